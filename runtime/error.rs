//! The crate-wide error: one variant per layer, each layer's own typed error inside.

use std::path::PathBuf;

/// Any error the xdna library can return.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelError),
    #[error(transparent)]
    Weights(#[from] crate::weights::WeightsError),
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// Sampling settings or logits refused by `model::sampling` (plain decoding).
    #[error(transparent)]
    Sampling(#[from] crate::model::sampling::SamplingError),
    #[error(transparent)]
    Spec(#[from] crate::spec::SpecError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
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
