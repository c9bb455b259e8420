//! The reference forward: the test oracle of the fast path.
//!
//! Weights are decoded to f32 straight from the GGUF file by the slow block decoders of
//! [`super::gguf_lite`] (no tiles, no kernels layer, no rotary un-interleave); every dot product
//! accumulates in f64; attention is a plain causal softmax over the whole sequence. Llama GGUFs keep
//! Q/K rows in llama.cpp's rotary interleave, so RoPE here rotates adjacent pairs `(2j, 2j+1)`
//! (the fast path rotates `(j, j + d/2)` on un-interleaved rows); Qwen GGUFs are not permuted and
//! use the half-split ("NeoX") rotation.

use super::gguf_lite::GgufLite;
use super::ModelError;
use crate::weights::gguf::GgufFile;
use crate::weights::{LayerKind, ModelConfig};
use std::path::Path;

struct RefLayer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

/// The reference model (weights in f32, no state: each call runs a whole sequence).
pub struct Reference {
    /// The model description.
    pub config: ModelConfig,
    gguf: GgufLite,
    layers: Vec<RefLayer>,
    final_norm: Vec<f32>,
    /// `None` when tied to the embedding.
    output: Option<Vec<f32>>,
    embed: Vec<f32>,
    interleaved_rope: bool,
    act_q8: ActivationRounding,
    /// With q8 rounding: refine groups whose max exceeds this many times the row's RMS.
    act_refine: Option<f32>,
}

/// Which projections' input activations [`Reference`] rounds to q8 (all false = exact f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActivationRounding {
    /// The fused Q, K, V projections (input: the attention RMSNorm's output).
    pub qkv: bool,
    /// The attention output projection.
    pub o: bool,
    /// The gate and up projections (input: the FFN RMSNorm's output).
    pub gate_up: bool,
    /// The down projection (input: the SwiGLU product).
    pub down: bool,
    /// The output head (input: the final RMSNorm's output).
    pub lm_head: bool,
}

impl ActivationRounding {
    /// No rounding: the exact reference.
    pub const NONE: Self = ActivationRounding {
        qkv: false,
        o: false,
        gate_up: false,
        down: false,
        lm_head: false,
    };
    /// Every projection, as the fast kernels do.
    pub const ALL: Self = ActivationRounding {
        qkv: true,
        o: true,
        gate_up: true,
        down: true,
        lm_head: true,
    };
    /// The names [`ActivationRounding::parse`] accepts, besides `all` and `none`.
    pub const NAMES: [&'static str; 5] = ["qkv", "o", "gate_up", "down", "lm_head"];

    /// A comma-separated list of [`Self::NAMES`], or `all`, or `none`.
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut r = Self::NONE;
        for name in list.split(',').map(str::trim) {
            match name {
                "all" => r = Self::ALL,
                "none" => {}
                "qkv" => r.qkv = true,
                "o" => r.o = true,
                "gate_up" => r.gate_up = true,
                "down" => r.down = true,
                "lm_head" => r.lm_head = true,
                other => {
                    return Err(format!(
                        "unknown projection `{other}` (expected all, none or a comma list of {})",
                        Self::NAMES.join(", ")
                    ))
                }
            }
        }
        Ok(r)
    }

    /// The rounded projections, comma-separated (`all` / `none` when every one / none is).
    pub fn names(&self) -> String {
        if *self == Self::ALL {
            return "all".into();
        }
        let on = [self.qkv, self.o, self.gate_up, self.down, self.lm_head];
        let names: Vec<&str> = Self::NAMES
            .iter()
            .zip(on)
            .filter(|(_, on)| *on)
            .map(|(name, _)| *name)
            .collect();
        if names.is_empty() {
            "none".into()
        } else {
            names.join(",")
        }
    }
}

/// ggml `q8_1`-style activation rounding of one row, written independently of the kernels layer:
/// per 32 values `d = max|x| / 127`, `x̂ = d · round_half_even(x / d)`.
pub fn quantize_q8_row(x: &[f32]) -> Vec<f32> {
    quantize_q8_row_refined(x, None)
}

