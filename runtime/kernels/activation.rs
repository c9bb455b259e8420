//! SwiGLU over a batch of rows: `fastexp::silu_mul` on each span, the spans of a large batch split
//! over the worker pool.

// Unsafe is needed for disjoint output writes through the pool's shared-buffer handle.
#![allow(unsafe_code)]

use super::fastexp::silu_mul;
use super::pool::{ChunkCounter, Pool, SharedMut};

/// `out[i] = silu(gate[i]) * up[i]` for a fused `[rows, 2*inter]` gate‖up row layout.
///
/// Element-wise, so large batches (a 16-row pass: 16 × inter `exp`s per layer) are split over the
/// kernels' worker pool; every element is the same expression on any thread.
pub fn swiglu(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    // Below this many elements a pool dispatch costs more than it saves.
    const PARALLEL_MIN_ELEMENTS: usize = 4096;
    // Columns per pool claim (an L1-sized slice of gate, up and out).
    const COLUMN_BLOCK: usize = 512;
    let rows = out.len() / inter.max(1);
    let pool = Pool::global();
    if inter == 0 || rows * inter < PARALLEL_MIN_ELEMENTS || pool.threads() < 2 {
        swiglu_span(gate_up, inter, 0..rows * inter, &mut out[..rows * inter]);
        return;
    }
    let blocks = inter.div_ceil(COLUMN_BLOCK);
    let counter = ChunkCounter::new(rows * blocks, pool.threads(), 4);
    let out = SharedMut::new(&mut out[..rows * inter]);
    pool.run(&|_, _| {
        while let Some(range) = counter.claim() {
            for unit in range {
                let (r, b) = (unit / blocks, unit % blocks);
                let cols =
                    r * inter + b * COLUMN_BLOCK..r * inter + ((b + 1) * COLUMN_BLOCK).min(inter);
                // SAFETY: each (row, block) span is claimed by exactly one thread, so the spans
                // are disjoint.
                let span_out = unsafe { out.slice_mut(cols.clone()) };
                swiglu_span(gate_up, inter, cols, span_out);
            }
        }
    });
}

/// [`swiglu`] of the flat output elements `span` (`row * inter + column`) into `out`, which holds
/// exactly those elements.
fn swiglu_span(gate_up: &[f32], inter: usize, span: std::ops::Range<usize>, out: &mut [f32]) {
    let mut i = span.start;
    while i < span.end {
        let (r, c) = (i / inter, i % inter);
        let end = span.end.min((r + 1) * inter);
        let g = &gate_up[r * 2 * inter + c..r * 2 * inter + inter];
        let u = &gate_up[r * 2 * inter + inter + c..(r + 1) * 2 * inter];
        let at = i - span.start;
        silu_mul(g, u, &mut out[at..at + end - i]);
        i = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values::uniform_values;

    #[test]
    fn swiglu_hand_values() {
        let mut out = [0f32; 2];
        swiglu(&[0.0, 1.0, 5.0, 2.0], 2, &mut out);
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn pooled_swiglu_of_a_batch_pairs_each_gate_with_its_own_up() {
        // 7 rows × 1300 columns: over the pool threshold, and 1300 is not a multiple of the
        // column block, so spans end mid-row and at row ends.
        let (rows, inter) = (7, 1300);
        let mut next = uniform_values(0x51_7cc1_b727_220a);
        let gate_up: Vec<f32> = (0..rows * 2 * inter).map(|_| 8.0 * next()).collect();
        let mut out = vec![f32::NAN; rows * inter];
        swiglu(&gate_up, inter, &mut out);
        for r in 0..rows {
            for c in 0..inter {
                let (g, u) = (
                    gate_up[r * 2 * inter + c],
                    gate_up[r * 2 * inter + inter + c],
                );
                let want = g as f64 / (1.0 + (-g as f64).exp()) * u as f64;
                let got = out[r * inter + c];
                assert!(
                    (got as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "row {r} column {c}: {got} vs {want}"
                );
            }
        }
    }
}
