//! ggml's tensor element types and their block layouts: what a GGUF tensor's bytes mean.
//!
//! Every quantized type stores consecutive blocks of 32 or 256 values. [`unpack`] turns one block
//! into small integer codes and one affine pair per sub-block (`value = scale[s]·q + offset[s]`),
//! the form every consumer builds on: [`dequantize`] evaluates it (bit for bit what ggml's
//! `dequantize_row_*` functions give, since each of them is that same product and sum in f32), and
//! the host executor's dot products (`kernels::ggml_dot`) take integer sums of `q` against 8-bit
//! activations per sub-block and apply the pair once per sub-block.
//!
//! Layouts (`ggml-common.h`; all little-endian, `f16` = IEEE half):
//!
//! | type | values / bytes | block | value |
//! |---|---|---|---|
//! | Q4_0 | 32 / 18 | `d: f16, qs[16]` (value j: low nibble of `qs[j]`, j+16: high) | `d·(q − 8)` |
//! | Q4_1 | 32 / 20 | `d, m: f16, qs[16]` | `d·q + m` |
//! | Q5_0 | 32 / 22 | `d: f16, qh: u32, qs[16]` (bit 4 of value j: bit j of `qh`) | `d·(q − 16)` |
//! | Q5_1 | 32 / 24 | `d, m: f16, qh: u32, qs[16]` | `d·q + m` |
//! | Q8_0 | 32 / 34 | `d: f16, qs: i8[32]` | `d·q` |
//! | Q2_K | 256 / 84 | `scales[16], qs[64], d, dmin: f16`; sub-blocks of 16, scale byte = min·16 + scale | `d·sc·q − dmin·m` |
//! | Q3_K | 256 / 110 | `hmask[32], qs[64], scales[12] (6-bit), d: f16`; sub-blocks of 16 | `d·(sc − 32)·(q − 4·!h)` |
//! | Q4_K | 256 / 144 | `d, dmin: f16, scales[12] (6-bit pairs), qs[128]`; sub-blocks of 32 | `d·sc·q − dmin·m` |
//! | Q5_K | 256 / 176 | `d, dmin: f16, scales[12], qh[32], qs[128]` | `d·sc·q − dmin·m` |
//! | Q6_K | 256 / 210 | `ql[128], qh[64], scales: i8[16], d: f16`; sub-blocks of 16 | `d·sc·(q − 32)` |
//! | IQ4_NL | 32 / 18 | `d: f16, qs[16]`, 4-bit indices into a fixed table | `d·T[q]` |
//! | IQ4_XS | 256 / 136 | `d: f16, scales_h: u16, scales_l[4], qs[128]`; sub-blocks of 32 | `d·(ls − 32)·T[q]` |

use half::{bf16, f16};

