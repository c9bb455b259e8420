//! xdna: a Rust NPU kernel-and-runtime stack over the Linux `amdxdna` driver.
//!
//! Layers (data flows down, errors flow up; see `docs/architecture.md`):
//! [`spec`] → [`model`] → {[`kernels`], [`weights`]} → [`device`] → [`ffi`].
//! [`tiles`] is the shared vocabulary of weight tile formats used by `kernels` and `weights`.
//! [`cli`] serves the binaries only: the argument groups they share and their log subscriber.
//!
//! # Where each concept lives
//!
//! - The model description (config.json or GGUF metadata, parsed once): [`weights::config`]
//!   ([`weights::ModelConfig`]). Packages, GGUF and Q4NX readers, the tokenizer: [`weights`].
//!   A package's chat template rendered over a conversation: [`weights::chat`]
//!   ([`weights::Package::render_chat`]). The Qwen3.5 value-head order, both directions:
//!   [`weights::value_heads`].
//! - Weight tile formats and their byte layouts: [`tiles`] (`docs/formats.md`).
//! - The row family of a pass (`m16` verify passes, `m128` prefill chunks):
//!   [`kernels::RowFamily`].
//! - Host GEMM, its SIMD kernels and the worker pool: [`kernels`] ([`kernels::HostExecutor`],
//!   [`kernels::pool`]). Attention over the KV cache: [`kernels::attention`]; SwiGLU and `exp`:
//!   [`kernels::activation`], [`kernels::fastexp`].
//! - Kernel ELF files and kernel sets: [`kernels::elf`], [`kernels::KernelSet`]
//!   (`docs/kernel-elf.md`); running them on the NPU: [`kernels::DeviceExecutor`].
//! - The forward pass and a sequence's state (KV cache, recurrent state), verify passes, commit
//!   and replay: [`model`] (its module docs map the parts; `docs/model.md`). Fault injection for
//!   tests is compiled only with the cargo feature `fault-injection`.
//! - Sampling (settings, logit processor, generator): [`model::sampling`].
//! - Speculative decoding (drafters, acceptance rule, the loop): [`spec`] (`docs/speculative.md`).
//! - The device layer (device, heap, buffers, contexts, commands): [`device`] (`docs/device.md`,
//!   `docs/protocol.md`); raw UAPI structs and ioctl numbers: [`ffi`].
//! - Errors: [`Error`], which wraps each layer's own.
//! - The argument groups the binaries share, and their log subscriber: [`cli`].
//! - The OpenAI-compatible server: the `forward-serve` crate in `tools/forward-serve`
//!   (`docs/serving.md`). The fake amdxdna device for tests: the `xdna-shim` crate in
//!   `tools/xdna-shim` (`docs/shim.md`).
//!
//! One token from `open_model` to the ioctl and back: `docs/life-of-a-token.md`.

// Unsafe code lives only in the modules whose job it is (FFI, the device layer, the SIMD kernels,
// file mappings), each allowing it with its reason; every block carries a `// SAFETY:` comment.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod cli;
pub mod device;
pub mod error;
pub mod ffi;
pub mod ggml;
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
