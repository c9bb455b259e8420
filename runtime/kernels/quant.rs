//! Activation quantization to q8 (ggml's `quantize_row_q8_1`), done once per GEMM call.
//!
//! Per 32-column group of each activation row: `d = max|x| / 127`, `q = round_ties_even(x / d)`
//! (so |q| ≤ 127, which keeps the q4 `maddubs` sums inside i16), and `s = d · Σq` — the term that
//! multiplies a q4_1 group's min, exactly as ggml's q8_1 block carries it. Columns past the logical K
//! (up to the quantized width) are zero.
//!
//! Rows are independent, so a batch of several rows is quantized over the worker pool (a 16-row
//! pass quantizes on every core instead of leaving the others waiting at the GEMM's start).

use super::pool::{ChunkCounter, Pool};
use crate::tiles::GROUP;

/// Quantize over the pool from this many rows on (one decode row is too little to share).
const POOLED_MIN_ROWS: usize = 4;

/// Quantized activations: `rows × cols` i8 codes (cols a multiple of 32), one scale and one
/// `d·Σq` per group.
#[derive(Default, Debug)]
pub struct QuantizedRows {
    /// Activation rows.
    pub rows: usize,
    /// Columns per row (the logical K rounded up to a multiple of 32).
    pub cols: usize,
    /// Codes, row-major `[rows, cols]`.
    pub codes: Vec<i8>,
    /// Scale per group, `[rows, cols / 32]`.
    pub scales: Vec<f32>,
    /// `scale · Σ codes` per group, `[rows, cols / 32]`.
    pub sums: Vec<f32>,
    /// `Σ codes` per group, `[rows, cols / 32]`: the VNNI q8 kernel's offset correction.
    pub code_sums: Vec<i32>,
}

impl QuantizedRows {
    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.cols / GROUP
    }

    /// Quantize `x` (`rows × k`, row-major) in place of the previous contents; reuses capacity.
    pub fn quantize(&mut self, x: &[f32], rows: usize, k: usize) {
        let cols = k.div_ceil(GROUP) * GROUP;
        let groups = cols / GROUP;
        self.rows = rows;
        self.cols = cols;
        // Every element below is overwritten (codes past K included), so keep old contents
        // instead of zero-filling on every call.
        self.codes.resize(rows * cols, 0);
        self.scales.resize(rows * groups, 0.0);
        self.sums.resize(rows * groups, 0.0);
        self.code_sums.resize(rows * groups, 0);
        let pool = Pool::global();
        if rows < POOLED_MIN_ROWS || pool.threads() < 2 {
            for row in 0..rows {
                quantize_row(
                    &x[row * k..(row + 1) * k],
                    RowOut {
                        codes: &mut self.codes[row * cols..(row + 1) * cols],
                        scales: &mut self.scales[row * groups..(row + 1) * groups],
                        sums: &mut self.sums[row * groups..(row + 1) * groups],
                        code_sums: &mut self.code_sums[row * groups..(row + 1) * groups],
                    },
                );
            }
            return;
        }
        let out = RowsOut {
            codes: self.codes.as_mut_ptr(),
            scales: self.scales.as_mut_ptr(),
            sums: self.sums.as_mut_ptr(),
            code_sums: self.code_sums.as_mut_ptr(),
        };
        let counter = ChunkCounter::new(rows, pool.threads(), 2);
        pool.run(&|_, _| {
            let out = &out;
            while let Some(range) = counter.claim() {
                for row in range {
                    // SAFETY: row < rows, and the four buffers hold rows × cols codes and
                    // rows × groups scales and sums (resized above, not touched again until
                    // the pool job returns); every row is claimed by exactly one thread, so the
                    // row's slices are disjoint from every other thread's.
                    let row_out = unsafe {
                        RowOut {
                            codes: std::slice::from_raw_parts_mut(out.codes.add(row * cols), cols),
                            scales: std::slice::from_raw_parts_mut(
                                out.scales.add(row * groups),
                                groups,
                            ),
                            sums: std::slice::from_raw_parts_mut(
                                out.sums.add(row * groups),
                                groups,
                            ),
                            code_sums: std::slice::from_raw_parts_mut(
                                out.code_sums.add(row * groups),
                                groups,
                            ),
                        }
                    };
                    quantize_row(&x[row * k..(row + 1) * k], row_out);
                }
            }
        });
    }
}

