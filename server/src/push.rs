//! Server-to-server push (`/corolla/push/2`): a server sends its step output
//! straight to the next server of its client's route, and keeps the inboxes
//! where pushes for its own sessions arrive (`push_stream.rs` reads them
//! off the network). A push gets in only with a session's token, which
//! the server gave that session's client alone, and with its sender's
//! signed digest of what it carries (`corolla_shared::push_proof`), which
//! the session returns to its client with the output; whatever arrives is
//! checked like a client's step, by the session it is for. A push refused
//! for want of a valid proof is reported to that session as well, which
//! tells its client: the pusher is to blame, not the session that waited.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use corolla_shared::framing::write_frame;
use corolla_shared::hop_trace;
use corolla_shared::protocol::{PushStep, PushTarget, SessionToken, StepHeader, PUSH_PROTOCOL};
use corolla_shared::push_proof::{view_digest, PushProof, PushSender, PushedStep};
use corolla_shared::TensorPayload;
use libp2p::identity::Keypair;
use libp2p::{PeerId, Stream};
use tokio::sync::mpsc;

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
    /// The sender's signed digest of `hidden`, checked on arrival.
    pub proof: PushProof,
    pub hidden: TensorPayload,
}

/// What reaches a session's inbox.
#[derive(Debug)]
pub(crate) enum InboxItem {
    /// A step pushed to the session, its proof checked.
    Step(Pushed),
    /// A push for the session refused on the push stream (the pusher was
    /// told why; the session tells its client).
    Refused {
        from: PeerId,
        step_id: u32,
        reason: String,
    },
}

type InboxSender = mpsc::Sender<InboxItem>;

/// The sessions open for pushes, by token.
#[derive(Default)]
pub(crate) struct PushInboxes {
    inboxes: Mutex<HashMap<SessionToken, InboxSender>>,
}

/// A session's place in [`PushInboxes`]; dropping it closes the inbox.
pub(crate) struct Inbox {
    inboxes: Arc<PushInboxes>,
    token: SessionToken,
    pub receiver: mpsc::Receiver<InboxItem>,
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.inboxes.lock().remove(&self.token);
    }
}

impl PushInboxes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SessionToken, InboxSender>> {
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
    pub(crate) fn deliver(&self, token: SessionToken, pushed: Pushed) -> Result<(), String> {
        let sender = self
            .lock()
            .get(&token)
            .cloned()
            .ok_or_else(|| "no open session has this push token".to_string())?;
        sender
            .try_send(InboxItem::Step(pushed))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => {
                    format!("the session already holds {INBOX_CAPACITY} pushed steps")
                }
                mpsc::error::TrySendError::Closed(_) => "the session has ended".to_string(),
            })
    }

    /// Tells the session of `token`, if one is open, that a push for its
    /// step `step_id` from `from` was refused. Best effort: a full inbox
    /// already holds what its client will read first.
    pub(crate) fn report_refusal(
        &self,
        token: SessionToken,
        from: PeerId,
        step_id: u32,
        reason: &str,
    ) {
        let Some(sender) = self.lock().get(&token).cloned() else {
            return;
        };
        let _ = sender.try_send(InboxItem::Refused {
            from,
            step_id,
            reason: reason.to_string(),
        });
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
    /// route, signed by `identity`; `false` (logged) when it could not
    /// leave: the client then carries the output on itself.
    pub async fn push(
        &mut self,
        control: &mut libp2p_stream::Control,
        identity: &Keypair,
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
        let step = PushedStep {
            token: *token,
            step_id: header.step_id,
            start_position: header.start_position,
        };
        let proof = match PushProof::sign(identity, &step, output) {
            Ok(proof) => proof,
            Err(e) => {
                tracing::warn!(error = %e, "cannot sign a push; the client carries the output");
                return false;
            }
        };
        tracing::trace!(name: hop_trace::PUSH_SIGNED, target: hop_trace::TARGET, "hop stage");
        let frame = PushStep::encode(*token, &onward, &proof, output);
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
            Ok(Ok(())) => {
                tracing::trace!(name: hop_trace::PUSH_SENT, target: hop_trace::TARGET, "hop stage");
                true
            }
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

/// Refuses a push route that names this server or any server twice: a
/// loop would make one client frame cost a step on every pass.
pub(crate) fn check_route(this_server: PeerId, route: &[PushTarget]) -> Result<(), String> {
    let mut seen = HashSet::with_capacity(route.len() + 1);
    seen.insert(this_server);
    match route.iter().find(|t| !seen.insert(t.peer)) {
        None => Ok(()),
        Some(t) => Err(format!(
            "the push route names {} twice (or this server): routes cannot loop",
            t.peer
        )),
    }
}

/// Whether `push` carries its sender's signature over exactly what it
/// carries: the session returns the proof to its client, which blames the
/// session's server for one that does not hold.
pub(crate) fn check_proof(sender: &PushSender, push: &PushStep<'_>) -> Result<(), String> {
    let step = PushedStep {
        token: push.token,
        step_id: push.header.step_id,
        start_position: push.header.start_position,
    };
    push.proof
        .verify(sender, &step)
        .map_err(|e| format!("a push whose proof does not hold: {e}"))?;
    if push.proof.digest != view_digest(&push.hidden) {
        return Err("a push whose signed digest is not that of what it carries".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use corolla_shared::{Limits, WireDType};

    fn pushed() -> Pushed {
        Pushed {
            from: PeerId::random(),
            header: StepHeader::default(),
            proof: PushProof {
                digest: [0; 32],
                signature: Vec::new(),
            },
            hidden: TensorPayload::new(WireDType::F32, vec![1, 1, 1], vec![0; 4]).unwrap(),
        }
    }

    #[test]
    fn a_push_gets_in_only_with_its_senders_proof_of_what_it_carries() {
        let sender = Keypair::generate_ed25519();
        let sender_id = PushSender::new(sender.public().to_peer_id());
        let header = StepHeader {
            start_position: 4,
            step_id: 9,
            push: Vec::new(),
        };
        let token = SessionToken([3; 16]);
        let honest = TensorPayload::new(WireDType::F32, vec![1, 1, 2], vec![1; 8]).unwrap();
        let other = TensorPayload::new(WireDType::F32, vec![1, 1, 2], vec![2; 8]).unwrap();
        let step = PushedStep {
            token,
            step_id: 9,
            start_position: 4,
        };
        let proof = PushProof::sign(&sender, &step, &honest).unwrap();
        let frame = PushStep::encode(token, &header, &proof, &honest);
        check_proof(
            &sender_id,
            &PushStep::decode(&frame, &Limits::DEFAULT).unwrap(),
        )
        .unwrap();
        // Signed for other numbers than it carries.
        let frame = PushStep::encode(token, &header, &proof, &other);
        let push = PushStep::decode(&frame, &Limits::DEFAULT).unwrap();
        assert!(check_proof(&sender_id, &push)
            .unwrap_err()
            .contains("not that of what it carries"));
        // Signed by someone else than the peer it came from.
        let frame = PushStep::encode(token, &header, &proof, &honest);
        let push = PushStep::decode(&frame, &Limits::DEFAULT).unwrap();
        let stranger = PushSender::new(Keypair::generate_ed25519().public().to_peer_id());
        assert!(check_proof(&stranger, &push)
            .unwrap_err()
            .contains("does not hold"));
        // Signed for another session's token.
        let frame = PushStep::encode(SessionToken([4; 16]), &header, &proof, &honest);
        let push = PushStep::decode(&frame, &Limits::DEFAULT).unwrap();
        assert!(check_proof(&sender_id, &push).is_err());
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
