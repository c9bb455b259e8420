//! forward-serve: an OpenAI-compatible HTTP server over the xdna runtime.
//!
//! The `forward-serve` binary (`main.rs`) parses arguments and runs [`server::run`] (or
//! [`bench::run`]); the integration tests (`tests/`) drive the same modules directly.

#![warn(missing_docs)]

pub mod api;
pub mod bench;
pub mod engine;
pub mod error;
pub mod fake;
pub mod fields;
pub mod listen;
pub mod metrics;
pub mod ollama;
pub mod response;
pub mod scheduler;
pub mod server;
