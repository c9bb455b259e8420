//! The model description: `config.json` in the forms real `transformers` 4 and 5 write it
//! (fixtures in `tests/data/hf_configs/`, commands in its README), written back by `to_json`, and
//! read from GGUF metadata, where it must equal the description of the `config.json` that
//! `xdna pack import` writes from the same file. Errors name the file and the field.

#[path = "support/gguf_writer.rs"]
mod gguf_writer;
#[path = "support/scratch_dir.rs"]
mod scratch_dir;
#[path = "support/smollm2.rs"]
mod smollm2;

use gguf_writer::*;
use std::path::{Path, PathBuf};
use xdna::weights::gguf::GgufFile;
use xdna::weights::import::{import_gguf, ImportOptions};
use xdna::weights::{LayerKind, ModelConfig, Package, RopeScaling};

fn fixture_path(version: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf_configs")
        .join(version)
        .join(name)
}

fn fixture(version: &str, name: &str) -> ModelConfig {
    let path = fixture_path(version, name);
    ModelConfig::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn scratch(name: &str) -> PathBuf {
    let d = scratch_dir::scratch_path("config", name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// The transformers 4 and transformers 5 files of `name` give one description.
fn both_forms(name: &str) -> ModelConfig {
    let (v4, v5) = (
        fixture("transformers4", name),
        fixture("transformers5", name),
    );
    assert_eq!(v4, v5, "{name}: transformers 4 and 5 forms differ");
    v5
}

#[test]
fn llama3_rope_parameters_equal_rope_theta_and_rope_scaling() {
    let c = both_forms("llama3.json");
    assert_eq!(c.model_type, "llama");
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        }
    );
    assert_eq!(
        (c.hidden, c.heads, c.kv_heads, c.head_dim, c.rotary_dim),
        (256, 4, 2, 64, 64)
    );
    assert_eq!((c.rms_eps, c.max_position_embeddings), (1e-6, 131072));
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.as_slice()),
        (Some(1), &[2][..])
    );
    assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
    // The scaling reaches the rotary frequencies: the lowest one is divided by the factor.
    let raw = 1.0 / 500000f64.powf(62.0 / 64.0);
    assert_eq!(c.rope_inv_freq()[31], raw / 8.0);
}

#[test]
fn qwen3_keeps_its_rope_theta_in_the_transformers_5_form() {
    let c = both_forms("qwen3.json");
    assert_eq!(c.model_type, "qwen3");
    assert_eq!(c.rope_theta, 1_000_000.0);
    assert_eq!(c.rope_scaling, RopeScaling::None);
    assert!(c.qk_norm && !c.qkv_bias && c.tie_word_embeddings);
    assert_eq!((c.head_dim, c.rotary_dim, c.rms_eps), (64, 64, 1e-6));
    assert_eq!(c.layer_kinds, vec![LayerKind::Attention; 2]);
    assert_eq!((c.bos_token_id, c.eos_token_ids.len()), (None, 0));
}

#[test]
fn qwen2_has_qkv_bias_and_its_rope_theta() {
    let c = both_forms("qwen2.json");
    assert_eq!(c.rope_theta, 1_000_000.0);
    assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
    assert_eq!(c.head_dim, 64);
}

#[test]
fn hybrid_rope_parameters_carry_the_partial_rotary_factor() {
    let next = both_forms("qwen3_next.json");
    assert!(next.is_hybrid() && next.attn_output_gate && next.zero_centered_norms);
    assert_eq!(
        (next.head_dim, next.rotary_dim, next.rope_theta),
        (64, 16, 10000.0)
    );
    use LayerKind::{Attention, Linear};
    assert_eq!(next.layer_kinds, vec![Linear, Linear, Linear, Attention]);
    let lin = next.linear.as_ref().expect("linear dims");
    assert_eq!(
        (
            lin.key_heads,
            lin.value_heads,
            lin.key_head_dim,
            lin.value_head_dim,
            lin.conv_kernel
        ),
        (2, 4, 32, 32, 4)
    );
    // Qwen3.5's text config (transformers 5 only) describes the same model under its own name.
    let mut q35 = fixture("transformers5", "qwen3_5_text.json");
    assert_eq!(q35.model_type, "qwen3_5_text");
    q35.model_type = next.model_type.clone();
    assert_eq!(q35, next);
}

