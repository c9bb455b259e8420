//! Super-block weight rows in the lanes of a register, for calls with many activation rows
//! (CPUs with AVX-512 VNNI).
//!
//! The row kernels of `k512` take one weight row at a time against up to 8 activation rows, two
//! multiplies per 64 values and activation row (`maddubs` and the `vpdpwssd` that applies the
//! sub-block scales) plus the block's lane sums. Here the call's weight rows (≤ 32) are decoded
//! once into unsigned codes and interleaved, 16 rows four codes at a time, so that one 512-bit
//! load holds the same four positions of 16 rows; an activation row's four codes are broadcast
//! and one `vpdpbusd` takes 64 multiply-adds for 16 weight rows. Per sub-block the 16 lanes are
//! multiplied by their rows' integer scales (`vpmulld`) into the block sum. The decode costs
//! about as much as 15 activation rows' multiply-adds, so [`MIN_ROWS`] activation rows take
//! this kernel and fewer the row kernels.
//!
//! Each lane's block sum is the exact integer `S = Σ_s sc_s·Σ_{i∈s} q_i·c_i` the row kernels
//! find, and for types with minimums `M = Σ_s m_s·Σ_{i∈s} c_i`; from there the lane takes the
//! same f32 steps as `k512::BlockSums::finish` (`acc = fma(d·d_act, S, acc)`, `acc_m =
//! fma(dmin·d_act, M, acc_m)`, the result `acc − acc_m`), so every output has the bits of the row
//! kernels whatever the call's row count.
//! Codes go in unsigned, `u = q + bias` (Q3_K bias 4, Q6_K 32, IQ4_XS 128; the others are
//! unsigned already), and `bias·Σ_s sc_s·Σ_{i∈s} c_i` is taken off the block sum. Both that
//! term and `M` are one `vpdpwssd` per 32 values: the lanes' two sub-block multipliers (or one
//! twice, for sub-blocks of 32) as i16 against the activation row's two code sums per 16
//! (`QuantizedRows::code_sums16`).

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::k512::{self, WeightRows};
use super::x86::{f16_at, iq4xs_scales, k4_scales_mins, q3k_scales16};
use crate::ggml::GgmlType;
use crate::kernels::quant::QuantizedRows;

/// Activation rows from which a call takes this kernel instead of the row kernels.
pub(super) const MIN_ROWS: usize = 16;

/// Weight rows per lane group: one i32 lane each.
const LANES: usize = 16;
/// Four-code positions (one `vpdpbusd` each) per 256-value block.
const POSITIONS: usize = 64;

/// The super-block types this kernel reads.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Kind {
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Iq4Xs,
}

impl Kind {
    /// The kernel for `ty`, if there is one.
    pub(super) fn of(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q2_K => Some(Self::Q2K),
            GgmlType::Q3_K => Some(Self::Q3K),
            GgmlType::Q4_K => Some(Self::Q4K),
            GgmlType::Q5_K => Some(Self::Q5K),
            GgmlType::Q6_K => Some(Self::Q6K),
            GgmlType::IQ4_XS => Some(Self::Iq4Xs),
            _ => None,
        }
    }

    pub(super) fn block_bytes(self) -> usize {
        match self {
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Iq4Xs => 136,
        }
    }

    /// Values per sub-block (one scale).
    pub(super) fn sub(self) -> usize {
        match self {
            Self::Q2K | Self::Q3K | Self::Q6K => 16,
            Self::Q4K | Self::Q5K | Self::Iq4Xs => 32,
        }
    }

    /// What is added to a code to make it unsigned, as a power of two: `1 << log2`.
    pub(super) fn bias_log2(self) -> Option<u32> {
        match self {
            Self::Q3K => Some(2),
            Self::Q6K => Some(5),
            Self::Iq4Xs => Some(7),
            Self::Q2K | Self::Q4K | Self::Q5K => None,
        }
    }
}

/// One decoded block's integers and scales.
pub(super) struct BlockInts {
    /// Per sub-block scale (`256 / sub` of them).
    pub(super) scales: [i32; 16],
    /// Per sub-block minimum, for types with minimums.
    pub(super) mins: [i32; 16],
    pub(super) d: f32,
    pub(super) dmin: f32,
}

