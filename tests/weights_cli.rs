//! `xdna pack import | info | compare` end to end on the real SmolLM2 GGUF (skipped without it).

#[path = "support/smollm2.rs"]
mod smollm2;
use std::process::Command;

#[test]
fn pack_import_info_compare() {
    let Some(g) = smollm2::smollm2_gguf() else {
        return;
    };
    let exe = env!("CARGO_BIN_EXE_xdna");
    let dir = std::env::temp_dir().join(format!("xdna-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(exe)
        .args(["pack", "import", "--quiet", "-o"])
        .arg(&dir)
        .arg(&g)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info = Command::new(exe)
        .args(["pack", "info"])
        .arg(&dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(info.status.success());
    assert!(text.contains("fused true"), "{text}");
    assert!(text.contains("model.layers.0.self_attn.qkv_proj.weight"));
    assert!(text.contains("960x576"));
    assert!(text.contains("total: 182 tensors"));
    let ginfo = Command::new(exe)
        .args(["pack", "info"])
        .arg(&g)
        .output()
        .unwrap();
    let gtext = String::from_utf8_lossy(&ginfo.stdout);
    assert!(
        gtext.contains("GGUF v3") && gtext.contains("total: 272 tensors"),
        "{gtext}"
    );
    let cmp = Command::new(exe)
        .args(["pack", "compare"])
        .arg(&dir)
        .arg(&g)
        .output()
        .unwrap();
    let ctext = String::from_utf8_lossy(&cmp.stdout);
    assert!(
        ctext.contains("q4_1  values  106168320  max_abs 0.000e0"),
        "{ctext}"
    );
    assert!(
        ctext.contains("q8    values   28311552  max_abs 0.000e0"),
        "{ctext}"
    );
    // Errors name the file and go to stderr with a non-zero exit.
    let bad = Command::new(exe)
        .args(["pack", "info", "/nonexistent.gguf"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("/nonexistent.gguf"));
    let _ = std::fs::remove_dir_all(&dir);
}
