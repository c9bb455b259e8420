//! `xdna bench spec`: plain and speculative greedy decoding side by side over a built-in prompt set
//! (code, a numbered list, prose, repetitive text), with τ per prompt.

use std::time::Instant;

use xdna::cli::ModelArgs;
use xdna::model::load::open_model;
use xdna::model::sampling::{argmax, SamplingConfig};
use xdna::model::Model;
use xdna::spec::{SpecRunner, StopConditions};

use super::spec_common::{build_drafter, DraftOptions, DrafterKind};

/// The built-in prompts: name and text. Greedy SmolLM2 continues `code`, `list` and `repetitive`
/// by repeating what the prompt shows (the n-gram drafter's home ground); `list-count` invents new
/// items with increasing numbers (partly predictable); `prose` does not repeat itself.
pub const PROMPTS: &[(&str, &str)] = &[
    (
        "code",
        "def area(r):\n    return 3.14159 * r * r\n\ndef area(r):\n    return 3.14159 * r * r\n\ndef area(r):",
    ),
    (
        "list",
        "Packing list:\n1. passport\n2. tickets\n3. phone charger\n4. toothbrush\n5. toothpaste\n6. sunscreen\n7. sunglasses\n8. hat\n9. socks\n10. shirts\n11. trousers\n12. jacket\n13. umbrella\n14. book\n15. headphones\n16. laptop\n17. camera\n18. water bottle\n19. snacks\n20. pillow\n21. blanket\n22. notebook\n23. pen\n24. wallet\n25. keys\n26. map\n\nPacking list (copy):\n1. passport\n2.",
    ),
    (
        "list-count",
        "1. apple\n2. banana\n3. cherry\n4. date\n5. elderberry\n6.",
    ),
    (
        "prose",
        "The history of the printing press begins in the fifteenth century, when",
    ),
    (
        "repetitive",
        "Row, row, row your boat, gently down the stream. Merrily, merrily, merrily, merrily, life is but a dream.\nRow, row, row your boat, gently down the stream. Merrily, merrily, merrily, merrily, life is but a dream.\nRow, row,",
    ),
];

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model: ModelArgs,
    /// Drafter: ngram | draft:PKG | dflash:PATH | layerskip:E.
    #[arg(long, default_value = "ngram")]
    drafter: String,
    #[command(flatten)]
    draft: DraftOptions,
    /// Tokens to decode per prompt and run.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Runs per prompt (the median tok/s is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Keep speculating even when the measured costs say it does not pay.
    #[arg(long)]
    no_fallback: bool,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

struct PromptResult {
    name: &'static str,
    prompt_tokens: usize,
    plain_tok_s: f64,
    spec_tok_s: f64,
    tau: f64,
    tokens_per_pass: f64,
    fallbacks: u64,
    identical: bool,
}

/// Plain greedy: prefill all but the last prompt token, then one `step` per token (the same
/// starting state as the speculative loop). Returns the tokens and the decode seconds.
fn plain(model: &mut Model, ids: &[u32], tokens: usize) -> xdna::Result<(Vec<u32>, f64)> {
    model.reset();
    if ids.len() > 1 {
        model.prefill(&ids[..ids.len() - 1])?;
    }
    let mut out = Vec::with_capacity(tokens);
    let mut pending = ids[ids.len() - 1];
    let t = Instant::now();
    for _ in 0..tokens {
        pending = argmax(model.step(pending)?, 0)?;
        out.push(pending);
    }
    Ok((out, t.elapsed().as_secs_f64()))
}

