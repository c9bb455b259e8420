//! The speculative loop over the toy model: greedy speculative output is token-for-token plain
//! greedy output, for every drafter, with EOS and max_tokens inside accepted drafts; zero-draft
//! rounds; adaptive k; fallback; the toy model's contract errors.

use std::time::Duration;

use xdna::model::sampling::{LogitProcessor, Rng, Sampler, SamplingConfig};
use xdna::spec::toy::{ToyLm, ToyLmConfig, ToyLmError};
use xdna::spec::{
    prefill_with_verify_passes, AcceptanceRule, DraftModelDrafter, DraftProposal, Drafter,
    FallbackConfig, FinishReason, Generation, LayerSkipDraftModel, NgramConfig, NgramDrafter,
    NoDrafter, SpecConfig, SpecError, SpecRunner, StopConditions, VerifyTarget,
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn toy(seed: u64, order: usize) -> ToyLmConfig {
    ToyLmConfig {
        seed,
        context_order: order,
        ..ToyLmConfig::default()
    }
}

/// A target with `prompt[..len-1]` committed and the last prompt token pending.
fn prefilled(config: &ToyLmConfig, prompt: &[u32]) -> Result<ToyLm, SpecError> {
    let mut target = ToyLm::new(config.clone());
    prefill_with_verify_passes(&mut target, &prompt[..prompt.len() - 1])?;
    Ok(target)
}

/// Plain greedy decoding written independently of the library's loop: one-row pass, argmax
/// (lowest id on ties), commit(1).
fn plain_greedy(
    config: &ToyLmConfig,
    prompt: &[u32],
    max_tokens: usize,
    eos: Option<u32>,
) -> Result<(Vec<u32>, ToyLm), Box<dyn std::error::Error>> {
    let mut target = prefilled(config, prompt)?;
    let mut pending = prompt[prompt.len() - 1];
    let mut output = Vec::new();
    while output.len() < max_tokens {
        let logits = target.step_batch_all(&[pending])?;
        let mut best = 0;
        for (token, &value) in logits.iter().enumerate() {
            if value > logits[best] {
                best = token;
            }
        }
        target.commit_verify_rows(1)?;
        pending = best as u32;
        output.push(pending);
        if Some(pending) == eos {
            break;
        }
    }
    Ok((output, target))
}

fn greedy_config(max_drafts: usize) -> SpecConfig {
    SpecConfig {
        max_drafts,
        initial_drafts: max_drafts,
        fallback: FallbackConfig {
            enabled: false,
            ..FallbackConfig::default()
        },
        ..SpecConfig::default()
    }
}

fn speculative<D: Drafter>(
    runner: &mut SpecRunner<D>,
    config: &ToyLmConfig,
    prompt: &[u32],
    stop: &StopConditions,
) -> Result<(Generation, ToyLm), Box<dyn std::error::Error>> {
    let mut target = prefilled(config, prompt)?;
    let generation = runner.generate(&mut target, prompt, stop)?;
    Ok((generation, target))
}

fn stop(max_tokens: usize, eos: Option<u32>) -> StopConditions {
    let stop = StopConditions::max_tokens(max_tokens);
    match eos {
        Some(eos) => stop.with_eos(eos),
        None => stop,
    }
}

/// Checks that speculative and plain runs agree on output and on the target state.
fn assert_same_as_plain(spec: &(Generation, ToyLm), plain: &(Vec<u32>, ToyLm), what: &str) {
    assert_eq!(
        spec.0.tokens, plain.0,
        "{what}: output differs from plain greedy"
    );
    assert_eq!(
        spec.1.committed(),
        plain.1.committed(),
        "{what}: committed state differs from plain greedy"
    );
    assert_eq!(
        spec.1.pending_rows(),
        None,
        "{what}: a pass was left uncommitted"
    );
}

const PROMPT: [u32; 6] = [5, 9, 5, 9, 12, 3];

#[test]
fn ngram_greedy_matches_plain_greedy() -> TestResult {
    let mut total_accepted = 0;
    for seed in 1..=6 {
        for order in [1, 2] {
            let config = toy(seed, order);
            let plain = plain_greedy(&config, &PROMPT, 200, None)?;
            let drafter = NgramDrafter::new(NgramConfig {
                min_n: 1,
                max_n: 4,
                max_drafts: 8,
            })?;
            let mut runner = SpecRunner::new(greedy_config(8), drafter)?;
            let spec = speculative(&mut runner, &config, &PROMPT, &stop(200, None))?;
            assert_same_as_plain(&spec, &plain, &format!("ngram seed {seed} order {order}"));
            assert_eq!(spec.0.finish, FinishReason::MaxTokens);
            let stats = runner.stats();
            assert_eq!(stats.emitted, 200);
            assert!(spec.1.pass_rows.iter().all(|&rows| rows <= 16));
            total_accepted += stats.accepted;
        }
    }
    assert!(
        total_accepted > 100,
        "the n-gram drafter never helped ({total_accepted} accepted)"
    );
    Ok(())
}

#[test]
fn identical_draft_model_is_fully_accepted() -> TestResult {
    let config = toy(3, 2);
    let plain = plain_greedy(&config, &PROMPT, 120, None)?;
    let drafter = DraftModelDrafter::new(ToyLm::new(config.clone()), 1);
    let mut runner = SpecRunner::new(greedy_config(15), drafter)?;
    let spec = speculative(&mut runner, &config, &PROMPT, &stop(120, None))?;
    assert_same_as_plain(&spec, &plain, "identical draft model");
    let stats = runner.stats();
    assert_eq!(stats.accepted, stats.drafted);
    // 120 tokens = 7 rounds of 15 drafts + bonus (112) + one round capped by the budget (8).
    assert_eq!(stats.rounds, 8);
    assert_eq!(stats.mean_acceptance_length(), Some(15.0));
    assert_eq!(stats.acceptance_length_histogram[15], 7);
    assert_eq!(stats.acceptance_length_histogram[7], 1);
    assert_eq!(
        spec.1.pass_rows[spec.1.pass_rows.len() - 8..],
        [16, 16, 16, 16, 16, 16, 16, 8]
    );
    Ok(())
}

#[test]
fn perturbed_draft_model_is_partly_accepted() -> TestResult {
    for seed in 1..=4 {
        let config = toy(seed, 2);
        let plain = plain_greedy(&config, &PROMPT, 150, None)?;
        let draft_config = ToyLmConfig {
            perturbation: 2.5,
            ..config.clone()
        };
        let drafter = DraftModelDrafter::new(ToyLm::new(draft_config), 2);
        let mut runner = SpecRunner::new(greedy_config(6), drafter)?;
        let spec = speculative(&mut runner, &config, &PROMPT, &stop(150, None))?;
        assert_same_as_plain(&spec, &plain, &format!("perturbed draft model seed {seed}"));
        let stats = runner.stats();
        assert!(
            stats.accepted > 0 && stats.accepted < stats.drafted,
            "seed {seed}: expected partial acceptance, got {stats}"
        );
    }
    Ok(())
}

#[test]
fn layer_skip_drafter_matches_plain_greedy() -> TestResult {
    let config = toy(5, 2);
    let plain = plain_greedy(&config, &PROMPT, 100, None)?;
    let draft = LayerSkipDraftModel::new(ToyLm::new(config.clone()), 3)?;
    let mut runner = SpecRunner::new(greedy_config(4), DraftModelDrafter::new(draft, 3))?;
    let spec = speculative(&mut runner, &config, &PROMPT, &stop(100, None))?;
    assert_same_as_plain(&spec, &plain, "layer skip");
    assert!(runner.stats().accepted > 0, "{}", runner.stats());
    assert!(LayerSkipDraftModel::new(ToyLm::new(config.clone()), 4).is_err());
    assert!(LayerSkipDraftModel::new(ToyLm::new(config), 0).is_err());
    Ok(())
}

#[test]
fn eos_inside_accepted_drafts_stops_there_and_commits_correctly() -> TestResult {
    let config = toy(4, 2);
    let (free_run, _) = plain_greedy(&config, &PROMPT, 80, None)?;
    let mut checked = 0;
    // With 4 drafts, all accepted, rounds emit 5 tokens: outputs 0..4, 5..9, ...; an EOS at an
    // index ≢ 4 (mod 5) is an accepted draft, not the bonus.
    for index in 5..free_run.len() {
        let eos = free_run[index];
        if index % 5 == 4 || free_run[..index].contains(&eos) {
            continue;
        }
        let plain = plain_greedy(&config, &PROMPT, 80, Some(eos))?;
        assert_eq!(plain.0.len(), index + 1);
        let drafter = DraftModelDrafter::new(ToyLm::new(config.clone()), 1);
        let mut runner = SpecRunner::new(
            SpecConfig {
                adaptive_drafts: false,
                ..greedy_config(4)
            },
            drafter,
        )?;
        let spec = speculative(&mut runner, &config, &PROMPT, &stop(80, Some(eos)))?;
        assert_same_as_plain(&spec, &plain, &format!("EOS {eos} at output {index}"));
        assert_eq!(spec.0.finish, FinishReason::Eos);
        // The last pass had 5 rows; only the rows up to the EOS's predecessor were committed.
        assert_eq!(spec.1.pass_rows.last(), Some(&5));
        assert_eq!(spec.1.commits.last(), Some(&(index % 5 + 1)));

        // The state is consistent: generation continues exactly like plain decoding would.
        let mut context = PROMPT.to_vec();
        context.extend_from_slice(&spec.0.tokens);
        let mut spec_target = spec.1;
        let mut continued_runner = SpecRunner::new(
            greedy_config(4),
            DraftModelDrafter::new(ToyLm::new(config.clone()), 1),
        )?;
        let continued = continued_runner.generate(&mut spec_target, &context, &stop(30, None))?;
        let (plain_continued, _) = plain_greedy(&config, &context, 30, None)?;
        assert_eq!(continued.tokens, plain_continued);
        checked += 1;
    }
    assert!(
        checked >= 5,
        "too few EOS positions inside drafts were exercised ({checked})"
    );
    Ok(())
}

#[test]
fn stop_sequence_inside_accepted_drafts() -> TestResult {
    let config = toy(6, 2);
    let (free_run, _) = plain_greedy(&config, &PROMPT, 60, None)?;
    let sequence = free_run[11..13].to_vec();
    let first_end = (2..=free_run.len())
        .find(|&end| free_run[..end].ends_with(&sequence))
        .ok_or("stop sequence not found")?;
    let stop_conditions = StopConditions {
        max_tokens: 60,
        eos_tokens: Vec::new(),
        stop_sequences: vec![sequence],
    };
    let drafter = DraftModelDrafter::new(ToyLm::new(config.clone()), 1);
    let mut runner = SpecRunner::new(greedy_config(6), drafter)?;
    let spec = speculative(&mut runner, &config, &PROMPT, &stop_conditions)?;
    assert_eq!(spec.0.finish, FinishReason::StopSequence);
    assert_eq!(spec.0.tokens, free_run[..first_end]);
    assert_eq!(spec.1.position(), PROMPT.len() - 1 + first_end);
    Ok(())
}

#[test]
fn max_tokens_is_exact_even_when_drafts_would_go_beyond() -> TestResult {
    let config = toy(2, 2);
    // Identical draft model, k = 4: 7 tokens = one round of 5, then a round capped to 1 draft (2 rows).
    let plain = plain_greedy(&config, &PROMPT, 7, None)?;
    let drafter = DraftModelDrafter::new(ToyLm::new(config.clone()), 1);
    let mut runner = SpecRunner::new(
        SpecConfig {
            adaptive_drafts: false,
            ..greedy_config(4)
        },
        drafter,
    )?;
    let mut target = prefilled(&config, &PROMPT)?;
    let mut streamed = Vec::new();
    let generation = runner.generate_streaming(&mut target, &PROMPT, &stop(7, None), |tokens| {
        streamed.push(tokens.to_vec())
    })?;
    assert_eq!(streamed, vec![plain.0[..5].to_vec(), plain.0[5..].to_vec()]);
    let spec = (generation, target);
    assert_same_as_plain(&spec, &plain, "max_tokens 7");
    let prefill_passes = 1; // 5 prompt tokens in one pass
    assert_eq!(spec.1.pass_rows[prefill_passes..], [5, 2]);
    assert_eq!(spec.1.commits[prefill_passes..], [5, 2]);

    // Every budget from 0 to 40, with the n-gram and the identical-model drafters.
    for max_tokens in 0..=40 {
        let plain = plain_greedy(&config, &PROMPT, max_tokens, None)?;
        let mut ngram =
            SpecRunner::new(greedy_config(8), NgramDrafter::new(NgramConfig::default())?)?;
        let spec = speculative(&mut ngram, &config, &PROMPT, &stop(max_tokens, None))?;
        assert_same_as_plain(&spec, &plain, &format!("ngram, max_tokens {max_tokens}"));
        let mut model = SpecRunner::new(
            greedy_config(15),
            DraftModelDrafter::new(ToyLm::new(config.clone()), 1),
        )?;
        let spec = speculative(&mut model, &config, &PROMPT, &stop(max_tokens, None))?;
        assert_same_as_plain(
            &spec,
            &plain,
            &format!("draft model, max_tokens {max_tokens}"),
        );
        assert_eq!(spec.0.tokens.len(), max_tokens);
    }
    Ok(())
}

/// Proposes from an inner drafter on odd rounds only: rounds with drafts alternate with rounds
/// without (the vLLM #52942 bug class: a zero-draft step after a step with drafts).
struct EveryOtherRound<D> {
    inner: D,
    round: usize,
}

impl<D: Drafter> Drafter for EveryOtherRound<D> {
    fn name(&self) -> &'static str {
        "every-other-round"
    }

    fn begin(&mut self, context: &[u32]) -> Result<(), SpecError> {
        self.round = 0;
        self.inner.begin(context)
    }

    fn propose(
        &mut self,
        context: &[u32],
        max_drafts: usize,
        rule: &AcceptanceRule,
        out: &mut DraftProposal,
    ) -> Result<(), SpecError> {
        self.round += 1;
        if self.round.is_multiple_of(2) {
            out.reset(true, 0);
            return Ok(());
        }
        self.inner.propose(context, max_drafts, rule, out)
    }

    fn observe(&mut self, context: &[u32], accepted: usize) -> Result<(), SpecError> {
        self.inner.observe(context, accepted)
    }
}

