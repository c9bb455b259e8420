//! The next definitions of the interposed libc symbols, found with `dlsym(RTLD_NEXT, ...)` and
//! cached in atomics. Resolution happens at load time (an `.init_array` constructor) and, failing
//! that, lazily; while a symbol is unresolved (e.g. `dlsym` itself allocating, the allocator calling
//! `mmap`), the raw system call is used instead, so no call ever recurses into the shim.

use std::sync::atomic::{AtomicUsize, Ordering};

use libc::{c_char, c_int, c_uint, c_ulong, c_void, mode_t, off_t, size_t};

struct Sym {
    name: &'static [u8],
    addr: AtomicUsize,
}

impl Sym {
    const fn new(name: &'static [u8]) -> Self {
        Sym {
            name,
            addr: AtomicUsize::new(0),
        }
    }

    fn get(&self) -> usize {
        let a = self.addr.load(Ordering::Acquire);
        if a != 0 {
            return a;
        }
        self.resolve()
    }

    fn resolve(&self) -> usize {
        // SAFETY: `name` is a NUL-terminated literal; dlsym with RTLD_NEXT has no other preconditions.
        let a = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr().cast()) } as usize;
        if a != 0 {
            self.addr.store(a, Ordering::Release);
        }
        a
    }
}

static OPEN: Sym = Sym::new(b"open\0");
static OPEN64: Sym = Sym::new(b"open64\0");
static OPENAT: Sym = Sym::new(b"openat\0");
static OPENAT64: Sym = Sym::new(b"openat64\0");
static OPEN_2: Sym = Sym::new(b"__open_2\0");
static OPEN64_2: Sym = Sym::new(b"__open64_2\0");
static CLOSE: Sym = Sym::new(b"close\0");
static IOCTL: Sym = Sym::new(b"ioctl\0");
static MMAP: Sym = Sym::new(b"mmap\0");
static STAT: Sym = Sym::new(b"stat\0");
static STAT64: Sym = Sym::new(b"stat64\0");
static LSTAT: Sym = Sym::new(b"lstat\0");
static LSTAT64: Sym = Sym::new(b"lstat64\0");
static FSTAT: Sym = Sym::new(b"fstat\0");
static FSTAT64: Sym = Sym::new(b"fstat64\0");
static STATX: Sym = Sym::new(b"statx\0");
static ACCESS: Sym = Sym::new(b"access\0");
static DUP: Sym = Sym::new(b"dup\0");
static DUP2: Sym = Sym::new(b"dup2\0");
static DUP3: Sym = Sym::new(b"dup3\0");
static FCNTL: Sym = Sym::new(b"fcntl\0");
static FCNTL64: Sym = Sym::new(b"fcntl64\0");

static ALL: [&Sym; 22] = [
    &OPEN, &OPEN64, &OPENAT, &OPENAT64, &OPEN_2, &OPEN64_2, &CLOSE, &IOCTL, &MMAP, &STAT, &STAT64,
    &LSTAT, &LSTAT64, &FSTAT, &FSTAT64, &STATX, &ACCESS, &DUP, &DUP2, &DUP3, &FCNTL, &FCNTL64,
];

extern "C" fn resolve_all() {
    for s in ALL.iter() {
        s.resolve();
    }
    MUNMAP.resolve();
}

/// Load-time constructor: resolve every symbol before `main`.
#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = resolve_all;

// The wrappers below transmute the cached address to the function type of the symbol it was
// looked up under; the fallbacks are the equivalent raw system calls.

pub unsafe fn open(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    match OPEN.get() {
        // SAFETY: the address came from dlsym("open"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char, c_int, mode_t) -> c_int>(
                a,
            )(path, flags, mode)
        },
        // SAFETY: the caller's contract is libc openat's, and the system call behind it checks every
        // user pointer (EFAULT).
        _ => unsafe { libc::syscall(libc::SYS_openat, libc::AT_FDCWD, path, flags, mode) as c_int },
    }
}

pub unsafe fn open64(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    match OPEN64.get() {
        // SAFETY: the address came from dlsym("open64"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char, c_int, mode_t) -> c_int>(
                a,
            )(path, flags, mode)
        },
        // SAFETY: the caller's contract is libc openat's, and the system call behind it checks every
        // user pointer (EFAULT).
        _ => unsafe {
            libc::syscall(
                libc::SYS_openat,
                libc::AT_FDCWD,
                path,
                flags | libc::O_LARGEFILE,
                mode,
            ) as c_int
        },
    }
}

pub unsafe fn openat(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    match OPENAT.get() {
        // SAFETY: the address came from dlsym("openat"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<
                usize,
                unsafe extern "C" fn(c_int, *const c_char, c_int, mode_t) -> c_int,
            >(a)(dirfd, path, flags, mode)
        },
        // SAFETY: the caller's contract is libc openat's, and the system call behind it checks every
        // user pointer (EFAULT).
        _ => unsafe { libc::syscall(libc::SYS_openat, dirfd, path, flags, mode) as c_int },
    }
}

