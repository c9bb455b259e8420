//! A deterministic toy language model with the real verify-state semantics, for tests and demos.
//!
//! Logits of a row are a fixed pseudo-random function of the row's input token and the
//! `context_order` tokens before it, so plain decoding is reproducible and a speculative loop over
//! it must reproduce plain decoding token for token. It keeps committed and pending state and
//! refuses exactly what the verify contract (docs/model.md, "State and the verify contract")
//! refuses.

use std::time::Duration;

use super::draft_model::{DraftModel, EarlyExitModel};
use super::target::{VerifyTarget, MAX_VERIFY_ROWS};

/// Parameters of a [`ToyLm`].
#[derive(Clone, Debug, PartialEq)]
pub struct ToyLmConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Seed of the logit function.
    pub seed: u64,
    /// Tokens before the input token that the logits depend on (0..=4).
    pub context_order: usize,
    /// Logits lie in `[-logit_scale, logit_scale)`.
    pub logit_scale: f32,
    /// Amplitude of a second pseudo-random function added to the logits (a "perturbed" model
    /// that agrees with the unperturbed one only partly).
    pub perturbation: f32,
    /// Seed of the perturbation.
    pub perturbation_seed: u64,
    /// Simulated cost of every verify pass / feed.
    pub pass_cost: Duration,
    /// Simulated extra cost per row.
    pub row_cost: Duration,
    /// Layers, for the early-exit (layer-skip) interface.
    pub num_layers: usize,
}

impl Default for ToyLmConfig {
    fn default() -> Self {
        ToyLmConfig {
            vocab: 32,
            seed: 1,
            context_order: 2,
            logit_scale: 4.0,
            perturbation: 0.0,
            perturbation_seed: 7,
            pass_cost: Duration::ZERO,
            row_cost: Duration::ZERO,
            num_layers: 4,
        }
    }
}

/// Errors of the toy model: the verify contract's refusals.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ToyLmError {
    /// A pass (or feed) was given no tokens.
    #[error("empty batch")]
    EmptyBatch,
    /// A verify pass was given more than [`MAX_VERIFY_ROWS`] tokens.
    #[error("{rows} rows exceed the 16-row verify pass")]
    TooManyRows {
        /// Tokens given.
        rows: usize,
    },
    /// A pass, feed or truncate came while an earlier pass waits for its commit.
    #[error("a pass of {rows} rows is pending: commit it before another pass")]
    PassPending {
        /// Rows of the pending pass.
        rows: usize,
    },
    /// A commit came with no pass pending.
    #[error("commit without a pending pass")]
    NoPassToCommit,
    /// A commit kept 0 rows, or more rows than the pending pass has.
    #[error("commit of {n} rows out of range 1..={rows}")]
    CommitOutOfRange {
        /// Rows asked to keep.
        n: usize,
        /// Rows of the pending pass.
        rows: usize,
    },
    /// An input token is not in the vocabulary.
    #[error("token {token} outside the vocabulary of {vocab}")]
    TokenOutOfVocab {
        /// The token id.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A truncate asked for a position past what the model holds.
    #[error("truncate to {position} beyond the {held} positions held")]
    TruncateBeyond {
        /// The position asked for.
        position: usize,
        /// Positions held.
        held: usize,
    },
}

/// The toy model. Implements [`VerifyTarget`] (target role), [`DraftModel`] (draft role) and
/// [`EarlyExitModel`] (self-speculation role, with a separate early-exit cache).
#[derive(Clone, Debug)]
pub struct ToyLm {
    config: ToyLmConfig,
    committed: Vec<u32>,
    pending_pass: Option<Vec<u32>>,
    logits: Vec<f32>,
    early_exit_tokens: Vec<u32>,
    /// Rows of every verify pass / feed, in order.
    pub pass_rows: Vec<usize>,
    /// `n` of every successful commit, in order.
    pub commits: Vec<usize>,
}

