//! `xdna run --speculate` and `xdna spec-acceptance` end to end on the real SmolLM2.

#[path = "model_common.rs"]
mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;

fn xdna(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(args)
        .env("XDNA_BACKEND", "host")
        .output()
        .expect("run xdna");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const LIST: &str = "1. apple\n2. banana\n3. cherry\n4. date\n5. elderberry\n6.";
const CODE: &str =
    "def area(r):\n    return 3.14159 * r * r\n\ndef area(r):\n    return 3.14159 * r * r\n\ndef area(r):";

#[test]
fn run_speculate_prints_the_plain_text_and_the_statistics() {
    let Some(g) = common::smollm2_gguf() else {
        return;
    };
    let g = g.to_string_lossy().into_owned();
    for prompt in [LIST, CODE] {
        let base = [
            "run",
            "--model",
            &g,
            "--prompt",
            prompt,
            "--max-tokens",
            "40",
        ];
        let (ok, plain, err) = xdna(&base);
        assert!(ok, "{err}");
        let draft = format!("draft:{g}");
        for drafter in ["ngram", draft.as_str(), "layerskip:24"] {
            let mut args = base.to_vec();
            args.extend(["--speculate", drafter, "--draft-max", "6"]);
            let (ok, out, err) = xdna(&args);
            assert!(ok, "{drafter}: {err}");
            assert_eq!(
                out, plain,
                "{drafter}: speculative text differs from plain greedy"
            );
            // The stats line, then the speculative statistics.
            let stats_at = err.find("[stats] prompt").expect("stats line");
            for needle in [
                "[spec] rounds",
                "tau ",
                "[spec] per-position acceptance [",
                "[spec] acceptance-length histogram",
            ] {
                let at = err
                    .find(needle)
                    .unwrap_or_else(|| panic!("{needle}: {err}"));
                assert!(at > stats_at, "{needle} before the stats line: {err}");
            }
        }
    }
    // Sampled mode: reproducible by seed.
    let sampled = [
        "run",
        "--model",
        &g,
        "--prompt",
        LIST,
        "--max-tokens",
        "24",
        "--temperature",
        "0.8",
        "--seed",
        "11",
        "--speculate",
        "ngram",
    ];
    let (ok, first, err) = xdna(&sampled);
    assert!(ok && err.contains("[spec] rounds"), "{err}");
    let (ok, second, _) = xdna(&sampled);
    assert!(ok);
    assert_eq!(first, second, "sampled speculative run is not reproducible");
}

/// A package sharing SmolLM2's weights whose tokenizer has tokens 100 and 101 swapped.
fn package_with_swapped_tokens(gguf: &Path, dir: &Path) {
    let pkg = xdna::model::load::open_package(gguf).expect("package");
    std::fs::create_dir_all(dir).expect("mkdir");
    for entry in std::fs::read_dir(pkg.dir()).expect("read package") {
        let entry = entry.expect("entry");
        let name = entry.file_name();
        if name == "tokenizer.json" {
            continue;
        }
        let link = dir.join(&name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(entry.path(), link).expect("symlink");
    }
    let text = std::fs::read_to_string(pkg.dir().join("tokenizer.json")).expect("tokenizer");
    let mut json: serde_json::Value = serde_json::from_str(&text).expect("json");
    let vocab = json["model"]["vocab"].as_object_mut().expect("vocab");
    let a = vocab
        .iter()
        .find(|(_, id)| id.as_u64() == Some(100))
        .map(|(k, _)| k.clone());
    let b = vocab
        .iter()
        .find(|(_, id)| id.as_u64() == Some(101))
        .map(|(k, _)| k.clone());
    let (a, b) = (a.expect("token 100"), b.expect("token 101"));
    vocab.insert(a, serde_json::Value::from(101));
    vocab.insert(b, serde_json::Value::from(100));
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).expect("write tokenizer");
}

#[test]
fn run_speculate_refuses_bad_drafters() {
    let Some(g) = common::smollm2_gguf() else {
        return;
    };
    let gs = g.to_string_lossy().into_owned();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            &gs,
            "--prompt",
            "Hello",
            "--max-tokens",
            "4",
        ];
        args.extend_from_slice(extra);
        xdna(&args)
    };
    let (ok, _, err) = run(&["--speculate", "magic"]);
    assert!(!ok && err.contains("unknown drafter"), "{err}");
    let (ok, _, err) = run(&["--speculate", "ngram", "--draft-max", "16"]);
    assert!(!ok && err.contains("--draft-max 16"), "{err}");
    let (ok, _, err) = run(&["--speculate", "layerskip:0"]);
    assert!(!ok && err.contains("at least 1"), "{err}");
    let (ok, _, err) = run(&["--speculate", "layerskip:30"]);
    assert!(!ok && err.contains("must be 1..30"), "{err}");
    let (ok, _, err) = run(&["--speculate", "draft:/nonexistent/draft.gguf"]);
    assert!(!ok && err.contains("/nonexistent/draft.gguf"), "{err}");
    let dir = std::env::temp_dir().join(format!("xdna-spec-cli-vocab-{}", std::process::id()));
    package_with_swapped_tokens(&g, &dir);
    let draft = format!("draft:{}", dir.display());
    let (ok, _, err) = run(&["--speculate", &draft]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        !ok && err.contains("does not share the target's vocabulary") && err.contains("token 100"),
        "{err}"
    );
}

