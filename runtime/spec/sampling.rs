//! Normal sampling: temperature, top-k, top-p → a probability vector; inverse-CDF sampling with a
//! caller-supplied uniform. The acceptance rule computes the target distribution p with exactly this
//! processing, so speculative sampling reproduces plain sampling.

use std::cmp::Ordering;

use super::SpecError;
use crate::model::sampling::{crossing_bucket, BUCKETS};

/// Sampling parameters. `temperature == 0` means greedy (argmax, ties to the lowest id).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingConfig {
    /// Logits are divided by this before the softmax; `0` = greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (`0` = no limit).
    pub top_k: usize,
    /// Keep the smallest most-likely set whose probability reaches `top_p` (`1` = no limit).
    pub top_p: f32,
}

impl SamplingConfig {
    /// Greedy decoding.
    pub const GREEDY: SamplingConfig = SamplingConfig {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
    };

    /// Plain sampling at `temperature` with no top-k / top-p truncation.
    pub fn with_temperature(temperature: f32) -> Self {
        SamplingConfig {
            temperature,
            top_k: 0,
            top_p: 1.0,
        }
    }

    /// True when this configuration is greedy decoding.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), SpecError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SpecError::config(
                "temperature",
                self.temperature,
                "finite and ≥ 0",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SpecError::config("top_p", self.top_p, "in (0, 1]"));
        }
        Ok(())
    }
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig::GREEDY
    }
}

/// Index of the largest logit, ties broken by the lowest id. NaN and +∞ are refused.
pub fn argmax(logits: &[f32], row: usize) -> Result<u32, SpecError> {
    let mut best: Option<(usize, f32)> = None;
    for (token, &value) in logits.iter().enumerate() {
        if value.is_nan() || value == f32::INFINITY {
            return Err(SpecError::NonFiniteLogit { row, token, value });
        }
        if value == f32::NEG_INFINITY {
            continue;
        }
        match best {
            Some((_, best_value)) if value <= best_value => {}
            _ => best = Some((token, value)),
        }
    }
    match best {
        Some((token, _)) => Ok(token as u32),
        None => Err(SpecError::NoFiniteLogit { row }),
    }
}

/// Draws from an (unnormalized, non-negative) distribution by inverse CDF with a uniform `u` in
/// `[0, 1)`. Returns `None` when the distribution has no mass. Zero-probability tokens are never
/// returned.
pub fn sample_inverse_cdf(probabilities: &[f32], u: f64) -> Option<u32> {
    let total: f64 = probabilities.iter().map(|&p| f64::from(p.max(0.0))).sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let threshold = u * total;
    let mut cumulative = 0.0f64;
    let mut last_positive = None;
    for (token, &p) in probabilities.iter().enumerate() {
        if p <= 0.0 {
            continue;
        }
        cumulative += f64::from(p);
        last_positive = Some(token as u32);
        if cumulative > threshold {
            return last_positive;
        }
    }
    // Rounding left the threshold at or above the accumulated total: the last token with mass.
    last_positive
}

/// Turns logits into the sampling distribution of a [`SamplingConfig`], reusing its buffers.
#[derive(Debug, Default)]
pub struct LogitProcessor {
    candidates: Vec<u32>,
    /// Unnormalized probability of every token (0 when cut).
    weights: Vec<f64>,
    /// Probability mass per weight bucket, for the top-p cut.
    bucket_mass: Vec<f64>,
}

/// The top-p cut's bucket of a weight (`model::sampling`'s monotone f32-bit buckets).
fn bucket_of(weight: f64) -> usize {
    crate::model::sampling::bucket_of(weight as f32)
}

impl LogitProcessor {
    /// A processor with empty scratch buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes into `out` (resized to the vocabulary) the probability of every token after
    /// temperature, top-k and top-p; tokens cut by top-k/top-p get exactly 0. Greedy yields the
    /// one-hot vector of the argmax. `row` only labels errors.
    pub fn probabilities(
        &mut self,
        logits: &[f32],
        config: &SamplingConfig,
        row: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), SpecError> {
        out.clear();
        out.resize(logits.len(), 0.0);
        let best = argmax(logits, row)? as usize;
        if config.is_greedy() {
            out[best] = 1.0;
            return Ok(());
        }
        let max_logit = f64::from(logits[best]);
        let inverse_temperature = 1.0 / f64::from(config.temperature);
        let weight_of = |logit: f32| ((f64::from(logit) - max_logit) * inverse_temperature).exp();
        // Order: larger logit first, then lower id (deterministic ties).
        let by_logit_then_id = |a: &u32, b: &u32| -> Ordering {
            let (la, lb) = (logits[*a as usize], logits[*b as usize]);
            lb.partial_cmp(&la)
                .unwrap_or(Ordering::Equal)
                .then(a.cmp(b))
        };

        self.weights.clear();
        self.weights.resize(logits.len(), 0.0);
        let finite = logits.iter().filter(|&&l| l != f32::NEG_INFINITY).count();
        if config.top_k > 0 && config.top_k < finite {
            self.candidates.clear();
            self.candidates.extend(
                logits
                    .iter()
                    .enumerate()
                    .filter(|(_, &l)| l != f32::NEG_INFINITY)
                    .map(|(t, _)| t as u32),
            );
            self.candidates
                .select_nth_unstable_by(config.top_k - 1, by_logit_then_id);
            for &token in &self.candidates[..config.top_k] {
                self.weights[token as usize] = weight_of(logits[token as usize]);
            }
        } else {
            for (weight, &logit) in self.weights.iter_mut().zip(logits) {
                if logit != f32::NEG_INFINITY {
                    *weight = weight_of(logit);
                }
            }
        }
        let mut total: f64 = self.weights.iter().sum();

        if config.top_p < 1.0 {
            // Keep the shortest prefix, in (logit desc, id asc) order, whose mass reaches
            // top_p · total. Bucket the weights (monotone buckets), find the bucket where the
            // cumulative mass crosses the threshold, and sort only that bucket.
            let threshold = f64::from(config.top_p) * total;
            self.bucket_mass.clear();
            self.bucket_mass.resize(BUCKETS, 0.0);
            for &weight in &self.weights {
                if weight > 0.0 {
                    self.bucket_mass[bucket_of(weight)] += weight;
                }
            }
            let (boundary, mass_above) = match crossing_bucket(&self.bucket_mass, threshold) {
                Some(found) => found,
                None => {
                    // Rounding kept the sum below the threshold: keep everything.
                    let lowest = self.bucket_mass.iter().position(|&m| m > 0.0).unwrap_or(0);
                    (lowest, self.bucket_mass[lowest + 1..].iter().sum())
                }
            };
            self.candidates.clear();
            for (token, weight) in self.weights.iter_mut().enumerate() {
                if *weight > 0.0 {
                    match bucket_of(*weight).cmp(&boundary) {
                        Ordering::Less => *weight = 0.0,
                        Ordering::Equal => self.candidates.push(token as u32),
                        Ordering::Greater => {}
                    }
                }
            }
            self.candidates.sort_unstable_by(by_logit_then_id);
            let mut cumulative = mass_above;
            let mut cut = self.candidates.len();
            for (index, &token) in self.candidates.iter().enumerate() {
                cumulative += self.weights[token as usize];
                if cumulative >= threshold {
                    cut = index + 1;
                    break;
                }
            }
            for &token in &self.candidates[cut..] {
                self.weights[token as usize] = 0.0;
            }
            total = self.weights.iter().sum();
        }
        for (p, &weight) in out.iter_mut().zip(&self.weights) {
            *p = (weight / total) as f32;
        }
        Ok(())
    }
}
