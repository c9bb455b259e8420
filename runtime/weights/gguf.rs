//! GGUF reader over a read-only memory map (versions 2 and 3).
//!
//! Structure and hardening follow candle's `quantized/gguf_file.rs` and llama.cpp's `gguf.cpp`:
//! - strings ≤ 1 GiB, arrays nested ≤ 64 deep, ≤ 4 dims per tensor;
//! - every declared count (metadata entries, tensors, array elements, string bytes) is checked
//!   against the bytes the rest of the file can hold *before* anything is allocated for it;
//! - `general.alignment` (default 32) must be a power of two; tensor data offsets must be aligned,
//!   inside the file, and the byte size must follow from the ggml type and shape;
//! - duplicate metadata keys and duplicate tensor names are errors.
//!
//! Every error names the file and the field or tensor (see [`WeightsError`]).
//!
//! ```no_run
//! # fn main() -> Result<(), xdna::weights::WeightsError> {
//! use xdna::weights::gguf::GgufFile;
//! let f = GgufFile::open("model.gguf")?;
//! let layers = f.get_u64("llama.block_count");
//! let t = f.tensor("blk.0.attn_norm.weight").expect("tensor");
//! let values: Vec<f32> = t.decode_f32()?;
//! # let _ = (layers, values); Ok(()) }
//! ```

use super::{map_file, WeightsError};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// `"GGUF"` read as a little-endian u32.
pub const GGUF_MAGIC: u32 = 0x4655_4747;
/// Longest string accepted (key, value or tensor name).
pub const MAX_STRING_BYTES: u64 = 1 << 30;
/// Deepest array nesting accepted.
pub const MAX_DEPTH: usize = 64;
/// Most dimensions a tensor may have.
pub const MAX_DIMS: usize = 4;
/// Default tensor data alignment.
pub const DEFAULT_ALIGNMENT: u64 = 32;

pub use crate::ggml::GgmlType;

/// A metadata value (GGUF `gguf_type`).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `UINT8` (type 0).
    U8(u8),
    /// `INT8` (type 1).
    I8(i8),
    /// `UINT16` (type 2).
    U16(u16),
    /// `INT16` (type 3).
    I16(i16),
    /// `UINT32` (type 4).
    U32(u32),
    /// `INT32` (type 5).
    I32(i32),
    /// `FLOAT32` (type 6).
    F32(f32),
    /// `BOOL` (type 7): one byte, 0 or 1.
    Bool(bool),
    /// `STRING` (type 8): u64 length, then UTF-8 bytes.
    String(String),
    /// `ARRAY` (type 9): element type, u64 count, then the elements (all of that one type).
    Array(Vec<Value>),
    /// `UINT64` (type 10).
    U64(u64),
    /// `INT64` (type 11).
    I64(i64),
    /// `FLOAT64` (type 12).
    F64(f64),
}

impl Value {
    /// Any non-negative integer value as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            Value::Bool(v) => Some(v as u64),
            _ => None,
        }
    }
    /// Any integer value as i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    /// Any numeric value as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    /// A boolean (or an integer 0/1).
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => self.as_u64().map(|v| v != 0),
        }
    }
    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    /// An array value's elements.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
    /// The GGUF type name, for listings.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }
}

/// Where a tensor is and what it holds (parsed tensor-info record).
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// The tensor's name (e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions innermost-first (`ne[0]` = elements per row).
    pub shape: Vec<u64>,
    /// Element type of the data.
    pub ggml_type: GgmlType,
    /// Offset of the data relative to the data section.
    pub offset: u64,
    /// Bytes of data.
    pub size: usize,
}

impl TensorInfo {
    /// Number of elements (product of the shape).
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A zero-copy view of one tensor's bytes.
#[derive(Clone, Copy, Debug)]
pub struct GgufTensor<'a> {
    /// The tensor's name.
    pub name: &'a str,
    /// Element type of `data`.
    pub ggml_type: GgmlType,
    /// Dimensions innermost-first: `shape[0]` is the row length (GGUF `ne[0]`).
    pub shape: &'a [u64],
    /// The tensor's bytes, in place in the file's mapping.
    pub data: &'a [u8],
    path: &'a Path,
}

