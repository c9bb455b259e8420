//! The acceptance rule and the sampler processing: hand-computed cases and chi-square tests.

use xdna::model::sampling::{
    argmax, sample_inverse_cdf, LogitProcessor, Rng, SamplingConfig, SamplingError,
};
use xdna::spec::{
    decide, uniforms_needed, AcceptanceRule, Decision, DraftProbabilities, LogitRows, SpecError,
};

type TestResult = Result<(), SpecError>;

/// Logits whose softmax at temperature 1 is exactly `p` (zeros become −∞).
fn logits_for(rows: &[&[f32]]) -> Vec<f32> {
    rows.iter()
        .flat_map(|row| {
            row.iter()
                .map(|&p| if p > 0.0 { p.ln() } else { f32::NEG_INFINITY })
        })
        .collect()
}

fn sampling() -> AcceptanceRule {
    AcceptanceRule::Sampling(SamplingConfig::with_temperature(1.0))
}

fn run(
    rows: &[&[f32]],
    drafts: &[u32],
    q: DraftProbabilities<'_>,
    rule: &AcceptanceRule,
    uniforms: &[f64],
) -> Result<Decision, SpecError> {
    let logits = logits_for(rows);
    let vocab = rows[0].len();
    decide(
        LogitRows::new(&logits, rows.len(), vocab)?,
        drafts,
        q,
        rule,
        uniforms,
    )
}

const P1: [f32; 4] = [0.1, 0.2, 0.3, 0.4];
const P2: [f32; 4] = [0.5, 0.1, 0.2, 0.2];
const P3: [f32; 4] = [0.25, 0.25, 0.25, 0.25];
const P4: [f32; 4] = [0.7, 0.1, 0.1, 0.1];

#[test]
fn leviathan_rejects_in_the_middle_of_three_drafts() -> TestResult {
    // Draft 1 (token 3): p/q = 0.4/0.25 = 1.6 → accepted whatever u (0.9).
    // Draft 2 (token 1): p/q = 0.1/0.6 ≈ 0.167 < u = 0.5 → rejected.
    // Residual max(0, p2 − q2) = [0.4, 0, 0, 0.1] → normalized [0.8, 0, 0, 0.2].
    // Final u = 0.85 → 0.85 × 0.5 = 0.425 ≥ 0.4 → token 3; with u = 0.7 → token 0.
    let q = [
        0.25, 0.25, 0.25, 0.25, // q1
        0.1, 0.6, 0.2, 0.1, // q2
        0.25, 0.25, 0.25, 0.25, // q3 (never consulted)
    ];
    let rows: [&[f32]; 4] = [&P1, &P2, &P3, &P4];
    let decision = run(
        &rows,
        &[3, 1, 2],
        DraftProbabilities::Full(&q),
        &sampling(),
        &[0.9, 0.5, 0.0, 0.85],
    )?;
    assert_eq!(decision.accepted, 1);
    assert_eq!(decision.emitted, vec![3, 3]);
    assert_eq!(decision.rows_to_commit(), 2);
    let decision = run(
        &rows,
        &[3, 1, 2],
        DraftProbabilities::Full(&q),
        &sampling(),
        &[0.9, 0.5, 0.0, 0.7],
    )?;
    assert_eq!(decision.emitted, vec![3, 0]);
    // u just below the ratio accepts draft 2 (0.1/0.6 = 0.1667 > 0.16); draft 3 has p/q =
    // 0.25/0.25 = 1 → accepted; the bonus comes from row 3 = [0.7, 0.1, 0.1, 0.1]: u 0.75 → 1.
    let decision = run(
        &rows,
        &[3, 1, 2],
        DraftProbabilities::Full(&q),
        &sampling(),
        &[0.9, 0.16, 0.99, 0.75],
    )?;
    assert_eq!(decision.accepted, 3);
    assert_eq!(decision.emitted, vec![3, 1, 2, 1]);
    Ok(())
}

