//! FastFlowLM (GGUF-derived) Qwen3.5 Q4NX layout: a synthetic Hugging Face package is rewritten
//! into the FLM layout by applying, per index, the FORWARD transforms documented in
//! docs/formats.md "Qwen3.5 layouts" (llama.cpp `_reorder_v_heads`, then the FLM converter's
//! reorders, renames, −exp(A_log), +1 norms, planar gated q, transposed conv); both packages are
//! loaded and must give the same logits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use xdna::model::fflm_layout::FlmLayout;
use xdna::model::load::{load, open_package, LoadOptions};
use xdna::model::synthetic::{write_synthetic, SynthOptions};
use xdna::model::{LayerKind, Model, ModelConfig};
use xdna::weights::safetensors::{Declared, Dtype, Writer};

const TOKENS: [u32; 8] = [256, 72, 101, 108, 300, 511, 7, 480];

/// One tensor of the rewritten package: name, shape, f32 values.
type Tensor = (String, Vec<usize>, Vec<f32>);

fn write_f32_package(src: &Path, dst: &Path, tensors: &[Tensor]) {
    std::fs::create_dir_all(dst).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let decl: Vec<Declared> = tensors
        .iter()
        .map(|(n, s, _)| Declared {
            name: n.clone(),
            dtype: Dtype::F32,
            shape: s.clone(),
        })
        .collect();
    let mut w = Writer::create(dst.join("model.q4nx"), &decl, &BTreeMap::new()).unwrap();
    for (n, _, v) in tensors {
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.write(n, &b).unwrap();
    }
    w.finish().unwrap();
}

/// Labels (HF positions) after the llama.cpp V-head reorder then the FLM pair reorder, built as
/// forward scatters exactly as the sources describe them.
fn flm_labels(
    len: usize,
    hk: usize,
    hv: usize,
    gguf_unit: usize,
    reorder: bool,
    flm_unit: usize,
) -> Vec<usize> {
    let hf: Vec<usize> = (0..len).collect();
    // llama.cpp: reshape [hk, r, unit] → permute to [r, hk, unit] (grouped → tiled).
    let mut gguf = hf.clone();
    if hk != hv {
        let r = hv / hk;
        for k in 0..hk {
            for j in 0..r {
                for e in 0..gguf_unit {
                    gguf[(j * hk + k) * gguf_unit + e] = hf[(k * r + j) * gguf_unit + e];
                }
            }
        }
    }
    if !reorder {
        return gguf;
    }
    // FLM: rearrange '(q g p) -> (g q p)', q = 2.
    let groups = len / (2 * flm_unit);
    let mut flm = gguf.clone();
    for q in 0..2 {
        for g in 0..groups {
            for p in 0..flm_unit {
                flm[(g * 2 + q) * flm_unit + p] = gguf[(q * groups + g) * flm_unit + p];
            }
        }
    }
    flm
}

fn rows_by(v: &[f32], cols: usize, labels: &[usize]) -> Vec<f32> {
    labels
        .iter()
        .flat_map(|&l| v[l * cols..(l + 1) * cols].iter().copied())
        .collect()
}

/// Which tensors to rewrite, and how.
#[derive(Clone, Copy, PartialEq)]
enum Target {
    /// HF names and order, plain f32 (the reference).
    Hf,
    /// FLM names and order.
    Flm,
}

