//! The engine seam: every line of `forward-serve` that touches the model layer lives in this file.
//!
//! The server talks to two small traits of its own:
//! - [`TextCodec`] (shared, `Send + Sync`): tokenizer, chat template, EOS ids, context length, model id.
//!   HTTP handlers use it to validate and tokenize before a request is queued.
//! - [`Engine`] (owned by the single engine thread; the NPU is single-tenant): sequences, prefill and
//!   decode passes that hand back logits.
//!
//! Sampling and streaming detokenization come from the model layer and are re-exported here so the
//! rest of the server never names `xdna::model` directly.

use std::sync::Arc;

pub use xdna::model::logprobs::TokenLogprob;
pub use xdna::model::sampling::{LogitAdjustments, Sampler, SamplingConfig, SamplingError};
pub use xdna::model::text::{StopFilter, Utf8Stream};

/// One sequence's handle inside an [`Engine`].
pub type SeqId = u64;

/// Errors of the engine seam.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model, its tokenizer or its backend could not be loaded.
    #[error("load: {0}")]
    Load(String),
    /// The model has no chat template, or rendering it failed.
    #[error("chat template: {0}")]
    Template(String),
    /// A model pass failed (device or model error); counted in the `device_errors` metric.
    #[error("device: {0}")]
    Device(String),
    /// A sequence id the engine does not hold.
    #[error("no such sequence {0}")]
    NoSequence(SeqId),
    /// A request past the engine's limits: too many sequences, rows or positions.
    #[error("engine capacity: {0}")]
    Capacity(String),
}

pub use xdna::weights::ChatMessage;

/// A description of the served model, as the Ollama routes list it.
#[derive(Clone, Debug)]
pub struct ModelDetails {
    /// Architecture (`llama`, `qwen3`, ...).
    pub family: String,
    /// Container of the weights (`q4nx`, `gguf`).
    pub format: String,
    /// Bytes of the weights file.
    pub size_bytes: u64,
    /// Parameter count in words (`135M`), empty when unknown.
    pub parameter_size: String,
    /// Weight type of the projections (`Q4_1`), empty when unknown.
    pub quantization: String,
    /// A content digest of the weights (`sha256:…`), empty when not computed.
    pub digest: String,
    /// The weights file's modification time.
    pub modified: std::time::SystemTime,
    /// The chat template's source.
    pub chat_template: Option<String>,
}

impl Default for ModelDetails {
    fn default() -> Self {
        ModelDetails {
            family: "unknown".into(),
            format: String::new(),
            size_bytes: 0,
            parameter_size: String::new(),
            quantization: String::new(),
            digest: String::new(),
            modified: std::time::UNIX_EPOCH,
            chat_template: None,
        }
    }
}

/// Text side of a model: shared by the HTTP handlers and the engine thread.
pub trait TextCodec: Send + Sync {
    /// The model id reported by `/v1/models` and in responses.
    fn model_id(&self) -> &str;
    /// KV positions of one sequence.
    fn context_len(&self) -> usize;
    /// Tokens that end a generation.
    fn eos_ids(&self) -> &[u32];
    /// Token ids are `0..vocab_size()`.
    fn vocab_size(&self) -> usize;
    /// Plain tokenization (no BOS); `special` lets special-token text map to its id.
    fn tokenize(&self, text: &str, special: bool) -> Result<Vec<u32>, EngineError>;
    /// Token ids of a prompt: BOS when the model wants one, then the text.
    fn prompt_tokens(&self, text: &str, special: bool) -> Result<Vec<u32>, EngineError> {
        self.tokenize(text, special)
    }
    /// The raw bytes of one token (may be part of a UTF-8 character).
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    /// Render a chat into the prompt text (template with the generation prompt appended).
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, EngineError>;
    /// What `/api/tags` and `/api/show` say about the model.
    fn details(&self) -> ModelDetails {
        ModelDetails::default()
    }
    /// Decode ids to text (invalid UTF-8 becomes U+FFFD).
    fn detokenize(&self, ids: &[u32]) -> String {
        let mut u = Utf8Stream::default();
        let mut out = String::new();
        for &id in ids {
            u.push(&self.token_bytes(id), &mut out);
        }
        u.finish(&mut out);
        out
    }
}

/// Most rows of one [`Engine::step`] pass (the model's `m16` verify family).
pub const MAX_STEP_ROWS: usize = xdna::model::MAX_VERIFY_ROWS;
/// Most prompt tokens of one [`Engine::prefill`] call: the scheduler feeds longer prompts in chunks
/// between decode turns so a long prompt never stalls the running streams for long (one `m128`
/// prefill pass).
pub const PREFILL_CHUNK: usize = xdna::model::MAX_PREFILL_ROWS;