#[test]
fn zero_draft_rounds_are_one_row_passes_committing_one_row() -> TestResult {
    let config = toy(7, 2);
    // A drafter that never proposes: every pass is one row, every commit is 1.
    let plain = plain_greedy(&config, &PROMPT, 25, None)?;
    let mut runner = SpecRunner::new(greedy_config(8), NoDrafter)?;
    let spec = speculative(&mut runner, &config, &PROMPT, &stop(25, None))?;
    assert_same_as_plain(&spec, &plain, "no drafter");
    assert_eq!(spec.1.pass_rows[1..], [1; 25]);
    assert_eq!(spec.1.commits[1..], [1; 25]);
    assert_eq!(runner.stats().plain_steps, 25);
    assert_eq!(runner.stats().rounds, 0);

    // An n-gram drafter on a context without repeats: misses are zero-draft rounds.
    let prompt = [1, 2, 3, 4];
    let plain = plain_greedy(&config, &prompt, 3, None)?;
    let mut runner = SpecRunner::new(greedy_config(8), NgramDrafter::new(NgramConfig::default())?)?;
    let spec = speculative(&mut runner, &config, &prompt, &stop(3, None))?;
    assert_same_as_plain(&spec, &plain, "ngram misses");
    assert_eq!(runner.stats().rounds, 0);

    // Rounds with drafts alternating with rounds without, partial acceptance.
    for seed in 1..=3 {
        let config = toy(seed, 2);
        let plain = plain_greedy(&config, &PROMPT, 90, None)?;
        let draft_config = ToyLmConfig {
            perturbation: 2.0,
            ..config.clone()
        };
        let drafter = EveryOtherRound {
            inner: DraftModelDrafter::new(ToyLm::new(draft_config), 5),
            round: 0,
        };
        let mut runner = SpecRunner::new(greedy_config(5), drafter)?;
        let spec = speculative(&mut runner, &config, &PROMPT, &stop(90, None))?;
        assert_same_as_plain(
            &spec,
            &plain,
            &format!("alternating zero-draft rounds, seed {seed}"),
        );
        let stats = runner.stats();
        assert!(stats.plain_steps > 0 && stats.rounds > 0, "{stats}");
        // Every zero-draft round was a one-row pass followed by commit(1).
        let passes = &spec.1.pass_rows[1..];
        let commits = &spec.1.commits[1..];
        assert_eq!(passes.len(), commits.len());
        for (&rows, &n) in passes.iter().zip(commits) {
            assert!((1..=rows).contains(&n));
            if rows == 1 {
                assert_eq!(n, 1);
            }
        }
    }
    Ok(())
}

