//! Whom a session pushes to: the `next` its Open named, once that peer has
//! said itself (its live record over `/corolla/info/1`, on a stream to that
//! very peer) that it serves this model's block right after the session's.
//! Without the check, an Open naming any peer would make this server send
//! each step's output there: a reflection tool against hosts that never
//! asked. The check starts at the Open and is awaited at the first push.

use std::time::Duration;

use corolla_shared::session::fetch_info;
use corolla_shared::ServerRecord;
use libp2p::PeerId;
use tokio::task::JoinHandle;

/// How long the successor may take to answer the check; past it, the
/// session does not push (its client carries the outputs).
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// A session's successor and whether it checked out.
pub(crate) struct Successor {
    peer: PeerId,
    verdict: Verdict,
}

enum Verdict {
    Checking(JoinHandle<Result<(), String>>),
    Known(bool),
}

impl Successor {
    /// Starts checking that `peer` serves block `after` of `model`.
    pub fn check(
        control: &libp2p_stream::Control,
        peer: PeerId,
        model: &str,
        after: usize,
    ) -> Self {
        let mut control = control.clone();
        let model = model.to_string();
        let task = tokio::spawn(async move {
            let record = fetch_info(&mut control, peer, CHECK_TIMEOUT)
                .await
                .map_err(|e| e.to_string())?;
            serves_after(&record, &model, after)
        });
        Successor {
            peer,
            verdict: Verdict::Checking(task),
        }
    }

    pub fn peer(&self) -> PeerId {
        self.peer
    }

    /// Whether pushes may go to the successor: waits for the check once.
    pub async fn confirmed(&mut self) -> bool {
        if let Verdict::Checking(task) = &mut self.verdict {
            let ok = match task.await {
                Ok(Ok(())) => true,
                Ok(Err(why)) => {
                    tracing::debug!(peer = %self.peer, %why, "not pushing to a peer that does not serve the next blocks");
                    false
                }
                Err(_) => false,
            };
            self.verdict = Verdict::Known(ok);
        }
        matches!(self.verdict, Verdict::Known(true))
    }
}

impl Drop for Successor {
    fn drop(&mut self) {
        if let Verdict::Checking(task) = &self.verdict {
            task.abort();
        }
    }
}

/// Whether `record` serves block `after` of `model`.
fn serves_after(record: &ServerRecord, model: &str, after: usize) -> Result<(), String> {
    if record.model != model {
        return Err(format!("it serves model {:?}", record.model));
    }
    if record.leaving {
        return Err("it is leaving the swarm".into());
    }
    if !(record.start as usize..record.end as usize).contains(&after) {
        return Err(format!(
            "it serves blocks {}..{}, not block {after}",
            record.start, record.end
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_successor_must_serve_the_next_block_of_the_same_model() {
        let record = crate::placement::sample_record("p", 2, 4, 1.0);
        assert!(serves_after(&record, "m", 2).is_ok());
        assert!(serves_after(&record, "m", 3).is_ok());
        assert!(serves_after(&record, "m", 4)
            .unwrap_err()
            .contains("not block 4"));
        assert!(serves_after(&record, "m", 1).is_err());
        assert!(serves_after(&record, "other", 2)
            .unwrap_err()
            .contains("model"));
        let leaving = ServerRecord {
            leaving: true,
            ..record
        };
        assert!(serves_after(&leaving, "m", 2)
            .unwrap_err()
            .contains("leaving"));
    }
}
