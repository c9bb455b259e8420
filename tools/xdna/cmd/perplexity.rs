//! `xdna perplexity`: perplexity of a text file by the llama-perplexity method, or (`--score`)
//! the log-likelihoods of continuations after contexts, as evaluation harnesses score choices.

use std::path::PathBuf;
use xdna::cli::ModelArgs;
use xdna::model::load::open_model;
use xdna::model::perplexity::{
    compare, perplexity, score_continuation, PerplexityComparison, PerplexityResult,
};
use xdna::model::reference::{ActivationRounding, Reference};

#[derive(clap::Args)]
pub struct Args {
    /// The text file.
    #[arg(long, required_unless_present = "score")]
    file: Option<PathBuf>,
    /// Score instead: a JSON-lines file of `{"context", "continuation"}` strings; prints one JSON
    /// line per pair with the token ids, `loglikelihood` and `is_greedy`. The pair is split into
    /// ids as lm-evaluation-harness splits it (the context's trailing whitespace moves to the
    /// continuation; the continuation's ids are what follows the context's in the whole's).
    /// Loads the model with `--ctx` positions.
    #[arg(long, conflicts_with_all = ["file", "reference", "compare_reference"])]
    score: Option<PathBuf>,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model: ModelArgs,
    /// Exact projections (kernels reference executor: f32 activations, f64 sums; slow).
    #[arg(long, conflicts_with = "reference")]
    exact: bool,
    /// Evaluate with the slow reference forward instead (its own GGUF reader, f32 weights, f64
    /// sums; a GGUF model only): the yardstick the fast path is compared with.
    #[arg(long)]
    reference: bool,
    /// Also run the slow reference forward over the same tokens and print the relative perplexity
    /// gap with its standard error from the per-token differences (a GGUF model only).
    #[arg(long, conflicts_with = "reference")]
    compare_reference: bool,
    /// With --reference: round these projections' input activations to q8 per 32 values, as the
    /// fast kernels do (all | none | a comma list of qkv, o, gate_up, down, lm_head).
    #[arg(long, requires = "reference", value_parser = ActivationRounding::parse)]
    reference_q8: Option<ActivationRounding>,
    /// With --reference-q8: give each 32-value group whose max |x| exceeds RATIO × its row's RMS a
    /// second q8 pass over its residual (what refining only the outlier groups would reach).
    #[arg(long, requires = "reference_q8", value_parser = parse_ratio)]
    reference_refine: Option<f32>,
}

fn parse_ratio(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(r) if r.is_finite() && r >= 0.0 => Ok(r),
        _ => Err(format!("`{s}` is not a ratio: a finite number ≥ 0")),
    }
}

pub fn run(args: Args) -> xdna::Result<()> {
    if let Some(pairs) = &args.score {
        return score(&args, pairs);
    }
    let Some(file) = &args.file else {
        return Err(xdna::Error::Usage("--file or --score is required".into()));
    };
    let text = std::fs::read_to_string(file).map_err(|e| xdna::Error::io(file, e))?;
    let t0 = std::time::Instant::now();
    let json = args.json;
    let mut progress = |c: usize, p: f64| {
        if !json {
            eprint!("[{}]{:.4},", c + 1, p);
        }
    };
    let mut comparison: Option<PerplexityComparison> = None;
    // Opened first, so a model the reference cannot read fails before the fast run, not after.
    let compare_with = if args.compare_reference {
        Some(open_reference(&reference_gguf(&args)?, &args)?)
    } else {
        None
    };
    let (r, text_tokens, forward) = if args.reference {
        reference_perplexity(&args, &text, &mut progress)?
    } else {
        let opts = args.model.load_options(args.exact);
        let (pkg, mut model) = open_model(args.model.path.as_deref(), args.ctx, &opts)?;
        if model.context() < args.ctx {
            return Err(xdna::Error::Usage(format!(
                "--ctx {} exceeds the model's {} positions",
                args.ctx,
                model.context()
            )));
        }
        let tokens = pkg.tokenizer().encode(&text, false);
        let r = perplexity(
            &tokens,
            args.ctx,
            pkg.leading_bos(),
            &mut |chunk, first, f| {
                model.reset();
                model.prefill_with(chunk, first, f)
            },
            &mut progress,
        )?;
        if let Some(reference) = &compare_with {
            if !json {
                eprintln!();
                eprint!("reference: ");
            }
            let r_ref = perplexity(
                &tokens,
                args.ctx,
                pkg.leading_bos(),
                &mut |chunk, first, f| reference.score_chunk(chunk, first, f),
                &mut progress,
            )?;
            comparison = Some(compare(&r, &r_ref)?);
        }
        (r, tokens.len(), model.weights().backend.to_string())
    };
    let secs = t0.elapsed().as_secs_f64();
    if json {
        let mut v = serde_json::json!({
            "ppl": r.ppl, "ppl_uncertainty": r.uncertainty(), "tokens": r.tokens,
            "chunks": r.chunks, "ctx": args.ctx, "text_tokens": text_tokens,
            "per_chunk": r.per_chunk, "seconds": secs, "backend": forward,
        });
        if let Some(c) = comparison {
            v["reference_ppl"] = c.reference_ppl.into();
            v["gap"] = c.gap.into();
            v["gap_uncertainty"] = c.gap_uncertainty.into();
            v["mean_abs_token_nll"] = c.mean_abs_token_nll.into();
        }
        if args.reference {
            v["reference_q8"] = args.reference_q8.unwrap_or_default().names().into();
            v["reference_refine"] = args.reference_refine.into();
        }
        println!("{v}");
    } else {
        eprintln!();
        let how = match args.reference_q8 {
            Some(q8) if args.reference => match args.reference_refine {
                Some(ratio) => format!(
                    ", q8 activations at {} (groups over {ratio} × RMS refined)",
                    q8.names()
                ),
                None => format!(", q8 activations at {}", q8.names()),
            },
            _ => String::new(),
        };
        let plus_minus = r
            .uncertainty()
            .map_or(String::new(), |u| format!(" ± {u:.4}"));
        println!(
            "perplexity {:.4}{plus_minus} over {} scored tokens ({} chunks of {}, {} text tokens, {}{how}, {:.1} s)",
            r.ppl, r.tokens, r.chunks, args.ctx, text_tokens, forward, secs
        );
        if let Some(c) = comparison {
            println!(
                "reference {:.4}: gap {:+.3} % ± {:.3} % (standard error of the paired per-token \
                 differences), mean |Δnll| {:.4} nats per token",
                c.reference_ppl,
                100.0 * c.gap,
                100.0 * c.gap_uncertainty,
                c.mean_abs_token_nll
            );
        }
    }
    Ok(())
}

