//! The device executor: GEMM kernels from a [`KernelSet`] run on an [`XdnaDevice`] through the
//! amdxdna ioctls (real hardware, or the LD_PRELOAD fake device `tools/xdna-shim` in tests).
//!
//! * **Two flows.** A *full ELF* (toolchain-built, wrapped, control-code flag set) runs the
//!   `docs/protocol.md` §8 way: a context sized from `.note.xrt.configuration` without CONFIG_CU, `.ctrltext`
//!   copied into a 16 KiB-aligned DEV BO, the `.rela.dyn` argument relocations (`shim_dma_48`)
//!   applied to a **pristine** copy on every run, submitted as ERT_START_NPU_PREEMPT_ELF (22). A
//!   *descriptor-only* kernel (host-built, no control code) uses the agreed START_CU ABI: the whole
//!   ELF in a DEV BO configured as CU 0, a regmap {3, image address, words, buffer addresses…}.
//!   Real NPU firmware cannot run a descriptor-only kernel, and nothing in the ioctl interface tells
//!   the fake device from the real one (the shim imitates it on purpose), so descriptor-only
//!   kernels are refused unless explicitly allowed: [`DeviceExecOptions::allow_descriptor_only`],
//!   which [`DeviceExecOptions::from_env`] sets from `XDNA_ALLOW_DESCRIPTOR_KERNELS=1` (the tests
//!   set it for the shim). Refusal is [`KernelError::NoControlCode`] naming the file.
//! * **Resident contexts.** One hardware context per kernel image, kept between calls, at most the
//!   device's context limit (`npu_task_max`; or [`DeviceExecOptions::max_resident`]); the least
//!   recently used one is dropped to make room (also when CREATE_HWCTX reports the limit because
//!   another process holds contexts).
//! * **Weights** are uploaded once per weight matrix, keyed by the matrix's data pointer, length
//!   and a fingerprint of sampled bytes (the model's weights are an mmap that outlives the executor; call
//!   [`DeviceExecutor::forget_weights`] if a matrix's memory is reused). The upload goes to a sealed
//!   memfd imported as a dma-buf (udmabuf → PRIME) when that works, else to a SHARE BO; the path
//!   is logged (`tracing` info) and reported by [`DeviceExecutor::weight_paths`].
//! * **Activations and outputs** use two SHARE BOs reused across calls and grown as needed.
//! * **Argument extents.** Neither ABI carries buffer sizes: a kernel's buffer runs from its device
//!   address to the end of its BO. Every argument is therefore placed at the *tail* of its BO
//!   (address = BO end − length), so a grown, reused BO still hands the kernel exactly `m` rows.
//! * Flushes: SYNC_BO to-device for the weights (once, at upload), the activations and the patched
//!   control code before each submit; from-device for the outputs after completion.
//! * Rows are split by [`RowFamily::passes`]: ≤ 16 rows one m16 pass, else m128 passes of ≤ 128 rows.
//! * **Uploaded handles.** A caller that owns long-lived weights (the model) uploads each matrix
//!   once with [`DeviceExecutor::upload`] and runs it with [`DeviceExecutor::gemm_uploaded`]; the
//!   host copy is then no longer read (the model drops or releases it), so a loaded model holds its
//!   weights once, in the dma-buf pages.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use parking_lot::Mutex;

use super::elf::{self, ArgRole, KernelDesc};
use super::gemm::{HostExecutor, WeightMatrix};
use super::set::{KernelKey, KernelSet, RowFamily};
use super::shim_txn::{self, ArgReloc, DDR_OFFSET};
use super::KernelError;
use crate::device::{
    ert, sealed_memfd, Bo, BoKind, DeviceError, HwContext, SyncDirection, XdnaDevice,
};
use crate::tiles::WeightFormat;

/// Environment switch allowing descriptor-only kernels (see the module docs).
pub const ALLOW_ENV: &str = "XDNA_ALLOW_DESCRIPTOR_KERNELS";
/// Contexts kept when the device reports no limit.
const DEFAULT_MAX_RESIDENT: usize = 6;
/// Control code alignment in device memory (`docs/protocol.md` §8).
const CONTROL_CODE_ALIGN: u64 = 16 << 10;
/// Growth granularity of the activation / output BOs.
const IO_GRANULE: usize = 64 << 10;
/// CMD BO size.
const CMD_BO_SIZE: usize = 4096;
const PAGE: usize = 4096;

