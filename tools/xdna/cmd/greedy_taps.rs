//! `xdna greedy-taps`: the target's greedy continuations of token-id prompts, with its hidden
//! states after chosen layers at every fed position: what a DFlash draft is trained on
//! (`tools/dflash-train`), computed by the same forward that later verifies the draft's blocks.
//!
//! Input: JSON lines, one array of token ids per prompt. Output (little-endian):
//! - header: `b"XGT1"`, `u32` hidden size, `u32` tap count, `u32` tap layers (0-based, the hidden
//!   state after that layer);
//! - per prompt, in input order: `u32` prompt length `P`, `u32` total length `L` (prompt +
//!   continuation; the continuation ends early at an end-of-generation token, which it keeps),
//!   `u32` tokens `[L]`, then `f16` features `[L − 1][taps][hidden]`: the hidden states of the
//!   positions fed to the target (every token but the last, which nothing reads as context).
//!
//! Sequences run up to 16 at a time, one batched pass per generated token, as the server decodes.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

use xdna::cli::ModelArgs;
use xdna::model::load::open_model;
use xdna::model::sampling::argmax;
use xdna::model::{BatchOutput, SequenceState, MAX_VERIFY_ROWS};

/// The file's first bytes.
pub const MAGIC: &[u8; 4] = b"XGT1";

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompts: JSON lines, each an array of token ids.
    #[arg(long)]
    prompts: PathBuf,
    /// Greedy tokens to generate per prompt (fewer where an end-of-generation token comes first).
    #[arg(long, default_value_t = 160)]
    tokens: usize,
    /// Target layers (0-based) whose output hidden states are written, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    taps: Vec<usize>,
    /// Output file.
    #[arg(short, long)]
    output: PathBuf,
    /// Sequences decoded together (1..=16).
    #[arg(long, default_value_t = 16)]
    streams: usize,
}

fn read_prompts(path: &std::path::Path) -> xdna::Result<Vec<Vec<u32>>> {
    let file = std::fs::File::open(path)
        .map_err(|e| xdna::Error::Usage(format!("--prompts {}: {e}", path.display())))?;
    let mut prompts = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| xdna::Error::Usage(format!("{}: {e}", path.display())))?;
        if line.trim().is_empty() {
            continue;
        }
        let ids: Vec<u32> = serde_json::from_str(&line).map_err(|e| {
            xdna::Error::Usage(format!(
                "{} line {}: not a JSON array of token ids: {e}",
                path.display(),
                n + 1
            ))
        })?;
        if ids.is_empty() {
            return Err(xdna::Error::Usage(format!(
                "{} line {}: an empty prompt",
                path.display(),
                n + 1
            )));
        }
        prompts.push(ids);
    }
    Ok(prompts)
}

/// Append `out`'s tap rows `rows` as f16, each row's taps one after another.
fn push_features(out: &BatchOutput, taps: usize, rows: std::ops::Range<usize>, dst: &mut Vec<u16>) {
    for row in rows {
        for t in 0..taps {
            dst.extend(
                out.tap(t, row)
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_bits()),
            );
        }
    }
}

struct Record {
    prompt_len: usize,
    tokens: Vec<u32>,
    features: Vec<u16>,
    done: bool,
}

