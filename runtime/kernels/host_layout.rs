//! The host executor's own weight layout: tiles re-laid as contiguous per-group records.
//!
//! A package stores K zero-padded to the 256-column tile width, and inside a tile a group's
//! scales, mins and codes sit in three separate areas. On the NPU that is the DMA layout; on the
//! CPU it costs bandwidth: for SmolLM2's K = 576 a third of every row block's last tile is padding
//! that the hardware prefetcher streams in anyway (123 MB stored for 96 MB used per token), and
//! each group is three short streams instead of one. So the host backend repacks q4_1 and Q8
//! matrices once at load into *group records*: per 32-row block, one record per 32-column group
//! that holds real columns, back to back —
//!
//! - q4_1: 32 scales (64 B), 32 mins (64 B), then the group's 32 columns of codes in column-major
//!   nibble order (`c * 16 + r / 2`, 512 B): 640 B;
//! - Q8: 32 scales (64 B), then the 32 columns of codes column-major (`c * 32 + r`, 1024 B): 1088 B.
//!
//! Scales keep their stored type (bf16 or f16), codes their stored bits, so a record is a tile of
//! one group and the AVX2 kernels read it through the same code with `groups_per_tile = 1`. Every
//! row's arithmetic is the tile kernels' (same groups, same order): results are bit-identical.
//! Devices never see this layout; it is built only for matrices the host executor runs.
//!
//! IQ4_NL, Q5_0 and Q5_1 matrices (GGUF rows of 32-value blocks: f16 scales, Q5's fifth bits,
//! 16 bytes of nibbles) get a layout of their own on CPUs with AVX-512 VNNI, *interleaved rows*:
//! a single activation row then takes one `vpdpbusd` per four values of eight weight rows, its
//! activations broadcast, instead of a horizontal sum per weight row (`ggml_dot::interleaved`).
//! Per group of 8 weight rows (rows past the matrix's last are zero) and per 32-value block
//! column, eight blocks' bytes, each field for the 8 rows together:
//!
//! - the rows' f16 `d` (16 B) and, Q5_1, their f16 `m` (16 B);
//! - Q5_0, Q5_1: the fifth bits, byte `β` of every row's `qh` together (`8β + r`, 32 B), so eight
//!   bytes are the fifth bits of one register of codes;
//! - nibble bytes 0-7 of each row, row after row (`8r + k`, 64 B), then nibble bytes 8-15 (64 B).
//!
//! A column is 144 (IQ4_NL), 176 (Q5_0) or 192 bytes (Q5_1). Groups follow each other, a group's
//! block columns in order. Bytes are the file's, moved: [`deinterleave_rows`] gives back the GGUF
//! rows exactly.
//!
//! GGUF Q4_K and Q5_K matrices (whole 32-row blocks) become *K tiles* on CPUs whose fast path
//! is AVX2 without VNNI: the Q4_K tile of the device format (4736 B per 32 rows × 256 columns:
//! the 6-bit scales `s8` at `g·32 + r`, the 6-bit minimums `m8` at `256 + g·32 + r`, the codes
//! column-major from 512, then per row the super-block scale `d` and the negated `dmin`), with
//! `d` and `−dmin` kept in f16, as the file has them, instead of the device's bf16. Q5_K's tile
//! holds the low four bits of its codes so, followed by a 1024-byte plane of the fifth bits laid
//! out as the kernels' unpacked vectors take them ([`K_TILE_FIFTH_BITS`]). A 256-value GGUF block
//! is one row of one tile, so every weight is the file's (`d·s8·q − dmin·m8`), and the 4-bit tile
//! kernels run Q4_K and Q5_K as they run q4_1: sixteen activation rows share one unpack of the
//! codes, and a group's 32 values of 32 rows are summed in i16 (Q5_K: per half group) before one
//! widening, where the GGUF row kernel takes a widening per row and group. [`k_tiles_to_rows`]
//! gives back the GGUF rows exactly. IQ4_XS matrices become K tiles of their own: the i8
//! sub-block scales at `g·32 + r`, the 4-bit `IQ4_TABLE` indices column-major from
//! [`K_TILE_IQ4_CODES`], the rows' f16 `d` at [`K_TILE_IQ4_ROW_SCALES`]; the kernels take each
//! value plus 128 as two 4-bit planes. Every layout is re-laid in parallel over the pool.

// Unsafe is needed for disjoint chunk writes through the pool's shared-buffer handle.
#![allow(unsafe_code)]

use super::gemm::WeightMatrix;
use super::pool::{ChunkCounter, Pool, SharedMut};
use super::KernelError;
use crate::ggml::GgmlType;
use crate::tiles::{self, TileOrder, WeightFormat, GROUP, GROUPS, TILE_ROWS};

/// How a tiled matrix's bytes are arranged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Packing {
    /// The format's tile grid: what packages store and devices receive.
    #[default]
    Tiles,
    /// Per-group records without tile padding (q4_1 and Q8 only); see the module docs.
    GroupRecords,
    /// GGUF blocks with 8 weight rows interleaved (IQ4_NL, Q5_0, Q5_1); see the module docs.
    InterleavedRows,
    /// GGUF Q4_K, Q5_K or IQ4_XS rows re-laid as tiles with f16 row scales (Q5_K with a
    /// fifth-bit plane; exactly); see the module docs.
    KTiles,
}

