//! The fast forward against the reference forward on the real SmolLM2 model, and the verify
//! contract (batched pass = sequential steps; commit(n) = never having run the rejected rows).

#[path = "model_common.rs"]
mod common;

use common::{max_diff, smollm2_gguf};
use xdna::model::reference::Reference;
use xdna::model::sample::argmax;
use xdna::model::{host_gguf, Model, ModelError};

/// Logit tolerance of the fast path against the reference, absolute, per logit.
/// Why: the fast path accumulates in f32 (reference: f64) and, through the kernels layer, may
/// quantize activations to q8 per 32-column block (relative error ≤ 1/254 per element, i.e. ≈ 0.4 %
/// of each block's max); over 30 layers that gives logit errors of a few hundredths on logits of
/// magnitude ≈ 20. 0.25 leaves margin and still catches any real bug (a RoPE sign or a KV
/// off-by-one moves logits by whole units).
const TOL: f32 = 0.25;

fn fast_model(ctx: usize) -> Option<Model> {
    let path = smollm2_gguf()?;
    let w = host_gguf::load(&path).expect("load fast weights");
    Some(Model::new(w, ctx).expect("model"))
}

const PROMPT: [u32; 8] = [504, 3458, 282, 4649, 314, 216, 9637, 30];

#[test]
fn fast_path_matches_reference_over_64_tokens() {
    let Some(path) = smollm2_gguf() else { return };
    let mut m = fast_model(256).unwrap();
    // 8 fixed tokens, then greedy continuation by the fast path up to 64 tokens.
    let mut toks: Vec<u32> = PROMPT.to_vec();
    let mut fast_logits: Vec<Vec<f32>> = Vec::new();
    m.prefill_with(&toks, 0, &mut |_, l| fast_logits.push(l.to_vec())).unwrap();
    while toks.len() < 64 {
        let next = argmax(fast_logits.last().unwrap());
        toks.push(next);
        let l = m.step(next).unwrap().to_vec();
        fast_logits.push(l);
    }
    let r = Reference::open(&path).unwrap();
    let ref_logits = r.forward(&toks, 0).unwrap();
    let mut worst = 0f32;
    let mut disagree = 0;
    for (p, (f, rl)) in fast_logits.iter().zip(&ref_logits).enumerate() {
        let (d, mag) = max_diff(f, rl);
        worst = worst.max(d);
        assert!(d <= TOL, "position {p}: max |Δlogit| {d} > {TOL} (|logit| ≤ {mag})");
        if argmax(f) != argmax(rl) {
            // Only a near-tie may flip: the reference's top-2 margin must be within 2·TOL.
            let mut s = rl.clone();
            s.sort_by(|a, b| b.total_cmp(a));
            assert!(s[0] - s[1] <= 2.0 * TOL, "position {p}: greedy token differs");
            disagree += 1;
        }
    }
    eprintln!("fast vs reference: max |Δlogit| = {worst}, greedy disagreements (near-ties) = {disagree}");
    assert!(disagree <= 2);
}

#[test]
fn batch_of_16_equals_16_steps_and_commit_drops_rejected_rows() {
    let Some(mut a) = fast_model(128) else { return };
    let mut b = fast_model(128).unwrap();
    a.prefill(&PROMPT).unwrap();
    b.prefill(&PROMPT).unwrap();
    let rows: Vec<u32> = (0..16).map(|i| 100 + 37 * i).collect();
    let batch: Vec<Vec<f32>> = {
        let out = a.step_batch_all(&rows, &[3, 29]).unwrap();
        assert_eq!(out.rows(), 16);
        assert_eq!(out.tap_layers(), &[3, 29]);
        (0..16).map(|i| out.logits(i).to_vec()).collect()
    };
    for (i, &t) in rows.iter().enumerate() {
        let l = b.step(t).unwrap();
        let (d, _) = max_diff(&batch[i], l);
        assert!(d < 1e-3, "row {i}: batched vs sequential differ by {d}");
    }
    // Accept 5 rows; the next pass must equal a model that only ever saw those 5.
    a.commit_verify_rows(5).unwrap();
    assert_eq!(a.position(), PROMPT.len() + 5);
    let mut c = fast_model(128).unwrap();
    c.prefill(&PROMPT).unwrap();
    for &t in &rows[..5] {
        c.step(t).unwrap();
    }
    let next = [7u32, 8, 9];
    let la: Vec<Vec<f32>> = {
        let o = a.step_batch_all(&next, &[]).unwrap();
        (0..3).map(|i| o.logits(i).to_vec()).collect()
    };
    a.commit_verify_rows(3).unwrap();
    for (i, &t) in next.iter().enumerate() {
        let l = c.step(t).unwrap();
        let (d, _) = max_diff(&la[i], l);
        assert!(d < 1e-3, "after commit(5): row {i} differs by {d}");
    }
    assert_eq!(a.position(), c.position());
}

