//! `xdna bench spec`: plain and speculative greedy decoding side by side over a built-in prompt set
//! (code, a numbered list, prose, repetitive text), with τ per prompt.

use std::time::Instant;

use xdna::cli::ModelArgs;
use xdna::model::load::open_model;
use xdna::model::sampling::{argmax, SamplingConfig};
use xdna::model::Model;
use xdna::spec::{SpecRunner, SpecStats, StopConditions};

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
    /// Drafter: ngram | draft:PKG | dflash[:PATH] | layerskip:E (`dflash`: the draft shipped for the default model).
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
    /// Prompts instead of the built-in set (the format of `xdna spec-acceptance --prompts`: one
    /// per line, or JSON objects with `prompt` and `name`); names `KIND-…` (e.g. `prose-3`,
    /// `code-1`) are also summed per kind.
    #[arg(long)]
    prompts: Option<std::path::PathBuf>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

struct PromptResult {
    name: String,
    prompt_tokens: usize,
    plain_tok_s: f64,
    spec_tok_s: f64,
    tau: f64,
    tokens_per_pass: f64,
    fallbacks: u64,
    identical: bool,
    /// The runs' tokens, plain decode seconds, speculative seconds, and drafting seconds.
    tokens: usize,
    plain_seconds: f64,
    spec_seconds: f64,
    draft_seconds: f64,
}

impl PromptResult {
    /// Share of the speculative run's time spent drafting.
    fn draft_share(&self) -> f64 {
        if self.spec_seconds > 0.0 {
            self.draft_seconds / self.spec_seconds
        } else {
            0.0
        }
    }
}

/// Per-kind totals: prompts named `KIND-…` summed (tokens over seconds, so long prompts weigh
/// more), with the rounds' τ pooled.
struct KindTotal {
    kind: String,
    prompts: usize,
    tokens: usize,
    plain_seconds: f64,
    spec_seconds: f64,
    draft_seconds: f64,
    stats: SpecStats,
    identical: bool,
}