#[test]
fn to_json_reads_back_to_the_same_description() {
    for (version, name) in [
        ("transformers4", "llama3.json"),
        ("transformers5", "llama3.json"),
        ("transformers5", "qwen3.json"),
        ("transformers5", "qwen2.json"),
        ("transformers5", "qwen3_next.json"),
        ("transformers5", "qwen3_5_text.json"),
    ] {
        let c = fixture(version, name);
        let back = ModelConfig::from_json(&c.to_json(), "written.json").expect(name);
        assert_eq!(back, c, "{version}/{name}");
    }
}

#[test]
fn errors_name_the_file_and_the_field() {
    let path = fixture_path("transformers5", "llama3.json");
    let text = std::fs::read_to_string(&path).expect("fixture");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let err = |v: &serde_json::Value| {
        ModelConfig::from_json(v, "models/x/config.json")
            .expect_err("must be refused")
            .to_string()
    };
    let mut missing = v.clone();
    missing["rope_parameters"]
        .as_object_mut()
        .expect("object")
        .remove("factor");
    let e = err(&missing);
    assert!(
        e.contains("models/x/config.json") && e.contains("\"rope_parameters.factor\""),
        "{e}"
    );
    assert!(e.contains("missing"), "{e}");
    // Found by the config_json fuzz target: heads × head_dim overflowed in the shapes.
    let mut wide = v.clone();
    wide["head_dim"] = serde_json::json!(6555555555555555554u64);
    let e = err(&wide);
    assert!(
        e.contains("head_dim") && e.contains("at most 1048576"),
        "{e}"
    );
    // Found by the config_json fuzz target: the layer list was allocated from any count.
    for absurd in [
        serde_json::json!(11111111111111111112u64),
        serde_json::json!(1025),
    ] {
        let mut many = v.clone();
        many["num_hidden_layers"] = absurd;
        let e = err(&many);
        assert!(
            e.contains("\"num_hidden_layers\"") && e.contains("at most 1024 layers"),
            "{e}"
        );
    }
    let mut ill_typed = v.clone();
    ill_typed["rope_parameters"]["rope_theta"] = serde_json::json!("big");
    let e = err(&ill_typed);
    assert!(
        e.contains("\"rope_parameters.rope_theta\"") && e.contains("a number"),
        "{e}"
    );
    let mut yarn = v.clone();
    yarn["rope_parameters"]["rope_type"] = serde_json::json!("yarn");
    let e = err(&yarn);
    assert!(
        e.contains("\"rope_parameters.rope_type\"") && e.contains("yarn"),
        "{e}"
    );
    let mut kv = v.clone();
    kv["num_key_value_heads"] = serde_json::json!(3);
    let e = err(&kv);
    assert!(e.contains("\"num_key_value_heads\""), "{e}");
    let mut eos = v.clone();
    eos["eos_token_id"] = serde_json::json!("</s>");
    let e = err(&eos);
    assert!(e.contains("\"eos_token_id\""), "{e}");
    let mut kind = v;
    kind["model_type"] = serde_json::json!("gpt2");
    let e = err(&kind);
    assert!(e.contains("\"model_type\"") && e.contains("gpt2"), "{e}");
    // A file that is not there, or not JSON: named.
    let gone = Path::new("/nonexistent/config.json");
    let e = ModelConfig::from_file(gone)
        .expect_err("absent")
        .to_string();
    assert!(e.contains("/nonexistent/config.json"), "{e}");
}

