//! Qwen3.5 hybrid GGUF (llama.cpp `qwen35`): a synthetic Hugging Face package is written as a
//! GGUF by applying, per index, the FORWARD transforms of llama.cpp's converter
//! (`conversion/qwen.py`: `_LinearAttentionVReorderBase._reorder_v_heads` on the value heads,
//! `A_log` → −exp(A_log), `+1` on every norm but the GDN gated one, conv squeezed to `[C, K]`,
//! `dt_bias` → `ssm_dt.bias`, `in_proj_qkv` → `attn_qkv`, `in_proj_z` → `attn_gate`,
//! `in_proj_b/a` → `ssm_beta/alpha`, `post_attention_layernorm` → `post_attention_norm`, …).
//! The GGUF goes through `xdna pack import`'s path and must give the Hugging Face package's logits:
//! bit for bit when every tensor is Q8_0 (the synthetic tiles' own codes and scales) or F32.

#[path = "support/gguf_writer.rs"]
mod gguf_writer;

use gguf_writer::*;
use half::{bf16, f16};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use xdna::model::load::{load, open_package, LoadOptions};
use xdna::model::replay_check::{self, ReplayCheckOptions};
use xdna::model::synthetic::{write_synthetic, SynthOptions};
use xdna::model::{LayerKind, Model, ReplayMode};
use xdna::tiles::{self, WeightFormat};
use xdna::weights::import::{import_gguf, ImportOptions};
use xdna::weights::safetensors::{Declared, Dtype, Writer};
use xdna::weights::Package;

const TOKENS: [u32; 10] = [256, 72, 101, 108, 300, 511, 7, 480, 33, 200];

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("xdna_gguf35_{}_{name}", std::process::id()))
}

/// A matrix of the Hugging Face package: values, and the Q8 cells (f16 scale bits, 32 codes) per
/// (row, 32-column block) when it is stored as q8 tiles.
struct Mat {
    rows: usize,
    cols: usize,
    vals: Vec<f32>,
    q8: Option<Vec<(u16, [i8; 32])>>,
}

fn read_mat(pkg: &Package, name: &str, rows: usize, cols: usize) -> Mat {
    let view = pkg.matrix(name, rows, cols).unwrap();
    let vals = view.decode_f32().unwrap();
    let q8 = match view.format {
        WeightFormat::Q8 { order, .. } => {
            // Raw cells straight from the tile bytes (tiles.rs layout).
            let tb = tiles::Q8_TILE_BYTES;
            let qt = view.format.padded_cols(cols) / tiles::TILE_COLS;
            let mut cells = Vec::with_capacity(rows * cols / 32);
            for r in 0..rows {
                let (pb, rr) = (r / tiles::TILE_ROWS, r % tiles::TILE_ROWS);
                for blk in 0..cols / 32 {
                    let (q, g) = (
                        blk * 32 / tiles::TILE_COLS,
                        (blk * 32 % tiles::TILE_COLS) / 32,
                    );
                    let base = (pb * qt + q) * tb;
                    let at = base + 2 * tiles::cell(g, rr);
                    let d = u16::from_le_bytes([view.data[at], view.data[at + 1]]);
                    let codes: [i8; 32] = std::array::from_fn(|k| {
                        view.data
                            [base + tiles::Q8_CODES + tiles::q8_code_pos(order, rr, g * 32 + k)]
                            as i8
                    });
                    cells.push((d, codes));
                }
            }
            Some(cells)
        }
        _ => None,
    };
    Mat {
        rows,
        cols,
        vals,
        q8,
    }
}

/// GGUF position → Hugging Face index, built as llama.cpp's `_reorder_v_heads` does: view the axis
/// as `[hk, r, unit]` and swap the first two axes.
fn v_labels(len: usize, hk: usize, hv: usize, unit: usize, reorder: bool) -> Vec<usize> {
    let mut lab: Vec<usize> = (0..len).collect();
    if reorder && hk != hv {
        let r = hv / hk;
        for k in 0..hk {
            for j in 0..r {
                for e in 0..unit {
                    lab[(j * hk + k) * unit + e] = (k * r + j) * unit + e;
                }
            }
        }
    }
    lab
}

