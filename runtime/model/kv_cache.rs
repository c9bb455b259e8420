//! The KV cache of one sequence: every attention layer's cached keys or values, in f16 (the fast
//! path) or f32 (exact runs), and the read-only slices tests and `replay-check` see.

use crate::kernels::attention;
use half::f16;

/// Cached keys or values of one layer, in the model's cache type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvSlice<'a> {
    /// The fast path's f16 cache.
    F16(&'a [f16]),
    /// An exact run's f32 cache.
    F32(&'a [f32]),
}

impl KvSlice<'_> {
    /// The values as f32 (exact for both types).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            KvSlice::F16(v) => v.iter().map(|h| h.to_f32()).collect(),
            KvSlice::F32(v) => v.to_vec(),
        }
    }
}

/// Every layer's keys (or values) of one sequence: `[ctx, kv_heads, head_dim]` per attention
/// layer, empty for GDN layers.
pub(super) enum KvCache {
    /// The fast path's cache (llama.cpp's default type): half the bytes attention streams.
    F16(Vec<Vec<f16>>),
    /// Exact runs' cache ([`ModelWeights::f32_kv_cache`](super::ModelWeights::f32_kv_cache)).
    F32(Vec<Vec<f32>>),
}

impl Default for KvCache {
    fn default() -> Self {
        KvCache::F16(Vec::new())
    }
}

impl KvCache {
    pub(super) fn new(f32_cache: bool, layers: usize, len: impl Fn(usize) -> usize) -> KvCache {
        if f32_cache {
            KvCache::F32((0..layers).map(|l| vec![0.0; len(l)]).collect())
        } else {
            // Zeroed by the allocator (fresh pages stay untouched until a position is written):
            // `vec![f16::ZERO; n]` writes every element, and a 2048-position cache faulted in
            // ~47 MB per new sequence before its first token.
            KvCache::F16(
                (0..layers)
                    .map(|l| bytemuck::zeroed_vec::<f16>(len(l)))
                    .collect(),
            )
        }
    }

    pub(super) fn layers(&self) -> usize {
        match self {
            KvCache::F16(v) => v.len(),
            KvCache::F32(v) => v.len(),
        }
    }

    pub(super) fn is_f32(&self) -> bool {
        matches!(self, KvCache::F32(_))
    }

    /// Layer `l`'s first `len` values (`None` past the last layer or for a GDN layer).
    pub(super) fn view(&self, l: usize, len: usize) -> Option<KvSlice<'_>> {
        match self {
            KvCache::F16(v) => v
                .get(l)
                .filter(|b| !b.is_empty())
                .map(|b| KvSlice::F16(&b[..len])),
            KvCache::F32(v) => v
                .get(l)
                .filter(|b| !b.is_empty())
                .map(|b| KvSlice::F32(&b[..len])),
        }
    }

    /// Copy the first `len` values of every layer of `src` (the same type and layout: the caller
    /// checked both); returns false when the types or layouts differ.
    pub(super) fn copy_prefix_from(&mut self, src: &KvCache, len: usize) -> bool {
        fn copy<T: Copy>(dst: &mut [Vec<T>], src: &[Vec<T>], len: usize) -> bool {
            let fits = dst.len() == src.len()
                && dst.iter().zip(src).all(|(d, s)| {
                    d.is_empty() == s.is_empty() && (d.is_empty() || len <= d.len().min(s.len()))
                });
            if fits {
                for (d, s) in dst.iter_mut().zip(src).filter(|(d, _)| !d.is_empty()) {
                    d[..len].copy_from_slice(&s[..len]);
                }
            }
            fits
        }
        match (self, src) {
            (KvCache::F16(d), KvCache::F16(s)) => copy(d, s, len),
            (KvCache::F32(d), KvCache::F32(s)) => copy(d, s, len),
            _ => false,
        }
    }

    /// Store `src` at values `at..at + src.len()` of layer `l`.
    pub(super) fn store(&mut self, l: usize, at: usize, src: &[f32]) {
        match self {
            KvCache::F16(v) => attention::store_kv_row(src, &mut v[l][at..at + src.len()]),
            KvCache::F32(v) => v[l][at..at + src.len()].copy_from_slice(src),
        }
    }
}

/// A cache element type the forward can attend over: how to find its layers in a [`KvCache`].
pub(super) trait CachedValue: attention::KvValue {
    /// Layer `l` of `cache` (empty when `cache` holds the other type; batches are checked to
    /// match the model's type first).
    fn layer(cache: &KvCache, l: usize) -> &[Self];
}

impl CachedValue for f16 {
    fn layer(cache: &KvCache, l: usize) -> &[f16] {
        match cache {
            KvCache::F16(v) => &v[l],
            KvCache::F32(_) => &[],
        }
    }
}

impl CachedValue for f32 {
    fn layer(cache: &KvCache, l: usize) -> &[f32] {
        match cache {
            KvCache::F32(v) => &v[l],
            KvCache::F16(_) => &[],
        }
    }
}
