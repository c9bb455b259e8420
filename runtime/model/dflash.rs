//! DFlash block drafting (generation 1, z-lab `DFlashDraftModel`): the draft's weights and its
//! forward, fast path through the kernels layer and an f64 reference beside it.
//!
//! A draft attends over *context rows*, one per committed target position: the target's hidden
//! states after the tap layers ([`crate::weights::DflashParams::target_layers`]), concatenated,
//! through the fusion matrix `fc` and `hidden_norm`. Each layer projects them to keys (k_norm,
//! RoPE at the row's position) and values once; they are cached per context row, so growing
//! the context 2 + 1 + 2 rows gives the same cache as one push of 5. A *block* is the pending
//! token's embedding then `block_size − 1` copies of the mask token's (the target's own
//! embedding table) at the next positions; per layer: input norm, queries, keys and values from
//! the block rows (q/k norm, RoPE), attention of every block row over all context rows and
//! every block row (no causal mask inside the block unless the draft says so), output
//! projection, residual, gated MLP, residual. The final norm, then the target's own head: block
//! row `i ≥ 1` scores the token at position `P + i`, the drafts are their argmaxes.
//!
//! Generation 2 (z-lab `DFlash2DraftModel`) wraps attention and the MLP of the block rows in
//! grouped dynamic convolutions ([`grouped_conv`]) and picks each draft with the candidate
//! selector ([`DflashDraft::block_drafts`]); the context rows are the same.

use std::sync::Arc;

use super::layers::{ModelWeights, Projection};
use super::load::{projection, LoadOptions};
use super::load_hybrid::stacked;
use super::ops;
use super::ModelError;
use crate::kernels::attention::{attend_rows, AttentionRow, AttentionShape};
use crate::kernels::{Executor, HostExecutor, RowFamily};
use crate::weights::{Dflash2Params, DflashParams, ModelConfig, Package};

/// Most rows one projection call takes (the `m128` family).
const MAX_ROWS_PER_GEMM: usize = RowFamily::M128.max_rows();

/// One draft layer's weights.
struct DraftLayer {
    attn_norm: Vec<f32>,
    q: Box<dyn Projection>,
    /// k ‖ v, `[2 kv_dim, hidden]`.
    kv: Box<dyn Projection>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    o: Box<dyn Projection>,
    ffn_norm: Vec<f32>,
    /// gate ‖ up, `[2 intermediate, hidden]`.
    gate_up: Box<dyn Projection>,
    down: Box<dyn Projection>,
    /// Generation 2: the convolutions around attention and around the MLP.
    conv: Option<[LayerConv; 2]>,
}

/// One generation-2 convolution pair: its kernel projection and base kernels.
struct LayerConv {
    /// `[2 · kernel · groups, hidden]`: a row's own kernels, input side then output side.
    projection: Box<dyn Projection>,
    /// `[2, kernel, hidden]`: the base kernels, input side then output side.
    base: Vec<f32>,
}

/// The generation-2 candidate selector.
struct Selector {
    /// `[vocab, rank]`: the previous pick's code.
    predecessor: Vec<f32>,
    /// `[vocab, rank]`: each candidate's code.
    successor: Vec<f32>,
    /// `[rank, hidden]`: the row's gate on the pairwise term, from its final hidden state.
    hidden: Box<dyn Projection>,
}

/// A DFlash draft's weights on the host executor.
pub struct DflashWeights {
    config: ModelConfig,
    params: DflashParams,
    layers: Vec<DraftLayer>,
    fc: Box<dyn Projection>,
    hidden_norm: Vec<f32>,
    final_norm: Vec<f32>,
    selector: Option<Selector>,
}

