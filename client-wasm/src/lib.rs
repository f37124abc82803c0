//! Corolla in the browser: a wasm-bindgen API over the same client core as
//! the CLI. The page downloads the client part of the model (embeddings,
//! final norm, LM head, tokenizer), joins the swarm over WebRTC-direct or
//! WebSocket, and generates: tokenization, embedding, sampling and
//! detokenization run here; the decoder blocks run on the servers.
//!
//! JavaScript sees one class, `CorollaClient` (see `web/README.md`).
//! The crate is empty on other targets.
#![cfg(target_arch = "wasm32")]

mod download;
mod swarm;

use std::cell::{Cell, RefCell};
use std::ops::ControlFlow;
use std::rc::Rc;
use std::time::Duration;

use corolla_client::assistant::ClientPart;
use corolla_client::{
    Assistant, ChatMessage, Conversation, GenerateRequest, SessionSettings, TextStream,
};
use corolla_model::embeddings::RowFormat;
use corolla_model::quantized_buffer::{parse_ggml_dtype, QuantizedBuffer};
use corolla_model::{Checkpoint, DType, QuantizedWeights, SamplingParams};
use corolla_shared::flow::BROWSER_WINDOW;
use corolla_shared::manifest::{ClientManifest, MAX_PART_BYTES};
use corolla_shared::session::StepTimeout;
use js_sys::{Function, Promise};
use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

/// Limits on what a page may ask for: the servers bound sessions too, but
/// a typo should fail here with a clear message.
const MAX_NEW_TOKENS: usize = 4096;

/// The model before the page joins a swarm, and the assistant after.
enum Model {
    Loaded(Box<ClientPart>),
    Joined(Rc<Assistant>),
    /// Only while switching from one to the other.
    Switching,
}

struct Inner {
    model: String,
    info: InfoJs,
    state: RefCell<Model>,
    /// The page's conversation: its server sessions stay open between
    /// turns, and an edited or regenerated message rewinds them.
    conversation: RefCell<Conversation>,
    stop: Cell<bool>,
    busy: Cell<bool>,
    traffic: download::TrafficCounter,
}

#[wasm_bindgen]
pub struct CorollaClient {
    inner: Rc<Inner>,
}

/// Sampling and length settings from JavaScript.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    #[serde(default)]
    temperature: f64,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<usize>,
    #[serde(default = "default_max_new_tokens")]
    max_new_tokens: usize,
    /// None: a fresh seed for every answer.
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default = "default_true")]
    stop_at_eos: bool,
}

fn default_max_new_tokens() -> usize {
    128
}

fn default_true() -> bool {
    true
}

#[derive(Serialize, Clone)]
struct InfoJs {
    model: String,
    num_layers: usize,
    hidden_size: usize,
    vocab_size: usize,
    max_positions: usize,
    /// How the page holds the embeddings: "dense", or "fetched" by rows.
    embeddings: &'static str,
}

#[derive(Serialize)]
struct AnswerJs<'a> {
    text: String,
    prompt_ids: &'a [u32],
    generated_ids: &'a [u32],
    /// Prompt tokens the open sessions already held (not sent again).
    reused_tokens: usize,
    seed: u64,
    stop_reason: corolla_client::StopReason,
    tokens_per_second: f64,
    prefill_seconds: f64,
    total_seconds: f64,
    route: &'a [corolla_client::Hop],
    recoveries: &'a [corolla_client::Recovery],
    /// Servers spot checks caught returning wrong activations.
    suspects: &'a [String],
}

fn error(message: impl std::fmt::Display) -> JsValue {
    js_sys::Error::new(&message.to_string()).into()
}

fn to_js<T: Serialize>(value: &T) -> Result<JsValue, JsValue> {
    value
        .serialize(&serde_wasm_bindgen::Serializer::json_compatible())
        .map_err(error)
}

#[wasm_bindgen(start)]
fn start() {
    console_error_panic_hook::set_once();
}

