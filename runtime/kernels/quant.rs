//! Activation quantization to q8, done once per GEMM call, with one of two scale blocks
//! ([`ActivationScale`]) — the ones ggml pairs with each weight type, so that a GGUF file gives
//! llama.cpp's numbers:
//!
//! - **Per 32-column group** (ggml's `quantize_row_q8_1`, for the tile formats and ggml's 32-value
//!   types): `d = max|x| / 127`, `q = round_ties_even(x / d)` (so |q| ≤ 127, which keeps the q4
//!   `maddubs` sums inside i16).
//! - **Per 256-column superblock** (ggml's `quantize_row_q8_K`, which ggml's dot products of the
//!   K-quants and IQ4_XS take): `iscale = 127 / max|x|`, `q = round_ties_even(x · iscale)`,
//!   `d = 1 / iscale`, the same `d` written to each of the superblock's 8 groups. ggml takes the
//!   signed value of largest magnitude and `iscale = −127 / max`, which negates every code and `d`
//!   alike, so `d · q` is the same number. One scale over 256 values rounds small activations
//!   more coarsely than 8 scales do; on the default model requantized to Q4_K_M that moves
//!   perplexity by 0.4 %, the same way as llama.cpp's (`tests/model_llama_cpp.rs`).
//!
//! Either way each group also carries `Σq` and `s = d · Σq` — the term that multiplies a group's
//! minimum, as ggml's q8_1 block carries it. Columns past the logical K (up to the quantized
//! width) are zero.
//!
//! [`quantize_group`] is the reference. With AVX-512 a whole run of groups (all rows at once when
//! K is a multiple of 32) goes through one call that works on blocks of 16 groups: the maxima of
//! a block, then its 16 scales with two vector divisions, then its codes, with the scales of 8
//! blocks computed ahead of their codes. So the per-group chain (horizontal max, two dependent
//! divisions, horizontal sum) overlaps across groups instead of running one group at a time. It
//! has the same bits as the reference for every input.

// Unsafe is this module's job: AVX-512 quantization, and disjoint writes through the pool's handle.
#![allow(unsafe_code)]

use super::pool::{ChunkCounter, Pool, SharedMut};
use crate::tiles::{WeightFormat, GROUP};

/// Quantize over the pool from this many values on (and 2 rows, to have something to share).
/// Timed on one core, the AVX-512 path does 16 × 576 in about 1.1 µs and 16 × 1536 in 3 µs;
/// sharing those with a second thread (2-vCPU Sapphire Rapids VM) makes them 1.1 → 2.0 µs and
/// 3.0 → 3.1 µs, while 32 × 1536 gains 12 % and 64 × 1536 30 %.
const POOLED_MIN_VALUES: usize = 32 * 1536;

/// The block of activation values that shares one q8 scale (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationScale {
    /// One scale per 32-column group.
    #[default]
    PerGroup,
    /// One scale per 256-column superblock (a row's columns past its last whole superblock take
    /// per-group scales).
    PerSuperblock,
}

/// Columns per superblock of [`ActivationScale::PerSuperblock`].
pub const SUPERBLOCK: usize = 256;

impl ActivationScale {
    /// The scale block ggml pairs with `format`'s weights: per superblock for the ggml types
    /// whose dot products take `q8_K` activations, per group for every other format.
    pub fn for_format(format: WeightFormat) -> Self {
        match format {
            WeightFormat::Ggml(ty) if ty.activation_block() == SUPERBLOCK => Self::PerSuperblock,
            _ => Self::PerGroup,
        }
    }
}

/// Quantized activations: `rows × cols` i8 codes (cols a multiple of 32), one scale and one
/// `d·Σq` per group.
#[derive(Default, Debug)]
pub struct QuantizedRows {
    /// Activation rows.
    pub rows: usize,
    /// Columns per row (the logical K rounded up to a multiple of 32).
    pub cols: usize,
    /// Codes, row-major `[rows, cols]`.
    pub codes: Vec<i8>,
    /// Scale per group, `[rows, cols / 32]`.
    pub scales: Vec<f32>,
    /// `scale · Σ codes` per group, `[rows, cols / 32]`.
    pub sums: Vec<f32>,
    /// `Σ codes` per group, `[rows, cols / 32]`: the VNNI q8 kernel's offset correction.
    pub code_sums: Vec<i32>,
    /// `Σ codes` per 16 values, `[rows, cols / 16]`, filled with
    /// [`ActivationScale::PerSuperblock`] scales only (empty otherwise): the super-block kernels'
    /// minimums' and offset terms (ggml's q8_K `bsums`).
    pub code_sums16: Vec<i16>,
    /// The scale blocks the rows were quantized with: with [`ActivationScale::PerSuperblock`],
    /// every whole 256-column superblock's 8 groups carry one scale.
    pub scale: ActivationScale,
    /// The codes, scales and code sums again, group-major, for the AVX-512 multi-row kernels:
    /// filled for two rows or more on CPUs with AVX-512 VNNI, empty otherwise.
    pub by_group: GroupMajor,
    /// The codes again in 64-byte lines, rows `cols` apart, for the AMX tile kernels (a tile
    /// load of rows that straddle cache lines costs several times an aligned one): filled for
    /// [`ActivationScale::PerSuperblock`] rows, [`TILE_MIN_ROWS`] or more of whole 64-value lines,
    /// on CPUs whose AMX kernels run ([`super::amx_tiles_run`]); empty otherwise.
    pub code_lines: Vec<CodeLine>,
}

/// Activation rows from which [`QuantizedRows::code_lines`] is filled.
pub const TILE_MIN_ROWS: usize = 16;

/// 64 activation codes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CodeLine(pub [i8; 64]);

/// [`QuantizedRows`] group-major: one group's values of consecutive rows side by side, so a
/// multi-row kernel reaches eight rows of a group from one pointer with fixed offsets instead of
/// computing (and bounds-checking) a pointer per row for every group.
#[derive(Default, Debug)]
pub struct GroupMajor {
    /// Codes, `[groups, rows, 32]`.
    pub codes: Vec<i8>,
    /// Scale per group, `[groups, rows]`.
    pub scales: Vec<f32>,
    /// `−128 · Σ codes` per group, `[groups, rows]`: where the VNNI q8 kernel's sums start (its
    /// codes are offset by +128).
    pub q8_starts: Vec<i32>,
}

impl GroupMajor {
    /// Index of group `group` of row `row` of `rows` in [`GroupMajor::scales`] and
    /// [`GroupMajor::q8_starts`] (times 32: in [`GroupMajor::codes`]).
    pub fn cell(rows: usize, group: usize, row: usize) -> usize {
        group * rows + row
    }

