//! Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention), one token at a time.
//!
//! Per token (see `docs/model.md` and the reference's §4): the projections (batched by the caller)
//! give `mixed = q ‖ k ‖ v` (the convolution's input), `z` (output gate), `b` and `a`; then
//! 1. causal depthwise conv of width K over `[conv_state ‖ mixed]`, SiLU; conv_state keeps the last
//!    K − 1 inputs;
//! 2. β = sigmoid(b), g = A · softplus(a + dt_bias) with A = −exp(A_log), α = exp(g);
//! 3. q, k l2-normalized over d_k (eps 1e-6), q scaled by d_k^-1/2; v-head h uses q/k head
//!    ⌊h / (Hv/Hk)⌋;
//! 4. per v-head, state S [d_k × d_v]: S ← α S; δ = β (v − Sᵀk); S ← S + k δᵀ; o = Sᵀ q;
//! 5. y = w ⊙ o · rsqrt(mean(o²) + eps) ⊙ SiLU(z) per v-head (plain weight, not zero-centred).
//!
//! The state update reads only `mixed`, `b` and `a`, so a replay of accepted rows needs exactly
//! those inputs ([`step`] with no output) and runs the very same code: a replay reproduces the
//! pass's state bit for bit.

use super::layers::Projection;
use crate::weights::LinearAttnConfig;

/// Weights of one Gated DeltaNet layer (Qwen3.5 layout).
pub struct GdnWeights {
    /// `in_proj_qkv ‖ in_proj_z`: `[conv_dim + value_dim, hidden]`, rows q (all heads), k, v, z.
    pub in_qkvz: Box<dyn Projection>,
    /// `in_proj_b ‖ in_proj_a`: `[2 Hv, hidden]`.
    pub in_ba: Box<dyn Projection>,
    /// Depthwise conv weight `[conv_dim, K]` (tap K − 1 multiplies the current input).
    pub conv: Vec<f32>,
    /// `dt_bias` `[Hv]`.
    pub dt_bias: Vec<f32>,
    /// `A = −exp(A_log)` `[Hv]` (llama.cpp's `ssm_a`), formed once at load.
    pub a: Vec<f32>,
    /// Gated RMSNorm weight `[d_v]`, shared by the v-heads.
    pub norm: Vec<f32>,
    /// `out_proj`: `[hidden, value_dim]`.
    pub out: Box<dyn Projection>,
}

/// The recurrent state of one GDN layer of one sequence.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GdnState {
    /// The last K − 1 convolution inputs, oldest first: `[(K − 1), conv_dim]`.
    pub conv: Vec<f32>,
    /// Per v-head state `[Hv, d_k, d_v]`.
    pub s: Vec<f32>,
}

impl GdnState {
    /// An all-zero state (conv window and recurrent state) for `d`'s dimensions.
    pub fn zeros(d: &LinearAttnConfig) -> Self {
        GdnState {
            conv: vec![0.0; d.conv_state_len()],
            s: vec![0.0; d.state_len()],
        }
    }
    /// Back to all zeros.
    pub fn clear(&mut self) {
        self.conv.fill(0.0);
        self.s.fill(0.0);
    }
    /// Copy `other` into this state (same dimensions).
    pub fn copy_from(&mut self, other: &GdnState) {
        self.conv.copy_from_slice(&other.conv);
        self.s.copy_from_slice(&other.s);
    }
}

/// Per-token scratch (`conv_dim` floats), allocated once.
pub struct GdnScratch {
    conv_out: Vec<f32>,
}

