//! `forward-serve --bench`: aggregate decode throughput of N concurrent streams vs one stream,
//! through the real engine thread and scheduler (the server's request path minus HTTP). Streams are
//! greedy, or sampled at `--bench-temperature` (stream i seeded with i) as most API clients ask.
//!
//! Every stream asks for the same number of tokens with EOS ignored, so the two phases generate
//! exactly the tokens they claim. Tokens/s are completion tokens over wall time from submission to
//! the last `Done` (prefill included, as a client sees it).
//!
//! Two more cases time the first token of a chat's second turn over a long history, read cold and
//! from the prefix cache (the first turn's state), and the first tokens of `n` samples of one long
//! prompt, read once for all of them and read by each.

use super::engine::{ChatMessage, Loaded, SamplingConfig, TextCodec};
use super::metrics::Metrics;
use super::scheduler::{self, Control, Event, GenRequest, SampleGroup};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Distinct prompts, one per stream (cycled when there are more streams).
pub const BENCH_PROMPTS: [&str; 16] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "Water boils at a temperature of",
    "In computer science, a linked list is",
    "The quick brown fox",
    "My favourite season of the year is",
    "The main ingredients of bread are",
    "A good night's sleep helps",
    "The history of the Roman Empire began",
    "Photosynthesis is the process by which",
    "The best way to learn a new language is",
    "Mount Everest is located in",
    "The moon orbits the Earth every",
];

/// Bench settings.
#[derive(Clone, Debug)]
pub struct BenchSpec {
    /// Concurrent streams of the second phase (at least 1).
    pub streams: usize,
    /// Tokens every stream generates (EOS ignored).
    pub tokens: usize,
    /// Rounds of (one single stream, then all streams at once), alternated so that a change in
    /// machine load hits both phases alike; medians are reported.
    pub rounds: usize,
    /// Sampling temperature of every stream (0 = greedy).
    pub temperature: f32,
}

/// Bench result (also the `--json` shape).
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    /// The model id.
    pub model: String,
    /// Concurrent streams.
    pub streams: usize,
    /// Tokens every stream generated.
    pub tokens_per_stream: usize,
    /// Rounds measured.
    pub rounds: usize,
    /// Sampling temperature of every stream (0 = greedy; no top-k / top-p cut).
    pub temperature: f32,
    /// One stream: median over the rounds of completion tokens / wall seconds, prefill included.
    pub single_tok_s: f64,
    /// All streams at once: median over the rounds of completion tokens / wall seconds, prefill
    /// included.
    pub concurrent_tok_s: f64,
    /// `concurrent_tok_s / single_tok_s`.
    pub speedup: f64,
    /// `single_tok_s` of every round, for the spread.
    pub single_runs_tok_s: Vec<f64>,
    /// `concurrent_tok_s` of every round, for the spread.
    pub concurrent_runs_tok_s: Vec<f64>,
    /// One stream: median of decode rows / decode-pass seconds (prefill excluded), from the
    /// server's metrics.
    pub single_decode_tok_s: f64,
    /// All streams at once: median of decode rows / decode-pass seconds (prefill excluded).
    pub concurrent_decode_tok_s: f64,
    /// Mean rows per decode pass in the concurrent phase.
    pub concurrent_rows_per_pass: f64,
    /// The chat case (absent when the context is too small for it).
    pub chat_turn: Option<ChatTurnResult>,
    /// The `n` case (absent when the context is too small for it).
    pub samples: Option<SamplesResult>,
}

/// The `n` case: [`SHARED_SAMPLES`] samples of one long prompt, each generating one token; the
/// time until the last has it, the prompt read once (an `n` request) and read by each.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SamplesResult {
    /// Samples.
    pub samples: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Median milliseconds, one `n` request (the prompt read once and copied).
    pub shared_ms: f64,
    /// Median milliseconds, `n` separate requests at once (each reads the prompt).
    pub separate_ms: f64,
    /// `separate_ms / shared_ms`.
    pub speedup: f64,
}

/// Samples of the `n` case.
pub const SHARED_SAMPLES: usize = 4;

