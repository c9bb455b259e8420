//! `replay-check` and the verify contract on both model kinds: SmolLM2 (attention only) and the
//! synthetic Qwen3.5-style hybrid (Gated DeltaNet + gated attention). The baseline is always
//! plain sequential 1-row steps on a separate model over the same weights.

#[path = "model_common.rs"]
mod common;
#[path = "support/scratch_dir.rs"]
mod scratch_dir;
use scratch_dir::scratch_path;

use std::path::PathBuf;
use std::sync::Arc;
use xdna::model::load::{load, open_package, LoadOptions};
use xdna::model::replay_check::{self, ReplayCheckOptions};
use xdna::model::synthetic::{write_synthetic, SynthOptions};
use xdna::model::{CommitFault, Model, ModelError, ModelWeights, ReplayMode};

fn hybrid_weights() -> Arc<ModelWeights> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir: PathBuf = scratch_path("replay", "hybrid");
    if !dir.join("model.q4nx").exists() {
        write_synthetic(&dir, &SynthOptions::default()).unwrap();
    }
    let pkg = open_package(&dir).unwrap();
    Arc::new(load(&pkg, &LoadOptions::default()).unwrap())
}

fn smollm2_weights() -> Option<Arc<ModelWeights>> {
    let gguf = common::smollm2_gguf()?;
    let pkg = open_package(&gguf).unwrap();
    Some(Arc::new(load(&pkg, &LoadOptions::default()).unwrap()))
}

