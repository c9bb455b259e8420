/* SPDX-License-Identifier: MIT */
/*
 * probe.c — the C compiler's view of ffi/amdxdna_uapi.h, linked into the
 * xdna crate so tests can compare it with Rust's view (size_of, offset_of,
 * request numbers computed in Rust).
 *
 * Keys: "sizeof:<struct>", "offsetof:<struct>.<field>", "ioctl:<MACRO>",
 * "const:<MACRO>".
 */
#include <stddef.h>
#include <string.h>

#include "amdxdna_uapi.h"

struct xdna_probe_entry {
	const char *key;
	unsigned long long value;
};

#define S(T) { "sizeof:" #T, sizeof(struct T) },
#define O(T, f) { "offsetof:" #T "." #f, offsetof(struct T, f) },
#define I(R) { "ioctl:" #R, (unsigned long long)(R) },
#define C(K) { "const:" #K, (unsigned long long)(K) },

static const struct xdna_probe_entry entries[] = {
	/* DRM core */
	S(drm_version)
	O(drm_version, version_major) O(drm_version, version_minor)
	O(drm_version, version_patchlevel) O(drm_version, name_len)
	O(drm_version, name) O(drm_version, date_len) O(drm_version, date)
	O(drm_version, desc_len) O(drm_version, desc)
	S(drm_gem_close) O(drm_gem_close, handle) O(drm_gem_close, pad)
	S(drm_get_cap) O(drm_get_cap, capability) O(drm_get_cap, value)
	S(drm_prime_handle) O(drm_prime_handle, handle)
	O(drm_prime_handle, flags) O(drm_prime_handle, fd)
	S(drm_syncobj_create) O(drm_syncobj_create, handle)
	O(drm_syncobj_create, flags)
	S(drm_syncobj_destroy) O(drm_syncobj_destroy, handle)
	O(drm_syncobj_destroy, pad)
	S(drm_syncobj_handle) O(drm_syncobj_handle, handle)
	O(drm_syncobj_handle, flags) O(drm_syncobj_handle, fd)
	O(drm_syncobj_handle, pad) O(drm_syncobj_handle, point)
	S(drm_syncobj_wait) O(drm_syncobj_wait, handles)
	O(drm_syncobj_wait, timeout_nsec) O(drm_syncobj_wait, count_handles)
	O(drm_syncobj_wait, flags) O(drm_syncobj_wait, first_signaled)
	O(drm_syncobj_wait, pad) O(drm_syncobj_wait, deadline_nsec)
	S(drm_syncobj_timeline_wait) O(drm_syncobj_timeline_wait, handles)
	O(drm_syncobj_timeline_wait, points)
	O(drm_syncobj_timeline_wait, timeout_nsec)
	O(drm_syncobj_timeline_wait, count_handles)
	O(drm_syncobj_timeline_wait, flags)
	O(drm_syncobj_timeline_wait, first_signaled)
	O(drm_syncobj_timeline_wait, pad)
	O(drm_syncobj_timeline_wait, deadline_nsec)
	S(drm_syncobj_timeline_array) O(drm_syncobj_timeline_array, handles)
	O(drm_syncobj_timeline_array, points)
	O(drm_syncobj_timeline_array, count_handles)
	O(drm_syncobj_timeline_array, flags)
	S(drm_syncobj_eventfd) O(drm_syncobj_eventfd, handle)
	O(drm_syncobj_eventfd, flags) O(drm_syncobj_eventfd, point)
	O(drm_syncobj_eventfd, fd) O(drm_syncobj_eventfd, pad)
	/* udmabuf */
	S(udmabuf_create) O(udmabuf_create, memfd) O(udmabuf_create, flags)
	O(udmabuf_create, offset) O(udmabuf_create, size)
	S(udmabuf_create_item) O(udmabuf_create_item, memfd)
	O(udmabuf_create_item, __pad) O(udmabuf_create_item, offset)
	O(udmabuf_create_item, size)
	S(udmabuf_create_list) O(udmabuf_create_list, flags)
	O(udmabuf_create_list, count)
	/* amdxdna */
	S(amdxdna_qos_info) O(amdxdna_qos_info, gops) O(amdxdna_qos_info, fps)
	O(amdxdna_qos_info, dma_bandwidth) O(amdxdna_qos_info, latency)
	O(amdxdna_qos_info, frame_exec_time) O(amdxdna_qos_info, priority)
	S(amdxdna_qos_info_oot) O(amdxdna_qos_info_oot, priority)
	O(amdxdna_qos_info_oot, user_start_col)
	O(amdxdna_qos_info_oot, reserved)
	S(amdxdna_drm_create_hwctx) O(amdxdna_drm_create_hwctx, ext)
	O(amdxdna_drm_create_hwctx, ext_flags) O(amdxdna_drm_create_hwctx, qos_p)
	O(amdxdna_drm_create_hwctx, umq_bo) O(amdxdna_drm_create_hwctx, log_buf_bo)
	O(amdxdna_drm_create_hwctx, max_opc) O(amdxdna_drm_create_hwctx, num_tiles)
	O(amdxdna_drm_create_hwctx, mem_size)
	O(amdxdna_drm_create_hwctx, umq_doorbell)
	O(amdxdna_drm_create_hwctx, handle)
	O(amdxdna_drm_create_hwctx, syncobj_handle)
	S(amdxdna_drm_destroy_hwctx) O(amdxdna_drm_destroy_hwctx, handle)
	O(amdxdna_drm_destroy_hwctx, pad)
	S(amdxdna_cu_config) O(amdxdna_cu_config, cu_bo)
	O(amdxdna_cu_config, cu_func) O(amdxdna_cu_config, pad)
	S(amdxdna_hwctx_param_config_cu) O(amdxdna_hwctx_param_config_cu, num_cus)
	O(amdxdna_hwctx_param_config_cu, pad)
	S(amdxdna_drm_config_hwctx) O(amdxdna_drm_config_hwctx, handle)
	O(amdxdna_drm_config_hwctx, param_type)
	O(amdxdna_drm_config_hwctx, param_val)
	O(amdxdna_drm_config_hwctx, param_val_size)
	O(amdxdna_drm_config_hwctx, pad)
	S(amdxdna_drm_va_entry) O(amdxdna_drm_va_entry, vaddr)
	O(amdxdna_drm_va_entry, len)
	S(amdxdna_drm_va_tbl) O(amdxdna_drm_va_tbl, dmabuf_fd)
	O(amdxdna_drm_va_tbl, num_entries)
	S(amdxdna_drm_create_bo) O(amdxdna_drm_create_bo, flags)
	O(amdxdna_drm_create_bo, vaddr) O(amdxdna_drm_create_bo, size)
	O(amdxdna_drm_create_bo, type) O(amdxdna_drm_create_bo, handle)
	S(amdxdna_drm_get_bo_info) O(amdxdna_drm_get_bo_info, ext)
	O(amdxdna_drm_get_bo_info, ext_flags) O(amdxdna_drm_get_bo_info, handle)
	O(amdxdna_drm_get_bo_info, pad) O(amdxdna_drm_get_bo_info, map_offset)
	O(amdxdna_drm_get_bo_info, vaddr) O(amdxdna_drm_get_bo_info, xdna_addr)
	S(amdxdna_drm_sync_bo) O(amdxdna_drm_sync_bo, handle)
	O(amdxdna_drm_sync_bo, direction) O(amdxdna_drm_sync_bo, offset)
	O(amdxdna_drm_sync_bo, size)
	S(amdxdna_drm_exec_cmd) O(amdxdna_drm_exec_cmd, ext)
	O(amdxdna_drm_exec_cmd, ext_flags) O(amdxdna_drm_exec_cmd, hwctx)
	O(amdxdna_drm_exec_cmd, type) O(amdxdna_drm_exec_cmd, cmd_handles)
	O(amdxdna_drm_exec_cmd, args) O(amdxdna_drm_exec_cmd, cmd_count)
	O(amdxdna_drm_exec_cmd, arg_count) O(amdxdna_drm_exec_cmd, seq)
	S(amdxdna_drm_wait_cmd) O(amdxdna_drm_wait_cmd, hwctx)
	O(amdxdna_drm_wait_cmd, timeout) O(amdxdna_drm_wait_cmd, seq)
	S(amdxdna_drm_query_aie_status) O(amdxdna_drm_query_aie_status, buffer)
	O(amdxdna_drm_query_aie_status, buffer_size)
	O(amdxdna_drm_query_aie_status, cols_filled)
	S(amdxdna_drm_query_aie_version) O(amdxdna_drm_query_aie_version, major)
	O(amdxdna_drm_query_aie_version, minor)
	S(amdxdna_drm_query_aie_tile_metadata)
	O(amdxdna_drm_query_aie_tile_metadata, row_count)
	O(amdxdna_drm_query_aie_tile_metadata, row_start)
	O(amdxdna_drm_query_aie_tile_metadata, dma_channel_count)
	O(amdxdna_drm_query_aie_tile_metadata, lock_count)
	O(amdxdna_drm_query_aie_tile_metadata, event_reg_count)
	O(amdxdna_drm_query_aie_tile_metadata, pad)
	S(amdxdna_drm_query_aie_metadata)
	O(amdxdna_drm_query_aie_metadata, col_size)
	O(amdxdna_drm_query_aie_metadata, cols)
	O(amdxdna_drm_query_aie_metadata, rows)
	O(amdxdna_drm_query_aie_metadata, version)
	O(amdxdna_drm_query_aie_metadata, core)
	O(amdxdna_drm_query_aie_metadata, mem)
	O(amdxdna_drm_query_aie_metadata, shim)
	S(amdxdna_drm_query_clock) O(amdxdna_drm_query_clock, name)
	O(amdxdna_drm_query_clock, freq_mhz) O(amdxdna_drm_query_clock, pad)
	S(amdxdna_drm_query_clock_metadata)
	O(amdxdna_drm_query_clock_metadata, mp_npu_clock)
	O(amdxdna_drm_query_clock_metadata, h_clock)
	S(amdxdna_drm_query_sensor) O(amdxdna_drm_query_sensor, label)
	O(amdxdna_drm_query_sensor, input) O(amdxdna_drm_query_sensor, max)
	O(amdxdna_drm_query_sensor, average) O(amdxdna_drm_query_sensor, highest)
	O(amdxdna_drm_query_sensor, status) O(amdxdna_drm_query_sensor, units)
	O(amdxdna_drm_query_sensor, unitm) O(amdxdna_drm_query_sensor, type)
	O(amdxdna_drm_query_sensor, pad)
	S(amdxdna_drm_query_hwctx) O(amdxdna_drm_query_hwctx, context_id)
	O(amdxdna_drm_query_hwctx, start_col) O(amdxdna_drm_query_hwctx, num_col)
	O(amdxdna_drm_query_hwctx, pad) O(amdxdna_drm_query_hwctx, pid)
	O(amdxdna_drm_query_hwctx, command_submissions)
	O(amdxdna_drm_query_hwctx, command_completions)
	O(amdxdna_drm_query_hwctx, migrations)
	O(amdxdna_drm_query_hwctx, preemptions)
	O(amdxdna_drm_query_hwctx, errors)
	S(amdxdna_drm_query_firmware_version)
	O(amdxdna_drm_query_firmware_version, major)
	O(amdxdna_drm_query_firmware_version, minor)
	O(amdxdna_drm_query_firmware_version, patch)
	O(amdxdna_drm_query_firmware_version, build)
	S(amdxdna_drm_get_power_mode) O(amdxdna_drm_get_power_mode, power_mode)
	O(amdxdna_drm_get_power_mode, pad)
	S(amdxdna_drm_get_resource_info)
	O(amdxdna_drm_get_resource_info, npu_clk_max)
	O(amdxdna_drm_get_resource_info, npu_tops_max)
	O(amdxdna_drm_get_resource_info, npu_task_max)
	O(amdxdna_drm_get_resource_info, npu_tops_curr)
	O(amdxdna_drm_get_resource_info, npu_task_curr)
	S(amdxdna_drm_attribute_state) O(amdxdna_drm_attribute_state, state)
	O(amdxdna_drm_attribute_state, pad)
	S(amdxdna_drm_get_info) O(amdxdna_drm_get_info, param)
	O(amdxdna_drm_get_info, buffer_size) O(amdxdna_drm_get_info, buffer)
	S(amdxdna_drm_hwctx_entry) O(amdxdna_drm_hwctx_entry, context_id)
	O(amdxdna_drm_hwctx_entry, start_col) O(amdxdna_drm_hwctx_entry, num_col)
	O(amdxdna_drm_hwctx_entry, hwctx_id) O(amdxdna_drm_hwctx_entry, pid)
	O(amdxdna_drm_hwctx_entry, command_submissions)
	O(amdxdna_drm_hwctx_entry, command_completions)
	O(amdxdna_drm_hwctx_entry, migrations)
	O(amdxdna_drm_hwctx_entry, preemptions)
	O(amdxdna_drm_hwctx_entry, errors) O(amdxdna_drm_hwctx_entry, priority)
	O(amdxdna_drm_hwctx_entry, heap_usage)
	O(amdxdna_drm_hwctx_entry, suspensions) O(amdxdna_drm_hwctx_entry, state)
	O(amdxdna_drm_hwctx_entry, pasid) O(amdxdna_drm_hwctx_entry, gops)
	O(amdxdna_drm_hwctx_entry, fps) O(amdxdna_drm_hwctx_entry, dma_bandwidth)
	O(amdxdna_drm_hwctx_entry, latency)
	O(amdxdna_drm_hwctx_entry, frame_exec_time)
	O(amdxdna_drm_hwctx_entry, txn_op_idx) O(amdxdna_drm_hwctx_entry, ctx_pc)
	O(amdxdna_drm_hwctx_entry, fatal_error_type)
	O(amdxdna_drm_hwctx_entry, fatal_error_exception_type)
	O(amdxdna_drm_hwctx_entry, fatal_error_exception_pc)
	O(amdxdna_drm_hwctx_entry, fatal_error_app_module)
	O(amdxdna_drm_hwctx_entry, pad)
	S(amdxdna_async_error) O(amdxdna_async_error, err_code)
	O(amdxdna_async_error, ts_us) O(amdxdna_async_error, ex_err_code)
	S(amdxdna_drm_bo_usage) O(amdxdna_drm_bo_usage, pid)
	O(amdxdna_drm_bo_usage, total_usage)
	O(amdxdna_drm_bo_usage, internal_usage)
	O(amdxdna_drm_bo_usage, heap_usage)
	S(amdxdna_drm_get_array) O(amdxdna_drm_get_array, param)
	O(amdxdna_drm_get_array, element_size)
	O(amdxdna_drm_get_array, num_element) O(amdxdna_drm_get_array, pad)
	O(amdxdna_drm_get_array, buffer)
	S(amdxdna_drm_set_power_mode) O(amdxdna_drm_set_power_mode, power_mode)
	O(amdxdna_drm_set_power_mode, pad)
	S(amdxdna_drm_set_state) O(amdxdna_drm_set_state, param)
	O(amdxdna_drm_set_state, buffer_size) O(amdxdna_drm_set_state, buffer)
	S(amdxdna_cmd_header) O(amdxdna_cmd_header, header)
	S(ert_npu_data) O(ert_npu_data, instruction_buffer)
	O(ert_npu_data, instruction_buffer_size)
	O(ert_npu_data, instruction_prop_count)
	S(ert_npu_preempt_data) O(ert_npu_preempt_data, instruction_buffer)
	O(ert_npu_preempt_data, save_buffer)
	O(ert_npu_preempt_data, restore_buffer)
	O(ert_npu_preempt_data, instruction_buffer_size)
	O(ert_npu_preempt_data, save_buffer_size)
	O(ert_npu_preempt_data, restore_buffer_size)
	O(ert_npu_preempt_data, instruction_prop_count)
	S(ert_cmd_chain_data) O(ert_cmd_chain_data, command_count)
	O(ert_cmd_chain_data, submit_index) O(ert_cmd_chain_data, error_index)
	O(ert_cmd_chain_data, reserved)
	/* request values */
	I(DRM_IOCTL_VERSION) I(DRM_IOCTL_GEM_CLOSE) I(DRM_IOCTL_GET_CAP)
	I(DRM_IOCTL_PRIME_HANDLE_TO_FD) I(DRM_IOCTL_PRIME_FD_TO_HANDLE)
	I(DRM_IOCTL_SYNCOBJ_CREATE) I(DRM_IOCTL_SYNCOBJ_DESTROY)
	I(DRM_IOCTL_SYNCOBJ_HANDLE_TO_FD) I(DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE)
	I(DRM_IOCTL_SYNCOBJ_WAIT) I(DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT)
	I(DRM_IOCTL_SYNCOBJ_QUERY) I(DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL)
	I(DRM_IOCTL_SYNCOBJ_EVENTFD)
	I(UDMABUF_CREATE) I(UDMABUF_CREATE_LIST)
	I(DRM_IOCTL_AMDXDNA_CREATE_HWCTX) I(DRM_IOCTL_AMDXDNA_DESTROY_HWCTX)
	I(DRM_IOCTL_AMDXDNA_CONFIG_HWCTX) I(DRM_IOCTL_AMDXDNA_CREATE_BO)
	I(DRM_IOCTL_AMDXDNA_GET_BO_INFO) I(DRM_IOCTL_AMDXDNA_SYNC_BO)
	I(DRM_IOCTL_AMDXDNA_EXEC_CMD) I(DRM_IOCTL_AMDXDNA_GET_INFO)
	I(DRM_IOCTL_AMDXDNA_SET_STATE) I(DRM_IOCTL_AMDXDNA_WAIT_CMD)
	I(DRM_IOCTL_AMDXDNA_WAIT_CMD_UPSTREAM) I(DRM_IOCTL_AMDXDNA_GET_ARRAY)
	/* constants */
	C(AMDXDNA_BO_SHARE) C(AMDXDNA_BO_DEV_HEAP) C(AMDXDNA_BO_DEV)
	C(AMDXDNA_BO_CMD) C(ERT_START_CU) C(ERT_START_NPU)
	C(ERT_START_NPU_PREEMPT_ELF) C(ERT_CMD_STATE_COMPLETED)
	C(DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT) C(DRM_CLOEXEC) C(DRM_RDWR)
	C(AMDXDNA_INVALID_ADDR)
};

/* Number of entries in the probe table. */
unsigned long xdna_probe_count(void)
{
	return sizeof(entries) / sizeof(entries[0]);
}

/* Key of entry `i`, or NULL past the end. */
const char *xdna_probe_key(unsigned long i)
{
	if (i >= sizeof(entries) / sizeof(entries[0]))
		return NULL;
	return entries[i].key;
}

/* Looks up `key`; returns 1 and stores the value when found, else 0. */
int xdna_probe_lookup(const char *key, unsigned long long *out)
{
	unsigned long i;

	for (i = 0; i < sizeof(entries) / sizeof(entries[0]); i++) {
		if (strcmp(entries[i].key, key) == 0) {
			*out = entries[i].value;
			return 1;
		}
	}
	return 0;
}