/// Plain sampling written with the model layer's sampler: one-row pass, `Sampler::sample`,
/// commit(1).
fn plain_sampled(
    config: &ToyLmConfig,
    prompt: &[u32],
    sampling: &SamplingConfig,
    seed: u64,
    max_tokens: usize,
) -> Result<(Vec<u32>, ToyLm), Box<dyn std::error::Error>> {
    let mut target = prefilled(config, prompt)?;
    let mut sampler = Sampler::new(sampling.clone(), seed)?;
    let mut pending = prompt[prompt.len() - 1];
    let mut output = Vec::new();
    while output.len() < max_tokens {
        let logits = target.step_batch_all(&[pending])?;
        pending = sampler.sample(logits)?;
        target.commit_verify_rows(1)?;
        output.push(pending);
    }
    Ok((output, target))
}

#[test]
fn plain_sampling_is_the_loop_without_drafts_for_the_same_seed() -> TestResult {
    let config = toy(12, 2);
    let settings = [
        SamplingConfig::GREEDY,
        SamplingConfig::with_temperature(0.8),
        SamplingConfig {
            temperature: 1.0,
            top_k: 5,
            top_p: 1.0,
        },
        SamplingConfig {
            temperature: 0.7,
            top_k: 0,
            top_p: 0.9,
        },
        SamplingConfig {
            temperature: 1.3,
            top_k: 20,
            top_p: 0.8,
        },
        // Top-k 1 is greedy at any temperature: no uniform is drawn on either side.
        SamplingConfig {
            temperature: 0.5,
            top_k: 1,
            top_p: 1.0,
        },
    ];
    for sampling in settings {
        let mut outputs = Vec::new();
        for seed in [0, 7, 1234] {
            let plain = plain_sampled(&config, &PROMPT, &sampling, seed, 120)?;
            let mut runner = SpecRunner::new(
                SpecConfig {
                    sampling: sampling.clone(),
                    seed,
                    ..greedy_config(4)
                },
                NoDrafter,
            )?;
            let spec = speculative(&mut runner, &config, &PROMPT, &stop(120, None))?;
            assert_same_as_plain(&spec, &plain, &format!("{sampling:?}, seed {seed}"));
            outputs.push(plain.0);
        }
        // Greedy is the argmax whatever the seed; sampling depends on it.
        let same_for_every_seed = outputs.iter().all(|o| *o == outputs[0]);
        assert_eq!(same_for_every_seed, sampling.is_greedy(), "{sampling:?}");
        if sampling.is_greedy() {
            assert_eq!(outputs[0], plain_greedy(&config, &PROMPT, 120, None)?.0);
        }
    }
    Ok(())
}

