//! Grouped-query attention over a KV cache (f16, or f32 for exact verification runs): the AVX2+FMA
//! kernels, their split over the worker pool, and the scalar reference ([`attend_head`]) they are
//! tested against.
//!
//! The kernels know shapes, not models: head counts and head dim ([`AttentionShape`]), each query
//! row's heads, caches and last position ([`AttentionRow`]), slices in and out. No allocation after
//! warm-up: callers pass scratch, and the pool threads' score scratch grows to the context once.

// Unsafe is this module's job: AVX2/F16C intrinsics, and disjoint writes through the pool's handle.
#![allow(unsafe_code)]

use super::pool::{ChunkCounter, Pool, SharedMut};
use half::f16;

/// An element of a KV cache: f16 (the fast path's cache, llama.cpp's default: half the bytes of
/// the attention stream) or f32 (exact runs, whose comparisons with the f64 reference would
/// otherwise be dominated by f16 rounding). Conversions to f32 are exact.
pub trait KvValue: Copy + Send + Sync + 'static {
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// Eight values at `p` as f32.
    ///
    /// # Safety
    /// AVX2 and F16C available; 8 values readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvValue for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: 8 floats readable at p (caller contract).
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl KvValue for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: 16 readable bytes at p (caller contract).
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
    }
}

/// The dot product of f32 values with f32 or cached ones (a query with a key): eight independent
/// accumulators, which let the compiler vectorise.
#[inline]
pub fn dot<T: KvValue>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k].to_f32();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y.to_f32();
    }
    s
}

/// Store one row of keys or values in an f16 KV cache (round to nearest even, as llama.cpp's f16
/// cache does): with F16C eight at a time, otherwise one by one; the same bits either way.
pub fn store_kv_row(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "KV row width");
    #[cfg(target_arch = "x86_64")]
    if fast_attention_available() {
        // SAFETY: AVX2/F16C available (`fast_attention_available`); equal lengths (asserted).
        unsafe { avx2::store_f16(src, dst) };
        return;
    }
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(v);
    }
}

/// One query row's attention for all heads.
///
/// `q`: `[heads, hd]`; `k_cache`, `v_cache`: `[positions, kv_heads, hd]`; attends to positions
/// `0..=last`; `scores`: scratch of at least `last + 1`; `out`: `[heads, hd]`.
/// (A single-row [`attend_rows`]; the result is the same bits either way.)
#[allow(clippy::too_many_arguments)]
pub fn attend_row<T: KvValue>(
    q: &[f32],
    k_cache: &[T],
    v_cache: &[T],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    last: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let shape = AttentionShape {
        heads,
        kv_heads,
        head_dim: hd,
    };
    attend_rows(
        shape,
        1,
        &|_| AttentionRow {
            q,
            k_cache,
            v_cache,
            last,
        },
        scores,
        out,
    );
}

/// Head geometry of an attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; each serves `heads / kv_heads` query heads (grouped-query attention).
    pub kv_heads: usize,
    /// Floats per head (`hd` in the docs here).
    pub head_dim: usize,
}

/// One query row of a batched attention: its query heads `[heads, hd]`, its sequence's caches
/// (`[positions, kv_heads, hd]`) and the last position it attends to.
#[derive(Clone, Copy)]
pub struct AttentionRow<'a, T> {
    /// The row's query heads, `[heads, hd]`.
    pub q: &'a [f32],
    /// Its sequence's keys, `[positions, kv_heads, hd]`, at least `last + 1` positions.
    pub k_cache: &'a [T],
    /// Its sequence's values, same shape as `k_cache`.
    pub v_cache: &'a [T],
    /// The last cache position the row attends to (it attends to `0..=last`).
    pub last: usize,
}

