//! The drafter interface.

use super::decide::{AcceptanceRule, DraftProbabilities};
use super::{SpecError, TapRows};

/// Drafts proposed for one round, and the distribution each was drawn from.
#[derive(Clone, Debug, Default)]
pub struct DraftProposal {
    tokens: Vec<u32>,
    /// `tokens.len() × vocab` when `one_hot` is false; empty otherwise.
    distributions: Vec<f32>,
    one_hot: bool,
    vocab: usize,
}

impl DraftProposal {
    /// An empty proposal.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the proposal and declares the kind of the drafts to come: one-hot (deterministic
    /// drafts, no distribution stored) or drafts with a `vocab`-sized distribution each.
    pub fn reset(&mut self, one_hot: bool, vocab: usize) {
        self.tokens.clear();
        self.distributions.clear();
        self.one_hot = one_hot;
        self.vocab = vocab;
    }

    /// Adds a deterministic draft (the proposal must have been reset as one-hot).
    pub fn push_one_hot(&mut self, token: u32) {
        self.tokens.push(token);
    }

    /// Adds a draft drawn from `distribution` (the proposal must have been reset with a vocab).
    pub fn push_with_distribution(&mut self, token: u32, distribution: &[f32]) {
        self.tokens.push(token);
        self.distributions.extend_from_slice(distribution);
    }

    /// Keeps the first `len` drafts.
    pub fn truncate(&mut self, len: usize) {
        if len < self.tokens.len() {
            self.tokens.truncate(len);
            if !self.one_hot {
                self.distributions.truncate(len * self.vocab);
            }
        }
    }

    /// The draft tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Number of drafts.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when there are no drafts.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Vocabulary size of the distributions (meaningless for one-hot proposals).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// True when the drafts are deterministic (q one-hot).
    pub fn is_one_hot(&self) -> bool {
        self.one_hot
    }

    /// The draft distributions in the form [`decide`](super::decide) takes.
    pub fn probabilities(&self) -> DraftProbabilities<'_> {
        if self.one_hot {
            DraftProbabilities::OneHot
        } else {
            DraftProbabilities::Full(&self.distributions)
        }
    }
}

/// Proposes drafts for the speculative loop.
///
/// The loop's *context* is every token of the sequence so far (prompt and output); its last token
/// is the pending one (sampled, not yet fed to the target). Drafts continue after it.
pub trait Drafter {
    /// A short name for logs and errors.
    fn name(&self) -> &'static str;

    /// Starts a new sequence whose tokens so far are `context`.
    fn begin(&mut self, context: &[u32]) -> Result<(), SpecError>;

    /// Proposes at most `max_drafts` (≤ 15) drafts continuing `context` into `out` (which the
    /// drafter resets). Zero drafts is a valid answer. Under [`AcceptanceRule::Sampling`] a drafter
    /// that samples must report the distribution each draft was drawn from; deterministic
    /// drafters report one-hot.
    fn propose(
        &mut self,
        context: &[u32],
        max_drafts: usize,
        rule: &AcceptanceRule,
        out: &mut DraftProposal,
    ) -> Result<(), SpecError>;

    /// The round's outcome: `context` now ends with the tokens the round emitted;
    /// `accepted_drafts` of the proposal were accepted.
    fn observe(&mut self, context: &[u32], accepted_drafts: usize) -> Result<(), SpecError> {
        let _ = (context, accepted_drafts);
        Ok(())
    }

    /// Target layers whose hidden states the drafter reads (none by default). The loop asks the
    /// target for them and hands every committed row's states to
    /// [`observe_target_rows`](Self::observe_target_rows).
    fn target_taps(&self) -> &[usize] {
        &[]
    }

    /// The target's hidden states at [`target_taps`](Self::target_taps) of rows it just
    /// committed, in position order (the prompt's rows at prefill, then each round's kept rows).
    fn observe_target_rows(&mut self, rows: TapRows<'_>) -> Result<(), SpecError> {
        let _ = rows;
        Ok(())
    }
}

/// A drafter that never proposes: the loop then decodes plainly (one row per pass).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoDrafter;

impl Drafter for NoDrafter {
    fn name(&self) -> &'static str {
        "none"
    }

    fn begin(&mut self, _context: &[u32]) -> Result<(), SpecError> {
        Ok(())
    }

    fn propose(
        &mut self,
        _context: &[u32],
        _max_drafts: usize,
        _rule: &AcceptanceRule,
        out: &mut DraftProposal,
    ) -> Result<(), SpecError> {
        out.reset(true, 0);
        Ok(())
    }
}

/// A boxed drafter is a drafter (the CLI picks one at run time).
impl<D: Drafter + ?Sized> Drafter for Box<D> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn begin(&mut self, context: &[u32]) -> Result<(), SpecError> {
        (**self).begin(context)
    }

    fn propose(
        &mut self,
        context: &[u32],
        max_drafts: usize,
        rule: &AcceptanceRule,
        out: &mut DraftProposal,
    ) -> Result<(), SpecError> {
        (**self).propose(context, max_drafts, rule, out)
    }

    fn observe(&mut self, context: &[u32], accepted_drafts: usize) -> Result<(), SpecError> {
        (**self).observe(context, accepted_drafts)
    }

    fn target_taps(&self) -> &[usize] {
        (**self).target_taps()
    }

    fn observe_target_rows(&mut self, rows: TapRows<'_>) -> Result<(), SpecError> {
        (**self).observe_target_rows(rows)
    }
}
