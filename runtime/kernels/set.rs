//! A directory of kernel files, indexed by what they compute, and the shape lists that build them.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use super::elf::{self, KernelDesc};
use super::{ElfReason, KernelError};
use crate::tiles::WeightFormat;

/// The row family of a kernel: how many activation rows one pass of it takes at most. A pass of
/// ≤ 16 rows (decode, a verify pass) runs on `m16` kernels; longer ones (prefill) run as chunks of
/// ≤ 128 rows on `m128` kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RowFamily {
    /// Passes of at most 16 rows: decode steps and verify passes.
    M16,
    /// Passes of at most 128 rows: prefill chunks.
    M128,
}

impl RowFamily {
    /// Every family, smallest first.
    pub const ALL: [RowFamily; 2] = [RowFamily::M16, RowFamily::M128];

    /// Most rows of one pass of this family.
    pub const fn max_rows(self) -> usize {
        match self {
            RowFamily::M16 => 16,
            RowFamily::M128 => 128,
        }
    }

    /// The row count as kernel files and shape lists store it (16 or 128).
    pub const fn rows_u32(self) -> u32 {
        self.max_rows() as u32
    }

    /// The family whose row count is `rows` (16 or 128), as a file stores it.
    pub fn from_rows(rows: u32) -> Option<RowFamily> {
        RowFamily::ALL.into_iter().find(|f| f.rows_u32() == rows)
    }

    /// The family serving a pass of `rows` activation rows: `m16` for ≤ 16 rows, else `m128`
    /// (passes of more than 128 rows run as chunks of 128, see [`RowFamily::passes`]).
    pub fn for_rows(rows: usize) -> RowFamily {
        if rows <= RowFamily::M16.max_rows() {
            RowFamily::M16
        } else {
            RowFamily::M128
        }
    }

    /// How `rows` activation rows run: ≤ 16 rows as one `m16` pass, otherwise `m128` passes of up
    /// to 128 rows each (the last may be shorter). Yields (family, row range).
    pub fn passes(rows: usize) -> impl Iterator<Item = (RowFamily, std::ops::Range<usize>)> {
        let family = RowFamily::for_rows(rows);
        let chunk = family.max_rows();
        (0..rows)
            .step_by(chunk)
            .map(move |start| (family, start..(start + chunk).min(rows)))
    }

    /// `m16` or `m128`, as kernel file names spell it.
    pub fn name(self) -> &'static str {
        match self {
            RowFamily::M16 => "m16",
            RowFamily::M128 => "m128",
        }
    }
}

/// The row count (`16`, `128`), as shape lists and messages (`rows ≤ 16`) write it.
impl std::fmt::Display for RowFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.max_rows())
    }
}

/// Identity of a kernel: operation, weight format, row family, K, N.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelKey {
    /// Operation, e.g. `gemm`.
    pub op: String,
    /// Weight format, as [`WeightFormat::name`] writes it.
    pub wfmt: &'static str,
    /// Row family the kernel serves.
    pub family: RowFamily,
    /// Logical input features (columns of the weight matrix).
    pub k: u32,
    /// Output features (rows of the weight matrix).
    pub n: u32,
}

impl KernelKey {
    /// A GEMM key.
    pub fn gemm(wfmt: WeightFormat, family: RowFamily, k: usize, n: usize) -> KernelKey {
        KernelKey {
            op: "gemm".into(),
            wfmt: wfmt.name(),
            family,
            k: k as u32,
            n: n as u32,
        }
    }

    /// The key a descriptor provides.
    pub fn of(desc: &KernelDesc) -> KernelKey {
        KernelKey {
            op: desc.op.clone(),
            wfmt: desc.wfmt.name(),
            family: desc.family,
            k: desc.k,
            n: desc.n,
        }
    }

    /// The weight format.
    pub fn format(&self) -> WeightFormat {
        // `wfmt` only ever holds names produced by `WeightFormat::name`.
        WeightFormat::from_name(self.wfmt).unwrap_or(WeightFormat::F32)
    }

