//! The Rust view of the UAPI (bindgen structs, request numbers computed in
//! Rust) against two independent references: the C compiler (ffi/probe.c)
//! and the literal numbers of docs/protocol.md (§2, §3, §5.1, §5.2, §7, §9).

// `Request` is c_ulong: u64 here, so u64::from is a no-op on x86_64 only.
#![allow(clippy::useless_conversion)]

use core::mem::{offset_of, size_of};
use xdna::ffi::{self, probe};

fn c(key: &str) -> u64 {
    match probe::lookup(key) {
        Some(v) => v,
        None => panic!("C probe has no entry {key}"),
    }
}

/// size_of and every listed field offset agree with the C probe.
macro_rules! check_struct {
    ($t:ident { $($f:ident),* $(,)? }) => {{
        assert_eq!(
            size_of::<ffi::$t>() as u64,
            c(concat!("sizeof:", stringify!($t))),
            "sizeof {}",
            stringify!($t)
        );
        $(
            assert_eq!(
                offset_of!(ffi::$t, $f) as u64,
                // bindgen renames the C field `type` to `type_`.
                c(&format!(
                    "offsetof:{}.{}",
                    stringify!($t),
                    stringify!($f).trim_end_matches('_')
                )),
                "offsetof {}.{}",
                stringify!($t),
                stringify!($f)
            );
        )*
    }};
}

