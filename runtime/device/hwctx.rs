//! Hardware contexts: creation within the firmware limit, CONFIG_CU,
//! EXEC_CMD, completion and the command-state check.

// Unsafe is needed here only to read CLOCK_MONOTONIC through libc for absolute wait deadlines.
#![allow(unsafe_code)]

use super::bo::{Bo, BoKind, SyncDirection};
use super::ert::{self, CmdState};
use super::uapi::{self, CuConfig};
use super::xdna::{is_unsupported, Inner, XdnaDevice};
use super::{errno_of, DeviceError, Result};
use crate::ffi;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a finished command ended (only returned for COMPLETED).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Sequence number EXEC_CMD returned.
    pub seq: u64,
    /// Final state (always COMPLETED when returned as Ok).
    pub state: CmdState,
}

/// A hardware context and its timeline syncobj. Destroyed on drop.
pub struct HwContext {
    dev: Arc<Inner>,
    handle: u32,
    syncobj: u32,
    ncols: u32,
    cu_configured: bool,
    /// GEM handles of the configured CUs, in CU-index order.
    cus: Vec<u32>,
    cmd: Option<Bo>,
}

impl std::fmt::Debug for HwContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HwContext")
            .field("handle", &self.handle)
            .field("syncobj", &self.syncobj)
            .field("ncols", &self.ncols)
            .finish()
    }
}

/// CMD BO size used by the convenience runners (one page holds any packet
/// the non-chain path accepts).
const CMD_BO_SIZE: usize = 4096;

/// Required alignment of control code in device memory.
const CONTROL_CODE_ALIGN: u64 = 16 << 10;

/// Removes repeated handles, keeping first occurrences in order (the driver
/// rejects duplicates).
pub(crate) fn dedup_handles(handles: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for h in handles {
        if !out.contains(&h) {
            out.push(h);
        }
    }
    out
}

/// CLOCK_MONOTONIC now, in ns.
fn monotonic_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec)
}

impl HwContext {
    /// CREATE_HWCTX over `ncols` columns (num_tiles = ncols × core rows),
    /// zeroed 32-byte QoS with user_start_col 0xFF. Refused when the
    /// context limit is reached.
    pub fn new(dev: &XdnaDevice, ncols: u32) -> Result<HwContext> {
        let inner = dev.inner.clone();
        if ncols == 0 || ncols > inner.cols {
            return Err(DeviceError::Invalid(format!(
                "{}: a context needs 1..={} columns, not {ncols}",
                inner.path.display(),
                inner.cols
            )));
        }
        if let Some(limit) = inner.context_limit {
            let mut live = inner.live_contexts.load(Ordering::Relaxed);
            if let Ok(Some(r)) = dev.resource_info() {
                live = live.max(r.npu_task_curr);
            }
            if live >= limit {
                return Err(DeviceError::ContextLimit {
                    path: inner.path.clone(),
                    live,
                    limit,
                });
            }
        }
        let num_tiles = ncols * inner.core_rows;
        let qos = uapi::qos_default();
        let c = uapi::create_hwctx(inner.fd(), &qos, num_tiles, 0).map_err(|e| {
            let mut err = inner.ioctl_err("DRM_IOCTL_AMDXDNA_CREATE_HWCTX", e);
            if let DeviceError::Ioctl { source, hint, .. } = &mut err {
                *hint = match errno_of(source) {
                    libc::ENOENT => {
                        " (no device heap: create and mmap the 64 MiB DEV_HEAP before any context)"
                            .into()
                    }
                    libc::ENODEV | libc::EBUSY => " (no free columns / context limit)".into(),
                    libc::EINVAL => format!(
                        " (num_tiles {num_tiles} = {ncols} columns × {} core rows)",
                        inner.core_rows
                    ),
                    _ => String::new(),
                };
            }
            err
        })?;
        inner.live_contexts.fetch_add(1, Ordering::Relaxed);
        Ok(HwContext {
            dev: inner,
            handle: c.handle,
            syncobj: c.syncobj_handle,
            ncols,
            cu_configured: false,
            cus: Vec::new(),
            cmd: None,
        })
    }

    /// A context configured with one CU whose image is the DEV BO `image`
    /// (the descriptor-kernel ABI: CONFIG_CU {cu_bo = image, cu_func = 0}).
    pub fn with_image(dev: &XdnaDevice, ncols: u32, image: &Bo) -> Result<HwContext> {
        let mut ctx = Self::new(dev, ncols)?;
        ctx.configure_cu(&[(image, 0)])?;
        Ok(ctx)
    }

