//! FastFlowLM's legacy "q8 in q4nx" tiles as its real converter writes them (fixture in
//! `tests/data/flm-legacy-q8/`, made by `tools/flm/legacy_q8_fixture.py`): a 64 × 384 Q8_0 matrix
//! in a GGUF (`source.gguf`, tensor `output.weight`) and FLM_Q4NX_Converter's `model.q4nx` of it
//! (`lm_head.weight`, I8 `[2, 3, 5120]`: 2 row blocks × 3 tiles of 32 × 128, each with bf16 scales
//! at [0, 256) and again at [256, 512), int8 codes from byte 512 in two 16-row planes, 512 zero
//! bytes). Unlike the hand-encoded tiles of `kernels_gemm.rs` and `weights_safetensors.rs`, these
//! bytes are the converter's own, so a layout both sides of xdna agree on but the converter does not
//! write (codes read from byte 1024, the scale slot expected at [512, 768)) fails here.

use std::path::PathBuf;
use xdna::kernels::quant::{ActivationScale, QuantizedRows};
use xdna::kernels::{HostExecutor, WeightMatrix};
use xdna::tiles::{self, WeightFormat, GROUP, TILE_ROWS};
use xdna::weights::gguf::{GgmlType, GgufFile};
use xdna::weights::safetensors::{Dtype, SafeTensors};

const ROWS: usize = 64;
const COLS: usize = 384;
const TILE_COLS: usize = 128;
const GGUF_NAME: &str = "output.weight";
const PACKED_NAME: &str = "lm_head.weight";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/flm-legacy-q8")
        .join(name)
}

/// The source matrix from the GGUF's raw Q8_0 blocks (34 bytes: f16 scale, 32 int8 codes):
/// `(codes, f16 scales)`, codes row-major `[ROWS, COLS]`, scales `[ROWS, COLS / 32]`.
fn source_blocks(gguf: &GgufFile) -> (Vec<i8>, Vec<f32>) {
    let t = gguf.require_tensor(GGUF_NAME).expect("source tensor");
    assert_eq!(t.ggml_type, GgmlType::Q8_0);
    assert_eq!(
        t.shape,
        &[COLS as u64, ROWS as u64][..],
        "ggml order: ne[0] = columns"
    );
    assert_eq!(t.data.len(), ROWS * COLS / GROUP * 34);
    let mut codes = Vec::with_capacity(ROWS * COLS);
    let mut scales = Vec::with_capacity(ROWS * COLS / GROUP);
    for block in t.data.chunks_exact(34) {
        scales.push(half::f16::from_bits(u16::from_le_bytes([block[0], block[1]])).to_f32());
        codes.extend(block[2..].iter().map(|&b| b as i8));
    }
    (codes, scales)
}

/// What the converter's tiles must decode to: q · bf16(d), the f16 scale rounded to bf16 to
/// nearest even as `torch.Tensor.to(torch.bfloat16)` does in `_pack_q8nx`.
fn expected_matrix(codes: &[i8], scales: &[f32]) -> Vec<f32> {
    codes
        .iter()
        .enumerate()
        .map(|(i, &q)| {
            let d = half::bf16::from_f32(scales[i / GROUP]).to_f32();
            q as f32 * d
        })
        .collect()
}

/// The package's tile grid, decoded tile by tile with `tiles::decode_tile` (tiles row-major:
/// tile (p, q) holds rows 32p.. and columns 128q..).
fn decode_package(data: &[u8]) -> Vec<f32> {
    let format = WeightFormat::Q8Legacy;
    assert_eq!(format.tile_cols(), TILE_COLS);
    let tile_bytes = tiles::Q8_LEGACY_TILE_BYTES;
    let col_tiles = COLS / TILE_COLS;
    assert_eq!(data.len(), ROWS / TILE_ROWS * col_tiles * tile_bytes);
    let mut out = vec![f32::NAN; ROWS * COLS];
    let mut tile = vec![0f32; TILE_ROWS * TILE_COLS];
    for (t, bytes) in data.chunks_exact(tile_bytes).enumerate() {
        let (p, q) = (t / col_tiles, t % col_tiles);
        tiles::decode_tile(format, bytes, &mut tile).expect("decode tile");
        for r in 0..TILE_ROWS {
            for c in 0..TILE_COLS {
                out[(p * TILE_ROWS + r) * COLS + q * TILE_COLS + c] = tile[r * TILE_COLS + c];
            }
        }
    }
    out
}

#[test]
fn converter_output_is_detected_as_legacy_q8() {
    let st = SafeTensors::open(fixture("model.q4nx")).expect("open package");
    // save_file writes no __metadata__: xdna must recognize the tile type from the bytes alone.
    assert!(st.metadata().is_empty(), "{:?}", st.metadata());
    assert_eq!(st.entries().len(), 1);
    let t = st.tensor(PACKED_NAME).expect("lm_head.weight");
    assert_eq!(t.dtype, Dtype::I8);
    assert_eq!(t.shape, &[ROWS / TILE_ROWS, COLS / TILE_COLS, 5120][..]);
    assert_eq!(st.recorded_shape(PACKED_NAME), None);
    assert_eq!(
        st.format_of(PACKED_NAME).expect("format"),
        WeightFormat::Q8Legacy
    );
}

