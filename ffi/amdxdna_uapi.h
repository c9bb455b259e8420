/* SPDX-License-Identifier: MIT */
/*
 * amdxdna_uapi.h — the amdxdna (AMD XDNA / Ryzen AI NPU) user-space ABI as
 * used by the xdna runtime, plus the DRM core, syncobj and udmabuf pieces it
 * needs.
 *
 * Written for this project from the protocol description in
 * docs/protocol.md (sections 2, 3, 5, 6, 7 and 9); it is
 * not a copy of any kernel header.  It deliberately includes no system
 * header: only locally typedef'd fixed-width types are used, pointers are
 * carried as __u64 and the layouts are those of x86_64 (LP64).
 *
 * Where the mainline/staging ("upstream") and out-of-tree driver headers
 * differ, both shapes are declared (QoS: 24 bytes upstream, 32 bytes OOT).
 */
#ifndef XDNA_AMDXDNA_UAPI_H
#define XDNA_AMDXDNA_UAPI_H

typedef unsigned char __u8;
typedef signed char __s8;
typedef unsigned short __u16;
typedef signed short __s16;
typedef unsigned int __u32;
typedef signed int __s32;
typedef unsigned long long __u64;
typedef signed long long __s64;

/* ------------------------------------------------------------------------ */
/* ioctl request encoding (asm-generic/ioctl.h, as used on x86_64)           */
/* ------------------------------------------------------------------------ */

#define XDNA_IOC_NRBITS 8
#define XDNA_IOC_TYPEBITS 8
#define XDNA_IOC_SIZEBITS 14
#define XDNA_IOC_NRSHIFT 0
#define XDNA_IOC_TYPESHIFT (XDNA_IOC_NRSHIFT + XDNA_IOC_NRBITS)
#define XDNA_IOC_SIZESHIFT (XDNA_IOC_TYPESHIFT + XDNA_IOC_TYPEBITS)
#define XDNA_IOC_DIRSHIFT (XDNA_IOC_SIZESHIFT + XDNA_IOC_SIZEBITS)
#define XDNA_IOC_NONE 0U
#define XDNA_IOC_WRITE 1U
#define XDNA_IOC_READ 2U

#define XDNA_IOC(dir, type, nr, size)                                        \
	((((__u32)(dir)) << XDNA_IOC_DIRSHIFT) |                             \
	 (((__u32)(type)) << XDNA_IOC_TYPESHIFT) |                           \
	 (((__u32)(nr)) << XDNA_IOC_NRSHIFT) |                               \
	 (((__u32)(size)) << XDNA_IOC_SIZESHIFT))
#define XDNA_IOW(type, nr, T) XDNA_IOC(XDNA_IOC_WRITE, (type), (nr), sizeof(T))
#define XDNA_IOWR(type, nr, T)                                               \
	XDNA_IOC(XDNA_IOC_READ | XDNA_IOC_WRITE, (type), (nr), sizeof(T))

/* DRM: ioctl type 'd', driver-private ioctls start at 0x40. */
#define DRM_IOCTL_BASE 'd'
#define DRM_COMMAND_BASE 0x40
#define DRM_IO_W(nr, T) XDNA_IOW(DRM_IOCTL_BASE, (nr), T)
#define DRM_IO_WR(nr, T) XDNA_IOWR(DRM_IOCTL_BASE, (nr), T)

/* ------------------------------------------------------------------------ */
/* DRM core (drm.h)                                                          */
/* ------------------------------------------------------------------------ */

/* DRM_IOCTL_VERSION: 64 bytes; size_t and char * are 64-bit here. */
struct drm_version {
	__s32 version_major;
	__s32 version_minor;
	__s32 version_patchlevel;
	__u32 pad0; /* implicit padding in the C original */
	__u64 name_len; /* in: buffer size; out: string length */
	__u64 name;     /* user pointer (char *) */
	__u64 date_len;
	__u64 date;
	__u64 desc_len;
	__u64 desc;
};

struct drm_gem_close {
	__u32 handle;
	__u32 pad;
};

