//! The decoding state of one sequence ([`SequenceState`]: position, KV cache, recurrent state,
//! pending pass) and how a verify pass is committed: recurrent layers keep the batch's state or
//! restore their snapshot and replay the accepted rows ([`ReplayMode`]).

use super::gdn::{self, GdnScratch, GdnState};
use super::kv_cache::{KvCache, KvSlice};
use super::layers::{linear_dims, Layer, ModelWeights};
use super::ModelError;
use super::MAX_VERIFY_ROWS;
use crate::weights::{LayerKind, ModelConfig};

/// How `commit_verify_rows` treats recurrent layers (see `docs/model.md`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayMode {
    /// On full acceptance also restore + replay and compare with the batch state
    /// (`NPU_REPLAY_CHECK=1`); a disagreement fails the commit naming the layer.
    pub check: bool,
    /// Always restore the snapshot and replay, even on full acceptance
    /// (`NPU_COMMIT_FULL_REPLAY=1`).
    pub full_replay: bool,
}

impl ReplayMode {
    /// From `NPU_REPLAY_CHECK` and `NPU_COMMIT_FULL_REPLAY` (`1` / `true` turn them on).
    pub fn from_env() -> Self {
        let on = |k: &str| {
            std::env::var(k)
                .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
                .unwrap_or(false)
        };
        ReplayMode {
            check: on("NPU_REPLAY_CHECK"),
            full_replay: on("NPU_COMMIT_FULL_REPLAY"),
        }
    }
}

/// Deliberately wrong commits, for proving that `replay-check` and the tests catch them.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitFault {
    /// Replay one accepted row too few.
    ReplayOneFewer,
    /// After a partial acceptance keep the batch's recurrent state (no restore, no replay).
    KeepBatchState,
}

/// The faults a test injected into a model: a pass that fails at a layer, a wrong commit. Without
/// the `fault-injection` feature it holds nothing and never fires, so production builds carry no
/// test hook.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct InjectedFaults {
    /// Fail the next pass at this layer (simulates a device fault mid-pass).
    #[cfg(feature = "fault-injection")]
    pub(super) fail_at_layer: Option<usize>,
    #[cfg(feature = "fault-injection")]
    pub(super) commit_fault: Option<CommitFault>,
}

impl InjectedFaults {
    /// Whether a pass must fail at layer `layer`.
    #[cfg_attr(not(feature = "fault-injection"), allow(unused_variables))]
    pub(super) fn fails_at_layer(&self, layer: usize) -> bool {
        #[cfg(feature = "fault-injection")]
        if self.fail_at_layer == Some(layer) {
            return true;
        }
        false
    }

    /// Rows a commit replays for `n` accepted rows: `n`, or one too few under
    /// [`CommitFault::ReplayOneFewer`].
    fn replay_rows(&self, n: usize) -> usize {
        #[cfg(feature = "fault-injection")]
        if self.commit_fault == Some(CommitFault::ReplayOneFewer) {
            return n - 1;
        }
        n
    }

    /// Whether a partial acceptance keeps the batch's recurrent state
    /// ([`CommitFault::KeepBatchState`]).
    fn keeps_batch_state(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        if self.commit_fault == Some(CommitFault::KeepBatchState) {
            return true;
        }
        false
    }
}

/// Recurrent state of one GDN layer of one sequence, with what a rollback needs.
#[derive(Default)]
pub(super) struct RecurrentSlot {
    pub(super) state: GdnState,
    /// The state at `P` before the pending pass.
    pub(super) snapshot: GdnState,
    /// Replay inputs recorded by the pass, per row: `mixed` (conv input) ‖ b ‖ a.
    pub(super) tape: Vec<f32>,
}

/// Read-only view of one layer's state (for `replay-check` and tests).
pub struct LayerStateView<'a> {
    /// Keys of positions `0..P` (attention layers), as cached.
    pub keys: Option<KvSlice<'a>>,
    /// Values of positions `0..P` (attention layers), as cached.
    pub values: Option<KvSlice<'a>>,
    /// The conv window: the last K − 1 inputs, oldest first (GDN layers).
    pub conv: Option<&'a [f32]>,
    /// The recurrent state `[Hv, d_k, d_v]` (GDN layers).
    pub recurrent: Option<&'a [f32]>,
}