/// Block `p` of `kind`: its 256 unsigned codes in value order into `codes` (64 per register),
/// its scales and minimums into the result.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C; `p` holds one block of `kind`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn decode(
    kind: Kind,
    p: *const u8,
    table: __m512i,
    codes: &mut [__m512i; 4],
) -> BlockInts {
    let mut ints = BlockInts {
        scales: [0; 16],
        mins: [0; 16],
        d: 0.0,
        dmin: 0.0,
    };
    match kind {
        Kind::Q4K | Kind::Q5K => {
            *codes = if kind == Kind::Q5K {
                k512::k45_codes::<true>(p)
            } else {
                k512::k45_codes::<false>(p)
            };
            let (sc, mn) = k4_scales_mins(p.add(4));
            for (s, &v) in sc.iter().enumerate() {
                ints.scales[s] = i32::from(v);
            }
            _mm256_storeu_si256(ints.mins.as_mut_ptr() as *mut __m256i, mn);
            (ints.d, ints.dmin) = (f16_at(p), f16_at(p.add(2)));
        }
        Kind::Q6K => {
            *codes = k512::q6k_codes(p);
            for s in 0..16 {
                ints.scales[s] = i32::from(*p.add(192 + s) as i8);
            }
            ints.d = f16_at(p.add(208));
        }
        Kind::Q3K => {
            *codes = k512::q3k_codes(p);
            let scales = _mm512_cvtepi16_epi32(q3k_scales16(p.add(96)));
            _mm512_storeu_si512(ints.scales.as_mut_ptr() as *mut _, scales);
            ints.d = f16_at(p.add(108));
        }
        Kind::Q2K => {
            *codes = k512::two_bit_codes(p.add(16));
            for s in 0..16 {
                let packed = *p.add(s);
                ints.scales[s] = i32::from(packed & 0x0F);
                ints.mins[s] = i32::from(packed >> 4);
            }
            (ints.d, ints.dmin) = (f16_at(p.add(80)), f16_at(p.add(82)));
        }
        Kind::Iq4Xs => {
            let flip = _mm512_set1_epi8(-128);
            *codes = k512::iq4xs_values(p, table).map(|w| _mm512_xor_si512(w, flip));
            for (s, &v) in iq4xs_scales(p).iter().enumerate() {
                ints.scales[s] = i32::from(v);
            }
            ints.d = f16_at(p);
        }
    }
    ints
}

/// ggml's IQ4 value table in every 128-bit lane, for [`decode`].
///
/// # Safety
/// AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn iq4_table() -> __m512i {
    _mm512_broadcast_i32x4(_mm_loadu_si128(
        crate::ggml::IQ4_TABLE.as_ptr() as *const __m128i
    ))
}

/// The 16 × 16 i32 matrix `rows` transposed in registers: output `j` holds element `j` of every
/// input, input `r` in lane `r` (two rounds of interleaves within 128-bit lanes, then two of
/// 128-bit lane shuffles).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose16(rows: &[__m512i; 16]) -> [__m512i; 16] {
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
    }
    // u[4q + e], 128-bit lane L: element 4L + e of rows 4q .. 4q + 4.
    let mut u = [_mm512_setzero_si512(); 16];
    for q in 0..4 {
        let (a, b, c, d) = (t[4 * q], t[4 * q + 1], t[4 * q + 2], t[4 * q + 3]);
        u[4 * q] = _mm512_unpacklo_epi64(a, c);
        u[4 * q + 1] = _mm512_unpackhi_epi64(a, c);
        u[4 * q + 2] = _mm512_unpacklo_epi64(b, d);
        u[4 * q + 3] = _mm512_unpackhi_epi64(b, d);
    }
    let mut out = [_mm512_setzero_si512(); 16];
    for e in 0..4 {
        let v0 = _mm512_shuffle_i32x4::<0x44>(u[e], u[4 + e]);
        let v1 = _mm512_shuffle_i32x4::<0xEE>(u[e], u[4 + e]);
        let v2 = _mm512_shuffle_i32x4::<0x44>(u[8 + e], u[12 + e]);
        let v3 = _mm512_shuffle_i32x4::<0xEE>(u[8 + e], u[12 + e]);
        out[e] = _mm512_shuffle_i32x4::<0x88>(v0, v2);
        out[4 + e] = _mm512_shuffle_i32x4::<0xDD>(v0, v2);
        out[8 + e] = _mm512_shuffle_i32x4::<0x88>(v1, v3);
        out[12 + e] = _mm512_shuffle_i32x4::<0xDD>(v1, v3);
    }
    out
}

