//! Clients no one here wrote against the `forward-serve` binary: the official OpenAI Python client
//! and the `ollama` Python package, on the fake engine (whose answers are known exactly) and on the
//! real default model. Each skips loudly when python3 or its package is missing; under CI, where
//! `.ci/run` installs them, it fails instead.

mod serve_common;
#[path = "../../../tests/support/smollm2.rs"]
mod smollm2;

use serve_common::spawn_binary;

use std::process::{Command, Stdio};
use std::time::Duration;

/// Run `tests/python/<script> <base><suffix>` against a fresh fake-engine server; every line of
/// `checks` must be in its output.
fn run_client(module: &str, script: &str, suffix: &str, checks: &[&str]) {
    run_client_with(
        module,
        script,
        suffix,
        &["--fake-engine".as_ref()],
        &[],
        checks,
    );
}

/// The same against a server started with `server_args`, the script given `extra` arguments.
fn run_client_with(
    module: &str,
    script: &str,
    suffix: &str,
    server_args: &[&std::ffi::OsStr],
    extra: &[&str],
    checks: &[&str],
) {
    let have = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 with the `{module}` package is missing under CI (.ci/run installs it)"
        );
        eprintln!("SKIPPED {script}: python3 with the `{module}` package is not available (python3 -m pip install {})", module.replace(", ", " "));
        return;
    }
    let (mut child, base) = spawn_binary(server_args, Duration::from_secs(120));
    let script_path = format!("{}/tests/python/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3")
        .args([&script_path, &format!("{base}{suffix}")])
        .args(extra)
        .output();
    let _ = child.kill();
    let _ = child.wait();
    let out = out.expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for check in checks {
        assert!(stdout.contains(check), "missing {check:?} in:\n{stdout}");
    }
}

#[test]
fn openai_python_client_completes_streams_and_reads_logprobs() {
    run_client(
        "openai",
        "openai_client.py",
        "/v1",
        &[
            "models ok",
            "completion ok",
            "completion stream ok",
            "chat ok",
            "chat stream ok",
            "completion logprobs ok",
            "completion logprobs stream ok",
            "chat logprobs ok",
            "chat logprobs stream ok",
            "n ok",
            "error ok",
        ],
    );
}

#[test]
fn ollama_python_client_generates_chats_and_lists() {
    run_client(
        "ollama",
        "ollama_client.py",
        "",
        &[
            "tags ok",
            "show ok",
            "generate ok",
            "generate stream ok",
            "generate templated ok",
            "chat ok",
            "chat stream ok",
            "errors ok",
        ],
    );
}

#[test]
fn openai_and_ollama_clients_against_the_real_model() {
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    let id = gguf
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .expect("model file name");
    run_client_with(
        "openai, ollama",
        "real_model_clients.py",
        "",
        &[
            "--model".as_ref(),
            gguf.as_os_str(),
            "--backend".as_ref(),
            "host".as_ref(),
            "--ctx".as_ref(),
            "512".as_ref(),
        ],
        &[&id],
        &[
            "completion logprobs ok",
            "completion stream ok",
            "echo scoring ok",
            "chat logprobs ok",
            "n samples ok",
            "ollama generate ok",
            "ollama chat ok",
        ],
    );
}
