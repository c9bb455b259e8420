//! forward-serve end to end with the real SmolLM2-135M-Instruct: the server's greedy completion
//! equals the model layer's own greedy generation; 16 concurrent greedy requests (one batched
//! pass per turn) each return exactly what they return alone; greedy speculative decoding returns
//! exactly the plain greedy text.

mod serve_common;
#[path = "../../../tests/support/smollm2.rs"]
mod smollm2;

use forward_serve::api::Config;
use forward_serve::engine::{LoadSpec, Loaded};
use serde_json::{json, Value};
use serve_common::*;
use std::path::PathBuf;
use std::time::Duration;
use xdna::cli::ModelArgs;
use xdna::model::load::Backend;

/// The SmolLM2 GGUF: `XDNA_TEST_GGUF`, else the product's own fetch; fails under CI, skips loudly
/// elsewhere (see `tests/support/smollm2.rs` of the xdna package).
fn model_path() -> Option<PathBuf> {
    smollm2::smollm2_gguf()
}

/// The model layer's own greedy generation: prefill, then argmax/step until EOS or `n` tokens.
fn reference_greedy(path: &std::path::Path, prompt: &str, n: usize) -> String {
    use xdna::model::sampling::argmax;
    let opts = xdna::model::load::LoadOptions {
        backend: Backend::Host,
        ..Default::default()
    };
    let (pkg, mut m) = xdna::model::load::open_model(Some(path), 256, &opts).expect("model");
    let ids = pkg.tokenizer().encode(prompt, false);
    let eos = pkg.eos_token_ids().to_vec();
    let mut next = argmax(m.prefill(&ids).expect("prefill"), 0).expect("finite logits");
    let mut out = Vec::new();
    while !eos.contains(&next) && out.len() < n {
        out.push(next);
        if out.len() == n {
            break;
        }
        next = argmax(m.step(next).expect("step"), 0).expect("finite logits");
    }
    pkg.tokenizer().decode(&out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_greedy_matches_model_layer() {
    let Some(path) = model_path() else { return };
    let prompt = "The capital of France is";
    let n = 12;
    let want = {
        let p = path.clone();
        tokio::task::spawn_blocking(move || reference_greedy(&p, prompt, n))
            .await
            .expect("reference")
    };
    assert!(!want.is_empty());
    let loaded = load_real(&path).await;
    let model_id = loaded.codec.model_id().to_string();
    // Tokenizer agreement through the codec.
    let ids = loaded.codec.tokenize(prompt, false).expect("tokenize");
    assert_eq!(loaded.codec.detokenize(&ids), prompt);
    assert_eq!(loaded.codec.eos_ids(), &[2]);
    let cfg = Config {
        request_timeout: Duration::from_secs(300),
        ..Config::default()
    };
    let (addr, tx, server) = serve_loaded(loaded, cfg).await;
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"model": model_id, "prompt": prompt, "max_tokens": n, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()), "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    eprintln!("greedy: {prompt:?} -> {want:?}");
    // Streaming gives the same text.
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": true}),
    )
    .await;
    let text: String = r
        .sse()
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, want);
    // Chat goes through the ChatML template and ends on EOS or the limit.
    let r = post_json(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(
        v["usage"]["prompt_tokens"].as_u64().is_some_and(|p| p > 5),
        "{v}"
    );
    stop_server(tx, server).await;
}

/// The real model through the server's own loader: host backend, 256 positions, 16 sequences.
async fn load_real(path: &std::path::Path) -> Loaded {
    load_real_with(path, 256, 0).await
}

/// The real model with `ctx` positions and a prefix cache of `prefix_cache` sequences.
async fn load_real_with(path: &std::path::Path, ctx: usize, prefix_cache: usize) -> Loaded {
    let spec = LoadSpec {
        model: ModelArgs {
            path: Some(path.to_path_buf()),
            backend: Backend::Host,
            kernels: None,
        },
        ctx,
        max_sequences: 16,
        prefix_cache,
        draft: None,
    };
    tokio::task::spawn_blocking(move || forward_serve::engine::load(&spec))
        .await
        .expect("join")
        .expect("load")
}

/// Start the in-process server on the real model (host backend).
async fn start_real(
    path: &std::path::Path,
    cfg: Config,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), forward_serve::server::ServeError>>,
) {
    serve_loaded(load_real(path).await, cfg).await
}

async fn greedy_text(addr: std::net::SocketAddr, prompt: &str, n: usize, spec: Value) -> String {
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "speculative": spec}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string()
}

