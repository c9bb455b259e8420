//! The engine thread: it owns the model, takes requests from a bounded queue, keeps up to
//! `max_batch` sequences active and runs them, streaming text back per request.
//!
//! Each turn of the loop does, in order:
//! 1. admission of queued requests while fewer than `max_batch` sequences are active (each gets
//!    its own engine sequence — on the real model its own KV cache);
//! 2. cancellation and timeouts;
//! 3. at most [`PREFILL_CHUNK`] prompt tokens of prefill, oldest prompt first (several short
//!    prompts start in one turn; a long prompt is read one ≤ 128-token chunk per turn), so a long
//!    prompt delays the running streams by one chunk per turn, never by its whole length;
//! 4. one decode pass ([`Engine::step`]) carrying the pending token of every generating sequence,
//!    plus, for a speculating sequence, its drafts — n-gram, or DFlash from the engine's draft —
//!    (as extra rows of the same pass, at most [`MAX_STEP_ROWS`] rows in all; drafts shrink when
//!    the batch is full), then a commit per sequence of the rows its acceptance kept;
//! 5. retirement of finished sequences (their engine state is released).

use super::engine::{
    Engine, EngineError, LogitAdjustments, PrefillItem, Sampler, SamplingConfig, SamplingError,
    SeqId, SequenceStart, StopFilter, TextCodec, TokenLogprob, Utf8Stream, MAX_STEP_ROWS,
    PREFILL_CHUNK,
};
use super::metrics::Metrics;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use xdna::spec::{
    uniforms_needed, AcceptanceRule, DecideWorkspace, DraftProbabilities, DraftProposal, Drafter,
    LogitRows, NgramConfig, NgramDrafter,
};

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` or the context is full.
    Length,
    /// The client went away or the server is shutting down.
    Cancelled,
    /// The request timeout passed.
    Timeout,
}

impl Finish {
    /// The OpenAI `finish_reason`: `"stop"` for [`Finish::Stop`], `"length"` otherwise.
    pub fn openai(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length | Finish::Timeout | Finish::Cancelled => "length",
        }
    }
}

/// A token's log-probability and where its text starts: in characters from the start of the
/// completion (generated tokens) or of the prompt's text (prompt tokens).
#[derive(Clone, Debug, PartialEq)]
pub struct LoggedToken {
    /// The token, its log-probability and the top alternatives.
    pub lp: TokenLogprob,
    /// Characters of text before this token's.
    pub offset: usize,
}

/// What the engine thread sends back to a request.
#[derive(Debug)]
pub enum Event {
    /// The prompt's tokens with their log-probabilities (asked for by `prompt_logprobs`; the
    /// first token has none), once, before anything generated.
    PromptLogprobs(Vec<LoggedToken>),
    /// The generated tokens whose text starts in the [`Event::Text`] that follows (or, just
    /// before [`Event::Done`], in text already sent, and an EOS); asked for by `logprobs`.
    /// Tokens of a stop string (never shown) are not reported.
    Logprobs(Vec<LoggedToken>),
    /// A piece of text (never empty).
    Text(String),
    /// The generation ended.
    Done {
        /// Why it ended.
        finish: Finish,
        /// Tokens of the prompt.
        prompt_tokens: usize,
        /// Tokens generated.
        completion_tokens: usize,
        /// Stopped on an EOS token (vs a stop string) — llama.cpp's `stopped_eos`.
        eos: bool,
        /// Ended by a stop string.
        stopped_word: bool,
    },
    /// The engine failed on this request.
    Error(String),
}

/// Which drafter proposes a speculating sequence's drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrafterKind {
    /// Prompt lookup over the sequence's own tokens.
    Ngram,
    /// The engine's DFlash block draft (`forward-serve --draft`), reading the target's hidden
    /// states.
    Dflash,
}

impl DrafterKind {
    /// Every drafter, in the order of their metrics.
    pub const ALL: [DrafterKind; 2] = [DrafterKind::Ngram, DrafterKind::Dflash];

    /// The name requests, flags and metric labels use.
    pub fn name(self) -> &'static str {
        match self {
            DrafterKind::Ngram => "ngram",
            DrafterKind::Dflash => "dflash",
        }
    }

    /// The drafter named `name` (`ngram`, `dflash`).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Its index in [`DrafterKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Speculative decoding for one request: the drafter and the most drafts per round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculate {
    /// Who drafts.
    pub drafter: DrafterKind,
    /// Drafts per round at most (1..=15; DFlash: also at most its block size − 1).
    pub draft_max: usize,
}

impl Speculate {
    /// N-gram drafts, at most `draft_max` per round.
    pub fn ngram(draft_max: usize) -> Self {
        Speculate {
            drafter: DrafterKind::Ngram,
            draft_max,
        }
    }

    /// DFlash drafts, at most `draft_max` per round.
    pub fn dflash(draft_max: usize) -> Self {
        Speculate {
            drafter: DrafterKind::Dflash,
            draft_max,
        }
    }
}

/// One of the `n` samples of a request: they share its prompt, which is read once (by sample 0,
/// the leader) and copied into the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleGroup {
    /// The request's group (unique per request).
    pub id: u64,
    /// This sample's index (0: the leader).
    pub index: usize,
    /// Samples in the group (`n`).
    pub count: usize,
}

