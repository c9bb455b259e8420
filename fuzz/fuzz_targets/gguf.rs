//! Fuzz the GGUF parser and dequantizers: any input must give Ok or Err, never a panic.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run gguf` (cargo-fuzz; only stable is installed).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = xdna::weights::gguf::check_bytes(data);
});
