//! Copies from and to client memory that fail with `EFAULT` instead of crashing, like the kernel's
//! `copy_from_user`/`copy_to_user`: `process_vm_readv`/`process_vm_writev` on our own pid, or —
//! where a seccomp profile forbids those — a pipe (`write(2)`/`read(2)` report `EFAULT` for a bad
//! user buffer instead of faulting).

use std::sync::atomic::{AtomicBool, Ordering};

use libc::{c_int, iovec};

/// Set once `process_vm_*` turned out to be unavailable.
static USE_PIPE: AtomicBool = AtomicBool::new(false);

fn errno() -> c_int {
    // SAFETY: errno slot of this thread.
    unsafe { *libc::__errno_location() }
}

fn xfer_vm(addr: u64, local: *mut u8, len: usize, write: bool) -> Result<(), c_int> {
    let l = iovec {
        iov_base: local.cast(),
        iov_len: len,
    };
    let r = iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: `l` describes a live local buffer of `len` bytes; the remote range is validated by
    // the kernel (EFAULT on any unmapped byte) — nothing here dereferences `addr` directly.
    let n = unsafe {
        if write {
            libc::process_vm_writev(libc::getpid(), &l, 1, &r, 1, 0)
        } else {
            libc::process_vm_readv(libc::getpid(), &l, 1, &r, 1, 0)
        }
    };
    if n == len as isize {
        return Ok(());
    }
    match errno() {
        libc::EPERM | libc::ENOSYS | libc::EACCES if n < 0 => {
            USE_PIPE.store(true, Ordering::Relaxed);
            xfer_pipe(addr, local, len, write)
        }
        _ => Err(libc::EFAULT),
    }
}

/// The pipe fallback, in chunks below the pipe capacity.
fn xfer_pipe(addr: u64, local: *mut u8, len: usize, write: bool) -> Result<(), c_int> {
    let mut fds = [0 as c_int; 2];
    // SAFETY: pipe2 into a live 2-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(libc::EFAULT);
    }
    const CHUNK: usize = 32 << 10;
    let mut done = 0;
    let mut result = Ok(());
    while done < len {
        let n = CHUNK.min(len - done);
        let (src, dst) = if write {
            (local as usize + done, addr as usize + done)
        } else {
            (addr as usize + done, local as usize + done)
        };
        // SAFETY: the pipe's write(2)/read(2) validate the user-side buffer (EFAULT); the local side
        // is our own live buffer of `len` bytes.
        let w = unsafe { libc::write(fds[1], src as *const libc::c_void, n) };
        let r = if w == n as isize {
            // SAFETY: as for the write: the kernel checks the user-side buffer, and the local side
            // is our own live buffer of `len` bytes.
            unsafe { libc::read(fds[0], dst as *mut libc::c_void, n) }
        } else {
            -1
        };
        if r != n as isize {
            result = Err(libc::EFAULT);
            break;
        }
        done += n;
    }
    // SAFETY: closing the pipe we created (not interposed fds: plain close is fine, the shim's
    // close only does extra work for fake fds).
    unsafe {
        crate::real::close(fds[0]);
        crate::real::close(fds[1]);
    }
    result
}

fn xfer(addr: u64, local: *mut u8, len: usize, write: bool) -> Result<(), c_int> {
    if len == 0 {
        return Ok(());
    }
    if addr == 0 || addr.checked_add(len as u64).is_none() {
        return Err(libc::EFAULT);
    }
    if USE_PIPE.load(Ordering::Relaxed) {
        xfer_pipe(addr, local, len, write)
    } else {
        xfer_vm(addr, local, len, write)
    }
}

/// Reads `len` bytes of client memory at `addr`.
pub fn read(addr: u64, len: usize) -> Result<Vec<u8>, c_int> {
    let mut v = vec![0u8; len];
    xfer(addr, v.as_mut_ptr(), len, false)?;
    Ok(v)
}

/// Writes `data` to client memory at `addr`.
pub fn write(addr: u64, data: &[u8]) -> Result<(), c_int> {
    xfer(addr, data.as_ptr() as *mut u8, data.len(), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_paths_copy_and_fault() {
        let src = [1u8, 2, 3, 4, 5];
        for pipe in [false, true] {
            let mut out = [0u8; 5];
            let f = if pipe { xfer_pipe } else { xfer_vm };
            f(src.as_ptr() as u64, out.as_mut_ptr(), 5, false).unwrap();
            assert_eq!(out, src);
            assert_eq!(f(16, out.as_mut_ptr(), 5, false), Err(libc::EFAULT));
            let mut dst = [0u8; 5];
            f(dst.as_mut_ptr() as u64, src.as_ptr() as *mut u8, 5, true).unwrap();
            assert_eq!(dst, src);
            assert_eq!(f(16, src.as_ptr() as *mut u8, 5, true), Err(libc::EFAULT));
        }
    }
}