/// 16 different prompts: each alone (the server runs one sequence, single-row passes; checked
/// against the model layer's own greedy loop), then all 16 at once (16 rows per pass, prefill
/// chunks interleaved): every text identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_greedy_requests_equal_each_alone() {
    let Some(path) = model_path() else { return };
    let n = 20;
    let prompts = forward_serve::bench::BENCH_PROMPTS;
    let cfg = Config {
        request_timeout: Duration::from_secs(600),
        ..Config::default()
    };
    let (addr, stop, server) = start_real(&path, cfg).await;
    let mut alone = Vec::new();
    for p in prompts {
        alone.push(greedy_text(addr, p, n, Value::Null).await);
    }
    // The alone texts are the model layer's greedy generation (independent reference).
    for i in [0, 7, 15] {
        let (p, pr) = (path.clone(), prompts[i]);
        let want = tokio::task::spawn_blocking(move || reference_greedy(&p, pr, n))
            .await
            .expect("reference");
        assert_eq!(alone[i], want, "prompt {i} {:?}", prompts[i]);
    }
    let before = get(addr, "/metrics").await.text();
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let p = p.to_string();
            tokio::spawn(async move { greedy_text(addr, &p, n, Value::Null).await })
        })
        .collect();
    let mut together = Vec::new();
    for t in tasks {
        together.push(t.await.expect("join"));
    }
    let body = get(addr, "/metrics").await.text();
    for (i, p) in prompts.iter().enumerate() {
        eprintln!("{p:?} -> {:?}", alone[i]);
        assert_eq!(
            together[i], alone[i],
            "prompt {i} {p:?}: concurrent vs alone"
        );
    }
    // The concurrent phase really batched: many rows per decode pass on average.
    let delta =
        |name: &str| metric(&body, name).unwrap_or(0.0) - metric(&before, name).unwrap_or(0.0);
    let (rows, passes) = (
        delta("forward_serve_decode_rows_total"),
        delta("forward_serve_decode_passes_total"),
    );
    eprintln!("concurrent phase: {rows} rows in {passes} passes");
    assert!(
        passes > 0.0 && rows / passes > 12.0,
        "{rows} rows in {passes} passes"
    );
    stop_server(stop, server).await;
}

/// Greedy speculative decoding (n-gram drafts as extra rows of the batched pass, per request and
/// per server) returns the plain greedy text on the real model, alone and next to plain streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_greedy_equals_plain_greedy_on_smollm2() {
    let Some(path) = model_path() else { return };
    let n = 32;
    // Repetitive prompts so prompt lookup finds drafts.
    let prompts = [
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
        "The cat sat on the mat. The dog sat on the log. The cat sat on the",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,",
    ];
    let cfg = Config {
        request_timeout: Duration::from_secs(600),
        ..Config::default()
    };
    let (addr, stop, server) = start_real(&path, cfg).await;
    let mut plain = Vec::new();
    for p in prompts {
        plain.push(greedy_text(addr, p, n, Value::Null).await);
    }
    for (i, p) in prompts.iter().enumerate() {
        let spec = greedy_text(addr, p, n, json!({"drafter": "ngram", "draft_max": 6})).await;
        eprintln!("{p:?} -> {:?}", plain[i]);
        assert_eq!(spec, plain[i], "prompt {i}: speculative alone vs plain");
    }
    // All at once, speculating and plain mixed in the same passes.
    let tasks: Vec<_> = prompts
        .iter()
        .flat_map(|p| [json!(true), json!(false)].map(|s| (p.to_string(), s)))
        .map(|(p, s)| tokio::spawn(async move { (p.clone(), greedy_text(addr, &p, n, s).await) }))
        .collect();
    for t in tasks {
        let (p, text) = t.await.expect("join");
        let i = prompts.iter().position(|q| *q == p).expect("prompt");
        assert_eq!(text, plain[i], "prompt {i}: mixed batch vs plain");
    }
    let body = get(addr, "/metrics").await.text();
    let tau = metric(&body, "forward_serve_speculative_tau").unwrap_or(0.0);
    eprintln!("tau = {tau}");
    assert!(tau > 1.0, "{body}");
    stop_server(stop, server).await;
}

