//! The model description: one typed [`ModelConfig`], owned by the weights layer and parsed once.
//!
//! Sources: a Hugging Face `config.json` ([`ModelConfig::from_json`], [`ModelConfig::from_file`];
//! transformers 4 writes `rope_theta` / `rope_scaling` / `partial_rotary_factor` at the top
//! level, transformers 5 nests them in `rope_parameters`, both are read) or GGUF metadata
//! ([`ModelConfig::from_gguf`]: the `<arch>.*` keys of llama, qwen2, qwen3 and qwen35 files).
//! [`ModelConfig::to_json`] writes it back as a `config.json` (what `xdna pack import` stores), and
//! [`ModelConfig::kernel_shapes`] turns it into the GEMM shapes a kernel set must hold: model,
//! kernels, import and tools all read this one type.
//!
//! Supported families: Llama (SmolLM2, Llama 3.x with `rope_type = "llama3"`), Qwen2/2.5 (q/k/v
//! bias), Qwen3 (per-head q_norm / k_norm), Qwen3.5 / Qwen3-Next hybrids (Gated DeltaNet layers).
//! Every missing or ill-typed field is a typed error naming the field and the file it was read
//! from.

use super::gguf::{GgufFile, Value as GgufValue};
use super::WeightsError;
use crate::kernels::ShapeNeed;
use crate::tiles::WeightFormat;
use serde_json::{json, Value};
use std::path::Path;

/// `model_type`s of the hybrid (Gated DeltaNet + gated attention) family.
const HYBRID_MODEL_TYPES: [&str; 3] = ["qwen3_5", "qwen3_5_text", "qwen3_next"];

/// Every `model_type` the forward runs.
const SUPPORTED_MODEL_TYPES: [&str; 11] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "smollm",
    "smollm2",
    "smollm3",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_next",
    "dflash",
];

/// How rotary frequencies are scaled for long contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// `"linear"`: positions divided by `factor` (all frequencies divided by `factor`).
    Linear {
        /// The divisor of every frequency.
        factor: f64,
    },
    /// `"llama3"`: Llama 3.1 frequency-dependent scaling: long wavelengths divided by `factor`,
    /// short ones kept, the band between blended.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled
        /// fully.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length (tokens) the model was trained at before the extension.
        original_max_position_embeddings: f64,
    },
    /// One divisor per rotated pair, applied to that pair's frequency: llama.cpp's
    /// `rope_freqs.weight` (how its converter stores Llama 3.1 scaling). Written to a package's
    /// `config.json` as `{"rope_type": "frequency_divisors", "divisors": [...]}`.
    FrequencyDivisors(Vec<f64>),
}

/// The transformer's shape and numerical constants.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `model_type` (e.g. `llama`, `qwen2`, `qwen3`, `qwen3_5`).
    pub model_type: String,
    /// `hidden_size`: width of the residual stream (floats per token).
    pub hidden: usize,
    /// `intermediate_size`: width of the MLP's gate/up outputs.
    pub intermediate: usize,
    /// `num_hidden_layers`: decoder layers.
    pub layers: usize,
    /// `num_attention_heads`: query heads.
    pub heads: usize,
    /// `num_key_value_heads`: key/value heads (grouped-query attention; = `heads` when absent).
    pub kv_heads: usize,
    /// `head_dim`: floats per attention head (`hidden / heads` when absent).
    pub head_dim: usize,
    /// `rms_norm_eps`: the epsilon added to the mean square in every RMSNorm.
    pub rms_eps: f64,
    /// `rope_theta`: the RoPE base frequency.
    pub rope_theta: f64,
    /// `rope_scaling`: how RoPE frequencies are stretched for long contexts.
    pub rope_scaling: RopeScaling,
    /// `vocab_size`: rows of the embedding table and of the lm_head.
    pub vocab: usize,
    /// `tie_word_embeddings`: the lm_head reuses the embedding table.
    pub tie_word_embeddings: bool,
    /// `max_position_embeddings`: the longest context (tokens) the model was trained for.
    pub max_position_embeddings: usize,
    /// q/k/v projections carry a bias (Qwen2, or `attention_bias: true`).
    pub qkv_bias: bool,
    /// o_proj carries a bias (`attention_bias: true` on Llama).
    pub o_bias: bool,
    /// gate/up/down carry biases (`mlp_bias: true`).
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// What each layer's token mixer is (all `Attention` for Llama-family models).
    pub layer_kinds: Vec<LayerKind>,
    /// Gated DeltaNet dimensions (hybrid models only).
    pub linear: Option<LinearAttnConfig>,
    /// q_proj also emits a per-head output gate: `attn_out ⊙ sigmoid(gate)` (Qwen3-Next / 3.5).
    pub attn_output_gate: bool,
    /// Dimensions of each head that RoPE rotates (`head_dim · partial_rotary_factor`).
    pub rotary_dim: usize,
    /// The checkpoint's RMSNorm weights are zero-centred (`x · (1 + w)`, Qwen3-Next / 3.5); the
    /// loader adds 1 so the forward uses plain `x · w`. The gated norm inside GDN is not. False
    /// when `xdna.norms_include_one` is true (packages imported from a llama.cpp GGUF, whose
    /// converter already added the 1).
    pub zero_centered_norms: bool,
    /// `bos_token_id` (GGUF: `tokenizer.ggml.bos_token_id`).
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`, one id or a list (GGUF: `tokenizer.ggml.eos_token_id`).
    pub eos_token_ids: Vec<u32>,
    /// Present when the model is a DFlash block drafter (`model_type` `dflash`): Qwen3-style
    /// layers run over a target's hidden states, not a standalone language model.
    pub dflash: Option<DflashParams>,
}

/// What makes a model a DFlash block drafter (generation 1, z-lab `DFlashDraftModel`): its
/// layers (Qwen3-style, described by the rest of [`ModelConfig`]) attend over context rows made
/// from the target's hidden states and draft a whole block in one non-causal pass; it has no
/// embedding table or head of its own (the target's are used).
#[derive(Clone, Debug, PartialEq)]
pub struct DflashParams {
    /// Rows of one drafted block: the pending token, then `block_size - 1` mask rows, each
    /// predicting one draft (`dflash_config.block_size`; GGUF `dflash.block_size`).
    pub block_size: usize,
    /// The target layers (0-based) whose output, the residual stream after that layer, is one
    /// part of a context row, in the order the fusion matrix reads them. Hugging Face
    /// `dflash_config.target_layer_ids` holds these ids; GGUF `dflash.target_layers` holds
    /// hidden-state indices, each id + 1.
    pub target_layers: Vec<usize>,
    /// The token whose embedding fills the block's mask rows (`dflash_config.mask_token_id`;
    /// GGUF `tokenizer.ggml.mask_token_id`).
    pub mask_token_id: u32,
    /// Attention inside the block is causal (`is_causal`; GGUF `dflash.attention.causal`).
    /// DFlash drafts are trained non-causal, the default.
    pub causal: bool,
    /// Generation 2 (z-lab `DFlash2DraftModel`): grouped dynamic convolutions around attention
    /// and MLP, and the candidate selector; `None` for generation 1.
    pub generation2: Option<Dflash2Params>,
}

/// The generation-2 additions of a DFlash draft.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dflash2Params {
    /// Kernel offsets of the grouped convolutions (offset 0 is the row itself).
    pub conv_kernel: usize,
    /// Channels per group sharing one dynamic kernel (`hidden / conv_group` groups).
    pub conv_group: usize,
    /// Width of the selector's pairwise codebooks.
    pub selector_rank: usize,
    /// Candidates per block row the selector chooses among (the head's top k).
    pub selector_top_k: usize,
}

impl Dflash2Params {
    /// Groups of channels, each with its own dynamic kernel.
    pub fn groups(&self, hidden: usize) -> usize {
        hidden / self.conv_group.max(1)
    }
}

/// The most rows a DFlash block may have: one verify pass (the pending token and 15 drafts).
pub const DFLASH_MAX_BLOCK: usize = 16;

/// The token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Softmax attention over the KV cache.
    Attention,
    /// Gated DeltaNet (recurrent state + short causal convolution).
    Linear,
}

/// Gated DeltaNet dimensions (`linear_*` fields of `config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct LinearAttnConfig {
    /// `linear_num_key_heads` (Hk): q/k heads.
    pub key_heads: usize,
    /// `linear_num_value_heads` (Hv): v heads, one recurrent state each.
    pub value_heads: usize,
    /// `linear_key_head_dim` (d_k).
    pub key_head_dim: usize,
    /// `linear_value_head_dim` (d_v).
    pub value_head_dim: usize,
    /// `linear_conv_kernel_dim` (K): the causal convolution's width.
    pub conv_kernel: usize,
}

