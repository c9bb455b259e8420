//! forward-serve against the deterministic fake engine, over real loopback sockets.

mod serve_common;

use forward_serve::api::Config;
use forward_serve::engine::ChatMessage;
use forward_serve::fake::{chat_text, expected_text};
use serde_json::{json, Value};
use serve_common::*;
use std::time::{Duration, Instant};

/// Concatenate the text of an OpenAI SSE stream; returns (text, finish_reason, saw [DONE]).
fn join_stream(events: &[String], chat: bool) -> (String, Option<String>, bool) {
    let mut text = String::new();
    let mut finish = None;
    let mut done = false;
    for e in events {
        if e == "[DONE]" {
            done = true;
            continue;
        }
        assert!(!done, "event after [DONE]");
        let v: Value = serde_json::from_str(e).expect("chunk JSON");
        let Some(c) = v["choices"].get(0) else {
            continue;
        };
        let piece = if chat {
            &c["delta"]["content"]
        } else {
            &c["text"]
        };
        if let Some(s) = piece.as_str() {
            text.push_str(s);
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    (text, finish, done)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_models_metrics() {
    let s = TestServer::default().await;
    let h = get(s.addr, "/health").await;
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["status"], "ok");
    let m = get(s.addr, "/v1/models").await;
    assert_eq!(m.status, 200);
    let v = m.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "fake");
    assert_eq!(v["data"][0]["object"], "model");
    let nf = get(s.addr, "/nope").await;
    assert_eq!(nf.status, 404);
    err_of(&nf);
    let body = s.metrics().await;
    assert!(
        body.contains("# TYPE forward_serve_requests_total counter"),
        "{body}"
    );
    assert!(
        body.contains("forward_serve_requests_total{endpoint=\"/health\",status=\"200\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("forward_serve_requests_total{endpoint=\"other\",status=\"404\"} 1"),
        "{body}"
    );
    for name in [
        "forward_serve_prompt_tokens_total",
        "forward_serve_generated_tokens_total",
        "forward_serve_decode_tokens_per_second",
        "forward_serve_queue_depth",
        "forward_serve_active_sequences",
        "forward_serve_device_errors_total",
        "forward_serve_speculative_tau",
    ] {
        assert!(
            metric(&body, name).is_some(),
            "metric {name} missing:\n{body}"
        );
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_non_streaming() {
    let s = TestServer::default().await;
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"model": "fake", "prompt": "abc", "max_tokens": 5, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("cmpl-")));
    assert!(v["created"].as_u64().is_some_and(|c| c > 1_600_000_000));
    assert_eq!(v["model"], "fake");
    assert_eq!(v["choices"][0]["text"], "ABCAB");
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
    );
    // EOS ends with "stop" (the fake emits EOS where the prompt has '.').
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "hi.", "max_tokens": 10}),
    )
    .await;
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], "HI");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    // A stop string is not included; array form too; prompt as one string in an array.
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "abcd", "max_tokens": 10, "stop": "CD"}),
    )
    .await;
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], "AB");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": ["abcd"], "max_tokens": 10, "stop": ["zz", "DA"]}),
    )
    .await;
    assert_eq!(r.json()["choices"][0]["text"], "ABC");
    // Token-id prompt; default max_tokens 16; seed and top_p accepted; speculative accepted (a
    // sampled request decodes plainly).
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": [120, 121], "seed": 7, "top_p": 0.9, "temperature": 0.7, "speculative": {"drafter": "ngram", "draft_max": 4}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["text"], "XY".repeat(8));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_non_streaming_and_streaming() {
    let s = TestServer::default().await;
    let msgs = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]);
    let prompt = chat_text(&[
        ChatMessage {
            role: "system".into(),
            content: "be brief".into(),
        },
        ChatMessage {
            role: "user".into(),
            content: "hello".into(),
        },
    ]);
    let (want, _) = expected_text(&prompt, 12);
    let r = post_json(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": "fake", "messages": msgs, "max_tokens": 12}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("chatcmpl-")));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(v["usage"]["total_tokens"], prompt.len() + 12);
    // Streaming, with usage.
    let r = post_json(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_completion_tokens": 12, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let ev = r.sse();
    let first: Value = serde_json::from_str(&ev[0]).expect("json");
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (text, finish, done) = join_stream(&ev, true);
    assert_eq!(text, want);
    assert_eq!(finish.as_deref(), Some("length"));
    assert!(done, "no [DONE]");
    let usage_chunk: Value = serde_json::from_str(&ev[ev.len() - 2]).expect("json");
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 12);
    assert_eq!(usage_chunk["choices"], json!([]));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_streaming_and_llama_completion() {
    let s = TestServer::default().await;
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "xyzw", "max_tokens": 50, "stream": true, "stop": "ZW"}),
    )
    .await;
    assert_eq!(r.status, 200);
    let ev = r.sse();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let (text, finish, _) = join_stream(&ev, false);
    assert_eq!(text, "XY");
    assert_eq!(finish.as_deref(), Some("stop"));
    for e in &ev[..ev.len() - 1] {
        let v: Value = serde_json::from_str(e).expect("json");
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["model"], "fake");
    }
    // llama.cpp /completion
    let r = post_json(
        s.addr,
        "/completion",
        &json!({"prompt": "ab", "n_predict": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["content"], "ABA");
    assert_eq!(v["tokens_predicted"], 3);
    assert_eq!(v["tokens_evaluated"], 2);
    assert_eq!(v["stop"], true);
    assert_eq!(v["stopped_limit"], true);
    let r = post_json(
        s.addr,
        "/completion",
        &json!({"prompt": "ab.", "n_predict": -1, "stream": true}),
    )
    .await;
    let ev = r.sse();
    let mut text = String::new();
    for e in &ev {
        let v: Value = serde_json::from_str(e).expect("json");
        text.push_str(v["content"].as_str().unwrap_or(""));
    }
    let last: Value = serde_json::from_str(ev.last().expect("events")).expect("json");
    assert_eq!(text, "AB");
    assert_eq!(last["stop"], true);
    assert_eq!(last["stopped_eos"], true);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_detokenize() {
    let s = TestServer::default().await;
    let r = post_json(s.addr, "/tokenize", &json!({"content": "Hé"})).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["tokens"], json!([72, 195, 169]));
    let r = post_json(s.addr, "/detokenize", &json!({"tokens": [72, 195, 169]})).await;
    assert_eq!(r.json()["content"], "Hé");
    let r = post_json(s.addr, "/detokenize", &json!({"tokens": [72, 99999]})).await;
    assert_eq!(r.status, 400);
    assert_eq!(err_of(&r)["param"], "tokens");
    let r = post_json(s.addr, "/tokenize", &json!({"content": 5})).await;
    assert_eq!(r.status, 400);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_4xx_with_openai_error() {
    let s = TestServer::default().await;
    let a = s.addr;
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/completions", "{not json".into(), 400, None),
        ("/v1/completions", "[1,2]".into(), 400, None),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": "5"}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 0}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": -3}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 101}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "model": "gpt-9"}).to_string(),
            404,
            Some("model"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "model": 3}).to_string(),
            400,
            Some("model"),
        ),
        (
            "/v1/completions",
            json!({"prompt": ""}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": []}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 3}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": {"a": 1}}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x".repeat(300)}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "n": 17}).to_string(),
            400,
            Some("n"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "temperature": 5}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "temperature": "hot"}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "top_p": 0}).to_string(),
            400,
            Some("top_p"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "stop": 5}).to_string(),
            400,
            Some("stop"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "stream": "yes"}).to_string(),
            400,
            Some("stream"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 99999]}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"prompt": "hi"}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"content": "hi"}]}).to_string(),
            400,
            Some("messages[0]"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]})
                .to_string(),
            400,
            Some("messages[1].role"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/completion",
            json!({"prompt": "a", "n_predict": 0}).to_string(),
            400,
            Some("n_predict"),
        ),
        (
            "/completion",
            json!({"prompt": 7}).to_string(),
            400,
            Some("prompt"),
        ),
    ];
    for (path, body, status, param) in cases {
        let r = post(a, path, &body).await;
        assert_eq!(r.status, status, "{path} {body}: {}", r.text());
        let e = err_of(&r);
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{path} {body}: {e}");
        }
    }
    // The Ollama chat route checks roles in the same place.
    let r = post(
        a,
        "/api/chat",
        &json!({"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}).to_string(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("messages[0].role"), "{}", r.text());
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": "x".repeat(300)}).to_string(),
    )
    .await;
    assert_eq!(err_of(&r)["code"], "context_length_exceeded");
    // Over the body limit (4096): 413, whether announced by Content-Length or not.
    let big = json!({"prompt": "x".repeat(5000)}).to_string();
    let r = post(a, "/v1/completions", &big).await;
    assert_eq!(r.status, 413, "{}", r.text());
    err_of(&r);
    let mut chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    chunked.extend_from_slice(format!("{:x}\r\n{big}\r\n0\r\n\r\n", big.len()).as_bytes());
    let r = raw(a, &chunked).await;
    assert_eq!(r.status, 413, "{}", r.text());
    // The server still works afterwards, and counted the 4xx.
    let r = post_json(
        a,
        "/v1/completions",
        &json!({"prompt": "ok", "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.json()["choices"][0]["text"], "OK");
    let m = s.metrics().await;
    assert!(
        m.contains("forward_serve_requests_total{endpoint=\"/v1/completions\",status=\"400\"}"),
        "{m}"
    );
    assert!(
        m.contains("forward_serve_requests_total{endpoint=\"/v1/completions\",status=\"413\"} 2"),
        "{m}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_streams_none_lost_or_mixed() {
    let cfg = Config {
        max_queue: 256,
        max_batch: 16,
        ..small_cfg()
    };
    let s = TestServer::start(cfg, 256, Duration::ZERO).await;
    let addr = s.addr;
    let mut tasks = Vec::new();
    for i in 0..200usize {
        tasks.push(tokio::spawn(async move {
            // Distinct prompts; some end on EOS ('.'), lengths vary.
            let prompt = if i % 7 == 0 {
                format!("r{i}q.")
            } else {
                format!("req{i}-{}", "abcdefghij".get(..i % 10).unwrap_or(""))
            };
            let max = 5 + i % 23;
            let chat = i % 2 == 1;
            let r = if chat {
                post_json(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": max, "stream": true})).await
            } else {
                post_json(addr, "/v1/completions", &json!({"prompt": prompt, "max_tokens": max, "stream": true})).await
            };
            assert_eq!(r.status, 200, "request {i}: {}", r.text());
            let (text, finish, done) = join_stream(&r.sse(), chat);
            let full_prompt = if chat {
                chat_text(&[ChatMessage {
                    role: "user".into(),
                    content: prompt.clone(),
                }])
            } else {
                prompt.clone()
            };
            let (want, eos) = expected_text(&full_prompt, max);
            assert_eq!(text, want, "request {i} ({prompt:?}) got another text");
            assert_eq!(finish.as_deref(), Some(if eos { "stop" } else { "length" }), "request {i}");
            assert!(done, "request {i}: no [DONE]");
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let m = s.metrics().await;
    assert_eq!(
        metric(&m, "forward_serve_active_sequences"),
        Some(0.0),
        "{m}"
    );
    assert_eq!(metric(&m, "forward_serve_queue_depth"), Some(0.0), "{m}");
    assert!(
        m.contains("forward_serve_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 100"),
        "{m}"
    );
    s.stop().await;
}

async fn wait_metric(s: &TestServer, name: &str, pred: impl Fn(f64) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let m = s.metrics().await;
        if metric(&m, name).is_some_and(&pred) {
            return m;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "metric {name} never matched:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_generation() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = TestServer::start(small_cfg(), 4096, Duration::from_millis(10)).await;
    let body = json!({"prompt": "long", "max_tokens": 100, "stream": true}).to_string();
    let mut c = tokio::net::TcpStream::connect(s.addr)
        .await
        .expect("connect");
    c.write_all(&request_bytes(
        "POST",
        "/v1/completions",
        Some(body.as_bytes()),
        &[],
    ))
    .await
    .expect("write");
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
            .await
            .expect("first chunk")
            .expect("read");
        assert!(n > 0, "closed early");
        got.extend_from_slice(&buf[..n]);
    }
    wait_metric(&s, "forward_serve_active_sequences", |v| v == 1.0).await;
    drop(c);
    // 100 tokens at 10 ms would take a second; the slot must be freed well before.
    let t0 = Instant::now();
    let m = wait_metric(&s, "forward_serve_active_sequences", |v| v == 0.0).await;
    assert!(
        t0.elapsed() < Duration::from_millis(900),
        "cancel took {:?}",
        t0.elapsed()
    );
    assert_eq!(
        metric(&m, "forward_serve_cancelled_total"),
        Some(1.0),
        "{m}"
    );
    assert!(
        metric(&m, "forward_serve_generated_tokens_total").is_some_and(|g| g < 90.0),
        "{m}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_answers_503_with_retry_after() {
    let cfg = Config {
        max_queue: 1,
        max_batch: 1,
        ..small_cfg()
    };
    let s = TestServer::start(cfg, 256, Duration::from_millis(5)).await;
    let addr = s.addr;
    let mut tasks = Vec::new();
    for i in 0..6 {
        tasks.push(tokio::spawn(async move {
            post_json(
                addr,
                "/v1/completions",
                &json!({"prompt": format!("p{i}"), "max_tokens": 40}),
            )
            .await
        }));
    }
    let mut ok = 0;
    let mut full = 0;
    for t in tasks {
        let r = t.await.expect("task");
        match r.status {
            200 => ok += 1,
            503 => {
                full += 1;
                assert_eq!(r.header("retry-after"), Some("1"));
                assert_eq!(err_of(&r)["code"], "queue_full");
            }
            s => panic!("status {s}: {}", r.text()),
        }
    }
    // One active + one queued at most: at least 4 of the 6 were turned away.
    assert!(ok >= 1 && full >= 4, "ok {ok} full {full}");
    let m = s.metrics().await;
    assert_eq!(
        metric(&m, "forward_serve_rejected_queue_full_total"),
        Some(full as f64)
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_and_device_error() {
    let cfg = Config {
        request_timeout: Duration::from_millis(200),
        ..small_cfg()
    };
    let s = TestServer::start(cfg, 4096, Duration::from_millis(10)).await;
    let t0 = Instant::now();
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "slow", "max_tokens": 100}),
    )
    .await;
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(err_of(&r)["type"], "timeout_error");
    assert!(t0.elapsed() < Duration::from_millis(900));
    // The fake device fails a prompt holding the special token (id 256): 500, counted.
    let r = post_json(s.addr, "/v1/completions", &json!({"prompt": [65, 256]})).await;
    assert_eq!(r.status, 500, "{}", r.text());
    assert_eq!(err_of(&r)["type"], "server_error");
    let m = s.metrics().await;
    assert_eq!(
        metric(&m, "forward_serve_device_errors_total"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(metric(&m, "forward_serve_timeouts_total"), Some(1.0), "{m}");
    // The timed-out sequence is dropped by the scheduler on its next turn, which on a loaded
    // machine can come after the 504 has been sent: it must be gone within a bound, not at once.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut m = m;
    while metric(&m, "forward_serve_active_sequences") != Some(0.0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        m = s.metrics().await;
    }
    assert_eq!(
        metric(&m, "forward_serve_active_sequences"),
        Some(0.0),
        "{m}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_connection_cancels_non_streaming_generation() {
    use tokio::io::AsyncWriteExt;
    let s = TestServer::start(small_cfg(), 4096, Duration::from_millis(10)).await;
    let body = json!({"prompt": "long", "max_tokens": 100}).to_string();
    let mut c = tokio::net::TcpStream::connect(s.addr)
        .await
        .expect("connect");
    c.write_all(&request_bytes(
        "POST",
        "/v1/completions",
        Some(body.as_bytes()),
        &[],
    ))
    .await
    .expect("write");
    wait_metric(&s, "forward_serve_active_sequences", |v| v == 1.0).await;
    drop(c);
    let t0 = Instant::now();
    let m = wait_metric(&s, "forward_serve_active_sequences", |v| v == 0.0).await;
    assert!(
        t0.elapsed() < Duration::from_millis(900),
        "cancel took {:?}",
        t0.elapsed()
    );
    assert_eq!(
        metric(&m, "forward_serve_cancelled_total"),
        Some(1.0),
        "{m}"
    );
    s.stop().await;
}

/// DFlash drafting through the scheduler, over the fake engine's stand-in draft (its own
/// continuation, every seventh byte wrong): greedy requests drafting with it, with n-gram drafts
/// and plainly, all at once, return the plain text; its rounds, accepted drafts and τ are
/// counted under `drafter="dflash"`, no proposal fails (the draft context follows every
/// commit), and a server default of DFlash applies to requests that do not say. A server
/// without a draft answers a request for one with a 400 naming `speculative`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dflash_drafts_through_the_scheduler_return_the_plain_text() {
    let cfg = || Config {
        max_batch: 16,
        max_queue: 32,
        ..small_cfg()
    };
    let s = TestServer::start_engine(
        cfg(),
        256,
        forward_serve::fake::FakeEngine::new(16, Duration::ZERO).with_dflash(true),
    )
    .await;
    // Nine sequences: seven rows of each pass are left for drafts.
    let prompts = ["abcdefg", "hello world", "the cat sat on the mat"];
    let mut tasks = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        for spec in [
            json!(false),
            json!({"drafter": "dflash", "draft_max": 3 + i * 5}),
            json!({"drafter": "ngram"}),
        ] {
            let addr = s.addr;
            let p = p.to_string();
            tasks.push(tokio::spawn(async move {
                let r = post_json(
                    addr,
                    "/v1/completions",
                    &json!({"prompt": p, "max_tokens": 60, "temperature": 0, "speculative": spec}),
                )
                .await;
                assert_eq!(r.status, 200, "{}", r.text());
                (p, r.json())
            }));
        }
    }
    for t in tasks {
        let (p, v) = t.await.expect("join");
        let (want, _) = expected_text(&p, 60);
        assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()), "{p}");
    }
    let body = s.metrics().await;
    let dflash =
        |name: &str| metric(&body, &format!("{name}{{drafter=\"dflash\"}}")).unwrap_or(-1.0);
    let (rounds, accepted, tau) = (
        dflash("forward_serve_speculative_drafter_rounds_total"),
        dflash("forward_serve_speculative_drafter_accepted_total"),
        dflash("forward_serve_speculative_drafter_tau"),
    );
    eprintln!("dflash: {rounds} rounds, {accepted} accepted, tau {tau}");
    assert!(rounds > 0.0 && accepted > 0.0, "{body}");
    assert!((tau - (1.0 + accepted / rounds)).abs() < 1e-9, "{body}");
    assert!(tau > 1.5, "the fake draft is mostly right: {body}");
    assert_eq!(
        dflash("forward_serve_speculative_drafter_errors_total"),
        0.0,
        "{body}"
    );
    let ngram = metric(
        &body,
        "forward_serve_speculative_drafter_rounds_total{drafter=\"ngram\"}",
    );
    assert!(ngram.is_some_and(|r| r > 0.0), "{body}");
    // The drafters' rounds add up to all speculative rounds.
    let all = metric(&body, "forward_serve_speculative_rounds_total").unwrap_or(0.0);
    assert_eq!(all, rounds + ngram.unwrap_or(0.0), "{body}");
    // Sampled and streamed requests draft with it too.
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "abcd", "max_tokens": 30, "temperature": 0, "stream": true, "speculative": {"drafter": "dflash"}}),
    )
    .await;
    let text: String = r
        .sse()
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, expected_text("abcd", 30).0);
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "sampled", "max_tokens": 50, "temperature": 0.8, "seed": 3, "speculative": {"drafter": "dflash"}}),
    )
    .await;
    assert_eq!(
        r.json()["choices"][0]["text"].as_str(),
        Some(expected_text("sampled", 50).0.as_str())
    );
    // `"type"` names the drafter too; it drafts like `"drafter"` ...
    let before = metric(
        &s.metrics().await,
        "forward_serve_speculative_drafter_rounds_total{drafter=\"dflash\"}",
    )
    .unwrap_or(0.0);
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "abcd", "max_tokens": 30, "temperature": 0, "speculative": {"type": "dflash"}}),
    )
    .await;
    assert_eq!(
        r.json()["choices"][0]["text"].as_str(),
        Some(expected_text("abcd", 30).0.as_str())
    );
    let after = metric(
        &s.metrics().await,
        "forward_serve_speculative_drafter_rounds_total{drafter=\"dflash\"}",
    )
    .unwrap_or(0.0);
    assert!(
        after > before,
        "no DFlash rounds for `type`: {before} -> {after}"
    );
    // ... and the two may not disagree.
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "abc", "speculative": {"type": "dflash", "drafter": "ngram"}}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(err_of(&r)["param"], "speculative");
    assert!(r.text().contains("speculative.type"), "{}", r.text());
    s.stop().await;

    // `--speculate dflash`: requests that do not say draft with DFlash.
    let s = TestServer::start_engine(
        Config {
            speculate: Some(forward_serve::scheduler::Speculate::dflash(4)),
            ..cfg()
        },
        256,
        forward_serve::fake::FakeEngine::new(16, Duration::ZERO).with_dflash(true),
    )
    .await;
    for spec in [Value::Null, json!(true), json!({"draft_max": 2})] {
        let r = post_json(
            s.addr,
            "/v1/completions",
            &json!({"prompt": "hello world", "max_tokens": 40, "temperature": 0, "speculative": spec}),
        )
        .await;
        assert_eq!(
            r.json()["choices"][0]["text"].as_str(),
            Some(expected_text("hello world", 40).0.as_str())
        );
    }
    let body = s.metrics().await;
    assert!(
        metric(
            &body,
            "forward_serve_speculative_drafter_rounds_total{drafter=\"dflash\"}"
        )
        .is_some_and(|r| r >= 3.0),
        "{body}"
    );
    assert_eq!(
        metric(
            &body,
            "forward_serve_speculative_drafter_rounds_total{drafter=\"ngram\"}"
        ),
        Some(0.0),
        "{body}"
    );
    s.stop().await;

    // No draft: a 400 naming the field, for the OpenAI, llama.cpp and Ollama routes alike.
    let s = TestServer::start(cfg(), 256, Duration::ZERO).await;
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "abc", "speculative": {"drafter": "dflash"}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "speculative": {"drafter": "dflash", "draft_max": 4}}),
        ),
        (
            "/completion",
            json!({"prompt": "abc", "speculative": {"drafter": "dflash"}}),
        ),
    ] {
        let r = post_json(s.addr, path, &body).await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        let e = err_of(&r);
        assert_eq!(e["param"], "speculative", "{path}");
        assert!(
            e["message"].as_str().is_some_and(|m| m.contains("--draft")),
            "{path}: {e}"
        );
    }
    let body = s.metrics().await;
    assert!(
        body.contains("forward_serve_speculative_drafter_rounds_total{drafter=\"dflash\"} 0"),
        "{body}"
    );
    s.stop().await;
}