impl DflashWeights {
    /// Loads a DFlash package (a `dflash` GGUF opens as one through the import). The projections
    /// run on the host executor; `exact` as in [`LoadOptions::exact`] (no activation rounding).
    pub fn load(pkg: &Arc<Package>, exact: bool) -> Result<DflashWeights, ModelError> {
        let config = pkg.config().clone();
        let Some(params) = config.dflash.clone() else {
            return Err(ModelError::Unsupported {
                what: format!(
                    "{}: model_type {:?} is not a DFlash draft (config.json has no dflash_config)",
                    pkg.dir().display(),
                    config.model_type
                ),
            });
        };
        let opts = LoadOptions {
            exact,
            ..LoadOptions::default()
        };
        let exec = Arc::new(Executor::Host(HostExecutor::new()));
        let (h, qd, kvd, inter) = (
            config.hidden,
            config.q_dim(),
            config.kv_dim(),
            config.intermediate,
        );
        let vector = |name: &str, len: usize| -> Result<Vec<f32>, ModelError> {
            let v = pkg.vector(name)?;
            if v.len() != len {
                return Err(ModelError::Shape {
                    what: format!(
                        "{}: {name} holds {} values, expected {len}",
                        pkg.dir().display(),
                        v.len()
                    ),
                });
            }
            Ok(v)
        };
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let n = |s: &str| format!("model.layers.{i}.{s}");
            let one =
                |s: &str, rows: usize, cols: usize| -> Result<Box<dyn Projection>, ModelError> {
                    Ok(Box::new(projection(
                        &opts,
                        &exec,
                        pkg,
                        &[&n(s)],
                        &[rows],
                        cols,
                    )?))
                };
            let conv = match params.generation2 {
                None => None,
                Some(g) => {
                    let projected = 2 * g.conv_kernel * g.groups(h);
                    let pair = |hf: &str| -> Result<LayerConv, ModelError> {
                        Ok(LayerConv {
                            projection: one(
                                &format!("{hf}.kernel_projection.weight"),
                                projected,
                                h,
                            )?,
                            base: vector(&n(&format!("{hf}.base_kernel")), 2 * g.conv_kernel * h)?,
                        })
                    };
                    Some([pair("attention_conv")?, pair("mlp_conv")?])
                }
            };
            let (k, v) = (n("self_attn.k_proj.weight"), n("self_attn.v_proj.weight"));
            let (gate, up) = (n("mlp.gate_proj.weight"), n("mlp.up_proj.weight"));
            layers.push(DraftLayer {
                attn_norm: vector(&n("input_layernorm.weight"), h)?,
                q: one("self_attn.q_proj.weight", qd, h)?,
                kv: stacked(&opts, &exec, pkg, &[&k, &v], &[kvd, kvd], h)?,
                q_norm: vector(&n("self_attn.q_norm.weight"), config.head_dim)?,
                k_norm: vector(&n("self_attn.k_norm.weight"), config.head_dim)?,
                o: one("self_attn.o_proj.weight", h, qd)?,
                ffn_norm: vector(&n("post_attention_layernorm.weight"), h)?,
                gate_up: stacked(&opts, &exec, pkg, &[&gate, &up], &[inter, inter], h)?,
                down: one("mlp.down_proj.weight", h, inter)?,
                conv,
            });
        }
        let selector = match params.generation2 {
            None => None,
            Some(g) => Some(Selector {
                predecessor: vector(
                    "model.candidate_selector.predecessor_codebook",
                    config.vocab * g.selector_rank,
                )?,
                successor: vector(
                    "model.candidate_selector.successor_codebook",
                    config.vocab * g.selector_rank,
                )?,
                hidden: Box::new(projection(
                    &opts,
                    &exec,
                    pkg,
                    &["model.candidate_selector.hidden_projection.weight"],
                    &[g.selector_rank],
                    h,
                )?),
            }),
        };
        let fc_cols = params.target_layers.len() * h;
        let fc = Box::new(projection(
            &opts,
            &exec,
            pkg,
            &["model.fc.weight"],
            &[h],
            fc_cols,
        )?);
        Ok(DflashWeights {
            hidden_norm: vector("model.hidden_norm.weight", h)?,
            final_norm: vector("model.norm.weight", h)?,
            config,
            params,
            layers,
            fc,
            selector,
        })
    }

    /// The draft's description.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Block size, tap layers, mask token.
    pub fn params(&self) -> &DflashParams {
        &self.params
    }

    /// Checks that the draft fits `target`: the same hidden width (context rows concatenate the
    /// target's hidden states; the block rows are its embeddings), the same vocabulary (its head
    /// scores the block), tap layers inside the target.
    pub fn check_target(&self, target: &ModelConfig) -> Result<(), ModelError> {
        let c = &self.config;
        let bad = |what: String| ModelError::Unsupported { what };
        if c.hidden != target.hidden {
            return Err(bad(format!(
                "the DFlash draft is {} wide, the target {}: the draft reads the target's hidden states and embeddings",
                c.hidden, target.hidden
            )));
        }
        if c.vocab != target.vocab {
            return Err(bad(format!(
                "the DFlash draft has a vocabulary of {}, the target {}",
                c.vocab, target.vocab
            )));
        }
        if let Some(&l) = self
            .params
            .target_layers
            .iter()
            .find(|&&l| l >= target.layers)
        {
            return Err(bad(format!(
                "the DFlash draft reads the target's layer {l}, the target has {} layers",
                target.layers
            )));
        }
        Ok(())
    }
}

/// Per-pass scratch, sized for one block or one chunk of context rows.
#[derive(Default)]
struct Scratch {
    g: Vec<f32>,
    gn: Vec<f32>,
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    kv: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    scores: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// Generation 2: the rows' own kernels of the current convolution pair, and its output.
    dynamic: Vec<f32>,
    conv: Vec<f32>,
    gate: Vec<f32>,
}

