//! `replay-check`: does `step_batch_all(M rows)` + `commit_verify_rows(n)` leave exactly the state
//! that `n` plain sequential steps leave? For every M = 1..=max_m and n = 1..=M it compares, per
//! layer, the committed KV (positions `0..P`), the conv window and the recurrent state, plus the
//! logits of the next token, and reports the largest differences and a verdict.
//!
//! The baseline is a separate [`Model`] over the same weights that only ever runs 1-row passes
//! with full acceptance (its commits never restore or replay), so a broken rollback cannot hide in
//! both sides at once.

use std::sync::Arc;

use super::forward::Model;
use super::layers::ModelWeights;
#[cfg(feature = "fault-injection")]
use super::sequence::CommitFault;
use super::sequence::{ReplayMode, SequenceState};
use super::ModelError;

/// What to check.
#[derive(Clone, Debug)]
pub struct ReplayCheckOptions {
    /// The token stream: `prefix` tokens are prefilled, the next `max_m + 1` are verified.
    pub tokens: Vec<u32>,
    /// Tokens prefilled before the verify passes.
    pub prefix: usize,
    /// Largest pass (≤ 16).
    pub max_m: usize,
    /// Commit mode of the model under test.
    pub mode: ReplayMode,
    /// A deliberately broken commit (to prove the check catches it).
    #[cfg(feature = "fault-injection")]
    pub fault: Option<CommitFault>,
    /// Largest accepted difference, relative to the largest magnitude of the compared quantity
    /// (per layer and kind of state, and for the logits).
    pub tolerance: f32,
}

/// Largest differences of one layer over every (M, n).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LayerDiff {
    /// The layer.
    pub layer: usize,
    /// `"attention"` or `"linear"`.
    pub kind: &'static str,
    /// Largest absolute difference of the committed keys and values.
    pub kv_abs: f32,
    /// The same, relative to their largest magnitude.
    pub kv_rel: f32,
    /// Largest absolute difference of the conv window.
    pub conv_abs: f32,
    /// The same, relative to its largest magnitude.
    pub conv_rel: f32,
    /// Largest absolute difference of the recurrent state.
    pub recurrent_abs: f32,
    /// The same, relative to its largest magnitude.
    pub recurrent_rel: f32,
    /// The pass size M of the (M, n) with the largest relative difference of this layer.
    pub worst_m: usize,
    /// The accepted rows n of that (M, n).
    pub worst_n: usize,
}

/// The outcome.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReplayReport {
    /// `"pass"` or `"fail"`.
    pub verdict: &'static str,
    /// (M, n) cases run.
    pub cases: usize,
    /// The tolerance the verdict used.
    pub tolerance: f32,
    /// Largest absolute difference of the next token's logits.
    pub logits_abs: f32,
    /// The same, relative to their largest magnitude.
    pub logits_rel: f32,
    /// Per layer: its largest differences.
    pub layers: Vec<LayerDiff>,
}

impl ReplayReport {
    /// Whether every difference was within the tolerance.
    pub fn passed(&self) -> bool {
        self.verdict == "pass"
    }
}

/// Owned copy of one layer's committed state.
#[derive(Clone, Default)]
struct LayerCopy {
    kv: Vec<f32>,
    conv: Vec<f32>,
    rec: Vec<f32>,
}

fn copy_state(seq: &SequenceState) -> Vec<LayerCopy> {
    (0..seq.layers())
        .filter_map(|l| seq.layer_state(l))
        .map(|v| {
            let mut kv = Vec::new();
            if let (Some(k), Some(vv)) = (v.keys, v.values) {
                // Widening to f32 is exact: the comparison sees the cached values.
                kv.extend(k.to_f32_vec());
                kv.extend(vv.to_f32_vec());
            }
            LayerCopy {
                kv,
                conv: v.conv.map(<[f32]>::to_vec).unwrap_or_default(),
                rec: v.recurrent.map(<[f32]>::to_vec).unwrap_or_default(),
            }
        })
        .collect()
}

/// (max |a − b|, that divided by max |b|).
fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    if a.len() != b.len() {
        return (f32::INFINITY, f32::INFINITY);
    }
    let mut d = 0f32;
    let mut mag = 0f32;
    for (&x, &y) in a.iter().zip(b) {
        d = d.max((x - y).abs());
        mag = mag.max(y.abs());
    }
    (d, if d == 0.0 { 0.0 } else { d / mag.max(1e-12) })
}

