//! Acceptance measurement without the target: replay a drafter over a recorded greedy
//! continuation (`xdna spec-acceptance`), and project the speedup from measured pass costs.

use super::decide::AcceptanceRule;
use super::drafter::{DraftProposal, Drafter};
use super::stats::SpecStats;
use super::target::TapRows;
use super::SpecError;

/// The target's hidden states of every position a replay commits, for drafters that read them
/// ([`Drafter::target_taps`]): position-major, `[positions][taps][hidden]`, position `i` being
/// the state after reading token `i` of prompt + continuation. Computed by one tapped prefill
/// over those tokens (teacher-forced: the continuation is the target's own greedy output, so
/// these are the rows a greedy speculative run commits, up to the rounding of its pass shapes).
#[derive(Clone, Copy, Debug)]
pub struct ReplayTaps<'a> {
    /// `[positions][taps][hidden]`.
    pub states: &'a [f32],
    /// Tap layers per position.
    pub taps: usize,
    /// Floats per hidden state.
    pub hidden: usize,
}

impl ReplayTaps<'_> {
    fn positions(&self) -> usize {
        self.states.len() / (self.taps * self.hidden).max(1)
    }

    /// Hand positions `range` to the drafter as `[taps, rows, hidden]` (`buf` reused).
    fn feed(
        &self,
        drafter: &mut dyn Drafter,
        range: std::ops::Range<usize>,
        buf: &mut Vec<f32>,
    ) -> Result<(), SpecError> {
        if range.is_empty() {
            return Ok(());
        }
        if range.end > self.positions() {
            return Err(SpecError::Drafter {
                drafter: drafter.name(),
                source: format!(
                    "the replay needs the target's hidden states of {} positions, {} were computed",
                    range.end,
                    self.positions()
                )
                .into(),
            });
        }
        let (taps, hidden, rows) = (self.taps, self.hidden, range.len());
        buf.clear();
        buf.resize(taps * rows * hidden, 0.0);
        for (r, pos) in range.enumerate() {
            for t in 0..taps {
                let src = (pos * taps + t) * hidden;
                let dst = (t * rows + r) * hidden;
                buf[dst..dst + hidden].copy_from_slice(&self.states[src..src + hidden]);
            }
        }
        let view = TapRows::new(buf, taps, rows, hidden).ok_or_else(|| SpecError::Drafter {
            drafter: drafter.name(),
            source: "tap rows of an inconsistent size".into(),
        })?;
        drafter.observe_target_rows(view)
    }
}

/// The replay of one continuation: the statistics the speculative loop would have produced.
///
/// `context` is the prompt (its last token pending), `continuation` the target's greedy tokens.
/// Draft lengths are fixed at `min(max_drafts, remaining − 1)` (no adaptive k, no fallback), so
/// the numbers describe the drafter alone.
pub fn replay_acceptance(
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    continuation: &[u32],
    max_drafts: usize,
) -> Result<SpecStats, SpecError> {
    replay_acceptance_tapped(drafter, prompt, continuation, max_drafts, None)
}

/// [`replay_acceptance`] for a drafter that reads the target's hidden states (a DFlash draft):
/// before each proposal it is handed the states of every position committed since the last one
/// (the prompt's, less its pending last token, first), as the speculative loop hands them over.
/// `taps` must cover prompt + continuation less its last token; `None` for drafters that read
/// none.
pub fn replay_acceptance_tapped(
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    continuation: &[u32],
    max_drafts: usize,
    taps: Option<ReplayTaps<'_>>,
) -> Result<SpecStats, SpecError> {
    if !drafter.target_taps().is_empty() && taps.is_none() {
        return Err(SpecError::TargetTaps {
            drafter: drafter.name(),
        });
    }
    let mut stats = SpecStats::default();
    let mut context = prompt.to_vec();
    let mut proposal = DraftProposal::new();
    let mut committed = 0;
    let mut buf = Vec::new();
    // Positions whose states the drafter holds: committed ones, the pending token excluded.
    let mut fed = 0;
    let mut feed = |drafter: &mut dyn Drafter, context_len: usize| -> Result<(), SpecError> {
        if let Some(t) = &taps {
            let upto = context_len.saturating_sub(1);
            t.feed(drafter, fed..upto, &mut buf)?;
            fed = upto;
        }
        Ok(())
    };
    feed(drafter, context.len())?;
    drafter.begin(&context)?;
    while committed < continuation.len() {
        let remaining = continuation.len() - committed;
        let k = max_drafts.min(remaining - 1);
        let accepted = if k > 0 {
            drafter.propose(&context, k, &AcceptanceRule::Greedy, &mut proposal)?;
            proposal.truncate(k);
            let expected = &continuation[committed..];
            let accepted = proposal
                .tokens()
                .iter()
                .zip(expected)
                .take_while(|(draft, target)| draft == target)
                .count();
            if proposal.is_empty() {
                stats.plain_steps += 1;
            } else {
                stats.record_round(proposal.len(), accepted);
            }
            accepted
        } else {
            stats.plain_steps += 1;
            0
        };
        let emitted = accepted + 1;
        context.extend_from_slice(&continuation[committed..committed + emitted]);
        committed += emitted;
        stats.emitted += emitted as u64;
        feed(drafter, context.len())?;
        drafter.observe(&context, accepted)?;
    }
    Ok(stats)
}

/// Projected speedups over plain decoding (formulas in `docs/speculative.md`):
/// one-pass round `N·s / (R·p + Z·s)`, two-pass round `N·s / (R·2p + Z·s)`, with `N` tokens,
/// `R` rounds with drafts, `Z` zero-draft steps, `p` = pass ms, `s` = step ms.
pub fn projected_speedups(stats: &SpecStats, pass_ms: f64, step_ms: f64) -> (f64, f64) {
    let tokens = stats.emitted as f64;
    let (rounds, plain) = (stats.rounds as f64, stats.plain_steps as f64);
    let plain_time = tokens * step_ms;
    let one_pass = rounds * pass_ms + plain * step_ms;
    let two_pass = rounds * 2.0 * pass_ms + plain * step_ms;
    (plain_time / one_pass, plain_time / two_pass)
}