#[test]
fn one_hot_rejects_the_last_draft() -> TestResult {
    // One-hot: accept d with probability p(d). Draft 1 = 3: u 0.39 < 0.4 accept. Draft 2 = 0:
    // u 0.49 < 0.5 accept. Draft 3 = 2: u 0.3 ≥ 0.25 reject → p with p(2) zeroed:
    // [0.25, 0.25, 0, 0.25] / 0.75; u 0.5 → 0.375 → cumulative 0.25, 0.5 → token 1.
    let rows: [&[f32]; 4] = [&P1, &P2, &P3, &P4];
    let decision = run(
        &rows,
        &[3, 0, 2],
        DraftProbabilities::OneHot,
        &sampling(),
        &[0.39, 0.49, 0.3, 0.5],
    )?;
    assert_eq!(decision.accepted, 2);
    assert_eq!(decision.emitted, vec![3, 0, 1]);
    assert_eq!(decision.rows_to_commit(), 3);
    // The same with u = 0.41 at draft 1: 0.41 ≥ 0.4 → rejected at once; residual
    // [0.1, 0.2, 0.3, 0] / 0.6, u 0.55 → 0.33 → cumulative 0.1, 0.3, 0.6 → token 2.
    let decision = run(
        &rows,
        &[3, 0, 2],
        DraftProbabilities::OneHot,
        &sampling(),
        &[0.41, 0.49, 0.3, 0.55],
    )?;
    assert_eq!(decision.accepted, 0);
    assert_eq!(decision.emitted, vec![2]);
    Ok(())
}

#[test]
fn full_acceptance_samples_the_bonus_from_the_last_row() -> TestResult {
    // q = p at both drafts → ratio 1 > any u in [0, 1): both accepted. Bonus from row 2 (P4):
    // u 0.75 → cumulative 0.7, 0.8 → token 1.
    let q: Vec<f32> = P1.iter().chain(P2.iter()).copied().collect();
    let rows: [&[f32]; 3] = [&P1, &P2, &P4];
    let decision = run(
        &rows,
        &[2, 0],
        DraftProbabilities::Full(&q),
        &sampling(),
        &[0.999, 0.999, 0.75],
    )?;
    assert_eq!(decision.accepted, 2);
    assert_eq!(decision.emitted, vec![2, 0, 1]);
    assert_eq!(decision.rows_to_commit(), 3);
    Ok(())
}

#[test]
fn draft_with_zero_draft_probability_is_rejected() -> TestResult {
    // q1(0) = 0: the draft cannot come from q; it is treated as a rejection even with u = 0.
    // p1 = [0.1, 0.2, 0.3, 0.4], q1 = [0, 0.5, 0.5, 0] → residual max(0, p − q) = [0.1, 0, 0, 0.4]
    // (total 0.5). u 0.1 → 0.05 → token 0 (the draft itself, through its residual mass);
    // u 0.5 → 0.25 → token 3.
    let q = [0.0, 0.5, 0.5, 0.0];
    let rows: [&[f32]; 2] = [&P1, &P4];
    let decision = run(
        &rows,
        &[0],
        DraftProbabilities::Full(&q),
        &sampling(),
        &[0.0, 0.1],
    )?;
    assert_eq!(decision.accepted, 0);
    assert_eq!(decision.emitted, vec![0]);
    let decision = run(
        &rows,
        &[0],
        DraftProbabilities::Full(&q),
        &sampling(),
        &[0.0, 0.5],
    )?;
    assert_eq!(decision.emitted, vec![3]);
    Ok(())
}

#[test]
fn no_drafts_is_a_plain_step() -> TestResult {
    let rows: [&[f32]; 1] = [&P1];
    // Sampling: one uniform, inverse CDF over p: u 0.35 → 0.1, 0.3, 0.6 → token 2.
    let decision = run(&rows, &[], DraftProbabilities::OneHot, &sampling(), &[0.35])?;
    assert_eq!(decision.accepted, 0);
    assert_eq!(decision.emitted, vec![2]);
    assert_eq!(decision.rows_to_commit(), 1);
    // Greedy: no uniforms, the argmax.
    let decision = run(
        &rows,
        &[],
        DraftProbabilities::OneHot,
        &AcceptanceRule::Greedy,
        &[],
    )?;
    assert_eq!(decision.emitted, vec![3]);
    assert_eq!(uniforms_needed(&sampling(), 0), 1);
    assert_eq!(uniforms_needed(&AcceptanceRule::Greedy, 5), 0);
    Ok(())
}

