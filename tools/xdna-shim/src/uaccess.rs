//! Copies from and to client memory that fail with `EFAULT` instead of crashing, like the kernel's
//! `copy_from_user`/`copy_to_user`: `process_vm_readv`/`process_vm_writev` on our own pid.

use libc::{c_int, iovec};

fn xfer(addr: u64, local: *mut u8, len: usize, write: bool) -> Result<(), c_int> {
    if len == 0 {
        return Ok(());
    }
    if addr == 0 || addr.checked_add(len as u64).is_none() {
        return Err(libc::EFAULT);
    }
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
        Ok(())
    } else {
        Err(libc::EFAULT)
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