impl LinearAttnConfig {
    /// Width of q (and of k): `Hk × d_k`.
    pub fn key_dim(&self) -> usize {
        self.key_heads * self.key_head_dim
    }
    /// Width of v (and of the layer's output before o_proj): `Hv × d_v`.
    pub fn value_dim(&self) -> usize {
        self.value_heads * self.value_head_dim
    }
    /// Channels of the short convolution: q ‖ k ‖ v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Floats of one layer's recurrent state: `Hv × d_k × d_v`.
    pub fn state_len(&self) -> usize {
        self.value_heads * self.key_head_dim * self.value_head_dim
    }
    /// Floats of one layer's conv state: the last `K − 1` inputs.
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim()
    }
}

impl ModelConfig {
    /// Rows of the fused QKV projection: q rows (per head `[q, gate]` when gated), then k, then v.
    pub fn qkv_rows(&self) -> usize {
        self.q_rows() + 2 * self.kv_heads * self.head_dim
    }

    /// Rows the q projection emits: `heads × head_dim`, doubled when it carries the output gate.
    pub fn q_rows(&self) -> usize {
        self.q_dim() * if self.attn_output_gate { 2 } else { 1 }
    }

    /// Whether any layer is recurrent (Gated DeltaNet).
    pub fn has_recurrent(&self) -> bool {
        self.layer_kinds.contains(&LayerKind::Linear)
    }

    /// The mixer of layer `l`.
    pub fn layer_kind(&self, l: usize) -> LayerKind {
        self.layer_kinds
            .get(l)
            .copied()
            .unwrap_or(LayerKind::Attention)
    }

    /// Width of the attention output (input of o_proj).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of one position's keys (or values) across all KV heads.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Whether this is a hybrid (Gated DeltaNet + gated attention) model: those run on the host
    /// backend only and get no device kernel set.
    pub fn is_hybrid(&self) -> bool {
        HYBRID_MODEL_TYPES.contains(&self.model_type.as_str())
    }

    /// Read and parse a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self, WeightsError> {
        let text = std::fs::read_to_string(path).map_err(|e| WeightsError::io(path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| WeightsError::invalid(path, format!("invalid JSON: {e}")))?;
        Self::from_json(&v, path)
    }