/// How weights should reach the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightPathPref {
    /// Sealed memfd + dma-buf import when it works, else a SHARE BO.
    Auto,
    /// Always a SHARE BO.
    Share,
}

/// Which path a weight matrix took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightPath {
    /// Copied into a sealed memfd, exported with udmabuf, PRIME-imported.
    MemfdImport,
    /// Copied into a SHARE BO.
    ShareBo,
}

/// Options of a [`DeviceExecutor`].
#[derive(Clone, Debug)]
pub struct DeviceExecOptions {
    /// Run kernels without control code (only the fake device can). Default: off.
    pub allow_descriptor_only: bool,
    /// Most resident contexts; default: the device's context limit (else 6).
    pub max_resident: Option<usize>,
    /// Per-command wait deadline (default 10 s).
    pub timeout: Option<Duration>,
    /// Weight upload path.
    pub weights: WeightPathPref,
}

impl Default for DeviceExecOptions {
    fn default() -> Self {
        DeviceExecOptions {
            allow_descriptor_only: false,
            max_resident: None,
            timeout: Some(Duration::from_secs(10)),
            weights: WeightPathPref::Auto,
        }
    }
}

impl DeviceExecOptions {
    /// Defaults, with `allow_descriptor_only` from `XDNA_ALLOW_DESCRIPTOR_KERNELS=1`.
    pub fn from_env() -> Self {
        DeviceExecOptions {
            allow_descriptor_only: std::env::var(ALLOW_ENV).is_ok_and(|v| v == "1"),
            ..Default::default()
        }
    }
}

enum Flow {
    /// START_CU with the whole ELF as CU 0.
    Descriptor,
    /// Opcode 22 with `.ctrltext` patched from this pristine copy.
    FullElf {
        ctrltext: Vec<u8>,
        relocs: Vec<ArgReloc>,
    },
}

/// A kernel with its own hardware context. `ctx` is declared first so it is destroyed before the
/// image BO it uses.
struct Resident {
    ctx: HwContext,
    image: Bo,
    flow: Flow,
    key: KernelKey,
    path: PathBuf,
    desc: KernelDesc,
    last_used: u64,
}

/// Which uploaded matrix: keyed by the host slice ([`DeviceExecutor::gemm`]) or by the handle
/// [`DeviceExecutor::upload`] returned (independent of the host memory, which may be gone).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum WeightId {
    Host(WeightKey),
    Handle(u64),
}

/// A weight matrix held by the device, from [`DeviceExecutor::upload`]; run it with
/// [`DeviceExecutor::gemm_uploaded`] on the executor that uploaded it.
#[derive(Clone, Copy, Debug)]
pub struct DeviceWeights {
    id: u64,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    bytes: usize,
    path: WeightPath,
}

impl DeviceWeights {
    /// N (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// K (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The matrix's stored format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }
    /// Bytes handed to the device.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// How the bytes reached the device.
    pub fn path(&self) -> WeightPath {
        self.path
    }
}

struct WeightBo {
    bo: Bo,
    len: usize,
    path: WeightPath,
    /// The memfd behind an imported BO (kept with it).
    _memfd: Option<std::fs::File>,
}

#[derive(Default)]
struct State {
    residents: Vec<Resident>,
    weights: HashMap<WeightId, WeightBo>,
    x: Option<Bo>,
    y: Option<Bo>,
    cmd: Option<Bo>,
    tick: u64,
    patch_in_place: bool,
    /// Next [`DeviceWeights`] id.
    next_handle: u64,
}

/// Runs GEMM kernels on an NPU (see the module docs).
pub struct DeviceExecutor {
    state: Mutex<State>,
    kernels: HashMap<KernelKey, (PathBuf, KernelDesc)>,
    opts: DeviceExecOptions,
    max_resident: usize,
    device: XdnaDevice,
}

impl std::fmt::Debug for DeviceExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceExecutor")
            .field("device", &self.device.path())
            .field("kernels", &self.kernels.len())
            .field("max_resident", &self.max_resident)
            .finish()
    }
}

