//! Perplexity of the fast path against the reference forward on a plain English text.

#[path = "model_common.rs"]
mod common;

use xdna::model::perplexity::perplexity;
use xdna::model::reference::Reference;

/// Per-token agreement of a model run with the reference: mean |ΔNLL| over the scored tokens, and
/// the spread that implies for the perplexity ratio (std of ΔNLL / √n, as a relative change of
/// exp(mean NLL)): how far a perturbation that re-draws the per-token errors can move it.
fn per_token_agreement(model: &[f64], reference: &[f64]) -> (f64, f64) {
    assert_eq!(model.len(), reference.len());
    let n = model.len() as f64;
    let d: Vec<f64> = model.iter().zip(reference).map(|(a, b)| a - b).collect();
    let mean_abs = d.iter().map(|x| x.abs()).sum::<f64>() / n;
    let mean = d.iter().sum::<f64>() / n;
    let std = (d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    (mean_abs, std / n.sqrt())
}

/// Perplexity of `tests/data/licenses.txt` (all 7 full 128-token chunks, 441 scored tokens) through
/// the model (`exact` = the kernels layer's exact executor) and through the slow reference forward.
/// The whole text, not a prefix: on its first three chunks alone (189 scored tokens) the fast path's
/// estimate swings by ~1 % with last-bit changes of the f32 code (0.38 % … 0.71 % this week), while
/// the whole text stays at 0.40–0.44 %.
fn model_and_reference(exact: bool) -> Option<(f64, f64, f64)> {
    let gguf = common::smollm2_gguf()?;
    let (pkg, mut model) = common::model_with(128, exact).unwrap();
    let text = include_str!("data/licenses.txt");
    let tokens = pkg.tokenizer().encode(text, false);
    let chunks = tokens.len() / 128;
    assert!(chunks >= 7, "{} tokens", tokens.len());
    let tokens = &tokens[..chunks * 128];
    let bos = pkg.leading_bos();
    let fast = perplexity(
        tokens,
        128,
        bos,
        &mut |chunk, first, f| {
            model.reset();
            model.prefill_with(chunk, first, f)
        },
        &mut |_, _| {},
    )
    .unwrap();
    // The f64 reference is slow (~1.5 min for the whole text): computed once for both tests.
    static REFERENCE: std::sync::OnceLock<(f64, usize, Vec<f64>)> = std::sync::OnceLock::new();
    let (reference_ppl, reference_tokens, reference_nll) = REFERENCE.get_or_init(|| {
        let r = Reference::open(&gguf).unwrap();
        let reference = perplexity(
            tokens,
            128,
            bos,
            &mut |chunk, first, f| r.score_chunk(chunk, first, f),
            &mut |_, _| {},
        )
        .unwrap();
        (reference.ppl, reference.tokens, reference.token_nll)
    });
    let (reference_ppl, reference_tokens) = (*reference_ppl, *reference_tokens);
    assert_eq!(fast.tokens, reference_tokens);
    assert_eq!(fast.tokens, chunks * 63);
    // A sane English-text perplexity for a 135M model.
    assert!(
        reference_ppl > 1.0 && reference_ppl < 30.0,
        "{}",
        reference_ppl
    );
    let rel = (fast.ppl - reference_ppl).abs() / reference_ppl;
    let (mean_abs, spread) = per_token_agreement(&fast.token_nll, reference_nll);
    eprintln!(
        "perplexity: reference {:.4}; model (exact projections: {exact}) {:.4} ({:.4} %); \
         per token: mean |ΔNLL| {mean_abs:.5} nats, ppl spread ≈ {:.3} %",
        reference_ppl,
        fast.ppl,
        100.0 * rel,
        100.0 * spread
    );
    Some((fast.ppl, reference_ppl, mean_abs))
}

/// The model layer's code (exact projections) within the 0.5 % (measured ~0.0001 %).
#[test]
fn exact_projection_perplexity_agrees_with_reference_within_half_a_percent() {
    let Some((model, reference, mean_abs_nll)) = model_and_reference(true) else {
        return;
    };
    assert!(
        (model - reference).abs() / reference < 0.005,
        "model {model} vs reference {reference}"
    );
    // Per token, too: only f32-vs-f64 summation order differs.
    assert!(mean_abs_nll < 1e-3, "mean |ΔNLL| {mean_abs_nll}");
}

/// The fast q8-activation kernels against the same 0.5 % bound (measured 0.44 % on the whole text).
/// The margin is not robust: per token the fast path is ≈ 0.1 nats off the reference either way
/// (q8 activation rounding), and the perplexity ratio is the sum of those, with a spread of
/// ≈ 0.6 % — a last-bit f32 change re-draws it (an eight-lane SwiGLU `exp` within 4 ulp moved it to
/// 1.74 %; docs/model.md). On three longer licence texts the gap is +0.23 % ± 0.13 % pooled
/// (`xdna perplexity --compare-reference`, docs/model.md). If a change turns this red, measure it
/// there first; the fix is then more precise activations, not a looser bound. The per-token error
/// itself is bounded too: a bug (a RoPE sign, a KV offset) costs whole nats per token.
#[test]
fn fast_perplexity_agrees_with_reference_within_half_a_percent() {
    let Some((model, reference, mean_abs_nll)) = model_and_reference(false) else {
        return;
    };
    assert!(
        (model - reference).abs() / reference < 0.005,
        "fast {model} vs reference {reference}"
    );
    assert!(mean_abs_nll < 0.2, "mean |ΔNLL| {mean_abs_nll} nats");
}
