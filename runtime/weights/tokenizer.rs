//! Byte-level BPE tokenizer (GPT-2 family), built from GGUF metadata or an HF `tokenizer.json`.
//!
//! Encoding: added/special tokens are matched first (longest match, left to right) when
//! `allow_special` is set; the text between them is pre-tokenized, mapped through GPT-2's
//! byte → unicode table and merged by BPE rank.
//!
//! Pre-tokenizers:
//! - [`PreTokenizer::Gpt2`]: the GPT-2 pattern
//!   `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`;
//! - [`PreTokenizer::SmolLm`] (llama.cpp `smollm`, HF `Sequence[Split(\p{N}, Isolated),
//!   ByteLevel(use_regex)]`): every `\p{N}` char split off first, then GPT-2 on each piece;
//! - [`PreTokenizer::Llama3`] / [`PreTokenizer::Qwen2`] / [`PreTokenizer::Qwen35`] (llama.cpp
//!   `llama-bpe` / `qwen2` / `qwen35`, HF `Split(pattern, Isolated)` +
//!   `ByteLevel(use_regex=false)`), for FastFlowLM packages and Qwen3.5 GGUFs;
//! - [`PreTokenizer::LlamaCppDefault`] (llama.cpp `default`, and a GGUF without
//!   `tokenizer.ggml.pre`): punctuation runs, GPT-2, `\p{N}+`, digit triples, in turn.
//!
//! Other `tokenizer.json` pre-tokenizers are refused by name rather than tokenized differently.
//!
//! The `regex` crate has no lookaround, so `\s+(?!\S)` is done by hand: the lookahead-free
//! pattern matches a maximal whitespace run; when a non-space follows and the run is longer than
//! one char, its last char is given back (exactly what the backtracking engine does).
//! Agreement with the `tokenizers` crate is tested in `tests/weights_tokenizer.rs`.

use super::WeightsError;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// How text is split before BPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2 / ByteLevel(use_regex=true).
    Gpt2,
    /// llama.cpp `smollm`: digits isolated, then GPT-2.
    SmolLm,
    /// llama.cpp `llama-bpe` (Llama 3): `Split(LLAMA3_PATTERN, Isolated)` + ByteLevel(no regex).
    Llama3,
    /// llama.cpp `qwen2`: `Split(QWEN2_PATTERN, Isolated)` + ByteLevel(no regex).
    Qwen2,
    /// llama.cpp `qwen35` (Qwen3.5): Qwen2's pattern with combining marks (`\p{M}`) kept in
    /// letter runs.
    Qwen35,
    /// llama.cpp `default` (also what it reads when `tokenizer.ggml.pre` is missing): four splits
    /// in turn, each over every piece the previous one left — runs of punctuation and
    /// `$+<=>^~|` ([`DEFAULT_PUNCT_PATTERN`]), the GPT-2 pattern, `\p{N}+`, then ASCII digit
    /// triples from the left.
    LlamaCppDefault,
}

/// GPT-2's split pattern (HF ByteLevel `use_regex`).
pub const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split pattern.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split pattern.
pub const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The first split of llama.cpp's `default` pre-tokenizer.
pub const DEFAULT_PUNCT_PATTERN: &str = r"[\p{P}\$\+<=>\^~\|]+";
/// Its third split.
pub const DEFAULT_NUMBER_PATTERN: &str = r"\p{N}+";
/// Its fourth split.
pub const DEFAULT_TRIPLE_PATTERN: &str = r"[0-9][0-9][0-9]";
/// Qwen3.5's split pattern (llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN35`, from its `tokenizer.json`).
pub const QWEN35_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl PreTokenizer {
    /// The split pattern as HF and llama.cpp write it (with the `\s+(?!\S)` lookahead).
    pub fn pattern(self) -> &'static str {
        match self {
            PreTokenizer::Gpt2 | PreTokenizer::SmolLm | PreTokenizer::LlamaCppDefault => {
                GPT2_PATTERN
            }
            PreTokenizer::Llama3 => LLAMA3_PATTERN,
            PreTokenizer::Qwen2 => QWEN2_PATTERN,
            PreTokenizer::Qwen35 => QWEN35_PATTERN,
        }
    }
    /// The pattern without its only lookaround, for the `regex` crate; the lookahead is
    /// emulated by hand in the splitter.
    fn pattern_without_lookahead(self) -> String {
        self.pattern().replace(r"|\s+(?!\S)", "")
    }
}

