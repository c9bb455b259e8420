//! `XdnaDevice`: discovery, the open checks, the device heap and the
//! GET_INFO / GET_ARRAY queries.

// Unsafe is this module's job here: it reserves, aligns and maps the device heap with libc mmap.
#![allow(unsafe_code)]

use super::uapi::{self, DrmVersion};
use super::{errno_of, DeviceError, Result};
use crate::ffi;
use serde::Serialize;
use std::ffi::c_void;
use std::fmt;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Size of the device heap created right after open (one 64 MiB chunk is
/// valid on every driver; the firmware's TLB needs 64 MiB alignment).
pub const HEAP_SIZE: usize = 64 << 20;
/// DEV BOs are carved from the heap at this alignment.
pub const DEV_BO_ALIGN: u64 = 32 << 10;
/// `/dev/accel/accel0..63` are probed.
pub const MAX_ACCEL_NODES: u32 = 64;
/// Device address of the first heap chunk (`AIE2_DEVM_BASE`).
pub const HEAP_DEVICE_BASE: u64 = 0x0400_0000;

/// DRM driver version, gating optional ioctls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DriverVersion {
    /// 1 = out-of-tree driver, 0 = mainline/staging.
    pub major: i32,
    /// Feature level.
    pub minor: i32,
    /// Patch level.
    pub patch: i32,
}

impl DriverVersion {
    /// The out-of-tree (legacy) driver.
    pub fn is_oot(&self) -> bool {
        self.major == ffi::AMDXDNA_OOT_DRIVER_MAJOR as i32
    }
    fn at_least(&self, minor: i32) -> bool {
        self.major >= 1 || self.minor >= minor
    }
    /// GET_ARRAY (driver ≥ 0.1 or OOT).
    pub fn has_get_array(&self) -> bool {
        self.at_least(1)
    }
    /// QUERY_RESOURCE_INFO (driver ≥ 0.4 or OOT).
    pub fn has_resource_info(&self) -> bool {
        self.at_least(4)
    }
    /// Completion via WAIT_CMD instead of the syncobj (OOT driver).
    pub fn uses_wait_cmd(&self) -> bool {
        self.is_oot()
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// PCI and firmware facts from `/sys/class/accel/accelN/device/`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SysfsInfo {
    /// Board name, e.g. `RyzenAI-npu4`.
    pub vbnv: Option<String>,
    /// Firmware version string `major.minor.patch.build`.
    pub fw_version: Option<String>,
    /// 0 = KMQ, 1 = UMQ, 2 = PF.
    pub device_type: Option<u32>,
    /// PCI vendor id (0x1022).
    pub vendor: Option<u32>,
    /// PCI device id (0x1502, 0x17f0, ...).
    pub device: Option<u32>,
    /// PCI revision.
    pub revision: Option<u32>,
}

impl SysfsInfo {
    /// Reads the attributes of `node` (e.g. `/dev/accel/accel0`); missing
    /// files are `None`.
    pub fn read(node: &Path) -> Self {
        let Some(name) = node.file_name() else {
            return Self::default();
        };
        let dir = Path::new("/sys/class/accel").join(name).join("device");
        let text = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        let hex = |f: &str| {
            text(f).and_then(|s| u32::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        };
        Self {
            vbnv: text("vbnv"),
            fw_version: text("fw_version"),
            device_type: text("device_type").and_then(|s| s.parse().ok()),
            vendor: hex("vendor"),
            device: hex("device"),
            revision: hex("revision"),
        }
    }
}

/// AIE array geometry (QUERY_AIE_METADATA).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AieMetadata {
    /// Columns in the array.
    pub cols: u32,
    /// Rows in the array.
    pub rows: u32,
    /// Bytes of one column (QUERY_AIE_STATUS granularity).
    pub col_size: u32,
    /// AIE version major.
    pub version_major: u32,
    /// AIE version minor.
    pub version_minor: u32,
    /// Core tile rows (num_tiles = columns × this).
    pub core_rows: u32,
    /// First core row.
    pub core_row_start: u32,
    /// Memory tile rows.
    pub mem_rows: u32,
    /// Shim tile rows.
    pub shim_rows: u32,
}

/// One clock (QUERY_CLOCK_METADATA).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Clock {
    /// Name, e.g. "MP-NPU Clock".
    pub name: String,
    /// Frequency in MHz.
    pub mhz: u32,
}

