//! The official OpenAI Python client against the `forward-serve` binary (fake engine).
//! Skips loudly when python3 or the `openai` package is missing (`python3 -m pip install openai`);
//! fails instead under CI, where `.ci/run` installs it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn openai_python_client_completes_and_streams() {
    let have = Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 with the `openai` package is missing under CI (.ci/run installs it)"
        );
        eprintln!("SKIPPED serve_python: python3 with the `openai` package is not available (python3 -m pip install openai)");
        return;
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_forward-serve"))
        .args(["--fake-engine", "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn forward-serve");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(a) = line.strip_prefix("forward-serve listening on ") {
                let _ = tx.send(a.trim().to_string());
            }
        }
    });
    let base = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("listening line");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openai_client.py");
    let out = Command::new("python3")
        .args([script, &format!("{base}/v1")])
        .output();
    let _ = child.kill();
    let _ = child.wait();
    let out = out.expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for check in [
        "models ok",
        "completion ok",
        "completion stream ok",
        "chat ok",
        "chat stream ok",
        "error ok",
    ] {
        assert!(stdout.contains(check), "missing {check:?} in:\n{stdout}");
    }
}
