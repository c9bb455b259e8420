//! The speculative loop: draft, verify in one pass, decide, commit, emit.

use std::ops::ControlFlow;
use std::time::Instant;

use super::decide::{uniforms_needed, AcceptanceRule, DecideWorkspace, DraftProbabilities};
use super::drafter::{DraftProposal, Drafter};
use super::stats::SpecStats;
use super::target::{LogitRows, VerifyTarget, MAX_DRAFTS, MAX_VERIFY_ROWS};
use super::{BoxedError, SpecError};
use crate::model::sampling::{Rng, SamplingConfig};

/// When generation stops. Stop tokens and sequences are emitted (the caller may strip them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopConditions {
    /// Tokens to emit at most.
    pub max_tokens: usize,
    /// End-of-sequence tokens.
    pub eos_tokens: Vec<u32>,
    /// Token sequences that end generation once the output ends with one of them.
    pub stop_sequences: Vec<Vec<u32>>,
}

impl StopConditions {
    /// Stop after `max_tokens` tokens only.
    pub fn max_tokens(max_tokens: usize) -> Self {
        StopConditions {
            max_tokens,
            ..Self::default()
        }
    }

    /// The same, also stopping at `eos`.
    pub fn with_eos(mut self, eos: u32) -> Self {
        self.eos_tokens.push(eos);
        self
    }

    fn check(&self, output: &[u32]) -> Option<FinishReason> {
        let last = *output.last()?;
        if self.eos_tokens.contains(&last) {
            return Some(FinishReason::Eos);
        }
        if self
            .stop_sequences
            .iter()
            .any(|sequence| !sequence.is_empty() && output.ends_with(sequence))
        {
            return Some(FinishReason::StopSequence);
        }
        (output.len() >= self.max_tokens).then_some(FinishReason::MaxTokens)
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS token was emitted (it is the last output token).
    Eos,
    /// The output ends with a stop sequence.
    StopSequence,
    /// `max_tokens` were emitted.
    MaxTokens,
    /// The caller's callback asked to stop (e.g. a text-level stop string was printed).
    Cancelled,
}

/// The output of [`SpecRunner::generate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    /// Emitted tokens, stop token included.
    pub tokens: Vec<u32>,
    /// Why generation ended.
    pub finish: FinishReason,
}

/// When to stop speculating and decode plainly.
#[derive(Clone, Debug, PartialEq)]
pub struct FallbackConfig {
    /// Whether the loop may fall back to plain decoding at all.
    pub enabled: bool,
    /// Speculative rounds measured before the first decision.
    pub warmup_rounds: u64,
    /// Plain tokens between a fallback and the first re-probe; doubles after each failed probe.
    pub probe_interval: usize,
    /// Cap of the doubling probe interval.
    pub max_probe_interval: usize,
    /// EWMA weight of a new measurement (a probe uses at least 0.5).
    pub ewma_weight: f64,
    /// While speculating, one plain step every this many rounds keeps the 1-row cost current.
    pub recalibrate_every: u64,
}

impl Default for FallbackConfig {
    fn default() -> Self {
        FallbackConfig {
            enabled: true,
            warmup_rounds: 8,
            probe_interval: 16,
            max_probe_interval: 256,
            ewma_weight: 0.25,
            recalibrate_every: 32,
        }
    }
}

/// Loop parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecConfig {
    /// Sampling configuration (temperature 0 = greedy); p is computed with it.
    pub sampling: SamplingConfig,
    /// Drafts per round at most (≤ 15).
    pub max_drafts: usize,
    /// Drafts per round at least while speculating (≥ 1, ≤ `max_drafts`).
    pub min_drafts: usize,
    /// Drafts asked for in the first round.
    pub initial_drafts: usize,
    /// Grow k on full acceptance, shrink it on early rejection.
    pub adaptive_drafts: bool,
    /// Fallback to plain decoding.
    pub fallback: FallbackConfig,
    /// Seed of the uniforms the acceptance rule consumes: the same stream as a plain
    /// `model::sampling::Sampler` with this seed, so rounds without drafts draw its tokens.
    pub seed: u64,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            sampling: SamplingConfig::GREEDY,
            max_drafts: 8,
            min_drafts: 1,
            initial_drafts: 4,
            adaptive_drafts: true,
            fallback: FallbackConfig::default(),
            seed: 0x5eed,
        }
    }
}

