//! The host GEMM executor: `y[m×N] = x[m×K] · Wᵀ` over weights in their stored tile layout.
//!
//! Dispatch: AVX2+FMA+F16C kernels (`avx2`) when the CPU has them (detected once; their multi-row
//! loops use AVX-512 VNNI where present, with the same results), else a portable scalar path that
//! decodes one tile at a time. Tile formats quantize the activations to q8 once per
//! call (`quant`); plain bf16/f16/f32 weights take f32 dot products. Work is split over the global
//! [`Pool`] in contiguous chunks of 32-row blocks: for one row guided (shrinking) so both threads
//! finish together, for several rows one contiguous share per thread (see `Schedule`).

// Unsafe is needed to call the SIMD kernels, to prefetch, and for disjoint writes through the pool.
#![allow(unsafe_code)]

use std::cell::RefCell;

use super::avx2::{self, Q4Codes, Q4Layout, Q4Scales, Q8Layout};
use super::ggml_dot;
use super::host_layout::{self, Packing};
use super::pool::{ChunkCounter, Pool, ShareCounter, SharedMut};
use super::quant::{ActivationScale, QuantizedRows};
use super::KernelError;
use crate::ggml::GgmlType;
use crate::tiles::{self, ScaleType, TileOrder, WeightFormat, GROUP, TILE_ROWS};

/// Activation rows handed to one block-kernel call: bounds the per-thread scratch (128 × 32 f32).
const ROWS_PER_PASS: usize = 128;
// A pass starts on a whole AMX activation tile (`amx_bf16::rows`).
const _: () = assert!(ROWS_PER_PASS.is_multiple_of(16));

/// Activation rows from which plain (f32 / f16 / bf16) matrices run `avx512::plain_rows`.
const PLAIN_TILE_MIN_ROWS: usize = 4;

/// A `[rows = N, cols = K]` weight matrix in a stored format, borrowed (typically from an mmap).
#[derive(Clone, Copy, Debug)]
pub struct WeightMatrix<'a> {
    /// Storage format.
    pub format: WeightFormat,
    /// Output features N (a multiple of 32 for tile formats).
    pub rows: usize,
    /// Logical input features K (tile formats store K zero-padded to the tile width).
    pub cols: usize,
    /// The bytes, exactly `format.matrix_bytes(rows, cols)` long for tiles (see [`Packing`]).
    pub data: &'a [u8],
    /// How `data` is arranged: the format's tiles, or the host executor's group records.
    pub packing: Packing,
}

impl<'a> WeightMatrix<'a> {
    /// A weight matrix whose byte length matches its format and shape.
    pub fn new(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        Self::checked(format, rows, cols, data, Packing::Tiles)
    }

    /// A matrix in the host executor's group-record layout (from
    /// [`host_layout::pack_group_records`]), its length checked against format and shape.
    pub fn group_records(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        Self::checked(format, rows, cols, data, Packing::GroupRecords)
    }

    /// A matrix in the host executor's interleaved rows (from
    /// [`host_layout::append_interleaved_rows`]), its length checked against format and shape.
    pub fn interleaved_rows(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        Self::checked(format, rows, cols, data, Packing::InterleavedRows)
    }

    /// A GGUF Q4_K, Q5_K or IQ4_XS matrix in the host executor's K tiles (from
    /// [`host_layout::append_k_tiles`]),
    /// its length checked against format and shape.
    pub fn k_tiles(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        Self::checked(format, rows, cols, data, Packing::KTiles)
    }

    fn checked(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: &'a [u8],
        packing: Packing,
    ) -> Result<Self, KernelError> {
        let w = WeightMatrix {
            format,
            rows,
            cols,
            data,
            packing,
        };
        let weight_error = |source| KernelError::Weight {
            format: format.name(),
            rows,
            cols,
            source,
        };
        let expected = w.expected_bytes().map_err(weight_error)?;
        if data.len() != expected {
            return Err(weight_error(tiles::TileError::Size {
                what: "matrix bytes",
                expected,
                got: data.len(),
            }));
        }
        Ok(w)
    }

    /// Bytes `data` must have for this format, shape and packing.
    fn expected_bytes(&self) -> Result<usize, tiles::TileError> {
        match self.packing {
            Packing::Tiles => self.format.matrix_bytes(self.rows, self.cols),
            Packing::GroupRecords => {
                host_layout::records_matrix_bytes(self.format, self.rows, self.cols)
            }
            Packing::InterleavedRows => {
                host_layout::interleaved_matrix_bytes(self.format, self.rows, self.cols)
            }
            Packing::KTiles => host_layout::k_tiles_matrix_bytes(self.format, self.rows, self.cols),
        }
    }

    /// An error unless `data` is in the format's tile grid: what devices and the reference take.
    pub fn require_tiles(&self, consumer: &'static str) -> Result<(), KernelError> {
        match self.packing {
            Packing::Tiles => Ok(()),
            Packing::GroupRecords | Packing::InterleavedRows | Packing::KTiles => {
                Err(KernelError::Unsupported(format!(
                    "{consumer} takes {} tiles; this {}×{} matrix is in the host executor's {} layout",
                    self.format.name(),
                    self.rows,
                    self.cols,
                    match self.packing {
                        Packing::GroupRecords => "group-record",
                        Packing::InterleavedRows => "interleaved-row",
                        _ => "K-tile",
                    }
                )))
            }
        }
    }

    /// `data` has exactly the bytes its format and shape imply (the fields are public, so a
    /// hand-built matrix may be inconsistent; every executor re-checks before reading).
    pub fn check_bytes(&self) -> Result<(), KernelError> {
        let expected = self
            .expected_bytes()
            .map_err(|source| KernelError::Weight {
                format: self.format.name(),
                rows: self.rows,
                cols: self.cols,
                source,
            })?;
        if self.data.len() != expected {
            return Err(KernelError::Shape {
                what: "weight bytes",
                expected,
                got: self.data.len(),
            });
        }
        Ok(())
    }

    /// Bytes a GEMM actually streams from this matrix: tile padding past the last real 32-column
    /// group is skipped, so this is less than `data.len()` when K is not a multiple of 256.
    pub fn streamed_bytes(&self) -> usize {
        let groups = self.cols.div_ceil(GROUP);
        let blocks = self.rows / TILE_ROWS;
        match self.format {
            // scale + min (2 × 64 B) + codes (512 B) per (group, 32 rows)
            WeightFormat::Q41 { .. } => blocks * groups * (128 + 512),
            // scale (64 B) + codes (1024 B)
            WeightFormat::Q8 { .. } | WeightFormat::Q8Legacy => blocks * groups * (64 + 1024),
            // s8 + m8 (64 B) + codes (512 B) per group, row super scales (128 B) per tile
            WeightFormat::Q4K => blocks * (groups * (64 + 512) + self.cols.div_ceil(256) * 128),
            WeightFormat::Bf16 | WeightFormat::F16 | WeightFormat::F32 | WeightFormat::Ggml(_) => {
                self.data.len()
            }
        }
    }