impl GdnScratch {
    /// The scratch for `d`'s dimensions.
    pub fn new(d: &LinearAttnConfig) -> Self {
        GdnScratch {
            conv_out: vec![0.0; d.conv_dim()],
        }
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// PyTorch's softplus (threshold 20: linear above).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Scale `x` to unit l2 norm: `x / sqrt(Σx² + 1e-6)`, then by `scale`.
fn l2norm_scaled(x: &mut [f32], scale: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = scale / (ss + 1e-6).sqrt();
    for v in x {
        *v *= inv;
    }
}

/// One token through a GDN layer: updates `st` (conv window and recurrent state) from `mixed`
/// (`conv_dim`) and `ba` (`2 Hv`: b then a). With `out = Some((z, y))` also writes the gated,
/// normed output `y` (`value_dim`) using `z` (`value_dim`); replay passes `None`.
#[allow(clippy::too_many_arguments)] // the layer's inputs, state and scratch, all distinct
pub fn step(
    d: &LinearAttnConfig,
    w: &GdnWeights,
    eps: f32,
    st: &mut GdnState,
    mixed: &[f32],
    ba: &[f32],
    scratch: &mut GdnScratch,
    out: Option<(&[f32], &mut [f32])>,
) {
    let cd = d.conv_dim();
    let kw = d.conv_kernel;
    let hist = kw - 1;
    // 1. Causal depthwise conv over [history ‖ current], then SiLU.
    let co = &mut scratch.conv_out[..cd];
    for (c, o) in co.iter_mut().enumerate() {
        let taps = &w.conv[c * kw..(c + 1) * kw];
        let mut acc = taps[hist] * mixed[c];
        for (j, &t) in taps[..hist].iter().enumerate() {
            acc += t * st.conv[j * cd + c];
        }
        *o = silu(acc);
    }
    // The window slides: drop the oldest input, append this one.
    if hist > 0 {
        st.conv.copy_within(cd.., 0);
        st.conv[(hist - 1) * cd..].copy_from_slice(&mixed[..cd]);
    }
    let (kd, dk, dv, hv) = (d.key_dim(), d.key_head_dim, d.value_head_dim, d.value_heads);
    let (q_all, rest) = co.split_at_mut(kd);
    let (k_all, v_all) = rest.split_at_mut(kd);
    // 3. l2-norm q and k per head; q also by d_k^-1/2.
    let q_scale = 1.0 / (dk as f32).sqrt();
    for h in 0..d.key_heads {
        l2norm_scaled(&mut q_all[h * dk..(h + 1) * dk], q_scale);
        l2norm_scaled(&mut k_all[h * dk..(h + 1) * dk], 1.0);
    }
    let group = hv / d.key_heads;
    let (b, a) = ba.split_at(hv);
    let mut out = out;
    for h in 0..hv {
        // 2. Gates.
        let beta = sigmoid(b[h]);
        let g = w.a[h] * softplus(a[h] + w.dt_bias[h]);
        let alpha = g.exp();
        let kh = h / group;
        let q = &q_all[kh * dk..(kh + 1) * dk];
        let k = &k_all[kh * dk..(kh + 1) * dk];
        let v = &v_all[h * dv..(h + 1) * dv];
        let s = &mut st.s[h * dk * dv..(h + 1) * dk * dv];
        // 4. Delta rule: decay, read Sᵀk, rank-1 correction toward v.
        for x in s.iter_mut() {
            *x *= alpha;
        }
        for j in 0..dv {
            let mut mem = 0.0f32;
            for i in 0..dk {
                mem += s[i * dv + j] * k[i];
            }
            let delta = beta * (v[j] - mem);
            for i in 0..dk {
                s[i * dv + j] += k[i] * delta;
            }
        }
        if let Some((z, y)) = out.as_mut() {
            // o = Sᵀq from the updated state, then the gated RMSNorm.
            let yh = &mut y[h * dv..(h + 1) * dv];
            for (j, o) in yh.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for i in 0..dk {
                    acc += s[i * dv + j] * q[i];
                }
                *o = acc;
            }
            let ms: f32 = yh.iter().map(|v| v * v).sum::<f32>() / dv as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            let zh = &z[h * dv..(h + 1) * dv];
            for ((o, &wn), &zz) in yh.iter_mut().zip(&w.norm).zip(zh) {
                *o = wn * (*o * inv) * silu(zz);
            }
        }
    }
}

/// Largest absolute and relative difference between two float slices (relative to the larger
/// magnitude, floored at 1e-6).
pub fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    let mut abs = 0f32;
    let mut rel = 0f32;
    for (&x, &y) in a.iter().zip(b) {
        let d = (x - y).abs();
        abs = abs.max(d);
        rel = rel.max(d / x.abs().max(y.abs()).max(1e-6));
    }
    if a.len() != b.len() {
        return (f32::INFINITY, f32::INFINITY);
    }
    (abs, rel)
}