/// Weight rows interleaved in [`Packing::InterleavedRows`].
pub const INTERLEAVED_ROWS: usize = 8;

/// One run of bytes of a GGUF block in [`Packing::InterleavedRows`]: block bytes `src .. src +
/// len` of row `r` of a group go to `dst + r · len` of the group's block column.
#[derive(Clone, Copy)]
struct Field {
    src: usize,
    len: usize,
    dst: usize,
}

const fn field(src: usize, len: usize, dst: usize) -> Field {
    Field { src, len, dst }
}

/// IQ4_NL: `d`, then nibble bytes 0-7 and 8-15 (module docs).
const IQ4_NL_FIELDS: [Field; 3] = [field(0, 2, 0), field(2, 8, 16), field(10, 8, 80)];

/// Q5_0: `d`, the four bytes of `qh` one by one (byte `β` of row `r` at `16 + 8β + r`), then
/// nibble bytes 0-7 and 8-15 (module docs).
const Q5_0_FIELDS: [Field; 7] = [
    field(0, 2, 0),
    field(2, 1, 16),
    field(3, 1, 24),
    field(4, 1, 32),
    field(5, 1, 40),
    field(6, 8, 48),
    field(14, 8, 112),
];

/// Q5_1: `d`, `m`, the four bytes of `qh` one by one (at `32 + 8β + r`), then nibble bytes 0-7
/// and 8-15 (module docs).
const Q5_1_FIELDS: [Field; 8] = [
    field(0, 2, 0),
    field(2, 2, 16),
    field(4, 1, 32),
    field(5, 1, 40),
    field(6, 1, 48),
    field(7, 1, 56),
    field(8, 8, 64),
    field(16, 8, 128),
];

/// Where the fields of an 8-row block column start, as the interleaved kernels read them: the
/// rows' `m` (Q5_1; 0 where the type has none), their fifth bits (Q5_0, Q5_1; byte `β` of every
/// row's `qh` together), the two registers of nibbles; and the column's bytes. Derived from the
/// field tables above, so the kernels and the packing share one layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InterleavedColumn {
    /// Offset of the eight rows' `m` (f16 each).
    pub m: usize,
    /// Offset of the transposed fifth bits (eight bytes per `qh` byte).
    pub fifth: usize,
    /// Offset of the 128 bytes of nibbles.
    pub nibbles: usize,
    /// Bytes of the column.
    pub bytes: usize,
}

/// Where the run taken from block byte `src` lands in a column of `fields` (0 if none does).
const fn column_offset(fields: &[Field], src: usize) -> usize {
    let mut i = 0;
    while i < fields.len() {
        if fields[i].src == src {
            return fields[i].dst;
        }
        i += 1;
    }
    0
}

/// Bytes of a column of `fields`: every field once per row of the group.
const fn column_bytes(fields: &[Field]) -> usize {
    let (mut i, mut bytes) = (0, 0);
    while i < fields.len() {
        bytes += INTERLEAVED_ROWS * fields[i].len;
        i += 1;
    }
    bytes
}

/// IQ4_NL's column: `d` at block byte 0, nibbles from byte 2.
pub const IQ4_NL_COLUMN: InterleavedColumn = InterleavedColumn {
    m: 0,
    fifth: 0,
    nibbles: column_offset(&IQ4_NL_FIELDS, 2),
    bytes: column_bytes(&IQ4_NL_FIELDS),
};

/// Q5_0's column: `d` at block byte 0, `qh` from byte 2, nibbles from byte 6.
pub const Q5_0_COLUMN: InterleavedColumn = InterleavedColumn {
    m: 0,
    fifth: column_offset(&Q5_0_FIELDS, 2),
    nibbles: column_offset(&Q5_0_FIELDS, 6),
    bytes: column_bytes(&Q5_0_FIELDS),
};

/// Q5_1's column: `d` at block byte 0, `m` at 2, `qh` from byte 4, nibbles from byte 8.
pub const Q5_1_COLUMN: InterleavedColumn = InterleavedColumn {
    m: column_offset(&Q5_1_FIELDS, 2),
    fifth: column_offset(&Q5_1_FIELDS, 4),
    nibbles: column_offset(&Q5_1_FIELDS, 8),
    bytes: column_bytes(&Q5_1_FIELDS),
};

/// The fields of a GGUF block of `format` in [`Packing::InterleavedRows`], or `None` if the
/// format has no interleaved layout.
fn interleaved_fields(format: WeightFormat) -> Option<&'static [Field]> {
    match format {
        WeightFormat::Ggml(GgmlType::IQ4_NL) => Some(&IQ4_NL_FIELDS),
        WeightFormat::Ggml(GgmlType::Q5_0) => Some(&Q5_0_FIELDS),
        WeightFormat::Ggml(GgmlType::Q5_1) => Some(&Q5_1_FIELDS),
        _ => None,
    }
}

/// Bytes of one block column of an 8-row group of `format` in [`Packing::InterleavedRows`]
/// (eight GGUF blocks), or `None` if the format has no interleaved layout.
pub fn interleaved_block_bytes(format: WeightFormat) -> Option<usize> {
    interleaved_fields(format).map(column_bytes)
}