/// One live hardware context (GET_ARRAY HW_CONTEXT_ALL or legacy query).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HwContextEntry {
    /// Context handle.
    pub context_id: u32,
    /// First column.
    pub start_col: u32,
    /// Number of columns.
    pub num_col: u32,
    /// Owning process.
    pub pid: i64,
    /// Commands submitted.
    pub submissions: u64,
    /// Commands completed.
    pub completions: u64,
    /// Errors.
    pub errors: u64,
    /// Firmware context id, priority and state when GET_ARRAY was used.
    pub hwctx_id: Option<u32>,
    /// Priority (GET_ARRAY only).
    pub priority: Option<u64>,
    /// 0 idle, 1 active (GET_ARRAY only).
    pub state: Option<u32>,
}

/// QUERY_RESOURCE_INFO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ResourceInfo {
    /// Max NPU clock (MHz).
    pub npu_clk_max: u64,
    /// Max TOPS.
    pub npu_tops_max: u64,
    /// Context limit.
    pub npu_task_max: u64,
    /// Current TOPS.
    pub npu_tops_curr: u64,
    /// Live contexts device-wide.
    pub npu_task_curr: u64,
}

/// Everything `xdna info` shows.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    /// Device node.
    pub path: PathBuf,
    /// DRM driver name.
    pub driver: String,
    /// DRM driver description.
    pub driver_desc: String,
    /// DRM driver version.
    pub version: DriverVersion,
    /// sysfs facts.
    pub sysfs: SysfsInfo,
    /// AIE geometry.
    pub aie: AieMetadata,
    /// Firmware version from GET_INFO (`major.minor.patch.build`).
    pub firmware: Option<String>,
    /// Clocks.
    pub clocks: Vec<Clock>,
    /// Power mode (0 default .. 4 turbo).
    pub power_mode: Option<u8>,
    /// Resource info (driver ≥ 0.4).
    pub resources: Option<ResourceInfo>,
    /// Hardware context limit in force.
    pub context_limit: Option<u64>,
    /// Live hardware contexts visible to this user.
    pub contexts: Option<Vec<HwContextEntry>>,
    /// Device heap: device address and CPU address.
    pub heap_device_addr: u64,
}

/// The 64 MiB DEV_HEAP BO, mapped at a 64 MiB-aligned address.
pub struct Heap {
    handle: u32,
    base: *mut u8,
    size: usize,
    xdna_addr: u64,
}

// SAFETY: `base` is a process-wide shared mapping owned by `Heap`; access to
// the bytes goes through `Bo`s that own disjoint DEV ranges.
unsafe impl Send for Heap {}
// SAFETY: as above; `Heap` itself never mutates through `base`.
unsafe impl Sync for Heap {}