#[test]
fn structs_match_c_probe() {
    check_struct!(drm_version {
        version_major,
        version_minor,
        version_patchlevel,
        name_len,
        name,
        date_len,
        date,
        desc_len,
        desc
    });
    check_struct!(drm_gem_close { handle, pad });
    check_struct!(drm_get_cap { capability, value });
    check_struct!(drm_prime_handle { handle, flags, fd });
    check_struct!(drm_syncobj_create { handle, flags });
    check_struct!(drm_syncobj_destroy { handle, pad });
    check_struct!(drm_syncobj_handle {
        handle,
        flags,
        fd,
        pad,
        point
    });
    check_struct!(drm_syncobj_wait {
        handles,
        timeout_nsec,
        count_handles,
        flags,
        first_signaled,
        pad,
        deadline_nsec
    });
    check_struct!(drm_syncobj_timeline_wait {
        handles,
        points,
        timeout_nsec,
        count_handles,
        flags,
        first_signaled,
        pad,
        deadline_nsec
    });
    check_struct!(drm_syncobj_timeline_array {
        handles,
        points,
        count_handles,
        flags
    });
    check_struct!(drm_syncobj_eventfd {
        handle,
        flags,
        point,
        fd,
        pad
    });
    check_struct!(udmabuf_create {
        memfd,
        flags,
        offset,
        size
    });
    check_struct!(udmabuf_create_item {
        memfd,
        __pad,
        offset,
        size
    });
    check_struct!(udmabuf_create_list { flags, count });
    check_struct!(amdxdna_qos_info {
        gops,
        fps,
        dma_bandwidth,
        latency,
        frame_exec_time,
        priority
    });
    check_struct!(amdxdna_qos_info_oot {
        priority,
        user_start_col,
        reserved
    });
    check_struct!(amdxdna_drm_create_hwctx {
        ext,
        ext_flags,
        qos_p,
        umq_bo,
        log_buf_bo,
        max_opc,
        num_tiles,
        mem_size,
        umq_doorbell,
        handle,
        syncobj_handle
    });
    check_struct!(amdxdna_drm_destroy_hwctx { handle, pad });
    check_struct!(amdxdna_cu_config {
        cu_bo,
        cu_func,
        pad
    });
    check_struct!(amdxdna_hwctx_param_config_cu { num_cus, pad });
    check_struct!(amdxdna_drm_config_hwctx {
        handle,
        param_type,
        param_val,
        param_val_size,
        pad
    });
    check_struct!(amdxdna_drm_va_entry { vaddr, len });
    check_struct!(amdxdna_drm_va_tbl {
        dmabuf_fd,
        num_entries
    });
    check_struct!(amdxdna_drm_create_bo {
        flags,
        vaddr,
        size,
        type_,
        handle
    });
    check_struct!(amdxdna_drm_get_bo_info {
        ext,
        ext_flags,
        handle,
        pad,
        map_offset,
        vaddr,
        xdna_addr
    });
    check_struct!(amdxdna_drm_sync_bo {
        handle,
        direction,
        offset,
        size
    });
    check_struct!(amdxdna_drm_exec_cmd {
        ext,
        ext_flags,
        hwctx,
        type_,
        cmd_handles,
        args,
        cmd_count,
        arg_count,
        seq
    });
    check_struct!(amdxdna_drm_wait_cmd {
        hwctx,
        timeout,
        seq
    });
    check_struct!(amdxdna_drm_query_aie_status {
        buffer,
        buffer_size,
        cols_filled
    });
    check_struct!(amdxdna_drm_query_aie_version { major, minor });
    check_struct!(amdxdna_drm_query_aie_tile_metadata {
        row_count,
        row_start,
        dma_channel_count,
        lock_count,
        event_reg_count,
        pad
    });
    check_struct!(amdxdna_drm_query_aie_metadata {
        col_size,
        cols,
        rows,
        version,
        core,
        mem,
        shim
    });
    check_struct!(amdxdna_drm_query_clock {
        name,
        freq_mhz,
        pad
    });
    check_struct!(amdxdna_drm_query_clock_metadata {
        mp_npu_clock,
        h_clock
    });
    check_struct!(amdxdna_drm_query_sensor {
        label,
        input,
        max,
        average,
        highest,
        status,
        units,
        unitm,
        type_,
        pad
    });
    check_struct!(amdxdna_drm_query_hwctx {
        context_id,
        start_col,
        num_col,
        pad,
        pid,
        command_submissions,
        command_completions,
        migrations,
        preemptions,
        errors
    });
    check_struct!(amdxdna_drm_query_firmware_version {
        major,
        minor,
        patch,
        build
    });
    check_struct!(amdxdna_drm_get_power_mode { power_mode, pad });
    check_struct!(amdxdna_drm_get_resource_info {
        npu_clk_max,
        npu_tops_max,
        npu_task_max,
        npu_tops_curr,
        npu_task_curr
    });
    check_struct!(amdxdna_drm_attribute_state { state, pad });
    check_struct!(amdxdna_drm_get_info {
        param,
        buffer_size,
        buffer
    });
    check_struct!(amdxdna_drm_hwctx_entry {
        context_id,
        start_col,
        num_col,
        hwctx_id,
        pid,
        command_submissions,
        command_completions,
        migrations,
        preemptions,
        errors,
        priority,
        heap_usage,
        suspensions,
        state,
        pasid,
        gops,
        fps,
        dma_bandwidth,
        latency,
        frame_exec_time,
        txn_op_idx,
        ctx_pc,
        fatal_error_type,
        fatal_error_exception_type,
        fatal_error_exception_pc,
        fatal_error_app_module,
        pad
    });
    check_struct!(amdxdna_async_error {
        err_code,
        ts_us,
        ex_err_code
    });
    check_struct!(amdxdna_drm_bo_usage {
        pid,
        total_usage,
        internal_usage,
        heap_usage
    });
    check_struct!(amdxdna_drm_get_array {
        param,
        element_size,
        num_element,
        pad,
        buffer
    });
    check_struct!(amdxdna_drm_set_power_mode { power_mode, pad });
    check_struct!(amdxdna_drm_set_state {
        param,
        buffer_size,
        buffer
    });
    check_struct!(amdxdna_cmd_header { header });
    check_struct!(ert_npu_data {
        instruction_buffer,
        instruction_buffer_size,
        instruction_prop_count
    });
    check_struct!(ert_npu_preempt_data {
        instruction_buffer,
        save_buffer,
        restore_buffer,
        instruction_buffer_size,
        save_buffer_size,
        restore_buffer_size,
        instruction_prop_count
    });
    check_struct!(ert_cmd_chain_data {
        command_count,
        submit_index,
        error_index,
        reserved
    });
}

#[test]
fn requests_match_c_probe() {
    assert_eq!(ffi::REQUESTS.len(), 28);
    for (name, value) in ffi::REQUESTS {
        assert_eq!(u64::from(*value), c(&format!("ioctl:{name}")), "{name}");
    }
}

#[test]
fn every_probe_ioctl_is_known_to_rust() {
    for key in probe::keys() {
        if let Some(name) = key.strip_prefix("ioctl:") {
            assert!(
                ffi::REQUESTS.iter().any(|(n, _)| *n == name),
                "{name} computed in C but not in Rust"
            );
        }
    }
}

