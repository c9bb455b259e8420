//! The fast forward pass and the model state (position, KV cache, the verify contract).
//!
//! Projections go through [`Projection`] objects built by the loader on top of the kernels layer;
//! everything else (norms, RoPE, attention, SwiGLU) runs on the host in scratch buffers sized at
//! construction, so a token costs no allocation.

use std::sync::Arc;

use super::config::ModelConfig;
use super::ops;
use super::ModelError;

/// Most rows of a verify pass (`m16` family).
pub const MAX_VERIFY_ROWS: usize = 16;
/// Most rows of one prefill chunk (`m128` family).
pub const MAX_PREFILL_ROWS: usize = 128;

/// Row family of a batched pass: which per-shape kernels run it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    M16,
    M128,
}

impl Family {
    pub fn for_rows(m: usize) -> Family {
        if m <= MAX_VERIFY_ROWS {
            Family::M16
        } else {
            Family::M128
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Family::M16 => "m16",
            Family::M128 => "m128",
        }
    }
}

/// A weight matrix `[N = rows, K = cols]` that multiplies activations: `y[m×N] = x[m×K] · Wᵀ`.
pub trait Projection: Send + Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Bytes of weights read by one pass over the matrix.
    fn weight_bytes(&self) -> usize;
    fn gemm(&self, x: &[f32], m: usize, y: &mut [f32], family: Family) -> Result<(), ModelError>;
}

/// The token embedding table, decoded one row at a time.
pub trait Embedding: Send + Sync {
    fn row(&self, token: u32, out: &mut [f32]) -> Result<(), ModelError>;
}

/// Weights of one attention layer.
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// Fused q‖k‖v, `[(heads + 2 kv_heads) head_dim, hidden]`, HF half-split rotary layout.
    pub qkv: Box<dyn Projection>,
    pub qkv_bias: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub o: Box<dyn Projection>,
    pub o_bias: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// Fused gate‖up, `[2 intermediate, hidden]`.
    pub gate_up: Box<dyn Projection>,
    pub down: Box<dyn Projection>,
}

/// Everything the fast forward needs.
pub struct ModelWeights {
    pub config: ModelConfig,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    pub embed: Box<dyn Embedding>,
    /// Separate lm_head, or the embedding matrix itself when tied.
    pub lm_head: Box<dyn Projection>,
    /// Human-readable backend name (for stats lines).
    pub backend: String,
}

impl ModelWeights {
    /// Weight bytes streamed by one decode step (every projection once, plus one embedding row).
    pub fn bytes_per_token(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.weight_bytes()
                    + l.o.weight_bytes()
                    + l.gate_up.weight_bytes()
                    + l.down.weight_bytes()
            })
            .sum();
        per_layer + self.lm_head.weight_bytes()
    }

    fn check_shapes(&self) -> Result<(), ModelError> {
        let c = &self.config;
        let check = |what: String, p: &dyn Projection, n: usize, k: usize| {
            if p.rows() != n || p.cols() != k {
                Err(ModelError::Shape {
                    what: format!(
                        "{what}: expected [{n}, {k}], got [{}, {}]",
                        p.rows(),
                        p.cols()
                    ),
                })
            } else {
                Ok(())
            }
        };
        if self.layers.len() != c.layers {
            return Err(ModelError::Shape {
                what: format!(
                    "{} layers loaded, config says {}",
                    self.layers.len(),
                    c.layers
                ),
            });
        }
        for (i, l) in self.layers.iter().enumerate() {
            check(format!("layer {i} qkv"), &*l.qkv, c.qkv_rows(), c.hidden)?;
            check(format!("layer {i} o_proj"), &*l.o, c.hidden, c.q_dim())?;
            check(
                format!("layer {i} gate_up"),
                &*l.gate_up,
                2 * c.intermediate,
                c.hidden,
            )?;
            check(
                format!("layer {i} down"),
                &*l.down,
                c.hidden,
                c.intermediate,
            )?;
            let vecs = [
                ("input_layernorm", Some(&l.attn_norm), c.hidden),
                ("post_attention_layernorm", Some(&l.ffn_norm), c.hidden),
                ("qkv bias", l.qkv_bias.as_ref(), c.qkv_rows()),
                ("o bias", l.o_bias.as_ref(), c.hidden),
                ("q_norm", l.q_norm.as_ref(), c.head_dim),
                ("k_norm", l.k_norm.as_ref(), c.head_dim),
            ];
            for (name, v, n) in vecs {
                if let Some(v) = v {
                    if v.len() != n {
                        return Err(ModelError::Shape {
                            what: format!("layer {i} {name}: expected {n} values, got {}", v.len()),
                        });
                    }
                }
            }
        }
        check("lm_head".into(), &*self.lm_head, c.vocab, c.hidden)?;
        if self.final_norm.len() != c.hidden {
            return Err(ModelError::Shape {
                what: format!(
                    "model.norm: expected {} values, got {}",
                    c.hidden,
                    self.final_norm.len()
                ),
            });
        }
        Ok(())
    }
}

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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
enum Pending {
    /// No pass outstanding.
    #[default]
    Idle,
    /// A verify pass of `len` rows ran and waits for `commit_verify_rows`.
    Pass { len: usize },
    /// The last pass failed: committed state is intact; call `recover()` (or `reset()`).
    Failed,
}

