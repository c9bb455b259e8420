//! Kernels on the device: `xdna::kernels::DeviceExecutor` over the xdna backend against the fake
//! amdxdna device (tools/xdna-shim, LD_PRELOAD), which runs kernel images with the same host
//! executors. Each case runs in a child process (tests/shim_support).
//!
//! Needs `target/<profile>/libxdna_shim.so`: `cargo build --workspace`.

mod shim_support;

use shim_support::*;
use std::path::{Path, PathBuf};
use xdna::device::{DeviceError, XdnaDevice};
use xdna::kernels::elf::{self, KernelDesc};
use xdna::kernels::{
    shim_txn, DeviceExecOptions, DeviceExecutor, Executor, HostExecutor, KernelError, KernelKey,
    KernelSet, RowFamily, WeightMatrix, WeightPath, WeightPathPref,
};
use xdna::tiles::{self, ScaleType, TileOrder, WeightFormat, GROUP, TILE_ROWS};

const NODE: &str = "/dev/accel/accel0";

const Q41: WeightFormat = WeightFormat::Q41 {
    scale: ScaleType::F16,
    order: TileOrder::ColumnMajor,
};
const Q8: WeightFormat = WeightFormat::Q8 {
    scale: ScaleType::F16,
    order: TileOrder::ColumnMajor,
};

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

/// A random but well-formed tile matrix of `[n, k]`.
fn weights(format: WeightFormat, n: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let mut data = vec![0u8; format.matrix_bytes(n, k).unwrap()];
    let tile_bytes = format.tile_bytes().unwrap();
    let groups = format.tile_cols() / GROUP;
    for tile in data.chunks_exact_mut(tile_bytes) {
        for g in 0..groups {
            for r in 0..TILE_ROWS {
                let d = 0.01 + 0.02 * rng.f32().abs();
                match format {
                    WeightFormat::Q41 { scale, order } => {
                        let codes: [u8; GROUP] =
                            std::array::from_fn(|_| (rng.next_u64() % 16) as u8);
                        tiles::set_q41_cell(tile, scale, order, g, r, d, -0.1 * rng.f32(), &codes);
                    }
                    WeightFormat::Q8 { scale, order } => {
                        let codes: [i8; GROUP] = std::array::from_fn(|_| rng.next_u64() as i8);
                        tiles::set_q8_cell(tile, scale, order, g, r, d, &codes);
                    }
                    _ => unreachable!(),
                }
            }
        }
    }
    data
}

fn acts(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed | 1);
    (0..m * k).map(|_| rng.f32() * 2.0).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xdna-kdev-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Host-built (descriptor-only) kernels for both families of each (format, K, N).
fn descriptor_set(dir: &Path, shapes: &[(WeightFormat, usize, usize)]) -> KernelSet {
    for &(f, k, n) in shapes {
        for family in RowFamily::ALL {
            elf::write_kernel(dir, &KernelDesc::gemm(f, family, k as u32, n as u32)).unwrap();
        }
    }
    KernelSet::load(dir).unwrap()
}

fn open_exec(set: &KernelSet, opts: DeviceExecOptions) -> DeviceExecutor {
    DeviceExecutor::with_options(XdnaDevice::open(NODE).expect("open"), set, opts)
}

fn allow() -> DeviceExecOptions {
    DeviceExecOptions {
        allow_descriptor_only: true,
        ..Default::default()
    }
}

/// Host and device results of one GEMM, both as bits.
fn both(
    exec: &DeviceExecutor,
    f: WeightFormat,
    n: usize,
    k: usize,
    m: usize,
    seed: u64,
) -> (Vec<u32>, Vec<u32>) {
    let wd = weights(f, n, k, seed);
    let w = WeightMatrix::new(f, n, k, &wd).unwrap();
    let x = acts(m, k, seed + 7);
    let mut yh = vec![0f32; m * n];
    HostExecutor::global().gemm(&w, &x, m, &mut yh).unwrap();
    let mut yd = vec![f32::NAN; m * n];
    exec.gemm(&w, &x, m, &mut yd)
        .unwrap_or_else(|e| panic!("device gemm {f:?} m={m}: {e}"));
    (bits(&yh), bits(&yd))
}

