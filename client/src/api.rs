//! `corolla api`: an OpenAI-compatible HTTP API (axum) in front of an
//! [`Assistant`], so that the `openai` SDKs, LangChain, Open WebUI or curl
//! can use a swarm. Each request answers through a conversation of its own;
//! one whose messages extend a conversation the API still holds reuses its
//! server sessions. Request bodies are bounded, errors come in OpenAI's
//! JSON shape, and `/metrics` speaks Prometheus' text format.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use corolla_model::SamplingParams;
use futures::Stream;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::assistant::{common_prefix, Assistant, Conversation};
use crate::chat::ChatMessage;
use crate::error::ClientError;
use crate::generate::{GenerateRequest, StopReason};
use crate::stop::StopSequences;
use crate::text::TextStream;

/// How the API listens and what it admits.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    pub addr: SocketAddr,
    /// Requests must carry `Authorization: Bearer KEY` when set.
    pub api_key: Option<String>,
    /// Longest request body accepted.
    pub max_body_bytes: usize,
    /// Answers generated at once; more requests wait their turn.
    pub max_concurrent: usize,
    /// Finished conversations kept open for follow-ups (oldest closed first).
    pub kept_conversations: usize,
    /// Answer length when a request names none (bounded by the context).
    pub default_max_tokens: usize,
}

impl Default for ApiSettings {
    fn default() -> Self {
        ApiSettings {
            addr: SocketAddr::from(([127, 0, 0, 1], 8000)),
            api_key: None,
            max_body_bytes: 1 << 20,
            max_concurrent: 16,
            kept_conversations: 8,
            default_max_tokens: 512,
        }
    }
}

/// A running API; [`ApiServer::shutdown`] stops it.
pub struct ApiServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl ApiServer {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Runs until `shutdown` or an I/O error.
    pub async fn wait(self) -> std::io::Result<()> {
        let _stop = self.stop;
        self.task
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))?
    }

    /// Stops accepting, lets running answers end, and returns.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.wait().await
    }
}

/// Binds `settings.addr` and serves the API for `assistant` in the background.
pub async fn serve(assistant: Arc<Assistant>, settings: ApiSettings) -> std::io::Result<ApiServer> {
    let listener = tokio::net::TcpListener::bind(settings.addr).await?;
    let addr = listener.local_addr()?;
    let state = Arc::new(ApiState {
        assistant,
        permits: Arc::new(Semaphore::new(settings.max_concurrent.max(1))),
        kept: Mutex::new(Vec::new()),
        metrics: Metrics::default(),
        settings,
    });
    let v1 = Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    let app = Router::new()
        .merge(v1)
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .with_state(state);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });
    tracing::info!(%addr, "OpenAI-compatible API listening");
    Ok(ApiServer {
        addr,
        stop: Some(stop),
        task,
    })
}

struct ApiState {
    assistant: Arc<Assistant>,
    settings: ApiSettings,
    permits: Arc<Semaphore>,
    /// Finished conversations, oldest first.
    kept: Mutex<Vec<Conversation>>,
    metrics: Metrics,
}

impl ApiState {
    /// The kept conversation sharing the longest prefix with `prompt`
    /// (at least half of what it holds), else a new one.
    fn take_conversation(&self, prompt: &[u32]) -> Conversation {
        let mut kept = lock(&self.kept);
        let best = kept
            .iter()
            .enumerate()
            .map(|(i, c)| (common_prefix(c.cached_tokens(), prompt), i))
            .filter(|&(shared, i)| shared > 0 && 2 * shared >= kept[i].cached_tokens().len())
            .max();
        match best {
            Some((_, i)) => kept.remove(i),
            None => Conversation::new(),
        }
    }