    /// `<op>_<wfmt>_m<family>_k<K>_n<N>.elf`.
    pub fn file_name(&self) -> String {
        elf::kernel_file_name(&self.op, self.format(), self.family, self.k, self.n)
    }

    /// The host-built descriptor for this key.
    pub fn descriptor(&self) -> KernelDesc {
        let mut desc = KernelDesc::gemm(self.format(), self.family, self.k, self.n);
        desc.op = self.op.clone();
        desc
    }
}

/// A kernel the model needs, and what needs it (for the error message).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelNeed {
    /// The kernel.
    pub key: KernelKey,
    /// E.g. `blk.0 qkv, rows ≤ 16`.
    pub what: String,
}

/// The kernels found in one directory.
#[derive(Debug, Default)]
pub struct KernelSet {
    dir: PathBuf,
    kernels: HashMap<KernelKey, (PathBuf, KernelDesc)>,
}

impl KernelSet {
    /// Load every `*.elf` in `dir`. A malformed file, or one whose name is not the canonical name
    /// of its descriptor, is an error naming the file.
    pub fn load(dir: impl AsRef<Path>) -> Result<KernelSet, KernelError> {
        let dir = dir.as_ref();
        let entries = std::fs::read_dir(dir).map_err(|e| KernelError::io(dir, e))?;
        let mut paths = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| KernelError::io(dir, e))?;
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "elf") {
                paths.push(path);
            }
        }
        paths.sort();
        let mut set = KernelSet {
            dir: dir.to_path_buf(),
            kernels: HashMap::new(),
        };
        for path in paths {
            let desc = elf::read_kernel(&path)?;
            let expected = desc.file_name();
            if path.file_name().and_then(|n| n.to_str()) != Some(expected.as_str()) {
                return Err(KernelError::elf(
                    &path,
                    ElfReason::BadDescriptor(format!(
                        "file name does not match its descriptor (expected {expected})"
                    )),
                ));
            }
            let key = KernelKey::of(&desc);
            if let Some((first, _)) = set.kernels.get(&key) {
                return Err(KernelError::Duplicate {
                    key: expected,
                    first: first.clone(),
                    second: path,
                });
            }
            set.kernels.insert(key, (path, desc));
        }
        Ok(set)
    }

    /// The directory this set was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of kernels.
    pub fn len(&self) -> usize {
        self.kernels.len()
    }

    /// Is the set empty?
    pub fn is_empty(&self) -> bool {
        self.kernels.is_empty()
    }

    /// The kernel for `key`, if present.
    pub fn get(&self, key: &KernelKey) -> Option<&KernelDesc> {
        self.kernels.get(key).map(|(_, d)| d)
    }

    /// The file of the kernel for `key`, if present.
    pub fn path(&self, key: &KernelKey) -> Option<&Path> {
        self.kernels.get(key).map(|(p, _)| p.as_path())
    }

    /// All kernels, sorted by key.
    pub fn iter(&self) -> impl Iterator<Item = (&KernelKey, &Path, &KernelDesc)> {
        let mut all: Vec<_> = self
            .kernels
            .iter()
            .map(|(k, (p, d))| (k, p.as_path(), d))
            .collect();
        all.sort_by(|a, b| a.0.cmp(b.0));
        all.into_iter()
    }

    /// Check every need is met; otherwise list every missing file (once, with what needs it).
    pub fn require(&self, needs: &[KernelNeed]) -> Result<(), KernelError> {
        let mut missing: BTreeMap<KernelKey, Vec<&str>> = BTreeMap::new();
        for need in needs {
            if !self.kernels.contains_key(&need.key) {
                missing
                    .entry(need.key.clone())
                    .or_default()
                    .push(&need.what);
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        let lines = missing
            .into_iter()
            .map(|(key, whats)| {
                let path = self.dir.join(key.file_name());
                let shown: Vec<&str> = whats.iter().take(3).copied().collect();
                let more = if whats.len() > 3 {
                    format!("; and {} more", whats.len() - 3)
                } else {
                    String::new()
                };
                format!(
                    "missing kernel {} ({}{more})",
                    path.display(),
                    shown.join("; ")
                )
            })
            .collect();
        Err(KernelError::Missing(lines))
    }
}

/// Parse a shape list: one kernel per line, `op wfmt family K N`; `#` comments and blank lines
/// are ignored.
pub fn parse_shape_list(path: &Path, text: &str) -> Result<Vec<KernelKey>, KernelError> {
    let mut keys = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |reason: String| KernelError::ShapeList {
            path: path.to_path_buf(),
            line: index + 1,
            reason,
        };
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [op, wfmt, family, k, n] = fields[..] else {
            return Err(bad(format!(
                "expected `op wfmt family K N`, got {} field(s)",
                fields.len()
            )));
        };
        if op.is_empty() || !op.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(bad(format!("bad op name {op:?}")));
        }
        let format = WeightFormat::from_name(wfmt).map_err(|e| bad(e.to_string()))?;
        let rows: u32 = family
            .trim_start_matches('m')
            .parse()
            .map_err(|_| bad(format!("bad family {family:?}")))?;
        let family = RowFamily::from_rows(rows)
            .ok_or_else(|| bad(format!("family {rows} (need 16 or 128)")))?;
        let number = |s: &str, what: &str| -> Result<u32, KernelError> {
            s.parse::<u32>()
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| bad(format!("bad {what} {s:?}")))
        };
        let k = number(k, "K")?;
        let n = number(n, "N")?;
        if format.tile_bytes().is_some() && n % 32 != 0 {
            return Err(bad(format!("N = {n} is not a multiple of 32 for {wfmt}")));
        }
        keys.push(KernelKey {
            op: op.to_string(),
            wfmt: format.name(),
            family,
            k,
            n,
        });
    }
    Ok(keys)
}

