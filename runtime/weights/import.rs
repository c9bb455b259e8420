//! `xdna pack import`: GGUF (llama, qwen2 and qwen3 architectures, or Qwen3.5 `qwen35` hybrids
//! through [`super::import_qwen35`]) → package directory.
//!
//! Output (`docs/formats.md` has the details):
//! - `model.q4nx`: safetensors; F32 norms first, then `I8` tile grids `[n_tiles, chunk]`:
//!   - `model.layers.{i}.self_attn.qkv_proj.weight`: rows of q, then k, then v (q4_1 tiles);
//!   - `model.layers.{i}.self_attn.o_proj.weight`, `…mlp.down_proj.weight` (q4_1 tiles);
//!   - `model.layers.{i}.mlp.gate_up_proj.weight`: rows of gate, then up (q4_1 tiles);
//!   - `model.embed_tokens.weight` (Q8 tiles from GGUF Q8_0, or q4_1 from Q4_1) — also the
//!     lm_head when tied; `lm_head.weight` when the GGUF has `output.weight`;
//!   - tiles are plain column-major ("1.0.3") with f16 scales by default (bit-exact to GGUF);
//!     Llama's Q/K rotary row interleave is undone (per head, rows `(p, 2)` → `(2, p)`);
//!     K is zero-padded to a multiple of 256.
//! - `config.json`, `tokenizer.json`, `tokenizer_config.json` (HF formats).
//!
//! Memory stays bounded: one row block of one matrix (plus the mmapped GGUF) at a time.

use super::config::ModelConfig;
use super::gguf::{GgmlType, GgufFile, GgufTensor};
use super::safetensors::{Declared, Dtype, Writer};
use super::tokenizer::{
    PreTokenizer, Tokenizer, DEFAULT_NUMBER_PATTERN, DEFAULT_PUNCT_PATTERN, DEFAULT_TRIPLE_PATTERN,
};
use super::WeightsError;
use crate::tiles::{self, ScaleType, TileOrder, WeightFormat};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Import options.
#[derive(Clone, Copy, Debug)]
pub struct ImportOptions {
    /// Scale type of the q4_1/Q8 tiles (f16 is exact; bf16 is what FastFlowLM writes).
    pub scale: ScaleType,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            scale: ScaleType::F16,
            progress: true,
        }
    }
}

/// One GGUF tensor contributing rows to an output matrix.
#[derive(Clone, Debug)]
pub struct Part {
    /// The GGUF tensor's name.
    pub tensor: String,
    /// Undo llama's rotary interleave with this many heads (q: heads, k: kv heads).
    pub unpermute_heads: Option<usize>,
    /// Rows this part contributes (the GGUF tensor's row count).
    pub rows: usize,
    /// Any other row map: entry r is the GGUF row of output row r (Qwen3.5 value-head order).
    pub row_src: Option<Vec<usize>>,
}

impl Part {
    /// The GGUF row holding output row `r` of this part.
    pub fn gguf_row(&self, r: usize) -> usize {
        match &self.row_src {
            Some(m) => m.get(r).copied().unwrap_or(r),
            None => gguf_row_for_hf_row(r, self.rows, self.unpermute_heads),
        }
    }
}

/// One output tensor.
#[derive(Clone, Debug)]
pub enum Planned {
    /// A tiled matrix built from row-concatenated parts.
    Matrix {
        /// The package tensor's name.
        name: String,
        /// The tile format it is written in.
        format: WeightFormat,
        /// The GGUF tensors whose rows it concatenates, in order.
        parts: Vec<Part>,
        /// Logical rows (output features): the parts' rows summed.
        rows: usize,
        /// Logical columns (input features).
        cols: usize,
        /// Column blocks of 32 moved whole (exact for Q8_0 / Q4_1): entry b is the GGUF block of
        /// output block b.
        col_blocks: Option<Vec<usize>>,
    },
    /// A plain f32 vector copied (decoded) from one GGUF tensor.
    Vector {
        /// The package tensor's name.
        name: String,
        /// The GGUF tensor's name.
        tensor: String,
        /// Elements.
        len: usize,
    },
    /// A plain f32 tensor decoded row by row from one GGUF tensor `[rows, cols]`, rows and columns
    /// gathered through the maps (entry i: the GGUF index of output index i), declared `shape`.
    Plain {
        /// The package tensor's name.
        name: String,
        /// The GGUF tensor's name.
        tensor: String,
        /// The shape declared in the package (`rows × cols` elements in all).
        shape: Vec<usize>,
        /// Rows written.
        rows: usize,
        /// Columns written.
        cols: usize,
        /// Row map (entry i: the GGUF row of output row i); `None` keeps the order.
        row_src: Option<Vec<usize>>,
        /// Column map (entry j: the GGUF column of output column j); `None` keeps the order.
        col_src: Option<Vec<usize>>,
    },
}

impl Planned {
    /// The package tensor's name.
    pub fn name(&self) -> &str {
        match self {
            Planned::Matrix { name, .. }
            | Planned::Vector { name, .. }
            | Planned::Plain { name, .. } => name,
        }
    }
}

/// The package format a GGUF weight matrix is stored in: q4_1 / Q8 tiles for Q4_1 / Q8_0 (an
/// exact re-layout, with `scale` as the tile scale type), the tensor's own rows for the other ggml
/// block types and the float types; any other type is refused naming the tensor and its type.
pub fn weight_format(
    f: &GgufFile,
    t: &GgufTensor<'_>,
    scale: ScaleType,
) -> Result<WeightFormat, WeightsError> {
    match t.ggml_type {
        GgmlType::Q4_1 => Ok(WeightFormat::Q41 {
            scale,
            order: TileOrder::ColumnMajor,
        }),
        // A q4_0 block is a q4_1 group with min −8·d, exact in f16 (a power-of-two multiple;
        // `build_row_block` checks it), so with f16 tile scales it is stored and run as q4_1.
        GgmlType::Q4_0 if scale == ScaleType::F16 => Ok(WeightFormat::Q41 {
            scale,
            order: TileOrder::ColumnMajor,
        }),
        GgmlType::Q8_0 => Ok(WeightFormat::Q8 {
            scale,
            order: TileOrder::ColumnMajor,
        }),
        GgmlType::F32 => Ok(WeightFormat::F32),
        GgmlType::F16 => Ok(WeightFormat::F16),
        GgmlType::BF16 => Ok(WeightFormat::Bf16),
        ty if ty.is_block_quant() => Ok(WeightFormat::Ggml(ty)),
        other => Err(WeightsError::tensor(
            f.path(),
            t.name,
            format!(
                "ggml type {} cannot be imported (readable: f32, f16, bf16, {})",
                other.name(),
                GgmlType::BLOCK_QUANTS.map(GgmlType::name).join(", ")
            ),
        )),
    }
}

