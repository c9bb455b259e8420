//! Fuzz the DFlash draft gate (`xdna pack check`): whatever the files hold, `check` returns a
//! report of PASS/FAIL lines, never a panic. The input is a GGUF file when it starts with the
//! GGUF magic; otherwise `config.json`, a zero byte, then `model.q4nx` of a package directory.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run dflash_check`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("xdna-fuzz-dflash-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    dir
}

fuzz_target!(|data: &[u8]| {
    let dir = scratch();
    if data.starts_with(b"GGUF") {
        let path = dir.join("draft.gguf");
        if std::fs::write(&path, data).is_ok() {
            let _ = xdna::weights::dflash_check::check(&path);
        }
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let (config, container) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    let pkg = dir.join("pkg");
    let _ = std::fs::create_dir_all(&pkg);
    if std::fs::write(pkg.join("config.json"), config).is_ok()
        && std::fs::write(pkg.join("model.q4nx"), container).is_ok()
    {
        let _ = xdna::weights::dflash_check::check(&pkg);
    }
    // Nothing outlives the run: the fuzzer may stop this process at any input.
    let _ = std::fs::remove_dir_all(&dir);
});
