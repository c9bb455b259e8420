//! Model-based drafters: a small draft model sharing the target's vocabulary, and self-speculation
//! through the first layers of the target itself (LayerSkip).

use super::decide::AcceptanceRule;
use super::drafter::{DraftProposal, Drafter};
use super::target::MAX_DRAFTS;
use super::{BoxedError, SpecError};
use crate::model::sampling::{argmax, sample_inverse_cdf, LogitProcessor, Rng, SamplingError};

/// A model run autoregressively to draft: its own state (KV cache, recurrent state) and rollback.
///
/// Position `P` = number of tokens whose state the model holds. Unlike the target, a draft model
/// commits what it is fed and is rolled back explicitly with [`truncate`](Self::truncate).
pub trait DraftModel {
    /// The model's error type; the drafter wraps it in [`SpecError::Drafter`].
    type Error: std::error::Error + Send + Sync + 'static;

    /// Vocabulary size; must equal the target's.
    fn vocab_size(&self) -> usize;

    /// `P`, the number of positions held.
    fn position(&self) -> usize;

    /// Rows one [`feed`](Self::feed) call accepts at most (prefill chunk size).
    fn max_feed_rows(&self) -> usize {
        crate::model::MAX_VERIFY_ROWS
    }

    /// Runs `tokens` at positions `P..P+len` and keeps them (`P += len`); returns the logits of the
    /// last row (the distribution of the token at `P+len`).
    fn feed(&mut self, tokens: &[u32]) -> Result<&[f32], Self::Error>;

    /// Forgets every position `≥ position` (`position ≤ P`): KV truncated, recurrent state
    /// restored to what it was after `position` tokens.
    fn truncate(&mut self, position: usize) -> Result<(), Self::Error>;
}

/// Self-speculation (LayerSkip): the target's first `exit_layer` layers plus its LM head serve as
/// the draft model, with their own cache view. The model implements this; [`LayerSkipDraftModel`]
/// turns it into a [`DraftModel`].
pub trait EarlyExitModel {
    /// The model's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Vocabulary size.
    fn vocab_size(&self) -> usize;

    /// Layers in the full model.
    fn num_layers(&self) -> usize;

    /// Positions held by the early-exit cache view.
    fn early_exit_position(&self) -> usize;

    /// Runs `tokens` through layers `0..exit_layer` (then final norm + LM head) at the early-exit
    /// view's positions, keeps them, returns the last row's logits.
    fn early_exit_feed(&mut self, tokens: &[u32], exit_layer: usize)
        -> Result<&[f32], Self::Error>;

    /// Forgets early-exit positions `≥ position`.
    fn early_exit_truncate(&mut self, position: usize) -> Result<(), Self::Error>;
}

/// Adapter: an [`EarlyExitModel`] exiting at a fixed layer, as a [`DraftModel`].
#[derive(Debug)]
pub struct LayerSkipDraftModel<M> {
    model: M,
    exit_layer: usize,
}

impl<M: EarlyExitModel> LayerSkipDraftModel<M> {
    /// Drafts with the first `exit_layer` layers (`1 ≤ exit_layer < num_layers`).
    pub fn new(model: M, exit_layer: usize) -> Result<Self, SpecError> {
        if exit_layer == 0 || exit_layer >= model.num_layers() {
            return Err(SpecError::config(
                "layer-skip exit_layer",
                exit_layer,
                "in 1..num_layers",
            ));
        }
        Ok(LayerSkipDraftModel { model, exit_layer })
    }

    /// The wrapped model.
    pub fn into_inner(self) -> M {
        self.model
    }
}

impl<M: EarlyExitModel> DraftModel for LayerSkipDraftModel<M> {
    type Error = M::Error;

    fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    fn position(&self) -> usize {
        self.model.early_exit_position()
    }

    fn feed(&mut self, tokens: &[u32]) -> Result<&[f32], Self::Error> {
        self.model.early_exit_feed(tokens, self.exit_layer)
    }

    fn truncate(&mut self, position: usize) -> Result<(), Self::Error> {
        self.model.early_exit_truncate(position)
    }
}

/// Drafts by running a [`DraftModel`] k steps autoregressively.
///
/// Greedy rule: drafts are the draft model's argmax (one-hot q). Sampling rule: drafts are drawn
/// from the draft model's distribution processed with the loop's sampling configuration, and that
/// distribution is reported as q. Between rounds the drafter rolls the model back to the longest
/// prefix it shares with the new context and feeds the rest (the accepted drafts' states are reused).
#[derive(Debug)]
pub struct DraftModelDrafter<M> {
    model: M,
    /// Tokens whose state the model holds (`fed.len() == model.position()`).
    fed: Vec<u32>,
    /// Length of the context at the last proposal: the prefix known to agree with `fed`.
    agreed: usize,
    uniforms: Rng,
    processor: LogitProcessor,
    last_logits: Vec<f32>,
    distribution: Vec<f32>,
}

