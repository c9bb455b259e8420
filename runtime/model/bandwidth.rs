//! A memory read-bandwidth probe: several threads stream disjoint parts of a large buffer.
//! The decode memory limit is `bandwidth / weight bytes per token`.

use std::time::Instant;

/// Measured read bandwidth in bytes/s over a buffer of `bytes` (≥ 256 MiB recommended) with
/// `threads` readers; the best of `reps` passes (after one warm-up pass).
pub fn read_bandwidth(bytes: usize, threads: usize, reps: usize) -> f64 {
    let words = (bytes / 8).max(1024);
    // Touch every page with distinct values so nothing is a shared zero page.
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let threads = threads.max(1);
    let part = words.div_ceil(threads);
    let mut best = 0f64;
    let mut sink = 0u64;
    for rep in 0..=reps.max(1) {
        let t0 = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(part)
                .map(|c| {
                    s.spawn(move || {
                        let mut acc = [0u64; 8];
                        for w in c.chunks_exact(8) {
                            for k in 0..8 {
                                acc[k] = acc[k].wrapping_add(w[k]);
                            }
                        }
                        acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        let dt = t0.elapsed().as_secs_f64();
        sink = sums.iter().fold(sink, |a, &b| a.wrapping_add(b));
        if rep > 0 {
            best = best.max((words * 8) as f64 / dt);
        }
    }
    std::hint::black_box(sink);
    best
}

#[cfg(test)]
mod tests {
    #[test]
    fn bandwidth_is_positive() {
        let b = super::read_bandwidth(8 << 20, 2, 1);
        assert!(b > 1e8, "{b}");
    }
}
