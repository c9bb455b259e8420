//! A model package: `config.json`, `model.q4nx`, `tokenizer.json`, `tokenizer_config.json`
//! (and optionally `chat_template.jinja`), as written by `xdna pack import` or by FastFlowLM.
//!
//! [`Package::open`] accepts a package directory, a `model.q4nx` inside one, or a `.gguf` file
//! (imported once into the cache, see [`super::import::cached_import`], then opened).
//!
//! Tensor names are HF-style. Our packages hold FUSED matrices
//! (`model.layers.{i}.self_attn.qkv_proj.weight` = q rows, then k, then v;
//! `model.layers.{i}.mlp.gate_up_proj.weight` = gate rows, then up); FastFlowLM packages hold
//! separate `q_proj/k_proj/v_proj` and `gate_proj/up_proj`. [`Package::fused`] says which.

use super::config::ModelConfig;
use super::safetensors::{Dtype, SafeTensors};
use super::tokenizer::Tokenizer;
use super::WeightsError;
use crate::tiles::{self, WeightFormat};
use std::path::{Path, PathBuf};

/// A zero-copy view of one weight matrix `[rows, cols]` (rows = out features, cols = K).
#[derive(Clone, Copy, Debug)]
pub struct MatrixView<'a> {
    /// How `data` is laid out (a tile format, or plain f32/f16/bf16 rows).
    pub format: WeightFormat,
    /// Output features.
    pub rows: usize,
    /// Input features (K).
    pub cols: usize,
    /// Tile grid in raster order (or plain row-major data), straight from the mmap.
    pub data: &'a [u8],
}

impl MatrixView<'_> {
    /// Decode one row to f32 (`out.len() == cols`).
    pub fn decode_row(&self, row: usize, out: &mut [f32]) -> Result<(), tiles::TileError> {
        tiles::decode_row(self.format, self.data, self.rows, self.cols, row, out)
    }
    /// Decode the whole matrix, row-major.
    pub fn decode_f32(&self) -> Result<Vec<f32>, tiles::TileError> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.decode_row(r, row)?;
        }
        Ok(out)
    }
}

impl<'a> MatrixView<'a> {
    /// The matrix `name` of `st` as `[rows, cols]` (rows = out features), checked as every
    /// loader takes it: the stored bytes are exactly `rows × cols` in the tensor's format (a
    /// whole tile grid for tiled formats), the shape agrees, and for our own files the recorded
    /// logical shape is `[rows, cols]`. Zero-copy.
    pub fn read(
        st: &'a SafeTensors,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<MatrixView<'a>, WeightsError> {
        let path = st.path();
        let t = st
            .tensor(name)
            .ok_or_else(|| WeightsError::missing(path, name))?;
        let format = st.format_of(name)?;
        if let Some((r, c)) = st.recorded_shape(name) {
            if (r, c) != (rows, cols) {
                return Err(WeightsError::tensor(
                    path,
                    name,
                    format!("asked for [{rows}, {cols}] but the file records [{r}, {c}]"),
                ));
            }
        }
        let expected = format
            .matrix_bytes(rows, cols)
            .map_err(|e| WeightsError::tensor(path, name, e.to_string()))?;
        if t.data.len() != expected {
            return Err(WeightsError::tensor(
                path,
                name,
                format!(
                    "[{rows}, {cols}] in {} needs {expected} bytes, the tensor has {} (shape {:?})",
                    format.name(),
                    t.data.len(),
                    t.shape
                ),
            ));
        }
        let shape_ok = match (format.tile_bytes(), t.shape.len()) {
            (None, _) if matches!(format, WeightFormat::Ggml(_)) => {
                t.shape == [rows, expected / rows.max(1)]
            }
            (None, _) => t.shape == [rows, cols],
            (Some(_), 3) => {
                t.shape[0] == rows / tiles::TILE_ROWS
                    && t.shape[1] == format.padded_cols(cols) / format.tile_cols()
            }
            (Some(_), _) => true,
        };
        if !shape_ok {
            return Err(WeightsError::tensor(
                path,
                name,
                format!(
                    "shape {:?} does not match [{rows}, {cols}] in {}",
                    t.shape,
                    format.name()
                ),
            ));
        }
        Ok(MatrixView {
            format,
            rows,
            cols,
            data: t.data,
        })
    }
}

/// What a tensor is for (from its HF name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// The token embedding table (`embed_tokens`, `token_embd.weight`).
    Embedding,
    /// The output projection to vocabulary logits (`lm_head`, `output.weight`).
    LmHead,
    /// The fused q ‖ k ‖ v projection (`qkv_proj`).
    AttnQkv,
    /// The query projection (`q_proj`, `attn_q`).
    AttnQ,
    /// The key projection (`k_proj`, `attn_k`).
    AttnK,
    /// The value projection (`v_proj`, `attn_v`).
    AttnV,
    /// The attention output projection (`o_proj`, `attn_output`).
    AttnO,
    /// The fused gate ‖ up projection (`gate_up_proj`).
    MlpGateUp,
    /// The MLP gate projection (`gate_proj`, `ffn_gate`).
    MlpGate,
    /// The MLP up projection (`up_proj`, `ffn_up`).
    MlpUp,
    /// The MLP down projection (`down_proj`, `ffn_down`).
    MlpDown,
    /// An RMSNorm weight (any name containing `norm`).
    Norm,
    /// Anything else (biases, GDN tensors, ...).
    Other,
}