/// A kernel shape a model runs in every row family: operation, weight format, K, N, and what runs
/// it (for the error message). Whoever knows the model (the loader, the import, `xdna kernels
/// build`) lists these; the kernel set only sees shapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeNeed {
    /// Operation, e.g. `gemm`.
    pub op: String,
    /// Weight format of the matrix.
    pub format: WeightFormat,
    /// Logical input features (columns of the weight matrix).
    pub k: usize,
    /// Output features (rows of the weight matrix).
    pub n: usize,
    /// E.g. `blk.0 qkv`.
    pub what: String,
}

impl ShapeNeed {
    /// A GEMM of `[N, K]` weights in `format`.
    pub fn gemm(format: WeightFormat, k: usize, n: usize, what: impl Into<String>) -> ShapeNeed {
        ShapeNeed {
            op: "gemm".into(),
            format,
            k,
            n,
            what: what.into(),
        }
    }
}

/// The kernels `shapes` need: each shape in every row family (`what` gains `, rows ≤ 16`).
pub fn family_needs(shapes: &[ShapeNeed]) -> Vec<KernelNeed> {
    let mut needs = Vec::with_capacity(RowFamily::ALL.len() * shapes.len());
    for family in RowFamily::ALL {
        for shape in shapes {
            needs.push(KernelNeed {
                key: KernelKey {
                    op: shape.op.clone(),
                    wfmt: shape.format.name(),
                    family,
                    k: shape.k as u32,
                    n: shape.n as u32,
                },
                what: format!("{}, rows ≤ {family}", shape.what),
            });
        }
    }
    needs
}

/// The distinct kernel keys of a list of needs, sorted.
pub fn distinct_keys(needs: &[KernelNeed]) -> Vec<KernelKey> {
    let mut keys: Vec<KernelKey> = needs.iter().map(|n| n.key.clone()).collect();
    keys.sort();
    keys.dedup();
    keys
}