/// How long admission keeps reading the queue for samples still due behind their leader. The
/// handler queues them right after the leader, but on a loaded 2-core host it can be descheduled
/// for longer than 250 ms (serve_e2e missed the fork under CI's parallel tests). The wait ends as
/// soon as they arrive, or as soon as the group is cancelled (a request whose later samples could
/// not be queued cancels them, and they never come), so only a handler stalled that long pays it.
const SAMPLES_WAIT: Duration = Duration::from_secs(2);

/// One generation request, as queued.
pub struct GenRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Temperature, top-k and top-p.
    pub sampling: SamplingConfig,
    /// Seed of the request's sampler.
    pub seed: u64,
    /// Stop strings: generation ends at the first occurrence of any (not sent).
    pub stop: Vec<String>,
    /// When the request times out ([`Finish::Timeout`]), queueing included.
    pub deadline: Instant,
    /// Set by the HTTP side when the client goes away: the generation ends as
    /// [`Finish::Cancelled`].
    pub cancel: Arc<AtomicBool>,
    /// Where the request's [`Event`]s go.
    pub events: mpsc::UnboundedSender<Event>,
    /// Speculative decoding: the drafter (n-gram, or the engine's DFlash draft) and at most how
    /// many drafts per pass (1..=15); `None`: plain decoding. Greedy requests use the greedy
    /// acceptance rule (same text as plain greedy); sampled ones the spec layer's
    /// rejection-sampling rule (drafts one-hot; same distribution, its uniforms drawn from the
    /// request's one seeded stream).
    pub speculate: Option<Speculate>,
    /// Keep generating past EOS (fixed-length streams for `forward-serve --bench`).
    pub ignore_eos: bool,
    /// Report each generated token's log-probability with this many top alternatives.
    pub logprobs: Option<usize>,
    /// Report the prompt's log-probabilities (an echoed prompt), with as many alternatives as
    /// `logprobs` says (0 when it is `None`).
    pub prompt_logprobs: bool,
    /// Logit bias and presence/frequency penalties, applied before sampling. A request with any
    /// decodes plainly (its speculation is off).
    pub adjust: LogitAdjustments,
    /// One of the samples of an `n` > 1 request.
    pub group: Option<SampleGroup>,
}

/// Shared switches between the HTTP side and the engine thread.
#[derive(Default)]
pub struct Control {
    /// Cancel every active and queued generation now (shutdown grace expired).
    pub abort: AtomicBool,
}

struct Active {
    seq: SeqId,
    req: GenRequest,
    /// Samples plain rows; its generator also feeds the speculative rounds (one stream per
    /// request, as in `spec::SpecRunner`, where a round without drafts is a plain step).
    sampler: Sampler,
    utf8: Utf8Stream,
    stops: StopFilter,
    generated: usize,
    /// Prompt tokens fed so far (the prompt is read when this reaches its length).
    fed: usize,
    /// The last sampled token, not yet fed.
    pending: Option<u32>,
    done: bool,
    spec: Option<Speculation>,
    /// How often each token was generated (for presence/frequency penalties).
    counts: HashMap<u32, u32>,
    /// Log-probabilities of tokens whose text has not been shown yet.
    held: Vec<LoggedToken>,
    /// Characters the generated tokens decoded to, and how many of them were sent.
    raw_chars: usize,
    shown_chars: usize,
    /// An echoed prompt's log-probabilities, gathered over its chunks.
    prompt_lp: Vec<LoggedToken>,
    /// Where each echoed prompt token's text starts (computed with the first chunk).
    prompt_offsets: Vec<usize>,
    /// A sample waiting for its group's leader to read the prompt (then copied from it).
    waiting: bool,
}

impl Active {
    /// A group leader still reading its prompt.
    fn leads_prefill_of(&self, group: u64) -> bool {
        !self.done
            && self.fed < self.req.prompt.len()
            && self
                .req
                .group
                .is_some_and(|g| g.id == group && g.index == 0)
    }
}

/// What one logit row of a sequence is turned into: its sampler, the request's logit
/// adjustments and log-probability settings. Borrowed field by field from an [`Active`].
struct RowSampler<'a> {
    sampler: &'a mut Sampler,
    req: &'a GenRequest,
    counts: &'a HashMap<u32, u32>,
    adjusted: Vec<f32>,
}

impl RowSampler<'_> {
    /// The next token from `logits` (after the request's adjustments) and, when asked for, its
    /// log-probability under the raw logits.
    fn sample(&mut self, logits: &[f32]) -> (Result<u32, SamplingError>, Option<TokenLogprob>) {
        let token = if self.req.adjust.is_empty() {
            self.sampler.sample(logits)
        } else {
            self.adjusted.clear();
            self.adjusted.extend_from_slice(logits);
            self.req.adjust.apply(&mut self.adjusted, self.counts);
            self.sampler.sample(&self.adjusted)
        };
        let lp = match (&token, self.req.logprobs) {
            (Ok(t), Some(k)) => Some(xdna::model::logprobs::token_logprob(logits, *t, k)),
            _ => None,
        };
        (token, lp)
    }
}

/// Row samplers for the active sequences at `indices` (ascending, distinct), in that order.
fn row_samplers<'a>(active: &'a mut [Active], indices: &[usize]) -> Vec<RowSampler<'a>> {
    let mut out = Vec::with_capacity(indices.len());
    let mut want = indices.iter().peekable();
    for (i, a) in active.iter_mut().enumerate() {
        if want.peek() == Some(&&i) {
            want.next();
            let Active {
                sampler,
                req,
                counts,
                ..
            } = a;
            out.push(RowSampler {
                sampler,
                req,
                counts,
                adjusted: Vec::new(),
            });
        }
    }
    out
}