impl Heap {
    /// CREATE_BO DEV_HEAP, GET_BO_INFO, then reserve 2 × size PROT_NONE and
    /// MAP_FIXED the heap into the 64 MiB-aligned part of the reservation.
    fn create(fd: BorrowedFd<'_>, path: &Path) -> Result<Heap> {
        let ioerr = |ioctl: &'static str, source: io::Error, hint: &str| DeviceError::Ioctl {
            path: path.to_path_buf(),
            ioctl,
            source,
            hint: hint.to_string(),
        };
        let bo = uapi::create_bo(fd, ffi::AMDXDNA_BO_DEV_HEAP, HEAP_SIZE as u64).map_err(|e| {
            ioerr(
                "DRM_IOCTL_AMDXDNA_CREATE_BO(DEV_HEAP)",
                e,
                " (64 MiB device heap; EBUSY means this file already has one)",
            )
        })?;
        let handle = bo.handle;
        let fail = |e: DeviceError| {
            let _ = uapi::gem_close(fd, handle);
            e
        };
        let info = uapi::get_bo_info(fd, handle)
            .map_err(|e| fail(ioerr("DRM_IOCTL_AMDXDNA_GET_BO_INFO(DEV_HEAP)", e, "")))?;
        if info.map_offset == ffi::AMDXDNA_INVALID_ADDR {
            return Err(fail(DeviceError::Other(format!(
                "{}: the driver gave the device heap no mmap offset",
                path.display()
            ))));
        }
        let base = map_aligned(fd, info.map_offset, HEAP_SIZE).map_err(|source| {
            fail(DeviceError::Mem {
                path: path.to_path_buf(),
                what: "mmap of the 64 MiB device heap at a 64 MiB-aligned address".into(),
                source,
            })
        })?;
        // xdna_addr is meaningful once mapped; fall back to the fixed base.
        let xdna_addr = match uapi::get_bo_info(fd, handle) {
            Ok(i) if i.xdna_addr != ffi::AMDXDNA_INVALID_ADDR => i.xdna_addr,
            _ => HEAP_DEVICE_BASE,
        };
        Ok(Heap {
            handle,
            base,
            size: HEAP_SIZE,
            xdna_addr,
        })
    }

    /// GEM handle of the heap BO.
    pub fn handle(&self) -> u32 {
        self.handle
    }
    /// Device address of heap byte 0.
    pub fn xdna_addr(&self) -> u64 {
        self.xdna_addr
    }
    /// CPU address of heap byte 0 (64 MiB aligned).
    pub fn cpu_addr(&self) -> usize {
        self.base as usize
    }
    /// Heap size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// CPU pointer of the DEV BO at `xdna_addr` spanning `len` bytes, if the
    /// range lies inside the heap.
    pub(crate) fn cpu_ptr(&self, xdna_addr: u64, len: usize) -> Option<*mut u8> {
        let off = xdna_addr.checked_sub(self.xdna_addr)? as usize;
        if off.checked_add(len)? > self.size {
            return None;
        }
        // SAFETY: off + len ≤ size, so the result stays inside the mapping.
        Some(unsafe { self.base.add(off) })
    }

    fn unmap(&mut self) {
        if !self.base.is_null() {
            // SAFETY: `base`/`size` is exactly the mapping made in `create`,
            // and no `Bo` outlives the device (they hold its Arc).
            unsafe { libc::munmap(self.base as *mut c_void, self.size) };
            self.base = std::ptr::null_mut();
        }
    }
}

