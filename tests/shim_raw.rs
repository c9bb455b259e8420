//! The fake amdxdna device (tools/xdna-shim) driven with raw ioctls from a child process started
//! with `LD_PRELOAD`. Each `#[test]` here is a parent that re-executes this binary running one
//! `child_*` body; the `child_*` tests do nothing unless they are that child.
//!
//! Needs `target/<profile>/libxdna_shim.so`: `cargo build --workspace` first.

mod shim_support;

use shim_support::*;

fn f32s(b: &[u8], n: usize) -> Vec<f32> {
    b[..4 * n]
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn put_f32s(b: &mut [u8], xs: &[f32]) {
    for (i, x) in xs.iter().enumerate() {
        b[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes());
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_round_trip() {
    if !is_child("child_round_trip") {
        return;
    }
    let d = Raw::open();
    let mut v = [0u8; 64];
    let mut name = [0u8; 64];
    put64(&mut v, 16, name.len() as u64);
    put64(&mut v, 24, name.as_mut_ptr() as u64);
    d.ioctl(DRM_VERSION, &mut v).unwrap();
    let n = get64(&v, 16) as usize;
    assert_eq!(&name[..n], b"amdxdna_accel_driver");
    assert_eq!((get32(&v, 0), get32(&v, 4)), (0, 16));
    let mut meta = [0u8; 64];
    d.get_info(1, &mut meta).unwrap();
    assert_eq!(u16::from_le_bytes([meta[4], meta[5]]), 8, "columns");
    assert_eq!(u16::from_le_bytes([meta[16], meta[17]]), 4, "core rows");
    let mut fw = [0u8; 16];
    d.get_info(8, &mut fw).unwrap();
    assert_eq!((get32(&fw, 0), get32(&fw, 12)), (1, 380));

    let s = Setup::new(&d, 4096);
    assert_eq!(
        s.a_addr, s.a_map.ptr as u64,
        "SHARE xdna_addr is the first mapping's VA (PASID mode)"
    );
    assert_eq!(s.instr_addr % (32 << 10), 0, "DEV BOs are 32 KiB-aligned");
    let xs: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    put_f32s(s.a_map.bytes(), &xs);

    // copy a -> b
    assert_eq!(s.run(&d, &shim_image(1, 0.0)).unwrap(), 4, "COMPLETED");
    assert_eq!(f32s(s.b_map.bytes(), 1024), xs);

    // axpy: b = 2.5 a + b  (b == a now) => 3.5 a
    assert_eq!(s.run(&d, &shim_image(2, 2.5)).unwrap(), 4, "COMPLETED");
    let want: Vec<f32> = xs.iter().map(|x| 3.5 * x).collect();
    assert_eq!(f32s(s.b_map.bytes(), 1024), want);

    // seq counts from 0 per context: the next submission is seq 2; point 3 was never submitted.
    assert_eq!(d.wait(s.syncobj, 3), Err(libc::ETIME));
    // The legacy 40-byte TIMELINE_WAIT (no deadline_nsec) works too: DRM copies min(user, kernel).
    let (handles, points) = ([s.syncobj], [1u64]);
    let mut w = [0u8; 40];
    put64(&mut w, 0, handles.as_ptr() as u64);
    put64(&mut w, 8, points.as_ptr() as u64);
    put64(&mut w, 16, i64::MAX as u64);
    put32(&mut w, 24, 1);
    put32(&mut w, 28, 2);
    d.ioctl(0xC028_64CA, &mut w)
        .expect("legacy-size SYNCOBJ_TIMELINE_WAIT");
    s.teardown(&d);
    drop(d);
    println!("child ok");
}

#[test]
fn round_trip_moves_data_and_leaks_nothing() {
    let r = run_child("child_round_trip", &[]);
    r.assert_ok_no_leaks();
    assert_eq!(r.stats.len(), 1);
    assert_eq!(r.stats[0]["execs"], 2);
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_injected_exec_fault() {
    if !is_child("child_injected_exec_fault") {
        return;
    }
    let want: u32 = std::env::var("WANT_STATE").unwrap().parse().unwrap();
    let d = Raw::open();
    let s = Setup::new(&d, 4096);
    put_f32s(s.a_map.bytes(), &[1.0; 1024]);
    let state = s.run(&d, &shim_image(1, 0.0)).unwrap();
    assert_eq!(state, want);
    // Error states trash the payload (upstream driver behaviour) and skip the work.
    assert!(
        s.cmd_map.bytes()[4..44].iter().all(|&b| b == 0xff),
        "payload overwritten with 0xFF"
    );
    assert_eq!(
        f32s(s.b_map.bytes(), 4),
        [0.0; 4],
        "the failed command did not run"
    );
    // The second command is not affected.
    assert_eq!(s.run(&d, &shim_image(1, 0.0)).unwrap(), 4);
    s.teardown(&d);
    println!("child ok");
}

#[test]
fn injected_exec_faults_end_in_their_state() {
    for (name, state) in [("ERROR", "5"), ("TIMEOUT", "8"), ("ABORT", "6")] {
        let r = run_child(
            "child_injected_exec_fault",
            &[
                ("XDNA_SHIM_FAIL_EXEC", &format!("1:{name}")),
                ("WANT_STATE", state),
            ],
        );
        r.assert_ok_no_leaks();
        assert!(
            r.stderr.contains(&format!("forced to {name}")),
            "log names the injected state\n{}",
            r.stderr
        );
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_ioctl_errno() {
    if !is_child("child_ioctl_errno") {
        return;
    }
    let d = Raw::open();
    let heap = d.create_bo(BO_DEV_HEAP, HEAP_SIZE).unwrap();
    let a = d.create_bo(BO_SHARE, 4096).unwrap();
    assert_eq!(
        d.create_bo(BO_SHARE, 4096),
        Err(libc::ENOMEM),
        "3rd CREATE_BO fails as injected"
    );
    let c = d.create_bo(BO_SHARE, 4096).unwrap();
    for h in [c, a, heap] {
        d.gem_close(h).unwrap();
    }
    println!("child ok");
}

#[test]
fn injected_ioctl_errno_is_returned_once() {
    let r = run_child(
        "child_ioctl_errno",
        &[("XDNA_SHIM_IOCTL_ERRNO", "CREATE_BO:ENOMEM@3")],
    );
    r.assert_ok_no_leaks();
    assert!(r.stderr.contains("CREATE_BO: ENOMEM"), "{}", r.stderr);
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_ordering() {
    if !is_child("child_ordering") {
        return;
    }
    let d = Raw::open();
    assert_eq!(d.create_ctx(16), Err(libc::ENOENT), "context before heap");
    assert_eq!(
        d.create_bo(BO_DEV, 4096),
        Err(libc::EINVAL),
        "DEV BO before heap"
    );
    let heap = d.create_bo(BO_DEV_HEAP, HEAP_SIZE).unwrap();
    assert_eq!(
        d.create_bo(BO_DEV, 4096),
        Err(libc::EAGAIN),
        "DEV BO before the heap is mapped"
    );
    assert_eq!(
        d.create_ctx(16),
        Err(libc::EINVAL),
        "context before the heap is mapped"
    );
    assert_eq!(
        d.create_bo(BO_DEV_HEAP, HEAP_SIZE),
        Err(libc::EBUSY),
        "second heap"
    );
    let m = d.map(heap, HEAP_SIZE as usize).unwrap();
    let dev = d.create_bo(BO_DEV, 4096).unwrap();
    assert_eq!(d.bo_info(dev).unwrap().0, !0, "DEV BOs have no map offset");
    assert_eq!(
        d.bo_info(dev).unwrap().1,
        m.ptr as u64 + (d.bo_info(dev).unwrap().2 - 0x0400_0000)
    );
    drop(m);
    assert_eq!(
        d.create_bo(BO_DEV, 4096),
        Err(libc::EAGAIN),
        "heap unmapped again"
    );
    d.gem_close(dev).unwrap();
    d.gem_close(heap).unwrap();
    println!("child ok");
}

#[test]
fn context_before_heap_is_enoent_with_advice() {
    let r = run_child("child_ordering", &[]);
    r.assert_ok_no_leaks();
    assert!(r.stderr.contains("CREATE_HWCTX: ENOENT"), "{}", r.stderr);
    assert!(
        r.stderr.contains(
            "create the 64 MiB DEV_HEAP BO and mmap it before creating a hardware context"
        ),
        "{}",
        r.stderr
    );
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_context_limit() {
    if !is_child("child_context_limit") {
        return;
    }
    let d = Raw::open();
    let heap = d.create_bo(BO_DEV_HEAP, HEAP_SIZE).unwrap();
    let _m = d.map(heap, HEAP_SIZE as usize).unwrap();
    let mut res = [0u8; 40];
    d.get_info(12, &mut res).unwrap();
    assert_eq!(get64(&res, 16), 3, "npu_task_max = context limit");
    let ctxs: Vec<(u32, u32)> = (0..3).map(|_| d.create_ctx(4).unwrap()).collect();
    assert_eq!(d.create_ctx(4), Err(libc::EBUSY), "limit + 1");
    assert_eq!(
        d.create_ctx(0),
        Err(libc::EINVAL),
        "num_tiles / core_rows = 0 columns"
    );
    assert_eq!(
        d.create_ctx(4 * 9),
        Err(libc::EINVAL),
        "9 columns on an 8-column device"
    );
    // The array query sees them.
    let mut arr = vec![0u8; 160 * 8];
    let mut g = [0u8; 24];
    put32(&mut g, 4, 160);
    put32(&mut g, 8, 8);
    put64(&mut g, 16, arr.as_mut_ptr() as u64);
    d.ioctl(GET_ARRAY, &mut g).unwrap();
    assert_eq!(get32(&g, 8), 3);
    let (c0, s0) = ctxs[0];
    d.destroy_ctx(c0).unwrap();
    d.syncobj_destroy(s0).unwrap();
    let again = d.create_ctx(4).unwrap();
    for (c, s) in ctxs[1..].iter().copied().chain([again]) {
        d.syncobj_destroy(s).unwrap();
        d.destroy_ctx(c).unwrap();
    }
    assert_eq!(d.destroy_ctx(again.0), Err(libc::EINVAL), "double destroy");
    d.gem_close(heap).unwrap();
    println!("child ok");
}

#[test]
fn context_limit_plus_one_is_ebusy() {
    run_child("child_context_limit", &[("XDNA_SHIM_CONTEXT_LIMIT", "3")]).assert_ok_no_leaks();
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_mbz() {
    if !is_child("child_mbz") {
        return;
    }
    let d = Raw::open();
    let heap = d.create_bo(BO_DEV_HEAP, HEAP_SIZE).unwrap();
    let _m = d.map(heap, HEAP_SIZE as usize).unwrap();
    // CREATE_HWCTX.ext
    let qos = [0u8; 32];
    let mut b = [0u8; 56];
    put64(&mut b, 0, 1);
    put64(&mut b, 16, qos.as_ptr() as u64);
    put32(&mut b, 36, 4);
    assert_eq!(d.ioctl(CREATE_HWCTX, &mut b), Err(libc::EINVAL));
    // CREATE_HWCTX with an unreadable QoS pointer
    let mut b = [0u8; 56];
    put64(&mut b, 16, 8);
    put32(&mut b, 36, 4);
    assert_eq!(d.ioctl(CREATE_HWCTX, &mut b), Err(libc::EFAULT));
    // GET_BO_INFO.pad
    let mut b = [0u8; 48];
    put32(&mut b, 16, heap);
    put32(&mut b, 20, 1);
    assert_eq!(d.ioctl(GET_BO_INFO, &mut b), Err(libc::EINVAL));
    // CREATE_BO.flags
    let mut b = [0u8; 32];
    put64(&mut b, 0, 1);
    put64(&mut b, 16, 4096);
    put32(&mut b, 24, BO_SHARE);
    assert_eq!(d.ioctl(CREATE_BO, &mut b), Err(libc::EINVAL));
    // GEM_CLOSE.pad, unknown handles
    let mut b = [0u8; 8];
    put32(&mut b, 0, heap);
    put32(&mut b, 4, 1);
    assert_eq!(d.ioctl(GEM_CLOSE, &mut b), Err(libc::EINVAL));
    assert_eq!(d.gem_close(999), Err(libc::EINVAL));
    assert_eq!(d.syncobj_destroy(999), Err(libc::EINVAL));
    // A bad argument pointer is EFAULT, not a crash.
    // SAFETY: deliberately passing an invalid pointer; the shim must return EFAULT.
    let r = unsafe { libc::ioctl(d.fd, CREATE_BO as libc::c_ulong, 16usize as *mut u8) };
    assert_eq!(
        (r, std::io::Error::last_os_error().raw_os_error()),
        (-1, Some(libc::EFAULT))
    );
    // Invalid BO type
    assert_eq!(d.create_bo(7, 4096), Err(libc::EINVAL));
    // CONFIG_CU: non-DEV BO, then write-once
    let (ctx, so) = d.create_ctx(4).unwrap();
    let share = d.create_bo(BO_SHARE, 4096).unwrap();
    assert_eq!(d.config_cu(ctx, share), Err(libc::EINVAL));
    let pdi = d.create_bo(BO_DEV, 4096).unwrap();
    d.config_cu(ctx, pdi).unwrap();
    assert_eq!(
        d.config_cu(ctx, pdi),
        Err(libc::EINVAL),
        "CONFIG_CU is write-once"
    );
    // EXEC: unknown arg BO, duplicate arg BO
    let cmd = d.create_bo(BO_CMD, 4096).unwrap();
    assert_eq!(d.exec(ctx, cmd, &[share, 999]), Err(libc::ENOENT));
    assert_eq!(d.exec(ctx, cmd, &[share, share]), Err(libc::EINVAL));
    assert_eq!(d.exec(ctx, share + 100, &[share]), Err(libc::ENOENT));
    d.syncobj_destroy(so).unwrap();
    d.destroy_ctx(ctx).unwrap();
    for h in [cmd, pdi, share, heap] {
        d.gem_close(h).unwrap();
    }
    println!("child ok");
}

#[test]
fn mbz_and_invalid_arguments_are_rejected() {
    let r = run_child("child_mbz", &[]);
    r.assert_ok_no_leaks();
    assert!(r.stderr.contains("Invalid BO type"), "{}", r.stderr);
    assert!(
        r.stderr.contains("Not support re-config CU"),
        "{}",
        r.stderr
    );
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_guard_overrun() {
    if !is_child("child_guard_overrun") {
        return;
    }
    let d = Raw::open();
    // Data BOs of 100 bytes: their guard words share the mapped page.
    let s = Setup::new(&d, 100);
    assert_eq!(s.run(&d, &shim_image(1, 0.0)).unwrap(), 4);
    // SAFETY: the 100-byte mapping covers its whole page; byte 100 is the first guard byte.
    unsafe { *s.b_map.ptr.add(100) = 0x55 }; // one byte past the end of b
    assert_eq!(
        s.run(&d, &shim_image(1, 0.0)).unwrap(),
        5,
        "ERROR after a guard is clobbered"
    );
    // Reported once; guard restored.
    assert_eq!(s.run(&d, &shim_image(1, 0.0)).unwrap(), 4);
    // DEV BO overrun through the heap mapping (writing 4 KiB + 8 into a 4 KiB DEV BO).
    let instr = s.dev_bytes(&d, s.instr);
    instr[4096..4104].copy_from_slice(&[0xAA; 8]);
    assert_eq!(s.run(&d, &shim_image(1, 0.0)).unwrap(), 5);
    println!("b={} instr={}", s.b, s.instr);
    s.teardown(&d);
    println!("child ok");
}

#[test]
fn guard_word_overrun_is_detected_and_named() {
    let r = run_child("child_guard_overrun", &[]);
    r.assert_ok_no_leaks();
    let at = r.stdout.find("b=").expect("handles line");
    let line = r.stdout[at + 2..].lines().next().unwrap();
    let (b, instr) = line.split_once(" instr=").unwrap();
    assert!(
        r.stderr.contains(&format!(
            "guard words after BO {b} (SHARE, 100 bytes) clobbered at byte 100"
        )),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains(&format!("guard words after BO {instr} (DEV, 4096 bytes)")),
        "{}",
        r.stderr
    );
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_dmabuf() {
    if !is_child("child_dmabuf") {
        return;
    }
    let d = Raw::open();
    let s = Setup::new(&d, 4096);
    // A sealed memfd → /dev/udmabuf → PRIME import → used as the copy source.
    // SAFETY: plain libc calls on fds this test owns; results checked.
    let (memfd, dmabuf) = unsafe {
        let memfd = libc::memfd_create(c"weights".as_ptr(), libc::MFD_ALLOW_SEALING);
        assert!(memfd >= 0);
        assert_eq!(libc::ftruncate(memfd, 8192), 0);
        let p = libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            memfd,
            0,
        ) as *mut u8;
        for i in 0..8192 {
            *p.add(i) = (i % 251) as u8;
        }
        libc::munmap(p.cast(), 8192);
        let u = libc::open(c"/dev/udmabuf".as_ptr(), libc::O_RDWR);
        assert!(u >= 0);
        let mut c = [0u8; 24];
        put32(&mut c, 0, memfd as u32);
        put64(&mut c, 8, 4096);
        put64(&mut c, 16, 4096);
        assert_eq!(
            libc::ioctl(u, UDMABUF_CREATE as libc::c_ulong, c.as_mut_ptr()),
            -1,
            "unsealed memfd refused"
        );
        assert_eq!(
            libc::fcntl(memfd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK),
            0
        );
        let dmabuf = libc::ioctl(u, UDMABUF_CREATE as libc::c_ulong, c.as_mut_ptr());
        assert!(dmabuf >= 0, "udmabuf create");
        // UDMABUF_CREATE_LIST: two contiguous ranges of the memfd make one 8 KiB dma-buf ...
        let mut l = [0u8; 8 + 48];
        put32(&mut l, 0, 1);
        put32(&mut l, 4, 2);
        for (i, off) in [0u64, 4096].into_iter().enumerate() {
            put32(&mut l, 8 + 24 * i, memfd as u32);
            put64(&mut l, 8 + 24 * i + 8, off);
            put64(&mut l, 8 + 24 * i + 16, 4096);
        }
        let lfd = libc::ioctl(u, 0x4008_7543 as libc::c_ulong, l.as_mut_ptr());
        assert!(lfd >= 0, "udmabuf create list");
        let w = libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ,
            libc::MAP_SHARED,
            lfd,
            0,
        );
        assert_ne!(w, libc::MAP_FAILED);
        assert_eq!(*(w as *const u8).add(4097), (4097 % 251) as u8);
        libc::munmap(w, 8192);
        libc::close(lfd);
        // ... a gap between the ranges is beyond what the shim emulates.
        put64(&mut l, 8 + 24 + 8, 0);
        assert_eq!(
            libc::ioctl(u, 0x4008_7543 as libc::c_ulong, l.as_mut_ptr()),
            -1
        );
        libc::close(u);
        (memfd, dmabuf)
    };
    // The dma-buf maps its window (offset 4096 of the memfd).
    // SAFETY: mapping the dma-buf fd; checked, unmapped right after.
    unsafe {
        let w = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_SHARED,
            dmabuf,
            0,
        );
        assert_ne!(w, libc::MAP_FAILED);
        assert_eq!(*(w as *const u8).add(1), (4097 % 251) as u8);
        libc::munmap(w, 4096);
    }
    let mut p = [0u8; 12];
    put32(&mut p, 8, dmabuf as u32);
    d.ioctl(PRIME_FD_TO_HANDLE, &mut p).unwrap();
    let imported = get32(&p, 0);
    let m = d.map(imported, 4096).unwrap();
    let addr = d.bo_info(imported).unwrap().2;
    assert_eq!(m.bytes()[0], (4096 % 251) as u8, "window at offset 4096");
    s.dev_bytes(&d, s.instr)[..16].copy_from_slice(&shim_image(1, 0.0));
    write_start_cu(s.cmd_map.bytes(), s.instr_addr, 4, &[addr, s.b_addr]);
    let seq = d.exec(s.ctx, s.cmd, &[s.instr, imported, s.b]).unwrap();
    d.wait(s.syncobj, seq).unwrap();
    assert_eq!(cmd_state(s.cmd_map.bytes()), 4);
    assert_eq!(&s.b_map.bytes()[..4096], &m.bytes()[..4096]);
    // Export a SHARE BO and map the dma-buf.
    let mut e = [0u8; 12];
    put32(&mut e, 0, s.b);
    put32(&mut e, 4, (libc::O_CLOEXEC | libc::O_RDWR) as u32);
    d.ioctl(PRIME_HANDLE_TO_FD, &mut e).unwrap();
    let efd = get32(&e, 8) as i32;
    // SAFETY: mapping the exported dma-buf fd; checked.
    let q = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_SHARED,
            efd,
            0,
        )
    } as *const u8;
    assert_ne!(q as *mut libc::c_void, libc::MAP_FAILED);
    // SAFETY: q maps 4096 readable bytes (checked against MAP_FAILED above), unmapped only below.
    let mapped = unsafe { std::slice::from_raw_parts(q, 4096) };
    assert_eq!(mapped, &s.b_map.bytes()[..4096]);
    // SAFETY: cleanup of this test's mapping and fds.
    unsafe {
        libc::munmap(q as *mut libc::c_void, 4096);
        libc::close(efd);
        libc::close(dmabuf);
        libc::close(memfd);
    }
    drop(m);
    d.gem_close(imported).unwrap();
    s.teardown(&d);
    println!("child ok");
}

#[test]
fn udmabuf_prime_import_and_export() {
    run_child("child_dmabuf", &[]).assert_ok_no_leaks();
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_leak_is_reported() {
    if !is_child("child_leak_is_reported") {
        return;
    }
    let d = Raw::open();
    let s = Setup::new(&d, 4096);
    std::mem::forget(s); // never torn down: closing the fd must release (and count) it all
    println!("child ok");
}

#[test]
fn close_releases_and_counts_leftovers() {
    let r = run_child("child_leak_is_reported", &[]);
    assert!(r.ok, "{}", r.stderr);
    assert_eq!(r.stats.len(), 1, "{}", r.stderr);
    assert_eq!(r.stats[0]["bos"], 6);
    assert_eq!(r.stats[0]["contexts"], 1);
    assert_eq!(r.stats[0]["syncobjs"], 1);
    assert!(
        r.stderr
            .contains("releasing 6 BOs, 1 contexts, 1 syncobjs still alive"),
        "{}",
        r.stderr
    );
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_npu_opcodes_and_chains() {
    if !is_child("child_npu_opcodes_and_chains") {
        return;
    }
    let d = Raw::open();
    let s = Setup::new(&d, 4096);
    put_f32s(s.a_map.bytes(), &[7.0; 1024]);
    let instr = s.dev_bytes(&d, s.instr);
    instr[..16].copy_from_slice(&shim_image(1, 0.0));
    instr[0x800..0x810].copy_from_slice(&shim_image(1, 0.0));
    let npu = |cmd: &mut [u8], op: u32, instr_addr: u64| {
        // header, cu_mask, ert_npu_data {instr u64, size u32, prop_count u32}, args a, b
        put32(cmd, 0, 1 | (9 << 12) | (op << 23));
        put32(cmd, 4, 1);
        put64(cmd, 8, instr_addr);
        put32(cmd, 16, 16);
        put32(cmd, 20, 0);
        put64(cmd, 24, s.a_addr);
        put64(cmd, 32, s.b_addr);
    };
    let submit = || {
        let seq = d.exec(s.ctx, s.cmd, &[s.instr, s.a, s.b]).unwrap();
        d.wait(s.syncobj, seq).unwrap();
        cmd_state(s.cmd_map.bytes())
    };
    npu(s.cmd_map.bytes(), 20, s.instr_addr);
    assert_eq!(submit(), 4, "ERT_START_NPU runs");
    assert_eq!(f32s(s.b_map.bytes(), 2), [7.0, 7.0]);
    npu(s.cmd_map.bytes(), 20, s.instr_addr + 0x800);
    assert_eq!(
        submit(),
        8,
        "instruction buffer not 16 KiB-aligned: TIMEOUT"
    );
    // opcode 22 with a malformed ELF image (16 bytes, no section table) → ERROR
    s.dev_bytes(&d, s.instr)[..4].copy_from_slice(b"\x7fELF");
    let cmd = s.cmd_map.bytes();
    cmd[..48].fill(0);
    put32(cmd, 0, 1 | (11 << 12) | (22 << 23));
    put32(cmd, 4, 1);
    put64(cmd, 8, s.instr_addr);
    put32(cmd, 32, 16);
    assert_eq!(submit(), 5);
    // A chain of one START_CU sub-command.
    s.dev_bytes(&d, s.instr)[..16].copy_from_slice(&shim_image(2, 1.0));
    let sub = d.create_bo(BO_CMD, 4096).unwrap();
    let sub_map = d.map(sub, 4096).unwrap();
    write_start_cu(sub_map.bytes(), s.instr_addr, 4, &[s.a_addr, s.b_addr]);
    let cmd = s.cmd_map.bytes();
    cmd[..64].fill(0);
    put32(cmd, 0, 1 | (8 << 12) | (19 << 23));
    put32(cmd, 4, 1); // command_count
    put64(cmd, 4 + 24, sub as u64);
    assert_eq!(submit(), 4, "chain completes");
    assert_eq!(cmd_state(sub_map.bytes()), 4, "sub-command state written");
    assert_eq!(f32s(s.b_map.bytes(), 2), [14.0, 14.0]);
    // An unknown opcode aborts.
    put32(s.cmd_map.bytes(), 0, 1 | (2 << 12) | (5 << 23));
    assert_eq!(submit(), 6);
    drop(sub_map);
    d.gem_close(sub).unwrap();
    s.teardown(&d);
    println!("child ok");
}

#[test]
fn npu_opcodes_alignment_and_chains() {
    let r = run_child("child_npu_opcodes_and_chains", &[]);
    r.assert_ok_no_leaks();
    assert!(r.stderr.contains("not 16 KiB-aligned"), "{}", r.stderr);
    assert!(
        r.stderr.contains("kernel ELF image: truncated"),
        "{}",
        r.stderr
    );
}

// ---------------------------------------------------------------------------------------------

const SYNCOBJ_EVENTFD: u64 = 0xC018_64CF;

#[test]
fn child_syncobj_eventfd() {
    if !is_child("child_syncobj_eventfd") {
        return;
    }
    let d = Raw::open();
    let s = Setup::new(&d, 4096);
    // SAFETY: eventfd creation; checked.
    let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    assert!(efd >= 0);
    let mut e = [0u8; 24];
    put32(&mut e, 0, s.syncobj);
    put64(&mut e, 8, 0); // point 0 = the first submission's seq
    put32(&mut e, 16, efd as u32);
    d.ioctl(SYNCOBJ_EVENTFD, &mut e).unwrap();
    let read = || {
        let mut v = 0u64;
        // SAFETY: 8-byte read from the eventfd into a live u64.
        let n = unsafe { libc::read(efd, (&mut v as *mut u64).cast(), 8) };
        (n == 8).then_some(v)
    };
    assert_eq!(read(), None, "not signalled before the submission");
    assert_eq!(s.run(&d, &shim_image(1, 0.0)).unwrap(), 4);
    assert_eq!(read(), Some(1), "signalled by the submission of point 0");
    // Already-signalled points fire at once; unknown handles are ENOENT.
    d.ioctl(SYNCOBJ_EVENTFD, &mut e).unwrap();
    assert_eq!(read(), Some(1));
    put32(&mut e, 0, 999);
    assert_eq!(d.ioctl(SYNCOBJ_EVENTFD, &mut e), Err(libc::ENOENT));
    // A registration still pending at teardown is released with the syncobj.
    put32(&mut e, 0, s.syncobj);
    put64(&mut e, 8, 10);
    d.ioctl(SYNCOBJ_EVENTFD, &mut e).unwrap();
    // SAFETY: closing our eventfd.
    unsafe { libc::close(efd) };
    s.teardown(&d);
    println!("child ok");
}

#[test]
fn syncobj_eventfd_fires_on_signal() {
    run_child("child_syncobj_eventfd", &[]).assert_ok_no_leaks();
}

// ---------------------------------------------------------------------------------------------

const WAIT_CMD_OOT: u64 = 0xC010_6449;
const WAIT_CMD_UPSTREAM: u64 = 0x4010_6449;

#[test]
fn child_driver_versions() {
    if !is_child("child_driver_versions") {
        return;
    }
    let version = std::env::var("XDNA_SHIM_DRIVER_VERSION").unwrap();
    let d = Raw::open();
    let mut v = [0u8; 64];
    d.ioctl(DRM_VERSION, &mut v).unwrap();
    let s = Setup::new(&d, 4096);
    assert_eq!(s.run(&d, &shim_image(1, 0.0)).unwrap(), 4);
    let mut res = [0u8; 40];
    let mut arr = vec![0u8; 160];
    let mut g = [0u8; 24];
    put32(&mut g, 4, 160);
    put32(&mut g, 8, 1);
    put64(&mut g, 16, arr.as_mut_ptr() as u64);
    let wait = |req: u64, seq: u64| {
        let mut w = [0u8; 16];
        put32(&mut w, 0, s.ctx);
        put64(&mut w, 8, seq);
        d.ioctl(req, &mut w)
    };
    match version.as_str() {
        "0.0" => {
            assert_eq!((get32(&v, 0), get32(&v, 4)), (0, 0));
            assert_eq!(
                d.ioctl(GET_ARRAY, &mut g),
                Err(libc::EINVAL),
                "no GET_ARRAY before 0.1"
            );
            assert_eq!(
                d.get_info(12, &mut res),
                Err(libc::EOPNOTSUPP),
                "no RESOURCE_INFO before 0.4"
            );
            assert_eq!(wait(WAIT_CMD_UPSTREAM, 0), Err(libc::EINVAL), "no WAIT_CMD");
            // The legacy context list instead of GET_ARRAY.
            let mut list = vec![0u8; 64 * 4];
            let mut q = [0u8; 16];
            put32(&mut q, 0, 5);
            put32(&mut q, 4, list.len() as u32);
            put64(&mut q, 8, list.as_mut_ptr() as u64);
            d.ioctl(GET_INFO, &mut q).unwrap();
            assert_eq!(get32(&q, 4), 64, "one context filled");
            assert_eq!(get32(&list, 0), s.ctx);
            assert_eq!(get64(&list, 24), 1, "one submission");
        }
        "0.16" => {
            d.ioctl(GET_ARRAY, &mut g).unwrap();
            d.get_info(12, &mut res).unwrap();
            assert_eq!(
                wait(WAIT_CMD_UPSTREAM, 0),
                Err(libc::EOPNOTSUPP),
                "AIE2 has no WAIT_CMD upstream"
            );
        }
        "1.0" => {
            assert_eq!((get32(&v, 0), get32(&v, 4)), (1, 0));
            d.ioctl(GET_ARRAY, &mut g).unwrap();
            assert_eq!(
                wait(WAIT_CMD_OOT, 0),
                Ok(()),
                "OOT WAIT_CMD on a submitted seq"
            );
            assert_eq!(wait(WAIT_CMD_OOT, 1), Err(libc::ETIME), "never submitted");
        }
        other => panic!("unexpected version {other}"),
    }
    s.teardown(&d);
    println!("child ok");
}

#[test]
fn driver_versions_gate_features() {
    for v in ["0.0", "0.16", "1.0"] {
        run_child("child_driver_versions", &[("XDNA_SHIM_DRIVER_VERSION", v)]).assert_ok_no_leaks();
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_dup_shares_the_drm_file() {
    if !is_child("child_dup_shares_the_drm_file") {
        return;
    }
    let d = Raw::open();
    let heap = d.create_bo(BO_DEV_HEAP, HEAP_SIZE).unwrap();
    // SAFETY: dup/fcntl of our own fd; checked.
    let (d2, d3) = unsafe {
        (
            libc::dup(d.fd),
            libc::fcntl(d.fd, libc::F_DUPFD_CLOEXEC, 100),
        )
    };
    assert!(d2 >= 0 && d3 >= 100);
    let a = Raw { fd: d2 };
    let b = Raw { fd: d3 };
    // Same DRM file: a handle made through one fd is visible through the others.
    assert_eq!(a.bo_info(heap).unwrap().2, 0x0400_0000);
    let m = b.map(heap, HEAP_SIZE as usize).unwrap();
    drop(d); // the original fd closes: the file lives on through its dups
    let dev = a
        .create_bo(BO_DEV, 4096)
        .expect("heap is mapped (through the dup)");
    drop(m);
    for h in [dev, heap] {
        b.gem_close(h).unwrap();
    }
    drop(a);
    drop(b);
    println!("child ok");
}

#[test]
fn dup_of_the_device_fd_shares_the_drm_file() {
    let r = run_child("child_dup_shares_the_drm_file", &[]);
    r.assert_ok_no_leaks();
    assert_eq!(r.stats.len(), 1, "released once, when the last fd closed");
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_munmap_invalidates_the_device_address() {
    if !is_child("child_munmap_invalidates_the_device_address") {
        return;
    }
    let d = Raw::open();
    let mut s = Setup::new(&d, 4096);
    let stale = s.b_addr;
    // Unmap b: its device address goes away with the mapping (the driver's MMU notifier).
    let b_map = std::mem::replace(&mut s.b_map, d.map(s.a, 4096).unwrap());
    drop(b_map);
    assert_eq!(
        d.bo_info(s.b).unwrap().2,
        !0,
        "no device address without a mapping"
    );
    assert_eq!(
        s.run(&d, &shim_image(1, 0.0)).unwrap(),
        5,
        "stale address: ERROR"
    );
    // Map it again: a new address, and commands work with it.
    s.b_map = d.map(s.b, 4096).unwrap();
    s.b_addr = d.bo_info(s.b).unwrap().2;
    assert_eq!(s.b_addr, s.b_map.ptr as u64);
    put_f32s(s.a_map.bytes(), &[3.0; 4]);
    assert_eq!(s.run(&d, &shim_image(1, 0.0)).unwrap(), 4);
    assert_eq!(f32s(s.b_map.bytes(), 4), [3.0; 4]);
    println!("stale={stale:#x}");
    s.teardown(&d);
    println!("child ok");
}

#[test]
fn munmap_invalidates_the_device_address() {
    let r = run_child("child_munmap_invalidates_the_device_address", &[]);
    r.assert_ok_no_leaks();
    let at = r.stdout.find("stale=").expect("stale line") + "stale=".len();
    let stale: String = r.stdout[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    assert!(
        r.stderr.contains(&format!(
            "buffer address {stale} (regmap +0x1c) is not inside any argument BO"
        )),
        "{}",
        r.stderr
    );
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_aliasing_buffers() {
    if !is_child("child_aliasing_buffers") {
        return;
    }
    let d = Raw::open();
    let s = Setup::new(&d, 4096);
    let a = s.a_map.bytes();
    for (i, x) in a.iter_mut().enumerate() {
        *x = (i % 256) as u8;
    }
    // Both buffers inside BO a: copy a[0..2048] → a[2048..4096] (buffer 1 is the shorter).
    s.dev_bytes(&d, s.instr)[..16].copy_from_slice(&shim_image(1, 0.0));
    write_start_cu(
        s.cmd_map.bytes(),
        s.instr_addr,
        4,
        &[s.a_addr, s.a_addr + 2048],
    );
    let seq = d.exec(s.ctx, s.cmd, &[s.instr, s.a]).unwrap();
    d.wait(s.syncobj, seq).unwrap();
    assert_eq!(cmd_state(s.cmd_map.bytes()), 4);
    let a = s.a_map.bytes();
    assert!((0..2048).all(|i| a[i] == (i % 256) as u8), "source intact");
    assert!((0..2048).all(|i| a[2048 + i] == (i % 256) as u8), "copied");
    s.teardown(&d);
    println!("child ok");
}

#[test]
fn aliasing_buffers_run_on_copies() {
    run_child("child_aliasing_buffers", &[]).assert_ok_no_leaks();
}

// ---------------------------------------------------------------------------------------------

#[test]
fn child_user_pointer_bo() {
    if !is_child("child_user_pointer_bo") {
        return;
    }
    let d = Raw::open();
    let s = Setup::new(&d, 8192);
    // Two page-sized, contiguous entries of an anonymous mapping.
    // SAFETY: anonymous mapping owned by this test; checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    } as *mut u8;
    assert_ne!(p as *mut libc::c_void, libc::MAP_FAILED);
    // SAFETY: p maps 8192 writable bytes.
    let user = unsafe { std::slice::from_raw_parts_mut(p, 8192) };
    put_f32s(user, &[1.5; 2048]);
    let mut tbl = [0u8; 8 + 32];
    put32(&mut tbl, 0, u32::MAX); // dmabuf_fd -1
    put32(&mut tbl, 4, 2);
    put64(&mut tbl, 8, p as u64);
    put64(&mut tbl, 16, 4096);
    put64(&mut tbl, 24, p as u64 + 4096);
    put64(&mut tbl, 32, 4096);
    let mut c = [0u8; 32];
    put64(&mut c, 8, tbl.as_ptr() as u64);
    put32(&mut c, 24, BO_SHARE);
    d.ioctl(CREATE_BO, &mut c).expect("user-pointer BO");
    let u = get32(&c, 28);
    let (off, _, addr) = d.bo_info(u).unwrap();
    assert_eq!(
        (off, addr),
        (!0, p as u64),
        "no map offset; device address = the VA"
    );
    assert_eq!(
        d.map(u, 4096).err(),
        Some(libc::EINVAL),
        "not mmap-able through the device"
    );
    // axpy: b = 2·user + b, then user = copy of b (the device writes client memory).
    s.dev_bytes(&d, s.instr)[..16].copy_from_slice(&shim_image(2, 2.0));
    write_start_cu(s.cmd_map.bytes(), s.instr_addr, 4, &[addr, s.b_addr]);
    let seq = d.exec(s.ctx, s.cmd, &[s.instr, u, s.b]).unwrap();
    d.wait(s.syncobj, seq).unwrap();
    assert_eq!(cmd_state(s.cmd_map.bytes()), 4);
    assert_eq!(f32s(s.b_map.bytes(), 2048), vec![3.0; 2048]);
    s.dev_bytes(&d, s.instr)[..16].copy_from_slice(&shim_image(1, 0.0));
    write_start_cu(s.cmd_map.bytes(), s.instr_addr, 4, &[s.b_addr, addr]);
    let seq = d.exec(s.ctx, s.cmd, &[s.instr, u, s.b]).unwrap();
    d.wait(s.syncobj, seq).unwrap();
    assert_eq!(cmd_state(s.cmd_map.bytes()), 4);
    assert_eq!(f32s(user, 2048), vec![3.0; 2048]);
    // Non-contiguous entries are refused.
    put64(&mut tbl, 24, p as u64 + 8192);
    let mut c = [0u8; 32];
    put64(&mut c, 8, tbl.as_ptr() as u64);
    put32(&mut c, 24, BO_SHARE);
    assert_eq!(d.ioctl(CREATE_BO, &mut c), Err(libc::EINVAL));
    // Unmapped client memory: the command fails, the shim does not crash.
    // SAFETY: unmapping our own mapping (the BO now points at nothing).
    unsafe { libc::munmap(p.cast(), 8192) };
    let seq = d.exec(s.ctx, s.cmd, &[s.instr, u, s.b]).unwrap();
    d.wait(s.syncobj, seq).unwrap();
    assert_eq!(cmd_state(s.cmd_map.bytes()), 5);
    d.gem_close(u).unwrap();
    s.teardown(&d);
    println!("child ok");
}

#[test]
fn user_pointer_bos_use_client_memory() {
    let r = run_child("child_user_pointer_bo", &[]);
    r.assert_ok_no_leaks();
    assert!(
        r.stderr.contains("its memory is no longer mapped"),
        "{}",
        r.stderr
    );
}
