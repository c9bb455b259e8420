//! Configuration from the environment (read once, on first use). Every variable is documented in
//! `docs/shim.md`; a malformed value is logged and the default kept.

use std::path::PathBuf;
use std::sync::OnceLock;

/// ERT command states the shim can be told to produce.
pub const ERT_COMPLETED: u32 = 4;
pub const ERT_ERROR: u32 = 5;
pub const ERT_ABORT: u32 = 6;
pub const ERT_TIMEOUT: u32 = 8;
pub const ERT_NORESPONSE: u32 = 9;

/// One `XDNA_SHIM_IOCTL_ERRNO` rule.
#[derive(Debug, Clone)]
pub struct IoctlFault {
    /// Ioctl name as in the table of `docs/shim.md` (e.g. `CREATE_BO`, or `MMAP`).
    pub name: String,
    pub errno: i32,
    /// Only the Nth call (1-based) of that ioctl; `None` = every call.
    pub nth: Option<u64>,
}

#[derive(Debug)]
pub struct Config {
    pub driver_major: i32,
    pub driver_minor: i32,
    pub columns: u16,
    pub rows: u16,
    pub core_rows: u16,
    pub context_limit: u32,
    pub vbnv: String,
    pub fw_version: [u32; 4],
    pub device_type: u32,
    pub vendor: u16,
    pub device: u16,
    pub revision: u8,
    /// `(exec number (1-based) or None = every exec, final state)`.
    pub fail_exec: Vec<(Option<u64>, u32)>,
    pub ioctl_errno: Vec<IoctlFault>,
    pub stats: Option<PathBuf>,
    /// Also append a stats line at every this many EXEC_CMDs (0 = only at close and exit).
    pub stats_every: u64,
    pub log: Option<PathBuf>,
    pub debug: bool,
    pub udmabuf: bool,
    pub udmabuf_limit: u64,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

pub fn get() -> &'static Config {
    CONFIG.get_or_init(load)
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|s| !s.is_empty())
}

fn warn(name: &str, value: &str, why: &str) {
    // Can't use log::log here (it reads the config being built).
    eprintln!(
        "xdna-shim[{}]: ignoring {name}={value:?}: {why}",
        std::process::id()
    );
}

fn parse_num<T: std::str::FromStr>(name: &str, default: T) -> T {
    match var(name) {
        None => default,
        Some(v) => {
            let parsed = if let Some(hex) = v.strip_prefix("0x") {
                u64::from_str_radix(hex, 16)
                    .ok()
                    .and_then(|n| n.to_string().parse().ok())
            } else {
                v.parse().ok()
            };
            parsed.unwrap_or_else(|| {
                warn(name, &v, "not a number in range");
                default
            })
        }
    }
}

pub fn state_by_name(s: &str) -> Option<u32> {
    match s.to_ascii_uppercase().as_str() {
        "ERROR" => Some(ERT_ERROR),
        "ABORT" => Some(ERT_ABORT),
        "TIMEOUT" => Some(ERT_TIMEOUT),
        "NORESPONSE" => Some(ERT_NORESPONSE),
        _ => None,
    }
}

pub fn errno_by_name(s: &str) -> Option<i32> {
    if let Ok(n) = s.parse::<i32>() {
        return (n > 0).then_some(n);
    }
    Some(match s.to_ascii_uppercase().as_str() {
        "EPERM" => libc::EPERM,
        "ENOENT" => libc::ENOENT,
        "EINTR" => libc::EINTR,
        "EIO" => libc::EIO,
        "EBADF" => libc::EBADF,
        "EAGAIN" => libc::EAGAIN,
        "ENOMEM" => libc::ENOMEM,
        "EACCES" => libc::EACCES,
        "EFAULT" => libc::EFAULT,
        "EBUSY" => libc::EBUSY,
        "ENODEV" => libc::ENODEV,
        "EINVAL" => libc::EINVAL,
        "ENOSPC" => libc::ENOSPC,
        "E2BIG" => libc::E2BIG,
        "ETIME" => libc::ETIME,
        "ETIMEDOUT" => libc::ETIMEDOUT,
        "EOPNOTSUPP" => libc::EOPNOTSUPP,
        "ENOTTY" => libc::ENOTTY,
        _ => return None,
    })
}

