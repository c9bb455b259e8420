//! `xdna perplexity`: perplexity of a text file by the llama-perplexity method, or (`--score`)
//! the log-likelihoods of continuations after contexts, as evaluation harnesses score choices.

use std::path::PathBuf;
use xdna::cli::ModelArgs;
use xdna::model::kl_divergence::{compare_with_saved, SavedLogits};
use xdna::model::load::open_model;
use xdna::model::perplexity::{
    compare, perplexity, score_continuation, PerplexityComparison, PerplexityResult,
};
use xdna::model::reference::{ActivationRounding, Reference};

#[derive(clap::Args)]
pub struct Args {
    /// The text file (with --kl-divergence-base: checked to tokenize to the saved tokens).
    #[arg(long, required_unless_present_any = ["score", "kl_divergence_base"])]
    file: Option<PathBuf>,
    /// Compare with the logits llama.cpp saved (`llama-perplexity --kl-divergence-base FILE`):
    /// run the file's own tokens and chunks, print both perplexities, the mean KL divergence from
    /// the saved distributions, how often the top-1 tokens agree, and every row where they differ
    /// although the saved top-2 margin exceeds --top1-margin (exit status 1 if any).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["score", "reference", "compare_reference"])]
    kl_divergence_base: Option<PathBuf>,
    /// With --kl-divergence-base: the saved top-2 margin, in nats, above which a row's top-1
    /// tokens must agree.
    #[arg(long, default_value_t = 0.1, requires = "kl_divergence_base", value_parser = parse_margin)]
    top1_margin: f32,
    /// Score instead: a JSON-lines file of `{"context", "continuation"}` strings; prints one JSON
    /// line per pair with the token ids, `loglikelihood` and `is_greedy`. The pair is split into
    /// ids as lm-evaluation-harness splits it (the context's trailing whitespace moves to the
    /// continuation; the continuation's ids are what follows the context's in the whole's).
    /// Loads the model with `--ctx` positions.
    #[arg(long, conflicts_with_all = ["file", "reference", "compare_reference"])]
    score: Option<PathBuf>,
    /// Tokens per chunk [default: 512; with --kl-divergence-base the saved file's].
    #[arg(long)]
    ctx: Option<usize>,
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

impl Args {
    fn ctx(&self) -> usize {
        self.ctx.unwrap_or(512)
    }
}

fn parse_margin(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(m) if m.is_finite() && m >= 0.0 => Ok(m),
        _ => Err(format!(
            "`{s}` is not a margin: a finite number of nats ≥ 0"
        )),
    }
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
    if let Some(base) = &args.kl_divergence_base {
        return kl_divergence(&args, base);
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
        let (pkg, mut model) = open_model(args.model.path.as_deref(), args.ctx(), &opts)?;
        if model.context() < args.ctx() {
            return Err(xdna::Error::Usage(format!(
                "--ctx {} exceeds the model's {} positions",
                args.ctx(),
                model.context()
            )));
        }
        let tokens = pkg.tokenizer().encode(&text, false);
        let r = perplexity(
            &tokens,
            args.ctx(),
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
                args.ctx(),
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
            "chunks": r.chunks, "ctx": args.ctx(), "text_tokens": text_tokens,
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
            r.ppl, r.tokens, r.chunks, args.ctx(), text_tokens, forward, secs
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

/// `--kl-divergence-base FILE`: this run against llama.cpp's saved logits.
fn kl_divergence(args: &Args, base: &std::path::Path) -> xdna::Result<()> {
    let mut saved = SavedLogits::open(base)?;
    if let Some(ctx) = args.ctx.filter(|&c| c != saved.n_ctx) {
        return Err(xdna::Error::Usage(format!(
            "--ctx {ctx} differs from the {} tokens per chunk {} was saved with",
            saved.n_ctx,
            base.display()
        )));
    }
    let opts = args.model.load_options(args.exact);
    let (pkg, mut model) = open_model(args.model.path.as_deref(), saved.n_ctx, &opts)?;
    if model.context() < saved.n_ctx {
        return Err(xdna::Error::Usage(format!(
            "{} was saved with {} tokens per chunk; the model holds {} positions",
            base.display(),
            saved.n_ctx,
            model.context()
        )));
    }
    if let Some(file) = &args.file {
        let text = std::fs::read_to_string(file).map_err(|e| xdna::Error::io(file, e))?;
        let ours: Vec<u32> = pkg
            .leading_bos()
            .into_iter()
            .chain(pkg.tokenizer().encode(&text, false))
            .collect();
        let n = saved.tokens.len();
        if let Some(at) = (0..n).find(|&i| ours.get(i) != saved.tokens.get(i)) {
            return Err(xdna::Error::Usage(format!(
                "{} tokenizes differently from {}: token {at} is {:?} here and {} there",
                file.display(),
                base.display(),
                ours.get(at),
                saved.tokens[at]
            )));
        }
    }
    let json = args.json;
    let t0 = std::time::Instant::now();
    let c = compare_with_saved(
        &mut saved,
        pkg.leading_bos(),
        args.top1_margin,
        &mut |chunk, first, f| {
            model.reset();
            model.prefill_with(chunk, first, f)
        },
        &mut |chunk, kld| {
            if !json {
                eprint!("[{}]{kld:.6},", chunk + 1);
            }
        },
    )?;
    let secs = t0.elapsed().as_secs_f64();
    let backend = model.weights().backend.to_string();
    if json {
        let mut v = serde_json::to_value(&c).map_err(|e| xdna::Error::Usage(e.to_string()))?;
        v["chunks"] = saved.n_chunk.into();
        v["ctx"] = saved.n_ctx.into();
        v["seconds"] = secs.into();
        v["backend"] = backend.into();
        v["tokens_checked"] = args.file.is_some().into();
        println!("{v}");
    } else {
        eprintln!();
        println!(
            "{} rows ({} chunks of {}, {backend}, {secs:.1} s): perplexity {:.4}, saved {:.4} ({:+.3} %)",
            c.rows,
            saved.n_chunk,
            saved.n_ctx,
            c.ppl,
            c.saved_ppl,
            100.0 * (c.ppl / c.saved_ppl - 1.0)
        );
        println!(
            "mean KL divergence {:.6} ± {:.6} nats (max {:.4}); same top-1 {:.3} % ({} of {})",
            c.mean_kld,
            c.mean_kld_uncertainty,
            c.max_kld,
            100.0 * c.same_top as f64 / c.rows as f64,
            c.same_top,
            c.rows
        );
        println!(
            "rows with a saved top-2 margin over {} nats: {}, top-1 differs in {}",
            c.margin, c.confident_rows, c.confident_disagreement_count
        );
        for d in &c.confident_disagreements {
            println!(
                "  chunk {} row {}: saved top-1 {} (margin {:.3}), here {}",
                d.chunk, d.row, d.saved_top, d.saved_margin, d.top
            );
        }
    }
    if c.confident_disagreement_count > 0 {
        return Err(xdna::Error::Usage(format!(
            "the top-1 token differs from {} in {} rows where its margin exceeds {} nats",
            base.display(),
            c.confident_disagreement_count,
            c.margin
        )));
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
        args.ctx(),
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
    let (pkg, mut model) = open_model(args.model.path.as_deref(), args.ctx(), &opts)?;
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
