//! What a user chose for the sessions a client opens: one leaf settings
//! type (the model, the wire, deadlines, which servers, spot checks), read
//! by the chain, the route and the swarm view.

use std::collections::HashSet;
use std::time::Duration;

use corolla_shared::session::StepTimeout;
use corolla_shared::{Compression, WireDType};

use crate::spot_check::Referee;

/// Settings of the sessions a client opens.
#[derive(Debug, Clone)]
pub struct SessionSettings {
    pub model: String,
    /// Hashes of every block of the model the client expects, when it knows them.
    pub expected_blocks: Option<Vec<String>>,
    pub num_layers: usize,
    pub max_length: usize,
    /// Positions the chain's first step prefills (0: not known); routing
    /// prefers servers that hold shared prefix pages for long prompts.
    pub prompt_tokens: usize,
    /// The dtype of activations on the wire (what sessions are opened with).
    pub dtype: WireDType,
    /// What the user asked to put on the wire; `None`: f16 where the
    /// compute dtype allows it (see [`crate::Blocks::swarm`]).
    pub wire_dtype: Option<WireDType>,
    /// How activations are compressed on the wire, both ways.
    pub compression: Compression,
    /// Servers send their outputs straight to the next server of the route
    /// (each also returns its own to the client, for replay).
    pub push: bool,
    /// How long one step may take before the server counts as failed.
    pub timeout: Duration,
    /// A tighter deadline for short steps (see [`StepTimeout`]); `None`: `timeout` for all.
    pub step_timeout: Option<StepTimeout>,
    /// How long to look for servers covering the blocks needed.
    pub discovery_timeout: Duration,
    /// Failures survived in one session before giving up.
    pub max_retries: usize,
    /// When set, only these peer ids are used.
    pub allowed_servers: Option<HashSet<String>>,
    /// Peer ids never used.
    pub blocked_servers: HashSet<String>,
    /// Flow control toward this client (see `corolla_shared::flow`): what
    /// browsers on WebRTC need; 0 for none.
    pub flow_window: u32,
    /// The share of steps whose output is checked against an independent
    /// witness (0: none, 1: every step).
    pub spot_check: f64,
    /// The client's own copy of the blocks, for a third opinion (never
    /// with an adapter: the client's blocks run the base weights).
    pub referee: Option<Referee>,
    /// The LoRA adapter sessions run with: only servers announcing it are
    /// routed through, and each session's Open names it.
    pub adapter: Option<String>,
}

impl Default for SessionSettings {
    /// For [`crate::Assistant::swarm`], which fills in the model's part.
    fn default() -> Self {
        Self::new("", 0, 0, WireDType::F32)
    }
}

impl SessionSettings {
    /// Whether `record`'s server runs sessions with the adapter these ask for.
    pub fn served_by(&self, record: &corolla_shared::ServerRecord) -> bool {
        self.adapter
            .as_ref()
            .is_none_or(|name| record.adapters.contains(name))
    }

    pub fn new(
        model: impl Into<String>,
        num_layers: usize,
        max_length: usize,
        dtype: WireDType,
    ) -> Self {
        SessionSettings {
            model: model.into(),
            expected_blocks: None,
            num_layers,
            max_length,
            prompt_tokens: 0,
            dtype,
            wire_dtype: None,
            compression: Compression::None,
            push: true,
            timeout: Duration::from_secs(60),
            step_timeout: None,
            discovery_timeout: Duration::from_secs(30),
            max_retries: 8,
            allowed_servers: None,
            blocked_servers: HashSet::new(),
            flow_window: 0,
            spot_check: 0.0,
            referee: None,
            adapter: None,
        }
    }
}