/// The attention-only architectures [`plan`] reads: llama (rotary rows interleaved by the
/// converter), qwen2 (q/k/v bias) and qwen3 (q/k RMS norm).
pub const ATTENTION_ONLY_ARCHS: [&str; 3] = ["llama", "qwen2", "qwen3"];

/// The error for a GGUF architecture the import does not read.
pub(super) fn unsupported_architecture(f: &GgufFile, arch: &str) -> WeightsError {
    let why = match arch {
        "qwen35moe" | "qwen3next" => {
            " (a mixture-of-experts hybrid: experts are not supported; dense \"qwen35\" is)"
        }
        _ => "",
    };
    WeightsError::invalid(
        f.path(),
        format!(
            "general.architecture = {arch:?}{why}: only {} and \"qwen35\" can be imported",
            ATTENTION_ONLY_ARCHS.map(|a| format!("{a:?}")).join(", ")
        ),
    )
}

/// The plan of any supported GGUF (`qwen35` hybrids, else llama) and the model description it
/// was planned from.
pub fn plan_any(
    f: &GgufFile,
    scale: ScaleType,
) -> Result<(ModelConfig, Vec<Planned>), WeightsError> {
    match f.architecture() {
        Some(super::import_qwen35::ARCH) => super::import_qwen35::plan(f, scale),
        Some(super::config::DFLASH_ARCH) => plan_dflash(f, scale),
        _ => plan(f, scale),
    }
}