fn dev_err(path: &Path, source: DeviceError) -> KernelError {
    KernelError::Device {
        path: path.to_path_buf(),
        source,
    }
}

/// Device address of the last `len` bytes of `bo`.
fn tail(bo: &Bo, len: usize) -> (usize, u64) {
    let off = bo.size() - len;
    (off, bo.xdna_addr() + off as u64)
}

impl DeviceExecutor {
    /// An executor over `device` for the kernels of `kernels`, options from the environment
    /// ([`DeviceExecOptions::from_env`]).
    pub fn new(device: XdnaDevice, kernels: &KernelSet) -> DeviceExecutor {
        Self::with_options(device, kernels, DeviceExecOptions::from_env())
    }

    /// As [`DeviceExecutor::new`] with explicit options.
    pub fn with_options(
        device: XdnaDevice,
        kernels: &KernelSet,
        opts: DeviceExecOptions,
    ) -> DeviceExecutor {
        let limit = device
            .context_limit()
            .map(|l| l.max(1) as usize)
            .unwrap_or(DEFAULT_MAX_RESIDENT);
        let max_resident = opts.max_resident.unwrap_or(limit).clamp(1, limit.max(1));
        let kernels = kernels
            .iter()
            .map(|(k, p, d)| (k.clone(), (p.to_path_buf(), d.clone())))
            .collect();
        DeviceExecutor {
            state: Mutex::new(State::default()),
            kernels,
            opts,
            max_resident,
            device,
        }
    }

    /// An executor over the NPU [`XdnaDevice::discover`] finds (`$XDNA_DEVICE`, else the first
    /// `/dev/accel/accelN` that opens as amdxdna), options from the environment. Without a device
    /// the error names `/dev/accel` and what was tried.
    pub fn discover(kernels: &KernelSet) -> Result<DeviceExecutor, KernelError> {
        let device = XdnaDevice::discover().map_err(|e| dev_err(Path::new("/dev/accel"), e))?;
        Ok(Self::new(device, kernels))
    }

    /// The device.
    pub fn device(&self) -> &XdnaDevice {
        &self.device
    }

    /// Most contexts kept resident.
    pub fn max_resident(&self) -> usize {
        self.max_resident
    }

    /// Kernels with a resident context, least recently used first.
    pub fn resident_kernels(&self) -> Vec<KernelKey> {
        let st = self.state.lock();
        let mut r: Vec<(u64, KernelKey)> = st
            .residents
            .iter()
            .map(|r| (r.last_used, r.key.clone()))
            .collect();
        r.sort();
        r.into_iter().map(|(_, k)| k).collect()
    }

    /// The upload path of every weight matrix held, in no particular order.
    pub fn weight_paths(&self) -> Vec<WeightPath> {
        self.state.lock().weights.values().map(|w| w.path).collect()
    }

    /// Drop every uploaded weight matrix (e.g. before the memory behind one is reused).
    pub fn forget_weights(&self) {
        self.state.lock().weights.clear();
    }

    /// Drop every resident context and cached buffer.
    pub fn release_all(&self) {
        let mut st = self.state.lock();
        st.residents.clear();
        st.weights.clear();
        st.x = None;
        st.y = None;
        st.cmd = None;
    }

    /// Test knob: patch the control code in the resident BO itself instead of a fresh copy of the
    /// pristine `.ctrltext` (wrong on purpose: `shim_dma_48` patches add, so the second run carries
    /// doubled addresses). Exists so the tests can show the device refusing that.
    #[doc(hidden)]
    pub fn set_patch_in_place(&self, on: bool) {
        self.state.lock().patch_in_place = on;
    }

    /// `y[m×N] = x[m×K] · Wᵀ`, as [`HostExecutor::gemm`]: the kernel is the set's
    /// `gemm_<wfmt>_m<family>_k<K>_n<N>.elf` for each pass of [`RowFamily::passes`] (≤ 16 rows: one m16
    /// pass; more: m128 passes of up to 128 rows).
    pub fn gemm(
        &self,
        w: &WeightMatrix,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        w.check_bytes()?;
        w.require_tiles("a device executor")?;
        let wid = WeightId::Host(weight_key(w.data));
        let shape = (w.format, w.cols, w.rows);
        self.run_passes(shape, wid, Some(w.data), x, m, y)
    }

