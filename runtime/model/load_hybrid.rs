//! Hybrid (Qwen3.5-style) packages: loading Gated DeltaNet + gated-attention layers, and writing
//! deterministic small random-weight packages (`xdna pack synth`) for tests and benches.
//!
//! Tensor names are Hugging Face Qwen3.5's: `model.layers.{i}.linear_attn.{in_proj_qkv, in_proj_z,
//! in_proj_b, in_proj_a, out_proj}.weight`, `.conv1d.weight` `[conv_dim, 1, K]`, `.dt_bias`,
//! `.A_log`, `.norm.weight`; full-attention layers `self_attn.{q,k,v,o}_proj.weight` (q rows per
//! head `[q, gate]`), `self_attn.{q,k}_norm.weight`; `mlp.{gate,up,down}_proj.weight`. The
//! model's RMSNorm weights are zero-centred (`1 + w`, added here); the GDN gated norm is not.
//! Packages imported from a llama.cpp `qwen35` GGUF (`weights::import_qwen35`) use these names in
//! this order, except that they store `linear_attn.ssm_a` (= −exp(A_log)) instead of `A_log` and
//! effective norms (`xdna.norms_include_one` in `config.json`, so nothing is added).
//!
//! FastFlowLM Q4NX packages converted from a llama.cpp GGUF (`FLM_Q4NX_Converter`
//! `q4nx/models/qwen35.py`) are read too: their names (`linear_attn.qkv_proj`,
//! `self_attn.gate_proj` for z, `ssm_{alpha,beta}_proj`, `ssm_conv1d` `[K, conv_dim]`, `ssm_a` =
//! −exp(A_log), `ssm_dt.bias`, `ssm_norm`, `ssm_out_proj`), their effective (`1 + w`) norms, their
//! planar full-attention `q_proj` and their value-head orders are mapped to the layout above at
//! load ([`FlmLayout`]; docs/formats.md "Qwen3.5 layouts" gives the sources).

