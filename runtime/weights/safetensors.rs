//! Safetensors / Q4NX container: reader over a read-only map, and a streaming writer.
//!
//! Layout: `u64` LE header length N, N bytes of UTF-8 JSON, then the data section. Each JSON
//! entry is `{"dtype", "shape", "data_offsets": [begin, end]}` relative to the data section; the
//! optional `__metadata__` is a string → string map.
//!
//! Checks on open: N within the file, JSON valid, every entry well-formed with a known dtype,
//! offsets inside the data section, `dtype × shape = bytes`, no two tensors overlapping.
//!
//! Quantized Q4NX tensors are `I8` tile grids, `[n_tiles, chunk]` or `[out/32, in/256, chunk]`,
//! with the chunk size telling the tile type (see `runtime/tiles.rs`). Our own writer records in
//! `__metadata__`:
//! - `"xdna.scale_type"`: `"f16"` or `"bf16"` (file-level; FastFlowLM files have none → bf16),
//! - `"xdna.format.<tensor>"`: the [`WeightFormat::name`] of a tile grid (e.g. `"q41h"`),
//! - `"xdna.shape.<tensor>"`: the logical `"rows,cols"` of a tile grid.
//!
//! For FastFlowLM files (no metadata) the nibble order of 5120-byte chunks is detected once per
//! file (docs/formats.md, "Nibble order of FastFlowLM files"): a 4736-byte (Q4_K) chunk anywhere → "1.0.3" column-major; otherwise
//! a few q4_1 chunks are decoded both ways and the order in which more (row, group) cells hold
//! both a 0 and a 15 wins.

use super::{map_file, WeightsError};
use crate::tiles::{self, ScaleType, TileOrder, WeightFormat};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Largest JSON header accepted (safetensors' own limit is 100 MB).
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Safetensors element types (plus the legacy FastFlowLM `"Q4NX"` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `"BOOL"`: one byte per element.
    Bool,
    /// `"U8"`: unsigned byte.
    U8,
    /// `"I8"`: signed byte; also the element type of Q4NX tile grids.
    I8,
    /// `"I16"`.
    I16,
    /// `"U16"`.
    U16,
    /// `"F16"`: IEEE half float.
    F16,
    /// `"BF16"`: bfloat16.
    BF16,
    /// `"I32"`.
    I32,
    /// `"U32"`.
    U32,
    /// `"F32"`.
    F32,
    /// `"F64"`.
    F64,
    /// `"I64"`.
    I64,
    /// `"U64"`.
    U64,
    /// `"F8_E4M3"`: 8-bit float, 4 exponent and 3 mantissa bits.
    F8E4M3,
    /// `"F8_E5M2"`: 8-bit float, 5 exponent and 2 mantissa bits.
    F8E5M2,
    /// Legacy FastFlowLM label: logical `[M, K]` shape, 1.0.2 q4_1-layout 5120-byte chunks.
    Q4nx,
}

impl Dtype {
    /// The dtype of a header's `"dtype"` string; `None` if unknown.
    pub fn parse(s: &str) -> Option<Dtype> {
        use Dtype::*;
        Some(match s {
            "BOOL" => Bool,
            "U8" => U8,
            "I8" => I8,
            "I16" => I16,
            "U16" => U16,
            "F16" => F16,
            "BF16" => BF16,
            "I32" => I32,
            "U32" => U32,
            "F32" => F32,
            "F64" => F64,
            "I64" => I64,
            "U64" => U64,
            "F8_E4M3" => F8E4M3,
            "F8_E5M2" => F8E5M2,
            "Q4NX" => Q4nx,
            _ => return None,
        })
    }
    /// The header's `"dtype"` string for this dtype (inverse of [`Dtype::parse`]).
    pub fn name(self) -> &'static str {
        use Dtype::*;
        match self {
            Bool => "BOOL",
            U8 => "U8",
            I8 => "I8",
            I16 => "I16",
            U16 => "U16",
            F16 => "F16",
            BF16 => "BF16",
            I32 => "I32",
            U32 => "U32",
            F32 => "F32",
            F64 => "F64",
            I64 => "I64",
            U64 => "U64",
            F8E4M3 => "F8_E4M3",
            F8E5M2 => "F8_E5M2",
            Q4nx => "Q4NX",
        }
    }
    /// Bytes per element (for `Q4nx`: bytes per 32 × 256 logical block, see [`Dtype::byte_size`]).
    pub fn size(self) -> usize {
        use Dtype::*;
        match self {
            Bool | U8 | I8 | F8E4M3 | F8E5M2 => 1,
            I16 | U16 | F16 | BF16 => 2,
            I32 | U32 | F32 => 4,
            F64 | I64 | U64 => 8,
            Q4nx => tiles::Q41_TILE_BYTES,
        }
    }
    /// Bytes a tensor of this dtype and shape must occupy, if it does not overflow.
    pub fn byte_size(self, shape: &[usize]) -> Option<usize> {
        if self == Dtype::Q4nx {
            // Logical [M, K]: M/32 × ceil(K/256) chunks of 5120 bytes.
            if shape.len() != 2 || !shape[0].is_multiple_of(tiles::TILE_ROWS) {
                return None;
            }
            return (shape[0] / tiles::TILE_ROWS)
                .checked_mul(shape[1].div_ceil(tiles::TILE_COLS))?
                .checked_mul(tiles::Q41_TILE_BYTES);
        }
        shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))?
            .checked_mul(self.size())
    }
}

