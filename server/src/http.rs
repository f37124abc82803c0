//! The server's HTTP side (`--http-port`): the built web chat page, the
//! client part of its model for browsers (config, tokenizer, embeddings,
//! final norm, LM head, listed with sizes and SHA-256 in a manifest so a page
//! can show progress and cache by digest; an untied quantized model's LM head
//! and embedding table as raw tensors, the table read by range a row at a
//! time), a JSON status and Prometheus metrics (`/metrics`). Only GET; CORS
//! is open, since an embedded widget fetches from other sites' pages.
//! Connections and requests are bounded by `http_guard`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Html;
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::task::JoinHandle;
use tower_http::cors::CorsLayer;
use tower_http::services::{ServeDir, ServeFile};

use corolla_model::Checkpoint;
use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;

pub use corolla_shared::manifest::{ClientFile, ClientManifest, RowsFile, TensorFile};

use crate::config::ServerArgs;
use crate::error::ServerError;
use crate::host::SpanHost;
use corolla_http::{serve_bounded, HttpLimits};

use crate::http_guard::{guard_request, Guard};
use crate::hub::ModelSource;
use crate::metrics::ServerMetrics;
use crate::tls::TlsIdentity;

/// `GET /api/status`: the live record plus how browsers reach this server.
#[derive(Serialize)]
struct Status {
    #[serde(flatten)]
    record: corolla_shared::ServerRecord,
    http: String,
    /// Multiaddrs a browser can dial (WebSocket, WebRTC-direct).
    browser_addresses: Vec<String>,
    /// What the compute core has done: decode batches and their sizes, prefill chunks.
    compute: crate::compute::ComputeFigures,
}

struct HttpState {
    host: Arc<SpanHost>,
    metrics: ServerMetrics,
    http: String,
    browser_addresses: Vec<String>,
    /// Keeps the client part's folder alive as long as the server.
    _client_dir_guard: ClientPartDir,
}

/// The folder holding the client part, removed when the server stops; its
/// lock file, held for the server's life, tells a later server whether the
/// folder was left behind by one that died (a 70B model's part is 0.3–1.4 GB).
struct ClientPartDir {
    dir: tempfile::TempDir,
    _lock: std::fs::File,
}

impl ClientPartDir {
    fn path(&self) -> &Path {
        self.dir.path()
    }
}

const PART_PREFIX: &str = "corolla-client-part-";
const PART_LOCK: &str = ".lock";

/// Removes the client-part folders in `tmp` whose server is gone: their
/// lock is free (or, from versions without one, they are over a day old).
fn sweep_stale_parts(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let ours = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(PART_PREFIX));
        if !ours || !path.is_dir() {
            continue;
        }
        let stale = match std::fs::File::open(path.join(PART_LOCK)) {
            Ok(lock) => lock.try_lock().is_ok(),
            Err(_) => entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > std::time::Duration::from_secs(24 * 3600)),
        };
        if stale {
            match std::fs::remove_dir_all(&path) {
                Ok(()) => {
                    tracing::info!(path = %path.display(), "removed a client part left by a server that died")
                }
                Err(e) => {
                    tracing::debug!(path = %path.display(), error = %e, "cannot remove a stale client part")
                }
            }
        }
    }
}

/// Where the client part's files (and its manifest) are, inside the guard's folder.
fn part_dir(guard: &ClientPartDir) -> PathBuf {
    guard.path().join("part")
}

fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The tensors of the client part, which browsers fetch over HTTP.
const CLIENT_TENSORS: [&str; 3] = [
    corolla_model::tensor_names::EMBED_TOKENS,
    corolla_model::tensor_names::FINAL_NORM,
    corolla_model::tensor_names::LM_HEAD,
];

