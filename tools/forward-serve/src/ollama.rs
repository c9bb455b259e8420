//! Ollama's API: `POST /api/generate` and `POST /api/chat` (streamed as newline-delimited JSON
//! by default), `GET /api/tags`, `POST /api/show`, `GET /api/version`. Their option names map
//! onto the same sampler and queue as the OpenAI routes; errors are Ollama's `{"error": "..."}`.

use super::api::{self, App, Kind, Params};
use super::error::ApiError;
use super::scheduler::{Event, Finish};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Ollama's sampling defaults (its documented `options` defaults).
const DEFAULT_TEMPERATURE: f64 = 0.8;
const DEFAULT_TOP_K: i64 = 40;
const DEFAULT_TOP_P: f64 = 0.9;

/// Which Ollama route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Generate,
    Chat,
}

/// An error in Ollama's shape: the status and `{"error": message}`.
struct OllamaError(ApiError);

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> Self {
        OllamaError(e)
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        let e = self.0;
        let mut r = (
            e.status,
            json_headers(),
            json!({"error": e.message}).to_string(),
        )
            .into_response();
        if let Some(s) = e.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

fn json_headers() -> [(header::HeaderName, HeaderValue); 1] {
    [(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    )]
}

fn rfc3339_now() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// Top-level fields of each route and whether they are read; anything else is refused.
const GENERATE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "system",
    "raw",
    "stream",
    "options",
    "keep_alive",
    "suffix",
    "images",
    "format",
    "template",
    "context",
    "think",
];
const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "stream",
    "options",
    "keep_alive",
    "tools",
    "format",
    "think",
];

/// `options` keys read by the sampler, and the runtime knobs that change no output (threads,
/// GPU layers, batch size, memory mapping).
const SAMPLING_OPTIONS: &[&str] = &[
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "num_predict",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "num_ctx",
    "repeat_penalty",
    "repeat_last_n",
    "min_p",
    "typical_p",
];
const RUNTIME_OPTIONS: &[&str] = &[
    "num_keep",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "num_thread",
    "use_mmap",
    "use_mlock",
    "numa",
    "low_vram",
    "vocab_only",
];

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, msg).code("invalid_value")
}

fn present<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

/// Refuse unknown top-level fields, and those this server cannot honour when set.
fn check_fields(v: &Value, route: Route) -> Result<(), ApiError> {
    let known = match route {
        Route::Generate => GENERATE_FIELDS,
        Route::Chat => CHAT_FIELDS,
    };
    if let Some(obj) = v.as_object() {
        if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(bad(
                k,
                format!(
                    "unknown field `{k}`; this endpoint reads {}",
                    known.join(", ")
                ),
            ));
        }
    }
    let empty_or_absent = |key: &str| match present(v, key) {
        None => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(_) => false,
    };
    for (key, why) in [
        (
            "suffix",
            "insertion (text after the completion) is not supported",
        ),
        ("images", "this server reads text only"),
        ("format", "constrained (JSON) output is not supported"),
        ("template", "the model's own chat template is used"),
        (
            "context",
            "the `context` token list is not supported; send the conversation as messages",
        ),
        ("tools", "this server has no tool calling"),
    ] {
        if !empty_or_absent(key) {
            return Err(bad(key, format!("`{key}`: {why}")));
        }
    }
    if present(v, "think").is_some_and(|t| t.as_bool() != Some(false)) {
        return Err(bad(
            "think",
            "`think`: the served model has no thinking mode",
        ));
    }
    Ok(())
}

