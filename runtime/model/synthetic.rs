//! Synthetic packages: deterministic small random-weight packages in the hybrid (Qwen3.5) or
//! Llama layout, for tests and benches (`xdna pack synth`), and the kernel shapes they need.

use super::ModelError;
use crate::kernels::{KernelKey, RowFamily};
use crate::tiles::{self, ScaleType, TileOrder, WeightFormat};
use crate::weights::safetensors::{Declared, Dtype, Writer};
use crate::weights::{LayerKind, ModelConfig};
use std::collections::BTreeMap;
use std::path::Path;

/// The tiled GEMM shapes (`K`, `N`) of a hybrid config whose matrices are written by
/// [`write_synthetic`] (tiled when rows are a multiple of 32), for its kernel set.
pub fn synthetic_kernel_keys(c: &ModelConfig, f: WeightFormat) -> Vec<KernelKey> {
    let h = c.hidden;
    let mut shapes = vec![(h, c.vocab), (h, 2 * c.intermediate), (c.intermediate, h)];
    if let Some(d) = &c.linear {
        shapes.push((h, d.conv_dim() + d.value_dim()));
        shapes.push((d.value_dim(), h));
        if d.value_heads % tiles::TILE_ROWS == 0 {
            shapes.push((h, 2 * d.value_heads));
        }
    }
    shapes.push((h, c.qkv_rows()));
    shapes.push((c.q_dim(), h));
    let mut keys: Vec<KernelKey> = RowFamily::ALL
        .into_iter()
        .flat_map(|fam| {
            shapes
                .iter()
                .map(move |&(k, n)| KernelKey::gemm(f, fam, k, n))
        })
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// Architecture of a synthetic package.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthArch {
    /// Hybrid: Gated DeltaNet layers + gated full attention (q/k norm, partial rotary).
    Qwen35,
    /// Plain Llama (attention only).
    Llama,
}

/// Shape and seed of a synthetic package (defaults: a 6-layer hybrid, 2 attention layers).
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// Hybrid or Llama.
    pub arch: SynthArch,
    /// Decoder layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Feed-forward intermediate size.
    pub intermediate: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Attention head dimension.
    pub head_dim: usize,
    /// Vocabulary size (≥ 257).
    pub vocab: usize,
    /// Every N-th layer is full attention (hybrid).
    pub full_attention_interval: usize,
    /// Gated DeltaNet key heads (hybrid).
    pub linear_key_heads: usize,
    /// Gated DeltaNet value heads (hybrid).
    pub linear_value_heads: usize,
    /// Gated DeltaNet key head dimension (hybrid).
    pub linear_key_head_dim: usize,
    /// Gated DeltaNet value head dimension (hybrid).
    pub linear_value_head_dim: usize,
    /// Causal convolution width (hybrid).
    pub conv_kernel: usize,
    /// Seed of the weights.
    pub seed: u64,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            arch: SynthArch::Qwen35,
            layers: 6,
            hidden: 256,
            intermediate: 512,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            vocab: 512,
            full_attention_interval: 3,
            linear_key_heads: 2,
            linear_value_heads: 4,
            linear_key_head_dim: 64,
            linear_value_head_dim: 64,
            conv_kernel: 4,
            seed: 1,
        }
    }
}

/// SplitMix64: deterministic across platforms.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f64 / (1u64 << 23) as f64 - 1.0) as f32
    }
}