/// Decode the synthetic package at `src` and write it (f32) in `target` layout to `dst`.
fn rewrite(src: &Path, dst: &Path, target: Target) {
    let pkg = open_package(src).unwrap();
    let c: ModelConfig = xdna::model::ModelConfig::from_json(
        &serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap(),
        "config.json",
    )
    .unwrap();
    let h = c.hidden;
    let mat = |n: &str, r: usize, k: usize| pkg.matrix(n, r, k).unwrap().decode_f32().unwrap();
    let vecf = |n: &str| pkg.vector(n).unwrap();
    let flm = target == Target::Flm;
    let norm = |n: &str| -> Vec<f32> {
        let v = vecf(n);
        if flm {
            v.iter().map(|x| x + 1.0).collect()
        } else {
            v
        }
    };
    let mut t: Vec<Tensor> = Vec::new();
    t.push((
        "model.embed_tokens.weight".into(),
        vec![c.vocab, h],
        mat("model.embed_tokens.weight", c.vocab, h),
    ));
    for i in 0..c.layers {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        t.push((
            n("input_layernorm.weight"),
            vec![h],
            norm(&n("input_layernorm.weight")),
        ));
        t.push((
            n("post_attention_layernorm.weight"),
            vec![h],
            norm(&n("post_attention_layernorm.weight")),
        ));
        for m in ["gate_proj", "up_proj"] {
            let nm = n(&format!("mlp.{m}.weight"));
            t.push((
                nm.clone(),
                vec![c.intermediate, h],
                mat(&nm, c.intermediate, h),
            ));
        }
        let nm = n("mlp.down_proj.weight");
        t.push((
            nm.clone(),
            vec![h, c.intermediate],
            mat(&nm, h, c.intermediate),
        ));
        match c.layer_kind(i) {
            LayerKind::Attention => {
                let (heads, hd) = (c.heads, c.head_dim);
                let q = mat(&n("self_attn.q_proj.weight"), 2 * heads * hd, h);
                let q = if flm {
                    // FLM: '(g p h) -> (p g h)', p = 2 (q, gate).
                    let mut out = vec![0.0; q.len()];
                    for g in 0..heads {
                        for p in 0..2 {
                            for e in 0..hd {
                                let (to, from) = ((p * heads + g) * hd + e, (g * 2 + p) * hd + e);
                                out[to * h..(to + 1) * h]
                                    .copy_from_slice(&q[from * h..(from + 1) * h]);
                            }
                        }
                    }
                    out
                } else {
                    q
                };
                t.push((n("self_attn.q_proj.weight"), vec![2 * heads * hd, h], q));
                for m in ["k_proj", "v_proj"] {
                    let nm = n(&format!("self_attn.{m}.weight"));
                    t.push((nm.clone(), vec![c.kv_dim(), h], mat(&nm, c.kv_dim(), h)));
                }
                let nm = n("self_attn.o_proj.weight");
                t.push((nm.clone(), vec![h, c.q_dim()], mat(&nm, h, c.q_dim())));
                for m in ["q_norm", "k_norm"] {
                    let nm = n(&format!("self_attn.{m}.weight"));
                    t.push((nm.clone(), vec![hd], norm(&nm)));
                }
            }
            LayerKind::Linear => {
                let d = c.linear.as_ref().unwrap();
                let (hk, hv, dk, dv, kk) = (
                    d.key_heads,
                    d.value_heads,
                    d.key_head_dim,
                    d.value_head_dim,
                    d.conv_kernel,
                );
                let (cd, vd) = (d.conv_dim(), d.value_dim());
                let qk = cd - vd;
                let la = |s: &str| n(&format!("linear_attn.{s}"));
                let qkv = mat(&la("in_proj_qkv.weight"), cd, h);
                let z = mat(&la("in_proj_z.weight"), vd, h);
                let b = mat(&la("in_proj_b.weight"), hv, h);
                let a = mat(&la("in_proj_a.weight"), hv, h);
                let conv = vecf(&la("conv1d.weight"));
                let dt = vecf(&la("dt_bias"));
                let a_log = vecf(&la("A_log"));
                let gnorm = vecf(&la("norm.weight"));
                let out = mat(&la("out_proj.weight"), h, vd);
                if !flm {
                    t.push((la("in_proj_qkv.weight"), vec![cd, h], qkv));
                    t.push((la("in_proj_z.weight"), vec![vd, h], z));
                    t.push((la("in_proj_b.weight"), vec![hv, h], b));
                    t.push((la("in_proj_a.weight"), vec![hv, h], a));
                    t.push((la("conv1d.weight"), vec![cd, 1, kk], conv));
                    t.push((la("dt_bias"), vec![hv], dt));
                    t.push((la("A_log"), vec![hv], a_log));
                    t.push((la("norm.weight"), vec![dv], gnorm));
                    t.push((la("out_proj.weight"), vec![h, vd], out));
                    continue;
                }
                let reorder = c.intermediate > 6144;
                let ch = flm_labels(vd, hk, hv, dv, reorder, dk);
                let hd = flm_labels(hv, hk, hv, 1, reorder, 1);
                // qkv rows / conv channels: llama.cpp reorders the v part (unit d_v), then FLM
                // the second half, `chunk(2)` (unit d_k).
                let gguf_v = flm_labels(vd, hk, hv, dv, false, dk);
                let gguf_qkv: Vec<usize> = (0..qk).chain(gguf_v.iter().map(|&l| qk + l)).collect();
                let half = cd - cd / 2;
                let second = flm_labels(half, hk, hk, 1, reorder, dk);
                let qkv_labels: Vec<usize> = (0..cd)
                    .map(|f| {
                        if f < cd / 2 {
                            gguf_qkv[f]
                        } else {
                            gguf_qkv[cd / 2 + second[f - cd / 2]]
                        }
                    })
                    .collect();
                t.push((
                    la("qkv_proj.weight"),
                    vec![cd, h],
                    rows_by(&qkv, h, &qkv_labels),
                ));
                t.push((
                    n("self_attn.gate_proj.weight"),
                    vec![vd, h],
                    rows_by(&z, h, &ch),
                ));
                for (name, m) in [("ssm_beta_proj.weight", &b), ("ssm_alpha_proj.weight", &a)] {
                    let mut v = rows_by(m, h, &hd);
                    let mut rows = hv;
                    if hv < 32 {
                        // '(d c) -> ((r d) c)', r = 2: the whole matrix twice.
                        v = v.iter().chain(v.iter()).copied().collect();
                        rows *= 2;
                    }
                    t.push((la(name), vec![rows, h], v));
                }
                // conv: [cd, K] with the v channels reordered, then transposed to [K, cd].
                let mut tconv = vec![0.0; kk * cd];
                for to in 0..cd {
                    let from = qkv_labels[to];
                    for tap in 0..kk {
                        tconv[tap * cd + to] = conv[from * kk + tap];
                    }
                }
                t.push((la("ssm_conv1d.weight"), vec![kk, cd], tconv));
                t.push((
                    la("ssm_a"),
                    vec![hv],
                    hd.iter().map(|&j| -a_log[j].exp()).collect(),
                ));
                t.push((
                    la("ssm_dt.bias"),
                    vec![hv],
                    hd.iter().map(|&j| dt[j]).collect(),
                ));
                t.push((la("ssm_norm.weight"), vec![dv], gnorm));
                let mut tout = vec![0.0; h * vd];
                for r in 0..h {
                    for (col, &l) in ch.iter().enumerate() {
                        tout[r * vd + col] = out[r * vd + l];
                    }
                }
                t.push((la("ssm_out_proj.weight"), vec![h, vd], tout));
            }
        }
    }
    t.push((
        "model.norm.weight".into(),
        vec![h],
        norm("model.norm.weight"),
    ));
    t.push((
        "lm_head.weight".into(),
        vec![c.vocab, h],
        mat("lm_head.weight", c.vocab, h),
    ));
    write_f32_package(src, dst, &t);
}