/// The call's weight rows decoded, per lane group `g` (16 rows) and block `b` (`gb = g·nb + b`).
#[derive(Default)]
struct Scratch {
    /// `[gb][position][lane]` four codes each: register `gb·64 + k` holds codes `4k .. 4k + 4`
    /// of the block in every lane.
    codes: Vec<__m512i>,
    /// `[gb][sub-block][lane]` scales.
    scales: Vec<i32>,
    /// `[gb][t][lane]`, for values `32t .. 32t + 32`, the two multipliers of their code sums
    /// per 16 as i16: the minimums (types with minimums) or the scales (types with a bias) of
    /// sub-blocks `2t`, `2t + 1` (sub-blocks of 16) or of sub-block `t` twice (of 32).
    pairs: Vec<i32>,
    /// `[gb][lane]` block scales `d` and `dmin`.
    d: Vec<f32>,
    dmin: Vec<f32>,
    /// 16 rows of one block's codes, row-major, before the transpose.
    staging: Vec<__m512i>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Rows `rows` of a `kind` matrix against activation rows `act_rows` of `act` (one scale per
/// 256 values): `out[(i − act_rows.start)·stride + r]` for activation row `i` and weight row
/// `r`.
///
/// # Safety
/// AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; `rows` holds `cols / 256` blocks of `kind` per row,
/// `act` holds `cols` codes per row of `act_rows` with `ActivationScale::PerSuperblock` scales
/// (and so `code_sums16`), and `out` holds `(act_rows.len() − 1)·stride + rows.count` floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn rows(
    kind: Kind,
    rows: WeightRows,
    cols: usize,
    act: &QuantizedRows,
    act_rows: std::ops::Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    crate::kernels::with_scratch(&SCRATCH, |scratch| {
        decode_rows(kind, rows, cols, scratch);
        let nb = cols / 256;
        for g in 0..rows.count.div_ceil(LANES) {
            let lanes_here = (rows.count - g * LANES).min(LANES);
            for first in act_rows.clone().step_by(8) {
                let n = (act_rows.end - first).min(8);
                let tile = Tile {
                    scratch,
                    nb,
                    g,
                    lanes_here,
                    first,
                };
                // SAFETY: `out` holds rows `first − act_rows.start ..` + n of `stride` floats
                // from this group's first lane on, up to `rows.count` (the caller's contract).
                let out = out
                    .as_mut_ptr()
                    .add((first - act_rows.start) * stride + g * LANES);
                macro_rules! run {
                    ($sub:literal, $mins:literal, $bias:expr) => {
                        match n {
                            1 => tile.run::<1, $sub, $mins, $bias>(act, out, stride),
                            2 => tile.run::<2, $sub, $mins, $bias>(act, out, stride),
                            3 => tile.run::<3, $sub, $mins, $bias>(act, out, stride),
                            4 => tile.run::<4, $sub, $mins, $bias>(act, out, stride),
                            5 => tile.run::<5, $sub, $mins, $bias>(act, out, stride),
                            6 => tile.run::<6, $sub, $mins, $bias>(act, out, stride),
                            7 => tile.run::<7, $sub, $mins, $bias>(act, out, stride),
                            _ => tile.run::<8, $sub, $mins, $bias>(act, out, stride),
                        }
                    };
                }
                match kind {
                    Kind::Q2K => run!(16, true, 0),
                    Kind::Q3K => run!(16, false, 2),
                    Kind::Q6K => run!(16, false, 5),
                    Kind::Q4K | Kind::Q5K => run!(32, true, 0),
                    Kind::Iq4Xs => run!(32, false, 7),
                }
            }
        }
    });
}

/// Decode every block of `rows` into `s` (lanes past `rows.count` zero).
///
/// # Safety
/// As [`rows`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn decode_rows(kind: Kind, rows: WeightRows, cols: usize, s: &mut Scratch) {
    let nb = cols / 256;
    let groups = rows.count.div_ceil(LANES);
    let (sub, subs) = (kind.sub(), 256 / kind.sub());
    let zero = _mm512_setzero_si512();
    s.codes.clear();
    s.codes.resize(groups * nb * POSITIONS, zero);
    s.scales.clear();
    s.scales.resize(groups * nb * 16 * LANES, 0);
    s.pairs.clear();
    s.pairs.resize(groups * nb * 8 * LANES, 0);
    s.d.clear();
    s.d.resize(groups * nb * LANES, 0.0);
    s.dmin.clear();
    s.dmin.resize(groups * nb * LANES, 0.0);
    s.staging.clear();
    s.staging.resize(LANES * 4, zero);
    let table = iq4_table();
    for g in 0..groups {
        for b in 0..nb {
            let gb = g * nb + b;
            for lane in 0..LANES {
                let r = g * LANES + lane;
                let mut codes = [zero; 4];
                if r < rows.count {
                    let p = rows.row(r).add(b * kind.block_bytes());
                    let ints = decode(kind, p, table, &mut codes);
                    for j in 0..subs {
                        s.scales[(gb * 16 + j) * LANES + lane] = ints.scales[j];
                    }
                    let multipliers = if kind.bias_log2().is_some() {
                        &ints.scales
                    } else {
                        &ints.mins
                    };
                    for t in 0..8 {
                        // The sub-blocks of values 32t .. 32t + 16 and 32t + 16 .. 32t + 32.
                        let (lo, hi) =
                            (multipliers[32 * t / sub], multipliers[(32 * t + 16) / sub]);
                        s.pairs[(gb * 8 + t) * LANES + lane] = (lo & 0xFFFF) | (hi << 16);
                    }
                    s.d[gb * LANES + lane] = ints.d;
                    s.dmin[gb * LANES + lane] = ints.dmin;
                }
                s.staging[lane * 4..lane * 4 + 4].copy_from_slice(&codes);
            }
            // Register c of every row (codes 64c .. 64c + 64) transposed: position 16c + j.
            for c in 0..4 {
                let rows16: [__m512i; 16] = std::array::from_fn(|lane| s.staging[lane * 4 + c]);
                let at = gb * POSITIONS + 16 * c;
                s.codes[at..at + 16].copy_from_slice(&transpose16(&rows16));
            }
        }
    }
}

