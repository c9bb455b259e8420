//! A deliberately small, independent GGUF reader for the reference forward.
//!
//! The reference must not share code with the fast path's import (tiling, rotary un-interleave), so
//! it reads the GGUF file itself: header, metadata, tensor table, and the slow block decoders of the
//! few formats llama-family GGUFs use (F32, F16, BF16, Q4_0, Q4_1, Q8_0). Everything is bounds-checked;
//! a bad file is a typed error naming the file.

use super::ModelError;
use half::{bf16, f16};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A metadata value.
#[derive(Clone, Debug)]
pub enum Meta {
    /// An integer of any width and sign.
    Int(i64),
    /// An f32 or f64.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(String),
    /// An array of values.
    Array(Vec<Meta>),
}

impl Meta {
    /// The value as an integer, if it is one.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Meta::Int(i) => Some(*i),
            _ => None,
        }
    }
    /// The value as a float (integers converted).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Meta::Float(f) => Some(*f),
            Meta::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Meta::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor of the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// The tensor's name.
    pub name: String,
    /// GGML dims, fastest first: `dims[0]` = columns.
    pub dims: Vec<usize>,
    /// The GGML type id.
    pub ggml_type: u32,
    /// Absolute byte offset in the file.
    pub offset: usize,
    /// Bytes of data.
    pub bytes: usize,
}

impl TensorInfo {
    /// Columns (`dims[0]`).
    pub fn cols(&self) -> usize {
        self.dims.first().copied().unwrap_or(1)
    }
    /// Rows: the product of the other dims.
    pub fn rows(&self) -> usize {
        self.dims.iter().skip(1).product::<usize>().max(1)
    }
}

/// An opened GGUF file (memory-mapped).
pub struct GgufLite {
    /// The file's path.
    pub path: PathBuf,
    map: memmap2::Mmap,
    /// Metadata by key.
    pub meta: HashMap<String, Meta>,
    /// Tensor descriptions by name.
    pub tensors: HashMap<String, TensorInfo>,
}

/// (block elements, block bytes) of a GGML type.
fn block_of(t: u32) -> Option<(usize, usize)> {
    match t {
        0 => Some((1, 4)),   // F32
        1 => Some((1, 2)),   // F16
        30 => Some((1, 2)),  // BF16
        2 => Some((32, 18)), // Q4_0
        3 => Some((32, 20)), // Q4_1
        8 => Some((32, 34)), // Q8_0
        _ => None,
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl Cursor<'_> {
    fn err(&self, what: &str) -> ModelError {
        ModelError::File {
            path: self.path.display().to_string(),
            problem: format!("{what} at byte {}", self.at),
        }
    }
    fn take(&mut self, n: usize) -> Result<&[u8], ModelError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| self.err("truncated GGUF"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, ModelError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, ModelError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self) -> Result<String, ModelError> {
        let n = self.u64()? as usize;
        let s = self.take(n)?;
        Ok(String::from_utf8_lossy(s).into_owned())
    }
    fn value(&mut self, t: u32, depth: usize) -> Result<Meta, ModelError> {
        Ok(match t {
            0 => Meta::Int(self.take(1)?[0] as i64),
            1 => Meta::Int(self.take(1)?[0] as i8 as i64),
            2 => {
                let s = self.take(2)?;
                Meta::Int(u16::from_le_bytes([s[0], s[1]]) as i64)
            }
            3 => {
                let s = self.take(2)?;
                Meta::Int(i16::from_le_bytes([s[0], s[1]]) as i64)
            }
            4 => Meta::Int(self.u32()? as i64),
            5 => Meta::Int(self.u32()? as i32 as i64),
            6 => Meta::Float(f32::from_bits(self.u32()?) as f64),
            7 => Meta::Bool(self.take(1)?[0] != 0),
            8 => Meta::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.err("nested GGUF arrays too deep"));
                }
                let et = self.u32()?;
                let n = self.u64()? as usize;
                if n > self.b.len() {
                    return Err(self.err("GGUF array length beyond the file"));
                }
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(et, depth + 1)?);
                }
                Meta::Array(v)
            }
            10 => Meta::Int(self.u64()? as i64),
            11 => Meta::Int(self.u64()? as i64),
            12 => Meta::Float(f64::from_bits(self.u64()?)),
            other => return Err(self.err(&format!("unknown GGUF value type {other}"))),
        })
    }
}