/// A byte-level BPE tokenizer.
pub struct Tokenizer {
    /// Token id → the bytes it stands for.
    bytes: Vec<Vec<u8>>,
    /// Token id → its vocabulary string (byte-level alphabet).
    strings: Vec<String>,
    /// Vocabulary string → id.
    vocab: HashMap<String, u32>,
    /// (left id, right id) → (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32), PairHash>,
    /// Byte → id of its single-char token.
    byte_ids: [Option<u32>; 256],
    /// Added tokens matched before splitting: (content, id, special).
    added: Vec<(String, u32, bool)>,
    /// Bytes that start some added token (fast skip while scanning for them).
    added_first: [bool; 256],
    pre: PreTokenizer,
    gpt2: regex::Regex,
    digit: regex::Regex,
    /// llama.cpp `default`'s other three splits, in order around the GPT-2 one.
    default_splits: [regex::Regex; 3],
    source: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.strings.len())
            .field("merges", &self.merges.len())
            .field("added", &self.added.len())
            .field("pre", &self.pre)
            .finish()
    }
}

/// A fast hasher for (u32, u32) merge keys (FxHash-style multiply-rotate; keys are token ids
/// from our own vocabulary, so DoS resistance is not needed).
#[derive(Clone, Copy, Default)]
pub struct PairHasher(u64);

impl std::hash::Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type PairHash = std::hash::BuildHasherDefault<PairHasher>;

/// GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the rest to U+0100 onwards.
pub fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        table[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    table
}

impl Tokenizer {
    /// Build from a vocabulary (id order), merges (`"a b"` pairs of vocabulary strings, in rank
    /// order), added tokens `(id, special)`, and the pre-tokenizer.
    pub fn new(
        source: &Path,
        tokens: Vec<String>,
        merges: &[(String, String)],
        added: &[(u32, bool)],
        pre: PreTokenizer,
    ) -> Result<Tokenizer, WeightsError> {
        let err = |what: String| WeightsError::Tokenizer {
            path: source.to_path_buf(),
            what,
        };
        if tokens.len() > u32::MAX as usize {
            return Err(err("vocabulary too large".into()));
        }
        let table = byte_to_char_table();
        let mut rev: HashMap<char, u8> = HashMap::with_capacity(256);
        for (b, &c) in table.iter().enumerate() {
            rev.insert(c, b as u8);
        }
        let mut vocab = HashMap::with_capacity(tokens.len());
        let mut bytes = Vec::with_capacity(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            // Keep the first id of a duplicated string (as HF's vocab map would hold one).
            vocab.entry(t.clone()).or_insert(id as u32);
            let mut b = Vec::with_capacity(t.len());
            for ch in t.chars() {
                match rev.get(&ch) {
                    Some(&x) => b.push(x),
                    None => {
                        let mut buf = [0u8; 4];
                        b.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                    }
                }
            }
            bytes.push(b);
        }
        let mut byte_ids = [None; 256];
        for (b, &c) in table.iter().enumerate() {
            byte_ids[b] = vocab.get(c.to_string().as_str()).copied();
        }
        let mut merge_map = HashMap::with_capacity_and_hasher(merges.len(), PairHash::default());
        for (rank, (a, b)) in merges.iter().enumerate() {
            let (Some(&ia), Some(&ib)) = (vocab.get(a), vocab.get(b)) else {
                return Err(err(format!(
                    "merge #{rank} {a:?} {b:?} uses a token not in the vocabulary"
                )));
            };
            let merged = format!("{a}{b}");
            let Some(&im) = vocab.get(&merged) else {
                return Err(err(format!(
                    "merge #{rank} result {merged:?} is not in the vocabulary"
                )));
            };
            merge_map.entry((ia, ib)).or_insert((rank as u32, im));
        }
        let mut added_list = Vec::with_capacity(added.len());
        for &(id, special) in added {
            let s = tokens
                .get(id as usize)
                .ok_or_else(|| err(format!("added token id {id} outside the vocabulary")))?;
            if !s.is_empty() {
                added_list.push((s.clone(), id, special));
            }
        }
        // Longest first so that the first match at a position is the longest.
        added_list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let gpt2 =
            regex::Regex::new(&pre.pattern_without_lookahead()).map_err(|e| err(e.to_string()))?;
        let digit = regex::Regex::new(r"\p{N}").map_err(|e| err(e.to_string()))?;
        let compile = |p: &str| regex::Regex::new(p).map_err(|e| err(e.to_string()));
        let default_splits = [
            compile(DEFAULT_PUNCT_PATTERN)?,
            compile(DEFAULT_NUMBER_PATTERN)?,
            compile(DEFAULT_TRIPLE_PATTERN)?,
        ];
        Ok(Tokenizer {
            bytes,
            strings: tokens,
            vocab,
            merges: merge_map,
            byte_ids,
            added_first: {
                let mut f = [false; 256];
                for (s, _, _) in &added_list {
                    f[s.as_bytes()[0] as usize] = true;
                }
                f
            },
            added: added_list,
            pre,
            gpt2,
            digit,
            default_splits,
            source: source.to_path_buf(),
        })
    }