    /// Sized for `rows` rows of `cols` columns (no rows: empty); the contents are left to be
    /// overwritten.
    fn resize(&mut self, rows: usize, cols: usize) {
        self.codes.resize(rows * cols, 0);
        self.scales.resize(rows * cols / GROUP, 0.0);
        self.q8_starts.resize(rows * cols / GROUP, 0);
    }
}

/// The [`GroupMajor`] buffers, shared with the pool threads that quantize disjoint rows.
struct GroupMajorOut<'a> {
    codes: SharedMut<'a, i8>,
    scales: SharedMut<'a, f32>,
    q8_starts: SharedMut<'a, i32>,
}

impl<'a> GroupMajorOut<'a> {
    fn new(by_group: &'a mut GroupMajor) -> Self {
        GroupMajorOut {
            codes: SharedMut::new(&mut by_group.codes),
            scales: SharedMut::new(&mut by_group.scales),
            q8_starts: SharedMut::new(&mut by_group.q8_starts),
        }
    }

    /// Rows `first .. first + n` of `rows` into their group-major cells, from those rows'
    /// row-major `codes`, `scales` and `code_sums` (`n` rows of `groups` groups). Empty buffers
    /// (no group-major copy wanted) are left so.
    ///
    /// # Safety
    /// The buffers hold `rows` rows of `groups` groups, and no other thread touches the cells of
    /// rows `first .. first + n` while this runs ([`SharedMut`]'s contract).
    unsafe fn fill_rows(
        &self,
        rows: usize,
        first: usize,
        groups: usize,
        codes: &[i8],
        scales: &[f32],
        code_sums: &[i32],
    ) {
        if self.scales.is_empty() {
            return;
        }
        let n = scales.len() / groups.max(1);
        for group in 0..groups {
            let cell = GroupMajor::cell(rows, group, first);
            // SAFETY: the cells of rows first .. first + n of this group are consecutive, inside
            // the buffers, and this thread's alone (caller contract).
            let (codes_out, scales_out, starts_out) = unsafe {
                (
                    self.codes.slice_mut(cell * GROUP..(cell + n) * GROUP),
                    self.scales.slice_mut(cell..cell + n),
                    self.q8_starts.slice_mut(cell..cell + n),
                )
            };
            for (row, run) in codes_out.chunks_exact_mut(GROUP).enumerate() {
                let from = row * groups + group;
                run.copy_from_slice(&codes[from * GROUP..(from + 1) * GROUP]);
                scales_out[row] = scales[from];
                // |Σ| ≤ 32 · 127, so the product fits easily.
                starts_out[row] = -128 * code_sums[from];
            }
        }
    }
}

impl QuantizedRows {
    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.cols / GROUP
    }

    /// Quantize `x` (`rows × k`, row-major) in place of the previous contents with scales per
    /// `scale`; reuses capacity.
    pub fn quantize(&mut self, x: &[f32], rows: usize, k: usize, scale: ActivationScale) {
        let cols = k.div_ceil(GROUP) * GROUP;
        let groups = cols / GROUP;
        self.rows = rows;
        self.cols = cols;
        self.scale = scale;
        // Every element below is overwritten (codes past K included), so keep old contents
        // instead of zero-filling on every call.
        self.codes.resize(rows * cols, 0);
        self.scales.resize(rows * groups, 0.0);
        self.sums.resize(rows * groups, 0.0);
        self.code_sums.resize(rows * groups, 0);
        let group_major = rows >= 2 && multi_row_kernels_read_by_group();
        self.by_group
            .resize(if group_major { rows } else { 0 }, cols);
        self.quantize_codes(x, rows, k, scale);
        self.code_sums16.clear();
        self.code_lines.clear();
        if scale == ActivationScale::PerSuperblock {
            self.code_sums16.resize(rows * cols / 16, 0);
            fill_code_sums16(&self.codes, &mut self.code_sums16);
            if rows >= TILE_MIN_ROWS && cols.is_multiple_of(64) && super::amx_tiles_run() {
                self.code_lines.resize(rows * cols / 64, CodeLine([0; 64]));
                bytemuck::cast_slice_mut(&mut self.code_lines).copy_from_slice(&self.codes);
            }
        }
    }

    /// [`QuantizedRows::quantize`]'s codes, scales and per-group sums, and their group-major copy
    /// (buffers sized).
    fn quantize_codes(&mut self, x: &[f32], rows: usize, k: usize, scale: ActivationScale) {
        let cols = self.cols;
        let groups = cols / GROUP;
        let x = &x[..rows * k];
        let pool = Pool::global();
        let by_group = GroupMajorOut::new(&mut self.by_group);
        if rows < 2 || rows * k < POOLED_MIN_VALUES || pool.threads() < 2 {
            quantize_rows(
                x,
                k,
                scale,
                GroupsOut {
                    codes: &mut self.codes,
                    scales: &mut self.scales,
                    sums: &mut self.sums,
                    code_sums: &mut self.code_sums,
                },
            );
            // SAFETY: the group-major buffers were sized for these rows (or are empty), and
            // this thread alone holds them.
            unsafe {
                by_group.fill_rows(rows, 0, groups, &self.codes, &self.scales, &self.code_sums)
            };
            return;
        }
        let out = RowsOut {
            codes: SharedMut::new(&mut self.codes),
            scales: SharedMut::new(&mut self.scales),
            sums: SharedMut::new(&mut self.sums),
            code_sums: SharedMut::new(&mut self.code_sums),
        };
        let counter = ChunkCounter::new(rows, pool.threads(), 2);
        pool.run(&|_, _| {
            let out = &out;
            while let Some(range) = counter.claim() {
                let (first, n) = (range.start, range.len());
                // SAFETY: first + n ≤ rows, and the four buffers hold rows × cols codes and
                // rows × groups scales and sums (resized above, not touched again until the pool
                // job returns); every row is claimed by exactly one thread, so the range's slices
                // are disjoint from every other thread's.
                let chunk_out = unsafe {
                    GroupsOut {
                        codes: row_span(out.codes, first..first + n, cols),
                        scales: row_span(out.scales, first..first + n, groups),
                        sums: row_span(out.sums, first..first + n, groups),
                        code_sums: row_span(out.code_sums, first..first + n, groups),
                    }
                };
                quantize_rows(&x[first * k..(first + n) * k], k, scale, chunk_out);
                // SAFETY: as above, these rows are this thread's, in the row-major buffers it
                // just wrote and in the group-major cells (sized for `rows`, or empty).
                unsafe {
                    by_group.fill_rows(
                        rows,
                        first,
                        groups,
                        out.codes.slice(first * cols..(first + n) * cols),
                        out.scales.slice(first * groups..(first + n) * groups),
                        out.code_sums.slice(first * groups..(first + n) * groups),
                    )
                };
            }
        });
    }
}