pub fn run(args: Args) -> xdna::Result<()> {
    if args.streams == 0 || args.streams > MAX_VERIFY_ROWS {
        return Err(xdna::Error::Usage(format!(
            "--streams {} must be between 1 and {MAX_VERIFY_ROWS}",
            args.streams
        )));
    }
    if args.tokens == 0 {
        return Err(xdna::Error::Usage("--tokens 0: nothing to generate".into()));
    }
    let prompts = read_prompts(&args.prompts)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let ctx = longest.saturating_add(args.tokens);
    let opts = args.model.load_options(false);
    let (pkg, mut model) = open_model(args.model.path.as_deref(), ctx, &opts)?;
    let vocab = pkg.config().vocab;
    for (n, prompt) in prompts.iter().enumerate() {
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(xdna::Error::Usage(format!(
                "{}: prompt {}: token id {bad} is outside the vocabulary (0..{vocab})",
                args.prompts.display(),
                n + 1
            )));
        }
    }
    if ctx > model.context() {
        return Err(xdna::Error::Usage(format!(
            "the longest prompt ({longest}) + --tokens {} exceed the model's {} positions",
            args.tokens,
            model.context()
        )));
    }
    let hidden = pkg.config().hidden;
    let taps = args.taps.clone();
    let eog: Vec<u32> = pkg.eos_token_ids().to_vec();
    let file = std::fs::File::create(&args.output)
        .map_err(|e| xdna::Error::Usage(format!("{}: {e}", args.output.display())))?;
    let mut w = std::io::BufWriter::new(file);
    let io = |e: std::io::Error| xdna::Error::Usage(format!("{}: {e}", args.output.display()));
    w.write_all(MAGIC).map_err(io)?;
    for v in [hidden as u32, taps.len() as u32]
        .into_iter()
        .chain(taps.iter().map(|&t| t as u32))
    {
        w.write_all(&v.to_le_bytes()).map_err(io)?;
    }
    let t0 = Instant::now();
    let mut states: Vec<SequenceState> = (0..args.streams.min(prompts.len()))
        .map(|_| model.new_sequence(ctx))
        .collect::<Result<_, _>>()?;
    let mut generated = 0usize;
    for (group, chunk) in prompts.chunks(args.streams).enumerate() {
        let mut records: Vec<Record> = Vec::with_capacity(chunk.len());
        for (prompt, state) in chunk.iter().zip(states.iter_mut()) {
            state.reset();
            let mut first = Ok(0);
            let mut features =
                Vec::with_capacity((prompt.len() + args.tokens) * taps.len() * hidden);
            model.prefill_sequence_tapped(
                state,
                prompt,
                prompt.len() - 1,
                &mut |_, logits| first = argmax(logits, 0),
                &taps,
                &mut |out| push_features(out, taps.len(), 0..out.rows(), &mut features),
            )?;
            let first = first?;
            let mut tokens = prompt.clone();
            tokens.push(first);
            records.push(Record {
                prompt_len: prompt.len(),
                done: eog.contains(&first) || args.tokens == 1,
                tokens,
                features,
            });
        }
        loop {
            let live: Vec<usize> = (0..records.len()).filter(|&i| !records[i].done).collect();
            if live.is_empty() {
                break;
            }
            let feeds: Vec<[u32; 1]> = live
                .iter()
                .map(|&i| [*records[i].tokens.last().unwrap_or(&0)])
                .collect();
            let mut batch: Vec<(&mut SequenceState, &[u32])> = Vec::with_capacity(live.len());
            let mut feed_iter = feeds.iter();
            for (i, state) in states.iter_mut().enumerate().take(records.len()) {
                if !records[i].done {
                    if let Some(feed) = feed_iter.next() {
                        batch.push((state, &feed[..]));
                    }
                }
            }
            let out = model.step_sequences_tapped(&mut batch, &taps)?;
            for (row, &i) in live.iter().enumerate() {
                let next = argmax(out.logits(row), row)?;
                let r = &mut records[i];
                push_features(out, taps.len(), row..row + 1, &mut r.features);
                r.tokens.push(next);
                r.done = eog.contains(&next) || r.tokens.len() - r.prompt_len >= args.tokens;
            }
            for (i, state) in states.iter_mut().enumerate().take(records.len()) {
                if live.contains(&i) {
                    model.commit_sequence(state, 1)?;
                }
            }
        }
        for r in &records {
            let fed = r.tokens.len() - 1;
            debug_assert_eq!(r.features.len(), fed * taps.len() * hidden);
            w.write_all(&(r.prompt_len as u32).to_le_bytes())
                .map_err(io)?;
            w.write_all(&(r.tokens.len() as u32).to_le_bytes())
                .map_err(io)?;
            for t in &r.tokens {
                w.write_all(&t.to_le_bytes()).map_err(io)?;
            }
            w.write_all(bytemuck::cast_slice(&r.features)).map_err(io)?;
            generated += r.tokens.len() - r.prompt_len;
        }
        eprintln!(
            "greedy-taps: {} of {} prompts, {generated} tokens generated, {:.0} tok/s",
            (group * args.streams + chunk.len()),
            prompts.len(),
            generated as f64 / t0.elapsed().as_secs_f64()
        );
    }
    w.flush().map_err(io)?;
    Ok(())
}