pub unsafe fn openat64(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    match OPENAT64.get() {
        // SAFETY: the address came from dlsym("openat64"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<
                usize,
                unsafe extern "C" fn(c_int, *const c_char, c_int, mode_t) -> c_int,
            >(a)(dirfd, path, flags, mode)
        },
        // SAFETY: the caller's contract is libc openat's, and the system call behind it checks every
        // user pointer (EFAULT).
        _ => unsafe {
            libc::syscall(
                libc::SYS_openat,
                dirfd,
                path,
                flags | libc::O_LARGEFILE,
                mode,
            ) as c_int
        },
    }
}

pub unsafe fn open_2(path: *const c_char, flags: c_int) -> c_int {
    match OPEN_2.get() {
        // SAFETY: the address came from dlsym("__open_2"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char, c_int) -> c_int>(a)(
                path, flags,
            )
        },
        // SAFETY: the caller's contract is libc openat's, and the system call behind it checks every
        // user pointer (EFAULT).
        _ => unsafe { libc::syscall(libc::SYS_openat, libc::AT_FDCWD, path, flags, 0) as c_int },
    }
}

pub unsafe fn open64_2(path: *const c_char, flags: c_int) -> c_int {
    match OPEN64_2.get() {
        // SAFETY: the address came from dlsym("__open64_2"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char, c_int) -> c_int>(a)(
                path, flags,
            )
        },
        // SAFETY: the caller's contract is libc openat's, and the system call behind it checks every
        // user pointer (EFAULT).
        _ => unsafe {
            libc::syscall(
                libc::SYS_openat,
                libc::AT_FDCWD,
                path,
                flags | libc::O_LARGEFILE,
                0,
            ) as c_int
        },
    }
}

pub unsafe fn close(fd: c_int) -> c_int {
    match CLOSE.get() {
        // SAFETY: the address came from dlsym("close"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(c_int) -> c_int>(a)(fd)
        },
        // SAFETY: the system call takes only integers and touches no memory; what it does to fds
        // is what the caller asked of close.
        _ => unsafe { libc::syscall(libc::SYS_close, fd) as c_int },
    }
}

pub unsafe fn ioctl(fd: c_int, req: c_ulong, arg: *mut c_void) -> c_int {
    match IOCTL.get() {
        // SAFETY: the address came from dlsym("ioctl"); glibc's ioctl is (int, unsigned long, ...)
        // and on x86_64 a variadic pointer argument is passed like a fixed one.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(c_int, c_ulong, *mut c_void) -> c_int>(
                a,
            )(fd, req, arg)
        },
        // SAFETY: the caller's contract is libc ioctl's, and the system call behind it checks every
        // user pointer (EFAULT).
        _ => unsafe { libc::syscall(libc::SYS_ioctl, fd, req, arg) as c_int },
    }
}

/// The real `mmap`. Must stay allocation-free and lock-free: the allocator calls it.
pub unsafe fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    let a = MMAP.addr.load(Ordering::Acquire);
    if a != 0 {
        // SAFETY: the address came from dlsym("mmap"), whose C type is this signature.
        return unsafe {
            std::mem::transmute::<
                usize,
                unsafe extern "C" fn(
                    *mut c_void,
                    size_t,
                    c_int,
                    c_int,
                    c_int,
                    off_t,
                ) -> *mut c_void,
            >(a)(addr, len, prot, flags, fd, off)
        };
    }
    // Unresolved (possibly because dlsym is running right now): raw system call, no dlsym here.
    // SAFETY: the caller's contract is libc mmap's, and the system call behind it checks every
    // user pointer (EFAULT).
    let r = unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) };
    // glibc's syscall() returns -1 with errno set on failure (user addresses are never negative).
    if r == -1 {
        return libc::MAP_FAILED;
    }
    r as *mut c_void
}

macro_rules! real_stat {
    ($fn:ident, $sym:ident, $ty:ty, $sys:expr) => {
        pub unsafe fn $fn(path: *const c_char, buf: *mut $ty) -> c_int {
            match $sym.get() {
                // SAFETY: the address came from dlsym of the same-named symbol with this C type.
                a if a != 0 => unsafe {
                    std::mem::transmute::<
                        usize,
                        unsafe extern "C" fn(*const c_char, *mut $ty) -> c_int,
                    >(a)(path, buf)
                },
                // SAFETY: the caller's contract is libc newfstatat's, and the system call behind it checks every
                // user pointer (EFAULT).
                _ => unsafe {
                    libc::syscall(libc::SYS_newfstatat, libc::AT_FDCWD, path, buf, $sys) as c_int
                },
            }
        }
    };
}

real_stat!(stat, STAT, libc::stat, 0);
real_stat!(stat64, STAT64, libc::stat64, 0);
real_stat!(lstat, LSTAT, libc::stat, libc::AT_SYMLINK_NOFOLLOW);
real_stat!(lstat64, LSTAT64, libc::stat64, libc::AT_SYMLINK_NOFOLLOW);

