//! The emulated amdxdna driver: per-fd clients with their BOs, heap, contexts and syncobjs, and the
//! ioctl handlers with the driver's validation (`docs/protocol.md` §2–§9).
//!
//! Locking: one `parking_lot` mutex over all state, taken only for work on fake fds. Nothing done
//! under it calls back into a code path that takes it (the shim's own `mmap`s go to the real
//! function; the allocator's anonymous `mmap`s never look at the lock).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::io::Write;
use std::sync::OnceLock;

use libc::{c_int, c_void, size_t};
use parking_lot::Mutex;

use crate::config::{self, ERT_ABORT, ERT_COMPLETED, ERT_ERROR, ERT_TIMEOUT};
use crate::ert::{self, Header};
use crate::{log, real, uaccess};

type Res<T> = Result<T, c_int>;

const PAGE: u64 = 4096;
/// The one device heap a client may create.
pub const HEAP_SIZE: u64 = 64 << 20;
/// DEV BOs are carved from the heap at this alignment (`dev_mem_buf_shift = 15`).
pub const DEV_ALIGN: u64 = 32 << 10;
/// Device address of the heap (`AIE2_DEVM_BASE`).
pub const DEVM_BASE: u64 = 0x0400_0000;
/// Bytes of guard pattern after every BO.
pub const GUARD_LEN: u64 = 64;
/// The guard pattern (repeated).
pub const GUARD_WORD: u64 = 0x5844_4E41_6775_6172; // "XDNAguar" read as big-endian
const INVALID: u64 = !0;
/// Heap the driver takes per context for command staging (4 × 4 KiB).
const HWCTX_RESERVE: u64 = 16 << 10;
/// Instruction buffers not aligned to this never complete on npu4 firmware.
const INSTR_ALIGN: u64 = 16 << 10;

const BO_SHARE: u32 = 1;
const BO_DEV_HEAP: u32 = 2;
const BO_DEV: u32 = 3;
const BO_CMD: u32 = 4;

fn round_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

fn errno_name(e: c_int) -> &'static str {
    match e {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EIO => "EIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::E2BIG => "E2BIG",
        libc::ETIME => "ETIME",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ENOTTY => "ENOTTY",
        _ => "errno",
    }
}

/// Logs a driver-style error line and returns the errno.
fn fail<T>(e: c_int, what: &str, msg: impl Display) -> Res<T> {
    log::log(&format!("{what}: {} ({e}): {msg}", errno_name(e)));
    Err(e)
}

// Little-endian field access on ioctl argument buffers (bounds are guaranteed by the dispatcher,
// which sizes every buffer to the kernel struct).
fn g16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn g32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
fn g64(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}
fn p32(b: &mut [u8], o: usize, v: u32) {
    b[o..o + 4].copy_from_slice(&v.to_le_bytes());
}
fn p64(b: &mut [u8], o: usize, v: u64) {
    b[o..o + 8].copy_from_slice(&v.to_le_bytes());
}

/// A memfd and the shim's own shared mapping of it (independent of the client's mappings).
struct Backing {
    fd: c_int,
    ptr: usize,
    len: usize,
    /// Offset of the window inside the file (non-zero only for imported dma-buf windows).
    fd_off: u64,
}

impl Drop for Backing {
    fn drop(&mut self) {
        // SAFETY: `ptr/len` is the mapping this Backing created and nobody else unmaps it; `fd` is
        // owned by this Backing.
        unsafe {
            real::munmap(self.ptr as *mut c_void, self.len);
            real::close(self.fd);
        }
    }
}

impl Backing {
    fn map(fd: c_int, len: usize, fd_off: u64) -> Res<Backing> {
        // SAFETY: a fresh shared mapping of a file we own; the real mmap never re-enters the shim.
        let p = unsafe {
            real::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                fd_off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            // SAFETY: errno slot of this thread.
            let e = unsafe { *libc::__errno_location() };
            // SAFETY: closing the fd we own on the error path.
            unsafe { real::close(fd) };
            return Err(e);
        }
        Ok(Backing {
            fd,
            ptr: p as usize,
            len,
            fd_off,
        })
    }

    fn memfd(name: &str, len: u64) -> Res<Backing> {
        let cname = std::ffi::CString::new(name).map_err(|_| libc::EINVAL)?;
        // SAFETY: NUL-terminated name; memfd_create is not interposed.
        let fd = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(last_errno());
        }
        // SAFETY: plain syscall on the fd we just created.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let e = last_errno();
            // SAFETY: closing the fd we own on the error path.
            unsafe { real::close(fd) };
            return Err(e);
        }
        // Like a real dma-buf, an exported BO can't change size under the shim's mapping.
        // SAFETY: fcntl on the memfd we just created (with MFD_ALLOW_SEALING).
        unsafe {
            real::fcntl(
                fd,
                libc::F_ADD_SEALS,
                (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) as libc::c_ulong,
            )
        };
        Backing::map(fd, len as usize, 0)
    }

    fn dup(&self, cloexec: bool) -> Res<c_int> {
        let cmd = if cloexec {
            libc::F_DUPFD_CLOEXEC
        } else {
            libc::F_DUPFD
        };
        // SAFETY: fcntl on an fd we own.
        let fd = unsafe { real::fcntl(self.fd, cmd, 0) };
        if fd < 0 {
            Err(last_errno())
        } else {
            Ok(fd)
        }
    }
}

fn last_errno() -> c_int {
    // SAFETY: errno slot of this thread.
    unsafe { *libc::__errno_location() }
}

fn write_guard(ptr: usize, at: u64) {
    let pat = GUARD_WORD.to_le_bytes();
    for i in 0..(GUARD_LEN / 8) {
        // SAFETY: callers pass a BO memory base and its size; every backing reserves GUARD_LEN
        // bytes after the size (memfds are sized size+guard, DEV carve-outs reserve it in the heap).
        unsafe {
            std::ptr::copy_nonoverlapping(
                pat.as_ptr(),
                (ptr + at as usize + 8 * i as usize) as *mut u8,
                8,
            )
        };
    }
}

/// Offset (relative to the BO start) of the first clobbered guard byte, if any.
fn check_guard(ptr: usize, at: u64) -> Option<u64> {
    let pat = GUARD_WORD.to_le_bytes();
    for i in 0..GUARD_LEN {
        // SAFETY: as in write_guard.
        let b = unsafe { std::ptr::read_volatile((ptr + (at + i) as usize) as *const u8) };
        if b != pat[(i % 8) as usize] {
            return Some(at + i);
        }
    }
    None
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Share,
    Heap,
    Dev {
        off: u64,
    },
    Cmd,
    Imported,
    /// A user-pointer BO (va_tbl with dmabuf_fd -1): the client's own memory at `va`.
    UserPtr,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Share => "SHARE",
            Kind::Heap => "DEV_HEAP",
            Kind::Dev { .. } => "DEV",
            Kind::Cmd => "CMD",
            Kind::Imported => "SHARE(imported)",
            Kind::UserPtr => "SHARE(user pointer)",
        }
    }
}

struct Bo {
    kind: Kind,
    size: u64,
    /// Own memory (SHARE, CMD, imported); None for DEV and the heap (memory in `Heap`).
    backing: Option<Backing>,
    /// VA of the first client mapping (the device address in PASID mode); when that mapping is
    /// unmapped, the next live one's (or none).
    va: Option<u64>,
    /// Base VAs of the client's live mappings.
    maps: Vec<u64>,
    guarded: bool,
}

struct Heap {
    backing: Backing,
    va: Option<u64>,
    maps: Vec<u64>,
    /// offset → (reserved length, references). A DEV BO holds one reference, a context using it
    /// as a CU holds another; context staging reservations hold one.
    allocs: BTreeMap<u64, (u64, u32)>,
}

impl Heap {
    fn alloc(&mut self, size: u64) -> Option<u64> {
        let need = round_up(size + GUARD_LEN, DEV_ALIGN);
        let mut cursor = 0u64;
        for (&off, &(len, _)) in self.allocs.iter() {
            if off >= cursor + need {
                break;
            }
            cursor = round_up(off + len, DEV_ALIGN);
        }
        if cursor + need > HEAP_SIZE {
            return None;
        }
        self.allocs.insert(cursor, (need, 1));
        Some(cursor)
    }

    fn hold(&mut self, off: u64) {
        if let Some(a) = self.allocs.get_mut(&off) {
            a.1 += 1;
        }
    }

    fn release(&mut self, off: u64) {
        if let Some(a) = self.allocs.get_mut(&off) {
            a.1 -= 1;
            if a.1 == 0 {
                self.allocs.remove(&off);
            }
        }
    }
}

struct Ctx {
    syncobj: u32,
    next_seq: u64,
    /// CONFIG_CU: (DEV BO handle, heap offset) per CU.
    cus: Vec<(u32, u64)>,
    reserve_off: u64,
    num_col: u32,
    submissions: u64,
    completions: u64,
    errors: u64,
}

#[derive(Default)]
struct Syncobj {
    /// Highest signalled timeline point (None = no fence yet).
    signalled: Option<u64>,
    /// SYNCOBJ_EVENTFD registrations not yet fired: (point, our dup of the eventfd).
    waiters: Vec<(u64, c_int)>,
}

impl Syncobj {
    /// Signals timeline point `p` (monotonic) and fires the eventfds waiting for it.
    fn signal(&mut self, p: u64) {
        let now = self.signalled.map_or(p, |old| old.max(p));
        self.signalled = Some(now);
        self.waiters.retain(|&(point, efd)| {
            if point > now {
                return true;
            }
            fire_eventfd(efd);
            false
        });
    }
}

impl Drop for Syncobj {
    fn drop(&mut self) {
        for &(_, efd) in &self.waiters {
            // SAFETY: closing our own dup of the eventfd.
            unsafe { real::close(efd) };
        }
    }
}

/// Adds 1 to an eventfd and closes our dup of it.
fn fire_eventfd(efd: c_int) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: an 8-byte write to an eventfd we own, then closing it.
    unsafe {
        libc::write(efd, one.as_ptr().cast(), 8);
        real::close(efd);
    }
}

#[derive(Default)]
struct Client {
    bos: BTreeMap<u32, Bo>,
    next_handle: u32,
    heap: Option<Heap>,
    ctxs: BTreeMap<u32, Ctx>,
    syncobjs: BTreeMap<u32, Syncobj>,
    next_syncobj: u32,
}

impl Client {
    fn new_handle(&mut self) -> u32 {
        loop {
            self.next_handle = self.next_handle.wrapping_add(1).max(1);
            if !self.bos.contains_key(&self.next_handle) {
                return self.next_handle;
            }
        }
    }

    fn new_syncobj(&mut self, s: Syncobj) -> u32 {
        loop {
            self.next_syncobj = self.next_syncobj.wrapping_add(1).max(1);
            if !self.syncobjs.contains_key(&self.next_syncobj) {
                self.syncobjs.insert(self.next_syncobj, s);
                return self.next_syncobj;
            }
        }
    }

    /// (memory base in the shim's mapping, guard capacity known) of a BO.
    fn mem(&self, bo: &Bo) -> Option<usize> {
        match bo.kind {
            Kind::Dev { off } => self.heap.as_ref().map(|h| h.backing.ptr + off as usize),
            Kind::Heap => self.heap.as_ref().map(|h| h.backing.ptr),
            Kind::UserPtr => bo.va.map(|v| v as usize),
            _ => bo.backing.as_ref().map(|b| b.ptr),
        }
    }

    /// Device address range of an argument BO.
    fn dev_range(&self, bo: &Bo) -> Option<(u64, u64)> {
        match bo.kind {
            Kind::Dev { off } => Some((DEVM_BASE + off, bo.size)),
            Kind::Heap => Some((DEVM_BASE, HEAP_SIZE)),
            _ => bo.va.map(|va| (va, bo.size)),
        }
    }