impl GgufLite {
    /// Open and parse the header of the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let map = crate::weights::map_file(path)?;
        let mut c = Cursor {
            b: &map,
            at: 0,
            path,
        };
        if c.take(4)? != b"GGUF" {
            return Err(c.err("not a GGUF file (magic)"));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(c.err(&format!("unsupported GGUF version {version}")));
        }
        let n_tensors = c.u64()? as usize;
        let n_kv = c.u64()? as usize;
        let mut meta = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let t = c.u32()?;
            let v = c.value(t, 0)?;
            meta.insert(key, v);
        }
        let mut infos = Vec::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()? as usize;
            if nd > 4 {
                return Err(c.err(&format!("tensor {name} has {nd} dims")));
            }
            let mut dims = Vec::with_capacity(nd);
            for _ in 0..nd {
                dims.push(c.u64()? as usize);
            }
            let ggml_type = c.u32()?;
            let offset = c.u64()? as usize;
            infos.push((name, dims, ggml_type, offset));
        }
        let align = meta
            .get("general.alignment")
            .and_then(Meta::as_i64)
            .unwrap_or(32)
            .max(1) as usize;
        let data_start = c.at.div_ceil(align) * align;
        let mut tensors = HashMap::new();
        for (name, dims, ggml_type, offset) in infos {
            let n: usize = dims.iter().product();
            let bytes = match block_of(ggml_type) {
                Some((be, bb)) => n / be * bb,
                None => 0, // unsupported type: reported when the tensor is decoded
            };
            let abs = data_start + offset;
            if abs + bytes > map.len() {
                return Err(ModelError::File {
                    path: path.display().to_string(),
                    problem: format!("tensor {name} extends beyond the file"),
                });
            }
            tensors.insert(
                name.clone(),
                TensorInfo {
                    name,
                    dims,
                    ggml_type,
                    offset: abs,
                    bytes,
                },
            );
        }
        Ok(GgufLite {
            path: path.to_path_buf(),
            map,
            meta,
            tensors,
        })
    }

    /// The description of tensor `name`.
    pub fn info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                file: self.path.display().to_string(),
            })
    }

    /// Raw bytes of a tensor.
    pub fn raw(&self, name: &str) -> Result<&[u8], ModelError> {
        let i = self.info(name)?;
        Ok(&self.map[i.offset..i.offset + i.bytes])
    }

    /// Decode row `row` of a 2-D tensor into `out` (len = cols).
    pub fn decode_row(&self, name: &str, row: usize, out: &mut [f32]) -> Result<(), ModelError> {
        let i = self.info(name)?;
        let cols = i.cols();
        let (be, bb) = block_of(i.ggml_type).ok_or_else(|| ModelError::Unsupported {
            what: format!("GGML type {} of tensor {name}", i.ggml_type),
        })?;
        if out.len() != cols || row >= i.rows() || cols % be != 0 {
            return Err(ModelError::Shape {
                what: format!("row {row} of {name} ({} × {cols})", i.rows()),
            });
        }
        let row_bytes = cols / be * bb;
        let start = i.offset + row * row_bytes;
        decode_blocks(i.ggml_type, &self.map[start..start + row_bytes], out);
        Ok(())
    }

    /// Decode a whole tensor to f32, row-major `[rows, cols]`.
    pub fn decode_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let i = self.info(name)?;
        let (rows, cols) = (i.rows(), i.cols());
        let mut out = vec![0f32; rows * cols];
        for (r, chunk) in out.chunks_mut(cols).enumerate() {
            self.decode_row(name, r, chunk)?;
        }
        Ok(out)
    }

    /// The metadata value `key` as a string.
    pub fn meta_str(&self, key: &str) -> Option<&str> {
        self.meta.get(key).and_then(Meta::as_str)
    }
}

/// Decode consecutive blocks of `t` (slow and obvious).
pub fn decode_blocks(t: u32, b: &[u8], out: &mut [f32]) {
    let h = |i: usize| f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32();
    match t {
        0 => {
            for (k, o) in out.iter_mut().enumerate() {
                *o = f32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]]);
            }
        }
        1 => {
            for (k, o) in out.iter_mut().enumerate() {
                *o = h(2 * k);
            }
        }
        30 => {
            for (k, o) in out.iter_mut().enumerate() {
                *o = bf16::from_bits(u16::from_le_bytes([b[2 * k], b[2 * k + 1]])).to_f32();
            }
        }
        2 => {
            for (blk, o) in out.chunks_mut(32).enumerate() {
                let at = blk * 18;
                let d = h(at);
                for j in 0..16 {
                    let q = b[at + 2 + j];
                    o[j] = ((q & 0x0F) as f32 - 8.0) * d;
                    o[j + 16] = ((q >> 4) as f32 - 8.0) * d;
                }
            }
        }
        3 => {
            for (blk, o) in out.chunks_mut(32).enumerate() {
                let at = blk * 20;
                let (d, m) = (h(at), h(at + 2));
                for j in 0..16 {
                    let q = b[at + 4 + j];
                    o[j] = (q & 0x0F) as f32 * d + m;
                    o[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
        8 => {
            for (blk, o) in out.chunks_mut(32).enumerate() {
                let at = blk * 34;
                let d = h(at);
                for j in 0..32 {
                    o[j] = b[at + 2 + j] as i8 as f32 * d;
                }
            }
        }
        _ => out.fill(f32::NAN),
    }
}