/// Where a sequence stands between passes: the verify contract's bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(super) enum Pending {
    /// No pass outstanding.
    #[default]
    Idle,
    /// A verify pass of `len` rows ran and waits for `commit_verify_rows`.
    Pass { len: usize },
    /// The last pass failed: committed state is intact; call `recover()` (or `reset()`).
    Failed,
}

/// The decoding state of one sequence: its KV cache, recurrent state, committed position `P` and
/// pending pass.
///
/// A [`Model`](super::Model) owns one (the state its single-sequence methods use); a server keeps one per active
/// request and runs several of them in one batched pass with [`Model::step_sequences`](super::Model::step_sequences).
#[derive(Default)]
pub struct SequenceState {
    pub(super) ctx: usize,
    pub(super) kv_dim: usize,
    pub(super) k_cache: KvCache,
    pub(super) v_cache: KvCache,
    /// Per layer: GDN state (None for attention layers).
    pub(super) recurrent: Vec<Option<RecurrentSlot>>,
    /// Floats per row of a slot's tape.
    pub(super) tape_stride: usize,
    pub(super) pos: usize,
    pub(super) pending: Pending,
}

impl SequenceState {
    pub(super) fn new(
        config: &ModelConfig,
        layers: usize,
        ctx: usize,
        f32_kv_cache: bool,
    ) -> Result<Self, ModelError> {
        if ctx == 0 || ctx > config.max_position_embeddings {
            return Err(ModelError::Context {
                what: format!(
                    "context {ctx} out of range 1..={} (max_position_embeddings)",
                    config.max_position_embeddings
                ),
            });
        }
        let kvd = config.kv_dim();
        let is_attn = |l: usize| config.layer_kind(l) == LayerKind::Attention;
        let kv_len = |l: usize| if is_attn(l) { ctx * kvd } else { 0 };
        let mut tape_stride = 0;
        let mut recurrent = Vec::with_capacity(layers);
        for l in 0..layers {
            if is_attn(l) {
                recurrent.push(None);
                continue;
            }
            let d = linear_dims(config)?;
            tape_stride = d.conv_dim() + 2 * d.value_heads;
            recurrent.push(Some(RecurrentSlot {
                state: GdnState::zeros(d),
                snapshot: GdnState::zeros(d),
                tape: vec![0.0; MAX_VERIFY_ROWS * tape_stride],
            }));
        }
        Ok(SequenceState {
            ctx,
            kv_dim: kvd,
            k_cache: KvCache::new(f32_kv_cache, layers, kv_len),
            v_cache: KvCache::new(f32_kv_cache, layers, kv_len),
            recurrent,
            tape_stride,
            pos: 0,
            pending: Pending::Idle,
        })
    }

    /// Whether any layer of this state is recurrent.
    pub fn has_recurrent(&self) -> bool {
        self.recurrent.iter().any(Option::is_some)
    }

    /// Layers this state covers.
    pub fn layers(&self) -> usize {
        self.k_cache.layers()
    }