impl TensorRole {
    /// Classify an HF-style (or GGUF-style) tensor name.
    pub fn of(name: &str) -> TensorRole {
        let n = name;
        let has = |s: &str| n.contains(s);
        if has("embed_tokens") || n == "token_embd.weight" {
            TensorRole::Embedding
        } else if has("lm_head") || n == "output.weight" {
            TensorRole::LmHead
        } else if has("qkv_proj") {
            TensorRole::AttnQkv
        } else if has("q_proj") || has("attn_q.") {
            TensorRole::AttnQ
        } else if has("k_proj") || has("attn_k.") {
            TensorRole::AttnK
        } else if has("v_proj") || has("attn_v.") {
            TensorRole::AttnV
        } else if has("o_proj") || has("attn_output") {
            TensorRole::AttnO
        } else if has("gate_up_proj") {
            TensorRole::MlpGateUp
        } else if has("gate_proj") || has("ffn_gate") {
            TensorRole::MlpGate
        } else if has("up_proj") || has("ffn_up") {
            TensorRole::MlpUp
        } else if has("down_proj") || has("ffn_down") {
            TensorRole::MlpDown
        } else if has("norm") {
            TensorRole::Norm
        } else {
            TensorRole::Other
        }
    }
    /// Short label for listings (`"attn.qkv"`, `"mlp.down"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            TensorRole::Embedding => "embedding",
            TensorRole::LmHead => "lm_head",
            TensorRole::AttnQkv => "attn.qkv",
            TensorRole::AttnQ => "attn.q",
            TensorRole::AttnK => "attn.k",
            TensorRole::AttnV => "attn.v",
            TensorRole::AttnO => "attn.o",
            TensorRole::MlpGateUp => "mlp.gate_up",
            TensorRole::MlpGate => "mlp.gate",
            TensorRole::MlpUp => "mlp.up",
            TensorRole::MlpDown => "mlp.down",
            TensorRole::Norm => "norm",
            TensorRole::Other => "other",
        }
    }
}

/// An open model package.
pub struct Package {
    dir: PathBuf,
    config: ModelConfig,
    weights: SafeTensors,
    tokenizer: Tokenizer,
    chat_template: Option<String>,
    eos: Vec<u32>,
    bos: Option<u32>,
    add_bos: bool,
    tokenizer_config: serde_json::Value,
}

impl std::fmt::Debug for Package {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Package")
            .field("dir", &self.dir)
            .field("weights", &self.weights)
            .finish()
    }
}

/// Name of the embedding tensor.
pub const EMBED: &str = "model.embed_tokens.weight";
/// Name of the output projection when not tied.
pub const LM_HEAD: &str = "lm_head.weight";

fn read_json(path: &Path) -> Result<serde_json::Value, WeightsError> {
    let text = std::fs::read_to_string(path).map_err(|e| WeightsError::io(path, e))?;
    serde_json::from_str(&text)
        .map_err(|e| WeightsError::invalid(path, format!("invalid JSON: {e}")))
}

fn token_field(v: &serde_json::Value) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(|c| c.as_str()))
}

fn ids_field(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        None => Vec::new(),
    }
}

