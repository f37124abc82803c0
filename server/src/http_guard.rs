//! The HTTP side's defences against floods and prying: a bounded accept
//! loop (connections at most, header deadline and size, connection
//! lifetime, rate-limited logs of accept errors) and a request guard (414
//! for over-long paths, 404 for over-long segments, dotfiles and anything a
//! symlink leads out of `--web-dir`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Semaphore;
use web_time::Instant;

/// How the HTTP side bounds its clients.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HttpLimits {
    /// Connections served at once; more are closed on arrival.
    pub max_connections: usize,
    /// A request's head must arrive within this.
    pub header_timeout: Duration,
    /// The most bytes buffered for one request head.
    pub max_header_bytes: usize,
    /// No connection, keep-alive included, lives longer.
    pub max_connection_time: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 256,
            header_timeout: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            max_connection_time: Duration::from_secs(300),
        }
    }
}

/// The longest request path accepted (414 beyond).
const MAX_PATH_BYTES: usize = 2048;
/// The longest path segment: file systems refuse longer names.
const MAX_SEGMENT_BYTES: usize = 255;
/// At most one log line per this long about refused or failed accepts.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Logs at most once per [`LOG_EVERY`], counting what it left out.
struct RateLimitedLog {
    last: Option<Instant>,
    skipped: u64,
}

impl RateLimitedLog {
    fn warn(&mut self, what: &str, detail: &dyn std::fmt::Display) {
        if self.last.is_some_and(|t| t.elapsed() < LOG_EVERY) {
            self.skipped += 1;
            return;
        }
        tracing::warn!(%detail, skipped = self.skipped, "{what}");
        self.last = Some(Instant::now());
        self.skipped = 0;
    }
}

/// Where connections come from: plain TCP, or the TLS listener's handshakes.
pub(crate) trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&mut self) -> impl std::future::Future<Output = std::io::Result<Self::Io>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&mut self) -> std::io::Result<Self::Io> {
        tokio::net::TcpListener::accept(self).await.map(|(s, _)| s)
    }
}

/// Serves `app` on connections from `listener` within `limits`, forever.
pub(crate) async fn serve_bounded<L: Accept>(mut listener: L, app: Router, limits: HttpLimits) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut log = RateLimitedLog {
        last: None,
        skipped: 0,
    };
    loop {
        let io = match listener.accept().await {
            Ok(io) => io,
            Err(e) => {
                // Out of descriptors and the like: say so now and then, and
                // give the process a moment instead of spinning.
                log.warn("HTTP accept failed", &e);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            log.warn(
                "HTTP connection refused: the limit is reached",
                &limits.max_connections,
            );
            drop(io);
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(limits.max_header_bytes.max(8192));
            let conn = builder.serve_connection(TokioIo::new(io), service);
            if let Err(e) = tokio::time::timeout(limits.max_connection_time, conn).await {
                tracing::debug!(error = %e, "HTTP connection ended at its time limit");
            }
            drop(permit);
        });
    }
}

/// What the request guard knows: the web folder, resolved.
pub(crate) struct Guard {
    pub web_dir: Option<PathBuf>,
}

impl Guard {
    pub fn new(web_dir: Option<&Path>) -> Self {
        Guard {
            web_dir: web_dir.and_then(|d| d.canonicalize().ok()),
        }
    }
}

/// Refuses requests for what must not be served, before any handler runs.
pub(crate) async fn guard_request(
    State(guard): State<Arc<Guard>>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    if path.len() > MAX_PATH_BYTES {
        return StatusCode::URI_TOO_LONG.into_response();
    }
    let Some(segments) = decoded_segments(path) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if segments
        .iter()
        .any(|s| s.len() > MAX_SEGMENT_BYTES || s.starts_with('.') || s.contains(['/', '\\', '\0']))
    {
        return StatusCode::NOT_FOUND.into_response();
    }
    if let Some(root) = &guard.web_dir {
        let candidate = segments.iter().fold(root.clone(), |p, s| p.join(s));
        // Whatever exists must resolve inside the folder: no symlink out.
        if let Ok(resolved) = candidate.canonicalize() {
            if !resolved.starts_with(root) {
                return StatusCode::NOT_FOUND.into_response();
            }
        }
    }
    next.run(request).await
}

/// The path's non-empty segments, percent-decoded; `None` when not UTF-8
/// or badly encoded.
fn decoded_segments(path: &str) -> Option<Vec<String>> {
    path.split('/')
        .filter(|s| !s.is_empty())
        .map(|s| {
            let bytes: Vec<u8> = percent_encoding::percent_decode_str(s).collect();
            String::from_utf8(bytes).ok()
        })
        .collect()
}

/// Raises this process's open-file soft limit to its hard limit, so that a
/// flood of sockets meets the HTTP connection limit before the kernel's
/// (which would also starve the libp2p listeners). Returns the new limit.
#[cfg(unix)]
pub fn raise_open_file_limit() -> Option<libc::rlim_t> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                return Some(raised.rlim_cur);
            }
        }
    }
    Some(limit.rlim_cur)
}

#[cfg(not(unix))]
pub fn raise_open_file_limit() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_decoded() {
        assert_eq!(
            decoded_segments("/a/%2e%2e/b%20c/").unwrap(),
            ["a", "..", "b c"]
        );
        assert!(decoded_segments("/%ff").is_none());
    }
}
