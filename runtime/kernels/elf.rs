//! Kernel ELF files: write, read and wrap (format in `docs/kernel-elf.md`).
//!
//! A kernel file is an ELF64 little-endian file with `EI_OSABI` 69 (AIE2P) following the "full ELF"
//! conventions (`docs/protocol.md` §8) plus the project note `.note.xdna.kernel`, whose descriptor
//! says what the kernel computes. Files built here carry the descriptor and the XRT configuration
//! note only; toolchain-built files keep their `.ctrltext`/`.ctrldata`/`.pdi.N`/`.dyn*` sections and
//! get the note appended by [`wrap_elf`].
//!
//! The reader is a hand-written, bounds-checked parser: every offset and size is checked against the
//! file before use, and a malformed file is rejected with an [`ElfReason`] naming the rule it broke.

use std::path::Path;

use super::set::RowFamily;
use super::{ElfReason, KernelError};
use crate::tiles::WeightFormat;

/// `EI_OSABI` of AIE2P kernels.
pub const OSABI_AIE2P: u8 = 69;
/// Name of the project descriptor section.
pub const DESCRIPTOR_SECTION: &str = ".note.xdna.kernel";
/// Name of the XRT configuration note (first u32 of its descriptor = partition columns).
pub const CONFIG_SECTION: &str = ".note.xrt.configuration";
/// Descriptor format version written and understood by this code.
pub const DESCRIPTOR_VERSION: u32 = 1;
/// Partition columns requested by kernels built here (the host ignores it).
pub const DEFAULT_PARTITION_COLUMNS: u32 = 4;

const NOTE_TYPE_DESCRIPTOR: u32 = 1;
const NOTE_TYPE_CONFIG: u32 = 1;
const NOTE_NAME_XDNA: &str = "XDNA";
const NOTE_NAME_XRT: &str = "XRT";
const FLAG_CONTROL_CODE: u32 = 1;

const SHT_PROGBITS: u32 = 1;
const SHT_STRTAB: u32 = 3;
const SHT_NOTE: u32 = 7;
const SHT_NOBITS: u32 = 8;
const EHDR_SIZE: usize = 64;
const SHDR_SIZE: usize = 64;

/// Direction of a kernel argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgDirection {
    /// The kernel only reads it.
    In,
    /// The kernel only writes it.
    Out,
    /// The kernel reads and writes it.
    InOut,
}

/// What a kernel argument holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgRole {
    /// The weight matrix (tile grid).
    Weight,
    /// Activations in.
    Activation,
    /// Results out.
    Output,
    /// Temporary device memory.
    Scratch,
}

/// One argument of a kernel, in call order (argument index = position).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelArg {
    /// Short name, e.g. `w`, `x`, `y`.
    pub name: String,
    /// Whether the kernel reads it, writes it or both.
    pub direction: ArgDirection,
    /// What the buffer holds.
    pub role: ArgRole,
}

/// What a kernel file says about itself (the `.note.xdna.kernel` descriptor).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelDesc {
    /// Operation, e.g. `gemm`.
    pub op: String,
    /// Weight storage format.
    pub wfmt: WeightFormat,
    /// Row family: `m16` (decode / verify) or `m128` (prefill chunk); stored as its row count.
    pub family: RowFamily,
    /// Logical input features.
    pub k: u32,
    /// Output features.
    pub n: u32,
    /// Arguments in call order.
    pub args: Vec<KernelArg>,
    /// Does the file carry AIE control code (`.ctrltext`)? Host-built kernels do not.
    pub has_control_code: bool,
    /// Partition size in columns (from `.note.xrt.configuration`).
    pub partition_columns: u32,
}

impl KernelDesc {
    /// A host-built GEMM descriptor with the standard arguments `w`, `x`, `y`.
    pub fn gemm(wfmt: WeightFormat, family: RowFamily, k: u32, n: u32) -> KernelDesc {
        KernelDesc {
            op: "gemm".to_string(),
            wfmt,
            family,
            k,
            n,
            args: vec![
                KernelArg {
                    name: "w".into(),
                    direction: ArgDirection::In,
                    role: ArgRole::Weight,
                },
                KernelArg {
                    name: "x".into(),
                    direction: ArgDirection::In,
                    role: ArgRole::Activation,
                },
                KernelArg {
                    name: "y".into(),
                    direction: ArgDirection::Out,
                    role: ArgRole::Output,
                },
            ],
            has_control_code: false,
            partition_columns: DEFAULT_PARTITION_COLUMNS,
        }
    }