/// One prompt chunk of one sequence for [`Engine::prefill`].
#[derive(Clone, Copy, Debug)]
pub struct PrefillItem<'a> {
    /// The sequence.
    pub seq: SeqId,
    /// The chunk's tokens (the sequence's next positions).
    pub tokens: &'a [u32],
    /// The chunk ends the prompt: its last row predicts the first new token.
    pub last: bool,
    /// Every row's logits are wanted (an echoed prompt's log-probabilities).
    pub all_rows: bool,
}

impl PrefillItem<'_> {
    /// The first row whose logits the sink gets (`usize::MAX`: none).
    pub fn first_logit_row(&self) -> usize {
        if self.all_rows {
            0
        } else if self.last {
            self.tokens.len().saturating_sub(1)
        } else {
            usize::MAX
        }
    }
}

/// Compute side of a model: lives on the engine thread only.
pub trait Engine {
    /// How many sequences can be resident at once (the scheduler admits at most this many).
    fn max_sequences(&self) -> usize;
    /// Start an empty sequence (its state is allocated here and freed by [`Engine::release`]).
    fn new_sequence(&mut self) -> Result<SeqId, EngineError>;
    /// Start a sequence for `prompt`, holding as many of its first tokens as the engine can take
    /// from states it keeps (the prefix cache): returns the sequence and that count, always less
    /// than `prompt.len()` (the last prompt token is fed, and its logits start the generation).
    /// The output is the same as from a cold start. This default keeps nothing.
    fn new_sequence_for(&mut self, prompt: &[u32]) -> Result<(SeqId, usize), EngineError> {
        let _ = prompt;
        Ok((self.new_sequence()?, 0))
    }
    /// Make `to` (a sequence nothing was fed to) a copy of `from`'s committed state: several
    /// samples of one prompt read it once. Engines that cannot refuse, and the caller feeds `to`
    /// itself.
    fn fork(&mut self, from: SeqId, to: SeqId) -> Result<(), EngineError> {
        let _ = (from, to);
        Err(EngineError::Capacity(
            "this engine does not copy sequences".into(),
        ))
    }
    /// Feed one chunk (≤ [`PREFILL_CHUNK`] tokens) of a sequence's prompt; the chunk is committed.
    /// `sink(row, logits)` gets the logits of every row when `item.all_rows` (row `j` predicts
    /// the token after input `j`: the log-probabilities of an echoed prompt), else of the last
    /// row only when `item.last` (predicting the first new token).
    fn prefill(
        &mut self,
        item: &PrefillItem<'_>,
        sink: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), EngineError>;
    /// Feed one prompt chunk each of several distinct sequences (≤ [`PREFILL_CHUNK`] tokens in
    /// all), committed; `sink(i, row, logits)` gets item `i`'s rows as [`Engine::prefill`] says.
    /// The model engine runs them in ONE pass (one sweep over the weights instead of one per
    /// prompt); this default feeds them one at a time. On failure the items are to be failed by
    /// the caller (earlier ones may have been fed).
    fn prefill_many(
        &mut self,
        items: &[PrefillItem<'_>],
        sink: &mut dyn FnMut(usize, usize, &[f32]),
    ) -> Result<(), EngineError> {
        for (i, item) in items.iter().enumerate() {
            self.prefill(item, &mut |row, l| sink(i, row, l))?;
        }
        Ok(())
    }
    /// One batched pass: every `(seq, tokens)` segment feeds its tokens at the sequence's own next
    /// positions (1.. tokens per segment, ≤ [`MAX_STEP_ROWS`] rows in all, distinct sequences).
    /// `sink(segment, row, logits)` gets each row's logits (row `j` predicts the token after input
    /// `j`). Every segment's sequence then waits for [`Engine::commit`]; on failure no sequence's
    /// committed state changed (and none waits for a commit).
    fn step(
        &mut self,
        batch: &[(SeqId, &[u32])],
        sink: &mut dyn FnMut(usize, usize, &[f32]),
    ) -> Result<(), EngineError>;
    /// Keep the first `n` rows of `seq`'s segment of the last [`Engine::step`].
    fn commit(&mut self, seq: SeqId, n: usize) -> Result<(), EngineError>;
    /// Committed positions of a sequence.
    fn position(&self, seq: SeqId) -> usize;
    /// Forget a sequence and free its state.
    fn release(&mut self, seq: SeqId);
    /// Sequence states allocated now (running, cached for their prefix, or spare): the memory
    /// the engine holds beyond the model, bounded by its capacity plus its prefix cache.
    fn states_held(&self) -> usize {
        0
    }
}

/// A loaded model: its codec and its engine, which the server moves onto the engine thread.
pub struct Loaded {
    /// Tokenizer and chat template, shared with the HTTP handlers.
    pub codec: Arc<dyn TextCodec>,
    /// The compute side, owned by the engine thread once the server starts.
    pub engine: Box<dyn Engine + Send>,
}

/// Options for loading the real model.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// The model (`None`: the default model), its backend and kernel set.
    pub model: xdna::cli::ModelArgs,
    /// KV positions per sequence.
    pub ctx: usize,
    /// Sequences resident at once (each with its own KV cache of `ctx` positions; ≤ 16).
    pub max_sequences: usize,
    /// Finished sequences kept for their prompt prefixes (each a KV cache of `ctx` positions);
    /// 0 turns the prefix cache off.
    pub prefix_cache: usize,
}