impl SpecConfig {
    /// Checks every range.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.sampling.validate()?;
        if self.max_drafts > MAX_DRAFTS {
            return Err(SpecError::config("max_drafts", self.max_drafts, "≤ 15"));
        }
        if self.min_drafts == 0 || self.min_drafts > self.max_drafts.max(1) {
            return Err(SpecError::config(
                "min_drafts",
                self.min_drafts,
                "in 1..=max_drafts",
            ));
        }
        if self.initial_drafts > self.max_drafts {
            return Err(SpecError::config(
                "initial_drafts",
                self.initial_drafts,
                "≤ max_drafts",
            ));
        }
        let weight = self.fallback.ewma_weight;
        if !(weight > 0.0 && weight <= 1.0) {
            return Err(SpecError::config(
                "fallback ewma_weight",
                weight,
                "in (0, 1]",
            ));
        }
        if self.fallback.probe_interval == 0
            || self.fallback.max_probe_interval < self.fallback.probe_interval
        {
            return Err(SpecError::config(
                "fallback probe_interval",
                self.fallback.probe_interval,
                "≥ 1 and ≤ max_probe_interval",
            ));
        }
        Ok(())
    }
}

/// Measured costs, as exponentially weighted moving averages.
///
/// Speculation pays when the tokens a round yields exceed the plain steps its time would buy:
/// `τ_measured > break_even_τ = (draft time + verify time of a round) / (time of a 1-row step)`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostModel {
    pass_seconds: [Option<f64>; MAX_VERIFY_ROWS + 1],
    round_seconds: Option<f64>,
    round_tokens: Option<f64>,
}

/// A sample more than this many times the running mean (a scheduler stall) counts as this much.
const OUTLIER_FACTOR: f64 = 4.0;

fn ewma(old: Option<f64>, new: f64, weight: f64) -> Option<f64> {
    Some(match old {
        Some(old) => old + weight * (new.min(old * OUTLIER_FACTOR) - old),
        None => new,
    })
}

impl CostModel {
    /// Records a verify pass of `rows` rows taking `seconds` (pass + decide + commit).
    pub fn record_pass(&mut self, rows: usize, seconds: f64, weight: f64) {
        if let Some(slot) = self.pass_seconds.get_mut(rows) {
            *slot = ewma(*slot, seconds, weight);
        }
    }

    /// Records a speculative round: drafting plus its pass took `seconds` and the rule accepted
    /// `tokens - 1` drafts.
    pub fn record_round(&mut self, seconds: f64, tokens: usize, weight: f64) {
        self.round_seconds = ewma(self.round_seconds, seconds, weight);
        self.round_tokens = ewma(self.round_tokens, tokens as f64, weight);
    }

    /// Mean seconds of a pass of `rows` rows, if measured.
    pub fn pass_seconds(&self, rows: usize) -> Option<f64> {
        self.pass_seconds.get(rows).copied().flatten()
    }

    /// Mean tokens per speculative round (τ as the fallback sees it), if measured.
    pub fn measured_tau(&self) -> Option<f64> {
        self.round_tokens
    }

    /// τ at which a speculative round costs as much per token as plain decoding.
    pub fn break_even_tau(&self) -> Option<f64> {
        let plain = self.pass_seconds(1)?;
        let round = self.round_seconds?;
        (plain > 0.0).then(|| round / plain)
    }

    /// Whether speculation pays, once both sides are measured.
    pub fn speculation_pays(&self) -> Option<bool> {
        Some(self.measured_tau()? >= self.break_even_tau()?)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Speculating,
    /// Plain decoding; a probe round follows after `tokens_until_probe` plain tokens.
    Plain {
        tokens_until_probe: usize,
    },
}

/// The speculative decoding loop over a [`VerifyTarget`] and a [`Drafter`].
#[derive(Debug)]
pub struct SpecRunner<D> {
    config: SpecConfig,
    rule: AcceptanceRule,
    drafter: D,
    uniforms: Rng,
    workspace: DecideWorkspace,
    proposal: DraftProposal,
    uniform_buffer: Vec<f64>,
    pass_tokens: Vec<u32>,
    stats: SpecStats,
    costs: CostModel,
    draft_len: usize,
    mode: Mode,
    probe_interval: usize,
    rounds_since_plain_step: u64,
}

impl<D: Drafter> SpecRunner<D> {
    /// A loop with a validated configuration.
    pub fn new(config: SpecConfig, drafter: D) -> Result<Self, SpecError> {
        config.validate()?;
        let rule = AcceptanceRule::for_sampling(&config.sampling);
        Ok(SpecRunner {
            rule,
            drafter,
            uniforms: Rng::new(config.seed),
            workspace: DecideWorkspace::new(),
            proposal: DraftProposal::new(),
            uniform_buffer: Vec::new(),
            pass_tokens: Vec::with_capacity(MAX_VERIFY_ROWS),
            stats: SpecStats::default(),
            costs: CostModel::default(),
            draft_len: config
                .initial_drafts
                .max(config.min_drafts)
                .min(config.max_drafts),
            mode: Mode::Speculating,
            probe_interval: config.fallback.probe_interval,
            rounds_since_plain_step: 0,
            config,
        })
    }