/// A ggml tensor element type. Values are the on-disk ids of `enum ggml_type` (ggml.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// 32-bit float (id 0).
    F32,
    /// IEEE half float (id 1).
    F16,
    /// 4-bit codes in 32-element blocks with an f16 scale (id 2).
    Q4_0,
    /// 4-bit codes in 32-element blocks with an f16 scale and an f16 minimum (id 3).
    Q4_1,
    /// 5-bit codes in 32-element blocks with an f16 scale (id 6).
    Q5_0,
    /// 5-bit codes in 32-element blocks with an f16 scale and an f16 minimum (id 7).
    Q5_1,
    /// 8-bit codes in 32-element blocks with an f16 scale (id 8).
    Q8_0,
    /// 8-bit codes in 32-element blocks with an f16 scale and the block's scaled sum (id 9).
    Q8_1,
    /// 2-bit k-quant: 256-element super-blocks of 16-element sub-blocks (id 10).
    Q2_K,
    /// 3-bit k-quant: 256-element super-blocks of 16-element sub-blocks (id 11).
    Q3_K,
    /// 4-bit k-quant: 256-element super-blocks of 32-element sub-blocks with 6-bit scales and
    /// minimums (id 12).
    Q4_K,
    /// 5-bit k-quant: 256-element super-blocks of 32-element sub-blocks (id 13).
    Q5_K,
    /// 6-bit k-quant: 256-element super-blocks of 16-element sub-blocks with 8-bit scales (id 14).
    Q6_K,
    /// 8-bit k-quant with an f32 scale per 256 elements, ggml's dot-product intermediate (id 15).
    Q8_K,
    /// 2-bit lattice codes, 256-element super-blocks (id 16).
    IQ2_XXS,
    /// 2-bit lattice codes with sub-block scales (id 17).
    IQ2_XS,
    /// 3-bit lattice codes (id 18).
    IQ3_XXS,
    /// 1-bit lattice codes (id 19).
    IQ1_S,
    /// 4-bit indices into a fixed non-linear table, 32-element blocks (id 20).
    IQ4_NL,
    /// 3-bit lattice codes with signs and scales (id 21).
    IQ3_S,
    /// 2-bit lattice codes with scales (id 22).
    IQ2_S,
    /// IQ4_NL's table in 256-element super-blocks with 6-bit sub-block scales (id 23).
    IQ4_XS,
    /// 8-bit signed integer (id 24).
    I8,
    /// 16-bit signed integer (id 25).
    I16,
    /// 32-bit signed integer (id 26).
    I32,
    /// 64-bit signed integer (id 27).
    I64,
    /// 64-bit float (id 28).
    F64,
    /// 1-bit lattice codes with block scales (id 29).
    IQ1_M,
    /// bfloat16: the upper half of an f32 (id 30).
    BF16,
    /// Ternary codes, five to a byte (id 34).
    TQ1_0,
    /// Ternary codes, four to a byte (id 35).
    TQ2_0,
    /// 4-bit e2m1 floats with a shared 8-bit exponent per 32 (id 39).
    MXFP4,
}

impl GgmlType {
    /// The type for an on-disk id, if known.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block), as in ggml's `type_traits`.
    pub fn block(self) -> (usize, usize) {
        use GgmlType::*;
        match self {
            F32 => (1, 4),
            F16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2_K => (256, 84),
            Q3_K => (256, 110),
            Q4_K => (256, 144),
            Q5_K => (256, 176),
            Q6_K => (256, 210),
            Q8_K => (256, 292),
            IQ2_XXS => (256, 66),
            IQ2_XS => (256, 74),
            IQ3_XXS => (256, 98),
            IQ1_S => (256, 50),
            IQ4_NL => (32, 18),
            IQ3_S => (256, 110),
            IQ2_S => (256, 82),
            IQ4_XS => (256, 136),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 => (1, 8),
            F64 => (1, 8),
            IQ1_M => (256, 56),
            BF16 => (1, 2),
            TQ1_0 => (256, 54),
            TQ2_0 => (256, 66),
            MXFP4 => (32, 17),
        }
    }

