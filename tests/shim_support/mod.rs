//! Test support for the shim tests: locating `libxdna_shim.so`, re-executing the test binary as
//! a child under `LD_PRELOAD`, and a minimal raw-ioctl amdxdna client (byte offsets from
//! docs/protocol.md §2) used by the child bodies.

#![allow(dead_code)]

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long a child may run before it is killed and the test fails.
const CHILD_TIMEOUT: Duration = Duration::from_secs(120);

/// Env var naming the child body to run (the parent sets it; child tests return early without it).
pub const CHILD_ENV: &str = "XDNA_SHIM_TEST_CHILD";

/// True when this process is the child for `name`.
pub fn is_child(name: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|v| v == name)
}

/// `target/<profile>/libxdna_shim.so`, next to the directory holding this test binary.
pub fn shim_path() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binary lives in target/<profile>/deps");
    let so = profile_dir.join("libxdna_shim.so");
    assert!(
        so.exists(),
        "{} is missing: build it with `cargo build --workspace` (the shim is a cdylib that `cargo test` does not build for this package)",
        so.display()
    );
    if let Some(src) = newest_shim_source() {
        let built = std::fs::metadata(&so).and_then(|m| m.modified()).ok();
        let changed = std::fs::metadata(&src).and_then(|m| m.modified()).ok();
        if let (Some(built), Some(changed)) = (built, changed) {
            assert!(
                changed <= built,
                "{} is older than {}: rebuild it with `cargo build --workspace`",
                so.display(),
                src.display()
            );
        }
    }
    so
}

/// The most recently modified source file of tools/xdna-shim (None outside a source checkout).
fn newest_shim_source() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/xdna-shim/src");
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
}

/// `target/<profile>/<bin>`.
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>")
        .join(name)
}

pub struct ChildRun {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
    /// One JSON object per close of the device fd (`XDNA_SHIM_STATS`).
    pub stats: Vec<serde_json::Value>,
}

impl ChildRun {
    /// Panics (with the child's output) unless the child succeeded and every device-fd close saw
    /// zero live BOs, contexts and syncobjs.
    pub fn assert_ok_no_leaks(&self) {
        assert!(
            self.ok,
            "child failed\n--- stdout\n{}\n--- stderr\n{}",
            self.stdout, self.stderr
        );
        assert!(
            !self.stats.is_empty(),
            "no stats line: the child never closed the device\n{}",
            self.stderr
        );
        for s in &self.stats {
            for k in ["bos", "contexts", "syncobjs"] {
                assert_eq!(
                    s[k], 0,
                    "leaked {k} at close: {s}\n--- stderr\n{}",
                    self.stderr
                );
            }
        }
    }
}