#[test]
fn adaptive_draft_length_grows_on_full_acceptance_and_shrinks_on_rejection() -> TestResult {
    let config = toy(8, 2);
    let mut runner = SpecRunner::new(
        SpecConfig {
            max_drafts: 15,
            initial_drafts: 2,
            ..greedy_config(15)
        },
        DraftModelDrafter::new(ToyLm::new(config.clone()), 1),
    )?;
    let _ = speculative(&mut runner, &config, &PROMPT, &stop(100, None))?;
    assert_eq!(runner.draft_len(), 15);

    let bad_draft = ToyLmConfig {
        perturbation: 40.0,
        perturbation_seed: 99,
        ..config.clone()
    };
    let mut runner = SpecRunner::new(
        SpecConfig {
            initial_drafts: 8,
            ..greedy_config(8)
        },
        DraftModelDrafter::new(ToyLm::new(bad_draft), 1),
    )?;
    let plain = plain_greedy(&config, &PROMPT, 60, None)?;
    let spec = speculative(&mut runner, &config, &PROMPT, &stop(60, None))?;
    assert_same_as_plain(&spec, &plain, "poor drafter");
    assert!(runner.draft_len() < 4, "k stayed at {}", runner.draft_len());
    Ok(())
}

#[test]
fn falls_back_to_plain_decoding_when_speculation_does_not_pay() -> TestResult {
    // Rows dominate the cost (CPU-like scaling: a 2-row pass costs ~1.9 plain steps) and the
    // drafter is nearly always wrong: a round yields ~1 token, far below the break-even τ.
    let config = ToyLmConfig {
        pass_cost: Duration::from_micros(200),
        row_cost: Duration::from_millis(2),
        ..toy(9, 2)
    };
    let bad_draft = ToyLmConfig {
        perturbation: 40.0,
        perturbation_seed: 99,
        pass_cost: Duration::ZERO,
        row_cost: Duration::ZERO,
        ..config.clone()
    };
    let spec_config = SpecConfig {
        fallback: FallbackConfig {
            enabled: true,
            warmup_rounds: 4,
            probe_interval: 8,
            max_probe_interval: 32,
            ewma_weight: 0.25,
            recalibrate_every: 16,
        },
        ..greedy_config(4)
    };
    let plain = plain_greedy(&config, &PROMPT, 120, None)?;
    let mut runner = SpecRunner::new(
        spec_config.clone(),
        DraftModelDrafter::new(ToyLm::new(bad_draft), 1),
    )?;
    let spec = speculative(&mut runner, &config, &PROMPT, &stop(120, None))?;
    assert_same_as_plain(&spec, &plain, "fallback");
    let stats = runner.stats().clone();
    assert!(stats.fallback_entries >= 1, "never fell back: {stats}");
    assert!(stats.plain_steps > stats.rounds, "{stats}");
    assert!(stats.probes >= 1, "never re-probed: {stats}");
    assert!(runner.costs().break_even_tau().is_some());

    // A drafter that is always right with NPU-like costs (the pass dominates) keeps speculating.
    let npu_like = ToyLmConfig {
        pass_cost: Duration::from_millis(2),
        row_cost: Duration::from_micros(20),
        ..toy(9, 2)
    };
    let mut runner = SpecRunner::new(
        spec_config,
        DraftModelDrafter::new(ToyLm::new(toy(9, 2)), 1),
    )?;
    let spec = speculative(&mut runner, &npu_like, &PROMPT, &stop(120, None))?;
    assert_eq!(spec.0.tokens, plain.0);
    let stats = runner.stats();
    assert_eq!(stats.fallback_entries, 0, "{stats}");
    assert!(!runner.is_falling_back());
    Ok(())
}