struct drm_get_cap {
	__u64 capability;
	__u64 value;
};

#define DRM_CAP_PRIME 0x5
#define DRM_CAP_SYNCOBJ 0x13
#define DRM_CAP_SYNCOBJ_TIMELINE 0x14

struct drm_prime_handle {
	__u32 handle;
	__u32 flags; /* DRM_CLOEXEC | DRM_RDWR */
	__s32 fd;
};

#define DRM_CLOEXEC 02000000 /* O_CLOEXEC */
#define DRM_RDWR 02          /* O_RDWR */

struct drm_syncobj_create {
	__u32 handle;
	__u32 flags;
};

#define DRM_SYNCOBJ_CREATE_SIGNALED (1 << 0)

struct drm_syncobj_destroy {
	__u32 handle;
	__u32 pad;
};

struct drm_syncobj_handle {
	__u32 handle;
	__u32 flags;
	__s32 fd;
	__u32 pad;
	__u64 point;
};

struct drm_syncobj_wait {
	__u64 handles;
	__s64 timeout_nsec; /* absolute CLOCK_MONOTONIC */
	__u32 count_handles;
	__u32 flags;
	__u32 first_signaled;
	__u32 pad;
	__u64 deadline_nsec;
};

struct drm_syncobj_timeline_wait {
	__u64 handles;
	__u64 points;
	__s64 timeout_nsec; /* absolute CLOCK_MONOTONIC */
	__u32 count_handles;
	__u32 flags;
	__u32 first_signaled;
	__u32 pad;
	__u64 deadline_nsec;
};

#define DRM_SYNCOBJ_WAIT_FLAGS_WAIT_ALL (1 << 0)
#define DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT (1 << 1)
#define DRM_SYNCOBJ_WAIT_FLAGS_WAIT_AVAILABLE (1 << 2)
#define DRM_SYNCOBJ_WAIT_FLAGS_WAIT_DEADLINE (1 << 3)

/* SYNCOBJ_QUERY and SYNCOBJ_TIMELINE_SIGNAL */
struct drm_syncobj_timeline_array {
	__u64 handles;
	__u64 points;
	__u32 count_handles;
	__u32 flags;
};

struct drm_syncobj_eventfd {
	__u32 handle;
	__u32 flags;
	__u64 point;
	__s32 fd;
	__u32 pad;
};

#define DRM_IOCTL_VERSION DRM_IO_WR(0x00, struct drm_version)
#define DRM_IOCTL_GEM_CLOSE DRM_IO_W(0x09, struct drm_gem_close)
#define DRM_IOCTL_GET_CAP DRM_IO_WR(0x0c, struct drm_get_cap)
#define DRM_IOCTL_PRIME_HANDLE_TO_FD DRM_IO_WR(0x2d, struct drm_prime_handle)
#define DRM_IOCTL_PRIME_FD_TO_HANDLE DRM_IO_WR(0x2e, struct drm_prime_handle)
#define DRM_IOCTL_SYNCOBJ_CREATE DRM_IO_WR(0xBF, struct drm_syncobj_create)
#define DRM_IOCTL_SYNCOBJ_DESTROY DRM_IO_WR(0xC0, struct drm_syncobj_destroy)
#define DRM_IOCTL_SYNCOBJ_HANDLE_TO_FD DRM_IO_WR(0xC1, struct drm_syncobj_handle)
#define DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE DRM_IO_WR(0xC2, struct drm_syncobj_handle)
#define DRM_IOCTL_SYNCOBJ_WAIT DRM_IO_WR(0xC3, struct drm_syncobj_wait)
#define DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT                                      \
	DRM_IO_WR(0xCA, struct drm_syncobj_timeline_wait)
#define DRM_IOCTL_SYNCOBJ_QUERY                                              \
	DRM_IO_WR(0xCB, struct drm_syncobj_timeline_array)
#define DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL                                    \
	DRM_IO_WR(0xCD, struct drm_syncobj_timeline_array)
#define DRM_IOCTL_SYNCOBJ_EVENTFD DRM_IO_WR(0xCF, struct drm_syncobj_eventfd)

