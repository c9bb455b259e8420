//! TEMPORARY loader: fast-path weights straight from GGUF blocks, with a simple block GEMM.
//!
//! Used until the `weights` package reader and the `kernels` GEMM land; then the loader in
//! `load.rs` (Package + kernels) replaces it. It fuses q‖k‖v (undoing llama.cpp's rotary row
//! interleave, so the fast path's half-split RoPE applies) and gate‖up like the package import does.

use super::forward::{Embedding, Family, LayerWeights, ModelWeights, Projection};
use super::gguf_config;
use super::gguf_lite::{decode_blocks, GgufLite};
use super::ModelError;
use std::path::Path;

/// A `[rows, cols]` matrix of GGML blocks (F32, F16, Q4_0, Q4_1, Q8_0), row-major.
pub struct BlockMatrix {
    ggml_type: u32,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
}

impl BlockMatrix {
    fn from_rows(g: &GgufLite, parts: &[(&str, Option<usize>)]) -> Result<Self, ModelError> {
        // parts: tensor names, each with an optional head count to un-interleave rotary rows.
        let mut data = Vec::new();
        let mut rows = 0;
        let mut t0 = None;
        let mut cols0 = 0;
        for &(name, heads) in parts {
            let i = g.info(name)?;
            let raw = g.raw(name)?;
            let (r, c) = (i.rows(), i.cols());
            if let Some(t) = t0 {
                if t != i.ggml_type || c != cols0 {
                    return Err(ModelError::Shape {
                        what: format!("cannot fuse {name}: type/cols differ from {}", parts[0].0),
                    });
                }
            }
            t0 = Some(i.ggml_type);
            cols0 = c;
            let rb = raw.len() / r.max(1);
            match heads {
                None => data.extend_from_slice(raw),
                Some(nh) => {
                    let hd = r / nh;
                    let half = hd / 2;
                    for h in 0..nh {
                        for j in 0..hd {
                            // HF row j = s*half + i  ↔  GGUF row 2i + s
                            let (s, ii) = (j / half, j % half);
                            let src = h * hd + 2 * ii + s;
                            data.extend_from_slice(&raw[src * rb..(src + 1) * rb]);
                        }
                    }
                }
            }
            rows += r;
        }
        let ggml_type = t0.unwrap_or(0);
        Ok(BlockMatrix {
            ggml_type,
            rows,
            cols: cols0,
            row_bytes: data.len() / rows.max(1),
            data,
        })
    }

    fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
}

fn h16(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

impl Projection for BlockMatrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn weight_bytes(&self) -> usize {
        self.data.len()
    }
    fn gemm(&self, x: &[f32], m: usize, y: &mut [f32], _family: Family) -> Result<(), ModelError> {
        let (n, k) = (self.rows, self.cols);
        let mut tmp = [0f32; 32];
        for r in 0..n {
            let w = self.row(r);
            for t in 0..m {
                let xt = &x[t * k..(t + 1) * k];
                let acc = match self.ggml_type {
                    3 => {
                        let mut acc = 0f32;
                        for (b, xb) in xt.chunks_exact(32).enumerate() {
                            let at = b * 20;
                            let (d, mn) = (h16(w, at), h16(w, at + 2));
                            let mut s = 0f32;
                            let mut sx = 0f32;
                            for j in 0..16 {
                                let q = w[at + 4 + j];
                                s += (q & 15) as f32 * xb[j] + (q >> 4) as f32 * xb[j + 16];
                                sx += xb[j] + xb[j + 16];
                            }
                            acc += d * s + mn * sx;
                        }
                        acc
                    }
                    8 => {
                        let mut acc = 0f32;
                        for (b, xb) in xt.chunks_exact(32).enumerate() {
                            let at = b * 34;
                            let d = h16(w, at);
                            let mut s = 0f32;
                            for j in 0..32 {
                                s += w[at + 2 + j] as i8 as f32 * xb[j];
                            }
                            acc += d * s;
                        }
                        acc
                    }
                    t => {
                        let mut acc = 0f32;
                        let bb = w.len() / (k / 32).max(1);
                        for (b, xb) in xt.chunks_exact(32).enumerate() {
                            decode_blocks(t, &w[b * bb..(b + 1) * bb], &mut tmp);
                            acc += super::ops::dot(&tmp, xb);
                        }
                        acc
                    }
                };
                y[t * n + r] = acc;
            }
        }
        Ok(())
    }
}

struct BlockEmbedding(BlockMatrix);

impl Embedding for BlockEmbedding {
    fn row(&self, token: u32, out: &mut [f32]) -> Result<(), ModelError> {
        let t = token as usize;
        if t >= self.0.rows {
            return Err(ModelError::Token {
                token,
                vocab: self.0.rows,
            });
        }
        decode_blocks(self.0.ggml_type, self.0.row(t), out);
        Ok(())
    }
}

/// Load a llama-family GGUF into fast-path weights (temporary host path).
pub fn load(path: &Path) -> Result<ModelWeights, ModelError> {
    let g = GgufLite::open(path)?;
    let config = gguf_config::config(&g)?;
    let llama = g.meta_str("general.architecture").unwrap_or("llama") == "llama";
    let (qh, kh) = if llama {
        (Some(config.heads), Some(config.kv_heads))
    } else {
        (None, None)
    };
    let opt = |name: String| -> Result<Option<Vec<f32>>, ModelError> {
        if g.tensors.contains_key(&name) {
            g.decode_f32(&name).map(Some)
        } else {
            Ok(None)
        }
    };
    let mut layers = Vec::with_capacity(config.layers);
    for i in 0..config.layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        let (q, k, v) = (n("attn_q.weight"), n("attn_k.weight"), n("attn_v.weight"));
        let qkv = BlockMatrix::from_rows(&g, &[(&q, qh), (&k, kh), (&v, None)])?;
        let (gt, up) = (n("ffn_gate.weight"), n("ffn_up.weight"));
        let gate_up = BlockMatrix::from_rows(&g, &[(&gt, None), (&up, None)])?;
        let o = BlockMatrix::from_rows(&g, &[(&n("attn_output.weight"), None)])?;
        let down = BlockMatrix::from_rows(&g, &[(&n("ffn_down.weight"), None)])?;
        let qkv_bias = match (opt(n("attn_q.bias"))?, opt(n("attn_k.bias"))?, opt(n("attn_v.bias"))?) {
            (Some(a), Some(b), Some(c)) => Some([a, b, c].concat()),
            _ => None,
        };
        layers.push(LayerWeights {
            attn_norm: g.decode_f32(&n("attn_norm.weight"))?,
            qkv: Box::new(qkv),
            qkv_bias,
            q_norm: opt(n("attn_q_norm.weight"))?,
            k_norm: opt(n("attn_k_norm.weight"))?,
            o: Box::new(o),
            o_bias: opt(n("attn_output.bias"))?,
            ffn_norm: g.decode_f32(&n("ffn_norm.weight"))?,
            gate_up: Box::new(gate_up),
            down: Box::new(down),
        });
    }
    let embed = BlockMatrix::from_rows(&g, &[("token_embd.weight", None)])?;
    let lm_head = if g.tensors.contains_key("output.weight") {
        BlockMatrix::from_rows(&g, &[("output.weight", None)])?
    } else {
        BlockMatrix::from_rows(&g, &[("token_embd.weight", None)])?
    };
    Ok(ModelWeights {
        final_norm: g.decode_f32("output_norm.weight")?,
        layers,
        embed: Box::new(BlockEmbedding(embed)),
        lm_head: Box::new(lm_head),
        backend: "host-gguf (temporary scalar)".into(),
        config,
    })
}
