//! IQ4_NL, Q5_0 and Q5_1 rows interleaved eight at a time (`host_layout`,
//! `Packing::InterleavedRows`), as AVX-512 VNNI ([`small_rows`]) and AVX2 ([`avx2_rows`])
//! kernels. In the VNNI kernel each 64-bit lane of a register holds
//! eight code bytes of one weight row, so one `vpdpbusd` against eight activation codes broadcast
//! to every lane adds four products into each of two i32 lanes per weight row, and no horizontal
//! sum is needed until a row's end.
//!
//! A block column of 8 weight rows is 128 bytes of nibbles in two 512-bit registers; a lane's
//! low nibbles are eight consecutive values of its row, its high nibbles the eight 16 places
//! later. IQ4_NL's table lookup (`vpshufb`) or Q5's fifth bits (a masked add of 16, the mask
//! read straight from the layout) make them unsigned codes `u = w + bias`. Each lane starts at
//! `−bias·Σc / 2` of the block, so a row's two lanes sum to `Σ w·c` exactly. Per block: the
//! lanes converted to f32 and one FMA with `d·d_act` (each row's `d` in its two lanes) into one
//! of two accumulators, even and odd blocks (the block-to-block chain is one FMA every other
//! block); a row's result is its pair of lanes summed at the end.
//!
//! Every activation row runs the same operations whatever the other rows of the call, so batched
//! rows keep single rows' bits.

use crate::ggml::IQ4_TABLE;
use crate::kernels::host_layout::{
    InterleavedColumn, INTERLEAVED_ROWS, IQ4_NL_COLUMN, Q5_0_COLUMN, Q5_1_COLUMN,
};
use crate::kernels::quant::QuantizedRows;
use std::arch::x86_64::*;

/// Which 32-value block type [`small_rows`] reads: IQ4_NL.
pub const IQ4_NL: u8 = 0;
/// Q5_0 for [`small_rows`].
pub const Q5_0: u8 = 1;
/// Q5_1 for [`small_rows`].
pub const Q5_1: u8 = 2;

/// The layout of an 8-row block column of `KIND` (`host_layout`'s, the one the rows were
/// packed in).
const fn column(kind: u8) -> InterleavedColumn {
    match kind {
        IQ4_NL => IQ4_NL_COLUMN,
        Q5_0 => Q5_0_COLUMN,
        _ => Q5_1_COLUMN,
    }
}

