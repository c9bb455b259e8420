//! HTTP handlers: request validation and submission to the engine queue; the answers are built in
//! `response.rs`, the Ollama routes in `ollama.rs`.

use super::engine::{ChatMessage, LogitAdjustments, SamplingConfig, TextCodec};
use super::error::ApiError;
use super::metrics::Metrics;
use super::response::{collect, merged, sse_response, Shape, StreamState};
use super::scheduler::{DrafterKind, Event, GenRequest, SampleGroup, Speculate};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// Server limits and settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// Requests waiting for a sequence slot before new ones get 503 (`--max-queue`).
    pub max_queue: usize,
    /// Sequences generated at once (`--max-batch`; the engine may cap it lower).
    pub max_batch: usize,
    /// Per-request time limit, queueing included (`--request-timeout`).
    pub request_timeout: Duration,
    /// Largest `max_tokens` a request may ask for (`--max-tokens-limit`).
    pub max_tokens_limit: usize,
    /// Largest request body in bytes; larger ones get 413 (`--body-limit`).
    pub body_limit: usize,
    /// Time a request's body may take to arrive once its headers have; 408 after (`--body-timeout`).
    pub body_timeout: Duration,
    /// Time a connection gets to send a request's headers, from its opening or its previous
    /// answer; closed after (`--header-timeout`).
    pub header_timeout: Duration,
    /// Client connections open at once; one more is answered 503 (`--max-connections`).
    pub max_connections: usize,
    /// Time in-flight requests get to finish after SIGTERM/SIGINT (`--shutdown-grace`).
    pub shutdown_grace: Duration,
    /// Server default for speculative decoding (`--speculate ngram|dflash --draft-max K`): the
    /// drafter and drafts per round, `None` = off. A request's `speculative` field overrides it.
    pub speculate: Option<Speculate>,
    /// The engine has a DFlash draft (`--draft`), so requests may ask for `"drafter":
    /// "dflash"`; [`crate::server::run`] sets it from the engine.
    pub dflash: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_queue: 64,
            max_batch: 16,
            request_timeout: Duration::from_secs(120),
            max_tokens_limit: 2048,
            body_limit: 1 << 20,
            body_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(15),
            max_connections: 1024,
            shutdown_grace: Duration::from_secs(10),
            speculate: None,
            dflash: false,
        }
    }
}

/// State shared by every handler.
pub struct App {
    /// Limits and settings.
    pub cfg: Config,
    /// Tokenizer and chat template of the served model.
    pub codec: Arc<dyn TextCodec>,
    /// Counters shared with the engine thread, served at `/metrics`.
    pub metrics: Arc<Metrics>,
    /// The queue's only sender; taken at shutdown so the engine thread sees the queue close.
    pub queue: Mutex<Option<mpsc::Sender<GenRequest>>>,
    /// Set at shutdown: new generations get 503 and `/health` reports "shutting down".
    pub draining: AtomicBool,
    next_id: AtomicU64,
    created: u64,
}

impl App {
    /// The shared state, with `queue` the sender side of the engine's request queue.
    pub fn new(
        cfg: Config,
        codec: Arc<dyn TextCodec>,
        metrics: Arc<Metrics>,
        queue: mpsc::Sender<GenRequest>,
    ) -> Self {
        App {
            cfg,
            codec,
            metrics,
            queue: Mutex::new(Some(queue)),
            draining: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            created: unix_now(),
        }
    }
    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The endpoint label for metrics (bounded set).
pub fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/completions" => "/v1/completions",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/models" => "/v1/models",
        "/health" => "/health",
        "/tokenize" => "/tokenize",
        "/detokenize" => "/detokenize",
        "/completion" => "/completion",
        "/metrics" => "/metrics",
        "/api/generate" => "/api/generate",
        "/api/chat" => "/api/chat",
        "/api/tags" => "/api/tags",
        "/api/show" => "/api/show",
        "/api/version" => "/api/version",
        _ => "other",
    }
}

