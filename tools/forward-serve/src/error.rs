//! OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// An error answer of the API: its HTTP status, its JSON body's fields and an optional
/// `Retry-After`.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status of the response.
    pub status: StatusCode,
    /// `error.message`: what went wrong, for a person.
    pub message: String,
    /// `error.type` (e.g. `invalid_request_error`, `server_overloaded`).
    pub kind: &'static str,
    /// `error.param`: the request field at fault, if one is.
    pub param: Option<String>,
    /// `error.code`: a machine-readable reason (e.g. `invalid_value`, `queue_full`).
    pub code: Option<&'static str>,
    /// Seconds for the `Retry-After` header (overload and shutdown answers).
    pub retry_after: Option<u64>,
    /// Close the connection after this answer (the request's body was not read to its end).
    pub close: bool,
}

impl ApiError {
    /// An error with no `param`, `code` or `Retry-After`.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
            close: false,
        }
    }
    /// 400 invalid_request_error about `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        if !param.is_empty() {
            e.param = Some(param.to_string());
        }
        e
    }
    /// The same error with `error.code` set.
    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    /// 404 `model_not_found`: the request names a model this server does not serve.
    pub fn model_not_found(model: &str) -> Self {
        let mut e = ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist"),
        )
        .code("model_not_found");
        e.param = Some("model".into());
        e
    }
    /// 413 `request_too_large`: the body is over `limit` bytes.
    pub fn too_large(limit: usize) -> Self {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body over the limit of {limit} bytes"),
        )
        .code("request_too_large")
    }
    /// 408 `body_timeout`: the body did not arrive within `limit` of the headers; the connection
    /// is closed after the answer (what is left of the body is never read).
    pub fn body_timeout(limit: std::time::Duration) -> Self {
        let mut e = ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("the request body did not arrive within {limit:?}"),
        )
        .code("body_timeout");
        e.close = true;
        e
    }
    /// 503 `queue_full` (retry after 1 s): the request queue is at `--max-queue`.
    pub fn queue_full() -> Self {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_overloaded",
            "the request queue is full; retry later",
        )
        .code("queue_full");
        e.retry_after = Some(1);
        e
    }
    /// 503 `too_many_connections` (retry after 1 s): `--max-connections` are open; the
    /// connection is closed after the answer.
    pub fn too_many_connections() -> Self {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_overloaded",
            "too many open connections; retry shortly",
        )
        .code("too_many_connections");
        e.retry_after = Some(1);
        e.close = true;
        e
    }
    /// 503 `shutting_down` (retry after 5 s): the server is draining after SIGTERM/SIGINT.
    pub fn shutting_down() -> Self {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_overloaded",
            "the server is shutting down",
        )
        .code("shutting_down");
        e.retry_after = Some(5);
        e
    }
    /// 504 `timeout`: the request ran past `--request-timeout`.
    pub fn timeout() -> Self {
        ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout_error",
            "the request timed out",
        )
        .code("timeout")
    }
    /// 500 `engine_error`: the engine failed the request.
    pub fn engine(msg: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", msg).code("engine_error")
    }
    /// 404 `not_found`: no route for `path`.
    pub fn not_found(path: &str) -> Self {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no route {path}"),
        )
        .code("not_found")
    }

    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.kind,
            self.message
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (
            self.status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            self.body().to_string(),
        )
            .into_response();
        if self.close {
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}