    /// Parse a `config.json` value; `file` names the source in errors.
    pub fn from_json(v: &Value, file: impl AsRef<Path>) -> Result<Self, WeightsError> {
        let file = file.as_ref();
        let f = Fields::top(v, file);
        let model_type = f.opt_str("model_type")?.unwrap_or("llama").to_string();
        if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
            return Err(config_error(
                file,
                "model_type",
                format!("{model_type:?} is not supported (supported: {SUPPORTED_MODEL_TYPES:?})"),
            ));
        }
        let hidden = f.usize("hidden_size")?;
        let heads = f.usize("num_attention_heads")?;
        let kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(heads);
        let head_dim = match f.opt_usize("head_dim")? {
            Some(h) => h,
            None => {
                if heads == 0 || hidden % heads != 0 {
                    return Err(f.bad(
                        "num_attention_heads",
                        "a divisor of hidden_size (no head_dim given)",
                    ));
                }
                hidden / heads
            }
        };
        // transformers 5 moved `rope_theta`, the scaling fields and `partial_rotary_factor` into
        // `rope_parameters`; transformers 4 has them at the top level (scaling in `rope_scaling`).
        let rope_params = v
            .get("rope_parameters")
            .filter(|p| p.is_object())
            .map(|p| f.nested(p, "rope_parameters"));
        let rope_scaling = match (v.get("rope_scaling"), &rope_params) {
            (Some(s), _) if !s.is_null() => parse_rope_scaling(&f.nested(s, "rope_scaling"))?,
            (_, Some(p)) => parse_rope_scaling(p)?,
            _ => RopeScaling::None,
        };
        let is_qwen2 = model_type == "qwen2";
        let hybrid = HYBRID_MODEL_TYPES.contains(&model_type.as_str());
        let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(false);
        let layers = f.usize("num_hidden_layers")?;
        if layers > MAX_LAYERS {
            return Err(f.bad("num_hidden_layers", MAX_LAYERS_EXPECTED));
        }
        let (layer_kinds, linear) = if hybrid {
            parse_hybrid_layers(&f, layers)?
        } else {
            (vec![LayerKind::Attention; layers], None)
        };
        let partial = match f.opt_f64("partial_rotary_factor")? {
            Some(p) => p,
            None => match &rope_params {
                Some(p) => p.opt_f64("partial_rotary_factor")?.unwrap_or(1.0),
                None => {
                    if hybrid {
                        0.25
                    } else {
                        1.0
                    }
                }
            },
        };
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(f.bad("partial_rotary_factor", "a number in (0, 1]"));
        }
        let rotary_dim = (head_dim as f64 * partial).round() as usize;
        let rope_theta = match f.opt_f64("rope_theta")? {
            Some(t) => t,
            None => match &rope_params {
                Some(p) => p.opt_f64("rope_theta")?.unwrap_or(10000.0),
                None => 10000.0,
            },
        };
        let cfg = ModelConfig {
            hidden,
            intermediate: f.usize("intermediate_size")?,
            layers,
            heads,
            kv_heads,
            head_dim,
            rms_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            vocab: f.usize("vocab_size")?,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(2048),
            qkv_bias: is_qwen2 || attention_bias,
            o_bias: attention_bias,
            mlp_bias: f.opt_bool("mlp_bias")?.unwrap_or(false),
            qk_norm: model_type == "qwen3" || model_type == "dflash" || hybrid,
            layer_kinds,
            linear,
            attn_output_gate: hybrid && f.opt_bool("attn_output_gate")?.unwrap_or(true),
            rotary_dim,
            zero_centered_norms: hybrid
                && !v
                    .pointer("/xdna/norms_include_one")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            dflash: if model_type == "dflash" {
                Some(dflash_from_json(&f)?)
            } else {
                None
            },
            model_type,
        };
        cfg.check_dims()
            .map_err(|(field, expected)| f.bad(field.json_name(), expected))?;
        if let RopeScaling::FrequencyDivisors(d) = &cfg.rope_scaling {
            check_divisors(d, cfg.rotary_dim)
                .map_err(|problem| config_error(file, "rope_scaling.divisors", problem))?;
        }
        Ok(cfg)
    }

    /// The description of a GGUF file, from its metadata: `<arch>.*` keys of llama, qwen2 and
    /// qwen3 files (attention only) or of qwen35 hybrids, `token_embd.weight`'s rows as the
    /// vocabulary, and the tokenizer's BOS / EOS ids. f32 values (`rms_norm_eps`, `rope_theta`)
    /// are taken as the decimal they were written from (1e-5, not 9.999999747378752e-6).
    pub fn from_gguf(g: &GgufFile) -> Result<Self, WeightsError> {
        let path = g.path();
        let arch = g
            .architecture()
            .ok_or_else(|| config_error(path, "general.architecture", "missing"))?;
        let mut cfg = match arch {
            "llama" | "qwen2" | "qwen3" => attention_only_from_gguf(g, arch)?,
            super::import_qwen35::ARCH => qwen35_from_gguf(g)?,
            DFLASH_ARCH => dflash_from_gguf(g)?,
            other => {
                return Err(config_error(
                    path,
                    "general.architecture",
                    format!(
                        "{other:?} is not supported (llama, qwen2, qwen3, qwen35 and dflash are)"
                    ),
                ))
            }
        };
        cfg.bos_token_id = g.get_u32("tokenizer.ggml.bos_token_id");
        cfg.eos_token_ids = g
            .get_u32("tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect();
        cfg.check_dims().map_err(|(field, expected)| {
            config_error(
                path,
                &field.gguf_name(arch),
                format!(
                    "expected {expected}, the metadata gives {}",
                    cfg.value_of(field)
                ),
            )
        })?;
        Ok(cfg)
    }

    /// The shape rules every description obeys, whichever source it came from: the first broken
    /// one and what was expected.
    fn check_dims(&self) -> Result<(), (ShapeField, &'static str)> {
        let linear_dims = [
            ShapeField::LinearKeyHeads,
            ShapeField::LinearValueHeads,
            ShapeField::LinearKeyHeadDim,
            ShapeField::LinearValueHeadDim,
        ];
        let counts = [
            ShapeField::Hidden,
            ShapeField::Intermediate,
            ShapeField::Layers,
            ShapeField::Vocab,
        ];
        let linear = self.linear.as_ref().map(|_| linear_dims);
        for field in counts.into_iter().chain(linear.into_iter().flatten()) {
            if self.value_of(field) == 0 {
                return Err((field, "a positive integer"));
            }
        }
        // Every size at most 2^20: real models stay far below it, and the products the shapes are
        // built from (up to three sizes, doubled) then fit a 64-bit usize.
        const MAX_SIZE: usize = 1 << 20;
        let sizes = [ShapeField::Heads, ShapeField::KvHeads, ShapeField::HeadDim];
        for field in counts
            .into_iter()
            .chain(sizes)
            .chain(linear.into_iter().flatten())
        {
            if self.value_of(field) > MAX_SIZE {
                return Err((field, "at most 1048576"));
            }
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err((ShapeField::KvHeads, "a divisor of num_attention_heads"));
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim == 0 {
            return Err((ShapeField::HeadDim, "an even, non-zero number"));
        }
        if self.rotary_dim == 0
            || !self.rotary_dim.is_multiple_of(2)
            || self.rotary_dim > self.head_dim
        {
            return Err((
                ShapeField::RotaryDim,
                "a factor giving an even, non-zero number of rotated dimensions",
            ));
        }
        if let Some(lin) = &self.linear {
            if !lin.value_heads.is_multiple_of(lin.key_heads) {
                return Err((
                    ShapeField::LinearValueHeads,
                    "a multiple of linear_num_key_heads",
                ));
            }
            if lin.conv_kernel < 2 {
                return Err((ShapeField::LinearConvKernel, "at least 2"));
            }
        }
        Ok(())
    }

    /// The value of a field [`ModelConfig::check_dims`] judges (0 for a linear one without
    /// linear dimensions).
    fn value_of(&self, dim: ShapeField) -> usize {
        let lin = self.linear.as_ref();
        let linear = |get: fn(&LinearAttnConfig) -> usize| lin.map_or(0, get);
        match dim {
            ShapeField::Hidden => self.hidden,
            ShapeField::Intermediate => self.intermediate,
            ShapeField::Layers => self.layers,
            ShapeField::Vocab => self.vocab,
            ShapeField::KvHeads => self.kv_heads,
            ShapeField::HeadDim => self.head_dim,
            ShapeField::Heads => self.heads,
            ShapeField::RotaryDim => self.rotary_dim,
            ShapeField::LinearKeyHeads => linear(|l| l.key_heads),
            ShapeField::LinearValueHeads => linear(|l| l.value_heads),
            ShapeField::LinearKeyHeadDim => linear(|l| l.key_head_dim),
            ShapeField::LinearValueHeadDim => linear(|l| l.value_head_dim),
            ShapeField::LinearConvKernel => linear(|l| l.conv_kernel),
        }
    }

    /// The Hugging Face `config.json` of this description, as `xdna pack import` writes it
    /// (transformers 4 names; [`ModelConfig::from_json`] reads it back to an equal description).
    pub fn to_json(&self) -> Value {
        let mut c = json!({
            "architectures": [self.architecture()],
            "model_type": self.model_type,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        });
        let hybrid = self.is_hybrid();
        // Hybrids default to a quarter of each head rotated, so theirs is always written.
        if hybrid || self.rotary_dim != self.head_dim {
            c["partial_rotary_factor"] = json!(self.rotary_dim as f64 / self.head_dim as f64);
        }
        // Qwen2's q/k/v biases follow from its model_type; `attention_bias` adds o_proj's too.
        if self.o_bias {
            c["attention_bias"] = json!(true);
        }
        if self.mlp_bias {
            c["mlp_bias"] = json!(true);
        }
        match &self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                c["rope_scaling"] =
                    json!({"rope_type": "linear", "type": "linear", "factor": factor});
            }
            RopeScaling::FrequencyDivisors(divisors) => {
                c["rope_scaling"] =
                    json!({"rope_type": "frequency_divisors", "divisors": divisors});
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                c["rope_scaling"] = json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                });
            }
        }
        if hybrid {
            let types: Vec<&str> = self
                .layer_kinds
                .iter()
                .map(|k| match k {
                    LayerKind::Linear => "linear_attention",
                    LayerKind::Attention => "full_attention",
                })
                .collect();
            c["layer_types"] = json!(types);
            if let Some(every) = self.full_attention_interval() {
                c["full_attention_interval"] = json!(every);
            }
            c["attn_output_gate"] = json!(self.attn_output_gate);
            if let Some(lin) = &self.linear {
                c["linear_num_key_heads"] = json!(lin.key_heads);
                c["linear_num_value_heads"] = json!(lin.value_heads);
                c["linear_key_head_dim"] = json!(lin.key_head_dim);
                c["linear_value_head_dim"] = json!(lin.value_head_dim);
                c["linear_conv_kernel_dim"] = json!(lin.conv_kernel);
            }
            if !self.zero_centered_norms {
                c["xdna"] = json!({"norms_include_one": true});
            }
        }
        if let Some(d) = &self.dflash {
            c["dflash_config"] = json!({
                "block_size": d.block_size,
                "target_layer_ids": d.target_layers,
                "mask_token_id": d.mask_token_id,
            });
            if let Some(g) = &d.generation2 {
                c["dflash_config"]["conv_kernel_size"] = json!(g.conv_kernel);
                c["dflash_config"]["conv_group_size"] = json!(g.conv_group);
                c["dflash_config"]["selector_rank"] = json!(g.selector_rank);
                c["dflash_config"]["selector_top_k"] = json!(g.selector_top_k);
            }
            if d.causal {
                c["is_causal"] = json!(true);
            }
        }
        if let Some(bos) = self.bos_token_id {
            c["bos_token_id"] = json!(bos);
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => c["eos_token_id"] = json!(one),
            many => c["eos_token_id"] = json!(many),
        }
        c
    }

    /// The transformers class of this `model_type` (`architectures` in `config.json`).
    fn architecture(&self) -> &'static str {
        match self.model_type.as_str() {
            "mistral" => "MistralForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            "qwen3" => "Qwen3ForCausalLM",
            "smollm3" => "SmolLM3ForCausalLM",
            "qwen3_5" | "qwen3_5_text" => "Qwen3_5ForCausalLM",
            "qwen3_next" => "Qwen3NextForCausalLM",
            "dflash" => "DFlashDraftModel",
            _ => "LlamaForCausalLM",
        }
    }

    /// `n` when every `n`-th layer (1-based) is full attention and the rest Gated DeltaNet, as
    /// `full_attention_interval` says.
    fn full_attention_interval(&self) -> Option<usize> {
        let first = self
            .layer_kinds
            .iter()
            .position(|&k| k == LayerKind::Attention)?;
        let every = first + 1;
        let matches = self.layer_kinds.iter().enumerate().all(|(i, &k)| {
            let full = (i + 1).is_multiple_of(every);
            (k == LayerKind::Attention) == full
        });
        matches.then_some(every)
    }

    /// The GEMM shapes the fast forward of an attention-only (Llama-family) model runs, in every
    /// layer: fused QKV, O, fused gate+up and down in `body`, and the lm_head in `head`. The
    /// kernels layer turns them into one kernel per row family ([`crate::kernels::family_needs`]).
    pub fn kernel_shapes(&self, body: WeightFormat, head: WeightFormat) -> Vec<ShapeNeed> {
        let mut shapes = Vec::with_capacity(4 * self.layers + 1);
        for layer in 0..self.layers {
            for (what, k, n) in [
                ("qkv", self.hidden, self.qkv_rows()),
                ("o", self.q_dim(), self.hidden),
                ("gate+up", self.hidden, 2 * self.intermediate),
                ("down", self.intermediate, self.hidden),
            ] {
                shapes.push(ShapeNeed::gemm(body, k, n, format!("blk.{layer} {what}")));
            }
        }
        let what = if self.tie_word_embeddings {
            "lm_head (tied token_embd)"
        } else {
            "lm_head"
        };
        shapes.push(ShapeNeed::gemm(head, self.hidden, self.vocab, what));
        shapes
    }

    /// Inverse frequencies of the rotary embedding (`rotary_dim / 2` values), scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let half = self.rotary_dim / 2;
        (0..half)
            .map(|j| {
                let freq = 1.0
                    / self
                        .rope_theta
                        .powf((2 * j) as f64 / self.rotary_dim as f64);
                match &self.rope_scaling {
                    RopeScaling::None => freq,
                    RopeScaling::Linear { factor } => freq / factor,
                    // Checked at parse: one finite, positive divisor per pair.
                    RopeScaling::FrequencyDivisors(divisors) => {
                        freq / divisors.get(j).copied().unwrap_or(1.0)
                    }
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings: old,
                    } => {
                        let (factor, low_freq_factor, high_freq_factor, old) =
                            (*factor, *low_freq_factor, *high_freq_factor, *old);
                        let low_wavelen = old / low_freq_factor;
                        let high_wavelen = old / high_freq_factor;
                        let wavelen = 2.0 * std::f64::consts::PI / freq;
                        if wavelen < high_wavelen {
                            freq
                        } else if wavelen > low_wavelen {
                            freq / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * freq / factor + smooth * freq
                        }
                    }
                }
            })
            .collect()
    }
}

