//! Host-side transformer operations of the fast path: RMSNorm, RoPE (HF half-split), SwiGLU,
//! softmax, grouped-query attention over the f32 KV cache. No allocation: callers pass scratch.

/// `out = x / rms(x) * w`, row by row (`x`, `out`: `[rows, w.len()]`).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, orow) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, &v), &g) in orow.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// RMSNorm of one vector in place (Qwen3 per-head q/k norm).
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = x.len();
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
    let inv = 1.0 / (ss + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * inv * g;
    }
}

/// Fill `cos`/`sin` (`half` values each) for one absolute position.
pub fn rope_angles(pos: usize, inv_freq: &[f64], cos: &mut [f32], sin: &mut [f32]) {
    for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
        let a = pos as f64 * f;
        let (sa, ca) = a.sin_cos();
        *c = ca as f32;
        *s = sa as f32;
    }
}

/// Rotate one head in place, HF "rotate_half" convention: pairs `(j, j + half)`.
pub fn rope_half_split(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    let (a, b) = x.split_at_mut(half);
    for j in 0..half {
        let (x0, x1) = (a[j], b[j]);
        a[j] = x0 * cos[j] - x1 * sin[j];
        b[j] = x1 * cos[j] + x0 * sin[j];
    }
}

/// `out[i] = silu(gate[i]) * up[i]` for a fused `[rows, 2*inter]` gate‖up row layout.
pub fn swiglu(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    for (gu, o) in gate_up
        .chunks_exact(2 * inter)
        .zip(out.chunks_exact_mut(inter))
    {
        let (g, u) = gu.split_at(inter);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
}

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise.
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// One query row's attention for all heads.
///
/// `q`: `[heads, hd]`; `k_cache`, `v_cache`: `[positions, kv_heads, hd]`; attends to positions
/// `0..=last`; `scores`: scratch of at least `last + 1`; `out`: `[heads, hd]`.
/// (A single-row [`attend_rows`]; the result is the same bits either way.)
#[allow(clippy::too_many_arguments)]
pub fn attend_row(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
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
        hd,
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
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
}

/// One query row of a batched attention: its query heads `[heads, hd]`, its sequence's caches
/// (`[positions, kv_heads, hd]`) and the last position it attends to.
#[derive(Clone, Copy)]
pub struct AttentionRow<'a> {
    pub q: &'a [f32],
    pub k_cache: &'a [f32],
    pub v_cache: &'a [f32],
    pub last: usize,
}

/// Attention of `rows` query rows (each over its own cache and length, e.g. the rows of several
/// sequences in one batched pass): `out` is `[rows, heads, hd]`; `row(i)` describes row `i`;
/// `scores` is caller scratch of at least the longest row's `last + 1` (used when the work runs on
/// the caller alone).
///
/// Every (row, head) pair is independent, so all of them go over the kernels' worker pool in ONE
/// dispatch (a per-row dispatch would cost `rows` pool handoffs per layer); tiny totals run on the
/// caller. Each pair is computed by the same code whichever thread runs it and whatever else is in
/// the batch, so a row's result does not depend on its batch. AVX2+FMA when the CPU has it
/// ([`attend_head`] is the scalar reference).
pub fn attend_rows<'a>(
    shape: AttentionShape,
    rows: usize,
    row: &(dyn Fn(usize) -> AttentionRow<'a> + Sync),
    scores: &mut [f32],
    out: &mut [f32],
) {
    let AttentionShape {
        heads,
        kv_heads,
        hd,
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
    let pool = crate::kernels::pool::Pool::global();
    let out = &mut out[..items * hd];
    if items < 2 || pool.threads() < 2 || work < PARALLEL_MIN_WORK {
        for (item, oh) in out.chunks_exact_mut(hd).enumerate() {
            let (i, h) = (item / heads, item % heads);
            let r = row(i);
            let qh = &r.q[h * hd..(h + 1) * hd];
            let sc = &mut scores[..r.last + 1];
            attend_one(fast, geometry, h, qh, r.k_cache, r.v_cache, sc, oh);
        }
        return;
    }
    // Claim units: with enough of them, the query heads sharing one KV head of one row (its
    // keys and values are then read from memory once, by one core, and reused from its cache);
    // with few (a decode row has only kv_heads), single heads, for balance. One unit per claim:
    // units are few and uneven (rows differ in length).
    let unit = if heads % kv_heads == 0 && rows * kv_heads >= 4 * pool.threads() {
        geometry.group
    } else {
        1
    };
    let units = items / unit;
    let counter = crate::kernels::pool::ChunkCounter::new(units, units, 1);
    let out_ptr = HeadsOut(out.as_mut_ptr());
    pool.run(&|_, _| {
        HEAD_SCORES.with(|cell| {
            let mut scratch = cell.borrow_mut();
            while let Some(range) = counter.claim() {
                for item in range.start * unit..range.end * unit {
                    let (i, h) = (item / heads, item % heads);
                    let r = row(i);
                    let n = r.last + 1;
                    if scratch.len() < n {
                        scratch.resize(n, 0.0);
                    }
                    // SAFETY: `out` holds `items * hd` floats and every item is claimed by exactly
                    // one thread, so the slices are disjoint and `out` outlives the pool job.
                    let oh =
                        unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(item * hd), hd) };
                    let qh = &r.q[h * hd..(h + 1) * hd];
                    attend_one(
                        fast,
                        geometry,
                        h,
                        qh,
                        r.k_cache,
                        r.v_cache,
                        &mut scratch[..n],
                        oh,
                    );
                }
            }
        });
    });
}

