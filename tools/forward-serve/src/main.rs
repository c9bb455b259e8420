//! `forward-serve`: OpenAI-compatible HTTP server with xdna as its device backend.
//! See docs/serving.md.

use clap::Parser;
use forward_serve::api::Config;
use forward_serve::engine::{self, LoadSpec, Loaded};
use forward_serve::scheduler::{DrafterKind, Speculate};
use forward_serve::{bench, fake, server};
use std::sync::Arc;
use std::time::Duration;
use xdna::cli::ModelArgs;

#[derive(Parser, Debug)]
#[command(
    name = "forward-serve",
    version,
    about = "OpenAI-compatible server over the xdna runtime"
)]
struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (printed on stdout).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests waiting for a slot before new ones get 503.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Sequences generated at once (each with its own KV cache of `--ctx` positions; ≤ 16).
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Speculative decoding for every request: none | ngram | dflash (dflash: the --draft draft,
    /// or for the default model the one shipped with xdna; requests may override).
    #[arg(long, default_value = "none", value_parser = ["none", "ngram", "dflash"])]
    speculate: String,
    /// A DFlash draft (a `dflash` GGUF or package) made for the model, or `default` (the draft
    /// shipped for the default model): requests may draft with it (`"speculative": {"drafter":
    /// "dflash"}`).
    #[arg(long, value_name = "PATH")]
    draft: Option<std::path::PathBuf>,
    /// Drafts per speculative round at most (1..=15).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=15))]
    draft_max: u64,
    /// Measure instead of serving: aggregate tok/s of `--max-batch` concurrent streams (greedy, or
    /// sampled at `--bench-temperature`) vs one stream (table, or JSON with `--json`), then exit.
    #[arg(long)]
    bench: bool,
    /// Bench: tokens per stream.
    #[arg(long, default_value_t = 64)]
    bench_tokens: usize,
    /// Bench: rounds of (one stream, then all at once); medians are reported.
    #[arg(long, default_value_t = 3)]
    bench_rounds: usize,
    /// Bench: sampling temperature of every stream (0 = greedy; stream i is seeded with i).
    #[arg(long, default_value_t = 0.0, value_parser = parse_temperature)]
    bench_temperature: f32,
    /// Bench: print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Per-request time limit (e.g. 120s, 500ms, 2m).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    request_timeout: Duration,
    /// Largest `max_tokens` a request may ask for.
    #[arg(long, default_value_t = 2048)]
    max_tokens_limit: usize,
    /// Largest request body in bytes (413 above).
    #[arg(long, default_value_t = 1 << 20)]
    body_limit: usize,
    /// Time a request's body may take once its headers have arrived (408 after).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    body_timeout: Duration,
    /// Time a connection gets to send a request's headers, from its opening or its previous
    /// answer (slow senders and idle keep-alive connections are closed after it).
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    header_timeout: Duration,
    /// Client connections open at once; one more is answered 503 and closed. The open-file
    /// limit is raised to its hard limit at start, and this is capped below it.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Time in-flight requests get to finish after SIGTERM/SIGINT.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    shutdown_grace: Duration,
    /// KV positions per sequence.
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// Finished sequences kept for their prompt prefixes (the prefix cache; each holds a KV
    /// cache of `--ctx` positions); 0 turns it off.
    #[arg(long, default_value_t = 8)]
    prefix_cache: usize,
    /// Serve the deterministic fake engine instead of a model (tests, load experiments).
    #[arg(long, hide = true)]
    fake_engine: bool,
    /// Fake engine: delay per decode pass, e.g. 20ms.
    #[arg(long, hide = true, default_value = "0ms", value_parser = parse_duration)]
    fake_step_delay: Duration,
}

fn parse_temperature(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(t),
        _ => Err(format!("`{s}` is not a temperature: a finite number ≥ 0")),
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("bad duration {s:?} (e.g. 120s, 500ms, 2m)"))?;
    if !(v.is_finite() && v >= 0.0) {
        return Err(format!("bad duration {s:?}"));
    }
    Ok(Duration::from_secs_f64(v * mult))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => tracing::info!("SIGTERM"),
                _ = i.recv() => tracing::info!("SIGINT"),
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// `--max-connections`, lowered where the open-file limit (raised as far as allowed) cannot hold
/// that many plus the server's own descriptors (model files, device, engine).
fn connection_cap(wanted: usize) -> usize {
    const OWN_DESCRIPTORS: u64 = 64;
    let Some(files) = forward_serve::listen::raise_fd_limit() else {
        return wanted;
    };
    let room = files.saturating_sub(OWN_DESCRIPTORS).max(1) as usize;
    if wanted > room {
        tracing::warn!(
            "--max-connections {wanted} lowered to {room}: the open-file limit is {files}"
        );
        return room;
    }
    wanted
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    xdna::cli::init_logging("info", true);
    match real_main(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("forward-serve: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn real_main(mut args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.speculate == "dflash" && args.draft.is_none() {
        if args.model.path.is_some() {
            return Err("--speculate dflash needs a DFlash draft made for this model: --draft PATH (the shipped draft, --draft default, is for the default model)".into());
        }
        args.draft = Some("default".into());
    }
    if !args.fake_engine && args.draft.as_deref() == Some(std::path::Path::new("default")) {
        args.draft = Some(xdna::weights::default_model::default_dflash_draft()?);
    }
    let loaded = if args.fake_engine {
        Loaded {
            codec: Arc::new(fake::FakeCodec::new(args.ctx)),
            // The fake engine's DFlash drafts (its own continuation, some of them wrong) stand in
            // for a draft file.
            engine: Box::new(
                fake::FakeEngine::new(args.max_batch, args.fake_step_delay)
                    .with_dflash(args.draft.is_some()),
            ),
        }
    } else {
        engine::load(&LoadSpec {
            model: args.model.clone(),
            ctx: args.ctx,
            max_sequences: args.max_batch,
            prefix_cache: args.prefix_cache,
            draft: args.draft.clone(),
        })?
    };
    if args.bench {
        let r = bench::run(
            loaded,
            &bench::BenchSpec {
                streams: args.max_batch,
                tokens: args.bench_tokens.max(1),
                rounds: args.bench_rounds,
                temperature: args.bench_temperature,
            },
        )?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&r)?);
        } else {
            print!("{}", bench::table(&r));
        }
        return Ok(());
    }
    let cfg = Config {
        max_queue: args.max_queue,
        max_batch: args.max_batch,
        request_timeout: args.request_timeout,
        max_tokens_limit: args.max_tokens_limit,
        body_limit: args.body_limit,
        body_timeout: args.body_timeout,
        header_timeout: args.header_timeout,
        max_connections: connection_cap(args.max_connections),
        shutdown_grace: args.shutdown_grace,
        speculate: DrafterKind::from_name(&args.speculate).map(|drafter| Speculate {
            drafter,
            draft_max: args.draft_max as usize,
        }),
        dflash: false,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port)).await?;
        let addr = listener.local_addr()?;
        tracing::info!("model {} ready", loaded.codec.model_id());
        println!("forward-serve listening on http://{addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        server::run(listener, cfg, loaded, shutdown_signal()).await?;
        Ok::<(), Box<dyn std::error::Error>>(())
    })?;
    tracing::info!("exit");
    Ok(())
}
