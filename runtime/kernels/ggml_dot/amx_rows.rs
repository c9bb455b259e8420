//! Super-block weight rows as AMX-INT8 tile products, for calls with many activation rows on
//! CPUs with AMX (`kernels::amx`).
//!
//! Each block of a weight row is decoded as for the lane kernels (`lanes::decode`), and its codes
//! turned into the block's exact integer weights `w = sc·(u − bias)` (the sub-block scale times
//! the signed code; `|w| < 2¹³` for every type), split into an unsigned low byte and a signed
//! high byte, `w = lo + 256·hi`; types with minimums add a third byte plane, each value's
//! sub-block minimum. Sixteen weight rows of a 64-value run, four values of a row side by side,
//! make one B tile per plane (the lanes' layout); sixteen activation rows' 64 codes
//! (`QuantizedRows::code_lines`) make the A tile; each `tdpbsud` / `tdpbssd` takes 16 · 16 · 64
//! multiply-adds. After a block's four runs, `C_lo + 256·C_hi` is every (activation row, weight
//! row) pair's exact block sum `S = Σ_s sc_s·Σ_{i∈s} q_i·c_i` and `C_min` its exact minimums' sum
//! `M = Σ_s m_s·Σ_{i∈s} c_i` — the integers the lane and row kernels find — and from there each
//! output takes the lane kernels' float steps, so it has their bits whichever kernel ran. Q2_K's
//! weights (at most 15 · 3) have no high byte.
//!
//! A block's products are stored and read back by the vector units for the float steps; the
//! next block's tile products are issued first, so the two units overlap. A tile load from
//! aligned lines hides behind the products, and one whose rows straddle cache lines costs
//! several times as much: hence the aligned activation copy.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::k512::WeightRows;
use super::lanes::{self, Kind};
use crate::kernels::amx::{self, Tiles, TILE_BYTES, TILE_ROWS};
use crate::kernels::quant::QuantizedRows;

/// Weight rows per lane group: one column of the product tiles each.
const LANES: usize = 16;
/// 64-value runs (one tile product per plane) per 256-value block.
const RUNS: usize = 4;
/// Byte planes of the weights: low bytes, high bytes, minimums.
const PLANES: usize = 3;
/// Registers (tile rows) per block and lane group: four runs of three planes' tiles.
const BLOCK_REGS: usize = RUNS * PLANES * TILE_ROWS;

