//! FastFlowLM Qwen3.5 packages against the GGUF they were made from, both written by the real
//! tools (tests/data/flm-qwen35, made by tools/flm/qwen35_value_heads_fixture.py): llama.cpp's
//! converter and quantizer wrote `source.gguf` from a random-weight Hugging Face checkpoint with
//! 8 key heads and 16 value heads, FLM_Q4NX_Converter wrote the package from that GGUF. The GGUF is
//! imported (bf16 scales, as the converter rounds them) and both must give the same logits.
//!
//! `r2-reorder` has an FFN of 6400, so the converter reorders the value heads a second time (the
//! path of Qwen3.5-4B/9B, where the package ends up in Hugging Face order); `r2-plain` has an FFN
//! of 256, so the package keeps llama.cpp's tiled order.
//!
//! Tolerance: the two read the same Q4_1 blocks, but the converter stores the embedding as bf16
//! values and rounds scales its own way; that moves these logits by about 0.07 (peak 4.2). A value
//! head read in the wrong place moves them by about 3 (checked by breaking either reorder in
//! `model::fflm_layout`), so the bound is 5 % of the peak.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use xdna::model::fflm_layout::{FlmLayout, FLM_REORDER_ABOVE_FFN};
use xdna::model::load::{load, open_package, LoadOptions};
use xdna::model::{Model, ModelConfig};
use xdna::tiles::ScaleType;
use xdna::weights::import::{import_gguf, ImportOptions};
use xdna::weights::safetensors::{Declared, Dtype, SafeTensors, Writer};

const TOKENS: [u32; 12] = [3, 70, 101, 259, 300, 44, 7, 319, 33, 200, 101, 280];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/flm-qwen35")
        .join(name)
}

struct Dirs(Vec<PathBuf>);
impl Drop for Dirs {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// The converter's package: the committed files plus its MLP, all zeros, which the fixture
/// leaves out (`zeros.json` names the tensors; the generator checked that the converter wrote
/// zero bytes). They go back as plain f32 zeros of their logical shape: an all-zero 5120-byte
/// tile grid does not say whether it holds q4_1 or legacy q8 tiles.
fn package(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join("package").join(f), dst.join(f)).unwrap();
    }
    let c = ModelConfig::from_json(
        &serde_json::from_str(&std::fs::read_to_string(dst.join("config.json")).unwrap()).unwrap(),
        "config.json",
    )
    .unwrap();
    let st = SafeTensors::open(src.join("package/model.q4nx")).unwrap();
    let zeros: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("zeros.json")).unwrap()).unwrap();
    let mut decl: Vec<Declared> = st
        .entries()
        .iter()
        .map(|e| Declared {
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
        })
        .collect();
    let kept = decl.len();
    for z in zeros.as_array().unwrap() {
        let name = z["name"].as_str().unwrap().to_string();
        let shape = if name.ends_with("mlp.down_proj.weight") {
            vec![c.hidden, c.intermediate]
        } else {
            assert!(name.ends_with("mlp.gate_proj.weight") || name.ends_with("mlp.up_proj.weight"));
            vec![c.intermediate, c.hidden]
        };
        decl.push(Declared {
            name,
            dtype: Dtype::F32,
            shape,
        });
    }
    // The converter writes its q4_1 codes in 16-row lanes. The reader guesses the nibble order
    // from the codes; with 32 real columns in each 256-column tile there are too few to go on.
    let mut meta = st.metadata().clone();
    meta.insert("xdna.order".into(), "lanes16".into());
    let mut w = Writer::create(dst.join("model.q4nx"), &decl, &meta).unwrap();
    for (i, d) in decl.iter().enumerate() {
        if i < kept {
            w.write(&d.name, st.tensor(&d.name).unwrap().data).unwrap();
        } else {
            w.write(&d.name, &vec![0u8; 4 * d.shape.iter().product::<usize>()])
                .unwrap();
        }
    }
    w.finish().unwrap();
}

fn logits(dir: &Path) -> Vec<Vec<f32>> {
    let pkg = open_package(dir).unwrap();
    let w = load(&pkg, &LoadOptions::default()).unwrap();
    let mut m = Model::new(w, 64).unwrap();
    TOKENS
        .iter()
        .map(|&t| m.step(t).unwrap().to_vec())
        .collect()
}

/// Largest |Δ| between two runs' logits and the largest |logit|.
fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, f32) {
    let (mut diff, mut peak) = (0f32, 0f32);
    for (ra, rb) in a.iter().zip(b) {
        assert_eq!(ra.len(), rb.len());
        for (x, y) in ra.iter().zip(rb) {
            diff = diff.max((x - y).abs());
            peak = peak.max(x.abs());
        }
    }
    (diff, peak)
}

/// Imports the fixture's GGUF, rebuilds its package, and returns (GGUF logits, package logits,
/// the package's config).
fn run(name: &str) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, ModelConfig) {
    let src = fixture(name);
    let tmp = std::env::temp_dir().join(format!("xdna_flm35_{}_{name}", std::process::id()));
    let _dirs = Dirs(vec![tmp.clone()]);
    let (imported, flm) = (tmp.join("gguf"), tmp.join("flm"));
    import_gguf(
        &src.join("source.gguf"),
        &imported,
        ImportOptions {
            scale: ScaleType::Bf16,
            progress: false,
        },
    )
    .unwrap();
    package(&src, &flm);
    let pkg = open_package(&flm).unwrap();
    let c = pkg.config().clone();
    assert!(
        FlmLayout::detect(&pkg, &c).unwrap().is_some(),
        "{name}: FLM names"
    );
    (logits(&imported), logits(&flm), c)
}

fn check(name: &str, reorder: bool) {
    let (gguf, flm, c) = run(name);
    let d = c.linear.as_ref().unwrap();
    assert_eq!((d.key_heads, d.value_heads), (8, 16), "{name}");
    assert_eq!(c.intermediate > FLM_REORDER_ABOVE_FFN, reorder, "{name}");
    let (diff, peak) = max_diff(&gguf, &flm);
    eprintln!("{name}: max |Δ logit| {diff:.3e} (peak |logit| {peak:.2})");
    assert!(peak > 1.0, "{name}: logits too flat to tell layouts apart");
    assert!(
        diff <= 0.05 * peak,
        "{name}: the package and its GGUF differ by {diff} (peak {peak})"
    );
}

#[test]
fn flm_package_with_the_converters_value_head_reorder_matches_its_gguf() {
    check("r2-reorder", true);
}

#[test]
fn flm_package_in_llama_cpp_value_head_order_matches_its_gguf() {
    check("r2-plain", false);
}

#[test]
fn fixture_tensors_are_what_the_converter_names() {
    // The package keeps FLM's names (so the loader takes the FLM path), and its zeros are MLP only.
    for name in ["r2-reorder", "r2-plain"] {
        let st = SafeTensors::open(fixture(name).join("package/model.q4nx")).unwrap();
        for t in [
            "model.layers.0.linear_attn.qkv_proj.weight",
            "model.layers.0.self_attn.gate_proj.weight",
            "model.layers.0.linear_attn.ssm_out_proj.weight",
            "model.layers.0.linear_attn.ssm_a",
        ] {
            assert!(st.contains(t), "{name}: {t}");
        }
        assert!(!st.entries().iter().any(|e| e.name.contains(".mlp.")));
        let meta: BTreeMap<String, String> = st.metadata().clone();
        assert!(meta.is_empty(), "{name}: the converter writes no metadata");
    }
}