/// The package tensors of a DFlash draft (llama.cpp's `dflash` GGUF), unfused, in Hugging Face
/// names: per layer the norms and the q/k/v/o and gate/up/down projections, then the fusion
/// matrix `model.fc.weight` `[hidden, taps · target hidden]`, its `model.hidden_norm.weight`
/// and the final `model.norm.weight`. The target's embedding table and head are not in a draft.
pub fn plan_dflash(
    f: &GgufFile,
    scale: ScaleType,
) -> Result<(ModelConfig, Vec<Planned>), WeightsError> {
    let p = ModelConfig::from_gguf(f)?;
    let vector = |out: String, src: String, len: usize| -> Result<Planned, WeightsError> {
        let t = f.require_tensor(&src)?;
        if !matches!(t.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
            || t.elements() != len
        {
            return Err(WeightsError::tensor(
                f.path(),
                &src,
                format!(
                    "expected {len} float values, got {} of type {}",
                    t.elements(),
                    t.ggml_type.name()
                ),
            ));
        }
        Ok(Planned::Vector {
            name: out,
            tensor: src,
            len,
        })
    };
    let matrix = |out: String, src: String, rows: usize, cols: usize| {
        let t = f.require_tensor(&src)?;
        if t.shape.len() != 2 || t.shape[0] as usize != cols || t.shape[1] as usize != rows {
            return Err(WeightsError::tensor(
                f.path(),
                &src,
                format!(
                    "expected [{rows}, {cols}] (rows, columns), GGUF shape {:?}",
                    t.shape
                ),
            ));
        }
        let format = weight_format(f, &t, scale)?;
        if format.tile_bytes().is_some() && !rows.is_multiple_of(tiles::TILE_ROWS) {
            return Err(WeightsError::tensor(
                f.path(),
                &src,
                format!("{rows} rows is not a multiple of {}", tiles::TILE_ROWS),
            ));
        }
        Ok(Planned::Matrix {
            name: out,
            format,
            parts: vec![Part {
                tensor: src,
                unpermute_heads: None,
                rows,
                row_src: None,
            }],
            rows,
            cols,
            col_blocks: None,
        })
    };
    // A plain f32 tensor of `shape` (outermost first), read whole from a float GGUF tensor.
    let plain = |out: String, src: String, shape: Vec<usize>| -> Result<Planned, WeightsError> {
        let t = f.require_tensor(&src)?;
        let len: usize = shape.iter().product();
        let ggml: Vec<usize> = shape.iter().rev().copied().collect();
        let dims: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        if !matches!(t.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) || dims != ggml {
            return Err(WeightsError::tensor(
                f.path(),
                &src,
                format!(
                    "expected a float tensor of GGUF shape {ggml:?}, got {} {dims:?}",
                    t.ggml_type.name()
                ),
            ));
        }
        let cols = shape.last().copied().unwrap_or(1);
        Ok(Planned::Plain {
            name: out,
            tensor: src,
            rows: len / cols.max(1),
            cols,
            shape,
            row_src: None,
            col_src: None,
        })
    };
    let taps = p.dflash.as_ref().map_or(0, |d| d.target_layers.len());
    let generation2 = p.dflash.as_ref().and_then(|d| d.generation2);
    let (hidden, hd) = (p.hidden, p.head_dim);
    let mut v = Vec::new();
    for i in 0..p.layers {
        let attn = |s: &str| format!("model.layers.{i}.self_attn.{s}.weight");
        let blk = |s: &str| format!("blk.{i}.{s}.weight");
        v.push(vector(
            format!("model.layers.{i}.input_layernorm.weight"),
            blk("attn_norm"),
            hidden,
        )?);
        v.push(vector(
            format!("model.layers.{i}.post_attention_layernorm.weight"),
            blk("ffn_norm"),
            hidden,
        )?);
        v.push(vector(attn("q_norm"), blk("attn_q_norm"), hd)?);
        v.push(vector(attn("k_norm"), blk("attn_k_norm"), hd)?);
    }
    v.push(vector(
        "model.hidden_norm.weight".into(),
        "enc.output_norm.weight".into(),
        hidden,
    )?);
    v.push(vector(
        "model.norm.weight".into(),
        "output_norm.weight".into(),
        hidden,
    )?);
    // The target's hidden width is the draft's (llama.cpp requires it: n_embd_inp = taps · n_embd).
    v.push(matrix(
        "model.fc.weight".into(),
        "fc.weight".into(),
        hidden,
        taps * hidden,
    )?);
    for i in 0..p.layers {
        let attn = |s: &str| format!("model.layers.{i}.self_attn.{s}.weight");
        let mlp = |s: &str| format!("model.layers.{i}.mlp.{s}.weight");
        let blk = |s: &str| format!("blk.{i}.{s}.weight");
        v.push(matrix(attn("q_proj"), blk("attn_q"), p.q_dim(), hidden)?);
        v.push(matrix(attn("k_proj"), blk("attn_k"), p.kv_dim(), hidden)?);
        v.push(matrix(attn("v_proj"), blk("attn_v"), p.kv_dim(), hidden)?);
        v.push(matrix(
            attn("o_proj"),
            blk("attn_output"),
            hidden,
            p.q_dim(),
        )?);
        v.push(matrix(
            mlp("gate_proj"),
            blk("ffn_gate"),
            p.intermediate,
            hidden,
        )?);
        v.push(matrix(
            mlp("up_proj"),
            blk("ffn_up"),
            p.intermediate,
            hidden,
        )?);
        v.push(matrix(
            mlp("down_proj"),
            blk("ffn_down"),
            hidden,
            p.intermediate,
        )?);
        if let Some(g) = generation2 {
            let projected = 2 * g.conv_kernel * g.groups(hidden);
            for (hf, gguf) in [("attention_conv", "attn_conv"), ("mlp_conv", "ffn_conv")] {
                let layer = |s: &str| format!("model.layers.{i}.{hf}.{s}");
                v.push(plain(
                    layer("base_kernel"),
                    format!("blk.{i}.{gguf}_base"),
                    vec![2, g.conv_kernel, hidden],
                )?);
                v.push(matrix(
                    layer("kernel_projection.weight"),
                    blk(&format!("{gguf}_proj")),
                    projected,
                    hidden,
                )?);
            }
        }
    }
    if let Some(g) = generation2 {
        for (hf, gguf) in [
            ("predecessor_codebook", "selector_predecessor"),
            ("successor_codebook", "selector_successor"),
        ] {
            v.push(plain(
                format!("model.candidate_selector.{hf}"),
                format!("{gguf}.weight"),
                vec![p.vocab, g.selector_rank],
            )?);
        }
        v.push(matrix(
            "model.candidate_selector.hidden_projection.weight".into(),
            "selector_hidden.weight".into(),
            g.selector_rank,
            hidden,
        )?);
    }
    Ok((p, v))
}

/// The list of output tensors for a llama GGUF, in file order (vectors first).
pub fn plan(f: &GgufFile, scale: ScaleType) -> Result<(ModelConfig, Vec<Planned>), WeightsError> {
    let arch = f.architecture().ok_or_else(|| {
        WeightsError::invalid(f.path(), "metadata \"general.architecture\" missing")
    })?;
    if !ATTENTION_ONLY_ARCHS.contains(&arch) {
        return Err(unsupported_architecture(f, arch));
    }
    // Only llama.cpp's LlamaModel conversion interleaves Q/K rows per rotary pair; qwen2/qwen3
    // are stored in Hugging Face order.
    let interleaved = arch == "llama";
    let p = ModelConfig::from_gguf(f)?;
    let q41 = WeightFormat::Q41 {
        scale,
        order: TileOrder::ColumnMajor,
    };
    let tile_format = |t: &GgufTensor<'_>| weight_format(f, t, scale);
    let part =
        |name: String, heads: Option<usize>| -> Result<(Part, WeightFormat, usize), WeightsError> {
            let t = f.require_tensor(&name)?;
            if t.shape.len() != 2 {
                return Err(WeightsError::tensor(
                    f.path(),
                    &name,
                    format!("expected 2 dims, got {:?}", t.shape),
                ));
            }
            let fmt = tile_format(&t)?;
            let rows = t.shape[1] as usize;
            if let Some(h) = heads {
                if h == 0 || !rows.is_multiple_of(2 * h) {
                    return Err(WeightsError::tensor(
                        f.path(),
                        &name,
                        format!("{rows} rows do not split into {h} heads"),
                    ));
                }
            }
            Ok((
                Part {
                    tensor: name,
                    unpermute_heads: heads,
                    rows,
                    row_src: None,
                },
                fmt,
                t.shape[0] as usize,
            ))
        };
    let matrix =
        |out: &str, parts: Vec<(String, Option<usize>)>| -> Result<Planned, WeightsError> {
            let mut ps = Vec::new();
            let mut fmt = None;
            let mut cols = None;
            for (n, h) in parts {
                let (pt, f1, c) = part(n, h)?;
                if fmt.is_some_and(|x| x != f1) || cols.is_some_and(|x| x != c) {
                    return Err(WeightsError::tensor(
                        f.path(),
                        &pt.tensor,
                        format!(
                        "cannot fuse into {out}: type or column count differs from its siblings"
                    ),
                    ));
                }
                fmt = Some(f1);
                cols = Some(c);
                ps.push(pt);
            }
            let rows: usize = ps.iter().map(|p| p.rows).sum();
            let tiled = fmt.is_none_or(|x| x.tile_bytes().is_some());
            if tiled && !rows.is_multiple_of(tiles::TILE_ROWS) {
                return Err(WeightsError::tensor(
                    f.path(),
                    out,
                    format!("{rows} rows is not a multiple of {}", tiles::TILE_ROWS),
                ));
            }
            Ok(Planned::Matrix {
                name: out.to_string(),
                format: fmt.unwrap_or(q41),
                parts: ps,
                rows,
                cols: cols.unwrap_or(0),
                col_blocks: None,
            })
        };
    let vector = |out: String, src: String| -> Result<Planned, WeightsError> {
        let t = f.require_tensor(&src)?;
        if !matches!(t.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Err(WeightsError::tensor(
                f.path(),
                &src,
                format!(
                    "norm of type {} (expected a float type)",
                    t.ggml_type.name()
                ),
            ));
        }
        Ok(Planned::Vector {
            name: out,
            tensor: src,
            len: t.elements(),
        })
    };
    // Projections read from one input (q, k, v; gate, up) are written fused when every layer's
    // parts share a format, else each on its own, for the whole package (the loader decides per
    // package): llama-quantize's mixes (Q4_K_M: v in Q6_K beside q, k in Q4_K) are stored split.
    let mut fuse = true;
    for i in 0..p.layers {
        let format_of = |s: &str| -> Result<WeightFormat, WeightsError> {
            tile_format(&f.require_tensor(&format!("blk.{i}.{s}.weight"))?)
        };
        let (q, k, val) = (
            format_of("attn_q")?,
            format_of("attn_k")?,
            format_of("attn_v")?,
        );
        let (gate, up) = (format_of("ffn_gate")?, format_of("ffn_up")?);
        fuse &= q == k && k == val && gate == up;
    }
    let mut v = Vec::new();
    for i in 0..p.layers {
        v.push(vector(
            format!("model.layers.{i}.input_layernorm.weight"),
            format!("blk.{i}.attn_norm.weight"),
        )?);
        v.push(vector(
            format!("model.layers.{i}.post_attention_layernorm.weight"),
            format!("blk.{i}.ffn_norm.weight"),
        )?);
    }
    for i in 0..p.layers {
        let attn = |s: &str| format!("model.layers.{i}.self_attn.{s}");
        if p.qkv_bias {
            for (hf, gguf) in [
                ("q_proj", "attn_q"),
                ("k_proj", "attn_k"),
                ("v_proj", "attn_v"),
            ] {
                v.push(vector(
                    attn(&format!("{hf}.bias")),
                    format!("blk.{i}.{gguf}.bias"),
                )?);
            }
        }
        if p.qk_norm {
            v.push(vector(
                attn("q_norm.weight"),
                format!("blk.{i}.attn_q_norm.weight"),
            )?);
            v.push(vector(
                attn("k_norm.weight"),
                format!("blk.{i}.attn_k_norm.weight"),
            )?);
        }
    }
    v.push(vector(
        "model.norm.weight".into(),
        "output_norm.weight".into(),
    )?);
    v.push(matrix(
        "model.embed_tokens.weight",
        vec![("token_embd.weight".into(), None)],
    )?);
    if !p.tie_word_embeddings {
        v.push(matrix(
            "lm_head.weight",
            vec![("output.weight".into(), None)],
        )?);
    }
    for i in 0..p.layers {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        let attn = |s: &str| format!("model.layers.{i}.self_attn.{s}.weight");
        let mlp = |s: &str| format!("model.layers.{i}.mlp.{s}.weight");
        let (q, k, val) = (
            (b("attn_q"), interleaved.then_some(p.heads)),
            (b("attn_k"), interleaved.then_some(p.kv_heads)),
            (b("attn_v"), None),
        );
        let (gate, up) = ((b("ffn_gate"), None), (b("ffn_up"), None));
        if fuse {
            v.push(matrix(&attn("qkv_proj"), vec![q, k, val])?);
            v.push(matrix(&mlp("gate_up_proj"), vec![gate, up])?);
        } else {
            v.push(matrix(&attn("q_proj"), vec![q])?);
            v.push(matrix(&attn("k_proj"), vec![k])?);
            v.push(matrix(&attn("v_proj"), vec![val])?);
            v.push(matrix(&mlp("gate_proj"), vec![gate])?);
            v.push(matrix(&mlp("up_proj"), vec![up])?);
        }
        v.push(matrix(
            &format!("model.layers.{i}.self_attn.o_proj.weight"),
            vec![(b("attn_output"), None)],
        )?);
        v.push(matrix(
            &format!("model.layers.{i}.mlp.down_proj.weight"),
            vec![(b("ffn_down"), None)],
        )?);
    }
    Ok((p, v))
}

/// GGUF row that holds HF row `r` of a tensor with `heads` rotary-interleaved heads.
/// GGUF (llama.cpp `convert_hf_to_gguf.py` `permute`) stores each head's rows as `(p, 2)`;
/// HF order is `(2, p)`, p = head_dim / 2.
pub fn gguf_row_for_hf_row(r: usize, rows: usize, heads: Option<usize>) -> usize {
    match heads {
        None => r,
        Some(h) => {
            let hd = rows / h;
            let half = hd / 2;
            let (head, within) = (r / hd, r % hd);
            let (a, p) = (within / half, within % half);
            head * hd + 2 * p + a
        }
    }
}

/// Source (tensor view, GGUF row) for output row `r` of a planned matrix.
fn source_row<'a>(views: &[(GgufTensor<'a>, &Part)], r: usize) -> Option<(GgufTensor<'a>, usize)> {
    let mut r = r;
    for (t, p) in views {
        if r < p.rows {
            return Some((*t, p.gguf_row(r)));
        }
        r -= p.rows;
    }
    None
}