#[test]
fn sampling_runs_are_reproducible_and_consistent() -> TestResult {
    let config = toy(10, 2);
    let sampling = SpecConfig {
        sampling: SamplingConfig {
            temperature: 0.8,
            top_k: 10,
            top_p: 0.95,
        },
        seed: 42,
        ..greedy_config(6)
    };
    let draft_config = ToyLmConfig {
        perturbation: 1.0,
        ..config.clone()
    };
    let run = |seed: u64| -> Result<(Generation, ToyLm, String), Box<dyn std::error::Error>> {
        let mut runner = SpecRunner::new(
            SpecConfig {
                seed,
                ..sampling.clone()
            },
            DraftModelDrafter::new(ToyLm::new(draft_config.clone()), seed),
        )?;
        let (generation, target) = speculative(&mut runner, &config, &PROMPT, &stop(80, None))?;
        Ok((generation, target, runner.stats().to_string()))
    };
    let (first, target, stats) = run(42)?;
    let (second, _, _) = run(42)?;
    assert_eq!(first, second);
    assert_eq!(first.tokens.len(), 80);
    assert_eq!(target.position(), PROMPT.len() - 1 + 80);
    assert_eq!(&target.committed()[PROMPT.len()..], &first.tokens[..79]);
    assert!(
        stats.starts_with("SpecDecoding metrics: Mean acceptance length: "),
        "{stats}"
    );

    // n-gram drafts (one-hot q) under sampling.
    let mut runner = SpecRunner::new(sampling, NgramDrafter::new(NgramConfig::default())?)?;
    let (generation, target) = speculative(&mut runner, &config, &PROMPT, &stop(80, None))?;
    assert_eq!(generation.tokens.len(), 80);
    assert_eq!(target.position(), PROMPT.len() - 1 + 80);
    Ok(())
}

