//! The xdna backend (runtime/device) end to end against the fake amdxdna
//! device (tools/xdna-shim). Each `#[test]` is a parent that re-executes
//! this binary under `LD_PRELOAD` to run one `child_*` body; the children do
//! nothing unless they are that child.
//!
//! Needs `target/<profile>/libxdna_shim.so` (`cargo build --workspace`); the
//! parents fail, saying so, when it is missing.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;
use xdna::device::ert::CmdState;
use xdna::device::{
    sealed_memfd, Bo, BoKind, DeviceError, HwContext, SyncDirection, XdnaDevice, HEAP_DEVICE_BASE,
    HEAP_SIZE,
};

const CHILD_ENV: &str = "XDNA_DEVICE_TEST_CHILD";
const TIMEOUT: Option<Duration> = Some(Duration::from_secs(5));

fn is_child(name: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|v| v == name)
}

fn shim() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let so = exe.parent()?.parent()?.join("libxdna_shim.so");
    so.exists().then_some(so)
}

/// Runs child `name` under the shim with `env`; returns (ok, stdout+stderr,
/// stats lines). Fails the test when the shim is not built.
fn run_child(name: &str, env: &[(&str, &str)]) -> (bool, String, Vec<String>) {
    let Some(so) = shim() else {
        panic!("{name}: libxdna_shim.so is not built next to the test binary; run `cargo build --workspace` first");
    };
    // Unique per run: several parent tests may run the same child body concurrently.
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stats = std::env::temp_dir().join(format!(
        "xdna-dev-{name}-{}-{run}.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&stats);
    let exe = std::env::current_exe().expect("current test executable");
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, name)
        .env("LD_PRELOAD", &so)
        .env("XDNA_SHIM_STATS", &stats)
        .env_remove("XDNA_DEVICE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("spawn the child test process");
    let text = format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = std::fs::read_to_string(&stats)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    let _ = std::fs::remove_file(&stats);
    (out.status.success(), text, lines)
}

/// Child succeeded and freed every BO, context and syncobj before close.
fn expect_ok_no_leaks(name: &str, env: &[(&str, &str)]) {
    let (ok, text, stats) = run_child(name, env);
    assert!(ok, "{name} failed\n{text}");
    assert!(!stats.is_empty(), "{name}: device never closed\n{text}");
    for s in &stats {
        for k in ["\"bos\":0", "\"contexts\":0", "\"syncobjs\":0"] {
            assert!(s.contains(k), "{name}: leak ({k} expected) in {s}\n{text}");
        }
    }
}

fn shim_image(dev: &XdnaDevice, op: u32, alpha: f32) -> Bo {
    let mut img = Vec::with_capacity(64);
    img.extend_from_slice(b"XDNASHIM");
    img.extend_from_slice(&op.to_le_bytes());
    img.extend_from_slice(&alpha.to_le_bytes());
    img.resize(64, 0);
    let mut bo = Bo::new(dev, BoKind::Dev, img.len()).expect("DEV BO");
    bo.write(0, &img).expect("write image");
    bo
}

fn put_f32(bo: &mut Bo, xs: &[f32]) {
    let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
    bo.write(0, &bytes).expect("write f32s");
}

fn get_f32(bo: &Bo, n: usize) -> Vec<f32> {
    bo.as_slice()[..4 * n]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

// ---------------------------------------------------------------------------

#[test]
fn round_trip_copy_and_axpy() {
    expect_ok_no_leaks("child_round_trip", &[]);
}

#[test]
fn child_round_trip() {
    if !is_child("child_round_trip") {
        return;
    }
    let dev = XdnaDevice::discover().expect("open the shim device");
    assert_eq!(dev.drm_version().name, "amdxdna_accel_driver");
    assert_eq!(dev.heap().cpu_addr() % HEAP_SIZE, 0, "heap 64 MiB aligned");
    assert_eq!(dev.heap().xdna_addr(), HEAP_DEVICE_BASE);
    assert_eq!(dev.aie().core_rows, 4);

    let n = 1024;
    let mut a = Bo::new(&dev, BoKind::Share, 4 * n).unwrap();
    let mut b = Bo::new(&dev, BoKind::Share, 4 * n).unwrap();
    assert_eq!(
        a.xdna_addr(),
        a.as_slice().as_ptr() as u64,
        "SHARE addr = VA"
    );
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    put_f32(&mut a, &xs);

    let copy = shim_image(&dev, 1, 0.0);
    assert_eq!((copy.xdna_addr() - HEAP_DEVICE_BASE) % (32 << 10), 0);
    let mut ctx = HwContext::with_image(&dev, 1, &copy).unwrap();
    let c1 = ctx.run_start_cu(&copy, &[&a, &b], TIMEOUT).unwrap();
    assert_eq!(c1.state, CmdState::Completed);
    assert_eq!(get_f32(&b, n), xs);
    // Same context again: the CMD BO is reused, seq advances.
    let c2 = ctx.run_start_cu(&copy, &[&a, &b], TIMEOUT).unwrap();
    assert_eq!(c2.seq, c1.seq + 1);
    // A buffer passed twice: EXEC args are de-duplicated.
    ctx.run_start_cu(&copy, &[&a, &a], TIMEOUT).unwrap();
    // An image that is not this context's CU 0 is refused before submission.
    let other = shim_image(&dev, 1, 0.0);
    assert!(matches!(
        ctx.run_start_cu(&other, &[&a, &b], TIMEOUT),
        Err(DeviceError::Invalid(_))
    ));
    drop(other);
    // CONFIG_CU is write-once.
    assert!(matches!(
        ctx.configure_cu(&[(&copy, 0)]),
        Err(DeviceError::Invalid(_))
    ));

    let axpy = shim_image(&dev, 2, 2.0);
    let mut ctx2 = HwContext::with_image(&dev, 2, &axpy).unwrap();
    put_f32(&mut b, &vec![1.0; n]);
    ctx2.run_start_cu(&axpy, &[&a, &b], TIMEOUT).unwrap();
    let want: Vec<f32> = xs.iter().map(|x| 2.0 * x + 1.0).collect();
    assert_eq!(get_f32(&b, n), want);

    let info = dev.info().unwrap();
    assert_eq!(info.contexts.as_ref().map(Vec::len), Some(2));
    assert_eq!(dev.live_contexts(), 2);
    drop(ctx2);
    assert_eq!(dev.live_contexts(), 1);
}

#[test]
fn failed_command_names_state_context_command() {
    let (ok, text, _) = run_child(
        "child_fail_timeout",
        &[("XDNA_SHIM_FAIL_EXEC", "1:TIMEOUT")],
    );
    assert!(ok, "{text}");
}

#[test]
fn child_fail_timeout() {
    if !is_child("child_fail_timeout") {
        return;
    }
    let dev = XdnaDevice::discover().unwrap();
    let a = Bo::new(&dev, BoKind::Share, 4096).unwrap();
    let b = Bo::new(&dev, BoKind::Share, 4096).unwrap();
    let img = shim_image(&dev, 1, 0.0);
    let mut ctx = HwContext::with_image(&dev, 1, &img).unwrap();
    let err = ctx.run_start_cu(&img, &[&a, &b], TIMEOUT).unwrap_err();
    let msg = err.to_string();
    match err {
        DeviceError::CommandFailed { state, context, .. } => {
            assert_eq!(state, CmdState::Timeout);
            assert_eq!(context, ctx.handle());
        }
        other => panic!("expected CommandFailed, got {other}"),
    }
    assert!(msg.contains("TIMEOUT") && msg.contains("START_CU"), "{msg}");
    assert!(
        msg.contains(&format!("hardware context {}", ctx.handle())),
        "{msg}"
    );
    // The next command runs normally (the CMD BO is rewritten).
    ctx.run_start_cu(&img, &[&a, &b], TIMEOUT).unwrap();
}

#[test]
fn context_limit_is_enforced() {
    expect_ok_no_leaks("child_context_limit", &[("XDNA_SHIM_CONTEXT_LIMIT", "2")]);
}

#[test]
fn child_context_limit() {
    if !is_child("child_context_limit") {
        return;
    }
    let dev = XdnaDevice::discover().unwrap();
    assert_eq!(dev.context_limit(), Some(2));
    let c1 = HwContext::new(&dev, 1).unwrap();
    let _c2 = HwContext::new(&dev, 1).unwrap();
    match HwContext::new(&dev, 1) {
        Err(DeviceError::ContextLimit {
            limit: 2, live: 2, ..
        }) => {}
        other => panic!("expected ContextLimit, got {other:?}"),
    }
    drop(c1);
    let _c3 = HwContext::new(&dev, 1).unwrap();
    assert!(matches!(
        HwContext::new(&dev, 0),
        Err(DeviceError::Invalid(_))
    ));
    assert!(matches!(
        HwContext::new(&dev, 99),
        Err(DeviceError::Invalid(_))
    ));
}

#[test]
fn oot_driver_waits_with_wait_cmd() {
    expect_ok_no_leaks("child_oot", &[("XDNA_SHIM_DRIVER_VERSION", "1.0")]);
}

#[test]
fn child_oot() {
    if !is_child("child_oot") {
        return;
    }
    let dev = XdnaDevice::discover().unwrap();
    assert!(dev.version().is_oot());
    let mut a = Bo::new(&dev, BoKind::Share, 256).unwrap();
    let b = Bo::new(&dev, BoKind::Share, 256).unwrap();
    a.write(0, &[7u8; 256]).unwrap();
    let img = shim_image(&dev, 1, 0.0);
    let mut ctx = HwContext::with_image(&dev, 1, &img).unwrap();
    ctx.run_start_cu(&img, &[&a, &b], TIMEOUT).unwrap();
    assert_eq!(b.as_slice(), &[7u8; 256][..]);
}

#[test]
fn old_mainline_driver_degrades() {
    expect_ok_no_leaks("child_old_driver", &[("XDNA_SHIM_DRIVER_VERSION", "0.0")]);
}

#[test]
fn child_old_driver() {
    if !is_child("child_old_driver") {
        return;
    }
    let dev = XdnaDevice::discover().unwrap();
    let info = dev.info().unwrap();
    assert!(info.resources.is_none(), "no RESOURCE_INFO before 0.4");
    assert_eq!(info.context_limit, Some(16), "per-PCI-id default for 17f0");
    assert_eq!(info.firmware.as_deref(), Some("1.5.2.380"));
}

#[test]
fn prime_and_udmabuf() {
    expect_ok_no_leaks("child_dmabuf", &[]);
}

#[test]
fn child_dmabuf() {
    if !is_child("child_dmabuf") {
        return;
    }
    let dev = XdnaDevice::discover().unwrap();
    // Export a SHARE BO and import it back: same pages.
    let mut a = Bo::new(&dev, BoKind::Share, 8192).unwrap();
    a.write(0, b"exported").unwrap();
    let fd = a.export().unwrap();
    let imported = dev
        .import_dmabuf(std::os::fd::AsFd::as_fd(&fd), 8192)
        .unwrap();
    assert_eq!(&imported.as_slice()[..8], b"exported");
    // A DEV BO refuses export.
    let d = Bo::new(&dev, BoKind::Dev, 4096).unwrap();
    assert!(d.export().is_err());

    // memfd sealed F_SEAL_SHRINK → udmabuf → PRIME import → run on it.
    let memfd = sealed_memfd("weights", 65536).unwrap();
    let pattern: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    {
        let mut f = std::fs::File::from(memfd.try_clone().unwrap());
        std::io::Write::write_all(&mut f, &pattern).unwrap();
    }
    let w = dev
        .import_memfd(std::os::fd::AsFd::as_fd(&memfd), 0, 65536)
        .unwrap();
    assert_eq!(w.as_slice(), &pattern[..]);
    let out = Bo::new(&dev, BoKind::Share, 65536).unwrap();
    let img = shim_image(&dev, 1, 0.0);
    let mut ctx = HwContext::with_image(&dev, 1, &img).unwrap();
    ctx.run_start_cu(&img, &[&w, &out], TIMEOUT).unwrap();
    out.sync(SyncDirection::FromDevice).unwrap();
    assert_eq!(out.as_slice(), &pattern[..]);
    assert!(dev
        .import_memfd(std::os::fd::AsFd::as_fd(&memfd), 1, 4096)
        .is_err());
}

#[test]
fn open_failures_name_the_check() {
    for (child, env) in [
        ("child_open_sva", "OPEN:ENODEV"),
        ("child_open_eacces", "OPEN:EACCES"),
    ] {
        let (ok, text, _) = run_child(child, &[("XDNA_SHIM_IOCTL_ERRNO", env)]);
        assert!(ok, "{child}\n{text}");
    }
}

#[test]
fn child_open_sva() {
    if !is_child("child_open_sva") {
        return;
    }
    let err = XdnaDevice::discover().unwrap_err();
    assert!(matches!(err, DeviceError::SvaBind { .. }), "{err}");
    assert!(err.to_string().contains("/dev/accel/accel0"), "{err}");
}

#[test]
fn child_open_eacces() {
    if !is_child("child_open_eacces") {
        return;
    }
    let err = XdnaDevice::open("/dev/accel/accel0").unwrap_err();
    assert!(matches!(err, DeviceError::PermissionDenied { .. }), "{err}");
    assert!(err.to_string().contains("render"), "{err}");
}

#[test]
fn ioctl_errors_name_ioctl_and_errno() {
    let env = [("XDNA_SHIM_IOCTL_ERRNO", "EXEC_CMD:ENOMEM")];
    expect_ok_no_leaks("child_ioctl_errno", &env);
}

#[test]
fn child_ioctl_errno() {
    if !is_child("child_ioctl_errno") {
        return;
    }
    let dev = XdnaDevice::discover().unwrap();
    let a = Bo::new(&dev, BoKind::Share, 4096).unwrap();
    let img = shim_image(&dev, 1, 0.0);
    let mut ctx = HwContext::with_image(&dev, 1, &img).unwrap();
    let err = ctx.run_start_cu(&img, &[&a], TIMEOUT).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            DeviceError::Ioctl {
                ioctl: "DRM_IOCTL_AMDXDNA_EXEC_CMD",
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains("/dev/accel/accel0"), "{msg}");
    let errno = std::io::Error::from_raw_os_error(libc::ENOMEM).to_string();
    assert!(msg.contains(&errno), "{msg}");
}

#[test]
fn start_npu_and_full_elf_packets() {
    expect_ok_no_leaks("child_npu", &[]);
}

#[test]
fn child_npu() {
    if !is_child("child_npu") {
        return;
    }
    let dev = XdnaDevice::discover().unwrap();
    let mut a = Bo::new(&dev, BoKind::Share, 4096).unwrap();
    let b = Bo::new(&dev, BoKind::Share, 4096).unwrap();
    a.write(0, &[3u8; 4096]).unwrap();
    let mut img = b"XDNASHIM".to_vec();
    img.extend_from_slice(&1u32.to_le_bytes());
    img.extend_from_slice(&0f32.to_le_bytes());
    img.resize(64, 0);
    let instr = Bo::with_data(&dev, BoKind::Dev, &img).unwrap();
    let mut ctx = HwContext::new(&dev, 1).unwrap();
    if !instr.xdna_addr().is_multiple_of(16 << 10) {
        // The builder refuses what the firmware would never complete.
        assert!(matches!(
            ctx.run_start_npu(&instr, &[], &[&a, &b], TIMEOUT),
            Err(DeviceError::Invalid(_))
        ));
        return;
    }
    let words = [
        a.xdna_addr() as u32,
        (a.xdna_addr() >> 32) as u32,
        b.xdna_addr() as u32,
        (b.xdna_addr() >> 32) as u32,
    ];
    ctx.run_start_npu(&instr, &words, &[&a, &b], TIMEOUT)
        .unwrap();
    assert_eq!(b.as_slice(), &[3u8; 4096][..]);
    // A SHARE BO is not control code.
    assert!(matches!(
        ctx.run_preempt_elf(&a, &[], TIMEOUT),
        Err(DeviceError::Invalid(_))
    ));
}
