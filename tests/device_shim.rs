//! The runtime's xdna backend and the `xdna` CLI against the fake amdxdna device
//! (tools/xdna-shim), each in a child process started with `LD_PRELOAD`.
//!
//! Needs `target/<profile>/libxdna_shim.so` and `target/<profile>/xdna`: `cargo build --workspace`.

mod shim_support;

use shim_support::*;

#[test]
fn xdna_info_json_shows_the_fake_device() {
    let xdna = bin_path("xdna");
    assert!(
        xdna.exists(),
        "{} missing: build it with `cargo build --workspace`",
        xdna.display()
    );
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
    assert!(
        out.status.success(),
        "xdna info --json failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}"));
    assert_eq!(v["driver"], "amdxdna_accel_driver", "{stdout}");
    assert_eq!(v["sysfs"]["vbnv"], "RyzenAI-npu4-shim", "{stdout}");
    assert_eq!(v["sysfs"]["device"], 0x17f0, "{stdout}");
    assert_eq!(v["firmware"], "1.5.2.380", "{stdout}");
    assert_eq!(v["aie"]["cols"], 6, "{stdout}");
    assert_eq!(v["context_limit"], 16, "{stdout}");
}

// -------------------------------------------------------------------------------------------------
// The device layer (xdna::device) in children under the shim.

use std::os::fd::AsFd;
use std::time::Duration;
use xdna::device::{ert::CmdState, uapi, Bo, BoKind, DeviceError, HwContext, XdnaDevice};

const NODE: &str = "/dev/accel/accel0";
const T: Option<Duration> = Some(Duration::from_secs(5));

fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// open → heap (by open) → image DEV BO + two SHARE BOs → context with the image as CU 0 →
/// START_CU copy a→b → wait → state → check; then axpy. Returns b's values.
fn round_trip(dev: &XdnaDevice) -> Result<Vec<f32>, DeviceError> {
    let mut image = Bo::new(dev, BoKind::Dev, 16)?;
    image.write(0, &shim_image(1, 0.0))?;
    let mut a = Bo::new(dev, BoKind::Share, 4096)?;
    let b = Bo::new(dev, BoKind::Share, 4096)?;
    let xs: Vec<f32> = (0..1024).map(|i| i as f32 * 0.5).collect();
    a.write(0, &f32_bytes(&xs))?;
    let mut ctx = HwContext::with_image(dev, 1, &image)?;
    let done = ctx.run_start_cu(&image, &[&a, &b], T)?;
    assert_eq!(done.state, CmdState::Completed);
    assert_eq!(bytes_f32(b.as_slice()), xs, "copy moved the data");
    image.write(0, &shim_image(2, -2.0))?;
    ctx.run_start_cu(&image, &[&a, &b], T)?;
    Ok(bytes_f32(b.as_slice()))
}

#[test]
fn child_dev_round_trip() {
    if !is_child("child_dev_round_trip") {
        return;
    }
    let dev = XdnaDevice::open(NODE).expect("open");
    assert_eq!(dev.drm_version().name, "amdxdna_accel_driver");
    assert_eq!(dev.aie().cols, 8);
    let got = round_trip(&dev).expect("round trip");
    let want: Vec<f32> = (0..1024)
        .map(|i| -2.0 * (i as f32 * 0.5) + i as f32 * 0.5)
        .collect();
    assert_eq!(got, want, "axpy b = -2a + b");
    drop(dev);
    println!("child ok");
}

#[test]
fn device_layer_round_trip_moves_data() {
    let r = run_child("child_dev_round_trip", &[]);
    r.assert_ok_no_leaks();
    assert_eq!(r.stats[0]["execs"], 2);
}

#[test]
fn child_dev_exec_fault() {
    if !is_child("child_dev_exec_fault") {
        return;
    }
    let want = std::env::var("WANT_STATE").unwrap();
    let dev = XdnaDevice::open(NODE).expect("open");
    match round_trip(&dev) {
        Err(DeviceError::CommandFailed { state, .. }) => {
            assert_eq!(format!("{state:?}").to_uppercase(), want)
        }
        other => panic!("expected CommandFailed({want}), got {other:?}"),
    }
    // The device is still usable after a failed command.
    round_trip(&dev).expect("second round trip");
    println!("child ok");
}

#[test]
fn injected_exec_faults_are_typed_errors_and_leak_nothing() {
    for state in ["ERROR", "TIMEOUT", "ABORT"] {
        let r = run_child(
            "child_dev_exec_fault",
            &[
                ("XDNA_SHIM_FAIL_EXEC", &format!("1:{state}")),
                ("WANT_STATE", state),
            ],
        );
        r.assert_ok_no_leaks();
    }
}

