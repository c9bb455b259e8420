//! The fast forward against the reference forward on the real SmolLM2 model, and the verify
//! contract (batched pass = sequential steps; commit(n) = never having run the rejected rows).

#[path = "model_common.rs"]
mod common;

use common::{max_diff, smollm2_gguf};
use xdna::model::reference::Reference;
use xdna::model::sampling::argmax;
use xdna::model::{KvSlice, Model, ModelError};

/// Logit tolerance of the fast path against the exact (f32-activation, f64-sum) reference,
/// absolute, per logit (logits here have magnitude ≈ 15–35).
///
/// Why this size: the kernels layer rounds every projection's input to q8 per 32 values (ggml
/// q8_1: step d = max|x|/127, error ≤ d/2 per element, ≈ 0.4 % of the group's largest value).
/// SmolLM2 has outlier channels, so a group holding an outlier quantizes its other 31 values
/// coarsely; over 30 layers this gives measured max |Δlogit| ≈ 0.5–1.0 and rms ≈ 0.1–0.5 per
/// position. The rounding is also discontinuous: even a reference that applies the very same q8
/// rounding (`with_activation_q8`) differs from the fast path by the same order once positions > 0
/// (f32 vs f64 sums flip codes at rounding boundaries, and each flip is a full quantization step),
/// so no tighter per-logit oracle exists for q8 arithmetic. Distribution-level agreement is
/// checked by `MAX_MEAN_KL` here and by perplexity (≤ 0.5 %) in `model_perplexity.rs`.
/// Bugs are far larger (a RoPE sign flip or a KV off-by-one moves logits by several units).
const TOL: f32 = 1.5;
/// With exact projections (f32 activations) only f32-vs-f64 summation order differs from the
/// reference: logits agree to ~1e-3.
const TOL_EXACT: f32 = 0.005;
/// Mean KL(reference ‖ fast) over the 64 positions, in nats.
const MAX_MEAN_KL: f64 = 0.02;

fn kl(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let lse = |l: &[f32]| {
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        m + l.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
    };
    let (lp, lq) = (lse(p_logits), lse(q_logits));
    p_logits
        .iter()
        .zip(q_logits)
        .map(|(&a, &b)| {
            let (la, lb) = (a as f64 - lp, b as f64 - lq);
            la.exp() * (la - lb)
        })
        .sum()
}

fn fast_model(ctx: usize) -> Option<Model> {
    common::fast_model(ctx).map(|(_, m)| m)
}

const PROMPT: [u32; 8] = [504, 3458, 282, 4649, 314, 216, 9637, 30];

#[test]
fn fast_path_matches_reference_over_64_tokens() {
    let Some(path) = smollm2_gguf() else { return };
    let mut m = fast_model(256).unwrap();
    // 8 fixed tokens, then greedy continuation by the fast path up to 64 tokens.
    let mut toks: Vec<u32> = PROMPT.to_vec();
    let mut fast_logits: Vec<Vec<f32>> = Vec::new();
    m.prefill_with(&toks, 0, &mut |_, l| fast_logits.push(l.to_vec()))
        .unwrap();
    while toks.len() < 64 {
        let next = argmax(fast_logits.last().unwrap(), 0).unwrap();
        toks.push(next);
        let l = m.step(next).unwrap().to_vec();
        fast_logits.push(l);
    }
    let r = Reference::open(&path).unwrap();
    let ref_logits = r.forward(&toks, 0).unwrap();
    let mut worst = 0f32;
    let mut disagree = 0;
    let mut kl_sum = 0f64;
    for (p, (f, rl)) in fast_logits.iter().zip(&ref_logits).enumerate() {
        let (d, mag) = max_diff(f, rl);
        worst = worst.max(d);
        kl_sum += kl(rl, f);
        assert!(
            d <= TOL,
            "position {p}: max |Δlogit| {d} > {TOL} (|logit| ≤ {mag})"
        );
        if argmax(f, p).unwrap() != argmax(rl, p).unwrap() {
            // Only a near-tie may flip: the reference's top-2 margin must be within 2·TOL.
            let mut s = rl.clone();
            s.sort_by(|a, b| b.total_cmp(a));
            assert!(
                s[0] - s[1] <= 2.0 * TOL,
                "position {p}: greedy token differs"
            );
            disagree += 1;
        }
    }
    let mean_kl = kl_sum / 64.0;
    eprintln!(
        "fast vs reference: max |Δlogit| = {worst}, mean KL = {mean_kl:.5} nats, greedy near-tie flips = {disagree}/64"
    );
    assert!(disagree <= 2);
    assert!(mean_kl <= MAX_MEAN_KL, "mean KL {mean_kl}");
}