impl GgufTensor<'_> {
    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.shape.iter().product::<u64>() as usize
    }
    /// Elements per row (`ne[0]`).
    pub fn row_len(&self) -> usize {
        self.shape.first().copied().unwrap_or(1) as usize
    }
    /// Number of rows (product of all but the innermost dim).
    pub fn rows(&self) -> usize {
        self.shape.iter().skip(1).product::<u64>() as usize
    }
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        let (be, bb) = self.ggml_type.block();
        self.row_len() / be * bb
    }
    /// The raw bytes of row `row`.
    pub fn row_data(&self, row: usize) -> Result<&[u8], WeightsError> {
        let rb = self.row_bytes();
        if row >= self.rows() {
            return Err(WeightsError::tensor(
                self.path,
                self.name,
                format!("row {row} out of range (rows {})", self.rows()),
            ));
        }
        Ok(&self.data[row * rb..(row + 1) * rb])
    }
    /// Decode the whole tensor to f32 (scalar reference dequantizers, see [`decode_f32`]).
    pub fn decode_f32(&self) -> Result<Vec<f32>, WeightsError> {
        let mut out = vec![0f32; self.elements()];
        decode_f32(self.ggml_type, self.data, &mut out)
            .map_err(|e| WeightsError::tensor(self.path, self.name, e))?;
        Ok(out)
    }
    /// Decode one row (`ne[0]` values) into `out`.
    pub fn decode_row(&self, row: usize, out: &mut [f32]) -> Result<(), WeightsError> {
        let data = self.row_data(row)?;
        decode_f32(self.ggml_type, data, out)
            .map_err(|e| WeightsError::tensor(self.path, self.name, e))
    }
}

