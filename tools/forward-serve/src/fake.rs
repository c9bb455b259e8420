//! A deterministic fake engine for tests and for running the server without a model.
//!
//! Vocabulary: the 256 byte values plus EOS (id 256). The tokenizer maps bytes to ids. The "model"
//! continues a prompt `p` (as bytes) with `upper(p[k % len])` for k = 0, 1, ...; when that byte is `.`
//! it emits EOS instead; inside a prompt it predicts that each byte repeats (the rows an echoed
//! prompt's log-probabilities come from). So the expected completion of a prompt is a pure function of the prompt
//! ([`expected_text`]), which is what the concurrency tests check.
//!
//! With [`FakeEngine::with_dflash`] it also stands in for a DFlash draft: a sequence started with
//! [`SequenceStart::dflash`] drafts the fake model's own continuation, every seventh output byte
//! wrong ([`fake_dflash_draft`]), and keeps a draft context of one row per committed position as
//! the real engine does (drafts are refused when it is out of step).

use super::engine::{
    ChatMessage, Engine, EngineError, PrefillItem, SeqId, SequenceStart, TextCodec, MAX_STEP_ROWS,
    PREFILL_CHUNK,
};
use std::collections::HashMap;
use std::time::Duration;

/// The fake model's EOS id (the one id past the 256 byte values).
pub const FAKE_EOS: u32 = 256;
/// The fake model's vocabulary size: 256 bytes plus EOS.
pub const FAKE_VOCAB: usize = 257;

/// The fake codec.
pub struct FakeCodec {
    /// Context length reported (KV positions per sequence).
    pub ctx: usize,
    eos: [u32; 1],
}

impl FakeCodec {
    /// A codec reporting a context of `ctx` positions.
    pub fn new(ctx: usize) -> Self {
        FakeCodec {
            ctx,
            eos: [FAKE_EOS],
        }
    }
}

impl TextCodec for FakeCodec {
    fn model_id(&self) -> &str {
        "fake"
    }
    fn context_len(&self) -> usize {
        self.ctx
    }
    fn eos_ids(&self) -> &[u32] {
        &self.eos
    }
    fn vocab_size(&self) -> usize {
        FAKE_VOCAB
    }
    fn tokenize(&self, text: &str, _special: bool) -> Result<Vec<u32>, EngineError> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        match u8::try_from(id) {
            Ok(b) => vec![b],
            Err(_) => Vec::new(),
        }
    }
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        Ok(chat_text(messages))
    }
}

/// The fake chat template: `role: content\n` per message.
pub fn chat_text(messages: &[ChatMessage]) -> String {
    messages
        .iter()
        .map(|m| format!("{}: {}\n", m.role, m.content))
        .collect()
}

/// The fake model's next byte after `k` generated tokens (None = EOS).
pub fn next_byte(prompt: &[u8], k: usize) -> Option<u8> {
    if prompt.is_empty() {
        return None;
    }
    let b = prompt[k % prompt.len()].to_ascii_uppercase();
    (b != b'.').then_some(b)
}

/// The text the fake engine generates for `prompt` with at most `max_tokens` tokens and an
/// unbounded context, and whether it ended on EOS (used by the tests).
#[allow(dead_code)]
pub fn expected_text(prompt: &str, max_tokens: usize) -> (String, bool) {
    let p = prompt.as_bytes();
    let mut out = Vec::new();
    for k in 0..max_tokens {
        match next_byte(p, k) {
            Some(b) => out.push(b),
            None => return (String::from_utf8_lossy(&out).into_owned(), true),
        }
    }
    (String::from_utf8_lossy(&out).into_owned(), false)
}

/// The fake DFlash draft for output byte `k` of `prompt`: the fake model's own token, except for
/// every seventh byte (`k % 7 == 6`), which is drafted wrong.
pub fn fake_dflash_draft(prompt: &[u8], k: usize) -> u32 {
    let right = next_byte(prompt, k).map_or(FAKE_EOS, u32::from);
    if k % 7 == 6 {
        (right + 1) % FAKE_VOCAB as u32
    } else {
        right
    }
}

