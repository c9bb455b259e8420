//! GGUF reader: synthetic files with hand-computed bytes, every corrupt-input rule, and the real
//! SmolLM2 file when present.

#[path = "support/smollm2.rs"]
mod smollm2;
use half::{bf16, f16};
use std::path::{Path, PathBuf};
use xdna::weights::gguf::{decode_f32, GgmlType, GgufFile, Value};
use xdna::weights::WeightsError;

/// Minimal GGUF writer for tests.
struct G {
    version: u32,
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_t: u64,
    data: Vec<u8>,
    align: usize,
}

fn s(out: &mut Vec<u8>, v: &str) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    out.extend_from_slice(v.as_bytes());
}

impl G {
    fn new(version: u32) -> G {
        G {
            version,
            kv: vec![],
            n_kv: 0,
            infos: vec![],
            n_t: 0,
            data: vec![],
            align: 32,
        }
    }
    fn kv_raw(&mut self, key: &str, ty: u32, value: &[u8]) -> &mut Self {
        s(&mut self.kv, key);
        self.kv.extend_from_slice(&ty.to_le_bytes());
        self.kv.extend_from_slice(value);
        self.n_kv += 1;
        self
    }
    fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        let mut b = vec![];
        s(&mut b, v);
        self.kv_raw(key, 8, &b)
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv_raw(key, 4, &v.to_le_bytes())
    }
    fn tensor(&mut self, name: &str, shape: &[u64], ty: u32, bytes: &[u8]) -> &mut Self {
        while !self.data.len().is_multiple_of(self.align) {
            self.data.push(0);
        }
        s(&mut self.infos, name);
        self.infos
            .extend_from_slice(&(shape.len() as u32).to_le_bytes());
        for d in shape {
            self.infos.extend_from_slice(&d.to_le_bytes());
        }
        self.infos.extend_from_slice(&ty.to_le_bytes());
        self.infos
            .extend_from_slice(&(self.data.len() as u64).to_le_bytes());
        self.data.extend_from_slice(bytes);
        self.n_t += 1;
        self
    }
    fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&self.n_t.to_le_bytes());
        b.extend_from_slice(&self.n_kv.to_le_bytes());
        b.extend_from_slice(&self.kv);
        b.extend_from_slice(&self.infos);
        while !b.len().is_multiple_of(self.align) {
            b.push(0);
        }
        b.extend_from_slice(&self.data);
        b
    }
}

struct Tmp(PathBuf);
impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
fn write(name: &str, bytes: &[u8]) -> Tmp {
    let p = std::env::temp_dir().join(format!("xdna-test-{}-{name}.gguf", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    Tmp(p)
}
fn open_bytes(name: &str, bytes: &[u8]) -> Result<GgufFile, WeightsError> {
    let t = write(name, bytes);
    let r = GgufFile::open(&t.0);
    drop(t);
    r
}
fn err_of(name: &str, bytes: &[u8]) -> String {
    match open_bytes(name, bytes) {
        Ok(_) => panic!("{name}: expected an error"),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("xdna-test-{}-{name}", std::process::id())),
                "error names the file: {msg}"
            );
            msg
        }
    }
}