/// ggml types the writer can emit for a matrix.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Ty {
    Q8_0,
    Q4_1,
    F16,
    Bf16,
    F32,
    Q4_0,
}

/// Encode `m` with GGUF row g = HF row `rl[g]`, GGUF column c = HF column `cl[c]`, as `ty`.
/// Returns the bytes and the values the GGUF holds mapped back to HF order (the reference).
fn encode(m: &Mat, ty: Ty, rl: &[usize], cl: &[usize]) -> (Vec<u8>, Vec<f32>) {
    let (rows, cols) = (m.rows, m.cols);
    let mut bytes = Vec::new();
    let mut back = vec![0f32; rows * cols];
    for &hr in rl {
        let row: Vec<f32> = cl.iter().map(|&hc| m.vals[hr * cols + hc]).collect();
        let got: Vec<f32> = match ty {
            Ty::Q8_0 => {
                let cells = m.q8.as_ref().expect("Q8_0 only from q8 tiles");
                let mut out = Vec::new();
                for b in 0..cols / 32 {
                    let hb = cl[b * 32] / 32;
                    assert!((0..32).all(|e| cl[b * 32 + e] == hb * 32 + e), "block move");
                    let (d, codes) = cells[hr * (cols / 32) + hb];
                    bytes.extend_from_slice(&d.to_le_bytes());
                    bytes.extend(codes.iter().map(|&c| c as u8));
                    let df = f16::from_bits(d).to_f32();
                    out.extend(codes.iter().map(|&c| c as f32 * df));
                }
                out
            }
            Ty::Q4_1 => {
                // ggml quantize_row_q4_1_ref: d = (max − min)/15, m = min, q = round((x − m)/d).
                let mut out = Vec::new();
                for blk in row.chunks(32) {
                    let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                    let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let d = (max - min) / 15.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    let (dh, mh) = (f16::from_f32(d), f16::from_f32(min));
                    bytes.extend_from_slice(&dh.to_bits().to_le_bytes());
                    bytes.extend_from_slice(&mh.to_bits().to_le_bytes());
                    let q: Vec<u8> = blk
                        .iter()
                        .map(|&x| (((x - min) * id + 0.5) as i32).clamp(0, 15) as u8)
                        .collect();
                    for i in 0..16 {
                        bytes.push(q[i] | (q[i + 16] << 4));
                    }
                    out.extend(q.iter().map(|&c| c as f32 * dh.to_f32() + mh.to_f32()));
                }
                out
            }
            Ty::Q4_0 => {
                // Only for the "unsupported type" check: zeros.
                bytes.extend(std::iter::repeat_n(0u8, cols / 32 * 18));
                vec![0.0; cols]
            }
            Ty::F16 => row
                .iter()
                .map(|&x| {
                    let h = f16::from_f32(x);
                    bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                    h.to_f32()
                })
                .collect(),
            Ty::Bf16 => row
                .iter()
                .map(|&x| {
                    let h = bf16::from_f32(x);
                    bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                    h.to_f32()
                })
                .collect(),
            Ty::F32 => row
                .iter()
                .map(|&x| {
                    bytes.extend_from_slice(&x.to_le_bytes());
                    x
                })
                .collect(),
        };
        for (c, &hc) in cl.iter().enumerate() {
            back[hr * cols + hc] = got[c];
        }
    }
    (bytes, back)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// How to write the GGUF.
#[derive(Clone)]
struct Plan {
    /// Type of every matrix that is q8 tiles in the HF package (plain f32 ones stay F32), by the
    /// GGUF tensor's short name (`attn_qkv`, `ffn_up`, …); default `Q8_0`.
    types: BTreeMap<&'static str, Ty>,
    /// Apply llama.cpp's value-head reorder (false: a deliberately wrong GGUF).
    reorder: bool,
    /// Leave this GGUF tensor out.
    drop: Option<String>,
    /// Metadata overrides / removals.
    arch: &'static str,
    skip_key: Option<&'static str>,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            types: BTreeMap::new(),
            reorder: true,
            drop: None,
            arch: "qwen35",
            skip_key: None,
        }
    }
}