    /// Resolves a device address to (BO handle, shim pointer, bytes to the end of the BO) among
    /// the command's argument BOs.
    /// The last field is true for user-pointer BOs, whose memory (the client's) must only be
    /// touched through `uaccess`.
    fn resolve(&self, args: &[u32], addr: u64) -> Option<Resolved> {
        for &h in args {
            let bo = self.bos.get(&h)?;
            if let (Some((base, size)), Some(ptr)) = (self.dev_range(bo), self.mem(bo)) {
                if addr >= base && addr < base + size {
                    return Some((
                        h,
                        ptr + (addr - base) as usize,
                        size - (addr - base),
                        bo.kind == Kind::UserPtr,
                    ));
                }
            }
        }
        None
    }

    fn free_bo(&mut self, bo: Bo) {
        if let (Kind::Dev { off }, Some(heap)) = (bo.kind, self.heap.as_mut()) {
            heap.release(off);
        }
    }
}

/// (BO handle, pointer, bytes to the end of the BO, user-pointer BO).
type Resolved = (u32, usize, u64, bool);

struct DmaBuf {
    offset: u64,
    size: u64,
}

#[derive(Default)]
struct Globals {
    dmabufs: BTreeMap<c_int, DmaBuf>,
    /// dup'ed device fds → the fd their client is keyed by.
    aliases: BTreeMap<c_int, c_int>,
    live_ctx_ids: BTreeSet<u32>,
    next_ctx: u32,
    execs: u64,
    calls: BTreeMap<&'static str, u64>,
    power_mode: u8,
}

struct State {
    clients: BTreeMap<c_int, Client>,
    g: Option<Globals>,
}

