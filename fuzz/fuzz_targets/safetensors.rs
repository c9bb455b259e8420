//! Fuzz the safetensors / Q4NX header parser: any input must give Ok or Err, never a panic.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run safetensors`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = xdna::weights::safetensors::parse_header(std::path::Path::new("<fuzz>"), data);
});
