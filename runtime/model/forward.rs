//! The fast forward pass: [`Model`] runs batches of rows (one or several sequences) through every
//! layer and the lm_head, and keeps the verify contract (a pass, then a commit).
//!
//! Projections go through [`Projection`] objects built by the loader on top of the kernels layer;
//! everything else (norms, RoPE, attention, SwiGLU) runs on the host in scratch buffers sized at
//! construction, so a token costs no allocation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::gdn::{self, GdnScratch};
use super::kv_cache::CachedValue;
use super::layers::{
    linear_dims, Layer, LayerWeights, LinearLayerWeights, ModelWeights, Projection,
};
use super::ops;
#[cfg(feature = "fault-injection")]
use super::sequence::CommitFault;
use super::sequence::{commit_sequence_state, InjectedFaults, Pending, ReplayMode, SequenceState};
use super::ModelError;
use crate::kernels::{attention, RowFamily};
use crate::weights::ModelConfig;
use half::f16;

/// Most rows of a verify pass (`m16` family).
pub const MAX_VERIFY_ROWS: usize = RowFamily::M16.max_rows();
/// Most rows of one prefill chunk (`m128` family).
pub const MAX_PREFILL_ROWS: usize = RowFamily::M128.max_rows();

/// The result of a batched pass: logits (one row per input row) and hidden states at tap layers.
#[derive(Default)]
pub struct BatchOutput {
    rows: usize,
    vocab: usize,
    hidden: usize,
    logits: Vec<f32>,
    taps: Vec<usize>,
    tap_states: Vec<f32>,
}

impl BatchOutput {
    /// Rows of the pass.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Logits of every row, row-major (`rows × vocab`).
    pub fn all_logits(&self) -> &[f32] {
        &self.logits[..self.rows * self.vocab]
    }
    /// Logits of row `i` (it predicts the token at `P + i + 1`).
    pub fn logits(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab..(i + 1) * self.vocab]
    }
    /// Hidden state (residual stream after layer `taps[t]`) of row `i`, for the `t`-th requested tap.
    pub fn tap(&self, t: usize, i: usize) -> &[f32] {
        let at = (t * self.rows + i) * self.hidden;
        &self.tap_states[at..at + self.hidden]
    }
    /// The tap layers of this pass, in the order requested.
    pub fn tap_layers(&self) -> &[usize] {
        &self.taps
    }
    /// Every tap's hidden states, `[taps, rows, hidden]`.
    pub fn tap_states(&self) -> &[f32] {
        &self.tap_states[..self.taps.len() * self.rows * self.hidden]
    }
}

/// Counters for stats lines, and where the passes' wall time went (for `xdna bench decode`).
#[derive(Clone, Copy, Debug, Default)]
pub struct PassStats {
    /// Verify passes (`m16` family) run.
    pub m16_passes: u64,
    /// Prefill chunks (`m128` family) run.
    pub m128_passes: u64,
    /// Rows of those verify passes.
    pub m16_rows: u64,
    /// Rows of those prefill chunks.
    pub m128_rows: u64,
    /// Wall time of the passes that succeeded (embedding lookup to logits).
    pub pass_time: Duration,
    /// Of which in the projections (the kernel set's GEMMs, activation quantization included).
    pub projection_time: Duration,
    /// Of which in attention over the KV cache.
    pub attention_time: Duration,
}

/// `p.gemm(…)`, adding its wall time to `spent`.
fn timed_gemm(
    p: &dyn Projection,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    family: RowFamily,
    spent: &mut Duration,
) -> Result<(), ModelError> {
    let start = Instant::now();
    let result = p.gemm(x, m, y, family);
    *spent += start.elapsed();
    result
}

struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    scores: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// Final-normed rows whose logits are wanted (≤ 16 at a time).
    head_in: Vec<f32>,
    /// Per row of the pass: which segment (sequence) it belongs to, and its position.
    row_segment: Vec<usize>,
    row_position: Vec<usize>,
    /// Gated attention: q heads compacted and their output gates (`rows × q_dim` each).
    q_compact: Vec<f32>,
    gate: Vec<f32>,
    /// GDN: in_proj_qkv‖z rows, b‖a rows, gated-normed outputs, per-token scratch.
    gdn_proj: Vec<f32>,
    gdn_ba: Vec<f32>,
    gdn_y: Vec<f32>,
    gdn: Option<GdnScratch>,
}

/// One sequence's part of a batched pass: its state and the tokens it feeds at `P..`.
struct Segment<'a, 't> {
    seq: &'a mut SequenceState,
    tokens: &'t [u32],
}

/// A loaded model and its decoding state.
///
/// The weights are shared (`Arc`): several models (an early-exit drafter, a server's engine) can
/// run over one copy. The single-sequence methods use the model's own [`SequenceState`].
pub struct Model {
    w: Arc<ModelWeights>,
    /// Layers a pass runs: all of them, or the first `E` for an early-exit (layer-skip) view.
    run_layers: usize,
    inv_freq: Vec<f64>,
    seq: SequenceState,
    s: Scratch,
    out: BatchOutput,
    /// Last-row logits of `prefill`.
    last_logits: Vec<f32>,
    stats: PassStats,
    replay: ReplayMode,
    /// Test hooks (empty without the `fault-injection` feature).
    faults: InjectedFaults,
    /// Tap layers of the passes run through the speculative loop's verify contract.
    verify_taps: Vec<usize>,
}

impl Model {
    /// Build the model with a state for `ctx` positions (≤ max_position_embeddings).
    pub fn new(w: ModelWeights, ctx: usize) -> Result<Self, ModelError> {
        Self::shared(Arc::new(w), ctx)
    }

    /// Like [`Model::new`], over weights shared with other models.
    pub fn shared(w: Arc<ModelWeights>, ctx: usize) -> Result<Self, ModelError> {
        let layers = w.config.layers;
        Self::with_layers(w, ctx, layers)
    }

