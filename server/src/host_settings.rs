//! What stays the same whichever span the server hosts: one settings type,
//! held once and shared by every span's sessions (see `host.rs` for
//! hosting a span with it).

use std::sync::Arc;
use std::time::Duration;

use corolla_shared::source_address::PeerSources;
use corolla_shared::{Limits, ServerRecord};
use libp2p::identity::Keypair;
use libp2p::PeerId;

use crate::admission::CacheBudget;
use crate::compute::ComputeSettings;
use crate::metrics::ServerMetrics;
use crate::push::PushInboxes;
use crate::quota::{Holder, Quota};

/// What stays the same whichever span the server hosts.
pub(crate) struct HostSettings {
    /// The record's fixed fields (peer, model, limits); each span fills its own.
    pub template: ServerRecord,
    pub limits: Limits,
    pub max_length: usize,
    pub idle_timeout: Duration,
    pub step_delay: Duration,
    pub sessions: Arc<Quota>,
    pub cache: Arc<CacheBudget>,
    pub corrupt_outputs: f64,
    /// `--corrupt-pushes` (a testing aid).
    pub corrupt_pushes: f64,
    /// `--push-fault` (a testing aid).
    pub push_fault: Option<crate::push_fault::PushFault>,
    /// `--late-steps-ms` (a testing aid).
    pub late_steps: Duration,
    pub compute: ComputeSettings,
    pub update_period: Duration,
    /// Every session's push inbox; one registry whichever span is hosted.
    pub pushes: Arc<PushInboxes>,
    /// For pushes to the next servers of clients' routes.
    pub control: libp2p_stream::Control,
    /// This server's id: a push route naming it again is a loop.
    pub peer_id: PeerId,
    /// Signs what this server pushes (see `corolla_shared::push_proof`).
    pub identity: Keypair,
    pub metrics: ServerMetrics,
    /// Where each connected peer comes from: slots are shared per source.
    pub sources: PeerSources,
}

impl HostSettings {
    /// `peer` as the quotas see it: with the address it connected from.
    pub fn holder(&self, peer: PeerId) -> Holder {
        Holder {
            peer,
            source: self.sources.of(&peer),
        }
    }
}
