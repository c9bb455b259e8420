//! Log-probabilities of tokens under a logit row: the log-softmax of the raw logits (no
//! temperature, no truncation), as llama.cpp's and vLLM's servers report them, in f64.
//!
//! One place for the log-softmax: the server's `logprobs`, and perplexity's negative
//! log-likelihood ([`crate::model::perplexity::nll`]) both call [`log_sum_exp`].

/// `ln Σ exp(logits)`, in f64 (max-shifted, so large logits do not overflow). An empty row, or a
/// row of only −∞, gives −∞; a NaN anywhere gives NaN.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let (max, sum) = max_and_sum_exp(logits);
    if logits.iter().any(|v| v.is_nan()) {
        return f64::NAN;
    }
    if max.is_infinite() {
        return max;
    }
    max + sum.ln()
}

/// The row's maximum `m` (NaN ignored) and `Σ exp(logit − m)`, in f64: the two halves of
/// [`log_sum_exp`], for a caller that subtracts them in its own order.
pub fn max_and_sum_exp(logits: &[f32]) -> (f64, f64) {
    let max = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let sum = logits.iter().map(|&l| (f64::from(l) - max).exp()).sum();
    (max, sum)
}

/// A token and its log-probability, with the most likely alternatives at that position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// `log softmax(logits)[token]`; `None` where nothing predicts the token (a prompt's first).
    pub logprob: Option<f32>,
    /// The `k` most likely tokens and their log-probabilities, most likely first (ties: lower id
    /// first).
    pub top: Vec<(u32, f32)>,
}

/// The log-probability of `token` under `logits` and the `top_k` most likely tokens.
/// A token id past the row gets −∞.
pub fn token_logprob(logits: &[f32], token: u32, top_k: usize) -> TokenLogprob {
    let lse = log_sum_exp(logits);
    let lp = |v: f32| (f64::from(v) - lse) as f32;
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&v| lp(v));
    TokenLogprob {
        token,
        logprob: Some(logprob),
        top: top_k_indices(logits, top_k)
            .into_iter()
            .map(|t| (t, lp(logits[t as usize])))
            .collect(),
    }
}

/// The ids of the `k` largest logits, largest first, ties to the lower id; NaN is never picked.
/// One pass, keeping a sorted list of `k` (k is small: ≤ 20 for the API).
pub fn top_k_indices(logits: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(logits.len());
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return Vec::new();
    }
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        // Strictly greater than the current k-th: equal values keep the earlier (lower) id.
        if best.len() == k && v <= best[k - 1].0 {
            continue;
        }
        let at = best.partition_point(|&(b, _)| b >= v);
        best.insert(at, (v, i as u32));
        best.truncate(k);
    }
    best.into_iter().map(|(_, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The obvious definition, term by term in f64.
    fn slow_logprob(logits: &[f32], t: usize) -> f64 {
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        (f64::from(logits[t]).exp() / z).ln()
    }

    #[test]
    fn matches_the_definition_and_sums_to_one() {
        let logits = [1.0f32, -2.0, 0.5, 3.25, 3.25, -0.75];
        for t in 0..logits.len() {
            let e = token_logprob(&logits, t as u32, 0);
            let got = f64::from(e.logprob.unwrap_or(f32::NAN));
            assert!((got - slow_logprob(&logits, t)).abs() < 1e-6, "token {t}");
        }
        let total: f64 = (0..logits.len())
            .map(|t| f64::from(token_logprob(&logits, t as u32, 0).logprob.unwrap_or(0.0)).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn hand_computed_two_way() {
        // softmax([0, ln 3]) = [1/4, 3/4].
        let e = token_logprob(&[0.0, 3f32.ln()], 0, 2);
        assert!((e.logprob.unwrap_or(0.0) - 0.25f32.ln()).abs() < 1e-6);
        assert_eq!(e.top[0].0, 1);
        assert!((e.top[0].1 - 0.75f32.ln()).abs() < 1e-6);
        assert_eq!(e.top[1].0, 0);
    }

    #[test]
    fn top_k_is_ordered_with_ties_to_the_lower_id() {
        let logits = [0.5f32, 2.0, f32::NAN, 2.0, -1.0, 7.0, 0.5];
        assert_eq!(top_k_indices(&logits, 4), vec![5, 1, 3, 0]);
        assert_eq!(top_k_indices(&logits, 0), Vec::<u32>::new());
        assert_eq!(top_k_indices(&logits, 100).len(), 6);
        // Against a full sort of the non-NaN values.
        let mut idx: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| !logits[i as usize].is_nan())
            .collect();
        idx.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        assert_eq!(top_k_indices(&logits, 6), idx);
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let e = token_logprob(&[1000.0, 1000.0], 1, 1);
        assert!((e.logprob.unwrap_or(0.0) - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(log_sum_exp(&[]), f64::NEG_INFINITY);
        assert!(log_sum_exp(&[1.0, f32::NAN]).is_nan());
    }
}
