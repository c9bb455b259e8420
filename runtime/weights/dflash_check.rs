//! `xdna pack check`: the DFlash draft gate. Before any loader touches a DFlash draft — a
//! package directory (`config.json` with `model_type: "dflash"` and z-lab's `dflash_config`,
//! plus one Q4NX container `model.q4nx`) or llama.cpp's `dflash` GGUF — every rule the loaders
//! rely on is checked and reported as one [`Check`] per rule, named `<check> <subject>` where the
//! subject is the file, tensor or key checked (`grid model.fc.weight`, `scalar
//! dflash.block_size`). It fails closed: what cannot be read, or is not expected, is a FAIL.
//!
//! Checks of a package:
//! - `container model.q4nx`: the safetensors header parses;
//! - `config config.json`: a DFlash draft (`model_type` `dflash`) that [`ModelConfig`] reads,
//!   its generation-2 keys complete and consistent, no scale the draft forward does not apply;
//! - `tokenizer tokenizer.json`: parses and holds the mask token;
//! - `grid NAME`: every projection the config implies is present and is exactly the tensor's
//!   format's `N × K` (for tiles: a whole grid of 32 × 256 tiles, K padded), as loaders read it
//!   ([`MatrixView::read`]);
//! - `tiles NAME` / `values NAME`: tile headers are sane (q4_1: scales finite and positive,
//!   minimums finite; Q8: scales finite and not negative; padding cells finite, since they meet
//!   zero activations), plain values finite;
//! - `signature NAME`: the q4_1 signature, median minimum / scale over the matrix's cells within
//!   [`SIGNATURE_TOLERANCE`] of −7.5 (or every minimum exactly −8 · scale: Q4_0 blocks stored as
//!   q4_1, which an import of a Q4_0 GGUF writes);
//! - `norm NAME`: RMSNorm weights `hidden` or `head_dim` long and finite; `tensor NAME`: the
//!   generation-2 convolution base kernels, `[2, kernel, hidden]` floats;
//! - `unexplained NAME`: a tensor the draft does not use;
//! - `scalar dflash.*`: the container's `__metadata__` scalars ([`dflash_metadata`], written by
//!   `xdna pack import`) equal `config.json`'s, floats at f32 precision.
//!
//! A GGUF is checked in place, not imported first: the gate runs before any loader, and the
//! import stops at its first refusal, where the gate reports every broken rule. Its keys are the
//! description (`key dflash.*`, read here independently of the import's parser), its tensors are
//! checked by ggml type and shape (`grid`), block headers by unpacking every block (`blocks`:
//! every scale and minimum finite; Q4_1 scales positive) and Q4_1 blocks by the same signature
//! (a Q4_1 block is exactly one q4_1 tile cell).
//!
//! Generation-2 drafts (grouped convolutions and the candidate selector) are recognised and
//! their tensors checked by shape: per layer `attention_conv` / `mlp_conv` (GGUF `attn_conv` /
//! `ffn_conv`) base kernels `[2, kernel, hidden]` and kernel projections
//! `[2 · kernel · hidden / group, hidden]`, the selector's codebooks `[vocab, rank]` and
//! `hidden_projection` `[rank, hidden]` (shapes as llama.cpp's `src/models/dflash.cpp` creates
//! them).
//!
//! [`selftest`] writes a synthetic valid package with the import's writers and negative controls
//! that must each fail by name.

use super::config::{ModelConfig, DFLASH_ARCH, DFLASH_MAX_BLOCK};
use super::gguf::{GgmlType, GgufFile, GgufTensor};
use super::package::MatrixView;
use super::safetensors::{Declared, Dtype, SafeTensors, Writer};
use super::tokenizer::Tokenizer;
use super::WeightsError;
use crate::ggml::{self, BlockCodes};
use crate::tiles::{self, ScaleType, TileOrder, WeightFormat};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The centre of the q4_1 signature: a group of symmetric weights has its minimum near −7.5
/// scales (`m = min`, `d = (max − min) / 15`, min ≈ −max).
pub const SIGNATURE_CENTER: f64 = -7.5;

/// How far a q4_1 matrix's median minimum / scale may sit from [`SIGNATURE_CENTER`]. Measured
/// per matrix: SmolLM2-135M-Instruct's 210 Q4_1 matrices (trained weights) −7.566 … −7.435, a
/// random DFlash draft quantized by llama-quantize (15 matrices) −7.543 … −7.448, so at most
/// 0.066 off; the median of n cells has a standard error of about 1.6 / √n (0.1 for one tile's
/// 256 cells). 0.5 keeps 7× the measured spread and 5 standard errors of the smallest grid, and
/// still refuses what else fits a 5120-byte chunk: legacy q8 tiles (+1), FastFlowLM q4_0 tiles
/// (0) and scales read in the wrong half-float type.
pub const SIGNATURE_TOLERANCE: f64 = 0.5;

/// One rule checked: its name (`<check> <subject>`), whether it held, and what was found.
#[derive(Clone, Debug, PartialEq)]
pub struct Check {
    /// `<check> <subject>`: the rule and the file, tensor or key it was checked on.
    pub name: String,
    /// The rule held.
    pub pass: bool,
    /// What was found (the reason, on a FAIL).
    pub detail: String,
}

/// Every check of one draft.
#[derive(Clone, Debug)]
pub struct Report {
    /// The path checked.
    pub path: PathBuf,
    /// `"package"` or `"gguf"` (what the path was read as), or `"unknown"`.
    pub container: &'static str,
    /// The checks, in the order they ran.
    pub checks: Vec<Check>,
}

impl Report {
    /// Every check passed (and there was at least one).
    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.pass)
    }
    /// The checks that failed.
    pub fn failures(&self) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(|c| !c.pass)
    }
    /// The check of this exact name, if it ran.
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }
    /// One PASS/FAIL line per check.
    pub fn lines(&self) -> Vec<String> {
        self.checks
            .iter()
            .map(|c| {
                let verdict = if c.pass { "PASS" } else { "FAIL" };
                format!("{verdict} {}: {}", c.name, c.detail)
            })
            .collect()
    }
    /// `{path, container, pass, checks: [{name, pass, detail}]}`.
    pub fn to_json(&self) -> Value {
        json!({
            "path": self.path.display().to_string(),
            "container": self.container,
            "pass": self.passed(),
            "checks": self.checks.iter().map(|c| json!({
                "name": c.name, "pass": c.pass, "detail": c.detail,
            })).collect::<Vec<_>>(),
        })
    }
}

/// Collects checks.
struct Gate {
    checks: Vec<Check>,
}

impl Gate {
    fn record(&mut self, name: String, pass: bool, detail: String) {
        self.checks.push(Check { name, pass, detail });
    }
    fn pass(&mut self, name: impl Into<String>, detail: impl Into<String>) {
        self.record(name.into(), true, detail.into());
    }
    fn fail(&mut self, name: impl Into<String>, detail: impl Into<String>) {
        self.record(name.into(), false, detail.into());
    }
    fn outcome(&mut self, name: impl Into<String>, r: Result<String, String>) {
        match r {
            Ok(d) => self.pass(name, d),
            Err(d) => self.fail(name, d),
        }
    }
}

/// Check a DFlash draft: a package directory, a `model.q4nx` inside one, or a GGUF file. Never
/// an error: whatever cannot be read is a failed check naming it.
pub fn check(path: &Path) -> Report {
    let mut g = Gate { checks: Vec::new() };
    let container = match classify(path) {
        Ok(Kind::Package(dir)) => {
            check_package(&mut g, &dir);
            "package"
        }
        Ok(Kind::Gguf) => {
            check_gguf(&mut g, path);
            "gguf"
        }
        Err(why) => {
            g.fail(format!("container {}", path.display()), why);
            "unknown"
        }
    };
    Report {
        path: path.to_path_buf(),
        container,
        checks: g.checks,
    }
}

enum Kind {
    Package(PathBuf),
    Gguf,
}

fn classify(path: &Path) -> Result<Kind, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    if meta.is_dir() {
        return Ok(Kind::Package(path.to_path_buf()));
    }
    let mut magic = [0u8; 4];
    let is_gguf = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF";
    if is_gguf {
        return Ok(Kind::Gguf);
    }
    match path.parent() {
        Some(dir) if dir.join("config.json").is_file() => Ok(Kind::Package(dir.to_path_buf())),
        _ => Err(
            "neither a package directory, a model.q4nx inside one, nor a GGUF file (no GGUF magic)"
                .into(),
        ),
    }
}

/// Generation-2 dimensions (z-lab `DFlash2DraftModel`; GGUF `dflash.conv_kernel_size`,
/// `conv_group_size`, `selector_rank`, `selector_top_k`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Gen2 {
    conv_kernel: usize,
    conv_group: usize,
    selector_rank: usize,
    selector_top_k: usize,
}

/// The generation-2 keys, in `dflash_config` (config.json) and under `dflash.` (GGUF and the
/// container's metadata) alike.
const GEN2_KEYS: [&str; 4] = [
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
];