// ---- the real model -------------------------------------------------------------------------

use std::collections::HashMap;
use xdna::model::{Model, ModelError, SequenceState};
use xdna::weights::{Package, WeightsError};

fn device_err(e: ModelError) -> EngineError {
    EngineError::Device(e.to_string())
}

/// Codec over a weights package: its tokenizer, chat template and EOS ids.
pub struct PackageCodec {
    pkg: Arc<Package>,
    id: String,
    ctx: usize,
    eos: Vec<u32>,
}

impl TextCodec for PackageCodec {
    fn model_id(&self) -> &str {
        &self.id
    }
    fn context_len(&self) -> usize {
        self.ctx
    }
    fn eos_ids(&self) -> &[u32] {
        &self.eos
    }
    fn vocab_size(&self) -> usize {
        self.pkg.tokenizer().vocab_size()
    }
    fn tokenize(&self, text: &str, special: bool) -> Result<Vec<u32>, EngineError> {
        Ok(self.pkg.tokenizer().encode(text, special))
    }
    fn prompt_tokens(&self, text: &str, special: bool) -> Result<Vec<u32>, EngineError> {
        Ok(self.pkg.encode_prompt(text, special))
    }
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.pkg.tokenizer().token_bytes(id).to_vec()
    }
    fn details(&self) -> ModelDetails {
        let weights = self.pkg.dir().join("model.q4nx");
        let meta = std::fs::metadata(&weights).ok();
        let config = self.pkg.config();
        ModelDetails {
            family: config.model_type.clone(),
            format: "q4nx".into(),
            size_bytes: meta.as_ref().map_or(0, std::fs::Metadata::len),
            parameter_size: String::new(),
            quantization: String::new(),
            digest: String::new(),
            modified: meta
                .and_then(|m| m.modified().ok())
                .unwrap_or(std::time::UNIX_EPOCH),
            chat_template: self.pkg.chat_template().map(str::to_string),
        }
    }
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        // The client sees the template's message, not the server's package path.
        self.pkg.render_chat(messages).map_err(|e| match e {
            WeightsError::ChatTemplate { what, .. } => {
                EngineError::Template(format!("model {}: {what}", self.id))
            }
            other => EngineError::Template(other.to_string()),
        })
    }
}

/// The real model behind the [`Engine`] seam: the shared weights (one [`Model`]) and one
/// [`SequenceState`] (KV cache of `ctx` positions) per resident sequence, at most `capacity`.
/// An ended sequence's state goes to the prefix cache or the spares, so KV memory is bounded by
/// `(capacity + prefix cache capacity) × ctx` positions and reached once, not churned.
pub struct ModelEngine {
    model: Model,
    ctx: usize,
    capacity: usize,
    seqs: HashMap<SeqId, SequenceState>,
    /// The tokens each resident sequence's state holds (committed, in order).
    history: HashMap<SeqId, Vec<u32>>,
    /// The tokens of each sequence's last step, until its commit says how many were kept.
    stepped: HashMap<SeqId, Vec<u32>>,
    cache: PrefixCache,
    /// States of ended sequences, reset and ready for new ones (at most `capacity` + the prefix
    /// cache's capacity states exist in all): a request allocates no KV cache once the server is
    /// warm.
    spare: Vec<SequenceState>,
    next: SeqId,
}