/// The output buffers of [`QuantizedRows::quantize`], shared with the pool threads, which write
/// disjoint rows.
struct RowsOut {
    codes: *mut i8,
    scales: *mut f32,
    sums: *mut f32,
    code_sums: *mut i32,
}

/// One row's slices of the [`QuantizedRows`] buffers.
struct RowOut<'a> {
    codes: &'a mut [i8],
    scales: &'a mut [f32],
    sums: &'a mut [f32],
    code_sums: &'a mut [i32],
}

// SAFETY: the pointers are only dereferenced for rows a thread has claimed exactly once (see the
// pool job in `quantize`), while the buffers they point into outlive the job.
unsafe impl Sync for RowsOut {}

/// One activation row of `k` values into `out.codes` (the quantized width) and a scale, `d·Σq` and
/// `Σq` per group.
fn quantize_row(src: &[f32], out: RowOut<'_>) {
    let k = src.len();
    for (g, ((scale, sum_out), code_sum)) in out
        .scales
        .iter_mut()
        .zip(out.sums.iter_mut())
        .zip(out.code_sums.iter_mut())
        .enumerate()
    {
        let start = g * GROUP;
        let end = (start + GROUP).min(k);
        let (d, sum) = quantize_group_fast(&src[start..end], &mut out.codes[start..start + GROUP]);
        *scale = d;
        *sum_out = d * sum as f32;
        *code_sum = sum;
    }
}

/// [`quantize_group`], with the AVX2 version for full groups when the CPU has it (bit-identical).
#[inline]
fn quantize_group_fast(values: &[f32], out: &mut [i8]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if values.len() == GROUP && out.len() == GROUP && super::avx2::available() {
        // SAFETY: AVX2 is available; `values` has 32 floats and `out` 32 bytes (checked above).
        return unsafe { super::avx2::quantize_group32(values.as_ptr(), out.as_mut_ptr()) };
    }
    quantize_group(values, out)
}

/// Quantize up to 32 values into `out` (the rest of `out` zeroed); returns (scale, Σ codes).
#[inline]
pub fn quantize_group(values: &[f32], out: &mut [i8]) -> (f32, i32) {
    let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (o, &v) in out.iter_mut().zip(values) {
        // Ties to even, like `_mm256_cvtps_epi32`; |v·inv| ≤ 127 by construction (NaN → 0).
        let q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
        *o = q;
        sum += q as i32;
    }
    for o in out.iter_mut().skip(values.len()) {
        *o = 0;
    }
    (d, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_group_quantization_is_bit_identical_to_scalar() {
        let mut seed = 0x1234_5678_9abc_def0u64;
        for case in 0..2000 {
            let values: Vec<f32> = (0..GROUP)
                .map(|i| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let r = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    // Mix scales, exact halves (ties after scaling) and zeros.
                    match case % 4 {
                        0 => r * 10.0,
                        1 => (r * 254.0).round() / 2.0,
                        2 => {
                            if i % 3 == 0 {
                                0.0
                            } else {
                                r
                            }
                        }
                        _ => r * 1e-3,
                    }
                })
                .collect();
            let mut fast = [0i8; GROUP];
            let mut slow = [0i8; GROUP];
            let a = quantize_group_fast(&values, &mut fast);
            let b = quantize_group(&values, &mut slow);
            assert_eq!(a, b, "case {case}");
            assert_eq!(fast, slow, "case {case}");
        }
        let zeros = [0f32; GROUP];
        let mut out = [1i8; GROUP];
        assert_eq!(quantize_group_fast(&zeros, &mut out), (0.0, 0));
        assert_eq!(out, [0; GROUP]);
    }

    #[test]
    fn groups_are_scaled_to_127_and_padded_with_zeros() {
        let x: Vec<f32> = (0..40).map(|i| i as f32 - 20.0).collect();
        let mut q = QuantizedRows::default();
        q.quantize(&x, 1, 40);
        assert_eq!(q.cols, 64);
        assert_eq!(q.codes[0], -127); // -20 is the group's max magnitude
        assert!(q.codes[40..].iter().all(|&c| c == 0));
        let d0 = q.scales[0];
        assert!((d0 - 20.0 / 127.0).abs() < 1e-7);
        let sum: i32 = q.codes[..32].iter().map(|&c| c as i32).sum();
        assert_eq!(q.sums[0], d0 * sum as f32);
        let tail: i32 = q.codes[32..64].iter().map(|&c| c as i32).sum();
        assert_eq!(q.code_sums, [sum, tail]);
    }
}
