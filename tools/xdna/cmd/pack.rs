//! `xdna pack`: import GGUF files into packages, inspect packages and GGUF files.

use std::path::PathBuf;
use xdna::tiles::ScaleType;
use xdna::tiles::WeightFormat;
use xdna::weights::dflash_check;
use xdna::weights::gguf::GgufFile;
use xdna::weights::import::{self, ImportOptions};
use xdna::weights::safetensors::SafeTensors;
use xdna::weights::{Package, TensorRole, WeightsError};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand)]
enum Cmd {
    /// Convert a GGUF (llama) file into a package directory.
    Import {
        /// The GGUF file.
        gguf: PathBuf,
        /// Output package directory.
        #[arg(short, long)]
        output: PathBuf,
        /// Tile scale type: f16 (exact to GGUF) or bf16 (FastFlowLM's choice).
        #[arg(long, default_value = "f16")]
        scale: String,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// List tensors (roles, dtypes/formats, shapes, bytes) of a package dir, .q4nx or .gguf file;
    /// for a GGUF file also the host kernel and the device format each matrix would get, and
    /// whether the file imports, before anything is loaded.
    Info {
        path: PathBuf,
        /// One JSON object (GGUF files only).
        #[arg(long)]
        json: bool,
    },
    /// Compare a package's matrices with the GGUF it was imported from (max abs / rms error).
    Compare { package: PathBuf, gguf: PathBuf },
    /// The DFlash draft gate: check a draft package (directory, or its model.q4nx) or a dflash
    /// GGUF before any loader reads it; one PASS/FAIL line per check, exit status 1 on any FAIL.
    Check {
        /// The package directory, its model.q4nx, or a .gguf file.
        #[arg(required_unless_present = "selftest")]
        path: Option<PathBuf>,
        /// One JSON object: {path, container, pass, checks: [{name, pass, detail}]}.
        #[arg(long)]
        json: bool,
        /// Write a synthetic valid draft package and negative controls that must each fail by
        /// name (in a temporary directory, removed afterwards unless --keep).
        #[arg(long, conflicts_with = "path")]
        selftest: bool,
        /// With --selftest: keep the synthetic packages in this directory.
        #[arg(long, requires = "selftest")]
        keep: Option<PathBuf>,
    },
    /// Print the default model's package directory (downloading/importing it if needed); also
    /// imports the DFlash draft shipped for it.
    Default,
    /// Write a deterministic small random-weight package (with its kernel set) for tests and
    /// benches: a Qwen3.5-style hybrid (Gated DeltaNet + gated attention) or a Llama.
    Synth(SynthArgs),
}

#[derive(clap::Args)]
struct SynthArgs {
    /// qwen3_5 (hybrid) or llama.
    #[arg(long, default_value = "qwen3_5")]
    arch: String,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    hidden: Option<usize>,
    #[arg(long)]
    intermediate: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long)]
    head_dim: Option<usize>,
    #[arg(long)]
    vocab: Option<usize>,
    /// Every N-th layer is full attention (hybrid).
    #[arg(long)]
    full_attention_interval: Option<usize>,
    #[arg(long)]
    linear_key_heads: Option<usize>,
    #[arg(long)]
    linear_value_heads: Option<usize>,
    #[arg(long)]
    linear_key_head_dim: Option<usize>,
    #[arg(long)]
    linear_value_head_dim: Option<usize>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output package directory.
    #[arg(short, long)]
    output: PathBuf,
}