    /// An early-exit view: passes run layers `0..exit_layers`, then the final norm and the
    /// lm_head (self-speculation by layer skip). `1 ≤ exit_layers ≤ layers`.
    pub fn early_exit(
        w: Arc<ModelWeights>,
        ctx: usize,
        exit_layers: usize,
    ) -> Result<Self, ModelError> {
        let layers = w.config.layers;
        if exit_layers == 0 || exit_layers > layers {
            return Err(ModelError::Context {
                what: format!("early exit after {exit_layers} layers: must be 1..={layers}"),
            });
        }
        Self::with_layers(w, ctx, exit_layers)
    }

    fn with_layers(
        w: Arc<ModelWeights>,
        ctx: usize,
        run_layers: usize,
    ) -> Result<Self, ModelError> {
        w.check_shapes()?;
        let c = w.config.clone();
        let seq = SequenceState::new(&c, run_layers, ctx, w.f32_kv_cache)?;
        let r = MAX_PREFILL_ROWS;
        let half = c.rotary_dim / 2;
        let gated = if c.attn_output_gate { r * c.q_dim() } else { 0 };
        let (gdn_proj, gdn_ba, gdn_y, gdn) = match (&c.linear, c.has_recurrent()) {
            (Some(d), true) => (
                r * (d.conv_dim() + d.value_dim()),
                r * 2 * d.value_heads,
                r * d.value_dim(),
                Some(GdnScratch::new(d)),
            ),
            _ => (0, 0, 0, None),
        };
        let s = Scratch {
            q_compact: vec![0.0; gated],
            gate: vec![0.0; gated],
            gdn_proj: vec![0.0; gdn_proj],
            gdn_ba: vec![0.0; gdn_ba],
            gdn_y: vec![0.0; gdn_y],
            gdn,
            x: vec![0.0; r * c.hidden],
            xn: vec![0.0; r * c.hidden],
            qkv: vec![0.0; r * c.qkv_rows()],
            attn: vec![0.0; r * c.q_dim()],
            o: vec![0.0; r * c.hidden],
            gate_up: vec![0.0; r * 2 * c.intermediate],
            act: vec![0.0; r * c.intermediate],
            scores: vec![0.0; ctx],
            cos: vec![0.0; r * half],
            sin: vec![0.0; r * half],
            head_in: vec![0.0; MAX_VERIFY_ROWS * c.hidden],
            row_segment: vec![0; r],
            row_position: vec![0; r],
        };
        let out = BatchOutput {
            rows: 0,
            vocab: c.vocab,
            hidden: c.hidden,
            logits: vec![0.0; MAX_VERIFY_ROWS * c.vocab],
            taps: Vec::new(),
            tap_states: Vec::new(),
        };
        Ok(Model {
            inv_freq: c.rope_inv_freq(),
            run_layers,
            seq,
            s,
            out,
            last_logits: vec![0.0; c.vocab],
            stats: PassStats::default(),
            replay: ReplayMode::from_env(),
            faults: InjectedFaults::default(),
            verify_taps: Vec::new(),
            w,
        })
    }

    /// How commits treat recurrent layers (initially from the environment, see [`ReplayMode`]).
    pub fn replay_mode(&self) -> ReplayMode {
        self.replay
    }
    /// Change how commits treat recurrent layers.
    pub fn set_replay_mode(&mut self, mode: ReplayMode) {
        self.replay = mode;
    }

    /// The model's own sequence state (read-only, for checks).
    pub fn state(&self) -> &SequenceState {
        &self.seq
    }

    /// Break the following commits on purpose (`None`: commit correctly again).
    #[cfg(feature = "fault-injection")]
    pub fn inject_commit_fault(&mut self, fault: Option<CommitFault>) {
        self.faults.commit_fault = fault;
    }

    /// The model description.
    pub fn config(&self) -> &ModelConfig {
        &self.w.config
    }
    /// The weights.
    pub fn weights(&self) -> &ModelWeights {
        &self.w
    }
    /// The shared weights, to build another model (an early-exit drafter) over the same copy.
    pub fn weights_arc(&self) -> Arc<ModelWeights> {
        Arc::clone(&self.w)
    }
    /// Layers a pass runs (all of them unless this is an early-exit view).
    pub fn run_layers(&self) -> usize {
        self.run_layers
    }
    /// Committed position `P`.
    pub fn position(&self) -> usize {
        self.seq.pos
    }
    /// Positions the model's own state can hold.
    pub fn context(&self) -> usize {
        self.seq.ctx
    }
    /// Pass counters and where their time went.
    pub fn stats(&self) -> PassStats {
        self.stats
    }

    /// A fresh state for another sequence over these weights (`ctx` positions).
    pub fn new_sequence(&self, ctx: usize) -> Result<SequenceState, ModelError> {
        SequenceState::new(&self.w.config, self.run_layers, ctx, self.w.f32_kv_cache)
    }

    /// Forget everything: `P = 0`, no pending pass.
    pub fn reset(&mut self) {
        self.seq.reset();
    }

    /// Acknowledge a failed pass; the committed state (which the failure left untouched) is kept.
    pub fn recover(&mut self) {
        self.seq.recover();
    }

    /// Drop committed tokens past `position` (`position ≤ P`, no pass pending): the next token is
    /// fed at `position`. Attention layers only need their KV rows forgotten, which is free.
    /// Recurrent (GDN) layers cannot be rewound, so a model with them refuses any `position < P`
    /// (use `reset()` and prefill again).
    pub fn truncate(&mut self, position: usize) -> Result<(), ModelError> {
        self.seq.check_ready()?;
        if position > self.seq.pos {
            return Err(ModelError::Context {
                what: format!(
                    "truncate to {position}: only {} tokens are committed",
                    self.seq.pos
                ),
            });
        }
        if position < self.seq.pos && self.seq.has_recurrent() {
            return Err(ModelError::Unsupported {
                what: format!(
                    "truncate from {} to {position} on a model with recurrent (Gated DeltaNet) layers: their state cannot be rewound; reset() and prefill again",
                    self.seq.pos
                ),
            });
        }
        self.seq.pos = position;
        Ok(())
    }

