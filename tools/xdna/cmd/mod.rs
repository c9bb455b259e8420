//! Subcommands of `xdna`, one module each.

pub mod bench;
pub mod bench_decode;
pub mod bench_gemm;
pub mod bench_load;
pub mod bench_spec;
pub mod bench_verify;
pub mod greedy_taps;
pub mod info;
pub mod kernels;
pub mod pack;
pub mod perplexity;
pub mod run;
pub mod spec_acceptance;
pub mod spec_common;
