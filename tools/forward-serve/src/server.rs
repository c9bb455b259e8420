//! Router assembly, the engine thread's lifetime and graceful shutdown.

use super::api::{self, App, Config};
use super::engine::Loaded;
use super::listen::{self, ConnLimits};
use super::metrics::Metrics;
use super::ollama;
use super::scheduler::{self, Control, DrafterKind};
use axum::routing::{get, post};
use axum::Router;
use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Errors of running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The engine thread could not be started.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The engine thread was still running after the shutdown grace (plus 2 s).
    #[error("the engine thread did not stop within the shutdown grace")]
    EngineStuck,
    /// The settings ask for what the engine cannot do.
    #[error("config: {0}")]
    Config(String),
}

/// Every route of the API (OpenAI, llama.cpp `/completion`, Ollama `/api/*`, health, metrics,
/// tokenizer), with
/// the request counter around them.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(api::completions))
        .route("/v1/chat/completions", post(api::chat_completions))
        .route("/completion", post(api::llama_completion))
        .route("/v1/models", get(api::models))
        .route("/health", get(api::health))
        .route("/metrics", get(api::metrics))
        .route("/tokenize", post(api::tokenize))
        .route("/detokenize", post(api::detokenize))
        .route("/api/generate", post(ollama::generate))
        .route("/api/chat", post(ollama::chat))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/version", get(ollama::version))
        .fallback(api::fallback)
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            api::track,
        ))
        .with_state(app)
}

/// Serve on `listener` until `shutdown` resolves, then shut down gracefully: stop accepting, let
/// in-flight requests finish within `cfg.shutdown_grace`, cancel what is left, stop the engine
/// thread (dropping the model, which releases the device).
pub async fn run(
    listener: tokio::net::TcpListener,
    cfg: Config,
    loaded: Loaded,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let mut cfg = cfg;
    cfg.dflash = loaded.engine.has_dflash();
    if cfg
        .speculate
        .is_some_and(|s| s.drafter == DrafterKind::Dflash && !cfg.dflash)
    {
        return Err(ServeError::Config(
            "DFlash speculation by default needs a DFlash draft (--draft PATH)".into(),
        ));
    }
    let metrics = Arc::new(Metrics::default());
    let control = Arc::new(Control::default());
    let (tx, rx) = mpsc::channel(cfg.max_queue.max(1));
    let engine_thread = scheduler::spawn(
        loaded.engine,
        loaded.codec.clone(),
        rx,
        cfg.max_batch,
        metrics.clone(),
        control.clone(),
    )?;
    let grace = cfg.shutdown_grace;
    let app = Arc::new(App::new(cfg, loaded.codec, metrics, tx));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let limits = ConnLimits {
        max_connections: app.cfg.max_connections,
        header_timeout: app.cfg.header_timeout,
    };
    let server = listen::serve(
        listener,
        router(app.clone()),
        limits,
        app.metrics.clone(),
        async move {
            let _ = stop_rx.await;
        },
    );
    let mut server = tokio::spawn(server);
    tokio::select! {
        r = &mut server => {
            // The accept loop ends only when told to, or when its task panicked.
            tracing::error!("server ended: {r:?}");
        }
        _ = shutdown => {
            tracing::info!("shutdown: no new connections; waiting up to {grace:?} for in-flight requests");
            app.draining.store(true, Relaxed);
            let _ = stop_tx.send(());
            let t0 = Instant::now();
            if tokio::time::timeout(grace, &mut server).await.is_err() {
                tracing::warn!("shutdown grace over: cancelling in-flight generations");
                control.abort.store(true, Relaxed);
                if tokio::time::timeout(Duration::from_secs(2), &mut server).await.is_err() {
                    server.abort();
                }
            }
            tracing::info!("connections closed after {:?}", t0.elapsed());
        }
    }
    // Close the queue: the engine thread ends once its active sequences are done.
    if let Ok(mut q) = app.queue.lock() {
        q.take();
    }
    control.abort.store(true, Relaxed);
    let done = tokio::task::spawn_blocking(move || {
        scheduler::join_within(engine_thread, grace + Duration::from_secs(2))
    })
    .await
    .unwrap_or(false);
    if !done {
        return Err(ServeError::EngineStuck);
    }
    tracing::info!("engine stopped; model dropped");
    Ok(())
}
