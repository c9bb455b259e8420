//! A soak that checks every answer: the real `forward-serve` binary with the real default model
//! on the host backend, driven by concurrent clients with mixed traffic — completions and chat,
//! streamed and not, n-gram speculation on and off, seeded sampling, cancelled streams and
//! malformed requests. Every completed answer must equal the same request's answer when it ran
//! alone (before the soak); every malformed request must get a 4xx; nothing may be lost; and the
//! server's resident memory after the warm-up must stay within 5 %.
//!
//! Short in CI (`XDNA_SOAK_SECS`, default 45 s of traffic); by hand for the long figures:
//! `XDNA_SOAK_SECS=600 cargo test --release -p forward-serve --test serve_soak -- --nocapture`.

mod serve_common;
#[path = "../../../tests/support/smollm2.rs"]
mod smollm2;

use serde_json::{json, Value};
use serve_common::{addr_of, parse_response, post_json, request_bytes, spawn_command, Resp};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CLIENTS: usize = 10;
const PROMPTS: [&str; 8] = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three uses of copper:",
    "Once upon a time, in a small village,",
    "Explain what a CPU cache does.",
    "def fibonacci(n):",
    "The best way to learn a language is",
    "Q: What is 12 times 12?\nA:",
];

/// One well-formed request of the soak: its answer must not depend on what else runs.
#[derive(Clone, Copy, Debug)]
struct Template {
    prompt: usize,
    chat: bool,
    /// Seeded sampling at temperature 0.8 instead of greedy.
    sampled: bool,
}

impl Template {
    fn all() -> Vec<Template> {
        let mut v = Vec::new();
        for prompt in 0..PROMPTS.len() {
            for chat in [false, true] {
                v.push(Template {
                    prompt,
                    chat,
                    sampled: false,
                });
            }
            v.push(Template {
                prompt,
                chat: prompt % 2 == 1,
                sampled: true,
            });
        }
        v
    }

    fn path(&self) -> &'static str {
        if self.chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }

    /// The request body; `stream` and `speculative` may not change the answer.
    fn body(&self, stream: bool, speculative: bool) -> Value {
        let text = PROMPTS[self.prompt];
        let mut v = if self.chat {
            json!({"messages": [{"role": "user", "content": text}]})
        } else {
            json!({"prompt": text})
        };
        v["max_tokens"] = json!(8 + 8 * (self.prompt % 3));
        v["stream"] = json!(stream);
        if self.sampled {
            v["temperature"] = json!(0.8);
            v["seed"] = json!(1234 + self.prompt);
        } else {
            v["temperature"] = json!(0);
            v["speculative"] = json!(speculative);
        }
        v
    }
}

/// The text of an answer (streamed ones put back together), or why there is none.
fn answer_text(r: &Resp, stream: bool) -> Result<String, String> {
    if r.status != 200 {
        return Err(format!("status {}: {}", r.status, r.text()));
    }
    let choice_text = |c: &Value| {
        let mut s = String::new();
        s.push_str(c["text"].as_str().unwrap_or_default());
        s.push_str(c["delta"]["content"].as_str().unwrap_or_default());
        s.push_str(c["message"]["content"].as_str().unwrap_or_default());
        s
    };
    if !stream {
        let v: Value = serde_json::from_slice(&r.body).map_err(|e| format!("not JSON: {e}"))?;
        return Ok(choice_text(&v["choices"][0]));
    }
    let mut text = String::new();
    let mut done = false;
    for ev in r.sse() {
        if ev == "[DONE]" {
            done = true;
            break;
        }
        let v: Value = serde_json::from_str(&ev).map_err(|e| format!("SSE not JSON: {e}"))?;
        if v.get("error").is_some() {
            return Err(format!("stream error: {v}"));
        }
        text.push_str(&choice_text(&v["choices"][0]));
    }
    if !done {
        return Err("stream without [DONE]".into());
    }
    Ok(text)
}

