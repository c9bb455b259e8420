//! `xdna-shim`: an `LD_PRELOAD` library presenting a fake amdxdna device at `/dev/accel/accel0`
//! (in the manner of Mesa's drm-shim). See `docs/shim.md` for the behaviour and the environment
//! variables.
//!
//! Layout:
//! - this file: libc interposition (`open*`, `close`, `ioctl`, `mmap*`, `stat*`, `access`) and the
//!   lock-free fd table that decides, without locking, whether a call concerns the fake device;
//! - [`real`]: the next definitions of the interposed symbols (`dlsym(RTLD_NEXT)`, cached);
//! - [`uaccess`]: fault-tolerant copies from/to client memory (`process_vm_readv`);
//! - [`config`]: environment configuration and fault injection;
//! - [`device`]: the emulated driver (BOs, heap, contexts, syncobjs, ioctls);
//! - [`ert`]: ERT packet parsing and the command executor seam.
//!
//! Nothing here may panic across the FFI boundary: every interposed entry that does more than a
//! pass-through runs inside `catch_unwind`.

#![allow(clippy::missing_safety_doc)]
// Nearly everything here is unsafe FFI: every unsafe operation sits in its own block, and every
// block says why it is sound.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
// The shim has no public Rust API (it is a cdylib of C symbols): its module map names its private
// modules on purpose.
#![allow(rustdoc::private_intra_doc_links)]

mod config;
mod device;
mod ert;
mod kexec;
mod layout;
mod log;
mod maps;
mod real;
mod uaccess;

use std::ffi::CStr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering};

use libc::{c_char, c_int, c_uint, c_ulong, c_void, mode_t, off_t, size_t};

extern "C" fn shim_fini() {
    let _ = catch_unwind(device::at_exit);
}

/// Unload-time destructor (runs at `exit`): stats for device fds still open.
#[used]
#[link_section = ".fini_array"]
static FINI: extern "C" fn() = shim_fini;

/// Kinds of fd the shim owns (stored in [`FAKE_FDS`]).
pub(crate) const FD_NONE: u8 = 0;
/// The fake accel device node.
pub(crate) const FD_DEVICE: u8 = 1;
/// The fake `/dev/udmabuf` node.
pub(crate) const FD_UDMABUF: u8 = 2;
/// A "dma-buf" returned by the fake udmabuf (a dup of the memfd, with an offset/size window).
pub(crate) const FD_DMABUF: u8 = 3;

const MAX_FDS: usize = 65536;

/// Lock-free table marking the fds the shim owns. Read on every interposed call; written only
/// when a fake fd is created or closed.
static FAKE_FDS: [AtomicU8; MAX_FDS] = [const { AtomicU8::new(FD_NONE) }; MAX_FDS];

pub(crate) fn fd_kind(fd: c_int) -> u8 {
    if fd < 0 || fd as usize >= MAX_FDS {
        return FD_NONE;
    }
    FAKE_FDS[fd as usize].load(Ordering::Acquire)
}

pub(crate) fn set_fd_kind(fd: c_int, kind: u8) {
    if fd >= 0 && (fd as usize) < MAX_FDS {
        FAKE_FDS[fd as usize].store(kind, Ordering::Release);
    }
}

/// The fake device node path.
pub(crate) const DEVICE_PATH: &[u8] = b"/dev/accel/accel0";
const ACCEL_PREFIX: &[u8] = b"/dev/accel/accel";
const UDMABUF_PATH: &[u8] = b"/dev/udmabuf";
/// The DRM accel character major.
pub(crate) const ACCEL_MAJOR: u32 = 261;

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns the calling thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
}

/// Runs `f` with panics turned into `-1`/`EIO` (never unwinding into C).
fn guarded(f: impl FnOnce() -> Result<c_int, c_int>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            set_errno(e);
            -1
        }
        Err(_) => {
            log::log("internal panic caught at the FFI boundary (returning EIO)");
            set_errno(libc::EIO);
            -1
        }
    }
}

