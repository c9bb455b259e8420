//! lm-evaluation-harness (`lm-eval` from PyPI, its `local-completions` model) against the
//! `forward-serve` binary with the real SmolLM2-135M-Instruct, on two small tasks defined in
//! `tests/python/lm_eval_tasks` (a log-likelihood task and a `generate_until` task, local files,
//! nothing downloaded). The log-likelihoods lm-eval records must equal, to 1e-4, those that
//! `xdna perplexity --score` computes for the same strings — another path through the model
//! (its own tokenizer, no HTTP, no scheduler) — and its token ids must equal those lm-eval's
//! Hugging Face tokenizer made. Skips loudly without python3 + lm_eval; fails under CI.

mod serve_common;
#[path = "../../../tests/support/smollm2.rs"]
mod smollm2;

use serve_common::spawn_binary;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

fn have_lm_eval() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import lm_eval, transformers"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 with lm_eval and transformers is missing under CI (.ci/run installs them)"
        );
        eprintln!(
            "SKIPPED serve_lm_eval: python3 -m pip install 'lm-eval[api]==0.4.13' transformers"
        );
    }
    ok
}

/// The `xdna` binary beside `forward-serve` (the workspace build makes both).
fn xdna_bin() -> PathBuf {
    let fs = Path::new(env!("CARGO_BIN_EXE_forward-serve"));
    let bin = fs.with_file_name("xdna");
    assert!(
        bin.exists(),
        "{} is missing: build the workspace (cargo build --workspace --release)",
        bin.display()
    );
    bin
}

#[test]
fn lm_eval_scores_equal_xdna_perplexity_scoring() {
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    if !have_lm_eval() {
        return;
    }
    // The package directory: the server's model and lm-eval's Hugging Face tokenizer.
    let pkg = xdna::weights::import::cached_import(&gguf).expect("package of the GGUF");
    let id = pkg
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .expect("package name");
    let server_args: Vec<&std::ffi::OsStr> = ["--backend", "host", "--ctx", "512", "--model"]
        .iter()
        .map(std::ffi::OsStr::new)
        .chain([pkg.as_os_str()])
        .collect();
    let (mut child, base) = spawn_binary(&server_args, Duration::from_secs(120));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/lm_eval_check.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(&base)
        .arg(&pkg)
        .args(["--model", &id])
        .output();
    let _ = child.kill();
    let _ = child.wait();
    let out = out.expect("run python3");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "lm_eval_check.py failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&text).expect("one JSON object");
    let lls = report["loglikelihood"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(lls.len() >= 10, "too few log-likelihood requests: {report}");
    let gens = report["generate_until"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(gens.len(), 4, "{report}");
    assert!(
        gens.iter()
            .any(|g| g["output"].as_str().is_some_and(|o| !o.trim().is_empty())),
        "every generation empty: {report}"
    );

    // The same strings through `xdna perplexity --score`.
    let dir = std::env::temp_dir().join(format!("xdna-lm-eval-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let pairs = dir.join("pairs.jsonl");
    let lines: Vec<String> = lls
        .iter()
        .map(|r| {
            serde_json::json!({"context": r["context"], "continuation": r["continuation"]})
                .to_string()
        })
        .collect();
    std::fs::write(&pairs, lines.join("\n")).expect("write pairs");
    let scored = Command::new(xdna_bin())
        .args(["perplexity", "--backend", "host", "--ctx", "512", "--score"])
        .arg(&pairs)
        .arg("--model")
        .arg(&pkg)
        .output()
        .expect("run xdna perplexity --score");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        scored.status.success(),
        "xdna perplexity --score failed: {}",
        String::from_utf8_lossy(&scored.stderr)
    );
    let ours: Vec<Value> = String::from_utf8_lossy(&scored.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(ours.len(), lls.len());
    let mut worst = 0f64;
    for (theirs, ours) in lls.iter().zip(&ours) {
        let what = format!("{:?} + {:?}", theirs["context"], theirs["continuation"]);
        assert_eq!(theirs["context_ids"], ours["context_ids"], "{what}");
        assert_eq!(
            theirs["continuation_ids"], ours["continuation_ids"],
            "{what}"
        );
        let (a, b) = (
            theirs["loglikelihood"].as_f64().unwrap_or(f64::NAN),
            ours["loglikelihood"].as_f64().unwrap_or(f64::NAN),
        );
        assert!((a - b).abs() <= 1e-4, "{what}: lm-eval {a}, xdna {b}");
        assert_eq!(theirs["is_greedy"], ours["is_greedy"], "{what}");
        worst = worst.max((a - b).abs());
    }
    eprintln!(
        "lm-eval vs xdna perplexity --score: {} log-likelihoods, largest difference {worst:.2e}; metrics {}",
        lls.len(),
        report["metrics"]
    );
}