/// One tensor entry of the header.
#[derive(Clone, Debug)]
pub struct Entry {
    /// The tensor's name (the header key).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Absolute byte range in the file: first byte.
    pub start: usize,
    /// Absolute byte range in the file: one past the last byte.
    pub end: usize,
}

/// A zero-copy view of one tensor.
#[derive(Clone, Copy, Debug)]
pub struct StTensor<'a> {
    /// The tensor's name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: &'a [usize],
    /// The tensor's bytes, in place in the file's mapping.
    pub data: &'a [u8],
}

/// An open safetensors (Q4NX) file.
pub struct SafeTensors {
    path: PathBuf,
    map: memmap2::Mmap,
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    metadata: BTreeMap<String, String>,
    header_len: usize,
    scale: ScaleType,
    /// Detected (or recorded) code order of this file's tiles.
    order: TileOrder,
}

impl std::fmt::Debug for SafeTensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafeTensors")
            .field("path", &self.path)
            .field("tensors", &self.entries.len())
            .field("scale", &self.scale)
            .field("order", &self.order)
            .finish()
    }
}

/// A parsed header: entries (file order), `__metadata__`, header length N.
pub type Header = (Vec<Entry>, BTreeMap<String, String>, usize);

/// Parse and validate a header; returns (entries in file order, metadata, header length N).
pub fn parse_header(path: &Path, buf: &[u8]) -> Result<Header, WeightsError> {
    let inv = |what: String| WeightsError::invalid(path, what);
    if buf.len() < 8 {
        return Err(inv(format!(
            "file of {} bytes is too short for a safetensors header length",
            buf.len()
        )));
    }
    let mut n8 = [0u8; 8];
    n8.copy_from_slice(&buf[..8]);
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER_BYTES {
        return Err(inv(format!(
            "header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap"
        )));
    }
    if n > (buf.len() - 8) as u64 {
        return Err(inv(format!(
            "header length {n} runs past the end of the file ({} bytes; truncated?)",
            buf.len()
        )));
    }
    let n = n as usize;
    let text = std::str::from_utf8(&buf[8..8 + n])
        .map_err(|e| inv(format!("header is not valid UTF-8 ({e})")))?;
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| inv(format!("header is not valid JSON ({e})")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| inv("header JSON is not an object".into()))?;
    let data_start = 8 + n;
    let data_len = buf.len() - data_start;
    let mut metadata = BTreeMap::new();
    let mut entries = Vec::with_capacity(obj.len());
    for (name, v) in obj {
        if name == "__metadata__" {
            let m = v
                .as_object()
                .ok_or_else(|| inv("__metadata__ is not an object".into()))?;
            for (k, v) in m {
                let s = v
                    .as_str()
                    .ok_or_else(|| inv(format!("__metadata__ value {k:?} is not a string")))?;
                metadata.insert(k.clone(), s.to_string());
            }
            continue;
        }
        let what = |m: &str| inv(format!("tensor {name:?}: {m}"));
        let e = v
            .as_object()
            .ok_or_else(|| what("entry is not an object"))?;
        let dtype_s = e
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| what("missing string \"dtype\""))?;
        let dtype =
            Dtype::parse(dtype_s).ok_or_else(|| what(&format!("unknown dtype {dtype_s:?}")))?;
        let shape_v = e
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| what("missing array \"shape\""))?;
        let mut shape = Vec::with_capacity(shape_v.len());
        for d in shape_v {
            let d = d
                .as_u64()
                .and_then(|d| usize::try_from(d).ok())
                .ok_or_else(|| what(&format!("shape entry {d} is not a non-negative integer")))?;
            shape.push(d);
        }
        let offs = e
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .ok_or_else(|| what("missing [begin, end] \"data_offsets\""))?;
        let begin = offs[0]
            .as_u64()
            .ok_or_else(|| what("data_offsets begin is not an integer"))?;
        let end = offs[1]
            .as_u64()
            .ok_or_else(|| what("data_offsets end is not an integer"))?;
        if begin > end || end > data_len as u64 {
            return Err(what(&format!(
                "data_offsets [{begin}, {end}] outside the {data_len}-byte data section"
            )));
        }
        let expected = dtype
            .byte_size(&shape)
            .ok_or_else(|| what(&format!("shape {shape:?} is invalid for dtype {dtype_s}")))?;
        if (end - begin) as usize != expected {
            return Err(what(&format!(
                "dtype {dtype_s} × shape {shape:?} = {expected} bytes, but data_offsets span {}",
                end - begin
            )));
        }
        entries.push(Entry {
            name: name.clone(),
            dtype,
            shape,
            start: data_start + begin as usize,
            end: data_start + end as usize,
        });
    }
    let mut by_start: Vec<&Entry> = entries.iter().filter(|e| e.end > e.start).collect();
    by_start.sort_by_key(|e| (e.start, e.end));
    for w in by_start.windows(2) {
        if w[1].start < w[0].end {
            return Err(inv(format!(
                "tensors {:?} and {:?} overlap (bytes {}..{} and {}..{})",
                w[0].name, w[1].name, w[0].start, w[0].end, w[1].start, w[1].end
            )));
        }
    }
    Ok((entries, metadata, n))
}