/// Write the GGUF of the HF package `src` to `out`; returns the reference HF tensors (what the
/// GGUF holds, back in HF order and names, norms and A_log as HF stores them).
fn write_gguf(src: &Path, out: &Path, plan: &Plan) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let pkg = open_package(src).unwrap();
    let c = pkg.config().clone();
    let d = c.linear.clone().unwrap();
    let (h, ffn) = (c.hidden, c.intermediate);
    let (hk, hv, dk, dv, kk) = (
        d.key_heads,
        d.value_heads,
        d.key_head_dim,
        d.value_head_dim,
        d.conv_kernel,
    );
    let (cd, vd) = (d.conv_dim(), d.value_dim());
    let qk = 2 * hk * dk;
    let mut g = GgufWriter::new();
    let a = plan.arch;
    g.str("general.architecture", a);
    let mut meta_u32 = vec![
        ("block_count", c.layers as u32),
        ("context_length", 4096),
        ("embedding_length", h as u32),
        ("feed_forward_length", ffn as u32),
        ("attention.head_count", c.heads as u32),
        ("attention.head_count_kv", c.kv_heads as u32),
        ("attention.key_length", c.head_dim as u32),
        ("attention.value_length", c.head_dim as u32),
        ("rope.dimension_count", c.rotary_dim as u32),
        ("ssm.conv_kernel", kk as u32),
        ("ssm.state_size", dk as u32),
        ("ssm.group_count", hk as u32),
        ("ssm.time_step_rank", hv as u32),
        ("ssm.inner_size", vd as u32),
        ("full_attention_interval", 3),
    ];
    meta_u32.retain(|(k, _)| Some(*k) != plan.skip_key);
    for (k, v) in meta_u32 {
        g.u32(&format!("{a}.{k}"), v);
    }
    g.f32(&format!("{a}.attention.layer_norm_rms_epsilon"), 1e-6);
    g.f32(&format!("{a}.rope.freq_base"), 10000.0);
    g.i32_array(&format!("{a}.rope.dimension_sections"), &[11, 11, 10, 0]);
    // Byte-level vocabulary of the synthetic package: 256 byte tokens + <|endoftext|>.
    let table = xdna::weights::tokenizer::byte_to_char_table();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    tokens.push("<|endoftext|>".into());
    let mut types = vec![1i32; 256];
    types.push(3);
    g.str("tokenizer.ggml.model", "gpt2");
    g.str("tokenizer.ggml.pre", "qwen35");
    g.str_array("tokenizer.ggml.tokens", &tokens);
    g.i32_array("tokenizer.ggml.token_type", &types);
    g.u32("tokenizer.ggml.bos_token_id", 256);
    g.u32("tokenizer.ggml.eos_token_id", 256);

    let mut reference = Vec::new();
    let ident = |n: usize| (0..n).collect::<Vec<usize>>();
    let put = |g: &mut GgufWriter,
               reference: &mut Vec<(String, Vec<usize>, Vec<f32>)>,
               hf: &str,
               gguf: &str,
               short: &'static str,
               rows: usize,
               cols: usize,
               rl: Vec<usize>,
               cl: Vec<usize>| {
        let m = read_mat(&pkg, hf, rows, cols);
        // Q8_0 carries the tiles' own cells; other types re-encode the values (plain f32
        // matrices stay F32 unless the plan names a type for them).
        let ty = match (plan.types.get(short).copied(), m.q8.is_some()) {
            (Some(Ty::Q8_0), false) | (None, false) => Ty::F32,
            (Some(t), _) => t,
            (None, true) => Ty::Q8_0,
        };
        let (bytes, back) = encode(&m, ty, &rl, &cl);
        reference.push((hf.to_string(), vec![rows, cols], back));
        if plan.drop.as_deref() != Some(gguf) {
            let id = match ty {
                Ty::Q8_0 => GGML_Q8_0,
                Ty::Q4_1 => GGML_Q4_1,
                Ty::Q4_0 => GGML_Q4_0,
                Ty::F16 => GGML_F16,
                Ty::Bf16 => GGML_BF16,
                Ty::F32 => GGML_F32,
            };
            g.tensor(gguf, &[cols as u64, rows as u64], id, &bytes);
        }
    };
    let vector = |g: &mut GgufWriter,
                  reference: &mut Vec<(String, Vec<usize>, Vec<f32>)>,
                  hf: &str,
                  gguf: &str,
                  transform: &dyn Fn(f32) -> f32,
                  labels: Option<Vec<usize>>,
                  ne: Vec<u64>| {
        let v = pkg.vector(hf).unwrap();
        let lab = labels.unwrap_or_else(|| (0..v.len()).collect());
        let out: Vec<f32> = lab.iter().map(|&i| transform(v[i])).collect();
        let shape = pkg.weights().tensor(hf).unwrap().shape.to_vec();
        reference.push((hf.to_string(), shape, v));
        if plan.drop.as_deref() != Some(gguf) {
            g.tensor(gguf, &ne, GGML_F32, &f32_bytes(&out));
        }
    };
    let plus_one = |x: f32| x + 1.0;
    let same = |x: f32| x;
    put(
        &mut g,
        &mut reference,
        "model.embed_tokens.weight",
        "token_embd.weight",
        "token_embd",
        c.vocab,
        h,
        ident(c.vocab),
        ident(h),
    );
    put(
        &mut g,
        &mut reference,
        "lm_head.weight",
        "output.weight",
        "output",
        c.vocab,
        h,
        ident(c.vocab),
        ident(h),
    );
    vector(
        &mut g,
        &mut reference,
        "model.norm.weight",
        "output_norm.weight",
        &plus_one,
        None,
        vec![h as u64],
    );
    let ch = v_labels(vd, hk, hv, dv, plan.reorder);
    let heads = v_labels(hv, hk, hv, 1, plan.reorder);
    let qkv: Vec<usize> = (0..qk).chain(ch.iter().map(|&l| qk + l)).collect();
    for i in 0..c.layers {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        let b = |s: &str| format!("blk.{i}.{s}");
        vector(
            &mut g,
            &mut reference,
            &n("input_layernorm.weight"),
            &b("attn_norm.weight"),
            &plus_one,
            None,
            vec![h as u64],
        );
        vector(
            &mut g,
            &mut reference,
            &n("post_attention_layernorm.weight"),
            &b("post_attention_norm.weight"),
            &plus_one,
            None,
            vec![h as u64],
        );
        for (m, short, rows, cols) in [
            ("gate_proj", "ffn_gate", ffn, h),
            ("up_proj", "ffn_up", ffn, h),
            ("down_proj", "ffn_down", h, ffn),
        ] {
            put(
                &mut g,
                &mut reference,
                &n(&format!("mlp.{m}.weight")),
                &b(&format!("{short}.weight")),
                short,
                rows,
                cols,
                ident(rows),
                ident(cols),
            );
        }
        match c.layer_kind(i) {
            LayerKind::Attention => {
                let (qd, kvd) = (c.q_dim(), c.kv_dim());
                for (m, short, rows, cols) in [
                    ("q_proj", "attn_q", 2 * qd, h),
                    ("k_proj", "attn_k", kvd, h),
                    ("v_proj", "attn_v", kvd, h),
                    ("o_proj", "attn_output", h, qd),
                ] {
                    put(
                        &mut g,
                        &mut reference,
                        &n(&format!("self_attn.{m}.weight")),
                        &b(&format!("{short}.weight")),
                        short,
                        rows,
                        cols,
                        ident(rows),
                        ident(cols),
                    );
                }
                for (m, short) in [("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")] {
                    vector(
                        &mut g,
                        &mut reference,
                        &n(&format!("self_attn.{m}.weight")),
                        &b(&format!("{short}.weight")),
                        &plus_one,
                        None,
                        vec![c.head_dim as u64],
                    );
                }
            }
            LayerKind::Linear => {
                let la = |s: &str| n(&format!("linear_attn.{s}"));
                put(
                    &mut g,
                    &mut reference,
                    &la("in_proj_qkv.weight"),
                    &b("attn_qkv.weight"),
                    "attn_qkv",
                    cd,
                    h,
                    qkv.clone(),
                    ident(h),
                );
                put(
                    &mut g,
                    &mut reference,
                    &la("in_proj_z.weight"),
                    &b("attn_gate.weight"),
                    "attn_gate",
                    vd,
                    h,
                    ch.clone(),
                    ident(h),
                );
                put(
                    &mut g,
                    &mut reference,
                    &la("in_proj_b.weight"),
                    &b("ssm_beta.weight"),
                    "ssm_beta",
                    hv,
                    h,
                    heads.clone(),
                    ident(h),
                );
                put(
                    &mut g,
                    &mut reference,
                    &la("in_proj_a.weight"),
                    &b("ssm_alpha.weight"),
                    "ssm_alpha",
                    hv,
                    h,
                    heads.clone(),
                    ident(h),
                );
                put(
                    &mut g,
                    &mut reference,
                    &la("out_proj.weight"),
                    &b("ssm_out.weight"),
                    "ssm_out",
                    h,
                    vd,
                    ident(h),
                    ch.clone(),
                );
                // conv1d [C, 1, K] squeezed to [C, K] (ggml ne [K, C]), v channels reordered.
                let conv = pkg.vector(&la("conv1d.weight")).unwrap();
                let mut gconv = Vec::with_capacity(cd * kk);
                for &l in &qkv {
                    gconv.extend_from_slice(&conv[l * kk..(l + 1) * kk]);
                }
                reference.push((la("conv1d.weight"), vec![cd, 1, kk], conv));
                if plan.drop.as_deref() != Some(b("ssm_conv1d.weight").as_str()) {
                    g.tensor(
                        &b("ssm_conv1d.weight"),
                        &[kk as u64, cd as u64],
                        GGML_F32,
                        &f32_bytes(&gconv),
                    );
                }
                vector(
                    &mut g,
                    &mut reference,
                    &la("dt_bias"),
                    &b("ssm_dt.bias"),
                    &same,
                    Some(heads.clone()),
                    vec![hv as u64],
                );
                vector(
                    &mut g,
                    &mut reference,
                    &la("A_log"),
                    &b("ssm_a"),
                    &|x: f32| -x.exp(),
                    Some(heads.clone()),
                    vec![hv as u64],
                );
                vector(
                    &mut g,
                    &mut reference,
                    &la("norm.weight"),
                    &b("ssm_norm.weight"),
                    &same,
                    None,
                    vec![dv as u64],
                );
            }
        }
    }
    std::fs::write(out, g.bytes()).unwrap();
    reference
}

