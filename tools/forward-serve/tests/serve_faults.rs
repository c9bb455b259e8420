//! Device faults in the middle of serving: the real `forward-serve` binary on the xdna backend
//! with the real default model, its device being the fake amdxdna of `tools/xdna-shim`
//! (`LD_PRELOAD`), which is told to fail one command (`XDNA_SHIM_FAIL_EXEC`: ERROR, TIMEOUT,
//! ABORT) or one ioctl (`XDNA_SHIM_IOCTL_ERRNO`: BO creation ENOMEM, context creation EBUSY, the
//! wait EIO) while 16 sequences are being generated and 8 more wait in the queue.
//!
//! Against a fault-free run of the same traffic: a request of the failed pass gets a 5xx (or, when
//! streamed, an error event) naming the device error; every other request gets exactly the
//! fault-free answer; requests after the fault are served as before; and the device objects the
//! shim counts (BOs, hardware contexts, syncobjs — `XDNA_SHIM_STATS_EVERY`) come back to what the
//! fault-free run holds after the same traffic, then to zero at shutdown.
//!
//! Needs `cargo build --workspace --release` first (the shim is a cdylib of another package).

mod serve_common;
#[path = "../../../tests/support/smollm2.rs"]
mod smollm2;

use serde_json::{json, Value};
use serve_common::{addr_of, get, post_json, spawn_command, Resp};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

/// Executions per decode pass of SmolLM2 on the xdna backend: one per weight matrix (30 layers ×
/// 4 + the head). Only used to place a fault some passes into the traffic.
const EXECS_PER_PASS: u64 = 121;
/// Requests sent at once: 16 are generated together (`--max-batch 16`), 8 wait for a slot.
const CONCURRENT: usize = 24;

/// What a request got: its text, or the failure it was told about.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Text(String),
    Failed { status: u16, message: String },
}

/// `libxdna_shim.so`, built by `cargo build --workspace` beside the `forward-serve` binary.
fn shim_path() -> PathBuf {
    let so = Path::new(env!("CARGO_BIN_EXE_forward-serve")).with_file_name("libxdna_shim.so");
    assert!(
        so.exists(),
        "{} is missing: build it with `cargo build --workspace --release`",
        so.display()
    );
    so
}

struct Server {
    child: Child,
    addr: SocketAddr,
    stats: PathBuf,
}

