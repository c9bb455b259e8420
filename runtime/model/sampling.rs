//! Token sampling, one module for plain and speculative decoding: the settings
//! ([`SamplingConfig`], validated here), the generator ([`Rng`]), the logit processor
//! ([`LogitProcessor`]: temperature, top-k and top-p, then probabilities or a draw), [`argmax`] and
//! the inverse-CDF draw of any distribution ([`sample_inverse_cdf`]).
//!
//! Why in the model layer: its users span the layers. The speculative layer's acceptance rule and
//! draft models call it (spec may call model), and so do the tools' plain decoding and
//! `replay-check`'s random tokens, which need nothing of spec. It uses nothing of the model but
//! [`fastexp`].
//!
//! Plain sampling is the zero-draft case of speculative sampling: [`Sampler::sample`] draws with
//! [`LogitProcessor::sample`] and the next uniform of its [`Rng`], the very call `spec::decide`
//! makes for the token after the accepted drafts with the next uniform of the loop's [`Rng`]. A
//! plain run and a speculative run whose drafter proposes nothing therefore give the same tokens
//! for the same seed. Greedy settings (temperature 0, or top-k 1) draw no uniform: the argmax,
//! lowest id on ties.
//!
//! Reproducible by seed on every platform. Fast enough to sample every row of a 16-stream step: no
//! allocation per token after the first, the weights in one vectorized pass, and no sort of the
//! vocabulary for a top-p cut (see [`LogitProcessor`]).

use std::cmp::Ordering;

use crate::kernels::fastexp;

/// Errors of sampling: a setting out of range, or a logit row with nothing to draw.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A sampling setting is out of range.
    #[error("invalid sampling setting: {field} = {value} ({expected})")]
    InvalidConfig {
        /// The setting.
        field: &'static str,
        /// Its value.
        value: String,
        /// The range it must lie in.
        expected: &'static str,
    },
    /// A logit is NaN or +∞.
    #[error("logit row {row}, token {token} is {value} (NaN or +inf)")]
    NonFiniteLogit {
        /// Row of the logits.
        row: usize,
        /// Token id of the logit.
        token: usize,
        /// The logit.
        value: f32,
    },
    /// Every logit of a row is −∞, or the row is empty: there is no token to pick.
    #[error("logit row {row} has no finite logit")]
    NoFiniteLogit {
        /// Row of the logits.
        row: usize,
    },
}

impl SamplingError {
    fn config(field: &'static str, value: impl std::fmt::Display, expected: &'static str) -> Self {
        SamplingError::InvalidConfig {
            field,
            value: value.to_string(),
            expected,
        }
    }
}

/// Sampling settings. `temperature == 0` means greedy (argmax, ties to the lowest id).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingConfig {
    /// Logits are divided by this before the softmax; `0` = greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (`0` = no limit; `1` = greedy).
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

    /// True when these settings always pick the argmax: temperature 0, or a top-k cut to one token
    /// (whatever the temperature). Greedy decoding draws no uniform.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Checks every field's range; the error names the field.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::config(
                "temperature",
                self.temperature,
                "finite and ≥ 0",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::config("top_p", self.top_p, "in (0, 1]"));
        }
        Ok(())
    }
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig::GREEDY
    }
}

/// Additive changes to a logit row before it is sampled: OpenAI's `logit_bias` and its presence
/// and frequency penalties, `logit[t] += bias[t] − count(t)·frequency − [count(t) > 0]·presence`,
/// where `count(t)` is how often `t` was generated so far. Log-probabilities are reported from the
/// raw logits, before these.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitAdjustments {
    /// `(token, bias)` pairs, each bias in [−100, 100].
    pub bias: Vec<(u32, f32)>,
    /// Subtracted once from every token generated at least once.
    pub presence_penalty: f32,
    /// Subtracted from every token once per time it was generated.
    pub frequency_penalty: f32,
}

impl LogitAdjustments {
    /// True when applying would change nothing.
    pub fn is_empty(&self) -> bool {
        self.bias.iter().all(|&(_, b)| b == 0.0)
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
    }