/// Middleware: counts every response by endpoint and status in [`Metrics`].
pub async fn track(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let ep = endpoint_label(req.uri().path());
    let r = next.run(req).await;
    app.metrics.record_request(ep, r.status().as_u16());
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        v.to_string(),
    )
        .into_response()
}

/// Read a JSON object body within the size limit.
pub(crate) async fn read_json(
    app: &App,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    let limit = app.cfg.body_limit;
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
    {
        if len > limit as u64 {
            return Err(ApiError::too_large(limit));
        }
    }
    let bytes: Bytes =
        tokio::time::timeout(app.cfg.body_timeout, axum::body::to_bytes(body, limit))
            .await
            .map_err(|_| {
                app.metrics.body_timeouts.fetch_add(1, Relaxed);
                ApiError::body_timeout(app.cfg.body_timeout)
            })?
            .map_err(|_| ApiError::too_large(limit))?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::invalid("", format!("invalid JSON body: {e}")).code("invalid_json")
    })?;
    if !v.is_object() {
        return Err(ApiError::invalid("", "the body must be a JSON object").code("invalid_json"));
    }
    Ok(v)
}

// ---- typed field access with the offending parameter named -------------------------------------

fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    match v.get(key) {
        None | Some(Value::Null) => None,
        Some(x) => Some(x),
    }
}

fn opt_i64(v: &Value, key: &str) -> Result<Option<i64>, ApiError> {
    match field(v, key) {
        None => Ok(None),
        Some(x) => match x.as_i64() {
            Some(i) => Ok(Some(i)),
            None => match x.as_f64() {
                Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
                _ => Err(
                    ApiError::invalid(key, format!("`{key}` must be an integer, got {x}"))
                        .code("invalid_type"),
                ),
            },
        },
    }
}

fn opt_f64(v: &Value, key: &str) -> Result<Option<f64>, ApiError> {
    match field(v, key) {
        None => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| {
            ApiError::invalid(key, format!("`{key}` must be a number, got {x}"))
                .code("invalid_type")
        }),
    }
}

fn opt_bool(v: &Value, key: &str) -> Result<Option<bool>, ApiError> {
    match field(v, key) {
        None => Ok(None),
        Some(x) => x.as_bool().map(Some).ok_or_else(|| {
            ApiError::invalid(key, format!("`{key}` must be a boolean, got {x}"))
                .code("invalid_type")
        }),
    }
}

fn stop_list(v: &Value, key: &str) -> Result<Vec<String>, ApiError> {
    match field(v, key) {
        None => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => {
            if a.len() > 4 {
                return Err(
                    ApiError::invalid(key, "at most 4 stop sequences").code("invalid_value")
                );
            }
            a.iter()
                .map(|x| {
                    x.as_str().map(str::to_string).ok_or_else(|| {
                        ApiError::invalid(key, "`stop` must be a string or an array of strings")
                            .code("invalid_type")
                    })
                })
                .collect()
        }
        Some(_) => Err(
            ApiError::invalid(key, "`stop` must be a string or an array of strings")
                .code("invalid_type"),
        ),
    }
}

fn token_list(codec: &dyn TextCodec, a: &[Value], key: &str) -> Result<Vec<u32>, ApiError> {
    let vocab = codec.vocab_size();
    a.iter()
        .map(|x| match x.as_u64() {
            Some(t) if (t as usize) < vocab => Ok(t as u32),
            _ => Err(ApiError::invalid(
                key,
                format!("token ids must be integers in 0..{vocab}, got {x}"),
            )
            .code("invalid_value")),
        })
        .collect()
}

/// Which API shape a generation answers in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// OpenAI `/v1/completions` (`text_completion` objects).
    Completions,
    /// OpenAI `/v1/chat/completions` (`chat.completion` objects; the prompt is rendered through
    /// the chat template).
    Chat,
    /// llama.cpp server `/completion` (`content`, `stop`, `tokens_predicted`, ...).
    Llama,
}