impl<M: DraftModel> DraftModelDrafter<M> {
    /// A drafter over `model`; `seed` drives its draft sampling.
    pub fn new(model: M, seed: u64) -> Self {
        DraftModelDrafter {
            model,
            fed: Vec::new(),
            agreed: 0,
            uniforms: Rng::new(seed),
            processor: LogitProcessor::new(),
            last_logits: Vec::new(),
            distribution: Vec::new(),
        }
    }

    /// The draft model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The draft model, mutably.
    pub fn model_mut(&mut self) -> &mut M {
        &mut self.model
    }

    fn wrap(error: M::Error) -> SpecError {
        SpecError::Drafter {
            drafter: "draft-model",
            source: Box::new(error) as BoxedError,
        }
    }

    fn truncate_to(&mut self, position: usize) -> Result<(), SpecError> {
        if position < self.fed.len() {
            self.model.truncate(position).map_err(Self::wrap)?;
            self.fed.truncate(position);
        }
        Ok(())
    }

    /// Feeds `tokens` in chunks and keeps the last row's logits in `last_logits`.
    fn feed_all(&mut self, tokens: &[u32]) -> Result<(), SpecError> {
        let chunk_rows = self.model.max_feed_rows().max(1);
        for chunk in tokens.chunks(chunk_rows) {
            let logits = self.model.feed(chunk).map_err(Self::wrap)?;
            self.last_logits.clear();
            self.last_logits.extend_from_slice(logits);
            self.fed.extend_from_slice(chunk);
        }
        Ok(())
    }

    /// Rolls back to the prefix shared with `context`, then feeds the rest so `last_logits`
    /// predicts the token after the context.
    fn catch_up(&mut self, context: &[u32]) -> Result<(), SpecError> {
        if self.fed.len() != self.model.position() || self.agreed > context.len() {
            self.agreed = 0;
        }
        let mut common = self.agreed.min(self.fed.len());
        while common < self.fed.len()
            && common < context.len()
            && self.fed[common] == context[common]
        {
            common += 1;
        }
        // The logits after the context's last token are not kept; re-feed at least that token.
        let keep = common.min(context.len().saturating_sub(1));
        self.truncate_to(keep)?;
        if self.fed.len() != self.model.position() {
            // The model's state is not what we fed it: start over.
            self.model.truncate(0).map_err(Self::wrap)?;
            self.fed.clear();
        }
        let start = self.fed.len();
        self.feed_all(&context[start..])?;
        self.agreed = context.len();
        Ok(())
    }
}

impl<M: DraftModel> Drafter for DraftModelDrafter<M> {
    fn name(&self) -> &'static str {
        "draft-model"
    }

    fn begin(&mut self, _context: &[u32]) -> Result<(), SpecError> {
        self.model.truncate(0).map_err(Self::wrap)?;
        self.fed.clear();
        self.agreed = 0;
        Ok(())
    }

    fn propose(
        &mut self,
        context: &[u32],
        max_drafts: usize,
        rule: &AcceptanceRule,
        out: &mut DraftProposal,
    ) -> Result<(), SpecError> {
        let vocab = self.model.vocab_size();
        let one_hot = matches!(rule, AcceptanceRule::Greedy);
        out.reset(one_hot, vocab);
        let max_drafts = max_drafts.min(MAX_DRAFTS);
        if max_drafts == 0 || context.is_empty() {
            return Ok(());
        }
        self.catch_up(context)?;
        for step in 0..max_drafts {
            if self.last_logits.len() != vocab {
                return Err(SpecError::LogitShape {
                    len: self.last_logits.len(),
                    rows: 1,
                    vocab,
                });
            }
            let token = match rule {
                AcceptanceRule::Greedy => {
                    let token = argmax(&self.last_logits, step)?;
                    out.push_one_hot(token);
                    token
                }
                AcceptanceRule::Sampling(config) => {
                    self.processor.probabilities(
                        &self.last_logits,
                        config,
                        step,
                        &mut self.distribution,
                    )?;
                    let u = self.uniforms.uniform();
                    let token = sample_inverse_cdf(&self.distribution, u)
                        .ok_or(SamplingError::NoFiniteLogit { row: step })?;
                    out.push_with_distribution(token, &self.distribution);
                    token
                }
            };
            if step + 1 < max_drafts {
                self.feed_all(&[token])?;
            }
        }
        Ok(())
    }
}
