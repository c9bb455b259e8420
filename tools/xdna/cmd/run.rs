//! `xdna run`: generate text from a model, streaming it to stdout.

use std::io::Write;
use std::time::Instant;
use xdna::cli::ModelArgs;
use xdna::model::load::open_model;
use xdna::model::sampling::{Sampler, SamplingConfig};
use xdna::model::text::{StopFilter, Utf8Stream};
use xdna::model::ModelError;
use xdna::spec::{FinishReason, SpecRunner, StopConditions};
use xdna::weights::{ChatMessage, Package};

use super::spec_common::{build_drafter, print_stats, DraftOptions, DrafterKind};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in the package's chat template (one user message).
    #[arg(long)]
    chat: bool,
    /// Exact projections (kernels reference executor: f32 activations, f64 sums; several times
    /// slower). The fast kernels round activations to q8 per 32 values, which can flip a greedy
    /// near-tie; this gives the reference forward's tokens.
    #[arg(long)]
    exact: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampler's PRNG.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when this string appears (not printed); repeatable.
    #[arg(long)]
    stop: Vec<String>,
    /// Context length (KV cache positions).
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// Speculative decoding with this drafter: ngram | draft:PKG | dflash[:PATH] | layerskip:E (`dflash`: the draft shipped for the default model).
    #[arg(long, value_name = "DRAFTER")]
    speculate: Option<String>,
    #[command(flatten)]
    draft: DraftOptions,
    /// With --speculate: keep speculating even when the measured costs say it does not pay.
    #[arg(long)]
    no_fallback: bool,
}

/// Token ids of the prompt: chat template or raw, with BOS when the package says so.
pub fn prompt_tokens(pkg: &Package, prompt: &str, chat: bool) -> Result<Vec<u32>, ModelError> {
    if prompt.is_empty() {
        return Err(ModelError::Context {
            what: "empty prompt".into(),
        });
    }
    let (text, special) = if chat {
        (pkg.render_chat(&[ChatMessage::new("user", prompt)])?, true)
    } else {
        (prompt.to_string(), false)
    };
    Ok(pkg.encode_prompt(&text, special))
}

pub fn run(args: Args) -> xdna::Result<()> {
    // Refuse bad sampling settings before loading anything (a negative or NaN temperature would
    // otherwise quietly mean greedy, and a top-p outside (0, 1] a silent no-op or cut-to-one).
    let sampling = SamplingConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
    };
    sampling.validate()?;
    let opts = args.model.load_options(args.exact);
    let (pkg, mut model) = open_model(args.model.path.as_deref(), args.ctx, &opts)?;
    let ids = prompt_tokens(&pkg, &args.prompt, args.chat)?;
    if ids.len() + 1 > model.context() {
        return Err(ModelError::Context {
            what: format!(
                "the prompt has {} tokens, the context holds {} (use --ctx)",
                ids.len(),
                model.context()
            ),
        }
        .into());
    }
    let eos: Vec<u32> = pkg.eos_token_ids().to_vec();
    if let Some(speculate) = &args.speculate {
        let kind: DrafterKind = speculate.parse()?;
        return run_speculative(&args, sampling, &kind, &pkg, &mut model, &ids, &eos);
    }
    let mut sampler = Sampler::new(sampling, args.seed)?;
    let t0 = Instant::now();
    let mut next = sampler.sample(model.prefill(&ids)?)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let tok = pkg.tokenizer();
    let mut utf8 = Utf8Stream::default();
    let mut stops = StopFilter::new(args.stop.clone());
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut text = String::new();
    let mut generated = 0usize;
    let t1 = Instant::now();
    let mut decode_steps = 0usize;
    let emit = |s: &str, out: &mut std::io::StdoutLock| {
        if !s.is_empty() {
            let _ = out.write_all(s.as_bytes());
            let _ = out.flush();
        }
    };
    loop {
        if eos.contains(&next) || generated >= args.max_tokens {
            break;
        }
        generated += 1;
        text.clear();
        utf8.push(tok.token_bytes(next), &mut text);
        let shown = stops.push(&text);
        emit(&shown, &mut out);
        if stops.stopped()
            || generated >= args.max_tokens
            || model.position() + 1 >= model.context()
        {
            break;
        }
        next = sampler.sample(model.step(next)?)?;
        decode_steps += 1;
    }
    if !stops.stopped() {
        text.clear();
        utf8.finish(&mut text);
        let mut tail = stops.push(&text);
        if !stops.stopped() {
            tail.push_str(&stops.finish());
        }
        emit(&tail, &mut out);
    }
    let _ = out.write_all(b"\n");
    let decode_s = t1.elapsed().as_secs_f64();
    let st = model.stats();
    eprintln!(
        "[stats] prompt {} tok, prefill {:.1} tok/s, decode {:.1} tok/s ({} tokens), backend {}, families m16 {} passes / m128 {} passes",
        ids.len(),
        ids.len() as f64 / prefill_s.max(1e-9),
        decode_steps as f64 / decode_s.max(1e-9),
        generated,
        model.weights().backend,
        st.m16_passes,
        st.m128_passes
    );
    Ok(())
}