/// An HF-layout package of plain f32 tensors (the reference for lossy GGUF types).
fn write_f32_package(src: &Path, dst: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
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
        w.write(n, &f32_bytes(v)).unwrap();
    }
    w.finish().unwrap();
}

fn weights(dir: &Path, exact: bool) -> xdna::model::ModelWeights {
    let pkg = open_package(dir).unwrap();
    let opts = LoadOptions {
        exact,
        ..LoadOptions::default()
    };
    load(&pkg, &opts).unwrap()
}

fn logits(w: xdna::model::ModelWeights) -> Vec<Vec<f32>> {
    let mut m = Model::new(w, 64).unwrap();
    TOKENS
        .iter()
        .map(|&t| m.step(t).unwrap().to_vec())
        .collect()
}

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

fn import(gguf: &Path, dir: &Path) -> Result<(), xdna::weights::WeightsError> {
    import_gguf(
        gguf,
        dir,
        ImportOptions {
            progress: false,
            ..ImportOptions::default()
        },
    )
}

struct Dirs(Vec<PathBuf>);
impl Drop for Dirs {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
            let _ = std::fs::remove_file(d);
        }
    }
}

fn synth(name: &str, o: &SynthOptions) -> PathBuf {
    let src = tmp(&format!("{name}_hf"));
    write_synthetic(&src, o).unwrap();
    src
}