/// The chat case: a second turn's time to its first token, cold and from the prefix cache.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ChatTurnResult {
    /// Prompt tokens of the second turn.
    pub prompt_tokens: usize,
    /// Median milliseconds to the first token, the prompt read cold.
    pub cold_ms: f64,
    /// The same with the first turn's state in the prefix cache.
    pub warm_ms: f64,
    /// `cold_ms / warm_ms`.
    pub speedup: f64,
    /// Every round's cold and warm milliseconds.
    pub cold_runs_ms: Vec<f64>,
    /// See `cold_runs_ms`.
    pub warm_runs_ms: Vec<f64>,
}

/// Bench prompts repeated in [`long_chat`]'s history (about a thousand tokens on the default
/// model); the bench uses fewer when its context is smaller.
pub const LONG_CHAT_PROMPTS: usize = 140;

/// A chat whose user turn carries a history of `prompts` bench prompts (140: about a thousand
/// tokens); `tag` makes the system prompt, hence the whole prompt, distinct.
pub fn long_chat(tag: &str, prompts: usize) -> Vec<ChatMessage> {
    let history: Vec<&str> = BENCH_PROMPTS
        .iter()
        .cycle()
        .take(prompts)
        .copied()
        .collect();
    vec![
        ChatMessage {
            role: "system".into(),
            content: format!("You are a helpful assistant ({tag})."),
        },
        ChatMessage {
            role: "user".into(),
            content: format!(
                "Here are some notes: {}\nSummarize them.",
                history.join(" ")
            ),
        },
    ]
}

/// The second turn of [`long_chat`]: its answer `reply`, then a short question.
pub fn second_turn(mut chat: Vec<ChatMessage>, reply: &str) -> Vec<ChatMessage> {
    chat.push(ChatMessage {
        role: "assistant".into(),
        content: reply.to_string(),
    });
    chat.push(ChatMessage {
        role: "user".into(),
        content: "Now say it in one word.".into(),
    });
    chat
}

/// Errors of the bench.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A prompt did not tokenize, a stream failed or ended short, or the engine thread went away.
    #[error("bench: {0}")]
    Failed(String),
    /// The engine thread could not be started.
    #[error("bench: could not start the engine thread: {0}")]
    Io(#[from] std::io::Error),
}

fn submit(
    tx: &mpsc::Sender<GenRequest>,
    codec: &dyn TextCodec,
    metrics: &Metrics,
    prompt: &str,
    tokens: usize,
    temperature: f32,
    seed: u64,
) -> Result<mpsc::UnboundedReceiver<Event>, BenchError> {
    let ids = codec
        .prompt_tokens(prompt, false)
        .map_err(|e| BenchError::Failed(e.to_string()))?;
    submit_ids(tx, metrics, ids, tokens, temperature, seed, None)
}

fn submit_ids(
    tx: &mpsc::Sender<GenRequest>,
    metrics: &Metrics,
    ids: Vec<u32>,
    tokens: usize,
    temperature: f32,
    seed: u64,
    group: Option<SampleGroup>,
) -> Result<mpsc::UnboundedReceiver<Event>, BenchError> {
    let (etx, erx) = mpsc::unbounded_channel();
    let req = GenRequest {
        prompt: ids,
        max_tokens: tokens,
        sampling: SamplingConfig::with_temperature(temperature),
        seed,
        stop: Vec::new(),
        deadline: Instant::now() + Duration::from_secs(3600),
        cancel: Arc::new(AtomicBool::new(false)),
        events: etx,
        speculate: None,
        ignore_eos: true,
        logprobs: None,
        prompt_logprobs: false,
        adjust: Default::default(),
        group,
    };
    metrics
        .queue_depth
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tx.blocking_send(req)
        .map_err(|_| BenchError::Failed("the engine thread is gone".into()))?;
    Ok(erx)
}