/// A validated generation request.
#[derive(Debug)]
pub struct Params {
    /// Prompt token ids (chat: the rendered template, tokenized).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Temperature, top-k and top-p.
    pub sampling: SamplingConfig,
    /// Seed of the sampler (varied per request when the request gives none or a negative one).
    pub seed: u64,
    /// Stop strings: generation ends at the first occurrence of any (not sent).
    pub stop: Vec<String>,
    /// Answer as server-sent events instead of one JSON body.
    pub stream: bool,
    /// `stream_options.include_usage`: end the stream with a usage chunk.
    pub include_usage: bool,
    /// Speculative decoding for this request: the drafter and drafts per round (`None` = plain
    /// decoding), from the request's `speculative` field or else the server default.
    pub speculate: Option<Speculate>,
    /// Report log-probabilities with this many alternatives per token (`None`: none).
    pub logprobs: Option<usize>,
    /// `echo`: the prompt's text (and, with `logprobs`, its tokens) comes first.
    pub echo: Option<String>,
    /// `logit_bias`, `presence_penalty`, `frequency_penalty`.
    pub adjust: LogitAdjustments,
    /// Samples (`n`): sample `i` is seeded with `seed + i`; the prompt is read once.
    pub n: usize,
}

/// Most samples of one request (`n`).
pub const MAX_SAMPLES: i64 = 16;

fn check_model(app: &App, v: &Value) -> Result<(), ApiError> {
    match field(v, "model") {
        None => Ok(()),
        Some(Value::String(m)) => {
            if m == app.codec.model_id() {
                Ok(())
            } else {
                Err(ApiError::model_not_found(m))
            }
        }
        Some(x) => Err(
            ApiError::invalid("model", format!("`model` must be a string, got {x}"))
                .code("invalid_type"),
        ),
    }
}

fn chat_messages(v: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let Some(msgs) = field(v, "messages") else {
        return Err(ApiError::invalid("messages", "`messages` is required")
            .code("missing_required_parameter"));
    };
    let Some(arr) = msgs.as_array() else {
        return Err(
            ApiError::invalid("messages", "`messages` must be an array").code("invalid_type")
        );
    };
    if arr.is_empty() {
        return Err(
            ApiError::invalid("messages", "`messages` must not be empty").code("invalid_value"),
        );
    }
    let mut out = Vec::with_capacity(arr.len());
    for (i, m) in arr.iter().enumerate() {
        let p = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(&p, format!("`{p}.role` must be a string")).code("invalid_type")
        })?;
        // OpenAI's roles; `developer` is its newer name for `system`, which is what chat
        // templates know.
        let role = match role {
            "system" | "developer" => "system",
            "user" | "assistant" | "tool" => role,
            other => {
                return Err(ApiError::invalid(
                    &format!("{p}.role"),
                    format!(
                        "`{p}.role` is `{other}`; supported roles are system, developer, user, \
                         assistant and tool"
                    ),
                )
                .code("invalid_value"))
            }
        };
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for part in parts {
                    match (
                        part.get("type").and_then(Value::as_str),
                        part.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => s.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                &p,
                                "only text content parts are supported",
                            )
                            .code("invalid_value"))
                        }
                    }
                }
                s
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    &p,
                    format!("`{p}.content` must be a string or an array of parts"),
                )
                .code("invalid_type"))
            }
        };
        out.push(ChatMessage {
            role: role.to_string(),
            content,
        });
    }
    Ok(out)
}

