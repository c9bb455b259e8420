//! AVX-512 VNNI multi-row kernels on 512-bit vectors: what [`avx2::q4_block`] and
//! [`avx2::q8_block`] run for two or more activation rows when [`avx2::vnni_available`].
//!
//! [`avx2::q4_block`]: crate::kernels::avx2::q4_block
//! [`avx2::q8_block`]: crate::kernels::avx2::q8_block
//! [`avx2::vnni_available`]: crate::kernels::avx2::vnni_available
//!
//! # Layout in registers
//!
//! A group (32 columns × 32 weight rows) is 8 quads of 4 columns. Here a quad is two 512-bit vectors
//! of 16 rows each, each 32-bit lane holding one row's 4 codes as u8, so one `vpdpbusd` forms 64
//! products into one i32 per row, against 32 for the 256-bit slot vectors of the AVX2 loops. Q8
//! codes are gathered into natural order (rows 0-15, 16-31) with one `vpermt2b` per vector. 4-bit
//! codes take one `vpermb` per quad, which puts each row pair's byte of the 4 columns into one
//! lane; its low nibbles are then the even rows and its high nibbles the odd rows (a mask, and a
//! shift and a mask). So q4_1 scales are split into even and odd rows once per group, and each
//! row's 32 results are interleaved back once per block, before the min term.
//!
//! # Why 512-bit
//!
//! On a core with two 512-bit integer multiply pipes one `vpdpbusd` costs the same at either width
//! (Sapphire Rapids: 0.18 ns each, ymm or zmm, measured with a register-only loop), so this halves
//! the multiplies, converts, scale products and FMAs of a multi-row pass. Zen 4 splits 512-bit
//! operations into two 256-bit halves, where the count of halves, and so the cost, is the same as
//! with the 256-bit loop.
//!
//! # Same bits
//!
//! Integer sums are exact in any order (|Σ| ≤ 32 · 128 · 127 < 2²⁴, so their f32 conversion is exact
//! too). Q8 codes are signed, so they are gathered offset by +128 (a sign-bit flip) and each row's
//! sums start at `−128 · Σx`, which cancels the offset exactly. After the sums, every output lane
//! gets the single-row kernel's float operations in its order: `fma(dot, d · d_x, acc)` per group,
//! in group order, from zero, then (q4_1) the min term's own chain added last. A row's result
//! therefore has the same bits as it has alone or on the AVX2 path.

// Unsafe is this module's job: AVX-512 intrinsics and assembly over raw tile pointers.
#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
pub use imp::*;

#[cfg(target_arch = "x86_64")]
mod imp {
    use crate::kernels::avx2::{
        hsum_float_8, plain_tail, prefetch_ahead, prefetch_q4_group, prefetch_q8_group,
        q4_group_scales, q8_group_scales, tile_and_group, PlainKind, Q4Layout, Q8Layout,
    };
    use crate::kernels::quant::{GroupMajor, QuantizedRows};
    use crate::tiles::{GROUP, TILE_ROWS};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// One group's codes as u8: `[quad][half]` holds columns `4·quad .. 4·quad + 4` of 16 of the
    /// 32 rows, one row per lane, byte `j` = column `4·quad + j`. Q8: half `h`, lane `L` = row
    /// `16h + L` (natural order); q4: half 0 the even rows, half 1 the odd ones (lane `L` = row
    /// `2L + h`). The scales and results of a group follow the same order.
    type Unpacked = [[__m512i; 2]; 8];