/* ------------------------------------------------------------------------ */
/* udmabuf (linux/udmabuf.h): memfd -> dma-buf, ioctl type 'u'              */
/* ------------------------------------------------------------------------ */

#define UDMABUF_FLAGS_CLOEXEC 0x01

struct udmabuf_create {
	__u32 memfd;
	__u32 flags;
	__u64 offset;
	__u64 size;
};

struct udmabuf_create_item {
	__u32 memfd;
	__u32 __pad;
	__u64 offset;
	__u64 size;
};

/* Header of UDMABUF_CREATE_LIST; `count` udmabuf_create_item follow. */
struct udmabuf_create_list {
	__u32 flags;
	__u32 count;
};

#define UDMABUF_CREATE XDNA_IOW('u', 0x42, struct udmabuf_create)
#define UDMABUF_CREATE_LIST XDNA_IOW('u', 0x43, struct udmabuf_create_list)

/* ------------------------------------------------------------------------ */
/* amdxdna: ioctl indices (DRM_COMMAND_BASE + idx)                           */
/* ------------------------------------------------------------------------ */

#define DRM_AMDXDNA_CREATE_HWCTX 0
#define DRM_AMDXDNA_DESTROY_HWCTX 1
#define DRM_AMDXDNA_CONFIG_HWCTX 2
#define DRM_AMDXDNA_CREATE_BO 3
#define DRM_AMDXDNA_GET_BO_INFO 4
#define DRM_AMDXDNA_SYNC_BO 5
#define DRM_AMDXDNA_EXEC_CMD 6
#define DRM_AMDXDNA_GET_INFO 7
#define DRM_AMDXDNA_SET_STATE 8
#define DRM_AMDXDNA_WAIT_CMD 9
#define DRM_AMDXDNA_GET_ARRAY 10

/* Driver name reported by DRM_IOCTL_VERSION. */
#define AMDXDNA_DRIVER_NAME "amdxdna_accel_driver"
/* The out-of-tree ("legacy") driver reports DRM major 1. */
#define AMDXDNA_OOT_DRIVER_MAJOR 1

#define AMDXDNA_INVALID_ADDR 0xFFFFFFFFFFFFFFFFULL
#define AMDXDNA_INVALID_CTX_HANDLE 0
#define AMDXDNA_INVALID_BO_HANDLE 0
#define AMDXDNA_INVALID_FENCE_HANDLE 0

/* Device types (sysfs device_type). */
#define AMDXDNA_DEV_TYPE_KMQ 0
#define AMDXDNA_DEV_TYPE_UMQ 1
#define AMDXDNA_DEV_TYPE_PF 2

/* QoS priorities. */
#define AMDXDNA_QOS_REALTIME_PRIORITY 0x100
#define AMDXDNA_QOS_HIGH_PRIORITY 0x180
#define AMDXDNA_QOS_NORMAL_PRIORITY 0x200
#define AMDXDNA_QOS_LOW_PRIORITY 0x280
#define AMDXDNA_USER_START_COL_NOT_REQUESTED 0xFF

/* Upstream/mainline QoS: 24 bytes. */
struct amdxdna_qos_info {
	__u32 gops;
	__u32 fps;
	__u32 dma_bandwidth;
	__u32 latency;
	__u32 frame_exec_time;
	__u32 priority;
};

/* Out-of-tree QoS: 32 bytes.  Always pass this one (see reference 2.2). */
struct amdxdna_qos_info_oot {
	__u32 gops;
	__u32 fps;
	__u32 dma_bandwidth;
	__u32 latency;
	__u32 frame_exec_time;
	__u32 priority;
	__u32 user_start_col;
	__u32 reserved;
};

struct amdxdna_drm_create_hwctx {
	__u64 ext;
	__u64 ext_flags;
	__u64 qos_p;
	__u32 umq_bo;
	__u32 log_buf_bo;
	__u32 max_opc;
	__u32 num_tiles;
	__u32 mem_size;
	__u32 umq_doorbell;
	__u32 handle;
	__u32 syncobj_handle;
};