/// Validate a generation request body.
pub fn parse_params(app: &App, v: &Value, kind: Kind) -> Result<Params, ApiError> {
    let codec = &*app.codec;
    super::fields::check(v, kind)?;
    super::fields::check_defaults(v, kind)?;
    check_model(app, v)?;
    let echo = kind == Kind::Completions && opt_bool(v, "echo")?.unwrap_or(false);
    // The prompt.
    let prompt: Vec<u32> = match kind {
        Kind::Chat => {
            let msgs = chat_messages(v)?;
            let text = codec
                .chat_prompt(&msgs)
                .map_err(|e| ApiError::invalid("messages", e.to_string()).code("invalid_value"))?;
            codec
                .prompt_tokens(&text, true)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?
        }
        Kind::Completions | Kind::Llama => match field(v, "prompt") {
            None => return Err(ApiError::invalid("prompt", "`prompt` is required").code("missing_required_parameter")),
            Some(Value::String(s)) => {
                if s.is_empty() {
                    return Err(ApiError::invalid("prompt", "`prompt` is empty").code("invalid_value"));
                }
                codec.prompt_tokens(s, false).map_err(|e| ApiError::invalid("prompt", e.to_string()))?
            }
            Some(Value::Array(a)) => match a.as_slice() {
                [Value::String(s)] => {
                    if s.is_empty() {
                        return Err(ApiError::invalid("prompt", "`prompt` is empty").code("invalid_value"));
                    }
                    codec.prompt_tokens(s, false).map_err(|e| ApiError::invalid("prompt", e.to_string()))?
                }
                [] => return Err(ApiError::invalid("prompt", "`prompt` is empty").code("invalid_value")),
                xs if xs.iter().all(Value::is_number) => token_list(codec, xs, "prompt")?,
                // One prompt of token ids in a batch of one (lm-evaluation-harness sends this).
                [Value::Array(ids)] if !ids.is_empty() && ids.iter().all(Value::is_number) => {
                    token_list(codec, ids, "prompt")?
                }
                _ => {
                    return Err(ApiError::invalid(
                        "prompt",
                        "`prompt` must be a string, an array of token ids, or an array holding one of those (one prompt per request)",
                    )
                    .code("invalid_type"))
                }
            },
            Some(x) => return Err(ApiError::invalid("prompt", format!("`prompt` must be a string, got {x}")).code("invalid_type")),
        },
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt has no tokens").code("invalid_value"));
    }
    let echo = echo.then(|| match field(v, "prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        _ => codec.detokenize(&prompt),
    });
    let ctx = codec.context_len();
    if prompt.len() >= ctx {
        return Err(ApiError::invalid(
            if kind == Kind::Chat { "messages" } else { "prompt" },
            format!(
                "the prompt has {} tokens; this model's context holds {ctx} (prompt and completion together)",
                prompt.len()
            ),
        )
        .code("context_length_exceeded"));
    }
    // max_tokens.
    let limit = app.cfg.max_tokens_limit;
    let (key, requested) = match kind {
        Kind::Completions => ("max_tokens", opt_i64(v, "max_tokens")?),
        Kind::Chat => match opt_i64(v, "max_completion_tokens")? {
            Some(x) => ("max_completion_tokens", Some(x)),
            None => ("max_tokens", opt_i64(v, "max_tokens")?),
        },
        Kind::Llama => ("n_predict", opt_i64(v, "n_predict")?.filter(|&n| n >= 0)),
    };
    let max_tokens = match requested {
        // Scoring a prompt (lm-evaluation-harness): its log-probabilities, nothing generated.
        Some(0) if echo.is_some() => 0,
        Some(n) if n <= 0 => {
            return Err(
                ApiError::invalid(key, format!("`{key}` must be at least 1, got {n}"))
                    .code("invalid_value"),
            )
        }
        Some(n) if n as u64 > limit as u64 => {
            return Err(ApiError::invalid(
                key,
                format!("`{key}` is {n}; this server allows at most {limit}"),
            )
            .code("invalid_value"))
        }
        Some(n) => n as usize,
        None => match kind {
            Kind::Completions => 16.min(limit),
            Kind::Chat | Kind::Llama => limit,
        },
    };
    let max_tokens = max_tokens.min(ctx - prompt.len());
    // Sampling.
    let default_t = if kind == Kind::Llama { 0.8 } else { 1.0 };
    let temperature = opt_f64(v, "temperature")?.unwrap_or(default_t);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(
            ApiError::invalid("temperature", "`temperature` must be in [0, 2]")
                .code("invalid_value"),
        );
    }
    let top_p = opt_f64(v, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p", "`top_p` must be in (0, 1]").code("invalid_value"));
    }
    let top_k = match opt_i64(v, "top_k")? {
        None => 0,
        // llama.cpp reads ≤ 0 as "no limit"; vLLM's −1 means the same.
        Some(k) if kind == Kind::Llama || k == -1 => k.max(0) as usize,
        Some(k) if k >= 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be ≥ 0 (or −1 for no limit), got {k}"),
            )
            .code("invalid_value"))
        }
    };
    let seed = match opt_i64(v, "seed")? {
        Some(s) if s >= 0 => s as u64,
        _ => {
            // No (or a "random" -1) seed: vary per request.
            unix_now() ^ app.next_id().wrapping_mul(0x9E37_79B9_7F4A_7C15)
        }
    };
    let stop = stop_list(v, "stop")?;
    let stream = opt_bool(v, "stream")?.unwrap_or(false);
    let include_usage = match field(v, "stream_options") {
        None => false,
        Some(o) => opt_bool(o, "include_usage")?.unwrap_or(false),
    };
    let speculate = speculative(v, &app.cfg)?;
    let logprobs = logprobs_setting(v, kind)?;
    let n = match opt_i64(v, "n")? {
        None => 1,
        Some(n) if (1..=MAX_SAMPLES).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be in 1..={MAX_SAMPLES}, got {n}"),
            )
            .code("invalid_value"))
        }
    };
    if let Some(b) = opt_i64(v, "best_of")? {
        if b as usize != n {
            return Err(ApiError::invalid(
                "best_of",
                format!("`best_of` must equal `n` ({n}): choosing the best of more samples is not supported"),
            )
            .code("unsupported_parameter"));
        }
    }
    let adjust = LogitAdjustments {
        bias: logit_bias(v, codec.vocab_size())?,
        presence_penalty: penalty(v, "presence_penalty")?,
        frequency_penalty: penalty(v, "frequency_penalty")?,
    };
    if !adjust.is_empty() && field(v, "speculative").is_some() && speculate.is_some() {
        return Err(ApiError::invalid(
            "speculative",
            "speculative decoding cannot be combined with `logit_bias` or penalties (their logits change row by row)",
        )
        .code("invalid_value"));
    }
    Ok(Params {
        prompt,
        max_tokens,
        sampling: SamplingConfig {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
        },
        seed,
        stop,
        stream,
        include_usage,
        speculate,
        logprobs,
        echo,
        adjust,
        n,
    })
}

