//! `corolla api`: an OpenAI-compatible HTTP API (axum) in front of an
//! [`Assistant`], so that the `openai` SDKs, LangChain, Open WebUI or curl
//! can use a swarm. Each request answers through a conversation of its own;
//! one whose messages extend a conversation the API still holds reuses its
//! server sessions. Request bodies are bounded, errors come in OpenAI's
//! JSON shape, and `/metrics` speaks Prometheus' text format.

mod admission;
mod answer;
mod error;
mod metrics;
mod request;
mod state;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use corolla_http::{serve_bounded, ClientAddress};
use corolla_shared::adapter_name::check_adapter_name;
use serde_json::{json, Value};
use tokio::sync::oneshot;

use crate::assistant::Assistant;
use admission::Admission;
use answer::{respond, Kind};
use error::ApiError;
use metrics::Metrics;
use request::{chat_messages, job, parse_body, ChatRequest, CompletionRequest, PromptField};
pub use state::ApiSettings;
use state::ApiState;

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
        admission: Admission::new(settings.max_concurrent),
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

async fn chat_completions(
    State(state): State<Arc<ApiState>>,
    from: Option<Extension<ClientAddress>>,
    body: Body,
) -> Response {
    state.metrics.request("chat_completions");
    let result = async {
        let request: ChatRequest = parse_body(&state, body).await?;
        let adapter = check_model(&state, &request.common.model)?;
        let messages = chat_messages(request.messages)?;
        let prompt_ids = state.assistant.chat_prompt(&messages)?;
        let job = job(&state, request.common, adapter, prompt_ids)?;
        respond(
            state.clone(),
            Kind::Chat,
            job,
            from.and_then(|Extension(a)| a.0),
        )
        .await
    }
    .await;
    finish(&state, result)
}

async fn completions(
    State(state): State<Arc<ApiState>>,
    from: Option<Extension<ClientAddress>>,
    body: Body,
) -> Response {
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
        respond(
            state.clone(),
            Kind::Completion,
            job,
            from.and_then(|Extension(a)| a.0),
        )
        .await
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
