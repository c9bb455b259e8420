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

impl MappedBytes {
    /// Drop this process's resident pages of `range` (byte offsets into these bytes; whole pages
    /// inside it only). They stay in the page cache and fault back in, with the same contents, if
    /// read again: what keeps a weight that was repacked, uploaded or read once from being
    /// resident twice. Best effort.
    // madvise on a live mapping is unsafe by nature; it is sound here because these bytes are
    // always a range of the package's read-only file mapping, which nothing writes.
    #[allow(unsafe_code)]
    pub fn release_pages(&self, range: Range<usize>) {
        const PAGE: usize = 4096;
        let Some(bytes) = self.get(range) else {
            return;
        };
        let start = (bytes.as_ptr() as usize).div_ceil(PAGE) * PAGE;
        let end = (bytes.as_ptr() as usize + bytes.len()) / PAGE * PAGE;
        if end > start {
            // SAFETY: [start, end) lies inside `bytes`, a range of the package's private,
            // read-only, file-backed mapping (kept alive by `self.package`); nothing ever writes
            // it, so MADV_DONTNEED only unmaps clean page-cache pages and later reads fault the
            // same bytes back in. No Rust reference is invalidated.
            let _ = unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED)
            };
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