    fn keep_conversation(&self, conversation: Conversation) {
        if !conversation.is_open() {
            return;
        }
        let evicted = {
            let mut kept = lock(&self.kept);
            kept.push(conversation);
            let excess = kept.len().saturating_sub(self.settings.kept_conversations);
            kept.drain(..excess).collect::<Vec<_>>()
        };
        for old in evicted {
            tokio::spawn(old.close());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

// ---- errors ----------------------------------------------------------------

/// An error in OpenAI's shape: `{"error": {message, type, param, code}}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    code: Option<&'static str>,
    /// Already counted in `/metrics` (where it happened, in the answer's task).
    counted: bool,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            code: None,
            counted: false,
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The label `/metrics` counts this error under.
    fn kind(&self) -> &'static str {
        match (self.code, self.status) {
            (Some(code), _) => code,
            (None, StatusCode::BAD_REQUEST) => "invalid_request",
            (None, StatusCode::NOT_FOUND) => "not_found",
            (None, StatusCode::PAYLOAD_TOO_LARGE) => "body_too_large",
            (None, s) if s.is_server_error() => "server_error",
            _ => "other",
        }
    }

    fn body(&self) -> Value {
        let kind = match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": null, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

impl From<ClientError> for ApiError {
    fn from(e: ClientError) -> Self {
        match &e {
            ClientError::NoRoute { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()).with_code("no_route")
            }
            ClientError::TooLong { .. } | ClientError::SessionTooLong { .. } => {
                ApiError::bad_request(e.to_string()).with_code("context_length_exceeded")
            }
            ClientError::EmptyPrompt | ClientError::BadRequest(_) | ClientError::Tokenizer(_) => {
                ApiError::bad_request(e.to_string())
            }
            ClientError::Model(corolla_model::ModelError::InvalidSampling(_)) => {
                ApiError::bad_request(e.to_string())
            }
            _ => ApiError::new(StatusCode::BAD_GATEWAY, e.to_string()).with_code("swarm_error"),
        }
    }
}

async fn authorize(State(state): State<Arc<ApiState>>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.settings.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            let e = ApiError::new(StatusCode::UNAUTHORIZED, "invalid or missing API key")
                .with_code("invalid_api_key");
            state.metrics.error(e.kind());
            return e.into_response();
        }
    }
    next.run(request).await
}

// ---- models ----------------------------------------------------------------

fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "corolla"})
}

async fn list_models(State(state): State<Arc<ApiState>>) -> Json<Value> {
    state.metrics.request("models");
    Json(json!({"object": "list", "data": [model_object(state.assistant.model())]}))
}

async fn get_model(
    State(state): State<Arc<ApiState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    state.metrics.request("models");
    check_model(&state, &id).inspect_err(|e| state.metrics.error(e.kind()))?;
    Ok(Json(model_object(&id)))
}

fn check_model(state: &ApiState, model: &str) -> Result<(), ApiError> {
    let ours = state.assistant.model();
    if model != ours {
        let e = ApiError::new(
            StatusCode::NOT_FOUND,
            format!("the model {model:?} does not exist; this API serves {ours:?}"),
        )
        .with_code("model_not_found");
        return Err(e);
    }
    Ok(())
}

// ---- requests --------------------------------------------------------------

#[derive(Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct InMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// What chat and completion requests share. Unknown fields are ignored
/// (SDKs send more than we use); known ones of the wrong type are errors.
#[derive(Deserialize)]
struct Common {
    model: String,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<i64>,
    stop: Option<StopField>,
    n: Option<u64>,
}

#[derive(Deserialize)]
struct ChatRequest {
    messages: Vec<InMessage>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: PromptField,
    #[serde(flatten)]
    common: Common,
}

/// Reads at most `max` bytes of body and parses it.
async fn parse_body<T: serde::de::DeserializeOwned>(
    state: &ApiState,
    body: Body,
) -> Result<T, ApiError> {
    let max = state.settings.max_body_bytes;
    let bytes: Bytes = axum::body::to_bytes(body, max).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is over {max} bytes"),
        )
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

