//! Build script: compiles the C layout probe (always) and, with the `bindgen`
//! feature, regenerates `ffi/bindings.rs` from `ffi/amdxdna_uapi.h`.
//!
//! A normal build never touches libclang: the bindings are checked in.

fn main() {
    println!("cargo:rerun-if-changed=ffi/amdxdna_uapi.h");
    println!("cargo:rerun-if-changed=ffi/probe.c");
    println!("cargo:rerun-if-changed=build.rs");

    cc::Build::new()
        .file("ffi/probe.c")
        .include("ffi")
        .warnings(true)
        .compile("xdna_probe");

    #[cfg(feature = "bindgen")]
    regenerate_bindings();
}

/// Regenerates `ffi/bindings.rs`. Deterministic: no comments, no host paths,
/// fixed Rust target, sorted by source order of the header.
#[cfg(feature = "bindgen")]
fn regenerate_bindings() {
    let bindings = bindgen::Builder::default()
        .header("ffi/amdxdna_uapi.h")
        .clang_arg("-target")
        .clang_arg("x86_64-unknown-linux-gnu")
        .use_core()
        .ctypes_prefix("core::ffi")
        .allowlist_type("(amdxdna|drm|udmabuf|ert)_.*")
        .allowlist_var("(AMDXDNA|DRM|ERT|UDMABUF|SYNC|POWER)_.*")
        .blocklist_item("XDNA_IOC.*")
        .blocklist_item("AMDXDNA_INVALID_ADDR")
        .derive_default(true)
        .derive_debug(true)
        .derive_copy(true)
        .derive_eq(true)
        .layout_tests(true)
        .generate_comments(false)
        .rust_target(bindgen::RustTarget::Stable_1_77)
        .generate();
    let bindings = match bindings {
        Ok(b) => b,
        Err(e) => {
            println!("cargo:warning=bindgen failed: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = bindings.write_to_file("ffi/bindings.rs") {
        println!("cargo:warning=writing ffi/bindings.rs failed: {e}");
        std::process::exit(1);
    }
}