thread_local! {
    /// Set while this thread holds the state lock: `munmap`s it makes then (the allocator's)
    /// skip BO tracking, so nothing re-enters the lock.
    static IN_SHIM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// True while the calling thread holds the shim's lock (or its TLS is gone).
pub fn in_shim() -> bool {
    IN_SHIM.try_with(|f| f.get()).unwrap_or(true)
}

/// The state lock, marking this thread as inside the shim while held.
struct Locked(parking_lot::MutexGuard<'static, State>);

impl std::ops::Deref for Locked {
    type Target = State;
    fn deref(&self) -> &State {
        &self.0
    }
}

impl std::ops::DerefMut for Locked {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.0
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        let _ = IN_SHIM.try_with(|f| f.set(false));
    }
}

fn lock() -> Locked {
    let g = STATE.lock();
    let _ = IN_SHIM.try_with(|f| f.set(true));
    Locked(g)
}

/// The client unmapped the BO mapping based at `base`: its device address goes with it (the
/// driver's MMU notifier), the next live mapping's VA takes over.
pub fn unmapped(base: u64) {
    let mut st = lock();
    for c in st.clients.values_mut() {
        for (h, bo) in c.bos.iter_mut() {
            if let Some(i) = bo.maps.iter().position(|&m| m == base) {
                bo.maps.remove(i);
                if bo.va == Some(base) {
                    bo.va = bo.maps.first().copied();
                    log::debug(|| {
                        format!(
                            "BO {h}: mapping at {base:#x} unmapped; device address now {:?}",
                            bo.va
                        )
                    });
                }
            }
        }
        if let Some(hp) = c.heap.as_mut() {
            if let Some(i) = hp.maps.iter().position(|&m| m == base) {
                hp.maps.remove(i);
                if hp.va == Some(base) {
                    hp.va = hp.maps.first().copied();
                }
            }
        }
    }
}

static STATE: Mutex<State> = Mutex::new(State {
    clients: BTreeMap::new(),
    g: None,
});

impl State {
    fn g(&mut self) -> &mut Globals {
        self.g.get_or_insert_with(Globals::default)
    }
}

/// Counts a call of `name` and applies `XDNA_SHIM_IOCTL_ERRNO`.
fn inject(g: &mut Globals, name: &'static str) -> Res<()> {
    let n = {
        let c = g.calls.entry(name).or_insert(0);
        *c += 1;
        *c
    };
    for f in &config::get().ioctl_errno {
        if f.name == name && f.nth.is_none_or(|k| k == n) {
            return fail(
                f.errno,
                name,
                format!("injected by XDNA_SHIM_IOCTL_ERRNO (call {n})"),
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Nodes: device, udmabuf, sysfs

fn new_placeholder_fd(name: &str, flags: c_int) -> Res<c_int> {
    let cname = std::ffi::CString::new(name).map_err(|_| libc::EINVAL)?;
    let mfd = if flags & libc::O_CLOEXEC != 0 {
        libc::MFD_CLOEXEC
    } else {
        0
    };
    // SAFETY: NUL-terminated name; memfd_create is not interposed.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), mfd) };
    if fd < 0 {
        Err(last_errno())
    } else {
        Ok(fd)
    }
}

pub fn open_device(flags: c_int) -> Res<c_int> {
    let mut st = lock();
    inject(st.g(), "OPEN")?;
    let fd = new_placeholder_fd("xdna-shim-accel0", flags)?;
    st.clients.insert(fd, Client::default());
    crate::set_fd_kind(fd, crate::FD_DEVICE);
    log::debug(|| format!("open /dev/accel/accel0 -> fd {fd}"));
    Ok(fd)
}

pub fn open_udmabuf(flags: c_int) -> Res<c_int> {
    let fd = new_placeholder_fd("xdna-shim-udmabuf", flags)?;
    crate::set_fd_kind(fd, crate::FD_UDMABUF);
    Ok(fd)
}

pub fn open_sysfs(contents: &str, flags: c_int) -> Res<c_int> {
    if flags & libc::O_ACCMODE != libc::O_RDONLY {
        return Err(libc::EACCES);
    }
    let fd = new_placeholder_fd("xdna-shim-sysfs", flags)?;
    // SAFETY: writing our own string into the memfd we created, then rewinding it.
    unsafe {
        libc::write(fd, contents.as_ptr().cast(), contents.len());
        libc::lseek(fd, 0, libc::SEEK_SET);
    }
    Ok(fd)
}

static SYSFS: OnceLock<Vec<(String, String)>> = OnceLock::new();

/// Contents of a faked sysfs attribute of the device.
pub fn sysfs_lookup(path: &[u8]) -> Option<&'static str> {
    let table = SYSFS.get_or_init(|| {
        let c = config::get();
        let dev = "/sys/class/accel/accel0/device/";
        let fw = c.fw_version;
        vec![
            (format!("{dev}vbnv"), format!("{}\n", c.vbnv)),
            (format!("{dev}fw_version"), format!("{}.{}.{}.{}\n", fw[0], fw[1], fw[2], fw[3])),
            (format!("{dev}device_type"), format!("{}\n", c.device_type)),
            (format!("{dev}vendor"), format!("0x{:04x}\n", c.vendor)),
            (format!("{dev}device"), format!("0x{:04x}\n", c.device)),
            (format!("{dev}revision"), format!("0x{:02x}\n", c.revision)),
            (
                format!("{dev}uevent"),
                format!("DRIVER=amdxdna\nPCI_CLASS=118000\nPCI_ID={:04X}:{:04X}\nPCI_SLOT_NAME=0000:c5:00.1\n", c.vendor, c.device),
            ),
            ("/sys/class/accel/accel0/dev".into(), format!("{}:0\n", crate::ACCEL_MAJOR)),
            ("/sys/class/accel/accel0/uevent".into(), format!("MAJOR={}\nMINOR=0\nDEVNAME=accel/accel0\n", crate::ACCEL_MAJOR)),
        ]
    });
    let p = std::str::from_utf8(path).ok()?;
    table.iter().find(|(k, _)| k == p).map(|(_, v)| v.as_str())
}

/// `close` of a fake fd: the driver's client cleanup for the device.
/// What one `XDNA_SHIM_STATS` line reports about a client.
struct Snapshot {
    fd: c_int,
    bos: usize,
    ctxs: usize,
    syncobjs: usize,
    execs: u64,
    /// Calls so far of each ioctl (the count `XDNA_SHIM_IOCTL_ERRNO`'s `@N` refers to).
    calls: String,
}

fn calls_json(calls: &BTreeMap<&'static str, u64>) -> String {
    let items: Vec<String> = calls.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    format!("{{{}}}", items.join(","))
}

/// Appends one `XDNA_SHIM_STATS` line; `event` is `close`, `exit` or `exec`.
fn write_stats(s: &Snapshot, event: &str) {
    let Some(path) = config::get().stats.as_ref() else {
        return;
    };
    let line = format!(
        "{{\"pid\":{},\"fd\":{},\"bos\":{},\"contexts\":{},\"syncobjs\":{},\"execs\":{},\"closed\":{},\"event\":\"{event}\",\"calls\":{}}}\n",
        std::process::id(),
        s.fd,
        s.bos,
        s.ctxs,
        s.syncobjs,
        s.execs,
        event == "close",
        s.calls,
    );
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = f.write_all(line.as_bytes());
    }
}

/// At process exit: a stats line (`"closed":false`) for every device fd never closed, so a
/// runtime that leaks its device is visible too. Skipped if another thread holds the lock.
pub fn at_exit() {
    let Some(st) = STATE.try_lock() else {
        return;
    };
    let (execs, calls) =
        st.g.as_ref()
            .map_or((0, String::from("{}")), |g| (g.execs, calls_json(&g.calls)));
    let open: Vec<Snapshot> = st
        .clients
        .iter()
        .map(|(&fd, c)| Snapshot {
            fd,
            bos: c.bos.len(),
            ctxs: c.ctxs.len(),
            syncobjs: c.syncobjs.len(),
            execs,
            calls: calls.clone(),
        })
        .collect();
    drop(st);
    for snap in open {
        write_stats(&snap, "exit");
    }
}

/// `dup` of a fake fd: the new fd refers to the same client (like a dup'ed DRM file) or dma-buf.
pub fn dup_fd(old: c_int, new: c_int, kind: u8) {
    let mut st = lock();
    let g = st.g();
    match kind {
        crate::FD_DEVICE => {
            let primary = g.aliases.get(&old).copied().unwrap_or(old);
            g.aliases.insert(new, primary);
        }
        crate::FD_DMABUF => {
            let Some(w) = g.dmabufs.get(&old) else { return };
            let w = DmaBuf {
                offset: w.offset,
                size: w.size,
            };
            g.dmabufs.insert(new, w);
        }
        _ => return,
    }
    crate::set_fd_kind(new, kind);
}

pub fn release_fd(fd: c_int, kind: u8) {
    let mut st = lock();
    match kind {
        crate::FD_DEVICE => {
            // The DRM file lives until its last fd closes.
            let g = st.g();
            if g.aliases.remove(&fd).is_some() {
                return;
            }
            let heir = g.aliases.iter().find(|(_, &p)| p == fd).map(|(&a, _)| a);
            if let Some(heir) = heir {
                g.aliases.remove(&heir);
                for p in g.aliases.values_mut() {
                    if *p == fd {
                        *p = heir;
                    }
                }
                if let Some(c) = st.clients.remove(&fd) {
                    st.clients.insert(heir, c);
                }
                return;
            }
            let Some(client) = st.clients.remove(&fd) else {
                return;
            };
            let (bos, ctxs, syncobjs) =
                (client.bos.len(), client.ctxs.len(), client.syncobjs.len());
            let g = st.g();
            for id in client.ctxs.keys() {
                g.live_ctx_ids.remove(id);
            }
            let snap = Snapshot {
                fd,
                bos,
                ctxs,
                syncobjs,
                execs: g.execs,
                calls: calls_json(&g.calls),
            };
            drop(st);
            drop(client);
            if bos + ctxs + syncobjs > 0 {
                log::log(&format!("close fd {fd}: releasing {bos} BOs, {ctxs} contexts, {syncobjs} syncobjs still alive"));
            }
            write_stats(&snap, "close");
        }
        crate::FD_DMABUF => {
            st.g().dmabufs.remove(&fd);
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// mmap

#[allow(clippy::too_many_arguments)]
pub fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    kind: u8,
    off: i64,
) -> Res<*mut c_void> {
    let off = off as u64;
    let do_map = |backing_fd: c_int, file_off: u64| -> Res<*mut c_void> {
        // SAFETY: mapping a memfd the shim owns, with the caller's address/protection/flags.
        let p = unsafe { real::mmap(addr, len, prot, flags, backing_fd, file_off as libc::off_t) };
        if p == libc::MAP_FAILED {
            Err(last_errno())
        } else {
            Ok(p)
        }
    };
    let mut st = lock();
    match kind {
        crate::FD_DMABUF => {
            let Some(w) = st.g().dmabufs.get(&fd) else {
                return Err(libc::EINVAL);
            };
            if !off.is_multiple_of(PAGE) || off + len as u64 > round_up(w.size, PAGE) {
                return fail(
                    libc::EINVAL,
                    "MMAP(dma-buf)",
                    format!("offset {off:#x} + {len} outside the {}-byte buffer", w.size),
                );
            }
            // The dma-buf fd is a dup of the memfd: same file, window at `offset`.
            do_map(fd, w.offset + off)
        }
        crate::FD_DEVICE => {
            inject(st.g(), "MMAP")?;
            let fd = st.g().aliases.get(&fd).copied().unwrap_or(fd);
            let Some(c) = st.clients.get_mut(&fd) else {
                return Err(libc::EBADF);
            };
            let handle = (off >> 32) as u32;
            let sub = off & 0xffff_ffff;
            let Some(bo) = c.bos.get(&handle) else {
                return fail(
                    libc::EINVAL,
                    "MMAP",
                    format!("no BO at map offset {off:#x} (use GET_BO_INFO.map_offset)"),
                );
            };
            if matches!(bo.kind, Kind::Dev { .. }) {
                return fail(libc::EINVAL, "MMAP", format!("BO {handle} is a DEV BO: it has no map_offset; access it through the heap mapping"));
            }
            if bo.kind == Kind::UserPtr {
                return fail(
                    libc::EINVAL,
                    "MMAP",
                    format!("BO {handle} is a user-pointer BO: use the memory it was created from"),
                );
            }
            if flags & libc::MAP_SHARED == 0 {
                return fail(libc::EINVAL, "MMAP", "BO mappings must be MAP_SHARED");
            }
            if !sub.is_multiple_of(PAGE) || sub + len as u64 > round_up(bo.size, PAGE) {
                return fail(
                    libc::EINVAL,
                    "MMAP",
                    format!(
                        "offset {sub:#x} + length {len} exceeds BO {handle} ({} bytes)",
                        bo.size
                    ),
                );
            }
            let (bfd, boff) = match (&bo.backing, &c.heap) {
                (Some(b), _) => (b.fd, b.fd_off),
                (None, Some(h)) if bo.kind == Kind::Heap => (h.backing.fd, 0),
                _ => return Err(libc::EINVAL),
            };
            let p = do_map(bfd, boff + sub)?;
            let va = p as u64 - sub;
            let is_heap = bo.kind == Kind::Heap;
            if let Some(bo) = c.bos.get_mut(&handle) {
                bo.va.get_or_insert(va);
                bo.maps.push(va);
            }
            if is_heap {
                if let Some(h) = c.heap.as_mut() {
                    h.va.get_or_insert(va);
                    h.maps.push(va);
                }
            }
            if !crate::maps::register(p as u64, len as u64, va) {
                log::debug(|| "mapping table full: this mapping's munmap is not tracked".into());
            }
            log::debug(|| format!("mmap BO {handle} at {p:p} (+{sub:#x}, {len} bytes)"));
            Ok(p)
        }
        _ => Err(libc::ENODEV),
    }
}

// ---------------------------------------------------------------------------------------------
// ioctl dispatch

const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;
const RW: u32 = IOC_WRITE | IOC_READ;

type Handler = fn(&mut State, c_int, &mut [u8]) -> Res<c_int>;

struct Def {
    name: &'static str,
    size: usize,
    dir: u32,
    handler: Handler,
}

fn lookup(nr: u32) -> Option<Def> {
    use std::mem::size_of;
    use xdna::ffi::{self, nr};
    let d = |name, size, dir, handler: Handler| {
        Some(Def {
            name,
            size,
            dir,
            handler,
        })
    };
    let nr = u8::try_from(nr).ok()?;
    match nr {
        nr::VERSION => d("VERSION", size_of::<ffi::drm_version>(), RW, drm_version),
        nr::GEM_CLOSE => d(
            "GEM_CLOSE",
            size_of::<ffi::drm_gem_close>(),
            IOC_WRITE,
            gem_close,
        ),
        nr::GET_CAP => d("GET_CAP", size_of::<ffi::drm_get_cap>(), RW, get_cap),
        nr::PRIME_HANDLE_TO_FD => d(
            "PRIME_HANDLE_TO_FD",
            size_of::<ffi::drm_prime_handle>(),
            RW,
            prime_handle_to_fd,
        ),
        nr::PRIME_FD_TO_HANDLE => d(
            "PRIME_FD_TO_HANDLE",
            size_of::<ffi::drm_prime_handle>(),
            RW,
            prime_fd_to_handle,
        ),
        nr::SYNCOBJ_CREATE => d(
            "SYNCOBJ_CREATE",
            size_of::<ffi::drm_syncobj_create>(),
            RW,
            syncobj_create,
        ),
        nr::SYNCOBJ_DESTROY => d(
            "SYNCOBJ_DESTROY",
            size_of::<ffi::drm_syncobj_destroy>(),
            RW,
            syncobj_destroy,
        ),
        nr::SYNCOBJ_WAIT => d(
            "SYNCOBJ_WAIT",
            size_of::<ffi::drm_syncobj_wait>(),
            RW,
            syncobj_wait,
        ),
        nr::SYNCOBJ_EVENTFD => d(
            "SYNCOBJ_EVENTFD",
            size_of::<ffi::drm_syncobj_eventfd>(),
            RW,
            syncobj_eventfd,
        ),
        // drm_syncobj_array {handles u64, count_handles u32, pad u32} (not in ffi).
        SYNCOBJ_RESET_NR => d("SYNCOBJ_RESET", 16, RW, syncobj_reset),
        SYNCOBJ_SIGNAL_NR => d("SYNCOBJ_SIGNAL", 16, RW, syncobj_signal),
        nr::SYNCOBJ_TIMELINE_WAIT => d(
            "SYNCOBJ_TIMELINE_WAIT",
            size_of::<ffi::drm_syncobj_timeline_wait>(),
            RW,
            syncobj_timeline_wait,
        ),
        nr::SYNCOBJ_QUERY => d(
            "SYNCOBJ_QUERY",
            size_of::<ffi::drm_syncobj_timeline_array>(),
            RW,
            syncobj_query,
        ),
        nr::SYNCOBJ_TIMELINE_SIGNAL => d(
            "SYNCOBJ_TIMELINE_SIGNAL",
            size_of::<ffi::drm_syncobj_timeline_array>(),
            RW,
            syncobj_timeline_signal,
        ),
        nr::AMDXDNA_CREATE_HWCTX => d(
            "CREATE_HWCTX",
            size_of::<ffi::amdxdna_drm_create_hwctx>(),
            RW,
            create_hwctx,
        ),
        nr::AMDXDNA_DESTROY_HWCTX => d(
            "DESTROY_HWCTX",
            size_of::<ffi::amdxdna_drm_destroy_hwctx>(),
            RW,
            destroy_hwctx,
        ),
        nr::AMDXDNA_CONFIG_HWCTX => d(
            "CONFIG_HWCTX",
            size_of::<ffi::amdxdna_drm_config_hwctx>(),
            RW,
            config_hwctx,
        ),
        nr::AMDXDNA_CREATE_BO => d(
            "CREATE_BO",
            size_of::<ffi::amdxdna_drm_create_bo>(),
            RW,
            create_bo,
        ),
        nr::AMDXDNA_GET_BO_INFO => d(
            "GET_BO_INFO",
            size_of::<ffi::amdxdna_drm_get_bo_info>(),
            RW,
            get_bo_info,
        ),
        nr::AMDXDNA_SYNC_BO => d(
            "SYNC_BO",
            size_of::<ffi::amdxdna_drm_sync_bo>(),
            RW,
            sync_bo,
        ),
        nr::AMDXDNA_EXEC_CMD => d(
            "EXEC_CMD",
            size_of::<ffi::amdxdna_drm_exec_cmd>(),
            RW,
            exec_cmd,
        ),
        nr::AMDXDNA_GET_INFO => d(
            "GET_INFO",
            size_of::<ffi::amdxdna_drm_get_info>(),
            RW,
            get_info,
        ),
        nr::AMDXDNA_SET_STATE => d(
            "SET_STATE",
            size_of::<ffi::amdxdna_drm_set_state>(),
            RW,
            set_state,
        ),
        nr::AMDXDNA_WAIT_CMD => {
            // Upstream declares it IOW, the OOT driver IOWR.
            let dir = if config::get().driver_major == 1 {
                RW
            } else {
                IOC_WRITE
            };
            d(
                "WAIT_CMD",
                size_of::<ffi::amdxdna_drm_wait_cmd>(),
                dir,
                wait_cmd,
            )
        }
        nr::AMDXDNA_GET_ARRAY => d(
            "GET_ARRAY",
            size_of::<ffi::amdxdna_drm_get_array>(),
            RW,
            get_array,
        ),
        _ => None,
    }
}

const SYNCOBJ_RESET_NR: u8 = 0xC4;
const SYNCOBJ_SIGNAL_NR: u8 = 0xC5;

pub fn ioctl(fd: c_int, kind: u8, req: u64, arg: u64) -> Res<c_int> {
    let ty = ((req >> 8) & 0xff) as u8;
    let nr = (req & 0xff) as u32;
    let usize_ = ((req >> 16) & 0x3fff) as usize;
    let dir = ((req >> 30) & 3) as u32;
    match kind {
        crate::FD_UDMABUF => return udmabuf_ioctl(req, arg),
        // DMA_BUF_IOCTL_SYNC: nothing to do for memfd-backed buffers.
        crate::FD_DMABUF if ty == b'b' && nr == 0 => return Ok(0),
        crate::FD_DEVICE => {}
        _ => return Err(libc::ENOTTY),
    }
    if ty != b'd' {
        return fail(
            libc::ENOTTY,
            "ioctl",
            format!("request {req:#x} is not a DRM ioctl"),
        );
    }
    let Some(def) = lookup(nr) else {
        return fail(
            libc::EINVAL,
            "ioctl",
            format!("unhandled DRM ioctl nr {nr:#x} (request {req:#x})"),
        );
    };
    // DRM core: copy min(user, kernel) in, zero-extend, copy the user's size back out.
    let in_size = if dir & def.dir & IOC_WRITE != 0 {
        usize_
    } else {
        0
    };
    let out_size = if dir & def.dir & IOC_READ != 0 {
        usize_
    } else {
        0
    };
    let mut buf = vec![0u8; def.size.max(in_size).max(out_size)];
    let input = uaccess::read(arg, in_size)
        .or_else(|e| fail(e, def.name, "argument struct not readable"))?;
    buf[..in_size].copy_from_slice(&input);
    let mut st = lock();
    let fd = st.g().aliases.get(&fd).copied().unwrap_or(fd);
    inject(st.g(), def.name)?;
    if !st.clients.contains_key(&fd) {
        return Err(libc::EBADF);
    }
    log::debug(|| format!("{} fd {fd}", def.name));
    let ret = (def.handler)(&mut st, fd, &mut buf)?;
    drop(st);
    uaccess::write(arg, &buf[..out_size])
        .or_else(|e| fail(e, def.name, "argument struct not writable"))?;
    Ok(ret)
}

/// Splits the state into the calling client and the globals.
fn parts(st: &mut State, fd: c_int) -> Res<(&mut Client, &mut Globals)> {
    let State { clients, g } = st;
    let c = clients.get_mut(&fd).ok_or(libc::EBADF)?;
    Ok((c, g.get_or_insert_with(Globals::default)))
}

fn mbz(name: &str, b: &[u8], fields: &[(usize, usize, &str)]) -> Res<()> {
    for &(o, len, field) in fields {
        if b[o..o + len].iter().any(|&x| x != 0) {
            return fail(libc::EINVAL, name, format!("{field} must be zero"));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// DRM core ioctls

fn drm_version(_st: &mut State, _fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let c = config::get();
    p32(b, 0, c.driver_major as u32);
    p32(b, 4, c.driver_minor as u32);
    p32(b, 8, 0);
    let strings: [(usize, &str); 3] = [
        (16, "amdxdna_accel_driver"),
        (32, "20240124"),
        (48, "AMD XDNA DRM implementation"),
    ];
    for (o, s) in strings {
        let len = g64(b, o) as usize;
        let ptr = g64(b, o + 8);
        if ptr != 0 && len > 0 {
            uaccess::write(ptr, &s.as_bytes()[..len.min(s.len())])
                .or_else(|e| fail(e, "VERSION", "string buffer not writable"))?;
        }
        p64(b, o, s.len() as u64);
    }
    Ok(0)
}

fn get_cap(_st: &mut State, _fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let v = match g64(b, 0) {
        0x5 => 3,         // DRM_CAP_PRIME: IMPORT | EXPORT
        0x13 | 0x14 => 1, // SYNCOBJ, SYNCOBJ_TIMELINE
        cap => {
            return fail(
                libc::EINVAL,
                "GET_CAP",
                format!("capability {cap:#x} not reported by amdxdna"),
            )
        }
    };
    p64(b, 8, v);
    Ok(0)
}

fn gem_close(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    mbz("GEM_CLOSE", b, &[(4, 4, "pad")])?;
    let h = g32(b, 0);
    let Some(bo) = c.bos.remove(&h) else {
        return fail(libc::EINVAL, "GEM_CLOSE", format!("no BO handle {h}"));
    };
    c.free_bo(bo);
    Ok(0)
}

fn prime_handle_to_fd(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, g) = parts(st, fd)?;
    let (h, flags) = (g32(b, 0), g32(b, 4) as c_int);
    if flags & !(libc::O_CLOEXEC | libc::O_RDWR) != 0 {
        return fail(
            libc::EINVAL,
            "PRIME_HANDLE_TO_FD",
            format!("flags {flags:#x}: only DRM_CLOEXEC|DRM_RDWR"),
        );
    }
    let Some(bo) = c.bos.get(&h) else {
        return fail(
            libc::ENOENT,
            "PRIME_HANDLE_TO_FD",
            format!("no BO handle {h}"),
        );
    };
    let backing = match (bo.kind, &bo.backing, &c.heap) {
        (Kind::Dev { .. } | Kind::UserPtr, _, _) => {
            return fail(
                libc::EOPNOTSUPP,
                "PRIME_HANDLE_TO_FD",
                format!(
                    "BO {h} is a {} BO, which cannot be exported",
                    bo.kind.name()
                ),
            )
        }
        (_, Some(bk), _) => bk,
        (Kind::Heap, None, Some(heap)) => &heap.backing,
        _ => return Err(libc::EINVAL),
    };
    let nfd = backing.dup(flags & libc::O_CLOEXEC != 0)?;
    g.dmabufs.insert(
        nfd,
        DmaBuf {
            offset: backing.fd_off,
            size: bo.size,
        },
    );
    crate::set_fd_kind(nfd, crate::FD_DMABUF);
    p32(b, 8, nfd as u32);
    Ok(0)
}

/// Imports a dma-buf (a memfd, a shim udmabuf or an exported BO) as a SHARE BO.
fn import(c: &mut Client, g: &Globals, dfd: c_int, what: &str) -> Res<u32> {
    let (offset, size) = match crate::fd_kind(dfd) {
        crate::FD_DMABUF => match g.dmabufs.get(&dfd) {
            Some(w) => (w.offset, w.size),
            None => return Err(libc::EINVAL),
        },
        crate::FD_NONE => {
            // SAFETY: an all-zero struct stat is valid; fstat fills it.
            let mut s: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: real fstat into a live local.
            if dfd < 0 || unsafe { real::fstat(dfd, &mut s) } != 0 {
                return fail(libc::EBADF, what, format!("fd {dfd} is not open"));
            }
            if s.st_mode & libc::S_IFMT != libc::S_IFREG {
                return fail(
                    libc::EINVAL,
                    what,
                    format!("fd {dfd} is not a dma-buf the shim can import (memfd/udmabuf)"),
                );
            }
            (0, s.st_size as u64)
        }
        _ => return fail(libc::EINVAL, what, format!("fd {dfd} is not a dma-buf")),
    };
    if size == 0 {
        return fail(libc::EINVAL, what, "empty dma-buf");
    }
    // SAFETY: fcntl dup of a caller-provided fd (checked open above).
    let nfd = unsafe { real::fcntl(dfd, libc::F_DUPFD_CLOEXEC, 0) };
    if nfd < 0 {
        return Err(last_errno());
    }
    let backing = Backing::map(nfd, round_up(size, PAGE) as usize, offset)?;
    let h = c.new_handle();
    c.bos.insert(
        h,
        Bo {
            kind: Kind::Imported,
            size,
            backing: Some(backing),
            va: None,
            maps: Vec::new(),
            guarded: false,
        },
    );
    Ok(h)
}

fn prime_fd_to_handle(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, g) = parts(st, fd)?;
    let h = import(c, g, g32(b, 8) as c_int, "PRIME_FD_TO_HANDLE")?;
    p32(b, 0, h);
    Ok(0)
}

// ---------------------------------------------------------------------------------------------
// syncobjs

const WAIT_ALL: u32 = 1;
const WAIT_FOR_SUBMIT: u32 = 2;
const WAIT_AVAILABLE: u32 = 4;
const WAIT_DEADLINE: u32 = 8;

fn syncobj_create(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    let flags = g32(b, 4);
    if flags & !1 != 0 {
        return fail(libc::EINVAL, "SYNCOBJ_CREATE", format!("flags {flags:#x}"));
    }
    let h = c.new_syncobj(Syncobj {
        signalled: (flags & 1 != 0).then_some(0),
        waiters: Vec::new(),
    });
    p32(b, 0, h);
    Ok(0)
}

fn syncobj_destroy(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    mbz("SYNCOBJ_DESTROY", b, &[(4, 4, "pad")])?;
    let h = g32(b, 0);
    if c.syncobjs.remove(&h).is_none() {
        return fail(
            libc::EINVAL,
            "SYNCOBJ_DESTROY",
            format!("no syncobj handle {h}"),
        );
    }
    Ok(0)
}

fn syncobj_eventfd(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    mbz("SYNCOBJ_EVENTFD", b, &[(20, 4, "pad")])?;
    let (h, flags, point, efd) = (g32(b, 0), g32(b, 4), g64(b, 8), g32(b, 16) as c_int);
    if flags & !WAIT_AVAILABLE != 0 {
        return fail(libc::EINVAL, "SYNCOBJ_EVENTFD", format!("flags {flags:#x}"));
    }
    let Some(s) = c.syncobjs.get_mut(&h) else {
        return fail(
            libc::ENOENT,
            "SYNCOBJ_EVENTFD",
            format!("no syncobj handle {h}"),
        );
    };
    // SAFETY: fcntl dup of the caller's fd (EBADF if it is not open).
    let dup = unsafe { real::fcntl(efd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return fail(
            libc::EBADF,
            "SYNCOBJ_EVENTFD",
            format!("fd {efd} is not open"),
        );
    }
    if s.signalled.is_some_and(|sig| point <= sig) {
        fire_eventfd(dup);
    } else {
        s.waiters.push((point, dup));
    }
    Ok(0)
}

fn read_handles(name: &str, ptr: u64, count: u32) -> Res<Vec<u32>> {
    if count == 0 {
        return fail(libc::EINVAL, name, "count_handles is 0");
    }
    let raw = uaccess::read(ptr, count as usize * 4)
        .or_else(|e| fail(e, name, "handle array not readable"))?;
    Ok(raw.chunks(4).map(|w| g32(w, 0)).collect())
}

/// Common wait: `points` None = binary wait.
fn wait_common(
    c: &Client,
    name: &str,
    handles: &[u32],
    points: Option<&[u64]>,
    flags: u32,
) -> Res<u32> {
    if flags & !(WAIT_ALL | WAIT_FOR_SUBMIT | WAIT_AVAILABLE | WAIT_DEADLINE) != 0 {
        return fail(libc::EINVAL, name, format!("flags {flags:#x}"));
    }
    let mut first = None;
    let mut all = true;
    for (i, h) in handles.iter().enumerate() {
        let Some(s) = c.syncobjs.get(h) else {
            return fail(libc::ENOENT, name, format!("no syncobj handle {h}"));
        };
        let point = points.map_or(0, |p| p[i]);
        let done = s.signalled.is_some_and(|sig| point <= sig);
        if done {
            first.get_or_insert(i as u32);
        } else {
            all = false;
            if s.signalled.is_none() && flags & WAIT_FOR_SUBMIT == 0 {
                return fail(
                    libc::EINVAL,
                    name,
                    format!(
                        "syncobj {h} has no fence (pass WAIT_FOR_SUBMIT to wait for a submission)"
                    ),
                );
            }
        }
    }
    let ok = if flags & WAIT_ALL != 0 {
        all
    } else {
        first.is_some()
    };
    if !ok {
        // Commands run synchronously: a point not signalled now was never submitted.
        log::debug(|| format!("{name}: points {points:?} of {handles:?} never submitted: ETIME"));
        return Err(libc::ETIME);
    }
    Ok(first.unwrap_or(0))
}

fn syncobj_wait(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    let handles = read_handles("SYNCOBJ_WAIT", g64(b, 0), g32(b, 16))?;
    let first = wait_common(c, "SYNCOBJ_WAIT", &handles, None, g32(b, 20))?;
    p32(b, 24, first);
    Ok(0)
}

fn syncobj_timeline_wait(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    let count = g32(b, 24);
    let handles = read_handles("SYNCOBJ_TIMELINE_WAIT", g64(b, 0), count)?;
    let raw = uaccess::read(g64(b, 8), count as usize * 8)
        .or_else(|e| fail(e, "SYNCOBJ_TIMELINE_WAIT", "points array not readable"))?;
    let points: Vec<u64> = raw.chunks(8).map(|w| g64(w, 0)).collect();
    let first = wait_common(
        c,
        "SYNCOBJ_TIMELINE_WAIT",
        &handles,
        Some(&points),
        g32(b, 28),
    )?;
    p32(b, 32, first);
    Ok(0)
}

fn syncobj_query(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    let count = g32(b, 16);
    let handles = read_handles("SYNCOBJ_QUERY", g64(b, 0), count)?;
    let mut out = Vec::with_capacity(handles.len() * 8);
    for h in &handles {
        let Some(s) = c.syncobjs.get(h) else {
            return fail(
                libc::ENOENT,
                "SYNCOBJ_QUERY",
                format!("no syncobj handle {h}"),
            );
        };
        out.extend_from_slice(&s.signalled.unwrap_or(0).to_le_bytes());
    }
    uaccess::write(g64(b, 8), &out)
        .or_else(|e| fail(e, "SYNCOBJ_QUERY", "points array not writable"))?;
    Ok(0)
}

fn syncobj_timeline_signal(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    let count = g32(b, 16);
    let handles = read_handles("SYNCOBJ_TIMELINE_SIGNAL", g64(b, 0), count)?;
    let raw = uaccess::read(g64(b, 8), count as usize * 8)
        .or_else(|e| fail(e, "SYNCOBJ_TIMELINE_SIGNAL", "points array not readable"))?;
    for (i, h) in handles.iter().enumerate() {
        let p = g64(&raw, i * 8);
        let Some(s) = c.syncobjs.get_mut(h) else {
            return fail(
                libc::ENOENT,
                "SYNCOBJ_TIMELINE_SIGNAL",
                format!("no syncobj handle {h}"),
            );
        };
        s.signal(p);
    }
    Ok(0)
}

fn syncobj_signal(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    for h in read_handles("SYNCOBJ_SIGNAL", g64(b, 0), g32(b, 8))? {
        let Some(s) = c.syncobjs.get_mut(&h) else {
            return fail(
                libc::ENOENT,
                "SYNCOBJ_SIGNAL",
                format!("no syncobj handle {h}"),
            );
        };
        s.signal(s.signalled.unwrap_or(0));
    }
    Ok(0)
}

fn syncobj_reset(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    for h in read_handles("SYNCOBJ_RESET", g64(b, 0), g32(b, 8))? {
        let Some(s) = c.syncobjs.get_mut(&h) else {
            return fail(
                libc::ENOENT,
                "SYNCOBJ_RESET",
                format!("no syncobj handle {h}"),
            );
        };
        s.signalled = None;
    }
    Ok(0)
}

// ---------------------------------------------------------------------------------------------
// amdxdna: BOs

/// CREATE_BO SHARE with va_tbl {dmabuf_fd -1, entries}: a BO over the client's own pages. Entries
/// must be page-aligned, non-empty and (PASID mode) form one contiguous VA range; the device
/// address is the first entry's VA.
fn user_ptr_bo(c: &mut Client, tbl: u64, n: u32, size: u64) -> Res<u32> {
    const W: &str = "CREATE_BO(user pointer)";
    if n == 0 || n > 1024 {
        return fail(libc::EINVAL, W, format!("{n} va_tbl entries (1..=1024)"));
    }
    let raw = uaccess::read(tbl + 8, n as usize * 16)
        .or_else(|e| fail(e, W, "va_tbl entries not readable"))?;
    let first = g64(&raw, 0);
    let mut total = 0u64;
    for i in 0..n as usize {
        let (va, len) = (g64(&raw, 16 * i), g64(&raw, 16 * i + 8));
        if len == 0 || !va.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) {
            return fail(
                libc::EINVAL,
                W,
                format!("entry {i} ({va:#x}, {len:#x}) must be page-aligned and non-empty"),
            );
        }
        if va != first + total {
            return fail(libc::EINVAL, W, format!("entry {i} at {va:#x} does not continue the range (PASID mode needs one contiguous VA range)"));
        }
        total += len;
    }
    if size != 0 && size != total {
        return fail(
            libc::EINVAL,
            W,
            format!("size {size} != the entries' {total} bytes (pass 0)"),
        );
    }
    // The driver pins the pages (EFAULT if they are not mapped).
    uaccess::read(first, 1)
        .and_then(|_| uaccess::read(first + total - 1, 1))
        .or_else(|e| fail(e, W, format!("range {first:#x}+{total:#x} is not mapped")))?;
    let h = c.new_handle();
    c.bos.insert(
        h,
        Bo {
            kind: Kind::UserPtr,
            size: total,
            backing: None,
            va: Some(first),
            maps: Vec::new(),
            guarded: false,
        },
    );
    Ok(h)
}

fn create_bo(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, g) = parts(st, fd)?;
    let (flags, vaddr, size, ty) = (g64(b, 0), g64(b, 8), g64(b, 16), g32(b, 24));
    let allowed_flags = if config::get().driver_major == 1 {
        0xff
    } else {
        0
    };
    if flags & !allowed_flags != 0 {
        return fail(
            libc::EINVAL,
            "CREATE_BO",
            format!("flags {flags:#x} must be zero"),
        );
    }
    if vaddr != 0 && ty != BO_SHARE {
        return fail(
            libc::EINVAL,
            "CREATE_BO",
            "vaddr (va_tbl) is only valid for SHARE BOs",
        );
    }
    let h = match ty {
        BO_SHARE if vaddr != 0 && !feature_level(1) => {
            return fail(
                libc::EINVAL,
                "CREATE_BO",
                "vaddr must be zero (driver 0.0 has no va_tbl)",
            );
        }
        BO_SHARE if vaddr != 0 => {
            let tbl =
                uaccess::read(vaddr, 8).or_else(|e| fail(e, "CREATE_BO", "va_tbl not readable"))?;
            let (dfd, n) = (g32(&tbl, 0) as i32, g32(&tbl, 4));
            if dfd >= 0 && n == 0 {
                import(c, g, dfd, "CREATE_BO(va_tbl)")?
            } else if dfd == -1 {
                user_ptr_bo(c, vaddr, n, size)?
            } else {
                return fail(
                    libc::EINVAL,
                    "CREATE_BO",
                    format!("va_tbl dmabuf_fd {dfd} with {n} entries"),
                );
            }
        }
        BO_SHARE | BO_CMD => {
            if size == 0 || (ty == BO_CMD && size < 4) {
                return fail(libc::EINVAL, "CREATE_BO", format!("invalid size {size}"));
            }
            let h = c.new_handle();
            let backing = Backing::memfd(&format!("xdna-bo-{h}"), round_up(size + GUARD_LEN, PAGE))
                .or_else(|e| fail(e, "CREATE_BO", "memfd allocation failed"))?;
            write_guard(backing.ptr, size);
            let kind = if ty == BO_CMD { Kind::Cmd } else { Kind::Share };
            c.bos.insert(
                h,
                Bo {
                    kind,
                    size,
                    backing: Some(backing),
                    va: None,
                    maps: Vec::new(),
                    guarded: true,
                },
            );
            h
        }
        BO_DEV_HEAP => {
            if size != HEAP_SIZE {
                return fail(
                    libc::EINVAL,
                    "CREATE_BO",
                    format!("DEV_HEAP size {size} must be 64 MiB (67108864)"),
                );
            }
            if c.heap.is_some() {
                return fail(libc::EBUSY, "CREATE_BO", "this client already has a device heap (one 64 MiB heap per fd; expandable heaps are not emulated)");
            }
            let h = c.new_handle();
            let backing = Backing::memfd(&format!("xdna-heap-{h}"), HEAP_SIZE)
                .or_else(|e| fail(e, "CREATE_BO", "memfd allocation failed"))?;
            c.heap = Some(Heap {
                backing,
                va: None,
                maps: Vec::new(),
                allocs: BTreeMap::new(),
            });
            c.bos.insert(
                h,
                Bo {
                    kind: Kind::Heap,
                    size,
                    backing: None,
                    va: None,
                    maps: Vec::new(),
                    guarded: false,
                },
            );
            h
        }
        BO_DEV => {
            if size == 0 {
                return fail(libc::EINVAL, "CREATE_BO", "invalid size 0");
            }
            let Some(heap) = c.heap.as_mut() else {
                return fail(
                    libc::EINVAL,
                    "CREATE_BO",
                    "DEV BO without a device heap: create the 64 MiB DEV_HEAP BO and mmap it first",
                );
            };
            if heap.va.is_none() {
                return fail(libc::EAGAIN, "CREATE_BO", "heap is not mapped: mmap the DEV_HEAP BO (GET_BO_INFO.map_offset) before allocating DEV BOs");
            }
            let Some(off) = heap.alloc(size) else {
                return fail(
                    libc::EAGAIN,
                    "CREATE_BO",
                    format!("no room for {size} bytes in the 64 MiB heap"),
                );
            };
            write_guard(heap.backing.ptr + off as usize, size);
            let h = c.new_handle();
            c.bos.insert(
                h,
                Bo {
                    kind: Kind::Dev { off },
                    size,
                    backing: None,
                    va: None,
                    maps: Vec::new(),
                    guarded: true,
                },
            );
            h
        }
        _ => return fail(libc::EINVAL, "CREATE_BO", format!("Invalid BO type {ty}")),
    };
    log::debug(|| format!("CREATE_BO type {ty} size {size} -> handle {h}"));
    p32(b, 28, h);
    Ok(0)
}

fn get_bo_info(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    mbz(
        "GET_BO_INFO",
        b,
        &[(0, 8, "ext"), (8, 8, "ext_flags"), (20, 4, "pad")],
    )?;
    let h = g32(b, 16);
    let Some(bo) = c.bos.get(&h) else {
        return fail(libc::ENOENT, "GET_BO_INFO", format!("no BO handle {h}"));
    };
    let heap_va = c.heap.as_ref().and_then(|hp| hp.va);
    let (map_offset, vaddr, xdna) = match bo.kind {
        Kind::Dev { off } => (
            INVALID,
            heap_va.map_or(INVALID, |v| v + off),
            DEVM_BASE + off,
        ),
        Kind::Heap => ((h as u64) << 32, heap_va.unwrap_or(INVALID), DEVM_BASE),
        Kind::UserPtr => (INVALID, bo.va.unwrap_or(INVALID), bo.va.unwrap_or(INVALID)),
        _ => (
            (h as u64) << 32,
            bo.va.unwrap_or(INVALID),
            bo.va.unwrap_or(INVALID),
        ),
    };
    p64(b, 24, map_offset);
    p64(b, 32, vaddr);
    p64(b, 40, xdna);
    Ok(0)
}

fn sync_bo(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    let (h, dir, off, size) = (g32(b, 0), g32(b, 4), g64(b, 8), g64(b, 16));
    let Some(bo) = c.bos.get(&h) else {
        return fail(libc::ENOENT, "SYNC_BO", format!("no BO handle {h}"));
    };
    if dir > 1 {
        return fail(
            libc::EINVAL,
            "SYNC_BO",
            format!("direction {dir} (0 = TO_DEVICE, 1 = FROM_DEVICE)"),
        );
    }
    if off.checked_add(size).is_none_or(|end| end > bo.size) {
        return fail(
            libc::EINVAL,
            "SYNC_BO",
            format!(
                "range {off:#x}+{size:#x} outside BO {h} ({} bytes)",
                bo.size
            ),
        );
    }
    Ok(0)
}

// ---------------------------------------------------------------------------------------------
// amdxdna: contexts

fn create_hwctx(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let cfg = config::get();
    let (c, g) = parts(st, fd)?;
    mbz("CREATE_HWCTX", b, &[(0, 8, "ext"), (8, 8, "ext_flags")])?;
    let qos_len = if cfg.driver_major == 1 { 32 } else { 24 };
    uaccess::read(g64(b, 16), qos_len).or_else(|e| fail(e, "CREATE_HWCTX", format!("qos_p must point to a readable {qos_len}-byte amdxdna_qos_info (pass 32 zeroed bytes, user_start_col 0xFF)")))?;
    let Some(heap) = c.heap.as_mut() else {
        return fail(
            libc::ENOENT,
            "CREATE_HWCTX",
            "The client dev heap object not exist: create the 64 MiB DEV_HEAP BO and mmap it before creating a hardware context",
        );
    };
    if heap.va.is_none() {
        return fail(libc::EINVAL, "CREATE_HWCTX", "Map host buffer failed: the device heap is not mmapped (mmap the DEV_HEAP BO before creating a context)");
    }
    let num_tiles = g32(b, 36);
    let cols = num_tiles / cfg.core_rows as u32;
    if cols == 0 || cols > cfg.columns as u32 {
        return fail(
            libc::EINVAL,
            "CREATE_HWCTX",
            format!("Invalid num_col {cols} (num_tiles {num_tiles} / {} core rows); pass ncols × core_rows with 1 ≤ ncols ≤ {}", cfg.core_rows, cfg.columns),
        );
    }
    if g.live_ctx_ids.len() as u32 >= cfg.context_limit {
        return fail(
            libc::EBUSY,
            "CREATE_HWCTX",
            format!(
                "hardware context limit reached ({} contexts; QUERY_RESOURCE_INFO.npu_task_max)",
                cfg.context_limit
            ),
        );
    }
    let Some(reserve_off) = heap.alloc(HWCTX_RESERVE - GUARD_LEN) else {
        return fail(
            libc::ENOMEM,
            "CREATE_HWCTX",
            "no heap left for the context's command staging buffers",
        );
    };
    let id = loop {
        g.next_ctx = if g.next_ctx >= 1024 {
            1
        } else {
            g.next_ctx + 1
        };
        if !g.live_ctx_ids.contains(&g.next_ctx) {
            break g.next_ctx;
        }
    };
    g.live_ctx_ids.insert(id);
    let syncobj = c.new_syncobj(Syncobj::default());
    c.ctxs.insert(
        id,
        Ctx {
            syncobj,
            next_seq: 0,
            cus: Vec::new(),
            reserve_off,
            num_col: cols,
            submissions: 0,
            completions: 0,
            errors: 0,
        },
    );
    p32(b, 48, id);
    p32(b, 52, syncobj);
    log::debug(|| format!("CREATE_HWCTX {cols} columns -> ctx {id}, syncobj {syncobj}"));
    Ok(0)
}

fn destroy_hwctx(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, g) = parts(st, fd)?;
    mbz("DESTROY_HWCTX", b, &[(4, 4, "pad")])?;
    let h = g32(b, 0);
    let Some(ctx) = c.ctxs.remove(&h) else {
        return fail(
            libc::EINVAL,
            "DESTROY_HWCTX",
            format!("no hardware context {h}"),
        );
    };
    g.live_ctx_ids.remove(&h);
    if let Some(heap) = c.heap.as_mut() {
        heap.release(ctx.reserve_off);
        for &(_, off) in &ctx.cus {
            heap.release(off);
        }
    }
    Ok(0)
}

fn config_hwctx(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, _) = parts(st, fd)?;
    mbz("CONFIG_HWCTX", b, &[(20, 4, "pad")])?;
    let (h, ty, val, size) = (g32(b, 0), g32(b, 4), g64(b, 8), g32(b, 16));
    if !c.ctxs.contains_key(&h) {
        return fail(
            libc::EINVAL,
            "CONFIG_HWCTX",
            format!("no hardware context {h}"),
        );
    }
    match ty {
        0 => {}
        1 | 2 => {
            return fail(
                libc::EOPNOTSUPP,
                "CONFIG_HWCTX",
                "debug buffers are not emulated",
            )
        }
        3 if config::get().driver_major == 1 => return Ok(0),
        _ => return fail(libc::EINVAL, "CONFIG_HWCTX", format!("param_type {ty}")),
    }
    if size as u64 > PAGE {
        return fail(
            libc::E2BIG,
            "CONFIG_HWCTX",
            format!("param_val_size {size} > 4096"),
        );
    }
    if size < 8 {
        return fail(
            libc::EINVAL,
            "CONFIG_HWCTX",
            format!("param_val_size {size} too small for config_cu"),
        );
    }
    let buf = uaccess::read(val, size as usize)
        .or_else(|e| fail(e, "CONFIG_HWCTX", "config_cu not readable"))?;
    let num = g16(&buf, 0) as usize;
    mbz("CONFIG_HWCTX", &buf, &[(2, 6, "config_cu.pad")])?;
    if num == 0 || num > 32 {
        return fail(
            libc::EINVAL,
            "CONFIG_HWCTX",
            format!("num_cus {num} (1..=32)"),
        );
    }
    if (size as usize) < 8 + 8 * num {
        return fail(
            libc::EINVAL,
            "CONFIG_HWCTX",
            format!("param_val_size {size} too small for {num} CUs"),
        );
    }
    if c.ctxs.get(&h).is_some_and(|x| !x.cus.is_empty()) {
        return fail(
            libc::EINVAL,
            "CONFIG_HWCTX",
            "Not support re-config CU: CONFIG_CU is write-once; create a new context",
        );
    }
    let mut cus = Vec::with_capacity(num);
    for i in 0..num {
        let e = &buf[8 + 8 * i..16 + 8 * i];
        mbz("CONFIG_HWCTX", e, &[(5, 3, "cu_config.pad")])?;
        let bo_h = g32(e, 0);
        match c.bos.get(&bo_h).map(|bo| bo.kind) {
            Some(Kind::Dev { off }) => cus.push((bo_h, off)),
            Some(k) => {
                return fail(
                    libc::EINVAL,
                    "CONFIG_HWCTX",
                    format!(
                        "Invalid BO type: CU {i} BO {bo_h} is {}, must be a DEV BO holding the PDI",
                        k.name()
                    ),
                )
            }
            None => {
                return fail(
                    libc::EINVAL,
                    "CONFIG_HWCTX",
                    format!("CU {i}: no BO handle {bo_h}"),
                )
            }
        }
    }
    if let Some(heap) = c.heap.as_mut() {
        for &(_, off) in &cus {
            heap.hold(off);
        }
    }
    if let Some(ctx) = c.ctxs.get_mut(&h) {
        ctx.cus = cus;
    }
    Ok(0)
}

// ---------------------------------------------------------------------------------------------
// amdxdna: commands

fn exec_cmd(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let (c, g) = parts(st, fd)?;
    mbz("EXEC_CMD", b, &[(0, 8, "ext"), (8, 8, "ext_flags")])?;
    let (ctx_h, ty, cmd_handles, args_p, cmd_count, arg_count) = (
        g32(b, 16),
        g32(b, 20),
        g64(b, 24),
        g64(b, 32),
        g32(b, 40),
        g32(b, 44),
    );
    if ty != 0 {
        return fail(
            libc::EINVAL,
            "EXEC_CMD",
            format!("type {ty}: only 0 (SUBMIT_EXEC_BUF)"),
        );
    }
    if cmd_count != 1 {
        return fail(
            libc::EINVAL,
            "EXEC_CMD",
            format!("cmd_count {cmd_count} must be 1 (chain commands with ERT_CMD_CHAIN)"),
        );
    }
    if arg_count > 4095 {
        return fail(
            libc::EINVAL,
            "EXEC_CMD",
            format!("arg_count {arg_count} > 4095"),
        );
    }
    let Some(cus_len) = c.ctxs.get(&ctx_h).map(|x| x.cus.len()) else {
        return fail(libc::EINVAL, "EXEC_CMD", format!("Invalid hwctx {ctx_h}"));
    };
    let cmd_h = u32::try_from(cmd_handles).or_else(|_| {
        fail(
            libc::EINVAL,
            "EXEC_CMD",
            "cmd_handles is the CMD BO handle value, not a pointer",
        )
    })?;
    match c.bos.get(&cmd_h).map(|bo| bo.kind) {
        None => return fail(libc::ENOENT, "EXEC_CMD", format!("no command BO {cmd_h}")),
        Some(Kind::Cmd | Kind::Share) => {}
        Some(k) => {
            return fail(
                libc::EINVAL,
                "EXEC_CMD",
                format!("command BO {cmd_h} is {}, must be CMD", k.name()),
            )
        }
    }
    let raw = uaccess::read(args_p, arg_count as usize * 4)
        .or_else(|e| fail(e, "EXEC_CMD", "args array not readable"))?;
    let args: Vec<u32> = raw.chunks(4).map(|w| g32(w, 0)).collect();
    let mut seen = BTreeSet::new();
    for &a in &args {
        if !c.bos.contains_key(&a) {
            return fail(
                libc::ENOENT,
                "EXEC_CMD",
                format!("argument BO {a} does not exist"),
            );
        }
        if !seen.insert(a) {
            return fail(
                libc::EINVAL,
                "EXEC_CMD",
                format!("argument BO {a} listed twice"),
            );
        }
    }
    g.execs += 1;
    let n = g.execs;
    let every = config::get().stats_every;
    if every > 0 && n % every == 0 {
        // Live counts while the client runs (a server that never closes its device): taken at
        // submission, before this command's effects.
        write_stats(
            &Snapshot {
                fd,
                bos: c.bos.len(),
                ctxs: c.ctxs.len(),
                syncobjs: c.syncobjs.len(),
                execs: n,
                calls: calls_json(&g.calls),
            },
            "exec",
        );
    }
    let injected = config::get()
        .fail_exec
        .iter()
        .find(|(k, _)| k.is_none_or(|k| k == n))
        .map(|&(_, s)| s);
    let Some(ctx) = c.ctxs.get_mut(&ctx_h) else {
        return Err(libc::EINVAL);
    };
    let seq = ctx.next_seq;
    ctx.next_seq += 1;
    ctx.submissions += 1;

    let tag = format!("EXEC ctx {ctx_h} seq {seq} (cmd BO {cmd_h}, exec #{n})");
    let mut state = match injected {
        Some(s) => {
            log::log(&format!(
                "{tag}: forced to {} by XDNA_SHIM_FAIL_EXEC",
                ert::state_name(s)
            ));
            s
        }
        None => match run_packet(c, cmd_h, &args, cus_len, 0) {
            Ok(()) => ERT_COMPLETED,
            Err((s, msg)) => {
                log::log(&format!("{tag}: {}: {msg}", ert::state_name(s)));
                s
            }
        },
    };
    for msg in check_all_guards(c, &args, cmd_h) {
        log::log(&format!("{tag}: ERROR: {msg}"));
        state = ERT_ERROR;
    }
    finish_packet(c, cmd_h, state, true);
    if let Some(ctx) = c.ctxs.get_mut(&ctx_h) {
        if state == ERT_COMPLETED {
            ctx.completions += 1;
        } else {
            ctx.errors += 1;
        }
        let so = ctx.syncobj;
        if let Some(s) = c.syncobjs.get_mut(&so) {
            s.signal(seq);
        }
    }
    log::debug(|| format!("{tag}: {}", ert::state_name(state)));
    p64(b, 48, seq);
    Ok(0)
}

/// Writes the final state into a command BO; on error states (not for chains) overwrites the
/// payload with 0xFF like the upstream driver.
fn finish_packet(c: &Client, h: u32, state: u32, trash: bool) {
    let Some(bo) = c.bos.get(&h) else { return };
    let Some(ptr) = c.mem(bo) else { return };
    // SAFETY: CMD BOs are at least 4 bytes; ptr is the shim's mapping of the BO.
    let raw = unsafe { std::ptr::read_volatile(ptr as *const u32) };
    let hdr = Header::parse(raw);
    if trash && state != ERT_COMPLETED && hdr.opcode != ert::OP_CMD_CHAIN {
        let end = (4 + 4 * hdr.count as u64).min(bo.size);
        // SAFETY: [4, end) lies inside the BO.
        unsafe {
            std::ptr::write_bytes((ptr + 4) as *mut u8, 0xff, end.saturating_sub(4) as usize)
        };
    }
    // SAFETY: as above.
    unsafe { std::ptr::write_volatile(ptr as *mut u32, Header::with_state(raw, state)) };
}

type RunErr = (u32, String);

fn abort<T>(msg: impl Into<String>) -> Result<T, RunErr> {
    Err((ERT_ABORT, msg.into()))
}
fn error<T>(msg: impl Into<String>) -> Result<T, RunErr> {
    Err((ERT_ERROR, msg.into()))
}

/// Parses and runs one ERT packet (recursing once for chains).
fn run_packet(c: &Client, h: u32, args: &[u32], cus_len: usize, depth: u32) -> Result<(), RunErr> {
    let Some(bo) = c.bos.get(&h) else {
        return abort(format!("command BO {h} does not exist"));
    };
    let Some(ptr) = c.mem(bo) else {
        return abort("command BO has no memory");
    };
    // SAFETY: ptr maps at least 4 bytes of the CMD BO.
    let hdr = Header::parse(unsafe { std::ptr::read_volatile(ptr as *const u32) });
    if hdr.state != 1 {
        log::debug(|| {
            format!(
                "command BO {h}: header state {} (the host should write NEW = 1)",
                hdr.state
            )
        });
    }
    let len = 4 + 4 * hdr.count as u64;
    if len > bo.size {
        return abort(format!(
            "packet count {} overruns the {}-byte command BO",
            hdr.count, bo.size
        ));
    }
    // SAFETY: [ptr+4, ptr+len) lies inside the BO (checked above).
    let payload: Vec<u32> =
        unsafe { std::slice::from_raw_parts((ptr + 4) as *const u8, len as usize - 4) }
            .chunks(4)
            .map(|w| g32(w, 0))
            .collect();
    let bytes_of =
        |words: &[u32]| -> Vec<u8> { words.iter().flat_map(|w| w.to_le_bytes()).collect() };
    match hdr.opcode {
        ert::OP_CMD_CHAIN => {
            if depth > 0 {
                return abort("nested command chain");
            }
            let d = bytes_of(&payload);
            if d.len() < 24 {
                return abort("chain payload shorter than ert_cmd_chain_data");
            }
            let n = g32(&d, 0) as usize;
            if d.len() < 24 + 8 * n {
                return abort(format!("chain of {n} commands overruns its payload"));
            }
            let subs: Vec<u64> = (0..n).map(|i| g64(&d, 24 + 8 * i)).collect();
            let mut first_op = None;
            for (i, &sub) in subs.iter().enumerate() {
                let sub_h = sub as u32;
                let Some(sbo) = c.bos.get(&sub_h) else {
                    return abort(format!("chain slot {i}: no command BO {sub}"));
                };
                if !matches!(sbo.kind, Kind::Cmd | Kind::Share) {
                    return abort(format!(
                        "chain slot {i}: BO {sub_h} is {}, not a command BO",
                        sbo.kind.name()
                    ));
                }
                let Some(sptr) = c.mem(sbo) else {
                    return abort(format!("chain slot {i}: BO {sub_h} has no memory"));
                };
                // SAFETY: CMD BOs are at least 4 bytes.
                let op =
                    Header::parse(unsafe { std::ptr::read_volatile(sptr as *const u32) }).opcode;
                if *first_op.get_or_insert(op) != op {
                    return abort("chain mixes opcodes");
                }
                let r = run_packet(c, sub_h, args, cus_len, depth + 1);
                let s = r.as_ref().map_or_else(|e| e.0, |_| ERT_COMPLETED);
                finish_packet(c, sub_h, s, true);
                if let Err((s, msg)) = r {
                    // error_index @8 of the chain data.
                    // SAFETY: the chain payload is at least 24 bytes (checked).
                    unsafe { std::ptr::write_volatile((ptr + 4 + 8) as *mut u32, i as u32) };
                    return Err((s, format!("chain slot {i} (cmd BO {sub_h}): {msg}")));
                }
            }
            Ok(())
        }
        ert::OP_START_CU => {
            let masks = 1 + hdr.extra_cu_masks as usize;
            if payload.len() <= masks {
                return abort("START_CU packet has no register map after the CU mask");
            }
            let Some(cu) = payload[..masks]
                .iter()
                .find(|&&m| m != 0)
                .map(|m| m.trailing_zeros() as usize)
            else {
                return abort("CU mask is zero");
            };
            if cus_len == 0 {
                return error("START_CU on a context without CONFIG_CU (configure a CU with its PDI DEV BO first)");
            }
            if cu >= cus_len {
                return error(format!(
                    "CU index {cu} not configured (context has {cus_len} CUs)"
                ));
            }
            let regmap = bytes_of(&payload[masks..]);
            if regmap.len() < 0x14 {
                return error(format!(
                    "regmap of {} bytes; needs opcode@0x00, instr@0x08, ninstr@0x10",
                    regmap.len()
                ));
            }
            let txn = g64(&regmap, 0);
            if txn != 3 {
                return error(format!("regmap opcode {txn}, expected 3 (TXN)"));
            }
            let (instr, ninstr) = (g64(&regmap, 0x08), g32(&regmap, 0x10) as u64);
            let mut bufs = Vec::new();
            let mut o = 0x14;
            while o + 8 <= regmap.len() {
                let addr = g64(&regmap, o);
                match c.resolve(args, addr) {
                    Some(r) => bufs.push(r),
                    None => {
                        return error(format!(
                        "buffer address {addr:#x} (regmap +{o:#x}) is not inside any argument BO"
                    ))
                    }
                }
                o += 8;
            }
            run_image(c, args, instr, ninstr * 4, bufs)
        }
        ert::OP_START_NPU | ert::OP_START_NPU_PREEMPT | ert::OP_START_NPU_PREEMPT_ELF => {
            let masks = 1 + hdr.extra_cu_masks as usize;
            let d = bytes_of(payload.get(masks..).unwrap_or(&[]));
            let preempt = hdr.opcode != ert::OP_START_NPU;
            let need = if preempt { 40 } else { 16 };
            if d.len() < need {
                return abort(format!(
                    "opcode {} payload of {} bytes, needs {need}",
                    hdr.opcode,
                    d.len()
                ));
            }
            let instr = g64(&d, 0);
            let isize = if preempt { g32(&d, 24) } else { g32(&d, 8) } as u64;
            if preempt {
                for (name, a, s) in [
                    ("save", g64(&d, 8), g32(&d, 28)),
                    ("restore", g64(&d, 16), g32(&d, 32)),
                ] {
                    if a != 0 && c.resolve(args, a).is_none_or(|r| r.2 < s as u64) {
                        return error(format!(
                            "{name} buffer {a:#x} (+{s} bytes) is not inside an argument BO"
                        ));
                    }
                }
            }
            if !instr.is_multiple_of(INSTR_ALIGN) {
                return Err((ERT_TIMEOUT, format!("instruction buffer {instr:#x} is not 16 KiB-aligned: the firmware never completes such a command")));
            }
            let mut bufs = Vec::new();
            if hdr.opcode == ert::OP_START_NPU_PREEMPT_ELF {
                // Full-ELF flow: a shim-TXN stream names its buffers in its patched slots.
                if let Some(addrs) = txn_slots(c, args, instr, isize)? {
                    for (i, a) in addrs.into_iter().enumerate() {
                        match c.resolve(args, a) {
                            Some(r) => bufs.push(r),
                            None => {
                                return error(format!(
                                    "control code argument {i}: patched address minus 0x8000_0000 and addend is {a:#x}, not inside any argument BO (patched twice, or from a non-pristine copy?)"
                                ))
                            }
                        }
                    }
                }
            } else {
                let mut o = need;
                while o + 8 <= d.len() {
                    if let Some(r) = c.resolve(args, g64(&d, o)) {
                        bufs.push(r);
                    }
                    o += 8;
                }
            }
            run_image(c, args, instr, isize, bufs)
        }
        op => abort(format!(
            "opcode {op} is not supported by amdxdna AIE2/AIE2P"
        )),
    }
}

/// For opcode 22: when the instruction stream is shim-TXN control code, the buffer addresses
/// its patched slots hold (argument order); `None` for any other stream.
fn txn_slots(c: &Client, args: &[u32], instr: u64, ilen: u64) -> Result<Option<Vec<u64>>, RunErr> {
    let Some((_, iptr, avail, user)) = c.resolve(args, instr) else {
        return Ok(None); // run_image reports the unresolvable instruction address
    };
    let n = ilen.min(avail) as usize;
    if user || n < 8 {
        return Ok(None);
    }
    // SAFETY: [iptr, iptr + n) lies inside the instruction BO's shim mapping (resolve; n ≤ avail).
    let code = unsafe { std::slice::from_raw_parts(iptr as *const u8, n) };
    if !xdna::kernels::shim_txn::is_txn(code) {
        return Ok(None);
    }
    crate::kexec::txn_buffers(code).map(Some).or_else(error)
}

/// Copies the image and buffers out, runs [`ert::execute`], writes the buffers back.
fn run_image(
    c: &Client,
    args: &[u32],
    instr: u64,
    ilen: u64,
    bufs: Vec<Resolved>,
) -> Result<(), RunErr> {
    let Some((ih, iptr, avail, iuser)) = c.resolve(args, instr) else {
        return error(format!("instruction address {instr:#x} is not inside any argument BO (list the instruction DEV BO in EXEC_CMD args)"));
    };
    if ilen == 0 || ilen > avail {
        return error(format!(
            "instruction stream of {ilen} bytes at {instr:#x} exceeds BO {ih} ({avail} bytes left)"
        ));
    }
    let unreadable = |h: u32| format!("user-pointer BO {h}: its memory is no longer mapped");
    let image = if iuser {
        uaccess::read(iptr as u64, ilen as usize).map_err(|_| (ERT_ERROR, unreadable(ih)))?
    } else {
        // SAFETY: [iptr, iptr+ilen) lies inside BO `ih`'s shim mapping (resolve + check above).
        unsafe { std::slice::from_raw_parts(iptr as *const u8, ilen as usize) }.to_vec()
    };
    let disjoint = bufs.iter().enumerate().all(|(i, &(_, p, l, _))| {
        bufs[i + 1..]
            .iter()
            .all(|&(_, q, m, _)| p as u64 + l <= q as u64 || q as u64 + m <= p as u64)
    });
    let any_user = bufs.iter().any(|b| b.3);
    let result = if disjoint && !any_user {
        // Disjoint ranges of the shim's own mappings: the executor works on them in place
        // (no copy of large weight buffers per command).
        let mut refs: Vec<&mut [u8]> = bufs
            .iter()
            // SAFETY: each (ptr, len) lies inside its BO's mapping (from resolve), the mappings
            // stay alive while the state lock is held, and the ranges are pairwise disjoint, so
            // no two of these &mut slices alias.
            .map(|&(_, p, l, _)| unsafe {
                std::slice::from_raw_parts_mut(p as *mut u8, l as usize)
            })
            .collect();
        ert::execute(&image, &mut refs)
    } else {
        // Aliasing arguments (two addresses inside one BO) or client memory (user-pointer BOs):
        // run on copies, written back in order.
        let mut owned: Vec<Vec<u8>> = Vec::with_capacity(bufs.len());
        for &(h, p, l, user) in &bufs {
            owned.push(if user {
                uaccess::read(p as u64, l as usize).map_err(|_| (ERT_ERROR, unreadable(h)))?
            } else {
                // SAFETY: (ptr, len) lies inside BO `h`'s shim mapping (from resolve).
                unsafe { std::slice::from_raw_parts(p as *const u8, l as usize) }.to_vec()
            });
        }
        let mut refs: Vec<&mut [u8]> = owned.iter_mut().map(|v| v.as_mut_slice()).collect();
        let r = ert::execute(&image, &mut refs);
        if r.is_ok() {
            for (&(h, p, l, user), v) in bufs.iter().zip(&owned) {
                if user {
                    uaccess::write(p as u64, v).map_err(|_| (ERT_ERROR, unreadable(h)))?;
                } else {
                    // SAFETY: writing back exactly the range read above.
                    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), p as *mut u8, l as usize) };
                }
            }
        }
        r
    };
    result.or_else(|e| error(e.to_string()))
}

