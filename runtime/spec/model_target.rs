//! The model as a speculative-decoding target: the verify contract of design.md maps one-to-one
//! onto [`VerifyTarget`] (spec may call model, never the reverse).

use super::VerifyTarget;
use crate::model::{Model, ModelError};

impl VerifyTarget for Model {
    type Error = ModelError;

    fn vocab_size(&self) -> usize {
        self.config().vocab
    }

    fn position(&self) -> usize {
        Model::position(self)
    }

    fn step_batch_all(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        Ok(Model::step_batch_all(self, tokens, &[])?.all_logits())
    }

    fn commit_verify_rows(&mut self, n: usize) -> Result<(), ModelError> {
        Model::commit_verify_rows(self, n)
    }
}

/// A [`Model`] as a [`DraftModel`](super::DraftModel): a second model (or the target's weights in
/// a second state) drafting autoregressively.
///
/// `feed` commits through the model's prefill path (≤ 128-row chunks, one pass per chunk). The
/// model's public contract only moves `P` forward (verify + commit), so [`truncate`]
/// (super::DraftModel::truncate) below `P` resets the model and re-prefills the kept prefix from
/// the tokens this wrapper recorded: exact, but O(kept tokens). It is needed only after a rejected
/// draft; an identical or well-aligned draft model rarely pays it.
pub struct ModelDraft {
    model: Model,
    /// Every token whose state the model holds (`fed.len() == model.position()`).
    fed: Vec<u32>,
    /// Times `truncate` had to re-prefill (for statistics and tests).
    replays: u64,
}

impl ModelDraft {
    /// Wraps `model`, forgetting its state.
    pub fn new(mut model: Model) -> Self {
        model.reset();
        ModelDraft {
            model,
            fed: Vec::new(),
            replays: 0,
        }
    }

    /// The wrapped model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Times a truncation re-prefilled the kept prefix.
    pub fn replays(&self) -> u64 {
        self.replays
    }

    /// The wrapped model back.
    pub fn into_inner(self) -> Model {
        self.model
    }
}

impl std::fmt::Debug for ModelDraft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelDraft")
            .field("position", &self.model.position())
            .field("replays", &self.replays)
            .finish()
    }
}

impl super::DraftModel for ModelDraft {
    type Error = ModelError;

    fn vocab_size(&self) -> usize {
        self.model.config().vocab
    }

    fn position(&self) -> usize {
        self.model.position()
    }

    fn max_feed_rows(&self) -> usize {
        128
    }

    fn feed(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        let logits = self.model.prefill(tokens)?;
        self.fed.extend_from_slice(tokens);
        Ok(logits)
    }

    fn truncate(&mut self, position: usize) -> Result<(), ModelError> {
        let held = self.model.position();
        if position > held {
            return Err(ModelError::State {
                what: format!("draft model truncate to {position} beyond its {held} positions"),
            });
        }
        if position == held {
            return Ok(());
        }
        self.model.reset();
        self.fed.truncate(position);
        if position > 0 {
            self.replays += 1;
            if let Err(e) = self.model.prefill(&self.fed) {
                // Keep `fed` describing the (now empty) state, so the drafter starts over.
                self.model.reset();
                self.fed.clear();
                return Err(e);
            }
        }
        Ok(())
    }
}