/// Wait for a stream's end; its completion tokens.
fn drain(mut rx: mpsc::UnboundedReceiver<Event>) -> Result<usize, BenchError> {
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Text(_) | Event::Logprobs(_) | Event::PromptLogprobs(_) => {}
            Event::Done {
                completion_tokens, ..
            } => return Ok(completion_tokens),
            Event::Error(e) => return Err(BenchError::Failed(e)),
        }
    }
    Err(BenchError::Failed("a stream ended without Done".into()))
}

/// A greedy completion of a chat: its text and the seconds to its end.
fn chat_completion(
    tx: &mpsc::Sender<GenRequest>,
    codec: &dyn TextCodec,
    metrics: &Metrics,
    chat: &[ChatMessage],
    tokens: usize,
) -> Result<(String, usize, f64), BenchError> {
    let fail = |e: super::engine::EngineError| BenchError::Failed(e.to_string());
    let text = codec.chat_prompt(chat).map_err(fail)?;
    let ids = codec.prompt_tokens(&text, true).map_err(fail)?;
    let n = ids.len();
    let t0 = Instant::now();
    let mut rx = submit_ids(tx, metrics, ids, tokens, 0.0, 0, None)?;
    let mut out = String::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Text(t) => out.push_str(&t),
            Event::Logprobs(_) | Event::PromptLogprobs(_) => {}
            Event::Done { .. } => return Ok((out, n, t0.elapsed().as_secs_f64())),
            Event::Error(e) => return Err(BenchError::Failed(e)),
        }
    }
    Err(BenchError::Failed("a stream ended without Done".into()))
}

const REPLY: &str = "The notes list facts about many topics.";

/// The token ids of a chat.
fn chat_ids(codec: &dyn TextCodec, chat: &[ChatMessage]) -> Result<Vec<u32>, BenchError> {
    let fail = |e: super::engine::EngineError| BenchError::Failed(e.to_string());
    let text = codec.chat_prompt(chat).map_err(fail)?;
    codec.prompt_tokens(&text, true).map_err(fail)
}

/// How many bench prompts [`long_chat`]'s history can hold so that its second turn fits the
/// context with room for a 16-token reply and the template (`None`: not even a few).
fn fitted_history(codec: &dyn TextCodec) -> Result<Option<usize>, BenchError> {
    let room = codec.context_len().saturating_sub(48);
    let mut prompts = LONG_CHAT_PROMPTS;
    while chat_ids(codec, &second_turn(long_chat("size", prompts), REPLY))?.len() > room {
        if prompts < 4 {
            return Ok(None);
        }
        prompts = prompts * 9 / 10;
    }
    Ok(Some(prompts))
}

/// The `n` case, `rounds` times: [`SHARED_SAMPLES`] sampled first tokens of a long prompt as one
/// group, then (another prompt of the same length) as separate requests.
fn samples_case(
    tx: &mpsc::Sender<GenRequest>,
    codec: &dyn TextCodec,
    metrics: &Metrics,
    rounds: usize,
) -> Result<Option<SamplesResult>, BenchError> {
    let Some(prompts) = fitted_history(codec)? else {
        return Ok(None);
    };
    let n = SHARED_SAMPLES;
    let (mut shared, mut separate, mut tokens) = (Vec::new(), Vec::new(), 0);
    for r in 0..rounds {
        for grouped in [true, false] {
            let tag = format!("samples {r} {grouped}");
            let ids = chat_ids(codec, &long_chat(&tag, prompts))?;
            tokens = ids.len();
            let t0 = Instant::now();
            let rxs = (0..n)
                .map(|i| {
                    let group = grouped.then_some(SampleGroup {
                        id: r as u64,
                        index: i,
                        count: n,
                    });
                    submit_ids(tx, metrics, ids.clone(), 1, 0.8, i as u64, group)
                })
                .collect::<Result<Vec<_>, _>>()?;
            for rx in rxs {
                drain(rx)?;
            }
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            if grouped {
                shared.push(ms);
            } else {
                separate.push(ms);
            }
        }
    }
    let (s, p) = (median(&shared), median(&separate));
    Ok(Some(SamplesResult {
        samples: n,
        prompt_tokens: tokens,
        shared_ms: s,
        separate_ms: p,
        speedup: p / s.max(1e-9),
    }))
}