/// mmap `len` bytes of `fd` at `offset` at a `len`-aligned address (len is a
/// power of two): reserve 2 × len PROT_NONE, MAP_FIXED inside, trim.
fn map_aligned(fd: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<*mut u8> {
    let reserve = 2 * len;
    // SAFETY: anonymous PROT_NONE reservation at a kernel-chosen address.
    let r = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if r == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let start = r as usize;
    let aligned = (start + len - 1) & !(len - 1);
    // SAFETY: [aligned, aligned + len) lies inside our own reservation, so
    // MAP_FIXED replaces only memory we own.
    let m = unsafe {
        libc::mmap(
            aligned as *mut c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if m == libc::MAP_FAILED {
        let e = io::Error::last_os_error();
        // SAFETY: releasing the reservation made above.
        unsafe { libc::munmap(r, reserve) };
        return Err(e);
    }
    let head = aligned - start;
    let tail = start + reserve - (aligned + len);
    // SAFETY: head and tail are the unused parts of our reservation.
    unsafe {
        if head > 0 {
            libc::munmap(start as *mut c_void, head);
        }
        if tail > 0 {
            libc::munmap((aligned + len) as *mut c_void, tail);
        }
    }
    Ok(aligned as *mut u8)
}

/// State shared by the device and everything created from it. Dropped last.
pub(crate) struct Inner {
    pub(crate) path: PathBuf,
    pub(crate) version: DriverVersion,
    pub(crate) heap: Heap,
    pub(crate) core_rows: u32,
    pub(crate) cols: u32,
    pub(crate) context_limit: Option<u64>,
    pub(crate) live_contexts: AtomicU64,
    pub(crate) fd: OwnedFd,
}

impl Inner {
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A DeviceError::Ioctl for this node.
    pub(crate) fn ioctl_err(&self, ioctl: &'static str, source: io::Error) -> DeviceError {
        let hint = match errno_of(&source) {
            libc::ENOTTY => " (the driver does not know this ioctl)".to_string(),
            _ => String::new(),
        };
        DeviceError::Ioctl {
            path: self.path.clone(),
            ioctl,
            source,
            hint,
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.heap.unmap();
        let _ = uapi::gem_close(self.fd.as_fd(), self.heap.handle);
    }
}

/// An open amdxdna device: the fd, its driver version, its heap.
///
/// Created by [`XdnaDevice::open`] / [`XdnaDevice::discover`]; BOs and
/// contexts keep it alive.
#[derive(Clone)]
pub struct XdnaDevice {
    pub(crate) inner: Arc<Inner>,
    drm: DrmVersion,
    sysfs: SysfsInfo,
    aie: AieMetadata,
}

impl fmt::Debug for XdnaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("XdnaDevice")
            .field("path", &self.inner.path)
            .field("version", &self.inner.version)
            .finish_non_exhaustive()
    }
}

/// Whether an errno means "this driver doesn't have that".
pub(crate) fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        errno_of(e),
        libc::EINVAL | libc::EOPNOTSUPP | libc::ENOTTY | libc::ENOSYS
    )
}

impl XdnaDevice {
    /// Candidate nodes, in probe order.
    pub fn candidates() -> Vec<PathBuf> {
        (0..MAX_ACCEL_NODES)
            .map(|n| PathBuf::from(format!("/dev/accel/accel{n}")))
            .collect()
    }

    /// `$XDNA_DEVICE` if set, else the first of `/dev/accel/accel0..63` that
    /// opens as amdxdna. The error of the first existing node is returned
    /// when none opens; [`DeviceError::NoNode`] when none exists.
    pub fn discover() -> Result<XdnaDevice> {
        if let Some(p) = std::env::var_os("XDNA_DEVICE").filter(|p| !p.is_empty()) {
            return Self::open(PathBuf::from(p));
        }
        let mut first_err = None;
        for path in Self::candidates() {
            match std::fs::metadata(&path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                _ => {}
            }
            match Self::open(&path) {
                Ok(d) => return Ok(d),
                Err(e) => {
                    tracing::debug!("{}: {e}", path.display());
                    if first_err.is_none() {
                        first_err = Some(e);
                    }
                }
            }
        }
        Err(first_err.unwrap_or(DeviceError::NoNode {
            tried: format!("/dev/accel/accel0..{}", MAX_ACCEL_NODES - 1),
        }))
    }

