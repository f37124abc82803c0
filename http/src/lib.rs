//! HTTP serving that a flood cannot take over: a bounded accept loop
//! (connections at most, shared between source hosts (`shares.rs`), a
//! header deadline and size, a connection lifetime, rate-limited logs of
//! accept errors) shared by the server's
//! page and files and the client's OpenAI-compatible API, and the
//! open-file limit raised so that the connection cap is met before the
//! kernel's.

use std::future::Future;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};

mod shares;
pub use shares::{host_of, ConnectionShares, ConnectionSlot, Host};

/// How an HTTP listener bounds its clients.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Connections served at once; more are closed on arrival, unless
    /// their host holds less than its share and another holds more.
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

/// The address a request's connection came from, in every request's
/// extensions (`None`: not known).
#[derive(Debug, Clone, Copy)]
pub struct ClientAddress(pub Option<IpAddr>);

/// Where connections come from: plain TCP, or a TLS listener's handshakes;
/// each with the address it came from, when known.
pub trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(
        &mut self,
    ) -> impl Future<Output = std::io::Result<(Self::Io, Option<IpAddr>)>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&mut self) -> std::io::Result<(Self::Io, Option<IpAddr>)> {
        tokio::net::TcpListener::accept(self)
            .await
            .map(|(s, addr)| (s, Some(addr.ip())))
    }
}

/// Serves `app` on connections from `listener` within `limits` until
/// `stop` completes; then accepts no more, asks open connections to end
/// after their current request, and returns once they have.
pub async fn serve_bounded<L: Accept>(
    mut listener: L,
    app: Router,
    limits: HttpLimits,
    stop: impl Future<Output = ()> + Send,
) {
    let shares = ConnectionShares::new(limits.max_connections);
    let graceful = GracefulShutdown::new();
    let mut log = RateLimitedLog {
        last: None,
        skipped: 0,
    };
    let mut stop = std::pin::pin!(stop);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        let (io, from) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors and the like: say so now and then, and
                // give the process a moment instead of spinning.
                log.warn("HTTP accept failed", &e);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(slot) = shares.admit(host_of(from)) else {
            log.warn(
                "HTTP connection refused: the limit is reached",
                &limits.max_connections,
            );
            drop(io);
            continue;
        };
        let service =
            TowerToHyperService::new(app.clone().layer(axum::Extension(ClientAddress(from))));
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .max_buf_size(limits.max_header_bytes.max(8192));
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(io), service));
        let task = tokio::spawn(async move {
            if let Err(e) = tokio::time::timeout(limits.max_connection_time, conn).await {
                tracing::debug!(error = %e, "HTTP connection ended at its time limit");
            }
        });
        slot.serve_in(task.abort_handle());
        // The slot lives as long as the task: freed when it ends or is aborted.
        tokio::spawn(async move {
            let _ = task.await;
            drop(slot);
        });
    }
    drop(listener);
    // Connections end after their current request; none outlives its limit.
    let _ = tokio::time::timeout(limits.max_connection_time, graceful.shutdown()).await;
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