fn sized(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

/// A DFlash draft bound to its target: the cached context rows and the block forward.
pub struct DflashDraft {
    w: Arc<DflashWeights>,
    target: Arc<ModelWeights>,
    inv_freq: Vec<f64>,
    /// Context rows cached.
    context: usize,
    /// Per layer: keys then values of every context row, `[context, kv_dim]` each, f32.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    s: Scratch,
    logits: Vec<f32>,
    margins: Vec<f32>,
}

impl DflashDraft {
    /// Binds `w` to `target` (checked with [`DflashWeights::check_target`]); no context yet.
    pub fn new(w: Arc<DflashWeights>, target: Arc<ModelWeights>) -> Result<Self, ModelError> {
        w.check_target(&target.config)?;
        let layers = w.layers.len();
        Ok(DflashDraft {
            inv_freq: w.config.rope_inv_freq(),
            w,
            target,
            context: 0,
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            s: Scratch::default(),
            logits: Vec::new(),
            margins: Vec::new(),
        })
    }

    /// The draft's weights.
    pub fn weights(&self) -> &DflashWeights {
        &self.w
    }

    /// Context rows cached (= the target position the next block starts at).
    pub fn context(&self) -> usize {
        self.context
    }

    /// Forgets every context row.
    pub fn reset(&mut self) {
        self.truncate(0);
    }

    /// Keeps the first `rows` context rows.
    pub fn truncate(&mut self, rows: usize) {
        let kvd = self.w.config.kv_dim();
        if rows < self.context {
            self.context = rows;
            for l in 0..self.keys.len() {
                self.keys[l].truncate(rows * kvd);
                self.values[l].truncate(rows * kvd);
            }
        }
    }

    /// Appends context rows at the next positions: `features` is `[rows, taps · hidden]`, each
    /// row the target's hidden states after the tap layers, concatenated in tap order.
    pub fn push_context(&mut self, features: &[f32], rows: usize) -> Result<(), ModelError> {
        let c = &self.w.config;
        let width = self.w.params.target_layers.len() * c.hidden;
        if features.len() != rows * width {
            return Err(ModelError::Shape {
                what: format!(
                    "{} context values for {rows} rows of {width}",
                    features.len()
                ),
            });
        }
        for (chunk_index, chunk) in features.chunks(MAX_ROWS_PER_GEMM * width).enumerate() {
            let n = chunk.len() / width;
            let first = self.context + chunk_index * MAX_ROWS_PER_GEMM;
            self.push_chunk(chunk, n, first)?;
        }
        self.context += rows;
        Ok(())
    }

    fn push_chunk(
        &mut self,
        features: &[f32],
        rows: usize,
        first: usize,
    ) -> Result<(), ModelError> {
        let c = &self.w.config;
        let (h, hd, kvd) = (c.hidden, c.head_dim, c.kv_dim());
        let eps = c.rms_eps as f32;
        let family = RowFamily::for_rows(rows);
        let s = &mut self.s;
        let g = sized(&mut s.g, rows * h);
        self.w.fc.gemm(features, rows, g, family)?;
        let gn = sized(&mut s.gn, rows * h);
        ops::rmsnorm(&s.g[..rows * h], &self.w.hidden_norm, eps, gn);
        let half = c.rotary_dim / 2;
        let (cos, sin) = (
            sized(&mut s.cos, rows * half),
            sized(&mut s.sin, rows * half),
        );
        for r in 0..rows {
            ops::rope_angles(
                first + r,
                &self.inv_freq,
                &mut cos[r * half..(r + 1) * half],
                &mut sin[r * half..(r + 1) * half],
            );
        }
        for (l, layer) in self.w.layers.iter().enumerate() {
            let kv = sized(&mut s.kv, rows * 2 * kvd);
            layer.kv.gemm(&s.gn[..rows * h], rows, kv, family)?;
            for r in 0..rows {
                let row = &mut kv[r * 2 * kvd..(r + 1) * 2 * kvd];
                let (k, v) = row.split_at_mut(kvd);
                for head in k.chunks_exact_mut(hd) {
                    ops::rmsnorm_inplace(head, &layer.k_norm, eps);
                    rope_head(
                        head,
                        c.rotary_dim,
                        &s.cos[r * half..(r + 1) * half],
                        &s.sin[r * half..(r + 1) * half],
                    );
                }
                self.keys[l].extend_from_slice(k);
                self.values[l].extend_from_slice(v);
            }
        }
        Ok(())
    }

    /// Runs the block `[pending, mask, …]` at positions `context()..` and returns the logits of
    /// rows `1..block_size`, `(block_size − 1) × vocab`: row `i` scores the draft at position
    /// `context() + i`. The context is left as it was.
    pub fn block_logits(&mut self, pending: u32) -> Result<&[f32], ModelError> {
        let c = &self.w.config;
        let p = &self.w.params;
        let (h, hd, kvd, qd, inter) = (c.hidden, c.head_dim, c.kv_dim(), c.q_dim(), c.intermediate);
        let vocab = self.target.config.vocab;
        if pending as usize >= vocab {
            return Err(ModelError::Shape {
                what: format!("pending token {pending} is outside the vocabulary of {vocab}"),
            });
        }
        let eps = c.rms_eps as f32;
        let rows = p.block_size;
        let base = self.context;
        let family = RowFamily::for_rows(rows);
        let s = &mut self.s;
        let x = sized(&mut s.x, rows * h);
        for r in 0..rows {
            let token = if r == 0 { pending } else { p.mask_token_id };
            self.target.embed.row(token, &mut x[r * h..(r + 1) * h])?;
        }
        let half = c.rotary_dim / 2;
        let (cos, sin) = (
            sized(&mut s.cos, rows * half),
            sized(&mut s.sin, rows * half),
        );
        for r in 0..rows {
            ops::rope_angles(
                base + r,
                &self.inv_freq,
                &mut cos[r * half..(r + 1) * half],
                &mut sin[r * half..(r + 1) * half],
            );
        }
        let total = base + rows;
        sized(&mut s.scores, total);
        let generation2 = p.generation2;
        for (l, layer) in self.w.layers.iter().enumerate() {
            let xn = sized(&mut s.xn, rows * h);
            ops::rmsnorm(&s.x[..rows * h], &layer.attn_norm, eps, xn);
            if let (Some(g), Some([attn_conv, _])) = (generation2, &layer.conv) {
                conv_input(attn_conv, g, rows, h, family, s)?;
            }
            let q = sized(&mut s.q, rows * qd);
            layer.q.gemm(&s.xn[..rows * h], rows, q, family)?;
            let kv = sized(&mut s.kv, rows * 2 * kvd);
            layer.kv.gemm(&s.xn[..rows * h], rows, kv, family)?;
            for r in 0..rows {
                let (cr, sr) = (
                    &s.cos[r * half..(r + 1) * half],
                    &s.sin[r * half..(r + 1) * half],
                );
                for head in s.q[r * qd..(r + 1) * qd].chunks_exact_mut(hd) {
                    ops::rmsnorm_inplace(head, &layer.q_norm, eps);
                    rope_head(head, c.rotary_dim, cr, sr);
                }
                let row = &mut s.kv[r * 2 * kvd..(r + 1) * 2 * kvd];
                let (k, v) = row.split_at_mut(kvd);
                for head in k.chunks_exact_mut(hd) {
                    ops::rmsnorm_inplace(head, &layer.k_norm, eps);
                    rope_head(head, c.rotary_dim, cr, sr);
                }
                self.keys[l].extend_from_slice(k);
                self.values[l].extend_from_slice(v);
            }
            let (keys, values) = (&self.keys[l], &self.values[l]);
            let q_all = &s.q[..rows * qd];
            let causal = p.causal;
            let attn = sized(&mut s.attn, rows * qd);
            attend_rows(
                AttentionShape {
                    heads: c.heads,
                    kv_heads: c.kv_heads,
                    head_dim: hd,
                },
                rows,
                &|i| AttentionRow {
                    q: &q_all[i * qd..(i + 1) * qd],
                    k_cache: keys.as_slice(),
                    v_cache: values.as_slice(),
                    last: if causal { base + i } else { total - 1 },
                },
                &mut s.scores,
                attn,
            );
            self.keys[l].truncate(base * kvd);
            self.values[l].truncate(base * kvd);
            let o = sized(&mut s.o, rows * h);
            layer.o.gemm(&s.attn[..rows * qd], rows, o, family)?;
            if let (Some(g), Some([attn_conv, _])) = (generation2, &layer.conv) {
                conv_output(attn_conv, g, rows, h, s);
            }
            for (xv, ov) in s.x[..rows * h].iter_mut().zip(s.o.iter()) {
                *xv += ov;
            }
            let xn = sized(&mut s.xn, rows * h);
            ops::rmsnorm(&s.x[..rows * h], &layer.ffn_norm, eps, xn);
            if let (Some(g), Some([_, ffn_conv])) = (generation2, &layer.conv) {
                conv_input(ffn_conv, g, rows, h, family, s)?;
            }
            sized(&mut s.gate_up, rows * 2 * inter);
            sized(&mut s.act, rows * inter);
            layer.gate_up.gemm_swiglu(
                &s.xn[..rows * h],
                rows,
                &mut s.gate_up,
                &mut s.act,
                family,
            )?;
            let o = sized(&mut s.o, rows * h);
            layer.down.gemm(&s.act[..rows * inter], rows, o, family)?;
            if let (Some(g), Some([_, ffn_conv])) = (generation2, &layer.conv) {
                conv_output(ffn_conv, g, rows, h, s);
            }
            for (xv, ov) in s.x[..rows * h].iter_mut().zip(s.o.iter()) {
                *xv += ov;
            }
        }
        let drafts = rows - 1;
        let xn = sized(&mut s.xn, drafts * h);
        ops::rmsnorm(&s.x[h..rows * h], &self.w.final_norm, eps, xn);
        let logits = sized(&mut self.logits, drafts * vocab);
        self.target.lm_head.gemm(
            &s.xn[..drafts * h],
            drafts,
            logits,
            RowFamily::for_rows(drafts),
        )?;
        Ok(&self.logits[..drafts * vocab])
    }
}

fn tile_error(name: &str, e: crate::tiles::TileError) -> ModelError {
    ModelError::Shape {
        what: format!("{name}: {e}"),
    }
}

impl DflashDraft {
    /// The block's drafts after `pending` (`block_size − 1` of them, for positions
    /// `context() + 1..`): each row's argmax (the first of equals) for generation 1; for
    /// generation 2 the selector's walk: among row `i`'s `top_k` highest-scoring tokens (ties to
    /// the lower id), the one maximising its logit plus the pairwise term
    /// `⟨successor[candidate], predecessor[previous pick] ⊙ gate_i⟩` (the previous pick of row 1
    /// is `pending`; `gate_i` = `selector_hidden` · row `i`'s final hidden state); the first of
    /// equal scores wins.
    pub fn block_drafts(&mut self, pending: u32, drafts: &mut Vec<u32>) -> Result<(), ModelError> {
        let mut margins = std::mem::take(&mut self.margins);
        let r = self.block_drafts_given(pending, None, drafts, &mut margins);
        self.margins = margins;
        r
    }

    /// [`block_drafts`](Self::block_drafts), with each draft's margin (the top-2 logit margin
    /// for generation 1; for generation 2 the selector's score margin or, when smaller, the gap
    /// at the edge of the candidate set); for generation 2 each row's previous pick may be
    /// `given` (another walk's drafts), to compare with that walk row by row.
    pub fn block_drafts_given(
        &mut self,
        pending: u32,
        given: Option<&[u32]>,
        drafts: &mut Vec<u32>,
        margins: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        drafts.clear();
        margins.clear();
        let vocab = self.target.config.vocab;
        self.block_logits(pending)?;
        let rows = self.w.params.block_size - 1;
        let (Some(g), Some(selector)) = (self.w.params.generation2, &self.w.selector) else {
            for row in self.logits[..rows * vocab].chunks_exact(vocab) {
                let best = argmax(row);
                let second = row
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| i != best as usize)
                    .fold(f32::NEG_INFINITY, |m, (_, &v)| m.max(v));
                drafts.push(best);
                margins.push(row[best as usize] - second);
            }
            return Ok(());
        };
        let (h, rank) = (self.w.config.hidden, g.selector_rank);
        // `block_logits` leaves the rows' final hidden states (rows 1..) in `xn`.
        let gate = sized(&mut self.s.gate, rows * rank);
        selector.hidden.gemm(
            &self.s.xn[..rows * h],
            rows,
            gate,
            RowFamily::for_rows(rows),
        )?;
        selector_walk(
            &self.logits[..rows * vocab],
            &self.s.gate[..rows * rank],
            &selector.predecessor,
            &selector.successor,
            vocab,
            rank,
            g.selector_top_k,
            pending,
            given,
            drafts,
            margins,
        );
        Ok(())
    }
}