    /// Bytes of one 32-row block (tile formats).
    fn block_bytes(&self) -> usize {
        match (self.packing, self.format.tile_bytes()) {
            (Packing::GroupRecords, _) => {
                self.cols.div_ceil(GROUP) * host_layout::record_bytes(self.format).unwrap_or(0)
            }
            (Packing::Tiles, Some(tile)) => {
                self.format.padded_cols(self.cols) / self.format.tile_cols() * tile
            }
            (Packing::KTiles, _) => {
                let tile = host_layout::KTileType::of(self.format).map_or(0, |ty| ty.tile_bytes());
                self.cols / tiles::TILE_COLS * tile
            }
            // Interleaved rows exist only for ggml blocks, which have no row blocks of tiles.
            (Packing::Tiles, None) | (Packing::InterleavedRows, _) => 0,
        }
    }
}

/// Which kernel runs a format on the fast path.
#[derive(Clone, Copy, Debug)]
enum FastKernel {
    Q4(Q4Layout),
    Q8(Q8Layout),
    Plain(avx2::PlainKind),
    /// Rows of ggml blocks (`ggml_dot`), AVX2 when `fast`.
    Ggml,
}

fn fast_kernel(format: WeightFormat, packing: Packing) -> FastKernel {
    let column_major = |order| order == TileOrder::ColumnMajor;
    let q4_scales = |scale| match scale {
        ScaleType::Bf16 => Q4Scales::Bf16,
        ScaleType::F16 => Q4Scales::F16,
    };
    if let (Packing::KTiles, Some(ty)) = (packing, host_layout::KTileType::of(format)) {
        // GGUF Q4_K / Q5_K re-laid as column-major Q4_K tiles with f16 row scales, Q5_K's fifth
        // bits in a plane after them; IQ4_XS as its table indices under i8 scales (host_layout).
        use host_layout::KTileType;
        let (scales, codes, codes_kind) = match ty {
            KTileType::Q4K => (Q4Scales::Q4KF16, 512, Q4Codes::Nibbles),
            KTileType::Q5K => (
                Q4Scales::Q4KF16,
                512,
                Q4Codes::FifthBits(host_layout::K_TILE_FIFTH_BITS),
            ),
            KTileType::Iq4Xs => (
                Q4Scales::Q4KF16,
                host_layout::K_TILE_IQ4_CODES,
                Q4Codes::Iq4Table,
            ),
        };
        return FastKernel::Q4(Q4Layout {
            scales,
            column_major: true,
            codes,
            mins: 256,
            tile_bytes: ty.tile_bytes(),
            groups_per_tile: tiles::GROUPS,
            codes_kind,
        });
    }
    if packing == Packing::GroupRecords {
        // A record is a column-major tile of one group (host_layout).
        match format {
            WeightFormat::Q41 { scale, .. } => {
                return FastKernel::Q4(Q4Layout {
                    scales: q4_scales(scale),
                    column_major: true,
                    codes: host_layout::Q41_RECORD_CODES,
                    mins: host_layout::Q41_RECORD_MINS,
                    tile_bytes: host_layout::Q41_RECORD_BYTES,
                    groups_per_tile: 1,
                    codes_kind: Q4Codes::Nibbles,
                })
            }
            WeightFormat::Q8 { scale, .. } => {
                return FastKernel::Q8(Q8Layout {
                    f16_scales: scale == ScaleType::F16,
                    column_major: true,
                    codes: host_layout::Q8_RECORD_CODES,
                    plane: 0,
                    tile_cols: GROUP,
                    tile_bytes: host_layout::Q8_RECORD_BYTES,
                })
            }
            // No record layout: `check_bytes` has already rejected such a matrix.
            _ => {}
        }
    }
    match format {
        WeightFormat::Q41 { scale, order } => FastKernel::Q4(Q4Layout {
            scales: q4_scales(scale),
            column_major: column_major(order),
            codes: tiles::Q41_CODES,
            mins: tiles::Q41_MINS,
            tile_bytes: tiles::Q41_TILE_BYTES,
            groups_per_tile: tiles::GROUPS,
            codes_kind: Q4Codes::Nibbles,
        }),
        WeightFormat::Q4K => FastKernel::Q4(Q4Layout {
            scales: Q4Scales::Q4K,
            column_major: true,
            codes: 512,
            mins: 256,
            tile_bytes: tiles::Q4K_TILE_BYTES,
            groups_per_tile: tiles::GROUPS,
            codes_kind: Q4Codes::Nibbles,
        }),
        WeightFormat::Q8 { scale, order } => FastKernel::Q8(Q8Layout {
            f16_scales: scale == ScaleType::F16,
            column_major: column_major(order),
            codes: tiles::Q8_CODES,
            plane: 4096,
            tile_cols: 256,
            tile_bytes: tiles::Q8_TILE_BYTES,
        }),
        WeightFormat::Q8Legacy => FastKernel::Q8(Q8Layout {
            f16_scales: false,
            column_major: false,
            codes: tiles::Q8_LEGACY_CODES,
            plane: 2048,
            tile_cols: 128,
            tile_bytes: tiles::Q8_LEGACY_TILE_BYTES,
        }),
        WeightFormat::Bf16 => FastKernel::Plain(avx2::PlainKind::Bf16),
        WeightFormat::F16 => FastKernel::Plain(avx2::PlainKind::F16),
        WeightFormat::F32 => FastKernel::Plain(avx2::PlainKind::F32),
        WeightFormat::Ggml(_) => FastKernel::Ggml,
    }
}

