//! Weight tile formats: the shared vocabulary of the `weights` and `kernels` layers.
//!
//! Quantized matrices are stored as grids of 32 × 256 tiles (32 output rows × 256 input columns),
//! in raster order: tile `t = p * Q + q`, `p` the 32-row block, `q` the 256-column block, `Q` the
//! number of column blocks (K zero-padded to a multiple of 256). Inside a tile, the 256 columns form
//! 8 groups of 32; every (group, row) cell has its own scale (and min). Byte layouts are
//! documented in `docs/formats.md` ("Tile byte layouts").
//!
//! This module owns the byte layouts and the slow, obviously-correct scalar encode/decode of a
//! single tile. Fast kernels live in `kernels`; containers and files live in `weights`.

use crate::ggml::GgmlType;
use half::{bf16, f16};

/// Output rows per tile.
pub const TILE_ROWS: usize = 32;
/// Input columns per tile (except the legacy 32 × 128 q8 tile).
pub const TILE_COLS: usize = 256;
/// Columns per quantization group.
pub const GROUP: usize = 32;
/// Groups per 256-column tile.
pub const GROUPS: usize = TILE_COLS / GROUP;

/// Bytes of a q4_1 tile: 256 scales + 256 mins (2 bytes each) + 4096 bytes of nibbles.
pub const Q41_TILE_BYTES: usize = 5120;
/// Bytes of a Q8 tile (32 × 256): 256 scales (2 bytes) + 8192 codes.
pub const Q8_TILE_BYTES: usize = 8704;
/// Bytes of the legacy "q8 packed in q4nx" tile (32 × 128): FLM_Q4NX_Converter's
/// `_pack_q4nx_8b` (`_pack_q8nx` padded to a q4_1 chunk): 128 bf16 scales `[0, 256)`, the same
/// scales again in its "min" slot `[256, 512)`, 4096 codes from [`Q8_LEGACY_CODES`], 512 zero bytes.
pub const Q8_LEGACY_TILE_BYTES: usize = 5120;
/// Offset of the code area in a legacy q8 tile (right after the scale and "min" slots).
pub const Q8_LEGACY_CODES: usize = 512;
/// Bytes of a Q4_K tile: s8, m8, nibbles, per-row super scale and (negated) super min.
pub const Q4K_TILE_BYTES: usize = 4736;

/// Type of the per-group scales and mins inside a tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleType {
    /// bfloat16, what FastFlowLM writes.
    Bf16,
    /// IEEE half, bit-exact to GGUF's Q4_1 / Q8_0 block scales.
    F16,
}

/// Order of the codes inside a tile (the two generations of the Q4NX converter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TileOrder {
    /// "1.0.3": plain column-major. q4: byte `c*16 + r/2`; q8: byte `c*32 + r`.
    ColumnMajor,
    /// "1.0.2": two 16-row planes. q4: byte `(r/16)*2048 + c*8 + (r%16)/2`; q8: `(r/16)*4096 + c*16 + r%16`.
    Lanes16,
}

/// How a weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// q4_1 tiles (5120 B): value = q·d + m, q in 0..=15.
    Q41 {
        /// Type of the per-(group, row) scales and mins.
        scale: ScaleType,
        /// Order of the codes inside a tile.
        order: TileOrder,
    },
    /// Q8 tiles (8704 B, 32 × 256): value = q·d, q in -128..=127.
    Q8 {
        /// Type of the per-(group, row) scales.
        scale: ScaleType,
        /// Order of the codes inside a tile.
        order: TileOrder,
    },
    /// Legacy q8 tiles (5120 B, 32 × 128, 16-row lanes, bf16 scales).
    Q8Legacy,
    /// Q4_K tiles (4736 B): value = `S[r]·s8·q + M[r]·m8` (M stored negated).
    Q4K,
    /// Plain row-major bf16 `[rows, cols]`.
    Bf16,
    /// Plain row-major f16 `[rows, cols]`.
    F16,
    /// Plain row-major f32 `[rows, cols]`.
    F32,
    /// Rows of ggml blocks exactly as a GGUF file stores them (`[rows, cols / block]` blocks,
    /// each row on its own): the host executor runs them from these bytes (`kernels::ggml_dot`);
    /// no device kernel reads them. One of [`GgmlType::BLOCK_QUANTS`] other than Q4_1 and Q8_0,
    /// which become q4_1 / Q8 tiles exactly.
    Ggml(GgmlType),
}

