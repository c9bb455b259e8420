//! The default model against llama.cpp, the independent implementation: `llama-perplexity` and
//! `xdna perplexity` on the same GGUF file and text give the same perplexity; `llama-quantize`'s
//! files of every weight type this runtime reads (each preset's mix) are read alike, and those of
//! other types are refused naming a tensor and its type; random-weight files of each attention
//! family written by llama.cpp's own GGUF writer are read alike.
//!
//! llama.cpp comes from `tools/llama-cpp/build.sh` (the source vendored in the PyPI
//! llama-cpp-python sdist), which `.ci/run` runs and points `XDNA_LLAMA_CPP_BIN` at. Without it
//! the tests skip loudly; under CI they fail.

#[path = "support/smollm2.rs"]
mod smollm2;

use std::path::{Path, PathBuf};
use std::process::Command;
use xdna::model::kl_divergence::{compare_with_saved, LogitsComparison, SavedLogits};

fn llama_cpp_bin() -> Option<PathBuf> {
    match std::env::var_os("XDNA_LLAMA_CPP_BIN") {
        Some(d) => {
            let d = PathBuf::from(d);
            assert!(
                d.join("llama-perplexity").is_file(),
                "XDNA_LLAMA_CPP_BIN={} holds no llama-perplexity",
                d.display()
            );
            Some(d)
        }
        None if std::env::var_os("CI").is_some() => {
            panic!("XDNA_LLAMA_CPP_BIN is unset under CI (.ci/run builds llama.cpp and sets it)")
        }
        None => {
            eprintln!("\n!!!!!!!! SKIPPED: llama.cpp unavailable; run tools/llama-cpp/build.sh and set XDNA_LLAMA_CPP_BIN !!!!!!!!\n");
            None
        }
    }
}

/// GPL-3.0, Apache-2.0 and MPL-2.0 verbatim (Debian's `/usr/share/common-licenses`): 13,523 tokens,
/// 26 chunks of 512, 6,630 scored. A shorter text cannot tell the runtimes apart: on
/// `licenses.txt` (441 scored tokens) the paired per-token differences leave a standard error of
/// ~0.9 % on the ratio, from the q8 rounding of activations alone.
const TEXT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/licenses-long.txt");
const CTX: &str = "512";

/// How llama-perplexity runs: as a user runs it (flash attention and the f16 KV cache it
/// chooses), or exactly (no flash attention, f32 KV cache) for a file of dequantized f32 weights,
/// where nothing is rounded but the summation order: the exact forward of the weights.
#[derive(Clone, Copy, Debug, PartialEq)]
enum LlamaRun {
    AsUsersRunIt,
    Exact,
}

/// A llama-perplexity run: its final estimate and the logits it saved
/// (`--kl-divergence-base`), removed on drop.
struct LlamaSaved {
    ppl: f64,
    logits: PathBuf,
}

impl Drop for LlamaSaved {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.logits);
    }
}

