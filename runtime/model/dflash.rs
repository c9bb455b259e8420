//! DFlash block drafting (generation 1, z-lab `DFlashDraftModel`): the draft's weights and its
//! forward, fast path through the kernels layer and an f64 reference beside it.
//!
//! A draft attends over *context rows*, one per committed target position: the target's hidden
//! states after the tap layers ([`crate::weights::DflashParams::target_layers`]), concatenated,
//! through the fusion matrix `fc` and `hidden_norm`. Each layer projects them to keys (k_norm,
//! RoPE at the row's position) and values once; they are cached per context row, so growing
//! the context 2 + 1 + 2 rows gives the same cache as one push of 5. A *block* is the pending
//! token's embedding then `block_size − 1` copies of the mask token's (the target's own
//! embedding table) at the next positions; per layer: input norm, queries, keys and values from
//! the block rows (q/k norm, RoPE), attention of every block row over all context rows and
//! every block row (no causal mask inside the block unless the draft says so), output
//! projection, residual, gated MLP, residual. The final norm, then the target's own head: block
//! row `i ≥ 1` scores the token at position `P + i`, the drafts are their argmaxes.

use std::sync::Arc;

use super::layers::{ModelWeights, Projection};
use super::load::{projection, LoadOptions};
use super::load_hybrid::stacked;
use super::ops;
use super::ModelError;
use crate::kernels::attention::{attend_rows, AttentionRow, AttentionShape};
use crate::kernels::{activation, Executor, HostExecutor, RowFamily};
use crate::weights::{DflashParams, ModelConfig, Package};

/// Most rows one projection call takes (the `m128` family).
const MAX_ROWS_PER_GEMM: usize = RowFamily::M128.max_rows();

/// One draft layer's weights.
struct DraftLayer {
    attn_norm: Vec<f32>,
    q: Box<dyn Projection>,
    /// k ‖ v, `[2 kv_dim, hidden]`.
    kv: Box<dyn Projection>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    o: Box<dyn Projection>,
    ffn_norm: Vec<f32>,
    /// gate ‖ up, `[2 intermediate, hidden]`.
    gate_up: Box<dyn Projection>,
    down: Box<dyn Projection>,
}

/// A DFlash draft's weights on the host executor.
pub struct DflashWeights {
    config: ModelConfig,
    params: DflashParams,
    layers: Vec<DraftLayer>,
    fc: Box<dyn Projection>,
    hidden_norm: Vec<f32>,
    final_norm: Vec<f32>,
}