fn synth(a: SynthArgs) -> xdna::Result<()> {
    use xdna::model::synthetic::{self, SynthArch, SynthOptions};
    let arch = match a.arch.as_str() {
        "qwen3_5" | "qwen3.5" => SynthArch::Qwen35,
        "llama" => SynthArch::Llama,
        s => {
            return Err(xdna::Error::Usage(format!(
                "--arch {s:?}: expected qwen3_5 or llama"
            )))
        }
    };
    let d = SynthOptions::default();
    let o = SynthOptions {
        arch,
        layers: a.layers.unwrap_or(d.layers),
        hidden: a.hidden.unwrap_or(d.hidden),
        intermediate: a.intermediate.unwrap_or(d.intermediate),
        heads: a.heads.unwrap_or(d.heads),
        kv_heads: a.kv_heads.unwrap_or(d.kv_heads),
        head_dim: a.head_dim.unwrap_or(d.head_dim),
        vocab: a.vocab.unwrap_or(d.vocab),
        full_attention_interval: a
            .full_attention_interval
            .unwrap_or(d.full_attention_interval),
        linear_key_heads: a.linear_key_heads.unwrap_or(d.linear_key_heads),
        linear_value_heads: a.linear_value_heads.unwrap_or(d.linear_value_heads),
        linear_key_head_dim: a.linear_key_head_dim.unwrap_or(d.linear_key_head_dim),
        linear_value_head_dim: a.linear_value_head_dim.unwrap_or(d.linear_value_head_dim),
        conv_kernel: d.conv_kernel,
        seed: a.seed,
    };
    let c = synthetic::write_synthetic(&a.output, &o)?;
    let keys = match arch {
        SynthArch::Qwen35 => synthetic::synthetic_kernel_keys(&c, synthetic::SYNTH_FORMAT),
        SynthArch::Llama => super::kernels::package_keys(
            &a.output,
            &[synthetic::SYNTH_FORMAT],
            &[synthetic::SYNTH_FORMAT],
        )?,
    };
    let kernels = a.output.join("kernels");
    let written = super::kernels::write_kernels(&keys, &kernels, true)?;
    eprintln!(
        "wrote {} ({} {} layers, seed {}, {} kernels in {})",
        a.output.display(),
        c.model_type,
        c.layers,
        o.seed,
        written.len(),
        kernels.display()
    );
    Ok(())
}

/// `xdna pack check PATH`: the gate's report; an error (exit status 1) when any check failed.
fn check(path: &std::path::Path, json: bool) -> xdna::Result<()> {
    let report = dflash_check::check(path);
    if json {
        println!("{}", report.to_json());
    } else {
        for line in report.lines() {
            println!("{line}");
        }
    }
    let failed: Vec<&str> = report.failures().map(|c| c.name.as_str()).collect();
    if failed.is_empty() && report.passed() {
        if !json {
            println!(
                "pack check {}: all {} checks passed",
                path.display(),
                report.checks.len()
            );
        }
        return Ok(());
    }
    Err(WeightsError::Invalid {
        path: path.to_path_buf(),
        what: format!(
            "pack check: {} of {} checks failed: {}",
            failed.len(),
            report.checks.len(),
            failed.join(", ")
        ),
    }
    .into())
}

/// `xdna pack check --selftest`: the synthetic valid packages must pass, every negative control
/// must fail by the check named for it.
fn check_selftest(keep: Option<PathBuf>, json: bool) -> xdna::Result<()> {
    let root = match &keep {
        Some(dir) => dir.clone(),
        None => {
            std::env::temp_dir().join(format!("xdna-pack-check-selftest-{}", std::process::id()))
        }
    };
    let outcome = dflash_check::selftest(&root);
    if keep.is_none() {
        // Best effort: a leftover temporary directory is not worth failing the selftest for.
        let _ = std::fs::remove_dir_all(&root);
    }
    let t = outcome?;
    if json {
        let v = serde_json::json!({
            "pass": t.passed(),
            "valid": t.valid.iter().map(|(what, r)| serde_json::json!({
                "what": what, "pass": r.passed(), "report": r.to_json(),
            })).collect::<Vec<_>>(),
            "controls": t.controls.iter().map(|c| serde_json::json!({
                "what": c.control.what, "expect": c.control.expect, "caught": c.caught,
                "detail": c.detail, "failed": c.failed,
            })).collect::<Vec<_>>(),
        });
        println!("{v}");
    } else {
        for (what, r) in &t.valid {
            let verdict = if r.passed() { "PASS" } else { "FAIL" };
            println!("{verdict} {what}: {} checks", r.checks.len());
            for c in r.failures() {
                println!("  FAIL {}: {}", c.name, c.detail);
            }
        }
        for c in &t.controls {
            let verdict = if c.caught { "PASS" } else { "FAIL" };
            println!(
                "{verdict} control {:?}: {} {}: {}",
                c.control.what,
                if c.caught {
                    "caught by"
                } else {
                    "NOT caught by"
                },
                c.control.expect,
                c.detail
            );
        }
    }
    if t.passed() {
        return Ok(());
    }
    let missed: Vec<String> = t
        .valid
        .iter()
        .filter(|(_, r)| !r.passed())
        .map(|(w, _)| format!("{w} failed"))
        .chain(
            t.controls
                .iter()
                .filter(|c| !c.caught)
                .map(|c| format!("control {:?} not caught", c.control.what)),
        )
        .collect();
    Err(WeightsError::Other(format!("pack check --selftest: {}", missed.join("; "))).into())
}