    /// Make every following pass fail when it reaches `layer`, as a device fault mid-pass would
    /// (`None`: stop failing).
    #[cfg(feature = "fault-injection")]
    pub fn inject_failure_at_layer(&mut self, layer: Option<usize>) {
        self.faults.fail_at_layer = layer;
    }

    fn check_taps(&self, taps: &[usize]) -> Result<(), ModelError> {
        if let Some(&l) = taps.iter().find(|&&l| l >= self.run_layers) {
            return Err(ModelError::Tap {
                layer: l,
                layers: self.run_layers,
            });
        }
        Ok(())
    }

    /// Tap layers for the passes the speculative loop runs through the verify contract
    /// (`spec::VerifyTarget`), whose calls take none: checked here, used by every later pass.
    pub fn set_verify_taps(&mut self, layers: &[usize]) -> Result<(), ModelError> {
        self.check_taps(layers)?;
        self.verify_taps.clear();
        self.verify_taps.extend_from_slice(layers);
        Ok(())
    }

    /// The tap layers set by [`Model::set_verify_taps`].
    pub fn verify_taps(&self) -> &[usize] {
        &self.verify_taps
    }

    /// [`Model::step_batch_all`] with the taps set by [`Model::set_verify_taps`].
    pub fn step_batch_verify_taps(&mut self, tokens: &[u32]) -> Result<&BatchOutput, ModelError> {
        // Moved out for the call (the pass borrows the model mutably), then back.
        let taps = std::mem::take(&mut self.verify_taps);
        let result = self.step_batch_all(tokens, &taps).map(|_| ());
        self.verify_taps = taps;
        result?;
        Ok(&self.out)
    }

    /// The output of the last verify pass (logits and taps), until the next pass.
    pub fn last_pass(&self) -> &BatchOutput {
        &self.out
    }

    /// One batched verify pass over `tokens` (1..=16 rows) at positions `P..P+len-1`.
    ///
    /// Returns one logit row per input row and, for each layer in `taps`, every row's hidden state
    /// after that layer. Must be followed by [`Model::commit_verify_rows`].
    pub fn step_batch_all(
        &mut self,
        tokens: &[u32],
        taps: &[usize],
    ) -> Result<&BatchOutput, ModelError> {
        self.seq.check_ready()?;
        if tokens.is_empty() || tokens.len() > MAX_VERIFY_ROWS {
            return Err(ModelError::BatchRows {
                rows: tokens.len(),
                max: MAX_VERIFY_ROWS,
            });
        }
        self.seq.check_tokens(tokens, self.w.config.vocab)?;
        self.check_taps(taps)?;
        let mut seq = std::mem::take(&mut self.seq);
        let r = self.verify_pass(
            &mut [Segment {
                seq: &mut seq,
                tokens,
            }],
            taps,
        );
        self.seq = seq;
        r?;
        Ok(&self.out)
    }

    /// A batch of `(state, tokens)` for one pass: 1..=`max_rows` rows in all, every segment
    /// non-empty, every state ready, made for this model (same layer count), with tokens inside
    /// its vocabulary. Returns the row count.
    fn check_batch(
        &self,
        batch: &[(&mut SequenceState, &[u32])],
        max_rows: usize,
    ) -> Result<usize, ModelError> {
        let rows: usize = batch.iter().map(|(_, t)| t.len()).sum();
        if rows == 0 || rows > max_rows {
            return Err(ModelError::BatchRows {
                rows,
                max: max_rows,
            });
        }
        for (seq, tokens) in batch {
            seq.check_ready()?;
            if tokens.is_empty() {
                return Err(ModelError::BatchRows {
                    rows: 0,
                    max: max_rows,
                });
            }
            self.check_state_fits(seq)?;
            seq.check_tokens(tokens, self.w.config.vocab)?;
        }
        Ok(rows)
    }
    /// One batched pass over several sequences: each `(state, tokens)` feeds its tokens at its own
    /// `P..`, and all rows (1..=16 in total) share every projection. Logit rows come back in input
    /// order (the first sequence's rows first). Every state then waits for its own
    /// [`Model::commit_sequence`]; on failure every state is marked failed with its committed
    /// state intact.
    pub fn step_sequences(
        &mut self,
        batch: &mut [(&mut SequenceState, &[u32])],
    ) -> Result<&BatchOutput, ModelError> {
        self.step_sequences_tapped(batch, &[])
    }

    /// [`Model::step_sequences`] that also returns every row's hidden state after each layer in
    /// `taps` ([`BatchOutput::tap`]; rows in input order, the first sequence's first), as
    /// [`Model::step_batch_all`] does for one sequence: what a server's DFlash drafts read.
    pub fn step_sequences_tapped(
        &mut self,
        batch: &mut [(&mut SequenceState, &[u32])],
        taps: &[usize],
    ) -> Result<&BatchOutput, ModelError> {
        self.check_batch(batch, MAX_VERIFY_ROWS)?;
        self.check_taps(taps)?;
        let mut segments: Vec<Segment<'_, '_>> = batch
            .iter_mut()
            .map(|(seq, tokens)| Segment { seq, tokens })
            .collect();
        self.verify_pass(&mut segments, taps)?;
        Ok(&self.out)
    }

    /// Keep rows `0..n` of `seq`'s part of the last [`Model::step_sequences`] pass.
    pub fn commit_sequence(&mut self, seq: &mut SequenceState, n: usize) -> Result<(), ModelError> {
        commit_sequence_state(&self.w, &mut self.s.gdn, self.replay, self.faults, seq, n)
    }

    /// Is `seq` a state this model can run: its layers, and its KV cache of the model's type?
    fn check_state_fits(&self, seq: &SequenceState) -> Result<(), ModelError> {
        if seq.layers() != self.run_layers {
            return Err(ModelError::State {
                what: format!(
                    "a sequence state of {} layers given to a model running {}",
                    seq.layers(),
                    self.run_layers
                ),
            });
        }
        if seq.k_cache.is_f32() != self.w.f32_kv_cache {
            let name = |f32_cache: bool| if f32_cache { "f32" } else { "f16" };
            return Err(ModelError::State {
                what: format!(
                    "a sequence state with an {} KV cache given to a model keeping {}",
                    name(seq.k_cache.is_f32()),
                    name(self.w.f32_kv_cache)
                ),
            });
        }
        Ok(())
    }

