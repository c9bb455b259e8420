//! `xdna`: the command-line front end of the xdna runtime.
//!
//! Each subcommand lives in its own module under `cmd/`; this file only parses and dispatches.

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "xdna",
    version,
    about = "AMD XDNA NPU runtime: device info, kernels, packages, generation, benchmarks"
)]
struct Cli {
    /// Log filter (e.g. `info`, `xdna=debug`; `xdna::status=off` hides the status lines); also
    /// RUST_LOG.
    #[arg(long, global = true, default_value = "warn", env = "XDNA_LOG")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show everything the NPU device reports.
    Info(cmd::info::Args),
    /// Build, list and wrap per-shape kernel ELF files.
    Kernels(cmd::kernels::Args),
    /// Import, inspect and synthesize model packages.
    Pack(cmd::pack::Args),
    /// Generate text from a model.
    Run(cmd::run::Args),
    /// Perplexity of a text file (llama-perplexity method).
    Perplexity(cmd::perplexity::Args),
    /// Benchmarks (table and --json).
    Bench(cmd::bench::Args),
    /// Tokens per round a drafter would yield on the target's greedy continuations.
    SpecAcceptance(cmd::spec_acceptance::Args),
    /// The target's greedy continuations of token-id prompts with its hidden states after
    /// chosen layers: training data for a DFlash draft (tools/dflash-train).
    GreedyTaps(cmd::greedy_taps::Args),
}

fn main() {
    let cli = Cli::parse();
    xdna::cli::init_logging(&cli.log, false);
    let result = match cli.command {
        Command::Info(args) => cmd::info::run(args),
        Command::Kernels(args) => cmd::kernels::run(args),
        Command::Pack(args) => cmd::pack::run(args),
        Command::Run(args) => cmd::run::run(args),
        Command::Perplexity(args) => cmd::perplexity::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::SpecAcceptance(args) => cmd::spec_acceptance::run(args),
        Command::GreedyTaps(args) => cmd::greedy_taps::run(args),
    };
    if let Err(err) = result {
        eprintln!("xdna: error: {err}");
        let mut source = std::error::Error::source(&err);
        while let Some(cause) = source {
            eprintln!("  caused by: {cause}");
            source = cause.source();
        }
        std::process::exit(1);
    }
}