/// The OpenAI-shaped body the shared validation reads, from Ollama's `options`.
fn openai_body(v: &Value, route: Route, prompt: Value) -> Result<Value, ApiError> {
    let mut out = Map::new();
    let opts = match present(v, "options") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(x) => {
            return Err(bad(
                "options",
                format!("`options` must be an object, got {x}"),
            ))
        }
    };
    for k in opts.keys() {
        if !SAMPLING_OPTIONS.contains(&k.as_str()) && !RUNTIME_OPTIONS.contains(&k.as_str()) {
            return Err(bad(
                "options",
                format!(
                    "unknown option `{k}`; this server reads {}",
                    SAMPLING_OPTIONS.join(", ")
                ),
            ));
        }
    }
    let opt = |k: &str| opts.get(k).filter(|x| !x.is_null());
    // Options this sampler has no equivalent for are accepted only at their no-op values.
    for (k, neutral) in [("repeat_penalty", 1.0), ("min_p", 0.0), ("typical_p", 1.0)] {
        if let Some(x) = opt(k) {
            if x.as_f64() != Some(neutral) {
                return Err(bad(
                    "options",
                    format!(
                        "option `{k}` = {x} is not supported (only {neutral}, which does nothing)"
                    ),
                ));
            }
        }
    }
    out.insert(
        "temperature".into(),
        opt("temperature")
            .cloned()
            .unwrap_or(json!(DEFAULT_TEMPERATURE)),
    );
    out.insert(
        "top_k".into(),
        opt("top_k").cloned().unwrap_or(json!(DEFAULT_TOP_K)),
    );
    out.insert(
        "top_p".into(),
        opt("top_p").cloned().unwrap_or(json!(DEFAULT_TOP_P)),
    );
    for k in ["seed", "stop", "presence_penalty", "frequency_penalty"] {
        if let Some(x) = opt(k) {
            out.insert(k.into(), x.clone());
        }
    }
    // num_predict: −1 (the default) and −2 generate up to the context or the server's limit.
    if let Some(n) = opt("num_predict") {
        match n.as_i64() {
            Some(n) if n >= 1 => {
                out.insert("max_tokens".into(), json!(n));
            }
            Some(-1 | -2) => {}
            _ => {
                return Err(bad(
                    "options",
                    format!("option `num_predict` must be ≥ 1, −1 or −2, got {n}"),
                ))
            }
        }
    }
    match route {
        Route::Generate => out.insert("prompt".into(), prompt),
        Route::Chat => out.insert("messages".into(), prompt),
    };
    Ok(Value::Object(out))
}

/// `num_ctx`: a smaller context for this request (prompt and completion together); never
/// more than the server's.
fn num_ctx(v: &Value) -> Result<Option<usize>, ApiError> {
    let Some(n) = present(v, "options")
        .and_then(|o| o.get("num_ctx"))
        .filter(|x| !x.is_null())
    else {
        return Ok(None);
    };
    match n.as_u64() {
        Some(n) if n >= 1 => Ok(Some(n as usize)),
        _ => Err(bad(
            "options",
            format!("option `num_ctx` must be a positive integer, got {n}"),
        )),
    }
}

fn check_model(app: &App, v: &Value) -> Result<(), ApiError> {
    let Some(m) = present(v, "model") else {
        return Err(
            ApiError::invalid("model", "model is required").code("missing_required_parameter")
        );
    };
    let Some(m) = m.as_str() else {
        return Err(ApiError::invalid("model", "`model` must be a string").code("invalid_type"));
    };
    let id = app.codec.model_id();
    if m == id || m.strip_suffix(":latest") == Some(id) {
        Ok(())
    } else {
        let mut e = ApiError::model_not_found(m);
        e.message = format!("model '{m}' not found (this server has '{id}')");
        Err(e)
    }
}

/// The validated request, and what the response names.
struct Request {
    params: Params,
    route: Route,
}

fn parse(app: &App, v: &Value, route: Route) -> Result<Option<Request>, ApiError> {
    check_fields(v, route)?;
    check_model(app, v)?;
    let (body, kind) = match route {
        Route::Generate => {
            let prompt = match present(v, "prompt") {
                None => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(x) => {
                    return Err(bad("prompt", format!("`prompt` must be a string, got {x}")))
                }
            };
            if prompt.is_empty() {
                // Ollama answers an empty prompt by loading the model: nothing to generate.
                return Ok(None);
            }
            let raw = match present(v, "raw") {
                None => false,
                Some(x) => x
                    .as_bool()
                    .ok_or_else(|| bad("raw", "`raw` must be a boolean"))?,
            };
            let system = match present(v, "system") {
                None => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(x) => {
                    return Err(bad("system", format!("`system` must be a string, got {x}")))
                }
            };
            if raw {
                if system.is_some() {
                    return Err(bad("system", "`system` has no place in a raw prompt"));
                }
                (
                    openai_body(v, route, Value::String(prompt))?,
                    Kind::Completions,
                )
            } else {
                let mut msgs = Vec::new();
                if let Some(s) = system {
                    msgs.push(json!({"role": "system", "content": s}));
                }
                msgs.push(json!({"role": "user", "content": prompt}));
                (openai_body(v, Route::Chat, Value::Array(msgs))?, Kind::Chat)
            }
        }
        Route::Chat => {
            let msgs = present(v, "messages").cloned().unwrap_or(Value::Null);
            if let Some(arr) = msgs.as_array() {
                for (i, m) in arr.iter().enumerate() {
                    if m.get("images")
                        .is_some_and(|x| !x.is_null() && x.as_array().is_none_or(|a| !a.is_empty()))
                    {
                        return Err(bad(
                            &format!("messages[{i}]"),
                            "this server reads text only (`images`)",
                        ));
                    }
                }
            }
            (openai_body(v, route, msgs)?, Kind::Chat)
        }
    };
    let mut params = api::parse_params(app, &body, kind)?;
    if let Some(n) = num_ctx(v)? {
        if params.prompt.len() >= n {
            return Err(bad(
                "options",
                format!(
                    "the prompt has {} tokens; `num_ctx` {n} leaves no room",
                    params.prompt.len()
                ),
            ));
        }
        params.max_tokens = params.max_tokens.min(n - params.prompt.len());
    }
    params.stream = match present(v, "stream") {
        None => true,
        Some(x) => x
            .as_bool()
            .ok_or_else(|| bad("stream", "`stream` must be a boolean"))?,
    };
    Ok(Some(Request { params, route }))
}