/// A speculating sequence's drafter state.
struct Speculation {
    /// Greedy, or rejection sampling with the request's temperature / top-k / top-p.
    rule: AcceptanceRule,
    draft_max: usize,
    drafter: SeqDrafter,
    /// Prompt and emitted tokens; the last one is the pending token (the drafter's convention).
    context: Vec<u32>,
    proposal: DraftProposal,
    begun: bool,
    /// This turn's DFlash drafts (a buffer reused across turns).
    drafts: Vec<u32>,
}

/// Who drafts for one sequence.
enum SeqDrafter {
    /// Its own n-gram drafter.
    Ngram(NgramDrafter),
    /// The engine's DFlash draft: the engine feeds the sequence's draft context as it commits.
    Dflash,
}

impl SeqDrafter {
    fn kind(&self) -> DrafterKind {
        match self {
            SeqDrafter::Ngram(_) => DrafterKind::Ngram,
            SeqDrafter::Dflash => DrafterKind::Dflash,
        }
    }
}

/// One sequence's part of a decode pass.
struct Segment {
    /// Index into the active list.
    active: usize,
    /// The pending token, then the drafts.
    tokens: Vec<u32>,
}

/// The engine loop; returns when the queue is closed and every active sequence has ended.
pub fn run(
    mut engine: Box<dyn Engine + Send>,
    codec: Arc<dyn TextCodec>,
    mut queue: mpsc::Receiver<GenRequest>,
    max_batch: usize,
    metrics: Arc<Metrics>,
    control: Arc<Control>,
) {
    let cap = max_batch.max(1).min(engine.max_sequences().max(1));
    let mut active: Vec<Active> = Vec::new();
    let mut scratch = String::new();
    let mut decide_ws = DecideWorkspace::new();
    let mut closed = false;
    // Decode passes so far: where each pass starts sharing its spare draft rows.
    let mut turn = 0usize;
    loop {
        // Admit. The samples of a group are queued one after another right behind their leader;
        // until they are here (briefly: the handler sends them at once), the queue is read again,
        // so they wait for the leader's prompt instead of reading it themselves.
        let mut samples_due = 0usize;
        // The cancel flag of the group whose samples are due.
        let mut due_group_cancel: Option<Arc<AtomicBool>> = None;
        let admit_start = Instant::now();
        while !closed && active.len() < cap {
            let next = if active.is_empty() {
                match queue.blocking_recv() {
                    Some(r) => Some(r),
                    None => {
                        closed = true;
                        None
                    }
                }
            } else {
                match queue.try_recv() {
                    Ok(r) => Some(r),
                    Err(mpsc::error::TryRecvError::Empty)
                        if samples_due > 0
                            && admit_start.elapsed() < SAMPLES_WAIT
                            && !due_group_cancel.as_ref().is_some_and(|c| c.load(Relaxed)) =>
                    {
                        std::thread::yield_now();
                        continue;
                    }
                    Err(mpsc::error::TryRecvError::Empty) => None,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        closed = true;
                        None
                    }
                }
            };
            let Some(req) = next else { break };
            metrics.queue_depth.fetch_sub(1, Relaxed);
            match req.group {
                Some(g) if g.index == 0 => {
                    samples_due += g.count.saturating_sub(1);
                    due_group_cancel = Some(req.cancel.clone());
                }
                Some(_) => samples_due = samples_due.saturating_sub(1),
                None => {}
            }
            // A later sample of a group whose leader is reading the prompt waits for its copy.
            let wait = match req.group {
                Some(g) if g.index > 0 && !req.prompt_logprobs => {
                    active.iter().any(|a| a.leads_prefill_of(g.id))
                }
                _ => false,
            };
            if let Some(a) = admit(&mut *engine, req, wait, &metrics, &control) {
                active.push(a);
                metrics.active_sequences.fetch_add(1, Relaxed);
            }
        }
        if active.is_empty() {
            if closed {
                return;
            }
            continue;
        }
        // Cancellation, timeouts, abort.
        let now = Instant::now();
        let abort = control.abort.load(Relaxed);
        for a in active.iter_mut() {
            if a.done {
                continue;
            }
            if abort || a.req.cancel.load(Relaxed) || a.req.events.is_closed() {
                finish(a, Finish::Cancelled, &metrics, &mut scratch);
            } else if now >= a.req.deadline {
                finish(a, Finish::Timeout, &metrics, &mut scratch);
            }
        }
        // At most PREFILL_CHUNK prompt tokens per turn, oldest prompt first: several short
        // prompts start together, a long one is read one chunk per turn.
        // Several prompts go into one engine pass (one sweep over the weights, not one each).
        // A sample whose leader is gone (failed, cancelled) reads the prompt itself.
        for i in 0..active.len() {
            if active[i].waiting {
                let group = active[i].req.group.map_or(0, |g| g.id);
                active[i].waiting = active.iter().any(|a| a.leads_prefill_of(group));
            }
        }
        let mut budget = PREFILL_CHUNK;
        let mut picks: Vec<(usize, usize)> = Vec::new();
        for (i, a) in active.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if a.done || a.waiting || a.fed >= a.req.prompt.len() {
                continue;
            }
            let end = (a.fed + budget).min(a.req.prompt.len());
            budget -= end - a.fed;
            picks.push((i, end));
        }
        if !picks.is_empty() {
            prefill_together(
                &mut *engine,
                &*codec,
                &mut active,
                &picks,
                &metrics,
                &mut scratch,
            );
        }
        // One decode pass over every generating sequence.
        decode_turn(
            &mut *engine,
            &*codec,
            &mut active,
            &metrics,
            &mut scratch,
            &mut decide_ws,
            turn,
        );
        turn = turn.wrapping_add(1);
        // Retire.
        active.retain(|a| {
            if a.done {
                engine.release(a.seq);
                metrics.active_sequences.fetch_sub(1, Relaxed);
                false
            } else {
                true
            }
        });
        metrics
            .sequence_states
            .store(engine.states_held() as u64, Relaxed);
        if control.abort.load(Relaxed) {
            // Drain the queue too.
            while let Ok(r) = queue.try_recv() {
                metrics.queue_depth.fetch_sub(1, Relaxed);
                metrics.cancelled.fetch_add(1, Relaxed);
                let _ = r.events.send(Event::Done {
                    finish: Finish::Cancelled,
                    prompt_tokens: r.prompt.len(),
                    completion_tokens: 0,
                    eos: false,
                    stopped_word: false,
                });
            }
        }
    }
}

