//! One safe function per ioctl, in the drm-ffi shape: a borrowed fd and plain
//! values in, the filled UAPI struct (or `io::Result`) out. `unsafe` is one
//! line per function; the pointers it passes come from live Rust values.
//!
//! Interrupted calls (EINTR) are retried here; waits additionally retry
//! EAGAIN in `hwctx`, with their absolute deadline unchanged.

// Unsafe is this module's job: every call here issues a raw ioctl on caller-built argument structs.
#![allow(unsafe_code)]

use super::ioctl;
use crate::ffi::*;
use core::mem::size_of;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Runs `f` until it does not fail with EINTR; maps nix errors to io::Error.
fn retry_eintr(mut f: impl FnMut() -> nix::Result<i32>) -> io::Result<i32> {
    loop {
        match f() {
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(io::Error::from_raw_os_error(e as i32)),
            Ok(r) => return Ok(r),
        }
    }
}

/// Strings and version of the DRM driver behind `fd` (DRM_IOCTL_VERSION).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrmVersion {
    /// `version_major` (1 = amdxdna out-of-tree driver).
    pub major: i32,
    /// `version_minor` (feature level).
    pub minor: i32,
    /// `version_patchlevel`.
    pub patch: i32,
    /// Driver name, e.g. `amdxdna_accel_driver`.
    pub name: String,
    /// Driver date string.
    pub date: String,
    /// Driver description.
    pub desc: String,
}

/// DRM_IOCTL_VERSION, both passes (lengths, then strings).
pub fn drm_version(fd: BorrowedFd<'_>) -> io::Result<DrmVersion> {
    let mut v = drm_version::default();
    // SAFETY: `v` is a valid drm_version; with zero lengths the kernel writes
    // no strings, only the lengths and version numbers.
    retry_eintr(|| unsafe { ioctl::drm_version_raw(fd.as_raw_fd(), &mut v) })?;
    // Cap lengths so a hostile driver cannot make us allocate gigabytes.
    let cap = |n: u64| n.min(4096) as usize;
    let mut name = vec![0u8; cap(v.name_len)];
    let mut date = vec![0u8; cap(v.date_len)];
    let mut desc = vec![0u8; cap(v.desc_len)];
    let mut v2 = drm_version {
        name_len: name.len() as u64,
        name: name.as_mut_ptr() as u64,
        date_len: date.len() as u64,
        date: date.as_mut_ptr() as u64,
        desc_len: desc.len() as u64,
        desc: desc.as_mut_ptr() as u64,
        ..Default::default()
    };
    // SAFETY: each string pointer points to a live Vec of exactly the length
    // announced next to it; the kernel writes at most that many bytes.
    retry_eintr(|| unsafe { ioctl::drm_version_raw(fd.as_raw_fd(), &mut v2) })?;
    let text = |buf: &[u8], n: u64| {
        let n = (n as usize).min(buf.len());
        let s = &buf[..n];
        let s = s.split(|b| *b == 0).next().unwrap_or(&[]);
        String::from_utf8_lossy(s).into_owned()
    };
    Ok(DrmVersion {
        major: v2.version_major,
        minor: v2.version_minor,
        patch: v2.version_patchlevel,
        name: text(&name, v2.name_len),
        date: text(&date, v2.date_len),
        desc: text(&desc, v2.desc_len),
    })
}

/// DRM_IOCTL_GEM_CLOSE.
pub fn gem_close(fd: BorrowedFd<'_>, handle: u32) -> io::Result<drm_gem_close> {
    let arg = drm_gem_close {
        handle,
        ..Default::default()
    };
    // SAFETY: `arg` is a valid drm_gem_close read by the kernel.
    retry_eintr(|| unsafe { ioctl::gem_close(fd.as_raw_fd(), &arg) })?;
    Ok(arg)
}

/// DRM_IOCTL_GET_CAP.
pub fn get_cap(fd: BorrowedFd<'_>, capability: u64) -> io::Result<drm_get_cap> {
    let mut arg = drm_get_cap {
        capability,
        ..Default::default()
    };
    // SAFETY: `arg` is a valid drm_get_cap.
    retry_eintr(|| unsafe { ioctl::get_cap(fd.as_raw_fd(), &mut arg) })?;
    Ok(arg)
}

