//! The weights a forward pass runs over: the projection and embedding traits the loaders
//! implement on top of the kernels layer, each decoder layer's weights, and the whole model's
//! [`ModelWeights`] with its shape checks.

use super::gdn::GdnWeights;
use super::ModelError;
use crate::kernels::RowFamily;
use crate::weights::{LayerKind, LinearAttnConfig, ModelConfig};

/// A weight matrix `[N = rows, K = cols]` that multiplies activations: `y[m×N] = x[m×K] · Wᵀ`.
pub trait Projection: Send + Sync {
    /// Output rows `N`.
    fn rows(&self) -> usize;
    /// Input columns `K`.
    fn cols(&self) -> usize;
    /// Bytes of weights read by one pass over the matrix.
    fn weight_bytes(&self) -> usize;
    /// `y[m×N] = x[m×K] · Wᵀ` for `m` rows of the row family `family`.
    fn gemm(&self, x: &[f32], m: usize, y: &mut [f32], family: RowFamily)
        -> Result<(), ModelError>;
    /// The tile format when the matrix runs on a per-shape kernel (for kernel-set checks).
    fn tiled_format(&self) -> Option<crate::tiles::WeightFormat> {
        None
    }
    /// SwiGLU of a fused gate‖up matrix (rows `0..N/2` the gate, the rest the up projection):
    /// `out[m × N/2] = silu(x · W_gateᵀ) ⊙ (x · W_upᵀ)`. `gate_up` (`m × N`) is scratch for
    /// the product where it is stored first: by this default always, by the host executor where
    /// it cannot fuse the activation into the GEMM (same bits either way).
    fn gemm_swiglu(
        &self,
        x: &[f32],
        m: usize,
        gate_up: &mut [f32],
        out: &mut [f32],
        family: RowFamily,
    ) -> Result<(), ModelError> {
        swiglu_after_gemm(self, x, m, gate_up, out, family)
    }
}

/// [`Projection::gemm_swiglu`] in two steps: the gate‖up product into `gate_up`, then SwiGLU.
pub fn swiglu_after_gemm<P: Projection + ?Sized>(
    p: &P,
    x: &[f32],
    m: usize,
    gate_up: &mut [f32],
    out: &mut [f32],
    family: RowFamily,
) -> Result<(), ModelError> {
    let inter = p.rows() / 2;
    let (Some(gate_up), Some(out)) = (gate_up.get_mut(..m * 2 * inter), out.get_mut(..m * inter))
    else {
        return Err(ModelError::Shape {
            what: format!(
                "SwiGLU buffers: {} and {} floats for {m} × {} and {m} × {inter}",
                gate_up.len(),
                out.len(),
                2 * inter
            ),
        });
    };
    p.gemm(x, m, gate_up, family)?;
    crate::kernels::activation::swiglu(gate_up, inter, out);
    Ok(())
}

/// The token embedding table, decoded one row at a time.
pub trait Embedding: Send + Sync {
    /// Decode token `token`'s row into `out` (`hidden` values).
    fn row(&self, token: u32, out: &mut [f32]) -> Result<(), ModelError>;
}

/// Weights of one full-attention decoder layer (the Llama family's only kind).
pub struct LayerWeights {
    /// The input RMSNorm weight.
    pub attn_norm: Vec<f32>,
    /// Fused q‖k‖v, `[(heads + 2 kv_heads) head_dim, hidden]`, HF half-split rotary layout.
    pub qkv: Box<dyn Projection>,
    /// Bias of the fused q‖k‖v rows (Qwen2).
    pub qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weight of q (Qwen3).
    pub q_norm: Option<Vec<f32>>,
    /// Per-head RMSNorm weight of k (Qwen3).
    pub k_norm: Option<Vec<f32>>,
    /// Input `heads × head_dim`; with an output gate the fused q rows are per head `[q, gate]`.
    pub o: Box<dyn Projection>,
    /// Bias of the output projection.
    pub o_bias: Option<Vec<f32>>,
    /// The RMSNorm weight before the feed-forward block.
    pub ffn_norm: Vec<f32>,
    /// Fused gate‖up, `[2 intermediate, hidden]`.
    pub gate_up: Box<dyn Projection>,
    /// The feed-forward output projection, `[hidden, intermediate]`.
    pub down: Box<dyn Projection>,
}