/// Most fake DFlash drafts per block (a block of 16 rows).
pub const FAKE_DFLASH_DRAFTS: usize = 15;

struct Seq {
    prompt: Vec<u8>,
    /// Context rows of its fake DFlash draft (`None`: it does not draft with one).
    draft_context: Option<usize>,
    /// Decode rows committed (the next row predicts output byte `generated + 1`).
    generated: usize,
    position: usize,
    /// Rows of the last step waiting for a commit.
    pending_rows: Option<usize>,
}

/// The fake engine. Its "model" ignores the tokens fed: row `j` of a step predicts output byte
/// `generated + j + 1`, which is right whenever the rows before it carried the right tokens — the
/// only rows an acceptance rule ever reads.
pub struct FakeEngine {
    seqs: HashMap<SeqId, Seq>,
    next_id: SeqId,
    max_seqs: usize,
    /// Sleep per decode pass (and per prefill chunk), to make timing tests possible.
    pub step_delay: Duration,
    logits: Vec<f32>,
    dflash: bool,
}

impl FakeEngine {
    /// An engine holding at most `max_seqs` sequences (at least 1), sleeping `step_delay` per
    /// pass.
    pub fn new(max_seqs: usize, step_delay: Duration) -> Self {
        FakeEngine {
            seqs: HashMap::new(),
            next_id: 1,
            max_seqs: max_seqs.max(1),
            step_delay,
            logits: vec![0.0; FAKE_VOCAB],
            dflash: false,
        }
    }

    /// With `on`, sequences may draft with the fake DFlash draft.
    pub fn with_dflash(mut self, on: bool) -> Self {
        self.dflash = on;
        self
    }

    /// One-hot-ish logits for output byte `k` of `seq`.
    fn fill(&mut self, seq: SeqId, k: usize) -> Result<(), EngineError> {
        let s = self.seqs.get(&seq).ok_or(EngineError::NoSequence(seq))?;
        let next = next_byte(&s.prompt, k).map_or(FAKE_EOS, u32::from);
        self.logits.iter_mut().for_each(|l| *l = 0.0);
        self.logits[next as usize] = 50.0;
        Ok(())
    }
}

