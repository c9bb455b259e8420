//! Memory read-bandwidth probe: the roofline every GEMM sweep and decode speed is compared with.
//!
//! A streaming read of a large buffer through the same worker pool the kernels use (so the probe
//! and the kernels see the same threads), repeated; the median and the best run are returned.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::pool::{ChunkCounter, Pool};

/// Read bandwidth in GB/s (10⁹ bytes per second).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bandwidth {
    /// Median over the runs.
    pub median_gbs: f64,
    /// Fastest run.
    pub best_gbs: f64,
}

/// Streams `bytes` (≥ 256 MiB keeps it out of the last-level cache) `runs` times through the
/// global pool, after one warm-up pass that also faults the pages in.
pub fn read_bandwidth(bytes: usize, runs: usize) -> Bandwidth {
    let words = (bytes / 8).max(1 << 10);
    // Distinct values on every page, so nothing reads a shared zero page.
    let buffer: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let pool = Pool::global();
    let sink = AtomicU64::new(0);
    let mut samples = Vec::with_capacity(runs.max(1));
    for run in 0..=runs.max(1) {
        let counter = ChunkCounter::new(buffer.len(), pool.threads(), 16);
        let start = Instant::now();
        pool.run(&|_, _| {
            let mut acc = 0u64;
            while let Some(range) = counter.claim() {
                acc = buffer[range]
                    .chunks_exact(8)
                    .fold(acc, |a, c| a ^ c.iter().fold(0, |x, &y| x ^ y));
            }
            sink.fetch_xor(acc, Ordering::Relaxed);
        });
        let seconds = start.elapsed().as_secs_f64();
        if run > 0 {
            samples.push((buffer.len() * 8) as f64 / seconds / 1e9);
        }
    }
    std::hint::black_box(sink.load(Ordering::Relaxed));
    samples.sort_by(f64::total_cmp);
    Bandwidth {
        median_gbs: samples[samples.len() / 2],
        best_gbs: samples[samples.len() - 1],
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn bandwidth_is_positive_and_ordered() {
        let b = super::read_bandwidth(8 << 20, 3);
        assert!(b.median_gbs > 0.0 && b.best_gbs >= b.median_gbs, "{b:?}");
    }
}