#[path = "support/scratch_dir.rs"]
mod scratch_dir;

fn tmp(name: &str) -> PathBuf {
    scratch_dir::scratch_path("layouts", name)
}

fn logits(dir: &Path) -> Vec<Vec<f32>> {
    let pkg = open_package(dir).unwrap();
    let w = load(&pkg, &LoadOptions::default()).unwrap();
    let mut m = Model::new(w, 32).unwrap();
    TOKENS
        .iter()
        .map(|&t| m.step(t).unwrap().to_vec())
        .collect()
}

/// Max |a − b| over all tokens' logits, and the largest |a|.
fn compare(o: &SynthOptions, name: &str) -> (f32, f32) {
    let (src, hf, flm) = (
        tmp(&format!("{name}_src")),
        tmp(&format!("{name}_hf")),
        tmp(&format!("{name}_flm")),
    );
    write_synthetic(&src, o).unwrap();
    rewrite(&src, &hf, Target::Hf);
    rewrite(&src, &flm, Target::Flm);
    let (a, b) = (logits(&hf), logits(&flm));
    let mut diff = 0.0f32;
    let mut peak = 0.0f32;
    for (ra, rb) in a.iter().zip(&b) {
        assert_eq!(ra.len(), rb.len());
        for (x, y) in ra.iter().zip(rb) {
            diff = diff.max((x - y).abs());
            peak = peak.max(x.abs());
        }
    }
    eprintln!("{name}: max |Δlogit| {diff:e}, max |logit| {peak}");
    for d in [src, hf, flm] {
        let _ = std::fs::remove_dir_all(d);
    }
    (diff, peak)
}

