//! N-gram / prompt-lookup drafting: copy the continuation of the most recent earlier occurrence of
//! the longest suffix n-gram of the context.

use std::collections::HashMap;

use super::decide::AcceptanceRule;
use super::drafter::{DraftProposal, Drafter};
use super::target::MAX_DRAFTS;
use super::SpecError;

/// Parameters of the n-gram drafter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NgramConfig {
    /// Shortest suffix n-gram that may match (≥ 1).
    pub min_n: usize,
    /// Longest suffix n-gram tried first (≥ `min_n`, ≤ 32).
    pub max_n: usize,
    /// Drafts per round at most (≤ 15); the loop may ask for fewer.
    pub max_drafts: usize,
}

impl Default for NgramConfig {
    fn default() -> Self {
        NgramConfig {
            min_n: 2,
            max_n: 4,
            max_drafts: 8,
        }
    }
}

impl NgramConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.min_n == 0 {
            return Err(SpecError::config("ngram min_n", self.min_n, "≥ 1"));
        }
        if self.max_n < self.min_n || self.max_n > MAX_NGRAM {
            return Err(SpecError::config(
                "ngram max_n",
                self.max_n,
                "in min_n..=32",
            ));
        }
        if self.max_drafts > MAX_DRAFTS {
            return Err(SpecError::config(
                "ngram max_drafts",
                self.max_drafts,
                "≤ 15",
            ));
        }
        Ok(())
    }
}

const MAX_NGRAM: usize = 32;

/// Prompt-lookup drafter with an incremental index.
///
/// For every n in `min_n..=max_n` the index maps an n-gram to the end of its most recent occurrence
/// that already has a continuation. Appending a token registers the n-grams ending just before it —
/// O(max_n²) per token — so a lookup costs O(max_n²) instead of a scan of the context. Keys are
/// 64-bit hashes; a hit is checked against the actual tokens, so a hash collision is a miss, never a
/// wrong draft.
#[derive(Debug)]
pub struct NgramDrafter {
    config: NgramConfig,
    tokens: Vec<u32>,
    index: HashMap<(usize, u64), usize>,
}

impl NgramDrafter {
    /// A drafter with a validated configuration.
    pub fn new(config: NgramConfig) -> Result<Self, SpecError> {
        config.validate()?;
        Ok(NgramDrafter {
            config,
            tokens: Vec::new(),
            index: HashMap::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &NgramConfig {
        &self.config
    }

    /// Tokens indexed so far.
    pub fn indexed_len(&self) -> usize {
        self.tokens.len()
    }

    fn clear(&mut self) {
        self.tokens.clear();
        self.index.clear();
    }

    fn append(&mut self, token: u32) {
        let end = self.tokens.len();
        for n in self.config.min_n..=self.config.max_n.min(end) {
            let key = (n, hash_tokens(&self.tokens[end - n..end]));
            self.index.insert(key, end);
        }
        self.tokens.push(token);
    }

    /// Brings the index up to `context`: appends the new tail when `context` extends what is
    /// indexed, rebuilds otherwise.
    fn sync(&mut self, context: &[u32]) {
        let known = self.tokens.len();
        let extends = known <= context.len()
            && (known == 0 || context[known - 1] == self.tokens[known - 1])
            && context.first() == self.tokens.first().or(context.first());
        if !extends {
            self.clear();
        }
        for &token in &context[self.tokens.len()..] {
            self.append(token);
        }
    }

    /// The drafts for the indexed context: up to `max_drafts` tokens following the most recent
    /// earlier occurrence of the longest matching suffix n-gram, pushed onto `out`.
    ///
    /// The copy may run past the end of the context into the drafts themselves (an overlapping
    /// copy, as in LZ77): a match ending `d` tokens before the end continues with period `d`. A
    /// text repeating a 2-token unit then yields full drafts instead of stopping after 2 tokens.
    fn lookup(&self, max_drafts: usize, out: &mut DraftProposal) {
        let len = self.tokens.len();
        if max_drafts == 0 {
            return;
        }
        for n in (self.config.min_n..=self.config.max_n.min(len)).rev() {
            let suffix = &self.tokens[len - n..];
            let Some(&end) = self.index.get(&(n, hash_tokens(suffix))) else {
                continue;
            };
            if end < n || end >= len || &self.tokens[end - n..end] != suffix {
                continue; // hash collision (or stale entry): a miss at this n
            }
            for j in 0..max_drafts {
                let source = end + j;
                let token = match self.tokens.get(source) {
                    Some(&token) => token,
                    // Past the context: the draft `source - len` proposed above.
                    None => out.tokens()[source - len],
                };
                out.push_one_hot(token);
            }
            return;
        }
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> &'static str {
        "ngram"
    }

    fn begin(&mut self, context: &[u32]) -> Result<(), SpecError> {
        self.clear();
        self.sync(context);
        Ok(())
    }

    fn propose(
        &mut self,
        context: &[u32],
        max_drafts: usize,
        _rule: &AcceptanceRule,
        out: &mut DraftProposal,
    ) -> Result<(), SpecError> {
        self.sync(context);
        out.reset(true, 0);
        let limit = max_drafts.min(self.config.max_drafts);
        self.lookup(limit, out);
        Ok(())
    }

    fn observe(&mut self, context: &[u32], _accepted_drafts: usize) -> Result<(), SpecError> {
        self.sync(context);
        Ok(())
    }
}

/// FNV-1a over the tokens' little-endian bytes, then a final avalanche.
fn hash_tokens(tokens: &[u32]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &token in tokens {
        for byte in token.to_le_bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^ (hash >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafts_for(config: NgramConfig, context: &[u32], max: usize) -> Vec<u32> {
        let mut drafter = match NgramDrafter::new(config) {
            Ok(d) => d,
            Err(e) => panic!("config: {e}"),
        };
        let mut out = DraftProposal::new();
        if let Err(e) = drafter.propose(context, max, &AcceptanceRule::Greedy, &mut out) {
            panic!("propose: {e}");
        }
        out.tokens().to_vec()
    }

    #[test]
    fn copies_continuation_of_most_recent_longest_match() {
        let config = NgramConfig {
            min_n: 1,
            max_n: 3,
            max_drafts: 4,
        };
        // "1 2 3" occurs at 0 (followed by 4 5) and at 5 (followed by 9 9); most recent wins.
        let context = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 7, 1, 2, 3];
        assert_eq!(drafts_for(config.clone(), &context, 4), vec![9, 9, 7, 1]);
        // Longest match first: suffix "8 3" has no 2-gram match, 1-gram "3" matches at 7.
        let context = [1, 2, 3, 4, 5, 8, 3];
        assert_eq!(drafts_for(config.clone(), &context, 4), vec![4, 5, 8, 3]);
        // The budget caps the continuation; no match → no drafts.
        assert_eq!(drafts_for(config.clone(), &context, 1), vec![4]);
        // A match near the end continues into its own drafts: "5 6" last seen ending 2 tokens
        // before the end, so the copy repeats with period 2 (by hand: 7 5 | 6 7 | 5 ...).
        let context = [5, 6, 7, 5, 6];
        assert_eq!(drafts_for(config.clone(), &context, 4), vec![7, 5, 6, 7]);
        assert_eq!(drafts_for(config, &[1, 2, 3], 4), Vec::<u32>::new());
    }

    #[test]
    fn min_n_excludes_short_matches() {
        let config = NgramConfig {
            min_n: 2,
            max_n: 3,
            max_drafts: 4,
        };
        assert_eq!(
            drafts_for(config, &[1, 2, 3, 4, 5, 8, 3], 4),
            Vec::<u32>::new()
        );
    }
}
