//! The FastFlowLM Qwen3.5 layout: how a FastFlowLM Q4NX package converted from a llama.cpp GGUF
//! (`FLM_Q4NX_Converter` `q4nx/models/qwen35.py`) names and orders its tensors, mapped to the
//! Hugging Face layout the hybrid loader ([`load_hybrid`](super::load_hybrid)) reads.
//!
//! Its names (`linear_attn.qkv_proj`, `self_attn.gate_proj` for z, `ssm_{alpha,beta}_proj`,
//! `ssm_conv1d` `[K, conv_dim]`, `ssm_a` = −exp(A_log), `ssm_dt.bias`, `ssm_norm`,
//! `ssm_out_proj`), its effective (`1 + w`) norms, its planar full-attention `q_proj` and its
//! value-head orders are mapped at load ([`FlmLayout`]; docs/formats.md "Qwen3.5 layouts" gives
//! the sources).

use super::gdn::GdnWeights;
use super::load::{projection, LoadOptions};
use super::load_hybrid::{check_a, PermutedProjection};
use super::ModelError;
use crate::kernels::Executor;
use crate::tiles;
use crate::weights::value_heads::gguf_to_hf;
use crate::weights::{LayerKind, ModelConfig, Package};
use std::sync::Arc;

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
    pub(super) fn attention_q_rows(&self, c: &ModelConfig) -> Vec<usize> {
        let (heads, hd) = (c.heads, c.head_dim);
        (0..2 * heads * hd)
            .map(|i| {
                let (head, half, e) = (i / (2 * hd), (i / hd) % 2, i % hd);
                (half * heads + head) * hd + e
            })
            .collect()
    }

    /// One linear-attention layer's weights, read from FLM names and mapped to HF order.
    pub(super) fn gdn(
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
