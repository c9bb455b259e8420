//! Token sampling, reproducible by seed on every platform: a SplitMix64-seeded xoshiro256**
//! generator, temperature, top-k and top-p (nucleus). Temperature 0 is greedy (argmax, lowest id on
//! ties).

/// xoshiro256** seeded by SplitMix64 (Blackman & Vigna).
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
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

/// Sampling settings.
#[derive(Clone, Debug)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// 0 = no top-k cut.
    pub top_k: usize,
    /// 1.0 = no nucleus cut.
    pub top_p: f32,
}

/// Buckets of a nucleus (top-p) cut: a non-negative weight's f32 bit pattern (sign bit clear)
/// shifted right by this: exponent and 4 mantissa bits, monotone in the weight. Shared with the
/// speculative layer's `LogitProcessor`.
const BUCKET_SHIFT: u32 = 19;
/// Number of buckets of a nucleus cut.
pub(crate) const BUCKETS: usize = 1 << (31 - BUCKET_SHIFT);

/// The bucket of a non-negative weight.
pub(crate) fn bucket_of(weight: f32) -> usize {
    (weight.to_bits() >> BUCKET_SHIFT) as usize
}

/// Over per-bucket masses, from the heaviest bucket down: the first bucket where the running mass
/// reaches `threshold` (it holds the cut: every bucket above it is kept whole, every one below is
/// cut), with the mass of the buckets above it. `None` when rounding keeps the total below the
/// threshold.
pub(crate) fn crossing_bucket(bucket_mass: &[f64], threshold: f64) -> Option<(usize, f64)> {
    let mut mass_above = 0f64;
    for (bucket, &mass) in bucket_mass.iter().enumerate().rev() {
        if mass > 0.0 && mass_above + mass >= threshold {
            return Some((bucket, mass_above));
        }
        mass_above += mass;
    }
    None
}

/// A sampler with reusable buffers (no allocation per token after the first).
///
/// Without a top-k cut the whole vocabulary is a candidate, and sorting it (49 k entries for
/// SmolLM2) cost more than the decode step's attention: the nucleus is found by bucketing the
/// weights instead, and only the bucket where the cumulative mass crosses `top_p` is sorted. The
/// draw then walks the kept tokens in id order, which gives each the same probability as the
/// sorted walk would.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// Top-k path: (scaled logit, id) of the k best, sorted.
    cand: Vec<(f32, u32)>,
    /// No-top-k path: unnormalized weight of every token (0 = cut or never possible).
    weights: Vec<f32>,
    /// No-top-k path: ids in the bucket where the nucleus mass crosses `top_p`.
    crossing: Vec<u32>,
    bucket_mass: Vec<f64>,
}

/// Index of the largest logit (lowest index on ties; NaN never wins, except a NaN at index 0,
/// which nothing beats — the result of [`argmax_scan`], the reference).
///
/// Two passes: the maximum in eight lanes (the `>` select compiles to vector max instructions),
/// then the first index holding it. The single scan's compare chain cost ~20 µs per 49 k-entry row,
/// and a 16-stream step samples 16 rows.
pub fn argmax(logits: &[f32]) -> u32 {
    let Some(&first) = logits.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = logits.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (l, &v) in lanes.iter_mut().zip(chunk) {
            *l = if v > *l { v } else { *l };
        }
    }
    let mut max = first;
    for &v in lanes.iter().chain(tail) {
        if v > max {
            max = v;
        }
    }
    // `max` is a non-NaN value present in `logits` (or `first`): the first equal entry is the scan's
    // answer (±0 compare equal, and the scan keeps the first of them too).
    logits.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// The reference of [`argmax`]: one scan keeping the first strictly larger value.
