//! `xdna pack check`, the DFlash draft gate: its selftest (a synthetic valid package passes,
//! every negative control fails by the check named for it), real drafts written by llama.cpp's
//! own writer (`tools/llama-cpp/random_gguf.py --arch dflash`, F32, and the same file through
//! `llama-quantize … Q4_1` so the tile checks run on real q4_1 tiles) passing as GGUF and as
//! imported packages, the same drafts broken in place failing by name, a generation-2 GGUF
//! (`tests/support/dflash2_gguf.py`, gguf-py) recognised and checked by shape, and `--json`.
//!
//! Without llama.cpp or the default model the tests that need them skip loudly; under CI they
//! fail.

#[path = "support/scratch_dir.rs"]
mod scratch_dir;
#[path = "support/smollm2.rs"]
mod smollm2;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use xdna::weights::dflash_check::{self, SIGNATURE_CENTER, SIGNATURE_TOLERANCE};
use xdna::weights::gguf::GgufFile;
use xdna::weights::safetensors::{Declared, SafeTensors, Writer};

fn scratch(name: &str) -> PathBuf {
    scratch_dir::scratch_path("pack_check", name)
}

fn llama_cpp_bin() -> Option<PathBuf> {
    match std::env::var_os("XDNA_LLAMA_CPP_BIN") {
        Some(d) => Some(PathBuf::from(d)),
        None if std::env::var_os("CI").is_some() => {
            panic!("XDNA_LLAMA_CPP_BIN is unset under CI (.ci/run builds llama.cpp and sets it)")
        }
        None => {
            eprintln!("\n!!!!!!!! SKIPPED: llama.cpp unavailable; run tools/llama-cpp/build.sh and set XDNA_LLAMA_CPP_BIN !!!!!!!!\n");
            None
        }
    }
}

fn gguf_py(bin: &Path) -> PathBuf {
    bin.parent()
        .map_or_else(PathBuf::new, |p| p.join("gguf-py"))
}