/// DRM_IOCTL_PRIME_HANDLE_TO_FD with DRM_RDWR | DRM_CLOEXEC.
pub fn prime_handle_to_fd(fd: BorrowedFd<'_>, handle: u32) -> io::Result<OwnedFd> {
    let mut arg = drm_prime_handle {
        handle,
        flags: DRM_RDWR | DRM_CLOEXEC,
        fd: -1,
    };
    // SAFETY: `arg` is a valid drm_prime_handle.
    retry_eintr(|| unsafe { ioctl::prime_handle_to_fd(fd.as_raw_fd(), &mut arg) })?;
    owned(arg.fd)
}

/// DRM_IOCTL_PRIME_FD_TO_HANDLE: returns the new BO handle.
pub fn prime_fd_to_handle(fd: BorrowedFd<'_>, dmabuf: BorrowedFd<'_>) -> io::Result<u32> {
    let mut arg = drm_prime_handle {
        fd: dmabuf.as_raw_fd(),
        ..Default::default()
    };
    // SAFETY: `arg` is a valid drm_prime_handle.
    retry_eintr(|| unsafe { ioctl::prime_fd_to_handle(fd.as_raw_fd(), &mut arg) })?;
    Ok(arg.handle)
}

/// DRM_IOCTL_SYNCOBJ_DESTROY.
pub fn syncobj_destroy(fd: BorrowedFd<'_>, handle: u32) -> io::Result<drm_syncobj_destroy> {
    let mut arg = drm_syncobj_destroy {
        handle,
        ..Default::default()
    };
    // SAFETY: `arg` is a valid drm_syncobj_destroy.
    retry_eintr(|| unsafe { ioctl::syncobj_destroy(fd.as_raw_fd(), &mut arg) })?;
    Ok(arg)
}

/// One DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT attempt on a single (handle, point),
/// deadline `abs_timeout_ns` on CLOCK_MONOTONIC. Not retried: the caller
/// decides about EINTR/EAGAIN/ETIME.
pub fn syncobj_timeline_wait(
    fd: BorrowedFd<'_>,
    handle: u32,
    point: u64,
    abs_timeout_ns: i64,
    flags: u32,
) -> io::Result<drm_syncobj_timeline_wait> {
    let handles = [handle];
    let points = [point];
    let mut arg = drm_syncobj_timeline_wait {
        handles: handles.as_ptr() as u64,
        points: points.as_ptr() as u64,
        timeout_nsec: abs_timeout_ns,
        count_handles: 1,
        flags,
        ..Default::default()
    };
    // SAFETY: `handles` and `points` are live one-element arrays matching
    // `count_handles`; `arg` is a valid drm_syncobj_timeline_wait.
    unsafe { ioctl::syncobj_timeline_wait(fd.as_raw_fd(), &mut arg) }
        .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
    Ok(arg)
}

/// DRM_IOCTL_SYNCOBJ_QUERY of one handle: its last signalled point.
pub fn syncobj_query(fd: BorrowedFd<'_>, handle: u32) -> io::Result<u64> {
    let handles = [handle];
    let mut points = [0u64];
    let mut arg = drm_syncobj_timeline_array {
        handles: handles.as_ptr() as u64,
        points: points.as_mut_ptr() as u64,
        count_handles: 1,
        flags: 0,
    };
    // SAFETY: one-element arrays matching `count_handles`, both live.
    retry_eintr(|| unsafe { ioctl::syncobj_query(fd.as_raw_fd(), &mut arg) })?;
    Ok(points[0])
}

/// UDMABUF_CREATE on an open `/dev/udmabuf`: returns the dma-buf fd.
pub fn udmabuf_create(
    udmabuf_dev: BorrowedFd<'_>,
    memfd: BorrowedFd<'_>,
    offset: u64,
    size: u64,
) -> io::Result<OwnedFd> {
    let arg = udmabuf_create {
        memfd: memfd.as_raw_fd() as u32,
        flags: UDMABUF_FLAGS_CLOEXEC,
        offset,
        size,
    };
    // SAFETY: `arg` is a valid udmabuf_create read by the kernel.
    let fd = retry_eintr(|| unsafe { ioctl::udmabuf_create_raw(udmabuf_dev.as_raw_fd(), &arg) })?;
    owned(fd)
}

