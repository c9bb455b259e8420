//! Safetensors / Q4NX container: writer → reader round trip, tile-grid formats, nibble-order
//! detection for FastFlowLM files, and every header-corruption rule.

use std::collections::BTreeMap;
use std::path::PathBuf;
use xdna::tiles::{self, ScaleType, TileOrder, WeightFormat};
use xdna::weights::safetensors::{full_range_cells, Declared, Dtype, SafeTensors, Writer};

struct Tmp(PathBuf);
impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
fn tmp(name: &str) -> Tmp {
    Tmp(std::env::temp_dir().join(format!("xdna-st-{}-{name}.q4nx", std::process::id())))
}

/// Raw safetensors bytes from a JSON header and a data section.
fn raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    b
}

fn err_of(name: &str, bytes: &[u8]) -> String {
    let t = tmp(name);
    std::fs::write(&t.0, bytes).unwrap();
    match SafeTensors::open(&t.0) {
        Ok(_) => panic!("{name}: expected an error"),
        Err(e) => {
            let m = e.to_string();
            assert!(
                m.contains(&format!("xdna-st-{}-{name}", std::process::id())),
                "names the file: {m}"
            );
            m
        }
    }
}

/// A q4_1 tile like real GGUF-derived data: every (group, row) cell holds one 0 and one 15
/// (the group's min and max), the rest pseudo-random in 1..=14; written in `order`.
fn q41_tile(order: TileOrder, seed: u8) -> Vec<u8> {
    let mut t = vec![0u8; tiles::Q41_TILE_BYTES];
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ seed as u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for g in 0..8 {
        for r in 0..32 {
            let mut codes: [u8; 32] = std::array::from_fn(|_| 1 + (next() % 14) as u8);
            let lo = (next() % 32) as usize;
            codes[lo] = 0;
            codes[(lo + 1 + (next() % 31) as usize) % 32] = 15;
            tiles::set_q41_cell(&mut t, ScaleType::Bf16, order, g, r, 0.5, -1.0, &codes);
        }
    }
    t
}

