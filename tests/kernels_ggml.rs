//! Host GEMM over GGUF block rows (`WeightFormat::Ggml`): every block type on the AVX2 and the
//! scalar path against the decode-then-f64 reference with the same q8 activations, batched rows
//! bit-identical to single rows, and the matrix checks of a hand-built `WeightMatrix`; the same
//! for the host executor's interleaved rows (IQ4_NL, Q5_0, Q5_1) and K tiles (Q4_K, Q5_K,
//! IQ4_XS).

use xdna::ggml::GgmlType;
use xdna::kernels::host_layout::{
    self, append_interleaved_rows, append_k_tiles, deinterleave_rows, k_tiles_to_rows,
};
use xdna::kernels::reference::gemm_reference_quantized;
use xdna::kernels::{HostExecutor, WeightMatrix};
use xdna::tiles::WeightFormat;

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

/// Offsets of the f16 fields (scales, minimums) inside one block of `ty`.
fn half_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL | GgmlType::IQ4_XS => {
            &[0]
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// `rows` rows of random blocks: every code and sub-block scale bit random, the f16 fields
/// finite (0.0005 .. 0.03, either sign).
fn random_rows(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let (values, bytes) = ty.block();
    let mut data: Vec<u8> = (0..rows * cols / values * bytes)
        .map(|_| rng.next_u64() as u8)
        .collect();
    for block in data.chunks_exact_mut(bytes) {
        for &at in half_fields(ty) {
            let v = half::f16::from_f32(rng.f32() * 0.03);
            block[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    data
}

/// `w` in its GGUF rows and, where the format has them, in the host executor's interleaved rows
/// (`packed` holds those bytes).
fn layouts<'a>(
    w: WeightMatrix<'a>,
    packed: &'a mut Vec<u8>,
) -> Vec<(&'static str, WeightMatrix<'a>)> {
    packed.clear();
    let interleaved = append_interleaved_rows(&w, packed).expect("interleave");
    let mut all = vec![("GGUF rows", w)];
    if interleaved {
        let wi = WeightMatrix::interleaved_rows(w.format, w.rows, w.cols, packed).expect("matrix");
        all.push(("interleaved rows", wi));
    }
    all
}

fn formats() -> impl Iterator<Item = (WeightFormat, GgmlType)> {
    WeightFormat::ALL.into_iter().filter_map(|f| match f {
        WeightFormat::Ggml(ty) => Some((f, ty)),
        _ => None,
    })
}

/// Max |a − b| over the outputs, relative to the largest reference magnitude.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

#[test]
fn every_block_type_matches_the_reference_on_both_paths() {
    let mut rng = Rng(0x5eed);
    for (format, ty) in formats() {
        // K = 768 is three 256-value super-blocks; 32-value types also take K = 576 and 608
        // (a half 64-value chunk at the end of the 512-bit path).
        let ks: &[usize] = if ty.block().0 == 32 {
            &[576, 608, 768]
        } else {
            &[768]
        };
        for &k in ks {
            let n = 70; // two full row blocks and a partial one
            let data = random_rows(ty, n, k, &mut rng);
            let w = WeightMatrix::new(format, n, k, &data).expect("matrix");
            let mut packed = Vec::new();
            for m in [1usize, 3, 16] {
                let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
                let mut want = vec![0f32; m * n];
                gemm_reference_quantized(&w, &x, m, &mut want).expect("reference");
                for (layout, w) in layouts(w, &mut packed) {
                    for (name, exec) in [
                        ("default", HostExecutor::new()),
                        ("AVX2", HostExecutor::without_vnni()),
                        ("scalar", HostExecutor::scalar()),
                    ] {
                        let mut got = vec![0f32; m * n];
                        exec.gemm(&w, &x, m, &mut got).expect("gemm");
                        let e = rel_err(&got, &want);
                        assert!(
                            e < 2e-5,
                            "{} {layout} {name} k={k} m={m}: relative error {e}",
                            format.name()
                        );
                    }
                }
            }
        }
    }
}

/// From 16 activation rows the super-block types run in lanes (weight rows across a register)
/// and below that row by row; 40 weight rows leave a part-filled lane group, 37 activation rows
/// a part-filled chunk.
#[test]
fn a_row_of_a_batch_equals_the_same_row_alone() {
    let mut rng = Rng(0xba7c);
    let (n, k) = (40, 768);
    for (format, ty) in formats() {
        let data = random_rows(ty, n, k, &mut rng);
        let w = WeightMatrix::new(format, n, k, &data).expect("matrix");
        let mut packed = Vec::new();
        let all = layouts(w, &mut packed);
        for (m, (layout, w)) in [16, 37]
            .into_iter()
            .flat_map(|m| all.iter().map(move |l| (m, l)))
        {
            let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
            for (name, exec) in [
                ("default", HostExecutor::new()),
                ("AVX2", HostExecutor::without_vnni()),
            ] {
                let mut batch = vec![0f32; m * n];
                exec.gemm(w, &x, m, &mut batch).expect("gemm");
                for i in 0..m {
                    let mut one = vec![0f32; n];
                    exec.gemm(w, &x[i * k..(i + 1) * k], 1, &mut one)
                        .expect("gemm");
                    let same = one
                        .iter()
                        .zip(&batch[i * n..(i + 1) * n])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{} {layout} {name} m={m}: row {i} differs from its batch",
                        format.name()
                    );
                }
            }
        }
    }
}

#[test]
fn a_matrix_of_the_wrong_length_or_width_is_refused() {
    let ty = GgmlType::Q6_K;
    let data = vec![0u8; 4 * 210];
    // 4 rows of one super-block each is right; one byte short, or K not a whole block, is not.
    assert!(WeightMatrix::new(WeightFormat::Ggml(ty), 4, 256, &data).is_ok());
    assert!(WeightMatrix::new(WeightFormat::Ggml(ty), 4, 256, &data[1..]).is_err());
    let err = WeightMatrix::new(WeightFormat::Ggml(ty), 4, 200, &data)
        .expect_err("K = 200 is not whole blocks")
        .to_string();
    assert!(err.contains("256"), "{err}");
}

/// On CPUs with AVX-512 VNNI, Q4_K, Q5_K and Q6_K run 512-bit kernels. Each block sums to the
/// same integers as on the AVX2 kernels, which take them into floats per lane and the 512-bit
/// kernels per block, so the two agree to float rounding (a wrong scale lane, code bit or centre
/// is off by far more). Every activation row count, the lane kernels' (from 16 rows) included.
#[test]
fn the_512_bit_k_quant_kernels_agree_with_the_avx2_ones() {
    if !HostExecutor::new().uses_vnni() {
        eprintln!("no AVX-512 VNNI on this CPU: only the AVX2 kernels run here");
        return;
    }
    let mut rng = Rng(0x512b);
    let (n, k) = (40, 1024);
    for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        let format = WeightFormat::Ggml(ty);
        let data = random_rows(ty, n, k, &mut rng);
        let w = WeightMatrix::new(format, n, k, &data).expect("matrix");
        for m in [1usize, 3, 8, 13, 16, 37] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
            let (mut wide, mut narrow) = (vec![0f32; m * n], vec![0f32; m * n]);
            HostExecutor::new()
                .gemm(&w, &x, m, &mut wide)
                .expect("gemm");
            HostExecutor::without_vnni()
                .gemm(&w, &x, m, &mut narrow)
                .expect("gemm");
            let e = rel_err(&wide, &narrow);
            assert!(e < 1e-6, "{} m={m}: relative difference {e}", format.name());
        }
    }
}