    /// Feed `tokens` of a server-held sequence in chunks of ≤ 128 rows (see [`Model::prefill_with`]).
    pub fn prefill_sequence(
        &mut self,
        seq: &mut SequenceState,
        tokens: &[u32],
        first_logit_row: usize,
        on_logits: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), ModelError> {
        self.prefill_sequence_tapped(seq, tokens, first_logit_row, on_logits, &[], &mut |_| {})
    }

    /// [`Model::prefill_sequence`] that also hands each chunk's hidden states after the `taps`
    /// layers to `on_taps`, as [`Model::prefill_tapped`] does (a [`BatchOutput`] whose rows are
    /// the chunk's; its logits are not the rows'). Atomic like `prefill_sequence`; `on_taps` has
    /// seen the chunks before a failing one.
    pub fn prefill_sequence_tapped(
        &mut self,
        seq: &mut SequenceState,
        tokens: &[u32],
        first_logit_row: usize,
        on_logits: &mut dyn FnMut(usize, &[f32]),
        taps: &[usize],
        on_taps: &mut dyn FnMut(&BatchOutput),
    ) -> Result<(), ModelError> {
        // The model's own state always fits; a caller's must be checked before it stands in.
        self.check_state_fits(seq)?;
        self.check_taps(taps)?;
        std::mem::swap(&mut self.seq, seq);
        let r = self.prefill_chunks(tokens, first_logit_row, on_logits, taps, on_taps);
        std::mem::swap(&mut self.seq, seq);
        if !taps.is_empty() {
            self.out.rows = 0;
            self.out.taps.clear();
        }
        r
    }

    /// Prefill several server-held sequences in ONE pass (one sweep over the weights instead of
    /// one per sequence): each `(state, tokens)` feeds its tokens at its own `P..`, ≤ 128 rows in
    /// all, and is committed on success; `on_last_logits(i, logits)` gets the logits of sequence
    /// `i`'s last row (predicting its next token). Every row is computed as it would be alone
    /// (rows do not depend on their batch), so the logits equal [`Model::prefill_sequence`]'s.
    /// On failure no state changed (each stays ready).
    pub fn prefill_sequences(
        &mut self,
        batch: &mut [(&mut SequenceState, &[u32])],
        on_last_logits: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), ModelError> {
        self.prefill_sequences_tapped(batch, &[], on_last_logits, &mut |_| {})
    }

    /// [`Model::prefill_sequences`] that also hands the pass's hidden states after the `taps`
    /// layers to `on_taps` once it succeeded (a [`BatchOutput`] whose rows are the batch's,
    /// segment after segment; its logits are not the rows'). On failure `on_taps` is not called
    /// and no state changed.
    pub fn prefill_sequences_tapped(
        &mut self,
        batch: &mut [(&mut SequenceState, &[u32])],
        taps: &[usize],
        on_last_logits: &mut dyn FnMut(usize, &[f32]),
        on_taps: &mut dyn FnMut(&BatchOutput),
    ) -> Result<(), ModelError> {
        let rows = self.check_batch(batch, MAX_PREFILL_ROWS)?;
        self.check_taps(taps)?;
        let mut segments: Vec<Segment<'_, '_>> = batch
            .iter_mut()
            .map(|(seq, tokens)| Segment { seq, tokens })
            .collect();
        // Recurrent layers: the state at P, restored if the pass fails.
        for seg in segments.iter_mut() {
            seg.seq.snapshot();
        }
        self.out.taps.clear();
        self.out.taps.extend_from_slice(taps);
        if !taps.is_empty() {
            let need = taps.len() * rows * self.w.config.hidden;
            if self.out.tap_states.len() < need {
                self.out.tap_states.resize(need, 0.0);
            }
            self.out.rows = rows;
        }
        let mut sink = Sink::SegmentLast { f: on_last_logits };
        let r = self.forward_rows(
            &mut segments,
            RowFamily::for_rows(rows),
            0,
            &mut sink,
            !taps.is_empty(),
            false,
        );
        if r.is_ok() && !taps.is_empty() {
            on_taps(&self.out);
        }
        if !taps.is_empty() {
            self.out.rows = 0;
            self.out.taps.clear();
        }
        match r {
            Ok(()) => {
                for seg in segments.iter_mut() {
                    seg.seq.pos += seg.tokens.len();
                }
                Ok(())
            }
            Err(e) => {
                for seg in segments.iter_mut() {
                    seg.seq.restore_snapshot();
                }
                Err(e)
            }
        }
    }

    /// The verify pass proper: marks every segment pending (or failed).
    fn verify_pass(
        &mut self,
        segments: &mut [Segment<'_, '_>],
        taps: &[usize],
    ) -> Result<(), ModelError> {
        let rows: usize = segments.iter().map(|s| s.tokens.len()).sum();
        // Recurrent layers: the state at P, for rollback (and for a failed pass).
        for seg in segments.iter_mut() {
            seg.seq.snapshot();
        }
        self.out.taps.clear();
        self.out.taps.extend_from_slice(taps);
        let need = taps.len() * rows * self.w.config.hidden;
        if self.out.tap_states.len() < need {
            self.out.tap_states.resize(need, 0.0);
        }
        self.out.rows = rows;
        let taps_on = !taps.is_empty();
        match self.forward_rows(segments, RowFamily::M16, 0, &mut Sink::Batch, taps_on, true) {
            Ok(()) => {
                for seg in segments.iter_mut() {
                    seg.seq.pending = Pending::Pass {
                        len: seg.tokens.len(),
                    };
                }
                Ok(())
            }
            Err(e) => {
                for seg in segments.iter_mut() {
                    seg.seq.restore_snapshot();
                    seg.seq.pending = Pending::Failed;
                }
                Err(e)
            }
        }
    }