/// The call's weight rows decoded into tiles, per lane group `g` (16 rows) and block `b`
/// (`gb = g·nb + b`). Every buffer only grows: each call overwrites what it reads.
#[derive(Default)]
struct Scratch {
    /// `[gb][run][plane][tile row]`: tile row `k` of run `j` holds values `64j + 4k ..
    /// 64j + 4k + 4` of the group's 16 weight rows, in their lanes.
    tiles: Vec<__m512i>,
    /// `[gb][lane]` block scales `d` and `dmin` (lanes past the call's rows: stale, unused).
    d: Vec<f32>,
    dmin: Vec<f32>,
    /// `[lane][run][plane]`: 16 rows of one block's planes, before the transpose.
    staging: Vec<__m512i>,
    /// `[chunk][sum, minimums' sum][row]`: a lane group's accumulators for every chunk of 16
    /// activation rows, so that each block's weight tiles serve all chunks while in cache.
    acc: Vec<__m512>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Rows `rows` of a `kind` matrix against activation rows `act_rows` of `act` (one scale per
/// 256 values): `out[(i − act_rows.start)·stride + r]` for activation row `i` and weight row
/// `r`, with the bits `lanes::rows` gives.
///
/// # Safety
/// `amx::available()`; `rows` holds `cols / 256` blocks of `kind` per row, `act` holds `cols`
/// codes per row of `act_rows` with `ActivationScale::PerSuperblock` scales and its
/// `code_lines` filled, and `out` holds `(act_rows.len() − 1)·stride + rows.count` floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
pub(super) unsafe fn rows(
    kind: Kind,
    rows: WeightRows,
    cols: usize,
    act: &QuantizedRows,
    act_rows: std::ops::Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    debug_assert_eq!(act.code_lines.len() * 64, act.rows * act.cols);
    crate::kernels::with_scratch(&SCRATCH, |scratch| {
        decode_rows(kind, rows, cols, scratch);
        let whole = act_rows.start + act_rows.len() / TILE_ROWS * TILE_ROWS;
        // Whole tiles of 16 activation rows, then the rest with A and C tiles that short.
        for part in [act_rows.start..whole, whole..act_rows.end] {
            if part.is_empty() {
                continue;
            }
            let m = part.len().min(TILE_ROWS) as u8;
            // Tiles 0–2 are C tiles of `m` activation rows where the type has their planes, and
            // otherwise B tiles of 16 rows (`multiply`); 3–4 are A tiles, 5–7 B tiles.
            let (high, mins) = planes(kind);
            let c_or_b = |c: bool| if c { m } else { TILE_ROWS as u8 };
            // SAFETY: `amx::available()` (the caller's contract).
            let _tiles = Tiles::configure([m, c_or_b(high), c_or_b(mins), m, m, 16, 16, 16]);
            let Scratch {
                tiles,
                d,
                dmin,
                acc,
                ..
            } = &mut *scratch;
            for g in 0..rows.count.div_ceil(LANES) {
                let pass = GroupPass {
                    tiles,
                    d,
                    dmin,
                    nb: cols / 256,
                    g,
                    lanes_here: (rows.count - g * LANES).min(LANES),
                    first: part.start,
                    rows: part.len(),
                };
                // SAFETY: `out` holds rows `part.start − act_rows.start ..` + part.len() of
                // `stride` floats from this group's first lane on (the caller's contract).
                let out = out
                    .as_mut_ptr()
                    .add((part.start - act_rows.start) * stride + g * LANES);
                match (high, mins) {
                    (false, _) => pass.run::<false, true>(act, acc, out, stride),
                    (true, true) => pass.run::<true, true>(act, acc, out, stride),
                    (true, false) => pass.run::<true, false>(act, acc, out, stride),
                }
            }
        }
    });
}

/// Whether `kind`'s weights have high bytes (all but Q2_K's, at most 15 · 3), and whether it
/// has minimums.
fn planes(kind: Kind) -> (bool, bool) {
    match kind {
        Kind::Q2K => (false, true),
        Kind::Q4K | Kind::Q5K => (true, true),
        Kind::Q3K | Kind::Q6K | Kind::Iq4Xs => (true, false),
    }
}

/// Decode every block of `rows` into `s` (lanes past `rows.count` zero in the tiles).
///
/// # Safety
/// As [`rows`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn decode_rows(kind: Kind, rows: WeightRows, cols: usize, s: &mut Scratch) {
    let nb = cols / 256;
    let groups = rows.count.div_ceil(LANES);
    let zero = _mm512_setzero_si512();
    grow(&mut s.tiles, groups * nb * BLOCK_REGS, zero);
    grow(&mut s.d, groups * nb * LANES, 0.0);
    grow(&mut s.dmin, groups * nb * LANES, 0.0);
    grow(&mut s.staging, LANES * RUNS * PLANES, zero);
    let table = lanes::iq4_table();
    let bias = kind.bias_log2().map_or(0, |log2| 1u8 << log2);
    let (high, mins) = planes(kind);
    let read = [true, high, mins];
    for g in 0..groups {
        for b in 0..nb {
            let gb = g * nb + b;
            for lane in 0..LANES {
                let r = g * LANES + lane;
                let staged = &mut s.staging[lane * RUNS * PLANES..(lane + 1) * RUNS * PLANES];
                if r >= rows.count {
                    staged.fill(zero);
                    continue;
                }
                let mut codes = [zero; 4];
                let p = rows.row(r).add(b * kind.block_bytes());
                let ints = lanes::decode(kind, p, table, &mut codes);
                weight_planes(&codes, &ints, kind.sub(), bias, mins, staged);
                s.d[gb * LANES + lane] = ints.d;
                s.dmin[gb * LANES + lane] = ints.dmin;
            }
            // Each run's planes of every row, transposed into the run's B tiles: only the planes
            // the type's products read (`multiply`).
            for plane in 0..RUNS * PLANES {
                if !read[plane % PLANES] {
                    continue;
                }
                let rows16: [__m512i; 16] =
                    std::array::from_fn(|lane| s.staging[lane * RUNS * PLANES + plane]);
                let at = gb * BLOCK_REGS + plane * TILE_ROWS;
                s.tiles[at..at + TILE_ROWS].copy_from_slice(&lanes::transpose16(&rows16));
            }
        }
    }
}

/// `v` at least `len` long (new elements `fill`); what is there is left to be overwritten.
fn grow<T: Copy>(v: &mut Vec<T>, len: usize, fill: T) {
    if v.len() < len {
        v.resize(len, fill);
    }
}

/// Byte `i` of run `j` is value `64j + i`, of sub-block `(64j + i) / sub`: `vpermb` indices
/// that spread a block's sub-block scales or minimums over its values.
const SUB16_PICKS: [[u8; 64]; RUNS] = sub_block_picks(16);
const SUB32_PICKS: [[u8; 64]; RUNS] = sub_block_picks(32);

const fn sub_block_picks(sub: usize) -> [[u8; 64]; RUNS] {
    let mut picks = [[0u8; 64]; RUNS];
    let mut value = 0;
    while value < 256 {
        picks[value / 64][value % 64] = (value / sub) as u8;
        value += 1;
    }
    picks
}

/// A block's 256 unsigned codes (64 per register) as its weight planes, `out[run·3 + plane]`
/// with 64 values per register in value order: the low and high bytes of the integer weights
/// `sc·(u − bias)`, and with `mins_plane` each value's sub-block minimum. The products come
/// from `vpmaddubsw` against each value's scale in every other byte (the even values', then the
/// odd values'; one product per pair, so never saturated: `|u·sc| ≤ 255 · 128`), and the bytes
/// are picked by blends: no cross-lane shuffle but the one that spreads the scales.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vbmi")]
unsafe fn weight_planes(
    codes: &[__m512i; 4],
    ints: &lanes::BlockInts,
    sub: usize,
    bias: u8,
    mins_plane: bool,
    out: &mut [__m512i],
) {
    // The 16 i32 as bytes, each half read as wide as `lanes::decode` stores Q4_K's and Q5_K's
    // eight values: a wider load would wait for that store to reach the cache instead of
    // taking it forwarded.
    let bytes16 = |v: &[i32; 16]| {
        let halves = [0, 8]
            .map(|at| _mm256_cvtepi32_epi8(_mm256_loadu_si256(v.as_ptr().add(at) as *const _)));
        _mm512_castsi128_si512(_mm_unpacklo_epi64(halves[0], halves[1]))
    };
    let scales = bytes16(&ints.scales);
    let mins = if mins_plane {
        bytes16(&ints.mins)
    } else {
        _mm512_setzero_si512()
    };
    let low_bytes = _mm512_set1_epi16(0x00FF);
    let biases = _mm512_set1_epi8(bias as i8);
    const ODD_BYTES: __mmask64 = 0xAAAA_AAAA_AAAA_AAAA;
    for (j, &run) in codes.iter().enumerate() {
        let picks = if sub == 16 {
            &SUB16_PICKS[j]
        } else {
            &SUB32_PICKS[j]
        };
        let picks = _mm512_loadu_si512(picks.as_ptr() as *const _);
        let sc = _mm512_permutexvar_epi8(picks, scales);
        // i16 lane i: w[2i] (`even`), w[2i + 1] (`odd`).
        let [even, odd] = [
            _mm512_and_si512(sc, low_bytes),
            _mm512_andnot_si512(low_bytes, sc),
        ]
        .map(|pattern| {
            let w = _mm512_maddubs_epi16(run, pattern);
            if bias == 0 {
                w
            } else {
                _mm512_sub_epi16(w, _mm512_maddubs_epi16(biases, pattern))
            }
        });
        out[PLANES * j] = _mm512_mask_blend_epi8(ODD_BYTES, even, _mm512_slli_epi16::<8>(odd));
        out[PLANES * j + 1] = _mm512_mask_blend_epi8(ODD_BYTES, _mm512_srli_epi16::<8>(even), odd);
        if mins_plane {
            out[PLANES * j + 2] = _mm512_permutexvar_epi8(picks, mins);
        }
    }
}

/// One lane group's part of a call: every chunk of (up to) 16 activation rows of a part whose
/// chunks share one tile configuration.
struct GroupPass<'a> {
    tiles: &'a [__m512i],
    d: &'a [f32],
    dmin: &'a [f32],
    nb: usize,
    /// The lane group.
    g: usize,
    /// Weight rows in the group (≤ 16).
    lanes_here: usize,
    /// The part's first activation row.
    first: usize,
    /// Activation rows in the part: whole chunks of 16, or one chunk of the configured rows.
    rows: usize,
}