/// Error of a tile-level operation: which rule the data broke.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TileError {
    /// A format name no [`WeightFormat`] has, or a tile operation on a format without tiles;
    /// holds the name.
    #[error("unknown weight format name {0:?}")]
    UnknownFormat(String),
    /// A buffer does not have the byte size its format and shape imply.
    #[error("{what}: expected {expected} bytes, got {got}")]
    Size {
        /// The buffer.
        what: &'static str,
        /// Bytes the format and shape imply.
        expected: usize,
        /// Bytes passed.
        got: usize,
    },
    /// A dimension is not a multiple of the tile's (e.g. rows of a tiled matrix and 32).
    #[error("{what}: {value} is not a multiple of {multiple}")]
    NotMultiple {
        /// The dimension.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The multiple it must be.
        multiple: usize,
    },
}

impl WeightFormat {
    /// All formats, for listing and round-trip tests.
    pub const ALL: [WeightFormat; 23] = [
        WeightFormat::Q41 {
            scale: ScaleType::Bf16,
            order: TileOrder::ColumnMajor,
        },
        WeightFormat::Q41 {
            scale: ScaleType::F16,
            order: TileOrder::ColumnMajor,
        },
        WeightFormat::Q41 {
            scale: ScaleType::Bf16,
            order: TileOrder::Lanes16,
        },
        WeightFormat::Q41 {
            scale: ScaleType::F16,
            order: TileOrder::Lanes16,
        },
        WeightFormat::Q8 {
            scale: ScaleType::Bf16,
            order: TileOrder::ColumnMajor,
        },
        WeightFormat::Q8 {
            scale: ScaleType::F16,
            order: TileOrder::ColumnMajor,
        },
        WeightFormat::Q8 {
            scale: ScaleType::Bf16,
            order: TileOrder::Lanes16,
        },
        WeightFormat::Q8 {
            scale: ScaleType::F16,
            order: TileOrder::Lanes16,
        },
        WeightFormat::Q8Legacy,
        WeightFormat::Q4K,
        WeightFormat::Bf16,
        WeightFormat::F16,
        WeightFormat::F32,
        WeightFormat::Ggml(GgmlType::Q4_0),
        WeightFormat::Ggml(GgmlType::Q5_0),
        WeightFormat::Ggml(GgmlType::Q5_1),
        WeightFormat::Ggml(GgmlType::Q2_K),
        WeightFormat::Ggml(GgmlType::Q3_K),
        WeightFormat::Ggml(GgmlType::Q4_K),
        WeightFormat::Ggml(GgmlType::Q5_K),
        WeightFormat::Ggml(GgmlType::Q6_K),
        WeightFormat::Ggml(GgmlType::IQ4_NL),
        WeightFormat::Ggml(GgmlType::IQ4_XS),
    ];