    /// Build from GGUF `tokenizer.ggml.*` metadata (`model = gpt2`).
    pub fn from_gguf(f: &super::gguf::GgufFile) -> Result<Tokenizer, WeightsError> {
        let err = |what: String| WeightsError::Tokenizer {
            path: f.path().to_path_buf(),
            what,
        };
        let model = f.get_str("tokenizer.ggml.model").unwrap_or("");
        if model != "gpt2" {
            return Err(err(format!(
                "tokenizer.ggml.model = {model:?}: only byte-level BPE (\"gpt2\") is supported"
            )));
        }
        let tokens: Vec<String> = f
            .get_array("tokenizer.ggml.tokens")
            .ok_or_else(|| err("metadata tokenizer.ggml.tokens missing".into()))?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| err(format!("tokenizer.ggml.tokens[{i}] is not a string")))
            })
            .collect::<Result<_, _>>()?;
        let merges: Vec<(String, String)> = f
            .get_array("tokenizer.ggml.merges")
            .unwrap_or(&[])
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .and_then(|s| s.split_once(' '))
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| err(format!("tokenizer.ggml.merges[{i}] is not \"a b\"")))
            })
            .collect::<Result<_, _>>()?;
        let types = f.get_array("tokenizer.ggml.token_type").unwrap_or(&[]);
        let added: Vec<(u32, bool)> = types
            .iter()
            .enumerate()
            .filter_map(|(i, t)| match t.as_i64() {
                // 2 unknown, 3 control → special; 4 user-defined → added, not special.
                Some(2) | Some(3) => Some((i as u32, true)),
                Some(4) => Some((i as u32, false)),
                _ => None,
            })
            .collect();
        // A missing key is read as llama.cpp reads it ("default"); a name that is not known is
        // refused, as llama.cpp refuses it, rather than split differently.
        let pre = match f.get_str("tokenizer.ggml.pre").unwrap_or("default") {
            "smollm" | "starcoder" | "refact" | "command-r" => PreTokenizer::SmolLm,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => PreTokenizer::Llama3,
            "qwen2" | "deepseek-r1-qwen" => PreTokenizer::Qwen2,
            "qwen35" => PreTokenizer::Qwen35,
            "gpt2" | "gpt-2" => PreTokenizer::Gpt2,
            "default" => PreTokenizer::LlamaCppDefault,
            other => {
                return Err(err(format!(
                    "tokenizer.ggml.pre = {other:?} is not a pre-tokenizer this runtime splits by \
                     (it reads smollm, starcoder, refact, command-r, llama3, llama-v3, llama-bpe, \
                     falcon3, pixtral, qwen2, deepseek-r1-qwen, qwen35, gpt-2, default)"
                )))
            }
        };
        Tokenizer::new(f.path(), tokens, &merges, &added, pre)
    }

    /// Build from an HF `tokenizer.json` (BPE model, ByteLevel pre-tokenizer optionally preceded
    /// by `Split(\p{N}, Isolated)`).
    pub fn from_json_file(path: &Path) -> Result<Tokenizer, WeightsError> {
        let text = std::fs::read_to_string(path).map_err(|e| WeightsError::io(path, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| WeightsError::Tokenizer {
                path: path.to_path_buf(),
                what: format!("invalid JSON: {e}"),
            })?;
        Self::from_json(path, &json)
    }

    /// Build from a parsed HF `tokenizer.json`.
    pub fn from_json(path: &Path, json: &serde_json::Value) -> Result<Tokenizer, WeightsError> {
        let err = |what: String| WeightsError::Tokenizer {
            path: path.to_path_buf(),
            what,
        };
        let model = &json["model"];
        if model["type"].as_str().unwrap_or("BPE") != "BPE" {
            return Err(err(format!("model type {} is not BPE", model["type"])));
        }
        let vocab = model["vocab"]
            .as_object()
            .ok_or_else(|| err("model.vocab missing".into()))?;
        let mut pairs: Vec<(u32, String)> = Vec::with_capacity(vocab.len());
        for (k, v) in vocab {
            let id = v
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| err(format!("vocab entry {k:?} has no integer id")))?;
            pairs.push((id, k.clone()));
        }
        let mut added = Vec::new();
        if let Some(list) = json["added_tokens"].as_array() {
            for t in list {
                let id = t["id"]
                    .as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| err("added token without id".into()))?;
                let content = t["content"]
                    .as_str()
                    .ok_or_else(|| err("added token without content".into()))?;
                if !pairs.iter().any(|(i, _)| *i == id) {
                    pairs.push((id, content.to_string()));
                }
                added.push((id, t["special"].as_bool().unwrap_or(false)));
            }
        }
        let n = pairs
            .iter()
            .map(|(i, _)| *i as usize + 1)
            .max()
            .unwrap_or(0);
        if n > pairs.len() * 2 + 1024 {
            return Err(err(format!("vocabulary ids are sparse (max id {})", n - 1)));
        }
        let mut tokens = vec![String::new(); n];
        for (id, s) in pairs {
            tokens[id as usize] = s;
        }
        let mut merges = Vec::new();
        if let Some(list) = model["merges"].as_array() {
            for (i, m) in list.iter().enumerate() {
                let pair = if let Some(s) = m.as_str() {
                    s.split_once(' ')
                        .map(|(a, b)| (a.to_string(), b.to_string()))
                } else if let Some(a) = m.as_array() {
                    match (
                        a.first().and_then(|x| x.as_str()),
                        a.get(1).and_then(|x| x.as_str()),
                    ) {
                        (Some(x), Some(y)) if a.len() == 2 => Some((x.to_string(), y.to_string())),
                        _ => None,
                    }
                } else {
                    None
                };
                merges.push(pair.ok_or_else(|| err(format!("merge #{i} is malformed")))?);
            }
        }
        let pre = pre_tokenizer_of(&json["pre_tokenizer"]).ok_or_else(|| {
            err(format!(
                "unsupported pre_tokenizer {} (supported: ByteLevel; Split(\\p{{N}}) + ByteLevel; \
                 Split(Llama-3 or Qwen2 pattern) + ByteLevel(use_regex=false))",
                json["pre_tokenizer"]
            ))
        })?;
        Tokenizer::new(path, tokens, &merges, &added, pre)
    }

    /// Number of ids (vocabulary plus added tokens).
    pub fn vocab_size(&self) -> usize {
        self.strings.len()
    }
    /// The pre-tokenizer in use.
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }
    /// Whether the vocabulary has a token for byte `b` alone. Text made only of such bytes
    /// encodes losslessly; a byte without one is dropped, as Hugging Face's BPE drops it.
    pub fn has_byte(&self, b: u8) -> bool {
        self.byte_ids[b as usize].is_some()
    }
    /// The bytes token `id` stands for (empty for unknown ids).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.bytes
            .get(id as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }
    /// The vocabulary string of `id` (byte-level alphabet; special tokens verbatim).
    pub fn token_str(&self, id: u32) -> Option<&str> {
        self.strings.get(id as usize).map(String::as_str)
    }
    /// Id of a vocabulary string (e.g. `"<|im_end|>"`).
    pub fn token_id(&self, s: &str) -> Option<u32> {
        self.vocab.get(s).copied()
    }
    /// Added tokens `(content, id, special)`.
    pub fn added_tokens(&self) -> &[(String, u32, bool)] {
        &self.added
    }
    /// Vocabulary strings in id order.
    pub fn tokens(&self) -> &[String] {
        &self.strings
    }
    /// Merges `(left, right)` in rank order (reconstructed).
    pub fn merges(&self) -> Vec<(String, String)> {
        let mut m: Vec<(u32, u32, u32)> = self
            .merges
            .iter()
            .map(|(&(a, b), &(r, _))| (r, a, b))
            .collect();
        m.sort_unstable();
        m.into_iter()
            .map(|(_, a, b)| {
                (
                    self.strings[a as usize].clone(),
                    self.strings[b as usize].clone(),
                )
            })
            .collect()
    }
    /// Where the tokenizer was loaded from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Encode text. With `allow_special`, special tokens in the text become their ids; without,
    /// they are tokenized as ordinary text. Non-special added tokens always match.
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        if self.added.iter().all(|a| a.2 && !allow_special) {
            self.encode_plain(text, &mut out);
            return out;
        }
        let mut start = 0;
        let mut i = 0;
        let b = text.as_bytes();
        while i < b.len() {
            if !text.is_char_boundary(i) {
                i += 1;
                continue;
            }
            if !self.added_first[b[i] as usize] {
                i += 1;
                continue;
            }
            let rest = &text[i..];
            let hit = self.added.iter().find(|(s, _, special)| {
                (allow_special || !special) && rest.starts_with(s.as_str())
            });
            if let Some((s, id, _)) = hit {
                self.encode_plain(&text[start..i], &mut out);
                out.push(*id);
                i += s.len();
                start = i;
            } else {
                i += 1;
            }
        }
        self.encode_plain(&text[start..], &mut out);
        out
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        match self.pre {
            PreTokenizer::Gpt2
            | PreTokenizer::Llama3
            | PreTokenizer::Qwen2
            | PreTokenizer::Qwen35 => self.encode_gpt2(text, out),
            PreTokenizer::SmolLm => {
                let mut last = 0;
                for m in self.digit.find_iter(text) {
                    self.encode_gpt2(&text[last..m.start()], out);
                    self.encode_gpt2(m.as_str(), out);
                    last = m.end();
                }
                self.encode_gpt2(&text[last..], out);
            }
            PreTokenizer::LlamaCppDefault => {
                for p in self.split_default(text) {
                    self.bpe(p.as_bytes(), out);
                }
            }
        }
    }

    /// The pre-tokenized pieces of `text` (no special-token handling); for tests and debugging.
    pub fn pre_tokenize<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut pieces = Vec::new();
        match self.pre {
            PreTokenizer::Gpt2
            | PreTokenizer::Llama3
            | PreTokenizer::Qwen2
            | PreTokenizer::Qwen35 => self.split_gpt2(text, &mut pieces),
            PreTokenizer::SmolLm => {
                let mut last = 0;
                for m in self.digit.find_iter(text) {
                    self.split_gpt2(&text[last..m.start()], &mut pieces);
                    self.split_gpt2(m.as_str(), &mut pieces);
                    last = m.end();
                }
                self.split_gpt2(&text[last..], &mut pieces);
            }
            PreTokenizer::LlamaCppDefault => pieces = self.split_default(text),
        }
        pieces
    }

    /// llama.cpp's `default` splitting: each split in turn over every piece so far, the matches
    /// and the text between them all kept as pieces (llama.cpp's `unicode_regex_split`).
    fn split_default<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let [punct, number, triple] = &self.default_splits;
        let mut pieces = Vec::new();
        split_keeping(punct, text, &mut pieces);
        let mut next = Vec::with_capacity(pieces.len());
        for p in &pieces {
            self.split_gpt2(p, &mut next);
        }
        for re in [number, triple] {
            pieces.clear();
            for p in &next {
                split_keeping(re, p, &mut pieces);
            }
            std::mem::swap(&mut pieces, &mut next);
        }
        next
    }

    fn split_gpt2<'t>(&self, text: &'t str, pieces: &mut Vec<&'t str>) {
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.gpt2.find_at(text, pos) else {
                pieces.push(&text[pos..]);
                break;
            };
            if m.start() > pos {
                // Cannot happen (the pattern covers every char), but never lose text.
                pieces.push(&text[pos..m.start()]);
            }
            let s = m.as_str();
            let mut end = m.end();
            // `\s+(?!\S)`: a whitespace run followed by a non-space gives back its last char.
            // (Llama 3 / Qwen2 try `\s*[\r\n]+` first: a run holding a line break is that
            // alternative's match and is kept whole.)
            let newline_alt = matches!(
                self.pre,
                PreTokenizer::Llama3 | PreTokenizer::Qwen2 | PreTokenizer::Qwen35
            );
            if end < text.len()
                && s.chars().all(char::is_whitespace)
                && !(newline_alt && s.contains(['\r', '\n']))
            {
                if let Some((last, _)) = s.char_indices().next_back() {
                    if last > 0 {
                        end = m.start() + last;
                    }
                }
            }
            pieces.push(&text[m.start()..end]);
            pos = end;
        }
    }

    fn encode_gpt2(&self, text: &str, out: &mut Vec<u32>) {
        let mut pieces = Vec::new();
        self.split_gpt2(text, &mut pieces);
        for p in pieces {
            self.bpe(p.as_bytes(), out);
        }
    }

    /// Byte-level BPE of one pre-tokenized piece: repeatedly merge the lowest-ranked adjacent
    /// pair, leftmost on ties, as HF `BPE::merge_word` does (min-heap of (rank, position) over a
    /// linked list of symbols, stale entries skipped: O(n log n) even for very long pieces).
    fn bpe(&self, piece: &[u8], out: &mut Vec<u32>) {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        const NONE: usize = usize::MAX;
        let mut ids: Vec<u32> = Vec::with_capacity(piece.len());
        // A byte the vocabulary lacks is dropped alone, as HF `BPE::merge_word` drops a symbol it
        // cannot look up (no unk, no byte fallback); its neighbours still merge across the gap.
        ids.extend(piece.iter().filter_map(|&b| self.byte_ids[b as usize]));
        let n = ids.len();
        if n < 2 {
            out.extend_from_slice(&ids);
            return;
        }
        let mut next: Vec<usize> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
        let mut alive = vec![true; n];
        // (rank, left position, left id, right id)
        let mut heap: BinaryHeap<Reverse<(u32, usize, u32, u32)>> = BinaryHeap::new();
        for i in 0..n - 1 {
            if let Some(&(rank, _)) = self.merges.get(&(ids[i], ids[i + 1])) {
                heap.push(Reverse((rank, i, ids[i], ids[i + 1])));
            }
        }
        while let Some(Reverse((_, i, a, b))) = heap.pop() {
            let j = next[i];
            if !alive[i] || j == NONE || ids[i] != a || ids[j] != b {
                continue; // stale
            }
            let Some(&(_, merged)) = self.merges.get(&(a, b)) else {
                continue;
            };
            ids[i] = merged;
            alive[j] = false;
            next[i] = next[j];
            if next[j] != NONE {
                prev[next[j]] = i;
            }
            if prev[i] != NONE {
                let p = prev[i];
                if let Some(&(rank, _)) = self.merges.get(&(ids[p], ids[i])) {
                    heap.push(Reverse((rank, p, ids[p], ids[i])));
                }
            }
            if next[i] != NONE {
                let q = next[i];
                if let Some(&(rank, _)) = self.merges.get(&(ids[i], ids[q])) {
                    heap.push(Reverse((rank, i, ids[i], ids[q])));
                }
            }
        }
        let mut i = 0;
        while i != NONE {
            out.push(ids[i]);
            i = next[i];
        }
    }

    /// Decode ids to text (invalid UTF-8 replaced by U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// A streaming decoder that holds back incomplete UTF-8 sequences across tokens.
    pub fn decode_stream(&self) -> DecodeStream<'_> {
        DecodeStream {
            tok: self,
            pending: Vec::new(),
        }
    }
}