/// Most alternatives per token: `/v1/completions` `logprobs` (as OpenAI), chat `top_logprobs`.
pub const MAX_COMPLETION_LOGPROBS: i64 = 5;
/// See [`MAX_COMPLETION_LOGPROBS`].
pub const MAX_CHAT_TOP_LOGPROBS: i64 = 20;

/// Completions: `logprobs: k` (0..=5). Chat: `logprobs: true` with `top_logprobs: k` (0..=20).
fn logprobs_setting(v: &Value, kind: Kind) -> Result<Option<usize>, ApiError> {
    let range = |key: &str, k: i64, max: i64| {
        if (0..=max).contains(&k) {
            Ok(k as usize)
        } else {
            Err(
                ApiError::invalid(key, format!("`{key}` must be in 0..={max}, got {k}"))
                    .code("invalid_value"),
            )
        }
    };
    match kind {
        Kind::Completions => opt_i64(v, "logprobs")?
            .map(|k| range("logprobs", k, MAX_COMPLETION_LOGPROBS))
            .transpose(),
        Kind::Chat => {
            let on = opt_bool(v, "logprobs")?.unwrap_or(false);
            let top = opt_i64(v, "top_logprobs")?;
            match (on, top) {
                (false, Some(_)) => Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                )
                .code("invalid_value")),
                (false, None) => Ok(None),
                (true, k) => Ok(Some(range(
                    "top_logprobs",
                    k.unwrap_or(0),
                    MAX_CHAT_TOP_LOGPROBS,
                )?)),
            }
        }
        Kind::Llama => Ok(None),
    }
}