#[test]
fn child_dev_ioctl_fault() {
    if !is_child("child_dev_ioctl_fault") {
        return;
    }
    let want = std::env::var("WANT_TEXT").unwrap();
    let r = XdnaDevice::open(NODE).and_then(|dev| round_trip(&dev));
    match r {
        Err(e) => {
            let text = e.to_string();
            println!("error: {text}");
            assert!(
                text.contains(&want),
                "error `{text}` does not mention `{want}`"
            );
        }
        Ok(_) => panic!("the injected fault ({want}) did not surface"),
    }
    println!("child ok");
}

#[test]
fn injected_ioctl_errnos_are_typed_errors_and_leak_nothing() {
    // (XDNA_SHIM_IOCTL_ERRNO, text the typed error must contain)
    let cases = [
        ("CREATE_BO:ENOMEM@3", "DRM_IOCTL_AMDXDNA_CREATE_BO"),
        ("CREATE_BO:ENOMEM@1", "DRM_IOCTL_AMDXDNA_CREATE_BO"),
        ("MMAP:ENOMEM@2", "Cannot allocate memory"),
        ("CREATE_HWCTX:ENODEV", "DRM_IOCTL_AMDXDNA_CREATE_HWCTX"),
        ("CONFIG_HWCTX:EINVAL", "DRM_IOCTL_AMDXDNA_CONFIG_HWCTX"),
        ("EXEC_CMD:ENOMEM", "DRM_IOCTL_AMDXDNA_EXEC_CMD"),
        ("EXEC_CMD:EINVAL@2", "DRM_IOCTL_AMDXDNA_EXEC_CMD"),
        ("SYNC_BO:EIO", "DRM_IOCTL_AMDXDNA_SYNC_BO"),
        (
            "SYNCOBJ_TIMELINE_WAIT:ETIME",
            "did not complete within 5000 ms",
        ),
    ];
    for (fault, text) in cases {
        let r = run_child(
            "child_dev_ioctl_fault",
            &[("XDNA_SHIM_IOCTL_ERRNO", fault), ("WANT_TEXT", text)],
        );
        assert!(r.ok, "{fault}: child failed\n{}\n{}", r.stdout, r.stderr);
        for s in &r.stats {
            for k in ["bos", "contexts", "syncobjs"] {
                assert_eq!(s[k], 0, "{fault}: leaked {k}: {s}\n{}", r.stderr);
            }
        }
    }
}

#[test]
fn child_dev_ordering() {
    if !is_child("child_dev_ordering") {
        return;
    }
    // Below the device layer (which always creates the heap first): a context before any heap.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(NODE)
        .unwrap();
    let e = uapi::create_hwctx(f.as_fd(), &uapi::qos_default(), 4, 0).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    drop(f);
    println!("child ok");
}

#[test]
fn context_before_heap_gives_enoent_and_says_what_to_do() {
    let r = run_child("child_dev_ordering", &[]);
    r.assert_ok_no_leaks();
    assert!(
        r.stderr.contains("CREATE_HWCTX: ENOENT")
            && r.stderr.contains(
                "create the 64 MiB DEV_HEAP BO and mmap it before creating a hardware context"
            ),
        "{}",
        r.stderr
    );
}

#[test]
fn child_dev_context_limit() {
    if !is_child("child_dev_context_limit") {
        return;
    }
    let dev = XdnaDevice::open(NODE).unwrap();
    assert_eq!(dev.context_limit(), Some(2));
    let image = Bo::new(&dev, BoKind::Dev, 16).unwrap();
    let c1 = HwContext::with_image(&dev, 1, &image).unwrap();
    let c2 = HwContext::new(&dev, 2).unwrap();
    match HwContext::new(&dev, 1) {
        Err(DeviceError::ContextLimit { limit: 2, .. }) => {}
        other => panic!("expected ContextLimit, got {other:?}"),
    }
    // The driver's own answer (bypassing the layer's pre-check).
    let e = uapi::create_hwctx(dev.fd(), &uapi::qos_default(), 4, 0).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EBUSY));
    drop(c1);
    let c3 = HwContext::new(&dev, 1).expect("a slot is free again");
    drop((c2, c3, image, dev));
    println!("child ok");
}

#[test]
fn context_limit_plus_one_is_refused() {
    run_child(
        "child_dev_context_limit",
        &[("XDNA_SHIM_CONTEXT_LIMIT", "2")],
    )
    .assert_ok_no_leaks();
}

#[test]
fn child_dev_mbz() {
    if !is_child("child_dev_mbz") {
        return;
    }
    let dev = XdnaDevice::open(NODE).unwrap();
    let qos = uapi::qos_default();
    let mut arg = xdna::ffi::amdxdna_drm_create_hwctx {
        ext: 1,
        qos_p: &qos as *const _ as u64,
        num_tiles: 4,
        ..Default::default()
    };
    // SAFETY: a valid create_hwctx struct for the request it is passed with.
    let r = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&dev.fd()),
            xdna::ffi::DRM_IOCTL_AMDXDNA_CREATE_HWCTX,
            &mut arg,
        )
    };
    assert_eq!(
        (r, std::io::Error::last_os_error().raw_os_error()),
        (-1, Some(libc::EINVAL))
    );
    println!("child ok");
}