#[test]
fn prefill_chunks_are_exact_across_the_128_boundary() {
    let Some(mut a) = fast_model(512) else { return };
    let mut b = fast_model(512).unwrap();
    let toks: Vec<u32> = (0..200).map(|i| ((i * 7919) % 49000) as u32 + 10).collect();
    let mut la = Vec::new();
    a.prefill_with(&toks, 120, &mut |i, l| la.push((i, l.to_vec()))).unwrap();
    assert_eq!(la.len(), 80);
    assert_eq!(la[0].0, 120);
    // b: 100 rows of prefill, then 16-row verify passes, then single steps.
    b.prefill(&toks[..100]).unwrap();
    let mut lb = Vec::new();
    let mut at = 100;
    while at < 200 {
        let n = (200 - at).min(16);
        let o = b.step_batch_all(&toks[at..at + n], &[]).unwrap();
        for i in 0..n {
            if at + i >= 120 {
                lb.push(o.logits(i).to_vec());
            }
        }
        b.commit_verify_rows(n).unwrap();
        at += n;
    }
    assert_eq!(a.position(), 200);
    assert_eq!(b.position(), 200);
    for ((i, x), y) in la.iter().zip(&lb) {
        let (d, _) = max_diff(x, y);
        assert!(d < 1e-3, "row {i}: chunked prefill vs verify passes differ by {d}");
    }
}

#[test]
fn verify_contract_errors_and_failed_pass() {
    let Some(mut m) = fast_model(64) else { return };
    let many = [1u32; 17];
    assert!(matches!(m.step_batch_all(&many, &[]), Err(ModelError::BatchRows { rows: 17, .. })));
    assert!(matches!(m.step_batch_all(&[], &[]), Err(ModelError::BatchRows { rows: 0, .. })));
    assert!(matches!(m.commit_verify_rows(1), Err(ModelError::State { .. })));
    m.step_batch_all(&[1, 2, 3], &[]).unwrap();
    assert!(matches!(m.step_batch_all(&[1], &[]), Err(ModelError::State { .. })));
    assert!(matches!(m.commit_verify_rows(0), Err(ModelError::Commit { n: 0, len: 3 })));
    assert!(matches!(m.commit_verify_rows(4), Err(ModelError::Commit { n: 4, len: 3 })));
    m.commit_verify_rows(3).unwrap();
    assert_eq!(m.position(), 3);
    assert!(matches!(m.step_batch_all(&[60000], &[]), Err(ModelError::Token { .. })));
    assert!(matches!(m.step_batch_all(&[1], &[30]), Err(ModelError::Tap { .. })));
    // A pass failing mid-way leaves the committed state untouched.
    let before = m.step_batch_all(&[5], &[]).unwrap().logits(0).to_vec();
    m.commit_verify_rows(1).unwrap();
    let mut m2 = fast_model(64).unwrap();
    m2.step_batch_all(&[1, 2, 3], &[]).unwrap();
    m2.commit_verify_rows(3).unwrap();
    m2.inject_failure_at_layer(Some(17));
    assert!(m2.step_batch_all(&[9, 9, 9, 9], &[]).is_err());
    assert!(matches!(m2.commit_verify_rows(1), Err(ModelError::State { .. })));
    assert!(matches!(m2.step_batch_all(&[5], &[]), Err(ModelError::State { .. })));
    m2.inject_failure_at_layer(None);
    m2.recover();
    assert_eq!(m2.position(), 3);
    let after = m2.step_batch_all(&[5], &[]).unwrap().logits(0).to_vec();
    let (d, _) = max_diff(&before, &after);
    assert!(d < 1e-4, "state after a failed pass differs by {d}");
    // Context limit.
    m2.commit_verify_rows(1).unwrap();
    let long = vec![1u32; 61];
    assert!(matches!(m2.prefill(&long), Err(ModelError::Context { .. })));
    assert_eq!(m2.position(), 4);
    m2.reset();
    assert_eq!(m2.position(), 0);
}