    /// Context handle.
    pub fn handle(&self) -> u32 {
        self.handle
    }
    /// Timeline syncobj handle (0 on UMQ devices).
    pub fn syncobj(&self) -> u32 {
        self.syncobj
    }
    /// Columns.
    pub fn ncols(&self) -> u32 {
        self.ncols
    }

    /// CONFIG_CU: write-once, 1..=32 CUs, each a DEV BO.
    pub fn configure_cu(&mut self, cus: &[(&Bo, u8)]) -> Result<()> {
        if self.cu_configured {
            return Err(DeviceError::Invalid(format!(
                "hardware context {}: CONFIG_CU is write-once; create a new context for a new design",
                self.handle
            )));
        }
        if cus.is_empty() || cus.len() > ffi::AMDXDNA_MAX_CUS as usize {
            return Err(DeviceError::Invalid(format!(
                "CONFIG_CU takes 1..=32 CUs, not {}",
                cus.len()
            )));
        }
        if let Some((bo, _)) = cus.iter().find(|(bo, _)| bo.kind() != BoKind::Dev) {
            return Err(DeviceError::Invalid(format!(
                "CU image BO {} is {:?}; CONFIG_CU needs a DEV BO",
                bo.handle(),
                bo.kind()
            )));
        }
        for (bo, _) in cus {
            bo.sync(SyncDirection::ToDevice)?;
        }
        let cfg: Vec<CuConfig> = cus
            .iter()
            .map(|(bo, func)| CuConfig {
                cu_bo: bo.handle(),
                cu_func: *func,
            })
            .collect();
        uapi::config_cu(self.dev.fd(), self.handle, &cfg).map_err(|e| {
            self.dev
                .ioctl_err("DRM_IOCTL_AMDXDNA_CONFIG_HWCTX(CONFIG_CU)", e)
        })?;
        self.cu_configured = true;
        self.cus = cfg.iter().map(|c| c.cu_bo).collect();
        Ok(())
    }

    /// EXEC_CMD of `cmd` (a CMD BO holding a packet) with every BO it
    /// touches (duplicates removed) → seq.
    pub fn submit(&self, cmd: &Bo, args: &[&Bo]) -> Result<u64> {
        let handles = dedup_handles(args.iter().map(|b| b.handle()));
        let r = uapi::exec_cmd(self.dev.fd(), self.handle, cmd.handle(), &handles)
            .map_err(|e| self.dev.ioctl_err("DRM_IOCTL_AMDXDNA_EXEC_CMD", e))?;
        Ok(r.seq)
    }

