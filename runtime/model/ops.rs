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
    // Whole runs of 8 as arrays, which the compiler turns into vector operations: indexed (or
    // zipped element by element), the loop ran scalar on the caller, ~2 % of a 16-row pass, while
    // the worker waited.
    let (a_runs, a_rest) = a.as_chunks_mut::<8>();
    let (b_runs, b_rest) = b.as_chunks_mut::<8>();
    let (cos_runs, cos_rest) = cos[..half].as_chunks::<8>();
    let (sin_runs, sin_rest) = sin[..half].as_chunks::<8>();
    for (((a, b), c), s) in a_runs.iter_mut().zip(b_runs).zip(cos_runs).zip(sin_runs) {
        let (x0, x1) = (*a, *b);
        *a = std::array::from_fn(|j| x0[j] * c[j] - x1[j] * s[j]);
        *b = std::array::from_fn(|j| x1[j] * c[j] + x0[j] * s[j]);
    }
    for (((x0, x1), &c), &s) in a_rest.iter_mut().zip(b_rest).zip(cos_rest).zip(sin_rest) {
        let (v0, v1) = (*x0, *x1);
        *x0 = v0 * c - v1 * s;
        *x1 = v1 * c + v0 * s;
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
    fn rope_runs_of_eight_give_the_pairwise_bits() {
        // half = 35: four runs of 8 and a rest of 3, against the formula pair by pair.
        let half = 35;
        let x: Vec<f32> = (0..2 * half)
            .map(|i| (i as f32 * 0.37).sin() * 3.0)
            .collect();
        let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
        let inv_freq: Vec<f64> = (0..half)
            .map(|j| 10000f64.powf(-(j as f64) / half as f64))
            .collect();
        rope_angles(17, &inv_freq, &mut cos, &mut sin);
        let mut rotated = x.clone();
        rope_half_split(&mut rotated, &cos, &sin);
        for j in 0..half {
            let (x0, x1) = (x[j], x[j + half]);
            assert_eq!(
                rotated[j].to_bits(),
                (x0 * cos[j] - x1 * sin[j]).to_bits(),
                "pair {j}"
            );
            assert_eq!(
                rotated[j + half].to_bits(),
                (x1 * cos[j] + x0 * sin[j]).to_bits(),
                "pair {j}"
            );
        }
    }
}