#[test]
fn header_corruption_is_reported() {
    assert!(err_of("short", &[1, 2, 3]).contains("too short"));
    let mut b = 1000u64.to_le_bytes().to_vec();
    b.extend_from_slice(b"{}");
    assert!(err_of("past", &b).contains("past the end"));
    assert!(err_of("json", &raw("{not json", &[])).contains("not valid JSON"));
    assert!(err_of(
        "utf8",
        &raw("{\"\u{FF}\":1}", &[])
            .iter()
            .map(|&x| if x == 0xC3 { 0xFF } else { x })
            .collect::<Vec<_>>()
    )
    .contains("UTF-8"));
    assert!(err_of("array", &raw("[]", &[])).contains("not an object"));
    let m = err_of(
        "dtype",
        &raw(
            r#"{"w":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}"#,
            &[0],
        ),
    );
    assert!(
        m.contains("\"w\"") && m.contains("unknown dtype \"Q9\""),
        "{m}"
    );
    let m = err_of(
        "size",
        &raw(
            r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            &[0; 8],
        ),
    );
    assert!(m.contains("12 bytes") && m.contains("span 8"), "{m}");
    let m = err_of(
        "outside",
        &raw(
            r#"{"w":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}}"#,
            &[0; 8],
        ),
    );
    assert!(m.contains("outside"), "{m}");
    let m = err_of(
        "overlap",
        &raw(
            r#"{"a":{"dtype":"U8","shape":[6],"data_offsets":[0,6]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#,
            &[0; 8],
        ),
    );
    assert!(m.contains("overlap"), "{m}");
    let m = err_of(
        "neg",
        &raw(
            r#"{"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}}"#,
            &[],
        ),
    );
    assert!(m.contains("shape"), "{m}");
    let m = err_of("meta", &raw(r#"{"__metadata__":{"k":1}}"#, &[]));
    assert!(m.contains("not a string"), "{m}");
    let m = err_of(
        "scale",
        &raw(r#"{"__metadata__":{"xdna.scale_type":"f8"}}"#, &[]),
    );
    assert!(m.contains("xdna.scale_type"), "{m}");
}

#[test]
fn truncations_and_flips_never_panic() {
    let t = tmp("rt-src");
    let decl = [
        Declared {
            name: "n".into(),
            dtype: Dtype::F32,
            shape: vec![4],
        },
        Declared {
            name: "w".into(),
            dtype: Dtype::I8,
            shape: vec![1, 5120],
        },
    ];
    let mut w = Writer::create(&t.0, &decl, &BTreeMap::new()).unwrap();
    w.write("n", &[0u8; 16]).unwrap();
    w.write("w", &q41_tile(TileOrder::ColumnMajor, 1)).unwrap();
    w.finish().unwrap();
    let bytes = std::fs::read(&t.0).unwrap();
    let c = tmp("rt-cut");
    for len in (0..bytes.len()).step_by(7) {
        std::fs::write(&c.0, &bytes[..len]).unwrap();
        assert!(SafeTensors::open(&c.0).is_err(), "prefix {len} accepted");
    }
    let mut state = 88172645463325252u64;
    let hl = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for _ in 0..2000 {
        let mut b = bytes.clone();
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let at = (state % hl as u64) as usize;
        b[at] = (state >> 40) as u8;
        std::fs::write(&c.0, &b).unwrap();
        if let Ok(st) = SafeTensors::open(&c.0) {
            for e in st.entries() {
                let _ = st.format_of(&e.name);
            }
        }
    }
}

#[test]
fn writer_round_trip_and_recorded_shape() {
    let t = tmp("rt");
    let mut meta = BTreeMap::new();
    meta.insert("xdna.scale_type".to_string(), "f16".to_string());
    meta.insert("xdna.format.w".to_string(), "q41h".to_string());
    meta.insert("xdna.shape.w".to_string(), "32,200".to_string());
    let decl = [
        Declared {
            name: "norm".into(),
            dtype: Dtype::F32,
            shape: vec![2],
        },
        Declared {
            name: "w".into(),
            dtype: Dtype::I8,
            shape: vec![1, 5120],
        },
        Declared {
            name: "e".into(),
            dtype: Dtype::BF16,
            shape: vec![2, 3],
        },
    ];
    let mut w = Writer::create(&t.0, &decl, &meta).unwrap();
    assert!(w.write("w", &[0]).is_err(), "out of order");
    w.write("norm", &1.0f32.to_le_bytes()).unwrap();
    w.write("norm", &(-2.0f32).to_le_bytes()).unwrap();
    let mut tile = vec![0u8; 5120];
    let codes: [u8; 32] = std::array::from_fn(|i| (i % 16) as u8);
    tiles::set_q41_cell(
        &mut tile,
        ScaleType::F16,
        TileOrder::ColumnMajor,
        0,
        5,
        0.125,
        0.5,
        &codes,
    );
    w.write("w", &tile).unwrap();
    assert!(w.write("e", &[0; 13]).is_err(), "too many bytes");
    let e: Vec<u8> = [1.0f32, 2.0, 3.0, -1.0, -2.0, -3.0]
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
        .collect();
    w.write("e", &e).unwrap();
    w.finish().unwrap();

    let st = SafeTensors::open(&t.0).unwrap();
    assert_eq!(st.header_len() % 8, 0);
    assert_eq!(st.scale_type(), ScaleType::F16);
    assert_eq!(st.recorded_shape("w"), Some((32, 200)));
    let f = st.format_of("w").unwrap();
    assert_eq!(
        f,
        WeightFormat::Q41 {
            scale: ScaleType::F16,
            order: TileOrder::ColumnMajor
        }
    );
    assert_eq!(st.format_of("e").unwrap(), WeightFormat::Bf16);
    assert_eq!(st.format_of("norm").unwrap(), WeightFormat::F32);
    let w = st.tensor("w").unwrap();
    let mut row = vec![0f32; 200];
    tiles::decode_row(f, w.data, 32, 200, 5, &mut row).unwrap();
    for (c, &v) in row.iter().enumerate().take(32) {
        assert_eq!(v, (c % 16) as f32 * 0.125 + 0.5);
    }
    assert_eq!(row[32], 0.0);
    assert!(st.format_of("missing").is_err());

    // finish() with a missing tensor fails and names it.
    let t2 = tmp("short-write");
    let w = Writer::create(&t2.0, &decl, &meta).unwrap();
    let m = w.finish().unwrap_err().to_string();
    assert!(m.contains("\"norm\"") && m.contains("0 of 8"), "{m}");
    // The failed write leaves neither the file nor its temporary beside it.
    let stem = t2.0.file_name().unwrap().to_string_lossy().into_owned();
    let leftovers: Vec<_> = std::fs::read_dir(t2.0.parent().unwrap())
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains(&stem))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

fn flm_file(name: &str, tensors: &[(&str, Vec<u8>, usize)]) -> Tmp {
    // FastFlowLM style: no __metadata__, I8 [n_tiles, chunk].
    let t = tmp(name);
    let decl: Vec<Declared> = tensors
        .iter()
        .map(|(n, d, chunk)| Declared {
            name: n.to_string(),
            dtype: Dtype::I8,
            shape: vec![d.len() / chunk, *chunk],
        })
        .collect();
    let mut w = Writer::create(&t.0, &decl, &BTreeMap::new()).unwrap();
    for (n, d, _) in tensors {
        w.write(n, d).unwrap();
    }
    w.finish().unwrap();
    t
}

#[test]
fn nibble_order_detection_for_flm_files() {
    for order in [TileOrder::Lanes16, TileOrder::ColumnMajor] {
        let mut data = q41_tile(order, 3);
        data.extend(q41_tile(order, 9));
        let t = flm_file(
            &format!("order-{order:?}"),
            &[("model.layers.0.self_attn.q_proj.weight", data, 5120)],
        );
        let st = SafeTensors::open(&t.0).unwrap();
        assert_eq!(st.tile_order(), order);
        assert_eq!(st.scale_type(), ScaleType::Bf16);
        assert_eq!(
            st.format_of("model.layers.0.self_attn.q_proj.weight")
                .unwrap(),
            WeightFormat::Q41 {
                scale: ScaleType::Bf16,
                order
            }
        );
    }
    // The rule itself: every cell is full-range in the right order, few in the wrong one.
    let t = q41_tile(TileOrder::Lanes16, 5);
    assert_eq!(full_range_cells(&t, TileOrder::Lanes16), 256);
    assert!(full_range_cells(&t, TileOrder::ColumnMajor) < 256);
    // Any Q4_K chunk → 1.0.3 (column-major) for the whole file, even if q4_1 looks like lanes.
    let tl = flm_file(
        "order-q4k",
        &[
            ("a.weight", q41_tile(TileOrder::Lanes16, 1), 5120),
            ("b.weight", vec![0u8; 4736], 4736),
        ],
    );
    let st = SafeTensors::open(&tl.0).unwrap();
    assert_eq!(st.tile_order(), TileOrder::ColumnMajor);
    assert_eq!(st.format_of("b.weight").unwrap(), WeightFormat::Q4K);
    // 8704 → Q8; unknown chunk → error naming the size; legacy q8 heuristic.
    // FLM_Q4NX_Converter `_pack_q4nx_8b`: scales [0, 256) repeated in [256, 512), codes
    // [512, 4608), 512 zero bytes.
    let mut legacy = vec![0u8; 5120];
    legacy[..512].fill(0x3F);
    legacy[512..4608].fill(3);
    let tq = flm_file(
        "q8",
        &[
            ("q8.weight", vec![1u8; 8704], 8704),
            ("odd.weight", vec![0u8; 1000], 1000),
            ("legacy.weight", legacy, 5120),
        ],
    );
    let st = SafeTensors::open(&tq.0).unwrap();
    assert!(matches!(
        st.format_of("q8.weight").unwrap(),
        WeightFormat::Q8 { .. }
    ));
    assert!(st
        .format_of("odd.weight")
        .unwrap_err()
        .to_string()
        .contains("1000"));
    assert_eq!(
        st.format_of("legacy.weight").unwrap(),
        WeightFormat::Q8Legacy
    );
}