impl DflashWeights {
    /// Loads a DFlash package (a `dflash` GGUF opens as one through the import). The projections
    /// run on the host executor; `exact` as in [`LoadOptions::exact`] (no activation rounding).
    pub fn load(pkg: &Arc<Package>, exact: bool) -> Result<DflashWeights, ModelError> {
        let config = pkg.config().clone();
        let Some(params) = config.dflash.clone() else {
            return Err(ModelError::Unsupported {
                what: format!(
                    "{}: model_type {:?} is not a DFlash draft (config.json has no dflash_config)",
                    pkg.dir().display(),
                    config.model_type
                ),
            });
        };
        let opts = LoadOptions {
            exact,
            ..LoadOptions::default()
        };
        let exec = Arc::new(Executor::Host(HostExecutor::new()));
        let (h, qd, kvd, inter) = (
            config.hidden,
            config.q_dim(),
            config.kv_dim(),
            config.intermediate,
        );
        let vector = |name: &str, len: usize| -> Result<Vec<f32>, ModelError> {
            let v = pkg.vector(name)?;
            if v.len() != len {
                return Err(ModelError::Shape {
                    what: format!(
                        "{}: {name} holds {} values, expected {len}",
                        pkg.dir().display(),
                        v.len()
                    ),
                });
            }
            Ok(v)
        };
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let n = |s: &str| format!("model.layers.{i}.{s}");
            let one =
                |s: &str, rows: usize, cols: usize| -> Result<Box<dyn Projection>, ModelError> {
                    Ok(Box::new(projection(
                        &opts,
                        &exec,
                        pkg,
                        &[&n(s)],
                        &[rows],
                        cols,
                    )?))
                };
            let (k, v) = (n("self_attn.k_proj.weight"), n("self_attn.v_proj.weight"));
            let (gate, up) = (n("mlp.gate_proj.weight"), n("mlp.up_proj.weight"));
            layers.push(DraftLayer {
                attn_norm: vector(&n("input_layernorm.weight"), h)?,
                q: one("self_attn.q_proj.weight", qd, h)?,
                kv: stacked(&opts, &exec, pkg, &[&k, &v], &[kvd, kvd], h)?,
                q_norm: vector(&n("self_attn.q_norm.weight"), config.head_dim)?,
                k_norm: vector(&n("self_attn.k_norm.weight"), config.head_dim)?,
                o: one("self_attn.o_proj.weight", h, qd)?,
                ffn_norm: vector(&n("post_attention_layernorm.weight"), h)?,
                gate_up: stacked(&opts, &exec, pkg, &[&gate, &up], &[inter, inter], h)?,
                down: one("mlp.down_proj.weight", h, inter)?,
            });
        }
        let fc_cols = params.target_layers.len() * h;
        let fc = Box::new(projection(
            &opts,
            &exec,
            pkg,
            &["model.fc.weight"],
            &[h],
            fc_cols,
        )?);
        Ok(DflashWeights {
            hidden_norm: vector("model.hidden_norm.weight", h)?,
            final_norm: vector("model.norm.weight", h)?,
            config,
            params,
            layers,
            fc,
        })
    }

    /// The draft's description.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Block size, tap layers, mask token.
    pub fn params(&self) -> &DflashParams {
        &self.params
    }

    /// Checks that the draft fits `target`: the same hidden width (context rows concatenate the
    /// target's hidden states; the block rows are its embeddings), the same vocabulary (its head
    /// scores the block), tap layers inside the target.
    pub fn check_target(&self, target: &ModelConfig) -> Result<(), ModelError> {
        let c = &self.config;
        let bad = |what: String| ModelError::Unsupported { what };
        if c.hidden != target.hidden {
            return Err(bad(format!(
                "the DFlash draft is {} wide, the target {}: the draft reads the target's hidden states and embeddings",
                c.hidden, target.hidden
            )));
        }
        if c.vocab != target.vocab {
            return Err(bad(format!(
                "the DFlash draft has a vocabulary of {}, the target {}",
                c.vocab, target.vocab
            )));
        }
        if let Some(&l) = self
            .params
            .target_layers
            .iter()
            .find(|&&l| l >= target.layers)
        {
            return Err(bad(format!(
                "the DFlash draft reads the target's layer {l}, the target has {} layers",
                target.layers
            )));
        }
        Ok(())
    }
}