    /// The committed state of layer `l` (`None` past the last layer).
    pub fn layer_state(&self, l: usize) -> Option<LayerStateView<'_>> {
        if l >= self.layers() {
            return None;
        }
        let kv_len = self.pos * self.kv_dim;
        let slot = self.recurrent.get(l).and_then(Option::as_ref);
        Some(LayerStateView {
            keys: self.k_cache.view(l, kv_len),
            values: self.v_cache.view(l, kv_len),
            conv: slot.map(|s| &s.state.conv[..]),
            recurrent: slot.map(|s| &s.state.s[..]),
        })
    }

    /// Copy every recurrent state to its snapshot (the state at `P`).
    pub(super) fn snapshot(&mut self) {
        for slot in self.recurrent.iter_mut().flatten() {
            slot.snapshot.copy_from(&slot.state);
        }
    }

    /// Put every recurrent state back to its snapshot.
    pub(super) fn restore_snapshot(&mut self) {
        for slot in self.recurrent.iter_mut().flatten() {
            slot.state.copy_from(&slot.snapshot);
        }
    }

    /// Rows of the pending pass, or the error for a commit without one.
    pub(super) fn pending_len(&self) -> Result<usize, ModelError> {
        match self.pending {
            Pending::Pass { len } => Ok(len),
            Pending::Idle => Err(ModelError::State {
                what: "commit_verify_rows without a pass".into(),
            }),
            Pending::Failed => Err(ModelError::State {
                what: "commit_verify_rows after a failed pass".into(),
            }),
        }
    }

    /// Committed position `P` (tokens whose keys and values are kept).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Positions this state can hold.
    pub fn context(&self) -> usize {
        self.ctx
    }

    /// Rows of the pass waiting for a commit, if any.
    pub fn pending_rows(&self) -> Option<usize> {
        match self.pending {
            Pending::Pass { len } => Some(len),
            _ => None,
        }
    }

    /// Become a copy of `src`'s first `len` committed positions (`P = len`): a prompt prefix
    /// shared between sequences without reading it again. Both states must be idle and of one
    /// model and cache type. A recurrent layer's state exists only at `src`'s own `P`, so a
    /// model with recurrent layers copies `len == src.position()` only.
    pub fn copy_prefix_from(&mut self, src: &SequenceState, len: usize) -> Result<(), ModelError> {
        self.check_ready()?;
        src.check_ready()?;
        let refuse = |what: String| Err(ModelError::State { what });
        if len > src.pos || len > self.ctx {
            return refuse(format!(
                "a prefix of {len} positions from a sequence at {} into one of {} positions",
                src.pos, self.ctx
            ));
        }
        if src.has_recurrent() && len != src.pos {
            return refuse(format!(
                "a recurrent state exists only at the sequence's position {}, not at {len}",
                src.pos
            ));
        }
        let same_shape = self.kv_dim == src.kv_dim
            && self.recurrent.len() == src.recurrent.len()
            && self
                .recurrent
                .iter()
                .zip(&src.recurrent)
                .all(|(a, b)| match (a, b) {
                    (Some(a), Some(b)) => {
                        a.state.conv.len() == b.state.conv.len()
                            && a.state.s.len() == b.state.s.len()
                    }
                    (None, None) => true,
                    _ => false,
                });
        let values = len * self.kv_dim;
        if !same_shape
            || !self.k_cache.copy_prefix_from(&src.k_cache, values)
            || !self.v_cache.copy_prefix_from(&src.v_cache, values)
        {
            return refuse(
                "a prefix copied between states of different models or cache types".into(),
            );
        }
        for (dst, from) in self.recurrent.iter_mut().zip(&src.recurrent) {
            if let (Some(d), Some(f)) = (dst.as_mut(), from.as_ref()) {
                d.state.copy_from(&f.state);
            }
        }
        self.pos = len;
        Ok(())
    }

    /// Forget everything: `P = 0`, no pending pass.
    pub fn reset(&mut self) {
        self.pos = 0;
        self.pending = Pending::Idle;
        for slot in self.recurrent.iter_mut().flatten() {
            slot.state.clear();
            slot.snapshot.clear();
        }
    }

    /// Acknowledge a failed pass; the committed state (which the failure left untouched) is kept.
    pub fn recover(&mut self) {
        if self.pending == Pending::Failed {
            self.pending = Pending::Idle;
        }
    }

    pub(super) fn check_ready(&self) -> Result<(), ModelError> {
        match self.pending {
            Pending::Idle => Ok(()),
            Pending::Pass { len } => Err(ModelError::State {
                what: format!("a pass of {len} rows is waiting for commit_verify_rows"),
            }),
            Pending::Failed => Err(ModelError::State {
                what: "the previous pass failed; call recover() or reset() first".into(),
            }),
        }
    }

    pub(super) fn check_tokens(&self, tokens: &[u32], vocab: usize) -> Result<(), ModelError> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::Token { token: t, vocab });
        }
        if self.pos + tokens.len() > self.ctx {
            return Err(ModelError::Context {
                what: format!(
                    "{} tokens at position {} exceed the context of {}",
                    tokens.len(),
                    self.pos,
                    self.ctx
                ),
            });
        }
        Ok(())
    }
}

