//! The acceptance rule: which drafts a verify pass accepts and which token follows them.

use super::target::{LogitRows, MAX_DRAFTS};
use super::SpecError;
use crate::model::sampling::{
    argmax, sample_inverse_cdf, LogitProcessor, SamplingConfig, SamplingError,
};

/// How drafts are accepted and tokens emitted.
#[derive(Clone, Debug, PartialEq)]
pub enum AcceptanceRule {
    /// Accept while the draft equals the target argmax (ties → lowest id); emit the argmax of
    /// row `a`. Uses no uniforms and ignores draft distributions.
    Greedy,
    /// Leviathan et al. rejection sampling against the target distribution p obtained from each
    /// row with this configuration (the same processing as plain sampling).
    Sampling(SamplingConfig),
}

impl AcceptanceRule {
    /// The rule matching a sampling configuration (greedy settings → greedy).
    pub fn for_sampling(config: &SamplingConfig) -> Self {
        if config.is_greedy() {
            AcceptanceRule::Greedy
        } else {
            AcceptanceRule::Sampling(config.clone())
        }
    }
}

/// The draft distributions q, one per draft.
#[derive(Clone, Copy, Debug)]
pub enum DraftProbabilities<'a> {
    /// Deterministic drafts (n-gram, argmax drafts): q is one-hot at each draft. Accept with
    /// probability p(d); on rejection sample p with p(d) zeroed and renormalized.
    OneHot,
    /// `drafts × vocab` probabilities, row-major: row i is the distribution draft i was drawn from.
    Full(&'a [f32]),
}

/// Outcome of one verify pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Number of drafts accepted, `a`.
    pub accepted: usize,
    /// The `a + 1` tokens emitted: the accepted drafts, then the correction (on rejection) or the
    /// bonus token (on full acceptance).
    pub emitted: Vec<u32>,
}

impl Decision {
    /// Rows to keep with `commit_verify_rows`: the pending token's row plus one per accepted draft.
    pub fn rows_to_commit(&self) -> usize {
        self.accepted + 1
    }
}

/// Number of uniforms [`decide`] needs: none for greedy; for sampling one per draft (its
/// acceptance test) plus one for the emitted correction/bonus token.
pub fn uniforms_needed(rule: &AcceptanceRule, drafts: usize) -> usize {
    match rule {
        AcceptanceRule::Greedy => 0,
        AcceptanceRule::Sampling(_) => drafts + 1,
    }
}

/// Applies the acceptance rule to one verify pass.
///
/// - `rows`: the pass's logits, `drafts.len() + 1` rows (row i predicts the token after input i).
/// - `drafts`: the draft tokens (inputs 1.. of the pass), at most 15.
/// - `q`: the draft distributions (ignored by the greedy rule).
/// - `uniforms`: exactly [`uniforms_needed`] values in `[0, 1)`: `uniforms[i]` tests draft i,
///   `uniforms[drafts.len()]` draws the emitted correction or bonus token. The bonus token is
///   [`LogitProcessor::sample`] of the last row with that uniform, the draw of a plain sampled
///   step: with no drafts, `decide` is plain sampling.
///
/// A pure function of its inputs; allocates its scratch (see [`DecideWorkspace`] to reuse it).
pub fn decide(
    rows: LogitRows<'_>,
    drafts: &[u32],
    q: DraftProbabilities<'_>,
    rule: &AcceptanceRule,
    uniforms: &[f64],
) -> Result<Decision, SpecError> {
    DecideWorkspace::new().decide(rows, drafts, q, rule, uniforms)
}

/// Reusable buffers for [`decide`].
#[derive(Debug, Default)]
pub struct DecideWorkspace {
    processor: LogitProcessor,
    target: Vec<f32>,
    residual: Vec<f32>,
}

impl DecideWorkspace {
    /// Empty buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// [`decide`] with this workspace's buffers.
    pub fn decide(
        &mut self,
        rows: LogitRows<'_>,
        drafts: &[u32],
        q: DraftProbabilities<'_>,
        rule: &AcceptanceRule,
        uniforms: &[f64],
    ) -> Result<Decision, SpecError> {
        let k = drafts.len();
        if k > MAX_DRAFTS {
            return Err(SpecError::TooManyDrafts {
                drafts: k,
                max: MAX_DRAFTS,
            });
        }
        if rows.rows() != k + 1 {
            return Err(SpecError::LogitShape {
                len: rows.rows() * rows.vocab(),
                rows: k + 1,
                vocab: rows.vocab(),
            });
        }
        let vocab = rows.vocab();
        for (position, &token) in drafts.iter().enumerate() {
            if token as usize >= vocab {
                return Err(SpecError::DraftTokenOutOfVocab {
                    position,
                    token,
                    vocab,
                });
            }
        }
        let expected_uniforms = uniforms_needed(rule, k);
        if uniforms.len() != expected_uniforms {
            return Err(SpecError::UniformCount {
                expected: expected_uniforms,
                got: uniforms.len(),
            });
        }
        for (index, &value) in uniforms.iter().enumerate() {
            if !(0.0..1.0).contains(&value) {
                return Err(SpecError::UniformOutOfRange { index, value });
            }
        }
        match rule {
            AcceptanceRule::Greedy => decide_greedy(rows, drafts),
            AcceptanceRule::Sampling(config) => {
                config.validate()?;
                if let DraftProbabilities::Full(q_rows) = q {
                    if q_rows.len() != k * vocab {
                        return Err(SpecError::DraftDistributionShape {
                            expected: k * vocab,
                            got: q_rows.len(),
                        });
                    }
                }
                self.decide_sampling(rows, drafts, q, config, uniforms)
            }
        }
    }