/// The fast forward's own code (norms, RoPE, attention, KV, chunking) with exact projections
/// against the reference: only f32-vs-f64 rounding remains, so the bound is tight.
#[test]
fn model_code_with_exact_projections_matches_reference_tightly() {
    let Some(path) = smollm2_gguf() else { return };
    let (_, mut m) = common::model_with(256, true).unwrap();
    let toks: Vec<u32> = (0..64)
        .map(|i| PROMPT[i % 8] + (i as u32 / 8) * 101)
        .collect();
    let mut fast = Vec::new();
    m.prefill_with(&toks, 0, &mut |_, l| fast.push(l.to_vec()))
        .unwrap();
    let r = Reference::open(&path).unwrap().forward(&toks, 0).unwrap();
    let mut worst = 0f32;
    for (p, (f, rl)) in fast.iter().zip(&r).enumerate() {
        let (d, _) = max_diff(f, rl);
        worst = worst.max(d);
        assert!(
            d <= TOL_EXACT,
            "position {p}: max |Δlogit| {d} > {TOL_EXACT}"
        );
        assert_eq!(
            argmax(f, p).unwrap(),
            argmax(rl, p).unwrap(),
            "position {p}"
        );
    }
    eprintln!("exact projections vs reference: max |Δlogit| = {worst}");
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
    a.prefill_with(&toks, 120, &mut |i, l| la.push((i, l.to_vec())))
        .unwrap();
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
        assert!(
            d < 1e-3,
            "row {i}: chunked prefill vs verify passes differ by {d}"
        );
    }
}

