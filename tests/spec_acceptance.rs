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

/// A drafter reading the target's hidden states, as a DFlash draft does: it checks that it holds
/// exactly the committed positions' states, in order, whenever it is asked, and drafts the
/// recorded continuation's next three tokens with the second one wrong.
struct TapReader {
    taps: Vec<usize>,
    hidden: usize,
    /// Positions whose states arrived, in arrival order.
    seen: Vec<usize>,
    continuation_at: Vec<u32>,
}

impl xdna::spec::Drafter for TapReader {
    fn name(&self) -> &'static str {
        "tap-reader"
    }
    fn begin(&mut self, context: &[u32]) -> Result<(), xdna::spec::SpecError> {
        assert_eq!(
            self.seen.len(),
            context.len() - 1,
            "begin: committed rows held"
        );
        Ok(())
    }
    fn propose(
        &mut self,
        context: &[u32],
        max_drafts: usize,
        _rule: &xdna::spec::AcceptanceRule,
        out: &mut xdna::spec::DraftProposal,
    ) -> Result<(), xdna::spec::SpecError> {
        assert_eq!(
            self.seen.len(),
            context.len() - 1,
            "propose: committed rows held"
        );
        out.reset(true, 100);
        let next = context.len();
        for i in 0..max_drafts.min(3) {
            let t = self.continuation_at.get(next + i).copied().unwrap_or(0);
            out.push_one_hot(if i == 1 { t + 1 } else { t });
        }
        Ok(())
    }
    fn target_taps(&self) -> &[usize] {
        &self.taps
    }
    fn observe_target_rows(
        &mut self,
        rows: xdna::spec::TapRows<'_>,
    ) -> Result<(), xdna::spec::SpecError> {
        assert_eq!((rows.taps(), rows.hidden()), (2, self.hidden));
        for r in 0..rows.rows() {
            // Position p's state at tap t is filled with 10·p + t.
            let p = rows.state(0, r)[0] as usize / 10;
            for t in 0..2 {
                assert!(rows.state(t, r).iter().all(|&v| v == (10 * p + t) as f32));
            }
            assert_eq!(
                p,
                self.seen.len(),
                "rows arrive in position order, each once"
            );
            self.seen.push(p);
        }
        Ok(())
    }
}

#[test]
fn tapped_replay_hands_over_every_committed_row_once_in_order() {
    use xdna::spec::{replay_acceptance_tapped, ReplayTaps};
    let prompt = [5u32, 6, 7];
    let continuation = [10u32, 11, 12, 13, 14, 15, 16, 17];
    let all: Vec<u32> = prompt.iter().chain(&continuation).copied().collect();
    let hidden = 4;
    // States of every fed position (all tokens but the last): [positions][taps][hidden].
    let mut states = Vec::new();
    for p in 0..all.len() - 1 {
        for t in 0..2 {
            states.extend(std::iter::repeat_n((10 * p + t) as f32, hidden));
        }
    }
    let mut drafter = TapReader {
        taps: vec![3, 9],
        hidden,
        seen: Vec::new(),
        continuation_at: all.clone(),
    };
    let taps = ReplayTaps {
        states: &states,
        taps: 2,
        hidden,
    };
    let stats = replay_acceptance_tapped(&mut drafter, &prompt, &continuation, 4, Some(taps))
        .expect("replay");
    // Each round drafts the right token then a wrong one: accepted 1, emitted 2. Eight tokens:
    // three such rounds (6), then two left: k = 1 round (accepted 1, emitted 2).
    assert_eq!((stats.rounds, stats.accepted, stats.emitted), (4, 4, 8));
    // The drafter saw every position up to the last committed one.
    assert_eq!(drafter.seen, (0..all.len() - 1).collect::<Vec<_>>());

    // A drafter that reads hidden states cannot be replayed without them.
    let mut drafter = TapReader {
        taps: vec![3, 9],
        hidden,
        seen: Vec::new(),
        continuation_at: all.clone(),
    };
    let err = replay_acceptance_tapped(&mut drafter, &prompt, &continuation, 4, None)
        .expect_err("no states");
    assert!(err.to_string().contains("hidden states"), "{err}");
    // Too few states: refused, naming how many were needed.
    let short = ReplayTaps {
        states: &states[..states.len() - 2 * hidden],
        taps: 2,
        hidden,
    };
    let mut drafter = TapReader {
        taps: vec![3, 9],
        hidden,
        seen: Vec::new(),
        continuation_at: all,
    };
    let err = replay_acceptance_tapped(&mut drafter, &prompt, &continuation, 4, Some(short))
        .expect_err("short");
    assert!(err.to_string().contains("10 positions"), "{err}");
}