fn kind_totals(results: &[PromptResult], stats: &[SpecStats]) -> Vec<KindTotal> {
    let mut out: Vec<KindTotal> = Vec::new();
    for (r, s) in results.iter().zip(stats) {
        let Some((kind, _)) = r.name.split_once('-') else {
            continue;
        };
        let at = match out.iter().position(|k| k.kind == kind) {
            Some(i) => i,
            None => {
                out.push(KindTotal {
                    kind: kind.to_string(),
                    prompts: 0,
                    tokens: 0,
                    plain_seconds: 0.0,
                    spec_seconds: 0.0,
                    draft_seconds: 0.0,
                    stats: SpecStats::default(),
                    identical: true,
                });
                out.len() - 1
            }
        };
        let k = &mut out[at];
        k.prompts += 1;
        k.tokens += r.tokens;
        k.plain_seconds += r.plain_seconds;
        k.spec_seconds += r.spec_seconds;
        k.draft_seconds += r.draft_seconds;
        k.stats.merge(s);
        k.identical &= r.identical;
    }
    out.retain(|k| k.prompts > 1);
    out
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
    let prompts: Vec<(String, String)> = match &args.prompts {
        None => PROMPTS
            .iter()
            .map(|&(n, t)| (n.to_string(), t.to_string()))
            .collect(),
        Some(path) => {
            let content = std::fs::read_to_string(path).map_err(|e| xdna::Error::io(path, e))?;
            super::spec_acceptance::parse_prompts(path, &content)?
                .into_iter()
                .map(|p| (p.name, p.text))
                .collect()
        }
    };
    let mut results = Vec::new();
    let mut all_stats = Vec::new();
    for (name, text) in &prompts {
        let ids = pkg.encode_prompt(text, false);
        if ids.is_empty() || ids.len() > longest_prompt {
            return Err(xdna::Error::Usage(format!(
                "prompt {name} has {} tokens (1..={longest_prompt} expected)",
                ids.len()
            )));
        }
        let (mut plain_rates, mut spec_rates) = (Vec::new(), Vec::new());
        let (mut plain_times, mut spec_times, mut draft_times) =
            (Vec::new(), Vec::new(), Vec::new());
        let mut identical = true;
        let mut last_stats = None;
        for _ in 0..args.runs.max(1) {
            // Alternate plain and speculative runs so machine-load drift hits both alike.
            let (plain_tokens, plain_s) = plain(&mut model, &ids, args.tokens)?;
            plain_rates.push(args.tokens as f64 / plain_s);
            plain_times.push(plain_s);

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
            let spec_s = t.elapsed().as_secs_f64();
            spec_rates.push(generation.tokens.len() as f64 / spec_s);
            spec_times.push(spec_s);
            draft_times.push(runner.stats().draft_seconds);
            identical &= generation.tokens == plain_tokens;
            last_stats = Some(runner.stats().clone());
        }
        let stats = last_stats.unwrap_or_default();
        results.push(PromptResult {
            name: name.clone(),
            prompt_tokens: ids.len(),
            plain_tok_s: median(&mut plain_rates),
            spec_tok_s: median(&mut spec_rates),
            tau: stats.mean_acceptance_length().unwrap_or(1.0),
            tokens_per_pass: stats.tokens_per_pass().unwrap_or(1.0),
            fallbacks: stats.fallback_entries,
            identical,
            tokens: args.tokens,
            plain_seconds: median(&mut plain_times),
            spec_seconds: median(&mut spec_times),
            draft_seconds: median(&mut draft_times),
        });
        all_stats.push(stats);
    }
    let kinds = kind_totals(&results, &all_stats);
    if args.json {
        let prompts: Vec<_> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.name, "prompt_tokens": r.prompt_tokens,
                    "plain_tok_s": r.plain_tok_s, "spec_tok_s": r.spec_tok_s,
                    "speedup": r.spec_tok_s / r.plain_tok_s, "tau": r.tau,
                    "tokens_per_pass": r.tokens_per_pass, "fallbacks": r.fallbacks,
                    "identical": r.identical, "draft_share": r.draft_share(),
                })
            })
            .collect();
        let kinds: Vec<_> = kinds
            .iter()
            .map(|k| {
                serde_json::json!({
                    "kind": k.kind, "prompts": k.prompts, "tokens": k.tokens,
                    "plain_tok_s": k.tokens as f64 / k.plain_seconds,
                    "spec_tok_s": k.tokens as f64 / k.spec_seconds,
                    "speedup": k.plain_seconds / k.spec_seconds,
                    "tau": k.stats.mean_acceptance_length().unwrap_or(1.0),
                    "draft_share": k.draft_seconds / k.spec_seconds,
                    "identical": k.identical,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "drafter": args.drafter, "draft_max": args.draft.draft_max,
                "tokens": args.tokens, "runs": args.runs.max(1),
                "backend": model.weights().backend, "prompts": prompts, "kinds": kinds,
            })
        );
    } else {
        println!(
            "{:<12} {:>7} {:>12} {:>12} {:>8} {:>6} {:>10} {:>7} {:>9} {:>9}",
            "prompt",
            "prompt",
            "plain tok/s",
            "spec tok/s",
            "speedup",
            "tau",
            "tok/pass",
            "draft",
            "fallback",
            "identical"
        );
        for r in &results {
            println!(
                "{:<12} {:>7} {:>12.1} {:>12.1} {:>7.2}x {:>6.2} {:>10.2} {:>6.1}% {:>9} {:>9}",
                r.name,
                r.prompt_tokens,
                r.plain_tok_s,
                r.spec_tok_s,
                r.spec_tok_s / r.plain_tok_s,
                r.tau,
                r.tokens_per_pass,
                100.0 * r.draft_share(),
                r.fallbacks,
                r.identical
            );
        }
        for k in &kinds {
            println!(
                "{:<12} {:>7} {:>12.1} {:>12.1} {:>7.2}x {:>6.2} {:>10} {:>6.1}% {:>9} {:>9}",
                format!("{} ({})", k.kind, k.prompts),
                "",
                k.tokens as f64 / k.plain_seconds,
                k.tokens as f64 / k.spec_seconds,
                k.plain_seconds / k.spec_seconds,
                k.stats.mean_acceptance_length().unwrap_or(1.0),
                "",
                100.0 * k.draft_seconds / k.spec_seconds,
                "",
                k.identical
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
