//! `replay-check`: verify that a batched verify pass + partial commit leaves exactly the state of
//! plain sequential steps, for every pass size M = 1..=16 and acceptance n = 1..=M (see
//! `runtime/model/replay_check.rs` and `docs/model.md`). Exit 0 on pass, 1 on a difference beyond
//! the tolerance, 2 on errors.

use clap::Parser;
use std::sync::Arc;
use xdna::cli::ModelArgs;
use xdna::model::load::{load, open_package};
use xdna::model::replay_check::{self, ReplayCheckOptions};
#[cfg(feature = "fault-injection")]
use xdna::model::CommitFault;
use xdna::model::ReplayMode;

#[derive(Parser)]
#[command(
    name = "replay-check",
    about = "Compare verify-pass + commit against sequential steps (KV, conv and recurrent state, next logits)"
)]
struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Token ids, comma-separated (default: a seeded random stream).
    #[arg(long)]
    tokens: Option<String>,
    /// Seed of the random stream.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Tokens prefilled before the verify passes.
    #[arg(long, default_value_t = 6)]
    prefix: usize,
    /// Largest pass size.
    #[arg(long, default_value_t = 16)]
    max_m: usize,
    /// Commit mode: env (from NPU_REPLAY_CHECK / NPU_COMMIT_FULL_REPLAY), keep (batch state on
    /// full acceptance), check (also replay and compare), full (always restore + replay).
    #[arg(long, default_value = "env")]
    mode: String,
    /// Largest accepted difference relative to the compared quantity's magnitude.
    #[arg(long, default_value_t = 1e-3)]
    tolerance: f32,
    /// Use exact projections (f32 activations, f64 sums).
    #[arg(long)]
    exact: bool,
    /// Deliberately break the commit (replay-fewer | keep-batch) to see the check fail (needs a
    /// build with the `fault-injection` feature).
    #[arg(long, hide = true)]
    fault: Option<String>,
    #[arg(long)]
    json: bool,
}

fn main() {
    let a = Args::parse();
    xdna::cli::init_logging("warn", false);
    match run(&a) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("replay-check: {e}");
            std::process::exit(2);
        }
    }
}

fn run(a: &Args) -> Result<bool, String> {
    #[cfg(feature = "fault-injection")]
    let fault = parse_fault(a.fault.as_deref())?;
    #[cfg(not(feature = "fault-injection"))]
    if let Some(f) = &a.fault {
        return Err(format!(
            "--fault {f:?}: this replay-check was built without the `fault-injection` feature \
             (rebuild with `--features fault-injection`)"
        ));
    }
    let path = match &a.model.path {
        Some(p) => p.clone(),
        None => xdna::weights::default_model().map_err(|e| e.to_string())?,
    };
    let pkg = open_package(&path).map_err(|e| e.to_string())?;
    let opts = a.model.load_options(a.exact);
    let w = Arc::new(load(&pkg, &opts).map_err(|e| e.to_string())?);
    let vocab = w.config.vocab as u64;
    let need = a.prefix + a.max_m.clamp(1, 16) + 1;
    let tokens: Vec<u32> = match &a.tokens {
        Some(t) => t
            .split(',')
            .map(|s| {
                s.trim()
                    .parse::<u32>()
                    .map_err(|e| format!("--tokens: {s:?}: {e}"))
            })
            .collect::<Result<_, _>>()?,
        None => {
            let mut rng = xdna::model::sampling::Rng::new(a.seed);
            (0..need).map(|_| (rng.next_u64() % vocab) as u32).collect()
        }
    };
    let mode = match a.mode.as_str() {
        "env" => ReplayMode::from_env(),
        "keep" => ReplayMode::default(),
        "check" => ReplayMode {
            check: true,
            full_replay: false,
        },
        "full" => ReplayMode {
            check: false,
            full_replay: true,
        },
        m => return Err(format!("--mode {m:?}: expected env, keep, check or full")),
    };
    let report = replay_check::run(
        w,
        &ReplayCheckOptions {
            tokens,
            prefix: a.prefix,
            max_m: a.max_m,
            mode,
            #[cfg(feature = "fault-injection")]
            fault,
            tolerance: a.tolerance,
        },
    )
    .map_err(|e| e.to_string())?;
    if a.json {
        let v = serde_json::json!({
            "model": path.display().to_string(),
            "mode": a.mode,
            "replay_check": mode.check,
            "full_replay": mode.full_replay,
            "verdict": report.verdict,
            "cases": report.cases,
            "tolerance": report.tolerance,
            "logits_abs": report.logits_abs,
            "logits_rel": report.logits_rel,
            "layers": report.layers,
        });
        println!("{v}");
    } else {
        println!(
            "{}: {} cases (M = 1..={}, n = 1..=M), mode {}, tolerance {:e} (relative)",
            path.display(),
            report.cases,
            a.max_m,
            a.mode,
            report.tolerance
        );
        println!(
            "{:>5} {:>16} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8}",
            "layer",
            "kind",
            "kv_abs",
            "kv_rel",
            "conv_abs",
            "conv_rel",
            "rec_abs",
            "rec_rel",
            "worst"
        );
        for r in &report.layers {
            println!(
                "{:>5} {:>16} {:>10.3e} {:>10.3e} {:>10.3e} {:>10.3e} {:>10.3e} {:>10.3e} {:>8}",
                r.layer,
                r.kind,
                r.kv_abs,
                r.kv_rel,
                r.conv_abs,
                r.conv_rel,
                r.recurrent_abs,
                r.recurrent_rel,
                format!("{}/{}", r.worst_m, r.worst_n)
            );
        }
        println!(
            "next logits: max |Δ| {:.3e}, relative {:.3e}",
            report.logits_abs, report.logits_rel
        );
        println!("verdict: {}", report.verdict);
    }
    Ok(report.passed())
}

/// The `--fault` negative control: which commit to break.
#[cfg(feature = "fault-injection")]
fn parse_fault(fault: Option<&str>) -> Result<Option<CommitFault>, String> {
    match fault {
        None => Ok(None),
        Some("replay-fewer") => Ok(Some(CommitFault::ReplayOneFewer)),
        Some("keep-batch") => Ok(Some(CommitFault::KeepBatchState)),
        Some(f) => Err(format!(
            "--fault {f:?}: expected replay-fewer or keep-batch"
        )),
    }
}