/// max |g|.
fn abs_max(g: &[f32]) -> f32 {
    g.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// One group's q8 rounding: `d = max|g| / 127`, `d · round_half_even(g / d)`.
fn q8_group(g: &[f32]) -> Vec<f32> {
    let d = abs_max(g) / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    g.iter()
        .map(|&v| (v * inv).round_ties_even().clamp(-127.0, 127.0) * d)
        .collect()
}

/// [`quantize_q8_row`], and with `Some(ratio)` every group whose max |x| exceeds `ratio` × the
/// row's RMS gets a second q8 pass over its residual: `x̂ = x̂₁ + q8(x − x̂₁)` (a group crushed by
/// one outlier keeps its small values).
pub fn quantize_q8_row_refined(x: &[f32], outlier_ratio: Option<f32>) -> Vec<f32> {
    // Groups whose max exceeds this get the second pass (none without a ratio).
    let outlier_above = outlier_ratio.map(|ratio| {
        let mean_square =
            x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len().max(1) as f64;
        ratio * mean_square.sqrt() as f32
    });
    let mut out = Vec::with_capacity(x.len());
    for g in x.chunks(32) {
        let first = q8_group(g);
        match outlier_above {
            Some(limit) if abs_max(g) > limit => {
                let residual: Vec<f32> = g.iter().zip(&first).map(|(&v, &q)| v - q).collect();
                out.extend(first.iter().zip(q8_group(&residual)).map(|(&a, b)| a + b));
            }
            _ => out.extend(first),
        }
    }
    out
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// `y[t][r] = Σ_k x̂[t][k] w[r][k]` with f64 accumulation; `x̂ = x`, or q8-rounded when `q8`.
fn matmul(x: &[Vec<f32>], w: &[f32], rows: usize, q8: bool, refine: Option<f32>) -> Vec<Vec<f32>> {
    let k = x.first().map_or(0, |v| v.len());
    let xq: Vec<Vec<f32>>;
    let x = if q8 {
        xq = x
            .iter()
            .map(|r| quantize_q8_row_refined(r, refine))
            .collect();
        &xq
    } else {
        x
    };
    let mut y = vec![vec![0f32; rows]; x.len()];
    for r in 0..rows {
        let wr = &w[r * k..(r + 1) * k];
        for (t, xt) in x.iter().enumerate() {
            y[t][r] = dot64(xt, wr) as f32;
        }
    }
    y
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(&v, &g)| (v as f64 * inv * g as f64) as f32)
        .collect()
}

impl Reference {
    /// Load a llama-family GGUF.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let g = GgufLite::open(path)?;
        let config = ModelConfig::from_gguf(&GgufFile::open(path)?)?;
        let arch = g
            .meta_str("general.architecture")
            .unwrap_or("llama")
            .to_string();
        let opt = |name: String| -> Result<Option<Vec<f32>>, ModelError> {
            if g.tensors.contains_key(&name) {
                g.decode_f32(&name).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let t = |s: &str| g.decode_f32(&format!("blk.{i}.{s}"));
            layers.push(RefLayer {
                attn_norm: t("attn_norm.weight")?,
                wq: t("attn_q.weight")?,
                wk: t("attn_k.weight")?,
                wv: t("attn_v.weight")?,
                bq: opt(format!("blk.{i}.attn_q.bias"))?,
                bk: opt(format!("blk.{i}.attn_k.bias"))?,
                bv: opt(format!("blk.{i}.attn_v.bias"))?,
                q_norm: opt(format!("blk.{i}.attn_q_norm.weight"))?,
                k_norm: opt(format!("blk.{i}.attn_k_norm.weight"))?,
                wo: t("attn_output.weight")?,
                ffn_norm: t("ffn_norm.weight")?,
                w_gate: t("ffn_gate.weight")?,
                w_up: t("ffn_up.weight")?,
                w_down: t("ffn_down.weight")?,
            });
        }
        Ok(Reference {
            final_norm: g.decode_f32("output_norm.weight")?,
            output: opt("output.weight".into())?,
            embed: g.decode_f32("token_embd.weight")?,
            interleaved_rope: arch == "llama",
            act_q8: ActivationRounding::NONE,
            act_refine: None,
            layers,
            config,
            gguf: g,
        })
    }

    /// Round every projection's input activations to q8 per 32 values (as ggml's q8_1 and the
    /// kernels layer's quantized paths do), isolating the fast path's remaining differences.
    pub fn with_activation_q8(self, on: bool) -> Self {
        self.with_activation_q8_at(if on {
            ActivationRounding::ALL
        } else {
            ActivationRounding::NONE
        })
    }

    /// Round the input activations of the chosen projections only: how much of the fast path's
    /// distance from this reference each projection's q8 rounding accounts for.
    pub fn with_activation_q8_at(mut self, rounding: ActivationRounding) -> Self {
        self.act_q8 = rounding;
        self
    }

    /// Where activations are rounded, give every 32-value group whose max |x| exceeds `ratio` ×
    /// the row's RMS a second q8 pass over its residual ([`quantize_q8_row_refined`]): what a
    /// kernel refining only the outlier groups would reach.
    pub fn with_outlier_refinement(mut self, ratio: Option<f32>) -> Self {
        self.act_refine = ratio;
        self
    }

    /// The GGUF file this reference reads.
    pub fn gguf(&self) -> &GgufLite {
        &self.gguf
    }

    fn rope(&self, x: &mut [f32], pos: usize) {
        let c = &self.config;
        let hd = c.head_dim;
        let inv = c.rope_inv_freq();
        for head in x.chunks_exact_mut(hd) {
            for (j, &f) in inv.iter().enumerate() {
                let a = pos as f64 * f;
                let (s, co) = a.sin_cos();
                let (i0, i1) = if self.interleaved_rope {
                    (2 * j, 2 * j + 1)
                } else {
                    (j, j + hd / 2)
                };
                let (x0, x1) = (head[i0] as f64, head[i1] as f64);
                head[i0] = (x0 * co - x1 * s) as f32;
                head[i1] = (x1 * co + x0 * s) as f32;
            }
        }
    }

    /// [`Reference::forward`] as the perplexity method's chunk evaluation: `f(row, logits)` for
    /// every row `≥ first`.
    pub fn score_chunk(
        &self,
        tokens: &[u32],
        first: usize,
        f: &mut super::perplexity::LogitSink<'_>,
    ) -> Result<(), ModelError> {
        for (i, logits) in self.forward(tokens, first)?.iter().enumerate() {
            f(first + i, logits);
        }
        Ok(())
    }

    /// Logits of every position `≥ first` of `tokens` (row i predicts token i + 1).
    pub fn forward(&self, tokens: &[u32], first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &self.config;
        let (h, hd) = (c.hidden, c.head_dim);
        let n = tokens.len();
        let eps = c.rms_eps;
        let mut x: Vec<Vec<f32>> = Vec::with_capacity(n);
        for &t in tokens {
            let t = t as usize;
            if t >= c.vocab {
                return Err(ModelError::Token {
                    token: t as u32,
                    vocab: c.vocab,
                });
            }
            x.push(self.embed[t * h..(t + 1) * h].to_vec());
        }
        let group = c.heads / c.kv_heads;
        for l in &self.layers {
            let xn: Vec<Vec<f32>> = x.iter().map(|r| rmsnorm(r, &l.attn_norm, eps)).collect();
            let mut q = matmul(&xn, &l.wq, c.q_dim(), self.act_q8.qkv, self.act_refine);
            let mut k = matmul(&xn, &l.wk, c.kv_dim(), self.act_q8.qkv, self.act_refine);
            let mut v = matmul(&xn, &l.wv, c.kv_dim(), self.act_q8.qkv, self.act_refine);
            for (p, ((qr, kr), vr)) in q.iter_mut().zip(k.iter_mut()).zip(v.iter_mut()).enumerate()
            {
                for (row, b) in [(&mut *qr, &l.bq), (&mut *kr, &l.bk), (&mut *vr, &l.bv)] {
                    if let Some(b) = b {
                        for (a, &bb) in row.iter_mut().zip(b) {
                            *a += bb;
                        }
                    }
                }
                for (row, nw) in [(&mut *qr, &l.q_norm), (&mut *kr, &l.k_norm)] {
                    if let Some(nw) = nw {
                        for head in row.chunks_exact_mut(hd) {
                            let r = rmsnorm(head, nw, eps);
                            head.copy_from_slice(&r);
                        }
                    }
                }
                self.rope(qr, p);
                self.rope(kr, p);
            }
            let scale = 1.0 / (hd as f64).sqrt();
            let mut att = vec![vec![0f32; c.q_dim()]; n];
            for (p, out) in att.iter_mut().enumerate() {
                for hh in 0..c.heads {
                    let g = hh / group;
                    let qh = &q[p][hh * hd..(hh + 1) * hd];
                    let scores: Vec<f64> = (0..=p)
                        .map(|t| dot64(qh, &k[t][g * hd..(g + 1) * hd]) * scale)
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for d in 0..hd {
                        let acc: f64 = (0..=p).map(|t| e[t] * v[t][g * hd + d] as f64).sum();
                        out[hh * hd + d] = (acc / sum) as f32;
                    }
                }
            }
            let o = matmul(&att, &l.wo, h, self.act_q8.o, self.act_refine);
            for (xr, or) in x.iter_mut().zip(&o) {
                for (a, &b) in xr.iter_mut().zip(or) {
                    *a += b;
                }
            }
            let xn: Vec<Vec<f32>> = x.iter().map(|r| rmsnorm(r, &l.ffn_norm, eps)).collect();
            let gate = matmul(
                &xn,
                &l.w_gate,
                c.intermediate,
                self.act_q8.gate_up,
                self.act_refine,
            );
            let up = matmul(
                &xn,
                &l.w_up,
                c.intermediate,
                self.act_q8.gate_up,
                self.act_refine,
            );
            let act: Vec<Vec<f32>> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| {
                    g.iter()
                        .zip(u)
                        .map(|(&g, &u)| {
                            let g = g as f64;
                            (g / (1.0 + (-g).exp()) * u as f64) as f32
                        })
                        .collect()
                })
                .collect();
            let d = matmul(&act, &l.w_down, h, self.act_q8.down, self.act_refine);
            for (xr, dr) in x.iter_mut().zip(&d) {
                for (a, &b) in xr.iter_mut().zip(dr) {
                    *a += b;
                }
            }
        }
        let xn: Vec<Vec<f32>> = x[first.min(n)..]
            .iter()
            .map(|r| rmsnorm(r, &self.final_norm, eps))
            .collect();
        let head = self.output.as_deref().unwrap_or(&self.embed);
        Ok(matmul(
            &xn,
            head,
            c.vocab,
            self.act_q8.lm_head,
            self.act_refine,
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Hybrid (Qwen3.5-style) reference: Gated DeltaNet + gated attention, written from the equations.
// ---------------------------------------------------------------------------------------------

/// One layer of the hybrid reference, weights decoded to f32 row-major `[out, in]`.
enum HybridRefMixer {
    Attention {
        /// `[heads · 2 · head_dim, hidden]` (per head `[q, gate]`) or `[heads · head_dim, hidden]`.
        wq: Vec<f32>,
        wk: Vec<f32>,
        wv: Vec<f32>,
        wo: Vec<f32>,
        q_norm: Option<Vec<f32>>,
        k_norm: Option<Vec<f32>>,
    },
    Linear {
        w_qkv: Vec<f32>,
        w_z: Vec<f32>,
        w_b: Vec<f32>,
        w_a: Vec<f32>,
        conv: Vec<f32>,
        dt_bias: Vec<f32>,
        a_log: Vec<f32>,
        norm: Vec<f32>,
        w_out: Vec<f32>,
    },
}

struct HybridRefLayer {
    attn_norm: Vec<f32>,
    mixer: HybridRefMixer,
    ffn_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

/// Final recurrent state of one GDN layer after a reference run.
#[derive(Clone, Debug)]
pub struct HybridRefState {
    /// The last K − 1 conv inputs, oldest first (zeros before the sequence start).
    pub conv: Vec<f64>,
    /// `[Hv, d_k, d_v]`.
    pub s: Vec<f64>,
}

/// Slow reference of a hybrid package (decoded from the package's tensors by the weights layer,
/// f64 arithmetic, whole sequence per call, no state carried between calls).
pub struct HybridReference {
    /// The model description.
    pub config: ModelConfig,
    layers: Vec<HybridRefLayer>,
    embed: Vec<f32>,
    final_norm: Vec<f32>,
    lm_head: Vec<f32>,
}

fn mat_vec(w: &[f32], x: &[f64], rows: usize) -> Vec<f64> {
    let cols = x.len();
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(&a, &b)| a as f64 * b)
                .sum()
        })
        .collect()
}

fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

impl HybridReference {
    /// Decode a hybrid package's tensors to f32.
    pub fn load(pkg: &crate::weights::Package) -> Result<Self, ModelError> {
        let c = pkg.config().clone();
        let m = |name: &str, rows: usize, cols: usize| -> Result<Vec<f32>, ModelError> {
            pkg.matrix(name, rows, cols)?
                .decode_f32()
                .map_err(|e| ModelError::Shape {
                    what: format!("{name}: {e}"),
                })
        };
        // Zero-centred checkpoints store w − 1.
        let norm = |name: &str| -> Result<Vec<f32>, ModelError> {
            let off = if c.zero_centered_norms { 1.0 } else { 0.0 };
            Ok(pkg.vector(name)?.into_iter().map(|v| v + off).collect())
        };
        let h = c.hidden;
        let mut layers = Vec::new();
        for i in 0..c.layers {
            let n = |s: &str| format!("model.layers.{i}.{s}");
            let mixer = match c.layer_kind(i) {
                LayerKind::Attention => HybridRefMixer::Attention {
                    wq: m(&n("self_attn.q_proj.weight"), c.q_rows(), h)?,
                    wk: m(&n("self_attn.k_proj.weight"), c.kv_dim(), h)?,
                    wv: m(&n("self_attn.v_proj.weight"), c.kv_dim(), h)?,
                    wo: m(&n("self_attn.o_proj.weight"), h, c.q_dim())?,
                    q_norm: if c.qk_norm {
                        Some(norm(&n("self_attn.q_norm.weight"))?)
                    } else {
                        None
                    },
                    k_norm: if c.qk_norm {
                        Some(norm(&n("self_attn.k_norm.weight"))?)
                    } else {
                        None
                    },
                },
                LayerKind::Linear => {
                    let d = c.linear.as_ref().ok_or_else(|| ModelError::Shape {
                        what: "linear layer without linear_* config".into(),
                    })?;
                    let la = |s: &str| n(&format!("linear_attn.{s}"));
                    HybridRefMixer::Linear {
                        w_qkv: m(&la("in_proj_qkv.weight"), d.conv_dim(), h)?,
                        w_z: m(&la("in_proj_z.weight"), d.value_dim(), h)?,
                        w_b: m(&la("in_proj_b.weight"), d.value_heads, h)?,
                        w_a: m(&la("in_proj_a.weight"), d.value_heads, h)?,
                        conv: pkg.vector(&la("conv1d.weight"))?,
                        dt_bias: pkg.vector(&la("dt_bias"))?,
                        // GGUF-imported packages store llama.cpp's ssm_a = −exp(A_log).
                        a_log: if pkg.has_tensor(&la("ssm_a")) && !pkg.has_tensor(&la("A_log")) {
                            pkg.vector(&la("ssm_a"))?
                                .iter()
                                .map(|&x| ((-(x as f64)).ln()) as f32)
                                .collect()
                        } else {
                            pkg.vector(&la("A_log"))?
                        },
                        norm: pkg.vector(&la("norm.weight"))?,
                        w_out: m(&la("out_proj.weight"), h, d.value_dim())?,
                    }
                }
            };
            layers.push(HybridRefLayer {
                attn_norm: norm(&n("input_layernorm.weight"))?,
                mixer,
                ffn_norm: norm(&n("post_attention_layernorm.weight"))?,
                w_gate: m(&n("mlp.gate_proj.weight"), c.intermediate, h)?,
                w_up: m(&n("mlp.up_proj.weight"), c.intermediate, h)?,
                w_down: m(&n("mlp.down_proj.weight"), h, c.intermediate)?,
            });
        }
        Ok(HybridReference {
            embed: m(pkg.embedding_name(), c.vocab, h)?,
            final_norm: norm("model.norm.weight")?,
            lm_head: m(pkg.lm_head_name(), c.vocab, h)?,
            layers,
            config: c,
        })
    }

    /// Logits of every position of `tokens` (from an empty state) and each GDN layer's final
    /// state (`None` for attention layers).
    // Index loops on purpose: the reference reads like the equations it checks.
    #[allow(clippy::type_complexity, clippy::needless_range_loop)]
    pub fn forward(
        &self,
        tokens: &[u32],
    ) -> Result<(Vec<Vec<f32>>, Vec<Option<HybridRefState>>), ModelError> {
        let c = &self.config;
        let (h, hd, eps) = (c.hidden, c.head_dim, c.rms_eps);
        let t_len = tokens.len();
        let rmsn = |x: &[f64], w: &[f32]| -> Vec<f64> {
            let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            x.iter().zip(w).map(|(v, &g)| v * inv * g as f64).collect()
        };
        let mut xs: Vec<Vec<f64>> = Vec::with_capacity(t_len);
        for &t in tokens {
            let t = t as usize;
            if t >= c.vocab {
                return Err(ModelError::Token {
                    token: t as u32,
                    vocab: c.vocab,
                });
            }
            xs.push(
                self.embed[t * h..(t + 1) * h]
                    .iter()
                    .map(|&v| v as f64)
                    .collect(),
            );
        }
        let mut finals = Vec::new();
        for layer in &self.layers {
            let normed: Vec<Vec<f64>> = xs.iter().map(|x| rmsn(x, &layer.attn_norm)).collect();
            let mixed_out: Vec<Vec<f64>> = match &layer.mixer {
                HybridRefMixer::Attention {
                    wq,
                    wk,
                    wv,
                    wo,
                    q_norm,
                    k_norm,
                } => {
                    finals.push(None);
                    let gated = c.attn_output_gate;
                    let rd = c.rotary_dim;
                    let rope = |v: &mut [f64], pos: usize| {
                        let half = rd / 2;
                        for j in 0..half {
                            let ang = pos as f64 * c.rope_theta.powf(-((2 * j) as f64) / rd as f64);
                            let (x1, x2) = (v[j], v[j + half]);
                            v[j] = x1 * ang.cos() - x2 * ang.sin();
                            v[j + half] = x2 * ang.cos() + x1 * ang.sin();
                        }
                    };
                    let head_norm = |v: &mut [f64], w: &Option<Vec<f32>>| {
                        if let Some(w) = w {
                            let r = rmsn(v, w);
                            v.copy_from_slice(&r);
                        }
                    };
                    let mut qs = Vec::new();
                    let mut gates = Vec::new();
                    let mut ks = Vec::new();
                    let mut vs = Vec::new();
                    for (pos, x) in normed.iter().enumerate() {
                        let qraw = mat_vec(wq, x, c.q_rows());
                        let mut q = vec![0f64; c.q_dim()];
                        let mut g = vec![0f64; c.q_dim()];
                        for hh in 0..c.heads {
                            let per = if gated { 2 * hd } else { hd };
                            q[hh * hd..(hh + 1) * hd]
                                .copy_from_slice(&qraw[hh * per..hh * per + hd]);
                            if gated {
                                g[hh * hd..(hh + 1) * hd]
                                    .copy_from_slice(&qraw[hh * per + hd..(hh + 1) * per]);
                            }
                            head_norm(&mut q[hh * hd..(hh + 1) * hd], q_norm);
                            rope(&mut q[hh * hd..hh * hd + rd], pos);
                        }
                        let mut k = mat_vec(wk, x, c.kv_dim());
                        for hh in 0..c.kv_heads {
                            head_norm(&mut k[hh * hd..(hh + 1) * hd], k_norm);
                            rope(&mut k[hh * hd..hh * hd + rd], pos);
                        }
                        qs.push(q);
                        gates.push(g);
                        ks.push(k);
                        vs.push(mat_vec(wv, x, c.kv_dim()));
                    }
                    let group = c.heads / c.kv_heads;
                    (0..t_len)
                        .map(|t| {
                            let mut att = vec![0f64; c.q_dim()];
                            for hh in 0..c.heads {
                                let kvh = hh / group;
                                let q = &qs[t][hh * hd..(hh + 1) * hd];
                                let scores: Vec<f64> = (0..=t)
                                    .map(|s| {
                                        q.iter()
                                            .zip(&ks[s][kvh * hd..(kvh + 1) * hd])
                                            .map(|(a, b)| a * b)
                                            .sum::<f64>()
                                            / (hd as f64).sqrt()
                                    })
                                    .collect();
                                let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
                                let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                                let z: f64 = e.iter().sum();
                                for (s, p) in e.iter().enumerate() {
                                    for d in 0..hd {
                                        att[hh * hd + d] += p / z * vs[s][kvh * hd + d];
                                    }
                                }
                            }
                            if gated {
                                for (a, &g) in att.iter_mut().zip(&gates[t]) {
                                    *a *= sigmoid64(g);
                                }
                            }
                            mat_vec(wo, &att, h)
                        })
                        .collect()
                }
                HybridRefMixer::Linear {
                    w_qkv,
                    w_z,
                    w_b,
                    w_a,
                    conv,
                    dt_bias,
                    a_log,
                    norm,
                    w_out,
                } => {
                    let d = c.linear.as_ref().ok_or_else(|| ModelError::Shape {
                        what: "linear layer without linear_* config".into(),
                    })?;
                    let (kh, vh, dk, dv, kw) = (
                        d.key_heads,
                        d.value_heads,
                        d.key_head_dim,
                        d.value_head_dim,
                        d.conv_kernel,
                    );
                    let cd = d.conv_dim();
                    let inputs: Vec<Vec<f64>> =
                        normed.iter().map(|x| mat_vec(w_qkv, x, cd)).collect();
                    // S[h] as a d_k × d_v matrix, zero at the start.
                    let mut s = vec![vec![vec![0f64; dv]; dk]; vh];
                    let mut outs = Vec::new();
                    for t in 0..t_len {
                        // Causal conv over inputs t−K+1..=t (zeros before 0), then SiLU.
                        let conv_out: Vec<f64> = (0..cd)
                            .map(|ch| {
                                let mut acc = 0f64;
                                for j in 0..kw {
                                    let src = t as isize - (kw - 1 - j) as isize;
                                    if src >= 0 {
                                        acc += conv[ch * kw + j] as f64 * inputs[src as usize][ch];
                                    }
                                }
                                acc * sigmoid64(acc)
                            })
                            .collect();
                        let kd = kh * dk;
                        let unit = |v: &[f64]| -> Vec<f64> {
                            let n = (v.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt();
                            v.iter().map(|x| x / n).collect()
                        };
                        let z = mat_vec(w_z, &normed[t], d.value_dim());
                        let b = mat_vec(w_b, &normed[t], vh);
                        let a = mat_vec(w_a, &normed[t], vh);
                        let mut y = vec![0f64; d.value_dim()];
                        for hv in 0..vh {
                            let src = hv / (vh / kh);
                            let q: Vec<f64> = unit(&conv_out[src * dk..(src + 1) * dk])
                                .iter()
                                .map(|x| x / (dk as f64).sqrt())
                                .collect();
                            let k = unit(&conv_out[kd + src * dk..kd + (src + 1) * dk]);
                            let v = &conv_out[2 * kd + hv * dv..2 * kd + (hv + 1) * dv];
                            let beta = sigmoid64(b[hv]);
                            let sp = (1.0 + (a[hv] + dt_bias[hv] as f64).exp()).ln();
                            let alpha = (-(a_log[hv] as f64).exp() * sp).exp();
                            // S ← (I − β k kᵀ) α S + β k vᵀ.
                            let sh = &mut s[hv];
                            let decayed: Vec<Vec<f64>> = sh
                                .iter()
                                .map(|row| row.iter().map(|x| alpha * x).collect())
                                .collect();
                            let kt_s: Vec<f64> = (0..dv)
                                .map(|j| (0..dk).map(|i| k[i] * decayed[i][j]).sum())
                                .collect();
                            for i in 0..dk {
                                for j in 0..dv {
                                    sh[i][j] =
                                        decayed[i][j] - beta * k[i] * kt_s[j] + beta * k[i] * v[j];
                                }
                            }
                            let o: Vec<f64> = (0..dv)
                                .map(|j| (0..dk).map(|i| sh[i][j] * q[i]).sum())
                                .collect();
                            let ms = o.iter().map(|x| x * x).sum::<f64>() / dv as f64;
                            let inv = 1.0 / (ms + eps).sqrt();
                            for j in 0..dv {
                                let zz = z[hv * dv + j];
                                y[hv * dv + j] = norm[j] as f64 * o[j] * inv * zz * sigmoid64(zz);
                            }
                        }
                        outs.push(mat_vec(w_out, &y, h));
                    }
                    let mut conv_state = Vec::with_capacity((kw - 1) * cd);
                    for j in 0..kw - 1 {
                        let src = t_len as isize - (kw - 1 - j) as isize;
                        if src >= 0 {
                            conv_state.extend_from_slice(&inputs[src as usize]);
                        } else {
                            conv_state.extend(std::iter::repeat_n(0.0, cd));
                        }
                    }
                    finals.push(Some(HybridRefState {
                        conv: conv_state,
                        s: s.into_iter().flatten().flatten().collect(),
                    }));
                    outs
                }
            };
            for (x, o) in xs.iter_mut().zip(&mixed_out) {
                for (a, b) in x.iter_mut().zip(o) {
                    *a += b;
                }
            }
            for x in xs.iter_mut() {
                let n = rmsn(x, &layer.ffn_norm);
                let g = mat_vec(&layer.w_gate, &n, c.intermediate);
                let u = mat_vec(&layer.w_up, &n, c.intermediate);
                let act: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g * sigmoid64(*g) * u)
                    .collect();
                for (a, b) in x.iter_mut().zip(mat_vec(&layer.w_down, &act, h)) {
                    *a += b;
                }
            }
        }
        let logits = xs
            .iter()
            .map(|x| {
                mat_vec(&self.lm_head, &rmsn(x, &self.final_norm), c.vocab)
                    .into_iter()
                    .map(|v| v as f32)
                    .collect()
            })
            .collect();
        Ok((logits, finals))
    }
}

#[cfg(test)]
mod tests {
    use super::{quantize_q8_row, quantize_q8_row_refined, ActivationRounding};

    #[test]
    fn outlier_groups_keep_their_small_values_when_refined() {
        // Group 0: one outlier of 127 and 0.3s; group 1: values up to 1 (no outlier).
        let mut x = vec![0.3f32; 64];
        x[0] = 127.0;
        for (i, v) in x[32..].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) / 16.0;
        }
        let plain = quantize_q8_row(&x);
        // d = 1: 0.3 rounds to 0 beside the outlier.
        assert_eq!(plain[0], 127.0);
        assert_eq!(plain[1], 0.0);
        // rms = sqrt((127² + 31 · 0.09 + Σ_{i<32} ((i − 16)/16)²) / 64) ≈ 15.9, so 127 > 4 · rms:
        // the residual 0.3 gets its own d = 0.3/127 and comes back exactly (127 · 0.3/127).
        let refined = quantize_q8_row_refined(&x, Some(4.0));
        assert_eq!(refined[0], 127.0);
        assert!((refined[1] - 0.3).abs() < 1e-6, "{}", refined[1]);
        // Group 1's max (1) is under 4 · rms: left as the plain rounding.
        assert_eq!(refined[32..], plain[32..]);
        // Without a ratio, or with one no group exceeds, nothing changes.
        assert_eq!(quantize_q8_row_refined(&x, None), plain);
        assert_eq!(quantize_q8_row_refined(&x, Some(100.0)), plain);
    }

    #[test]
    fn activation_rounding_lists_parse_by_name() {
        let r = ActivationRounding::parse("qkv, gate_up").expect("valid list");
        assert_eq!(
            r,
            ActivationRounding {
                qkv: true,
                gate_up: true,
                ..ActivationRounding::NONE
            }
        );
        assert_eq!(r.names(), "qkv,gate_up");
        for (name, one) in ActivationRounding::NAMES.iter().zip([
            ActivationRounding {
                qkv: true,
                ..ActivationRounding::NONE
            },
            ActivationRounding {
                o: true,
                ..ActivationRounding::NONE
            },
            ActivationRounding {
                gate_up: true,
                ..ActivationRounding::NONE
            },
            ActivationRounding {
                down: true,
                ..ActivationRounding::NONE
            },
            ActivationRounding {
                lm_head: true,
                ..ActivationRounding::NONE
            },
        ]) {
            assert_eq!(ActivationRounding::parse(name), Ok(one), "{name}");
            assert_eq!(one.names(), *name);
        }
        assert_eq!(
            ActivationRounding::parse("all"),
            Ok(ActivationRounding::ALL)
        );
        assert_eq!(
            ActivationRounding::parse("none"),
            Ok(ActivationRounding::NONE)
        );
        assert_eq!(ActivationRounding::NONE.names(), "none");
        assert_eq!(ActivationRounding::ALL.names(), "all");
        let err = ActivationRounding::parse("qkv,ffn").expect_err("unknown name");
        assert!(err.contains("`ffn`") && err.contains("lm_head"), "{err}");
    }
}
