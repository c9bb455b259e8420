//! `xdna bench verify`: the cost of a verify pass of M = 1..=16 rows relative to one decode step
//! (a 1-row pass + commit), and the cost of `commit_verify_rows(n)` after a 16-row pass: keeping
//! the batch state (n = 16) vs restoring the snapshot and replaying n rows through the recurrent
//! layers. Every timed pass starts from a freshly prefilled sequence at the same position. Each
//! M's passes alternate with steps, and its ratio is taken to the steps timed beside it, so a
//! machine whose speed drifts between minutes (a shared last-level cache) moves both alike.

use std::time::Instant;
use xdna::cli::ModelArgs;
use xdna::model::load::open_model;
use xdna::model::{Model, ReplayMode, SequenceState, MAX_VERIFY_ROWS};

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model: ModelArgs,
    /// Timed repetitions per point (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Tokens prefilled before each timed pass.
    #[arg(long, default_value_t = 16)]
    prefix: usize,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// A fresh sequence with `prefix` committed.
fn fresh(model: &mut Model, prefix: &[u32], ctx: usize) -> xdna::Result<SequenceState> {
    let mut seq = model.new_sequence(ctx)?;
    model.prefill_sequence(&mut seq, prefix, usize::MAX, &mut |_, _| {})?;
    Ok(seq)
}

/// Seconds of (a pass of `m` rows, the commit of `n`) on a fresh sequence.
fn time_once(
    model: &mut Model,
    prefix: &[u32],
    drafts: &[u32],
    m: usize,
    n: usize,
    ctx: usize,
) -> xdna::Result<(f64, f64)> {
    let mut seq = fresh(model, prefix, ctx)?;
    let t0 = Instant::now();
    model.step_sequences(&mut [(&mut seq, &drafts[..m])])?;
    let t1 = Instant::now();
    model.commit_sequence(&mut seq, n)?;
    let t2 = Instant::now();
    Ok(((t1 - t0).as_secs_f64(), (t2 - t1).as_secs_f64()))
}

/// Median seconds of (pass of `m` rows, commit of `n`) over `runs` fresh sequences.
fn time_round(
    model: &mut Model,
    prefix: &[u32],
    drafts: &[u32],
    m: usize,
    n: usize,
    runs: usize,
    ctx: usize,
) -> xdna::Result<(f64, f64)> {
    let (mut pass, mut commit) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let (p, c) = time_once(model, prefix, drafts, m, n, ctx)?;
        pass.push(p);
        commit.push(c);
    }
    Ok((median(&mut pass), median(&mut commit)))
}

/// The passes of `m` rows (each with the commit of all `m`) and as many steps, in alternation:
/// medians of (step, pass, commit) seconds.
fn time_beside_steps(
    model: &mut Model,
    prefix: &[u32],
    drafts: &[u32],
    m: usize,
    runs: usize,
    ctx: usize,
    all_steps: &mut Vec<f64>,
) -> xdna::Result<(f64, f64, f64)> {
    let (mut steps, mut pass, mut commit) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let (sp, sc) = time_once(model, prefix, drafts, 1, 1, ctx)?;
        steps.push(sp + sc);
        let (p, c) = time_once(model, prefix, drafts, m, m, ctx)?;
        pass.push(p);
        commit.push(c);
    }
    all_steps.extend_from_slice(&steps);
    Ok((median(&mut steps), median(&mut pass), median(&mut commit)))
}