struct amdxdna_drm_destroy_hwctx {
	__u32 handle;
	__u32 pad;
};

struct amdxdna_cu_config {
	__u32 cu_bo;
	__u8 cu_func;
	__u8 pad[3];
};

/* Header of the CONFIG_CU payload; num_cus amdxdna_cu_config follow. */
struct amdxdna_hwctx_param_config_cu {
	__u16 num_cus;
	__u16 pad[3];
};

#define DRM_AMDXDNA_HWCTX_CONFIG_CU 0
#define DRM_AMDXDNA_HWCTX_ASSIGN_DBG_BUF 1
#define DRM_AMDXDNA_HWCTX_REMOVE_DBG_BUF 2
#define DRM_AMDXDNA_HWCTX_CONFIG_OPCODE_TIMEOUT 3

#define AMDXDNA_MAX_CUS 32

struct amdxdna_drm_config_hwctx {
	__u32 handle;
	__u32 param_type;
	__u64 param_val;
	__u32 param_val_size;
	__u32 pad;
};

/* BO types. */
#define AMDXDNA_BO_INVALID 0
#define AMDXDNA_BO_SHMEM 1
#define AMDXDNA_BO_SHARE 1
#define AMDXDNA_BO_DEV_HEAP 2
#define AMDXDNA_BO_DEV 3
#define AMDXDNA_BO_CMD 4

struct amdxdna_drm_va_entry {
	__u64 vaddr;
	__u64 len;
};

/* Header; num_entries amdxdna_drm_va_entry follow.  OOT names it udma_fd. */
struct amdxdna_drm_va_tbl {
	__s32 dmabuf_fd;
	__u32 num_entries;
};

struct amdxdna_drm_create_bo {
	__u64 flags;
	__u64 vaddr;
	__u64 size;
	__u32 type;
	__u32 handle;
};

struct amdxdna_drm_get_bo_info {
	__u64 ext;
	__u64 ext_flags;
	__u32 handle;
	__u32 pad;
	__u64 map_offset;
	__u64 vaddr;
	__u64 xdna_addr;
};

#define SYNC_DIRECT_TO_DEVICE 0
#define SYNC_DIRECT_FROM_DEVICE 1

struct amdxdna_drm_sync_bo {
	__u32 handle;
	__u32 direction;
	__u64 offset;
	__u64 size;
};

#define AMDXDNA_CMD_SUBMIT_EXEC_BUF 0
#define AMDXDNA_CMD_SUBMIT_DEPENDENCY 1
#define AMDXDNA_CMD_SUBMIT_SIGNAL 2

struct amdxdna_drm_exec_cmd {
	__u64 ext;
	__u64 ext_flags;
	__u32 hwctx;
	__u32 type;
	__u64 cmd_handles;
	__u64 args;
	__u32 cmd_count;
	__u32 arg_count;
	__u64 seq;
};

struct amdxdna_drm_wait_cmd {
	__u32 hwctx;
	__u32 timeout; /* ms, 0 = forever */
	__u64 seq;
};

/* ------------------------------------------------------------------------ */
/* GET_INFO                                                                  */
/* ------------------------------------------------------------------------ */

#define DRM_AMDXDNA_QUERY_AIE_STATUS 0
#define DRM_AMDXDNA_QUERY_AIE_METADATA 1
#define DRM_AMDXDNA_QUERY_AIE_VERSION 2
#define DRM_AMDXDNA_QUERY_CLOCK_METADATA 3
#define DRM_AMDXDNA_QUERY_SENSORS 4
#define DRM_AMDXDNA_QUERY_HW_CONTEXTS 5
#define DRM_AMDXDNA_READ_AIE_MEM 6
#define DRM_AMDXDNA_READ_AIE_REG 7
#define DRM_AMDXDNA_QUERY_FIRMWARE_VERSION 8
#define DRM_AMDXDNA_GET_POWER_MODE 9
#define DRM_AMDXDNA_QUERY_TELEMETRY 10
#define DRM_AMDXDNA_GET_FORCE_PREEMPT_STATE 11
#define DRM_AMDXDNA_QUERY_RESOURCE_INFO 12
#define DRM_AMDXDNA_GET_FRAME_BOUNDARY_PREEMPT_STATE 13
#define DRM_AMDXDNA_QUERY_CERT_FIRMWARE_VERSION 14
#define DRM_AMDXDNA_GET_AUTO_COREDUMP 15