/// A random F32 DFlash draft for the default model, as tests/dflash.rs makes it.
fn random_draft(bin: &Path, target: &Path, out: &Path) {
    let run = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tools/llama-cpp/random_gguf.py"
        ))
        .args([
            "--arch",
            "dflash",
            "--hidden",
            "576",
            "--heads",
            "9",
            "--kv-heads",
            "3",
            "--head-dim",
            "64",
            "--ffn",
            "1536",
            "--rope-base",
            "100000",
            "--rms-eps",
            "1e-5",
        ])
        .arg("--tokenizer-from")
        .arg(target)
        .arg("--out")
        .arg(out)
        .env("PYTHONPATH", gguf_py(bin))
        .output()
        .expect("run python3");
    assert!(
        run.status.success(),
        "random_gguf.py --arch dflash failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The draft `X.gguf` (F32) and `Y.gguf` (llama-quantize Q4_1), made once per test binary.
fn drafts() -> Option<(PathBuf, PathBuf)> {
    static MADE: std::sync::OnceLock<Option<(PathBuf, PathBuf)>> = std::sync::OnceLock::new();
    MADE.get_or_init(|| {
        let bin = llama_cpp_bin()?;
        let target = smollm2::smollm2_gguf()?;
        let (x, y) = (scratch("X.gguf"), scratch("Y.gguf"));
        random_draft(&bin, &target, &x);
        let q = Command::new(bin.join("llama-quantize"))
            .arg(&x)
            .arg(&y)
            .arg("Q4_1")
            .output()
            .expect("run llama-quantize");
        assert!(
            q.status.success(),
            "llama-quantize on the dflash draft failed: {}",
            String::from_utf8_lossy(&q.stderr)
        );
        Some((x, y))
    })
    .clone()
}

fn xdna(args: &[&str], path: &Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(args)
        .arg(path)
        .output()
        .expect("run xdna");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn import(gguf: &Path, dir: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(["pack", "import", "--quiet", "-o"])
        .arg(dir)
        .arg(gguf)
        .output()
        .expect("run xdna pack import");
    assert!(
        out.status.success(),
        "import {}: {}",
        gguf.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `xdna pack check --json PATH`: exit status and the report.
fn check_json(path: &Path) -> (bool, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(["pack", "check", "--json"])
        .arg(path)
        .output()
        .expect("run xdna pack check");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "pack check --json {}: not JSON ({e}): {}",
            path.display(),
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out.status.success(), v)
}

/// The failed checks' names.
fn failed(report: &Value) -> Vec<String> {
    report["checks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["pass"] == false)
        .filter_map(|c| c["name"].as_str().map(str::to_string))
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Rewrites `dir/model.q4nx` through the safetensors writer: `bytes` may change a tensor's bytes
/// (its declared shape follows: `[len / chunk, chunk]` for tile grids), `extra` adds tensors,
/// `meta` edits the metadata.
fn rewrite_container(
    dir: &Path,
    bytes: impl Fn(&str, &[u8]) -> Vec<u8>,
    extra: &[(&str, Vec<u8>)],
    meta: impl FnOnce(&mut std::collections::BTreeMap<String, String>),
) {
    let path = dir.join("model.q4nx");
    let (mut decl, mut data) = (Vec::new(), Vec::new());
    let mut metadata;
    {
        let st = SafeTensors::open(&path).unwrap();
        metadata = st.metadata().clone();
        for e in st.entries() {
            let t = st.tensor(&e.name).unwrap();
            let b = bytes(&e.name, t.data);
            let mut shape = e.shape.clone();
            if b.len() != t.data.len() {
                let chunk = *shape.last().unwrap();
                shape = vec![b.len() / chunk, chunk];
            }
            decl.push(Declared {
                name: e.name.clone(),
                dtype: e.dtype,
                shape,
            });
            data.push(b);
        }
    }
    for (name, b) in extra {
        decl.push(Declared {
            name: name.to_string(),
            dtype: xdna::weights::safetensors::Dtype::F32,
            shape: vec![b.len() / 4],
        });
        data.push(b.clone());
    }
    meta(&mut metadata);
    let mut w = Writer::create(&path, &decl, &metadata).unwrap();
    for (d, b) in decl.iter().zip(&data) {
        w.write(&d.name, b).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn selftest_passes_and_every_control_fails_by_name() {
    let t = dflash_check::selftest(&scratch("selftest")).expect("selftest writes its packages");
    for (what, r) in &t.valid {
        assert!(
            r.passed(),
            "{what}: {:#?}",
            r.failures().collect::<Vec<_>>()
        );
    }
    assert_eq!(t.controls.len(), dflash_check::controls().len());
    for c in &t.controls {
        assert!(
            c.caught,
            "control {:?} not caught by {}: {} (failed: {:?})",
            c.control.what, c.control.expect, c.detail, c.failed
        );
        // The FAIL line names the tensor or key; the reason is in the detail.
        let subject = c.control.expect.split_once(' ').map_or("", |s| s.1);
        let line = format!("FAIL {}: {}", c.control.expect, c.detail);
        assert!(line.contains(subject) && c.detail.len() > 20, "{line}");
    }
    let by = |what: &str| {
        t.controls
            .iter()
            .find(|c| c.control.what.contains(what))
            .map(|c| c.detail.clone())
            .unwrap()
    };
    assert!(by("NaN").contains("scale NaN"), "{}", by("NaN"));
    assert!(by("one tile short").contains("holds 29 tiles"));
    assert!(by("block size").contains("records 8, config.json gives 16"));
    assert!(by("head_dim").contains("asked for [160, 320] but the file records [320, 320]"));

    let (ok, text) = xdna(
        &["pack", "check", "--selftest", "--keep"],
        &scratch("cli-selftest"),
    );
    assert!(ok, "{text}");
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("PASS control"))
            .count(),
        dflash_check::controls().len(),
        "{text}"
    );
    assert_eq!(
        text.lines().filter(|l| l.starts_with("PASS valid")).count(),
        2
    );
}

#[test]
fn real_drafts_pass_as_gguf_and_as_imported_packages() {
    let Some((x, y)) = drafts() else {
        return;
    };
    for gguf in [&x, &y] {
        let (ok, r) = check_json(gguf);
        assert!(
            ok && r["pass"] == true,
            "{}: {:?}",
            gguf.display(),
            failed(&r)
        );
        assert_eq!(r["container"], "gguf");
    }
    let (xp, yp) = (scratch("xpkg"), scratch("ypkg"));
    import(&x, &xp);
    import(&y, &yp);
    for pkg in [&xp, &yp] {
        let (ok, r) = check_json(pkg);
        assert!(
            ok && r["pass"] == true,
            "{}: {:?}",
            pkg.display(),
            failed(&r)
        );
        assert_eq!(r["container"], "package");
        let st = SafeTensors::open(pkg.join("model.q4nx")).unwrap();
        let meta = st.metadata();
        for (key, want) in [
            ("dflash.block_size", "16"),
            ("dflash.target_layer_ids", "1,10,19,28"),
            ("dflash.mask_token_id", "16"),
            ("dflash.rope_theta", "100000"),
            ("dflash.rms_norm_eps", "0.00001"),
            ("dflash.sliding_window", "0"),
            ("dflash.causal", "false"),
        ] {
            assert_eq!(meta.get(key).map(String::as_str), Some(want), "{key}");
        }
    }
    // The Q4_1 draft: every projection of the GGUF and the package passes the tile / block
    // checks and the q4_1 signature, with the same medians (a Q4_1 block is one tile cell).
    let medians = |r: &Value| -> Vec<f64> {
        r["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["name"].as_str().unwrap().starts_with("signature "))
            .map(|c| {
                let d = c["detail"].as_str().unwrap();
                let v = d.split("scale ").nth(1).unwrap().split(' ').next().unwrap();
                v.parse::<f64>().unwrap()
            })
            .collect()
    };
    let (_, rg) = check_json(&y);
    let (_, rp) = check_json(&yp);
    let (mg, mp) = (medians(&rg), medians(&rp));
    assert_eq!(mg.len(), 15, "7 projections × 2 layers + fc");
    assert_eq!(mg, mp);
    for m in &mg {
        assert!(
            (m - SIGNATURE_CENTER).abs() < SIGNATURE_TOLERANCE / 5.0,
            "{m}"
        );
    }
    let names = |r: &Value, prefix: &str| {
        r["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["name"].as_str().unwrap().starts_with(prefix))
            .count()
    };
    assert_eq!(names(&rp, "tiles "), 15);
    assert_eq!(names(&rg, "blocks "), 15);
    assert_eq!(names(&rp, "norm "), 10);
    assert_eq!(names(&rp, "scalar "), 7);
    // What passes the gate loads.
    let pkg = std::sync::Arc::new(xdna::weights::Package::open(&yp).unwrap());
    xdna::model::dflash::DflashWeights::load(&pkg, false).expect("the checked package loads");
}

#[test]
fn a_broken_real_draft_fails_by_name() {
    let Some((_, y)) = drafts() else {
        return;
    };
    let base = scratch("broken-base");
    import(&y, &base);
    let nan = half::f16::NAN.to_le_bytes();
    // (what, break the copy, the check that must fail, text its line must hold)
    type Edit = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Edit, &str, &str)> = vec![
        (
            "NaN scale",
            Box::new(move |d| {
                rewrite_container(
                    d,
                    |n, b| {
                        let mut b = b.to_vec();
                        if n == "model.layers.0.mlp.up_proj.weight" {
                            b[64..66].copy_from_slice(&nan);
                        }
                        b
                    },
                    &[],
                    |_| {},
                )
            }),
            "tiles model.layers.0.mlp.up_proj.weight",
            "scale NaN",
        ),
        (
            "one tile short",
            Box::new(|d| {
                rewrite_container(
                    d,
                    |n, b| {
                        let mut b = b.to_vec();
                        if n == "model.layers.1.mlp.down_proj.weight" {
                            b.truncate(b.len() - 5120);
                        }
                        b
                    },
                    &[],
                    |_| {},
                )
            }),
            "grid model.layers.1.mlp.down_proj.weight",
            "holds 107 tiles",
        ),
        (
            "unexplained tensor",
            Box::new(|d| {
                rewrite_container(
                    d,
                    |_, b| b.to_vec(),
                    &[("model.embed_tokens.weight", vec![0u8; 64])],
                    |_| {},
                )
            }),
            "unexplained model.embed_tokens.weight",
            "not one the draft uses",
        ),
        (
            "rope theta of the container",
            Box::new(|d| {
                rewrite_container(
                    d,
                    |_, b| b.to_vec(),
                    &[],
                    |m| {
                        m.insert("dflash.rope_theta".into(), "10000".into());
                    },
                )
            }),
            "scalar dflash.rope_theta",
            "model.q4nx records 10000, config.json gives 100000",
        ),
        (
            "a scalar missing from the container",
            Box::new(|d| {
                rewrite_container(
                    d,
                    |_, b| b.to_vec(),
                    &[],
                    |m| {
                        m.remove("dflash.causal");
                    },
                )
            }),
            "scalar dflash.causal",
            "missing from model.q4nx",
        ),
        (
            "block size of config.json",
            Box::new(|d| edit_config(d, |v| v["dflash_config"]["block_size"] = 8.into())),
            "scalar dflash.block_size",
            "model.q4nx records 16, config.json gives 8",
        ),
        (
            "head_dim of config.json",
            Box::new(|d| edit_config(d, |v| v["head_dim"] = 32.into())),
            "grid model.layers.0.self_attn.q_proj.weight",
            "asked for [288, 576] but the file records [576, 576]",
        ),
        (
            "not a draft",
            Box::new(|d| {
                edit_config(d, |v| {
                    v["model_type"] = "qwen3".into();
                    v.as_object_mut().unwrap().remove("dflash_config");
                })
            }),
            "config config.json",
            "not a DFlash draft",
        ),
    ];
    for (i, (what, edit, expect, text)) in cases.iter().enumerate() {
        let dir = scratch(&format!("broken-{i}"));
        copy_dir(&base, &dir);
        edit(&dir);
        let (ok, r) = check_json(&dir);
        assert!(!ok && r["pass"] == false, "{what}: passed");
        let c = r["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == *expect)
            .unwrap_or_else(|| panic!("{what}: no check {expect}: {:?}", failed(&r)));
        let detail = c["detail"].as_str().unwrap();
        assert!(
            c["pass"] == false && detail.contains(text),
            "{what}: {expect}: {detail}"
        );
        // The text report: one FAIL line naming the tensor or key.
        let (ok, lines) = xdna(&["pack", "check"], &dir);
        assert!(!ok);
        assert!(
            lines
                .lines()
                .any(|l| l.starts_with(&format!("FAIL {expect}: "))),
            "{what}: {lines}"
        );
    }

    // The GGUF itself, with one NaN block scale.
    let bad = scratch("nan.gguf");
    std::fs::copy(&y, &bad).unwrap();
    let at = {
        let f = GgufFile::open(&bad).unwrap();
        let info = f
            .tensor_infos()
            .iter()
            .find(|t| t.name == "blk.0.ffn_up.weight")
            .unwrap();
        f.data_offset() + info.offset as usize + 20 * 7
    };
    let mut bytes = std::fs::read(&bad).unwrap();
    bytes[at..at + 2].copy_from_slice(&nan);
    std::fs::write(&bad, bytes).unwrap();
    let (ok, r) = check_json(&bad);
    assert!(!ok);
    assert_eq!(failed(&r), ["blocks blk.0.ffn_up.weight"]);
}

#[test]
fn a_generation_2_gguf_is_recognised_and_checked_by_shape() {
    let Some((x, _)) = drafts() else {
        return;
    };
    let Some(bin) = llama_cpp_bin() else {
        return;
    };
    let make = |out: &Path, extra: &[&str]| {
        let run = Command::new("python3")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/support/dflash2_gguf.py"
            ))
            .arg(&x)
            .arg(out)
            .args(["4", "18", "32", "4"])
            .args(extra)
            .env("PYTHONPATH", gguf_py(&bin))
            .output()
            .expect("run python3");
        assert!(
            run.status.success(),
            "dflash2_gguf.py: {}",
            String::from_utf8_lossy(&run.stderr)
        );
    };
    let good = scratch("gen2.gguf");
    make(&good, &[]);
    let (ok, r) = check_json(&good);
    assert!(ok, "{:?}", failed(&r));
    let names: Vec<&str> = r["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    for want in [
        "key dflash.conv_kernel_size",
        "key dflash.selector_top_k",
        "tensor blk.1.ffn_conv_base",
        "grid blk.0.attn_conv_proj.weight",
        "grid selector_predecessor.weight",
        "grid selector_hidden.weight",
    ] {
        assert!(names.contains(&want), "{want} not checked: {names:?}");
    }
    let bad = scratch("gen2-bad.gguf");
    make(&bad, &["--proj-rows", "200"]);
    let (ok, r) = check_json(&bad);
    assert!(!ok);
    let f = failed(&r);
    assert!(
        f.contains(&"grid blk.0.attn_conv_proj.weight".to_string())
            && f.contains(&"grid blk.1.ffn_conv_proj.weight".to_string()),
        "{f:?}"
    );
}

#[test]
fn what_is_not_a_draft_fails_closed() {
    let missing = scratch("no-such-draft");
    let (ok, r) = check_json(&missing);
    assert!(!ok);
    assert_eq!(failed(&r), [format!("container {}", missing.display())]);
    let Some(target) = smollm2::smollm2_gguf() else {
        return;
    };
    let (ok, r) = check_json(&target);
    assert!(!ok);
    let f = failed(&r);
    assert!(
        f.contains(&"config general.architecture".to_string())
            && f.contains(&format!(
                "tensors {}",
                target.file_name().unwrap().to_string_lossy()
            )),
        "{f:?}"
    );
    let (ok, text) = xdna(&["pack", "check"], &target);
    assert!(
        !ok && text.contains("FAIL config general.architecture: \"llama\": not a DFlash draft"),
        "{text}"
    );
}