/// The settings of every session the page opens.
fn browser_sessions(model: &str) -> SessionSettings {
    SessionSettings {
        model: model.to_string(),
        flow_window: BROWSER_WINDOW,
        timeout: Duration::from_secs(60),
        // A WebRTC peer that vanished is noticed by the browser only after ~30 s
        // of ICE consent failures; a one-token step that takes 8 s is a lost server.
        step_timeout: Some(StepTimeout {
            base: Duration::from_secs(8),
            per_position: Duration::from_millis(20),
        }),
        // The page holds no blocks: a mismatch is decided by a third server.
        spot_check: 0.05,
        ..SessionSettings::default()
    }
}

#[wasm_bindgen]
impl CorollaClient {
    /// Downloads (or takes from the browser cache) the client part that the
    /// Corolla server at `server_url` serves, and builds tokenizer, chat
    /// template and head. `on_progress({file, loaded, total, cached})`.
    pub async fn load(server_url: String, on_progress: Function) -> Result<CorollaClient, JsValue> {
        let base = server_url.trim_end_matches('/');
        let manifest = download::manifest(base).await.map_err(error)?;
        let cache = download::open_cache().await;
        let traffic = download::TrafficCounter::default();
        let lm_head_file = manifest.lm_head.as_ref().map(|h| h.file.as_str());
        let digests_file = manifest.embedding_rows.as_ref().map(|r| r.digests.as_str());
        let mut files = Vec::with_capacity(manifest.files.len());
        let mut lm_head = None;
        let mut digests = None;
        for file in &manifest.files {
            if Some(file.name.as_str()) == lm_head_file {
                // Streamed straight into the quantized tensor's storage.
                let mut buffer = lm_head_buffer(&manifest).map_err(error)?;
                let mut dest = download::Dest::Fixed {
                    bytes: buffer.bytes_mut(),
                    filled: 0,
                };
                download::file_into(
                    base,
                    file,
                    cache.as_ref(),
                    &on_progress,
                    &traffic,
                    &mut dest,
                )
                .await
                .map_err(error)?;
                lm_head = Some(buffer.into_qtensor().map_err(error)?);
                continue;
            }
            let bytes = download::file(base, file, cache.as_ref(), &on_progress, &traffic)
                .await
                .map_err(error)?;
            if Some(file.name.as_str()) == digests_file {
                digests = Some(bytes);
            } else {
                files.push((file.name.clone(), bytes));
            }
        }
        let checkpoint = Checkpoint::from_memory(files)
            .map_err(error)?
            // As the CLI does, so that both compute the same logits.
            .with_quantized_weights(QuantizedWeights::Auto);
        let part = match (&manifest.embedding_rows, lm_head, digests) {
            (Some(rows), Some(lm_head), Some(digests)) => {
                let format = RowFormat {
                    dtype: parse_ggml_dtype(&rows.dtype).map_err(error)?,
                    rows: rows.rows as usize,
                    hidden: rows.hidden as usize,
                };
                if format.row_bytes() != Some(rows.row_bytes as usize) {
                    return Err(error(format!(
                        "embedding rows of {} bytes are not {} {} values",
                        rows.row_bytes, rows.hidden, rows.dtype
                    )));
                }
                let source =
                    download::RowSource::new(base, rows, digests, cache.clone(), traffic.clone())
                        .map_err(error)?;
                ClientPart::load_split(&checkpoint, DType::F32, lm_head, format, Box::new(source))
            }
            (None, None, None) => ClientPart::load(&checkpoint, DType::F32),
            _ => {
                return Err(error(
                    "the manifest lists an LM head or embedding rows without the other",
                ))
            }
        }
        .map_err(error)?;
        drop(checkpoint);
        let cfg = part.head.config();
        let info = InfoJs {
            model: manifest.model.clone(),
            num_layers: cfg.num_hidden_layers,
            hidden_size: cfg.hidden_size,
            vocab_size: cfg.vocab_size,
            max_positions: cfg.max_position_embeddings,
            embeddings: part.head.embeddings_kind(),
        };
        Ok(CorollaClient {
            inner: Rc::new(Inner {
                model: manifest.model,
                info,
                state: RefCell::new(Model::Loaded(Box::new(part))),
                conversation: RefCell::new(Conversation::new()),
                stop: Cell::new(false),
                busy: Cell::new(false),
                traffic,
            }),
        })
    }

