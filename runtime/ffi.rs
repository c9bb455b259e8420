//! Raw amdxdna UAPI: the structs and constants bindgen generated from
//! `ffi/amdxdna_uapi.h` (checked in as `ffi/bindings.rs`), the ioctl request
//! numbers computed in Rust, and access to the C layout probe.
//!
//! Nothing here is safe to call on its own; `device` builds on it.

#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    missing_docs,
    clippy::all
)]
mod bindings {
    include!("../ffi/bindings.rs");
}
pub use bindings::*;

use core::mem::size_of;

/// The request-number type `libc::ioctl` takes on this target.
pub type Request = nix::sys::ioctl::ioctl_num_type;

/// `DRM_IOCTL_BASE` ('d').
pub const DRM_IOCTL_TYPE: u8 = b'd';
/// `DRM_COMMAND_BASE`: driver-private ioctls start here.
pub const DRM_COMMAND_BASE_NR: u8 = 0x40;
/// udmabuf ioctl type ('u').
pub const UDMABUF_IOCTL_TYPE: u8 = b'u';

/// `DRM_IOWR('d', nr, T)`.
macro_rules! drm_iowr {
    ($nr:expr, $t:ty) => {
        nix::request_code_readwrite!(DRM_IOCTL_TYPE, $nr, size_of::<$t>())
    };
}
/// `DRM_IOW('d', nr, T)`.
macro_rules! drm_iow {
    ($nr:expr, $t:ty) => {
        nix::request_code_write!(DRM_IOCTL_TYPE, $nr, size_of::<$t>())
    };
}
/// `DRM_IOWR('d', DRM_COMMAND_BASE + idx, T)` for an amdxdna ioctl.
macro_rules! amdxdna_iowr {
    ($idx:expr, $t:ty) => {
        drm_iowr!(DRM_COMMAND_BASE_NR + $idx as u8, $t)
    };
}

/// Driver-private ioctl numbers (idx 0..=10) as `u8` for `nix` macros.
pub mod nr {
    use super::*;
    /// DRM_IOCTL_VERSION.
    pub const VERSION: u8 = 0x00;
    /// DRM_IOCTL_GEM_CLOSE.
    pub const GEM_CLOSE: u8 = 0x09;
    /// DRM_IOCTL_GET_CAP.
    pub const GET_CAP: u8 = 0x0c;
    /// DRM_IOCTL_PRIME_HANDLE_TO_FD.
    pub const PRIME_HANDLE_TO_FD: u8 = 0x2d;
    /// DRM_IOCTL_PRIME_FD_TO_HANDLE.
    pub const PRIME_FD_TO_HANDLE: u8 = 0x2e;
    /// DRM_IOCTL_SYNCOBJ_CREATE.
    pub const SYNCOBJ_CREATE: u8 = 0xBF;
    /// DRM_IOCTL_SYNCOBJ_DESTROY.
    pub const SYNCOBJ_DESTROY: u8 = 0xC0;
    /// DRM_IOCTL_SYNCOBJ_HANDLE_TO_FD.
    pub const SYNCOBJ_HANDLE_TO_FD: u8 = 0xC1;
    /// DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE.
    pub const SYNCOBJ_FD_TO_HANDLE: u8 = 0xC2;
    /// DRM_IOCTL_SYNCOBJ_WAIT.
    pub const SYNCOBJ_WAIT: u8 = 0xC3;
    /// DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT.
    pub const SYNCOBJ_TIMELINE_WAIT: u8 = 0xCA;
    /// DRM_IOCTL_SYNCOBJ_QUERY.
    pub const SYNCOBJ_QUERY: u8 = 0xCB;
    /// DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL.
    pub const SYNCOBJ_TIMELINE_SIGNAL: u8 = 0xCD;
    /// DRM_IOCTL_SYNCOBJ_EVENTFD.
    pub const SYNCOBJ_EVENTFD: u8 = 0xCF;
    /// UDMABUF_CREATE (type 'u').
    pub const UDMABUF_CREATE: u8 = 0x42;
    /// UDMABUF_CREATE_LIST (type 'u').
    pub const UDMABUF_CREATE_LIST: u8 = 0x43;
    /// amdxdna CREATE_HWCTX.
    pub const AMDXDNA_CREATE_HWCTX: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_CREATE_HWCTX as u8;
    /// amdxdna DESTROY_HWCTX.
    pub const AMDXDNA_DESTROY_HWCTX: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_DESTROY_HWCTX as u8;
    /// amdxdna CONFIG_HWCTX.
    pub const AMDXDNA_CONFIG_HWCTX: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_CONFIG_HWCTX as u8;
    /// amdxdna CREATE_BO.
    pub const AMDXDNA_CREATE_BO: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_CREATE_BO as u8;
    /// amdxdna GET_BO_INFO.
    pub const AMDXDNA_GET_BO_INFO: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_GET_BO_INFO as u8;
    /// amdxdna SYNC_BO.
    pub const AMDXDNA_SYNC_BO: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_SYNC_BO as u8;
    /// amdxdna EXEC_CMD.
    pub const AMDXDNA_EXEC_CMD: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_EXEC_CMD as u8;
    /// amdxdna GET_INFO.
    pub const AMDXDNA_GET_INFO: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_GET_INFO as u8;
    /// amdxdna SET_STATE.
    pub const AMDXDNA_SET_STATE: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_SET_STATE as u8;
    /// amdxdna WAIT_CMD.
    pub const AMDXDNA_WAIT_CMD: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_WAIT_CMD as u8;
    /// amdxdna GET_ARRAY.
    pub const AMDXDNA_GET_ARRAY: u8 = DRM_COMMAND_BASE_NR + DRM_AMDXDNA_GET_ARRAY as u8;
}

