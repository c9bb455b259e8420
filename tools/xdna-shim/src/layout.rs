//! The shim parses ioctl structs by byte offset (so short, long and malformed structs are handled
//! like the DRM core does). These compile-time checks tie every offset it uses to the project's
//! UAPI bindings (`xdna::ffi`, generated from `ffi/amdxdna_uapi.h`): if the bindings change, the
//! shim stops compiling instead of silently disagreeing with the runtime.

use std::mem::{offset_of, size_of};
use xdna::ffi::*;

macro_rules! at {
    ($t:ty, $f:ident, $o:expr) => {
        const _: () = assert!(
            offset_of!($t, $f) == $o,
            concat!(stringify!($t), ".", stringify!($f))
        );
    };
}
macro_rules! size {
    ($t:ty, $s:expr) => {
        const _: () = assert!(size_of::<$t>() == $s, concat!("sizeof ", stringify!($t)));
    };
}

size!(drm_version, 64);
at!(drm_version, version_major, 0);
at!(drm_version, version_minor, 4);
at!(drm_version, name_len, 16);
at!(drm_version, name, 24);
at!(drm_version, date_len, 32);
at!(drm_version, desc_len, 48);
at!(drm_get_cap, value, 8);
at!(drm_prime_handle, flags, 4);
at!(drm_prime_handle, fd, 8);
at!(drm_syncobj_create, flags, 4);
at!(drm_syncobj_destroy, pad, 4);
at!(drm_syncobj_wait, count_handles, 16);
at!(drm_syncobj_wait, flags, 20);
at!(drm_syncobj_wait, first_signaled, 24);
at!(drm_syncobj_timeline_wait, points, 8);
at!(drm_syncobj_timeline_wait, count_handles, 24);
at!(drm_syncobj_timeline_wait, flags, 28);
at!(drm_syncobj_timeline_wait, first_signaled, 32);
at!(drm_syncobj_timeline_array, points, 8);
at!(drm_syncobj_eventfd, point, 8);
at!(drm_syncobj_eventfd, fd, 16);
at!(drm_syncobj_eventfd, pad, 20);
at!(drm_syncobj_timeline_array, count_handles, 16);
at!(udmabuf_create, flags, 4);
at!(udmabuf_create, offset, 8);
at!(udmabuf_create, size, 16);

size!(amdxdna_drm_create_hwctx, 56);
at!(amdxdna_drm_create_hwctx, ext_flags, 8);
at!(amdxdna_drm_create_hwctx, qos_p, 16);
at!(amdxdna_drm_create_hwctx, num_tiles, 36);
at!(amdxdna_drm_create_hwctx, handle, 48);
at!(amdxdna_drm_create_hwctx, syncobj_handle, 52);
size!(amdxdna_qos_info, 24);
size!(amdxdna_qos_info_oot, 32);
at!(amdxdna_drm_destroy_hwctx, pad, 4);
at!(amdxdna_drm_config_hwctx, param_type, 4);
at!(amdxdna_drm_config_hwctx, param_val, 8);
at!(amdxdna_drm_config_hwctx, param_val_size, 16);
at!(amdxdna_drm_config_hwctx, pad, 20);
size!(amdxdna_cu_config, 8);
at!(amdxdna_cu_config, cu_func, 4);
size!(amdxdna_hwctx_param_config_cu, 8);
at!(amdxdna_drm_create_bo, vaddr, 8);
at!(amdxdna_drm_create_bo, size, 16);
at!(amdxdna_drm_create_bo, type_, 24);
at!(amdxdna_drm_create_bo, handle, 28);
at!(amdxdna_drm_va_tbl, num_entries, 4);
at!(amdxdna_drm_get_bo_info, handle, 16);
at!(amdxdna_drm_get_bo_info, pad, 20);
at!(amdxdna_drm_get_bo_info, map_offset, 24);
at!(amdxdna_drm_get_bo_info, vaddr, 32);
at!(amdxdna_drm_get_bo_info, xdna_addr, 40);
at!(amdxdna_drm_sync_bo, direction, 4);
at!(amdxdna_drm_sync_bo, offset, 8);
at!(amdxdna_drm_sync_bo, size, 16);
at!(amdxdna_drm_exec_cmd, hwctx, 16);
at!(amdxdna_drm_exec_cmd, type_, 20);
at!(amdxdna_drm_exec_cmd, cmd_handles, 24);
at!(amdxdna_drm_exec_cmd, args, 32);
at!(amdxdna_drm_exec_cmd, cmd_count, 40);
at!(amdxdna_drm_exec_cmd, arg_count, 44);
at!(amdxdna_drm_exec_cmd, seq, 48);
at!(amdxdna_drm_wait_cmd, seq, 8);
at!(amdxdna_drm_get_info, buffer_size, 4);
at!(amdxdna_drm_get_info, buffer, 8);
at!(amdxdna_drm_get_array, element_size, 4);
at!(amdxdna_drm_get_array, num_element, 8);
at!(amdxdna_drm_get_array, pad, 12);
at!(amdxdna_drm_get_array, buffer, 16);
at!(amdxdna_drm_set_state, buffer, 8);
size!(amdxdna_drm_query_aie_metadata, 64);
at!(amdxdna_drm_query_aie_metadata, cols, 4);
at!(amdxdna_drm_query_aie_metadata, core, 16);
at!(amdxdna_drm_query_aie_metadata, mem, 32);
at!(amdxdna_drm_query_aie_metadata, shim, 48);
size!(amdxdna_drm_query_clock_metadata, 48);
size!(amdxdna_drm_query_firmware_version, 16);
size!(amdxdna_drm_get_resource_info, 40);
at!(amdxdna_drm_get_resource_info, npu_task_max, 16);
at!(amdxdna_drm_get_resource_info, npu_task_curr, 32);
size!(amdxdna_drm_query_hwctx, 64);
at!(amdxdna_drm_query_hwctx, num_col, 8);
at!(amdxdna_drm_query_hwctx, pid, 16);
at!(amdxdna_drm_query_hwctx, command_submissions, 24);
at!(amdxdna_drm_query_hwctx, command_completions, 32);
at!(amdxdna_drm_query_hwctx, errors, 56);
at!(amdxdna_drm_hwctx_entry, num_col, 8);
at!(amdxdna_drm_hwctx_entry, hwctx_id, 12);
at!(amdxdna_drm_hwctx_entry, pid, 16);
at!(amdxdna_drm_hwctx_entry, command_submissions, 24);
at!(amdxdna_drm_hwctx_entry, command_completions, 32);
at!(amdxdna_drm_hwctx_entry, errors, 56);
at!(amdxdna_drm_hwctx_entry, priority, 64);
at!(amdxdna_drm_hwctx_entry, heap_usage, 72);
at!(amdxdna_drm_hwctx_entry, state, 88);
size!(ert_npu_data, 16);
at!(ert_npu_data, instruction_buffer_size, 8);
size!(ert_npu_preempt_data, 40);
at!(ert_npu_preempt_data, save_buffer, 8);
at!(ert_npu_preempt_data, restore_buffer, 16);
at!(ert_npu_preempt_data, instruction_buffer_size, 24);
at!(ert_npu_preempt_data, save_buffer_size, 28);
at!(ert_npu_preempt_data, restore_buffer_size, 32);
at!(ert_cmd_chain_data, error_index, 8);