// Tolerance: out_proj's permuted columns change the summation order and ssm_a → A_log is a
// ln(exp(x)) round trip; everything else is bit-exact. A swapped head moves logits by O(1).
const TOL: f32 = 1e-4;

#[test]
fn flm_layout_with_llama_cpp_tiled_value_heads_gives_hf_logits() {
    // hk = 2, hv = 4, intermediate 512 ≤ 6144: FLM keeps llama.cpp's tiled value-head order.
    let (diff, peak) = compare(&SynthOptions::default(), "tiled");
    assert!(peak > 0.1, "logits are not trivially zero ({peak})");
    assert!(diff <= TOL, "max |Δlogit| {diff}");
}

#[test]
fn flm_layout_with_converter_pair_reorder_gives_hf_logits() {
    // hk = 2, hv = 8 (r = 4), intermediate 6400 > 6144: both reorders, not inverse of each other.
    // (A consistent permutation of value heads that share one key head leaves the model unchanged,
    // so the key heads must be ≥ 2 for a wrong map to show.)
    let o = SynthOptions {
        layers: 3,
        intermediate: 6400,
        linear_key_heads: 2,
        linear_value_heads: 8,
        ..SynthOptions::default()
    };
    let (diff, peak) = compare(&o, "pairs");
    assert!(peak > 0.1, "logits are not trivially zero ({peak})");
    assert!(diff <= TOL, "max |Δlogit| {diff}");
}

#[test]
fn flm_maps_are_the_identity_for_qwen3_5_4b_and_9b_shapes() {
    // 16 key heads, 32 value heads, 128-wide, FFN > 6144 (Qwen3.5-4B/9B): the FLM pair reorder
    // undoes llama.cpp's tiling exactly, so the file is in HF order.
    let v = serde_json::json!({
        "model_type": "qwen3_5", "hidden_size": 256, "intermediate_size": 9216,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "vocab_size": 300, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128
    });
    let c = ModelConfig::from_json(&v, "c.json").unwrap();
    let l = FlmLayout::for_config(&c, "c.json").unwrap();
    assert!(l.channel_src.iter().enumerate().all(|(i, &s)| i == s));
    assert!(l.head_src.iter().enumerate().all(|(i, &s)| i == s));
    // The same shapes below the threshold keep the tiled order: file head 1 is HF head 2.
    let mut small = v.clone();
    small["intermediate_size"] = serde_json::json!(6144);
    let c = ModelConfig::from_json(&small, "c.json").unwrap();
    let l = FlmLayout::for_config(&c, "c.json").unwrap();
    assert_eq!(&l.head_src[..4], &[0, 2, 4, 6]);
    assert_eq!(l.head_src[16], 1);
}