    /// Opens `path`, checks it is amdxdna, creates and maps the device heap,
    /// and reads geometry and the context limit.
    pub fn open(path: impl AsRef<Path>) -> Result<XdnaDevice> {
        let path = path.as_ref().to_path_buf();
        let (fd, drm, version) = open_amdxdna(&path)?;
        let sysfs = SysfsInfo::read(&path);

        // The heap comes first: contexts and DEV BOs need it mapped.
        let mut heap = Heap::create(fd.as_fd(), &path)?;

        let meta: ffi::amdxdna_drm_query_aie_metadata =
            match uapi::get_info(fd.as_fd(), ffi::DRM_AMDXDNA_QUERY_AIE_METADATA) {
                Ok(meta) => meta,
                Err(source) => {
                    // Nothing owns the heap yet: release it here, not at fd close.
                    heap.unmap();
                    let _ = uapi::gem_close(fd.as_fd(), heap.handle);
                    return Err(DeviceError::Ioctl {
                        path: path.clone(),
                        ioctl: "DRM_IOCTL_AMDXDNA_GET_INFO(QUERY_AIE_METADATA)",
                        source,
                        hint: String::new(),
                    });
                }
            };
        let aie = AieMetadata {
            cols: meta.cols.into(),
            rows: meta.rows.into(),
            col_size: meta.col_size,
            version_major: meta.version.major,
            version_minor: meta.version.minor,
            core_rows: meta.core.row_count.into(),
            core_row_start: meta.core.row_start.into(),
            mem_rows: meta.mem.row_count.into(),
            shim_rows: meta.shim.row_count.into(),
        };

        let context_limit = if version.has_resource_info() {
            match uapi::get_info::<ffi::amdxdna_drm_get_resource_info>(
                fd.as_fd(),
                ffi::DRM_AMDXDNA_QUERY_RESOURCE_INFO,
            ) {
                Ok(r) if r.npu_task_max > 0 => Some(r.npu_task_max),
                _ => default_context_limit(&sysfs),
            }
        } else {
            default_context_limit(&sysfs)
        };

        let inner = Arc::new(Inner {
            path,
            version,
            heap,
            core_rows: aie.core_rows,
            cols: aie.cols,
            context_limit,
            live_contexts: AtomicU64::new(0),
            fd,
        });
        Ok(XdnaDevice {
            inner,
            drm,
            sysfs,
            aie,
        })
    }

