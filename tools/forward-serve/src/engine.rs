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
    /// The engine's drafter could not propose (no draft, or its context is out of step with the
    /// sequence); the sequence decodes plainly.
    #[error("drafter: {0}")]
    Draft(String),
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

/// How [`Engine::start_sequence`] starts a sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SequenceStart {
    /// Take as many of the prompt's first tokens as the engine can from states it keeps (the
    /// prefix cache; see [`Engine::new_sequence_for`]).
    pub reuse_prefix: bool,
    /// Draft with the engine's DFlash draft ([`Engine::dflash_drafts`]): the engine feeds it the
    /// target's hidden states of every row the sequence commits.
    pub dflash: bool,
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
    /// Start a sequence for `prompt` as `start` says: from a kept prefix
    /// ([`Engine::new_sequence_for`]) or cold, drafting with the DFlash draft or not. Returns the
    /// sequence and the prompt tokens it already holds. This default has no DFlash draft.
    fn start_sequence(
        &mut self,
        prompt: &[u32],
        start: SequenceStart,
    ) -> Result<(SeqId, usize), EngineError> {
        if start.dflash {
            return Err(EngineError::Draft("this engine has no DFlash draft".into()));
        }
        if start.reuse_prefix {
            self.new_sequence_for(prompt)
        } else {
            Ok((self.new_sequence()?, 0))
        }
    }
    /// Whether sequences may draft with a DFlash draft (`forward-serve --draft`).
    fn has_dflash(&self) -> bool {
        false
    }
    /// Up to `k` DFlash drafts (`out`, cleared first) after `seq`'s pending token: the first `k`
    /// of one draft block's (`DflashDraft::block_drafts`, at most block size − 1). Refused
    /// unless `seq` was started with [`SequenceStart::dflash`] and its draft holds exactly the
    /// sequence's committed positions.
    fn dflash_drafts(
        &mut self,
        seq: SeqId,
        pending: u32,
        k: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), EngineError> {
        let _ = (seq, pending, k, out);
        Err(EngineError::Draft("this engine has no DFlash draft".into()))
    }
    /// Diagnostics: the context rows `seq`'s DFlash draft holds (`None`: it does not draft with
    /// one). Between passes this equals [`Engine::position`].
    fn dflash_context(&self, seq: SeqId) -> Option<usize> {
        let _ = seq;
        None
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
    /// A DFlash draft (a `dflash` GGUF or package) that requests may draft with.
    pub draft: Option<std::path::PathBuf>,
}

// ---- the real model -------------------------------------------------------------------------

use std::collections::HashMap;
use xdna::model::dflash::{DflashDraft, DflashWeights};
use xdna::model::{BatchOutput, Model, ModelError, SequenceState};
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
    /// The DFlash draft (`--draft`), when the server has one.
    dflash: Option<Dflash>,
}

/// A DFlash draft bound to the target: one [`DflashDraft`] (its own context cache) per sequence
/// slot, the weights shared, and the context of each sequence drafting with it.
struct Dflash {
    /// The target layers whose hidden states make a context row, in the draft's order.
    taps: Vec<usize>,
    /// Floats per context row: taps × the target's hidden width.
    width: usize,
    /// Drafts not bound to a sequence, reset; `capacity` of them exist in all.
    spare: Vec<DflashDraft>,
    /// The sequences drafting with DFlash.
    seqs: HashMap<SeqId, DraftingSeq>,
}

/// One sequence's DFlash context.
struct DraftingSeq {
    draft: DflashDraft,
    /// The context row (`width` floats: the target's hidden states after the tap layers) of
    /// every committed position, as the draft was fed them. Kept so that a prefix of them seeds
    /// another sequence's draft when that sequence starts from this one's KV cache (prefix
    /// cache, samples of one prompt): the KV cache alone does not hold the hidden states.
    features: Vec<f32>,
    /// This sequence's rows of the last step, `[rows, width]`, until its commit says how many
    /// are kept.
    stepped: Vec<f32>,
}