    /// The short name used in kernel file names (`gemm_<name>_m16_k576_n960.elf`).
    pub fn name(self) -> &'static str {
        use ScaleType::*;
        use TileOrder::*;
        match self {
            WeightFormat::Q41 {
                scale: Bf16,
                order: ColumnMajor,
            } => "q41",
            WeightFormat::Q41 {
                scale: F16,
                order: ColumnMajor,
            } => "q41h",
            WeightFormat::Q41 {
                scale: Bf16,
                order: Lanes16,
            } => "q41l",
            WeightFormat::Q41 {
                scale: F16,
                order: Lanes16,
            } => "q41hl",
            WeightFormat::Q8 {
                scale: Bf16,
                order: ColumnMajor,
            } => "q8",
            WeightFormat::Q8 {
                scale: F16,
                order: ColumnMajor,
            } => "q8h",
            WeightFormat::Q8 {
                scale: Bf16,
                order: Lanes16,
            } => "q8l",
            WeightFormat::Q8 {
                scale: F16,
                order: Lanes16,
            } => "q8hl",
            WeightFormat::Q8Legacy => "q8x128",
            WeightFormat::Q4K => "q4k",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::F16 => "f16",
            WeightFormat::F32 => "f32",
            WeightFormat::Ggml(ty) => match ty {
                GgmlType::Q4_0 => "ggml_q4_0",
                GgmlType::Q4_1 => "ggml_q4_1",
                GgmlType::Q5_0 => "ggml_q5_0",
                GgmlType::Q5_1 => "ggml_q5_1",
                GgmlType::Q8_0 => "ggml_q8_0",
                GgmlType::Q2_K => "ggml_q2_k",
                GgmlType::Q3_K => "ggml_q3_k",
                GgmlType::Q4_K => "ggml_q4_k",
                GgmlType::Q5_K => "ggml_q5_k",
                GgmlType::Q6_K => "ggml_q6_k",
                GgmlType::IQ4_NL => "ggml_iq4_nl",
                GgmlType::IQ4_XS => "ggml_iq4_xs",
                _ => "ggml_unsupported",
            },
        }
    }

    /// Inverse of [`WeightFormat::name`].
    pub fn from_name(name: &str) -> Result<Self, TileError> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| TileError::UnknownFormat(name.to_string()))
    }

    /// Bytes of one tile, or `None` for plain (untiled) formats.
    pub fn tile_bytes(self) -> Option<usize> {
        match self {
            WeightFormat::Q41 { .. } => Some(Q41_TILE_BYTES),
            WeightFormat::Q8 { .. } => Some(Q8_TILE_BYTES),
            WeightFormat::Q8Legacy => Some(Q8_LEGACY_TILE_BYTES),
            WeightFormat::Q4K => Some(Q4K_TILE_BYTES),
            WeightFormat::Bf16 | WeightFormat::F16 | WeightFormat::F32 | WeightFormat::Ggml(_) => {
                None
            }
        }
    }

    /// Input columns covered by one tile (256, or 128 for the legacy q8 tile); 1 for plain formats.
    pub fn tile_cols(self) -> usize {
        match self {
            WeightFormat::Q8Legacy => 128,
            f if f.tile_bytes().is_some() => TILE_COLS,
            _ => 1,
        }
    }

    /// Bytes per element of a plain format.
    pub fn plain_elem_bytes(self) -> Option<usize> {
        match self {
            WeightFormat::Bf16 | WeightFormat::F16 => Some(2),
            WeightFormat::F32 => Some(4),
            _ => None,
        }
    }

    /// Columns as stored: K rounded up to the tile width (plain formats keep K).
    pub fn padded_cols(self, cols: usize) -> usize {
        cols.div_ceil(self.tile_cols()) * self.tile_cols()
    }

    /// Bytes of a `[rows, cols]` matrix in this format; rows must be a multiple of 32 for tiles.
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> Result<usize, TileError> {
        match (self.tile_bytes(), self.plain_elem_bytes()) {
            (Some(tile), _) => {
                if !rows.is_multiple_of(TILE_ROWS) {
                    return Err(TileError::NotMultiple {
                        what: "tiled matrix rows",
                        value: rows,
                        multiple: TILE_ROWS,
                    });
                }
                Ok(rows / TILE_ROWS * (self.padded_cols(cols) / self.tile_cols()) * tile)
            }
            (None, Some(elem)) => Ok(rows * cols * elem),
            (None, None) => match self {
                WeightFormat::Ggml(ty) => Ok(rows * ggml_row_bytes(ty, cols)?),
                _ => Ok(0),
            },
        }
    }
}

/// Bytes of one row of `cols` values of ggml block type `ty`; `cols` must fill whole blocks.
pub fn ggml_row_bytes(ty: GgmlType, cols: usize) -> Result<usize, TileError> {
    let (values, bytes) = ty.block();
    if !cols.is_multiple_of(values) {
        return Err(TileError::NotMultiple {
            what: "columns of a ggml block matrix",
            value: cols,
            multiple: values,
        });
    }
    Ok(cols / values * bytes)
}