use super::gdn::GdnWeights;
use super::layers::{Layer, LayerWeights, LinearLayerWeights, ModelWeights, Projection};
use super::load::{kernel_dir, projection, LoadOptions, PackageEmbedding};
use super::ModelError;
use crate::kernels::{self, Executor, KernelKey, KernelNeed, KernelSet, RowFamily, ShapeNeed};
use crate::tiles::{self, ScaleType, TileOrder, WeightFormat};
use crate::weights::safetensors::{Declared, Dtype, Writer};
use crate::weights::value_heads::gguf_to_hf;
use crate::weights::{LayerKind, ModelConfig, Package};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// The weights of a hybrid package (any model with GDN layers or gated attention), in Hugging
/// Face or FastFlowLM (GGUF-derived) tensor layout.
pub fn load(
    pkg: &Arc<Package>,
    opts: &LoadOptions,
    exec: &Arc<Executor>,
    c: ModelConfig,
    backend: &str,
) -> Result<ModelWeights, ModelError> {
    let flm = FlmLayout::detect(pkg, &c)?;
    // FLM files store the effective norm (llama.cpp adds the 1 at conversion).
    let add_one = c.zero_centered_norms && flm.is_none();
    let norm = |name: &str| -> Result<Vec<f32>, ModelError> {
        let mut v = pkg.vector(name)?;
        if add_one {
            for x in &mut v {
                *x += 1.0;
            }
        }
        Ok(v)
    };
    let (qd, kvd, h) = (c.q_dim(), c.kv_dim(), c.hidden);
    let mut layers = Vec::with_capacity(c.layers);
    for i in 0..c.layers {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        let gate_up = stacked(
            opts,
            exec,
            pkg,
            &[&n("mlp.gate_proj.weight"), &n("mlp.up_proj.weight")],
            &[c.intermediate, c.intermediate],
            h,
        )?;
        let down = projection(
            opts,
            exec,
            pkg,
            &[&n("mlp.down_proj.weight")],
            &[h],
            c.intermediate,
        )?;
        let attn_norm = norm(&n("input_layernorm.weight"))?;
        let ffn_norm = norm(&n("post_attention_layernorm.weight"))?;
        match c.layer_kind(i) {
            LayerKind::Attention => {
                let qkv = stacked(
                    opts,
                    exec,
                    pkg,
                    &[
                        &n("self_attn.q_proj.weight"),
                        &n("self_attn.k_proj.weight"),
                        &n("self_attn.v_proj.weight"),
                    ],
                    &[c.q_rows(), kvd, kvd],
                    h,
                )?;
                let qkv: Box<dyn Projection> = match &flm {
                    Some(l) if c.attn_output_gate => {
                        let mut rows = l.attention_q_rows(&c);
                        rows.extend(c.q_rows()..c.q_rows() + 2 * kvd);
                        PermutedProjection::wrap(qkv, Some(rows), None)
                    }
                    _ => qkv,
                };
                let o = projection(opts, exec, pkg, &[&n("self_attn.o_proj.weight")], &[h], qd)?;
                let (q_norm, k_norm) = if c.qk_norm {
                    (
                        Some(norm(&n("self_attn.q_norm.weight"))?),
                        Some(norm(&n("self_attn.k_norm.weight"))?),
                    )
                } else {
                    (None, None)
                };
                layers.push(Layer::Attention(LayerWeights {
                    attn_norm,
                    qkv,
                    qkv_bias: None,
                    q_norm,
                    k_norm,
                    o: Box::new(o),
                    o_bias: None,
                    ffn_norm,
                    gate_up,
                    down: Box::new(down),
                }));
            }
            LayerKind::Linear => {
                let d = c.linear.as_ref().ok_or_else(|| ModelError::Config {
                    file: pkg.dir().join("config.json").display().to_string(),
                    field: "linear_num_value_heads".into(),
                    problem: "missing for a model with linear_attention layers".into(),
                })?;
                let (cd, vd, hv) = (d.conv_dim(), d.value_dim(), d.value_heads);
                let la = |s: &str| n(&format!("linear_attn.{s}"));
                let gdn = match &flm {
                    None => GdnWeights {
                        in_qkvz: stacked(
                            opts,
                            exec,
                            pkg,
                            &[&la("in_proj_qkv.weight"), &la("in_proj_z.weight")],
                            &[cd, vd],
                            h,
                        )?,
                        in_ba: stacked(
                            opts,
                            exec,
                            pkg,
                            &[&la("in_proj_b.weight"), &la("in_proj_a.weight")],
                            &[hv, hv],
                            h,
                        )?,
                        conv: pkg.vector(&la("conv1d.weight"))?,
                        dt_bias: pkg.vector(&la("dt_bias"))?,
                        a: gdn_a(pkg, &la("A_log"), &la("ssm_a"), hv)?,
                        norm: pkg.vector(&la("norm.weight"))?,
                        out: Box::new(projection(
                            opts,
                            exec,
                            pkg,
                            &[&la("out_proj.weight")],
                            &[h],
                            vd,
                        )?),
                    },
                    Some(l) => l.gdn(pkg, opts, exec, &c, i)?,
                };
                layers.push(Layer::Linear(LinearLayerWeights {
                    attn_norm,
                    gdn,
                    ffn_norm,
                    gate_up,
                    down: Box::new(down),
                }));
            }
        }
    }
    let embed = PackageEmbedding::new(pkg, pkg.matrix(pkg.embedding_name(), c.vocab, h)?)?;
    let lm_head = projection(opts, exec, pkg, &[pkg.lm_head_name()], &[c.vocab], h)?;
    if let Some(dir) = kernel_dir(pkg, opts) {
        let set = KernelSet::load(&dir)?;
        let mut needs = Vec::new();
        for l in &layers {
            for (p, what) in layer_projections(l) {
                if let Some(f) = p.tiled_format() {
                    needs.extend(gemm_needs(f, p.cols(), p.rows(), what));
                }
            }
        }
        if let Some(f) = Projection::tiled_format(&lm_head) {
            needs.extend(gemm_needs(f, h, c.vocab, "lm_head"));
        }
        set.require(&needs)?;
    }
    Ok(ModelWeights {
        final_norm: norm("model.norm.weight")?,
        layers,
        embed: Box::new(embed),
        lm_head: Box::new(lm_head),
        backend: backend.to_string(),
        f32_kv_cache: opts.exact,
        config: c,
    })
}

/// `FLM_Q4NX_Converter` reorders the linear-attention value heads only when the GGUF's
/// `qwen35.feed_forward_length` exceeds this (`q4nx/models/qwen35.py`, "small model, no qk share
/// on linear head").
pub const FLM_REORDER_ABOVE_FFN: usize = 6144;

/// How a FastFlowLM Qwen3.5 package (HF model → llama.cpp GGUF → `FLM_Q4NX_Converter`) maps to
/// the loader's Hugging Face layout. Every map is "file index → Hugging Face index"; the two steps
/// are, from docs/formats.md "Qwen3.5 layouts":
/// 1. llama.cpp `_reorder_v_heads` (only when key heads ≠ value heads): value heads from grouped
///    (`k·r + j`) to tiled (`j·hk + k`) order, in units of `linear_value_head_dim` rows/columns
///    (z rows, the v part of qkv rows and conv channels, out_proj columns) or of 1 (a, b, A, dt).
/// 2. FLM (only when `intermediate_size` > [`FLM_REORDER_ABOVE_FFN`]): `(q g p) → (g q p)` with
///    q = 2 and p = `linear_key_head_dim` (`ssm.state_size`) for the channel maps, p = 1 for the
///    per-head vectors.
#[derive(Clone, Debug)]
pub struct FlmLayout {
    /// File value channel → HF value channel (`value_dim` entries).
    pub channel_src: Vec<usize>,
    /// File value head → HF value head (`value_heads` entries).
    pub head_src: Vec<usize>,
    /// File `qkv_proj` row (= conv channel) → HF row (`conv_dim` entries): llama.cpp reorders the
    /// v part, FLM the second half (`chunk(2)`), which is the v part only when 2·Hk·d_k = Hv·d_v.
    pub qkv_src: Vec<usize>,
}