/// A chat's second turn over a long history starts from the first turn's cached state, and the
/// samples of an `n` > 1 request copy the prompt their first sample read: both give exactly what
/// a server without either gives (same text, same log-probabilities), sample `i` being the
/// request with seed `seed + i`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_and_shared_samples_give_the_cold_outputs() {
    let Some(path) = model_path() else { return };
    let cfg = || Config {
        request_timeout: Duration::from_secs(600),
        ..Config::default()
    };
    let (warm, stop_warm, warm_server) =
        serve_loaded(load_real_with(&path, 2048, 4).await, cfg()).await;
    let (cold, stop_cold, cold_server) =
        serve_loaded(load_real_with(&path, 2048, 0).await, cfg()).await;
    let to_json = |m: &[forward_serve::engine::ChatMessage]| -> Vec<Value> {
        m.iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect()
    };
    let chat = forward_serve::bench::long_chat("test", forward_serve::bench::LONG_CHAT_PROMPTS);
    let mut messages = to_json(&chat);
    let turn = |addr, messages: Vec<Value>| async move {
        let r = post_json(
            addr,
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let first = turn(warm, messages.clone()).await;
    let first_text = first["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert_eq!(
        turn(cold, messages.clone()).await["choices"],
        first["choices"]
    );
    messages = to_json(&forward_serve::bench::second_turn(chat, &first_text));
    let before = get(warm, "/metrics").await.text();
    let second = turn(warm, messages.clone()).await;
    let after = get(warm, "/metrics").await.text();
    let second_cold = turn(cold, messages.clone()).await;
    assert_eq!(
        second["choices"], second_cold["choices"],
        "second turn: warm vs cold"
    );
    let prompt_tokens = second["usage"]["prompt_tokens"].as_f64().unwrap_or(0.0);
    let reused = metric(&after, "forward_serve_prefix_cache_tokens_total").unwrap_or(0.0)
        - metric(&before, "forward_serve_prefix_cache_tokens_total").unwrap_or(0.0);
    eprintln!("second turn: {reused} of {prompt_tokens} prompt tokens from the prefix cache");
    assert!(
        prompt_tokens > 500.0 && reused > 0.9 * prompt_tokens - 40.0,
        "{reused} of {prompt_tokens}"
    );

    // n = 3 sampled: sample i equals the n = 1 request seeded seed + i on the cold server.
    let body = |n: usize, seed: u64| json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "seed": seed, "n": n, "logprobs": 1});
    let many = post_json(warm, "/v1/completions", &body(3, 42))
        .await
        .json();
    let choices = many["choices"].as_array().cloned().unwrap_or_default();
    assert_eq!(choices.len(), 3, "{many}");
    for (i, c) in choices.iter().enumerate() {
        let one = post_json(cold, "/v1/completions", &body(1, 42 + i as u64))
            .await
            .json();
        let mut want = one["choices"][0].clone();
        want["index"] = json!(i);
        assert_eq!(c, &want, "sample {i}");
    }
    let texts: std::collections::HashSet<&str> =
        choices.iter().filter_map(|c| c["text"].as_str()).collect();
    assert!(texts.len() > 1, "three samples, one text: {choices:?}");
    let shared = metric(
        &get(warm, "/metrics").await.text(),
        "forward_serve_shared_prompt_samples_total",
    )
    .unwrap_or(0.0);
    assert_eq!(shared, 2.0, "samples 1 and 2 copy sample 0's prompt");
    // A request whose prompt a running sequence holds starts from that sequence's state: B is
    // admitted while A (same prompt, longer answer) is still generating, and answers as cold.
    let running =
        forward_serve::bench::long_chat("running", forward_serve::bench::LONG_CHAT_PROMPTS);
    let running = to_json(&running);
    let ask =
        |max: usize| json!({"messages": running.clone(), "max_tokens": max, "temperature": 0});
    let before = get(warm, "/metrics").await.text();
    let read = |body: &str, name: &str| metric(body, name).unwrap_or(0.0);
    let a_body = ask(200);
    let a = tokio::spawn(async move {
        let r = post_json(warm, "/v1/chat/completions", &a_body).await;
        (r.json(), std::time::Instant::now())
    });
    let start = std::time::Instant::now();
    let prompt_before = read(&before, "forward_serve_prompt_tokens_total");
    // A is generating (its prompt read, a token out); what B reuses is counted from here.
    let mid = loop {
        let now = get(warm, "/metrics").await.text();
        if read(&now, "forward_serve_generated_tokens_total")
            > read(&before, "forward_serve_generated_tokens_total")
            && read(&now, "forward_serve_prompt_tokens_total") > prompt_before + 500.0
        {
            break now;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "A never started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let b = post_json(warm, "/v1/chat/completions", &ask(8))
        .await
        .json();
    let b_done = std::time::Instant::now();
    let after = get(warm, "/metrics").await.text();
    let (a, a_done) = a.await.expect("A");
    assert!(
        b_done < a_done,
        "B ended after A: the running sequence was not what B copied"
    );
    let reused = read(&after, "forward_serve_prefix_cache_tokens_total")
        - read(&mid, "forward_serve_prefix_cache_tokens_total");
    let b_prompt = b["usage"]["prompt_tokens"].as_f64().unwrap_or(0.0);
    assert_eq!(
        reused,
        b_prompt - 1.0,
        "B copies all but its last prompt token from A"
    );
    let b_cold = post_json(cold, "/v1/chat/completions", &ask(8))
        .await
        .json();
    assert_eq!(
        b["choices"], b_cold["choices"],
        "B from a running sequence vs cold"
    );
    assert_eq!(
        a["usage"]["completion_tokens"].as_u64().map(|n| n > 8),
        Some(true),
        "{a}"
    );
    for (stop, server) in [(stop_warm, warm_server), (stop_cold, cold_server)] {
        stop_server(stop, server).await;
    }
}

/// Log-probabilities under greedy speculative decoding come from the verify rows that predicted
/// each token: the same tokens and (to batching's rounding) the same values as plain decoding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_logprobs_equal_plain_ones() {
    let Some(path) = model_path() else { return };
    let (addr, stop, server) = start_real(&path, Config::default()).await;
    let ask = |spec: bool| {
        json!({"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 24, "temperature": 0,
               "logprobs": 3, "speculative": spec})
    };
    let plain = post_json(addr, "/v1/completions", &ask(false)).await.json();
    let spec = post_json(addr, "/v1/completions", &ask(true)).await.json();
    let (p, s) = (
        &plain["choices"][0]["logprobs"],
        &spec["choices"][0]["logprobs"],
    );
    assert_eq!(p["tokens"], s["tokens"]);
    assert_eq!(p["text_offset"], s["text_offset"]);
    let (pl, sl) = (
        p["token_logprobs"].as_array(),
        s["token_logprobs"].as_array(),
    );
    let (Some(pl), Some(sl)) = (pl, sl) else {
        panic!("no token_logprobs: {plain} {spec}");
    };
    assert_eq!(pl.len(), 24);
    for (a, b) in pl.iter().zip(sl) {
        let (a, b) = (
            a.as_f64().unwrap_or(f64::NAN),
            b.as_f64().unwrap_or(f64::NAN),
        );
        assert!((a - b).abs() < 1e-3, "{a} vs {b}");
    }
    let tau = metric(
        &get(addr, "/metrics").await.text(),
        "forward_serve_speculative_tau",
    )
    .unwrap_or(0.0);
    assert!(tau > 1.5, "the prompt should draft well: tau {tau}");
    stop_server(stop, server).await;
}