/// What a path means to the shim.
enum PathClass<'a> {
    /// Not ours: pass through.
    Other,
    Device,
    /// `/dev/accel/accelN`, N != 0.
    MissingAccel,
    Udmabuf,
    /// A sysfs attribute of the fake device, with its contents.
    Sysfs(&'a str),
    /// A path under the fake device's sysfs directory that doesn't exist.
    MissingSysfs,
}

fn classify(path: *const c_char) -> PathClass<'static> {
    if path.is_null() {
        return PathClass::Other;
    }
    // SAFETY: the caller passes a NUL-terminated path (libc contract); CStr::from_ptr only reads
    // up to the NUL and does not allocate.
    let p = unsafe { CStr::from_ptr(path) }.to_bytes();
    if p == DEVICE_PATH {
        return PathClass::Device;
    }
    if p.starts_with(ACCEL_PREFIX) {
        return PathClass::MissingAccel;
    }
    if p == UDMABUF_PATH {
        return if config::get().udmabuf {
            PathClass::Udmabuf
        } else {
            PathClass::Other
        };
    }
    if p.starts_with(b"/sys/class/accel/") {
        return match device::sysfs_lookup(p) {
            Some(contents) => PathClass::Sysfs(contents),
            None if p.starts_with(b"/sys/class/accel/accel") => PathClass::MissingSysfs,
            None => PathClass::Other,
        };
    }
    PathClass::Other
}

/// Common body of every `open` flavour for a path the shim recognised.
fn open_fake(class: PathClass<'static>, flags: c_int) -> Result<c_int, c_int> {
    match class {
        PathClass::Other => unreachable_other(),
        PathClass::Device => device::open_device(flags),
        PathClass::MissingAccel | PathClass::MissingSysfs => Err(libc::ENOENT),
        PathClass::Udmabuf => device::open_udmabuf(flags),
        PathClass::Sysfs(contents) => device::open_sysfs(contents, flags),
    }
}

fn unreachable_other() -> Result<c_int, c_int> {
    Err(libc::EIO)
}

macro_rules! interpose_open {
    ($name:ident, $real:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
            match classify(path) {
                // SAFETY: forwarding the caller's arguments unchanged to the next definition.
                PathClass::Other => unsafe { real::$real(path, flags, mode) },
                class => guarded(|| open_fake(class, flags)),
            }
        }
    };
}

interpose_open!(open, open);
interpose_open!(open64, open64);

/// `openat`/`openat64`: only absolute paths can name the fake nodes.
macro_rules! interpose_openat {
    ($name:ident, $real:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            dirfd: c_int,
            path: *const c_char,
            flags: c_int,
            mode: mode_t,
        ) -> c_int {
            match classify(path) {
                // SAFETY: forwarding the caller's arguments unchanged to the next definition.
                PathClass::Other => unsafe { real::$real(dirfd, path, flags, mode) },
                class => guarded(|| open_fake(class, flags)),
            }
        }
    };
}

interpose_openat!(openat, openat);
interpose_openat!(openat64, openat64);

macro_rules! interpose_open_2 {
    ($name:ident, $real:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(path: *const c_char, flags: c_int) -> c_int {
            match classify(path) {
                // SAFETY: forwarding the caller's arguments unchanged to the next definition.
                PathClass::Other => unsafe { real::$real(path, flags) },
                class => guarded(|| open_fake(class, flags)),
            }
        }
    };
}

interpose_open_2!(__open_2, open_2);
interpose_open_2!(__open64_2, open64_2);

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let kind = fd_kind(fd);
    if kind != FD_NONE {
        // Unmark first: once the real close returns, the number may be reused by another thread.
        set_fd_kind(fd, FD_NONE);
        let _ = catch_unwind(AssertUnwindSafe(|| device::release_fd(fd, kind)));
    }
    // SAFETY: forwarding the caller's argument unchanged to the next definition.
    unsafe { real::close(fd) }
}

/// Marks `new` (a successful dup of `old`) like `old`.
fn after_dup(old: c_int, new: c_int) {
    let kind = fd_kind(old);
    if new >= 0 && kind != FD_NONE {
        let _ = catch_unwind(AssertUnwindSafe(|| device::dup_fd(old, new, kind)));
    }
}