    /// Apply to `logits`, with `counts` the generated tokens and how often each occurred. Token
    /// ids past the row are ignored (the caller validated them against the vocabulary).
    pub fn apply(&self, logits: &mut [f32], counts: &std::collections::HashMap<u32, u32>) {
        for &(t, b) in &self.bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 {
            for (&t, &c) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    if c > 0 {
                        *l -= c as f32 * self.frequency_penalty + self.presence_penalty;
                    }
                }
            }
        }
    }
}

/// xoshiro256** seeded by SplitMix64 (Blackman & Vigna).
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator seeded with `seed` (the same seed, the same stream).
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Index of the largest logit, ties to the lowest id (of +0 and −0, the first). NaN and +∞ are
/// refused, naming the token; a row of only −∞ (or an empty one) has no token to pick. `row` only
/// labels errors.
///
/// One pass in eight lanes, each keeping its maximum and where it first saw it (the selects
/// compile to vector compares and blends), and a NaN sentinel sum; then the lanes, lowest index
/// among equal maxima. A scan with one compare chain cost ~20 µs per 49 k-entry row, and a
/// 16-stream step takes the argmax of 16 rows.
pub fn argmax(logits: &[f32], row: usize) -> Result<u32, SamplingError> {
    let mut maxima = [f32::NEG_INFINITY; 8];
    let mut first_at = [0u32; 8];
    let mut index = [0u32, 1, 2, 3, 4, 5, 6, 7];
    // Turns NaN when a NaN was seen (finite and infinite values add 0).
    let mut nan_sentinel = [0f32; 8];
    let chunks = logits.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for lane in 0..8 {
            let v = chunk[lane];
            let greater = v > maxima[lane];
            // All ones where `greater`: a select written as bit operations, so that it stays in
            // vector registers.
            let mask = 0u32.wrapping_sub(u32::from(greater));
            maxima[lane] = if greater { v } else { maxima[lane] };
            first_at[lane] = (index[lane] & mask) | (first_at[lane] & !mask);
            nan_sentinel[lane] += if v.is_nan() { v } else { 0.0 };
            index[lane] += 8;
        }
    }
    let mut nan_seen = nan_sentinel.iter().any(|s| s.is_nan());
    let (mut max, mut best) = (f32::NEG_INFINITY, 0u32);
    for (&lane_max, &at) in maxima.iter().zip(&first_at) {
        if lane_max > max || (lane_max == max && at < best) {
            (max, best) = (lane_max, at);
        }
    }
    let tail_start = logits.len() - tail.len();
    for (offset, &v) in tail.iter().enumerate() {
        nan_seen |= v.is_nan();
        if v > max {
            (max, best) = (v, (tail_start + offset) as u32);
        }
    }
    if nan_seen || max == f32::INFINITY {
        if let Some((token, &value)) = logits
            .iter()
            .enumerate()
            .find(|(_, &v)| v.is_nan() || v == f32::INFINITY)
        {
            return Err(SamplingError::NonFiniteLogit { row, token, value });
        }
    }
    if max == f32::NEG_INFINITY {
        return Err(SamplingError::NoFiniteLogit { row });
    }
    Ok(best)
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

/// Buckets of a top-p cut: a non-negative weight's f32 bit pattern (sign bit clear) shifted right
/// by this: exponent and 4 mantissa bits, monotone in the weight.
const BUCKET_SHIFT: u32 = 19;
/// Number of buckets of a top-p cut.
const BUCKETS: usize = 1 << (31 - BUCKET_SHIFT);

/// The bucket of a non-negative weight.
fn bucket_of(weight: f32) -> usize {
    (weight.to_bits() >> BUCKET_SHIFT) as usize
}

/// Over per-bucket masses, from the heaviest bucket down: the first bucket where the running mass
/// reaches `threshold` (it holds the cut: every bucket above it is kept whole, every one below is
/// cut), with the mass of the buckets above it. `None` when rounding keeps the total below the
/// threshold.
fn crossing_bucket(bucket_mass: &[f64], threshold: f64) -> Option<(usize, f64)> {
    let mut mass_above = 0f64;
    for (bucket, &mass) in bucket_mass.iter().enumerate().rev() {
        if mass > 0.0 && mass_above + mass >= threshold {
            return Some((bucket, mass_above));
        }
        mass_above += mass;
    }
    None
}