/// The selector's walk over `rows` block rows (`logits` `[rows, vocab]`, `gate` `[rows, rank]`,
/// codebooks `[vocab, rank]`): row `i` picks, among its `top_k` highest logits (ties to the lower
/// id, the first of equal scores winning), the candidate `c` maximising `logits[i][c] +
/// Σ_r successor[c][r] · predecessor[previous][r] · gate[i][r]`, where `previous` is row `i − 1`'s
/// pick (`pending` for row 0), or `given[i − 1]` when another walk's picks are `given` (to
/// compare walks row by row). `margins` gets, per row, the smaller of its best score minus its
/// second best and its last candidate's logit minus the best logit left out.
#[allow(clippy::too_many_arguments)] // the walk's inputs, each a different table
pub fn selector_walk(
    logits: &[f32],
    gate: &[f32],
    predecessor: &[f32],
    successor: &[f32],
    vocab: usize,
    rank: usize,
    top_k_count: usize,
    pending: u32,
    given: Option<&[u32]>,
    drafts: &mut Vec<u32>,
    margins: &mut Vec<f32>,
) {
    drafts.clear();
    margins.clear();
    let mut previous = pending;
    let mut candidates: Vec<u32> = Vec::with_capacity(top_k_count + 1);
    for (i, (row, gate_row)) in logits
        .chunks_exact(vocab)
        .zip(gate.chunks_exact(rank))
        .enumerate()
    {
        if let Some(&g) = given.and_then(|g| i.checked_sub(1).and_then(|j| g.get(j))) {
            previous = g;
        }
        let left_out = top_k(row, top_k_count, &mut candidates);
        let top = &candidates[..];
        let code = &predecessor[previous as usize * rank..][..rank];
        let (mut best, mut second) = ((f32::NEG_INFINITY, top[0]), f32::NEG_INFINITY);
        for &c in top {
            let succ = &successor[c as usize * rank..][..rank];
            let pair: f32 = succ
                .iter()
                .zip(code)
                .zip(gate_row)
                .map(|((s, p), g)| s * p * g)
                .sum();
            let score = row[c as usize] + pair;
            if score > best.0 {
                second = best.0;
                best = (score, c);
            } else if score > second {
                second = score;
            }
        }
        // How settled the candidate set is: the gap between the last candidate's logit and the
        // best one left out (a token crossing it could win through its pairwise term).
        let last = row[top[top.len() - 1] as usize];
        drafts.push(best.1);
        margins.push((best.0 - second).min(last - left_out));
        previous = best.1;
    }
}

