//! The default model against llama.cpp, the independent implementation: `llama-perplexity` and
//! `xdna perplexity` on the same GGUF file and text give the same perplexity; `llama-quantize`'s
//! files of the types this runtime reads are read alike, and those of other types are refused
//! naming a tensor and its type.
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
    let out = Command::new(bin.join("llama-perplexity"))
        .arg("-m")
        .arg(gguf)
        .arg("-f")
        .arg(TEXT)
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
    let out = xdna(&[
        "perplexity".as_ref(),
        "--model".as_ref(),
        gguf.as_os_str(),
        "--file".as_ref(),
        TEXT.as_ref(),
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
    let dst = std::env::temp_dir().join(format!("xdna-llama-cpp-{}-{ty}.gguf", std::process::id()));
    let out = Command::new(bin.join("llama-quantize"))
        .arg("--allow-requantize")
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

#[test]
fn files_of_types_not_read_yet_are_refused_naming_a_tensor_and_its_type() {
    let (Some(bin), Some(gguf)) = (llama_cpp_bin(), smollm2::smollm2_gguf()) else {
        return;
    };
    // (preset, the ggml type the refusal must name; None: any type the import does not read,
    // since Q4_K_M mixes K-quants with fallbacks where a row is not a whole 256-value block)
    for (ty, named) in [
        ("Q4_0", Some("q4_0")),
        ("Q4_K_M", None),
        ("F16", Some("f16")),
    ] {
        let f = quantize(&bin, &gguf, ty);
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
        assert!(!out.status.success(), "{ty}: accepted");
        assert!(
            err.contains("blk.") || err.contains("token_embd") || err.contains("output"),
            "{ty}: the refusal names no tensor: {err}"
        );
        let refused = err
            .split("ggml type ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("{ty}: the refusal names no ggml type: {err}"));
        assert!(
            !["q4_1", "q8_0"].contains(&refused.to_lowercase().as_str())
                && named.is_none_or(|n| refused.eq_ignore_ascii_case(n)),
            "{ty}: refused as type {refused}: {err}"
        );
        assert!(
            err.contains("Q4_1 and Q8_0 are supported"),
            "{ty}: the refusal does not say what is read: {err}"
        );
        assert!(!err.contains("panicked"), "{ty}: {err}");
    }
}
