//! Accepting connections with bounds a hostile or broken client cannot get around: a cap on open
//! connections, a deadline for a request's headers (which also closes idle keep-alive
//! connections), and graceful shutdown. Body deadlines are per request (`api::read_json`).
//!
//! `axum::serve` has none of these (hyper's header timeout needs a timer axum does not give it),
//! so connections are served here with hyper directly and the router as the service.

use super::error::ApiError;
use super::metrics::Metrics;
use axum::body::Body;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower_service::Service;

/// Bounds on connections (`--max-connections`, `--header-timeout`).
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Time a connection gets to deliver a request's headers, counted from its opening or from
    /// its previous answer (so an idle keep-alive connection is closed after it too).
    pub header_timeout: Duration,
}

/// Answer to a connection over the cap, written straight to the socket (it never reaches hyper):
/// the client learns why instead of seeing a reset.
fn too_many_connections() -> Vec<u8> {
    let e = ApiError::too_many_connections();
    let body = e.body().to_string();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\nconnection: close\r\n\
         retry-after: {}\r\ncontent-length: {}\r\n\r\n{body}",
        e.status.as_u16(),
        e.status.canonical_reason().unwrap_or(""),
        e.retry_after.unwrap_or(1),
        body.len()
    )
    .into_bytes()
}

/// Serve `router` on `listener` until `stop` resolves; then stop accepting, let every open
/// connection finish its current request (`graceful_shutdown`), and return once all are closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    metrics: Arc<Metrics>,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Every connection task holds a receiver: `closed()` on the sender resolves when all are done.
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut stop = std::pin::pin!(stop);
    loop {
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    accept_error(&e).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            metrics.rejected_connections.fetch_add(1, Relaxed);
            tokio::spawn(refuse(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        metrics.open_connections.fetch_add(1, Relaxed);
        let service = router.clone();
        let metrics = metrics.clone();
        let mut stop_rx = stop_rx.clone();
        tokio::spawn(async move {
            let hyper_service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let mut router = service.clone();
                router.call(req.map(Body::new))
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), hyper_service);
            let mut conn = std::pin::pin!(conn);
            let mut stopping = false;
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            if e.is_timeout() {
                                metrics.header_timeouts.fetch_add(1, Relaxed);
                            }
                            tracing::debug!("connection ended: {e}");
                        }
                        break;
                    }
                    _ = stop_rx.changed(), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            metrics.open_connections.fetch_sub(1, Relaxed);
            drop(permit);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(stop_rx);
    stop_tx.closed().await;
}

/// Tell a connection over the cap to come back later, without waiting on it for long.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(&too_many_connections()).await;
        let _ = stream.shutdown().await;
        // Read what the client sent until it closes: closing with unread bytes would reset the
        // connection, and a reset can discard the answer before the client reads it.
        let mut sink = [0u8; 1024];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// Accept errors are per connection (the peer reset it) or transient (out of file descriptors);
/// the latter clear only when connections close, so wait a little instead of spinning.
async fn accept_error(e: &std::io::Error) {
    use nix::errno::Errno;
    let out_of_resources = [Errno::EMFILE, Errno::ENFILE, Errno::ENOBUFS, Errno::ENOMEM]
        .iter()
        .any(|&n| e.raw_os_error() == Some(n as i32));
    if out_of_resources {
        tracing::error!("accept: {e}; retrying in 100 ms");
        tokio::time::sleep(Duration::from_millis(100)).await;
    } else {
        tracing::debug!("accept: {e}");
    }
}

/// Raise this process's open-file limit to its hard limit: every connection is a descriptor, and
/// the usual soft limit (1024) is below what `--max-connections` allows. Returns the soft limit
/// in force afterwards.
pub fn raise_fd_limit() -> Option<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return Some(hard);
    }
    Some(soft)
}