/// DRM_IOCTL_VERSION = 0xC0406400.
pub const DRM_IOCTL_VERSION: Request = drm_iowr!(nr::VERSION, drm_version);
/// DRM_IOCTL_GEM_CLOSE = 0x40086409 (IOW).
pub const DRM_IOCTL_GEM_CLOSE: Request = drm_iow!(nr::GEM_CLOSE, drm_gem_close);
/// DRM_IOCTL_GET_CAP = 0xC010640C.
pub const DRM_IOCTL_GET_CAP: Request = drm_iowr!(nr::GET_CAP, drm_get_cap);
/// DRM_IOCTL_PRIME_HANDLE_TO_FD = 0xC00C642D.
pub const DRM_IOCTL_PRIME_HANDLE_TO_FD: Request =
    drm_iowr!(nr::PRIME_HANDLE_TO_FD, drm_prime_handle);
/// DRM_IOCTL_PRIME_FD_TO_HANDLE = 0xC00C642E.
pub const DRM_IOCTL_PRIME_FD_TO_HANDLE: Request =
    drm_iowr!(nr::PRIME_FD_TO_HANDLE, drm_prime_handle);
/// DRM_IOCTL_SYNCOBJ_CREATE = 0xC00864BF.
pub const DRM_IOCTL_SYNCOBJ_CREATE: Request = drm_iowr!(nr::SYNCOBJ_CREATE, drm_syncobj_create);
/// DRM_IOCTL_SYNCOBJ_DESTROY = 0xC00864C0.
pub const DRM_IOCTL_SYNCOBJ_DESTROY: Request = drm_iowr!(nr::SYNCOBJ_DESTROY, drm_syncobj_destroy);
/// DRM_IOCTL_SYNCOBJ_HANDLE_TO_FD = 0xC01864C1.
pub const DRM_IOCTL_SYNCOBJ_HANDLE_TO_FD: Request =
    drm_iowr!(nr::SYNCOBJ_HANDLE_TO_FD, drm_syncobj_handle);
/// DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE = 0xC01864C2.
pub const DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE: Request =
    drm_iowr!(nr::SYNCOBJ_FD_TO_HANDLE, drm_syncobj_handle);
/// DRM_IOCTL_SYNCOBJ_WAIT = 0xC02864C3.
pub const DRM_IOCTL_SYNCOBJ_WAIT: Request = drm_iowr!(nr::SYNCOBJ_WAIT, drm_syncobj_wait);
/// DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT = 0xC03064CA.
pub const DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT: Request =
    drm_iowr!(nr::SYNCOBJ_TIMELINE_WAIT, drm_syncobj_timeline_wait);
/// DRM_IOCTL_SYNCOBJ_QUERY = 0xC01864CB.
pub const DRM_IOCTL_SYNCOBJ_QUERY: Request =
    drm_iowr!(nr::SYNCOBJ_QUERY, drm_syncobj_timeline_array);
/// DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL = 0xC01864CD.
pub const DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL: Request =
    drm_iowr!(nr::SYNCOBJ_TIMELINE_SIGNAL, drm_syncobj_timeline_array);
/// DRM_IOCTL_SYNCOBJ_EVENTFD = 0xC01864CF.
pub const DRM_IOCTL_SYNCOBJ_EVENTFD: Request = drm_iowr!(nr::SYNCOBJ_EVENTFD, drm_syncobj_eventfd);
/// UDMABUF_CREATE = 0x40187542 (IOW, type 'u').
pub const UDMABUF_CREATE_REQ: Request = nix::request_code_write!(
    UDMABUF_IOCTL_TYPE,
    nr::UDMABUF_CREATE,
    size_of::<udmabuf_create>()
);
/// UDMABUF_CREATE_LIST = 0x40087543 (IOW, type 'u').
pub const UDMABUF_CREATE_LIST_REQ: Request = nix::request_code_write!(
    UDMABUF_IOCTL_TYPE,
    nr::UDMABUF_CREATE_LIST,
    size_of::<udmabuf_create_list>()
);

