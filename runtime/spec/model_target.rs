//! The model as a speculative-decoding target: the verify contract (docs/speculative.md, "The
//! contract with the model") maps one-to-one onto [`VerifyTarget`] (spec may call model, never
//! the reverse).

use super::{TapRows, VerifyTarget};
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
        Ok(self.step_batch_verify_taps(tokens)?.all_logits())
    }

    fn commit_verify_rows(&mut self, n: usize) -> Result<(), ModelError> {
        Model::commit_verify_rows(self, n)
    }

    fn request_taps(&mut self, layers: &[usize]) -> bool {
        self.set_verify_taps(layers).is_ok()
    }

    fn pass_taps(&self) -> Option<TapRows<'_>> {
        let out = self.last_pass();
        if out.tap_layers().is_empty() || out.rows() == 0 {
            return None;
        }
        TapRows::new(
            out.tap_states(),
            out.tap_layers().len(),
            out.rows(),
            self.config().hidden,
        )
    }

    fn prefill_tapped(
        &mut self,
        tokens: &[u32],
        on_rows: &mut dyn FnMut(TapRows<'_>),
    ) -> Result<(), ModelError> {
        let taps = self.verify_taps().to_vec();
        if taps.is_empty() {
            return self.prefill_with(tokens, tokens.len(), &mut |_, _| {});
        }
        let hidden = self.config().hidden;
        Model::prefill_tapped(self, tokens, &taps, &mut |out| {
            if let Some(rows) = TapRows::new(out.tap_states(), taps.len(), out.rows(), hidden) {
                on_rows(rows);
            }
        })
    }
}

/// A [`Model`] as a [`DraftModel`](super::DraftModel): a second model (or the target's weights
/// in a second state, `Model::shared`) drafting autoregressively. `feed` commits through the
/// model's prefill path (≤ 128-row chunks, one pass per chunk); `truncate` is the model's
/// `truncate` (free for attention layers).
pub struct ModelDraft {
    model: Model,
}

impl ModelDraft {
    /// Wraps `model`, forgetting its state.
    pub fn new(mut model: Model) -> Self {
        model.reset();
        ModelDraft { model }
    }

    /// The wrapped model.
    pub fn model(&self) -> &Model {
        &self.model
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
            .field("run_layers", &self.model.run_layers())
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
        crate::model::MAX_PREFILL_ROWS
    }

    fn feed(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        self.model.prefill(tokens)
    }

    fn truncate(&mut self, position: usize) -> Result<(), ModelError> {
        self.model.truncate(position)
    }
}

/// The model's layer-skip view for self-speculation: an early-exit [`Model`] sharing the
/// target's weights (`Model::early_exit`), running layers `0..E`, the final norm and the LM head,
/// with its own KV cache. It implements [`EarlyExitModel`](super::EarlyExitModel) for one exit
/// layer, the one it was built with.
pub struct ModelEarlyExit {
    view: Model,
    exit_layers: usize,
    num_layers: usize,
}

impl ModelEarlyExit {
    /// A view of `target`'s first `exit_layers` layers (`1 ≤ exit_layers < layers`) with `ctx`
    /// positions.
    pub fn new(target: &Model, ctx: usize, exit_layers: usize) -> Result<Self, ModelError> {
        let num_layers = target.config().layers;
        if exit_layers == 0 || exit_layers >= num_layers {
            return Err(ModelError::Context {
                what: format!(
                    "layer-skip exit after {exit_layers} layers: must be 1..{num_layers} (the \
                     model has {num_layers} layers; exiting after all of them is the model itself)"
                ),
            });
        }
        let view = Model::early_exit(target.weights_arc(), ctx, exit_layers)?;
        Ok(ModelEarlyExit {
            view,
            exit_layers,
            num_layers,
        })
    }

    /// The exit layer the view runs to.
    pub fn exit_layers(&self) -> usize {
        self.exit_layers
    }
}

impl std::fmt::Debug for ModelEarlyExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelEarlyExit")
            .field("exit_layers", &self.exit_layers)
            .field("num_layers", &self.num_layers)
            .field("position", &self.view.position())
            .finish()
    }
}

impl super::EarlyExitModel for ModelEarlyExit {
    type Error = ModelError;

    fn vocab_size(&self) -> usize {
        self.view.config().vocab
    }

    fn num_layers(&self) -> usize {
        self.num_layers
    }

    fn early_exit_position(&self) -> usize {
        self.view.position()
    }

    fn early_exit_feed(&mut self, tokens: &[u32], exit_layer: usize) -> Result<&[f32], ModelError> {
        if exit_layer != self.exit_layers {
            return Err(ModelError::State {
                what: format!(
                    "the early-exit view runs {} layers, asked for {exit_layer}",
                    self.exit_layers
                ),
            });
        }
        self.view.prefill(tokens)
    }

    fn early_exit_truncate(&mut self, position: usize) -> Result<(), ModelError> {
        self.view.truncate(position)
    }
}