/// Checks (and restores) the guard words of the argument BOs, the command BO and every DEV
/// carve-out of the heap. Returns one message per clobbered guard.
fn check_all_guards(c: &Client, args: &[u32], cmd: u32) -> Vec<String> {
    let mut out = Vec::new();
    for (&h, bo) in &c.bos {
        let relevant = matches!(bo.kind, Kind::Dev { .. }) || args.contains(&h) || h == cmd;
        if !relevant || !bo.guarded {
            continue;
        }
        let Some(ptr) = c.mem(bo) else { continue };
        if let Some(at) = check_guard(ptr, bo.size) {
            out.push(format!(
                "guard words after BO {h} ({}, {} bytes) clobbered at byte {at} (+{} past the end): something wrote past the end of this buffer",
                bo.kind.name(),
                bo.size,
                at - bo.size
            ));
            write_guard(ptr, bo.size);
        }
    }
    out
}

fn wait_cmd(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let cfg = config::get();
    if cfg.driver_major != 1 {
        if cfg.driver_minor == 0 {
            return fail(
                libc::EINVAL,
                "WAIT_CMD",
                "no such ioctl on this driver version; wait on the context syncobj",
            );
        }
        return fail(libc::EOPNOTSUPP, "WAIT_CMD", "not supported on AIE2/AIE2P by the upstream driver; wait on the context syncobj (SYNCOBJ_TIMELINE_WAIT)");
    }
    let (c, _) = parts(st, fd)?;
    let (h, seq) = (g32(b, 0), g64(b, 8));
    let Some(ctx) = c.ctxs.get(&h) else {
        return fail(libc::EINVAL, "WAIT_CMD", format!("no hardware context {h}"));
    };
    if seq >= ctx.next_seq {
        log::debug(|| format!("WAIT_CMD ctx {h} seq {seq} never submitted: ETIME"));
        return Err(libc::ETIME);
    }
    Ok(0)
}