/// Serves `replies.len()` POST requests on 127.0.0.1, answering each with an OpenAI completion
/// whose text is the next reply; returns the port and a handle yielding the request bodies.
fn completion_server(replies: Vec<String>) -> (u16, std::thread::JoinHandle<Vec<String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let handle = std::thread::spawn(move || {
        let mut bodies = Vec::new();
        for reply in replies {
            let (stream, _) = listener.accept().expect("accept");
            stream
                .set_read_timeout(Some(std::time::Duration::from_secs(60)))
                .expect("timeout");
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut request_line = String::new();
            reader.read_line(&mut request_line).expect("request line");
            assert!(
                request_line.starts_with("POST /v1/completions "),
                "{request_line}"
            );
            let mut length = 0;
            loop {
                let mut header = String::new();
                reader.read_line(&mut header).expect("header");
                let header = header.trim_end();
                if header.is_empty() {
                    break;
                }
                if let Some((name, value)) = header.split_once(':') {
                    if name.eq_ignore_ascii_case("content-length") {
                        length = value.trim().parse().expect("length");
                    }
                }
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).expect("body");
            bodies.push(String::from_utf8(body).expect("utf8"));
            let answer = serde_json::json!({
                "id": "cmpl-test", "object": "text_completion", "model": "test",
                "choices": [{"index": 0, "text": reply, "finish_reason": "length"}],
            })
            .to_string();
            let mut stream = stream;
            write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
                answer.len(),
                answer
            )
            .expect("reply");
        }
        bodies
    });
    (port, handle)
}