/// `text` split at the matches of `re`: the matches and the non-empty text between them, in order.
fn split_keeping<'t>(re: &regex::Regex, text: &'t str, pieces: &mut Vec<&'t str>) {
    let mut last = 0;
    for m in re.find_iter(text) {
        if m.start() > last {
            pieces.push(&text[last..m.start()]);
        }
        pieces.push(m.as_str());
        last = m.end();
    }
    if last < text.len() {
        pieces.push(&text[last..]);
    }
}

/// Recognize an HF `pre_tokenizer` object.
pub fn pre_tokenizer_of(v: &serde_json::Value) -> Option<PreTokenizer> {
    let byte_level = |b: &serde_json::Value| -> Option<bool> {
        (b["type"] == "ByteLevel").then(|| b["use_regex"].as_bool().unwrap_or(true))
    };
    if let Some(true) = byte_level(v) {
        return Some(PreTokenizer::Gpt2);
    }
    if v["type"] != "Sequence" {
        return None;
    }
    let list = v["pretokenizers"].as_array()?;
    let isolated = |split: &serde_json::Value, pattern: &str| {
        split["type"] == "Split"
            && split["behavior"] == "Isolated"
            && split["invert"].as_bool() != Some(true)
            && split["pattern"]["Regex"].as_str() == Some(pattern)
    };
    if let [punct, bl, number, triple] = list.as_slice() {
        return (isolated(punct, DEFAULT_PUNCT_PATTERN)
            && byte_level(bl) == Some(true)
            && isolated(number, DEFAULT_NUMBER_PATTERN)
            && isolated(triple, DEFAULT_TRIPLE_PATTERN))
        .then_some(PreTokenizer::LlamaCppDefault);
    }
    let [split, bl] = list.as_slice() else {
        return None;
    };
    let use_regex = byte_level(bl)?;
    if split["type"] != "Split"
        || split["behavior"] != "Isolated"
        || split["invert"].as_bool() == Some(true)
    {
        return None;
    }
    match (split["pattern"]["Regex"].as_str()?, use_regex) {
        (r"\p{N}", true) => Some(PreTokenizer::SmolLm),
        (p, false) if p == LLAMA3_PATTERN => Some(PreTokenizer::Llama3),
        (p, false) if p == QWEN2_PATTERN => Some(PreTokenizer::Qwen2),
        (p, false) if p == QWEN35_PATTERN => Some(PreTokenizer::Qwen35),
        _ => None,
    }
}

/// Streaming detokenizer: push ids, get the text that is complete so far.
pub struct DecodeStream<'a> {
    tok: &'a Tokenizer,
    pending: Vec<u8>,
}

impl DecodeStream<'_> {
    /// Add one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.pending.extend_from_slice(self.tok.token_bytes(id));
        self.drain(false)
    }
    /// Flush what is left (an incomplete tail becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }
    fn drain(&mut self, all: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    // SAFETY-free: `good` is valid UTF-8 per `valid_up_to`.
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &bad[n..];
                        }
                        None => {
                            if all {
                                out.push('\u{FFFD}');
                                rest = &[];
                            } else {
                                rest = bad;
                            }
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }
}
