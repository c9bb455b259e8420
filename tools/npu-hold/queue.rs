//! The hold directory: a FIFO of ticket files and the device lock.
//!
//! Layout of `<dir>` (one directory per device):
//!
//! - `device.lock`: the holder keeps an exclusive `flock` on it while its command runs.
//! - `seq`: the last ticket number handed out; read and bumped under an exclusive `flock`.
//! - `queue/<seq:020>.ticket`: one JSON file per waiting or holding `npu-hold`, exclusively
//!   `flock`ed by its owner for its whole life. A ticket whose lock can be taken belongs to a dead
//!   process and is removed by whoever sees it (the kernel drops `flock`s when a process dies).
//! - `queue/<seq:020>.holder`: written by the holder once it has the device (since, deadline, state).
//!
//! A waiter owns the device once its ticket is the oldest live ticket *and* it gets `device.lock`.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

/// An error with the file it concerns.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot {what} {}: {errno}", path.display())]
    Lock {
        what: &'static str,
        path: PathBuf,
        errno: Errno,
    },
    #[error("interrupted while taking a ticket")]
    GaveUp,
    #[error("no usable lock directory for device {device} (tried {tried})")]
    NoDir { device: String, tried: String },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> QueueError {
    let path = path.to_path_buf();
    move |source| QueueError::Io { what, path, source }
}

fn current_uid() -> u32 {
    // SAFETY: getuid(2) takes no arguments and always succeeds.
    unsafe { libc::getuid() }
}

/// What a ticket file holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TicketInfo {
    pub seq: u64,
    pub label: String,
    pub pid: u32,
    pub uid: u32,
    pub queued_at_ms: u64,
    pub command: Vec<String>,
    pub timeout_ms: Option<u64>,
}

/// What the holder publishes once it owns the device.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HolderInfo {
    pub seq: u64,
    pub child_pid: Option<u32>,
    pub since_ms: u64,
    pub deadline_ms: Option<u64>,
    /// `starting`, `running`, `stopping (<reason>)`.
    pub state: String,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The lock directory of one device.
#[derive(Debug, Clone)]
pub struct HoldDir {
    pub root: PathBuf,
    /// Created under a system-wide base (`/run`, `/tmp`): make what we create usable by all users.
    shared: bool,
}

/// A ticket in the queue, owned by this process; removed (and unlocked) on drop.
pub struct Ticket {
    pub info: TicketInfo,
    path: PathBuf,
    holder_path: PathBuf,
    _lock: Flock<File>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.holder_path);
        let _ = fs::remove_file(&self.path);
        // `_lock` is dropped after this body: the file is gone before its lock is released.
    }
}

/// The exclusive device lock; released on drop (or by the kernel when this process dies).
pub struct DeviceLock {
    _lock: Flock<File>,
}

/// A live ticket seen in the queue.
#[derive(Debug, Clone)]
pub struct LiveTicket {
    pub seq: u64,
    pub info: Option<TicketInfo>,
}

fn ticket_name(seq: u64) -> String {
    format!("{seq:020}.ticket")
}

fn holder_name(seq: u64) -> String {
    format!("{seq:020}.holder")
}

fn parse_seq(name: &str, suffix: &str) -> Option<u64> {
    let digits = name.strip_suffix(suffix)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn pid_alive(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None),
        Err(Errno::ESRCH)
    )
}

