//! Buffer objects: SHARE (host buffers), DEV (carved from the heap), CMD
//! (ERT packets), and imported dma-bufs. GEM_CLOSE on drop.

// Unsafe is this module's job: it maps buffer objects and hands out slices of the mappings.
#![allow(unsafe_code)]

use super::xdna::{Inner, XdnaDevice};
use super::{uapi, DeviceError, Result};
use crate::ffi;
use memmap2::{MmapMut, MmapOptions};
use std::fmt;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

/// What a BO is, which decides how the CPU reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoKind {
    /// Host buffer (type SHARE/SHMEM), mmapped through the accel fd.
    Share,
    /// Device-memory BO inside the heap (type DEV), reached through the heap
    /// mapping; the only kind CONFIG_CU accepts; not exportable.
    Dev,
    /// ERT command buffer (type CMD), mmapped.
    Cmd,
    /// A dma-buf imported with PRIME, mmapped through the accel fd.
    Imported,
}

impl BoKind {
    fn uapi_type(self) -> u32 {
        match self {
            BoKind::Share | BoKind::Imported => ffi::AMDXDNA_BO_SHARE,
            BoKind::Dev => ffi::AMDXDNA_BO_DEV,
            BoKind::Cmd => ffi::AMDXDNA_BO_CMD,
        }
    }
}

/// Direction of a cache flush (the NPU is not coherent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncDirection {
    /// After CPU writes, before the device reads.
    ToDevice,
    /// After the device wrote, before the CPU reads.
    FromDevice,
}

enum Mapping {
    /// SHARE/CMD/imported: our own mmap at map_offset.
    Own(MmapMut),
    /// DEV: `len` bytes of the heap mapping at `ptr`.
    Heap(*mut u8),
}

/// A buffer object with its CPU mapping and device address.
pub struct Bo {
    dev: Arc<Inner>,
    handle: u32,
    kind: BoKind,
    size: usize,
    xdna_addr: u64,
    map: Option<Mapping>,
}

// SAFETY: the heap pointer refers to a range owned by this BO alone, inside
// a mapping kept alive by `dev`; MmapMut is Send + Sync.
unsafe impl Send for Bo {}
// SAFETY: shared access only reads; writes need `&mut Bo`.
unsafe impl Sync for Bo {}

impl fmt::Debug for Bo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bo")
            .field("handle", &self.handle)
            .field("kind", &self.kind)
            .field("size", &self.size)
            .field("xdna_addr", &format_args!("{:#x}", self.xdna_addr))
            .finish()
    }
}

