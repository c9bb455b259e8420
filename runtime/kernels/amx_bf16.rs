//! Bf16 weight rows as AMX-BF16 tile products (`kernels::amx`), for every call on a CPU that has
//! them: one activation row or many, so batched rows keep the bits of single rows.
//!
//! `tdpbf16ps C, A, B` adds to the f32 tile `C[r][j]` (16 × 16) the products
//! `A[r][2p]·B[p][2j] + A[r][2p + 1]·B[p][2j + 1]` for `p = 0 .. 16`: 32 values of `k` per
//! instruction. A is 16 weight rows read in place (64 bytes of each row, `2k` bytes apart); B is
//! 16 activation rows of the same 32 values, each row's pairs side by side in one column
//! ([`pair_tiles`], built once per call). Two weight tiles × two activation tiles keep four
//! accumulators; a finished C tile is stored and transposed into the `[activation][weight]`
//! output. Every output is the same sequence of f32 operations whichever tile, tile position or
//! call it ran in, and [`reference_dot`] is that sequence, scalar: it gives the kernel's bits.

// Unsafe is needed for CPUID-gated intrinsics and the tile instructions' inline assembly.
#![allow(unsafe_code)]

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::amx::{self, Tiles, TILE_BYTES, TILE_ROWS, TILE_ROW_BYTES};
use super::ggml_dot::transpose16;

/// Values of `k` in one tile product (16 pairs).
pub const CHUNK: usize = 32;
/// Weight rows in one A tile; activation rows (columns) in one B tile.
const LANES: usize = TILE_ROWS;
/// Chunks ahead of the tile loads that [`products`] asks for weight lines.
const PREFETCH_CHUNKS: usize = 4;

/// Whether the AMX-BF16 kernel runs: [`amx::available`] (tiles, permission, `XDNA_NO_AMX`
/// unset), AMX-BF16, and AVX-512 BF16 for rounding the activations.
pub fn available() -> bool {
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        // Leaf 7, EDX bit 22: AMX-BF16 (leaf 7 exists wherever `amx::available` holds).
        amx::available()
            && __cpuid_count(7, 0).edx & (1 << 22) != 0
            && super::avx512::bf16_dot_available()
    })
}

/// Whether a matrix of `k` columns and a block of `rows` weight rows run here: whole chunks and
/// whole A tiles (other blocks take `vdpbf16ps`, as they do in every call).
pub fn fits(rows: usize, k: usize) -> bool {
    k > 0 && k.is_multiple_of(CHUNK) && rows > 0 && rows.is_multiple_of(LANES)
}

/// Elements [`pair_tiles`] writes for `m` rows of `k`: whole groups of 16 rows.
pub fn pair_tiles_len(m: usize, k: usize) -> usize {
    m.div_ceil(LANES) * LANES * k
}

/// Rows `0 .. m` of `x` (`k` bf16 each, row-major) as B tiles: for group `g` of 16 rows and
/// chunk `c`, the 512 elements from `(g·(k/32) + c)·512` hold tile row `p`, column `j` (row
/// `16g + j`), pair `(x[16g + j][32c + 2p], x[16g + j][32c + 2p + 1])`; rows past `m` are zero.
///
/// # Safety
/// AVX-512 F; `k` a multiple of [`CHUNK`], `x` holds `m · k` elements and `out`
/// [`pair_tiles_len`]`(m, k)`.
#[target_feature(enable = "avx512f")]
pub unsafe fn pair_tiles(x: &[u16], m: usize, k: usize, out: &mut [u16]) {
    debug_assert!(k.is_multiple_of(CHUNK) && x.len() >= m * k && out.len() >= pair_tiles_len(m, k));
    let chunks = k / CHUNK;
    for g in 0..m.div_ceil(LANES) {
        for c in 0..chunks {
            let mut v = [_mm512_setzero_si512(); LANES];
            for (j, v) in v.iter_mut().enumerate() {
                let row = g * LANES + j;
                if row < m {
                    *v = _mm512_loadu_si512(x.as_ptr().add(row * k + c * CHUNK) as *const _);
                }
            }
            let t = transpose16(&v);
            let dst = out.as_mut_ptr().add((g * chunks + c) * (TILE_BYTES / 2));
            for (p, t) in t.iter().enumerate() {
                _mm512_storeu_si512(dst.add(p * (TILE_ROW_BYTES / 2)) as *mut _, *t);
            }
        }
    }
}