impl Engine for FakeEngine {
    fn max_sequences(&self) -> usize {
        self.max_seqs
    }
    fn new_sequence(&mut self) -> Result<SeqId, EngineError> {
        if self.seqs.len() >= self.max_seqs {
            return Err(EngineError::Capacity(format!(
                "{} sequences resident",
                self.seqs.len()
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(
            id,
            Seq {
                prompt: Vec::new(),
                draft_context: None,
                generated: 0,
                position: 0,
                pending_rows: None,
            },
        );
        Ok(id)
    }
    fn prefill(
        &mut self,
        item: &PrefillItem<'_>,
        sink: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), EngineError> {
        if !self.step_delay.is_zero() {
            std::thread::sleep(self.step_delay);
        }
        let (seq, tokens) = (item.seq, item.tokens);
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(EngineError::NoSequence(seq))?;
        if tokens.iter().any(|&t| t >= 256) {
            return Err(EngineError::Device("fake: special token in prompt".into()));
        }
        if tokens.len() > PREFILL_CHUNK {
            return Err(EngineError::Capacity(format!(
                "fake: prefill chunk of {} tokens",
                tokens.len()
            )));
        }
        s.prompt.extend(tokens.iter().map(|&t| t as u8));
        s.position += tokens.len();
        if let Some(c) = s.draft_context.as_mut() {
            *c += tokens.len();
        }
        let last_row = tokens.len() - 1;
        for (row, &t) in tokens.iter().enumerate() {
            if item.last && row == last_row {
                self.fill(seq, 0)?;
                sink(row, &self.logits);
            } else if item.all_rows {
                // Inside the prompt the fake predicts that a byte repeats.
                self.logits.iter_mut().for_each(|l| *l = 0.0);
                self.logits[t as usize] = 50.0;
                sink(row, &self.logits);
            }
        }
        Ok(())
    }
    fn step(
        &mut self,
        batch: &[(SeqId, &[u32])],
        sink: &mut dyn FnMut(usize, usize, &[f32]),
    ) -> Result<(), EngineError> {
        if !self.step_delay.is_zero() {
            std::thread::sleep(self.step_delay);
        }
        let rows: usize = batch.iter().map(|(_, t)| t.len()).sum();
        if rows == 0 || rows > MAX_STEP_ROWS || batch.iter().any(|(_, t)| t.is_empty()) {
            return Err(EngineError::Capacity(format!(
                "fake: a step of {rows} rows"
            )));
        }
        for &(seq, _) in batch {
            let s = self.seqs.get(&seq).ok_or(EngineError::NoSequence(seq))?;
            if s.pending_rows.is_some() {
                return Err(EngineError::Device(format!(
                    "fake: sequence {seq} stepped without a commit"
                )));
            }
            if batch.iter().filter(|(o, _)| *o == seq).count() > 1 {
                return Err(EngineError::Device(format!("fake: sequence {seq} twice")));
            }
        }
        for (g, &(seq, toks)) in batch.iter().enumerate() {
            let generated = self.seqs.get(&seq).map_or(0, |s| s.generated);
            for j in 0..toks.len() {
                self.fill(seq, generated + j + 1)?;
                sink(g, j, &self.logits);
            }
            if let Some(s) = self.seqs.get_mut(&seq) {
                s.pending_rows = Some(toks.len());
            }
        }
        Ok(())
    }
    fn commit(&mut self, seq: SeqId, n: usize) -> Result<(), EngineError> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(EngineError::NoSequence(seq))?;
        match s.pending_rows.take() {
            Some(len) if (1..=len).contains(&n) => {
                s.generated += n;
                s.position += n;
                if let Some(c) = s.draft_context.as_mut() {
                    *c += n;
                }
                Ok(())
            }
            other => Err(EngineError::Device(format!(
                "fake: commit of {n} rows with {other:?} pending"
            ))),
        }
    }
    fn position(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.position)
    }
    fn release(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }
    fn start_sequence(
        &mut self,
        prompt: &[u32],
        start: SequenceStart,
    ) -> Result<(SeqId, usize), EngineError> {
        let _ = prompt;
        if start.dflash && !self.dflash {
            return Err(EngineError::Draft("this engine has no DFlash draft".into()));
        }
        let id = self.new_sequence()?;
        if let Some(s) = self.seqs.get_mut(&id) {
            s.draft_context = start.dflash.then_some(0);
        }
        Ok((id, 0))
    }
    fn has_dflash(&self) -> bool {
        self.dflash
    }
    fn dflash_drafts(
        &mut self,
        seq: SeqId,
        pending: u32,
        k: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), EngineError> {
        let _ = pending;
        out.clear();
        let s = self.seqs.get(&seq).ok_or(EngineError::NoSequence(seq))?;
        match s.draft_context {
            None => Err(EngineError::Draft(format!(
                "fake: sequence {seq} does not draft with DFlash"
            ))),
            Some(c) if c != s.position => Err(EngineError::Draft(format!(
                "fake: DFlash context {c}, position {}",
                s.position
            ))),
            Some(_) => {
                let first = s.generated + 1;
                out.extend(
                    (first..first + k.min(FAKE_DFLASH_DRAFTS))
                        .map(|k| fake_dflash_draft(&s.prompt, k)),
                );
                Ok(())
            }
        }
    }
    fn dflash_context(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq)?.draft_context
    }
}
