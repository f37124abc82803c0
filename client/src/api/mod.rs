//! `corolla api`: an OpenAI-compatible HTTP API (axum) in front of an
//! [`Assistant`], so that the `openai` SDKs, LangChain, Open WebUI or curl
//! can use a swarm. Each request answers through a conversation of its own;
//! one whose messages extend a conversation the API still holds reuses its
//! server sessions. Request bodies are bounded, errors come in OpenAI's
//! JSON shape, and `/metrics` speaks Prometheus' text format.

mod answer;
mod error;
mod metrics;
mod request;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use corolla_http::{serve_bounded, HttpLimits};
use corolla_shared::adapter_name::check_adapter_name;
use serde_json::{json, Value};
use tokio::sync::{oneshot, Semaphore};

use crate::assistant::{Assistant, Conversation};
use crate::tokens::common_prefix;
use answer::{respond, Kind};
use error::ApiError;
use metrics::Metrics;
use request::{chat_messages, job, parse_body, ChatRequest, CompletionRequest, PromptField};

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
    /// The longest draft of a multi-token step; 0: one token per step.
    pub drafts: usize,
    /// The most tokens one request may ask for (`max_tokens`); more is a
    /// bad request, not an answer that holds a session for minutes.
    pub max_tokens_cap: usize,
    /// Connections at once, the header deadline, a connection's lifetime.
    pub http: HttpLimits,
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
            drafts: crate::DEFAULT_DRAFTS,
            max_tokens_cap: 4096,
            http: HttpLimits::default(),
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
    let limits = settings.http;
    // Idle sockets must meet the connection cap before the kernel's file limit.
    corolla_http::raise_open_file_limit();
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
        let stopped = async {
            let _ = stopped.await;
        };
        serve_bounded(listener, app, limits, stopped).await;
        Ok(())
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
    /// The kept conversation with `adapter` sharing the longest prefix
    /// with `prompt` (at least half of what it holds), else a new one.
    fn take_conversation(&self, prompt: &[u32], adapter: Option<&str>) -> Conversation {
        let mut kept = lock(&self.kept);
        let best = kept
            .iter()
            .enumerate()
            .filter(|(_, c)| c.adapter() == adapter)
            .map(|(i, c)| (common_prefix(c.cached_tokens(), prompt), i))
            .filter(|&(shared, i)| shared > 0 && 2 * shared >= kept[i].cached_tokens().len())
            .max();
        match best {
            Some((_, i)) => kept.remove(i),
            None => Conversation::new().with_adapter(adapter.map(str::to_owned)),
        }
    }

    /// Closes every kept conversation.
    async fn release_kept(&self) {
        let kept = std::mem::take(&mut *lock(&self.kept));
        for conversation in kept {
            conversation.close().await;
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

fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "corolla"})
}

/// The adapters the swarm's usable servers announce.
async fn announced_adapters(state: &ApiState) -> Vec<String> {
    match state.assistant.swarm_view() {
        Some(view) => {
            view.ensure_fresh().await;
            view.adapters()
        }
        None => Vec::new(),
    }
}

/// The model, and the model with each adapter the swarm's servers
/// announce (`model:adapter`).
async fn list_models(State(state): State<Arc<ApiState>>) -> Json<Value> {
    state.metrics.request("models");
    let model = state.assistant.model();
    let adapters = announced_adapters(&state).await;
    let data: Vec<Value> = std::iter::once(model_object(model))
        .chain(
            adapters
                .iter()
                .map(|a| model_object(&format!("{model}:{a}"))),
        )
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn get_model(
    State(state): State<Arc<ApiState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    state.metrics.request("models");
    let result = async {
        if let Some(adapter) = check_model(&state, &id)? {
            if !announced_adapters(&state).await.contains(&adapter) {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!("no server of the swarm runs adapter {adapter:?}"),
                )
                .with_code("model_not_found"));
            }
        }
        Ok(Json(model_object(&id)))
    }
    .await;
    result.inspect_err(|e| state.metrics.error(e.kind()))
}

/// The adapter `model` asks for: none for the model's own name, `adapter`
/// for `model:adapter`.
fn check_model(state: &ApiState, model: &str) -> Result<Option<String>, ApiError> {
    let ours = state.assistant.model();
    if model == ours {
        return Ok(None);
    }
    match model.rsplit_once(':') {
        Some((base, adapter)) if base == ours && check_adapter_name(adapter).is_ok() => {
            Ok(Some(adapter.to_string()))
        }
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "the model {model:?} does not exist; this API serves {ours:?}, and {ours:?}:ADAPTER for the adapters GET /v1/models lists"
            ),
        )
        .with_code("model_not_found")),
    }
}

async fn chat_completions(State(state): State<Arc<ApiState>>, body: Body) -> Response {
    state.metrics.request("chat_completions");
    let result = async {
        let request: ChatRequest = parse_body(&state, body).await?;
        let adapter = check_model(&state, &request.common.model)?;
        let messages = chat_messages(request.messages)?;
        let prompt_ids = state.assistant.chat_prompt(&messages)?;
        let job = job(&state, request.common, adapter, prompt_ids)?;
        respond(state.clone(), Kind::Chat, job).await
    }
    .await;
    finish(&state, result)
}

async fn completions(State(state): State<Arc<ApiState>>, body: Body) -> Response {
    state.metrics.request("completions");
    let result = async {
        let request: CompletionRequest = parse_body(&state, body).await?;
        let adapter = check_model(&state, &request.common.model)?;
        let prompt = match request.prompt {
            PromptField::One(p) => p,
            PromptField::Many(mut v) if v.len() == 1 => v.remove(0),
            PromptField::Many(_) => {
                return Err(ApiError::bad_request("prompt must be one string"));
            }
        };
        let prompt_ids = state.assistant.tokenizer().encode(&prompt)?;
        let job = job(&state, request.common, adapter, prompt_ids)?;
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

async fn metrics(State(state): State<Arc<ApiState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