// ---------------------------------------------------------------------------------------------
// amdxdna: queries

fn get_info(st: &mut State, fd: c_int, b: &mut [u8]) -> Res<c_int> {
    let cfg = config::get();
    let (c, g) = parts(st, fd)?;
    let (param, bsize, ptr) = (g32(b, 0), g32(b, 4) as usize, g64(b, 8));
    let mut v: Vec<u8> = Vec::new();
    let u16s = |v: &mut Vec<u8>, xs: &[u16]| {
        xs.iter()
            .for_each(|x| v.extend_from_slice(&x.to_le_bytes()))
    };
    let u32s = |v: &mut Vec<u8>, xs: &[u32]| {
        xs.iter()
            .for_each(|x| v.extend_from_slice(&x.to_le_bytes()))
    };
    match param {
        1 => {
            // amdxdna_drm_query_aie_metadata (64 B)
            u32s(&mut v, &[0x0200_0000]); // col_size
            u16s(&mut v, &[cfg.columns, cfg.rows]);
            u32s(&mut v, &[2, 1]); // AIE version
                                   // tile blocks: row_count, row_start, dma_channel_count, lock_count, event_reg_count, pad[3]
            u16s(&mut v, &[cfg.core_rows, 2, 2, 16, 4, 0, 0, 0]);
            u16s(&mut v, &[1, 1, 6, 64, 4, 0, 0, 0]);
            u16s(&mut v, &[1, 0, 2, 16, 4, 0, 0, 0]);
        }
        2 => u32s(&mut v, &[2, 1]),
        5 => {
            // Legacy QUERY_HW_CONTEXTS: 64-byte amdxdna_drm_query_hwctx per context, as many
            // as fit; buffer_size is set to the bytes filled.
            let pid = std::process::id() as u64;
            for (&id, ctx) in &c.ctxs {
                if v.len() + 64 > bsize {
                    break;
                }
                let mut e = [0u8; 64];
                p32(&mut e, 0, id);
                p32(&mut e, 8, ctx.num_col);
                p64(&mut e, 16, pid);
                p64(&mut e, 24, ctx.submissions);
                p64(&mut e, 32, ctx.completions);
                p64(&mut e, 56, ctx.errors);
                v.extend_from_slice(&e);
            }
            p32(b, 4, v.len() as u32);
        }
        3 => {
            for (name, mhz) in [("MP-NPU Clock", 1800u32), ("H Clock", 1024)] {
                let mut n = [0u8; 16];
                n[..name.len()].copy_from_slice(name.as_bytes());
                v.extend_from_slice(&n);
                u32s(&mut v, &[mhz, 0]);
            }
        }
        8 => u32s(&mut v, &cfg.fw_version),
        9 => v.extend_from_slice(&[g.power_mode, 0, 0, 0, 0, 0, 0, 0]),
        12 if feature_level(4) => {
            for x in [
                1800u64,
                50,
                cfg.context_limit as u64,
                0,
                g.live_ctx_ids.len() as u64,
            ] {
                v.extend_from_slice(&x.to_le_bytes());
            }
        }
        _ => {
            // Optional queries: a client probes them, so this is debug-level, not an error line.
            log::debug(|| format!("GET_INFO: EOPNOTSUPP: param {param} not emulated"));
            return Err(libc::EOPNOTSUPP);
        }
    }
    let n = bsize.min(v.len());
    uaccess::write(ptr, &v[..n]).or_else(|e| fail(e, "GET_INFO", "buffer not writable"))?;
    Ok(0)
}

