//! The real `forward-serve` binary: startup on port 0, graceful shutdown on SIGTERM/SIGINT.

mod serve_common;
#[path = "../../../tests/support/smollm2.rs"]
mod smollm2;

use serde_json::json;
use serve_common::*;
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

struct Proc {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(extra: &[&str]) -> Proc {
    let mut args = vec!["--fake-engine"];
    args.extend_from_slice(extra);
    spawn_with(&args)
}

fn spawn_with(extra: &[&str]) -> Proc {
    let args: Vec<&std::ffi::OsStr> = ["--host", "127.0.0.1"]
        .iter()
        .chain(extra)
        .map(std::ffi::OsStr::new)
        .collect();
    let (child, base) = spawn_binary(&args, Duration::from_secs(20));
    Proc {
        child,
        addr: base.trim_start_matches("http://").parse().expect("address"),
    }
}

fn signal(p: &Proc, sig: nix::sys::signal::Signal) {
    let pid = nix::unistd::Pid::from_raw(p.child.id() as i32);
    nix::sys::signal::kill(pid, sig).expect("kill");
}

fn wait_exit(p: &mut Proc, limit: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = p.child.try_wait().expect("try_wait") {
            return st;
        }
        assert!(
            t0.elapsed() < limit,
            "forward-serve did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_then_exits_0() {
    let mut p = spawn(&["--fake-step-delay", "20ms", "--shutdown-grace", "10s"]);
    let addr = p.addr;
    assert_eq!(get(addr, "/health").await.status, 200);
    // 30 tokens at 20 ms: in flight when SIGTERM arrives, and must complete.
    let inflight = tokio::spawn(async move {
        post_json(
            addr,
            "/v1/completions",
            &json!({"prompt": "abc", "max_tokens": 30, "stream": true}),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    signal(&p, nix::sys::signal::Signal::SIGTERM);
    let r = tokio::time::timeout(Duration::from_secs(10), inflight)
        .await
        .expect("in-flight")
        .expect("task");
    assert_eq!(r.status, 200);
    let ev = r.sse();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{ev:?}");
    let text: String = ev
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, "ABC".repeat(10));
    let st = wait_exit(&mut p, Duration::from_secs(10));
    assert_eq!(st.code(), Some(0), "{st:?}");
    // No longer accepting.
    assert!(std::net::TcpStream::connect(addr).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_cancels_after_grace_and_exits_0() {
    let mut p = spawn(&[
        "--fake-step-delay",
        "20ms",
        "--shutdown-grace",
        "500ms",
        "--max-tokens-limit",
        "5000",
    ]);
    let addr = p.addr;
    // 5000 tokens at 20 ms = 100 s: far beyond the grace, so it is cancelled.
    let inflight = tokio::spawn(async move {
        post_json(
            addr,
            "/v1/completions",
            &json!({"prompt": "zz", "max_tokens": 1000, "stream": true}),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t0 = Instant::now();
    signal(&p, nix::sys::signal::Signal::SIGINT);
    let st = wait_exit(&mut p, Duration::from_secs(8));
    assert_eq!(st.code(), Some(0), "{st:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    let r = tokio::time::timeout(Duration::from_secs(5), inflight)
        .await
        .expect("in-flight")
        .expect("task");
    let text: String = r
        .sse()
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert!(text.len() < 1000, "generation was not cut short");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_serves_then_sigterm_exits_0() {
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    let gguf = gguf.to_string_lossy().into_owned();
    let mut p = spawn_with(&["--model", &gguf, "--backend", "host", "--ctx", "256"]);
    let addr = p.addr;
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert_eq!(v["model"], "SmolLM2-135M-Instruct.Q4_1");
    let t = post_json(addr, "/tokenize", &json!({"content": "Paris"}))
        .await
        .json();
    let back = post_json(addr, "/detokenize", &json!({"tokens": t["tokens"]}))
        .await
        .json();
    assert_eq!(back["content"], "Paris");
    signal(&p, nix::sys::signal::Signal::SIGTERM);
    let st = wait_exit(&mut p, Duration::from_secs(15));
    assert_eq!(st.code(), Some(0), "{st:?}");
}

/// `--bench --json` on the real model: the fields a reader compares, consistent with each other,
/// for sampled streams; a bad `--bench-temperature` is refused by name.
#[test]
fn bench_reports_sampled_streams_against_one() {
    let bad = Command::new(env!("CARGO_BIN_EXE_forward-serve"))
        .args(["--bench", "--bench-temperature=-0.5"])
        .output()
        .expect("run forward-serve");
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--bench-temperature"), "{err}");
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_forward-serve"))
        .arg("--model")
        .arg(&gguf)
        .args([
            "--backend",
            "host",
            "--ctx",
            "256",
            "--max-batch",
            "3",
            "--bench",
        ])
        .args([
            "--bench-tokens",
            "5",
            "--bench-rounds",
            "2",
            "--bench-temperature",
            "0.8",
        ])
        .arg("--json")
        .output()
        .expect("run forward-serve");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench JSON");
    assert_eq!(v["temperature"].as_f64(), Some(0.8), "{v}");
    assert_eq!(v["streams"], 3, "{v}");
    assert_eq!(v["tokens_per_stream"], 5, "{v}");
    assert_eq!(
        v["single_runs_tok_s"].as_array().map(Vec::len),
        Some(2),
        "{v}"
    );
    let (single, concurrent) = (
        v["single_tok_s"].as_f64().unwrap_or(0.0),
        v["concurrent_tok_s"].as_f64().unwrap_or(0.0),
    );
    assert!(single > 0.0 && concurrent > 0.0, "{v}");
    let speedup = v["speedup"].as_f64().unwrap_or(0.0);
    assert!(
        (speedup - concurrent / single).abs() < 1e-9 * speedup,
        "{v}"
    );
    // 256 positions hold a shortened chat history: the prefix-cache case runs on it.
    let chat = &v["chat_turn"];
    assert!(
        chat["prompt_tokens"]
            .as_u64()
            .is_some_and(|n| n > 64 && n <= 256),
        "{v}"
    );
    assert!(chat["cold_ms"].as_f64().is_some_and(|c| c > 0.0), "{v}");
    assert!(chat["warm_ms"].as_f64().is_some_and(|w| w > 0.0), "{v}");
}