/// Σ `values` in f64: element i into lane i mod 8, then the lanes and the tail in order. It
/// vectorizes, and gives the same bits on every machine.
fn sum_f64(values: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = values.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f64::from(v);
        }
    }
    let tail_sum: f64 = tail.iter().map(|&v| f64::from(v)).sum();
    lanes.iter().sum::<f64>() + tail_sum
}

/// Larger logit first, then lower id: the order of the top-k cut and of the top-p prefix. The
/// logits hold no NaN ([`argmax`] refused them) and went through [`zero_as_positive`], so
/// `total_cmp` (3–4× faster than `partial_cmp` in a 49 k-entry selection) orders them as `<` does.
fn by_logit_then_id(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// −0 as +0 (`−0 + 0 = +0`), other values unchanged: equal logits tie, whatever their sign bit.
fn zero_as_positive(logit: f32) -> f32 {
    logit + 0.0
}

/// Turns logits into the sampling distribution of a [`SamplingConfig`], reusing its buffers.
///
/// A token's weight is `exp((l − max) / T)` (the argument in f64, so a tiny temperature gives −∞
/// and weight 0, never NaN; the exponential in f32 by [`fastexp`], vectorized).
/// Top-k keeps the k best by (logit desc, id asc), selected without sorting the vocabulary; only
/// those k are sorted. Top-p keeps the shortest prefix in that order whose mass reaches `top_p` of
/// the total. After a top-k cut that is a walk of the sorted k; without one, it is found without
/// sorting the vocabulary (49 k entries for SmolLM2, a sort cost more than the decode step's
/// attention), by bucketing the weights by their float bits and sorting only the bucket where the
/// cumulative mass crosses the threshold. That needs a larger logit never to get a smaller weight:
/// the f64 → f32 rounding is monotone, and so is `fastexp::exp` (checked exhaustively over
/// [−90, 0] by `weights_are_monotone_in_the_logit`).
#[derive(Debug, Default)]
pub struct LogitProcessor {
    /// Top-k: (logit, id) of every token, then the k best in (logit desc, id asc) order.
    candidates: Vec<(f32, u32)>,
    /// Unnormalized weight of every token (0 when cut or −∞).
    weights: Vec<f32>,
    /// Top-p: ids in the bucket where the cumulative mass crosses the threshold.
    crossing: Vec<u32>,
    /// Top-p: mass per weight bucket.
    bucket_mass: Vec<f64>,
}

impl LogitProcessor {
    /// A processor with empty scratch buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes into `out` (resized to the vocabulary) the probability of every token after
    /// temperature, top-k and top-p; tokens cut by top-k/top-p get exactly 0. Greedy settings
    /// yield the one-hot vector of the argmax. `row` only labels errors.
    pub fn probabilities(
        &mut self,
        logits: &[f32],
        config: &SamplingConfig,
        row: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), SamplingError> {
        let best = argmax(logits, row)? as usize;
        out.clear();
        if config.is_greedy() {
            out.resize(logits.len(), 0.0);
            out[best] = 1.0;
            return Ok(());
        }
        let kept = self.weigh(logits, config, logits[best]);
        let scale = 1.0 / kept;
        out.extend(
            self.weights
                .iter()
                .map(|&weight| (f64::from(weight) * scale) as f32),
        );
        Ok(())
    }

    /// One token of the processed distribution, drawn by inverse CDF with `uniform` in `[0, 1)`:
    /// the kept tokens, walked in id order, each take their weight's share of `[0, 1)`. Greedy
    /// settings give the argmax and ignore `uniform`. `row` only labels errors.
    ///
    /// The draw of a plain sampled step ([`Sampler::sample`]) and of the token `spec::decide` emits
    /// after the accepted drafts: one function, so the two agree bit for bit.
    pub fn sample(
        &mut self,
        logits: &[f32],
        config: &SamplingConfig,
        row: usize,
        uniform: f64,
    ) -> Result<u32, SamplingError> {
        let best = argmax(logits, row)?;
        if config.is_greedy() {
            return Ok(best);
        }
        let kept = self.weigh(logits, config, logits[best as usize]);
        let threshold = uniform * kept;
        let mut cumulative = 0f64;
        let mut last_kept = best;
        for (token, &weight) in self.weights.iter().enumerate() {
            if weight > 0.0 {
                cumulative += f64::from(weight);
                last_kept = token as u32;
                if cumulative > threshold {
                    return Ok(last_kept);
                }
            }
        }
        // Rounding left the threshold at or past the walked sum: the last kept token.
        Ok(last_kept)
    }

    /// Fills `self.weights` with every token's weight after the top-k and top-p cuts (0 when cut)
    /// and returns the kept mass (≥ 1: the argmax keeps weight 1). `max` is the row's largest
    /// logit; every logit is finite or −∞ ([`argmax`] checked) and the temperature is positive.
    fn weigh(&mut self, logits: &[f32], config: &SamplingConfig, max: f32) -> f64 {
        let inverse_temperature = 1.0 / f64::from(config.temperature);
        let max = f64::from(max);
        let scaled = |logit: f32| ((f64::from(logit) - max) * inverse_temperature) as f32;
        self.weights.clear();
        if config.top_k > 0 && config.top_k < logits.len() {
            return self.weigh_top_k(logits, config.top_k, config.top_p, scaled);
        }
        self.weights
            .extend(logits.iter().map(|&logit| scaled(logit)));
        // exp(s − 0): the vector lanes and the scalar tail give the same bits.
        fastexp::exp_shifted_sum(&mut self.weights, 0.0);
        let total = sum_f64(&self.weights);
        if config.top_p < 1.0 {
            self.cut_to_nucleus(logits, config.top_p, total)
        } else {
            total
        }
    }

    /// [`weigh`](Self::weigh) with a top-k cut: select the k best without sorting the
    /// vocabulary, sort only those k, and cut the top-p prefix among them in that order.
    fn weigh_top_k(
        &mut self,
        logits: &[f32],
        top_k: usize,
        top_p: f32,
        scaled: impl Fn(f32) -> f32,
    ) -> f64 {
        self.candidates.clear();
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .map(|(token, &logit)| (zero_as_positive(logit), token as u32)),
        );
        self.candidates
            .select_nth_unstable_by(top_k - 1, by_logit_then_id);
        self.candidates.truncate(top_k);
        self.candidates.sort_unstable_by(by_logit_then_id);
        self.weights.resize(logits.len(), 0.0);
        let mut total = 0f64;
        for &(logit, token) in &self.candidates {
            let weight = fastexp::exp(scaled(logit));
            self.weights[token as usize] = weight;
            total += f64::from(weight);
        }
        if top_p >= 1.0 {
            return total;
        }
        let threshold = f64::from(top_p) * total;
        let mut kept = 0f64;
        let mut cut = self.candidates.len();
        for (index, &(_, token)) in self.candidates.iter().enumerate() {
            kept += f64::from(self.weights[token as usize]);
            if kept >= threshold {
                cut = index + 1;
                break;
            }
        }
        for &(_, token) in &self.candidates[cut..] {
            self.weights[token as usize] = 0.0;
        }
        kept
    }

    /// Zeroes the weights outside the nucleus: the shortest prefix, in (logit desc, id asc)
    /// order, whose mass reaches `top_p` of `total`. Returns the kept mass.
    fn cut_to_nucleus(&mut self, logits: &[f32], top_p: f32, total: f64) -> f64 {
        let threshold = f64::from(top_p) * total;
        self.bucket_mass.clear();
        self.bucket_mass.resize(BUCKETS, 0.0);
        for &weight in self.weights.iter().filter(|&&weight| weight > 0.0) {
            self.bucket_mass[bucket_of(weight)] += f64::from(weight);
        }
        let Some((crossing, mass_above)) = crossing_bucket(&self.bucket_mass, threshold) else {
            // Rounding kept the running mass below the threshold: everything stays.
            return total;
        };
        self.crossing.clear();
        for (token, weight) in self.weights.iter_mut().enumerate() {
            if *weight > 0.0 {
                match bucket_of(*weight).cmp(&crossing) {
                    Ordering::Less => *weight = 0.0,
                    Ordering::Equal => self.crossing.push(token as u32),
                    Ordering::Greater => {}
                }
            }
        }
        // Every token of a higher bucket has a larger logit than any of this one, so the global
        // order continues with this bucket's (logit desc, id asc) order.
        let keyed = |token: u32| (zero_as_positive(logits[token as usize]), token);
        self.crossing
            .sort_unstable_by(|&a, &b| by_logit_then_id(&keyed(a), &keyed(b)));
        let mut kept = mass_above;
        let mut cut = self.crossing.len();
        for (index, &token) in self.crossing.iter().enumerate() {
            kept += f64::from(self.weights[token as usize]);
            if kept >= threshold {
                cut = index + 1;
                break;
            }
        }
        for &token in &self.crossing[cut..] {
            self.weights[token as usize] = 0.0;
        }
        kept
    }
}

