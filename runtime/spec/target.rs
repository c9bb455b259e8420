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

    /// Asks every later pass and [`prefill_tapped`](Self::prefill_tapped) for the hidden states
    /// after `layers` (for a drafter that reads the target's states, such as DFlash). Returns
    /// false when the target cannot provide them; by default only an empty list is accepted.
    fn request_taps(&mut self, layers: &[usize]) -> bool {
        layers.is_empty()
    }

    /// The hidden states of the last pass's rows at the requested layers (valid until the next
    /// pass); `None` when none were requested or the target has none.
    fn pass_taps(&self) -> Option<TapRows<'_>> {
        None
    }

    /// Feeds and commits `tokens` (a prompt before the loop starts), handing the tapped hidden
    /// states of every row to `on_rows`, in position order. The default runs verify passes of
    /// up to 16 rows through the contract.
    fn prefill_tapped(
        &mut self,
        tokens: &[u32],
        on_rows: &mut dyn FnMut(TapRows<'_>),
    ) -> Result<(), Self::Error> {
        for chunk in tokens.chunks(MAX_VERIFY_ROWS) {
            self.step_batch_all(chunk)?;
            self.commit_verify_rows(chunk.len())?;
            if let Some(rows) = self.pass_taps() {
                on_rows(rows);
            }
        }
        Ok(())
    }
}

/// Hidden states of consecutive target rows at several tap layers: `[taps, rows, hidden]`.
#[derive(Clone, Copy, Debug)]
pub struct TapRows<'a> {
    data: &'a [f32],
    taps: usize,
    /// Rows visible (a prefix of the stored ones).
    rows: usize,
    /// Rows stored per tap.
    stride: usize,
    hidden: usize,
}

impl<'a> TapRows<'a> {
    /// Views `data` as `[taps, rows, hidden]`; `None` unless the length matches exactly.
    pub fn new(data: &'a [f32], taps: usize, rows: usize, hidden: usize) -> Option<Self> {
        (taps.checked_mul(rows)?.checked_mul(hidden)? == data.len()).then_some(TapRows {
            data,
            taps,
            rows,
            stride: rows,
            hidden,
        })
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tap layers held.
    pub fn taps(&self) -> usize {
        self.taps
    }

    /// Floats per hidden state.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The hidden state of row `row` (< [`rows`](Self::rows)) at the `tap`-th layer.
    pub fn state(&self, tap: usize, row: usize) -> &'a [f32] {
        let at = (tap * self.stride + row.min(self.rows.saturating_sub(1))) * self.hidden;
        &self.data[at..at + self.hidden]
    }

    /// The first `rows` rows (all of them when `rows` is larger), same taps.
    pub fn first(&self, rows: usize) -> TapRows<'a> {
        TapRows {
            rows: rows.min(self.rows),
            ..*self
        }
    }
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