fn f16b(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// A file with every metadata type and one tensor of each decodable type.
fn rich(version: u32) -> (G, Vec<(String, Vec<f32>)>) {
    let mut g = G::new(version);
    g.kv_raw("u8", 0, &[200]);
    g.kv_raw("i8", 1, &[0xFE]);
    g.kv_raw("u16", 2, &60000u16.to_le_bytes());
    g.kv_raw("i16", 3, &(-300i16).to_le_bytes());
    g.kv_u32("u32", 4_000_000_000);
    g.kv_raw("i32", 5, &(-5i32).to_le_bytes());
    g.kv_raw("f32", 6, &1.5f32.to_le_bytes());
    g.kv_raw("bool", 7, &[1]);
    g.kv_str("string", "héllo");
    g.kv_raw("u64", 10, &u64::MAX.to_le_bytes());
    g.kv_raw("i64", 11, &(-7i64).to_le_bytes());
    g.kv_raw("f64", 12, &2.25f64.to_le_bytes());
    // Nested array: [[1u8, 2u8], []] as array of arrays.
    let mut arr = vec![];
    arr.extend_from_slice(&9u32.to_le_bytes());
    arr.extend_from_slice(&2u64.to_le_bytes());
    arr.extend_from_slice(&0u32.to_le_bytes());
    arr.extend_from_slice(&2u64.to_le_bytes());
    arr.extend_from_slice(&[1, 2]);
    arr.extend_from_slice(&0u32.to_le_bytes());
    arr.extend_from_slice(&0u64.to_le_bytes());
    g.kv_raw("nested", 9, &arr);
    let mut sarr = vec![];
    sarr.extend_from_slice(&8u32.to_le_bytes());
    sarr.extend_from_slice(&2u64.to_le_bytes());
    s(&mut sarr, "a");
    s(&mut sarr, "bc");
    g.kv_raw("strings", 9, &sarr);

    let mut expect = vec![];
    // F32 [3]
    let v = [1.0f32, -2.5, 3.25];
    g.tensor(
        "f32",
        &[3],
        0,
        &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
    );
    expect.push(("f32".into(), v.to_vec()));
    // F16 [2, 2]
    let v = [0.5f32, -1.0, 65504.0, 0.0];
    g.tensor(
        "f16",
        &[2, 2],
        1,
        &v.iter().flat_map(|&x| f16b(x)).collect::<Vec<_>>(),
    );
    expect.push(("f16".into(), v.to_vec()));
    // BF16 [2]
    let v = [1.0f32, -3.0];
    g.tensor(
        "bf16",
        &[2],
        30,
        &v.iter()
            .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
            .collect::<Vec<_>>(),
    );
    expect.push(("bf16".into(), v.to_vec()));
    // Q4_0: d = 0.5; qs[j] = j | (15-j)<<4 → y[j] = (j-8)*0.5, y[j+16] = (7-j)*0.5
    let mut b = f16b(0.5).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut e = vec![0f32; 32];
    for j in 0..16 {
        e[j] = (j as f32 - 8.0) * 0.5;
        e[j + 16] = (7.0 - j as f32) * 0.5;
    }
    g.tensor("q4_0", &[32], 2, &b);
    expect.push(("q4_0".into(), e));
    // Q4_1: d = 0.25, m = -1.0
    let mut b = f16b(0.25).to_vec();
    b.extend_from_slice(&f16b(-1.0));
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut e = vec![0f32; 32];
    for j in 0..16 {
        e[j] = j as f32 * 0.25 - 1.0;
        e[j + 16] = (15 - j) as f32 * 0.25 - 1.0;
    }
    g.tensor("q4_1", &[32], 3, &b);
    expect.push(("q4_1".into(), e));
    // Q8_0: d = 2.0, qs = -16..16
    let mut b = f16b(2.0).to_vec();
    b.extend((0..32).map(|i| (i as i8 - 16) as u8));
    g.tensor("q8_0", &[32], 8, &b);
    expect.push((
        "q8_0".into(),
        (0..32).map(|i| (i as f32 - 16.0) * 2.0).collect(),
    ));
    // Q4_K: d = 1, dmin = 0.5; sub-block j has scale sc[j] = j+1 and min m[j] = 2j+1 (6 bits),
    // packed as in ggml: j<4 → scales[j] = sc | (sc_hi<<6)…; here values < 16 except j≥4.
    let sc = [1u8, 2, 3, 4, 37, 38, 39, 40]; // j≥4 need the high bits
    let mn = [1u8, 3, 5, 7, 49, 50, 51, 52];
    let mut scales = [0u8; 12];
    for j in 0..4 {
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        scales[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        scales[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
    let qs: Vec<u8> = (0..128)
        .map(|i| ((i * 7) % 16) as u8 | ((((i * 3) + 5) % 16) as u8) << 4)
        .collect();
    let mut b = f16b(1.0).to_vec();
    b.extend_from_slice(&f16b(0.5));
    b.extend_from_slice(&scales);
    b.extend_from_slice(&qs);
    let mut e = vec![0f32; 256];
    for chunk in 0..4 {
        for l in 0..32 {
            let q = qs[chunk * 32 + l];
            let (j0, j1) = (2 * chunk, 2 * chunk + 1);
            e[chunk * 64 + l] = sc[j0] as f32 * (q & 0xF) as f32 - 0.5 * mn[j0] as f32;
            e[chunk * 64 + 32 + l] = sc[j1] as f32 * (q >> 4) as f32 - 0.5 * mn[j1] as f32;
        }
    }
    g.tensor("q4_k", &[256], 12, &b);
    expect.push(("q4_k".into(), e));
    // Q6_K: element i of the 256 has 6-bit code c(i) = (i*11) % 64, scale index i/16 → sc = (i/16) - 8.
    let code = |i: usize| ((i * 11) % 64) as u8;
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        for l in 0..32 {
            let base = half * 128;
            let c = [
                code(base + l),
                code(base + l + 32),
                code(base + l + 64),
                code(base + l + 96),
            ];
            ql[half * 64 + l] = (c[0] & 0xF) | ((c[2] & 0xF) << 4);
            ql[half * 64 + l + 32] = (c[1] & 0xF) | ((c[3] & 0xF) << 4);
            qh[half * 32 + l] =
                (c[0] >> 4) | ((c[1] >> 4) << 2) | ((c[2] >> 4) << 4) | ((c[3] >> 4) << 6);
        }
    }
    let scl: Vec<u8> = (0..16).map(|k| (k as i8 - 8) as u8).collect();
    let mut b = ql.to_vec();
    b.extend_from_slice(&qh);
    b.extend_from_slice(&scl);
    b.extend_from_slice(&f16b(0.5));
    let e: Vec<f32> = (0..256)
        .map(|i| 0.5 * ((i / 16) as f32 - 8.0) * (code(i) as f32 - 32.0))
        .collect();
    g.tensor("q6_k", &[256], 14, &b);
    expect.push(("q6_k".into(), e));
    (g, expect)
}

#[test]
fn v2_and_v3_metadata_of_every_type_and_all_decoders() {
    for version in [2, 3] {
        let (g, expect) = rich(version);
        let t = write(&format!("rich{version}"), &g.bytes());
        let f = GgufFile::open(&t.0).unwrap();
        assert_eq!(f.version(), version);
        assert_eq!(f.metadata("u8"), Some(&Value::U8(200)));
        assert_eq!(f.metadata("i8"), Some(&Value::I8(-2)));
        assert_eq!(f.get_u64("u16"), Some(60000));
        assert_eq!(f.get_i64("i16"), Some(-300));
        assert_eq!(f.get_u32("u32"), Some(4_000_000_000));
        assert_eq!(f.get_i64("i32"), Some(-5));
        assert_eq!(f.get_f32("f32"), Some(1.5));
        assert_eq!(f.get_bool("bool"), Some(true));
        assert_eq!(f.get_str("string"), Some("héllo"));
        assert_eq!(f.get_u64("u64"), Some(u64::MAX));
        assert_eq!(f.get_i64("i64"), Some(-7));
        assert_eq!(f.get_f64("f64"), Some(2.25));
        assert_eq!(
            f.metadata("nested"),
            Some(&Value::Array(vec![
                Value::Array(vec![Value::U8(1), Value::U8(2)]),
                Value::Array(vec![])
            ]))
        );
        let strs: Vec<&str> = f
            .get_array("strings")
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(strs, ["a", "bc"]);
        assert!(f.metadata("absent").is_none());
        assert!(f.require_u64("string").is_err());
        for (name, want) in &expect {
            let t = f.tensor(name).unwrap();
            assert_eq!(&t.decode_f32().unwrap(), want, "{name}");
        }
        let t = f.tensor("f16").unwrap();
        assert_eq!(t.shape, &[2, 2]);
        assert_eq!(t.rows(), 2);
        let mut row = [0f32; 2];
        t.decode_row(1, &mut row).unwrap();
        assert_eq!(row, [65504.0, 0.0]);
        assert!(t.decode_row(2, &mut row).is_err());
        assert!(f.tensor("nope").is_none());
        assert!(f
            .require_tensor("nope")
            .unwrap_err()
            .to_string()
            .contains("nope"));
    }
}

#[test]
fn every_truncation_is_an_error_never_a_panic() {
    let (g, _) = rich(3);
    let bytes = g.bytes();
    let t = write("trunc", &bytes);
    for len in 0..bytes.len() {
        std::fs::write(&t.0, &bytes[..len]).unwrap();
        assert!(
            GgufFile::open(&t.0).is_err(),
            "prefix of {len} bytes accepted"
        );
    }
}

#[test]
fn random_corruption_never_panics() {
    let (g, _) = rich(3);
    let bytes = g.bytes();
    let t = write("flip", &bytes);
    let mut state = 0x9E3779B97F4A7C15u64;
    for _ in 0..3000 {
        let mut b = bytes.clone();
        for _ in 0..3 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let at = (state % b.len() as u64) as usize;
            b[at] = (state >> 32) as u8;
        }
        std::fs::write(&t.0, &b).unwrap();
        if let Ok(f) = GgufFile::open(&t.0) {
            for info in f.tensor_infos() {
                if let Some(t) = f.tensor(&info.name) {
                    if t.ggml_type.can_decode() {
                        let _ = t.decode_f32();
                    }
                }
            }
        }
    }
}

fn header(version: u32, n_t: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&n_t.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b
}

#[test]
fn corrupt_inputs_name_the_problem() {
    // Empty file.
    assert!(err_of("empty", &[]).contains("empty"));
    // Bad magic.
    assert!(err_of("magic", b"GGML\x03\0\0\0").contains("magic"));
    // Unsupported version.
    assert!(err_of("v1", &header(1, 0, 0)).contains("version 1"));
    // A string claiming 10 GB.
    let mut b = header(3, 0, 1);
    b.extend_from_slice(&10_000_000_000u64.to_le_bytes());
    b.extend_from_slice(b"key and some more bytes to look plausible");
    assert!(err_of("bigstr", &b).contains("1 GiB"));
    // A string claiming more than the file holds (under the cap).
    let mut b = header(3, 0, 1);
    b.extend_from_slice(&1000u64.to_le_bytes());
    b.extend_from_slice(b"key-and-then-some-padding");
    assert!(err_of("shortstr", &b).contains("remain"));
    // Counts the file cannot hold.
    assert!(err_of("nkv", &header(3, 0, u64::MAX)).contains("metadata_kv_count"));
    assert!(err_of("nt", &header(3, 1 << 40, 0)).contains("tensor_count"));
    // Array of 2^60 u32: refused before allocating.
    let mut g = G::new(3);
    let mut a = 4u32.to_le_bytes().to_vec();
    a.extend_from_slice(&(1u64 << 60).to_le_bytes());
    g.kv_raw("arr", 9, &a);
    assert!(err_of("bigarr", &g.bytes()).contains("array declares"));
    // Nesting deeper than 64.
    let mut g = G::new(3);
    let mut a = vec![];
    for _ in 0..70 {
        a.extend_from_slice(&9u32.to_le_bytes());
        a.extend_from_slice(&1u64.to_le_bytes());
    }
    a.extend_from_slice(&[0u8; 64]);
    g.kv_raw("deep", 9, &a);
    assert!(err_of("deep", &g.bytes()).contains("nested deeper"));
    // Unknown value type.
    let mut g = G::new(3);
    g.kv_raw("weird", 99, &[0; 8]);
    assert!(err_of("vtype", &g.bytes()).contains("unknown metadata value type 99"));
    // Invalid UTF-8 in a string.
    let mut g = G::new(3);
    g.kv_raw("bad", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xC3, 0x28]);
    assert!(err_of("utf8", &g.bytes()).contains("UTF-8"));
    // Bool that is not 0/1.
    let mut g = G::new(3);
    g.kv_raw("b", 7, &[7]);
    assert!(err_of("bool", &g.bytes()).contains("bool"));
    // Duplicate key.
    let mut g = G::new(3);
    g.kv_u32("k", 1).kv_u32("k", 2);
    assert!(err_of("dupkey", &g.bytes()).contains("duplicate metadata key"));
    // Alignment not a power of two.
    let mut g = G::new(3);
    g.kv_u32("general.alignment", 24);
    assert!(err_of("align", &g.bytes()).contains("power of two"));
    // Five dims.
    let mut g = G::new(3);
    g.tensor("t5", &[1, 1, 1, 1, 1], 0, &[0; 4]);
    assert!(err_of("dims", &g.bytes()).contains("5 dims"));
    // Unknown ggml type.
    let mut g = G::new(3);
    g.tensor("tq", &[32], 77, &[0; 32]);
    let m = err_of("gtype", &g.bytes());
    assert!(m.contains("ggml type 77") && m.contains("\"tq\""), "{m}");
    // Row length not a multiple of the block size.
    let mut g = G::new(3);
    g.tensor("tb", &[33], 3, &[0; 40]);
    assert!(err_of("block", &g.bytes()).contains("block size"));
    // Data past the end of the file.
    let mut g = G::new(3);
    g.tensor("big", &[16], 0, &[0; 16]);
    let m = err_of("past", &g.bytes());
    assert!(
        m.contains("\"big\"") && m.contains("outside the file"),
        "{m}"
    );
    let mut g = G::new(3);
    g.tensor("huge", &[1 << 30], 0, &[0; 16]);
    let m = err_of("huge", &g.bytes());
    assert!(
        m.contains("\"huge\"") && m.contains("exceeds the file"),
        "{m}"
    );
    // Misaligned offset.
    let mut g = G::new(3);
    g.tensor("a", &[1], 0, &[0; 4]);
    let mut bytes = g.bytes();
    // Patch the offset (last 8 bytes of the tensor info) to 4.
    let info_end = 24 + g.infos.len();
    bytes[info_end - 8..info_end].copy_from_slice(&4u64.to_le_bytes());
    assert!(err_of("misalign", &bytes).contains("alignment"));
    // Duplicate tensor name.
    let mut g = G::new(3);
    g.tensor("x", &[1], 0, &[0; 4])
        .tensor("x", &[1], 0, &[0; 4]);
    assert!(err_of("duptensor", &g.bytes()).contains("duplicate tensor name"));
    // Element count overflow.
    let mut g = G::new(3);
    g.tensor("ovf", &[1 << 40, 1 << 40], 0, &[]);
    assert!(err_of("overflow", &g.bytes()).contains("overflow"));
}

#[test]
fn decode_f32_rejects_size_mismatch() {
    let mut out = [0f32; 32];
    assert!(decode_f32(GgmlType::Q4_1, &[0u8; 19], &mut out).is_err());
    assert!(decode_f32(GgmlType::Q5_0, &[0u8; 21], &mut out).is_err());
    assert!(decode_f32(GgmlType::Q5_0, &[0u8; 22], &mut out).is_ok());
    assert!(decode_f32(GgmlType::Q8_0, &[0u8; 34], &mut out).is_ok());
    // A type with no decoder (ternary TQ2_0, 256 values in 66 bytes) is an error, not garbage.
    let mut wide = [0f32; 256];
    assert!(decode_f32(GgmlType::TQ2_0, &[0u8; 66], &mut wide).is_err());
}

fn smollm() -> Option<PathBuf> {
    smollm2::smollm2_gguf()
}

#[test]
fn real_smollm2_file() {
    let Some(p) = smollm() else { return };
    let f = GgufFile::open(Path::new(&p)).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.get_u64("llama.block_count"), Some(30));
    assert_eq!(f.get_u64("llama.embedding_length"), Some(576));
    assert_eq!(f.get_f32("llama.rope.freq_base"), Some(100000.0));
    assert_eq!(f.get_array("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(f.get_str("tokenizer.ggml.pre"), Some("smollm"));
    assert_eq!(f.tensor_infos().len(), 272);
    let e = f.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (e.ggml_type, e.shape),
        (GgmlType::Q8_0, &[576u64, 49152][..])
    );
    // Row 7 of token_embd, hand-decoded from its bytes: block b = (f16 d, 32 × i8).
    let row = e.row_data(7).unwrap();
    let mut want = vec![0f32; 576];
    for b in 0..18 {
        let d = f16::from_bits(u16::from_le_bytes([row[b * 34], row[b * 34 + 1]])).to_f32();
        for i in 0..32 {
            want[b * 32 + i] = row[b * 34 + 2 + i] as i8 as f32 * d;
        }
    }
    let mut got = vec![0f32; 576];
    e.decode_row(7, &mut got).unwrap();
    assert_eq!(got, want);
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!((q.ggml_type, q.shape), (GgmlType::Q4_1, &[576u64, 576][..]));
    let all = q.decode_f32().unwrap();
    let b = &q.data[20 * 18 * 3..]; // row 3, block 0
    let d = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    let m = f16::from_bits(u16::from_le_bytes([b[2], b[3]])).to_f32();
    assert_eq!(all[3 * 576 + 1], (b[5] & 0xF) as f32 * d + m);
    assert_eq!(all[3 * 576 + 17], (b[5] >> 4) as f32 * d + m);
    let n = f.tensor("output_norm.weight").unwrap();
    assert_eq!(n.ggml_type, GgmlType::F32);
    assert_eq!(n.decode_f32().unwrap().len(), 576);
}
