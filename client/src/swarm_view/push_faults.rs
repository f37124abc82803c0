//! Pushes that did not arrive: whom a client charges for them, and which
//! servers' outputs it carries itself for a while.
//!
//! A push the receiver never got (or refused: a forged proof, a replay)
//! is settled once the receiver has answered the same step carried by the
//! client: the receiver works, so the pusher failed. A receiver could say
//! it got nothing from an honest pusher; one that misses the pushes of a
//! second pusher while the first miss is still recent is the one charged.

use web_time::Instant;

use super::bans::backoff;
use super::{SwarmView, BAN_BASE};

/// Who a push that did not arrive is charged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushBlame {
    Pusher,
    /// The receiver missed pushes of other servers too.
    Receiver,
}

impl SwarmView {
    /// Takes note that `pusher`'s push did not reach `receiver`, which then
    /// answered the step the client carried, and says whom to charge. A
    /// charged pusher's outputs go through the client for as long as a ban
    /// would last ([`Self::pushes_fail`]).
    pub fn record_push_miss(&self, pusher: &str, receiver: &str) -> PushBlame {
        let now = Instant::now();
        let mut state = self.state();
        let misses = state.push_misses.entry(receiver.to_string()).or_default();
        misses.retain(|(_, until)| now < *until);
        let missed_others = misses.iter().any(|(other, _)| other != pusher);
        let (blame, until) = if missed_others {
            (PushBlame::Receiver, now + 2 * BAN_BASE)
        } else {
            let lasts = backoff(state.push_faults.entry(pusher.to_string()));
            (PushBlame::Pusher, now + lasts)
        };
        state
            .push_misses
            .entry(receiver.to_string())
            .or_default()
            .push((pusher.to_string(), until));
        blame
    }

    /// Whether the client carries `peer`'s outputs itself for now: its
    /// pushes did not arrive lately.
    pub fn pushes_fail(&self, peer: &str) -> bool {
        self.state()
            .push_faults
            .get(peer)
            .is_some_and(|(_, until)| Instant::now() < *until)
    }
}