    /// The file name this kernel must have: `<op>_<wfmt>_m<rows>_k<K>_n<N>.elf`.
    pub fn file_name(&self) -> String {
        kernel_file_name(&self.op, self.wfmt, self.family, self.k, self.n)
    }

    /// Encode the descriptor (the note's payload).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&DESCRIPTOR_VERSION.to_le_bytes());
        let flags = if self.has_control_code {
            FLAG_CONTROL_CODE
        } else {
            0
        };
        for v in [flags, self.family.rows_u32(), self.k, self.n] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        put_str(&mut out, &self.op);
        put_str(&mut out, self.wfmt.name());
        out.extend_from_slice(&(self.args.len() as u16).to_le_bytes());
        for arg in &self.args {
            put_str(&mut out, &arg.name);
            out.push(match arg.direction {
                ArgDirection::In => 0,
                ArgDirection::Out => 1,
                ArgDirection::InOut => 2,
            });
            out.push(match arg.role {
                ArgRole::Weight => 0,
                ArgRole::Activation => 1,
                ArgRole::Output => 2,
                ArgRole::Scratch => 3,
            });
        }
        out
    }

    /// Decode a descriptor payload; `partition_columns` is filled in by the caller.
    pub fn decode(bytes: &[u8]) -> Result<KernelDesc, ElfReason> {
        let mut cur = Cursor { bytes, at: 0 };
        let version = cur.u32()?;
        if version != DESCRIPTOR_VERSION {
            return Err(ElfReason::UnknownDescriptorVersion(version));
        }
        let flags = cur.u32()?;
        let family = cur.u32()?;
        let k = cur.u32()?;
        let n = cur.u32()?;
        let op = cur.str()?;
        let wfmt_name = cur.str()?;
        let wfmt = WeightFormat::from_name(&wfmt_name).map_err(|_| {
            ElfReason::BadDescriptor(format!("unknown weight format {wfmt_name:?}"))
        })?;
        let nargs = cur.u16()?;
        let mut args = Vec::with_capacity(nargs as usize);
        for _ in 0..nargs {
            let name = cur.str()?;
            let direction = match cur.u8()? {
                0 => ArgDirection::In,
                1 => ArgDirection::Out,
                2 => ArgDirection::InOut,
                d => return Err(ElfReason::BadDescriptor(format!("argument direction {d}"))),
            };
            let role = match cur.u8()? {
                0 => ArgRole::Weight,
                1 => ArgRole::Activation,
                2 => ArgRole::Output,
                3 => ArgRole::Scratch,
                r => return Err(ElfReason::BadDescriptor(format!("argument role {r}"))),
            };
            args.push(KernelArg {
                name,
                direction,
                role,
            });
        }
        let family = RowFamily::from_rows(family).ok_or_else(|| {
            ElfReason::BadDescriptor(format!("row family {family} (need 16 or 128)"))
        })?;
        if op.is_empty() || !op.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(ElfReason::BadDescriptor(format!("op name {op:?}")));
        }
        Ok(KernelDesc {
            op,
            wfmt,
            family,
            k,
            n,
            args,
            has_control_code: flags & FLAG_CONTROL_CODE != 0,
            partition_columns: DEFAULT_PARTITION_COLUMNS,
        })
    }
}

/// `<op>_<wfmt>_m<rows>_k<K>_n<N>.elf`.
pub fn kernel_file_name(op: &str, wfmt: WeightFormat, family: RowFamily, k: u32, n: u32) -> String {
    format!("{op}_{}_{}_k{k}_n{n}.elf", wfmt.name(), family.name())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], ElfReason> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(ElfReason::BadDescriptor(format!(
                "truncated at byte {} (need {n} more)",
                self.at
            )));
        };
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, ElfReason> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, ElfReason> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, ElfReason> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn str(&mut self) -> Result<String, ElfReason> {
        let n = self.u16()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| ElfReason::BadDescriptor("string is not UTF-8".into()))
    }
}