/// One lane group's part of a call for a chunk of activation rows.
struct Tile<'a> {
    scratch: &'a Scratch,
    nb: usize,
    /// The lane group.
    g: usize,
    /// Weight rows in the group (≤ 16).
    lanes_here: usize,
    /// The chunk's first activation row.
    first: usize,
}

impl Tile<'_> {
    /// Activation rows `first .. first + A` against the group's 16 weight rows, into
    /// `out[a·stride + lane]`. `SUB` values per sub-block; `MINS`: the type has minimums;
    /// `BIAS`: log2 of its codes' bias (0: none).
    ///
    /// # Safety
    /// As [`rows`]; `out` holds `A` rows of `stride` floats, the first `lanes_here` of each
    /// written.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn run<const A: usize, const SUB: usize, const MINS: bool, const BIAS: u32>(
        &self,
        act: &QuantizedRows,
        out: *mut f32,
        stride: usize,
    ) {
        let s = self.scratch;
        let subs = 256 / SUB;
        let groups = act.groups();
        let row_at = |a: usize| (self.first + a) * act.cols;
        let mut acc = [_mm512_setzero_ps(); A];
        let mut acc_mins = [_mm512_setzero_ps(); A];
        for b in 0..self.nb {
            let gb = self.g * self.nb + b;
            let weights = s.codes.as_ptr().add(gb * POSITIONS);
            let mut total = [_mm512_setzero_si512(); A];
            for sub in 0..subs {
                let mut sum = [_mm512_setzero_si512(); A];
                for k in sub * SUB / 4..(sub + 1) * SUB / 4 {
                    let w = _mm512_load_si512(weights.add(k) as *const _);
                    for (a, sum) in sum.iter_mut().enumerate() {
                        let at = act.codes.as_ptr().add(row_at(a) + b * 256 + 4 * k);
                        let four = (at as *const i32).read_unaligned();
                        *sum = _mm512_dpbusd_epi32(*sum, w, _mm512_set1_epi32(four));
                    }
                }
                let scales = s.scales.as_ptr().add((gb * 16 + sub) * LANES);
                let scales = _mm512_loadu_si512(scales as *const _);
                for (total, sum) in total.iter_mut().zip(sum) {
                    *total = _mm512_add_epi32(*total, _mm512_mullo_epi32(sum, scales));
                }
            }
            // Σ over 32-value runs of the lanes' two multipliers against the row's two code
            // sums per 16: the minimums' term, or the bias's.
            let paired = |a: usize| {
                let mut m = _mm512_setzero_si512();
                for t in 0..8 {
                    let sums = act
                        .code_sums16
                        .as_ptr()
                        .add(row_at(a) / 16 + b * 16 + 2 * t);
                    let two = (sums as *const i32).read_unaligned();
                    let pairs = s.pairs.as_ptr().add((gb * 8 + t) * LANES);
                    let pairs = _mm512_loadu_si512(pairs as *const _);
                    m = _mm512_dpwssd_epi32(m, pairs, _mm512_set1_epi32(two));
                }
                m
            };
            let d = _mm512_loadu_ps(s.d.as_ptr().add(gb * LANES));
            let dmin = _mm512_loadu_ps(s.dmin.as_ptr().add(gb * LANES));
            for (a, (acc, acc_mins)) in acc.iter_mut().zip(&mut acc_mins).enumerate() {
                let act_d = *act.scales.as_ptr().add((self.first + a) * groups + b * 8);
                let act_d = _mm512_set1_ps(act_d);
                let mut total = total[a];
                if BIAS != 0 {
                    total = _mm512_sub_epi32(total, _mm512_slli_epi32::<BIAS>(paired(a)));
                }
                let codes = _mm512_cvtepi32_ps(total);
                *acc = _mm512_fmadd_ps(_mm512_mul_ps(d, act_d), codes, *acc);
                if MINS {
                    let mins = _mm512_cvtepi32_ps(paired(a));
                    *acc_mins = _mm512_fmadd_ps(_mm512_mul_ps(dmin, act_d), mins, *acc_mins);
                }
            }
        }
        let mask = ((1u32 << self.lanes_here) - 1) as __mmask16;
        for (a, (acc, acc_mins)) in acc.iter().zip(acc_mins).enumerate() {
            let result = if MINS {
                _mm512_sub_ps(*acc, acc_mins)
            } else {
                *acc
            };
            _mm512_mask_storeu_ps(out.add(a * stride), mask, result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_moves_element_j_of_row_r_to_lane_r_of_output_j() {
        if !crate::kernels::avx2::vnni_available() {
            return;
        }
        let input: Vec<i32> = (0..256).collect();
        // SAFETY: AVX-512 F is available (checked above); `input` holds 16 × 16 i32.
        let rows: [__m512i; 16] = std::array::from_fn(|r| unsafe {
            _mm512_loadu_si512(input.as_ptr().add(16 * r) as *const _)
        });
        // SAFETY: as above.
        let out = unsafe { transpose16(&rows) };
        for (j, v) in out.iter().enumerate() {
            let mut lanes = [0i32; 16];
            // SAFETY: `lanes` holds 16 i32.
            unsafe { _mm512_storeu_si512(lanes.as_mut_ptr() as *mut _, *v) };
            for (r, &x) in lanes.iter().enumerate() {
                assert_eq!(x, (16 * r + j) as i32, "output {j} lane {r}");
            }
        }
    }
}
