//! Model configuration: the Llama-family fields of a Hugging Face `config.json`.
//!
//! Supported families: Llama (SmolLM2, Llama 3.x with `rope_scaling.rope_type = "llama3"`),
//! Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q_norm / k_norm). Every missing or ill-typed field is
//! a typed error naming the field and the file it was read from.

use crate::model::ModelError;
use serde_json::Value;

/// How rotary frequencies are scaled for long contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// `"linear"`: positions divided by `factor` (all frequencies divided by `factor`).
    Linear { factor: f64 },
    /// `"llama3"`: Llama 3.1 frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// The transformer's shape and numerical constants.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `model_type` (e.g. `llama`, `qwen2`, `qwen3`).
    pub model_type: String,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub vocab: usize,
    pub tie_word_embeddings: bool,
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
}

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
    pub fn key_dim(&self) -> usize {
        self.key_heads * self.key_head_dim
    }
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

    /// Parse a `config.json` value; `file` names the source in errors.
    pub fn from_json(v: &Value, file: &str) -> Result<Self, ModelError> {
        let f = Fields { v, file };
        let model_type = f.opt_str("model_type")?.unwrap_or("llama").to_string();
        let known = [
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
        ];
        if !known.contains(&model_type.as_str()) {
            return Err(ModelError::Unsupported {
                what: format!("model_type {model_type:?} in {file} (supported: {known:?})"),
            });
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
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(f.bad("num_key_value_heads", "a divisor of num_attention_heads"));
        }
        if head_dim % 2 != 0 || head_dim == 0 {
            return Err(f.bad("head_dim", "an even, non-zero number"));
        }
        let rope_scaling = match v.get("rope_scaling") {
            None | Some(Value::Null) => RopeScaling::None,
            Some(s) => parse_rope_scaling(s, file)?,
        };
        let is_qwen2 = model_type == "qwen2";
        let hybrid = matches!(
            model_type.as_str(),
            "qwen3_5" | "qwen3_5_text" | "qwen3_next"
        );
        let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(false);
        let layers = f.usize("num_hidden_layers")?;
        let (layer_kinds, linear) = if hybrid {
            parse_hybrid_layers(&f, layers)?
        } else {
            (vec![LayerKind::Attention; layers], None)
        };
        // Qwen3.5 nests rope fields in `rope_parameters`; Qwen3-Next has them at the top level.
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let partial = match f.opt_f64("partial_rotary_factor")? {
            Some(p) => p,
            None => match rope_params {
                Some(p) => Fields { v: p, file }
                    .opt_f64("partial_rotary_factor")?
                    .unwrap_or(1.0),
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
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
            return Err(f.bad(
                "partial_rotary_factor",
                "a factor giving an even, non-zero number of rotated dimensions",
            ));
        }
        let rope_theta = match f.opt_f64("rope_theta")? {
            Some(t) => t,
            None => match rope_params {
                Some(p) => Fields { v: p, file }
                    .opt_f64("rope_theta")?
                    .unwrap_or(10000.0),
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
            qk_norm: model_type == "qwen3" || hybrid,
            layer_kinds,
            linear,
            attn_output_gate: hybrid && f.opt_bool("attn_output_gate")?.unwrap_or(true),
            rotary_dim,
            zero_centered_norms: hybrid
                && !v
                    .pointer("/xdna/norms_include_one")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            model_type,
        };
        for (name, val) in [
            ("hidden_size", cfg.hidden),
            ("intermediate_size", cfg.intermediate),
            ("num_hidden_layers", cfg.layers),
            ("vocab_size", cfg.vocab),
        ] {
            if val == 0 {
                return Err(f.bad(name, "a positive integer"));
            }
        }
        Ok(cfg)
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
                match self.rope_scaling {
                    RopeScaling::None => freq,
                    RopeScaling::Linear { factor } => freq / factor,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings: old,
                    } => {
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
) -> Result<(Vec<LayerKind>, Option<LinearAttnConfig>), ModelError> {
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
        Some(_) => return Err(f.bad("layer_types", "an array")),
    };
    let lin = LinearAttnConfig {
        key_heads: f.usize("linear_num_key_heads")?,
        value_heads: f.usize("linear_num_value_heads")?,
        key_head_dim: f.usize("linear_key_head_dim")?,
        value_head_dim: f.usize("linear_value_head_dim")?,
        conv_kernel: f.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
    };
    for (name, val) in [
        ("linear_num_key_heads", lin.key_heads),
        ("linear_num_value_heads", lin.value_heads),
        ("linear_key_head_dim", lin.key_head_dim),
        ("linear_value_head_dim", lin.value_head_dim),
    ] {
        if val == 0 {
            return Err(f.bad(name, "a positive integer"));
        }
    }
    if !lin.value_heads.is_multiple_of(lin.key_heads) {
        return Err(f.bad(
            "linear_num_value_heads",
            "a multiple of linear_num_key_heads",
        ));
    }
    if lin.conv_kernel < 2 {
        return Err(f.bad("linear_conv_kernel_dim", "at least 2"));
    }
    Ok((kinds, Some(lin)))
}

fn parse_rope_scaling(s: &Value, file: &str) -> Result<RopeScaling, ModelError> {
    let f = Fields { v: s, file };
    let kind = match f.opt_str("rope_type")? {
        Some(k) => k,
        None => f.opt_str("type")?.unwrap_or("default"),
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
        other => Err(ModelError::Unsupported {
            what: format!("rope_scaling type {other:?} in {file}"),
        }),
    }
}

struct Fields<'a> {
    v: &'a Value,
    file: &'a str,
}

impl Fields<'_> {
    fn bad(&self, field: &str, expected: &str) -> ModelError {
        ModelError::Config {
            file: self.file.to_string(),
            field: field.to_string(),
            problem: format!(
                "expected {expected}, got {}",
                self.v.get(field).unwrap_or(&Value::Null)
            ),
        }
    }
    fn missing(&self, field: &str) -> ModelError {
        ModelError::Config {
            file: self.file.to_string(),
            field: field.to_string(),
            problem: "missing".to_string(),
        }
    }
    fn opt_usize(&self, field: &str) -> Result<Option<usize>, ModelError> {
        match self.v.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.bad(field, "a non-negative integer")),
        }
    }
    fn usize(&self, field: &str) -> Result<usize, ModelError> {
        self.opt_usize(field)?.ok_or_else(|| self.missing(field))
    }
    fn opt_f64(&self, field: &str) -> Result<Option<f64>, ModelError> {
        match self.v.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.bad(field, "a number")),
        }
    }
    fn f64(&self, field: &str) -> Result<f64, ModelError> {
        self.opt_f64(field)?.ok_or_else(|| self.missing(field))
    }
    fn opt_bool(&self, field: &str) -> Result<Option<bool>, ModelError> {
        match self.v.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.bad(field, "true or false")),
        }
    }
    fn opt_str(&self, field: &str) -> Result<Option<&str>, ModelError> {
        match self.v.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_str()
                .map(Some)
                .ok_or_else(|| self.bad(field, "a string")),
        }
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
