//! The peer ids one client speaks to a swarm as. Servers cap the sessions a
//! peer holds (a quarter of their slots by default), so a gateway answering
//! many users at once (`corolla api`) spreads its chains over several
//! identities: each has a node and a view of the swarm of its own, and a new
//! chain goes to the identity holding the fewest. What servers grant one
//! source address is capped beside that (`server::quota`), so more
//! identities never take a server from other users.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use corolla_shared::ErrorKind;

use crate::swarm_view::SwarmView;

/// At most this many identities: each costs a node with its own connections,
/// and servers' per-address shares make more of them pointless.
pub const MAX_IDENTITIES: usize = 16;

pub(crate) struct Identities {
    members: Vec<Member>,
}

struct Member {
    view: SwarmView,
    open_chains: Arc<AtomicUsize>,
}

impl Member {
    fn new(view: SwarmView) -> Self {
        Member {
            view,
            open_chains: Arc::default(),
        }
    }
}

/// Held by a chain for as long as it is open under an identity.
pub(crate) struct Lease {
    open_chains: Arc<AtomicUsize>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.open_chains.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Identities {
    /// One identity, seen through `first`.
    pub(crate) fn new(first: SwarmView) -> Self {
        Identities {
            members: vec![Member::new(first)],
        }
    }

    pub(crate) fn extended(mut self, more: impl IntoIterator<Item = SwarmView>) -> Self {
        self.members.extend(more.into_iter().map(Member::new));
        self
    }

    /// The first identity's view: what the swarm covers, how long sessions
    /// may be (every identity sees the same servers).
    pub(crate) fn first(&self) -> &SwarmView {
        &self.members[0].view
    }

    /// The identity with the fewest open chains (the first among equals),
    /// and the lease a new chain holds on it.
    pub(crate) fn least_busy(&self) -> (&SwarmView, Lease) {
        let member = self
            .members
            .iter()
            .min_by_key(|m| m.open_chains.load(Ordering::Relaxed))
            .unwrap_or(&self.members[0]);
        member.open_chains.fetch_add(1, Ordering::Relaxed);
        let lease = Lease {
            open_chains: member.open_chains.clone(),
        };
        (&member.view, lease)
    }

    /// Servers one identity caught lying are banned for every identity
    /// (a refusal for want of sessions is not: servers count those per peer).
    pub(crate) fn share_suspects(&self, suspects: &[String]) {
        // The identity that caught them has banned them already.
        for member in &self.members {
            for peer in suspects {
                if !member.view.is_banned(peer) {
                    member.view.ban_for(
                        peer,
                        ErrorKind::BadServer,
                        "caught returning wrong activations (through another identity)",
                    );
                }
            }
        }
    }

    pub(crate) fn forgive_busy(&self) {
        for member in &self.members {
            member.view.forgive_busy();
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.members.len()
    }
}
