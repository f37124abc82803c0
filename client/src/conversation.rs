//! A conversation: the chain its answers go through, kept between turns,
//! and the tokens whose positions its caches hold.

use crate::chain::RemoteChain;
use crate::identities::Lease;
use crate::local::LocalChain;

/// Positions a conversation's sessions reserve when they open, so that
/// follow-ups fit without reopening (bounded by what the model and the
/// servers allow, and never less than the request needs).
pub const CONVERSATION_LENGTH: usize = 2048;

/// Where a conversation's blocks run: a local chain, or a remote one held
/// by one of the client's identities.
pub(crate) enum Chain {
    Local(LocalChain),
    Remote {
        chain: Box<RemoteChain>,
        /// The identity the chain's sessions are held by.
        _lease: Lease,
    },
}

impl Chain {
    pub(crate) fn capacity(&self) -> usize {
        match self {
            Chain::Local(c) => c.capacity(),
            Chain::Remote { chain, .. } => chain.capacity(),
        }
    }

    pub(crate) async fn close(self) {
        if let Chain::Remote { chain, .. } = self {
            chain.close().await;
        }
    }
}

/// A conversation's chain and the tokens whose positions its caches hold.
/// Answers given through the same conversation reuse the longest common
/// prefix of those tokens and the new prompt; an edited or regenerated
/// message rewinds to where the prompts diverge.
pub struct Conversation {
    pub(crate) chain: Option<Chain>,
    pub(crate) cached: Vec<u32>,
    pub(crate) reserve: usize,
    /// The LoRA adapter answers run with (`None`: the base weights).
    pub(crate) adapter: Option<String>,
    /// The adapter the open chain's sessions run with.
    pub(crate) chain_adapter: Option<String>,
}

impl Default for Conversation {
    fn default() -> Self {
        Self::new()
    }
}

impl Conversation {
    /// A conversation whose sessions reserve [`CONVERSATION_LENGTH`] positions.
    pub fn new() -> Self {
        Conversation {
            chain: None,
            cached: Vec::new(),
            reserve: CONVERSATION_LENGTH,
            adapter: None,
            chain_adapter: None,
        }
    }

    /// For a single answer: sessions reserve exactly what it needs.
    pub fn one_shot() -> Self {
        Conversation {
            reserve: 0,
            ..Self::new()
        }
    }

    /// Runs the next answers with the LoRA adapter `name` (servers must
    /// announce it), or with the base weights. A chain opened with another
    /// choice is replaced at the next answer.
    pub fn set_adapter(&mut self, name: Option<String>) {
        self.adapter = name;
    }

    /// [`Self::set_adapter`] as a builder.
    pub fn with_adapter(mut self, name: Option<String>) -> Self {
        self.set_adapter(name);
        self
    }

    pub fn adapter(&self) -> Option<&str> {
        self.adapter.as_deref()
    }

    /// The tokens the open sessions hold, position by position.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.cached
    }

    pub fn is_open(&self) -> bool {
        self.chain.is_some()
    }

    /// Keeps the servers' sessions of an idle conversation open (see
    /// [`RemoteChain::keep_alive`]); a front end calls it every minute or so
    /// while the conversation is on screen. On a failure the chain is closed
    /// and the next answer opens a new one.
    pub async fn keep_alive(&mut self) {
        if let Some(Chain::Remote { chain, .. }) = &mut self.chain {
            if let Err(e) = chain.keep_alive().await {
                tracing::debug!(error = %e, "keep-alive failed; the next answer reopens");
                self.reset().await;
            }
        }
    }

    /// Ends the sessions politely (servers free their caches at once).
    pub async fn close(mut self) {
        self.reset().await;
    }

    async fn reset(&mut self) {
        self.cached.clear();
        if let Some(chain) = self.chain.take() {
            chain.close().await;
        }
    }
}
