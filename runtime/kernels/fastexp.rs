//! A polynomial `exp` for f32 and the two activations the forward pass builds on it: the
//! attention softmax's `exp(s − max)` with its sum, and SwiGLU's `silu(g) · u`.
//!
//! Why not `f32::exp`: libm's `expf` is a scalar call, and in a 16-stream decode pass SwiGLU and
//! the softmax spent about 5 % of the time in it. This is Cephes' `expf` (range reduction by
//! `n = round(x·log2 e)`, `r = x − n·ln 2` in two FMAs, a degree-5 polynomial, then `2ⁿ` built in
//! the exponent bits), the same method as ggml's vector `expf`: within 2 ulp of the exact value on
//! `[−87.33, 88]`, 0 below (where the exact result is not a normal f32), `+∞` above 88, NaN for
//! NaN (`fastexp::tests` checks all of it against f64 `exp`).
//!
//! The AVX2 lanes and the scalar [`exp`] do the same IEEE operations in the same order (fused
//! multiply-adds as `mul_add`), so they give the same bits: an element's value never depends on
//! whether it fell in a vector or in a tail, i.e. on how rows were batched or split between
//! threads.

// Unsafe is this module's job: AVX2/FMA intrinsics for exp and SiLU.
#![allow(unsafe_code)]