impl Gen2 {
    fn from_values(v: [usize; 4]) -> Gen2 {
        Gen2 {
            conv_kernel: v[0],
            conv_group: v[1],
            selector_rank: v[2],
            selector_top_k: v[3],
        }
    }
    /// Rows of a kernel projection: two sides (before and after the wrapped block), `kernel`
    /// offsets, one coefficient per channel group.
    fn projected(&self, hidden: usize) -> usize {
        self.conv_kernel
            .saturating_mul(2)
            .saturating_mul(hidden / self.conv_group.max(1))
    }
    /// llama.cpp's rules (`load_arch_tensors`): the first broken one as (key, problem).
    fn check(&self, hidden: usize, vocab: usize) -> Result<(), (&'static str, String)> {
        if self.conv_kernel == 0 {
            return Err(("conv_kernel_size", "0: expected at least 1".into()));
        }
        if self.conv_group == 0 || !hidden.is_multiple_of(self.conv_group) {
            return Err((
                "conv_group_size",
                format!(
                    "{}: expected a divisor of the hidden size {hidden}",
                    self.conv_group
                ),
            ));
        }
        if self.selector_rank == 0 {
            return Err(("selector_rank", "0: expected at least 1".into()));
        }
        let k = self.selector_top_k;
        if k == 0 || k > vocab || hidden < k.saturating_mul(k + 1) {
            return Err((
                "selector_top_k",
                format!(
                    "{k}: expected 1..={vocab} with hidden ({hidden}) ≥ k·(k + 1) (llama.cpp's selector lattice)"
                ),
            ));
        }
        Ok(())
    }
}

/// The shapes a draft's description implies.
#[derive(Clone, Debug)]
struct Dims {
    hidden: usize,
    intermediate: usize,
    layers: usize,
    q_dim: usize,
    kv_dim: usize,
    head_dim: usize,
    vocab: usize,
    taps: usize,
    gen2: Option<Gen2>,
}