/// Greedy speculative decoding (n-gram drafts verified as extra rows of the batched pass) returns
/// exactly the plain greedy text — per request and per server — and τ shows up in /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_greedy_equals_plain_and_reports_tau() {
    let s = TestServer::start(
        Config {
            max_batch: 16,
            ..small_cfg()
        },
        256,
        Duration::ZERO,
    )
    .await;
    // The fake continues a prompt cyclically, so after one cycle the n-gram drafter hits.
    let prompts = ["abcdefg", "hello world", "xyz", "the cat sat on the mat"];
    let mut tasks = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        for spec in [
            json!(false),
            json!({"drafter": "ngram", "draft_max": 1 + i * 4}),
        ] {
            let addr = s.addr;
            let p = p.to_string();
            tasks.push(tokio::spawn(async move {
                let r = post_json(
                    addr,
                    "/v1/completions",
                    &json!({"prompt": p, "max_tokens": 60, "temperature": 0, "speculative": spec}),
                )
                .await;
                assert_eq!(r.status, 200, "{}", r.text());
                (p, r.json())
            }));
        }
    }
    for t in tasks {
        let (p, v) = t.await.expect("join");
        let (want, _) = expected_text(&p, 60);
        assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()), "{p}");
        assert_eq!(v["usage"]["completion_tokens"], 60);
    }
    let body = s.metrics().await;
    let rounds = metric(&body, "forward_serve_speculative_rounds_total").unwrap_or(0.0);
    let accepted = metric(&body, "forward_serve_speculative_accepted_total").unwrap_or(0.0);
    let tau = metric(&body, "forward_serve_speculative_tau").unwrap_or(0.0);
    assert!(rounds > 0.0 && accepted > 0.0, "{body}");
    assert!((tau - (1.0 + accepted / rounds)).abs() < 1e-9, "{body}");
    assert!(
        tau > 2.0,
        "the cyclic fake should accept most drafts: {body}"
    );
    // Streaming with speculation gives the same text too.
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "abcd", "max_tokens": 30, "temperature": 0, "stream": true, "speculative": true}),
    )
    .await;
    let text: String = r
        .sse()
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, expected_text("abcd", 30).0);
    // A sampled request speculates with the rejection-sampling rule; the fake's logits (50 vs 0)
    // leave no real choice, so its text is still the expected one and more rounds are counted.
    let rounds_before = metric(&s.metrics().await, "forward_serve_speculative_rounds_total");
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "sampled", "max_tokens": 50, "temperature": 0.8, "top_p": 0.95, "seed": 3, "speculative": {"draft_max": 5}}),
    )
    .await;
    assert_eq!(
        r.json()["choices"][0]["text"].as_str(),
        Some(expected_text("sampled", 50).0.as_str())
    );
    assert!(
        metric(&s.metrics().await, "forward_serve_speculative_rounds_total") > rounds_before,
        "no speculative round for a sampled request"
    );
    // Bad settings are 400s naming the field.
    for bad in [
        json!({"drafter": "eagle"}),
        json!({"draft_max": 0}),
        json!({"draft_max": 16}),
        json!({"k": 4}),
        json!("ngram"),
    ] {
        let r = post_json(
            s.addr,
            "/v1/completions",
            &json!({"prompt": "abc", "speculative": bad}),
        )
        .await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert_eq!(err_of(&r)["param"], "speculative", "{bad}");
    }
    s.stop().await;

    // Per server: every greedy request speculates; `"speculative": false` opts out.
    let s = TestServer::start(
        Config {
            speculate: Some(forward_serve::scheduler::Speculate::ngram(6)),
            ..small_cfg()
        },
        256,
        Duration::ZERO,
    )
    .await;
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "server side", "max_tokens": 40, "temperature": 0}),
    )
    .await;
    assert_eq!(
        r.json()["choices"][0]["text"].as_str(),
        Some(expected_text("server side", 40).0.as_str())
    );
    let body = s.metrics().await;
    assert!(
        metric(&body, "forward_serve_speculative_rounds_total").unwrap_or(0.0) > 0.0,
        "{body}"
    );
    let before = metric(&body, "forward_serve_speculative_rounds_total");
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "opt out", "max_tokens": 40, "temperature": 0, "speculative": false}),
    )
    .await;
    assert_eq!(
        r.json()["choices"][0]["text"].as_str(),
        Some(expected_text("opt out", 40).0.as_str())
    );
    let body = s.metrics().await;
    assert_eq!(
        metric(&body, "forward_serve_speculative_rounds_total"),
        before
    );
    s.stop().await;
}

/// A prompt longer than one prefill chunk is fed in chunks and still yields the right text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompt_prefills_in_chunks() {
    let s = TestServer::start(small_cfg(), 1024, Duration::ZERO).await;
    let prompt: String = (0..300).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 40, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["choices"][0]["text"].as_str(),
        Some(expected_text(&prompt, 40).0.as_str())
    );
    assert_eq!(r.json()["usage"]["prompt_tokens"], 300);
    s.stop().await;
}
