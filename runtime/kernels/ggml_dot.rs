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
//!
//! The vector paths skip the scratch row for every type whose activations they can take whole:
//! - The super-block types (Q2_K … Q6_K, IQ4_XS) against activations with one scale per 256
//!   values (ggml's `q8_K`, `quant::ActivationScale::PerSuperblock`): per 32-value group
//!   `maddubs(u, c)` on codes split straight from the block's bytes (unsigned; Q3_K's offset
//!   by 4, Q6_K's centre of 32 and Q2_K's minimums taken off per block through the activations'
//!   code sums per 16; IQ4_XS's signed table values through ggml's sign trick), weighted by the
//!   sub-block scales in the `madd` that widens the pair sums, so a block sums in integers and
//!   takes the shared scales in one float multiply-add (`x86::k_block`). CPUs with AVX-512 VNNI
//!   take 512-bit kernels for them (`k512`, two groups per register), from 16 activation rows
//!   with weight rows across the lanes of a register, one `vpdpbusd` per four values of 16 rows
//!   (`lanes`), and on CPUs with AMX-INT8 as tile products (`amx_rows`), with the same exact
//!   block sums and so the same bits.
//! - The 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) against activations per 32
//!   values: each block's codes split once for up to eight activation rows, one `maddubs`, a
//!   widening `madd` and one FMA with `d·d_act` per group and row (`x86::block32`). IQ4_NL,
//!   Q5_0 and Q5_1 rows are interleaved eight at a time at load on every vector path
//!   (`kernels::host_layout`) and run `interleaved`'s kernels instead: four values of eight
//!   weight rows per instruction against broadcast activations, no horizontal sums
//!   ([`interleaved_block`]); on AVX-512 VNNI CPUs the file's layout (a matrix built by hand) is
//!   unpacked to i8 and dotted by `vnni`.
//!
//! What each gave against unpack-then-dot is measured in docs/performance.md ("GGUF block
//! types").

// Unsafe is needed for the AVX2 intrinsics.
#![allow(unsafe_code)]

use std::cell::RefCell;

use super::quant::ActivationScale;
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
    /// the caller), for every row count, so batched rows keep the bits of single rows; Q4_K,
    /// Q5_K and Q6_K take the AVX2 path's fused kernels.
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

/// Calls `$kernel::<N>(args)` once per chunk of up to 8 activation rows of `$act_rows` (`N`
/// the chunk's row count, a const generic: the kernels keep `N` accumulators in registers), with
/// `$first` bound to the chunk's first row and `$out` to the output from that row on.
#[cfg(target_arch = "x86_64")]
macro_rules! by_act_chunks {
    ($act_rows:expr, $out:expr, $stride:expr, |$first:ident, $chunk_out:ident|
        $($kernel:ident)::+ ($($arg:expr),* $(,)?)) => {
        by_act_chunks!($act_rows, $out, $stride, |$first, $chunk_out|
            $($kernel)::+ [] ($($arg),*))
    };
    // `[G, …]`: const arguments the kernel takes after the row count.
    ($act_rows:expr, $out:expr, $stride:expr, |$first:ident, $chunk_out:ident|
        $($kernel:ident)::+ [$($generic:tt)*] ($($arg:expr),* $(,)?)) => {{
        for $first in $act_rows.clone().step_by(8) {
            let $chunk_out = &mut $out[($first - $act_rows.start) * $stride..];
            match ($act_rows.end - $first).min(8) {
                1 => $($kernel)::+::<1, $($generic)*>($($arg),*),
                2 => $($kernel)::+::<2, $($generic)*>($($arg),*),
                3 => $($kernel)::+::<3, $($generic)*>($($arg),*),
                4 => $($kernel)::+::<4, $($generic)*>($($arg),*),
                5 => $($kernel)::+::<5, $($generic)*>($($arg),*),
                6 => $($kernel)::+::<6, $($generic)*>($($arg),*),
                7 => $($kernel)::+::<7, $($generic)*>($($arg),*),
                _ => $($kernel)::+::<8, $($generic)*>($($arg),*),
            }
        }
    }};
}