    /// Keep rows `0..n` of the last pass: `P += n`; keys/values beyond `P` are dropped; recurrent
    /// layers keep the batch state (`n == rows`) or restore the snapshot and replay `n` rows.
    pub fn commit_verify_rows(&mut self, n: usize) -> Result<(), ModelError> {
        commit_sequence_state(
            &self.w,
            &mut self.s.gdn,
            self.replay,
            self.faults,
            &mut self.seq,
            n,
        )
    }

    /// `step_batch_all([token])` + `commit_verify_rows(1)`; returns the next-token logits.
    pub fn step(&mut self, token: u32) -> Result<&[f32], ModelError> {
        self.step_batch_all(&[token], &[])?;
        self.commit_verify_rows(1)?;
        Ok(self.out.logits(0))
    }

    /// Feed `tokens` in chunks of ≤ 128 rows (m128 family), committing each chunk. Calls
    /// `on_logits(i, logits)` for every row `i ≥ first_logit_row` (row i predicts token `P0+i+1`).
    /// Atomic: if a chunk fails, `P` returns to its value before the call.
    pub fn prefill_with(
        &mut self,
        tokens: &[u32],
        first_logit_row: usize,
        on_logits: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), ModelError> {
        self.prefill_chunks(tokens, first_logit_row, on_logits, &[], &mut |_| {})
    }

    /// Feed `tokens` like [`Model::prefill_with`], computing no logits, and hand each chunk's
    /// hidden states at the `taps` layers to `on_taps` (a [`BatchOutput`] whose rows are the
    /// chunk's, in order; its logits are not set). Atomic like `prefill_with`; `on_taps` has
    /// seen the chunks before a failing one.
    pub fn prefill_tapped(
        &mut self,
        tokens: &[u32],
        taps: &[usize],
        on_taps: &mut dyn FnMut(&BatchOutput),
    ) -> Result<(), ModelError> {
        self.check_taps(taps)?;
        let r = self.prefill_chunks(tokens, tokens.len(), &mut |_, _| {}, taps, on_taps);
        self.out.rows = 0;
        self.out.taps.clear();
        r
    }

    fn prefill_chunks(
        &mut self,
        tokens: &[u32],
        first_logit_row: usize,
        on_logits: &mut dyn FnMut(usize, &[f32]),
        taps: &[usize],
        on_taps: &mut dyn FnMut(&BatchOutput),
    ) -> Result<(), ModelError> {
        self.seq.check_ready()?;
        if tokens.is_empty() {
            return Err(ModelError::Context {
                what: "prefill of zero tokens".into(),
            });
        }
        self.seq.check_tokens(tokens, self.w.config.vocab)?;
        self.out.taps.clear();
        self.out.taps.extend_from_slice(taps);
        let start = self.seq.pos;
        let mut seq = std::mem::take(&mut self.seq);
        // Recurrent layers: the state at P, restored if a chunk fails (prefill is atomic).
        seq.snapshot();
        let mut result = Ok(());
        for (c, chunk) in tokens.chunks(MAX_PREFILL_ROWS).enumerate() {
            let base = c * MAX_PREFILL_ROWS;
            let first = first_logit_row.saturating_sub(base);
            let mut sink = Sink::Callback { base, f: on_logits };
            let mut segment = [Segment {
                seq: &mut seq,
                tokens: chunk,
            }];
            if !taps.is_empty() {
                let need = taps.len() * chunk.len() * self.w.config.hidden;
                if self.out.tap_states.len() < need {
                    self.out.tap_states.resize(need, 0.0);
                }
                self.out.rows = chunk.len();
            }
            if let Err(e) = self.forward_rows(
                &mut segment,
                RowFamily::for_rows(chunk.len()),
                first,
                &mut sink,
                !taps.is_empty(),
                false,
            ) {
                seq.pos = start;
                seq.restore_snapshot();
                result = Err(e);
                break;
            }
            seq.pos += chunk.len();
            if !taps.is_empty() {
                on_taps(&self.out);
            }
        }
        self.seq = seq;
        result
    }

    /// Prefill and return the last row's logits (predicting the token after `tokens`).
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        let last = tokens.len().saturating_sub(1);
        let mut buf = std::mem::take(&mut self.last_logits);
        let r = self.prefill_with(tokens, last, &mut |_, l| buf.copy_from_slice(l));
        self.last_logits = buf;
        r?;
        Ok(&self.last_logits)
    }

    /// The forward of every segment's tokens at its positions `P..`, all rows through each
    /// projection together; KV written at those positions.
    fn forward_rows(
        &mut self,
        segments: &mut [Segment<'_, '_>],
        family: RowFamily,
        first_logit_row: usize,
        sink: &mut Sink<'_>,
        taps: bool,
        record: bool,
    ) -> Result<(), ModelError> {
        // Wall time of a successful pass, added to `stats.pass_time` where it returns.
        let start = Instant::now();
        let mut pass = ForwardPass {
            w: &self.w,
            inv_freq: &self.inv_freq,
            scratch: &mut self.s,
            stats: &mut self.stats,
            out: &mut self.out,
            family,
            eps: self.w.config.rms_eps as f32,
        };
        let rows = pass.embed_rows(segments)?;
        pass.count_rows(rows);
        for (layer_index, layer) in self.w.layers[..self.run_layers].iter().enumerate() {
            if self.faults.fails_at_layer(layer_index) {
                return Err(ModelError::Other(format!(
                    "injected failure at layer {layer_index}"
                )));
            }
            pass.attention_norm(layer, rows);
            match layer {
                Layer::Attention(weights) => {
                    pass.attention_block(segments, layer_index, weights, rows)?
                }
                Layer::Linear(weights) => {
                    pass.recurrent_block(segments, layer_index, weights, rows, record)?
                }
            }
            pass.ffn_block(layer, rows)?;
            if taps {
                pass.record_taps(layer_index, rows);
            }
        }
        match sink {
            Sink::SegmentLast { f } => pass.segment_last_logits(segments, &mut **f)?,
            _ => pass.row_logits(rows, first_logit_row, sink)?,
        }
        self.stats.pass_time += start.elapsed();
        Ok(())
    }
}

