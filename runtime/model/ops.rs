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
///
/// Heads are independent, so long contexts split them over the kernels' worker pool (at decode
/// this loop is the largest host cost after the projections); short ones run on the caller.
/// Each head uses AVX2+FMA dot products and updates when the CPU has them ([`attend_head`]
/// is the scalar reference).
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
    let n = last + 1;
    let shape = HeadShape {
        group: heads / kv_heads,
        kvd: kv_heads * hd,
        hd,
    };
    let fast = fast_attention_available();
    // Below this many multiply-adds per row a pool dispatch costs more than it saves.
    const PARALLEL_MIN_WORK: usize = 16 * 1024;
    let pool = crate::kernels::pool::Pool::global();
    if heads < 2 || pool.threads() < 2 || 2 * n * hd * heads < PARALLEL_MIN_WORK {
        for (h, oh) in out[..heads * hd].chunks_exact_mut(hd).enumerate() {
            let qh = &q[h * hd..(h + 1) * hd];
            attend_one(fast, shape, h, qh, k_cache, v_cache, &mut scores[..n], oh);
        }
        return;
    }
    let counter = crate::kernels::pool::ChunkCounter::new(heads, heads, 1);
    let out_ptr = HeadsOut(out.as_mut_ptr());
    pool.run(&|_, _| {
        HEAD_SCORES.with(|cell| {
            let mut scratch = cell.borrow_mut();
            if scratch.len() < n {
                scratch.resize(n, 0.0);
            }
            while let Some(range) = counter.claim() {
                for h in range {
                    // SAFETY: `out` holds `heads * hd` floats (caller contract) and every head
                    // index is claimed by exactly one thread, so the slices are disjoint and
                    // `out` outlives the pool job.
                    let oh =
                        unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(h * hd), hd) };
                    let qh = &q[h * hd..(h + 1) * hd];
                    attend_one(fast, shape, h, qh, k_cache, v_cache, &mut scratch[..n], oh);
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

/// [`attend_head`] with AVX2+FMA dot products and value updates (hd a multiple of 8).
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
        hd % 8 == 0
            && qh.len() >= hd
            && oh.len() >= hd
            && k_off + hd <= kvd
            && k_cache.len() >= n * kvd
            && v_cache.len() >= n * kvd
    );
    let scale = 1.0 / (hd as f32).sqrt();
    let mut max = f32::NEG_INFINITY;
    for (t, s) in scores.iter_mut().enumerate() {
        let k = k_cache[t * kvd + k_off..].as_ptr();
        let mut acc = _mm256_setzero_ps();
        let mut c = 0;
        while c < hd {
            // SAFETY: c + 8 ≤ hd; both rows hold hd floats from their start (asserted above).
            acc = unsafe {
                _mm256_fmadd_ps(
                    _mm256_loadu_ps(qh.as_ptr().add(c)),
                    _mm256_loadu_ps(k.add(c)),
                    acc,
                )
            };
            c += 8;
        }
        let s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        *s = _mm_cvtss_f32(s1) * scale;
        max = max.max(*s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    oh[..hd].fill(0.0);
    let o = oh.as_mut_ptr();
    for (t, &p) in scores.iter().enumerate() {
        let w = _mm256_set1_ps(p * inv);
        let v = v_cache[t * kvd + k_off..].as_ptr();
        let mut c = 0;
        while c < hd {
            // SAFETY: c + 8 ≤ hd; `oh` and the value row hold hd floats (asserted above).
            unsafe {
                let acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(v.add(c)), _mm256_loadu_ps(o.add(c)));
                _mm256_storeu_ps(o.add(c), acc);
            }
            c += 8;
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

    #[test]
    fn parallel_simd_attention_matches_the_scalar_reference() {
        // 9 query heads over 3 KV heads, head dim 64, 300 positions: long enough for the pool.
        let (heads, kv_heads, hd, n) = (9, 3, 64, 300);
        let kvd = kv_heads * hd;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
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
        for h in 0..heads {
            let mut sc = vec![0f32; n];
            let mut want = vec![0f32; hd];
            let g = h / (heads / kv_heads);
            attend_head(
                &q[h * hd..(h + 1) * hd],
                &k,
                &v,
                kvd,
                g * hd,
                hd,
                &mut sc,
                &mut want,
            );
            for (a, b) in out[h * hd..(h + 1) * hd].iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "head {h}: {a} vs {b}"
                );
            }
        }
    }
}
