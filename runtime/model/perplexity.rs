//! Perplexity by the method of llama.cpp's `llama-perplexity`: tokenize once, split into
//! non-overlapping chunks of `ctx` tokens (at least two chunks' worth of tokens are required), run
//! each chunk from a fresh state (the first token replaced by BOS when the model adds one), and
//! score only the second half: the logits at positions `ctx/2 .. ctx-2` predicting the next token.

use super::ModelError;

/// The outcome of a perplexity run.
#[derive(Clone, Debug, PartialEq)]
pub struct PerplexityResult {
    /// The perplexity over every scored token.
    pub ppl: f64,
    /// Tokens scored (predictions).
    pub tokens: usize,
    /// Chunks evaluated.
    pub chunks: usize,
    /// Running estimate after each chunk.
    pub per_chunk: Vec<f64>,
    /// `-log p(target)` of every scored token, in order (for per-token comparisons of runtimes).
    pub token_nll: Vec<f64>,
}

impl PerplexityResult {
    /// llama-perplexity's `+/-`: `ppl · sqrt(var(nll) / (n − 1))`, the standard error of the mean
    /// NLL carried through `exp` (`var` the population variance of the scored tokens' NLL). `None`
    /// with fewer than two scored tokens or no spread.
    pub fn uncertainty(&self) -> Option<f64> {
        let (mean, var) = mean_and_variance(&self.token_nll)?;
        let n = self.token_nll.len() as f64;
        (var > 0.0).then(|| mean.exp() * (var / (n - 1.0)).sqrt())
    }
}

/// Two runs of the same text compared token by token (`model` against `reference`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PerplexityComparison {
    /// The reference run's perplexity.
    pub reference_ppl: f64,
    /// `ppl_model / ppl_reference − 1`: the relative perplexity gap.
    pub gap: f64,
    /// The gap's standard error from the per-token differences (`sqrt(var(Δnll) / (n − 1))`,
    /// relative): the same tokens scored twice, so much tighter than either run's own `+/-`. A gap
    /// within about two of these is what re-drawing the rounding of one run can move it by.
    pub gap_uncertainty: f64,
    /// Mean |Δnll| per scored token, in nats.
    pub mean_abs_token_nll: f64,
}

/// Compare two runs over the same tokens. Errors if they scored different token counts.
pub fn compare(
    model: &PerplexityResult,
    reference: &PerplexityResult,
) -> Result<PerplexityComparison, ModelError> {
    if model.token_nll.len() != reference.token_nll.len() || model.token_nll.len() < 2 {
        return Err(ModelError::Other(format!(
            "perplexity comparison needs the same ≥ 2 scored tokens in both runs ({} vs {})",
            model.token_nll.len(),
            reference.token_nll.len()
        )));
    }
    let d: Vec<f64> = model
        .token_nll
        .iter()
        .zip(&reference.token_nll)
        .map(|(a, b)| a - b)
        .collect();
    let (mean, var) = mean_and_variance(&d).unwrap_or((0.0, 0.0));
    let n = d.len() as f64;
    Ok(PerplexityComparison {
        reference_ppl: reference.ppl,
        gap: mean.exp() - 1.0,
        gap_uncertainty: mean.exp() * (var.max(0.0) / (n - 1.0)).sqrt(),
        mean_abs_token_nll: d.iter().map(|x| x.abs()).sum::<f64>() / n,
    })
}

/// Mean and population variance, or `None` for fewer than two values.
fn mean_and_variance(v: &[f64]) -> Option<(f64, f64)> {
    if v.len() < 2 {
        return None;
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    Some((mean, v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n))
}

/// `-log softmax(logits)[target]`, in f64.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let lt = logits
        .get(target as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY) as f64;
    // (lt − max) − ln Σ: perplexity's numbers stay those it has always printed.
    let (max, sum) = super::logprobs::max_and_sum_exp(logits);
    -(lt - max - sum.ln())
}

/// The log-likelihood of a continuation after a context, as evaluation harnesses score a choice.
#[derive(Clone, Debug, PartialEq)]
pub struct ContinuationScore {
    /// `Σ log p(continuation[i] | context, continuation[..i])`, in f64.
    pub loglikelihood: f64,
    /// Every continuation token is its row's argmax (ties to the lower id).
    pub is_greedy: bool,
}