fn human(n: u64) -> String {
    if n >= 1 << 20 {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    } else if n >= 1 << 10 {
        format!("{:.1} KiB", n as f64 / 1024.0)
    } else {
        format!("{n} B")
    }
}

pub fn run(args: Args) -> xdna::Result<()> {
    match args.cmd {
        Cmd::Import {
            gguf,
            output,
            scale,
            quiet,
        } => {
            let scale = match scale.as_str() {
                "f16" => ScaleType::F16,
                "bf16" => ScaleType::Bf16,
                s => {
                    return Err(xdna::Error::Usage(format!(
                        "--scale {s:?}: expected f16 or bf16"
                    )))
                }
            };
            import::import_gguf(
                &gguf,
                &output,
                ImportOptions {
                    scale,
                    progress: !quiet,
                },
            )?;
            let pkg = Package::open_dir(&output)?;
            if pkg.config().is_hybrid() {
                // Hybrid (Gated DeltaNet) models run on the host backend only: no kernel set.
                eprintln!(
                    "wrote {} (hybrid {} layers; host backend only, no kernel set)",
                    output.display(),
                    pkg.config().layers
                );
                return Ok(());
            }
            if let Some((name, format)) = pkg.host_only_matrix() {
                eprintln!(
                    "wrote {} ({name} and others are {}, GGUF block rows: host backend only, no kernel set)",
                    output.display(),
                    format.name()
                );
                return Ok(());
            }
            // The package's kernel set: every shape it needs, in the weight formats it was
            // written with (f16 scales → q41h / q8h, bf16 → q41 / q8).
            let (wfmt, head) = match scale {
                ScaleType::F16 => ("q41h", "q8h"),
                ScaleType::Bf16 => ("q41", "q8"),
            };
            let keys = super::kernels::package_keys(
                &output,
                &[WeightFormat::from_name(wfmt).map_err(|e| xdna::Error::Usage(e.to_string()))?],
                &[WeightFormat::from_name(head).map_err(|e| xdna::Error::Usage(e.to_string()))?],
            )?;
            let kernels = output.join("kernels");
            let written = super::kernels::write_kernels(&keys, &kernels, true)?;
            eprintln!(
                "wrote {} ({} kernels in {})",
                output.display(),
                written.len(),
                kernels.display()
            );
            Ok(())
        }
        Cmd::Info { path, json } => info(&path, json),
        Cmd::Compare { package, gguf } => {
            let pkg = Package::open(&package)?;
            let (q41, q8) = import::compare(&pkg, &gguf)?;
            println!("scale type: {:?}", pkg.weights().scale_type());
            for (name, s) in [("q4_1", q41), ("q8", q8)] {
                println!(
                    "{name:5} values {:>10}  max_abs {:.3e}  rms {:.3e}  (max |w| {:.3})",
                    s.values,
                    s.max_abs,
                    s.rms(),
                    s.max_ref
                );
            }
            Ok(())
        }
        Cmd::Synth(a) => synth(a),
        Cmd::Check {
            path,
            json,
            selftest,
            keep,
        } => match path {
            Some(p) if !selftest => check(&p, json),
            _ => check_selftest(keep, json),
        },
        Cmd::Default => {
            let dir = xdna::weights::default_model()?;
            // The DFlash draft shipped for it (`--speculate dflash`), imported now like the model.
            let draft = xdna::weights::default_model::default_dflash_draft()?;
            let draft_pkg = xdna::weights::import::cached_import(&draft)?;
            tracing::info!(target: xdna::STATUS_TARGET, "DFlash draft: {}", draft_pkg.display());
            println!("{}", dir.display());
            Ok(())
        }
    }
}