    /// Hand `w` to the device once (sealed memfd → udmabuf → PRIME import when that works, else a
    /// SHARE BO; see [`WeightPath`]) and return its handle. The host bytes are not read again:
    /// the caller may drop them or release their pages.
    pub fn upload(&self, w: &WeightMatrix) -> Result<DeviceWeights, KernelError> {
        w.check_bytes()?;
        w.require_tiles("a device upload")?;
        let wbo = self
            .upload_weights(w.data)
            .map_err(|e| dev_err(self.device.path(), e))?;
        let mut st = self.state.lock();
        st.next_handle += 1;
        let handle = DeviceWeights {
            id: st.next_handle,
            format: w.format,
            rows: w.rows,
            cols: w.cols,
            bytes: w.data.len(),
            path: wbo.path,
        };
        st.weights.insert(WeightId::Handle(handle.id), wbo);
        Ok(handle)
    }

    /// As [`DeviceExecutor::gemm`] for a matrix uploaded with [`DeviceExecutor::upload`].
    pub fn gemm_uploaded(
        &self,
        w: &DeviceWeights,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let shape = (w.format, w.cols, w.rows);
        self.run_passes(shape, WeightId::Handle(w.id), None, x, m, y)
    }

    /// The m16 / m128 passes of one GEMM of `shape = (format, K, N)` with the weights `wid`.
    fn run_passes(
        &self,
        (format, k, n): (WeightFormat, usize, usize),
        wid: WeightId,
        data: Option<&[u8]>,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        check_io(k, n, x, m, y)?;
        for (family, rows) in RowFamily::passes(m) {
            let key = KernelKey::gemm(format, family, k, n);
            self.run(
                &key,
                wid,
                data,
                &x[rows.start * k..rows.end * k],
                &mut y[rows.start * n..rows.end * n],
            )?;
        }
        Ok(())
    }

    /// One pass through kernel `key` with the weights `wid` (uploaded from `data` on first use
    /// when given; a handle's weights must already be held).
    fn run(
        &self,
        key: &KernelKey,
        wid: WeightId,
        data: Option<&[u8]>,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let Some((path, _)) = self.kernels.get(key) else {
            return Err(KernelError::Missing(vec![key.file_name()]));
        };
        let mut guard = self.state.lock();
        let st = &mut *guard;
        st.tick += 1;
        let idx = self.resident(st, key, path)?;
        st.residents[idx].last_used = st.tick;
        if let std::collections::hash_map::Entry::Vacant(slot) = st.weights.entry(wid) {
            let Some(data) = data else {
                return Err(dev_err(
                    path,
                    DeviceError::Invalid(
                        "uploaded weights are no longer held (forget_weights or release_all was called)"
                            .into(),
                    ),
                ));
            };
            slot.insert(self.upload_weights(data).map_err(|e| dev_err(path, e))?);
        }
        let x_bytes: &[u8] = bytemuck::cast_slice(x);
        let y_len = std::mem::size_of_val(y);
        grow(&self.device, &mut st.x, x_bytes.len()).map_err(|e| dev_err(path, e))?;
        grow(&self.device, &mut st.y, y_len).map_err(|e| dev_err(path, e))?;
        if st.cmd.is_none() {
            st.cmd = Some(
                Bo::new(&self.device, BoKind::Cmd, CMD_BO_SIZE).map_err(|e| dev_err(path, e))?,
            );
        }
        let result = self.submit(st, idx, wid, x_bytes, y);
        if let Err(e) = &result {
            // A context whose command failed is not trusted again (the driver may have marked it
            // bad); it is destroyed now and recreated on the next call.
            tracing::warn!("{e}; dropping its hardware context");
            st.residents.remove(idx);
        }
        result
    }

