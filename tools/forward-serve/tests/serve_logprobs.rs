//! Log-probabilities, `echo`, scoring with `max_tokens: 0`, logit adjustments and the request
//! field table, against the fake engine (whose logits are known exactly: one logit of 50 over
//! 257, so a hit has log-probability −ln(1 + 256·e⁻⁵⁰) ≈ 0 and a miss −50 − that).

mod serve_common;

use serde_json::{json, Value};
use serve_common::*;

/// The fake's log-probability of the token it predicts, and of any other.
fn hit() -> f64 {
    -(1.0 + 256.0 * (-50f64).exp()).ln()
}
fn miss() -> f64 {
    -50.0 + hit()
}

fn close(v: &Value, want: f64) -> bool {
    v.as_f64().is_some_and(|x| (x - want).abs() < 1e-4)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_scores_the_prompt_and_max_tokens_zero_generates_nothing() {
    let s = TestServer::default().await;
    let a = s.addr;
    // Inside a prompt the fake predicts that each byte repeats: a·b·b·a·. scores miss, hit,
    // miss, miss after the unscored first byte.
    let r = post_json(
        a,
        "/v1/completions",
        &json!({"prompt": "abba.", "max_tokens": 0, "echo": true, "logprobs": 2}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let c = &v["choices"][0];
    assert_eq!(c["text"], "abba.");
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    let lp = &c["logprobs"];
    assert_eq!(lp["tokens"], json!(["a", "b", "b", "a", "."]));
    assert_eq!(lp["text_offset"], json!([0, 1, 2, 3, 4]));
    let tl = lp["token_logprobs"].as_array().expect("token_logprobs");
    assert!(tl[0].is_null() && lp["top_logprobs"][0].is_null(), "{lp}");
    for (i, want) in [(1, miss()), (2, hit()), (3, miss()), (4, miss())] {
        assert!(close(&tl[i], want), "token {i}: {} vs {want}", tl[i]);
    }
    // Top 2 after "a": "a" (the prediction), then the lowest id of the rest ("\0"); the
    // sampled token "b" joins them, as OpenAI reports it.
    let top = lp["top_logprobs"][1].as_object().expect("top dict");
    assert_eq!(top.len(), 3, "{top:?}");
    assert!(close(&top["a"], hit()) && close(&top["\u{0}"], miss()) && close(&top["b"], miss()));
    // The token's own entry equals its top entry bit for bit where it is the top one
    // (lm-evaluation-harness compares them for `is_greedy`).
    assert_eq!(lp["top_logprobs"][2]["b"], tl[2]);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_logprobs_plain_echoed_streamed_and_cut_at_stop() {
    let s = TestServer::default().await;
    let a = s.addr;
    // Generation: "ab" continues A, B, A.
    let r = post_json(
        a,
        "/v1/completions",
        &json!({"prompt": "ab", "max_tokens": 3, "logprobs": 1, "temperature": 0}),
    )
    .await;
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(v["choices"][0]["text"], "ABA");
    assert_eq!(lp["tokens"], json!(["A", "B", "A"]));
    assert_eq!(lp["text_offset"], json!([0, 1, 2]));
    assert!(lp["token_logprobs"]
        .as_array()
        .is_some_and(|t| t.iter().all(|x| close(x, hit()))));
    // With echo the prompt comes first and the completion's offsets follow its text.
    let r = post_json(
        a,
        "/v1/completions",
        &json!({"prompt": "ab", "max_tokens": 2, "logprobs": 0, "echo": true, "temperature": 0}),
    )
    .await;
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(v["choices"][0]["text"], "abAB");
    assert_eq!(lp["tokens"], json!(["a", "b", "A", "B"]));
    assert_eq!(lp["text_offset"], json!([0, 1, 2, 3]));
    // logprobs 0: only the token itself in top_logprobs.
    assert_eq!(lp["top_logprobs"][2].as_object().map(|m| m.len()), Some(1));
    // A stop string is not shown, and neither are its tokens' log-probabilities.
    let r = post_json(
        a,
        "/v1/completions",
        &json!({"prompt": "abcd", "max_tokens": 4, "logprobs": 1, "stop": "CD", "temperature": 0}),
    )
    .await;
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], "AB");
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!(["A", "B"]));
    // Streamed: the chunks' tokens and offsets put together equal the whole answer's.
    let body = json!({"prompt": "hello", "max_tokens": 5, "logprobs": 2, "echo": true, "temperature": 0, "stream": true});
    let r = post_json(a, "/v1/completions", &body).await;
    let mut text = String::new();
    let (mut tokens, mut offsets) = (Vec::new(), Vec::new());
    for e in r.sse().iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).expect("chunk json");
        let ch = &c["choices"][0];
        text.push_str(ch["text"].as_str().unwrap_or(""));
        if let Some(t) = ch["logprobs"]["tokens"].as_array() {
            tokens.extend(t.iter().cloned());
            offsets.extend(
                ch["logprobs"]["text_offset"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
            );
        }
    }
    let mut whole_body = body.clone();
    whole_body["stream"] = json!(false);
    let whole = post_json(a, "/v1/completions", &whole_body).await.json();
    assert_eq!(text, "helloHELLO");
    assert_eq!(whole["choices"][0]["text"], json!(text));
    assert_eq!(whole["choices"][0]["logprobs"]["tokens"], json!(tokens));
    assert_eq!(
        whole["choices"][0]["logprobs"]["text_offset"],
        json!(offsets)
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs_and_top_logprobs_streamed_and_not() {
    let s = TestServer::default().await;
    let a = s.addr;
    let body = json!({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "logprobs": true, "top_logprobs": 3,
    });
    let v = post_json(a, "/v1/chat/completions", &body).await.json();
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .cloned()
        .expect("logprobs.content");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
    assert_eq!(content.len(), 3);
    let joined: String = content.iter().filter_map(|e| e["token"].as_str()).collect();
    assert_eq!(joined, text);
    for e in &content {
        assert!(close(&e["logprob"], hit()), "{e}");
        assert_eq!(e["top_logprobs"].as_array().map(Vec::len), Some(3));
        assert_eq!(e["top_logprobs"][0]["token"], e["token"]);
        assert_eq!(
            e["bytes"],
            json!(e["token"].as_str().unwrap_or("").as_bytes())
        );
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post_json(a, "/v1/chat/completions", &streamed).await;
    let mut entries = Vec::new();
    for e in r.sse().iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).expect("chunk json");
        if let Some(x) = c["choices"][0]["logprobs"]["content"].as_array() {
            entries.extend(x.iter().cloned());
        }
    }
    assert_eq!(entries, content);
    // Without `logprobs: true` there are none.
    let v = post_json(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await
    .json();
    assert!(v["choices"][0]["logprobs"].is_null());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_and_penalties_change_the_choice() {
    let s = TestServer::default().await;
    let a = s.addr;
    // "ab" → "ABA" greedily; a bias of −100 on "B" (66) leaves 50 − 100 there, so the second
    // token becomes the lowest id of the zeros, "\0".
    let v = post_json(
        a,
        "/v1/completions",
        &json!({"prompt": "ab", "max_tokens": 2, "temperature": 0, "logit_bias": {"66": -100}}),
    )
    .await
    .json();
    assert_eq!(v["choices"][0]["text"], "A\u{0}");
    // A frequency penalty of 2 cannot outweigh a margin of 50; the text is unchanged.
    let v = post_json(
        a,
        "/v1/completions",
        &json!({"prompt": "aaaa", "max_tokens": 4, "temperature": 0, "frequency_penalty": 2}),
    )
    .await
    .json();
    assert_eq!(v["choices"][0]["text"], "AAAA");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_field_is_honoured_or_refused_by_name() {
    let s = TestServer::default().await;
    let a = s.addr;
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        b
    };
    let cmpl = |extra: Value| {
        let mut b = json!({"prompt": "hi", "max_tokens": 2});
        if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        b
    };
    let refused = [
        (
            "/v1/completions",
            cmpl(json!({"frobnicate": 1})),
            "frobnicate",
        ),
        ("/v1/completions", cmpl(json!({"n": 17})), "n"),
        ("/v1/completions", cmpl(json!({"best_of": 3})), "best_of"),
        ("/v1/completions", cmpl(json!({"suffix": "end"})), "suffix"),
        ("/v1/completions", cmpl(json!({"logprobs": 6})), "logprobs"),
        (
            "/v1/completions",
            cmpl(json!({"max_tokens": 0})),
            "max_tokens",
        ),
        (
            "/v1/completions",
            cmpl(json!({"logit_bias": {"999": 1}})),
            "logit_bias",
        ),
        (
            "/v1/completions",
            cmpl(json!({"logit_bias": {"1": 101}})),
            "logit_bias",
        ),
        (
            "/v1/completions",
            cmpl(json!({"presence_penalty": 3})),
            "presence_penalty",
        ),
        ("/v1/completions", cmpl(json!({"top_k": -2})), "top_k"),
        ("/v1/chat/completions", chat(json!({"echo": true})), "echo"),
        (
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 2})),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_object"}})),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})),
            "tools",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tool_choice": "required"})),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"audio": {"voice": "x"}})),
            "audio",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"reasoning_effort": "low"})),
            "reasoning_effort",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"store": true})),
            "store",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"modalities": ["text", "audio"]})),
            "modalities",
        ),
        ("/v1/chat/completions", chat(json!({"n": 0})), "n"),
        (
            "/completion",
            json!({"prompt": "hi", "n_probs": 3}),
            "n_probs",
        ),
        (
            "/v1/completions",
            cmpl(json!({"logit_bias": {"66": -1}, "speculative": true})),
            "speculative",
        ),
    ];
    for (path, body, param) in refused {
        let r = post_json(a, path, &body).await;
        assert_eq!(r.status, 400, "{path} {body}: {}", r.text());
        assert_eq!(err_of(&r)["param"], param, "{path} {body}");
    }
    let accepted = [
        (
            "/v1/completions",
            cmpl(json!({"n": 1, "best_of": 1, "suffix": "", "user": "u1", "echo": false})),
        ),
        (
            "/v1/completions",
            cmpl(json!({"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}})),
        ),
        (
            "/v1/completions",
            cmpl(json!({"top_k": -1, "top_p": 0.5, "seed": 3})),
        ),
        (
            "/v1/chat/completions",
            chat(json!({
                "n": 1, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                "parallel_tool_calls": false, "modalities": ["text"], "store": false,
                "service_tier": "auto", "user": "u", "metadata": {"k": "v"},
                "prompt_cache_key": "p", "safety_identifier": "s", "audio": null,
            })),
        ),
        (
            "/completion",
            json!({"prompt": "hi", "n_predict": 2, "cache_prompt": true}),
        ),
    ];
    for (path, body) in accepted {
        let r = post_json(a, path, &body).await;
        assert_eq!(r.status, 200, "{path} {body}: {}", r.text());
    }
    s.stop().await;
}

/// Table-driven: every field the table refuses outright gets a 400 naming it when set; every
/// field accepted only at its no-op value gets one at another value (the list below must cover
/// the table, so a field added without a case fails here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refused_or_default_only_field_of_the_table_is_a_400_naming_it() {
    use forward_serve::fields::{self, Use};
    let s = TestServer::default().await;
    let a = s.addr;
    // A value each default-only field cannot take.
    let non_default = |name: &str| -> Value {
        match name {
            "n" => json!(17),
            "best_of" => json!(2),
            "suffix" => json!("tail"),
            "response_format" => json!({"type": "json_object"}),
            "tools" | "functions" => json!([{"type": "function", "function": {"name": "f"}}]),
            "tool_choice" | "function_call" => json!("required"),
            "parallel_tool_calls" => json!("yes"),
            "modalities" => json!(["audio"]),
            "store" => json!(true),
            "service_tier" => json!("flex"),
            other => panic!("no non-default value for the default-only field `{other}`"),
        }
    };
    for (path, table, base) in [
        (
            "/v1/completions",
            fields::COMPLETIONS,
            json!({"prompt": "hi", "max_tokens": 2}),
        ),
        (
            "/v1/chat/completions",
            fields::CHAT,
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ),
        (
            "/completion",
            fields::LLAMA,
            json!({"prompt": "hi", "n_predict": 2}),
        ),
    ] {
        let mut cases = vec![("frobnicate".to_string(), json!(1))];
        for &(name, how) in table {
            match how {
                Use::Refused(_) => cases.push((name.to_string(), json!("x"))),
                Use::DefaultOnly => cases.push((name.to_string(), non_default(name))),
                Use::Honoured | Use::Label => {}
            }
        }
        for (name, value) in cases {
            let mut body = base.clone();
            body[&name] = value;
            let r = post_json(a, path, &body).await;
            assert_eq!(r.status, 400, "{path} {body}: {}", r.text());
            assert_eq!(err_of(&r)["param"], name.as_str(), "{path} {body}");
        }
        // And the base request itself is fine.
        assert_eq!(post_json(a, path, &base).await.status, 200, "{path}");
    }
    s.stop().await;
}

/// `docs/serving.md` lists every field each route reads, in its field table.
#[test]
fn the_docs_table_lists_every_field() {
    let doc = include_str!("../../../docs/serving.md");
    let table = doc
        .split("## Request fields")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/serving.md has a `## Request fields` section");
    for (route, fields) in [
        ("/v1/completions", forward_serve::fields::COMPLETIONS),
        ("/v1/chat/completions", forward_serve::fields::CHAT),
        ("/completion", forward_serve::fields::LLAMA),
    ] {
        for (name, _) in fields {
            let row_has = table
                .lines()
                .filter(|l| l.starts_with(&format!("| `{name}`")))
                .any(|l| l.contains(route) || l.contains("all"));
            assert!(row_has, "docs/serving.md: no row for `{name}` of {route}");
        }
    }
}
