//! Every request field each generation route knows, and what happens to it. A field not listed
//! is refused with a 400 naming it, so nothing a client sends is dropped without a word;
//! `docs/serving.md` shows the same table (a test keeps the two equal).

use super::api::Kind;
use super::error::ApiError;
use serde_json::Value;

/// What a route does with a field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Read and honoured.
    Honoured,
    /// Accepted: it labels or identifies the request and by definition changes no output.
    Label,
    /// Accepted at its no-op value (e.g. `n: 1`, `response_format: {"type": "text"}`); any other
    /// value gets a 400 naming the field.
    DefaultOnly,
    /// Refused with a 400 whenever present (and not null), with this reason.
    Refused(&'static str),
}

/// One field of a route.
pub type Field = (&'static str, Use);

use Use::{DefaultOnly, Honoured, Label, Refused};

const NO_TOOLS: &str = "this server has no tool or function calling";

/// `POST /v1/completions`.
pub const COMPLETIONS: &[Field] = &[
    ("model", Honoured),
    ("prompt", Honoured),
    ("max_tokens", Honoured),
    ("temperature", Honoured),
    ("top_p", Honoured),
    ("top_k", Honoured),
    ("seed", Honoured),
    ("stop", Honoured),
    ("stream", Honoured),
    ("stream_options", Honoured),
    ("echo", Honoured),
    ("logprobs", Honoured),
    ("logit_bias", Honoured),
    ("presence_penalty", Honoured),
    ("frequency_penalty", Honoured),
    ("speculative", Honoured),
    ("n", Honoured),
    ("best_of", DefaultOnly),
    ("suffix", DefaultOnly),
    ("user", Label),
];

/// `POST /v1/chat/completions`.
pub const CHAT: &[Field] = &[
    ("model", Honoured),
    ("messages", Honoured),
    ("max_tokens", Honoured),
    ("max_completion_tokens", Honoured),
    ("temperature", Honoured),
    ("top_p", Honoured),
    ("top_k", Honoured),
    ("seed", Honoured),
    ("stop", Honoured),
    ("stream", Honoured),
    ("stream_options", Honoured),
    ("logprobs", Honoured),
    ("top_logprobs", Honoured),
    ("logit_bias", Honoured),
    ("presence_penalty", Honoured),
    ("frequency_penalty", Honoured),
    ("speculative", Honoured),
    ("n", Honoured),
    ("response_format", DefaultOnly),
    ("tools", DefaultOnly),
    ("tool_choice", DefaultOnly),
    ("functions", DefaultOnly),
    ("function_call", DefaultOnly),
    ("parallel_tool_calls", DefaultOnly),
    ("modalities", DefaultOnly),
    ("store", DefaultOnly),
    ("service_tier", DefaultOnly),
    ("user", Label),
    ("metadata", Label),
    ("prompt_cache_key", Label),
    ("safety_identifier", Label),
    ("audio", Refused("this server generates text only")),
    (
        "prediction",
        Refused("predicted outputs are not supported (use `speculative` for drafting)"),
    ),
    (
        "reasoning_effort",
        Refused("the served model has no reasoning-effort setting"),
    ),
    (
        "web_search_options",
        Refused("this server has no web search"),
    ),
    (
        "verbosity",
        Refused("the served model has no verbosity setting"),
    ),
];

/// `POST /completion` (llama.cpp server).
pub const LLAMA: &[Field] = &[
    ("prompt", Honoured),
    ("n_predict", Honoured),
    ("temperature", Honoured),
    ("top_k", Honoured),
    ("top_p", Honoured),
    ("seed", Honoured),
    ("stop", Honoured),
    ("stream", Honoured),
    ("speculative", Honoured),
    // A hint to reuse cached state; the output is the same either way.
    ("cache_prompt", Label),
];

/// The fields of a route.
pub fn of(kind: Kind) -> &'static [Field] {
    match kind {
        Kind::Completions => COMPLETIONS,
        Kind::Chat => CHAT,
        Kind::Llama => LLAMA,
    }
}

/// Refuse a body naming a field the route does not know, or one it refuses outright.
pub fn check(v: &Value, kind: Kind) -> Result<(), ApiError> {
    let Some(obj) = v.as_object() else {
        return Ok(());
    };
    let table = of(kind);
    for (key, value) in obj {
        match table.iter().find(|(name, _)| name == key) {
            None => {
                let known: Vec<&str> = table.iter().map(|(n, _)| *n).collect();
                return Err(ApiError::invalid(
                    key,
                    format!(
                        "unknown field `{key}`; this endpoint reads {}",
                        known.join(", ")
                    ),
                )
                .code("unknown_parameter"));
            }
            Some((_, Refused(why))) if !value.is_null() => {
                return Err(
                    ApiError::invalid(key, format!("`{key}`: {why}")).code("unsupported_parameter")
                );
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Checks of the [`Use::DefaultOnly`] fields of the OpenAI routes: each must be absent, null or
/// its no-op value.
pub fn check_defaults(v: &Value, kind: Kind) -> Result<(), ApiError> {
    let unsupported = |key: &str, why: &str| {
        Err(ApiError::invalid(key, format!("`{key}`: {why}")).code("unsupported_parameter"))
    };
    let get = |key: &str| v.get(key).filter(|x| !x.is_null());
    if kind == Kind::Completions {
        // `best_of` (equal to `n` only) is checked with `n`.
        if let Some(x) = get("suffix") {
            if x.as_str() != Some("") {
                return unsupported(
                    "suffix",
                    "insertion (text after the completion) is not supported",
                );
            }
        }
        return Ok(());
    }
    if kind != Kind::Chat {
        return Ok(());
    }
    if let Some(x) = get("response_format") {
        if x.get("type").and_then(Value::as_str) != Some("text") {
            return unsupported(
                "response_format",
                "only {\"type\": \"text\"} is supported (no constrained JSON output)",
            );
        }
    }
    for key in ["tools", "functions"] {
        if let Some(x) = get(key) {
            if !x.as_array().is_some_and(Vec::is_empty) {
                return unsupported(key, NO_TOOLS);
            }
        }
    }
    for key in ["tool_choice", "function_call"] {
        if let Some(x) = get(key) {
            if !matches!(x.as_str(), Some("none" | "auto")) {
                return unsupported(key, NO_TOOLS);
            }
        }
    }
    if let Some(x) = get("parallel_tool_calls") {
        if !x.is_boolean() {
            return Err(ApiError::invalid(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean",
            )
            .code("invalid_type"));
        }
    }
    if let Some(x) = get("modalities") {
        let text_only = x
            .as_array()
            .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text")));
        if !text_only {
            return unsupported("modalities", "this server generates text only");
        }
    }
    if let Some(x) = get("store") {
        if x.as_bool() != Some(false) {
            return unsupported("store", "this server stores no completions");
        }
    }
    if let Some(x) = get("service_tier") {
        if !matches!(x.as_str(), Some("auto" | "default")) {
            return unsupported("service_tier", "this server has one tier: \"default\"");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_field_is_listed_twice() {
        for kind in [Kind::Completions, Kind::Chat, Kind::Llama] {
            let t = of(kind);
            for (i, (a, _)) in t.iter().enumerate() {
                assert!(t[i + 1..].iter().all(|(b, _)| a != b), "{a} twice");
            }
        }
    }
}