/// A llama GGUF with metadata only (and the embedding whose rows give the vocabulary).
fn tiny_llama_gguf(edit: impl FnOnce(&mut GgufWriter)) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.str("general.architecture", "llama");
    w.u32("llama.embedding_length", 64);
    w.u32("llama.feed_forward_length", 128);
    w.u32("llama.block_count", 2);
    w.u32("llama.attention.head_count", 4);
    w.u32("llama.attention.head_count_kv", 2);
    w.f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
    w.f32("llama.rope.freq_base", 500000.0);
    w.u32("llama.context_length", 4096);
    w.u32("tokenizer.ggml.bos_token_id", 1);
    w.u32("tokenizer.ggml.eos_token_id", 2);
    edit(&mut w);
    w.tensor(
        "token_embd.weight",
        &[64, 300],
        GGML_F32,
        &vec![0u8; 64 * 300 * 4],
    );
    w
}

/// A qwen3 GGUF with `blocks` layers: hidden 64, 4 heads, a 300-token F32 embedding.
fn tiny_qwen3_gguf(blocks: u32) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.str("general.architecture", "qwen3");
    for (key, v) in [
        ("embedding_length", 64),
        ("feed_forward_length", 128),
        ("block_count", blocks),
        ("attention.head_count", 4),
    ] {
        w.u32(&format!("qwen3.{key}"), v);
    }
    w.tensor(
        "token_embd.weight",
        &[64, 300],
        GGML_F32,
        &vec![0u8; 64 * 300 * 4],
    );
    w
}

fn gguf_description(name: &str, w: &GgufWriter) -> Result<ModelConfig, String> {
    let path = scratch(name).join("model.gguf");
    std::fs::write(&path, w.bytes()).expect("write gguf");
    let f = GgufFile::open(&path).map_err(|e| e.to_string())?;
    ModelConfig::from_gguf(&f).map_err(|e| e.to_string())
}

#[test]
fn gguf_metadata_gives_the_description() {
    let c = gguf_description("gguf_ok", &tiny_llama_gguf(|_| {})).expect("description");
    assert_eq!(c.model_type, "llama");
    assert_eq!(
        (
            c.hidden,
            c.intermediate,
            c.layers,
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.vocab
        ),
        (64, 128, 2, 4, 2, 16, 300)
    );
    // f32 metadata is taken as the decimal it was written from.
    assert_eq!((c.rms_eps, c.rope_theta), (1e-5, 500000.0));
    assert_eq!(c.max_position_embeddings, 4096);
    assert!(c.tie_word_embeddings);
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.as_slice()),
        (Some(1), &[2][..])
    );
    // qwen3 keys: the same shape, with per-head q/k norms.
    let qwen3 = tiny_qwen3_gguf(2);
    let q = gguf_description("gguf_qwen3", &qwen3).expect("qwen3");
    assert!(q.qk_norm && !q.qkv_bias && q.kv_heads == 4);
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Llama 3.1 rope scaling as llama.cpp's converter writes it (one frequency divisor per rotated
/// pair in `rope_freqs.weight`, no scaling key) divides each pair's frequency, and survives the
/// package's `config.json`.
#[test]
fn gguf_rope_freqs_divide_each_pairs_frequency() {
    let divisors = [1f32, 1.0, 1.0, 1.5, 4.0, 8.0, 8.0, 8.0];
    let c = gguf_description(
        "gguf_rope_freqs",
        &tiny_llama_gguf(|w| w.tensor("rope_freqs.weight", &[8], GGML_F32, &f32_bytes(&divisors))),
    )
    .expect("rope_freqs");
    let inv = c.rope_inv_freq();
    assert_eq!(inv.len(), 8);
    for (j, (&f, &d)) in inv.iter().zip(&divisors).enumerate() {
        // head_dim 16, theta 500000: pair j turns at 500000^(-2j/16) / divisor j.
        let want = 500000f64.powf(-((2 * j) as f64) / 16.0) / f64::from(d);
        assert!((f - want).abs() <= want * 1e-15, "pair {j}: {f} vs {want}");
    }
    let back = ModelConfig::from_json(&c.to_json(), "config.json").expect("round trip");
    assert_eq!(back, c);
    let mut short = c.to_json();
    short["rope_scaling"]["divisors"] = serde_json::json!([1.0, 2.0]);
    let e = ModelConfig::from_json(&short, "config.json")
        .expect_err("2 divisors")
        .to_string();
    assert!(
        e.contains("rope_scaling.divisors") && e.contains("2 divisors"),
        "{e}"
    );
    let mut zero = c.to_json();
    zero["rope_scaling"]["divisors"][3] = serde_json::json!(0.0);
    let e = ModelConfig::from_json(&zero, "config.json")
        .expect_err("a zero divisor")
        .to_string();
    assert!(
        e.contains("rope_scaling.divisors") && e.contains("divisor 3 is 0"),
        "{e}"
    );
    let mut qwen3 = tiny_qwen3_gguf(2);
    qwen3.tensor("rope_freqs.weight", &[8], GGML_F32, &f32_bytes(&divisors));
    let e = gguf_description("gguf_qwen3_freqs", &qwen3).expect_err("qwen3 rope_freqs");
    assert!(
        e.contains("rope_freqs.weight") && e.contains("qwen3"),
        "{e}"
    );
}

