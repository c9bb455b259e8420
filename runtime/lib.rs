//! xdna: a Rust NPU kernel-and-runtime stack over the Linux `amdxdna` driver.
//!
//! Layers (data flows down, errors flow up; see `docs/architecture.md`):
//! `spec` → `model` → {`kernels`, `weights`} → `device` → `ffi`.
//! `tiles` is the shared vocabulary of weight tile formats used by `kernels` and `weights`.
//! `cli` serves the binaries only: the argument groups they share and their log subscriber.

pub mod cli;
pub mod device;
pub mod error;
pub mod ffi;
pub mod kernels;
pub mod model;
pub mod spec;
pub mod tiles;
pub mod weights;

pub use error::{Error, Result};

/// `tracing` target of the library's status events: what a command tells its user as it goes
/// (the backend chosen and why, where the weights went, download progress). The binaries show
/// them by default ([`cli::init_logging`]).
pub const STATUS_TARGET: &str = "xdna::status";