/// Encode an ELF note: namesz, descsz, type, name (NUL, padded to 4), desc (padded to 4).
fn encode_note(name: &str, note_type: u32, desc: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(name.len() as u32 + 1).to_le_bytes());
    out.extend_from_slice(&(desc.len() as u32).to_le_bytes());
    out.extend_from_slice(&note_type.to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad_to(&mut out, 4);
    out.extend_from_slice(desc);
    pad_to(&mut out, 4);
    out
}

/// The descriptor of the first note in `section` (name, type, desc).
fn decode_note(section: &[u8]) -> Result<(String, u32, &[u8]), ElfReason> {
    let bad = |what: &str| ElfReason::BadDescriptor(format!("note {what}"));
    if section.len() < 12 {
        return Err(bad("header truncated"));
    }
    let word = |i: usize| {
        u32::from_le_bytes([
            section[4 * i],
            section[4 * i + 1],
            section[4 * i + 2],
            section[4 * i + 3],
        ]) as usize
    };
    let (namesz, descsz, note_type) = (word(0), word(1), word(2) as u32);
    let name_end = 12usize
        .checked_add(namesz)
        .filter(|&e| e <= section.len())
        .ok_or_else(|| bad("name truncated"))?;
    let name_bytes = &section[12..name_end];
    let name =
        String::from_utf8_lossy(name_bytes.strip_suffix(&[0]).unwrap_or(name_bytes)).into_owned();
    let desc_start = name_end.div_ceil(4) * 4;
    let desc_end = desc_start
        .checked_add(descsz)
        .filter(|&e| e <= section.len())
        .ok_or_else(|| bad("descriptor truncated"))?;
    Ok((name, note_type, &section[desc_start..desc_end]))
}

fn pad_to(out: &mut Vec<u8>, align: usize) {
    while !out.len().is_multiple_of(align) {
        out.push(0);
    }
}

/// A section to write.
#[derive(Clone, Debug)]
pub struct SectionSpec {
    /// Section name, e.g. `.note.xdna.kernel`.
    pub name: String,
    /// ELF section type (`SHT_*`).
    pub sh_type: u32,
    /// ELF section flags (`SHF_*`).
    pub flags: u64,
    /// Alignment of the contents in the file, in bytes (0 or 1: none).
    pub align: u64,
    /// The contents.
    pub data: Vec<u8>,
}

/// Write an ELF64 LE file with the given sections (plus the null section and `.shstrtab`).
/// Output depends only on the input: no timestamps, no addresses.
pub fn write_elf(sections: &[SectionSpec]) -> Vec<u8> {
    let mut shstrtab = vec![0u8];
    let mut name_offsets = Vec::with_capacity(sections.len());
    for s in sections {
        name_offsets.push(shstrtab.len() as u32);
        shstrtab.extend_from_slice(s.name.as_bytes());
        shstrtab.push(0);
    }
    let shstrtab_name = shstrtab.len() as u32;
    shstrtab.extend_from_slice(b".shstrtab\0");

    let mut out = vec![0u8; EHDR_SIZE];
    let mut headers = vec![[0u8; SHDR_SIZE]];
    for (s, &name) in sections.iter().zip(&name_offsets) {
        pad_to(&mut out, s.align.max(1) as usize);
        let offset = out.len() as u64;
        out.extend_from_slice(&s.data);
        headers.push(section_header(
            name,
            s.sh_type,
            s.flags,
            offset,
            s.data.len() as u64,
            0,
            0,
            s.align,
            0,
        ));
    }
    let shstrtab_offset = out.len() as u64;
    out.extend_from_slice(&shstrtab);
    headers.push(section_header(
        shstrtab_name,
        SHT_STRTAB,
        0,
        shstrtab_offset,
        shstrtab.len() as u64,
        0,
        0,
        1,
        0,
    ));
    pad_to(&mut out, 8);
    let shoff = out.len() as u64;
    for h in &headers {
        out.extend_from_slice(h);
    }
    let header = elf_header(shoff, headers.len() as u16, (headers.len() - 1) as u16);
    out[..EHDR_SIZE].copy_from_slice(&header);
    out
}

