//! Loading a model package onto the kernels layer: the fast path's weights.
//!
//! Matrices stay where the package mapped them (zero-copy) and every projection runs through
//! [`kernels::HostExecutor`] (the host backend of the per-shape kernels). Packages with separate
//! q/k/v and gate/up (FastFlowLM) are fused at load by concatenating tile row blocks into an owned
//! buffer. When a kernel set is given (or found in the package), every shape the model needs must
//! be present; the error names every missing file.

use super::config::ModelConfig;
use super::forward::{Embedding, Family, Layer, LayerWeights, ModelWeights, Projection};
use super::ModelError;
use crate::kernels::{self, HostExecutor, KernelSet, WeightMatrix};
use crate::tiles::{self, WeightFormat};
use crate::weights::Package;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which executor runs the projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The NPU if an amdxdna device opens, else host.
    Auto,
    Host,
    Xdna,
}

impl std::str::FromStr for Backend {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, ModelError> {
        match s {
            "auto" => Ok(Backend::Auto),
            "host" => Ok(Backend::Host),
            "xdna" => Ok(Backend::Xdna),
            other => Err(ModelError::Unsupported {
                what: format!("backend {other:?} (expected auto, host or xdna)"),
            }),
        }
    }
}

/// Options of [`load`].
#[derive(Clone, Debug)]
pub struct LoadOptions {
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

/// Stored bytes of one matrix: borrowed from the package mapping, or owned (fused at load).
enum Bytes {
    /// Points into `pkg`'s read-only mapping, which lives as long as the `Arc` held next to it.
    Mapped(&'static [u8]),
    Owned(Vec<u8>),
}

/// A projection executed by the kernels layer.
pub struct KernelProjection {
    _pkg: Arc<Package>,
    bytes: Bytes,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    streamed: usize,
    exact: bool,
}

impl KernelProjection {
    fn data(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped(b) => b,
            Bytes::Owned(v) => v,
        }
    }
    fn matrix(&self) -> Result<WeightMatrix<'_>, ModelError> {
        Ok(WeightMatrix::new(
            self.format,
            self.rows,
            self.cols,
            self.data(),
        )?)
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
    fn gemm(&self, x: &[f32], m: usize, y: &mut [f32], _family: Family) -> Result<(), ModelError> {
        if self.exact {
            kernels::reference::gemm_reference(&self.matrix()?, x, m, y)?;
        } else {
            HostExecutor::global().gemm(&self.matrix()?, x, m, y)?;
        }
        Ok(())
    }
}

/// Borrow `data` (inside `pkg`'s mapping) for as long as `pkg` lives.
pub(super) fn mapped(pkg: &Arc<Package>, data: &[u8]) -> &'static [u8] {
    let _ = pkg;
    // SAFETY: `data` points into the package's read-only memory map, which is neither moved nor
    // unmapped while the `Package` lives; every holder of the returned slice (a KernelProjection or
    // PackageEmbedding) also holds an `Arc<Package>`, so the mapping outlives the slice.
    unsafe { std::slice::from_raw_parts(data.as_ptr(), data.len()) }
}

pub(super) fn projection(
    opts: &LoadOptions,
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
        Bytes::Mapped(mapped(pkg, views[0].1.data))
    } else {
        // Row blocks of 32 concatenate: tile grids are raster order by row block.
        let mut v = Vec::new();
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
            v.extend_from_slice(view.data);
        }
        Bytes::Owned(v)
    };
    let mut p = KernelProjection {
        _pkg: pkg.clone(),
        bytes,
        format,
        rows,
        cols,
        streamed: 0,
        exact: opts.exact,
    };
    p.streamed = p.matrix()?.streamed_bytes();
    Ok(p)
}

/// Token embeddings decoded row by row from the package's matrix (no allocation per lookup for
/// q8 / q4_1 tiles and plain formats).
pub struct PackageEmbedding {
    pub(super) _pkg: Arc<Package>,
    pub(super) data: &'static [u8],
    pub(super) format: WeightFormat,
    pub(super) rows: usize,
    pub(super) cols: usize,
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
        decode_row_noalloc(self.format, self.data, self.rows, self.cols, r, out)
    }
}

