//! Answers of the generation routes: whole JSON bodies and server-sent event streams for every
//! sample of a request, with their log-probabilities in the OpenAI shapes.

use super::api::{CancelGuard, Kind};
use super::engine::TextCodec;
use super::error::ApiError;
use super::scheduler::{Event, Finish, LoggedToken};
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The outcome of a whole (non-streamed) generation.
pub(crate) struct Outcome {
    text: String,
    finish: Finish,
    completion_tokens: usize,
    eos: bool,
    stopped_word: bool,
    /// An echoed prompt's token log-probabilities.
    prompt_lp: Vec<LoggedToken>,
    /// The generated tokens' log-probabilities.
    lp: Vec<LoggedToken>,
}

pub(crate) async fn collect(
    mut rx: mpsc::UnboundedReceiver<Event>,
    deadline: Instant,
) -> Result<Outcome, ApiError> {
    let mut text = String::new();
    let (mut prompt_lp, mut lp) = (Vec::new(), Vec::new());
    // The engine enforces the deadline; this backstop covers an engine stuck in a pass.
    let backstop = tokio::time::Instant::from_std(deadline) + Duration::from_secs(5);
    loop {
        let ev = match tokio::time::timeout_at(backstop, rx.recv()).await {
            Err(_) => return Err(ApiError::timeout()),
            Ok(None) => return Err(ApiError::engine("the engine dropped the request")),
            Ok(Some(ev)) => ev,
        };
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::PromptLogprobs(v) => prompt_lp = v,
            Event::Logprobs(v) => lp.extend(v),
            Event::Error(m) => return Err(ApiError::engine(m)),
            Event::Done {
                finish,
                completion_tokens,
                eos,
                stopped_word,
                ..
            } => {
                return match finish {
                    Finish::Timeout => Err(ApiError::timeout()),
                    Finish::Cancelled => Err(ApiError::shutting_down()),
                    _ => Ok(Outcome {
                        text,
                        finish,
                        completion_tokens,
                        eos,
                        stopped_word,
                        prompt_lp,
                        lp,
                    }),
                }
            }
        }
    }
}

pub(crate) fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// A log-probability as JSON: −∞ (a token the row gives no mass) as −9999, as vLLM reports it.
fn lp_json(lp: f32) -> Value {
    json!(if lp.is_finite() { lp } else { -9999.0 })
}

/// The OpenAI completions `logprobs` object of `entries` (text offsets moved by `base`): the
/// sampled (or prompt) token is always among `top_logprobs`, as OpenAI and vLLM report it.
fn completion_logprobs(codec: &dyn TextCodec, entries: &[LoggedToken], base: usize) -> Value {
    let text = |t: u32| String::from_utf8_lossy(&codec.token_bytes(t)).into_owned();
    let mut tokens = Vec::with_capacity(entries.len());
    let mut token_logprobs = Vec::with_capacity(entries.len());
    let mut top_logprobs = Vec::with_capacity(entries.len());
    let mut text_offset = Vec::with_capacity(entries.len());
    for e in entries {
        tokens.push(Value::String(text(e.lp.token)));
        text_offset.push(json!(base + e.offset));
        match e.lp.logprob {
            None => {
                token_logprobs.push(Value::Null);
                top_logprobs.push(Value::Null);
            }
            Some(lp) => {
                token_logprobs.push(lp_json(lp));
                let mut top = serde_json::Map::new();
                for &(t, l) in e.lp.top.iter().chain(std::iter::once(&(e.lp.token, lp))) {
                    // Two tokens may print alike (partial UTF-8); the likelier one keeps the key.
                    top.entry(text(t)).or_insert_with(|| lp_json(l));
                }
                top_logprobs.push(Value::Object(top));
            }
        }
    }
    json!({
        "tokens": tokens, "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs, "text_offset": text_offset,
    })
}

