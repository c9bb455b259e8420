//! The reference forward: the test oracle of the fast path.
//!
//! Weights are decoded to f32 straight from the GGUF file by the slow block decoders of
//! [`super::gguf_lite`] (no tiles, no kernels layer, no rotary un-interleave); every dot product
//! accumulates in f64; attention is a plain causal softmax over the whole sequence. Llama GGUFs keep
//! Q/K rows in llama.cpp's rotary interleave, so RoPE here rotates adjacent pairs `(2j, 2j+1)`
//! (the fast path rotates `(j, j + d/2)` on un-interleaved rows); Qwen GGUFs are not permuted and
//! use the half-split ("NeoX") rotation.

use super::config::ModelConfig;
use super::gguf_config;
use super::gguf_lite::GgufLite;
use super::ModelError;
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
    pub config: ModelConfig,
    gguf: GgufLite,
    layers: Vec<RefLayer>,
    final_norm: Vec<f32>,
    /// `None` when tied to the embedding.
    output: Option<Vec<f32>>,
    embed: Vec<f32>,
    interleaved_rope: bool,
    act_q8: bool,
}

/// ggml `q8_1`-style activation rounding of one row, written independently of the kernels layer:
/// per 32 values `d = max|x| / 127`, `x̂ = d · round_half_even(x / d)`.
pub fn quantize_q8_row(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for g in x.chunks(32) {
        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend(
            g.iter()
                .map(|&v| (v * inv).round_ties_even().clamp(-127.0, 127.0) * d),
        );
    }
    out
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// `y[t][r] = Σ_k x̂[t][k] w[r][k]` with f64 accumulation; `x̂ = x`, or q8-rounded when `q8`.
fn matmul(x: &[Vec<f32>], w: &[f32], rows: usize, q8: bool) -> Vec<Vec<f32>> {
    let k = x.first().map_or(0, |v| v.len());
    let xq: Vec<Vec<f32>>;
    let x = if q8 {
        xq = x.iter().map(|r| quantize_q8_row(r)).collect();
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
        let config = gguf_config::config(&g)?;
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
            act_q8: false,
            layers,
            config,
            gguf: g,
        })
    }

    /// Round every projection's input activations to q8 per 32 values (as ggml's q8_1 and the
    /// kernels layer's quantized paths do), isolating the fast path's remaining differences.
    pub fn with_activation_q8(mut self, on: bool) -> Self {
        self.act_q8 = on;
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
            let mut q = matmul(&xn, &l.wq, c.q_dim(), self.act_q8);
            let mut k = matmul(&xn, &l.wk, c.kv_dim(), self.act_q8);
            let mut v = matmul(&xn, &l.wv, c.kv_dim(), self.act_q8);
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
            let o = matmul(&att, &l.wo, h, self.act_q8);
            for (xr, or) in x.iter_mut().zip(&o) {
                for (a, &b) in xr.iter_mut().zip(or) {
                    *a += b;
                }
            }
            let xn: Vec<Vec<f32>> = x.iter().map(|r| rmsnorm(r, &l.ffn_norm, eps)).collect();
            let gate = matmul(&xn, &l.w_gate, c.intermediate, self.act_q8);
            let up = matmul(&xn, &l.w_up, c.intermediate, self.act_q8);
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
            let d = matmul(&act, &l.w_down, h, self.act_q8);
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
        Ok(matmul(&xn, head, c.vocab, self.act_q8))
    }
}
