//! Placeholder: the fake amdxdna device.