/// Malformed requests of several kinds (path, raw body); each must be answered 4xx.
fn malformed(k: usize) -> (&'static str, &'static str) {
    const CASES: [(&str, &str); 8] = [
        ("/v1/completions", "{\"prompt\": \"unterminated"),
        ("/v1/completions", "{\"prompt\": 5}"),
        ("/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": -1}"),
        (
            "/v1/completions",
            "{\"prompt\": \"x\", \"no_such_field\": 1}",
        ),
        ("/v1/chat/completions", "{\"messages\": \"hi\"}"),
        ("/v1/chat/completions", "[]"),
        (
            "/v1/completions",
            "{\"prompt\": \"x\", \"max_tokens\": 100000}",
        ),
        (
            "/v1/chat/completions",
            "{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}",
        ),
    ];
    CASES[k % CASES.len()]
}

/// A streamed request the client walks away from after its first events.
async fn cancel_midway(addr: SocketAddr, t: &Template) -> Result<(), String> {
    let body = t.body(true, false).to_string();
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    s.write_all(&request_bytes("POST", t.path(), Some(body.as_bytes()), &[]))
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while got.windows(6).filter(|w| w == b"data: ").count() < 2 {
        match tokio::time::timeout(Duration::from_secs(60), s.read(&mut buf)).await {
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => return Err(format!("read: {e}")),
            Err(_) => return Err("no event within 60 s".into()),
        }
    }
    let r = parse_response(&got);
    if r.status != 200 {
        return Err(format!("status {}", r.status));
    }
    Ok(())
}