/// Bytes of a `[rows, cols]` matrix with interleaved rows (rows rounded up to a whole group).
pub fn interleaved_matrix_bytes(
    format: WeightFormat,
    rows: usize,
    cols: usize,
) -> Result<usize, tiles::TileError> {
    interleaved_fields(format).ok_or_else(|| {
        tiles::TileError::UnknownFormat(format!("{} interleaved rows", format.name()))
    })?;
    // Whole blocks per row (the GGUF layout's check); a group holds 8 rows' bytes.
    let row_bytes = format.matrix_bytes(1, cols)?;
    Ok(rows.div_ceil(INTERLEAVED_ROWS) * INTERLEAVED_ROWS * row_bytes)
}

/// `fill(i, chunk)` for every `chunk_bytes`-long chunk of `packed` (its index `i`), the chunks
/// split over the worker pool when there are enough of them. Every host layout is made of
/// independent chunks (a K tile, 8 interleaved rows, a row block of group records), and a load
/// re-lays each matrix once, so the re-layout is most of the load's time beyond the file.
fn fill_chunks(packed: &mut [u8], chunk_bytes: usize, fill: impl Fn(usize, &mut [u8]) + Sync) {
    // Below this many chunks a pool dispatch costs more than it saves.
    const PARALLEL_MIN_CHUNKS: usize = 16;
    if chunk_bytes == 0 {
        return;
    }
    let count = packed.len() / chunk_bytes;
    let pool = Pool::global();
    if pool.threads() < 2 || count < PARALLEL_MIN_CHUNKS {
        for (i, chunk) in packed.chunks_exact_mut(chunk_bytes).enumerate() {
            fill(i, chunk);
        }
        return;
    }
    let counter = ChunkCounter::new(count, pool.threads(), 4);
    let shared = SharedMut::new(packed);
    pool.run(&|_, _| {
        while let Some(range) = counter.claim() {
            for i in range {
                // SAFETY: each chunk index is claimed by exactly one thread, so the chunks' byte
                // ranges are disjoint.
                let chunk = unsafe { shared.slice_mut(i * chunk_bytes..(i + 1) * chunk_bytes) };
                fill(i, chunk);
            }
        }
    });
}

/// [`Packing::InterleavedRows`] bytes of `w`, a matrix in its GGUF row layout, appended to
/// `out`. Returns false, appending nothing, when the format has no interleaved layout. A
/// matrix can be packed a stripe of rows at a time into one buffer when every stripe but the
/// last holds whole groups of 8 rows.
pub fn append_interleaved_rows(
    w: &WeightMatrix<'_>,
    out: &mut Vec<u8>,
) -> Result<bool, KernelError> {
    let (format, rows, cols) = (w.format, w.rows, w.cols);
    let (Some(fields), Some(block)) = (interleaved_fields(format), interleaved_block_bytes(format))
    else {
        return Ok(false);
    };
    w.require_tiles("interleaving rows")?;
    w.check_bytes()?;
    let added =
        interleaved_matrix_bytes(format, rows, cols).map_err(|source| KernelError::Weight {
            format: format.name(),
            rows,
            cols,
            source,
        })?;
    let row_block = block / INTERLEAVED_ROWS;
    let row_bytes = w.data.len() / rows.max(1);
    let group_bytes = row_bytes * INTERLEAVED_ROWS;
    if group_bytes == 0 {
        return Ok(true);
    }
    let start = out.len();
    out.resize(start + added, 0);
    let data = w.data;
    fill_chunks(&mut out[start..], group_bytes, |g, dst_group| {
        let first = g * INTERLEAVED_ROWS;
        for r in 0..INTERLEAVED_ROWS.min(rows - first) {
            let src = &data[(first + r) * row_bytes..(first + r + 1) * row_bytes];
            for (dst, b) in dst_group
                .chunks_exact_mut(block)
                .zip(src.chunks_exact(row_block))
            {
                for f in fields {
                    let to = f.dst + r * f.len;
                    dst[to..to + f.len].copy_from_slice(&b[f.src..f.src + f.len]);
                }
            }
        }
    });
    Ok(true)
}