/// What one expected tensor must be.
#[derive(Clone, Debug)]
enum Want {
    /// A weight matrix `[rows, cols]` (rows = out features) in any matrix format.
    Matrix { rows: usize, cols: usize },
    /// An RMSNorm weight of `len` floats (`what` names the length: hidden or head_dim).
    Norm { len: usize, what: &'static str },
    /// A plain float tensor of this shape (outermost first).
    Plain { shape: Vec<usize> },
}

/// The tensors a draft holds: (package name, GGUF name, what it must be), in load order.
fn expected(d: &Dims) -> Vec<(String, String, Want)> {
    let mut v = Vec::new();
    let (h, hd) = (d.hidden, d.head_dim);
    let hidden_norm = |len| Want::Norm {
        len,
        what: "hidden",
    };
    for i in 0..d.layers {
        let m = |s: &str| format!("model.layers.{i}.{s}.weight");
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        v.push((m("input_layernorm"), b("attn_norm"), hidden_norm(h)));
        v.push((m("post_attention_layernorm"), b("ffn_norm"), hidden_norm(h)));
        for (hf, gguf) in [("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")] {
            v.push((
                m(&format!("self_attn.{hf}")),
                b(gguf),
                Want::Norm {
                    len: hd,
                    what: "head_dim",
                },
            ));
        }
    }
    v.push((
        "model.hidden_norm.weight".into(),
        "enc.output_norm.weight".into(),
        hidden_norm(h),
    ));
    v.push((
        "model.norm.weight".into(),
        "output_norm.weight".into(),
        hidden_norm(h),
    ));
    // The target's hidden width is the draft's (llama.cpp: n_embd_inp = taps · n_embd).
    v.push((
        "model.fc.weight".into(),
        "fc.weight".into(),
        Want::Matrix {
            rows: h,
            cols: d.taps.saturating_mul(h),
        },
    ));
    for i in 0..d.layers {
        let m = |s: &str| format!("model.layers.{i}.{s}.weight");
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        let mat = |rows, cols| Want::Matrix { rows, cols };
        v.push((m("self_attn.q_proj"), b("attn_q"), mat(d.q_dim, h)));
        v.push((m("self_attn.k_proj"), b("attn_k"), mat(d.kv_dim, h)));
        v.push((m("self_attn.v_proj"), b("attn_v"), mat(d.kv_dim, h)));
        v.push((m("self_attn.o_proj"), b("attn_output"), mat(h, d.q_dim)));
        v.push((m("mlp.gate_proj"), b("ffn_gate"), mat(d.intermediate, h)));
        v.push((m("mlp.up_proj"), b("ffn_up"), mat(d.intermediate, h)));
        v.push((m("mlp.down_proj"), b("ffn_down"), mat(h, d.intermediate)));
        if let Some(g) = d.gen2 {
            for (hf, gguf) in [("attention_conv", "attn_conv"), ("mlp_conv", "ffn_conv")] {
                v.push((
                    format!("model.layers.{i}.{hf}.base_kernel"),
                    format!("blk.{i}.{gguf}_base"),
                    Want::Plain {
                        shape: vec![2, g.conv_kernel, h],
                    },
                ));
                v.push((
                    format!("model.layers.{i}.{hf}.kernel_projection.weight"),
                    b(&format!("{gguf}_proj")),
                    mat(g.projected(h), h),
                ));
            }
        }
    }
    if let Some(g) = d.gen2 {
        for (hf, gguf) in [
            ("predecessor_codebook", "selector_predecessor"),
            ("successor_codebook", "selector_successor"),
        ] {
            v.push((
                format!("model.candidate_selector.{hf}"),
                format!("{gguf}.weight"),
                Want::Matrix {
                    rows: d.vocab,
                    cols: g.selector_rank,
                },
            ));
        }
        v.push((
            "model.candidate_selector.hidden_projection.weight".into(),
            "selector_hidden.weight".into(),
            Want::Matrix {
                rows: g.selector_rank,
                cols: h,
            },
        ));
    }
    v
}

/// Dimensions a description may imply before any tensor is looked at: no side over 2³², no
/// matrix over 2⁴⁰ values (absurd keys would otherwise overflow the byte counts).
fn in_range(want: &Want) -> Result<(), String> {
    let dims: Vec<usize> = match want {
        Want::Matrix { rows, cols } => vec![*rows, *cols],
        Want::Norm { len, .. } => vec![*len],
        Want::Plain { shape } => shape.clone(),
    };
    let values = dims.iter().map(|&d| d as u128).product::<u128>();
    if dims.iter().any(|&d| d as u128 > 1 << 32) || values > 1 << 40 {
        return Err(format!(
            "the description implies a tensor of {dims:?}: out of range (sides ≤ 2^32, ≤ 2^40 values)"
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Scalars: what `xdna pack import` records in model.q4nx's `__metadata__`.

/// A scalar of the container's `dflash.*` metadata.
#[derive(Clone, Debug, PartialEq)]
enum Scalar {
    Int(u64),
    Ints(Vec<u64>),
    /// Compared at f32 precision.
    Float(f64),
    Bool(bool),
}

impl Scalar {
    fn text(&self) -> String {
        match self {
            Scalar::Int(v) => v.to_string(),
            Scalar::Ints(v) => v.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
            Scalar::Float(v) => format!("{v}"),
            Scalar::Bool(v) => v.to_string(),
        }
    }
    /// `s` read as the same kind of scalar as `self`.
    fn parse_like(&self, s: &str) -> Result<Scalar, String> {
        let bad = |what: &str| format!("{s:?} is not {what}");
        Ok(match self {
            Scalar::Int(_) => Scalar::Int(s.trim().parse().map_err(|_| bad("an integer"))?),
            Scalar::Ints(_) if s.trim().is_empty() => Scalar::Ints(Vec::new()),
            Scalar::Ints(_) => Scalar::Ints(
                s.split(',')
                    .map(|x| x.trim().parse::<u64>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| bad("a comma-separated list of integers"))?,
            ),
            Scalar::Float(_) => {
                let v: f64 = s.trim().parse().map_err(|_| bad("a number"))?;
                if !v.is_finite() {
                    return Err(bad("a finite number"));
                }
                Scalar::Float(v)
            }
            Scalar::Bool(_) => match s.trim() {
                "true" => Scalar::Bool(true),
                "false" => Scalar::Bool(false),
                _ => return Err(bad("true or false")),
            },
        })
    }
    fn same(&self, other: &Scalar) -> bool {
        match (self, other) {
            (Scalar::Float(a), Scalar::Float(b)) => (*a as f32) == (*b as f32),
            (a, b) => a == b,
        }
    }
}

/// The draft's scalars as the container records them, from its description and the
/// `config.json` it was written as (the generation-2 keys are read from `dflash_config`).
fn expected_scalars(cfg: &ModelConfig, config_json: &Value) -> Vec<(String, Scalar)> {
    let Some(d) = &cfg.dflash else {
        return Vec::new();
    };
    let mut v = vec![
        ("block_size", Scalar::Int(d.block_size as u64)),
        (
            "target_layer_ids",
            Scalar::Ints(d.target_layers.iter().map(|&l| l as u64).collect()),
        ),
        ("mask_token_id", Scalar::Int(u64::from(d.mask_token_id))),
        ("rope_theta", Scalar::Float(cfg.rope_theta)),
        ("rms_norm_eps", Scalar::Float(cfg.rms_eps)),
        // Sliding-window drafts are refused when the description is read: full attention.
        ("sliding_window", Scalar::Int(0)),
        ("causal", Scalar::Bool(d.causal)),
    ];
    for key in GEN2_KEYS {
        if let Some(n) = config_json
            .pointer(&format!("/dflash_config/{key}"))
            .and_then(Value::as_u64)
        {
            v.push((key, Scalar::Int(n)));
        }
    }
    v.into_iter()
        .map(|(k, s)| (format!("dflash.{k}"), s))
        .collect()
}

/// The `dflash.*` metadata `xdna pack import` writes into a draft's `model.q4nx`: block size,
/// target layer ids (0-based, as `config.json`'s `target_layer_ids`), mask token, rope theta,
/// RMS epsilon, sliding window (0), causal, and for generation 2 the convolution and selector
/// sizes. Empty for a description that is not a DFlash draft.
pub fn dflash_metadata(cfg: &ModelConfig, config_json: &Value) -> BTreeMap<String, String> {
    expected_scalars(cfg, config_json)
        .into_iter()
        .map(|(k, s)| (k, s.text()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Packages.

fn check_package(g: &mut Gate, dir: &Path) {
    let model = dir.join("model.q4nx");
    let st = match SafeTensors::open(&model) {
        Ok(st) => {
            g.pass(
                "container model.q4nx",
                format!(
                    "{}: safetensors, {} tensors, {:?} tile scales, {:?} tile order",
                    model.display(),
                    st.entries().len(),
                    st.scale_type(),
                    st.tile_order()
                ),
            );
            Some(st)
        }
        Err(e) => {
            g.fail("container model.q4nx", e.to_string());
            None
        }
    };
    let config_path = dir.join("config.json");
    let described = package_description(g, &config_path);
    let vocab_for_mask = described.as_ref().map(|(c, _, _)| c);
    check_tokenizer_json(g, &dir.join("tokenizer.json"), vocab_for_mask);
    let (Some(st), Some((cfg, raw, dims))) = (st, described) else {
        g.fail(
            "tensors model.q4nx",
            "not checked: needs both a readable container and a draft description",
        );
        return;
    };
    let mut wanted = BTreeSet::new();
    for (name, _, want) in expected(&dims) {
        wanted.insert(name.clone());
        if let Err(e) = in_range(&want) {
            g.fail(format!("grid {name}"), e);
            continue;
        }
        match want {
            Want::Matrix { rows, cols } => package_matrix(g, &st, &name, rows, cols),
            Want::Norm { len, what } => package_plain(g, &st, &name, &[len], Some(what)),
            Want::Plain { shape } => package_plain(g, &st, &name, &shape, None),
        }
    }
    let extra: Vec<&str> = st
        .entries()
        .iter()
        .map(|e| e.name.as_str())
        .filter(|n| !wanted.contains(*n))
        .collect();
    for name in &extra {
        g.fail(
            format!("unexplained {name}"),
            format!("tensor {name:?} is not one the draft uses"),
        );
    }
    if extra.is_empty() {
        g.pass(
            "unexplained model.q4nx",
            format!(
                "every tensor ({}) is one the draft uses",
                st.entries().len()
            ),
        );
    }
    check_scalars(g, &st, &cfg, &raw);
}

/// `config.json` read as the loaders read it ([`ModelConfig::from_json`]), plus the
/// generation-2 sizes from `dflash_config`.
fn package_description(g: &mut Gate, path: &Path) -> Option<(ModelConfig, Value, Dims)> {
    let name = "config config.json";
    let raw: Value = match std::fs::read_to_string(path)
        .map_err(|e| format!("{}: {e}", path.display()))
        .and_then(|t| {
            serde_json::from_str(&t).map_err(|e| format!("{}: invalid JSON: {e}", path.display()))
        }) {
        Ok(v) => v,
        Err(e) => {
            g.fail(name, e);
            return None;
        }
    };
    let model_type = raw.get("model_type").and_then(Value::as_str).unwrap_or("");
    if model_type != "dflash" || raw.get("dflash_config").is_none() {
        g.fail(
            name,
            format!(
                "{}: model_type {model_type:?}{}: not a DFlash draft (model_type \"dflash\" with a dflash_config)",
                path.display(),
                if raw.get("dflash_config").is_none() { ", no dflash_config" } else { "" }
            ),
        );
        return None;
    }
    let cfg = match ModelConfig::from_json(&raw, path) {
        Ok(c) => c,
        Err(e) => {
            g.fail(name, e.to_string());
            return None;
        }
    };
    let Some(d) = &cfg.dflash else {
        g.fail(
            name,
            format!("{}: read without DFlash parameters", path.display()),
        );
        return None;
    };
    let field = |k: &str| format!("{}: dflash_config.{k}", path.display());
    let present: Vec<Option<&Value>> = GEN2_KEYS
        .iter()
        .map(|k| raw.pointer(&format!("/dflash_config/{k}")))
        .collect();
    let gen2 = if present.iter().all(Option::is_none) {
        None
    } else {
        let mut v = [0usize; 4];
        for (i, (k, p)) in GEN2_KEYS.iter().zip(&present).enumerate() {
            match p.and_then(|x| x.as_u64()) {
                Some(n) => v[i] = n as usize,
                None => {
                    g.fail(
                        name,
                        format!(
                            "{}: {} (generation 2 needs all of {})",
                            field(k),
                            if p.is_some() {
                                "not a non-negative integer"
                            } else {
                                "missing"
                            },
                            GEN2_KEYS.join(", ")
                        ),
                    );
                    return None;
                }
            }
        }
        let g2 = Gen2::from_values(v);
        if let Err((k, problem)) = g2.check(cfg.hidden, cfg.vocab) {
            g.fail(name, format!("{}: {problem}", field(k)));
            return None;
        }
        Some(g2)
    };
    // Scales the draft forward does not apply would be ignored silently.
    for key in [
        "input_embedding_scale",
        "output_multiplier",
        "attention_value_scale",
    ] {
        let v = raw
            .pointer(&format!("/dflash_config/{key}"))
            .or_else(|| raw.get(key))
            .filter(|v| !v.is_null());
        if let Some(v) = v {
            if v.as_f64() != Some(1.0) {
                g.fail(
                    name,
                    format!(
                        "{}: {key} = {v}: not applied by the draft forward (only 1 is)",
                        path.display()
                    ),
                );
                return None;
            }
        }
    }
    if let Some(v) = raw
        .pointer("/dflash_config/final_logit_softcapping")
        .or_else(|| raw.get("final_logit_softcapping"))
        .filter(|v| !v.is_null() && v.as_f64() != Some(0.0))
    {
        g.fail(
            name,
            format!(
                "{}: final_logit_softcapping = {v}: not applied by the draft forward",
                path.display()
            ),
        );
        return None;
    }
    let dims = Dims {
        hidden: cfg.hidden,
        intermediate: cfg.intermediate,
        layers: cfg.layers,
        q_dim: cfg.heads.saturating_mul(cfg.head_dim),
        kv_dim: cfg.kv_heads.saturating_mul(cfg.head_dim),
        head_dim: cfg.head_dim,
        vocab: cfg.vocab,
        taps: d.target_layers.len(),
        gen2,
    };
    g.pass(
        name,
        format!(
            "DFlash generation-{} draft: {} layers, hidden {}, {} heads / {} KV heads of {}, MLP {}, vocab {}, block {}, target layers {:?}, mask token {}",
            if gen2.is_some() { 2 } else { 1 },
            cfg.layers,
            cfg.hidden,
            cfg.heads,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.intermediate,
            cfg.vocab,
            d.block_size,
            d.target_layers,
            d.mask_token_id
        ),
    );
    Some((cfg, raw, dims))
}

fn check_tokenizer_json(g: &mut Gate, path: &Path, cfg: Option<&ModelConfig>) {
    let name = "tokenizer tokenizer.json";
    let tok = match Tokenizer::from_json_file(path) {
        Ok(t) => t,
        Err(e) => return g.fail(name, e.to_string()),
    };
    let mask = cfg.and_then(|c| c.dflash.as_ref()).map(|d| d.mask_token_id);
    match mask {
        Some(m) if m as usize >= tok.vocab_size() => g.fail(
            name,
            format!(
                "the mask token {m} is outside its {} tokens",
                tok.vocab_size()
            ),
        ),
        Some(m) => g.pass(
            name,
            format!("{} tokens, mask token {m} among them", tok.vocab_size()),
        ),
        None => g.pass(
            name,
            format!(
                "{} tokens (mask token not checked: no draft description)",
                tok.vocab_size()
            ),
        ),
    }
}

/// `grid NAME`, then its contents (`tiles` / `values`) and, for q4_1, `signature`.
fn package_matrix(g: &mut Gate, st: &SafeTensors, name: &str, rows: usize, cols: usize) {
    let grid = format!("grid {name}");
    let view = match MatrixView::read(st, name, rows, cols) {
        Ok(v) => v,
        Err(e) => {
            return g.fail(
                grid,
                format!("{e}{}", tile_count_note(st, name, rows, cols)),
            )
        }
    };
    let held = match view.format.tile_bytes() {
        Some(tb) => format!(", {} tiles of {tb} B", view.data.len() / tb),
        None => String::new(),
    };
    g.pass(
        grid,
        format!("{} [{rows}, {cols}]{held}", view.format.name()),
    );
    match view.format {
        WeightFormat::Q41 { scale, .. } => {
            let mut s = CellStats::default();
            scan_q41_tiles(&view, scale, &mut s);
            g.outcome(format!("tiles {name}"), s.header_verdict("q4_1 tile"));
            g.outcome(format!("signature {name}"), s.signature());
        }
        WeightFormat::Q8 { scale, .. } => {
            g.outcome(format!("tiles {name}"), scan_q8_tiles(&view, scale));
        }
        WeightFormat::Q8Legacy => {
            g.outcome(format!("tiles {name}"), scan_q8_legacy_tiles(&view));
        }
        WeightFormat::Q4K => {
            g.outcome(format!("tiles {name}"), scan_q4k_tiles(&view));
        }
        WeightFormat::Ggml(ty) => {
            let mut s = CellStats::default();
            let r = scan_blocks(ty, view.data, &mut s);
            g.outcome(format!("values {name}"), r);
        }
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => {
            let r = finite_rows(rows, cols, |r, row| {
                view.decode_row(r, row).map_err(|e| e.to_string())
            });
            g.outcome(format!("values {name}"), r);
        }
    }
}

/// How many whole tiles a tiled tensor holds against what `[rows, cols]` needs, for a failed
/// grid check (empty when it is not a tile grid).
fn tile_count_note(st: &SafeTensors, name: &str, rows: usize, cols: usize) -> String {
    let (Some(t), Ok(f)) = (st.tensor(name), st.format_of(name)) else {
        return String::new();
    };
    let Some(tb) = f.tile_bytes() else {
        return String::new();
    };
    let held = format!(
        "{} tiles{}",
        t.data.len() / tb,
        if t.data.len() % tb != 0 {
            format!(" and {} stray bytes", t.data.len() % tb)
        } else {
            String::new()
        }
    );
    match f.matrix_bytes(rows, cols) {
        Ok(need) => format!(
            " (holds {held}; [{rows}, {cols}] is a {} × {} grid of {} tiles)",
            rows / tiles::TILE_ROWS,
            f.padded_cols(cols) / f.tile_cols(),
            need / tb
        ),
        Err(e) => format!(" (holds {held}; {e})"),
    }
}

/// A plain float tensor: `norm NAME` (`what` names the length) or `tensor NAME`.
fn package_plain(g: &mut Gate, st: &SafeTensors, name: &str, shape: &[usize], what: Option<&str>) {
    let check = match what {
        Some(_) => format!("norm {name}"),
        None => format!("tensor {name}"),
    };
    let Some(t) = st.tensor(name) else {
        return g.fail(
            check,
            format!("{}: no tensor {name:?}", st.path().display()),
        );
    };
    let ty = match t.dtype {
        Dtype::F32 => GgmlType::F32,
        Dtype::F16 => GgmlType::F16,
        Dtype::BF16 => GgmlType::BF16,
        d => {
            return g.fail(
                check,
                format!("{name}: dtype {} is not a float type", d.name()),
            )
        }
    };
    let expect = match what {
        Some(w) => format!("{shape:?} ({w})"),
        None => format!("{shape:?}"),
    };
    if t.shape != shape {
        return g.fail(
            check,
            format!("{name}: shape {:?}, expected {expect}", t.shape),
        );
    }
    let mut values = vec![0f32; shape.iter().product()];
    if let Err(e) = super::gguf::decode_f32(ty, t.data, &mut values) {
        return g.fail(check, format!("{name}: {e}"));
    }
    g.outcome(
        check,
        all_finite(&values).map(|()| format!("{} {expect}, finite", t.dtype.name())),
    );
}

fn check_scalars(g: &mut Gate, st: &SafeTensors, cfg: &ModelConfig, raw: &Value) {
    let want = expected_scalars(cfg, raw);
    let meta = st.metadata();
    for (key, expect) in &want {
        let name = format!("scalar {key}");
        let Some(stored) = meta.get(key) else {
            g.fail(
                name,
                format!(
                    "{key}: missing from model.q4nx __metadata__ (config.json: {})",
                    expect.text()
                ),
            );
            continue;
        };
        match expect.parse_like(stored) {
            Ok(v) if v.same(expect) => g.pass(
                name,
                format!("{key} = {} in model.q4nx and config.json", v.text()),
            ),
            Ok(v) => g.fail(
                name,
                format!(
                    "{key}: model.q4nx records {}, config.json gives {}",
                    v.text(),
                    expect.text()
                ),
            ),
            Err(e) => g.fail(name, format!("{key}: model.q4nx records {e}")),
        }
    }
    let known: BTreeSet<&str> = want.iter().map(|(k, _)| k.as_str()).collect();
    for key in meta.keys().filter(|k| k.starts_with("dflash.")) {
        if !known.contains(key.as_str()) {
            g.fail(
                format!("scalar {key}"),
                format!("{key}: recorded in model.q4nx but not a scalar of this draft"),
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Cell scans.

/// Scale/minimum pairs of q4_1 cells (tile cells or Q4_1 blocks) and block scales of other
/// types: the first broken header, and the q4_1 signature's ratios.
#[derive(Default)]
struct CellStats {
    cells: usize,
    bad: usize,
    first_bad: Option<String>,
    ratios: Vec<f32>,
    /// Every q4_1 minimum so far is exactly −8 · scale (Q4_0 blocks stored as q4_1).
    all_minus_eight: Option<bool>,
}

impl CellStats {
    fn flag(&mut self, what: impl FnOnce() -> String) {
        self.bad += 1;
        if self.first_bad.is_none() {
            self.first_bad = Some(what());
        }
    }
    /// One q4_1 cell (scale `d`, minimum `m`) at `at`.
    fn q41(&mut self, d: f32, m: f32, at: impl Fn() -> String) {
        self.cells += 1;
        if !d.is_finite() || d <= 0.0 {
            return self.flag(|| format!("{}: scale {d} is not finite and positive", at()));
        }
        if !m.is_finite() {
            return self.flag(|| format!("{}: minimum {m} is not finite", at()));
        }
        self.ratios.push(m / d);
        let minus_eight = m == -8.0 * d;
        self.all_minus_eight = Some(self.all_minus_eight.unwrap_or(true) && minus_eight);
    }
    fn header_verdict(&self, what: &str) -> Result<String, String> {
        match &self.first_bad {
            None => Ok(format!(
                "{} {what} cells: scales finite and positive, minimums finite",
                self.cells
            )),
            Some(first) => Err(format!(
                "{} of {} {what} cells broken; first: {first}",
                self.bad, self.cells
            )),
        }
    }
    fn signature(&mut self) -> Result<String, String> {
        let n = self.ratios.len();
        if n == 0 {
            return Err("no sane q4_1 cell to measure".into());
        }
        if self.all_minus_eight == Some(true) {
            return Ok(format!(
                "every minimum of {n} cells is −8 · scale: Q4_0 blocks stored as q4_1"
            ));
        }
        let mid = n / 2;
        let (_, m, _) = self.ratios.select_nth_unstable_by(mid, f32::total_cmp);
        let median = f64::from(*m);
        let text = format!(
            "median minimum / scale {median:.3} over {n} cells (expected {SIGNATURE_CENTER} ± {SIGNATURE_TOLERANCE})"
        );
        if (median - SIGNATURE_CENTER).abs() <= SIGNATURE_TOLERANCE {
            Ok(text)
        } else {
            Err(format!("{text}: not q4_1 data of symmetric weights"))
        }
    }
}

fn bits_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Where tile `t`'s cell (g, r) sits in the matrix.
fn cell_at(t: usize, q_tiles: usize, g: usize, r: usize) -> String {
    format!(
        "tile {t} (row {}, columns {}..{})",
        (t / q_tiles) * tiles::TILE_ROWS + r,
        (t % q_tiles) * tiles::TILE_COLS + g * tiles::GROUP,
        (t % q_tiles) * tiles::TILE_COLS + (g + 1) * tiles::GROUP
    )
}

/// Whether group `g` of column tile `q` holds real columns (not K padding).
fn real_group(q: usize, g: usize, cols: usize) -> bool {
    q * tiles::TILE_COLS + g * tiles::GROUP < cols
}

fn scan_q41_tiles(view: &MatrixView<'_>, scale: ScaleType, s: &mut CellStats) {
    let q_tiles = view.format.padded_cols(view.cols) / tiles::TILE_COLS;
    for (t, tile) in view.data.chunks_exact(tiles::Q41_TILE_BYTES).enumerate() {
        let q = t % q_tiles.max(1);
        for g in 0..tiles::GROUPS {
            for r in 0..tiles::TILE_ROWS {
                let at = 2 * tiles::cell(g, r);
                let d = tiles::scale_to_f32(scale, bits_at(tile, at));
                let m = tiles::scale_to_f32(scale, bits_at(tile, tiles::Q41_MINS + at));
                if real_group(q, g, view.cols) {
                    s.q41(d, m, || cell_at(t, q_tiles, g, r));
                } else if !d.is_finite() || !m.is_finite() {
                    // Padding meets zero activations, where only a NaN or infinity would show.
                    s.flag(|| {
                        format!(
                            "{} (K padding): scale {d}, minimum {m} not finite",
                            cell_at(t, q_tiles, g, r)
                        )
                    });
                }
            }
        }
    }
}

fn scan_q8_tiles(view: &MatrixView<'_>, scale: ScaleType) -> Result<String, String> {
    let q_tiles = view.format.padded_cols(view.cols) / tiles::TILE_COLS;
    let mut s = CellStats::default();
    for (t, tile) in view.data.chunks_exact(tiles::Q8_TILE_BYTES).enumerate() {
        let q = t % q_tiles.max(1);
        for g in 0..tiles::GROUPS {
            for r in 0..tiles::TILE_ROWS {
                let d = tiles::scale_to_f32(scale, bits_at(tile, 2 * tiles::cell(g, r)));
                let real = real_group(q, g, view.cols);
                s.cells += usize::from(real);
                // A zero scale is how Q8_0 stores a group of zeros.
                if !d.is_finite() || (real && d < 0.0) {
                    s.flag(|| {
                        format!(
                            "{}: scale {d} is not finite and non-negative",
                            cell_at(t, q_tiles, g, r)
                        )
                    });
                }
            }
        }
    }
    match s.first_bad {
        None => Ok(format!(
            "{} Q8 tile cells: scales finite and non-negative",
            s.cells
        )),
        Some(f) => Err(format!("{} Q8 tile cells broken; first: {f}", s.bad)),
    }
}

fn scan_q8_legacy_tiles(view: &MatrixView<'_>) -> Result<String, String> {
    let mut s = CellStats::default();
    for (t, tile) in view
        .data
        .chunks_exact(tiles::Q8_LEGACY_TILE_BYTES)
        .enumerate()
    {
        for i in 0..128 {
            let d = tiles::scale_to_f32(ScaleType::Bf16, bits_at(tile, 2 * i));
            s.cells += 1;
            if !d.is_finite() || d < 0.0 {
                s.flag(|| format!("tile {t} scale {i}: {d} is not finite and non-negative"));
            }
        }
    }
    match s.first_bad {
        None => Ok(format!(
            "{} legacy q8 scales finite and non-negative",
            s.cells
        )),
        Some(f) => Err(format!("{} legacy q8 scales broken; first: {f}", s.bad)),
    }
}

fn scan_q4k_tiles(view: &MatrixView<'_>) -> Result<String, String> {
    let mut s = CellStats::default();
    for (t, tile) in view.data.chunks_exact(tiles::Q4K_TILE_BYTES).enumerate() {
        for r in 0..tiles::TILE_ROWS {
            let sup = half::bf16::from_bits(bits_at(tile, 4608 + 2 * r)).to_f32();
            let min = half::bf16::from_bits(bits_at(tile, 4672 + 2 * r)).to_f32();
            s.cells += 1;
            if !sup.is_finite() || !min.is_finite() {
                s.flag(|| {
                    format!("tile {t} row {r}: super scale {sup}, super minimum {min} not finite")
                });
            }
        }
    }
    match s.first_bad {
        None => Ok(format!(
            "{} Q4_K tile rows: super scales and minimums finite",
            s.cells
        )),
        Some(f) => Err(format!("{} Q4_K tile rows broken; first: {f}", s.bad)),
    }
}

/// Every block of ggml type `ty` in `data` unpacked: every scale and offset finite; Q4_1 blocks
/// also go through [`CellStats::q41`] (scale positive, and the signature).
fn scan_blocks(ty: GgmlType, data: &[u8], s: &mut CellStats) -> Result<String, String> {
    let (values, bytes) = ty.block();
    if !ty.is_block_quant() || !data.len().is_multiple_of(bytes) {
        return Err(format!(
            "{} bytes are not whole {} blocks",
            data.len(),
            ty.name()
        ));
    }
    let mut codes = BlockCodes::default();
    let mut other = 0usize;
    for (b, block) in data.chunks_exact(bytes).enumerate() {
        ggml::unpack(ty, block, &mut codes);
        let at = || format!("block {b} (values {}..{})", b * values, (b + 1) * values);
        if ty == GgmlType::Q4_1 {
            s.q41(codes.scale[0], codes.offset[0], at);
            continue;
        }
        for sub in 0..codes.len / codes.sub.max(1) {
            other += 1;
            let (d, m) = (codes.scale[sub], codes.offset[sub]);
            if !d.is_finite() || !m.is_finite() {
                s.flag(|| format!("{} sub-block {sub}: scale {d}, offset {m} not finite", at()));
            }
        }
    }
    if ty == GgmlType::Q4_1 {
        return s.header_verdict("Q4_1 block");
    }
    match &s.first_bad {
        None => Ok(format!(
            "{other} {} sub-blocks: scales and offsets finite",
            ty.name()
        )),
        Some(f) => Err(format!(
            "{} {} sub-blocks broken; first: {f}",
            s.bad,
            ty.name()
        )),
    }
}

fn all_finite(v: &[f32]) -> Result<(), String> {
    match v.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(i) => Err(format!(
            "value {i} is {} ({} of {} not finite)",
            v[i],
            v.iter().filter(|x| !x.is_finite()).count(),
            v.len()
        )),
    }
}

/// Rows `0..rows`, each decoded by `fill`, all finite.
fn finite_rows(
    rows: usize,
    cols: usize,
    mut fill: impl FnMut(usize, &mut [f32]) -> Result<(), String>,
) -> Result<String, String> {
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        fill(r, &mut row)?;
        if let Some(c) = row.iter().position(|x| !x.is_finite()) {
            return Err(format!("value ({r}, {c}) is {}", row[c]));
        }
    }
    Ok(format!("{} values finite", rows * cols))
}

// ---------------------------------------------------------------------------------------------
// GGUF files.

/// `dflash.*` keys the runtime reads or that cannot change the draft's arithmetic; any other is
/// an unexplained key.
const GGUF_KNOWN_KEYS: [&str; 17] = [
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "block_count",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.causal",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.dimension_sections",
    "block_size",
    "target_layers",
];

/// Keys llama.cpp reads as scales or heads this runtime does not apply: each must be absent or 0.
const GGUF_ZERO_KEYS: [&str; 6] = [
    "embedding_scale",
    "logit_scale",
    "final_logit_softcapping",
    "attention.scale",
    "attention.value_scale",
    "hyper_connection_count",
];

fn check_gguf(g: &mut Gate, path: &Path) {
    let file = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let f = match GgufFile::open(path) {
        Ok(f) => {
            g.pass(
                format!("container {file}"),
                format!(
                    "GGUF v{}, {} keys, {} tensors",
                    f.version(),
                    f.metadata_entries().len(),
                    f.tensor_infos().len()
                ),
            );
            f
        }
        Err(e) => return g.fail(format!("container {file}"), e.to_string()),
    };
    let dims = gguf_description(g, &f);
    match Tokenizer::from_gguf(&f) {
        Err(e) => g.fail("tokenizer tokenizer.ggml.*", e.to_string()),
        Ok(t) => g.pass(
            "tokenizer tokenizer.ggml.*",
            format!("{} tokens", t.vocab_size()),
        ),
    }
    let Some(dims) = dims else {
        return g.fail(
            format!("tensors {file}"),
            "not checked: no draft description (see the failed key checks)",
        );
    };
    let mut wanted = BTreeSet::new();
    for (_, name, want) in expected(&dims) {
        wanted.insert(name.clone());
        if let Err(e) = in_range(&want) {
            g.fail(format!("grid {name}"), e);
            continue;
        }
        match want {
            Want::Matrix { rows, cols } => gguf_matrix(g, &f, &name, rows, cols),
            Want::Norm { len, what } => gguf_plain(g, &f, &name, &[len], Some(what)),
            Want::Plain { shape } => gguf_plain(g, &f, &name, &shape, None),
        }
    }
    let extra: Vec<&str> = f
        .tensor_infos()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !wanted.contains(*n))
        .collect();
    for name in &extra {
        g.fail(
            format!("unexplained {name}"),
            format!("tensor {name:?} is not one the draft uses"),
        );
    }
    if extra.is_empty() {
        g.pass(
            format!("unexplained {file}"),
            format!(
                "every tensor ({}) is one the draft uses",
                f.tensor_infos().len()
            ),
        );
    }
}

/// The draft's description from the GGUF's keys, one `key` check per key read.
fn gguf_description(g: &mut Gate, f: &GgufFile) -> Option<Dims> {
    let arch = f.architecture();
    if arch != Some(DFLASH_ARCH) {
        let found = arch.map_or_else(|| "missing".to_string(), |a| format!("{a:?}"));
        g.fail(
            "config general.architecture",
            format!("{found}: not a DFlash draft (\"{DFLASH_ARCH}\")"),
        );
        return None;
    }
    g.pass("config general.architecture", "\"dflash\"");
    let k = |s: &str| format!("{DFLASH_ARCH}.{s}");
    let ok = std::cell::Cell::new(true);
    // An unsigned key: `Some(default)` when absent, a failed check when ill-typed or required.
    let uint = |g: &mut Gate, key: &str, default: Option<u64>, rule: &dyn Fn(u64) -> bool| {
        let name = format!("key {key}");
        let v = match (f.metadata(key), default) {
            (None, Some(d)) => {
                g.pass(name, format!("absent: {d}"));
                return Some(d);
            }
            (None, None) => {
                g.fail(name, format!("{key}: missing"));
                ok.set(false);
                return None;
            }
            (Some(v), _) => v.as_u64(),
        };
        match v {
            Some(v) if rule(v) => {
                g.pass(name, v.to_string());
                Some(v)
            }
            Some(v) => {
                g.fail(name, format!("{key} = {v} is out of range"));
                ok.set(false);
                None
            }
            None => {
                g.fail(name, format!("{key}: not an unsigned integer"));
                ok.set(false);
                None
            }
        }
    };
    let positive = |v: u64| v > 0;
    let hidden = uint(g, &k("embedding_length"), None, &positive);
    let layers = uint(g, &k("block_count"), None, &|v| (1..=4096).contains(&v));
    let intermediate = uint(g, &k("feed_forward_length"), None, &positive);
    let heads = uint(g, &k("attention.head_count"), None, &positive);
    let kv_heads = uint(g, &k("attention.head_count_kv"), heads, &|v| {
        v > 0 && heads.is_some_and(|h| h % v == 0)
    });
    let default_hd = hidden.zip(heads).map(|(h, n)| h / n);
    let head_dim = uint(g, &k("attention.key_length"), default_hd, &positive);
    if f.metadata(&k("attention.value_length")).is_some() {
        uint(g, &k("attention.value_length"), None, &|v| {
            Some(v) == head_dim
        });
    }
    if f.metadata(&k("rope.dimension_count")).is_some() {
        uint(g, &k("rope.dimension_count"), None, &|v| {
            v > 0 && v % 2 == 0 && head_dim.is_some_and(|hd| v <= hd)
        });
    }
    uint(g, &k("block_size"), Some(16), &|v| {
        (2..=DFLASH_MAX_BLOCK as u64).contains(&v)
    });
    uint(g, &k("attention.sliding_window"), Some(0), &|v| v == 0);
    if f.metadata(&k("context_length")).is_some() {
        uint(g, &k("context_length"), None, &|_| true);
    }
    for key in [k("attention.layer_norm_rms_epsilon"), k("rope.freq_base")] {
        let name = format!("key {key}");
        match f.metadata(&key).map(|v| v.as_f64()) {
            None if key.ends_with("freq_base") => g.pass(name, "absent: 10000"),
            None => {
                g.fail(name, format!("{key}: missing"));
                ok.set(false);
            }
            Some(Some(v)) if v.is_finite() && v > 0.0 => g.pass(name, format!("{v}")),
            Some(v) => {
                g.fail(
                    name,
                    format!("{key} = {v:?}: expected a finite positive number"),
                );
                ok.set(false);
            }
        }
    }
    let causal = k("attention.causal");
    match f.metadata(&causal) {
        None => g.pass(format!("key {causal}"), "absent: false (non-causal block)"),
        Some(v) => match v.as_bool() {
            Some(b) => g.pass(format!("key {causal}"), b.to_string()),
            None => {
                g.fail(format!("key {causal}"), format!("{causal}: not a bool"));
                ok.set(false);
            }
        },
    }
    let vocab = match f.get_array("tokenizer.ggml.tokens") {
        Some(t) => {
            g.pass("key tokenizer.ggml.tokens", format!("{} tokens", t.len()));
            Some(t.len())
        }
        None => {
            g.fail(
                "key tokenizer.ggml.tokens",
                "missing (the vocabulary size is read from it)",
            );
            ok.set(false);
            None
        }
    };
    let mask = "tokenizer.ggml.mask_token_id";
    match (f.get_u64(mask), vocab) {
        (Some(m), Some(v)) if (m as usize) < v => g.pass(format!("key {mask}"), m.to_string()),
        (Some(m), _) => {
            g.fail(
                format!("key {mask}"),
                format!("{mask} = {m} is outside the vocabulary"),
            );
            ok.set(false);
        }
        (None, _) => {
            g.fail(
                format!("key {mask}"),
                format!("{mask}: missing (the block's mask rows are this token)"),
            );
            ok.set(false);
        }
    }
    let taps_key = k("target_layers");
    let taps = match f.get_array(&taps_key) {
        None => None,
        Some(a) => a
            .iter()
            .map(|v| v.as_u64().filter(|&i| i >= 1))
            .collect::<Option<Vec<u64>>>()
            .filter(|v| !v.is_empty()),
    };
    match &taps {
        Some(t) => g.pass(
            format!("key {taps_key}"),
            format!("{t:?} (hidden-state indices: layer ids + 1)"),
        ),
        None => {
            g.fail(
                format!("key {taps_key}"),
                format!("{taps_key}: missing, empty or not hidden-state indices ≥ 1"),
            );
            ok.set(false);
        }
    }
    for key in GGUF_ZERO_KEYS.map(k) {
        if let Some(v) = f.metadata(&key) {
            if v.as_f64() == Some(0.0) {
                g.pass(format!("key {key}"), "0 (unset)");
            } else {
                g.fail(
                    format!("key {key}"),
                    format!("{key} = {v:?}: not applied by this runtime's draft forward"),
                );
                ok.set(false);
            }
        }
    }
    let act = k("hidden_act");
    if let Some(v) = f.metadata(&act) {
        if v.as_str() == Some("silu") {
            g.pass(format!("key {act}"), "silu");
        } else {
            g.fail(
                format!("key {act}"),
                format!("{act} = {v:?}: only silu is implemented"),
            );
            ok.set(false);
        }
    }
    let scaling = k("rope.scaling.type");
    if let Some(v) = f.metadata(&scaling) {
        if v.as_str() == Some("none") {
            g.pass(format!("key {scaling}"), "none");
        } else {
            g.fail(
                format!("key {scaling}"),
                format!("{scaling} = {v:?}: rope scaling is not read for DFlash drafts"),
            );
            ok.set(false);
        }
    }
    // Generation 2: llama.cpp takes selector_hidden.weight as the sign and then needs every key.
    let present: Vec<bool> = GEN2_KEYS
        .iter()
        .map(|s| f.metadata(&k(s)).is_some())
        .collect();
    let gen2_sign = f.tensor("selector_hidden.weight").is_some() || present.contains(&true);
    let mut gen2 = None;
    if gen2_sign {
        let mut v = [0usize; 4];
        let mut complete = true;
        for (i, s) in GEN2_KEYS.iter().enumerate() {
            match uint(g, &k(s), None, &|_| true) {
                Some(n) => v[i] = n as usize,
                None => complete = false,
            }
        }
        if complete {
            let g2 = Gen2::from_values(v);
            match (hidden, vocab) {
                (Some(h), Some(voc)) => match g2.check(h as usize, voc) {
                    Ok(()) => gen2 = Some(g2),
                    Err((s, problem)) => {
                        g.fail(format!("key {}", k(s)), format!("{}: {problem}", k(s)));
                        ok.set(false);
                    }
                },
                _ => ok.set(false),
            }
        }
    }
    let mut known: BTreeSet<String> = GGUF_KNOWN_KEYS.iter().map(|s| k(s)).collect();
    known.extend(GGUF_ZERO_KEYS.map(k));
    known.extend(GEN2_KEYS.map(k));
    known.insert(act);
    known.insert(scaling);
    for (key, _) in f.metadata_entries() {
        if key.starts_with("dflash.") && !known.contains(key) {
            g.fail(
                format!("key {key}"),
                format!("{key}: not read by this runtime (an unexplained key)"),
            );
            ok.set(false);
        }
    }
    if let Some(v) = f.metadata(&k("rope.dimension_sections")) {
        let degenerate = v
            .as_array()
            .is_some_and(|a| a.iter().skip(1).all(|x| x.as_u64() == Some(0)));
        let name = format!("key {}", k("rope.dimension_sections"));
        if degenerate {
            g.pass(name, "one section (text positions only)");
        } else {
            g.fail(name, "M-RoPE sections beyond the first are not implemented");
            ok.set(false);
        }
    }
    let (Some(hidden), Some(layers), Some(intermediate), Some(heads), Some(kv_heads)) =
        (hidden, layers, intermediate, heads, kv_heads)
    else {
        return None;
    };
    let (Some(head_dim), Some(vocab), Some(taps)) = (head_dim, vocab, taps) else {
        return None;
    };
    if !ok.get() || (gen2_sign && gen2.is_none()) {
        return None;
    }
    Some(Dims {
        hidden: hidden as usize,
        intermediate: intermediate as usize,
        layers: layers as usize,
        q_dim: heads.saturating_mul(head_dim) as usize,
        kv_dim: kv_heads.saturating_mul(head_dim) as usize,
        head_dim: head_dim as usize,
        vocab,
        taps: taps.len(),
        gen2,
    })
}

fn gguf_matrix(g: &mut Gate, f: &GgufFile, name: &str, rows: usize, cols: usize) {
    let grid = format!("grid {name}");
    let Some(t) = f.tensor(name) else {
        return g.fail(grid, format!("{}: no tensor {name:?}", f.path().display()));
    };
    if t.shape.len() != 2 || t.shape[0] as usize != cols || t.shape[1] as usize != rows {
        return g.fail(
            grid,
            format!(
                "{name}: GGUF shape {:?} (innermost first), expected [{cols}, {rows}] for [{rows}, {cols}] (rows, columns)",
                t.shape
            ),
        );
    }
    let format = match super::import::weight_format(f, &t, ScaleType::F16) {
        Ok(fm) => fm,
        Err(e) => return g.fail(grid, e.to_string()),
    };
    if format.tile_bytes().is_some() && !rows.is_multiple_of(tiles::TILE_ROWS) {
        return g.fail(
            grid,
            format!(
                "{name}: {rows} rows of {} do not fill 32-row tiles",
                t.ggml_type.name()
            ),
        );
    }
    g.pass(
        grid,
        format!("{} [{rows}, {cols}] (rows, columns)", t.ggml_type.name()),
    );
    gguf_contents(g, &t, name, rows, cols);
}

/// `blocks NAME` (and `signature NAME` for Q4_1) or `values NAME` of a GGUF matrix.
fn gguf_contents(g: &mut Gate, t: &GgufTensor<'_>, name: &str, rows: usize, cols: usize) {
    if t.ggml_type.is_block_quant() {
        let mut s = CellStats::default();
        let r = scan_blocks(t.ggml_type, t.data, &mut s);
        g.outcome(format!("blocks {name}"), r);
        if t.ggml_type == GgmlType::Q4_1 {
            g.outcome(format!("signature {name}"), s.signature());
        }
        return;
    }
    let r = finite_rows(rows, cols, |r, row| {
        t.decode_row(r, row).map_err(|e| e.to_string())
    });
    g.outcome(format!("values {name}"), r);
}

fn gguf_plain(g: &mut Gate, f: &GgufFile, name: &str, shape: &[usize], what: Option<&str>) {
    let check = match what {
        Some(_) => format!("norm {name}"),
        None => format!("tensor {name}"),
    };
    let Some(t) = f.tensor(name) else {
        return g.fail(check, format!("{}: no tensor {name:?}", f.path().display()));
    };
    let ggml: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
    let expect = match what {
        Some(w) => format!("{shape:?} ({w})"),
        None => format!("{shape:?}"),
    };
    if !matches!(t.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        return g.fail(
            check,
            format!("{name}: type {} is not a float type", t.ggml_type.name()),
        );
    }
    if t.shape != ggml.as_slice() {
        return g.fail(
            check,
            format!(
                "{name}: GGUF shape {:?} (innermost first), expected {ggml:?}, i.e. {expect}",
                t.shape
            ),
        );
    }
    match t.decode_f32() {
        Ok(v) => g.outcome(
            check,
            all_finite(&v).map(|()| format!("{} {expect}, finite", t.ggml_type.name())),
        ),
        Err(e) => g.fail(check, e.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// The selftest: a synthetic package written with the import's writers, and negative controls.

/// A synthetic DFlash draft package (small: K padding and every check still exercised).
#[derive(Clone, Debug)]
pub struct SynthDraft {
    /// Decoder layers.
    pub layers: usize,
    /// Hidden width (also the target's).
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Floats per head.
    pub head_dim: usize,
    /// MLP width.
    pub intermediate: usize,
    /// `vocab_size` (the tokenizer holds 257 byte-level tokens).
    pub vocab: usize,
    /// The target layers read (0-based ids).
    pub target_layer_ids: Vec<usize>,
    /// Rows per block.
    pub block_size: usize,
    /// The mask token.
    pub mask_token_id: u32,
    /// Generation 2: (conv kernel, conv group, selector rank, selector top-k).
    pub generation2: Option<(usize, usize, usize, usize)>,
    /// Seed of the weights.
    pub seed: u64,
}

impl Default for SynthDraft {
    fn default() -> Self {
        SynthDraft {
            layers: 2,
            hidden: 320,
            heads: 5,
            kv_heads: 1,
            head_dim: 64,
            intermediate: 640,
            vocab: 512,
            target_layer_ids: vec![1, 3],
            block_size: 16,
            mask_token_id: 5,
            generation2: None,
            seed: 7,
        }
    }
}

/// What a negative control breaks in the synthetic package.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Break {
    /// Nothing: a valid package.
    Nothing,
    /// The last layer's `down_proj` one tile short.
    TileShort,
    /// `config.json`'s `head_dim` half the stored heads' width.
    HeadDim,
    /// One NaN scale in layer 0's `gate_proj`.
    NanScale,
    /// Layer 0's `q_proj` a plain F16 matrix of the tiles' byte count.
    HalfFloatMatrix,
    /// Layer 0's `q_proj` tile grid holding half-float values instead of q4_1 tiles.
    HalfFloatInTiles,
    /// Layer 0's `k_proj` tiles hold bf16 scales, recorded as f16 (`q41h`).
    ScaleType,
    /// The container's `dflash.block_size` differs from `config.json`'s.
    BlockSize,
    /// A tensor no part of the draft uses.
    UnexplainedTensor,
    /// `config.json` describes a Qwen3 model, not a DFlash draft.
    NotADraft,
    /// Generation 2: `config.json`'s `conv_group_size` doubled (the kernel projections no longer fit).
    ConvGroup,
}

/// A negative control: what it breaks, and the check that must catch it.
#[derive(Clone, Debug)]
pub struct Control {
    /// What is broken, in words.
    pub what: &'static str,
    /// The break.
    pub brk: Break,
    /// Written as a generation-2 draft.
    pub generation2: bool,
    /// The check (`<check> <subject>`) that must fail.
    pub expect: String,
}

/// The negative controls of [`selftest`].
pub fn controls() -> Vec<Control> {
    let c = |what, brk, generation2, expect: &str| Control {
        what,
        brk,
        generation2,
        expect: expect.to_string(),
    };
    vec![
        c(
            "a projection one tile short",
            Break::TileShort,
            false,
            "grid model.layers.1.mlp.down_proj.weight",
        ),
        c(
            "a head_dim in config.json that disagrees with the stored tiles",
            Break::HeadDim,
            false,
            "grid model.layers.0.self_attn.q_proj.weight",
        ),
        c(
            "one NaN scale",
            Break::NanScale,
            false,
            "tiles model.layers.0.mlp.gate_proj.weight",
        ),
        c(
            "a plain half-float matrix of the tiles' byte count",
            Break::HalfFloatMatrix,
            false,
            "grid model.layers.0.self_attn.q_proj.weight",
        ),
        c(
            "half-float values of the tiles' byte count in the tile grid",
            Break::HalfFloatInTiles,
            false,
            "tiles model.layers.0.self_attn.q_proj.weight",
        ),
        c(
            "tile scales written as bf16, recorded as f16",
            Break::ScaleType,
            false,
            "signature model.layers.0.self_attn.k_proj.weight",
        ),
        c(
            "a block size differing from config.json",
            Break::BlockSize,
            false,
            "scalar dflash.block_size",
        ),
        c(
            "an unexplained tensor",
            Break::UnexplainedTensor,
            false,
            "unexplained model.layers.0.self_attn.rotary_emb.inv_freq",
        ),
        c(
            "a config that is not a dflash draft",
            Break::NotADraft,
            false,
            "config config.json",
        ),
        c(
            "generation 2: a conv group size the kernel projections do not fit",
            Break::ConvGroup,
            true,
            "grid model.layers.0.attention_conv.kernel_projection.weight",
        ),
    ]
}

/// One control's outcome.
#[derive(Clone, Debug)]
pub struct ControlOutcome {
    /// The control.
    pub control: Control,
    /// Its expected check failed.
    pub caught: bool,
    /// That check's detail (or why it was not found).
    pub detail: String,
    /// Every check that failed.
    pub failed: Vec<String>,
}

/// What [`selftest`] found.
#[derive(Clone, Debug)]
pub struct Selftest {
    /// The valid packages (generation 1 and 2) and their reports, which must pass.
    pub valid: Vec<(String, Report)>,
    /// Each negative control.
    pub controls: Vec<ControlOutcome>,
}

impl Selftest {
    /// Every valid package passed and every control was caught by its check.
    pub fn passed(&self) -> bool {
        self.valid.iter().all(|(_, r)| r.passed()) && self.controls.iter().all(|c| c.caught)
    }
}

/// Writes the synthetic packages under `root` (created; left for inspection), checks the valid
/// ones (generation 1 and 2) and every control of [`controls`].
pub fn selftest(root: &Path) -> Result<Selftest, WeightsError> {
    let gen1 = SynthDraft::default();
    let gen2 = SynthDraft {
        generation2: Some((4, 20, 32, 4)),
        ..SynthDraft::default()
    };
    let mut valid = Vec::new();
    for (label, d) in [("generation-1", &gen1), ("generation-2", &gen2)] {
        let dir = root.join(format!("valid-{label}"));
        write_synthetic_draft(&dir, d, Break::Nothing)?;
        valid.push((format!("valid {label} draft"), check(&dir)));
    }
    let mut outcomes = Vec::new();
    for (i, c) in controls().into_iter().enumerate() {
        let dir = root.join(format!("control-{i}"));
        let d = if c.generation2 { &gen2 } else { &gen1 };
        write_synthetic_draft(&dir, d, c.brk)?;
        let r = check(&dir);
        let (caught, detail) = match r.check(&c.expect) {
            Some(k) => (!k.pass, k.detail.clone()),
            None => (false, format!("no check named {:?} ran", c.expect)),
        };
        outcomes.push(ControlOutcome {
            failed: r.failures().map(|k| k.name.clone()).collect(),
            control: c,
            caught,
            detail,
        });
    }
    Ok(Selftest {
        valid,
        controls: outcomes,
    })
}

/// SplitMix64, for reproducible synthetic weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Roughly normal (a sum of four uniforms in [−1, 1), variance 4/3).
    fn normalish(&mut self) -> f32 {
        (0..4)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            .sum()
    }
}

/// One q4_1 group as ggml's `quantize_row_q4_1_ref` makes it: (scale, minimum, codes).
fn quantize_q41_group(x: &[f32]) -> (f32, f32, [u8; tiles::GROUP]) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut codes = [0u8; tiles::GROUP];
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = (((v - min) * id + 0.5) as u8).min(15);
    }
    (d, min, codes)
}

/// `[rows, cols]` of `w` (row-major) as q4_1 tiles with `scale` scales, column-major codes.
fn q41_tiles(w: &[f32], rows: usize, cols: usize, scale: ScaleType) -> Vec<u8> {
    let format = WeightFormat::Q41 {
        scale,
        order: TileOrder::ColumnMajor,
    };
    let q_tiles = format.padded_cols(cols) / tiles::TILE_COLS;
    let tb = tiles::Q41_TILE_BYTES;
    let mut out = vec![0u8; rows / tiles::TILE_ROWS * q_tiles * tb];
    for p in 0..rows / tiles::TILE_ROWS {
        for q in 0..q_tiles {
            let t = p * q_tiles + q;
            let tile = &mut out[t * tb..(t + 1) * tb];
            for g in 0..tiles::GROUPS {
                let c0 = q * tiles::TILE_COLS + g * tiles::GROUP;
                if c0 >= cols {
                    break;
                }
                for r in 0..tiles::TILE_ROWS {
                    let row = p * tiles::TILE_ROWS + r;
                    let mut x = [0f32; tiles::GROUP];
                    for (i, v) in x.iter_mut().enumerate() {
                        if c0 + i < cols {
                            *v = w[row * cols + c0 + i];
                        }
                    }
                    let (d, m, codes) = quantize_q41_group(&x);
                    tiles::set_q41_cell(tile, scale, TileOrder::ColumnMajor, g, r, d, m, &codes);
                }
            }
        }
    }
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes a synthetic DFlash package into `dir` (`config.json`, `model.q4nx` through the
/// safetensors [`Writer`] with q4_1 tiles from [`tiles::set_q41_cell`] and the metadata of
/// `xdna pack import`, a byte-level `tokenizer.json`), broken as `brk` says.
pub fn write_synthetic_draft(dir: &Path, d: &SynthDraft, brk: Break) -> Result<(), WeightsError> {
    std::fs::create_dir_all(dir).map_err(|e| WeightsError::io(dir, e))?;
    let mut dflash_config = json!({
        "block_size": d.block_size,
        "target_layer_ids": d.target_layer_ids,
        "mask_token_id": d.mask_token_id,
    });
    if let Some((k, group, rank, top_k)) = d.generation2 {
        for (key, v) in GEN2_KEYS.iter().zip([k, group, rank, top_k]) {
            dflash_config[key] = json!(v);
        }
    }
    let config = json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "dflash",
        "hidden_size": d.hidden,
        "intermediate_size": d.intermediate,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "vocab_size": d.vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": true,
        "torch_dtype": "bfloat16",
        "dflash_config": dflash_config,
        "xdna": {"scale_type": "f16", "tile_order": "column_major", "norm_dtype": "F32", "source": "selftest"},
    });
    let config_path = dir.join("config.json");
    let cfg = ModelConfig::from_json(&config, &config_path)?;
    let Some(dflash) = cfg.dflash.as_ref() else {
        return Err(WeightsError::invalid(
            &config_path,
            "not a DFlash description",
        ));
    };
    let gen2 = d
        .generation2
        .map(|(a, b, c, e)| Gen2::from_values([a, b, c, e]));
    let dims = Dims {
        hidden: cfg.hidden,
        intermediate: cfg.intermediate,
        layers: cfg.layers,
        q_dim: cfg.heads.saturating_mul(cfg.head_dim),
        kv_dim: cfg.kv_heads.saturating_mul(cfg.head_dim),
        head_dim: cfg.head_dim,
        vocab: cfg.vocab,
        taps: dflash.target_layers.len(),
        gen2,
    };
    let mut meta = BTreeMap::new();
    meta.insert("xdna.scale_type".to_string(), "f16".to_string());
    meta.insert("xdna.order".to_string(), "column_major".to_string());
    meta.insert("xdna.source".to_string(), "selftest".to_string());
    meta.extend(dflash_metadata(&cfg, &config));
    if brk == Break::BlockSize {
        meta.insert("dflash.block_size".into(), (d.block_size / 2).to_string());
    }
    let q41 = WeightFormat::Q41 {
        scale: ScaleType::F16,
        order: TileOrder::ColumnMajor,
    };
    let mut rng = Rng(d.seed);
    let mut decl = Vec::new();
    let mut data: Vec<Vec<u8>> = Vec::new();
    let mut wanted = expected(&dims);
    // Vectors first, as the import orders them.
    wanted.sort_by_key(|(_, _, w)| !matches!(w, Want::Norm { .. } | Want::Plain { .. }));
    for (name, _, want) in wanted {
        match want {
            Want::Norm { len, .. } => {
                let v: Vec<f32> = (0..len).map(|_| 1.0 + 0.1 * rng.normalish()).collect();
                decl.push(Declared {
                    name,
                    dtype: Dtype::F32,
                    shape: vec![len],
                });
                data.push(f32_bytes(&v));
            }
            Want::Plain { shape } => {
                let n = shape.iter().product();
                let v: Vec<f32> = (0..n).map(|_| 0.1 * rng.normalish()).collect();
                decl.push(Declared {
                    name,
                    dtype: Dtype::F32,
                    shape,
                });
                data.push(f32_bytes(&v));
            }
            Want::Matrix { rows, cols } => {
                let amp = 1.0 / (cols as f32).sqrt();
                let w: Vec<f32> = (0..rows * cols).map(|_| amp * rng.normalish()).collect();
                if name.contains("codebook") {
                    // The selector's codebooks are read whole, as plain floats.
                    decl.push(Declared {
                        name,
                        dtype: Dtype::F32,
                        shape: vec![rows, cols],
                    });
                    data.push(f32_bytes(&w));
                    continue;
                }
                let layer0 = |s: &str| name == format!("model.layers.0.{s}.weight");
                let scale = match brk {
                    Break::ScaleType if layer0("self_attn.k_proj") => ScaleType::Bf16,
                    _ => ScaleType::F16,
                };
                let mut bytes = q41_tiles(&w, rows, cols, scale);
                let tb = tiles::Q41_TILE_BYTES;
                let last_down = name
                    == format!(
                        "model.layers.{}.mlp.down_proj.weight",
                        d.layers.saturating_sub(1)
                    );
                let half: Vec<u8> = w
                    .iter()
                    .take(bytes.len() / 2)
                    .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                    .collect();
                match brk {
                    Break::TileShort if last_down => {
                        bytes.truncate(bytes.len() - tb);
                    }
                    Break::NanScale if layer0("mlp.gate_proj") => {
                        bytes[..2].copy_from_slice(&half::f16::NAN.to_le_bytes());
                    }
                    Break::HalfFloatMatrix if layer0("self_attn.q_proj") => {
                        let n = half.len();
                        decl.push(Declared {
                            name,
                            dtype: Dtype::F16,
                            shape: vec![rows, n / 2 / rows],
                        });
                        data.push(half);
                        continue;
                    }
                    Break::HalfFloatInTiles if layer0("self_attn.q_proj") => {
                        bytes = half;
                    }
                    _ => {}
                }
                meta.insert(format!("xdna.format.{name}"), q41.name().to_string());
                meta.insert(format!("xdna.shape.{name}"), format!("{rows},{cols}"));
                decl.push(Declared {
                    name,
                    dtype: Dtype::I8,
                    shape: vec![bytes.len() / tb, tb],
                });
                data.push(bytes);
            }
        }
    }
    if brk == Break::UnexplainedTensor {
        decl.push(Declared {
            name: "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            dtype: Dtype::F32,
            shape: vec![d.head_dim / 2],
        });
        data.push(f32_bytes(&vec![1.0; d.head_dim / 2]));
    }
    let mut w = Writer::create(dir.join("model.q4nx"), &decl, &meta)?;
    for (t, bytes) in decl.iter().zip(&data) {
        w.write(&t.name, bytes)?;
    }
    w.finish()?;

    let mut written = config;
    match brk {
        Break::HeadDim => written["head_dim"] = json!(d.head_dim / 2),
        Break::NotADraft => {
            written["model_type"] = json!("qwen3");
            written["architectures"] = json!(["Qwen3ForCausalLM"]);
            if let Some(o) = written.as_object_mut() {
                o.remove("dflash_config");
            }
        }
        Break::ConvGroup => {
            if let Some((_, group, _, _)) = d.generation2 {
                written["dflash_config"]["conv_group_size"] = json!(group * 2);
            }
        }
        _ => {}
    }
    write_json(&config_path, &written)?;
    write_json(&dir.join("tokenizer.json"), &byte_tokenizer())?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"add_bos_token": false, "eos_token": "<|endoftext|>", "tokenizer_class": "GPT2Tokenizer"}),
    )
}

fn write_json(path: &Path, v: &Value) -> Result<(), WeightsError> {
    let text =
        serde_json::to_string_pretty(v).map_err(|e| WeightsError::invalid(path, e.to_string()))?;
    std::fs::write(path, text).map_err(|e| WeightsError::io(path, e))
}

/// A byte-level BPE tokenizer: the 256 GPT-2 byte tokens and `<|endoftext|>` = 256.
fn byte_tokenizer() -> Value {
    let table = super::tokenizer::byte_to_char_table();
    let mut vocab = serde_json::Map::new();
    for (b, ch) in table.iter().enumerate() {
        vocab.insert(ch.to_string(), Value::from(b as u64));
    }
    vocab.insert("<|endoftext|>".into(), 256u64.into());
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{ "id": 256, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true }],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": { "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": [] }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q41_group_quantizer_matches_ggml_on_a_hand_case() {
        // min −1, max 2: d = 0.2, codes round((x + 1) / 0.2).
        let mut x = [0f32; 32];
        x[0] = -1.0;
        x[1] = 2.0;
        x[2] = 0.5;
        let (d, m, q) = quantize_q41_group(&x);
        assert!((d - 0.2).abs() < 1e-7 && m == -1.0);
        assert_eq!((q[0], q[1], q[2], q[3]), (0, 15, 8, 5));
    }

    #[test]
    fn scalars_compare_at_f32_precision() {
        let a = Scalar::Float(1e-5);
        assert!(a.same(&a.parse_like("0.00001").unwrap()));
        assert!(a.same(&Scalar::Float(1e-5 * (1.0 + 1e-12))));
        assert!(!a.same(&Scalar::Float(1.0001e-5)));
        let l = Scalar::Ints(vec![1, 10]);
        assert_eq!(l.parse_like(&l.text()).unwrap(), l);
        assert!(l.parse_like("1,x").is_err());
    }

    #[test]
    fn signature_accepts_q4_0_origin_and_refuses_a_wrong_centre() {
        let mut s = CellStats::default();
        for i in 1..100 {
            let d = i as f32 * 0.01;
            s.q41(d, -8.0 * d, String::new);
        }
        assert!(s.signature().unwrap().contains("Q4_0"));
        let mut s = CellStats::default();
        for i in 1..100 {
            s.q41(0.1, 0.1 * (i as f32 / 100.0), String::new);
        }
        assert!(s.signature().is_err());
    }

    #[test]
    fn signature_tolerance_is_half_a_scale_either_side() {
        let verdict = |ratio: f32| {
            let mut s = CellStats::default();
            for i in 1..50 {
                let d = 0.01 * i as f32;
                s.q41(d, ratio * d, String::new);
            }
            s.signature().is_ok()
        };
        assert!(verdict(-7.1) && verdict(-7.9));
        assert!(!verdict(-6.9) && !verdict(-8.1));
    }
}