/// 64-byte aligned room for a block's three product tiles.
#[repr(C, align(64))]
struct Products([i32; PLANES * TILE_BYTES / 4]);

impl GroupPass<'_> {
    /// The part's activation rows against the group's 16 weight rows, into `out[a·stride +
    /// lane]`, block by block and within a block chunk by chunk (each element's float steps in
    /// block order, as in the lane kernels). The next (block, chunk)'s products run on the tile
    /// unit during the float steps of the current one, and are stored after those have read
    /// its sums. `HIGH`: the type's weights have high bytes; `MINS`: it has minimums.
    ///
    /// # Safety
    /// As [`rows`], with tiles configured for the part's chunks; `out` holds `rows` rows of
    /// `stride` floats, the first `lanes_here` of each written.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn run<const HIGH: bool, const MINS: bool>(
        &self,
        act: &QuantizedRows,
        acc: &mut Vec<__m512>,
        out: *mut f32,
        stride: usize,
    ) {
        let chunks = self.rows.div_ceil(TILE_ROWS);
        acc.clear();
        acc.resize(chunks * 2 * TILE_ROWS, _mm512_setzero_ps());
        let mut products = Products([0; PLANES * TILE_BYTES / 4]);
        let lines = act.code_lines.as_ptr() as *const i8;
        // Step i: block i / chunks, chunk i % chunks.
        let steps = self.nb * chunks;
        let a = |i: usize| {
            let (b, chunk) = (i / chunks, i % chunks);
            lines.add((self.first + chunk * TILE_ROWS) * act.cols + b * 256)
        };
        let weights = |i: usize| {
            let gb = self.g * self.nb + i / chunks;
            self.tiles.as_ptr().add(gb * BLOCK_REGS) as *const u8
        };
        let c = products.0.as_mut_ptr();
        multiply::<HIGH, MINS>(a(0), act.cols, weights(0));
        store::<HIGH, MINS>(c);
        for i in 0..steps {
            let next = i + 1 < steps;
            if next {
                multiply::<HIGH, MINS>(a(i + 1), act.cols, weights(i + 1));
            }
            let (b, chunk) = (i / chunks, i % chunks);
            let acc = &mut acc[chunk * 2 * TILE_ROWS..(chunk + 1) * 2 * TILE_ROWS];
            self.block_sums::<HIGH, MINS>(act, b, chunk, &products, acc);
            if next {
                store::<HIGH, MINS>(c);
            }
        }
        let mask = ((1u32 << self.lanes_here) - 1) as __mmask16;
        for r in 0..self.rows {
            let acc = &acc[(r / TILE_ROWS) * 2 * TILE_ROWS..];
            let (sum, mins) = (acc[r % TILE_ROWS], acc[TILE_ROWS + r % TILE_ROWS]);
            let result = if MINS { _mm512_sub_ps(sum, mins) } else { sum };
            _mm512_mask_storeu_ps(out.add(r * stride), mask, result);
        }
    }

    /// Block `b`'s exact sums of chunk `chunk` (`products`) into its accumulators (`acc`: the
    /// sums' 16 rows, then the minimums' sums'), with the lane kernels' float steps.
    ///
    /// # Safety
    /// As [`GroupPass::run`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn block_sums<const HIGH: bool, const MINS: bool>(
        &self,
        act: &QuantizedRows,
        b: usize,
        chunk: usize,
        products: &Products,
        acc: &mut [__m512],
    ) {
        let gb = self.g * self.nb + b;
        let groups = act.groups();
        let d = _mm512_loadu_ps(self.d.as_ptr().add(gb * LANES));
        let dmin = _mm512_loadu_ps(self.dmin.as_ptr().add(gb * LANES));
        let tile = |plane: usize, r: usize| {
            _mm512_load_si512(products.0.as_ptr().add(plane * TILE_BYTES / 4 + 16 * r) as *const _)
        };
        let first = self.first + chunk * TILE_ROWS;
        let m = (self.rows - chunk * TILE_ROWS).min(TILE_ROWS);
        let (sums, mins_sums) = acc.split_at_mut(TILE_ROWS);
        for (r, (acc, acc_mins)) in sums.iter_mut().zip(mins_sums).take(m).enumerate() {
            let total = if HIGH {
                _mm512_add_epi32(tile(0, r), _mm512_slli_epi32::<8>(tile(1, r)))
            } else {
                tile(0, r)
            };
            let act_d = *act.scales.as_ptr().add((first + r) * groups + b * 8);
            let act_d = _mm512_set1_ps(act_d);
            *acc = _mm512_fmadd_ps(_mm512_mul_ps(d, act_d), _mm512_cvtepi32_ps(total), *acc);
            if MINS {
                let mins = _mm512_cvtepi32_ps(tile(2, r));
                *acc_mins = _mm512_fmadd_ps(_mm512_mul_ps(dmin, act_d), mins, *acc_mins);
            }
        }
    }
}