/// Weight rows `0 .. rows` of `w` (`k` bf16 each, `2k` bytes apart) against activation rows
/// `act_rows` of `pairs` ([`pair_tiles`] of the call's rows): `out[(i − act_rows.start)·stride
/// + r]` for activation row `i` and weight row `r`, each [`reference_dot`]'s bits.
///
/// # Safety
/// [`available`]; [`fits`]`(rows, k)`; `w` holds `rows · 2k` bytes; `pairs` is [`pair_tiles`]
/// of at least `act_rows.end` rows of `k`; `act_rows.start` is a multiple of 16; `out` holds
/// `(act_rows.len() − 1)·stride + rows` floats.
#[target_feature(enable = "avx512f")]
pub unsafe fn rows(
    w: &[u8],
    rows: usize,
    k: usize,
    pairs: &[u16],
    act_rows: std::ops::Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    debug_assert!(fits(rows, k) && act_rows.start.is_multiple_of(LANES));
    debug_assert!(w.len() >= rows * 2 * k && pairs.len() >= pair_tiles_len(act_rows.end, k));
    if act_rows.is_empty() {
        return;
    }
    debug_assert!(out.len() >= (act_rows.len() - 1) * stride + rows);
    let chunks = k / CHUNK;
    let row_bytes = 2 * k;
    let groups = act_rows.start / LANES..act_rows.end.div_ceil(LANES);
    // SAFETY: `available()` (the caller's contract); every tile is 16 rows of 64 bytes.
    let _tiles = Tiles::configure([TILE_ROWS as u8; 8]);
    // Every `products` call stores all four C tiles before any is read: nothing to zero.
    let mut c_tiles = std::mem::MaybeUninit::<CTiles>::uninit();
    for r0 in (0..rows).step_by(2 * LANES) {
        let two_w = rows - r0 >= 2 * LANES;
        let a = w.as_ptr().add(r0 * row_bytes);
        let mut g = groups.start;
        while g < groups.end {
            let two_g = groups.end - g >= 2;
            let b = pairs.as_ptr().add(g * chunks * (TILE_BYTES / 2)) as *const u8;
            // The weights come from memory on the first group only; later groups find them in
            // cache.
            let prefetch = g == groups.start;
            products(
                a,
                row_bytes,
                b,
                chunks,
                two_w,
                two_g,
                prefetch,
                c_tiles.as_mut_ptr(),
            );
            // SAFETY: `products` just stored all four tiles.
            let c = c_tiles.assume_init_ref();
            for (t, tile) in c.0.chunks_exact(TILE_BYTES / 4).enumerate() {
                let (wt, gt) = (t % 2, t / 2);
                if (wt == 1 && !two_w) || (gt == 1 && !two_g) {
                    continue;
                }
                let first = (g + gt) * LANES;
                let acts = (act_rows.end.min(first + LANES)) - first;
                let dst = out
                    .as_mut_ptr()
                    .add((first - act_rows.start) * stride + r0 + wt * LANES);
                store_transposed(tile, acts, dst, stride);
            }
            g += if two_g { 2 } else { 1 };
        }
    }
}

/// Four C tiles' floats, `[g tile][w tile][weight row][activation column]`, line-aligned for
/// `tilestored`.
#[repr(C, align(64))]
struct CTiles([f32; 4 * TILE_BYTES / 4]);