    /// Whether [`dequantize`] supports this type.
    pub fn can_decode(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | BF16) || self.is_block_quant()
    }

    /// Whether [`unpack`] reads this type: the quantized weight types the host executor runs
    /// from their own bytes.
    pub fn is_block_quant(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_NL | IQ4_XS
        )
    }

    /// Whether [`unpack`] gives this type a non-zero offset (an affine type: a minimum per block
    /// or sub-block); the symmetric ones are `scale·q` alone.
    pub fn has_offset(self) -> bool {
        use GgmlType::*;
        matches!(self, Q4_1 | Q5_1 | Q2_K | Q4_K | Q5_K)
    }

    /// Values per scale of the q8 activations ggml's CPU dot product pairs with this type (its
    /// `vec_dot_type`): 256 (`q8_K`) for the K-quants and IQ4_XS, 32 (`q8_0`, `q8_1`) for the
    /// other block types.
    pub fn activation_block(self) -> usize {
        use GgmlType::*;
        match self {
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS => 256,
            _ => 32,
        }
    }

    /// Values per sub-block with one affine pair in [`unpack`] (16 or 32), for the block types.
    pub fn sub_block(self) -> usize {
        use GgmlType::*;
        match self {
            Q2_K | Q3_K | Q6_K => 16,
            _ => 32,
        }
    }

    /// ggml's name of the type (`"q4_1"`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "f32",
            F16 => "f16",
            Q4_0 => "q4_0",
            Q4_1 => "q4_1",
            Q5_0 => "q5_0",
            Q5_1 => "q5_1",
            Q8_0 => "q8_0",
            Q8_1 => "q8_1",
            Q2_K => "q2_K",
            Q3_K => "q3_K",
            Q4_K => "q4_K",
            Q5_K => "q5_K",
            Q6_K => "q6_K",
            Q8_K => "q8_K",
            IQ2_XXS => "iq2_xxs",
            IQ2_XS => "iq2_xs",
            IQ3_XXS => "iq3_xxs",
            IQ1_S => "iq1_s",
            IQ4_NL => "iq4_nl",
            IQ3_S => "iq3_s",
            IQ2_S => "iq2_s",
            IQ4_XS => "iq4_xs",
            I8 => "i8",
            I16 => "i16",
            I32 => "i32",
            I64 => "i64",
            F64 => "f64",
            IQ1_M => "iq1_m",
            BF16 => "bf16",
            TQ1_0 => "tq1_0",
            TQ2_0 => "tq2_0",
            MXFP4 => "mxfp4",
        }
    }

    /// The block types [`unpack`] reads, in id order.
    pub const BLOCK_QUANTS: [GgmlType; 12] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
    ];
}

/// IQ4_NL / IQ4_XS code values (`kvalues_iq4nl`).
pub const IQ4_TABLE: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// One block in integer form: value `i` is `scale[s]·q[i] + offset[s]`, `s = i / sub`.
#[derive(Clone, Debug)]
pub struct BlockCodes {
    /// Integer codes (signed where the type's zero point is subtracted), `len` of them.
    pub q: [i8; 256],
    /// Multiplier of each sub-block.
    pub scale: [f32; 16],
    /// Addend of each sub-block (0 for symmetric types).
    pub offset: [f32; 16],
    /// Values per sub-block (16 or 32).
    pub sub: usize,
    /// Values in the block (32 or 256).
    pub len: usize,
}

impl Default for BlockCodes {
    fn default() -> Self {
        BlockCodes {
            q: [0; 256],
            scale: [0.0; 16],
            offset: [0.0; 16],
            sub: 32,
            len: 0,
        }
    }
}

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// ggml `get_scale_min_k4`: the 6-bit (scale, min) pair `j` of a Q4_K/Q5_K block.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The sixteen 6-bit scales of a Q3_K block (stored biased by 32), unpacked from its 12 bytes.
pub fn q3k_scales(packed: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        // Low 4 bits: byte j (j < 8) low nibble, or byte j-8 high nibble; high 2 bits: byte
        // 8 + j%4, bit pair j/4.
        let low = if j < 8 {
            packed[j] & 0x0F
        } else {
            packed[j - 8] >> 4
        };
        let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8).wrapping_sub(32);
    }
    out
}

