//! Acceptance measurement without the target: replay a drafter over a recorded greedy
//! continuation (`xdna spec-acceptance`), and project the speedup from measured pass costs.

use super::decide::AcceptanceRule;
use super::drafter::{DraftProposal, Drafter};
use super::stats::SpecStats;
use super::SpecError;

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
    let mut stats = SpecStats::default();
    let mut context = prompt.to_vec();
    let mut proposal = DraftProposal::new();
    let mut committed = 0;
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