/// Score `continuation` after `context` (both non-empty) in one run from a fresh state:
/// `eval(tokens, first_row, sink)` as for [`perplexity`].
pub fn score_continuation(
    context: &[u32],
    continuation: &[u32],
    eval: &mut ChunkEval<'_>,
) -> Result<ContinuationScore, ModelError> {
    if context.is_empty() || continuation.is_empty() {
        return Err(ModelError::Context {
            what: format!(
                "scoring needs a non-empty context and continuation (got {} and {} tokens)",
                context.len(),
                continuation.len()
            ),
        });
    }
    let tokens: Vec<u32> = context.iter().chain(continuation).copied().collect();
    let first = context.len() - 1;
    let mut loglikelihood = 0f64;
    let mut is_greedy = true;
    let mut bad = None;
    eval(&tokens, first, &mut |i, logits| {
        // Row i predicts tokens[i + 1]; the last row predicts past the continuation.
        let Some(&target) = tokens.get(i + 1) else {
            return;
        };
        let v = nll(logits, target);
        if !v.is_finite() {
            bad = Some(i);
        }
        loglikelihood -= v;
        is_greedy &= super::sampling::argmax(logits, i).ok() == Some(target);
    })?;
    if let Some(i) = bad {
        return Err(ModelError::Other(format!(
            "non-finite log-probability at row {i} while scoring"
        )));
    }
    Ok(ContinuationScore {
        loglikelihood,
        is_greedy,
    })
}