thread_local! {
    /// Per-thread softmax scratch of the parallel attention (grows to the context, then reused).
    static HEAD_SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The output rows of the heads, shared by the pool threads (each writes its own heads).
#[derive(Clone, Copy)]
struct HeadsOut(*mut f32);
impl HeadsOut {
    fn get(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: threads write disjoint head slices of an output that outlives the pool job.
unsafe impl Send for HeadsOut {}
// SAFETY: as above.
unsafe impl Sync for HeadsOut {}

/// Geometry of one attention row: query heads per KV head, KV row width, head dim.
#[derive(Clone, Copy)]
struct HeadShape {
    group: usize,
    kvd: usize,
    hd: usize,
}

/// Is the AVX2+FMA attention path usable on this CPU?
fn fast_attention_available() -> bool {
    crate::kernels::gemm::fast_available()
}

#[allow(clippy::too_many_arguments)]
#[inline]
fn attend_one(
    fast: bool,
    s: HeadShape,
    h: usize,
    qh: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    scores: &mut [f32],
    oh: &mut [f32],
) {
    let g = h / s.group;
    #[cfg(target_arch = "x86_64")]
    if fast && s.hd % 8 == 0 {
        // SAFETY: AVX2/FMA are available (`fast`); the caches hold `n` positions of `kvd`
        // floats (asserted inside), `qh` and `oh` hold `hd`, `scores` holds `n`.
        unsafe { attend_head_avx2(qh, k_cache, v_cache, s.kvd, g * s.hd, s.hd, scores, oh) };
        return;
    }
    let _ = fast;
    attend_head(qh, k_cache, v_cache, s.kvd, g * s.hd, s.hd, scores, oh);
}

/// Scalar reference of one head: softmax(q·Kᵀ/√hd)·V over `scores.len()` positions, reading the
/// KV head at column `k_off` of each `[kvd]` cache row.
#[allow(clippy::too_many_arguments)]
pub fn attend_head(
    qh: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
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
            *o += w * v;
        }
    }
}

/// [`attend_head`] with AVX2+FMA (hd a multiple of 8).
///
/// Scores: four positions at a time, each with its own accumulator chain, reduced together by one
/// `hadd` tree (a position's sum does not depend on its neighbours or on `n`: the tail reuses the
/// same tree). Values: the output head lives in registers (64 columns at a time) across all
/// positions instead of a load + store per position.
///
/// # Safety
/// AVX2 and FMA available; `hd % 8 == 0`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_head_avx2(
    qh: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    kvd: usize,
    k_off: usize,
    hd: usize,
    scores: &mut [f32],
    oh: &mut [f32],
) {
    use std::arch::x86_64::*;
    let n = scores.len();
    // Bounds for every raw access below: positions 0..n, columns k_off..k_off+hd of kvd.
    assert!(
        n > 0
            && hd % 8 == 0
            && qh.len() >= hd
            && oh.len() >= hd
            && k_off + hd <= kvd
            && k_cache.len() >= n * kvd
            && v_cache.len() >= n * kvd
    );
    let scale = _mm_set1_ps(1.0 / (hd as f32).sqrt());
    let q = qh.as_ptr();
    let mut t = 0;
    while t < n {
        // Positions t..t+4; past the end the last position is recomputed and not stored.
        let key = |j: usize| k_cache[(t + j).min(n - 1) * kvd + k_off..].as_ptr();
        let (k0, k1, k2, k3) = (key(0), key(1), key(2), key(3));
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut c = 0;
        while c < hd {
            // SAFETY: c + 8 ≤ hd; q and every key row hold hd floats from their start (asserted).
            unsafe {
                let qv = _mm256_loadu_ps(q.add(c));
                acc[0] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0.add(c)), acc[0]);
                acc[1] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1.add(c)), acc[1]);
                acc[2] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2.add(c)), acc[2]);
                acc[3] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3.add(c)), acc[3]);
            }
            c += 8;
        }
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
        let valid = (n - t).min(4);
        scores[t..t + valid].copy_from_slice(&four[..valid]);
        t += 4;
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    for s in scores.iter_mut() {
        *s *= inv;
    }
    let o = oh.as_mut_ptr();
    let mut c0 = 0;
    while c0 < hd {
        let v0 = v_cache[k_off + c0..].as_ptr();
        if hd - c0 >= 64 {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (t, &p) in scores.iter().enumerate() {
                let w = _mm256_set1_ps(p);
                // SAFETY: t < n and c0 + 64 ≤ hd: 64 floats of the value row (asserted above).
                let v = unsafe { v0.add(t * kvd) };
                for (j, a) in acc.iter_mut().enumerate() {
                    // SAFETY: as above, j < 8.
                    *a = _mm256_fmadd_ps(w, unsafe { _mm256_loadu_ps(v.add(8 * j)) }, *a);
                }
            }
            for (j, a) in acc.iter().enumerate() {
                // SAFETY: c0 + 64 ≤ hd ≤ oh.len().
                unsafe { _mm256_storeu_ps(o.add(c0 + 8 * j), *a) };
            }
            c0 += 64;
        } else {
            let mut acc = _mm256_setzero_ps();
            for (t, &p) in scores.iter().enumerate() {
                // SAFETY: t < n and c0 + 8 ≤ hd (hd % 8 == 0).
                acc = _mm256_fmadd_ps(
                    _mm256_set1_ps(p),
                    unsafe { _mm256_loadu_ps(v0.add(t * kvd)) },
                    acc,
                );
            }
            // SAFETY: c0 + 8 ≤ hd ≤ oh.len().
            unsafe { _mm256_storeu_ps(o.add(c0), acc) };
            c0 += 8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_hand_values() {
        // x = [3, 4]: mean square 12.5, rms = sqrt(12.5 + 0) → [3, 4] / 3.5355
        let mut out = [0f32; 2];
        rmsnorm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        assert!((out[0] - 0.848_528).abs() < 1e-5);
        assert!((out[1] - 2.262_742).abs() < 1e-5);
    }

    #[test]
    fn rope_half_split_hand_values() {
        // head_dim 4, half 2: pairs (0,2) and (1,3). Angle 90° on pair 0, 0° on pair 1.
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        let cos = [0.0f32, 1.0];
        let sin = [1.0f32, 0.0];
        rope_half_split(&mut x, &cos, &sin);
        assert_eq!(x, [-3.0, 2.0, 1.0, 4.0]);
        let mut c = [0f32; 2];
        let mut s = [0f32; 2];
        rope_angles(3, &[0.5, 0.25], &mut c, &mut s);
        assert!((c[0] - 1.5f32.cos()).abs() < 1e-6 && (s[1] - 0.75f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn attention_single_key_returns_value_and_gqa_groups() {
        // 2 heads share 1 kv head; one position → output = v.
        let q = [1.0f32, 0.0, 0.0, 1.0];
        let k = [0.5f32, 0.5];
        let v = [7.0f32, -1.0];
        let mut sc = [0f32; 1];
        let mut out = [0f32; 4];
        attend_row(&q, &k, &v, 2, 1, 2, 0, &mut sc, &mut out);
        assert_eq!(out, [7.0, -1.0, 7.0, -1.0]);
        // Two positions with equal scores average the values.
        let k2 = [1.0f32, 0.0, 1.0, 0.0];
        let v2 = [2.0f32, 0.0, 4.0, 2.0];
        let mut sc = [0f32; 2];
        let mut out = [0f32; 2];
        attend_row(&[0.0, 1.0], &k2, &v2, 1, 1, 2, 1, &mut sc, &mut out);
        assert_eq!(out, [3.0, 1.0]);
    }

    #[test]
    fn swiglu_hand_values() {
        let mut out = [0f32; 2];
        swiglu(&[0.0, 1.0, 5.0, 2.0], 2, &mut out);
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    /// Deterministic test values in [-0.5, 0.5) (xorshift64).
    fn uniform_values(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        }
    }

    /// Every head of one attention row `out` (`[heads, hd]`, over position-major caches, positions
    /// `0..=last`) equals the scalar reference [`attend_head`] within f32 rounding.
    #[allow(clippy::too_many_arguments)]
    fn assert_heads_match_reference(
        out: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
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
        let k: Vec<f32> = (0..n * kvd).map(|_| next()).collect();
        let v: Vec<f32> = (0..n * kvd).map(|_| next()).collect();
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
        // Rows over two "sequences" of different lengths (one shorter than a 4-position
        // block, one not a multiple of 4), head dims 64 and 80 (a 64-wide and an 8-wide chunk):
        // the batch is bit-identical to each row alone and close to the scalar reference.
        for hd in [64usize, 80] {
            let (heads, kv_heads) = (6, 2);
            let kvd = kv_heads * hd;
            let mut next = uniform_values(0x2545_f491_4f6c_dd1d);
            let caches: Vec<(Vec<f32>, Vec<f32>)> = [3usize, 203]
                .iter()
                .map(|&n| {
                    let k = (0..n * kvd).map(|_| next()).collect();
                    let v = (0..n * kvd).map(|_| next()).collect();
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
            let qs: Vec<Vec<f32>> = rows
                .iter()
                .map(|_| (0..heads * hd).map(|_| 3.0 * next()).collect())
                .collect();
            let shape = AttentionShape {
                heads,
                kv_heads,
                hd,
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
                assert_eq!(got, &alone[..], "hd {hd} row {i}: batch differs from alone");
                let what = format!("hd {hd} row {i}");
                assert_heads_match_reference(got, &qs[i], k, v, heads, kv_heads, hd, last, &what);
            }
        }
    }
}