/// Index of the largest value; the first of equals (NaN never wins).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] || row[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// The `k` highest-scoring ids of `logits` into `top`, highest first, ties to the lower id (the
/// order of `f32::total_cmp`), and the best score left out (`NEG_INFINITY` when none is). One
/// pass keeping the best `k + 1` (a block's rows each scan the whole vocabulary).
fn top_k(logits: &[f32], k: usize, top: &mut Vec<u32>) -> f32 {
    let k = k.min(logits.len()).max(1);
    let keep = k + 1;
    top.clear();
    let beats = |a: f32, ia: usize, b: f32, ib: usize| a.total_cmp(&b).then(ib.cmp(&ia)).is_gt();
    for (i, &v) in logits.iter().enumerate() {
        if top.len() == keep {
            let last = top[keep - 1] as usize;
            if !beats(v, i, logits[last], last) {
                continue;
            }
            top.pop();
        }
        let at = top
            .iter()
            .position(|&t| beats(v, i, logits[t as usize], t as usize))
            .unwrap_or(top.len());
        top.insert(at, i as u32);
    }
    if top.len() > k {
        top.pop().map_or(f32::NEG_INFINITY, |t| logits[t as usize])
    } else {
        f32::NEG_INFINITY
    }
}

/// The input side of a generation-2 convolution pair: the rows' own kernels from the normed
/// rows in `xn` (kept in `dynamic` for the output side), then `xn` convolved in place.
fn conv_input(
    pair: &LayerConv,
    g: Dflash2Params,
    rows: usize,
    hidden: usize,
    family: RowFamily,
    s: &mut Scratch,
) -> Result<(), ModelError> {
    let width = 2 * g.conv_kernel * g.groups(hidden);
    let dynamic = sized(&mut s.dynamic, rows * width);
    pair.projection
        .gemm(&s.xn[..rows * hidden], rows, dynamic, family)?;
    let out = sized(&mut s.conv, rows * hidden);
    grouped_conv(
        &s.xn[..rows * hidden],
        &s.dynamic[..rows * width],
        &pair.base,
        g,
        hidden,
        0,
        out,
    );
    s.xn[..rows * hidden].copy_from_slice(&s.conv[..rows * hidden]);
    Ok(())
}

/// The output side of a generation-2 convolution pair, on the sub-layer's output in `o`, with
/// the kernels its input side computed.
fn conv_output(pair: &LayerConv, g: Dflash2Params, rows: usize, hidden: usize, s: &mut Scratch) {
    let width = 2 * g.conv_kernel * g.groups(hidden);
    let out = sized(&mut s.conv, rows * hidden);
    grouped_conv(
        &s.o[..rows * hidden],
        &s.dynamic[..rows * width],
        &pair.base,
        g,
        hidden,
        1,
        out,
    );
    s.o[..rows * hidden].copy_from_slice(&s.conv[..rows * hidden]);
}

/// The grouped dynamic convolution of generation 2 over one block's rows (`x`, `out`:
/// `[rows, hidden]`): `out[t][c] = Σ_{j < kernel, j ≤ t} (dynamic[t][side][j][c / group] +
/// base[side][j][c]) · x[t − j][c]`. Offset `j` reads the row `j` places earlier; nothing is read
/// across the block's start. `dynamic` is `[rows, 2, kernel, groups]`, `base` `[2, kernel, hidden]`.
pub fn grouped_conv(
    x: &[f32],
    dynamic: &[f32],
    base: &[f32],
    g: Dflash2Params,
    hidden: usize,
    side: usize,
    out: &mut [f32],
) {
    let (kernel, groups, group) = (g.conv_kernel, g.groups(hidden), g.conv_group);
    let width = 2 * kernel * groups;
    let rows = out.len() / hidden;
    out.fill(0.0);
    for t in 0..rows {
        let own = &dynamic[t * width + side * kernel * groups..][..kernel * groups];
        let o = &mut out[t * hidden..(t + 1) * hidden];
        for j in 0..kernel.min(t + 1) {
            let src = &x[(t - j) * hidden..(t - j + 1) * hidden];
            let base_j = &base[(side * kernel + j) * hidden..][..hidden];
            for (c, ((ov, &xv), &b)) in o.iter_mut().zip(src).zip(base_j).enumerate() {
                *ov += (own[j * groups + c / group] + b) * xv;
            }
        }
    }
}