/// The OpenAI chat `logprobs` object of `entries`.
fn chat_logprobs(codec: &dyn TextCodec, entries: &[LoggedToken]) -> Value {
    let item = |t: u32, lp: f32| {
        let bytes = codec.token_bytes(t);
        json!({
            "token": String::from_utf8_lossy(&bytes), "logprob": lp_json(lp), "bytes": bytes,
        })
    };
    // The content's tokens only: the EOS that ended it is not part of the message.
    let content: Vec<Value> = entries
        .iter()
        .filter(|e| !codec.eos_ids().contains(&e.lp.token))
        .map(|e| {
            let lp = e.lp.logprob.unwrap_or(0.0);
            let mut v = item(e.lp.token, lp);
            v["top_logprobs"] = e.lp.top.iter().map(|&(t, l)| item(t, l)).collect();
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Build one streamed chunk's JSON.
pub(crate) struct Shape {
    pub(crate) kind: Kind,
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) include_usage: bool,
    pub(crate) prompt_len: usize,
    pub(crate) started: Instant,
    pub(crate) codec: Arc<dyn TextCodec>,
    /// Log-probabilities were asked for.
    pub(crate) logprobs: bool,
    /// `echo`: the prompt's text.
    pub(crate) echo: Option<String>,
}

impl Shape {
    /// Characters of the echoed prompt (where the completion's text offsets start).
    fn echo_chars(&self) -> usize {
        self.echo.as_ref().map_or(0, |e| e.chars().count())
    }
    fn chunk_logprobs(&self, entries: &[LoggedToken], base: usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => chat_logprobs(&*self.codec, entries),
            _ => completion_logprobs(&*self.codec, entries, base),
        }
    }
    /// A chunk carrying one choice.
    fn chunk(&self, choice: Value) -> Value {
        let object = if self.kind == Kind::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice]
        })
    }
    /// Choice `index`'s piece of generated text with the log-probabilities of its tokens.
    fn text_chunk(&self, index: usize, text: &str, first: bool, entries: &[LoggedToken]) -> Value {
        let logprobs = self.chunk_logprobs(entries, self.echo_chars());
        match self.kind {
            Kind::Completions => self.chunk(json!({
                "index": index, "text": text, "logprobs": logprobs, "finish_reason": null
            })),
            Kind::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                self.chunk(json!({
                    "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null
                }))
            }
            Kind::Llama => json!({"content": text, "stop": false}),
        }
    }
    /// The echoed prompt as choice `index`'s first chunk (with its tokens' log-probabilities).
    fn echo_chunk(&self, index: usize, prompt_lp: &[LoggedToken]) -> Option<Value> {
        let text = self.echo.as_deref()?;
        Some(self.chunk(json!({
            "index": index, "text": text, "logprobs": self.chunk_logprobs(prompt_lp, 0),
            "finish_reason": null
        })))
    }
    /// Choice `index`'s last chunk (OpenAI routes).
    fn finish_chunk(&self, index: usize, finish: Finish) -> Value {
        let fr = finish.openai();
        match self.kind {
            Kind::Chat => self.chunk(json!({
                "index": index, "delta": {}, "logprobs": null, "finish_reason": fr
            })),
            _ => self.chunk(json!({
                "index": index, "text": "", "logprobs": null, "finish_reason": fr
            })),
        }
    }
    /// The stream's usage chunk, when asked for (`stream_options.include_usage`).
    fn usage_chunk(&self, completion: usize) -> Option<Value> {
        self.include_usage.then(|| {
            let mut c = self.chunk(Value::Null);
            c["choices"] = json!([]);
            c["usage"] = usage(self.prompt_len, completion);
            c
        })
    }
    fn llama_final(
        &self,
        content: &str,
        finish: Finish,
        completion: usize,
        eos: bool,
        stopped_word: bool,
    ) -> Value {
        let secs = self.started.elapsed().as_secs_f64();
        json!({
            "content": content,
            "stop": true,
            "model": self.model,
            "tokens_predicted": completion,
            "tokens_evaluated": self.prompt_len,
            "stopped_eos": eos,
            "stopped_word": stopped_word,
            "stopped_limit": finish == Finish::Length,
            "truncated": false,
            "timings": {
                "prompt_n": self.prompt_len,
                "predicted_n": completion,
                "predicted_per_second": if secs > 0.0 { completion as f64 / secs } else { 0.0 },
            }
        })
    }
    /// One choice of a whole (non-streamed) answer.
    fn whole_choice(&self, index: usize, o: &Outcome) -> Value {
        let fr = o.finish.openai();
        match self.kind {
            Kind::Chat => json!({
                "index": index, "message": {"role": "assistant", "content": o.text},
                "logprobs": self.chunk_logprobs(&o.lp, 0), "finish_reason": fr
            }),
            _ => {
                let text = match &self.echo {
                    Some(prompt) => format!("{prompt}{}", o.text),
                    None => o.text.clone(),
                };
                let logprobs = if self.logprobs {
                    let mut all = completion_logprobs(&*self.codec, &o.prompt_lp, 0);
                    let gen = completion_logprobs(&*self.codec, &o.lp, self.echo_chars());
                    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                        if let (Some(a), Some(b)) = (all[key].as_array_mut(), gen[key].as_array()) {
                            a.extend(b.iter().cloned());
                        }
                    }
                    all
                } else {
                    Value::Null
                };
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": fr})
            }
        }
    }
    /// The whole answer of every sample.
    pub(crate) fn whole(&self, outcomes: &[Outcome]) -> Value {
        if let (Kind::Llama, Some(o)) = (self.kind, outcomes.first()) {
            return self.llama_final(
                &o.text,
                o.finish,
                o.completion_tokens,
                o.eos,
                o.stopped_word,
            );
        }
        let object = if self.kind == Kind::Chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        let choices: Vec<Value> = outcomes
            .iter()
            .enumerate()
            .map(|(i, o)| self.whole_choice(i, o))
            .collect();
        let completion = outcomes.iter().map(|o| o.completion_tokens).sum();
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choices, "usage": usage(self.prompt_len, completion)
        })
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// Every sample's events in one stream, tagged with the sample's index.
pub(crate) type Events = std::pin::Pin<Box<dyn futures_util::Stream<Item = (usize, Event)> + Send>>;

