//! `xdna bench load`: the wall time of loading a model (opening, checking and re-laying its
//! weights for the backend) and the peak resident memory of the load (and of generating a few
//! tokens, which reads every weight) against the package's weight bytes.
//!
//! Peak RSS is the kernel's high-water mark `VmHWM` from `/proc/self/status`: mapped package
//! pages, anonymous memory and mapped shmem (the dma-buf weight buffers) all count. Run it in a
//! fresh process (it is one): the mark never goes down.

use xdna::cli::ModelArgs;
use xdna::model::load::open_model;
use xdna::model::sampling::argmax;

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens to prefill after loading (> 16 uses the m128 family).
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    /// Tokens to decode after the prefill.
    #[arg(long, default_value_t = 8)]
    decode_tokens: usize,
}

/// A `kB` field of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> xdna::Result<u64> {
    let path = "/proc/self/status";
    let text = std::fs::read_to_string(path).map_err(|e| xdna::Error::io(path, e))?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| xdna::Error::Usage(format!("{path}: no {field} line in kB")))
}

/// The kinds of resident pages (anonymous, mapped files, shmem and dma-buf), so a high mark in a
/// failing run says where the memory went.
fn rss_split() -> xdna::Result<serde_json::Value> {
    Ok(serde_json::json!({
        "anon": status_bytes("RssAnon")?,
        "file": status_bytes("RssFile")?,
        "shmem": status_bytes("RssShmem")?,
    }))
}

pub fn run(args: Args) -> xdna::Result<()> {
    let opts = args.model.load_options(false);
    let rss_start = status_bytes("VmRSS")?;
    let ctx = args.prompt_tokens + args.decode_tokens + 1;
    let load_start = std::time::Instant::now();
    let (pkg, mut model) = open_model(args.model.path.as_deref(), ctx, &opts)?;
    let load_seconds = load_start.elapsed().as_secs_f64();
    let peak_load = status_bytes("VmHWM")?;
    let split_load = rss_split()?;
    let weight_bytes: u64 = pkg
        .weights()
        .entries()
        .iter()
        .map(|e| (e.end - e.start) as u64)
        .sum();
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(16);
    let mut prompt = pkg.tokenizer().encode(&text, false);
    prompt.resize(args.prompt_tokens.max(1), 0);
    let mut next = argmax(model.prefill(&prompt)?, 0)?;
    for _ in 0..args.decode_tokens {
        next = argmax(model.step(next)?, 0)?;
    }
    let peak_run = status_bytes("VmHWM")?;
    let rss_end = status_bytes("VmRSS")?;
    let split_end = rss_split()?;
    let ratio = peak_run as f64 / weight_bytes.max(1) as f64;
    let backend = model.weights().backend.clone();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "weight_bytes": weight_bytes, "rss_start_bytes": rss_start,
                "load_seconds": load_seconds, "peak_rss_load_bytes": peak_load, "peak_rss_bytes": peak_run,
                "rss_end_bytes": rss_end, "peak_rss_over_weights": ratio,
                "prompt_tokens": prompt.len(), "decode_tokens": args.decode_tokens,
                "backend": backend, "last_token": next,
                "rss_split_load": split_load, "rss_split_end": split_end,
            })
        );
    } else {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!("{:<34} {:>10}", "metric", "value");
        println!("{:<34} {:>10.1}", "weight MiB", mib(weight_bytes));
        println!("{:<34} {:>10.3}", "load seconds", load_seconds);
        println!("{:<34} {:>10.1}", "RSS before load MiB", mib(rss_start));
        println!("{:<34} {:>10.1}", "peak RSS after load MiB", mib(peak_load));
        println!(
            "{:<34} {:>10.1}",
            format!(
                "peak RSS after {}+{} tokens MiB",
                prompt.len(),
                args.decode_tokens
            ),
            mib(peak_run)
        );
        println!("{:<34} {:>10.3}", "peak RSS / weight bytes", ratio);
        println!("{:<34} {:>10}", "backend", backend);
    }
    Ok(())
}