impl SafeTensors {
    /// Open and validate a safetensors / Q4NX file.
    pub fn open(path: impl AsRef<Path>) -> Result<SafeTensors, WeightsError> {
        let path = path.as_ref();
        let map = map_file(path)?;
        let (entries, metadata, header_len) = parse_header(path, &map)?;
        let mut index = HashMap::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            index.insert(e.name.clone(), i);
        }
        let scale = match metadata.get("xdna.scale_type").map(String::as_str) {
            None | Some("bf16") => ScaleType::Bf16,
            Some("f16") => ScaleType::F16,
            Some(other) => {
                return Err(WeightsError::invalid(
                    path,
                    format!(
                    "__metadata__ \"xdna.scale_type\" = {other:?}, expected \"f16\" or \"bf16\""
                ),
                ))
            }
        };
        let mut st = SafeTensors {
            path: path.to_path_buf(),
            map,
            entries,
            index,
            metadata,
            header_len,
            scale,
            order: TileOrder::ColumnMajor,
        };
        st.order = st.detect_order();
        Ok(st)
    }

    /// The file this was opened from (what errors name).
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Every tensor entry of the header.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }
    /// The header's `__metadata__` (empty if absent).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }
    /// Bytes of the JSON header (N, without the 8-byte length before it).
    pub fn header_len(&self) -> usize {
        self.header_len
    }
    /// Total file size in bytes.
    pub fn file_len(&self) -> usize {
        self.map.len()
    }
    /// The whole file, as mapped (every tensor's bytes are a slice of it).
    pub fn file_bytes(&self) -> &[u8] {
        &self.map
    }
    /// Scale type of the tiles (from `xdna.scale_type`, default bf16).
    pub fn scale_type(&self) -> ScaleType {
        self.scale
    }
    /// Code order of the 5120/8704-byte tiles in this file.
    pub fn tile_order(&self) -> TileOrder {
        self.order
    }
    /// Whether the header names a tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }
    /// A zero-copy view of tensor `name`; `None` if the file has none of that name.
    pub fn tensor(&self, name: &str) -> Option<StTensor<'_>> {
        let e = &self.entries[*self.index.get(name)?];
        Some(StTensor {
            name: &e.name,
            dtype: e.dtype,
            shape: &e.shape,
            data: &self.map[e.start..e.end],
        })
    }

    /// Tile chunk size of an `I8` tile grid (last shape dim), if the tensor is one.
    fn chunk_of(e: &Entry) -> Option<usize> {
        if e.dtype == Dtype::I8 && (e.shape.len() == 2 || e.shape.len() == 3) {
            e.shape.last().copied()
        } else {
            None
        }
    }

    fn detect_order(&self) -> TileOrder {
        if let Some(f) = self.metadata.get("xdna.order") {
            if f == "lanes16" {
                return TileOrder::Lanes16;
            }
            return TileOrder::ColumnMajor;
        }
        if self.entries.iter().any(|e| {
            Self::chunk_of(e) == Some(tiles::Q4K_TILE_BYTES) && !e.name.contains("lm_head")
        }) {
            return TileOrder::ColumnMajor;
        }
        let mut votes = [0usize; 2]; // [column-major, lanes16]
        let mut sampled = 0;
        for e in &self.entries {
            if Self::chunk_of(e) != Some(tiles::Q41_TILE_BYTES) {
                continue;
            }
            let data = &self.map[e.start..e.end];
            if looks_like_legacy_q8(data) {
                continue;
            }
            for chunk in data.chunks_exact(tiles::Q41_TILE_BYTES).take(4) {
                votes[0] += full_range_cells(chunk, TileOrder::ColumnMajor);
                votes[1] += full_range_cells(chunk, TileOrder::Lanes16);
            }
            sampled += 1;
            if sampled >= 3 {
                break;
            }
        }
        if votes[1] > votes[0] {
            TileOrder::Lanes16
        } else {
            TileOrder::ColumnMajor
        }
    }

    /// The weight format of a tensor (tile grid or plain 2-D), or an error naming it.
    pub fn format_of(&self, name: &str) -> Result<WeightFormat, WeightsError> {
        let e = self
            .index
            .get(name)
            .map(|&i| &self.entries[i])
            .ok_or_else(|| WeightsError::missing(&self.path, name))?;
        if let Some(f) = self.metadata.get(&format!("xdna.format.{name}")) {
            return WeightFormat::from_name(f)
                .map_err(|err| WeightsError::tensor(&self.path, name, err.to_string()));
        }
        let (scale, order) = (self.scale, self.order);
        match e.dtype {
            Dtype::BF16 => Ok(WeightFormat::Bf16),
            Dtype::F16 => Ok(WeightFormat::F16),
            Dtype::F32 => Ok(WeightFormat::F32),
            Dtype::Q4nx => Err(WeightsError::tensor(
                &self.path,
                name,
                "legacy \"Q4NX\" dtype (zero-point dequant) is not supported; re-export with the I8 form",
            )),
            Dtype::I8 => match Self::chunk_of(e) {
                Some(tiles::Q41_TILE_BYTES) => {
                    let data = &self.map[e.start..e.end];
                    if looks_like_legacy_q8(data) {
                        Ok(WeightFormat::Q8Legacy)
                    } else if looks_like_q4_0(data, scale) {
                        Err(WeightsError::tensor(
                            &self.path,
                            name,
                            "q4_0 chunks (all mins zero, signed scales) are not supported",
                        ))
                    } else {
                        Ok(WeightFormat::Q41 { scale, order })
                    }
                }
                Some(tiles::Q8_TILE_BYTES) => Ok(WeightFormat::Q8 { scale, order }),
                Some(tiles::Q4K_TILE_BYTES) => Ok(WeightFormat::Q4K),
                Some(c) => Err(WeightsError::tensor(
                    &self.path,
                    name,
                    format!("unsupported tile chunk size {c} bytes (known: 5120, 4736, 8704)"),
                )),
                None => Err(WeightsError::tensor(
                    &self.path,
                    name,
                    format!("I8 tensor of shape {:?} is not a tile grid", e.shape),
                )),
            },
            d => Err(WeightsError::tensor(
                &self.path,
                name,
                format!("dtype {} is not a weight matrix format", d.name()),
            )),
        }
    }

    /// The logical `(rows, cols)` recorded by our writer (`xdna.shape.<name>`), if any.
    pub fn recorded_shape(&self, name: &str) -> Option<(usize, usize)> {
        let s = self.metadata.get(&format!("xdna.shape.{name}"))?;
        let (r, c) = s.split_once(',')?;
        Some((r.trim().parse().ok()?, c.trim().parse().ok()?))
    }
}