/// CREATE_HWCTX = 0xC0386440.
pub const DRM_IOCTL_AMDXDNA_CREATE_HWCTX: Request =
    amdxdna_iowr!(DRM_AMDXDNA_CREATE_HWCTX, amdxdna_drm_create_hwctx);
/// DESTROY_HWCTX = 0xC0086441.
pub const DRM_IOCTL_AMDXDNA_DESTROY_HWCTX: Request =
    amdxdna_iowr!(DRM_AMDXDNA_DESTROY_HWCTX, amdxdna_drm_destroy_hwctx);
/// CONFIG_HWCTX = 0xC0186442.
pub const DRM_IOCTL_AMDXDNA_CONFIG_HWCTX: Request =
    amdxdna_iowr!(DRM_AMDXDNA_CONFIG_HWCTX, amdxdna_drm_config_hwctx);
/// CREATE_BO = 0xC0206443.
pub const DRM_IOCTL_AMDXDNA_CREATE_BO: Request =
    amdxdna_iowr!(DRM_AMDXDNA_CREATE_BO, amdxdna_drm_create_bo);
/// GET_BO_INFO = 0xC0306444.
pub const DRM_IOCTL_AMDXDNA_GET_BO_INFO: Request =
    amdxdna_iowr!(DRM_AMDXDNA_GET_BO_INFO, amdxdna_drm_get_bo_info);
/// SYNC_BO = 0xC0186445.
pub const DRM_IOCTL_AMDXDNA_SYNC_BO: Request =
    amdxdna_iowr!(DRM_AMDXDNA_SYNC_BO, amdxdna_drm_sync_bo);
/// EXEC_CMD = 0xC0386446.
pub const DRM_IOCTL_AMDXDNA_EXEC_CMD: Request =
    amdxdna_iowr!(DRM_AMDXDNA_EXEC_CMD, amdxdna_drm_exec_cmd);
/// GET_INFO = 0xC0106447.
pub const DRM_IOCTL_AMDXDNA_GET_INFO: Request =
    amdxdna_iowr!(DRM_AMDXDNA_GET_INFO, amdxdna_drm_get_info);
/// SET_STATE = 0xC0106448 (root only).
pub const DRM_IOCTL_AMDXDNA_SET_STATE: Request =
    amdxdna_iowr!(DRM_AMDXDNA_SET_STATE, amdxdna_drm_set_state);
/// WAIT_CMD, out-of-tree IOWR form = 0xC0106449 (the DRM core accepts either).
pub const DRM_IOCTL_AMDXDNA_WAIT_CMD: Request =
    amdxdna_iowr!(DRM_AMDXDNA_WAIT_CMD, amdxdna_drm_wait_cmd);
/// WAIT_CMD, upstream IOW form = 0x40106449.
pub const DRM_IOCTL_AMDXDNA_WAIT_CMD_UPSTREAM: Request = nix::request_code_write!(
    DRM_IOCTL_TYPE,
    nr::AMDXDNA_WAIT_CMD,
    size_of::<amdxdna_drm_wait_cmd>()
);
/// GET_ARRAY = 0xC018644A.
pub const DRM_IOCTL_AMDXDNA_GET_ARRAY: Request =
    amdxdna_iowr!(DRM_AMDXDNA_GET_ARRAY, amdxdna_drm_get_array);