/// Size of `amdxdna_drm_hwctx_entry` in the upstream header (with `name[16]`).
const HWCTX_ENTRY_SIZE: usize = 160;

/// The driver's feature level: DRM minor on the upstream driver; the OOT driver (major 1) has
/// everything.
fn feature_level(min_minor: i32) -> bool {
    let c = config::get();
    c.driver_major >= 1 || c.driver_minor >= min_minor
}

fn get_array(st: &mut State, _fd: c_int, b: &mut [u8]) -> Res<c_int> {
    if !feature_level(1) {
        return fail(libc::EINVAL, "GET_ARRAY", "no such ioctl before driver 0.1");
    }
    mbz("GET_ARRAY", b, &[(12, 4, "pad")])?;
    let (param, esize, num, ptr) = (
        g32(b, 0),
        g32(b, 4) as usize,
        g32(b, 8) as usize,
        g64(b, 16),
    );
    if esize == 0 || num == 0 || esize > 4096 || num > 1024 {
        return fail(
            libc::EINVAL,
            "GET_ARRAY",
            format!("element_size {esize} / num_element {num} (both 1.., ≤ 4096 / ≤ 1024)"),
        );
    }
    if param != 0 {
        log::debug(|| {
            format!("GET_ARRAY: EOPNOTSUPP: param {param} not emulated (only 0 = HW_CONTEXT_ALL)")
        });
        return Err(libc::EOPNOTSUPP);
    }
    let stride = esize.min(HWCTX_ENTRY_SIZE);
    let pid = std::process::id() as u64;
    let mut out = Vec::new();
    let mut count = 0usize;
    for c in st.clients.values() {
        let heap_usage = c
            .heap
            .as_ref()
            .map_or(0, |h| h.allocs.values().map(|a| a.0).sum::<u64>());
        for (&id, ctx) in &c.ctxs {
            if count == num {
                break;
            }
            let mut e = vec![0u8; HWCTX_ENTRY_SIZE];
            p32(&mut e, 0, id); // context_id
            p32(&mut e, 4, 0); // start_col
            p32(&mut e, 8, ctx.num_col);
            p32(&mut e, 12, id); // fw hwctx_id
            p64(&mut e, 16, pid);
            p64(&mut e, 24, ctx.submissions);
            p64(&mut e, 32, ctx.completions);
            p64(&mut e, 56, ctx.errors);
            p64(&mut e, 64, 0x200); // priority NORMAL
            p64(&mut e, 72, heap_usage);
            p32(&mut e, 88, 0); // state IDLE
            let name = b"xdna-shim";
            e[144..144 + name.len()].copy_from_slice(name);
            out.extend_from_slice(&e[..stride]);
            count += 1;
        }
    }
    uaccess::write(ptr, &out).or_else(|e| fail(e, "GET_ARRAY", "buffer not writable"))?;
    p32(b, 4, stride as u32);
    p32(b, 8, count as u32);
    Ok(0)
}

