//! ERT packets and the command executor seam.
//!
//! [`execute`] is the one place a command's *work* happens: it gets the kernel image (the bytes the
//! instruction address points at) and the argument buffers (each from its device address to the end
//! of its BO). It runs the built-in test ops (`XDNASHIM` images), kernel ELF images with a
//! `.note.xdna.kernel` descriptor and shim-TXN control code (both through `kexec`, i.e. the
//! runtime's host executors).

use std::fmt;

pub const OP_START_CU: u32 = 0;
pub const OP_CMD_CHAIN: u32 = 19;
pub const OP_START_NPU: u32 = 20;
pub const OP_START_NPU_PREEMPT: u32 = 21;
pub const OP_START_NPU_PREEMPT_ELF: u32 = 22;

/// The magic of a built-in test image.
pub const SHIM_MAGIC: &[u8; 8] = b"XDNASHIM";
/// Built-in op: copy buffer 0 → buffer 1 (min of the lengths).
pub const SHIM_OP_COPY: u32 = 1;
/// Built-in op: f32 axpy, buffer1 = alpha·buffer0 + buffer1 (min of the lengths, in f32 elements).
pub const SHIM_OP_AXPY: u32 = 2;

/// The decoded ERT header word.
#[derive(Debug, Clone, Copy)]
pub struct Header {
    pub state: u32,
    pub extra_cu_masks: u32,
    pub count: u32,
    pub opcode: u32,
}

impl Header {
    pub fn parse(raw: u32) -> Header {
        Header {
            state: raw & 0xf,
            extra_cu_masks: (raw >> 10) & 0x3,
            count: (raw >> 12) & 0x7ff,
            opcode: (raw >> 23) & 0x1f,
        }
    }

    pub fn with_state(raw: u32, state: u32) -> u32 {
        (raw & !0xf) | (state & 0xf)
    }
}

pub fn state_name(s: u32) -> &'static str {
    match s {
        0 => "INVALID",
        1 => "NEW",
        2 => "QUEUED",
        3 => "RUNNING",
        4 => "COMPLETED",
        5 => "ERROR",
        6 => "ABORT",
        7 => "SUBMITTED",
        8 => "TIMEOUT",
        9 => "NORESPONSE",
        _ => "UNKNOWN",
    }
}

/// Why a command's work did not complete.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecFault {
    /// The image is in a format this executor cannot run (yet).
    Unsupported(String),
    /// The kernel ran and failed (bad arguments for the op, ...).
    Failed(String),
}

impl fmt::Display for ExecFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExecFault::Unsupported(m) => write!(f, "unsupported image: {m}"),
            ExecFault::Failed(m) => write!(f, "kernel failed: {m}"),
        }
    }
}

/// Runs one kernel image over its argument buffers.
pub fn execute(image: &[u8], buffers: &mut [&mut [u8]]) -> Result<(), ExecFault> {
    if image.len() >= 8 && &image[..8] == SHIM_MAGIC {
        return builtin(image, buffers);
    }
    if image.len() >= 4 && &image[..4] == b"\x7fELF" {
        // Kernel ELF (descriptor kernel, START_CU ABI): the runtime's host executors.
        return crate::kexec::run_elf(image, buffers);
    }
    if xdna::kernels::shim_txn::is_txn(image) {
        // shim-TXN control code (full-ELF flow, opcode 22; buffers resolved from its slots).
        return crate::kexec::run_txn(image, buffers);
    }
    Err(ExecFault::Unsupported(format!(
        "image starts with {:02x?}; the shim runs `XDNASHIM` test images, kernel ELFs and shim-TXN control code",
        &image[..image.len().min(8)]
    )))
}

fn builtin(image: &[u8], buffers: &mut [&mut [u8]]) -> Result<(), ExecFault> {
    if image.len() < 16 {
        return Err(ExecFault::Failed(format!(
            "XDNASHIM image is {} bytes, needs 16 (magic, op u32, alpha f32)",
            image.len()
        )));
    }
    let op = u32::from_le_bytes([image[8], image[9], image[10], image[11]]);
    let alpha = f32::from_le_bytes([image[12], image[13], image[14], image[15]]);
    if buffers.len() < 2 {
        return Err(ExecFault::Failed(format!(
            "op {op} needs 2 buffers, the command passed {}",
            buffers.len()
        )));
    }
    let (first, rest) = buffers.split_at_mut(1);
    let (src, dst) = (&*first[0], &mut *rest[0]);
    match op {
        SHIM_OP_COPY => {
            let n = src.len().min(dst.len());
            dst[..n].copy_from_slice(&src[..n]);
            Ok(())
        }
        SHIM_OP_AXPY => {
            let n = src.len().min(dst.len()) / 4;
            for i in 0..n {
                let x = f32::from_le_bytes([
                    src[4 * i],
                    src[4 * i + 1],
                    src[4 * i + 2],
                    src[4 * i + 3],
                ]);
                let y = f32::from_le_bytes([
                    dst[4 * i],
                    dst[4 * i + 1],
                    dst[4 * i + 2],
                    dst[4 * i + 3],
                ]);
                dst[4 * i..4 * i + 4].copy_from_slice(&(alpha * x + y).to_le_bytes());
            }
            Ok(())
        }
        _ => Err(ExecFault::Failed(format!(
            "unknown XDNASHIM op {op} (1 = copy, 2 = axpy f32)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(op: u32, alpha: f32) -> Vec<u8> {
        let mut v = SHIM_MAGIC.to_vec();
        v.extend_from_slice(&op.to_le_bytes());
        v.extend_from_slice(&alpha.to_le_bytes());
        v
    }

    #[test]
    fn axpy_and_copy() {
        let mut a: Vec<u8> = [1.0f32, 2.0, 3.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let mut b: Vec<u8> = [10.0f32, 20.0, 30.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        execute(&image(SHIM_OP_AXPY, 2.0), &mut [&mut a, &mut b]).unwrap();
        let got: Vec<f32> = b
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got, [12.0, 24.0, 36.0]);
        execute(&image(SHIM_OP_COPY, 0.0), &mut [&mut a, &mut b]).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn header_fields() {
        let h = Header::parse(0x3000_A001);
        assert_eq!(
            (h.state, h.count, h.opcode, h.extra_cu_masks),
            (1, 10, 0, 0)
        );
    }

    #[test]
    fn unknown_images_are_refused() {
        assert!(matches!(
            execute(b"\x7fELF....", &mut []),
            Err(ExecFault::Unsupported(_))
        ));
        assert!(matches!(
            execute(b"garbage!", &mut []),
            Err(ExecFault::Unsupported(_))
        ));
    }
}