struct amdxdna_drm_query_aie_status {
	__u64 buffer;
	__u32 buffer_size;
	__u32 cols_filled;
};

struct amdxdna_drm_query_aie_version {
	__u32 major;
	__u32 minor;
};

struct amdxdna_drm_query_aie_tile_metadata {
	__u16 row_count;
	__u16 row_start;
	__u16 dma_channel_count;
	__u16 lock_count;
	__u16 event_reg_count;
	__u16 pad[3];
};

struct amdxdna_drm_query_aie_metadata {
	__u32 col_size;
	__u16 cols;
	__u16 rows;
	struct amdxdna_drm_query_aie_version version;
	struct amdxdna_drm_query_aie_tile_metadata core;
	struct amdxdna_drm_query_aie_tile_metadata mem;
	struct amdxdna_drm_query_aie_tile_metadata shim;
};

struct amdxdna_drm_query_clock {
	__u8 name[16];
	__u32 freq_mhz;
	__u32 pad;
};

struct amdxdna_drm_query_clock_metadata {
	struct amdxdna_drm_query_clock mp_npu_clock;
	struct amdxdna_drm_query_clock h_clock;
};

#define AMDXDNA_SENSOR_TYPE_POWER 0
#define AMDXDNA_SENSOR_TYPE_COLUMN_UTILIZATION 1
#define AMDXDNA_SENSOR_TYPE_TEMPERATURE 2

struct amdxdna_drm_query_sensor {
	__u8 label[64];
	__u32 input;
	__u32 max;
	__u32 average;
	__u32 highest;
	__u8 status[64];
	__u8 units[16];
	__s8 unitm;
	__u8 type;
	__u8 pad[6];
};

/* Legacy QUERY_HW_CONTEXTS element (64 bytes). */
struct amdxdna_drm_query_hwctx {
	__u32 context_id;
	__u32 start_col;
	__u32 num_col;
	__u32 pad;
	__s64 pid;
	__u64 command_submissions;
	__u64 command_completions;
	__u64 migrations;
	__u64 preemptions;
	__u64 errors;
};

struct amdxdna_drm_query_firmware_version {
	__u32 major;
	__u32 minor;
	__u32 patch;
	__u32 build;
};

#define POWER_MODE_DEFAULT 0
#define POWER_MODE_LOW 1
#define POWER_MODE_MEDIUM 2
#define POWER_MODE_HIGH 3
#define POWER_MODE_TURBO 4

struct amdxdna_drm_get_power_mode {
	__u8 power_mode;
	__u8 pad[7];
};

struct amdxdna_drm_get_resource_info {
	__u64 npu_clk_max;
	__u64 npu_tops_max;
	__u64 npu_task_max; /* context limit */
	__u64 npu_tops_curr;
	__u64 npu_task_curr;
};

/* GET_FORCE_PREEMPT_STATE / GET_FRAME_BOUNDARY_PREEMPT_STATE and setters. */
struct amdxdna_drm_attribute_state {
	__u8 state;
	__u8 pad[7];
};

struct amdxdna_drm_get_info {
	__u32 param;
	__u32 buffer_size;
	__u64 buffer;
};

/* ------------------------------------------------------------------------ */
/* GET_ARRAY                                                                 */
/* ------------------------------------------------------------------------ */

#define DRM_AMDXDNA_HW_CONTEXT_ALL 0
#define DRM_AMDXDNA_HW_CONTEXT_BY_ID 1
#define DRM_AMDXDNA_HW_LAST_ASYNC_ERR 2
#define DRM_AMDXDNA_FW_LOG 3
#define DRM_AMDXDNA_FW_TRACE 4
#define DRM_AMDXDNA_AIE_COREDUMP 5
#define DRM_AMDXDNA_BO_USAGE 6

