//! Speculative decoding: drafters, the acceptance rule, the speculative loop and its statistics.
//!
//! The layer sits on top of the model's verify contract (see `docs/speculative.md` and the
//! "State and the verify contract" section of `docs/model.md`):
//!
//! - [`VerifyTarget`]: what the target model implements — `step_batch_all` (≤ 16 rows: the pending
//!   token and up to 15 drafts, one logit row per input row) and `commit_verify_rows(n)`.
//! - [`Drafter`]: proposes up to k drafts (and, for sampling, the draft distribution q at each);
//!   [`NgramDrafter`] (prompt lookup), [`DraftModelDrafter`] (any small model implementing
//!   [`DraftModel`]) and [`LayerSkipDraftModel`] (self-speculation over [`EarlyExitModel`]).
//! - [`decide`]: the pure acceptance rule (greedy, Leviathan sampling, one-hot drafts), with the
//!   caller supplying every uniform so a run is reproducible. The target distribution p comes from
//!   `model::sampling`'s logit processor, the one plain decoding uses: a round without drafts is a
//!   plain sampled step.
//! - [`SpecRunner`]: the loop — drafting, one verify pass, `decide`, commit, stop conditions,
//!   adaptive draft length and the fallback to plain decoding when speculation does not pay.
//! - [`SpecStats`]: rounds, drafted, accepted, τ, per-position acceptance, acceptance-length histogram.
//!
//! [`toy`] holds a deterministic toy language model with real verify-state semantics, used by the
//! tests and usable as a reference target.

mod acceptance;
mod decide;
mod dflash;
mod draft_model;
mod drafter;
mod model_target;
mod ngram;
mod runner;
mod stats;
mod target;
pub mod toy;

pub use acceptance::{projected_speedups, replay_acceptance, replay_acceptance_tapped, ReplayTaps};
pub use decide::{
    decide, uniforms_needed, AcceptanceRule, DecideWorkspace, Decision, DraftProbabilities,
};
pub use dflash::DflashDrafter;
pub use draft_model::{DraftModel, DraftModelDrafter, EarlyExitModel, LayerSkipDraftModel};
pub use drafter::{DraftProposal, Drafter, NoDrafter};
pub use model_target::{ModelDraft, ModelEarlyExit};
pub use ngram::{NgramConfig, NgramDrafter};
pub use runner::{
    prefill_with_verify_passes, CostModel, FallbackConfig, FinishReason, Generation, SpecConfig,
    SpecRunner, StopConditions,
};
pub use stats::SpecStats;
pub use target::{LogitRows, TapRows, VerifyTarget, MAX_DRAFTS, MAX_VERIFY_ROWS};

/// A boxed error from a collaborator of this layer (the target model or a drafter's model).
pub type BoxedError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the speculative-decoding layer.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// A uniform supplied to [`decide`] is not in `[0, 1)` (or is NaN).
    #[error("uniform #{index} = {value} is outside [0, 1)")]
    UniformOutOfRange {
        /// Index of the uniform in the slice given.
        index: usize,
        /// Its value.
        value: f64,
    },
    /// [`decide`] was given the wrong number of uniforms for the rule and draft count.
    #[error("decide needs {expected} uniforms for this rule and draft count, got {got}")]
    UniformCount {
        /// Uniforms the rule needs ([`uniforms_needed`]).
        expected: usize,
        /// Uniforms given.
        got: usize,
    },
    /// More drafts than a verify pass can carry (at most 15 besides the pending token).
    #[error("{drafts} drafts exceed the maximum of {max} per verify pass")]
    TooManyDrafts {
        /// Drafts given.
        drafts: usize,
        /// The limit ([`MAX_DRAFTS`]).
        max: usize,
    },
    /// A draft token is not in the vocabulary.
    #[error("draft #{position} is token {token}, outside the vocabulary of {vocab}")]
    DraftTokenOutOfVocab {
        /// Index of the draft in the round (0 = first draft).
        position: usize,
        /// The token id.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A logits buffer does not hold `rows × vocab` values.
    #[error("logits buffer of {len} values is not {rows} rows × vocabulary {vocab}")]
    LogitShape {
        /// Values in the buffer.
        len: usize,
        /// Rows expected.
        rows: usize,
        /// Vocabulary size (values per row).
        vocab: usize,
    },
    /// A draft-distribution buffer does not hold `drafts × vocab` values.
    #[error("draft distributions hold {got} values, expected {expected} (drafts × vocabulary)")]
    DraftDistributionShape {
        /// Values expected: drafts × vocabulary.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// A draft distribution has a negative, NaN or infinite entry, or sums to zero.
    #[error("draft distribution for draft #{position} is invalid: {reason}")]
    InvalidDraftDistribution {
        /// Index of the draft whose distribution it is.
        position: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Sampling settings out of range, or a logit row with NaN, +∞ or nothing finite.
    #[error(transparent)]
    Sampling(#[from] crate::model::sampling::SamplingError),
    /// A loop parameter is out of range.
    #[error("invalid configuration: {field} = {value} ({expected})")]
    InvalidConfig {
        /// The parameter's name.
        field: &'static str,
        /// The value given.
        value: String,
        /// The range or form it must have.
        expected: &'static str,
    },
    /// The loop's context does not match the target's state.
    #[error(
        "context of {context_len} tokens does not match the target: position {position} committed \
         plus one pending token expected"
    )]
    ContextMismatch {
        /// Tokens in the context given (committed plus pending).
        context_len: usize,
        /// The target's committed position `P`.
        position: usize,
    },
    /// The drafter's model and the target disagree on the vocabulary.
    #[error("drafter vocabulary {drafter} differs from target vocabulary {target}")]
    VocabMismatch {
        /// The target's vocabulary size.
        target: usize,
        /// The drafter model's vocabulary size.
        drafter: usize,
    },
    /// The target model failed in `operation`.
    #[error("target {operation} failed: {source}")]
    Target {
        /// The call that failed (e.g. `step_batch_all`, `commit_verify_rows`).
        operation: &'static str,
        /// The target's error.
        #[source]
        source: BoxedError,
    },
    /// The drafter reads the target's hidden states, which the target does not provide.
    #[error(
        "drafter {drafter} reads the target's hidden states, which this target does not provide"
    )]
    TargetTaps {
        /// The drafter's name.
        drafter: &'static str,
    },
    /// A drafter's model failed.
    #[error("drafter {drafter} failed: {source}")]
    Drafter {
        /// The drafter's name (e.g. `draft-model`).
        drafter: &'static str,
        /// The drafter model's error.
        #[source]
        source: BoxedError,
    },
}

impl SpecError {
    pub(crate) fn config(
        field: &'static str,
        value: impl std::fmt::Display,
        expected: &'static str,
    ) -> Self {
        SpecError::InvalidConfig {
            field,
            value: value.to_string(),
            expected,
        }
    }
}