/// Decode one row of a tiled matrix without a scratch tile (q8 / q4_1 tiles); other formats go
/// through `tiles::decode_row`.
pub fn decode_row_noalloc(
    format: WeightFormat,
    data: &[u8],
    rows: usize,
    cols: usize,
    row: usize,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let shape_err = |what: String| ModelError::Shape { what };
    if out.len() != cols {
        return Err(shape_err(format!(
            "embedding row of {} values into {}",
            cols,
            out.len()
        )));
    }
    let u16at = |at: usize| u16::from_le_bytes([data[at], data[at + 1]]);
    match format {
        WeightFormat::Q8 { scale, order } | WeightFormat::Q41 { scale, order } => {
            let tb = format.tile_bytes().unwrap_or(0);
            let qt = format.padded_cols(cols) / tiles::TILE_COLS;
            let need = format
                .matrix_bytes(rows, cols)
                .map_err(|e| shape_err(e.to_string()))?;
            if data.len() != need {
                return Err(shape_err(format!(
                    "embedding bytes {} (expected {need})",
                    data.len()
                )));
            }
            let (p, r) = (row / tiles::TILE_ROWS, row % tiles::TILE_ROWS);
            for (c, o) in out.iter_mut().enumerate() {
                let (q, cc) = (c / tiles::TILE_COLS, c % tiles::TILE_COLS);
                let base = (p * qt + q) * tb;
                let cell = tiles::cell(cc / tiles::GROUP, r);
                let d = tiles::scale_to_f32(scale, u16at(base + 2 * cell));
                *o = if matches!(format, WeightFormat::Q8 { .. }) {
                    let code =
                        data[base + tiles::Q8_CODES + tiles::q8_code_pos(order, r, cc)] as i8;
                    code as f32 * d
                } else {
                    let m = tiles::scale_to_f32(scale, u16at(base + tiles::Q41_MINS + 2 * cell));
                    let (byte, high) = tiles::q4_code_pos(order, r, cc);
                    let b = data[base + tiles::Q41_CODES + byte];
                    (if high { b >> 4 } else { b & 15 }) as f32 * d + m
                };
            }
            Ok(())
        }
        _ => tiles::decode_row(format, data, rows, cols, row, out)
            .map_err(|e| shape_err(e.to_string())),
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

/// The validated config of a package.
pub fn package_config(pkg: &Package) -> Result<ModelConfig, ModelError> {
    let file = pkg.dir().join("config.json");
    ModelConfig::from_json(&pkg.config().raw, &file.display().to_string())
}

/// Build the fast-path weights of `pkg`.
pub fn load(pkg: &Arc<Package>, opts: &LoadOptions) -> Result<ModelWeights, ModelError> {
    let c = package_config(pkg)?;
    let backend = match opts.backend {
        Backend::Xdna => {
            return Err(ModelError::Unsupported {
                what: "the xdna backend is not wired into the model layer yet; use --backend host"
                    .into(),
            })
        }
        Backend::Auto => {
            tracing::info!("backend auto: using host (the model layer drives the host executors)");
            "host"
        }
        Backend::Host => "host",
    };
    let backend = if opts.exact { "host-exact" } else { backend };
    // Hybrid (Gated DeltaNet / gated attention) packages: runtime/model/load_hybrid.rs.
    if c.has_recurrent() || c.attn_output_gate {
        return super::load_hybrid::load(pkg, opts, c, backend);
    }
    let (qd, kvd) = (c.q_dim(), c.kv_dim());
    let fused = pkg.fused();
    let mut layers = Vec::with_capacity(c.layers);
    let mut body_format = None;
    for i in 0..c.layers {
        let p = format!("model.layers.{i}");
        let n = |s: &str| format!("{p}.{s}");
        let qkv = if fused {
            projection(
                opts,
                pkg,
                &[&n("self_attn.qkv_proj.weight")],
                &[c.qkv_rows()],
                c.hidden,
            )?
        } else {
            let (q, k, v) = (
                n("self_attn.q_proj.weight"),
                n("self_attn.k_proj.weight"),
                n("self_attn.v_proj.weight"),
            );
            projection(opts, pkg, &[&q, &k, &v], &[qd, kvd, kvd], c.hidden)?
        };
        let gate_up = if fused {
            projection(
                opts,
                pkg,
                &[&n("mlp.gate_up_proj.weight")],
                &[2 * c.intermediate],
                c.hidden,
            )?
        } else {
            let (g, u) = (n("mlp.gate_proj.weight"), n("mlp.up_proj.weight"));
            projection(
                opts,
                pkg,
                &[&g, &u],
                &[c.intermediate, c.intermediate],
                c.hidden,
            )?
        };
        let o = projection(opts, pkg, &[&n("self_attn.o_proj.weight")], &[c.hidden], qd)?;
        let down = projection(
            opts,
            pkg,
            &[&n("mlp.down_proj.weight")],
            &[c.hidden],
            c.intermediate,
        )?;
        body_format.get_or_insert(qkv.format);
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
            qkv: Box::new(qkv),
            qkv_bias,
            q_norm,
            k_norm,
            o: Box::new(o),
            o_bias: if c.o_bias {
                Some(pkg.vector(&n("self_attn.o_proj.bias"))?)
            } else {
                None
            },
            ffn_norm: pkg.vector(&n("post_attention_layernorm.weight"))?,
            gate_up: Box::new(gate_up),
            down: Box::new(down),
        }));
    }
    let emb_name = pkg.embedding_name();
    let ev = pkg.matrix(emb_name, c.vocab, c.hidden)?;
    let embed = PackageEmbedding {
        _pkg: pkg.clone(),
        data: mapped(pkg, ev.data),
        format: ev.format,
        rows: c.vocab,
        cols: c.hidden,
    };
    let lm_head = projection(opts, pkg, &[pkg.lm_head_name()], &[c.vocab], c.hidden)?;
    if let Some(dir) = kernel_dir(pkg, opts) {
        let set = KernelSet::load(&dir)?;
        let shapes = kernels::set::ModelShapes::from_config(
            &pkg.config().raw,
            &pkg.dir().join("config.json"),
        )?;
        let wfmt = body_format.unwrap_or(lm_head.format);
        set.require(&shapes.needs(wfmt, lm_head.format))?;
        tracing::info!(
            "kernel set {}: {} kernels, all shapes present",
            dir.display(),
            set.len()
        );
    } else {
        tracing::info!("no kernel set given or found in the package; the host executor runs the shapes directly");
    }
    Ok(ModelWeights {
        final_norm: pkg.vector("model.norm.weight")?,
        layers,
        embed: Box::new(embed),
        lm_head: Box::new(lm_head),
        backend: backend.to_string(),
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