/// `dup2`/`dup3` onto a fake fd close it first.
fn before_dup_onto(old: c_int, new: c_int) {
    let kind = fd_kind(new);
    if new != old && kind != FD_NONE {
        set_fd_kind(new, FD_NONE);
        let _ = catch_unwind(AssertUnwindSafe(|| device::release_fd(new, kind)));
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: forwarding the caller's argument unchanged to the next definition.
    let r = unsafe { real::dup(fd) };
    after_dup(fd, r);
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    before_dup_onto(old, new);
    // SAFETY: forwarding the caller's arguments unchanged to the next definition.
    let r = unsafe { real::dup2(old, new) };
    if old != new {
        after_dup(old, r);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    before_dup_onto(old, new);
    // SAFETY: forwarding the caller's arguments unchanged to the next definition.
    let r = unsafe { real::dup3(old, new, flags) };
    after_dup(old, r);
    r
}

fn fcntl_common(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: forwarding the caller's arguments unchanged to the next definition.
    let r = unsafe { real::fcntl(fd, cmd, arg) };
    if cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC {
        after_dup(fd, r);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    fcntl_common(fd, cmd, arg)
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    fcntl_common(fd, cmd, arg)
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: c_ulong, arg: *mut c_void) -> c_int {
    let kind = fd_kind(fd);
    if kind == FD_NONE {
        // SAFETY: forwarding the caller's arguments unchanged to the next definition.
        return unsafe { real::ioctl(fd, request, arg) };
    }
    guarded(|| device::ioctl(fd, kind, request, arg as u64))
}

fn mmap_common(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: i64,
) -> *mut c_void {
    let kind = fd_kind(fd);
    if kind == FD_NONE {
        // SAFETY: forwarding the caller's arguments unchanged to the real mmap.
        return unsafe { real::mmap(addr, len, prot, flags, fd, off) };
    }
    match catch_unwind(AssertUnwindSafe(|| {
        device::mmap(addr, len, prot, flags, fd, kind, off)
    })) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            set_errno(e);
            libc::MAP_FAILED
        }
        Err(_) => {
            set_errno(libc::EIO);
            libc::MAP_FAILED
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    mmap_common(addr, len, prot, flags, fd, off)
}

#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    mmap_common(addr, len, prot, flags, fd, off)
}

#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    // Lock-free unless the range held a tracked BO mapping (and never from inside the shim).
    // The tracking is dropped *before* the real munmap: afterwards another thread may map a new
    // BO at the same address, and dropping then would take that BO's mapping away.
    if maps::live() > 0 && !device::in_shim() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            maps::take_overlapping(addr as u64, len as u64, device::unmapped)
        }));
    }
    // SAFETY: forwarding the caller's arguments unchanged to the real munmap.
    unsafe { real::munmap(addr, len) }
}

/// Fills a `struct stat` (same layout as `stat64` on x86_64) for a fake node.
fn fake_stat(buf: *mut libc::stat, class: &PathClass<'_>) -> Result<c_int, c_int> {
    // SAFETY: an all-zero `struct stat` is a valid value (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    match class {
        PathClass::Device => {
            st.st_mode = libc::S_IFCHR | 0o666;
            st.st_rdev = libc::makedev(ACCEL_MAJOR, 0);
        }
        PathClass::Udmabuf => {
            st.st_mode = libc::S_IFCHR | 0o666;
            st.st_rdev = libc::makedev(10, 125);
        }
        PathClass::Sysfs(_) => {
            st.st_mode = libc::S_IFREG | 0o444;
            st.st_size = 4096;
        }
        _ => return Err(libc::ENOENT),
    }
    st.st_nlink = 1;
    st.st_blksize = 4096;
    // SAFETY: `st` is a live local of exactly size_of::<stat>() bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (&st as *const libc::stat).cast::<u8>(),
            std::mem::size_of::<libc::stat>(),
        )
    };
    uaccess::write(buf as u64, bytes).map(|_| 0)
}