    /// What the page has fetched: `{downloaded_bytes, cached_bytes,
    /// rows_downloaded, rows_cached}`, and the wasm memory's size.
    pub fn traffic(&self) -> Result<JsValue, JsValue> {
        #[derive(Serialize)]
        struct TrafficJs {
            #[serde(flatten)]
            traffic: download::Traffic,
            wasm_memory_bytes: f64,
        }
        let traffic = self.inner.traffic.take();
        self.inner.traffic.set(traffic.clone());
        let memory = wasm_bindgen::memory()
            .dyn_into::<js_sys::WebAssembly::Memory>()
            .map(|m| js_sys::ArrayBuffer::from(m.buffer()).byte_length() as f64)
            .unwrap_or(0.0);
        to_js(&TrafficJs {
            traffic,
            wasm_memory_bytes: memory,
        })
    }

    /// `{model, num_layers, hidden_size, vocab_size, max_positions}`.
    pub fn info(&self) -> Result<JsValue, JsValue> {
        to_js(&self.inner.info)
    }

    /// Joins the swarm through `bootstrap` (multiaddrs ending in
    /// `/p2p/<peer id>`); the transports of those addresses are the ones
    /// used for every server. Resolves once one bootstrap peer is connected.
    pub fn connect(&self, bootstrap: Vec<String>) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            if inner.busy.get() {
                return Err(error("cannot join another swarm while answering"));
            }
            let node = swarm::connect(&bootstrap).await.map_err(error)?;
            let part = match inner.state.replace(Model::Switching) {
                Model::Loaded(part) => *part,
                Model::Joined(assistant) => match Rc::try_unwrap(assistant) {
                    Ok(assistant) => assistant.into_part(),
                    Err(shared) => {
                        inner.state.replace(Model::Joined(shared));
                        return Err(error("cannot join another swarm while answering"));
                    }
                },
                Model::Switching => return Err(error("already joining a swarm")),
            };
            let assistant =
                Assistant::on_swarm(part, node, browser_sessions(&inner.model)).map_err(error)?;
            inner.state.replace(Model::Joined(Rc::new(assistant)));
            // Sessions on the old swarm are of no use any more.
            inner.conversation.replace(Conversation::new());
            Ok(JsValue::UNDEFINED)
        })
    }

    /// Answers the conversation `messages` (`[{role, content}]`) with the
    /// model's chat template. `on_token(piece, token_id)` sees the text as it
    /// streams. Resolves with the answer, its route and speed. Follow-ups
    /// (the same messages and more) send only what is new to the servers.
    pub fn chat(&self, messages: JsValue, settings: JsValue, on_token: Function) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let assistant = joined(&inner)?;
            let messages: Vec<ChatMessage> = serde_wasm_bindgen::from_value(messages)
                .map_err(|e| error(format!("messages must be [{{role, content}}]: {e}")))?;
            let prompt_ids = assistant.chat_prompt(&messages).map_err(error)?;
            answer(&inner, &assistant, prompt_ids, settings, on_token).await
        })
    }

    /// Continues plain `prompt` text (no chat template), like `corolla generate`.
    pub fn complete(&self, prompt: String, settings: JsValue, on_token: Function) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let assistant = joined(&inner)?;
            let prompt_ids = assistant.tokenizer().encode(&prompt).map_err(error)?;
            answer(&inner, &assistant, prompt_ids, settings, on_token).await
        })
    }

    /// Ends the running answer after the token being computed; it resolves
    /// with `stop_reason: "cancelled"`.
    pub fn stop(&self) {
        self.inner.stop.set(true);
    }

    /// Keeps the conversation's server sessions open while it is idle on
    /// screen (servers expire idle sessions); call it every minute or so.
    /// Does nothing while an answer runs.
    #[wasm_bindgen(js_name = keepAlive)]
    pub fn keep_alive(&self) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            if inner.busy.replace(true) {
                return Ok(JsValue::UNDEFINED);
            }
            let _busy = BusyGuard(&inner.busy);
            let mut conversation = inner.conversation.take();
            conversation.keep_alive().await;
            inner.conversation.replace(conversation);
            Ok(JsValue::UNDEFINED)
        })
    }

    /// Closes the conversation's server sessions (a new conversation on
    /// screen): the next answer opens new ones.
    pub fn reset(&self) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            if inner.busy.get() {
                return Err(error("an answer is being generated"));
            }
            let old = inner.conversation.replace(Conversation::new());
            old.close().await;
            Ok(JsValue::UNDEFINED)
        })
    }
}