    /// Statistics since creation (or the last [`reset_stats`](Self::reset_stats)).
    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }

    /// Clears the statistics.
    pub fn reset_stats(&mut self) {
        self.stats = SpecStats::default();
    }

    /// The measured costs.
    pub fn costs(&self) -> &CostModel {
        &self.costs
    }

    /// Drafts the next speculative round will ask for.
    pub fn draft_len(&self) -> usize {
        self.draft_len
    }

    /// True while the loop decodes plainly because speculation did not pay.
    pub fn is_falling_back(&self) -> bool {
        matches!(self.mode, Mode::Plain { .. })
    }

    /// The drafter.
    pub fn drafter(&self) -> &D {
        &self.drafter
    }

    /// The drafter, mutably.
    pub fn drafter_mut(&mut self) -> &mut D {
        &mut self.drafter
    }

    /// The drafter back (e.g. a draft model to reuse in another loop).
    pub fn into_drafter(self) -> D {
        self.drafter
    }

    /// Generates from `context` (every token so far; the last one is pending: sampled or the
    /// prompt's last token, not yet fed). The target must hold exactly `context.len() - 1`
    /// committed positions. On return the target holds `context.len() - 1 + tokens.len()`
    /// positions and the last emitted token is pending, exactly as after plain decoding.
    ///
    /// On an error from the target's pass nothing was committed. An error from the acceptance
    /// rule (bad logits) leaves the pass uncommitted; the target then refuses a new pass, and the
    /// sequence has to be reset by the caller.
    pub fn generate<T: VerifyTarget>(
        &mut self,
        target: &mut T,
        context: &[u32],
        stop: &StopConditions,
    ) -> Result<Generation, SpecError> {
        self.generate_streaming(target, context, stop, |_| {})
    }

    /// Feeds and commits `tokens` to `target` (the context before its pending token, before
    /// [`generate`](Self::generate)); a drafter that reads the target's hidden states
    /// ([`Drafter::target_taps`]) gets every row's.
    pub fn prefill<T: VerifyTarget>(
        &mut self,
        target: &mut T,
        tokens: &[u32],
    ) -> Result<(), SpecError> {
        if tokens.is_empty() {
            return Ok(());
        }
        if !target.request_taps(self.drafter.target_taps()) {
            return Err(SpecError::TargetTaps {
                drafter: self.drafter.name(),
            });
        }
        let drafter = &mut self.drafter;
        let mut failure = None;
        target
            .prefill_tapped(tokens, &mut |rows| {
                if failure.is_none() {
                    failure = drafter.observe_target_rows(rows).err();
                }
            })
            .map_err(|e| target_error("prefill", e))?;
        failure.map_or(Ok(()), Err)
    }

    /// [`generate`](Self::generate), handing each round's emitted tokens to `on_tokens` as soon as
    /// they are committed (for streaming servers).
    pub fn generate_streaming<T: VerifyTarget>(
        &mut self,
        target: &mut T,
        context: &[u32],
        stop: &StopConditions,
        mut on_tokens: impl FnMut(&[u32]),
    ) -> Result<Generation, SpecError> {
        self.generate_controlled(target, context, stop, |tokens| {
            on_tokens(tokens);
            ControlFlow::Continue(())
        })
    }

