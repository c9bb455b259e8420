//! Integration tests of the `npu-hold` binary: exit codes, timeouts that kill whole process
//! trees, signal handling, FIFO serialization through the queue, crash release and `--status`.
//!
//! Every test uses its own `XDNA_HOLD_DIR` and bounds every wait; leftover processes of a failed
//! test are killed by `Scratch::drop` (recognized by their environment, never by name).

use std::fs::{self, File};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const BIN: &str = env!("CARGO_BIN_EXE_npu-hold");
const LIMIT: Duration = Duration::from_secs(30);

struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn new(name: &str) -> Scratch {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "npu-hold-test-{name}-{}-{nanos}",
            std::process::id()
        ));
        fs::create_dir_all(&dir).expect("create scratch dir");
        let dir = fs::canonicalize(&dir).expect("canonical scratch dir");
        Scratch { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn hold_dir(&self) -> PathBuf {
        self.dir.join("hold")
    }

    /// `npu-hold` with this scratch's lock dir, a non-existent device, stderr into `<tag>.err`.
    fn cmd(&self, tag: &str) -> Command {
        let mut c = Command::new(BIN);
        c.env("XDNA_HOLD_DIR", self.hold_dir())
            .env("XDNA_DEVICE", self.path("accel-test"))
            .env_remove("XDNA_HOLD_TICKET")
            .env_remove("NPU_HOLD_LOG")
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(self.path(&format!("{tag}.err"))).expect("stderr file"));
        // npu-hold leaves a stop signal alone when it is ignored on entry (as a shell does), and a
        // test runner started as a background job of a non-interactive shell ignores SIGINT and
        // SIGQUIT. The tests signal npu-hold, so start it with the default dispositions.
        // SAFETY: between fork and exec only signal(2), which is async-signal-safe, is called.
        unsafe {
            c.pre_exec(|| {
                for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGTERM, libc::SIGHUP] {
                    libc::signal(sig, libc::SIG_DFL);
                }
                Ok(())
            });
        }
        c
    }

    fn stderr(&self, tag: &str) -> String {
        fs::read_to_string(self.path(&format!("{tag}.err"))).unwrap_or_default()
    }

    fn spawn(&self, tag: &str, args: &[&str]) -> Child {
        self.cmd(tag).args(args).spawn().expect("spawn npu-hold")
    }

    /// Run to completion (bounded); the exit code (None: killed by a signal).
    fn run(&self, tag: &str, args: &[&str]) -> Option<i32> {
        let mut child = self.spawn(tag, args);
        finish(&mut child, LIMIT).code()
    }

    fn status_json(&self) -> serde_json::Value {
        let out = Command::new(BIN)
            .env("XDNA_HOLD_DIR", self.hold_dir())
            .env("XDNA_DEVICE", self.path("accel-test"))
            .args(["--status", "--json"])
            .stdin(Stdio::null())
            .output()
            .expect("run npu-hold --status --json");
        assert!(out.status.success(), "--status failed: {out:?}");
        serde_json::from_slice(&out.stdout).expect("--status --json output is JSON")
    }

    fn queue_labels(&self) -> Vec<String> {
        let v = self.status_json();
        v["queue"]
            .as_array()
            .map(|q| {
                q.iter()
                    .map(|t| t["label"].as_str().unwrap_or("?").to_string())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn pid(&self, name: &str) -> i32 {
        let text = fs::read_to_string(self.path(name))
            .unwrap_or_else(|e| panic!("pid file {name} missing: {e}"));
        text.trim()
            .parse()
            .unwrap_or_else(|e| panic!("pid file {name}: {text:?}: {e}"))
    }
}

impl Drop for Scratch {
    /// Safety net: SIGKILL every still-running process started under this scratch's lock dir.
    fn drop(&mut self) {
        let marker = format!("XDNA_HOLD_TICKET={}#", self.hold_dir().display());
        if let Ok(entries) = fs::read_dir("/proc") {
            for e in entries.filter_map(|e| e.ok()) {
                let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                    continue;
                };
                let Ok(env) = fs::read(format!("/proc/{pid}/environ")) else {
                    continue;
                };
                let hit = env
                    .split(|b| *b == 0)
                    .any(|v| v.starts_with(marker.as_bytes()));
                if hit && alive(pid) {
                    let _ = Command::new("kill")
                        .args(["-KILL", &pid.to_string()])
                        .status();
                }
            }
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Wait for `child` at most `limit`; on expiry SIGKILL it and fail the test.
fn finish(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "npu-hold (pid {}) did not exit within {limit:?}",
                child.id()
            );
        }
        sleep(Duration::from_millis(20));
    }
}

fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        sleep(Duration::from_millis(20));
    }
}