/// The C tiles of one or two weight tiles (`a`, 16 rows each, the second `16·a_stride` bytes on)
/// by one or two activation tiles (`b`, the second `chunks` tiles on), over every chunk, into
/// `c` (`[g tile][w tile]`; all four are stored, zero where a tile is absent). With `prefetch`,
/// each step first asks for the lines its rows need [`PREFETCH_CHUNKS`] steps later (past the
/// last chunk: the same lines of the rows after `a`'s).
///
/// # Safety
/// Tiles configured by [`rows`]; `a` holds 16 or 32 rows of `64·chunks` bytes `a_stride` apart,
/// `b` one or two groups of `chunks` tiles, `c` writable for a [`CTiles`].
#[allow(clippy::too_many_arguments)] // one tile step's context
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn products(
    a: *const u8,
    a_stride: usize,
    b: *const u8,
    chunks: usize,
    two_w: bool,
    two_g: bool,
    prefetch: bool,
    c: *mut CTiles,
) {
    let a_high = a.add(LANES * a_stride);
    let b_next = b.add(chunks * TILE_BYTES);
    let line = TILE_ROW_BYTES;
    // SAFETY (every asm block below): the tiles are configured (the caller's contract); each load
    // reads 16 rows of 64 bytes inside `a` or `b`, and each store writes one 1 KiB quarter of `c`.
    asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        options(nostack, nomem)
    );
    let rows = if two_w { 2 * LANES } else { LANES };
    for ch in 0..chunks {
        if prefetch {
            // A tile register is not renamed: the next chunk's load waits for this chunk's
            // product, which waits for this chunk's load, so a line missed by a tile load stalls
            // the whole chain, and decode reads each weight line once: it is asked for ahead.
            let ahead = ch + PREFETCH_CHUNKS;
            let (base, column) = if ahead < chunks {
                (a, ahead)
            } else {
                (a.wrapping_add(rows * a_stride), ahead - chunks)
            };
            for r in 0..rows {
                let at = base.wrapping_add(r * a_stride + column * line);
                _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
            }
        }
        let (a0, b0) = (a.add(ch * line), b.add(ch * TILE_BYTES));
        asm!(
            "tileloadd tmm4, [{a} + {s}*1]",
            "tileloadd tmm6, [{b} + {l}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            a = in(reg) a0, s = in(reg) a_stride, b = in(reg) b0, l = in(reg) line,
            options(nostack, readonly),
        );
        if two_w {
            asm!(
                "tileloadd tmm5, [{a} + {s}*1]",
                "tdpbf16ps tmm1, tmm5, tmm6",
                a = in(reg) a_high.add(ch * line), s = in(reg) a_stride,
                options(nostack, readonly),
            );
        }
        if two_g {
            asm!(
                "tileloadd tmm7, [{b} + {l}*1]",
                "tdpbf16ps tmm2, tmm4, tmm7",
                b = in(reg) b_next.add(ch * TILE_BYTES), l = in(reg) line,
                options(nostack, readonly),
            );
            if two_w {
                asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem));
            }
        }
    }
    let out = c as *mut u8;
    asm!(
        "tilestored [{c} + {l}*1], tmm0",
        "tilestored [{c} + {l}*1 + 1024], tmm1",
        "tilestored [{c} + {l}*1 + 2048], tmm2",
        "tilestored [{c} + {l}*1 + 3072], tmm3",
        c = in(reg) out, l = in(reg) line,
        options(nostack),
    );
}

/// A C tile (`[weight row][activation column]`, 16 × 16) into `dst[j·stride + r]` for its first
/// `acts` columns `j`.
///
/// # Safety
/// AVX-512 F; `dst` holds `(acts − 1)·stride + 16` floats.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_transposed(tile: &[f32], acts: usize, dst: *mut f32, stride: usize) {
    if acts == LANES {
        let v: [__m512i; LANES] =
            std::array::from_fn(|r| _mm512_loadu_si512(tile.as_ptr().add(r * LANES) as *const _));
        for (j, t) in transpose16(&v).iter().enumerate() {
            _mm512_storeu_si512(dst.add(j * stride) as *mut _, *t);
        }
        return;
    }
    for j in 0..acts {
        for r in 0..LANES {
            *dst.add(j * stride + r) = tile[r * LANES + j];
        }
    }
}

