//! `xdna bench decode`: prefill and greedy decode speed against the memory-bandwidth limit.
//!
//! The machines this runs on are shared: their read bandwidth drifts by a quarter within minutes.
//! So every run is paired with its own bandwidth probe, taken just before it, and the fraction of
//! the limit is the median of the runs' own fractions (decode tok/s over that run's limit), not
//! one run's speed over another moment's bandwidth.
//!
//! With `--streams N` (2..=16) every run decodes N sequences at once, one row each per batched
//! pass (the server's decode step): the time split is then per pass, and the fraction of the limit
//! compares passes per second with one weight sweep at the probe's bandwidth.

use std::time::Instant;
use xdna::cli::ModelArgs;
use xdna::model::load::open_model;
use xdna::model::sampling::argmax;
use xdna::model::{Model, SequenceState, MAX_VERIFY_ROWS};

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model: ModelArgs,
    /// Runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Prompt tokens to prefill.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens to decode per run.
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// MiB streamed by each run's bandwidth probe (best of 3 passes).
    #[arg(long, default_value_t = 512)]
    probe_mib: usize,
    /// Sequences decoded at once, one row each per batched pass (1..=16).
    #[arg(long, default_value_t = 1)]
    streams: usize,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

pub fn run(args: Args) -> xdna::Result<()> {
    let opts = args.model.load_options(false);
    // The probe allocates what it streams: keep it to sizes a machine can hold.
    const MAX_PROBE_MIB: usize = 16 << 10;
    if args.probe_mib == 0 || args.probe_mib > MAX_PROBE_MIB {
        return Err(xdna::Error::Usage(format!(
            "--probe-mib {} must be between 1 and {MAX_PROBE_MIB}",
            args.probe_mib
        )));
    }
    if args.decode_tokens == 0 {
        // Nothing to time: the rates and fractions below would be 0 or undefined.
        return Err(xdna::Error::Usage(
            "--decode-tokens 0: a decode benchmark needs at least one decoded token".into(),
        ));
    }
    if args.streams == 0 || args.streams > MAX_VERIFY_ROWS {
        return Err(xdna::Error::Usage(format!(
            "--streams {} must be between 1 and {MAX_VERIFY_ROWS} (one batched pass)",
            args.streams
        )));
    }
    let ctx = args
        .prompt_tokens
        .saturating_add(args.decode_tokens)
        .saturating_add(1);
    let (pkg, mut model) = open_model(args.model.path.as_deref(), ctx, &opts)?;
    if model.context() < ctx {
        return Err(xdna::Error::Usage(format!(
            "prompt + decode tokens ({ctx}) exceed the model's {} positions",
            model.context()
        )));
    }
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(64);
    let mut prompt = pkg.tokenizer().encode(&text, false);
    prompt.resize(args.prompt_tokens.max(1), 0);
    let bytes = model.weights().bytes_per_token() as f64;
    let (mut pre, mut dec, mut bws, mut fracs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Per decode token: projections, attention and the rest of the pass (ms), and the
    // projections' weight streaming as a fraction of the probe.
    let (mut projection, mut attention, mut other) = (Vec::new(), Vec::new(), Vec::new());
    let mut projection_fracs = Vec::new();
    for _ in 0..args.runs.max(1) {
        // The same pool the kernels run on; the best pass is the attainable roofline.
        let bw = xdna::kernels::bandwidth::read_bandwidth(args.probe_mib << 20, 3).best_gbs * 1e9;
        let (prefill_tok_s, passes_s, before, after) = if args.streams == 1 {
            model.reset();
            let t0 = Instant::now();
            let mut next = argmax(model.prefill(&prompt)?, 0)?;
            let prefill_tok_s = prompt.len() as f64 / t0.elapsed().as_secs_f64();
            let before = model.stats();
            let t1 = Instant::now();
            for _ in 0..args.decode_tokens {
                next = argmax(model.step(next)?, 0)?;
            }
            let passes_s = args.decode_tokens as f64 / t1.elapsed().as_secs_f64();
            (prefill_tok_s, passes_s, before, model.stats())
        } else {
            decode_streams(&mut model, &prompt, args.streams, args.decode_tokens, ctx)?
        };
        pre.push(prefill_tok_s);
        let decode = passes_s * args.streams as f64;
        // A pass decodes one token of every stream.
        let per_pass = |d: std::time::Duration| d.as_secs_f64() * 1e3 / args.decode_tokens as f64;
        let projection_ms = per_pass(after.projection_time - before.projection_time);
        let attention_ms = per_pass(after.attention_time - before.attention_time);
        let pass_ms = per_pass(after.pass_time - before.pass_time);
        projection.push(projection_ms);
        attention.push(attention_ms);
        other.push(pass_ms - projection_ms - attention_ms);
        // The projections' own share of the limit: the weight bytes over their time, against
        // this run's probe.
        projection_fracs.push(bytes / (projection_ms * 1e-3) / bw);
        dec.push(decode);
        fracs.push(passes_s / (bw / bytes));
        bws.push(bw);
    }
    let (decode_runs, fraction_runs) = (dec.clone(), fracs.clone());
    let streams = args.streams as f64;
    let (projection_ms, attention_ms, other_ms) = (
        median(&mut projection),
        median(&mut attention),
        median(&mut other),
    );
    let projection_frac = median(&mut projection_fracs);
    let threads = xdna::kernels::pool::Pool::global().threads();
    let bw = median(&mut bws);
    let limit = bw / bytes;
    let (prefill, decode) = (median(&mut pre), median(&mut dec));
    let frac = median(&mut fracs);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "prefill_tok_s": prefill, "decode_tok_s": decode, "limit_tok_s": limit,
                "fraction_of_limit": frac, "read_bandwidth_gb_s": bw / 1e9,
                "decode_tok_s_runs": decode_runs, "fraction_of_limit_runs": fraction_runs,
                "weight_bytes_per_token": bytes as u64, "runs": args.runs.max(1),
                "prompt_tokens": prompt.len(), "decode_tokens": args.decode_tokens,
                "threads": threads, "backend": model.weights().backend,
                "amx": xdna::kernels::amx_tiles_run(), "streams": args.streams,
                "projection_ms_per_pass": projection_ms, "attention_ms_per_pass": attention_ms,
                "other_ms_per_pass": other_ms,
                "projection_ms_per_token": projection_ms / streams,
                "attention_ms_per_token": attention_ms / streams,
                "other_ms_per_token": other_ms / streams,
                "projection_fraction_of_bandwidth": projection_frac,
            })
        );
    } else {
        println!("{:<28} {:>12}", "metric", "value");
        println!("{:<28} {:>12.1}", "prefill tok/s (median)", prefill);
        if xdna::kernels::amx_tiles_run() {
            println!("{:<28} {:>12}", "super-block prefill on", "AMX tiles");
        }
        println!("{:<28} {:>12.1}", "decode tok/s (median)", decode);
        println!("{:<28} {:>12.2}", "read bandwidth GB/s (median)", bw / 1e9);
        println!("{:<28} {:>12.1}", "weight MB per token", bytes / 1e6);
        println!("{:<28} {:>12.1}", "limit tok/s (median)", limit);
        println!(
            "{:<28} {:>11.1}%",
            "fraction of limit (median)",
            100.0 * frac
        );
        let runs: Vec<String> = fraction_runs
            .iter()
            .map(|f| format!("{:.1}%", 100.0 * f))
            .collect();
        println!("{:<28} {:>12}", "fraction per run", runs.join(" "));
        println!("{:<28} {:>12}", "streams", args.streams);
        println!("{:<28} {:>12.3}", "projections ms/pass", projection_ms);
        println!(
            "{:<28} {:>11.1}%",
            "projections at bandwidth",
            100.0 * projection_frac
        );
        println!("{:<28} {:>12.3}", "attention ms/pass", attention_ms);
        println!("{:<28} {:>12.3}", "rest of a pass ms/pass", other_ms);
        println!("{:<28} {:>12}", "backend", model.weights().backend);
    }
    Ok(())
}