/// llama.cpp's final estimate (`Final estimate: PPL = 16.2907 +/- 0.56480`) of `gguf` on `text`,
/// saving every scored row's log-probabilities.
fn llama_perplexity_saving(
    bin: &Path,
    gguf: &Path,
    text: &Path,
    ctx: &str,
    run: LlamaRun,
) -> LlamaSaved {
    let logits = std::env::temp_dir().join(format!(
        "xdna-llama-cpp-{}-{}-{run:?}.logits",
        std::process::id(),
        gguf.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    let mut cmd = Command::new(bin.join("llama-perplexity"));
    cmd.arg("-m")
        .arg(gguf)
        .arg("-f")
        .arg(text)
        .args(["-c", ctx, "-b", ctx, "-t", "2", "--no-warmup"])
        .arg("--kl-divergence-base")
        .arg(&logits);
    if run == LlamaRun::Exact {
        cmd.args(["-fa", "off", "-ctk", "f32", "-ctv", "f32"]);
    }
    let out = cmd.output().expect("run llama-perplexity");
    // Removes the file on every exit from here on.
    let mut saved = LlamaSaved { ppl: 0.0, logits };
    saved.ppl = final_estimate(&out);
    saved
}

/// The `Final estimate: PPL = 16.2907 +/- 0.56480` of a finished llama-perplexity run.
fn final_estimate(out: &std::process::Output) -> f64 {
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "llama-perplexity failed:\n{text}");
    text.lines()
        .find_map(|l| l.split("Final estimate: PPL = ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no final estimate in:\n{text}"))
}

/// The perplexity of the exact forward of `gguf`'s weights on `text` (chunks of 512): the file
/// dequantized to f32 by llama-quantize and run by llama-perplexity with nothing rounded (no
/// flash attention, f32 KV cache, f32 activations).
fn exact_perplexity(bin: &Path, gguf: &Path, text: &Path) -> f64 {
    let dequantized = quantize(bin, gguf, "F32");
    let out = Command::new(bin.join("llama-perplexity"))
        .arg("-m")
        .arg(&dequantized)
        .arg("-f")
        .arg(text)
        .args(["-c", CTX, "-b", CTX, "-t", "2", "--no-warmup"])
        .args(["-fa", "off", "-ctk", "f32", "-ctv", "f32"])
        .output()
        .expect("run llama-perplexity");
    let _ = std::fs::remove_file(&dequantized);
    final_estimate(&out)
}

fn xdna(args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(args)
        .env_remove("XDNA_BACKEND")
        .output()
        .expect("run xdna")
}

/// `xdna perplexity --kl-divergence-base` on the host backend: this runtime on the tokens and
/// chunks llama.cpp saved, compared row by row (with `text`, its tokenization is checked against
/// the saved tokens). Its JSON; it exits 1 when a confident row's top-1 differs, after printing.
fn xdna_against(gguf: &Path, saved: &Path, text: Option<&Path>, exact: bool) -> serde_json::Value {
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "perplexity".as_ref(),
        "--model".as_ref(),
        gguf.as_os_str(),
        "--kl-divergence-base".as_ref(),
        saved.as_os_str(),
        "--backend".as_ref(),
        "host".as_ref(),
        "--json".as_ref(),
    ];
    if let Some(t) = text {
        args.extend(["--file".as_ref(), t.as_os_str()]);
    }
    if exact {
        args.push("--exact".as_ref());
    }
    let out = xdna(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() || err.contains("top-1 token differs"),
        "xdna perplexity failed: {err}"
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("JSON ({e}): {err}"))
}