    /// Waits for `seq`: SYNCOBJ_TIMELINE_WAIT (WAIT_FOR_SUBMIT, absolute
    /// CLOCK_MONOTONIC deadline), or WAIT_CMD on the out-of-tree driver or
    /// a context without syncobj. EINTR/EAGAIN are retried. `None` = forever.
    pub fn wait(&self, seq: u64, timeout: Option<Duration>, command: &str) -> Result<()> {
        let timed_out = |ms: u64| DeviceError::Timeout {
            path: self.dev.path.clone(),
            context: self.handle,
            command: command.to_string(),
            seq,
            timeout_ms: ms,
        };
        let timeout_ms = timeout.map(|t| t.as_millis() as u64).unwrap_or(0);
        if self.dev.version.uses_wait_cmd() || self.syncobj == 0 {
            let deadline = timeout.map(|t| Instant::now() + t);
            loop {
                let ms = match deadline {
                    None => 0,
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return Err(timed_out(timeout_ms));
                        }
                        left.as_millis().clamp(1, u32::MAX as u128) as u32
                    }
                };
                match uapi::wait_cmd(self.dev.fd(), self.handle, seq, ms) {
                    Ok(_) => return Ok(()),
                    Err(e) if retryable(&e) => continue,
                    Err(e) if errno_of(&e) == libc::ETIME => return Err(timed_out(timeout_ms)),
                    Err(e) if is_unsupported(&e) && self.syncobj != 0 => break,
                    Err(e) if is_unsupported(&e) => {
                        tracing::debug!("WAIT_CMD: {e}");
                        return Err(DeviceError::Unsupported {
                            path: self.dev.path.clone(),
                            what: "WAIT_CMD (needed: this context has no syncobj)",
                            version: self.dev.version.to_string(),
                        });
                    }
                    Err(e) => return Err(self.dev.ioctl_err("DRM_IOCTL_AMDXDNA_WAIT_CMD", e)),
                }
            }
        }
        let deadline = match timeout {
            None => i64::MAX,
            Some(t) => monotonic_ns().saturating_add(t.as_nanos().min(i64::MAX as u128) as i64),
        };
        loop {
            match uapi::syncobj_timeline_wait(
                self.dev.fd(),
                self.syncobj,
                seq,
                deadline,
                ffi::DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT,
            ) {
                Ok(_) => return Ok(()),
                Err(e) if retryable(&e) => continue,
                Err(e) if errno_of(&e) == libc::ETIME => return Err(timed_out(timeout_ms)),
                Err(e) => return Err(self.dev.ioctl_err("DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT", e)),
            }
        }
    }

    /// Reads the state of the packet in `cmd`; anything but COMPLETED is a
    /// [`DeviceError::CommandFailed`] naming state, context and command.
    pub fn check_state(&self, cmd: &Bo, seq: u64, command: &str) -> Result<Completion> {
        let mut w = [0u8; 4];
        cmd.read(0, &mut w)?;
        let state = CmdState::from_header(u32::from_le_bytes(w));
        if state != CmdState::Completed {
            return Err(DeviceError::CommandFailed {
                path: self.dev.path.clone(),
                state,
                context: self.handle,
                command: command.to_string(),
                seq,
            });
        }
        Ok(Completion { seq, state })
    }

    /// Writes `packet` into `cmd`, flushes `args`, submits, waits, checks
    /// the state, and invalidates `args` for CPU reads.
    pub fn run_packet(
        &self,
        cmd: &mut Bo,
        packet: &[u32],
        args: &[&Bo],
        timeout: Option<Duration>,
        command: &str,
    ) -> Result<Completion> {
        if cmd.kind() != BoKind::Cmd {
            return Err(DeviceError::Invalid(format!(
                "BO {} is {:?}; commands go in a CMD BO",
                cmd.handle(),
                cmd.kind()
            )));
        }
        cmd.write(0, &ert::to_bytes(packet))?;
        for b in args {
            b.sync(SyncDirection::ToDevice)?;
        }
        let seq = self.submit(cmd, args)?;
        self.wait(seq, timeout, command)?;
        let done = self.check_state(cmd, seq, command)?;
        for b in args {
            b.sync(SyncDirection::FromDevice)?;
        }
        Ok(done)
    }

    /// Runs a descriptor-kernel image with the START_CU regmap ABI: the
    /// context must have been configured with `image` as CU 0
    /// ([`HwContext::with_image`]); `buffers` are passed by device address in
    /// order; EXEC args are [image, buffers...] de-duplicated.
    pub fn run_start_cu(
        &mut self,
        image: &Bo,
        buffers: &[&Bo],
        timeout: Option<Duration>,
    ) -> Result<Completion> {
        if image.kind() != BoKind::Dev {
            return Err(DeviceError::Invalid(format!(
                "kernel image BO {} is {:?}; it must be a DEV BO",
                image.handle(),
                image.kind()
            )));
        }
        if self.cus.first() != Some(&image.handle()) {
            return Err(DeviceError::Invalid(format!(
                "hardware context {}: CU 0 is {:?}, not image BO {}; create the context with HwContext::with_image",
                self.handle,
                self.cus.first(),
                image.handle()
            )));
        }
        let addrs: Vec<u64> = buffers.iter().map(|b| b.xdna_addr()).collect();
        let ninstr = (image.size() / 4) as u32;
        let packet = ert::start_cu(1, image.xdna_addr(), ninstr, &addrs)?;
        let command = format!(
            "START_CU(image BO {}, {} buffers)",
            image.handle(),
            buffers.len()
        );
        let mut args: Vec<&Bo> = Vec::with_capacity(buffers.len() + 1);
        args.push(image);
        args.extend_from_slice(buffers);
        self.run_cached(&packet, &args, timeout, &command)
    }

    /// Runs ERT_START_NPU: `instr` (a DEV BO, 16 KiB-aligned) holds the
    /// instruction stream, `arg_words` follow `ert_npu_data`, `bos` are all
    /// buffers the command touches (EXEC args, with `instr`).
    pub fn run_start_npu(
        &mut self,
        instr: &Bo,
        arg_words: &[u32],
        bos: &[&Bo],
        timeout: Option<Duration>,
    ) -> Result<Completion> {
        check_control_code(instr)?;
        let size = u32::try_from(instr.size()).map_err(|_| {
            DeviceError::Invalid(format!("instruction BO {} is too large", instr.handle()))
        })?;
        let packet = ert::start_npu(1, instr.xdna_addr(), size, arg_words)?;
        let command = format!("START_NPU(instr BO {})", instr.handle());
        let mut args: Vec<&Bo> = vec![instr];
        args.extend_from_slice(bos);
        self.run_cached(&packet, &args, timeout, &command)
    }

    /// Runs ERT_START_NPU_PREEMPT_ELF (opcode 22), the full-ELF flow: the
    /// context was created without CONFIG_CU; `instr` (DEV BO, 16 KiB-aligned)
    /// holds the patched control code; `bos` are every BO it references.
    pub fn run_preempt_elf(
        &mut self,
        instr: &Bo,
        bos: &[&Bo],
        timeout: Option<Duration>,
    ) -> Result<Completion> {
        check_control_code(instr)?;
        let size = u32::try_from(instr.size()).map_err(|_| {
            DeviceError::Invalid(format!("instruction BO {} is too large", instr.handle()))
        })?;
        let data = ert::PreemptData {
            instruction: instr.xdna_addr(),
            instruction_size: size,
            ..Default::default()
        };
        let packet = ert::start_npu_preempt_elf(&data)?;
        let command = format!("START_NPU_PREEMPT_ELF(instr BO {})", instr.handle());
        let mut args: Vec<&Bo> = vec![instr];
        args.extend_from_slice(bos);
        self.run_cached(&packet, &args, timeout, &command)
    }

    /// `run_packet` with this context's cached 4 KiB CMD BO.
    fn run_cached(
        &mut self,
        packet: &[u32],
        args: &[&Bo],
        timeout: Option<Duration>,
        command: &str,
    ) -> Result<Completion> {
        if packet.len() * 4 > CMD_BO_SIZE {
            return Err(DeviceError::Invalid(format!(
                "{command}: packet of {} words does not fit a {CMD_BO_SIZE}-byte CMD BO",
                packet.len()
            )));
        }
        let mut cmd = match self.cmd.take() {
            Some(c) => c,
            None => Bo::new_from_inner(&self.dev, BoKind::Cmd, CMD_BO_SIZE)?,
        };
        let r = self.run_packet(&mut cmd, packet, args, timeout, command);
        self.cmd = Some(cmd);
        r
    }
}