/// The HTTP side of a server started with `--http-port`: writes the client
/// part (fetching its files first, for a hub model), binds and serves.
/// Returns the public URL and the serving task; `None` without `--http-port`.
// Each argument is a distinct piece of the server it serves; a struct
// gathering them would only be built at this one call.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn start(
    args: &ServerArgs,
    checkpoint: Arc<Checkpoint>,
    source: Arc<ModelSource>,
    model: &str,
    host: Arc<SpanHost>,
    tls: Option<Arc<TlsIdentity>>,
    listen_addrs: &[Multiaddr],
    node: corolla_shared::node::NodeHandle,
    metrics: ServerMetrics,
) -> Result<Option<(String, JoinHandle<()>)>, ServerError> {
    let Some(port) = args.http_port else {
        return Ok(None);
    };
    let name = model.to_string();
    let part = tokio::task::spawn_blocking(move || {
        // A hub model has only this server's blocks so far.
        source.fetch(checkpoint.files_for_tensors(CLIENT_TENSORS))?;
        prepare_client_part(&checkpoint, &name)
    })
    .await
    .map_err(ServerError::Task)??;
    let public_host = args.public_name.clone().unwrap_or_else(|| {
        if args.host.is_unspecified() {
            "127.0.0.1".into()
        } else {
            args.host.to_string()
        }
    });
    let config = HttpConfig {
        listen: SocketAddr::new(args.host, port),
        limits: HttpLimits {
            max_connections: args.http_max_connections,
            header_timeout: args.http_header_timeout,
            ..HttpLimits::default()
        },
        public_host,
        web_dir: args.web_dir.clone(),
        tls,
        metrics,
        monitor: crate::monitor::SwarmMonitor::new(node, host.clone()),
        browser_addresses: listen_addrs
            .iter()
            .filter(|a| {
                a.iter()
                    .any(|p| matches!(p, Protocol::Ws(_) | Protocol::WebRTCDirect))
            })
            .map(ToString::to_string)
            .collect(),
    };
    let (_, url, task) = serve(config, host, part).await?;
    tracing::info!(%url, "serving HTTP");
    Ok(Some((url, task)))
}

/// What `serve` needs besides the sessions' context.
struct HttpConfig {
    listen: SocketAddr,
    limits: HttpLimits,
    /// The public host name or IP written into URLs (the listen IP by default).
    public_host: String,
    web_dir: Option<PathBuf>,
    browser_addresses: Vec<String>,
    /// Serve https with this certificate.
    tls: Option<Arc<TlsIdentity>>,
    /// `/metrics`.
    metrics: ServerMetrics,
    /// `/monitor` and `/api/swarm`.
    monitor: Arc<crate::monitor::SwarmMonitor>,
}

/// Writes the client part of `checkpoint`, and `manifest.json` describing
/// it, into a folder owned by the server.
fn prepare_client_part(checkpoint: &Checkpoint, model: &str) -> Result<ClientPartDir, ServerError> {
    sweep_stale_parts(&std::env::temp_dir());
    let failed = |source| ServerError::File {
        doing: "cannot create a folder for the client part in",
        path: std::env::temp_dir(),
        source,
    };
    let dir = tempfile::Builder::new()
        .prefix(PART_PREFIX)
        .tempdir()
        .map_err(failed)?;
    let lock = std::fs::File::create(dir.path().join(PART_LOCK)).map_err(failed)?;
    lock.lock().map_err(failed)?;
    let dir = ClientPartDir { dir, _lock: lock };
    let out = part_dir(&dir);
    let part = corolla_model::convert::write_page_part(checkpoint, &out)?;
    let describe = |name: &str| -> Result<ClientFile, ServerError> {
        let path = out.join(name);
        let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let sha256 = sha256_file(&path).map_err(|source| ServerError::File {
            doing: "cannot read",
            path: path.clone(),
            source,
        })?;
        Ok(ClientFile {
            name: name.to_string(),
            size,
            sha256,
        })
    };
    let files = part
        .files
        .iter()
        .map(|name| describe(name))
        .collect::<Result<Vec<_>, ServerError>>()?;
    let (lm_head, embedding_rows) = match &part.split {
        None => (None, None),
        Some(split) => {
            use corolla_model::quantized_buffer::ggml_dtype_name;
            let format = split.rows_format;
            let row_bytes = format.row_bytes().unwrap_or(0) as u64;
            let rows = RowsFile {
                file: split.rows.clone(),
                size: row_bytes * format.rows as u64,
                dtype: ggml_dtype_name(format.dtype).into(),
                rows: format.rows as u64,
                hidden: format.hidden as u64,
                row_bytes,
                digests: split.row_digests.clone(),
            };
            let head = TensorFile {
                file: split.lm_head.clone(),
                dtype: ggml_dtype_name(split.lm_head_dtype).into(),
                shape: vec![format.rows as u64, format.hidden as u64],
            };
            (Some(head), Some(rows))
        }
    };
    let manifest = ClientManifest {
        model: model.to_string(),
        files,
        lm_head,
        embedding_rows,
    };
    let path = out.join(MANIFEST);
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| ServerError::File {
        doing: "cannot write",
        path: path.clone(),
        source: e.into(),
    })?;
    std::fs::write(&path, json).map_err(|source| ServerError::File {
        doing: "cannot write",
        path,
        source,
    })?;
    Ok(dir)
}