/// Do the multi-row kernels of this CPU read [`QuantizedRows::by_group`] (the AVX-512 VNNI ones)?
fn multi_row_kernels_read_by_group() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::avx2::vnni_available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[j] = Σ codes[16j .. 16j + 16]`: with AVX-512 BW, per 64 codes their sign bits flipped
/// (`c + 128`), `vpsadbw` against zero (sums of 8), adjacent sums added and `16 · 128` taken off;
/// otherwise [`code_sums16_reference`]. The same integers either way.
fn fill_code_sums16(codes: &[i8], out: &mut [i16]) {
    debug_assert_eq!(codes.len(), 16 * out.len());
    #[cfg(target_arch = "x86_64")]
    if super::avx2::vnni_available() && codes.len().is_multiple_of(64) {
        // SAFETY: `vnni_available` implies AVX-512 F/BW; `codes` holds 16 per `out` element in
        // whole 64-code runs.
        unsafe { code_sums16_avx512(codes, out) };
        return;
    }
    code_sums16_reference(codes, out);
}

/// The scalar reference of `fill_code_sums16` (the per-16 code sums).
pub fn code_sums16_reference(codes: &[i8], out: &mut [i16]) {
    for (sum, run) in out.iter_mut().zip(codes.chunks_exact(16)) {
        // |Σ| ≤ 16 · 128 fits i16.
        *sum = run.iter().map(|&c| i16::from(c)).sum();
    }
}

/// [`fill_code_sums16`] with AVX-512 BW.
///
/// # Safety
/// AVX-512 F/BW; `codes.len()` is a multiple of 64 and 16 × `out.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn code_sums16_avx512(codes: &[i8], out: &mut [i16]) {
    use std::arch::x86_64::*;
    let flip = _mm512_set1_epi8(-128);
    for (run, sums) in codes.chunks_exact(64).zip(out.chunks_exact_mut(4)) {
        let x = _mm512_xor_si512(_mm512_loadu_si512(run.as_ptr() as *const _), flip);
        let eights = _mm512_sad_epu8(x, _mm512_setzero_si512());
        let mut lanes = [0i64; 8];
        _mm512_storeu_si512(lanes.as_mut_ptr() as *mut _, eights);
        for (k, sum) in sums.iter_mut().enumerate() {
            *sum = (lanes[2 * k] + lanes[2 * k + 1] - 16 * 128) as i16;
        }
    }
}

/// The output buffers of [`QuantizedRows::quantize`], shared with the pool threads, which write
/// disjoint rows.
struct RowsOut<'a> {
    codes: SharedMut<'a, i8>,
    scales: SharedMut<'a, f32>,
    sums: SharedMut<'a, f32>,
    code_sums: SharedMut<'a, i32>,
}

/// Rows `rows` of a shared row-major buffer of `per_row` elements a row.
///
/// # Safety
/// Nothing else reads or writes those rows while the slice lives ([`SharedMut`]'s contract).
unsafe fn row_span<'a, T>(
    buffer: SharedMut<'a, T>,
    rows: std::ops::Range<usize>,
    per_row: usize,
) -> &'a mut [T] {
    // SAFETY: the caller's contract.
    unsafe { buffer.slice_mut(rows.start * per_row..rows.end * per_row) }
}

/// A run of consecutive groups' slices of the [`QuantizedRows`] buffers (`codes` 32 per group).
pub struct GroupsOut<'a> {
    /// 32 codes per group.
    pub codes: &'a mut [i8],
    /// One scale per group.
    pub scales: &'a mut [f32],
    /// `scale · Σ codes` per group.
    pub sums: &'a mut [f32],
    /// `Σ codes` per group.
    pub code_sums: &'a mut [i32],
}

impl<'a> GroupsOut<'a> {
    /// Consecutive runs of `groups` groups each (the last may hold fewer).
    fn chunks(self, groups: usize) -> impl Iterator<Item = GroupsOut<'a>> {
        self.codes
            .chunks_mut(groups * GROUP)
            .zip(self.scales.chunks_mut(groups))
            .zip(self.sums.chunks_mut(groups))
            .zip(self.code_sums.chunks_mut(groups))
            .map(|(((codes, scales), sums), code_sums)| GroupsOut {
                codes,
                scales,
                sums,
                code_sums,
            })
    }

    /// The first `groups` groups and the rest (`groups` at most the run's length).
    fn split_at(self, groups: usize) -> (GroupsOut<'a>, GroupsOut<'a>) {
        let (codes, codes_rest) = self.codes.split_at_mut(groups * GROUP);
        let (scales, scales_rest) = self.scales.split_at_mut(groups);
        let (sums, sums_rest) = self.sums.split_at_mut(groups);
        let (code_sums, code_sums_rest) = self.code_sums.split_at_mut(groups);
        (
            GroupsOut {
                codes,
                scales,
                sums,
                code_sums,
            },
            GroupsOut {
                codes: codes_rest,
                scales: scales_rest,
                sums: sums_rest,
                code_sums: code_sums_rest,
            },
        )
    }
}

/// Rows of `k` values (`src`, row-major) into `out`, which holds those rows' groups.
fn quantize_rows(src: &[f32], k: usize, scale: ActivationScale, out: GroupsOut<'_>) {
    if scale == ActivationScale::PerSuperblock && k >= SUPERBLOCK {
        quantize_rows_by_superblock(src, k, out);
        return;
    }
    if k.is_multiple_of(GROUP) {
        // No padding: the rows' groups are one contiguous run, in and out.
        quantize_groups(src, out);
        return;
    }
    let groups = k.div_ceil(GROUP);
    for (row_out, row) in out.chunks(groups).zip(src.chunks(k)) {
        quantize_groups(row, row_out);
    }
}

/// [`quantize_rows`] with per-superblock scales: each row's whole superblocks through
/// [`quantize_superblock_fast`], the rest of the row per group.
fn quantize_rows_by_superblock(src: &[f32], k: usize, out: GroupsOut<'_>) {
    let groups = k.div_ceil(GROUP);
    let whole = k / SUPERBLOCK * SUPERBLOCK;
    for (row_out, row) in out.chunks(groups).zip(src.chunks(k)) {
        let (blocks_out, rest_out) = row_out.split_at(whole / GROUP);
        let superblocks = row[..whole].chunks_exact(SUPERBLOCK);
        for (block_out, values) in blocks_out.chunks(SUPERBLOCK / GROUP).zip(superblocks) {
            quantize_superblock_fast(values, block_out);
        }
        if whole < k {
            quantize_groups(&row[whole..], rest_out);
        }
    }
}