/// Weights of one Gated DeltaNet decoder layer (hybrid models).
pub struct LinearLayerWeights {
    /// The input RMSNorm weight.
    pub attn_norm: Vec<f32>,
    /// The Gated DeltaNet token mixer.
    pub gdn: GdnWeights,
    /// The RMSNorm weight before the feed-forward block.
    pub ffn_norm: Vec<f32>,
    /// Fused gate‖up, `[2 intermediate, hidden]`.
    pub gate_up: Box<dyn Projection>,
    /// The feed-forward output projection, `[hidden, intermediate]`.
    pub down: Box<dyn Projection>,
}

/// One decoder layer: its token mixer decides what state it keeps.
pub enum Layer {
    /// Softmax attention: KV cache, rolled back by truncation.
    Attention(LayerWeights),
    /// Gated DeltaNet: conv window + recurrent state, rolled back by snapshot and replay.
    Linear(LinearLayerWeights),
}

impl Layer {
    /// The layer's token-mixer kind.
    pub fn kind(&self) -> LayerKind {
        match self {
            Layer::Attention(_) => LayerKind::Attention,
            Layer::Linear(_) => LayerKind::Linear,
        }
    }
    pub(super) fn attn_norm(&self) -> &[f32] {
        match self {
            Layer::Attention(l) => &l.attn_norm,
            Layer::Linear(l) => &l.attn_norm,
        }
    }
    pub(super) fn ffn(&self) -> (&[f32], &dyn Projection, &dyn Projection) {
        match self {
            Layer::Attention(l) => (&l.ffn_norm, &*l.gate_up, &*l.down),
            Layer::Linear(l) => (&l.ffn_norm, &*l.gate_up, &*l.down),
        }
    }
    pub(super) fn projections(&self) -> Vec<&dyn Projection> {
        match self {
            Layer::Attention(l) => vec![&*l.qkv, &*l.o, &*l.gate_up, &*l.down],
            Layer::Linear(l) => vec![
                &*l.gdn.in_qkvz,
                &*l.gdn.in_ba,
                &*l.gdn.out,
                &*l.gate_up,
                &*l.down,
            ],
        }
    }
}

/// Everything the fast forward needs.
pub struct ModelWeights {
    /// The model description.
    pub config: ModelConfig,
    /// The decoder layers, in order.
    pub layers: Vec<Layer>,
    /// The final RMSNorm weight.
    pub final_norm: Vec<f32>,
    /// The token embedding table.
    pub embed: Box<dyn Embedding>,
    /// Separate lm_head, or the embedding matrix itself when tied.
    pub lm_head: Box<dyn Projection>,
    /// Human-readable backend name (for stats lines).
    pub backend: String,
    /// Keep the KV cache in f32 instead of f16: exact runs (`LoadOptions::exact`), whose
    /// comparisons with the f64 reference are about the model code, not f16 rounding.
    pub f32_kv_cache: bool,
}

impl ModelWeights {
    /// Weight bytes streamed by one decode step (every projection once, plus one embedding row).
    pub fn bytes_per_token(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .flat_map(|l| l.projections())
            .map(|p| p.weight_bytes())
            .sum();
        per_layer + self.lm_head.weight_bytes()
    }