/// The chat case, `rounds` times: a second turn timed to its first token with its prompt read
/// cold, then (another conversation) after its first turn left its state in the prefix cache.
/// (second-turn prompt tokens, cold ms, warm ms).
fn chat_turn_case(
    tx: &mpsc::Sender<GenRequest>,
    codec: &dyn TextCodec,
    metrics: &Metrics,
    rounds: usize,
) -> Result<Option<ChatTurnResult>, BenchError> {
    let Some(prompts) = fitted_history(codec)? else {
        return Ok(None);
    };
    let (mut cold, mut warm, mut tokens) = (Vec::new(), Vec::new(), 0);
    for r in 0..rounds {
        // Cold: a conversation whose first turn this server never saw.
        let chat = second_turn(long_chat(&format!("cold {r}"), prompts), REPLY);
        let (_, n, secs) = chat_completion(tx, codec, metrics, &chat, 1)?;
        cold.push(secs * 1e3);
        // Warm: the first turn runs (untimed), then the second.
        let first = long_chat(&format!("warm {r}"), prompts);
        let (reply, _, _) = chat_completion(tx, codec, metrics, &first, 16)?;
        let (_, n_warm, secs) =
            chat_completion(tx, codec, metrics, &second_turn(first, &reply), 1)?;
        warm.push(secs * 1e3);
        tokens = n.max(n_warm);
    }
    let (c, w) = (median(&cold), median(&warm));
    Ok(Some(ChatTurnResult {
        prompt_tokens: tokens,
        cold_ms: c,
        warm_ms: w,
        speedup: c / w.max(1e-9),
        cold_runs_ms: cold,
        warm_runs_ms: warm,
    }))
}

/// Run `streams` prompts at once; (completion tokens, seconds).
fn phase(
    tx: &mpsc::Sender<GenRequest>,
    codec: &dyn TextCodec,
    metrics: &Metrics,
    prompts: &[&str],
    tokens: usize,
    temperature: f32,
) -> Result<(usize, f64), BenchError> {
    let t0 = Instant::now();
    let rxs = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| submit(tx, codec, metrics, p, tokens, temperature, i as u64))
        .collect::<Result<Vec<_>, _>>()?;
    let mut total = 0;
    for rx in rxs {
        total += drain(rx)?;
    }
    Ok((total, t0.elapsed().as_secs_f64()))
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Decode rows, decode nanoseconds and passes so far.
fn decode_counters(m: &Metrics) -> (u64, u64, u64) {
    use std::sync::atomic::Ordering::Relaxed;
    (
        m.decode_rows.load(Relaxed),
        m.decode_nanos.load(Relaxed),
        m.decode_passes.load(Relaxed),
    )
}