/// An open GGUF file: parsed metadata and tensor index over a read-only map.
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    version: u32,
    metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn err(&self, what: impl std::fmt::Display) -> WeightsError {
        WeightsError::invalid(self.path, format!("{what} (at byte {})", self.pos))
    }
    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], WeightsError> {
        if n > self.remaining() {
            return Err(self.err(format_args!(
                "{what}: needs {n} bytes but only {} remain (truncated file?)",
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], WeightsError> {
        let b = self.bytes(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }
    fn u32(&mut self, what: &str) -> Result<u32, WeightsError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, WeightsError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn string(&mut self, what: &str) -> Result<String, WeightsError> {
        let len = self.u64(what)?;
        if len > MAX_STRING_BYTES {
            return Err(self.err(format_args!(
                "{what}: string length {len} exceeds the 1 GiB cap"
            )));
        }
        let b = self.bytes(len as usize, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|e| self.err(format_args!("{what}: string is not valid UTF-8 ({e})")))
    }
}

/// Smallest encoded size of one value of GGUF type `ty` (for array count checks).
fn min_value_bytes(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,     // string: u64 length
        9 => 4 + 8, // array: type + count
        10..=12 => 8,
        _ => return None,
    })
}

fn read_value(
    c: &mut Cursor<'_>,
    ty: u32,
    depth: usize,
    what: &str,
) -> Result<Value, WeightsError> {
    Ok(match ty {
        0 => Value::U8(c.array::<1>(what)?[0]),
        1 => Value::I8(c.array::<1>(what)?[0] as i8),
        2 => Value::U16(u16::from_le_bytes(c.array(what)?)),
        3 => Value::I16(i16::from_le_bytes(c.array(what)?)),
        4 => Value::U32(c.u32(what)?),
        5 => Value::I32(i32::from_le_bytes(c.array(what)?)),
        6 => Value::F32(f32::from_le_bytes(c.array(what)?)),
        7 => {
            let b = c.array::<1>(what)?[0];
            if b > 1 {
                return Err(c.err(format_args!("{what}: bool byte {b} is neither 0 nor 1")));
            }
            Value::Bool(b == 1)
        }
        8 => Value::String(c.string(what)?),
        9 => {
            if depth >= MAX_DEPTH {
                return Err(c.err(format_args!(
                    "{what}: arrays nested deeper than {MAX_DEPTH}"
                )));
            }
            let ety = c.u32(what)?;
            let min = min_value_bytes(ety)
                .ok_or_else(|| c.err(format_args!("{what}: unknown array element type {ety}")))?;
            let count = c.u64(what)?;
            // A declared count the rest of the file cannot hold is refused before allocating.
            if count > (c.remaining() / min) as u64 {
                return Err(c.err(format_args!(
                    "{what}: array declares {count} elements of type {ety}, but only {} bytes remain",
                    c.remaining()
                )));
            }
            let mut items = Vec::with_capacity(count as usize);
            for _ in 0..count {
                items.push(read_value(c, ety, depth + 1, what)?);
            }
            Value::Array(items)
        }
        10 => Value::U64(c.u64(what)?),
        11 => Value::I64(i64::from_le_bytes(c.array(what)?)),
        12 => Value::F64(f64::from_le_bytes(c.array(what)?)),
        _ => return Err(c.err(format_args!("{what}: unknown metadata value type {ty}"))),
    })
}

impl GgufFile {
    /// Open and validate a GGUF file (header, metadata, tensor index). Tensor data is not read.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, WeightsError> {
        let path = path.as_ref();
        let map = map_file(path)?;
        Self::parse(path.to_path_buf(), map)
    }

    fn parse(path: PathBuf, map: memmap2::Mmap) -> Result<GgufFile, WeightsError> {
        let (version, metadata, tensors, alignment, data_offset) = parse_header(&path, &map)?;
        let mut meta_index = HashMap::with_capacity(metadata.len());
        for (i, (k, _)) in metadata.iter().enumerate() {
            meta_index.insert(k.clone(), i);
        }
        let mut tensor_index = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            tensor_index.insert(t.name.clone(), i);
        }
        Ok(GgufFile {
            path,
            map,
            version,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    /// The file this was opened from (what errors name).
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }
    /// Data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// Byte offset of the tensor data section.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }
    /// Total file size.
    pub fn file_len(&self) -> usize {
        self.map.len()
    }
    /// Drop this process's resident pages of the mapping (they stay in the page cache and are
    /// re-read on the next access). Keeps the RSS of a streaming import bounded. Best effort.
    // madvise on a live mapping is unsafe by nature (memmap2::Mmap::unchecked_advise).
    #[allow(unsafe_code)]
    pub fn release_pages(&self) {
        // SAFETY: the mapping is a private, read-only, file-backed map that we never write, so
        // MADV_DONTNEED only discards clean pages; later reads fault them back in from the file
        // with the same contents. No reference into the map is invalidated.
        let _ = unsafe {
            self.map
                .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)
        };
    }
    /// All metadata in file order.
    pub fn metadata_entries(&self) -> &[(String, Value)] {
        &self.metadata
    }
    /// One metadata value.
    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
    /// A metadata value as u64 (any non-negative integer); `None` if absent or not one.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.metadata(key).and_then(Value::as_u64)
    }
    /// A metadata value as u32; `None` if absent, not an integer, or out of range.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.get_u64(key).and_then(|v| u32::try_from(v).ok())
    }
    /// A metadata value as i64 (any integer in range); `None` if absent or not one.
    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.metadata(key).and_then(Value::as_i64)
    }
    /// A numeric metadata value as f32 (rounded); `None` if absent or not numeric.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.metadata(key).and_then(Value::as_f64).map(|v| v as f32)
    }
    /// A numeric metadata value as f64; `None` if absent or not numeric.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.metadata(key).and_then(Value::as_f64)
    }
    /// A boolean (or 0/1 integer) metadata value; `None` if absent or not one.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.metadata(key).and_then(Value::as_bool)
    }
    /// A string metadata value; `None` if absent or not a string.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.metadata(key).and_then(Value::as_str)
    }
    /// An array metadata value's elements; `None` if absent or not an array.
    pub fn get_array(&self, key: &str) -> Option<&[Value]> {
        self.metadata(key).and_then(Value::as_array)
    }
    /// A metadata value that must be present and a non-negative integer.
    pub fn require_u64(&self, key: &str) -> Result<u64, WeightsError> {
        match self.metadata(key) {
            None => Err(WeightsError::invalid(
                &self.path,
                format!("metadata {key:?} missing"),
            )),
            Some(v) => v.as_u64().ok_or_else(|| {
                WeightsError::invalid(
                    &self.path,
                    format!(
                        "metadata {key:?} is {} {v:?}, expected an unsigned integer",
                        v.type_name()
                    ),
                )
            }),
        }
    }
    /// A metadata value that must be present and numeric.
    pub fn require_f64(&self, key: &str) -> Result<f64, WeightsError> {
        match self.metadata(key) {
            None => Err(WeightsError::invalid(
                &self.path,
                format!("metadata {key:?} missing"),
            )),
            Some(v) => v.as_f64().ok_or_else(|| {
                WeightsError::invalid(
                    &self.path,
                    format!("metadata {key:?} is {}, expected a number", v.type_name()),
                )
            }),
        }
    }
    /// `general.architecture` (e.g. `"llama"`).
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }
    /// All tensor-info records in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.tensors
    }
    /// A zero-copy view of a tensor.
    pub fn tensor(&self, name: &str) -> Option<GgufTensor<'_>> {
        let t = &self.tensors[*self.tensor_index.get(name)?];
        Some(self.view(t))
    }
    /// A tensor view, or an error naming the file and the tensor.
    pub fn require_tensor(&self, name: &str) -> Result<GgufTensor<'_>, WeightsError> {
        self.tensor(name)
            .ok_or_else(|| WeightsError::missing(&self.path, name))
    }
    fn view<'a>(&'a self, t: &'a TensorInfo) -> GgufTensor<'a> {
        // Bounds were validated in `parse_header`.
        let start = self.data_offset + t.offset as usize;
        GgufTensor {
            name: &t.name,
            ggml_type: t.ggml_type,
            shape: &t.shape,
            data: &self.map[start..start + t.size],
            path: &self.path,
        }
    }
}