/// `logit_bias`: an object from token ids (as strings) to biases in [−100, 100].
fn logit_bias(v: &Value, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    const P: &str = "logit_bias";
    let Some(x) = field(v, P) else {
        return Ok(Vec::new());
    };
    let Some(map) = x.as_object() else {
        return Err(ApiError::invalid(
            P,
            format!("`{P}` must be an object from token ids to numbers, got {x}"),
        )
        .code("invalid_type"));
    };
    map.iter()
        .map(|(k, b)| {
            let token = k.parse::<u32>().ok().filter(|&t| (t as usize) < vocab);
            let Some(token) = token else {
                return Err(ApiError::invalid(
                    P,
                    format!("`{P}` key {k:?} is not a token id in 0..{vocab}"),
                )
                .code("invalid_value"));
            };
            match b.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((token, b as f32)),
                _ => Err(ApiError::invalid(
                    P,
                    format!("`{P}[{k:?}]` must be a number in [-100, 100], got {b}"),
                )
                .code("invalid_value")),
            }
        })
        .collect()
}

/// `presence_penalty` / `frequency_penalty`: in [−2, 2], default 0.
fn penalty(v: &Value, key: &str) -> Result<f32, ApiError> {
    match opt_f64(v, key)? {
        None => Ok(0.0),
        Some(p) if (-2.0..=2.0).contains(&p) => Ok(p as f32),
        Some(p) => Err(
            ApiError::invalid(key, format!("`{key}` must be in [-2, 2], got {p}"))
                .code("invalid_value"),
        ),
    }
}

/// Default drafts per round when speculation is asked for without `draft_max`.
pub const DEFAULT_DRAFT_MAX: usize = 8;

/// The request's `speculative` field: `false` / `{"drafter": "none"}` turn speculation off;
/// `true` / `{"drafter": "ngram" | "dflash", "draft_max": K}` (`type` is a synonym of `drafter`;
/// K in 1..=15, default the server's
/// `--draft-max` when it speculates, else 8) turn it on, `drafter` defaulting to the server's (`--speculate`), else
/// `"ngram"`; absent: the server default. `"dflash"` needs the server's DFlash draft (`--draft`).
fn speculative(v: &Value, cfg: &Config) -> Result<Option<Speculate>, ApiError> {
    const P: &str = "speculative";
    let server = cfg.speculate;
    let bad = |m: String| ApiError::invalid(P, m).code("invalid_value");
    let default_k = server.map_or(DEFAULT_DRAFT_MAX, |s| s.draft_max);
    let default_drafter = server.map_or(DrafterKind::Ngram, |s| s.drafter);
    let chosen = match field(v, P) {
        None => return Ok(server),
        Some(Value::Bool(false)) => return Ok(None),
        Some(Value::Bool(true)) => Speculate {
            drafter: default_drafter,
            draft_max: default_k,
        },
        Some(o @ Value::Object(m)) => {
            if let Some(k) = m
                .keys()
                .find(|k| !matches!(k.as_str(), "drafter" | "type" | "draft_max"))
            {
                return Err(bad(format!(
                    "unknown field `speculative.{k}` (expected `drafter` or its synonym `type`, `draft_max`)"
                )));
            }
            let named = match (field(o, "drafter"), field(o, "type")) {
                (Some(d), Some(t)) if d != t => {
                    return Err(bad(format!(
                        "`speculative.drafter` {d} and `speculative.type` {t} disagree (they name the same thing)"
                    )))
                }
                (d, t) => d.or(t),
            };
            // `None`: "none", plain decoding (once `draft_max` is checked too).
            let drafter = match named {
                None => Some(default_drafter),
                Some(Value::String(d)) if d == "none" => None,
                Some(Value::String(d)) => match DrafterKind::from_name(d) {
                    Some(kind) => Some(kind),
                    None => {
                        return Err(bad(format!(
                            "unknown drafter {d:?} (this server has \"ngram\", \"dflash\" and \"none\")"
                        )))
                    }
                },
                Some(x) => {
                    return Err(ApiError::invalid(
                        P,
                        format!("`speculative.drafter` must be a string, got {x}"),
                    )
                    .code("invalid_type"))
                }
            };
            let k = match opt_i64(o, "draft_max")? {
                None => default_k,
                Some(k) if (1..=15).contains(&k) => k as usize,
                Some(k) => {
                    return Err(bad(format!(
                        "`speculative.draft_max` must be in 1..=15, got {k}"
                    )))
                }
            };
            let Some(drafter) = drafter else {
                return Ok(None);
            };
            Speculate {
                drafter,
                draft_max: k,
            }
        }
        Some(x) => {
            return Err(ApiError::invalid(
                P,
                format!("`speculative` must be an object or a boolean, got {x}"),
            )
            .code("invalid_type"))
        }
    };
    if chosen.drafter == DrafterKind::Dflash && !cfg.dflash {
        return Err(bad(
            "`speculative.drafter` \"dflash\" needs a DFlash draft, and this server has none (start it with --draft PATH)".into(),
        ));
    }
    Ok(Some(chosen))
}