#[test]
fn uniforms_outside_the_unit_interval_are_refused() -> TestResult {
    let rows: [&[f32]; 2] = [&P1, &P2];
    for (bad, index) in [(1.0, 1), (-0.1, 0), (f64::NAN, 1), (f64::INFINITY, 0)] {
        let mut uniforms = [0.5, 0.5];
        uniforms[index] = bad;
        match run(
            &rows,
            &[3],
            DraftProbabilities::OneHot,
            &sampling(),
            &uniforms,
        ) {
            Err(SpecError::UniformOutOfRange { index: got, .. }) => assert_eq!(got, index),
            other => panic!("uniform {bad} at {index}: expected UniformOutOfRange, got {other:?}"),
        }
    }
    match run(&rows, &[3], DraftProbabilities::OneHot, &sampling(), &[0.5]) {
        Err(SpecError::UniformCount {
            expected: 2,
            got: 1,
        }) => {}
        other => panic!("expected UniformCount, got {other:?}"),
    }
    Ok(())
}

#[test]
fn greedy_accepts_while_drafts_match_the_argmax_with_lowest_id_ties() -> TestResult {
    // Row 0 ties tokens 1 and 2 → argmax 1. Row 1 argmax 0. Row 2 argmax 3. Row 3 argmax 2.
    let logits = [
        1.0, 3.0, 3.0, 0.5, //
        9.0, 1.0, 1.0, 1.0, //
        0.0, 0.0, 0.0, 2.0, //
        0.0, 0.0, 5.0, 5.0,
    ];
    let rows = LogitRows::new(&logits, 4, 4)?;
    let greedy = AcceptanceRule::Greedy;
    // Rejection in the middle: draft 2 = 2 ≠ argmax 0 → emit [1, 0].
    let d = decide(rows, &[1, 2, 3], DraftProbabilities::OneHot, &greedy, &[])?;
    assert_eq!((d.accepted, d.emitted.clone()), (1, vec![1, 0]));
    // Tie: a draft of 2 at row 0 is rejected, the correction is the lower id 1.
    let d = decide(rows, &[2, 0, 3], DraftProbabilities::OneHot, &greedy, &[])?;
    assert_eq!((d.accepted, d.emitted.clone()), (0, vec![1]));
    // Rejection at the last draft.
    let d = decide(rows, &[1, 0, 0], DraftProbabilities::OneHot, &greedy, &[])?;
    assert_eq!((d.accepted, d.emitted.clone()), (2, vec![1, 0, 3]));
    // Full acceptance; the bonus is the argmax of the last row (tie 2/3 → 2).
    let d = decide(rows, &[1, 0, 3], DraftProbabilities::OneHot, &greedy, &[])?;
    assert_eq!((d.accepted, d.emitted.clone()), (3, vec![1, 0, 3, 2]));
    assert_eq!(d.rows_to_commit(), 4);
    assert_eq!(argmax(&[2.0, 7.0, 7.0, 7.0], 0)?, 1);
    Ok(())
}

