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
