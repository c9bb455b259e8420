//! Loading a model package onto the kernels layer: the fast path's weights.
//!
//! Every projection runs through one [`kernels::Executor`]:
//! * **host**: [`kernels::HostExecutor`]; matrices stay where the package mapped them (zero-copy).
//! * **xdna**: [`kernels::DeviceExecutor`] running the package's kernel set on the NPU (or the
//!   fake device). Each matrix is handed to the device once at load
//!   ([`kernels::DeviceExecutor::upload`]: dma-buf weight buffers); afterwards the host copy is not
//!   read, so its mapped pages are released (and fused copies freed) to hold the weights once.
//! * **auto**: xdna when a device node opens and the kernel set can run on it, else host.
//!
//! The choice and its reason, and the path the weights took, are stated on stderr (one line each).
//! Packages with separate q/k/v and gate/up (FastFlowLM) are fused at load by concatenating tile
//! row blocks into an owned buffer. When a kernel set is given (or found in the package), every
//! shape the model needs must be present; the error names every missing file. The xdna backend
//! needs one. The model layer never touches the device itself: it only calls kernels-layer APIs.

use super::layers::{swiglu_after_gemm, Embedding, Layer, LayerWeights, ModelWeights, Projection};
use super::ModelError;
use crate::kernels::host_layout::{self, append_group_records, Packing};
use crate::kernels::{
    self, DeviceExecutor, DeviceWeights, Executor, HostExecutor, KernelSet, RowFamily,
    WeightMatrix, WeightPath,
};
use crate::tiles::{self, WeightFormat};
use crate::weights::{MappedBytes, MatrixView, ModelConfig, Package};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which executor runs the projections (on the command line: `crate::cli::ModelArgs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The NPU if an amdxdna device opens, else host.
    Auto,
    /// The host executor.
    Host,
    /// The NPU through the amdxdna driver (fails when no device opens).
    Xdna,
}

/// Options of [`load`].
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Which executor runs the projections.
    pub backend: Backend,
    /// Kernel set directory; `None`: `<package>/kernels` if present.
    pub kernels: Option<PathBuf>,
    /// Run projections with the kernels layer's exact reference executor (f32 activations, f64
    /// sums; slow): the fast forward's own code without q8 activation rounding, for verification.
    pub exact: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            backend: Backend::Auto,
            kernels: None,
            exact: false,
        }
    }
}

/// Stored bytes of one matrix: read in place from the package mapping, or owned (fused or
/// re-laid at load): `buf[start..]`, where a fused copy starts on a cache line (a kernel's
/// 64-byte loads then never straddle two lines).
enum Bytes {
    Mapped(MappedBytes),
    Owned { buf: Vec<u8>, start: usize },
}

impl Bytes {
    /// `len` bytes written by `fill` into a buffer whose first byte starts a cache line.
    fn owned_aligned(len: usize, fill: impl FnOnce(&mut Vec<u8>)) -> Bytes {
        const LINE: usize = 64;
        // Reserved in full first, so the buffer never moves and the offset stays valid.
        let mut buf: Vec<u8> = Vec::with_capacity(len + LINE - 1);
        let start = buf.as_ptr().align_offset(LINE).min(LINE - 1);
        buf.resize(start, 0);
        fill(&mut buf);
        Bytes::Owned { buf, start }
    }

    fn owned(buf: Vec<u8>) -> Bytes {
        Bytes::Owned { buf, start: 0 }
    }
}

/// Where a projection's matrix lives.
enum Store {
    /// Host memory (run by the host executor, or the exact reference).
    Host(Bytes),
    /// Handed to the device at load; the host bytes are gone or released.
    Device(DeviceWeights),
}

/// A projection executed by the kernels layer.
pub struct KernelProjection {
    store: Store,
    exec: Arc<Executor>,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    streamed: usize,
    exact: bool,
    /// Tiles as stored, or the host executor's group records (see `use_host_layout`).
    packing: Packing,
}

impl KernelProjection {
    fn matrix(&self) -> Result<WeightMatrix<'_>, ModelError> {
        let data: &[u8] =
            match &self.store {
                Store::Host(Bytes::Mapped(b)) => &b[..],
                Store::Host(Bytes::Owned { buf, start }) => &buf[*start..],
                Store::Device(_) => return Err(ModelError::State {
                    what:
                        "the projection's weights were handed to the device; no host copy is kept"
                            .into(),
                }),
            };
        Ok(match self.packing {
            Packing::Tiles => WeightMatrix::new(self.format, self.rows, self.cols, data)?,
            Packing::GroupRecords => {
                WeightMatrix::group_records(self.format, self.rows, self.cols, data)?
            }
            Packing::InterleavedRows => {
                WeightMatrix::interleaved_rows(self.format, self.rows, self.cols, data)?
            }
            Packing::KTiles => WeightMatrix::k_tiles(self.format, self.rows, self.cols, data)?,
        })
    }

    /// Re-lay the matrix in the host executor's own layout, where its format has one
    /// (`kernels::host_layout`), replacing the stored bytes; mapped pages are released. q4_1 /
    /// Q8 tiles become group records (no tile padding, one stream per row block: decode streams
    /// ~20 % fewer bytes for SmolLM2, whose K = 576 pads to 768 in tiles), and IQ4_NL, Q5_0 and
    /// Q5_1 rows are interleaved 8 at a time where `exec` runs them so, and GGUF Q4_K, Q5_K and
    /// IQ4_XS rows become K tiles where `exec` runs those (AVX2 without VNNI). Other formats keep
    /// their bytes. Results are bit-identical to the stored layout's for the records, and for the
    /// interleaved rows and K tiles on every path but the one they are laid out for.
    fn use_host_layout(&mut self, exec: &HostExecutor) -> Result<(), ModelError> {
        let Store::Host(bytes) = &self.store else {
            return Ok(());
        };
        if self.packing != Packing::Tiles {
            return Ok(());
        }
        let (data, mapped): (&[u8], Option<&MappedBytes>) = match bytes {
            Bytes::Mapped(b) => (&b[..], Some(b)),
            Bytes::Owned { buf, start } => (&buf[*start..], None),
        };
        let packing = if host_layout::record_bytes(self.format).is_some() {
            Packing::GroupRecords
        } else if exec.interleaves_rows(self.format) {
            Packing::InterleavedRows
        } else if exec.k_tiles(self.format, self.rows) {
            Packing::KTiles
        } else {
            return Ok(());
        };
        let packed_bytes = match packing {
            Packing::GroupRecords => {
                host_layout::records_matrix_bytes(self.format, self.rows, self.cols)
            }
            Packing::KTiles => host_layout::k_tiles_matrix_bytes(self.format, self.rows, self.cols),
            _ => host_layout::interleaved_matrix_bytes(self.format, self.rows, self.cols),
        };
        let packed_bytes = packed_bytes.map_err(|source| kernels::KernelError::Weight {
            format: self.format.name(),
            rows: self.rows,
            cols: self.cols,
            source,
        })?;
        // Reserved in full, so the buffer never moves (and is never resident twice) as it fills.
        let mut packed = Vec::with_capacity(packed_bytes);
        // A stripe of rows at a time, its mapped pages released as soon as it is packed: the
        // stored bytes of a large matrix (the 38 MiB lm_head) are never all resident next to
        // the packed ones. Both layouts are row-block (8-row group) major, so stripes of whole
        // 32-row blocks simply concatenate; `data` holds rows / 32 tile row blocks or rows GGUF
        // rows (checked by `matrix()` when the projection was built), so row `r` starts at byte
        // `len · r / rows` for such `r`.
        const STRIPE_ROWS: usize = 1024;
        let byte_of_row = |row: usize| data.len() * row / self.rows.max(1);
        let mut row = 0;
        while row < self.rows {
            let rows = STRIPE_ROWS.min(self.rows - row);
            let stripe_bytes = byte_of_row(row)..byte_of_row(row + rows);
            let stripe = &data[stripe_bytes.clone()];
            let stored = WeightMatrix::new(self.format, rows, self.cols, stripe)?;
            let appended = match packing {
                Packing::GroupRecords => append_group_records(&stored, &mut packed)?,
                Packing::KTiles => host_layout::append_k_tiles(&stored, &mut packed)?,
                _ => host_layout::append_interleaved_rows(&stored, &mut packed)?,
            };
            if !appended {
                return Ok(());
            }
            if let Some(mapped) = mapped {
                mapped.release_pages(stripe_bytes);
            }
            row += rows;
        }
        self.store = Store::Host(Bytes::owned(packed));
        self.packing = packing;
        Ok(())
    }

    /// Hand the matrix to `dev` once and drop the host copy: owned (fused) bytes are freed, mapped
    /// pages released (they stay in the page cache and fault back in if read again).
    fn upload(&mut self, dev: &DeviceExecutor) -> Result<DeviceWeights, ModelError> {
        let handle = dev.upload(&self.matrix()?)?;
        if let Store::Host(Bytes::Mapped(b)) = &self.store {
            b.release_pages(0..b.len());
        }
        self.store = Store::Device(handle);
        Ok(handle)
    }
}

impl Projection for KernelProjection {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn weight_bytes(&self) -> usize {
        self.streamed
    }
    fn tiled_format(&self) -> Option<WeightFormat> {
        self.format.tile_bytes().map(|_| self.format)
    }
    fn gemm(
        &self,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        _family: RowFamily,
    ) -> Result<(), ModelError> {
        // The executor picks the row family itself (≤ 16 rows m16, else m128 passes).
        match (&self.store, &*self.exec) {
            (Store::Host(_), _) if self.exact => {
                kernels::reference::gemm_reference(&self.matrix()?, x, m, y)?
            }
            (Store::Host(_), exec) => exec.gemm(&self.matrix()?, x, m, y)?,
            (Store::Device(w), Executor::Device(dev)) => dev.gemm_uploaded(w, x, m, y)?,
            (Store::Device(_), Executor::Host(_)) => {
                return Err(ModelError::State {
                    what: "device-held weights with a host executor".into(),
                })
            }
        }
        Ok(())
    }
    fn gemm_swiglu(
        &self,
        x: &[f32],
        m: usize,
        gate_up: &mut [f32],
        out: &mut [f32],
        family: RowFamily,
    ) -> Result<(), ModelError> {
        match (&self.store, &*self.exec) {
            (Store::Host(_), Executor::Host(host)) if !self.exact => {
                Ok(host.gemm_swiglu(&self.matrix()?, x, m, gate_up, out)?)
            }
            _ => swiglu_after_gemm(self, x, m, gate_up, out, family),
        }
    }
}

pub(super) fn projection(
    opts: &LoadOptions,
    exec: &Arc<Executor>,
    pkg: &Arc<Package>,
    names: &[&str],
    rows_each: &[usize],
    cols: usize,
) -> Result<KernelProjection, ModelError> {
    let mut views = Vec::with_capacity(names.len());
    for (&n, &r) in names.iter().zip(rows_each) {
        views.push((n, pkg.matrix(n, r, cols)?));
    }
    let rows: usize = rows_each.iter().sum();
    let format = views[0].1.format;
    let bytes = if views.len() == 1 {
        Bytes::Mapped(MappedBytes::new(pkg, views[0].1.data)?)
    } else {
        for (n, view) in &views {
            if view.format != format {
                return Err(ModelError::Shape {
                    what: format!(
                        "cannot fuse {n} ({}) with {} ({})",
                        view.format.name(),
                        names[0],
                        format.name()
                    ),
                });
            }
        }
        // Row blocks of 32 concatenate: tile grids are raster order by row block.
        let total = views.iter().map(|(_, view)| view.data.len()).sum();
        let fused = Bytes::owned_aligned(total, |buf| {
            for (_, view) in &views {
                buf.extend_from_slice(view.data);
            }
        });
        // The copy is what runs from now on: the pages the copy read are released, so the
        // parts are not resident twice (they stay in the page cache).
        for (_, view) in &views {
            MappedBytes::new(pkg, view.data)?.release_pages(0..view.data.len());
        }
        fused
    };
    let mut p = KernelProjection {
        store: Store::Host(bytes),
        exec: exec.clone(),
        format,
        rows,
        cols,
        streamed: 0,
        exact: opts.exact,
        packing: Packing::Tiles,
    };
    p.streamed = p.matrix()?.streamed_bytes();
    // The exact reference reads tiles; a device gets tiles at upload (see `place` in `load`).
    if let (Executor::Host(host), false) = (&**exec, opts.exact) {
        p.use_host_layout(host)?;
    }
    Ok(p)
}

/// Projections of one input stacked by output rows (q ‖ k ‖ v, gate ‖ up): one matrix when the
/// parts share a format (their rows concatenate), else each part on its own, run one after the
/// other into its rows of the output ([`StackedProjection`]): llama-quantize's mixes store v in
/// another type than q and k.
#[allow(clippy::too_many_arguments)] // the loader's context and one placement callback
fn stacked_projection(
    opts: &LoadOptions,
    exec: &Arc<Executor>,
    pkg: &Arc<Package>,
    names: &[&str],
    rows_each: &[usize],
    cols: usize,
    place: &mut dyn FnMut(KernelProjection) -> Result<Box<dyn Projection>, ModelError>,
) -> Result<Box<dyn Projection>, ModelError> {
    let mut formats = Vec::with_capacity(names.len());
    for (&n, &r) in names.iter().zip(rows_each) {
        formats.push(pkg.matrix(n, r, cols)?.format);
    }
    if formats.windows(2).all(|w| w[0] == w[1]) {
        return place(projection(opts, exec, pkg, names, rows_each, cols)?);
    }
    let mut parts = Vec::with_capacity(names.len());
    for (&n, &r) in names.iter().zip(rows_each) {
        parts.push(place(projection(opts, exec, pkg, &[n], &[r], cols)?)?);
    }
    Ok(Box::new(StackedProjection {
        parts,
        rows: rows_each.iter().sum(),
        cols,
    }))
}

/// Several projections of one input whose outputs are concatenated per row.
struct StackedProjection {
    parts: Vec<Box<dyn Projection>>,
    rows: usize,
    cols: usize,
}

thread_local! {
    /// One part's output before it is copied into its columns of the stacked output.
    static PART_OUT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Projection for StackedProjection {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn weight_bytes(&self) -> usize {
        self.parts.iter().map(|p| p.weight_bytes()).sum()
    }
    fn gemm(
        &self,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        family: RowFamily,
    ) -> Result<(), ModelError> {
        if y.len() < m * self.rows {
            return Err(ModelError::Shape {
                what: format!(
                    "stacked projection output: {} < {m} × {}",
                    y.len(),
                    self.rows
                ),
            });
        }
        crate::kernels::with_scratch(&PART_OUT, |buf| {
            let mut col0 = 0;
            for part in &self.parts {
                let n = part.rows();
                buf.resize(m * n, 0.0);
                part.gemm(x, m, buf, family)?;
                for (i, row) in buf.chunks_exact(n).enumerate() {
                    y[i * self.rows + col0..i * self.rows + col0 + n].copy_from_slice(row);
                }
                col0 += n;
            }
            Ok(())
        })
    }
}

/// Token embeddings decoded row by row from the package's matrix (no allocation per lookup for
/// q8 / q4_1 tiles and plain formats).
///
/// The table is read through the package's file mapping and never held: each lookup releases the
/// pages it mapped. A page fault maps far more than its page (see `MAX_FAULT_MAP_BYTES`), so
/// without the release a few dozen distinct tokens would leave megabytes of the table resident, a
/// second copy of a tied lm_head already held as records or device buffers.
pub struct PackageEmbedding {
    data: MappedBytes,
    format: WeightFormat,
    rows: usize,
    cols: usize,
}

impl PackageEmbedding {
    /// The embedding matrix `view` of `pkg` (a slice of its mapping).
    pub(super) fn new(
        pkg: &Arc<Package>,
        view: MatrixView<'_>,
    ) -> Result<PackageEmbedding, ModelError> {
        Ok(PackageEmbedding {
            data: MappedBytes::new(pkg, view.data)?,
            format: view.format,
            rows: view.rows,
            cols: view.cols,
        })
    }

    /// The bytes holding `row`: its row block of tiles, or the plain row.
    fn row_bytes(&self, row: usize) -> &[u8] {
        let (blocks, block) = match self.format.tile_bytes() {
            Some(_) => (self.rows / tiles::TILE_ROWS, row / tiles::TILE_ROWS),
            None => (self.rows, row),
        };
        let per = self.data.len() / blocks.max(1);
        &self.data[(block * per).min(self.data.len())..((block + 1) * per).min(self.data.len())]
    }
}

impl Embedding for PackageEmbedding {
    fn row(&self, token: u32, out: &mut [f32]) -> Result<(), ModelError> {
        let r = token as usize;
        if r >= self.rows {
            return Err(ModelError::Token {
                token,
                vocab: self.rows,
            });
        }
        let decoded = tiles::decode_row(self.format, &self.data, self.rows, self.cols, r, out)
            .map_err(|e| ModelError::Shape {
                what: format!("embedding row {r}: {e}"),
            });
        release_fault_around(&self.data, self.row_bytes(r));
        decoded
    }
}

/// The most one fault on a file mapping maps around the faulting page: the kernel's fault-around
/// window is 64 KiB, but the page cache holds files in large folios (up to 2 MiB, the PMD size)
/// and a fault maps more of its folio. Measured (`tests/model_memory.rs`): releasing 64 KiB
/// windows still left 2.3 MB of 256 lookups resident, 2 MiB windows nothing.
const MAX_FAULT_MAP_BYTES: usize = 2 << 20;

/// Release the pages that reading `span` may have mapped: the aligned windows of
/// [`MAX_FAULT_MAP_BYTES`] that cover it, clipped to `table` (the embedding matrix, so no other
/// tensor's pages are touched; at its two ends a folio reaching past it may stay mapped).
fn release_fault_around(table: &MappedBytes, span: &[u8]) {
    let base = table.as_ptr() as usize;
    let lo = (span.as_ptr() as usize) / MAX_FAULT_MAP_BYTES * MAX_FAULT_MAP_BYTES;
    let hi =
        (span.as_ptr() as usize + span.len()).div_ceil(MAX_FAULT_MAP_BYTES) * MAX_FAULT_MAP_BYTES;
    let (start, end) = (lo.max(base) - base, hi.min(base + table.len()) - base);
    if end > start {
        table.release_pages(start..end);
    }
}

fn opt_vector(pkg: &Package, name: &str) -> Result<Option<Vec<f32>>, ModelError> {
    if pkg.has_tensor(name) {
        Ok(Some(pkg.vector(name)?))
    } else {
        Ok(None)
    }
}

/// Find the kernel set: the explicit directory, else `<package>/kernels` when present.
pub(super) fn kernel_dir(pkg: &Package, opts: &LoadOptions) -> Option<PathBuf> {
    opts.kernels.clone().or_else(|| {
        let d = pkg.dir().join("kernels");
        d.is_dir().then_some(d)
    })
}

/// Open a package directory or GGUF file.
pub fn open_package(path: &Path) -> Result<Arc<Package>, ModelError> {
    Ok(Arc::new(Package::open(path)?))
}

/// What the device received at load (for the one-line summary).
#[derive(Default)]
struct UploadTally {
    matrices: usize,
    bytes: usize,
    imported: usize,
    share: usize,
}

impl UploadTally {
    fn add(&mut self, w: &DeviceWeights) {
        self.matrices += 1;
        self.bytes += w.bytes();
        match w.path() {
            WeightPath::MemfdImport => self.imported += 1,
            WeightPath::ShareBo => self.share += 1,
        }
    }

    fn line(&self, device: &Path) -> String {
        let mib = self.bytes as f64 / (1 << 20) as f64;
        let how = match (self.imported, self.share) {
            (_, 0) => "as dma-buf weight buffers (sealed memfd → /dev/udmabuf → PRIME import)".to_string(),
            (0, _) => "copied into SHARE BOs (the memfd/udmabuf dma-buf import is unavailable; run with --log info for why)".to_string(),
            (i, s) => format!("{i} as dma-buf weight buffers (sealed memfd → /dev/udmabuf → PRIME import), {s} copied into SHARE BOs"),
        };
        format!(
            "weights: {} matrices ({mib:.1} MiB) handed to {} once, {how}; host copies released",
            self.matrices,
            device.display()
        )
    }
}

/// Weight formats of the layer projections and of the lm_head (for the kernel-set check, before
/// any projection is built).
fn projection_formats(
    pkg: &Package,
    c: &ModelConfig,
) -> Result<(WeightFormat, WeightFormat), ModelError> {
    let body = if c.layers == 0 {
        None
    } else if pkg.fused() {
        Some(
            pkg.matrix(
                "model.layers.0.self_attn.qkv_proj.weight",
                c.qkv_rows(),
                c.hidden,
            )?
            .format,
        )
    } else {
        Some(
            pkg.matrix(
                "model.layers.0.self_attn.q_proj.weight",
                c.q_dim(),
                c.hidden,
            )?
            .format,
        )
    };
    let head = pkg.matrix(pkg.lm_head_name(), c.vocab, c.hidden)?.format;
    Ok((body.unwrap_or(head), head))
}

/// The executor for `opts.backend`, and the name shown in stats. States the choice (and for
/// `auto` why) in a status event.
fn select_executor(
    opts: &LoadOptions,
    set: Option<&KernelSet>,
    needs: &[kernels::KernelNeed],
) -> Result<(Arc<Executor>, &'static str), ModelError> {
    let host = || Arc::new(Executor::Host(HostExecutor::new()));
    if opts.exact {
        return Ok((host(), "host-exact"));
    }
    // A kernel the device cannot run (descriptor-only, see kernels::device_exec) fails here, not
    // at the first token.
    let runnable = |set: &KernelSet| -> Result<(), ModelError> {
        let allow = kernels::DeviceExecOptions::from_env().allow_descriptor_only;
        for need in needs {
            if let (Some(desc), Some(path)) = (set.get(&need.key), set.path(&need.key)) {
                if !desc.has_control_code && !allow {
                    return Err(kernels::KernelError::NoControlCode {
                        path: path.to_path_buf(),
                    }
                    .into());
                }
            }
        }
        Ok(())
    };
    match opts.backend {
        Backend::Host => {
            tracing::info!(target: crate::STATUS_TARGET, "backend host (requested)");
            Ok((host(), "host"))
        }
        Backend::Xdna => {
            let Some(set) = set else {
                return Err(ModelError::Unsupported {
                    what: "the xdna backend needs a kernel set: the package has no kernels/ directory (re-import it with `xdna pack import`, or pass --kernels DIR)".into(),
                });
            };
            let dev = DeviceExecutor::discover(set)?;
            runnable(set)?;
            tracing::info!(
                target: crate::STATUS_TARGET,
                "backend xdna (requested): {} with kernel set {} ({} kernels, {} contexts resident at most)",
                dev.device().path().display(),
                set.dir().display(),
                set.len(),
                dev.max_resident()
            );
            Ok((Arc::new(Executor::Device(Box::new(dev))), "xdna"))
        }
        Backend::Auto => {
            let Some(set) = set else {
                tracing::info!(target: crate::STATUS_TARGET, "backend auto → host: the package has no kernel set (kernels/) for a device");
                return Ok((host(), "host"));
            };
            match DeviceExecutor::discover(set) {
                Ok(dev) => match runnable(set) {
                    Ok(()) => {
                        tracing::info!(
                            target: crate::STATUS_TARGET,
                            "backend auto → xdna: {} opened (kernel set {}, {} kernels)",
                            dev.device().path().display(),
                            set.dir().display(),
                            set.len()
                        );
                        Ok((Arc::new(Executor::Device(Box::new(dev))), "xdna"))
                    }
                    Err(e) => {
                        tracing::info!(
                            target: crate::STATUS_TARGET,
                            "backend auto → host: {} opened but {e}",
                            dev.device().path().display()
                        );
                        Ok((host(), "host"))
                    }
                },
                Err(e) => {
                    tracing::info!(target: crate::STATUS_TARGET, "backend auto → host: no NPU ({e})");
                    Ok((host(), "host"))
                }
            }
        }
    }
}

/// Build the fast-path weights of `pkg`.
pub fn load(pkg: &Arc<Package>, opts: &LoadOptions) -> Result<ModelWeights, ModelError> {
    let weights = load_weights(pkg, opts);
    release_freed_heap();
    weights
}

/// Hand the memory the loader freed back to the OS. Loading allocates and frees large scratch
/// (packing records, fusing and uploading matrices, building the tokenizer) that glibc keeps in
/// the heap otherwise: ≈ 10 MB of SmolLM2's resident set (`xdna bench load`) that the process
/// would carry for its whole life.
// A libc call is unsafe by nature; malloc_trim has no preconditions.
#[allow(unsafe_code)]
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel; it is thread-safe and
    // touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn load_weights(pkg: &Arc<Package>, opts: &LoadOptions) -> Result<ModelWeights, ModelError> {
    let c = pkg.config().clone();
    if c.dflash.is_some() {
        return Err(ModelError::Unsupported {
            what: format!(
                "{} is a DFlash draft, which drafts for a target model rather than running alone: use it with --speculate dflash:PATH",
                pkg.dir().display()
            ),
        });
    }
    // Hybrid (Gated DeltaNet / gated attention) packages: runtime/model/load_hybrid.rs, on the
    // host executors (their GDN shapes have no device kernels yet).
    if c.has_recurrent() || c.attn_output_gate {
        let backend = match (opts.backend, opts.exact) {
            (Backend::Xdna, _) => {
                return Err(ModelError::Unsupported {
                    what: format!(
                        "{}: hybrid (Gated DeltaNet) models run on the host backend only; use --backend host",
                        pkg.dir().display()
                    ),
                })
            }
            (_, true) => "host-exact",
            (Backend::Auto, false) => {
                tracing::info!(target: crate::STATUS_TARGET, "backend auto → host: hybrid (Gated DeltaNet) model");
                "host"
            }
            (Backend::Host, false) => "host",
        };
        let exec = Arc::new(Executor::Host(HostExecutor::new()));
        return super::load_hybrid::load(pkg, opts, &exec, c, backend);
    }
    let (wfmt, head_fmt) = projection_formats(pkg, &c)?;
    // Matrices kept in a GGUF file's own block rows run on the host executor only.
    let host_only = pkg.host_only_matrix();
    let host_opts;
    let opts = match (&host_only, opts.backend) {
        (Some((name, format)), Backend::Xdna) => {
            return Err(ModelError::Unsupported {
                what: format!(
                    "{}: {name} is stored as {} (a GGUF file's own block rows), which no device kernel reads; run it with --backend host, or requantize the GGUF to Q4_1 or Q8_0 for the NPU",
                    pkg.dir().display(),
                    format.name()
                ),
            });
        }
        (Some((name, format)), _) => {
            if opts.backend == Backend::Auto {
                tracing::info!(target: crate::STATUS_TARGET, "backend auto → host: {name} is {} (GGUF block rows, host only)", format.name());
            }
            host_opts = LoadOptions {
                backend: Backend::Host,
                kernels: None,
                exact: opts.exact,
            };
            &host_opts
        }
        (None, _) => opts,
    };
    let kernel_set_dir = match opts.backend {
        Backend::Host if host_only.is_some() => None,
        _ => kernel_dir(pkg, opts),
    };
    let (set, needs) = match kernel_set_dir {
        Some(dir) => {
            let set = KernelSet::load(&dir)?;
            let needs = kernels::family_needs(&c.kernel_shapes(wfmt, head_fmt));
            set.require(&needs)?;
            tracing::info!(
                "kernel set {}: {} kernels, all shapes present",
                dir.display(),
                set.len()
            );
            (Some(set), needs)
        }
        None => {
            tracing::info!("no kernel set given or found in the package; the host executor runs the shapes directly");
            (None, Vec::new())
        }
    };
    let (exec, backend) = select_executor(opts, set.as_ref(), &needs)?;
    let device = match &*exec {
        Executor::Device(d) => Some(&**d),
        Executor::Host(_) => None,
    };
    let mut tally = UploadTally::default();
    // Hand each matrix to the device as soon as it is built, so at most one host copy is resident.
    let place =
        |p: KernelProjection, tally: &mut UploadTally| -> Result<Box<dyn Projection>, ModelError> {
            let mut p = p;
            if let Some(dev) = device {
                tally.add(&p.upload(dev)?);
            }
            Ok(Box::new(p))
        };
    let (qd, kvd) = (c.q_dim(), c.kv_dim());
    let fused = pkg.fused();
    let mut layers = Vec::with_capacity(c.layers);
    for i in 0..c.layers {
        let p = format!("model.layers.{i}");
        let n = |s: &str| format!("{p}.{s}");
        let qkv = if fused {
            place(
                projection(
                    opts,
                    &exec,
                    pkg,
                    &[&n("self_attn.qkv_proj.weight")],
                    &[c.qkv_rows()],
                    c.hidden,
                )?,
                &mut tally,
            )?
        } else {
            let (q, k, v) = (
                n("self_attn.q_proj.weight"),
                n("self_attn.k_proj.weight"),
                n("self_attn.v_proj.weight"),
            );
            stacked_projection(
                opts,
                &exec,
                pkg,
                &[&q, &k, &v],
                &[qd, kvd, kvd],
                c.hidden,
                &mut |p| place(p, &mut tally),
            )?
        };
        let gate_up = if fused {
            place(
                projection(
                    opts,
                    &exec,
                    pkg,
                    &[&n("mlp.gate_up_proj.weight")],
                    &[2 * c.intermediate],
                    c.hidden,
                )?,
                &mut tally,
            )?
        } else {
            let (g, u) = (n("mlp.gate_proj.weight"), n("mlp.up_proj.weight"));
            stacked_projection(
                opts,
                &exec,
                pkg,
                &[&g, &u],
                &[c.intermediate, c.intermediate],
                c.hidden,
                &mut |p| place(p, &mut tally),
            )?
        };
        let o = projection(
            opts,
            &exec,
            pkg,
            &[&n("self_attn.o_proj.weight")],
            &[c.hidden],
            qd,
        )?;
        let down = projection(
            opts,
            &exec,
            pkg,
            &[&n("mlp.down_proj.weight")],
            &[c.hidden],
            c.intermediate,
        )?;
        let qkv_bias = if c.qkv_bias {
            match opt_vector(pkg, &n("self_attn.qkv_proj.bias"))? {
                Some(b) => Some(b),
                None => Some(
                    [
                        pkg.vector(&n("self_attn.q_proj.bias"))?,
                        pkg.vector(&n("self_attn.k_proj.bias"))?,
                        pkg.vector(&n("self_attn.v_proj.bias"))?,
                    ]
                    .concat(),
                ),
            }
        } else {
            None
        };
        let (q_norm, k_norm) = if c.qk_norm {
            (
                Some(pkg.vector(&n("self_attn.q_norm.weight"))?),
                Some(pkg.vector(&n("self_attn.k_norm.weight"))?),
            )
        } else {
            (None, None)
        };
        layers.push(Layer::Attention(LayerWeights {
            attn_norm: pkg.vector(&n("input_layernorm.weight"))?,
            qkv,
            qkv_bias,
            q_norm,
            k_norm,
            o: place(o, &mut tally)?,
            o_bias: if c.o_bias {
                Some(pkg.vector(&n("self_attn.o_proj.bias"))?)
            } else {
                None
            },
            ffn_norm: pkg.vector(&n("post_attention_layernorm.weight"))?,
            gate_up,
            down: place(down, &mut tally)?,
        }));
    }
    let emb_name = pkg.embedding_name();
    let embed = PackageEmbedding::new(pkg, pkg.matrix(emb_name, c.vocab, c.hidden)?)?;
    let lm_head = projection(
        opts,
        &exec,
        pkg,
        &[pkg.lm_head_name()],
        &[c.vocab],
        c.hidden,
    )?;
    let lm_head = place(lm_head, &mut tally)?;
    if let Some(dev) = device {
        tracing::info!(target: crate::STATUS_TARGET, "{}", tally.line(dev.device().path()));
    }
    Ok(ModelWeights {
        final_norm: pkg.vector("model.norm.weight")?,
        layers,
        embed: Box::new(embed),
        lm_head,
        backend: backend.to_string(),
        f32_kv_cache: opts.exact,
        config: c,
    })
}

/// Open `model` (a package dir or GGUF; `None`: the default model, fetched on first use) and build
/// a [`super::Model`] with `ctx` positions.
pub fn open_model(
    model: Option<&Path>,
    ctx: usize,
    opts: &LoadOptions,
) -> Result<(Arc<Package>, super::Model), ModelError> {
    let path = match model {
        Some(p) => p.to_path_buf(),
        None => crate::weights::default_model()?,
    };
    let pkg = open_package(&path)?;
    let w = load(&pkg, opts)?;
    let ctx = ctx.min(w.config.max_position_embeddings);
    let m = super::Model::new(w, ctx)?;
    Ok((pkg, m))
}