/// xorshift64*: the soak's choices, reproducible from the client's seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Default, Debug)]
struct Tally {
    served: u64,
    streamed: u64,
    speculative: u64,
    sampled: u64,
    cancelled: u64,
    malformed_4xx: u64,
    malformed_other: Vec<String>,
    lost: Vec<String>,
    mixed: Vec<String>,
    latencies: Vec<Duration>,
}

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_traffic_every_answer_checked() {
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    let secs: u64 = std::env::var("XDNA_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(45);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_forward-serve"));
    cmd.arg("--model")
        .arg(&gguf)
        .args(["--backend", "host", "--ctx", "512", "--max-batch", "8"])
        .args(["--max-queue", "64", "--prefix-cache", "4"])
        .env_remove("XDNA_BACKEND");
    let (child, base) = spawn_command(cmd, Duration::from_secs(120));
    let pid = child.id();
    let _server = Server(child);
    let addr = addr_of(&base);

    // Every template alone, one at a time: the answers the soak must reproduce.
    let templates = Template::all();
    let mut alone = Vec::new();
    for t in &templates {
        let r = post_json(addr, t.path(), &t.body(false, false)).await;
        let text = answer_text(&r, false).unwrap_or_else(|e| panic!("{t:?} alone: {e}"));
        alone.push(text);
    }
    let empty = alone.iter().filter(|t| t.is_empty()).count();
    assert!(empty <= 2, "{empty} templates answer nothing: a weak check");
    let alone = Arc::new(alone);
    let templates = Arc::new(templates);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(secs);
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (alone, templates, tally) = (alone.clone(), templates.clone(), tally.clone());
        clients.push(tokio::spawn(async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (c as u64 + 1));
            while Instant::now() < deadline {
                let roll = rng.below(100);
                let ti = rng.below(templates.len());
                let t = templates[ti];
                if roll < 12 {
                    let (path, body) = malformed(rng.below(64));
                    let r = serve_common::post(addr, path, body).await;
                    let mut g = tally.lock().expect("tally");
                    if (400..500).contains(&r.status) {
                        g.malformed_4xx += 1;
                    } else {
                        g.malformed_other.push(format!(
                            "{path} {body} → {}: {}",
                            r.status,
                            r.text()
                        ));
                    }
                    continue;
                }
                if roll < 24 {
                    let r = cancel_midway(addr, &t).await;
                    let mut g = tally.lock().expect("tally");
                    match r {
                        Ok(()) => g.cancelled += 1,
                        Err(e) => g.lost.push(format!("cancelled stream {t:?}: {e}")),
                    }
                    continue;
                }
                let stream = rng.below(2) == 0;
                let speculative = !t.sampled && rng.below(2) == 0;
                let started = Instant::now();
                let r = post_json(addr, t.path(), &t.body(stream, speculative)).await;
                let took = started.elapsed();
                let mut g = tally.lock().expect("tally");
                match answer_text(&r, stream) {
                    Err(e) => g.lost.push(format!("{t:?} stream {stream}: {e}")),
                    Ok(text) if text != alone[ti] => g.mixed.push(format!(
                        "{t:?} stream {stream} speculative {speculative}: {text:?} alone {:?}",
                        alone[ti]
                    )),
                    Ok(_) => {
                        g.served += 1;
                        g.streamed += u64::from(stream);
                        g.speculative += u64::from(speculative);
                        g.sampled += u64::from(t.sampled);
                        g.latencies.push(took);
                    }
                }
            }
        }));
    }
    // Resident memory once a second; the first quarter of the run is the warm-up.
    let mut rss = Vec::new();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let m = serve_common::get(addr, "/metrics").await.text();
        let states = serve_common::metric(&m, "forward_serve_sequence_states").unwrap_or(0.0);
        if let Some(k) = rss_kib(pid) {
            rss.push((t0.elapsed().as_secs_f64(), k, states as u64));
        }
    }
    for c in clients {
        c.await.expect("client");
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let g = tally.lock().expect("tally");
    let after_warmup: Vec<u64> = rss
        .iter()
        .filter(|(t, _, _)| *t >= elapsed / 4.0)
        .map(|&(_, k, _)| k)
        .collect();
    let first = after_warmup.first().copied().unwrap_or(0);
    let peak = after_warmup.iter().copied().max().unwrap_or(0);
    let growth = if first == 0 {
        0.0
    } else {
        peak as f64 / first as f64 - 1.0
    };
    let mut lat = g.latencies.clone();
    lat.sort();
    let pct = |q: f64| {
        lat.get(((q * lat.len() as f64).ceil() as usize).clamp(1, lat.len().max(1)) - 1)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    let summary = json!({
        "seconds": elapsed.round(),
        "clients": CLIENTS,
        "served": g.served,
        "streamed": g.streamed,
        "speculative": g.speculative,
        "sampled": g.sampled,
        "cancelled": g.cancelled,
        "malformed_4xx": g.malformed_4xx,
        "malformed_other": g.malformed_other.len(),
        "lost": g.lost.len(),
        "mixed": g.mixed.len(),
        "latency_ms_p50": pct(0.5),
        "latency_ms_p99": pct(0.99),
        "rss_kib_after_warmup_first": first,
        "rss_kib_after_warmup_peak": peak,
        "rss_growth": growth,
    });
    eprintln!("soak: {summary}");
    let series: Vec<String> = rss
        .iter()
        .map(|(t, k, n)| format!("{t:.0}s:{}M/{n}", k / 1024))
        .collect();
    eprintln!("resident memory: {}", series.join(" "));
    let by_kind: BTreeMap<&str, usize> = [
        ("lost", g.lost.len()),
        ("mixed", g.mixed.len()),
        ("malformed not 4xx", g.malformed_other.len()),
    ]
    .into_iter()
    .collect();
    assert!(
        g.lost.is_empty() && g.mixed.is_empty() && g.malformed_other.is_empty(),
        "{by_kind:?}\nlost: {:?}\nmixed: {:?}\nmalformed: {:?}",
        &g.lost[..g.lost.len().min(5)],
        &g.mixed[..g.mixed.len().min(5)],
        &g.malformed_other[..g.malformed_other.len().min(5)],
    );
    assert!(
        g.served >= 50,
        "only {} answers in {elapsed:.0} s",
        g.served
    );
    assert!(g.cancelled > 0 && g.malformed_4xx > 0 && g.speculative > 0 && g.streamed > 0);
    let most_states = rss.iter().map(|&(_, _, n)| n).max().unwrap_or(0);
    assert!(
        most_states <= 8 + 4,
        "{most_states} sequence states held; --max-batch 8 + --prefix-cache 4 is the bound"
    );
    assert!(
        growth <= 0.05,
        "resident memory grew {:.1} % after the warm-up ({first} → {peak} KiB)",
        growth * 100.0
    );
}