/// Output rows `n0 .. n0 + out_rows` of an interleaved IQ4_NL, Q5_0 or Q5_1 matrix `data`
/// (`KIND`; `cols` values per row; `n0` a multiple of 8) for activation rows `first .. first +
/// N` (quantized per 32 values): `out[slot · stride + r]` for weight row `n0 + r`. The codes go
/// into `vpdpbusd` unsigned (`u = w + bias`: IQ4_NL's table value + 128, Q5_0's 5-bit code, bias
/// 16; Q5_1's code, bias 0), each lane starting at `−bias·Σc / 2` of the block; Q5_1 adds its
/// minimums' term `m·d_act·Σc` (the activations' `sums`) in a second FMA on one lane per row.
///
/// # Safety
/// AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; `data` holds the 8-row groups of rows `n0 .. n0 +
/// out_rows` (`cols / 32` block columns each); `act` holds rows `first .. first + N` of `cols`
/// codes with scales, sums and code sums per 32 values; `out` holds `(N - 1) · stride +
/// out_rows` floats.
#[allow(clippy::too_many_arguments)] // one work item's context, as `ggml_dot::block`
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn small_rows<const N: usize, const KIND: u8>(
    data: &[u8],
    cols: usize,
    n0: usize,
    out_rows: usize,
    act: &QuantizedRows,
    first: usize,
    out: &mut [f32],
    stride: usize,
) {
    let at = const { column(KIND) };
    let blocks = cols / 32;
    let groups = act.groups();
    let table = _mm512_xor_si512(
        _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4_TABLE.as_ptr() as *const __m128i)),
        _mm512_set1_epi8(-128),
    );
    let (low_nibbles, sixteen) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(16));
    // −bias·Σc over a row's two lanes: −(bias / 2)·Σc in each.
    let half_bias = match KIND {
        IQ4_NL => 64,
        Q5_0 => 8,
        _ => 0,
    };
    // Row r's scale into lanes 2r and 2r + 1.
    let pair_lanes = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    let even = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    let odd = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 13, 11, 9, 7, 5, 3, 1);
    let rows8 = |p: *const u8| {
        _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)))
    };
    for g in 0..out_rows.div_ceil(INTERLEAVED_ROWS) {
        let group = data
            .as_ptr()
            .add((n0 / INTERLEAVED_ROWS + g) * blocks * at.bytes);
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        for b in 0..blocks {
            let p = group.add(b * at.bytes);
            crate::kernels::avx2::prefetch_ahead(p, at.bytes);
            let (w0, w1) = (
                _mm512_loadu_si512(p.add(at.nibbles) as *const _),
                _mm512_loadu_si512(p.add(at.nibbles + 64) as *const _),
            );
            // Values 0-7, 8-15, 16-23 and 24-31 of each row.
            let mut codes = [
                _mm512_and_si512(w0, low_nibbles),
                _mm512_and_si512(w1, low_nibbles),
                _mm512_and_si512(_mm512_srli_epi16::<4>(w0), low_nibbles),
                _mm512_and_si512(_mm512_srli_epi16::<4>(w1), low_nibbles),
            ];
            for (e, u) in codes.iter_mut().enumerate() {
                if KIND == IQ4_NL {
                    *u = _mm512_shuffle_epi8(table, *u);
                } else {
                    // Bit 8r + k: the fifth bit of value 8e + k of row r.
                    let fifth = (p.add(at.fifth + 8 * e) as *const u64).read_unaligned();
                    *u = _mm512_mask_add_epi8(*u, fifth, *u, sixteen);
                }
            }
            let d = _mm512_permutexvar_ps(pair_lanes, rows8(p));
            // Q5_1: each row's m in its first lane only.
            let m = if KIND == Q5_1 {
                _mm512_maskz_permutexvar_ps(0x5555, pair_lanes, rows8(p.add(at.m)))
            } else {
                _mm512_setzero_ps()
            };
            for (slot, acc) in acc.iter_mut().enumerate() {
                let i = first + slot;
                let x = act.codes.as_ptr().add(i * act.cols + 32 * b) as *const i64;
                let at = i * groups + b;
                let start = -half_bias * *act.code_sums.get_unchecked(at);
                let mut isum = _mm512_set1_epi32(start);
                for (e, codes) in codes.iter().enumerate() {
                    let xs = _mm512_set1_epi64(x.add(e).read_unaligned());
                    isum = _mm512_dpbusd_epi32(isum, *codes, xs);
                }
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(*act.scales.get_unchecked(at)));
                let a = &mut acc[b & 1];
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *a);
                if KIND == Q5_1 {
                    *a = _mm512_fmadd_ps(m, _mm512_set1_ps(*act.sums.get_unchecked(at)), *a);
                }
            }
        }
        let r0 = g * INTERLEAVED_ROWS;
        let live = ((1u32 << (out_rows - r0).min(INTERLEAVED_ROWS)) - 1) as __mmask8;
        for (slot, acc) in acc.iter().enumerate() {
            let lanes = _mm512_add_ps(acc[0], acc[1]);
            let rows = _mm512_add_ps(
                _mm512_permutexvar_ps(even, lanes),
                _mm512_permutexvar_ps(odd, lanes),
            );
            let dst = out.as_mut_ptr().add(slot * stride + r0);
            _mm256_mask_storeu_ps(dst, live, _mm512_castps512_ps256(rows));
        }
    }
}

