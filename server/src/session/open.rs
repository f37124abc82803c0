//! Opening a session: every field of the Open checked, a slot and cache
//! room taken (evicting what the quota rules allow), the cache allocated.

use std::time::Duration;

use corolla_model::fingerprint::span_hash;
use corolla_shared::flow::MIN_WINDOW;
use corolla_shared::protocol::{ErrorCode, OpenRequest};
use libp2p::PeerId;
use tokio::time::Instant;

use crate::admission::{BudgetFull, Reservation};
use crate::push::PushLink;
use crate::quota::{Refusal, Slot};
use crate::successor::Successor;

use super::{Session, SessionContext, RETRY_AFTER};

pub(super) async fn open_session(
    ctx: &SessionContext,
    peer: PeerId,
    open: &OpenRequest,
) -> Result<Session, (ErrorCode, String)> {
    if open.model != ctx.settings.template.model {
        return Err((
            ErrorCode::WrongModel,
            format!(
                "this server serves model {:?}, not {:?}",
                ctx.settings.template.model, open.model
            ),
        ));
    }
    let served = ctx.core.span().range();
    let (start, end) = (open.start as usize, open.end as usize);
    if start >= end || start < served.start || end > served.end {
        return Err((
            ErrorCode::SpanNotServed,
            format!(
                "this server holds blocks {}..{}; blocks {start}..{end} requested",
                served.start, served.end
            ),
        ));
    }
    if !open.fingerprint.is_empty() {
        let ours = span_hash(&ctx.block_hashes[start - served.start..end - served.start]);
        if open.fingerprint != ours {
            return Err((
                ErrorCode::WrongModel,
                format!(
                    "this server holds other weights for blocks {start}..{end} (hash {ours}, not {})",
                    open.fingerprint
                ),
            ));
        }
    }
    let adapter = match &open.adapter {
        None => None,
        Some(name) => match ctx.adapters.get(name) {
            Some(adapter) => Some((name.clone(), adapter.clone())),
            None => {
                let served = ctx.adapters.names();
                return Err((
                    ErrorCode::WrongModel,
                    format!(
                        "this server does not run adapter {name:?} (it runs: {})",
                        if served.is_empty() {
                            "none".to_string()
                        } else {
                            served.join(", ")
                        }
                    ),
                ));
            }
        },
    };
    if open.next == Some(ctx.settings.peer_id) {
        return Err((
            ErrorCode::BadFrame,
            "a session cannot push to its own server".to_string(),
        ));
    }
    if open.flow_window > 0 && open.flow_window < MIN_WINDOW {
        return Err((
            ErrorCode::BadFrame,
            format!(
                "flow_window {} is below the minimum of {MIN_WINDOW} bytes",
                open.flow_window
            ),
        ));
    }
    let max_length = open.max_length as usize;
    if max_length == 0 {
        return Err((ErrorCode::TooLong, "max_length must be at least 1".into()));
    }
    if max_length > ctx.settings.max_length {
        return Err((
            ErrorCode::TooLong,
            format!(
                "max_length {max_length} exceeds {}",
                ctx.settings.max_length
            ),
        ));
    }
    let slot = ctx
        .settings
        .sessions
        .take_waiting(ctx.settings.holder(peer))
        .await
        .map_err(|refusal| {
            let message = match refusal {
                Refusal::Full { limit } => format!("busy: {limit}/{limit} sessions in use"),
                Refusal::PeerFull { limit } => {
                    format!("busy: this peer holds {limit} sessions, the most one peer may hold")
                }
            };
            (ErrorCode::Busy, message)
        })?;
    let reservation = reserve_cache(ctx, &slot, max_length).await.map_err(
        |BudgetFull { free, total }| {
            (
                ErrorCode::Busy,
                format!(
                    "busy: the KV cache is full ({free} of {total} tokens free, {max_length} asked); \
                     retry after {} s",
                    RETRY_AFTER.as_secs()
                ),
            )
        },
    )?;
    slot.holds(max_length);
    let cache = ctx
        .core
        .open(start..end, max_length, adapter)
        .await
        .map_err(|e| (ErrorCode::TooLong, e.to_string()))?;
    ctx.settings.metrics.session_opened(peer, start..end);
    Ok(Session {
        cache,
        layers: start..end,
        len: 0,
        dtype: open.dtype,
        compression: open.compression,
        max_length,
        inbox: ctx.settings.pushes.open(),
        next: open.next.map(|next| {
            let model = &ctx.settings.template.model;
            Successor::check(&ctx.settings.control, next, model, end)
        }),
        push_link: PushLink::default(),
        last_step_id: 0,
        last_push: None,
        slot,
        _reservation: reservation,
    })
}

/// Reserves `tokens` of the KV cache for the session holding `slot`. When
/// the cache is full, the sessions the slot rules would evict for this one
/// (stale ones, then those of a source over its share) are evicted one at a
/// time, each given a moment to free its share: a crowd within its share of
/// sessions cannot hold the whole cache with long reservations.
async fn reserve_cache(
    ctx: &SessionContext,
    slot: &Slot,
    tokens: usize,
) -> Result<Reservation, BudgetFull> {
    let cache = &ctx.settings.cache;
    loop {
        let full = match cache.try_reserve(tokens) {
            Ok(reservation) => return Ok(reservation),
            Err(full) => full,
        };
        // Shared prefix pages give way before any session does.
        if ctx.core.prefixes().is_some_and(|p| p.make_room(tokens)) {
            continue;
        }
        if !ctx.settings.sessions.evict_for(slot) {
            return Err(full);
        }
        // The evicted session frees its reservation as soon as its task
        // sees the eviction: milliseconds.
        let (before, deadline) = (cache.free(), Instant::now() + Duration::from_secs(1));
        while cache.free() <= before && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