    pub(super) fn check_shapes(&self) -> Result<(), ModelError> {
        let c = &self.config;
        let check = |what: String, p: &dyn Projection, n: usize, k: usize| {
            if p.rows() != n || p.cols() != k {
                Err(ModelError::Shape {
                    what: format!(
                        "{what}: expected [{n}, {k}], got [{}, {}]",
                        p.rows(),
                        p.cols()
                    ),
                })
            } else {
                Ok(())
            }
        };
        if self.layers.len() != c.layers {
            return Err(ModelError::Shape {
                what: format!(
                    "{} layers loaded, config says {}",
                    self.layers.len(),
                    c.layers
                ),
            });
        }
        for (i, layer) in self.layers.iter().enumerate() {
            if layer.kind() != c.layer_kind(i) {
                return Err(ModelError::Shape {
                    what: format!(
                        "layer {i} loaded as {:?}, config says {:?}",
                        layer.kind(),
                        c.layer_kind(i)
                    ),
                });
            }
            let (_, gate_up, down) = layer.ffn();
            check(
                format!("layer {i} gate_up"),
                gate_up,
                2 * c.intermediate,
                c.hidden,
            )?;
            check(format!("layer {i} down"), down, c.hidden, c.intermediate)?;
            let l = match layer {
                Layer::Attention(l) => l,
                Layer::Linear(l) => {
                    let d = linear_dims(c)?;
                    let g = &l.gdn;
                    let (cd, vd, hv) = (d.conv_dim(), d.value_dim(), d.value_heads);
                    check(
                        format!("layer {i} in_proj_qkv‖z"),
                        &*g.in_qkvz,
                        cd + vd,
                        c.hidden,
                    )?;
                    check(
                        format!("layer {i} in_proj_b‖a"),
                        &*g.in_ba,
                        2 * hv,
                        c.hidden,
                    )?;
                    check(format!("layer {i} out_proj"), &*g.out, c.hidden, vd)?;
                    let vecs = [
                        ("input_layernorm", &l.attn_norm, c.hidden),
                        ("post_attention_layernorm", &l.ffn_norm, c.hidden),
                        ("conv1d", &g.conv, cd * d.conv_kernel),
                        ("dt_bias", &g.dt_bias, hv),
                        ("A", &g.a, hv),
                        ("norm", &g.norm, d.value_head_dim),
                    ];
                    for (name, v, n) in vecs {
                        if v.len() != n {
                            return Err(ModelError::Shape {
                                what: format!(
                                    "layer {i} {name}: expected {n} values, got {}",
                                    v.len()
                                ),
                            });
                        }
                    }
                    continue;
                }
            };
            check(format!("layer {i} qkv"), &*l.qkv, c.qkv_rows(), c.hidden)?;
            check(format!("layer {i} o_proj"), &*l.o, c.hidden, c.q_dim())?;
            let vecs = [
                ("input_layernorm", Some(&l.attn_norm), c.hidden),
                ("post_attention_layernorm", Some(&l.ffn_norm), c.hidden),
                ("qkv bias", l.qkv_bias.as_ref(), c.qkv_rows()),
                ("o bias", l.o_bias.as_ref(), c.hidden),
                ("q_norm", l.q_norm.as_ref(), c.head_dim),
                ("k_norm", l.k_norm.as_ref(), c.head_dim),
            ];
            for (name, v, n) in vecs {
                if let Some(v) = v {
                    if v.len() != n {
                        return Err(ModelError::Shape {
                            what: format!("layer {i} {name}: expected {n} values, got {}", v.len()),
                        });
                    }
                }
            }
        }
        check("lm_head".into(), &*self.lm_head, c.vocab, c.hidden)?;
        if self.final_norm.len() != c.hidden {
            return Err(ModelError::Shape {
                what: format!(
                    "model.norm: expected {} values, got {}",
                    c.hidden,
                    self.final_norm.len()
                ),
            });
        }
        Ok(())
    }
}

/// The GDN dimensions of a config that has recurrent layers.
pub(super) fn linear_dims(c: &ModelConfig) -> Result<&LinearAttnConfig, ModelError> {
    c.linear.as_ref().ok_or_else(|| ModelError::Shape {
        what: "recurrent layers without linear_* dimensions in the config".into(),
    })
}
