//! Host GEMM over rows of ggml blocks (`WeightFormat::Ggml`), read from the GGUF file's own bytes.
//!
//! A weight row is first *unpacked* into one i8 code per value and one (scale, offset) pair per
//! sub-block of 16 or 32 values ([`crate::ggml::unpack`]'s integer form: `w = scale·q + offset`),
//! into a per-thread scratch row; then every activation row of the call takes its dot product
//! with that scratch: per 32-value group an exact integer sum `Σ q·c` against the q8 activation
//! codes `c` (`kernels::quant`, scale `d` per group), and
//! `Σ_s scale[s]·d·Σ_{i∈s} q_i c_i + offset[s]·d·Σ_{i∈s} c_i` in f32. So the type-specific work
//! (bit unpacking) is done once per weight row however many activation rows there are, and every
//! type shares one dot product. A row's result never depends on the other rows of the call:
//! batched rows are bit-identical to single rows.
//!
//! Two implementations of each step, chosen at run time: AVX2 (unpacking with shuffles and
//! shifts, the dot with ggml's sign trick `maddubs(|q|, sign(c, q))`) and the portable scalar
//! reference ([`unpack_row_reference`], [`dot_reference`]). The unpacked codes are the same bytes
//! either way; the dots differ only in float summation order.

// Unsafe is needed for the AVX2 intrinsics.
#![allow(unsafe_code)]

use std::cell::RefCell;

use crate::ggml::{self, BlockCodes, GgmlType};
use crate::tiles::GROUP;

/// One weight row in integer form: `values` codes, and per sub-block a scale and an offset.
#[derive(Default, Debug, Clone)]
pub struct UnpackedRow {
    /// Codes, one per value (the row's K of them).
    pub q: Vec<i8>,
    /// Multiplier of each sub-block (K / sub of them).
    pub scale: Vec<f32>,
    /// Addend of each sub-block; all zero for a symmetric type.
    pub offset: Vec<f32>,
    /// Values per sub-block: 16 or 32.
    pub sub: usize,
    /// Whether any offset can be non-zero (the type has minimums).
    pub affine: bool,
}

impl UnpackedRow {
    fn reset(&mut self, ty: GgmlType, cols: usize) {
        self.sub = ty.sub_block();
        self.affine = ty.has_offset();
        self.q.resize(cols, 0);
        self.scale.resize(cols / self.sub, 0.0);
        self.offset.resize(cols / self.sub, 0.0);
    }
}

/// The scalar reference unpack of one row (`cols` values of `ty`, `row.len()` its bytes).
pub fn unpack_row_reference(ty: GgmlType, row: &[u8], cols: usize, out: &mut UnpackedRow) {
    out.reset(ty, cols);
    let (values, bytes) = ty.block();
    let mut codes = BlockCodes::default();
    for (b, block) in row.chunks_exact(bytes).enumerate() {
        ggml::unpack(ty, block, &mut codes);
        let at = b * values;
        out.q[at..at + values].copy_from_slice(&codes.q[..values]);
        let subs = values / codes.sub;
        let s0 = at / codes.sub;
        out.scale[s0..s0 + subs].copy_from_slice(&codes.scale[..subs]);
        out.offset[s0..s0 + subs].copy_from_slice(&codes.offset[..subs]);
    }
}

/// The scalar reference dot of an unpacked row with one activation row: `codes` (K i8) and the
/// activation scale of each 32-value group.
pub fn dot_reference(w: &UnpackedRow, codes: &[i8], scales: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (g, &d) in scales.iter().enumerate() {
        let (q, c) = (
            &w.q[g * GROUP..(g + 1) * GROUP],
            &codes[g * GROUP..(g + 1) * GROUP],
        );
        for part in 0..GROUP / w.sub {
            let range = part * w.sub..(part + 1) * w.sub;
            let s = g * (GROUP / w.sub) + part;
            let isum: i32 = q[range.clone()]
                .iter()
                .zip(&c[range.clone()])
                .map(|(&a, &b)| a as i32 * b as i32)
                .sum();
            acc += w.scale[s] * d * isum as f32;
            if w.affine {
                let csum: i32 = c[range].iter().map(|&b| b as i32).sum();
                acc += w.offset[s] * d * csum as f32;
            }
        }
    }
    acc
}

