//! forward-serve: an OpenAI-compatible HTTP server over the xdna runtime.
//!
//! The binary (`main.rs`) and the integration tests (`tests/serve_*.rs`) both include this module
//! tree with `#[path]`.

pub mod api;
pub mod bench;
pub mod engine;
pub mod error;
pub mod fake;
pub mod metrics;
pub mod scheduler;
pub mod server;
