//! The default model: with the GGUF already in the cache (no network), `default_model()` checks
//! its sha256, imports it once through a temporary directory, and reuses the package; the package
//! carries its kernel set like `xdna pack import` writes it (also restored on reuse when missing).

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
    assert_eq!(pkg.config().layers, 30);
    // The kernel set, by hand from SmolLM2's shapes (hidden 576, 9 + 2×3 heads of 64, ffn 1536,
    // vocab 49152): fused QKV N 960, O N 576, fused gate+up N 3072, down K 1536, lm_head (the
    // tied q8 embedding) N 49152; f16-scale tiles; families 16 and 128.
    let mut want: Vec<String> = Vec::new();
    for fam in [16, 128] {
        for (w, k, n) in [
            ("q41h", 576, 960),
            ("q41h", 576, 576),
            ("q41h", 576, 3072),
            ("q41h", 1536, 576),
            ("q8h", 576, 49152),
        ] {
            want.push(format!("gemm_{w}_m{fam}_k{k}_n{n}.elf"));
        }
    }
    want.push("shapes.txt".into());
    want.sort();
    let kernels_dir = dir.join("kernels");
    let listing = || {
        let mut v: Vec<String> = std::fs::read_dir(&kernels_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(listing(), want);
    for name in want.iter().filter(|n| n.ends_with(".elf")) {
        let desc = xdna::kernels::elf::read_kernel(&kernels_dir.join(name)).unwrap();
        assert_eq!(&desc.file_name(), name);
    }
    let shapes = std::fs::read_to_string(kernels_dir.join("shapes.txt")).unwrap();
    assert!(shapes.contains("gemm q8h 128 576 49152\n"), "{shapes}");
    assert_eq!(
        shapes.lines().filter(|l| l.starts_with("gemm ")).count(),
        10
    );
    // A package imported before kernel sets existed gets one on reuse, without re-importing.
    std::fs::remove_dir_all(&kernels_dir).unwrap();
    assert_eq!(default_model().unwrap(), dir);
    assert_eq!(listing(), want);
    assert_eq!(
        std::fs::metadata(dir.join("model.q4nx"))
            .unwrap()
            .modified()
            .unwrap(),
        mtime
    );
    let _ = std::fs::remove_dir_all(&cache);
}