#[test]
fn statistics_follow_the_conventions() -> TestResult {
    let config = toy(11, 2);
    let draft_config = ToyLmConfig {
        perturbation: 2.5,
        ..config.clone()
    };
    let mut runner = SpecRunner::new(
        SpecConfig {
            adaptive_drafts: false,
            ..greedy_config(5)
        },
        DraftModelDrafter::new(ToyLm::new(draft_config), 1),
    )?;
    let _ = speculative(&mut runner, &config, &PROMPT, &stop(200, None))?;
    let stats = runner.stats();
    let histogram_rounds: u64 = stats.acceptance_length_histogram.iter().sum();
    assert_eq!(histogram_rounds, stats.rounds);
    let histogram_accepted: u64 = stats
        .acceptance_length_histogram
        .iter()
        .enumerate()
        .map(|(a, &count)| a as u64 * count)
        .sum();
    assert_eq!(histogram_accepted, stats.accepted);
    let tau = stats.mean_acceptance_length().ok_or("no rounds")?;
    assert!((tau - (1.0 + stats.accepted as f64 / stats.rounds as f64)).abs() < 1e-12);
    let per_position = stats.per_position_acceptance();
    assert_eq!(per_position.len(), 5);
    assert!(per_position.windows(2).all(|w| w[0] >= w[1]));
    let sum: f64 = per_position.iter().sum();
    assert!((sum - (tau - 1.0)).abs() < 1e-9, "Σ per-position = τ − 1");
    let line = stats.to_string();
    for field in [
        "Mean acceptance length",
        "Accepted:",
        "Drafted:",
        "Per-position acceptance rate",
        "Avg Draft acceptance rate",
    ] {
        assert!(line.contains(field), "{line}");
    }
    Ok(())
}

#[test]
fn toy_model_enforces_the_verify_contract() -> TestResult {
    let mut target = ToyLm::new(toy(1, 2));
    assert_eq!(
        target.commit_verify_rows(1),
        Err(ToyLmError::NoPassToCommit)
    );
    assert_eq!(
        target.step_batch_all(&[]).err(),
        Some(ToyLmError::EmptyBatch)
    );
    assert_eq!(
        target.step_batch_all(&[0; 17]).err(),
        Some(ToyLmError::TooManyRows { rows: 17 })
    );
    assert_eq!(
        target.step_batch_all(&[99]).err(),
        Some(ToyLmError::TokenOutOfVocab {
            token: 99,
            vocab: 32
        })
    );
    target.step_batch_all(&[1, 2, 3])?;
    assert_eq!(
        target.step_batch_all(&[1]).err(),
        Some(ToyLmError::PassPending { rows: 3 })
    );
    assert_eq!(
        target.commit_verify_rows(4),
        Err(ToyLmError::CommitOutOfRange { n: 4, rows: 3 })
    );
    assert_eq!(
        target.commit_verify_rows(0),
        Err(ToyLmError::CommitOutOfRange { n: 0, rows: 3 })
    );
    target.commit_verify_rows(2)?;
    assert_eq!(target.committed(), &[1, 2]);
    assert_eq!(
        target.commit_verify_rows(1),
        Err(ToyLmError::NoPassToCommit)
    );

    // The loop refuses a context that does not match the target, and target errors are typed.
    let mut runner = SpecRunner::new(greedy_config(4), NoDrafter)?;
    assert!(matches!(
        runner.generate(&mut target, &[1, 2], &stop(5, None)),
        Err(SpecError::ContextMismatch {
            context_len: 2,
            position: 2
        })
    ));
    target.step_batch_all(&[3])?;
    assert!(matches!(
        runner.generate(&mut target, &[1, 2, 3], &stop(5, None)),
        Err(SpecError::Target {
            operation: "step_batch_all",
            ..
        })
    ));
    assert!(SpecRunner::new(greedy_config(16), NoDrafter).is_err());
    assert!(NgramDrafter::new(NgramConfig {
        min_n: 0,
        max_n: 2,
        max_drafts: 4
    })
    .is_err());
    Ok(())
}

/// χ² critical value at α = 0.001 by the Wilson–Hilferty approximation (z₀.₉₉₉ = 3.0902; within
/// 0.2% of the tables for df ≥ 5, e.g. df 35: 66.71 vs 66.619 tabulated).
fn chi_square_critical_0_001(df: usize) -> f64 {
    let df = df as f64;
    let z = 3.0902;
    let a = 2.0 / (9.0 * df);
    df * (1.0 - a + z * a.sqrt()).powi(3)
}