// -------------------------------------------------------------------------------------------------

#[test]
fn child_identical_outputs() {
    if !is_child("child_identical_outputs") {
        return;
    }
    let dir = temp_dir("ident");
    let (k, n) = (576, 64);
    let set = descriptor_set(&dir, &[(Q41, k, n), (Q8, k, n)]);
    for (pref, want_path) in [
        (WeightPathPref::Auto, WeightPath::MemfdImport),
        (WeightPathPref::Share, WeightPath::ShareBo),
    ] {
        // The executor is built from the environment here (XDNA_ALLOW_DESCRIPTOR_KERNELS=1).
        let mut opts = DeviceExecOptions::from_env();
        assert!(opts.allow_descriptor_only, "the parent sets the env switch");
        opts.weights = pref;
        let exec = open_exec(&set, opts);
        for (i, f) in [Q41, Q8].into_iter().enumerate() {
            // Weights are uploaded once per matrix: keep one matrix across all M.
            let wd = weights(f, n, k, 100 + i as u64);
            let w = WeightMatrix::new(f, n, k, &wd).unwrap();
            for m in [1, 5, 16, 128] {
                let x = acts(m, k, m as u64 * 31 + i as u64);
                let mut yh = vec![0f32; m * n];
                HostExecutor::global().gemm(&w, &x, m, &mut yh).unwrap();
                let mut yd = vec![f32::NAN; m * n];
                exec.gemm(&w, &x, m, &mut yd)
                    .unwrap_or_else(|e| panic!("device gemm {f:?} m={m}: {e}"));
                assert_eq!(bits(&yh), bits(&yd), "{f:?} m={m}: host and device differ");
                assert!(yh.iter().any(|v| *v != 0.0));
            }
        }
        let paths = exec.weight_paths();
        assert_eq!(paths, vec![want_path; 2], "one upload per weight matrix");
        // Families 16 and 128 of both formats are resident.
        assert_eq!(exec.resident_kernels().len(), 4);
        // Through the backend enum, too.
        let e = Executor::Device(Box::new(exec));
        let wd = weights(Q41, 32, 256, 5);
        let w = WeightMatrix::new(Q41, 32, 256, &wd).unwrap();
        let mut y = vec![0f32; 3 * 32];
        match e.gemm(&w, &acts(3, 256, 5), 3, &mut y) {
            Err(KernelError::Missing(names)) => {
                assert_eq!(
                    names,
                    vec![KernelKey::gemm(Q41, RowFamily::M16, 256, 32).file_name()]
                )
            }
            other => panic!("no kernel for K=256 N=32 in the set, got {other:?}"),
        }
        let wd = weights(Q8, n, k, 9);
        let w = WeightMatrix::new(Q8, n, k, &wd).unwrap();
        let x = acts(2, k, 1);
        let mut y1 = vec![0f32; 2 * n];
        let mut y2 = vec![0f32; 2 * n];
        e.gemm(&w, &x, 2, &mut y1).unwrap();
        Executor::Host(HostExecutor::new())
            .gemm(&w, &x, 2, &mut y2)
            .unwrap();
        assert_eq!(bits(&y1), bits(&y2));
        assert_eq!(e.name(), "xdna");
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("child ok");
}

#[test]
fn host_and_device_give_identical_outputs() {
    let r = run_child(
        "child_identical_outputs",
        &[("XDNA_ALLOW_DESCRIPTOR_KERNELS", "1")],
    );
    r.assert_ok_no_leaks();
}

// -------------------------------------------------------------------------------------------------

#[test]
fn child_context_lru() {
    if !is_child("child_context_lru") {
        return;
    }
    let dir = temp_dir("lru");
    let k = 256;
    let set = descriptor_set(&dir, &[(Q41, k, 32), (Q41, k, 64), (Q41, k, 96)]);
    let exec = open_exec(&set, allow());
    assert_eq!(exec.max_resident(), 2, "XDNA_SHIM_CONTEXT_LIMIT=2");
    let key = |n: usize| KernelKey::gemm(Q41, RowFamily::M16, k, n);
    let run = |n: usize| {
        let (h, d) = both(&exec, Q41, n, k, 1, n as u64);
        assert_eq!(h, d, "n={n}");
        assert!(exec.device().live_contexts() <= 2, "over the limit");
    };
    run(32);
    run(64);
    run(32);
    run(96); // limit + 1: the least recently used (n=64) goes
    assert_eq!(exec.resident_kernels(), vec![key(32), key(96)]);
    run(64); // now n=32 is the LRU one
    assert_eq!(exec.resident_kernels(), vec![key(96), key(64)]);
    drop(exec);
    let _ = std::fs::remove_dir_all(&dir);
    println!("child ok");
}

#[test]
fn resident_contexts_stay_within_the_limit_lru() {
    let r = run_child("child_context_lru", &[("XDNA_SHIM_CONTEXT_LIMIT", "2")]);
    r.assert_ok_no_leaks();
    assert!(
        !r.stderr.contains("EBUSY"),
        "never hit the limit:\n{}",
        r.stderr
    );
}

// -------------------------------------------------------------------------------------------------

#[test]
fn child_refuse_descriptor_only() {
    if !is_child("child_refuse_descriptor_only") {
        return;
    }
    let dir = temp_dir("refuse");
    let set = descriptor_set(&dir, &[(Q8, 256, 32)]);
    let exec = DeviceExecutor::new(XdnaDevice::open(NODE).expect("open"), &set);
    let wd = weights(Q8, 32, 256, 3);
    let w = WeightMatrix::new(Q8, 32, 256, &wd).unwrap();
    let mut y = vec![0f32; 32];
    let err = exec.gemm(&w, &acts(1, 256, 1), 1, &mut y).unwrap_err();
    let file = KernelKey::gemm(Q8, RowFamily::M16, 256, 32).file_name();
    match &err {
        KernelError::NoControlCode { path } => assert!(path.ends_with(&file), "{path:?}"),
        other => panic!("expected NoControlCode, got {other:?}"),
    }
    assert!(err.to_string().contains(&file), "{err}");
    assert_eq!(exec.device().live_contexts(), 0, "nothing created");
    drop(exec);
    let _ = std::fs::remove_dir_all(&dir);
    println!("child ok");
}

#[test]
fn descriptor_only_kernel_is_refused_on_real_hardware() {
    // The switch is off (removed from the environment): the executor must treat the device as real.
    let r = run_child(
        "child_refuse_descriptor_only",
        &[("XDNA_ALLOW_DESCRIPTOR_KERNELS", "0")],
    );
    r.assert_ok_no_leaks();
}

// -------------------------------------------------------------------------------------------------

/// A wrapped synthetic toolchain kernel (shim-TXN control code + .rela.dyn) for each family.
fn full_elf_set(dir: &Path, f: WeightFormat, k: usize, n: usize) -> KernelSet {
    for family in RowFamily::ALL {
        let desc = KernelDesc::gemm(f, family, k as u32, n as u32);
        let raw = shim_txn::synthetic_txn_elf(&desc, &[0, 0x40, 0x1000]);
        let wrapped = elf::wrap_elf(&raw, &desc).unwrap();
        std::fs::write(dir.join(desc.file_name()), wrapped).unwrap();
    }
    KernelSet::load(dir).unwrap()
}

#[test]
fn child_full_elf_flow() {
    if !is_child("child_full_elf_flow") {
        return;
    }
    let dir = temp_dir("full");
    let (k, n) = (576, 64);
    let set = full_elf_set(&dir, Q41, k, n);
    // No descriptor-only switch: full ELFs carry control code.
    let exec = open_exec(&set, DeviceExecOptions::default());
    for m in [1, 5, 16, 128] {
        let (h, d) = both(&exec, Q41, n, k, m, 40 + m as u64);
        assert_eq!(h, d, "full ELF m={m}");
    }
    // Repeated runs re-patch from the pristine copy.
    let (h, d) = both(&exec, Q41, n, k, 5, 77);
    assert_eq!(h, d);
    // Patching the already-patched code again (non-pristine copy) must fail on the device.
    exec.set_patch_in_place(true);
    let wd = weights(Q41, n, k, 8);
    let w = WeightMatrix::new(Q41, n, k, &wd).unwrap();
    let x = acts(5, k, 8);
    let mut y = vec![0f32; 5 * n];
    match exec.gemm(&w, &x, 5, &mut y) {
        Err(KernelError::Device {
            path,
            source: DeviceError::CommandFailed { state, .. },
        }) => {
            assert!(path.to_string_lossy().contains("gemm_"), "{path:?}");
            assert_eq!(format!("{state:?}").to_uppercase(), "ERROR");
        }
        other => panic!("double patch should fail, got {other:?}"),
    }
    exec.set_patch_in_place(false);
    let (h, d) = both(&exec, Q41, n, k, 5, 78);
    assert_eq!(h, d, "pristine patching works again");
    drop(exec);
    let _ = std::fs::remove_dir_all(&dir);
    println!("child ok");
}

#[test]
fn full_elf_flow_patches_from_a_pristine_copy() {
    let r = run_child(
        "child_full_elf_flow",
        &[("XDNA_ALLOW_DESCRIPTOR_KERNELS", "0")],
    );
    r.assert_ok_no_leaks();
    assert!(
        r.stderr.contains("patched twice"),
        "the shim names the double patch:\n{}",
        r.stderr
    );
}

// -------------------------------------------------------------------------------------------------

#[test]
fn child_exec_failure() {
    if !is_child("child_exec_failure") {
        return;
    }
    let dir = temp_dir("fail");
    let (k, n) = (256, 32);
    let set = descriptor_set(&dir, &[(Q8, k, n)]);
    let exec = open_exec(&set, allow());
    let wd = weights(Q8, n, k, 4);
    let w = WeightMatrix::new(Q8, n, k, &wd).unwrap();
    let x = acts(2, k, 4);
    let mut y = vec![0f32; 2 * n];
    exec.gemm(&w, &x, 2, &mut y).expect("exec #1 runs");
    match exec.gemm(&w, &x, 2, &mut y) {
        Err(KernelError::Device {
            path,
            source: DeviceError::CommandFailed { state, .. },
        }) => {
            assert!(path.ends_with(KernelKey::gemm(Q8, RowFamily::M16, k, n).file_name()));
            assert_eq!(format!("{state:?}").to_uppercase(), "ERROR");
        }
        other => panic!("exec #2 is forced to ERROR, got {other:?}"),
    }
    assert_eq!(exec.device().live_contexts(), 0, "failed context dropped");
    let (h, d) = both(&exec, Q8, n, k, 2, 4);
    assert_eq!(h, d, "the executor recovers");
    drop(exec);
    let _ = std::fs::remove_dir_all(&dir);
    println!("child ok");
}

#[test]
fn injected_exec_failure_is_a_typed_error_and_leaks_nothing() {
    let r = run_child("child_exec_failure", &[("XDNA_SHIM_FAIL_EXEC", "2:ERROR")]);
    r.assert_ok_no_leaks();
    assert_eq!(r.stats[0]["execs"], 3);
}

// -------------------------------------------------------------------------------------------------

#[test]
fn child_threads() {
    if !is_child("child_threads") {
        return;
    }
    let dir = temp_dir("threads");
    let (k, n) = (576, 96);
    let set = descriptor_set(&dir, &[(Q41, k, n), (Q8, k, n)]);
    // Two clients (two device fds) submitting at once while the shim's executor uses its worker
    // pool inside EXEC_CMD, and the host executor's pool runs in this process: no deadlock, same
    // bits. M = 200 also checks the m128 pass split (128 + 72).
    std::thread::scope(|s| {
        for (t, f) in [Q41, Q8].into_iter().enumerate() {
            let set = &set;
            s.spawn(move || {
                let exec = open_exec(set, allow());
                let wd = weights(f, n, k, 300 + t as u64);
                let w = WeightMatrix::new(f, n, k, &wd).unwrap();
                for (i, m) in [16, 200, 1, 16, 3].into_iter().enumerate() {
                    let x = acts(m, k, (t * 10 + i) as u64);
                    let mut yh = vec![0f32; m * n];
                    HostExecutor::global().gemm(&w, &x, m, &mut yh).unwrap();
                    let mut yd = vec![0f32; m * n];
                    exec.gemm(&w, &x, m, &mut yd).unwrap();
                    assert_eq!(bits(&yh), bits(&yd), "thread {t} m={m}");
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    println!("child ok");
}

#[test]
fn concurrent_device_gemms_do_not_deadlock() {
    let r = run_child("child_threads", &[]);
    r.assert_ok_no_leaks();
    assert_eq!(r.stats.len(), 2, "one stats line per device fd");
}

// -------------------------------------------------------------------------------------------------

#[test]
fn child_executor_error_names_the_kernel() {
    if !is_child("child_executor_error_names_the_kernel") {
        return;
    }
    use xdna::device::{Bo, BoKind, HwContext};
    let dev = XdnaDevice::open(NODE).expect("open");
    let desc = KernelDesc::gemm(Q8, RowFamily::M16, 256, 32);
    let image = Bo::with_data(&dev, BoKind::Dev, &elf::build_kernel_elf(&desc)).unwrap();
    let mut ctx = HwContext::with_image(&dev, 4, &image).unwrap();
    let wd = weights(Q8, 32, 256, 1);
    let w = Bo::with_data(&dev, BoKind::Share, &wd).unwrap();
    let x = Bo::with_data(&dev, BoKind::Share, &[0u8; 4 * 256]).unwrap();
    // y should hold 1 × 32 f32 = 128 bytes; give it 100.
    let y = Bo::new(&dev, BoKind::Share, 100).unwrap();
    match ctx.run_start_cu(
        &image,
        &[&w, &x, &y],
        Some(std::time::Duration::from_secs(5)),
    ) {
        Err(DeviceError::CommandFailed { state, .. }) => {
            assert_eq!(format!("{state:?}").to_uppercase(), "ERROR")
        }
        other => panic!("wrong-sized output should fail, got {other:?}"),
    }
    // The right size runs (m = 1).
    let y = Bo::new(&dev, BoKind::Share, 128).unwrap();
    ctx.run_start_cu(
        &image,
        &[&w, &x, &y],
        Some(std::time::Duration::from_secs(5)),
    )
    .expect("right sizes run");
    drop((ctx, image, w, x, y, dev));
    println!("child ok");
}

#[test]
fn executor_errors_end_in_error_naming_the_kernel() {
    let r = run_child("child_executor_error_names_the_kernel", &[]);
    r.assert_ok_no_leaks();
    assert!(
        r.stderr
            .contains("ERROR: kernel failed: kernel gemm_q8h_m16_k256_n32.elf: y bytes"),
        "{}",
        r.stderr
    );
}

/// The model shares one executor between threads.
#[test]
fn executors_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<DeviceExecutor>();
    send_sync::<Executor>();
}
