//! `xdna spec-acceptance`: how many tokens per round a drafter would yield on the target's own
//! greedy continuations, measured without running the target during the replay.
//!
//! 1. Record: for every prompt, the target's greedy continuation — locally (`--model`), or from an
//!    OpenAI-compatible `/v1/completions` endpoint at temperature 0 (`--endpoint`), re-tokenized
//!    with the package's tokenizer.
//! 2. Replay: walk each continuation as the speculative loop would commit it. At every committed
//!    prefix the drafter proposes k = min(--draft-max, remaining − 1) drafts; the round accepts the
//!    longest prefix of drafts equal to the recorded tokens and emits that plus one token. A DFlash
//!    draft reads the target's hidden states: one tapped prefill of the target over prompt and
//!    continuation gives them, and each round hands it the rows it committed.
//! 3. Report τ and tokens per pass per prompt and overall; with `--pass-ms` and `--step-ms`, the
//!    projected speedups of a one-pass and a two-pass round (formulas in `docs/speculative.md`).

use std::path::{Path, PathBuf};

use xdna::cli::ModelArgs;
use xdna::model::load::{load, open_package};
use xdna::model::sampling::argmax;
use xdna::model::Model;
use xdna::spec::{
    projected_speedups, replay_acceptance, replay_acceptance_tapped, ReplayTaps, SpecStats,
};
use xdna::weights::Package;

use super::spec_common::{build_drafter, DraftOptions, DrafterKind};

#[derive(clap::Args)]
pub struct Args {
    /// Prompts: one per line (blank lines and `#` comments skipped); a line starting with `{` is a
    /// JSON object with `prompt` (and optional `name`), a line starting with `"` a JSON string.
    #[arg(long)]
    prompts: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
    /// Record continuations from this OpenAI-compatible server (`http://host:port`, or the full
    /// `.../v1/completions` URL) instead of running the target locally; `--model` still gives the
    /// tokenizer and the base of layer-skip drafting.
    #[arg(long)]
    endpoint: Option<String>,
    /// `model` field sent to the endpoint.
    #[arg(long)]
    endpoint_model: Option<String>,
    /// Drafter: ngram | draft:PKG | dflash[:PATH] | layerskip:E. A DFlash draft is handed the
    /// target's hidden states of the recorded text (one tapped prefill over it).
    #[arg(long, default_value = "ngram")]
    drafter: String,
    #[command(flatten)]
    draft: DraftOptions,
    /// Tokens of continuation recorded per prompt.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Measured time of one verify pass (k + 1 rows), in ms: enables the speedup projection.
    #[arg(long, requires = "step_ms")]
    pass_ms: Option<f64>,
    /// Measured time of one plain decode step (1 row), in ms.
    #[arg(long, requires = "pass_ms")]
    step_ms: Option<f64>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// One prompt of the prompts file.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptEntry {
    pub name: String,
    pub text: String,
}

/// Parses a prompts file (format in [`Args::prompts`]); errors name the file and line.
pub fn parse_prompts(path: &Path, content: &str) -> xdna::Result<Vec<PromptEntry>> {
    let mut prompts = Vec::new();
    for (number, line) in content.lines().enumerate() {
        let at = || format!("{}:{}", path.display(), number + 1);
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let default_name = format!("line{}", number + 1);
        let entry = if trimmed.starts_with('{') {
            let value: serde_json::Value = serde_json::from_str(trimmed)
                .map_err(|e| xdna::Error::Usage(format!("{}: invalid JSON: {e}", at())))?;
            let text = value
                .get("prompt")
                .and_then(|p| p.as_str())
                .ok_or_else(|| {
                    xdna::Error::Usage(format!("{}: the object has no string \"prompt\"", at()))
                })?
                .to_string();
            let name = value
                .get("name")
                .and_then(|n| n.as_str())
                .map_or(default_name, str::to_string);
            PromptEntry { name, text }
        } else if trimmed.starts_with('"') {
            let text: String = serde_json::from_str(trimmed)
                .map_err(|e| xdna::Error::Usage(format!("{}: invalid JSON string: {e}", at())))?;
            PromptEntry {
                name: default_name,
                text,
            }
        } else {
            PromptEntry {
                name: default_name,
                text: line.to_string(),
            }
        };
        if entry.text.is_empty() {
            return Err(xdna::Error::Usage(format!("{}: empty prompt", at())));
        }
        prompts.push(entry);
    }
    if prompts.is_empty() {
        return Err(xdna::Error::Usage(format!(
            "{}: no prompts",
            path.display()
        )));
    }
    Ok(prompts)
}

fn prompt_ids(pkg: &Package, text: &str) -> Vec<u32> {
    pkg.encode_prompt(text, false)
}

/// The target's greedy continuation, computed locally: EOS included when reached.
fn record_local(
    model: &mut Model,
    ids: &[u32],
    eos: &[u32],
    max_tokens: usize,
) -> xdna::Result<Vec<u32>> {
    model.reset();
    let mut out = Vec::new();
    let mut next = argmax(model.prefill(ids)?, 0)?;
    while out.len() < max_tokens {
        out.push(next);
        if eos.contains(&next) || out.len() == max_tokens || model.position() + 1 >= model.context()
        {
            break;
        }
        next = argmax(model.step(next)?, 0)?;
    }
    Ok(out)
}

