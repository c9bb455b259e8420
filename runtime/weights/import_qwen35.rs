//! The import plan of a Qwen3.5 hybrid GGUF (llama.cpp architecture `qwen35`): Gated DeltaNet
//! layers and gated full-attention layers, written into the Hugging Face layout that
//! `model::load_hybrid` reads (the names `xdna pack synth --arch qwen3_5` writes).
//!
//! What llama.cpp's converter (`conversion/qwen.py`: `Qwen3NextModel.modify_tensors`,
//! `_LinearAttentionVReorderBase`, `Qwen3_5TextModel`) did to the Hugging Face checkpoint, and how
//! the import undoes it (docs/formats.md, "Qwen3.5 layouts"):
//! - value heads reordered from grouped (`k·r + j`) to tiled (`j·Hk + k`) order when key heads ≠
//!   value heads: the v rows of `attn_qkv`, `attn_gate` rows and the v channels of `ssm_conv1d`
//!   (unit d_v), `ssm_beta` / `ssm_alpha` rows, `ssm_a`, `ssm_dt.bias` (unit 1), `ssm_out`
//!   columns (unit d_v). Rows are gathered back; `ssm_out` columns move as whole 32-column
//!   blocks when d_v is a multiple of 32 (exact for Q8_0 / Q4_1), otherwise the matrix is
//!   dequantized (exactly) to plain f32 and permuted per column;
//! - `A_log` stored as `ssm_a` = −exp(A_log): kept as it is, under `linear_attn.ssm_a` (the
//!   loader uses −exp(A_log) directly, so nothing is rounded twice);
//! - every RMSNorm weight except the GDN gated norm stored as the effective `1 + w`: kept, and
//!   `config.json` says so (`xdna.norms_include_one`, the loader then adds nothing);
//! - `conv1d` squeezed to `[conv_dim, K]`: written back as `[conv_dim, 1, K]`;
//! - `dt_bias` renamed `ssm_dt.bias`; full-attention q rows stay per head `[q, gate]` (no rotary
//!   interleave: Qwen uses NEOX-style rotation, llama.cpp's `IMROPE` reduces to it for text).
//!
//! Matrices of type Q8_0 / Q4_1 become tiles (exact) when their rows are a multiple of 32;
//! F32 / F16 / BF16 tensors, and quantized ones tiles cannot hold, become plain f32. MTP blocks
//! (`nextn_predict_layers`) are not read; mixture-of-experts (`qwen35moe`) is not supported.

use super::config::{LayerKind, LinearAttnConfig, ModelConfig};
use super::gguf::{GgmlType, GgufFile};
use super::import::{Part, Planned};
use super::value_heads;
use super::WeightsError;
use crate::tiles::{self, ScaleType, TileOrder, WeightFormat};

/// llama.cpp's `general.architecture` of dense Qwen3.5 (`MODEL_ARCH.QWEN35`).
pub const ARCH: &str = "qwen35";

/// GGUF index of Hugging Face index `idx` on a value-head axis of `unit`-wide heads
/// (llama.cpp `_reorder_v_heads`, [`value_heads`](super::value_heads)).
fn v_src(d: &LinearAttnConfig, idx: usize, unit: usize) -> usize {
    value_heads::hf_to_gguf(idx, d.key_heads, d.value_heads, unit)
}

/// GGUF row of each Hugging Face row of `in_proj_qkv` (= conv channel): q, k as they are.
fn qkv_rows(d: &LinearAttnConfig) -> Vec<usize> {
    let qk = 2 * d.key_dim();
    (0..d.conv_dim())
        .map(|r| {
            if r < qk {
                r
            } else {
                qk + v_src(d, r - qk, d.value_head_dim)
            }
        })
        .collect()
}

fn value_map(d: &LinearAttnConfig, unit: usize, len: usize) -> Vec<usize> {
    (0..len).map(|i| v_src(d, i, unit)).collect()
}

/// `Some(map)` unless it is the identity.
fn non_identity(map: Vec<usize>) -> Option<Vec<usize>> {
    if map.iter().enumerate().all(|(i, &s)| i == s) {
        None
    } else {
        Some(map)
    }
}

/// Builds the plan's entries, checking each GGUF tensor's shape and type.
struct Planner<'a> {
    f: &'a GgufFile,
    scale: ScaleType,
}

