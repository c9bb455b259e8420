//! Kernels: per-shape GEMM kernels, their ELF files, and the host executors that run them on the CPU.
//!
//! # Host GEMM (what the model layer calls)
//!
//! ```no_run
//! use xdna::kernels::{HostExecutor, WeightMatrix};
//! use xdna::tiles::{ScaleType, TileOrder, WeightFormat};
//! # fn demo(bytes: &[u8]) -> Result<(), xdna::kernels::KernelError> {
//! let format = WeightFormat::Q41 { scale: ScaleType::F16, order: TileOrder::ColumnMajor };
//! // W is [N = 960, K = 576]; `bytes` is the mmapped tile grid (zero-copy).
//! let w = WeightMatrix::new(format, 960, 576, bytes)?;
//! let x = vec![0.0f32; 2 * 576]; // m = 2 activation rows, row-major [m, K]
//! let mut y = vec![0.0f32; 2 * 960]; // [m, N]
//! HostExecutor::global().gemm(&w, &x, 2, &mut y)?; // y = x · Wᵀ
//! # Ok(()) }
//! ```
//!
//! * [`HostExecutor::gemm`] is `&self` and thread-safe. It picks the AVX2+FMA+F16C path at run time
//!   (detected once) or the portable scalar path, quantizes the activations once per call into a
//!   per-thread scratch buffer (no allocation after warm-up) and spreads 32-row weight blocks over the
//!   global [`pool::Pool`]. [`HostExecutor::gemm_strided`] writes into a sub-slice with a row stride
//!   (for fused outputs).
//! * [`reference::gemm_reference`] is the slow, obviously-correct twin (tile decode + f64 dot).
//! * Weights are read in their tile layout directly (`tiles.rs`, `docs/formats.md`); nothing is
//!   repacked, and column padding beyond the logical K is not read.
//!
//! # Attention, SwiGLU, `exp`
//!
//! [`attention`] (grouped-query attention over an f16 or f32 KV cache: AVX2+FMA kernels and the
//! scalar reference), [`activation`] (SwiGLU over a batch of rows) and [`fastexp`] (the polynomial
//! `exp` both build on) are the forward pass's other host kernels. They take shapes and slices, not
//! model configurations, and split large work over the [`pool::Pool`]; a buffer its threads write
//! in disjoint parts is shared as a [`pool::SharedMut`].
//!
//! # Kernel files
//!
//! [`elf`] writes and reads kernel ELF files (`docs/kernel-elf.md`); [`set::KernelSet`] loads a
//! directory of them and reports every missing shape at once.

pub mod activation;
pub mod attention;
pub mod avx2;
pub mod avx512;
pub mod bandwidth;
pub mod device_exec;
pub mod elf;
pub mod fastexp;
pub mod gemm;
pub mod host_layout;
pub mod pool;
pub mod quant;
pub mod reference;
pub mod set;
pub mod shim_txn;

use std::path::PathBuf;

pub use device_exec::{
    DeviceExecOptions, DeviceExecutor, DeviceWeights, Executor, WeightPath, WeightPathPref,
};
pub use elf::{ArgDirection, ArgRole, KernelArg, KernelDesc};
pub use gemm::{execute, HostExecutor, WeightMatrix};
pub use set::{family_needs, KernelKey, KernelNeed, KernelSet, RowFamily, ShapeNeed};

use crate::tiles::TileError;

/// Deterministic values for the kernels' unit tests.
#[cfg(test)]
pub(crate) mod test_values {
    /// Deterministic test values in [-0.5, 0.5) (xorshift64).
    pub(crate) fn uniform_values(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        }
    }
}

/// Why a kernel file was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElfReason {
    #[error("bad magic (not an ELF file)")]
    BadMagic,
    #[error("bad class {0} (need ELFCLASS64 little-endian)")]
    BadClass(u8),
    #[error("wrong OSABI {0} (need 69, AIE2P)")]
    WrongOsAbi(u8),
    #[error("truncated: {0}")]
    Truncated(String),
    #[error("section {0:?} lies outside the file")]
    SectionOutOfBounds(String),
    #[error("sections {0:?} and {1:?} overlap")]
    OverlappingSections(String, String),
    #[error("unknown descriptor version {0}")]
    UnknownDescriptorVersion(u32),
    #[error("no .note.xdna.kernel descriptor")]
    MissingDescriptor,
    #[error("malformed descriptor: {0}")]
    BadDescriptor(String),
    #[error("already carries a .note.xdna.kernel descriptor")]
    AlreadyWrapped,
}

/// Errors of the kernels layer.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A buffer does not have the size its shape implies.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A weight matrix does not match its declared format.
    #[error("weight matrix {rows}x{cols} {format}: {source}")]
    Weight {
        format: &'static str,
        rows: usize,
        cols: usize,
        #[source]
        source: TileError,
    },
    /// A kernel ELF file is malformed.
    #[error("{}: {reason}", path.display())]
    Elf { path: PathBuf, reason: ElfReason },
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A shape list line is malformed.
    #[error("{}:{line}: {reason}", path.display())]
    ShapeList {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    /// Kernels the model needs are not in the set; every one is listed.
    #[error("{} missing kernel(s):\n{}", .0.len(), .0.join("\n"))]
    Missing(Vec<String>),
    /// Two files in a kernel directory describe the same kernel.
    #[error("{} and {} both provide {key}", first.display(), second.display())]
    Duplicate {
        key: String,
        first: PathBuf,
        second: PathBuf,
    },
    /// The request is valid but not supported (e.g. an op the host executor does not run).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A kernel carries no device control code (descriptor only) and the device is real hardware
    /// (see `device_exec`: descriptor-only kernels run only where explicitly allowed).
    #[error("{}: kernel has no device control code (.ctrltext); real NPU hardware cannot run a descriptor-only kernel (build it with the AIE toolchain and `xdna kernels wrap`, or set XDNA_ALLOW_DESCRIPTOR_KERNELS=1 on the fake device)", path.display())]
    NoControlCode { path: PathBuf },
    /// The device backend failed running a kernel.
    #[error("{}: {source}", path.display())]
    Device {
        path: PathBuf,
        #[source]
        source: crate::device::DeviceError,
    },
}

impl KernelError {
    /// An I/O error naming its file.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        KernelError::Io {
            path: path.into(),
            source,
        }
    }

    /// A malformed-ELF error naming its file.
    pub fn elf(path: impl Into<PathBuf>, reason: ElfReason) -> Self {
        KernelError::Elf {
            path: path.into(),
            reason,
        }
    }
}
