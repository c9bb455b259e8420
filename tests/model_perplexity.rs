//! Perplexity of the fast path against the reference forward on a plain English text.

#[path = "model_common.rs"]
mod common;

use xdna::model::perplexity::perplexity;
use xdna::model::reference::Reference;

/// Perplexity of the first three 128-token chunks of `tests/data/licenses.txt` through the model
/// (`exact` = the kernels layer's exact executor) and through the slow reference forward.
fn model_and_reference(exact: bool) -> Option<(f64, f64)> {
    let gguf = common::smollm2_gguf()?;
    let (pkg, mut model) = common::model_with(128, exact).unwrap();
    let text = include_str!("data/licenses.txt");
    let tokens = pkg.tokenizer().encode(text, false);
    assert!(tokens.len() >= 3 * 128, "{} tokens", tokens.len());
    // Three chunks of 128 keep the f64 reference affordable.
    let tokens = &tokens[..3 * 128];
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
    assert_eq!(fast.tokens, reference.tokens);
    assert_eq!(fast.tokens, 3 * 63);
    // A sane English-text perplexity for a 135M model.
    assert!(
        reference.ppl > 1.0 && reference.ppl < 30.0,
        "{}",
        reference.ppl
    );
    let rel = (fast.ppl - reference.ppl).abs() / reference.ppl;
    eprintln!(
        "perplexity: reference {:.4}; model (exact projections: {exact}) {:.4} ({:.4} %)",
        reference.ppl,
        fast.ppl,
        100.0 * rel
    );
    Some((fast.ppl, reference.ppl))
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

/// The fast q8-activation kernels against the same 0.5 % bound (measured 0.38 %). The margin is not
/// robust: q8 activation rounding gives this 189-token estimate a spread of ~1 % (a last-bit change of
/// the kernels' summation order moved it from 1.13 % to 0.38 %; docs/model.md), so if a kernel change
/// turns this red, the fix is more precise activations, not a looser bound.
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