/// RoPE on the first `rotary_dim` values of one head (HF half-split pairs).
fn rope_head(head: &mut [f32], rotary_dim: usize, cos: &[f32], sin: &[f32]) {
    ops::rope_half_split(&mut head[..rotary_dim], cos, sin);
}

/// A generation-2 convolution pair in f64: kernel projection `[2 · kernel · groups, hidden]`,
/// base kernels `[2, kernel, hidden]`.
type ConvWeights = (Vec<f64>, Vec<f64>);

/// The same forward from the package's decoded weights in f64, one row at a time, with nothing
/// cached: `features` `[context, taps · hidden]` and the block `[pending, mask, …]` give the
/// `(block_size − 1) × vocab` logits. `target` supplies the embedding rows and the head (its
/// `lm_head.weight`, or the embedding table when tied). Slow; for tests.
pub fn reference_block_logits(
    draft: &Package,
    target: &Package,
    features: &[f32],
    pending: u32,
) -> Result<Vec<f32>, ModelError> {
    let c = draft.config();
    let Some(p) = c.dflash.as_ref() else {
        return Err(ModelError::Unsupported {
            what: "not a DFlash draft".into(),
        });
    };
    let tc = target.config();
    let (h, hd, kvd, qd, inter) = (c.hidden, c.head_dim, c.kv_dim(), c.q_dim(), c.intermediate);
    let eps = c.rms_eps;
    let width = p.target_layers.len() * h;
    let ctx = features.len() / width;
    let matrix =
        |pkg: &Package, name: &str, rows: usize, cols: usize| -> Result<Vec<f64>, ModelError> {
            Ok(pkg
                .matrix(name, rows, cols)?
                .decode_f32()
                .map_err(|e| tile_error(name, e))?
                .into_iter()
                .map(f64::from)
                .collect())
        };
    let vector = |name: &str| -> Result<Vec<f64>, ModelError> {
        Ok(draft.vector(name)?.into_iter().map(f64::from).collect())
    };
    let matvec = |w: &[f64], x: &[f64], rows: usize| -> Vec<f64> {
        let cols = x.len();
        (0..rows)
            .map(|r| {
                w[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect()
    };
    let rms = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, g)| v * inv * g).collect()
    };
    let half = c.rotary_dim / 2;
    let rope = |head: &mut [f64], pos: usize| {
        for j in 0..half {
            let freq = 1.0 / c.rope_theta.powf(2.0 * j as f64 / c.rotary_dim as f64);
            let (sa, ca) = (pos as f64 * freq).sin_cos();
            let (a, b) = (head[j], head[j + half]);
            head[j] = a * ca - b * sa;
            head[j + half] = b * ca + a * sa;
        }
    };
    let fc = matrix(draft, "model.fc.weight", h, width)?;
    let hidden_norm = vector("model.hidden_norm.weight")?;
    let context: Vec<Vec<f64>> = (0..ctx)
        .map(|r| {
            let f: Vec<f64> = features[r * width..(r + 1) * width]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            rms(&matvec(&fc, &f, h), &hidden_norm)
        })
        .collect();
    let embed = target.matrix(crate::weights::package::EMBED, tc.vocab, tc.hidden)?;
    let rows = p.block_size;
    let mut x: Vec<Vec<f64>> = Vec::with_capacity(rows);
    let mut buf = vec![0f32; h];
    for r in 0..rows {
        let token = if r == 0 { pending } else { p.mask_token_id };
        embed
            .decode_row(token as usize, &mut buf)
            .map_err(|e| tile_error(crate::weights::package::EMBED, e))?;
        x.push(buf.iter().map(|&v| f64::from(v)).collect());
    }
    let group = c.heads / c.kv_heads;
    for l in 0..c.layers {
        let n = |s: &str| format!("model.layers.{l}.{s}");
        let wq = matrix(draft, &n("self_attn.q_proj.weight"), qd, h)?;
        let wk = matrix(draft, &n("self_attn.k_proj.weight"), kvd, h)?;
        let wv = matrix(draft, &n("self_attn.v_proj.weight"), kvd, h)?;
        let wo = matrix(draft, &n("self_attn.o_proj.weight"), h, qd)?;
        let wg = matrix(draft, &n("mlp.gate_proj.weight"), inter, h)?;
        let wu = matrix(draft, &n("mlp.up_proj.weight"), inter, h)?;
        let wd = matrix(draft, &n("mlp.down_proj.weight"), h, inter)?;
        let (qn, kn) = (
            vector(&n("self_attn.q_norm.weight"))?,
            vector(&n("self_attn.k_norm.weight"))?,
        );
        let (an, fnorm) = (
            vector(&n("input_layernorm.weight"))?,
            vector(&n("post_attention_layernorm.weight"))?,
        );
        // Keys and values: context rows at 0..ctx, then block rows at ctx..ctx+rows.
        let mut keys = Vec::with_capacity(ctx + rows);
        let mut values = Vec::with_capacity(ctx + rows);
        let kv_of = |src: &[f64], pos: usize| -> (Vec<f64>, Vec<f64>) {
            let mut k = matvec(&wk, src, kvd);
            for head in k.chunks_exact_mut(hd) {
                let normed = rms(head, &kn);
                head.copy_from_slice(&normed);
                rope(head, pos);
            }
            (k, matvec(&wv, src, kvd))
        };
        for (r, g) in context.iter().enumerate() {
            let (k, v) = kv_of(g, r);
            keys.push(k);
            values.push(v);
        }
        // Generation 2: a convolution pair's kernels from the normed rows, and the convolution
        // of a side over all block rows (each row reads itself and the rows before it).
        let conv_pair = |hf: &str| -> Result<Option<ConvWeights>, ModelError> {
            let Some(g) = p.generation2 else {
                return Ok(None);
            };
            let projected = 2 * g.conv_kernel * g.groups(h);
            Ok(Some((
                matrix(
                    draft,
                    &n(&format!("{hf}.kernel_projection.weight")),
                    projected,
                    h,
                )?,
                vector(&n(&format!("{hf}.base_kernel")))?,
            )))
        };
        let conv = |rows_in: &[Vec<f64>], own: &[Vec<f64>], base: &[f64], side: usize| {
            let Some(g) = p.generation2 else {
                return rows_in.to_vec();
            };
            let (kernel, groups) = (g.conv_kernel, g.groups(h));
            (0..rows_in.len())
                .map(|t| {
                    (0..h)
                        .map(|ch| {
                            (0..kernel.min(t + 1))
                                .map(|j| {
                                    let w = own[t]
                                        [(side * kernel + j) * groups + ch / g.conv_group]
                                        + base[(side * kernel + j) * h + ch];
                                    w * rows_in[t - j][ch]
                                })
                                .sum()
                        })
                        .collect()
                })
                .collect::<Vec<Vec<f64>>>()
        };
        let attn_conv = conv_pair("attention_conv")?;
        let ffn_conv = conv_pair("mlp_conv")?;
        let mut xn: Vec<Vec<f64>> = x.iter().map(|xr| rms(xr, &an)).collect();
        let attn_own: Vec<Vec<f64>> = match &attn_conv {
            Some((proj, base)) => {
                let own: Vec<Vec<f64>> =
                    xn.iter().map(|r| matvec(proj, r, proj.len() / h)).collect();
                xn = conv(&xn, &own, base, 0);
                own
            }
            None => Vec::new(),
        };
        for (r, xr) in xn.iter().enumerate() {
            let (k, v) = kv_of(xr, ctx + r);
            keys.push(k);
            values.push(v);
        }
        let mut attn_out = Vec::with_capacity(rows);
        for (r, xr) in xn.iter().enumerate() {
            let mut q = matvec(&wq, xr, qd);
            for head in q.chunks_exact_mut(hd) {
                let normed = rms(head, &qn);
                head.copy_from_slice(&normed);
                rope(head, ctx + r);
            }
            let last = if p.causal { ctx + r } else { ctx + rows - 1 };
            let mut attn = vec![0f64; qd];
            for head in 0..c.heads {
                let kvh = head / group;
                let qh = &q[head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=last)
                    .map(|j| {
                        let kh = &keys[j][kvh * hd..(kvh + 1) * hd];
                        qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = weights.iter().sum();
                for (j, wj) in weights.iter().enumerate() {
                    let vh = &values[j][kvh * hd..(kvh + 1) * hd];
                    for d in 0..hd {
                        attn[head * hd + d] += wj / sum * vh[d];
                    }
                }
            }
            attn_out.push(matvec(&wo, &attn, h));
        }
        if let Some((_, base)) = &attn_conv {
            attn_out = conv(&attn_out, &attn_own, base, 1);
        }
        for (xr, o) in x.iter_mut().zip(attn_out) {
            for (xv, ov) in xr.iter_mut().zip(o) {
                *xv += ov;
            }
        }
        let mut xn: Vec<Vec<f64>> = x.iter().map(|xr| rms(xr, &fnorm)).collect();
        let ffn_own: Vec<Vec<f64>> = match &ffn_conv {
            Some((proj, base)) => {
                let own: Vec<Vec<f64>> =
                    xn.iter().map(|r| matvec(proj, r, proj.len() / h)).collect();
                xn = conv(&xn, &own, base, 0);
                own
            }
            None => Vec::new(),
        };
        let mut ffn_out: Vec<Vec<f64>> = xn
            .iter()
            .map(|xr| {
                let gate = matvec(&wg, xr, inter);
                let up = matvec(&wu, xr, inter);
                let act: Vec<f64> = gate
                    .iter()
                    .zip(&up)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                matvec(&wd, &act, h)
            })
            .collect();
        if let Some((_, base)) = &ffn_conv {
            ffn_out = conv(&ffn_out, &ffn_own, base, 1);
        }
        for (xr, o) in x.iter_mut().zip(ffn_out) {
            for (xv, ov) in xr.iter_mut().zip(o) {
                *xv += ov;
            }
        }
    }
    let final_norm = vector("model.norm.weight")?;
    let head_name = target.lm_head_name();
    let head = target.matrix(head_name, tc.vocab, tc.hidden)?;
    let mut out = Vec::with_capacity((rows - 1) * tc.vocab);
    let normed: Vec<Vec<f64>> = x[1..].iter().map(|xr| rms(xr, &final_norm)).collect();
    let mut row = vec![0f32; h];
    let mut logits = vec![0f64; (rows - 1) * tc.vocab];
    for t in 0..tc.vocab {
        head.decode_row(t, &mut row)
            .map_err(|e| tile_error(head_name, e))?;
        for (r, xr) in normed.iter().enumerate() {
            logits[r * tc.vocab + t] = row.iter().zip(xr).map(|(&a, b)| f64::from(a) * b).sum();
        }
    }
    out.extend(logits.into_iter().map(|v| v as f32));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_of_equals_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
        assert_eq!(argmax(&[-1.0]), 0);
    }

    #[test]
    fn top_k_orders_by_score_then_id() {
        let logits = [0.5, 2.0, -1.0, 2.0, 1.0];
        let mut top = Vec::new();
        assert_eq!(top_k(&logits, 3, &mut top), 0.5);
        assert_eq!(top, [1, 3, 4]);
        assert_eq!(top_k(&logits, 5, &mut top), f32::NEG_INFINITY);
        assert_eq!(top, [1, 3, 4, 0, 2]);
        // Against a full sort on pseudo-random scores with many ties.
        let scores: Vec<f32> = (0..997u32)
            .map(|i| ((i * 7919) % 61) as f32 * 0.25)
            .collect();
        let mut sorted: Vec<u32> = (0..997).collect();
        sorted.sort_by(|&a, &b| {
            scores[b as usize]
                .total_cmp(&scores[a as usize])
                .then(a.cmp(&b))
        });
        for k in [1, 8, 40] {
            let left_out = top_k(&scores, k, &mut top);
            assert_eq!(top, sorted[..k]);
            assert_eq!(left_out, scores[sorted[k] as usize]);
        }
    }

    /// Vocabulary 4, rank 1, top 3: two rows whose picks follow from the pairwise term by hand.
    #[test]
    fn selector_walk_by_hand() {
        // Row 0 logits: candidates (top 3) are 2 (3.0), 0 (2.0), 1 (1.0); token 3 is left out.
        // Row 1 logits: candidates 3 (1.0), 1 (0.5), 0 (0.5) — 1 before 0 by score, then id.
        let logits = [2.0, 1.0, 3.0, -5.0, 0.5, 0.5, -1.0, 1.0];
        let gate = [1.0, 2.0];
        // predecessor[t], successor[t] (rank 1).
        let predecessor = [1.0, -1.0, 0.5, 2.0];
        let successor = [0.0, 3.0, -1.0, 0.25];
        let (mut drafts, mut margins) = (Vec::new(), Vec::new());
        let mut walk = |gate: &[f32], given: Option<&[u32]>| {
            selector_walk(
                &logits,
                gate,
                &predecessor,
                &successor,
                4,
                1,
                3,
                3,
                given,
                &mut drafts,
                &mut margins,
            );
            (drafts.clone(), margins.clone())
        };
        // Row 0, previous = pending 3 (code 2.0), gate 1: 2 → 3 − 2 = 1; 0 → 2 + 0 = 2;
        // 1 → 1 + 6 = 7: pick 1 by 5. Row 1, previous 1 (code −1), gate 2: 3 → 1 − 0.5 = 0.5;
        // 1 → 0.5 − 6 = −5.5; 0 → 0.5 + 0 = 0.5: a tie with 3, the first (3) wins, margin 0.
        assert_eq!(walk(&gate, None), (vec![1, 3], vec![5.0, 0.0]));
        // Row 1 after another walk's pick 2 (code 0.5, gate 2): 3 → 1 + 0.25 = 1.25;
        // 1 → 0.5 + 3 = 3.5; 0 → 0.5: pick 1 by 2.25, but the candidate set's edge is closer:
        // its last logit 0.5 against the best left out, −1 (row 0's edge: 1 against −5).
        assert_eq!(walk(&gate, Some(&[2])), (vec![1, 1], vec![5.0, 1.5]));
        // Without the pairwise term (gate 0) the walk is the rows' argmax.
        assert_eq!(walk(&[0.0, 0.0], None).0, vec![2, 3]);
    }

    /// Three rows, hidden 4 in 2 groups of 2, kernel 2: every output by hand.
    #[test]
    fn grouped_conv_by_hand() {
        let g = Dflash2Params {
            conv_kernel: 2,
            conv_group: 2,
            selector_rank: 1,
            selector_top_k: 1,
        };
        let x = [
            1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0, -1.0, 0.0, 1.0, 2.0,
        ];
        // Per row [side 0: (j0: g0, g1), (j1: g0, g1)], [side 1: …]; only side 0 is read here.
        let dynamic = [
            0.5, 1.0, 0.0, 0.0, 9.0, 9.0, 9.0, 9.0, //
            0.0, 0.0, 1.0, 2.0, 9.0, 9.0, 9.0, 9.0, //
            1.0, 0.0, 0.0, 1.0, 9.0, 9.0, 9.0, 9.0,
        ];
        // base[side][j][c]: side 0 offset 0 = 1 everywhere, offset 1 = 0.1·c; side 1 unused.
        let mut base = vec![0.0f32; 2 * 2 * 4];
        base[..4].fill(1.0);
        for c in 0..4 {
            base[4 + c] = 0.1 * c as f32;
        }
        let mut out = [0.0f32; 12];
        grouped_conv(&x, &dynamic, &base, g, 4, 0, &mut out);
        // Row 0: offset 0 only: (own + 1) · x0 = [1.5·1, 1.5·2, 2·3, 2·4].
        // Row 1: (0 + 1) · x1 + (own1 + 0.1c) · x0 = x1 + [1·1, 1.1·2, 2.2·3, 2.3·4].
        // Row 2: (own0 + 1) · x2 + (own1 + 0.1c) · x1 = [2·−1, 2·0, 1·1, 1·2] + [0, 0.1·20, 1.2·30, 1.3·40].
        let want = [
            1.5, 3.0, 6.0, 8.0, //
            11.0, 22.2, 36.6, 49.2, //
            -2.0, 2.0, 37.0, 54.0,
        ];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-5, "{out:?} vs {want:?}");
        }
    }
}
