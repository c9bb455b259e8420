//! AVX2 + FMA + F16C kernels over the Q4NX tile layouts (`docs/formats.md`, "Tile byte layouts"), read in place.
//!
//! # Why outer-product over columns
//!
//! In a column-major q4_1 tile a column's 32 rows are 16 contiguous bytes, so instead of transposing
//! tiles into ggml's row-major blocks, a kernel takes 4 columns at a time (64 bytes) and rearranges
//! them in registers into four `u8 × 32` vectors whose every 4-byte slot is one row's 4 codes
//! (8 rows per vector, all 32 rows in 4 vectors). One broadcast of the 4 matching activation bytes
//! then feeds `maddubs` (u8·i8 pairs → i16) for 32 rows at once; eight such column quads (one
//! 32-column group) are summed in i16 (|Σ| ≤ 16·15·127 = 30480, no overflow) and widened once with
//! `madd(·, 1)`. The float work is one FMA per (group, 8 rows) with the weight scales converted 8 at a
//! time (`cvtph` for f16, a 16-bit shift for bf16) — ggml's `ggml_vec_dot_q4_1_q8_1` arithmetic,
//! transposed. Rows come out in a fixed slot order (see `Q4_SLOT_ROWS`), so the scale vectors are
//! permuted to match, once per group, and results are un-permuted once per block.
//!
//! For several activation rows, each group is unpacked once into a 1-2 KiB stack buffer and reused by
//! every row: that keeps the M = 16 cost at a few times M = 1. The row loop broadcasts each
//! activation quad once per row and feeds all four slot vectors from it (`q4_group_rows`), two rows
//! at a time in a short assembly loop that loads each weight vector once for both
//! (`maddubs_quads_2_rows`; `q8_sign_quads_2_rows` for Q8); the q4_1
//! min term is a separate pass over mins converted once per 16 rows (`q4_add_min_terms`). Both do
//! the single-row kernel's float operations in its order, so a row's bits never depend on its batch.
//!
//! Q8 tiles use ggml's sign trick (`maddubs(|w|, sign(a, w))`, `ggml_vec_dot_q8_0_q8_0`) and a 4×32
//! byte transpose; the legacy 32×128 q8 tile and the 16-row-lane orders only change the loads.
//!
//! # AVX-512 VNNI
//!
//! On CPUs with AVX-512 F, BW, VL, VNNI and VBMI (Zen 4, Ice Lake and later; [`vnni_available`])
//! the multi-row calls ([`IntDot::Vnni`], two or more activation rows) go to the 512-bit kernels of
//! [`super::avx512`] instead: `vpdpbusd` forms 64 products into i32 per instruction, a quad of a
//! group is two vectors of 16 rows, and eight rows share each weight load. Their integer
//! sums are exact and the float work after them is this module's, per output lane, so both paths
//! give the same bits; the single-row kernel (memory-bound, AVX2) is the same for both.

// Unsafe is this module's job: AVX2/FMA/F16C intrinsics and assembly over raw tile pointers.
#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
pub use imp::*;

/// Slot order of the 32 rows in the four q4 result vectors (vector-major).
pub const Q4_SLOT_ROWS: [usize; 32] = [
    0, 2, 4, 6, 16, 18, 20, 22, 1, 3, 5, 7, 17, 19, 21, 23, 8, 10, 12, 14, 24, 26, 28, 30, 9, 11,
    13, 15, 25, 27, 29, 31,
];
/// Slot order of the 32 rows in the four q8 result vectors (vector-major).
pub const Q8_SLOT_ROWS: [usize; 32] = [
    0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13,
    14, 15, 28, 29, 30, 31,
];

/// How a 4-bit tile stores its per-(group, row) scale and min.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q4Scales {
    /// q4_1: bf16 d at `[0, 512)`, bf16 m at `[512, 1024)`.
    Bf16,
    /// q4_1: f16 d and m.
    F16,
    /// Q4_K: u8 s8/m8 times per-row bf16 super scale/min.
    Q4K,
    /// Q4_K with per-row f16 super scale/min: a GGUF Q4_K matrix re-laid exactly
    /// (`host_layout::Packing::KTiles`).
    Q4KF16,
}

/// Geometry of a 4-bit tile kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Q4Layout {
    /// How the tile stores its scales and mins.
    pub scales: Q4Scales,
    /// Plain column-major (true) or two 16-row planes (false).
    pub column_major: bool,
    /// Offset of the code area in the tile.
    pub codes: usize,
    /// Offset of the min area (q4_1; 512 in a tile, 64 in a host group record).
    pub mins: usize,
    /// Bytes per tile.
    pub tile_bytes: usize,
    /// 32-column groups per tile: 8, or 1 for host group records (`gemm::Packing`).
    pub groups_per_tile: usize,
    /// What the code bytes hold.
    pub codes_kind: Q4Codes,
}

/// What the code bytes of a 4-bit tile hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q4Codes {
    /// Unsigned 4-bit codes (q4_1, Q4_K).
    Nibbles,
    /// 5-bit codes: the nibbles plus 16 where the fifth-bit plane at this tile offset has their
    /// bit (GGUF Q5_K in K tiles, `host_layout::K_TILE_FIFTH_BITS`).
    FifthBits(usize),
    /// Indices into ggml's `IQ4_TABLE` (GGUF IQ4_XS in K tiles): each value plus 128 taken as
    /// `16·h + l`, two planes of 4-bit codes, the 128 taken back off as the tile's minimum. The
    /// tile has its own scales whatever `Q4Layout::scales` says: i8 `s8` at `g·32 + r` times the
    /// row's f16 `d` at `host_layout::K_TILE_IQ4_ROW_SCALES`, minimum `−128·s8·d`
    /// ([`group_scales`]).
    Iq4Table,
}

/// Geometry of an 8-bit tile kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Q8Layout {
    /// f16 (true) or bf16 scales at `[0, 512)`.
    pub f16_scales: bool,
    /// Plain column-major (true) or two 16-row planes (false).
    pub column_major: bool,
    /// Offset of the code area in the tile.
    pub codes: usize,
    /// Offset of the second 16-row plane from the first (16-row-lane order only).
    pub plane: usize,
    /// Columns per tile (256, or 128 for the legacy tile).
    pub tile_cols: usize,
    /// Bytes per tile.
    pub tile_bytes: usize,
}

/// How the multi-row integer kernels form their u8 · i8 dot products. Both give the same integer
/// sums (exact, no saturation), so the same bits; only the instruction count differs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IntDot {
    /// `maddubs` (u8·i8 pairs → i16) plus adds: AVX2, two vector ops per 32 products (q4), four
    /// with Q8's sign trick.
    #[default]
    Maddubs,
    /// 512-bit `vpdpbusd` ([`super::avx512`]; AVX-512 VNNI, with VBMI's byte permutes for
    /// unpacking; Zen 4, Ice Lake and later): one op per 64 products into i32.
    Vnni,
}

