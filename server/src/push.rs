//! Server-to-server push (`/corolla/push/1`): a server sends its step output
//! straight to the next server of its client's route, and takes pushes in
//! for its own sessions. A push gets in only with a session's token, which
//! the server gave that session's client alone; whatever arrives is checked
//! like a client's step, by the session it is for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use corolla_shared::framing::{write_frame, FrameReader};
use corolla_shared::protocol::{
    ErrorCode, PushStep, PushTarget, Response, SessionToken, StepHeader, PUSH_PROTOCOL,
};
use corolla_shared::{Limits, TensorPayload};
use futures::{AsyncWriteExt, StreamExt};
use libp2p::{PeerId, Stream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::admission::Quota;
use crate::error::ServerError;
use crate::metrics::ServerMetrics;
use crate::refuse::{refuse_stream, MAX_BAD_REQUESTS_IN_A_ROW};

/// Pushed steps a session holds before further pushes are refused: one
/// is in flight on an honest route; more means a pusher outrunning it.
const INBOX_CAPACITY: usize = 4;
/// The longest one push may take to leave this server.
const PUSH_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// A step another server pushed to one of this server's sessions.
#[derive(Debug)]
pub(crate) struct Pushed {
    pub from: PeerId,
    pub header: StepHeader,
    pub hidden: TensorPayload,
}

/// The sessions open for pushes, by token.
#[derive(Default)]
pub(crate) struct PushInboxes {
    inboxes: Mutex<HashMap<SessionToken, mpsc::Sender<Pushed>>>,
}

/// A session's place in [`PushInboxes`]; dropping it closes the inbox.
pub(crate) struct Inbox {
    inboxes: Arc<PushInboxes>,
    token: SessionToken,
    pub receiver: mpsc::Receiver<Pushed>,
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.inboxes.lock().remove(&self.token);
    }
}

impl PushInboxes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SessionToken, mpsc::Sender<Pushed>>> {
        self.inboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh token and the inbox its pushes arrive in.
    pub fn open(self: &Arc<Self>) -> Inbox {
        let (sender, receiver) = mpsc::channel(INBOX_CAPACITY);
        let mut inboxes = self.lock();
        let token = loop {
            let token = SessionToken(rand::random());
            if !inboxes.contains_key(&token) {
                break token;
            }
        };
        inboxes.insert(token, sender);
        Inbox {
            inboxes: self.clone(),
            token,
            receiver,
        }
    }

    /// Hands `pushed` to the session of `token`; the refusal says why not.
    fn deliver(&self, token: SessionToken, pushed: Pushed) -> Result<(), String> {
        let sender = self
            .lock()
            .get(&token)
            .cloned()
            .ok_or_else(|| "no open session has this push token".to_string())?;
        sender.try_send(pushed).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                format!("the session already holds {INBOX_CAPACITY} pushed steps")
            }
            mpsc::error::TrySendError::Closed(_) => "the session has ended".to_string(),
        })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

impl Inbox {
    pub fn token(&self) -> SessionToken {
        self.token
    }
}

/// A session's stream toward the next server of its route, opened at the
/// first push and kept while the route's next server stays the same.
#[derive(Default)]
pub(crate) struct PushLink {
    open: Option<(PeerId, Stream)>,
}

impl PushLink {
    /// Sends `output` to `route`'s first session, with the rest of the
    /// route; `false` (logged) when it could not leave: the client then
    /// carries the output on itself.
    pub async fn push(
        &mut self,
        control: &mut libp2p_stream::Control,
        header: &StepHeader,
        output: &TensorPayload,
    ) -> bool {
        let Some((PushTarget { peer, token }, rest)) = header.push.split_first() else {
            return false;
        };
        let onward = StepHeader {
            start_position: header.start_position,
            step_id: header.step_id,
            push: rest.to_vec(),
        };
        let frame = PushStep::encode(*token, &onward, output);
        let sent = tokio::time::timeout(PUSH_WRITE_TIMEOUT, async {
            if self.open.as_ref().is_none_or(|(open, _)| open != peer) {
                let stream = control
                    .open_stream(*peer, PUSH_PROTOCOL)
                    .await
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                self.open = Some((*peer, stream));
            }
            match &mut self.open {
                Some((_, stream)) => write_frame(stream, &frame).await,
                None => Err(std::io::ErrorKind::NotConnected.into()),
            }
        })
        .await;
        match sent {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "a push failed; the client carries the output");
                self.open = None;
                false
            }
            Err(_) => {
                tracing::debug!(%peer, "a push timed out; the client carries the output");
                self.open = None;
                false
            }
        }
    }
}

