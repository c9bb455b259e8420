//! Placeholder: this layer is being written (see docs/architecture.md).

/// Errors of this layer.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Other(String),
}
