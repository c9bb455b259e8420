//! A minimal GGUF v3 writer for tests, from the published format (ggml `docs/gguf.md`): header
//! `GGUF`, version, tensor count, key-value count; key-values (string key, u32 type, value);
//! tensor infos (name, n_dims, ne[0..n] innermost first, ggml type, data offset); padding to the
//! alignment (32); the data section, each tensor aligned.
#![allow(dead_code)]

/// GGUF metadata value types.
pub const T_U32: u32 = 4;
pub const T_I32: u32 = 5;
pub const T_F32: u32 = 6;
pub const T_BOOL: u32 = 7;
pub const T_STRING: u32 = 8;
pub const T_ARRAY: u32 = 9;

/// ggml tensor types.
pub const GGML_F32: u32 = 0;
pub const GGML_F16: u32 = 1;
pub const GGML_Q4_0: u32 = 2;
pub const GGML_Q4_1: u32 = 3;
pub const GGML_Q8_0: u32 = 8;
pub const GGML_BF16: u32 = 30;

pub struct GgufWriter {
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_t: u64,
    data: Vec<u8>,
}

fn string(out: &mut Vec<u8>, v: &str) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    out.extend_from_slice(v.as_bytes());
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            kv: vec![],
            n_kv: 0,
            infos: vec![],
            n_t: 0,
            data: vec![],
        }
    }
    fn kv_raw(&mut self, key: &str, ty: u32, value: &[u8]) {
        string(&mut self.kv, key);
        self.kv.extend_from_slice(&ty.to_le_bytes());
        self.kv.extend_from_slice(value);
        self.n_kv += 1;
    }
    pub fn str(&mut self, key: &str, v: &str) {
        let mut b = vec![];
        string(&mut b, v);
        self.kv_raw(key, T_STRING, &b);
    }
    pub fn u32(&mut self, key: &str, v: u32) {
        self.kv_raw(key, T_U32, &v.to_le_bytes());
    }
    pub fn f32(&mut self, key: &str, v: f32) {
        self.kv_raw(key, T_F32, &v.to_le_bytes());
    }
    pub fn i32_array(&mut self, key: &str, v: &[i32]) {
        let mut b = T_I32.to_le_bytes().to_vec();
        b.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            b.extend_from_slice(&x.to_le_bytes());
        }
        self.kv_raw(key, T_ARRAY, &b);
    }
    pub fn bool_array(&mut self, key: &str, v: &[bool]) {
        let mut b = T_BOOL.to_le_bytes().to_vec();
        b.extend_from_slice(&(v.len() as u64).to_le_bytes());
        b.extend(v.iter().map(|&x| u8::from(x)));
        self.kv_raw(key, T_ARRAY, &b);
    }
    pub fn str_array(&mut self, key: &str, v: &[String]) {
        let mut b = T_STRING.to_le_bytes().to_vec();
        b.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            string(&mut b, x);
        }
        self.kv_raw(key, T_ARRAY, &b);
    }
    /// A tensor with dims `ne` (innermost first) of ggml type `ty`.
    pub fn tensor(&mut self, name: &str, ne: &[u64], ty: u32, bytes: &[u8]) {
        while !self.data.len().is_multiple_of(32) {
            self.data.push(0);
        }
        string(&mut self.infos, name);
        self.infos
            .extend_from_slice(&(ne.len() as u32).to_le_bytes());
        for d in ne {
            self.infos.extend_from_slice(&d.to_le_bytes());
        }
        self.infos.extend_from_slice(&ty.to_le_bytes());
        self.infos
            .extend_from_slice(&(self.data.len() as u64).to_le_bytes());
        self.data.extend_from_slice(bytes);
        self.n_t += 1;
    }
    pub fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&self.n_t.to_le_bytes());
        b.extend_from_slice(&self.n_kv.to_le_bytes());
        b.extend_from_slice(&self.kv);
        b.extend_from_slice(&self.infos);
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        b.extend_from_slice(&self.data);
        b
    }
}
