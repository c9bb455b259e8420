//! Roofline probes: the memory read bandwidth every GEMM sweep and decode speed is compared with,
//! and the int8 multiply-add peak a compute-bound (M = 16) sweep is compared with.
//!
//! Both run through the same worker pool the kernels use (so the probes and the kernels see the
//! same threads), repeated; the median and the best run are returned.

// Unsafe is needed to run the target-feature throughput probes (assembly).
#![allow(unsafe_code)]

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

/// Size of the last-level CPU cache in bytes, from sysfs (`/sys/devices/system/cpu/cpu0/cache`:
/// the highest-level data or unified cache), or `None` where the kernel does not say.
pub fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let mut best: Option<(u32, usize)> = None;
    for entry in dir.flatten() {
        let path = entry.path();
        let read = |name: &str| std::fs::read_to_string(path.join(name)).ok();
        let (Some(level), Some(kind), Some(size)) = (read("level"), read("type"), read("size"))
        else {
            continue;
        };
        if kind.trim() == "Instruction" {
            continue;
        }
        let (Ok(level), Some(bytes)) = (level.trim().parse::<u32>(), parse_cache_size(&size))
        else {
            continue;
        };
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, bytes));
        }
    }
    best.map(|(_, bytes)| bytes)
}

/// A sysfs cache size (`"32K"`, `"266240K"`, `"32M"`, or plain bytes) in bytes.
fn parse_cache_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = match text.as_bytes().last()? {
        b'K' => (&text[..text.len() - 1], 1 << 10),
        b'M' => (&text[..text.len() - 1], 1 << 20),
        b'G' => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

/// Bytes a streaming read must cover to measure memory rather than cache: 256 MiB, or twice the
/// last-level cache where that is larger (a server part's L3 can exceed 256 MiB).
pub fn probe_bytes() -> usize {
    let floor = 256 << 20;
    last_level_cache_bytes().map_or(floor, |llc| floor.max(2 * llc))
}

/// Streams `bytes` ([`probe_bytes`] keeps it out of the last-level cache) `runs` times through the
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
/// multi-row GEMM kernels are built on (512-bit `vpdpbusd`, 64 u8 × i8 products, where AVX-512
/// VNNI runs, else `vpmaddubsw`, 32; see [`int8_peak_instruction`]) on independent register
/// chains: the ceiling no q4/q8 kernel on this ISA can pass. `None` without AVX2.
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
            let products = if vnni() { 64 } else { 32 };
            let macs = (pool.threads() as u64 * ITERATIONS * 8 * products) as f64;
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

/// Do the multi-row kernels (and so the peak probe) use AVX-512 VNNI here?
fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::avx2::vnni_available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The instruction [`int8_mac_peak`] measures on this CPU.
pub fn int8_peak_instruction() -> &'static str {
    if vnni() {
        "vpdpbusd (512-bit)"
    } else {
        "vpmaddubsw"
    }
}

/// `iterations` × 8 512-bit `vpdpbusd` (16 independent chains, half as many steps: 16 cover its
/// latency at two per cycle), folded into one word. In assembly: compiled from intrinsics the
/// 16 accumulators were kept in `zmm0`–`zmm15` only, with three of them spilled and reloaded every
/// step, so the chains ran at store-forwarding latency and the probe read ~30 % low.
///
/// # Safety
/// AVX2, AVX-512 F and VNNI available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512vnni")]
unsafe fn dpbusd_chains(iterations: u64) -> u64 {
    use std::arch::x86_64::*;
    let seed = std::hint::black_box(0x0102_0304_0506_0708i64);
    let w = _mm512_set1_epi64(std::hint::black_box(0x0101_0101_0101_0101));
    let x = _mm512_set1_epi64(std::hint::black_box(0x0203_0405_0607_0809));
    let mut acc = [_mm512_setzero_si512(); 16];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = _mm512_set1_epi64(seed + i as i64);
    }
    let [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15] = &mut acc;
    // SAFETY: register-only arithmetic on the named operands and a counter; AVX-512 F and VNNI
    // are available (caller contract).
    unsafe {
        std::arch::asm!(
            "2:",
            "vpdpbusd {a0}, {w}, {x}",
            "vpdpbusd {a1}, {w}, {x}",
            "vpdpbusd {a2}, {w}, {x}",
            "vpdpbusd {a3}, {w}, {x}",
            "vpdpbusd {a4}, {w}, {x}",
            "vpdpbusd {a5}, {w}, {x}",
            "vpdpbusd {a6}, {w}, {x}",
            "vpdpbusd {a7}, {w}, {x}",
            "vpdpbusd {a8}, {w}, {x}",
            "vpdpbusd {a9}, {w}, {x}",
            "vpdpbusd {a10}, {w}, {x}",
            "vpdpbusd {a11}, {w}, {x}",
            "vpdpbusd {a12}, {w}, {x}",
            "vpdpbusd {a13}, {w}, {x}",
            "vpdpbusd {a14}, {w}, {x}",
            "vpdpbusd {a15}, {w}, {x}",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) (iterations / 2).max(1) => _,
            w = in(zmm_reg) w,
            x = in(zmm_reg) x,
            a0 = inout(zmm_reg) *a0,
            a1 = inout(zmm_reg) *a1,
            a2 = inout(zmm_reg) *a2,
            a3 = inout(zmm_reg) *a3,
            a4 = inout(zmm_reg) *a4,
            a5 = inout(zmm_reg) *a5,
            a6 = inout(zmm_reg) *a6,
            a7 = inout(zmm_reg) *a7,
            a8 = inout(zmm_reg) *a8,
            a9 = inout(zmm_reg) *a9,
            a10 = inout(zmm_reg) *a10,
            a11 = inout(zmm_reg) *a11,
            a12 = inout(zmm_reg) *a12,
            a13 = inout(zmm_reg) *a13,
            a14 = inout(zmm_reg) *a14,
            a15 = inout(zmm_reg) *a15,
            options(nomem, nostack),
        );
    }
    let mut folded = _mm512_setzero_si512();
    for a in acc {
        folded = _mm512_xor_si512(folded, a);
    }
    _mm_cvtsi128_si64(_mm512_castsi512_si128(folded)) as u64
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
    fn sysfs_cache_sizes_parse() {
        assert_eq!(super::parse_cache_size("48K\n"), Some(48 << 10));
        assert_eq!(super::parse_cache_size("266240K"), Some(266240 << 10));
        assert_eq!(super::parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(super::parse_cache_size("1024"), Some(1024));
        assert_eq!(super::parse_cache_size("K"), None);
        assert_eq!(super::parse_cache_size("big"), None);
        assert!(super::probe_bytes() >= 256 << 20);
    }

    #[test]
    fn int8_peak_is_positive_and_ordered_when_avx2_runs() {
        if let Some(p) = super::int8_mac_peak(2) {
            assert!(p.median_gbs > 0.0 && p.best_gbs >= p.median_gbs, "{p:?}");
        }
    }
}
