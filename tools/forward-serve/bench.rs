//! `forward-serve --bench`: aggregate decode throughput of N concurrent greedy streams vs one
//! stream, through the real engine thread and scheduler (the server's request path minus HTTP).
//!
//! Every stream asks for the same number of tokens with EOS ignored, so the two phases generate
//! exactly the tokens they claim. Tokens/s are completion tokens over wall time from submission to
//! the last `Done` (prefill included, as a client sees it).

use super::engine::{Loaded, SamplerConfig, TextCodec};
use super::metrics::Metrics;
use super::scheduler::{self, Control, Event, GenRequest};
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
    pub streams: usize,
    pub tokens: usize,
    /// Single-stream runs (the median is reported).
    pub single_runs: usize,
}

/// Bench result (also the `--json` shape).
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    pub model: String,
    pub streams: usize,
    pub tokens_per_stream: usize,
    pub single_tok_s: f64,
    pub single_runs_tok_s: Vec<f64>,
    pub concurrent_tok_s: f64,
    pub concurrent_seconds: f64,
    pub speedup: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("bench: {0}")]
    Failed(String),
    #[error("bench: could not start the engine thread: {0}")]
    Io(#[from] std::io::Error),
}

fn submit(
    tx: &mpsc::Sender<GenRequest>,
    codec: &dyn TextCodec,
    metrics: &Metrics,
    prompt: &str,
    tokens: usize,
) -> Result<mpsc::UnboundedReceiver<Event>, BenchError> {
    let ids = codec
        .prompt_tokens(prompt, false)
        .map_err(|e| BenchError::Failed(e.to_string()))?;
    let (etx, erx) = mpsc::unbounded_channel();
    let req = GenRequest {
        prompt: ids,
        max_tokens: tokens,
        sampling: SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        },
        seed: 0,
        stop: Vec::new(),
        deadline: Instant::now() + Duration::from_secs(3600),
        cancel: Arc::new(AtomicBool::new(false)),
        events: etx,
        speculate: None,
        ignore_eos: true,
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
            Event::Text(_) => {}
            Event::Done {
                completion_tokens, ..
            } => return Ok(completion_tokens),
            Event::Error(e) => return Err(BenchError::Failed(e)),
        }
    }
    Err(BenchError::Failed("a stream ended without Done".into()))
}

/// Run `streams` prompts at once; (completion tokens, seconds).
fn phase(
    tx: &mpsc::Sender<GenRequest>,
    codec: &dyn TextCodec,
    metrics: &Metrics,
    prompts: &[&str],
    tokens: usize,
) -> Result<(usize, f64), BenchError> {
    let t0 = Instant::now();
    let rxs = prompts
        .iter()
        .map(|p| submit(tx, codec, metrics, p, tokens))
        .collect::<Result<Vec<_>, _>>()?;
    let mut total = 0;
    for rx in rxs {
        total += drain(rx)?;
    }
    Ok((total, t0.elapsed().as_secs_f64()))
}

pub fn run(loaded: Loaded, spec: &BenchSpec) -> Result<BenchResult, BenchError> {
    let streams = spec.streams.max(1);
    let codec = loaded.codec.clone();
    let metrics = Arc::new(Metrics::default());
    let control = Arc::new(Control::default());
    let (tx, rx) = mpsc::channel(streams.max(1) + 1);
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
    let result = (|| {
        // Warm-up: fault the weights in and size every buffer.
        phase(&tx, &*codec, &metrics, &prompts[..1], 4)?;
        let mut singles = Vec::new();
        for i in 0..spec.single_runs.max(1) {
            let p = prompts[i % prompts.len()];
            let (n, s) = phase(&tx, &*codec, &metrics, &[p], spec.tokens)?;
            singles.push(n as f64 / s);
        }
        let (n, secs) = phase(&tx, &*codec, &metrics, &prompts, spec.tokens)?;
        if n != streams * spec.tokens {
            return Err(BenchError::Failed(format!(
                "{n} tokens generated, {} expected",
                streams * spec.tokens
            )));
        }
        let mut sorted = singles.clone();
        sorted.sort_by(f64::total_cmp);
        let single = sorted[sorted.len() / 2];
        let concurrent = n as f64 / secs;
        Ok(BenchResult {
            model: codec.model_id().to_string(),
            streams,
            tokens_per_stream: spec.tokens,
            single_tok_s: single,
            single_runs_tok_s: singles,
            concurrent_tok_s: concurrent,
            concurrent_seconds: secs,
            speedup: concurrent / single,
        })
    })();
    drop(tx);
    let _ = scheduler::join_within(engine, Duration::from_secs(60));
    result
}

/// The human-readable table.
pub fn table(r: &BenchResult) -> String {
    let single_runs: Vec<String> = r
        .single_runs_tok_s
        .iter()
        .map(|v| format!("{v:.1}"))
        .collect();
    format!(
        "forward-serve bench: {} — greedy streams of {} tokens (EOS ignored), prefill included\n\
         | mode       | streams | tok/s   |\n\
         |------------|---------|---------|\n\
         | single     | 1       | {:>7.1} |  (median of runs: {})\n\
         | concurrent | {:<7} | {:>7.1} |  ({:.2} s)\n\
         speedup: {:.2}×\n",
        r.model,
        r.tokens_per_stream,
        r.single_tok_s,
        single_runs.join(", "),
        r.streams,
        r.concurrent_tok_s,
        r.concurrent_seconds,
        r.speedup
    )
}
