//! A `config.json`-shaped value from GGUF metadata (llama-family keys), so GGUF files and packages
//! share one validation path ([`ModelConfig::from_json`]).

use super::config::ModelConfig;
use super::gguf_lite::{GgufLite, Meta};
use super::ModelError;
use serde_json::{json, Value};

/// Build the HF-style config of a llama-family GGUF.
pub fn config_value(g: &GgufLite) -> Result<Value, ModelError> {
    let file = g.path.display().to_string();
    let arch = g
        .meta_str("general.architecture")
        .unwrap_or("llama")
        .to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let int = |k: &str| -> Result<i64, ModelError> {
        g.meta
            .get(&key(k))
            .and_then(Meta::as_i64)
            .ok_or_else(|| ModelError::Config {
                file: file.clone(),
                field: key(k),
                problem: "missing or not an integer".into(),
            })
    };
    let float = |k: &str| g.meta.get(&key(k)).and_then(Meta::as_f64);
    let hidden = int("embedding_length")?;
    let heads = int("attention.head_count")?;
    let embd = g.info("token_embd.weight")?;
    let vocab = g
        .meta
        .get(&key("vocab_size"))
        .and_then(Meta::as_i64)
        .unwrap_or(embd.rows() as i64);
    let model_type = match arch.as_str() {
        "llama" => "llama",
        "qwen2" => "qwen2",
        "qwen3" => "qwen3",
        other => {
            return Err(ModelError::Unsupported {
                what: format!("GGUF architecture {other:?} in {file}"),
            })
        }
    };
    let mut v = json!({
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int("feed_forward_length")?,
        "num_hidden_layers": int("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": g.meta.get(&key("attention.head_count_kv")).and_then(Meta::as_i64).unwrap_or(heads),
        "rms_norm_eps": float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        "rope_theta": float("rope.freq_base").unwrap_or(10000.0),
        "vocab_size": vocab,
        "tie_word_embeddings": !g.tensors.contains_key("output.weight"),
        "max_position_embeddings": g.meta.get(&key("context_length")).and_then(Meta::as_i64).unwrap_or(2048),
    });
    if let Some(hd) = g
        .meta
        .get(&key("attention.key_length"))
        .and_then(Meta::as_i64)
    {
        v["head_dim"] = json!(hd);
    }
    Ok(v)
}

/// The validated config of a GGUF file.
pub fn config(g: &GgufLite) -> Result<ModelConfig, ModelError> {
    ModelConfig::from_json(&config_value(g)?, &g.path.display().to_string())
}