/// One output of [`rows`], scalar, as `tdpbf16ps` computes it: per chunk of 32 values, the
/// even-indexed products and the odd-indexed ones each summed in order from zero by f32
/// multiply-adds (each product of two bf16 is exact, so one rounding per step), their two sums
/// added, and that added to the running sum; subnormal inputs and results are taken as zero.
/// `k` is a multiple of [`CHUNK`].
pub fn reference_dot(w: &[u16], x: &[u16], k: usize) -> f32 {
    let flush = |v: f32| if v.is_subnormal() { 0.0 } else { v };
    let value = |bits: u16| flush(f32::from_bits(u32::from(bits) << 16));
    let mut sum = 0f32;
    for (w, x) in w[..k].chunks_exact(CHUNK).zip(x[..k].chunks_exact(CHUNK)) {
        let (mut even, mut odd) = (0f32, 0f32);
        for p in 0..CHUNK / 2 {
            even = flush(value(w[2 * p]).mul_add(value(x[2 * p]), even));
            odd = flush(value(w[2 * p + 1]).mul_add(value(x[2 * p + 1]), odd));
        }
        sum = flush(sum + flush(even + odd));
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_values(n: usize, seed: u64) -> Vec<u16> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let v = ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0;
                half::bf16::from_f32(v).to_bits()
            })
            .collect()
    }

    #[test]
    fn tile_products_give_the_reference_chain_bits() {
        if !available() {
            eprintln!("no AMX-BF16 here: nothing to run");
            return;
        }
        let mut total = (0usize, 0usize);
        for (rows, k, m) in [
            (32usize, 576usize, 37usize),
            (16, 32, 1),
            (48, 96, 16),
            (32, 1536, 3),
        ] {
            let w = bf16_values(rows * k, 7 + k as u64);
            let x = bf16_values(m * k, 11 + m as u64);
            let mut pairs = vec![0u16; pair_tiles_len(m, k)];
            // SAFETY: `available` implies AVX-512 F; the lengths are as `pair_tiles` asks.
            unsafe { pair_tiles(&x, m, k, &mut pairs) };
            let wb: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            for start in [0, 16] {
                if start >= m {
                    continue;
                }
                let mut out = vec![f32::NAN; (m - start) * rows];
                // SAFETY: `available`, `fits`, and every length as `rows` asks.
                unsafe { super::rows(&wb, rows, k, &pairs, start..m, &mut out, rows) };
                let (mut differ, mut one_chain_differs) = (0, 0);
                for i in start..m {
                    for r in 0..rows {
                        let (wr, xr) = (&w[r * k..(r + 1) * k], &x[i * k..(i + 1) * k]);
                        let want = reference_dot(wr, xr, k);
                        let got = out[(i - start) * rows + r];
                        if got.to_bits() != one_chain_dot(wr, xr).to_bits() {
                            one_chain_differs += 1;
                        }
                        if got.to_bits() != want.to_bits() {
                            differ += 1;
                            if differ < 5 {
                                eprintln!("{rows}x{k} m={m} row {i} weight {r}: {got} vs {want}");
                            }
                        }
                    }
                }
                assert_eq!(differ, 0, "{rows}x{k} m={m} from {start}");
                eprintln!(
                    "{rows}x{k} m={m} from {start}: one chain gives other bits in {one_chain_differs} of {} outputs",
                    (m - start) * rows
                );
                total.0 += one_chain_differs;
                total.1 += (m - start) * rows;
            }
        }
        // The order matters: one chain of multiply-adds over all the values (the order of
        // Intel's pseudo-code) gives other bits in many outputs.
        assert!(
            4 * total.0 > total.1,
            "one chain differs in {} of {}",
            total.0,
            total.1
        );
    }

    /// Every product added in turn to one running sum, flushing as the instruction does.
    fn one_chain_dot(w: &[u16], x: &[u16]) -> f32 {
        let flush = |v: f32| if v.is_subnormal() { 0.0 } else { v };
        let value = |bits: u16| flush(f32::from_bits(u32::from(bits) << 16));
        w.iter()
            .zip(x)
            .fold(0f32, |sum, (&w, &x)| flush(value(w).mul_add(value(x), sum)))
    }
}