/// Interleaved rows are the file's bytes moved: taken back they are the GGUF rows exactly; the
/// path that reads rows (scalar) gives the bits it gives over the file's layout, and the AVX2
/// path's interleaved kernel agrees with its kernel over the file's rows to float rounding (both
/// sum the same integers per block). A matrix of 45 rows leaves a part-filled last group of 8;
/// the wrong length is refused, and so is handing the layout to what takes the stored one, or
/// asking it of a type without it.
#[test]
fn interleaved_rows_are_the_file_rows_moved() {
    let mut rng = Rng(0x1a7e);
    // Six groups of 8 rows, the last short, are interleaved on one thread; eighteen over the pool.
    for (ty, k, n) in [
        (GgmlType::IQ4_NL, 608, 45),
        (GgmlType::Q5_0, 608, 45),
        (GgmlType::Q5_1, 608, 45),
        (GgmlType::Q5_0, 288, 141),
    ] {
        let format = WeightFormat::Ggml(ty);
        let data = random_rows(ty, n, k, &mut rng);
        let w = WeightMatrix::new(format, n, k, &data).expect("matrix");
        let mut packed = Vec::new();
        assert!(append_interleaved_rows(&w, &mut packed).expect("interleave"));
        let groups = n.div_ceil(8);
        assert_eq!(
            packed.len(),
            groups * 8 * data.len() / n,
            "{groups} groups of 8 rows"
        );
        let mut back = vec![0u8; data.len()];
        deinterleave_rows(format, &packed, k, 0..n, &mut back);
        assert!(
            back == data,
            "{ty:?}: the rows taken back differ from the file's"
        );
        let wi = WeightMatrix::interleaved_rows(format, n, k, &packed).expect("matrix");
        let paths = [
            ("AVX2", HostExecutor::without_vnni()),
            ("scalar", HostExecutor::scalar()),
        ];
        for m in [1usize, 5, 8, 15, 16, 19] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.f32() * 2.0 - 1.0).collect();
            for (name, exec) in &paths {
                let (mut file, mut moved) = (vec![0f32; m * n], vec![0f32; m * n]);
                exec.gemm(&w, &x, m, &mut file).expect("gemm");
                exec.gemm(&wi, &x, m, &mut moved).expect("gemm");
                if *name == "scalar" {
                    let same = file
                        .iter()
                        .zip(&moved)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{ty:?} {name} m={m}: interleaved rows give other bits"
                    );
                } else {
                    let e = rel_err(&moved, &file);
                    assert!(e < 1e-5, "{ty:?} {name} m={m}: relative difference {e}");
                }
            }
        }
        assert!(WeightMatrix::interleaved_rows(format, n, k, &packed[1..]).is_err());
        assert!(WeightMatrix::interleaved_rows(format, n, k, &data).is_err());
        let err = wi
            .require_tiles("the reference")
            .expect_err("not the stored layout");
        assert!(err.to_string().contains("interleaved-row"), "{err}");
    }
    let q6 = WeightFormat::Ggml(GgmlType::Q6_K);
    assert!(host_layout::interleaved_block_bytes(q6).is_none());
    let q6_data = vec![0u8; 8 * 210];
    let q6_matrix = WeightMatrix::new(q6, 8, 256, &q6_data).expect("matrix");
    assert!(!append_interleaved_rows(&q6_matrix, &mut Vec::new()).expect("no layout"));
}