/// `layer_types` (or `full_attention_interval`) and the `linear_*` dimensions of a hybrid model.
fn parse_hybrid_layers(
    f: &Fields<'_>,
    layers: usize,
) -> Result<(Vec<LayerKind>, Option<LinearAttnConfig>), WeightsError> {
    let kinds = match f.v.get("layer_types") {
        Some(Value::Array(a)) => {
            if a.len() != layers {
                return Err(f.bad("layer_types", "one entry per hidden layer"));
            }
            a.iter()
                .map(|t| match t.as_str() {
                    Some("linear_attention") => Ok(LayerKind::Linear),
                    Some("full_attention") => Ok(LayerKind::Attention),
                    _ => Err(f.bad(
                        "layer_types",
                        "entries \"linear_attention\" or \"full_attention\"",
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        None | Some(Value::Null) => {
            let every = f.opt_usize("full_attention_interval")?.unwrap_or(4);
            if every == 0 {
                return Err(f.bad("full_attention_interval", "a positive integer"));
            }
            every_nth_layer_attention(layers, every)
        }
        Some(_) => return Err(f.bad("layer_types", "an array")),
    };
    let lin = LinearAttnConfig {
        key_heads: f.usize("linear_num_key_heads")?,
        value_heads: f.usize("linear_num_value_heads")?,
        key_head_dim: f.usize("linear_key_head_dim")?,
        value_head_dim: f.usize("linear_value_head_dim")?,
        conv_kernel: f.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
    };
    Ok((kinds, Some(lin)))
}

/// Every `every`-th layer (1-based) full attention, the rest Gated DeltaNet (as llama.cpp and
/// transformers read `full_attention_interval`).
fn every_nth_layer_attention(layers: usize, every: usize) -> Vec<LayerKind> {
    (0..layers)
        .map(|i| {
            if (i + 1) % every == 0 {
                LayerKind::Attention
            } else {
                LayerKind::Linear
            }
        })
        .collect()
}

/// Per-pair frequency divisors fit a rotary dimension: one per rotated pair, each finite and
/// positive (the problem, for the caller to name its source).
fn check_divisors(divisors: &[f64], rotary_dim: usize) -> Result<(), String> {
    if divisors.len() != rotary_dim / 2 {
        return Err(format!(
            "{} divisors for {} rotated pairs (rotary dimension {rotary_dim})",
            divisors.len(),
            rotary_dim / 2
        ));
    }
    match divisors
        .iter()
        .enumerate()
        .find(|(_, d)| !(d.is_finite() && **d > 0.0))
    {
        Some((i, d)) => Err(format!(
            "divisor {i} is {d}; divisors must be finite and positive"
        )),
        None => Ok(()),
    }
}

/// `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5): both carry `rope_type`
/// (or the older `type`) and the scaling fields.
fn parse_rope_scaling(f: &Fields<'_>) -> Result<RopeScaling, WeightsError> {
    let (kind, kind_field) = match f.opt_str("rope_type")? {
        Some(k) => (k, "rope_type"),
        None => (f.opt_str("type")?.unwrap_or("default"), "type"),
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: f.f64("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: f.f64("factor")?,
            low_freq_factor: f.f64("low_freq_factor")?,
            high_freq_factor: f.f64("high_freq_factor")?,
            original_max_position_embeddings: f.f64("original_max_position_embeddings")?,
        }),
        "frequency_divisors" => {
            let divisors = f
                .opt("divisors", "an array of numbers", |x| {
                    x.as_array()?
                        .iter()
                        .map(Value::as_f64)
                        .collect::<Option<Vec<f64>>>()
                })?
                .ok_or_else(|| f.missing("divisors"))?;
            Ok(RopeScaling::FrequencyDivisors(divisors))
        }
        other => Err(config_error(
            f.file,
            &f.name(kind_field),
            format!(
                "{other:?} is not supported (default, linear, llama3 and frequency_divisors are)"
            ),
        )),
    }
}

/// The shape rules' fields, named per source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ShapeField {
    Heads,
    Hidden,
    Intermediate,
    Layers,
    Vocab,
    KvHeads,
    HeadDim,
    RotaryDim,
    LinearKeyHeads,
    LinearValueHeads,
    LinearKeyHeadDim,
    LinearValueHeadDim,
    LinearConvKernel,
}

impl ShapeField {
    /// The `config.json` field.
    fn json_name(self) -> &'static str {
        match self {
            ShapeField::Heads => "num_attention_heads",
            ShapeField::Hidden => "hidden_size",
            ShapeField::Intermediate => "intermediate_size",
            ShapeField::Layers => "num_hidden_layers",
            ShapeField::Vocab => "vocab_size",
            ShapeField::KvHeads => "num_key_value_heads",
            ShapeField::HeadDim => "head_dim",
            ShapeField::RotaryDim => "partial_rotary_factor",
            ShapeField::LinearKeyHeads => "linear_num_key_heads",
            ShapeField::LinearValueHeads => "linear_num_value_heads",
            ShapeField::LinearKeyHeadDim => "linear_key_head_dim",
            ShapeField::LinearValueHeadDim => "linear_value_head_dim",
            ShapeField::LinearConvKernel => "linear_conv_kernel_dim",
        }
    }

    /// The GGUF metadata key (or tensor) the value came from.
    fn gguf_name(self, arch: &str) -> String {
        let key = match self {
            ShapeField::Vocab => return "token_embd.weight".to_string(),
            ShapeField::Hidden => "embedding_length",
            ShapeField::Intermediate => "feed_forward_length",
            ShapeField::Layers => "block_count",
            ShapeField::Heads => "attention.head_count",
            ShapeField::KvHeads => "attention.head_count_kv",
            ShapeField::HeadDim => "attention.key_length",
            ShapeField::RotaryDim => "rope.dimension_count",
            ShapeField::LinearKeyHeads => "ssm.group_count",
            ShapeField::LinearValueHeads => "ssm.time_step_rank",
            ShapeField::LinearKeyHeadDim => "ssm.state_size",
            ShapeField::LinearValueHeadDim => "ssm.inner_size",
            ShapeField::LinearConvKernel => "ssm.conv_kernel",
        };
        format!("{arch}.{key}")
    }
}

/// `general.architecture` of llama.cpp's DFlash drafts.
pub const DFLASH_ARCH: &str = "dflash";

/// The block, tap layers and mask token checked the same way whichever source they came from:
/// the first broken rule as (field, problem).
fn check_dflash(
    d: &DflashParams,
    vocab: usize,
    hidden: usize,
) -> Result<(), (&'static str, String)> {
    if !(2..=DFLASH_MAX_BLOCK).contains(&d.block_size) {
        return Err((
            "block_size",
            format!(
                "{} rows: a block holds the pending token and 1..={} mask rows (one verify pass)",
                d.block_size,
                DFLASH_MAX_BLOCK - 1
            ),
        ));
    }
    if d.target_layers.is_empty() {
        return Err((
            "target_layer_ids",
            "empty: no target hidden state to read".into(),
        ));
    }
    if let Some(g) = &d.generation2 {
        if g.conv_kernel == 0 {
            return Err(("conv_kernel_size", "0: expected at least 1".into()));
        }
        if g.conv_group == 0 || !hidden.is_multiple_of(g.conv_group) {
            return Err((
                "conv_group_size",
                format!(
                    "{}: expected a divisor of the hidden size {hidden}",
                    g.conv_group
                ),
            ));
        }
        if g.selector_rank == 0 {
            return Err(("selector_rank", "0: expected at least 1".into()));
        }
        if g.selector_top_k == 0 || g.selector_top_k > vocab {
            return Err((
                "selector_top_k",
                format!("{}: expected 1..={vocab}", g.selector_top_k),
            ));
        }
    }
    if d.mask_token_id as usize >= vocab {
        return Err((
            "mask_token_id",
            format!("{} is outside the vocabulary of {vocab}", d.mask_token_id),
        ));
    }
    Ok(())
}

/// `dflash_config` of a DFlash draft's `config.json` (z-lab's form; `block_size` may also sit at
/// the top level). Sliding-window drafts are refused: their attention is not implemented.
fn dflash_from_json(f: &Fields<'_>) -> Result<DflashParams, WeightsError> {
    let Some(dc) = f.v.get("dflash_config").filter(|v| v.is_object()) else {
        return Err(f.missing("dflash_config"));
    };
    let d = f.nested(dc, "dflash_config");
    if f.opt_bool("use_sliding_window")?.unwrap_or(false) || d.opt_bool("use_swa")?.unwrap_or(false)
    {
        return Err(config_error(
            f.file,
            "use_sliding_window",
            "sliding-window draft attention is not implemented (only full attention over the context)",
        ));
    }
    let block_size = match d.opt_usize("block_size")? {
        Some(b) => b,
        None => f.opt_usize("block_size")?.unwrap_or(16),
    };
    let target_layers = match dc.get("target_layer_ids") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_u64().map(|n| n as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| d.bad("target_layer_ids", "a list of layer ids"))?,
        _ => return Err(d.missing("target_layer_ids")),
    };
    let mask_token_id = d
        .token_ids("mask_token_id")?
        .first()
        .copied()
        .ok_or_else(|| d.missing("mask_token_id"))?;
    let causal = match f.opt_bool("is_causal")? {
        Some(c) => c,
        None => d.opt_bool("causal")?.unwrap_or(false),
    };
    let generation2 = match d.opt_usize("conv_kernel_size")? {
        None => None,
        Some(conv_kernel) => {
            let need = |field: &str| d.opt_usize(field)?.ok_or_else(|| d.missing(field));
            Some(Dflash2Params {
                conv_kernel,
                conv_group: need("conv_group_size")?,
                selector_rank: need("selector_rank")?,
                selector_top_k: need("selector_top_k")?,
            })
        }
    };
    let params = DflashParams {
        block_size,
        target_layers,
        mask_token_id,
        causal,
        generation2,
    };
    check_dflash(&params, f.usize("vocab_size")?, f.usize("hidden_size")?).map_err(
        |(field, problem)| config_error(f.file, &format!("dflash_config.{field}"), problem),
    )?;
    Ok(params)
}

/// A `dflash` GGUF (llama.cpp's converter, `DFlashModel`): Qwen3-style layers under `dflash.*`,
/// the block size, the target's hidden-state indices, the mask token. What this runtime does not
/// read is refused by name: DSpark heads, a reduced
/// draft vocabulary, the draft's own embedding table, sliding-window attention, logit or
/// embedding scales.
fn dflash_from_gguf(f: &GgufFile) -> Result<ModelConfig, WeightsError> {
    let arch = DFLASH_ARCH;
    let k = |s: &str| format!("{arch}.{s}");
    let refuse = |field: &str, problem: &str| config_error(f.path(), field, problem);
    for (key, what) in [
        (
            "attention.sliding_window",
            "sliding-window draft attention is not implemented",
        ),
        (
            "embedding_scale",
            "an embedding scale is not implemented for DFlash drafts",
        ),
        (
            "logit_scale",
            "a logit scale is not implemented for DFlash drafts",
        ),
        (
            "final_logit_softcapping",
            "logit soft-capping is not implemented for DFlash drafts",
        ),
        (
            "attention.scale",
            "a custom attention scale is not implemented for DFlash drafts",
        ),
        (
            "attention.value_scale",
            "an attention value scale is not implemented for DFlash drafts",
        ),
        (
            "hyper_connection_count",
            "DSpark DeepSeek-V4 drafts are not read",
        ),
    ] {
        let set = f
            .metadata(&k(key))
            .is_some_and(|v| v.as_f64().is_none_or(|x| x != 0.0));
        if set {
            return Err(refuse(&k(key), what));
        }
    }
    for (tensor, what) in [
        (
            "markov_w1.weight",
            "DSpark drafts (Markov head) are not read",
        ),
        ("d2t", "a reduced draft vocabulary (d2t) is not read"),
        (
            "token_embd.weight",
            "a draft with its own embedding table is not read (DFlash drafts share the target's)",
        ),
        (
            "output.weight",
            "a draft with its own output head is not read (DFlash drafts share the target's)",
        ),
    ] {
        if f.tensor(tensor).is_some() {
            return Err(refuse(tensor, what));
        }
    }
    let (hidden, heads, kv_heads, head_dim) = attention_dims_from_gguf(f, arch)?;
    let layers = f.require_u64(&k("block_count"))? as usize;
    if layers == 0 || layers > MAX_LAYERS {
        return Err(refuse(&k("block_count"), MAX_LAYERS_EXPECTED));
    }
    let vocab = f
        .get_array("tokenizer.ggml.tokens")
        .map(<[GgufValue]>::len)
        .ok_or_else(|| {
            refuse(
                "tokenizer.ggml.tokens",
                "missing (the vocabulary size is read from it)",
            )
        })?;
    let target_layers = f
        .get_array(&k("target_layers"))
        .ok_or_else(|| refuse(&k("target_layers"), "missing"))?
        .iter()
        .map(|v| match v.as_u64() {
            // Hidden-state indices: 0 is the embedding output, which no layer produces.
            Some(i) if i >= 1 => Ok(i as usize - 1),
            _ => Err(refuse(
                &k("target_layers"),
                "expected hidden-state indices of at least 1 (layer id + 1)",
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mask_token_id = f.get_u32("tokenizer.ggml.mask_token_id").ok_or_else(|| {
        refuse(
            "tokenizer.ggml.mask_token_id",
            "missing (the block's mask rows are this token)",
        )
    })?;
    // Generation 2: llama.cpp takes the selector tensor as the sign, then requires every key.
    let generation2 = if f.tensor("selector_hidden.weight").is_some()
        || f.metadata(&k("conv_kernel_size")).is_some()
    {
        let need =
            |key: &str| -> Result<usize, WeightsError> { Ok(f.require_u64(&k(key))? as usize) };
        Some(Dflash2Params {
            conv_kernel: need("conv_kernel_size")?,
            conv_group: need("conv_group_size")?,
            selector_rank: need("selector_rank")?,
            selector_top_k: need("selector_top_k")?,
        })
    } else {
        None
    };
    let params = DflashParams {
        block_size: f.get_u64(&k("block_size")).unwrap_or(16) as usize,
        target_layers,
        mask_token_id,
        causal: f.get_bool(&k("attention.causal")).unwrap_or(false),
        generation2,
    };
    check_dflash(&params, vocab, hidden).map_err(|(field, problem)| {
        let key = match field {
            "mask_token_id" => "tokenizer.ggml.mask_token_id".to_string(),
            "target_layer_ids" => k("target_layers"),
            other => k(other),
        };
        refuse(&key, &problem)
    })?;
    Ok(ModelConfig {
        model_type: arch.to_string(),
        hidden,
        intermediate: f.require_u64(&k("feed_forward_length"))? as usize,
        layers,
        heads,
        kv_heads,
        head_dim,
        rms_eps: shortest(f.require_f64(&k("attention.layer_norm_rms_epsilon"))?),
        rope_theta: f
            .get_f64(&k("rope.freq_base"))
            .map(shortest)
            .unwrap_or(10_000.0),
        rope_scaling: RopeScaling::None,
        vocab,
        tie_word_embeddings: true,
        max_position_embeddings: f.get_u64(&k("context_length")).unwrap_or(4096) as usize,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: true,
        layer_kinds: vec![LayerKind::Attention; layers],
        linear: None,
        attn_output_gate: false,
        rotary_dim: f
            .get_u64(&k("rope.dimension_count"))
            .unwrap_or(head_dim as u64) as usize,
        zero_centered_norms: false,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        dflash: Some(params),
    })
}

fn config_error(file: &Path, field: &str, problem: impl Into<String>) -> WeightsError {
    WeightsError::Config {
        path: file.to_path_buf(),
        field: field.to_string(),
        problem: problem.into(),
    }
}

/// An f32 metadata value as the f64 with the same shortest decimal form (1e-5, not
/// 9.999999747378752e-6), as HF configs write it.
pub(super) fn shortest(v: f64) -> f64 {
    format!("{}", v as f32).parse().unwrap_or(v)
}

/// Hidden size, heads, KV heads and head dimension of a GGUF's attention (`<arch>.*` keys; KV
/// heads default to the heads, the head dimension to hidden / heads).
fn attention_dims_from_gguf(
    f: &GgufFile,
    arch: &str,
) -> Result<(usize, usize, usize, usize), WeightsError> {
    let k = |s: &str| format!("{arch}.{s}");
    let hidden = f.require_u64(&k("embedding_length"))? as usize;
    let heads = f.require_u64(&k("attention.head_count"))? as usize;
    if hidden == 0 || heads == 0 {
        return Err(config_error(
            f.path(),
            &k("embedding_length"),
            "zero embedding_length or head_count",
        ));
    }
    let kv_heads = f
        .get_u64(&k("attention.head_count_kv"))
        .unwrap_or(heads as u64) as usize;
    let head_dim = f
        .get_u64(&k("attention.key_length"))
        .unwrap_or((hidden / heads) as u64) as usize;
    Ok((hidden, heads, kv_heads, head_dim))
}

/// A llama, qwen2 or qwen3 GGUF (attention layers only).
fn attention_only_from_gguf(f: &GgufFile, arch: &str) -> Result<ModelConfig, WeightsError> {
    let k = |s: &str| format!("{arch}.{s}");
    let (hidden, heads, kv_heads, head_dim) = attention_dims_from_gguf(f, arch)?;
    let embd = f.require_tensor("token_embd.weight")?;
    let rope_scaling = match f.get_str(&k("rope.scaling.type")) {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear {
            factor: f.require_f64(&k("rope.scaling.factor"))?,
        },
        Some(other) => {
            return Err(config_error(
                f.path(),
                &k("rope.scaling.type"),
                format!("{other:?} is not supported (none and linear are)"),
            ))
        }
    };
    // llama.cpp's converter writes Llama 3.1's rope scaling as one frequency divisor per rotated
    // pair in this tensor, with no scaling key; llama.cpp reads it for llama only.
    let rope_scaling = match f.tensor("rope_freqs.weight") {
        None => rope_scaling,
        Some(t) => {
            let bad = |what: String| config_error(f.path(), "rope_freqs.weight", what);
            if arch != "llama" {
                return Err(bad(format!(
                    "per-pair RoPE frequency divisors are read for llama files only, not {arch}"
                )));
            }
            if rope_scaling != RopeScaling::None {
                return Err(bad(format!(
                    "both this tensor and {} are set; llama.cpp would apply both",
                    k("rope.scaling.type")
                )));
            }
            let divisors: Vec<f64> = t
                .decode_f32()
                .map_err(|e| bad(format!("cannot be read: {e}")))?
                .into_iter()
                .map(f64::from)
                .collect();
            check_divisors(&divisors, head_dim).map_err(bad)?;
            RopeScaling::FrequencyDivisors(divisors)
        }
    };
    let layers = f.require_u64(&k("block_count"))?;
    let layers = usize::try_from(layers)
        .ok()
        .filter(|&l| l <= MAX_LAYERS)
        .ok_or_else(|| {
            config_error(
                f.path(),
                &k("block_count"),
                format!("expected {MAX_LAYERS_EXPECTED}, got {layers}"),
            )
        })?;
    Ok(ModelConfig {
        model_type: arch.to_string(),
        hidden,
        intermediate: f.require_u64(&k("feed_forward_length"))? as usize,
        layers,
        heads,
        kv_heads,
        head_dim,
        rms_eps: f
            .get_f64(&k("attention.layer_norm_rms_epsilon"))
            .map(shortest)
            .unwrap_or(1e-5),
        rope_theta: f
            .get_f64(&k("rope.freq_base"))
            .map(shortest)
            .unwrap_or(10000.0),
        rope_scaling,
        vocab: embd.shape.get(1).copied().unwrap_or(0) as usize,
        tie_word_embeddings: f.tensor("output.weight").is_none(),
        max_position_embeddings: f.get_u64(&k("context_length")).unwrap_or(2048) as usize,
        qkv_bias: arch == "qwen2",
        o_bias: false,
        mlp_bias: false,
        qk_norm: arch == "qwen3",
        layer_kinds: vec![LayerKind::Attention; layers],
        linear: None,
        attn_output_gate: false,
        rotary_dim: head_dim,
        zero_centered_norms: false,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        dflash: None,
    })
}

/// A `qwen35` GGUF (llama.cpp's dense Qwen3.5): Gated DeltaNet layers and gated full attention.
/// Its norms already hold `1 + w` (llama.cpp's converter added the 1), so they are not
/// zero-centred.
fn qwen35_from_gguf(f: &GgufFile) -> Result<ModelConfig, WeightsError> {
    let arch = super::import_qwen35::ARCH;
    let k = |s: &str| format!("{arch}.{s}");
    let req = |s: &str| -> Result<usize, WeightsError> { Ok(f.require_u64(&k(s))? as usize) };
    let bad = |key: &str, what: String| config_error(f.path(), key, what);
    if f.get_u64(&k("expert_count")).is_some_and(|n| n > 0) {
        return Err(bad(
            &k("expert_count"),
            "mixture-of-experts layers are not supported".into(),
        ));
    }
    if let Some(kind) = f.get_str(&k("rope.scaling.type")) {
        if kind != "none" {
            return Err(bad(
                &k("rope.scaling.type"),
                format!("{kind:?}: rope scaling is not supported for qwen35"),
            ));
        }
    }
    let (hidden, heads, kv_heads, head_dim) = attention_dims_from_gguf(f, arch)?;
    if let Some(v) = f.get_u64(&k("attention.value_length")) {
        if v as usize != head_dim {
            return Err(bad(
                &k("attention.value_length"),
                format!("{v} ≠ key_length {head_dim} (llama.cpp requires them equal)"),
            ));
        }
    }
    let blocks = req("block_count")?;
    if blocks > MAX_LAYERS {
        return Err(bad(
            &k("block_count"),
            format!("expected {MAX_LAYERS_EXPECTED}, got {blocks}"),
        ));
    }
    let nextn = f.get_u64(&k("nextn_predict_layers")).unwrap_or(0) as usize;
    let layers = blocks
        .checked_sub(nextn)
        .filter(|&l| l > 0)
        .ok_or_else(|| {
            bad(
                &k("block_count"),
                format!("{blocks} blocks with {nextn} MTP layers leave no decoder layer"),
            )
        })?;
    // The file's own per-layer flags win; without them, llama.cpp's qwen35 rule: every
    // `full_attention_interval`-th layer (default 4) is full attention.
    let layer_kinds = match f.metadata(&k("attention.recurrent_layers")) {
        Some(flags) => recurrent_layer_flags(flags, blocks, layers)
            .map_err(|problem| bad(&k("attention.recurrent_layers"), problem))?,
        None => {
            let interval = f.get_u64(&k("full_attention_interval")).unwrap_or(4).max(1);
            every_nth_layer_attention(layers, interval as usize)
        }
    };
    let value_heads = req("ssm.time_step_rank")?;
    let key_heads = req("ssm.group_count")?;
    let inner = req("ssm.inner_size")?;
    if key_heads == 0 || value_heads == 0 || value_heads % key_heads != 0 {
        return Err(bad(
            &k("ssm.time_step_rank"),
            format!("{value_heads} value heads are not a multiple of {key_heads} key heads"),
        ));
    }
    if inner == 0 || inner % value_heads != 0 {
        return Err(bad(
            &k("ssm.inner_size"),
            format!("{inner} does not split into {value_heads} value heads"),
        ));
    }
    let embd = f.require_tensor("token_embd.weight")?;
    Ok(ModelConfig {
        model_type: "qwen3_5".to_string(),
        hidden,
        intermediate: req("feed_forward_length")?,
        layers,
        heads,
        kv_heads,
        head_dim,
        // Required by llama.cpp's qwen35 loader too.
        rms_eps: shortest(f.require_f64(&k("attention.layer_norm_rms_epsilon"))?),
        // llama.cpp's default when absent.
        rope_theta: f
            .get_f64(&k("rope.freq_base"))
            .map(shortest)
            .unwrap_or(10_000.0),
        rope_scaling: RopeScaling::None,
        vocab: embd.shape.get(1).copied().unwrap_or(0) as usize,
        tie_word_embeddings: f.tensor("output.weight").is_none(),
        max_position_embeddings: f.get_u64(&k("context_length")).unwrap_or(4096) as usize,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: true,
        layer_kinds,
        linear: Some(LinearAttnConfig {
            key_heads,
            value_heads,
            key_head_dim: req("ssm.state_size")?,
            value_head_dim: inner / value_heads,
            conv_kernel: req("ssm.conv_kernel")?,
        }),
        attn_output_gate: true,
        rotary_dim: f
            .get_u64(&k("rope.dimension_count"))
            .unwrap_or(head_dim as u64) as usize,
        zero_centered_norms: false,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        dflash: None,
    })
}

/// The layer kinds a hybrid GGUF's `attention.recurrent_layers` states: one flag per block
/// (`block_count` of them, trailing MTP blocks included), true (or a non-zero integer) for a
/// recurrent layer; the first `layers` are the decoder's. A single flag applies to every layer.
fn recurrent_layer_flags(
    flags: &GgufValue,
    blocks: usize,
    layers: usize,
) -> Result<Vec<LayerKind>, String> {
    let kind = |recurrent: bool| {
        if recurrent {
            LayerKind::Linear
        } else {
            LayerKind::Attention
        }
    };
    match flags {
        GgufValue::Array(items) => {
            if items.len() != blocks {
                return Err(format!(
                    "{} flags for {blocks} blocks (block_count)",
                    items.len()
                ));
            }
            items[..layers]
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_bool()
                        .map(kind)
                        .ok_or_else(|| format!("flag {i} is {v:?}, not a boolean or an integer"))
                })
                .collect()
        }
        single => single
            .as_bool()
            .map(|recurrent| vec![kind(recurrent); layers])
            .ok_or_else(|| format!("{single:?} is not a boolean, an integer or an array of them")),
    }
}

/// The most decoder layers a description may state (the largest published models have under
/// 200): the layer list is allocated from this number before any weight is read.
const MAX_LAYERS: usize = 1024;
const MAX_LAYERS_EXPECTED: &str = "at most 1024 layers";

/// Typed access to one JSON object of a `config.json` (the top level or a nested object such as
/// `rope_parameters`, whose fields errors name as `rope_parameters.factor`).
struct Fields<'a> {
    v: &'a Value,
    file: &'a Path,
    /// The nested object's name, empty at the top level.
    prefix: &'static str,
}

impl<'a> Fields<'a> {
    fn top(v: &'a Value, file: &'a Path) -> Self {
        Fields {
            v,
            file,
            prefix: "",
        }
    }
    fn nested(&self, v: &'a Value, prefix: &'static str) -> Fields<'a> {
        Fields {
            v,
            file: self.file,
            prefix,
        }
    }
    fn name(&self, field: &str) -> String {
        if self.prefix.is_empty() {
            field.to_string()
        } else {
            format!("{}.{field}", self.prefix)
        }
    }
    fn bad(&self, field: &str, expected: &str) -> WeightsError {
        config_error(
            self.file,
            &self.name(field),
            format!(
                "expected {expected}, got {}",
                self.v.get(field).unwrap_or(&Value::Null)
            ),
        )
    }
    fn missing(&self, field: &str) -> WeightsError {
        config_error(self.file, &self.name(field), "missing")
    }
    /// `field` read by `read` (absent or null: `None`); a value `read` refuses is an error saying
    /// what was `expected`.
    fn opt<T>(
        &self,
        field: &str,
        expected: &str,
        read: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<Option<T>, WeightsError> {
        match self.v.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => read(x).map(Some).ok_or_else(|| self.bad(field, expected)),
        }
    }
    fn opt_usize(&self, field: &str) -> Result<Option<usize>, WeightsError> {
        self.opt(field, "a non-negative integer", |x| {
            x.as_u64().map(|n| n as usize)
        })
    }
    fn usize(&self, field: &str) -> Result<usize, WeightsError> {
        self.opt_usize(field)?.ok_or_else(|| self.missing(field))
    }
    fn opt_f64(&self, field: &str) -> Result<Option<f64>, WeightsError> {
        self.opt(field, "a number", Value::as_f64)
    }
    fn f64(&self, field: &str) -> Result<f64, WeightsError> {
        self.opt_f64(field)?.ok_or_else(|| self.missing(field))
    }
    fn opt_bool(&self, field: &str) -> Result<Option<bool>, WeightsError> {
        self.opt(field, "true or false", Value::as_bool)
    }
    fn opt_str(&self, field: &str) -> Result<Option<&'a str>, WeightsError> {
        self.opt(field, "a string", Value::as_str)
    }
    /// A token id or a list of them (`eos_token_id`); empty when absent.
    fn token_ids(&self, field: &str) -> Result<Vec<u32>, WeightsError> {
        let id = |x: &Value| x.as_u64().and_then(|n| u32::try_from(n).ok());
        let ids = match self.v.get(field) {
            None | Some(Value::Null) => Some(Vec::new()),
            Some(Value::Array(a)) => a.iter().map(id).collect(),
            Some(x) => id(x).map(|n| vec![n]),
        };
        ids.ok_or_else(|| self.bad(field, "a token id or a list of token ids"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn smollm2() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0, "vocab_size": 49152, "tie_word_embeddings": true,
            "max_position_embeddings": 8192, "rope_scaling": null
        })
    }

    /// A z-lab DFlash draft config (generation 1) for SmolLM2's width and vocabulary.
    fn dflash_draft() -> Value {
        json!({
            "architectures": ["DFlashDraftModel"], "model_type": "dflash",
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2,
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
            "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "vocab_size": 49152,
            "dflash_config": {"block_size": 16, "target_layer_ids": [1, 10, 19, 28], "mask_token_id": 16}
        })
    }

    #[test]
    fn dflash_config_reads_and_round_trips() {
        let c = ModelConfig::from_json(&dflash_draft(), "config.json").unwrap();
        let d = c.dflash.clone().unwrap();
        assert_eq!((d.block_size, d.mask_token_id, d.causal), (16, 16, false));
        assert_eq!(d.target_layers, vec![1, 10, 19, 28]);
        assert!(c.qk_norm && !c.qkv_bias);
        assert_eq!(ModelConfig::from_json(&c.to_json(), "x").unwrap(), c);
    }

    #[test]
    fn dflash_config_refusals_name_the_field() {
        let refused = |edit: &dyn Fn(&mut Value)| {
            let mut v = dflash_draft();
            edit(&mut v);
            ModelConfig::from_json(&v, "config.json")
                .unwrap_err()
                .to_string()
        };
        let e = refused(&|v| v["dflash_config"]["block_size"] = json!(17));
        assert!(e.contains("dflash_config.block_size"), "{e}");
        let e = refused(&|v| v["dflash_config"]["mask_token_id"] = json!(49152));
        assert!(e.contains("dflash_config.mask_token_id"), "{e}");
        let e = refused(&|v| v["dflash_config"]["target_layer_ids"] = json!([]));
        assert!(e.contains("target_layer_ids"), "{e}");
        let e = refused(&|v| v["use_sliding_window"] = json!(true));
        assert!(e.contains("use_sliding_window"), "{e}");
        let e = refused(&|v| {
            v.as_object_mut().unwrap().remove("dflash_config");
        });
        assert!(e.contains("dflash_config") && e.contains("missing"), "{e}");
    }

    #[test]
    fn smollm2_fields() {
        let c = ModelConfig::from_json(&smollm2(), "config.json").unwrap();
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.qkv_rows(), 960);
        assert_eq!(c.kv_dim(), 192);
        assert!(c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
        let f = c.rope_inv_freq();
        assert_eq!(f.len(), 32);
        assert_eq!(f[0], 1.0);
        // theta^(-2/64) for j = 1
        assert!((f[1] - 100000f64.powf(-2.0 / 64.0)).abs() < 1e-15);
    }

    #[test]
    fn missing_and_bad_fields_are_named() {
        let mut v = smollm2();
        v.as_object_mut().unwrap().remove("hidden_size");
        let e = ModelConfig::from_json(&v, "x/config.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("hidden_size") && e.contains("x/config.json"),
            "{e}"
        );
        let mut v = smollm2();
        v["num_key_value_heads"] = json!(4);
        let e = ModelConfig::from_json(&v, "c.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
        let mut v = smollm2();
        v["rope_theta"] = json!("big");
        assert!(ModelConfig::from_json(&v, "c.json").is_err());
    }

    #[test]
    fn llama3_scaling_matches_hand_values() {
        let mut v = smollm2();
        v["rope_theta"] = json!(500000.0);
        v["head_dim"] = json!(64);
        v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = ModelConfig::from_json(&v, "c.json").unwrap();
        let f = c.rope_inv_freq();
        // High frequency (wavelength 2π < 2048): unchanged.
        assert_eq!(f[0], 1.0);
        // Lowest frequency: wavelength 2π·500000^(62/64) ≫ 8192 → divided by 8.
        let raw = 500000f64.powf(-62.0 / 64.0);
        assert!((f[31] - raw / 8.0).abs() < 1e-18);
        // A middle one is between raw/8 and raw.
        let j = 20;
        let raw = 500000f64.powf(-((2 * j) as f64) / 64.0);
        let wl = 2.0 * std::f64::consts::PI / raw;
        if wl > 2048.0 && wl < 8192.0 {
            assert!(f[j] < raw && f[j] > raw / 8.0);
        }
    }

    #[test]
    fn qwen_flags() {
        let mut v = smollm2();
        v["model_type"] = json!("qwen2");
        assert!(ModelConfig::from_json(&v, "c").unwrap().qkv_bias);
        v["model_type"] = json!("qwen3");
        let c = ModelConfig::from_json(&v, "c").unwrap();
        assert!(c.qk_norm && !c.qkv_bias);
        v["model_type"] = json!("gpt2");
        assert!(ModelConfig::from_json(&v, "c").is_err());
    }
}
