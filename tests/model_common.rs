// Shared helpers of the model integration tests (included with `#[path]`).
#![allow(dead_code)]

#[path = "support/smollm2.rs"]
mod smollm2;

use std::path::PathBuf;
use std::sync::Arc;
use xdna::model::load::{load, open_package, LoadOptions};
use xdna::model::Model;
use xdna::weights::Package;

/// The real SmolLM2 GGUF (see `support/smollm2.rs`).
pub fn smollm2_gguf() -> Option<PathBuf> {
    smollm2::smollm2_gguf()
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