/// [`small_rows`] on AVX2: each 64-bit lane of a 256-bit register holds eight code bytes of one
/// weight row, so a block column of 8 rows is two registers per eight values (rows 0-3, rows
/// 4-7), each taken against the eight activation codes broadcast to every lane. Q5_0 and Q5_1
/// take their unsigned 5-bit codes `u` in `maddubs(u, c)` (pairs ≤ 2·31·127) and sum the
/// block's four runs of eight values in i16 (≤ 4·7874) before one `madd` widens them; each row's
/// two i32 lanes start at `−(bias / 2)·Σc` (Q5_0's bias 16, Q5_1's 0) as in [`small_rows`].
/// IQ4_NL's table values plus 128 (bias 128) reach 241, too wide for such sums, so each is looked
/// up twice as its two nibbles `16·h + l` (`avx2::IQ4_SPLIT`): two planes of codes ≤ 15 whose
/// `maddubs` sums stay within i16 over the block, widened once each (weights 16 and 1), where
/// ggml's sign trick took two `vpsignb` and a `madd` more per run. Per block: the lanes
/// converted to f32 and one FMA with `d·d_act` (each row's `d` in its two lanes); Q5_1 adds
/// `m·d_act·Σc` (the activations' `sums`) in a second FMA on one lane per row. A row's result is
/// its pair of lanes summed at the end, and every activation row runs the same operations
/// whatever the other rows of the call: batched rows keep single rows' bits.
///
/// # Safety
/// AVX2, FMA and F16C; otherwise as [`small_rows`].
#[allow(clippy::too_many_arguments)] // one work item's context, as `ggml_dot::block`
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn avx2_rows<const N: usize, const KIND: u8>(
    data: &[u8],
    cols: usize,
    n0: usize,
    out_rows: usize,
    act: &QuantizedRows,
    first: usize,
    out: &mut [f32],
    stride: usize,
) {
    let at = const { column(KIND) };
    let blocks = cols / 32;
    let groups = act.groups();
    let low_nibbles = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    // −bias·Σc over a row's two lanes: −(bias / 2)·Σc in each.
    let half_bias = match KIND {
        IQ4_NL => 64,
        Q5_0 => 8,
        _ => 0,
    };
    let (high_table, low_table) = crate::kernels::avx2::iq4_split_tables();
    let sixteens = _mm256_set1_epi16(16);
    // Rows 0-3 (and 4-7) of eight per-row floats, each into its two lanes.
    let pair_lanes = [
        _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3),
        _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7),
    ];
    // Byte j of a half's fifth-bit word: byte j / 8 of it, then bit j % 8.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let sixteen = _mm256_set1_epi8(16);
    let rows8 = |p: *const u8| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
    for g in 0..out_rows.div_ceil(INTERLEAVED_ROWS) {
        let group = data
            .as_ptr()
            .add((n0 / INTERLEAVED_ROWS + g) * blocks * at.bytes);
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..blocks {
            let p = group.add(b * at.bytes);
            crate::kernels::avx2::prefetch_ahead(p, at.bytes);
            if KIND == IQ4_NL {
                let d8 = rows8(p);
                for (h, half) in [0usize, 32].into_iter().enumerate() {
                    // Values 8e .. 8e + 8 of rows 4h .. 4h + 4 as table indices, as below.
                    let w0 = _mm256_loadu_si256(p.add(at.nibbles + half) as *const __m256i);
                    let w1 = _mm256_loadu_si256(p.add(at.nibbles + 64 + half) as *const __m256i);
                    let index = [
                        _mm256_and_si256(w0, low_nibbles),
                        _mm256_and_si256(w1, low_nibbles),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(w0), low_nibbles),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(w1), low_nibbles),
                    ];
                    let mut high = [_mm256_setzero_si256(); 4];
                    let mut low = [_mm256_setzero_si256(); 4];
                    for e in 0..4 {
                        high[e] = _mm256_shuffle_epi8(high_table, index[e]);
                        low[e] = _mm256_shuffle_epi8(low_table, index[e]);
                    }
                    let d = _mm256_permutevar8x32_ps(d8, pair_lanes[h]);
                    for (slot, acc) in acc.iter_mut().enumerate() {
                        let i = first + slot;
                        let x = act.codes.as_ptr().add(i * act.cols + 32 * b) as *const i64;
                        let at = i * groups + b;
                        let mut high_sum = _mm256_setzero_si256();
                        let mut low_sum = _mm256_setzero_si256();
                        for e in 0..4 {
                            let xs = _mm256_set1_epi64x(x.add(e).read_unaligned());
                            high_sum =
                                _mm256_add_epi16(high_sum, _mm256_maddubs_epi16(high[e], xs));
                            low_sum = _mm256_add_epi16(low_sum, _mm256_maddubs_epi16(low[e], xs));
                        }
                        let start =
                            _mm256_set1_epi32(-half_bias * *act.code_sums.get_unchecked(at));
                        let isum = _mm256_add_epi32(
                            start,
                            _mm256_add_epi32(
                                _mm256_madd_epi16(high_sum, sixteens),
                                _mm256_madd_epi16(low_sum, ones),
                            ),
                        );
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(*act.scales.get_unchecked(at)));
                        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[h]);
                    }
                }
                continue;
            }
            // codes[e][h]: values 8e .. 8e + 8 of rows 4h .. 4h + 4 (w0: bytes 0-63, w1: 64-127;
            // low nibbles values 0-7 / 8-15, high nibbles 16-23 / 24-31).
            let mut codes = [[_mm256_setzero_si256(); 2]; 4];
            for (h, half) in [0usize, 32].into_iter().enumerate() {
                let w0 = _mm256_loadu_si256(p.add(at.nibbles + half) as *const __m256i);
                let w1 = _mm256_loadu_si256(p.add(at.nibbles + 64 + half) as *const __m256i);
                codes[0][h] = _mm256_and_si256(w0, low_nibbles);
                codes[1][h] = _mm256_and_si256(w1, low_nibbles);
                codes[2][h] = _mm256_and_si256(_mm256_srli_epi16::<4>(w0), low_nibbles);
                codes[3][h] = _mm256_and_si256(_mm256_srli_epi16::<4>(w1), low_nibbles);
            }
            for (e, run) in codes.iter_mut().enumerate() {
                for (h, u) in run.iter_mut().enumerate() {
                    // Bit 8r + k of the run's word: the fifth bit of value 8e + k of row r.
                    let word = (p.add(at.fifth + 8 * e + 4 * h) as *const u32).read_unaligned();
                    let bits = _mm256_shuffle_epi8(_mm256_set1_epi32(word as i32), spread);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bits, select), select);
                    *u = _mm256_or_si256(*u, _mm256_and_si256(set, sixteen));
                }
            }
            let d8 = rows8(p);
            let d = pair_lanes.map(|lanes| _mm256_permutevar8x32_ps(d8, lanes));
            // Q5_1: each row's m in its first lane only.
            let m = if KIND == Q5_1 {
                let m8 = rows8(p.add(at.m));
                pair_lanes.map(|lanes| {
                    _mm256_blend_ps::<0b1010_1010>(
                        _mm256_permutevar8x32_ps(m8, lanes),
                        _mm256_setzero_ps(),
                    )
                })
            } else {
                [_mm256_setzero_ps(); 2]
            };
            for (slot, acc) in acc.iter_mut().enumerate() {
                let i = first + slot;
                let x = act.codes.as_ptr().add(i * act.cols + 32 * b) as *const i64;
                let xs: [__m256i; 4] =
                    std::array::from_fn(|e| _mm256_set1_epi64x(x.add(e).read_unaligned()));
                let at = i * groups + b;
                let start = _mm256_set1_epi32(-half_bias * *act.code_sums.get_unchecked(at));
                let act_d = _mm256_set1_ps(*act.scales.get_unchecked(at));
                for (h, acc) in acc.iter_mut().enumerate() {
                    let mut pairs = _mm256_maddubs_epi16(codes[0][h], xs[0]);
                    for e in 1..4 {
                        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(codes[e][h], xs[e]));
                    }
                    let isum = _mm256_add_epi32(start, _mm256_madd_epi16(pairs, ones));
                    let scale = _mm256_mul_ps(d[h], act_d);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, *acc);
                    if KIND == Q5_1 {
                        *acc = _mm256_fmadd_ps(
                            m[h],
                            _mm256_set1_ps(*act.sums.get_unchecked(at)),
                            *acc,
                        );
                    }
                }
            }
        }
        let r0 = g * INTERLEAVED_ROWS;
        let live = (out_rows - r0).min(INTERLEAVED_ROWS);
        for (slot, acc) in acc.iter().enumerate() {
            // Lanes (2j, 2j + 1) of each half summed: rows 0, 1, 4, 5 | 2, 3, 6, 7, then in order.
            let sums = _mm256_hadd_ps(acc[0], acc[1]);
            let rows = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(
                sums,
            )));
            let mut all = [0f32; INTERLEAVED_ROWS];
            _mm256_storeu_ps(all.as_mut_ptr(), rows);
            out[slot * stride + r0..slot * stride + r0 + live].copy_from_slice(&all[..live]);
        }
    }
}