/// Finished sequences' states with the tokens they hold, most recently used first, at most
/// `capacity`; a new request starts from the longest usable prefix.
struct PrefixCache {
    capacity: usize,
    entries: std::collections::VecDeque<(Vec<u32>, SequenceState)>,
}

/// How many of `prompt`'s first tokens a state holding `tokens` can give: their common prefix,
/// at most `prompt.len() − 1` (the last is fed for its logits); a state with recurrent layers only
/// as a whole (its recurrent state exists at its end only).
fn usable_prefix(tokens: &[u32], state: &SequenceState, prompt: &[u32]) -> usize {
    let common = tokens
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count()
        .min(prompt.len().saturating_sub(1));
    if common == tokens.len() || !state.has_recurrent() {
        common
    } else {
        0
    }
}

impl PrefixCache {
    /// The longest usable prefix of `prompt` among the entries: `(entry, tokens)`.
    fn best(&self, prompt: &[u32]) -> Option<(usize, usize)> {
        self.entries
            .iter()
            .enumerate()
            .map(|(i, (tokens, state))| (i, usable_prefix(tokens, state, prompt)))
            .filter(|&(_, common)| common > 0)
            .max_by_key(|&(i, common)| (common, std::cmp::Reverse(i)))
    }

    /// Keep `state` holding `tokens`; entries it extends are dropped (it serves them all), and
    /// the least recently used beyond the capacity. Returns the states let go.
    fn insert(&mut self, tokens: Vec<u32>, state: SequenceState) -> Vec<SequenceState> {
        if self.capacity == 0 || tokens.is_empty() {
            return vec![state];
        }
        let mut out = Vec::new();
        let mut kept = std::collections::VecDeque::with_capacity(self.capacity);
        for (t, s) in self.entries.drain(..) {
            if t.len() <= tokens.len() && tokens[..t.len()] == t[..] {
                out.push(s);
            } else {
                kept.push_back((t, s));
            }
        }
        kept.push_front((tokens, state));
        while kept.len() > self.capacity {
            if let Some((_, s)) = kept.pop_back() {
                out.push(s);
            }
        }
        self.entries = kept;
        out
    }
}

impl ModelEngine {
    /// `capacity` sequences of `ctx` positions each (capacity is capped at [`MAX_STEP_ROWS`]: one
    /// decode row per sequence must fit one pass).
    /// `prefix_cache` finished sequences are kept for their prompt prefixes (0: none).
    pub fn new(model: Model, ctx: usize, capacity: usize, prefix_cache: usize) -> Self {
        ModelEngine {
            model,
            ctx,
            capacity: capacity.clamp(1, MAX_STEP_ROWS),
            seqs: HashMap::new(),
            history: HashMap::new(),
            stepped: HashMap::new(),
            cache: PrefixCache {
                capacity: prefix_cache,
                entries: std::collections::VecDeque::new(),
            },
            spare: Vec::new(),
            next: 1,
        }
    }

    /// Record the tokens a sequence's state now holds.
    fn fed(&mut self, seq: SeqId, tokens: &[u32]) {
        self.history
            .entry(seq)
            .or_default()
            .extend_from_slice(tokens);
    }
}

impl ModelEngine {
    /// Run one pass over the states of the distinct sequences `ids`, taken out of the map for its
    /// duration and always put back. On failure each state is `recover`ed: a failed pass leaves
    /// the committed state untouched, and the sequence is ready for the next one.
    fn with_states(
        &mut self,
        ids: impl Iterator<Item = SeqId>,
        pass: impl FnOnce(&mut Model, &mut [SequenceState]) -> Result<(), ModelError>,
    ) -> Result<(), EngineError> {
        let mut taken: Vec<(SeqId, SequenceState)> = Vec::new();
        for id in ids {
            match self.seqs.remove(&id) {
                Some(state) => taken.push((id, state)),
                None => {
                    self.seqs.extend(taken);
                    return Err(EngineError::NoSequence(id));
                }
            }
        }
        let (order, mut states): (Vec<SeqId>, Vec<SequenceState>) = taken.into_iter().unzip();
        let result = pass(&mut self.model, &mut states);
        if result.is_err() {
            states.iter_mut().for_each(SequenceState::recover);
        }
        self.seqs.extend(order.into_iter().zip(states));
        result.map_err(device_err)
    }
}