fn elf_header(shoff: u64, shnum: u16, shstrndx: u16) -> [u8; EHDR_SIZE] {
    let mut h = [0u8; EHDR_SIZE];
    h[..4].copy_from_slice(b"\x7fELF");
    h[4] = 2; // ELFCLASS64
    h[5] = 1; // little-endian
    h[6] = 1; // EV_CURRENT
    h[7] = OSABI_AIE2P;
    h[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    h[20..24].copy_from_slice(&1u32.to_le_bytes()); // e_version
    h[40..48].copy_from_slice(&shoff.to_le_bytes());
    h[52..54].copy_from_slice(&(EHDR_SIZE as u16).to_le_bytes());
    h[58..60].copy_from_slice(&(SHDR_SIZE as u16).to_le_bytes());
    h[60..62].copy_from_slice(&shnum.to_le_bytes());
    h[62..64].copy_from_slice(&shstrndx.to_le_bytes());
    h
}

#[allow(clippy::too_many_arguments)] // one argument per Elf64_Shdr field
fn section_header(
    name: u32,
    sh_type: u32,
    flags: u64,
    offset: u64,
    size: u64,
    link: u32,
    info: u32,
    align: u64,
    entsize: u64,
) -> [u8; SHDR_SIZE] {
    let mut h = [0u8; SHDR_SIZE];
    h[0..4].copy_from_slice(&name.to_le_bytes());
    h[4..8].copy_from_slice(&sh_type.to_le_bytes());
    h[8..16].copy_from_slice(&flags.to_le_bytes());
    h[24..32].copy_from_slice(&offset.to_le_bytes());
    h[32..40].copy_from_slice(&size.to_le_bytes());
    h[40..44].copy_from_slice(&link.to_le_bytes());
    h[44..48].copy_from_slice(&info.to_le_bytes());
    h[48..56].copy_from_slice(&align.to_le_bytes());
    h[56..64].copy_from_slice(&entsize.to_le_bytes());
    h
}

/// The bytes of a host-built kernel file for `desc`.
pub fn build_kernel_elf(desc: &KernelDesc) -> Vec<u8> {
    let mut desc = desc.clone();
    desc.has_control_code = false;
    write_elf(&[
        SectionSpec {
            name: CONFIG_SECTION.into(),
            sh_type: SHT_NOTE,
            flags: 0,
            align: 4,
            data: encode_note(
                NOTE_NAME_XRT,
                NOTE_TYPE_CONFIG,
                &desc.partition_columns.to_le_bytes(),
            ),
        },
        SectionSpec {
            name: DESCRIPTOR_SECTION.into(),
            sh_type: SHT_NOTE,
            flags: 0,
            align: 4,
            data: encode_note(NOTE_NAME_XDNA, NOTE_TYPE_DESCRIPTOR, &desc.encode()),
        },
    ])
}

/// One section of a parsed file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SectionInfo {
    /// Section name (empty for the null section 0).
    pub name: String,
    /// ELF section type (`SHT_*`).
    pub sh_type: u32,
    /// Byte offset of the contents in the file (0 for the null section and `SHT_NOBITS`).
    pub offset: usize,
    /// Bytes of contents in the file (0 for the null section and `SHT_NOBITS`).
    pub size: usize,
}

/// A validated ELF file: its section table.
#[derive(Clone, Debug)]
pub struct ParsedElf {
    /// Every section, in section-table order (index 0 is the null section).
    pub sections: Vec<SectionInfo>,
    shoff: usize,
    shnum: usize,
    shstrndx: usize,
}

impl ParsedElf {
    /// The section called `name`, if any.
    pub fn section(&self, name: &str) -> Option<&SectionInfo> {
        self.sections.iter().find(|s| s.name == name)
    }
}

