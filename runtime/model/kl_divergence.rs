//! Comparison with the logits another runtime saved: llama.cpp's
//! `llama-perplexity --kl-divergence-base FILE` writes the tokens it evaluated and, for every
//! scored row of every chunk, its log-probabilities over the vocabulary; this module reads that
//! file, runs the same chunks, and reports the KL divergence from the saved distribution, how often
//! the top-1 token agrees, and every row where it does not although the saved run was confident
//! (its top-2 margin over a threshold), which is the greedy-decoding criterion.
//!
//! The file, all little-endian: `"_logits_"`, `n_ctx: i32`, `n_vocab: i32`, `n_chunk: i32`, the
//! tokens (`n_chunk · n_ctx` × `i32`), then per chunk the rows `n_ctx/2 .. n_ctx−2`, each
//! `nv = 2·⌈n_vocab/2⌉ + 4` × `u16`: the first four hold two `f32` (`scale`, `min_log_prob`),
//! then code `c_i` per token with `log p_i = scale · c_i + min_log_prob` (llama.cpp clamps the
//! range to 16 nats below the maximum; everything below reads as the minimum).

use super::perplexity::{ChunkEval, LogitSink};
use super::ModelError;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"_logits_";

/// A llama.cpp logits file, opened and checked; its rows are read one chunk at a time.
pub struct SavedLogits {
    path: PathBuf,
    /// Tokens per chunk.
    pub n_ctx: usize,
    /// The vocabulary the rows cover.
    pub n_vocab: usize,
    /// Chunks held.
    pub n_chunk: usize,
    /// The evaluated tokens, `n_chunk · n_ctx` of them (with the BOS the writer added, if any).
    pub tokens: Vec<u32>,
    reader: BufReader<std::fs::File>,
    chunks_read: usize,
}

/// One saved row: a view of its `u16` words.
pub struct SavedRow<'a> {
    scale: f32,
    min_log_prob: f32,
    codes: &'a [u16],
}

impl SavedRow<'_> {
    /// `log p` of token `i`.
    pub fn log_prob(&self, i: usize) -> f32 {
        self.scale * f32::from(self.codes[i]) + self.min_log_prob
    }

    /// The most likely token (the lowest id among equals) and its margin over the second, in nats.
    pub fn top1_and_margin(&self) -> (u32, f32) {
        let (mut best, mut second) = ((0usize, self.codes[0]), 0u16);
        for (i, &c) in self.codes.iter().enumerate().skip(1) {
            if c > best.1 {
                second = best.1;
                best = (i, c);
            } else if c > second {
                second = c;
            }
        }
        if self.codes.len() < 2 {
            return (best.0 as u32, f32::INFINITY);
        }
        (best.0 as u32, self.scale * f32::from(best.1 - second))
    }
}

fn file_error(path: &Path, problem: impl Into<String>) -> ModelError {
    ModelError::File {
        path: path.display().to_string(),
        problem: problem.into(),
    }
}

impl SavedLogits {
    /// `u16` words per row.
    pub fn row_words(&self) -> usize {
        2 * self.n_vocab.div_ceil(2) + 4
    }

    /// Scored rows per chunk (`n_ctx/2 .. n_ctx−2`).
    pub fn rows_per_chunk(&self) -> usize {
        self.n_ctx - 1 - self.n_ctx / 2
    }

