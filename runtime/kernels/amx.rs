//! AMX-INT8 tiles (Intel Sapphire Rapids and later): whether this process may use them, and a
//! thread's tile configuration held as a guard.
//!
//! A tile is up to 16 rows of 64 bytes in one of eight registers `tmm0 .. tmm7`; `tdpbsud` /
//! `tdpbssd` add to an i32 tile `C[m][n]` the 16 × 16 × 64 products `Σ_k A[m][k]·B[k/4][4n + k%4]`
//! of a signed byte tile A and an unsigned / signed byte tile B (B holds four consecutive `k` of
//! each column `n` side by side: the "lanes" layout of `ggml_dot::lanes`). Linux hands out the
//! tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), once per
//! process; each thread loads a configuration before its first tile instruction and releases it
//! after, so a context switch saves no tile data between calls. The kernels write their tile
//! instructions as inline assembly (Rust's AMX intrinsics are unstable) with fixed registers.
//! `XDNA_NO_AMX=1` turns the tiles off (the VNNI kernels run instead).

// Unsafe is needed for CPUID-gated inline assembly and the permission system call.
#![allow(unsafe_code)]

use std::arch::asm;
use std::marker::PhantomData;
use std::sync::OnceLock;

/// Rows of every tile used here.
pub const TILE_ROWS: usize = 16;
/// Bytes per tile row.
pub const TILE_ROW_BYTES: usize = 64;
/// Bytes of a whole tile.
pub const TILE_BYTES: usize = TILE_ROWS * TILE_ROW_BYTES;

/// `arch_prctl` request for permission to use an extended state component.
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
/// The AMX tile data state component.
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// Whether the AMX-INT8 kernels run: the CPU has AMX-TILE and AMX-INT8, the kernel granted this
/// process the tile state, the AVX-512 VNNI kernels they sit beside are available, and
/// `XDNA_NO_AMX` is unset.
pub fn available() -> bool {
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        std::env::var_os("XDNA_NO_AMX").is_none()
            && super::avx2::vnni_available()
            && cpu_has_amx_int8()
            && permission_granted()
    })
}

fn cpu_has_amx_int8() -> bool {
    use std::arch::x86_64::__cpuid_count;
    if __cpuid_count(0, 0).eax < 7 {
        return false;
    }
    // Leaf 7, EDX: bit 24 AMX-TILE, bit 25 AMX-INT8.
    let both = (1 << 24) | (1 << 25);
    __cpuid_count(7, 0).edx & both == both
}

fn permission_granted() -> bool {
    // SAFETY: this `arch_prctl` request takes two integers and touches no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

/// `ldtilecfg`'s 64-byte operand, palette 1.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

/// This thread's tiles `tmm0 .. tmm7` configured; released when dropped. Not `Send`: the
/// configuration belongs to the thread that loaded it.
pub struct Tiles(PhantomData<*const ()>);

impl Tiles {
    /// Tile `t` configured as `rows[t]` (1 ..= 16) rows of 64 bytes.
    ///
    /// # Safety
    /// [`available`] returned true.
    pub unsafe fn configure(rows: [u8; 8]) -> Self {
        debug_assert!(rows.iter().all(|&r| (1..=TILE_ROWS as u8).contains(&r)));
        let mut config = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        for (t, &r) in rows.iter().enumerate() {
            config.bytes_per_row[t] = TILE_ROW_BYTES as u16;
            config.rows[t] = r;
        }
        // SAFETY: AMX is available and permitted (the caller's contract); `config` is a valid
        // palette-1 configuration of 64 aligned bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly)) };
        Self(PhantomData)
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: a configuration was loaded on this thread (`configure`), so AMX is usable.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}