/// The GGUF bytes of rows `rows` (whole rows of `cols` values of `format`) of a matrix in
/// [`Packing::InterleavedRows`] (`data`), into `out` (`rows.len()` rows): the inverse of
/// [`append_interleaved_rows`], for the paths that read GGUF rows.
pub fn deinterleave_rows(
    format: WeightFormat,
    data: &[u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    out: &mut [u8],
) {
    let (Some(fields), Some(block), Ok(row_bytes)) = (
        interleaved_fields(format),
        interleaved_block_bytes(format),
        format.matrix_bytes(1, cols),
    ) else {
        return;
    };
    let (row_block, group_bytes) = (block / INTERLEAVED_ROWS, row_bytes * INTERLEAVED_ROWS);
    if row_bytes == 0 {
        return;
    }
    for (row, dst_row) in rows.zip(out.chunks_exact_mut(row_bytes)) {
        let (g, r) = (row / INTERLEAVED_ROWS, row % INTERLEAVED_ROWS);
        let group = &data[g * group_bytes..(g + 1) * group_bytes];
        for (src, dst) in group
            .chunks_exact(block)
            .zip(dst_row.chunks_exact_mut(row_block))
        {
            for f in fields {
                let from = f.dst + r * f.len;
                dst[f.src..f.src + f.len].copy_from_slice(&src[from..from + f.len]);
            }
        }
    }
}

/// Offset of the per-row super-block scales in a K tile (f16 `d`; the negated `dmin` follows).
const K_TILE_ROW_SCALES: usize = 4608;
/// Offset of a Q5_K K tile's fifth-bit plane: right after the Q4_K tile of its low four bits.
pub const K_TILE_FIFTH_BITS: usize = tiles::Q4K_TILE_BYTES;
/// Bytes of the fifth-bit plane: per group and slot vector, 32 bytes.
const FIFTH_BITS_BYTES: usize = GROUPS * 4 * 32;

/// Offset of the codes (`IQ4_TABLE` indices) in an IQ4_XS K tile, after the i8 scales.
pub const K_TILE_IQ4_CODES: usize = 256;
/// Offset of the per-row f16 super-block scales `d` in an IQ4_XS K tile, after the codes.
pub const K_TILE_IQ4_ROW_SCALES: usize = K_TILE_IQ4_CODES + GROUPS * GROUP * TILE_ROWS / 2;

/// The GGUF types that have a [`Packing::KTiles`] layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KTileType {
    /// Q4_K: the Q4_K tile of the device format.
    Q4K,
    /// Q5_K: the Q4_K tile of the low four bits, then the fifth-bit plane.
    Q5K,
    /// IQ4_XS: i8 sub-block scales, the 4-bit table indices column-major, the rows' f16 `d`.
    Iq4Xs,
}

impl KTileType {
    /// The K-tile type of `format`, if it has one.
    pub fn of(format: WeightFormat) -> Option<Self> {
        match format {
            WeightFormat::Ggml(GgmlType::Q4_K) => Some(Self::Q4K),
            WeightFormat::Ggml(GgmlType::Q5_K) => Some(Self::Q5K),
            WeightFormat::Ggml(GgmlType::IQ4_XS) => Some(Self::Iq4Xs),
            _ => None,
        }
    }

    /// Bytes of one GGUF block (256 values of one row).
    fn block_bytes(self) -> usize {
        match self {
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Iq4Xs => 136,
        }
    }

    /// Offset of the nibbles (`qs`) in a GGUF block; Q5_K's `qh` sits between the scales and them.
    fn nibbles(self) -> usize {
        match self {
            Self::Q4K => 16,
            Self::Q5K => 48,
            Self::Iq4Xs => 8,
        }
    }

    /// Bytes of one K tile (32 rows × 256 columns).
    pub fn tile_bytes(self) -> usize {
        match self {
            Self::Q4K => tiles::Q4K_TILE_BYTES,
            Self::Q5K => tiles::Q4K_TILE_BYTES + FIFTH_BITS_BYTES,
            Self::Iq4Xs => K_TILE_IQ4_ROW_SCALES + 2 * TILE_ROWS,
        }
    }
}

/// Each row's place in the 4-bit kernels' slot order (`avx2::Q4_SLOT_ROWS` inverted).
const Q4_SLOT_INDEX: [usize; TILE_ROWS] = {
    let mut index = [0; TILE_ROWS];
    let mut p = 0;
    while p < TILE_ROWS {
        index[super::avx2::Q4_SLOT_ROWS[p]] = p;
        p += 1;
    }
    index
};

/// Where the fifth bit of row `r`, column `c` (of 256) of a K tile lives: `(byte offset in the
/// tile, bit)`. Per group g and slot vector s, 32 bytes at `K_TILE_FIFTH_BITS + g·128 + s·32`;
/// byte i holds the fifth bits of the 4-bit kernels' unpacked vector `(quad q, slot s)` byte i in
/// bit q. That byte multiplies column `32g + 4q + i mod 4` of row `Q4_SLOT_ROWS[8s + i/4]`
/// (`avx2::q4_unpack_quad`), so one 32-byte load gives a slot's fifth bits for all 8 quads.
fn fifth_bit_pos(r: usize, c: usize) -> (usize, u8) {
    let slot_index = Q4_SLOT_INDEX[r];
    let (g, q, lane) = (c / GROUP, (c % GROUP) / 4, c % 4);
    let (s, j) = (slot_index / 8, slot_index % 8);
    (K_TILE_FIFTH_BITS + g * 128 + s * 32 + 4 * j + lane, 1 << q)
}

/// Row `r`'s scales of an IQ4_XS K tile from its GGUF block (136 bytes: f16 `d`, the scales' top
/// two bits (`scales_h`, a u16) and low nibbles (`scales_l`, 4 bytes), then per 32-value sub-block
/// 16 bytes of index nibbles, low nibbles first): `s8 = ls − 32` at `g·32 + r`, `d` at
/// [`K_TILE_IQ4_ROW_SCALES`] `+ 2r`. The indices go column-major from [`K_TILE_IQ4_CODES`].
fn iq4xs_scales_into_tile(block: &[u8], r: usize, tile: &mut [u8]) {
    tile[K_TILE_IQ4_ROW_SCALES + 2 * r..][..2].copy_from_slice(&block[0..2]);
    let high = u16::from_le_bytes([block[2], block[3]]);
    for g in 0..GROUPS {
        let low = (block[4 + g / 2] >> (4 * (g % 2))) & 0x0F;
        let top = ((high >> (2 * g)) & 3) as u8;
        tile[tiles::cell(g, r)] = ((low | (top << 4)) as i8 - 32) as u8;
    }
}

