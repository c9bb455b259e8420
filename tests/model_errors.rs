//! Broken model packages give clear errors naming what is missing: a package without one
//! of its tensors, and a package whose kernel set lacks a shape the model needs.

#[path = "model_common.rs"]
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use xdna::model::load::open_package;
use xdna::weights::safetensors::{Declared, SafeTensors, Writer};

fn xdna(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_xdna"))
        .args(args)
        .output()
        .expect("run xdna");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A scratch copy of the SmolLM2 package: every file but `model.q4nx`, which `write_weights`
/// provides; kernels copied too.
fn copy_package(from: &Path, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("xdna-model-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("kernels")).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let file = entry.file_name();
        if entry.file_type().unwrap().is_file() && file != "model.q4nx" {
            std::fs::copy(entry.path(), dir.join(&file)).unwrap();
        }
    }
    for entry in std::fs::read_dir(from.join("kernels")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join("kernels").join(entry.file_name())).unwrap();
    }
    dir
}

/// Rewrite `src` into `dst` without the tensor `skip`.
fn write_weights(src: &SafeTensors, dst: &Path, skip: Option<&str>) {
    let keep: Vec<_> = src
        .entries()
        .iter()
        .filter(|e| Some(e.name.as_str()) != skip)
        .collect();
    let declared: Vec<Declared> = keep
        .iter()
        .map(|e| Declared {
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
        })
        .collect();
    let meta: BTreeMap<String, String> = src.metadata().clone();
    let mut w = Writer::create(dst, &declared, &meta).unwrap();
    for e in keep {
        w.write(&e.name, src.tensor(&e.name).unwrap().data).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn package_missing_a_tensor_or_a_kernel_is_refused_by_name() {
    let Some(gguf) = common::smollm2_gguf() else {
        return;
    };
    let pkg = open_package(&gguf).expect("package");
    let missing = "model.layers.7.mlp.down_proj.weight";
    assert!(pkg.weights().contains(missing), "tensor naming changed");

    // Control: an intact copy runs.
    let good = copy_package(pkg.dir(), "good");
    write_weights(pkg.weights(), &good.join("model.q4nx"), None);
    let args = |dir: &Path| -> Vec<String> {
        [
            "run",
            "--model",
            &dir.to_string_lossy(),
            "--prompt",
            "Hi",
            "--max-tokens",
            "2",
        ]
        .map(String::from)
        .to_vec()
    };
    let run = |dir: &Path| {
        let a = args(dir);
        xdna(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (ok, err) = run(&good);
    assert!(ok, "intact copy failed: {err}");

    // One tensor gone.
    let no_tensor = copy_package(pkg.dir(), "tensor");
    write_weights(pkg.weights(), &no_tensor.join("model.q4nx"), Some(missing));
    let (ok, err) = run(&no_tensor);
    assert!(!ok, "a package without {missing} ran");
    assert!(
        err.contains(missing),
        "error does not name the tensor: {err}"
    );

    // One kernel file gone.
    let no_kernel = copy_package(pkg.dir(), "kernel");
    write_weights(pkg.weights(), &no_kernel.join("model.q4nx"), None);
    let victim = std::fs::read_dir(no_kernel.join("kernels"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .find(|n| n.contains("_m16_") && n.contains("k1536"))
        .expect("the down-projection m16 kernel");
    std::fs::remove_file(no_kernel.join("kernels").join(&victim)).unwrap();
    let (ok, err) = run(&no_kernel);
    assert!(!ok, "a package without kernel {victim} ran");
    assert!(
        err.contains(&victim),
        "error does not name the kernel file: {err}"
    );

    for d in [good, no_tensor, no_kernel] {
        let _ = std::fs::remove_dir_all(d);
    }
}