    fn decide_sampling(
        &mut self,
        rows: LogitRows<'_>,
        drafts: &[u32],
        q: DraftProbabilities<'_>,
        config: &SamplingConfig,
        uniforms: &[f64],
    ) -> Result<Decision, SpecError> {
        let k = drafts.len();
        let vocab = rows.vocab();
        let final_uniform = uniforms[k];
        let mut emitted = Vec::with_capacity(k + 1);
        for (i, &draft) in drafts.iter().enumerate() {
            let logits = row_of(rows, i)?;
            self.processor
                .probabilities(logits, config, i, &mut self.target)?;
            let p = &self.target;
            let p_draft = f64::from(p[draft as usize]);
            let accepted = match q {
                DraftProbabilities::OneHot => uniforms[i] < p_draft,
                DraftProbabilities::Full(q_rows) => {
                    let q_row = &q_rows[i * vocab..(i + 1) * vocab];
                    check_distribution(q_row, i)?;
                    let q_draft = f64::from(q_row[draft as usize]);
                    // q(d) = 0: the draft could not have been drawn from q; treat it as a
                    // rejection (as vLLM does). The residual still holds d with mass p(d).
                    q_draft > 0.0 && uniforms[i] < p_draft / q_draft
                }
            };
            if accepted {
                emitted.push(draft);
                continue;
            }
            self.residual.clear();
            match q {
                DraftProbabilities::OneHot => {
                    self.residual.extend_from_slice(p);
                    self.residual[draft as usize] = 0.0;
                }
                DraftProbabilities::Full(q_rows) => {
                    let q_row = &q_rows[i * vocab..(i + 1) * vocab];
                    self.residual
                        .extend(p.iter().zip(q_row).map(|(&pt, &qt)| (pt - qt).max(0.0)));
                }
            }
            // An empty residual means p == q up to rounding, where rejection has probability 0;
            // p itself is then the right distribution.
            let token = sample_inverse_cdf(&self.residual, final_uniform)
                .or_else(|| sample_inverse_cdf(p, final_uniform))
                .ok_or(SamplingError::NoFiniteLogit { row: i })?;
            emitted.push(token);
            return Ok(Decision {
                accepted: i,
                emitted,
            });
        }
        let bonus = self
            .processor
            .sample(row_of(rows, k)?, config, k, final_uniform)?;
        emitted.push(bonus);
        Ok(Decision {
            accepted: k,
            emitted,
        })
    }
}

fn decide_greedy(rows: LogitRows<'_>, drafts: &[u32]) -> Result<Decision, SpecError> {
    let mut emitted = Vec::with_capacity(drafts.len() + 1);
    for (i, &draft) in drafts.iter().enumerate() {
        let best = argmax(row_of(rows, i)?, i)?;
        emitted.push(best);
        if best != draft {
            return Ok(Decision {
                accepted: i,
                emitted,
            });
        }
    }
    let k = drafts.len();
    emitted.push(argmax(row_of(rows, k)?, k)?);
    Ok(Decision {
        accepted: k,
        emitted,
    })
}

fn row_of(rows: LogitRows<'_>, index: usize) -> Result<&[f32], SpecError> {
    rows.row(index).ok_or(SpecError::LogitShape {
        len: rows.rows() * rows.vocab(),
        rows: index + 1,
        vocab: rows.vocab(),
    })
}

fn check_distribution(q_row: &[f32], position: usize) -> Result<(), SpecError> {
    let mut total = 0.0f64;
    for &value in q_row {
        if !(value.is_finite() && value >= 0.0) {
            return Err(SpecError::InvalidDraftDistribution {
                position,
                reason: "entry negative, NaN or infinite",
            });
        }
        total += f64::from(value);
    }
    if total <= 0.0 {
        return Err(SpecError::InvalidDraftDistribution {
            position,
            reason: "no probability mass",
        });
    }
    Ok(())
}