/// K tiles are the file's Q4_K, Q5_K and IQ4_XS bytes moved: taken back they are the GGUF rows
/// exactly; the scalar path (which reads rows) gives the bits it gives over the file's layout; the
/// AVX2 path's 4-bit tile kernel (Q5_K: with the fifth-bit plane, in half-group sums; IQ4_XS: its
/// table values plus 128 in two 4-bit planes, the 128 taken off as a minimum) matches the
/// decode-then-f64 reference, and its batched rows keep the bits of single rows (one 32 × 32
/// unpack serves every row, sums in the same order). The wrong length is refused, and so is
/// handing the layout to what takes the stored one; a row count that is not whole blocks of 32,
/// or another type, has no K tiles.
#[test]
fn k_tiles_are_the_file_rows_moved() {
    let mut rng = Rng(0x4b71);
    let types = [
        (GgmlType::Q4_K, 4736),
        (GgmlType::Q5_K, 5760),
        (GgmlType::IQ4_XS, 4416),
    ];
    for (ty, tile_bytes) in types {
        // Six row blocks of three tiles: enough tiles for the load to split them over the pool.
        let (n, k) = (192, 768);
        let format = WeightFormat::Ggml(ty);
        let data = random_rows(ty, n, k, &mut rng);
        let w = WeightMatrix::new(format, n, k, &data).expect("matrix");
        let mut packed = Vec::new();
        assert!(append_k_tiles(&w, &mut packed).expect("K tiles"));
        assert_eq!(
            packed.len(),
            6 * 3 * tile_bytes,
            "{ty:?}: six row blocks of three tiles"
        );
        let mut back = vec![0u8; data.len()];
        k_tiles_to_rows(format, &packed, k, 0..n, &mut back);
        assert!(
            back == data,
            "{ty:?}: the rows taken back differ from the file's"
        );
        let wk = WeightMatrix::k_tiles(format, n, k, &packed).expect("matrix");
        let avx2 = HostExecutor::without_vnni();
        let scalar = HostExecutor::scalar();
        for m in [1usize, 2, 3, 5, 16, 17, 19] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let mut want = vec![0f32; m * n];
            gemm_reference_quantized(&w, &x, m, &mut want).expect("reference");
            let (mut file, mut moved) = (vec![0f32; m * n], vec![0f32; m * n]);
            scalar.gemm(&w, &x, m, &mut file).expect("gemm");
            scalar.gemm(&wk, &x, m, &mut moved).expect("gemm");
            let same = file
                .iter()
                .zip(&moved)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{ty:?} scalar m={m}: K tiles give other bits");
            let mut tiled = vec![0f32; m * n];
            avx2.gemm(&wk, &x, m, &mut tiled).expect("gemm");
            let e = rel_err(&tiled, &want);
            assert!(e < 2e-5, "{ty:?} AVX2 m={m}: relative error {e}");
            // Every row alone, then within the batch: the same bits.
            for (i, row) in x.chunks_exact(k).enumerate() {
                let mut one = vec![0f32; n];
                avx2.gemm(&wk, row, 1, &mut one).expect("gemm");
                let batched = &tiled[i * n..(i + 1) * n];
                assert!(
                    one.iter()
                        .zip(batched)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty:?} AVX2 m={m}: row {i} batched differs from the row alone"
                );
            }
        }
        assert!(WeightMatrix::k_tiles(format, n, k, &packed[1..]).is_err());
        assert!(WeightMatrix::k_tiles(format, n, k, &data).is_err());
        let err = wk
            .require_tiles("the reference")
            .expect_err("not the stored layout");
        assert!(err.to_string().contains("K-tile"), "{err}");
        assert!(!host_layout::has_k_tiles(format, 45));
        let partial =
            WeightMatrix::new(format, 45, k, &data[..45 * data.len() / n]).expect("matrix");
        assert!(!append_k_tiles(&partial, &mut Vec::new()).expect("no layout"));
    }
    let q6 = WeightFormat::Ggml(GgmlType::Q6_K);
    assert!(!host_layout::has_k_tiles(q6, 64));
    let q6_data = vec![0u8; 32 * 210];
    let q6_matrix = WeightMatrix::new(q6, 32, 256, &q6_data).expect("matrix");
    assert!(!append_k_tiles(&q6_matrix, &mut Vec::new()).expect("no layout"));
}