/// Unpack one block of `ty` (exactly `ty.block().1` bytes) into `out`. `ty` must be one of
/// [`GgmlType::BLOCK_QUANTS`]; other types leave `out.len` at 0.
pub fn unpack(ty: GgmlType, b: &[u8], out: &mut BlockCodes) {
    out.len = 0;
    out.sub = ty.sub_block();
    match ty {
        GgmlType::Q4_0 | GgmlType::IQ4_NL => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                let (lo, hi) = (b[2 + j] & 0x0F, b[2 + j] >> 4);
                let (lo, hi) = if ty == GgmlType::Q4_0 {
                    (lo as i8 - 8, hi as i8 - 8)
                } else {
                    (IQ4_TABLE[lo as usize], IQ4_TABLE[hi as usize])
                };
                out.q[j] = lo;
                out.q[j + 16] = hi;
            }
            out.scale[0] = d;
            out.offset[0] = 0.0;
            out.len = 32;
        }
        GgmlType::Q4_1 => {
            for j in 0..16 {
                out.q[j] = (b[4 + j] & 0x0F) as i8;
                out.q[j + 16] = (b[4 + j] >> 4) as i8;
            }
            out.scale[0] = f16_at(b, 0);
            out.offset[0] = f16_at(b, 2);
            out.len = 32;
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (qh_at, qs_at) = if ty == GgmlType::Q5_0 { (2, 6) } else { (4, 8) };
            let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
            let zero = if ty == GgmlType::Q5_0 { 16 } else { 0 };
            for j in 0..16 {
                let h0 = (((qh >> j) & 1) << 4) as u8;
                let h1 = (((qh >> (j + 16)) & 1) << 4) as u8;
                out.q[j] = ((b[qs_at + j] & 0x0F) | h0) as i8 - zero;
                out.q[j + 16] = ((b[qs_at + j] >> 4) | h1) as i8 - zero;
            }
            out.scale[0] = f16_at(b, 0);
            out.offset[0] = if ty == GgmlType::Q5_1 {
                f16_at(b, 2)
            } else {
                0.0
            };
            out.len = 32;
        }
        GgmlType::Q8_0 => {
            for j in 0..32 {
                out.q[j] = b[2 + j] as i8;
            }
            out.scale[0] = f16_at(b, 0);
            out.offset[0] = 0.0;
            out.len = 32;
        }
        GgmlType::Q2_K => {
            let (scales, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            for (s, &sc) in scales.iter().enumerate() {
                out.scale[s] = d * (sc & 0x0F) as f32;
                out.offset[s] = -(dmin * (sc >> 4) as f32);
            }
            // Value n·128 + j·32 + l: bits 2j of qs[n·32 + l].
            for i in 0..256 {
                let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
                out.q[i] = ((qs[n * 32 + l] >> (2 * j)) & 3) as i8;
            }
            out.len = 256;
        }
        GgmlType::Q3_K => {
            let (hmask, qs) = (&b[0..32], &b[32..96]);
            let sc = q3k_scales(&b[96..108]);
            let d = f16_at(b, 108);
            for (s, &v) in sc.iter().enumerate() {
                out.scale[s] = d * v as f32;
                out.offset[s] = 0.0;
            }
            for i in 0..256 {
                let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
                let low = ((qs[n * 32 + l] >> (2 * j)) & 3) as i8;
                let high_set = hmask[l] & (1 << (n * 4 + j)) != 0;
                out.q[i] = low - if high_set { 0 } else { 4 };
            }
            out.len = 256;
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (qh, qs) = if ty == GgmlType::Q5_K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            for s in 0..8 {
                let (sc, m) = scale_min_k4(s, scales);
                out.scale[s] = d * sc as f32;
                out.offset[s] = -(dmin * m as f32);
            }
            // Value c·64 + l (l < 32): low nibble of qs[c·32 + l]; c·64 + 32 + l: high nibble.
            // Q5_K's fifth bit of sub-block s is bit s of qh[l].
            for i in 0..256 {
                let (c, half, l) = (i / 64, (i % 64) / 32, i % 32);
                let byte = qs[c * 32 + l];
                let mut v = if half == 0 { byte & 0x0F } else { byte >> 4 };
                if let Some(qh) = qh {
                    v |= ((qh[l] >> (i / 32)) & 1) << 4;
                }
                out.q[i] = v as i8;
            }
            out.len = 256;
        }
        GgmlType::Q6_K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for (s, &v) in sc.iter().enumerate() {
                out.scale[s] = d * (v as i8) as f32;
                out.offset[s] = 0.0;
            }
            // Per 128 values (half h): value h·128 + k·32 + l takes nibble (k / 2) of
            // ql[h·64 + (k % 2)·32 + l] and bit pair k of qh[h·32 + l].
            for i in 0..256 {
                let (h, k, l) = (i / 128, (i % 128) / 32, i % 32);
                let byte = ql[h * 64 + (k % 2) * 32 + l];
                let low = if k < 2 { byte & 0x0F } else { byte >> 4 };
                let high = (qh[h * 32 + l] >> (2 * k)) & 3;
                out.q[i] = (low | (high << 4)) as i8 - 32;
            }
            out.len = 256;
        }
        GgmlType::IQ4_XS => {
            let d = f16_at(b, 0);
            let scales_h = u16::from_le_bytes([b[2], b[3]]);
            let (scales_l, qs) = (&b[4..8], &b[8..136]);
            for s in 0..8 {
                let low = (scales_l[s / 2] >> (4 * (s % 2))) & 0x0F;
                let high = ((scales_h >> (2 * s)) & 3) as u8;
                let ls = (low | (high << 4)) as i32 - 32;
                out.scale[s] = d * ls as f32;
                out.offset[s] = 0.0;
                for j in 0..16 {
                    let byte = qs[s * 16 + j];
                    out.q[s * 32 + j] = IQ4_TABLE[(byte & 0x0F) as usize];
                    out.q[s * 32 + 16 + j] = IQ4_TABLE[(byte >> 4) as usize];
                }
            }
            out.len = 256;
        }
        _ => {}
    }
}