/// Run the bench: `spec.rounds` rounds of one stream, then `spec.streams` streams at once,
/// through a fresh engine thread; medians of the rounds.
pub fn run(loaded: Loaded, spec: &BenchSpec) -> Result<BenchResult, BenchError> {
    let streams = spec.streams.max(1);
    let rounds = spec.rounds.max(1);
    let codec = loaded.codec.clone();
    let metrics = Arc::new(Metrics::default());
    let control = Arc::new(Control::default());
    let (tx, rx) = mpsc::channel(streams + 1);
    let engine = scheduler::spawn(
        loaded.engine,
        codec.clone(),
        rx,
        streams,
        metrics.clone(),
        control,
    )?;
    let prompts: Vec<&str> = (0..streams)
        .map(|i| BENCH_PROMPTS[i % BENCH_PROMPTS.len()])
        .collect();
    // One phase: (tok/s wall, decode tok/s, rows per pass).
    let measure = |ps: &[&str]| -> Result<(f64, f64, f64), BenchError> {
        let (r0, n0, p0) = decode_counters(&metrics);
        let (n, secs) = phase(&tx, &*codec, &metrics, ps, spec.tokens, spec.temperature)?;
        if n != ps.len() * spec.tokens {
            return Err(BenchError::Failed(format!(
                "{n} tokens generated, {} expected",
                ps.len() * spec.tokens
            )));
        }
        let (r1, n1, p1) = decode_counters(&metrics);
        let decode = (r1 - r0) as f64 / ((n1 - n0) as f64 / 1e9).max(1e-9);
        let per_pass = (r1 - r0) as f64 / ((p1 - p0) as f64).max(1.0);
        Ok((n as f64 / secs, decode, per_pass))
    };
    let result = (|| {
        // Warm-up: fault the weights in and size every buffer.
        phase(&tx, &*codec, &metrics, &prompts[..1], 4, spec.temperature)?;
        let (mut single, mut single_dec) = (Vec::new(), Vec::new());
        let (mut conc, mut conc_dec, mut per_pass) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rounds {
            let (t, d, _) = measure(&[prompts[r % prompts.len()]])?;
            single.push(t);
            single_dec.push(d);
            let (t, d, p) = measure(&prompts)?;
            conc.push(t);
            conc_dec.push(d);
            per_pass.push(p);
        }
        let (s, c) = (median(&single), median(&conc));
        let chat_turn = chat_turn_case(&tx, &*codec, &metrics, rounds)?;
        let samples = samples_case(&tx, &*codec, &metrics, rounds)?;
        Ok(BenchResult {
            model: codec.model_id().to_string(),
            streams,
            tokens_per_stream: spec.tokens,
            rounds,
            temperature: spec.temperature,
            single_tok_s: s,
            concurrent_tok_s: c,
            speedup: c / s,
            single_runs_tok_s: single,
            concurrent_runs_tok_s: conc,
            single_decode_tok_s: median(&single_dec),
            concurrent_decode_tok_s: median(&conc_dec),
            concurrent_rows_per_pass: median(&per_pass),
            chat_turn,
            samples,
        })
    })();
    drop(tx);
    let _ = scheduler::join_within(engine, Duration::from_secs(60));
    result
}

/// The human-readable table.
pub fn table(r: &BenchResult) -> String {
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "forward-serve bench: {} — {} streams of {} tokens (EOS ignored), {} rounds, medians\n\
         | mode       | streams | tok/s (prefill incl.) | decode-only tok/s | per round            |\n\
         |------------|---------|----------------------|-------------------|----------------------|\n\
         | single     | 1       | {:>20.1} | {:>17.1} | {} |\n\
         | concurrent | {:<7} | {:>20.1} | {:>17.1} | {} |\n\
         speedup: {:.2}×   (concurrent rows per decode pass: {:.1})\n{}{}",
        r.model,
        if r.temperature > 0.0 {
            format!("sampled (temperature {})", r.temperature)
        } else {
            "greedy".to_string()
        },
        r.tokens_per_stream,
        r.rounds,
        r.single_tok_s,
        r.single_decode_tok_s,
        list(&r.single_runs_tok_s),
        r.streams,
        r.concurrent_tok_s,
        r.concurrent_decode_tok_s,
        list(&r.concurrent_runs_tok_s),
        r.speedup,
        r.concurrent_rows_per_pass,
        match &r.chat_turn {
            Some(c) => format!(
                "chat second turn ({} prompt tokens), time to first token: {:.1} ms cold, {:.1} ms \
                 from the prefix cache ({:.1}×; rounds cold {}, warm {})\n",
                c.prompt_tokens,
                c.cold_ms,
                c.warm_ms,
                c.speedup,
                list(&c.cold_runs_ms),
                list(&c.warm_runs_ms),
            ),
            None => "chat second turn: skipped (the context is too small for its history)\n".into(),
        },
        match &r.samples {
            Some(c) => format!(
                "{} samples of one {}-token prompt, time to every first token: {:.1} ms read once \
                 (n = {}), {:.1} ms read by each ({:.1}×)\n",
                c.samples, c.prompt_tokens, c.shared_ms, c.samples, c.separate_ms, c.speedup
            ),
            None => "samples of one prompt: skipped (the context is too small)\n".into(),
        },
    )
}
