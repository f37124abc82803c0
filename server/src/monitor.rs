//! The swarm monitor every server with `--http-port` carries: `/monitor`, a
//! self-contained page (no external assets, relative URLs only, so it works
//! for any private swarm), and `/api/swarm`, the [`SwarmReport`] of this
//! server's model as its own node sees it. Reports are cached for
//! [`FRESH_FOR`], and one lookup at a time runs, so a page left open on many
//! screens (or a refresh storm) costs the DHT one lookup per two seconds.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use corolla_shared::node::NodeHandle;
use corolla_shared::swarm_report::{rtts_by_peer, SwarmReport};
use libp2p::{Multiaddr, PeerId};

use crate::host::SpanHost;

/// The page, built into the binary.
const PAGE: &str = include_str!("monitor.html");

/// How long one report answers every request.
const FRESH_FOR: Duration = Duration::from_secs(2);
/// How long one lookup of the model's servers may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// Servers without a round trip yet dialed after one report, at most, so
/// that the next report can show theirs (libp2p pings a new connection at once).
const DIALS_PER_REPORT: usize = 16;
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// A server dialed for its round trip is not dialed again this soon (one
/// that never answers pings would otherwise get a connection per report).
const REDIAL_AFTER: Duration = Duration::from_secs(30);

/// A report, or why there is none.
type Answer = Result<Arc<SwarmReport>, String>;

/// What `/api/swarm` reads: this server's node and span, and the last report.
pub(crate) struct SwarmMonitor {
    node: NodeHandle,
    host: Arc<SpanHost>,
    /// The last answer (a report, or why there is none) and when it was made.
    /// Held across a lookup, so concurrent requests wait for that one.
    latest: tokio::sync::Mutex<Option<(Instant, Answer)>>,
    /// When each server was last dialed for its round trip.
    dialed: std::sync::Mutex<HashMap<PeerId, Instant>>,
}

impl SwarmMonitor {
    pub fn new(node: NodeHandle, host: Arc<SpanHost>) -> Arc<Self> {
        Arc::new(SwarmMonitor {
            node,
            host,
            latest: tokio::sync::Mutex::new(None),
            dialed: std::sync::Mutex::default(),
        })
    }

    /// The current report: the cached one while fresh, else a new lookup's.
    async fn report(&self) -> Answer {
        let mut latest = self.latest.lock().await;
        if let Some((at, answer)) = latest.as_ref() {
            if at.elapsed() < FRESH_FOR {
                return answer.clone();
            }
        }
        let answer = self.build().await.map(Arc::new);
        *latest = Some((Instant::now(), answer.clone()));
        answer
    }

    async fn build(&self) -> Result<SwarmReport, String> {
        let own = self.host.record();
        let mut records = self
            .node
            .discover(&own.model, LOOKUP_TIMEOUT)
            .await
            .map_err(|e| format!("cannot look the swarm up: {e}"))?;
        // The live record rather than the DHT's copy (up to a period old),
        // and present even before the first announcement is stored.
        records.retain(|r| r.peer_id != own.peer_id);
        records.push(own.clone());
        let rtts = self.node.peer_rtts().await.unwrap_or_default();
        let mut report = SwarmReport::build(
            &own.model,
            own.num_layers,
            &records,
            &rtts_by_peer(rtts.clone()),
        );
        report.observer = Some(own.peer_id.clone());
        self.dial_unmeasured(&report, &rtts);
        Ok(report)
    }

    /// Connects, in the background, to servers of `report` this node has no
    /// round trip to, so that the next report has one.
    fn dial_unmeasured(&self, report: &SwarmReport, rtts: &HashMap<PeerId, Duration>) {
        let me = self.node.peer_id();
        let targets: Vec<(PeerId, Vec<Multiaddr>)> = {
            let mut dialed = self.dialed.lock().unwrap_or_else(|p| p.into_inner());
            dialed.retain(|_, at| at.elapsed() < REDIAL_AFTER);
            let targets: Vec<(PeerId, Vec<Multiaddr>)> = report
                .servers
                .iter()
                .filter_map(|s| {
                    let peer: PeerId = s.peer_id.parse().ok()?;
                    let addrs = s.addresses.iter().filter_map(|a| a.parse().ok()).collect();
                    Some((peer, addrs))
                })
                .filter(|(peer, _)| {
                    *peer != me && !rtts.contains_key(peer) && !dialed.contains_key(peer)
                })
                .take(DIALS_PER_REPORT)
                .collect();
            for (peer, _) in &targets {
                dialed.insert(*peer, Instant::now());
            }
            targets
        };
        for (peer, addrs) in targets {
            let node = self.node.clone();
            tokio::spawn(async move {
                if let Err(e) = node.dial(peer, addrs, DIAL_TIMEOUT).await {
                    tracing::debug!(%peer, error = %e, "cannot reach a server to time it");
                }
            });
        }
    }
}

/// `/monitor` and `/api/swarm`, for any router state.
pub(crate) fn routes<S: Clone + Send + Sync + 'static>(monitor: Arc<SwarmMonitor>) -> Router<S> {
    Router::new()
        .route("/monitor", get(page))
        .route("/api/swarm", get(swarm))
        .with_state(monitor)
}

async fn page() -> Response {
    ([(header::CACHE_CONTROL, "no-cache")], Html(PAGE)).into_response()
}

async fn swarm(State(monitor): State<Arc<SwarmMonitor>>) -> Response {
    let no_store = [(header::CACHE_CONTROL, "no-store")];
    match monitor.report().await {
        Ok(report) => (no_store, Json(report.as_ref())).into_response(),
        Err(error) => (
            StatusCode::SERVICE_UNAVAILABLE,
            no_store,
            Json(serde_json::json!({ "error": error })),
        )
            .into_response(),
    }
}
