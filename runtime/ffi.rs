//! Placeholder: raw amdxdna UAPI bindings (generated into ffi/bindings.rs).