/// One block's products into tiles 0 (C, low bytes), 1 (C, high bytes; with `HIGH`) and 2 (C,
/// minimums; with `MINS`), over the block's four runs of A (the activation rows' codes `a`, rows
/// `a_stride` apart, 64 bytes per run; alternate runs in tiles 3 and 4) and B (`weights`, the
/// block's [`BLOCK_REGS`] registers, per run the three planes' tiles). B tiles are 5–7; a type
/// without one of the C tiles 1, 2 loads every other run's B tiles into 7 and that tile, so a
/// run's loads need not wait for the previous run's products.
///
/// # Safety
/// Tiles configured as in [`rows`]; `a` 64-byte aligned and readable for the configured rows at
/// `a_stride` and 256 bytes each; `weights` holds [`BLOCK_REGS`] aligned registers.
#[inline(always)]
unsafe fn multiply<const HIGH: bool, const MINS: bool>(
    a: *const i8,
    a_stride: usize,
    weights: *const u8,
) {
    let r = amx::TILE_ROW_BYTES;
    macro_rules! products {
        ($($line:literal),* $(,)?) => {
            // SAFETY: the caller's contract; each run's three B tiles are 1 KiB apart, and
            // runs 3 KiB.
            asm!(
                $($line,)*
                a = in(reg) a,
                s = in(reg) a_stride,
                w = in(reg) weights,
                r = in(reg) r,
                options(nostack, readonly),
            )
        };
    }
    match (HIGH, MINS) {
        (true, true) => products!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tileloadd tmm3, [{a} + {s}*1]",
            "tileloadd tmm5, [{w} + {r}*1]",
            "tileloadd tmm6, [{w} + {r}*1 + 1024]",
            "tileloadd tmm7, [{w} + {r}*1 + 2048]",
            "tdpbsud tmm0, tmm3, tmm5",
            "tdpbssd tmm1, tmm3, tmm6",
            "tdpbsud tmm2, tmm3, tmm7",
            "tileloadd tmm4, [{a} + {s}*1 + 64]",
            "tileloadd tmm5, [{w} + {r}*1 + 3072]",
            "tileloadd tmm6, [{w} + {r}*1 + 4096]",
            "tileloadd tmm7, [{w} + {r}*1 + 5120]",
            "tdpbsud tmm0, tmm4, tmm5",
            "tdpbssd tmm1, tmm4, tmm6",
            "tdpbsud tmm2, tmm4, tmm7",
            "tileloadd tmm3, [{a} + {s}*1 + 128]",
            "tileloadd tmm5, [{w} + {r}*1 + 6144]",
            "tileloadd tmm6, [{w} + {r}*1 + 7168]",
            "tileloadd tmm7, [{w} + {r}*1 + 8192]",
            "tdpbsud tmm0, tmm3, tmm5",
            "tdpbssd tmm1, tmm3, tmm6",
            "tdpbsud tmm2, tmm3, tmm7",
            "tileloadd tmm4, [{a} + {s}*1 + 192]",
            "tileloadd tmm5, [{w} + {r}*1 + 9216]",
            "tileloadd tmm6, [{w} + {r}*1 + 10240]",
            "tileloadd tmm7, [{w} + {r}*1 + 11264]",
            "tdpbsud tmm0, tmm4, tmm5",
            "tdpbssd tmm1, tmm4, tmm6",
            "tdpbsud tmm2, tmm4, tmm7",
        ),
        (true, false) => products!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tileloadd tmm3, [{a} + {s}*1]",
            "tileloadd tmm5, [{w} + {r}*1]",
            "tileloadd tmm6, [{w} + {r}*1 + 1024]",
            "tdpbsud tmm0, tmm3, tmm5",
            "tdpbssd tmm1, tmm3, tmm6",
            "tileloadd tmm4, [{a} + {s}*1 + 64]",
            "tileloadd tmm7, [{w} + {r}*1 + 3072]",
            "tileloadd tmm2, [{w} + {r}*1 + 4096]",
            "tdpbsud tmm0, tmm4, tmm7",
            "tdpbssd tmm1, tmm4, tmm2",
            "tileloadd tmm3, [{a} + {s}*1 + 128]",
            "tileloadd tmm5, [{w} + {r}*1 + 6144]",
            "tileloadd tmm6, [{w} + {r}*1 + 7168]",
            "tdpbsud tmm0, tmm3, tmm5",
            "tdpbssd tmm1, tmm3, tmm6",
            "tileloadd tmm4, [{a} + {s}*1 + 192]",
            "tileloadd tmm7, [{w} + {r}*1 + 9216]",
            "tileloadd tmm2, [{w} + {r}*1 + 10240]",
            "tdpbsud tmm0, tmm4, tmm7",
            "tdpbssd tmm1, tmm4, tmm2",
        ),
        // Q2_K, the one type without high bytes, has minimums (`planes`).
        (false, _) => products!(
            "tilezero tmm0",
            "tilezero tmm2",
            "tileloadd tmm3, [{a} + {s}*1]",
            "tileloadd tmm5, [{w} + {r}*1]",
            "tileloadd tmm7, [{w} + {r}*1 + 2048]",
            "tdpbsud tmm0, tmm3, tmm5",
            "tdpbsud tmm2, tmm3, tmm7",
            "tileloadd tmm4, [{a} + {s}*1 + 64]",
            "tileloadd tmm6, [{w} + {r}*1 + 3072]",
            "tileloadd tmm1, [{w} + {r}*1 + 5120]",
            "tdpbsud tmm0, tmm4, tmm6",
            "tdpbsud tmm2, tmm4, tmm1",
            "tileloadd tmm3, [{a} + {s}*1 + 128]",
            "tileloadd tmm5, [{w} + {r}*1 + 6144]",
            "tileloadd tmm7, [{w} + {r}*1 + 8192]",
            "tdpbsud tmm0, tmm3, tmm5",
            "tdpbsud tmm2, tmm3, tmm7",
            "tileloadd tmm4, [{a} + {s}*1 + 192]",
            "tileloadd tmm6, [{w} + {r}*1 + 9216]",
            "tileloadd tmm1, [{w} + {r}*1 + 11264]",
            "tdpbsud tmm0, tmm4, tmm6",
            "tdpbsud tmm2, tmm4, tmm1",
        ),
    }
}