    /// [`generate_streaming`](Self::generate_streaming) whose callback may end generation after
    /// any round by returning `Break` (finish reason [`FinishReason::Cancelled`]); the target is
    /// then in the plain-decoding state after the tokens handed out so far.
    pub fn generate_controlled<T: VerifyTarget>(
        &mut self,
        target: &mut T,
        context: &[u32],
        stop: &StopConditions,
        mut on_tokens: impl FnMut(&[u32]) -> ControlFlow<()>,
    ) -> Result<Generation, SpecError> {
        if context.is_empty() || target.position() + 1 != context.len() {
            return Err(SpecError::ContextMismatch {
                context_len: context.len(),
                position: target.position(),
            });
        }
        let vocab = target.vocab_size();
        let mut sequence = context.to_vec();
        let mut output = Vec::new();
        if stop.max_tokens == 0 {
            return Ok(Generation {
                tokens: output,
                finish: FinishReason::MaxTokens,
            });
        }
        let tapped = !self.drafter.target_taps().is_empty();
        if !target.request_taps(self.drafter.target_taps()) {
            return Err(SpecError::TargetTaps {
                drafter: self.drafter.name(),
            });
        }
        self.drafter.begin(&sequence)?;
        loop {
            let remaining = stop.max_tokens - output.len();
            let (requested, probing) = self.drafts_to_request(remaining);

            let draft_start = Instant::now();
            if requested > 0 {
                self.drafter
                    .propose(&sequence, requested, &self.rule, &mut self.proposal)?;
                self.proposal.truncate(requested);
                if !self.proposal.is_one_hot()
                    && !self.proposal.is_empty()
                    && self.proposal.vocab() != vocab
                {
                    return Err(SpecError::VocabMismatch {
                        target: vocab,
                        drafter: self.proposal.vocab(),
                    });
                }
            } else {
                self.proposal.reset(true, 0);
            }
            let draft_seconds = draft_start.elapsed().as_secs_f64();
            let drafted = self.proposal.len();
            // Refuse a malformed proposal before the pass, so the target is never left with an
            // uncommitted pass because of a drafter bug.
            check_proposal(&self.proposal, vocab)?;

            let pending = *sequence.last().ok_or(SpecError::ContextMismatch {
                context_len: 0,
                position: target.position(),
            })?;
            self.pass_tokens.clear();
            self.pass_tokens.push(pending);
            self.pass_tokens.extend_from_slice(self.proposal.tokens());
            self.uniform_buffer.clear();
            for _ in 0..uniforms_needed(&self.rule, drafted) {
                self.uniform_buffer.push(self.uniforms.uniform());
            }

            let pass_start = Instant::now();
            let logits = target
                .step_batch_all(&self.pass_tokens)
                .map_err(|e| target_error("step_batch_all", e))?;
            let rows = LogitRows::new(logits, drafted + 1, vocab)?;
            let decision = self.workspace.decide(
                rows,
                self.proposal.tokens(),
                self.proposal.probabilities(),
                &self.rule,
                &self.uniform_buffer,
            )?;

            let mut kept = 0;
            let mut finish = None;
            for &token in &decision.emitted {
                output.push(token);
                sequence.push(token);
                kept += 1;
                finish = stop.check(&output);
                if finish.is_some() {
                    break;
                }
            }
            // Rows 0..kept are the pending token and the kept tokens but the last, which becomes
            // the new pending token: exactly the state plain decoding would be in.
            target
                .commit_verify_rows(kept)
                .map_err(|e| target_error("commit_verify_rows", e))?;
            let pass_seconds = pass_start.elapsed().as_secs_f64();
            // Feeding the kept rows' hidden states to the drafter is drafting work too.
            let observe_start = Instant::now();
            if tapped {
                let rows = target.pass_taps().ok_or(SpecError::TargetTaps {
                    drafter: self.drafter.name(),
                })?;
                self.drafter.observe_target_rows(rows.first(kept))?;
            }
            let draft_seconds = draft_seconds + observe_start.elapsed().as_secs_f64();
            if on_tokens(&decision.emitted[..kept]).is_break() && finish.is_none() {
                finish = Some(FinishReason::Cancelled);
            }

            self.stats.emitted += kept as u64;
            self.stats.draft_seconds += draft_seconds;
            self.stats.verify_seconds += pass_seconds;
            let weight = if probing {
                self.config.fallback.ewma_weight.max(0.5)
            } else {
                self.config.fallback.ewma_weight
            };
            self.costs.record_pass(drafted + 1, pass_seconds, weight);
            if drafted > 0 {
                self.stats.record_round(drafted, decision.accepted);
                self.costs.record_round(
                    draft_seconds + pass_seconds,
                    decision.accepted + 1,
                    weight,
                );
                self.adapt_draft_len(requested, drafted, decision.accepted);
                self.rounds_since_plain_step += 1;
            } else {
                self.stats.plain_steps += 1;
                self.rounds_since_plain_step = 0;
            }
            self.update_mode(requested, drafted, probing, kept);
            self.drafter.observe(&sequence, decision.accepted)?;

            if let Some(finish) = finish {
                return Ok(Generation {
                    tokens: output,
                    finish,
                });
            }
        }
    }