/// `run --speculate`: the same text as plain decoding (identical under greedy), produced by the
/// speculative loop; the speculative statistics follow the stats line on stderr.
fn run_speculative(
    args: &Args,
    sampling: SamplingConfig,
    kind: &DrafterKind,
    pkg: &Package,
    model: &mut xdna::model::Model,
    ids: &[u32],
    eos: &[u32],
) -> xdna::Result<()> {
    let ctx = model.context();
    let drafter = build_drafter(kind, &args.draft, pkg, model, ctx, args.seed)?;
    let drafter_name = drafter.name();
    let config = args
        .draft
        .spec_config(sampling, args.seed, !args.no_fallback);
    let mut runner = SpecRunner::new(config, drafter)?;
    // The loop feeds the prompt's last token itself (it is the pending token).
    let t0 = Instant::now();
    runner.prefill(model, &ids[..ids.len().saturating_sub(1)])?;
    let prefill_s = t0.elapsed().as_secs_f64();
    // Plain decoding stops when the next step would not fit the context: the same budget here.
    let max_tokens = args.max_tokens.min(ctx.saturating_sub(ids.len()));
    let stop = StopConditions {
        max_tokens,
        eos_tokens: eos.to_vec(),
        stop_sequences: Vec::new(),
    };
    let tok = pkg.tokenizer();
    let mut utf8 = Utf8Stream::default();
    let mut stops = StopFilter::new(args.stop.clone());
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut text = String::new();
    let mut generated = 0usize;
    let t1 = Instant::now();
    let generation = runner.generate_controlled(model, ids, &stop, |tokens| {
        for &token in tokens {
            if eos.contains(&token) {
                break;
            }
            generated += 1;
            text.clear();
            utf8.push(tok.token_bytes(token), &mut text);
            let shown = stops.push(&text);
            if !shown.is_empty() {
                let _ = out.write_all(shown.as_bytes());
                let _ = out.flush();
            }
            if stops.stopped() {
                return std::ops::ControlFlow::Break(());
            }
        }
        std::ops::ControlFlow::Continue(())
    })?;
    let decode_s = t1.elapsed().as_secs_f64();
    if !stops.stopped() {
        text.clear();
        utf8.finish(&mut text);
        let mut tail = stops.push(&text);
        if !stops.stopped() {
            tail.push_str(&stops.finish());
        }
        if !tail.is_empty() {
            let _ = out.write_all(tail.as_bytes());
        }
    }
    let _ = out.write_all(b"\n");
    let _ = out.flush();
    let st = model.stats();
    let finish = match generation.finish {
        FinishReason::Eos => "eos",
        FinishReason::StopSequence | FinishReason::Cancelled => "stop",
        FinishReason::MaxTokens => "length",
    };
    eprintln!(
        "[stats] prompt {} tok, prefill {:.1} tok/s, decode {:.1} tok/s ({} tokens), backend {}, families m16 {} passes / m128 {} passes, finish {}",
        ids.len(),
        (ids.len() - 1) as f64 / prefill_s.max(1e-9),
        generated as f64 / decode_s.max(1e-9),
        generated,
        model.weights().backend,
        st.m16_passes,
        st.m128_passes,
        finish
    );
    print_stats(drafter_name, runner.stats());
    Ok(())
}