impl FlmLayout {
    /// `Some` when the package carries FLM names (`linear_attn.qkv_proj.weight` in the first linear
    /// layer). Attention-only packages have nothing to tell the layouts apart and read as HF.
    pub fn detect(pkg: &Package, c: &ModelConfig) -> Result<Option<FlmLayout>, ModelError> {
        let first_linear = (0..c.layers).find(|&i| c.layer_kind(i) == LayerKind::Linear);
        let Some(i) = first_linear else {
            return Ok(None);
        };
        if !pkg.has_tensor(&format!("model.layers.{i}.linear_attn.qkv_proj.weight")) {
            return Ok(None);
        }
        Self::for_config(c, &pkg.dir().join("config.json").display().to_string()).map(Some)
    }

    /// The maps for `c` (errors name `file` when the converter's reshapes cannot apply).
    pub fn for_config(c: &ModelConfig, file: &str) -> Result<FlmLayout, ModelError> {
        let d = c.linear.as_ref().ok_or_else(|| ModelError::Config {
            file: file.into(),
            field: "linear_num_value_heads".into(),
            problem: "missing for a model with linear_attention layers".into(),
        })?;
        let (hk, hv, dk, dv) = (d.key_heads, d.value_heads, d.key_head_dim, d.value_head_dim);
        let reorder = c.intermediate > FLM_REORDER_ABOVE_FFN;
        let vd = hv * dv;
        let (qk, cd) = (2 * hk * dk, 2 * hk * dk + vd);
        let half = cd - cd / 2;
        if reorder && (hv % 2 != 0 || dk == 0 || vd % (2 * dk) != 0 || half % (2 * dk) != 0) {
            return Err(ModelError::Config {
                file: file.into(),
                field: "linear_num_value_heads".into(),
                problem: format!(
                    "a FastFlowLM Qwen3.5 file reorders value channels in pairs of {dk}-wide blocks; \
                     {hv} heads × {dv} do not split that way"
                ),
            });
        }
        let map = |len: usize, gguf_unit: usize, flm_unit: usize| -> Vec<usize> {
            (0..len)
                .map(|f| {
                    let g = if reorder {
                        flm_to_gguf(f, len, flm_unit)
                    } else {
                        f
                    };
                    gguf_to_hf(g, hk, hv, gguf_unit)
                })
                .collect()
        };
        let qkv_src = (0..cd)
            .map(|f| {
                let g = if reorder && f >= cd / 2 {
                    cd / 2 + flm_to_gguf(f - cd / 2, half, dk)
                } else {
                    f
                };
                if g < qk {
                    g
                } else {
                    qk + gguf_to_hf(g - qk, hk, hv, dv)
                }
            })
            .collect();
        Ok(FlmLayout {
            channel_src: map(vd, dv, dk),
            head_src: map(hv, 1, 1),
            qkv_src,
        })
    }

    /// Fused `[q ‖ gate]` rows of a gated full-attention layer: the file is planar (all q heads,
    /// then all gate heads); the loader wants per head `[q, gate]`. Entry i: the file row of
    /// internal row i.
    fn attention_q_rows(&self, c: &ModelConfig) -> Vec<usize> {
        let (heads, hd) = (c.heads, c.head_dim);
        (0..2 * heads * hd)
            .map(|i| {
                let (head, half, e) = (i / (2 * hd), (i / hd) % 2, i % hd);
                (half * heads + head) * hd + e
            })
            .collect()
    }

