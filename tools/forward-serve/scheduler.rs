//! The engine thread: it owns the model, takes requests from a bounded queue, keeps up to
//! `max_batch` sequences active and runs their decode steps, streaming text back per request.
//!
//! All active sequences go into one `Engine::decode` call per turn (one token each). Whether that is
//! one batched device pass or a round-robin of single-sequence steps is the engine's business: the
//! real model has one KV cache today, so its adapter holds one resident sequence and the scheduler
//! admits one at a time (see docs/serving.md).

use super::engine::{
    Engine, EngineError, Sampler, SamplerConfig, SeqId, StopFilter, TextCodec, Utf8Stream,
};
use super::metrics::Metrics;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

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
    pub fn openai(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length | Finish::Timeout | Finish::Cancelled => "length",
        }
    }
}

/// What the engine thread sends back to a request.
#[derive(Debug)]
pub enum Event {
    /// A piece of text (never empty).
    Text(String),
    /// The generation ended.
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Stopped on an EOS token (vs a stop string) — llama.cpp's `stopped_eos`.
        eos: bool,
        /// Ended by a stop string.
        stopped_word: bool,
    },
    /// The engine failed on this request.
    Error(String),
}

/// One generation request, as queued.
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    pub seed: u64,
    pub stop: Vec<String>,
    pub deadline: Instant,
    pub cancel: Arc<AtomicBool>,
    pub events: mpsc::UnboundedSender<Event>,
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
    sampler: Sampler,
    utf8: Utf8Stream,
    stops: StopFilter,
    generated: usize,
    /// The last sampled token, not yet fed.
    pending: Option<u32>,
    done: bool,
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
    let mut closed = false;
    loop {
        // Admit.
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
                    Err(mpsc::error::TryRecvError::Empty) => None,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        closed = true;
                        None
                    }
                }
            };
            let Some(req) = next else { break };
            metrics.queue_depth.fetch_sub(1, Relaxed);
            if let Some(a) = admit(&mut *engine, &*codec, req, &metrics, &control, &mut scratch) {
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
                finish(
                    a,
                    Finish::Cancelled,
                    codec.eos_ids(),
                    &metrics,
                    &mut scratch,
                );
            } else if now >= a.req.deadline {
                finish(a, Finish::Timeout, codec.eos_ids(), &metrics, &mut scratch);
            }
        }
        // One decode turn over every live sequence.
        let rows: Vec<(SeqId, u32)> = active
            .iter()
            .filter(|a| !a.done)
            .filter_map(|a| a.pending.map(|t| (a.seq, t)))
            .collect();
        if !rows.is_empty() {
            let t0 = Instant::now();
            let mut sampled: Vec<Option<u32>> = vec![None; rows.len()];
            let res = {
                let mut by_seq: Vec<&mut Active> = active
                    .iter_mut()
                    .filter(|a| !a.done && a.pending.is_some())
                    .collect();
                let r = engine.decode(&rows, &mut |i, logits| {
                    if let Some(a) = by_seq.get_mut(i) {
                        sampled[i] = Some(a.sampler.sample(logits));
                    }
                });
                r
            };
            metrics
                .decode_nanos
                .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
            metrics.decode_rows.fetch_add(rows.len() as u64, Relaxed);
            match res {
                Ok(()) => {
                    let eos = codec.eos_ids();
                    let live = active.iter_mut().filter(|a| !a.done && a.pending.is_some());
                    for (i, a) in live.enumerate() {
                        let tok = sampled.get(i).copied().flatten();
                        match tok {
                            Some(t) => {
                                let pos = engine.position(a.seq);
                                take_token(a, t, &*codec, eos, pos, &metrics, &mut scratch)
                            }
                            None => fail(a, "engine returned no logits for the row", &metrics),
                        }
                    }
                }
                Err(e) => {
                    metrics.device_errors.fetch_add(1, Relaxed);
                    tracing::error!("decode pass failed: {e}");
                    for a in active.iter_mut().filter(|a| !a.done) {
                        fail(a, &e.to_string(), &metrics);
                    }
                }
            }
        }
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

fn admit(
    engine: &mut dyn Engine,
    codec: &dyn TextCodec,
    req: GenRequest,
    metrics: &Metrics,
    control: &Control,
    scratch: &mut String,
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
    let seq = match engine.new_sequence() {
        Ok(s) => s,
        Err(e) => {
            let _ = req.events.send(Event::Error(e.to_string()));
            return None;
        }
    };
    let mut a = Active {
        seq,
        sampler: Sampler::new(req.sampling.clone(), req.seed),
        utf8: Utf8Stream::default(),
        stops: StopFilter::new(req.stop.clone()),
        generated: 0,
        pending: None,
        done: false,
        req,
    };
    let mut first = None;
    let res = engine.prefill(seq, &a.req.prompt, &mut |logits| {
        first = Some(a.sampler.sample(logits))
    });
    match res {
        Ok(()) => {
            metrics
                .prompt_tokens
                .fetch_add(a.req.prompt.len() as u64, Relaxed);
            match first {
                Some(t) => {
                    let pos = engine.position(seq);
                    take_token(&mut a, t, codec, codec.eos_ids(), pos, metrics, scratch);
                }
                None => fail(&mut a, "engine returned no logits for the prompt", metrics),
            }
        }
        Err(e) => {
            if matches!(e, EngineError::Device(_)) {
                metrics.device_errors.fetch_add(1, Relaxed);
            }
            tracing::error!("prefill failed: {e}");
            fail(&mut a, &e.to_string(), metrics);
        }
    }
    if a.done {
        engine.release(seq);
        return None;
    }
    Some(a)
}

fn fail(a: &mut Active, msg: &str, _metrics: &Metrics) {
    a.done = true;
    a.pending = None;
    let _ = a.req.events.send(Event::Error(msg.to_string()));
}

/// Handle a freshly sampled token; `pos` = the sequence's committed positions.
fn take_token(
    a: &mut Active,
    t: u32,
    codec: &dyn TextCodec,
    eos: &[u32],
    pos: usize,
    metrics: &Metrics,
    scratch: &mut String,
) {
    if eos.contains(&t) {
        a.pending = None;
        emit_finish(a, Finish::Stop, true, metrics, scratch);
        return;
    }
    a.generated += 1;
    metrics.generated_tokens.fetch_add(1, Relaxed);
    scratch.clear();
    a.utf8.push(&codec.token_bytes(t), scratch);
    let shown = a.stops.push(scratch);
    if !shown.is_empty() {
        let _ = a.req.events.send(Event::Text(shown));
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

fn finish(a: &mut Active, why: Finish, _eos: &[u32], metrics: &Metrics, scratch: &mut String) {
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

/// Flush held text (unless a stop string matched) and send `Done`.
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
            let _ = a.req.events.send(Event::Text(tail));
        }
    }
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