/// One pass's view of a [`Model`]: the weights, the scratch buffers, the counters and the output,
/// borrowed apart so that each step of [`Model::forward_rows`] is a method. Rows are laid out
/// segment after segment (`hidden` values each in `scratch.x`).
struct ForwardPass<'m> {
    w: &'m ModelWeights,
    inv_freq: &'m [f64],
    scratch: &'m mut Scratch,
    stats: &'m mut PassStats,
    out: &'m mut BatchOutput,
    /// The row family of the pass's layer projections.
    family: RowFamily,
    /// RMSNorm epsilon, as f32.
    eps: f32,
}

impl ForwardPass<'_> {
    /// Every segment's token embeddings into the residual stream, with each row's segment,
    /// position and RoPE angles; the attention scores sized for the longest row. Returns the
    /// number of rows.
    fn embed_rows(&mut self, segments: &[Segment<'_, '_>]) -> Result<usize, ModelError> {
        let hidden = self.w.config.hidden;
        let half = self.w.config.rotary_dim / 2;
        let s = &mut *self.scratch;
        let mut rows = 0;
        for (segment_index, segment) in segments.iter().enumerate() {
            for (offset, &token) in segment.tokens.iter().enumerate() {
                let row = rows + offset;
                let position = segment.seq.pos + offset;
                s.row_segment[row] = segment_index;
                s.row_position[row] = position;
                self.w
                    .embed
                    .row(token, &mut s.x[row * hidden..(row + 1) * hidden])?;
                ops::rope_angles(
                    position,
                    self.inv_freq,
                    &mut s.cos[row * half..(row + 1) * half],
                    &mut s.sin[row * half..(row + 1) * half],
                );
            }
            rows += segment.tokens.len();
        }
        let longest = s.row_position[..rows].iter().max().map_or(0, |&p| p + 1);
        if s.scores.len() < longest {
            s.scores.resize(longest, 0.0);
        }
        Ok(rows)
    }

    /// The pass and its rows in the counters of its row family.
    fn count_rows(&mut self, rows: usize) {
        match self.family {
            RowFamily::M16 => {
                self.stats.m16_passes += 1;
                self.stats.m16_rows += rows as u64;
            }
            RowFamily::M128 => {
                self.stats.m128_passes += 1;
                self.stats.m128_rows += rows as u64;
            }
        }
    }

    /// The layer's input norm: residual stream `x` → normed rows `xn`.
    fn attention_norm(&mut self, layer: &Layer, rows: usize) {
        let hidden = self.w.config.hidden;
        let s = &mut *self.scratch;
        ops::rmsnorm(
            &s.x[..rows * hidden],
            layer.attn_norm(),
            self.eps,
            &mut s.xn[..rows * hidden],
        );
    }

    /// Softmax attention: the fused q‖k‖v projection, biases, q/k norms and RoPE, keys and values
    /// stored at each row's position, attention over each row's own cache, the output gate, the
    /// output projection added to the residual stream.
    fn attention_block(
        &mut self,
        segments: &mut [Segment<'_, '_>],
        layer_index: usize,
        weights: &LayerWeights,
        rows: usize,
    ) -> Result<(), ModelError> {
        let w = self.w;
        let config = &w.config;
        let (head_dim, rotary_dim, hidden) = (config.head_dim, config.rotary_dim, config.hidden);
        let half = rotary_dim / 2;
        let (q_dim, kv_dim, qkv_width) = (config.q_dim(), config.kv_dim(), config.qkv_rows());
        let (q_rows, gated) = (config.q_rows(), config.attn_output_gate);
        // Fused q rows: per head [q] or, with the output gate, [q, gate].
        let q_stride = if gated { 2 * head_dim } else { head_dim };
        let eps = self.eps;
        let s = &mut *self.scratch;
        timed_gemm(
            &*weights.qkv,
            &s.xn[..rows * hidden],
            rows,
            &mut s.qkv[..rows * qkv_width],
            self.family,
            &mut self.stats.projection_time,
        )?;
        for row in 0..rows {
            let qkv = &mut s.qkv[row * qkv_width..(row + 1) * qkv_width];
            if let Some(bias) = &weights.qkv_bias {
                for (value, &bias_value) in qkv.iter_mut().zip(bias) {
                    *value += bias_value;
                }
            }
            let (cos, sin) = (
                &s.cos[row * half..(row + 1) * half],
                &s.sin[row * half..(row + 1) * half],
            );
            for head in 0..config.heads {
                let q = &mut qkv[head * q_stride..head * q_stride + head_dim];
                if let Some(norm) = &weights.q_norm {
                    ops::rmsnorm_inplace(q, norm, eps);
                }
                ops::rope_half_split(&mut q[..rotary_dim], cos, sin);
            }
            for k in qkv[q_rows..q_rows + kv_dim].chunks_exact_mut(head_dim) {
                if let Some(norm) = &weights.k_norm {
                    ops::rmsnorm_inplace(k, norm, eps);
                }
                ops::rope_half_split(&mut k[..rotary_dim], cos, sin);
            }
            if gated {
                for head in 0..config.heads {
                    let at = row * q_dim + head * head_dim;
                    let q_at = head * q_stride;
                    s.q_compact[at..at + head_dim].copy_from_slice(&qkv[q_at..q_at + head_dim]);
                    s.gate[at..at + head_dim]
                        .copy_from_slice(&qkv[q_at + head_dim..(head + 1) * q_stride]);
                }
            }
            let seq = &mut *segments[s.row_segment[row]].seq;
            let position = s.row_position[row];
            seq.k_cache.store(
                layer_index,
                position * kv_dim,
                &qkv[q_rows..q_rows + kv_dim],
            );
            seq.v_cache.store(
                layer_index,
                position * kv_dim,
                &qkv[q_rows + kv_dim..qkv_width],
            );
        }
        {
            // Every row's heads in one pool dispatch (rows of different sequences read their own
            // caches).
            let attention = LayerAttention {
                shape: attention::AttentionShape {
                    heads: config.heads,
                    kv_heads: config.kv_heads,
                    head_dim,
                },
                segments,
                layer: layer_index,
                rows,
                q: if gated { &s.q_compact } else { &s.qkv },
                q_stride: if gated { q_dim } else { qkv_width },
                row_segment: &s.row_segment,
                row_position: &s.row_position,
            };
            let out = &mut s.attn[..rows * q_dim];
            let start = Instant::now();
            if w.f32_kv_cache {
                attention.run::<f32>(&mut s.scores, out);
            } else {
                attention.run::<f16>(&mut s.scores, out);
            }
            self.stats.attention_time += start.elapsed();
        }
        if gated {
            for (value, &gate) in s.attn[..rows * q_dim]
                .iter_mut()
                .zip(&s.gate[..rows * q_dim])
            {
                *value *= 1.0 / (1.0 + (-gate).exp());
            }
        }
        project_into_residual(
            &*weights.o,
            &s.attn[..rows * q_dim],
            &mut s.o[..rows * hidden],
            &mut s.x[..rows * hidden],
            weights.o_bias.as_deref(),
            self.family,
            &mut self.stats.projection_time,
        )?;
        Ok(())
    }

    /// Gated DeltaNet: the qkv‖z and b‖a projections, each row through its sequence's recurrent
    /// state in order (recording the replay tape when `record`), the output projection added to
    /// the residual stream.
    fn recurrent_block(
        &mut self,
        segments: &mut [Segment<'_, '_>],
        layer_index: usize,
        weights: &LinearLayerWeights,
        rows: usize,
        record: bool,
    ) -> Result<(), ModelError> {
        let config = &self.w.config;
        let hidden = config.hidden;
        let dims = linear_dims(config)?;
        let (conv_dim, value_dim, value_heads) =
            (dims.conv_dim(), dims.value_dim(), dims.value_heads);
        let (proj_width, ba_width) = (conv_dim + value_dim, 2 * value_heads);
        let gdn_weights = &weights.gdn;
        let eps = self.eps;
        let s = &mut *self.scratch;
        timed_gemm(
            &*gdn_weights.in_qkvz,
            &s.xn[..rows * hidden],
            rows,
            &mut s.gdn_proj[..rows * proj_width],
            self.family,
            &mut self.stats.projection_time,
        )?;
        timed_gemm(
            &*gdn_weights.in_ba,
            &s.xn[..rows * hidden],
            rows,
            &mut s.gdn_ba[..rows * ba_width],
            self.family,
            &mut self.stats.projection_time,
        )?;
        let Some(gdn_scratch) = s.gdn.as_mut() else {
            return Err(ModelError::State {
                what: "GDN layer without GDN scratch".into(),
            });
        };
        // The recurrence is sequential within a sequence: rows in order.
        for row in 0..rows {
            let seq = &mut *segments[s.row_segment[row]].seq;
            // The row's index in its sequence's part of the pass (its tape row).
            let offset = s.row_position[row] - seq.pos;
            let stride = seq.tape_stride;
            let Some(slot) = seq.recurrent.get_mut(layer_index).and_then(Option::as_mut) else {
                return Err(ModelError::State {
                    what: format!("sequence state has no recurrent slot for layer {layer_index}"),
                });
            };
            let proj = &s.gdn_proj[row * proj_width..(row + 1) * proj_width];
            let ba = &s.gdn_ba[row * ba_width..(row + 1) * ba_width];
            if record {
                let tape = &mut slot.tape[offset * stride..(offset + 1) * stride];
                tape[..conv_dim].copy_from_slice(&proj[..conv_dim]);
                tape[conv_dim..].copy_from_slice(ba);
            }
            gdn::step(
                dims,
                gdn_weights,
                eps,
                &mut slot.state,
                &proj[..conv_dim],
                ba,
                gdn_scratch,
                Some((
                    &proj[conv_dim..],
                    &mut s.gdn_y[row * value_dim..(row + 1) * value_dim],
                )),
            );
        }
        project_into_residual(
            &*gdn_weights.out,
            &s.gdn_y[..rows * value_dim],
            &mut s.o[..rows * hidden],
            &mut s.x[..rows * hidden],
            None,
            self.family,
            &mut self.stats.projection_time,
        )?;
        Ok(())
    }

    /// The feed-forward block: norm, gate‖up, SwiGLU, down, added to the residual stream.
    fn ffn_block(&mut self, layer: &Layer, rows: usize) -> Result<(), ModelError> {
        let (hidden, intermediate) = (self.w.config.hidden, self.w.config.intermediate);
        let s = &mut *self.scratch;
        let (ffn_norm, gate_up, down) = layer.ffn();
        ops::rmsnorm(
            &s.x[..rows * hidden],
            ffn_norm,
            self.eps,
            &mut s.xn[..rows * hidden],
        );
        let start = Instant::now();
        let result = gate_up.gemm_swiglu(
            &s.xn[..rows * hidden],
            rows,
            &mut s.gate_up[..rows * 2 * intermediate],
            &mut s.act[..rows * intermediate],
            self.family,
        );
        self.stats.projection_time += start.elapsed();
        result?;
        project_into_residual(
            down,
            &s.act[..rows * intermediate],
            &mut s.o[..rows * hidden],
            &mut s.x[..rows * hidden],
            None,
            self.family,
            &mut self.stats.projection_time,
        )?;
        Ok(())
    }

    /// The residual stream after layer `layer_index`, for every tap that asked for that layer.
    fn record_taps(&mut self, layer_index: usize, rows: usize) {
        let hidden = self.w.config.hidden;
        let x = &self.scratch.x[..rows * hidden];
        for (tap, _) in self
            .out
            .taps
            .iter()
            .enumerate()
            .filter(|(_, &tap_layer)| tap_layer == layer_index)
        {
            let at = tap * rows * hidden;
            self.out.tap_states[at..at + rows * hidden].copy_from_slice(x);
        }
    }

    /// Output head for a multi-sequence prefill: the last row of each segment, up to 16 rows per
    /// lm_head GEMM; `on_logits(segment, logits)`.
    fn segment_last_logits(
        &mut self,
        segments: &[Segment<'_, '_>],
        on_logits: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), ModelError> {
        let (hidden, vocab) = (self.w.config.hidden, self.w.config.vocab);
        let s = &mut *self.scratch;
        // Rows of the segments before `first_segment` plus those of the group so far.
        let mut end = 0;
        let mut first_segment = 0;
        while first_segment < segments.len() {
            let end_segment = (first_segment + MAX_VERIFY_ROWS).min(segments.len());
            for (group_row, segment) in segments[first_segment..end_segment].iter().enumerate() {
                end += segment.tokens.len();
                let last_row = end - 1;
                ops::rmsnorm(
                    &s.x[last_row * hidden..(last_row + 1) * hidden],
                    &self.w.final_norm,
                    self.eps,
                    &mut s.head_in[group_row * hidden..(group_row + 1) * hidden],
                );
            }
            let count = end_segment - first_segment;
            timed_gemm(
                &*self.w.lm_head,
                &s.head_in[..count * hidden],
                count,
                &mut self.out.logits[..count * vocab],
                RowFamily::for_rows(count),
                &mut self.stats.projection_time,
            )?;
            for group_row in 0..count {
                on_logits(
                    first_segment + group_row,
                    &self.out.logits[group_row * vocab..(group_row + 1) * vocab],
                );
            }
            first_segment = end_segment;
        }
        Ok(())
    }

    /// Output head: logits for rows `first_logit_row..rows`, up to 16 rows per lm_head GEMM, kept
    /// in the output ([`Sink::Batch`]) or handed to the callback ([`Sink::Callback`]).
    fn row_logits(
        &mut self,
        rows: usize,
        first_logit_row: usize,
        sink: &mut Sink<'_>,
    ) -> Result<(), ModelError> {
        let (hidden, vocab) = (self.w.config.hidden, self.w.config.vocab);
        let s = &mut *self.scratch;
        let mut first = first_logit_row;
        while first < rows {
            let end = (first + MAX_VERIFY_ROWS).min(rows);
            let count = end - first;
            ops::rmsnorm(
                &s.x[first * hidden..end * hidden],
                &self.w.final_norm,
                self.eps,
                &mut s.head_in[..count * hidden],
            );
            timed_gemm(
                &*self.w.lm_head,
                &s.head_in[..count * hidden],
                count,
                &mut self.out.logits[..count * vocab],
                RowFamily::for_rows(count),
                &mut self.stats.projection_time,
            )?;
            if let Sink::Callback { base, f } = sink {
                for offset in 0..count {
                    f(
                        *base + first + offset,
                        &self.out.logits[offset * vocab..(offset + 1) * vocab],
                    );
                }
            }
            first = end;
        }
        Ok(())
    }
}

