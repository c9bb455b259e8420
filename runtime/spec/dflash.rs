//! The DFlash block drafter: one draft pass per round proposes up to `block_size − 1` tokens
//! from the target's own hidden states (`model::dflash` holds the draft's forward).
//!
//! The loop hands it the target's hidden states after the draft's tap layers for every
//! committed row (prompt rows at [`SpecRunner::prefill`](super::SpecRunner::prefill), then each
//! round's kept rows), which it turns into cached context rows. A round's block is the pending
//! token then mask rows at the next positions; the drafts are each mask row's argmax
//! (generation 1) or the candidate selector's walk (generation 2), deterministic, so they are
//! proposed one-hot.

use super::decide::AcceptanceRule;
use super::drafter::{DraftProposal, Drafter};
use super::{BoxedError, SpecError, TapRows};
use crate::model::dflash::DflashDraft;

/// Drafts whole blocks with a DFlash draft bound to the target.
pub struct DflashDrafter {
    draft: DflashDraft,
    taps: Vec<usize>,
    features: Vec<f32>,
    drafts: Vec<u32>,
    vocab: usize,
}

impl DflashDrafter {
    /// Wraps `draft` (already bound to the target's weights).
    pub fn new(draft: DflashDraft) -> Self {
        let taps = draft.weights().params().target_layers.clone();
        let vocab = draft.weights().config().vocab;
        DflashDrafter {
            draft,
            taps,
            features: Vec::new(),
            drafts: Vec::new(),
            vocab,
        }
    }

    /// The draft and its cached context.
    pub fn draft(&self) -> &DflashDraft {
        &self.draft
    }

    /// The draft, for diagnostics that run blocks on the drafter's context
    /// ([`DflashDraft::block_drafts_given`]).
    pub fn draft_mut(&mut self) -> &mut DflashDraft {
        &mut self.draft
    }

    fn failed(error: impl Into<BoxedError>) -> SpecError {
        SpecError::Drafter {
            drafter: "dflash",
            source: error.into(),
        }
    }

    /// The context must be the committed target rows plus the pending token.
    fn check_context(&self, context: &[u32]) -> Result<(), SpecError> {
        let committed = context.len().saturating_sub(1);
        if self.draft.context() != committed {
            return Err(Self::failed(format!(
                "it holds the target's hidden states of {} positions, the sequence has {committed} committed (feed the prompt through SpecRunner::prefill)",
                self.draft.context()
            )));
        }
        Ok(())
    }
}

impl Drafter for DflashDrafter {
    fn name(&self) -> &'static str {
        "dflash"
    }

    fn begin(&mut self, context: &[u32]) -> Result<(), SpecError> {
        self.check_context(context)
    }

    fn propose(
        &mut self,
        context: &[u32],
        max_drafts: usize,
        _rule: &AcceptanceRule,
        out: &mut DraftProposal,
    ) -> Result<(), SpecError> {
        self.check_context(context)?;
        out.reset(true, self.vocab);
        let Some(&pending) = context.last() else {
            return Ok(());
        };
        self.draft
            .block_drafts(pending, &mut self.drafts)
            .map_err(Self::failed)?;
        for &token in self.drafts.iter().take(max_drafts) {
            out.push_one_hot(token);
        }
        Ok(())
    }

    fn target_taps(&self) -> &[usize] {
        &self.taps
    }

    fn observe_target_rows(&mut self, rows: TapRows<'_>) -> Result<(), SpecError> {
        if rows.taps() != self.taps.len() {
            return Err(Self::failed(format!(
                "{} tap layers handed over, the draft reads {}",
                rows.taps(),
                self.taps.len()
            )));
        }
        let hidden = rows.hidden();
        self.features.clear();
        self.features.reserve(rows.rows() * rows.taps() * hidden);
        for r in 0..rows.rows() {
            for t in 0..rows.taps() {
                self.features.extend_from_slice(rows.state(t, r));
            }
        }
        self.draft
            .push_context(&self.features, rows.rows())
            .map_err(Self::failed)
    }
}
