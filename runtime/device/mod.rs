//! The device layer: the xdna backend over the amdxdna driver.
//!
//! * `ioctl` (private): nix-generated `unsafe fn` per request.
//! * [`uapi`]: one safe function per ioctl (BorrowedFd + values → struct).
//! * [`XdnaDevice`], [`Heap`], [`Bo`], [`HwContext`]: RAII types that own the
//!   fd, the 64 MiB device heap, buffer objects and hardware contexts.
//! * [`ert`]: ERT command packet builders.
//!
//! Everything goes through libc (`open`, `ioctl`, `mmap`) so the LD_PRELOAD
//! shim can stand in for the driver.

mod bo;
pub mod ert;
mod hwctx;
mod ioctl;
pub mod uapi;
mod xdna;

pub use bo::{sealed_memfd, Bo, BoKind, SyncDirection};
pub use hwctx::{Completion, HwContext};
pub use xdna::{
    AieMetadata, Clock, DeviceInfo, DeviceMonitor, DriverVersion, Heap, HwContextEntry,
    ResourceInfo, SysfsInfo, XdnaDevice, DEV_BO_ALIGN, HEAP_DEVICE_BASE, HEAP_SIZE,
    MAX_ACCEL_NODES,
};

use std::io;
use std::path::PathBuf;

/// Errno of an `io::Error` (0 when it has none).
pub(crate) fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// Errors of this layer. Each names the device node and, for ioctls, the
/// request and errno.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// No `/dev/accel/accelN` node exists at all.
    #[error("no NPU device node: none of {tried} exists (is the amdxdna module loaded and the firmware present? see `dmesg | grep amdxdna`)")]
    NoNode {
        /// What was looked for.
        tried: String,
    },
    /// The given node path does not exist.
    #[error("{path}: no such device node")]
    NodeMissing {
        /// The node.
        path: PathBuf,
    },
    /// open() failed with EACCES/EPERM.
    #[error("{path}: permission denied opening the NPU node; add your user to the `render` group (or install a udev rule giving accel nodes group render / uaccess) and log in again")]
    PermissionDenied {
        /// The node.
        path: PathBuf,
        /// The open error.
        #[source]
        source: io::Error,
    },
    /// open() failed the way the driver's IOMMU SVA bind fails (`docs/protocol.md` §10, pitfall 1).
    #[error("{path}: open failed with {source}: the amdxdna driver could not bind IOMMU SVA/PASID for this process (IOMMU off, `iommu=pt`, a VM without a PASID-capable vIOMMU, or a kernel older than 6.10; check `dmesg | grep -i sva`)")]
    SvaBind {
        /// The node.
        path: PathBuf,
        /// The open error (ENODEV/EINVAL/ENOSPC/EOPNOTSUPP).
        #[source]
        source: io::Error,
    },
    /// open() failed otherwise.
    #[error("{path}: cannot open: {source}")]
    Open {
        /// The node.
        path: PathBuf,
        /// The open error.
        #[source]
        source: io::Error,
    },
    /// The node belongs to another DRM driver.
    #[error("{path}: not an amdxdna device (DRM driver is {driver:?}, expected \"amdxdna_accel_driver\")")]
    NotAmdxdna {
        /// The node.
        path: PathBuf,
        /// What DRM_IOCTL_VERSION reported.
        driver: String,
    },
    /// An ioctl failed.
    #[error("{path}: {ioctl} failed: {source}{hint}")]
    Ioctl {
        /// The node.
        path: PathBuf,
        /// The request name, e.g. `DRM_IOCTL_AMDXDNA_CREATE_HWCTX`.
        ioctl: &'static str,
        /// The errno.
        #[source]
        source: io::Error,
        /// An explanation for well-known failures (may be empty).
        hint: String,
    },
    /// A feature the running driver does not have.
    #[error("{path}: {what} is not supported by driver {version}")]
    Unsupported {
        /// The node.
        path: PathBuf,
        /// The feature.
        what: &'static str,
        /// The driver version, e.g. `0.0`.
        version: String,
    },
    /// mmap/munmap/memfd failures.
    #[error("{path}: {what}: {source}")]
    Mem {
        /// The node (or `/dev/udmabuf`).
        path: PathBuf,
        /// What was being mapped.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Refused: another context would exceed the firmware's context limit.
    #[error(
        "{path}: hardware context limit reached ({live} live, limit {limit}); drop a context first"
    )]
    ContextLimit {
        /// The node.
        path: PathBuf,
        /// Live contexts (this process, or device-wide when known).
        live: u64,
        /// The limit (QUERY_RESOURCE_INFO npu_task_max, or the per-device default).
        limit: u64,
    },
    /// A command finished in a state other than COMPLETED.
    #[error("{path}: command {command} on hardware context {context} ended in state {state} (seq {seq}); only COMPLETED (4) is success")]
    CommandFailed {
        /// The node.
        path: PathBuf,
        /// The final state.
        state: ert::CmdState,
        /// The hardware context handle.
        context: u32,
        /// The command (kernel name / packet description).
        command: String,
        /// Its sequence number.
        seq: u64,
    },
    /// The wait deadline passed.
    #[error("{path}: command {command} on hardware context {context} did not complete within {timeout_ms} ms (seq {seq})")]
    Timeout {
        /// The node.
        path: PathBuf,
        /// The hardware context handle.
        context: u32,
        /// The command.
        command: String,
        /// Its sequence number.
        seq: u64,
        /// The timeout.
        timeout_ms: u64,
    },
    /// Bad arguments from the caller (sizes, offsets, BO kinds).
    #[error("{0}")]
    Invalid(String),
    /// An ERT packet could not be built.
    #[error(transparent)]
    Ert(#[from] ert::ErtError),
    /// Anything else.
    #[error("{0}")]
    Other(String),
}

/// Result of this layer.
pub type Result<T, E = DeviceError> = std::result::Result<T, E>;
