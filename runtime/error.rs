//! The crate-wide error: one variant per layer, each layer's own typed error inside.

use std::path::PathBuf;

/// Any error the xdna library can return.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device layer failed: opening or querying the device, a buffer, context or command.
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    /// A kernel failed: a kernel file, a missing or mismatched kernel, or its execution.
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelError),
    /// Reading weights failed: a package, GGUF or safetensors file, an import, the tokenizer.
    #[error(transparent)]
    Weights(#[from] crate::weights::WeightsError),
    /// The model refused its description or an input, or a forward pass failed.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// Sampling settings or logits refused by `model::sampling` (plain decoding).
    #[error(transparent)]
    Sampling(#[from] crate::model::sampling::SamplingError),
    /// Speculative decoding failed: a drafter, its settings or the verify loop.
    #[error(transparent)]
    Spec(#[from] crate::spec::SpecError),
    /// An I/O operation on a file failed outside the layers' own errors.
    #[error("{path}: {source}")]
    Io {
        /// The file the operation concerned.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A caller's request makes no sense (bad arguments, conflicting options); the message says
    /// which and why.
    #[error("{0}")]
    Usage(String),
}

/// Result with the crate-wide [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An I/O error that names the file it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