fn chat_messages(messages: Vec<InMessage>) -> Result<Vec<ChatMessage>, ApiError> {
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
struct Job {
    request: GenerateRequest,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
    model: String,
}

/// Seeds for requests that name none: distinct per request.
fn fresh_seed() -> u64 {
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

fn job(state: &ApiState, common: Common, prompt_ids: Vec<u32>) -> Result<Job, ApiError> {
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
    if prompt_ids.len() + max_new_tokens > limit + 1 {
        return Err(ApiError::bad_request(format!(
            "the prompt takes {} tokens; with max_tokens {max_new_tokens} that exceeds this model's limit of {limit} positions (the servers' inference_max_length and the model's context)",
            prompt_ids.len()
        ))
        .with_code("context_length_exceeded"));
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
        },
        stops,
        stream: common.stream,
        include_usage: common.stream_options.unwrap_or_default().include_usage,
        model: common.model,
    })
}

/// Fails fast with 503 when the swarm leaves blocks uncovered, instead of
/// waiting out the discovery timeout.
async fn check_coverage(state: &ApiState) -> Result<(), ApiError> {
    let Some(view) = state.assistant.swarm_view() else {
        return Ok(());
    };
    let layers = state.assistant.head().config().num_hidden_layers;
    view.ensure_fresh().await;
    if view.uncovered(layers).is_empty() {
        return Ok(());
    }
    view.refresh().await;
    let uncovered = view.uncovered(layers);
    if uncovered.is_empty() {
        return Ok(());
    }
    Err(ClientError::NoRoute { uncovered }.into())
}

// ---- answering -------------------------------------------------------------

/// What the generation task reports.
enum Progress {
    Text(String),
    Done(Result<Finished, ApiError>),
}

struct Finished {
    finish_reason: &'static str,
    prompt_tokens: usize,
    completion_tokens: usize,
}

/// Answers `job` on a blocking thread of its own (the local chain computes
/// there; a swarm chain's future need not be `Send`), streaming text pieces.
fn spawn_answer(
    state: Arc<ApiState>,
    job: Job,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> mpsc::UnboundedReceiver<Progress> {
    let (tx, rx) = mpsc::unbounded_channel();
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        runtime.block_on(answer(state, job, tx));
    });
    rx
}

async fn answer(state: Arc<ApiState>, job: Job, tx: mpsc::UnboundedSender<Progress>) {
    let assistant = &state.assistant;
    let started = Instant::now();
    let mut conversation = state.take_conversation(&job.request.prompt_ids);
    let mut text = TextStream::default();
    let mut stops = StopSequences::new(job.stops);
    let mut first_token = true;
    let mut decode_error = None;
    let tokenizer = assistant.tokenizer();
    let result = assistant
        .answer(&mut conversation, &job.request, |token| {
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
        })
        .await;
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

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage(f: &Finished) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

/// The two endpoints' response shapes.
#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn choice(self, text: &str, finish_reason: Option<&str>, chunk: bool) -> Value {
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
struct Envelope<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Value>,
}

async fn respond(state: Arc<ApiState>, kind: Kind, job: Job) -> Result<Response, ApiError> {
    check_coverage(&state).await?;
    let permit =
        state.permits.clone().acquire_owned().await.map_err(|_| {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the API is shutting down")
        })?;
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
    let mut rx = spawn_answer(state.clone(), job, permit);
    if !stream {
        let mut text = String::new();
        while let Some(progress) = rx.recv().await {
            match progress {
                Progress::Text(piece) => text.push_str(&piece),
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
                    None => None,
                }
            }
        },
    );
    Ok(sse(events).into_response())
}