/// Feed the chunks `picks` (`(index into active, end of the chunk)`, ascending, distinct
/// sequences, ≤ [`PREFILL_CHUNK`] tokens in all) in one engine pass; a chunk that ends its prompt
/// samples the first token (unless `max_tokens` is 0), and an echoed prompt's rows give its
/// log-probabilities. A failed pass fails every request in it.
fn prefill_together(
    engine: &mut dyn Engine,
    codec: &dyn TextCodec,
    active: &mut [Active],
    picks: &[(usize, usize)],
    metrics: &Metrics,
    scratch: &mut String,
) {
    // The chunks' tokens, copied (≤ 128) so the sink may borrow the samplers mutably.
    let mut tokens: Vec<u32> = Vec::new();
    let mut bounds = Vec::with_capacity(picks.len());
    for &(i, end) in picks {
        let a = &active[i];
        let start = tokens.len();
        tokens.extend_from_slice(&a.req.prompt[a.fed..end]);
        bounds.push((start, tokens.len(), end == a.req.prompt.len()));
    }
    let items: Vec<PrefillItem<'_>> = picks
        .iter()
        .zip(&bounds)
        .map(|(&(i, _), &(s, e, last))| PrefillItem {
            seq: active[i].seq,
            tokens: &tokens[s..e],
            last: last && active[i].req.max_tokens > 0,
            all_rows: active[i].req.prompt_logprobs,
        })
        .collect();
    // Per pick: the prompt (for the token each row predicts) and where its chunk starts.
    let prompts: Vec<(Vec<u32>, usize)> = picks
        .iter()
        .map(|&(i, _)| {
            let a = &active[i];
            if a.req.prompt_logprobs {
                (a.req.prompt.clone(), a.fed)
            } else {
                (Vec::new(), a.fed)
            }
        })
        .collect();
    let indices: Vec<usize> = picks.iter().map(|&(i, _)| i).collect();
    type First = Option<(Result<u32, SamplingError>, Option<TokenLogprob>)>;
    let mut firsts: Vec<First> = vec![None; picks.len()];
    let mut prompt_lps: Vec<Vec<TokenLogprob>> = vec![Vec::new(); picks.len()];
    // A leader whose samples wait for its prompt keeps the last row: their first tokens too.
    let leads: Vec<Option<u64>> = picks
        .iter()
        .zip(&items)
        .map(|(&(i, _), item)| match active[i].req.group {
            Some(g) if g.index == 0 && item.last => active
                .iter()
                .any(|f| f.waiting && f.req.group.is_some_and(|h| h.id == g.id))
                .then_some(g.id),
            _ => None,
        })
        .collect();
    let mut shared_logits: Vec<Vec<f32>> = vec![Vec::new(); picks.len()];
    let res = {
        let mut rows = row_samplers(active, &indices);
        engine.prefill_many(&items, &mut |k, row, logits| {
            let (prompt, fed) = &prompts[k];
            let item = &items[k];
            if item.last && row + 1 == item.tokens.len() {
                firsts[k] = Some(rows[k].sample(logits));
                if leads[k].is_some() {
                    shared_logits[k] = logits.to_vec();
                }
            } else if let Some(&next) = prompt.get(fed + row + 1) {
                let top = rows[k].req.logprobs.unwrap_or(0);
                prompt_lps[k].push(xdna::model::logprobs::token_logprob(logits, next, top));
            }
        })
    };
    match res {
        Ok(()) => {
            for (k, &(i, end)) in picks.iter().enumerate() {
                let a = &mut active[i];
                metrics
                    .prompt_tokens
                    .fetch_add((end - a.fed) as u64, Relaxed);
                a.fed = end;
                if a.req.prompt_logprobs {
                    // Offsets once per prompt, with its first chunk (they decode from the start).
                    if a.prompt_offsets.is_empty() {
                        a.prompt_offsets = prompt_offsets(codec, &a.req.prompt);
                    }
                    let base = a.prompt_lp.len();
                    for (j, lp) in std::mem::take(&mut prompt_lps[k]).into_iter().enumerate() {
                        let offset = a.prompt_offsets.get(base + j).copied().unwrap_or(0);
                        a.prompt_lp.push(LoggedToken { lp, offset });
                    }
                }
                if !bounds[k].2 {
                    continue;
                }
                if a.req.prompt_logprobs {
                    let _ = a
                        .req
                        .events
                        .send(Event::PromptLogprobs(std::mem::take(&mut a.prompt_lp)));
                }
                if a.req.max_tokens == 0 {
                    a.pending = None;
                    emit_finish(a, Finish::Length, false, metrics, scratch);
                    continue;
                }
                match firsts[k].take() {
                    Some((Ok(t), lp)) => {
                        let pos = engine.position(a.seq);
                        take_token(a, t, lp, codec, pos, metrics, scratch);
                    }
                    Some((Err(e), _)) => fail(a, &format!("sampling: {e}"), metrics),
                    None => fail(a, "engine returned no logits for the prompt", metrics),
                }
            }
        }
        Err(e) => {
            if matches!(e, EngineError::Device(_)) {
                metrics.device_errors.fetch_add(1, Relaxed);
            }
            tracing::error!("prefill failed: {e}");
            for &(i, _) in picks {
                fail(&mut active[i], &e.to_string(), metrics);
            }
            return;
        }
    }
    for (k, &(leader, _)) in picks.iter().enumerate() {
        if let Some(group) = leads[k] {
            start_samples(
                engine,
                codec,
                active,
                leader,
                group,
                &shared_logits[k],
                metrics,
                scratch,
            );
        }
    }
}