/// The GGUF IQ4_XS block of row `r` of a K tile: the inverse of [`iq4xs_scales_into_tile`] and
/// of the codes of [`k_tile_from_blocks`].
fn iq4xs_block_from_tile(tile: &[u8], r: usize, block: &mut [u8]) {
    block[0..2].copy_from_slice(&tile[K_TILE_IQ4_ROW_SCALES + 2 * r..][..2]);
    block[2..].fill(0);
    let mut high = 0u16;
    for g in 0..GROUPS {
        let ls = (tile[tiles::cell(g, r)] as i8 as i16 + 32) as u16;
        high |= (ls >> 4) << (2 * g);
        block[4 + g / 2] |= ((ls & 0x0F) as u8) << (4 * (g % 2));
        for i in 0..GROUP {
            let (pos, upper) = tiles::q4_code_pos(tiles::TileOrder::ColumnMajor, r, g * GROUP + i);
            let byte = tile[K_TILE_IQ4_CODES + pos];
            let n = if upper { byte >> 4 } else { byte & 0x0F };
            if i < 16 {
                block[8 + 16 * g + i] |= n;
            } else {
                block[8 + 16 * g + i - 16] |= n << 4;
            }
        }
    }
    block[2..4].copy_from_slice(&high.to_le_bytes());
}

/// One K tile (zeroed, `ty.tile_bytes()` long) from the GGUF blocks of its 32 rows (`block(r)`).
/// Two rows at a time: the column-major code area holds rows `2j` and `2j + 1` of a column in one
/// byte, so each code byte is written once, whole.
fn k_tile_from_blocks<'a>(ty: KTileType, block: impl Fn(usize) -> &'a [u8], tile: &mut [u8]) {
    let codes_at = match ty {
        KTileType::Iq4Xs => K_TILE_IQ4_CODES,
        KTileType::Q4K | KTileType::Q5K => 512,
    };
    let mut codes = [[0u8; tiles::TILE_COLS]; 2];
    for pair in 0..TILE_ROWS / 2 {
        for (half, row_codes) in codes.iter_mut().enumerate() {
            let r = 2 * pair + half;
            let block = block(r);
            if ty == KTileType::Iq4Xs {
                iq4xs_scales_into_tile(block, r, tile);
            } else {
                k_quant_scales_into_tile(block, r, tile);
                if ty == KTileType::Q5K {
                    fifth_bits_into_tile(&block[16..48], r, tile);
                }
            }
            // Group 2c: the low nibbles of qs[32c ..], group 2c + 1: their high nibbles (Q4_K and
            // Q5_K); sub-block g: the low nibbles of qs[16g ..] then their high nibbles (IQ4_XS).
            let qs = &block[ty.nibbles()..];
            for (g, group) in row_codes.chunks_exact_mut(GROUP).enumerate() {
                let (bytes, shift) = match ty {
                    KTileType::Iq4Xs => (&qs[16 * g..][..16], 0),
                    KTileType::Q4K | KTileType::Q5K => (&qs[32 * (g / 2)..][..GROUP], 4 * (g % 2)),
                };
                if ty == KTileType::Iq4Xs {
                    for (i, &byte) in bytes.iter().enumerate() {
                        group[i] = byte & 0x0F;
                        group[i + 16] = byte >> 4;
                    }
                } else {
                    for (code, &byte) in group.iter_mut().zip(bytes) {
                        *code = (byte >> shift) & 0x0F;
                    }
                }
            }
        }
        for (c, (&even, &odd)) in codes[0].iter().zip(&codes[1]).enumerate() {
            let (pos, _) = tiles::q4_code_pos(tiles::TileOrder::ColumnMajor, 2 * pair, c);
            tile[codes_at + pos] = even | (odd << 4);
        }
    }
}

/// Row `r`'s scales of a Q4_K / Q5_K K tile from its GGUF block: the 6-bit group scales and
/// minimums at `cell(g, r)` and `256 + cell(g, r)`, `d` and `−dmin` at [`K_TILE_ROW_SCALES`].
fn k_quant_scales_into_tile(block: &[u8], r: usize, tile: &mut [u8]) {
    tile[K_TILE_ROW_SCALES + 2 * r..][..2].copy_from_slice(&block[0..2]);
    // −dmin: the f16 sign bit flipped, so the tile's `M·m8` is the file's `−dmin·m`.
    let neg_dmin = u16::from_le_bytes([block[2], block[3]]) ^ 0x8000;
    tile[K_TILE_ROW_SCALES + 64 + 2 * r..][..2].copy_from_slice(&neg_dmin.to_le_bytes());
    for g in 0..GROUPS {
        let (sc, m) = crate::ggml::scale_min_k4(g, &block[4..16]);
        tile[tiles::cell(g, r)] = sc;
        tile[256 + tiles::cell(g, r)] = m;
    }
}