fn read_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Validate the ELF structure: identification, header, section table, section bounds, no overlaps.
pub fn parse_elf(bytes: &[u8]) -> Result<ParsedElf, ElfReason> {
    if bytes.len() < 4 || &bytes[..4] != b"\x7fELF" {
        return Err(ElfReason::BadMagic);
    }
    if bytes.len() < EHDR_SIZE {
        return Err(ElfReason::Truncated(format!(
            "ELF header needs {EHDR_SIZE} bytes, file has {}",
            bytes.len()
        )));
    }
    if bytes[4] != 2 || bytes[5] != 1 {
        return Err(ElfReason::BadClass(bytes[4]));
    }
    if bytes[7] != OSABI_AIE2P {
        return Err(ElfReason::WrongOsAbi(bytes[7]));
    }
    let shoff = read_u64(bytes, 40);
    let shentsize = read_u16(bytes, 58) as usize;
    let shnum = read_u16(bytes, 60) as usize;
    let shstrndx = read_u16(bytes, 62) as usize;
    if shnum == 0 {
        return Err(ElfReason::Truncated("no section header table".into()));
    }
    if shentsize != SHDR_SIZE {
        return Err(ElfReason::Truncated(format!(
            "section header size {shentsize} (need {SHDR_SIZE})"
        )));
    }
    let table_end = usize::try_from(shoff)
        .ok()
        .and_then(|o| o.checked_add(shnum * SHDR_SIZE).map(|e| (o, e)))
        .filter(|&(o, e)| o >= EHDR_SIZE && e <= bytes.len());
    let Some((shoff, table_end)) = table_end else {
        return Err(ElfReason::Truncated(format!(
            "section header table ({shnum} entries at {shoff}) past end of file ({} bytes)",
            bytes.len()
        )));
    };
    if shstrndx >= shnum {
        return Err(ElfReason::Truncated(format!(
            "section name table index {shstrndx} ≥ {shnum} sections"
        )));
    }
    // Index 0 is SHN_UNDEF, "no name table", and section 0 is the null section with no
    // contents (read as empty below): names read from it and the table `wrap_elf` copies would
    // disagree, and a wrapped file could then name one of the input's notes the descriptor.
    if shstrndx == 0 {
        return Err(ElfReason::BadSectionNameTable(
            "e_shstrndx is 0 (SHN_UNDEF): the file has no section name table".into(),
        ));
    }
    struct Raw {
        name: u32,
        sh_type: u32,
        offset: u64,
        size: u64,
    }
    let raw: Vec<Raw> = (0..shnum)
        .map(|i| {
            let h = &bytes[shoff + i * SHDR_SIZE..shoff + (i + 1) * SHDR_SIZE];
            Raw {
                name: read_u32(h, 0),
                sh_type: read_u32(h, 4),
                offset: read_u64(h, 24),
                size: read_u64(h, 32),
            }
        })
        .collect();
    let in_file = |offset: u64, size: u64| -> Option<(usize, usize)> {
        let o = usize::try_from(offset).ok()?;
        let s = usize::try_from(size).ok()?;
        let e = o.checked_add(s)?;
        (e <= bytes.len()).then_some((o, s))
    };
    let strtab = &raw[shstrndx];
    // Names are read from this table and `wrap_elf` copies it: both need real bytes of type
    // SHT_STRTAB (a NOBITS "table" has none in the file).
    if strtab.sh_type != SHT_STRTAB {
        return Err(ElfReason::BadSectionNameTable(format!(
            "section {shstrndx} has type {}, not SHT_STRTAB ({SHT_STRTAB})",
            strtab.sh_type
        )));
    }
    let Some((str_off, str_size)) = in_file(strtab.offset, strtab.size) else {
        return Err(ElfReason::SectionOutOfBounds(".shstrtab".into()));
    };
    let names = &bytes[str_off..str_off + str_size];
    let name_at = |at: u32| -> Result<String, ElfReason> {
        let at = at as usize;
        let tail = names
            .get(at..)
            .ok_or_else(|| ElfReason::Truncated(format!("section name offset {at}")))?;
        let end = tail
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| ElfReason::Truncated("unterminated section name".into()))?;
        Ok(String::from_utf8_lossy(&tail[..end]).into_owned())
    };
    let mut sections = Vec::with_capacity(shnum);
    for (i, r) in raw.iter().enumerate() {
        let name = if i == 0 {
            String::new()
        } else {
            name_at(r.name)?
        };
        let (offset, size) = if r.sh_type == SHT_NOBITS || i == 0 {
            (0, 0)
        } else {
            in_file(r.offset, r.size).ok_or_else(|| ElfReason::SectionOutOfBounds(name.clone()))?
        };
        sections.push(SectionInfo {
            name,
            sh_type: r.sh_type,
            offset,
            size,
        });
    }
    // No two regions of the file may overlap: header, section table, section contents.
    let mut regions: Vec<(usize, usize, String)> = sections
        .iter()
        .filter(|s| s.size > 0)
        .map(|s| (s.offset, s.offset + s.size, s.name.clone()))
        .collect();
    regions.push((0, EHDR_SIZE, "ELF header".into()));
    regions.push((shoff, table_end, "section header table".into()));
    regions.sort();
    for pair in regions.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(ElfReason::OverlappingSections(
                pair[0].2.clone(),
                pair[1].2.clone(),
            ));
        }
    }
    Ok(ParsedElf {
        sections,
        shoff,
        shnum,
        shstrndx,
    })
}