#[inline]
fn read_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

#[inline]
fn write_u16(bytes: &mut [u8], at: usize, v: u16) {
    bytes[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

/// Decode a stored scale (bf16 or f16 bits) to f32.
#[inline]
pub fn scale_to_f32(scale: ScaleType, bits: u16) -> f32 {
    match scale {
        ScaleType::Bf16 => bf16::from_bits(bits).to_f32(),
        ScaleType::F16 => f16::from_bits(bits).to_f32(),
    }
}

/// Encode an f32 scale (round to nearest even) as bf16 or f16 bits.
#[inline]
pub fn scale_from_f32(scale: ScaleType, v: f32) -> u16 {
    match scale {
        ScaleType::Bf16 => bf16::from_f32(v).to_bits(),
        ScaleType::F16 => f16::from_f32(v).to_bits(),
    }
}

/// Index of the (group, row) scale cell: scales are group-major, `g*32 + r`.
#[inline]
pub fn cell(g: usize, r: usize) -> usize {
    g * TILE_ROWS + r
}

/// Byte index and nibble (false = low, true = high) of q4 code (r, c) inside the code area.
#[inline]
pub fn q4_code_pos(order: TileOrder, r: usize, c: usize) -> (usize, bool) {
    let byte = match order {
        TileOrder::ColumnMajor => c * 16 + r / 2,
        TileOrder::Lanes16 => (r / 16) * 2048 + c * 8 + (r % 16) / 2,
    };
    (byte, r % 2 == 1)
}

/// Index of q8 code (r, c) inside the code area of an 8704-byte tile.
#[inline]
pub fn q8_code_pos(order: TileOrder, r: usize, c: usize) -> usize {
    match order {
        TileOrder::ColumnMajor => c * 32 + r,
        TileOrder::Lanes16 => (r / 16) * 4096 + c * 16 + r % 16,
    }
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), TileError> {
    if got != expected {
        return Err(TileError::Size {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// Offset of the code area in a q4_1 tile.
pub const Q41_CODES: usize = 1024;
/// Offset of the min area in a q4_1 tile.
pub const Q41_MINS: usize = 512;
/// Offset of the code area in a Q8 tile.
pub const Q8_CODES: usize = 512;

/// Decode one tile to f32, row-major `out[r * tile_cols + c]` (`tile_cols` = 256, or 128 for
/// the legacy q8 tile). The slow reference every fast path is checked against.
pub fn decode_tile(format: WeightFormat, tile: &[u8], out: &mut [f32]) -> Result<(), TileError> {
    let tile_bytes = format
        .tile_bytes()
        .ok_or(TileError::UnknownFormat(format.name().to_string()))?;
    check_len("tile", tile.len(), tile_bytes)?;
    let cols = format.tile_cols();
    check_len("decoded tile", out.len(), TILE_ROWS * cols)?;
    match format {
        WeightFormat::Q41 { scale, order } => {
            for r in 0..TILE_ROWS {
                for c in 0..TILE_COLS {
                    let g = c / GROUP;
                    let d = scale_to_f32(scale, read_u16(tile, 2 * cell(g, r)));
                    let m = scale_to_f32(scale, read_u16(tile, Q41_MINS + 2 * cell(g, r)));
                    let (byte, high) = q4_code_pos(order, r, c);
                    let b = tile[Q41_CODES + byte];
                    let q = if high { b >> 4 } else { b & 0x0F };
                    out[r * cols + c] = q as f32 * d + m;
                }
            }
        }
        WeightFormat::Q8 { scale, order } => {
            for r in 0..TILE_ROWS {
                for c in 0..TILE_COLS {
                    let d = scale_to_f32(scale, read_u16(tile, 2 * cell(c / GROUP, r)));
                    let q = tile[Q8_CODES + q8_code_pos(order, r, c)] as i8;
                    out[r * cols + c] = q as f32 * d;
                }
            }
        }
        WeightFormat::Q8Legacy => {
            for r in 0..TILE_ROWS {
                for c in 0..128 {
                    let d = scale_to_f32(ScaleType::Bf16, read_u16(tile, 2 * cell(c / GROUP, r)));
                    let q = tile[Q8_LEGACY_CODES + (r / 16) * 2048 + c * 16 + r % 16] as i8;
                    out[r * cols + c] = q as f32 * d;
                }
            }
        }
        WeightFormat::Q4K => {
            for r in 0..TILE_ROWS {
                let s_row = bf16::from_bits(read_u16(tile, 4608 + 2 * r)).to_f32();
                let m_row = bf16::from_bits(read_u16(tile, 4672 + 2 * r)).to_f32();
                for c in 0..TILE_COLS {
                    let g = c / GROUP;
                    let s8 = tile[cell(g, r)] as f32;
                    let m8 = tile[256 + cell(g, r)] as f32;
                    let (byte, high) = q4_code_pos(TileOrder::ColumnMajor, r, c);
                    let b = tile[512 + byte];
                    let q = if high { b >> 4 } else { b & 0x0F };
                    out[r * cols + c] = s_row * s8 * q as f32 + m_row * m8;
                }
            }
        }
        // Plain formats have no tile: rejected by `tile_bytes()` above.
        WeightFormat::Bf16 | WeightFormat::F16 | WeightFormat::F32 | WeightFormat::Ggml(_) => {}
    }
    Ok(())
}

/// Write one q4_1 (group, row) cell: scale `d`, min `m` and 32 codes (each 0..=15).
#[allow(clippy::too_many_arguments)] // one argument per field of the cell
pub fn set_q41_cell(
    tile: &mut [u8],
    scale: ScaleType,
    order: TileOrder,
    g: usize,
    r: usize,
    d: f32,
    m: f32,
    codes: &[u8; GROUP],
) {
    write_u16(tile, 2 * cell(g, r), scale_from_f32(scale, d));
    write_u16(tile, Q41_MINS + 2 * cell(g, r), scale_from_f32(scale, m));
    for (i, &q) in codes.iter().enumerate() {
        let (byte, high) = q4_code_pos(order, r, g * GROUP + i);
        let slot = &mut tile[Q41_CODES + byte];
        *slot = if high {
            (*slot & 0x0F) | (q << 4)
        } else {
            (*slot & 0xF0) | (q & 0x0F)
        };
    }
}

/// Write one Q8 (group, row) cell: scale `d` and 32 signed codes.
pub fn set_q8_cell(
    tile: &mut [u8],
    scale: ScaleType,
    order: TileOrder,
    g: usize,
    r: usize,
    d: f32,
    codes: &[i8; GROUP],
) {
    write_u16(tile, 2 * cell(g, r), scale_from_f32(scale, d));
    for (i, &q) in codes.iter().enumerate() {
        tile[Q8_CODES + q8_code_pos(order, r, g * GROUP + i)] = q as u8;
    }
}

/// Decode row `row` of a `[rows, cols]` matrix stored in `format` to f32 (`out.len() == cols`).
/// Padded columns beyond `cols` are not returned. Plain, q4_1 and Q8 rows are read in place (no
/// allocation); the other tiled formats go through [`decode_tile`] into a scratch tile. Every
/// value has [`decode_tile`]'s bits.
pub fn decode_row(
    format: WeightFormat,
    data: &[u8],
    rows: usize,
    cols: usize,
    row: usize,
    out: &mut [f32],
) -> Result<(), TileError> {
    check_len("matrix", data.len(), format.matrix_bytes(rows, cols)?)?;
    check_len("row", out.len(), cols)?;
    if row >= rows {
        return Err(TileError::Size {
            what: "row index bound",
            expected: rows,
            got: row,
        });
    }
    match format {
        WeightFormat::Ggml(ty) => {
            let row_bytes = ggml_row_bytes(ty, cols)?;
            crate::ggml::dequantize(ty, &data[row * row_bytes..(row + 1) * row_bytes], out)
                .map_err(TileError::UnknownFormat)?;
        }
        WeightFormat::F32 => {
            for (c, o) in out.iter_mut().enumerate() {
                let at = (row * cols + c) * 4;
                *o = f32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
            }
        }
        WeightFormat::Bf16 | WeightFormat::F16 => {
            let scale = if format == WeightFormat::Bf16 {
                ScaleType::Bf16
            } else {
                ScaleType::F16
            };
            for (c, o) in out.iter_mut().enumerate() {
                *o = scale_to_f32(scale, read_u16(data, (row * cols + c) * 2));
            }
        }
        // Straight from the row's scales, mins and codes, without a scratch tile (an embedding
        // lookup per token); each value is `decode_tile`'s expression.
        WeightFormat::Q8 { scale, order } | WeightFormat::Q41 { scale, order } => {
            let tile_bytes = format.tile_bytes().unwrap_or(0);
            let q_tiles = format.padded_cols(cols) / TILE_COLS;
            let (p, r) = (row / TILE_ROWS, row % TILE_ROWS);
            for (c, o) in out.iter_mut().enumerate() {
                let (q, cc) = (c / TILE_COLS, c % TILE_COLS);
                let base = (p * q_tiles + q) * tile_bytes;
                let at = cell(cc / GROUP, r);
                let d = scale_to_f32(scale, read_u16(data, base + 2 * at));
                *o = if matches!(format, WeightFormat::Q8 { .. }) {
                    let code = data[base + Q8_CODES + q8_code_pos(order, r, cc)] as i8;
                    code as f32 * d
                } else {
                    let m = scale_to_f32(scale, read_u16(data, base + Q41_MINS + 2 * at));
                    let (byte, high) = q4_code_pos(order, r, cc);
                    let b = data[base + Q41_CODES + byte];
                    (if high { b >> 4 } else { b & 15 }) as f32 * d + m
                };
            }
        }
        _ => {
            let tile_bytes = format.tile_bytes().unwrap_or(0);
            let tcols = format.tile_cols();
            let q_tiles = format.padded_cols(cols) / tcols;
            let mut buf = vec![0f32; TILE_ROWS * tcols];
            let p = row / TILE_ROWS;
            let r = row % TILE_ROWS;
            for q in 0..q_tiles {
                let t = p * q_tiles + q;
                decode_tile(
                    format,
                    &data[t * tile_bytes..(t + 1) * tile_bytes],
                    &mut buf,
                )?;
                for c in 0..tcols {
                    let col = q * tcols + c;
                    if col < cols {
                        out[col] = buf[r * tcols + c];
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for f in WeightFormat::ALL {
            assert_eq!(WeightFormat::from_name(f.name()), Ok(f));
            assert!(seen.insert(f.name()));
        }
        assert!(WeightFormat::from_name("q5").is_err());
    }

    #[test]
    fn code_positions_match_the_reference_formulas() {
        // Hand-computed from the code-order table of `docs/formats.md` ("Tile byte layouts").
        assert_eq!(q4_code_pos(TileOrder::ColumnMajor, 0, 0), (0, false));
        assert_eq!(q4_code_pos(TileOrder::ColumnMajor, 1, 0), (0, true));
        assert_eq!(
            q4_code_pos(TileOrder::ColumnMajor, 31, 255),
            (255 * 16 + 15, true)
        );
        assert_eq!(q4_code_pos(TileOrder::Lanes16, 17, 3), (2048 + 24, true));
        assert_eq!(
            q4_code_pos(TileOrder::Lanes16, 14, 255),
            (255 * 8 + 7, false)
        );
        assert_eq!(q8_code_pos(TileOrder::ColumnMajor, 5, 2), 69);
        assert_eq!(q8_code_pos(TileOrder::Lanes16, 20, 2), 4096 + 32 + 4);
    }

    #[test]
    fn q41_cell_decodes_to_q_times_d_plus_m() {
        for order in [TileOrder::ColumnMajor, TileOrder::Lanes16] {
            let f = WeightFormat::Q41 {
                scale: ScaleType::F16,
                order,
            };
            let mut tile = vec![0u8; Q41_TILE_BYTES];
            let codes: [u8; 32] = std::array::from_fn(|i| (i % 16) as u8);
            set_q41_cell(&mut tile, ScaleType::F16, order, 3, 7, 0.5, -2.0, &codes);
            let mut out = vec![0f32; 32 * 256];
            decode_tile(f, &tile, &mut out).unwrap();
            for i in 0..32 {
                assert_eq!(out[7 * 256 + 96 + i], (i % 16) as f32 * 0.5 - 2.0);
            }
            // Neighbouring rows and groups untouched (scale 0, min 0).
            assert_eq!(out[6 * 256 + 96], 0.0);
            assert_eq!(out[8 * 256 + 97], 0.0);
            assert_eq!(out[7 * 256 + 95], 0.0);
        }
    }

    #[test]
    fn q8_cell_and_padded_row_decode() {
        let f = WeightFormat::Q8 {
            scale: ScaleType::Bf16,
            order: TileOrder::ColumnMajor,
        };
        // 32 rows × 300 columns → 2 tiles per row block (K padded to 512).
        let rows = 32;
        let cols = 300;
        let mut data = vec![0u8; f.matrix_bytes(rows, cols).unwrap()];
        assert_eq!(data.len(), 2 * Q8_TILE_BYTES);
        let codes: [i8; 32] = std::array::from_fn(|i| i as i8 - 16);
        set_q8_cell(
            &mut data[Q8_TILE_BYTES..],
            ScaleType::Bf16,
            TileOrder::ColumnMajor,
            1,
            4,
            0.25,
            &codes,
        );
        let mut row = vec![0f32; cols];
        decode_row(f, &data, rows, cols, 4, &mut row).unwrap();
        // Second tile, group 1 → columns 256 + 32 .. 256 + 43 exist (300 is the bound).
        for (c, &v) in row.iter().enumerate().skip(288) {
            assert_eq!(v, (c as i32 - 288 - 16) as f32 * 0.25);
        }
        assert_eq!(row[287], 0.0);
        assert!(decode_row(f, &data, rows, cols, 32, &mut row).is_err());
        assert!(decode_row(f, &data[1..], rows, cols, 0, &mut row).is_err());
    }

    #[test]
    fn every_tiled_row_equals_its_row_of_the_decoded_tiles() {
        // 64 rows × 300 columns: two row blocks, K padded (to 512, or 384 for the 128-column
        // legacy tile), so rows end inside a tile.
        let (rows, cols) = (64, 300);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for f in WeightFormat::ALL {
            let Some(tile_bytes) = f.tile_bytes() else {
                continue;
            };
            let data: Vec<u8> = (0..f.matrix_bytes(rows, cols).unwrap())
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed >> 32) as u8
                })
                .collect();
            let tcols = f.tile_cols();
            let q_tiles = f.padded_cols(cols) / tcols;
            let mut tile = vec![0f32; TILE_ROWS * tcols];
            let mut row = vec![0f32; cols];
            for r in [0, 5, 31, 32, 63] {
                decode_row(f, &data, rows, cols, r, &mut row).unwrap();
                for q in 0..q_tiles {
                    let t = (r / TILE_ROWS) * q_tiles + q;
                    decode_tile(f, &data[t * tile_bytes..(t + 1) * tile_bytes], &mut tile).unwrap();
                    for c in (q * tcols..(q + 1) * tcols).take_while(|&c| c < cols) {
                        let (got, want) = (row[c], tile[(r % TILE_ROWS) * tcols + c - q * tcols]);
                        assert!(
                            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                            "{} row {r} column {c}: {got} vs {want}",
                            f.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn matrix_bytes_for_smollm_shapes() {
        let q41 = WeightFormat::Q41 {
            scale: ScaleType::Bf16,
            order: TileOrder::ColumnMajor,
        };
        // QKV fused: N = 576 + 2*192 = 960 rows, K = 576 → padded 768 → 3 tiles per row block.
        assert_eq!(q41.matrix_bytes(960, 576).unwrap(), 30 * 3 * 5120);
        assert!(q41.matrix_bytes(100, 576).is_err());
        assert_eq!(WeightFormat::F32.matrix_bytes(3, 5).unwrap(), 60);
    }
}