/// CREATE_HWCTX with the given 32-byte QoS (see [`qos_default`]).
pub fn create_hwctx(
    fd: BorrowedFd<'_>,
    qos: &amdxdna_qos_info_oot,
    num_tiles: u32,
    max_opc: u32,
) -> io::Result<amdxdna_drm_create_hwctx> {
    let mut arg = amdxdna_drm_create_hwctx {
        qos_p: qos as *const amdxdna_qos_info_oot as u64,
        num_tiles,
        max_opc,
        ..Default::default()
    };
    // SAFETY: `qos_p` points to a live 32-byte QoS (the largest size any
    // driver reads); `arg` is a valid amdxdna_drm_create_hwctx.
    retry_eintr(|| unsafe { ioctl::create_hwctx(fd.as_raw_fd(), &mut arg) })?;
    Ok(arg)
}

/// The QoS every context is created with: zeroed, `user_start_col` = 0xFF.
pub fn qos_default() -> amdxdna_qos_info_oot {
    amdxdna_qos_info_oot {
        user_start_col: AMDXDNA_USER_START_COL_NOT_REQUESTED,
        ..Default::default()
    }
}

/// DESTROY_HWCTX.
pub fn destroy_hwctx(fd: BorrowedFd<'_>, handle: u32) -> io::Result<amdxdna_drm_destroy_hwctx> {
    let mut arg = amdxdna_drm_destroy_hwctx {
        handle,
        ..Default::default()
    };
    // SAFETY: `arg` is a valid amdxdna_drm_destroy_hwctx.
    retry_eintr(|| unsafe { ioctl::destroy_hwctx(fd.as_raw_fd(), &mut arg) })?;
    Ok(arg)
}

/// One CU of a CONFIG_CU request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CuConfig {
    /// DEV BO holding the CU's image (PDI / kernel image).
    pub cu_bo: u32,
    /// Function index (0 unless the xclbin says otherwise).
    pub cu_func: u8,
}