#define AMDXDNA_HWCTX_STATE_IDLE 0
#define AMDXDNA_HWCTX_STATE_ACTIVE 1

/*
 * HW_CONTEXT_ALL element, 144-byte form.  Newer drivers append a 16-byte
 * process name (160 bytes); the driver copies min(element_size, its own), so
 * asking for 144 is valid on every driver that has GET_ARRAY.
 */
struct amdxdna_drm_hwctx_entry {
	__u32 context_id;
	__u32 start_col;
	__u32 num_col;
	__u32 hwctx_id;
	__s64 pid;
	__u64 command_submissions;
	__u64 command_completions;
	__u64 migrations;
	__u64 preemptions;
	__u64 errors;
	__u64 priority;
	__u64 heap_usage;
	__u64 suspensions;
	__u32 state;
	__u32 pasid;
	__u32 gops;
	__u32 fps;
	__u32 dma_bandwidth;
	__u32 latency;
	__u32 frame_exec_time;
	__u32 txn_op_idx;
	__u32 ctx_pc;
	__u32 fatal_error_type;
	__u32 fatal_error_exception_type;
	__u32 fatal_error_exception_pc;
	__u32 fatal_error_app_module;
	__u32 pad;
};

struct amdxdna_async_error {
	__u64 err_code;
	__u64 ts_us;
	__u64 ex_err_code;
};

struct amdxdna_drm_bo_usage {
	__s64 pid;
	__u64 total_usage;
	__u64 internal_usage;
	__u64 heap_usage;
};

struct amdxdna_drm_get_array {
	__u32 param;
	__u32 element_size;
	__u32 num_element;
	__u32 pad;
	__u64 buffer;
};

/* ------------------------------------------------------------------------ */
/* SET_STATE (root only)                                                     */
/* ------------------------------------------------------------------------ */

#define DRM_AMDXDNA_SET_POWER_MODE 0
#define DRM_AMDXDNA_WRITE_AIE_MEM 1
#define DRM_AMDXDNA_WRITE_AIE_REG 2
#define DRM_AMDXDNA_SET_FORCE_PREEMPT 3
#define DRM_AMDXDNA_SET_FRAME_BOUNDARY_PREEMPT 4

struct amdxdna_drm_set_power_mode {
	__u8 power_mode;
	__u8 pad[7];
};

struct amdxdna_drm_set_state {
	__u32 param;
	__u32 buffer_size;
	__u64 buffer;
};

/* ------------------------------------------------------------------------ */
/* amdxdna request values                                                    */
/* ------------------------------------------------------------------------ */

#define DRM_IOCTL_AMDXDNA_CREATE_HWCTX                                       \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_CREATE_HWCTX,                   \
		  struct amdxdna_drm_create_hwctx)
#define DRM_IOCTL_AMDXDNA_DESTROY_HWCTX                                      \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_DESTROY_HWCTX,                  \
		  struct amdxdna_drm_destroy_hwctx)
#define DRM_IOCTL_AMDXDNA_CONFIG_HWCTX                                       \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_CONFIG_HWCTX,                   \
		  struct amdxdna_drm_config_hwctx)
#define DRM_IOCTL_AMDXDNA_CREATE_BO                                          \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_CREATE_BO,                      \
		  struct amdxdna_drm_create_bo)
#define DRM_IOCTL_AMDXDNA_GET_BO_INFO                                        \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_GET_BO_INFO,                    \
		  struct amdxdna_drm_get_bo_info)
#define DRM_IOCTL_AMDXDNA_SYNC_BO                                            \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_SYNC_BO,                        \
		  struct amdxdna_drm_sync_bo)
#define DRM_IOCTL_AMDXDNA_EXEC_CMD                                           \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_EXEC_CMD,                       \
		  struct amdxdna_drm_exec_cmd)
#define DRM_IOCTL_AMDXDNA_GET_INFO                                           \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_GET_INFO,                       \
		  struct amdxdna_drm_get_info)