/// Literal request values from the tables of docs/protocol.md (§2.1, §2.3).
#[test]
fn requests_match_reference_literals() {
    let expect: &[(&str, u64)] = &[
        ("DRM_IOCTL_AMDXDNA_CREATE_HWCTX", 0xC0386440),
        ("DRM_IOCTL_AMDXDNA_DESTROY_HWCTX", 0xC0086441),
        ("DRM_IOCTL_AMDXDNA_CONFIG_HWCTX", 0xC0186442),
        ("DRM_IOCTL_AMDXDNA_CREATE_BO", 0xC0206443),
        ("DRM_IOCTL_AMDXDNA_GET_BO_INFO", 0xC0306444),
        ("DRM_IOCTL_AMDXDNA_SYNC_BO", 0xC0186445),
        ("DRM_IOCTL_AMDXDNA_EXEC_CMD", 0xC0386446),
        ("DRM_IOCTL_AMDXDNA_GET_INFO", 0xC0106447),
        ("DRM_IOCTL_AMDXDNA_SET_STATE", 0xC0106448),
        ("DRM_IOCTL_AMDXDNA_WAIT_CMD", 0xC0106449),
        ("DRM_IOCTL_AMDXDNA_WAIT_CMD_UPSTREAM", 0x40106449),
        ("DRM_IOCTL_AMDXDNA_GET_ARRAY", 0xC018644A),
        ("DRM_IOCTL_VERSION", 0xC0406400),
        ("DRM_IOCTL_GEM_CLOSE", 0x40086409),
        ("DRM_IOCTL_GET_CAP", 0xC010640C),
        ("DRM_IOCTL_PRIME_HANDLE_TO_FD", 0xC00C642D),
        ("DRM_IOCTL_PRIME_FD_TO_HANDLE", 0xC00C642E),
        ("DRM_IOCTL_SYNCOBJ_CREATE", 0xC00864BF),
        ("DRM_IOCTL_SYNCOBJ_DESTROY", 0xC00864C0),
        ("DRM_IOCTL_SYNCOBJ_HANDLE_TO_FD", 0xC01864C1),
        ("DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE", 0xC01864C2),
        ("DRM_IOCTL_SYNCOBJ_WAIT", 0xC02864C3),
        ("DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT", 0xC03064CA),
        ("DRM_IOCTL_SYNCOBJ_QUERY", 0xC01864CB),
        ("DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL", 0xC01864CD),
        ("DRM_IOCTL_SYNCOBJ_EVENTFD", 0xC01864CF),
        ("UDMABUF_CREATE", 0x40187542),
        ("UDMABUF_CREATE_LIST", 0x40087543),
    ];
    for (name, want) in expect {
        let got = ffi::REQUESTS
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| u64::from(*v));
        assert_eq!(
            got,
            Some(*want),
            "{name}: Rust {got:x?} vs reference {want:#x}"
        );
        assert_eq!(
            c(&format!("ioctl:{name}")),
            *want,
            "{name}: C probe vs reference"
        );
    }
}