/// The samples waiting for `leader`'s prompt: each becomes a copy of its state and draws its own
/// first token from the prompt's last row (`logits`) with its own sampler. A sample the engine
/// cannot copy into reads the prompt itself.
#[allow(clippy::too_many_arguments)]
fn start_samples(
    engine: &mut dyn Engine,
    codec: &dyn TextCodec,
    active: &mut [Active],
    leader: usize,
    group: u64,
    logits: &[f32],
    metrics: &Metrics,
    scratch: &mut String,
) {
    let leader_seq = active[leader].seq;
    for f in 0..active.len() {
        let a = &active[f];
        if !(a.waiting && a.req.group.is_some_and(|g| g.id == group)) {
            continue;
        }
        active[f].waiting = false;
        if let Err(e) = engine.fork(leader_seq, active[f].seq) {
            tracing::warn!("sample of a shared prompt: {e}; reading the prompt again");
            continue;
        }
        metrics.shared_prompts.fetch_add(1, Relaxed);
        let a = &mut active[f];
        a.fed = a.req.prompt.len();
        if a.req.max_tokens == 0 {
            emit_finish(a, Finish::Length, false, metrics, scratch);
            continue;
        }
        let sampled = row_samplers(active, &[f])
            .first_mut()
            .map(|rows| rows.sample(logits));
        let a = &mut active[f];
        match sampled {
            Some((Ok(t), lp)) => {
                let pos = engine.position(a.seq);
                take_token(a, t, lp, codec, pos, metrics, scratch);
            }
            Some((Err(e), _)) => fail(a, &format!("sampling: {e}"), metrics),
            None => fail(a, "no sampler for the sample", metrics),
        }
    }
}

/// Where each prompt token's text starts, in characters of the decoded prompt; the first token's
/// entry (which no row predicts) is included, so index `j` belongs to `prompt[j]`.
fn prompt_offsets(codec: &dyn TextCodec, prompt: &[u32]) -> Vec<usize> {
    let mut utf8 = Utf8Stream::default();
    let mut text = String::new();
    let mut chars = 0;
    prompt
        .iter()
        .map(|&t| {
            let at = chars;
            text.clear();
            utf8.push(&codec.token_bytes(t), &mut text);
            chars += text.chars().count();
            at
        })
        .collect()
}

/// How many drafts each generating sequence may carry this pass: one row each for the pending
/// tokens, the rest of [`MAX_STEP_ROWS`] shared among the speculating sequences in turn, each
/// also bounded by its own `draft_max`, its context and its remaining `max_tokens`. The sharing
/// starts at a different sequence each pass (`turn`), so when the spare rows are fewer than the
/// speculating sequences, every one of them still drafts on some passes, whatever order the
/// requests arrived in.
fn draft_budget(active: &[Active], live: &[usize], ctx: usize, turn: usize) -> Vec<usize> {
    let mut spare = MAX_STEP_ROWS.saturating_sub(live.len());
    let mut speculating = live.iter().filter(|&&i| active[i].spec.is_some()).count();
    let mut budget = vec![0; live.len()];
    for j in 0..live.len() {
        let slot = (turn + j) % live.len();
        let a = &active[live[slot]];
        let Some(sp) = &a.spec else { continue };
        let share = spare.div_ceil(speculating.max(1));
        speculating = speculating.saturating_sub(1);
        let room = ctx.saturating_sub(a.req.prompt.len() + a.generated + 1);
        let left = a.req.max_tokens.saturating_sub(a.generated + 1);
        let k = sp.draft_max.min(share).min(room).min(left);
        spare -= k;
        budget[slot] = k;
    }
    budget
}

