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

/// llama.cpp's final estimate: `Final estimate: PPL = 16.2907 +/- 0.56480`.
fn llama_perplexity(bin: &Path, gguf: &Path) -> f64 {
    llama_perplexity_on(bin, gguf, Path::new(TEXT))
}

fn llama_perplexity_on(bin: &Path, gguf: &Path, text: &Path) -> f64 {
    let out = Command::new(bin.join("llama-perplexity"))
        .arg("-m")
        .arg(gguf)
        .arg("-f")
        .arg(text)
        .args(["-c", CTX, "-b", CTX, "-t", "2", "--no-warmup"])
        .output()
        .expect("run llama-perplexity");
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "llama-perplexity failed:\n{text}");
    text.lines()
        .find_map(|l| l.split("Final estimate: PPL = ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no final estimate in:\n{text}"))
}

fn xdna(args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(args)
        .env_remove("XDNA_BACKEND")
        .output()
        .expect("run xdna")
}

fn xdna_perplexity(gguf: &Path) -> f64 {
    xdna_perplexity_on(gguf, Path::new(TEXT))
}

fn xdna_perplexity_on(gguf: &Path, text: &Path) -> f64 {
    let out = xdna(&[
        "perplexity".as_ref(),
        "--model".as_ref(),
        gguf.as_os_str(),
        "--file".as_ref(),
        text.as_os_str(),
        "--ctx".as_ref(),
        CTX.as_ref(),
        "--backend".as_ref(),
        "host".as_ref(),
        "--json".as_ref(),
    ]);
    assert!(
        out.status.success(),
        "xdna perplexity failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    v["ppl"].as_f64().expect("ppl")
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

/// Both runtimes on one file: the relative gap of xdna's perplexity from llama.cpp's.
fn gap(bin: &Path, gguf: &Path, what: &str) -> f64 {
    let theirs = llama_perplexity(bin, gguf);
    let ours = xdna_perplexity(gguf);
    let gap = ours / theirs - 1.0;
    eprintln!(
        "{what}: llama-perplexity {theirs:.4}, xdna perplexity {ours:.4}, gap {:+.3} %",
        gap * 100.0
    );
    gap
}

#[test]
fn the_default_model_has_llama_cpps_perplexity() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let g = gap(&bin, &gguf, "Q4_1 (the default model's file)");
    assert!(g.abs() <= 0.005, "gap {:.3} %", g * 100.0);
}

#[test]
fn a_q8_0_file_from_llama_quantize_has_llama_cpps_perplexity() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let q8 = quantize(&bin, &gguf, "Q8_0");
    let g = gap(&bin, &q8, "Q8_0 (llama-quantize of the default model)");
    let _ = std::fs::remove_file(&q8);
    assert!(g.abs() <= 0.005, "gap {:.3} %", g * 100.0);
}

/// A shorter text (the first 15,000 bytes: 6 chunks of 512 tokens) for files whose matrices
/// take f32 activations, where the two runtimes differ only in summation order.
fn short_text(user: &str) -> PathBuf {
    let text = std::fs::read(TEXT).expect("read the text");
    // One copy per test: tests run in parallel and each removes its own.
    let path = std::env::temp_dir().join(format!(
        "xdna-llama-cpp-{}-{user}-short.txt",
        std::process::id()
    ));
    std::fs::write(&path, &text[..15_000.min(text.len())]).expect("write the short text");
    path
}