    /// Opens `path` and checks its header and that its length is exactly what the header implies.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = std::fs::File::open(path).map_err(|e| file_error(path, e.to_string()))?;
        let len = file
            .metadata()
            .map_err(|e| file_error(path, e.to_string()))?
            .len();
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut head = [0u8; 20];
        reader.read_exact(&mut head).map_err(|_| {
            file_error(
                path,
                "shorter than a llama.cpp logits header (20 bytes); not written by llama-perplexity --kl-divergence-base?",
            )
        })?;
        if &head[..8] != MAGIC {
            return Err(file_error(
                path,
                "not a llama.cpp logits file (no \"_logits_\" magic)",
            ));
        }
        let field = |at: usize, name: &str| -> Result<usize, ModelError> {
            let v = i32::from_le_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
            usize::try_from(v).ok().filter(|&v| v > 0).ok_or_else(|| {
                file_error(path, format!("header field {name} is {v}, not positive"))
            })
        };
        let (n_ctx, n_vocab, n_chunk) = (
            field(8, "n_ctx")?,
            field(12, "n_vocab")?,
            field(16, "n_chunk")?,
        );
        if n_ctx < 4 {
            return Err(file_error(
                path,
                format!("header field n_ctx is {n_ctx}, below 4"),
            ));
        }
        let mut saved = SavedLogits {
            path: path.to_path_buf(),
            n_ctx,
            n_vocab,
            n_chunk,
            tokens: Vec::new(),
            reader,
            chunks_read: 0,
        };
        let n_tokens = n_ctx.checked_mul(n_chunk);
        let expected = n_tokens.and_then(|t| {
            let rows = n_chunk.checked_mul(saved.rows_per_chunk())?;
            let words = rows.checked_mul(saved.row_words())?;
            20u64
                .checked_add(u64::try_from(t).ok()?.checked_mul(4)?)?
                .checked_add(u64::try_from(words).ok()?.checked_mul(2)?)
        });
        match expected {
            Some(e) if e == len => {}
            Some(e) => {
                return Err(file_error(
                    path,
                    format!(
                        "{len} bytes, but its header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}) implies {e}"
                    ),
                ))
            }
            None => return Err(file_error(path, "header sizes overflow")),
        }
        let n_tokens = n_tokens.unwrap_or(0);
        let mut raw = vec![0u8; n_tokens * 4];
        saved
            .reader
            .read_exact(&mut raw)
            .map_err(|e| file_error(path, format!("reading the tokens: {e}")))?;
        saved.tokens = raw
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(saved)
    }

    /// Reads the next chunk's rows into `words` (resized to `rows_per_chunk · row_words`).
    fn read_chunk(&mut self, words: &mut Vec<u16>) -> Result<(), ModelError> {
        let n = self.rows_per_chunk() * self.row_words();
        let mut raw = vec![0u8; n * 2];
        self.reader.read_exact(&mut raw).map_err(|e| {
            file_error(
                &self.path,
                format!("reading chunk {}: {e}", self.chunks_read),
            )
        })?;
        words.clear();
        words.extend(
            raw.chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]])),
        );
        self.chunks_read += 1;
        Ok(())
    }

    /// Reads the next chunk's rows as log-probabilities into `out` (`rows_per_chunk × n_vocab`,
    /// row-major), to compare two saved files: rows of log-probabilities are logits.
    pub fn read_chunk_log_probs(&mut self, out: &mut Vec<f32>) -> Result<(), ModelError> {
        let mut words = Vec::new();
        self.read_chunk(&mut words)?;
        out.clear();
        for r in 0..self.rows_per_chunk() {
            let row = self.row(&words, r);
            out.extend((0..self.n_vocab).map(|i| row.log_prob(i)));
        }
        Ok(())
    }

    /// Row `r` of a chunk read by `read_chunk`.
    fn row<'a>(&self, words: &'a [u16], r: usize) -> SavedRow<'a> {
        let w = &words[r * self.row_words()..(r + 1) * self.row_words()];
        let f = |lo: u16, hi: u16| f32::from_bits(u32::from(lo) | (u32::from(hi) << 16));
        SavedRow {
            scale: f(w[0], w[1]),
            min_log_prob: f(w[2], w[3]),
            codes: &w[4..4 + self.n_vocab],
        }
    }
}

/// A row where the saved run was confident and the top-1 tokens differ.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Disagreement {
    /// Chunk index.
    pub chunk: usize,
    /// Row inside the chunk.
    pub row: usize,
    /// The saved run's top-1 token.
    pub saved_top: u32,
    /// This run's top-1 token.
    pub top: u32,
    /// The saved run's top-2 margin, in nats.
    pub saved_margin: f32,
}

/// This run against the saved one, over every scored row.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LogitsComparison {
    /// Rows compared.
    pub rows: usize,
    /// This run's perplexity over the rows.
    pub ppl: f64,
    /// The saved run's perplexity over the same rows (from its rounded log-probabilities).
    pub saved_ppl: f64,
    /// Mean `KL(saved ‖ this)` per row, in nats (terms where the saved `log p > −16`, as
    /// llama.cpp sums them).
    pub mean_kld: f64,
    /// Its standard error.
    pub mean_kld_uncertainty: f64,
    /// The largest per-row KL divergence.
    pub max_kld: f64,
    /// Rows whose top-1 tokens agree.
    pub same_top: usize,
    /// The margin that makes a saved row confident, in nats.
    pub margin: f32,
    /// Rows whose saved top-2 margin exceeds `margin`.
    pub confident_rows: usize,
    /// Confident rows whose top-1 tokens differ (the first 20).
    pub confident_disagreements: Vec<Disagreement>,
    /// How many confident rows differ.
    pub confident_disagreement_count: usize,
}

/// `KL(saved ‖ this)` of one row and this run's NLL of `target`.
fn compare_row(saved: &SavedRow<'_>, logits: &[f32], target: usize) -> (f64, f64) {
    let (max, sum) = super::logprobs::max_and_sum_exp(logits);
    let lse = max + sum.ln();
    let mut kld = 0f64;
    for (i, &l) in logits.iter().enumerate() {
        let lp_saved = saved.log_prob(i);
        if lp_saved > -16.0 {
            let lp_saved = f64::from(lp_saved);
            kld += lp_saved.exp() * (lp_saved - (f64::from(l) - lse));
        }
    }
    let nll = lse - f64::from(logits[target]);
    (kld, nll)
}

