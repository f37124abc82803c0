//! Answering a [`Job`]: generation on a blocking thread of its own, its text
//! streamed back as server-sent events or gathered into one response.

use std::convert::Infallible;
use std::net::IpAddr;
use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::admission::AnswerPlace;
use super::error::ApiError;
use super::request::{check_coverage, fresh_seed, Job};
use super::state::ApiState;
use crate::error::ClientError;
use crate::generate::{AnswerEvent, StopReason};
use crate::stop::StopSequences;
use crate::text::TextStream;
use corolla_shared::ErrorKind;

/// What the generation task reports.
pub(super) enum Progress {
    Text(String),
    /// Tokens already reported were withdrawn (a server caught lying about
    /// positions already answered): the answer's text so far is `text`.
    /// A response still being gathered starts again from it; a stream,
    /// which cannot take text back, ends with an error.
    Restart {
        text: String,
        withdrawn: usize,
    },
    Done(Result<Finished, ApiError>),
}

pub(super) struct Finished {
    pub(super) finish_reason: &'static str,
    pub(super) prompt_tokens: usize,
    pub(super) completion_tokens: usize,
}

/// Answers `job` on a blocking thread of its own (the local chain computes
/// there; a swarm chain's future need not be `Send`), streaming text pieces.
pub(super) fn spawn_answer(
    state: Arc<ApiState>,
    job: Job,
    place: AnswerPlace,
) -> mpsc::UnboundedReceiver<Progress> {
    let (tx, rx) = mpsc::unbounded_channel();
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let _place = place;
        runtime.block_on(answer(state, job, tx));
    });
    rx
}

/// Whether a failed answer was refused for want of sessions.
fn is_busy(e: &ClientError) -> bool {
    e.kind() == ErrorKind::Busy
}

pub(super) async fn answer(state: Arc<ApiState>, job: Job, tx: mpsc::UnboundedSender<Progress>) {
    let assistant = &state.assistant;
    let started = Instant::now();
    let mut conversation = state.take_conversation(&job.request.prompt_ids, job.adapter.as_deref());
    let mut text = TextStream::default();
    let stop_words = job.stops.clone();
    let mut stops = StopSequences::new(job.stops);
    let mut first_token = true;
    let mut decode_error = None;
    let tokenizer = assistant.tokenizer();
    let mut shown_tokens = 0;
    let mut on_event = |event| {
        let token = match event {
            AnswerEvent::Token(token) => {
                shown_tokens += 1;
                token
            }
            AnswerEvent::Withdraw { kept } => {
                let withdrawn = shown_tokens - kept.min(shown_tokens);
                shown_tokens = kept;
                if let Err(e) = text.truncate(tokenizer, kept) {
                    decode_error = Some(e);
                    return ControlFlow::Break(());
                }
                // The stops start again over the kept text (it held none,
                // or the answer would have ended there).
                stops = StopSequences::new(stop_words.clone());
                let kept_text = text.released(tokenizer).unwrap_or_default();
                let (text, _) = stops.push(&kept_text);
                let restart = Progress::Restart { text, withdrawn };
                return if tx.send(restart).is_err() || tx.is_closed() {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                };
            }
        };
        if first_token {
            first_token = false;
            state.metrics.time_to_first_token(started.elapsed());
        }
        let piece = match text.push(tokenizer, token) {
            Ok(piece) => piece.unwrap_or_default(),
            Err(e) => {
                decode_error = Some(e);
                return ControlFlow::Break(());
            }
        };
        let (out, stopped) = stops.push(&piece);
        if !out.is_empty() && tx.send(Progress::Text(out)).is_err() {
            return ControlFlow::Break(());
        }
        if stopped || tx.is_closed() {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    let mut result = assistant
        .answer(&mut conversation, &job.request, &mut on_event)
        .await;
    // Servers cap the sessions one peer (this API) holds: the conversations
    // kept for follow-ups give theirs up for a request that needs them.
    let mut tries = 0;
    while result.as_ref().is_err_and(is_busy) && tries < 3 {
        tries += 1;
        state.release_kept().await;
        // The servers free a slot once they have read the Close.
        tokio::time::sleep(Duration::from_millis(300 * tries)).await;
        assistant.forgive_busy();
        result = assistant
            .answer(&mut conversation, &job.request, &mut on_event)
            .await;
    }
    let result = match (result, decode_error) {
        (_, Some(e)) | (Err(e), None) => Err(ApiError::from(e)),
        (Ok(answer), None) => {
            let tail = stops.finish();
            if !tail.is_empty() {
                let _ = tx.send(Progress::Text(tail));
            }
            let out = &answer.output;
            state
                .metrics
                .tokens(out.prompt_ids.len(), out.generated_ids.len());
            state
                .metrics
                .tokens_reused
                .fetch_add(answer.reused_tokens as u64, Ordering::Relaxed);
            tracing::debug!(
                reused = answer.reused_tokens,
                prompt = out.prompt_ids.len(),
                "answered"
            );
            Ok(Finished {
                finish_reason: match out.stop_reason {
                    StopReason::MaxNewTokens if !stops.stopped() => "length",
                    _ => "stop",
                },
                prompt_tokens: out.prompt_ids.len(),
                completion_tokens: out.generated_ids.len(),
            })
        }
    };
    let result = result.map_err(|mut e| {
        state.metrics.error(e.kind());
        e.counted = true;
        e
    });
    if tx.is_closed() {
        // The client went away: free the servers' sessions now.
        conversation.close().await;
    } else {
        state.keep_conversation(conversation);
        let _ = tx.send(Progress::Done(result));
    }
}

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) fn usage(f: &Finished) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

/// The two endpoints' response shapes.
#[derive(Clone, Copy)]
pub(super) enum Kind {
    Chat,
    Completion,
}

impl Kind {
    pub(super) fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    pub(super) fn choice(self, text: &str, finish_reason: Option<&str>, chunk: bool) -> Value {
        match (self, chunk) {
            (Kind::Chat, false) => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
            (Kind::Chat, true) => {
                let delta = match finish_reason {
                    Some(_) => json!({}),
                    None => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason})
            }
            (Kind::Completion, _) => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
        }
    }
}