/// Keep rows `0..n` of `seq`'s pending pass: `P += n`. KV rows `P+n..` are stale from here on
/// (attention only reads positions below its row's, and the next pass overwrites them).
/// Recurrent layers keep the batch's state on full acceptance, otherwise restore the snapshot and
/// replay the `n` accepted rows from the tape (recurrent layers only).
pub(super) fn commit_sequence_state(
    w: &ModelWeights,
    scratch: &mut Option<GdnScratch>,
    mode: ReplayMode,
    faults: InjectedFaults,
    seq: &mut SequenceState,
    n: usize,
) -> Result<(), ModelError> {
    let len = seq.pending_len()?;
    if n == 0 || n > len {
        return Err(ModelError::Commit { n, len });
    }
    if seq.has_recurrent() {
        let full = n == len;
        if full && mode.check && !mode.full_replay {
            // Diagnostic: the replay must reproduce the batch's state.
            let batch: Vec<Option<GdnState>> = seq
                .recurrent
                .iter()
                .map(|s| s.as_ref().map(|s| s.state.clone()))
                .collect();
            replay_recurrent(w, scratch, seq, faults.replay_rows(n))?;
            for (l, (slot, b)) in seq.recurrent.iter().zip(&batch).enumerate() {
                if let (Some(slot), Some(b)) = (slot, b) {
                    let (ca, _) = gdn::max_diff(&slot.state.conv, &b.conv);
                    let (sa, _) = gdn::max_diff(&slot.state.s, &b.s);
                    if ca > REPLAY_CHECK_TOLERANCE || sa > REPLAY_CHECK_TOLERANCE {
                        seq.restore_snapshot();
                        seq.pending = Pending::Failed;
                        return Err(ModelError::State {
                            what: format!(
                                "NPU_REPLAY_CHECK: layer {l}: replayed state differs from the batch state (conv max |Δ| {ca:e}, recurrent max |Δ| {sa:e}); committed state at P = {} kept",
                                seq.pos
                            ),
                        });
                    }
                }
            }
        } else if !full || mode.full_replay {
            let keep_batch_state = !full && faults.keeps_batch_state();
            if !keep_batch_state {
                replay_recurrent(w, scratch, seq, faults.replay_rows(n))?;
            }
        }
    }
    seq.pos += n;
    seq.pending = Pending::Idle;
    Ok(())
}

/// Largest state difference `NPU_REPLAY_CHECK` accepts (the replay runs the pass's own code, so
/// it is exact today; the margin is for a future device replay kernel).
const REPLAY_CHECK_TOLERANCE: f32 = 1e-5;

/// Restore every GDN layer's snapshot and run the first `rows` recorded rows through it.
fn replay_recurrent(
    w: &ModelWeights,
    scratch: &mut Option<GdnScratch>,
    seq: &mut SequenceState,
    rows: usize,
) -> Result<(), ModelError> {
    let c = &w.config;
    let eps = c.rms_eps as f32;
    let stride = seq.tape_stride;
    for (l, slot) in seq.recurrent.iter_mut().enumerate() {
        let Some(slot) = slot else { continue };
        let (Some(Layer::Linear(lw)), Some(sc)) = (w.layers.get(l), scratch.as_mut()) else {
            return Err(ModelError::State {
                what: format!("layer {l} has recurrent state but no Gated DeltaNet weights"),
            });
        };
        let d = linear_dims(c)?;
        let cd = d.conv_dim();
        slot.state.copy_from(&slot.snapshot);
        for j in 0..rows {
            let row = &slot.tape[j * stride..(j + 1) * stride];
            gdn::step(
                d,
                &lw.gdn,
                eps,
                &mut slot.state,
                &row[..cd],
                &row[cd..],
                sc,
                None,
            );
        }
    }
    Ok(())
}
