//! `xdna kernels build | list | wrap`: per-shape kernel ELF files (format: docs/kernel-elf.md).

use std::path::{Path, PathBuf};

use clap::Subcommand;
use xdna::kernels::elf::{self, KernelDesc};
use xdna::kernels::set::{distinct_keys, parse_shape_list};
use xdna::kernels::{family_needs, KernelError, KernelKey, KernelSet, RowFamily};
use xdna::tiles::WeightFormat;
use xdna::weights::ModelConfig;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    which: Which,
}

#[derive(Subcommand)]
enum Which {
    /// Build descriptor-only kernel files from a shape list or a model package.
    Build(BuildArgs),
    /// List the kernels in a directory (validating every file).
    List {
        /// Kernel directory.
        dir: PathBuf,
    },
    /// Add the descriptor note to a toolchain-built full ELF (control-code flag set).
    Wrap(WrapArgs),
}

#[derive(clap::Args)]
struct BuildArgs {
    /// Shape list: one kernel per line, `op wfmt family K N` (`#` comments).
    #[arg(
        long,
        conflicts_with = "for_package",
        required_unless_present = "for_package"
    )]
    shapes: Option<PathBuf>,
    /// Model package directory: its config.json gives the shapes (fused QKV, O, fused gate+up,
    /// down, lm_head; families 16 and 128).
    #[arg(long = "for")]
    for_package: Option<PathBuf>,
    /// Projection weight format(s) for --for (comma-separated, e.g. `q41,q41h`).
    #[arg(long, default_value = "q41h", value_delimiter = ',')]
    wfmt: Vec<String>,
    /// lm_head weight format(s) for --for (comma-separated).
    #[arg(long, default_value = "q8h", value_delimiter = ',')]
    head_wfmt: Vec<String>,
    /// Output directory (created if missing).
    #[arg(short = 'o', long)]
    out: PathBuf,
}

#[derive(clap::Args)]
struct WrapArgs {
    /// Toolchain-built full ELF.
    input: PathBuf,
    /// Operation (e.g. `gemm`).
    #[arg(long)]
    op: String,
    /// Weight format name (e.g. `q41h`).
    #[arg(long)]
    wfmt: String,
    /// Row family (16 or 128).
    #[arg(long)]
    family: u32,
    /// Logical K.
    #[arg(long)]
    k: u32,
    /// N.
    #[arg(long)]
    n: u32,
    /// Output file (by convention named `<op>_<wfmt>_m<family>_k<K>_n<N>.elf`).
    #[arg(short = 'o', long)]
    out: PathBuf,
}

pub fn run(args: Args) -> xdna::Result<()> {
    match args.which {
        Which::Build(a) => build(a),
        Which::List { dir } => list(&dir),
        Which::Wrap(a) => wrap(a),
    }
}

fn formats(names: &[String], option: &str) -> xdna::Result<Vec<WeightFormat>> {
    names
        .iter()
        .map(|n| {
            WeightFormat::from_name(n.trim())
                .map_err(|e| xdna::Error::Usage(format!("{option}: {e}")))
        })
        .collect()
}

/// Every kernel a package needs (fused QKV, O, fused gate+up, down, lm_head; families 16 and 128)
/// for the given projection and lm_head weight formats, from its `config.json`.
pub fn package_keys(
    package: &Path,
    wfmts: &[WeightFormat],
    head_wfmts: &[WeightFormat],
) -> xdna::Result<Vec<KernelKey>> {
    let config = ModelConfig::from_file(&package.join("config.json"))?;
    let mut needs = Vec::new();
    for &wfmt in wfmts {
        for &head in head_wfmts {
            needs.extend(family_needs(&config.kernel_shapes(wfmt, head)));
        }
    }
    Ok(distinct_keys(&needs))
}

/// Writes the kernel files of `keys` into `out` (plus `shapes.txt` when `with_shape_list`),
/// returning the paths written.
pub fn write_kernels(
    keys: &[KernelKey],
    out: &Path,
    with_shape_list: bool,
) -> xdna::Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(out).map_err(|e| xdna::Error::io(out, e))?;
    let mut shape_list = String::from("# op wfmt family K N  (xdna kernels build --shapes)\n");
    let mut written = Vec::with_capacity(keys.len());
    for key in keys {
        written.push(elf::write_kernel(out, &key.descriptor())?);
        shape_list.push_str(&format!(
            "{} {} {} {} {}\n",
            key.op, key.wfmt, key.family, key.k, key.n
        ));
    }
    if with_shape_list {
        let path = out.join("shapes.txt");
        std::fs::write(&path, shape_list).map_err(|e| xdna::Error::io(&path, e))?;
    }
    Ok(written)
}

fn build(args: BuildArgs) -> xdna::Result<()> {
    let keys: Vec<KernelKey> = if let Some(path) = &args.shapes {
        let text = std::fs::read_to_string(path).map_err(|e| xdna::Error::io(path, e))?;
        parse_shape_list(path, &text)?
    } else if let Some(package) = &args.for_package {
        package_keys(
            package,
            &formats(&args.wfmt, "--wfmt")?,
            &formats(&args.head_wfmt, "--head-wfmt")?,
        )?
    } else {
        return Err(xdna::Error::Usage(
            "give --shapes FILE or --for PACKAGE".into(),
        ));
    };
    for path in write_kernels(&keys, &args.out, args.for_package.is_some())? {
        println!("{}", path.display());
    }
    eprintln!("{} kernel(s) written to {}", keys.len(), args.out.display());
    Ok(())
}

fn list(dir: &Path) -> xdna::Result<()> {
    let set = KernelSet::load(dir)?;
    println!(
        "{:<40} {:>4} {:<8} {:>6} {:>6} {:>6} {:>5}  args",
        "file", "op", "wfmt", "family", "K", "N", "ctrl"
    );
    for (_, path, desc) in set.iter() {
        let args: Vec<String> = desc
            .args
            .iter()
            .map(|a| format!("{}:{:?}/{:?}", a.name, a.direction, a.role))
            .collect();
        println!(
            "{:<40} {:>4} {:<8} {:>6} {:>6} {:>6} {:>5}  {}",
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            desc.op,
            desc.wfmt.name(),
            desc.family,
            desc.k,
            desc.n,
            if desc.has_control_code { "yes" } else { "no" },
            args.join(" ")
        );
    }
    eprintln!("{} kernel(s) in {}", set.len(), dir.display());
    Ok(())
}

fn wrap(args: WrapArgs) -> xdna::Result<()> {
    let wfmt = WeightFormat::from_name(&args.wfmt)
        .map_err(|e| xdna::Error::Usage(format!("--wfmt: {e}")))?;
    let family = RowFamily::from_rows(args.family)
        .ok_or_else(|| xdna::Error::Usage("--family must be 16 or 128".into()))?;
    let mut desc = KernelDesc::gemm(wfmt, family, args.k, args.n);
    desc.op = args.op;
    let input = std::fs::read(&args.input).map_err(|e| xdna::Error::io(&args.input, e))?;
    let wrapped =
        elf::wrap_elf(&input, &desc).map_err(|reason| KernelError::elf(&args.input, reason))?;
    std::fs::write(&args.out, &wrapped).map_err(|e| xdna::Error::io(&args.out, e))?;
    // Read back what was written: the output must pass the same checks as any kernel file.
    elf::read_kernel(&args.out)?;
    let expected = desc.file_name();
    if args.out.file_name().and_then(|n| n.to_str()) != Some(expected.as_str()) {
        eprintln!("note: a kernel directory expects this file to be named {expected}");
    }
    println!("{}", args.out.display());
    Ok(())
}