/// Validate an `/api/generate` (`chat` false) or `/api/chat` body as the handlers do: the request
/// it makes, or `None` for a generate with an empty prompt (a model load), or the 4xx error.
pub fn validate(app: &App, v: &Value, chat: bool) -> Result<Option<Params>, ApiError> {
    let route = if chat { Route::Chat } else { Route::Generate };
    Ok(parse(app, v, route)?.map(|r| r.params))
}

/// What every line of an answer carries, and the final line's counters.
struct Reply {
    model: String,
    route: Route,
    started: Instant,
    prompt_tokens: usize,
}

impl Reply {
    fn line(&self, text: &str, done: bool) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("model".into(), json!(self.model));
        m.insert("created_at".into(), json!(rfc3339_now()));
        match self.route {
            Route::Generate => m.insert("response".into(), json!(text)),
            Route::Chat => m.insert(
                "message".into(),
                json!({"role": "assistant", "content": text}),
            ),
        };
        m.insert("done".into(), json!(done));
        m
    }
    fn last(&self, text: &str, finish: Finish, completion: usize, prompt_nanos: u64) -> Value {
        let mut m = self.line(text, true);
        let total = self.started.elapsed().as_nanos() as u64;
        m.insert("done_reason".into(), json!(finish.openai()));
        m.insert("total_duration".into(), json!(total));
        m.insert("load_duration".into(), json!(0));
        m.insert("prompt_eval_count".into(), json!(self.prompt_tokens));
        m.insert("prompt_eval_duration".into(), json!(prompt_nanos));
        m.insert("eval_count".into(), json!(completion));
        m.insert(
            "eval_duration".into(),
            json!(total.saturating_sub(prompt_nanos)),
        );
        Value::Object(m)
    }
}