#[test]
fn q8_0_gguf_gives_the_hf_logits_bit_for_bit_and_passes_replay_check() {
    let src = synth("bitwise", &SynthOptions::default());
    let (gguf, pkg) = (tmp("bitwise.gguf"), tmp("bitwise_pkg"));
    let _clean = Dirs(vec![src.clone(), gguf.clone(), pkg.clone()]);
    write_gguf(&src, &gguf, &Plan::default());
    import(&gguf, &pkg).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(pkg.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "qwen3_5");
    assert_eq!(cfg["layer_types"][2], "full_attention");
    assert_eq!(cfg["layer_types"][3], "linear_attention");
    let hf = logits(weights(&src, false));
    let gw = weights(&pkg, false);
    assert_eq!(gw.backend, "host");
    let from_gguf = logits(gw);
    let (diff, peak) = max_diff(&hf, &from_gguf);
    eprintln!("Q8_0/F32 GGUF: max |Δlogit| {diff:e}, max |logit| {peak}");
    assert!(peak > 0.1, "logits are not trivially zero ({peak})");
    assert!(hf == from_gguf, "logits differ (max |Δ| {diff:e})");
    // The verify contract on the GGUF-loaded model: every (M, n), both replay modes.
    let w = Arc::new(weights(&pkg, false));
    let mut x = 99u64;
    let tokens: Vec<u32> = (0..23)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % 512) as u32
        })
        .collect();
    for (check, full_replay) in [(false, false), (false, true), (true, false)] {
        let mode = ReplayMode { check, full_replay };
        let r = replay_check::run(
            w.clone(),
            &ReplayCheckOptions {
                tokens: tokens.clone(),
                prefix: 6,
                max_m: 16,
                mode,
                fault: None,
                tolerance: 1e-3,
            },
        )
        .unwrap();
        assert!(r.passed(), "replay-check {mode:?}: {r:?}");
    }
}