/// The process exists and is not a zombie.
fn alive(pid: i32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_some_and(|state| state != "Z"),
        Err(_) => false,
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill -{sig} {pid} failed");
}

fn read_ns(path: &Path) -> u128 {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {text:?}: {e}", path.display()))
}

#[test]
fn exit_codes_are_propagated() {
    let s = Scratch::new("codes");
    assert_eq!(s.run("ok", &["--", "true"]), Some(0));
    assert_eq!(s.run("three", &["--", "sh", "-c", "exit 3"]), Some(3));
    assert_eq!(
        s.run("kill9", &["--", "sh", "-c", "kill -KILL $$"]),
        Some(128 + 9)
    );
    assert_eq!(
        s.run("term", &["--", "sh", "-c", "kill -TERM $$"]),
        Some(128 + 15)
    );
    assert_eq!(
        s.run("missing", &["--", "/nonexistent/npu-hold-test-cmd"]),
        Some(127)
    );
    assert!(
        s.stderr("missing").contains("cannot run"),
        "{}",
        s.stderr("missing")
    );
}

#[test]
fn bad_durations_are_rejected() {
    let s = Scratch::new("durations");
    for bad in ["5x", "0s", "1.5h", "30m1h", ""] {
        assert_eq!(
            s.run("bad", &["-t", bad, "--", "true"]),
            Some(125),
            "-t {bad:?}"
        );
        let err = s.stderr("bad");
        assert!(err.contains("invalid duration"), "-t {bad:?}: {err}");
    }
    assert_eq!(s.run("nocmd", &["-t", "1s"]), Some(125));
    assert_eq!(
        s.run("good", &["-t", "1h30m", "--grace", "500ms", "--", "true"]),
        Some(0)
    );
}

#[test]
fn timeout_kills_the_whole_tree_including_term_ignoring_and_setsid_escapees() {
    let s = Scratch::new("timeout");
    let d = s.dir.display().to_string();
    // The escapee: new session via setsid, parent exits at once (double fork), ignores SIGTERM.
    fs::write(
        s.path("esc.sh"),
        "trap '' TERM; echo $$ > \"$1/p2.pid\"; exec sleep 1000\n",
    )
    .expect("write esc.sh");
    fs::write(
        s.path("tree.sh"),
        r#"D="$1"
trap '' TERM
echo $$ > "$D/p0.pid"
sh -c 'trap "" TERM; echo $$ > "$1/p1.pid"; exec sleep 1000' sh "$D" &
(trap '' TERM; sh -c 'echo $PPID > "$1/p3.pid"' sh "$D"; sh -c 'echo $$ > "$1/p4.pid"; exec sleep 1000' sh "$D") &
setsid sh -c 'sh "$1/esc.sh" "$1" & exit 0' sh "$D" &
sleep 1000
"#,
    )
    .expect("write tree.sh");
    let start = Instant::now();
    let mut child = s.spawn(
        "tree",
        &[
            "-t",
            "2s",
            "--grace",
            "1s",
            "--",
            "sh",
            &format!("{d}/tree.sh"),
            &d,
        ],
    );
    let status = finish(&mut child, LIMIT);
    let elapsed = start.elapsed();
    let err = s.stderr("tree");
    assert_eq!(status.code(), Some(124), "stderr: {err}");
    assert!(err.contains("timeout"), "stderr: {err}");
    assert!(err.contains("SIGKILL sent"), "stderr: {err}");
    // 2 s limit + 1 s grace (everything ignores SIGTERM), not much more.
    assert!(
        elapsed >= Duration::from_millis(2900),
        "exited after {elapsed:?}"
    );
    for f in ["p0.pid", "p1.pid", "p2.pid", "p3.pid", "p4.pid"] {
        let pid = s.pid(f);
        assert!(!alive(pid), "{f}: process {pid} survived npu-hold");
    }
    // The lock is free again.
    assert_eq!(s.status_json()["locked"], false);
}

