//! Fuzz the kernel ELF reader: any bytes must give Ok or Err, never a panic. A file that reads as
//! a kernel rebuilds (host-built, so without control code) to one that reads back to the same
//! descriptor; bytes that `xdna kernels wrap` accepts as a toolchain ELF give a kernel file that
//! reads back.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run kernel_elf corpus/kernel_elf`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xdna::kernels::elf::{self, KernelDesc};
use xdna::kernels::RowFamily;
use xdna::tiles::WeightFormat;

fuzz_target!(|data: &[u8]| {
    let _ = elf::parse_elf(data);
    if let Ok(desc) = elf::read_kernel_bytes(data) {
        let rebuilt = elf::build_kernel_elf(&desc);
        let again = elf::read_kernel_bytes(&rebuilt).expect("a built kernel reads back");
        let host_built = KernelDesc {
            has_control_code: false,
            ..desc
        };
        assert_eq!(again, host_built, "descriptor round trip");
    }
    if let Ok(q41) = WeightFormat::from_name("q41h") {
        let desc = KernelDesc::gemm(q41, RowFamily::M16, 576, 960);
        if let Ok(wrapped) = elf::wrap_elf(data, &desc) {
            elf::read_kernel_bytes(&wrapped).expect("a wrapped kernel reads back");
        }
    }
});
