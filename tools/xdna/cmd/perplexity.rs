//! `xdna perplexity`: perplexity of a text file by the llama-perplexity method.

use std::path::PathBuf;
use xdna::model::load::{open_model, Backend, LoadOptions};
use xdna::model::perplexity::perplexity;

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
    #[arg(long)]
    exact: bool,
}

pub fn run(args: Args) -> xdna::Result<()> {
    let text = std::fs::read_to_string(&args.file).map_err(|e| xdna::Error::io(&args.file, e))?;
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
    let bos = if pkg.add_bos() {
        pkg.bos_token_id()
    } else {
        None
    };
    let t0 = std::time::Instant::now();
    let json = args.json;
    let r = perplexity(
        &tokens,
        args.ctx,
        bos,
        &mut |chunk, first, f| {
            model.reset();
            model.prefill_with(chunk, first, f)
        },
        &mut |c, p| {
            if !json {
                eprint!("[{}]{:.4},", c + 1, p);
            }
        },
    )?;
    let secs = t0.elapsed().as_secs_f64();
    if json {
        println!(
            "{}",
            serde_json::json!({
                "ppl": r.ppl, "tokens": r.tokens, "chunks": r.chunks, "ctx": args.ctx,
                "text_tokens": tokens.len(), "per_chunk": r.per_chunk, "seconds": secs,
                "backend": model.weights().backend,
            })
        );
    } else {
        eprintln!();
        println!(
            "perplexity {:.4} over {} scored tokens ({} chunks of {}, {} text tokens, {:.1} s)",
            r.ppl,
            r.tokens,
            r.chunks,
            args.ctx,
            tokens.len(),
            secs
        );
    }
    Ok(())
}