    /// One linear-attention layer's weights, read from FLM names and mapped to HF order.
    fn gdn(
        &self,
        pkg: &Arc<Package>,
        opts: &LoadOptions,
        exec: &Arc<Executor>,
        c: &ModelConfig,
        i: usize,
    ) -> Result<GdnWeights, ModelError> {
        let h = c.hidden;
        let d = c.linear.as_ref().ok_or_else(|| ModelError::Config {
            file: pkg.dir().join("config.json").display().to_string(),
            field: "linear_num_value_heads".into(),
            problem: "missing for a model with linear_attention layers".into(),
        })?;
        let (cd, vd, hv, kk) = (d.conv_dim(), d.value_dim(), d.value_heads, d.conv_kernel);
        let la = |s: &str| format!("model.layers.{i}.linear_attn.{s}");
        let channel_file = invert(&self.channel_src);
        let head_file = invert(&self.head_src);
        // in_qkvz = [qkv (q, k untouched; v permuted) ‖ z (gate_proj, permuted)].
        let qkv_file = invert(&self.qkv_src);
        let qkvz_rows: Vec<usize> = qkv_file
            .iter()
            .copied()
            .chain((0..vd).map(|v| cd + channel_file[v]))
            .collect();
        let in_qkvz = projection(
            opts,
            exec,
            pkg,
            &[
                &la("qkv_proj.weight"),
                &format!("model.layers.{i}.self_attn.gate_proj.weight"),
            ],
            &[cd, vd],
            h,
        )?;
        // alpha/beta: fewer than 32 heads are stored twice (rows [all, all]); read the first copy.
        let ba_rows = if hv < tiles::TILE_ROWS { 2 * hv } else { hv };
        let in_ba = projection(
            opts,
            exec,
            pkg,
            &[&la("ssm_beta_proj.weight"), &la("ssm_alpha_proj.weight")],
            &[ba_rows, ba_rows],
            h,
        )?;
        let ba: Vec<usize> = (0..hv)
            .map(|j| head_file[j])
            .chain((0..hv).map(|j| ba_rows + head_file[j]))
            .collect();
        let out = projection(opts, exec, pkg, &[&la("ssm_out_proj.weight")], &[h], vd)?;
        // out_proj's stored column c holds HF value channel channel_src[c].
        let out_cols = self.channel_src.clone();
        // conv: file [K, conv_dim] with permuted v channels → [conv_dim, K] in HF channel order.
        let conv_name = la("ssm_conv1d.weight");
        let file_conv = pkg.vector(&conv_name)?;
        if file_conv.len() != kk * cd {
            return Err(ModelError::Shape {
                what: format!(
                    "{conv_name}: {} values, expected [{kk}, {cd}] = {}",
                    file_conv.len(),
                    kk * cd
                ),
            });
        }
        let mut conv = vec![0.0f32; cd * kk];
        for ch in 0..cd {
            let file_ch = qkv_file[ch];
            for t in 0..kk {
                conv[ch * kk + t] = file_conv[t * cd + file_ch];
            }
        }
        let per_head = |name: &str| -> Result<Vec<f32>, ModelError> {
            let v = pkg.vector(name)?;
            if v.len() != hv {
                return Err(ModelError::Shape {
                    what: format!("{name}: {} values, expected {hv}", v.len()),
                });
            }
            Ok((0..hv).map(|j| v[head_file[j]]).collect())
        };
        let ssm_a_name = la("ssm_a");
        let a = per_head(&ssm_a_name)?;
        check_a(&ssm_a_name, &a)?;
        Ok(GdnWeights {
            in_qkvz: PermutedProjection::wrap(Box::new(in_qkvz), Some(qkvz_rows), None),
            in_ba: PermutedProjection::wrap(Box::new(in_ba), Some(ba), None),
            conv,
            dt_bias: per_head(&la("ssm_dt.bias"))?,
            a,
            norm: pkg.vector(&la("ssm_norm.weight"))?,
            out: PermutedProjection::wrap(Box::new(out), None, Some(out_cols)),
        })
    }
}

/// A = −exp(A_log) of one GDN layer, `[Hv]`: from the checkpoint's `A_log`, or, in packages
/// imported from a llama.cpp GGUF, its stored `ssm_a` (already −exp(A_log), used as is).
fn gdn_a(
    pkg: &Package,
    a_log_name: &str,
    ssm_a_name: &str,
    hv: usize,
) -> Result<Vec<f32>, ModelError> {
    let (name, a) = if pkg.has_tensor(a_log_name) || !pkg.has_tensor(ssm_a_name) {
        let a: Vec<f32> = pkg.vector(a_log_name)?.iter().map(|x| -x.exp()).collect();
        (a_log_name, a)
    } else {
        (ssm_a_name, pkg.vector(ssm_a_name)?)
    };
    if a.len() != hv {
        return Err(ModelError::Shape {
            what: format!("{name}: {} values, expected {hv}", a.len()),
        });
    }
    check_a(name, &a)?;
    Ok(a)
}

/// A must be negative and finite (the decay α = exp(A · softplus(·)) then lies in (0, 1]).
fn check_a(name: &str, a: &[f32]) -> Result<(), ModelError> {
    for (j, &x) in a.iter().enumerate() {
        if !(x < 0.0 && x.is_finite()) {
            return Err(ModelError::Shape {
                what: format!("{name}[{j}] = {x}: expected A = −exp(A_log) < 0"),
            });
        }
    }
    Ok(())
}

/// FLM `rearrange('(q g p) -> (g q p)', q = 2)`: FLM index → GGUF index over `len` entries in
/// blocks of `unit`.
fn flm_to_gguf(idx: usize, len: usize, unit: usize) -> usize {
    let groups = len / (2 * unit);
    let (block, p) = (idx / unit, idx % unit);
    let (g, q) = (block / 2, block % 2);
    (q * groups + g) * unit + p
}

/// The inverse of a permutation given as "position → source".
fn invert(src: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; src.len()];
    for (pos, &s) in src.iter().enumerate() {
        inv[s] = pos;
    }
    inv
}