#[test]
fn mbz_violation_is_einval() {
    let r = run_child("child_dev_mbz", &[]);
    r.assert_ok_no_leaks();
    assert!(
        r.stderr
            .contains("CREATE_HWCTX: EINVAL (22): ext must be zero"),
        "{}",
        r.stderr
    );
}

#[test]
fn child_dev_guard() {
    if !is_child("child_dev_guard") {
        return;
    }
    let dev = XdnaDevice::open(NODE).unwrap();
    let mut image = Bo::new(&dev, BoKind::Dev, 16).unwrap();
    image.write(0, &shim_image(1, 0.0)).unwrap();
    let a = Bo::new(&dev, BoKind::Share, 100).unwrap();
    let mut b = Bo::new(&dev, BoKind::Share, 100).unwrap();
    let mut ctx = HwContext::with_image(&dev, 1, &image).unwrap();
    ctx.run_start_cu(&image, &[&a, &b], T).unwrap();
    // A buggy writer runs one word past the end of b (the page is mapped; the guard is there).
    // SAFETY: b's mapping covers a whole page; bytes 100..104 are the shim's guard words.
    unsafe {
        b.as_mut_slice()
            .as_mut_ptr()
            .add(100)
            .cast::<u32>()
            .write_unaligned(0)
    };
    match ctx.run_start_cu(&image, &[&a, &b], T) {
        Err(DeviceError::CommandFailed {
            state: CmdState::Error,
            ..
        }) => {}
        other => panic!("expected CommandFailed(Error), got {other:?}"),
    }
    println!("overrun BO {}", b.handle());
    drop((ctx, a, b, image, dev));
    println!("child ok");
}

#[test]
fn guard_overrun_fails_the_command_and_names_the_bo() {
    let r = run_child("child_dev_guard", &[]);
    r.assert_ok_no_leaks();
    let at = r.stdout.find("overrun BO ").expect("handle line") + "overrun BO ".len();
    let h: String = r.stdout[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    assert!(
        r.stderr.contains(&format!(
            "guard words after BO {h} (SHARE, 100 bytes) clobbered at byte 100"
        )),
        "{}",
        r.stderr
    );
}

#[test]
fn open_failure_after_the_heap_leaves_nothing_alive() {
    let r = run_child(
        "child_dev_ioctl_fault",
        &[
            ("XDNA_SHIM_IOCTL_ERRNO", "GET_INFO:EIO@1"),
            ("WANT_TEXT", "QUERY_AIE_METADATA"),
        ],
    );
    r.assert_ok_no_leaks();
}

#[test]
fn child_dev_threads() {
    if !is_child("child_dev_threads") {
        return;
    }
    // Four threads, each its own device fd (four shim clients) and context, submitting while the
    // allocator maps and unmaps large blocks: no deadlock between the shim's lock and mmap.
    let handles: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let dev = XdnaDevice::open(NODE).expect("open");
                for i in 0..25 {
                    let big = vec![t as u8; 512 << 10]; // malloc → mmap
                    let got = round_trip(&dev).expect("round trip");
                    assert_eq!(got[2], -2.0 * 1.0 + 1.0, "thread {t} iteration {i}");
                    assert_eq!(big[big.len() - 1], t as u8);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("thread");
    }
    println!("child ok");
}

#[test]
fn concurrent_clients_do_not_deadlock_or_leak() {
    let r = run_child("child_dev_threads", &[]);
    r.assert_ok_no_leaks();
    assert_eq!(r.stats.len(), 4, "one stats line per device fd");
}

#[test]
fn xdna_info_prints_the_fake_device() {
    let out = std::process::Command::new(bin_path("xdna"))
        .arg("info")
        .env("LD_PRELOAD", shim_path())
        .env_remove("XDNA_DEVICE")
        .output()
        .expect("run xdna info");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "device         /dev/accel/accel0",
        "driver         amdxdna_accel_driver 0.16.0",
        "board (vbnv)   RyzenAI-npu4",
        "firmware       1.5.2.380",
    ] {
        assert!(
            stdout.lines().any(|l| l == want),
            "line `{want}` missing:\n{stdout}"
        );
    }
    assert!(stdout.contains("8 columns × 6 rows"), "{stdout}");
}

#[test]
fn child_dev_forgotten() {
    if !is_child("child_dev_forgotten") {
        return;
    }
    let dev = XdnaDevice::open(NODE).unwrap();
    std::mem::forget(dev); // never closed: the shim reports it at exit
    println!("child ok");
}

#[test]
fn a_device_never_closed_is_reported_at_exit() {
    let r = run_child("child_dev_forgotten", &[]);
    assert!(r.ok, "{}", r.stderr);
    assert_eq!(r.stats.len(), 1, "{:?}", r.stats);
    assert_eq!(r.stats[0]["closed"], false);
    assert_eq!(r.stats[0]["bos"], 1, "the heap");
}
