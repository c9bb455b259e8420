//! Speculative decoding on the real SmolLM2 through the model's verify contract: greedy output with
//! the n-gram drafter is token-for-token the plain greedy output, also when `max_tokens` or EOS
//! falls inside an accepted draft (the stop conditions are checked per emitted token).

#[path = "model_common.rs"]
mod model_common;

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
