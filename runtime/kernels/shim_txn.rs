//! The shim-TXN control-code stream: a tiny, documented stand-in for the AIE control code of a
//! toolchain-built full ELF, so the full-ELF flow (`.ctrltext` + `.rela.dyn` patching + opcode 22)
//! can be exercised end to end against the fake device (tools/xdna-shim) without the AIE toolchain.
//!
//! Layout (all little-endian; see `docs/device.md`, "Kernels on the device"):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `XDNATXN\x01` |
//! | 8 | 4 | descriptor length `D` |
//! | 12 | 4 | slot count `S` |
//! | 16 | D | the kernel descriptor (the `.note.xdna.kernel` payload, [`KernelDesc::encode`]) |
//! | 16 + round_up(D, 16) | 16 × S | buffer-descriptor slots |
//!
//! A slot is four u32 words, shaped like the words a `shim_dma_48` relocation patches
//! (`docs/protocol.md` §8): `[0]` argument index, `[1]` address bits 31:0, `[2]` address bits 47:32 in its low
//! 16 bits (upper 16 bits reserved, kept), `[3]` the addend the toolchain recorded for this slot
//! (the real BD has no such word; the shim uses it to undo the patch and check it). A pristine slot
//! holds address 0; patching adds `buffer address + addend + 0x8000_0000`. The buffer handed to the
//! kernel runs from the resolved address to the end of its BO (as for START_CU regmaps).

use super::elf::{self, KernelDesc, SectionSpec};
use super::ElfReason;

/// Magic of a shim-TXN stream.
pub const TXN_MAGIC: &[u8; 8] = b"XDNATXN\x01";
/// The DDR offset `shim_dma_48` adds to every patched address.
pub const DDR_OFFSET: u64 = 0x8000_0000;
/// Bytes per slot.
pub const SLOT_BYTES: usize = 16;
/// ELF relocation type of the `shim_dma_48` scheme.
pub const R_SHIM_DMA_48: u32 = 5;

const HEADER_BYTES: usize = 16;

/// One decoded slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnSlot {
    /// Byte offset of the slot in the stream.
    pub offset: usize,
    /// Argument index (position in the descriptor's argument list).
    pub arg: u32,
    /// The 48-bit address the slot holds now.
    pub addr48: u64,
    /// The addend recorded by the toolchain.
    pub addend: u32,
}

impl TxnSlot {
    /// The buffer address a correct single patch implies: `addr48 − 0x8000_0000 − addend`, or `None`
    /// when the slot is still pristine (or was patched with something smaller).
    pub fn buffer_address(&self) -> Option<u64> {
        self.addr48
            .checked_sub(DDR_OFFSET)?
            .checked_sub(u64::from(self.addend))
    }
}

/// A decoded stream.
#[derive(Clone, Debug)]
pub struct Txn {
    /// The kernel descriptor the stream carries.
    pub desc: KernelDesc,
    /// The buffer-descriptor slots, in stream order.
    pub slots: Vec<TxnSlot>,
}