impl Package {
    /// Open a package directory, a `model.q4nx` file inside one, or a `.gguf` file (imported into
    /// the cache on first use).
    pub fn open(path: impl AsRef<Path>) -> Result<Package, WeightsError> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| WeightsError::io(path, e))?;
        if meta.is_dir() {
            return Self::open_dir(path);
        }
        let is_gguf = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
            || {
                let mut magic = [0u8; 4];
                std::fs::File::open(path)
                    .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
                    .is_ok()
                    && &magic == b"GGUF"
            };
        if is_gguf {
            let dir = super::import::cached_import(path)?;
            return Self::open_dir(&dir);
        }
        match path.parent() {
            Some(dir) if dir.join("config.json").exists() => Self::open_dir(dir),
            _ => Err(WeightsError::invalid(
                path,
                "neither a package directory, a model.q4nx inside one, nor a .gguf file",
            )),
        }
    }

    /// Open a package directory.
    pub fn open_dir(dir: &Path) -> Result<Package, WeightsError> {
        let config_path = dir.join("config.json");
        let config = ModelConfig::from_file(&config_path)?;
        let weights = SafeTensors::open(dir.join("model.q4nx"))?;
        let tokenizer = Tokenizer::from_json_file(&dir.join("tokenizer.json"))?;
        let tc_path = dir.join("tokenizer_config.json");
        let tokenizer_config = if tc_path.exists() {
            read_json(&tc_path)?
        } else {
            serde_json::Value::Null
        };
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.exists() {
            Some(std::fs::read_to_string(&jinja).map_err(|e| WeightsError::io(&jinja, e))?)
        } else {
            tokenizer_config
                .get("chat_template")
                .and_then(|v| v.as_str())
                .map(str::to_string)
        };
        let mut eos = ids_field(tokenizer_config.get("eos_token_id"));
        if eos.is_empty() {
            if let Some(id) = tokenizer_config
                .get("eos_token")
                .and_then(token_field)
                .and_then(|s| tokenizer.token_id(s))
            {
                eos.push(id);
            }
        }
        if eos.is_empty() {
            eos = config.eos_token_ids.clone();
        }
        let bos = ids_field(tokenizer_config.get("bos_token_id"))
            .first()
            .copied()
            .or_else(|| {
                tokenizer_config
                    .get("bos_token")
                    .and_then(token_field)
                    .and_then(|s| tokenizer.token_id(s))
            })
            .or(config.bos_token_id);
        let add_bos = tokenizer_config
            .get("add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        Ok(Package {
            dir: dir.to_path_buf(),
            config,
            weights,
            tokenizer,
            chat_template,
            eos,
            bos,
            add_bos,
            tokenizer_config,
        })
    }

    /// The package directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The model description from `config.json`.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    /// The weight container.
    pub fn weights(&self) -> &SafeTensors {
        &self.weights
    }
    /// The tokenizer from `tokenizer.json`.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
    /// Raw `tokenizer_config.json` (Null if absent).
    pub fn tokenizer_config(&self) -> &serde_json::Value {
        &self.tokenizer_config
    }
    /// The Jinja chat template: `chat_template.jinja` if present, else `tokenizer_config.json`'s
    /// `chat_template`.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
    /// The ids that end generation: `tokenizer_config.json`'s `eos_token_id` (or `eos_token`),
    /// else `config.json`'s `eos_token_id`.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }
    /// The BOS id: `tokenizer_config.json`'s `bos_token_id` (or `bos_token`), else
    /// `config.json`'s `bos_token_id`.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }
    /// Whether a BOS token is prepended to prompts.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// The token to put before a prompt: the BOS id when the metadata asks for one and names it.
    pub fn leading_bos(&self) -> Option<u32> {
        self.bos.filter(|_| self.add_bos)
    }
    /// A prompt's token ids: [`Package::leading_bos`], left out when `special` text (a rendered
    /// chat template) already starts with the BOS token's text, then `text` encoded (`special`:
    /// special-token text is parsed as those tokens).
    pub fn encode_prompt(&self, text: &str, special: bool) -> Vec<u32> {
        let tok = self.tokenizer();
        let mut ids = Vec::new();
        if let Some(b) = self.leading_bos() {
            let bos_text = tok.token_str(b).unwrap_or("\u{0}");
            if !(special && text.starts_with(bos_text)) {
                ids.push(b);
            }
        }
        ids.extend(tok.encode(text, special));
        ids
    }
    /// Whether the weights file holds a tensor of this name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.weights.contains(name)
    }

    /// The first matrix stored as ggml block rows (`WeightFormat::Ggml`), which only the host
    /// executor runs, with its format; `None` when every matrix has a device format.
    pub fn host_only_matrix(&self) -> Option<(String, WeightFormat)> {
        self.weights
            .entries()
            .iter()
            .find_map(|e| match self.weights.format_of(&e.name) {
                Ok(f @ WeightFormat::Ggml(_)) => Some((e.name.clone(), f)),
                _ => None,
            })
    }

    /// Whether attention/MLP matrices are fused (`qkv_proj`, `gate_up_proj`) as in our imports,
    /// or separate (`q/k/v_proj`, `gate/up_proj`) as in FastFlowLM packages and imports of mixed
    /// weight types.
    pub fn fused(&self) -> bool {
        self.has_tensor("model.layers.0.self_attn.qkv_proj.weight")
    }

    /// A weight matrix `[rows, cols]` (rows = out features), validated against the stored bytes
    /// (and, for our own files, against the recorded shape). Zero-copy.
    pub fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<MatrixView<'_>, WeightsError> {
        MatrixView::read(&self.weights, name, rows, cols)
    }

    /// A 1-D (or any-shape plain) F32/BF16/F16 tensor as f32, e.g. a norm weight.
    pub fn vector(&self, name: &str) -> Result<Vec<f32>, WeightsError> {
        let path = self.weights.path();
        let t = self
            .weights
            .tensor(name)
            .ok_or_else(|| WeightsError::missing(path, name))?;
        let ty = match t.dtype {
            Dtype::F32 => super::gguf::GgmlType::F32,
            Dtype::BF16 => super::gguf::GgmlType::BF16,
            Dtype::F16 => super::gguf::GgmlType::F16,
            d => {
                return Err(WeightsError::tensor(
                    path,
                    name,
                    format!("dtype {} is not a float vector", d.name()),
                ))
            }
        };
        let n: usize = t.shape.iter().product();
        let mut out = vec![0f32; n];
        super::gguf::decode_f32(ty, t.data, &mut out)
            .map_err(|e| WeightsError::tensor(path, name, e))?;
        Ok(out)
    }

    /// Name of the tensor that holds the token embeddings (the lm_head when only it exists).
    pub fn embedding_name(&self) -> &'static str {
        if self.has_tensor(EMBED) {
            EMBED
        } else {
            LM_HEAD
        }
    }

    /// Name of the output projection: `lm_head.weight`, or the embedding when tied.
    pub fn lm_head_name(&self) -> &'static str {
        if self.has_tensor(LM_HEAD) {
            LM_HEAD
        } else {
            EMBED
        }
    }

    /// Rows of the embedding / lm_head tensor: what the file records (ours), the plain tensor's
    /// own shape (FastFlowLM bf16, possibly fewer rows than a padded config vocab), else the
    /// config's `vocab_size`.
    fn vocab_rows(&self, name: &str) -> usize {
        match (self.weights.recorded_shape(name), self.weights.tensor(name)) {
            (Some((r, _)), _) => r,
            (None, Some(t)) if t.shape.len() == 2 && t.dtype != Dtype::I8 => t.shape[0],
            _ => self.config.vocab,
        }
    }

    /// The output projection `[vocab, hidden]`: `lm_head.weight`, or the embedding when tied.
    pub fn lm_head(&self) -> Result<MatrixView<'_>, WeightsError> {
        let name = self.lm_head_name();
        self.matrix(name, self.vocab_rows(name), self.config.hidden)
    }

    /// Decode the embedding row of `token` into `out` (`out.len() == hidden_size`).
    pub fn embedding_row(&self, token: u32, out: &mut [f32]) -> Result<(), WeightsError> {
        let name = self.embedding_name();
        let vocab = self.vocab_rows(name);
        let m = self.matrix(name, vocab, self.config.hidden)?;
        if token as usize >= vocab {
            return Err(WeightsError::tensor(
                self.weights.path(),
                name,
                format!("token {token} out of range (vocab {vocab})"),
            ));
        }
        m.decode_row(token as usize, out)
            .map_err(|e| WeightsError::tensor(self.weights.path(), name, e.to_string()))
    }
}
