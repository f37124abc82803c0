//! The host settings a server starts with: the record's fixed fields, the
//! frame limits, the session quota and the KV-cache budget, from the flags,
//! the model and the first span loaded.

use std::sync::Arc;
use std::time::Duration;

use corolla_shared::{Limits, ServerRecord};
use libp2p::PeerId;

use super::blocks::OpenedModel;
use super::swarm::JoinedSwarm;
use crate::admission::CacheBudget;
use crate::config::{BalanceQuality, ServerArgs};
use crate::host::LoadedSpan;
use crate::host_settings::HostSettings;
use crate::push::PushInboxes;
use crate::quota::Quota;

pub(super) fn host_settings(
    args: &ServerArgs,
    model: &OpenedModel,
    swarm: &JoinedSwarm,
    first_span: &LoadedSpan,
) -> Arc<HostSettings> {
    let config = &model.config;
    // No session is longer than the model's positions, whatever the flag says.
    let max_length = args
        .inference_max_length
        .min(config.max_position_embeddings);
    let template = record_template(args, model, swarm.node.peer_id(), &swarm.addrs, max_length);
    let per_peer = args
        .max_sessions_per_peer
        .unwrap_or(args.max_sessions / 4)
        .max(1);
    let cache_bytes_per_token = first_span.span.cache_bytes_per_token();
    let cache_tokens = match args.cache_tokens {
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => crate::memory::default_cache_tokens(
            args.max_sessions,
            max_length,
            cache_bytes_per_token,
            crate::memory::available_bytes(),
        ),
    };
    tracing::info!(
        cache_tokens,
        mib = (cache_tokens as u64).saturating_mul(cache_bytes_per_token as u64) >> 20,
        "KV-cache budget"
    );
    if args.late_steps_ms > 0 {
        tracing::warn!(
            ms = args.late_steps_ms,
            "--late-steps-ms: this server answers late on purpose, slower than it announces (a testing aid)"
        );
    }
    if args.corrupt_pushes > 0.0 {
        tracing::warn!(
            rate = args.corrupt_pushes,
            "--corrupt-pushes: this server pushes wrong activations on purpose (a testing aid)"
        );
    }
    if let Some(fault) = args.push_fault {
        tracing::warn!(
            ?fault,
            "--push-fault: this server fails its pushes on purpose (a testing aid)"
        );
    }
    if args.corrupt_outputs > 0.0 {
        tracing::warn!(
            rate = args.corrupt_outputs,
            "--corrupt-outputs: this server returns wrong activations on purpose (a testing aid)"
        );
    }
    let settings = Arc::new(HostSettings {
        template,
        // No step can carry more than max_length positions of f32 hidden
        // states; frames are bounded by that before any buffer grows.
        limits: Limits {
            max_tensor_bytes: (max_length as u64)
                .saturating_mul(config.hidden_size as u64)
                .saturating_mul(4),
            ..Limits::DEFAULT
        },
        max_length,
        idle_timeout: args.session_timeout,
        step_delay: Duration::from_millis(args.step_delay_ms),
        sessions: Quota::new(per_peer, args.max_sessions),
        cache: CacheBudget::new(cache_tokens),
        corrupt_outputs: args.corrupt_outputs,
        corrupt_pushes: args.corrupt_pushes,
        push_fault: args.push_fault,
        late_steps: Duration::from_millis(args.late_steps_ms),
        compute: args.compute_settings(),
        update_period: args.update_period,
        pushes: Arc::new(PushInboxes::default()),
        control: swarm.node.control(),
        peer_id: swarm.node.peer_id(),
        identity: swarm.identity.clone(),
        metrics: swarm.metrics.clone(),
        sources: swarm.node.sources().clone(),
    });
    swarm
        .metrics
        .watch(settings.sessions.clone(), settings.cache.clone());
    settings
}

/// Whether this server moves its blocks where the swarm needs them.
pub(super) fn rebalances(args: &ServerArgs) -> bool {
    args.block_indices.is_none() && args.balance_quality != BalanceQuality::Off
}

/// The record's fields that stay whichever span is hosted (each span fills
/// its own blocks, hashes, throughput and dtype).
fn record_template(
    args: &ServerArgs,
    model: &OpenedModel,
    peer_id: PeerId,
    addrs: &[libp2p::Multiaddr],
    max_length: usize,
) -> ServerRecord {
    let config = &model.config;
    ServerRecord {
        peer_id: peer_id.to_string(),
        model: model.name.clone(),
        fingerprint: String::new(),
        block_hashes: Vec::new(),
        start: 0,
        end: 0,
        num_layers: config.num_hidden_layers as u32,
        hidden_size: config.hidden_size as u32,
        throughput: 0.0,
        prefill_throughput: 0.0,
        cache_tokens_left: 0,
        prefix_tokens: 0,
        adapters: Vec::new(),
        max_length: u32::try_from(max_length).unwrap_or(u32::MAX),
        sessions: 0,
        max_sessions: args.max_sessions as u32,
        dtype: String::new(),
        version: env!("CARGO_PKG_VERSION").into(),
        addresses: addrs.iter().map(ToString::to_string).collect(),
        published_at_ms: 0,
        leaving: false,
        rebalances: rebalances(args),
        reachability: Default::default(),
    }
}