thread_local! {
    static SCRATCH: RefCell<UnpackedRow> = RefCell::new(UnpackedRow::default());
    /// GGUF rows taken back out of an interleaved matrix for the paths that read rows.
    static GGUF_ROWS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// As [`block`], for a matrix of `ty` in the host executor's interleaved rows
/// (`host_layout::Packing::InterleavedRows`; `n0` a multiple of 8). AVX-512 VNNI runs
/// `interleaved`'s kernel on it; the other paths take the rows back in their GGUF layout
/// (`host_layout::deinterleave_rows`) and run as over the file's bytes.
#[allow(clippy::too_many_arguments)] // one work item's context
pub fn interleaved_block(
    path: Path,
    ty: GgmlType,
    data: &[u8],
    cols: usize,
    n0: usize,
    out_rows: usize,
    act: &super::quant::QuantizedRows,
    act_rows: std::ops::Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    let format = crate::tiles::WeightFormat::Ggml(ty);
    #[cfg(target_arch = "x86_64")]
    if path != Path::Scalar
        && act.scale == ActivationScale::PerGroup
        && n0.is_multiple_of(super::host_layout::INTERLEAVED_ROWS)
    {
        // Each arm's kernel needs what holds here: `Path::Avx2` is only chosen when AVX2, FMA
        // and F16C are available (`gemm`), `Path::Avx512Vnni` when AVX-512 F/BW/VL/VNNI are
        // too (`avx2::vnni_available`); `data` is the whole interleaved matrix of `ty` (its
        // length validated against rows and cols), so it holds the groups of rows n0 .. n0 +
        // out_rows; `act` holds `cols` codes per group-scaled row of `act_rows`, `out` `stride`
        // per row.
        macro_rules! interleaved {
            ($kernel:ident, $kind:ident) => {
                // SAFETY: as above.
                unsafe {
                    by_act_chunks!(act_rows, out, stride, |first, out| interleaved::$kernel
                        [{ interleaved::$kind }](
                        data, cols, n0, out_rows, act, first, out, stride
                    ))
                }
            };
            ($kind:ident) => {
                if path == Path::Avx512Vnni {
                    interleaved!(small_rows, $kind)
                } else {
                    interleaved!(avx2_rows, $kind)
                }
            };
        }
        match ty {
            GgmlType::IQ4_NL => return interleaved!(IQ4_NL),
            GgmlType::Q5_0 => return interleaved!(Q5_0),
            GgmlType::Q5_1 => return interleaved!(Q5_1),
            _ => {}
        }
    }
    block_over_rows_taken_back(
        path,
        ty,
        cols,
        out_rows,
        act,
        act_rows,
        out,
        stride,
        |rows| super::host_layout::deinterleave_rows(format, data, cols, n0..n0 + out_rows, rows),
    );
}

/// [`block`] over `out_rows` weight rows that `take_back` writes in their GGUF layout into
/// scratch: how the paths that read GGUF rows run a matrix the host executor re-laid
/// (interleaved rows, K tiles).
#[allow(clippy::too_many_arguments)] // one work item's context
pub fn block_over_rows_taken_back(
    path: Path,
    ty: GgmlType,
    cols: usize,
    out_rows: usize,
    act: &super::quant::QuantizedRows,
    act_rows: std::ops::Range<usize>,
    out: &mut [f32],
    stride: usize,
    take_back: impl FnOnce(&mut [u8]),
) {
    // Whole blocks per row: the matrix's length was validated against its shape.
    let (values, bytes) = ty.block();
    let row_bytes = cols / values * bytes;
    crate::kernels::with_scratch(&GGUF_ROWS, |rows| {
        rows.resize(out_rows * row_bytes, 0);
        take_back(rows);
        block(
            path, ty, rows, row_bytes, cols, 0, out_rows, act, act_rows, out, stride,
        );
    });
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
    if let (Path::Avx512Vnni, ActivationScale::PerSuperblock, Some(kind)) =
        (path, act.scale, lanes::Kind::of(ty))
    {
        if act_rows.len() >= lanes::MIN_ROWS {
            // SAFETY: `Path::Avx512Vnni` is only chosen when AVX2, FMA, F16C and AVX-512
            // F/BW/VL/VNNI are available (`avx2::vnni_available`); `data` holds rows n0 .. n0 +
            // out_rows of `row_bytes` (cols / 256 whole blocks: validated with the matrix), `act`
            // holds `cols` codes per superblock-scaled row of `act_rows`, `out` `stride` per row.
            // The tile kernel also needs AMX (checked here) and the aligned codes.
            unsafe {
                let rows = k512::WeightRows::new(data, row_bytes, n0, out_rows);
                if !act.code_lines.is_empty() && crate::kernels::amx::available() {
                    amx_rows::rows(kind, rows, cols, act, act_rows, out, stride);
                } else {
                    lanes::rows(kind, rows, cols, act, act_rows, out, stride);
                }
            }
            return;
        }
    }
    // The fused super-block kernels (the K-quants and IQ4_XS) need AVX2 only; on VNNI CPUs the
    // 512-bit ones also beat unpack + vpdpbusd (module docs), so both vector paths take them.
    // They sum each 256-value block in integers, which needs the block's activations to share
    // one scale.
    #[cfg(target_arch = "x86_64")]
    if path != Path::Scalar && act.scale == ActivationScale::PerSuperblock {
        if let Some(kind) = x86::KQuant::of(ty) {
            let wide = path == Path::Avx512Vnni;
            // SAFETY: both vector paths are only chosen when AVX2, FMA and F16C are available
            // (`gemm`; `avx2::vnni_available` implies `avx2::available`), and `wide` only when
            // AVX-512 F/BW/VL/VNNI are too (`Path::Avx512Vnni` follows `vnni_available`);
            // `data` holds rows n0 .. n0 + out_rows of `row_bytes` (cols / 256 whole blocks: the
            // matrix length and width are validated), `act` holds `cols` codes for every row of
            // `act_rows`, and `out` holds `stride` floats per activation row.
            unsafe {
                x86::k_block(
                    kind, wide, data, row_bytes, cols, n0, out_rows, act, act_rows, out, stride,
                )
            };
            return;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let (Path::Avx2, ActivationScale::PerGroup, Some(kind)) =
        (path, act.scale, x86::Block32::of(ty))
    {
        // SAFETY: `Path::Avx2` is only chosen when AVX2, FMA and F16C are available (`gemm`);
        // `data` holds rows n0 .. n0 + out_rows of `row_bytes` (cols / 32 whole blocks: the
        // matrix length and width are validated), `act` holds `cols` codes, scales and sums for
        // every group-scaled row of `act_rows`, and `out` holds `stride` floats per activation
        // row.
        unsafe {
            x86::block32(
                kind, data, row_bytes, cols, n0, out_rows, act, act_rows, out, stride,
            )
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx512Vnni {
        vnni::block(
            ty, data, row_bytes, cols, n0, out_rows, act, act_rows, out, stride,
        );
        return;
    }
    crate::kernels::with_scratch(&SCRATCH, |w| {
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
        crate::kernels::with_scratch(&SCRATCH, |(unpacked, prepared, results)| {
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

/// The fused K-quant kernels of [`x86::k_block`] on 512-bit registers, for CPUs with AVX-512
/// VNNI. Each 512-bit vector holds two 32-value groups.
///
/// Q4_K and Q5_K: a block of 256 values is four `maddubs` + `vpdpwssd` pairs per activation row
/// (the `madd` that weights the pair sums by the sub-block scale and the add into the block sum
/// become one `vpdpwssd`) where the AVX2 kernels take eight `maddubs` + `madd` + `add`.
///
/// Q6_K: its centred codes `u − 32` are signed, which cost the AVX2 kernel a second `maddubs`
/// per group. Here each 64 values take one `vpdpbusd` with the activations as the unsigned
/// operand (`c + 128`), whose four-product lane sums (|s| ≤ 4·32·127 < 2¹⁵) two groups at a time
/// are packed to i16 and weighted by their sub-block scales in one `vpdpwssd`: four `vpdpbusd`,
/// two packs and two `vpdpwssd` per block and activation row, against sixteen `maddubs` and
/// eight `madd`.
///
/// Every kernel here, and the lane kernels of [`lanes`] that take calls of
/// [`lanes::MIN_ROWS`] activation rows or more, finds each block's exact integer sums and takes
/// them into floats in one place, [`BlockSums::finish`]: one f32 product and one fused
/// multiply-add per block and term. So an output has the same bits whichever kernel ran it and
/// whatever the other rows of the call are. The AVX2 kernels sum the same integers but take them
/// into floats per lane, so the two paths agree to float rounding (docs/performance.md has the
/// speeds).
#[cfg(target_arch = "x86_64")]
mod lanes;
#[cfg(target_arch = "x86_64")]
pub(crate) use lanes::transpose16;

#[cfg(target_arch = "x86_64")]
mod amx_rows;

#[cfg(target_arch = "x86_64")]
mod interleaved;

#[cfg(target_arch = "x86_64")]
mod k512 {
    use super::x86::{f16_at, iq4xs_scales, k4_scales_mins, q3k_scales16};
    use crate::kernels::quant::QuantizedRows;
    use std::arch::x86_64::*;

    /// The 16 i32 lanes of a block sum folded to the 8 of the AVX2 kernels (lane `j` + `8 + j`).
    #[inline]
    #[target_feature(enable = "avx2,avx512f")]
    unsafe fn fold(v: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
    }

    pub(super) use super::x86::WeightRows;

    /// A `vpshufb` control that puts i16 scale `2c` (of the eight in each 128-bit lane) in every
    /// i16 lane of the low half and scale `2c + 1` in the high half: bytes (4c, 4c + 1) and
    /// (4c + 2, 4c + 3).
    #[inline]
    #[target_feature(enable = "avx2,avx512f")]
    unsafe fn scale_pick(c: i32) -> __m512i {
        let (lo, hi) = (
            0x0100 * (4 * c + 1) + 4 * c,
            0x0100 * (4 * c + 3) + 4 * c + 2,
        );
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi16(lo as i16)),
            _mm256_set1_epi16(hi as i16),
        )
    }

    /// The 256-bit `v` in both halves of a 512-bit vector.
    #[inline]
    #[target_feature(enable = "avx2,avx512f")]
    unsafe fn both_halves(v: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), v)
    }

    /// One Q4_K (`FIVE = false`) or Q5_K row against activation rows `first .. first + N`, as
    /// `x86::k45_rows`. Pair `c` is groups `2c` (low nibbles of `qs[32c..]`, low half) and
    /// `2c + 1` (high nibbles, high half): one shift by 0 | 4 of the run loaded into both halves.
    ///
    /// Every weight row of `rows` in one call, so the constants are set up once: `out[slot ·
    /// stride + r]` for activation row `first + slot` and weight row `r`.
    ///
    /// # Safety
    /// AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; `rows` holds `cols / 256` blocks per row; `act`
    /// holds rows `first .. first + N` of `cols` codes and per-superblock scales; `out` holds
    /// `(N - 1) · stride + rows.count` floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn k45_rows<const N: usize, const FIVE: bool>(
        rows: WeightRows,
        cols: usize,
        act: &QuantizedRows,
        first: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let block_bytes = if FIVE { 176 } else { 144 };
        let groups = act.groups();
        let picks = [scale_pick(0), scale_pick(1), scale_pick(2), scale_pick(3)];
        for r in 0..rows.count {
            let row = rows.row(r);
            let mut acc = [[0f32; 2]; N];
            for b in 0..cols / 256 {
                let p = row.add(b * block_bytes);
                crate::kernels::avx2::prefetch_ahead(p, block_bytes);
                let (d, dmin) = (f16_at(p), f16_at(p.add(2)));
                let (sc, mn) = k4_scales_mins(p.add(4));
                let sc8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(u64::from_le_bytes(sc) as i64));
                let sc_all = _mm512_broadcast_i32x4(sc8);
                let q = k45_codes::<FIVE>(p);
                let sc16 = picks.map(|pick| _mm512_shuffle_epi8(sc_all, pick));
                let mut sums = BlockSums::<N>::default();
                for slot in 0..N {
                    let i = first + slot;
                    let codes = act.codes.as_ptr().add(i * act.cols + b * 256);
                    let mut isum = _mm512_setzero_si512();
                    for c in 0..4 {
                        let x = _mm512_loadu_si512(codes.add(c * 64) as *const _);
                        isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q[c], x), sc16[c]);
                    }
                    let at = i * groups + b * 8;
                    let group_sums = _mm256_loadu_si256(act.code_sums.as_ptr().add(at) as *const _);
                    sums.codes[slot] = fold(isum);
                    sums.mins[slot] = _mm256_mullo_epi32(mn, group_sums);
                    sums.act_d[slot] = *act.scales.as_ptr().add(at);
                }
                sums.finish::<true>(d, dmin, &mut acc);
            }
            for (slot, acc) in acc.iter().enumerate() {
                out[slot * stride + r] = BlockSums::<N>::output::<true>(*acc);
            }
        }
    }

    /// One super-block's sums for `N` activation rows, before they take the block's scales: per
    /// row, i32 lanes summing to the block's exact `S = Σ_s sc_s·Σ_{i∈s} q_i·c_i` (`codes`) and,
    /// for types with minimums, `M = Σ_s m_s·Σ_{i∈s} c_i` (`mins`), and the row's activation
    /// scale. [`BlockSums::finish`] is the one place where a block becomes floats, the same
    /// steps for every kernel of these types whatever their lane layout ([`super::lanes`] too),
    /// so every kernel gives the same bits.
    pub(super) struct BlockSums<const N: usize> {
        pub codes: [__m256i; N],
        pub mins: [__m256i; N],
        pub act_d: [f32; N],
    }

    impl<const N: usize> Default for BlockSums<N> {
        fn default() -> Self {
            // SAFETY: zeroing a register value needs no CPU feature beyond SSE2 (x86_64).
            let zero = unsafe { _mm256_setzero_si256() };
            Self {
                codes: [zero; N],
                mins: [zero; N],
                act_d: [0.0; N],
            }
        }
    }

    impl<const N: usize> BlockSums<N> {
        /// `acc[slot][0] = fma(d·d_act, S, acc[slot][0])` and, with `MINS`, `acc[slot][1] =
        /// fma(dmin·d_act, M, acc[slot][1])`: each an f32 product and one fused multiply-add (one
        /// rounding), `S` and `M` converted from their exact i32 totals. Two accumulators, so
        /// the block-to-block chain of a row is one multiply-add long; [`BlockSums::output`]
        /// gives the row's result.
        ///
        /// # Safety
        /// AVX2 and FMA.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        pub(super) unsafe fn finish<const MINS: bool>(
            &self,
            d: f32,
            dmin: f32,
            acc: &mut [[f32; 2]; N],
        ) {
            if N == 1 {
                // One row (decode): the totals stay in a register, through the same steps.
                let halves = |x: __m256i| {
                    _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256::<1>(x))
                };
                let (codes, mins) = if MINS {
                    // [S, M, S, M] after two pairwise rounds and the halves' sum.
                    let x = halves(_mm256_hadd_epi32(self.codes[0], self.mins[0]));
                    let totals = _mm_cvtepi32_ps(_mm_hadd_epi32(x, x));
                    (totals, _mm_movehdup_ps(totals))
                } else {
                    let x = halves(self.codes[0]);
                    let x = _mm_hadd_epi32(x, x);
                    (_mm_cvtepi32_ps(_mm_hadd_epi32(x, x)), _mm_setzero_ps())
                };
                let act_d = self.act_d[0];
                let sum = _mm_fmadd_ss(_mm_set_ss(d * act_d), codes, _mm_set_ss(acc[0][0]));
                acc[0][0] = _mm_cvtss_f32(sum);
                if MINS {
                    let m = _mm_fmadd_ss(_mm_set_ss(dmin * act_d), mins, _mm_set_ss(acc[0][1]));
                    acc[0][1] = _mm_cvtss_f32(m);
                }
                return;
            }
            let zero = _mm256_setzero_si256();
            let (mut codes, mut mins) = ([0i32; 8], [0i32; 8]);
            if MINS && 2 * N <= 8 {
                // Both sums of every row in one reduction.
                let mut rows = [zero; 8];
                rows[..N].copy_from_slice(&self.codes);
                rows[N..2 * N].copy_from_slice(&self.mins);
                let totals = lane_totals(&rows, 2 * N);
                codes[..N].copy_from_slice(&totals[..N]);
                mins[..N].copy_from_slice(&totals[N..2 * N]);
            } else {
                let mut rows = [zero; 8];
                rows[..N].copy_from_slice(&self.codes);
                codes = lane_totals(&rows, N);
                if MINS {
                    rows[..N].copy_from_slice(&self.mins);
                    mins = lane_totals(&rows, N);
                }
            }
            for (slot, acc) in acc.iter_mut().enumerate() {
                let act_d = self.act_d[slot];
                acc[0] = fused(d * act_d, codes[slot] as f32, acc[0]);
                if MINS {
                    acc[1] = fused(dmin * act_d, mins[slot] as f32, acc[1]);
                }
            }
        }

        /// A row's result from its two accumulators: `acc[0] − acc[1]` with `MINS`.
        #[inline]
        pub(super) fn output<const MINS: bool>(acc: [f32; 2]) -> f32 {
            if MINS {
                acc[0] - acc[1]
            } else {
                acc[0]
            }
        }
    }

    /// `a·b + c` with one rounding (`vfmadd` on one lane).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fused(a: f32, b: f32, c: f32) -> f32 {
        _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
    }

    /// Element `j < n` (`n ≤ 8`) is the wrapping sum of the eight i32 lanes of `v[j]`, by a
    /// `hadd` tree as deep as `n` needs (`v[n..]` are not read).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn lane_totals(v: &[__m256i; 8], n: usize) -> [i32; 8] {
        let mut out = [0i32; 8];
        let halves =
            |x: __m256i| _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256::<1>(x));
        if n == 1 {
            let x = halves(v[0]);
            let x = _mm_add_epi32(x, _mm_shuffle_epi32::<0b01_00_11_10>(x));
            let x = _mm_add_epi32(x, _mm_shuffle_epi32::<0b10_11_00_01>(x));
            out[0] = _mm_cvtsi128_si32(x);
        } else if n == 2 {
            // [Σ0,1 Σ2,3 of v0, of v1] per half, the halves added, then one more pairwise sum.
            let x = halves(_mm256_hadd_epi32(v[0], v[1]));
            let x = _mm_hadd_epi32(x, x);
            _mm_storel_epi64(out.as_mut_ptr() as *mut __m128i, x);
        } else if n <= 4 {
            let x = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            _mm_storeu_si128(out.as_mut_ptr() as *mut __m128i, halves(x));
        } else {
            // Per 128-bit half: Σ0..3 (low) and Σ4..7 (high) of rows 0-3 in u0, 4-7 in u1.
            let u0 =
                _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let u1 =
                _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
            let low = _mm256_permute2x128_si256::<0x20>(u0, u1);
            let high = _mm256_permute2x128_si256::<0x31>(u0, u1);
            _mm256_storeu_si256(
                out.as_mut_ptr() as *mut __m256i,
                _mm256_add_epi32(low, high),
            );
        }
        out
    }

    /// A block's 256 codes in value order, 64 per register: the unsigned codes `u` of Q4_K
    /// (`FIVE = false`) or Q5_K at `p`. Register `c` is the low nibbles of `qs[32c..32c + 32]`
    /// (low half) then their high nibbles, Q5_K's fifth bits (bit `2c` | `2c + 1` of `qh`)
    /// added as 16.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn k45_codes<const FIVE: bool>(p: *const u8) -> [__m512i; 4] {
        let nibble_shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
        let qs = p.add(if FIVE { 48 } else { 16 });
        let qh = both_halves(_mm256_loadu_si256(p.add(16) as *const __m256i));
        let mut q = [_mm512_setzero_si512(); 4];
        for (c, q) in q.iter_mut().enumerate() {
            let run = both_halves(_mm256_loadu_si256(qs.add(c * 32) as *const __m256i));
            *q = _mm512_and_si512(_mm512_srlv_epi16(run, nibble_shift), _mm512_set1_epi8(0x0F));
            if FIVE {
                let fifth = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_set1_epi8((1u8 << (2 * c)) as i8)),
                    _mm256_set1_epi8((2u8 << (2 * c)) as i8),
                );
                let set = _mm512_test_epi8_mask(qh, fifth);
                *q = _mm512_mask_add_epi8(*q, set, *q, _mm512_set1_epi8(16));
            }
        }
        q
    }

    /// Q6_K's unsigned codes `u` (0..=63, centre 32) at `p` in value order, as [`k45_codes`]: in
    /// half `h` of the block, register `2h` takes the low nibbles of the 64 `ql` bytes and bits
    /// 0-1 | 2-3 of `qh`, register `2h + 1` the high nibbles and bits 4-5 | 6-7.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn q6k_codes(p: *const u8) -> [__m512i; 4] {
        let shifts = |lo: i16, hi: i16| {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set1_epi16(lo)),
                _mm256_set1_epi16(hi),
            )
        };
        let high_shifts = [shifts(0, 2), shifts(4, 6)];
        let (m4, m3) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
        let mut q = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let ql = _mm512_loadu_si512(p.add(h * 64) as *const _);
            let qh = both_halves(_mm256_loadu_si256(p.add(128 + h * 32) as *const __m256i));
            let lows = [
                _mm512_and_si512(ql, m4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
            ];
            for k in 0..2 {
                let high = _mm512_and_si512(_mm512_srlv_epi16(qh, high_shifts[k]), m3);
                q[2 * h + k] = _mm512_or_si512(lows[k], _mm512_slli_epi16::<4>(high));
            }
        }
        q
    }

    /// The 2-bit fields of a Q2_K or Q3_K block's 64 `qs` bytes at `qs` in value order: values
    /// `128n + 32j + l` are bits `2j, 2j + 1` of `qs[32n + l]`; register `c` is `n = c / 2` and
    /// `j = 2(c % 2)` (low half), `j + 1` (high half).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn two_bit_codes(qs: *const u8) -> [__m512i; 4] {
        let mut q = [_mm512_setzero_si512(); 4];
        for (c, q) in q.iter_mut().enumerate() {
            let (n, j) = (c / 2, 2 * (c % 2));
            let run = both_halves(_mm256_loadu_si256(qs.add(32 * n) as *const __m256i));
            let counts = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set1_epi16(2 * j as i16)),
                _mm256_set1_epi16(2 * j as i16 + 2),
            );
            *q = _mm512_and_si512(_mm512_srlv_epi16(run, counts), _mm512_set1_epi8(3));
        }
        q
    }

    /// Q3_K's codes at `p` offset to unsigned, `u = q + 4` (0..=7), in value order: the 2-bit
    /// field plus 4 where bit `4n + j` of `hmask[l]` is set (register `c` as [`two_bit_codes`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn q3k_codes(p: *const u8) -> [__m512i; 4] {
        let clear = q3k_high_clear(p);
        let mut q = two_bit_codes(p.add(32));
        for (q, clear) in q.iter_mut().zip(clear) {
            *q = _mm512_mask_add_epi8(*q, !clear, *q, _mm512_set1_epi8(4));
        }
        q
    }

    /// Per register of [`two_bit_codes`], the values whose high bit is clear (bit `4n + j` of
    /// `hmask[l]`): Q3_K's code is the 2-bit field less 4 there.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q3k_high_clear(p: *const u8) -> [__mmask64; 4] {
        let hmask = both_halves(_mm256_loadu_si256(p as *const __m256i));
        std::array::from_fn(|c| {
            let (n, j) = (c / 2, 2 * (c % 2));
            let bits = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set1_epi8((1u8 << (4 * n + j)) as i8)),
                _mm256_set1_epi8((2u8 << (4 * n + j)) as i8),
            );
            _mm512_testn_epi8_mask(hmask, bits)
        })
    }

    /// IQ4_XS's signed values `IQ4_TABLE[nibble]` at `p` in value order: sub-block `s` (32
    /// values) is the low then the high nibbles of `qs[16s..16s + 16]`; register `c` holds
    /// sub-blocks `2c`, `2c + 1`. `table` is the table in each 128-bit lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn iq4xs_values(p: *const u8, table: __m512i) -> [__m512i; 4] {
        const BY_4: i64 = 0x0004_0004_0004_0004; // four i16 shift counts of 4
        let nibble_shift = _mm512_set_epi64(BY_4, BY_4, 0, 0, BY_4, BY_4, 0, 0);
        let mut w = [_mm512_setzero_si512(); 4];
        for (c, w) in w.iter_mut().enumerate() {
            let run =
                _mm512_castsi256_si512(_mm256_loadu_si256(p.add(8 + 32 * c) as *const __m256i));
            // 128-bit lanes [2c, 2c, 2c + 1, 2c + 1] shifted by 0, 4, 0, 4.
            let spread = _mm512_shuffle_i64x2::<0b01_01_00_00>(run, run);
            let codes = _mm512_and_si512(
                _mm512_srlv_epi16(spread, nibble_shift),
                _mm512_set1_epi8(0x0F),
            );
            *w = _mm512_shuffle_epi8(table, codes);
        }
        w
    }

    /// The super-block kernel of `kind` for `N` activation rows.
    ///
    /// # Safety
    /// As [`k45_rows`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn kquant_rows<const N: usize>(
        kind: super::x86::KQuant,
        rows: WeightRows,
        cols: usize,
        act: &QuantizedRows,
        first: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        use super::x86::KQuant;
        match kind {
            KQuant::Q4 => k45_rows::<N, false>(rows, cols, act, first, out, stride),
            KQuant::Q5 => k45_rows::<N, true>(rows, cols, act, first, out, stride),
            KQuant::Q6 => q6k_rows::<N>(rows, cols, act, first, out, stride),
            KQuant::Q2 => q2k_rows::<N>(rows, cols, act, first, out, stride),
            KQuant::Q3 => signed_rows::<N, SIGNED_Q3_K>(rows, cols, act, first, out, stride),
            KQuant::Iq4Xs => signed_rows::<N, SIGNED_IQ4_XS>(rows, cols, act, first, out, stride),
        }
    }

    /// [`super::x86::KQuant::Iq4Xs`] as [`signed_rows`]'s const-generic argument.
    const SIGNED_IQ4_XS: u8 = 0;
    /// [`super::x86::KQuant::Q3`] as [`signed_rows`]'s const-generic argument.
    const SIGNED_Q3_K: u8 = 1;

    /// One block of a signed-code type, four 64-value pairs: `|w|`, the mask of negative `w`,
    /// and per i16 lane (a pair of values) its sub-block scale; and `d`.
    struct SignedBlock {
        magnitude: [__m512i; 4],
        negative: [__mmask64; 4],
        scales: [__m512i; 4],
        d: f32,
    }

    /// IQ4_XS block at `p`: pair `c` is sub-blocks `2c` (low half: the low then the high
    /// nibbles of `qs[32c..32c + 16]`) and `2c + 1`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn iq4xs_block_codes(p: *const u8, table: __m512i, picks: &[__m512i; 4]) -> SignedBlock {
        let ls = iq4xs_scales(p);
        let sc_all = _mm512_broadcast_i32x4(_mm_loadu_si128(ls.as_ptr() as *const __m128i));
        let w = iq4xs_values(p, table);
        SignedBlock {
            magnitude: w.map(|w| _mm512_abs_epi8(w)),
            negative: w.map(|w| _mm512_movepi8_mask(w)),
            scales: picks.map(|pick| _mm512_shuffle_epi8(sc_all, pick)),
            d: f16_at(p),
        }
    }

    /// Q3_K block at `p`: values `128n + 32j + l` are bits `2j, 2j + 1` of `qs[32n + l]`, less
    /// 4 where bit `4n + j` of `hmask[l]` is clear; pair `c` is `n = c / 2` and `j = 2(c % 2)`
    /// (low half), `j + 1` (high half), sub-blocks of 16 `4c .. 4c + 4`, one per 128-bit lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q3k_block_codes(p: *const u8, scale_lanes: &[__m512i; 4]) -> SignedBlock {
        let sub_scales = _mm512_castsi256_si512(q3k_scales16(p.add(96)));
        let clear = q3k_high_clear(p);
        let mut w = two_bit_codes(p.add(32));
        for (w, clear) in w.iter_mut().zip(clear) {
            *w = _mm512_mask_sub_epi8(*w, clear, *w, _mm512_set1_epi8(4));
        }
        SignedBlock {
            magnitude: w.map(|w| _mm512_abs_epi8(w)),
            negative: w.map(|w| _mm512_movepi8_mask(w)),
            scales: scale_lanes.map(|lanes| _mm512_permutexvar_epi16(lanes, sub_scales)),
            d: f16_at(p.add(108)),
        }
    }

    /// Rows of a signed-code type (`KIND`: [`SIGNED_IQ4_XS`] or [`SIGNED_Q3_K`]) against
    /// activation rows `first .. first + N`: `out[slot · stride + r]`. The codes are signed
    /// (IQ4_XS's table reaches −127), so neither operand order of `vpdpbusd` nor a pack to i16
    /// fits; instead ggml's sign trick in 512 bits: `maddubs(|w|, ±c)` (pairs ≤ 2·127² < 2¹⁵),
    /// with the activations negated under the mask of the negative weights (AVX-512 has no
    /// `vpsignb`), weighted by the sub-block scales in the `vpdpwssd` that widens them. The
    /// block sum is exact (|lane| ≤ 8·32·32258 < 2²⁴) and takes `d·d_act` in one 512-bit FMA.
    ///
    /// # Safety
    /// As [`k45_rows`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn signed_rows<const N: usize, const KIND: u8>(
        rows: WeightRows,
        cols: usize,
        act: &QuantizedRows,
        first: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let block_bytes = if KIND == SIGNED_IQ4_XS { 136 } else { 110 };
        let groups = act.groups();
        let table = _mm512_broadcast_i32x4(_mm_loadu_si128(
            crate::ggml::IQ4_TABLE.as_ptr() as *const __m128i
        ));
        let picks = [scale_pick(0), scale_pick(1), scale_pick(2), scale_pick(3)];
        let scale_lanes = sub16_scale_lanes();
        for r in 0..rows.count {
            let row = rows.row(r);
            let mut acc = [[0f32; 2]; N];
            for b in 0..cols / 256 {
                let p = row.add(b * block_bytes);
                crate::kernels::avx2::prefetch_ahead(p, block_bytes);
                let block = if KIND == SIGNED_IQ4_XS {
                    iq4xs_block_codes(p, table, &picks)
                } else {
                    q3k_block_codes(p, &scale_lanes)
                };
                let mut sums = BlockSums::<N>::default();
                for slot in 0..N {
                    let i = first + slot;
                    let codes = act.codes.as_ptr().add(i * act.cols + b * 256);
                    let mut isum = _mm512_setzero_si512();
                    for c in 0..4 {
                        let x = _mm512_loadu_si512(codes.add(c * 64) as *const _);
                        let signed =
                            _mm512_mask_sub_epi8(x, block.negative[c], _mm512_setzero_si512(), x);
                        let pairs = _mm512_maddubs_epi16(block.magnitude[c], signed);
                        isum = _mm512_dpwssd_epi32(isum, pairs, block.scales[c]);
                    }
                    sums.codes[slot] = fold(isum);
                    sums.act_d[slot] = *act.scales.as_ptr().add(i * groups + b * 8);
                }
                sums.finish::<false>(block.d, 0.0, &mut acc);
            }
            for (slot, acc) in acc.iter().enumerate() {
                out[slot * stride + r] = BlockSums::<N>::output::<false>(*acc);
            }
        }
    }

    /// i16 lane `l` of pair `c` reads sub-block `4c + l / 8` (sub-blocks of 16 values, one per
    /// 128-bit lane): `vpermw` indices.
    #[inline]
    #[target_feature(enable = "avx2,avx512f")]
    unsafe fn sub16_scale_lanes() -> [__m512i; 4] {
        let lanes = |c: i16| {
            let mut idx = [0i16; 32];
            for (l, v) in idx.iter_mut().enumerate() {
                *v = 4 * c + l as i16 / 8;
            }
            _mm512_loadu_si512(idx.as_ptr() as *const _)
        };
        [lanes(0), lanes(1), lanes(2), lanes(3)]
    }

    /// Q2_K rows against activation rows `first .. first + N`: `out[slot · stride + r]`. Values
    /// `128n + 32j + l` are bits `2j, 2j + 1` of `qs[32n + l]` (unsigned, 0..=3); pair `c` is `n
    /// = c / 2` and `j = 2(c % 2)` (low half), `j + 1` (high half), sub-blocks of 16 `4c .. 4c +
    /// 4`, one per 128-bit lane. Per pair: `maddubs(q, c)` weighted by the sub-block scales in a
    /// `vpdpwssd`; per block the minimums' term `Σ m·c` in one `vpmaddwd` of the 16 minimums
    /// against the activations' code sums per 16 (`QuantizedRows::code_sums16`, ggml's q8_K `bsums`);
    /// both block sums are exact and take `d·d_act` and `−dmin·d_act` in one FMA each.
    ///
    /// # Safety
    /// As [`k45_rows`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q2k_rows<const N: usize>(
        rows: WeightRows,
        cols: usize,
        act: &QuantizedRows,
        first: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        const BLOCK_BYTES: usize = 84;
        let groups = act.groups();
        let scale_lanes = sub16_scale_lanes();
        let m4 = _mm_set1_epi8(0x0F);
        {
            let sums16 = &act.code_sums16;
            for r in 0..rows.count {
                let row = rows.row(r);
                let mut acc = [[0f32; 2]; N];
                for b in 0..cols / 256 {
                    let p = row.add(b * BLOCK_BYTES);
                    crate::kernels::avx2::prefetch_ahead(p, BLOCK_BYTES);
                    let (d, dmin) = (f16_at(p.add(80)), f16_at(p.add(82)));
                    let packed = _mm_loadu_si128(p as *const __m128i);
                    let sub_scales =
                        _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(packed, m4)));
                    let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), m4));
                    let q = two_bit_codes(p.add(16));
                    let sc = scale_lanes.map(|lanes| _mm512_permutexvar_epi16(lanes, sub_scales));
                    let mut sums = BlockSums::<N>::default();
                    for slot in 0..N {
                        let i = first + slot;
                        let codes = act.codes.as_ptr().add(i * act.cols + b * 256);
                        let mut isum = _mm512_setzero_si512();
                        for c in 0..4 {
                            let x = _mm512_loadu_si512(codes.add(c * 64) as *const _);
                            isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q[c], x), sc[c]);
                        }
                        let bsums = _mm256_loadu_si256(
                            sums16.as_ptr().add(i * act.cols / 16 + b * 16) as *const __m256i,
                        );
                        sums.codes[slot] = fold(isum);
                        sums.mins[slot] = _mm256_madd_epi16(mins, bsums);
                        sums.act_d[slot] = *act.scales.as_ptr().add(i * groups + b * 8);
                    }
                    sums.finish::<true>(d, dmin, &mut acc);
                }
                for (slot, acc) in acc.iter().enumerate() {
                    out[slot * stride + r] = BlockSums::<N>::output::<true>(*acc);
                }
            }
        }
    }

    /// The sums of one Q6_K block's four 64-value pairs of centred codes `q` with the
    /// activation codes at `codes`, as the module docs describe: the activations are the
    /// unsigned operand of `vpdpbusd` (sign bits flipped as they load), each lane starting at
    /// `start[c]`; two groups' lane sums packed to i16 and weighted by `sc01` (pairs 0-1) and
    /// `sc23` (pairs 2-3) in a `vpdpwssd`.
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
    unsafe fn q6k_block_sum(
        q: &[__m512i; 4],
        start: &[__m512i; 4],
        (sc01, sc23): (__m512i, __m512i),
        codes: *const i8,
    ) -> __m512i {
        let mut p = [_mm512_setzero_si512(); 4];
        for c in 0..4 {
            let x = _mm512_loadu_si512(codes.add(c * 64) as *const _);
            let unsigned = _mm512_xor_si512(x, _mm512_set1_epi8(-128));
            p[c] = _mm512_dpbusd_epi32(start[c], unsigned, q[c]);
        }
        let isum =
            _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_packs_epi32(p[0], p[1]), sc01);
        _mm512_dpwssd_epi32(isum, _mm512_packs_epi32(p[2], p[3]), sc23)
    }

    /// One Q6_K row against activation rows `first .. first + N`, as `x86::q6k_rows`. Pair `c`
    /// is groups `2c`, `2c + 1`. In half `h = c / 2` of the block, pair `2h` takes the low
    /// nibbles of the 64 `ql` bytes and bits 0-1 | 2-3 of `qh`, pair `2h + 1` the high nibbles
    /// and bits 4-5 | 6-7. The centred codes `u − 32` are signed, so the activations go
    /// unsigned instead (`c + 128`, a sign-bit flip as they load) and each lane starts at
    /// `−128·Σ(u − 32)` of its four codes (per weight block, shared by the activation rows),
    /// which cancels the flip exactly.
    ///
    /// # Safety
    /// As [`k45_rows`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn q6k_rows<const N: usize>(
        rows: WeightRows,
        cols: usize,
        act: &QuantizedRows,
        first: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        const BLOCK_BYTES: usize = 210;
        let groups = act.groups();
        let thirty_two = _mm512_set1_epi8(32);
        let ones = _mm512_set1_epi8(1);
        // Sub-block scales are per 16 values: pair c's lanes (4 per 16 values) read sub-block
        // 4c + lane / 4; after the pack, i16 j of 128-bit lane L comes from P (j < 4) or P'
        // at i32 lane 4L + j % 4: sub-block 4c + L of the pair it came from.
        let control = |c0: i16, c1: i16| {
            let mut idx = [0i16; 32];
            for (w, v) in idx.iter_mut().enumerate() {
                let (lane, j) = (w / 8, w % 8);
                *v = if j < 4 { 4 * c0 } else { 4 * c1 } + lane as i16;
            }
            _mm512_loadu_si512(idx.as_ptr() as *const _)
        };
        let controls = [control(0, 1), control(2, 3)];
        for r in 0..rows.count {
            let row = rows.row(r);
            let mut acc = [[0f32; 2]; N];
            for b in 0..cols / 256 {
                let p = row.add(b * BLOCK_BYTES);
                crate::kernels::avx2::prefetch_ahead(p, BLOCK_BYTES);
                let d = f16_at(p.add(208));
                let sub_scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(
                    p.add(192) as *const __m128i,
                )));
                let scales = (
                    _mm512_permutexvar_epi16(controls[0], sub_scales),
                    _mm512_permutexvar_epi16(controls[1], sub_scales),
                );
                let q = q6k_codes(p).map(|u| _mm512_sub_epi8(u, thirty_two));
                let start = q.map(|centred| {
                    let sum4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, centred);
                    _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<7>(sum4))
                });
                let mut sums = BlockSums::<N>::default();
                for slot in 0..N {
                    let i = first + slot;
                    let codes = act.codes.as_ptr().add(i * act.cols + b * 256);
                    sums.codes[slot] = fold(q6k_block_sum(&q, &start, scales, codes));
                    sums.act_d[slot] = *act.scales.as_ptr().add(i * groups + b * 8);
                }
                sums.finish::<false>(d, 0.0, &mut acc);
            }
            for (slot, acc) in acc.iter().enumerate() {
                out[slot * stride + r] = BlockSums::<N>::output::<false>(*acc);
            }
        }
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
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
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

    /// The eight 6-bit scales and eight 6-bit minimums of a Q4_K / Q5_K block from its 12 packed
    /// bytes at `p` (scales as bytes, minimums as i32 lanes): [`ggml::scale_min_k4`] for all eight sub-blocks at once, on
    /// three little-endian words `w0 w1 w2` (bytes 0-3, 4-7, 8-11). Sub-blocks 0-3 keep the low 6
    /// bits of `w0` (scales) and `w1` (minimums); 4-7 take a nibble of `w2` (low: scale, high:
    /// minimum) topped with the two high bits of the matching byte of `w0` / `w1`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn k4_scales_mins(p: *const u8) -> ([u8; 8], __m256i) {
        let word =
            |i: usize| u32::from_le_bytes([*p.add(i), *p.add(i + 1), *p.add(i + 2), *p.add(i + 3)]);
        let (w0, w1, w2) = (word(0), word(4), word(8));
        const LOW6: u32 = 0x3F3F_3F3F;
        const LOW4: u32 = 0x0F0F_0F0F;
        const TOP2: u32 = 0x0303_0303;
        let sc_hi = (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4);
        let mn_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4);
        let sc = (w0 & LOW6) as u64 | ((sc_hi as u64) << 32);
        let mn = (w1 & LOW6) as u64 | ((mn_hi as u64) << 32);
        (
            sc.to_le_bytes(),
            _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn as i64)),
        )
    }

    /// `ggml::q3k_scales` of the 12 bytes at `p`, as 16 i16 lanes, in a few word operations:
    /// scale `j`'s low nibble is byte `j % 8`'s (low for `j < 8`, high after), its top two bits
    /// are bits `2(j / 4)` of byte `8 + j % 4`, so each run of four scales takes the four high
    /// bytes shifted by `2(j / 4)` at once.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q3k_scales16(p: *const u8) -> __m256i {
        const NIBBLES: u64 = 0x0F0F_0F0F_0F0F_0F0F;
        const PAIRS: u32 = 0x0303_0303;
        let low = (p as *const u64).read_unaligned();
        let top = (p.add(8) as *const u32).read_unaligned();
        let tops = |t: u32| u64::from((top >> (2 * t)) & PAIRS);
        let first = (low & NIBBLES) | ((tops(0) | (tops(1) << 32)) << 4);
        let second = ((low >> 4) & NIBBLES) | ((tops(2) | (tops(3) << 32)) << 4);
        let bytes = _mm_set_epi64x(second as i64, first as i64);
        _mm256_cvtepi8_epi16(_mm_sub_epi8(bytes, _mm_set1_epi8(32)))
    }

    /// IQ4_XS's eight sub-block scales at `p` (6 bits, offset 32): the low nibble from
    /// `scales_l`, the top two bits from the `scales_h` word.
    #[inline]
    pub(super) unsafe fn iq4xs_scales(p: *const u8) -> [i16; 8] {
        let high = u16::from_le_bytes([*p.add(2), *p.add(3)]);
        let mut ls = [0i16; 8];
        for (s, v) in ls.iter_mut().enumerate() {
            let low = (*p.add(4 + s / 2) >> (4 * (s % 2))) & 0x0F;
            let top = ((high >> (2 * s)) & 3) as u8;
            *v = i16::from(low | (top << 4)) - 32;
        }
        ls
    }

    /// Weight rows `n0 .. n0 + count` of a matrix whose rows of `row_bytes` start at `data`.
    #[derive(Clone, Copy)]
    pub(super) struct WeightRows {
        pub data: *const u8,
        pub row_bytes: usize,
        pub n0: usize,
        pub count: usize,
    }

    impl WeightRows {
        /// Rows `n0 .. n0 + count` of `data`, rows of `row_bytes`.
        pub(super) fn new(data: &[u8], row_bytes: usize, n0: usize, count: usize) -> Self {
            Self {
                data: data.as_ptr(),
                row_bytes,
                n0,
                count,
            }
        }

        /// The first byte of row `n0 + r`.
        ///
        /// # Safety
        /// `r < count`, and `data` holds rows `n0 .. n0 + count`.
        #[inline]
        pub(super) unsafe fn row(&self, r: usize) -> *const u8 {
            self.data.add((self.n0 + r) * self.row_bytes)
        }
    }

    /// Calls `$rows!(N)` with the literal `N` equal to `$n` (1..=8): the kernels keep `N`
    /// accumulators in registers.
    macro_rules! by_row_count {
        ($n:expr, $rows:ident) => {
            match $n {
                1 => $rows!(1),
                2 => $rows!(2),
                3 => $rows!(3),
                4 => $rows!(4),
                5 => $rows!(5),
                6 => $rows!(6),
                7 => $rows!(7),
                _ => $rows!(8),
            }
        };
    }

    /// Runs `$body` with `$row` bound to each weight row of `$rows` (a [`WeightRows`]) and
    /// `$first`, `$n` to each chunk of up to [`K_ACT_CHUNK`] activation rows of `$act_rows`,
    /// `$sums` to the chunk's outputs, and stores `$sums[..n]` at `$out[slot · $stride + r]`.
    /// Activation chunks outside, weight rows inside: a chunk's codes stay in L1 across the
    /// weight rows (taken the other way round, every weight row streamed all the activation rows
    /// from L2, one byte per multiply-add, and L2 was the bound). A macro, so that the kernels
    /// `$body` calls inline into the caller's loop.
    macro_rules! each_row_chunk {
        ($rows:expr, $act_rows:expr, $out:expr, $stride:expr,
         |$row:ident, $first:ident, $n:ident, $sums:ident| $body:block) => {{
            let (rows, act_rows) = ($rows, $act_rows);
            for $first in act_rows.clone().step_by(K_ACT_CHUNK) {
                let $n = (act_rows.end - $first).min(K_ACT_CHUNK);
                for r in 0..rows.count {
                    let mut sums = [0f32; K_ACT_CHUNK];
                    let ($row, $sums) = (rows.row(r), &mut sums);
                    $body
                    for (slot, sum) in sums.iter().take($n).enumerate() {
                        $out[($first + slot - act_rows.start) * $stride + r] = *sum;
                    }
                }
            }
        }};
    }

    /// Activation rows whose accumulators one pass over a weight row's blocks keeps.
    const K_ACT_CHUNK: usize = 8;

    /// Which super-block type a fused kernel reads.
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub enum KQuant {
        /// Q4_K: 144-byte blocks, 4-bit codes, 6-bit scales and minimums per 32 values.
        Q4,
        /// Q5_K: 176-byte blocks, Q4_K plus a fifth bit per value.
        Q5,
        /// Q6_K: 210-byte blocks, 6-bit codes centred on 32, an i8 scale per 16 values.
        Q6,
        /// Q2_K: 84 bytes, per 16 values a 4-bit scale and a 4-bit minimum, 2-bit codes, f16 d
        /// and dmin last; `w = d·sc·q − dmin·m`.
        Q2,
        /// Q3_K: 110 bytes, 2-bit codes with a high bit (`q − 4` where it is clear), 6-bit
        /// scales (offset 32) per 16 values, f16 d last.
        Q3,
        /// IQ4_XS: 136 bytes, f16 d, 6-bit scales (offset 32) per 32 values, nibbles into
        /// `IQ4_TABLE`.
        Iq4Xs,
    }

    impl KQuant {
        /// The fused kernel for `ty`, if there is one.
        pub fn of(ty: GgmlType) -> Option<Self> {
            match ty {
                GgmlType::Q4_K => Some(Self::Q4),
                GgmlType::Q5_K => Some(Self::Q5),
                GgmlType::Q6_K => Some(Self::Q6),
                GgmlType::Q2_K => Some(Self::Q2),
                GgmlType::Q3_K => Some(Self::Q3),
                GgmlType::IQ4_XS => Some(Self::Iq4Xs),
                _ => None,
            }
        }
    }

    /// Q4_K / Q5_K / Q6_K rows dotted straight from their bytes, no unpacked scratch row, against
    /// activations with one scale per 256 values (`ActivationScale::PerSuperblock`, which
    /// `ggml_dot::block` checks). Per 256-value block the codes are split into eight 32-value
    /// groups of unsigned codes `u`, each taken against its activation group with `maddubs(u, c)`
    /// (u ≤ 63, |c| ≤ 127: pair sums inside i16, no sign trick) and weighted by its sub-block
    /// scales in the `madd` that widens it to i32, so the block sums in integers and takes the
    /// shared scales in one FMA:
    /// - Q4_K / Q5_K (`w = d·sc·u − dmin·m` per 32 values): `d·d_act·Σ_g sc_g·isum_g` (|lane| ≤
    ///   8 · 2·7874·63 < 2²³) and `−Σ_g dmin·m_g·(d_act·Σc_g)` (`act.sums`), one FMA each into
    ///   separate accumulators;
    /// - Q6_K (`w = d·sc·(u − 32)`, one i8 `sc` per 16 values): `maddubs(u, c)` weighted by the
    ///   two sub-blocks' scales in one `madd`, the 32 taken off as `32·Σ sc·bsum` in one `madd`
    ///   per block against the activations' code sums per 16 (as Q3_K's 4), then one FMA with
    ///   `d·d_act`.
    ///
    /// A block's codes and scales are extracted once for up to [`K_ACT_CHUNK`] activation rows,
    /// whose accumulators stay in registers (`N` is the chunk's row count). Every activation row
    /// runs the same sequence of operations whatever the other rows are: batched rows keep the
    /// bits of single rows. Same value as [`super::dot_reference`] up to float summation order.
    ///
    /// With `wide` the blocks are taken by the 512-bit kernels of [`super::k512`], which sum
    /// the same integers and agree to float rounding.
    ///
    /// # Safety
    /// AVX2, FMA and F16C, and with `wide` AVX-512 F/BW/VL/VNNI; `data` holds rows `n0 .. n0 +
    /// out_rows` of `row_bytes` (`cols / 256` blocks of `kind`), `act` holds `cols` codes and
    /// `cols / 32` scales and sums for each row of `act_rows`, `out` holds `(act_rows.len() - 1)
    /// * stride + out_rows` floats.
    #[allow(clippy::too_many_arguments)] // one work item's context
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn k_block(
        kind: KQuant,
        wide: bool,
        data: &[u8],
        row_bytes: usize,
        cols: usize,
        n0: usize,
        out_rows: usize,
        act: &crate::kernels::quant::QuantizedRows,
        act_rows: std::ops::Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        if wide {
            let rows = super::k512::WeightRows::new(data, row_bytes, n0, out_rows);
            by_act_chunks!(
                act_rows,
                out,
                stride,
                |first, out| super::k512::kquant_rows(kind, rows, cols, act, first, out, stride)
            );
            return;
        }
        let rows = WeightRows::new(data, row_bytes, n0, out_rows);
        each_row_chunk!(rows, act_rows, out, stride, |row, first, n, sums| {
            macro_rules! rows {
                ($n:literal) => {
                    // SAFETY: as `k_block`'s contract: `row` holds `cols / 256` blocks of
                    // `kind`, `act` rows `first .. first + n`.
                    unsafe {
                        match kind {
                            KQuant::Q4 => k45_rows::<$n, false>(row, cols, act, first, sums),
                            KQuant::Q5 => k45_rows::<$n, true>(row, cols, act, first, sums),
                            KQuant::Q6 => q6k_rows::<$n>(row, cols, act, first, sums),
                            KQuant::Q2 => q2k_rows::<$n>(row, cols, act, first, sums),
                            KQuant::Q3 => q3k_rows::<$n>(row, cols, act, first, sums),
                            KQuant::Iq4Xs => iq4xs_rows::<$n>(row, cols, act, first, sums),
                        }
                    }
                };
            }
            by_row_count!(n, rows)
        });
    }

    /// Which 32-value block type [`block32`] reads.
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub enum Block32 {
        /// 18 bytes: f16 d, 4-bit codes `q − 8`.
        Q4_0,
        /// 20 bytes: f16 d and m, 4-bit codes: `d·q + m`.
        Q4_1,
        /// 22 bytes: f16 d, a fifth bit per value, 4-bit codes `q − 16`.
        Q5_0,
        /// 24 bytes: f16 d and m, a fifth bit per value, 4-bit codes: `d·q + m`.
        Q5_1,
        /// 34 bytes: f16 d, i8 codes.
        Q8_0,
        /// 18 bytes: f16 d, nibbles into `IQ4_TABLE`.
        Iq4Nl,
    }

    impl Block32 {
        /// The fused kernel for `ty`, if there is one.
        pub fn of(ty: GgmlType) -> Option<Self> {
            match ty {
                GgmlType::Q4_0 => Some(Self::Q4_0),
                GgmlType::Q4_1 => Some(Self::Q4_1),
                GgmlType::Q5_0 => Some(Self::Q5_0),
                GgmlType::Q5_1 => Some(Self::Q5_1),
                GgmlType::Q8_0 => Some(Self::Q8_0),
                GgmlType::IQ4_NL => Some(Self::Iq4Nl),
                _ => None,
            }
        }
    }

    /// Rows of a 32-value block type dotted straight from their bytes, no unpacked scratch row,
    /// against activations with one scale per 32 values (`ActivationScale::PerGroup`). Per
    /// group one `maddubs` of the codes against the activation codes, widened by `madd`,
    /// converted, and one FMA with `d·d_act`: the unsigned-code types (Q4_0, Q4_1, Q5_0, Q5_1:
    /// `u ≤ 31`, pairs inside i16) take `u` as it is and their addend `m` (Q4_0: `−8d`, Q5_0:
    /// `−16d`) as `m·(d_act·Σc)` (`act.sums`) into a scalar sum; the signed ones (Q8_0,
    /// IQ4_NL) take ggml's sign trick `maddubs(|w|, sign(c, w))` (|w| ≤ 128: pairs ≤
    /// 2·128·127). A block's codes are split once for up to [`K_ACT_CHUNK`] activation rows,
    /// and every activation row runs the same operations whatever the other rows are: batched
    /// rows keep the bits of single rows. Same value as [`super::dot_reference`] up to float
    /// summation order.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `data` holds rows `n0 .. n0 + out_rows` of `row_bytes` (`cols / 32`
    /// blocks of `kind`), `act` holds `cols` codes and `cols / 32` scales and sums for each row
    /// of `act_rows`, `out` holds `(act_rows.len() − 1) · stride + out_rows` floats.
    #[allow(clippy::too_many_arguments)] // one work item's context
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn block32(
        kind: Block32,
        data: &[u8],
        row_bytes: usize,
        cols: usize,
        n0: usize,
        out_rows: usize,
        act: &crate::kernels::quant::QuantizedRows,
        act_rows: std::ops::Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        let rows = WeightRows::new(data, row_bytes, n0, out_rows);
        each_row_chunk!(rows, act_rows, out, stride, |row, first, n, sums| {
            macro_rules! rows {
                ($n:literal) => {
                    // SAFETY: as `block32`'s contract: `row` holds `cols / 32` blocks of
                    // `kind`, `act` rows `first .. first + n`.
                    unsafe {
                        match kind {
                            Block32::Q4_0 => block32_rows::<$n, 0>(row, cols, act, first, sums),
                            Block32::Q4_1 => block32_rows::<$n, 1>(row, cols, act, first, sums),
                            Block32::Q5_0 => block32_rows::<$n, 2>(row, cols, act, first, sums),
                            Block32::Q5_1 => block32_rows::<$n, 3>(row, cols, act, first, sums),
                            Block32::Q8_0 => block32_rows::<$n, 4>(row, cols, act, first, sums),
                            Block32::Iq4Nl => block32_rows::<$n, 5>(row, cols, act, first, sums),
                        }
                    }
                };
            }
            by_row_count!(n, rows)
        });
    }

    /// One block of [`Block32`] `KIND` (its index as a const) at `p`: the 32 codes in value
    /// order (unsigned for Q4_0 … Q5_1, signed for Q8_0 and IQ4_NL), `d`, and the addend `m`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn block32_codes<const KIND: u8>(p: *const u8, table: __m256i) -> (__m256i, f32, f32) {
        let d = f16_at(p);
        let fifth = |at: usize| {
            bits_to_0x10(u32::from_le_bytes([
                *p.add(at),
                *p.add(at + 1),
                *p.add(at + 2),
                *p.add(at + 3),
            ]))
        };
        match KIND {
            0 => (nibbles16(p.add(2)), d, -8.0 * d),
            1 => (nibbles16(p.add(4)), d, f16_at(p.add(2))),
            2 => (_mm256_or_si256(nibbles16(p.add(6)), fifth(2)), d, -16.0 * d),
            3 => (
                _mm256_or_si256(nibbles16(p.add(8)), fifth(4)),
                d,
                f16_at(p.add(2)),
            ),
            4 => (_mm256_loadu_si256(p.add(2) as *const __m256i), d, 0.0),
            _ => (_mm256_shuffle_epi8(table, nibbles16(p.add(2))), d, 0.0),
        }
    }

    /// One row of [`Block32`] `KIND` against activation rows `first .. first + N`: `out[slot]`
    /// for each, as [`block32`] describes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block32_rows<const N: usize, const KIND: u8>(
        row: *const u8,
        cols: usize,
        act: &crate::kernels::quant::QuantizedRows,
        first: usize,
        out: &mut [f32; K_ACT_CHUNK],
    ) {
        const BYTES: [usize; 6] = [18, 20, 22, 24, 34, 18];
        let signed = KIND >= 4;
        let bytes = BYTES[KIND as usize];
        let groups = act.groups();
        let ones = _mm256_set1_epi16(1);
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
            ggml::IQ4_TABLE.as_ptr() as *const __m128i
        ));
        // A group's exact sum against activation row `i`, converted, and `d·d_act`.
        let group = |q: __m256i, magnitude: __m256i, d: f32, i: usize, g: usize| {
            let c = _mm256_loadu_si256(
                act.codes.as_ptr().add(i * act.cols + g * GROUP) as *const __m256i
            );
            let c = if signed { _mm256_sign_epi8(c, q) } else { c };
            let isum = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, c), ones);
            let scale = _mm256_set1_ps(d * *act.scales.as_ptr().add(i * groups + g));
            (scale, _mm256_cvtepi32_ps(isum))
        };
        let mut acc = [_mm256_setzero_ps(); N];
        let mut offset = [0f32; N];
        // Groups in pairs, each pair's two products summed before they join the accumulator:
        // a single row's chain is then one add per 64 values, not one FMA per 32.
        let count = cols / GROUP;
        for g in (0..count - count % 2).step_by(2) {
            let p = row.add(g * bytes);
            // One prefetch per four blocks (72..136 bytes) keeps a line or two in flight per
            // step without a prefetch per 18 bytes.
            if g % 4 == 0 {
                crate::kernels::avx2::prefetch_ahead(p, 4 * bytes);
            }
            let (q0, d0, m0) = block32_codes::<KIND>(p, table);
            let (q1, d1, m1) = block32_codes::<KIND>(p.add(bytes), table);
            let (mag0, mag1) = if signed {
                (_mm256_sign_epi8(q0, q0), _mm256_sign_epi8(q1, q1))
            } else {
                (q0, q1)
            };
            for slot in 0..N {
                let i = first + slot;
                let (s0, x0) = group(q0, mag0, d0, i, g);
                let (s1, x1) = group(q1, mag1, d1, i, g + 1);
                acc[slot] =
                    _mm256_add_ps(acc[slot], _mm256_fmadd_ps(s1, x1, _mm256_mul_ps(s0, x0)));
                if !signed {
                    let sums = act.sums.as_ptr().add(i * groups + g);
                    offset[slot] += m0 * *sums + m1 * *sums.add(1);
                }
            }
        }
        if count % 2 == 1 {
            let g = count - 1;
            let (q, d, m) = block32_codes::<KIND>(row.add(g * bytes), table);
            let magnitude = if signed { _mm256_sign_epi8(q, q) } else { q };
            for slot in 0..N {
                let i = first + slot;
                let (scale, x) = group(q, magnitude, d, i, g);
                acc[slot] = _mm256_fmadd_ps(scale, x, acc[slot]);
                if !signed {
                    offset[slot] += m * *act.sums.as_ptr().add(i * groups + g);
                }
            }
        }
        for slot in 0..N {
            out[slot] = hsum(acc[slot]) + offset[slot];
        }
    }

    /// One Q4_K (`FIVE = false`) or Q5_K row against activation rows `first .. first + N`:
    /// `out[slot]` for each.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k45_rows<const N: usize, const FIVE: bool>(
        row: *const u8,
        cols: usize,
        act: &crate::kernels::quant::QuantizedRows,
        first: usize,
        out: &mut [f32; K_ACT_CHUNK],
    ) {
        let block_bytes = if FIVE { 176 } else { 144 };
        let groups = act.groups();
        let m4 = _mm256_set1_epi8(0x0F);
        let sixteen = _mm256_set1_epi8(16);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut acc_min = [_mm256_setzero_ps(); N];
        for b in 0..cols / 256 {
            let p = row.add(b * block_bytes);
            crate::kernels::avx2::prefetch_ahead(p, block_bytes);
            let (d, dmin) = (f16_at(p), f16_at(p.add(2)));
            let (sc, mn) = k4_scales_mins(p.add(4));
            let dmn = _mm256_mul_ps(_mm256_cvtepi32_ps(mn), _mm256_set1_ps(-dmin));
            // Group g's scale in every i16 lane, the `madd` weight of its pair sums.
            let sc16 = sc.map(|v| _mm256_set1_epi16(v as i16));
            let qs = p.add(if FIVE { 48 } else { 16 });
            let qh = if FIVE {
                _mm256_loadu_si256(p.add(16) as *const __m256i)
            } else {
                _mm256_setzero_si256()
            };
            // Group 2c: low nibbles of qs[32c..], 2c + 1: high nibbles; Q5_K's fifth bits are
            // bits 2c and 2c + 1 of qh.
            let mut q = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let bytes = _mm256_loadu_si256(qs.add(c * 32) as *const __m256i);
                let mut lo = _mm256_and_si256(bytes, m4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4);
                if FIVE {
                    let bit_lo = _mm256_set1_epi8(1 << (2 * c));
                    let bit_hi = _mm256_set1_epi8((2u8 << (2 * c)) as i8);
                    let has_lo = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_lo), bit_lo);
                    let has_hi = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_hi), bit_hi);
                    lo = _mm256_or_si256(lo, _mm256_and_si256(has_lo, sixteen));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(has_hi, sixteen));
                }
                q[2 * c] = lo;
                q[2 * c + 1] = hi;
            }
            for slot in 0..N {
                let i = first + slot;
                let codes = act.codes.as_ptr().add(i * act.cols + b * 256);
                let isum = scaled_block_sum(&q, &sc16, codes);
                let at = i * groups + b * 8;
                // One scale for the block's eight groups (per-superblock activations).
                let act_d = *act.scales.as_ptr().add(at);
                let act_sum = _mm256_loadu_ps(act.sums.as_ptr().add(at));
                acc[slot] = _mm256_fmadd_ps(
                    _mm256_set1_ps(d * act_d),
                    _mm256_cvtepi32_ps(isum),
                    acc[slot],
                );
                acc_min[slot] = _mm256_fmadd_ps(dmn, act_sum, acc_min[slot]);
            }
        }
        for slot in 0..N {
            out[slot] = hsum(_mm256_add_ps(acc[slot], acc_min[slot]));
        }
    }

    /// One Q6_K row against activation rows `first .. first + N`: `out[slot]` for each.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6k_rows<const N: usize>(
        row: *const u8,
        cols: usize,
        act: &crate::kernels::quant::QuantizedRows,
        first: usize,
        out: &mut [f32; K_ACT_CHUNK],
    ) {
        const BLOCK_BYTES: usize = 210;
        let groups = act.groups();
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..cols / 256 {
            let p = row.add(b * BLOCK_BYTES);
            crate::kernels::avx2::prefetch_ahead(p, BLOCK_BYTES);
            let d = f16_at(p.add(208));
            let scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i));
            let sc = sub16_group_scales(scales);
            let mut q = [_mm256_setzero_si256(); 8];
            for h in 0..2 {
                q[4 * h..4 * h + 4].copy_from_slice(&q6k_half_codes(p, h));
            }
            for (slot, acc) in acc.iter_mut().enumerate() {
                let i = first + slot;
                let codes = act.codes.as_ptr().add(i * act.cols + b * 256);
                let offset = _mm256_madd_epi16(scales, code_sums16(act, i, b));
                let isum = _mm256_sub_epi32(
                    scaled_block_sum(&q, &sc, codes),
                    _mm256_slli_epi32::<5>(offset),
                );
                // One scale for the block's eight groups (per-superblock activations).
                let act_d = *act.scales.as_ptr().add(i * groups + b * 8);
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * act_d), _mm256_cvtepi32_ps(isum), *acc);
            }
        }
        for slot in 0..N {
            out[slot] = hsum(acc[slot]);
        }
    }

    /// The `madd` weights of a block's eight 32-value groups from its sixteen 16-value
    /// sub-block scales (`scales`, i16 lanes): group `g`'s register holds scale `2g` in its low
    /// 128 bits (the i16 pair sums of its first 16 values) and `2g + 1` in its high 128 bits.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn sub16_group_scales(scales: __m256i) -> [__m256i; 8] {
        // Byte masks that spread i16 lane 2k (into the low 128 bits) and 2k + 1 (into the high)
        // of a vector holding the same eight i16 scales in each half.
        const SPREADS: [[u8; 32]; 4] = {
            let mut masks = [[0u8; 32]; 4];
            let mut k = 0;
            while k < 4 {
                let mut j = 0;
                while j < 32 {
                    let lane = if j < 16 { 2 * k } else { 2 * k + 1 };
                    masks[k][j] = (2 * lane + j % 2) as u8;
                    j += 1;
                }
                k += 1;
            }
            masks
        };
        let halves = [
            _mm256_permute2x128_si256(scales, scales, 0x00),
            _mm256_permute2x128_si256(scales, scales, 0x11),
        ];
        std::array::from_fn(|g| {
            let spread = _mm256_loadu_si256(SPREADS[g % 4].as_ptr() as *const __m256i);
            _mm256_shuffle_epi8(halves[g / 4], spread)
        })
    }

    /// `Σ_g madd(maddubs(q[g], c_g), sc[g])` over a block's eight 32-value groups, `c_g` the
    /// activation codes at `codes + 32g`: unsigned codes `q` (pair sums inside i16 for every
    /// type that calls it), weighted in the widening `madd`; exact i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scaled_block_sum(q: &[__m256i; 8], sc: &[__m256i; 8], codes: *const i8) -> __m256i {
        let mut isum = _mm256_setzero_si256();
        for g in 0..8 {
            let c = _mm256_loadu_si256(codes.add(g * 32) as *const __m256i);
            isum = _mm256_add_epi32(
                isum,
                _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], c), sc[g]),
            );
        }
        isum
    }

    /// The 2-bit codes (0..=3) of a Q2_K / Q3_K block's 64 `qs` bytes at `qs`, group `g = 4n +
    /// j` (values `32g ..`): bits `2j, 2j + 1` of `qs[32n ..]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn two_bit_codes(qs: *const u8) -> [__m256i; 8] {
        let m3 = _mm256_set1_epi8(3);
        std::array::from_fn(|g| {
            let (n, j) = (g / 4, g % 4);
            let run = _mm256_loadu_si256(qs.add(32 * n) as *const __m256i);
            _mm256_and_si256(_mm256_srl_epi16(run, _mm_cvtsi32_si128(2 * j as i32)), m3)
        })
    }

    /// The code sums per 16 values of activation row `i`'s block `b` (ggml's q8_K `bsums`).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn code_sums16(
        act: &crate::kernels::quant::QuantizedRows,
        i: usize,
        b: usize,
    ) -> __m256i {
        _mm256_loadu_si256(
            act.code_sums16.as_ptr().add(i * act.cols / 16 + b * 16) as *const __m256i
        )
    }

    /// One Q2_K row against activation rows `first .. first + N`: `out[slot]` for each. Per
    /// block `d·d_act·Σ_g madd(maddubs(q, c), sc)` (|lane| ≤ 8·2·762·15) and the minimums'
    /// term `−dmin·d_act·Σ m·bsum` from one `madd` of the sixteen minimums against the
    /// activations' code sums per 16 (`QuantizedRows::code_sums16`), each one FMA into its own
    /// accumulator.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2k_rows<const N: usize>(
        row: *const u8,
        cols: usize,
        act: &crate::kernels::quant::QuantizedRows,
        first: usize,
        out: &mut [f32; K_ACT_CHUNK],
    ) {
        const BLOCK_BYTES: usize = 84;
        let groups = act.groups();
        let m4 = _mm_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut acc_min = [_mm256_setzero_ps(); N];
        for b in 0..cols / 256 {
            let p = row.add(b * BLOCK_BYTES);
            crate::kernels::avx2::prefetch_ahead(p, BLOCK_BYTES);
            let (d, dmin) = (f16_at(p.add(80)), f16_at(p.add(82)));
            let packed = _mm_loadu_si128(p as *const __m128i);
            let sc = sub16_group_scales(_mm256_cvtepu8_epi16(_mm_and_si128(packed, m4)));
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), m4));
            let q = two_bit_codes(p.add(16));
            for slot in 0..N {
                let i = first + slot;
                let codes = act.codes.as_ptr().add(i * act.cols + b * 256);
                let isum = scaled_block_sum(&q, &sc, codes);
                let msum = _mm256_madd_epi16(mins, code_sums16(act, i, b));
                // One scale for the block's eight groups (per-superblock activations).
                let act_d = *act.scales.as_ptr().add(i * groups + b * 8);
                acc[slot] = _mm256_fmadd_ps(
                    _mm256_set1_ps(d * act_d),
                    _mm256_cvtepi32_ps(isum),
                    acc[slot],
                );
                acc_min[slot] = _mm256_fmadd_ps(
                    _mm256_set1_ps(-dmin * act_d),
                    _mm256_cvtepi32_ps(msum),
                    acc_min[slot],
                );
            }
        }
        for slot in 0..N {
            out[slot] = hsum(_mm256_add_ps(acc[slot], acc_min[slot]));
        }
    }

    /// One Q3_K row against activation rows `first .. first + N`: `out[slot]` for each. The
    /// codes go unsigned, `u = q + 4` (0..=7: the 2-bit field plus 4 where bit `g` of
    /// `hmask[l]` is set, group `g` as [`two_bit_codes`]), so `maddubs(u, c)` needs no sign
    /// trick; the 4 comes back off as `4·Σ sc·bsum` in one `madd` per block against the code
    /// sums per 16. The block sum is exact (|lane| ≤ 8·2·1778·32) and takes `d·d_act` in one FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q3k_rows<const N: usize>(
        row: *const u8,
        cols: usize,
        act: &crate::kernels::quant::QuantizedRows,
        first: usize,
        out: &mut [f32; K_ACT_CHUNK],
    ) {
        const BLOCK_BYTES: usize = 110;
        let groups = act.groups();
        let four = _mm256_set1_epi8(4);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..cols / 256 {
            let p = row.add(b * BLOCK_BYTES);
            crate::kernels::avx2::prefetch_ahead(p, BLOCK_BYTES);
            let d = f16_at(p.add(108));
            let scales = q3k_scales16(p.add(96));
            let sc = sub16_group_scales(scales);
            let hmask = _mm256_loadu_si256(p as *const __m256i);
            let mut q = two_bit_codes(p.add(32));
            for (g, q) in q.iter_mut().enumerate() {
                let bit = _mm256_set1_epi8((1u8 << g) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), bit);
                *q = _mm256_or_si256(*q, _mm256_and_si256(set, four));
            }
            for (slot, acc) in acc.iter_mut().enumerate() {
                let i = first + slot;
                let codes = act.codes.as_ptr().add(i * act.cols + b * 256);
                let offset = _mm256_madd_epi16(scales, code_sums16(act, i, b));
                let isum = _mm256_sub_epi32(
                    scaled_block_sum(&q, &sc, codes),
                    _mm256_slli_epi32::<2>(offset),
                );
                // One scale for the block's eight groups (per-superblock activations).
                let act_d = *act.scales.as_ptr().add(i * groups + b * 8);
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * act_d), _mm256_cvtepi32_ps(isum), *acc);
            }
        }
        for slot in 0..N {
            out[slot] = hsum(acc[slot]);
        }
    }

    /// One IQ4_XS row against activation rows `first .. first + N`: `out[slot]` for each. The
    /// values `IQ4_TABLE[nibble]` are signed (down to −127), so ggml's sign trick:
    /// `maddubs(|w|, sign(c, w))` (pairs ≤ 2·127² < 2¹⁵) weighted by the sub-block's scale in
    /// the widening `madd`; the block sum is exact (|lane| ≤ 8·2·32258·32 < 2²⁴) and takes
    /// `d·d_act` in one FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4xs_rows<const N: usize>(
        row: *const u8,
        cols: usize,
        act: &crate::kernels::quant::QuantizedRows,
        first: usize,
        out: &mut [f32; K_ACT_CHUNK],
    ) {
        const BLOCK_BYTES: usize = 136;
        let groups = act.groups();
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
            ggml::IQ4_TABLE.as_ptr() as *const __m128i
        ));
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..cols / 256 {
            let p = row.add(b * BLOCK_BYTES);
            crate::kernels::avx2::prefetch_ahead(p, BLOCK_BYTES);
            let d = f16_at(p);
            let ls = iq4xs_scales(p);
            // Sub-block s: the low then the high nibbles of qs[16s ..].
            let w: [__m256i; 8] =
                std::array::from_fn(|s| _mm256_shuffle_epi8(table, nibbles16(p.add(8 + 16 * s))));
            let magnitude = w.map(|w| _mm256_sign_epi8(w, w));
            let sc = ls.map(|v| _mm256_set1_epi16(v));
            for (slot, acc) in acc.iter_mut().enumerate() {
                let i = first + slot;
                let codes = act.codes.as_ptr().add(i * act.cols + b * 256);
                let mut isum = _mm256_setzero_si256();
                for s in 0..8 {
                    let c = _mm256_loadu_si256(codes.add(s * 32) as *const __m256i);
                    let pairs = _mm256_maddubs_epi16(magnitude[s], _mm256_sign_epi8(c, w[s]));
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, sc[s]));
                }
                // One scale for the block's eight groups (per-superblock activations).
                let act_d = *act.scales.as_ptr().add(i * groups + b * 8);
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * act_d), _mm256_cvtepi32_ps(isum), *acc);
            }
        }
        for slot in 0..N {
            out[slot] = hsum(acc[slot]);
        }
    }

    /// The unsigned 6-bit codes (0..=63, before the centre of 32 is taken off) of values
    /// `128h + 32k .. 128h + 32k + 32`, k = 0..4, of the Q6_K block at `p`: low four bits from
    /// `ql` (bytes `64h ..`: k = 0, 1 low nibbles of the two 32-byte runs, k = 2, 3 high
    /// nibbles), high two bits from `qh` (bytes `128 + 32h ..`, bits `2k, 2k + 1`).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q6k_half_codes(p: *const u8, h: usize) -> [__m256i; 4] {
        let m4 = _mm256_set1_epi8(0x0F);
        let m3 = _mm256_set1_epi8(3);
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
        [
            _mm256_or_si256(lows[0], _mm256_slli_epi16(highs[0], 4)),
            _mm256_or_si256(lows[1], _mm256_slli_epi16(highs[1], 4)),
            _mm256_or_si256(lows[2], _mm256_slli_epi16(highs[2], 4)),
            _mm256_or_si256(lows[3], _mm256_slli_epi16(highs[3], 4)),
        ]
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
    pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
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
                let thirty_two = _mm256_set1_epi8(32);
                for b in 0..blocks {
                    let p = row.as_ptr().add(b * bytes);
                    let d = f16_at(p.add(208));
                    for s in 0..16 {
                        out.scale[b * 16 + s] = d * (*p.add(192 + s) as i8) as f32;
                        out.offset[b * 16 + s] = 0.0;
                    }
                    for h in 0..2 {
                        for (k, v) in q6k_half_codes(p, h).into_iter().enumerate() {
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

    /// A row of `cols` values of random `ty` blocks with finite scales (also the AMX kernel's
    /// test rows).
    pub(super) fn random_row(ty: GgmlType, cols: usize, seed: u64) -> Vec<u8> {
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