/// One 1-row pass + commit on `seq`; returns the logits.
fn step_seq(m: &mut Model, seq: &mut SequenceState, t: u32) -> Result<Vec<f32>, ModelError> {
    let l = m
        .step_sequences(&mut [(&mut *seq, &[t][..])])?
        .logits(0)
        .to_vec();
    m.commit_sequence(seq, 1)?;
    Ok(l)
}

/// Run the check over `w`.
pub fn run(w: Arc<ModelWeights>, o: &ReplayCheckOptions) -> Result<ReplayReport, ModelError> {
    let max_m = o.max_m.clamp(1, super::MAX_VERIFY_ROWS);
    if o.prefix == 0 || o.tokens.len() < o.prefix + max_m + 1 {
        return Err(ModelError::Context {
            what: format!(
                "replay-check needs a prefix ≥ 1 and {} more tokens, got {} tokens with prefix {}",
                max_m + 1,
                o.tokens.len(),
                o.prefix
            ),
        });
    }
    let ctx = o.prefix + max_m + 2;
    let mut base = Model::shared(Arc::clone(&w), ctx)?;
    base.set_replay_mode(ReplayMode::default());
    let mut test = Model::shared(Arc::clone(&w), ctx)?;
    test.set_replay_mode(o.mode);
    #[cfg(feature = "fault-injection")]
    test.inject_commit_fault(o.fault);
    let prefix = &o.tokens[..o.prefix];
    let stream = &o.tokens[o.prefix..];
    let mut noop = |_: usize, _: &[f32]| {};
    // Baseline: the state after n sequential steps (states[n]) and the logits of the next
    // token from that state (next_logits[n]).
    let mut seq = base.new_sequence(ctx)?;
    base.prefill_sequence(&mut seq, prefix, usize::MAX, &mut noop)?;
    let mut states = vec![Vec::new()];
    let mut next_logits = vec![Vec::new()];
    for (i, &t) in stream[..=max_m].iter().enumerate() {
        let l = step_seq(&mut base, &mut seq, t)?;
        if i >= 1 {
            next_logits.push(l);
        }
        if i < max_m {
            states.push(copy_state(&seq));
        }
    }
    let layers = w.layers.len();
    let mut rows: Vec<LayerDiff> = (0..layers)
        .map(|l| LayerDiff {
            layer: l,
            kind: match w.config.layer_kind(l) {
                super::LayerKind::Attention => "attention",
                super::LayerKind::Linear => "linear_attention",
            },
            ..LayerDiff::default()
        })
        .collect();
    let mut worst_rel = vec![0f32; layers];
    let (mut logits_abs, mut logits_rel) = (0f32, 0f32);
    let mut cases = 0;
    for m in 1..=max_m {
        for n in 1..=m {
            let mut seq = test.new_sequence(ctx)?;
            test.prefill_sequence(&mut seq, prefix, usize::MAX, &mut noop)?;
            test.step_sequences(&mut [(&mut seq, &stream[..m])])?;
            test.commit_sequence(&mut seq, n)?;
            if seq.position() != o.prefix + n {
                return Err(ModelError::State {
                    what: format!(
                        "M {m} n {n}: position {} after commit, expected {}",
                        seq.position(),
                        o.prefix + n
                    ),
                });
            }
            let got = copy_state(&seq);
            for (l, (g, e)) in got.iter().zip(&states[n]).enumerate() {
                let r = &mut rows[l];
                let (ka, kr) = diff(&g.kv, &e.kv);
                let (ca, cr) = diff(&g.conv, &e.conv);
                let (sa, sr) = diff(&g.rec, &e.rec);
                r.kv_abs = r.kv_abs.max(ka);
                r.kv_rel = r.kv_rel.max(kr);
                r.conv_abs = r.conv_abs.max(ca);
                r.conv_rel = r.conv_rel.max(cr);
                r.recurrent_abs = r.recurrent_abs.max(sa);
                r.recurrent_rel = r.recurrent_rel.max(sr);
                let worst = kr.max(cr).max(sr);
                if worst > worst_rel[l] || (m, n) == (1, 1) {
                    worst_rel[l] = worst_rel[l].max(worst);
                    r.worst_m = m;
                    r.worst_n = n;
                }
            }
            let l = step_seq(&mut test, &mut seq, stream[n])?;
            let (a, r) = diff(&l, &next_logits[n]);
            logits_abs = logits_abs.max(a);
            logits_rel = logits_rel.max(r);
            cases += 1;
        }
    }
    let ok = logits_rel <= o.tolerance && worst_rel.iter().all(|&r| r <= o.tolerance);
    Ok(ReplayReport {
        verdict: if ok { "pass" } else { "fail" },
        cases,
        tolerance: o.tolerance,
        logits_abs,
        logits_rel,
        layers: rows,
    })
}