    /// The device node.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }
    /// The device fd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inner.fd()
    }
    /// DRM driver version.
    pub fn version(&self) -> DriverVersion {
        self.inner.version
    }
    /// DRM driver name/date/description.
    pub fn drm_version(&self) -> &DrmVersion {
        &self.drm
    }
    /// sysfs facts read at open.
    pub fn sysfs(&self) -> &SysfsInfo {
        &self.sysfs
    }
    /// AIE geometry.
    pub fn aie(&self) -> AieMetadata {
        self.aie
    }
    /// The device heap.
    pub fn heap(&self) -> &Heap {
        &self.inner.heap
    }
    /// The context limit in force (queried, or the per-device default).
    pub fn context_limit(&self) -> Option<u64> {
        self.inner.context_limit
    }
    /// Contexts this process currently holds on this device.
    pub fn live_contexts(&self) -> u64 {
        self.inner.live_contexts.load(Ordering::Relaxed)
    }

    fn optional<T>(&self, r: io::Result<T>, ioctl: &'static str) -> Result<Option<T>> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e) if is_unsupported(&e) => Ok(None),
            Err(e) => Err(self.inner.ioctl_err(ioctl, e)),
        }
    }

    /// QUERY_AIE_VERSION.
    pub fn aie_version(&self) -> Result<(u32, u32)> {
        let v: ffi::amdxdna_drm_query_aie_version =
            uapi::get_info(self.fd(), ffi::DRM_AMDXDNA_QUERY_AIE_VERSION).map_err(|e| {
                self.inner
                    .ioctl_err("DRM_IOCTL_AMDXDNA_GET_INFO(QUERY_AIE_VERSION)", e)
            })?;
        Ok((v.major, v.minor))
    }

    /// QUERY_FIRMWARE_VERSION as `major.minor.patch.build`; None if unsupported.
    pub fn firmware_version(&self) -> Result<Option<String>> {
        let r = uapi::get_info::<ffi::amdxdna_drm_query_firmware_version>(
            self.fd(),
            ffi::DRM_AMDXDNA_QUERY_FIRMWARE_VERSION,
        );
        Ok(self
            .optional(r, "DRM_IOCTL_AMDXDNA_GET_INFO(QUERY_FIRMWARE_VERSION)")?
            .map(|v| format!("{}.{}.{}.{}", v.major, v.minor, v.patch, v.build)))
    }

    /// QUERY_CLOCK_METADATA; empty if unsupported.
    pub fn clocks(&self) -> Result<Vec<Clock>> {
        let r = uapi::get_info::<ffi::amdxdna_drm_query_clock_metadata>(
            self.fd(),
            ffi::DRM_AMDXDNA_QUERY_CLOCK_METADATA,
        );
        let Some(c) = self.optional(r, "DRM_IOCTL_AMDXDNA_GET_INFO(QUERY_CLOCK_METADATA)")? else {
            return Ok(Vec::new());
        };
        let name = |b: &[u8; 16]| {
            let s = b.split(|x| *x == 0).next().unwrap_or(&[]);
            String::from_utf8_lossy(s).into_owned()
        };
        Ok(vec![
            Clock {
                name: name(&c.mp_npu_clock.name),
                mhz: c.mp_npu_clock.freq_mhz,
            },
            Clock {
                name: name(&c.h_clock.name),
                mhz: c.h_clock.freq_mhz,
            },
        ])
    }

    /// GET_POWER_MODE; None if unsupported.
    pub fn power_mode(&self) -> Result<Option<u8>> {
        let r = uapi::get_info::<ffi::amdxdna_drm_get_power_mode>(
            self.fd(),
            ffi::DRM_AMDXDNA_GET_POWER_MODE,
        );
        Ok(self
            .optional(r, "DRM_IOCTL_AMDXDNA_GET_INFO(GET_POWER_MODE)")?
            .map(|p| p.power_mode))
    }

    /// QUERY_RESOURCE_INFO (driver ≥ 0.4); None if unsupported.
    pub fn resource_info(&self) -> Result<Option<ResourceInfo>> {
        if !self.version().has_resource_info() {
            return Ok(None);
        }
        let r = uapi::get_info::<ffi::amdxdna_drm_get_resource_info>(
            self.fd(),
            ffi::DRM_AMDXDNA_QUERY_RESOURCE_INFO,
        );
        Ok(self
            .optional(r, "DRM_IOCTL_AMDXDNA_GET_INFO(QUERY_RESOURCE_INFO)")?
            .map(|r| ResourceInfo {
                npu_clk_max: r.npu_clk_max,
                npu_tops_max: r.npu_tops_max,
                npu_task_max: r.npu_task_max,
                npu_tops_curr: r.npu_tops_curr,
                npu_task_curr: r.npu_task_curr,
            }))
    }

    /// Live hardware contexts: GET_ARRAY HW_CONTEXT_ALL when the driver has
    /// it, else the legacy QUERY_HW_CONTEXTS; None if neither works.
    pub fn hw_contexts(&self) -> Result<Option<Vec<HwContextEntry>>> {
        query_hw_contexts(self.fd(), self.version(), self.path())
    }

    /// Everything `xdna info` prints.
    pub fn info(&self) -> Result<DeviceInfo> {
        Ok(DeviceInfo {
            path: self.path().to_path_buf(),
            driver: self.drm.name.clone(),
            driver_desc: self.drm.desc.clone(),
            version: self.version(),
            sysfs: self.sysfs.clone(),
            aie: self.aie,
            firmware: self.firmware_version()?,
            clocks: self.clocks()?,
            power_mode: self.power_mode()?,
            resources: self.resource_info()?,
            context_limit: self.context_limit(),
            contexts: self.hw_contexts()?,
            heap_device_addr: self.heap().xdna_addr(),
        })
    }

    /// SET_STATE SET_POWER_MODE (root only; EACCES otherwise).
    pub fn set_power_mode(&self, mode: u8) -> Result<()> {
        if mode > ffi::POWER_MODE_TURBO as u8 {
            return Err(DeviceError::Invalid(format!(
                "power mode {mode} is out of range 0..=4"
            )));
        }
        uapi::set_power_mode(self.fd(), mode).map_err(|e| {
            let mut err = self
                .inner
                .ioctl_err("DRM_IOCTL_AMDXDNA_SET_STATE(SET_POWER_MODE)", e);
            if let DeviceError::Ioctl { source, hint, .. } = &mut err {
                if errno_of(source) == libc::EACCES {
                    *hint = " (SET_STATE is root-only)".into();
                }
            }
            err
        })
    }
}