async fn run(
    app: Arc<App>,
    headers: HeaderMap,
    body: Body,
    route: Route,
) -> Result<Response, OllamaError> {
    let v = api::read_json(&app, &headers, body).await?;
    let reply_model = present(&v, "model")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let Some(req) = parse(&app, &v, route)? else {
        let m = json!({"model": reply_model, "created_at": rfc3339_now(), "response": "", "done": true, "done_reason": "load"});
        return Ok((StatusCode::OK, json_headers(), m.to_string()).into_response());
    };
    let api::Submitted {
        rxs,
        guard,
        deadline,
    } = api::submit(&app, &req.params)?;
    let Some(mut rx) = rxs.into_iter().next() else {
        return Err(ApiError::engine("the request was not queued").into());
    };
    let reply = Reply {
        model: reply_model,
        route: req.route,
        started: Instant::now(),
        prompt_tokens: req.params.prompt.len(),
    };
    let backstop = tokio::time::Instant::from_std(deadline) + Duration::from_secs(5);
    if !req.params.stream {
        let mut text = String::new();
        let mut first_token = None;
        loop {
            let ev = match tokio::time::timeout_at(backstop, rx.recv()).await {
                Err(_) => return Err(ApiError::timeout().into()),
                Ok(None) => return Err(ApiError::engine("the engine dropped the request").into()),
                Ok(Some(ev)) => ev,
            };
            match ev {
                Event::Text(t) => {
                    first_token.get_or_insert(reply.started.elapsed());
                    text.push_str(&t);
                }
                Event::Logprobs(_) | Event::PromptLogprobs(_) => {}
                Event::Error(m) => return Err(ApiError::engine(m).into()),
                Event::Done {
                    finish,
                    completion_tokens,
                    ..
                } => {
                    drop(guard);
                    return match finish {
                        Finish::Timeout => Err(ApiError::timeout().into()),
                        Finish::Cancelled => Err(ApiError::shutting_down().into()),
                        _ => {
                            let pn = first_token.map_or(0, |d| d.as_nanos() as u64);
                            let body = reply.last(&text, finish, completion_tokens, pn);
                            Ok((StatusCode::OK, json_headers(), body.to_string()).into_response())
                        }
                    };
                }
            }
        }
    }
    struct Stream {
        rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
        _guard: api::CancelGuard,
        reply: Reply,
        first_token: Option<Duration>,
        ended: bool,
        backstop: tokio::time::Instant,
    }
    let st = Stream {
        rx,
        _guard: guard,
        reply,
        first_token: None,
        ended: false,
        backstop,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if st.ended {
                return None;
            }
            let ev = match tokio::time::timeout_at(st.backstop, st.rx.recv()).await {
                Ok(Some(ev)) => ev,
                Ok(None) => Event::Error("the engine dropped the request".into()),
                Err(_) => Event::Error("the request timed out".into()),
            };
            let line = match ev {
                Event::Text(t) => {
                    st.first_token.get_or_insert(st.reply.started.elapsed());
                    Value::Object(st.reply.line(&t, false))
                }
                Event::Logprobs(_) | Event::PromptLogprobs(_) => continue,
                Event::Error(m) => {
                    st.ended = true;
                    json!({"error": m})
                }
                Event::Done {
                    finish,
                    completion_tokens,
                    ..
                } => {
                    st.ended = true;
                    if finish == Finish::Timeout {
                        json!({"error": "the request timed out"})
                    } else {
                        let pn = st.first_token.map_or(0, |d| d.as_nanos() as u64);
                        st.reply.last("", finish, completion_tokens, pn)
                    }
                }
            };
            let bytes = Bytes::from(format!("{line}\n"));
            return Some((Ok::<Bytes, std::convert::Infallible>(bytes), st));
        }
    });
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    Ok(r)
}

/// `POST /api/generate`.
pub async fn generate(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    run(app, headers, body, Route::Generate)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /api/chat`.
pub async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    run(app, headers, body, Route::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn details(app: &App) -> Value {
    let d = app.codec.details();
    json!({
        "parent_model": "", "format": d.format, "family": d.family, "families": [d.family],
        "parameter_size": d.parameter_size, "quantization_level": d.quantization,
    })
}

/// `GET /api/tags`: the one served model.
pub async fn tags(State(app): State<Arc<App>>) -> Response {
    let d = app.codec.details();
    let id = app.codec.model_id();
    let body = json!({"models": [{
        "name": id, "model": id, "modified_at": humantime::format_rfc3339_seconds(d.modified).to_string(),
        "size": d.size_bytes, "digest": d.digest, "details": details(&app),
    }]});
    (StatusCode::OK, json_headers(), body.to_string()).into_response()
}

/// `POST /api/show`: `{"model"}` (or the older `{"name"}`) → template, details, model info.
pub async fn show(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    async fn inner(app: &App, headers: HeaderMap, body: Body) -> Result<Response, OllamaError> {
        let mut v = api::read_json(app, &headers, body).await?;
        if present(&v, "model").is_none() {
            if let Some(n) = present(&v, "name").cloned() {
                v["model"] = n;
            }
        }
        check_model(app, &v)?;
        let d = app.codec.details();
        let mut info = Map::new();
        info.insert("general.architecture".into(), json!(d.family));
        info.insert(
            format!("{}.context_length", d.family),
            json!(app.codec.context_len()),
        );
        let body = json!({
            "modelfile": "", "parameters": "", "template": d.chat_template.unwrap_or_default(),
            "details": details(app), "model_info": Value::Object(info),
            "modified_at": humantime::format_rfc3339_seconds(d.modified).to_string(),
            "capabilities": ["completion"],
        });
        Ok((StatusCode::OK, json_headers(), body.to_string()).into_response())
    }
    inner(&app, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `GET /api/version`.
pub async fn version() -> Response {
    let body = json!({"version": env!("CARGO_PKG_VERSION")});
    (StatusCode::OK, json_headers(), body.to_string()).into_response()
}