/// [`quantize_superblock`], with the AVX2 version when the CPU has it (bit-identical).
fn quantize_superblock_fast(values: &[f32], out: GroupsOut<'_>) {
    #[cfg(target_arch = "x86_64")]
    if values.len() == SUPERBLOCK && out.codes.len() == SUPERBLOCK && super::avx2::available() {
        if let (Ok(scales), Ok(code_sums)) = (
            <&mut [f32; 8]>::try_from(&mut *out.scales),
            <&mut [i32; 8]>::try_from(&mut *out.code_sums),
        ) {
            // SAFETY: AVX2 is available; `values` has 256 floats and `out.codes` 256 bytes
            // (checked above).
            let d = unsafe {
                super::avx2::quantize_superblock256(
                    values.as_ptr(),
                    out.codes.as_mut_ptr(),
                    scales,
                    code_sums,
                )
            };
            // As in `quantize_group_fast`: a NaN, an infinity or an overflowing `127/max` shows
            // as a non-finite scale or a −128 code; those go to the scalar.
            if d.is_finite() && !out.codes.contains(&i8::MIN) {
                for ((sum, &d), &q) in out.sums.iter_mut().zip(scales.iter()).zip(code_sums.iter())
                {
                    *sum = d * q as f32;
                }
                return;
            }
        }
    }
    quantize_superblock(values, out);
}

/// Quantize one superblock of up to 256 values with one scale (ggml's `quantize_row_q8_K`, see
/// the module docs): codes into `out.codes` (zero past `values`), the scale, `d·Σq` and `Σq` of
/// each 32-column group into `out`. NaNs are skipped by the max and get code 0.
pub fn quantize_superblock(values: &[f32], out: GroupsOut<'_>) {
    let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let iscale = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let d = if amax > 0.0 { 1.0 / iscale } else { 0.0 };
    for (g, group) in out.chunks(1).enumerate() {
        let start = (g * GROUP).min(values.len());
        let end = (start + GROUP).min(values.len());
        let sum = scaled_codes(&values[start..end], iscale, group.codes);
        group.scales[0] = d;
        group.sums[0] = d * sum as f32;
        group.code_sums[0] = sum;
    }
}

/// A run of groups: group `g` is `src[32g .. min(32g + 32, len)]` (only the last may be short),
/// into `out` (one scale, `d·Σq` and `Σq` per group, 32 codes per group, zero past `src`).
fn quantize_groups(src: &[f32], out: GroupsOut<'_>) {
    let groups = out.scales.len();
    let consistent = src.len().div_ceil(GROUP) == groups
        && out.codes.len() == groups * GROUP
        && out.sums.len() == groups
        && out.code_sums.len() == groups;
    #[cfg(target_arch = "x86_64")]
    if consistent && simd512::available() {
        // SAFETY: the CPU has the kernel's features, and the lengths are as it requires
        // (checked above).
        unsafe { simd512::quantize_groups(src, out) };
        return;
    }
    // The group-at-a-time path copes with any lengths (it stops at the shortest buffer).
    #[cfg(not(target_arch = "x86_64"))]
    let _ = consistent;
    quantize_groups_by_one(src, out);
}

/// [`quantize_groups`] one group at a time (the path without AVX-512).
fn quantize_groups_by_one(src: &[f32], out: GroupsOut<'_>) {
    let len = src.len();
    for (g, ((scale, sum_out), code_sum)) in out
        .scales
        .iter_mut()
        .zip(out.sums.iter_mut())
        .zip(out.code_sums.iter_mut())
        .enumerate()
    {
        let start = (g * GROUP).min(len);
        let end = (start + GROUP).min(len);
        let Some(codes) = out.codes.get_mut(g * GROUP..(g + 1) * GROUP) else {
            return;
        };
        let (d, sum) = quantize_group_fast(&src[start..end], codes);
        *scale = d;
        *sum_out = d * sum as f32;
        *code_sum = sum;
    }
}

/// [`quantize_group`], with the AVX2 version for full groups when the CPU has it (bit-identical).
#[inline]
fn quantize_group_fast(values: &[f32], out: &mut [i8]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if values.len() == GROUP && out.len() == GROUP && super::avx2::available() {
        // SAFETY: AVX2 is available; `values` has 32 floats and `out` 32 bytes (checked above).
        let (d, sum) = unsafe { super::avx2::quantize_group32(values.as_ptr(), out.as_mut_ptr()) };
        // Its vector max and convert differ from the scalar's only with a NaN, an infinity or an
        // overflowing 1/d in the group, and each leaves a non-finite d or a −128 code (the
        // converter's out-of-range value), which the scalar never makes: redo those groups.
        if d.is_finite() && !out.contains(&i8::MIN) {
            return (d, sum);
        }
    }
    quantize_group(values, out)
}

/// Quantize up to 32 values into `out` (the rest of `out` zeroed); returns (scale, Σ codes).
///
/// NaNs are skipped by the max and get code 0; an infinity makes `d` infinite and `1/d` zero.
#[inline]
pub fn quantize_group(values: &[f32], out: &mut [i8]) -> (f32, i32) {
    let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    (d, scaled_codes(values, inv, out))
}

/// Codes `round_ties_even(v · inv)` of `values` into `out` (the rest of `out` zeroed); returns
/// their sum. The clamp to ±127 only acts on a NaN (→ 0) or an infinite product: with `inv` from
/// the values' own max, |v·inv| ≤ 127 up to rounding.
fn scaled_codes(values: &[f32], inv: f32, out: &mut [i8]) -> i32 {
    let mut sum = 0i32;
    for (o, &v) in out.iter_mut().zip(values) {
        // Ties to even, like `_mm256_cvtps_epi32`.
        let q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
        *o = q;
        sum += q as i32;
    }
    for o in out.iter_mut().skip(values.len()) {
        *o = 0;
    }
    sum
}

/// AVX-512 version of [`quantize_groups`], 16 groups per block, bit-identical to
/// [`quantize_group`] per group.
///
/// The max is an unsigned max of the |x| bit patterns, which orders non-negative floats as
/// values do; a NaN's pattern is above +∞'s, so a group whose max is not below +∞'s pattern holds
/// a NaN or an infinity. The divisions are IEEE (correctly rounded) in either width, so the
/// vector `max / 127` and `1 / d` equal the scalar ones. For a group of finite values whose `1/d`
/// is finite, |x · (1/d)| < 127.5 (d, at least 2⁻¹²⁸, has over 20 significant bits even when
/// subnormal), so converting with ties-to-even gives the scalar's clamped code without a clamp.
/// The rest — a NaN or infinity in the group, or `1/d` overflowing for a tiny max — goes to
/// [`quantize_group`] itself after the block.
#[cfg(target_arch = "x86_64")]
mod simd512 {
    use super::{quantize_group, GroupsOut, GROUP};
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// Groups per block: one per lane of a 512-bit f32 vector of scales.
    const BLOCK: usize = 16;

    /// Blocks whose scales are computed before their codes: 8 × 2 KiB of activations, which stay
    /// in L1 between the two passes.
    const AHEAD: usize = 8;