/// Firmware context limits by PCI device when the driver can't tell us:
/// 6 on NPU1 (0x1502), 16 on NPU4/5/6 (0x17f0).
fn default_context_limit(sysfs: &SysfsInfo) -> Option<u64> {
    match sysfs.device {
        Some(0x1502) => Some(6),
        Some(0x17f0) => Some(16),
        _ => None,
    }
}

/// Live hardware contexts of the device behind `fd`: GET_ARRAY HW_CONTEXT_ALL
/// when the driver has it, else the legacy QUERY_HW_CONTEXTS; None if neither works.
fn query_hw_contexts(
    fd: BorrowedFd<'_>,
    version: DriverVersion,
    path: &Path,
) -> Result<Option<Vec<HwContextEntry>>> {
    let ioctl_err = |ioctl: &'static str, source: io::Error| DeviceError::Ioctl {
        path: path.to_path_buf(),
        ioctl,
        source,
        hint: String::new(),
    };
    if version.has_get_array() {
        let r = uapi::get_array::<ffi::amdxdna_drm_hwctx_entry>(
            fd,
            ffi::DRM_AMDXDNA_HW_CONTEXT_ALL,
            256,
        );
        match r {
            Ok((v, _)) => {
                return Ok(Some(
                    v.iter()
                        .map(|e| HwContextEntry {
                            context_id: e.context_id,
                            start_col: e.start_col,
                            num_col: e.num_col,
                            pid: e.pid,
                            submissions: e.command_submissions,
                            completions: e.command_completions,
                            errors: e.errors,
                            hwctx_id: Some(e.hwctx_id),
                            priority: Some(e.priority),
                            state: Some(e.state),
                        })
                        .collect(),
                ))
            }
            Err(e) if is_unsupported(&e) => {}
            Err(e) => return Err(ioctl_err("DRM_IOCTL_AMDXDNA_GET_ARRAY(HW_CONTEXT_ALL)", e)),
        }
    }
    let r = uapi::get_info_array::<ffi::amdxdna_drm_query_hwctx>(
        fd,
        ffi::DRM_AMDXDNA_QUERY_HW_CONTEXTS,
        64,
    );
    let r = match r {
        Ok(v) => Some(v),
        Err(e) if is_unsupported(&e) => None,
        Err(e) => {
            return Err(ioctl_err(
                "DRM_IOCTL_AMDXDNA_GET_INFO(QUERY_HW_CONTEXTS)",
                e,
            ))
        }
    };
    Ok(r.map(|v| {
        // Drivers differ in how they report the filled size; unused
        // slots stay zeroed (context ids start at 1).
        v.iter()
            .filter(|e| e.context_id != 0)
            .map(|e| HwContextEntry {
                context_id: e.context_id,
                start_col: e.start_col,
                num_col: e.num_col,
                pid: e.pid,
                submissions: e.command_submissions,
                completions: e.command_completions,
                errors: e.errors,
                hwctx_id: None,
                priority: None,
                state: None,
            })
            .collect()
    }))
}

/// A query-only handle on an amdxdna node: checks the driver and reads
/// counters, but creates no heap, context or BO (cheap enough to poll, and it
/// takes no device memory from the run it watches — `npu-hold` uses it).
pub struct DeviceMonitor {
    path: PathBuf,
    fd: OwnedFd,
    version: DriverVersion,
}

