//! The default model: with the GGUF already in the cache (no network), `default_model()` checks
//! its sha256, imports it once through a temporary directory, and reuses the package.

#[path = "support/smollm2.rs"]
mod smollm2;
use xdna::weights::default_model::{GGUF_NAME, GGUF_SHA256};
use xdna::weights::{default_model, Package};

#[test]
fn default_model_imports_once_from_a_cached_gguf() {
    let Some(src) = smollm2::smollm2_gguf() else {
        return;
    };
    let cache = std::env::temp_dir().join(format!("xdna-default-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let xdna_dir = cache.join("xdna");
    std::fs::create_dir_all(&xdna_dir).unwrap();
    std::os::unix::fs::symlink(&src, xdna_dir.join(GGUF_NAME)).unwrap();
    // A stale temporary directory from an interrupted import must be ignored.
    std::fs::create_dir_all(xdna_dir.join(".SmolLM2-135M-Instruct.Q4_1.pkg.tmp.1")).unwrap();
    // SAFETY: this test binary has a single test; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("XDG_CACHE_HOME", &cache) };
    assert_eq!(
        xdna::weights::default_model::sha256_file(&src).unwrap(),
        GGUF_SHA256
    );
    let dir = default_model().unwrap();
    assert_eq!(dir, xdna_dir.join("SmolLM2-135M-Instruct.Q4_1.pkg"));
    let mtime = std::fs::metadata(dir.join("model.q4nx"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(default_model().unwrap(), dir);
    assert_eq!(
        std::fs::metadata(dir.join("model.q4nx"))
            .unwrap()
            .modified()
            .unwrap(),
        mtime
    );
    let pkg = Package::open(&dir).unwrap();
    assert_eq!(pkg.config().num_hidden_layers, 30);
    let _ = std::fs::remove_dir_all(&cache);
}
