//! The engine seam: every line of `forward-serve` that touches the model layer lives in this file.
//!
//! The server talks to two small traits of its own:
//! - [`TextCodec`] (shared, `Send + Sync`): tokenizer, chat template, EOS ids, context length, model id.
//!   HTTP handlers use it to validate and tokenize before a request is queued.
//! - [`Engine`] (owned by the single engine thread; the NPU is single-tenant): sequences, prefill and
//!   decode passes that hand back logits.
//!
//! Sampling and streaming detokenization come from the model layer and are re-exported here so the
//! rest of the server never names `xdna::model` directly.

use std::sync::Arc;

pub use xdna::model::sample::{Sampler, SamplerConfig};
pub use xdna::model::text::{StopFilter, Utf8Stream};

/// One sequence's handle inside an [`Engine`].
pub type SeqId = u64;

/// Errors of the engine seam.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("load: {0}")]
    Load(String),
    #[error("tokenizer: {0}")]
    Tokenize(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("context: {0}")]
    Context(String),
    #[error("device: {0}")]
    Device(String),
    #[error("no such sequence {0}")]
    NoSequence(SeqId),
    #[error("engine capacity: {0}")]
    Capacity(String),
}

/// One chat message, already flattened to text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Text side of a model: shared by the HTTP handlers and the engine thread.
pub trait TextCodec: Send + Sync {
    /// The model id reported by `/v1/models` and in responses.
    fn model_id(&self) -> &str;
    /// KV positions of one sequence.
    fn context_len(&self) -> usize;
    /// Tokens that end a generation.
    fn eos_ids(&self) -> &[u32];
    fn vocab_size(&self) -> usize;
    /// Plain tokenization (no BOS); `special` lets special-token text map to its id.
    fn tokenize(&self, text: &str, special: bool) -> Result<Vec<u32>, EngineError>;
    /// Token ids of a prompt: BOS when the model wants one, then the text.
    fn prompt_tokens(&self, text: &str, special: bool) -> Result<Vec<u32>, EngineError> {
        self.tokenize(text, special)
    }
    /// The raw bytes of one token (may be part of a UTF-8 character).
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    /// Render a chat into the prompt text (template with the generation prompt appended).
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, EngineError>;
    /// Decode ids to text (invalid UTF-8 becomes U+FFFD).
    fn detokenize(&self, ids: &[u32]) -> String {
        let mut u = Utf8Stream::default();
        let mut out = String::new();
        for &id in ids {
            u.push(&self.token_bytes(id), &mut out);
        }
        u.finish(&mut out);
        out
    }
}

/// Compute side of a model: lives on the engine thread only.
pub trait Engine {
    /// How many sequences can be resident at once (the scheduler admits at most this many).
    fn max_sequences(&self) -> usize;
    /// Start an empty sequence.
    fn new_sequence(&mut self) -> Result<SeqId, EngineError>;
    /// Feed a prompt to a fresh sequence; `sink` gets the logits predicting the first new token.
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], sink: &mut dyn FnMut(&[f32])) -> Result<(), EngineError>;
    /// One decode step for each `(seq, token)` row (the token is fed and committed); `sink(i, logits)`
    /// gets row `i`'s logits for the next token. Rows belong to distinct sequences.
    fn decode(&mut self, rows: &[(SeqId, u32)], sink: &mut dyn FnMut(usize, &[f32])) -> Result<(), EngineError>;
    /// Committed positions of a sequence.
    fn position(&self, seq: SeqId) -> usize;
    /// Forget a sequence and free its state.
    fn release(&mut self, seq: SeqId);
}

/// A loaded model: its codec and a factory that builds the engine on the engine thread.
pub struct Loaded {
    pub codec: Arc<dyn TextCodec>,
    pub engine: Box<dyn Engine + Send>,
}

/// Options for loading the real model.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// Package directory or GGUF file; `None`: the default model.
    pub model: Option<std::path::PathBuf>,
    /// auto | host | xdna
    pub backend: String,
    /// KV positions per sequence.
    pub ctx: usize,
}

/// Load the real model. Placeholder until the model layer's loader and the tokenizer land on
/// this branch (see docs/serving.md, "What the model layer must add").
pub fn load(spec: &LoadSpec) -> Result<Loaded, EngineError> {
    Err(EngineError::Load(format!(
        "real model loading is not wired yet on this branch (model {:?}, backend {}, ctx {}): the \
         model layer's loader/tokenizer have not landed; use --fake-engine for a test engine",
        spec.model, spec.backend, spec.ctx
    )))
}