#[test]
fn malformed_inputs_are_typed_errors() -> TestResult {
    let rows: [&[f32]; 2] = [&P1, &P2];
    assert!(matches!(
        run(
            &rows,
            &[3, 1],
            DraftProbabilities::OneHot,
            &sampling(),
            &[0.1; 3]
        ),
        Err(SpecError::LogitShape { .. })
    ));
    assert!(matches!(
        run(
            &rows,
            &[9],
            DraftProbabilities::OneHot,
            &sampling(),
            &[0.1; 2]
        ),
        Err(SpecError::DraftTokenOutOfVocab { token: 9, .. })
    ));
    assert!(matches!(
        run(
            &rows,
            &[1],
            DraftProbabilities::Full(&[0.5; 3]),
            &sampling(),
            &[0.1; 2]
        ),
        Err(SpecError::DraftDistributionShape { .. })
    ));
    assert!(matches!(
        run(
            &rows,
            &[1],
            DraftProbabilities::Full(&[-0.5, 1.0, 0.5, 0.0]),
            &sampling(),
            &[0.1; 2]
        ),
        Err(SpecError::InvalidDraftDistribution { .. })
    ));
    let nan_logits = [0.0, f32::NAN, 0.0, 0.0];
    assert!(matches!(
        decide(
            LogitRows::new(&nan_logits, 1, 4)?,
            &[],
            DraftProbabilities::OneHot,
            &AcceptanceRule::Greedy,
            &[]
        ),
        Err(SpecError::Sampling(SamplingError::NonFiniteLogit {
            token: 1,
            ..
        }))
    ));
    assert!(matches!(
        LogitRows::new(&nan_logits, 2, 4),
        Err(SpecError::LogitShape { .. })
    ));
    let too_many = [0u32; 16];
    let logits = vec![0.0f32; 17 * 4];
    assert!(matches!(
        decide(
            LogitRows::new(&logits, 17, 4)?,
            &too_many,
            DraftProbabilities::OneHot,
            &AcceptanceRule::Greedy,
            &[]
        ),
        Err(SpecError::TooManyDrafts { drafts: 16, .. })
    ));
    Ok(())
}

#[test]
fn sampler_processing_matches_hand_computation() -> TestResult {
    let logits = [2.0f32, 1.0, 0.0, -1.0];
    let e: Vec<f64> = logits.iter().map(|&l| f64::from(l).exp()).collect();
    let total: f64 = e.iter().sum();
    let mut processor = LogitProcessor::new();
    let mut p = Vec::new();
    let close = |a: f32, b: f64| (f64::from(a) - b).abs() < 1e-6;

    processor.probabilities(&logits, &SamplingConfig::with_temperature(1.0), 0, &mut p)?;
    for (got, want) in p.iter().zip(&e) {
        assert!(close(*got, want / total), "{p:?}");
    }
    // Temperature 0.5 doubles the logits.
    processor.probabilities(&logits, &SamplingConfig::with_temperature(0.5), 0, &mut p)?;
    let e2: Vec<f64> = logits.iter().map(|&l| f64::from(2.0 * l).exp()).collect();
    let total2: f64 = e2.iter().sum();
    assert!(
        close(p[0], e2[0] / total2) && close(p[3], e2[3] / total2),
        "{p:?}"
    );
    // Top-k 2 keeps tokens 0 and 1.
    let top_k = SamplingConfig {
        temperature: 1.0,
        top_k: 2,
        top_p: 1.0,
    };
    processor.probabilities(&logits, &top_k, 0, &mut p)?;
    assert!(
        close(p[0], e[0] / (e[0] + e[1])) && p[2] == 0.0 && p[3] == 0.0,
        "{p:?}"
    );
    // Top-p 0.7: p ≈ [0.644, 0.237, 0.087, 0.032]; 0.644 < 0.7 ≤ 0.881 → tokens 0 and 1.
    let top_p = SamplingConfig {
        temperature: 1.0,
        top_k: 0,
        top_p: 0.7,
    };
    processor.probabilities(&logits, &top_p, 0, &mut p)?;
    assert!(close(p[1], e[1] / (e[0] + e[1])) && p[2] == 0.0, "{p:?}");
    // Top-p 0.6 keeps only the best token.
    let top_p = SamplingConfig {
        top_p: 0.6,
        ..top_p
    };
    processor.probabilities(&logits, &top_p, 0, &mut p)?;
    assert_eq!(p, vec![1.0, 0.0, 0.0, 0.0]);
    // Greedy → one-hot of the argmax; ties → lowest id.
    processor.probabilities(&[1.0, 4.0, 4.0], &SamplingConfig::GREEDY, 0, &mut p)?;
    assert_eq!(p, vec![0.0, 1.0, 0.0]);
    // Top-k ties keep the lower ids.
    let top_k1 = SamplingConfig {
        temperature: 1.0,
        top_k: 1,
        top_p: 1.0,
    };
    processor.probabilities(&[1.0, 4.0, 4.0], &top_k1, 0, &mut p)?;
    assert_eq!(p, vec![0.0, 1.0, 0.0]);

    // Inverse CDF skips zero-probability tokens.
    let probs = [0.25f32, 0.0, 0.5, 0.25];
    assert_eq!(sample_inverse_cdf(&probs, 0.0), Some(0));
    assert_eq!(sample_inverse_cdf(&probs, 0.25), Some(2));
    assert_eq!(sample_inverse_cdf(&probs, 0.7499), Some(2));
    assert_eq!(sample_inverse_cdf(&probs, 0.75), Some(3));
    assert_eq!(sample_inverse_cdf(&probs, 0.999_999_9), Some(3));
    assert_eq!(sample_inverse_cdf(&[0.0, 0.0], 0.5), None);

    assert!(SamplingConfig::with_temperature(-1.0).validate().is_err());
    assert!(SamplingConfig {
        top_p: 0.0,
        ..SamplingConfig::GREEDY
    }
    .validate()
    .is_err());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Statistical tests: the emitted token distribution equals the target's p.

/// χ² critical values at significance α = 0.001 for 1..=6 degrees of freedom (standard tables).
const CHI_SQUARE_CRITICAL_0_001: [f64; 6] = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458];