/// Row `r`'s fifth bits of a Q5_K K tile from its block's `qh` (bit g of `qh[i]` is the fifth bit
/// of value i of group g), four plane bytes per group at once: byte `lane` of [`fifth_bit_pos`]'s
/// word holds, in bit q, the fifth bit of column `4q + lane` of the group.
fn fifth_bits_into_tile(qh: &[u8], r: usize, tile: &mut [u8]) {
    for g in 0..GROUPS {
        let mut word = 0u32;
        for (q, quad) in qh.chunks_exact(4).enumerate() {
            let bits = u32::from_le_bytes([quad[0], quad[1], quad[2], quad[3]]);
            // Bit g of each byte to bit q of the same byte.
            word |= ((bits >> g) & 0x0101_0101) << q;
        }
        let (at, _) = fifth_bit_pos(r, g * GROUP);
        tile[at..at + 4].copy_from_slice(&word.to_le_bytes());
    }
}

/// Bytes of a `[rows, cols]` GGUF Q4_K, Q5_K or IQ4_XS matrix as [`Packing::KTiles`].
pub fn k_tiles_matrix_bytes(
    format: WeightFormat,
    rows: usize,
    cols: usize,
) -> Result<usize, tiles::TileError> {
    let Some(ty) = KTileType::of(format) else {
        return Err(tiles::TileError::UnknownFormat(format!(
            "{} K tiles",
            format.name()
        )));
    };
    if !rows.is_multiple_of(TILE_ROWS) {
        return Err(tiles::TileError::NotMultiple {
            what: "K-tiled matrix rows",
            value: rows,
            multiple: TILE_ROWS,
        });
    }
    // Whole 256-value blocks per row (the GGUF layout's own check).
    format.matrix_bytes(1, cols)?;
    Ok(rows / TILE_ROWS * cols / tiles::TILE_COLS * ty.tile_bytes())
}

/// Whether a matrix of `format` and `rows` has a [`Packing::KTiles`] layout.
pub fn has_k_tiles(format: WeightFormat, rows: usize) -> bool {
    KTileType::of(format).is_some() && rows.is_multiple_of(TILE_ROWS)
}

/// [`Packing::KTiles`] bytes of `w`, a Q4_K, Q5_K or IQ4_XS matrix in its GGUF row layout, appended to
/// `out`. Returns false, appending nothing, when it has no K-tile layout ([`has_k_tiles`]). A
/// matrix can be packed a stripe of whole 32-row blocks at a time into one buffer.
pub fn append_k_tiles(w: &WeightMatrix<'_>, out: &mut Vec<u8>) -> Result<bool, KernelError> {
    let (format, rows, cols) = (w.format, w.rows, w.cols);
    let Some(ty) = KTileType::of(format).filter(|_| has_k_tiles(format, rows)) else {
        return Ok(false);
    };
    w.require_tiles("re-laying GGUF rows as K tiles")?;
    w.check_bytes()?;
    let added = k_tiles_matrix_bytes(format, rows, cols).map_err(|source| KernelError::Weight {
        format: format.name(),
        rows,
        cols,
        source,
    })?;
    let blocks_per_row = cols / tiles::TILE_COLS;
    let block_bytes = ty.block_bytes();
    let row_bytes = blocks_per_row * block_bytes;
    let tile_bytes = ty.tile_bytes();
    let start = out.len();
    out.resize(start + added, 0);
    let data = w.data;
    fill_chunks(&mut out[start..], tile_bytes, |t, tile| {
        let (row_block, b) = (t / blocks_per_row, t % blocks_per_row);
        let block = |r: usize| {
            let at = (row_block * TILE_ROWS + r) * row_bytes + b * block_bytes;
            &data[at..at + block_bytes]
        };
        k_tile_from_blocks(ty, block, tile);
    });
    Ok(true)
}