/// Dequantize `data` of type `ty` into `out` (which must hold exactly the element count).
///
/// Scalar and obviously correct: F32 / F16 / BF16 convert each value; the block types evaluate
/// [`unpack`]'s `scale·q + offset`, which is each of ggml's `dequantize_row_*` expressions.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), String> {
    let (be, bb) = ty.block();
    if !ty.can_decode() {
        return Err(format!("decoding ggml type {} is not supported", ty.name()));
    }
    if !out.len().is_multiple_of(be) || data.len() != out.len() / be * bb {
        return Err(format!(
            "{} bytes of {} cannot hold exactly {} values",
            data.len(),
            ty.name(),
            out.len()
        ));
    }
    let blocks = data.chunks_exact(bb).zip(out.chunks_exact_mut(be));
    match ty {
        GgmlType::F32 => {
            for (b, y) in blocks {
                y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, y) in blocks {
                y[0] = f16_at(b, 0);
            }
        }
        GgmlType::BF16 => {
            for (b, y) in blocks {
                y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        _ => {
            let mut codes = BlockCodes::default();
            // A symmetric type adds nothing (so a zero keeps ggml's sign: `d·0` may be −0).
            let affine = ty.has_offset();
            for (b, y) in blocks {
                unpack(ty, b, &mut codes);
                for (i, v) in y.iter_mut().enumerate() {
                    let s = i / codes.sub;
                    let product = codes.scale[s] * codes.q[i] as f32;
                    *v = if affine {
                        product + codes.offset[s]
                    } else {
                        product
                    };
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block with every code, scale and min bit pattern varied (deterministic).
    fn varied_block(ty: GgmlType, seed: u32) -> Vec<u8> {
        let (_, bytes) = ty.block();
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        let mut b: Vec<u8> = (0..bytes)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                state as u8
            })
            .collect();
        // Keep the f16 scales finite and modest: 0x3000..0x37ff is 0.125 ..< 0.5.
        let halves: &[usize] = match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            GgmlType::Q6_K => &[208],
            GgmlType::IQ4_XS => &[0],
            _ => &[],
        };
        for &at in halves {
            b[at + 1] = 0x30 | (b[at + 1] & 0x07);
        }
        b
    }

    /// ggml's own loops, transcribed literally from `dequantize_row_*` (the independent check of
    /// [`unpack`]'s index arithmetic).
    fn ggml_loops(ty: GgmlType, b: &[u8]) -> Vec<f32> {
        let mut y = Vec::new();
        match ty {
            GgmlType::Q2_K => {
                let (d, min) = (f16_at(b, 80), f16_at(b, 82));
                let mut is = 0;
                for n in 0..2 {
                    let q = &b[16 + n * 32..16 + n * 32 + 32];
                    let mut shift = 0;
                    for _ in 0..4 {
                        for part in 0..2 {
                            let sc = b[is];
                            is += 1;
                            let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                            for l in 0..16 {
                                y.push(dl * ((q[l + 16 * part] >> shift) & 3) as f32 - ml);
                            }
                        }
                        shift += 2;
                    }
                }
            }
            GgmlType::Q3_K => {
                let d = f16_at(b, 108);
                // ggml's aux-word shuffle of the 12 scale bytes.
                let w = |i: usize| {
                    u32::from_le_bytes([b[96 + 4 * i], b[97 + 4 * i], b[98 + 4 * i], b[99 + 4 * i]])
                };
                let (a0, a1, tmp) = (w(0), w(1), w(2));
                let (k1, k2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
                let aux = [
                    (a0 & k2) | ((tmp & k1) << 4),
                    (a1 & k2) | (((tmp >> 2) & k1) << 4),
                    ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
                    ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
                ];
                let scales: Vec<i8> = aux
                    .iter()
                    .flat_map(|a| a.to_le_bytes())
                    .map(|x| x as i8)
                    .collect();
                let mut is = 0;
                let mut m = 1u8;
                for n in 0..2 {
                    let q = &b[32 + n * 32..32 + n * 32 + 32];
                    let mut shift = 0;
                    for _ in 0..4 {
                        for part in 0..2 {
                            let dl = d * (scales[is] as i32 - 32) as f32;
                            is += 1;
                            for l in 0..16 {
                                let li = l + 16 * part;
                                let v = ((q[li] >> shift) & 3) as i32
                                    - if b[li] & m != 0 { 0 } else { 4 };
                                y.push(dl * v as f32);
                            }
                        }
                        shift += 2;
                        m <<= 1;
                    }
                }
            }
            GgmlType::Q5_K => {
                let (d, min) = (f16_at(b, 0), f16_at(b, 2));
                let (qh, mut ql) = (&b[16..48], &b[48..176]);
                let (mut u1, mut u2) = (1u8, 2u8);
                for is in (0..8).step_by(2) {
                    let (sc, m) = scale_min_k4(is, &b[4..16]);
                    let (d1, m1) = (d * sc as f32, min * m as f32);
                    let (sc, m) = scale_min_k4(is + 1, &b[4..16]);
                    let (d2, m2) = (d * sc as f32, min * m as f32);
                    for l in 0..32 {
                        y.push(
                            d1 * ((ql[l] & 0xF) as f32 + if qh[l] & u1 != 0 { 16.0 } else { 0.0 })
                                - m1,
                        );
                    }
                    for l in 0..32 {
                        y.push(
                            d2 * ((ql[l] >> 4) as f32 + if qh[l] & u2 != 0 { 16.0 } else { 0.0 })
                                - m2,
                        );
                    }
                    ql = &ql[32..];
                    u1 <<= 2;
                    u2 <<= 2;
                }
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let d = f16_at(b, 0);
                let (m, qh_at) = if ty == GgmlType::Q5_1 {
                    (f16_at(b, 2), 4)
                } else {
                    (0.0, 2)
                };
                let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
                let qs = &b[qh_at + 4..qh_at + 20];
                let mut lo = Vec::new();
                let mut hi = Vec::new();
                for (j, &byte) in qs.iter().enumerate() {
                    let xh0 = (((qh >> j) << 4) & 0x10) as u8;
                    let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
                    let (x0, x1) = ((byte & 0xF) | xh0, (byte >> 4) | xh1);
                    if ty == GgmlType::Q5_0 {
                        lo.push((x0 as i32 - 16) as f32 * d);
                        hi.push((x1 as i32 - 16) as f32 * d);
                    } else {
                        lo.push(x0 as f32 * d + m);
                        hi.push(x1 as f32 * d + m);
                    }
                }
                y.extend(lo);
                y.extend(hi);
            }
            GgmlType::Q6_K => {
                let d = f16_at(b, 208);
                y.resize(256, 0.0);
                for n in 0..2 {
                    let (ql, qh) = (&b[n * 64..n * 64 + 64], &b[128 + n * 32..128 + n * 32 + 32]);
                    let sc = |i: usize| b[192 + n * 8 + i] as i8 as f32;
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        let y = &mut y[n * 128..];
                        y[l] = d * sc(is) * q1 as f32;
                        y[l + 32] = d * sc(is + 2) * q2 as f32;
                        y[l + 64] = d * sc(is + 4) * q3 as f32;
                        y[l + 96] = d * sc(is + 6) * q4 as f32;
                    }
                }
            }
            GgmlType::Q4_K => {
                let (d, min) = (f16_at(b, 0), f16_at(b, 2));
                let mut q = &b[16..144];
                for is in (0..8).step_by(2) {
                    let (sc, m) = scale_min_k4(is, &b[4..16]);
                    let (d1, m1) = (d * sc as f32, min * m as f32);
                    let (sc, m) = scale_min_k4(is + 1, &b[4..16]);
                    let (d2, m2) = (d * sc as f32, min * m as f32);
                    y.extend(q[..32].iter().map(|&x| d1 * (x & 0xF) as f32 - m1));
                    y.extend(q[..32].iter().map(|&x| d2 * (x >> 4) as f32 - m2));
                    q = &q[32..];
                }
            }
            GgmlType::Q4_0 => {
                let d = f16_at(b, 0);
                let qs = &b[2..18];
                y.extend(qs.iter().map(|&x| ((x & 0xF) as i32 - 8) as f32 * d));
                y.extend(qs.iter().map(|&x| ((x >> 4) as i32 - 8) as f32 * d));
            }
            GgmlType::IQ4_XS => {
                let d = f16_at(b, 0);
                let sh = u16::from_le_bytes([b[2], b[3]]) as i32;
                for ib in 0..8 {
                    let ls = ((b[4 + ib / 2] as i32 >> (4 * (ib % 2))) & 0xf)
                        | (((sh >> (2 * ib)) & 3) << 4);
                    let dl = d * (ls - 32) as f32;
                    let qs = &b[8 + ib * 16..8 + ib * 16 + 16];
                    let lo: Vec<f32> = qs
                        .iter()
                        .map(|&q| dl * IQ4_TABLE[(q & 0xf) as usize] as f32)
                        .collect();
                    let hi: Vec<f32> = qs
                        .iter()
                        .map(|&q| dl * IQ4_TABLE[(q >> 4) as usize] as f32)
                        .collect();
                    y.extend(lo);
                    y.extend(hi);
                }
            }
            _ => unreachable!("no literal loop for {ty:?}"),
        }
        y
    }

    #[test]
    fn unpack_matches_ggml_loops_bit_for_bit() {
        for ty in [
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::Q5_K,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q6_K,
            GgmlType::Q4_K,
            GgmlType::Q4_0,
            GgmlType::IQ4_XS,
        ] {
            for seed in 0..64 {
                let b = varied_block(ty, seed);
                let want = ggml_loops(ty, &b);
                let mut got = vec![0f32; want.len()];
                dequantize(ty, &b, &mut got).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{ty:?} seed {seed} value {i}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_block_type_unpacks_to_its_block_length() {
        for ty in GgmlType::BLOCK_QUANTS {
            let b = varied_block(ty, 7);
            let mut c = BlockCodes::default();
            unpack(ty, &b, &mut c);
            assert_eq!(c.len, ty.block().0, "{ty:?}");
            assert!(c.len.is_multiple_of(c.sub));
        }
    }
}
