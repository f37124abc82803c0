//! Serving pushes from other servers (`/corolla/push/2`): each stream is
//! read frame by frame, a push with a valid proof for an open session goes
//! to its inbox (see `push.rs`), any other is answered with an error frame,
//! and a stream with too many refusals in a row is closed.

use std::sync::Arc;
use std::time::Duration;

use corolla_shared::framing::{write_frame, FrameReader};
use corolla_shared::hop_trace;
use corolla_shared::protocol::{ErrorCode, PushStep, Response, PUSH_PROTOCOL};
use corolla_shared::push_proof::PushSender;
use futures::{AsyncWriteExt, StreamExt};
use libp2p::{PeerId, Stream};
use tokio::task::JoinHandle;

use crate::error::ServerError;
use crate::host_settings::HostSettings;
use crate::push::{check_proof, Pushed};
use crate::quota::{Quota, Slot};
use crate::refuse::{refuse_stream, FIRST_FRAME_WITHIN, MAX_BAD_REQUESTS_IN_A_ROW};

/// Takes pushes in: each stream is read frame by frame; a push for an
/// open session goes to its inbox, any other is answered with an error
/// frame, and a stream with too many refusals in a row is closed.
pub(crate) fn accept_pushes(
    settings: Arc<HostSettings>,
    streams: Arc<Quota>,
) -> Result<JoinHandle<()>, ServerError> {
    let mut incoming = settings
        .control
        .clone()
        .accept(PUSH_PROTOCOL)
        .map_err(|e| ServerError::Network(e.to_string()))?;
    Ok(tokio::spawn(async move {
        let mut tasks = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                next = incoming.next() => match next {
                    Some((peer, stream)) => match streams.try_take(settings.holder(peer)) {
                        Ok(slot) => {
                            tasks.spawn(serve_pushes(stream, peer, settings.clone(), slot));
                        }
                        Err(refusal) => {
                            tasks.spawn(refuse_stream(stream, peer, ErrorCode::Busy, refusal.stream_message(), settings.metrics.clone()));
                        }
                    },
                    None => break,
                },
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
    }))
}

/// Serves one push stream while it holds `slot`: it must send its first
/// frame within [`FIRST_FRAME_WITHIN`], then one within the session
/// timeout of the last delivered push, and ends when its slot is evicted.
async fn serve_pushes(mut stream: Stream, peer: PeerId, settings: Arc<HostSettings>, slot: Slot) {
    let (limits, metrics) = (&settings.limits, &settings.metrics);
    let mut reader = FrameReader::new(limits.max_frame_bytes());
    let mut refused_in_a_row = 0;
    let mut wait = FIRST_FRAME_WITHIN.min(settings.idle_timeout);
    let sender = PushSender::new(peer);
    loop {
        let read = tokio::select! {
            read = tokio::time::timeout(wait, reader.next_frame(&mut stream)) => read,
            _ = slot.evicted() => {
                tracing::debug!(%peer, "a push stream lost its slot to another source");
                break;
            }
        };
        let frame = match read {
            Ok(Ok(Some(frame))) => frame,
            Ok(Ok(None)) | Err(_) => break,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "a push stream failed");
                break;
            }
        };
        tracing::trace!(name: hop_trace::PUSH_READ, target: hop_trace::TARGET, "hop stage");
        let refusal = match PushStep::decode(frame, limits) {
            Err(e) => Some((ErrorCode::BadFrame, format!("malformed push: {e}"))),
            Ok(push) => match check_proof(&sender, &push) {
                Err(why) => {
                    // Its session's client hears of it too: it carries the
                    // step itself and blames this sender.
                    let step_id = push.header.step_id;
                    settings
                        .pushes
                        .report_refusal(push.token, peer, step_id, &why);
                    Some((ErrorCode::BadFrame, why))
                }
                Ok(()) => {
                    tracing::trace!(name: hop_trace::PUSH_CHECKED, target: hop_trace::TARGET, "hop stage");
                    let pushed = Pushed {
                        from: peer,
                        header: push.header,
                        proof: push.proof,
                        hidden: push.hidden.to_owned(),
                    };
                    settings
                        .pushes
                        .deliver(push.token, pushed)
                        .err()
                        .map(|why| (ErrorCode::UnknownSession, why))
                }
            },
        };
        match refusal {
            None => {
                refused_in_a_row = 0;
                wait = settings.idle_timeout;
                slot.progressed();
                metrics.push_received();
            }
            Some((code, message)) => {
                refused_in_a_row += 1;
                metrics.error_sent(code);
                tracing::debug!(%peer, %message, "refused a push");
                let frame = Response::error(code, message).encode();
                let written =
                    tokio::time::timeout(Duration::from_secs(2), write_frame(&mut stream, &frame))
                        .await;
                if refused_in_a_row >= MAX_BAD_REQUESTS_IN_A_ROW || !matches!(written, Ok(Ok(()))) {
                    break;
                }
            }
        }
    }
    drop(slot);
    let _ = tokio::time::timeout(Duration::from_secs(2), stream.close()).await;
}