pub fn run(args: Args) -> xdna::Result<()> {
    let opts = args.model.load_options(false);
    let ctx = args.prefix.max(1) + MAX_VERIFY_ROWS + 1;
    let (pkg, mut model) = open_model(args.model.path.as_deref(), ctx, &opts)?;
    model.set_replay_mode(ReplayMode::default());
    let vocab = model.config().vocab;
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(16);
    let mut toks: Vec<u32> = pkg
        .tokenizer()
        .encode(&text, false)
        .into_iter()
        .map(|t| t % vocab as u32)
        .collect();
    toks.resize(args.prefix.max(1) + MAX_VERIFY_ROWS, 1);
    let (prefix, drafts) = toks.split_at(args.prefix.max(1));
    let runs = args.runs.max(1);
    // Warm-up (page in the weights, spin up the pool).
    time_round(&mut model, prefix, drafts, MAX_VERIFY_ROWS, 1, 1, ctx)?;
    let mut rows = Vec::new();
    let mut all_steps = Vec::new();
    for m in 1..=MAX_VERIFY_ROWS {
        let (step_here, p, c) =
            time_beside_steps(&mut model, prefix, drafts, m, runs, ctx, &mut all_steps)?;
        rows.push(serde_json::json!({
            "m": m, "pass_ms": p * 1e3, "commit_full_ms": c * 1e3,
            "step_ms": step_here * 1e3, "relative_to_step": p / step_here,
        }));
    }
    // The commits' costs are put against the median of every step timed above.
    let step = median(&mut all_steps);
    let mut commits = Vec::new();
    for n in 1..=MAX_VERIFY_ROWS {
        let (_, c) = time_round(&mut model, prefix, drafts, MAX_VERIFY_ROWS, n, runs, ctx)?;
        let how = if n == MAX_VERIFY_ROWS || !model.config().has_recurrent() {
            "keep"
        } else {
            "replay"
        };
        commits.push(serde_json::json!({
            "n": n, "path": how, "commit_ms": c * 1e3, "relative_to_step": c / step,
        }));
    }
    // Full acceptance forced through restore + replay of all 16 rows.
    model.set_replay_mode(ReplayMode {
        check: false,
        full_replay: true,
    });
    let (_, c16) = time_round(
        &mut model,
        prefix,
        drafts,
        MAX_VERIFY_ROWS,
        MAX_VERIFY_ROWS,
        runs,
        ctx,
    )?;
    let c = model.config();
    let kind = if c.has_recurrent() {
        "hybrid (Gated DeltaNet + attention)"
    } else {
        "attention only"
    };
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": pkg.dir().display().to_string(), "kind": kind, "layers": c.layers,
                "step_ms": step * 1e3, "rows": rows, "commits": commits,
                "commit_full_replay_16_ms": c16 * 1e3, "runs": runs, "prefix": prefix.len(),
                "threads": xdna::kernels::pool::Pool::global().threads(),
                "backend": model.weights().backend,
            })
        );
    } else {
        println!(
            "{} ({kind}, {} layers), step {:.3} ms (1-row pass + commit; median of all steps), \
             medians of {runs}; each M against the steps timed in alternation with it",
            pkg.dir().display(),
            c.layers,
            step * 1e3
        );
        println!(
            "{:>3} {:>10} {:>10} {:>10}",
            "M", "pass ms", "step ms", "× step"
        );
        for r in &rows {
            println!(
                "{:>3} {:>10.3} {:>10.3} {:>10.2}",
                r["m"],
                r["pass_ms"].as_f64().unwrap_or(0.0),
                r["step_ms"].as_f64().unwrap_or(0.0),
                r["relative_to_step"].as_f64().unwrap_or(0.0)
            );
        }
        println!("commit after a 16-row pass:");
        println!("{:>3} {:>7} {:>10} {:>10}", "n", "path", "ms", "× step");
        for r in &commits {
            println!(
                "{:>3} {:>7} {:>10.4} {:>10.3}",
                r["n"],
                r["path"].as_str().unwrap_or(""),
                r["commit_ms"].as_f64().unwrap_or(0.0),
                r["relative_to_step"].as_f64().unwrap_or(0.0)
            );
        }
        println!(
            "commit 16 with NPU_COMMIT_FULL_REPLAY: {:.4} ms ({:.3} × step)",
            c16 * 1e3,
            c16 / step
        );
    }
    Ok(())
}