fn stream(vocab: usize) -> Vec<u32> {
    // A fixed pseudo-random stream (LCG), prefix 6 + 17 tokens.
    let mut x = 12345u64;
    (0..23)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn check(
    w: Arc<ModelWeights>,
    mode: ReplayMode,
    fault: Option<CommitFault>,
) -> replay_check::ReplayReport {
    let tokens = stream(w.config.vocab);
    replay_check::run(
        w,
        &ReplayCheckOptions {
            tokens,
            prefix: 6,
            max_m: 16,
            mode,
            fault,
            tolerance: 1e-3,
        },
    )
    .unwrap()
}

const KEEP: ReplayMode = ReplayMode {
    check: false,
    full_replay: false,
};
const FULL: ReplayMode = ReplayMode {
    check: false,
    full_replay: true,
};
const CHECK: ReplayMode = ReplayMode {
    check: true,
    full_replay: false,
};

#[test]
fn replay_check_passes_on_the_hybrid_in_every_mode() {
    let w = hybrid_weights();
    for mode in [KEEP, FULL, CHECK] {
        let r = check(Arc::clone(&w), mode, None);
        assert_eq!(r.cases, 136);
        assert!(r.passed(), "{mode:?}: {r:?}");
        assert_eq!(r.layers.len(), 6);
    }
}

#[test]
fn replay_check_fails_on_broken_commits() {
    let w = hybrid_weights();
    for (mode, fault) in [
        (KEEP, CommitFault::ReplayOneFewer),
        (FULL, CommitFault::ReplayOneFewer),
        (KEEP, CommitFault::KeepBatchState),
    ] {
        let r = check(Arc::clone(&w), mode, Some(fault));
        assert_eq!(r.verdict, "fail", "{mode:?} {fault:?} not caught: {r:?}");
        // The recurrent layers carry the difference; attention KV is unaffected.
        let gdn_worst = r
            .layers
            .iter()
            .filter(|l| l.kind == "linear_attention")
            .map(|l| l.recurrent_rel.max(l.conv_rel))
            .fold(0f32, f32::max);
        assert!(gdn_worst > 1e-2, "{fault:?}: {gdn_worst}");
    }
}

#[test]
fn replay_check_passes_on_smollm2_in_both_modes() {
    let Some(w) = smollm2_weights() else { return };
    for mode in [KEEP, FULL] {
        let r = check(Arc::clone(&w), mode, None);
        assert!(r.passed(), "{mode:?}: {r:?}");
        assert_eq!(r.layers.len(), 30);
    }
}

/// NPU_REPLAY_CHECK's comparison itself: with a broken replay, a fully accepted pass fails the
/// commit naming the layer, and the committed state at P stays usable.
#[test]
fn replay_check_mode_reports_a_disagreeing_replay() {
    let w = hybrid_weights();
    let mut m = Model::shared(w, 64).unwrap();
    m.set_replay_mode(CHECK);
    m.prefill(&[256, 1, 2, 3]).unwrap();
    m.step_batch_all(&[4, 5, 6], &[]).unwrap();
    m.commit_verify_rows(3).unwrap();
    m.inject_commit_fault(Some(CommitFault::ReplayOneFewer));
    m.step_batch_all(&[7, 8, 9], &[]).unwrap();
    let e = m.commit_verify_rows(3).unwrap_err();
    assert!(
        matches!(&e, ModelError::State { what } if what.contains("layer 0")),
        "{e}"
    );
    assert_eq!(m.position(), 7);
    m.inject_commit_fault(None);
    m.recover();
    // Continues exactly like a model that never saw the failed round.
    let mut fresh = Model::shared(m.weights_arc(), 64).unwrap();
    let a = fresh.prefill(&[256, 1, 2, 3, 4, 5, 6, 7]).unwrap().to_vec();
    let b = m.step(7).unwrap().to_vec();
    assert_eq!(a, b);
}

fn sixteen_rows_equal_sixteen_steps(w: Arc<ModelWeights>) {
    let toks = stream(w.config.vocab);
    let mut batched = Model::shared(Arc::clone(&w), 64).unwrap();
    let mut seq = Model::shared(w, 64).unwrap();
    batched.prefill(&toks[..4]).unwrap();
    seq.prefill(&toks[..4]).unwrap();
    let out = batched.step_batch_all(&toks[4..20], &[]).unwrap();
    let rows: Vec<Vec<f32>> = (0..16).map(|i| out.logits(i).to_vec()).collect();
    batched.commit_verify_rows(16).unwrap();
    for (i, row) in rows.iter().enumerate() {
        let l = seq.step(toks[4 + i]).unwrap();
        let (d, _) = common::max_diff(row, l);
        assert!(d <= 1e-3, "row {i}: max |Δlogit| {d}");
    }
}

#[test]
fn sixteen_row_pass_equals_sixteen_steps_on_the_hybrid() {
    sixteen_rows_equal_sixteen_steps(hybrid_weights());
}

#[test]
fn sixteen_row_pass_equals_sixteen_steps_on_smollm2() {
    let Some(w) = smollm2_weights() else { return };
    sixteen_rows_equal_sixteen_steps(w);
}

/// Rounds with drafts and rounds with zero drafts (a 1-row pass) interleaved: every layer's state
/// after every commit equals sequential steps (the vLLM #52942 bug class).
#[test]
fn zero_draft_rounds_keep_every_layer_state() {
    let w = hybrid_weights();
    let toks = stream(w.config.vocab);
    for mode in [KEEP, FULL] {
        let mut spec = Model::shared(Arc::clone(&w), 64).unwrap();
        spec.set_replay_mode(mode);
        let mut plain = Model::shared(Arc::clone(&w), 64).unwrap();
        spec.prefill(&toks[..3]).unwrap();
        plain.prefill(&toks[..3]).unwrap();
        let mut p = 3;
        // (rows, accepted): a partial round, zero-draft rounds, a full round, zero-draft again.
        for (rows, n) in [(5, 2), (1, 1), (1, 1), (4, 4), (1, 1), (6, 1), (1, 1)] {
            spec.step_batch_all(&toks[p..p + rows], &[]).unwrap();
            spec.commit_verify_rows(n).unwrap();
            for &t in &toks[p..p + n] {
                plain.step(t).unwrap();
            }
            p += n;
            assert_eq!(spec.position(), p);
            for l in 0..6 {
                let (a, b) = (
                    spec.state().layer_state(l).unwrap(),
                    plain.state().layer_state(l).unwrap(),
                );
                assert_eq!(a.keys, b.keys, "{mode:?} layer {l} keys at {p}");
                assert_eq!(a.values, b.values, "{mode:?} layer {l} values at {p}");
                assert_eq!(a.conv, b.conv, "{mode:?} layer {l} conv at {p}");
                assert_eq!(a.recurrent, b.recurrent, "{mode:?} layer {l} state at {p}");
            }
        }
    }
}

/// The binaries: `xdna pack synth` writes a loadable package with its kernel set, and
/// `replay-check` states its backend, exits 0 / 1 with a JSON verdict, honours
/// NPU_COMMIT_FULL_REPLAY, and under NPU_REPLAY_CHECK turns a broken replay into an error (exit 2)
/// naming the layer.
#[test]
fn replay_check_binary_exit_codes_and_env_modes() {
    let dir = scratch_path("replay", "cli");
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(["pack", "synth", "--arch", "qwen3_5", "--seed", "3", "-o"])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(st.success());
    assert!(dir.join("kernels/shapes.txt").exists());
    let run = |env: &[(&str, &str)], extra: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_replay-check"));
        c.arg("--model")
            .arg(&dir)
            .args(["--max-m", "5", "--json"])
            .args(extra)
            .env_remove("NPU_REPLAY_CHECK")
            .env_remove("NPU_COMMIT_FULL_REPLAY");
        for (k, v) in env {
            c.env(k, v);
        }
        let o = c.output().unwrap();
        let v: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
        (
            o.status.code(),
            v,
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, v, err) = run(&[], &[]);
    assert_eq!(code, Some(0));
    assert_eq!(v["verdict"], "pass");
    assert_eq!(v["cases"], 15);
    assert_eq!(v["layers"].as_array().unwrap().len(), 6);
    // The loader's status line reaches the user; a filter naming its target silences it.
    assert!(
        err.contains("xdna: backend auto → host: hybrid (Gated DeltaNet) model"),
        "{err}"
    );
    let (code, _, err) = run(&[("RUST_LOG", "xdna::status=off")], &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("backend auto"), "{err}");
    let (code, v, _) = run(&[], &["--fault", "keep-batch"]);
    assert_eq!((code, v["verdict"].as_str()), (Some(1), Some("fail")));
    let (code, v, _) = run(&[("NPU_COMMIT_FULL_REPLAY", "1")], &[]);
    assert_eq!((code, v["full_replay"].as_bool()), (Some(0), Some(true)));
    let (code, _, err) = run(
        &[("NPU_COMMIT_FULL_REPLAY", "1")],
        &["--fault", "replay-fewer"],
    );
    assert_eq!(code, Some(1), "{err}");
    let (code, _, err) = run(&[("NPU_REPLAY_CHECK", "1")], &["--fault", "replay-fewer"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("NPU_REPLAY_CHECK: layer 0"), "{err}");
}