/// The synthetic package's `config.json`.
pub fn synthetic_config(o: &SynthOptions) -> serde_json::Value {
    let mut c = serde_json::json!({
        "hidden_size": o.hidden,
        "intermediate_size": o.intermediate,
        "num_hidden_layers": o.layers,
        "num_attention_heads": o.heads,
        "num_key_value_heads": o.kv_heads,
        "head_dim": o.head_dim,
        "vocab_size": o.vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "bos_token_id": 256,
        "eos_token_id": 256,
        "xdna": { "synthetic": true, "seed": o.seed, "scale_type": "f16", "fused": false },
    });
    match o.arch {
        SynthArch::Llama => {
            c["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
            c["model_type"] = "llama".into();
        }
        SynthArch::Qwen35 => {
            c["architectures"] = serde_json::json!(["Qwen3_5ForCausalLM"]);
            c["model_type"] = "qwen3_5".into();
            let every = o.full_attention_interval.max(1);
            let types: Vec<&str> = (0..o.layers)
                .map(|i| {
                    if (i + 1) % every == 0 {
                        "full_attention"
                    } else {
                        "linear_attention"
                    }
                })
                .collect();
            c["layer_types"] = serde_json::json!(types);
            c["full_attention_interval"] = every.into();
            c["partial_rotary_factor"] = 0.25.into();
            c["attn_output_gate"] = true.into();
            c["linear_num_key_heads"] = o.linear_key_heads.into();
            c["linear_num_value_heads"] = o.linear_value_heads.into();
            c["linear_key_head_dim"] = o.linear_key_head_dim.into();
            c["linear_value_head_dim"] = o.linear_value_head_dim.into();
            c["linear_conv_kernel_dim"] = o.conv_kernel.into();
        }
    }
    c
}

/// What to write for one tensor.
enum Synth {
    /// `[rows, cols]`, uniform in ±sqrt(3 / cols) (unit output variance for unit inputs).
    Matrix { rows: usize, cols: usize },
    /// Plain f32 values `center + spread · u`, u uniform in [-1, 1).
    Vector {
        shape: Vec<usize>,
        center: f32,
        spread: f32,
    },
    /// `A_log = ln(u)`, u uniform in [1, 16) (HF's init).
    ALog { len: usize },
}

fn synthetic_tensors(o: &SynthOptions, c: &ModelConfig) -> Vec<(String, Synth)> {
    let h = o.hidden;
    let mut t: Vec<(String, Synth)> = Vec::new();
    // Zero-centred norms (hybrid) are stored as small offsets; Llama norms as values around 1.
    let norm_center = if c.zero_centered_norms { 0.0 } else { 1.0 };
    let nv = |len: usize| Synth::Vector {
        shape: vec![len],
        center: norm_center,
        spread: 0.1,
    };
    let mat = |rows: usize, cols: usize| Synth::Matrix { rows, cols };
    t.push(("model.embed_tokens.weight".into(), mat(o.vocab, h)));
    for i in 0..o.layers {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        t.push((n("input_layernorm.weight"), nv(h)));
        match c.layer_kind(i) {
            LayerKind::Attention => {
                t.push((n("self_attn.q_proj.weight"), mat(c.q_rows(), h)));
                t.push((n("self_attn.k_proj.weight"), mat(c.kv_dim(), h)));
                t.push((n("self_attn.v_proj.weight"), mat(c.kv_dim(), h)));
                t.push((n("self_attn.o_proj.weight"), mat(h, c.q_dim())));
                if c.qk_norm {
                    t.push((n("self_attn.q_norm.weight"), nv(c.head_dim)));
                    t.push((n("self_attn.k_norm.weight"), nv(c.head_dim)));
                }
            }
            LayerKind::Linear => {
                if let Some(d) = &c.linear {
                    let la = |s: &str| n(&format!("linear_attn.{s}"));
                    let hv = d.value_heads;
                    t.push((la("in_proj_qkv.weight"), mat(d.conv_dim(), h)));
                    t.push((la("in_proj_z.weight"), mat(d.value_dim(), h)));
                    t.push((la("in_proj_b.weight"), mat(hv, h)));
                    t.push((la("in_proj_a.weight"), mat(hv, h)));
                    let a = 1.0 / (d.conv_kernel as f32).sqrt();
                    t.push((
                        la("conv1d.weight"),
                        Synth::Vector {
                            shape: vec![d.conv_dim(), 1, d.conv_kernel],
                            center: 0.0,
                            spread: a,
                        },
                    ));
                    t.push((
                        la("dt_bias"),
                        Synth::Vector {
                            shape: vec![hv],
                            center: 0.0,
                            spread: 1.0,
                        },
                    ));
                    t.push((la("A_log"), Synth::ALog { len: hv }));
                    t.push((
                        la("norm.weight"),
                        Synth::Vector {
                            shape: vec![d.value_head_dim],
                            center: 1.0,
                            spread: 0.1,
                        },
                    ));
                    t.push((la("out_proj.weight"), mat(h, d.value_dim())));
                }
            }
        }
        t.push((n("post_attention_layernorm.weight"), nv(h)));
        t.push((n("mlp.gate_proj.weight"), mat(o.intermediate, h)));
        t.push((n("mlp.up_proj.weight"), mat(o.intermediate, h)));
        t.push((n("mlp.down_proj.weight"), mat(h, o.intermediate)));
    }
    t.push(("model.norm.weight".into(), nv(h)));
    t.push(("lm_head.weight".into(), mat(o.vocab, h)));
    t
}

/// The tile format of synthetic matrices (q8 with f16 scales, column-major codes).
pub const SYNTH_FORMAT: WeightFormat = WeightFormat::Q8 {
    scale: ScaleType::F16,
    order: TileOrder::ColumnMajor,
};

/// Write a deterministic random-weight package into `dir`: `config.json`, `model.q4nx` (q8h
/// tiles for matrices whose rows are a multiple of 32, plain f32 otherwise), a byte-level
/// `tokenizer.json` (256 byte tokens + `<|endoftext|>`) and `tokenizer_config.json`. The kernel
/// set is written by the caller (`xdna pack synth`). Returns the parsed config.
pub fn write_synthetic(dir: &Path, o: &SynthOptions) -> Result<ModelConfig, ModelError> {
    let cfg_json = synthetic_config(o);
    let cfg_path = dir.join("config.json");
    let c = ModelConfig::from_json(&cfg_json, &cfg_path)?;
    if o.vocab < 257 {
        return Err(ModelError::Config {
            file: cfg_path.display().to_string(),
            field: "vocab_size".into(),
            problem: "a synthetic package needs ≥ 257 ids (256 bytes + <|endoftext|>)".into(),
        });
    }
    let io = |p: &Path, e: std::io::Error| ModelError::File {
        path: p.display().to_string(),
        problem: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let tensors = synthetic_tensors(o, &c);
    let mut decl = Vec::with_capacity(tensors.len());
    let mut meta = BTreeMap::new();
    meta.insert("xdna.scale_type".to_string(), "f16".to_string());
    meta.insert("xdna.order".to_string(), "column_major".to_string());
    meta.insert(
        "xdna.source".to_string(),
        format!("synthetic seed {}", o.seed),
    );
    let tiled = |rows: usize| rows.is_multiple_of(tiles::TILE_ROWS);
    for (name, t) in &tensors {
        match t {
            Synth::Matrix { rows, cols } if tiled(*rows) => {
                let bytes =
                    SYNTH_FORMAT
                        .matrix_bytes(*rows, *cols)
                        .map_err(|e| ModelError::Shape {
                            what: format!("{name}: {e}"),
                        })?;
                let tb = tiles::Q8_TILE_BYTES;
                decl.push(Declared {
                    name: name.clone(),
                    dtype: Dtype::I8,
                    shape: vec![bytes / tb, tb],
                });
                meta.insert(format!("xdna.format.{name}"), SYNTH_FORMAT.name().into());
                meta.insert(format!("xdna.shape.{name}"), format!("{rows},{cols}"));
            }
            Synth::Matrix { rows, cols } => decl.push(Declared {
                name: name.clone(),
                dtype: Dtype::F32,
                shape: vec![*rows, *cols],
            }),
            Synth::Vector { shape, .. } => decl.push(Declared {
                name: name.clone(),
                dtype: Dtype::F32,
                shape: shape.clone(),
            }),
            Synth::ALog { len } => decl.push(Declared {
                name: name.clone(),
                dtype: Dtype::F32,
                shape: vec![*len],
            }),
        }
    }
    let mut w = Writer::create(dir.join("model.q4nx"), &decl, &meta)?;
    let mut rng = Rng(o.seed);
    let f32s = |v: &mut dyn Iterator<Item = f32>| -> Vec<u8> {
        v.flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()
    };
    for (name, t) in &tensors {
        match *t {
            Synth::Matrix { rows, cols } if tiled(rows) => {
                let amp = (3.0 / cols as f32).sqrt();
                let d = amp / 127.0;
                let qt = SYNTH_FORMAT.padded_cols(cols) / tiles::TILE_COLS;
                let mut block = vec![0u8; qt * tiles::Q8_TILE_BYTES];
                for _pb in 0..rows / tiles::TILE_ROWS {
                    block.fill(0);
                    for q in 0..qt {
                        let tile =
                            &mut block[q * tiles::Q8_TILE_BYTES..(q + 1) * tiles::Q8_TILE_BYTES];
                        for g in 0..tiles::TILE_COLS / tiles::GROUP {
                            for r in 0..tiles::TILE_ROWS {
                                let mut codes = [0i8; tiles::GROUP];
                                let c0 = q * tiles::TILE_COLS + g * tiles::GROUP;
                                for (k, code) in codes.iter_mut().enumerate() {
                                    if c0 + k < cols {
                                        *code = (rng.unit() * 127.0).round() as i8;
                                    }
                                }
                                tiles::set_q8_cell(
                                    tile,
                                    ScaleType::F16,
                                    TileOrder::ColumnMajor,
                                    g,
                                    r,
                                    d,
                                    &codes,
                                );
                            }
                        }
                    }
                    w.write(name, &block)?;
                }
            }
            Synth::Matrix { rows, cols } => {
                let amp = (3.0 / cols as f32).sqrt();
                let bytes = f32s(&mut (0..rows * cols).map(|_| rng.unit() * amp));
                w.write(name, &bytes)?;
            }
            Synth::Vector {
                ref shape,
                center,
                spread,
            } => {
                let n: usize = shape.iter().product();
                let bytes = f32s(&mut (0..n).map(|_| center + spread * rng.unit()));
                w.write(name, &bytes)?;
            }
            Synth::ALog { len } => {
                let bytes = f32s(&mut (0..len).map(|_| (8.5 + 7.5 * rng.unit()).ln()));
                w.write(name, &bytes)?;
            }
        }
    }
    w.finish()?;
    let write_json = |name: &str, v: &serde_json::Value| -> Result<(), ModelError> {
        let p = dir.join(name);
        let text = serde_json::to_string_pretty(v).map_err(|e| ModelError::File {
            path: p.display().to_string(),
            problem: e.to_string(),
        })?;
        std::fs::write(&p, text).map_err(|e| io(&p, e))
    };
    write_json("config.json", &cfg_json)?;
    let table = crate::weights::tokenizer::byte_to_char_table();
    let mut vocab = serde_json::Map::new();
    for (b, ch) in table.iter().enumerate() {
        vocab.insert(ch.to_string(), serde_json::Value::from(b as u64));
    }
    vocab.insert("<|endoftext|>".into(), 256u64.into());
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    write_json(
        "tokenizer.json",
        &serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{ "id": 256, "content": "<|endoftext|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true }],
            "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
            "decoder": byte_level,
            "model": { "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": [] }
        }),
    )?;
    write_json(
        "tokenizer_config.json",
        &serde_json::json!({
            "add_bos_token": false, "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
            "tokenizer_class": "GPT2Tokenizer", "model_max_length": 4096,
        }),
    )?;
    Ok(c)
}