impl Planner<'_> {
    fn err(&self, tensor: &str, what: String) -> WeightsError {
        WeightsError::tensor(self.f.path(), tensor, what)
    }

    /// The output matrix `out` `[rows, cols]` from GGUF `tensor` (ggml `[cols, rows]`), output
    /// row r = GGUF row `row_src[r]`, output column c = GGUF column `col_src[c]`.
    fn matrix(
        &self,
        out: &str,
        tensor: &str,
        rows: usize,
        cols: usize,
        row_src: Option<Vec<usize>>,
        col_src: Option<Vec<usize>>,
    ) -> Result<Planned, WeightsError> {
        let t = self.f.require_tensor(tensor)?;
        let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        if shape != [cols, rows] {
            return Err(self.err(
                tensor,
                format!("shape (ggml ne) {shape:?}, expected [{cols}, {rows}] for {out}"),
            ));
        }
        let format = match t.ggml_type {
            GgmlType::Q4_1 => Some(WeightFormat::Q41 {
                scale: self.scale,
                order: TileOrder::ColumnMajor,
            }),
            GgmlType::Q8_0 => Some(WeightFormat::Q8 {
                scale: self.scale,
                order: TileOrder::ColumnMajor,
            }),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => None,
            other => {
                return Err(self.err(
                    tensor,
                    format!(
                        "ggml type {} is not supported (F32, F16, BF16, Q8_0, Q4_1 are)",
                        other.name()
                    ),
                ))
            }
        };
        // Whole 32-column blocks only: entry b is the GGUF block of output block b.
        let col_blocks = match &col_src {
            None => Some(None),
            Some(m) => {
                let blocks: Option<Vec<usize>> = (0..cols / 32)
                    .map(|b| {
                        let s = m[b * 32];
                        (s % 32 == 0 && (0..32).all(|e| m[b * 32 + e] == s + e)).then_some(s / 32)
                    })
                    .collect();
                blocks.map(Some)
            }
        };
        match (format, col_blocks) {
            (Some(format), Some(col_blocks)) if rows.is_multiple_of(tiles::TILE_ROWS) => {
                Ok(Planned::Matrix {
                    name: out.to_string(),
                    format,
                    parts: vec![Part {
                        tensor: tensor.to_string(),
                        unpermute_heads: None,
                        rows,
                        row_src,
                    }],
                    rows,
                    cols,
                    col_blocks,
                })
            }
            _ => Ok(Planned::Plain {
                name: out.to_string(),
                tensor: tensor.to_string(),
                shape: vec![rows, cols],
                rows,
                cols,
                row_src,
                col_src,
            }),
        }
    }

    /// A float GGUF tensor of `len` values; `map` (output index → GGUF index) permutes it.
    fn vector(
        &self,
        out: &str,
        tensor: &str,
        len: usize,
        map: Option<Vec<usize>>,
    ) -> Result<Planned, WeightsError> {
        let t = self.f.require_tensor(tensor)?;
        if !matches!(t.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Err(self.err(
                tensor,
                format!(
                    "type {} (expected a float type: F32, F16, BF16)",
                    t.ggml_type.name()
                ),
            ));
        }
        if t.elements() != len || t.rows() != 1 {
            return Err(self.err(
                tensor,
                format!("shape (ggml ne) {:?}, expected [{len}] for {out}", t.shape),
            ));
        }
        Ok(match map {
            None => Planned::Vector {
                name: out.to_string(),
                tensor: tensor.to_string(),
                len,
            },
            Some(m) => Planned::Plain {
                name: out.to_string(),
                tensor: tensor.to_string(),
                shape: vec![len],
                rows: 1,
                cols: len,
                row_src: None,
                col_src: Some(m),
            },
        })
    }
}