/// `names` stacked by rows: one fused matrix when they share a format, else a
/// [`StackedProjection`] of separate ones (a GGUF may mix types, e.g. Q4_1 `attn_qkv` with BF16
/// `attn_gate`; tile row blocks of different formats cannot be concatenated).
fn stacked(
    opts: &LoadOptions,
    exec: &Arc<Executor>,
    pkg: &Arc<Package>,
    names: &[&str],
    rows_each: &[usize],
    cols: usize,
) -> Result<Box<dyn Projection>, ModelError> {
    let mut formats = Vec::with_capacity(names.len());
    for (&n, &r) in names.iter().zip(rows_each) {
        formats.push(pkg.matrix(n, r, cols)?.format);
    }
    if formats.windows(2).all(|f| f[0] == f[1]) {
        return Ok(Box::new(projection(
            opts, exec, pkg, names, rows_each, cols,
        )?));
    }
    let mut parts: Vec<Box<dyn Projection>> = Vec::with_capacity(names.len());
    for (&n, &r) in names.iter().zip(rows_each) {
        parts.push(Box::new(projection(opts, exec, pkg, &[n], &[r], cols)?));
    }
    Ok(Box::new(StackedProjection { parts }))
}

/// Matrices of different formats stacked by rows: each runs on its own, its output rows are
/// placed after the previous part's.
struct StackedProjection {
    parts: Vec<Box<dyn Projection>>,
}

impl Projection for StackedProjection {
    fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows()).sum()
    }
    fn cols(&self) -> usize {
        self.parts.first().map_or(0, |p| p.cols())
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
        let total = self.rows();
        let mut offset = 0;
        for p in &self.parts {
            let n = p.rows();
            let mut tmp = vec![0.0f32; m * n];
            p.gemm(x, m, &mut tmp, family)?;
            for r in 0..m {
                y[r * total + offset..r * total + offset + n]
                    .copy_from_slice(&tmp[r * n..(r + 1) * n]);
            }
            offset += n;
        }
        Ok(())
    }
}

/// A projection whose stored matrix has permuted rows and/or columns: the permutation is applied
/// to the activations (output rows gathered, input columns scattered), so tiled data and kernels
/// stay as they are. Identity maps are not wrapped.
struct PermutedProjection {
    inner: Box<dyn Projection>,
    /// Internal output row i = stored row `rows[i]` (stored rows may outnumber internal ones).
    rows: Option<Vec<usize>>,
    /// Stored input column c = internal column `cols[c]`.
    cols: Option<Vec<usize>>,
}

impl PermutedProjection {
    fn wrap(
        inner: Box<dyn Projection>,
        rows: Option<Vec<usize>>,
        cols: Option<Vec<usize>>,
    ) -> Box<dyn Projection> {
        let identity = |v: &Option<Vec<usize>>, n: usize| match v {
            None => true,
            Some(v) => v.len() == n && v.iter().enumerate().all(|(i, &s)| i == s),
        };
        let (r, c) = (inner.rows(), inner.cols());
        if identity(&rows, r) && identity(&cols, c) {
            return inner;
        }
        Box::new(PermutedProjection { inner, rows, cols })
    }
}