impl Dflash {
    /// Feed `seq`'s draft the context rows `features` (`[rows, width]`) of its next committed
    /// positions. A failure leaves the draft out of step with the sequence, which then decodes
    /// plainly (its drafts are refused); the features are kept, they are the target's.
    fn commit_rows(&mut self, seq: SeqId, features: &[f32]) {
        let width = self.width;
        let Some(d) = self.seqs.get_mut(&seq) else {
            return;
        };
        let start = d.features.len();
        d.features.extend_from_slice(features);
        let rows = features.len() / width.max(1);
        if let Err(e) = d.draft.push_context(&d.features[start..], rows) {
            tracing::warn!("DFlash draft of sequence {seq}: {e}; it decodes plainly");
        }
    }

    /// `seq`'s first `rows` context rows, when it drafts with DFlash and holds them.
    fn prefix(&self, seq: SeqId, rows: usize) -> Option<&[f32]> {
        self.seqs.get(&seq)?.features.get(..rows * self.width)
    }
}

/// `[rows, taps · hidden]` from `out`'s `[taps, rows, hidden]`: rows `rows`, taps in order.
fn gather_taps(out: &BatchOutput, taps: usize, rows: std::ops::Range<usize>, dst: &mut Vec<f32>) {
    for r in rows {
        for t in 0..taps {
            dst.extend_from_slice(out.tap(t, r));
        }
    }
}

/// A finished sequence kept for its prefix.
struct Cached {
    /// The tokens its state holds.
    tokens: Vec<u32>,
    state: SequenceState,
    /// Its DFlash context rows, one per token, when it drafted with DFlash (only such an entry
    /// can start a DFlash sequence).
    features: Option<Vec<f32>>,
}

/// Finished sequences' states with the tokens they hold, most recently used first, at most
/// `capacity`; a new request starts from the longest usable prefix.
struct PrefixCache {
    capacity: usize,
    entries: std::collections::VecDeque<Cached>,
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
    /// The longest usable prefix of `prompt` among the entries: `(entry, tokens)`. With
    /// `features` (the floats per DFlash context row), only entries holding the context rows of
    /// that prefix count.
    fn best(&self, prompt: &[u32], features: Option<usize>) -> Option<(usize, usize)> {
        self.entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let common = usable_prefix(&e.tokens, &e.state, prompt);
                let fits = features.is_none_or(|width| {
                    e.features
                        .as_ref()
                        .is_some_and(|f| f.len() >= common * width)
                });
                (i, if fits { common } else { 0 })
            })
            .filter(|&(_, common)| common > 0)
            .max_by_key(|&(i, common)| (common, std::cmp::Reverse(i)))
    }

    /// Keep `entry`; entries it extends are dropped (it serves them all, unless it lacks the
    /// DFlash context rows they hold), and the least recently used beyond the capacity.
    /// Returns the states let go.
    fn insert(&mut self, entry: Cached) -> Vec<SequenceState> {
        if self.capacity == 0 || entry.tokens.is_empty() {
            return vec![entry.state];
        }
        let mut out = Vec::new();
        let mut kept = std::collections::VecDeque::with_capacity(self.capacity);
        for e in self.entries.drain(..) {
            let extended = e.tokens.len() <= entry.tokens.len()
                && entry.tokens[..e.tokens.len()] == e.tokens[..]
                && (e.features.is_none() || entry.features.is_some());
            if extended {
                out.push(e.state);
            } else {
                kept.push_back(e);
            }
        }
        kept.push_front(entry);
        while kept.len() > self.capacity {
            if let Some(e) = kept.pop_back() {
                out.push(e.state);
            }
        }
        self.entries = kept;
        out
    }
}