/// Legacy 32×128 q8 tile (FLM_Q4NX_Converter `_pack_q4nx_8b`): 128 scales `[0, 256)` repeated
/// in the "min" slot `[256, 512)`, codes `[512, 4608)`, and the last 512 bytes zero.
fn looks_like_legacy_q8(data: &[u8]) -> bool {
    let mut any = false;
    for c in data.chunks_exact(tiles::Q41_TILE_BYTES).take(4) {
        if c[4608..].iter().any(|&b| b != 0) || c[..256] != c[256..512] {
            return false;
        }
        any = true;
    }
    any
}

/// q4_0 in 5120-byte chunks: every min zero and some scale negative.
fn looks_like_q4_0(data: &[u8], scale: ScaleType) -> bool {
    let mut neg = false;
    for c in data.chunks_exact(tiles::Q41_TILE_BYTES).take(4) {
        if c[512..1024].iter().any(|&b| b != 0) {
            return false;
        }
        neg |= c[..512]
            .chunks_exact(2)
            .any(|s| tiles::scale_to_f32(scale, u16::from_le_bytes([s[0], s[1]])) < 0.0);
    }
    neg
}

/// Number of (group, row) cells whose 32 codes contain both 0 and 15 when read in `order`.
pub fn full_range_cells(chunk: &[u8], order: TileOrder) -> usize {
    let codes = &chunk[tiles::Q41_CODES..];
    let mut n = 0;
    for g in 0..tiles::GROUPS {
        for r in 0..tiles::TILE_ROWS {
            let (mut lo, mut hi) = (false, false);
            for i in 0..tiles::GROUP {
                let (byte, high) = tiles::q4_code_pos(order, r, g * tiles::GROUP + i);
                let b = codes[byte];
                let q = if high { b >> 4 } else { b & 0x0F };
                lo |= q == 0;
                hi |= q == 15;
            }
            n += (lo && hi) as usize;
        }
    }
    n
}

