//! ERT command packets as the firmware/driver read them from a CMD BO
//! (`docs/protocol.md` §5.1): a header word, `count` payload words.
//!
//! Header: state bits 3:0, extra_cu_masks 11:10, count 22:12, opcode 27:23,
//! type 31:28. The builders return the whole packet as u32 words, header
//! first, state NEW.

use crate::ffi;
use std::fmt;

/// Largest `count` the header's 11-bit field can hold.
pub const MAX_PAYLOAD_WORDS: usize = 0x7FF;

/// ERT opcode of a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Opcode {
    /// Regmap flow (xclbin PDI + instruction stream, descriptor kernels).
    StartCu = ffi::ERT_START_CU,
    /// `ert_npu_data` + args.
    StartNpu = ffi::ERT_START_NPU,
    /// `ert_npu_preempt_data` + args.
    StartNpuPreempt = ffi::ERT_START_NPU_PREEMPT,
    /// Full ELF: `ert_npu_preempt_data`, args ignored.
    StartNpuPreemptElf = ffi::ERT_START_NPU_PREEMPT_ELF,
}

/// Command state in header bits 3:0. Not monotonic: success is exactly
/// [`CmdState::Completed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmdState {
    /// 0
    Invalid,
    /// 1: written by the host before submission.
    New,
    /// 2
    Queued,
    /// 3
    Running,
    /// 4: the only success state.
    Completed,
    /// 5: firmware reported failure.
    Error,
    /// 6: malformed/short firmware response, or killed.
    Abort,
    /// 7
    Submitted,
    /// 8: TDR fired; payload holds a health record.
    Timeout,
    /// 9
    NoResponse,
    /// 10
    SkError,
    /// 11
    SkCrashed,
    /// 12..=15: not defined by ERT.
    Unknown(u32),
}

impl CmdState {
    /// State from a header word.
    pub fn from_header(header: u32) -> Self {
        Self::from_raw(header & ffi::ERT_HDR_STATE_MASK)
    }

    /// State from its 4-bit value.
    pub fn from_raw(v: u32) -> Self {
        match v {
            0 => Self::Invalid,
            1 => Self::New,
            2 => Self::Queued,
            3 => Self::Running,
            4 => Self::Completed,
            5 => Self::Error,
            6 => Self::Abort,
            7 => Self::Submitted,
            8 => Self::Timeout,
            9 => Self::NoResponse,
            10 => Self::SkError,
            11 => Self::SkCrashed,
            other => Self::Unknown(other),
        }
    }

    /// The 4-bit value.
    pub fn raw(self) -> u32 {
        match self {
            Self::Invalid => 0,
            Self::New => 1,
            Self::Queued => 2,
            Self::Running => 3,
            Self::Completed => 4,
            Self::Error => 5,
            Self::Abort => 6,
            Self::Submitted => 7,
            Self::Timeout => 8,
            Self::NoResponse => 9,
            Self::SkError => 10,
            Self::SkCrashed => 11,
            Self::Unknown(v) => v,
        }
    }
}

impl fmt::Display for CmdState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::Invalid => "INVALID",
            Self::New => "NEW",
            Self::Queued => "QUEUED",
            Self::Running => "RUNNING",
            Self::Completed => "COMPLETED",
            Self::Error => "ERROR",
            Self::Abort => "ABORT",
            Self::Submitted => "SUBMITTED",
            Self::Timeout => "TIMEOUT",
            Self::NoResponse => "NORESPONSE",
            Self::SkError => "SKERROR",
            Self::SkCrashed => "SKCRASHED",
            Self::Unknown(_) => "UNKNOWN",
        };
        write!(f, "{name} ({})", self.raw())
    }
}

/// Why a packet could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ErtError {
    /// More payload words than the 11-bit count field holds.
    #[error("ERT payload of {0} words exceeds the 2047-word header limit")]
    TooLong(usize),
    /// CU mask 0 selects no CU.
    #[error("ERT cu_mask must be non-zero")]
    EmptyCuMask,
}