/// Every request value by its C macro name, for tests and diagnostics.
pub const REQUESTS: &[(&str, Request)] = &[
    ("DRM_IOCTL_VERSION", DRM_IOCTL_VERSION),
    ("DRM_IOCTL_GEM_CLOSE", DRM_IOCTL_GEM_CLOSE),
    ("DRM_IOCTL_GET_CAP", DRM_IOCTL_GET_CAP),
    ("DRM_IOCTL_PRIME_HANDLE_TO_FD", DRM_IOCTL_PRIME_HANDLE_TO_FD),
    ("DRM_IOCTL_PRIME_FD_TO_HANDLE", DRM_IOCTL_PRIME_FD_TO_HANDLE),
    ("DRM_IOCTL_SYNCOBJ_CREATE", DRM_IOCTL_SYNCOBJ_CREATE),
    ("DRM_IOCTL_SYNCOBJ_DESTROY", DRM_IOCTL_SYNCOBJ_DESTROY),
    (
        "DRM_IOCTL_SYNCOBJ_HANDLE_TO_FD",
        DRM_IOCTL_SYNCOBJ_HANDLE_TO_FD,
    ),
    (
        "DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE",
        DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE,
    ),
    ("DRM_IOCTL_SYNCOBJ_WAIT", DRM_IOCTL_SYNCOBJ_WAIT),
    (
        "DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT",
        DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT,
    ),
    ("DRM_IOCTL_SYNCOBJ_QUERY", DRM_IOCTL_SYNCOBJ_QUERY),
    (
        "DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL",
        DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL,
    ),
    ("DRM_IOCTL_SYNCOBJ_EVENTFD", DRM_IOCTL_SYNCOBJ_EVENTFD),
    ("UDMABUF_CREATE", UDMABUF_CREATE_REQ),
    ("UDMABUF_CREATE_LIST", UDMABUF_CREATE_LIST_REQ),
    (
        "DRM_IOCTL_AMDXDNA_CREATE_HWCTX",
        DRM_IOCTL_AMDXDNA_CREATE_HWCTX,
    ),
    (
        "DRM_IOCTL_AMDXDNA_DESTROY_HWCTX",
        DRM_IOCTL_AMDXDNA_DESTROY_HWCTX,
    ),
    (
        "DRM_IOCTL_AMDXDNA_CONFIG_HWCTX",
        DRM_IOCTL_AMDXDNA_CONFIG_HWCTX,
    ),
    ("DRM_IOCTL_AMDXDNA_CREATE_BO", DRM_IOCTL_AMDXDNA_CREATE_BO),
    (
        "DRM_IOCTL_AMDXDNA_GET_BO_INFO",
        DRM_IOCTL_AMDXDNA_GET_BO_INFO,
    ),
    ("DRM_IOCTL_AMDXDNA_SYNC_BO", DRM_IOCTL_AMDXDNA_SYNC_BO),
    ("DRM_IOCTL_AMDXDNA_EXEC_CMD", DRM_IOCTL_AMDXDNA_EXEC_CMD),
    ("DRM_IOCTL_AMDXDNA_GET_INFO", DRM_IOCTL_AMDXDNA_GET_INFO),
    ("DRM_IOCTL_AMDXDNA_SET_STATE", DRM_IOCTL_AMDXDNA_SET_STATE),
    ("DRM_IOCTL_AMDXDNA_WAIT_CMD", DRM_IOCTL_AMDXDNA_WAIT_CMD),
    (
        "DRM_IOCTL_AMDXDNA_WAIT_CMD_UPSTREAM",
        DRM_IOCTL_AMDXDNA_WAIT_CMD_UPSTREAM,
    ),
    ("DRM_IOCTL_AMDXDNA_GET_ARRAY", DRM_IOCTL_AMDXDNA_GET_ARRAY),
];

/// `~0`: "no address / no mmap offset" in GET_BO_INFO (bindgen cannot type
/// the C macro as u64).
pub const AMDXDNA_INVALID_ADDR: u64 = u64::MAX;

/// Driver name `DRM_IOCTL_VERSION` must report.
pub const AMDXDNA_DRIVER_NAME_STR: &str = "amdxdna_accel_driver";

/// The C compiler's view of `ffi/amdxdna_uapi.h` (from `ffi/probe.c`).
pub mod probe {
    use std::ffi::{c_char, c_int, c_ulong, c_ulonglong, CStr, CString};

    extern "C" {
        fn xdna_probe_count() -> c_ulong;
        fn xdna_probe_key(i: c_ulong) -> *const c_char;
        fn xdna_probe_lookup(key: *const c_char, out: *mut c_ulonglong) -> c_int;
    }

    /// Value the C probe recorded under `key` (`sizeof:T`, `offsetof:T.f`,
    /// `ioctl:NAME`, `const:NAME`), or `None` if it has no such entry.
    pub fn lookup(key: &str) -> Option<u64> {
        let key = CString::new(key).ok()?;
        let mut out: c_ulonglong = 0;
        // SAFETY: `key` is a valid NUL-terminated string and `out` a valid
        // u64 location; the probe only reads the one and writes the other.
        let found = unsafe { xdna_probe_lookup(key.as_ptr(), &mut out) };
        (found == 1).then_some(out)
    }

    /// Every key in the probe table.
    pub fn keys() -> Vec<String> {
        // SAFETY: pure function over a static table.
        let n = unsafe { xdna_probe_count() };
        (0..n)
            .filter_map(|i| {
                // SAFETY: `i < count`, so the probe returns a pointer to a
                // static NUL-terminated string (or NULL, checked below).
                let p = unsafe { xdna_probe_key(i) };
                if p.is_null() {
                    return None;
                }
                // SAFETY: non-null pointer to a static C string literal.
                Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            })
            .collect()
    }
}