impl DeviceMonitor {
    /// Opens `path` and checks `DRM_IOCTL_VERSION` names amdxdna.
    pub fn open(path: impl AsRef<Path>) -> Result<DeviceMonitor> {
        let path = path.as_ref().to_path_buf();
        let (fd, _, version) = open_amdxdna(&path)?;
        Ok(DeviceMonitor { path, fd, version })
    }

    /// Live hardware contexts with their error counts (see [`XdnaDevice::hw_contexts`]).
    pub fn hw_contexts(&self) -> Result<Option<Vec<HwContextEntry>>> {
        query_hw_contexts(self.fd.as_fd(), self.version, &self.path)
    }
}

/// Opens `path` and checks that `DRM_IOCTL_VERSION` names amdxdna: the first
/// two steps of every open, shared by [`XdnaDevice`] and [`DeviceMonitor`].
fn open_amdxdna(path: &Path) -> Result<(OwnedFd, DrmVersion, DriverVersion)> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| classify_open_error(path, source))?;
    let fd: OwnedFd = file.into();
    let drm = uapi::drm_version(fd.as_fd()).map_err(|source| {
        if errno_of(&source) == libc::ENOTTY || errno_of(&source) == libc::EINVAL {
            DeviceError::NotAmdxdna {
                path: path.to_path_buf(),
                driver: "(not a DRM device)".into(),
            }
        } else {
            DeviceError::Ioctl {
                path: path.to_path_buf(),
                ioctl: "DRM_IOCTL_VERSION",
                source,
                hint: String::new(),
            }
        }
    })?;
    if drm.name != ffi::AMDXDNA_DRIVER_NAME_STR {
        return Err(DeviceError::NotAmdxdna {
            path: path.to_path_buf(),
            driver: drm.name,
        });
    }
    let version = DriverVersion {
        major: drm.major,
        minor: drm.minor,
        patch: drm.patch,
    };
    Ok((fd, drm, version))
}

/// Maps an open() failure to the check that failed.
fn classify_open_error(path: &Path, source: io::Error) -> DeviceError {
    let path = path.to_path_buf();
    match errno_of(&source) {
        libc::ENOENT => DeviceError::NodeMissing { path },
        libc::EACCES | libc::EPERM => DeviceError::PermissionDenied { path, source },
        libc::ENODEV | libc::EINVAL | libc::ENOSPC | libc::EOPNOTSUPP => {
            DeviceError::SvaBind { path, source }
        }
        _ => DeviceError::Open { path, source },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_gates() {
        let v = |major, minor| DriverVersion {
            major,
            minor,
            patch: 0,
        };
        assert!(!v(0, 0).has_get_array());
        assert!(v(0, 1).has_get_array());
        assert!(!v(0, 3).has_resource_info());
        assert!(v(0, 4).has_resource_info());
        assert!(v(1, 0).has_resource_info() && v(1, 0).has_get_array());
        assert!(v(1, 0).uses_wait_cmd() && !v(0, 16).uses_wait_cmd());
    }

    #[test]
    fn open_errors_name_the_check() {
        let p = Path::new("/dev/accel/accel9");
        let e = |n| classify_open_error(p, io::Error::from_raw_os_error(n));
        assert!(matches!(e(libc::ENOENT), DeviceError::NodeMissing { .. }));
        assert!(matches!(
            e(libc::EACCES),
            DeviceError::PermissionDenied { .. }
        ));
        assert!(e(libc::EACCES).to_string().contains("render"));
        for n in [libc::ENODEV, libc::EINVAL, libc::ENOSPC, libc::EOPNOTSUPP] {
            assert!(matches!(e(n), DeviceError::SvaBind { .. }));
        }
        assert!(e(libc::ENODEV).to_string().contains("accel9"));
        assert!(matches!(e(libc::EIO), DeviceError::Open { .. }));
    }

    #[test]
    fn missing_node() {
        let r = XdnaDevice::open("/nonexistent/accel/accel0");
        assert!(matches!(r, Err(DeviceError::NodeMissing { .. })));
    }
}
