//! `xdna run` / `xdna perplexity` / `xdna bench decode` end to end on the real model.

#[path = "model_common.rs"]
mod common;

use std::process::Command;

fn xdna(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(args)
        .output()
        .expect("run xdna");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Bad sampling settings are refused by name before any model is loaded.
#[test]
fn run_refuses_bad_sampling_settings_by_name() {
    for (flag, value, field) in [
        ("--temperature", "-0.5", "temperature"),
        ("--temperature", "NaN", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--top-p", "1.5", "top_p"),
    ] {
        let arg = format!("{flag}={value}");
        let (ok, _, err) = xdna(&[
            "run",
            "--model",
            "/nonexistent/model.gguf",
            "--prompt",
            "x",
            &arg,
        ]);
        assert!(!ok && err.contains(field), "{arg}: {err}");
        assert!(
            !err.contains("/nonexistent"),
            "{arg}: checked after loading: {err}"
        );
    }
}

/// An unknown backend is refused while parsing, with the accepted values, before any loading.
#[test]
fn unknown_backend_is_refused_with_the_accepted_values() {
    for args in [
        &["run", "--prompt", "x", "--backend", "npu"][..],
        &["perplexity", "--file", "/nonexistent", "--backend", "npu"][..],
        &["bench", "decode", "--backend", "npu"][..],
    ] {
        let (ok, _, err) = xdna(args);
        assert!(
            !ok && err.contains("invalid value 'npu' for '--backend <BACKEND>'")
                && err.contains("[possible values: auto, host, xdna]"),
            "{args:?}: {err}"
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(["run", "--prompt", "x", "--model", "/nonexistent/model.gguf"])
        .env("XDNA_BACKEND", "npu")
        .output()
        .expect("run xdna");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("invalid value 'npu'")
            && !err.contains("/nonexistent"),
        "XDNA_BACKEND=npu: {err}"
    );
}

#[test]
fn run_errors_streaming_stop_and_seed() {
    let Some(g) = common::smollm2_gguf() else {
        return;
    };
    let g = g.to_string_lossy().into_owned();
    let (ok, _, err) = xdna(&["run", "--model", &g, "--prompt", ""]);
    assert!(!ok && err.contains("empty prompt"), "{err}");
    let (ok, _, err) = xdna(&[
        "run",
        "--model",
        &g,
        "--prompt",
        "hello there world",
        "--ctx",
        "2",
    ]);
    assert!(!ok && err.contains("context holds 2"), "{err}");
    let (ok, _, err) = xdna(&["run", "--model", "/nonexistent/model.gguf", "--prompt", "x"]);
    assert!(!ok && err.contains("/nonexistent/model.gguf"), "{err}");
    // Greedy, with a stats line on stderr and the text on stdout.
    let (ok, out, err) = xdna(&[
        "run",
        "--model",
        &g,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("Paris"), "{out}");
    assert!(
        err.contains("[stats] prompt 5 tok") && err.contains("m16 "),
        "{err}"
    );
    // The stop string is not printed and ends the text.
    let (ok, out2, _) = xdna(&[
        "run",
        "--model",
        &g,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--stop",
        "Paris",
    ]);
    assert!(ok && !out2.contains("Paris"), "{out2}");
    assert!(out.starts_with(out2.trim_end()), "{out:?} vs {out2:?}");
    // Sampling is reproducible by seed.
    let args = [
        "run",
        "--model",
        &g,
        "--chat",
        "--prompt",
        "Tell me a story.",
        "--max-tokens",
        "16",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "7",
    ];
    let (ok, a, _) = xdna(&args);
    let (_, b, _) = xdna(&args);
    assert!(ok && !a.trim().is_empty());
    assert_eq!(a, b);
}

#[test]
fn perplexity_json_and_bench_json() {
    let Some(g) = common::smollm2_gguf() else {
        return;
    };
    let g = g.to_string_lossy().into_owned();
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/licenses.txt");
    let (ok, out, err) = xdna(&[
        "perplexity",
        "--model",
        &g,
        "--file",
        file,
        "--ctx",
        "128",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["chunks"], 7);
    assert_eq!(v["tokens"], 7 * 63);
    let ppl = v["ppl"].as_f64().unwrap();
    assert!(ppl > 1.0 && ppl < 30.0, "{ppl}");
    let (ok, out, err) = xdna(&[
        "bench",
        "decode",
        "--model",
        &g,
        "--json",
        "--runs",
        "1",
        "--prompt-tokens",
        "16",
        "--decode-tokens",
        "8",
        "--probe-mib",
        "64",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    for k in [
        "prefill_tok_s",
        "decode_tok_s",
        "limit_tok_s",
        "fraction_of_limit",
    ] {
        assert!(v[k].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
    // One paired fraction per run (each run measured against its own bandwidth probe).
    for k in ["decode_tok_s_runs", "fraction_of_limit_runs"] {
        let runs = v[k].as_array().unwrap();
        assert_eq!(runs.len(), 1, "{k}: {v}");
        assert!(runs[0].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
    // The split of a decode token: projections and attention both take time, and the three
    // parts add up to no more than the measured time per token (which also holds the argmax).
    let part = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k}: {v}"));
    let (projection, attention, other) = (
        part("projection_ms_per_token"),
        part("attention_ms_per_token"),
        part("other_ms_per_token"),
    );
    assert!(projection > 0.0 && attention > 0.0 && other >= 0.0, "{v}");
    let per_token_ms = 1e3 / part("decode_tok_s");
    assert!(
        projection + attention + other <= per_token_ms * 1.0001,
        "{projection} + {attention} + {other} ms > {per_token_ms} ms per token: {v}"
    );
    let f = part("projection_fraction_of_bandwidth");
    assert!(f > 0.0 && f >= part("fraction_of_limit"), "{v}");
    // Four streams per batched pass: the split is per pass, a token's share a quarter of it, and
    // a pass (four tokens) takes at least its three parts.
    let (ok, out, err) = xdna(&[
        "bench",
        "decode",
        "--model",
        &g,
        "--json",
        "--runs",
        "1",
        "--prompt-tokens",
        "16",
        "--decode-tokens",
        "8",
        "--probe-mib",
        "64",
        "--streams",
        "4",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let part = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k}: {v}"));
    assert_eq!(v["streams"], 4, "{v}");
    let (projection, attention, other) = (
        part("projection_ms_per_pass"),
        part("attention_ms_per_pass"),
        part("other_ms_per_pass"),
    );
    assert!(projection > 0.0 && attention > 0.0 && other >= 0.0, "{v}");
    assert!((part("attention_ms_per_token") - attention / 4.0).abs() <= 1e-9 * attention);
    let per_pass_ms = 4.0 * 1e3 / part("decode_tok_s");
    assert!(
        projection + attention + other <= per_pass_ms * 1.0001,
        "{projection} + {attention} + {other} ms > {per_pass_ms} ms per pass: {v}"
    );
    // Passes per second against one weight sweep at the probe's bandwidth.
    let passes_per_limit = part("decode_tok_s") / 4.0 / part("limit_tok_s");
    assert!(
        (part("fraction_of_limit") - passes_per_limit).abs() <= 1e-9,
        "{v}"
    );
}

/// `--exact` runs the projections at reference precision: on this chat prompt the fast q8 path
/// flips a near-tie at the first answer token ("L'Étoile…"), while the slow reference forward
/// (`model::reference`, its answer checked by hand) answers "The capital of France is Paris.".
#[test]
fn run_exact_gives_the_reference_answer_on_a_near_tie() {
    let Some(g) = common::smollm2_gguf() else {
        return;
    };
    let g = g.to_string_lossy().into_owned();
    let (ok, out, err) = xdna(&[
        "run",
        "--model",
        &g,
        "--chat",
        "--exact",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "8",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.starts_with("The capital of France is Paris"),
        "exact chat answer: {out:?}"
    );
}

/// `bench gemm --json` carries the fields docs/performance.md reads: both roofline probes, and per
/// M the time, the traffic, the cost relative to M = 1 and the share of the int8 peak.
#[test]
fn bench_gemm_json_reports_both_rooflines_and_every_row() {
    let (ok, out, err) = xdna(&[
        "bench",
        "gemm",
        "--json",
        "--m",
        "1,16",
        "--layers",
        "1",
        "--head-rows",
        "1024",
        "--min-time",
        "0",
        "--compare-chunks",
        "1,8",
        "--copies",
        "2",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["read_bandwidth_gbs"].as_f64().unwrap() > 0.0, "{v}");
    // The sweeps cycle through 2 copies of the weights; the probe reads at least 256 MiB and at
    // least twice the last-level cache where sysfs names one.
    assert_eq!(v["copies"], 2, "{v}");
    assert_eq!(
        v["working_set_bytes"].as_u64().unwrap(),
        2 * v["stored_bytes"].as_u64().unwrap(),
        "{v}"
    );
    let probe = v["probe_bytes"].as_u64().unwrap();
    assert!(probe >= 256 << 20, "{v}");
    if let Some(llc) = v["last_level_cache_bytes"].as_u64() {
        assert!(llc > 0 && probe >= 2 * llc, "{v}");
    }
    assert!(v["fraction_of_bandwidth_m1"].as_f64().unwrap() > 0.0, "{v}");
    assert!(
        v["shapes"].as_str().unwrap().contains("1 x (")
            && v["shapes"].as_str().unwrap().contains("lm_head 1024x576"),
        "{v}"
    );
    // The probe runs wherever the AVX2 kernels do, and is null elsewhere.
    match v["avx2"].as_bool().unwrap() {
        true => assert!(v["int8_mac_peak_gmacs"].as_f64().unwrap() > 0.0, "{v}"),
        false => assert!(v["int8_mac_peak_gmacs"].is_null(), "{v}"),
    }
    // 32 × 32 weight blocks per activation row, by hand: one layer (qkv 960×576, o 576×576,
    // gate+up 3072×576, down 576×1536) and 1024 lm_head rows of 576.
    let blocks_per_row =
        (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536 + 1024 * 576) as f64 / 1024.0;
    assert_eq!(blocks_per_row, 4032.0);
    let threads = v["threads"].as_f64().unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    assert_eq!(rows[0]["m"], 1);
    assert_eq!(rows[0]["relative_to_m1"].as_f64().unwrap(), 1.0);
    for r in rows {
        for k in [
            "seconds",
            "gbs",
            "gops",
            "relative_to_m1",
            "ns_per_block_group",
        ] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {r}");
        }
        if v["avx2"] == true {
            assert!(r["fraction_of_int8_peak"].as_f64().unwrap() > 0.0, "{r}");
        }
        let m = r["m"].as_f64().unwrap();
        let expected = r["seconds"].as_f64().unwrap() * 1e9 * threads / (m * blocks_per_row);
        let got = r["ns_per_block_group"].as_f64().unwrap();
        assert!(
            (got - expected).abs() <= 1e-9 * expected,
            "{got} vs {expected}: {r}"
        );
    }
    let chunks = v["chunk_comparison"].as_array().unwrap();
    assert_eq!(chunks.len(), 2, "{v}");
    for (c, want) in chunks.iter().zip([1, 8]) {
        assert_eq!(c["min_chunk"], want, "{c}");
        assert!(c["seconds"].as_f64().unwrap() > 0.0, "{c}");
        assert!(
            c["best_seconds"].as_f64().unwrap() <= c["seconds"].as_f64().unwrap(),
            "{c}"
        );
    }
    assert_eq!(chunks[0]["relative_to_first"].as_f64().unwrap(), 1.0);
}

/// A shrunken sweep (`--layers`, `--head-rows`) defaults to one copy of the weights: it is meant to
/// stay in the cache.
#[test]
fn bench_gemm_small_sweeps_default_to_one_copy() {
    let (ok, out, err) = xdna(&[
        "bench",
        "gemm",
        "--json",
        "--m",
        "2",
        "--layers",
        "1",
        "--head-rows",
        "32",
        "--min-time",
        "0",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["copies"], 1, "{v}");
    assert_eq!(v["working_set_bytes"], v["stored_bytes"], "{v}");
}

#[test]
fn benches_reject_bad_sizes_by_name() {
    for bad in ["0", "100", "49184"] {
        let (ok, _, err) = xdna(&["bench", "gemm", "--head-rows", bad, "--min-time", "0"]);
        assert!(!ok, "--head-rows {bad} was accepted");
        assert!(err.contains("--head-rows") && err.contains(bad), "{err}");
    }
    let (ok, _, err) = xdna(&[
        "bench",
        "gemm",
        "--compare-chunks",
        "1,0",
        "--min-time",
        "0",
    ]);
    assert!(!ok && err.contains("--compare-chunks"), "{err}");
    // Sizes that would only end in a failed allocation are refused by name, as is no copy at all.
    for (flag, bad) in [
        ("--m", "1,1000000000"),
        ("--layers", "100000000"),
        ("--copies", "0"),
        ("--copies", "100000"),
    ] {
        let (ok, _, err) = xdna(&["bench", "gemm", flag, bad, "--min-time", "0"]);
        assert!(!ok && err.contains(flag), "{flag} {bad}: {err}");
    }
    // Copies within the count bound whose bytes exceed the memory bound (64 × 1000 layers ≈ 200 GB)
    // are refused by name before anything is allocated.
    let (ok, _, err) = xdna(&[
        "bench",
        "gemm",
        "--copies",
        "64",
        "--layers",
        "1000",
        "--min-time",
        "0",
    ]);
    assert!(
        !ok && err.contains("--copies") && err.contains("GiB"),
        "{err}"
    );
    let (ok, _, err) = xdna(&["bench", "decode", "--probe-mib", "1000000000000"]);
    assert!(!ok && err.contains("--probe-mib"), "{err}");
    let (ok, _, err) = xdna(&["bench", "decode", "--decode-tokens", "0"]);
    assert!(!ok && err.contains("--decode-tokens"), "{err}");
    for bad in ["0", "17"] {
        let (ok, _, err) = xdna(&["bench", "decode", "--streams", bad]);
        assert!(
            !ok && err.contains("--streams") && err.contains(bad),
            "{err}"
        );
    }
}

/// `xdna perplexity --reference [--reference-q8 LIST]`: the slow reference forward through the CLI,
/// equal to the library's reference with the same rounding, and its usage errors by name.
#[test]
fn perplexity_of_the_reference_with_rounding_by_projection() {
    use xdna::model::perplexity::perplexity;
    use xdna::model::reference::Reference;
    for (extra, needle) in [
        (&["--reference-q8", "qkv"][..], "--reference"),
        (&["--reference", "--exact"], "--exact"),
        (
            &["--reference", "--compare-reference"],
            "--compare-reference",
        ),
        (&["--reference", "--reference-q8", "qkv,bogus"], "`bogus`"),
        (
            &["--reference", "--reference-refine", "4"],
            "--reference-q8",
        ),
        (
            &[
                "--reference",
                "--reference-q8",
                "all",
                "--reference-refine=-1",
            ],
            "not a ratio",
        ),
    ] {
        let mut args = vec!["perplexity", "--file", "x.txt"];
        args.extend_from_slice(extra);
        let (ok, _, err) = xdna(&args);
        assert!(!ok && err.contains(needle), "{extra:?}: {err}");
    }
    let Some(g) = common::smollm2_gguf() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("xdna-ref-ppl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("text.txt");
    // About a hundred tokens: three chunks of 32 keep the slow reference to seconds.
    let text: String = include_str!("data/licenses.txt")
        .chars()
        .take(520)
        .collect();
    std::fs::write(&file, &text).expect("write text");
    let file = file.to_string_lossy().into_owned();
    let gs = g.to_string_lossy().into_owned();
    let (ok, _, err) = xdna(&[
        "perplexity",
        "--file",
        &file,
        "--reference",
        "--model",
        &dir.to_string_lossy(),
    ]);
    assert!(!ok && err.contains(&*dir.to_string_lossy()), "{err}");
    // The comparison checks the model before its fast run (an empty directory would otherwise fail
    // there, with a different error).
    let (ok, _, err) = xdna(&[
        "perplexity",
        "--file",
        &file,
        "--compare-reference",
        "--model",
        &dir.to_string_lossy(),
    ]);
    assert!(!ok && err.contains("reads a GGUF file"), "{err}");
    let perplexity_json = |extra: &[&str]| {
        let mut args = vec![
            "perplexity",
            "--model",
            &gs,
            "--file",
            &file,
            "--ctx",
            "32",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = xdna(&args);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(out.trim()).expect("JSON")
    };
    let run = |q8: &[&str]| perplexity_json(&[&["--reference", "--reference-q8"][..], q8].concat());
    let (all, none) = (run(&["all"]), run(&["none"]));
    assert_eq!(all["backend"], "reference");
    assert_eq!(all["reference_q8"], "all");
    assert_eq!(all["reference_refine"], serde_json::Value::Null);
    assert_eq!(none["reference_q8"], "none");
    // A ratio no group exceeds refines nothing: the same numbers as plain rounding.
    let never = run(&["all", "--reference-refine", "1000"]);
    assert_eq!(never["reference_refine"], 1000.0);
    assert_eq!(never["ppl"], all["ppl"]);
    // Real activations have groups beyond 2 × RMS (outliers of 5–20 × RMS): refined, they differ.
    let refined = run(&["all", "--reference-refine", "2"]);
    assert_ne!(refined["ppl"], all["ppl"]);
    assert_eq!(all["chunks"], 3, "{all}");
    // The library's reference with every input rounded: the same numbers.
    let pkg = xdna::weights::Package::open(&g).expect("package");
    let reference = Reference::open(&g)
        .expect("reference")
        .with_activation_q8(true);
    let tokens = pkg.tokenizer().encode(&text, false);
    let bos = pkg.leading_bos();
    let expected = perplexity(
        &tokens,
        32,
        bos,
        &mut |chunk, first, f| reference.score_chunk(chunk, first, f),
        &mut |_, _| {},
    )
    .expect("library perplexity");
    assert_eq!(all["ppl"].as_f64(), Some(expected.ppl), "{all}");
    // Rounding changes the logits, so the two estimates differ.
    assert_ne!(all["ppl"], none["ppl"]);
    // The fast path compared with the exact reference over the same tokens: the reference's
    // estimate is exactly `--reference`'s, and the gap is the two estimates' ratio.
    let cmp = perplexity_json(&["--compare-reference"]);
    assert_eq!(cmp["reference_ppl"], none["ppl"], "{cmp}");
    let (fast, reference) = (cmp["ppl"].as_f64().unwrap(), none["ppl"].as_f64().unwrap());
    let gap = cmp["gap"].as_f64().unwrap();
    assert!((gap - (fast / reference - 1.0)).abs() < 1e-12, "{cmp}");
    // q8 activations move every token a little (≈ 0.1 nats here), so both spreads are positive.
    let per_token = cmp["mean_abs_token_nll"].as_f64().unwrap();
    assert!(per_token > 0.0 && per_token < 0.5, "{cmp}");
    assert!(cmp["gap_uncertainty"].as_f64().unwrap() > 0.0, "{cmp}");
    assert!(cmp["ppl_uncertainty"].as_f64().unwrap() > 0.0, "{cmp}");
    let _ = std::fs::remove_dir_all(&dir);
}
