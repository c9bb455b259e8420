//! Hybrid (Qwen3.5-style) packages: loading Gated DeltaNet + gated-attention layers.
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
//! FastFlowLM Q4NX packages are read too, through the name and layout mapping of
//! [`fflm_layout`](super::fflm_layout). Small random-weight packages in this layout (`xdna pack
//! synth`) are written by [`synthetic`](super::synthetic).

use super::fflm_layout::FlmLayout;
use super::gdn::GdnWeights;
use super::layers::{Layer, LayerWeights, LinearLayerWeights, ModelWeights, Projection};
use super::load::{kernel_dir, projection, LoadOptions, PackageEmbedding};
use super::ModelError;
use crate::kernels::{self, Executor, KernelNeed, KernelSet, RowFamily, ShapeNeed};
use crate::tiles::WeightFormat;
use crate::weights::{LayerKind, ModelConfig, Package};
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
pub(super) fn check_a(name: &str, a: &[f32]) -> Result<(), ModelError> {
    for (j, &x) in a.iter().enumerate() {
        if !(x < 0.0 && x.is_finite()) {
            return Err(ModelError::Shape {
                what: format!("{name}[{j}] = {x}: expected A = −exp(A_log) < 0"),
            });
        }
    }
    Ok(())
}
/// `names` stacked by rows: one fused matrix when they share a format, else a
/// [`StackedProjection`] of separate ones (a GGUF may mix types, e.g. Q4_1 `attn_qkv` with BF16
/// `attn_gate`; tile row blocks of different formats cannot be concatenated).
pub(super) fn stacked(
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
pub(super) struct PermutedProjection {
    inner: Box<dyn Projection>,
    /// Internal output row i = stored row `rows[i]` (stored rows may outnumber internal ones).
    rows: Option<Vec<usize>>,
    /// Stored input column c = internal column `cols[c]`.
    cols: Option<Vec<usize>>,
}

impl PermutedProjection {
    pub(super) fn wrap(
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