/// Two llama.cpp runs, `other` against `base` over `base`'s chunks (`other` may hold more, of
/// a longer text with the same beginning; rows of log-probabilities are logits), through the same
/// comparison `xdna perplexity --kl-divergence-base` makes.
fn saved_against_saved(base: &Path, other: &Path) -> LogitsComparison {
    let mut a = SavedLogits::open(base).unwrap_or_else(|e| panic!("{e}"));
    let mut b = SavedLogits::open(other).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        a.n_ctx == b.n_ctx && b.tokens.starts_with(&a.tokens),
        "the two runs evaluated different tokens"
    );
    let n_vocab = b.n_vocab;
    let mut rows = Vec::new();
    compare_with_saved(
        &mut a,
        None,
        MARGIN,
        &mut |_, first, sink| {
            b.read_chunk_log_probs(&mut rows)?;
            for (r, row) in rows.chunks(n_vocab).enumerate() {
                sink(first + r, row);
            }
            Ok(())
        },
        &mut |_, _| {},
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The issue's greedy criterion: llama.cpp's top-2 margin above which the top-1 tokens must agree.
const MARGIN: f32 = 0.1;

fn confident_flips(v: &serde_json::Value) -> u64 {
    v["confident_disagreement_count"].as_u64().expect("count")
}

fn mean_kld(v: &serde_json::Value) -> f64 {
    v["mean_kld"].as_f64().expect("mean_kld")
}

/// `llama-quantize --allow-requantize SRC DST TYPE`.
fn quantize(bin: &Path, src: &Path, ty: &str) -> PathBuf {
    quantize_with(bin, src, ty, &[])
}

/// `llama-quantize --allow-requantize [OPTIONS] SRC DST TYPE`.
fn quantize_with(bin: &Path, src: &Path, ty: &str, options: &[&str]) -> PathBuf {
    // Tests run in parallel: the name holds the source and the options.
    let source = src.file_stem().map(|s| s.to_string_lossy().into_owned());
    let tag = options.concat().replace('-', "");
    let dst = std::env::temp_dir().join(format!(
        "xdna-llama-cpp-{}-{}-{ty}{tag}.gguf",
        std::process::id(),
        source.unwrap_or_default()
    ));
    let out = Command::new(bin.join("llama-quantize"))
        .arg("--allow-requantize")
        .args(options)
        .arg(src)
        .arg(&dst)
        .arg(ty)
        .output()
        .expect("run llama-quantize");
    assert!(
        out.status.success(),
        "llama-quantize {ty} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dst
}

/// One file in both runtimes, on the same tokens.
struct FileCheck {
    what: String,
    /// llama-perplexity's final estimate.
    llama_ppl: f64,
    /// xdna's perplexity over llama-perplexity's, minus 1.
    gap: f64,
    /// xdna against llama-perplexity as users run it on the same file.
    against_llama: serde_json::Value,
    /// xdna's fast path against the exact forward of the same weights.
    xdna_from_exact: serde_json::Value,
    /// llama.cpp's own run of the file against the same exact forward.
    llama_from_exact: LogitsComparison,
}

impl FileCheck {
    fn report(&self) {
        let x = &self.xdna_from_exact;
        let l = &self.llama_from_exact;
        eprintln!(
            "{}: llama-perplexity {:.4}, xdna {:.4}, gap {:+.3} %; top-1 differs where llama.cpp's \
             margin > {MARGIN}: {} of {}; from the exact forward: xdna KLD {:.6}, same top-1 {}, \
             confident flips {}; llama.cpp KLD {:.6}, same top-1 {}, confident flips {}",
            self.what,
            self.llama_ppl,
            self.against_llama["ppl"].as_f64().unwrap_or(f64::NAN),
            self.gap * 100.0,
            confident_flips(&self.against_llama),
            self.against_llama["confident_rows"],
            mean_kld(x),
            x["same_top"],
            confident_flips(x),
            l.mean_kld,
            l.same_top,
            l.confident_disagreement_count,
        );
    }

    /// What is out of bounds: a perplexity gap over `bound`, or xdna's fast path farther from
    /// the exact forward than llama.cpp's own run of the file (KL divergence over 1.1 × its).
    fn failures(&self, bound: f64) -> Vec<String> {
        let mut failed = Vec::new();
        if self.gap.abs() > bound {
            failed.push(format!(
                "{}: perplexity gap {:+.3} %",
                self.what,
                self.gap * 100.0
            ));
        }
        let (ours, theirs) = (
            mean_kld(&self.xdna_from_exact),
            self.llama_from_exact.mean_kld,
        );
        if ours > 1.1 * theirs + 1e-5 {
            failed.push(format!(
                "{}: KL divergence from the exact forward {ours:.6}, llama.cpp's {theirs:.6}",
                self.what
            ));
        }
        failed
    }
}

/// Both runtimes on `gguf` and `text` (chunks of 512): the perplexity gap on the same tokens
/// (xdna runs llama.cpp's saved tokens and checks its own tokenization of `text` against them),
/// and each runtime against the exact forward of the same weights on the first 15,000 bytes
/// (6 chunks, 1,530 rows: the mean KL divergence is known to a few per cent there): the file
/// dequantized to f32 by llama-quantize and run by llama-perplexity with nothing rounded.
fn check_file(bin: &Path, gguf: &Path, text: &Path, what: &str) -> FileCheck {
    let theirs = llama_perplexity_saving(bin, gguf, text, CTX, LlamaRun::AsUsersRunIt);
    let against_llama = xdna_against(gguf, &theirs.logits, Some(text), false);
    let ours = against_llama["ppl"].as_f64().expect("ppl");
    let dequantized = quantize(bin, gguf, "F32");
    let stem = gguf.file_stem().map(|s| s.to_string_lossy().into_owned());
    let head = text_head(&stem.unwrap_or_default(), 15_000);
    let exact = llama_perplexity_saving(bin, &dequantized, &head, CTX, LlamaRun::Exact);
    let _ = std::fs::remove_file(&dequantized);
    let _ = std::fs::remove_file(&head);
    let xdna_from_exact = xdna_against(gguf, &exact.logits, None, false);
    let llama_from_exact = saved_against_saved(&exact.logits, &theirs.logits);
    let check = FileCheck {
        what: what.to_string(),
        llama_ppl: theirs.ppl,
        gap: ours / theirs.ppl - 1.0,
        against_llama,
        xdna_from_exact,
        llama_from_exact,
    };
    check.report();
    check
}

/// The first `bytes` of the text in a file of its own (tests run in parallel and each removes
/// its own).
fn text_head(user: &str, bytes: usize) -> PathBuf {
    let text = std::fs::read(TEXT).expect("read the text");
    let path = std::env::temp_dir().join(format!(
        "xdna-llama-cpp-{}-{user}-head.txt",
        std::process::id()
    ));
    std::fs::write(&path, &text[..bytes.min(text.len())]).expect("write the short text");
    path
}

/// The default model's file: its perplexity within 0.5 % of llama.cpp's, and no farther from the
/// exact forward than llama.cpp's own run. The exact path (`--exact`: f32 activations, f64 sums)
/// against llama.cpp's exact run of the same weights (2 chunks of 256): the same distribution to
/// 1e-4 nats and the same top-1 token in every row where llama.cpp's margin exceeds 0.1 nat.
#[test]
fn the_default_model_has_llama_cpps_perplexity() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let c = check_file(
        &bin,
        &gguf,
        Path::new(TEXT),
        "Q4_1 (the default model's file)",
    );
    let mut failed = c.failures(0.005);
    let head = text_head("default", 3_000);
    let dequantized = quantize(&bin, &gguf, "F32");
    let exact = llama_perplexity_saving(&bin, &dequantized, &head, "256", LlamaRun::Exact);
    let _ = std::fs::remove_file(&dequantized);
    let e = xdna_against(&gguf, &exact.logits, Some(&head), true);
    let _ = std::fs::remove_file(&head);
    eprintln!(
        "exact path against llama.cpp's exact forward: {} rows, KLD {:.2e} (max {:.2e}), same top-1 {}, confident flips {}",
        e["rows"], mean_kld(&e), e["max_kld"].as_f64().unwrap_or(f64::NAN), e["same_top"], confident_flips(&e)
    );
    if confident_flips(&e) > 0 || mean_kld(&e) > 1e-4 {
        failed.push(format!(
            "the exact path differs from llama.cpp's exact forward: {e}"
        ));
    }
    assert!(failed.is_empty(), "{failed:?}");
}

#[test]
fn a_q8_0_file_from_llama_quantize_has_llama_cpps_perplexity() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let q8 = quantize(&bin, &gguf, "Q8_0");
    let c = check_file(
        &bin,
        &q8,
        Path::new(TEXT),
        "Q8_0 (llama-quantize of the default model)",
    );
    let _ = std::fs::remove_file(&q8);
    let failed = c.failures(0.005);
    assert!(failed.is_empty(), "{failed:?}");
}

