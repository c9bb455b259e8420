//! Argument groups the binaries share (`xdna`, `forward-serve`, `replay-check`). The library never
//! parses arguments itself: the binaries flatten these groups into their own `clap` parsers.

use crate::model::load::{Backend, LoadOptions};
use clap::builder::PossibleValue;
use std::path::PathBuf;

/// Which model to load, on which backend, with which kernel set: the arguments of every command
/// that loads a model.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// Package directory or GGUF file (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(id = "model", long = "model", value_name = "MODEL")]
    pub path: Option<PathBuf>,
    /// Executor of the projections (auto: xdna when an amdxdna device opens and can run the
    /// kernel set, else host).
    #[arg(long, value_enum, default_value_t = Backend::Auto, env = "XDNA_BACKEND")]
    pub backend: Backend,
    /// Kernel set directory (default: the package's `kernels/`).
    #[arg(long, env = "XDNA_KERNELS")]
    pub kernels: Option<PathBuf>,
}

impl ModelArgs {
    /// The loader's options for these arguments; `exact` selects the exact reference projections.
    pub fn load_options(&self, exact: bool) -> LoadOptions {
        LoadOptions {
            backend: self.backend,
            kernels: self.kernels.clone(),
            exact,
        }
    }
}

impl clap::ValueEnum for Backend {
    fn value_variants<'a>() -> &'a [Self] {
        &[Backend::Auto, Backend::Host, Backend::Xdna]
    }

    // No per-value help: it would switch every command's `--help` to the long layout.
    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(match self {
            Backend::Auto => "auto",
            Backend::Host => "host",
            Backend::Xdna => "xdna",
        }))
    }
}
