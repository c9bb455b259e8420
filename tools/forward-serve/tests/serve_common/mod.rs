//! A tiny HTTP/1.1 client over loopback TCP for the server tests (no client crate needed), and a
//! server over the fake engine.
#![allow(dead_code)]

use forward_serve::api::Config;
use forward_serve::engine::Loaded;
use forward_serve::fake::{FakeCodec, FakeEngine};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        match serde_json::from_slice(&self.body) {
            Ok(v) => v,
            Err(e) => panic!("not JSON ({e}): {}", self.text()),
        }
    }
    /// The `data:` payloads of an SSE body, in order.
    pub fn sse(&self) -> Vec<String> {
        sse_events(&self.text())
    }
}

pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| {
            let data: Vec<&str> = ev
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

pub fn request_bytes(
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    extra: &[(&str, &str)],
) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for (k, v) in extra {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    let mut out = req.into_bytes();
    if let Some(b) = body {
        out.extend_from_slice(b);
    }
    out
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size_str = String::from_utf8_lossy(&b[..nl]);
        let size =
            usize::from_str_radix(size_str.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        b = &b[nl + 2..];
        if size == 0 || b.len() < size {
            break;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[(size + 2).min(b.len())..];
    }
    out
}

pub fn parse_response(raw: &[u8]) -> Resp {
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        panic!(
            "no header end in response: {:?}",
            String::from_utf8_lossy(raw)
        );
    };
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        })
        .collect();
    let rest = &raw[end + 4..];
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    Resp {
        status,
        headers,
        body,
    }
}

pub async fn raw(addr: SocketAddr, bytes: &[u8]) -> Resp {
    let fut = async {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(bytes).await.expect("write");
        // Read to EOF; a reset after the response (server closed with our body unread, e.g. 413)
        // keeps what arrived.
        let mut buf = Vec::new();
        let mut chunk = [0u8; 16384];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if !buf.is_empty() => {
                    eprintln!("read after {} bytes: {e}", buf.len());
                    break;
                }
                Err(e) => panic!("read: {e}"),
            }
        }
        buf
    };
    let buf = tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .expect("request timed out");
    parse_response(&buf)
}

pub async fn get(addr: SocketAddr, path: &str) -> Resp {
    raw(addr, &request_bytes("GET", path, None, &[])).await
}

pub async fn post(addr: SocketAddr, path: &str, body: &str) -> Resp {
    raw(
        addr,
        &request_bytes("POST", path, Some(body.as_bytes()), &[]),
    )
    .await
}

pub async fn post_json(addr: SocketAddr, path: &str, v: &serde_json::Value) -> Resp {
    post(addr, path, &v.to_string()).await
}

/// Value of an unlabelled metric in a Prometheus text body.
pub fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(name)
            .and_then(|r| r.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// forward-serve over the fake engine on a loopback port.
pub struct TestServer {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    join: tokio::task::JoinHandle<Result<(), forward_serve::server::ServeError>>,
}

impl TestServer {
    pub async fn start(cfg: Config, ctx: usize, delay: Duration) -> TestServer {
        let engine = FakeEngine::new(cfg.max_batch, delay);
        TestServer::start_engine(cfg, ctx, engine).await
    }
    /// The server over `engine` (a fake engine set up by the test, e.g. with its DFlash drafts).
    pub async fn start_engine(cfg: Config, ctx: usize, engine: FakeEngine) -> TestServer {
        let loaded = Loaded {
            codec: Arc::new(FakeCodec::new(ctx)),
            engine: Box::new(engine),
        };
        let (addr, tx, join) = serve_loaded(loaded, cfg).await;
        TestServer {
            addr,
            stop: Some(tx),
            join,
        }
    }
    pub async fn default() -> TestServer {
        TestServer::start(small_cfg(), 256, Duration::ZERO).await
    }
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let r = tokio::time::timeout(Duration::from_secs(20), &mut self.join).await;
        match r {
            Ok(Ok(Ok(()))) => {}
            other => panic!("server did not stop cleanly: {other:?}"),
        }
    }
    pub async fn metrics(&self) -> String {
        get(self.addr, "/metrics").await.text()
    }
}

pub fn small_cfg() -> Config {
    Config {
        max_queue: 8,
        max_batch: 4,
        request_timeout: Duration::from_secs(30),
        max_tokens_limit: 100,
        body_limit: 4096,
        shutdown_grace: Duration::from_secs(5),
        ..Config::default()
    }
}

pub fn err_of(r: &Resp) -> Value {
    let v = r.json();
    let e = v.get("error").cloned().unwrap_or(Value::Null);
    assert!(
        e.get("message").and_then(Value::as_str).is_some(),
        "error body without message: {v}"
    );
    assert!(
        e.get("type").and_then(Value::as_str).is_some(),
        "error body without type: {v}"
    );
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "error body without param/code: {v}"
    );
    e
}

/// The `forward-serve` binary started with `args` and `--port 0`, and its base URL
/// (`http://127.0.0.1:PORT`) once it prints its listening line (within `wait`).
pub fn spawn_binary(args: &[&std::ffi::OsStr], wait: Duration) -> (std::process::Child, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_forward-serve"));
    cmd.args(args);
    spawn_command(cmd, wait)
}

/// `cmd` (the `forward-serve` binary with its arguments and environment) started with
/// `--port 0`, and its base URL once it prints its listening line (within `wait`).
pub fn spawn_command(
    mut cmd: std::process::Command,
    wait: Duration,
) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = cmd
        .args(["--port", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn forward-serve");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(a) = line.strip_prefix("forward-serve listening on ") {
                let _ = tx.send(a.trim().to_string());
            }
        }
    });
    let base = rx.recv_timeout(wait).expect("listening line");
    (child, base)
}

/// The loopback address in a base URL from [`spawn_command`].
pub fn addr_of(base: &str) -> SocketAddr {
    base.trim_start_matches("http://")
        .parse()
        .expect("a socket address")
}

/// Serve `loaded` in process on a loopback port: its address, the stop switch and the server.
pub async fn serve_loaded(
    loaded: Loaded,
    cfg: Config,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), forward_serve::server::ServeError>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(forward_serve::server::run(
        listener,
        cfg,
        loaded,
        async move {
            let _ = rx.await;
        },
    ));
    (addr, tx, server)
}
