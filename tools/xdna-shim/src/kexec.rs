//! Kernel ELF images and shim-TXN control code, run with the runtime's host executors
//! (`xdna::kernels::execute`).
//!
//! * A kernel ELF (`.note.xdna.kernel` descriptor) reached through START_CU: the buffers are the
//!   regmap's, in the descriptor's argument order.
//! * A shim-TXN stream (`xdna::kernels::shim_txn`) reached through opcode 22: [`txn_buffers`]
//!   decodes its patched slots into buffer addresses (which the caller resolves among the argument
//!   BOs), and the stream's descriptor names the computation.
//!
//! The executor runs on the thread that called EXEC_CMD while the shim's state lock is held (the
//! buffers are the shim's own mappings, which the lock keeps alive). It spreads the work over the
//! shim's copy of the kernel worker pool (`Pool::global` of the `xdna` crate linked into this
//! library; its threads are started by the first kernel). That cannot deadlock: pool workers only
//! compute on the slices they are given; the interposed calls they can make (anonymous mmap/munmap
//! of stacks and allocations, `open` of cgroup files by `available_parallelism`) are lock-free
//! pass-throughs (a `munmap` takes the lock only when it hits a client BO mapping, which a worker
//! never owns); and the pool runs a concurrent call inline rather than waiting for a busy pool.

use crate::ert::ExecFault;
use xdna::kernels::{self, shim_txn, ArgRole, KernelDesc};

/// Runs the GEMM a descriptor describes over `buffers` (in argument order).
pub fn run_desc(desc: &KernelDesc, buffers: &mut [&mut [u8]]) -> Result<(), ExecFault> {
    let name = desc.file_name();
    if buffers.len() != desc.args.len() {
        return Err(ExecFault::Failed(format!(
            "kernel {name}: {} buffers passed, the descriptor lists {} arguments",
            buffers.len(),
            desc.args.len()
        )));
    }
    let find = |role: ArgRole| {
        desc.args
            .iter()
            .position(|a| a.role == role)
            .ok_or_else(|| ExecFault::Failed(format!("kernel {name}: no {role:?} argument")))
    };
    let (wi, xi, yi) = (
        find(ArgRole::Weight)?,
        find(ArgRole::Activation)?,
        find(ArgRole::Output)?,
    );
    if wi == yi || xi == yi {
        return Err(ExecFault::Failed(format!(
            "kernel {name}: output argument is also an input"
        )));
    }
    // Take the output slice out of the list so the inputs can be borrowed alongside it.
    let y = std::mem::take(&mut buffers[yi]);
    let r = kernels::execute(desc, &buffers[wi][..], &buffers[xi][..], &mut *y);
    buffers[yi] = y;
    r.map_err(|e| ExecFault::Failed(format!("kernel {name}: {e}")))
}

/// A kernel ELF image (START_CU): descriptor from the file, then [`run_desc`].
pub fn run_elf(image: &[u8], buffers: &mut [&mut [u8]]) -> Result<(), ExecFault> {
    let desc = kernels::elf::read_kernel_bytes(image)
        .map_err(|e| ExecFault::Unsupported(format!("kernel ELF image: {e}")))?;
    run_desc(&desc, buffers)
}

/// A shim-TXN stream (opcode 22) whose buffers the caller resolved from [`txn_buffers`].
pub fn run_txn(image: &[u8], buffers: &mut [&mut [u8]]) -> Result<(), ExecFault> {
    let txn = shim_txn::decode(image)
        .map_err(|e| ExecFault::Failed(format!("shim-TXN control code: {e}")))?;
    run_desc(&txn.desc, buffers)
}

/// The buffer addresses a patched shim-TXN stream refers to, in argument order: each slot's
/// address minus 0x8000_0000 and its addend. A pristine (unpatched) slot, a missing or repeated
/// argument index is an error naming the kernel.
pub fn txn_buffers(image: &[u8]) -> Result<Vec<u64>, String> {
    let txn = shim_txn::decode(image).map_err(|e| format!("shim-TXN control code: {e}"))?;
    let name = txn.desc.file_name();
    let n = txn.desc.args.len();
    let mut out: Vec<Option<u64>> = vec![None; n];
    for s in &txn.slots {
        let i = s.arg as usize;
        if i >= n {
            return Err(format!(
                "kernel {name}: slot at {:#x} names argument {i}, the kernel has {n}",
                s.offset
            ));
        }
        if out[i].is_some() {
            return Err(format!("kernel {name}: argument {i} has two slots"));
        }
        let a = s.buffer_address().ok_or_else(|| {
            format!(
                "kernel {name}: slot at {:#x} (argument {i}) holds {:#x}, below 0x8000_0000 + addend {:#x}: not patched",
                s.offset, s.addr48, s.addend
            )
        })?;
        out[i] = Some(a);
    }
    out.into_iter()
        .enumerate()
        .map(|(i, a)| a.ok_or_else(|| format!("kernel {name}: no slot for argument {i}")))
        .collect()
}