/// Plain decoding's sampler: validated settings, a generator and a processor, with reusable
/// buffers (no allocation per token after the first).
#[derive(Debug)]
pub struct Sampler {
    config: SamplingConfig,
    rng: Rng,
    processor: LogitProcessor,
}

impl Sampler {
    /// A sampler whose generator starts from `seed`; refuses settings out of range.
    pub fn new(config: SamplingConfig, seed: u64) -> Result<Self, SamplingError> {
        config.validate()?;
        Ok(Sampler {
            config,
            rng: Rng::new(seed),
            processor: LogitProcessor::new(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &SamplingConfig {
        &self.config
    }

    /// The generator. A sequence that also speculates draws its rounds' uniforms from it, so one
    /// seed drives one stream.
    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// The token after one logit row: the argmax when greedy (no uniform drawn), else
    /// [`LogitProcessor::sample`] with the next uniform, which is what `spec::decide` emits for
    /// a round without drafts.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        if self.config.is_greedy() {
            return argmax(logits, 0);
        }
        let uniform = self.rng.uniform();
        self.processor.sample(logits, &self.config, 0, uniform)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_adjustments_by_hand() {
        let adj = LogitAdjustments {
            bias: vec![(0, 5.0), (3, -100.0), (99, 1.0)],
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
        };
        let mut logits = vec![1.0f32, 2.0, 3.0, 4.0];
        let counts: std::collections::HashMap<u32, u32> = [(1, 2), (2, 0)].into_iter().collect();
        adj.apply(&mut logits, &counts);
        // 0: +5; 1: −(2·0.25 + 0.5); 2: never generated; 3: −100; 99 is past the row.
        assert_eq!(logits, vec![6.0, 1.0, 3.0, -96.0]);
        assert!(!adj.is_empty());
        assert!(LogitAdjustments::default().is_empty());
    }

    #[test]
    fn splitmix_xoshiro_known_values() {
        // SplitMix64(0) first output is 0xE220A8397B1DCDAF (reference implementation).
        let mut r = Rng::new(0);
        assert_eq!(r.s[0], 0xE220_A839_7B1D_CDAF);
        let a: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        let mut r2 = Rng::new(0);
        let b: Vec<u64> = (0..3).map(|_| r2.next_u64()).collect();
        assert_eq!(a, b);
        assert!(Rng::new(1).uniform() < 1.0);
    }

    /// The reference of [`argmax`]: one scan keeping the first strictly larger value, refusing
    /// the first NaN or +∞.
    fn argmax_scan(logits: &[f32], row: usize) -> Result<u32, SamplingError> {
        let mut best: Option<usize> = None;
        for (token, &value) in logits.iter().enumerate() {
            if value.is_nan() || value == f32::INFINITY {
                return Err(SamplingError::NonFiniteLogit { row, token, value });
            }
            if value > f32::NEG_INFINITY && best.is_none_or(|b| value > logits[b]) {
                best = Some(token);
            }
        }
        best.map(|b| b as u32)
            .ok_or(SamplingError::NoFiniteLogit { row })
    }

    #[test]
    fn argmax_equals_the_scan() {
        let mut r = Rng::new(7);
        for case in 0..600 {
            let n = 1 + (r.next_u64() % 200) as usize;
            let mut v: Vec<f32> = (0..n)
                .map(|_| ((r.next_u64() % 9) as f32 - 4.0) * 0.5)
                .collect();
            // Ties everywhere (few distinct values); then NaN, +∞, ±0, −∞ in places.
            match case % 8 {
                1 => v[(r.next_u64() as usize) % n] = f32::NAN,
                2 => v[0] = f32::NAN,
                3 => v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                4 => v.iter_mut().for_each(|x| {
                    *x = if r.next_u64().is_multiple_of(2) {
                        0.0
                    } else {
                        -0.0
                    }
                }),
                5 => v[n - 1] = 1e30,
                6 => v[(r.next_u64() as usize) % n] = f32::INFINITY,
                7 => v[(r.next_u64() as usize) % n] = f32::NEG_INFINITY,
                _ => {}
            }
            // Compared by their printed form: a NaN in an error compares unequal to itself.
            let (got, want) = (argmax(&v, 3), argmax_scan(&v, 3));
            assert_eq!(
                format!("{got:?}"),
                format!("{want:?}"),
                "case {case}: {v:?}"
            );
        }
        assert_eq!(argmax(&[], 2), Err(SamplingError::NoFiniteLogit { row: 2 }));
        assert!(matches!(
            argmax(&[1.0, f32::NAN, 2.0, f32::INFINITY], 4),
            Err(SamplingError::NonFiniteLogit {
                row: 4,
                token: 1,
                ..
            })
        ));
    }

    fn sampler(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampler {
        Sampler::new(
            SamplingConfig {
                temperature,
                top_k,
                top_p,
            },
            seed,
        )
        .expect("valid settings")
    }

    #[test]
    fn greedy_topk_topp() {
        let logits = [0.0f32, 3.0, 1.0, 3.0];
        assert_eq!(sampler(0.0, 0, 1.0, 1).sample(&logits), Ok(1));
        assert_eq!(sampler(1.0, 1, 1.0, 1).sample(&logits), Ok(1));
        // top_p tiny keeps only the best (id 1 wins the tie by id).
        let mut s = sampler(1.0, 0, 0.01, 7);
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), Ok(1));
        }
        // top_k 2 only ever yields ids 1 and 3; both appear.
        let mut s = sampler(1.0, 2, 1.0, 3);
        let got: Vec<u32> = (0..200).filter_map(|_| s.sample(&logits).ok()).collect();
        assert_eq!(got.len(), 200);
        assert!(got.iter().all(|&t| t == 1 || t == 3));
        assert!(got.contains(&1) && got.contains(&3));
        // Same seed, same sequence.
        let mut s2 = sampler(1.0, 2, 1.0, 3);
        let again: Vec<u32> = (0..200).filter_map(|_| s2.sample(&logits).ok()).collect();
        assert_eq!(got, again);
        // Settings out of range are refused by name.
        for (bad, field) in [
            (sampler_config(-1.0, 1.0), "temperature"),
            (sampler_config(f32::NAN, 1.0), "temperature"),
            (sampler_config(1.0, 0.0), "top_p"),
            (sampler_config(1.0, 1.5), "top_p"),
        ] {
            match Sampler::new(bad, 0) {
                Err(SamplingError::InvalidConfig { field: got, .. }) => assert_eq!(got, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    fn sampler_config(temperature: f32, top_p: f32) -> SamplingConfig {
        SamplingConfig {
            temperature,
            top_k: 0,
            top_p,
        }
    }

    #[test]
    fn a_tiny_temperature_keeps_the_tied_maxima_and_never_makes_nan() {
        // 1/T overflows f32 but not f64: the maxima keep weight 1, the others 0.
        let logits = [1.0f32, 3.0, f32::NEG_INFINITY, 3.0];
        let mut processor = LogitProcessor::new();
        let mut p = Vec::new();
        let config = SamplingConfig::with_temperature(f32::from_bits(1));
        processor
            .probabilities(&logits, &config, 0, &mut p)
            .expect("finite logits");
        assert_eq!(p, [0.0, 0.5, 0.0, 0.5]);
        assert_eq!(processor.sample(&logits, &config, 0, 0.25), Ok(1));
        assert_eq!(processor.sample(&logits, &config, 0, 0.75), Ok(3));
    }

    /// The slow, obviously-correct weights: sort every token by (logit desc, id asc), keep the
    /// first `top_k` (0 = all), weigh them as the processor does, keep the shortest sorted prefix
    /// whose mass reaches `top_p`.
    fn sorted_reference(logits: &[f32], config: &SamplingConfig) -> Vec<f32> {
        let mut order: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, i as u32))
            .collect();
        order.sort_by(|a, b| {
            b.0.partial_cmp(&a.0)
                .unwrap_or(Ordering::Equal)
                .then(a.1.cmp(&b.1))
        });
        if config.top_k > 0 {
            order.truncate(config.top_k);
        }
        let max = f64::from(order[0].0);
        let inverse_temperature = 1.0 / f64::from(config.temperature);
        let top_p = config.top_p;
        let mut weights = vec![0f32; logits.len()];
        for &(l, id) in &order {
            weights[id as usize] =
                fastexp::exp(((f64::from(l) - max) * inverse_temperature) as f32);
        }
        let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        let mut acc = 0f64;
        let mut cut = order.len();
        for (index, &(_, id)) in order.iter().enumerate() {
            acc += f64::from(weights[id as usize]);
            if top_p < 1.0 && acc >= f64::from(top_p) * total {
                cut = index + 1;
                break;
            }
        }
        for &(_, id) in &order[cut..] {
            weights[id as usize] = 0.0;
        }
        weights
    }

    #[test]
    fn nucleus_weights_equal_the_sorted_reference() {
        let mut r = Rng::new(11);
        for case in 0..300 {
            let n = 1 + (r.next_u64() % 3000) as usize;
            // Case by case: wide spread, few distinct values (ties, ±0 among them), peaked, and
            // −∞ mixed in.
            let mut logits: Vec<f32> = (0..n)
                .map(|_| match case % 3 {
                    0 => (r.uniform() * 40.0 - 20.0) as f32,
                    1 => match r.next_u64() % 6 {
                        5 => -0.0,
                        v => v as f32,
                    },
                    _ => (r.uniform() * 4.0) as f32,
                })
                .collect();
            if case % 4 == 3 && n > 2 {
                logits[(r.next_u64() as usize) % n] = f32::NEG_INFINITY;
                logits[(r.next_u64() as usize) % n] = f32::NEG_INFINITY;
            }
            let Ok(best) = argmax(&logits, 0) else {
                continue;
            };
            let config = SamplingConfig {
                temperature: [0.3f32, 0.8, 1.0, 1.7][case % 4],
                top_k: [0, 0, 3, 50, 2000, 0, 7][case % 7],
                top_p: [1.0f32, 0.95, 0.5, 0.1, 0.999][case % 5],
            };
            let mut processor = LogitProcessor::new();
            let kept = processor.weigh(&logits, &config, logits[best as usize]);
            let expected = sorted_reference(&logits, &config);
            assert_eq!(
                processor.weights, expected,
                "case {case}: n {n}, {config:?}"
            );
            let expected_mass: f64 = expected.iter().map(|&w| f64::from(w)).sum();
            assert!(
                (kept - expected_mass).abs() <= 1e-9 * expected_mass,
                "case {case}"
            );
        }
    }

    /// Counts of `draws` tokens drawn by a plain sampler, checked against the processor's
    /// probabilities by five standard deviations of a binomial frequency per token.
    fn assert_draws_follow(config: SamplingConfig, logits: &[f32], expected: &[f64]) {
        let mut probabilities = Vec::new();
        LogitProcessor::new()
            .probabilities(logits, &config, 0, &mut probabilities)
            .expect("finite logits");
        for (&p, &want) in probabilities.iter().zip(expected) {
            assert!((f64::from(p) - want).abs() < 1e-6, "{probabilities:?}");
        }
        let mut sampler = Sampler::new(config.clone(), 5).expect("valid settings");
        let draws = 40_000;
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..draws {
            counts[sampler.sample(logits).expect("finite logits") as usize] += 1;
        }
        for (id, &p) in expected.iter().enumerate() {
            let frequency = counts[id] as f64 / draws as f64;
            let sigma = (p * (1.0 - p) / draws as f64).sqrt();
            assert!(
                (frequency - p).abs() <= 5.0 * sigma + 1e-12,
                "{config:?}: id {id} drawn {frequency}, expected {p}"
            );
        }
    }

    #[test]
    fn draws_follow_the_kept_distribution() {
        // Weights 1, 2, 4, 8 (logits ln w at T = 1): top_p 0.7 keeps ids 3 and 2 (8 + 4 ≥ 0.7 · 15),
        // whose probabilities are 2/3 and 1/3; top-k 3 keeps ids 1, 2 and 3. Ids cut and the −∞
        // one never appear.
        let logits = [0.0f32, 2f32.ln(), 4f32.ln(), 8f32.ln(), f32::NEG_INFINITY];
        let config = |top_k, top_p| SamplingConfig {
            temperature: 1.0,
            top_k,
            top_p,
        };
        let fifteenths = [1.0 / 15.0, 2.0 / 15.0, 4.0 / 15.0, 8.0 / 15.0, 0.0];
        assert_draws_follow(config(0, 1.0), &logits, &fifteenths);
        assert_draws_follow(
            config(0, 0.7),
            &logits,
            &[0.0, 0.0, 1.0 / 3.0, 2.0 / 3.0, 0.0],
        );
        assert_draws_follow(
            config(3, 1.0),
            &logits,
            &[0.0, 2.0 / 14.0, 4.0 / 14.0, 8.0 / 14.0, 0.0],
        );
        // Top-k 3 then top-p 0.8 of the kept mass 14: 8 < 11.2 ≤ 12 keeps ids 3 and 2.
        assert_draws_follow(
            config(3, 0.8),
            &logits,
            &[0.0, 0.0, 1.0 / 3.0, 2.0 / 3.0, 0.0],
        );
        // Temperature 2 halves the logits: weights 1, √2, 2, √8.
        let roots = [1.0, 2f64.sqrt(), 2.0, 8f64.sqrt()];
        let total: f64 = roots.iter().sum();
        let halved: Vec<f64> = roots.iter().map(|w| w / total).chain([0.0]).collect();
        assert_draws_follow(SamplingConfig::with_temperature(2.0), &logits, &halved);
        // Nothing finite, or a NaN: an error naming the row (and token), never a token.
        let mut sampler = Sampler::new(config(0, 0.9), 5).expect("valid settings");
        assert_eq!(
            sampler.sample(&[f32::NEG_INFINITY; 3]),
            Err(SamplingError::NoFiniteLogit { row: 0 })
        );
        assert!(matches!(
            sampler.sample(&[0.0, f32::NAN]),
            Err(SamplingError::NonFiniteLogit { token: 1, .. })
        ));
    }

    /// Consecutive floats of `[−90, 0]` every `stride` bits: `fastexp::exp` of the nearer one to
    /// 0 is never smaller, which the top-p buckets rely on.
    fn assert_exp_monotone(stride: u32) {
        let mut previous = fastexp::exp(-0.0);
        let mut bits = (-0.0f32).to_bits();
        while f32::from_bits(bits) >= -90.0 {
            let x = f32::from_bits(bits);
            let e = fastexp::exp(x);
            assert!(
                e <= previous,
                "exp({x:e}) = {e:e} > exp of the next float up"
            );
            previous = e;
            bits += stride;
        }
    }

    #[test]
    fn weights_are_monotone_in_the_logit_on_a_sample_of_floats() {
        assert_exp_monotone(1021);
    }

    #[test]
    #[ignore = "every float in [−90, 0]: ~30 s"]
    fn weights_are_monotone_in_the_logit() {
        assert_exp_monotone(1);
    }
}