/// Control code must sit in a DEV BO at a 16 KiB-aligned device address: the
/// firmware accepts a misaligned one and never completes it (`docs/protocol.md` §8).
fn check_control_code(instr: &Bo) -> Result<()> {
    if instr.kind() != BoKind::Dev {
        return Err(DeviceError::Invalid(format!(
            "instruction BO {} is {:?}; control code must be in a DEV BO",
            instr.handle(),
            instr.kind()
        )));
    }
    if !instr.xdna_addr().is_multiple_of(CONTROL_CODE_ALIGN) {
        return Err(DeviceError::Invalid(format!(
            "instruction BO {} at device address {:#x} is not 16 KiB-aligned",
            instr.handle(),
            instr.xdna_addr()
        )));
    }
    Ok(())
}

fn retryable(e: &io::Error) -> bool {
    matches!(errno_of(e), libc::EINTR | libc::EAGAIN)
}

impl Drop for HwContext {
    fn drop(&mut self) {
        self.cmd = None;
        if self.syncobj != 0 {
            if let Err(e) = uapi::syncobj_destroy(self.dev.fd(), self.syncobj) {
                tracing::warn!("SYNCOBJ_DESTROY {}: {e}", self.syncobj);
            }
        }
        if let Err(e) = uapi::destroy_hwctx(self.dev.fd(), self.handle) {
            tracing::warn!("DESTROY_HWCTX {}: {e}", self.handle);
        }
        self.dev.live_contexts.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dedup_keeps_order() {
        assert_eq!(dedup_handles([5, 3, 5, 7, 3, 9]), vec![5, 3, 7, 9]);
        assert_eq!(dedup_handles([]), Vec::<u32>::new());
    }

    #[test]
    fn monotonic_is_positive() {
        let a = monotonic_ns();
        let b = monotonic_ns();
        assert!(a > 0 && b >= a);
    }
}