/// The GGUF bytes of rows `rows` (whole rows of `cols` values) of a `format` matrix in
/// [`Packing::KTiles`] (`data`), into `out` (`rows.len()` rows): the inverse of
/// [`append_k_tiles`], for the paths that read GGUF rows. Writes nothing for a format without K
/// tiles.
pub fn k_tiles_to_rows(
    format: WeightFormat,
    data: &[u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    out: &mut [u8],
) {
    let Some(ty) = KTileType::of(format) else {
        return;
    };
    let blocks_per_row = cols / tiles::TILE_COLS;
    let block_bytes = ty.block_bytes();
    let row_bytes = blocks_per_row * block_bytes;
    if row_bytes == 0 {
        return;
    }
    let tile_bytes = ty.tile_bytes();
    for (row, dst_row) in rows.zip(out.chunks_exact_mut(row_bytes)) {
        let (row_block, r) = (row / TILE_ROWS, row % TILE_ROWS);
        for (b, block) in dst_row.chunks_exact_mut(block_bytes).enumerate() {
            let t = row_block * blocks_per_row + b;
            let tile = &data[t * tile_bytes..(t + 1) * tile_bytes];
            if ty == KTileType::Iq4Xs {
                iq4xs_block_from_tile(tile, r, block);
                continue;
            }
            block[0..2].copy_from_slice(&tile[K_TILE_ROW_SCALES + 2 * r..][..2]);
            let m_row = &tile[K_TILE_ROW_SCALES + 64 + 2 * r..][..2];
            let dmin = u16::from_le_bytes([m_row[0], m_row[1]]) ^ 0x8000;
            block[2..4].copy_from_slice(&dmin.to_le_bytes());
            let (sc, m): ([u8; 8], [u8; 8]) = (
                std::array::from_fn(|g| tile[tiles::cell(g, r)]),
                std::array::from_fn(|g| tile[256 + tiles::cell(g, r)]),
            );
            // ggml's 12-byte packing of eight 6-bit pairs (`scale_min_k4` reads it back).
            for j in 0..4 {
                block[4 + j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
                block[8 + j] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
                block[12 + j] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
            }
            block[16..].fill(0);
            for g in 0..tiles::GROUPS {
                for i in 0..GROUP {
                    let (pos, high) =
                        tiles::q4_code_pos(tiles::TileOrder::ColumnMajor, r, g * GROUP + i);
                    let byte = tile[512 + pos];
                    let q = if high { byte >> 4 } else { byte & 0x0F };
                    block[ty.nibbles() + 32 * (g / 2) + i] |= if g % 2 == 0 { q } else { q << 4 };
                    if ty == KTileType::Q5K {
                        let (at, bit) = fifth_bit_pos(r, g * GROUP + i);
                        if tile[at] & bit != 0 {
                            block[16 + i] |= 1 << g;
                        }
                    }
                }
            }
        }
    }
}

/// Offset of the min area in a q4_1 record.
pub const Q41_RECORD_MINS: usize = 64;
/// Offset of the codes in a q4_1 record.
pub const Q41_RECORD_CODES: usize = 128;
/// Bytes of a q4_1 record.
pub const Q41_RECORD_BYTES: usize = Q41_RECORD_CODES + GROUP * TILE_ROWS / 2;
/// Offset of the codes in a Q8 record.
pub const Q8_RECORD_CODES: usize = 64;
/// Bytes of a Q8 record.
pub const Q8_RECORD_BYTES: usize = Q8_RECORD_CODES + GROUP * TILE_ROWS;

/// Bytes of one group record of `format`, or `None` if the format has no record layout.
pub fn record_bytes(format: WeightFormat) -> Option<usize> {
    match format {
        WeightFormat::Q41 { .. } => Some(Q41_RECORD_BYTES),
        WeightFormat::Q8 { .. } => Some(Q8_RECORD_BYTES),
        _ => None,
    }
}

/// Bytes of a `[rows, cols]` matrix as group records.
pub fn records_matrix_bytes(
    format: WeightFormat,
    rows: usize,
    cols: usize,
) -> Result<usize, tiles::TileError> {
    let record = record_bytes(format)
        .ok_or_else(|| tiles::TileError::UnknownFormat(format!("{} records", format.name())))?;
    if !rows.is_multiple_of(TILE_ROWS) {
        return Err(tiles::TileError::NotMultiple {
            what: "tiled matrix rows",
            value: rows,
            multiple: TILE_ROWS,
        });
    }
    Ok(rows / TILE_ROWS * cols.div_ceil(GROUP) * record)
}

/// The group records of `w`, a matrix in its format's tile grid, or `None` when the format has no
/// record layout (Q4_K, the legacy q8 tile, plain formats), in which case the host executor keeps
/// the tiles. Either tile order is accepted; records are column-major.
pub fn pack_group_records(w: &WeightMatrix<'_>) -> Result<Option<Vec<u8>>, KernelError> {
    let mut out = Vec::new();
    Ok(append_group_records(w, &mut out)?.then_some(out))
}

/// [`pack_group_records`] appending to `out` (row blocks are independent, so a matrix can be
/// packed a stripe of row blocks at a time into one buffer). Returns false, appending nothing,
/// when the format has no record layout.
pub fn append_group_records(w: &WeightMatrix<'_>, out: &mut Vec<u8>) -> Result<bool, KernelError> {
    let (format, rows, cols, data) = (w.format, w.rows, w.cols, w.data);
    let Some(record) = record_bytes(format) else {
        return Ok(false);
    };
    w.require_tiles("repacking into group records")?;
    w.check_bytes()?;
    let added = records_matrix_bytes(format, rows, cols).map_err(|source| KernelError::Weight {
        format: format.name(),
        rows,
        cols,
        source,
    })?;
    let tile_bytes = format.tile_bytes().unwrap_or(0);
    let tiles_per_block = format.padded_cols(cols) / tiles::TILE_COLS;
    let groups = cols.div_ceil(GROUP);
    let start = out.len();
    out.resize(start + added, 0);
    fill_chunks(&mut out[start..], groups * record, |block, dst_block| {
        for (gg, dst) in dst_block.chunks_exact_mut(record).enumerate() {
            let t = block * tiles_per_block + gg / GROUPS;
            let tile = &data[t * tile_bytes..(t + 1) * tile_bytes];
            group_record(format, tile, gg % GROUPS, dst);
        }
    });
    Ok(true)
}

/// Copy group `g` of `tile` into the record `dst` (`record_bytes(format)` long).
fn group_record(format: WeightFormat, tile: &[u8], g: usize, dst: &mut [u8]) {
    // Scales (and mins) are group-major in a tile: group g's 32 cells are 64 contiguous bytes.
    let cells = 2 * TILE_ROWS;
    match format {
        WeightFormat::Q41 { order, .. } => {
            dst[..cells].copy_from_slice(&tile[g * cells..(g + 1) * cells]);
            let mins = tiles::Q41_MINS + g * cells;
            dst[Q41_RECORD_MINS..Q41_RECORD_MINS + cells]
                .copy_from_slice(&tile[mins..mins + cells]);
            let codes = &mut dst[Q41_RECORD_CODES..];
            if order == TileOrder::ColumnMajor {
                // Already column-major: the group's 32 columns are 512 contiguous bytes.
                let at = tiles::Q41_CODES + g * codes.len();
                codes.copy_from_slice(&tile[at..at + codes.len()]);
                return;
            }
            for c in 0..GROUP {
                for r in 0..TILE_ROWS {
                    let (src, high) = tiles::q4_code_pos(order, r, g * GROUP + c);
                    let byte = tile[tiles::Q41_CODES + src];
                    let q = if high { byte >> 4 } else { byte & 0x0F };
                    let (at, to_high) = tiles::q4_code_pos(TileOrder::ColumnMajor, r, c);
                    codes[at] |= if to_high { q << 4 } else { q };
                }
            }
        }
        WeightFormat::Q8 { order, .. } => {
            dst[..cells].copy_from_slice(&tile[g * cells..(g + 1) * cells]);
            let codes = &mut dst[Q8_RECORD_CODES..];
            if order == TileOrder::ColumnMajor {
                let at = tiles::Q8_CODES + g * codes.len();
                codes.copy_from_slice(&tile[at..at + codes.len()]);
                return;
            }
            for c in 0..GROUP {
                for r in 0..TILE_ROWS {
                    let src = tiles::q8_code_pos(order, r, g * GROUP + c);
                    codes[tiles::q8_code_pos(TileOrder::ColumnMajor, r, c)] =
                        tile[tiles::Q8_CODES + src];
                }
            }
        }
        _ => {}
    }
}

/// Rebuild tile `t` of one row block from its group records (`records` = the block's records):
/// the inverse of [`pack_group_records`] for the groups the records hold, zero elsewhere. The
/// scalar path decodes this with `tiles::decode_tile`, so it sums exactly as it does over tiles.
pub(super) fn tile_from_records(format: WeightFormat, records: &[u8], t: usize, tile: &mut [u8]) {
    let Some(record) = record_bytes(format) else {
        return;
    };
    tile.fill(0);
    let cells = 2 * TILE_ROWS;
    for (g, src) in records
        .chunks_exact(record)
        .skip(t * GROUPS)
        .take(GROUPS)
        .enumerate()
    {
        match format {
            WeightFormat::Q41 { order, .. } => {
                tile[g * cells..(g + 1) * cells].copy_from_slice(&src[..cells]);
                let mins = tiles::Q41_MINS + g * cells;
                tile[mins..mins + cells]
                    .copy_from_slice(&src[Q41_RECORD_MINS..Q41_RECORD_MINS + cells]);
                for c in 0..GROUP {
                    for r in 0..TILE_ROWS {
                        let (at, high) = tiles::q4_code_pos(TileOrder::ColumnMajor, r, c);
                        let byte = src[Q41_RECORD_CODES + at];
                        let q = if high { byte >> 4 } else { byte & 0x0F };
                        let (to, to_high) = tiles::q4_code_pos(order, r, g * GROUP + c);
                        tile[tiles::Q41_CODES + to] |= if to_high { q << 4 } else { q };
                    }
                }
            }
            WeightFormat::Q8 { order, .. } => {
                tile[g * cells..(g + 1) * cells].copy_from_slice(&src[..cells]);
                for c in 0..GROUP {
                    for r in 0..TILE_ROWS {
                        let at = tiles::q8_code_pos(TileOrder::ColumnMajor, r, c);
                        tile[tiles::Q8_CODES + tiles::q8_code_pos(order, r, g * GROUP + c)] =
                            src[Q8_RECORD_CODES + at];
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte of a column is written by exactly one field of one row.
    fn assert_fields_tile_the_column(fields: &[Field], what: &str) {
        let mut written = vec![0u8; column_bytes(fields)];
        for f in fields {
            for byte in &mut written[f.dst..f.dst + INTERLEAVED_ROWS * f.len] {
                *byte += 1;
            }
        }
        assert!(written.iter().all(|&n| n == 1), "{what}: {written:?}");
    }

    #[test]
    fn interleaved_columns_are_the_documented_layout() {
        // docs/formats.md, "Host interleaved rows": eight `d` (16 bytes), Q5_1's eight `m`, the
        // four `qh` bytes of every row transposed (32 bytes), 128 bytes of nibbles.
        let expected = [
            (IQ4_NL_COLUMN, (0, 0, 16, 144), &IQ4_NL_FIELDS[..], "iq4_nl"),
            (Q5_0_COLUMN, (0, 16, 48, 176), &Q5_0_FIELDS[..], "q5_0"),
            (Q5_1_COLUMN, (16, 32, 64, 192), &Q5_1_FIELDS[..], "q5_1"),
        ];
        for (column, (m, fifth, nibbles, bytes), fields, what) in expected {
            let want = InterleavedColumn {
                m,
                fifth,
                nibbles,
                bytes,
            };
            assert_eq!(column, want, "{what}");
            assert_fields_tile_the_column(fields, what);
        }
    }
}
