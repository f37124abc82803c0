//! `--push-fault`, a testing aid: a server that answers its client
//! honestly but fails the push to the next server the ways a liar would
//! (nothing sent, a forged proof, the previous step's push again, an
//! honest push late, its own output pushed into a later session of the
//! route before the next server's). Clients must charge each to this
//! server, never to the server that waited or was intruded on.

use std::str::FromStr;
use std::time::Duration;

use corolla_shared::protocol::StepHeader;
use corolla_shared::TensorPayload;
use libp2p::identity::Keypair;

use crate::push::PushLink;

/// How a `--push-fault` server fails its pushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushFault {
    /// Says it pushed, sends nothing.
    Silent,
    /// Pushes its output with a proof signed by another key.
    Forged,
    /// Pushes the previous step's push again (its proof holds, for that step).
    Replayed,
    /// Answers its client at once and pushes the honest output this late.
    Late(Duration),
    /// Pushes its own output, signed, into the session after the next one
    /// (it knows that session's token from the route), then honestly on.
    Intrude,
}

impl FromStr for PushFault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "silent" => Ok(PushFault::Silent),
            "forged" => Ok(PushFault::Forged),
            "replayed" => Ok(PushFault::Replayed),
            "intrude" => Ok(PushFault::Intrude),
            other => other
                .strip_prefix("late:")
                .and_then(|ms| ms.parse::<u64>().ok())
                .map(|ms| PushFault::Late(Duration::from_millis(ms)))
                .ok_or_else(|| format!("{s:?} is not a push fault: {KINDS}")),
        }
    }
}

const KINDS: &str = "silent, forged, replayed, intrude or late:MS";

/// What a session of a `--replayed` server remembers: its last push.
pub(crate) type LastPush = Option<(StepHeader, TensorPayload)>;

impl PushFault {
    /// Fails this step's push (`header`, `output`) the chosen way; returns
    /// what the session tells its client: always that it pushed.
    pub(crate) async fn push(
        self,
        link: &mut PushLink,
        last: &mut LastPush,
        control: &mut libp2p_stream::Control,
        identity: &Keypair,
        header: &StepHeader,
        output: &TensorPayload,
    ) -> bool {
        match self {
            PushFault::Silent => {}
            PushFault::Forged => {
                let stranger = Keypair::generate_ed25519();
                link.push(control, &stranger, header, output).await;
            }
            PushFault::Replayed => {
                // The first step has nothing before it: pushed honestly.
                let (header, output) = last
                    .replace((header.clone(), output.clone()))
                    .unwrap_or_else(|| (header.clone(), output.clone()));
                link.push(control, identity, &header, &output).await;
            }
            PushFault::Intrude => {
                if header.push.len() > 1 {
                    // A link of its own: the session's goes to the next server.
                    let into_later = StepHeader {
                        push: header.push[1..].to_vec(),
                        ..header.clone()
                    };
                    let mut intruding = PushLink::default();
                    intruding.push(control, identity, &into_later, output).await;
                }
                link.push(control, identity, header, output).await;
            }
            PushFault::Late(delay) => {
                let (mut control, identity) = (control.clone(), identity.clone());
                let (header, output) = (header.clone(), output.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let mut link = PushLink::default();
                    link.push(&mut control, &identity, &header, &output).await;
                });
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_faults_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!("silent".parse(), Ok(PushFault::Silent));
        assert_eq!("forged".parse(), Ok(PushFault::Forged));
        assert_eq!("replayed".parse(), Ok(PushFault::Replayed));
        assert_eq!("intrude".parse(), Ok(PushFault::Intrude));
        assert_eq!(
            "late:1500".parse(),
            Ok(PushFault::Late(Duration::from_millis(1500)))
        );
        for bad in ["", "late", "late:soon", "loud"] {
            let e = bad.parse::<PushFault>().unwrap_err();
            assert!(e.contains(KINDS), "{e}");
        }
    }
}