/// One tensor to be written: name, dtype, shape (bytes follow from them).
#[derive(Clone, Debug)]
pub struct Declared {
    /// The tensor's name (the header key).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
}

/// Streaming safetensors writer: declare every tensor, then write their bytes in declared
/// order (in as many pieces as convenient). Memory stays bounded by what the caller holds.
/// Writes a temporary file beside `path` and renames it into place on [`Writer::finish`]; a
/// writer dropped unfinished (an error, a missing tensor) removes its temporary file.
pub struct Writer {
    path: PathBuf,
    tmp: PathBuf,
    out: std::io::BufWriter<tempfile::NamedTempFile>,
    sizes: Vec<(String, usize)>,
    current: usize,
    written_in_current: usize,
}

impl Writer {
    /// Create the file and write the header for `tensors` (in this order) and `metadata`.
    pub fn create(
        path: impl AsRef<Path>,
        tensors: &[Declared],
        metadata: &BTreeMap<String, String>,
    ) -> Result<Writer, WeightsError> {
        let path = path.as_ref().to_path_buf();
        let mut header = serde_json::Map::new();
        if !metadata.is_empty() {
            header.insert(
                "__metadata__".into(),
                serde_json::Value::Object(
                    metadata
                        .iter()
                        .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                        .collect(),
                ),
            );
        }
        let mut offset = 0usize;
        let mut sizes = Vec::with_capacity(tensors.len());
        for t in tensors {
            let size = t.dtype.byte_size(&t.shape).ok_or_else(|| {
                WeightsError::tensor(
                    &path,
                    &t.name,
                    format!("shape {:?} invalid for {}", t.shape, t.dtype.name()),
                )
            })?;
            if header.contains_key(&t.name) {
                return Err(WeightsError::tensor(&path, &t.name, "declared twice"));
            }
            header.insert(
                t.name.clone(),
                serde_json::json!({
                    "dtype": t.dtype.name(),
                    "shape": t.shape,
                    "data_offsets": [offset, offset + size],
                }),
            );
            offset += size;
            sizes.push((t.name.clone(), size));
        }
        let mut json = serde_json::to_vec(&serde_json::Value::Object(header))
            .map_err(|e| WeightsError::invalid(&path, format!("header encoding: {e}")))?;
        while json.len() % 8 != 0 {
            json.push(b' ');
        }
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let prefix = path.file_name().map_or_else(
            || std::ffi::OsString::from("."),
            |n| {
                let mut p = std::ffi::OsString::from(".");
                p.push(n);
                p.push(".");
                p
            },
        );
        let file = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(".tmp")
            .tempfile_in(dir)
            .map_err(|e| WeightsError::io(&path, e))?;
        let tmp = file.path().to_path_buf();
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        out.write_all(&(json.len() as u64).to_le_bytes())
            .and_then(|_| out.write_all(&json))
            .map_err(|e| WeightsError::io(&tmp, e))?;
        Ok(Writer {
            path,
            tmp,
            out,
            sizes,
            current: 0,
            written_in_current: 0,
        })
    }