#[test]
fn value_heads_in_hf_order_are_not_the_same_model() {
    // The same GGUF without llama.cpp's value-head reorder: the import (which undoes it) must now
    // produce a different model — the comparison above can see a wrong permutation.
    let src = synth("noreorder", &SynthOptions::default());
    let (gguf, pkg) = (tmp("noreorder.gguf"), tmp("noreorder_pkg"));
    let _clean = Dirs(vec![src.clone(), gguf.clone(), pkg.clone()]);
    let plan = Plan {
        reorder: false,
        ..Plan::default()
    };
    write_gguf(&src, &gguf, &plan);
    import(&gguf, &pkg).unwrap();
    let (diff, _) = max_diff(&logits(weights(&src, false)), &logits(weights(&pkg, false)));
    eprintln!("unreordered GGUF: max |Δlogit| {diff:e}");
    assert!(
        diff > 1e-2,
        "a wrong value-head order went unnoticed ({diff:e})"
    );
}

#[test]
fn q4_1_f16_bf16_gguf_matches_its_dequantized_hf_reference() {
    // r = 4 (2 key heads, 8 value heads): a value-head permutation that is not an involution;
    // d_v = 48: `ssm_out`'s column permutation does not move whole 32-column blocks, so the
    // Q4_1 matrix is dequantized to plain f32; Q4_1 `ssm_beta/alpha` have 8 rows (not tiles).
    let o = SynthOptions {
        layers: 3,
        linear_key_heads: 2,
        linear_value_heads: 8,
        linear_value_head_dim: 48,
        ..SynthOptions::default()
    };
    let src = synth("mixed", &o);
    let (gguf, pkg, refdir) = (tmp("mixed.gguf"), tmp("mixed_pkg"), tmp("mixed_ref"));
    let _clean = Dirs(vec![src.clone(), gguf.clone(), pkg.clone(), refdir.clone()]);
    let plan = Plan {
        types: BTreeMap::from([
            ("attn_qkv", Ty::Q4_1),
            ("attn_gate", Ty::Bf16),
            ("ssm_out", Ty::Q4_1),
            ("ssm_beta", Ty::Q4_1),
            ("ssm_alpha", Ty::F16),
            ("ffn_gate", Ty::Q4_1),
            ("ffn_up", Ty::Q4_1),
            ("ffn_down", Ty::F16),
            ("attn_q", Ty::F16),
            ("attn_k", Ty::F16),
            ("attn_v", Ty::F16),
            ("attn_output", Ty::Bf16),
            ("token_embd", Ty::Q4_1),
            ("output", Ty::F32),
        ]),
        ..Plan::default()
    };
    let reference = write_gguf(&src, &gguf, &plan);
    write_f32_package(&src, &refdir, &reference);
    import(&gguf, &pkg).unwrap();
    // Decoded weights: every imported tensor equals the reference exactly (moves, no arithmetic).
    let (a, b) = (
        Package::open_dir(&refdir).unwrap(),
        Package::open_dir(&pkg).unwrap(),
    );
    // Which path each took: tiles for Q4_1 `attn_qkv` (640 rows), plain f32 for the Q4_1 `ssm_out`
    // (columns not block-aligned) and the 8-row Q4_1 `ssm_beta`.
    let dtype = |n: &str| b.weights().tensor(n).unwrap().dtype;
    assert_eq!(
        dtype("model.layers.0.linear_attn.in_proj_qkv.weight"),
        Dtype::I8
    );
    assert_eq!(
        dtype("model.layers.0.linear_attn.out_proj.weight"),
        Dtype::F32
    );
    assert_eq!(
        dtype("model.layers.0.linear_attn.in_proj_b.weight"),
        Dtype::F32
    );
    for (name, shape, _) in &reference {
        let got = if shape.len() == 2 && !name.ends_with("conv1d.weight") {
            b.matrix(name, shape[0], shape[1])
                .unwrap()
                .decode_f32()
                .unwrap()
        } else if name.ends_with("A_log") {
            let ssm_a = b.vector(&name.replace("A_log", "ssm_a")).unwrap();
            let want: Vec<f32> = a.vector(name).unwrap().iter().map(|x| -x.exp()).collect();
            assert!(ssm_a == want, "{name}: stored ssm_a is not −exp(A_log)");
            continue;
        } else {
            b.vector(name).unwrap()
        };
        let want = if shape.len() == 2 && !name.ends_with("conv1d.weight") {
            a.matrix(name, shape[0], shape[1])
                .unwrap()
                .decode_f32()
                .unwrap()
        } else if name.contains("norm.weight") && !name.contains("linear_attn") {
            a.vector(name).unwrap().iter().map(|x| x + 1.0).collect()
        } else {
            a.vector(name).unwrap()
        };
        let first = got.iter().zip(&want).position(|(x, y)| x != y);
        assert!(
            got.len() == want.len() && first.is_none(),
            "{name}: differs at {first:?} (lengths {} / {})",
            got.len(),
            want.len()
        );
    }
    // Logits on the exact executor (f32 activations, f64 sums) on both sides: the same weights.
    let (diff, peak) = max_diff(
        &logits(weights(&refdir, true)),
        &logits(weights(&pkg, true)),
    );
    eprintln!("Q4_1/F16/BF16 GGUF vs dequantized HF: max |Δlogit| {diff:e}, max |logit| {peak}");
    assert!(peak > 0.1);
    // Identical weights on the same exact executor (tiles decode to the very f32 values the plain
    // reference holds): bit for bit.
    assert!(diff == 0.0, "max |Δlogit| {diff:e}");
}