/// Below this, the result is 0 (the exact value is under `f32::MIN_POSITIVE`).
const LO: f32 = -87.336_54;
/// Above this, the result is `+∞` (`2ⁿ` with n = 128 has no f32 exponent).
const HI: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split so that `n · LN2_HI` is exact for |n| ≤ 2⁹.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes `expf` polynomial, highest degree first.
const POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `eˣ`, the scalar twin of the AVX2 lanes (see the module docs for its range and error).
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < LO {
        return 0.0;
    }
    if x > HI {
        return f32::INFINITY;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = POLY[0];
    for &c in &POLY[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // n ∈ [−126, 127] here, so the biased exponent is in 1..=254.
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `silu(g) · u = g / (1 + e^(−g)) · u`, one element (the scalar twin of [`silu_mul`]'s lanes).
#[inline]
fn silu_mul_one(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

/// `out[i] = silu(gate[i]) · up[i]` (SwiGLU's activation), AVX2 when available.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::gemm::fast_available() {
        // SAFETY: AVX2/FMA are available (checked above); `n` is within all three slices.
        done = unsafe { avx2::silu_mul(&gate[..n], &up[..n], &mut out[..n]) };
    }
    for ((o, &g), &u) in out[done..n]
        .iter_mut()
        .zip(&gate[done..n])
        .zip(&up[done..n])
    {
        *o = silu_mul_one(g, u);
    }
}

/// Replace every `s` by `exp(s − max)` and return their sum: the softmax's numerator and
/// denominator. The sum is taken in 8 lanes (element i into lane i mod 8, over whole groups of 8),
/// then the lanes in order, then the tail in order, on both paths.
pub fn exp_shifted_sum(scores: &mut [f32], max: f32) -> f32 {
    let whole = scores.len() / 8 * 8;
    #[cfg(target_arch = "x86_64")]
    let lanes = if crate::kernels::gemm::fast_available() {
        // SAFETY: AVX2/FMA are available (checked above).
        unsafe { avx2::exp_shifted_lanes(&mut scores[..whole], max) }
    } else {
        exp_shifted_lanes_scalar(&mut scores[..whole], max)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let lanes = exp_shifted_lanes_scalar(&mut scores[..whole], max);
    let sum = lanes.iter().sum::<f32>();
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::gemm::fast_available() {
        // SAFETY: AVX2/FMA are available (checked above).
        return unsafe { avx2::exp_shifted_tail(&mut scores[whole..], max, sum) };
    }
    exp_shifted_tail(&mut scores[whole..], max, sum)
}

/// [`exp_shifted_sum`]'s tail: each `s` replaced by `exp(s − max)` and added to `sum` in order.
/// Inlined into the FMA-enabled twin so that `exp`'s `mul_add`s are instructions, not calls.
#[inline(always)]
fn exp_shifted_tail(scores: &mut [f32], max: f32, mut sum: f32) -> f32 {
    for s in scores {
        *s = exp(*s - max);
        sum += *s;
    }
    sum
}

/// The lane sums of [`exp_shifted_sum`] over whole groups of 8 (`scores.len()` a multiple of 8).
fn exp_shifted_lanes_scalar(scores: &mut [f32], max: f32) -> [f32; 8] {
    let mut lanes = [0f32; 8];
    for chunk in scores.chunks_exact_mut(8) {
        for (lane, s) in lanes.iter_mut().zip(chunk) {
            *s = exp(*s - max);
            *lane += *s;
        }
    }
    lanes
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{HI, LN2_HI, LN2_LO, LO, LOG2E, POLY};
    use std::arch::x86_64::*;

    /// [`super::exp_shifted_tail`] compiled with FMA.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_shifted_tail(scores: &mut [f32], max: f32, sum: f32) -> f32 {
        super::exp_shifted_tail(scores, max, sum)
    }

    /// Eight [`super::exp`]s, operation for operation.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp8(x: __m256) -> __m256 {
        let clamped = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(clamped, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), clamped);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(POLY[0]);
        for &c in &POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        let e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
        // Out of range: 0 below, +∞ above; NaN stays NaN.
        let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(LO));
        let above = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(HI));
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        let e = _mm256_andnot_ps(below, e);
        let e = _mm256_blendv_ps(e, _mm256_set1_ps(f32::INFINITY), above);
        _mm256_blendv_ps(e, x, nan)
    }

    /// [`super::silu_mul`] over whole groups of 8; returns how many elements it wrote.
    ///
    /// # Safety
    /// AVX2 and FMA available; `gate`, `up` and `out` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
        let whole = out.len() / 8 * 8;
        let sign = _mm256_set1_ps(-0.0);
        let one = _mm256_set1_ps(1.0);
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 ≤ whole ≤ the length of all three slices (caller contract).
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                let e = exp8(_mm256_xor_ps(g, sign));
                let s = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
                _mm256_storeu_ps(out.as_mut_ptr().add(i), s);
            }
        }
        whole
    }

    /// [`super::exp_shifted_lanes_scalar`] in vectors.
    ///
    /// # Safety
    /// AVX2 and FMA available; `scores.len()` is a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_shifted_lanes(scores: &mut [f32], max: f32) -> [f32; 8] {
        debug_assert_eq!(scores.len() % 8, 0);
        let max = _mm256_set1_ps(max);
        let mut lanes = _mm256_setzero_ps();
        for chunk in scores.chunks_exact_mut(8) {
            // SAFETY: the chunk holds 8 floats.
            unsafe {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), max));
                _mm256_storeu_ps(chunk.as_mut_ptr(), e);
                lanes = _mm256_add_ps(lanes, e);
            }
        }
        let mut out = [0f32; 8];
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), lanes) };
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite positive floats.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// The exactly rounded eˣ (f64 `exp` has far more precision than an f32 needs).
    fn exact(x: f32) -> f32 {
        (x as f64).exp() as f32
    }

    #[test]
    fn exp_is_within_2_ulp_of_the_exact_value_over_its_range() {
        let mut worst = (0, 0.0f32);
        let steps = 2_000_000;
        for i in 0..=steps {
            let x = (LO + (HI - LO) * i as f32 / steps as f32).min(HI);
            let d = ulps(exp(x), exact(x));
            if d > worst.0 {
                worst = (d, x);
            }
        }
        eprintln!("worst: {} ulp at x = {}", worst.0, worst.1);
        assert!(worst.0 <= 2, "{} ulp at x = {}", worst.0, worst.1);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(1.0), std::f32::consts::E);
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp(-90.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(88.5), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        // The range ends are normal floats, close to the exact values.
        assert!(ulps(exp(LO), exact(LO)) <= 2 && exp(LO) >= f32::MIN_POSITIVE);
        assert!(ulps(exp(HI), exact(HI)) <= 2);
    }

    /// Values that cover the range, its edges and the specials.
    fn test_inputs() -> Vec<f32> {
        let mut v: Vec<f32> = (0..4000).map(|i| -100.0 + i as f32 * 0.0473).collect();
        v.extend([
            LO,
            LO - 1e-5,
            HI,
            HI + 1e-5,
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
        ]);
        v
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_lanes_equal_the_scalar_twin_bit_for_bit() {
        if !crate::kernels::gemm::fast_available() {
            eprintln!("no AVX2/FMA: nothing to compare");
            return;
        }
        use std::arch::x86_64::*;
        let xs = test_inputs();
        for chunk in xs.chunks(8) {
            let mut x = [0f32; 8];
            x[..chunk.len()].copy_from_slice(chunk);
            let mut got = [0f32; 8];
            // SAFETY: AVX2/FMA available (checked above); both arrays hold 8 floats.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), avx2::exp8(_mm256_loadu_ps(x.as_ptr()))) };
            for (g, &xi) in got.iter().zip(&x) {
                let want = exp(xi);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "x = {xi}: lane {g} vs scalar {want}"
                );
            }
        }
    }

    #[test]
    fn silu_mul_matches_f64_and_its_tail_matches_its_lanes() {
        let gate = test_inputs();
        let up: Vec<f32> = (0..gate.len()).map(|i| 0.5 + (i % 7) as f32).collect();
        let mut out = vec![f32::NAN; gate.len()];
        silu_mul(&gate, &up, &mut out);
        for ((&g, &u), &o) in gate.iter().zip(&up).zip(&out) {
            if !g.is_finite() {
                continue;
            }
            let want = g as f64 / (1.0 + (-g as f64).exp()) * u as f64;
            assert!(
                (o as f64 - want).abs() <= 4e-7 * want.abs() + 1e-30,
                "silu({g}) · {u} = {o}, want {want}"
            );
            // Each element is the scalar twin's value whether it was in a vector or the tail.
            assert_eq!(o.to_bits(), silu_mul_one(g, u).to_bits(), "g = {g}");
        }
        // Shifting the start moves elements between vectors and tails; no bit changes.
        let mut shifted = vec![f32::NAN; gate.len() - 3];
        silu_mul(&gate[3..], &up[3..], &mut shifted);
        for (a, b) in shifted.iter().zip(&out[3..]) {
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
        }
    }

    #[test]
    fn exp_shifted_sum_is_the_softmax_numerator_and_denominator() {
        for n in [1usize, 7, 8, 9, 64, 131] {
            let scores: Vec<f32> = (0..n).map(|i| ((i * 37) % 23) as f32 * 0.7 - 8.0).collect();
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let mut got = scores.clone();
            let sum = exp_shifted_sum(&mut got, max);
            let mut want_sum = 0f64;
            for (&s, &g) in scores.iter().zip(&got) {
                let want = ((s - max) as f64).exp();
                want_sum += want;
                assert!(
                    (g as f64 - want).abs() <= 2.5e-7 * want,
                    "n {n}: {g} vs {want}"
                );
            }
            assert!(
                (sum as f64 - want_sum).abs() <= 1e-6 * want_sum,
                "n {n}: sum {sum} vs {want_sum}"
            );
            // The vector path's lane sums equal the scalar path's.
            let mut twin = scores.clone();
            let whole = n / 8 * 8;
            let lanes = exp_shifted_lanes_scalar(&mut twin[..whole], max);
            let mut twin_sum = lanes.iter().sum::<f32>();
            for s in &mut twin[whole..] {
                *s = exp(*s - max);
                twin_sum += *s;
            }
            assert_eq!(sum.to_bits(), twin_sum.to_bits(), "n {n}");
            assert_eq!(got, twin, "n {n}");
        }
    }
}