impl Projection for PermutedProjection {
    fn rows(&self) -> usize {
        self.rows.as_ref().map_or(self.inner.rows(), Vec::len)
    }
    fn cols(&self) -> usize {
        self.inner.cols()
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn tiled_format(&self) -> Option<WeightFormat> {
        self.inner.tiled_format()
    }
    fn gemm(
        &self,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        family: RowFamily,
    ) -> Result<(), ModelError> {
        let k = self.inner.cols();
        let permuted_x;
        let x = match &self.cols {
            Some(cols) => {
                permuted_x = (0..m * k)
                    .map(|i| x[(i / k) * k + cols[i % k]])
                    .collect::<Vec<f32>>();
                &permuted_x[..]
            }
            None => x,
        };
        match &self.rows {
            None => self.inner.gemm(x, m, y, family),
            Some(rows) => {
                let (stored, n) = (self.inner.rows(), rows.len());
                let mut tmp = vec![0.0f32; m * stored];
                self.inner.gemm(x, m, &mut tmp, family)?;
                for r in 0..m {
                    for (i, &s) in rows.iter().enumerate() {
                        y[r * n + i] = tmp[r * stored + s];
                    }
                }
                Ok(())
            }
        }
    }
}

/// The layer's projections with a label.
fn layer_projections(l: &Layer) -> Vec<(&dyn Projection, &'static str)> {
    match l {
        Layer::Attention(a) => vec![
            (&*a.qkv, "qkv"),
            (&*a.o, "o"),
            (&*a.gate_up, "gate+up"),
            (&*a.down, "down"),
        ],
        Layer::Linear(g) => vec![
            (&*g.gdn.in_qkvz, "in_proj_qkv+z"),
            (&*g.gdn.in_ba, "in_proj_b+a"),
            (&*g.gdn.out, "out_proj"),
            (&*g.gate_up, "gate+up"),
            (&*g.down, "down"),
        ],
    }
}

fn gemm_needs(f: WeightFormat, k: usize, n: usize, what: &str) -> Vec<KernelNeed> {
    kernels::family_needs(&[ShapeNeed::gemm(f, k, n, what)])
}

/// The tiled GEMM shapes (`K`, `N`) of a hybrid config whose matrices are written by
/// [`write_synthetic`] (tiled when rows are a multiple of 32), for its kernel set.
pub fn synthetic_kernel_keys(c: &ModelConfig, f: WeightFormat) -> Vec<KernelKey> {
    let h = c.hidden;
    let mut shapes = vec![(h, c.vocab), (h, 2 * c.intermediate), (c.intermediate, h)];
    if let Some(d) = &c.linear {
        shapes.push((h, d.conv_dim() + d.value_dim()));
        shapes.push((d.value_dim(), h));
        if d.value_heads % tiles::TILE_ROWS == 0 {
            shapes.push((h, 2 * d.value_heads));
        }
    }
    shapes.push((h, c.qkv_rows()));
    shapes.push((c.q_dim(), h));
    let mut keys: Vec<KernelKey> = RowFamily::ALL
        .into_iter()
        .flat_map(|fam| {
            shapes
                .iter()
                .map(move |&(k, n)| KernelKey::gemm(f, fam, k, n))
        })
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// Architecture of a synthetic package.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthArch {
    /// Hybrid: Gated DeltaNet layers + gated full attention (q/k norm, partial rotary).
    Qwen35,
    /// Plain Llama (attention only).
    Llama,
}

/// Shape and seed of a synthetic package (defaults: a 6-layer hybrid, 2 attention layers).
#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub arch: SynthArch,
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub full_attention_interval: usize,
    pub linear_key_heads: usize,
    pub linear_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub conv_kernel: usize,
    pub seed: u64,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            arch: SynthArch::Qwen35,
            layers: 6,
            hidden: 256,
            intermediate: 512,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            vocab: 512,
            full_attention_interval: 3,
            linear_key_heads: 2,
            linear_value_heads: 4,
            linear_key_head_dim: 64,
            linear_value_head_dim: 64,
            conv_kernel: 4,
            seed: 1,
        }
    }
}

/// SplitMix64: deterministic across platforms.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f64 / (1u64 << 23) as f64 - 1.0) as f32
    }
}