#[allow(clippy::too_many_arguments)] // the scheduler loop's state for one pass
fn decode_turn(
    engine: &mut dyn Engine,
    codec: &dyn TextCodec,
    active: &mut [Active],
    metrics: &Metrics,
    scratch: &mut String,
    decide_ws: &mut DecideWorkspace,
    turn: usize,
) {
    let live: Vec<usize> = (0..active.len())
        .filter(|&i| !active[i].done && active[i].pending.is_some())
        .take(MAX_STEP_ROWS)
        .collect();
    if live.is_empty() {
        return;
    }
    let budget = draft_budget(active, &live, codec.context_len(), turn);
    let mut segments: Vec<Segment> = Vec::with_capacity(live.len());
    for (&i, &k) in live.iter().zip(&budget) {
        let a = &mut active[i];
        let Some(pending) = a.pending else { continue };
        let mut tokens = vec![pending];
        let mut spec_off = false;
        if let Some(sp) = a.spec.as_mut() {
            if k > 0 {
                let kind = sp.drafter.kind();
                match propose(engine, a.seq, sp, &a.req.prompt, pending, k, &mut tokens) {
                    Ok(()) => {}
                    Err(e) if kind == DrafterKind::Dflash => {
                        // A DFlash context out of step with its sequence stays so: plain
                        // decoding from here on (the output is the same, only slower).
                        metrics.spec_errors[kind.index()].fetch_add(1, Relaxed);
                        tracing::warn!("drafter dflash: {e}; the sequence decodes plainly");
                        tokens.truncate(1);
                        spec_off = true;
                    }
                    Err(e) => {
                        metrics.spec_errors[kind.index()].fetch_add(1, Relaxed);
                        tracing::warn!("drafter {}: {e}; decoding plainly this turn", kind.name());
                        tokens.truncate(1);
                    }
                }
            }
        }
        if spec_off {
            a.spec = None;
        }
        segments.push(Segment { active: i, tokens });
    }
    let vocab = codec.vocab_size();
    let batch: Vec<(SeqId, &[u32])> = segments
        .iter()
        .map(|s| (active[s.active].seq, s.tokens.as_slice()))
        .collect();
    let rows: usize = batch.iter().map(|(_, t)| t.len()).sum();
    let t0 = Instant::now();
    // Per segment: the token sampled from row 0 (plain rows), or every row's logits (drafting).
    type Sampled = Option<(Result<u32, SamplingError>, Option<TokenLogprob>)>;
    let mut outs: Vec<(Sampled, Vec<f32>)> = segments
        .iter()
        .map(|s| {
            (
                None,
                Vec::with_capacity(if s.tokens.len() > 1 {
                    s.tokens.len() * vocab
                } else {
                    0
                }),
            )
        })
        .collect();
    let res = {
        let indices: Vec<usize> = segments.iter().map(|s| s.active).collect();
        let mut samplers = row_samplers(active, &indices);
        let drafting: Vec<bool> = segments.iter().map(|s| s.tokens.len() > 1).collect();
        engine.step(&batch, &mut |g, j, logits| {
            if g >= outs.len() {
                return;
            }
            if drafting[g] {
                outs[g].1.extend_from_slice(logits);
            } else if j == 0 {
                outs[g].0 = Some(samplers[g].sample(logits));
            }
        })
    };
    metrics
        .decode_nanos
        .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
    metrics.decode_rows.fetch_add(rows as u64, Relaxed);
    metrics.decode_passes.fetch_add(1, Relaxed);
    drop(batch);
    if let Err(e) = res {
        metrics.device_errors.fetch_add(1, Relaxed);
        tracing::error!("decode pass failed: {e}");
        for s in &segments {
            fail(&mut active[s.active], &e.to_string(), metrics);
        }
        return;
    }
    for (s, (sampled, logits)) in segments.into_iter().zip(outs) {
        let a = &mut active[s.active];
        let before = engine.position(a.seq);
        if s.tokens.len() == 1 {
            let (t, lp) = match sampled {
                Some((Ok(t), lp)) => (t, lp),
                Some((Err(e), _)) => {
                    fail(a, &format!("sampling: {e}"), metrics);
                    continue;
                }
                None => {
                    fail(a, "engine returned no logits for the row", metrics);
                    continue;
                }
            };
            if let Err(e) = engine.commit(a.seq, 1) {
                fail(a, &e.to_string(), metrics);
                continue;
            }
            if let Some(sp) = a.spec.as_mut() {
                sp.context.push(t);
            }
            take_token(a, t, lp, codec, before + 1, metrics, scratch);
            continue;
        }
        // A speculative round: the acceptance rule over the pending row and the drafts.
        let drafts = &s.tokens[1..];
        let decision = match a.spec.as_mut() {
            Some(sp) => {
                let rng = a.sampler.rng();
                let u: Vec<f64> = (0..uniforms_needed(&sp.rule, drafts.len()))
                    .map(|_| rng.uniform())
                    .collect();
                LogitRows::new(&logits, s.tokens.len(), vocab).and_then(|rows| {
                    decide_ws.decide(rows, drafts, DraftProbabilities::OneHot, &sp.rule, &u)
                })
            }
            None => {
                fail(a, "drafts without a drafter", metrics);
                continue;
            }
        };
        let decision = match decision {
            Ok(d) => d,
            Err(e) => {
                fail(a, &format!("speculative acceptance: {e}"), metrics);
                continue;
            }
        };
        if let Err(e) = engine.commit(a.seq, decision.rows_to_commit()) {
            fail(a, &e.to_string(), metrics);
            continue;
        }
        if let Some(sp) = a.spec.as_mut() {
            metrics.record_round(sp.drafter.kind(), drafts.len(), decision.accepted);
            sp.context.extend_from_slice(&decision.emitted);
            if let SeqDrafter::Ngram(drafter) = &mut sp.drafter {
                if let Err(e) = drafter.observe(&sp.context, decision.accepted) {
                    tracing::warn!("drafter: {e}");
                }
            }
        }
        for (i, &t) in decision.emitted.iter().enumerate() {
            // Row i's logits predicted emitted token i (accepted drafts, then the correction).
            let lp = a.req.logprobs.and_then(|k| {
                logits
                    .get(i * vocab..(i + 1) * vocab)
                    .map(|row| xdna::model::logprobs::token_logprob(row, t, k))
            });
            take_token(a, t, lp, codec, before + i + 1, metrics, scratch);
            if a.done {
                break;
            }
        }
    }
}

