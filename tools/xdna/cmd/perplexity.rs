//! `xdna perplexity`: perplexity of a text file by the llama-perplexity method.

use std::path::PathBuf;
use xdna::model::load::{open_model, Backend, LoadOptions};
use xdna::model::perplexity::{perplexity, PerplexityResult};
use xdna::model::reference::{ActivationRounding, Reference};

#[derive(clap::Args)]
pub struct Args {
    /// The text file.
    #[arg(long)]
    file: PathBuf,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Package directory or GGUF file (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    model: Option<PathBuf>,
    /// auto | host | xdna.
    #[arg(long, default_value = "auto", env = "XDNA_BACKEND")]
    backend: String,
    /// Kernel set directory.
    #[arg(long, env = "XDNA_KERNELS")]
    kernels: Option<PathBuf>,
    /// Exact projections (kernels reference executor: f32 activations, f64 sums; slow).
    #[arg(long, conflicts_with = "reference")]
    exact: bool,
    /// Evaluate with the slow reference forward instead (its own GGUF reader, f32 weights, f64
    /// sums; a GGUF model only): the yardstick the fast path is compared with.
    #[arg(long)]
    reference: bool,
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
    let text = std::fs::read_to_string(&args.file).map_err(|e| xdna::Error::io(&args.file, e))?;
    let t0 = std::time::Instant::now();
    let json = args.json;
    let mut progress = |c: usize, p: f64| {
        if !json {
            eprint!("[{}]{:.4},", c + 1, p);
        }
    };
    let (r, text_tokens, forward) = if args.reference {
        reference_perplexity(&args, &text, &mut progress)?
    } else {
        let opts = LoadOptions {
            backend: args.backend.parse::<Backend>()?,
            kernels: args.kernels.clone(),
            exact: args.exact,
        };
        let (pkg, mut model) = open_model(args.model.as_deref(), args.ctx, &opts)?;
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
            bos_of(&pkg),
            &mut |chunk, first, f| {
                model.reset();
                model.prefill_with(chunk, first, f)
            },
            &mut progress,
        )?;
        (r, tokens.len(), model.weights().backend.to_string())
    };
    let secs = t0.elapsed().as_secs_f64();
    if json {
        let mut v = serde_json::json!({
            "ppl": r.ppl, "tokens": r.tokens, "chunks": r.chunks, "ctx": args.ctx,
            "text_tokens": text_tokens, "per_chunk": r.per_chunk, "seconds": secs,
            "backend": forward,
        });
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
        println!(
            "perplexity {:.4} over {} scored tokens ({} chunks of {}, {} text tokens, {}{how}, {:.1} s)",
            r.ppl, r.tokens, r.chunks, args.ctx, text_tokens, forward, secs
        );
    }
    Ok(())
}

fn bos_of(pkg: &xdna::weights::Package) -> Option<u32> {
    if pkg.add_bos() {
        pkg.bos_token_id()
    } else {
        None
    }
}

/// `--reference`: the slow reference forward over a GGUF file (the default model's when none is
/// given); (result, text tokens, the forward's name).
fn reference_perplexity(
    args: &Args,
    text: &str,
    progress: &mut dyn FnMut(usize, f64),
) -> xdna::Result<(PerplexityResult, usize, String)> {
    let gguf = match &args.model {
        Some(path) if path.is_file() => path.clone(),
        Some(path) => {
            return Err(xdna::Error::Usage(format!(
            "--reference reads a GGUF file and {} is not one (the reference forward has its own \
                 GGUF reader; pass the model's .gguf)",
            path.display()
        )))
        }
        None => xdna::weights::default_model::default_gguf()?,
    };
    let pkg = xdna::weights::Package::open(&gguf)?;
    let reference = Reference::open(&gguf)?
        .with_activation_q8_at(args.reference_q8.unwrap_or_default())
        .with_outlier_refinement(args.reference_refine);
    let tokens = pkg.tokenizer().encode(text, false);
    let r = perplexity(
        &tokens,
        args.ctx,
        bos_of(&pkg),
        &mut |chunk, first, f| {
            for (i, logits) in reference.forward(chunk, first)?.iter().enumerate() {
                f(first + i, logits);
            }
            Ok(())
        },
        progress,
    )?;
    Ok((r, tokens.len(), "reference".into()))
}