/// Which implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The scalar references.
    Scalar,
    /// AVX2 + FMA + F16C (checked by the caller).
    Avx2,
    /// AVX2 unpacking, 512-bit AVX-512 VNNI dot products (`avx2::vnni_available`, checked by
    /// the caller), for every row count, so batched rows keep the bits of single rows.
    Avx512Vnni,
}

/// Unpack one row with `path`.
pub fn unpack_row(path: Path, ty: GgmlType, row: &[u8], cols: usize, out: &mut UnpackedRow) {
    #[cfg(target_arch = "x86_64")]
    if path != Path::Scalar {
        out.reset(ty, cols);
        // SAFETY: `Path::Avx2` is only chosen when AVX2 is available (`gemm`); `row` holds
        // exactly cols / values blocks (the matrix length is validated), `out` was sized above.
        if unsafe { x86::unpack_row(ty, row, out) } {
            return;
        }
    }
    unpack_row_reference(ty, row, cols, out);
}

/// Dot of an unpacked row with one activation row, with `path`.
pub fn dot(path: Path, w: &UnpackedRow, codes: &[i8], scales: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx512Vnni {
        let mut act = vnni::WideAct::default();
        // SAFETY: `Path::Avx512Vnni` is only chosen when AVX-512 VNNI is available; `codes` has
        // 32 per scale and `w` as many values.
        return unsafe {
            vnni::widen_act(codes, scales, &mut act);
            let mut out = [0f32];
            vnni::dots(std::slice::from_ref(w), &act, &mut out);
            out[0]
        };
    }
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx2 {
        // SAFETY: as in `unpack_row`; `codes` has 32 per scale, `w` as many values.
        return unsafe { x86::dot(w, codes, scales) };
    }
    dot_reference(w, codes, scales)
}

thread_local! {
    static SCRATCH: RefCell<UnpackedRow> = RefCell::new(UnpackedRow::default());
}

/// Output rows `n0 .. n0 + out_rows` of a `WeightMatrix::Ggml` matrix (`data`: its rows of
/// `row_bytes`), for activation rows `act_rows` of `act` (quantized, `cols` per row):
/// `out[slot * stride + r]` for the slot-th activation row and weight row `n0 + r`.
#[allow(clippy::too_many_arguments)] // one work item's context
pub fn block(
    path: Path,
    ty: GgmlType,
    data: &[u8],
    row_bytes: usize,
    cols: usize,
    n0: usize,
    out_rows: usize,
    act: &super::quant::QuantizedRows,
    act_rows: std::ops::Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    let groups = act.groups();
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx512Vnni {
        vnni::block(
            ty, data, row_bytes, cols, n0, out_rows, act, act_rows, out, stride,
        );
        return;
    }
    SCRATCH.with(|cell| {
        let mut fallback = UnpackedRow::default();
        let mut guard = cell.try_borrow_mut();
        let w: &mut UnpackedRow = match guard.as_deref_mut() {
            Ok(w) => w,
            Err(_) => &mut fallback,
        };
        for r in 0..out_rows {
            let row = &data[(n0 + r) * row_bytes..(n0 + r + 1) * row_bytes];
            unpack_row(path, ty, row, cols, w);
            for (slot, i) in act_rows.clone().enumerate() {
                let codes = &act.codes[i * act.cols..i * act.cols + cols];
                let scales = &act.scales[i * groups..i * groups + cols / GROUP];
                out[slot * stride + r] = dot(path, w, codes, scales);
            }
        }
    });
}

