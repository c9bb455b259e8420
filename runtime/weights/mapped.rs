//! [`MappedBytes`]: bytes of a package's weights file, read in place from its read-only mapping.

use super::{Package, WeightsError};
use std::ops::{Deref, Range};
use std::sync::Arc;

/// A range of a package's weights file, read in place from the package's read-only mapping, which
/// it keeps alive: what a projection or an embedding table holds instead of a copy of its matrix.
///
/// Dereferences to the bytes (`&[u8]`): an `Arc` deref and a bounds-checked slice of the mapping,
/// with no reference-count traffic, so a per-call borrow costs nothing measurable.
#[derive(Clone)]
pub struct MappedBytes {
    package: Arc<Package>,
    /// Byte offsets into the package's weights file.
    range: Range<usize>,
}

impl MappedBytes {
    /// The bytes `data`, which must lie inside `package`'s weights file mapping (as the bytes of
    /// a [`super::MatrixView`] of the package do).
    pub fn new(package: &Arc<Package>, data: &[u8]) -> Result<MappedBytes, WeightsError> {
        let file = package.weights().file_bytes();
        let start = (data.as_ptr() as usize).checked_sub(file.as_ptr() as usize);
        match start {
            Some(start) if start + data.len() <= file.len() => Ok(MappedBytes {
                package: Arc::clone(package),
                range: start..start + data.len(),
            }),
            _ => Err(WeightsError::invalid(
                package.weights().path(),
                format!(
                    "{} bytes asked for as a slice of the mapped file are not inside it",
                    data.len()
                ),
            )),
        }
    }
}

impl Deref for MappedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.package.weights().file_bytes()[self.range.clone()]
    }
}

impl std::fmt::Debug for MappedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedBytes")
            .field("file", &self.package.weights().path())
            .field("range", &self.range)
            .finish()
    }
}