#[test]
fn gguf_errors_name_the_file_and_the_key() {
    let e = gguf_description(
        "gguf_kv",
        &tiny_llama_gguf(|w| w.u32("llama.attention.head_count_kv", 3)),
    )
    .expect_err("3 KV heads for 4 heads");
    assert!(
        e.contains("model.gguf") && e.contains("\"llama.attention.head_count_kv\""),
        "{e}"
    );
    let e = gguf_description(
        "gguf_rope",
        &tiny_llama_gguf(|w| w.str("llama.rope.scaling.type", "yarn")),
    )
    .expect_err("yarn");
    assert!(
        e.contains("\"llama.rope.scaling.type\"") && e.contains("yarn"),
        "{e}"
    );
    // rope_freqs.weight: wrong length, a zero divisor, on a family llama.cpp does not read it
    // for, beside a scaling key.
    for (name, values, edit_arch, why) in [
        (
            "gguf_freqs_len",
            &[1f32; 7][..],
            None,
            "7 divisors for 8 rotated pairs",
        ),
        (
            "gguf_freqs_zero",
            &[1f32, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0][..],
            None,
            "divisor 2 is 0",
        ),
        (
            "gguf_freqs_linear",
            &[1f32; 8][..],
            Some("linear"),
            "both this tensor and",
        ),
    ] {
        let e = gguf_description(
            name,
            &tiny_llama_gguf(|w| {
                if let Some(kind) = edit_arch {
                    w.str("llama.rope.scaling.type", kind);
                    w.f32("llama.rope.scaling.factor", 2.0);
                }
                w.tensor(
                    "rope_freqs.weight",
                    &[values.len() as u64],
                    GGML_F32,
                    &f32_bytes(values),
                )
            }),
        )
        .expect_err(name);
        assert!(
            e.contains("model.gguf") && e.contains("rope_freqs.weight") && e.contains(why),
            "{e}"
        );
    }
    let huge = tiny_qwen3_gguf(4_000_000_000);
    let e = gguf_description("gguf_blocks", &huge).expect_err("four billion blocks");
    assert!(
        e.contains("\"qwen3.block_count\"") && e.contains("at most 1024 layers"),
        "{e}"
    );
    let mut no_arch = GgufWriter::new();
    no_arch.u32("llama.embedding_length", 64);
    let e = gguf_description("gguf_arch", &no_arch).expect_err("no architecture");
    assert!(e.contains("general.architecture"), "{e}");
}