/// The 512-bit VNNI dot. Weight codes are offset to u8 (`q + 128`, a sign-bit flip as they are
/// loaded) for `vpdpbusd`, whose i32 lanes each sum 4 products; every activation row is prepared
/// once per call with, per lane, `−128 · Σ` of its 4 codes as the sum's starting value (which
/// cancels the offset exactly), its group's scale `d`, and `d · Σ` of its 4 codes (the offset
/// term). Each lane's weight scale (and offset) is permuted out of the row's compact sub-block
/// scales. Per 64 values and pair of rows: a flip, one `vpdpbusd`, a convert, a multiply, a permute
/// and one FMA (two of each with offsets), against eighteen AVX2 operations; four weight rows
/// share each activation load. A pair's result does not depend on which other rows are in the call.
#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{unpack_row, Path, UnpackedRow};
    use crate::ggml::GgmlType;
    use crate::kernels::quant::QuantizedRows;
    use crate::tiles::GROUP;
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    /// Values per 512-bit chunk (16 lanes of 4).
    const CHUNK: usize = 64;

    /// An activation row prepared for [`dots`]: codes (padded with zeros to whole chunks) and per
    /// lane the `vpdpbusd` start `−128·Σ`, the group scale `d` and `d·Σ`.
    #[derive(Default)]
    pub struct WideAct {
        codes: Vec<i8>,
        bias: Vec<i32>,
        d: Vec<f32>,
        d_sum: Vec<f32>,
        /// Values of the row (before padding).
        values: usize,
    }

    /// Lane `l` of a chunk reads scale `l * 4 / sub` of the chunk's sub-blocks.
    #[target_feature(enable = "avx512f")]
    unsafe fn lane_index(sub: usize) -> __m512i {
        if sub == 16 {
            _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
        } else {
            _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
        }
    }

    /// Prepare one activation row: `codes` (a multiple of 32) and one scale per 32.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI; `codes.len() == 32 · scales.len()`.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn widen_act(codes: &[i8], scales: &[f32], out: &mut WideAct) {
        let k = codes.len();
        let chunks = k.div_ceil(CHUNK);
        out.values = k;
        out.codes.clear();
        out.codes.extend_from_slice(codes);
        out.codes.resize(chunks * CHUNK, 0);
        out.bias.resize(chunks * 16, 0);
        out.d.resize(chunks * 16, 0.0);
        out.d_sum.resize(chunks * 16, 0.0);
        let ones = _mm512_set1_epi8(1);
        let idx = lane_index(GROUP);
        let groups = scales.len();
        for c in 0..chunks {
            let x = _mm512_loadu_si512(out.codes.as_ptr().add(c * CHUNK) as *const _);
            let sum4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, x);
            let n = (groups - 2 * c).min(2);
            let m: __mmask8 = ((1u16 << n) - 1) as __mmask8;
            let d = _mm512_permutexvar_ps(
                idx,
                _mm512_castps128_ps512(_mm_maskz_loadu_ps(m, scales.as_ptr().add(2 * c))),
            );
            _mm512_storeu_si512(
                out.bias.as_mut_ptr().add(c * 16) as *mut _,
                _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum4, 7)),
            );
            _mm512_storeu_ps(out.d.as_mut_ptr().add(c * 16), d);
            _mm512_storeu_ps(
                out.d_sum.as_mut_ptr().add(c * 16),
                _mm512_mul_ps(_mm512_cvtepi32_ps(sum4), d),
            );
        }
    }

    /// Chunk `c` of a prepared activation row: codes, `vpdpbusd` start, `d`, `d·Σ`.
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn act_chunk(act: &WideAct, c: usize) -> (__m512i, __m512i, __m512, __m512) {
        (
            _mm512_loadu_si512(act.codes.as_ptr().add(c * CHUNK) as *const _),
            _mm512_loadu_si512(act.bias.as_ptr().add(c * 16) as *const _),
            _mm512_loadu_ps(act.d.as_ptr().add(c * 16)),
            _mm512_loadu_ps(act.d_sum.as_ptr().add(c * 16)),
        )
    }

    /// Where chunk `c` of a row of `values` (sub-blocks of `sub`) reads: its byte mask, its
    /// first sub-block and the mask of its sub-blocks.
    #[inline]
    fn chunk_masks(c: usize, values: usize, sub: usize) -> (u64, usize, __mmask8) {
        let valid = (values - c * CHUNK).min(CHUNK);
        let bytes = if valid == CHUNK {
            u64::MAX
        } else {
            (1u64 << valid) - 1
        };
        let subs = valid / sub;
        (bytes, c * (CHUNK / sub), ((1u16 << subs) - 1) as __mmask8)
    }

    /// One chunk's contribution to a pair's accumulator.
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[allow(clippy::too_many_arguments)] // one chunk's operands, kept in registers
    unsafe fn step(
        w: &UnpackedRow,
        c: usize,
        (bytes, first, subs): (u64, usize, __mmask8),
        idx: __m512i,
        (x, bias, d, d_sum): (__m512i, __m512i, __m512, __m512),
        acc: __m512,
    ) -> __m512 {
        // Masked-off bytes load as 0 and flip to 128, against activation codes of 0.
        let q = _mm512_xor_si512(
            _mm512_maskz_loadu_epi8(bytes, w.q.as_ptr().add(c * CHUNK)),
            _mm512_set1_epi8(-128),
        );
        let isum = _mm512_dpbusd_epi32(bias, q, x);
        let scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), d);
        let lane = |v: *const f32| {
            _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(subs, v)))
        };
        let acc = _mm512_fmadd_ps(lane(w.scale.as_ptr().add(first)), scaled, acc);
        if w.affine {
            _mm512_fmadd_ps(lane(w.offset.as_ptr().add(first)), d_sum, acc)
        } else {
            acc
        }
    }

    /// `out[j]` = the dot of `rows[j]` with `act` (all of its length and one sub-block size),
    /// four rows at a time.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI; `out.len() == rows.len()`; every row holds `act.values` values.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn dots(rows: &[UnpackedRow], act: &WideAct, out: &mut [f32]) {
        let Some(sub) = rows.first().map(|r| r.sub) else {
            return;
        };
        let chunks = act.codes.len() / CHUNK;
        let idx = lane_index(sub);
        let mut four = rows.chunks_exact(4);
        let mut at = 0;
        for quad in four.by_ref() {
            let mut acc = [_mm512_setzero_ps(); 4];
            for c in 0..chunks {
                let masks = chunk_masks(c, act.values, sub);
                let a = act_chunk(act, c);
                for (acc, w) in acc.iter_mut().zip(quad) {
                    *acc = step(w, c, masks, idx, a, *acc);
                }
            }
            for (o, a) in out[at..at + 4].iter_mut().zip(acc) {
                *o = _mm512_reduce_add_ps(a);
            }
            at += 4;
        }
        for w in four.remainder() {
            let mut acc = _mm512_setzero_ps();
            for c in 0..chunks {
                let masks = chunk_masks(c, act.values, sub);
                acc = step(w, c, masks, idx, act_chunk(act, c), acc);
            }
            out[at] = _mm512_reduce_add_ps(acc);
            at += 1;
        }
    }

    thread_local! {
        static SCRATCH: RefCell<(Vec<UnpackedRow>, WideAct, Vec<f32>)> =
            RefCell::new(Default::default());
    }

    /// [`super::block`] on this path: the block's weight rows are unpacked once, then each
    /// activation row is prepared and dotted with all of them.
    #[allow(clippy::too_many_arguments)] // one work item's context
    pub fn block(
        ty: GgmlType,
        data: &[u8],
        row_bytes: usize,
        cols: usize,
        n0: usize,
        out_rows: usize,
        act: &QuantizedRows,
        act_rows: std::ops::Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        let groups = act.groups();
        SCRATCH.with(|cell| {
            let mut fallback = Default::default();
            let mut guard = cell.try_borrow_mut();
            let (unpacked, prepared, results) = match guard.as_deref_mut() {
                Ok(s) => s,
                Err(_) => &mut fallback,
            };
            unpacked.resize_with(out_rows.max(unpacked.len()), UnpackedRow::default);
            for (r, w) in unpacked[..out_rows].iter_mut().enumerate() {
                let row = &data[(n0 + r) * row_bytes..(n0 + r + 1) * row_bytes];
                unpack_row(Path::Avx512Vnni, ty, row, cols, w);
            }
            results.resize(out_rows, 0.0);
            for (slot, i) in act_rows.enumerate() {
                let codes = &act.codes[i * act.cols..i * act.cols + cols];
                let scales = &act.scales[i * groups..i * groups + cols / GROUP];
                // SAFETY: this path is chosen only when AVX-512 VNNI is available (`gemm`);
                // `codes` has 32 per scale, and every row was unpacked from `cols` values.
                unsafe {
                    widen_act(codes, scales, prepared);
                    dots(&unpacked[..out_rows], prepared, results);
                }
                out[slot * stride..slot * stride + out_rows].copy_from_slice(results);
            }
        });
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::UnpackedRow;
    use crate::ggml::{self, GgmlType};
    use crate::tiles::GROUP;
    use std::arch::x86_64::*;

    /// Horizontal sum of 8 f32 lanes.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// The dot of [`super::dot_reference`]: per group, `maddubs(|q|, sign(c, q))` (|q|, |c| ≤ 127,
    /// so pair sums stay inside i16) widened to eight i32 lanes — lanes 0-3 hold the group's first
    /// 16 values, 4-7 the second 16, which is what a sub-block of 16 needs.
    ///
    /// # Safety
    /// AVX2 and FMA; `codes.len() ≥ 32 · scales.len()` and `w` holds as many values.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(w: &UnpackedRow, codes: &[i8], scales: &[f32]) -> f32 {
        match (w.sub == 16, w.affine) {
            (false, false) => dot_kind::<false, false>(w, codes, scales),
            (false, true) => dot_kind::<false, true>(w, codes, scales),
            (true, false) => dot_kind::<true, false>(w, codes, scales),
            (true, true) => dot_kind::<true, true>(w, codes, scales),
        }
    }

    /// [`dot`] for one sub-block size and affinity (the branches out of the group loop).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_kind<const SUB16: bool, const AFFINE: bool>(
        w: &UnpackedRow,
        codes: &[i8],
        scales: &[f32],
    ) -> f32 {
        let ones = _mm256_set1_epi16(1);
        let ones8 = _mm256_set1_epi8(1);
        let mut acc = _mm256_setzero_ps();
        let mut acc_min = _mm256_setzero_ps();
        let (q, c) = (w.q.as_ptr(), codes.as_ptr());
        let (ws, wo) = (w.scale.as_ptr(), w.offset.as_ptr());
        let pair = |p: *const f32, g: usize| {
            if SUB16 {
                _mm256_set_m128(_mm_set1_ps(*p.add(2 * g + 1)), _mm_set1_ps(*p.add(2 * g)))
            } else {
                _mm256_set1_ps(*p.add(g))
            }
        };
        for (g, &d) in scales.iter().enumerate() {
            let qv = _mm256_loadu_si256(q.add(g * GROUP) as *const __m256i);
            let cv = _mm256_loadu_si256(c.add(g * GROUP) as *const __m256i);
            let prod = _mm256_maddubs_epi16(_mm256_sign_epi8(qv, qv), _mm256_sign_epi8(cv, qv));
            let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
            let d = _mm256_set1_ps(d);
            acc = _mm256_fmadd_ps(_mm256_mul_ps(pair(ws, g), d), isum, acc);
            if AFFINE {
                let csum =
                    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ones8, cv), ones));
                acc_min = _mm256_fmadd_ps(_mm256_mul_ps(pair(wo, g), d), csum, acc_min);
            }
        }
        hsum(_mm256_add_ps(acc, acc_min))
    }

    /// 32 low nibbles then 32 high nibbles of 16 bytes at `p`, as `[lo0..lo15, hi0..hi15]`.
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles16(p: *const u8) -> __m256i {
        let b = _mm_loadu_si128(p as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(b, m);
        let hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        _mm256_set_m128i(hi, lo)
    }

    /// 32 low nibbles and 32 high nibbles of 32 bytes at `p`.
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles32(p: *const u8) -> (__m256i, __m256i) {
        let b = _mm256_loadu_si256(p as *const __m256i);
        let m = _mm256_set1_epi8(0x0F);
        (
            _mm256_and_si256(b, m),
            _mm256_and_si256(_mm256_srli_epi16(b, 4), m),
        )
    }

    /// Bit `j` of the 32-bit `bits` as 0x10 in byte j (Q5_0/Q5_1's fifth bits).
    #[target_feature(enable = "avx2")]
    unsafe fn bits_to_0x10(bits: u32) -> __m256i {
        // Byte j gets byte j/8 of `bits`, then tests bit j%8.
        let v = _mm256_set1_epi32(bits as i32);
        let spread = _mm256_shuffle_epi8(
            v,
            _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            ),
        );
        let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    /// The f16 at `p`, converted inline with F16C (the `half` crate's conversion is an
    /// out-of-line call that picks its path at run time: a tenth of a decode step).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn f16_at(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// Unpack a row with the AVX2 code for its type; `false` leaves it to the reference.
    ///
    /// # Safety
    /// AVX2; `row` holds whole blocks of `ty` and `out` was reset for its value count.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn unpack_row(ty: GgmlType, row: &[u8], out: &mut UnpackedRow) -> bool {
        let (values, bytes) = ty.block();
        let blocks = row.len() / bytes;
        let q = out.q.as_mut_ptr();
        let store = |at: usize, v: __m256i| {
            _mm256_storeu_si256(q.add(at) as *mut __m256i, v);
        };
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                for b in 0..blocks {
                    let p = row.as_ptr().add(b * bytes);
                    out.scale[b] = f16_at(p);
                    let v = match ty {
                        GgmlType::Q4_0 => {
                            out.offset[b] = 0.0;
                            _mm256_sub_epi8(nibbles16(p.add(2)), _mm256_set1_epi8(8))
                        }
                        GgmlType::Q4_1 => {
                            out.offset[b] = f16_at(p.add(2));
                            nibbles16(p.add(4))
                        }
                        GgmlType::Q5_0 => {
                            out.offset[b] = 0.0;
                            let qh =
                                u32::from_le_bytes([*p.add(2), *p.add(3), *p.add(4), *p.add(5)]);
                            let v = _mm256_or_si256(nibbles16(p.add(6)), bits_to_0x10(qh));
                            _mm256_sub_epi8(v, _mm256_set1_epi8(16))
                        }
                        GgmlType::Q5_1 => {
                            out.offset[b] = f16_at(p.add(2));
                            let qh =
                                u32::from_le_bytes([*p.add(4), *p.add(5), *p.add(6), *p.add(7)]);
                            _mm256_or_si256(nibbles16(p.add(8)), bits_to_0x10(qh))
                        }
                        _ => {
                            out.offset[b] = 0.0;
                            _mm256_loadu_si256(p.add(2) as *const __m256i)
                        }
                    };
                    store(b * values, v);
                }
                true
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                for b in 0..blocks {
                    let p = row.as_ptr().add(b * bytes);
                    let (d, dmin) = (f16_at(p), f16_at(p.add(2)));
                    let scales = std::slice::from_raw_parts(p.add(4), 12);
                    for s in 0..8 {
                        let (sc, m) = ggml::scale_min_k4(s, scales);
                        out.scale[b * 8 + s] = d * sc as f32;
                        out.offset[b * 8 + s] = -(dmin * m as f32);
                    }
                    let (qh, qs) = if ty == GgmlType::Q5_K {
                        (
                            Some(_mm256_loadu_si256(p.add(16) as *const __m256i)),
                            p.add(48),
                        )
                    } else {
                        (None, p.add(16))
                    };
                    for c in 0..4 {
                        let (mut lo, mut hi) = nibbles32(qs.add(c * 32));
                        if let Some(qh) = qh {
                            // Fifth bit of sub-block 2c: bit 2c of qh[l]; of 2c+1: bit 2c+1.
                            let bit_lo = _mm256_set1_epi8(1 << (2 * c));
                            let bit_hi = _mm256_set1_epi8((2u8 << (2 * c)) as i8);
                            let sixteen = _mm256_set1_epi8(16);
                            let has_lo = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_lo), bit_lo);
                            let has_hi = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_hi), bit_hi);
                            lo = _mm256_or_si256(lo, _mm256_and_si256(has_lo, sixteen));
                            hi = _mm256_or_si256(hi, _mm256_and_si256(has_hi, sixteen));
                        }
                        store(b * 256 + c * 64, lo);
                        store(b * 256 + c * 64 + 32, hi);
                    }
                }
                true
            }
            GgmlType::Q6_K => {
                let m4 = _mm256_set1_epi8(0x0F);
                let m3 = _mm256_set1_epi8(3);
                let thirty_two = _mm256_set1_epi8(32);
                for b in 0..blocks {
                    let p = row.as_ptr().add(b * bytes);
                    let d = f16_at(p.add(208));
                    for s in 0..16 {
                        out.scale[b * 16 + s] = d * (*p.add(192 + s) as i8) as f32;
                        out.offset[b * 16 + s] = 0.0;
                    }
                    for h in 0..2 {
                        let ql0 = _mm256_loadu_si256(p.add(h * 64) as *const __m256i);
                        let ql1 = _mm256_loadu_si256(p.add(h * 64 + 32) as *const __m256i);
                        let qh = _mm256_loadu_si256(p.add(128 + h * 32) as *const __m256i);
                        let lows = [
                            _mm256_and_si256(ql0, m4),
                            _mm256_and_si256(ql1, m4),
                            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        ];
                        let highs = [
                            _mm256_and_si256(qh, m3),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m3),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 4), m3),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 6), m3),
                        ];
                        for k in 0..4 {
                            let v = _mm256_or_si256(lows[k], _mm256_slli_epi16(highs[k], 4));
                            store(b * 256 + h * 128 + k * 32, _mm256_sub_epi8(v, thirty_two));
                        }
                    }
                }
                true
            }
            GgmlType::Q2_K => {
                let m3 = _mm256_set1_epi8(3);
                for b in 0..blocks {
                    let p = row.as_ptr().add(b * bytes);
                    let (d, dmin) = (f16_at(p.add(80)), f16_at(p.add(82)));
                    for s in 0..16 {
                        let sc = *p.add(s);
                        out.scale[b * 16 + s] = d * (sc & 0x0F) as f32;
                        out.offset[b * 16 + s] = -(dmin * (sc >> 4) as f32);
                    }
                    for n in 0..2 {
                        let qs = _mm256_loadu_si256(p.add(16 + n * 32) as *const __m256i);
                        for j in 0..4 {
                            let v = _mm256_and_si256(
                                _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * j as i32)),
                                m3,
                            );
                            store(b * 256 + n * 128 + j * 32, v);
                        }
                    }
                }
                true
            }
            GgmlType::Q3_K => {
                let m3 = _mm256_set1_epi8(3);
                let four = _mm256_set1_epi8(4);
                for b in 0..blocks {
                    let p = row.as_ptr().add(b * bytes);
                    let d = f16_at(p.add(108));
                    let sc = ggml::q3k_scales(std::slice::from_raw_parts(p.add(96), 12));
                    for (s, &v) in sc.iter().enumerate() {
                        out.scale[b * 16 + s] = d * v as f32;
                        out.offset[b * 16 + s] = 0.0;
                    }
                    let hmask = _mm256_loadu_si256(p as *const __m256i);
                    for n in 0..2 {
                        let qs = _mm256_loadu_si256(p.add(32 + n * 32) as *const __m256i);
                        for j in 0..4 {
                            let low = _mm256_and_si256(
                                _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * j as i32)),
                                m3,
                            );
                            let bit = _mm256_set1_epi8((1u8 << (n * 4 + j)) as i8);
                            let clear = _mm256_cmpeq_epi8(
                                _mm256_and_si256(hmask, bit),
                                _mm256_setzero_si256(),
                            );
                            let v = _mm256_sub_epi8(low, _mm256_and_si256(clear, four));
                            store(b * 256 + n * 128 + j * 32, v);
                        }
                    }
                }
                true
            }
            GgmlType::IQ4_NL | GgmlType::IQ4_XS => {
                let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                    ggml::IQ4_TABLE.as_ptr() as *const __m128i
                ));
                for b in 0..blocks {
                    let p = row.as_ptr().add(b * bytes);
                    let d = f16_at(p);
                    if ty == GgmlType::IQ4_NL {
                        out.scale[b] = d;
                        out.offset[b] = 0.0;
                        store(b * 32, _mm256_shuffle_epi8(table, nibbles16(p.add(2))));
                        continue;
                    }
                    let scales_h = u16::from_le_bytes([*p.add(2), *p.add(3)]);
                    for s in 0..8 {
                        let low = (*p.add(4 + s / 2) >> (4 * (s % 2))) & 0x0F;
                        let high = ((scales_h >> (2 * s)) & 3) as u8;
                        out.scale[b * 8 + s] = d * ((low | (high << 4)) as i32 - 32) as f32;
                        out.offset[b * 8 + s] = 0.0;
                        let v = _mm256_shuffle_epi8(table, nibbles16(p.add(8 + s * 16)));
                        store(b * 256 + s * 32, v);
                    }
                }
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_row(ty: GgmlType, cols: usize, seed: u64) -> Vec<u8> {
        let (values, bytes) = ty.block();
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        };
        let mut row: Vec<u8> = (0..cols / values * bytes).map(|_| next()).collect();
        // Finite f16 scales: force the exponent bits of every f16 field into a modest range.
        let halves: &[usize] = match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => &[0],
            GgmlType::IQ4_XS => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            GgmlType::Q6_K => &[208],
            _ => &[],
        };
        for block in row.chunks_exact_mut(bytes) {
            for &at in halves {
                block[at + 1] = 0x30 | (block[at + 1] & 0x07);
            }
        }
        row
    }

    #[test]
    fn avx2_unpack_gives_the_reference_codes_and_scales() {
        #[cfg(target_arch = "x86_64")]
        if super::super::avx2::available() {
            for ty in GgmlType::BLOCK_QUANTS {
                let cols = 512;
                for seed in 0..8 {
                    let row = random_row(ty, cols, seed);
                    let (mut a, mut b) = (UnpackedRow::default(), UnpackedRow::default());
                    unpack_row_reference(ty, &row, cols, &mut a);
                    unpack_row(Path::Avx2, ty, &row, cols, &mut b);
                    assert_eq!(a.q, b.q, "{ty:?} codes");
                    assert_eq!(a.scale, b.scale, "{ty:?} scales");
                    assert_eq!(a.offset, b.offset, "{ty:?} offsets");
                }
            }
        }
    }

    #[test]
    fn avx2_dot_matches_the_reference_and_the_dequantized_row() {
        let cols = 768;
        for ty in GgmlType::BLOCK_QUANTS {
            let row = random_row(ty, cols, 3);
            let mut w = UnpackedRow::default();
            unpack_row_reference(ty, &row, cols, &mut w);
            let mut values = vec![0f32; cols];
            ggml::dequantize(ty, &row, &mut values).unwrap();
            // Activation codes are within ±127 (`quant`).
            let codes: Vec<i8> = (0..cols)
                .map(|i| (((i * 37 + 11) % 255) as i32 - 127) as i8)
                .collect();
            let scales: Vec<f32> = (0..cols / GROUP).map(|g| 0.01 + g as f32 * 1e-3).collect();
            let exact: f64 = (0..cols)
                .map(|i| values[i] as f64 * codes[i] as f64 * scales[i / GROUP] as f64)
                .sum();
            let magnitude: f64 = (0..cols)
                .map(|i| (values[i] as f64 * codes[i] as f64 * scales[i / GROUP] as f64).abs())
                .sum();
            let mut paths = vec![Path::Scalar];
            #[cfg(target_arch = "x86_64")]
            {
                if super::super::avx2::available() {
                    paths.push(Path::Avx2);
                }
                if super::super::avx2::vnni_available() {
                    paths.push(Path::Avx512Vnni);
                }
            }
            for path in paths {
                let got = dot(path, &w, &codes, &scales) as f64;
                assert!(
                    (got - exact).abs() <= 1e-5 * magnitude,
                    "{ty:?} {path:?}: {got} vs exact {exact}"
                );
            }
        }
    }
}
