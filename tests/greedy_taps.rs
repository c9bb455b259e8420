//! `xdna greedy-taps` (the DFlash trainer's labels) end to end on the real model: its file holds
//! the prompts, the target's greedy continuations (equal to plain decoding one token at a time
//! through the library) and the hidden states after the tap layers at every fed position (equal
//! to one tapped prefill over the same tokens, up to the f16 the file stores); bad prompt files
//! are refused naming the file and line.

#[path = "support/scratch_dir.rs"]
mod scratch_dir;
#[path = "support/smollm2.rs"]
mod smollm2;

use std::process::Command;
use xdna::model::load::{open_model, Backend, LoadOptions};
use xdna::model::sampling::argmax;

struct Record {
    prompt_len: usize,
    tokens: Vec<u32>,
    features: Vec<f32>,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn parse(bytes: &[u8]) -> (usize, Vec<usize>, Vec<Record>) {
    assert_eq!(&bytes[..4], b"XGT1");
    let hidden = u32_at(bytes, 4) as usize;
    let ntaps = u32_at(bytes, 8) as usize;
    let taps: Vec<usize> = (0..ntaps)
        .map(|i| u32_at(bytes, 12 + 4 * i) as usize)
        .collect();
    let mut at = 12 + 4 * ntaps;
    let mut records = Vec::new();
    while at < bytes.len() {
        let (p, total) = (u32_at(bytes, at) as usize, u32_at(bytes, at + 4) as usize);
        at += 8;
        let tokens: Vec<u32> = (0..total).map(|i| u32_at(bytes, at + 4 * i)).collect();
        at += 4 * total;
        let n = (total - 1) * ntaps * hidden;
        let features = (0..n)
            .map(|i| {
                let bits = u16::from_le_bytes([bytes[at + 2 * i], bytes[at + 2 * i + 1]]);
                half::f16::from_bits(bits).to_f32()
            })
            .collect();
        at += 2 * n;
        records.push(Record {
            prompt_len: p,
            tokens,
            features,
        });
    }
    assert_eq!(at, bytes.len(), "trailing bytes");
    (hidden, taps, records)
}

#[test]
fn greedy_taps_writes_plain_greedy_continuations_and_the_prefills_hidden_states() {
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    let dir = scratch_dir::scratch_path("greedy_taps", "run");
    std::fs::create_dir_all(&dir).expect("dir");
    let opts = LoadOptions {
        backend: Backend::Host,
        kernels: None,
        exact: false,
    };
    let (pkg, mut model) = open_model(Some(&gguf), 512, &opts).expect("model");
    let texts = [
        "The river carried the boat slowly past the",
        "def add(a, b):\n    return",
        "Once upon a time",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| pkg.encode_prompt(t, false)).collect();
    let prompt_file = dir.join("prompts.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .map(|p| serde_json::to_string(p).expect("json"))
        .collect();
    std::fs::write(&prompt_file, lines.join("\n") + "\n").expect("write prompts");
    let out_file = dir.join("out.bin");
    let taps = [2usize, 17, 28];
    let tokens = 24;
    let out = Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(["greedy-taps", "--backend", "host", "--model"])
        .arg(&gguf)
        .arg("--prompts")
        .arg(&prompt_file)
        .args([
            "--tokens",
            &tokens.to_string(),
            "--taps",
            "2,17,28",
            "--streams",
            "2",
        ])
        .arg("--output")
        .arg(&out_file)
        .output()
        .expect("run xdna");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (hidden, file_taps, records) = parse(&std::fs::read(&out_file).expect("read"));
    assert_eq!((hidden, &file_taps[..]), (576, &taps[..]));
    assert_eq!(records.len(), prompts.len());
    let eos = pkg.eos_token_ids().to_vec();
    for (r, prompt) in records.iter().zip(&prompts) {
        assert_eq!(r.prompt_len, prompt.len());
        assert_eq!(&r.tokens[..prompt.len()], &prompt[..]);
        // The continuation is plain greedy decoding, one token at a time.
        model.reset();
        let mut want = Vec::new();
        let mut next = argmax(model.prefill(prompt).expect("prefill"), 0).expect("argmax");
        loop {
            want.push(next);
            if eos.contains(&next) || want.len() == tokens {
                break;
            }
            next = argmax(model.step(next).expect("step"), 0).expect("argmax");
        }
        assert_eq!(&r.tokens[prompt.len()..], &want[..], "continuation");
        // The features are the hidden states of one tapped prefill over every fed token.
        model.reset();
        let fed = &r.tokens[..r.tokens.len() - 1];
        let mut want = Vec::new();
        model
            .prefill_tapped(fed, &taps, &mut |pass| {
                for row in 0..pass.rows() {
                    for t in 0..taps.len() {
                        want.extend_from_slice(pass.tap(t, row));
                    }
                }
            })
            .expect("tapped prefill");
        assert_eq!(r.features.len(), want.len());
        let mut worst = 0f32;
        for (row, (got, exp)) in r
            .features
            .chunks(hidden)
            .zip(want.chunks(hidden))
            .enumerate()
        {
            let scale = exp.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = got
                .iter()
                .zip(exp)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(err / scale);
            assert!(
                err <= 2e-3 * scale,
                "row {row}: max |Δ| {err} against a state of max |x| {scale}"
            );
        }
        eprintln!("greedy-taps: worst relative difference to the prefill's states {worst:.2e}");
    }

    // Bad prompt files are refused naming the file and line.
    for (content, want) in [
        (
            "[1, 2]\nnot json\n",
            "line 2: not a JSON array of token ids",
        ),
        ("[]\n", "line 1: an empty prompt"),
        (
            "[1, 99999999]\n",
            "token id 99999999 is outside the vocabulary",
        ),
    ] {
        std::fs::write(&prompt_file, content).expect("write");
        let out = Command::new(env!("CARGO_BIN_EXE_xdna"))
            .args(["greedy-taps", "--backend", "host", "--model"])
            .arg(&gguf)
            .arg("--prompts")
            .arg(&prompt_file)
            .args(["--taps", "1", "--output"])
            .arg(&out_file)
            .output()
            .expect("run xdna");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{content:?} accepted");
        assert!(
            err.contains(want) && err.contains("prompts.jsonl"),
            "{content:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