/// The target's hidden states after the `taps` layers at every position of `tokens`, read in one
/// tapped prefill: `out` = `[positions][taps][hidden]`.
fn target_states(
    model: &mut Model,
    tokens: &[u32],
    taps: &[usize],
    out: &mut Vec<f32>,
) -> xdna::Result<()> {
    model.reset();
    out.clear();
    model.prefill_tapped(tokens, taps, &mut |pass| {
        for row in 0..pass.rows() {
            for t in 0..taps.len() {
                out.extend_from_slice(pass.tap(t, row));
            }
        }
    })?;
    model.reset();
    Ok(())
}

/// `.../v1/completions` for an endpoint given as a base URL or as the full URL.
fn completions_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/completions") {
        base.to_string()
    } else if base.ends_with("/v1") {
        format!("{base}/completions")
    } else {
        format!("{base}/v1/completions")
    }
}

/// The endpoint's greedy completion text for `prompt` (temperature 0).
pub fn record_endpoint(
    url: &str,
    model: Option<&str>,
    prompt: &str,
    max_tokens: usize,
) -> xdna::Result<String> {
    let mut body = serde_json::json!({
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": false,
    });
    if let Some(model) = model {
        body["model"] = serde_json::Value::from(model);
    }
    let failed = |why: String| xdna::Error::Usage(format!("endpoint {url}: {why}"));
    let response = ureq::post(url)
        .set("Content-Type", "application/json")
        .timeout(std::time::Duration::from_secs(600))
        .send_string(&body.to_string())
        .map_err(|e| match e {
            ureq::Error::Status(code, response) => failed(format!(
                "HTTP {code}: {}",
                response.into_string().unwrap_or_default()
            )),
            other => failed(other.to_string()),
        })?;
    let text = response
        .into_string()
        .map_err(|e| failed(format!("reading the response: {e}")))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| failed(format!("the response is not JSON ({e}): {text:.200}")))?;
    value
        .get("choices")
        .and_then(|c| c.get(0))
        .and_then(|c| c.get("text"))
        .and_then(|t| t.as_str())
        .map(str::to_string)
        .ok_or_else(|| failed(format!("no choices[0].text in the response: {text:.200}")))
}

struct PromptReport {
    name: String,
    prompt_tokens: usize,
    stats: SpecStats,
}

fn report_json(
    name: &str,
    prompt_tokens: Option<usize>,
    stats: &SpecStats,
    projection: Option<(f64, f64)>,
) -> serde_json::Value {
    let mut value = serde_json::json!({
        "name": name,
        "tokens": stats.emitted,
        "rounds": stats.rounds,
        "plain_steps": stats.plain_steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "tau": stats.mean_acceptance_length(),
        "tokens_per_pass": stats.tokens_per_pass(),
        "acceptance_rate": stats.draft_acceptance_rate(),
        "per_position_acceptance": stats.per_position_acceptance(),
        "acceptance_length_histogram": stats.acceptance_length_histogram.to_vec(),
    });
    if let Some(tokens) = prompt_tokens {
        value["prompt_tokens"] = serde_json::Value::from(tokens);
    }
    if let Some((one, two)) = projection {
        value["speedup_one_pass"] = serde_json::Value::from(one);
        value["speedup_two_pass"] = serde_json::Value::from(two);
    }
    value
}