    fn submit(
        &self,
        st: &mut State,
        idx: usize,
        wid: WeightId,
        x_bytes: &[u8],
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let State {
            residents,
            weights,
            x: xbo,
            y: ybo,
            cmd,
            patch_in_place,
            ..
        } = st;
        let r = &mut residents[idx];
        let path = r.path.clone();
        let e = |source| dev_err(&path, source);
        let (Some(wb), Some(xbo), Some(ybo), Some(cmd)) =
            (weights.get(&wid), xbo.as_mut(), ybo.as_mut(), cmd.as_mut())
        else {
            return Err(e(DeviceError::Other("executor buffers missing".into())));
        };
        let y_len = std::mem::size_of_val(y);
        let (x_off, x_addr) = tail(xbo, x_bytes.len());
        let (_, w_addr) = tail(&wb.bo, wb.len);
        let (y_off, y_addr) = tail(ybo, y_len);
        xbo.write(x_off, x_bytes).map_err(e)?;
        xbo.sync_range(SyncDirection::ToDevice, x_off, x_bytes.len())
            .map_err(e)?;
        // Argument addresses in the descriptor's argument order.
        let mut addrs = Vec::with_capacity(r.desc.args.len());
        for a in &r.desc.args {
            addrs.push(match a.role {
                ArgRole::Weight => w_addr,
                ArgRole::Activation => x_addr,
                ArgRole::Output => y_addr,
                ArgRole::Scratch => {
                    return Err(KernelError::Unsupported(format!(
                        "{}: scratch arguments are not supported by the device executor",
                        path.display()
                    )))
                }
            });
        }
        let (packet, command) = match &r.flow {
            Flow::Descriptor => {
                let ninstr = u32::try_from(r.image.size().div_ceil(4))
                    .map_err(|_| e(DeviceError::Invalid("kernel image too large".into())))?;
                let p = ert::start_cu(1, r.image.xdna_addr(), ninstr, &addrs)
                    .map_err(|x| e(x.into()))?;
                (p, format!("{} (START_CU)", r.key.file_name()))
            }
            Flow::FullElf { ctrltext, relocs } => {
                let mut code = if *patch_in_place {
                    r.image.as_slice()[..ctrltext.len()].to_vec()
                } else {
                    ctrltext.clone()
                };
                for rel in relocs {
                    let Some(&addr) = addrs.get(rel.arg) else {
                        return Err(KernelError::elf(
                            &path,
                            super::ElfReason::BadDescriptor(format!(
                                "relocation for argument {} but the kernel has {} arguments",
                                rel.arg,
                                addrs.len()
                            )),
                        ));
                    };
                    let value = addr
                        .wrapping_add(rel.addend as u64)
                        .wrapping_add(DDR_OFFSET);
                    shim_txn::patch_shim_dma_48(&mut code, rel.offset, value)
                        .map_err(|m| KernelError::elf(&path, super::ElfReason::BadDescriptor(m)))?;
                }
                r.image.write(0, &code).map_err(e)?;
                r.image
                    .sync_range(SyncDirection::ToDevice, 0, code.len())
                    .map_err(e)?;
                let size = u32::try_from(code.len())
                    .map_err(|_| e(DeviceError::Invalid("control code too large".into())))?;
                let p = ert::start_npu_preempt_elf(&ert::PreemptData {
                    instruction: r.image.xdna_addr(),
                    instruction_size: size,
                    ..Default::default()
                })
                .map_err(|x| e(x.into()))?;
                (p, format!("{} (PREEMPT_ELF)", r.key.file_name()))
            }
        };
        cmd.write(0, &ert::to_bytes(&packet)).map_err(e)?;
        let args: [&Bo; 4] = [&r.image, &wb.bo, xbo, ybo];
        let seq = r.ctx.submit(cmd, &args).map_err(e)?;
        r.ctx.wait(seq, self.opts.timeout, &command).map_err(e)?;
        r.ctx.check_state(cmd, seq, &command).map_err(e)?;
        ybo.sync_range(SyncDirection::FromDevice, y_off, y_len)
            .map_err(e)?;
        ybo.read(y_off, bytemuck::cast_slice_mut(y)).map_err(e)?;
        Ok(())
    }