const NO_TOKEN: u64 = u64::MAX;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl ToyLm {
    /// A model with no committed positions.
    pub fn new(config: ToyLmConfig) -> Self {
        ToyLm {
            config,
            committed: Vec::new(),
            pending_pass: None,
            logits: Vec::new(),
            early_exit_tokens: Vec::new(),
            pass_rows: Vec::new(),
            commits: Vec::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ToyLmConfig {
        &self.config
    }

    /// Committed tokens.
    pub fn committed(&self) -> &[u32] {
        &self.committed
    }

    /// Rows of the pending (uncommitted) pass, if any.
    pub fn pending_rows(&self) -> Option<usize> {
        self.pending_pass.as_ref().map(Vec::len)
    }

    /// The logits this model gives after `history` (whose last token is the input token).
    pub fn logits_after(&self, history: &[u32], perturbation: f32, out: &mut Vec<f32>) {
        out.clear();
        let order = self.config.context_order.min(4);
        let mut key = self.config.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for back in 0..=order {
            let token = history
                .len()
                .checked_sub(1 + back)
                .map_or(NO_TOKEN, |i| u64::from(history[i]));
            key = mix(key ^ token.wrapping_add(back as u64 * 0x1000_0000_0001));
        }
        let noise_key = mix(key ^ self.config.perturbation_seed);
        for v in 0..self.config.vocab as u64 {
            let base = unit(mix(key ^ v.wrapping_mul(0x2545_f491_4f6c_dd1d)));
            let noise = unit(mix(noise_key ^ v.wrapping_mul(0x2545_f491_4f6c_dd1d)));
            out.push(self.config.logit_scale * base + perturbation * noise);
        }
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), ToyLmError> {
        for &token in tokens {
            if token as usize >= self.config.vocab {
                return Err(ToyLmError::TokenOutOfVocab {
                    token,
                    vocab: self.config.vocab,
                });
            }
        }
        Ok(())
    }

    fn simulate_cost(&self, rows: usize) {
        let cost = self.config.pass_cost + self.config.row_cost * rows as u32;
        if !cost.is_zero() {
            std::thread::sleep(cost);
        }
    }

    /// Logits of every row of `tokens` fed after `prefix`, into `self.logits`.
    fn run_rows(&mut self, prefix_is_early_exit: bool, tokens: &[u32], perturbation: f32) {
        let mut history = if prefix_is_early_exit {
            self.early_exit_tokens.clone()
        } else {
            self.committed.clone()
        };
        let mut all = Vec::with_capacity(tokens.len() * self.config.vocab);
        let mut row = Vec::with_capacity(self.config.vocab);
        for &token in tokens {
            history.push(token);
            self.logits_after(&history, perturbation, &mut row);
            all.extend_from_slice(&row);
        }
        self.logits = all;
    }
}

fn unit(bits: u64) -> f32 {
    // [-1, 1)
    ((bits >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

impl VerifyTarget for ToyLm {
    type Error = ToyLmError;

    fn vocab_size(&self) -> usize {
        self.config.vocab
    }

    fn position(&self) -> usize {
        self.committed.len()
    }

    fn step_batch_all(&mut self, tokens: &[u32]) -> Result<&[f32], ToyLmError> {
        if let Some(rows) = self.pending_rows() {
            return Err(ToyLmError::PassPending { rows });
        }
        if tokens.is_empty() {
            return Err(ToyLmError::EmptyBatch);
        }
        if tokens.len() > MAX_VERIFY_ROWS {
            return Err(ToyLmError::TooManyRows { rows: tokens.len() });
        }
        self.check_tokens(tokens)?;
        self.simulate_cost(tokens.len());
        self.pass_rows.push(tokens.len());
        self.run_rows(false, tokens, self.config.perturbation);
        self.pending_pass = Some(tokens.to_vec());
        Ok(&self.logits)
    }

    fn commit_verify_rows(&mut self, n: usize) -> Result<(), ToyLmError> {
        let rows = self.pending_rows().ok_or(ToyLmError::NoPassToCommit)?;
        if n == 0 || n > rows {
            return Err(ToyLmError::CommitOutOfRange { n, rows });
        }
        if let Some(pass) = self.pending_pass.take() {
            self.committed.extend_from_slice(&pass[..n]);
        }
        self.commits.push(n);
        Ok(())
    }
}

impl DraftModel for ToyLm {
    type Error = ToyLmError;

    fn vocab_size(&self) -> usize {
        self.config.vocab
    }

    fn position(&self) -> usize {
        self.committed.len()
    }

    fn feed(&mut self, tokens: &[u32]) -> Result<&[f32], ToyLmError> {
        self.step_batch_all(tokens)?;
        self.commit_verify_rows(tokens.len())?;
        let vocab = self.config.vocab;
        let start = self.logits.len() - vocab;
        Ok(&self.logits[start..])
    }

    fn truncate(&mut self, position: usize) -> Result<(), ToyLmError> {
        if let Some(rows) = self.pending_rows() {
            return Err(ToyLmError::PassPending { rows });
        }
        if position > self.committed.len() {
            return Err(ToyLmError::TruncateBeyond {
                position,
                held: self.committed.len(),
            });
        }
        self.committed.truncate(position);
        Ok(())
    }
}

impl EarlyExitModel for ToyLm {
    type Error = ToyLmError;

    fn vocab_size(&self) -> usize {
        self.config.vocab
    }

    fn num_layers(&self) -> usize {
        self.config.num_layers
    }

    fn early_exit_position(&self) -> usize {
        self.early_exit_tokens.len()
    }

    /// The first `exit_layer` layers: the full model's logits plus a perturbation that shrinks as
    /// the exit layer deepens.
    fn early_exit_feed(&mut self, tokens: &[u32], exit_layer: usize) -> Result<&[f32], ToyLmError> {
        if tokens.is_empty() {
            return Err(ToyLmError::EmptyBatch);
        }
        self.check_tokens(tokens)?;
        let layers = self.config.num_layers.max(1) as f32;
        let skipped = layers - (exit_layer as f32).min(layers);
        let perturbation = self.config.perturbation + self.config.logit_scale * skipped / layers;
        self.run_rows(true, tokens, perturbation);
        self.early_exit_tokens.extend_from_slice(tokens);
        let start = self.logits.len() - self.config.vocab;
        Ok(&self.logits[start..])
    }

    fn early_exit_truncate(&mut self, position: usize) -> Result<(), ToyLmError> {
        if position > self.early_exit_tokens.len() {
            return Err(ToyLmError::TruncateBeyond {
                position,
                held: self.early_exit_tokens.len(),
            });
        }
        self.early_exit_tokens.truncate(position);
        Ok(())
    }
}
