//! What `xdna run --speculate`, `xdna spec-acceptance` and `xdna bench spec` share: the drafter
//! choice (`ngram | draft:PKG | dflash[:PATH] | layerskip:E`), its options, and the statistics report.

use std::path::PathBuf;
use std::str::FromStr;

use xdna::model::dflash::{DflashDraft, DflashWeights};
use xdna::model::load::{open_model, open_package, Backend, LoadOptions};
use xdna::model::sampling::SamplingConfig;
use xdna::model::{Model, MAX_VERIFY_ROWS};
use xdna::spec::{
    DflashDrafter, DraftModelDrafter, Drafter, FallbackConfig, LayerSkipDraftModel, ModelDraft,
    ModelEarlyExit, NgramConfig, NgramDrafter, SpecConfig, SpecStats, MAX_DRAFTS,
};
use xdna::weights::Package;

/// Which drafter proposes the drafts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DrafterKind {
    /// Prompt lookup over the context (no model).
    Ngram,
    /// Another package or GGUF sharing the target's vocabulary, on the host backend.
    Draft(PathBuf),
    /// A DFlash block draft (a `dflash` GGUF or package) reading the target's hidden states;
    /// `None`: the draft trained for the default model, shipped with xdna.
    Dflash(Option<PathBuf>),
    /// The target's first E layers plus its head (self-speculation).
    LayerSkip(usize),
}

impl FromStr for DrafterKind {
    type Err = xdna::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let usage = |why: &str| {
            xdna::Error::Usage(format!(
                "drafter {s:?}: {why} (expected ngram, draft:PKG, dflash, dflash:PATH or layerskip:E)"
            ))
        };
        if s == "ngram" {
            return Ok(DrafterKind::Ngram);
        }
        if let Some(path) = s.strip_prefix("draft:") {
            if path.is_empty() {
                return Err(usage("empty package path"));
            }
            return Ok(DrafterKind::Draft(PathBuf::from(path)));
        }
        if s == "dflash" {
            return Ok(DrafterKind::Dflash(None));
        }
        if let Some(path) = s.strip_prefix("dflash:") {
            if path.is_empty() {
                return Err(usage("empty draft path"));
            }
            return Ok(DrafterKind::Dflash(Some(PathBuf::from(path))));
        }
        if let Some(layers) = s.strip_prefix("layerskip:") {
            let exit = layers
                .parse::<usize>()
                .map_err(|_| usage("the exit layer is not a number"))?;
            if exit == 0 {
                return Err(usage("the exit layer must be at least 1"));
            }
            return Ok(DrafterKind::LayerSkip(exit));
        }
        Err(usage("unknown drafter"))
    }
}

/// Drafter and loop options shared by the speculative commands.
#[derive(clap::Args, Clone, Debug)]
pub struct DraftOptions {
    /// Drafts per round at most (1..=15; a verify pass carries k + 1 ≤ 16 rows).
    #[arg(long, default_value_t = 8)]
    pub draft_max: usize,
    /// N-gram drafter: shortest suffix n-gram that may match.
    #[arg(long, default_value_t = 2)]
    pub ngram_min: usize,
    /// N-gram drafter: longest suffix n-gram, tried first.
    #[arg(long, default_value_t = 4)]
    pub ngram_max: usize,
}

impl DraftOptions {
    /// Checks `--draft-max`.
    pub fn validate(&self) -> xdna::Result<()> {
        if self.draft_max == 0 || self.draft_max > MAX_DRAFTS {
            return Err(xdna::Error::Usage(format!(
                "--draft-max {} is outside 1..={MAX_DRAFTS} (a verify pass holds at most {MAX_VERIFY_ROWS} rows)",
                self.draft_max
            )));
        }
        Ok(())
    }

    /// The loop configuration: adaptive k up to `--draft-max`, fallback on.
    pub fn spec_config(&self, sampling: SamplingConfig, seed: u64, fallback: bool) -> SpecConfig {
        SpecConfig {
            sampling,
            max_drafts: self.draft_max,
            min_drafts: 1,
            initial_drafts: self.draft_max.min(4),
            adaptive_drafts: true,
            fallback: FallbackConfig {
                enabled: fallback,
                ..FallbackConfig::default()
            },
            seed,
        }
    }
}

/// Refuses a draft package whose vocabulary differs from the target's (size or any token's bytes).
pub fn check_same_vocabulary(
    target: &Package,
    target_model: &Model,
    draft: &Package,
    draft_model: &Model,
    draft_path: &std::path::Path,
) -> xdna::Result<()> {
    let refuse = |why: String| {
        xdna::Error::Usage(format!(
            "draft model {} does not share the target's vocabulary: {why}",
            draft_path.display()
        ))
    };
    let (tv, dv) = (target_model.config().vocab, draft_model.config().vocab);
    if tv != dv {
        return Err(refuse(format!("{dv} logits per row, the target has {tv}")));
    }
    let (tt, dt) = (target.tokenizer(), draft.tokenizer());
    if tt.vocab_size() != dt.vocab_size() {
        return Err(refuse(format!(
            "tokenizer of {} tokens, the target's has {}",
            dt.vocab_size(),
            tt.vocab_size()
        )));
    }
    if let Some(id) =
        (0..tt.vocab_size() as u32).find(|&id| tt.token_bytes(id) != dt.token_bytes(id))
    {
        return Err(refuse(format!(
            "token {id} is {:?} in the draft, {:?} in the target",
            String::from_utf8_lossy(dt.token_bytes(id)),
            String::from_utf8_lossy(tt.token_bytes(id))
        )));
    }
    Ok(())
}