    /// Drafts to ask for this round and whether it is a probe. Never more than the budget allows:
    /// a round emits at most drafts + 1 tokens.
    fn drafts_to_request(&self, remaining: usize) -> (usize, bool) {
        let budget = remaining.saturating_sub(1).min(self.config.max_drafts);
        let fallback = &self.config.fallback;
        match self.mode {
            Mode::Plain {
                tokens_until_probe: 0,
            } => {
                let drafts = self.draft_len.min(budget);
                (drafts, drafts > 0)
            }
            Mode::Plain { .. } => (0, false),
            Mode::Speculating => {
                let needs_plain_calibration = fallback.enabled
                    && self.stats.rounds >= fallback.warmup_rounds
                    && (self.costs.pass_seconds(1).is_none()
                        || self.rounds_since_plain_step >= fallback.recalibrate_every.max(1));
                if needs_plain_calibration {
                    (0, false)
                } else {
                    (self.draft_len.min(budget), false)
                }
            }
        }
    }

    fn adapt_draft_len(&mut self, requested: usize, drafted: usize, accepted: usize) {
        if !self.config.adaptive_drafts {
            return;
        }
        let (min, max) = (self.config.min_drafts, self.config.max_drafts);
        if accepted == drafted && drafted == requested && requested >= self.draft_len {
            self.draft_len = (self.draft_len + 2).min(max);
        } else if accepted * 2 < drafted {
            self.draft_len = (self.draft_len / 2).max(accepted + 1).clamp(min, max);
        }
    }

    fn update_mode(&mut self, requested: usize, drafted: usize, probing: bool, emitted: usize) {
        let fallback = &self.config.fallback;
        if !fallback.enabled {
            return;
        }
        match self.mode {
            Mode::Plain { tokens_until_probe } if !probing => {
                self.mode = Mode::Plain {
                    tokens_until_probe: tokens_until_probe.saturating_sub(emitted),
                };
            }
            Mode::Plain { .. } => {
                self.stats.probes += 1;
                if drafted == 0 {
                    // The drafter had nothing to offer: probe again later.
                    self.mode = Mode::Plain {
                        tokens_until_probe: self.probe_interval,
                    };
                } else if self.costs.speculation_pays() == Some(true) {
                    self.mode = Mode::Speculating;
                    self.probe_interval = fallback.probe_interval;
                } else {
                    self.probe_interval =
                        (self.probe_interval * 2).min(fallback.max_probe_interval);
                    self.mode = Mode::Plain {
                        tokens_until_probe: self.probe_interval,
                    };
                }
            }
            Mode::Speculating => {
                if requested == 0 || self.stats.rounds < fallback.warmup_rounds {
                    return;
                }
                if self.costs.speculation_pays() == Some(false) {
                    self.stats.fallback_entries += 1;
                    self.mode = Mode::Plain {
                        tokens_until_probe: self.probe_interval,
                    };
                }
            }
        }
    }
}

fn check_proposal(proposal: &DraftProposal, vocab: usize) -> Result<(), SpecError> {
    for (position, &token) in proposal.tokens().iter().enumerate() {
        if token as usize >= vocab {
            return Err(SpecError::DraftTokenOutOfVocab {
                position,
                token,
                vocab,
            });
        }
    }
    if let DraftProbabilities::Full(distributions) = proposal.probabilities() {
        let expected = proposal.len() * vocab;
        if distributions.len() != expected {
            return Err(SpecError::DraftDistributionShape {
                expected,
                got: distributions.len(),
            });
        }
    }
    Ok(())
}

fn target_error<E: std::error::Error + Send + Sync + 'static>(
    operation: &'static str,
    error: E,
) -> SpecError {
    SpecError::Target {
        operation,
        source: Box::new(error) as BoxedError,
    }
}

/// Feeds `tokens` to the target through verify passes of ≤ 16 rows, committing every row (a slow
/// but contract-only prefill, for targets without a prefill path and for tests).
pub fn prefill_with_verify_passes<T: VerifyTarget>(
    target: &mut T,
    tokens: &[u32],
) -> Result<(), SpecError> {
    for chunk in tokens.chunks(MAX_VERIFY_ROWS) {
        target
            .step_batch_all(chunk)
            .map_err(|e| target_error("step_batch_all", e))?;
        target
            .commit_verify_rows(chunk.len())
            .map_err(|e| target_error("commit_verify_rows", e))?;
    }
    Ok(())
}