/// The output tensors of a `qwen35` GGUF: Hugging Face names and order (see the module docs).
pub fn plan(f: &GgufFile, scale: ScaleType) -> Result<(ModelConfig, Vec<Planned>), WeightsError> {
    let p = ModelConfig::from_gguf(f)?;
    let d = p.linear.clone().ok_or_else(|| {
        WeightsError::invalid(
            f.path(),
            "a qwen35 description without Gated DeltaNet dimensions",
        )
    })?;
    let pl = Planner { f, scale };
    let (h, ffn) = (p.hidden, p.intermediate);
    let (cd, vd, hv, dv, kk) = (
        d.conv_dim(),
        d.value_dim(),
        d.value_heads,
        d.value_head_dim,
        d.conv_kernel,
    );
    let qkv_rows = non_identity(qkv_rows(&d));
    let channel_map = non_identity(value_map(&d, dv, vd));
    let head_map = non_identity(value_map(&d, 1, hv));
    let mut v = Vec::new();
    v.push(pl.vector("model.norm.weight", "output_norm.weight", h, None)?);
    v.push(pl.matrix(
        "model.embed_tokens.weight",
        "token_embd.weight",
        p.vocab,
        h,
        None,
        None,
    )?);
    if !p.tie_word_embeddings {
        v.push(pl.matrix("lm_head.weight", "output.weight", p.vocab, h, None, None)?);
    }
    for i in 0..p.layers {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        let b = |s: &str| format!("blk.{i}.{s}");
        v.push(pl.vector(
            &n("input_layernorm.weight"),
            &b("attn_norm.weight"),
            h,
            None,
        )?);
        v.push(pl.vector(
            &n("post_attention_layernorm.weight"),
            &b("post_attention_norm.weight"),
            h,
            None,
        )?);
        if p.layer_kind(i) == LayerKind::Linear {
            let la = |s: &str| n(&format!("linear_attn.{s}"));
            v.push(pl.matrix(
                &la("in_proj_qkv.weight"),
                &b("attn_qkv.weight"),
                cd,
                h,
                qkv_rows.clone(),
                None,
            )?);
            v.push(pl.matrix(
                &la("in_proj_z.weight"),
                &b("attn_gate.weight"),
                vd,
                h,
                channel_map.clone(),
                None,
            )?);
            v.push(pl.matrix(
                &la("in_proj_b.weight"),
                &b("ssm_beta.weight"),
                hv,
                h,
                head_map.clone(),
                None,
            )?);
            v.push(pl.matrix(
                &la("in_proj_a.weight"),
                &b("ssm_alpha.weight"),
                hv,
                h,
                head_map.clone(),
                None,
            )?);
            // ggml [K, conv_dim]: rows are channels, as HF's [conv_dim, 1, K].
            let conv = b("ssm_conv1d.weight");
            let t = f.require_tensor(&conv)?;
            if !matches!(t.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
                || t.shape != [kk as u64, cd as u64]
            {
                return Err(pl.err(
                    &conv,
                    format!(
                        "{} {:?}, expected a float tensor of shape (ggml ne) [{kk}, {cd}]",
                        t.ggml_type.name(),
                        t.shape
                    ),
                ));
            }
            v.push(Planned::Plain {
                name: la("conv1d.weight"),
                tensor: conv,
                shape: vec![cd, 1, kk],
                rows: cd,
                cols: kk,
                row_src: qkv_rows.clone(),
                col_src: None,
            });
            v.push(pl.vector(&la("dt_bias"), &b("ssm_dt.bias"), hv, head_map.clone())?);
            v.push(pl.vector(&la("ssm_a"), &b("ssm_a"), hv, head_map.clone())?);
            v.push(pl.vector(&la("norm.weight"), &b("ssm_norm.weight"), dv, None)?);
            v.push(pl.matrix(
                &la("out_proj.weight"),
                &b("ssm_out.weight"),
                h,
                vd,
                None,
                channel_map.clone(),
            )?);
        } else {
            let (qd, kvd) = (p.heads * p.head_dim, p.kv_heads * p.head_dim);
            let sa = |s: &str| n(&format!("self_attn.{s}"));
            v.push(pl.matrix(
                &sa("q_proj.weight"),
                &b("attn_q.weight"),
                2 * qd,
                h,
                None,
                None,
            )?);
            v.push(pl.matrix(
                &sa("k_proj.weight"),
                &b("attn_k.weight"),
                kvd,
                h,
                None,
                None,
            )?);
            v.push(pl.matrix(
                &sa("v_proj.weight"),
                &b("attn_v.weight"),
                kvd,
                h,
                None,
                None,
            )?);
            v.push(pl.matrix(
                &sa("o_proj.weight"),
                &b("attn_output.weight"),
                h,
                qd,
                None,
                None,
            )?);
            v.push(pl.vector(
                &sa("q_norm.weight"),
                &b("attn_q_norm.weight"),
                p.head_dim,
                None,
            )?);
            v.push(pl.vector(
                &sa("k_norm.weight"),
                &b("attn_k_norm.weight"),
                p.head_dim,
                None,
            )?);
        }
        v.push(pl.matrix(
            &n("mlp.gate_proj.weight"),
            &b("ffn_gate.weight"),
            ffn,
            h,
            None,
            None,
        )?);
        v.push(pl.matrix(
            &n("mlp.up_proj.weight"),
            &b("ffn_up.weight"),
            ffn,
            h,
            None,
            None,
        )?);
        v.push(pl.matrix(
            &n("mlp.down_proj.weight"),
            &b("ffn_down.weight"),
            h,
            ffn,
            None,
            None,
        )?);
    }
    Ok((p, v))
}