/// Builds the drafter. `draft:PKG` is loaded on the host backend with `ctx` positions; the target
/// is only read (vocabulary, layer count).
pub fn build_drafter(
    kind: &DrafterKind,
    options: &DraftOptions,
    target_pkg: &Package,
    target: &Model,
    ctx: usize,
    seed: u64,
) -> xdna::Result<Box<dyn Drafter>> {
    options.validate()?;
    match kind {
        DrafterKind::Ngram => {
            let drafter = NgramDrafter::new(NgramConfig {
                min_n: options.ngram_min,
                max_n: options.ngram_max,
                max_drafts: options.draft_max,
            })?;
            Ok(Box::new(drafter))
        }
        DrafterKind::Draft(path) => {
            let opts = LoadOptions {
                backend: Backend::Host,
                kernels: None,
                exact: false,
            };
            let (draft_pkg, draft_model) = open_model(Some(path), ctx, &opts)?;
            check_same_vocabulary(target_pkg, target, &draft_pkg, &draft_model, path)?;
            if draft_model.context() < ctx {
                return Err(xdna::Error::Usage(format!(
                    "draft model {} holds {} positions, the run needs {ctx}",
                    path.display(),
                    draft_model.context()
                )));
            }
            Ok(Box::new(DraftModelDrafter::new(
                ModelDraft::new(draft_model),
                seed ^ 0xd4af_7d4a,
            )))
        }
        DrafterKind::Dflash(Some(path)) => dflash_drafter(path, target_pkg, target),
        DrafterKind::Dflash(None) => {
            let path = xdna::weights::default_model::default_dflash_draft()?;
            dflash_drafter(&path, target_pkg, target)
        }
        DrafterKind::LayerSkip(exit) => layer_skip_drafter(*exit, target, ctx, seed),
    }
}

/// A DFlash draft bound to the target: same width and vocabulary (checked by the model layer),
/// the same tokens (checked here, token by token).
fn dflash_drafter(
    path: &std::path::Path,
    target_pkg: &Package,
    target: &Model,
) -> xdna::Result<Box<dyn Drafter>> {
    let pkg = open_package(path)?;
    let weights = DflashWeights::load(&pkg, false)?;
    let (tt, dt) = (target_pkg.tokenizer(), pkg.tokenizer());
    let same = tt.vocab_size() == dt.vocab_size()
        && (0..tt.vocab_size() as u32).all(|id| tt.token_bytes(id) == dt.token_bytes(id));
    if !same {
        return Err(xdna::Error::Usage(format!(
            "DFlash draft {} was made for another tokenizer than the target's",
            path.display()
        )));
    }
    let draft = DflashDraft::new(std::sync::Arc::new(weights), target.weights_arc())?;
    Ok(Box::new(DflashDrafter::new(draft)))
}

/// Self-speculation through the target's first `exit` layers: an early-exit view sharing the
/// target's weights, with its own KV cache of `ctx` positions.
fn layer_skip_drafter(
    exit: usize,
    target: &Model,
    ctx: usize,
    seed: u64,
) -> xdna::Result<Box<dyn Drafter>> {
    let view = ModelEarlyExit::new(target, ctx, exit)?;
    let model = LayerSkipDraftModel::new(view, exit)?;
    Ok(Box::new(DraftModelDrafter::new(model, seed ^ 0x1a7e_5c1f)))
}

/// Prints the speculative statistics on stderr: vLLM's one-line summary, then the per-position
/// acceptance and the acceptance-length histogram.
pub fn print_stats(drafter: &str, stats: &SpecStats) {
    eprintln!("[spec] drafter {drafter}: {stats}");
    let tau = stats
        .mean_acceptance_length()
        .map_or("n/a".to_string(), |t| format!("{t:.2}"));
    eprintln!(
        "[spec] rounds {} drafted {} accepted {} tau {} plain steps {} emitted {} fallbacks {} probes {}",
        stats.rounds,
        stats.drafted,
        stats.accepted,
        tau,
        stats.plain_steps,
        stats.emitted,
        stats.fallback_entries,
        stats.probes
    );
    let per_position: Vec<String> = stats
        .per_position_acceptance()
        .iter()
        .map(|r| format!("{r:.3}"))
        .collect();
    eprintln!(
        "[spec] per-position acceptance [{}]",
        per_position.join(", ")
    );
    let longest = stats
        .acceptance_length_histogram
        .iter()
        .rposition(|&c| c > 0)
        .map_or(0, |i| i + 1);
    let histogram: Vec<String> = stats.acceptance_length_histogram[..longest]
        .iter()
        .enumerate()
        .map(|(a, c)| format!("{a}:{c}"))
        .collect();
    eprintln!(
        "[spec] acceptance-length histogram (accepted drafts: rounds) [{}]",
        histogram.join(" ")
    );
}