impl Server {
    fn start(gguf: &Path, env: &[(&str, String)], tag: &str) -> Server {
        let stats = std::env::temp_dir().join(format!(
            "forward-serve-faults-{}-{tag}.jsonl",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&stats);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_forward-serve"));
        cmd.arg("--model")
            .arg(gguf)
            .args(["--backend", "xdna", "--ctx", "256", "--max-batch", "16"])
            .args(["--max-queue", "64", "--prefix-cache", "0"])
            .env_remove("XDNA_BACKEND")
            .env_remove("XDNA_DEVICE")
            .env_remove("XDNA_KERNELS")
            .env("LD_PRELOAD", shim_path())
            .env("XDNA_ALLOW_DESCRIPTOR_KERNELS", "1")
            .env("XDNA_SHIM_STATS", &stats)
            .env("XDNA_SHIM_STATS_EVERY", "1")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        let (child, base) = spawn_command(cmd, Duration::from_secs(120));
        let addr = addr_of(&base);
        Server { child, addr, stats }
    }

    /// The shim's latest line: the device objects alive now (the server is idle when asked).
    fn device_now(&self) -> Value {
        stats_lines(&self.stats).pop().expect("a stats line")
    }

    /// SIGTERM, exit 0, and the shim's line at the device's close.
    fn stop(mut self) -> Value {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "forward-serve exited with {status}");
        let lines = stats_lines(&self.stats);
        let _ = std::fs::remove_file(&self.stats);
        lines
            .into_iter()
            .rfind(|l| l["event"] == "close")
            .expect("a line at the device's close")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stats_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn request(i: usize) -> (Value, bool) {
    let stream = i.is_multiple_of(3);
    let body = if i.is_multiple_of(2) {
        json!({"prompt": format!("Request {i}: a few words about the number {i}."),
               "max_tokens": 24, "temperature": 0, "stream": stream})
    } else {
        json!({"messages": [{"role": "user", "content": format!("Say something about {i}.")}],
               "max_tokens": 24, "temperature": 0, "stream": stream})
    };
    (body, i.is_multiple_of(2))
}

/// Send request `i` and read what it got (streamed ones are put back together).
async fn send(addr: SocketAddr, i: usize) -> Outcome {
    let (body, completion) = request(i);
    let path = if completion {
        "/v1/completions"
    } else {
        "/v1/chat/completions"
    };
    let r: Resp = post_json(addr, path, &body).await;
    if r.status != 200 {
        let message = r.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        return Outcome::Failed {
            status: r.status,
            message,
        };
    }
    if body["stream"] == true {
        let mut text = String::new();
        for ev in r.sse() {
            if ev == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(&ev).expect("SSE JSON");
            if let Some(m) = v["error"]["message"].as_str() {
                return Outcome::Failed {
                    status: 200,
                    message: m.to_string(),
                };
            }
            let c = &v["choices"][0];
            text.push_str(c["text"].as_str().unwrap_or_default());
            text.push_str(c["delta"]["content"].as_str().unwrap_or_default());
        }
        return Outcome::Text(text);
    }
    let v = r.json();
    let c = &v["choices"][0];
    let text = c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .unwrap_or_default();
    Outcome::Text(text.to_string())
}

/// The traffic of every run: a warm-up request (the fault is placed after it), `CONCURRENT`
/// requests at once, then four more one by one. Returns the shim's line after the warm-up and the
/// outcomes of the concurrent and the later requests.
async fn traffic(s: &Server) -> (Value, Vec<Outcome>, Vec<Outcome>) {
    let warm = send(s.addr, 1000).await;
    assert!(matches!(warm, Outcome::Text(_)), "warm-up: {warm:?}");
    let warm = s.device_now();
    let addr = s.addr;
    let tasks: Vec<_> = (0..CONCURRENT)
        .map(|i| tokio::spawn(async move { send(addr, i).await }))
        .collect();
    let mut during = Vec::new();
    for t in tasks {
        during.push(t.await.expect("request task"));
    }
    let mut after = Vec::new();
    for i in 0..4 {
        after.push(send(s.addr, i).await);
    }
    let health = get(s.addr, "/health").await;
    assert_eq!(health.status, 200, "{}", health.text());
    (warm, during, after)
}

/// Shim variables that inject a fault, and the counters (ioctl, call number) it fires at.
struct Fault {
    env: Vec<(&'static str, String)>,
    fires: Vec<(&'static str, u64)>,
}

fn counts(line: &Value) -> [u64; 3] {
    ["bos", "contexts", "syncobjs"].map(|k| line[k].as_u64().unwrap_or(u64::MAX))
}

fn calls(line: &Value, name: &str) -> u64 {
    line["calls"][name].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_faults_fail_their_pass_only_and_the_server_recovers() {
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    // The fault-free run: the answers every other run must give, where its warm-up ends (the
    // call counts a fault is placed after) and what the device holds after the traffic.
    let reference = Server::start(&gguf, &[], "reference");
    let (warm, expected, expected_after) = traffic(&reference).await;
    for (i, o) in expected.iter().chain(&expected_after).enumerate() {
        assert!(matches!(o, Outcome::Text(t) if !t.is_empty()), "{i}: {o:?}");
    }
    let baseline = counts(&reference.device_now());
    let closed = reference.stop();
    assert_eq!(
        counts(&closed),
        [0, 0, 0],
        "fault-free run leaked: {closed}"
    );
    // Faults are placed after the warm-up, by its call counts.
    let w = |name: &str| calls(&warm, name);
    let execs = warm["execs"].as_u64().unwrap_or(0);
    let waits = w("SYNCOBJ_TIMELINE_WAIT");

    let exec_at = |passes: u64, at: u64| execs + passes * EXECS_PER_PASS + at;
    let fail_exec = |n: u64, state: &str| Fault {
        env: vec![("XDNA_SHIM_FAIL_EXEC", format!("{n}:{state}"))],
        fires: vec![("EXEC_CMD", n)],
    };
    let ioctl = |name: &'static str, errno: &str, n: u64| Fault {
        env: vec![("XDNA_SHIM_IOCTL_ERRNO", format!("{name}:{errno}@{n}"))],
        fires: vec![(name, n)],
    };
    // (name, fault, must a request fail, text its error must contain)
    let cases: Vec<(&str, Fault, bool, &str)> = vec![
        (
            "exec ERROR",
            fail_exec(exec_at(12, 60), "ERROR"),
            true,
            "ERROR (5)",
        ),
        (
            "exec TIMEOUT",
            fail_exec(exec_at(14, 1), "TIMEOUT"),
            true,
            "TIMEOUT (8)",
        ),
        (
            "exec ABORT",
            fail_exec(exec_at(16, 120), "ABORT"),
            true,
            "ABORT (6)",
        ),
        (
            "wait EIO",
            ioctl(
                "SYNCOBJ_TIMELINE_WAIT",
                "EIO",
                waits + 13 * EXECS_PER_PASS + 30,
            ),
            true,
            "Input/output error",
        ),
        // The first BO created after the warm-up: the activations' buffers growing for 16 rows.
        (
            "BO create ENOMEM",
            ioctl("CREATE_BO", "ENOMEM", w("CREATE_BO") + 1),
            true,
            "Cannot allocate memory",
        ),
        // An ABORT, and the re-creation of the aborted context refused with EBUSY (the driver's
        // "no free columns"): the executor evicts its least recently used context and retries,
        // so only the aborted pass fails.
        (
            "exec ABORT, context re-creation EBUSY",
            Fault {
                env: vec![
                    ("XDNA_SHIM_FAIL_EXEC", format!("{}:ABORT", exec_at(12, 7))),
                    (
                        "XDNA_SHIM_IOCTL_ERRNO",
                        format!("CREATE_HWCTX:EBUSY@{}", w("CREATE_HWCTX") + 1),
                    ),
                ],
                fires: vec![
                    ("EXEC_CMD", exec_at(12, 7)),
                    ("CREATE_HWCTX", w("CREATE_HWCTX") + 1),
                ],
            },
            true,
            "ABORT (6)",
        ),
    ];
    for (name, fault, must_fail, names) in cases {
        let env = format!("{:?}", fault.env);
        let s = Server::start(&gguf, &fault.env, &name.replace([' ', ','], "-"));
        let (_, during, after) = traffic(&s).await;
        let mut failed = 0;
        for (i, (got, want)) in during.iter().zip(&expected).enumerate() {
            match got {
                Outcome::Text(_) => assert_eq!(got, want, "{name} ({env}): request {i}"),
                Outcome::Failed { status, message } => {
                    failed += 1;
                    assert!(
                        *status >= 500 || (*status == 200 && request(i).0["stream"] == true),
                        "{name}: request {i} got {status}: {message}"
                    );
                    assert!(
                        message.contains("/dev/accel/accel0") && message.contains(names),
                        "{name}: request {i}'s error does not name the device error: {message}"
                    );
                }
            }
        }
        assert!(
            !must_fail || (1..=16).contains(&failed),
            "{name} ({env}): {failed} requests failed (the failed pass holds 1..=16)"
        );
        assert!(
            failed < CONCURRENT,
            "{name}: every request failed, the queued ones included"
        );
        assert_eq!(after, expected_after, "{name}: requests after the fault");
        let now = s.device_now();
        for &(counter, at) in &fault.fires {
            assert!(
                calls(&now, counter) >= at,
                "{name}: the fault never fired ({counter} reached {} of {at})",
                calls(&now, counter)
            );
        }
        assert_eq!(
            counts(&now),
            baseline,
            "{name}: device objects after the traffic differ from the fault-free run: {now}"
        );
        let closed = s.stop();
        assert_eq!(
            counts(&closed),
            [0, 0, 0],
            "{name}: leaked at close: {closed}"
        );
        eprintln!("{name} ({env}): {failed} of {CONCURRENT} failed, the rest as fault-free");
    }
}
