//! Argument groups the binaries share (`xdna`, `forward-serve`, `replay-check`), and the log
//! subscriber they install. The library never parses arguments or installs a subscriber itself:
//! the binaries flatten these groups into their own `clap` parsers and call [`init_logging`].

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

/// Installs the process's log subscriber, writing to stderr.
///
/// The filter is `RUST_LOG` when set and valid, else `default_filter` (`EnvFilter` syntax, e.g.
/// `warn` or `xdna=debug`). Status events (target [`crate::STATUS_TARGET`]) are shown at info
/// unless the filter names that target itself, as plain `xdna: …` lines: they are part of what
/// a command tells its user. Every other event is printed in tracing's usual format, with its
/// target when `show_targets`.
pub fn init_logging(default_filter: &str, show_targets: bool) {
    use tracing_subscriber::filter::filter_fn;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{fmt, EnvFilter, Layer};

    let from_env = std::env::var(EnvFilter::DEFAULT_ENV)
        .ok()
        .filter(|f| EnvFilter::try_new(f).is_ok());
    let filter = from_env.as_deref().unwrap_or(default_filter);
    let directives = if filter.contains(crate::STATUS_TARGET) {
        filter.to_string()
    } else {
        format!("{}=info,{filter}", crate::STATUS_TARGET)
    };
    let is_status = |meta: &tracing::Metadata<'_>| meta.target() == crate::STATUS_TARGET;
    let status = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .event_format(StatusLine)
        .with_filter(filter_fn(is_status));
    let others = fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(show_targets)
        .with_filter(filter_fn(move |meta| !is_status(meta)));
    // A subscriber installed earlier (a test harness, an embedding program) keeps its place.
    let _ = tracing_subscriber::registry()
        .with(EnvFilter::new(directives))
        .with(status)
        .with(others)
        .try_init();
}

/// A status event as one plain line: `xdna: <message>` (`xdna: warning: …` / `xdna: error: …`
/// above info), without time or level, as the library printed it itself before it used tracing.
struct StatusLine;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for StatusLine
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        write!(writer, "xdna: ")?;
        match *event.metadata().level() {
            tracing::Level::ERROR => write!(writer, "error: ")?,
            tracing::Level::WARN => write!(writer, "warning: ")?,
            _ => {}
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}