/// `--reference`: the slow reference forward over a GGUF file (the default model's when none is
/// given); (result, text tokens, the forward's name).
fn reference_perplexity(
    args: &Args,
    text: &str,
    progress: &mut dyn FnMut(usize, f64),
) -> xdna::Result<(PerplexityResult, usize, String)> {
    let gguf = reference_gguf(args)?;
    let reference = open_reference(&gguf, args)?;
    let pkg = xdna::weights::Package::open(&gguf)?;
    let tokens = pkg.tokenizer().encode(text, false);
    let r = perplexity(
        &tokens,
        args.ctx,
        pkg.leading_bos(),
        &mut |chunk, first, f| reference.score_chunk(chunk, first, f),
        progress,
    )?;
    Ok((r, tokens.len(), "reference".into()))
}

/// The GGUF file the reference forward reads: `--model` if it is a file, else the default model's.
fn reference_gguf(args: &Args) -> xdna::Result<PathBuf> {
    match &args.model.path {
        Some(path) if path.is_file() => Ok(path.clone()),
        Some(path) => Err(xdna::Error::Usage(format!(
            "the reference forward (--reference, --compare-reference) reads a GGUF file and {} is \
             not one (it has its own GGUF reader; pass the model's .gguf)",
            path.display()
        ))),
        None => Ok(xdna::weights::default_model::default_gguf()?),
    }
}

/// The reference forward, with `--reference-q8` / `--reference-refine` applied.
fn open_reference(gguf: &std::path::Path, args: &Args) -> xdna::Result<Reference> {
    Ok(Reference::open(gguf)?
        .with_activation_q8_at(args.reference_q8.unwrap_or_default())
        .with_outlier_refinement(args.reference_refine))
}

/// `--score PAIRS`: one JSON line per `{"context", "continuation"}` line of `pairs`.
fn score(args: &Args, pairs: &std::path::Path) -> xdna::Result<()> {
    let text = std::fs::read_to_string(pairs).map_err(|e| xdna::Error::io(pairs, e))?;
    let opts = args.model.load_options(args.exact);
    let (pkg, mut model) = open_model(args.model.path.as_deref(), args.ctx, &opts)?;
    let tok = pkg.tokenizer();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at =
            |what: String| xdna::Error::Usage(format!("{}:{}: {what}", pairs.display(), n + 1));
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(format!("not JSON: {e}")))?;
        let field = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_str)
                .ok_or_else(|| at(format!("`{k}` must be a string")))
        };
        let (context, continuation) = (field("context")?, field("continuation")?);
        let (ctx_ids, cont_ids) = split_pair(tok, context, continuation);
        if ctx_ids.len() + cont_ids.len() > model.context() {
            return Err(at(format!(
                "{} tokens exceed --ctx {}",
                ctx_ids.len() + cont_ids.len(),
                model.context()
            )));
        }
        let s = score_continuation(&ctx_ids, &cont_ids, &mut |tokens, first, f| {
            model.reset();
            model.prefill_with(tokens, first, f)
        })
        .map_err(|e| at(e.to_string()))?;
        println!(
            "{}",
            serde_json::json!({
                "context": context, "continuation": continuation,
                "context_ids": ctx_ids, "continuation_ids": cont_ids,
                "loglikelihood": s.loglikelihood, "is_greedy": s.is_greedy,
            })
        );
    }
    Ok(())
}

/// Token ids of a (context, continuation) pair, split as lm-evaluation-harness splits them.
fn split_pair(
    tok: &xdna::weights::Tokenizer,
    context: &str,
    continuation: &str,
) -> (Vec<u32>, Vec<u32>) {
    let trimmed = context.trim_end();
    let moved = &context[trimmed.len()..];
    let continuation = format!("{moved}{continuation}");
    let whole = tok.encode(&format!("{trimmed}{continuation}"), false);
    let ctx_ids = tok.encode(trimmed, false);
    let cont_ids = whole[ctx_ids.len().min(whole.len())..].to_vec();
    (ctx_ids, cont_ids)
}