fn map_fd(fd: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<MmapMut> {
    // SAFETY: a shared mapping of a GEM object through the accel fd; the
    // memory is only accessed through the returned MmapMut, which the `Bo`
    // owns and drops before GEM_CLOSE.
    unsafe {
        MmapOptions::new()
            .offset(offset)
            .len(len)
            .map_mut(fd.as_raw_fd())
    }
}

impl Bo {
    /// CREATE_BO of `kind` with `size` bytes, then map it: DEV through the
    /// heap, others with mmap at map_offset (whose VA becomes the device
    /// address in PASID mode; GET_BO_INFO is read again after mapping).
    pub fn new(dev: &XdnaDevice, kind: BoKind, size: usize) -> Result<Bo> {
        Self::new_from_inner(&dev.inner, kind, size)
    }

    /// A BO of `kind` holding a copy of `data` (flushed to the device).
    pub fn with_data(dev: &XdnaDevice, kind: BoKind, data: &[u8]) -> Result<Bo> {
        let mut bo = Self::new(dev, kind, data.len())?;
        bo.write(0, data)?;
        bo.sync(SyncDirection::ToDevice)?;
        Ok(bo)
    }

    pub(crate) fn new_from_inner(inner: &Arc<Inner>, kind: BoKind, size: usize) -> Result<Bo> {
        let inner = inner.clone();
        if size == 0 {
            return Err(DeviceError::Invalid("a BO needs a non-zero size".into()));
        }
        if kind == BoKind::Imported {
            return Err(DeviceError::Invalid(
                "imported BOs come from XdnaDevice::import_dmabuf".into(),
            ));
        }
        let created = uapi::create_bo(inner.fd(), kind.uapi_type(), size as u64)
            .map_err(|e| inner.ioctl_err("DRM_IOCTL_AMDXDNA_CREATE_BO", e))?;
        let mut bo = Bo {
            dev: inner,
            handle: created.handle,
            kind,
            size,
            xdna_addr: ffi::AMDXDNA_INVALID_ADDR,
            map: None,
        };
        bo.map_and_locate()?;
        Ok(bo)
    }

    /// Wraps an imported handle of `size` bytes and maps it.
    pub(crate) fn from_import(inner: Arc<Inner>, handle: u32, size: usize) -> Result<Bo> {
        let mut bo = Bo {
            dev: inner,
            handle,
            kind: BoKind::Imported,
            size,
            xdna_addr: ffi::AMDXDNA_INVALID_ADDR,
            map: None,
        };
        bo.map_and_locate()?;
        Ok(bo)
    }

    fn map_and_locate(&mut self) -> Result<()> {
        let info = uapi::get_bo_info(self.dev.fd(), self.handle)
            .map_err(|e| self.dev.ioctl_err("DRM_IOCTL_AMDXDNA_GET_BO_INFO", e))?;
        if self.kind == BoKind::Dev {
            let ptr = self.dev.heap.cpu_ptr(info.xdna_addr, self.size).ok_or_else(|| {
                DeviceError::Other(format!(
                    "{}: DEV BO {} at device address {:#x} (+{} bytes) lies outside the heap at {:#x}",
                    self.dev.path.display(),
                    self.handle,
                    info.xdna_addr,
                    self.size,
                    self.dev.heap.xdna_addr()
                ))
            })?;
            self.xdna_addr = info.xdna_addr;
            self.map = Some(Mapping::Heap(ptr));
            return Ok(());
        }
        if info.map_offset == ffi::AMDXDNA_INVALID_ADDR {
            return Err(DeviceError::Other(format!(
                "{}: BO {} has no mmap offset",
                self.dev.path.display(),
                self.handle
            )));
        }
        let m = map_fd(self.dev.fd(), info.map_offset, self.size).map_err(|source| {
            DeviceError::Mem {
                path: self.dev.path.clone(),
                what: format!("mmap of BO {} ({} bytes)", self.handle, self.size),
                source,
            }
        })?;
        let va = m.as_ptr() as u64;
        self.map = Some(Mapping::Own(m));
        self.xdna_addr = match uapi::get_bo_info(self.dev.fd(), self.handle) {
            Ok(i) if i.xdna_addr != ffi::AMDXDNA_INVALID_ADDR && i.xdna_addr != 0 => i.xdna_addr,
            // 6.14 leaves SHMEM dev_addr invalid: the mmap VA is the address.
            _ => va,
        };
        Ok(())
    }

    /// GEM handle.
    pub fn handle(&self) -> u32 {
        self.handle
    }
    /// Kind.
    pub fn kind(&self) -> BoKind {
        self.kind
    }
    /// Size in bytes (as requested).
    pub fn size(&self) -> usize {
        self.size
    }
    /// Address the device uses (regmap, ERT payloads).
    pub fn xdna_addr(&self) -> u64 {
        self.xdna_addr
    }

    fn ptr(&self) -> *mut u8 {
        match &self.map {
            Some(Mapping::Own(m)) => m.as_ptr() as *mut u8,
            Some(Mapping::Heap(p)) => *p,
            None => std::ptr::null_mut(),
        }
    }

    /// The BO's bytes.
    pub fn as_slice(&self) -> &[u8] {
        let p = self.ptr();
        if p.is_null() {
            return &[];
        }
        // SAFETY: `p` maps `size` bytes that live as long as `self`.
        unsafe { std::slice::from_raw_parts(p, self.size) }
    }

    /// The BO's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let p = self.ptr();
        if p.is_null() {
            return &mut [];
        }
        // SAFETY: `p` maps `size` writable bytes owned by this BO; `&mut self`
        // makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(p, self.size) }
    }

    /// Copies `data` to `offset`.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        let size = self.size;
        let end = offset
            .checked_add(data.len())
            .filter(|&e| e <= size)
            .ok_or_else(|| {
                DeviceError::Invalid(format!(
                    "write of {} bytes at {offset} overruns BO {} of {size} bytes",
                    data.len(),
                    self.handle
                ))
            })?;
        self.as_mut_slice()[offset..end].copy_from_slice(data);
        Ok(())
    }

    /// Copies `out.len()` bytes from `offset`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let end = offset
            .checked_add(out.len())
            .filter(|&e| e <= self.size)
            .ok_or_else(|| {
                DeviceError::Invalid(format!(
                    "read of {} bytes at {offset} overruns BO {} of {} bytes",
                    out.len(),
                    self.handle,
                    self.size
                ))
            })?;
        out.copy_from_slice(&self.as_slice()[offset..end]);
        Ok(())
    }

    /// SYNC_BO over the whole BO.
    pub fn sync(&self, dir: SyncDirection) -> Result<()> {
        self.sync_range(dir, 0, self.size)
    }

    /// SYNC_BO over `[offset, offset + len)`.
    pub fn sync_range(&self, dir: SyncDirection, offset: usize, len: usize) -> Result<()> {
        let d = match dir {
            SyncDirection::ToDevice => ffi::SYNC_DIRECT_TO_DEVICE,
            SyncDirection::FromDevice => ffi::SYNC_DIRECT_FROM_DEVICE,
        };
        uapi::sync_bo(self.dev.fd(), self.handle, d, offset as u64, len as u64)
            .map_err(|e| self.dev.ioctl_err("DRM_IOCTL_AMDXDNA_SYNC_BO", e))?;
        Ok(())
    }

    /// PRIME export as a dma-buf fd (not for DEV BOs).
    pub fn export(&self) -> Result<OwnedFd> {
        if self.kind == BoKind::Dev {
            return Err(DeviceError::Invalid(format!(
                "BO {} is a DEV BO; the driver does not export DEV BOs",
                self.handle
            )));
        }
        uapi::prime_handle_to_fd(self.dev.fd(), self.handle)
            .map_err(|e| self.dev.ioctl_err("DRM_IOCTL_PRIME_HANDLE_TO_FD", e))
    }
}