    /// Does this CPU have AVX-512 F, BW and VL (and the AVX2 set)? Detected once;
    /// `XDNA_FORCE_SCALAR` turns it off with the AVX2 path.
    pub fn available() -> bool {
        static DETECTED: OnceLock<bool> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            crate::kernels::avx2::available()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
        })
    }

    /// # Safety
    /// The CPU has AVX2, FMA, F16C, AVX-512 F, BW and VL; `src.len().div_ceil(32)` equals the
    /// group count `out.scales.len()`, which `out.sums` and `out.code_sums` have too, and
    /// `out.codes` holds 32 bytes per group.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn quantize_groups(src: &[f32], mut out: GroupsOut<'_>) {
        let groups = out.scales.len();
        // Full blocks (all 512 values present) take unconditional loads and unrolled loops.
        let full = |first: usize| (first + BLOCK) * GROUP <= src.len();
        let mut first = 0;
        while first < groups {
            // Scales for up to AHEAD blocks first, so that their max → divide → divide chains
            // overlap each other and the codes, instead of each block waiting for its own.
            let blocks = (groups - first).div_ceil(BLOCK).min(AHEAD);
            let none = Scales {
                d: _mm512_setzero_ps(),
                inv: _mm512_setzero_ps(),
                special: 0,
            };
            let mut scales = [none; AHEAD];
            for (b, scale) in scales.iter_mut().enumerate().take(blocks) {
                let at = first + b * BLOCK;
                let n = (groups - at).min(BLOCK);
                // SAFETY: at + n ≤ groups, and with `full` the block's 512 values are in `src`;
                // the lengths are as `block_scales` requires (caller contract).
                *scale = unsafe {
                    if full(at) {
                        block_scales::<true>(src, at, BLOCK)
                    } else {
                        block_scales::<false>(src, at, n)
                    }
                };
            }
            for (b, scale) in scales.iter().enumerate().take(blocks) {
                let at = first + b * BLOCK;
                let n = (groups - at).min(BLOCK);
                // SAFETY: as for `block_scales` above.
                unsafe {
                    if full(at) {
                        block_codes::<true>(src, at, BLOCK, scale, &mut out)
                    } else {
                        block_codes::<false>(src, at, n, scale, &mut out)
                    }
                };
                // The rare groups the vector path does not cover, redone by the reference.
                let mut rest = scale.special;
                while rest != 0 {
                    let g = at + rest.trailing_zeros() as usize;
                    rest &= rest - 1;
                    let start = g * GROUP;
                    let end = (start + GROUP).min(src.len());
                    let (d, sum) =
                        quantize_group(&src[start..end], &mut out.codes[start..start + GROUP]);
                    out.scales[g] = d;
                    out.sums[g] = d * sum as f32;
                    out.code_sums[g] = sum;
                }
            }
            first += blocks * BLOCK;
        }
    }

    /// 16 floats of `src` from `start` (a multiple of 16), zero past its end.
    ///
    /// # Safety
    /// AVX-512 F; with `FULL`, `start + 16 ≤ src.len()`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn load16<const FULL: bool>(src: &[f32], start: usize) -> __m512 {
        let len = src.len();
        if FULL || start + 16 <= len {
            // SAFETY: 16 floats from `start` are inside `src`.
            unsafe { _mm512_loadu_ps(src.as_ptr().add(start)) }
        } else if start < len {
            // SAFETY: `start` is inside `src`, and the mask reads only the `len − start` < 16
            // floats after it (masked-off lanes are not accessed).
            unsafe {
                _mm512_maskz_loadu_ps(
                    ((1u32 << (len - start)) - 1) as __mmask16,
                    src.as_ptr().add(start),
                )
            }
        } else {
            _mm512_setzero_ps()
        }
    }

    /// Lane-wise sum (`ADD`) or unsigned max: the reduction of [`reduce16`]. A function, not a
    /// closure, so that it is compiled with the target features and inlined.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn combine<const ADD: bool>(a: __m512i, b: __m512i) -> __m512i {
        if ADD {
            _mm512_add_epi32(a, b)
        } else {
            _mm512_max_epu32(a, b)
        }
    }

    /// Sum or max (`ADD` or not) of each of 16 vectors' 16 lanes: lane `i` of the result reduces
    /// `v[i]` (a transpose-and-reduce: 15 shuffle pairs for 16 groups, not 4 for each group).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn reduce16<const ADD: bool>(v: &[__m512i; 16]) -> __m512i {
        // Within each 128-bit lane: [a b a b] partials of pairs, then [a b c d] of quads.
        let mut pairs = [_mm512_setzero_si512(); 8];
        for (p, pair) in pairs.iter_mut().enumerate() {
            let (a, b) = (v[2 * p], v[2 * p + 1]);
            *pair = combine::<ADD>(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
        }
        let mut quads = [_mm512_setzero_si512(); 4];
        for (q, quad) in quads.iter_mut().enumerate() {
            let (a, b) = (pairs[2 * q], pairs[2 * q + 1]);
            *quad = combine::<ADD>(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
        }
        // Then across the four 128-bit lanes: lanes 0-1 of octet `o` hold groups 8o..8o+3 and
        // lanes 2-3 groups 8o+4..8o+7; finally lane `L` holds groups 4L..4L+3, in order.
        let (a, b) = (quads[0], quads[1]);
        let lo = combine::<ADD>(
            _mm512_shuffle_i32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_i32x4::<0b11_10_11_10>(a, b),
        );
        let (a, b) = (quads[2], quads[3]);
        let hi = combine::<ADD>(
            _mm512_shuffle_i32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_i32x4::<0b11_10_11_10>(a, b),
        );
        combine::<ADD>(
            _mm512_shuffle_i32x4::<0b10_00_10_00>(lo, hi),
            _mm512_shuffle_i32x4::<0b11_01_11_01>(lo, hi),
        )
    }

    /// One block's scales: `d`, `1/d` (0 where `d` is 0), and the groups (bit `j` for the
    /// block's group `j`) the caller must redo with [`quantize_group`].
    #[derive(Clone, Copy)]
    struct Scales {
        d: __m512,
        inv: __m512,
        special: u32,
    }

    /// The scales of groups `first .. first + n` (n ≤ 16).
    ///
    /// # Safety
    /// AVX-512 F, BW, VL; `first + n` ≤ the group count, and the lengths as for
    /// [`quantize_groups`]; with `FULL`, n = 16 and all 16 groups' 512 values are in `src`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn block_scales<const FULL: bool>(src: &[f32], first: usize, n: usize) -> Scales {
        // A constant count lets the compiler unroll the loops and keep the arrays in registers.
        let n = if FULL { BLOCK } else { n };
        let abs = _mm512_set1_epi32(0x7fff_ffff);
        let mut maxima = [_mm512_setzero_si512(); BLOCK];
        for (j, m) in maxima.iter_mut().enumerate().take(n) {
            let start = (first + j) * GROUP;
            // SAFETY: AVX-512 F, and with `FULL` the block's values are in `src` (caller
            // contract).
            let (a, b) = unsafe { (load16::<FULL>(src, start), load16::<FULL>(src, start + 16)) };
            *m = _mm512_max_epu32(
                _mm512_and_si512(_mm512_castps_si512(a), abs),
                _mm512_and_si512(_mm512_castps_si512(b), abs),
            );
        }
        let amax = reduce16::<false>(&maxima);
        let valid = ((1u32 << n) - 1) as __mmask16;
        let non_finite = _mm512_mask_cmpgt_epu32_mask(valid, amax, _mm512_set1_epi32(0x7f7f_ffff));
        let d = _mm512_div_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(127.0));
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(d, _mm512_setzero_ps());
        let inv = _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.0), d);
        let overflow =
            _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(valid, inv, _mm512_set1_ps(f32::INFINITY));
        Scales {
            d,
            inv,
            special: (non_finite | overflow) as u32,
        }
    }

    /// Groups `first .. first + n` (n ≤ 16) into `out`, with their `scales` (the groups in
    /// `scales.special` get wrong values, for the caller to redo).
    ///
    /// # Safety
    /// As for [`block_scales`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn block_codes<const FULL: bool>(
        src: &[f32],
        first: usize,
        n: usize,
        scales: &Scales,
        out: &mut GroupsOut<'_>,
    ) {
        let n = if FULL { BLOCK } else { n };
        let valid = ((1u32 << n) - 1) as __mmask16;
        let d = scales.d;
        let mut invs = [0f32; BLOCK];
        // SAFETY: `invs` has 16 floats.
        unsafe { _mm512_storeu_ps(invs.as_mut_ptr(), scales.inv) };

        // Codes: i32 → i16 → i8 with saturation (within ±127 here), then undo the lane interleave
        // of the two packs: dword `4L + v` of the packed bytes is vector `v`'s lane `L` quad.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        let mut code_sums = [_mm512_setzero_si512(); BLOCK];
        let mut j = 0;
        while j < n {
            let start = (first + j) * GROUP;
            // SAFETY: AVX-512 F, and with `FULL` the block's values are in `src` (caller
            // contract).
            let v = unsafe {
                [
                    load16::<FULL>(src, start),
                    load16::<FULL>(src, start + 16),
                    load16::<FULL>(src, start + 32),
                    load16::<FULL>(src, start + 48),
                ]
            };
            let (ia, ib) = (_mm512_set1_ps(invs[j]), _mm512_set1_ps(invs[j + 1]));
            let q0 = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v[0], ia),
            );
            let q1 = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v[1], ia),
            );
            let q2 = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v[2], ib),
            );
            let q3 = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v[3], ib),
            );
            code_sums[j] = _mm512_add_epi32(q0, q1);
            let packed = _mm512_permutexvar_epi32(
                order,
                _mm512_packs_epi16(_mm512_packs_epi32(q0, q1), _mm512_packs_epi32(q2, q3)),
            );
            let dst = out.codes.as_mut_ptr();
            if j + 1 < n {
                code_sums[j + 1] = _mm512_add_epi32(q2, q3);
                // SAFETY: groups first + j and first + j + 1 exist, so their 64 codes do.
                unsafe { _mm512_storeu_si512(dst.add(start).cast(), packed) };
            } else {
                // SAFETY: group first + j exists, so its 32 codes do.
                unsafe {
                    _mm256_storeu_si256(dst.add(start).cast(), _mm512_castsi512_si256(packed))
                };
            }
            j += 2;
        }
        let code_sum = reduce16::<true>(&code_sums);
        let sums = _mm512_mul_ps(d, _mm512_cvtepi32_ps(code_sum));
        // SAFETY: groups first .. first + n exist, so their scales and sums do; `valid` stores
        // only those.
        unsafe {
            _mm512_mask_storeu_ps(out.scales.as_mut_ptr().add(first), valid, d);
            _mm512_mask_storeu_ps(out.sums.as_mut_ptr().add(first), valid, sums);
            _mm512_mask_storeu_epi32(out.code_sums.as_mut_ptr().add(first), valid, code_sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_sums16_equal_the_reference() {
        let mut q = QuantizedRows::default();
        let x: Vec<f32> = (0..3 * 512)
            .map(|i| ((i * 7919) % 255) as f32 - 127.0)
            .collect();
        q.quantize(&x, 3, 512, ActivationScale::PerSuperblock);
        let mut want = vec![0i16; q.codes.len() / 16];
        code_sums16_reference(&q.codes, &mut want);
        assert_eq!(q.code_sums16, want);
        assert!(want.iter().any(|&s| s != 0));
        q.quantize(&x, 3, 512, ActivationScale::PerGroup);
        assert!(q.code_sums16.is_empty());
    }

    #[test]
    fn simd_group_quantization_is_bit_identical_to_scalar() {
        let mut seed = 0x1234_5678_9abc_def0u64;
        for case in 0..2000 {
            let values: Vec<f32> = (0..GROUP)
                .map(|i| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let r = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    // Mix scales, exact halves (ties after scaling) and zeros.
                    match case % 4 {
                        0 => r * 10.0,
                        1 => (r * 254.0).round() / 2.0,
                        2 => {
                            if i % 3 == 0 {
                                0.0
                            } else {
                                r
                            }
                        }
                        _ => r * 1e-3,
                    }
                })
                .collect();
            let mut fast = [0i8; GROUP];
            let mut slow = [0i8; GROUP];
            let a = quantize_group_fast(&values, &mut fast);
            let b = quantize_group(&values, &mut slow);
            assert_eq!(a, b, "case {case}");
            assert_eq!(fast, slow, "case {case}");
        }
        let zeros = [0f32; GROUP];
        let mut out = [1i8; GROUP];
        assert_eq!(quantize_group_fast(&zeros, &mut out), (0.0, 0));
        assert_eq!(out, [0; GROUP]);
    }

    /// xorshift64: the next value of `seed`.
    fn next(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// `n` values of a group drawn from one of several distributions: plain, exact ties after
    /// scaling, all or some zeros, tiny (subnormal scales, an overflowing 1/d), huge, infinities,
    /// NaNs, signed zeros.
    fn group_values(seed: &mut u64, n: usize) -> Vec<f32> {
        let kind = next(seed) % 12;
        let pick = next(seed) as usize % n.max(1);
        let pow2 = f32::powi(2.0, (next(seed) % 16) as i32 - 8);
        (0..n)
            .map(|i| {
                let r = (next(seed) >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                let m = (next(seed) % 253) as f32 - 126.0;
                match kind {
                    0 => r * 10.0,
                    // max 127·s with s a power of two: d = s, 1/d exact, the rest land on .5.
                    1 if i == pick => 127.0 * pow2 * if r < 0.0 { -1.0 } else { 1.0 },
                    1 => (m + 0.5) * pow2,
                    2 => 0.0,
                    3 if i % 3 == 0 => 0.0,
                    3 => r,
                    4 => r * 1e-3,
                    // Around the smallest max whose 1/d is finite (127 · 2⁻¹²⁸), and subnormals.
                    5 => r * 4.0 * pow2 * 127.0 * f32::powi(2.0, -128),
                    6 => r * 1e-44,
                    7 => r * 1e38 * if i == pick { 6.0 } else { 1.0 },
                    8 if i == pick => f32::NAN,
                    9 if i == pick => {
                        if r < 0.0 {
                            f32::NEG_INFINITY
                        } else {
                            f32::INFINITY
                        }
                    }
                    10 if i == pick => f32::MAX,
                    11 if i % 2 == 0 => -0.0,
                    _ => r * 3.0,
                }
            })
            .collect()
    }

    /// The reference for a whole batch: per group, [`quantize_group`] over every group of every
    /// row; per superblock, [`quantize_superblock`] over each row's whole superblocks and
    /// [`quantize_group`] over the rest.
    fn quantize_slowly(x: &[f32], rows: usize, k: usize, scale: ActivationScale) -> QuantizedRows {
        let cols = k.div_ceil(GROUP) * GROUP;
        let groups = cols / GROUP;
        let mut q = QuantizedRows {
            rows,
            cols,
            codes: vec![0; rows * cols],
            scales: vec![0.0; rows * groups],
            sums: vec![0.0; rows * groups],
            code_sums: vec![0; rows * groups],
            code_sums16: Vec::new(),
            scale,
            by_group: GroupMajor::default(),
            code_lines: Vec::new(),
        };
        let whole = match scale {
            ActivationScale::PerGroup => 0,
            ActivationScale::PerSuperblock if k >= SUPERBLOCK => k / SUPERBLOCK * SUPERBLOCK,
            ActivationScale::PerSuperblock => 0,
        };
        let per = SUPERBLOCK / GROUP;
        for r in 0..rows {
            for b in 0..whole / SUPERBLOCK {
                let g = r * groups + b * per;
                quantize_superblock(
                    &x[r * k + b * SUPERBLOCK..r * k + (b + 1) * SUPERBLOCK],
                    GroupsOut {
                        codes: &mut q.codes[g * GROUP..(g + per) * GROUP],
                        scales: &mut q.scales[g..g + per],
                        sums: &mut q.sums[g..g + per],
                        code_sums: &mut q.code_sums[g..g + per],
                    },
                );
            }
            for g in whole / GROUP..groups {
                let values = &x[r * k + g * GROUP..r * k + (g * GROUP + GROUP).min(k)];
                let codes = &mut q.codes[r * cols + g * GROUP..r * cols + (g + 1) * GROUP];
                let (d, sum) = quantize_group(values, codes);
                q.scales[r * groups + g] = d;
                q.sums[r * groups + g] = d * sum as f32;
                q.code_sums[r * groups + g] = sum;
            }
        }
        if scale == ActivationScale::PerSuperblock {
            q.code_sums16 = vec![0; rows * cols / 16];
            code_sums16_reference(&q.codes, &mut q.code_sums16);
        }
        q
    }

    fn assert_same(fast: &QuantizedRows, slow: &QuantizedRows, what: &str) {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!((fast.rows, fast.cols), (slow.rows, slow.cols), "{what}");
        assert_eq!(fast.codes, slow.codes, "{what}: codes");
        assert_eq!(bits(&fast.scales), bits(&slow.scales), "{what}: scales");
        assert_eq!(bits(&fast.sums), bits(&slow.sums), "{what}: sums");
        assert_eq!(fast.code_sums, slow.code_sums, "{what}: code sums");
        assert_eq!(
            fast.code_sums16, slow.code_sums16,
            "{what}: code sums per 16"
        );
    }

    /// `fast`'s group-major copy holds `slow`'s row-major values where the multi-row kernels
    /// read it, and is empty elsewhere.
    fn assert_group_major(fast: &QuantizedRows, slow: &QuantizedRows, what: &str) {
        let by_group = &fast.by_group;
        let filled = fast.rows >= 2 && multi_row_kernels_read_by_group();
        assert_eq!(
            !by_group.codes.is_empty(),
            filled && fast.cols > 0,
            "{what}"
        );
        if filled {
            let groups = slow.groups();
            for row in 0..slow.rows {
                for group in 0..groups {
                    let (from, cell) = (row * groups + group, group * slow.rows + row);
                    let codes = &slow.codes[from * GROUP..(from + 1) * GROUP];
                    assert_eq!(&by_group.codes[cell * GROUP..(cell + 1) * GROUP], codes);
                    assert_eq!(by_group.scales[cell].to_bits(), slow.scales[from].to_bits());
                    assert_eq!(by_group.q8_starts[cell], -128 * slow.code_sums[from]);
                }
            }
        }
    }

    #[test]
    fn batch_quantization_is_bit_identical_to_the_scalar_groups() {
        let mut seed = 0x0ddb_1a5e_5ca1_ab1e_u64;
        // One `QuantizedRows` throughout, so stale contents from a larger call would show.
        let mut q = QuantizedRows::default();
        let mut by_one = QuantizedRows::default();
        let ks = [
            1usize, 31, 32, 33, 576, 1536, 1000, 1400, 64, 16, 256, 512, 300,
        ];
        let mut cases = 0;
        // 37 and 40 rows of 1536 or 1400 take the pooled path (with 2+ threads).
        const { assert!(37 * 1400 >= POOLED_MIN_VALUES) };
        for rows in (1..=20).chain([37, 40]) {
            for &k in &ks {
                // Fewer repeats of the big shapes, so the test stays quick.
                let repeats = if rows * k > 4096 { 1 } else { 3 };
                for _ in 0..repeats {
                    let mut x = Vec::with_capacity(rows * k);
                    for _ in 0..rows {
                        let mut row = Vec::with_capacity(k);
                        while row.len() < k {
                            let n = GROUP.min(k - row.len());
                            row.extend(group_values(&mut seed, n));
                        }
                        x.extend(row);
                    }
                    let what = format!("rows {rows}, k {k}");
                    let by_superblock =
                        quantize_slowly(&x, rows, k, ActivationScale::PerSuperblock);
                    q.quantize(&x, rows, k, ActivationScale::PerSuperblock);
                    assert_same(&q, &by_superblock, &format!("{what}, per superblock"));
                    assert_group_major(&q, &by_superblock, &format!("{what}, per superblock"));
                    let slow = quantize_slowly(&x, rows, k, ActivationScale::PerGroup);
                    q.quantize(&x, rows, k, ActivationScale::PerGroup);
                    assert_same(&q, &slow, &what);
                    assert_group_major(&q, &slow, &what);
                    // The path without AVX-512 (the AVX2 group kernel with its redo), directly.
                    let cols = k.div_ceil(GROUP) * GROUP;
                    by_one.rows = rows;
                    by_one.cols = cols;
                    by_one.codes = vec![7; rows * cols];
                    by_one.scales = vec![7.0; rows * cols / GROUP];
                    by_one.sums = vec![7.0; rows * cols / GROUP];
                    by_one.code_sums = vec![7; rows * cols / GROUP];
                    for r in 0..rows {
                        let g = cols / GROUP;
                        quantize_groups_by_one(
                            &x[r * k..(r + 1) * k],
                            GroupsOut {
                                codes: &mut by_one.codes[r * cols..(r + 1) * cols],
                                scales: &mut by_one.scales[r * g..(r + 1) * g],
                                sums: &mut by_one.sums[r * g..(r + 1) * g],
                                code_sums: &mut by_one.code_sums[r * g..(r + 1) * g],
                            },
                        );
                    }
                    assert_same(&by_one, &slow, &format!("{what}, one group at a time"));
                    cases += 1;
                }
            }
        }
        assert!(cases > 400);
    }

    #[test]
    fn groups_are_scaled_to_127_and_padded_with_zeros() {
        let x: Vec<f32> = (0..40).map(|i| i as f32 - 20.0).collect();
        let mut q = QuantizedRows::default();
        q.quantize(&x, 1, 40, ActivationScale::PerGroup);
        assert_eq!(q.cols, 64);
        assert_eq!(q.codes[0], -127); // -20 is the group's max magnitude
        assert!(q.codes[40..].iter().all(|&c| c == 0));
        let d0 = q.scales[0];
        assert!((d0 - 20.0 / 127.0).abs() < 1e-7);
        let sum: i32 = q.codes[..32].iter().map(|&c| c as i32).sum();
        assert_eq!(q.sums[0], d0 * sum as f32);
        let tail: i32 = q.codes[32..64].iter().map(|&c| c as i32).sum();
        assert_eq!(q.code_sums, [sum, tail]);
    }

    /// ggml's `quantize_row_q8_K` as written in its reference C: the signed value of largest
    /// magnitude (the first of equals), `iscale = −127 / max`, codes rounded to nearest (ties to
    /// even, its `nearest_int`) and capped at 127, `d = 1 / iscale`.
    fn ggml_q8_k(values: &[f32]) -> (f32, Vec<i8>) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in values {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            return (0.0, vec![0; values.len()]);
        }
        let iscale = -127.0 / max;
        let codes = values
            .iter()
            .map(|&v| ((iscale * v).round_ties_even() as i32).min(127) as i8)
            .collect();
        (1.0 / iscale, codes)
    }

    #[test]
    fn superblocks_take_one_scale_and_give_ggmls_q8_k_products() {
        // Hand values: the largest magnitude is −3 (at column 7), so iscale = 127/3 and every
        // group of the superblock carries d = 1/(127/3).
        let mut x = vec![0f32; 2 * SUPERBLOCK];
        for (i, v) in x[..SUPERBLOCK].iter_mut().enumerate() {
            *v = ((i % 13) as f32 - 6.0) / 4.0; // within ±1.5
        }
        x[7] = -3.0;
        x[100] = 1.5; // 1.5 · 127/3 = 63.5: a tie, to even
        x[101] = 0.75; // 31.75 → 32
        let mut q = QuantizedRows::default();
        q.quantize(&x, 1, 2 * SUPERBLOCK, ActivationScale::PerSuperblock);
        let d = 1.0 / (127.0f32 / 3.0);
        assert_eq!(q.codes[7], -127);
        assert_eq!(q.codes[100], 64);
        assert_eq!(q.codes[101], 32);
        assert!(q.scales[..8].iter().all(|s| s.to_bits() == d.to_bits()));
        for g in 0..8 {
            let sum: i32 = q.codes[g * 32..(g + 1) * 32]
                .iter()
                .map(|&c| c as i32)
                .sum();
            assert_eq!(q.code_sums[g], sum);
            assert_eq!(q.sums[g].to_bits(), (d * sum as f32).to_bits());
        }
        // The second superblock is all zeros: scale 0, codes 0.
        assert!(q.scales[8..].iter().all(|&s| s == 0.0));
        assert!(q.codes[SUPERBLOCK..].iter().all(|&c| c == 0));

        // Against ggml's reference, on varied superblocks: the same value d·q for every column
        // (the codes and d negated together when ggml's max is positive).
        let mut seed = 0x05ee_d0f5_ca1e_u64;
        for case in 0..300 {
            let values: Vec<f32> = (0..SUPERBLOCK / GROUP)
                .flat_map(|_| group_values(&mut seed, GROUP))
                .collect();
            if values.iter().any(|v| !v.is_finite()) {
                continue;
            }
            let (ggml_d, ggml_codes) = ggml_q8_k(&values);
            if !ggml_d.is_finite() {
                continue; // 127/max overflowed: ggml's codes are meaningless there too
            }
            let mut q = QuantizedRows::default();
            q.quantize(&values, 1, SUPERBLOCK, ActivationScale::PerSuperblock);
            for (c, (&ours, &theirs)) in q.codes.iter().zip(&ggml_codes).enumerate() {
                let a = q.scales[c / GROUP] * ours as f32;
                let b = ggml_d * theirs as f32;
                // Equal as numbers (a zero code times a negated d is −0).
                assert_eq!(a, b, "case {case}, column {c}");
            }
        }
    }

    #[test]
    fn scale_blocks_follow_ggmls_pairing_of_weight_types() {
        use crate::ggml::GgmlType;
        use ActivationScale::{PerGroup, PerSuperblock};
        use GgmlType::*;
        let expected = [
            (Q2_K, PerSuperblock),
            (Q3_K, PerSuperblock),
            (Q4_K, PerSuperblock),
            (Q5_K, PerSuperblock),
            (Q6_K, PerSuperblock),
            (IQ4_XS, PerSuperblock),
            (Q4_0, PerGroup),
            (Q4_1, PerGroup),
            (Q5_0, PerGroup),
            (Q5_1, PerGroup),
            (Q8_0, PerGroup),
            (IQ4_NL, PerGroup),
        ];
        for (ty, scale) in expected {
            assert_eq!(
                ActivationScale::for_format(WeightFormat::Ggml(ty)),
                scale,
                "{ty:?}"
            );
        }
        assert_eq!(
            ActivationScale::for_format(WeightFormat::Q8Legacy),
            ActivationScale::PerGroup
        );
    }
}
