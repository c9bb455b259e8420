//! Speculative decoding on the real SmolLM2 through the model's verify contract: greedy output with
//! the n-gram drafter is token-for-token the plain greedy output, also when `max_tokens` or EOS
//! falls inside an accepted draft (the stop conditions are checked per emitted token).

#[path = "model_common.rs"]
mod model_common;

use xdna::model::sampling::{Sampler, SamplingConfig};
use xdna::spec::{
    FallbackConfig, NgramConfig, NgramDrafter, NoDrafter, SpecConfig, SpecRunner, StopConditions,
};

fn config() -> SpecConfig {
    SpecConfig {
        max_drafts: 8,
        initial_drafts: 8,
        // Fallback would turn speculation off on timing alone; equivalence must hold either way,
        // but this test is about the speculative path.
        fallback: FallbackConfig {
            enabled: false,
            ..FallbackConfig::default()
        },
        ..SpecConfig::default()
    }
}

#[test]
fn ngram_greedy_equals_plain_greedy_on_smollm2() {
    let Some((pkg, mut model)) = model_common::fast_model(512) else {
        return;
    };
    let prompts = [
        "1. apple\n2. banana\n3. cherry\n4. date\n5. elderberry\n6.",
        "fn add(a: i32, b: i32) -> i32 { a + b }\nfn add(a: i32, b: i32) -> i32 {",
        "The capital of France is",
    ];
    let eos = pkg.eos_token_ids().first().copied();
    let mut accepted_total = 0;
    for prompt in prompts {
        let context = pkg.tokenizer().encode(prompt, false);
        for max_tokens in [1usize, 7, 40] {
            let mut stop = StopConditions::max_tokens(max_tokens);
            if let Some(e) = eos {
                stop = stop.with_eos(e);
            }
            // Plain greedy through the same loop with no drafter (1-row passes).
            model.reset();
            model
                .prefill(&context[..context.len() - 1])
                .expect("prefill");
            let mut plain = SpecRunner::new(config(), NoDrafter).expect("runner");
            let plain_out = plain.generate(&mut model, &context, &stop).expect("plain");
            let plain_position = model.position();

            model.reset();
            model
                .prefill(&context[..context.len() - 1])
                .expect("prefill");
            let drafter = NgramDrafter::new(NgramConfig::default()).expect("drafter");
            let mut spec = SpecRunner::new(config(), drafter).expect("runner");
            let spec_out = spec
                .generate(&mut model, &context, &stop)
                .expect("speculative");
            assert_eq!(
                spec_out.tokens, plain_out.tokens,
                "prompt {prompt:?}, max_tokens {max_tokens}: speculative output differs"
            );
            assert_eq!(
                model.position(),
                plain_position,
                "committed positions differ"
            );
            assert!(spec_out.tokens.len() <= max_tokens);
            accepted_total += spec.stats().accepted;
        }
    }
    // The list and code prompts repeat themselves: some drafts must have been accepted, or the
    // test would not exercise multi-row verify passes at all.
    assert!(accepted_total > 0, "no draft was ever accepted");
}

/// Plain greedy through the loop with no drafter (1-row passes), from a fresh state.
/// Plain sampling (the model layer's `Sampler` over `Model::step`) gives the very tokens of the
/// speculative loop whose drafter proposes nothing, for the same seed: a round without drafts is a
/// plain sampled step, on the real vocabulary (49152 tokens: the top-p buckets and the top-k
/// selection at full size).
#[test]
fn plain_sampling_equals_the_loop_without_drafts_on_smollm2() {
    let Some((pkg, mut model)) = model_common::fast_model(512) else {
        return;
    };
    let context = pkg
        .tokenizer()
        .encode("Once upon a time, in a small village", false);
    let settings = [
        SamplingConfig::with_temperature(0.8),
        SamplingConfig {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.9,
        },
        SamplingConfig {
            temperature: 1.0,
            top_k: 40,
            top_p: 0.95,
        },
    ];
    let tokens = 24;
    for sampling in settings {
        let mut outputs = Vec::new();
        for seed in [7u64, 8] {
            model.reset();
            model
                .prefill(&context[..context.len() - 1])
                .expect("prefill");
            let mut sampler = Sampler::new(sampling.clone(), seed).expect("valid settings");
            let mut next = context[context.len() - 1];
            let mut plain = Vec::new();
            for _ in 0..tokens {
                next = sampler
                    .sample(model.step(next).expect("step"))
                    .expect("finite logits");
                plain.push(next);
            }

            model.reset();
            model
                .prefill(&context[..context.len() - 1])
                .expect("prefill");
            let mut runner = SpecRunner::new(
                SpecConfig {
                    sampling: sampling.clone(),
                    seed,
                    ..config()
                },
                NoDrafter,
            )
            .expect("runner");
            let looped = runner
                .generate(&mut model, &context, &StopConditions::max_tokens(tokens))
                .expect("loop");
            assert_eq!(looped.tokens, plain, "{sampling:?}, seed {seed}");
            outputs.push(plain);
        }
        assert_ne!(
            outputs[0], outputs[1],
            "{sampling:?}: the seed changed nothing"
        );
    }
}

fn plain_greedy(
    model: &mut xdna::model::Model,
    context: &[u32],
    stop: &StopConditions,
) -> (Vec<u32>, usize) {
    model.reset();
    model
        .prefill(&context[..context.len() - 1])
        .expect("prefill");
    let mut plain = SpecRunner::new(config(), NoDrafter).expect("runner");
    let out = plain.generate(model, context, stop).expect("plain");
    (out.tokens, model.position())
}