/// Takes pushes in: each stream is read frame by frame; a push for an
/// open session goes to its inbox, any other is answered with an error
/// frame, and a stream with too many refusals in a row is closed.
pub(crate) fn accept_pushes(
    control: &mut libp2p_stream::Control,
    inboxes: Arc<PushInboxes>,
    limits: Limits,
    idle_timeout: Duration,
    streams: Arc<Quota>,
    metrics: ServerMetrics,
) -> Result<JoinHandle<()>, ServerError> {
    let mut incoming = control
        .accept(PUSH_PROTOCOL)
        .map_err(|e| ServerError::Network(e.to_string()))?;
    Ok(tokio::spawn(async move {
        let mut tasks = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                next = incoming.next() => match next {
                    Some((peer, stream)) => match streams.try_take(peer) {
                        Ok(slot) => {
                            let inboxes = inboxes.clone();
                            let metrics = metrics.clone();
                            tasks.spawn(async move {
                                serve_pushes(stream, peer, &inboxes, limits, idle_timeout, &metrics).await;
                                drop(slot);
                            });
                        }
                        Err(refusal) => {
                            tasks.spawn(refuse_stream(stream, peer, ErrorCode::Busy, refusal.stream_message(), metrics.clone()));
                        }
                    },
                    None => break,
                },
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
    }))
}

async fn serve_pushes(
    mut stream: Stream,
    peer: PeerId,
    inboxes: &PushInboxes,
    limits: Limits,
    idle_timeout: Duration,
    metrics: &ServerMetrics,
) {
    let mut reader = FrameReader::new(limits.max_frame_bytes());
    let mut refused_in_a_row = 0;
    loop {
        let frame = match tokio::time::timeout(idle_timeout, reader.next_frame(&mut stream)).await {
            Ok(Ok(Some(frame))) => frame,
            Ok(Ok(None)) | Err(_) => break,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "a push stream failed");
                break;
            }
        };
        let refusal = match PushStep::decode(frame, &limits) {
            Err(e) => Some((ErrorCode::BadFrame, format!("malformed push: {e}"))),
            Ok(push) => {
                let pushed = Pushed {
                    from: peer,
                    header: push.header,
                    hidden: push.hidden.to_owned(),
                };
                inboxes
                    .deliver(push.token, pushed)
                    .err()
                    .map(|why| (ErrorCode::UnknownSession, why))
            }
        };
        match refusal {
            None => {
                refused_in_a_row = 0;
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
    let _ = tokio::time::timeout(Duration::from_secs(2), stream.close()).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use corolla_shared::WireDType;

    fn pushed() -> Pushed {
        Pushed {
            from: PeerId::random(),
            header: StepHeader::default(),
            hidden: TensorPayload::new(WireDType::F32, vec![1, 1, 1], vec![0; 4]).unwrap(),
        }
    }

    #[test]
    fn pushes_reach_only_open_sessions_and_only_so_many() {
        let inboxes = Arc::new(PushInboxes::default());
        let mut inbox = inboxes.open();
        assert!(inboxes
            .deliver(SessionToken([0; 16]), pushed())
            .unwrap_err()
            .contains("no open session"));
        for _ in 0..INBOX_CAPACITY {
            inboxes.deliver(inbox.token(), pushed()).unwrap();
        }
        assert!(inboxes
            .deliver(inbox.token(), pushed())
            .unwrap_err()
            .contains("already holds"));
        assert!(inbox.receiver.try_recv().is_ok());
        inboxes.deliver(inbox.token(), pushed()).unwrap();
        let token = inbox.token();
        drop(inbox);
        assert_eq!(inboxes.len(), 0, "a closed session leaves no inbox behind");
        assert!(inboxes.deliver(token, pushed()).is_err());
    }
}