/// Sets the request's cancel flag when dropped (handler future or SSE stream gone).
pub struct CancelGuard(Arc<AtomicBool>);

impl Drop for CancelGuard {
    fn drop(&mut self) {
        self.0.store(true, Relaxed);
    }
}

/// A request in the engine's queue: one event channel per sample, one cancel flag for all.
pub(crate) struct Submitted {
    /// Sample `i`'s events.
    pub rxs: Vec<mpsc::UnboundedReceiver<Event>>,
    /// Cancels every sample when dropped.
    pub guard: CancelGuard,
    /// When the request times out.
    pub deadline: Instant,
}

pub(crate) fn submit(app: &App, p: &Params) -> Result<Submitted, ApiError> {
    if app.draining.load(Relaxed) {
        return Err(ApiError::shutting_down());
    }
    let cancel = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + app.cfg.request_timeout;
    let group_id = app.next_id();
    let guard = app
        .queue
        .lock()
        .map_err(|_| ApiError::engine("queue lock poisoned"))?;
    let Some(q) = guard.as_ref() else {
        return Err(ApiError::shutting_down());
    };
    // All samples are queued or none (a partial request would never complete).
    if q.capacity() < p.n {
        app.metrics.rejected_full.fetch_add(1, Relaxed);
        return Err(ApiError::queue_full());
    }
    let mut rxs = Vec::with_capacity(p.n);
    for index in 0..p.n {
        let (tx, rx) = mpsc::unbounded_channel();
        let req = GenRequest {
            prompt: p.prompt.clone(),
            max_tokens: p.max_tokens,
            sampling: p.sampling.clone(),
            seed: p.seed.wrapping_add(index as u64),
            stop: p.stop.clone(),
            deadline,
            cancel: cancel.clone(),
            events: tx,
            speculate: p.speculate,
            ignore_eos: false,
            logprobs: p.logprobs,
            prompt_logprobs: p.echo.is_some() && p.logprobs.is_some(),
            adjust: p.adjust.clone(),
            group: (p.n > 1).then_some(SampleGroup {
                id: group_id,
                index,
                count: p.n,
            }),
        };
        app.metrics.queue_depth.fetch_add(1, Relaxed);
        if let Err(e) = q.try_send(req) {
            app.metrics.queue_depth.fetch_sub(1, Relaxed);
            // The samples already queued end as cancelled.
            cancel.store(true, Relaxed);
            return Err(match e {
                mpsc::error::TrySendError::Full(_) => {
                    app.metrics.rejected_full.fetch_add(1, Relaxed);
                    ApiError::queue_full()
                }
                mpsc::error::TrySendError::Closed(_) => ApiError::shutting_down(),
            });
        }
        rxs.push(rx);
    }
    Ok(Submitted {
        rxs,
        guard: CancelGuard(cancel),
        deadline,
    })
}