/// Where a new sequence's prefix is copied from.
#[derive(Clone, Copy)]
enum PrefixSource {
    /// A running sequence, at rest between passes.
    Running(SeqId),
    /// A prefix-cache entry.
    Cached(usize),
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
            dflash: None,
        }
    }

    /// Let sequences draft with the DFlash draft `weights` (checked against the target by
    /// [`DflashDraft::new`]): one draft context per sequence slot, bound to the target's
    /// weights.
    pub fn with_dflash(mut self, weights: Arc<DflashWeights>) -> Result<Self, ModelError> {
        let taps = weights.params().target_layers.clone();
        let width = taps.len() * self.model.config().hidden;
        let spare = (0..self.capacity)
            .map(|_| DflashDraft::new(weights.clone(), self.model.weights_arc()))
            .collect::<Result<Vec<_>, _>>()?;
        self.dflash = Some(Dflash {
            taps,
            width,
            spare,
            seqs: HashMap::new(),
        });
        Ok(self)
    }

    /// Record the tokens a sequence's state now holds.
    fn fed(&mut self, seq: SeqId, tokens: &[u32]) {
        self.history
            .entry(seq)
            .or_default()
            .extend_from_slice(tokens);
    }

    /// Whether `seq` drafts with DFlash.
    fn drafting(&self, seq: SeqId) -> bool {
        self.dflash
            .as_ref()
            .is_some_and(|d| d.seqs.contains_key(&seq))
    }

    /// The taps a pass over `seqs` needs: the draft's when one of them drafts with DFlash.
    fn taps_for(&self, mut seqs: impl Iterator<Item = SeqId>) -> Vec<usize> {
        match &self.dflash {
            Some(d) if seqs.any(|s| d.seqs.contains_key(&s)) => d.taps.clone(),
            _ => Vec::new(),
        }
    }

    /// Bind a DFlash draft (empty context) to the new sequence `seq`.
    fn attach_draft(&mut self, seq: SeqId) -> Result<(), EngineError> {
        let Some(d) = self.dflash.as_mut() else {
            return Err(EngineError::Draft(
                "this server has no DFlash draft (start it with --draft PATH)".into(),
            ));
        };
        let Some(mut draft) = d.spare.pop() else {
            return Err(EngineError::Capacity(
                "every DFlash draft context is in use".into(),
            ));
        };
        draft.reset();
        d.seqs.insert(
            seq,
            DraftingSeq {
                draft,
                features: Vec::new(),
                stepped: Vec::new(),
            },
        );
        Ok(())
    }

    /// Seed `seq`'s (empty) DFlash draft with the context rows of its first positions.
    fn seed_draft(&mut self, seq: SeqId, features: &[f32]) -> Result<(), EngineError> {
        let Some(d) = self.dflash.as_mut() else {
            return Ok(());
        };
        let width = d.width;
        let Some(ds) = d.seqs.get_mut(&seq) else {
            return Ok(());
        };
        ds.draft.reset();
        ds.features.clear();
        ds.draft
            .push_context(features, features.len() / width.max(1))
            .map_err(|e| EngineError::Draft(e.to_string()))?;
        ds.features.extend_from_slice(features);
        Ok(())
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
        self.start_sequence(
            prompt,
            SequenceStart {
                reuse_prefix: true,
                dflash: false,
            },
        )
    }
    fn start_sequence(
        &mut self,
        prompt: &[u32],
        start: SequenceStart,
    ) -> Result<(SeqId, usize), EngineError> {
        if start.dflash && self.dflash.is_none() {
            return Err(EngineError::Draft(
                "this server has no DFlash draft (start it with --draft PATH)".into(),
            ));
        }
        let id = self.new_sequence()?;
        if start.dflash {
            if let Err(e) = self.attach_draft(id) {
                self.release(id);
                return Err(e);
            }
        }
        if !start.reuse_prefix || self.cache.capacity == 0 {
            return Ok((id, 0));
        }
        // A DFlash sequence starts only from a state whose context rows were kept with it (the
        // KV cache does not hold the hidden states its draft reads).
        let features = match (&self.dflash, start.dflash) {
            (Some(d), true) => Some(d.width),
            _ => None,
        };
        let has_features = |seq: SeqId, common: usize| {
            features.is_none()
                || self
                    .dflash
                    .as_ref()
                    .is_some_and(|d| d.prefix(seq, common).is_some())
        };
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
                (common > 0 && at_rest && has_features(seq, common)).then_some((seq, common))
            })
            .max_by_key(|&(seq, common)| (common, std::cmp::Reverse(seq)));
        let cached = self.cache.best(prompt, features);
        let mut state = self.seqs.remove(&id).ok_or(EngineError::NoSequence(id))?;
        let copied = match (running, cached) {
            (Some((seq, common)), c) if c.is_none_or(|(_, cc)| common >= cc) => {
                self.seqs.get(&seq).map(|src| {
                    (
                        state.copy_prefix_from(src, common),
                        common,
                        PrefixSource::Running(seq),
                    )
                })
            }
            (_, Some((entry, common))) => self.cache.entries.get(entry).map(|e| {
                (
                    state.copy_prefix_from(&e.state, common),
                    common,
                    PrefixSource::Cached(entry),
                )
            }),
            _ => None,
        };
        self.seqs.insert(id, state);
        match copied {
            Some((Ok(()), common, source)) => {
                if let Some(width) = features {
                    let rows = match source {
                        PrefixSource::Running(seq) => self
                            .dflash
                            .as_ref()
                            .and_then(|d| d.prefix(seq, common))
                            .map(<[f32]>::to_vec),
                        PrefixSource::Cached(entry) => self
                            .cache
                            .entries
                            .get(entry)
                            .and_then(|e| e.features.as_ref()?.get(..common * width))
                            .map(<[f32]>::to_vec),
                    };
                    let seeded = match rows {
                        Some(rows) => self.seed_draft(id, &rows),
                        None => Err(EngineError::Draft("no context rows kept".into())),
                    };
                    if let Err(e) = seeded {
                        // Cold after all: the state and the draft start empty.
                        tracing::warn!(
                            "prefix cache: DFlash context: {e}; reading the prompt cold"
                        );
                        if let Some(s) = self.seqs.get_mut(&id) {
                            s.reset();
                        }
                        let _ = self.seed_draft(id, &[]);
                        return Ok((id, 0));
                    }
                }
                // Most recently used first.
                if let PrefixSource::Cached(i) = source {
                    if let Some(e) = self.cache.entries.remove(i) {
                        self.cache.entries.push_front(e);
                    }
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
        // A DFlash sample starts with its leader's context rows, fed to its draft before the
        // state is copied (a refusal leaves `to` as it was).
        if self.drafting(to) {
            let rows = self.seqs.get(&from).map_or(0, SequenceState::position);
            let seed = self
                .dflash
                .as_ref()
                .and_then(|d| d.prefix(from, rows))
                .map(<[f32]>::to_vec)
                .ok_or_else(|| {
                    EngineError::Draft(format!(
                        "sequence {from} holds no DFlash context rows to copy"
                    ))
                })?;
            self.seed_draft(to, &seed)?;
        }
        let mut dst = self.seqs.remove(&to).ok_or(EngineError::NoSequence(to))?;
        let r = match self.seqs.get(&from) {
            Some(src) => dst
                .copy_prefix_from(src, src.position())
                .map_err(device_err),
            None => Err(EngineError::NoSequence(from)),
        };
        self.seqs.insert(to, dst);
        if r.is_err() && self.drafting(to) {
            let _ = self.seed_draft(to, &[]);
        }
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
        let taps = self.taps_for(std::iter::once(seq));
        let mut rows = Vec::new();
        let mut state = self.seqs.remove(&seq).ok_or(EngineError::NoSequence(seq))?;
        let r = self.model.prefill_sequence_tapped(
            &mut state,
            item.tokens,
            item.first_logit_row(),
            &mut |row, l| sink(row, l),
            &taps,
            &mut |out| gather_taps(out, taps.len(), 0..out.rows(), &mut rows),
        );
        if r.is_err() {
            // The failed chunk left the committed state untouched; acknowledge it.
            state.recover();
        }
        self.seqs.insert(seq, state);
        r.map_err(device_err)?;
        self.fed(seq, item.tokens);
        if let Some(d) = self.dflash.as_mut() {
            d.commit_rows(seq, &rows);
        }
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
        let taps = self.taps_for(shared.iter().map(|&i| items[i].seq));
        // Per shared item: its rows' DFlash context rows (when its sequence drafts).
        let drafting: Vec<bool> = shared
            .iter()
            .map(|&i| self.drafting(items[i].seq))
            .collect();
        let mut rows: Vec<Vec<f32>> = vec![Vec::new(); shared.len()];
        self.with_states(shared.iter().map(|&i| items[i].seq), |model, states| {
            let mut batch: Vec<(&mut SequenceState, &[u32])> = states
                .iter_mut()
                .zip(&shared)
                .map(|(state, &i)| (state, items[i].tokens))
                .collect();
            model.prefill_sequences_tapped(
                &mut batch,
                &taps,
                &mut |k, l| {
                    let item = &items[shared[k]];
                    if item.last {
                        sink(shared[k], item.tokens.len() - 1, l)
                    }
                },
                &mut |out| {
                    let mut first = 0;
                    for (k, &i) in shared.iter().enumerate() {
                        let len = items[i].tokens.len();
                        if drafting[k] {
                            gather_taps(out, taps.len(), first..first + len, &mut rows[k]);
                        }
                        first += len;
                    }
                },
            )
        })?;
        for (k, &i) in shared.iter().enumerate() {
            self.fed(items[i].seq, items[i].tokens);
            if drafting[k] {
                if let Some(d) = self.dflash.as_mut() {
                    d.commit_rows(items[i].seq, &rows[k]);
                }
            }
        }
        Ok(())
    }
    fn step(
        &mut self,
        batch: &[(SeqId, &[u32])],
        sink: &mut dyn FnMut(usize, usize, &[f32]),
    ) -> Result<(), EngineError> {
        let taps = self.taps_for(batch.iter().map(|item| item.0));
        // Each drafting segment's rows go to its `stepped` buffer (reused), until its commit.
        let mut stepped: Vec<Option<Vec<f32>>> = batch
            .iter()
            .map(|&(seq, _)| {
                let d = self.dflash.as_mut()?.seqs.get_mut(&seq)?;
                let mut buf = std::mem::take(&mut d.stepped);
                buf.clear();
                Some(buf)
            })
            .collect();
        let r = self.with_states(batch.iter().map(|item| item.0), |model, states| {
            let mut segments: Vec<(&mut SequenceState, &[u32])> = states
                .iter_mut()
                .zip(batch)
                .map(|(state, &(_, toks))| (state, toks))
                .collect();
            let out = model.step_sequences_tapped(&mut segments, &taps)?;
            let mut row = 0;
            for (g, &(_, toks)) in batch.iter().enumerate() {
                if let Some(buf) = stepped[g].as_mut() {
                    gather_taps(out, taps.len(), row..row + toks.len(), buf);
                }
                for j in 0..toks.len() {
                    sink(g, j, out.logits(row));
                    row += 1;
                }
            }
            Ok(())
        });
        if let Some(d) = self.dflash.as_mut() {
            for (&(seq, _), buf) in batch.iter().zip(stepped) {
                if let (Some(ds), Some(mut buf)) = (d.seqs.get_mut(&seq), buf) {
                    if r.is_err() {
                        buf.clear();
                    }
                    ds.stepped = buf;
                }
            }
        }
        r?;
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
        // The kept rows' hidden states become the draft's next context rows.
        if let Some(d) = self.dflash.as_mut() {
            let width = d.width;
            if let Some(ds) = d.seqs.get_mut(&seq) {
                let mut kept = std::mem::take(&mut ds.stepped);
                kept.truncate(n * width);
                d.commit_rows(seq, &kept);
                kept.clear();
                if let Some(ds) = d.seqs.get_mut(&seq) {
                    ds.stepped = kept;
                }
            }
        }
        Ok(())
    }
    fn position(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, SequenceState::position)
    }
    fn states_held(&self) -> usize {
        self.seqs.len() + self.spare.len() + self.cache.entries.len()
    }
    fn has_dflash(&self) -> bool {
        self.dflash.is_some()
    }
    fn dflash_drafts(
        &mut self,
        seq: SeqId,
        pending: u32,
        k: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), EngineError> {
        out.clear();
        let position = self.position(seq);
        let Some(d) = self.dflash.as_mut() else {
            return Err(EngineError::Draft("this server has no DFlash draft".into()));
        };
        let Some(ds) = d.seqs.get_mut(&seq) else {
            return Err(EngineError::Draft(format!(
                "sequence {seq} does not draft with DFlash"
            )));
        };
        if ds.draft.context() != position {
            return Err(EngineError::Draft(format!(
                "the DFlash draft of sequence {seq} holds {} context rows, the sequence {position} committed positions",
                ds.draft.context()
            )));
        }
        // Each mask row's argmax (generation 1) or the selector's walk (generation 2), as the
        // spec layer's `DflashDrafter` drafts.
        ds.draft
            .block_drafts(pending, out)
            .map_err(|e| EngineError::Draft(e.to_string()))?;
        out.truncate(k);
        Ok(())
    }
    fn dflash_context(&self, seq: SeqId) -> Option<usize> {
        Some(self.dflash.as_ref()?.seqs.get(&seq)?.draft.context())
    }
    fn release(&mut self, seq: SeqId) {
        self.stepped.remove(&seq);
        let tokens = self.history.remove(&seq);
        let drafted = self.dflash.as_mut().and_then(|d| {
            let ds = d.seqs.remove(&seq)?;
            let mut draft = ds.draft;
            draft.reset();
            d.spare.push(draft);
            Some(ds.features)
        });
        let Some(state) = self.seqs.remove(&seq) else {
            return;
        };
        // Only a state at rest is cached: its committed positions hold exactly `tokens`.
        let width = self.dflash.as_ref().map_or(0, |d| d.width);
        let freed = match tokens {
            Some(t) if state.pending_rows().is_none() && state.position() == t.len() => {
                // Its DFlash context rows go with it when they are complete.
                let features = drafted.filter(|f| f.len() == t.len() * width);
                self.cache.insert(Cached {
                    tokens: t,
                    state,
                    features,
                })
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
/// default model), with `ctx` positions, and the DFlash draft of `spec.draft`.
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
    let mut engine = ModelEngine::new(model, ctx, spec.max_sequences, spec.prefix_cache);
    if let Some(path) = &spec.draft {
        engine = engine
            .with_dflash(load_dflash(path, &pkg)?)
            .map_err(|e| EngineError::Load(format!("--draft {}: {e}", path.display())))?;
        tracing::info!("DFlash draft {} bound to the target", path.display());
    }
    Ok(Loaded {
        codec: Arc::new(PackageCodec { pkg, id, ctx, eos }),
        engine: Box::new(engine),
    })
}

/// The DFlash draft at `path` (a `dflash` GGUF or package), refused unless its tokenizer is the
/// target's token for token (its width, vocabulary and tap layers are checked when it is bound,
/// [`ModelEngine::with_dflash`]).
fn load_dflash(
    path: &std::path::Path,
    target: &Package,
) -> Result<Arc<DflashWeights>, EngineError> {
    let fail = |what: String| EngineError::Load(format!("--draft {}: {what}", path.display()));
    let pkg = xdna::model::load::open_package(path).map_err(|e| fail(e.to_string()))?;
    let weights = DflashWeights::load(&pkg, false).map_err(|e| fail(e.to_string()))?;
    let (tt, dt) = (target.tokenizer(), pkg.tokenizer());
    if tt.vocab_size() != dt.vocab_size() {
        return Err(fail(format!(
            "the draft's tokenizer has {} tokens, the target's {}",
            dt.vocab_size(),
            tt.vocab_size()
        )));
    }
    if let Some(id) =
        (0..tt.vocab_size() as u32).find(|&id| tt.token_bytes(id) != dt.token_bytes(id))
    {
        return Err(fail(format!(
            "the draft was made for another tokenizer than the target's (token {id} differs)"
        )));
    }
    Ok(Arc::new(weights))
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