impl Engine for ModelEngine {
    fn max_sequences(&self) -> usize {
        self.capacity
    }
    fn new_sequence(&mut self) -> Result<SeqId, EngineError> {
        if self.seqs.len() >= self.capacity {
            return Err(EngineError::Capacity(format!(
                "{} sequences resident (the most this engine holds)",
                self.seqs.len()
            )));
        }
        let state = match self.spare.pop() {
            Some(mut s) => {
                s.reset();
                s
            }
            None => self.model.new_sequence(self.ctx).map_err(device_err)?,
        };
        let id = self.next;
        self.next += 1;
        self.seqs.insert(id, state);
        self.history.insert(id, Vec::new());
        Ok(id)
    }
    fn new_sequence_for(&mut self, prompt: &[u32]) -> Result<(SeqId, usize), EngineError> {
        let id = self.new_sequence()?;
        if self.cache.capacity == 0 {
            return Ok((id, 0));
        }
        // The running sequences are at rest between passes: their committed prefixes serve as
        // well as the cache's (a shared system prompt still being answered).
        let running = self
            .history
            .iter()
            .filter(|(&seq, _)| seq != id)
            .filter_map(|(&seq, tokens)| {
                let state = self.seqs.get(&seq)?;
                let at_rest = state.pending_rows().is_none() && state.position() == tokens.len();
                let common = usable_prefix(tokens, state, prompt);
                (common > 0 && at_rest).then_some((seq, common))
            })
            .max_by_key(|&(seq, common)| (common, std::cmp::Reverse(seq)));
        let cached = self.cache.best(prompt);
        let mut state = self.seqs.remove(&id).ok_or(EngineError::NoSequence(id))?;
        let copied = match (running, cached) {
            (Some((seq, common)), c) if c.is_none_or(|(_, cc)| common >= cc) => self
                .seqs
                .get(&seq)
                .map(|src| (state.copy_prefix_from(src, common), common, None)),
            (_, Some((entry, common))) => self
                .cache
                .entries
                .get(entry)
                .map(|(_, src)| (state.copy_prefix_from(src, common), common, Some(entry))),
            _ => None,
        };
        self.seqs.insert(id, state);
        match copied {
            Some((Ok(()), common, entry)) => {
                // Most recently used first.
                if let Some(e) = entry.and_then(|i| self.cache.entries.remove(i)) {
                    self.cache.entries.push_front(e);
                }
                self.fed(id, &prompt[..common]);
                Ok((id, common))
            }
            Some((Err(e), _, _)) => {
                tracing::warn!("prefix cache: {e}; reading the prompt cold");
                Ok((id, 0))
            }
            None => Ok((id, 0)),
        }
    }
    fn fork(&mut self, from: SeqId, to: SeqId) -> Result<(), EngineError> {
        let mut dst = self.seqs.remove(&to).ok_or(EngineError::NoSequence(to))?;
        let r = match self.seqs.get(&from) {
            Some(src) => dst
                .copy_prefix_from(src, src.position())
                .map_err(device_err),
            None => Err(EngineError::NoSequence(from)),
        };
        self.seqs.insert(to, dst);
        r?;
        let tokens = self.history.get(&from).cloned().unwrap_or_default();
        self.history.insert(to, tokens);
        Ok(())
    }
    fn prefill(
        &mut self,
        item: &PrefillItem<'_>,
        sink: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), EngineError> {
        let seq = item.seq;
        let mut state = self.seqs.remove(&seq).ok_or(EngineError::NoSequence(seq))?;
        let r = self.model.prefill_sequence(
            &mut state,
            item.tokens,
            item.first_logit_row(),
            &mut |row, l| sink(row, l),
        );
        if r.is_err() {
            // The failed chunk left the committed state untouched; acknowledge it.
            state.recover();
        }
        self.seqs.insert(seq, state);
        r.map_err(device_err)?;
        self.fed(seq, item.tokens);
        Ok(())
    }
    fn prefill_many(
        &mut self,
        items: &[PrefillItem<'_>],
        sink: &mut dyn FnMut(usize, usize, &[f32]),
    ) -> Result<(), EngineError> {
        // A chunk whose every row is wanted runs alone (the batched pass hands back each
        // sequence's last row only); the others share one pass.
        for (i, item) in items.iter().enumerate().filter(|(_, it)| it.all_rows) {
            self.prefill(item, &mut |row, l| sink(i, row, l))?;
        }
        let shared: Vec<usize> = (0..items.len()).filter(|&i| !items[i].all_rows).collect();
        if shared.is_empty() {
            return Ok(());
        }
        self.with_states(shared.iter().map(|&i| items[i].seq), |model, states| {
            let mut batch: Vec<(&mut SequenceState, &[u32])> = states
                .iter_mut()
                .zip(&shared)
                .map(|(state, &i)| (state, items[i].tokens))
                .collect();
            model.prefill_sequences(&mut batch, &mut |k, l| {
                let item = &items[shared[k]];
                if item.last {
                    sink(shared[k], item.tokens.len() - 1, l)
                }
            })
        })?;
        for &i in &shared {
            self.fed(items[i].seq, items[i].tokens);
        }
        Ok(())
    }
    fn step(
        &mut self,
        batch: &[(SeqId, &[u32])],
        sink: &mut dyn FnMut(usize, usize, &[f32]),
    ) -> Result<(), EngineError> {
        self.with_states(batch.iter().map(|item| item.0), |model, states| {
            let mut segments: Vec<(&mut SequenceState, &[u32])> = states
                .iter_mut()
                .zip(batch)
                .map(|(state, &(_, toks))| (state, toks))
                .collect();
            let out = model.step_sequences(&mut segments)?;
            let mut row = 0;
            for (g, &(_, toks)) in batch.iter().enumerate() {
                for j in 0..toks.len() {
                    sink(g, j, out.logits(row));
                    row += 1;
                }
            }
            Ok(())
        })?;
        for &(seq, toks) in batch {
            self.stepped.insert(seq, toks.to_vec());
        }
        Ok(())
    }
    fn commit(&mut self, seq: SeqId, n: usize) -> Result<(), EngineError> {
        let mut state = self.seqs.remove(&seq).ok_or(EngineError::NoSequence(seq))?;
        let r = self.model.commit_sequence(&mut state, n);
        self.seqs.insert(seq, state);
        r.map_err(device_err)?;
        if let Some(toks) = self.stepped.remove(&seq) {
            self.fed(seq, &toks[..n.min(toks.len())]);
        }
        Ok(())
    }
    fn position(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, SequenceState::position)
    }
    fn states_held(&self) -> usize {
        self.seqs.len() + self.spare.len() + self.cache.entries.len()
    }
    fn release(&mut self, seq: SeqId) {
        self.stepped.remove(&seq);
        let tokens = self.history.remove(&seq);
        let Some(state) = self.seqs.remove(&seq) else {
            return;
        };
        // Only a state at rest is cached: its committed positions hold exactly `tokens`.
        let freed = match tokens {
            Some(t) if state.pending_rows().is_none() && state.position() == t.len() => {
                self.cache.insert(t, state)
            }
            _ => vec![state],
        };
        // A let-go state is kept as a spare while the states held stay within what running and
        // cached sequences may hold at once: a state freed and another allocated later would only
        // churn the allocator (resident memory creeping up), never lower the peak.
        for s in freed {
            if self.states_held() < self.capacity + self.cache.capacity {
                self.spare.push(s);
            }
        }
    }
}