fn word(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Offset of slot `i` in a stream whose descriptor is `desc_len` bytes.
pub fn slot_offset(desc_len: usize, i: usize) -> usize {
    HEADER_BYTES + desc_len.div_ceil(16) * 16 + i * SLOT_BYTES
}

/// Is this a shim-TXN stream?
pub fn is_txn(bytes: &[u8]) -> bool {
    bytes.len() >= 8 && &bytes[..8] == TXN_MAGIC
}

/// Encode a pristine stream for `desc`: one slot per argument, slot `i` for argument `i`, each
/// with the given addend.
pub fn encode(desc: &KernelDesc, addends: &[u32]) -> Vec<u8> {
    let d = desc.encode();
    let n = desc.args.len();
    let mut out = Vec::with_capacity(slot_offset(d.len(), n));
    out.extend_from_slice(TXN_MAGIC);
    out.extend_from_slice(&(d.len() as u32).to_le_bytes());
    out.extend_from_slice(&(n as u32).to_le_bytes());
    out.extend_from_slice(&d);
    out.resize(slot_offset(d.len(), 0), 0);
    for i in 0..n {
        let addend = addends.get(i).copied().unwrap_or(0);
        for w in [i as u32, 0, 0, addend] {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    out
}

/// Decode a stream (bounds-checked; the error says which rule it broke).
pub fn decode(bytes: &[u8]) -> Result<Txn, String> {
    if !is_txn(bytes) {
        return Err("not a shim-TXN stream (bad magic)".into());
    }
    if bytes.len() < HEADER_BYTES {
        return Err(format!(
            "stream of {} bytes is shorter than its header",
            bytes.len()
        ));
    }
    let dlen = word(bytes, 8) as usize;
    let nslots = word(bytes, 12) as usize;
    let end = nslots
        .checked_mul(SLOT_BYTES)
        .and_then(|s| slot_offset(dlen, 0).checked_add(s))
        .filter(|&e| e <= bytes.len() && dlen <= bytes.len())
        .ok_or_else(|| {
            format!(
                "descriptor of {dlen} bytes and {nslots} slots overrun the {}-byte stream",
                bytes.len()
            )
        })?;
    let desc = KernelDesc::decode(&bytes[HEADER_BYTES..HEADER_BYTES + dlen])
        .map_err(|e| format!("descriptor: {e}"))?;
    let slots = (0..nslots)
        .map(|i| {
            let o = slot_offset(dlen, i);
            TxnSlot {
                offset: o,
                arg: word(bytes, o),
                addr48: u64::from(word(bytes, o + 4))
                    | (u64::from(word(bytes, o + 8) & 0xFFFF) << 32),
                addend: word(bytes, o + 12),
            }
        })
        .collect();
    debug_assert!(end <= bytes.len());
    Ok(Txn { desc, slots })
}

/// Apply one `shim_dma_48` patch at `offset` of `code`: the 48-bit address in words `[1]` (low 32)
/// and `[2]` (low 16 bits) is incremented by `value` (= buffer address + addend + 0x8000_0000).
pub fn patch_shim_dma_48(code: &mut [u8], offset: usize, value: u64) -> Result<(), String> {
    let end = offset
        .checked_add(12)
        .filter(|&e| e <= code.len())
        .ok_or_else(|| {
            format!(
                "relocation at {offset:#x} overruns the {}-byte control code",
                code.len()
            )
        })?;
    let w1 = word(code, offset + 4);
    let w2 = word(code, offset + 8);
    let old = u64::from(w1) | (u64::from(w2 & 0xFFFF) << 32);
    let new = old.wrapping_add(value) & 0xFFFF_FFFF_FFFF;
    code[offset + 4..offset + 8].copy_from_slice(&(new as u32).to_le_bytes());
    let w2 = (w2 & 0xFFFF_0000) | ((new >> 32) as u32 & 0xFFFF);
    code[offset + 8..end].copy_from_slice(&w2.to_le_bytes());
    Ok(())
}

const SHT_PROGBITS: u32 = 1;
const SHT_RELA: u32 = 4;
const SHT_DYNSYM: u32 = 11;
const SHT_STRTAB: u32 = 3;
const SHT_NOTE: u32 = 7;

/// A synthetic "toolchain-built" full ELF for `desc` (not yet wrapped): `.note.xrt.configuration`
/// (partition columns), `.ctrltext` holding a pristine shim-TXN stream, `.ctrldata`, `.pdi.0`,
/// `.dynsym`/`.dynstr` with one symbol per argument (named by its index, "0", "1", …) and
/// `.rela.dyn` with one `shim_dma_48` relocation per slot (offset = slot offset in `.ctrltext`,
/// addend = `addends[i]`). Feed it to [`elf::wrap_elf`] to get a kernel file.
pub fn synthetic_txn_elf(desc: &KernelDesc, addends: &[u32]) -> Vec<u8> {
    let ctrl = encode(desc, addends);
    let dlen = desc.encode().len();
    let mut dynstr = vec![0u8];
    let mut dynsym = vec![0u8; 24]; // null symbol
    let mut rela = Vec::new();
    for i in 0..desc.args.len() {
        let name = dynstr.len() as u32;
        dynstr.extend_from_slice(i.to_string().as_bytes());
        dynstr.push(0);
        let mut sym = [0u8; 24];
        sym[0..4].copy_from_slice(&name.to_le_bytes());
        sym[4] = 0x10; // STB_GLOBAL, STT_NOTYPE
        dynsym.extend_from_slice(&sym);
        let sym_index = (i + 1) as u64;
        rela.extend_from_slice(&(slot_offset(dlen, i) as u64).to_le_bytes());
        rela.extend_from_slice(&((sym_index << 32) | u64::from(R_SHIM_DMA_48)).to_le_bytes());
        let addend = i64::from(addends.get(i).copied().unwrap_or(0));
        rela.extend_from_slice(&addend.to_le_bytes());
    }
    let mut config = Vec::new();
    for w in [4u32, 4, 1] {
        config.extend_from_slice(&w.to_le_bytes());
    }
    config.extend_from_slice(b"XRT\0");
    config.extend_from_slice(&desc.partition_columns.to_le_bytes());
    elf::write_elf(&[
        SectionSpec {
            name: elf::CONFIG_SECTION.into(),
            sh_type: SHT_NOTE,
            flags: 0,
            align: 4,
            data: config,
        },
        SectionSpec {
            name: ".ctrltext".into(),
            sh_type: SHT_PROGBITS,
            flags: 0x6,
            align: 16,
            data: ctrl,
        },
        SectionSpec {
            name: ".ctrldata".into(),
            sh_type: SHT_PROGBITS,
            flags: 0x2,
            align: 16,
            data: vec![0; 64],
        },
        SectionSpec {
            name: ".pdi.0".into(),
            sh_type: SHT_PROGBITS,
            flags: 0x2,
            align: 16,
            data: vec![0x5A; 128],
        },
        SectionSpec {
            name: ".dynstr".into(),
            sh_type: SHT_STRTAB,
            flags: 0x2,
            align: 1,
            data: dynstr,
        },
        SectionSpec {
            name: ".dynsym".into(),
            sh_type: SHT_DYNSYM,
            flags: 0x2,
            align: 8,
            data: dynsym,
        },
        SectionSpec {
            name: ".rela.dyn".into(),
            sh_type: SHT_RELA,
            flags: 0x2,
            align: 8,
            data: rela,
        },
    ])
}

/// One argument relocation of a full ELF (`.rela.dyn` entry resolved through `.dynsym`/`.dynstr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArgReloc {
    /// Byte offset in `.ctrltext`.
    pub offset: usize,
    /// Argument index (the symbol name parsed as a number).
    pub arg: usize,
    /// Relocation type (patch scheme).
    pub scheme: u32,
    /// Addend.
    pub addend: i64,
}

/// The control code and argument relocations of a full ELF.
#[derive(Clone, Debug)]
pub struct FullElf {
    /// `.ctrltext`, pristine.
    pub ctrltext: Vec<u8>,
    /// Argument relocations, in file order.
    pub relocs: Vec<ArgReloc>,
}

/// Extract `.ctrltext` and the argument relocations of a full ELF. Symbols that do not name an
/// argument index (`scratch-pad-ctrl`, `control-packet`, PDI symbols) and schemes other than
/// `shim_dma_48` are refused: the flow here patches user arguments only.
pub fn read_full_elf(bytes: &[u8]) -> Result<FullElf, ElfReason> {
    let parsed = elf::parse_elf(bytes)?;
    let sect = |name: &str| {
        parsed
            .section(name)
            .map(|s| &bytes[s.offset..s.offset + s.size])
    };
    let bad = |m: String| ElfReason::BadDescriptor(m);
    let ctrltext = sect(".ctrltext")
        .ok_or_else(|| bad("no .ctrltext section".into()))?
        .to_vec();
    let mut relocs = Vec::new();
    if let Some(rela) = sect(".rela.dyn") {
        let dynsym = sect(".dynsym").ok_or_else(|| bad(".rela.dyn without .dynsym".into()))?;
        let dynstr = sect(".dynstr").ok_or_else(|| bad(".rela.dyn without .dynstr".into()))?;
        if rela.len() % 24 != 0 {
            return Err(bad(format!(
                ".rela.dyn size {} is not a multiple of 24",
                rela.len()
            )));
        }
        for (i, r) in rela.chunks_exact(24).enumerate() {
            let mut q = [0u8; 8];
            q.copy_from_slice(&r[0..8]);
            let offset = u64::from_le_bytes(q);
            q.copy_from_slice(&r[8..16]);
            let info = u64::from_le_bytes(q);
            q.copy_from_slice(&r[16..24]);
            let addend = i64::from_le_bytes(q);
            let (sym, scheme) = ((info >> 32) as usize, info as u32);
            let s = sym
                .checked_mul(24)
                .and_then(|o| dynsym.get(o..o + 24))
                .ok_or_else(|| bad(format!("relocation {i}: symbol {sym} outside .dynsym")))?;
            let name_at = word(s, 0) as usize;
            let name = dynstr
                .get(name_at..)
                .and_then(|t| t.split(|&b| b == 0).next())
                .ok_or_else(|| bad(format!("relocation {i}: symbol name outside .dynstr")))?;
            let name = String::from_utf8_lossy(name);
            let arg: usize = name.parse().map_err(|_| {
                bad(format!(
                    "relocation {i}: symbol {name:?} is not an argument index (only argument relocations are supported)"
                ))
            })?;
            if scheme != R_SHIM_DMA_48 {
                return Err(bad(format!(
                    "relocation {i}: scheme {scheme} (only shim_dma_48 = {R_SHIM_DMA_48} is supported)"
                )));
            }
            let offset = usize::try_from(offset)
                .ok()
                .filter(|&o| o.checked_add(12).is_some_and(|e| e <= ctrltext.len()))
                .ok_or_else(|| {
                    bad(format!(
                        "relocation {i}: offset {offset:#x} outside the {}-byte .ctrltext",
                        ctrltext.len()
                    ))
                })?;
            relocs.push(ArgReloc {
                offset,
                arg,
                scheme,
                addend,
            });
        }
    }
    Ok(FullElf { ctrltext, relocs })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiles::{ScaleType, TileOrder, WeightFormat};

    fn desc() -> KernelDesc {
        let f = WeightFormat::Q41 {
            scale: ScaleType::F16,
            order: TileOrder::ColumnMajor,
        };
        KernelDesc::gemm(f, crate::kernels::RowFamily::M16, 256, 64)
    }

    #[test]
    fn encode_decode_patch() {
        let d = desc();
        let mut s = encode(&d, &[0x10, 0, 0x40]);
        let t = decode(&s).unwrap();
        assert_eq!(t.desc, d);
        assert_eq!(t.slots.len(), 3);
        assert_eq!(t.slots[0].buffer_address(), None);
        patch_shim_dma_48(
            &mut s,
            t.slots[2].offset,
            0x7f12_3456_7000 + 0x40 + DDR_OFFSET,
        )
        .unwrap();
        let t = decode(&s).unwrap();
        assert_eq!(t.slots[2].buffer_address(), Some(0x7f12_3456_7000));
        assert!(decode(&s[..20]).is_err());
    }

    #[test]
    fn full_elf_relocations() {
        let d = desc();
        let raw = synthetic_txn_elf(&d, &[0, 8, 0]);
        let wrapped = elf::wrap_elf(&raw, &d).unwrap();
        let read = elf::read_kernel_bytes(&wrapped).unwrap();
        assert!(read.has_control_code);
        let f = read_full_elf(&wrapped).unwrap();
        assert_eq!(f.relocs.len(), 3);
        assert_eq!(f.relocs[1].arg, 1);
        assert_eq!(f.relocs[1].addend, 8);
        assert_eq!(
            f.relocs[1].offset,
            decode(&f.ctrltext).unwrap().slots[1].offset
        );
    }
}
