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
#[cfg(target_arch = "x86_64")]
pub mod amx;
#[cfg(target_arch = "x86_64")]
pub mod amx_bf16;
pub mod attention;
pub mod avx2;
pub mod avx512;
pub mod bandwidth;
pub mod device_exec;
pub mod elf;
pub mod fastexp;
pub mod gemm;
pub mod ggml_dot;
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

/// Whether the AMX-INT8 tile kernels run on this CPU (`amx::available`; never off x86-64): the
/// GGUF super-block types' calls of 16 activation rows or more.
pub fn amx_tiles_run() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs `f` on this thread's scratch value in `key`, or on a fresh default one when the scratch
/// is already borrowed (a re-entered kernel on the same thread), so re-entry never panics.
pub(crate) fn with_scratch<T: Default + 'static, R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        Err(_) => f(&mut T::default()),
    })
}

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
    /// The file does not start with the ELF magic bytes.
    #[error("bad magic (not an ELF file)")]
    BadMagic,
    /// The ELF class/data bytes are not ELFCLASS64 little-endian; holds the class byte.
    #[error("bad class {0} (need ELFCLASS64 little-endian)")]
    BadClass(u8),
    /// `EI_OSABI` is not 69 (AIE2P); holds the byte found.
    #[error("wrong OSABI {0} (need 69, AIE2P)")]
    WrongOsAbi(u8),
    /// A header, table or name runs past the end of the file; says which.
    #[error("truncated: {0}")]
    Truncated(String),
    /// The section name table (`e_shstrndx`) is not a string table.
    #[error("section name table: {0}")]
    BadSectionNameTable(String),
    /// The named section's bytes lie outside the file.
    #[error("section {0:?} lies outside the file")]
    SectionOutOfBounds(String),
    /// The two named sections share bytes of the file.
    #[error("sections {0:?} and {1:?} overlap")]
    OverlappingSections(String, String),
    /// The `.note.xdna.kernel` descriptor has a version this build does not read.
    #[error("unknown descriptor version {0}")]
    UnknownDescriptorVersion(u32),
    /// The file has no `.note.xdna.kernel` section (read as a kernel, not wrapped).
    #[error("no .note.xdna.kernel descriptor")]
    MissingDescriptor,
    /// A note or the descriptor in it is malformed, or disagrees with the file (its name, its
    /// sections); says what.
    #[error("malformed descriptor: {0}")]
    BadDescriptor(String),
    /// `wrap_elf` was given a file that already carries a descriptor.
    #[error("already carries a .note.xdna.kernel descriptor")]
    AlreadyWrapped,
}

/// Errors of the kernels layer.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A buffer does not have the size its shape implies.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// The buffer, and the unit it is counted in when not elements.
        what: &'static str,
        /// The count the shape implies.
        expected: usize,
        /// The count passed.
        got: usize,
    },
    /// A weight matrix does not match its declared format.
    #[error("weight matrix {rows}x{cols} {format}: {source}")]
    Weight {
        /// The declared format's name.
        format: &'static str,
        /// Output rows (N) of the matrix.
        rows: usize,
        /// Input columns (K) of the matrix.
        cols: usize,
        /// Why the bytes do not fit the format.
        #[source]
        source: TileError,
    },
    /// A kernel ELF file is malformed.
    #[error("{}: {reason}", path.display())]
    Elf {
        /// The kernel file.
        path: PathBuf,
        /// What is wrong with it.
        reason: ElfReason,
    },
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A shape list line is malformed.
    #[error("{}:{line}: {reason}", path.display())]
    ShapeList {
        /// The shape list file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: String,
    },
    /// Kernels the model needs are not in the set; every one is listed.
    #[error("{} missing kernel(s):\n{}", .0.len(), .0.join("\n"))]
    Missing(Vec<String>),
    /// Two files in a kernel directory describe the same kernel.
    #[error("{} and {} both provide {key}", first.display(), second.display())]
    Duplicate {
        /// The kernel both describe, as its canonical file name.
        key: String,
        /// The file read first.
        first: PathBuf,
        /// The file that repeats it.
        second: PathBuf,
    },
    /// The request is valid but not supported (e.g. an op the host executor does not run).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A kernel carries no device control code (descriptor only) and the device is real hardware
    /// (see `device_exec`: descriptor-only kernels run only where explicitly allowed).
    #[error("{}: kernel has no device control code (.ctrltext); real NPU hardware cannot run a descriptor-only kernel (build it with the AIE toolchain and `xdna kernels wrap`, or set XDNA_ALLOW_DESCRIPTOR_KERNELS=1 on the fake device)", path.display())]
    NoControlCode {
        /// The kernel file.
        path: PathBuf,
    },
    /// The device backend failed running a kernel.
    #[error("{}: {source}", path.display())]
    Device {
        /// The kernel file that was running.
        path: PathBuf,
        /// The device layer's error.
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