#[test]
fn converter_tiles_decode_to_the_gguf_values_up_to_bf16_scales() {
    let gguf = GgufFile::open(fixture("source.gguf")).expect("open source");
    let (codes, scales) = source_blocks(&gguf);
    // xdna's GGUF reader gives q · d with the f16 scale (checks the block parsing above, too).
    let from_gguf = gguf
        .require_tensor(GGUF_NAME)
        .unwrap()
        .decode_f32()
        .expect("decode source");
    assert_eq!(from_gguf.len(), ROWS * COLS);
    for (i, &v) in from_gguf.iter().enumerate() {
        assert_eq!(v, codes[i] as f32 * scales[i / GROUP], "GGUF value {i}");
    }
    let want = expected_matrix(&codes, &scales);

    let st = SafeTensors::open(fixture("model.q4nx")).expect("open package");
    let data = st.tensor(PACKED_NAME).unwrap().data;
    let got = decode_package(data);

    // Exactly the converter's values: codes and scale cells in the right places.
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "row {} col {}: package decodes to {g}, the converter wrote q {} × bf16 scale = {w}",
            i / COLS,
            i % COLS,
            codes[i]
        );
    }
    // Against xdna's own dequantization of the source: bf16 keeps 8 significant bits, so rounding
    // a scale to it moves it by at most 2^-8 of itself, and |package − GGUF| ≤ |GGUF| · 2^-8
    // (plus the f32 products' rounding).
    let mut rounded = 0;
    for (i, (&g, &s)) in got.iter().zip(&from_gguf).enumerate() {
        let bound = s.abs() * (1.0 / 256.0 + 1.0 / 8_388_608.0);
        assert!(
            (g - s).abs() <= bound,
            "row {} col {}: package {g} vs GGUF {s} (|Δ| {} > {bound})",
            i / COLS,
            i % COLS,
            (g - s).abs()
        );
        rounded += (g != s) as usize;
    }
    // Not vacuous: the fixture's scales really are bf16-rounded f16 values, its values span
    // several octaves, and its one all-zero block (scale 0) decodes to zeros.
    assert!(
        rounded > ROWS * COLS / 2,
        "only {rounded} values moved by bf16 scales"
    );
    let max = from_gguf.iter().fold(0f32, |a, v| a.max(v.abs()));
    assert!(max > 1.0, "largest |value| {max}");
    let zero_blocks = scales.iter().filter(|&&d| d == 0.0).count();
    assert_eq!(zero_blocks, 1);
    assert!(got.iter().any(|&v| v != 0.0));

    // The scalar reference's whole-matrix decode (used by every gemm reference) agrees.
    let w = WeightMatrix::new(WeightFormat::Q8Legacy, ROWS, COLS, data).expect("matrix");
    let via_reference = xdna::kernels::reference::decode_matrix(&w).expect("decode_matrix");
    assert!(via_reference
        .iter()
        .zip(&got)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

/// `y[i, n] = Σ_k w[n, k] · x[i, k]` in f64, and the magnitudes `Σ_k |w[n, k] · x[i, k]|`.
fn product(w: &[f32], x: &[f32], m: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut y, mut mag) = (vec![0f32; m * ROWS], vec![0f32; m * ROWS]);
    for i in 0..m {
        for n in 0..ROWS {
            let (mut dot, mut abs) = (0f64, 0f64);
            for k in 0..COLS {
                let p = w[n * COLS + k] as f64 * x[i * COLS + k] as f64;
                dot += p;
                abs += p.abs();
            }
            y[i * ROWS + n] = dot as f32;
            mag[i * ROWS + n] = abs as f32;
        }
    }
    (y, mag)
}

/// The activations as the fast kernels see them: q8 per 32-column group (`QuantizedRows`).
fn quantized_activations(x: &[f32], m: usize) -> Vec<f32> {
    let mut q = QuantizedRows::default();
    q.quantize(x, m, COLS, ActivationScale::PerGroup);
    let mut out = vec![0f32; m * COLS];
    for i in 0..m {
        for c in 0..COLS {
            out[i * COLS + c] =
                q.scales[i * q.groups() + c / GROUP] * q.codes[i * q.cols + c] as f32;
        }
    }
    out
}

fn check_close(what: &str, got: &[f32], want: &[f32], mag: &[f32]) {
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(mag).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= 2e-5 * s.max(1e-3),
            "{what}: output {i}: {g} vs expected {w} (|Δ| {err}, magnitude {s})"
        );
    }
}

#[test]
fn gemm_on_converter_tiles_matches_the_source_product() {
    let gguf = GgufFile::open(fixture("source.gguf")).expect("open source");
    let (codes, scales) = source_blocks(&gguf);
    let want_w = expected_matrix(&codes, &scales);
    let st = SafeTensors::open(fixture("model.q4nx")).expect("open package");
    let format = st.format_of(PACKED_NAME).expect("format");
    let w = WeightMatrix::new(format, ROWS, COLS, st.tensor(PACKED_NAME).unwrap().data)
        .expect("matrix");
    let mut rng = Rng(0x5eed_f1a5);
    let mut executors = vec![("default", HostExecutor::new())];
    if HostExecutor::new().uses_vnni() {
        executors.push(("without-vnni", HostExecutor::without_vnni()));
    }
    for m in [1, 3, 17] {
        let x: Vec<f32> = (0..m * COLS).map(|_| rng.f32() * 2.0).collect();
        let (exact, mag) = product(&want_w, &x, m);
        // The scalar path: f32 activations against the decoded (converter-exact) weights.
        let mut y = vec![f32::NAN; m * ROWS];
        HostExecutor::scalar()
            .gemm(&w, &x, m, &mut y)
            .expect("scalar gemm");
        check_close(&format!("scalar m={m}"), &y, &exact, &mag);
        // The fast paths quantize the activations to q8 first; without AVX2 they are scalar.
        for (name, exec) in &executors {
            let want = if exec.uses_avx2() {
                product(&want_w, &quantized_activations(&x, m), m).0
            } else {
                exact.clone()
            };
            let mut y = vec![f32::NAN; m * ROWS];
            exec.gemm(&w, &x, m, &mut y).expect("gemm");
            check_close(&format!("{name} m={m}"), &y, &want, &mag);
        }
    }
}
