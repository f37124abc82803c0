//! The server's acceptors: inference sessions, pushes from other servers,
//! record requests, and the relay-circuit gauge, each a task of its own.

use std::sync::Arc;
use std::time::Duration;

use corolla_shared::framing;
use corolla_shared::node::NodeHandle;
use corolla_shared::protocol::{ErrorCode, INFERENCE_PROTOCOL, INFO_PROTOCOL};
use futures::{AsyncWriteExt, StreamExt};
use tokio::task::JoinHandle;

use crate::error::ServerError;
use crate::host::SpanHost;
use crate::host_settings::HostSettings;
use crate::metrics::ServerMetrics;
use crate::push_stream::accept_pushes;
use crate::quota::Quota;
use crate::refuse::refuse_stream;
use crate::session::serve;

/// Starts every acceptor of `host`'s streams.
pub(super) fn spawn_acceptors(
    node: &NodeHandle,
    host: &Arc<SpanHost>,
    settings: &Arc<HostSettings>,
) -> Result<Vec<JoinHandle<()>>, ServerError> {
    // Streams not yet holding a session cost a little each: a few more
    // than a peer's sessions, a few more than all sessions in total.
    let sessions = &settings.sessions;
    let streams = Quota::new(
        sessions.per_peer() + 2,
        sessions.total().saturating_mul(2) + 8,
    );
    let metrics = &settings.metrics;
    Ok(vec![
        accept_sessions(node, host.clone(), settings.clone(), streams.clone())?,
        accept_pushes(settings.clone(), streams)?,
        accept_info(node, host.clone())?,
        tokio::spawn(watch_relay_circuits(node.clone(), metrics.clone())),
    ])
}

fn accept_sessions(
    handle: &NodeHandle,
    host: Arc<SpanHost>,
    settings: Arc<HostSettings>,
    streams: Arc<Quota>,
) -> Result<JoinHandle<()>, ServerError> {
    let metrics = settings.metrics.clone();
    let mut incoming = handle
        .control()
        .accept(INFERENCE_PROTOCOL)
        .map_err(|e| ServerError::Network(e.to_string()))?;
    Ok(tokio::spawn(async move {
        // Sessions live in this set, so aborting the acceptor ends them all.
        let mut sessions = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                next = incoming.next() => match next {
                    Some((peer, stream)) => match (host.ctx(), streams.try_take(settings.holder(peer))) {
                        (Some(ctx), Ok(slot)) => {
                            sessions.spawn(serve(stream, peer, ctx, slot));
                        }
                        (None, _) => {
                            let message = "this server is changing its blocks or leaving; continue elsewhere";
                            sessions.spawn(refuse_stream(stream, peer, ErrorCode::ShuttingDown, message.into(), metrics.clone()));
                        }
                        (Some(_), Err(refusal)) => {
                            sessions.spawn(refuse_stream(stream, peer, ErrorCode::Busy, refusal.stream_message(), metrics.clone()));
                        }
                    },
                    None => break,
                },
                Some(_) = sessions.join_next(), if !sessions.is_empty() => {}
            }
        }
    }))
}

/// Keeps `corolla_relay_circuits` current: the node counts the circuits,
/// the gauge shows the latest count.
async fn watch_relay_circuits(node: NodeHandle, metrics: ServerMetrics) {
    let mut tick = tokio::time::interval(RELAY_GAUGE_PERIOD);
    loop {
        tick.tick().await;
        match node.reach().await {
            Ok(report) => metrics.set_relay_circuits(report.relay_circuits),
            Err(_) => break,
        }
    }
}

/// How stale `corolla_relay_circuits` may be.
const RELAY_GAUGE_PERIOD: Duration = Duration::from_secs(2);

fn accept_info(handle: &NodeHandle, host: Arc<SpanHost>) -> Result<JoinHandle<()>, ServerError> {
    let mut incoming = handle
        .control()
        .accept(INFO_PROTOCOL)
        .map_err(|e| ServerError::Network(e.to_string()))?;
    Ok(tokio::spawn(async move {
        while let Some((_peer, mut stream)) = incoming.next().await {
            let bytes = host.record().to_bytes();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(10), async {
                    let _ = framing::write_frame(&mut stream, &bytes).await;
                    let _ = stream.close().await;
                })
                .await;
            });
        }
    }))
}
