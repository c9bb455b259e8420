//! Roofline probes: the memory read bandwidth every GEMM sweep and decode speed is compared with,
//! and the int8 multiply-add peak a compute-bound (M = 16) sweep is compared with.
//!
//! Both run through the same worker pool the kernels use (so the probes and the kernels see the
//! same threads), repeated; the median and the best run are returned.

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

/// Int8 multiply-adds per second (10⁹), every pool thread issuing only the integer multiply the
/// multi-row GEMM kernels are built on (`vpdpbusd` where AVX-512 VNNI runs, else `vpmaddubsw`:
/// 32 u8 × i8 products per instruction either way; see [`int8_peak_instruction`]) on independent
/// register chains: the ceiling no q4/q8 kernel on this ISA can pass. `None` without AVX2.
pub fn int8_mac_peak(runs: usize) -> Option<Bandwidth> {
    if !super::gemm::fast_available() {
        return None;
    }
    // Per thread per run: 2²² iterations × 8 instructions ≈ 10 ms at ~3 instructions per ns.
    const ITERATIONS: u64 = 1 << 22;
    let pool = Pool::global();
    let sink = AtomicU64::new(0);
    let mut samples = Vec::with_capacity(runs.max(1));
    for run in 0..=runs.max(1) {
        let start = Instant::now();
        pool.run(&|_, _| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 is available (`fast_available` above), and AVX-512 VNNI where
            // `vnni_available` says so.
            let folded = unsafe {
                if super::avx2::vnni_available() {
                    dpbusd_chains(ITERATIONS)
                } else {
                    maddubs_chains(ITERATIONS)
                }
            };
            sink.fetch_xor(folded, Ordering::Relaxed);
        });
        let seconds = start.elapsed().as_secs_f64();
        if run > 0 {
            let macs = (pool.threads() as u64 * ITERATIONS * 8 * 32) as f64;
            samples.push(macs / seconds / 1e9);
        }
    }
    std::hint::black_box(sink.load(Ordering::Relaxed));
    samples.sort_by(f64::total_cmp);
    Some(Bandwidth {
        median_gbs: samples[samples.len() / 2],
        best_gbs: samples[samples.len() - 1],
    })
}

/// The instruction [`int8_mac_peak`] measures on this CPU.
pub fn int8_peak_instruction() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if super::avx2::vnni_available() {
        return "vpdpbusd";
    }
    "vpmaddubsw"
}

/// `iterations` × 8 `vpdpbusd` (16 independent chains, half as many steps: 16 cover its latency at
/// two per cycle), folded into one word.
///
/// # Safety
/// AVX2, AVX-512 F, VL and VNNI available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
unsafe fn dpbusd_chains(iterations: u64) -> u64 {
    use std::arch::x86_64::*;
    let seed = std::hint::black_box(0x0102_0304_0506_0708i64);
    let w = _mm256_set1_epi64x(std::hint::black_box(0x0101_0101_0101_0101));
    let x = _mm256_set1_epi64x(std::hint::black_box(0x0203_0405_0607_0809));
    let mut acc: [__m256i; 16] = std::array::from_fn(|i| _mm256_set1_epi64x(seed + i as i64));
    for _ in 0..iterations / 2 {
        for a in acc.iter_mut() {
            *a = _mm256_dpbusd_epi32(*a, w, x);
        }
    }
    let folded = acc
        .iter()
        .fold(_mm256_setzero_si256(), |f, &a| _mm256_xor_si256(f, a));
    _mm256_extract_epi64::<0>(folded) as u64
}

/// `iterations` × 8 `vpmaddubsw` on 8 independent chains (enough to cover its latency on every
/// AVX2 core), folded into one word so nothing is optimised away.
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn maddubs_chains(iterations: u64) -> u64 {
    use std::arch::x86_64::*;
    let seed = std::hint::black_box(0x0102_0304_0506_0708i64);
    let x = _mm256_set1_epi64x(std::hint::black_box(0x0101_0101_0101_0101));
    let mut acc: [__m256i; 8] = std::array::from_fn(|i| _mm256_set1_epi64x(seed + i as i64));
    for _ in 0..iterations {
        for a in acc.iter_mut() {
            *a = _mm256_maddubs_epi16(*a, x);
        }
    }
    let folded = acc
        .iter()
        .fold(_mm256_setzero_si256(), |f, &a| _mm256_xor_si256(f, a));
    _mm256_extract_epi64::<0>(folded) as u64
}

#[cfg(test)]
mod tests {
    #[test]
    fn bandwidth_is_positive_and_ordered() {
        let b = super::read_bandwidth(8 << 20, 3);
        assert!(b.median_gbs > 0.0 && b.best_gbs >= b.median_gbs, "{b:?}");
    }

    #[test]
    fn int8_peak_is_positive_and_ordered_when_avx2_runs() {
        if let Some(p) = super::int8_mac_peak(2) {
            assert!(p.median_gbs > 0.0 && p.best_gbs >= p.median_gbs, "{p:?}");
        }
    }
}