type Header = (u32, Vec<(String, Value)>, Vec<TensorInfo>, u64, usize);

/// Parse a GGUF image held in memory and decode every decodable tensor, discarding the results.
/// For fuzzing and tests: exercises every check [`GgufFile::open`] makes, without a file.
pub fn check_bytes(buf: &[u8]) -> Result<(), WeightsError> {
    let path = Path::new("<memory>");
    let (_, _, tensors, _, data_offset) = parse_header(path, buf)?;
    for t in &tensors {
        if !t.ggml_type.can_decode() {
            continue;
        }
        let start = data_offset + t.offset as usize;
        let mut out = vec![0f32; t.elements() as usize];
        decode_f32(t.ggml_type, &buf[start..start + t.size], &mut out)
            .map_err(|e| WeightsError::tensor(path, &t.name, e))?;
    }
    Ok(())
}

fn parse_header(path: &Path, buf: &[u8]) -> Result<Header, WeightsError> {
    let mut c = Cursor { buf, pos: 0, path };
    let magic = c.u32("magic")?;
    if magic != GGUF_MAGIC {
        return Err(c.err(format_args!(
            "not a GGUF file: magic {magic:#010x}, expected {GGUF_MAGIC:#010x} (\"GGUF\")"
        )));
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(c.err(format_args!(
            "GGUF version {version} is not supported (2 and 3 are)"
        )));
    }
    let n_tensors = c.u64("tensor_count")?;
    let n_kv = c.u64("metadata_kv_count")?;
    // Smallest key-value: key length (8) + 1 byte key + type (4) + 1 byte value.
    if n_kv > (c.remaining() / 14) as u64 {
        return Err(c.err(format_args!(
            "metadata_kv_count {n_kv} cannot fit in the {} remaining bytes",
            c.remaining()
        )));
    }
    // Smallest tensor info: name length (8) + n_dims (4) + type (4) + offset (8).
    if n_tensors > (c.remaining() / 24) as u64 {
        return Err(c.err(format_args!(
            "tensor_count {n_tensors} cannot fit in the {} remaining bytes",
            c.remaining()
        )));
    }
    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv as usize);
    let mut seen = std::collections::HashSet::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let ty = c.u32(&format!("metadata {key:?} type"))?;
        let value = read_value(&mut c, ty, 0, &format!("metadata {key:?}"))?;
        if !seen.insert(key.clone()) {
            return Err(c.err(format_args!("duplicate metadata key {key:?}")));
        }
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => {
            let a = v.as_u64().unwrap_or(0);
            if a == 0 || !a.is_power_of_two() || a > (1 << 30) {
                return Err(WeightsError::invalid(
                    path,
                    format!("metadata \"general.alignment\" = {v:?} is not a power of two"),
                ));
            }
            a
        }
    };
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors as usize);
    let mut names = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor #{i} name"))?;
        let what = format!("tensor {name:?}");
        let n_dims = c.u32(&what)?;
        if n_dims as usize > MAX_DIMS {
            return Err(c.err(format_args!("{what}: {n_dims} dims (at most {MAX_DIMS})")));
        }
        let mut shape = Vec::with_capacity(n_dims as usize);
        let mut elems: u64 = 1;
        for _ in 0..n_dims {
            let d = c.u64(&what)?;
            if d > i64::MAX as u64 {
                return Err(c.err(format_args!("{what}: dimension {d} out of range")));
            }
            elems = elems
                .checked_mul(d)
                .filter(|&e| e <= i64::MAX as u64)
                .ok_or_else(|| c.err(format_args!("{what}: element count overflows")))?;
            shape.push(d);
        }
        let ty_id = c.u32(&what)?;
        let ggml_type = GgmlType::from_id(ty_id).ok_or_else(|| {
            c.err(format_args!(
                "{what}: unknown or unsupported ggml type {ty_id}"
            ))
        })?;
        let offset = c.u64(&what)?;
        let (be, bb) = ggml_type.block();
        let ne0 = shape.first().copied().unwrap_or(1);
        if ne0 % be as u64 != 0 {
            return Err(c.err(format_args!(
                "{what}: row length {ne0} is not a multiple of the {} block size {be}",
                ggml_type.name()
            )));
        }
        let size = (elems / be as u64)
            .checked_mul(bb as u64)
            .filter(|&s| s <= buf.len() as u64)
            .ok_or_else(|| c.err(format_args!("{what}: data size exceeds the file")))?;
        if offset % alignment != 0 {
            return Err(c.err(format_args!(
                "{what}: data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        if !names.insert(name.clone()) {
            return Err(c.err(format_args!("duplicate tensor name {name:?}")));
        }
        tensors.push(TensorInfo {
            name,
            shape,
            ggml_type,
            offset,
            size: size as usize,
        });
    }
    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    if data_offset > buf.len() as u64 && !tensors.is_empty() {
        return Err(WeightsError::invalid(
            path,
            format!(
                "data section would start at {data_offset}, past the end of the file ({} bytes)",
                buf.len()
            ),
        ));
    }
    for t in &tensors {
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.size as u64));
        match end {
            Some(e) if e <= buf.len() as u64 => {}
            _ => {
                return Err(WeightsError::invalid(
                    path,
                    format!(
                        "tensor {:?}: data [{}+{}, +{} bytes) lies outside the file ({} bytes; truncated?)",
                        t.name,
                        data_offset,
                        t.offset,
                        t.size,
                        buf.len()
                    ),
                ))
            }
        }
    }
    Ok((version, metadata, tensors, alignment, data_offset as usize))
}

/// Dequantize `data` of type `ty` into `out` (which must hold exactly the element count); see
/// [`crate::ggml::dequantize`].
pub fn decode_f32(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), String> {
    crate::ggml::dequantize(ty, data, out)
}