pub(crate) fn merged(rxs: Vec<mpsc::UnboundedReceiver<Event>>) -> Events {
    use futures_util::StreamExt;
    let streams = rxs.into_iter().enumerate().map(|(i, rx)| {
        futures_util::stream::unfold(rx, move |mut rx| async move {
            rx.recv().await.map(|e| ((i, e), rx))
        })
        .boxed()
    });
    Box::pin(futures_util::stream::select_all(streams))
}

pub(crate) struct StreamState {
    pub(crate) events: Events,
    pub(crate) _guard: CancelGuard,
    pub(crate) shape: Shape,
    pub(crate) out: VecDeque<Bytes>,
    /// Per choice: nothing sent yet (chat announces the role in its first delta).
    pub(crate) first: Vec<bool>,
    /// Per choice: log-probabilities of the tokens its next text chunk carries.
    pub(crate) lp: Vec<Vec<LoggedToken>>,
    /// Choices not finished yet.
    pub(crate) open: usize,
    pub(crate) completion: usize,
    pub(crate) ended: bool,
    pub(crate) backstop: tokio::time::Instant,
}

impl StreamState {
    fn event(&mut self, i: usize, ev: Event) {
        let done_marker = self.shape.kind != Kind::Llama;
        match ev {
            Event::PromptLogprobs(v) => {
                if let Some(c) = self.shape.echo_chunk(i, &v) {
                    self.out.push_back(sse(&c));
                }
            }
            Event::Logprobs(v) => self.lp[i].extend(v),
            Event::Text(t) => {
                let c = self.shape.text_chunk(i, &t, self.first[i], &self.lp[i]);
                self.lp[i].clear();
                self.first[i] = false;
                self.out.push_back(sse(&c));
            }
            Event::Error(m) => {
                self.ended = true;
                self.out.push_back(sse(&ApiError::engine(m).body()));
                if done_marker {
                    self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                }
            }
            Event::Done {
                finish,
                completion_tokens,
                eos,
                stopped_word,
                ..
            } => {
                if finish == Finish::Timeout {
                    self.ended = true;
                    self.out.push_back(sse(&ApiError::timeout().body()));
                    if done_marker {
                        self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    }
                    return;
                }
                if self.shape.kind == Kind::Llama {
                    self.ended = true;
                    let last =
                        self.shape
                            .llama_final("", finish, completion_tokens, eos, stopped_word);
                    self.out.push_back(sse(&last));
                    return;
                }
                if (self.first[i] && self.shape.kind == Kind::Chat) || !self.lp[i].is_empty() {
                    // The role is announced once; tokens with no text of their own still
                    // report their log-probabilities.
                    let c = self.shape.text_chunk(i, "", self.first[i], &self.lp[i]);
                    self.lp[i].clear();
                    self.out.push_back(sse(&c));
                }
                self.out.push_back(sse(&self.shape.finish_chunk(i, finish)));
                self.completion += completion_tokens;
                self.open = self.open.saturating_sub(1);
                if self.open == 0 {
                    self.ended = true;
                    if let Some(u) = self.shape.usage_chunk(self.completion) {
                        self.out.push_back(sse(&u));
                    }
                    self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                }
            }
        }
    }
}

pub(crate) fn sse_response(mut s: StreamState) -> Response {
    if !s.shape.logprobs {
        // Without log-probabilities the echoed prompt needs nothing from the engine.
        for i in 0..s.open {
            if let Some(c) = s.shape.echo_chunk(i, &[]) {
                s.out.push_back(sse(&c));
            }
        }
    }
    let stream = futures_util::stream::unfold(s, |mut st| async move {
        use futures_util::StreamExt;
        loop {
            if let Some(b) = st.out.pop_front() {
                return Some((Ok::<Bytes, std::convert::Infallible>(b), st));
            }
            if st.ended {
                return None;
            }
            let (i, ev) = match tokio::time::timeout_at(st.backstop, st.events.next()).await {
                Ok(Some(x)) => x,
                Ok(None) => (0, Event::Error("the engine dropped the request".into())),
                Err(_) => (0, Event::Error("the request timed out".into())),
            };
            st.event(i, ev);
        }
    });
    let mut r = Response::new(Body::from_stream(stream));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}