    /// Byte-gather table for 4-bit codes: output byte `4L + j` takes the byte holding row pair `L`
    /// (rows `2L`, low nibble, and `2L + 1`, high nibble) of column `j` from a quad's 64 loaded
    /// bytes. Column-major order loads byte `16j + L`; the 16-row-lane order loads its two planes'
    /// 32-byte runs one after the other, so byte `32·(L/8) + 8j + L%8`.
    const fn q4_gather(column_major: bool) -> [u8; 64] {
        let mut table = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            let (pair, col) = (i / 4, i % 4);
            table[i] = if column_major {
                16 * col + pair
            } else {
                32 * (pair / 8) + 8 * col + pair % 8
            } as u8;
            i += 1;
        }
        table
    }

    /// Byte-gather table for 8-bit codes over a quad's 128 bytes (two 64-byte vectors): output byte
    /// `4L + j` takes row `first_row + L`, column `j`. Column-major: byte `32j + r`; the 16-row-lane
    /// order: plane `r/16` (the second vector for rows 16-31), byte `16j + r%16`.
    const fn q8_gather(first_row: usize, column_major: bool) -> [u8; 64] {
        let mut table = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            let (row, col) = (first_row + i / 4, i % 4);
            table[i] = if column_major {
                32 * col + row
            } else {
                64 * (row / 16) + 16 * col + row % 16
            } as u8;
            i += 1;
        }
        table
    }

    /// The gather tables: `Q4_GATHER[order]`, `Q8_GATHER[order][half]`, with order 0 =
    /// column-major, 1 = 16-row lanes.
    static Q4_GATHER: [[u8; 64]; 2] = [q4_gather(true), q4_gather(false)];
    static Q8_GATHER: [[[u8; 64]; 2]; 2] = [
        [q8_gather(0, true), q8_gather(16, true)],
        [q8_gather(0, false), q8_gather(16, false)],
    ];

    /// Two 256-bit halves as one 512-bit vector (`lo` in lanes 0-7).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    fn join(lo: __m256, hi: __m256) -> __m512 {
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
            _mm256_castps_pd(hi),
        ))
    }

    /// Natural-order rows 0-7, 8-15, 16-23, 24-31 as rows 0-15 and 16-31.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    fn pair(v: [__m256; 4]) -> [__m512; 2] {
        [join(v[0], v[1]), join(v[2], v[3])]
    }

    /// Group `g` of a 4-bit tile (codes at `codes`) as [`Unpacked`] in even/odd order: half 0 holds
    /// rows 0, 2, …, 30, half 1 rows 1, 3, …, 31 (lane `L` = row `2L` or `2L + 1`).
    ///
    /// # Safety
    /// AVX-512 F, VL, VNNI and VBMI available; columns `32·g .. 32·g + 32` lie inside the code area
    /// (for the 16-row-lane order, of both planes).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
    unsafe fn q4_unpack_group(codes: *const u8, column_major: bool, g: usize) -> Unpacked {
        // SAFETY: the table is 64 bytes.
        let gather =
            unsafe { _mm512_loadu_si512(Q4_GATHER[usize::from(!column_major)].as_ptr().cast()) };
        let low = _mm512_set1_epi8(0x0F);
        // Plain loops, not `array::from_fn` / `map`: a closure handed to those generic helpers is
        // compiled without this function's target features and was called out of line, per vector.
        let mut unpacked = [[_mm512_setzero_si512(); 2]; 8];
        for (quad, halves) in unpacked.iter_mut().enumerate() {
            let c = g * GROUP + quad * 4;
            // SAFETY: columns c..c+4 are inside the code area (caller contract): 64 contiguous
            // bytes column-major, or 32 in each 2048-byte plane.
            let bytes = unsafe {
                if column_major {
                    _mm512_loadu_si512(codes.add(c * 16).cast())
                } else {
                    let plane0 = _mm256_loadu_si256(codes.add(c * 8).cast());
                    let plane1 = _mm256_loadu_si256(codes.add(2048 + c * 8).cast());
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(plane0), plane1)
                }
            };
            let pairs = _mm512_permutexvar_epi8(gather, bytes);
            *halves = [
                _mm512_and_si512(pairs, low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(pairs), low),
            ];
        }
        unpacked
    }

    /// Natural-order rows 0-15 and 16-31 as even rows and odd rows (the q4 [`Unpacked`] order).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    fn even_odd(natural: [__m512; 2]) -> [__m512; 2] {
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        [
            _mm512_permutex2var_ps(natural[0], even, natural[1]),
            _mm512_permutex2var_ps(natural[0], odd, natural[1]),
        ]
    }

    /// Each row's 32 results in `out` from even/odd order (`[even rows | odd rows]`) back to natural
    /// order: the inverse of [`even_odd`].
    ///
    /// # Safety
    /// AVX-512 F available; `out.len() ≥ rows × 32`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn interleave_rows(out: &mut [f32], rows: usize) {
        debug_assert!(out.len() >= rows * TILE_ROWS);
        let first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
        for row in out.chunks_exact_mut(TILE_ROWS).take(rows) {
            // SAFETY: the chunk holds 32 floats: 16 at 0 and 16 at 16.
            unsafe {
                let p = row.as_mut_ptr();
                let (even, odd) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
                _mm512_storeu_ps(p, _mm512_permutex2var_ps(even, first, odd));
                _mm512_storeu_ps(p.add(16), _mm512_permutex2var_ps(even, second, odd));
            }
        }
    }

    /// Group `g` of an 8-bit tile as [`Unpacked`], codes offset by +128 (u8 for `vpdpbusd`).
    ///
    /// # Safety
    /// AVX-512 F, VL, VNNI and VBMI available; columns `32·g .. 32·g + 32` lie inside the code area
    /// (for the 16-row-lane order, of both planes, `layout.plane` apart).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni,avx512vbmi")]
    unsafe fn q8_unpack_group(codes: *const u8, layout: Q8Layout, g: usize) -> Unpacked {
        let tables = &Q8_GATHER[usize::from(!layout.column_major)];
        // SAFETY: the tables are 64 bytes each.
        let gather = unsafe {
            [
                _mm512_loadu_si512(tables[0].as_ptr().cast()),
                _mm512_loadu_si512(tables[1].as_ptr().cast()),
            ]
        };
        let offset = _mm512_set1_epi8(i8::MIN);
        let mut unpacked = [[_mm512_setzero_si512(); 2]; 8];
        for (quad, halves) in unpacked.iter_mut().enumerate() {
            let c = g * GROUP + quad * 4;
            // SAFETY: columns c..c+4 are inside the code area (caller contract): 128 contiguous
            // bytes column-major, or 64 in each plane.
            let (first, second) = unsafe {
                if layout.column_major {
                    (
                        _mm512_loadu_si512(codes.add(c * 32).cast()),
                        _mm512_loadu_si512(codes.add(c * 32 + 64).cast()),
                    )
                } else {
                    (
                        _mm512_loadu_si512(codes.add(c * 16).cast()),
                        _mm512_loadu_si512(codes.add(layout.plane + c * 16).cast()),
                    )
                }
            };
            for (half, table) in halves.iter_mut().zip(gather) {
                *half = _mm512_xor_si512(_mm512_permutex2var_epi8(first, table, second), offset);
            }
        }
        unpacked
    }

    /// Rows `rows` of `act` times one 32-row block of a 4-bit tiled matrix, for two or more rows:
    /// `avx2::q4_block`'s contract and results (natural order, min term included).
    ///
    /// # Safety
    /// As `avx2::q4_block`, and AVX-512 F, BW, VL, VNNI and VBMI available (`vnni_available()`).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
    pub unsafe fn q4_rows(
        layout: Q4Layout,
        block: &[u8],
        act: &QuantizedRows,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let groups_total = act.groups();
        let m = rows.len();
        debug_assert!(rows.end <= act.rows && out.len() >= m * TILE_ROWS);
        debug_assert!(
            block.len() >= groups_total.div_ceil(layout.groups_per_tile) * layout.tile_bytes
        );
        // Every group adds to the accumulators (the first to zeros, as the single-row kernel's).
        out[..m * TILE_ROWS].fill(0.0);
        for gg in 0..groups_total {
            let (t, g) = tile_and_group(gg, layout.groups_per_tile);
            // SAFETY: AVX2 available.
            unsafe { prefetch_q4_group(layout, block, groups_total, gg) };
            // SAFETY: tile t exists (caller contract); the scale and code areas of group g are
            // inside it.
            let (d, unpacked) = unsafe {
                let tile = block.as_ptr().add(t * layout.tile_bytes);
                (
                    even_odd(pair(q4_group_scales(layout, tile, g).0)),
                    q4_unpack_group(tile.add(layout.codes), layout.column_major, g),
                )
            };
            // SAFETY: rows inside `act`, gg < groups, `out` holds m × 32 floats (caller contract).
            unsafe { group_rows::<false>(&unpacked, &d, act, rows.clone(), gg, out) };
        }
        // SAFETY: `out` holds m × 32 floats (caller contract), even/odd-ordered per row; after
        // the interleave, natural-ordered, as `add_min_terms` takes them.
        unsafe {
            interleave_rows(out, m);
            add_min_terms(layout, block, act, rows, out)
        };
    }

    /// Rows `rows` of `act` times one 32-row block of an 8-bit tiled matrix, for two or more rows:
    /// `avx2::q8_block`'s contract and results.
    ///
    /// # Safety
    /// As `avx2::q8_block`, and AVX-512 F, BW, VL, VNNI and VBMI available (`vnni_available()`).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
    pub unsafe fn q8_rows(
        layout: Q8Layout,
        block: &[u8],
        act: &QuantizedRows,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let groups_total = act.groups();
        let groups_per_tile = layout.tile_cols / GROUP;
        let m = rows.len();
        debug_assert!(rows.end <= act.rows && out.len() >= m * TILE_ROWS);
        debug_assert!(block.len() >= groups_total.div_ceil(groups_per_tile) * layout.tile_bytes);
        out[..m * TILE_ROWS].fill(0.0);
        for gg in 0..groups_total {
            let (t, g) = tile_and_group(gg, groups_per_tile);
            // SAFETY: AVX2 available.
            unsafe { prefetch_q8_group(layout, block, groups_total, gg) };
            // SAFETY: tile t exists (caller contract); group g's scales and codes are inside it.
            let (d, unpacked) = unsafe {
                let tile = block.as_ptr().add(t * layout.tile_bytes);
                (
                    pair(q8_group_scales(layout.f16_scales, tile, g)),
                    q8_unpack_group(tile.add(layout.codes), layout, g),
                )
            };
            // SAFETY: as in `q4_rows`.
            unsafe { group_rows::<true>(&unpacked, &d, act, rows.clone(), gg, out) };
        }
    }

    /// One unpacked group times every row in `rows`, added into `out` (32 floats per row, in the
    /// row order of `unpacked` and `d`): eight rows at a time in [`group_8_rows`], from the
    /// group-major activations, the rest one by one in [`quads_one_row`]. With `Q8` the codes
    /// are Q8 codes + 128 and each row's sums start at `−128 · Σx`.
    ///
    /// # Safety
    /// AVX-512 F, VL and VNNI available; `rows` inside `act`; `gg < act.groups()`;
    /// `out.len() ≥ rows.len() × 32`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn group_rows<const Q8: bool>(
        unpacked: &Unpacked,
        d: &[__m512; 2],
        act: &QuantizedRows,
        rows: std::ops::Range<usize>,
        gg: usize,
        out: &mut [f32],
    ) {
        debug_assert!(rows.end <= act.rows && out.len() >= rows.len() * TILE_ROWS);
        let by_group = &act.by_group;
        let m = rows.len();
        let mut i = 0;
        while i + 8 <= m {
            let first = GroupMajor::cell(act.rows, gg, rows.start + i);
            // Bounds-checked once per eight rows: the kernel's pointers come from these slices.
            let codes = &by_group.codes[first * GROUP..(first + 8) * GROUP];
            let scales = &by_group.scales[first..first + 8];
            let starts = &by_group.q8_starts[first..first + 8];
            let acc = &mut out[i * TILE_ROWS..(i + 8) * TILE_ROWS];
            // SAFETY: the slices hold eight rows' codes, scales, starts and accumulators.
            unsafe { group_8_rows::<Q8>(unpacked, codes, scales, starts, d, acc) };
            i += 8;
        }
        let groups_total = act.groups();
        while i < m {
            let row = rows.start + i;
            let cell = row * groups_total + gg;
            let start = if Q8 { -128 * act.code_sums[cell] } else { 0 };
            // SAFETY: the row is inside `act`, so it has group gg's 32 codes at this offset.
            let sums = unsafe {
                let codes = act.codes.as_ptr().add(row * act.cols + gg * GROUP);
                quads_one_row(unpacked, codes, _mm512_set1_epi32(start))
            };
            // SAFETY: i < rows.len(), so row i's 32 floats are inside `out`.
            unsafe { accumulate(&mut out[i * TILE_ROWS..], sums, d, act.scales[cell]) };
            i += 1;
        }
    }

    /// `acc = fma(dot, d · d_x, acc)` for one row's 32 accumulators in `acc_mem`, in the order of
    /// `d`: the single-row kernel's per-group update, 16 lanes at a time.
    ///
    /// # Safety
    /// AVX-512 F available; `acc_mem.len() ≥ 32`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn accumulate(acc_mem: &mut [f32], sums: [__m512i; 2], d: &[__m512; 2], scale_x: f32) {
        debug_assert!(acc_mem.len() >= TILE_ROWS);
        let scale_x = _mm512_set1_ps(scale_x);
        for (half, sum) in sums.into_iter().enumerate() {
            // SAFETY: acc_mem holds ≥ 32 floats; 16 are read and written at 16·half (half < 2).
            unsafe {
                let p = acc_mem.as_mut_ptr().add(half * 16);
                let scale = _mm512_mul_ps(d[half], scale_x);
                let acc = _mm512_loadu_ps(p);
                _mm512_storeu_ps(p, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc));
            }
        }
    }

    /// One row of a group in intrinsics, its sums starting at `start`: two chains per half (even
    /// and odd quads, added at the end; the integer sums are exact), so four independent
    /// `vpdpbusd` chains.
    ///
    /// # Safety
    /// AVX-512 F, VL and VNNI available; 32 codes readable at `codes`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn quads_one_row(unpacked: &Unpacked, codes: *const i8, start: __m512i) -> [__m512i; 2] {
        let mut even = [start; 2];
        let mut odd = [_mm512_setzero_si512(); 2];
        for pair in 0..4 {
            for (quad, sums) in [(2 * pair, &mut even), (2 * pair + 1, &mut odd)] {
                // SAFETY: 4 codes at codes + 4·quad (quad < 8), caller contract.
                let x = unsafe { codes.add(quad * 4).cast::<i32>().read_unaligned() };
                let x = _mm512_set1_epi32(x);
                sums[0] = _mm512_dpbusd_epi32(sums[0], unpacked[quad][0], x);
                sums[1] = _mm512_dpbusd_epi32(sums[1], unpacked[quad][1], x);
            }
        }
        [
            _mm512_add_epi32(even[0], odd[0]),
            _mm512_add_epi32(even[1], odd[1]),
        ]
    }

    /// One quad of [`group_8_rows`]: its two weight vectors loaded once (at `$w`, `$w + 64` in the
    /// unpacked group), each row's 4 codes (row `r` at `32·r + $x`) broadcast once, then 16
    /// `vpdpbusd`.
    macro_rules! quad_8_rows {
        ($w:literal, $x:literal) => {
            concat!(
                "vmovdqu64 {w0:z}, zmmword ptr [{w} + ",
                $w,
                "]\n",
                "vmovdqu64 {w1:z}, zmmword ptr [{w} + ",
                $w,
                " + 64]\n",
                "vpbroadcastd {x0:z}, dword ptr [{a} + ",
                $x,
                "]\n",
                "vpbroadcastd {x1:z}, dword ptr [{a} + 32 + ",
                $x,
                "]\n",
                "vpbroadcastd {x2:z}, dword ptr [{a} + 64 + ",
                $x,
                "]\n",
                "vpbroadcastd {x3:z}, dword ptr [{a} + 96 + ",
                $x,
                "]\n",
                "vpbroadcastd {x4:z}, dword ptr [{a} + 128 + ",
                $x,
                "]\n",
                "vpbroadcastd {x5:z}, dword ptr [{a} + 160 + ",
                $x,
                "]\n",
                "vpbroadcastd {x6:z}, dword ptr [{a} + 192 + ",
                $x,
                "]\n",
                "vpbroadcastd {x7:z}, dword ptr [{a} + 224 + ",
                $x,
                "]\n",
                "vpdpbusd {s00:z}, {w0:z}, {x0:z}\n",
                "vpdpbusd {s01:z}, {w1:z}, {x0:z}\n",
                "vpdpbusd {s10:z}, {w0:z}, {x1:z}\n",
                "vpdpbusd {s11:z}, {w1:z}, {x1:z}\n",
                "vpdpbusd {s20:z}, {w0:z}, {x2:z}\n",
                "vpdpbusd {s21:z}, {w1:z}, {x2:z}\n",
                "vpdpbusd {s30:z}, {w0:z}, {x3:z}\n",
                "vpdpbusd {s31:z}, {w1:z}, {x3:z}\n",
                "vpdpbusd {s40:z}, {w0:z}, {x4:z}\n",
                "vpdpbusd {s41:z}, {w1:z}, {x4:z}\n",
                "vpdpbusd {s50:z}, {w0:z}, {x5:z}\n",
                "vpdpbusd {s51:z}, {w1:z}, {x5:z}\n",
                "vpdpbusd {s60:z}, {w0:z}, {x6:z}\n",
                "vpdpbusd {s61:z}, {w1:z}, {x6:z}\n",
                "vpdpbusd {s70:z}, {w0:z}, {x7:z}\n",
                "vpdpbusd {s71:z}, {w1:z}, {x7:z}\n",
            )
        };
    }

    /// Where row `$r`'s two sums of [`group_8_rows`] start: zero (q4), or its `−128 · Σx` (q8,
    /// at `{st} + 4·$r`) in both halves.
    macro_rules! start_row {
        (zero, $r:literal, $s0:literal, $s1:literal) => {
            concat!(
                "vpxord {", $s0, ":z}, {", $s0, ":z}, {", $s0, ":z}\n", "vpxord {", $s1, ":z}, {",
                $s1, ":z}, {", $s1, ":z}\n",
            )
        };
        (q8, $r:literal, $s0:literal, $s1:literal) => {
            concat!(
                "vpbroadcastd {",
                $s0,
                ":z}, dword ptr [{st} + 4 * ",
                $r,
                "]\n",
                "vmovdqa64 {",
                $s1,
                ":z}, {",
                $s0,
                ":z}\n",
            )
        };
    }

    /// Row `$r`'s update of [`group_8_rows`]: `acc = fma(dot, d · d_x, acc)` per half, with `d_x`
    /// at `{sx} + 4·$r` and the row's 32 accumulators at `{acc} + 128·$r` ([`accumulate`]'s
    /// operations, in its order).
    macro_rules! accumulate_row {
        ($r:literal, $s0:literal, $s1:literal) => {
            concat!(
                "vcvtdq2ps {",
                $s0,
                ":z}, {",
                $s0,
                ":z}\n",
                "vcvtdq2ps {",
                $s1,
                ":z}, {",
                $s1,
                ":z}\n",
                "vbroadcastss {t0:z}, dword ptr [{sx} + 4 * ",
                $r,
                "]\n",
                "vmulps {t1:z}, {d0:z}, {t0:z}\n",
                "vfmadd213ps {",
                $s0,
                ":z}, {t1:z}, zmmword ptr [{acc} + 128 * ",
                $r,
                "]\n",
                "vmovups zmmword ptr [{acc} + 128 * ",
                $r,
                "], {",
                $s0,
                ":z}\n",
                "vmulps {t1:z}, {d1:z}, {t0:z}\n",
                "vfmadd213ps {",
                $s1,
                ":z}, {t1:z}, zmmword ptr [{acc} + 128 * ",
                $r,
                " + 64]\n",
                "vmovups zmmword ptr [{acc} + 128 * ",
                $r,
                " + 64], {",
                $s1,
                ":z}\n",
            )
        };
    }

    /// The whole of [`group_8_rows`] for one way of starting the sums (`zero` or `q8`).
    macro_rules! group_8_rows_asm {
        ($start:ident) => {
            concat!(
                start_row!($start, "0", "s00", "s01"),
                start_row!($start, "1", "s10", "s11"),
                start_row!($start, "2", "s20", "s21"),
                start_row!($start, "3", "s30", "s31"),
                start_row!($start, "4", "s40", "s41"),
                start_row!($start, "5", "s50", "s51"),
                start_row!($start, "6", "s60", "s61"),
                start_row!($start, "7", "s70", "s71"),
                quad_8_rows!("0", "0"),
                quad_8_rows!("128", "4"),
                quad_8_rows!("256", "8"),
                quad_8_rows!("384", "12"),
                quad_8_rows!("512", "16"),
                quad_8_rows!("640", "20"),
                quad_8_rows!("768", "24"),
                quad_8_rows!("896", "28"),
                accumulate_row!("0", "s00", "s01"),
                accumulate_row!("1", "s10", "s11"),
                accumulate_row!("2", "s20", "s21"),
                accumulate_row!("3", "s30", "s31"),
                accumulate_row!("4", "s40", "s41"),
                accumulate_row!("5", "s50", "s51"),
                accumulate_row!("6", "s60", "s61"),
                accumulate_row!("7", "s70", "s71"),
            )
        };
    }

    /// Eight activation rows of one group, in one block of assembly: the sums (from zero, or with
    /// `Q8` from `starts`), the 8 quads × 2 halves × 8 rows of `vpdpbusd`, then each row's
    /// `acc = fma(dot, d · d_x, acc)` into `acc` (8 rows × 32 floats). Each quad's two weight
    /// vectors are loaded once for the 8 rows; the 16 sums, 8 broadcasts, 2 weights, 2 scales and 2
    /// temporaries take 30 of the 32 vector registers. The rows' codes (8 × 32), scales and starts
    /// lie side by side (group-major activations), so three pointers and fixed offsets reach them
    /// all. Compiled from intrinsics, loops like this came out reordered row by row with the
    /// weights hoisted and spilled, so the schedule is written out.
    ///
    /// # Safety
    /// AVX-512 F and VNNI available.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn group_8_rows<const Q8: bool>(
        unpacked: &Unpacked,
        codes: &[i8],
        scales: &[f32],
        starts: &[i32],
        d: &[__m512; 2],
        acc: &mut [f32],
    ) {
        assert!(codes.len() >= 8 * GROUP && scales.len() >= 8 && starts.len() >= 8);
        assert!(acc.len() >= 8 * TILE_ROWS);
        // Scratch registers, typed: an untyped `out(zmm_reg) _` is not formatted as a zmm name.
        let (_w0, _w1, _t0, _t1): (__m512i, __m512i, __m512, __m512);
        let (_x0, _x1, _x2, _x3): (__m512i, __m512i, __m512i, __m512i);
        let (_x4, _x5, _x6, _x7): (__m512i, __m512i, __m512i, __m512i);
        let (_s00, _s01, _s10, _s11): (__m512i, __m512i, __m512i, __m512i);
        let (_s20, _s21, _s30, _s31): (__m512i, __m512i, __m512i, __m512i);
        let (_s40, _s41, _s50, _s51): (__m512i, __m512i, __m512i, __m512i);
        let (_s60, _s61, _s70, _s71): (__m512i, __m512i, __m512i, __m512i);
        macro_rules! run {
            ($start:ident, $($starts:tt)*) => {
                // SAFETY: the code reads the 1 KiB of `unpacked`, 256 bytes of `codes`, 8 scales
                // and (q8) 8 starts, and reads and writes 256 floats of `acc` (all asserted
                // above); it writes only the named registers.
                unsafe {
                    std::arch::asm!(
                        group_8_rows_asm!($start),
                        w = in(reg) unpacked.as_ptr(),
                        a = in(reg) codes.as_ptr(),
                        sx = in(reg) scales.as_ptr(),
                        $($starts)*
                        acc = in(reg) acc.as_mut_ptr(),
                        d0 = in(zmm_reg) d[0],
                        d1 = in(zmm_reg) d[1],
                        w0 = out(zmm_reg) _w0,
                        w1 = out(zmm_reg) _w1,
                        t0 = out(zmm_reg) _t0,
                        t1 = out(zmm_reg) _t1,
                        x0 = out(zmm_reg) _x0,
                        x1 = out(zmm_reg) _x1,
                        x2 = out(zmm_reg) _x2,
                        x3 = out(zmm_reg) _x3,
                        x4 = out(zmm_reg) _x4,
                        x5 = out(zmm_reg) _x5,
                        x6 = out(zmm_reg) _x6,
                        x7 = out(zmm_reg) _x7,
                        s00 = out(zmm_reg) _s00,
                        s01 = out(zmm_reg) _s01,
                        s10 = out(zmm_reg) _s10,
                        s11 = out(zmm_reg) _s11,
                        s20 = out(zmm_reg) _s20,
                        s21 = out(zmm_reg) _s21,
                        s30 = out(zmm_reg) _s30,
                        s31 = out(zmm_reg) _s31,
                        s40 = out(zmm_reg) _s40,
                        s41 = out(zmm_reg) _s41,
                        s50 = out(zmm_reg) _s50,
                        s51 = out(zmm_reg) _s51,
                        s60 = out(zmm_reg) _s60,
                        s61 = out(zmm_reg) _s61,
                        s70 = out(zmm_reg) _s70,
                        s71 = out(zmm_reg) _s71,
                        options(nostack),
                    )
                }
            };
        }
        if Q8 {
            run!(q8, st = in(reg) starts.as_ptr(),)
        } else {
            run!(zero,)
        }
    }

    /// `out[r] += Σ_g m_w[g, r] · sums[g]` for every row in `rows` (natural order): the q4_1 min
    /// term, `avx2::q4_block`'s last step, on 512-bit vectors. Each group's mins are converted
    /// once per 16 rows into a stack buffer (up to 24 groups at a time); rows go four at a time
    /// (eight FMA chains) with their accumulators in registers. Per row the FMAs run in group
    /// order from zero and the total is added to `out` last: the single-row kernel's bits.
    ///
    /// # Safety
    /// As [`q4_rows`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn add_min_terms(
        layout: Q4Layout,
        block: &[u8],
        act: &QuantizedRows,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        const ROW_CHUNK: usize = 16;
        // 24 groups of converted mins (3 KiB) cover K = 576 in one chunk.
        const GROUP_CHUNK: usize = 24;
        const ROWS_AT_ONCE: usize = 4;
        let groups_total = act.groups();
        debug_assert!(rows.end <= act.rows && out.len() >= rows.len() * TILE_ROWS);
        if groups_total == 0 {
            return; // K = 0: no min term.
        }
        let first = rows.start;
        // Left uninitialized: every entry is written before it is read.
        let mut mins = [MaybeUninit::<[__m512; 2]>::uninit(); GROUP_CHUNK];
        let mut row_start = rows.start;
        while row_start < rows.end {
            let row_chunk = row_start..(row_start + ROW_CHUNK).min(rows.end);
            let rows_here = row_chunk.len();
            // Left uninitialized: the first group chunk writes every row's entry.
            let mut totals = [MaybeUninit::<[__m512; 2]>::uninit(); ROW_CHUNK];
            let mut g0 = 0;
            while g0 < groups_total {
                let g1 = (g0 + GROUP_CHUNK).min(groups_total);
                for (gg, slot) in (g0..g1).zip(mins.iter_mut()) {
                    let (t, g) = tile_and_group(gg, layout.groups_per_tile);
                    // SAFETY: tile t exists (caller contract); its min area holds group g.
                    let group_mins = unsafe {
                        let tile = block.as_ptr().add(t * layout.tile_bytes);
                        q4_group_scales(layout, tile, g).1
                    };
                    slot.write(pair(group_mins));
                }
                // SAFETY: entries 0..g1 - g0 were written just above; MaybeUninit<T> has T's layout.
                let mins: &[[__m512; 2]] = unsafe {
                    &*(&mins[..g1 - g0] as *const [MaybeUninit<[__m512; 2]>] as *const _)
                };
                for quad in (0..rows_here).step_by(ROWS_AT_ONCE) {
                    // Past the chunk's last row, the last row is computed again (and discarded).
                    let mut acc = [[_mm512_setzero_ps(); 2]; ROWS_AT_ONCE];
                    let mut sums: [&[f32]; ROWS_AT_ONCE] = [&[]; ROWS_AT_ONCE];
                    for r in 0..ROWS_AT_ONCE {
                        let i = (quad + r).min(rows_here - 1);
                        let row = row_chunk.start + i;
                        if g0 > 0 {
                            // SAFETY: the pass over the first group chunk wrote row i's entry.
                            acc[r] = unsafe { totals[i].assume_init() };
                        }
                        sums[r] = &act.sums[row * groups_total + g0..row * groups_total + g1];
                    }
                    for (j, m) in mins.iter().enumerate() {
                        for r in 0..ROWS_AT_ONCE {
                            let sum_x = _mm512_set1_ps(sums[r][j]);
                            acc[r][0] = _mm512_fmadd_ps(m[0], sum_x, acc[r][0]);
                            acc[r][1] = _mm512_fmadd_ps(m[1], sum_x, acc[r][1]);
                        }
                    }
                    // A fixed-count loop: a copy of the variable-length prefix was a `memcpy`
                    // call (and a `vzeroupper`) per four rows.
                    for (r, acc) in acc.iter().enumerate() {
                        if quad + r < rows_here {
                            totals[quad + r].write(*acc);
                        }
                    }
                }
                g0 = g1;
            }
            for (total, row) in totals.iter().zip(row_chunk.clone()) {
                // SAFETY: groups_total > 0, so the first group chunk wrote every row's entry.
                let total = unsafe { total.assume_init_ref() };
                for (half, m) in total.iter().enumerate() {
                    // SAFETY: row - first < rows.len(): 32 floats of `out` belong to it; 16 are
                    // read and written at 16·half for half < 2.
                    unsafe {
                        let p = out.as_mut_ptr().add((row - first) * TILE_ROWS + 16 * half);
                        _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), *m));
                    }
                }
            }
            row_start = row_chunk.end;
        }
    }

    /// `body` once per activation row `a` of a register tile (`0 .. acts`, at most 3), written
    /// out with constant indices: a loop over them left the accumulators on the stack.
    macro_rules! per_act {
        ($acts:expr, |$a:ident| $body:expr) => {{
            {
                let $a = 0;
                $body
            }
            if $acts > 1 {
                let $a = 1;
                $body
            }
            if $acts > 2 {
                let $a = 2;
                $body
            }
        }};
    }

    /// Weight rows of one register tile of [`plain_rows`].
    const PLAIN_TILE_ROWS: usize = 4;
    /// Most activation rows of one register tile of [`plain_rows`].
    const PLAIN_TILE_ACTS: usize = 3;

    /// Plain (f32 / f16 / bf16) weight rows `0 .. rows` of `w` (`k` elements each) against f32
    /// activation rows `act_rows` of `x` (`k` each): `out[slot · stride + r]`, the same bits as
    /// [`avx2::plain_dot`] for every pair. Tiles of 4 weight rows × 3 activation rows keep 12
    /// accumulators in registers (4 × 4 spilled them), so each 16 weights are converted once
    /// for 3 activation rows and each 16 activations loaded once for 4 weight rows. An
    /// accumulator holds `plain_dot`'s two 8-lane sums side by side (elements `16i .. 16i + 8`
    /// low, `16i + 8 .. 16i + 16` high), a trailing 8 go into the low half only, and the halves
    /// are added and summed by the same `hsum_float_8`, so every sum sees the same operations
    /// in the same order.
    ///
    /// [`avx2::plain_dot`]: crate::kernels::avx2::plain_dot
    ///
    /// # Safety
    /// AVX2, FMA, F16C and AVX-512 F; `w` holds `rows` rows of `k` elements of `kind`; `x` holds
    /// `k` floats for every row of `act_rows`; `out` holds `(act_rows.len() - 1) · stride +
    /// rows` floats.
    #[allow(clippy::too_many_arguments)] // one work item's context
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
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
        let row_bytes = k * kind.bytes();
        // Each tile's vector sums, finished by `plain_tail` with the row dot's operations.
        let tail = !k.is_multiple_of(8);
        let mut finish = |a0: usize, r0: usize, acts: usize, wrows: usize, sums: &[[f32; 4]]| {
            for (a, sums) in sums.iter().enumerate().take(acts) {
                let row = &mut out[(a0 + a - act_rows.start) * stride + r0..][..wrows];
                for (r, (out, &sum)) in row.iter_mut().zip(sums).enumerate() {
                    *out = if tail {
                        let (wrow, xrow) = (
                            &w[(r0 + r) * row_bytes..(r0 + r + 1) * row_bytes],
                            &x[(a0 + a) * k..(a0 + a + 1) * k],
                        );
                        plain_tail(kind, wrow, xrow, k / 8 * 8, k, sum)
                    } else {
                        sum
                    };
                }
            }
        };
        let mut a0 = act_rows.start;
        while a0 < act_rows.end {
            // f16 weights take six activation rows per tile where there are six (and four
            // weight rows): the tile's conversions are then shared by twice the multiply-adds.
            let wide = kind == PlainKind::F16 && act_rows.end - a0 >= F16_TILE_ACTS;
            let acts = if wide {
                F16_TILE_ACTS
            } else {
                (act_rows.end - a0).min(PLAIN_TILE_ACTS)
            };
            for r0 in (0..rows).step_by(PLAIN_TILE_ROWS) {
                let wrows = (rows - r0).min(PLAIN_TILE_ROWS);
                let (wp, xp) = (w.as_ptr().add(r0 * row_bytes), x.as_ptr().add(a0 * k));
                if wide && wrows == PLAIN_TILE_ROWS {
                    let sums = f16_tile_wide(wp, row_bytes, xp, k);
                    finish(a0, r0, acts, wrows, &sums);
                    continue;
                }
                if wide {
                    for half in [0, PLAIN_TILE_ACTS] {
                        let xp = xp.add(half * k);
                        let sums = plain_tile::<3, PLAIN_F16>(wp, row_bytes, wrows, xp, k);
                        finish(a0 + half, r0, PLAIN_TILE_ACTS, wrows, &sums);
                    }
                    continue;
                }
                macro_rules! tile {
                    ($kind:expr) => {
                        match acts {
                            1 => plain_tile::<1, { $kind }>(wp, row_bytes, wrows, xp, k),
                            2 => plain_tile::<2, { $kind }>(wp, row_bytes, wrows, xp, k),
                            _ => plain_tile::<3, { $kind }>(wp, row_bytes, wrows, xp, k),
                        }
                    };
                }
                let sums = match kind {
                    PlainKind::F32 => tile!(PLAIN_F32),
                    PlainKind::F16 => tile!(PLAIN_F16),
                    PlainKind::Bf16 => tile!(PLAIN_BF16),
                };
                finish(a0, r0, acts, wrows, &sums);
            }
            a0 += acts;
        }
    }

    /// Activation rows of one f16 register tile of [`plain_rows`] ([`f16_tile_wide`]).
    const F16_TILE_ACTS: usize = 6;

    /// [`plain_tile`] for f16 weights and six activation rows: 4 × 6 accumulators, 4
    /// conversions and 6 activation loads per 16 columns, written as assembly (compiled from
    /// intrinsics, 24 accumulators spilled to the stack). Each accumulator gets `plain_tile`'s
    /// operations in its order, so the sums have its bits.
    ///
    /// # Safety
    /// As [`plain_tile`] with `ACTS` = 6 and 4 weight rows.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn f16_tile_wide(
        w: *const u8,
        row_bytes: usize,
        x: *const f32,
        k: usize,
    ) -> [[f32; PLAIN_TILE_ROWS]; F16_TILE_ACTS] {
        let mut acc = f16_tile_wide_runs(w, row_bytes, x, k);
        let wp = [0, 1, 2, 3].map(|r| w.add(r * row_bytes));
        let xp = [0, 1, 2, 3, 4, 5].map(|a| x.add(a * k));
        tile_tail_sums::<F16_TILE_ACTS, PLAIN_F16>(
            &mut acc,
            &wp,
            &xp,
            F16_TILE_ACTS,
            k / 16 * 16,
            k,
        )
    }

    /// [`f16_tile_wide`]'s accumulators over the tile's whole runs of 16 columns. Not inlined:
    /// its 29 vector registers leave none for values of a caller live across it.
    ///
    /// # Safety
    /// As [`f16_tile_wide`].
    #[inline(never)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn f16_tile_wide_runs(
        w: *const u8,
        row_bytes: usize,
        x: *const f32,
        k: usize,
    ) -> [[__m512; PLAIN_TILE_ROWS]; F16_TILE_ACTS] {
        let mut acc = [[_mm512_setzero_ps(); PLAIN_TILE_ROWS]; F16_TILE_ACTS];
        let runs = k / 16;
        if runs > 0 {
            let [a0, a1, a2, a3, a4, a5] = &mut acc;
            // SAFETY: each of the 4 weight rows holds `k` f16 and each of the 6 activation rows
            // `k` floats (the caller's contract); the loop reads `runs · 16` of each, and writes
            // only the named registers.
            unsafe {
                std::arch::asm!(
                    "2:",
                    "vcvtph2ps {w0}, ymmword ptr [{p0}]",
                    "vcvtph2ps {w1}, ymmword ptr [{p0} + {s}]",
                    "vcvtph2ps {w2}, ymmword ptr [{p0} + {s}*2]",
                    "vcvtph2ps {w3}, ymmword ptr [{p3}]",
                    "vmovups {xv}, zmmword ptr [{x}]",
                    "vfmadd231ps {a00}, {w0}, {xv}",
                    "vfmadd231ps {a01}, {w1}, {xv}",
                    "vfmadd231ps {a02}, {w2}, {xv}",
                    "vfmadd231ps {a03}, {w3}, {xv}",
                    "vmovups {xv}, zmmword ptr [{x} + {xs}]",
                    "vfmadd231ps {a10}, {w0}, {xv}",
                    "vfmadd231ps {a11}, {w1}, {xv}",
                    "vfmadd231ps {a12}, {w2}, {xv}",
                    "vfmadd231ps {a13}, {w3}, {xv}",
                    "vmovups {xv}, zmmword ptr [{x} + {xs}*2]",
                    "vfmadd231ps {a20}, {w0}, {xv}",
                    "vfmadd231ps {a21}, {w1}, {xv}",
                    "vfmadd231ps {a22}, {w2}, {xv}",
                    "vfmadd231ps {a23}, {w3}, {xv}",
                    "vmovups {xv}, zmmword ptr [{x3}]",
                    "vfmadd231ps {a30}, {w0}, {xv}",
                    "vfmadd231ps {a31}, {w1}, {xv}",
                    "vfmadd231ps {a32}, {w2}, {xv}",
                    "vfmadd231ps {a33}, {w3}, {xv}",
                    "vmovups {xv}, zmmword ptr [{x3} + {xs}]",
                    "vfmadd231ps {a40}, {w0}, {xv}",
                    "vfmadd231ps {a41}, {w1}, {xv}",
                    "vfmadd231ps {a42}, {w2}, {xv}",
                    "vfmadd231ps {a43}, {w3}, {xv}",
                    "vmovups {xv}, zmmword ptr [{x3} + {xs}*2]",
                    "vfmadd231ps {a50}, {w0}, {xv}",
                    "vfmadd231ps {a51}, {w1}, {xv}",
                    "vfmadd231ps {a52}, {w2}, {xv}",
                    "vfmadd231ps {a53}, {w3}, {xv}",
                    "add {p0}, 32",
                    "add {p3}, 32",
                    "add {x}, 64",
                    "add {x3}, 64",
                    "dec {n}",
                    "jnz 2b",
                    p0 = inout(reg) w => _,
                    s = in(reg) row_bytes,
                    p3 = inout(reg) w.add(3 * row_bytes) => _,
                    x = inout(reg) x => _,
                    x3 = inout(reg) x.add(3 * k) => _,
                    xs = in(reg) 4 * k,
                    n = inout(reg) runs => _,
                    w0 = out(zmm_reg) _,
                    w1 = out(zmm_reg) _,
                    w2 = out(zmm_reg) _,
                    w3 = out(zmm_reg) _,
                    xv = out(zmm_reg) _,
                    a00 = inout(zmm_reg) a0[0],
                    a01 = inout(zmm_reg) a0[1],
                    a02 = inout(zmm_reg) a0[2],
                    a03 = inout(zmm_reg) a0[3],
                    a10 = inout(zmm_reg) a1[0],
                    a11 = inout(zmm_reg) a1[1],
                    a12 = inout(zmm_reg) a1[2],
                    a13 = inout(zmm_reg) a1[3],
                    a20 = inout(zmm_reg) a2[0],
                    a21 = inout(zmm_reg) a2[1],
                    a22 = inout(zmm_reg) a2[2],
                    a23 = inout(zmm_reg) a2[3],
                    a30 = inout(zmm_reg) a3[0],
                    a31 = inout(zmm_reg) a3[1],
                    a32 = inout(zmm_reg) a3[2],
                    a33 = inout(zmm_reg) a3[3],
                    a40 = inout(zmm_reg) a4[0],
                    a41 = inout(zmm_reg) a4[1],
                    a42 = inout(zmm_reg) a4[2],
                    a43 = inout(zmm_reg) a4[3],
                    a50 = inout(zmm_reg) a5[0],
                    a51 = inout(zmm_reg) a5[1],
                    a52 = inout(zmm_reg) a5[2],
                    a53 = inout(zmm_reg) a5[3],
                    options(nostack, readonly),
                )
            };
        }
        acc
    }

    /// [`PlainKind::F32`] as a const-generic argument.
    const PLAIN_F32: u8 = 0;
    /// [`PlainKind::F16`] as a const-generic argument.
    const PLAIN_F16: u8 = 1;
    /// [`PlainKind::Bf16`] as a const-generic argument.
    const PLAIN_BF16: u8 = 2;

    /// 16 elements of kind `KIND` at `p` (8 when `HALF`, in the low lanes) as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn plain16<const KIND: u8, const HALF: bool>(p: *const u8) -> __m512 {
        match (KIND, HALF) {
            (PLAIN_F32, false) => _mm512_loadu_ps(p as *const f32),
            (PLAIN_F32, true) => _mm512_castps256_ps512(_mm256_loadu_ps(p as *const f32)),
            (PLAIN_F16, false) => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            (PLAIN_F16, true) => {
                _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)))
            }
            (_, false) => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p as *const __m256i),
            ))),
            (_, true) => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_castsi128_si256(_mm_loadu_si128(p as *const __m128i)),
            ))),
        }
    }

    /// One tile: the vector part (elements `0 .. k / 8 · 8`) of the sums of weight rows `0 ..
    /// wrows` (rows `row_bytes` apart from `w`) against activation rows `0 .. ACTS` (`k` floats
    /// apart from `x`), `[activation][weight]`; entries past `ACTS` are zero, those past `wrows`
    /// repeat the first row's and are dropped by the caller.
    ///
    /// # Safety
    /// As [`plain_rows`], for the rows of this tile.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn plain_tile<const ACTS: usize, const KIND: u8>(
        w: *const u8,
        row_bytes: usize,
        wrows: usize,
        x: *const f32,
        k: usize,
    ) -> [[f32; PLAIN_TILE_ROWS]; PLAIN_TILE_ACTS] {
        let elem = if KIND == PLAIN_F32 { 4 } else { 2 };
        // Weight rows past the tile's real ones repeat its first row (their sums are dropped), so
        // the loops below run fixed counts and keep every accumulator in a register.
        let wp: [*const u8; PLAIN_TILE_ROWS] =
            std::array::from_fn(|r| w.add(if r < wrows { r } else { 0 } * row_bytes));
        let xp: [*const f32; PLAIN_TILE_ACTS] =
            std::array::from_fn(|a| x.add(if a < ACTS { a } else { 0 } * k));
        let mut acc = [[_mm512_setzero_ps(); PLAIN_TILE_ROWS]; PLAIN_TILE_ACTS];
        let mut c = 0;
        while c + 16 <= k {
            let w0 = plain16::<KIND, false>(wp[0].add(c * elem));
            let w1 = plain16::<KIND, false>(wp[1].add(c * elem));
            let w2 = plain16::<KIND, false>(wp[2].add(c * elem));
            let w3 = plain16::<KIND, false>(wp[3].add(c * elem));
            per_act!(ACTS, |a| {
                let xv = _mm512_loadu_ps(xp[a].add(c));
                acc[a][0] = _mm512_fmadd_ps(w0, xv, acc[a][0]);
                acc[a][1] = _mm512_fmadd_ps(w1, xv, acc[a][1]);
                acc[a][2] = _mm512_fmadd_ps(w2, xv, acc[a][2]);
                acc[a][3] = _mm512_fmadd_ps(w3, xv, acc[a][3]);
            });
            c += 16;
        }
        tile_tail_sums::<PLAIN_TILE_ACTS, KIND>(&mut acc, &wp, &xp, ACTS, c, k)
    }

    /// A tile's last 8 columns (`c + 8 ≤ k`; low lanes only, masked) into its accumulators
    /// `acc[a][r]` of activation rows `a < acts`, then each of their accumulators' two 8-lane
    /// halves added and summed: the row dot's vector part (rows from `acts` on: zero). Weight
    /// rows past the tile's real ones are computed and dropped.
    ///
    /// # Safety
    /// AVX2, FMA, F16C and AVX-512 F; `wp` and `xp` point at weight and activation rows of `k`
    /// elements.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn tile_tail_sums<const ACTS: usize, const KIND: u8>(
        acc: &mut [[__m512; PLAIN_TILE_ROWS]; ACTS],
        wp: &[*const u8; PLAIN_TILE_ROWS],
        xp: &[*const f32; ACTS],
        acts: usize,
        c: usize,
        k: usize,
    ) -> [[f32; PLAIN_TILE_ROWS]; ACTS] {
        let elem = if KIND == PLAIN_F32 { 4 } else { 2 };
        // Plain loops, not `array::from_fn` / `map`: a closure handed to those is compiled
        // without this function's target features.
        if c + 8 <= k {
            const LOW: __mmask16 = 0x00FF;
            let mut w = [_mm512_setzero_ps(); PLAIN_TILE_ROWS];
            for (w, &p) in w.iter_mut().zip(wp) {
                *w = plain16::<KIND, true>(p.add(c * elem));
            }
            for (acc, &xp) in acc.iter_mut().zip(xp).take(acts) {
                let xv = _mm512_maskz_loadu_ps(LOW, xp.add(c));
                for (acc, &w) in acc.iter_mut().zip(&w) {
                    *acc = _mm512_mask3_fmadd_ps(w, xv, *acc, LOW);
                }
            }
        }
        let mut sums = [[0f32; PLAIN_TILE_ROWS]; ACTS];
        for (sums, acc) in sums.iter_mut().zip(acc.iter()).take(acts) {
            for (sum, &v) in sums.iter_mut().zip(acc) {
                let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                *sum = hsum_float_8(_mm256_add_ps(_mm512_castps512_ps256(v), high));
            }
        }
        sums
    }

    /// Is `vdpbf16ps` (AVX-512 BF16, Zen 4 and Sapphire Rapids on) usable beside
    /// [`crate::kernels::avx2::vnni_available`]? Detected once; `XDNA_NO_BF16_DOT` (any value)
    /// turns it off, for A/B runs against the f32 register tiles.
    pub fn bf16_dot_available() -> bool {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            crate::kernels::avx2::vnni_available()
                && std::env::var_os("XDNA_NO_BF16_DOT").is_none()
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512bf16")
        })
    }

    /// Rows `rows` of `x` (`k` floats each) rounded to bf16 (nearest, ties to even), `k` per row
    /// into `out`: the activations [`bf16_rows`] takes.
    ///
    /// # Safety
    /// AVX-512 F and BF16 ([`bf16_dot_available`]); `x` holds `rows · k` floats and `out` as many
    /// elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn round_to_bf16(x: &[f32], out: &mut [u16]) {
        let n = x.len().min(out.len());
        let mut i = 0;
        while i < n {
            let live: __mmask16 = if n - i >= 16 {
                !0
            } else {
                (1u16 << (n - i)) - 1
            };
            let v = _mm512_maskz_loadu_ps(live, x.as_ptr().add(i));
            let b: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm256_mask_storeu_epi16(out.as_mut_ptr().add(i) as *mut i16, live, b);
            i += 16;
        }
    }

    /// Weight rows of one register tile of [`bf16_rows`].
    const BF16_TILE_ROWS: usize = 4;
    /// Most activation rows of one register tile of [`bf16_rows`].
    const BF16_TILE_ACTS: usize = 3;

    /// Bf16 weight rows `0 .. rows` of `w` (`k` elements each) against bf16 activation rows
    /// `act_rows` of `x` (`k` each, [`round_to_bf16`]): `out[slot · stride + r]`. One
    /// `vdpbf16ps` takes 32 products (both factors bf16, so each product is exact in f32) into
    /// 16 f32 lanes, twice the multiply-adds of an f32 FMA, and the weights need no conversion.
    /// Tiles of 4 weight rows × 3 activation rows keep 12 accumulators in registers; the last
    /// `k mod 32` elements take one masked step (zeros beyond add nothing), and each sum is the
    /// 16 lanes added in one fixed order, so a row's result does not depend on the tile it ran
    /// in: batched rows have the bits of single rows. Same value as
    /// `kernels::reference::gemm_reference_bf16_activations` up to float summation order.
    ///
    /// # Safety
    /// AVX-512 F, BW and BF16 ([`bf16_dot_available`]); `w` holds `rows` rows of `k` bf16; `x`
    /// holds `k` elements for every row of `act_rows`; `out` holds `(act_rows.len() - 1) ·
    /// stride + rows` floats.
    #[allow(clippy::too_many_arguments)] // one work item's context
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn bf16_rows(
        w: &[u8],
        rows: usize,
        k: usize,
        x: &[u16],
        act_rows: std::ops::Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        let row_bytes = 2 * k;
        for a0 in act_rows.clone().step_by(BF16_TILE_ACTS) {
            let acts = (act_rows.end - a0).min(BF16_TILE_ACTS);
            for r0 in (0..rows).step_by(BF16_TILE_ROWS) {
                let wrows = (rows - r0).min(BF16_TILE_ROWS);
                let (wp, xp) = (w.as_ptr().add(r0 * row_bytes), x.as_ptr().add(a0 * k));
                let sums = match acts {
                    1 => bf16_tile::<1>(wp, row_bytes, wrows, xp, k),
                    2 => bf16_tile::<2>(wp, row_bytes, wrows, xp, k),
                    _ => bf16_tile::<3>(wp, row_bytes, wrows, xp, k),
                };
                for (a, sums) in sums.iter().enumerate().take(acts) {
                    for (r, &sum) in sums.iter().enumerate().take(wrows) {
                        out[(a0 + a - act_rows.start) * stride + r0 + r] = sum;
                    }
                }
            }
        }
    }

    /// One bf16 weight row against one bf16 activation row (`k` elements each): the sum
    /// [`bf16_rows`] gives the pair, in the same per-lane operations and order, so its bits. A
    /// tile's 512-bit accumulator is two independent 256-bit halves (elements 0-15 and 16-31
    /// of each 32), so here they are two 256-bit chains fed by 32-byte loads, joined before the
    /// masked last step and the 16-lane sum: streaming one row from memory, 64-byte loads ran
    /// 12 % slower on Zen 4 (and a single activation row streams best one weight row after the
    /// other, not a tile's four at once).
    ///
    /// # Safety
    /// AVX-512 F, BW, VL, DQ and BF16 ([`bf16_dot_available`]); `w` holds `2 · k` bytes, `x`
    /// `k` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
    pub unsafe fn bf16_dot(w: &[u8], x: &[u16], k: usize) -> f32 {
        let (wp, xp) = (w.as_ptr(), x.as_ptr() as *const u8);
        let load = |p: *const u8| -> __m256bh {
            std::mem::transmute::<__m256i, __m256bh>(_mm256_loadu_si256(p as *const __m256i))
        };
        let (mut low, mut high) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut c = 0;
        while c + 32 <= k {
            prefetch_ahead(wp.wrapping_add(2 * c), 64);
            low = _mm256_dpbf16_ps(low, load(wp.add(2 * c)), load(xp.add(2 * c)));
            high = _mm256_dpbf16_ps(high, load(wp.add(2 * c + 32)), load(xp.add(2 * c + 32)));
            c += 32;
        }
        let mut acc = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(low), high);
        if c < k {
            let live: __mmask32 = (1u32 << (k - c)) - 1;
            let masked = |p: *const u8| -> __m512bh {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(
                    live,
                    p as *const i16,
                ))
            };
            acc = _mm512_dpbf16_ps(acc, masked(wp.add(2 * c)), masked(xp.add(2 * c)));
        }
        _mm512_reduce_add_ps(acc)
    }

    /// One tile of [`bf16_rows`]: the sums of weight rows `0 .. wrows` (`row_bytes` apart from
    /// `w`) against activation rows `0 .. ACTS` (`k` elements apart from `x`),
    /// `[activation][weight]`; entries past `ACTS` / `wrows` are zero.
    ///
    /// # Safety
    /// As [`bf16_rows`], for the rows of this tile.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn bf16_tile<const ACTS: usize>(
        w: *const u8,
        row_bytes: usize,
        wrows: usize,
        x: *const u16,
        k: usize,
    ) -> [[f32; BF16_TILE_ROWS]; BF16_TILE_ACTS] {
        // Weight rows past the tile's real ones repeat its first row (their sums are dropped).
        let wp: [*const u8; BF16_TILE_ROWS] =
            std::array::from_fn(|r| w.add(if r < wrows { r } else { 0 } * row_bytes));
        let xp: [*const u16; BF16_TILE_ACTS] =
            std::array::from_fn(|a| x.add(if a < ACTS { a } else { 0 } * k));
        let mut acc = [[_mm512_setzero_ps(); BF16_TILE_ROWS]; BF16_TILE_ACTS];
        macro_rules! step {
            ($live:expr, $c:expr) => {{
                let (live, c): (__mmask32, usize) = ($live, $c);
                macro_rules! load {
                    ($p:expr) => {
                        std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(
                            live,
                            $p as *const i16,
                        ))
                    };
                }
                let w0 = load!(wp[0].add(2 * c));
                let w1 = load!(wp[1].add(2 * c));
                let w2 = load!(wp[2].add(2 * c));
                let w3 = load!(wp[3].add(2 * c));
                per_act!(ACTS, |a| {
                    let xv = load!(xp[a].add(c));
                    acc[a][0] = _mm512_dpbf16_ps(acc[a][0], w0, xv);
                    acc[a][1] = _mm512_dpbf16_ps(acc[a][1], w1, xv);
                    acc[a][2] = _mm512_dpbf16_ps(acc[a][2], w2, xv);
                    acc[a][3] = _mm512_dpbf16_ps(acc[a][3], w3, xv);
                });
            }};
        }
        let mut c = 0;
        while c + 32 <= k {
            step!(!0, c);
            c += 32;
        }
        if c < k {
            step!((1u32 << (k - c)) - 1, c);
        }
        let mut sums = [[0f32; BF16_TILE_ROWS]; BF16_TILE_ACTS];
        per_act!(ACTS, |a| {
            sums[a] = [
                _mm512_reduce_add_ps(acc[a][0]),
                _mm512_reduce_add_ps(acc[a][1]),
                _mm512_reduce_add_ps(acc[a][2]),
                _mm512_reduce_add_ps(acc[a][3]),
            ];
        });
        sums
    }
}