/// The manifest's name beside the files it lists.
const MANIFEST: &str = "manifest.json";

/// Binds `config.listen` and serves until the returned task is aborted.
async fn serve(
    config: HttpConfig,
    host: Arc<SpanHost>,
    client_part: ClientPartDir,
) -> Result<(SocketAddr, String, JoinHandle<()>), ServerError> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServerError::HttpListen {
            addr: config.listen,
            source,
        })?;
    let local = listener
        .local_addr()
        .map_err(|source| ServerError::HttpListen {
            addr: config.listen,
            source,
        })?;
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let http = format!("{scheme}://{}:{}", config.public_host, local.port());
    // The folder holds the client part and its manifest only; ServeDir
    // streams files (with ranges) and refuses paths that leave the folder.
    let files = ServeDir::new(part_dir(&client_part));
    let state = Arc::new(HttpState {
        host,
        metrics: config.metrics.clone(),
        http: http.clone(),
        browser_addresses: config.browser_addresses,
        _client_dir_guard: client_part,
    });
    let mut app = Router::new()
        .route("/api/status", get(status))
        .route("/metrics", get(metrics))
        .merge(crate::monitor::routes(config.monitor.clone()))
        .nest_service("/model", files);
    app = match &config.web_dir {
        Some(dir) => app
            .fallback_service(ServeDir::new(dir).fallback(ServeFile::new(dir.join("index.html")))),
        None => app.fallback(get(no_page)),
    };
    let guard = Arc::new(Guard::new(config.web_dir.as_deref()));
    let app = app
        .layer(axum::middleware::from_fn_with_state(guard, guard_request))
        .layer(CorsLayer::permissive())
        .with_state(state);
    let limits = config.limits;
    let task = match &config.tls {
        Some(identity) => {
            let listener = crate::tls::TlsListener::new(listener, identity, &limits)?;
            tokio::spawn(serve_bounded(listener, app, limits, std::future::pending()))
        }
        None => tokio::spawn(serve_bounded(listener, app, limits, std::future::pending())),
    };
    Ok((local, http, task))
}

async fn status(State(state): State<Arc<HttpState>>) -> Json<Status> {
    Json(Status {
        record: state.host.record(),
        http: state.http.clone(),
        browser_addresses: state.browser_addresses.clone(),
        compute: state
            .host
            .ctx()
            .map(|ctx| ctx.core.figures())
            .unwrap_or_default(),
    })
}

/// `GET /metrics`: the server's and libp2p's series, as OpenMetrics text.
async fn metrics(State(state): State<Arc<HttpState>>) -> axum::response::Response {
    use axum::response::IntoResponse;
    match state.metrics.encode() {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                crate::metrics::CONTENT_TYPE,
            )],
            text,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn no_page() -> (StatusCode, Html<&'static str>) {
    (
        StatusCode::NOT_FOUND,
        Html(
            "<!doctype html><title>Corolla</title><p>This Corolla server has no web page \
             (start it with --web-dir pointing at the built page). \
             Its status is at <a href=\"/api/status\">/api/status</a>.</p>",
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_parts_whose_server_is_gone_are_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let make = |name: &str| {
            let dir = tmp.path().join(name);
            std::fs::create_dir_all(dir.join("part")).unwrap();
            std::fs::File::create(dir.join(PART_LOCK)).unwrap()
        };
        let live = make("corolla-client-part-live");
        live.lock().unwrap();
        drop(make("corolla-client-part-dead"));
        std::fs::create_dir(
            tmp.path()
                .join("corolla-client-part-fresh-unlocked-old-version"),
        )
        .unwrap();
        std::fs::create_dir(tmp.path().join("someone-else")).unwrap();
        sweep_stale_parts(tmp.path());
        let left: std::collections::BTreeSet<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        let expected: std::collections::BTreeSet<String> = [
            "corolla-client-part-live",
            "corolla-client-part-fresh-unlocked-old-version",
            "someone-else",
        ]
        .map(String::from)
        .into();
        assert_eq!(left, expected);
        drop(live);
    }
}