/// Runs `drafter` speculatively from a fresh state; returns the output, the committed position
/// and the statistics.
fn speculative<D: xdna::spec::Drafter>(
    model: &mut xdna::model::Model,
    drafter: D,
    context: &[u32],
    stop: &StopConditions,
) -> (xdna::spec::Generation, usize, xdna::spec::SpecStats, D) {
    model.reset();
    model
        .prefill(&context[..context.len() - 1])
        .expect("prefill");
    let mut spec = SpecRunner::new(config(), drafter).expect("runner");
    let out = spec.generate(model, context, stop).expect("speculative");
    let stats = spec.stats().clone();
    let position = model.position();
    // Hand the drafter back (it carries the draft model's state for the next prompt).
    let drafter = into_drafter(spec);
    (out, position, stats, drafter)
}

fn into_drafter<D: xdna::spec::Drafter>(runner: SpecRunner<D>) -> D {
    runner.into_drafter()
}

/// Checks one drafter against plain greedy on the prompt set: every `max_tokens` in a range, and
/// EOS placed (by choosing an emitted token as EOS) where it falls inside an accepted draft.
fn equals_plain_greedy<D: xdna::spec::Drafter>(
    model: &mut xdna::model::Model,
    mut drafter: D,
    prompts: &[Vec<u32>],
    what: &str,
) -> D {
    let mut cut_inside_accepted = 0;
    for context in prompts {
        for max_tokens in [1usize, 2, 5, 9, 24] {
            let stop = StopConditions::max_tokens(max_tokens);
            let (plain, plain_position) = plain_greedy(model, context, &stop);
            let (spec, position, _, d) = speculative(model, drafter, context, &stop);
            drafter = d;
            assert_eq!(
                spec.tokens, plain,
                "{what}, max_tokens {max_tokens}: output differs"
            );
            assert_eq!(
                position, plain_position,
                "{what}: committed positions differ"
            );
        }
        // EOS: the plain output's token at index j stands in for EOS; both runs must stop at its
        // first occurrence.
        let stop = StopConditions::max_tokens(24);
        let (reference, _) = plain_greedy(model, context, &stop);
        for j in [3usize, 10, 19] {
            let eos = reference[j];
            let first = reference.iter().position(|&t| t == eos).expect("present");
            let stop = StopConditions::max_tokens(24).with_eos(eos);
            let (plain, plain_position) = plain_greedy(model, context, &stop);
            assert_eq!(plain, reference[..=first].to_vec());
            let (spec, position, stats, d) = speculative(model, drafter, context, &stop);
            drafter = d;
            assert_eq!(spec.tokens, plain, "{what}, EOS {eos}: output differs");
            assert_eq!(spec.finish, xdna::spec::FinishReason::Eos);
            assert_eq!(
                position, plain_position,
                "{what}, EOS {eos}: positions differ"
            );
            // The rule accepted more than was emitted: the EOS cut a round inside its accepted
            // drafts.
            if stats.accepted + stats.rounds + stats.plain_steps > stats.emitted {
                cut_inside_accepted += 1;
            }
        }
    }
    assert!(
        cut_inside_accepted > 0,
        "{what}: no EOS ever fell inside an accepted draft"
    );
    drafter
}

fn prompt_set(pkg: &xdna::weights::Package) -> Vec<Vec<u32>> {
    [
        "1. apple\n2. banana\n3. cherry\n4. date\n5. elderberry\n6.",
        // Greedy SmolLM2 repeats this function: the n-gram drafter's drafts are accepted in full.
        "def area(r):\n    return 3.14159 * r * r\n\ndef area(r):\n    return 3.14159 * r * r\n\ndef area(r):",
        "The capital of France is",
    ]
    .iter()
    .map(|p| pkg.tokenizer().encode(p, false))
    .collect()
}

#[test]
fn draft_model_greedy_equals_plain_greedy_on_smollm2() {
    // SmolLM2 drafting for itself (a second instance on the host backend): near-full acceptance,
    // so EOS and max_tokens land inside accepted drafts.
    let Some((pkg, mut model)) = model_common::fast_model(512) else {
        return;
    };
    // A second state over the same weights: the draft model's own KV cache.
    let draft = xdna::model::Model::shared(model.weights_arc(), 512).expect("draft model");
    let prompts = prompt_set(&pkg);
    let drafter = xdna::spec::DraftModelDrafter::new(xdna::spec::ModelDraft::new(draft), 7);
    equals_plain_greedy(&mut model, drafter, &prompts, "draft model");
}

#[test]
fn ngram_greedy_equals_plain_greedy_with_eos_inside_drafts() {
    let Some((pkg, mut model)) = model_common::fast_model(512) else {
        return;
    };
    let prompts = prompt_set(&pkg);
    let drafter = NgramDrafter::new(NgramConfig::default()).expect("drafter");
    equals_plain_greedy(&mut model, drafter, &prompts, "ngram");
}

#[test]
fn layer_skip_greedy_equals_plain_greedy_on_smollm2() {
    // Self-speculation: the first 26 of SmolLM2's 30 layers + final norm + head draft (an
    // early-exit view sharing the weights, with its own KV cache); partial acceptance.
    let Some((pkg, mut model)) = model_common::fast_model(512) else {
        return;
    };
    let prompts = prompt_set(&pkg);
    let view = xdna::spec::ModelEarlyExit::new(&model, 512, 26).expect("early-exit view");
    let draft = xdna::spec::LayerSkipDraftModel::new(view, 26).expect("layer skip");
    let drafter = xdna::spec::DraftModelDrafter::new(draft, 3);
    equals_plain_greedy(&mut model, drafter, &prompts, "layer skip");
    // Exiting after every layer is the model itself, and no layer is no model: both refused.
    assert!(xdna::spec::ModelEarlyExit::new(&model, 512, 30).is_err());
    assert!(xdna::spec::ModelEarlyExit::new(&model, 512, 0).is_err());
}