/// Attention of `rows` query rows (each over its own cache and length, e.g. the rows of several
/// sequences in one batched pass): `out` is `[rows, heads, hd]`; `row(i)` describes row `i`;
/// `scores` is caller scratch of at least the longest row's `last + 1` (used when the work runs on
/// the caller alone).
///
/// Every (row, KV head) group is independent, so all of them go over the kernels' worker pool in
/// ONE dispatch (a per-row dispatch would cost `rows` pool handoffs per layer), a group per claim
/// (a decode row's groups are shared by the threads); a batch with fewer groups than threads is
/// split finer, by positions and columns (`attend_rows_split`); a batch of
/// `WHOLE_ROW_CLAIMS_MIN_ROWS` or more on the AVX2 path claims whole rows, so a row's keys are
/// read in cache-row order (`attend_rows_whole`); tiny totals run on the caller. Every head's
/// arithmetic is the same whichever path, thread or batch computes it, so a row's result does not
/// depend on its batch.
/// AVX2+FMA when the CPU has it ([`attend_head`] is the scalar reference).
pub fn attend_rows<'a, T: KvValue>(
    shape: AttentionShape,
    rows: usize,
    row: &(dyn Fn(usize) -> AttentionRow<'a, T> + Sync),
    scores: &mut [f32],
    out: &mut [f32],
) {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim: hd,
    } = shape;
    let geometry = HeadShape {
        group: heads / kv_heads,
        kvd: kv_heads * hd,
        hd,
    };
    let fast = fast_attention_available();
    let items = rows * heads;
    let work: usize = (0..rows).map(|i| (row(i).last + 1) * 2 * hd * heads).sum();
    // Below this many multiply-adds a pool dispatch costs more than it saves.
    const PARALLEL_MIN_WORK: usize = 16 * 1024;
    let pool = Pool::global();
    let out = &mut out[..items * hd];
    if items < 2 || pool.threads() < 2 || work < PARALLEL_MIN_WORK {
        for (item, oh) in out.chunks_exact_mut(hd).enumerate() {
            let (i, h) = (item / heads, item % heads);
            let r = row(i);
            let qh = &r.q[h * hd..(h + 1) * hd];
            let sc = &mut scores[..r.last + 1];
            attend_heads(fast, geometry, h, 1, qh, r.k_cache, r.v_cache, sc, oh);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if fast && hd % 8 == 0 && heads % kv_heads == 0 && rows * kv_heads < pool.threads() {
        attend_rows_split(geometry, rows, row, out, pool);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if fast && hd % 8 == 0 && heads % kv_heads == 0 && rows >= WHOLE_ROW_CLAIMS_MIN_ROWS {
        attend_rows_whole(geometry, rows, row, out, pool);
        return;
    }
    // Claim units: the query heads sharing one KV head of one row (its keys and values are then
    // read from memory once, by one core). One unit per claim: units are few and uneven (rows
    // differ in length).
    let count = if heads % kv_heads == 0 {
        geometry.group
    } else {
        1
    };
    let units = items / count;
    let counter = ChunkCounter::new(units, units, 1);
    let out = SharedMut::new(out);
    pool.run(&|_, _| {
        HEAD_SCORES.with(|cell| {
            let mut scratch = cell.borrow_mut();
            while let Some(range) = counter.claim() {
                for unit in range {
                    let (i, h0) = (unit * count / heads, unit * count % heads);
                    let r = row(i);
                    let n = r.last + 1;
                    if scratch.len() < count * n {
                        scratch.resize(count * n, 0.0);
                    }
                    // SAFETY: every (row, head) belongs to exactly one unit, claimed by exactly
                    // one thread, so the slices are disjoint.
                    let oh = unsafe {
                        out.slice_mut((i * heads + h0) * hd..(i * heads + h0 + count) * hd)
                    };
                    let qh = &r.q[h0 * hd..(h0 + count) * hd];
                    attend_heads(
                        fast,
                        geometry,
                        h0,
                        count,
                        qh,
                        r.k_cache,
                        r.v_cache,
                        &mut scratch[..count * n],
                        oh,
                    );
                }
            }
        });
    });
}

/// Rows from which [`attend_rows`] claims whole rows rather than (row, KV head) groups. Below it
/// (a decode row, a short verify pass) groups keep every thread on the row's keys at once, which
/// a whole-row claim cannot and the position split does at the cost of a second pool job
/// (`docs/performance.md`, "Attention by KV group"); a larger batch has rows enough for every
/// thread.
const WHOLE_ROW_CLAIMS_MIN_ROWS: usize = 8;

/// [`attend_rows`] for a batch with fewer KV groups than threads (a decode row of a model with
/// one KV head): two pool jobs — scores split by positions, then softmax and values by columns —
/// so the threads share every group's keys and values (each byte read once per token) instead of
/// one thread reading a whole group while the other idles. The bits are those of [`attend_heads`]
/// (see [`avx2`]).
#[cfg(target_arch = "x86_64")]
fn attend_rows_split<'a, T: KvValue>(
    g: HeadShape,
    rows: usize,
    row: &(dyn Fn(usize) -> AttentionRow<'a, T> + Sync),
    out: &mut [f32],
    pool: &Pool,
) {
    // Columns per value unit: whole cache lines, a multiple of 8.
    const COLUMN_CHUNK: usize = 32;
    let (hd, kv_heads) = (g.hd, g.kvd / g.hd);
    let heads = kv_heads * g.group;
    let positions = |i: usize| row(i).last + 1;
    // Row i's scores start at base(i): `[heads, positions(i)]` per row.
    let base = |i: usize| (0..i).map(|j| heads * positions(j)).sum::<usize>();
    // Position units: about 4 per thread per row, whole 4-position blocks.
    let span_len = |i: usize| {
        positions(i)
            .div_ceil(4 * pool.threads())
            .next_multiple_of(4)
            .max(16)
    };
    let spans = |i: usize| positions(i).div_ceil(span_len(i));
    let col_chunks = hd.div_ceil(COLUMN_CHUNK);
    SPLIT_SCORES.with(|cell| {
        let mut buf = cell.borrow_mut();
        let total = base(rows);
        if buf.len() < total {
            buf.resize(total, 0.0);
        }
        let scores = SharedMut::new(&mut buf[..total]);
        let units: usize = (0..rows).map(spans).sum();
        let counter = ChunkCounter::new(units, units, 1);
        pool.run(&|_, _| {
            while let Some(range) = counter.claim() {
                for unit in range {
                    let (mut i, mut s) = (0, unit);
                    while s >= spans(i) {
                        s -= spans(i);
                        i += 1;
                    }
                    let (r, n) = (row(i), positions(i));
                    let span = s * span_len(i)..((s + 1) * span_len(i)).min(n);
                    // SAFETY: AVX2/FMA available (caller); `buf` holds every row's `[heads, n]`
                    // scores from base(i), and this unit alone writes positions `span` of them,
                    // while the job runs inside the borrow of `buf`.
                    unsafe {
                        scores_in_cache_row_order(g, &r, span, scores.as_mut_ptr().add(base(i)))
                    };
                }
            }
        });
        // The scores job has finished: from here on they are only read.
        let scores = &buf[..total];
        let units = rows * kv_heads * col_chunks;
        let counter = ChunkCounter::new(units, units, 1);
        let out = SharedMut::new(out);
        pool.run(&|_, _| {
            HEAD_SCORES.with(|cell| {
                let mut probs = cell.borrow_mut();
                while let Some(range) = counter.claim() {
                    for unit in range {
                        let (i, kv, chunk) = (
                            unit / (kv_heads * col_chunks),
                            unit / col_chunks % kv_heads,
                            unit % col_chunks,
                        );
                        let (r, n) = (row(i), positions(i));
                        let h0 = kv * g.group;
                        let cols = chunk * COLUMN_CHUNK..((chunk + 1) * COLUMN_CHUNK).min(hd);
                        let group_scores = &scores[base(i) + h0 * n..][..g.group * n];
                        // Each column chunk takes its own copy of the group's softmax (the same
                        // function of the same scores, so the same bits): no third job, and no
                        // two units writing one buffer.
                        probs.clear();
                        probs.extend_from_slice(group_scores);
                        for head in probs.chunks_exact_mut(n) {
                            softmax_in_place(head);
                        }
                        // SAFETY: AVX2/FMA available (caller); `out` holds `rows * heads * hd`
                        // floats and this unit alone writes columns `cols` of row i's heads
                        // h0..h0 + group.
                        unsafe {
                            avx2::group_values(
                                &probs,
                                g.group,
                                r.v_cache,
                                (g.kvd, kv * hd, hd),
                                n,
                                cols,
                                out.as_mut_ptr().add((i * heads + h0) * hd),
                            )
                        };
                    }
                }
            });
        });
    });
}

/// [`attend_rows`] for a batch of rows, one row per claim: its keys are read whole cache row by
/// cache row (every KV head of 16 positions at a time, as [`attend_rows_split`] does), then its
/// values KV head by KV head. The bits are those of [`attend_heads`].
#[cfg(target_arch = "x86_64")]
fn attend_rows_whole<'a, T: KvValue>(
    g: HeadShape,
    rows: usize,
    row: &(dyn Fn(usize) -> AttentionRow<'a, T> + Sync),
    out: &mut [f32],
    pool: &Pool,
) {
    let (hd, kv_heads) = (g.hd, g.kvd / g.hd);
    let heads = kv_heads * g.group;
    let counter = ChunkCounter::new(rows, rows, 1);
    let out = SharedMut::new(out);
    pool.run(&|_, _| {
        HEAD_SCORES.with(|cell| {
            let mut scores = cell.borrow_mut();
            while let Some(range) = counter.claim() {
                for i in range {
                    let r = row(i);
                    let n = r.last + 1;
                    if scores.len() < heads * n {
                        scores.resize(heads * n, 0.0);
                    }
                    let scores = &mut scores[..heads * n];
                    // SAFETY: AVX2/FMA available (caller); `scores` holds `[heads, n]`.
                    unsafe { scores_in_cache_row_order(g, &r, 0..n, scores.as_mut_ptr()) };
                    for head in scores.chunks_exact_mut(n) {
                        softmax_in_place(head);
                    }
                    for kv in 0..kv_heads {
                        let h0 = kv * g.group;
                        // SAFETY: AVX2/FMA available (caller); `out` holds `rows * heads * hd`
                        // floats and row i (claimed by this thread alone) owns its heads'.
                        unsafe {
                            avx2::group_values(
                                &scores[h0 * n..(h0 + g.group) * n],
                                g.group,
                                r.v_cache,
                                (g.kvd, kv * hd, hd),
                                n,
                                0..hd,
                                out.as_mut_ptr().add((i * heads + h0) * hd),
                            )
                        };
                    }
                }
            }
        });
    });
}

/// Scores of positions `span` of row `r` for every head, written to `scores[h * n + t]` (`n =
/// r.last + 1`): every KV head of 16 positions at a time, so the keys are read whole cache row by
/// cache row, in order. Each score is [`avx2::group_scores`]'s, whatever the span.
///
/// # Safety
/// AVX2 and FMA available; `span` inside `0..n`; `scores` valid for writes at `h * n + t` for every
/// head h and t ∈ `span`, which no other thread touches meanwhile.
#[cfg(target_arch = "x86_64")]
unsafe fn scores_in_cache_row_order<T: KvValue>(
    g: HeadShape,
    r: &AttentionRow<'_, T>,
    span: std::ops::Range<usize>,
    scores: *mut f32,
) {
    let n = r.last + 1;
    for t in span.clone().step_by(16) {
        let block = t..(t + 16).min(span.end);
        for kv in 0..g.kvd / g.hd {
            let h0 = kv * g.group;
            // SAFETY: the caller's contract; head h0's scores start at h0 · n.
            unsafe {
                avx2::group_scores(
                    &r.q[h0 * g.hd..],
                    g.group,
                    r.k_cache,
                    (g.kvd, kv * g.hd, g.hd),
                    n,
                    block.clone(),
                    scores.add(h0 * n),
                )
            };
        }
    }
}

thread_local! {
    /// Per-thread softmax scratch of the parallel attention (grows to the context, then reused).
    static HEAD_SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The caller's `[rows, heads, positions]` scores of [`attend_rows_split`] (grows to the
    /// context, then reused).
    static SPLIT_SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Geometry of one attention row: query heads per KV head, KV row width, head dim.
#[derive(Clone, Copy)]
struct HeadShape {
    group: usize,
    kvd: usize,
    hd: usize,
}

/// Is the AVX2+FMA attention path usable on this CPU?
fn fast_attention_available() -> bool {
    super::gemm::fast_available()
}

/// Query heads `h0..h0 + count` of one row, all of the same KV head: `qs` and `out` are
/// `[count, hd]`, `scores` is `[count, n]` scratch.
#[allow(clippy::too_many_arguments)]
#[inline]
fn attend_heads<T: KvValue>(
    fast: bool,
    s: HeadShape,
    h0: usize,
    count: usize,
    qs: &[f32],
    k_cache: &[T],
    v_cache: &[T],
    scores: &mut [f32],
    out: &mut [f32],
) {
    let k_off = h0 / s.group * s.hd;
    debug_assert!(count > 0 && (h0 + count - 1) / s.group == h0 / s.group);
    let n = scores.len() / count;
    #[cfg(target_arch = "x86_64")]
    if fast && s.hd.is_multiple_of(8) {
        let dims = (s.kvd, k_off, s.hd);
        assert!(qs.len() >= count * s.hd && out.len() >= count * s.hd && n > 0);
        // SAFETY: AVX2/FMA are available (`fast`); `scores` and `out` are this call's own
        // `[count, n]` and `[count, hd]` slices (the caches are bounds-checked inside).
        unsafe {
            avx2::group_scores(qs, count, k_cache, dims, n, 0..n, scores.as_mut_ptr());
        }
        for head in scores.chunks_exact_mut(n) {
            softmax_in_place(head);
        }
        // SAFETY: as above.
        unsafe { avx2::group_values(scores, count, v_cache, dims, n, 0..s.hd, out.as_mut_ptr()) };
        return;
    }
    let _ = fast;
    for ((qh, oh), sc) in qs
        .chunks_exact(s.hd)
        .zip(out.chunks_exact_mut(s.hd))
        .zip(scores.chunks_exact_mut(n))
        .take(count)
    {
        attend_head(qh, k_cache, v_cache, s.kvd, k_off, s.hd, sc, oh);
    }
}

/// Scalar reference of one head: softmax(q·Kᵀ/√hd)·V over `scores.len()` positions, reading the
/// KV head at column `k_off` of each `[kvd]` cache row.
#[allow(clippy::too_many_arguments)]
pub fn attend_head<T: KvValue>(
    qh: &[f32],
    k_cache: &[T],
    v_cache: &[T],
    kvd: usize,
    k_off: usize,
    hd: usize,
    scores: &mut [f32],
    oh: &mut [f32],
) {
    let scale = 1.0 / (hd as f32).sqrt();
    let mut max = f32::NEG_INFINITY;
    for (t, s) in scores.iter_mut().enumerate() {
        let kt = &k_cache[t * kvd + k_off..t * kvd + k_off + hd];
        *s = dot(qh, kt) * scale;
        max = max.max(*s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    oh.fill(0.0);
    for (t, &p) in scores.iter().enumerate() {
        let w = p * inv;
        let vt = &v_cache[t * kvd + k_off..t * kvd + k_off + hd];
        for (o, &v) in oh.iter_mut().zip(vt) {
            *o += w * v.to_f32();
        }
    }
}

/// AVX2+FMA attention, in pieces that a pool can split among threads without changing a bit:
/// every position's score, every head's softmax and every output column's value sum is computed
/// by the same operations in the same order whichever piece or thread computes it.
///
/// Why pieces: a cached position costs 2·hd·2 bytes of KV (f16) per KV head and only 4·hd FLOPs per
/// query head, so decode attention is bound by that traffic. Every piece reads each key and value
/// row once for all the query heads of its KV head, and a decode row (only `kv_heads` groups) splits
/// its positions (scores) and columns (values) between the threads, so each byte is read once
/// per token by one core.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::KvValue;
    use half::f16;
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// [`super::store_kv_row`] with `vcvtps2ph` (round to nearest even, like `f16::from_f32`).
    ///
    /// # Safety
    /// AVX2 and F16C available; `src.len() == dst.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn store_f16(src: &[f32], dst: &mut [f16]) {
        debug_assert_eq!(src.len(), dst.len());
        let whole = src.len() / 8 * 8;
        let (src, src_rest) = src.split_at(whole);
        let (dst, dst_rest) = dst.split_at_mut(whole);
        for (s, d) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)) {
            // SAFETY: 8 floats readable at s, 8 halves (16 bytes) writable at d.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.as_ptr()));
                _mm_storeu_si128(d.as_mut_ptr() as *mut __m128i, h);
            }
        }
        for (d, &v) in dst_rest.iter_mut().zip(src_rest) {
            *d = f16::from_f32(v);
        }
    }

    /// Positions whose value rows are reused from L1 by every head of a group.
    const VALUE_BLOCK: usize = 32;
    /// Positions per block of [`group_scores`].
    const BLOCK: usize = 8;

    /// Scores `q·k/√hd` of positions `span` for the `count` query heads at `qs` (`[count, hd]`)
    /// over the KV head at column `k_off`, written to `scores[h * n + t]`.
    ///
    /// Eight positions at a time, each with its own accumulator chain (eight chains keep both FMA
    /// pipes busy; four left half of them idle on the FMA latency), reduced four at a time by one
    /// `hadd` tree (a position's sum does not depend on its neighbours, its block or `n`: a block
    /// past `n` recomputes the last position and does not store it); the eight key rows stay in L1
    /// while every head takes its turn.
    ///
    /// # Safety
    /// AVX2 and FMA available; `hd % 8 == 0`; `qs` holds `count * hd` floats; `span.end ≤ n`;
    /// `scores` is valid for writes at `h * n + t` for `h < count`, `t ∈ span`, and no other
    /// thread touches those floats meanwhile.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_scores<T: KvValue>(
        qs: &[f32],
        count: usize,
        k_cache: &[T],
        (kvd, k_off, hd): (usize, usize, usize),
        n: usize,
        span: Range<usize>,
        scores: *mut f32,
    ) {
        // Bounds for every raw read below: positions < n, columns k_off..k_off+hd of kvd.
        assert!(
            hd % 8 == 0
                && span.end <= n
                && qs.len() >= count * hd
                && k_off + hd <= kvd
                && k_cache.len() >= n * kvd
        );
        let scale = _mm_set1_ps(1.0 / (hd as f32).sqrt());
        let mut t = span.start;
        while t < span.end {
            let keys: [*const T; BLOCK] =
                std::array::from_fn(|j| k_cache[(t + j).min(n - 1) * kvd + k_off..].as_ptr());
            let valid = (span.end - t).min(BLOCK);
            for h in 0..count {
                let q = qs[h * hd..].as_ptr();
                let mut acc = [_mm256_setzero_ps(); BLOCK];
                let mut c = 0;
                while c < hd {
                    // SAFETY: c + 8 ≤ hd; the head's q and every key row hold hd floats from
                    // their start (asserted).
                    unsafe {
                        let qv = _mm256_loadu_ps(q.add(c));
                        for (a, k) in acc.iter_mut().zip(keys) {
                            *a = _mm256_fmadd_ps(qv, T::load8(k.add(c)), *a);
                        }
                    }
                    c += 8;
                }
                for (quad, acc) in acc.chunks_exact(4).enumerate() {
                    let pairs = _mm256_hadd_ps(
                        _mm256_hadd_ps(acc[0], acc[1]),
                        _mm256_hadd_ps(acc[2], acc[3]),
                    );
                    let sums = _mm_add_ps(
                        _mm256_castps256_ps128(pairs),
                        _mm256_extractf128_ps::<1>(pairs),
                    );
                    let mut four = [0f32; 4];
                    // SAFETY: `four` holds 4 floats.
                    unsafe { _mm_storeu_ps(four.as_mut_ptr(), _mm_mul_ps(sums, scale)) };
                    let stored = valid.saturating_sub(4 * quad).min(4);
                    for (j, &v) in four[..stored].iter().enumerate() {
                        // SAFETY: h < count and t + 4·quad + j ∈ span (caller contract).
                        unsafe { *scores.add(h * n + t + 4 * quad + j) = v };
                    }
                }
            }
            t += BLOCK;
        }
    }

    /// `out[h * hd + c] = Σ_t probs[h * n + t] · v[t][k_off + c]` for the `count` heads and the
    /// columns `cols` (multiples of 8): each column's `fma` chain runs in position order; the
    /// output columns live in registers across a block of positions (whose value rows stay in L1
    /// for the next head) and go through `out` between blocks, which does not change a bit.
    ///
    /// # Safety
    /// AVX2 and FMA available; `probs` holds `count * n` floats; `cols` is inside `0..hd` with
    /// both ends multiples of 8; `out` is valid for writes at `h * hd + c` for `h < count`,
    /// `c ∈ cols`, and no other thread touches those floats meanwhile.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_values<T: KvValue>(
        probs: &[f32],
        count: usize,
        v_cache: &[T],
        (kvd, k_off, hd): (usize, usize, usize),
        n: usize,
        cols: Range<usize>,
        out: *mut f32,
    ) {
        assert!(
            cols.start.is_multiple_of(8)
                && cols.end.is_multiple_of(8)
                && cols.end <= hd
                && k_off + hd <= kvd
                && probs.len() >= count * n
                && v_cache.len() >= n * kvd
        );
        let mut c0 = cols.start;
        while c0 < cols.end {
            let width = match cols.end - c0 {
                w if w >= 64 => 64,
                w if w >= 32 => 32,
                _ => 8,
            };
            let v0 = v_cache[k_off + c0..].as_ptr();
            // SAFETY: columns c0..c0+width of every head are inside `out` (caller contract) and
            // of every value row (asserted: c0 + width ≤ hd).
            unsafe {
                let o = out.add(c0);
                match width {
                    64 => value_columns::<T, 8>(probs, count, n, v0, kvd, o, hd),
                    32 => value_columns::<T, 4>(probs, count, n, v0, kvd, o, hd),
                    _ => value_columns::<T, 1>(probs, count, n, v0, kvd, o, hd),
                }
            }
            c0 += width;
        }
    }

    /// [`group_values`] for `8 · VECS` columns starting at `v0` (value row 0) and `out` (head 0).
    ///
    /// # Safety
    /// As [`group_values`]: `8 · VECS` floats readable at `v0 + t · kvd` for `t < n` and writable
    /// at `out + h · hd` for `h < count`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn value_columns<T: KvValue, const VECS: usize>(
        probs: &[f32],
        count: usize,
        n: usize,
        v0: *const T,
        kvd: usize,
        out: *mut f32,
        hd: usize,
    ) {
        let mut t0 = 0;
        while t0 < n {
            let t1 = (t0 + VALUE_BLOCK).min(n);
            for h in 0..count {
                // SAFETY: h < count (caller contract).
                let o = unsafe { out.add(h * hd) };
                let mut acc = [_mm256_setzero_ps(); VECS];
                if t0 > 0 {
                    for (j, a) in acc.iter_mut().enumerate() {
                        // SAFETY: 8 · VECS floats at `o` (caller contract).
                        *a = unsafe { _mm256_loadu_ps(o.add(8 * j)) };
                    }
                }
                for (t, &p) in (t0..t1).zip(&probs[h * n + t0..h * n + t1]) {
                    let w = _mm256_set1_ps(p);
                    // SAFETY: t < n: 8 · VECS floats of the value row (caller contract).
                    let v = unsafe { v0.add(t * kvd) };
                    for (j, a) in acc.iter_mut().enumerate() {
                        // SAFETY: as above, j < VECS.
                        *a = _mm256_fmadd_ps(w, unsafe { T::load8(v.add(8 * j)) }, *a);
                    }
                }
                for (j, a) in acc.iter().enumerate() {
                    // SAFETY: as above.
                    unsafe { _mm256_storeu_ps(o.add(8 * j), *a) };
                }
            }
            t0 = t1;
        }
    }
}