    /// Name of the tensor whose bytes are expected next, if any.
    pub fn expecting(&self) -> Option<&str> {
        self.sizes.get(self.current).map(|(n, _)| n.as_str())
    }

    /// Append bytes of tensor `name` (must be the one expected next).
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> Result<(), WeightsError> {
        let Some((expected, size)) = self.sizes.get(self.current) else {
            return Err(WeightsError::tensor(
                &self.path,
                name,
                "written after all declared tensors",
            ));
        };
        if expected != name {
            return Err(WeightsError::tensor(
                &self.path,
                name,
                format!("written out of order (expected {expected:?})"),
            ));
        }
        if self.written_in_current + bytes.len() > *size {
            return Err(WeightsError::tensor(
                &self.path,
                name,
                format!("more than the declared {size} bytes written"),
            ));
        }
        self.out
            .write_all(bytes)
            .map_err(|e| WeightsError::io(&self.tmp, e))?;
        self.written_in_current += bytes.len();
        if self.written_in_current == *size {
            self.current += 1;
            self.written_in_current = 0;
            // Skip zero-sized tensors.
            while self.sizes.get(self.current).is_some_and(|(_, s)| *s == 0) {
                self.current += 1;
            }
        }
        Ok(())
    }

    /// Check that every tensor was written in full, flush, and rename into place.
    pub fn finish(mut self) -> Result<PathBuf, WeightsError> {
        while self.sizes.get(self.current).is_some_and(|(_, s)| *s == 0) {
            self.current += 1;
        }
        if let Some((name, size)) = self.sizes.get(self.current) {
            return Err(WeightsError::tensor(
                &self.path,
                name,
                format!("only {} of {size} bytes written", self.written_in_current),
            ));
        }
        self.out
            .flush()
            .map_err(|e| WeightsError::io(&self.tmp, e))?;
        let file = self
            .out
            .into_inner()
            .map_err(|e| WeightsError::io(&self.tmp, e.into_error()))?;
        file.as_file()
            .sync_all()
            .map_err(|e| WeightsError::io(&self.tmp, e))?;
        file.persist(&self.path)
            .map_err(|e| WeightsError::io(&self.path, e.error))?;
        Ok(self.path)
    }
}
