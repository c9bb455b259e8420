//! The runtime's xdna backend and the `xdna` CLI against the fake amdxdna device
//! (tools/xdna-shim), each in a child process started with `LD_PRELOAD`.
//!
//! Needs `target/<profile>/libxdna_shim.so` and `target/<profile>/xdna`: `cargo build --workspace`.

mod shim_support;

use shim_support::*;

#[test]
fn xdna_info_json_shows_the_fake_device() {
    let xdna = bin_path("xdna");
    assert!(xdna.exists(), "{} missing: build it with `cargo build --workspace`", xdna.display());
    let out = std::process::Command::new(&xdna)
        .args(["info", "--json"])
        .env("LD_PRELOAD", shim_path())
        .env("XDNA_SHIM_VBNV", "RyzenAI-npu4-shim")
        .env("XDNA_SHIM_COLUMNS", "6")
        .env_remove("XDNA_BACKEND")
        .env_remove("XDNA_DEVICE")
        .output()
        .expect("run xdna info");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "xdna info --json failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}"));
    let text = v.to_string();
    for want in ["amdxdna_accel_driver", "RyzenAI-npu4-shim", "1.5.2.380"] {
        assert!(text.contains(want), "`{want}` missing from xdna info --json:\n{stdout}");
    }
}
