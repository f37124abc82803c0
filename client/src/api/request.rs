//! Request bodies: parsed within a size bound, checked, tokenized into a [`Job`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use corolla_model::SamplingParams;
use corolla_shared::ErrorKind;
use serde::Deserialize;

use super::error::ApiError;
use super::state::ApiState;
use crate::chat::ChatMessage;
use crate::error::ClientError;
use crate::generate::GenerateRequest;

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
pub(super) struct ContentPart {
    #[serde(rename = "type")]
    pub(super) kind: String,
    #[serde(default)]
    pub(super) text: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct InMessage {
    pub(super) role: String,
    #[serde(default)]
    pub(super) content: Option<Content>,
}

#[derive(Deserialize, Default)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
}

/// What chat and completion requests share. Unknown fields are ignored
/// (SDKs send more than we use); known ones of the wrong type are errors.
#[derive(Deserialize)]
pub(super) struct Common {
    pub(super) model: String,
    #[serde(default)]
    pub(super) stream: bool,
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
    pub(super) max_tokens: Option<u64>,
    pub(super) max_completion_tokens: Option<u64>,
    pub(super) temperature: Option<f64>,
    pub(super) top_p: Option<f64>,
    pub(super) seed: Option<i64>,
    pub(super) stop: Option<StopField>,
    pub(super) n: Option<u64>,
}

#[derive(Deserialize)]
pub(super) struct ChatRequest {
    pub(super) messages: Vec<InMessage>,
    #[serde(flatten)]
    pub(super) common: Common,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum PromptField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
pub(super) struct CompletionRequest {
    pub(super) prompt: PromptField,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// Reads at most `max` bytes of body and parses it.
pub(super) async fn parse_body<T: serde::de::DeserializeOwned>(
    state: &ApiState,
    body: Body,
) -> Result<T, ApiError> {
    let max = state.settings.max_body_bytes;
    let bytes: Bytes = axum::body::to_bytes(body, max).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is over {max} bytes"),
        )
        .with_code(ErrorKind::BadRequest.as_str())
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

pub(super) fn chat_messages(messages: Vec<InMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty"));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                other => {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}].role {other:?} is not one of system, user, assistant"
                    )))
                }
            };
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p.kind.as_str(), p.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            (kind, _) => {
                                return Err(ApiError::bad_request(format!(
                                    "messages[{i}]: content parts of type {kind:?} are not supported (text only)"
                                )))
                            }
                        }
                    }
                    text
                }
            };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// A request checked and tokenized, ready to answer.
pub(super) struct Job {
    pub(super) request: GenerateRequest,
    pub(super) stops: Vec<String>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// As the request named it (`model`, or `model:adapter`).
    pub(super) model: String,
    /// The LoRA adapter the model's name asked for.
    pub(super) adapter: Option<String>,
}

/// Seeds for requests that name none: distinct per request.
pub(super) fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // splitmix64 of the two.
    let mut z = nanos ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub(super) fn job(
    state: &ApiState,
    common: Common,
    adapter: Option<String>,
    prompt_ids: Vec<u32>,
) -> Result<Job, ApiError> {
    if let Some(n) = common.n {
        if n != 1 {
            return Err(ApiError::bad_request(format!("n must be 1, not {n}")));
        }
    }
    let temperature = common.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_request(format!(
            "temperature must be in 0..=2, not {temperature}"
        )));
    }
    let top_p = common.top_p.filter(|&p| p < 1.0);
    if let Some(p) = common.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::bad_request(format!(
                "top_p must be in (0, 1], not {p}"
            )));
        }
    }
    let stops = match common.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(v)) => v,
    };
    if stops.len() > 4 {
        return Err(ApiError::bad_request("stop takes at most 4 sequences"));
    }
    let limit = state.assistant.max_positions();
    let room = limit.saturating_sub(prompt_ids.len());
    let max_new_tokens = match common.max_completion_tokens.or(common.max_tokens) {
        Some(0) => return Err(ApiError::bad_request("max_tokens must be at least 1")),
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => state.settings.default_max_tokens.min(room.max(1)),
    };
    // `max_tokens` comes from the client: any u64, so no plain addition.
    if prompt_ids.len().saturating_add(max_new_tokens) > limit + 1 {
        return Err(ApiError::bad_request(format!(
            "the prompt takes {} tokens; with max_tokens {max_new_tokens} that exceeds this model's limit of {limit} positions (the servers' inference_max_length and the model's context)",
            prompt_ids.len()
        ))
        .with_code(ErrorKind::ContextLengthExceeded.as_str()));
    }
    // Within the context, but more than this API lets one request hold a session for.
    let cap = state.settings.max_tokens_cap;
    if max_new_tokens > cap {
        return Err(ApiError::bad_request(format!(
            "max_tokens {max_new_tokens} exceeds this API's cap of {cap} tokens per request"
        )));
    }
    Ok(Job {
        request: GenerateRequest {
            prompt_ids,
            max_new_tokens,
            sampling: SamplingParams {
                temperature,
                top_k: None,
                top_p,
                repetition_penalty: 1.0,
                seed: common.seed.map_or_else(fresh_seed, |s| s as u64),
            },
            stop_at_eos: true,
            drafts: state.settings.drafts,
        },
        stops,
        stream: common.stream,
        include_usage: common.stream_options.unwrap_or_default().include_usage,
        model: common.model,
        adapter,
    })
}

/// Fails fast with 503 when the swarm leaves blocks uncovered, instead of
/// waiting out the discovery timeout; with 404 when no server announces
/// the adapter asked for.
pub(super) async fn check_coverage(
    state: &ApiState,
    adapter: Option<&str>,
) -> Result<(), ApiError> {
    let Some(view) = state.assistant.swarm_view() else {
        return Ok(());
    };
    if let Some(adapter) = adapter {
        view.ensure_fresh().await;
        if !view.adapters().iter().any(|a| a == adapter) {
            view.refresh().await;
        }
        if !view.adapters().iter().any(|a| a == adapter) {
            let e = ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "no server of the swarm runs adapter {adapter:?}; GET /v1/models lists those that do"
                ),
            )
            .with_code("model_not_found");
            return Err(e);
        }
    }
    let layers = state.assistant.head().config().num_hidden_layers;
    view.ensure_fresh().await;
    if view.uncovered(layers, adapter).is_empty() {
        return Ok(());
    }
    view.refresh().await;
    let uncovered = view.uncovered(layers, adapter);
    if uncovered.is_empty() {
        return Ok(());
    }
    if let Some(next_try) = view.busy_covers(layers, adapter) {
        return Err(ApiError::busy(
            format!(
                "busy: every server of blocks {} is full now; retry in {} s",
                uncovered
                    .iter()
                    .map(|(a, b)| format!("{a}..{b}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                next_try.as_secs().max(1)
            ),
            next_try,
        ));
    }
    Err(match adapter {
        Some(adapter) => ClientError::AdapterNotServed {
            adapter: adapter.to_string(),
            uncovered,
        },
        None => ClientError::NoRoute { uncovered },
    }
    .into())
}
