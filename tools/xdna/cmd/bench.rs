//! `xdna bench ...`: benchmarks that print a table, or JSON with `--json`.

use clap::Subcommand;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    which: Which,
}

#[derive(Subcommand)]
enum Which {
    /// GEMM kernels on the model's shapes, against measured read bandwidth.
    Gemm(super::bench_gemm::Args),
    /// Prefill and decode speed against the memory limit.
    Decode(super::bench_decode::Args),
    /// Plain vs speculative greedy decoding over a built-in prompt set.
    Spec(super::bench_spec::Args),
    /// Peak RSS of loading a model (and generating a few tokens) against its weight bytes.
    Load(super::bench_load::Args),
    /// Verify-pass cost for M = 1..16 rows vs one step, and commit cost (keep vs replay).
    ///
    /// A synthetic hybrid model to measure comes from `xdna pack synth --arch qwen3_5 -o DIR`.
    Verify(super::bench_verify::Args),
}

pub fn run(args: Args) -> xdna::Result<()> {
    match args.which {
        Which::Gemm(a) => super::bench_gemm::run(a),
        Which::Decode(a) => super::bench_decode::run(a),
        Which::Spec(a) => super::bench_spec::run(a),
        Which::Load(a) => super::bench_load::run(a),
        Which::Verify(a) => super::bench_verify::run(a),
    }
}