/// χ² statistic of `observed` against `expected` probabilities; cells with zero expected
/// probability must be empty. Returns (statistic, degrees of freedom).
fn chi_square(observed: &[u64], expected: &[f32]) -> (f64, usize) {
    let n: u64 = observed.iter().sum();
    let mut statistic = 0.0;
    let mut cells = 0;
    for (&o, &p) in observed.iter().zip(expected) {
        if p <= 0.0 {
            assert_eq!(o, 0, "a token with zero target probability was emitted");
            continue;
        }
        let e = n as f64 * f64::from(p);
        statistic += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    (statistic, cells - 1)
}

fn assert_matches(observed: &[u64], expected: &[f32], what: &str) {
    let (statistic, df) = chi_square(observed, expected);
    let critical = CHI_SQUARE_CRITICAL_0_001[df - 1];
    assert!(
        statistic < critical,
        "{what}: χ² = {statistic:.2} ≥ {critical} (df {df}, α = 0.001); observed {observed:?}, p {expected:?}"
    );
}

const TARGET_ROW_1: [f32; 6] = [0.30, 0.05, 0.25, 0.10, 0.20, 0.10];
const TARGET_ROW_2: [f32; 6] = [0.05, 0.40, 0.05, 0.20, 0.10, 0.20];
const DRAFT_ROW_1: [f32; 6] = [0.10, 0.30, 0.30, 0.05, 0.05, 0.20];
const DRAFT_ROW_2: [f32; 6] = [0.20, 0.20, 0.10, 0.30, 0.10, 0.10];
const SAMPLES: usize = 100_000;

/// Runs `SAMPLES` rounds of two drafts drawn from the draft rows, counting the first emitted
/// token, and the second one on rounds that accepted the first draft.
fn sample_rounds(
    one_hot: bool,
    config: &SamplingConfig,
    seed: u64,
) -> Result<([u64; 6], [u64; 6]), SpecError> {
    let logits = logits_for(&[&TARGET_ROW_1, &TARGET_ROW_2, &TARGET_ROW_1]);
    let rows = LogitRows::new(&logits, 3, 6)?;
    let q: Vec<f32> = DRAFT_ROW_1
        .iter()
        .chain(DRAFT_ROW_2.iter())
        .copied()
        .collect();
    let rule = AcceptanceRule::Sampling(config.clone());
    let mut rng = Rng::new(seed);
    let mut first = [0u64; 6];
    let mut second = [0u64; 6];
    let mut workspace = xdna::spec::DecideWorkspace::new();
    for _ in 0..SAMPLES {
        let d1 = sample_inverse_cdf(&DRAFT_ROW_1, rng.uniform()).unwrap_or(0);
        let d2 = sample_inverse_cdf(&DRAFT_ROW_2, rng.uniform()).unwrap_or(0);
        let uniforms = [rng.uniform(), rng.uniform(), rng.uniform()];
        let probabilities = if one_hot {
            DraftProbabilities::OneHot
        } else {
            DraftProbabilities::Full(&q)
        };
        let decision = workspace.decide(rows, &[d1, d2], probabilities, &rule, &uniforms)?;
        first[decision.emitted[0] as usize] += 1;
        if decision.accepted >= 1 {
            second[decision.emitted[1] as usize] += 1;
        }
    }
    Ok((first, second))
}

#[test]
fn leviathan_rule_preserves_the_target_distribution() -> TestResult {
    let config = SamplingConfig::with_temperature(1.0);
    let (first, second) = sample_rounds(false, &config, 11)?;
    assert_matches(&first, &TARGET_ROW_1, "first token, Leviathan rule");
    assert_matches(
        &second,
        &TARGET_ROW_2,
        "second token given draft 1 accepted, Leviathan rule",
    );
    Ok(())
}

#[test]
fn one_hot_rule_preserves_the_target_distribution() -> TestResult {
    let config = SamplingConfig::with_temperature(1.0);
    let (first, second) = sample_rounds(true, &config, 12)?;
    assert_matches(&first, &TARGET_ROW_1, "first token, one-hot rule");
    assert_matches(
        &second,
        &TARGET_ROW_2,
        "second token given draft 1 accepted, one-hot rule",
    );
    Ok(())
}

#[test]
fn rule_uses_the_processed_distribution_with_top_k_and_temperature() -> TestResult {
    // The emitted distribution is the sampler's processed p (temperature 0.7, top-k 4), not the
    // raw softmax: tokens cut by top-k never appear.
    let config = SamplingConfig {
        temperature: 0.7,
        top_k: 4,
        top_p: 1.0,
    };
    let logits = logits_for(&[&TARGET_ROW_1]);
    let mut expected = Vec::new();
    LogitProcessor::new().probabilities(&logits, &config, 0, &mut expected)?;
    assert_eq!(expected.iter().filter(|&&p| p == 0.0).count(), 2);
    for one_hot in [false, true] {
        let (first, _) = sample_rounds(one_hot, &config, 13 + one_hot as u64)?;
        assert_matches(&first, &expected, "first token, processed p");
    }
    Ok(())
}

/// Cost of `decide` on a full 16-row pass at SmolLM2's vocabulary (49152); run with
/// `cargo test --release --test spec_decide -- --ignored --nocapture`.
#[test]
#[ignore = "timing report, not a check"]
fn decide_cost_at_smollm_vocabulary() -> TestResult {
    const VOCAB: usize = 49_152;
    let mut rng = Rng::new(3);
    let logits: Vec<f32> = (0..16 * VOCAB)
        .map(|_| (rng.uniform() * 12.0 - 6.0) as f32)
        .collect();
    let rows = LogitRows::new(&logits, 16, VOCAB)?;
    let mut workspace = xdna::spec::DecideWorkspace::new();
    let mut drafts = Vec::new();
    for row in 0..15 {
        drafts.push(argmax(
            rows.row(row).ok_or(SamplingError::NoFiniteLogit { row })?,
            row,
        )?);
    }
    let configs = [
        ("greedy", AcceptanceRule::Greedy),
        (
            "T=0.8",
            AcceptanceRule::Sampling(SamplingConfig::with_temperature(0.8)),
        ),
        (
            "T=0.8 top-k 40",
            AcceptanceRule::Sampling(SamplingConfig {
                temperature: 0.8,
                top_k: 40,
                top_p: 1.0,
            }),
        ),
        (
            "T=0.8 top-p 0.9",
            AcceptanceRule::Sampling(SamplingConfig {
                temperature: 0.8,
                top_k: 0,
                top_p: 0.9,
            }),
        ),
    ];
    for (name, rule) in configs {
        let uniforms = vec![0.0; uniforms_needed(&rule, 15)];
        let start = std::time::Instant::now();
        let reps = 20;
        for _ in 0..reps {
            workspace.decide(rows, &drafts, DraftProbabilities::OneHot, &rule, &uniforms)?;
        }
        let per_call = start.elapsed().as_secs_f64() / reps as f64;
        println!(
            "decide, 16 rows × {VOCAB}, all accepted, {name}: {:.3} ms",
            per_call * 1e3
        );
    }
    Ok(())
}

/// The processing written the obvious way: sort everything by (logit desc, id asc), keep top-k,
/// softmax, keep the shortest prefix reaching top-p, renormalize.
fn reference_probabilities(logits: &[f32], config: &SamplingConfig) -> Vec<f64> {
    let mut order: Vec<usize> = (0..logits.len())
        .filter(|&t| logits[t] != f32::NEG_INFINITY)
        .collect();
    order.sort_by(|&a, &b| {
        logits[b]
            .partial_cmp(&logits[a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    if config.top_k > 0 {
        order.truncate(config.top_k);
    }
    let max = f64::from(logits[order[0]]);
    let weights: Vec<f64> = order
        .iter()
        .map(|&t| ((f64::from(logits[t]) - max) / f64::from(config.temperature)).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut kept = order.len();
    if config.top_p < 1.0 {
        let mut cumulative = 0.0;
        for (i, w) in weights.iter().enumerate() {
            cumulative += w;
            if cumulative >= f64::from(config.top_p) * total {
                kept = i + 1;
                break;
            }
        }
    }
    let kept_total: f64 = weights[..kept].iter().sum();
    let mut p = vec![0.0; logits.len()];
    for (&t, &w) in order[..kept].iter().zip(&weights[..kept]) {
        p[t] = w / kept_total;
    }
    p
}

#[test]
fn processing_matches_a_full_sort_reference() -> TestResult {
    let mut rng = Rng::new(77);
    let mut processor = LogitProcessor::new();
    let mut p = Vec::new();
    let mut compared = 0;
    for case in 0..400 {
        let vocab = 1 + (rng.next_u64() % 3000) as usize;
        // Coarse logits (many exact ties), some −∞, varying spread.
        let spread = [0.5, 3.0, 12.0, 40.0][case % 4];
        let logits: Vec<f32> = (0..vocab)
            .map(|t| {
                if t > 0 && rng.uniform() < 0.05 {
                    f32::NEG_INFINITY
                } else {
                    ((rng.uniform() * spread * 8.0).round() / 8.0) as f32
                }
            })
            .collect();
        let config = SamplingConfig {
            temperature: [0.3, 0.7, 1.0, 1.5][(case / 4) % 4] as f32,
            top_k: [0, 1, 5, 50, 5000][case % 5],
            top_p: [1.0, 0.95, 0.5, 0.9, 0.1, 0.999][case % 6],
        };
        processor.probabilities(&logits, &config, 0, &mut p)?;
        let reference = reference_probabilities(&logits, &config);
        for (token, (&got, &want)) in p.iter().zip(&reference).enumerate() {
            // Same support, same values.
            assert_eq!(
                got == 0.0,
                want == 0.0,
                "case {case}, token {token}: {got} vs {want}, {config:?}"
            );
            assert!(
                (f64::from(got) - want).abs() <= 1e-6 + 1e-5 * want,
                "case {case}, token {token}: {got} vs {want}"
            );
        }
        compared += 1;
    }
    assert_eq!(compared, 400);
    Ok(())
}