/// Header word: state NEW, no extra CU masks, `count` payload words,
/// `opcode`, type ERT_CU (3).
pub fn header(opcode: Opcode, count: usize) -> Result<u32, ErtError> {
    if count > MAX_PAYLOAD_WORDS {
        return Err(ErtError::TooLong(count));
    }
    Ok((ffi::ERT_CMD_STATE_NEW << ffi::ERT_HDR_STATE_SHIFT)
        | ((count as u32) << ffi::ERT_HDR_COUNT_SHIFT)
        | ((opcode as u32) << ffi::ERT_HDR_OPCODE_SHIFT)
        | (ffi::ERT_CU << ffi::ERT_HDR_TYPE_SHIFT))
}

/// `count` field of a header word.
pub fn header_count(header: u32) -> usize {
    ((header >> ffi::ERT_HDR_COUNT_SHIFT) & ffi::ERT_HDR_COUNT_MASK) as usize
}

/// `opcode` field of a header word.
pub fn header_opcode(header: u32) -> u32 {
    (header >> ffi::ERT_HDR_OPCODE_SHIFT) & ffi::ERT_HDR_OPCODE_MASK
}

fn push_u64(words: &mut Vec<u32>, v: u64) {
    words.push(v as u32);
    words.push((v >> 32) as u32);
}

fn finish(opcode: Opcode, mut payload: Vec<u32>) -> Result<Vec<u32>, ErtError> {
    let h = header(opcode, payload.len())?;
    payload.insert(0, h);
    Ok(payload)
}

/// ERT_START_CU with the TXN regmap: cu_mask, then opcode u64 = 3 @0x00,
/// instr u64 @0x08, ninstr u32 (32-bit words) @0x10, buffer addresses u64
/// from @0x14. Two buffers → header 0x3000A001.
pub fn start_cu(
    cu_mask: u32,
    instr_addr: u64,
    ninstr_words: u32,
    buffers: &[u64],
) -> Result<Vec<u32>, ErtError> {
    if cu_mask == 0 {
        return Err(ErtError::EmptyCuMask);
    }
    let mut p = Vec::with_capacity(6 + 2 * buffers.len());
    p.push(cu_mask);
    push_u64(&mut p, u64::from(ffi::ERT_START_CU_OPCODE_TXN));
    push_u64(&mut p, instr_addr);
    p.push(ninstr_words);
    for &b in buffers {
        push_u64(&mut p, b);
    }
    finish(Opcode::StartCu, p)
}

/// ERT_START_NPU: cu_mask, `ert_npu_data` {instruction_buffer u64,
/// instruction_buffer_size u32 (bytes), instruction_prop_count u32 = 0},
/// then the kernel argument words.
pub fn start_npu(
    cu_mask: u32,
    instr_addr: u64,
    instr_size_bytes: u32,
    args: &[u32],
) -> Result<Vec<u32>, ErtError> {
    if cu_mask == 0 {
        return Err(ErtError::EmptyCuMask);
    }
    let mut p = Vec::with_capacity(5 + args.len());
    p.push(cu_mask);
    push_u64(&mut p, instr_addr);
    p.push(instr_size_bytes);
    p.push(0);
    p.extend_from_slice(args);
    finish(Opcode::StartNpu, p)
}

/// Buffers of an `ert_npu_preempt_data` payload (device addresses, sizes in
/// bytes). Save/restore may be 0/0 for a full ELF.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PreemptData {
    /// Control code (16 KiB-aligned DEV BO).
    pub instruction: u64,
    /// Control code size in bytes.
    pub instruction_size: u32,
    /// Preemption save code.
    pub save: u64,
    /// Save code size in bytes.
    pub save_size: u32,
    /// Preemption restore code.
    pub restore: u64,
    /// Restore code size in bytes.
    pub restore_size: u32,
}

fn preempt_payload(cu_mask: u32, d: &PreemptData) -> Vec<u32> {
    let mut p = Vec::with_capacity(13);
    p.push(cu_mask);
    push_u64(&mut p, d.instruction);
    push_u64(&mut p, d.save);
    push_u64(&mut p, d.restore);
    p.push(d.instruction_size);
    p.push(d.save_size);
    p.push(d.restore_size);
    p.push(0); // instruction_prop_count
    p
}

/// ERT_START_NPU_PREEMPT (21): cu_mask, `ert_npu_preempt_data`, args.
pub fn start_npu_preempt(
    cu_mask: u32,
    data: &PreemptData,
    args: &[u32],
) -> Result<Vec<u32>, ErtError> {
    if cu_mask == 0 {
        return Err(ErtError::EmptyCuMask);
    }
    let mut p = preempt_payload(cu_mask, data);
    p.extend_from_slice(args);
    finish(Opcode::StartNpuPreempt, p)
}