/// Load the real model through the model layer's loader (package directory or GGUF; `None`: the
/// default model), with `ctx` positions.
pub fn load(spec: &LoadSpec) -> Result<Loaded, EngineError> {
    use xdna::model::load::open_model;
    let load_err = |e: &dyn std::fmt::Display| EngineError::Load(e.to_string());
    let opts = spec.model.load_options(false);
    let (pkg, model) =
        open_model(spec.model.path.as_deref(), spec.ctx, &opts).map_err(|e| load_err(&e))?;
    let ctx = model.context();
    let id = model_id(spec.model.path.as_deref(), &pkg);
    let eos = pkg.eos_token_ids().to_vec();
    tracing::info!(
        "loaded {} ({} positions, EOS {:?}, backend {})",
        id,
        ctx,
        eos,
        model.weights().backend
    );
    Ok(Loaded {
        codec: Arc::new(PackageCodec { pkg, id, ctx, eos }),
        engine: Box::new(ModelEngine::new(
            model,
            ctx,
            spec.max_sequences,
            spec.prefix_cache,
        )),
    })
}

/// The served model id: the file stem of a GGUF, else the package directory's name.
fn model_id(path: Option<&std::path::Path>, pkg: &Package) -> String {
    let from = |p: &std::path::Path| {
        let p = if p.is_dir() {
            p.to_path_buf()
        } else {
            p.with_extension("")
        };
        p.file_name().map(|s| s.to_string_lossy().into_owned())
    };
    path.and_then(from)
        .or_else(|| from(pkg.dir()))
        .unwrap_or_else(|| "model".into())
}