/// Literal sizes and offsets from docs/protocol.md (§2.2, §2.3, §5.1, §7, §9).
#[test]
fn layouts_match_reference_literals() {
    assert_eq!(size_of::<ffi::amdxdna_qos_info>(), 24);
    assert_eq!(size_of::<ffi::amdxdna_qos_info_oot>(), 32);
    assert_eq!(offset_of!(ffi::amdxdna_qos_info_oot, user_start_col), 24);
    assert_eq!(size_of::<ffi::amdxdna_drm_create_hwctx>(), 56);
    assert_eq!(offset_of!(ffi::amdxdna_drm_create_hwctx, qos_p), 16);
    assert_eq!(offset_of!(ffi::amdxdna_drm_create_hwctx, max_opc), 32);
    assert_eq!(offset_of!(ffi::amdxdna_drm_create_hwctx, num_tiles), 36);
    assert_eq!(offset_of!(ffi::amdxdna_drm_create_hwctx, umq_doorbell), 44);
    assert_eq!(offset_of!(ffi::amdxdna_drm_create_hwctx, handle), 48);
    assert_eq!(
        offset_of!(ffi::amdxdna_drm_create_hwctx, syncobj_handle),
        52
    );
    assert_eq!(size_of::<ffi::amdxdna_drm_destroy_hwctx>(), 8);
    assert_eq!(size_of::<ffi::amdxdna_drm_config_hwctx>(), 24);
    assert_eq!(offset_of!(ffi::amdxdna_drm_config_hwctx, param_val), 8);
    assert_eq!(
        offset_of!(ffi::amdxdna_drm_config_hwctx, param_val_size),
        16
    );
    assert_eq!(size_of::<ffi::amdxdna_hwctx_param_config_cu>(), 8);
    assert_eq!(size_of::<ffi::amdxdna_cu_config>(), 8);
    assert_eq!(offset_of!(ffi::amdxdna_cu_config, cu_func), 4);
    assert_eq!(size_of::<ffi::amdxdna_drm_create_bo>(), 32);
    assert_eq!(offset_of!(ffi::amdxdna_drm_create_bo, type_), 24);
    assert_eq!(offset_of!(ffi::amdxdna_drm_create_bo, handle), 28);
    assert_eq!(size_of::<ffi::amdxdna_drm_va_tbl>(), 8);
    assert_eq!(size_of::<ffi::amdxdna_drm_va_entry>(), 16);
    assert_eq!(size_of::<ffi::amdxdna_drm_get_bo_info>(), 48);
    assert_eq!(offset_of!(ffi::amdxdna_drm_get_bo_info, handle), 16);
    assert_eq!(offset_of!(ffi::amdxdna_drm_get_bo_info, map_offset), 24);
    assert_eq!(offset_of!(ffi::amdxdna_drm_get_bo_info, vaddr), 32);
    assert_eq!(offset_of!(ffi::amdxdna_drm_get_bo_info, xdna_addr), 40);
    assert_eq!(size_of::<ffi::amdxdna_drm_sync_bo>(), 24);
    assert_eq!(size_of::<ffi::amdxdna_drm_exec_cmd>(), 56);
    assert_eq!(offset_of!(ffi::amdxdna_drm_exec_cmd, hwctx), 16);
    assert_eq!(offset_of!(ffi::amdxdna_drm_exec_cmd, type_), 20);
    assert_eq!(offset_of!(ffi::amdxdna_drm_exec_cmd, cmd_handles), 24);
    assert_eq!(offset_of!(ffi::amdxdna_drm_exec_cmd, args), 32);
    assert_eq!(offset_of!(ffi::amdxdna_drm_exec_cmd, cmd_count), 40);
    assert_eq!(offset_of!(ffi::amdxdna_drm_exec_cmd, arg_count), 44);
    assert_eq!(offset_of!(ffi::amdxdna_drm_exec_cmd, seq), 48);
    assert_eq!(size_of::<ffi::amdxdna_drm_wait_cmd>(), 16);
    assert_eq!(offset_of!(ffi::amdxdna_drm_wait_cmd, seq), 8);
    assert_eq!(size_of::<ffi::amdxdna_drm_get_info>(), 16);
    assert_eq!(size_of::<ffi::amdxdna_drm_get_array>(), 24);
    assert_eq!(offset_of!(ffi::amdxdna_drm_get_array, buffer), 16);
    assert_eq!(size_of::<ffi::amdxdna_drm_set_state>(), 16);
    // DRM core (§2.3)
    assert_eq!(size_of::<ffi::drm_version>(), 64);
    assert_eq!(offset_of!(ffi::drm_version, name_len), 16);
    assert_eq!(offset_of!(ffi::drm_version, name), 24);
    assert_eq!(offset_of!(ffi::drm_version, desc), 56);
    assert_eq!(size_of::<ffi::drm_gem_close>(), 8);
    assert_eq!(size_of::<ffi::drm_get_cap>(), 16);
    assert_eq!(size_of::<ffi::drm_prime_handle>(), 12);
    assert_eq!(offset_of!(ffi::drm_prime_handle, fd), 8);
    assert_eq!(size_of::<ffi::drm_syncobj_handle>(), 24);
    assert_eq!(size_of::<ffi::drm_syncobj_wait>(), 40);
    assert_eq!(size_of::<ffi::drm_syncobj_timeline_wait>(), 48);
    assert_eq!(offset_of!(ffi::drm_syncobj_timeline_wait, timeout_nsec), 16);
    assert_eq!(
        offset_of!(ffi::drm_syncobj_timeline_wait, count_handles),
        24
    );
    assert_eq!(offset_of!(ffi::drm_syncobj_timeline_wait, flags), 28);
    assert_eq!(
        offset_of!(ffi::drm_syncobj_timeline_wait, first_signaled),
        32
    );
    assert_eq!(
        offset_of!(ffi::drm_syncobj_timeline_wait, deadline_nsec),
        40
    );
    assert_eq!(size_of::<ffi::drm_syncobj_eventfd>(), 24);
    // udmabuf (§7)
    assert_eq!(size_of::<ffi::udmabuf_create>(), 24);
    assert_eq!(offset_of!(ffi::udmabuf_create, offset), 8);
    assert_eq!(offset_of!(ffi::udmabuf_create, size), 16);
    // GET_INFO / GET_ARRAY structs (§9)
    assert_eq!(size_of::<ffi::amdxdna_drm_query_aie_status>(), 16);
    assert_eq!(size_of::<ffi::amdxdna_drm_query_aie_metadata>(), 64);
    assert_eq!(offset_of!(ffi::amdxdna_drm_query_aie_metadata, cols), 4);
    assert_eq!(offset_of!(ffi::amdxdna_drm_query_aie_metadata, rows), 6);
    assert_eq!(offset_of!(ffi::amdxdna_drm_query_aie_metadata, version), 8);
    assert_eq!(offset_of!(ffi::amdxdna_drm_query_aie_metadata, core), 16);
    assert_eq!(offset_of!(ffi::amdxdna_drm_query_aie_metadata, mem), 32);
    assert_eq!(offset_of!(ffi::amdxdna_drm_query_aie_metadata, shim), 48);
    assert_eq!(size_of::<ffi::amdxdna_drm_query_aie_tile_metadata>(), 16);
    assert_eq!(size_of::<ffi::amdxdna_drm_query_aie_version>(), 8);
    assert_eq!(size_of::<ffi::amdxdna_drm_query_clock_metadata>(), 48);
    assert_eq!(size_of::<ffi::amdxdna_drm_query_sensor>(), 168);
    assert_eq!(size_of::<ffi::amdxdna_drm_query_hwctx>(), 64);
    assert_eq!(size_of::<ffi::amdxdna_drm_query_firmware_version>(), 16);
    assert_eq!(size_of::<ffi::amdxdna_drm_get_power_mode>(), 8);
    assert_eq!(size_of::<ffi::amdxdna_drm_get_resource_info>(), 40);
    assert_eq!(
        offset_of!(ffi::amdxdna_drm_get_resource_info, npu_task_max),
        16
    );
    assert_eq!(size_of::<ffi::amdxdna_drm_hwctx_entry>(), 144);
    assert_eq!(size_of::<ffi::amdxdna_async_error>(), 24);
    assert_eq!(size_of::<ffi::amdxdna_drm_bo_usage>(), 32);
    assert_eq!(size_of::<ffi::amdxdna_drm_set_power_mode>(), 8);
    // ERT payloads (§5.1)
    assert_eq!(size_of::<ffi::ert_npu_data>(), 16);
    assert_eq!(offset_of!(ffi::ert_npu_data, instruction_buffer_size), 8);
    assert_eq!(size_of::<ffi::ert_npu_preempt_data>(), 40);
    assert_eq!(
        offset_of!(ffi::ert_npu_preempt_data, instruction_buffer_size),
        24
    );
    assert_eq!(
        offset_of!(ffi::ert_npu_preempt_data, instruction_prop_count),
        36
    );
    assert_eq!(size_of::<ffi::ert_cmd_chain_data>(), 24);
}