fn info(path: &std::path::Path, json: bool) -> xdna::Result<()> {
    let is_gguf = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if is_gguf {
        return gguf_info(path, json);
    }
    if json {
        return Err(xdna::Error::Usage(
            "--json: only for GGUF files (a package's tensors are listed as text)".into(),
        ));
    }
    let (st, pkg) = if path.is_dir() {
        let pkg = Package::open(path)?;
        (None, Some(pkg))
    } else {
        (Some(SafeTensors::open(path)?), None)
    };
    let st = match (&st, &pkg) {
        (Some(s), _) => s,
        (None, Some(p)) => p.weights(),
        _ => return Err(xdna::Error::Usage("nothing to show".into())),
    };
    if let Some(p) = &pkg {
        let c = p.config();
        println!(
            "{}: {} layers {} hidden {} ffn {} heads {}/{} head_dim {} vocab {} rope_theta {} ctx {} tied {} fused {}",
            path.display(),
            c.model_type,
            c.layers,
            c.hidden,
            c.intermediate,
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.vocab,
            c.rope_theta,
            c.max_position_embeddings,
            c.tie_word_embeddings,
            p.fused()
        );
        println!(
            "tokenizer: {} tokens, pre {:?}; eos {:?} bos {:?} add_bos {}; chat template: {}",
            p.tokenizer().vocab_size(),
            p.tokenizer().pre_tokenizer(),
            p.eos_token_ids(),
            p.bos_token_id(),
            p.add_bos(),
            if p.chat_template().is_some() {
                "yes"
            } else {
                "no"
            }
        );
    }
    println!(
        "{}: safetensors, header {} bytes, {} tensors, scale {:?}, tile order {:?}",
        st.path().display(),
        st.header_len(),
        st.entries().len(),
        st.scale_type(),
        st.tile_order()
    );
    println!(
        "{:<48} {:<11} {:<6} {:<8} {:<18} {:<12} {:>10}",
        "tensor", "role", "dtype", "format", "shape", "logical", "bytes"
    );
    let mut total = 0u64;
    let mut by_role: std::collections::BTreeMap<&str, u64> = Default::default();
    for e in st.entries() {
        let bytes = (e.end - e.start) as u64;
        total += bytes;
        let role = TensorRole::of(&e.name);
        *by_role.entry(role.name()).or_default() += bytes;
        let fmt = st
            .format_of(&e.name)
            .map(|f| f.name().to_string())
            .unwrap_or_else(|_| "-".into());
        let logical = st
            .recorded_shape(&e.name)
            .map(|(r, c)| format!("{r}x{c}"))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<48} {:<11} {:<6} {:<8} {:<18} {:<12} {:>10}",
            e.name,
            role.name(),
            e.dtype.name(),
            fmt,
            format!("{:?}", e.shape),
            logical,
            bytes
        );
    }
    for (role, b) in by_role {
        println!("  {role:<12} {}", human(b));
    }
    println!(
        "total: {} tensors, {} ({total} bytes)",
        st.entries().len(),
        human(total)
    );
    Ok(())
}

/// What one GGUF tensor becomes: the package format it is imported to, the kernel the host
/// executor runs it with on this CPU, and the device format (or why there is none).
struct TensorPlan {
    format: Option<String>,
    host: String,
    device: String,
}