/// Runs the loop many times from the same prompt (sampling, T = 1, k ≤ 2, three tokens) and checks
/// that the joint distribution of the first two tokens equals the target's p(t1) · p(t2 | t1),
/// computed exactly from the toy model's logits, by a χ² test at α = 0.001.
fn check_joint_distribution_of_two_tokens<D: Drafter>(
    make_drafter: impl Fn(u64) -> D,
    what: &str,
) -> TestResult {
    let config = ToyLmConfig {
        vocab: 6,
        logit_scale: 1.5,
        ..toy(21, 2)
    };
    let sampling = SamplingConfig::with_temperature(1.0);
    let prompt = [1u32, 4, 2];
    let vocab = config.vocab;

    let reference = ToyLm::new(config.clone());
    let mut processor = LogitProcessor::new();
    let (mut logits, mut p1, mut p2) = (Vec::new(), Vec::new(), Vec::new());
    reference.logits_after(&prompt, 0.0, &mut logits);
    processor.probabilities(&logits, &sampling, 0, &mut p1)?;
    let mut expected = vec![0.0f64; vocab * vocab];
    for t1 in 0..vocab {
        let mut history = prompt.to_vec();
        history.push(t1 as u32);
        reference.logits_after(&history, 0.0, &mut logits);
        processor.probabilities(&logits, &sampling, 0, &mut p2)?;
        for t2 in 0..vocab {
            expected[t1 * vocab + t2] = f64::from(p1[t1]) * f64::from(p2[t2]);
        }
    }

    const RUNS: u64 = 30_000;
    let mut observed = vec![0u64; vocab * vocab];
    let mut rejected_drafts = 0u64;
    let mut target = prefilled(&config, &prompt)?;
    for run in 0..RUNS {
        xdna::spec::DraftModel::truncate(&mut target, prompt.len() - 1)?;
        let mut runner = SpecRunner::new(
            SpecConfig {
                sampling: sampling.clone(),
                seed: run,
                ..greedy_config(2)
            },
            make_drafter(run),
        )?;
        let generation = runner.generate(&mut target, &prompt, &stop(3, None))?;
        let (t1, t2) = (generation.tokens[0] as usize, generation.tokens[1] as usize);
        observed[t1 * vocab + t2] += 1;
        let stats = runner.stats();
        rejected_drafts += stats.drafted - stats.accepted;
    }
    assert!(
        rejected_drafts > RUNS / 10,
        "{what}: the drafter is too good to test the rule"
    );
    let mut statistic = 0.0;
    for (&o, &p) in observed.iter().zip(&expected) {
        let e = RUNS as f64 * p;
        assert!(e >= 5.0, "expected count {e} too small for χ²");
        statistic += (o as f64 - e).powi(2) / e;
    }
    let df = vocab * vocab - 1;
    let critical = chi_square_critical_0_001(df);
    assert!(
        statistic < critical,
        "{what}: joint (t1, t2): χ² = {statistic:.1} ≥ {critical:.1} (df {df}, α = 0.001)"
    );
    Ok(())
}

#[test]
fn speculative_sampling_loop_reproduces_the_target_distribution() -> TestResult {
    // Drafts drawn from a perturbed draft model's own distribution q (Leviathan rule).
    let draft_config = ToyLmConfig {
        vocab: 6,
        logit_scale: 1.5,
        perturbation: 1.5,
        ..toy(21, 2)
    };
    check_joint_distribution_of_two_tokens(
        |run| DraftModelDrafter::new(ToyLm::new(draft_config.clone()), run ^ 0xabcdef),
        "draft model, full q",
    )?;
    // Deterministic drafts (one-hot rule), as the n-gram drafter proposes.
    check_joint_distribution_of_two_tokens(|_| FixedDrafter(vec![2, 3]), "fixed drafts, one-hot")
}

/// Prompt lookup written as a scan: for n from max down to min, the latest start i < len − n with
/// context[i..i+n] == suffix; the continuation is copied token by token from i+n on, reading its
/// own output once it runs past the context (overlapping copy).
fn ngram_by_scan(context: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
    let len = context.len();
    for n in (min_n..=max_n.min(len)).rev() {
        let suffix = &context[len - n..];
        for start in (0..len - n).rev() {
            if &context[start..start + n] == suffix {
                let mut extended = context.to_vec();
                for j in 0..k {
                    extended.push(extended[start + n + j]);
                }
                return extended[len..].to_vec();
            }
        }
    }
    Vec::new()
}

