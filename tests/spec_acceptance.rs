//! `replay_acceptance` and `projected_speedups` (the library side of `xdna spec-acceptance`)
//! against rounds worked out by hand.

use xdna::spec::{projected_speedups, replay_acceptance, NgramConfig, NgramDrafter, SpecStats};

fn ngram(min_n: usize, max_n: usize, max_drafts: usize) -> NgramDrafter {
    NgramDrafter::new(NgramConfig {
        min_n,
        max_n,
        max_drafts,
    })
    .expect("config")
}

#[test]
fn replay_full_acceptance_then_budget() {
    // Prompt 1 2 3 4 (4 pending), continuation 1 2 3 4 1 2 5, n-grams 1..=2, k ≤ 4.
    // Round 1: suffixes "3 4" and "4" have no earlier occurrence → zero drafts, emit 1.
    // Round 2: suffix "1" last seen at 0 → drafts 2 3 4 1, all equal to the continuation →
    //          accepted 4, emit 2 3 4 1 + 2 (the bonus).
    // Round 3: one token left → k = 0, emit 5.
    let mut drafter = ngram(1, 2, 4);
    let stats =
        replay_acceptance(&mut drafter, &[1, 2, 3, 4], &[1, 2, 3, 4, 1, 2, 5], 4).expect("replay");
    assert_eq!(
        (
            stats.rounds,
            stats.plain_steps,
            stats.drafted,
            stats.accepted,
            stats.emitted
        ),
        (1, 2, 4, 4, 7)
    );
    assert_eq!(stats.mean_acceptance_length(), Some(5.0));
    assert_eq!(stats.tokens_per_pass(), Some(7.0 / 3.0));
    assert_eq!(stats.acceptance_length_histogram[4], 1);
    assert_eq!(stats.per_position_acceptance(), vec![1.0; 4]);

    // Projection, pass 12 ms, step 10 ms: plain 7 × 10 = 70 ms; one-pass round 1 × 12 + 2 × 10 =
    // 32 ms → 2.1875×; two-pass round 1 × 24 + 2 × 10 = 44 ms → 1.5909×.
    let (one, two) = projected_speedups(&stats, 12.0, 10.0);
    assert!((one - 70.0 / 32.0).abs() < 1e-12, "{one}");
    assert!((two - 70.0 / 44.0).abs() < 1e-12, "{two}");
}

#[test]
fn replay_rejection_inside_the_drafts() {
    // Prompt 7 8 9 7 8, continuation 9 7 5 6, k ≤ 4 but capped at remaining − 1 = 3.
    // Round 1: suffix "7 8" last seen at 0 → drafts 9 7 8; the continuation has 9 7 5 → accepted
    //          2, emit 9 7 + the correction 5. Round 2: one token left → plain, emit 6.
    let mut drafter = ngram(1, 2, 4);
    let stats =
        replay_acceptance(&mut drafter, &[7, 8, 9, 7, 8], &[9, 7, 5, 6], 4).expect("replay");
    assert_eq!(
        (
            stats.rounds,
            stats.plain_steps,
            stats.drafted,
            stats.accepted,
            stats.emitted
        ),
        (1, 1, 3, 2, 4)
    );
    assert_eq!(stats.acceptance_length_histogram[2], 1);
    assert_eq!(stats.per_position_acceptance(), vec![1.0, 1.0, 0.0]);
    assert_eq!(stats.mean_acceptance_length(), Some(3.0));
    // No continuation: nothing happens.
    let empty = replay_acceptance(&mut drafter, &[1, 2], &[], 4).expect("replay");
    assert_eq!(empty, SpecStats::default());
}

#[test]
fn merged_statistics_add_up() {
    let mut drafter = ngram(1, 2, 4);
    let a = replay_acceptance(&mut drafter, &[1, 2, 3, 4], &[1, 2, 3, 4, 1, 2, 5], 4).unwrap();
    let b = replay_acceptance(&mut drafter, &[7, 8, 9, 7, 8], &[9, 7, 5, 6], 4).unwrap();
    let mut total = a.clone();
    total.merge(&b);
    assert_eq!(
        (
            total.rounds,
            total.plain_steps,
            total.drafted,
            total.accepted,
            total.emitted
        ),
        (2, 3, 7, 6, 11)
    );
    assert_eq!(total.acceptance_length_histogram[2], 1);
    assert_eq!(total.acceptance_length_histogram[4], 1);
    assert_eq!(total.drafted_at_position[..4], [2, 2, 2, 1]);
}