/// Re-executes this test binary running only `name`, with the shim preloaded and `env` set.
pub fn run_child(name: &str, env: &[(&str, &str)]) -> ChildRun {
    let shim = shim_path();
    // Unique per run: several parent tests may run the same child body concurrently.
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stats = std::env::temp_dir().join(format!(
        "xdna-shim-stats-{}-{run}-{name}.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&stats);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, name)
        .env("LD_PRELOAD", &shim)
        .env("XDNA_SHIM_STATS", &stats)
        .env_remove("XDNA_SHIM_LOG")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut s);
            }
            s
        })
    };
    let out_t = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err_t = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    // A deadlock in the shim (e.g. its lock taken on the allocator's mmap path) must fail the
    // test, not hang it.
    let deadline = Instant::now() + CHILD_TIMEOUT;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait child") {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stdout = String::from_utf8_lossy(&out_t.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err_t.join().unwrap_or_default()).into_owned();
    let Some(status) = status else {
        panic!("child {name} did not finish within {CHILD_TIMEOUT:?} (deadlock?)\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    };
    let text = std::fs::read_to_string(&stats).unwrap_or_default();
    let _ = std::fs::remove_file(&stats);
    ChildRun {
        ok: status.success(),
        stdout,
        stderr,
        stats: text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect(),
    }
}

// -------------------------------------------------------------------------------------------------
// A raw amdxdna client (only used inside children).

pub const CREATE_HWCTX: u64 = 0xC038_6440;
pub const DESTROY_HWCTX: u64 = 0xC008_6441;
pub const CONFIG_HWCTX: u64 = 0xC018_6442;
pub const CREATE_BO: u64 = 0xC020_6443;
pub const GET_BO_INFO: u64 = 0xC030_6444;
pub const SYNC_BO: u64 = 0xC018_6445;
pub const EXEC_CMD: u64 = 0xC038_6446;
pub const GET_INFO: u64 = 0xC010_6447;
pub const GET_ARRAY: u64 = 0xC018_644A;
pub const DRM_VERSION: u64 = 0xC040_6400;
pub const GEM_CLOSE: u64 = 0x4008_6409;
pub const PRIME_HANDLE_TO_FD: u64 = 0xC00C_642D;
pub const PRIME_FD_TO_HANDLE: u64 = 0xC00C_642E;
pub const SYNCOBJ_DESTROY: u64 = 0xC008_64C0;
pub const SYNCOBJ_TIMELINE_WAIT: u64 = 0xC030_64CA;
pub const UDMABUF_CREATE: u64 = 0x4018_7542;

pub const BO_SHARE: u32 = 1;
pub const BO_DEV_HEAP: u32 = 2;
pub const BO_DEV: u32 = 3;
pub const BO_CMD: u32 = 4;
pub const HEAP_SIZE: u64 = 64 << 20;

pub fn put32(b: &mut [u8], o: usize, v: u32) {
    b[o..o + 4].copy_from_slice(&v.to_le_bytes());
}
pub fn put64(b: &mut [u8], o: usize, v: u64) {
    b[o..o + 8].copy_from_slice(&v.to_le_bytes());
}
pub fn get32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}
pub fn get64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

pub struct Raw {
    pub fd: i32,
}

pub struct Mapped {
    pub ptr: *mut u8,
    pub len: usize,
}

impl Mapped {
    /// The mapping's bytes. Shared device memory, like a `volatile` view: tests write through it
    /// while the shim (the "device") also reads and writes it.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes(&self) -> &mut [u8] {
        // SAFETY: a live MAP_SHARED mapping of `len` bytes owned by this test.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this value owns.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

impl Raw {
    pub fn open() -> Raw {
        // SAFETY: NUL-terminated literal path.
        let fd = unsafe {
            libc::open(
                c"/dev/accel/accel0".as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC,
            )
        };
        assert!(fd >= 0, "open /dev/accel/accel0: errno {}", errno());
        Raw { fd }
    }

    pub fn ioctl(&self, req: u64, b: &mut [u8]) -> Result<(), i32> {
        // SAFETY: `b` is a live buffer at least as large as the request's struct.
        let r = unsafe { libc::ioctl(self.fd, req as libc::c_ulong, b.as_mut_ptr()) };
        if r < 0 {
            Err(errno())
        } else {
            Ok(())
        }
    }

    pub fn create_bo(&self, ty: u32, size: u64) -> Result<u32, i32> {
        let mut b = [0u8; 32];
        put64(&mut b, 16, size);
        put32(&mut b, 24, ty);
        self.ioctl(CREATE_BO, &mut b)?;
        Ok(get32(&b, 28))
    }

    /// (map_offset, vaddr, xdna_addr)
    pub fn bo_info(&self, h: u32) -> Result<(u64, u64, u64), i32> {
        let mut b = [0u8; 48];
        put32(&mut b, 16, h);
        self.ioctl(GET_BO_INFO, &mut b)?;
        Ok((get64(&b, 24), get64(&b, 32), get64(&b, 40)))
    }

    pub fn map(&self, h: u32, len: usize) -> Result<Mapped, i32> {
        let (off, _, _) = self.bo_info(h)?;
        // SAFETY: mapping the device fd at the BO's map offset; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.fd,
                off as i64,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(errno());
        }
        Ok(Mapped { ptr: p.cast(), len })
    }