    /// Index of `key`'s resident context, creating it (and evicting the LRU one) if needed.
    fn resident(&self, st: &mut State, key: &KernelKey, path: &Path) -> Result<usize, KernelError> {
        if let Some(i) = st.residents.iter().position(|r| &r.key == key) {
            return Ok(i);
        }
        let bytes = std::fs::read(path).map_err(|e| KernelError::io(path, e))?;
        let desc = elf::read_kernel_bytes(&bytes).map_err(|r| KernelError::elf(path, r))?;
        if !desc.has_control_code && !self.opts.allow_descriptor_only {
            return Err(KernelError::NoControlCode {
                path: path.to_path_buf(),
            });
        }
        let flow = if desc.has_control_code {
            let f = shim_txn::read_full_elf(&bytes).map_err(|r| KernelError::elf(path, r))?;
            if let Some(bad) = f.relocs.iter().find(|r| r.arg >= desc.args.len()) {
                return Err(KernelError::elf(
                    path,
                    super::ElfReason::BadDescriptor(format!(
                        "relocation for argument {} but the descriptor lists {}",
                        bad.arg,
                        desc.args.len()
                    )),
                ));
            }
            Flow::FullElf {
                ctrltext: f.ctrltext,
                relocs: f.relocs,
            }
        } else {
            Flow::Descriptor
        };
        while st.residents.len() >= self.max_resident {
            evict_lru(st);
        }
        loop {
            match self.create(&bytes, &flow, &desc) {
                Ok((ctx, image)) => {
                    tracing::debug!(
                        "{}: resident on hardware context {} ({} columns)",
                        path.display(),
                        ctx.handle(),
                        ctx.ncols()
                    );
                    st.residents.push(Resident {
                        ctx,
                        image,
                        flow,
                        key: key.clone(),
                        path: path.to_path_buf(),
                        desc,
                        last_used: st.tick,
                    });
                    return Ok(st.residents.len() - 1);
                }
                // Someone else holds contexts: make room from ours, if we have any.
                Err(err) if is_context_limit(&err) && !st.residents.is_empty() => evict_lru(st),
                Err(err) => return Err(dev_err(path, err)),
            }
        }
    }

    fn create(
        &self,
        bytes: &[u8],
        flow: &Flow,
        desc: &KernelDesc,
    ) -> Result<(HwContext, Bo), DeviceError> {
        let ncols = desc.partition_columns;
        match flow {
            Flow::Descriptor => {
                let mut padded = bytes.to_vec();
                padded.resize(bytes.len().div_ceil(4) * 4, 0);
                let image = Bo::with_data(&self.device, BoKind::Dev, &padded)?;
                let ctx = HwContext::with_image(&self.device, ncols, &image)?;
                Ok((ctx, image))
            }
            Flow::FullElf { ctrltext, .. } => {
                let image = Bo::with_data(&self.device, BoKind::Dev, ctrltext)?;
                if image.xdna_addr() % CONTROL_CODE_ALIGN != 0 {
                    return Err(DeviceError::Invalid(format!(
                        "control code DEV BO at {:#x} is not 16 KiB-aligned",
                        image.xdna_addr()
                    )));
                }
                let ctx = HwContext::new(&self.device, ncols)?;
                Ok((ctx, image))
            }
        }
    }

    fn upload_weights(&self, data: &[u8]) -> Result<WeightBo, DeviceError> {
        if self.opts.weights == WeightPathPref::Auto {
            match self.upload_memfd(data) {
                Ok(w) => {
                    tracing::debug!(
                        "weights ({} bytes): sealed memfd imported as a dma-buf",
                        data.len()
                    );
                    return Ok(w);
                }
                Err(e) => tracing::info!(
                    "weights ({} bytes): memfd/dma-buf import unavailable ({e}); using a SHARE BO",
                    data.len()
                ),
            }
        } else {
            tracing::debug!("weights ({} bytes): SHARE BO", data.len());
        }
        let size = data.len().max(1);
        let mut bo = Bo::new(&self.device, BoKind::Share, size)?;
        bo.write(size - data.len(), data)?;
        bo.sync(SyncDirection::ToDevice)?;
        Ok(WeightBo {
            bo,
            len: data.len(),
            path: WeightPath::ShareBo,
            _memfd: None,
        })
    }

