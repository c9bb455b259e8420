//! Model weights: GGUF and Q4NX (safetensors) readers, package import, tokenizer, default model.
//!
//! Everything here reads files through read-only memory maps and hands out zero-copy views.
//! No input file, however corrupt, makes this layer panic: every failure is a [`WeightsError`]
//! that names the file and the field or tensor concerned.
//!
//! # Modules
//! - [`config`]: the model description ([`ModelConfig`]), parsed once from `config.json` or GGUF
//!   metadata; model, kernels, import and tools read it.
//! - [`gguf`]: GGUF v2/v3 reader ([`gguf::GgufFile`]), metadata values, tensor views, and the
//!   scalar ggml dequantizers (F32/F16/BF16/Q4_0/Q4_1/Q8_0/Q4_K/Q6_K → f32).
//! - [`safetensors`]: safetensors / Q4NX reader ([`safetensors::SafeTensors`]) and a streaming
//!   writer ([`safetensors::Writer`]); tile grids, nibble-order detection.
//! - [`package`]: a model package ([`Package`]): config.json, model.q4nx, tokenizer files, or a
//!   `.gguf` file read directly.
//! - [`mapped`]: [`MappedBytes`], a matrix's bytes read in place from a package's mapping, which
//!   they keep alive.
//! - [`import`]: `xdna pack import`: GGUF → package (fused QKV / gate-up, f16-scale q4_1 tiles).
//! - [`dflash_check`]: `xdna pack check`, the DFlash draft gate: every rule the loaders rely on,
//!   one PASS/FAIL check each, on a package or a `dflash` GGUF; and its selftest.
//! - [`import_qwen35`]: the import's plan for Qwen3.5 (`qwen35`) hybrid GGUFs: llama.cpp's
//!   converter transforms undone into the Hugging Face layout the hybrid loader reads.
//! - [`value_heads`]: the Qwen3.5 value-head order, Hugging Face grouped ↔ llama.cpp tiled, both
//!   directions (used by the import and the FastFlowLM loader).
//! - [`tokenizer`]: byte-level BPE ([`Tokenizer`]) with the `smollm` / GPT-2 pre-tokenizer.
//! - [`default_model`](mod@default_model): fetch + import the default model (SmolLM2-135M-Instruct Q4_1).
//!
//! # Typical use (the model layer)
//! ```no_run
//! # fn main() -> Result<(), xdna::weights::WeightsError> {
//! use xdna::weights::Package;
//! let pkg = Package::open("model-dir-or-file.gguf")?;
//! let cfg = pkg.config();
//! let qkv = pkg.matrix("model.layers.0.self_attn.qkv_proj.weight", cfg.qkv_rows(), cfg.hidden)?;
//! let norm = pkg.vector("model.layers.0.input_layernorm.weight")?;
//! let mut emb = vec![0f32; cfg.hidden];
//! pkg.embedding_row(1, &mut emb)?;
//! let ids = pkg.tokenizer().encode("Hello", true);
//! # let _ = (qkv, norm, ids); Ok(()) }
//! ```

pub mod chat;
pub mod config;
pub mod default_model;
pub mod dflash_check;
pub mod gguf;
pub mod import;
pub mod import_qwen35;
pub mod mapped;
pub mod package;
pub mod safetensors;
pub mod tokenizer;
pub mod value_heads;

pub use chat::ChatMessage;
pub use config::{
    Dflash2Params, DflashParams, LayerKind, LinearAttnConfig, ModelConfig, RopeScaling,
};
pub use default_model::default_model;
pub use mapped::MappedBytes;
pub use package::{MatrixView, Package, TensorRole};
pub use tokenizer::{DecodeStream, Tokenizer};

use std::path::{Path, PathBuf};

/// Errors of this layer. Every variant names the file it concerns.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// The operating system refused an operation on a file.
    #[error("{path}: {source}")]
    Io {
        /// The file (or directory) concerned.
        path: PathBuf,
        /// What the operating system answered.
        #[source]
        source: std::io::Error,
    },
    /// The file's contents break a rule of its format; `what` names the field or tensor.
    #[error("{path}: {what}")]
    Invalid {
        /// The file concerned.
        path: PathBuf,
        /// The rule broken, naming the field or tensor.
        what: String,
    },
    /// A field of the model description (`config.json` or GGUF metadata) is missing, ill-typed
    /// or unsupported.
    #[error("{path}: field {field:?}: {problem}")]
    Config {
        /// The file the description was read from.
        path: PathBuf,
        /// The field's key (e.g. `hidden_size`, `llama.block_count`).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A tensor the caller asked for is not in the file.
    #[error("{path}: no tensor named {name:?}")]
    MissingTensor {
        /// The file searched.
        path: PathBuf,
        /// The tensor's name as asked for.
        name: String,
    },
    /// A tensor exists but does not have the expected shape, format or size.
    #[error("{path}: tensor {name:?}: {what}")]
    Tensor {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor's name.
        name: String,
        /// How it differs from what was expected.
        what: String,
    },
    /// Tokenizer construction or lookup failed.
    #[error("tokenizer ({path}): {what}")]
    Tokenizer {
        /// The file the tokenizer is built from (`tokenizer.json` or a GGUF file).
        path: PathBuf,
        /// What failed.
        what: String,
    },
    /// A package's chat template is missing, does not parse, or refuses the conversation.
    #[error("{path}: chat template: {what}")]
    ChatTemplate {
        /// The package directory.
        path: PathBuf,
        /// What failed (the template engine's message, or the template's own refusal).
        what: String,
    },
    /// Anything else (e.g. an external tool failed); the message says what.
    #[error("{0}")]
    Other(String),
}

impl WeightsError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        WeightsError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
    pub(crate) fn invalid(path: &Path, what: impl Into<String>) -> Self {
        WeightsError::Invalid {
            path: path.to_path_buf(),
            what: what.into(),
        }
    }
    pub(crate) fn tensor(path: &Path, name: &str, what: impl Into<String>) -> Self {
        WeightsError::Tensor {
            path: path.to_path_buf(),
            name: name.to_string(),
            what: what.into(),
        }
    }
    pub(crate) fn missing(path: &Path, name: &str) -> Self {
        WeightsError::MissingTensor {
            path: path.to_path_buf(),
            name: name.to_string(),
        }
    }
}

/// Map a whole file read-only. Refuses empty files (nothing to map) with a clear error.
// Mapping a file is unsafe by nature (memmap2::Mmap::map); this is the one place weights maps one.
#[allow(unsafe_code)]
pub(crate) fn map_file(path: &Path) -> Result<memmap2::Mmap, WeightsError> {
    let file = std::fs::File::open(path).map_err(|e| WeightsError::io(path, e))?;
    let len = file
        .metadata()
        .map_err(|e| WeightsError::io(path, e))?
        .len();
    if len == 0 {
        return Err(WeightsError::invalid(path, "file is empty"));
    }
    // SAFETY: the file is opened read-only and mapped privately read-only; we never hand out
    // `&mut` into it. Like every mmap-based reader we rely on nobody truncating or rewriting the
    // file while it is mapped (the package writer replaces files by atomic rename, never in place).
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| WeightsError::io(path, e))
}