    pub fn gem_close(&self, h: u32) -> Result<(), i32> {
        let mut b = [0u8; 8];
        put32(&mut b, 0, h);
        self.ioctl(GEM_CLOSE, &mut b)
    }

    /// (context handle, syncobj handle)
    pub fn create_ctx(&self, num_tiles: u32) -> Result<(u32, u32), i32> {
        let mut qos = [0u8; 32];
        put32(&mut qos, 24, 0xff);
        let mut b = [0u8; 56];
        put64(&mut b, 16, qos.as_ptr() as u64);
        put32(&mut b, 36, num_tiles);
        self.ioctl(CREATE_HWCTX, &mut b)?;
        Ok((get32(&b, 48), get32(&b, 52)))
    }

    pub fn destroy_ctx(&self, h: u32) -> Result<(), i32> {
        let mut b = [0u8; 8];
        put32(&mut b, 0, h);
        self.ioctl(DESTROY_HWCTX, &mut b)
    }

    pub fn syncobj_destroy(&self, h: u32) -> Result<(), i32> {
        let mut b = [0u8; 8];
        put32(&mut b, 0, h);
        self.ioctl(SYNCOBJ_DESTROY, &mut b)
    }

    pub fn config_cu(&self, ctx: u32, cu_bo: u32) -> Result<(), i32> {
        let mut cfg = [0u8; 16];
        cfg[0] = 1;
        put32(&mut cfg, 8, cu_bo);
        let mut b = [0u8; 24];
        put32(&mut b, 0, ctx);
        put64(&mut b, 8, cfg.as_ptr() as u64);
        put32(&mut b, 16, 16);
        self.ioctl(CONFIG_HWCTX, &mut b)
    }

    pub fn exec(&self, ctx: u32, cmd: u32, args: &[u32]) -> Result<u64, i32> {
        let mut b = [0u8; 56];
        put32(&mut b, 16, ctx);
        put64(&mut b, 24, cmd as u64);
        put64(&mut b, 32, args.as_ptr() as u64);
        put32(&mut b, 40, 1);
        put32(&mut b, 44, args.len() as u32);
        self.ioctl(EXEC_CMD, &mut b)?;
        Ok(get64(&b, 48))
    }

    pub fn wait(&self, syncobj: u32, point: u64) -> Result<(), i32> {
        let handles = [syncobj];
        let points = [point];
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime into a live local.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let deadline = (ts.tv_sec as u64 + 5) * 1_000_000_000 + ts.tv_nsec as u64;
        let mut b = [0u8; 48];
        put64(&mut b, 0, handles.as_ptr() as u64);
        put64(&mut b, 8, points.as_ptr() as u64);
        put64(&mut b, 16, deadline);
        put32(&mut b, 24, 1);
        put32(&mut b, 28, 2); // WAIT_FOR_SUBMIT
        self.ioctl(SYNCOBJ_TIMELINE_WAIT, &mut b)
    }

    pub fn get_info(&self, param: u32, out: &mut [u8]) -> Result<(), i32> {
        let mut b = [0u8; 16];
        put32(&mut b, 0, param);
        put32(&mut b, 4, out.len() as u32);
        put64(&mut b, 8, out.as_mut_ptr() as u64);
        self.ioctl(GET_INFO, &mut b)
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: closing the fd this value owns.
        unsafe { libc::close(self.fd) };
    }
}

/// A `XDNASHIM` built-in test image: op 1 = copy, 2 = axpy f32.
pub fn shim_image(op: u32, alpha: f32) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..8].copy_from_slice(b"XDNASHIM");
    put32(&mut v, 8, op);
    v[12..16].copy_from_slice(&alpha.to_le_bytes());
    v
}

/// Writes an ERT_START_CU packet (cu_mask 1, regmap {3, instr, ninstr, bufs...}) into `cmd`.
pub fn write_start_cu(cmd: &mut [u8], instr: u64, ninstr_words: u32, bufs: &[u64]) {
    let regmap_words = (0x14 + 8 * bufs.len()) / 4;
    let count = 1 + regmap_words as u32;
    put32(cmd, 0, 1 | (count << 12) | (3 << 28));
    put32(cmd, 4, 1);
    let r = 8;
    put64(cmd, r, 3);
    put64(cmd, r + 8, instr);
    put32(cmd, r + 0x10, ninstr_words);
    for (i, &a) in bufs.iter().enumerate() {
        put64(cmd, r + 0x14 + 8 * i, a);
    }
}