    fn upload_memfd(&self, data: &[u8]) -> Result<WeightBo, DeviceError> {
        let size = data.len().max(1).div_ceil(PAGE) * PAGE;
        let fd = sealed_memfd("xdna-weights", size)?;
        let file = std::fs::File::from(fd);
        file.write_all_at(data, (size - data.len()) as u64)
            .map_err(|source| DeviceError::Mem {
                path: PathBuf::from("memfd"),
                what: "write weights".into(),
                source,
            })?;
        let bo = self.device.import_memfd(file.as_fd(), 0, size)?;
        if bo.size() != size {
            return Err(DeviceError::Other(format!(
                "imported weight BO has {} bytes, expected {size}",
                bo.size()
            )));
        }
        bo.sync(SyncDirection::ToDevice)?;
        Ok(WeightBo {
            bo,
            len: data.len(),
            path: WeightPath::MemfdImport,
            _memfd: Some(file),
        })
    }
}

/// `x` holds `m × K` values and `y` at least `m × N`.
fn check_io(k: usize, n: usize, x: &[f32], m: usize, y: &[f32]) -> Result<(), KernelError> {
    if x.len() != m * k {
        return Err(KernelError::Shape {
            what: "activations x (m × K)",
            expected: m * k,
            got: x.len(),
        });
    }
    if y.len() < m * n {
        return Err(KernelError::Shape {
            what: "output y (m × N)",
            expected: m * n,
            got: y.len(),
        });
    }
    Ok(())
}

/// Identity of an uploaded weight matrix: data pointer, length and a fingerprint of 16 sampled
/// 64-byte windows (so a matrix freed and replaced at the same address is not mistaken for the old
/// one in the common case; [`DeviceExecutor::forget_weights`] is the sure way).
type WeightKey = (usize, usize, u64);

fn weight_key(data: &[u8]) -> WeightKey {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let n = data.len();
    for i in 0..16 {
        let start = (n.saturating_sub(64)) * i / 15;
        data[start..(start + 64).min(n)].hash(&mut h);
    }
    (data.as_ptr() as usize, n, h.finish())
}

fn is_context_limit(e: &DeviceError) -> bool {
    match e {
        DeviceError::ContextLimit { .. } => true,
        DeviceError::Ioctl { source, .. } => {
            matches!(
                source.raw_os_error(),
                Some(libc::EBUSY) | Some(libc::ENODEV)
            )
        }
        _ => false,
    }
}

fn evict_lru(st: &mut State) {
    if let Some((i, _)) = st
        .residents
        .iter()
        .enumerate()
        .min_by_key(|(_, r)| r.last_used)
    {
        let r = st.residents.remove(i);
        tracing::debug!(
            "{}: evicting hardware context {} (least recently used)",
            r.path.display(),
            r.ctx.handle()
        );
    }
}

/// Make `slot` a SHARE BO of at least `len` bytes (grown in 64 KiB steps).
fn grow(dev: &XdnaDevice, slot: &mut Option<Bo>, len: usize) -> Result<(), DeviceError> {
    if slot.as_ref().is_some_and(|b| b.size() >= len) {
        return Ok(());
    }
    *slot = None;
    let size = len.max(1).div_ceil(IO_GRANULE) * IO_GRANULE;
    *slot = Some(Bo::new(dev, BoKind::Share, size)?);
    Ok(())
}

/// The GEMM backend the model calls: the host CPU or an NPU, behind one `gemm`.
#[derive(Debug)]
pub enum Executor {
    /// Host executors (AVX2 / scalar) over the worker pool.
    Host(HostExecutor),
    /// Kernels on an xdna device.
    Device(Box<DeviceExecutor>),
}

impl Executor {
    /// `y[m×N] = x[m×K] · Wᵀ` on this backend (same contract as [`HostExecutor::gemm`]).
    pub fn gemm(
        &self,
        w: &WeightMatrix,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        match self {
            Executor::Host(h) => h.gemm(w, x, m, y),
            Executor::Device(d) => d.gemm(w, x, m, y),
        }
    }

    /// `host` or `xdna`.
    pub fn name(&self) -> &'static str {
        match self {
            Executor::Host(_) => "host",
            Executor::Device(_) => "xdna",
        }
    }
}