pub fn run(args: Args) -> xdna::Result<()> {
    let opts = args.model.load_options(false);
    let kind: DrafterKind = args.drafter.parse()?;
    let longest_prompt = 256;
    let ctx = longest_prompt + args.tokens + 1;
    let (pkg, mut model) = open_model(args.model.path.as_deref(), ctx, &opts)?;
    if model.context() < ctx {
        return Err(xdna::Error::Usage(format!(
            "--tokens {} needs {ctx} positions, the model holds {}",
            args.tokens,
            model.context()
        )));
    }
    if args.tokens == 0 {
        return Err(xdna::Error::Usage("--tokens must be at least 1".into()));
    }
    let mut results = Vec::new();
    for &(name, text) in PROMPTS {
        let ids = pkg.encode_prompt(text, false);
        if ids.is_empty() || ids.len() > longest_prompt {
            return Err(xdna::Error::Usage(format!(
                "built-in prompt {name} has {} tokens (1..={longest_prompt} expected)",
                ids.len()
            )));
        }
        let (mut plain_rates, mut spec_rates) = (Vec::new(), Vec::new());
        let mut identical = true;
        let mut last_stats = None;
        for _ in 0..args.runs.max(1) {
            // Alternate plain and speculative runs so machine-load drift hits both alike.
            let (plain_tokens, plain_s) = plain(&mut model, &ids, args.tokens)?;
            plain_rates.push(args.tokens as f64 / plain_s);

            let drafter = build_drafter(&kind, &args.draft, &pkg, &model, ctx, 0)?;
            let config = args
                .draft
                .spec_config(SamplingConfig::GREEDY, 0, !args.no_fallback);
            let mut runner = SpecRunner::new(config, drafter)?;
            model.reset();
            runner.prefill(&mut model, &ids[..ids.len().saturating_sub(1)])?;
            let t = Instant::now();
            let generation =
                runner.generate(&mut model, &ids, &StopConditions::max_tokens(args.tokens))?;
            spec_rates.push(generation.tokens.len() as f64 / t.elapsed().as_secs_f64());
            identical &= generation.tokens == plain_tokens;
            last_stats = Some(runner.stats().clone());
        }
        let stats = last_stats.unwrap_or_default();
        results.push(PromptResult {
            name,
            prompt_tokens: ids.len(),
            plain_tok_s: median(&mut plain_rates),
            spec_tok_s: median(&mut spec_rates),
            tau: stats.mean_acceptance_length().unwrap_or(1.0),
            tokens_per_pass: stats.tokens_per_pass().unwrap_or(1.0),
            fallbacks: stats.fallback_entries,
            identical,
        });
    }
    if args.json {
        let prompts: Vec<_> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.name, "prompt_tokens": r.prompt_tokens,
                    "plain_tok_s": r.plain_tok_s, "spec_tok_s": r.spec_tok_s,
                    "speedup": r.spec_tok_s / r.plain_tok_s, "tau": r.tau,
                    "tokens_per_pass": r.tokens_per_pass, "fallbacks": r.fallbacks,
                    "identical": r.identical,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "drafter": args.drafter, "draft_max": args.draft.draft_max,
                "tokens": args.tokens, "runs": args.runs.max(1),
                "backend": model.weights().backend, "prompts": prompts,
            })
        );
    } else {
        println!(
            "{:<12} {:>7} {:>12} {:>12} {:>8} {:>6} {:>10} {:>9} {:>9}",
            "prompt",
            "prompt",
            "plain tok/s",
            "spec tok/s",
            "speedup",
            "tau",
            "tok/pass",
            "fallback",
            "identical"
        );
        for r in &results {
            println!(
                "{:<12} {:>7} {:>12.1} {:>12.1} {:>7.2}x {:>6.2} {:>10.2} {:>9} {:>9}",
                r.name,
                r.prompt_tokens,
                r.plain_tok_s,
                r.spec_tok_s,
                r.spec_tok_s / r.plain_tok_s,
                r.tau,
                r.tokens_per_pass,
                r.fallbacks,
                r.identical
            );
        }
        println!(
            "drafter {}, draft-max {}, {} tokens, median of {} runs, backend {}",
            args.drafter,
            args.draft.draft_max,
            args.tokens,
            args.runs.max(1),
            model.weights().backend
        );
    }
    Ok(())
}