/// Receives `(row, logits)` for each scored row.
pub type LogitSink<'a> = dyn FnMut(usize, &[f32]) + 'a;
/// Runs one chunk from a fresh state: `(tokens, first_row, sink)`.
pub type ChunkEval<'a> =
    dyn FnMut(&[u32], usize, &mut LogitSink<'_>) -> Result<(), ModelError> + 'a;

/// Run the method. `eval(chunk_tokens, first_row, on_logits)` must run `chunk_tokens` from a fresh
/// state and call `on_logits(i, logits)` for every row `i ≥ first_row`. `progress(chunk, running)`
/// is called after each chunk.
pub fn perplexity(
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    eval: &mut ChunkEval<'_>,
    progress: &mut dyn FnMut(usize, f64),
) -> Result<PerplexityResult, ModelError> {
    if ctx < 4 {
        return Err(ModelError::Context {
            what: format!("perplexity context {ctx} too small (need ≥ 4)"),
        });
    }
    if tokens.len() < 2 * ctx {
        return Err(ModelError::Context {
            what: format!(
                "perplexity needs at least {} tokens (2 × ctx {ctx}), the text has {}",
                2 * ctx,
                tokens.len()
            ),
        });
    }
    let n_chunks = tokens.len() / ctx;
    let first = ctx / 2;
    let mut buf = vec![0u32; ctx];
    let mut total = 0f64;
    let mut count = 0usize;
    let mut per_chunk = Vec::with_capacity(n_chunks);
    let mut token_nll = Vec::with_capacity(n_chunks * (ctx - 1 - first));
    for c in 0..n_chunks {
        let chunk = &tokens[c * ctx..(c + 1) * ctx];
        buf.copy_from_slice(chunk);
        if let Some(b) = bos {
            buf[0] = b;
        }
        let mut err = None;
        eval(&buf, first, &mut |i, logits| {
            // Row i predicts chunk[i + 1]; the last row has no target inside the chunk.
            if i + 1 < ctx {
                let v = nll(logits, chunk[i + 1]);
                if v.is_finite() {
                    total += v;
                } else {
                    err = Some(i);
                }
                token_nll.push(v);
                count += 1;
            }
        })?;
        if let Some(i) = err {
            return Err(ModelError::Other(format!(
                "non-finite log-probability in chunk {c}, row {i}"
            )));
        }
        let running = (total / count as f64).exp();
        per_chunk.push(running);
        progress(c, running);
    }
    Ok(PerplexityResult {
        ppl: (total / count as f64).exp(),
        tokens: count,
        chunks: n_chunks,
        per_chunk,
        token_nll,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continuation_score_by_hand() {
        // Every row gives softmax([0, ln 3, 0]) = [1/5, 3/5, 1/5].
        let row = [0.0f32, 3f32.ln(), 0.0];
        let mut rows_seen = Vec::new();
        let s = score_continuation(&[0, 0], &[1, 2], &mut |tokens, first, f| {
            assert_eq!((tokens, first), (&[0u32, 0, 1, 2][..], 1));
            for i in first..tokens.len() {
                rows_seen.push(i);
                f(i, &row);
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rows_seen, vec![1, 2, 3]);
        assert!((s.loglikelihood - (0.6f64.ln() + 0.2f64.ln())).abs() < 1e-6);
        assert!(!s.is_greedy);
        let greedy = score_continuation(&[2], &[1], &mut |t, first, f| {
            (first..t.len()).for_each(|i| f(i, &row));
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(greedy.is_greedy && (greedy.loglikelihood - 0.6f64.ln()).abs() < 1e-6);
        assert!(score_continuation(&[], &[1], &mut |_, _, _| Ok(())).is_err());
    }

    #[test]
    fn uniform_logits_give_vocab_perplexity_and_the_method_counts_right() {
        // Uniform logits over 10 tokens → ppl 10 exactly; ctx 8, 17 tokens → 2 chunks, rows 4..6
        // scored in each (3 predictions per chunk).
        let toks: Vec<u32> = (0..17).map(|i| i % 10).collect();
        let mut seen = Vec::new();
        let r = perplexity(
            &toks,
            8,
            Some(9),
            &mut |chunk, first, f| {
                seen.push((chunk[0], first));
                for i in first..chunk.len() {
                    f(i, &[0.0; 10]);
                }
                Ok(())
            },
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(r.chunks, 2);
        assert_eq!(r.tokens, 6);
        assert!((r.ppl - 10.0).abs() < 1e-9);
        assert_eq!(r.token_nll.len(), 6);
        assert!(r.token_nll.iter().all(|v| (v - 10f64.ln()).abs() < 1e-9));
        assert_eq!(seen, vec![(9, 4), (9, 4)]);
        assert!(perplexity(&toks[..15], 8, None, &mut |_, _, _| Ok(()), &mut |_, _| {}).is_err());
    }

    fn result(token_nll: Vec<f64>) -> PerplexityResult {
        let mean = token_nll.iter().sum::<f64>() / token_nll.len() as f64;
        PerplexityResult {
            ppl: mean.exp(),
            tokens: token_nll.len(),
            chunks: 1,
            per_chunk: vec![mean.exp()],
            token_nll,
        }
    }

    #[test]
    fn uncertainty_is_llama_perplexitys_by_hand() {
        // NLL 1, 2, 3: mean 2, population variance 2/3, so e² · sqrt((2/3) / 2) = e² / √3.
        let r = result(vec![1.0, 2.0, 3.0]);
        let expected = 2f64.exp() / 3f64.sqrt();
        assert!((r.uncertainty().unwrap() - expected).abs() < 1e-12);
        assert_eq!(result(vec![1.5, 1.5]).uncertainty(), None);
        assert_eq!(result(vec![1.5]).uncertainty(), None);
    }

    #[test]
    fn comparison_of_two_runs_by_hand() {
        // Δnll = 0.1, −0.1, 0.3: mean 0.1, population variance 0.08/3, |Δ| mean 0.5/3.
        let a = result(vec![1.1, 0.9, 2.3]);
        let b = result(vec![1.0, 1.0, 2.0]);
        let c = compare(&a, &b).unwrap();
        assert!((c.gap - (0.1f64.exp() - 1.0)).abs() < 1e-12, "{c:?}");
        let se = 0.1f64.exp() * (0.08f64 / 3.0 / 2.0).sqrt();
        assert!((c.gap_uncertainty - se).abs() < 1e-12, "{c:?}");
        assert!((c.mean_abs_token_nll - 0.5 / 3.0).abs() < 1e-12, "{c:?}");
        assert_eq!(c.reference_ppl, b.ppl);
        // The gap agrees with the two perplexities' ratio.
        assert!((c.gap - (a.ppl / b.ppl - 1.0)).abs() < 1e-12);
        assert!(compare(&a, &result(vec![1.0, 1.0])).is_err());
    }

    #[test]
    fn nll_hand_value() {
        // logits [0, ln 3] → p(1) = 3/4.
        let v = nll(&[0.0, 3f32.ln()], 1);
        assert!((v - (4.0f64 / 3.0).ln()).abs() < 1e-6);
    }
}