/// Stop an in-process server and wait (≤ 60 s) for its clean end.
async fn stop_server(
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), forward_serve::server::ServeError>>,
) {
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(60), server)
        .await
        .expect("stop")
        .expect("join")
        .expect("clean stop");
}

/// llama-quantize's Q4_K_M of the default model (q4_K, q5_0, q6_K and q8_0 matrices read from
/// their own rows), made with llama.cpp from `XDNA_LLAMA_CPP_BIN` (`.ci/run` builds it; without
/// it the test skips loudly, and fails under CI): None when unavailable.
fn q4_k_m_file(default: &std::path::Path) -> Option<PathBuf> {
    let Some(bin) = std::env::var_os("XDNA_LLAMA_CPP_BIN") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "XDNA_LLAMA_CPP_BIN is unset under CI (.ci/run builds llama.cpp and sets it)"
        );
        eprintln!("\n!!!!!!!! SKIPPED: llama.cpp unavailable; run tools/llama-cpp/build.sh and set XDNA_LLAMA_CPP_BIN !!!!!!!!\n");
        return None;
    };
    let out =
        std::env::temp_dir().join(format!("forward-serve-{}-Q4_K_M.gguf", std::process::id()));
    let run = std::process::Command::new(PathBuf::from(bin).join("llama-quantize"))
        .arg("--allow-requantize")
        .arg(default)
        .arg(&out)
        .arg("Q4_K_M")
        .output()
        .expect("run llama-quantize");
    assert!(
        run.status.success(),
        "llama-quantize failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    Some(out)
}

/// A Q4_K_M file served: each greedy completion is the model layer's own greedy text for the
/// file, and four at once (batched rows of the ggml block kernels) return what each returns alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_q4_k_m_file_serves_the_model_layers_greedy_text_alone_and_batched() {
    let Some(default) = model_path() else { return };
    let Some(path) = q4_k_m_file(&default) else {
        return;
    };
    let n = 16;
    let prompts = &forward_serve::bench::BENCH_PROMPTS[..4];
    let cfg = Config {
        request_timeout: Duration::from_secs(600),
        ..Config::default()
    };
    let (addr, stop, server) = start_real(&path, cfg).await;
    let mut alone = Vec::new();
    for p in prompts {
        alone.push(greedy_text(addr, p, n, Value::Null).await);
    }
    for (i, p) in prompts.iter().enumerate() {
        let (file, pr) = (path.clone(), *p);
        let want = tokio::task::spawn_blocking(move || reference_greedy(&file, pr, n))
            .await
            .expect("reference");
        assert_eq!(alone[i], want, "prompt {i} {p:?}");
    }
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let p = p.to_string();
            tokio::spawn(async move { greedy_text(addr, &p, n, Value::Null).await })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.expect("join"), alone[i], "prompt {i} batched");
    }
    stop_server(stop, server).await;
    let _ = std::fs::remove_file(&path);
}