#[derive(Serialize)]
pub(super) struct Envelope<'a> {
    pub(super) id: &'a str,
    pub(super) object: &'static str,
    pub(super) created: u64,
    pub(super) model: &'a str,
    pub(super) choices: Vec<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) usage: Option<Value>,
}

pub(super) async fn respond(
    state: Arc<ApiState>,
    kind: Kind,
    job: Job,
    from: Option<IpAddr>,
) -> Result<Response, ApiError> {
    check_coverage(&state, job.adapter.as_deref()).await?;
    let place = state.admission.admit(from).await?;
    let id = format!(
        "{}-{:016x}",
        match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        },
        fresh_seed()
    );
    let created = now_secs();
    let model = job.model.clone();
    let (stream, include_usage) = (job.stream, job.include_usage);
    let mut rx = spawn_answer(state.clone(), job, place);
    if !stream {
        let mut text = String::new();
        while let Some(progress) = rx.recv().await {
            match progress {
                Progress::Text(piece) => text.push_str(&piece),
                Progress::Restart { text: kept, .. } => text = kept,
                Progress::Done(result) => {
                    let finished = result?;
                    let body = Envelope {
                        id: &id,
                        object: kind.object(false),
                        created,
                        model: &model,
                        choices: vec![kind.choice(&text, Some(finished.finish_reason), false)],
                        usage: Some(usage(&finished)),
                    };
                    return Ok(Json(body).into_response());
                }
            }
        }
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the answer ended without a result",
        ));
    }
    let chunk = move |choices: Vec<Value>, usage: Option<Value>| {
        let envelope = Envelope {
            id: &id,
            object: kind.object(true),
            created,
            model: &model,
            choices,
            usage,
        };
        Event::default().data(serde_json::to_string(&envelope).unwrap_or_default())
    };
    let first = matches!(kind, Kind::Chat).then(|| {
        chunk(
            vec![json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})],
            None,
        )
    });
    let events = futures::stream::unfold(
        (rx, first, false, Vec::<Event>::new()),
        move |(mut rx, first, done, mut queued)| {
            let chunk = chunk.clone();
            let state = state.clone();
            async move {
                if let Some(event) = first {
                    return Some((Ok::<_, Infallible>(event), (rx, None, done, queued)));
                }
                if let Some(event) = queued.pop() {
                    return Some((Ok(event), (rx, None, done, queued)));
                }
                if done {
                    return None;
                }
                match rx.recv().await {
                    Some(Progress::Text(piece)) => {
                        let event = chunk(vec![kind.choice(&piece, None, true)], None);
                        Some((Ok(event), (rx, None, false, queued)))
                    }
                    Some(Progress::Done(Ok(finished))) => {
                        // Sent in reverse: `pop` takes from the end.
                        queued.push(Event::default().data("[DONE]"));
                        if include_usage {
                            queued.push(chunk(Vec::new(), Some(usage(&finished))));
                        }
                        let event = chunk(
                            vec![kind.choice("", Some(finished.finish_reason), true)],
                            None,
                        );
                        Some((Ok(event), (rx, None, true, queued)))
                    }
                    Some(Progress::Done(Err(e))) => {
                        queued.push(Event::default().data("[DONE]"));
                        let event = Event::default().data(e.body().to_string());
                        Some((Ok(event), (rx, None, true, queued)))
                    }
                    Some(Progress::Restart { withdrawn, .. }) => {
                        // Dropping `rx` with the stream stops the answer.
                        let e = ApiError::from(ClientError::Withdrawn { withdrawn });
                        state.metrics.error(e.kind());
                        queued.push(Event::default().data("[DONE]"));
                        let event = Event::default().data(e.body().to_string());
                        Some((Ok(event), (rx, None, true, queued)))
                    }
                    None => None,
                }
            }
        },
    );
    Ok(sse(events).into_response())
}

pub(super) fn sse(
    events: impl Stream<Item = Result<Event, Infallible>> + Send + 'static,
) -> impl IntoResponse {
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}