/// Counters for stats lines.
#[derive(Clone, Copy, Debug, Default)]
pub struct PassStats {
    pub m16_passes: u64,
    pub m128_passes: u64,
    pub m16_rows: u64,
    pub m128_rows: u64,
}

/// The decoding state of one sequence: its KV cache, committed position `P` and pending pass.
///
/// A [`Model`] owns one (the state its single-sequence methods use); a server keeps one per active
/// request and runs several of them in one batched pass with [`Model::step_sequences`].
#[derive(Default)]
pub struct SequenceState {
    ctx: usize,
    /// Per layer `[ctx, kv_heads, head_dim]`.
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    pos: usize,
    pending: Pending,
}

impl SequenceState {
    fn new(config: &ModelConfig, layers: usize, ctx: usize) -> Result<Self, ModelError> {
        if ctx == 0 || ctx > config.max_position_embeddings {
            return Err(ModelError::Context {
                what: format!(
                    "context {ctx} out of range 1..={} (max_position_embeddings)",
                    config.max_position_embeddings
                ),
            });
        }
        let kvd = config.kv_dim();
        Ok(SequenceState {
            ctx,
            k_cache: (0..layers).map(|_| vec![0.0; ctx * kvd]).collect(),
            v_cache: (0..layers).map(|_| vec![0.0; ctx * kvd]).collect(),
            pos: 0,
            pending: Pending::Idle,
        })
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

    /// Forget everything: `P = 0`, no pending pass.
    pub fn reset(&mut self) {
        self.pos = 0;
        self.pending = Pending::Idle;
        // Recurrent (GDN) layers: zero their state here.
    }

    /// Acknowledge a failed pass; the committed state (which the failure left untouched) is kept.
    pub fn recover(&mut self) {
        if self.pending == Pending::Failed {
            self.pending = Pending::Idle;
        }
    }

    fn check_ready(&self) -> Result<(), ModelError> {
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

    fn check_tokens(&self, tokens: &[u32], vocab: usize) -> Result<(), ModelError> {
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

    /// Keep rows `0..n` of the pending pass.
    fn commit(&mut self, n: usize) -> Result<(), ModelError> {
        let len = match self.pending {
            Pending::Pass { len } => len,
            Pending::Idle => {
                return Err(ModelError::State {
                    what: "commit_verify_rows without a pass".into(),
                })
            }
            Pending::Failed => {
                return Err(ModelError::State {
                    what: "commit_verify_rows after a failed pass".into(),
                })
            }
        };
        if n == 0 || n > len {
            return Err(ModelError::Commit { n, len });
        }
        // KV rows P+n.. are stale from here on: attention only ever reads positions < P + rows,
        // and the next pass overwrites them. Recurrent layers: if n < len restore the snapshot and
        // replay the n accepted rows here (NPU_REPLAY_CHECK / NPU_COMMIT_FULL_REPLAY hook in).
        self.pos += n;
        self.pending = Pending::Idle;
        Ok(())
    }
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
    /// Test hook: fail the next pass at this layer (simulates a device fault mid-pass).
    fail_at_layer: Option<usize>,
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
        let seq = SequenceState::new(&c, run_layers, ctx)?;
        let r = MAX_PREFILL_ROWS;
        let half = c.head_dim / 2;
        let s = Scratch {
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
            fail_at_layer: None,
            w,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.w.config
    }
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
    pub fn context(&self) -> usize {
        self.seq.ctx
    }
    pub fn stats(&self) -> PassStats {
        self.stats
    }

    /// A fresh state for another sequence over these weights (`ctx` positions).
    pub fn new_sequence(&self, ctx: usize) -> Result<SequenceState, ModelError> {
        SequenceState::new(&self.w.config, self.run_layers, ctx)
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
        self.seq.pos = position;
        Ok(())
    }

    #[doc(hidden)]
    pub fn inject_failure_at_layer(&mut self, layer: Option<usize>) {
        self.fail_at_layer = layer;
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

    /// One batched pass over several sequences: each `(state, tokens)` feeds its tokens at its own
    /// `P..`, and all rows (1..=16 in total) share every projection. Logit rows come back in input
    /// order (the first sequence's rows first). Every state then waits for its own
    /// [`Model::commit_sequence`]; on failure every state is marked failed with its committed
    /// state intact.
    pub fn step_sequences(
        &mut self,
        batch: &mut [(&mut SequenceState, &[u32])],
    ) -> Result<&BatchOutput, ModelError> {
        let rows: usize = batch.iter().map(|(_, t)| t.len()).sum();
        if rows == 0 || rows > MAX_VERIFY_ROWS {
            return Err(ModelError::BatchRows {
                rows,
                max: MAX_VERIFY_ROWS,
            });
        }
        for (seq, tokens) in batch.iter() {
            seq.check_ready()?;
            if tokens.is_empty() {
                return Err(ModelError::BatchRows {
                    rows: 0,
                    max: MAX_VERIFY_ROWS,
                });
            }
            if seq.k_cache.len() != self.run_layers {
                return Err(ModelError::State {
                    what: format!(
                        "a sequence state of {} layers given to a model running {}",
                        seq.k_cache.len(),
                        self.run_layers
                    ),
                });
            }
            seq.check_tokens(tokens, self.w.config.vocab)?;
        }
        let mut segments: Vec<Segment<'_, '_>> = batch
            .iter_mut()
            .map(|(seq, tokens)| Segment { seq, tokens })
            .collect();
        self.verify_pass(&mut segments, &[])?;
        Ok(&self.out)
    }

    /// Keep rows `0..n` of `seq`'s part of the last [`Model::step_sequences`] pass.
    pub fn commit_sequence(&mut self, seq: &mut SequenceState, n: usize) -> Result<(), ModelError> {
        seq.commit(n)
    }

    /// Feed `tokens` of a server-held sequence in chunks of ≤ 128 rows (see [`Model::prefill_with`]).
    pub fn prefill_sequence(
        &mut self,
        seq: &mut SequenceState,
        tokens: &[u32],
        first_logit_row: usize,
        on_logits: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), ModelError> {
        std::mem::swap(&mut self.seq, seq);
        let r = self.prefill_with(tokens, first_logit_row, on_logits);
        std::mem::swap(&mut self.seq, seq);
        r
    }

    /// The verify pass proper: marks every segment pending (or failed).
    fn verify_pass(
        &mut self,
        segments: &mut [Segment<'_, '_>],
        taps: &[usize],
    ) -> Result<(), ModelError> {
        let rows: usize = segments.iter().map(|s| s.tokens.len()).sum();
        // Recurrent (GDN) layers: snapshot their state at P here, record replay inputs in the pass.
        self.out.taps.clear();
        self.out.taps.extend_from_slice(taps);
        let need = taps.len() * rows * self.w.config.hidden;
        if self.out.tap_states.len() < need {
            self.out.tap_states.resize(need, 0.0);
        }
        self.out.rows = rows;
        match self.forward_rows(segments, Family::M16, 0, &mut Sink::Batch, !taps.is_empty()) {
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
                    seg.seq.pending = Pending::Failed;
                }
                Err(e)
            }
        }
    }

    /// Keep rows `0..n` of the last pass: `P += n`; keys/values beyond `P` are dropped.
    pub fn commit_verify_rows(&mut self, n: usize) -> Result<(), ModelError> {
        self.seq.commit(n)
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
        self.seq.check_ready()?;
        if tokens.is_empty() {
            return Err(ModelError::Context {
                what: "prefill of zero tokens".into(),
            });
        }
        self.seq.check_tokens(tokens, self.w.config.vocab)?;
        self.out.taps.clear();
        let start = self.seq.pos;
        let mut seq = std::mem::take(&mut self.seq);
        let mut result = Ok(());
        for (c, chunk) in tokens.chunks(MAX_PREFILL_ROWS).enumerate() {
            let base = c * MAX_PREFILL_ROWS;
            let first = first_logit_row.saturating_sub(base);
            let mut sink = Sink::Callback { base, f: on_logits };
            let mut segment = [Segment {
                seq: &mut seq,
                tokens: chunk,
            }];
            if let Err(e) = self.forward_rows(
                &mut segment,
                Family::for_rows(chunk.len()),
                first,
                &mut sink,
                false,
            ) {
                seq.pos = start;
                result = Err(e);
                break;
            }
            seq.pos += chunk.len();
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
        family: Family,
        first_logit_row: usize,
        sink: &mut Sink<'_>,
        taps: bool,
    ) -> Result<(), ModelError> {
        let c = &self.w.config;
        let (hd, half, hidden) = (c.head_dim, c.head_dim / 2, c.hidden);
        let (qd, kvd, qkvn, inter) = (c.q_dim(), c.kv_dim(), c.qkv_rows(), c.intermediate);
        let eps = c.rms_eps as f32;
        let s = &mut self.s;
        let mut m = 0;
        for (g, seg) in segments.iter().enumerate() {
            for (j, &t) in seg.tokens.iter().enumerate() {
                let i = m + j;
                let pos = seg.seq.pos + j;
                s.row_segment[i] = g;
                s.row_position[i] = pos;
                self.w
                    .embed
                    .row(t, &mut s.x[i * hidden..(i + 1) * hidden])?;
                ops::rope_angles(
                    pos,
                    &self.inv_freq,
                    &mut s.cos[i * half..(i + 1) * half],
                    &mut s.sin[i * half..(i + 1) * half],
                );
            }
            m += seg.tokens.len();
        }
        let longest = s.row_position[..m].iter().max().map_or(0, |&p| p + 1);
        if s.scores.len() < longest {
            s.scores.resize(longest, 0.0);
        }
        match family {
            Family::M16 => {
                self.stats.m16_passes += 1;
                self.stats.m16_rows += m as u64;
            }
            Family::M128 => {
                self.stats.m128_passes += 1;
                self.stats.m128_rows += m as u64;
            }
        }
        for (l, lw) in self.w.layers[..self.run_layers].iter().enumerate() {
            if self.fail_at_layer == Some(l) {
                return Err(ModelError::Other(format!("injected failure at layer {l}")));
            }
            ops::rmsnorm(
                &s.x[..m * hidden],
                &lw.attn_norm,
                eps,
                &mut s.xn[..m * hidden],
            );
            lw.qkv
                .gemm(&s.xn[..m * hidden], m, &mut s.qkv[..m * qkvn], family)?;
            for i in 0..m {
                let row = &mut s.qkv[i * qkvn..(i + 1) * qkvn];
                if let Some(b) = &lw.qkv_bias {
                    for (v, &b) in row.iter_mut().zip(b) {
                        *v += b;
                    }
                }
                let (cos, sin) = (
                    &s.cos[i * half..(i + 1) * half],
                    &s.sin[i * half..(i + 1) * half],
                );
                for (h, head) in row[..qd + kvd].chunks_exact_mut(hd).enumerate() {
                    let norm = if h < c.heads { &lw.q_norm } else { &lw.k_norm };
                    if let Some(nw) = norm {
                        ops::rmsnorm_inplace(head, nw, eps);
                    }
                    ops::rope_half_split(head, cos, sin);
                }
                let seq = &mut *segments[s.row_segment[i]].seq;
                let p = s.row_position[i];
                seq.k_cache[l][p * kvd..(p + 1) * kvd].copy_from_slice(&row[qd..qd + kvd]);
                seq.v_cache[l][p * kvd..(p + 1) * kvd].copy_from_slice(&row[qd + kvd..qkvn]);
            }
            for i in 0..m {
                let seq = &*segments[s.row_segment[i]].seq;
                ops::attend_row(
                    &s.qkv[i * qkvn..i * qkvn + qd],
                    &seq.k_cache[l],
                    &seq.v_cache[l],
                    c.heads,
                    c.kv_heads,
                    hd,
                    s.row_position[i],
                    &mut s.scores,
                    &mut s.attn[i * qd..(i + 1) * qd],
                );
            }
            lw.o.gemm(&s.attn[..m * qd], m, &mut s.o[..m * hidden], family)?;
            add_rows(
                &mut s.x[..m * hidden],
                &s.o[..m * hidden],
                lw.o_bias.as_deref(),
                hidden,
            );
            ops::rmsnorm(
                &s.x[..m * hidden],
                &lw.ffn_norm,
                eps,
                &mut s.xn[..m * hidden],
            );
            lw.gate_up.gemm(
                &s.xn[..m * hidden],
                m,
                &mut s.gate_up[..m * 2 * inter],
                family,
            )?;
            ops::swiglu(&s.gate_up[..m * 2 * inter], inter, &mut s.act[..m * inter]);
            lw.down
                .gemm(&s.act[..m * inter], m, &mut s.o[..m * hidden], family)?;
            add_rows(&mut s.x[..m * hidden], &s.o[..m * hidden], None, hidden);
            if taps {
                for (t, _) in self.out.taps.iter().enumerate().filter(|(_, &tl)| tl == l) {
                    let at = t * m * hidden;
                    self.out.tap_states[at..at + m * hidden].copy_from_slice(&s.x[..m * hidden]);
                }
            }
        }
        // Logits for rows first_logit_row.., up to 16 rows per lm_head GEMM.
        let vocab = c.vocab;
        let mut r0 = first_logit_row;
        while r0 < m {
            let r1 = (r0 + MAX_VERIFY_ROWS).min(m);
            let n = r1 - r0;
            ops::rmsnorm(
                &s.x[r0 * hidden..r1 * hidden],
                &self.w.final_norm,
                eps,
                &mut s.head_in[..n * hidden],
            );
            let fam = Family::for_rows(n);
            self.w.lm_head.gemm(
                &s.head_in[..n * hidden],
                n,
                &mut self.out.logits[..n * vocab],
                fam,
            )?;
            if let Sink::Callback { base, f } = sink {
                for i in 0..n {
                    f(*base + r0 + i, &self.out.logits[i * vocab..(i + 1) * vocab]);
                }
            }
            r0 = r1;
        }
        Ok(())
    }
}

enum Sink<'a> {
    /// Keep the logits in `out` (a verify pass has ≤ 16 rows: one lm_head GEMM).
    Batch,
    Callback {
        base: usize,
        f: &'a mut dyn FnMut(usize, &[f32]),
    },
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