thread_local! {
    /// The calling thread's quantized activations (reused across calls: no steady-state allocation).
    static ACTIVATIONS: RefCell<QuantizedRows> = RefCell::new(QuantizedRows::default());
    /// The calling thread's activations rounded to bf16 (row-major, for `vdpbf16ps`) and as AMX
    /// B tiles (`amx_bf16::pair_tiles`), for bf16 weights.
    static BF16_ACTIVATIONS: RefCell<(Vec<u16>, Vec<u16>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
    /// Each thread's block output / accumulator scratch, and the scalar path's tile scratch.
    static BLOCK_SCRATCH: RefCell<(Vec<f32>, ScalarScratch)> = const {
        RefCell::new((Vec::new(), ScalarScratch { decoded: Vec::new(), tile: Vec::new() }))
    };
}

/// How one call's row blocks are handed to the pool threads.
enum Schedule {
    /// One row (memory-bound): guided chunks of at least [`SINGLE_ROW_MIN_CHUNK`] blocks.
    Guided(ChunkCounter),
    /// Several rows (compute-bound): one contiguous share per thread, block by block from the
    /// thread's own counter.
    Shares(ShareCounter),
}

impl Schedule {
    fn claim(&self, thread: usize) -> Option<std::ops::Range<usize>> {
        match self {
            Schedule::Guided(counter) => counter.claim(),
            Schedule::Shares(counter) => counter.claim(thread),
        }
    }
}

/// Floats of margin on each side of a thread's block scratch (two cache lines).
const SCRATCH_MARGIN: usize = 32;

/// `len` floats of `buf`, 64-byte aligned and with [`SCRATCH_MARGIN`] unused floats on each side:
/// the kernels write the scratch once per group, and a cache line shared with a neighbouring
/// allocation (another thread's output or activations, from the same allocator arena) would move
/// between the cores on every write (seen as a slower caller share in a per-thread timing of a
/// 16-row 576 × 576 call).
fn padded_scratch(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    const LINE_FLOATS: usize = 16;
    buf.resize(len + 2 * SCRATCH_MARGIN + LINE_FLOATS, 0.0);
    let skew = buf[SCRATCH_MARGIN..]
        .as_ptr()
        .align_offset(64)
        .min(LINE_FLOATS);
    let start = SCRATCH_MARGIN + skew;
    &mut buf[start..start + len]
}

/// Fewest row blocks one thread claims at a time in a single-row (decode) GEMM. One row is
/// memory-bound, and every claim starts a new stream whose first lines arrive cold; claims of at
/// least 8 blocks (≈ 92 KB of q4_1 at K = 576) make a whole M = 1 sweep of SmolLM2 2-6 % faster
/// than single-block claims, 16 makes it slower again (`xdna bench gemm --m 1 --compare-chunks
/// 1,8,16`), and the tail imbalance 8 allows is a few µs. Multi-row calls are compute-bound and
/// claim single blocks, from per-thread shares (`Schedule::Shares`).
pub const SINGLE_ROW_MIN_CHUNK: usize = 8;

/// Runs GEMMs on the host CPU (the "host executor" of a kernel descriptor).
#[derive(Debug)]
pub struct HostExecutor {
    /// Use the portable scalar path even when AVX2 is available (tests, comparisons).
    force_scalar: bool,
    /// Use the AVX2 multi-row loops even when AVX-512 VNNI is available (tests, comparisons).
    no_vnni: bool,
    /// Fewest row blocks per claim in a single-row GEMM ([`SINGLE_ROW_MIN_CHUNK`] unless tuned).
    single_row_min_chunk: usize,
}

impl Default for HostExecutor {
    fn default() -> Self {
        HostExecutor::new()
    }
}

impl HostExecutor {
    /// The executor using the best path this CPU supports.
    pub fn new() -> Self {
        HostExecutor {
            force_scalar: false,
            no_vnni: false,
            single_row_min_chunk: SINGLE_ROW_MIN_CHUNK,
        }
    }

    /// An executor that always uses the portable scalar path.
    pub fn scalar() -> Self {
        HostExecutor {
            force_scalar: true,
            no_vnni: false,
            single_row_min_chunk: SINGLE_ROW_MIN_CHUNK,
        }
    }

    /// An executor whose multi-row kernels use AVX2's `maddubs` even on a CPU with AVX-512 VNNI
    /// (the two give the same bits; this is for comparing them).
    pub fn without_vnni() -> Self {
        HostExecutor {
            no_vnni: true,
            ..HostExecutor::new()
        }
    }

    /// This executor with single-row GEMMs claiming at least `blocks` row blocks at a time (at
    /// least 1): the knob `xdna bench gemm --compare-chunks` turns. Results do not depend on it.
    pub fn with_single_row_min_chunk(mut self, blocks: usize) -> Self {
        self.single_row_min_chunk = blocks.max(1);
        self
    }

    /// A shared executor (it holds no state; any instance uses the global pool).
    pub fn global() -> &'static HostExecutor {
        static GLOBAL: HostExecutor = HostExecutor {
            force_scalar: false,
            no_vnni: false,
            single_row_min_chunk: SINGLE_ROW_MIN_CHUNK,
        };
        &GLOBAL
    }

    /// Does this executor use the AVX2 kernels?
    pub fn uses_avx2(&self) -> bool {
        !self.force_scalar && fast_available()
    }

    /// Do this executor's multi-row kernels use AVX-512 VNNI?
    pub fn uses_vnni(&self) -> bool {
        self.int_dot() == Some(avx2::IntDot::Vnni)
    }

    /// Does this executor take bf16 matrices with `vdpbf16ps` against activations rounded to
    /// bf16 (AVX-512 BF16 beside VNNI), as llama.cpp does, rather than with f32 FMAs against
    /// f32 activations?
    pub fn rounds_bf16_activations(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self.uses_vnni() && super::avx512::bf16_dot_available()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Does this executor take bf16 matrices of `k` columns as AMX-BF16 tile products
    /// (`amx_bf16`, every call and row count alike) where a block is whole tiles?
    pub fn bf16_tiles(&self, k: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self.rounds_bf16_activations()
                && super::amx_bf16::available()
                && super::amx_bf16::fits(TILE_ROWS, k)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = k;
            false
        }
    }

    /// Whether this executor runs `format` from interleaved rows (`host_layout`,
    /// [`Packing::InterleavedRows`]): IQ4_NL, Q5_0 and Q5_1 on the AVX2 and AVX-512 VNNI paths.
    /// The loader lays such matrices out so; every path runs either layout.
    pub fn interleaves_rows(&self, format: WeightFormat) -> bool {
        self.int_dot().is_some() && host_layout::interleaved_block_bytes(format).is_some()
    }

    /// Whether this executor runs a `rows`-row matrix of `format` from K tiles (`host_layout`,
    /// [`Packing::KTiles`]): GGUF Q4_K, Q5_K and IQ4_XS on the AVX2 path without VNNI, where
    /// the 4-bit tile kernels outrun the row kernels (the VNNI and AMX paths keep their row
    /// kernels). The loader lays such matrices out so; every path runs either layout.
    pub fn k_tiles(&self, format: WeightFormat, rows: usize) -> bool {
        self.int_dot() == Some(avx2::IntDot::Maddubs) && host_layout::has_k_tiles(format, rows)
    }

    /// Which kernel this executor runs a matrix of `format` with on this CPU, in words (`xdna
    /// pack info`): the kernel family and the instruction set chosen at run time.
    pub fn kernel_for(&self, format: WeightFormat) -> String {
        let int_dot = match self.int_dot() {
            Some(avx2::IntDot::Vnni) => "AVX-512 VNNI",
            Some(_) => "AVX2",
            None => "scalar",
        };
        let simd = if self.uses_avx2() { "AVX2" } else { "scalar" };
        match fast_kernel(format, Packing::Tiles) {
            FastKernel::Q4(_) => format!("q4 tile dot on q8 activations ({int_dot})"),
            FastKernel::Q8(_) => format!("q8 tile dot on q8 activations ({int_dot})"),
            // Whether a K of whole chunks runs on tiles; the text names the exception.
            FastKernel::Plain(avx2::PlainKind::Bf16) if self.bf16_tiles(TILE_ROWS) => {
                "bf16 AMX tile products on bf16 activations (AMX-BF16; vdpbf16ps where K is not \
                 whole 32-value chunks)"
                    .into()
            }
            FastKernel::Plain(avx2::PlainKind::Bf16) if self.rounds_bf16_activations() => {
                "bf16 row dots in 4 x 3 register tiles on bf16 activations (AVX-512 BF16)".into()
            }
            FastKernel::Plain(_) if self.uses_vnni() => format!(
                "{} row dots in 4 x 3 register tiles on f32 activations (AVX-512)",
                format.name()
            ),
            FastKernel::Plain(_) if self.uses_avx2() => format!(
                "{} row dots in 3 x 4 register tiles on f32 activations, one sum per pair (AVX2)",
                format.name()
            ),
            FastKernel::Plain(_) => {
                format!("{} row dot on f32 activations (scalar)", format.name())
            }
            FastKernel::Ggml => {
                let vnni = self.int_dot() == Some(avx2::IntDot::Vnni);
                match format {
                    _ if self.k_tiles(format, TILE_ROWS) => format!(
                        "{} rows re-laid at load as {}, 4-bit tile dot on q8_K activations \
                         ({int_dot}; a row count that is not whole blocks of 32 keeps the rows, \
                         dotted in place)",
                        format.name(),
                        match host_layout::KTileType::of(format) {
                            Some(host_layout::KTileType::Q5K) => {
                                "Q4_K tiles with f16 row scales and a fifth-bit plane"
                            }
                            Some(host_layout::KTileType::Iq4Xs) => {
                                "tiles of table indices under i8 scales and f16 row scales, the \
                                 values plus 128 in two 4-bit planes"
                            }
                            _ => "Q4_K tiles with f16 row scales",
                        }
                    ),
                    _ if self.interleaves_rows(format) => format!(
                        "{} rows interleaved 8 at a time at load, dotted on q8 activations \
                         ({int_dot})",
                        format.name()
                    ),
                    WeightFormat::Ggml(
                        GgmlType::Q4_K
                        | GgmlType::Q5_K
                        | GgmlType::Q6_K
                        | GgmlType::Q2_K
                        | GgmlType::Q3_K
                        | GgmlType::IQ4_XS,
                    ) if self.uses_avx2() => {
                        format!(
                            "{} blocks dotted in place on q8_K activations ({int_dot})",
                            format.name()
                        )
                    }
                    WeightFormat::Ggml(
                        GgmlType::Q4_0
                        | GgmlType::Q4_1
                        | GgmlType::Q5_0
                        | GgmlType::Q5_1
                        | GgmlType::Q8_0
                        | GgmlType::IQ4_NL,
                    ) if self.uses_avx2() && !vnni => {
                        format!(
                            "{} blocks dotted in place on q8 activations (AVX2)",
                            format.name()
                        )
                    }
                    _ => format!(
                        "ggml block rows unpacked to i8, dot on q8 activations ({})",
                        if vnni {
                            "AVX2 unpack, AVX-512 VNNI dot"
                        } else {
                            simd
                        }
                    ),
                }
            }
        }
    }

    /// The integer dot product the fast kernels use, or `None` on the scalar path.
    fn int_dot(&self) -> Option<avx2::IntDot> {
        if !self.uses_avx2() {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        if !self.no_vnni && avx2::vnni_available() {
            return Some(avx2::IntDot::Vnni);
        }
        Some(avx2::IntDot::Maddubs)
    }

    /// `y[m×N] = x[m×K] · Wᵀ`; `x` is `m × K` row-major, `y` is `m × N` row-major.
    pub fn gemm(
        &self,
        w: &WeightMatrix,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        self.gemm_strided(w, x, m, y, w.rows)
    }

    /// As [`HostExecutor::gemm`], writing row i of the result to `y[i * y_stride .. i * y_stride + N]`
    /// (so a fused projection can write into its slice of a wider output).
    pub fn gemm_strided(
        &self,
        w: &WeightMatrix,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        y_stride: usize,
    ) -> Result<(), KernelError> {
        check_activations(w, x, m)?;
        let needed = if m == 0 {
            0
        } else {
            (m - 1) * y_stride + w.rows
        };
        if y_stride < w.rows || y.len() < needed {
            return Err(KernelError::Shape {
                what: "output y ((m-1) × stride + N)",
                expected: needed.max(m * w.rows),
                got: y.len(),
            });
        }
        // Re-validate: the fields are public, so a hand-built WeightMatrix may be inconsistent.
        w.check_bytes()?;
        if m == 0 || w.rows == 0 {
            return Ok(());
        }
        let fast = self.int_dot();
        let kernel = fast_kernel(w.format, w.packing);
        // Each row block's columns of every row are written by the one thread that claimed the block.
        let out = SharedMut::new(y);
        let blocks = w.rows.div_ceil(TILE_ROWS);
        self.with_activations(w, x, m, kernel, |act, x_bf16| {
            self.for_each_claimed(blocks, m, 1, |block, block_out, scalar| {
                run_block(
                    w, kernel, fast, act, x, x_bf16, m, block, block_out, scalar, out, y_stride,
                );
            });
        });
        Ok(())
    }

    /// `out[m × N/2] = silu(x · W_gateᵀ) ⊙ (x · W_upᵀ)` for a fused gate‖up matrix `w` (rows
    /// `0..N/2` the gate projection, the rest the up projection; `out` is `m × N/2` row-major):
    /// SwiGLU as the GEMM's epilogue. Each thread computes a gate block and the up block of the
    /// same columns and writes their SwiGLU, so the `m × N` product is never stored and read back
    /// (nor read by the other core), and the activation costs no pool dispatch of its own.
    /// Every output has the bits of [`HostExecutor::gemm`] followed by
    /// [`super::activation::swiglu`]. `gate_up` (`m × N`) holds the product where blocks cannot
    /// be paired (below); the fused path leaves it untouched.
    pub fn gemm_swiglu(
        &self,
        w: &WeightMatrix,
        x: &[f32],
        m: usize,
        gate_up: &mut [f32],
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let inter = w.rows / 2;
        check_activations(w, x, m)?;
        if !w.rows.is_multiple_of(2) || out.len() < m * inter {
            return Err(KernelError::Shape {
                what: "SwiGLU output (m × N/2, N even)",
                expected: m * inter,
                got: out.len(),
            });
        }
        let out = &mut out[..m * inter];
        // One row streams the weights in order (memory-bound, see `Schedule`), and a block pair
        // needs whole blocks on both sides: otherwise the product, then the activation.
        if m < 2 || inter == 0 || !inter.is_multiple_of(TILE_ROWS) {
            let Some(gate_up) = gate_up.get_mut(..m * w.rows) else {
                return Err(KernelError::Shape {
                    what: "gate‖up scratch (m × N)",
                    expected: m * w.rows,
                    got: gate_up.len(),
                });
            };
            self.gemm(w, x, m, gate_up)?;
            super::activation::swiglu(gate_up, inter, out);
            return Ok(());
        }
        w.check_bytes()?;
        let fast = self.int_dot();
        let kernel = fast_kernel(w.format, w.packing);
        // Each block pair's columns of every row are written by the one thread that claimed it.
        let shared_out = SharedMut::new(out);
        let pairs = inter / TILE_ROWS;
        self.with_activations(w, x, m, kernel, |act, x_bf16| {
            self.for_each_claimed(pairs, m, 2, |pair, both, scalar| {
                let (gate, up) = both.split_at_mut(ROWS_PER_PASS * TILE_ROWS);
                let n0 = pair * TILE_ROWS;
                let mut row0 = 0;
                while row0 < m {
                    let pass = (m - row0).min(ROWS_PER_PASS);
                    let rows = row0..row0 + pass;
                    prefetch_output(shared_out, rows.clone(), inter, n0, TILE_ROWS);
                    let (gate, up) = (&mut gate[..pass * TILE_ROWS], &mut up[..pass * TILE_ROWS]);
                    let up_block = pairs + pair;
                    compute_block(
                        w,
                        kernel,
                        fast,
                        act,
                        x,
                        x_bf16,
                        rows.clone(),
                        pair,
                        gate,
                        scalar,
                    );
                    compute_block(w, kernel, fast, act, x, x_bf16, rows, up_block, up, scalar);
                    for (i, (g, u)) in gate
                        .chunks_exact(TILE_ROWS)
                        .zip(up.chunks_exact(TILE_ROWS))
                        .enumerate()
                    {
                        let at = (row0 + i) * inter + n0;
                        // SAFETY: row0 + i < m and n0 + 32 ≤ inter, so the span is inside `out`
                        // (m × inter); the pair's columns are this thread's alone (claimed once).
                        let span = unsafe { shared_out.slice_mut(at..at + TILE_ROWS) };
                        super::fastexp::silu_mul(g, u, span);
                    }
                    row0 += pass;
                }
            });
        });
        Ok(())
    }

    /// `work(item, block_scratch, scalar_scratch)` for every item of `0..items` over the pool,
    /// each item claimed by one thread ([`Schedule`] for an `m`-row call), with that thread's
    /// padded scratch for `blocks_per_item` blocks of [`ROWS_PER_PASS`] rows.
    fn for_each_claimed(
        &self,
        items: usize,
        m: usize,
        blocks_per_item: usize,
        work: impl Fn(usize, &mut [f32], &mut ScalarScratch) + Sync,
    ) {
        let pool = Pool::global();
        let schedule = self.schedule(items, m, pool);
        pool.run(&|thread, _| {
            BLOCK_SCRATCH.with(|scratch| {
                let mut scratch = scratch.borrow_mut();
                let (block_out, scalar) = &mut *scratch;
                let block_out =
                    padded_scratch(block_out, blocks_per_item * ROWS_PER_PASS * TILE_ROWS);
                while let Some(range) = schedule.claim(thread) {
                    for item in range {
                        work(item, block_out, scalar);
                    }
                }
            });
        });
    }

    /// How one call's `blocks` work items are handed to the pool threads (see [`Schedule`]).
    fn schedule(&self, blocks: usize, m: usize, pool: &Pool) -> Schedule {
        if m == 1 {
            Schedule::Guided(ChunkCounter::guided(
                blocks,
                pool.threads(),
                self.single_row_min_chunk,
            ))
        } else {
            Schedule::Shares(ShareCounter::new(blocks, pool.threads(), 1))
        }
    }

    /// Run `body` with `x` in the form the kernels of `w` read: q8 groups for tile and ggml
    /// formats (`act`), bf16 for bf16 weights on `vdpbf16ps` or AMX tiles (`x_bf16`), else
    /// neither (the f32 rows themselves).
    fn with_activations(
        &self,
        w: &WeightMatrix,
        x: &[f32],
        m: usize,
        kernel: FastKernel,
        body: impl FnOnce(Option<&QuantizedRows>, Bf16Activations<'_>),
    ) {
        let fast = self.int_dot();
        // ggml blocks always take q8 activations (their scalar reference too, as ggml's do).
        let ggml = matches!(w.format, WeightFormat::Ggml(_));
        if (w.format.tile_bytes().is_some() && fast.is_some()) || ggml {
            super::with_scratch(&ACTIVATIONS, |act| {
                act.quantize(x, m, w.cols, ActivationScale::for_format(w.format));
                body(Some(act), Bf16Activations::default());
            });
        } else if matches!(kernel, FastKernel::Plain(avx2::PlainKind::Bf16))
            && self.rounds_bf16_activations()
        {
            let tiles = self.bf16_tiles(w.cols);
            super::with_scratch(&BF16_ACTIVATIONS, |(rounded, paired)| {
                let x_bf16 = line_aligned(rounded, x.len());
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `rounds_bf16_activations` means AVX-512 F, BW and BF16 are available;
                // `x_bf16` was just sized to `x`.
                unsafe {
                    super::avx512::round_to_bf16(x, x_bf16)
                };
                let mut pairs: &[u16] = &[];
                #[cfg(target_arch = "x86_64")]
                if tiles {
                    let out = line_aligned(paired, super::amx_bf16::pair_tiles_len(m, w.cols));
                    // SAFETY: `bf16_tiles` means AMX-BF16 and AVX-512 F are available and K is
                    // whole chunks; `x_bf16` holds m rows of K and `out` was sized for them.
                    unsafe { super::amx_bf16::pair_tiles(x_bf16, m, w.cols, out) };
                    pairs = out;
                }
                body(
                    None,
                    Bf16Activations {
                        rows: x_bf16,
                        pairs,
                    },
                );
            });
        } else {
            body(None, Bf16Activations::default());
        }
    }
}

/// A call's activations rounded to bf16, for a bf16 matrix: `rows` row-major (empty where the
/// matrix takes f32 or q8 activations) and `pairs` as AMX B tiles (empty where it takes no tiles).
#[derive(Clone, Copy, Default)]
struct Bf16Activations<'a> {
    rows: &'a [u16],
    pairs: &'a [u16],
}

/// `len` elements of `buf` from its first cache line boundary: rows start on a line, so the
/// kernels' 64-byte loads (and tile rows) never straddle two. The caller overwrites them all, so
/// only a grown buffer is filled (once).
fn line_aligned(buf: &mut Vec<u16>, len: usize) -> &mut [u16] {
    const LINE_ELEMS: usize = 32;
    if buf.capacity() < len + LINE_ELEMS - 1 {
        buf.clear();
        buf.reserve(len + LINE_ELEMS - 1);
    }
    let start = buf.as_ptr().align_offset(64).min(LINE_ELEMS - 1);
    if buf.len() < start + len {
        buf.resize(start + len, 0);
    }
    &mut buf[start..start + len]
}

/// `x` holds `m` rows of the matrix's K columns, or a shape error says what it holds.
pub(super) fn check_activations(w: &WeightMatrix, x: &[f32], m: usize) -> Result<(), KernelError> {
    if x.len() != m * w.cols {
        return Err(KernelError::Shape {
            what: "activations x (m × K)",
            expected: m * w.cols,
            got: x.len(),
        });
    }
    Ok(())
}

/// Is the AVX2 path usable on this CPU?
pub fn fast_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Compute output columns `block*32 .. block*32+32` (fewer for a plain matrix's last block) for all
/// `m` activation rows and write them to `y`.
#[allow(clippy::too_many_arguments)] // the per-call context of one work item
fn run_block(
    w: &WeightMatrix,
    kernel: FastKernel,
    fast: Option<avx2::IntDot>,
    act: Option<&QuantizedRows>,
    x: &[f32],
    x_bf16: Bf16Activations<'_>,
    m: usize,
    block: usize,
    block_out: &mut [f32],
    scalar: &mut ScalarScratch,
    y: SharedMut<'_, f32>,
    y_stride: usize,
) {
    let n0 = block * TILE_ROWS;
    let rows_here = (w.rows - n0).min(TILE_ROWS);
    let mut row0 = 0;
    while row0 < m {
        let pass = (m - row0).min(ROWS_PER_PASS);
        prefetch_output(y, row0..row0 + pass, y_stride, n0, rows_here);
        let out = &mut block_out[..pass * TILE_ROWS];
        compute_block(
            w,
            kernel,
            fast,
            act,
            x,
            x_bf16,
            row0..row0 + pass,
            block,
            out,
            scalar,
        );
        #[cfg(target_arch = "x86_64")]
        if fast.is_some() && rows_here == TILE_ROWS {
            // SAFETY: `fast` means AVX2 is available; `out` holds `pass` rows of 32 floats; row
            // (row0+i) < m of y has 32 floats from n0 + 32 ≤ N (see the copy below for why they
            // are inside y, disjoint between threads, and apart from `out`).
            unsafe {
                avx2::copy_block_rows(out, y.as_mut_ptr().add(row0 * y_stride + n0), y_stride)
            };
            row0 += pass;
            continue;
        }
        for (i, src) in out.chunks_exact(TILE_ROWS).enumerate() {
            // SAFETY: (row0+i) < m and n0 + rows_here ≤ N, so the range ends at or before
            // (m-1)·stride + N ≤ y.len() (checked in gemm_strided); blocks are disjoint, so no
            // two threads write it, and `src` (thread scratch) does not overlap `y`.
            unsafe {
                let dst = y.as_mut_ptr().add((row0 + i) * y_stride + n0);
                if rows_here == TILE_ROWS {
                    // A full block row: a fixed-size copy (inlined vector moves, no memcpy call).
                    std::ptr::write_unaligned(
                        dst.cast::<[f32; TILE_ROWS]>(),
                        std::ptr::read_unaligned(src.as_ptr().cast::<[f32; TILE_ROWS]>()),
                    );
                } else {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, rows_here);
                }
            };
        }
        row0 += pass;
    }
}

/// Ask for the lines of `y` that rows `rows` of this block will write, for writing (`prefetchw`),
/// before computing them. `y` was last touched by the other core or the caller's next op, so each
/// line is a read-for-ownership; issued here they complete under the block's compute instead of
/// stalling the copy and the next claim's atomic (which waits for the stores to drain): a 16-row
/// sweep of SmolLM2's projections runs 4-5 % faster on 2 threads (`docs/performance.md`, "Host GEMM,
/// sixteen rows").
fn prefetch_output(
    y: SharedMut<'_, f32>,
    rows: std::ops::Range<usize>,
    y_stride: usize,
    n0: usize,
    rows_here: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0};
        const LINE_FLOATS: usize = 16;
        for row in rows {
            // Every 16th float and the last: all the lines, aligned or not.
            let last = rows_here.saturating_sub(1);
            for column in (0..rows_here).step_by(LINE_FLOATS).chain([last]) {
                let at = y.as_mut_ptr().wrapping_add(row * y_stride + n0 + column);
                // SAFETY: a prefetch is only a hint: it never faults (and the address is inside
                // `y`, the block's own columns of row `row`).
                unsafe { _mm_prefetch::<{ _MM_HINT_ET0 }>(at as *const i8) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (y, rows, y_stride, n0, rows_here);
}

/// One block, activation rows `rows`: `out[(i - rows.start) * 32 + r]`.
#[allow(clippy::too_many_arguments)] // the per-call context of one work item
fn compute_block(
    w: &WeightMatrix,
    kernel: FastKernel,
    fast: Option<avx2::IntDot>,
    act: Option<&QuantizedRows>,
    x: &[f32],
    x_bf16: Bf16Activations<'_>,
    rows: std::ops::Range<usize>,
    block: usize,
    out: &mut [f32],
    scalar: &mut ScalarScratch,
) {
    let k = w.cols;
    if let (WeightFormat::Ggml(ty), Some(act)) = (w.format, act) {
        let n0 = block * TILE_ROWS;
        let path = match fast {
            Some(avx2::IntDot::Vnni) => ggml_dot::Path::Avx512Vnni,
            Some(avx2::IntDot::Maddubs) => ggml_dot::Path::Avx2,
            None => ggml_dot::Path::Scalar,
        };
        let out_rows = (w.rows - n0).min(TILE_ROWS);
        if w.packing == Packing::KTiles {
            #[cfg(target_arch = "x86_64")]
            if let (Some(dot), FastKernel::Q4(layout)) = (fast, kernel) {
                let block_bytes = w.block_bytes();
                let data = &w.data[block * block_bytes..(block + 1) * block_bytes];
                // SAFETY: `fast` means avx2::available(), and `IntDot::Vnni` means
                // avx2::vnni_available() (`int_dot`); `data` is the row block's K tiles (the
                // matrix length was validated against its shape, whole blocks of 32 rows and
                // 256 columns), rows ⊂ 0..m, and `out` holds rows.len() × 32 floats.
                unsafe { avx2::q4_block(layout, data, act, rows, dot, out) };
                return;
            }
            // Paths without the tile kernels read the GGUF rows, taken back exactly.
            let take_back = |gguf: &mut [u8]| {
                host_layout::k_tiles_to_rows(w.format, w.data, k, n0..n0 + out_rows, gguf)
            };
            ggml_dot::block_over_rows_taken_back(
                path, ty, k, out_rows, act, rows, out, TILE_ROWS, take_back,
            );
            let _ = (kernel, x, scalar);
            return;
        }
        if w.packing == Packing::InterleavedRows {
            ggml_dot::interleaved_block(
                path, ty, w.data, k, n0, out_rows, act, rows, out, TILE_ROWS,
            );
        } else {
            // The length was validated against the shape, so each row is data.len() / rows bytes.
            let row_bytes = w.data.len() / w.rows.max(1);
            ggml_dot::block(
                path, ty, w.data, row_bytes, k, n0, out_rows, act, rows, out, TILE_ROWS,
            );
        }
        let _ = (kernel, x, scalar);
        return;
    }
    if let Some(tile_bytes) = w.format.tile_bytes() {
        let block_bytes = w.block_bytes();
        let data = &w.data[block * block_bytes..(block + 1) * block_bytes];
        #[cfg(target_arch = "x86_64")]
        if let Some(dot) = fast {
            if let Some(act) = act {
                debug_assert_eq!(act.cols, k.div_ceil(GROUP) * GROUP);
                match kernel {
                    // SAFETY: `fast` means avx2::available(), and `IntDot::Vnni` means
                    // avx2::vnni_available() (`int_dot`); `data` is the full row block (its
                    // length follows from matrix_bytes, validated by the caller), rows ⊂ 0..m,
                    // and `out` holds rows.len() × 32 floats.
                    FastKernel::Q4(layout) => unsafe {
                        avx2::q4_block(layout, data, act, rows, dot, out)
                    },
                    // SAFETY: as above.
                    FastKernel::Q8(layout) => unsafe {
                        avx2::q8_block(layout, data, act, rows, dot, out)
                    },
                    FastKernel::Plain(_) | FastKernel::Ggml => {}
                }
                return;
            }
        }
        let _ = (kernel, fast, act);
        scalar_tiled_block(w, data, tile_bytes, x, rows, out, scalar);
        return;
    }
    // Plain formats: one weight row at a time, f32 dot products.
    let elem = w.format.plain_elem_bytes().unwrap_or(4);
    let n0 = block * TILE_ROWS;
    let rows_here = (w.rows - n0).min(TILE_ROWS);
    #[cfg(target_arch = "x86_64")]
    if !x_bf16.rows.is_empty() {
        let data = &w.data[n0 * k * elem..(n0 + rows_here) * k * elem];
        if !x_bf16.pairs.is_empty() && super::amx_bf16::fits(rows_here, k) {
            // SAFETY: activations come paired only when `bf16_tiles` (AMX-BF16 available, K
            // whole chunks); the block is whole tiles (`fits`), `data` holds its rows_here rows
            // of k bf16, `pairs` all m rows, `rows` starts on a multiple of ROWS_PER_PASS (so of
            // 16), and `out` holds TILE_ROWS floats per row of `rows`.
            unsafe {
                super::amx_bf16::rows(data, rows_here, k, x_bf16.pairs, rows, out, TILE_ROWS)
            };
            return;
        }
        // SAFETY: activations come rounded only when `rounds_bf16_activations` (AVX-512 F, BW
        // and BF16) chose this path for a bf16 matrix; `data` holds rows_here rows of k bf16,
        // `x_bf16` k elements per activation row (rows ⊂ 0..m), and `out` TILE_ROWS floats per
        // row of `rows`.
        if rows.len() >= PLAIN_TILE_MIN_ROWS {
            // SAFETY: as above.
            unsafe {
                super::avx512::bf16_rows(data, rows_here, k, x_bf16.rows, rows, out, TILE_ROWS)
            };
            return;
        }
        for r in 0..rows_here {
            let wrow = &data[r * k * 2..(r + 1) * k * 2];
            for (slot, i) in rows.clone().enumerate() {
                // SAFETY: as above; wrow holds k bf16 and the slice k elements.
                out[slot * TILE_ROWS + r] =
                    unsafe { super::avx512::bf16_dot(wrow, &x_bf16.rows[i * k..(i + 1) * k], k) };
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    // The AVX-512 path: register tiles from a few activation rows on; alone, a row streams best
    // one weight row after the other (the tiles read four rows at once); both give the same bits.
    if let (Some(avx2::IntDot::Vnni), FastKernel::Plain(kind), true) =
        (fast, kernel, rows.len() >= PLAIN_TILE_MIN_ROWS)
    {
        let data = &w.data[n0 * k * elem..(n0 + rows_here) * k * elem];
        // SAFETY: `IntDot::Vnni` is only chosen when AVX2, FMA, F16C and AVX-512 F are available
        // (`avx2::vnni_available`); `data` holds rows_here rows of k elements, `x` k floats per
        // activation row (rows ⊂ 0..m), and `out` TILE_ROWS floats per row of `rows`.
        unsafe { super::avx512::plain_rows(kind, data, rows_here, k, x, rows, out, TILE_ROWS) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    // The AVX2 path's tiles at every row count: their order (one sum per pair) is that path's.
    if let (Some(avx2::IntDot::Maddubs), FastKernel::Plain(kind)) = (fast, kernel) {
        let data = &w.data[n0 * k * elem..(n0 + rows_here) * k * elem];
        // SAFETY: `fast` means the CPU has AVX2, FMA and F16C; `data` holds rows_here rows of k
        // elements, `x` k floats per activation row (rows ⊂ 0..m), and `out` TILE_ROWS floats
        // per row of `rows`.
        unsafe { avx2::plain_rows(kind, data, rows_here, k, x, rows, out, TILE_ROWS) };
        return;
    }
    for r in 0..rows_here {
        let wrow = &w.data[(n0 + r) * k * elem..(n0 + r + 1) * k * elem];
        for (slot, i) in rows.clone().enumerate() {
            let xr = &x[i * k..(i + 1) * k];
            #[cfg(target_arch = "x86_64")]
            if fast.is_some() {
                if let FastKernel::Plain(kind) = kernel {
                    // SAFETY: `fast` (here the AVX-512 path's few rows) means the CPU has
                    // AVX2/FMA/F16C; wrow holds k elements and xr has k floats.
                    out[slot * TILE_ROWS + r] = unsafe { avx2::plain_dot(kind, wrow, xr, k) };
                    continue;
                }
            }
            out[slot * TILE_ROWS + r] = scalar_plain_dot(w.format, wrow, xr);
        }
    }
}

fn scalar_plain_dot(format: WeightFormat, wrow: &[u8], x: &[f32]) -> f32 {
    match format {
        WeightFormat::F32 => wrow
            .chunks_exact(4)
            .zip(x)
            .map(|(b, &v)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * v)
            .sum(),
        WeightFormat::Bf16 => wrow
            .chunks_exact(2)
            .zip(x)
            .map(|(b, &v)| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32() * v)
            .sum(),
        _ => wrow
            .chunks_exact(2)
            .zip(x)
            .map(|(b, &v)| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32() * v)
            .sum(),
    }
}

/// A thread's scratch for the portable path: one decoded tile, and one tile rebuilt from group
/// records (kept across blocks, so the scalar path allocates nothing after warm-up).
struct ScalarScratch {
    decoded: Vec<f32>,
    tile: Vec<u8>,
}

/// The portable path for tile formats: decode one tile at a time, f32 dots over real columns.
fn scalar_tiled_block(
    w: &WeightMatrix,
    data: &[u8],
    tile_bytes: usize,
    x: &[f32],
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    scratch: &mut ScalarScratch,
) {
    let k = w.cols;
    let tile_cols = w.format.tile_cols();
    let ScalarScratch {
        decoded,
        tile: rebuilt,
    } = scratch;
    decoded.resize(TILE_ROWS * tile_cols, 0.0);
    out[..rows.len() * TILE_ROWS].fill(0.0);
    // Group records are turned back into tiles, so both packings sum in the same order.
    if w.packing == Packing::GroupRecords {
        rebuilt.resize(tile_bytes, 0);
    }
    for t in 0..w.format.padded_cols(k) / tile_cols {
        let tile = match w.packing {
            // Interleaved rows and K tiles exist only for ggml blocks (`check_bytes` refuses
            // them for tile formats).
            Packing::Tiles | Packing::InterleavedRows | Packing::KTiles => {
                &data[t * tile_bytes..(t + 1) * tile_bytes]
            }
            Packing::GroupRecords => {
                host_layout::tile_from_records(w.format, data, t, rebuilt);
                &rebuilt[..]
            }
        };
        // The tile length is exact, so decoding cannot fail.
        if tiles::decode_tile(w.format, tile, decoded).is_err() {
            continue;
        }
        let c0 = t * tile_cols;
        let width = (k - c0).min(tile_cols);
        for (slot, i) in rows.clone().enumerate() {
            let xr = &x[i * k + c0..i * k + c0 + width];
            for r in 0..TILE_ROWS {
                let wr = &decoded[r * tile_cols..r * tile_cols + width];
                out[slot * TILE_ROWS + r] += wr.iter().zip(xr).map(|(a, b)| a * b).sum::<f32>();
            }
        }
    }
}

/// Run a kernel descriptor on the host over raw argument buffers (what a device backend or the
/// shim's EXEC path holds): `weight` is the tile grid, `x` is `m × K` little-endian f32, `y`
/// receives `m × N` f32. `m` follows from `x.len()` and must fit the descriptor's row family.
pub fn execute(
    desc: &super::KernelDesc,
    weight: &[u8],
    x: &[u8],
    y: &mut [u8],
) -> Result<(), KernelError> {
    if desc.op != "gemm" {
        return Err(KernelError::Unsupported(format!(
            "host executor has no op {:?}",
            desc.op
        )));
    }
    let (k, n) = (desc.k as usize, desc.n as usize);
    let w = WeightMatrix::new(desc.wfmt, n, k, weight)?;
    let row_bytes = 4 * k;
    if row_bytes == 0 || !x.len().is_multiple_of(row_bytes) {
        return Err(KernelError::Shape {
            what: "x bytes (m × K × 4)",
            expected: x.len().div_ceil(row_bytes.max(1)) * row_bytes,
            got: x.len(),
        });
    }
    let m = x.len() / row_bytes;
    if m > desc.family.max_rows() {
        return Err(KernelError::Shape {
            what: "activation rows (≤ row family)",
            expected: desc.family.max_rows(),
            got: m,
        });
    }
    if y.len() != 4 * m * n {
        return Err(KernelError::Shape {
            what: "y bytes (m × N × 4)",
            expected: 4 * m * n,
            got: y.len(),
        });
    }
    // Argument buffers are normally 4-byte aligned (BO mappings); copy only if one is not.
    let x_owned;
    let x_f32: &[f32] = match bytemuck::try_cast_slice(x) {
        Ok(v) => v,
        Err(_) => {
            x_owned = x
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect::<Vec<f32>>();
            &x_owned
        }
    };
    match bytemuck::try_cast_slice_mut::<u8, f32>(y) {
        Ok(y_f32) => HostExecutor::global().gemm(&w, x_f32, m, y_f32),
        Err(_) => {
            let mut y_f32 = vec![0f32; m * n];
            HostExecutor::global().gemm(&w, x_f32, m, &mut y_f32)?;
            for (dst, v) in y.chunks_exact_mut(4).zip(&y_f32) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
            Ok(())
        }
    }
}