/// Literal constants from docs/protocol.md (§2.2, §2.3, §3, §5.1, §5.2, §9).
#[test]
fn constants_match_reference() {
    assert_eq!(ffi::AMDXDNA_BO_SHARE, 1);
    assert_eq!(ffi::AMDXDNA_BO_DEV_HEAP, 2);
    assert_eq!(ffi::AMDXDNA_BO_DEV, 3);
    assert_eq!(ffi::AMDXDNA_BO_CMD, 4);
    assert_eq!(ffi::ERT_START_CU, 0);
    assert_eq!(ffi::ERT_START_NPU, 20);
    assert_eq!(ffi::ERT_START_NPU_PREEMPT, 21);
    assert_eq!(ffi::ERT_START_NPU_PREEMPT_ELF, 22);
    assert_eq!(ffi::ERT_CMD_CHAIN, 19);
    assert_eq!(ffi::ERT_CMD_STATE_COMPLETED, 4);
    assert_eq!(ffi::ERT_CMD_STATE_TIMEOUT, 8);
    assert_eq!(ffi::DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT, 2);
    assert_eq!(ffi::DRM_AMDXDNA_QUERY_RESOURCE_INFO, 12);
    assert_eq!(ffi::DRM_AMDXDNA_QUERY_FIRMWARE_VERSION, 8);
    assert_eq!(ffi::AMDXDNA_USER_START_COL_NOT_REQUESTED, 0xFF);
    assert_eq!(c("const:DRM_CLOEXEC"), 0o2000000);
    assert_eq!(c("const:AMDXDNA_BO_DEV"), ffi::AMDXDNA_BO_DEV as u64);
    assert_eq!(c("const:ERT_START_NPU_PREEMPT_ELF"), 22);
    assert_eq!(c("const:AMDXDNA_INVALID_ADDR"), ffi::AMDXDNA_INVALID_ADDR);
}