impl Drop for Bo {
    fn drop(&mut self) {
        // Unmap first: the device address is tied to the mapping.
        self.map = None;
        if let Err(e) = uapi::gem_close(self.dev.fd(), self.handle) {
            tracing::warn!(
                "{}: GEM_CLOSE of BO {}: {e}",
                self.dev.path.display(),
                self.handle
            );
        }
    }
}

/// A memfd of `size` bytes sealed against shrinking (F_SEAL_SHRINK) but not
/// against writes, as udmabuf requires.
pub fn sealed_memfd(name: &str, size: usize) -> Result<OwnedFd> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
    let mem = |what: &str, e: nix::Error| DeviceError::Mem {
        path: PathBuf::from("memfd"),
        what: format!("{what} ({name})"),
        source: io::Error::from_raw_os_error(e as i32),
    };
    let cname = std::ffi::CString::new(name)
        .map_err(|_| DeviceError::Invalid(format!("memfd name {name:?} contains NUL")))?;
    let fd = memfd_create(
        &cname,
        MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
    )
    .map_err(|e| mem("memfd_create", e))?;
    nix::unistd::ftruncate(&fd, size as libc::off_t).map_err(|e| mem("ftruncate", e))?;
    fcntl(
        fd.as_raw_fd(),
        FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK),
    )
    .map_err(|e| mem("F_ADD_SEALS F_SEAL_SHRINK", e))?;
    Ok(fd)
}

impl XdnaDevice {
    /// PRIME import of a dma-buf of `size` bytes as a BO (mapped; its device
    /// address is the mapping's VA in PASID mode).
    pub fn import_dmabuf(&self, dmabuf: BorrowedFd<'_>, size: usize) -> Result<Bo> {
        let handle = uapi::prime_fd_to_handle(self.fd(), dmabuf).map_err(|e| {
            let mut err = self.inner.ioctl_err("DRM_IOCTL_PRIME_FD_TO_HANDLE", e);
            if let DeviceError::Ioctl { hint, .. } = &mut err {
                hint.push_str(" (dma-buf import needs a 6.16-era amdxdna driver)");
            }
            err
        })?;
        Bo::from_import(self.inner.clone(), handle, size)
    }

    /// `[offset, offset + size)` of a memfd sealed with F_SEAL_SHRINK (see
    /// [`sealed_memfd`]) → `/dev/udmabuf` → PRIME import. Offset and size
    /// must be page aligned; udmabuf limits a buffer to 64 MiB by default.
    pub fn import_memfd(&self, memfd: BorrowedFd<'_>, offset: u64, size: usize) -> Result<Bo> {
        let page = 4096u64;
        if !offset.is_multiple_of(page) || !(size as u64).is_multiple_of(page) || size == 0 {
            return Err(DeviceError::Invalid(format!(
                "udmabuf range offset {offset} size {size} must be non-empty and page aligned"
            )));
        }
        let udev_path = PathBuf::from("/dev/udmabuf");
        let udev = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&udev_path)
            .map_err(|source| DeviceError::Mem {
                path: udev_path.clone(),
                what: "open (is the udmabuf module loaded?)".into(),
                source,
            })?;
        let buf = uapi::udmabuf_create(udev.as_fd(), memfd, offset, size as u64).map_err(
            |source| DeviceError::Ioctl {
                path: udev_path.clone(),
                ioctl: "UDMABUF_CREATE",
                source,
                hint: " (memfd must be shmem, sealed F_SEAL_SHRINK, not F_SEAL_WRITE; size ≤ size_limit_mb)"
                    .into(),
            },
        )?;
        self.import_dmabuf(buf.as_fd(), size)
    }
}