/// Run every chunk of `saved` through `eval` (as [`super::perplexity::perplexity`] does: a fresh
/// state per chunk, its first token replaced by `bos` when the model adds one) and compare each
/// scored row with the saved one. `progress(chunk, mean_kld)` after each chunk.
pub fn compare_with_saved(
    saved: &mut SavedLogits,
    bos: Option<u32>,
    margin: f32,
    eval: &mut ChunkEval<'_>,
    progress: &mut dyn FnMut(usize, f64),
) -> Result<LogitsComparison, ModelError> {
    let (n_ctx, first) = (saved.n_ctx, saved.n_ctx / 2);
    let mut words = Vec::new();
    let mut buf = vec![0u32; n_ctx];
    let (mut rows, mut same_top, mut confident_rows, mut disagreeing) = (0usize, 0, 0, 0);
    let (mut nll, mut saved_nll, mut kld_sum, mut kld_sq, mut max_kld) =
        (0f64, 0f64, 0f64, 0f64, 0f64);
    let mut disagreements = Vec::new();
    for c in 0..saved.n_chunk {
        saved.read_chunk(&mut words)?;
        let chunk = &saved.tokens[c * n_ctx..(c + 1) * n_ctx];
        buf.copy_from_slice(chunk);
        if let Some(b) = bos {
            buf[0] = b;
        }
        let mut problem: Option<String> = None;
        let mut sink = |i: usize, logits: &[f32]| {
            if i + 1 >= n_ctx || i < first || problem.is_some() {
                return;
            }
            if logits.len() != saved.n_vocab {
                problem = Some(format!(
                    "the model's rows have {} logits, the saved rows {}",
                    logits.len(),
                    saved.n_vocab
                ));
                return;
            }
            let target = chunk[i + 1] as usize;
            if target >= saved.n_vocab {
                problem = Some(format!(
                    "token {target} at chunk {c} is outside the vocabulary"
                ));
                return;
            }
            let top = match super::sampling::argmax(logits, i) {
                Ok(t) => t,
                Err(e) => {
                    problem = Some(format!("chunk {c}: {e}"));
                    return;
                }
            };
            let row = saved.row(&words, i - first);
            let (kld, row_nll) = compare_row(&row, logits, target);
            let (saved_top, saved_margin) = row.top1_and_margin();
            rows += 1;
            nll += row_nll;
            saved_nll -= f64::from(row.log_prob(target));
            kld_sum += kld;
            kld_sq += kld * kld;
            max_kld = max_kld.max(kld);
            same_top += usize::from(top == saved_top);
            if saved_margin > margin {
                confident_rows += 1;
                if top != saved_top {
                    disagreeing += 1;
                    if disagreements.len() < 20 {
                        disagreements.push(Disagreement {
                            chunk: c,
                            row: i,
                            saved_top,
                            top,
                            saved_margin,
                        });
                    }
                }
            }
        };
        let sink: &mut LogitSink<'_> = &mut sink;
        eval(&buf, first, sink)?;
        if let Some(p) = problem {
            return Err(file_error(&saved.path, p));
        }
        progress(c, kld_sum / rows.max(1) as f64);
    }
    if rows == 0 {
        return Err(file_error(&saved.path, "no rows were compared"));
    }
    let n = rows as f64;
    let mean = kld_sum / n;
    let var = (kld_sq / n - mean * mean).max(0.0);
    Ok(LogitsComparison {
        rows,
        ppl: (nll / n).exp(),
        saved_ppl: (saved_nll / n).exp(),
        mean_kld: mean,
        mean_kld_uncertainty: if rows > 1 {
            (var / (n - 1.0)).sqrt()
        } else {
            0.0
        },
        max_kld,
        same_top,
        margin,
        confident_rows,
        confident_disagreements: disagreements,
        confident_disagreement_count: disagreeing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a logits file the way llama-perplexity does, from float rows (its `log_softmax`).
    fn write_file(path: &Path, n_ctx: usize, n_vocab: usize, tokens: &[u32], rows: &[Vec<f32>]) {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(n_ctx as i32).to_le_bytes());
        out.extend_from_slice(&(n_vocab as i32).to_le_bytes());
        out.extend_from_slice(&((tokens.len() / n_ctx) as i32).to_le_bytes());
        for &t in tokens {
            out.extend_from_slice(&(t as i32).to_le_bytes());
        }
        let nv = 2 * n_vocab.div_ceil(2) + 4;
        for logits in rows {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let min = logits
                .iter()
                .copied()
                .fold(f32::INFINITY, f32::min)
                .max(max - 16.0);
            let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
            let lse = sum.ln() as f32;
            let scale = (max - min) / 65535.0;
            let mut words = vec![0u16; nv];
            words[0] = scale.to_bits() as u16;
            words[1] = (scale.to_bits() >> 16) as u16;
            let mlp = min - max - lse;
            words[2] = mlp.to_bits() as u16;
            words[3] = (mlp.to_bits() >> 16) as u16;
            for (i, &l) in logits.iter().enumerate() {
                if l > min && scale > 0.0 {
                    words[4 + i] = ((l - min) / scale).round() as u16;
                }
            }
            for w in words {
                out.extend_from_slice(&w.to_le_bytes());
            }
        }
        std::fs::write(path, out).unwrap();
    }

    #[test]
    fn a_saved_file_read_back_and_compared_by_hand() {
        // ctx 4: rows 2 of each chunk scored (4/2 .. 4−2); two chunks.
        let dir = std::env::temp_dir().join(format!("xdna-kld-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("base.logits");
        let tokens = [7u32, 0, 1, 2, 7, 2, 2, 1];
        let base = [vec![0.0, 2.0, 0.0], vec![1.0, 0.0, 1.05]];
        write_file(&path, 4, 3, &tokens, &base);
        let mut saved = SavedLogits::open(&path).unwrap();
        assert_eq!((saved.n_ctx, saved.n_vocab, saved.n_chunk), (4, 3, 2));
        assert_eq!(saved.tokens, tokens);
        assert_eq!(saved.rows_per_chunk(), 1);
        // Chunk 0 gets the base row itself; chunk 1 a row whose top-1 (0) differs from the
        // saved one (2, margin 0.05 < 0.1, so not a confident disagreement).
        let ours = [vec![0.0f32, 2.0, 0.0], vec![1.2f32, 0.0, 1.0]];
        let mut seen = Vec::new();
        let r = compare_with_saved(
            &mut saved,
            Some(9),
            0.1,
            &mut |chunk, first, f| {
                seen.push((chunk[0], first));
                let c = seen.len() - 1;
                for i in first..chunk.len() {
                    f(i, &ours[c]);
                }
                Ok(())
            },
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(seen, vec![(9, 2), (9, 2)]);
        assert_eq!(r.rows, 2);
        assert_eq!(r.same_top, 1);
        assert_eq!(r.confident_rows, 1);
        assert_eq!(r.confident_disagreement_count, 0);
        // KL of chunk 1 by hand: p = softmax(base[1]), q = softmax(ours[1]).
        let sm = |v: &[f32]| {
            let s: f64 = v.iter().map(|&x| f64::from(x).exp()).sum();
            v.iter()
                .map(|&x| f64::from(x).exp() / s)
                .collect::<Vec<_>>()
        };
        let (p, q) = (sm(&base[1]), sm(&ours[1]));
        let kl1: f64 = p.iter().zip(&q).map(|(a, b)| a * (a / b).ln()).sum();
        assert!((r.mean_kld - kl1 / 2.0).abs() < 1e-4, "{r:?} vs {kl1}");
        // Targets: chunk 0 row 2 predicts token 2, chunk 1 row 2 predicts token 1.
        let nll = -(sm(&ours[0])[2].ln() + q[1].ln()) / 2.0;
        assert!((r.ppl - nll.exp()).abs() < 1e-6);
        let saved_nll = -(sm(&base[0])[2].ln() + p[1].ln()) / 2.0;
        assert!((r.saved_ppl / saved_nll.exp() - 1.0).abs() < 1e-3);

        // With a lower margin, chunk 1 is a confident disagreement.
        let mut saved = SavedLogits::open(&path).unwrap();
        let mut c = 0;
        let r = compare_with_saved(
            &mut saved,
            None,
            0.01,
            &mut |chunk, first, f| {
                for i in first..chunk.len() {
                    f(i, &ours[c]);
                }
                c += 1;
                Ok(())
            },
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(r.confident_disagreement_count, 1);
        assert_eq!(
            (
                r.confident_disagreements[0].saved_top,
                r.confident_disagreements[0].top
            ),
            (2, 0)
        );

        // A truncated file and a foreign one are refused naming the file.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 2]).unwrap();
        let e = SavedLogits::open(&path).err().unwrap().to_string();
        assert!(e.contains("base.logits") && e.contains("implies"), "{e}");
        std::fs::write(&path, b"GGUF and more bytes here").unwrap();
        let e = SavedLogits::open(&path).err().unwrap().to_string();
        assert!(e.contains("magic"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