/// The fast path's softmax of one head's scores, in place (max, `exp`, sum and scaling, in
/// position order).
fn softmax_in_place(scores: &mut [f32]) {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let sum = super::fastexp::exp_shifted_sum(scores, max);
    let inv = 1.0 / sum;
    for s in scores.iter_mut() {
        *s *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values::uniform_values;

    #[test]
    fn attention_single_key_returns_value_and_gqa_groups() {
        // 2 heads share 1 kv head; one position → output = v.
        let q = [1.0f32, 0.0, 0.0, 1.0];
        let k = halves(&[0.5, 0.5]);
        let v = halves(&[7.0, -1.0]);
        let mut sc = [0f32; 1];
        let mut out = [0f32; 4];
        attend_row(&q, &k, &v, 2, 1, 2, 0, &mut sc, &mut out);
        assert_eq!(out, [7.0, -1.0, 7.0, -1.0]);
        // Two positions with equal scores average the values.
        let k2 = halves(&[1.0, 0.0, 1.0, 0.0]);
        let v2 = halves(&[2.0, 0.0, 4.0, 2.0]);
        let mut sc = [0f32; 2];
        let mut out = [0f32; 2];
        attend_row(&[0.0, 1.0], &k2, &v2, 1, 1, 2, 1, &mut sc, &mut out);
        assert_eq!(out, [3.0, 1.0]);
    }

    /// f16 cache values (test values here are exact in f16 or rounded on purpose).
    fn halves(v: &[f32]) -> Vec<f16> {
        v.iter().map(|&x| f16::from_f32(x)).collect()
    }

    #[test]
    fn kv_rows_are_stored_as_f16_rounded_to_nearest_even() {
        // Hand values: 1 + 2^-11 is halfway between 1 and the next f16 (1 + 2^-10): ties go to
        // the even 1.0; 1 + 3·2^-11 goes up to 1 + 2^-9 (even); 65520 overflows to infinity;
        // 2^-24 is the smallest f16 subnormal; 2^-26 rounds to zero.
        let hand = [
            (1.0 + 2f32.powi(-11), 1.0),
            (1.0 + 3.0 * 2f32.powi(-11), 1.0 + 2f32.powi(-9)),
            (65520.0, f32::INFINITY),
            (-2f32.powi(-24), -2f32.powi(-24)),
            (2f32.powi(-26), 0.0),
            (0.1, 0.099975586),
        ];
        // 13 values: one full 8-lane chunk and a 5-value tail.
        let mut src: Vec<f32> = hand.iter().map(|h| h.0).collect();
        let mut next = uniform_values(0x1d8e_4e27_c47d_124f);
        src.extend((0..7).map(|_| 1000.0 * next()));
        let mut got = vec![f16::ZERO; src.len()];
        store_kv_row(&src, &mut got);
        for (i, &(_, want)) in hand.iter().enumerate() {
            assert_eq!(got[i].to_f32(), want, "value {i}");
        }
        for (i, (&g, &x)) in got.iter().zip(&src).enumerate() {
            assert_eq!(g.to_bits(), f16::from_f32(x).to_bits(), "value {i}: {x}");
        }
    }

    /// Every head of one attention row `out` (`[heads, hd]`, over position-major caches, positions
    /// `0..=last`) equals the scalar reference [`attend_head`] within f32 rounding.
    #[allow(clippy::too_many_arguments)]
    fn assert_heads_match_reference(
        out: &[f32],
        q: &[f32],
        k: &[f16],
        v: &[f16],
        heads: usize,
        kv_heads: usize,
        hd: usize,
        last: usize,
        what: &str,
    ) {
        for h in 0..heads {
            let mut sc = vec![0f32; last + 1];
            let mut want = vec![0f32; hd];
            let g = h / (heads / kv_heads);
            let (qh, kvd) = (&q[h * hd..(h + 1) * hd], kv_heads * hd);
            attend_head(qh, k, v, kvd, g * hd, hd, &mut sc, &mut want);
            for (a, b) in out[h * hd..(h + 1) * hd].iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{what} head {h}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn parallel_simd_attention_matches_the_scalar_reference() {
        // 9 query heads over 3 KV heads, head dim 64, 300 positions: long enough for the pool.
        let (heads, kv_heads, hd, n) = (9, 3, 64, 300);
        let kvd = kv_heads * hd;
        let mut next = uniform_values(0x9e37_79b9_7f4a_7c15);
        let q: Vec<f32> = (0..heads * hd).map(|_| 4.0 * next()).collect();
        let k: Vec<f16> = (0..n * kvd).map(|_| f16::from_f32(next())).collect();
        let v: Vec<f16> = (0..n * kvd).map(|_| f16::from_f32(next())).collect();
        let mut scores = vec![0f32; n];
        let mut out = vec![0f32; heads * hd];
        attend_row(
            &q,
            &k,
            &v,
            heads,
            kv_heads,
            hd,
            n - 1,
            &mut scores,
            &mut out,
        );
        assert_heads_match_reference(&out, &q, &k, &v, heads, kv_heads, hd, n - 1, "");
    }

    #[test]
    fn batched_rows_of_different_sequences_equal_each_row_alone() {
        // Rows over two "sequences" of different lengths (one shorter than an 8-position
        // block, one not a multiple of 8), head dims 64 and 80 (a 64-wide and an 8-wide chunk):
        // the batch is bit-identical to each row alone and close to the scalar reference. Eight
        // rows claim whole rows, three claim (row, KV head) groups, and a row alone of one KV
        // head (on a pool of 2 or more) is split by positions: every parallel path.
        for (hd, kv_heads, batch_rows) in [(64usize, 2, 8), (80, 2, 8), (64, 2, 3), (64, 1, 8)] {
            let heads = 6;
            let kvd = kv_heads * hd;
            let mut next = uniform_values(0x2545_f491_4f6c_dd1d);
            let caches: Vec<(Vec<f16>, Vec<f16>)> = [3usize, 203]
                .iter()
                .map(|&n| {
                    let k = (0..n * kvd).map(|_| f16::from_f32(next())).collect();
                    let v = (0..n * kvd).map(|_| f16::from_f32(next())).collect();
                    (k, v)
                })
                .collect();
            // Eight rows × two KV heads: enough units that a KV head's query heads are claimed
            // together (on a ≤ 4-thread pool).
            let rows = [
                (0usize, 2usize),
                (1, 201),
                (1, 202),
                (1, 150),
                (0, 0),
                (1, 7),
                (1, 100),
                (0, 1),
            ];
            let rows = &rows[..batch_rows];
            let qs: Vec<Vec<f32>> = rows
                .iter()
                .map(|_| (0..heads * hd).map(|_| 3.0 * next()).collect())
                .collect();
            let shape = AttentionShape {
                heads,
                kv_heads,
                head_dim: hd,
            };
            let mut batch = vec![0f32; rows.len() * heads * hd];
            let mut scores = vec![0f32; 203];
            attend_rows(
                shape,
                rows.len(),
                &|i| AttentionRow {
                    q: &qs[i],
                    k_cache: &caches[rows[i].0].0,
                    v_cache: &caches[rows[i].0].1,
                    last: rows[i].1,
                },
                &mut scores,
                &mut batch,
            );
            for (i, &(c, last)) in rows.iter().enumerate() {
                let (k, v) = &caches[c];
                let mut alone = vec![0f32; heads * hd];
                attend_row(
                    &qs[i],
                    k,
                    v,
                    heads,
                    kv_heads,
                    hd,
                    last,
                    &mut scores,
                    &mut alone,
                );
                let got = &batch[i * heads * hd..(i + 1) * heads * hd];
                let what = format!("hd {hd}, {kv_heads} KV heads, {batch_rows} rows: row {i}");
                assert_eq!(got, &alone[..], "{what}: batch differs from alone");
                assert_heads_match_reference(got, &qs[i], k, v, heads, kv_heads, hd, last, &what);
            }
        }
    }
}
