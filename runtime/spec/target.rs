//! The verify contract the target model implements.

use super::SpecError;

/// Rows of one verify pass at most: the pending token plus up to [`MAX_DRAFTS`] drafts (the `m16`
/// kernel family; a 17-row pass is refused by the model).
pub use crate::model::MAX_VERIFY_ROWS;

/// Drafts per round at most.
pub const MAX_DRAFTS: usize = MAX_VERIFY_ROWS - 1;

/// The target model as the speculative loop sees it — exactly the model's verify contract
/// (docs/model.md, "State and the verify contract").
///
/// State: position `P` = number of committed tokens (keys/values and recurrent updates kept). The
/// *pending* token (last sampled, not yet fed) is held by the caller, not the target.
pub trait VerifyTarget {
    /// The model's own error type; the loop wraps it in [`SpecError::Target`].
    type Error: std::error::Error + Send + Sync + 'static;

    /// Vocabulary size: the length of one logit row.
    fn vocab_size(&self) -> usize;

    /// `P`, the number of committed positions.
    fn position(&self) -> usize;

    /// One batched pass over `tokens` (`tokens[0]` = pending token, `tokens[1..]` = drafts,
    /// `1 ≤ len ≤ 16`) at positions `P..P+len-1`. Returns `len × vocab` logits, row-major; row `i`
    /// predicts the token at position `P+i+1`. Nothing is committed until
    /// [`commit_verify_rows`](Self::commit_verify_rows); a second pass before the commit is an error.
    fn step_batch_all(&mut self, tokens: &[u32]) -> Result<&[f32], Self::Error>;

    /// Keep rows `0..n` of the last pass (`1 ≤ n ≤ len`): `P += n`; everything beyond is dropped
    /// (KV truncated, recurrent state restored and replayed). Errors: no pass pending, `n` out of
    /// range.
    fn commit_verify_rows(&mut self, n: usize) -> Result<(), Self::Error>;
}

/// A checked view of `rows × vocab` logits.
#[derive(Clone, Copy, Debug)]
pub struct LogitRows<'a> {
    data: &'a [f32],
    vocab: usize,
    rows: usize,
}

impl<'a> LogitRows<'a> {
    /// Views `data` as `rows` rows of `vocab` logits; the length must match exactly.
    pub fn new(data: &'a [f32], rows: usize, vocab: usize) -> Result<Self, SpecError> {
        let expected = rows.checked_mul(vocab);
        if vocab == 0 || rows == 0 || expected != Some(data.len()) {
            return Err(SpecError::LogitShape {
                len: data.len(),
                rows,
                vocab,
            });
        }
        Ok(LogitRows { data, vocab, rows })
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Length of one row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Row `index`, if present.
    pub fn row(&self, index: usize) -> Option<&'a [f32]> {
        let start = index.checked_mul(self.vocab)?;
        self.data.get(start..start.checked_add(self.vocab)?)
    }
}