fn joined(inner: &Inner) -> Result<Rc<Assistant>, JsValue> {
    match &*inner.state.borrow() {
        Model::Joined(assistant) => Ok(assistant.clone()),
        _ => Err(error("not connected: call connect() first")),
    }
}

/// The LM head's storage, sized by the manifest (bounded by its parser).
fn lm_head_buffer(manifest: &ClientManifest) -> Result<QuantizedBuffer, String> {
    let head = manifest
        .lm_head
        .as_ref()
        .ok_or("no LM head in the manifest")?;
    let dtype = parse_ggml_dtype(&head.dtype).map_err(|e| e.to_string())?;
    let shape: Vec<usize> = head.shape.iter().map(|&d| d as usize).collect();
    QuantizedBuffer::new(dtype, &shape, MAX_PART_BYTES).map_err(|e| e.to_string())
}

/// Clears the busy flag however the answer ends.
struct BusyGuard<'a>(&'a Cell<bool>);

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

/// A seed JavaScript can hold exactly (below 2^53), as the answer reports it.
fn fresh_seed() -> u64 {
    (js_sys::Math::random() * 9007199254740992.0) as u64
}

async fn answer(
    inner: &Inner,
    assistant: &Assistant,
    prompt_ids: Vec<u32>,
    settings: JsValue,
    on_token: Function,
) -> Result<JsValue, JsValue> {
    let settings: Settings = if settings.is_undefined() || settings.is_null() {
        serde_wasm_bindgen::from_value(js_sys::Object::new().into())
    } else {
        serde_wasm_bindgen::from_value(settings)
    }
    .map_err(|e| error(format!("bad settings: {e}")))?;
    if settings.max_new_tokens == 0 || settings.max_new_tokens > MAX_NEW_TOKENS {
        return Err(error(format!(
            "max_new_tokens must be 1..={MAX_NEW_TOKENS}, not {}",
            settings.max_new_tokens
        )));
    }
    if inner.busy.replace(true) {
        return Err(error("an answer is already being generated"));
    }
    let _busy = BusyGuard(&inner.busy);
    inner.stop.set(false);
    let seed = settings.seed.unwrap_or_else(fresh_seed);
    let request = GenerateRequest {
        prompt_ids,
        max_new_tokens: settings.max_new_tokens,
        sampling: SamplingParams {
            temperature: settings.temperature,
            top_k: settings.top_k,
            top_p: settings.top_p,
            repetition_penalty: 1.0,
            seed,
        },
        stop_at_eos: settings.stop_at_eos,
    };
    let tokenizer = assistant.tokenizer();
    let mut stream = TextStream::default();
    let mut callback_error = None;
    let on_token = |token: u32| {
        let piece = match stream.push(tokenizer, token) {
            Ok(piece) => piece.unwrap_or_default(),
            Err(e) => {
                callback_error = Some(e.to_string());
                return ControlFlow::Break(());
            }
        };
        if let Err(e) = on_token.call2(&JsValue::NULL, &piece.into(), &token.into()) {
            tracing::warn!(error = ?e, "the token callback threw");
        }
        if inner.stop.get() {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    // Out of the cell while answering: nothing else can touch it (busy).
    let mut conversation = inner.conversation.take();
    let answer = assistant
        .answer(&mut conversation, &request, on_token)
        .await;
    inner.conversation.replace(conversation);
    let answer = answer.map_err(error)?;
    if let Some(e) = callback_error {
        return Err(error(e));
    }
    let output = &answer.output;
    let text = tokenizer.decode(&output.generated_ids).map_err(error)?;
    to_js(&AnswerJs {
        text,
        prompt_ids: &output.prompt_ids,
        generated_ids: &output.generated_ids,
        reused_tokens: answer.reused_tokens,
        seed,
        stop_reason: output.stop_reason,
        tokens_per_second: output.tokens_per_second(),
        prefill_seconds: output.prefill_time.as_secs_f64(),
        total_seconds: output.total_time.as_secs_f64(),
        route: answer.route.as_deref().unwrap_or_default(),
        recoveries: &answer.recoveries,
        suspects: &answer.suspects,
    })
}