/// A `qwen35` GGUF's metadata (no weights but the embedding): 6 blocks, the last an MTP block.
fn tiny_qwen35_gguf(edit: impl FnOnce(&mut GgufWriter)) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.str("general.architecture", "qwen35");
    for (key, v) in [
        ("embedding_length", 64),
        ("feed_forward_length", 128),
        ("block_count", 6),
        ("nextn_predict_layers", 1),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
        ("attention.key_length", 16),
        ("ssm.time_step_rank", 4),
        ("ssm.group_count", 2),
        ("ssm.inner_size", 64),
        ("ssm.state_size", 16),
        ("ssm.conv_kernel", 4),
    ] {
        w.u32(&format!("qwen35.{key}"), v);
    }
    w.f32("qwen35.attention.layer_norm_rms_epsilon", 1e-6);
    edit(&mut w);
    w.tensor(
        "token_embd.weight",
        &[64, 300],
        GGML_F32,
        &vec![0u8; 64 * 300 * 4],
    );
    w
}

/// Which layers of a `qwen35` GGUF are recurrent: the file's `attention.recurrent_layers`
/// flags when it has them (any pattern), else every `full_attention_interval`-th layer is full
/// attention (default 4), as llama.cpp reads them.
#[test]
fn qwen35_gguf_layer_pattern_comes_from_its_recurrent_layer_flags() {
    use xdna::weights::LayerKind::{Attention as A, Linear as L};
    let kinds = |name: &str, edit: fn(&mut GgufWriter)| {
        gguf_description(name, &tiny_qwen35_gguf(edit)).map(|c| c.layer_kinds)
    };
    assert_eq!(kinds("q35_default", |_| {}).unwrap(), [L, L, L, A, L]);
    assert_eq!(
        kinds("q35_interval", |w| w
            .u32("qwen35.full_attention_interval", 2))
        .unwrap(),
        [L, A, L, A, L]
    );
    // Not an every-n-th pattern; the MTP block's flag is past the decoder's layers. The flags win
    // over an interval that disagrees.
    assert_eq!(
        kinds("q35_flags", |w| {
            w.u32("qwen35.full_attention_interval", 4);
            w.bool_array(
                "qwen35.attention.recurrent_layers",
                &[true, false, false, true, true, false],
            );
        })
        .unwrap(),
        [L, A, A, L, L]
    );
    assert_eq!(
        kinds("q35_int_flags", |w| w.i32_array(
            "qwen35.attention.recurrent_layers",
            &[0, 1, 1, 1, 0, 0]
        ))
        .unwrap(),
        [A, L, L, L, A]
    );
    let e = kinds("q35_short", |w| {
        w.bool_array("qwen35.attention.recurrent_layers", &[true; 5])
    })
    .expect_err("5 flags for 6 blocks");
    assert!(
        e.contains("\"qwen35.attention.recurrent_layers\"") && e.contains("5 flags for 6 blocks"),
        "{e}"
    );
    let e = kinds("q35_bad_flag", |w| {
        w.str_array(
            "qwen35.attention.recurrent_layers",
            &vec!["yes".to_string(); 6],
        )
    })
    .expect_err("string flags");
    assert!(e.contains("flag 0"), "{e}");
}

/// The default model: its GGUF metadata and the `config.json` that `xdna pack import` writes
/// from it describe the same model, bit for bit.
#[test]
fn smollm2_gguf_metadata_equals_its_imported_config_json() {
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    let from_gguf = ModelConfig::from_gguf(&GgufFile::open(&gguf).expect("gguf")).expect("desc");
    let dir = scratch("smollm2_import");
    import_gguf(
        &gguf,
        &dir,
        ImportOptions {
            progress: false,
            ..ImportOptions::default()
        },
    )
    .expect("import");
    let from_json = ModelConfig::from_file(&dir.join("config.json")).expect("config.json");
    assert_eq!(from_gguf, from_json);
    assert_eq!(
        Package::open_dir(&dir).expect("package").config(),
        &from_json
    );
    assert_eq!(
        (
            from_json.hidden,
            from_json.layers,
            from_json.heads,
            from_json.kv_heads
        ),
        (576, 30, 9, 3)
    );
    assert_eq!(
        (from_json.vocab, from_json.rope_theta, from_json.rms_eps),
        (49152, 100000.0, 1e-5)
    );
    assert!(from_json.tie_word_embeddings);
    let _ = std::fs::remove_dir_all(&dir);
}