fn load() -> Config {
    let (driver_major, driver_minor) = match var("XDNA_SHIM_DRIVER_VERSION") {
        None => (0, 16),
        Some(v) => match v
            .split_once('.')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        {
            Some(mm) => mm,
            None => {
                warn(
                    "XDNA_SHIM_DRIVER_VERSION",
                    &v,
                    "expected MAJOR.MINOR, e.g. 0.16 or 1.0",
                );
                (0, 16)
            }
        },
    };
    let mut columns: u16 = parse_num("XDNA_SHIM_COLUMNS", 8);
    if columns == 0 || columns > 64 {
        warn("XDNA_SHIM_COLUMNS", &columns.to_string(), "must be 1..=64");
        columns = 8;
    }
    let fw_version = match var("XDNA_SHIM_FW_VERSION") {
        None => [1, 5, 2, 380],
        Some(v) => {
            let parts: Vec<u32> = v.split('.').filter_map(|p| p.parse().ok()).collect();
            if parts.len() == 4 {
                [parts[0], parts[1], parts[2], parts[3]]
            } else {
                warn(
                    "XDNA_SHIM_FW_VERSION",
                    &v,
                    "expected major.minor.patch.build",
                );
                [1, 5, 2, 380]
            }
        }
    };
    let (device, revision) = match var("XDNA_SHIM_PCI") {
        None => (0x17f0, 0x10),
        Some(v) => match v.split_once(':').and_then(|(d, r)| {
            Some((
                u16::from_str_radix(d, 16).ok()?,
                u8::from_str_radix(r, 16).ok()?,
            ))
        }) {
            Some(dr) => dr,
            None => {
                warn(
                    "XDNA_SHIM_PCI",
                    &v,
                    "expected DEVICE:REVISION in hex, e.g. 17f0:10",
                );
                (0x17f0, 0x10)
            }
        },
    };
    let mut fail_exec = Vec::new();
    if let Some(v) = var("XDNA_SHIM_FAIL_EXEC") {
        for item in v.split(',') {
            let parsed = item.split_once(':').and_then(|(n, s)| {
                let n = if n == "*" || n.eq_ignore_ascii_case("all") {
                    None
                } else {
                    Some(n.parse::<u64>().ok().filter(|&n| n >= 1)?)
                };
                Some((n, state_by_name(s)?))
            });
            match parsed {
                Some(p) => fail_exec.push(p),
                None => warn(
                    "XDNA_SHIM_FAIL_EXEC",
                    item,
                    "expected N:ERROR|TIMEOUT|ABORT|NORESPONSE (N 1-based or *)",
                ),
            }
        }
    }
    let mut ioctl_errno = Vec::new();
    if let Some(v) = var("XDNA_SHIM_IOCTL_ERRNO") {
        for item in v.split(',') {
            let parsed = item.split_once(':').and_then(|(name, rest)| {
                let (e, nth) = match rest.split_once('@') {
                    Some((e, n)) => (e, Some(n.parse::<u64>().ok().filter(|&n| n >= 1)?)),
                    None => (rest, None),
                };
                Some(IoctlFault {
                    name: name.to_ascii_uppercase(),
                    errno: errno_by_name(e)?,
                    nth,
                })
            });
            match parsed {
                Some(p) => ioctl_errno.push(p),
                None => warn(
                    "XDNA_SHIM_IOCTL_ERRNO",
                    item,
                    "expected NAME:ERRNO[@N], e.g. CREATE_BO:12 or EXEC_CMD:ENOMEM@2",
                ),
            }
        }
    }
    Config {
        driver_major,
        driver_minor,
        columns,
        rows: 6,
        core_rows: 4,
        context_limit: parse_num("XDNA_SHIM_CONTEXT_LIMIT", 16),
        vbnv: var("XDNA_SHIM_VBNV").unwrap_or_else(|| "RyzenAI-npu4".into()),
        fw_version,
        device_type: parse_num("XDNA_SHIM_DEVICE_TYPE", 0),
        vendor: 0x1022,
        device,
        revision,
        fail_exec,
        ioctl_errno,
        stats: var("XDNA_SHIM_STATS").map(PathBuf::from),
        stats_every: parse_num("XDNA_SHIM_STATS_EVERY", 0),
        log: var("XDNA_SHIM_LOG").map(PathBuf::from),
        debug: var("XDNA_SHIM_DEBUG").is_some_and(|v| v != "0"),
        udmabuf: var("XDNA_SHIM_UDMABUF").is_none_or(|v| v != "0"),
        udmabuf_limit: parse_num::<u64>("XDNA_SHIM_UDMABUF_LIMIT_MB", 64) << 20,
    }
}