pub fn argmax_scan(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(cfg: SamplerConfig, seed: u64) -> Self {
        Sampler {
            cfg,
            rng: Rng::new(seed),
            cand: Vec::new(),
            weights: Vec::new(),
            crossing: Vec::new(),
            bucket_mass: Vec::new(),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 || self.cfg.top_k == 1 {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.cfg.temperature;
        if self.cfg.top_k != 0 && self.cfg.top_k < logits.len() {
            return self.sample_top_k(logits, inv_t, self.cfg.top_k);
        }
        let Some(total) = self.nucleus_weights(logits, inv_t) else {
            // Nothing finite to weigh (every logit -∞ or NaN, or a +∞ one): the argmax decides.
            return argmax(logits);
        };
        let u = self.rng.uniform() * total;
        let mut acc = 0f64;
        let mut last_kept = None;
        for (id, &w) in self.weights.iter().enumerate() {
            if w > 0.0 {
                acc += f64::from(w);
                last_kept = Some(id as u32);
                if u < acc {
                    return id as u32;
                }
            }
        }
        // Rounding left `u` at or past the walked sum: the last kept token.
        last_kept.unwrap_or_else(|| argmax(logits))
    }

    /// Top-k: select the k best, sort them, cut the nucleus among them, and walk them in order.
    fn sample_top_k(&mut self, logits: &[f32], inv_t: f32, k: usize) -> u32 {
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (l * inv_t, i as u32)),
        );
        // Descending by logit, ties by id: deterministic.
        let by = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        self.cand.select_nth_unstable_by(k - 1, by);
        self.cand.truncate(k);
        self.cand.sort_unstable_by(by);
        let max = self.cand[0].0;
        let mut sum = 0f64;
        for c in self.cand.iter_mut() {
            c.0 = (c.0 - max).exp();
            sum += c.0 as f64;
        }
        // Nucleus: smallest prefix with mass ≥ top_p.
        let mut keep = self.cand.len();
        if self.cfg.top_p < 1.0 {
            let mut acc = 0f64;
            for (i, c) in self.cand.iter().enumerate() {
                acc += c.0 as f64 / sum;
                if acc >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let total: f64 = self.cand[..keep].iter().map(|c| c.0 as f64).sum();
        let u = self.rng.uniform() * total;
        let mut acc = 0f64;
        for c in &self.cand[..keep] {
            acc += c.0 as f64;
            if u < acc {
                return c.1;
            }
        }
        self.cand[keep - 1].1
    }

    /// Fills `self.weights` with `exp(l/T - max)` for every token, then zeroes the tokens outside
    /// the nucleus: the shortest prefix, in (logit desc, id asc) order, whose mass reaches
    /// `top_p` of the total. Returns the kept mass, or `None` when no token has a finite weight.
    /// NaN and -∞ logits get weight 0.
    fn nucleus_weights(&mut self, logits: &[f32], inv_t: f32) -> Option<f64> {
        let max = logits
            .iter()
            .map(|&l| l * inv_t)
            .filter(|s| !s.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return None;
        }
        self.weights.clear();
        self.weights.extend(logits.iter().map(|&l| {
            let s = l * inv_t;
            if s.is_nan() {
                0.0
            } else {
                (s - max).exp()
            }
        }));
        let total: f64 = self.weights.iter().map(|&w| f64::from(w)).sum();
        if self.cfg.top_p >= 1.0 {
            return Some(total);
        }
        let threshold = f64::from(self.cfg.top_p) * total;
        self.bucket_mass.clear();
        self.bucket_mass.resize(BUCKETS, 0.0);
        for &w in self.weights.iter().filter(|&&w| w > 0.0) {
            self.bucket_mass[bucket_of(w)] += f64::from(w);
        }
        let Some((crossing, mass_above)) = crossing_bucket(&self.bucket_mass, threshold) else {
            // Rounding kept the running mass below the threshold: everything stays.
            return Some(total);
        };
        self.crossing.clear();
        for (id, w) in self.weights.iter_mut().enumerate() {
            if *w > 0.0 {
                match bucket_of(*w).cmp(&crossing) {
                    std::cmp::Ordering::Less => *w = 0.0,
                    std::cmp::Ordering::Equal => self.crossing.push(id as u32),
                    std::cmp::Ordering::Greater => {}
                }
            }
        }
        // A larger scaled logit never has a smaller weight, so within the bucket the global order
        // is (scaled logit desc, id asc), as the sorted walk of the top-k path uses.
        let scaled = |id: u32| logits[id as usize] * inv_t;
        self.crossing
            .sort_unstable_by(|&a, &b| scaled(b).total_cmp(&scaled(a)).then(a.cmp(&b)));
        let mut kept = mass_above;
        let mut cut = self.crossing.len();
        for (index, &id) in self.crossing.iter().enumerate() {
            kept += f64::from(self.weights[id as usize]);
            if kept >= threshold {
                cut = index + 1;
                break;
            }
        }
        for &id in &self.crossing[cut..] {
            self.weights[id as usize] = 0.0;
        }
        Some(kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn two_pass_argmax_equals_the_scan() {
        let mut r = Rng::new(7);
        for case in 0..400 {
            let n = 1 + (r.next_u64() % 200) as usize;
            let mut v: Vec<f32> = (0..n)
                .map(|_| ((r.next_u64() % 9) as f32 - 4.0) * 0.5)
                .collect();
            // Ties everywhere (few distinct values); then NaN, ±0, -inf in places.
            match case % 6 {
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
                _ => {}
            }
            assert_eq!(argmax(&v), argmax_scan(&v), "case {case}: {v:?}");
        }
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn greedy_topk_topp() {
        let logits = [0.0f32, 3.0, 1.0, 3.0];
        let mut s = Sampler::new(
            SamplerConfig {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
            },
            1,
        );
        assert_eq!(s.sample(&logits), 1);
        let mut s = Sampler::new(
            SamplerConfig {
                temperature: 1.0,
                top_k: 1,
                top_p: 1.0,
            },
            1,
        );
        assert_eq!(s.sample(&logits), 1);
        // top_p tiny keeps only the best (id 1 wins the tie by id).
        let mut s = Sampler::new(
            SamplerConfig {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.01,
            },
            7,
        );
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
        // top_k 2 only ever yields ids 1 and 3; both appear.
        let mut s = Sampler::new(
            SamplerConfig {
                temperature: 1.0,
                top_k: 2,
                top_p: 1.0,
            },
            3,
        );
        let got: Vec<u32> = (0..200).map(|_| s.sample(&logits)).collect();
        assert!(got.iter().all(|&t| t == 1 || t == 3));
        assert!(got.contains(&1) && got.contains(&3));
        // Same seed, same sequence.
        let mut s2 = Sampler::new(
            SamplerConfig {
                temperature: 1.0,
                top_k: 2,
                top_p: 1.0,
            },
            3,
        );
        let again: Vec<u32> = (0..200).map(|_| s2.sample(&logits)).collect();
        assert_eq!(got, again);
    }

    /// The slow, obviously-correct distribution: sort every token by (scaled logit desc, id asc),
    /// weigh it `exp(s - max)`, keep the shortest sorted prefix whose mass reaches `top_p`.
    fn sorted_reference(logits: &[f32], temperature: f32, top_p: f32) -> Vec<f32> {
        let inv_t = 1.0 / temperature;
        let mut order: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (l * inv_t, i as u32))
            .collect();
        order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let max = order[0].0;
        let mut weights = vec![0f32; logits.len()];
        for &(s, id) in &order {
            weights[id as usize] = (s - max).exp();
        }
        let total: f64 = order
            .iter()
            .map(|&(_, id)| f64::from(weights[id as usize]))
            .sum();
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
            // Case by case: wide spread, few distinct values (ties), peaked, and -inf / NaN mixed in.
            let mut logits: Vec<f32> = (0..n)
                .map(|_| match case % 3 {
                    0 => (r.uniform() * 40.0 - 20.0) as f32,
                    1 => (r.next_u64() % 5) as f32,
                    _ => (r.uniform() * 4.0) as f32,
                })
                .collect();
            if case % 4 == 3 && n > 2 {
                logits[(r.next_u64() as usize) % n] = f32::NEG_INFINITY;
                logits[(r.next_u64() as usize) % n] = f32::NAN;
            }
            if logits.iter().all(|l| !l.is_finite()) {
                continue;
            }
            let temperature = [0.3f32, 0.8, 1.0, 1.7][case % 4];
            let top_p = [1.0f32, 0.95, 0.5, 0.1, 0.999][case % 5];
            let mut sampler = Sampler::new(
                SamplerConfig {
                    temperature,
                    top_k: 0,
                    top_p,
                },
                0,
            );
            let kept = sampler.nucleus_weights(&logits, 1.0 / temperature);
            let expected = sorted_reference(&logits, temperature, top_p);
            assert_eq!(
                sampler.weights, expected,
                "case {case}: n {n}, top_p {top_p}"
            );
            let expected_mass: f64 = expected.iter().map(|&w| f64::from(w)).sum();
            let kept = kept.expect("finite logits have mass");
            assert!(
                (kept - expected_mass).abs() <= 1e-9 * expected_mass,
                "case {case}"
            );
        }
    }

    #[test]
    fn draws_follow_the_kept_distribution() {
        // Weights 1, 2, 4, 8 (logits ln w at T = 1): top_p 0.7 keeps ids 3 and 2 (8 + 4 ≥ 0.7 · 15),
        // whose probabilities are 2/3 and 1/3. Ids 0 and 1, and the NaN and -inf ones, never appear.
        let logits = [
            0.0f32,
            2f32.ln(),
            4f32.ln(),
            8f32.ln(),
            f32::NAN,
            f32::NEG_INFINITY,
        ];
        for (top_p, expected) in [
            (1.0f32, [1.0 / 15.0, 2.0 / 15.0, 4.0 / 15.0, 8.0 / 15.0]),
            (0.7, [0.0, 0.0, 1.0 / 3.0, 2.0 / 3.0]),
        ] {
            let mut sampler = Sampler::new(
                SamplerConfig {
                    temperature: 1.0,
                    top_k: 0,
                    top_p,
                },
                5,
            );
            let draws = 40_000;
            let mut counts = [0usize; 6];
            for _ in 0..draws {
                counts[sampler.sample(&logits) as usize] += 1;
            }
            assert_eq!(&counts[4..], &[0, 0], "top_p {top_p}: NaN / -inf drawn");
            for (id, &p) in expected.iter().enumerate() {
                let frequency = counts[id] as f64 / draws as f64;
                // Five standard deviations of a binomial frequency.
                let sigma = (p * (1.0 - p) / draws as f64).sqrt();
                assert!(
                    (frequency - p).abs() <= 5.0 * sigma + 1e-12,
                    "top_p {top_p}: id {id} drawn {frequency}, expected {p}"
                );
            }
        }
        // Nothing finite: the argmax decides (index 0 here, as `argmax` keeps the first).
        let mut sampler = Sampler::new(
            SamplerConfig {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.9,
            },
            5,
        );
        assert_eq!(sampler.sample(&[f32::NEG_INFINITY; 3]), 0);
    }
}