/// Parse a kernel file's bytes into its descriptor.
pub fn read_kernel_bytes(bytes: &[u8]) -> Result<KernelDesc, ElfReason> {
    let elf = parse_elf(bytes)?;
    let section = elf
        .section(DESCRIPTOR_SECTION)
        .ok_or(ElfReason::MissingDescriptor)?;
    let (name, note_type, payload) =
        decode_note(&bytes[section.offset..section.offset + section.size])?;
    if name != NOTE_NAME_XDNA || note_type != NOTE_TYPE_DESCRIPTOR {
        return Err(ElfReason::BadDescriptor(format!(
            "note name {name:?} type {note_type} (need {NOTE_NAME_XDNA:?} type {NOTE_TYPE_DESCRIPTOR})"
        )));
    }
    let mut desc = KernelDesc::decode(payload)?;
    let has_ctrltext = elf.sections.iter().any(|s| s.name.starts_with(".ctrltext"));
    if desc.has_control_code && !has_ctrltext {
        return Err(ElfReason::BadDescriptor(
            "flag says control code is present but there is no .ctrltext".into(),
        ));
    }
    if let Some(columns) = configured_partition_columns(&elf, bytes)? {
        desc.partition_columns = columns;
    }
    Ok(desc)
}

/// The partition size the file's `.note.xrt.configuration` states, if it has one; a note too
/// short to hold it is refused (by the reader and by `wrap_elf` alike, so a wrapped file always
/// reads back).
fn configured_partition_columns(elf: &ParsedElf, bytes: &[u8]) -> Result<Option<u32>, ElfReason> {
    let Some(config) = elf.section(CONFIG_SECTION) else {
        return Ok(None);
    };
    let (_, _, payload) = decode_note(&bytes[config.offset..config.offset + config.size])?;
    if payload.len() < 4 {
        return Err(ElfReason::BadDescriptor(
            "configuration note shorter than 4 bytes".into(),
        ));
    }
    Ok(Some(read_u32(payload, 0)))
}

/// Read and validate a kernel file; errors name the file.
pub fn read_kernel(path: &Path) -> Result<KernelDesc, KernelError> {
    let bytes = std::fs::read(path).map_err(|e| KernelError::io(path, e))?;
    read_kernel_bytes(&bytes).map_err(|reason| KernelError::elf(path, reason))
}

/// Write a host-built kernel file for `desc` into `dir` under its canonical name; returns the path.
pub fn write_kernel(dir: &Path, desc: &KernelDesc) -> Result<std::path::PathBuf, KernelError> {
    let path = dir.join(desc.file_name());
    std::fs::write(&path, build_kernel_elf(desc)).map_err(|e| KernelError::io(&path, e))?;
    Ok(path)
}