/// Build row block `pb` (32 rows, all column tiles) of a planned matrix into `out`.
fn build_row_block(
    format: WeightFormat,
    views: &[(GgufTensor<'_>, &Part)],
    cols: usize,
    col_blocks: Option<&[usize]>,
    pb: usize,
    out: &mut [u8],
) -> Result<(), WeightsError> {
    out.fill(0);
    let tb = format.tile_bytes().unwrap_or(0);
    let q_tiles = format.padded_cols(cols) / tiles::TILE_COLS;
    let blocks_per_row = cols / 32;
    for r in 0..tiles::TILE_ROWS {
        let (t, src) = source_row(views, pb * tiles::TILE_ROWS + r).ok_or_else(|| {
            WeightsError::Other(format!(
                "row {} beyond the source tensors",
                pb * tiles::TILE_ROWS + r
            ))
        })?;
        let row = t.row_data(src)?;
        for q in 0..q_tiles {
            let tile = &mut out[q * tb..(q + 1) * tb];
            for g in 0..tiles::GROUPS {
                let blk = q * tiles::GROUPS + g;
                if blk >= blocks_per_row {
                    break;
                }
                let src = col_blocks.and_then(|m| m.get(blk).copied()).unwrap_or(blk);
                if src >= blocks_per_row {
                    return Err(WeightsError::Other(format!(
                        "{}: column block {src} out of range",
                        t.name
                    )));
                }
                match format {
                    WeightFormat::Q41 { scale, order } => {
                        let f16_at = |b: &[u8], i: usize| {
                            half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
                        };
                        // q4_1: d, m, 16 bytes of nibbles; q4_0: d, 16 bytes, value d·(q − 8).
                        let (b, d, m, qs) = match t.ggml_type {
                            GgmlType::Q4_0 => {
                                let b = &row[src * 18..src * 18 + 18];
                                let d = f16_at(b, 0);
                                let m = -8.0 * d;
                                if half::f16::from_f32(m).to_f32() != m {
                                    return Err(WeightsError::Other(format!(
                                        "{}: q4_0 scale {d} has no exact q4_1 minimum",
                                        t.name
                                    )));
                                }
                                (b, d, m, 2)
                            }
                            _ => {
                                let b = &row[src * 20..src * 20 + 20];
                                (b, f16_at(b, 0), f16_at(b, 2), 4)
                            }
                        };
                        let codes: [u8; 32] = std::array::from_fn(|i| {
                            if i < 16 {
                                b[qs + i] & 0x0F
                            } else {
                                b[qs + i - 16] >> 4
                            }
                        });
                        tiles::set_q41_cell(tile, scale, order, g, r, d, m, &codes);
                    }
                    WeightFormat::Q8 { scale, order } => {
                        let b = &row[src * 34..src * 34 + 34];
                        let d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                        let codes: [i8; 32] = std::array::from_fn(|i| b[2 + i] as i8);
                        tiles::set_q8_cell(tile, scale, order, g, r, d, &codes);
                    }
                    _ => {
                        return Err(WeightsError::Other(format!(
                            "tile format {} cannot be built from GGUF",
                            format.name()
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

fn progress_bar(total: u64, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg:>12} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// Import `gguf` into the directory `out` (created if needed; files replaced atomically).
pub fn import_gguf(gguf: &Path, out: &Path, opts: ImportOptions) -> Result<(), WeightsError> {
    let f = GgufFile::open(gguf)?;
    let tokenizer = Tokenizer::from_gguf(&f)?;
    let (mut description, planned) = plan_any(&f, opts.scale)?;
    let fused = planned
        .iter()
        .any(|p| matches!(p, Planned::Matrix { name, .. } if name.ends_with("qkv_proj.weight")));
    std::fs::create_dir_all(out).map_err(|e| WeightsError::io(out, e))?;

    // Header declarations and metadata.
    let mut decl = Vec::with_capacity(planned.len());
    let mut meta = BTreeMap::new();
    meta.insert(
        "xdna.scale_type".to_string(),
        match opts.scale {
            ScaleType::F16 => "f16",
            ScaleType::Bf16 => "bf16",
        }
        .to_string(),
    );
    meta.insert("xdna.order".into(), "column_major".into());
    meta.insert(
        "xdna.source".into(),
        gguf.file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    // A DFlash draft's scalars (`dflash.*`), so `xdna pack check` can hold the container to the
    // config.json written beside it.
    meta.extend(super::dflash_check::dflash_metadata(
        &description,
        &description.to_json(),
    ));
    let mut total = 0u64;
    for pl in &planned {
        match pl {
            Planned::Vector { name, len, .. } => {
                decl.push(Declared {
                    name: name.clone(),
                    dtype: Dtype::F32,
                    shape: vec![*len],
                });
                total += *len as u64 * 4;
            }
            Planned::Matrix {
                name,
                format,
                rows,
                cols,
                ..
            } => {
                let bytes = format
                    .matrix_bytes(*rows, *cols)
                    .map_err(|e| WeightsError::tensor(gguf, name, e.to_string()))?;
                let (dtype, shape) = match (format, format.tile_bytes()) {
                    (_, Some(tb)) => (Dtype::I8, vec![bytes / tb, tb]),
                    (WeightFormat::F32, None) => (Dtype::F32, vec![*rows, *cols]),
                    (WeightFormat::F16, None) => (Dtype::F16, vec![*rows, *cols]),
                    (WeightFormat::Bf16, None) => (Dtype::BF16, vec![*rows, *cols]),
                    (_, None) => (Dtype::U8, vec![*rows, bytes / rows.max(&1)]),
                };
                decl.push(Declared {
                    name: name.clone(),
                    dtype,
                    shape,
                });
                meta.insert(format!("xdna.format.{name}"), format.name().to_string());
                meta.insert(format!("xdna.shape.{name}"), format!("{rows},{cols}"));
                total += bytes as u64;
            }
            Planned::Plain {
                name,
                shape,
                rows,
                cols,
                ..
            } => {
                decl.push(Declared {
                    name: name.clone(),
                    dtype: Dtype::F32,
                    shape: shape.clone(),
                });
                total += (*rows * *cols * 4) as u64;
            }
        }
    }
    let model_path = out.join("model.q4nx");
    let mut w = Writer::create(&model_path, &decl, &meta)?;
    let bar = progress_bar(total, opts.progress);
    bar.set_message("importing");
    for pl in &planned {
        match pl {
            Planned::Vector { name, tensor, len } => {
                let t = f.require_tensor(tensor)?;
                let v = t.decode_f32()?;
                let mut bytes = Vec::with_capacity(len * 4);
                for x in v {
                    bytes.extend_from_slice(&x.to_le_bytes());
                }
                w.write(name, &bytes)?;
                bar.inc(bytes.len() as u64);
            }
            Planned::Plain {
                name,
                tensor,
                rows,
                cols,
                row_src,
                col_src,
                ..
            } => {
                let t = f.require_tensor(tensor)?;
                let mut src = vec![0f32; t.row_len()];
                let mut bytes = Vec::with_capacity(cols * 4);
                for r in 0..*rows {
                    let from = row_src.as_ref().map_or(r, |m| m[r]);
                    t.decode_row(from, &mut src)?;
                    bytes.clear();
                    for c in 0..*cols {
                        let x = src[col_src.as_ref().map_or(c, |m| m[c])];
                        bytes.extend_from_slice(&x.to_le_bytes());
                    }
                    w.write(name, &bytes)?;
                    bar.inc(bytes.len() as u64);
                }
            }
            Planned::Matrix {
                name,
                format,
                parts,
                rows,
                cols,
                col_blocks,
            } => {
                let views: Vec<(GgufTensor<'_>, &Part)> = parts
                    .iter()
                    .map(|p| f.require_tensor(&p.tensor).map(|t| (t, p)))
                    .collect::<Result<_, _>>()?;
                let Some(tb) = format.tile_bytes() else {
                    // The tensors' own rows, copied (in the planned row order).
                    if col_blocks.is_some() {
                        return Err(WeightsError::tensor(
                            gguf,
                            name,
                            format!("columns of {} cannot be reordered", format.name()),
                        ));
                    }
                    let mut chunk = Vec::new();
                    for r in 0..*rows {
                        let (t, src) = source_row(&views, r).ok_or_else(|| {
                            WeightsError::tensor(gguf, name, format!("row {r} beyond the sources"))
                        })?;
                        chunk.extend_from_slice(t.row_data(src)?);
                        if chunk.len() >= 1 << 20 || r + 1 == *rows {
                            w.write(name, &chunk)?;
                            bar.inc(chunk.len() as u64);
                            chunk.clear();
                        }
                    }
                    f.release_pages();
                    continue;
                };
                let mut block = vec![0u8; format.padded_cols(*cols) / tiles::TILE_COLS * tb];
                for pb in 0..rows / tiles::TILE_ROWS {
                    build_row_block(
                        *format,
                        &views,
                        *cols,
                        col_blocks.as_deref(),
                        pb,
                        &mut block,
                    )?;
                    w.write(name, &block)?;
                    bar.inc(block.len() as u64);
                }
                f.release_pages();
            }
        }
    }
    w.finish()?;
    bar.finish_and_clear();

    // The vocabulary covers every tokenizer id, should the embedding have fewer rows.
    description.vocab = description.vocab.max(tokenizer.vocab_size());
    write_json(
        &out.join("config.json"),
        &config_json(&f, &description, opts.scale, fused),
    )?;
    write_json(&out.join("tokenizer.json"), &tokenizer_json(&tokenizer))?;
    write_json(
        &out.join("tokenizer_config.json"),
        &tokenizer_config_json(&f, &tokenizer),
    )?;
    Ok(())
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), WeightsError> {
    let text =
        serde_json::to_string_pretty(v).map_err(|e| WeightsError::invalid(path, e.to_string()))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(|e| WeightsError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| WeightsError::io(path, e))
}

/// The package's `config.json`: the description as Hugging Face names it, plus how this import
/// stored the weights (`xdna`: fused matrices, tile scale type and order, norm dtype, source).
fn config_json(
    f: &GgufFile,
    description: &ModelConfig,
    scale: ScaleType,
    fused: bool,
) -> serde_json::Value {
    let mut c = description.to_json();
    c["torch_dtype"] = "bfloat16".into();
    let storage = serde_json::json!({
        "fused": fused,
        "scale_type": match scale { ScaleType::F16 => "f16", ScaleType::Bf16 => "bf16" },
        "tile_order": "column_major",
        "norm_dtype": "F32",
        "source": f.path().file_name().map(|s| s.to_string_lossy().into_owned()),
    });
    match c.get_mut("xdna").and_then(serde_json::Value::as_object_mut) {
        Some(xdna) => {
            if let serde_json::Value::Object(fields) = storage {
                xdna.extend(fields);
            }
        }
        None => c["xdna"] = storage,
    }
    c
}

/// HF `tokenizer.json` for a byte-level BPE tokenizer.
pub fn tokenizer_json(tok: &Tokenizer) -> serde_json::Value {
    let mut added: Vec<&(String, u32, bool)> = tok.added_tokens().iter().collect();
    added.sort_by_key(|a| a.1);
    let added: Vec<serde_json::Value> = added
        .iter()
        .map(|(content, id, special)| {
            serde_json::json!({
                "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            })
        })
        .collect();
    let vocab: serde_json::Map<String, serde_json::Value> = tok
        .tokens()
        .iter()
        .enumerate()
        .map(|(i, s)| (s.clone(), serde_json::Value::from(i as u64)))
        .collect();
    let merges: Vec<serde_json::Value> = tok
        .merges()
        .into_iter()
        .map(|(a, b)| {
            if a.contains(' ') || b.contains(' ') {
                serde_json::json!([a, b])
            } else {
                serde_json::Value::String(format!("{a} {b}"))
            }
        })
        .collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    let pre = match tok.pre_tokenizer() {
        PreTokenizer::Gpt2 => byte_level.clone(),
        PreTokenizer::SmolLm => serde_json::json!({
            "type": "Sequence",
            "pretokenizers": [
                { "type": "Split", "pattern": { "Regex": "\\p{N}" }, "behavior": "Isolated", "invert": false },
                byte_level.clone(),
            ]
        }),
        // llama.cpp's `default`, in the HF form that lists its four splits (this runtime reads it
        // back as that; the byte-level step in the middle is where GPT-2's split happens).
        PreTokenizer::LlamaCppDefault => serde_json::json!({
            "type": "Sequence",
            "pretokenizers": [
                { "type": "Split", "pattern": { "Regex": DEFAULT_PUNCT_PATTERN }, "behavior": "Isolated", "invert": false },
                byte_level.clone(),
                { "type": "Split", "pattern": { "Regex": DEFAULT_NUMBER_PATTERN }, "behavior": "Isolated", "invert": false },
                { "type": "Split", "pattern": { "Regex": DEFAULT_TRIPLE_PATTERN }, "behavior": "Isolated", "invert": false },
            ]
        }),
        p @ (PreTokenizer::Llama3 | PreTokenizer::Qwen2 | PreTokenizer::Qwen35) => {
            serde_json::json!({
                "type": "Sequence",
                "pretokenizers": [
                    { "type": "Split", "pattern": { "Regex": p.pattern() }, "behavior": "Isolated", "invert": false },
                    { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false },
                ]
            })
        }
    };
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": null,
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        }
    })
}

fn tokenizer_config_json(f: &GgufFile, tok: &Tokenizer) -> serde_json::Value {
    let name = |key: &str| {
        f.get_u64(key)
            .and_then(|id| tok.token_str(id as u32).map(|s| (id, s.to_string())))
    };
    let mut c = serde_json::json!({
        "add_bos_token": f.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(false),
        "add_eos_token": f.get_bool("tokenizer.ggml.add_eos_token").unwrap_or(false),
        "clean_up_tokenization_spaces": false,
        "tokenizer_class": "GPT2Tokenizer",
    });
    if let Some((id, s)) = name("tokenizer.ggml.eos_token_id") {
        c["eos_token"] = s.into();
        c["eos_token_id"] = serde_json::json!([id]);
    }
    if let Some((id, s)) = name("tokenizer.ggml.bos_token_id") {
        c["bos_token"] = s.into();
        c["bos_token_id"] = id.into();
    }
    if let Some((_, s)) = name("tokenizer.ggml.unknown_token_id") {
        c["unk_token"] = s.into();
    }
    if let Some((_, s)) = name("tokenizer.ggml.padding_token_id") {
        c["pad_token"] = s.into();
    }
    if let Some(t) = f.get_str("tokenizer.chat_template") {
        c["chat_template"] = t.into();
    }
    if let Some(n) = f.get_u64(&format!(
        "{}.context_length",
        f.architecture().unwrap_or("llama")
    )) {
        c["model_max_length"] = n.into();
    }
    c
}

/// Reconstruction error of a package against the GGUF it came from.
#[derive(Clone, Debug, Default)]
pub struct CompareStats {
    /// Values compared.
    pub values: u64,
    /// Largest |package value − GGUF value|.
    pub max_abs: f64,
    /// Sum of the squared differences.
    pub sum_sq: f64,
    /// Largest |GGUF value| seen (for scale).
    pub max_ref: f64,
}

impl CompareStats {
    /// Root mean square of the differences (0 when nothing was compared).
    pub fn rms(&self) -> f64 {
        if self.values == 0 {
            0.0
        } else {
            (self.sum_sq / self.values as f64).sqrt()
        }
    }
}

/// Decode every matrix of `pkg` and compare with the GGUF decode (ggml formulas), undoing the
/// Q/K row permutation; returns (stats of q4_1 matrices, stats of Q8 matrices).
pub fn compare(
    pkg: &super::Package,
    gguf: &Path,
) -> Result<(CompareStats, CompareStats), WeightsError> {
    let f = GgufFile::open(gguf)?;
    let (_, planned) = plan_any(&f, pkg.weights().scale_type())?;
    let mut s41 = CompareStats::default();
    let mut s8 = CompareStats::default();
    for pl in &planned {
        let Planned::Matrix {
            name,
            parts,
            rows,
            cols,
            col_blocks,
            ..
        } = pl
        else {
            continue;
        };
        let view = pkg.matrix(name, *rows, *cols)?;
        let stats = if matches!(view.format, WeightFormat::Q8 { .. }) {
            &mut s8
        } else {
            &mut s41
        };
        let tb = view.format.tile_bytes().unwrap_or(0);
        let q_tiles = view.format.padded_cols(*cols) / tiles::TILE_COLS;
        let decoded: Vec<Vec<f32>> = parts
            .iter()
            .map(|p| f.require_tensor(&p.tensor).and_then(|t| t.decode_f32()))
            .collect::<Result<_, _>>()?;
        let mut tile = vec![0f32; tiles::TILE_ROWS * tiles::TILE_COLS];
        for pb in 0..rows / tiles::TILE_ROWS {
            for q in 0..q_tiles {
                let t = pb * q_tiles + q;
                tiles::decode_tile(view.format, &view.data[t * tb..(t + 1) * tb], &mut tile)
                    .map_err(|e| WeightsError::tensor(pkg.weights().path(), name, e.to_string()))?;
                for r in 0..tiles::TILE_ROWS {
                    let mut row = pb * tiles::TILE_ROWS + r;
                    let mut pi = 0;
                    while row >= parts[pi].rows {
                        row -= parts[pi].rows;
                        pi += 1;
                    }
                    let src = parts[pi].gguf_row(row);
                    for c in 0..tiles::TILE_COLS {
                        let col = q * tiles::TILE_COLS + c;
                        let got = tile[r * tiles::TILE_COLS + c] as f64;
                        let src_col = match col_blocks {
                            Some(m) if col < *cols => m[col / 32] * 32 + col % 32,
                            _ => col,
                        };
                        let want = if col < *cols {
                            decoded[pi][src * cols + src_col] as f64
                        } else {
                            0.0
                        };
                        if col >= *cols && got != 0.0 {
                            return Err(WeightsError::tensor(
                                pkg.weights().path(),
                                name,
                                "padding column is not zero",
                            ));
                        }
                        if col < *cols {
                            let e = (got - want).abs();
                            stats.values += 1;
                            stats.sum_sq += e * e;
                            stats.max_abs = stats.max_abs.max(e);
                            stats.max_ref = stats.max_ref.max(want.abs());
                        }
                    }
                }
            }
        }
    }
    Ok((s41, s8))
}

/// Where imported packages are cached: `$XDG_CACHE_HOME/xdna` or `~/.cache/xdna`.
pub fn cache_dir() -> Result<PathBuf, WeightsError> {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return Ok(PathBuf::from(x).join("xdna"));
    }
    match std::env::var_os("HOME").filter(|x| !x.is_empty()) {
        Some(h) => Ok(PathBuf::from(h).join(".cache").join("xdna")),
        None => Err(WeightsError::Other(
            "no cache directory: set XDG_CACHE_HOME or HOME".into(),
        )),
    }
}

/// A number no other call in this process gets: with the process id it names a temporary
/// file or directory that two imports running at once (two threads) do not share.
pub fn unique_suffix() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Import `gguf` once into `<dir>/<stem>.pkg` (or reuse it), atomically: the import goes into a
/// temporary directory renamed into place only when complete, so an interrupted import is never
/// reused.
pub fn import_once(
    gguf: &Path,
    final_dir: &Path,
    opts: ImportOptions,
) -> Result<PathBuf, WeightsError> {
    if final_dir.join("config.json").exists() && final_dir.join("model.q4nx").exists() {
        return Ok(final_dir.to_path_buf());
    }
    let parent = final_dir
        .parent()
        .ok_or_else(|| WeightsError::invalid(final_dir, "no parent directory"))?;
    std::fs::create_dir_all(parent).map_err(|e| WeightsError::io(parent, e))?;
    let tmp = parent.join(format!(
        ".{}.tmp.{}.{}",
        final_dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id(),
        unique_suffix()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    if let Err(e) = import_gguf(gguf, &tmp, opts) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    match std::fs::rename(&tmp, final_dir) {
        Ok(()) => Ok(final_dir.to_path_buf()),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            if final_dir.join("config.json").exists() {
                Ok(final_dir.to_path_buf()) // another process won the race
            } else {
                Err(WeightsError::io(final_dir, e))
            }
        }
    }
}

/// The revision of what an import writes: part of the cache key, so a package imported by a
/// build that stored a tensor or the tokenizer differently is imported again, not reused. Raise
/// it whenever the package written for the same file changes.
pub const IMPORT_REVISION: u32 = 2;

/// The cache's name for the import of `gguf`: its file name, size, mtime and
/// [`IMPORT_REVISION`], so a rewritten file or a newer import is never served from an old entry.
pub fn cache_key(gguf: &Path) -> Result<String, WeightsError> {
    let meta = std::fs::metadata(gguf).map_err(|e| WeightsError::io(gguf, e))?;
    Ok(key_of(gguf, &meta))
}

fn key_of(gguf: &Path, meta: &std::fs::Metadata) -> String {
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let stem = gguf
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    format!("{stem}-{:x}-{mtime:x}-r{IMPORT_REVISION}", meta.len())
}

/// Beside each cached import, the GGUF paths it was imported from, one per line.
const SOURCES_SUFFIX: &str = ".sources";

/// Add `gguf` to the source record of the import `key` in `packages` (atomically replaced).
fn record_source(packages: &Path, key: &str, gguf: &Path) -> Result<(), WeightsError> {
    let gguf = std::fs::canonicalize(gguf).map_err(|e| WeightsError::io(gguf, e))?;
    let record = packages.join(format!("{key}{SOURCES_SUFFIX}"));
    let mut text = std::fs::read_to_string(&record).unwrap_or_default();
    let line = gguf.to_string_lossy();
    if text.lines().any(|l| l == line) {
        return Ok(());
    }
    text.push_str(&line);
    text.push('\n');
    let mut tmp = tempfile::Builder::new()
        .prefix(".sources")
        .tempfile_in(packages)
        .map_err(|e| WeightsError::io(packages, e))?;
    std::io::Write::write_all(&mut tmp, text.as_bytes())
        .map_err(|e| WeightsError::io(&record, e))?;
    tmp.persist(&record)
        .map_err(|e| WeightsError::io(&record, e.error))?;
    Ok(())
}

/// Remove the cached imports no live file can reach: those whose every recorded source is gone or
/// has changed since (its key is no longer the entry's), and those written by an older
/// [`IMPORT_REVISION`]. Entries without a record are kept, and so are temporaries of imports in
/// progress. Returns the entries removed.
pub fn prune_import_cache(packages: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(packages) else {
        return removed;
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let stale = if let Some(key) = name.strip_suffix(SOURCES_SUFFIX) {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let live = text.lines().any(|line| {
                let source = Path::new(line);
                cache_key(source).is_ok_and(|k| k == key)
            });
            (!live).then(|| key.to_string())
        } else {
            let revision = name
                .rsplit_once("-r")
                .and_then(|(_, r)| r.parse::<u32>().ok());
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            (is_dir && revision.is_some_and(|r| r < IMPORT_REVISION)).then(|| name.clone())
        };
        let Some(key) = stale else { continue };
        let dir = packages.join(&key);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => removed.push(dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!("{}: stale import not removed: {e}", dir.display());
                continue;
            }
        }
        let _ = std::fs::remove_file(packages.join(format!("{key}{SOURCES_SUFFIX}")));
    }
    removed
}

/// Import a GGUF into the cache (keyed by [`cache_key`]) and return the package dir. The cache
/// holds what live files can use: each import records its source, and imports whose sources are
/// gone or changed are removed first ([`prune_import_cache`]).
pub fn cached_import(gguf: &Path) -> Result<PathBuf, WeightsError> {
    let key = cache_key(gguf)?;
    let packages = cache_dir()?.join("packages");
    for dir in prune_import_cache(&packages) {
        tracing::info!(
            "removed the cached import {} (its GGUF is gone or changed)",
            dir.display()
        );
    }
    let dir = packages.join(&key);
    let dir = import_once(gguf, &dir, ImportOptions::default())?;
    if let Err(e) = record_source(&packages, &key, gguf) {
        // Without a record the import is only kept longer, never reused wrongly.
        tracing::warn!("{}: source not recorded: {e}", dir.display());
    }
    if super::Package::open_dir(&dir).is_ok_and(|p| {
        p.config().is_hybrid() || p.host_only_matrix().is_some() || p.config().dflash.is_some()
    }) {
        // Hybrid models, GGUF block rows and DFlash drafts run on the host backend only
        // (docs/model.md); no device kernel set.
        return Ok(dir);
    }
    // The kernel set is what the xdna backend runs; a model whose shapes cannot be derived still
    // opens (the host backend needs no kernel set), with the reason logged.
    if let Err(e) = super::default_model::ensure_kernel_set(&dir) {
        tracing::warn!("{}: no kernel set written: {e}", dir.display());
    }
    Ok(dir)
}
