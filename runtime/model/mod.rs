//! The model layer: the fast forward pass with its KV cache and the verify contract
//! (`step_batch_all` / `commit_verify_rows`), the reference forward used by tests, sampling, and
//! streaming detokenization. See `docs/model.md`.
//!
//! # Modules
//! - [`forward`]: [`Model`], the fast forward pass over batches of rows, and the verify contract.
//! - [`layers`]: the weights a pass runs over ([`Projection`], [`Embedding`], [`Layer`],
//!   [`ModelWeights`]) and their shape checks.
//! - [`kv_cache`]: a sequence's KV cache (f16, or f32 for exact runs) and its read-only
//!   [`KvSlice`]s.
//! - [`sequence`]: a sequence's decoding state ([`SequenceState`]), committing a verify pass and
//!   replaying recurrent state ([`ReplayMode`]).
//! - [`gdn`]: Gated DeltaNet, the recurrent (linear-attention) token mixer, one token at a time.
//! - [`ops`]: host RMSNorm and RoPE.
//! - [`load`]: loading a package onto the kernels layer (Llama family), and the entry point for
//!   every package.
//! - [`load_hybrid`]: loading hybrid (Qwen3.5-style) packages in the Hugging Face layout.
//! - [`fflm_layout`]: the FastFlowLM Qwen3.5 tensor names and orders, mapped to that layout.
//! - [`synthetic`]: small deterministic random-weight packages (`xdna pack synth`).
//! - [`reference`](mod@reference): the slow reference forward, the tests' oracle; [`gguf_lite`] its own GGUF
//!   reader.
//! - [`logprobs`]: log-softmax of a logit row: a token's log-probability and the top alternatives.
//! - [`perplexity`]: perplexity by llama.cpp's method.
//! - [`replay_check`]: does a verify pass + partial commit equal plain sequential steps?
//! - [`sampling`]: sampling settings, the logit processor and the generator.
//! - [`text`]: streaming detokenization with stop strings.

pub mod dflash;
pub mod fflm_layout;
pub mod forward;
pub mod gdn;
pub mod gguf_lite;
pub mod kl_divergence;
pub mod kv_cache;
pub mod layers;
pub mod load;
pub mod load_hybrid;
pub mod logprobs;
pub mod ops;
pub mod perplexity;
pub mod reference;
pub mod replay_check;
pub mod sampling;
pub mod sequence;
pub mod synthetic;
pub mod text;

/// The kernels layer's row families (`m16` verify passes, `m128` prefill chunks).
pub use crate::kernels::RowFamily;
/// The model description the weights layer parses (config.json or GGUF metadata).
pub use crate::weights::{LayerKind, LinearAttnConfig, ModelConfig, RopeScaling};
pub use forward::{BatchOutput, Model, PassStats, MAX_PREFILL_ROWS, MAX_VERIFY_ROWS};
pub use kv_cache::KvSlice;
pub use layers::{Embedding, Layer, LayerWeights, LinearLayerWeights, ModelWeights, Projection};
#[cfg(feature = "fault-injection")]
pub use sequence::CommitFault;
pub use sequence::{LayerStateView, ReplayMode, SequenceState};

/// Errors of the model layer.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A model description field is missing or out of range.
    #[error("{file}: field {field:?}: {problem}")]
    Config {
        /// The file the description came from.
        file: String,
        /// The field.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Something the model layer does not do (an architecture, an operation on this model).
    #[error("unsupported: {what}")]
    Unsupported {
        /// What was asked for.
        what: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {problem}")]
    File {
        /// The file.
        path: String,
        /// The I/O or format error.
        problem: String,
    },
    /// A tensor the model needs is not in the package.
    #[error("tensor {name:?} missing in {file}")]
    MissingTensor {
        /// The tensor's name.
        name: String,
        /// The package file.
        file: String,
    },
    /// Loaded weights do not have the shapes the model description implies.
    #[error("shape mismatch: {what}")]
    Shape {
        /// Which tensor, expected and found.
        what: String,
    },
    /// A token id outside the vocabulary.
    #[error("token id {token} out of range (vocabulary {vocab})")]
    Token {
        /// The token id.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A context length or position out of range.
    #[error("context: {what}")]
    Context {
        /// What was out of range.
        what: String,
    },
    /// A verify pass with no rows or more than the `m16` family holds.
    #[error("a verify pass takes 1..={max} rows, got {rows} (17+ rows are refused, never run on the 128-row family)")]
    BatchRows {
        /// Rows asked for.
        rows: usize,
        /// Most rows a pass takes.
        max: usize,
    },
    /// A commit of more rows than the pending pass ran (or of none).
    #[error("commit_verify_rows({n}) out of range 1..={len}")]
    Commit {
        /// Rows asked to keep.
        n: usize,
        /// Rows of the pending pass.
        len: usize,
    },
    /// A tap layer past the layers the model runs.
    #[error("tap layer {layer} out of range (model has {layers} layers)")]
    Tap {
        /// The tap layer asked for.
        layer: usize,
        /// Layers the model runs.
        layers: usize,
    },
    /// A call that does not fit the sequence state (a pass pending, a failed pass, a state of
    /// another model).
    #[error("model state: {what}")]
    State {
        /// What does not fit.
        what: String,
    },
    /// An error of the weights layer.
    #[error(transparent)]
    Weights(#[from] crate::weights::WeightsError),
    /// An error of the kernels layer.
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelError),
    /// Anything else (an injected failure, a message from below).
    #[error("{0}")]
    Other(String),
}