fn tensor_plan(f: &GgufFile, t: &xdna::weights::gguf::TensorInfo) -> TensorPlan {
    if t.shape.len() != 2 {
        return TensorPlan {
            format: None,
            host: "read once as f32 (vector)".into(),
            device: "f32 vector (host-side)".into(),
        };
    }
    let format = f
        .tensor(&t.name)
        .ok_or_else(|| xdna::weights::WeightsError::Other(format!("{}: not found", t.name)))
        .and_then(|view| import::weight_format(f, &view, ScaleType::F16));
    match format {
        Ok(format) => TensorPlan {
            format: Some(format.name().to_string()),
            host: xdna::kernels::gemm::HostExecutor::global().kernel_for(format),
            device: match format {
                WeightFormat::Ggml(ty) => format!(
                    "none: host only (no device kernel reads ggml {} rows; Q4_1, Q8_0 do)",
                    ty.name()
                ),
                WeightFormat::Q41 { .. } | WeightFormat::Q8 { .. } => {
                    format!("{} tiles (exact re-layout)", format.name())
                }
                other => format!("{} rows", other.name()),
            },
        },
        Err(e) => TensorPlan {
            format: None,
            host: format!("refused: {e}"),
            device: "refused".into(),
        },
    }
}

fn gguf_info(path: &std::path::Path, json: bool) -> xdna::Result<()> {
    let f = GgufFile::open(path)?;
    // The whole-file decision (architecture, names, shapes, types) the import would make.
    let import_verdict = import::plan_any(&f, ScaleType::F16).map(|_| ());
    let plans: Vec<TensorPlan> = f
        .tensor_infos()
        .iter()
        .map(|t| tensor_plan(&f, t))
        .collect();
    if json {
        let tensors: Vec<serde_json::Value> = f
            .tensor_infos()
            .iter()
            .zip(&plans)
            .map(|(t, p)| {
                serde_json::json!({
                    "name": t.name,
                    "role": TensorRole::of(&t.name).name(),
                    "type": t.ggml_type.name(),
                    "shape": t.shape,
                    "bytes": t.size,
                    "package_format": p.format,
                    "host_kernel": p.host,
                    "device": p.device,
                })
            })
            .collect();
        let v = serde_json::json!({
            "path": path.display().to_string(),
            "version": f.version(),
            "architecture": f.architecture(),
            "tensors": tensors,
            "imports": import_verdict.is_ok(),
            "refusal": import_verdict.as_ref().err().map(|e| e.to_string()),
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "{}: GGUF v{}, {} metadata entries, {} tensors, alignment {}",
        path.display(),
        f.version(),
        f.metadata_entries().len(),
        f.tensor_infos().len(),
        f.alignment()
    );
    for (k, v) in f.metadata_entries() {
        let shown = match v {
            xdna::weights::gguf::Value::Array(a) => format!(
                "[{} × {}]",
                a.len(),
                a.first().map(|x| x.type_name()).unwrap_or("?")
            ),
            xdna::weights::gguf::Value::String(s) if s.len() > 60 => format!(
                "{:?}… ({} bytes)",
                &s[..s.char_indices().nth(50).map(|x| x.0).unwrap_or(s.len())],
                s.len()
            ),
            other => format!("{other:?}"),
        };
        println!("  {k} = {shown}");
    }
    let mut total = 0u64;
    println!(
        "{:<32} {:<10} {:<8} {:<14} {:>10}  {:<52} device",
        "tensor", "role", "type", "shape", "bytes", "host kernel"
    );
    for (t, p) in f.tensor_infos().iter().zip(&plans) {
        total += t.size as u64;
        println!(
            "{:<32} {:<10} {:<8} {:<14} {:>10}  {:<52} {}",
            t.name,
            TensorRole::of(&t.name).name(),
            t.ggml_type.name(),
            format!("{:?}", t.shape),
            t.size,
            p.host,
            p.device
        );
    }
    println!(
        "total: {} tensors, {} ({total} bytes)",
        f.tensor_infos().len(),
        human(total)
    );
    let host_only = f
        .tensor_infos()
        .iter()
        .zip(&plans)
        .find(|(_, p)| p.format.as_deref().is_some_and(|n| n.starts_with("ggml_")));
    match (import_verdict, host_only) {
        (Ok(()), None) => println!("import: yes (host and xdna backends)"),
        (Ok(()), Some((t, _))) => println!(
            "import: yes, host backend only ({} is ggml {}, which no device kernel reads)",
            t.name,
            t.ggml_type.name()
        ),
        (Err(e), _) => println!("import: refused: {e}"),
    }
    Ok(())
}