/// ERT_START_NPU_PREEMPT_ELF (22), the full-ELF packet: cu_mask 1,
/// `ert_npu_preempt_data`, then the u64 `opcode` argument (3) as XRT appends
/// it; the driver ignores args for this opcode.
pub fn start_npu_preempt_elf(data: &PreemptData) -> Result<Vec<u32>, ErtError> {
    let mut p = preempt_payload(1, data);
    push_u64(&mut p, u64::from(ffi::ERT_START_CU_OPCODE_TXN));
    finish(Opcode::StartNpuPreemptElf, p)
}

/// Packet words as little-endian bytes, ready to copy into a CMD BO.
pub fn to_bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_example_two_buffers() {
        // docs/protocol.md §5.1: 2 buffers → regmap 9 words + 1 mask →
        // count 10 → header 0x3000A001.
        let p = start_cu(1, 0x0400_8000, 16, &[0x7f00_1234_5000, 0x7f00_1234_9000]).unwrap();
        assert_eq!(p[0], 0x3000_A001);
        assert_eq!(p.len(), 11);
        assert_eq!(
            &p[1..],
            &[
                1,
                3,
                0,
                0x0400_8000,
                0,
                16,
                0x1234_5000,
                0x7f00,
                0x1234_9000,
                0x7f00
            ]
        );
    }

    #[test]
    fn start_cu_regmap_offsets() {
        let p = start_cu(1, 0x1122_3344_5566_7788, 7, &[0xAAAA_BBBB_CCCC_DDDD]).unwrap();
        // Regmap starts after header + cu_mask; byte offsets as in the ABI.
        let regmap = &p[2..];
        let at = |off: usize| regmap[off / 4];
        assert_eq!((at(0x00), at(0x04)), (3, 0));
        assert_eq!((at(0x08), at(0x0c)), (0x5566_7788, 0x1122_3344));
        assert_eq!(at(0x10), 7);
        assert_eq!((at(0x14), at(0x18)), (0xCCCC_DDDD, 0xAAAA_BBBB));
        assert_eq!(p[0], 0x3000_8001); // count 8
    }

    #[test]
    fn start_cu_no_buffers_and_limits() {
        assert_eq!(start_cu(1, 0, 0, &[]).unwrap()[0], 0x3000_6001);
        assert_eq!(start_cu(0, 0, 0, &[]), Err(ErtError::EmptyCuMask));
        let many = vec![0u64; 1021];
        assert_eq!(start_cu(1, 0, 0, &many), Err(ErtError::TooLong(6 + 2042)));
    }

    #[test]
    fn start_npu_layout() {
        let p = start_npu(1, 0x0401_0000, 0x400, &[9, 8]).unwrap();
        // count = mask 1 + npu_data 4 + args 2 = 7; opcode 20 << 23.
        assert_eq!(p[0], 1 | (7 << 12) | (20 << 23) | (3 << 28));
        assert_eq!(p[0], 0x3A00_7001);
        assert_eq!(&p[1..], &[1, 0x0401_0000, 0, 0x400, 0, 9, 8]);
    }

    #[test]
    fn preempt_elf_layout() {
        let d = PreemptData {
            instruction: 0x0400_8000,
            instruction_size: 0x100,
            ..Default::default()
        };
        let p = start_npu_preempt_elf(&d).unwrap();
        // count = 1 + 10 + 2 = 13; opcode 22.
        assert_eq!(p[0], 1 | (13 << 12) | (22 << 23) | (3 << 28));
        assert_eq!(p[0], 0x3B00_D001);
        assert_eq!(
            &p[1..],
            &[1, 0x0400_8000, 0, 0, 0, 0, 0, 0x100, 0, 0, 0, 3, 0]
        );
        assert_eq!(header_opcode(p[0]), 22);
        assert_eq!(header_count(p[0]), 13);
    }

    #[test]
    fn states() {
        assert_eq!(CmdState::from_header(0x3000_A004), CmdState::Completed);
        assert_eq!(CmdState::from_header(0x3000_A008), CmdState::Timeout);
        for v in 0..16 {
            assert_eq!(CmdState::from_raw(v).raw(), v);
        }
        assert_eq!(CmdState::Abort.to_string(), "ABORT (6)");
    }
}
