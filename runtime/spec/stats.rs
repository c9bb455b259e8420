//! Speculative-decoding statistics (vLLM's conventions; see `docs/speculative.md`).

use std::fmt;

use super::target::{MAX_DRAFTS, MAX_VERIFY_ROWS};

/// Counters of a speculative run.
///
/// A *round* is a verify pass that carried at least one draft; a pass with no draft (plain
/// decoding, fallback, or a drafter miss) is a *plain step*. τ counts the bonus/correction token.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Verify passes with ≥ 1 draft.
    pub rounds: u64,
    /// Passes with no draft (one row).
    pub plain_steps: u64,
    /// Drafts proposed and verified.
    pub drafted: u64,
    /// Drafts accepted (by the rule, before any stop condition cut the output).
    pub accepted: u64,
    /// Tokens emitted to the caller.
    pub emitted: u64,
    /// `accepted_at_position[i]`: rounds whose draft `i+1` was accepted.
    pub accepted_at_position: [u64; MAX_DRAFTS],
    /// `drafted_at_position[i]`: rounds that carried a draft `i+1`.
    pub drafted_at_position: [u64; MAX_DRAFTS],
    /// `acceptance_length_histogram[a]`: rounds that accepted exactly `a` drafts.
    pub acceptance_length_histogram: [u64; MAX_VERIFY_ROWS],
    /// Times the loop switched to plain decoding because speculation did not pay.
    pub fallback_entries: u64,
    /// Speculative rounds run while falling back, to re-measure acceptance.
    pub probes: u64,
    /// Seconds spent drafting: proposals, and handing a drafter that reads the target's hidden
    /// states the rows each pass kept.
    pub draft_seconds: f64,
    /// Seconds spent in verify passes (pass, decide, commit).
    pub verify_seconds: f64,
}

impl SpecStats {
    /// Records a round with `drafted ≥ 1` drafts of which `accepted` were accepted.
    pub fn record_round(&mut self, drafted: usize, accepted: usize) {
        let drafted = drafted.min(MAX_DRAFTS);
        let accepted = accepted.min(drafted);
        self.rounds += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        for count in &mut self.drafted_at_position[..drafted] {
            *count += 1;
        }
        for count in &mut self.accepted_at_position[..accepted] {
            *count += 1;
        }
        self.acceptance_length_histogram[accepted] += 1;
    }

    /// τ: mean tokens per round including the bonus/correction (`1 + accepted / rounds`); `None`
    /// before the first round.
    pub fn mean_acceptance_length(&self) -> Option<f64> {
        (self.rounds > 0).then(|| 1.0 + self.accepted as f64 / self.rounds as f64)
    }

    /// α: accepted / drafted; `None` before the first draft.
    pub fn draft_acceptance_rate(&self) -> Option<f64> {
        (self.drafted > 0).then(|| self.accepted as f64 / self.drafted as f64)
    }

    /// Per-position acceptance rate as vLLM reports it: rounds that accepted draft `i+1` divided
    /// by all rounds; positions up to the longest draft seen.
    pub fn per_position_acceptance(&self) -> Vec<f64> {
        if self.rounds == 0 {
            return Vec::new();
        }
        let longest = self
            .drafted_at_position
            .iter()
            .rposition(|&count| count > 0)
            .map_or(0, |i| i + 1);
        self.accepted_at_position[..longest]
            .iter()
            .map(|&count| count as f64 / self.rounds as f64)
            .collect()
    }

    /// Per-position acceptance conditioned on the draft existing: accepted at `i+1` / rounds that
    /// carried a draft `i+1`.
    pub fn per_position_acceptance_given_drafted(&self) -> Vec<f64> {
        self.accepted_at_position
            .iter()
            .zip(&self.drafted_at_position)
            .take_while(|(_, &drafted)| drafted > 0)
            .map(|(&accepted, &drafted)| accepted as f64 / drafted as f64)
            .collect()
    }

    /// Adds `other`'s counters to these (to total several runs).
    pub fn merge(&mut self, other: &SpecStats) {
        self.rounds += other.rounds;
        self.plain_steps += other.plain_steps;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.emitted += other.emitted;
        for (total, add) in self
            .accepted_at_position
            .iter_mut()
            .zip(&other.accepted_at_position)
        {
            *total += add;
        }
        for (total, add) in self
            .drafted_at_position
            .iter_mut()
            .zip(&other.drafted_at_position)
        {
            *total += add;
        }
        for (total, add) in self
            .acceptance_length_histogram
            .iter_mut()
            .zip(&other.acceptance_length_histogram)
        {
            *total += add;
        }
        self.fallback_entries += other.fallback_entries;
        self.probes += other.probes;
        self.draft_seconds += other.draft_seconds;
        self.verify_seconds += other.verify_seconds;
    }

    /// Tokens emitted per verify pass (rounds and plain steps).
    pub fn tokens_per_pass(&self) -> Option<f64> {
        let passes = self.rounds + self.plain_steps;
        (passes > 0).then(|| self.emitted as f64 / passes as f64)
    }
}

impl fmt::Display for SpecStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SpecDecoding metrics: Mean acceptance length: ")?;
        match self.mean_acceptance_length() {
            Some(tau) => write!(f, "{tau:.2}")?,
            None => write!(f, "n/a")?,
        }
        write!(
            f,
            ", Accepted: {} tokens, Drafted: {} tokens, Per-position acceptance rate: ",
            self.accepted, self.drafted
        )?;
        let per_position = self.per_position_acceptance();
        if per_position.is_empty() {
            write!(f, "n/a")?;
        }
        for (i, rate) in per_position.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{rate:.3}")?;
        }
        write!(f, ", Avg Draft acceptance rate: ")?;
        match self.draft_acceptance_rate() {
            Some(rate) => write!(f, "{:.1}%", rate * 100.0)?,
            None => write!(f, "n/a")?,
        }
        write!(
            f,
            ", Rounds: {}, Plain steps: {}, Emitted: {} tokens",
            self.rounds, self.plain_steps, self.emitted
        )?;
        if let Some(per_pass) = self.tokens_per_pass() {
            write!(f, ", Tokens per pass: {per_pass:.2}")?;
        }
        if self.fallback_entries > 0 || self.probes > 0 {
            write!(
                f,
                ", Fallbacks: {}, Probes: {}",
                self.fallback_entries, self.probes
            )?;
        }
        Ok(())
    }
}