pub fn run(args: Args) -> xdna::Result<()> {
    args.draft.validate()?;
    if let (Some(pass), Some(step)) = (args.pass_ms, args.step_ms) {
        if !(pass > 0.0 && step > 0.0 && pass.is_finite() && step.is_finite()) {
            return Err(xdna::Error::Usage(format!(
                "--pass-ms {pass} and --step-ms {step} must be positive"
            )));
        }
    }
    if args.max_tokens == 0 {
        return Err(xdna::Error::Usage("--max-tokens must be at least 1".into()));
    }
    let content =
        std::fs::read_to_string(&args.prompts).map_err(|e| xdna::Error::io(&args.prompts, e))?;
    let prompts = parse_prompts(&args.prompts, &content)?;
    let kind: DrafterKind = args.drafter.parse()?;
    let opts = args.model.load_options(false);
    let mut encoded = Vec::new();
    let path = match &args.model.path {
        Some(path) => path.clone(),
        None => xdna::weights::default_model()?,
    };
    let pkg = open_package(&path)?;
    for prompt in &prompts {
        let ids = prompt_ids(&pkg, &prompt.text);
        if ids.is_empty() {
            return Err(xdna::Error::Usage(format!(
                "prompt {} encodes to no tokens",
                prompt.name
            )));
        }
        encoded.push(ids);
    }
    // The model is loaded for the drafter in every mode (layer skip shares its weights); it runs
    // only to record locally — the replay never calls it.
    let ctx = encoded.iter().map(Vec::len).max().unwrap_or(0) + args.max_tokens + 1;
    let mut model = Model::new(load(&pkg, &opts)?, ctx)?;
    let eos = pkg.eos_token_ids().to_vec();
    let mut continuations = Vec::new();
    for (prompt, ids) in prompts.iter().zip(&encoded) {
        let continuation = match &args.endpoint {
            None => record_local(&mut model, ids, &eos, args.max_tokens)?,
            Some(endpoint) => {
                let url = completions_url(endpoint);
                let text = record_endpoint(
                    &url,
                    args.endpoint_model.as_deref(),
                    &prompt.text,
                    args.max_tokens,
                )?;
                pkg.tokenizer().encode(&text, false)
            }
        };
        continuations.push(continuation);
    }
    model.reset();
    let mut drafter = build_drafter(&kind, &args.draft, &pkg, &model, model.context(), 0)?;
    let taps = drafter.target_taps().to_vec();
    let mut reports = Vec::new();
    let mut total = SpecStats::default();
    let mut states = Vec::new();
    for ((prompt, ids), continuation) in prompts.iter().zip(&encoded).zip(&continuations) {
        let stats = if taps.is_empty() {
            replay_acceptance(drafter.as_mut(), ids, continuation, args.draft.draft_max)?
        } else {
            // A drafter reading the target's hidden states (DFlash): one tapped prefill over the
            // prompt and the recorded continuation gives the rows every round commits, and each
            // prompt starts a fresh draft context.
            let fed: Vec<u32> = ids
                .iter()
                .chain(continuation)
                .copied()
                .take((ids.len() + continuation.len()).saturating_sub(1))
                .collect();
            target_states(&mut model, &fed, &taps, &mut states)?;
            drafter = build_drafter(&kind, &args.draft, &pkg, &model, model.context(), 0)?;
            let rows = ReplayTaps {
                states: &states,
                taps: taps.len(),
                hidden: pkg.config().hidden,
            };
            replay_acceptance_tapped(
                drafter.as_mut(),
                ids,
                continuation,
                args.draft.draft_max,
                Some(rows),
            )?
        };
        total.merge(&stats);
        reports.push(PromptReport {
            name: prompt.name.clone(),
            prompt_tokens: ids.len(),
            stats,
        });
    }
    let projection = |stats: &SpecStats| {
        args.pass_ms
            .zip(args.step_ms)
            .map(|(pass, step)| projected_speedups(stats, pass, step))
    };
    if args.json {
        let prompts: Vec<_> = reports
            .iter()
            .map(|r| {
                report_json(
                    &r.name,
                    Some(r.prompt_tokens),
                    &r.stats,
                    projection(&r.stats),
                )
            })
            .collect();
        let mut value = serde_json::json!({
            "drafter": args.drafter,
            "draft_max": args.draft.draft_max,
            "source": if args.endpoint.is_some() { "endpoint" } else { "local" },
            "prompts": prompts,
            "overall": report_json("overall", None, &total, projection(&total)),
        });
        if let (Some(pass), Some(step)) = (args.pass_ms, args.step_ms) {
            value["pass_ms"] = serde_json::Value::from(pass);
            value["step_ms"] = serde_json::Value::from(step);
        }
        println!("{value}");
        return Ok(());
    }
    let with_projection = args.pass_ms.is_some();
    print!(
        "{:<16} {:>7} {:>7} {:>7} {:>6} {:>8} {:>8} {:>6} {:>9}",
        "prompt", "tokens", "rounds", "plain", "tau", "tok/pass", "accepted", "alpha", "drafted"
    );
    if with_projection {
        print!(" {:>9} {:>9}", "1-pass", "2-pass");
    }
    println!();
    let row = |name: &str, stats: &SpecStats| {
        print!(
            "{:<16} {:>7} {:>7} {:>7} {:>6.2} {:>8.2} {:>8} {:>5.1}% {:>9}",
            name,
            stats.emitted,
            stats.rounds,
            stats.plain_steps,
            stats.mean_acceptance_length().unwrap_or(1.0),
            stats.tokens_per_pass().unwrap_or(1.0),
            stats.accepted,
            100.0 * stats.draft_acceptance_rate().unwrap_or(0.0),
            stats.drafted
        );
        if let Some((one, two)) = projection(stats) {
            print!(" {:>8.2}x {:>8.2}x", one, two);
        }
        println!();
    };
    for r in &reports {
        row(&r.name, &r.stats);
    }
    row("overall", &total);
    print!(
        "drafter {}, draft-max {}, continuations from {}",
        args.drafter,
        args.draft.draft_max,
        args.endpoint.as_deref().unwrap_or("the local model")
    );
    if let (Some(pass), Some(step)) = (args.pass_ms, args.step_ms) {
        print!(
            "; projection: step {step} ms, pass {pass} ms; 1-pass round = N·s/(R·p + Z·s), 2-pass round = N·s/(R·2p + Z·s)"
        );
    }
    println!();
    Ok(())
}