/// The ggml types of a GGUF file's matrices, from `xdna pack info --json`.
fn matrix_types(gguf: &Path) -> Vec<String> {
    let out = xdna(&[
        "pack".as_ref(),
        "info".as_ref(),
        "--json".as_ref(),
        gguf.as_os_str(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["imports"], true, "{}: {}", gguf.display(), v["refusal"]);
    v["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .filter(|t| t["shape"].as_array().is_some_and(|s| s.len() == 2))
        .map(|t| t["type"].as_str().expect("type").to_string())
        .collect()
}

/// `xdna bench load --backend host`: the peak RSS of loading, prefilling and decoding a few
/// tokens, over the weight bytes.
fn peak_rss_over_weights(gguf: &Path) -> f64 {
    let out = xdna(&[
        "bench".as_ref(),
        "load".as_ref(),
        "--model".as_ref(),
        gguf.as_os_str(),
        "--backend".as_ref(),
        "host".as_ref(),
        "--json".as_ref(),
    ]);
    assert!(
        out.status.success(),
        "xdna bench load failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    v["peak_rss_over_weights"]
        .as_f64()
        .expect("peak_rss_over_weights")
}

/// Every GGUF weight type the host backend reads, in files llama-quantize writes without an
/// importance matrix, each preset with its own mix (SmolLM2's K = 576 rows are not whole
/// 256-value super-blocks, so K-quant presets fall back to Q4_0 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL
/// there and put K-quants in ffn_down only; `Q2_K --pure` puts q2_K in it): within 0.5 % of
/// llama.cpp's perplexity on the same file and tokens, and no farther from the exact forward of
/// the file's weights than llama.cpp's own run ([`FileCheck::failures`]); over the bound, the
/// perplexity of that exact forward on the same text is printed beside both; the peak RSS of a
/// load at most 1.3 × the weight bytes. Quantized files are read on the whole text: both
/// runtimes round activations to 8 bits with ggml's scale blocks (per 256 values for the
/// K-quants and IQ4_XS, per 32 otherwise), but not in the same arithmetic order, which on 6
/// chunks alone moves the ratio by a few tenths of a percent. With per-32 activation scales for
/// the K-quants, Q4_K_M was 0.60 % below llama.cpp on Zen 3 and `Q2_K --pure` 1.8 % (Zen 4) to 1.9 % (SPR) below:
/// this test is what holds the pairing.
///
/// The issue's greedy criterion (top-1 equal wherever llama.cpp's top-2 margin exceeds 0.1 nat)
/// is measured and printed, not asserted: rounding alone flips about 1 % of such rows between any
/// two runs (llama.cpp's own Q4_1 run with an f16 against an f32 KV cache differs in 18 of 1,434),
/// while the exact path meets it (the default model's test).
#[test]
fn files_of_every_read_weight_type_have_llama_cpps_perplexity() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let long = PathBuf::from(TEXT);
    let short = text_head("types", 15_000);
    let mut failed = Vec::new();
    let mut covered = std::collections::BTreeSet::new();
    // (preset, llama-quantize options, text): which types each file holds is asserted below.
    let files: [(&str, &[&str], &Path); 8] = [
        ("Q2_K", &[], &long),
        ("Q2_K", &["--pure"], &long),
        ("Q4_K_M", &[], &long),
        ("Q5_K_M", &[], &long),
        ("IQ4_XS", &[], &long),
        ("F16", &[], &short),
        ("BF16", &[], &short),
        ("F32", &[], &short),
    ];
    for (ty, options, text) in files {
        let f = quantize_with(&bin, &gguf, ty, options);
        let preset = format!(
            "{ty}{}",
            options.iter().map(|o| format!(" {o}")).collect::<String>()
        );
        let mut counts = std::collections::BTreeMap::<String, usize>::new();
        for ty in matrix_types(&f) {
            *counts.entry(ty).or_default() += 1;
        }
        let what = format!("{preset} (matrices {counts:?})");
        covered.extend(counts.into_keys());
        let c = check_file(&bin, &f, text, &what);
        // Over the bound, the weights' exact forward on the same text is printed beside both
        // runtimes (a diagnosis of which one is off; the bound still fails the test).
        if c.gap.abs() > 0.005 {
            let e = exact_perplexity(&bin, &f, text);
            eprintln!(
                "{preset}: exact forward {e:.4}; xdna {:+.3} %, llama.cpp {:+.3} % from it",
                (c.llama_ppl * (1.0 + c.gap) / e - 1.0) * 100.0,
                (c.llama_ppl / e - 1.0) * 100.0
            );
        }
        failed.extend(c.failures(0.005));
        let rss = peak_rss_over_weights(&f);
        eprintln!("{preset}: peak RSS {rss:.3} × the weight bytes");
        if rss > 1.3 {
            failed.push(format!(
                "{what}: peak RSS {rss:.3} × the weight bytes (bound 1.3)"
            ));
        }
        let _ = std::fs::remove_file(&f);
    }
    let _ = std::fs::remove_file(&short);
    assert!(failed.is_empty(), "{failed:?}");
    // Q4_1 and Q8_0 files have their own tests above.
    for ty in [
        "f32", "f16", "bf16", "q4_0", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K",
        "q6_K", "iq4_nl", "iq4_xs",
    ] {
        assert!(
            covered.contains(ty),
            "no file held {ty} matrices: {covered:?}"
        );
    }
}

/// `tools/llama-cpp/random_gguf.py ARGS --tokenizer-from TOKENIZER --out OUT`: a random-weight
/// GGUF written by llama.cpp's own writer (gguf-py, beside the programs) with the default
/// model's tokenizer.
fn random_gguf(bin: &Path, tokenizer_from: &Path, args: &[&str], out: &Path) {
    let gguf_py = bin.parent().expect("bin has a parent").join("gguf-py");
    let run = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tools/llama-cpp/random_gguf.py"
        ))
        .args(args)
        .arg("--tokenizer-from")
        .arg(tokenizer_from)
        .arg("--out")
        .arg(out)
        .env("PYTHONPATH", &gguf_py)
        .output()
        .expect("run python3");
    assert!(
        run.status.success(),
        "random_gguf.py {args:?} failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// A random-weight GGUF (`random_gguf.py ARGS`), named after `what`.
fn random_family_gguf(bin: &Path, tokenizer_from: &Path, what: &str, args: &[&str]) -> PathBuf {
    let out = std::env::temp_dir().join(format!(
        "xdna-llama-cpp-{}-random-{what}.gguf",
        std::process::id()
    ));
    random_gguf(bin, tokenizer_from, args, &out);
    out
}

/// The attention families from llama.cpp's writer: llama (rotary rows interleaved in the file),
/// qwen2 (q/k/v bias, rows in Hugging Face order) and qwen3 (q/k RMS norm), random weights
/// strong enough that every family-specific part moves the predictions (dropping qwen2's bias
/// moves its perplexity by 5 %): within 1 % of llama.cpp's perplexity, in f32 and as
/// llama-quantize's Q4_K_M (hidden 256: real q4_K / q6_K in every matrix). A llama file with
/// Llama 3.1 rope scaling as llama.cpp's converter writes it (`rope_freqs.weight`, original
/// context 64 so that most pairs are slowed 8×: reading it as plain RoPE moves the perplexity by
/// 3.9 % and flips the top-1 token of nearly every row) is checked in f32. The f32 files, where xdna rounds nothing, have the exact forward's
/// top-1 token in every row where its margin exceeds 0.1 nat.
#[test]
fn random_models_of_each_family_have_llama_cpps_perplexity() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let text = text_head("families", 15_000);
    let mut failed = Vec::new();
    let llama3_rope: &[&str] = &["--arch", "llama", "--llama3-rope", "8", "1", "4", "64"];
    for (family, args, quantized) in [
        ("llama", &["--arch", "llama"][..], true),
        ("qwen2", &["--arch", "qwen2"][..], true),
        ("qwen3", &["--arch", "qwen3"][..], true),
        ("llama-rope-freqs", llama3_rope, false),
    ] {
        let f32_file = random_family_gguf(&bin, &gguf, family, args);
        let q4_k_m = quantized.then(|| quantize(&bin, &f32_file, "Q4_K_M"));
        for (file, what) in
            std::iter::once((&f32_file, "f32")).chain(q4_k_m.as_ref().map(|q| (q, "Q4_K_M")))
        {
            let what = format!("random {family} {what}");
            let c = check_file(&bin, file, &text, &what);
            failed.extend(c.failures(0.01));
            if file == &f32_file && confident_flips(&c.xdna_from_exact) > 0 {
                failed.push(format!(
                    "{what}: top-1 differs from the exact forward: {}",
                    c.xdna_from_exact
                ));
            }
        }
        if let (Some(q), "qwen3") = (&q4_k_m, family) {
            assert!(
                matrix_types(q).iter().any(|t| t == "q4_K"),
                "the Q4_K_M file holds no q4_K matrix"
            );
        }
        let _ = std::fs::remove_file(&f32_file);
        if let Some(q) = q4_k_m {
            let _ = std::fs::remove_file(q);
        }
    }
    let _ = std::fs::remove_file(&text);
    assert!(failed.is_empty(), "{failed:?}");
}

#[test]
fn files_of_types_not_read_are_refused_naming_a_tensor_and_its_type() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    // TQ2_0 (ternary) puts tq2_0 in ffn_down (K = 1536) and q4_0 elsewhere.
    let f = quantize(&bin, &gguf, "TQ2_0");
    let out = xdna(&[
        "run".as_ref(),
        "--model".as_ref(),
        f.as_os_str(),
        "--prompt".as_ref(),
        "Hello".as_ref(),
        "--max-tokens".as_ref(),
        "2".as_ref(),
        "--backend".as_ref(),
        "host".as_ref(),
    ]);
    let _ = std::fs::remove_file(&f);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "TQ2_0: accepted");
    assert!(
        err.contains("ffn_down"),
        "the refusal names no tensor: {err}"
    );
    assert!(
        err.contains("ggml type tq2_0 cannot be imported"),
        "the refusal does not name the type: {err}"
    );
    assert!(
        err.contains("q6_K") && err.contains("iq4_xs"),
        "the refusal does not say what is read: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// A varied text (contractions in both cases, digit runs, code, tabs and whitespace runs, CR LF
/// and a lone CR, accented and decomposed letters, Greek, Cyrillic, CJK, Hangul, Arabic, Hebrew,
/// Devanagari and other scripts with combining marks, full-width forms, emoji with modifiers and
/// joiners, zero-width and non-breaking spaces, no final newline).
const VARIED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/tokenizer-varied.txt"
);

/// `llama-tokenize --ids` of `text` with the vocabulary of `gguf` (no BOS, no escapes).
fn llama_tokenize(bin: &Path, gguf: &Path, text: &Path) -> Vec<u32> {
    let out = Command::new(bin.join("llama-tokenize"))
        .arg("-m")
        .arg(gguf)
        .arg("-f")
        .arg(text)
        .args(["--ids", "--no-bos", "--no-escape", "--log-disable"])
        .output()
        .expect("run llama-tokenize");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "llama-tokenize failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('['))
        .unwrap_or_else(|| panic!("no id list in: {stdout}"));
    serde_json::from_str(list).unwrap_or_else(|e| panic!("{e}: {list}"))
}

/// A one-layer random llama GGUF with the default model's vocabulary and merges and the
/// pre-tokenizer `pre` (`random_gguf.py --pre`).
fn vocabulary_file(bin: &Path, gguf: &Path, pre: &str) -> PathBuf {
    let file = std::env::temp_dir().join(format!(
        "xdna-llama-cpp-{}-pre-{pre}.gguf",
        std::process::id()
    ));
    let one_small_layer = [
        "--arch",
        "llama",
        "--pre",
        pre,
        "--layers",
        "1",
        "--hidden",
        "64",
        "--ffn",
        "64",
        "--heads",
        "1",
        "--kv-heads",
        "1",
        "--head-dim",
        "64",
    ];
    random_gguf(bin, gguf, &one_small_layer, &file);
    file
}

/// Every `tokenizer.ggml.pre` the import reads, in a file with the default model's vocabulary
/// and merges and that pre-tokenizer (llama.cpp's writer, `random_gguf.py --pre`): the token ids
/// of the varied text, and of the licences text, equal llama.cpp's own tokenizer's, id for id.
/// The first differing position is named with the text around it.
#[test]
fn every_pre_tokenizer_splits_as_llama_cpps() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let mut failed = Vec::new();
    for pre in [
        "smollm",
        "starcoder",
        "refact",
        "command-r",
        "llama-bpe",
        "llama3",
        "llama-v3",
        "falcon3",
        "pixtral",
        "qwen2",
        "deepseek-r1-qwen",
        "qwen35",
        "gpt-2",
        "default",
    ] {
        let file = vocabulary_file(&bin, &gguf, pre);
        let pkg = xdna::weights::Package::open(&file).unwrap_or_else(|e| panic!("{pre}: {e}"));
        for text in [VARIED, TEXT] {
            let theirs = llama_tokenize(&bin, &file, Path::new(text));
            let content = std::fs::read_to_string(text).expect("read the text");
            let ours = pkg.tokenizer().encode(&content, false);
            if let Some(at) =
                (0..ours.len().max(theirs.len())).find(|&i| ours.get(i) != theirs.get(i))
            {
                let piece = |ids: &[u32]| {
                    let lo = at.saturating_sub(3);
                    let hi = (at + 3).min(ids.len());
                    format!("{:?}", pkg.tokenizer().decode(&ids[lo.min(hi)..hi]))
                };
                failed.push(format!(
                    "pre {pre}, {}: {} ids here, {} in llama.cpp; first difference at {at}: {:?} vs {:?} (here {}, llama.cpp {})",
                    Path::new(text).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
                    ours.len(),
                    theirs.len(),
                    ours.get(at),
                    theirs.get(at),
                    piece(&ours),
                    piece(&theirs),
                ));
            }
        }
        let _ = std::fs::remove_file(&file);
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    // A name neither reads is refused naming the key and the name, as llama.cpp refuses it.
    let file = vocabulary_file(&bin, &gguf, "no-such-pre");
    let refused = xdna::weights::Package::open(&file)
        .err()
        .map(|e| e.to_string());
    let _ = std::fs::remove_file(&file);
    let refused = refused.expect("an unknown pre-tokenizer was accepted");
    assert!(
        refused.contains("tokenizer.ggml.pre") && refused.contains("no-such-pre"),
        "{refused}"
    );
}

/// `xdna run --backend host` greedy: the generated text (stdout).
fn greedy_run(model: &Path, prompt: &str, draft: Option<&Path>) -> String {
    let mut args: Vec<std::ffi::OsString> = vec![
        "run".into(),
        "--model".into(),
        model.into(),
        "--prompt".into(),
        prompt.into(),
        "--max-tokens".into(),
        "40".into(),
        "--backend".into(),
        "host".into(),
    ];
    if let Some(d) = draft {
        let mut spec = std::ffi::OsString::from("draft:");
        spec.push(d);
        args.extend(["--speculate".into(), spec, "--no-fallback".into()]);
    }
    let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let out = xdna(&refs);
    assert!(
        out.status.success(),
        "xdna run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// llama-quantize's Q4_K_M of the default model as users run such a file: `xdna run` generates
/// from it; as the draft of the default model (`--speculate draft:FILE`) the text is the default
/// model's plain greedy text, and with the default model drafting for it, its own.
#[test]
fn a_q4_k_m_file_generates_and_drafts_with_the_plain_greedy_text() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let q = quantize(&bin, &gguf, "Q4_K_M");
    let prompt = "The three laws of thermodynamics say that";
    let plain_q = greedy_run(&q, prompt, None);
    let plain_default = greedy_run(&gguf, prompt, None);
    let drafted_by_q = greedy_run(&gguf, prompt, Some(&q));
    let drafting_for_q = greedy_run(&q, prompt, Some(&gguf));
    let _ = std::fs::remove_file(&q);
    eprintln!("Q4_K_M: {plain_q:?}\ndefault: {plain_default:?}");
    assert!(plain_q.trim().len() > 20, "{plain_q:?}");
    assert_eq!(drafted_by_q, plain_default);
    assert_eq!(drafting_for_q, plain_q);
}

/// llama-quantize's Q4_0 file: its q4_0 matrices are stored as q4_1 tiles with f16 scales
/// (min = −8·d, exact), so every value of the package equals ggml's dequantization of the
/// file's row (`GgufTensor::decode_row`), and the file runs on the q4_1 kernels.
#[test]
fn q4_0_matrices_become_q4_1_tiles_with_the_same_values() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let q = quantize(&bin, &gguf, "Q4_0");
    let file = xdna::weights::gguf::GgufFile::open(&q).unwrap_or_else(|e| panic!("{e}"));
    let pkg = xdna::weights::Package::open(&q).unwrap_or_else(|e| panic!("{e}"));
    let source = file
        .tensor("blk.3.attn_output.weight")
        .expect("attn_output");
    assert_eq!(source.ggml_type.name(), "q4_0");
    let view = pkg
        .matrix("model.layers.3.self_attn.o_proj.weight", 576, 576)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        view.format.name().starts_with("q41"),
        "{}",
        view.format.name()
    );
    let (mut ours, mut theirs) = (vec![0f32; 576], vec![0f32; 576]);
    for r in 0..576 {
        xdna::tiles::decode_row(view.format, view.data, 576, 576, r, &mut ours)
            .unwrap_or_else(|e| panic!("{e}"));
        source
            .decode_row(r, &mut theirs)
            .unwrap_or_else(|e| panic!("{e}"));
        // Equal values (a zero may carry the other sign: (8 − 8)·d against 8·d − 8·d).
        if let Some(c) = (0..576).find(|&c| ours[c] != theirs[c]) {
            panic!(
                "row {r} column {c}: {} here, {} in ggml",
                ours[c], theirs[c]
            );
        }
    }
    drop(pkg);
    let _ = std::fs::remove_file(&q);
}