/// Perplexity of `gguf` on `text` from both runtimes, and the relative gap of ours.
fn gap_on(bin: &Path, gguf: &Path, text: &Path, what: &str) -> f64 {
    let theirs = llama_perplexity_on(bin, gguf, text);
    let ours = xdna_perplexity_on(gguf, text);
    let gap = ours / theirs - 1.0;
    eprintln!(
        "{what}: llama-perplexity {theirs:.4}, xdna perplexity {ours:.4}, gap {:+.3} %",
        gap * 100.0
    );
    gap
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

/// Every GGUF weight type the host backend reads but Q2_K, in files llama-quantize writes
/// without an importance matrix, each preset with its own mix (SmolLM2's K = 576 rows are not
/// whole 256-value super-blocks, so K-quant presets fall back to Q4_0 / Q5_0 / Q5_1 / Q8_0 /
/// IQ4_NL there and put K-quants in ffn_down only): within 0.5 % of llama.cpp's perplexity on the
/// same file and text. Quantized files are read on the whole text: both runtimes round activations
/// to 8 bits, differently (llama.cpp per 256 values for K-quants, xdna per 32), which on 6 chunks
/// alone moves the ratio by up to ±0.7 %, on 26 chunks by about ±0.3 %.
///
/// Q2_K is read but not checked here: its only file (`Q2_K --pure`, q2_K in ffn_down) is 1.92 %
/// below llama.cpp, outside the bound (the same weights in f32 give 88.355; xdna +0.65 % above
/// them, llama.cpp +2.62 %); an open gap of the GGUF weight-types issue.
#[test]
fn files_of_every_read_weight_type_have_llama_cpps_perplexity() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let long = PathBuf::from(TEXT);
    let short = short_text("types");
    let mut failed = Vec::new();
    let mut covered = std::collections::BTreeSet::new();
    // (preset, llama-quantize options, text): which types each file holds is asserted below.
    let files: [(&str, &[&str], &Path); 7] = [
        ("Q2_K", &[], &long),
        ("Q4_K_M", &[], &long),
        ("Q5_K_M", &[], &long),
        ("IQ4_XS", &[], &long),
        ("F16", &[], &short),
        ("BF16", &[], &short),
        ("F32", &[], &short),
    ];
    for (preset, options, text) in files {
        let f = quantize_with(&bin, &gguf, preset, options);
        let mut counts = std::collections::BTreeMap::<String, usize>::new();
        for ty in matrix_types(&f) {
            *counts.entry(ty).or_default() += 1;
        }
        let what = format!("{preset} {}(matrices {counts:?})", options.join(" "));
        covered.extend(counts.into_keys());
        let gap = gap_on(&bin, &f, text, &what);
        if gap.abs() > 0.005 {
            failed.push(format!("{what}: {:+.3} %", gap * 100.0));
        }
        let _ = std::fs::remove_file(&f);
    }
    let _ = std::fs::remove_file(&short);
    assert!(failed.is_empty(), "gaps over 0.5 %: {failed:?}");
    // Q4_1 and Q8_0 files have their own tests above.
    for ty in [
        "f32", "f16", "bf16", "q4_0", "q5_0", "q5_1", "q8_0", "q3_K", "q4_K", "q5_K", "q6_K",
        "iq4_nl", "iq4_xs",
    ] {
        assert!(
            covered.contains(ty),
            "no file held {ty} matrices: {covered:?}"
        );
    }
}

/// A random-weight GGUF of `arch` written by llama.cpp's own writer (gguf-py, beside the
/// programs) with the default model's tokenizer: `tools/llama-cpp/random_gguf.py`.
fn random_family_gguf(bin: &Path, tokenizer_from: &Path, arch: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!(
        "xdna-llama-cpp-{}-random-{arch}.gguf",
        std::process::id()
    ));
    let gguf_py = bin.parent().expect("bin has a parent").join("gguf-py");
    let run = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tools/llama-cpp/random_gguf.py"
        ))
        .args(["--arch", arch, "--tokenizer-from"])
        .arg(tokenizer_from)
        .arg("--out")
        .arg(&out)
        .env("PYTHONPATH", &gguf_py)
        .output()
        .expect("run python3");
    assert!(
        run.status.success(),
        "random_gguf.py --arch {arch} failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    out
}

/// The attention families from llama.cpp's writer: llama (rotary rows interleaved in the file),
/// qwen2 (q/k/v bias, rows in Hugging Face order) and qwen3 (q/k RMS norm), random weights
/// strong enough that every family-specific part moves the predictions (dropping qwen2's bias
/// moves its perplexity by 5 %): within 1 % of llama.cpp's perplexity, in f32 and as
/// llama-quantize's Q4_K_M (hidden 256: real q4_K / q6_K in every matrix).
#[test]
fn random_models_of_each_family_have_llama_cpps_perplexity() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    let text = short_text("families");
    let mut failed = Vec::new();
    for arch in ["llama", "qwen2", "qwen3"] {
        let f32_file = random_family_gguf(&bin, &gguf, arch);
        let q4_k_m = quantize(&bin, &f32_file, "Q4_K_M");
        for (file, what) in [(&f32_file, "f32"), (&q4_k_m, "Q4_K_M")] {
            let what = format!("random {arch} {what}");
            let g = gap_on(&bin, file, &text, &what);
            if g.abs() > 0.01 {
                failed.push(format!("{what}: {:+.3} %", g * 100.0));
            }
        }
        if arch == "qwen3" {
            assert!(
                matrix_types(&q4_k_m).iter().any(|t| t == "q4_K"),
                "the Q4_K_M file holds no q4_K matrix"
            );
        }
        let _ = std::fs::remove_file(&f32_file);
        let _ = std::fs::remove_file(&q4_k_m);
    }
    let _ = std::fs::remove_file(&text);
    assert!(failed.is_empty(), "gaps over 1 %: {failed:?}");
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
