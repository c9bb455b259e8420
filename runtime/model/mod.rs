//! The model layer: the fast forward pass with its KV cache and the verify contract
//! (`step_batch_all` / `commit_verify_rows`), the reference forward used by tests, sampling, and
//! streaming detokenization. See `docs/model.md`.

pub mod fflm_layout;
pub mod forward;
pub mod gdn;
pub mod gguf_lite;
pub mod kv_cache;
pub mod layers;
pub mod load;
pub mod load_hybrid;
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
    #[error("{file}: field {field:?}: {problem}")]
    Config {
        file: String,
        field: String,
        problem: String,
    },
    #[error("unsupported: {what}")]
    Unsupported { what: String },
    #[error("{path}: {problem}")]
    File { path: String, problem: String },
    #[error("tensor {name:?} missing in {file}")]
    MissingTensor { name: String, file: String },
    #[error("shape mismatch: {what}")]
    Shape { what: String },
    #[error("token id {token} out of range (vocabulary {vocab})")]
    Token { token: u32, vocab: usize },
    #[error("context: {what}")]
    Context { what: String },
    #[error("a verify pass takes 1..={max} rows, got {rows} (17+ rows are refused, never run on the 128-row family)")]
    BatchRows { rows: usize, max: usize },
    #[error("commit_verify_rows({n}) out of range 1..={len}")]
    Commit { n: usize, len: usize },
    #[error("tap layer {layer} out of range (model has {layers} layers)")]
    Tap { layer: usize, layers: usize },
    #[error("model state: {what}")]
    State { what: String },
    #[error(transparent)]
    Weights(#[from] crate::weights::WeightsError),
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelError),
    #[error("{0}")]
    Other(String),
}