#[test]
fn ngram_index_agrees_with_a_scan_as_the_context_grows() -> TestResult {
    let mut rng = Rng::new(5);
    for (vocab, min_n, max_n, k) in [(3u64, 1, 3, 5), (5, 2, 4, 8), (8, 1, 1, 3), (4, 3, 6, 15)] {
        let config = NgramConfig {
            min_n,
            max_n,
            max_drafts: k,
        };
        let mut drafter = NgramDrafter::new(config)?;
        let mut context: Vec<u32> = vec![(rng.next_u64() % vocab) as u32];
        drafter.begin(&context)?;
        let mut proposal = DraftProposal::new();
        let mut hits = 0;
        for _ in 0..1500 {
            drafter.propose(&context, k, &AcceptanceRule::Greedy, &mut proposal)?;
            let expected = ngram_by_scan(&context, min_n, max_n, k);
            assert_eq!(
                proposal.tokens(),
                expected.as_slice(),
                "context length {}",
                context.len()
            );
            hits += usize::from(!expected.is_empty());
            // Grow by 1–3 tokens, as rounds do.
            for _ in 0..=(rng.next_u64() % 3) {
                context.push((rng.next_u64() % vocab) as u32);
            }
            drafter.observe(&context, 0)?;
            assert_eq!(drafter.indexed_len(), context.len());
        }
        assert!(hits > 100);
    }
    // A different sequence after begin() starts a fresh index.
    let mut drafter = NgramDrafter::new(NgramConfig::default())?;
    let mut proposal = DraftProposal::new();
    drafter.begin(&[1, 2, 3, 1, 2])?;
    drafter.propose(&[1, 2, 3, 1, 2], 4, &AcceptanceRule::Greedy, &mut proposal)?;
    // "1 2" matched at 0: copy 3 1 2, then the copy reads its own first draft (3).
    assert_eq!(proposal.tokens(), &[3, 1, 2, 3]);
    drafter.begin(&[7, 8, 9])?;
    drafter.propose(&[7, 8, 9], 4, &AcceptanceRule::Greedy, &mut proposal)?;
    assert!(proposal.is_empty());
    Ok(())
}

/// Proposes a fixed list of tokens whatever the context.
struct FixedDrafter(Vec<u32>);

impl Drafter for FixedDrafter {
    fn name(&self) -> &'static str {
        "fixed"
    }

    fn begin(&mut self, _context: &[u32]) -> Result<(), SpecError> {
        Ok(())
    }

    fn propose(
        &mut self,
        _context: &[u32],
        max_drafts: usize,
        _rule: &AcceptanceRule,
        out: &mut DraftProposal,
    ) -> Result<(), SpecError> {
        out.reset(true, 0);
        for &token in self.0.iter().take(max_drafts) {
            out.push_one_hot(token);
        }
        Ok(())
    }
}

#[test]
fn a_malformed_proposal_is_refused_before_the_pass() -> TestResult {
    let config = toy(12, 2);
    let mut target = prefilled(&config, &PROMPT)?;
    let passes_before = target.pass_rows.len();
    let mut runner = SpecRunner::new(greedy_config(4), FixedDrafter(vec![3, 500]))?;
    match runner.generate(&mut target, &PROMPT, &stop(10, None)) {
        Err(SpecError::DraftTokenOutOfVocab {
            position: 1,
            token: 500,
            vocab: 32,
        }) => {}
        other => panic!("expected DraftTokenOutOfVocab, got {other:?}"),
    }
    assert_eq!(target.pass_rows.len(), passes_before, "a pass ran");
    assert_eq!(target.pending_rows(), None);
    // The sequence is intact: generation can proceed with a sane drafter.
    let plain = plain_greedy(&config, &PROMPT, 10, None)?;
    let mut runner = SpecRunner::new(greedy_config(4), FixedDrafter(vec![3, 4]))?;
    let generation = runner.generate(&mut target, &PROMPT, &stop(10, None))?;
    assert_eq!(generation.tokens, plain.0);
    Ok(())
}

#[test]
fn cost_model_break_even_arithmetic() {
    let mut costs = xdna::spec::CostModel::default();
    assert_eq!(costs.speculation_pays(), None);
    // NPU-like: a 1-row step 10 ms, a 5-row pass 10.2 ms, drafting 4 ms → break-even τ 1.42.
    costs.record_pass(1, 0.010, 0.25);
    costs.record_pass(5, 0.0102, 0.25);
    costs.record_round(0.0142, 2, 0.25);
    let break_even = costs.break_even_tau().unwrap_or(f64::NAN);
    assert!((break_even - 1.42).abs() < 1e-9, "{break_even}");
    assert_eq!(costs.measured_tau(), Some(2.0));
    assert_eq!(costs.speculation_pays(), Some(true));
    // Rounds that yield 1 token each pull the EWMA of τ below 1.42: no longer pays.
    for _ in 0..4 {
        costs.record_round(0.0142, 1, 0.25);
    }
    let tau = costs.measured_tau().unwrap_or(f64::NAN);
    assert!((tau - (1.0 + 0.75f64.powi(4))).abs() < 1e-12, "{tau}");
    assert_eq!(costs.speculation_pays(), Some(false));
    // A stalled 1-row step (100 ms) enters as 4× the mean, not 10×.
    costs.record_pass(1, 0.100, 0.25);
    let plain = costs.pass_seconds(1).unwrap_or(f64::NAN);
    assert!(
        (plain - (0.010 + 0.25 * (0.040 - 0.010))).abs() < 1e-12,
        "{plain}"
    );
}