/// One layer's attention for every row of a pass, each row over its own sequence's cache.
struct LayerAttention<'p, 's, 'a, 'b> {
    shape: attention::AttentionShape,
    segments: &'s [Segment<'a, 'b>],
    layer: usize,
    rows: usize,
    /// Row i's query heads are `q[i * q_stride..][..heads * hd]`.
    q: &'p [f32],
    q_stride: usize,
    row_segment: &'p [usize],
    row_position: &'p [usize],
}

impl LayerAttention<'_, '_, '_, '_> {
    /// Every row's heads in one pool dispatch, over caches of element type `T` (the model's: the
    /// batch was checked to match it).
    fn run<T: CachedValue>(&self, scores: &mut [f32], out: &mut [f32]) {
        let qd = self.shape.heads * self.shape.head_dim;
        let row = |i: usize| {
            let seq = &*self.segments[self.row_segment[i]].seq;
            attention::AttentionRow {
                q: &self.q[i * self.q_stride..i * self.q_stride + qd],
                k_cache: T::layer(&seq.k_cache, self.layer),
                v_cache: T::layer(&seq.v_cache, self.layer),
                last: self.row_position[i],
            }
        };
        attention::attend_rows(self.shape, self.rows, &row, scores, out);
    }
}

enum Sink<'a> {
    /// Keep the logits in `out` (a verify pass has ≤ 16 rows: one lm_head GEMM).
    Batch,
    Callback {
        base: usize,
        f: &'a mut dyn FnMut(usize, &[f32]),
    },
    /// Only each segment's last row: `f(segment, logits)` (a multi-sequence prefill).
    SegmentLast { f: &'a mut dyn FnMut(usize, &[f32]) },
}

/// `residual += proj(input) (+ bias)`, row by row: an output projection (attention's O, the
/// recurrent block's out, the FFN's down) computed into the `out` scratch and added to the
/// residual stream. The row count is `residual`'s rows of `proj.rows()` features.
fn project_into_residual(
    proj: &dyn Projection,
    input: &[f32],
    out: &mut [f32],
    residual: &mut [f32],
    bias: Option<&[f32]>,
    family: RowFamily,
    spent: &mut Duration,
) -> Result<(), ModelError> {
    let hidden = proj.rows();
    timed_gemm(proj, input, residual.len() / hidden, out, family, spent)?;
    add_rows(residual, out, bias, hidden);
    Ok(())
}

fn add_rows(x: &mut [f32], d: &[f32], bias: Option<&[f32]>, hidden: usize) {
    for (xr, dr) in x.chunks_exact_mut(hidden).zip(d.chunks_exact(hidden)) {
        for (a, &b) in xr.iter_mut().zip(dr) {
            *a += b;
        }
        if let Some(bias) = bias {
            for (a, &b) in xr.iter_mut().zip(bias) {
                *a += b;
            }
        }
    }
}