macro_rules! interpose_stat {
    ($name:ident, $real:ident, $ty:ty) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(path: *const c_char, buf: *mut $ty) -> c_int {
            match classify(path) {
                // SAFETY: forwarding the caller's arguments unchanged to the next definition.
                PathClass::Other => unsafe { real::$real(path, buf) },
                class => guarded(|| fake_stat(buf.cast(), &class)),
            }
        }
    };
}

interpose_stat!(stat, stat, libc::stat);
interpose_stat!(stat64, stat64, libc::stat64);
interpose_stat!(lstat, lstat, libc::stat);
interpose_stat!(lstat64, lstat64, libc::stat64);

macro_rules! interpose_fstat {
    ($name:ident, $real:ident, $ty:ty) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(fd: c_int, buf: *mut $ty) -> c_int {
            match fd_kind(fd) {
                FD_DEVICE => guarded(|| fake_stat(buf.cast(), &PathClass::Device)),
                FD_UDMABUF => guarded(|| fake_stat(buf.cast(), &PathClass::Udmabuf)),
                // SAFETY: forwarding the caller's arguments unchanged to the next definition.
                _ => unsafe { real::$real(fd, buf) },
            }
        }
    };
}

interpose_fstat!(fstat, fstat, libc::stat);
interpose_fstat!(fstat64, fstat64, libc::stat64);

/// Fills a `struct statx` (256 bytes) by offset.
fn fake_statx(buf: *mut c_void, class: &PathClass<'_>) -> Result<c_int, c_int> {
    let mut b = [0u8; 256];
    let (mode, rdev, size): (u16, (u32, u32), u64) = match class {
        PathClass::Device => ((libc::S_IFCHR | 0o666) as u16, (ACCEL_MAJOR, 0), 0),
        PathClass::Udmabuf => ((libc::S_IFCHR | 0o666) as u16, (10, 125), 0),
        PathClass::Sysfs(_) => ((libc::S_IFREG | 0o444) as u16, (0, 0), 4096),
        _ => return Err(libc::ENOENT),
    };
    b[0..4].copy_from_slice(&libc::STATX_BASIC_STATS.to_le_bytes()); // stx_mask
    b[4..8].copy_from_slice(&4096u32.to_le_bytes()); // stx_blksize
    b[16..20].copy_from_slice(&1u32.to_le_bytes()); // stx_nlink
    b[28..30].copy_from_slice(&mode.to_le_bytes()); // stx_mode
    b[40..48].copy_from_slice(&size.to_le_bytes()); // stx_size
    b[128..132].copy_from_slice(&rdev.0.to_le_bytes()); // stx_rdev_major
    b[132..136].copy_from_slice(&rdev.1.to_le_bytes()); // stx_rdev_minor
    uaccess::write(buf as u64, &b).map(|_| 0)
}

#[no_mangle]
pub unsafe extern "C" fn statx(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mask: c_uint,
    buf: *mut c_void,
) -> c_int {
    let class = classify(path);
    if matches!(class, PathClass::Other) {
        // `statx(fd, "", AT_EMPTY_PATH)` on a fake fd.
        // SAFETY: path is NUL-terminated per the libc contract (checked non-null first).
        let empty = !path.is_null() && unsafe { *path } == 0;
        if empty && flags & libc::AT_EMPTY_PATH != 0 {
            match fd_kind(dirfd) {
                FD_DEVICE => return guarded(|| fake_statx(buf, &PathClass::Device)),
                FD_UDMABUF => return guarded(|| fake_statx(buf, &PathClass::Udmabuf)),
                _ => {}
            }
        }
        // SAFETY: forwarding the caller's arguments unchanged to the next definition.
        return unsafe { real::statx(dirfd, path, flags, mask, buf) };
    }
    guarded(|| fake_statx(buf, &class))
}

#[no_mangle]
pub unsafe extern "C" fn access(path: *const c_char, mode: c_int) -> c_int {
    match classify(path) {
        // SAFETY: forwarding the caller's arguments unchanged to the next definition.
        PathClass::Other => unsafe { real::access(path, mode) },
        PathClass::MissingAccel | PathClass::MissingSysfs => {
            set_errno(libc::ENOENT);
            -1
        }
        _ => 0,
    }
}