#define DRM_IOCTL_AMDXDNA_SET_STATE                                          \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_SET_STATE,                      \
		  struct amdxdna_drm_set_state)
/* Out-of-tree WAIT_CMD is IOWR; upstream declares it IOW.  Both dispatch. */
#define DRM_IOCTL_AMDXDNA_WAIT_CMD                                           \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_WAIT_CMD,                       \
		  struct amdxdna_drm_wait_cmd)
#define DRM_IOCTL_AMDXDNA_WAIT_CMD_UPSTREAM                                  \
	DRM_IO_W(DRM_COMMAND_BASE + DRM_AMDXDNA_WAIT_CMD,                        \
		 struct amdxdna_drm_wait_cmd)
#define DRM_IOCTL_AMDXDNA_GET_ARRAY                                          \
	DRM_IO_WR(DRM_COMMAND_BASE + DRM_AMDXDNA_GET_ARRAY,                      \
		  struct amdxdna_drm_get_array)

/* ------------------------------------------------------------------------ */
/* ERT command packets (in a CMD BO)                                         */
/* ------------------------------------------------------------------------ */

/* Header bit fields. */
#define ERT_HDR_STATE_SHIFT 0
#define ERT_HDR_STATE_MASK 0xFU
#define ERT_HDR_STAT_ENABLED_SHIFT 4
#define ERT_HDR_EXTRA_CU_MASKS_SHIFT 10
#define ERT_HDR_EXTRA_CU_MASKS_MASK 0x3U
#define ERT_HDR_COUNT_SHIFT 12
#define ERT_HDR_COUNT_MASK 0x7FFU
#define ERT_HDR_OPCODE_SHIFT 23
#define ERT_HDR_OPCODE_MASK 0x1FU
#define ERT_HDR_TYPE_SHIFT 28
#define ERT_HDR_TYPE_MASK 0xFU

/* Opcodes. */
#define ERT_START_CU 0
#define ERT_START_DPU 18
#define ERT_CMD_CHAIN 19
#define ERT_START_NPU 20
#define ERT_START_NPU_PREEMPT 21
#define ERT_START_NPU_PREEMPT_ELF 22

/* Header `type` field. */
#define ERT_CU 3

/* Command states (header bits 3:0).  Not monotonic: success is == 4. */
#define ERT_CMD_STATE_INVALID 0
#define ERT_CMD_STATE_NEW 1
#define ERT_CMD_STATE_QUEUED 2
#define ERT_CMD_STATE_RUNNING 3
#define ERT_CMD_STATE_COMPLETED 4
#define ERT_CMD_STATE_ERROR 5
#define ERT_CMD_STATE_ABORT 6
#define ERT_CMD_STATE_SUBMITTED 7
#define ERT_CMD_STATE_TIMEOUT 8
#define ERT_CMD_STATE_NORESPONSE 9
#define ERT_CMD_STATE_SKERROR 10
#define ERT_CMD_STATE_SKCRASHED 11

/* START_CU regmap value for the TXN (transaction) flow. */
#define ERT_START_CU_OPCODE_TXN 3

/* Packet header; `count` payload words follow. */
struct amdxdna_cmd_header {
	__u32 header;
};

/* START_NPU payload after the cu_mask (16 bytes), args follow. */
struct ert_npu_data {
	__u64 instruction_buffer;
	__u32 instruction_buffer_size; /* bytes */
	__u32 instruction_prop_count;
};

/* START_NPU_PREEMPT / START_NPU_PREEMPT_ELF payload (40 bytes). */
struct ert_npu_preempt_data {
	__u64 instruction_buffer;
	__u64 save_buffer;
	__u64 restore_buffer;
	__u32 instruction_buffer_size;
	__u32 save_buffer_size;
	__u32 restore_buffer_size;
	__u32 instruction_prop_count;
};

/* CMD_CHAIN payload header; command_count u64 CMD BO handles follow. */
struct ert_cmd_chain_data {
	__u32 command_count;
	__u32 submit_index;
	__u32 error_index;
	__u32 reserved[3];
};

#endif /* XDNA_AMDXDNA_UAPI_H */