#[test]
fn sigterm_to_npu_hold_kills_the_group() {
    let s = Scratch::new("sigterm");
    // A long grace: the command keeps default SIGTERM handling (npu-hold's blocked signals must
    // not leak into it), so SIGTERM alone must end it, well before SIGKILL would be sent.
    let mut child = s.spawn(
        "hold",
        &[
            "--grace",
            "20s",
            "--",
            "sh",
            "-c",
            "echo $$ > p0.pid; sleep 1000 & echo $! > p1.pid; wait",
        ],
    );
    wait_until("pid files", LIMIT, || {
        s.path("p1.pid").exists() && s.path("p0.pid").exists()
    });
    sleep(Duration::from_millis(50));
    let start = Instant::now();
    signal(child.id(), "TERM");
    let status = finish(&mut child, LIMIT);
    let err = s.stderr("hold");
    assert_eq!(status.code(), Some(128 + 15), "stderr: {err}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    assert!(!err.contains("SIGKILL sent"), "stderr: {err}");
    assert!(err.contains("SIGTERM received"), "stderr: {err}");
    for f in ["p0.pid", "p1.pid"] {
        let pid = s.pid(f);
        assert!(!alive(pid), "{f}: process {pid} survived");
    }
}

#[test]
fn two_holders_serialize() {
    let s = Scratch::new("serial");
    let mut a = s.spawn(
        "a",
        &[
            "-l",
            "A",
            "--",
            "sh",
            "-c",
            "date +%s%N > a.start.tmp && mv a.start.tmp a.start; sleep 2; date +%s%N > a.end",
        ],
    );
    wait_until("A to start", LIMIT, || s.path("a.start").exists());
    let mut b = s.spawn(
        "b",
        &[
            "-l",
            "B",
            "--",
            "sh",
            "-c",
            "date +%s%N > b.start.tmp && mv b.start.tmp b.start",
        ],
    );
    assert_eq!(finish(&mut a, LIMIT).code(), Some(0));
    assert_eq!(finish(&mut b, LIMIT).code(), Some(0));
    let a_end = read_ns(&s.path("a.end"));
    let b_start = read_ns(&s.path("b.start"));
    assert!(
        b_start >= a_end,
        "B started {} ms before A ended",
        (a_end - b_start) / 1_000_000
    );
    assert!(s.stderr("b").contains("waiting for"), "{}", s.stderr("b"));
}

#[test]
fn three_holders_run_in_fifo_order_and_status_shows_them() {
    let s = Scratch::new("fifo");
    let mut a = s.spawn(
        "a",
        &[
            "-l",
            "alpha",
            "-t",
            "25s",
            "--",
            "sh",
            "-c",
            "echo A >> order; while [ ! -e release ]; do sleep 0.05; done",
        ],
    );
    wait_until("A to hold", LIMIT, || s.path("order").exists());
    let mut b = s.spawn("b", &["-l", "beta", "--", "sh", "-c", "echo B >> order"]);
    wait_until("B queued", LIMIT, || s.queue_labels() == ["beta"]);
    let mut c = s.spawn("c", &["-l", "gamma", "--", "sh", "-c", "echo C >> order"]);
    wait_until("C queued", LIMIT, || s.queue_labels() == ["beta", "gamma"]);
    let mut d = s.spawn("d", &["-l", "delta", "--", "sh", "-c", "echo D >> order"]);
    wait_until("D queued", LIMIT, || {
        s.queue_labels() == ["beta", "gamma", "delta"]
    });

    // --status --json: holder and queue in order.
    let v = s.status_json();
    assert_eq!(v["locked"], true);
    assert_eq!(v["holder"]["label"], "alpha", "{v}");
    assert_eq!(v["holder"]["pid"], a.id(), "{v}");
    assert_eq!(v["holder"]["state"], "running", "{v}");
    assert!(v["holder"]["deadline"].is_string(), "{v}");
    assert!(v["holder"]["elapsed_s"].as_f64().is_some(), "{v}");
    assert_eq!(v["queue"][0]["pid"], b.id(), "{v}");
    assert_eq!(v["queue"][1]["pid"], c.id(), "{v}");
    assert_eq!(v["queue"][0]["position"], 1, "{v}");
    // Text form.
    let out = Command::new(BIN)
        .env("XDNA_HOLD_DIR", s.hold_dir())
        .env("XDNA_DEVICE", s.path("accel-test"))
        .arg("--status")
        .output()
        .expect("--status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains(&format!("holder: 'alpha' pid {}", a.id())),
        "{text}"
    );
    assert!(text.contains("deadline"), "{text}");
    assert!(
        text.contains("1. 'beta'") && text.contains("2. 'gamma'") && text.contains("3. 'delta'"),
        "{text}"
    );

    File::create(s.path("release")).expect("release");
    for (name, child) in [("A", &mut a), ("B", &mut b), ("C", &mut c), ("D", &mut d)] {
        assert_eq!(finish(child, LIMIT).code(), Some(0), "{name}");
    }
    assert_eq!(
        fs::read_to_string(s.path("order")).unwrap_or_default(),
        "A\nB\nC\nD\n"
    );
    let v = s.status_json();
    assert_eq!(v["locked"], false, "{v}");
    assert!(v["holder"].is_null(), "{v}");
    assert_eq!(v["queue"].as_array().map(|q| q.len()), Some(0), "{v}");
}

#[test]
fn a_sigkilled_holder_releases_the_ticket_and_its_command_tree_dies() {
    let s = Scratch::new("crash");
    let mut a = s.spawn(
        "a",
        &[
            "-l",
            "A",
            "--",
            "sh",
            "-c",
            "sleep 1000 & echo $! > a.kid; echo $$ > a.pid; wait",
        ],
    );
    wait_until("A to hold", LIMIT, || {
        s.path("a.pid").exists() && s.path("a.kid").exists()
    });
    let mut b = s.spawn(
        "b",
        &["-l", "B", "--", "sh", "-c", "echo started > b.started"],
    );
    wait_until("B queued", LIMIT, || s.queue_labels() == ["B"]);
    assert!(
        !s.path("b.started").exists(),
        "B ran while A held the device"
    );
    signal(a.id(), "KILL");
    let _ = finish(&mut a, LIMIT);
    assert_eq!(finish(&mut b, LIMIT).code(), Some(0), "{}", s.stderr("b"));
    assert!(s.path("b.started").exists());
    // A's command dies with it (parent-death signal), and so does the command's own child (the
    // watchdog kills the command's process group).
    let (a_cmd, a_kid) = (s.pid("a.pid"), s.pid("a.kid"));
    wait_until("A's command to die", Duration::from_secs(5), || {
        !alive(a_cmd)
    });
    wait_until("A's command's child to die", Duration::from_secs(5), || {
        !alive(a_kid)
    });
    // A's stale ticket is gone from the queue.
    assert_eq!(s.queue_labels(), Vec::<String>::new());
}

#[test]
fn leftovers_of_an_exited_command_are_stopped() {
    let s = Scratch::new("leftover");
    let code = s.run(
        "hold",
        &[
            "--grace",
            "20s",
            "--",
            "sh",
            "-c",
            "sleep 1000 & echo $! > bg.pid; exit 0",
        ],
    );
    let err = s.stderr("hold");
    assert_eq!(code, Some(0), "stderr: {err}");
    assert!(err.contains("left 1 process(es) behind"), "stderr: {err}");
    let pid = s.pid("bg.pid");
    assert!(!alive(pid), "background process {pid} survived");
}

#[test]
fn nested_npu_hold_inside_a_held_run_does_not_deadlock() {
    let s = Scratch::new("nested");
    let code = s.run(
        "outer",
        &[
            "-t",
            "20s",
            "-l",
            "outer",
            "--",
            BIN,
            "-l",
            "inner",
            "--",
            "sh",
            "-c",
            "echo ok > nested.out",
        ],
    );
    assert_eq!(code, Some(0), "stderr: {}", s.stderr("outer"));
    assert!(s.path("nested.out").exists());
}

#[test]
fn the_command_gets_the_terminal_when_npu_hold_has_it() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: util-linux `script` (to get a pseudo-terminal) is not installed");
        return;
    }
    let s = Scratch::new("tty");
    fs::write(s.path("input"), "hello\n").expect("write input");
    let out = s.path("got");
    // In its own process group the command could not read the terminal (SIGTTIN) unless
    // npu-hold makes that group the terminal's foreground group.
    let inner = format!("{BIN} -- sh -c 'read x; echo got:$x > {}'", out.display());
    let mut child = Command::new("script")
        .args(["-qec", &inner, "/dev/null"])
        .env("XDNA_HOLD_DIR", s.hold_dir())
        .env("XDNA_DEVICE", s.path("accel-test"))
        .env_remove("XDNA_HOLD_TICKET")
        .stdin(File::open(s.path("input")).expect("input"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn script");
    let status = finish(&mut child, Duration::from_secs(15));
    assert!(status.success(), "{status:?}");
    assert_eq!(fs::read_to_string(&out).unwrap_or_default(), "got:hello\n");
}

#[test]
fn a_waiter_interrupted_in_the_queue_leaves_it() {
    let s = Scratch::new("leave");
    let mut a = s.spawn(
        "a",
        &[
            "-l",
            "A",
            "-t",
            "25s",
            "--",
            "sh",
            "-c",
            "echo A > a.started; while [ ! -e release ]; do sleep 0.05; done",
        ],
    );
    wait_until("A to hold", LIMIT, || s.path("a.started").exists());
    let mut b = s.spawn("b", &["-l", "B", "--", "sh", "-c", "echo B > b.ran"]);
    wait_until("B queued", LIMIT, || s.queue_labels() == ["B"]);
    signal(b.id(), "INT");
    assert_eq!(
        finish(&mut b, LIMIT).code(),
        Some(128 + 2),
        "{}",
        s.stderr("b")
    );
    assert!(
        s.stderr("b").contains("left the queue"),
        "{}",
        s.stderr("b")
    );
    assert_eq!(s.queue_labels(), Vec::<String>::new());
    File::create(s.path("release")).expect("release");
    assert_eq!(finish(&mut a, LIMIT).code(), Some(0));
    assert!(
        !s.path("b.ran").exists(),
        "B ran its command after being interrupted"
    );
}