/// CONFIG_HWCTX / CONFIG_CU with 1..=32 CUs.
pub fn config_cu(
    fd: BorrowedFd<'_>,
    hwctx: u32,
    cus: &[CuConfig],
) -> io::Result<amdxdna_drm_config_hwctx> {
    if cus.is_empty() || cus.len() > AMDXDNA_MAX_CUS as usize {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // Header (8 bytes) followed by the 8-byte cu_configs, as u64 words so the
    // buffer is 8-aligned.
    let hdr = size_of::<amdxdna_hwctx_param_config_cu>();
    let ent = size_of::<amdxdna_cu_config>();
    let total = hdr + ent * cus.len();
    let mut buf = vec![0u64; total.div_ceil(8)];
    let base = buf.as_mut_ptr() as *mut u8;
    let header = amdxdna_hwctx_param_config_cu {
        num_cus: cus.len() as u16,
        ..Default::default()
    };
    // SAFETY: `buf` holds `total` bytes, 8-aligned; the header is written at
    // 0 and entry i at hdr + i*ent, all within `total` and naturally aligned.
    unsafe {
        core::ptr::write(base as *mut amdxdna_hwctx_param_config_cu, header);
        for (i, cu) in cus.iter().enumerate() {
            let e = amdxdna_cu_config {
                cu_bo: cu.cu_bo,
                cu_func: cu.cu_func,
                ..Default::default()
            };
            core::ptr::write(base.add(hdr + i * ent) as *mut amdxdna_cu_config, e);
        }
    }
    let mut arg = amdxdna_drm_config_hwctx {
        handle: hwctx,
        param_type: DRM_AMDXDNA_HWCTX_CONFIG_CU,
        param_val: base as u64,
        param_val_size: total as u32,
        ..Default::default()
    };
    // SAFETY: `param_val` points to `param_val_size` initialised bytes in
    // `buf`, which outlives the call.
    retry_eintr(|| unsafe { ioctl::config_hwctx(fd.as_raw_fd(), &mut arg) })?;
    Ok(arg)
}

/// CREATE_BO of `bo_type` and `size` (flags 0, vaddr 0).
pub fn create_bo(fd: BorrowedFd<'_>, bo_type: u32, size: u64) -> io::Result<amdxdna_drm_create_bo> {
    let mut arg = amdxdna_drm_create_bo {
        size,
        type_: bo_type,
        ..Default::default()
    };
    // SAFETY: `arg` is a valid amdxdna_drm_create_bo with no user pointers.
    retry_eintr(|| unsafe { ioctl::create_bo(fd.as_raw_fd(), &mut arg) })?;
    Ok(arg)
}

/// GET_BO_INFO.
pub fn get_bo_info(fd: BorrowedFd<'_>, handle: u32) -> io::Result<amdxdna_drm_get_bo_info> {
    let mut arg = amdxdna_drm_get_bo_info {
        handle,
        ..Default::default()
    };
    // SAFETY: `arg` is a valid amdxdna_drm_get_bo_info.
    retry_eintr(|| unsafe { ioctl::get_bo_info(fd.as_raw_fd(), &mut arg) })?;
    Ok(arg)
}

/// SYNC_BO of `[offset, offset + size)` in `direction` (SYNC_DIRECT_*).
pub fn sync_bo(
    fd: BorrowedFd<'_>,
    handle: u32,
    direction: u32,
    offset: u64,
    size: u64,
) -> io::Result<amdxdna_drm_sync_bo> {
    let mut arg = amdxdna_drm_sync_bo {
        handle,
        direction,
        offset,
        size,
    };
    // SAFETY: `arg` is a valid amdxdna_drm_sync_bo.
    retry_eintr(|| unsafe { ioctl::sync_bo(fd.as_raw_fd(), &mut arg) })?;
    Ok(arg)
}

/// EXEC_CMD of one CMD BO with `args` (already de-duplicated) → seq.
pub fn exec_cmd(
    fd: BorrowedFd<'_>,
    hwctx: u32,
    cmd_bo: u32,
    args: &[u32],
) -> io::Result<amdxdna_drm_exec_cmd> {
    let mut arg = amdxdna_drm_exec_cmd {
        hwctx,
        type_: AMDXDNA_CMD_SUBMIT_EXEC_BUF,
        cmd_handles: cmd_bo as u64,
        args: args.as_ptr() as u64,
        cmd_count: 1,
        arg_count: args.len() as u32,
        ..Default::default()
    };
    // SAFETY: `args` points to `arg_count` live u32 handles; `cmd_handles`
    // is a handle value, not a pointer, for cmd_count 1.
    retry_eintr(|| unsafe { ioctl::exec_cmd(fd.as_raw_fd(), &mut arg) })?;
    Ok(arg)
}

/// One WAIT_CMD attempt (timeout in ms, 0 = forever). Not retried.
pub fn wait_cmd(
    fd: BorrowedFd<'_>,
    hwctx: u32,
    seq: u64,
    timeout_ms: u32,
) -> io::Result<amdxdna_drm_wait_cmd> {
    let mut arg = amdxdna_drm_wait_cmd {
        hwctx,
        timeout: timeout_ms,
        seq,
    };
    // SAFETY: `arg` is a valid amdxdna_drm_wait_cmd.
    unsafe { ioctl::wait_cmd(fd.as_raw_fd(), &mut arg) }
        .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
    Ok(arg)
}

/// A plain-old-data UAPI struct GET_INFO/GET_ARRAY may fill.
///
/// # Safety
/// Implementors must be `repr(C)` structs of integers/arrays of integers, for
/// which every bit pattern is valid.
pub unsafe trait InfoStruct: Default + Copy {}
// SAFETY: all of these are bindgen repr(C) structs of plain integers.
unsafe impl InfoStruct for amdxdna_drm_query_aie_metadata {}
// SAFETY: as above.
unsafe impl InfoStruct for amdxdna_drm_query_aie_version {}
// SAFETY: as above.
unsafe impl InfoStruct for amdxdna_drm_query_clock_metadata {}
// SAFETY: as above.
unsafe impl InfoStruct for amdxdna_drm_query_firmware_version {}
// SAFETY: as above.
unsafe impl InfoStruct for amdxdna_drm_get_power_mode {}
// SAFETY: as above.
unsafe impl InfoStruct for amdxdna_drm_get_resource_info {}
// SAFETY: as above.
unsafe impl InfoStruct for amdxdna_drm_hwctx_entry {}
// SAFETY: as above.
unsafe impl InfoStruct for amdxdna_drm_query_hwctx {}
// SAFETY: as above.
unsafe impl InfoStruct for amdxdna_drm_attribute_state {}

/// GET_INFO of `param` into a `T` (buffer_size = size_of T).
pub fn get_info<T: InfoStruct>(fd: BorrowedFd<'_>, param: u32) -> io::Result<T> {
    let mut out = T::default();
    let mut arg = amdxdna_drm_get_info {
        param,
        buffer_size: size_of::<T>() as u32,
        buffer: &mut out as *mut T as u64,
    };
    // SAFETY: `buffer` points to a live `T` of `buffer_size` bytes and any
    // bytes the kernel writes form a valid `T` (InfoStruct contract).
    retry_eintr(|| unsafe { ioctl::get_info(fd.as_raw_fd(), &mut arg) })?;
    Ok(out)
}

/// GET_INFO of `param` into an array of `max` `T` (legacy array queries:
/// QUERY_HW_CONTEXTS). Returns the elements the driver filled, judged by the
/// returned `buffer_size` when the driver shrinks it.
pub fn get_info_array<T: InfoStruct>(
    fd: BorrowedFd<'_>,
    param: u32,
    max: usize,
) -> io::Result<Vec<T>> {
    let mut out = vec![T::default(); max];
    let bytes = size_of::<T>() * max;
    let mut arg = amdxdna_drm_get_info {
        param,
        buffer_size: bytes as u32,
        buffer: out.as_mut_ptr() as u64,
    };
    // SAFETY: `buffer` points to `max` live `T`s = `buffer_size` bytes.
    retry_eintr(|| unsafe { ioctl::get_info(fd.as_raw_fd(), &mut arg) })?;
    let n = (arg.buffer_size as usize).min(bytes) / size_of::<T>().max(1);
    out.truncate(n);
    Ok(out)
}

/// GET_ARRAY of `param` with up to `max` elements of `T`; returns the
/// elements filled and the element size the driver used.
pub fn get_array<T: InfoStruct>(
    fd: BorrowedFd<'_>,
    param: u32,
    max: usize,
) -> io::Result<(Vec<T>, u32)> {
    let max = max.clamp(1, 1024);
    let mut out = vec![T::default(); max];
    let mut arg = amdxdna_drm_get_array {
        param,
        element_size: size_of::<T>() as u32,
        num_element: max as u32,
        pad: 0,
        buffer: out.as_mut_ptr() as u64,
    };
    // SAFETY: `buffer` points to `num_element` live `T`s of `element_size`
    // bytes each; the driver writes at most element_size × num_element bytes.
    retry_eintr(|| unsafe { ioctl::get_array(fd.as_raw_fd(), &mut arg) })?;
    out.truncate((arg.num_element as usize).min(max));
    Ok((out, arg.element_size))
}

/// SET_STATE SET_POWER_MODE (root only).
pub fn set_power_mode(fd: BorrowedFd<'_>, mode: u8) -> io::Result<()> {
    let mut pm = amdxdna_drm_set_power_mode {
        power_mode: mode,
        ..Default::default()
    };
    let mut arg = amdxdna_drm_set_state {
        param: DRM_AMDXDNA_SET_POWER_MODE,
        buffer_size: size_of::<amdxdna_drm_set_power_mode>() as u32,
        buffer: &mut pm as *mut amdxdna_drm_set_power_mode as u64,
    };
    // SAFETY: `buffer` points to a live set_power_mode of `buffer_size`.
    retry_eintr(|| unsafe { ioctl::set_state(fd.as_raw_fd(), &mut arg) })?;
    Ok(())
}

/// Takes ownership of an fd the kernel just returned.
fn owned(fd: RawFd) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    // SAFETY: the kernel returned a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