/// Add the descriptor note to a toolchain-built full ELF. The original bytes are kept unchanged
/// (program headers and section offsets stay valid); the note, a new `.shstrtab` and a new section
/// header table (the old entries plus two) are appended. The control-code flag is set.
pub fn wrap_elf(input: &[u8], desc: &KernelDesc) -> Result<Vec<u8>, ElfReason> {
    let elf = parse_elf(input)?;
    if elf.section(DESCRIPTOR_SECTION).is_some() {
        return Err(ElfReason::AlreadyWrapped);
    }
    if !elf.sections.iter().any(|s| s.name.starts_with(".ctrltext")) {
        return Err(ElfReason::BadDescriptor(
            "input has no .ctrltext (not a toolchain-built kernel)".into(),
        ));
    }
    let mut desc = desc.clone();
    desc.has_control_code = true;
    if let Some(columns) = configured_partition_columns(&elf, input)? {
        desc.partition_columns = columns;
    }
    let mut out = input.to_vec();
    pad_to(&mut out, 4);
    let note_offset = out.len();
    let note = encode_note(NOTE_NAME_XDNA, NOTE_TYPE_DESCRIPTOR, &desc.encode());
    out.extend_from_slice(&note);
    // New name table: the old one plus the two new names.
    let old = &elf.sections[elf.shstrndx];
    let mut shstrtab = input[old.offset..old.offset + old.size].to_vec();
    if shstrtab.is_empty() {
        shstrtab.push(0);
    }
    let note_name = shstrtab.len() as u32;
    shstrtab.extend_from_slice(DESCRIPTOR_SECTION.as_bytes());
    shstrtab.push(0);
    let strtab_name = shstrtab.len() as u32;
    shstrtab.extend_from_slice(b".shstrtab\0");
    let strtab_offset = out.len();
    out.extend_from_slice(&shstrtab);
    pad_to(&mut out, 8);
    let shoff = out.len();
    out.extend_from_slice(&input[elf.shoff..elf.shoff + elf.shnum * SHDR_SIZE]);
    out.extend_from_slice(&section_header(
        note_name,
        SHT_NOTE,
        0,
        note_offset as u64,
        note.len() as u64,
        0,
        0,
        4,
        0,
    ));
    out.extend_from_slice(&section_header(
        strtab_name,
        SHT_STRTAB,
        0,
        strtab_offset as u64,
        shstrtab.len() as u64,
        0,
        0,
        1,
        0,
    ));
    let shnum = elf.shnum + 2;
    let shnum16 = u16::try_from(shnum)
        .map_err(|_| ElfReason::Truncated(format!("{shnum} sections is too many")))?;
    out[40..48].copy_from_slice(&(shoff as u64).to_le_bytes());
    out[60..62].copy_from_slice(&shnum16.to_le_bytes());
    out[62..64].copy_from_slice(&(shnum16 - 1).to_le_bytes());
    Ok(out)
}

/// A minimal stand-in for a toolchain-built full ELF (config note, `.ctrltext`, `.ctrldata`,
/// `.pdi.0`), for tests and for exercising `wrap` without the AIE toolchain.
pub fn synthetic_toolchain_elf(partition_columns: u32) -> Vec<u8> {
    write_elf(&[
        SectionSpec {
            name: CONFIG_SECTION.into(),
            sh_type: SHT_NOTE,
            flags: 0,
            align: 4,
            data: encode_note(
                NOTE_NAME_XRT,
                NOTE_TYPE_CONFIG,
                &partition_columns.to_le_bytes(),
            ),
        },
        SectionSpec {
            name: ".ctrltext".into(),
            sh_type: SHT_PROGBITS,
            flags: 0x6,
            align: 16,
            data: (0..256u32).map(|i| i as u8).collect(),
        },
        SectionSpec {
            name: ".ctrldata".into(),
            sh_type: SHT_PROGBITS,
            flags: 0x2,
            align: 16,
            data: vec![0xAB; 64],
        },
        SectionSpec {
            name: ".pdi.0".into(),
            sh_type: SHT_PROGBITS,
            flags: 0x2,
            align: 16,
            data: vec![0x5A; 128],
        },
    ])
}