async fn generate(
    app: Arc<App>,
    headers: HeaderMap,
    body: Body,
    kind: Kind,
) -> Result<Response, ApiError> {
    let v = read_json(&app, &headers, body).await?;
    let p = parse_params(&app, &v, kind)?;
    let sub = submit(&app, &p)?;
    let id = app.next_id();
    let shape = Shape {
        kind,
        id: match kind {
            Kind::Chat => format!("chatcmpl-{id:016x}"),
            _ => format!("cmpl-{id:016x}"),
        },
        created: unix_now(),
        model: app.codec.model_id().to_string(),
        include_usage: p.include_usage,
        prompt_len: p.prompt.len(),
        started: Instant::now(),
        codec: app.codec.clone(),
        logprobs: p.logprobs.is_some(),
        echo: p.echo,
    };
    let n = sub.rxs.len();
    if p.stream {
        Ok(sse_response(StreamState {
            events: merged(sub.rxs),
            _guard: sub.guard,
            shape,
            out: VecDeque::new(),
            first: vec![true; n],
            lp: vec![Vec::new(); n],
            open: n,
            completion: 0,
            ended: false,
            backstop: tokio::time::Instant::from_std(sub.deadline) + Duration::from_secs(5),
        }))
    } else {
        let mut outcomes = Vec::with_capacity(n);
        for rx in sub.rxs {
            outcomes.push(collect(rx, sub.deadline).await?);
        }
        drop(sub.guard);
        Ok(json_response(StatusCode::OK, &shape.whole(&outcomes)))
    }
}

/// `POST /v1/completions`.
pub async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    generate(app, headers, body, Kind::Completions)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(app, headers, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /completion` (llama.cpp server shape).
pub async fn llama_completion(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(app, headers, body, Kind::Llama)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v1/models`: the one model served, with its context length.
pub async fn models(State(app): State<Arc<App>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [{
            "id": app.codec.model_id(), "object": "model", "created": app.created, "owned_by": "xdna",
            "context_length": app.codec.context_len(),
        }]}),
    )
}

/// `GET /health`: 200 `{"status": "ok"}`, or 503 while shutting down.
pub async fn health(State(app): State<Arc<App>>) -> Response {
    if app.draining.load(Relaxed) {
        json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "shutting down"}),
        )
    } else {
        json_response(StatusCode::OK, &json!({"status": "ok"}))
    }
}

/// `GET /metrics`: the counters in Prometheus text format.
pub async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        app.metrics.render(),
    )
        .into_response()
}

async fn tokenize_inner(app: &App, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let v = read_json(app, &headers, body).await?;
    let content = match field(&v, "content") {
        Some(Value::String(s)) => s,
        Some(x) => {
            return Err(ApiError::invalid(
                "content",
                format!("`content` must be a string, got {x}"),
            )
            .code("invalid_type"))
        }
        None => {
            return Err(ApiError::invalid("content", "`content` is required")
                .code("missing_required_parameter"))
        }
    };
    let special = opt_bool(&v, "add_special")?.unwrap_or(false);
    let tokens = if special {
        app.codec.prompt_tokens(content, true)
    } else {
        app.codec.tokenize(content, false)
    }
    .map_err(|e| ApiError::invalid("content", e.to_string()))?;
    Ok(json_response(StatusCode::OK, &json!({"tokens": tokens})))
}

/// `POST /tokenize`: `{"content", "add_special"?}` → `{"tokens"}`.
pub async fn tokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    tokenize_inner(&app, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn detokenize_inner(app: &App, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let v = read_json(app, &headers, body).await?;
    let tokens = match field(&v, "tokens") {
        Some(Value::Array(a)) => token_list(&*app.codec, a, "tokens")?,
        Some(x) => {
            return Err(
                ApiError::invalid("tokens", format!("`tokens` must be an array, got {x}"))
                    .code("invalid_type"),
            )
        }
        None => {
            return Err(ApiError::invalid("tokens", "`tokens` is required")
                .code("missing_required_parameter"))
        }
    };
    Ok(json_response(
        StatusCode::OK,
        &json!({"content": app.codec.detokenize(&tokens)}),
    ))
}

/// `POST /detokenize`: `{"tokens"}` → `{"content"}`.
pub async fn detokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    detokenize_inner(&app, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Any other path: 404 in the OpenAI error shape.
pub async fn fallback(req: Request) -> Response {
    ApiError::not_found(req.uri().path()).into_response()
}
