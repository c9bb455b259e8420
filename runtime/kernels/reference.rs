//! Scalar references: decode the weights with `tiles::decode_tile` (ggml block rows with
//! `ggml::dequantize`) and take f64 dot products.
//! Slow and obviously correct; every fast path is tested against them.

use super::gemm::WeightMatrix;
use super::quant::{ActivationScale, QuantizedRows};
use super::KernelError;
use crate::tiles::{self, WeightFormat, GROUP, TILE_ROWS};

/// Decode a whole weight matrix to row-major f32 `[rows, cols]` (padding columns dropped).
pub fn decode_matrix(w: &WeightMatrix) -> Result<Vec<f32>, KernelError> {
    w.require_tiles("the scalar reference")?;
    let weight_error = |source| KernelError::Weight {
        format: w.format.name(),
        rows: w.rows,
        cols: w.cols,
        source,
    };
    let mut out = vec![0f32; w.rows * w.cols];
    match w.format.tile_bytes() {
        None => {
            for (row, dst) in out.chunks_exact_mut(w.cols.max(1)).enumerate() {
                tiles::decode_row(w.format, w.data, w.rows, w.cols, row, dst)
                    .map_err(weight_error)?;
            }
        }
        Some(tile_bytes) => {
            let tile_cols = w.format.tile_cols();
            let col_tiles = w.format.padded_cols(w.cols) / tile_cols;
            let mut tile = vec![0f32; TILE_ROWS * tile_cols];
            for p in 0..w.rows / TILE_ROWS {
                for q in 0..col_tiles {
                    let t = p * col_tiles + q;
                    tiles::decode_tile(
                        w.format,
                        &w.data[t * tile_bytes..(t + 1) * tile_bytes],
                        &mut tile,
                    )
                    .map_err(weight_error)?;
                    for r in 0..TILE_ROWS {
                        for c in 0..tile_cols {
                            let col = q * tile_cols + c;
                            if col < w.cols {
                                out[(p * TILE_ROWS + r) * w.cols + col] = tile[r * tile_cols + c];
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(out)
}

/// `y[m×N] = x[m×K] · Wᵀ` with f32 activations: decoded weights, f64 accumulation.
pub fn gemm_reference(
    w: &WeightMatrix,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    check_shapes(w, x, m, y)?;
    let decoded = decode_matrix(w)?;
    for i in 0..m {
        let xr = &x[i * w.cols..(i + 1) * w.cols];
        for n in 0..w.rows {
            let wr = &decoded[n * w.cols..(n + 1) * w.cols];
            let dot: f64 = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
            y[i * w.rows + n] = dot as f32;
        }
    }
    Ok(())
}

/// The same product with the activations first quantized exactly as the fast quantized paths do
/// (`quant::QuantizedRows`, i.e. x̂ = d·q with the scale block the weight format takes). The fast tile kernels compute this
/// up to f32 rounding, so the comparison can be tight. Plain formats are not quantized by the fast
/// path; for them this equals [`gemm_reference`].
pub fn gemm_reference_quantized(
    w: &WeightMatrix,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    if !quantizes_activations(w.format) {
        return gemm_reference(w, x, m, y);
    }
    check_shapes(w, x, m, y)?;
    let mut q = QuantizedRows::default();
    q.quantize(x, m, w.cols, ActivationScale::for_format(w.format));
    let mut dequantized = vec![0f32; m * w.cols];
    for i in 0..m {
        for c in 0..w.cols {
            let d = q.scales[i * q.groups() + c / GROUP];
            dequantized[i * w.cols + c] = d * q.codes[i * q.cols + c] as f32;
        }
    }
    gemm_reference(w, &dequantized, m, y)
}

/// The product with the activations first rounded to bf16 (nearest, ties to even), as the fast
/// path takes them for a bf16 matrix where [`super::HostExecutor::rounds_bf16_activations`].
pub fn gemm_reference_bf16_activations(
    w: &WeightMatrix,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let rounded: Vec<f32> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    gemm_reference(w, &rounded, m, y)
}

/// Check `x` is `m × K` and `y` is `m × N`.
pub(crate) fn check_shapes(
    w: &WeightMatrix,
    x: &[f32],
    m: usize,
    y: &[f32],
) -> Result<(), KernelError> {
    super::gemm::check_activations(w, x, m)?;
    if y.len() != m * w.rows {
        return Err(KernelError::Shape {
            what: "output y (m × N)",
            expected: m * w.rows,
            got: y.len(),
        });
    }
    Ok(())
}

/// Is `format` one whose fast path quantizes activations (all tile formats, and ggml block rows
/// on every path)?
pub fn quantizes_activations(format: WeightFormat) -> bool {
    format.tile_bytes().is_some() || matches!(format, WeightFormat::Ggml(_))
}