/// Most activation rows one kernel call handles (its stack accumulators are sized for this).
pub const MAX_ROWS: usize = 128;

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::*;
    use crate::kernels::quant::QuantizedRows;
    use crate::tiles::{GROUP, TILE_ROWS};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;
    use std::sync::OnceLock;

    /// Does this CPU have AVX2, FMA and F16C? Detected once.
    pub fn available() -> bool {
        static DETECTED: OnceLock<bool> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            std::env::var_os("XDNA_FORCE_SCALAR").is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }

    /// Does this CPU also run [`IntDot::Vnni`] (AVX-512 F, BW, VL, VNNI and VBMI: Zen 4, Ice Lake
    /// and later)? Detected once;
    /// `XDNA_NO_VNNI` (any value) turns it off, for A/B runs of the two paths.
    pub fn vnni_available() -> bool {
        static DETECTED: OnceLock<bool> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            available()
                && std::env::var_os("XDNA_NO_VNNI").is_none()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vbmi")
        })
    }

    // ---- scales -------------------------------------------------------------------------------

    /// 8 bf16 values → f32 (bf16 is the top half of an f32).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bf16x8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        let v = unsafe { _mm_loadu_si128(p as *const __m128i) };
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
    }

    /// 8 f16 values → f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16x8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
    }

    /// 8 u8 values → f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn u8x8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bytes at `p`.
        let v = unsafe { _mm_loadl_epi64(p as *const __m128i) };
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
    }

    /// 8 i8 → f32.
    ///
    /// # Safety
    /// AVX2 available; 8 readable bytes at `p`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn i8x8(p: *const u8) -> __m256 {
        // SAFETY: 8 bytes at `p` (caller contract).
        let v = unsafe { _mm_loadl_epi64(p as *const __m128i) };
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
    }

    /// [`q4_group_scales`] of an IQ4_XS K tile (`Q4Codes::Iq4Table`): `s8·d` and `−128·s8·d`.
    ///
    /// # Safety
    /// AVX2 available; `tile` is a whole IQ4_XS K tile, `g < 8`.
    #[inline(never)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4_group_scales(tile: *const u8, g: usize) -> ([__m256; 4], [__m256; 4]) {
        // SAFETY: the scale area's group g and the row scales lie inside the tile (caller
        // contract).
        unsafe {
            let s8 = tile.add(g * 32);
            let srow = tile.add(crate::kernels::host_layout::K_TILE_IQ4_ROW_SCALES);
            let minus_128 = _mm256_set1_ps(-128.0);
            let mut d = [_mm256_setzero_ps(); 4];
            let mut m = [_mm256_setzero_ps(); 4];
            for i in 0..4 {
                // i8 × f16 is exact in f32 (8 + 11 significant bits), and so is × −128.
                d[i] = _mm256_mul_ps(i8x8(s8.add(8 * i)), f16x8(srow.add(16 * i)));
                m[i] = _mm256_mul_ps(d[i], minus_128);
            }
            (d, m)
        }
    }

    /// [`q4_group_scales`], or [`iq4_group_scales`] for an IQ4_XS K tile: what the kernels that
    /// may meet every 4-bit layout call. Kept apart so that `q4_group_scales` stays small enough
    /// to be inlined into the q4 decode loop, which calls it directly.
    ///
    /// # Safety
    /// As [`q4_group_scales`].
    #[inline(always)]
    unsafe fn group_scales(
        layout: Q4Layout,
        tile: *const u8,
        g: usize,
    ) -> ([__m256; 4], [__m256; 4]) {
        // SAFETY: the caller's contract is both functions'; AVX2 available.
        unsafe {
            if layout.codes_kind == Q4Codes::Iq4Table {
                iq4_group_scales(tile, g)
            } else {
                q4_group_scales(layout, tile, g)
            }
        }
    }

    /// Natural-order (rows 0-7, 8-15, 16-23, 24-31) scale and min vectors of group `g`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::kernels) unsafe fn q4_group_scales(
        layout: Q4Layout,
        tile: *const u8,
        g: usize,
    ) -> ([__m256; 4], [__m256; 4]) {
        // SAFETY: `tile` points at a full tile (checked by the caller), and every offset in this
        // block is inside the tile's scale/min areas for g < layout.groups_per_tile.
        unsafe {
            match layout.scales {
                Q4Scales::Bf16 => {
                    let d = tile.add(g * 64);
                    let m = tile.add(layout.mins + g * 64);
                    (
                        [
                            bf16x8(d),
                            bf16x8(d.add(16)),
                            bf16x8(d.add(32)),
                            bf16x8(d.add(48)),
                        ],
                        [
                            bf16x8(m),
                            bf16x8(m.add(16)),
                            bf16x8(m.add(32)),
                            bf16x8(m.add(48)),
                        ],
                    )
                }
                Q4Scales::F16 => {
                    let d = tile.add(g * 64);
                    let m = tile.add(layout.mins + g * 64);
                    (
                        [
                            f16x8(d),
                            f16x8(d.add(16)),
                            f16x8(d.add(32)),
                            f16x8(d.add(48)),
                        ],
                        [
                            f16x8(m),
                            f16x8(m.add(16)),
                            f16x8(m.add(32)),
                            f16x8(m.add(48)),
                        ],
                    )
                }
                Q4Scales::Q4K | Q4Scales::Q4KF16 => {
                    let s8 = tile.add(g * 32);
                    let m8 = tile.add(256 + g * 32);
                    let srow = tile.add(4608);
                    let mrow = tile.add(4672);
                    let row_scales = |p: *const u8| {
                        if layout.scales == Q4Scales::Q4K {
                            bf16x8(p)
                        } else {
                            f16x8(p)
                        }
                    };
                    let mut d = [_mm256_setzero_ps(); 4];
                    let mut m = [_mm256_setzero_ps(); 4];
                    for i in 0..4 {
                        // u8 × bf16/f16 is exact in f32 (at most 8 + 11 significant bits).
                        d[i] = _mm256_mul_ps(u8x8(s8.add(8 * i)), row_scales(srow.add(16 * i)));
                        m[i] = _mm256_mul_ps(u8x8(m8.add(8 * i)), row_scales(mrow.add(16 * i)));
                    }
                    (d, m)
                }
            }
        }
    }

    /// Natural order → q4 slot order (`Q4_SLOT_ROWS`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_slot_order(n: [__m256; 4]) -> [__m256; 4] {
        let even = |a, b| {
            _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(
                _mm256_shuffle_ps::<0x88>(a, b),
            )))
        };
        let odd = |a, b| {
            _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(
                _mm256_shuffle_ps::<0xDD>(a, b),
            )))
        };
        [
            even(n[0], n[2]),
            odd(n[0], n[2]),
            even(n[1], n[3]),
            odd(n[1], n[3]),
        ]
    }

    /// Natural order → q8 slot order (`Q8_SLOT_ROWS`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_slot_order(n: [__m256; 4]) -> [__m256; 4] {
        [
            _mm256_permute2f128_ps::<0x20>(n[0], n[2]),
            _mm256_permute2f128_ps::<0x31>(n[0], n[2]),
            _mm256_permute2f128_ps::<0x20>(n[1], n[3]),
            _mm256_permute2f128_ps::<0x31>(n[1], n[3]),
        ]
    }

    // ---- code unpacking ---------------------------------------------------------------------------

    /// Columns `c..c+4` of a 4-bit tile as four u8 vectors, 4 codes (one row, 4 columns) per 32-bit
    /// slot, rows in `Q4_SLOT_ROWS` order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_unpack_quad(codes: *const u8, column_major: bool, c: usize) -> [__m256i; 4] {
        // SAFETY: the caller guarantees columns c..c+4 lie inside the tile's code area.
        let (a, b) = unsafe {
            if column_major {
                // [c bytes 0-15 | c+1 bytes 0-15] → [c 0-7, c+1 0-7 | c 8-15, c+1 8-15]
                let a = _mm256_loadu_si256(codes.add(c * 16) as *const __m256i);
                let b = _mm256_loadu_si256(codes.add(c * 16 + 32) as *const __m256i);
                (
                    _mm256_permute4x64_epi64::<0xD8>(a),
                    _mm256_permute4x64_epi64::<0xD8>(b),
                )
            } else {
                // Plane 0 holds bytes 0-7 (rows 0-15) of each column, plane 1 bytes 8-15.
                let p0 = _mm256_loadu_si256(codes.add(c * 8) as *const __m256i);
                let p1 = _mm256_loadu_si256(codes.add(2048 + c * 8) as *const __m256i);
                (
                    _mm256_permute2x128_si256::<0x20>(p0, p1),
                    _mm256_permute2x128_si256::<0x31>(p0, p1),
                )
            }
        };
        // Interleave the two columns' bytes in each lane: (c j, c+1 j) pairs.
        let pairs = _mm256_setr_epi8(
            0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12,
            5, 13, 6, 14, 7, 15,
        );
        let a = _mm256_shuffle_epi8(a, pairs);
        let b = _mm256_shuffle_epi8(b, pairs);
        // (c, c+1) pairs + (c+2, c+3) pairs → 4 columns of byte j per slot.
        let s0 = _mm256_unpacklo_epi16(a, b); // bytes 0-3 | 8-11
        let s1 = _mm256_unpackhi_epi16(a, b); // bytes 4-7 | 12-15
        let low = _mm256_set1_epi8(0x0F);
        [
            _mm256_and_si256(s0, low),
            _mm256_and_si256(_mm256_srli_epi16::<4>(s0), low),
            _mm256_and_si256(s1, low),
            _mm256_and_si256(_mm256_srli_epi16::<4>(s1), low),
        ]
    }

    /// The 32 columns of group `g` of a 4-bit tile as eight [`q4_unpack_quad`]s, built as a value
    /// (no zeroed scratch).
    ///
    /// # Safety
    /// AVX2 available; columns `32·g .. 32·g + 32` lie inside the tile's code area.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_unpack_group(codes: *const u8, column_major: bool, g: usize) -> [[__m256i; 4]; 8] {
        let c = g * GROUP;
        // SAFETY: every quad's columns are inside the group (caller contract).
        unsafe {
            [
                q4_unpack_quad(codes, column_major, c),
                q4_unpack_quad(codes, column_major, c + 4),
                q4_unpack_quad(codes, column_major, c + 8),
                q4_unpack_quad(codes, column_major, c + 12),
                q4_unpack_quad(codes, column_major, c + 16),
                q4_unpack_quad(codes, column_major, c + 20),
                q4_unpack_quad(codes, column_major, c + 24),
                q4_unpack_quad(codes, column_major, c + 28),
            ]
        }
    }

    /// `w` (a [`q4_unpack_quad`] vector of quad `quad`) with 16 added where its fifth bit is set:
    /// `bits` is its slot's 32 plane bytes, which hold quad q's bits in bit q
    /// (`host_layout::K_TILE_FIFTH_BITS`). `QUAD` is a constant so that the mask and the shift are
    /// immediates.
    #[inline(always)]
    fn add_fifth_bits<const QUAD: usize>(w: __m256i, bits: __m256i) -> __m256i {
        // SAFETY: these intrinsics operate on registers only, and AVX2 is enabled in every caller
        // (`target_feature`).
        unsafe {
            let bit = _mm256_and_si256(bits, _mm256_set1_epi8((1u8 << QUAD) as i8));
            // Bit `QUAD` moved to bit 4 of the same byte (16-bit shifts cannot carry it out: the
            // other bits are clear).
            let sixteen = match QUAD {
                0 => _mm256_slli_epi16::<4>(bit),
                1 => _mm256_slli_epi16::<3>(bit),
                2 => _mm256_slli_epi16::<2>(bit),
                3 => _mm256_slli_epi16::<1>(bit),
                4 => bit,
                5 => _mm256_srli_epi16::<1>(bit),
                6 => _mm256_srli_epi16::<2>(bit),
                _ => _mm256_srli_epi16::<3>(bit),
            };
            _mm256_or_si256(w, sixteen)
        }
    }

    /// A group's four slot vectors of fifth bits: the 128 plane bytes at `plane`.
    ///
    /// # Safety
    /// AVX2 available; 128 readable bytes at `plane`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fifth_bit_slots(plane: *const u8) -> [__m256i; 4] {
        // SAFETY: 4 × 32 bytes at `plane` (caller contract).
        std::array::from_fn(|s| unsafe { _mm256_loadu_si256(plane.add(32 * s) as *const __m256i) })
    }

    /// Offset of a 5-bit layout's fifth-bit plane (0 for the other code kinds, which have none).
    #[inline(always)]
    fn fifth_bit_plane(layout: Q4Layout) -> usize {
        match layout.codes_kind {
            Q4Codes::FifthBits(plane) => plane,
            Q4Codes::Nibbles | Q4Codes::Iq4Table => 0,
        }
    }

    /// Group `g` of a 5-bit K tile (`Q4Codes::FifthBits`) as [`q4_unpack_group`]'s vectors with
    /// their fifth bits added: codes 0..=31.
    ///
    /// # Safety
    /// AVX2 available; `tile` is a whole K tile of `layout` with a fifth-bit plane, `g < 8`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_unpack_group(layout: Q4Layout, tile: *const u8, g: usize) -> [[__m256i; 4]; 8] {
        // SAFETY: the code area and the plane's group g lie inside the tile (caller contract).
        unsafe {
            let mut unpacked = q4_unpack_group(tile.add(layout.codes), layout.column_major, g);
            let plane = tile.add(fifth_bit_plane(layout) + g * 128);
            let bits = fifth_bit_slots(plane);
            macro_rules! quad {
                ($q:literal) => {
                    for (w, &bits) in unpacked[$q].iter_mut().zip(&bits) {
                        *w = add_fifth_bits::<$q>(*w, bits);
                    }
                };
            }
            quad!(0);
            quad!(1);
            quad!(2);
            quad!(3);
            quad!(4);
            quad!(5);
            quad!(6);
            quad!(7);
            unpacked
        }
    }

    /// Group `g` of an 8-bit tile as eight quads of `[codes, |codes|]` (the sign trick's two
    /// operands), built as a value.
    ///
    /// # Safety
    /// AVX2 available; columns `32·g .. 32·g + 32` lie inside the tile's code area.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_unpack_group(
        codes: *const u8,
        layout: Q8Layout,
        g: usize,
    ) -> [[[__m256i; 4]; 2]; 8] {
        let c = g * GROUP;
        let quad = |at: usize| {
            // SAFETY: the quad's columns are inside the group (caller contract).
            let w = unsafe { q8_unpack_quad(codes, layout, at) };
            [w, w.map(|v| _mm256_sign_epi8(v, v))]
        };
        [
            quad(c),
            quad(c + 4),
            quad(c + 8),
            quad(c + 12),
            quad(c + 16),
            quad(c + 20),
            quad(c + 24),
            quad(c + 28),
        ]
    }

    /// Columns `c..c+4` of an 8-bit tile as four i8 vectors, rows in `Q8_SLOT_ROWS` order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_unpack_quad(codes: *const u8, layout: Q8Layout, c: usize) -> [__m256i; 4] {
        // SAFETY: the caller guarantees columns c..c+4 lie inside the tile's code area.
        let col = |i: usize| unsafe {
            if layout.column_major {
                _mm256_loadu_si256(codes.add((c + i) * 32) as *const __m256i)
            } else {
                let lo = _mm_loadu_si128(codes.add((c + i) * 16) as *const __m128i);
                let hi = _mm_loadu_si128(codes.add(layout.plane + (c + i) * 16) as *const __m128i);
                _mm256_set_m128i(hi, lo)
            }
        };
        let (c0, c1, c2, c3) = (col(0), col(1), col(2), col(3));
        let t0 = _mm256_unpacklo_epi8(c0, c1); // rows 0-7 | 16-23
        let t1 = _mm256_unpackhi_epi8(c0, c1); // rows 8-15 | 24-31
        let t2 = _mm256_unpacklo_epi8(c2, c3);
        let t3 = _mm256_unpackhi_epi8(c2, c3);
        [
            _mm256_unpacklo_epi16(t0, t2),
            _mm256_unpackhi_epi16(t0, t2),
            _mm256_unpacklo_epi16(t1, t3),
            _mm256_unpackhi_epi16(t1, t3),
        ]
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn broadcast4(p: *const i8) -> __m256i {
        // SAFETY: the caller guarantees 4 readable bytes at `p`.
        _mm256_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
    }

    /// Which slot order a kernel's result vectors use.
    #[derive(Clone, Copy)]
    enum SlotOrder {
        /// `Q4_SLOT_ROWS`.
        Q4,
        /// `Q8_SLOT_ROWS`.
        Q8,
    }

    /// Slot-ordered result vectors → rows 0-7, 8-15, 16-23, 24-31: the inverse of
    /// [`q4_slot_order`] / [`q8_slot_order`], in 4-8 shuffles instead of 32 scalar moves.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn natural_order(order: SlotOrder, s: [__m256; 4]) -> [__m256; 4] {
        let (a, b, c, d) = match order {
            // [0 2 4 6|16 18 20 22] + [1 3 5 7|17 19 21 23] → [0-3|16-19] and [4-7|20-23].
            SlotOrder::Q4 => (
                _mm256_unpacklo_ps(s[0], s[1]),
                _mm256_unpackhi_ps(s[0], s[1]),
                _mm256_unpacklo_ps(s[2], s[3]),
                _mm256_unpackhi_ps(s[2], s[3]),
            ),
            // Already [0-3|16-19], [4-7|20-23], [8-11|24-27], [12-15|28-31].
            SlotOrder::Q8 => (s[0], s[1], s[2], s[3]),
        };
        [
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x20>(c, d),
            _mm256_permute2f128_ps::<0x31>(a, b),
            _mm256_permute2f128_ps::<0x31>(c, d),
        ]
    }

    /// Store slot-ordered accumulators into `out[..32]` in natural row order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store_rows(acc: [__m256; 4], order: SlotOrder, out: &mut [f32]) {
        debug_assert!(out.len() >= TILE_ROWS);
        for (i, v) in natural_order(order, acc).iter().enumerate() {
            // SAFETY: out holds ≥ 32 floats; 8 are written at 8·i for i < 4.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), *v) };
        }
    }

    // ---- accumulators ------------------------------------------------------------------------------

    /// `acc[slot] = fma(dot[slot], d[slot] · scale_x, acc[slot])` for one row's four slot-ordered
    /// accumulators kept in `acc_mem[..32]` — the single-row kernel's per-group update. `FIRST`
    /// starts from zero, as that kernel's registers do (so `acc_mem` need not be cleared first).
    ///
    /// # Safety
    /// AVX2/FMA available; `acc_mem.len() ≥ 32`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate_row<const FIRST: bool>(
        acc_mem: &mut [f32],
        dots: [__m256; 4],
        d: &[__m256; 4],
        scale_x: __m256,
    ) {
        debug_assert!(acc_mem.len() >= TILE_ROWS);
        for (slot, dot) in dots.into_iter().enumerate() {
            // SAFETY: acc_mem holds ≥ 32 floats; 8 are read and written at 8·slot for slot < 4.
            unsafe {
                let p = acc_mem.as_mut_ptr().add(slot * 8);
                let acc = if FIRST {
                    _mm256_setzero_ps()
                } else {
                    _mm256_loadu_ps(p)
                };
                let scale = _mm256_mul_ps(d[slot], scale_x);
                _mm256_storeu_ps(p, _mm256_fmadd_ps(dot, scale, acc));
            }
        }
    }

    /// Turn slot-ordered accumulators kept in `out` (32 floats per row) into natural row order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpermute_rows(out: &mut [f32], m: usize, order: SlotOrder) {
        for row in out.chunks_exact_mut(TILE_ROWS).take(m) {
            // SAFETY: each chunk holds exactly 32 floats: 8 are read at 8·i for i < 4.
            let acc: [__m256; 4] =
                std::array::from_fn(|i| unsafe { _mm256_loadu_ps(row.as_ptr().add(8 * i)) });
            // SAFETY: AVX2 available (caller contract).
            unsafe { store_rows(acc, order, row) };
        }
    }

    // ---- software prefetch ---------------------------------------------------------------------------

    /// Bytes ahead of a weight stream that [`prefetch_ahead`] asks for: about the q4 tiles'
    /// distance (6 groups of 640 B). On EMR 2 KiB was slower and 8 KiB no faster.
    pub(in crate::kernels) const STREAM_AHEAD: usize = 4096;

    /// Prefetch the lines of `[p + STREAM_AHEAD, p + STREAM_AHEAD + bytes)`. A kernel that
    /// reads weight rows block after block (the GGUF block types, the plain types) calls it with
    /// each block it is about to read, so the stream's lines keep arriving a constant distance
    /// ahead of the loads; consecutive rows lie back to back, so the distance runs on into the
    /// next row. On a KVM guest the hardware prefetcher alone left single-row bf16 decode at
    /// three quarters of the memory limit (`docs/performance.md`, "GGUF block types").
    #[inline(always)]
    pub(in crate::kernels) fn prefetch_ahead(p: *const u8, bytes: usize) {
        let mut line = 0;
        while line < bytes {
            // SAFETY: a prefetch is only a hint and never faults, even past the end of the
            // matrix (hence `wrapping_add`, and no dereference).
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(STREAM_AHEAD + line) as *const i8)
            };
            line += 64;
        }
    }

    /// Groups to prefetch ahead: ~6 × 640 B covers DRAM latency at one core's M = 1 compute rate.
    const PREFETCH_AHEAD: usize = 6;

    /// Lines holding group `ahead` of this block (or, past its end, of the next block, which
    /// follows contiguously). The hardware prefetcher alone stalls on the tile layout: per group it
    /// reads three separate places in the tile, and the padding past K is skipped.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prefetch_group(
        block: &[u8],
        groups_total: usize,
        groups_per_tile: usize,
        tile_bytes: usize,
        lines: impl Fn(*const u8, usize) -> [(usize, usize); 3],
        ahead: usize,
    ) {
        let (base, gg) = if ahead < groups_total {
            (block.as_ptr(), ahead)
        } else {
            (
                block.as_ptr().wrapping_add(block.len()),
                ahead - groups_total,
            )
        };
        let (t, g) = tile_and_group(gg, groups_per_tile);
        let tile = base.wrapping_add(t * tile_bytes);
        for (offset, count) in lines(tile, g) {
            for line in 0..count {
                // A prefetch is only a hint: it never faults, even past the end of the matrix
                // (hence `wrapping_add`, and no dereference).
                _mm_prefetch::<_MM_HINT_T0>(tile.wrapping_add(offset + 64 * line) as *const i8);
            }
        }
    }

    /// `(tile, group in tile)` of a row block's group `gg`, without a division for the layouts
    /// the kernels meet (1 group per host record, 8 per 256-column tile): a 64-bit `div` per group
    /// showed in profiles of the multi-row kernels.
    #[inline(always)]
    pub(in crate::kernels) fn tile_and_group(gg: usize, groups_per_tile: usize) -> (usize, usize) {
        match groups_per_tile {
            1 => (gg, 0),
            8 => (gg >> 3, gg & 7),
            n => (gg / n, gg % n),
        }
    }

    /// (offset, lines) of a 4-bit group's scales, mins and codes.
    fn q4_group_lines(layout: Q4Layout, g: usize) -> [(usize, usize); 3] {
        let (scales, mins) = match layout.scales {
            Q4Scales::Q4K | Q4Scales::Q4KF16 => (g * 32, 256 + g * 32),
            _ => (g * 64, layout.mins + g * 64),
        };
        if layout.column_major {
            [(scales, 1), (mins, 1), (layout.codes + g * 512, 8)]
        } else {
            // Two planes of 4 lines; the second plane's lines take the mins slot's neighbour.
            [
                (scales, 1),
                (layout.codes + g * 256, 4),
                (layout.codes + 2048 + g * 256, 4),
            ]
        }
    }

    /// (offset, lines) of an 8-bit group's scales and codes.
    fn q8_group_lines(layout: Q8Layout, g: usize) -> [(usize, usize); 3] {
        if layout.column_major {
            [(g * 64, 1), (layout.codes + g * 1024, 16), (0, 0)]
        } else {
            [
                (g * 64, 1),
                (layout.codes + g * 512, 8),
                (layout.codes + layout.plane + g * 512, 8),
            ]
        }
    }

    /// Prefetch the lines of group `gg + PREFETCH_AHEAD` of a 4-bit row block (its scales, mins
    /// and codes; into the next block past the end).
    ///
    /// # Safety
    /// AVX2 available (a prefetch itself never faults).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::kernels) unsafe fn prefetch_q4_group(
        layout: Q4Layout,
        block: &[u8],
        groups_total: usize,
        gg: usize,
    ) {
        let ahead = gg + PREFETCH_AHEAD;
        let (per_tile, tile_bytes) = (layout.groups_per_tile, layout.tile_bytes);
        // SAFETY: AVX2 available (caller contract).
        unsafe {
            prefetch_group(
                block,
                groups_total,
                per_tile,
                tile_bytes,
                |_, g| q4_group_lines(layout, g),
                ahead,
            );
            if !layout.column_major {
                // The 16-row-lane order's mins live apart from its scales.
                prefetch_group(
                    block,
                    groups_total,
                    per_tile,
                    tile_bytes,
                    |_, g| [(layout.mins + g * 64, 1), (0, 0), (0, 0)],
                    ahead,
                );
            }
        }
    }

    /// Prefetch the fifth bits (128 bytes per group in the plane) of group `gg + PREFETCH_AHEAD` of
    /// a 5-bit K tile row block; nothing for the other code kinds. Apart from
    /// [`prefetch_q4_group`], which the q4 decode loop needs inlined.
    ///
    /// # Safety
    /// AVX2 available (a prefetch itself never faults).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prefetch_fifth_bits(layout: Q4Layout, block: &[u8], groups_total: usize, gg: usize) {
        if let Q4Codes::FifthBits(plane) = layout.codes_kind {
            // SAFETY: AVX2 available (caller contract).
            unsafe {
                prefetch_group(
                    block,
                    groups_total,
                    layout.groups_per_tile,
                    layout.tile_bytes,
                    |_, g| [(plane + g * 128, 2), (0, 0), (0, 0)],
                    gg + PREFETCH_AHEAD,
                )
            };
        }
    }

    /// Prefetch the lines of group `gg + PREFETCH_AHEAD` of an 8-bit row block.
    ///
    /// # Safety
    /// AVX2 available (a prefetch itself never faults).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::kernels) unsafe fn prefetch_q8_group(
        layout: Q8Layout,
        block: &[u8],
        groups_total: usize,
        gg: usize,
    ) {
        let per_tile = layout.tile_cols / GROUP;
        // SAFETY: AVX2 available (caller contract).
        unsafe {
            prefetch_group(
                block,
                groups_total,
                per_tile,
                layout.tile_bytes,
                |_, g| q8_group_lines(layout, g),
                gg + PREFETCH_AHEAD,
            )
        };
    }

    // ---- 4-bit block kernel -----------------------------------------------------------------------

    /// One group of a 4-bit block times every activation row in `rows`, accumulated into `out`
    /// (32 slot-ordered floats per row). The group's 32 unpacked weight vectors are unpacked once
    /// (by the caller) and stay in L1 while the rows stream past; per row, each of the 8 activation
    /// quads is broadcast once and feeds the 4 slot vectors (32 `maddubs` summed in four i16
    /// registers), then one widening and one FMA per slot: each broadcast serves four slots instead
    /// of one. The arithmetic is the single-row kernel's, operation for operation
    /// (an i16 sum is exact in any order, then the same `fma(dot, d · d_x, acc)` per group, in
    /// group order), so a row's bits do not depend on the rows batched with it.
    ///
    /// `FIRST` (group 0) overwrites the accumulators instead of adding to them.
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `rows` inside `act`; `gg < act.groups()`;
    /// `out.len() ≥ rows.len() * 32`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_group_rows<const FIRST: bool>(
        unpacked: &[[__m256i; 4]; 8],
        d: &[__m256; 4],
        act: &QuantizedRows,
        rows: std::ops::Range<usize>,
        gg: usize,
        out: &mut [f32],
    ) {
        debug_assert!(rows.end <= act.rows && out.len() >= rows.len() * TILE_ROWS);
        let groups_total = act.groups();
        // SAFETY: the closure gets only rows of `rows` (⊆ 0..act.rows, caller contract), and
        // gg < groups: the offset is that of the row's 32 codes of group gg, inside `act.codes`
        // (read 4 at a time at a, a + 4, …, a + 28).
        let codes = |row: usize| unsafe { act.codes.as_ptr().add(row * act.cols + gg * GROUP) };
        in_row_pairs(
            rows,
            // SAFETY: both rows are inside `act` (caller contract), so 32 codes each (above).
            |row| unsafe { maddubs_quads_2_rows(unpacked, [codes(row), codes(row + 1)]) },
            // SAFETY: the row is inside `act` (caller contract), so 32 codes (above).
            |row| unsafe { maddubs_quads_1_row(unpacked, codes(row)) },
            |i, row, sum16| {
                let scale_x = _mm256_set1_ps(act.scales[row * groups_total + gg]);
                // SAFETY: AVX2 available (caller contract); i < rows.len(), so the row's 32
                // floats are inside `out`.
                unsafe {
                    let dots = widen_i16_sums(sum16);
                    accumulate_row::<FIRST>(&mut out[i * TILE_ROWS..], dots, d, scale_x)
                };
            },
        );
    }

    /// The 8 quads × 4 slots of `maddubs` of one group for one activation row (an odd row count's
    /// last row): [`maddubs_quads_2_rows`]' sums for a single row, the same integers. A function
    /// with the target's features rather than a closure, so that the row loop's second call site
    /// (the odd row) cannot be left out of line as generic code: it was, and one row cost two to
    /// four pairs.
    ///
    /// # Safety
    /// AVX2 available; 32 readable activation codes at `a`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn maddubs_quads_1_row(unpacked: &[[__m256i; 4]; 8], a: *const i8) -> [__m256i; 4] {
        // SAFETY: 4 codes at a (caller contract).
        let x0 = unsafe { broadcast4(a) };
        let mut sum16 = [_mm256_setzero_si256(); 4];
        for (sum, w_slot) in sum16.iter_mut().zip(&unpacked[0]) {
            *sum = _mm256_maddubs_epi16(*w_slot, x0);
        }
        for (quad, w) in unpacked.iter().enumerate().skip(1) {
            // SAFETY: 4 codes at a + 4·quad (quad < 8; caller contract).
            let x4 = unsafe { broadcast4(a.add(quad * 4)) };
            for (sum, w_slot) in sum16.iter_mut().zip(w) {
                *sum = _mm256_add_epi16(*sum, _mm256_maddubs_epi16(*w_slot, x4));
            }
        }
        sum16
    }

    /// A row's four slot i16 sums widened to i32 (`madd` with ones) and converted to f32.
    ///
    /// # Safety
    /// AVX2 available.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_i16_sums(sum16: [__m256i; 4]) -> [__m256; 4] {
        let ones = _mm256_set1_epi16(1);
        let mut dots = [_mm256_setzero_ps(); 4];
        for (dot, sum) in dots.iter_mut().zip(sum16) {
            *dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
        }
        dots
    }

    /// Rows `rows` two at a time through `two` and an odd last one through `one`; `finish(i, row,
    /// sums)` then takes each row's sums, in row order (`i` counts from 0).
    #[inline(always)]
    fn in_row_pairs<S>(
        rows: std::ops::Range<usize>,
        two: impl Fn(usize) -> [S; 2],
        one: impl Fn(usize) -> S,
        mut finish: impl FnMut(usize, usize, S),
    ) {
        let mut i = 0;
        while i + 2 <= rows.len() {
            let [first, second] = two(rows.start + i);
            finish(i, rows.start + i, first);
            finish(i + 1, rows.start + i + 1, second);
            i += 2;
        }
        if i < rows.len() {
            finish(i, rows.start + i, one(rows.start + i));
        }
    }

    /// [`q4_group_rows`] for K tiles whose codes are not plain nibbles: `dots(a)` gives one
    /// activation row's four slot dot products over the group from its 32 codes at `a`
    /// ([`q5_group_dots`], [`iq4_group_dots`]), and the single-row kernel's `fma(dot, d · d_x,
    /// acc)` per group follows unchanged. Q5_K's codes reach 31, so a pair of `maddubs` products
    /// reaches 2·31·127 and each slot's i16 sum takes 4 quads (|Σ| ≤ 31496), the two halves of
    /// the group widened apart and added in i32 — the same integer as one sum.
    ///
    /// # Safety
    /// As [`q4_group_rows`]; `dots` may read 32 codes at the pointer it is given.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn coded_group_rows<const FIRST: bool>(
        dots: impl Fn(*const i8) -> [__m256; 4],
        d: &[__m256; 4],
        act: &QuantizedRows,
        rows: std::ops::Range<usize>,
        gg: usize,
        out: &mut [f32],
    ) {
        debug_assert!(rows.end <= act.rows && out.len() >= rows.len() * TILE_ROWS);
        let groups_total = act.groups();
        for (i, row) in rows.enumerate() {
            // SAFETY: row < act.rows and gg < groups (caller contract): the row's 32 codes of
            // group gg.
            let a = unsafe { act.codes.as_ptr().add(row * act.cols + gg * GROUP) };
            let dots = dots(a);
            let scale_x = _mm256_set1_ps(act.scales[row * groups_total + gg]);
            // SAFETY: i < rows.len(), so the row's 32 floats are inside `out`.
            unsafe { accumulate_row::<FIRST>(&mut out[i * TILE_ROWS..], dots, d, scale_x) };
        }
    }

    /// One activation row's four slot dot products (as f32) over a group of 5-bit codes: 32
    /// `maddubs` summed in i16 per half group, each half widened, the halves added in i32.
    ///
    /// # Safety
    /// AVX2 available; 32 readable activation codes at `a`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_group_dots(unpacked: &[[__m256i; 4]; 8], a: *const i8) -> [__m256; 4] {
        let ones = _mm256_set1_epi16(1);
        let mut halves = [[_mm256_setzero_si256(); 4]; 2];
        for (quad, w) in unpacked.iter().enumerate() {
            // SAFETY: 4 codes at a + 4·quad (quad < 8; caller contract).
            let x4 = unsafe { broadcast4(a.add(quad * 4)) };
            let half = &mut halves[quad / 4];
            for (sum, w_slot) in half.iter_mut().zip(w) {
                *sum = _mm256_add_epi16(*sum, _mm256_maddubs_epi16(*w_slot, x4));
            }
        }
        std::array::from_fn(|s| {
            let whole = _mm256_add_epi32(
                _mm256_madd_epi16(halves[0][s], ones),
                _mm256_madd_epi16(halves[1][s], ones),
            );
            _mm256_cvtepi32_ps(whole)
        })
    }

    /// The 8 quads × 4 slots of `maddubs` of one group for two activation rows, in assembly: each
    /// weight vector is loaded once and feeds both rows, and the 8 i16 sums, 2 broadcasts, the
    /// weight and 2 products fit the 16 AVX2 registers (13 used). The one-row intrinsics loop it
    /// replaces reloaded every weight vector per row; this one is ~5 % faster cache-resident on
    /// Zen 3 (docs/performance.md). i16 sums are exact (|Σ| ≤ 30480), so the order of the adds does
    /// not change them.
    ///
    /// # Safety
    /// AVX2 available; `rows[r]` points at 32 readable activation codes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn maddubs_quads_2_rows(
        unpacked: &[[__m256i; 4]; 8],
        rows: [*const i8; 2],
    ) -> [[__m256i; 4]; 2] {
        let (s00, s01, s02, s03): (__m256i, __m256i, __m256i, __m256i);
        let (s10, s11, s12, s13): (__m256i, __m256i, __m256i, __m256i);
        // SAFETY: the code reads 8 × 128 bytes from `unpacked` and 8 × 4 bytes from each row
        // pointer (caller contract); it writes only the named registers and flags.
        unsafe {
            std::arch::asm!(
                // Quad 0 starts the sums.
                "vpbroadcastd {x0}, dword ptr [{a0}]",
                "vpbroadcastd {x1}, dword ptr [{a1}]",
                "vmovdqu {w}, ymmword ptr [{wp}]",
                "vpmaddubsw {s00}, {w}, {x0}",
                "vpmaddubsw {s10}, {w}, {x1}",
                "vmovdqu {w}, ymmword ptr [{wp} + 32]",
                "vpmaddubsw {s01}, {w}, {x0}",
                "vpmaddubsw {s11}, {w}, {x1}",
                "vmovdqu {w}, ymmword ptr [{wp} + 64]",
                "vpmaddubsw {s02}, {w}, {x0}",
                "vpmaddubsw {s12}, {w}, {x1}",
                "vmovdqu {w}, ymmword ptr [{wp} + 96]",
                "vpmaddubsw {s03}, {w}, {x0}",
                "vpmaddubsw {s13}, {w}, {x1}",
                // Quads 1..8 add to them.
                "2:",
                "add {wp}, 128",
                "add {a0}, 4",
                "add {a1}, 4",
                "vpbroadcastd {x0}, dword ptr [{a0}]",
                "vpbroadcastd {x1}, dword ptr [{a1}]",
                "vmovdqu {w}, ymmword ptr [{wp}]",
                "vpmaddubsw {p0}, {w}, {x0}",
                "vpmaddubsw {p1}, {w}, {x1}",
                "vpaddw {s00}, {s00}, {p0}",
                "vpaddw {s10}, {s10}, {p1}",
                "vmovdqu {w}, ymmword ptr [{wp} + 32]",
                "vpmaddubsw {p0}, {w}, {x0}",
                "vpmaddubsw {p1}, {w}, {x1}",
                "vpaddw {s01}, {s01}, {p0}",
                "vpaddw {s11}, {s11}, {p1}",
                "vmovdqu {w}, ymmword ptr [{wp} + 64]",
                "vpmaddubsw {p0}, {w}, {x0}",
                "vpmaddubsw {p1}, {w}, {x1}",
                "vpaddw {s02}, {s02}, {p0}",
                "vpaddw {s12}, {s12}, {p1}",
                "vmovdqu {w}, ymmword ptr [{wp} + 96]",
                "vpmaddubsw {p0}, {w}, {x0}",
                "vpmaddubsw {p1}, {w}, {x1}",
                "vpaddw {s03}, {s03}, {p0}",
                "vpaddw {s13}, {s13}, {p1}",
                "dec {n:e}",
                "jnz 2b",
                wp = inout(reg) unpacked.as_ptr() => _,
                a0 = inout(reg) rows[0] => _,
                a1 = inout(reg) rows[1] => _,
                n = inout(reg) 7u32 => _,
                w = out(ymm_reg) _,
                x0 = out(ymm_reg) _,
                x1 = out(ymm_reg) _,
                p0 = out(ymm_reg) _,
                p1 = out(ymm_reg) _,
                s00 = out(ymm_reg) s00,
                s01 = out(ymm_reg) s01,
                s02 = out(ymm_reg) s02,
                s03 = out(ymm_reg) s03,
                s10 = out(ymm_reg) s10,
                s11 = out(ymm_reg) s11,
                s12 = out(ymm_reg) s12,
                s13 = out(ymm_reg) s13,
                options(nostack, readonly, pure),
            );
        }
        [[s00, s01, s02, s03], [s10, s11, s12, s13]]
    }

    /// [`q4_block`] for a single activation row (decode), with the nibble order fixed at compile
    /// time so the 8 column quads of a group unroll into straight-line code. Per group: 8 unpacks,
    /// 32 `maddubs` into four i16 sums, one widening and one FMA per 8 rows with the slot-ordered
    /// `d_w · d_x`. The q4_1 min term `Σ_g m_w[g] · (d_x Σq)[g]` does not depend on the codes, so
    /// it is a second, short pass over the (L1-resident) mins in natural row order: no per-group
    /// permute of the mins and four fewer live registers in the hot loop.
    ///
    /// # Safety
    /// As [`q4_block`] with `rows = row..row + 1`; `COLUMN_MAJOR == layout.column_major`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_block_one_row<const COLUMN_MAJOR: bool>(
        layout: Q4Layout,
        block: &[u8],
        act: &QuantizedRows,
        row: usize,
        out: &mut [f32],
    ) {
        let groups_total = act.groups();
        debug_assert!(row < act.rows && out.len() >= TILE_ROWS);
        debug_assert!(
            block.len() >= groups_total.div_ceil(layout.groups_per_tile) * layout.tile_bytes
        );
        debug_assert_eq!(COLUMN_MAJOR, layout.column_major);
        let ones = _mm256_set1_epi16(1);
        let scales = &act.scales[row * groups_total..(row + 1) * groups_total];
        let sums = &act.sums[row * groups_total..(row + 1) * groups_total];
        // SAFETY: row < act.rows, so the row's `cols` codes are readable.
        let a_row = unsafe { act.codes.as_ptr().add(row * act.cols) };
        let mut acc = [_mm256_setzero_ps(); 4];
        for (gg, &scale_x) in scales.iter().enumerate() {
            let (t, g) = tile_and_group(gg, layout.groups_per_tile);
            prefetch_q4_group(layout, block, groups_total, gg);
            // SAFETY: tile t exists (caller contract); all offsets are inside it.
            let tile = unsafe { block.as_ptr().add(t * layout.tile_bytes) };
            // SAFETY: `layout.codes` is the code area's offset inside the tile.
            let codes = unsafe { tile.add(layout.codes) };
            // SAFETY: gg < groups: 32 activation codes readable.
            let a = unsafe { a_row.add(gg * GROUP) };
            let mut sum16 = [_mm256_setzero_si256(); 4];
            for quad in 0..8 {
                // SAFETY: column g·32 + 4·quad + 3 < 256; the activation group has 32 codes.
                let (w, x4) = unsafe {
                    (
                        q4_unpack_quad(codes, COLUMN_MAJOR, g * 32 + quad * 4),
                        broadcast4(a.add(quad * 4)),
                    )
                };
                for i in 0..4 {
                    sum16[i] = _mm256_add_epi16(sum16[i], _mm256_maddubs_epi16(w[i], x4));
                }
            }
            // SAFETY: `tile` is a whole tile and g < layout.groups_per_tile (`tile_and_group`).
            let d = q4_slot_order(unsafe { q4_group_scales(layout, tile, g) }.0);
            let scale_x = _mm256_set1_ps(scale_x);
            for i in 0..4 {
                let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[i], ones));
                acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d[i], scale_x), acc[i]);
            }
        }
        store_rows(acc, SlotOrder::Q4, &mut out[..TILE_ROWS]);
        // SAFETY: as above.
        unsafe { q4_add_min_term(layout, block, sums, &mut out[..TILE_ROWS]) };
    }

    /// [`q5_group_dots`] of group `g` of a 5-bit K tile straight from the tile: each quad is
    /// unpacked, given its fifth bits (read from the plane as the `and`'s memory operand) and
    /// multiplied at once, so no unpacked group is stored — a single row is bound by these
    /// instructions, not by the multiplies. The same integers, so the same floats.
    ///
    /// # Safety
    /// AVX2 available; `tile` is a whole column-major K tile of `layout` with a fifth-bit plane,
    /// `g < 8`; 32 readable activation codes at `a`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_group_dots_one_row(
        layout: Q4Layout,
        tile: *const u8,
        g: usize,
        a: *const i8,
    ) -> [__m256; 4] {
        let ones = _mm256_set1_epi16(1);
        let mut whole = [_mm256_setzero_si256(); 4];
        // SAFETY: the code area, the plane's group g and the 32 codes at `a` are readable
        // (caller contract).
        unsafe {
            let codes = tile.add(layout.codes);
            let plane = tile.add(fifth_bit_plane(layout) + g * 128);
            let mut sums = [_mm256_setzero_si256(); 4];
            macro_rules! quad {
                ($q:literal) => {
                    let w = q4_unpack_quad(codes, true, g * GROUP + $q * 4);
                    let x4 = broadcast4(a.add($q * 4));
                    for (s, (sum, w)) in sums.iter_mut().zip(w).enumerate() {
                        let bits = _mm256_loadu_si256(plane.add(32 * s) as *const __m256i);
                        let w = add_fifth_bits::<$q>(w, bits);
                        *sum = _mm256_add_epi16(*sum, _mm256_maddubs_epi16(w, x4));
                    }
                };
            }
            // Four quads per i16 sum, then widened: two halves.
            quad!(0);
            quad!(1);
            quad!(2);
            quad!(3);
            for (whole, sum) in whole.iter_mut().zip(&mut sums) {
                *whole = _mm256_madd_epi16(*sum, ones);
                *sum = _mm256_setzero_si256();
            }
            quad!(4);
            quad!(5);
            quad!(6);
            quad!(7);
            for (whole, sum) in whole.iter_mut().zip(sums) {
                *whole = _mm256_add_epi32(*whole, _mm256_madd_epi16(sum, ones));
            }
        }
        whole.map(|w| _mm256_cvtepi32_ps(w))
    }

    /// `IQ4_TABLE[n] + 128 = 16·IQ4_SPLIT.0[n] + IQ4_SPLIT.1[n]`: the two 4-bit planes of an
    /// IQ4 value made unsigned, so each plane's `maddubs` sums stay within i16 over a group.
    const IQ4_SPLIT: ([u8; 16], [u8; 16]) = {
        let (mut high, mut low) = ([0u8; 16], [0u8; 16]);
        let mut n = 0;
        while n < 16 {
            let v = (crate::ggml::IQ4_TABLE[n] as i16 + 128) as u8;
            high[n] = v >> 4;
            low[n] = v & 0x0F;
            n += 1;
        }
        (high, low)
    };

    /// [`IQ4_SPLIT`]'s two tables in both lanes of a register, for `vpshufb`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::kernels) unsafe fn iq4_split_tables() -> (__m256i, __m256i) {
        // SAFETY: each table is 16 readable bytes.
        unsafe {
            (
                _mm256_broadcastsi128_si256(
                    _mm_loadu_si128(IQ4_SPLIT.0.as_ptr() as *const __m128i),
                ),
                _mm256_broadcastsi128_si256(
                    _mm_loadu_si128(IQ4_SPLIT.1.as_ptr() as *const __m128i),
                ),
            )
        }
    }

    /// Group `g` of an IQ4_XS K tile (`Q4Codes::Iq4Table`) as the [`q4_unpack_group`] vectors of
    /// its two planes: `[high, low]`, each code ≤ 15.
    ///
    /// # Safety
    /// AVX2 available; `tile` is a whole column-major K tile of `layout`, `g < 8`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4_unpack_group(
        layout: Q4Layout,
        tile: *const u8,
        g: usize,
    ) -> [[[__m256i; 4]; 8]; 2] {
        // SAFETY: the code area's group g lies inside the tile (caller contract).
        let index = unsafe { q4_unpack_group(tile.add(layout.codes), true, g) };
        // SAFETY: AVX2 available (caller contract).
        let (high, low) = unsafe { iq4_split_tables() };
        // Loops, not `map` closures: those were left out of line as calls per quad.
        let mut planes = [[[_mm256_setzero_si256(); 4]; 8]; 2];
        for (table, plane) in [high, low].into_iter().zip(&mut planes) {
            for (quad, indices) in plane.iter_mut().zip(&index) {
                for (value, &n) in quad.iter_mut().zip(indices) {
                    *value = _mm256_shuffle_epi8(table, n);
                }
            }
        }
        planes
    }

    /// One activation row's four slot dot products (as f32) over a group of IQ4 values plus 128:
    /// each plane's 32 `maddubs` summed in i16 (|Σ| ≤ 8·2·15·127), widened with weights 16 and 1
    /// and added in i32.
    ///
    /// # Safety
    /// AVX2 available; 32 readable activation codes at `a`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4_group_dots(planes: &[[[__m256i; 4]; 8]; 2], a: *const i8) -> [__m256; 4] {
        let mut high = [_mm256_setzero_si256(); 4];
        let mut low = [_mm256_setzero_si256(); 4];
        for (quad, (h, l)) in planes[0].iter().zip(&planes[1]).enumerate() {
            // SAFETY: 4 codes at a + 4·quad (quad < 8; caller contract).
            let x4 = unsafe { broadcast4(a.add(quad * 4)) };
            for s in 0..4 {
                high[s] = _mm256_add_epi16(high[s], _mm256_maddubs_epi16(h[s], x4));
                low[s] = _mm256_add_epi16(low[s], _mm256_maddubs_epi16(l[s], x4));
            }
        }
        iq4_widen(high, low)
    }

    /// `16·high + low` per row lane, widened to i32 and converted.
    #[inline(always)]
    fn iq4_widen(high: [__m256i; 4], low: [__m256i; 4]) -> [__m256; 4] {
        // SAFETY: these intrinsics operate on registers only, and AVX2 is enabled in every caller
        // (`target_feature`).
        unsafe {
            let (sixteen, ones) = (_mm256_set1_epi16(16), _mm256_set1_epi16(1));
            std::array::from_fn(|s| {
                _mm256_cvtepi32_ps(_mm256_add_epi32(
                    _mm256_madd_epi16(high[s], sixteen),
                    _mm256_madd_epi16(low[s], ones),
                ))
            })
        }
    }

    /// [`iq4_group_dots`] of group `g` of an IQ4_XS K tile straight from the tile, quad by quad
    /// (no unpacked group stored): the same integers, so the same floats.
    ///
    /// # Safety
    /// AVX2 available; `tile` is a whole column-major K tile of `layout`, `g < 8`; 32 readable
    /// activation codes at `a`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4_group_dots_one_row(
        layout: Q4Layout,
        tile: *const u8,
        g: usize,
        a: *const i8,
    ) -> [__m256; 4] {
        let mut high = [_mm256_setzero_si256(); 4];
        let mut low = [_mm256_setzero_si256(); 4];
        // SAFETY: the code area's group g and the 32 codes at `a` are readable (caller contract).
        unsafe {
            let (high_table, low_table) = iq4_split_tables();
            let codes = tile.add(layout.codes);
            for quad in 0..8 {
                let index = q4_unpack_quad(codes, true, g * GROUP + quad * 4);
                let x4 = broadcast4(a.add(quad * 4));
                for (s, n) in index.into_iter().enumerate() {
                    let h = _mm256_shuffle_epi8(high_table, n);
                    let l = _mm256_shuffle_epi8(low_table, n);
                    high[s] = _mm256_add_epi16(high[s], _mm256_maddubs_epi16(h, x4));
                    low[s] = _mm256_add_epi16(low[s], _mm256_maddubs_epi16(l, x4));
                }
            }
        }
        iq4_widen(high, low)
    }

    /// [`q4_block`] for a single activation row of a K tile matrix whose codes are not plain
    /// nibbles (`Q4Codes::FifthBits`, `Q4Codes::Iq4Table`): per group the row's dot products
    /// straight from the tile ([`q5_group_dots_one_row`], [`iq4_group_dots_one_row`]: the integers
    /// of the multi-row kernels), the multi-row kernel's `fma(dot, d · d_x, acc)` in registers
    /// from zero, then the min term as [`q4_block_one_row`] adds it: a row's bits do not depend
    /// on the rows batched with it.
    ///
    /// # Safety
    /// As [`q4_block`] with `rows = row..row + 1`; `layout` is a column-major K tile layout.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn coded_block_one_row(
        layout: Q4Layout,
        block: &[u8],
        act: &QuantizedRows,
        row: usize,
        out: &mut [f32],
    ) {
        let groups_total = act.groups();
        debug_assert!(row < act.rows && out.len() >= TILE_ROWS);
        debug_assert!(
            block.len() >= groups_total.div_ceil(layout.groups_per_tile) * layout.tile_bytes
        );
        let scales = &act.scales[row * groups_total..(row + 1) * groups_total];
        let sums = &act.sums[row * groups_total..(row + 1) * groups_total];
        // SAFETY: row < act.rows, so the row's `cols` codes are readable.
        let a_row = unsafe { act.codes.as_ptr().add(row * act.cols) };
        let mut acc = [_mm256_setzero_ps(); 4];
        for (gg, &scale_x) in scales.iter().enumerate() {
            let (t, g) = tile_and_group(gg, layout.groups_per_tile);
            prefetch_q4_group(layout, block, groups_total, gg);
            prefetch_fifth_bits(layout, block, groups_total, gg);
            // SAFETY: tile t exists (caller contract), a whole K tile of `layout`; g < 8; the
            // activation group gg has 32 codes.
            let (dots, d) = unsafe {
                let tile = block.as_ptr().add(t * layout.tile_bytes);
                let a = a_row.add(gg * GROUP);
                let dots = match layout.codes_kind {
                    Q4Codes::Iq4Table => iq4_group_dots_one_row(layout, tile, g, a),
                    _ => q5_group_dots_one_row(layout, tile, g, a),
                };
                (dots, q4_slot_order(group_scales(layout, tile, g).0))
            };
            let scale_x = _mm256_set1_ps(scale_x);
            for i in 0..4 {
                acc[i] = _mm256_fmadd_ps(dots[i], _mm256_mul_ps(d[i], scale_x), acc[i]);
            }
        }
        store_rows(acc, SlotOrder::Q4, &mut out[..TILE_ROWS]);
        // SAFETY: as above.
        unsafe { q4_add_min_term(layout, block, sums, &mut out[..TILE_ROWS]) };
    }

    /// `out[r] += Σ_g m_w[g, r] · sums[g]` for the 32 rows of a block (natural order): the q4_1 min
    /// term, kept apart from the code dot products. The single-row and multi-row kernels both add it
    /// last and in the same order, so a row's result does not depend on how many rows were batched
    /// with it (the model's batched = sequential guarantee rests on that).
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `block` holds `sums.len().div_ceil(layout.groups_per_tile)` tiles of `layout.tile_bytes`;
    /// `out.len() ≥ 32`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_add_min_term(layout: Q4Layout, block: &[u8], sums: &[f32], out: &mut [f32]) {
        debug_assert!(
            block.len() >= sums.len().div_ceil(layout.groups_per_tile) * layout.tile_bytes
        );
        debug_assert!(out.len() >= TILE_ROWS);
        let mut mins_acc = [_mm256_setzero_ps(); 4];
        for (gg, &sum_x) in sums.iter().enumerate() {
            let (t, g) = tile_and_group(gg, layout.groups_per_tile);
            // SAFETY: tile t exists (caller contract); its min area holds group g.
            let tile = unsafe { block.as_ptr().add(t * layout.tile_bytes) };
            // SAFETY: `tile` is a whole tile and g < layout.groups_per_tile (`tile_and_group`).
            let mins = unsafe { group_scales(layout, tile, g) }.1;
            let sum_x = _mm256_set1_ps(sum_x);
            for i in 0..4 {
                mins_acc[i] = _mm256_fmadd_ps(mins[i], sum_x, mins_acc[i]);
            }
        }
        for (i, m) in mins_acc.iter().enumerate() {
            // SAFETY: out holds ≥ 32 floats; 8 are read and written at 8·i for i < 4.
            unsafe {
                let p = out.as_mut_ptr().add(8 * i);
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), *m));
            }
        }
    }

    /// [`q4_add_min_term`] for several activation rows. Each group's mins are converted once per
    /// 16 rows into a stack buffer of f32 vectors (up to 24 groups at a time), and every row then
    /// runs its FMAs over that buffer with its accumulators in registers. Per row the FMAs run in
    /// the same order from zero and the total is added to `out` last, so the bits equal the
    /// single-row kernel's.
    ///
    /// # Safety
    /// As [`q4_block`] (`out` holds `rows.len() × 32` natural-order floats).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_add_min_terms(
        layout: Q4Layout,
        block: &[u8],
        act: &QuantizedRows,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        const ROW_CHUNK: usize = 16;
        // 24 groups of converted mins (3 KiB) cover K = 576 in one chunk.
        const GROUP_CHUNK: usize = 24;
        let groups_total = act.groups();
        debug_assert!(rows.end <= act.rows && out.len() >= rows.len() * TILE_ROWS);
        debug_assert!(
            block.len() >= groups_total.div_ceil(layout.groups_per_tile) * layout.tile_bytes
        );
        if groups_total == 0 {
            return; // K = 0: no min term.
        }
        let first = rows.start;
        // Scratch left uninitialized: every entry is written before it is read, and zeroing 5 KiB
        // per block call was a measurable memset in 16-row decode passes.
        let mut mins = [MaybeUninit::<[__m256; 4]>::uninit(); GROUP_CHUNK];
        let mut row_start = rows.start;
        while row_start < rows.end {
            let row_chunk = row_start..(row_start + ROW_CHUNK).min(rows.end);
            let mut mins_acc = [MaybeUninit::<[__m256; 4]>::uninit(); ROW_CHUNK];
            let mut g0 = 0;
            while g0 < groups_total {
                let g1 = (g0 + GROUP_CHUNK).min(groups_total);
                for (gg, slot) in (g0..g1).zip(mins.iter_mut()) {
                    let (t, g) = tile_and_group(gg, layout.groups_per_tile);
                    // SAFETY: tile t exists (caller contract); its min area holds group g.
                    let tile = unsafe { block.as_ptr().add(t * layout.tile_bytes) };
                    // SAFETY: `tile` is a whole tile and g < layout.groups_per_tile (`tile_and_group`).
                    slot.write(unsafe { group_scales(layout, tile, g) }.1);
                }
                // SAFETY: entries 0..g1 - g0 were written just above; MaybeUninit<T> has T's layout.
                let mins: &[[__m256; 4]] = unsafe {
                    &*(&mins[..g1 - g0] as *const [MaybeUninit<[__m256; 4]>] as *const _)
                };
                // Two rows at a time: eight independent FMA chains hide the FMA latency.
                let rows_here = row_chunk.len();
                for pair in (0..rows_here).step_by(2) {
                    let second = (pair + 1).min(rows_here - 1);
                    let (row_a, row_b) = (row_chunk.start + pair, row_chunk.start + second);
                    let (mut acc_a, mut acc_b) = if g0 == 0 {
                        ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4])
                    } else {
                        // SAFETY: the pass over the first group chunk wrote both rows' entries.
                        unsafe { (mins_acc[pair].assume_init(), mins_acc[second].assume_init()) }
                    };
                    let sums_a = &act.sums[row_a * groups_total + g0..row_a * groups_total + g1];
                    let sums_b = &act.sums[row_b * groups_total + g0..row_b * groups_total + g1];
                    for ((m, &sum_a), &sum_b) in mins.iter().zip(sums_a).zip(sums_b) {
                        let (sum_a, sum_b) = (_mm256_set1_ps(sum_a), _mm256_set1_ps(sum_b));
                        for i in 0..4 {
                            acc_a[i] = _mm256_fmadd_ps(m[i], sum_a, acc_a[i]);
                            acc_b[i] = _mm256_fmadd_ps(m[i], sum_b, acc_b[i]);
                        }
                    }
                    // With an odd row count the last "pair" is one row computed twice.
                    mins_acc[pair].write(acc_a);
                    mins_acc[second].write(acc_b);
                }
                g0 = g1;
            }
            for (acc, row) in mins_acc.iter().zip(row_chunk.clone()) {
                // SAFETY: groups_total > 0, so the first group chunk wrote every row's entry.
                let acc = unsafe { acc.assume_init_ref() };
                for (i, m) in acc.iter().enumerate() {
                    // SAFETY: row - first < rows.len(): 32 floats of `out` belong to it; 8 are
                    // read and written at 8·i for i < 4.
                    unsafe {
                        let p = out.as_mut_ptr().add((row - first) * TILE_ROWS + 8 * i);
                        _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), *m));
                    }
                }
            }
            row_start = row_chunk.end;
        }
    }

    /// One 32-row block of a 4-bit tiled matrix times activation rows `rows` of `act`:
    /// `out[(i - rows.start) * 32 + r]` for every activation row i. `block` is the row block's tiles
    /// (`ceil(K / 256)` of them); only groups holding real columns (< `act.cols`) are read. `dot`
    /// picks the multi-row loop's instructions (a single row always takes the AVX2 kernel: it is
    /// bound by memory, not by the multiplies).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C (`available()`), and AVX-512 VNNI
    /// (`vnni_available()`) when `dot` is [`IntDot::Vnni`]; `block` must hold
    /// `act.cols.div_ceil(256)` tiles of `layout.tile_bytes`, `rows` must be inside `act`, and
    /// `out.len() ≥ rows.len() * 32`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q4_block(
        layout: Q4Layout,
        block: &[u8],
        act: &QuantizedRows,
        rows: std::ops::Range<usize>,
        dot: IntDot,
        out: &mut [f32],
    ) {
        let groups_total = act.groups();
        let m = rows.len();
        debug_assert!(rows.end <= act.rows && out.len() >= m * TILE_ROWS);
        debug_assert!(
            block.len() >= groups_total.div_ceil(layout.groups_per_tile) * layout.tile_bytes
        );
        if m == 1 {
            // SAFETY: the caller's contract is this function's.
            unsafe {
                if layout.codes_kind != Q4Codes::Nibbles {
                    coded_block_one_row(layout, block, act, rows.start, out)
                } else if layout.column_major {
                    q4_block_one_row::<true>(layout, block, act, rows.start, out)
                } else {
                    q4_block_one_row::<false>(layout, block, act, rows.start, out)
                }
            }
            return;
        }
        // The 512-bit kernels take 4-bit codes only; 5-bit K tiles run below on any CPU.
        if dot == IntDot::Vnni && layout.codes_kind == Q4Codes::Nibbles {
            // SAFETY: the caller's contract, and `IntDot::Vnni` means `vnni_available()`.
            unsafe { crate::kernels::avx512::q4_rows(layout, block, act, rows, out) };
            return;
        }
        if groups_total == 0 {
            // K = 0: nothing overwrites the accumulators below.
            out[..m * TILE_ROWS].fill(0.0);
        }
        for gg in 0..groups_total {
            let (t, g) = tile_and_group(gg, layout.groups_per_tile);
            prefetch_q4_group(layout, block, groups_total, gg);
            // SAFETY: tile t exists (caller contract); all offsets are inside it.
            let tile = unsafe { block.as_ptr().add(t * layout.tile_bytes) };
            // SAFETY: `layout.codes` is the code area's offset inside the tile.
            let codes = unsafe { tile.add(layout.codes) };
            // SAFETY: `tile` is a whole tile and g < layout.groups_per_tile (`tile_and_group`).
            let d = q4_slot_order(unsafe { group_scales(layout, tile, g) }.0);
            match layout.codes_kind {
                Q4Codes::Nibbles => {}
                Q4Codes::FifthBits(_) => {
                    // SAFETY: a whole K tile of `layout`, g < 8; the closure gets the 32 codes of
                    // a row of `rows` (⊂ 0..act.rows) in group gg; `out` holds m × 32 floats.
                    unsafe {
                        prefetch_fifth_bits(layout, block, groups_total, gg);
                        let unpacked = q5_unpack_group(layout, tile, g);
                        let dots = |a| q5_group_dots(&unpacked, a);
                        if gg == 0 {
                            coded_group_rows::<true>(dots, &d, act, rows.clone(), gg, out)
                        } else {
                            coded_group_rows::<false>(dots, &d, act, rows.clone(), gg, out)
                        }
                    }
                    continue;
                }
                Q4Codes::Iq4Table => {
                    // SAFETY: as above.
                    unsafe {
                        let planes = iq4_unpack_group(layout, tile, g);
                        let dots = |a| iq4_group_dots(&planes, a);
                        if gg == 0 {
                            coded_group_rows::<true>(dots, &d, act, rows.clone(), gg, out)
                        } else {
                            coded_group_rows::<false>(dots, &d, act, rows.clone(), gg, out)
                        }
                    }
                    continue;
                }
            }
            // SAFETY: columns g·32 .. g·32 + 32 lie inside the tile.
            let unpacked = unsafe { q4_unpack_group(codes, layout.column_major, g) };
            // SAFETY: rows ⊂ 0..act.rows and gg < groups (caller contract); `out` holds m × 32
            // floats.
            unsafe {
                if gg == 0 {
                    q4_group_rows::<true>(&unpacked, &d, act, rows.clone(), gg, out)
                } else {
                    q4_group_rows::<false>(&unpacked, &d, act, rows.clone(), gg, out)
                }
            };
        }
        // SAFETY: AVX2 available; `out` holds m × 32 floats.
        unsafe { unpermute_rows(out, m, SlotOrder::Q4) };
        // SAFETY: the caller's contract; out holds m × 32 floats.
        unsafe { q4_add_min_terms(layout, block, act, rows, out) };
    }

    // ---- 8-bit block kernel -----------------------------------------------------------------------

    /// Natural-order scale vectors of group `g` of an 8-bit tile.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::kernels) unsafe fn q8_group_scales(
        f16_scales: bool,
        tile: *const u8,
        g: usize,
    ) -> [__m256; 4] {
        // SAFETY: the scale area is [0, 512); g < 8 so g·64 + 64 ≤ 512.
        unsafe {
            let p = tile.add(g * 64);
            if f16_scales {
                [
                    f16x8(p),
                    f16x8(p.add(16)),
                    f16x8(p.add(32)),
                    f16x8(p.add(48)),
                ]
            } else {
                [
                    bf16x8(p),
                    bf16x8(p.add(16)),
                    bf16x8(p.add(32)),
                    bf16x8(p.add(48)),
                ]
            }
        }
    }

    /// Σ over one quad of w·x for the four slot vectors, added to `sum32` (sign trick).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_quad_dot(
        w: &[__m256i; 4],
        magnitude: &[__m256i; 4],
        x4: __m256i,
        sum32: &mut [__m256i; 4],
    ) {
        let ones = _mm256_set1_epi16(1);
        for i in 0..4 {
            // |w| · (x with w's sign) = w · x; a pair sum ≤ 2·128·127 fits i16.
            let signed_x = _mm256_sign_epi8(x4, w[i]);
            let pairs = _mm256_maddubs_epi16(magnitude[i], signed_x);
            sum32[i] = _mm256_add_epi32(sum32[i], _mm256_madd_epi16(pairs, ones));
        }
    }

    /// The 8-bit counterpart of [`q4_group_rows`], with ggml's sign trick per (row, quad, slot)
    /// and the dot products widened to i32 per quad (two q8 pair sums can overflow i16): the
    /// single-row kernel's arithmetic, in its order.
    ///
    /// # Safety
    /// As [`q4_group_rows`]; `unpacked[quad]` is `[codes, magnitudes]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_group_rows<const FIRST: bool>(
        unpacked: &[[[__m256i; 4]; 2]; 8],
        d: &[__m256; 4],
        act: &QuantizedRows,
        rows: std::ops::Range<usize>,
        gg: usize,
        out: &mut [f32],
    ) {
        debug_assert!(rows.end <= act.rows && out.len() >= rows.len() * TILE_ROWS);
        let groups_total = act.groups();
        // SAFETY: the closure gets only rows of `rows` (⊆ 0..act.rows, caller contract), and
        // gg < groups: the offset is that of the row's 32 codes of group gg, inside `act.codes`.
        let codes = |row: usize| unsafe { act.codes.as_ptr().add(row * act.cols + gg * GROUP) };
        in_row_pairs(
            rows,
            // SAFETY: both rows are inside `act` (caller contract), so 32 codes each (above).
            |row| unsafe { q8_sign_quads_2_rows(unpacked, [codes(row), codes(row + 1)]) },
            |row| {
                let a = codes(row);
                let mut sum32 = [_mm256_setzero_si256(); 4];
                for (quad, [w, magnitude]) in unpacked.iter().enumerate() {
                    // SAFETY: 4 codes at a + 4·quad (quad < 8).
                    let x4 = unsafe { broadcast4(a.add(quad * 4)) };
                    // SAFETY: AVX2 available (caller contract).
                    unsafe { q8_quad_dot(w, magnitude, x4, &mut sum32) };
                }
                sum32
            },
            |i, row, sum32| {
                let scale_x = _mm256_set1_ps(act.scales[row * groups_total + gg]);
                // A loop, not a `map` closure, which the odd row's call site may leave out of
                // line (`q4_group_rows`).
                let mut dots = [_mm256_setzero_ps(); 4];
                for (dot, sum) in dots.iter_mut().zip(sum32) {
                    *dot = _mm256_cvtepi32_ps(sum);
                }
                // SAFETY: i < rows.len(), so the row's 32 floats are inside `out`.
                unsafe { accumulate_row::<FIRST>(&mut out[i * TILE_ROWS..], dots, d, scale_x) };
            },
        );
    }

    /// [`q8_quad_dot`] over a group's 8 quads for two activation rows, in assembly: each code and
    /// magnitude vector is loaded once and feeds both rows (8 i32 sums, 2 broadcasts, the ones, a
    /// code, a magnitude and 2 temporaries: 15 of the 16 AVX2 registers). Sums are exact i32, as
    /// in [`q8_quad_dot`], so the bits are its bits.
    ///
    /// # Safety
    /// AVX2 available; `rows[r]` points at 32 readable activation codes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_sign_quads_2_rows(
        unpacked: &[[[__m256i; 4]; 2]; 8],
        rows: [*const i8; 2],
    ) -> [[__m256i; 4]; 2] {
        let (s00, s01, s02, s03): (__m256i, __m256i, __m256i, __m256i);
        let (s10, s11, s12, s13): (__m256i, __m256i, __m256i, __m256i);
        // One slot of one quad: sign the rows' activations by the codes, multiply by the codes'
        // magnitudes, widen to i32 and add.
        macro_rules! slot {
            ($offset:literal, $s0:literal, $s1:literal) => {
                concat!(
                    "vmovdqu {w}, ymmword ptr [{wp} + ",
                    $offset,
                    "]\n",
                    "vmovdqu {mg}, ymmword ptr [{wp} + 128 + ",
                    $offset,
                    "]\n",
                    "vpsignb {t0}, {x0}, {w}\n",
                    "vpsignb {t1}, {x1}, {w}\n",
                    "vpmaddubsw {t0}, {mg}, {t0}\n",
                    "vpmaddubsw {t1}, {mg}, {t1}\n",
                    "vpmaddwd {t0}, {t0}, {ones}\n",
                    "vpmaddwd {t1}, {t1}, {ones}\n",
                    "vpaddd {",
                    $s0,
                    "}, {",
                    $s0,
                    "}, {t0}\n",
                    "vpaddd {",
                    $s1,
                    "}, {",
                    $s1,
                    "}, {t1}\n",
                )
            };
        }
        // SAFETY: the code reads 8 × 256 bytes from `unpacked` and 8 × 4 bytes from each row
        // pointer (caller contract); it writes only the named registers and flags.
        unsafe {
            std::arch::asm!(
                "vpxor {s00:x}, {s00:x}, {s00:x}",
                "vpxor {s01:x}, {s01:x}, {s01:x}",
                "vpxor {s02:x}, {s02:x}, {s02:x}",
                "vpxor {s03:x}, {s03:x}, {s03:x}",
                "vpxor {s10:x}, {s10:x}, {s10:x}",
                "vpxor {s11:x}, {s11:x}, {s11:x}",
                "vpxor {s12:x}, {s12:x}, {s12:x}",
                "vpxor {s13:x}, {s13:x}, {s13:x}",
                "2:",
                "vpbroadcastd {x0}, dword ptr [{a0}]",
                "vpbroadcastd {x1}, dword ptr [{a1}]",
                slot!("0", "s00", "s10"),
                slot!("32", "s01", "s11"),
                slot!("64", "s02", "s12"),
                slot!("96", "s03", "s13"),
                "add {wp}, 256",
                "add {a0}, 4",
                "add {a1}, 4",
                "dec {n:e}",
                "jnz 2b",
                wp = inout(reg) unpacked.as_ptr() => _,
                a0 = inout(reg) rows[0] => _,
                a1 = inout(reg) rows[1] => _,
                n = inout(reg) 8u32 => _,
                ones = in(ymm_reg) _mm256_set1_epi16(1),
                w = out(ymm_reg) _,
                mg = out(ymm_reg) _,
                x0 = out(ymm_reg) _,
                x1 = out(ymm_reg) _,
                t0 = out(ymm_reg) _,
                t1 = out(ymm_reg) _,
                s00 = out(ymm_reg) s00,
                s01 = out(ymm_reg) s01,
                s02 = out(ymm_reg) s02,
                s03 = out(ymm_reg) s03,
                s10 = out(ymm_reg) s10,
                s11 = out(ymm_reg) s11,
                s12 = out(ymm_reg) s12,
                s13 = out(ymm_reg) s13,
                options(nostack, readonly, pure),
            );
        }
        [[s00, s01, s02, s03], [s10, s11, s12, s13]]
    }

    /// One 32-row block of an 8-bit tiled matrix; same contract as [`q4_block`].
    ///
    /// # Safety
    /// As [`q4_block`], with `act.cols.div_ceil(layout.tile_cols)` tiles in `block`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q8_block(
        layout: Q8Layout,
        block: &[u8],
        act: &QuantizedRows,
        rows: std::ops::Range<usize>,
        dot: IntDot,
        out: &mut [f32],
    ) {
        let groups_total = act.groups();
        let groups_per_tile = layout.tile_cols / GROUP;
        let m = rows.len();
        debug_assert!(rows.end <= act.rows && out.len() >= m * TILE_ROWS);
        debug_assert!(block.len() >= groups_total.div_ceil(groups_per_tile) * layout.tile_bytes);
        if m > 1 && dot == IntDot::Vnni {
            // SAFETY: the caller's contract, and `IntDot::Vnni` means `vnni_available()`.
            unsafe { crate::kernels::avx512::q8_rows(layout, block, act, rows, out) };
            return;
        }
        let mut acc1 = [_mm256_setzero_ps(); 4];
        if m > 1 && groups_total == 0 {
            // K = 0: nothing overwrites the accumulators below.
            out[..m * TILE_ROWS].fill(0.0);
        }
        for gg in 0..groups_total {
            let (t, g) = tile_and_group(gg, groups_per_tile);
            prefetch_q8_group(layout, block, groups_total, gg);
            // SAFETY: tile t exists (caller contract); all offsets are inside it.
            let tile = unsafe { block.as_ptr().add(t * layout.tile_bytes) };
            // SAFETY: `layout.codes` is the code area's offset inside the tile.
            let codes = unsafe { tile.add(layout.codes) };
            // SAFETY: `tile` is a whole tile and g < groups_per_tile ≤ 8, inside its scale area.
            let d = q8_slot_order(unsafe { q8_group_scales(layout.f16_scales, tile, g) });
            if m == 1 {
                let row = rows.start;
                // SAFETY: row < act.rows and gg < groups: 32 codes readable.
                let a = unsafe { act.codes.as_ptr().add(row * act.cols + gg * GROUP) };
                let mut sum32 = [_mm256_setzero_si256(); 4];
                for quad in 0..8 {
                    // SAFETY: column g·32 + 4·quad + 3 < tile_cols.
                    let w = unsafe { q8_unpack_quad(codes, layout, g * 32 + quad * 4) };
                    let magnitude = w.map(|v| _mm256_sign_epi8(v, v));
                    // SAFETY: quad < 8, so the 4 codes at a + 4·quad lie inside the group's 32 (above).
                    let x4 = unsafe { broadcast4(a.add(quad * 4)) };
                    q8_quad_dot(&w, &magnitude, x4, &mut sum32);
                }
                let scale_a = _mm256_set1_ps(act.scales[row * groups_total + gg]);
                for i in 0..4 {
                    let dot = _mm256_cvtepi32_ps(sum32[i]);
                    acc1[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d[i], scale_a), acc1[i]);
                }
                continue;
            }
            // Per quad: the codes (for the sign) and their magnitudes (the unsigned maddubs operand).
            // SAFETY: columns g·32 .. g·32 + 32 < tile_cols.
            let unpacked = unsafe { q8_unpack_group(codes, layout, g) };
            // SAFETY: as for the 4-bit kernel.
            unsafe {
                if gg == 0 {
                    q8_group_rows::<true>(&unpacked, &d, act, rows.clone(), gg, out)
                } else {
                    q8_group_rows::<false>(&unpacked, &d, act, rows.clone(), gg, out)
                }
            };
        }
        if m == 1 {
            store_rows(acc1, SlotOrder::Q8, &mut out[..TILE_ROWS]);
        } else {
            // SAFETY: AVX2 available; `out` holds m × 32 floats.
            unsafe { unpermute_rows(out, m, SlotOrder::Q8) };
        }
    }

    /// Copy the 32-float result rows of one block (`src`, contiguous) to rows `stride` floats apart
    /// at `dst`, in 256-bit moves. The portable copy compiles to 128-bit moves, and reading back
    /// the halves of the kernels' 256-bit stores that way was ~3 % of a 16-row pass.
    ///
    /// # Safety
    /// AVX available; `src.len()` is a multiple of 32; for each row i, `dst + i·stride` is
    /// valid for 32 float writes that no other thread touches meanwhile and that do not overlap `src`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn copy_block_rows(src: &[f32], dst: *mut f32, stride: usize) {
        debug_assert!(src.len().is_multiple_of(TILE_ROWS));
        for (i, row) in src.chunks_exact(TILE_ROWS).enumerate() {
            for part in 0..TILE_ROWS / 8 {
                // SAFETY: row holds 32 floats; dst row i holds 32 (caller contract).
                unsafe {
                    let v = _mm256_loadu_ps(row.as_ptr().add(8 * part));
                    _mm256_storeu_ps(dst.add(i * stride + 8 * part), v);
                }
            }
        }
    }

    // ---- activation quantization -------------------------------------------------------------------

    /// ggml's `quantize_row_q8_1` for one full group of 32: codes into `out`, returns (d, Σq).
    /// Bit-identical to `quant::quantize_group` for groups of finite values whose `1/d` is finite
    /// (same max, same division, same product, and `cvtps_epi32` rounds ties to even like
    /// `round_ties_even`); a NaN, an infinity or an overflowing `1/d` leaves a non-finite `d` or a
    /// −128 code, and `quant::quantize_group_fast` redoes those groups with the scalar.
    ///
    /// # Safety
    /// AVX2 available; 32 floats readable at `values`, 32 bytes writable at `out`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_group32(values: *const f32, out: *mut i8) -> (f32, i32) {
        // SAFETY: 32 floats readable (caller contract).
        let amax = unsafe { abs_max(values, GROUP) };
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        // SAFETY: 32 floats readable, 32 bytes writable (caller contract).
        let sum = unsafe { scaled_codes32(values, inv, out) };
        (d, sum)
    }

    /// ggml's `quantize_row_q8_K` for one superblock of 256 (as `quant::quantize_superblock`
    /// writes it): codes into `out`, `1/iscale` into each of the 8 `scales`, Σq per 32 into
    /// `code_sums`; returns `1/iscale`. Bit-identical to the scalar for finite values whose
    /// `127/max` is finite; otherwise the returned scale is not finite or a code is −128, and the
    /// caller redoes the superblock with the scalar.
    ///
    /// # Safety
    /// AVX2 available; 256 floats readable at `values`, 256 bytes writable at `out`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_superblock256(
        values: *const f32,
        out: *mut i8,
        scales: &mut [f32; 8],
        code_sums: &mut [i32; 8],
    ) -> f32 {
        // SAFETY: 256 floats readable (caller contract).
        let amax = unsafe { abs_max(values, 8 * GROUP) };
        let iscale = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let d = if amax > 0.0 { 1.0 / iscale } else { 0.0 };
        for g in 0..8 {
            // SAFETY: group g's 32 floats and 32 bytes lie inside the caller's 256.
            code_sums[g] =
                unsafe { scaled_codes32(values.add(g * GROUP), iscale, out.add(g * GROUP)) };
            scales[g] = d;
        }
        d
    }

    /// max |x| over `n` floats (a multiple of 32) at `values`.
    ///
    /// # Safety
    /// AVX2 available; `n` floats readable at `values`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn abs_max(values: *const f32, n: usize) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for start in (0..n).step_by(GROUP) {
            // SAFETY: start + 32 ≤ n floats readable (caller contract).
            let v = unsafe {
                [
                    _mm256_loadu_ps(values.add(start)),
                    _mm256_loadu_ps(values.add(start + 8)),
                    _mm256_loadu_ps(values.add(start + 16)),
                    _mm256_loadu_ps(values.add(start + 24)),
                ]
            };
            let abs = |x| _mm256_andnot_ps(sign, x);
            let group = _mm256_max_ps(
                _mm256_max_ps(abs(v[0]), abs(v[1])),
                _mm256_max_ps(abs(v[2]), abs(v[3])),
            );
            m = _mm256_max_ps(m, group);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m1 = _mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2));
        _mm_cvtss_f32(m1)
    }

    /// Codes `round_ties_even(x · inv)` of 32 floats into `out`; returns their sum.
    ///
    /// # Safety
    /// AVX2 available; 32 floats readable at `values`, 32 bytes writable at `out`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scaled_codes32(values: *const f32, inv: f32, out: *mut i8) -> i32 {
        // SAFETY: 32 floats readable (caller contract).
        let v = unsafe {
            [
                _mm256_loadu_ps(values),
                _mm256_loadu_ps(values.add(8)),
                _mm256_loadu_ps(values.add(16)),
                _mm256_loadu_ps(values.add(24)),
            ]
        };
        let scale = _mm256_set1_ps(inv);
        let q = v.map(|x| _mm256_cvtps_epi32(_mm256_mul_ps(x, scale)));
        let total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let t4 = _mm_add_epi32(
            _mm256_castsi256_si128(total),
            _mm256_extracti128_si256::<1>(total),
        );
        let t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
        let t1 = _mm_add_epi32(t2, _mm_shuffle_epi32::<1>(t2));
        let sum = _mm_cvtsi128_si32(t1);
        // i32 → i16 → i8 with saturation (values are within ±127), then undo the lane interleave.
        let q16a = _mm256_packs_epi32(q[0], q[1]);
        let q16b = _mm256_packs_epi32(q[2], q[3]);
        let q8 = _mm256_packs_epi16(q16a, q16b);
        let q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: 32 bytes writable (caller contract).
        unsafe { _mm256_storeu_si256(out as *mut __m256i, q8) };
        sum
    }

    // ---- plain formats ----------------------------------------------------------------------------

    /// Horizontal sum of 8 floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::kernels) unsafe fn hsum_float_8(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Element type of a plain weight row.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum PlainKind {
        /// bf16 elements (2 bytes).
        Bf16,
        /// IEEE f16 elements (2 bytes).
        F16,
        /// f32 elements (4 bytes).
        F32,
    }

    impl PlainKind {
        /// Bytes per element.
        pub fn bytes(self) -> usize {
            match self {
                PlainKind::Bf16 | PlainKind::F16 => 2,
                PlainKind::F32 => 4,
            }
        }
    }

    /// Dot product of one plain weight row (`k` elements of `kind` at `w`) with `x[..k]`, in two
    /// 8-lane sums, of the even and of the odd 8-element chunks. The AVX-512 path's single-row
    /// dot, whose register tiles (`avx512::plain_rows`) hold the two sums in the halves of one
    /// 512-bit accumulator and so give its bits; the AVX2 path runs [`plain_rows`] at every row
    /// count instead.
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `w` holds `k` elements; `x.len() ≥ k`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn plain_dot(kind: PlainKind, w: &[u8], x: &[f32], k: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut c = 0;
        let load = |c: usize| unsafe {
            // SAFETY: c + 8 ≤ k, so 8 elements are readable from both rows.
            match kind {
                PlainKind::Bf16 => bf16x8(w.as_ptr().add(c * 2)),
                PlainKind::F16 => f16x8(w.as_ptr().add(c * 2)),
                PlainKind::F32 => _mm256_loadu_ps(w.as_ptr().add(c * 4) as *const f32),
            }
        };
        while c + 16 <= k {
            prefetch_ahead(w.as_ptr().wrapping_add(c * kind.bytes()), 16 * kind.bytes());
            // SAFETY: c + 16 ≤ k ≤ x.len().
            let (x0, x1) = unsafe {
                (
                    _mm256_loadu_ps(x.as_ptr().add(c)),
                    _mm256_loadu_ps(x.as_ptr().add(c + 8)),
                )
            };
            acc[0] = _mm256_fmadd_ps(load(c), x0, acc[0]);
            acc[1] = _mm256_fmadd_ps(load(c + 8), x1, acc[1]);
            c += 16;
        }
        if c + 8 <= k {
            // SAFETY: c + 8 ≤ k ≤ x.len().
            let x0 = unsafe { _mm256_loadu_ps(x.as_ptr().add(c)) };
            acc[0] = _mm256_fmadd_ps(load(c), x0, acc[0]);
            c += 8;
        }
        plain_tail(
            kind,
            w,
            x,
            c,
            k,
            hsum_float_8(_mm256_add_ps(acc[0], acc[1])),
        )
    }

    /// Weight rows of the widest register tile of [`plain_rows`].
    const PLAIN_TILE_ROWS: usize = 3;
    /// Most activation rows of one register tile of [`plain_rows`].
    const PLAIN_TILE_ACTS: usize = 4;
    /// Elements of one K slice of [`plain_rows`]: a tile's 4 activation rows of it (16 KiB of
    /// f32) stay in L1 while every weight tile of the block streams past; a multiple of 8.
    const PLAIN_K_SLICE: usize = 1024;

    /// One register tile's sums, `[activation][weight row]`, carried from one K slice to the next.
    type PlainTileSums = [[__m256; PLAIN_TILE_ROWS]; PLAIN_TILE_ACTS];

    /// Plain (f32 / f16 / bf16) weight rows `0 .. rows` of `w` (`k` elements each) against f32
    /// activation rows `act_rows` of `x` (`k` each): `out[slot · stride + r]`. The AVX2 path's
    /// dot for every row count, a single row included, so its order is the path's: per pair one
    /// 8-lane sum over K's 8-element chunks in order, `hsum_float_8`, then [`plain_tail`] for the
    /// last `k mod 8` elements. A register tile of up to 3 weight rows × 4 activation rows keeps
    /// its 12 sums in registers (with 3 weight vectors and one activation vector, the 16
    /// registers): each 8 weights converted once for 4 activation rows, each 8 activations
    /// loaded once for 3 weight rows. K runs in slices of `PLAIN_K_SLICE`, every weight tile of
    /// the block taking one slice before the next, so that the activations stay in L1 (at K =
    /// 2816 four rows are 45 KiB); a tile's sums wait in memory between slices. Two sums per
    /// pair, the order of [`plain_dot`] and of the AVX-512 tiles, would take 24 registers; built
    /// in two sweeps of one parity each they held the FMAs to about 68 % of their rate on one
    /// Zen 3 thread, where these tiles reach about 81 % (`docs/performance.md`). The last 4 rows
    /// of a block go as 2 + 2 rather than 3 + 1: a one-row tile has only its activation rows'
    /// chains, which FMA latency holds to half the rate. A single activation row (decode)
    /// takes tiles of 2 weight rows over the whole of K: its pass streams the block from memory,
    /// which three rows at once, or rows cut into slices, read slower.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `rows` ≤ [`TILE_ROWS`] (a GEMM block); `w` holds `rows` rows of `k`
    /// elements of `kind`; `x` holds `k` floats for every row of `act_rows`; `out` holds
    /// `(act_rows.len() - 1) · stride + rows` floats.
    #[allow(clippy::too_many_arguments)] // one work item's context
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn plain_rows(
        kind: PlainKind,
        w: &[u8],
        rows: usize,
        k: usize,
        x: &[f32],
        act_rows: std::ops::Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        debug_assert!(rows <= TILE_ROWS);
        let row_bytes = k * kind.bytes();
        let body = k / 8 * 8;
        // Each tile's first row and row count: `widest` at a time, the last 4 as 2 + 2.
        // A single activation row (decode) streams the block from memory two weight rows at a
        // time: three concurrent rows read slower there.
        let (widest, slice) = if act_rows.len() == 1 {
            (2, body.max(8))
        } else {
            (PLAIN_TILE_ROWS, PLAIN_K_SLICE)
        };
        let mut tiles = [(0, 0); TILE_ROWS.div_ceil(2)];
        let (mut tile_count, mut r0) = (0, 0);
        while r0 < rows {
            let n = match rows - r0 {
                4 | 2 => 2,
                1 => 1,
                _ => widest,
            };
            tiles[tile_count] = (r0, n);
            tile_count += 1;
            r0 += n;
        }
        let tiles = &tiles[..tile_count];
        let zero: PlainTileSums = [[_mm256_setzero_ps(); PLAIN_TILE_ROWS]; PLAIN_TILE_ACTS];
        let mut sums = [zero; TILE_ROWS.div_ceil(2)];
        for a0 in act_rows.clone().step_by(PLAIN_TILE_ACTS) {
            let acts = (act_rows.end - a0).min(PLAIN_TILE_ACTS);
            sums[..tile_count].fill(zero);
            // The first activation rows read the block from memory; later ones find it in L2.
            let stream = a0 == act_rows.start;
            for c0 in (0..body).step_by(slice) {
                let chunks = c0..(c0 + slice).min(body);
                for (&(r0, wrows), sums) in tiles.iter().zip(sums.iter_mut()) {
                    let (wp, xp) = (w.as_ptr().add(r0 * row_bytes), x.as_ptr().add(a0 * k));
                    macro_rules! tile {
                        ($w:literal, $a:literal, $kind:expr) => {
                            plain_tile::<$w, $a, { $kind }>(
                                wp,
                                row_bytes,
                                xp,
                                k,
                                chunks.clone(),
                                sums,
                                stream,
                            )
                        };
                        ($w:literal, $kind:expr) => {
                            match acts {
                                1 => tile!($w, 1, $kind),
                                2 => tile!($w, 2, $kind),
                                3 => tile!($w, 3, $kind),
                                _ => tile!($w, 4, $kind),
                            }
                        };
                        ($w:literal) => {
                            match kind {
                                PlainKind::F16 => tile!($w, PLAIN_F16),
                                PlainKind::Bf16 => tile!($w, PLAIN_BF16),
                                PlainKind::F32 => tile!($w, PLAIN_F32),
                            }
                        };
                    }
                    match wrows {
                        1 => tile!(1),
                        2 => tile!(2),
                        _ => tile!(3),
                    }
                }
            }
            for (&(r0, wrows), sums) in tiles.iter().zip(&sums) {
                for (a, sums) in sums.iter().enumerate().take(acts) {
                    let row = &mut out[(a0 + a - act_rows.start) * stride + r0..][..wrows];
                    for (r, (out, &sum)) in row.iter_mut().zip(sums).enumerate() {
                        let sum = hsum_float_8(sum);
                        *out = if body == k {
                            sum
                        } else {
                            let xrow = &x[(a0 + a) * k..(a0 + a + 1) * k];
                            let wrow = &w[(r0 + r) * row_bytes..(r0 + r + 1) * row_bytes];
                            plain_tail(kind, wrow, xrow, body, k, sum)
                        };
                    }
                }
            }
        }
    }

    /// [`PlainKind::F16`] as [`plain_tile`]'s const-generic argument.
    const PLAIN_F16: u8 = 0;
    /// [`PlainKind::Bf16`] as [`plain_tile`]'s const-generic argument.
    const PLAIN_BF16: u8 = 1;
    /// [`PlainKind::F32`] as [`plain_tile`]'s const-generic argument.
    const PLAIN_F32: u8 = 2;

    /// One K slice of a [`plain_rows`] register tile: `W` weight rows from `w` (rows `row_bytes`
    /// apart) against `A` activation rows from `x` (rows `k` apart), adding the 8-element chunks
    /// starting at `chunks.start`, `chunks.start + 8`, … (ending by `chunks.end`) to `sums`
    /// (`[a][r]`) in order, one FMA per chunk and pair. The weight rows are prefetched a stream
    /// distance ahead: a single row's decode needs it on a KVM guest, and a few rows' passes
    /// read the block from memory too. Not inlined: the sums go through memory between slices,
    /// and the registers are all the loop's.
    #[inline(never)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn plain_tile<const W: usize, const A: usize, const KIND: u8>(
        w: *const u8,
        row_bytes: usize,
        x: *const f32,
        k: usize,
        chunks: std::ops::Range<usize>,
        sums: &mut PlainTileSums,
        stream: bool,
    ) {
        let elem = if KIND == PLAIN_F32 { 4 } else { 2 };
        let load = |r: usize, c: usize| {
            let p = w.add(r * row_bytes + c * elem);
            match KIND {
                PLAIN_F16 => f16x8(p),
                PLAIN_BF16 => bf16x8(p),
                _ => _mm256_loadu_ps(p as *const f32),
            }
        };
        let mut acc: [[__m256; W]; A] =
            std::array::from_fn(|a| std::array::from_fn(|r| sums[a][r]));
        let mut c = chunks.start;
        while c + 8 <= chunks.end {
            if stream {
                for r in 0..W {
                    prefetch_ahead(w.wrapping_add(r * row_bytes + c * elem), 8 * elem);
                }
            }
            let wv: [__m256; W] = std::array::from_fn(|r| load(r, c));
            for (a, acc) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(a * k + c));
                for r in 0..W {
                    acc[r] = _mm256_fmadd_ps(wv[r], xv, acc[r]);
                }
            }
            c += 8;
        }
        for (a, acc) in acc.iter().enumerate() {
            sums[a][..W].copy_from_slice(acc);
        }
    }

    /// `sum` plus the products of elements `c .. k` (fewer than 8) of a plain row, one at a time:
    /// the end of [`plain_dot`], of [`plain_rows`] and of the AVX-512 tiles.
    pub(in crate::kernels) fn plain_tail(
        kind: PlainKind,
        w: &[u8],
        x: &[f32],
        mut c: usize,
        k: usize,
        mut sum: f32,
    ) -> f32 {
        while c < k {
            let v = match kind {
                PlainKind::Bf16 => {
                    half::bf16::from_bits(u16::from_le_bytes([w[2 * c], w[2 * c + 1]])).to_f32()
                }
                PlainKind::F16 => {
                    half::f16::from_bits(u16::from_le_bytes([w[2 * c], w[2 * c + 1]])).to_f32()
                }
                PlainKind::F32 => {
                    f32::from_le_bytes([w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]])
                }
            };
            sum += v * x[c];
            c += 1;
        }
        sum
    }
}
