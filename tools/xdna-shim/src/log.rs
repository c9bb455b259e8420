//! The shim's "dmesg": one line per event, prefixed `xdna-shim:`, to stderr or to the file named by
//! `XDNA_SHIM_LOG`.

use std::io::Write;

pub fn log(msg: &str) {
    let line = format!("xdna-shim[{}]: {msg}\n", std::process::id());
    if let Some(path) = crate::config::get().log.as_ref() {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(line.as_bytes());
            return;
        }
    }
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Logs only when `XDNA_SHIM_DEBUG` is set.
pub fn debug(msg: impl FnOnce() -> String) {
    if crate::config::get().debug {
        log(&msg());
    }
}