impl HoldDir {
    /// `$XDNA_HOLD_DIR` if set; else `/run/xdna-hold/<device basename>` (of the device path with
    /// symlinks resolved), falling back to
    /// `$XDG_RUNTIME_DIR/xdna-hold/<basename>` and `/tmp/xdna-hold/<basename>`.
    pub fn resolve(device: &Path) -> Result<HoldDir, QueueError> {
        if let Some(dir) = std::env::var_os("XDNA_HOLD_DIR").filter(|v| !v.is_empty()) {
            let mut hold = HoldDir {
                root: PathBuf::from(dir),
                shared: false,
            };
            hold.prepare()
                .map_err(io_err("use XDNA_HOLD_DIR", &hold.root))?;
            // Absolute, so commands that change directory still name the same place.
            if let Ok(abs) = fs::canonicalize(&hold.root) {
                hold.root = abs;
            }
            return Ok(hold);
        }
        // A symlink (e.g. /dev/accel/by-path/...) names the same lock as its target.
        let real = fs::canonicalize(device).unwrap_or_else(|_| device.to_path_buf());
        let key = real
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| !n.is_empty() && n != "..")
            .unwrap_or_else(|| "device".to_string());
        let mut bases: Vec<(PathBuf, bool)> = vec![(PathBuf::from("/run/xdna-hold"), true)];
        if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
            bases.push((PathBuf::from(xdg).join("xdna-hold"), false));
        }
        bases.push((PathBuf::from("/tmp/xdna-hold"), true));
        let mut tried = Vec::new();
        for (base, shared) in bases {
            let hold = HoldDir {
                root: base.join(&key),
                shared,
            };
            match hold.prepare_with_base(&base) {
                Ok(()) => {
                    tracing::debug!("lock directory {}", hold.root.display());
                    return Ok(hold);
                }
                Err(e) => {
                    tracing::debug!("lock directory {} unusable: {e}", hold.root.display());
                    tried.push(format!("{}: {e}", hold.root.display()));
                }
            }
        }
        Err(QueueError::NoDir {
            device: device.display().to_string(),
            tried: tried.join("; "),
        })
    }

    fn make_dir(&self, path: &Path) -> io::Result<()> {
        match fs::create_dir(path) {
            Ok(()) => {
                if self.shared {
                    // Sticky and world-writable, like /tmp: every user can queue.
                    let _ = fs::set_permissions(path, fs::Permissions::from_mode(0o1777));
                }
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn prepare_with_base(&self, base: &Path) -> io::Result<()> {
        if let Some(parent) = base.parent() {
            if !parent.is_dir() {
                return Err(io::Error::new(io::ErrorKind::NotFound, "parent missing"));
            }
        }
        self.make_dir(base)?;
        self.prepare()
    }

    fn prepare(&self) -> io::Result<()> {
        if self.shared {
            self.make_dir(&self.root)?;
        } else {
            fs::create_dir_all(&self.root)?;
        }
        self.make_dir(&self.queue_dir())?;
        nix::unistd::access(
            &self.queue_dir(),
            nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK,
        )
        .map_err(io::Error::from)?;
        Ok(())
    }

    fn queue_dir(&self) -> PathBuf {
        self.root.join("queue")
    }

    fn open_shared_file(&self, name: &str) -> Result<(File, PathBuf), QueueError> {
        let path = self.root.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            // Shared, world-writable directory: never follow a planted symlink.
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io_err("open", &path))?;
        let meta = file.metadata().map_err(io_err("stat", &path))?;
        if !meta.is_file() || meta.nlink() != 1 {
            return Err(QueueError::Io {
                what: "use",
                path,
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    "not a plain file with a single link (tampered lock directory?)",
                ),
            });
        }
        if self.shared {
            let _ = file.set_permissions(fs::Permissions::from_mode(0o666));
        }
        Ok((file, path))
    }

    /// Take the next ticket number and publish a locked ticket file for it.
    pub fn take_ticket(
        &self,
        label: String,
        command: Vec<String>,
        timeout: Option<Duration>,
        give_up: &mut dyn FnMut() -> bool,
    ) -> Result<Ticket, QueueError> {
        let (mut seq_file, seq_path) = self.open_shared_file("seq")?;
        // Held for microseconds by others; polled so that `give_up` (a signal) can end the wait.
        let mut seq_lock = loop {
            match Flock::lock(seq_file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => break lock,
                Err((file, Errno::EWOULDBLOCK)) => {
                    if give_up() {
                        return Err(QueueError::GaveUp);
                    }
                    seq_file = file;
                }
                Err((_, errno)) => {
                    return Err(QueueError::Lock {
                        what: "lock",
                        path: seq_path,
                        errno,
                    })
                }
            }
        };
        let mut text = String::new();
        seq_lock
            .read_to_string(&mut text)
            .map_err(io_err("read", &seq_path))?;
        let last = text.trim().parse::<u64>().unwrap_or(0);
        // Never go below a ticket still in the queue (e.g. if `seq` was lost or corrupted).
        let max_queued = self.scan_names().iter().map(|(s, _)| *s).max().unwrap_or(0);
        let seq = last.max(max_queued).saturating_add(1);
        seq_lock.set_len(0).map_err(io_err("truncate", &seq_path))?;
        seq_lock
            .write_all_at(format!("{seq}\n").as_bytes(), 0)
            .map_err(io_err("write", &seq_path))?;

        let info = TicketInfo {
            seq,
            label,
            pid: std::process::id(),
            uid: current_uid(),
            queued_at_ms: now_ms(),
            command,
            timeout_ms: timeout.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
        };
        // Write under a temporary name, lock, then rename: a visible ticket is always locked.
        let tmp = self
            .queue_dir()
            .join(format!(".tmp-{}-{seq}.ticket", std::process::id()));
        let _ = fs::remove_file(&tmp); // a leftover of an earlier process with our pid
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(l) => l,
            Err((_, errno)) => {
                let _ = fs::remove_file(&tmp);
                return Err(QueueError::Lock {
                    what: "lock",
                    path: tmp,
                    errno,
                });
            }
        };
        let json = serde_json::to_vec(&info).unwrap_or_default();
        if let Err(e) = lock.write_all(&json) {
            let _ = fs::remove_file(&tmp);
            return Err(io_err("write", &tmp)(e));
        }
        let path = self.queue_dir().join(ticket_name(seq));
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return Err(io_err("publish ticket", &path)(e));
        }
        drop(seq_lock);
        Ok(Ticket {
            holder_path: self.queue_dir().join(holder_name(seq)),
            info,
            path,
            _lock: lock,
        })
    }

    /// `(seq, file name)` of every ticket file, unsorted, without checking liveness.
    fn scan_names(&self) -> Vec<(u64, String)> {
        let Ok(entries) = fs::read_dir(self.queue_dir()) else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                parse_seq(&name, ".ticket").map(|s| (s, name))
            })
            .collect()
    }

    /// Live tickets, oldest first. Tickets of dead processes (lock free) are removed on the way.
    pub fn live_tickets(&self) -> Vec<LiveTicket> {
        let qdir = self.queue_dir();
        let Ok(entries) = fs::read_dir(&qdir) else {
            return Vec::new();
        };
        let mut live = Vec::new();
        let mut holders = Vec::new();
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = qdir.join(&name);
            if let Some(seq) = parse_seq(&name, ".ticket") {
                let opened = OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path);
                let Ok(file) = opened else {
                    continue; // removed meanwhile (or a planted symlink: ignored)
                };
                match Flock::lock(file, FlockArg::LockSharedNonblock) {
                    Ok(mut lock) => {
                        let mut text = String::new();
                        let _ = lock.read_to_string(&mut text);
                        let pid = serde_json::from_str::<TicketInfo>(&text)
                            .map(|t| t.pid.to_string())
                            .unwrap_or_else(|_| "?".into());
                        tracing::debug!("removing stale ticket {seq} of dead process {pid}");
                        let _ = fs::remove_file(&path);
                        let _ = fs::remove_file(qdir.join(holder_name(seq)));
                    }
                    Err((mut file, Errno::EWOULDBLOCK)) => {
                        let mut text = String::new();
                        let info = file
                            .read_to_string(&mut text)
                            .ok()
                            .and_then(|_| serde_json::from_str::<TicketInfo>(&text).ok());
                        live.push(LiveTicket { seq, info });
                    }
                    Err((_, errno)) => {
                        tracing::debug!("cannot probe ticket {}: {errno}", path.display());
                        // Unknown: treat as live so FIFO order is never broken by an error.
                        live.push(LiveTicket { seq, info: None });
                    }
                }
            } else if let Some(seq) = parse_seq(&name, ".holder") {
                holders.push((seq, path));
            } else if let Some(rest) = name.strip_prefix(".tmp-") {
                // `.tmp-<pid>-...`: leftovers of a process that died while publishing.
                let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
                let old = entry
                    .metadata()
                    .ok()
                    .and_then(|m| m.modified().ok())
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > Duration::from_secs(60));
                if old && pid.is_some_and(|p| !pid_alive(p)) {
                    let _ = fs::remove_file(&path);
                }
            }
        }
        live.sort_by_key(|t| t.seq);
        for (seq, path) in holders {
            if !live.iter().any(|t| t.seq == seq) && !qdir.join(ticket_name(seq)).exists() {
                let _ = fs::remove_file(path);
            }
        }
        live
    }

    /// Take the device lock if it is free.
    pub fn try_lock_device(&self) -> Result<Option<DeviceLock>, QueueError> {
        let (file, path) = self.open_shared_file("device.lock")?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Some(DeviceLock { _lock: lock })),
            Err((_, Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, errno)) => Err(QueueError::Lock {
                what: "lock",
                path,
                errno,
            }),
        }
    }

    /// Whether some process holds the device lock right now.
    pub fn device_locked(&self) -> Result<bool, QueueError> {
        let path = self.root.join("device.lock");
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io_err("open", &path)(e)),
        };
        match Flock::lock(file, FlockArg::LockSharedNonblock) {
            Ok(_probe) => Ok(false),
            Err((_, Errno::EWOULDBLOCK)) => Ok(true),
            Err((_, errno)) => Err(QueueError::Lock {
                what: "probe",
                path,
                errno,
            }),
        }
    }

    /// Publish (or update) the holder record of `ticket`.
    pub fn write_holder(&self, ticket: &Ticket, info: &HolderInfo) -> Result<(), QueueError> {
        let tmp = self
            .queue_dir()
            .join(format!(".tmp-{}-{}.holder", std::process::id(), info.seq));
        let json = serde_json::to_vec(info).unwrap_or_default();
        // A fresh file (O_EXCL: a planted symlink or file under this name is removed, not followed).
        let _ = fs::remove_file(&tmp);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        if let Err(e) = file.write_all(&json) {
            let _ = fs::remove_file(&tmp);
            return Err(io_err("write", &tmp)(e));
        }
        drop(file);
        fs::rename(&tmp, &ticket.holder_path).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_err("publish holder record", &ticket.holder_path)(e)
        })
    }

    pub fn read_holder(&self, seq: u64) -> Option<HolderInfo> {
        let text = fs::read_to_string(self.queue_dir().join(holder_name(seq))).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// The holder (oldest live ticket, when the device lock is held and it published a holder
    /// record) and the waiters after it, in order.
    pub fn snapshot(&self) -> Result<Snapshot, QueueError> {
        let locked = self.device_locked()?;
        let mut queue = self.live_tickets();
        let mut holder = None;
        if locked {
            if let Some(first) = queue.first() {
                if let Some(h) = self.read_holder(first.seq) {
                    holder = Some((queue.remove(0), h));
                }
            }
        }
        Ok(Snapshot {
            locked,
            holder,
            queue,
        })
    }
}

/// A view of the lock directory at one moment.
pub struct Snapshot {
    /// The device lock is held (by `holder`, or by a process outside the queue, or one starting).
    pub locked: bool,
    pub holder: Option<(LiveTicket, HolderInfo)>,
    pub queue: Vec<LiveTicket>,
}

/// `2026-11-30T02:50:01Z` from milliseconds since the Unix epoch.
pub fn format_utc(ms: u64) -> String {
    let secs = ms / 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_format() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(
            format_utc(1_795_996_800_000 + 3_723_000),
            "2026-11-30T01:02:03Z"
        );
    }

    #[test]
    fn seq_names() {
        assert_eq!(parse_seq(&ticket_name(42), ".ticket"), Some(42));
        assert_eq!(parse_seq("42.ticket", ".ticket"), None);
        assert_eq!(parse_seq(&holder_name(7), ".ticket"), None);
    }
}
