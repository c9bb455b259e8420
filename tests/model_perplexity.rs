//! Perplexity of the fast path against the reference forward on a plain English text.

#[path = "model_common.rs"]
mod common;

use xdna::model::perplexity::perplexity;
use xdna::model::reference::Reference;

/// Perplexity of `tests/data/licenses.txt` (all 7 full 128-token chunks, 441 scored tokens) through
/// the model (`exact` = the kernels layer's exact executor) and through the slow reference forward.
/// The whole text, not a prefix: on its first three chunks alone (189 scored tokens) the fast path's
/// estimate swings by ~1 % with last-bit changes of the f32 code (0.38 % … 0.71 % this week), while
/// the whole text stays at 0.40–0.44 %.
fn model_and_reference(exact: bool) -> Option<(f64, f64)> {
    let gguf = common::smollm2_gguf()?;
    let (pkg, mut model) = common::model_with(128, exact).unwrap();
    let text = include_str!("data/licenses.txt");
    let tokens = pkg.tokenizer().encode(text, false);
    let chunks = tokens.len() / 128;
    assert!(chunks >= 7, "{} tokens", tokens.len());
    let tokens = &tokens[..chunks * 128];
    let bos = if pkg.add_bos() {
        pkg.bos_token_id()
    } else {
        None
    };
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
    static REFERENCE: std::sync::OnceLock<(f64, usize)> = std::sync::OnceLock::new();
    let &(reference_ppl, reference_tokens) = REFERENCE.get_or_init(|| {
        let r = Reference::open(&gguf).unwrap();
        let reference = perplexity(
            tokens,
            128,
            bos,
            &mut |chunk, first, f| {
                for (i, l) in r.forward(chunk, first)?.iter().enumerate() {
                    f(first + i, l);
                }
                Ok(())
            },
            &mut |_, _| {},
        )
        .unwrap();
        (reference.ppl, reference.tokens)
    });
    assert_eq!(fast.tokens, reference_tokens);
    assert_eq!(fast.tokens, chunks * 63);
    // A sane English-text perplexity for a 135M model.
    assert!(
        reference_ppl > 1.0 && reference_ppl < 30.0,
        "{}",
        reference_ppl
    );
    let rel = (fast.ppl - reference_ppl).abs() / reference_ppl;
    eprintln!(
        "perplexity: reference {:.4}; model (exact projections: {exact}) {:.4} ({:.4} %)",
        reference_ppl,
        fast.ppl,
        100.0 * rel
    );
    Some((fast.ppl, reference_ppl))
}

/// The model layer's code (exact projections) within the 0.5 % (measured ~0.0001 %).
#[test]
fn exact_projection_perplexity_agrees_with_reference_within_half_a_percent() {
    let Some((model, reference)) = model_and_reference(true) else {
        return;
    };
    assert!(
        (model - reference).abs() / reference < 0.005,
        "model {model} vs reference {reference}"
    );
}

/// The fast q8-activation kernels against the same 0.5 % bound (measured 0.44 % on the whole text).
/// The margin is not robust: q8 activation rounding amplifies last-bit f32 changes (an eight-lane
/// SwiGLU `exp` within 4 ulp moved it to 1.74 %; docs/model.md), so if a change turns this red, the
/// fix is more precise activations, not a looser bound.
#[test]
fn fast_perplexity_agrees_with_reference_within_half_a_percent() {
    let Some((model, reference)) = model_and_reference(false) else {
        return;
    };
    assert!(
        (model - reference).abs() / reference < 0.005,
        "fast {model} vs reference {reference}"
    );
}