/// The C tiles [`multiply`] filled, stored at `products` (tile 0, then 1, then 2; 64 bytes per
/// row).
///
/// # Safety
/// Tiles configured as in [`rows`]; `products` holds three aligned tiles.
#[inline(always)]
unsafe fn store<const HIGH: bool, const MINS: bool>(products: *mut i32) {
    let r = amx::TILE_ROW_BYTES;
    // SAFETY: the caller's contract.
    asm!(
        "tilestored [{c} + {r}*1], tmm0",
        c = in(reg) products,
        r = in(reg) r,
        options(nostack),
    );
    if HIGH {
        // SAFETY: as above.
        asm!(
            "tilestored [{c} + {r}*1 + 1024], tmm1",
            c = in(reg) products,
            r = in(reg) r,
            options(nostack),
        );
    }
    if MINS {
        // SAFETY: as above.
        asm!(
            "tilestored [{c} + {r}*1 + 2048], tmm2",
            c = in(reg) products,
            r = in(reg) r,
            options(nostack),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml::GgmlType;
    use crate::kernels::quant::{ActivationScale, QuantizedRows};

    /// The tile kernel gives every output the lane kernel's bits, for each super-block type,
    /// a part-filled lane group (37 weight rows) and part-filled tiles of activation rows
    /// (53 rows from row 2: three whole tiles and one of 5).
    #[test]
    fn tile_products_have_the_bits_of_the_lane_kernel() {
        if !amx::available() {
            eprintln!("no AMX-INT8 on this CPU (or XDNA_NO_AMX set): nothing to compare");
            return;
        }
        let (n, cols, m) = (37, 768, 56);
        let mut state = 0x5eedu64;
        let x: Vec<f32> = (0..m * cols)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect();
        let mut act = QuantizedRows::default();
        act.quantize(&x, m, cols, ActivationScale::PerSuperblock);
        assert!(
            !act.code_lines.is_empty(),
            "the tile kernel reads the aligned codes"
        );
        for ty in [
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::IQ4_XS,
        ] {
            let kind = Kind::of(ty).expect("a super-block type");
            let row_bytes = cols / 256 * ty.block().1;
            let data: Vec<u8> = (0..n as u64)
                .flat_map(|r| crate::kernels::ggml_dot::tests::random_row(ty, cols, r * 31 + 7))
                .collect();
            let (mut tiles, mut lanes) = (vec![0f32; 53 * n], vec![0f32; 53 * n]);
            // SAFETY: AMX (and so AVX-512 VNNI) is available; `data` holds n rows of whole
            // blocks, `act` 56 superblock-scaled rows of `cols` codes, the outputs 53 × n.
            unsafe {
                let rows = WeightRows::new(&data, row_bytes, 0, n);
                super::rows(kind, rows, cols, &act, 2..55, &mut tiles, n);
                lanes::rows(kind, rows, cols, &act, 2..55, &mut lanes, n);
            }
            for (i, (a, b)) in tiles.iter().zip(&lanes).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{ty:?} output {i}: {a} vs {b}");
            }
            assert!(tiles.iter().any(|&v| v != 0.0), "{ty:?}: all zero");
        }
    }
}
