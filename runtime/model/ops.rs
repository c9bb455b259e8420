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
    let group = heads / kv_heads;
    let kvd = kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let n = last + 1;
    for h in 0..heads {
        let g = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        let sc = &mut scores[..n];
        let mut max = f32::NEG_INFINITY;
        for (t, s) in sc.iter_mut().enumerate() {
            let kt = &k_cache[t * kvd + g * hd..t * kvd + (g + 1) * hd];
            *s = dot(qh, kt) * scale;
            max = max.max(*s);
        }
        let mut sum = 0f32;
        for s in sc.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        let oh = &mut out[h * hd..(h + 1) * hd];
        oh.fill(0.0);
        for (t, &p) in sc.iter().enumerate() {
            let w = p * inv;
            let vt = &v_cache[t * kvd + g * hd..t * kvd + (g + 1) * hd];
            for (o, &v) in oh.iter_mut().zip(vt) {
                *o += w * v;
            }
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
}