/// Per-pass scratch, sized for one block or one chunk of context rows.
#[derive(Default)]
struct Scratch {
    g: Vec<f32>,
    gn: Vec<f32>,
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    kv: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    scores: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

fn sized(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

/// A DFlash draft bound to its target: the cached context rows and the block forward.
pub struct DflashDraft {
    w: Arc<DflashWeights>,
    target: Arc<ModelWeights>,
    inv_freq: Vec<f64>,
    /// Context rows cached.
    context: usize,
    /// Per layer: keys then values of every context row, `[context, kv_dim]` each, f32.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    s: Scratch,
    logits: Vec<f32>,
}

impl DflashDraft {
    /// Binds `w` to `target` (checked with [`DflashWeights::check_target`]); no context yet.
    pub fn new(w: Arc<DflashWeights>, target: Arc<ModelWeights>) -> Result<Self, ModelError> {
        w.check_target(&target.config)?;
        let layers = w.layers.len();
        Ok(DflashDraft {
            inv_freq: w.config.rope_inv_freq(),
            w,
            target,
            context: 0,
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            s: Scratch::default(),
            logits: Vec::new(),
        })
    }

    /// The draft's weights.
    pub fn weights(&self) -> &DflashWeights {
        &self.w
    }

    /// Context rows cached (= the target position the next block starts at).
    pub fn context(&self) -> usize {
        self.context
    }

    /// Forgets every context row.
    pub fn reset(&mut self) {
        self.truncate(0);
    }

    /// Keeps the first `rows` context rows.
    pub fn truncate(&mut self, rows: usize) {
        let kvd = self.w.config.kv_dim();
        if rows < self.context {
            self.context = rows;
            for l in 0..self.keys.len() {
                self.keys[l].truncate(rows * kvd);
                self.values[l].truncate(rows * kvd);
            }
        }
    }

    /// Appends context rows at the next positions: `features` is `[rows, taps · hidden]`, each
    /// row the target's hidden states after the tap layers, concatenated in tap order.
    pub fn push_context(&mut self, features: &[f32], rows: usize) -> Result<(), ModelError> {
        let c = &self.w.config;
        let width = self.w.params.target_layers.len() * c.hidden;
        if features.len() != rows * width {
            return Err(ModelError::Shape {
                what: format!(
                    "{} context values for {rows} rows of {width}",
                    features.len()
                ),
            });
        }
        for (chunk_index, chunk) in features.chunks(MAX_ROWS_PER_GEMM * width).enumerate() {
            let n = chunk.len() / width;
            let first = self.context + chunk_index * MAX_ROWS_PER_GEMM;
            self.push_chunk(chunk, n, first)?;
        }
        self.context += rows;
        Ok(())
    }

    fn push_chunk(
        &mut self,
        features: &[f32],
        rows: usize,
        first: usize,
    ) -> Result<(), ModelError> {
        let c = &self.w.config;
        let (h, hd, kvd) = (c.hidden, c.head_dim, c.kv_dim());
        let eps = c.rms_eps as f32;
        let family = RowFamily::for_rows(rows);
        let s = &mut self.s;
        let g = sized(&mut s.g, rows * h);
        self.w.fc.gemm(features, rows, g, family)?;
        let gn = sized(&mut s.gn, rows * h);
        ops::rmsnorm(&s.g[..rows * h], &self.w.hidden_norm, eps, gn);
        let half = c.rotary_dim / 2;
        let (cos, sin) = (
            sized(&mut s.cos, rows * half),
            sized(&mut s.sin, rows * half),
        );
        for r in 0..rows {
            ops::rope_angles(
                first + r,
                &self.inv_freq,
                &mut cos[r * half..(r + 1) * half],
                &mut sin[r * half..(r + 1) * half],
            );
        }
        for (l, layer) in self.w.layers.iter().enumerate() {
            let kv = sized(&mut s.kv, rows * 2 * kvd);
            layer.kv.gemm(&s.gn[..rows * h], rows, kv, family)?;
            for r in 0..rows {
                let row = &mut kv[r * 2 * kvd..(r + 1) * 2 * kvd];
                let (k, v) = row.split_at_mut(kvd);
                for head in k.chunks_exact_mut(hd) {
                    ops::rmsnorm_inplace(head, &layer.k_norm, eps);
                    rope_head(
                        head,
                        c.rotary_dim,
                        &s.cos[r * half..(r + 1) * half],
                        &s.sin[r * half..(r + 1) * half],
                    );
                }
                self.keys[l].extend_from_slice(k);
                self.values[l].extend_from_slice(v);
            }
        }
        Ok(())
    }

    /// Runs the block `[pending, mask, …]` at positions `context()..` and returns the logits of
    /// rows `1..block_size`, `(block_size − 1) × vocab`: row `i` scores the draft at position
    /// `context() + i`. The context is left as it was.
    pub fn block_logits(&mut self, pending: u32) -> Result<&[f32], ModelError> {
        let c = &self.w.config;
        let p = &self.w.params;
        let (h, hd, kvd, qd, inter) = (c.hidden, c.head_dim, c.kv_dim(), c.q_dim(), c.intermediate);
        let vocab = self.target.config.vocab;
        if pending as usize >= vocab {
            return Err(ModelError::Shape {
                what: format!("pending token {pending} is outside the vocabulary of {vocab}"),
            });
        }
        let eps = c.rms_eps as f32;
        let rows = p.block_size;
        let base = self.context;
        let family = RowFamily::for_rows(rows);
        let s = &mut self.s;
        let x = sized(&mut s.x, rows * h);
        for r in 0..rows {
            let token = if r == 0 { pending } else { p.mask_token_id };
            self.target.embed.row(token, &mut x[r * h..(r + 1) * h])?;
        }
        let half = c.rotary_dim / 2;
        let (cos, sin) = (
            sized(&mut s.cos, rows * half),
            sized(&mut s.sin, rows * half),
        );
        for r in 0..rows {
            ops::rope_angles(
                base + r,
                &self.inv_freq,
                &mut cos[r * half..(r + 1) * half],
                &mut sin[r * half..(r + 1) * half],
            );
        }
        let total = base + rows;
        sized(&mut s.scores, total);
        for (l, layer) in self.w.layers.iter().enumerate() {
            let xn = sized(&mut s.xn, rows * h);
            ops::rmsnorm(&s.x[..rows * h], &layer.attn_norm, eps, xn);
            let q = sized(&mut s.q, rows * qd);
            layer.q.gemm(&s.xn[..rows * h], rows, q, family)?;
            let kv = sized(&mut s.kv, rows * 2 * kvd);
            layer.kv.gemm(&s.xn[..rows * h], rows, kv, family)?;
            for r in 0..rows {
                let (cr, sr) = (
                    &s.cos[r * half..(r + 1) * half],
                    &s.sin[r * half..(r + 1) * half],
                );
                for head in s.q[r * qd..(r + 1) * qd].chunks_exact_mut(hd) {
                    ops::rmsnorm_inplace(head, &layer.q_norm, eps);
                    rope_head(head, c.rotary_dim, cr, sr);
                }
                let row = &mut s.kv[r * 2 * kvd..(r + 1) * 2 * kvd];
                let (k, v) = row.split_at_mut(kvd);
                for head in k.chunks_exact_mut(hd) {
                    ops::rmsnorm_inplace(head, &layer.k_norm, eps);
                    rope_head(head, c.rotary_dim, cr, sr);
                }
                self.keys[l].extend_from_slice(k);
                self.values[l].extend_from_slice(v);
            }
            let (keys, values) = (&self.keys[l], &self.values[l]);
            let q_all = &s.q[..rows * qd];
            let causal = p.causal;
            let attn = sized(&mut s.attn, rows * qd);
            attend_rows(
                AttentionShape {
                    heads: c.heads,
                    kv_heads: c.kv_heads,
                    head_dim: hd,
                },
                rows,
                &|i| AttentionRow {
                    q: &q_all[i * qd..(i + 1) * qd],
                    k_cache: keys.as_slice(),
                    v_cache: values.as_slice(),
                    last: if causal { base + i } else { total - 1 },
                },
                &mut s.scores,
                attn,
            );
            self.keys[l].truncate(base * kvd);
            self.values[l].truncate(base * kvd);
            let o = sized(&mut s.o, rows * h);
            layer.o.gemm(&s.attn[..rows * qd], rows, o, family)?;
            for (xv, ov) in s.x[..rows * h].iter_mut().zip(o.iter()) {
                *xv += ov;
            }
            let xn = sized(&mut s.xn, rows * h);
            ops::rmsnorm(&s.x[..rows * h], &layer.ffn_norm, eps, xn);
            let gu = sized(&mut s.gate_up, rows * 2 * inter);
            layer.gate_up.gemm(&s.xn[..rows * h], rows, gu, family)?;
            let act = sized(&mut s.act, rows * inter);
            activation::swiglu(&s.gate_up[..rows * 2 * inter], inter, act);
            let o = sized(&mut s.o, rows * h);
            layer.down.gemm(&s.act[..rows * inter], rows, o, family)?;
            for (xv, ov) in s.x[..rows * h].iter_mut().zip(o.iter()) {
                *xv += ov;
            }
        }
        let drafts = rows - 1;
        let xn = sized(&mut s.xn, drafts * h);
        ops::rmsnorm(&s.x[h..rows * h], &self.w.final_norm, eps, xn);
        let logits = sized(&mut self.logits, drafts * vocab);
        self.target.lm_head.gemm(
            &s.xn[..drafts * h],
            drafts,
            logits,
            RowFamily::for_rows(drafts),
        )?;
        Ok(&self.logits[..drafts * vocab])
    }
}

fn tile_error(name: &str, e: crate::tiles::TileError) -> ModelError {
    ModelError::Shape {
        what: format!("{name}: {e}"),
    }
}

/// RoPE on the first `rotary_dim` values of one head (HF half-split pairs).
fn rope_head(head: &mut [f32], rotary_dim: usize, cos: &[f32], sin: &[f32]) {
    ops::rope_half_split(&mut head[..rotary_dim], cos, sin);
}

/// The same forward from the package's decoded weights in f64, one row at a time, with nothing
/// cached: `features` `[context, taps · hidden]` and the block `[pending, mask, …]` give the
/// `(block_size − 1) × vocab` logits. `target` supplies the embedding rows and the head (its
/// `lm_head.weight`, or the embedding table when tied). Slow; for tests.
pub fn reference_block_logits(
    draft: &Package,
    target: &Package,
    features: &[f32],
    pending: u32,
) -> Result<Vec<f32>, ModelError> {
    let c = draft.config();
    let Some(p) = c.dflash.as_ref() else {
        return Err(ModelError::Unsupported {
            what: "not a DFlash draft".into(),
        });
    };
    let tc = target.config();
    let (h, hd, kvd, qd, inter) = (c.hidden, c.head_dim, c.kv_dim(), c.q_dim(), c.intermediate);
    let eps = c.rms_eps;
    let width = p.target_layers.len() * h;
    let ctx = features.len() / width;
    let matrix =
        |pkg: &Package, name: &str, rows: usize, cols: usize| -> Result<Vec<f64>, ModelError> {
            Ok(pkg
                .matrix(name, rows, cols)?
                .decode_f32()
                .map_err(|e| tile_error(name, e))?
                .into_iter()
                .map(f64::from)
                .collect())
        };
    let vector = |name: &str| -> Result<Vec<f64>, ModelError> {
        Ok(draft.vector(name)?.into_iter().map(f64::from).collect())
    };
    let matvec = |w: &[f64], x: &[f64], rows: usize| -> Vec<f64> {
        let cols = x.len();
        (0..rows)
            .map(|r| {
                w[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect()
    };
    let rms = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, g)| v * inv * g).collect()
    };
    let half = c.rotary_dim / 2;
    let rope = |head: &mut [f64], pos: usize| {
        for j in 0..half {
            let freq = 1.0 / c.rope_theta.powf(2.0 * j as f64 / c.rotary_dim as f64);
            let (sa, ca) = (pos as f64 * freq).sin_cos();
            let (a, b) = (head[j], head[j + half]);
            head[j] = a * ca - b * sa;
            head[j + half] = b * ca + a * sa;
        }
    };
    let fc = matrix(draft, "model.fc.weight", h, width)?;
    let hidden_norm = vector("model.hidden_norm.weight")?;
    let context: Vec<Vec<f64>> = (0..ctx)
        .map(|r| {
            let f: Vec<f64> = features[r * width..(r + 1) * width]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            rms(&matvec(&fc, &f, h), &hidden_norm)
        })
        .collect();
    let embed = target.matrix(crate::weights::package::EMBED, tc.vocab, tc.hidden)?;
    let rows = p.block_size;
    let mut x: Vec<Vec<f64>> = Vec::with_capacity(rows);
    let mut buf = vec![0f32; h];
    for r in 0..rows {
        let token = if r == 0 { pending } else { p.mask_token_id };
        embed
            .decode_row(token as usize, &mut buf)
            .map_err(|e| tile_error(crate::weights::package::EMBED, e))?;
        x.push(buf.iter().map(|&v| f64::from(v)).collect());
    }
    let group = c.heads / c.kv_heads;
    for l in 0..c.layers {
        let n = |s: &str| format!("model.layers.{l}.{s}");
        let wq = matrix(draft, &n("self_attn.q_proj.weight"), qd, h)?;
        let wk = matrix(draft, &n("self_attn.k_proj.weight"), kvd, h)?;
        let wv = matrix(draft, &n("self_attn.v_proj.weight"), kvd, h)?;
        let wo = matrix(draft, &n("self_attn.o_proj.weight"), h, qd)?;
        let wg = matrix(draft, &n("mlp.gate_proj.weight"), inter, h)?;
        let wu = matrix(draft, &n("mlp.up_proj.weight"), inter, h)?;
        let wd = matrix(draft, &n("mlp.down_proj.weight"), h, inter)?;
        let (qn, kn) = (
            vector(&n("self_attn.q_norm.weight"))?,
            vector(&n("self_attn.k_norm.weight"))?,
        );
        let (an, fnorm) = (
            vector(&n("input_layernorm.weight"))?,
            vector(&n("post_attention_layernorm.weight"))?,
        );
        // Keys and values: context rows at 0..ctx, then block rows at ctx..ctx+rows.
        let mut keys = Vec::with_capacity(ctx + rows);
        let mut values = Vec::with_capacity(ctx + rows);
        let kv_of = |src: &[f64], pos: usize| -> (Vec<f64>, Vec<f64>) {
            let mut k = matvec(&wk, src, kvd);
            for head in k.chunks_exact_mut(hd) {
                let normed = rms(head, &kn);
                head.copy_from_slice(&normed);
                rope(head, pos);
            }
            (k, matvec(&wv, src, kvd))
        };
        for (r, g) in context.iter().enumerate() {
            let (k, v) = kv_of(g, r);
            keys.push(k);
            values.push(v);
        }
        let xn: Vec<Vec<f64>> = x.iter().map(|xr| rms(xr, &an)).collect();
        for (r, xr) in xn.iter().enumerate() {
            let (k, v) = kv_of(xr, ctx + r);
            keys.push(k);
            values.push(v);
        }
        for r in 0..rows {
            let mut q = matvec(&wq, &xn[r], qd);
            for head in q.chunks_exact_mut(hd) {
                let normed = rms(head, &qn);
                head.copy_from_slice(&normed);
                rope(head, ctx + r);
            }
            let last = if p.causal { ctx + r } else { ctx + rows - 1 };
            let mut attn = vec![0f64; qd];
            for head in 0..c.heads {
                let kvh = head / group;
                let qh = &q[head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=last)
                    .map(|j| {
                        let kh = &keys[j][kvh * hd..(kvh + 1) * hd];
                        qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = weights.iter().sum();
                for (j, wj) in weights.iter().enumerate() {
                    let vh = &values[j][kvh * hd..(kvh + 1) * hd];
                    for d in 0..hd {
                        attn[head * hd + d] += wj / sum * vh[d];
                    }
                }
            }
            let o = matvec(&wo, &attn, h);
            for (xv, ov) in x[r].iter_mut().zip(o) {
                *xv += ov;
            }
        }
        for xr in x.iter_mut() {
            let xn = rms(xr, &fnorm);
            let gate = matvec(&wg, &xn, inter);
            let up = matvec(&wu, &xn, inter);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            for (xv, dv) in xr.iter_mut().zip(matvec(&wd, &act, h)) {
                *xv += dv;
            }
        }
    }
    let final_norm = vector("model.norm.weight")?;
    let head_name = target.lm_head_name();
    let head = target.matrix(head_name, tc.vocab, tc.hidden)?;
    let mut out = Vec::with_capacity((rows - 1) * tc.vocab);
    let normed: Vec<Vec<f64>> = x[1..].iter().map(|xr| rms(xr, &final_norm)).collect();
    let mut row = vec![0f32; h];
    let mut logits = vec![0f64; (rows - 1) * tc.vocab];
    for t in 0..tc.vocab {
        head.decode_row(t, &mut row)
            .map_err(|e| tile_error(head_name, e))?;
        for (r, xr) in normed.iter().enumerate() {
            logits[r * tc.vocab + t] = row.iter().zip(xr).map(|(&a, b)| f64::from(a) * b).sum();
        }
    }
    out.extend(logits.into_iter().map(|v| v as f32));
    Ok(out)
}