/// The synthetic package's `config.json`.
pub fn synthetic_config(o: &SynthOptions) -> serde_json::Value {
    let mut c = serde_json::json!({
        "hidden_size": o.hidden,
        "intermediate_size": o.intermediate,
        "num_hidden_layers": o.layers,
        "num_attention_heads": o.heads,
        "num_key_value_heads": o.kv_heads,
        "head_dim": o.head_dim,
        "vocab_size": o.vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "bos_token_id": 256,
        "eos_token_id": 256,
        "xdna": { "synthetic": true, "seed": o.seed, "scale_type": "f16", "fused": false },
    });
    match o.arch {
        SynthArch::Llama => {
            c["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
            c["model_type"] = "llama".into();
        }
        SynthArch::Qwen35 => {
            c["architectures"] = serde_json::json!(["Qwen3_5ForCausalLM"]);
            c["model_type"] = "qwen3_5".into();
            let every = o.full_attention_interval.max(1);
            let types: Vec<&str> = (0..o.layers)
                .map(|i| {
                    if (i + 1) % every == 0 {
                        "full_attention"
                    } else {
                        "linear_attention"
                    }
                })
                .collect();
            c["layer_types"] = serde_json::json!(types);
            c["full_attention_interval"] = every.into();
            c["partial_rotary_factor"] = 0.25.into();
            c["attn_output_gate"] = true.into();
            c["linear_num_key_heads"] = o.linear_key_heads.into();
            c["linear_num_value_heads"] = o.linear_value_heads.into();
            c["linear_key_head_dim"] = o.linear_key_head_dim.into();
            c["linear_value_head_dim"] = o.linear_value_head_dim.into();
            c["linear_conv_kernel_dim"] = o.conv_kernel.into();
        }
    }
    c
}

/// What to write for one tensor.
enum Synth {
    /// `[rows, cols]`, uniform in ±sqrt(3 / cols) (unit output variance for unit inputs).
    Matrix { rows: usize, cols: usize },
    /// Plain f32 values `center + spread · u`, u uniform in [-1, 1).
    Vector {
        shape: Vec<usize>,
        center: f32,
        spread: f32,
    },
    /// `A_log = ln(u)`, u uniform in [1, 16) (HF's init).
    ALog { len: usize },
}

fn synthetic_tensors(o: &SynthOptions, c: &ModelConfig) -> Vec<(String, Synth)> {
    let h = o.hidden;
    let mut t: Vec<(String, Synth)> = Vec::new();
    // Zero-centred norms (hybrid) are stored as small offsets; Llama norms as values around 1.
    let norm_center = if c.zero_centered_norms { 0.0 } else { 1.0 };
    let nv = |len: usize| Synth::Vector {
        shape: vec![len],
        center: norm_center,
        spread: 0.1,
    };
    let mat = |rows: usize, cols: usize| Synth::Matrix { rows, cols };
    t.push(("model.embed_tokens.weight".into(), mat(o.vocab, h)));
    for i in 0..o.layers {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        t.push((n("input_layernorm.weight"), nv(h)));
        match c.layer_kind(i) {
            LayerKind::Attention => {
                t.push((n("self_attn.q_proj.weight"), mat(c.q_rows(), h)));
                t.push((n("self_attn.k_proj.weight"), mat(c.kv_dim(), h)));
                t.push((n("self_attn.v_proj.weight"), mat(c.kv_dim(), h)));
                t.push((n("self_attn.o_proj.weight"), mat(h, c.q_dim())));
                if c.qk_norm {
                    t.push((n("self_attn.q_norm.weight"), nv(c.head_dim)));
                    t.push((n("self_attn.k_norm.weight"), nv(c.head_dim)));
                }
            }
            LayerKind::Linear => {
                if let Some(d) = &c.linear {
                    let la = |s: &str| n(&format!("linear_attn.{s}"));
                    let hv = d.value_heads;
                    t.push((la("in_proj_qkv.weight"), mat(d.conv_dim(), h)));
                    t.push((la("in_proj_z.weight"), mat(d.value_dim(), h)));
                    t.push((la("in_proj_b.weight"), mat(hv, h)));
                    t.push((la("in_proj_a.weight"), mat(hv, h)));
                    let a = 1.0 / (d.conv_kernel as f32).sqrt();
                    t.push((
                        la("conv1d.weight"),
                        Synth::Vector {
                            shape: vec![d.conv_dim(), 1, d.conv_kernel],
                            center: 0.0,
                            spread: a,
                        },
                    ));
                    t.push((
                        la("dt_bias"),
                        Synth::Vector {
                            shape: vec![hv],
                            center: 0.0,
                            spread: 1.0,
                        },
                    ));
                    t.push((la("A_log"), Synth::ALog { len: hv }));
                    t.push((
                        la("norm.weight"),
                        Synth::Vector {
                            shape: vec![d.value_head_dim],
                            center: 1.0,
                            spread: 0.1,
                        },
                    ));
                    t.push((la("out_proj.weight"), mat(h, d.value_dim())));
                }
            }
        }
        t.push((n("post_attention_layernorm.weight"), nv(h)));
        t.push((n("mlp.gate_proj.weight"), mat(o.intermediate, h)));
        t.push((n("mlp.up_proj.weight"), mat(o.intermediate, h)));
        t.push((n("mlp.down_proj.weight"), mat(h, o.intermediate)));
    }
    t.push(("model.norm.weight".into(), nv(h)));
    t.push(("lm_head.weight".into(), mat(o.vocab, h)));
    t
}

/// The tile format of synthetic matrices (q8 with f16 scales, column-major codes).
pub const SYNTH_FORMAT: WeightFormat = WeightFormat::Q8 {
    scale: ScaleType::F16,
    order: TileOrder::ColumnMajor,
};

/// Write a deterministic random-weight package into `dir`: `config.json`, `model.q4nx` (q8h
/// tiles for matrices whose rows are a multiple of 32, plain f32 otherwise), a byte-level
/// `tokenizer.json` (256 byte tokens + `<|endoftext|>`) and `tokenizer_config.json`. The kernel
/// set is written by the caller (`xdna pack synth`). Returns the parsed config.
pub fn write_synthetic(dir: &Path, o: &SynthOptions) -> Result<ModelConfig, ModelError> {
    let cfg_json = synthetic_config(o);
    let cfg_path = dir.join("config.json");
    let c = ModelConfig::from_json(&cfg_json, &cfg_path)?;
    if o.vocab < 257 {
        return Err(ModelError::Config {
            file: cfg_path.display().to_string(),
            field: "vocab_size".into(),
            problem: "a synthetic package needs ≥ 257 ids (256 bytes + <|endoftext|>)".into(),
        });
    }
    let io = |p: &Path, e: std::io::Error| ModelError::File {
        path: p.display().to_string(),
        problem: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let tensors = synthetic_tensors(o, &c);
    let mut decl = Vec::with_capacity(tensors.len());
    let mut meta = BTreeMap::new();
    meta.insert("xdna.scale_type".to_string(), "f16".to_string());
    meta.insert("xdna.order".to_string(), "column_major".to_string());
    meta.insert(
        "xdna.source".to_string(),
        format!("synthetic seed {}", o.seed),
    );
    let tiled = |rows: usize| rows.is_multiple_of(tiles::TILE_ROWS);
    for (name, t) in &tensors {
        match t {
            Synth::Matrix { rows, cols } if tiled(*rows) => {
                let bytes =
                    SYNTH_FORMAT
                        .matrix_bytes(*rows, *cols)
                        .map_err(|e| ModelError::Shape {
                            what: format!("{name}: {e}"),
                        })?;
                let tb = tiles::Q8_TILE_BYTES;
                decl.push(Declared {
                    name: name.clone(),
                    dtype: Dtype::I8,
                    shape: vec![bytes / tb, tb],
                });
                meta.insert(format!("xdna.format.{name}"), SYNTH_FORMAT.name().into());
                meta.insert(format!("xdna.shape.{name}"), format!("{rows},{cols}"));
            }
            Synth::Matrix { rows, cols } => decl.push(Declared {
                name: name.clone(),
                dtype: Dtype::F32,
                shape: vec![*rows, *cols],
            }),
            Synth::Vector { shape, .. } => decl.push(Declared {
                name: name.clone(),
                dtype: Dtype::F32,
                shape: shape.clone(),
            }),
            Synth::ALog { len } => decl.push(Declared {
                name: name.clone(),
                dtype: Dtype::F32,
                shape: vec![*len],
            }),
        }
    }
    let mut w = Writer::create(dir.join("model.q4nx"), &decl, &meta)?;
    let mut rng = Rng(o.seed);
    let f32s = |v: &mut dyn Iterator<Item = f32>| -> Vec<u8> {
        v.flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()
    };
    for (name, t) in &tensors {
        match *t {
            Synth::Matrix { rows, cols } if tiled(rows) => {
                let amp = (3.0 / cols as f32).sqrt();
                let d = amp / 127.0;
                let qt = SYNTH_FORMAT.padded_cols(cols) / tiles::TILE_COLS;
                let mut block = vec![0u8; qt * tiles::Q8_TILE_BYTES];
                for _pb in 0..rows / tiles::TILE_ROWS {
                    block.fill(0);
                    for q in 0..qt {
                        let tile =
                            &mut block[q * tiles::Q8_TILE_BYTES..(q + 1) * tiles::Q8_TILE_BYTES];
                        for g in 0..tiles::TILE_COLS / tiles::GROUP {
                            for r in 0..tiles::TILE_ROWS {
                                let mut codes = [0i8; tiles::GROUP];
                                let c0 = q * tiles::TILE_COLS + g * tiles::GROUP;
                                for (k, code) in codes.iter_mut().enumerate() {
                                    if c0 + k < cols {
                                        *code = (rng.unit() * 127.0).round() as i8;
                                    }
                                }
                                tiles::set_q8_cell(
                                    tile,
                                    ScaleType::F16,
                                    TileOrder::ColumnMajor,
                                    g,
                                    r,
                                    d,
                                    &codes,
                                );
                            }
                        }
                    }
                    w.write(name, &block)?;
                }
            }
            Synth::Matrix { rows, cols } => {
                let amp = (3.0 / cols as f32).sqrt();
                let bytes = f32s(&mut (0..rows * cols).map(|_| rng.unit() * amp));
                w.write(name, &bytes)?;
            }
            Synth::Vector {
                ref shape,
                center,
                spread,
            } => {
                let n: usize = shape.iter().product();
                let bytes = f32s(&mut (0..n).map(|_| center + spread * rng.unit()));
                w.write(name, &bytes)?;
            }
            Synth::ALog { len } => {
                let bytes = f32s(&mut (0..len).map(|_| (8.5 + 7.5 * rng.unit()).ln()));
                w.write(name, &bytes)?;
            }
        }
    }
    w.finish()?;
    let write_json = |name: &str, v: &serde_json::Value| -> Result<(), ModelError> {
        let p = dir.join(name);
        let text = serde_json::to_string_pretty(v).map_err(|e| ModelError::File {
            path: p.display().to_string(),
            problem: e.to_string(),
        })?;
        std::fs::write(&p, text).map_err(|e| io(&p, e))
    };
    write_json("config.json", &cfg_json)?;
    let table = crate::weights::tokenizer::byte_to_char_table();
    let mut vocab = serde_json::Map::new();
    for (b, ch) in table.iter().enumerate() {
        vocab.insert(ch.to_string(), serde_json::Value::from(b as u64));
    }
    vocab.insert("<|endoftext|>".into(), 256u64.into());
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    write_json(
        "tokenizer.json",
        &serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{ "id": 256, "content": "<|endoftext|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true }],
            "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
            "decoder": byte_level,
            "model": { "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": [] }
        }),
    )?;
    write_json(
        "tokenizer_config.json",
        &serde_json::json!({
            "add_bos_token": false, "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
            "tokenizer_class": "GPT2Tokenizer", "model_max_length": 4096,
        }),
    )?;
    Ok(c)
}