macro_rules! real_fstat {
    ($fn:ident, $sym:ident, $ty:ty) => {
        pub unsafe fn $fn(fd: c_int, buf: *mut $ty) -> c_int {
            match $sym.get() {
                // SAFETY: the address came from dlsym of the same-named symbol with this C type.
                a if a != 0 => unsafe {
                    std::mem::transmute::<usize, unsafe extern "C" fn(c_int, *mut $ty) -> c_int>(a)(
                        fd, buf,
                    )
                },
                // SAFETY: the caller's contract is libc fstat's, and the system call behind it checks every
                // user pointer (EFAULT).
                _ => unsafe { libc::syscall(libc::SYS_fstat, fd, buf) as c_int },
            }
        }
    };
}

real_fstat!(fstat, FSTAT, libc::stat);
real_fstat!(fstat64, FSTAT64, libc::stat64);

pub unsafe fn statx(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mask: c_uint,
    buf: *mut c_void,
) -> c_int {
    match STATX.get() {
        // SAFETY: the address came from dlsym("statx"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<
                usize,
                unsafe extern "C" fn(c_int, *const c_char, c_int, c_uint, *mut c_void) -> c_int,
            >(a)(dirfd, path, flags, mask, buf)
        },
        // SAFETY: the caller's contract is libc statx's, and the system call behind it checks every
        // user pointer (EFAULT).
        _ => unsafe { libc::syscall(libc::SYS_statx, dirfd, path, flags, mask, buf) as c_int },
    }
}

pub unsafe fn access(path: *const c_char, mode: c_int) -> c_int {
    match ACCESS.get() {
        // SAFETY: the address came from dlsym("access"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char, c_int) -> c_int>(a)(
                path, mode,
            )
        },
        // SAFETY: the caller's contract is libc faccessat's, and the system call behind it checks every
        // user pointer (EFAULT).
        _ => unsafe { libc::syscall(libc::SYS_faccessat, libc::AT_FDCWD, path, mode) as c_int },
    }
}

pub unsafe fn dup(fd: c_int) -> c_int {
    match DUP.get() {
        // SAFETY: the address came from dlsym("dup"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(c_int) -> c_int>(a)(fd)
        },
        // SAFETY: the system call takes only integers and touches no memory; what it does to fds
        // is what the caller asked of dup.
        _ => unsafe { libc::syscall(libc::SYS_dup, fd) as c_int },
    }
}

pub unsafe fn dup2(old: c_int, new: c_int) -> c_int {
    match DUP2.get() {
        // SAFETY: the address came from dlsym("dup2"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(c_int, c_int) -> c_int>(a)(old, new)
        },
        // SAFETY: the system call takes only integers and touches no memory; what it does to fds
        // is what the caller asked of dup2.
        _ => unsafe { libc::syscall(libc::SYS_dup2, old, new) as c_int },
    }
}

pub unsafe fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    match DUP3.get() {
        // SAFETY: the address came from dlsym("dup3"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(c_int, c_int, c_int) -> c_int>(a)(
                old, new, flags,
            )
        },
        // SAFETY: the system call takes only integers and touches no memory; what it does to fds
        // is what the caller asked of dup3.
        _ => unsafe { libc::syscall(libc::SYS_dup3, old, new, flags) as c_int },
    }
}

/// `fcntl`/`fcntl64` (variadic in C: the third argument is passed like a fixed `unsigned long`
/// on x86_64).
pub unsafe fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    match FCNTL64.get() {
        // SAFETY: the address came from dlsym("fcntl64"), (int, int, ...) in C.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(c_int, c_int, c_ulong) -> c_int>(a)(
                fd, cmd, arg,
            )
        },
        _ => match FCNTL.get() {
            // SAFETY: the address came from dlsym("fcntl"), (int, int, ...) in C.
            a if a != 0 => unsafe {
                std::mem::transmute::<usize, unsafe extern "C" fn(c_int, c_int, c_ulong) -> c_int>(
                    a,
                )(fd, cmd, arg)
            },
            // SAFETY: the system call takes only integers and touches no memory; what it does to fds
            // is what the caller asked of fcntl.
            _ => unsafe { libc::syscall(libc::SYS_fcntl, fd, cmd, arg) as c_int },
        },
    }
}

static MUNMAP: Sym = Sym::new(b"munmap\0");

/// The real `munmap` (resolved lazily; the raw syscall until then).
pub unsafe fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    match MUNMAP.addr.load(Ordering::Acquire) {
        // SAFETY: the address came from dlsym("munmap"), whose C type is this signature.
        a if a != 0 => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_void, size_t) -> c_int>(a)(
                addr, len,
            )
        },
        // Unresolved (the constructor has not run yet): raw system call; glibc's syscall() sets
        // errno and returns -1 on failure. No dlsym here: the allocator calls munmap.
        // SAFETY: the caller's contract is libc munmap's, and the system call behind it checks every
        // user pointer (EFAULT).
        _ => unsafe { libc::syscall(libc::SYS_munmap, addr, len) as c_int },
    }
}