#[test]
fn run_and_import_accept_a_qwen35_gguf_file() {
    let src = synth("cli", &SynthOptions::default());
    let (gguf, out, cache) = (tmp("cli.gguf"), tmp("cli_pkg"), tmp("cli_cache"));
    let _clean = Dirs(vec![src.clone(), gguf.clone(), out.clone(), cache.clone()]);
    write_gguf(&src, &gguf, &Plan::default());
    let xdna = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_xdna"))
            .args(args)
            .env("XDG_CACHE_HOME", &cache)
            .env("XDNA_BACKEND", "host")
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let g = gguf.to_string_lossy().into_owned();
    let (ok, _, err) = xdna(&[
        "pack",
        "import",
        &g,
        "-o",
        &out.to_string_lossy(),
        "--quiet",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("no kernel set"), "{err}");
    assert!(!out.join("kernels").exists());
    // `tokenizer.ggml.pre = "qwen35"` → Qwen3.5's split pattern in tokenizer.json.
    let tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer.json")).unwrap())
            .unwrap();
    assert_eq!(
        tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"],
        xdna::weights::tokenizer::QWEN35_PATTERN
    );
    // `run --model FILE.gguf`: imported into the cache, loaded as a hybrid on the host backend.
    let (ok, _, err) = xdna(&[
        "run",
        "--model",
        &g,
        "--prompt",
        "Hello",
        "--max-tokens",
        "4",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("hybrid") || err.contains("host"), "{err}");
}

#[test]
fn bad_qwen35_ggufs_are_named_errors() {
    let src = synth("errors", &SynthOptions::default());
    let _clean = Dirs(vec![src.clone()]);
    let case = |name: &str, plan: Plan| -> String {
        let (gguf, pkg) = (tmp(&format!("{name}.gguf")), tmp(&format!("{name}_pkg")));
        let _c = Dirs(vec![gguf.clone(), pkg.clone()]);
        write_gguf(&src, &gguf, &plan);
        match import(&gguf, &pkg) {
            Ok(()) => panic!("{name}: expected an error"),
            Err(e) => e.to_string(),
        }
    };
    let e = case(
        "missing",
        Plan {
            drop: Some("blk.0.ssm_a".into()),
            ..Plan::default()
        },
    );
    assert!(e.contains("blk.0.ssm_a"), "{e}");
    let e = case(
        "q4_0",
        Plan {
            types: BTreeMap::from([("ffn_up", Ty::Q4_0)]),
            ..Plan::default()
        },
    );
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("q4_0"),
        "{e}"
    );
    let e = case(
        "nokey",
        Plan {
            skip_key: Some("ssm.state_size"),
            ..Plan::default()
        },
    );
    assert!(e.contains("qwen35.ssm.state_size"), "{e}");
    let e = case(
        "moe",
        Plan {
            arch: "qwen35moe",
            ..Plan::default()
        },
    );
    assert!(e.contains("qwen35moe") && e.contains("experts"), "{e}");
}

#[test]
fn slow_reference_reads_the_imported_package_as_the_hf_one() {
    // `HybridReference` (f64, from the equations) on the GGUF-imported package (ssm_a instead of
    // A_log, norms with the 1 included) vs on the HF package: only ln(−ssm_a) in f64 differs.
    let src = synth("reference", &SynthOptions::default());
    let (gguf, pkg) = (tmp("reference.gguf"), tmp("reference_pkg"));
    let _clean = Dirs(vec![src.clone(), gguf.clone(), pkg.clone()]);
    write_gguf(&src, &gguf, &Plan::default());
    import(&gguf, &pkg).unwrap();
    let reference = |dir: &Path| {
        let p = Package::open_dir(dir).unwrap();
        xdna::model::reference::HybridReference::load(&p)
            .unwrap()
            .forward(&TOKENS)
            .unwrap()
            .0
    };
    let (a, b) = (reference(&src), reference(&pkg));
    let (diff, peak) = max_diff(&a, &b);
    eprintln!("HybridReference HF vs GGUF package: max |Δlogit| {diff:e}, max |logit| {peak}");
    assert!(peak > 0.1);
    assert!(diff <= 1e-5, "max |Δlogit| {diff:e}");
    // And the fast forward (exact projections) on the GGUF package agrees with it (as
    // tests/model_gdn.rs requires of the synthetic HF package: ≤ 2e-3).
    let (diff, _) = max_diff(&logits(weights(&pkg, true)), &b);
    eprintln!("fast exact vs HybridReference on the GGUF package: max |Δlogit| {diff:e}");
    assert!(diff <= 2e-3, "max |Δlogit| {diff:e}");
}