/// Ask a sequence's drafter for up to `k` drafts after its pending token, appended to `tokens`.
fn propose(
    engine: &mut dyn Engine,
    seq: SeqId,
    sp: &mut Speculation,
    prompt: &[u32],
    pending: u32,
    k: usize,
    tokens: &mut Vec<u32>,
) -> Result<(), String> {
    if !sp.begun {
        sp.context.clear();
        sp.context.extend_from_slice(prompt);
        sp.context.push(pending);
        if let SeqDrafter::Ngram(drafter) = &mut sp.drafter {
            drafter.begin(&sp.context).map_err(|e| e.to_string())?;
        }
        sp.begun = true;
    }
    match &mut sp.drafter {
        SeqDrafter::Ngram(drafter) => {
            drafter
                .propose(&sp.context, k, &sp.rule, &mut sp.proposal)
                .map_err(|e| e.to_string())?;
            tokens.extend_from_slice(sp.proposal.tokens());
        }
        SeqDrafter::Dflash => {
            let mut drafts = std::mem::take(&mut sp.drafts);
            let r = engine.dflash_drafts(seq, pending, k, &mut drafts);
            tokens.extend_from_slice(&drafts);
            sp.drafts = drafts;
            r.map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

fn admit(
    engine: &mut dyn Engine,
    req: GenRequest,
    wait: bool,
    metrics: &Metrics,
    control: &Control,
) -> Option<Active> {
    let done = |finish| Event::Done {
        finish,
        prompt_tokens: 0,
        completion_tokens: 0,
        eos: false,
        stopped_word: false,
    };
    if control.abort.load(Relaxed) || req.cancel.load(Relaxed) || req.events.is_closed() {
        metrics.cancelled.fetch_add(1, Relaxed);
        let _ = req.events.send(done(Finish::Cancelled));
        return None;
    }
    if Instant::now() >= req.deadline {
        metrics.timeouts.fetch_add(1, Relaxed);
        let _ = req.events.send(done(Finish::Timeout));
        return None;
    }
    let sampler = match Sampler::new(req.sampling.clone(), req.seed) {
        Ok(s) => s,
        Err(e) => {
            let _ = req.events.send(Event::Error(e.to_string()));
            return None;
        }
    };
    // Adjusted logits change from row to row with the tokens before them; such a request decodes
    // plainly.
    let speculate = req
        .speculate
        .filter(|s| s.draft_max > 0 && req.adjust.is_empty());
    let mut dflash = speculate.is_some_and(|s| s.drafter == DrafterKind::Dflash);
    // An echoed prompt's log-probabilities need every prompt row, so it is read in full; a
    // sample waiting for its leader's prompt starts empty.
    let start = SequenceStart {
        reuse_prefix: !(wait || req.prompt_logprobs),
        dflash,
    };
    let started = match engine.start_sequence(&req.prompt, start) {
        Err(e) if dflash => {
            metrics.spec_errors[DrafterKind::Dflash.index()].fetch_add(1, Relaxed);
            tracing::warn!("drafter dflash: {e}; decoding plainly");
            dflash = false;
            engine.start_sequence(
                &req.prompt,
                SequenceStart {
                    dflash: false,
                    ..start
                },
            )
        }
        r => r,
    };
    let (seq, reused) = match started {
        Ok(s) => s,
        Err(e) => {
            let _ = req.events.send(Event::Error(e.to_string()));
            return None;
        }
    };
    if reused > 0 {
        metrics.prefix_hits.fetch_add(1, Relaxed);
        metrics.prefix_tokens.fetch_add(reused as u64, Relaxed);
    }
    let rule = AcceptanceRule::for_sampling(&req.sampling);
    let spec = match speculate {
        Some(s) if dflash => Some((s, SeqDrafter::Dflash)),
        Some(s) if s.drafter == DrafterKind::Ngram => {
            let config = NgramConfig {
                max_drafts: s.draft_max.min(MAX_STEP_ROWS - 1),
                ..NgramConfig::default()
            };
            match NgramDrafter::new(config) {
                Ok(drafter) => Some((s, SeqDrafter::Ngram(drafter))),
                Err(e) => {
                    tracing::warn!("n-gram drafter: {e}; decoding plainly");
                    None
                }
            }
        }
        _ => None,
    }
    .map(|(s, drafter)| Speculation {
        rule,
        draft_max: s.draft_max.min(MAX_STEP_ROWS - 1),
        drafter,
        context: Vec::new(),
        proposal: DraftProposal::new(),
        begun: false,
        drafts: Vec::new(),
    });
    Some(Active {
        seq,
        sampler,
        utf8: Utf8Stream::default(),
        stops: StopFilter::new(req.stop.clone()),
        generated: 0,
        fed: reused,
        pending: None,
        done: false,
        spec,
        counts: HashMap::new(),
        held: Vec::new(),
        raw_chars: 0,
        shown_chars: 0,
        prompt_lp: match req.prompt.first() {
            // Nothing predicts the prompt's first token.
            Some(&t) if req.prompt_logprobs => vec![LoggedToken {
                lp: TokenLogprob {
                    token: t,
                    logprob: None,
                    top: Vec::new(),
                },
                offset: 0,
            }],
            _ => Vec::new(),
        },
        waiting: wait,
        prompt_offsets: Vec::new(),
        req,
    })
}

fn fail(a: &mut Active, msg: &str, _metrics: &Metrics) {
    a.done = true;
    a.pending = None;
    let _ = a.req.events.send(Event::Error(msg.to_string()));
}

/// Handle a freshly sampled token (with its log-probability when the request asked for them);
/// `pos` = the sequence's committed positions.
fn take_token(
    a: &mut Active,
    t: u32,
    lp: Option<TokenLogprob>,
    codec: &dyn TextCodec,
    pos: usize,
    metrics: &Metrics,
    scratch: &mut String,
) {
    if !a.req.ignore_eos && codec.eos_ids().contains(&t) {
        // EOS shows no text, but it was generated: scoring clients count on its entry.
        if let Some(lp) = lp {
            a.held.push(LoggedToken {
                lp,
                offset: a.raw_chars,
            });
        }
        a.pending = None;
        emit_finish(a, Finish::Stop, true, metrics, scratch);
        return;
    }
    a.generated += 1;
    *a.counts.entry(t).or_insert(0) += 1;
    metrics.generated_tokens.fetch_add(1, Relaxed);
    scratch.clear();
    a.utf8.push(&codec.token_bytes(t), scratch);
    if let Some(lp) = lp {
        a.held.push(LoggedToken {
            lp,
            offset: a.raw_chars,
        });
    }
    a.raw_chars += scratch.chars().count();
    let shown = a.stops.push(scratch);
    if !shown.is_empty() {
        show(a, shown);
    }
    if a.stops.stopped() {
        a.pending = None;
        emit_finish(a, Finish::Stop, false, metrics, scratch);
    } else if a.generated >= a.req.max_tokens || pos + 1 >= codec.context_len() {
        a.pending = None;
        emit_finish(a, Finish::Length, false, metrics, scratch);
    } else {
        a.pending = Some(t);
    }
}

/// Send `text` (non-empty), preceded by the log-probabilities of the tokens whose text now
/// starts in what was shown.
fn show(a: &mut Active, text: String) {
    a.shown_chars += text.chars().count();
    release_logprobs(a);
    let _ = a.req.events.send(Event::Text(text));
}

/// Send the held log-probabilities of tokens whose text starts before the shown end.
fn release_logprobs(a: &mut Active) {
    let ready = a.held.partition_point(|l| l.offset < a.shown_chars);
    if ready > 0 {
        let out: Vec<LoggedToken> = a.held.drain(..ready).collect();
        let _ = a.req.events.send(Event::Logprobs(out));
    }
}

fn finish(a: &mut Active, why: Finish, metrics: &Metrics, scratch: &mut String) {
    match why {
        Finish::Cancelled => {
            metrics.cancelled.fetch_add(1, Relaxed);
        }
        Finish::Timeout => {
            metrics.timeouts.fetch_add(1, Relaxed);
        }
        _ => {}
    }
    a.pending = None;
    emit_finish(a, why, false, metrics, scratch);
}

/// Flush held text (unless a stop string matched) and send `Done`. Log-probabilities of tokens
/// whose text was never shown (a stop string's) are dropped.
fn emit_finish(a: &mut Active, why: Finish, eos: bool, _metrics: &Metrics, scratch: &mut String) {
    a.done = true;
    if !a.stops.stopped() {
        scratch.clear();
        a.utf8.finish(scratch);
        let mut tail = a.stops.push(scratch);
        if !a.stops.stopped() {
            tail.push_str(&a.stops.finish());
        }
        if !tail.is_empty() {
            show(a, tail);
        }
    }
    if !a.stops.stopped() {
        // Everything decoded was shown; tokens with no text of their own go too.
        a.shown_chars = usize::MAX;
    }
    release_logprobs(a);
    a.held.clear();
    let _ = a.req.events.send(Event::Done {
        finish: if a.stops.stopped() { Finish::Stop } else { why },
        prompt_tokens: a.req.prompt.len(),
        completion_tokens: a.generated,
        eos,
        stopped_word: a.stops.stopped(),
    });
}

/// Spawn the engine thread. The engine is built by `make` on that thread.
pub fn spawn(
    engine: Box<dyn Engine + Send>,
    codec: Arc<dyn TextCodec>,
    queue: mpsc::Receiver<GenRequest>,
    max_batch: usize,
    metrics: Arc<Metrics>,
    control: Arc<Control>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("forward-serve-engine".into())
        .spawn(move || run(engine, codec, queue, max_batch, metrics, control))
}

/// Wait for a thread to end, at most `limit`; true if it ended.
pub fn join_within(h: std::thread::JoinHandle<()>, limit: Duration) -> bool {
    let t0 = Instant::now();
    while !h.is_finished() {
        if t0.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    h.join().is_ok()
}
