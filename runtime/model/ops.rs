//! Host-side transformer operations of the fast path: RMSNorm and RoPE (HF half-split). No
//! allocation: callers pass scratch. The attention and SwiGLU kernels they sit between are in
//! `kernels::attention` and `kernels::activation`.

use crate::kernels::attention::dot;

/// `out = x / rms(x) * w`, row by row (`x`, `out`: `[rows, w.len()]`).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, orow) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        // Eight partial sums (`dot`): a single running sum was one 576-long add chain per row,
        // ~1 % of a 16-row pass, on the caller while the worker waited.
        let ss: f32 = dot(xr, xr) / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, &v), &g) in orow.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// RMSNorm of one vector in place (Qwen3 per-head q/k norm).
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = x.len();
    let ss: f32 = dot(x, x) / d as f32;
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
}