fn sse(
    events: impl Stream<Item = Result<Event, Infallible>> + Send + 'static,
) -> impl IntoResponse {
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

async fn chat_completions(State(state): State<Arc<ApiState>>, body: Body) -> Response {
    state.metrics.request("chat_completions");
    let result = async {
        let request: ChatRequest = parse_body(&state, body).await?;
        check_model(&state, &request.common.model)?;
        let messages = chat_messages(request.messages)?;
        let prompt_ids = state.assistant.chat_prompt(&messages)?;
        let job = job(&state, request.common, prompt_ids)?;
        respond(state.clone(), Kind::Chat, job).await
    }
    .await;
    finish(&state, result)
}

async fn completions(State(state): State<Arc<ApiState>>, body: Body) -> Response {
    state.metrics.request("completions");
    let result = async {
        let request: CompletionRequest = parse_body(&state, body).await?;
        check_model(&state, &request.common.model)?;
        let prompt = match request.prompt {
            PromptField::One(p) => p,
            PromptField::Many(mut v) if v.len() == 1 => v.remove(0),
            PromptField::Many(_) => {
                return Err(ApiError::bad_request("prompt must be one string"));
            }
        };
        let prompt_ids = state.assistant.tokenizer().encode(&prompt)?;
        let job = job(&state, request.common, prompt_ids)?;
        respond(state.clone(), Kind::Completion, job).await
    }
    .await;
    finish(&state, result)
}

fn finish(state: &ApiState, result: Result<Response, ApiError>) -> Response {
    match result {
        Ok(response) => response,
        Err(e) => {
            if !e.counted {
                state.metrics.error(e.kind());
            }
            e.into_response()
        }
    }
}

// ---- metrics ---------------------------------------------------------------

#[derive(Default)]
struct Metrics {
    requests: Mutex<BTreeMap<&'static str, u64>>,
    errors: Mutex<BTreeMap<&'static str, u64>>,
    tokens_in: AtomicU64,
    tokens_out: AtomicU64,
    tokens_reused: AtomicU64,
    ttft_micros: AtomicU64,
    ttft_count: AtomicU64,
}

impl Metrics {
    fn request(&self, endpoint: &'static str) {
        *lock(&self.requests).entry(endpoint).or_default() += 1;
    }

    fn error(&self, kind: &'static str) {
        *lock(&self.errors).entry(kind).or_default() += 1;
    }

    fn tokens(&self, prompt: usize, completion: usize) {
        self.tokens_in.fetch_add(prompt as u64, Ordering::Relaxed);
        self.tokens_out
            .fetch_add(completion as u64, Ordering::Relaxed);
    }

    fn time_to_first_token(&self, elapsed: Duration) {
        self.ttft_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
        self.ttft_count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP corolla_api_requests_total Requests by endpoint.\n");
        out.push_str("# TYPE corolla_api_requests_total counter\n");
        for (endpoint, n) in lock(&self.requests).iter() {
            out.push_str(&format!(
                "corolla_api_requests_total{{endpoint=\"{endpoint}\"}} {n}\n"
            ));
        }
        out.push_str("# HELP corolla_api_errors_total Failed requests by kind.\n");
        out.push_str("# TYPE corolla_api_errors_total counter\n");
        for (kind, n) in lock(&self.errors).iter() {
            out.push_str(&format!(
                "corolla_api_errors_total{{kind=\"{kind}\"}} {n}\n"
            ));
        }
        let counters = [
            (
                "corolla_api_prompt_tokens_total",
                "Prompt tokens of answered requests.",
                self.tokens_in.load(Ordering::Relaxed),
            ),
            (
                "corolla_api_completion_tokens_total",
                "Tokens generated.",
                self.tokens_out.load(Ordering::Relaxed),
            ),
            (
                "corolla_api_reused_prompt_tokens_total",
                "Prompt tokens that open sessions of an earlier turn already held.",
                self.tokens_reused.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, value) in counters {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}\n"
            ));
        }
        let ttft = self.ttft_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let count = self.ttft_count.load(Ordering::Relaxed);
        let name = "corolla_api_time_to_first_token_seconds";
        out.push_str(&format!(
            "# HELP {name} Time from a request to its first token.\n# TYPE {name} summary\n\
             {name}_sum {ttft}\n{name}_count {count}\n"
        ));
        out
    }
}

async fn metrics(State(state): State<Arc<ApiState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