#[test]
fn spec_acceptance_local_and_endpoint_agree() {
    let Some(g) = common::smollm2_gguf() else {
        return;
    };
    let g = g.to_string_lossy().into_owned();
    let dir = std::env::temp_dir().join(format!("xdna-spec-acc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let prompts = dir.join("prompts.txt");
    // A plain line, a comment, and a JSON line carrying newlines.
    let file = format!(
        "The capital of France is\n# a comment\n{}\n",
        serde_json::json!({"name": "code", "prompt": CODE})
    );
    std::fs::write(&prompts, file).expect("write prompts");
    let p = prompts.to_string_lossy().into_owned();
    let common_args = [
        "spec-acceptance",
        "--prompts",
        &p,
        "--model",
        &g,
        "--max-tokens",
        "16",
        "--draft-max",
        "4",
        "--pass-ms",
        "12",
        "--step-ms",
        "10",
        "--json",
    ];
    let (ok, local, err) = xdna(&common_args);
    assert!(ok, "{err}");
    let local: serde_json::Value = serde_json::from_str(&local).expect("json");
    let names: Vec<&str> = local["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| p["name"].as_str().expect("name"))
        .collect();
    assert_eq!(names, ["line1", "code"]);
    // Every prompt's 16 tokens are accounted for, rounds and plain steps included.
    let overall = &local["overall"];
    assert_eq!(overall["tokens"], 32);
    let (rounds, plain, accepted) = (
        overall["rounds"].as_f64().unwrap(),
        overall["plain_steps"].as_f64().unwrap(),
        overall["accepted"].as_f64().unwrap(),
    );
    assert_eq!(
        rounds + plain + accepted,
        32.0,
        "each pass emits accepted + 1"
    );
    assert!(
        accepted > 0.0,
        "the code prompt repeats: drafts must be accepted"
    );
    let expected_one = 32.0 * 10.0 / (rounds * 12.0 + plain * 10.0);
    let expected_two = 32.0 * 10.0 / (rounds * 24.0 + plain * 10.0);
    assert!((overall["speedup_one_pass"].as_f64().unwrap() - expected_one).abs() < 1e-9);
    assert!((overall["speedup_two_pass"].as_f64().unwrap() - expected_two).abs() < 1e-9);

    // Continuations served by an OpenAI-compatible endpoint (the text `xdna run` prints for 16
    // greedy tokens): the report is the replay of the re-tokenized texts.
    let mut replies = Vec::new();
    for prompt in ["The capital of France is", CODE] {
        let (ok, out, err) = xdna(&[
            "run",
            "--model",
            &g,
            "--prompt",
            prompt,
            "--max-tokens",
            "16",
        ]);
        assert!(ok, "{err}");
        replies.push(out.strip_suffix('\n').expect("newline").to_string());
    }
    let pkg = xdna::model::load::open_package(Path::new(&g)).expect("package");
    let mut expected = xdna::spec::SpecStats::default();
    for (prompt, reply) in ["The capital of France is", CODE].iter().zip(&replies) {
        let ids = pkg.encode_prompt(prompt, false);
        let continuation = pkg.tokenizer().encode(reply, false);
        let mut drafter = xdna::spec::NgramDrafter::new(xdna::spec::NgramConfig {
            min_n: 2,
            max_n: 4,
            max_drafts: 4,
        })
        .expect("drafter");
        let stats =
            xdna::spec::replay_acceptance(&mut drafter, &ids, &continuation, 4).expect("replay");
        expected.merge(&stats);
    }
    let (port, server) = completion_server(replies);
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut args = common_args.to_vec();
    args.extend(["--endpoint", &endpoint]);
    let (ok, remote, err) = xdna(&args);
    let bodies = server.join().expect("server");
    assert!(ok, "{err}");
    let remote: serde_json::Value = serde_json::from_str(&remote).expect("json");
    assert_eq!(remote["source"], "endpoint");
    let overall = &remote["overall"];
    assert_eq!(overall["tokens"], expected.emitted);
    assert_eq!(overall["rounds"], expected.rounds);
    assert_eq!(overall["plain_steps"], expected.plain_steps);
    assert_eq!(overall["drafted"], expected.drafted);
    assert_eq!(overall["accepted"], expected.accepted);
    assert!(expected.accepted > 0);
    for (body, prompt) in bodies.iter().zip(["The capital of France is", CODE]) {
        let body: serde_json::Value = serde_json::from_str(body).expect("request json");
        assert_eq!(body["temperature"], 0);
        assert_eq!(body["max_tokens"], 16);
        assert_eq!(body["prompt"], prompt);
    }

    // The table form names the formulas.
    let mut table_args = common_args.to_vec();
    table_args.pop();
    let (ok, table, err) = xdna(&table_args);
    assert!(ok, "{err}");
    assert!(
        table.contains("overall") && table.contains("1-pass round = N·s/(R·p + Z·s)"),
        "{table}"
    );
    let (ok, _, err) = xdna(&[
        "spec-acceptance",
        "--prompts",
        "/nonexistent/prompts.txt",
        "--model",
        &g,
    ]);
    assert!(!ok && err.contains("/nonexistent/prompts.txt"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_spec_json_lists_every_prompt() {
    let Some(g) = common::smollm2_gguf() else {
        return;
    };
    let g = g.to_string_lossy().into_owned();
    let (ok, out, err) = xdna(&[
        "bench", "spec", "--model", &g, "--runs", "1", "--tokens", "12", "--json",
    ]);
    assert!(ok, "{err}");
    let value: serde_json::Value = serde_json::from_str(&out).expect("json");
    let prompts = value["prompts"].as_array().expect("prompts");
    let names: Vec<&str> = prompts
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["code", "list", "list-count", "prose", "repetitive"]);
    for p in prompts {
        let (plain, spec) = (
            p["plain_tok_s"].as_f64().unwrap(),
            p["spec_tok_s"].as_f64().unwrap(),
        );
        assert!(plain > 0.0 && spec > 0.0, "{p}");
        assert!(
            (p["speedup"].as_f64().unwrap() - spec / plain).abs() < 1e-9,
            "{p}"
        );
        assert!(p["tau"].as_f64().unwrap() >= 1.0, "{p}");
        // The speculative tokens are the plain greedy tokens.
        assert_eq!(p["identical"], true, "{p}");
    }
}

#[test]
fn bench_verify_puts_each_pass_against_the_steps_timed_beside_it() {
    let Some(g) = common::smollm2_gguf() else {
        return;
    };
    let g = g.to_string_lossy().into_owned();
    let (ok, out, err) = xdna(&[
        "bench",
        "verify",
        "--model",
        &g,
        "--backend",
        "host",
        "--runs",
        "3",
        "--json",
    ]);
    assert!(ok, "{err}");
    let value: serde_json::Value = serde_json::from_str(&out).expect("json");
    let rows = value["rows"].as_array().expect("rows");
    let ms: Vec<u64> = rows.iter().map(|r| r["m"].as_u64().unwrap()).collect();
    assert_eq!(ms, (1..=16).collect::<Vec<u64>>());
    let mut steps = Vec::new();
    for r in rows {
        let (pass, step) = (
            r["pass_ms"].as_f64().unwrap(),
            r["step_ms"].as_f64().unwrap(),
        );
        assert!(pass > 0.0 && step > 0.0, "{r}");
        assert!(
            (r["relative_to_step"].as_f64().unwrap() - pass / step).abs() < 1e-9,
            "{r}"
        );
        steps.push(step);
    }
    // The overall step is the median of every step timed, so it lies among the rows' medians.
    let all = value["step_ms"].as_f64().unwrap();
    let (lo, hi) = steps
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &s| (lo.min(s), hi.max(s)));
    assert!(lo <= all && all <= hi, "{all} outside {lo}..{hi}");
    assert_eq!(value["commits"].as_array().expect("commits").len(), 16);
}
