//! Gated DeltaNet hybrid models: the fast forward (with exact projections) against the slow
//! reference written from the equations, config parsing, and the recurrent half of the verify
//! contract (errors, failed passes, truncate).

use std::path::PathBuf;
use std::sync::Arc;
use xdna::model::load::{load, open_package, LoadOptions};
use xdna::model::reference::HybridReference;
use xdna::model::synthetic::{write_synthetic, SynthArch, SynthOptions};
use xdna::model::{LayerKind, Model, ModelError};

#[path = "support/scratch_dir.rs"]
mod scratch_dir;
use scratch_dir::scratch_path;

/// A synthetic hybrid package written once per test binary (per options) into a temp dir.
fn synth(name: &str, o: &SynthOptions) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch_path("gdn", name);
    if !dir.join("model.q4nx").exists() {
        write_synthetic(&dir, o).expect("write synthetic package");
    }
    dir
}

fn hybrid_model(exact: bool, ctx: usize) -> (Arc<xdna::weights::Package>, Model) {
    let dir = synth("hybrid", &SynthOptions::default());
    let pkg = open_package(&dir).unwrap();
    let w = load(
        &pkg,
        &LoadOptions {
            exact,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    (pkg, Model::new(w, ctx).unwrap())
}

const TOKENS: [u32; 24] = [
    256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 300, 511, 7, 480, 3, 99,
    258, 400, 12,
];

#[test]
fn config_layout_of_the_synthetic_hybrid() {
    let (_, m) = hybrid_model(false, 64);
    let c = m.config();
    use LayerKind::*;
    assert_eq!(
        c.layer_kinds,
        vec![Linear, Linear, Attention, Linear, Linear, Attention]
    );
    let d = c.linear.as_ref().unwrap();
    // Hand values: key_dim 2·64, value_dim 4·64, conv_dim 2·128 + 256.
    assert_eq!((d.key_dim(), d.value_dim(), d.conv_dim()), (128, 256, 512));
    assert_eq!(c.rotary_dim, 16); // 64 · 0.25
    assert!(c.attn_output_gate && c.qk_norm && c.zero_centered_norms);
    assert_eq!(c.qkv_rows(), 2 * 4 * 64 + 2 * 2 * 64);
}

#[test]
fn full_attention_interval_without_layer_types() {
    let v = serde_json::json!({
        "model_type": "qwen3_next", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "vocab_size": 300, "full_attention_interval": 4,
        "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32
    });
    let c = xdna::model::ModelConfig::from_json(&v, "c.json").unwrap();
    let full: Vec<usize> = (0..8)
        .filter(|&i| c.layer_kind(i) == LayerKind::Attention)
        .collect();
    assert_eq!(full, vec![3, 7]);
    assert_eq!(c.linear.as_ref().unwrap().conv_kernel, 4);
    let mut bad = v.clone();
    bad["linear_num_key_heads"] = serde_json::json!(2);
    bad["linear_num_value_heads"] = serde_json::json!(3);
    let e = xdna::model::ModelConfig::from_json(&bad, "c.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("linear_num_value_heads"), "{e}");
}

/// The model layer's code with exact projections vs the f64 reference: logits at every position
/// and each GDN layer's final conv window and recurrent state.
#[test]
fn hybrid_matches_reference_from_the_equations() {
    let (pkg, mut m) = hybrid_model(true, 64);
    let r = HybridReference::load(&pkg).unwrap();
    let (ref_logits, ref_states) = r.forward(&TOKENS).unwrap();
    let mut worst = 0f32;
    // Prefill 5, then verify passes of 6 (commit 4), then sequential steps.
    let mut got: Vec<Vec<f32>> = Vec::new();
    m.prefill_with(&TOKENS[..5], 0, &mut |_, l| got.push(l.to_vec()))
        .unwrap();
    let out = m.step_batch_all(&TOKENS[5..11], &[]).unwrap();
    for i in 0..4 {
        got.push(out.logits(i).to_vec());
    }
    m.commit_verify_rows(4).unwrap();
    for &t in &TOKENS[9..] {
        got.push(m.step(t).unwrap().to_vec());
    }
    assert_eq!(got.len(), TOKENS.len());
    for (p, (g, e)) in got.iter().zip(&ref_logits).enumerate() {
        let d = g
            .iter()
            .zip(e)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        worst = worst.max(d);
        assert!(d < 2e-3, "position {p}: max |Δlogit| {d}");
    }
    let st = m.state();
    for (l, rs) in ref_states.iter().enumerate() {
        let v = st.layer_state(l).unwrap();
        match rs {
            Some(rs) => {
                let conv = v.conv.unwrap();
                let rec = v.recurrent.unwrap();
                let dc = conv
                    .iter()
                    .zip(&rs.conv)
                    .map(|(&a, &b)| (a as f64 - b).abs())
                    .fold(0f64, f64::max);
                let ds = rec
                    .iter()
                    .zip(&rs.s)
                    .map(|(&a, &b)| (a as f64 - b).abs())
                    .fold(0f64, f64::max);
                let mag = rs.s.iter().map(|x| x.abs()).fold(0f64, f64::max);
                assert!(dc < 1e-4 && ds < 1e-4, "layer {l}: conv {dc} state {ds}");
                assert!(mag > 1e-2, "layer {l}: state unexpectedly ~0 ({mag})");
            }
            None => assert!(v.recurrent.is_none() && v.keys.is_some()),
        }
    }
    eprintln!("max |Δlogit| vs reference: {worst:e}");
}

#[test]
fn contract_errors_and_failed_pass_keep_committed_recurrent_state() {
    let (_, mut m) = hybrid_model(false, 64);
    m.prefill(&TOKENS[..6]).unwrap();
    let before: Vec<Vec<f32>> = (0..6)
        .filter_map(|l| m.state().layer_state(l)?.recurrent.map(<[f32]>::to_vec))
        .collect();
    // Commit without a pass.
    assert!(matches!(
        m.commit_verify_rows(1),
        Err(ModelError::State { .. })
    ));
    // 17 rows refused.
    assert!(matches!(
        m.step_batch_all(&[1; 17], &[]),
        Err(ModelError::BatchRows { rows: 17, .. })
    ));
    m.step_batch_all(&TOKENS[6..10], &[]).unwrap();
    // Second pass before commit.
    assert!(matches!(
        m.step_batch_all(&[1], &[]),
        Err(ModelError::State { .. })
    ));
    // n out of range, pass stays pending.
    assert!(matches!(
        m.commit_verify_rows(0),
        Err(ModelError::Commit { n: 0, len: 4 })
    ));
    assert!(matches!(
        m.commit_verify_rows(5),
        Err(ModelError::Commit { n: 5, len: 4 })
    ));
    m.commit_verify_rows(2).unwrap();
    assert_eq!(m.position(), 8);
    let at8: Vec<Vec<f32>> = (0..6)
        .filter_map(|l| m.state().layer_state(l)?.recurrent.map(<[f32]>::to_vec))
        .collect();
    assert_ne!(before, at8);
    // A pass failing at layer 4 (after GDN layers 0, 1, 3 updated their state) leaves the
    // committed state at P = 8 untouched; a pass after the failed pass is refused.
    m.inject_failure_at_layer(Some(4));
    assert!(m.step_batch_all(&TOKENS[8..12], &[]).is_err());
    m.inject_failure_at_layer(None);
    assert!(matches!(
        m.step_batch_all(&[1], &[]),
        Err(ModelError::State { .. })
    ));
    let after: Vec<Vec<f32>> = (0..6)
        .filter_map(|l| m.state().layer_state(l)?.recurrent.map(<[f32]>::to_vec))
        .collect();
    assert_eq!(
        at8, after,
        "a failed pass changed the committed recurrent state"
    );
    m.recover();
    assert_eq!(m.position(), 8);
    // Truncate cannot rewind recurrent state: refused (a no-op truncate to P is fine).
    assert!(matches!(m.truncate(4), Err(ModelError::Unsupported { .. })));
    m.truncate(8).unwrap();
    // Reset zeroes the recurrent state.
    m.reset();
    for l in 0..6 {
        if let Some(s) = m.state().layer_state(l).unwrap().recurrent {
            assert!(s.iter().all(|&x| x == 0.0));
        }
    }
}

#[test]
fn failed_prefill_restores_recurrent_state() {
    let (_, mut m) = hybrid_model(false, 64);
    m.prefill(&TOKENS[..6]).unwrap();
    let snap: Vec<Vec<f32>> = (0..6)
        .filter_map(|l| m.state().layer_state(l)?.conv.map(<[f32]>::to_vec))
        .collect();
    m.inject_failure_at_layer(Some(3));
    assert!(m.prefill(&TOKENS[6..20]).is_err());
    m.inject_failure_at_layer(None);
    let now: Vec<Vec<f32>> = (0..6)
        .filter_map(|l| m.state().layer_state(l)?.conv.map(<[f32]>::to_vec))
        .collect();
    assert_eq!(snap, now);
    assert_eq!(m.position(), 6);
}

#[test]
fn synthetic_llama_loads_and_is_deterministic() {
    let o = SynthOptions {
        arch: SynthArch::Llama,
        layers: 2,
        seed: 5,
        ..SynthOptions::default()
    };
    let a = synth("llama_a", &o);
    let b = scratch_path("gdn", "llama_b");
    write_synthetic(&b, &o).unwrap();
    assert_eq!(
        std::fs::read(a.join("model.q4nx")).unwrap(),
        std::fs::read(b.join("model.q4nx")).unwrap()
    );
    let pkg = open_package(&a).unwrap();
    let mut m = Model::new(load(&pkg, &LoadOptions::default()).unwrap(), 32).unwrap();
    assert!(!m.config().has_recurrent());
    let l = m.prefill(&[256, 1, 2, 3]).unwrap();
    assert!(l.iter().all(|v| v.is_finite()));
}

/// Two hybrid sequences in one `step_sequences` pass (as the server batches them), partial
/// commits on both: each ends exactly where its own sequential steps end.
#[test]
fn two_sequences_in_one_pass_keep_separate_recurrent_state() {
    let (_, mut m) = hybrid_model(false, 64);
    let (pa, pb) = (&TOKENS[..5], &TOKENS[10..13]);
    let mut a = m.new_sequence(64).unwrap();
    let mut b = m.new_sequence(64).unwrap();
    let mut noop = |_: usize, _: &[f32]| {};
    m.prefill_sequence(&mut a, pa, usize::MAX, &mut noop)
        .unwrap();
    m.prefill_sequence(&mut b, pb, usize::MAX, &mut noop)
        .unwrap();
    let (da, db) = (&TOKENS[5..9], &TOKENS[13..16]);
    let out = m.step_sequences(&mut [(&mut a, da), (&mut b, db)]).unwrap();
    assert_eq!(out.rows(), 7);
    let row_b1 = out.logits(5).to_vec();
    m.commit_sequence(&mut a, 1).unwrap();
    m.commit_sequence(&mut b, 2).unwrap();
    // Sequential references.
    let mut ra = m.new_sequence(64).unwrap();
    let mut rb = m.new_sequence(64).unwrap();
    m.prefill_sequence(&mut ra, &TOKENS[..6], usize::MAX, &mut noop)
        .unwrap();
    m.prefill_sequence(&mut rb, &TOKENS[10..14], usize::MAX, &mut noop)
        .unwrap();
    let l = m.step_sequences(&mut [(&mut rb, &TOKENS[14..15])]).unwrap();
    assert_eq!(l.logits(0), &row_b1[..]);
    m.commit_sequence(&mut rb, 1).unwrap();
    for (got, want) in [(&a, &ra), (&b, &rb)] {
        assert_eq!(got.position(), want.position());
        for l in 0..6 {
            let (g, w) = (got.layer_state(l).unwrap(), want.layer_state(l).unwrap());
            assert_eq!(g.recurrent, w.recurrent, "layer {l}");
            assert_eq!(g.conv, w.conv, "layer {l}");
            assert_eq!(g.keys, w.keys, "layer {l}");
        }
    }
}

/// A hybrid sequence copied at its position continues exactly as the original; its recurrent
/// state exists only there, so a shorter prefix is refused.
#[test]
fn a_hybrid_state_copies_only_at_its_position() {
    let (_, mut m) = hybrid_model(false, 64);
    let mut noop = |_: usize, _: &[f32]| {};
    let mut a = m.new_sequence(64).unwrap();
    m.prefill_sequence(&mut a, &TOKENS[..6], usize::MAX, &mut noop)
        .unwrap();
    let mut b = m.new_sequence(64).unwrap();
    assert!(b.copy_prefix_from(&a, 4).is_err());
    assert_eq!(b.position(), 0);
    b.copy_prefix_from(&a, 6).unwrap();
    let mut la = Vec::new();
    let mut lb = Vec::new();
    m.prefill_sequence(&mut a, &TOKENS[6..9], 2, &mut |_, l| la = l.to_vec())
        .unwrap();
    m.prefill_sequence(&mut b, &TOKENS[6..9], 2, &mut |_, l| lb = l.to_vec())
        .unwrap();
    assert_eq!(la, lb);
    for l in 0..6 {
        let (x, y) = (a.layer_state(l).unwrap(), b.layer_state(l).unwrap());
        assert_eq!(x.recurrent, y.recurrent, "layer {l}");
        assert_eq!(x.conv, y.conv, "layer {l}");
        assert_eq!(x.keys, y.keys, "layer {l}");
    }
}