/// The state bits of a command BO header.
pub fn cmd_state(cmd: &[u8]) -> u32 {
    get32(cmd, 0) & 0xf
}

/// Everything a round trip needs: heap, PDI and instruction DEV BOs, two data BOs, a CMD BO and a
/// configured context.
pub struct Setup {
    pub heap: u32,
    pub heap_map: Mapped,
    pub pdi: u32,
    pub instr: u32,
    pub instr_addr: u64,
    pub a: u32,
    pub b: u32,
    pub a_map: Mapped,
    pub b_map: Mapped,
    pub a_addr: u64,
    pub b_addr: u64,
    pub cmd: u32,
    pub cmd_map: Mapped,
    pub ctx: u32,
    pub syncobj: u32,
}

impl Setup {
    pub fn new(d: &Raw, data_size: u64) -> Setup {
        let heap = d.create_bo(BO_DEV_HEAP, HEAP_SIZE).expect("heap");
        let heap_map = d.map(heap, HEAP_SIZE as usize).expect("map heap");
        let pdi = d.create_bo(BO_DEV, 4096).expect("pdi");
        let instr = d.create_bo(BO_DEV, 4096).expect("instr");
        let (_, _, instr_addr) = d.bo_info(instr).unwrap();
        let a = d.create_bo(BO_SHARE, data_size).expect("a");
        let b = d.create_bo(BO_SHARE, data_size).expect("b");
        let a_map = d.map(a, data_size as usize).expect("map a");
        let b_map = d.map(b, data_size as usize).expect("map b");
        let a_addr = d.bo_info(a).unwrap().2;
        let b_addr = d.bo_info(b).unwrap().2;
        let cmd = d.create_bo(BO_CMD, 4096).expect("cmd");
        let cmd_map = d.map(cmd, 4096).expect("map cmd");
        let (ctx, syncobj) = d.create_ctx(4 * 4).expect("ctx");
        d.config_cu(ctx, pdi).expect("config_cu");
        Setup {
            heap,
            heap_map,
            pdi,
            instr,
            instr_addr,
            a,
            b,
            a_map,
            b_map,
            a_addr,
            b_addr,
            cmd,
            cmd_map,
            ctx,
            syncobj,
        }
    }

    /// Host view of a DEV BO's bytes through the heap mapping.
    #[allow(clippy::mut_from_ref)]
    pub fn dev_bytes(&self, d: &Raw, h: u32) -> &mut [u8] {
        let (_, _, xdna) = d.bo_info(h).unwrap();
        let off = (xdna - 0x0400_0000) as usize;
        &mut self.heap_map.bytes()[off..]
    }

    /// Puts `image` in the instruction BO, builds the START_CU packet over (a, b), submits, waits.
    /// Returns the final command state.
    pub fn run(&self, d: &Raw, image: &[u8]) -> Result<u32, i32> {
        self.dev_bytes(d, self.instr)[..image.len()].copy_from_slice(image);
        write_start_cu(
            self.cmd_map.bytes(),
            self.instr_addr,
            (image.len() / 4) as u32,
            &[self.a_addr, self.b_addr],
        );
        let seq = d.exec(self.ctx, self.cmd, &[self.instr, self.a, self.b])?;
        d.wait(self.syncobj, seq)?;
        Ok(cmd_state(self.cmd_map.bytes()))
    }

    pub fn teardown(self, d: &Raw) {
        d.syncobj_destroy(self.syncobj).expect("syncobj destroy");
        d.destroy_ctx(self.ctx).expect("destroy ctx");
        for h in [self.cmd, self.b, self.a, self.instr, self.pdi, self.heap] {
            d.gem_close(h).expect("gem close");
        }
    }
}