#[test]
fn verify_contract_errors_and_failed_pass() {
    let Some(mut m) = fast_model(64) else { return };
    let many = [1u32; 17];
    assert!(matches!(
        m.step_batch_all(&many, &[]),
        Err(ModelError::BatchRows { rows: 17, .. })
    ));
    assert!(matches!(
        m.step_batch_all(&[], &[]),
        Err(ModelError::BatchRows { rows: 0, .. })
    ));
    assert!(matches!(
        m.commit_verify_rows(1),
        Err(ModelError::State { .. })
    ));
    m.step_batch_all(&[1, 2, 3], &[]).unwrap();
    assert!(matches!(
        m.step_batch_all(&[1], &[]),
        Err(ModelError::State { .. })
    ));
    assert!(matches!(
        m.commit_verify_rows(0),
        Err(ModelError::Commit { n: 0, len: 3 })
    ));
    assert!(matches!(
        m.commit_verify_rows(4),
        Err(ModelError::Commit { n: 4, len: 3 })
    ));
    m.commit_verify_rows(3).unwrap();
    assert_eq!(m.position(), 3);
    assert!(matches!(
        m.step_batch_all(&[60000], &[]),
        Err(ModelError::Token { .. })
    ));
    assert!(matches!(
        m.step_batch_all(&[1], &[30]),
        Err(ModelError::Tap { .. })
    ));
    // A pass failing mid-way leaves the committed state untouched.
    let before = m.step_batch_all(&[5], &[]).unwrap().logits(0).to_vec();
    m.commit_verify_rows(1).unwrap();
    let mut m2 = fast_model(64).unwrap();
    m2.step_batch_all(&[1, 2, 3], &[]).unwrap();
    m2.commit_verify_rows(3).unwrap();
    m2.inject_failure_at_layer(Some(17));
    assert!(m2.step_batch_all(&[9, 9, 9, 9], &[]).is_err());
    assert!(matches!(
        m2.commit_verify_rows(1),
        Err(ModelError::State { .. })
    ));
    assert!(matches!(
        m2.step_batch_all(&[5], &[]),
        Err(ModelError::State { .. })
    ));
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

/// Several sequences in one pass (a server's decode rows): each row's logits equal what that
/// sequence gives alone, commits are per sequence, and a partial commit on one leaves the others.
#[test]
fn sequences_batched_in_one_pass_equal_each_sequence_alone() {
    let Some(mut server) = fast_model(128) else {
        return;
    };
    let prompts: [&[u32]; 3] = [&PROMPT, &[1, 504, 3458, 282], &[9637, 30, 216, 314, 4649]];
    let mut states = Vec::new();
    let mut alone = Vec::new();
    for p in prompts {
        let mut st = server.new_sequence(64).unwrap();
        server
            .prefill_sequence(&mut st, p, p.len() - 1, &mut |_, _| {})
            .unwrap();
        assert_eq!(st.position(), p.len());
        states.push(st);
        let mut m = fast_model(64).unwrap();
        m.prefill(p).unwrap();
        alone.push(m);
    }
    // Round 1: 1 + 3 + 2 rows; commit all, 2 and 1 of them.
    let feeds: [&[u32]; 3] = [&[42], &[7, 8, 9], &[1000, 2000]];
    let commits = [1usize, 2, 1];
    let batched: Vec<Vec<f32>> = {
        let [a, b, c] = &mut states[..] else {
            unreachable!()
        };
        let mut batch = [(a, feeds[0]), (b, feeds[1]), (c, feeds[2])];
        let out = server.step_sequences(&mut batch).unwrap();
        assert_eq!(out.rows(), 6);
        (0..6).map(|i| out.logits(i).to_vec()).collect()
    };
    let mut row = 0;
    for (s, feed) in feeds.iter().enumerate() {
        for (j, &t) in feed.iter().enumerate() {
            let (d, _) = max_diff(&batched[row], alone[s].step(t).unwrap());
            assert!(
                d < 1e-3,
                "sequence {s} row {j}: batched vs alone differ by {d}"
            );
            row += 1;
        }
    }
    for (s, st) in states.iter_mut().enumerate() {
        assert_eq!(st.pending_rows(), Some(feeds[s].len()));
        server.commit_sequence(st, commits[s]).unwrap();
        // The lone model saw every fed token; roll it back to the accepted prefix.
        let keep = prompts[s].len() + commits[s];
        alone[s].truncate(keep).unwrap();
        assert_eq!(st.position(), keep);
    }
    // Round 2: one row each, after the partial commits.
    let next = [11u32, 12, 13];
    let batched: Vec<Vec<f32>> = {
        let [a, b, c] = &mut states[..] else {
            unreachable!()
        };
        let mut batch = [(a, &next[0..1]), (b, &next[1..2]), (c, &next[2..3])];
        let out = server.step_sequences(&mut batch).unwrap();
        (0..3).map(|i| out.logits(i).to_vec()).collect()
    };
    for s in 0..3 {
        let (d, _) = max_diff(&batched[s], alone[s].step(next[s]).unwrap());
        assert!(d < 1e-3, "round 2, sequence {s}: differ by {d}");
        server.commit_sequence(&mut states[s], 1).unwrap();
    }
    // 17 rows in total are refused; a pending state is refused.
    let big = [5u32; 16];
    {
        let [a, b, _] = &mut states[..] else {
            unreachable!()
        };
        let mut batch = [(a, &big[..]), (b, &next[..1])];
        assert!(matches!(
            server.step_sequences(&mut batch),
            Err(ModelError::BatchRows { rows: 17, .. })
        ));
    }
    {
        let [a, _, _] = &mut states[..] else {
            unreachable!()
        };
        let mut batch = [(a, &next[..1])];
        server.step_sequences(&mut batch).unwrap();
    }
    {
        let [a, _, _] = &mut states[..] else {
            unreachable!()
        };
        let mut batch = [(a, &next[..1])];
        assert!(matches!(
            server.step_sequences(&mut batch),
            Err(ModelError::State { .. })
        ));
    }
}

/// The fast path caches keys and values in f16 and exact runs in f32; a sequence state made by one
/// kind of model is refused by the other with an error naming both types.
#[test]
fn kv_cache_types_follow_the_model_and_a_mismatch_is_refused() {
    let Some(mut fast) = fast_model(64) else {
        return;
    };
    let (_, mut exact) = common::model_with(64, true).unwrap();
    let mut fast_state = fast.new_sequence(16).unwrap();
    fast.prefill_sequence(&mut fast_state, &PROMPT[..3], 2, &mut |_, _| {})
        .unwrap();
    let mut exact_state = exact.new_sequence(16).unwrap();
    exact
        .prefill_sequence(&mut exact_state, &PROMPT[..3], 2, &mut |_, _| {})
        .unwrap();
    let kvd = fast.weights().config.kv_dim();
    match fast_state.layer_state(0).unwrap().keys {
        Some(KvSlice::F16(k)) => assert_eq!(k.len(), 3 * kvd),
        other => panic!("fast path cache: {other:?}"),
    }
    match exact_state.layer_state(0).unwrap().values {
        Some(KvSlice::F32(v)) => assert_eq!(v.len(), 3 * kvd),
        other => panic!("exact cache: {other:?}"),
    }
    let next = [PROMPT[3]];
    let e = fast
        .step_sequences(&mut [(&mut exact_state, &next[..])])
        .err();
    assert!(
        matches!(&e, Some(ModelError::State { what }) if what.contains("f32 KV cache") && what.contains("keeping f16")),
        "{e:?}"
    );
    let e = exact
        .step_sequences(&mut [(&mut fast_state, &next[..])])
        .err();
    assert!(
        matches!(&e, Some(ModelError::State { what }) if what.contains("f16 KV cache") && what.contains("keeping f32")),
        "{e:?}"
    );
    // prefill_sequence checks the state it is given the same way.
    let e = fast
        .prefill_sequence(&mut exact_state, &next, 0, &mut |_, _| {})
        .err();
    assert!(
        matches!(&e, Some(ModelError::State { what }) if what.contains("f32 KV cache")),
        "{e:?}"
    );
    // Both states are still usable by their own models.
    fast.step_sequences(&mut [(&mut fast_state, &next[..])])
        .unwrap();
    exact
        .step_sequences(&mut [(&mut exact_state, &next[..])])
        .unwrap();
}

/// An early-exit view runs the first E layers and the head: its logits equal the full model's
/// hidden state after layer E-1 put through the final norm and lm_head by hand.
#[test]
fn early_exit_view_is_the_head_over_the_tap_of_its_last_layer() {
    let Some(mut full) = fast_model(64) else {
        return;
    };
    let exit = 10;
    let mut early = Model::early_exit(full.weights_arc(), 64, exit).unwrap();
    assert_eq!(early.run_layers(), exit);
    assert!(Model::early_exit(full.weights_arc(), 64, 0).is_err());
    assert!(Model::early_exit(full.weights_arc(), 64, 31).is_err());
    full.prefill(&PROMPT).unwrap();
    early.prefill(&PROMPT).unwrap();
    let rows = [42u32, 43];
    let (taps, full_last): (Vec<Vec<f32>>, Vec<f32>) = {
        let out = full.step_batch_all(&rows, &[exit - 1]).unwrap();
        (
            (0..2).map(|i| out.tap(0, i).to_vec()).collect(),
            out.logits(1).to_vec(),
        )
    };
    let out = early.step_batch_all(&rows, &[]).unwrap();
    let w = full.weights();
    let hidden = w.config.hidden;
    for (i, h) in taps.iter().enumerate() {
        let ms = h.iter().map(|v| v * v).sum::<f32>() / hidden as f32;
        let inv = 1.0 / (ms + w.config.rms_eps as f32).sqrt();
        let normed: Vec<f32> = h
            .iter()
            .zip(&w.final_norm)
            .map(|(v, g)| v * inv * g)
            .collect();
        let mut logits = vec![0f32; w.config.vocab];
        w.lm_head
            .gemm(&normed, 1, &mut logits, xdna::model::RowFamily::M16)
            .unwrap();
        let (d, _) = max_diff(out.logits(i), &logits);
        assert!(d < 1e-2, "row {i}: early exit vs head(tap) differ by {d}");
    }
    // And it really is a different (shallower) model.
    let (d, _) = max_diff(out.logits(1), &full_last);
    assert!(d > 0.5, "early-exit logits equal the full model's ({d})");
    // Taps past the exit are refused.
    early.commit_verify_rows(2).unwrap();
    assert!(matches!(
        early.step_batch_all(&[1], &[exit]),
        Err(ModelError::Tap { .. })
    ));
}

#[test]
fn truncate_forgets_committed_tokens() {
    let Some(mut a) = fast_model(64) else { return };
    let mut b = fast_model(64).unwrap();
    a.prefill(&PROMPT).unwrap();
    a.step(77).unwrap();
    a.step(78).unwrap();
    assert!(a.truncate(PROMPT.len() + 3).is_err());
    a.truncate(PROMPT.len()).unwrap();
    b.prefill(&PROMPT).unwrap();
    let (d, _) = max_diff(a.step(99).unwrap(), b.step(99).unwrap());
    assert!(d < 1e-3, "after truncate: {d}");
    a.step_batch_all(&[1], &[]).unwrap();
    assert!(matches!(a.truncate(1), Err(ModelError::State { .. })));
}

#[test]
fn sequences_prefilled_in_one_pass_equal_each_prefilled_alone() {
    let Some(mut server) = fast_model(128) else {
        return;
    };
    // 8 + 4 + 5 = 17 rows in one pass (m128 family); alone each is its own m16 pass. Rows do not
    // depend on their batch, so the last-row logits and the next step are bit-identical.
    let prompts: [&[u32]; 3] = [&PROMPT, &[1, 504, 3458, 282], &[9637, 30, 216, 314, 4649]];
    let mut states: Vec<_> = prompts
        .iter()
        .map(|_| server.new_sequence(64).unwrap())
        .collect();
    let mut batched = vec![Vec::new(); 3];
    {
        let [a, b, c] = &mut states[..] else {
            unreachable!()
        };
        let mut batch = [(a, prompts[0]), (b, prompts[1]), (c, prompts[2])];
        server
            .prefill_sequences(&mut batch, &mut |i, l| batched[i] = l.to_vec())
            .unwrap();
    }
    for (s, p) in prompts.iter().enumerate() {
        assert_eq!(states[s].position(), p.len());
        let mut alone_state = server.new_sequence(64).unwrap();
        let mut alone = Vec::new();
        server
            .prefill_sequence(&mut alone_state, p, p.len() - 1, &mut |_, l| {
                alone = l.to_vec()
            })
            .unwrap();
        assert_eq!(batched[s], alone, "sequence {s}: last-row logits differ");
        // The committed KV is the same: the next token's logits agree too.
        let next = [77u32];
        let a = server
            .step_sequences(&mut [(&mut states[s], &next[..])])
            .unwrap()
            .logits(0)
            .to_vec();
        server.commit_sequence(&mut states[s], 1).unwrap();
        let b = server
            .step_sequences(&mut [(&mut alone_state, &next[..])])
            .unwrap()
            .logits(0)
            .to_vec();
        assert_eq!(a, b, "sequence {s}: step after the prefill differs");
    }
    // Errors: too many rows, a pending state; nothing changes.
    let mut big = server.new_sequence(256).unwrap();
    let long = vec![1u32; 129];
    assert!(server
        .prefill_sequences(&mut [(&mut big, &long[..])], &mut |_, _| {})
        .is_err());
    assert_eq!(big.position(), 0);
}

/// A prompt prefix copied from another sequence continues exactly as if the copy had read it
/// (the server's prefix cache and `n` samples of one prompt rest on this).
#[test]
fn a_copied_prefix_continues_exactly_as_a_cold_prefill() {
    let Some(mut m) = fast_model(128) else {
        return;
    };
    let mut noop = |_: usize, _: &[f32]| {};
    let mut cold = m.new_sequence(64).unwrap();
    let mut want = Vec::new();
    m.prefill_sequence(&mut cold, &PROMPT, PROMPT.len() - 1, &mut |_, l| {
        want = l.to_vec()
    })
    .unwrap();
    for k in [1, 5, PROMPT.len() - 1] {
        let mut warm = m.new_sequence(64).unwrap();
        warm.copy_prefix_from(&cold, k).unwrap();
        assert_eq!(warm.position(), k);
        let mut got = Vec::new();
        m.prefill_sequence(
            &mut warm,
            &PROMPT[k..],
            PROMPT.len() - k - 1,
            &mut |_, l| got = l.to_vec(),
        )
        .unwrap();
        assert_eq!(
            got, want,
            "prefix of {k}: last-row logits differ from the cold prefill"
        );
    }
    // The whole sequence copied: the next step agrees too.
    let mut twin = m.new_sequence(64).unwrap();
    twin.copy_prefix_from(&cold, PROMPT.len()).unwrap();
    let next = [77u32];
    let a = m
        .step_sequences(&mut [(&mut cold, &next[..])])
        .unwrap()
        .logits(0)
        .to_vec();
    // A state waiting for its commit is neither copied nor copied into.
    let mut other = m.new_sequence(64).unwrap();
    assert!(other.copy_prefix_from(&cold, 1).is_err());
    m.commit_sequence(&mut cold, 1).unwrap();
    let b = m
        .step_sequences(&mut [(&mut twin, &next[..])])
        .unwrap()
        .logits(0)
        .to_vec();
    assert_eq!(a, b);
    assert!(other.copy_prefix_from(&twin, 1).is_err());
    m.commit_sequence(&mut twin, 1).unwrap();
    // Past the source's position, or into a smaller context: refused, nothing changed.
    let mut small = m.new_sequence(4).unwrap();
    assert!(small.copy_prefix_from(&cold, PROMPT.len() + 2).is_err());
    assert!(small.copy_prefix_from(&cold, 5).is_err());
    assert_eq!(small.position(), 0);
    // The refused copies left it usable.
    m.prefill_sequence(&mut small, &PROMPT[..2], usize::MAX, &mut noop)
        .unwrap();
}

/// The tapped multi-sequence passes a server's DFlash drafts read: each row's hidden states after
/// the tap layers equal those of the sequence run alone (prefill and verify pass), rows laid out
/// sequence after sequence; the logits are those of the untapped passes; a tap past the last
/// layer is refused before anything runs.
#[test]
fn tapped_sequence_passes_return_each_rows_hidden_states() {
    let Some(mut server) = fast_model(128) else {
        return;
    };
    let taps = [0usize, 13, 29];
    let hidden = server.config().hidden;
    let prompts: [&[u32]; 2] = [&PROMPT, &[9637, 30, 216, 314, 4649]];
    let mut states: Vec<_> = (0..2).map(|_| server.new_sequence(64).unwrap()).collect();
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let mut last = vec![Vec::new(); 2];
    {
        let [a, b] = &mut states[..] else {
            unreachable!()
        };
        let mut batch = [(a, prompts[0]), (b, prompts[1])];
        server
            .prefill_sequences_tapped(
                &mut batch,
                &taps,
                &mut |i, l| last[i] = l.to_vec(),
                &mut |out| {
                    assert_eq!(out.rows(), 13);
                    rows = (0..out.rows())
                        .map(|r| {
                            (0..taps.len())
                                .flat_map(|t| out.tap(t, r).to_vec())
                                .collect()
                        })
                        .collect();
                },
            )
            .unwrap();
    }
    let mut first = 0;
    for (s, p) in prompts.iter().enumerate() {
        let mut alone = server.new_sequence(64).unwrap();
        let mut alone_rows: Vec<Vec<f32>> = Vec::new();
        let mut alone_last = Vec::new();
        server
            .prefill_sequence_tapped(
                &mut alone,
                p,
                p.len() - 1,
                &mut |_, l| alone_last = l.to_vec(),
                &taps,
                &mut |out| {
                    alone_rows.extend((0..out.rows()).map(|r| {
                        (0..taps.len())
                            .flat_map(|t| out.tap(t, r).to_vec())
                            .collect::<Vec<f32>>()
                    }))
                },
            )
            .unwrap();
        assert_eq!(alone_rows.len(), p.len());
        assert_eq!(alone_rows[0].len(), taps.len() * hidden);
        assert_eq!(
            &rows[first..first + p.len()],
            &alone_rows[..],
            "prefill taps of {s}"
        );
        assert_eq!(last[s], alone_last, "prefill logits of {s}");
        first += p.len();
    }
    // A verify pass over both: 3 + 2 rows; each sequence's rows equal its pass alone.
    let drafts: [&[u32]; 2] = [&[77, 504, 3458], &[282, 30]];
    let (batched_taps, batched_logits): (Vec<Vec<f32>>, Vec<Vec<f32>>) = {
        let [a, b] = &mut states[..] else {
            unreachable!()
        };
        let out = server
            .step_sequences_tapped(&mut [(a, drafts[0]), (b, drafts[1])], &taps)
            .unwrap();
        (0..out.rows())
            .map(|r| {
                let t: Vec<f32> = (0..taps.len())
                    .flat_map(|t| out.tap(t, r).to_vec())
                    .collect();
                (t, out.logits(r).to_vec())
            })
            .unzip()
    };
    for state in states.iter_mut() {
        server.commit_sequence(state, 1).unwrap();
    }
    let mut first = 0;
    for (s, d) in drafts.iter().enumerate() {
        let mut alone = server.new_sequence(64).unwrap();
        server
            .prefill_sequence(&mut alone, prompts[s], usize::MAX, &mut |_, _| {})
            .unwrap();
        let out = server
            .step_sequences_tapped(&mut [(&mut alone, d)], &taps)
            .unwrap();
        for r in 0..d.len() {
            let t: Vec<f32> = (0..taps.len())
                .flat_map(|t| out.tap(t, r).to_vec())
                .collect();
            assert_eq!(batched_taps[first + r], t, "verify taps of {s}, row {r}");
            assert_eq!(
                batched_logits[first + r],
                out.logits(r),
                "verify logits of {s}, row {r}"
            );
        }
        first += d.len();
    }
    // A tap past the last layer: refused, nothing fed.
    let mut fresh = server.new_sequence(64).unwrap();
    assert!(matches!(
        server.prefill_sequences_tapped(
            &mut [(&mut fresh, &PROMPT[..])],
            &[30],
            &mut |_, _| {},
            &mut |_| {}
        ),
        Err(ModelError::Tap { .. })
    ));
    assert_eq!(fresh.position(), 0);
}