fn set_state(st: &mut State, _fd: c_int, b: &mut [u8]) -> Res<c_int> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return fail(libc::EACCES, "SET_STATE", "root only (DRM_ROOT_ONLY)");
    }
    let (param, bsize, ptr) = (g32(b, 0), g32(b, 4), g64(b, 8));
    if param != 0 {
        return fail(
            libc::EOPNOTSUPP,
            "SET_STATE",
            format!("param {param} not emulated (only 0 = SET_POWER_MODE)"),
        );
    }
    if bsize < 8 {
        return fail(
            libc::EINVAL,
            "SET_STATE",
            format!("buffer_size {bsize} < 8"),
        );
    }
    let v = uaccess::read(ptr, 8).or_else(|e| fail(e, "SET_STATE", "buffer not readable"))?;
    mbz("SET_STATE", &v, &[(1, 7, "set_power_mode.pad")])?;
    if v[0] > 4 {
        return fail(
            libc::EINVAL,
            "SET_STATE",
            format!("power mode {} (0..=4)", v[0]),
        );
    }
    st.g().power_mode = v[0];
    Ok(0)
}

// ---------------------------------------------------------------------------------------------
// udmabuf

fn udmabuf_ioctl(req: u64, arg: u64) -> Res<c_int> {
    const CREATE: u64 = 0x4018_7542;
    const CREATE_LIST: u64 = 0x4008_7543;
    // (memfd, offset, size) ranges and flags.
    let (name, flags, items): (&str, u32, Vec<(c_int, u64, u64)>) = match req {
        CREATE => {
            let b = uaccess::read(arg, 24)
                .or_else(|e| fail(e, "UDMABUF_CREATE", "argument not readable"))?;
            (
                "UDMABUF_CREATE",
                g32(&b, 4),
                vec![(g32(&b, 0) as c_int, g64(&b, 8), g64(&b, 16))],
            )
        }
        CREATE_LIST => {
            const W: &str = "UDMABUF_CREATE_LIST";
            let h = uaccess::read(arg, 8).or_else(|e| fail(e, W, "argument not readable"))?;
            let count = g32(&h, 4) as usize;
            if count == 0 || count > 1024 {
                return fail(
                    libc::EINVAL,
                    W,
                    format!("count {count} (1..=1024, list_limit)"),
                );
            }
            let raw =
                uaccess::read(arg + 8, count * 24).or_else(|e| fail(e, W, "list not readable"))?;
            let items = (0..count)
                .map(|i| {
                    (
                        g32(&raw, 24 * i) as c_int,
                        g64(&raw, 24 * i + 8),
                        g64(&raw, 24 * i + 16),
                    )
                })
                .collect();
            (W, g32(&h, 0), items)
        }
        _ => {
            return fail(
                libc::ENOTTY,
                "UDMABUF",
                format!("request {req:#x} not emulated (UDMABUF_CREATE, UDMABUF_CREATE_LIST)"),
            )
        }
    };
    let mut st = lock();
    inject(st.g(), "UDMABUF_CREATE")?;
    if flags & !1 != 0 {
        return fail(libc::EINVAL, name, format!("flags {flags:#x}"));
    }
    let mut total = 0u64;
    let mut file: Option<(u64, u64)> = None; // (st_dev, st_ino) of the first memfd
    for &(memfd, off, size) in &items {
        // SAFETY: fcntl on a caller-provided fd.
        let seals = unsafe { real::fcntl(memfd, libc::F_GET_SEALS, 0) };
        if seals < 0 {
            return fail(libc::EINVAL, name, format!("fd {memfd} is not a memfd"));
        }
        if seals & libc::F_SEAL_SHRINK == 0 {
            return fail(
                libc::EINVAL,
                name,
                "memfd must be sealed with F_SEAL_SHRINK",
            );
        }
        if seals & (libc::F_SEAL_WRITE | libc::F_SEAL_FUTURE_WRITE) != 0 {
            return fail(
                libc::EINVAL,
                name,
                "memfd must not be sealed with F_SEAL_WRITE/F_SEAL_FUTURE_WRITE",
            );
        }
        if size == 0 || !off.is_multiple_of(PAGE) || !size.is_multiple_of(PAGE) {
            return fail(
                libc::EINVAL,
                name,
                format!("offset {off:#x} / size {size:#x} must be page-aligned and non-zero"),
            );
        }
        // SAFETY: an all-zero struct stat is valid; real fstat fills it.
        let mut s: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: real fstat into a live local.
        if unsafe { real::fstat(memfd, &mut s) } != 0 || off + size > s.st_size as u64 {
            return fail(
                libc::EINVAL,
                name,
                format!("range {off:#x}+{size:#x} outside the memfd"),
            );
        }
        let id = (s.st_dev, s.st_ino);
        let (first_fd, first_off, _) = items[0];
        if *file.get_or_insert(id) != id || off != first_off + total {
            return fail(
                libc::EOPNOTSUPP,
                name,
                format!("list item {memfd}@{off:#x}: the shim only emulates one contiguous range of one memfd (first: fd {first_fd})"),
            );
        }
        total += size;
    }
    let limit = config::get().udmabuf_limit;
    if total > limit {
        return fail(
            libc::E2BIG,
            name,
            format!("size {total} exceeds size_limit_mb ({} MiB)", limit >> 20),
        );
    }
    let cmd = if flags & 1 != 0 {
        libc::F_DUPFD_CLOEXEC
    } else {
        libc::F_DUPFD
    };
    let (memfd, off, _) = items[0];
    // SAFETY: fcntl dup of the caller's memfd.
    let nfd = unsafe { real::fcntl(memfd, cmd, 0) };
    if nfd < 0 {
        return Err(last_errno());
    }
    st.g().dmabufs.insert(
        nfd,
        DmaBuf {
            offset: off,
            size: total,
        },
    );
    crate::set_fd_kind(nfd, crate::FD_DMABUF);
    Ok(nfd)
}