/// `streams` sequences prefilled with `prompt` one after another, then `decode_tokens` batched
/// passes of one greedy row each: (prefill tok/s, passes/s, stats before and after the passes).
fn decode_streams(
    model: &mut Model,
    prompt: &[u32],
    streams: usize,
    decode_tokens: usize,
    ctx: usize,
) -> xdna::Result<(f64, f64, xdna::model::PassStats, xdna::model::PassStats)> {
    let mut states: Vec<SequenceState> = (0..streams)
        .map(|_| model.new_sequence(ctx))
        .collect::<Result<_, _>>()?;
    let mut next = vec![0u32; streams];
    let t0 = Instant::now();
    for (state, token) in states.iter_mut().zip(&mut next) {
        let last = prompt.len() - 1;
        let mut first = Ok(0);
        model.prefill_sequence(state, prompt, last, &mut |_, logits| {
            first = argmax(logits, 0)
        })?;
        *token = first?;
    }
    let prefill_tok_s = (streams * prompt.len()) as f64 / t0.elapsed().as_secs_f64();
    let before = model.stats();
    let t1 = Instant::now();
    for _ in 0..decode_tokens {
        let feeds: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut batch: Vec<(&mut SequenceState, &[u32])> = states
            .iter_mut()
            .zip(&feeds)
            .map(|(state, feed)| (state, &feed[..]))
            .collect();
        let out = model.step_sequences(&mut batch)?;
        for (i, token) in next.iter_mut().enumerate() {
            *token = argmax(out.logits(i), i)?;
        }
        for state in states.iter_mut() {
            model.commit_sequence(state, 1)?;
        }
    }
    let passes_s = decode_tokens as f64 / t1.elapsed().as_secs_f64();
    Ok((prefill_tok_s, passes_s, before, model.stats()))
}
