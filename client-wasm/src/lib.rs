//! Corolla in the browser: a wasm-bindgen API over the same client core as
//! the CLI. A Web Worker running this same module downloads the client part
//! of the model (tokenizer, final norm, LM head, embeddings or the rows it
//! needs) and does tokenization, embedding, sampling and detokenization
//! ([`worker`]); the page's thread joins the swarm over WebRTC-direct or
//! WebSocket (browsers offer WebRTC only to pages) and runs the generate
//! loop, moving hidden states between the servers and the worker
//! ([`head_worker`]), so it never blocks on the head's arithmetic.
//!
//! JavaScript sees one class, `CorollaClient` (see `web/README.md`).
//! The crate is empty on other targets.
#![cfg(target_arch = "wasm32")]

mod download;
mod head_worker;
mod heap;
mod part;
mod protocol;
mod swarm;
mod worker;

use std::cell::{Cell, RefCell};
use std::ops::ControlFlow;
use std::rc::Rc;
use std::time::Duration;

use corolla_client::{
    AnswerEvent, Blocks, ChatMessage, ClientError, Conversation, GenerateRequest, SessionSettings,
};
use corolla_model::{DType, Device, LlamaConfig, SamplingParams};
use corolla_shared::adapter_name::check_adapter_name;
use corolla_shared::flow::BROWSER_WINDOW;
use corolla_shared::session::StepTimeout;
use corolla_shared::ErrorKind;
use js_sys::{Function, Promise};
use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

use head_worker::{HeadWorker, Pieces};

#[global_allocator]
static ALLOCATOR: heap::CountingAllocator = heap::CountingAllocator;
use protocol::Sampling;

/// Limits on what a page may ask for: the servers bound sessions too, but
/// a typo should fail here with a clear message.
const MAX_NEW_TOKENS: usize = 4096;

struct Inner {
    model: String,
    info: InfoJs,
    config: LlamaConfig,
    head: HeadWorker,
    /// The swarm, once joined.
    blocks: RefCell<Option<Rc<Blocks>>>,
    /// The page's conversation: its server sessions stay open between
    /// turns, and an edited or regenerated message rewinds them.
    conversation: RefCell<Conversation>,
    stop: Cell<bool>,
    busy: Cell<bool>,
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
    /// The longest draft of a multi-token step (prompt lookup); 0: off.
    #[serde(default = "default_drafts")]
    drafts: usize,
    /// The LoRA adapter the answer runs with (servers announce theirs);
    /// none: the base weights.
    #[serde(default)]
    adapter: Option<String>,
}

fn default_drafts() -> usize {
    corolla_client::DEFAULT_DRAFTS
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
    embeddings: String,
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
    /// Chain steps after the prefill, draft tokens checked and accepted.
    steps: usize,
    drafted: usize,
    accepted: usize,
    route: &'a [corolla_client::Hop],
    recoveries: &'a [corolla_client::Recovery],
    /// Servers spot checks caught returning wrong activations.
    suspects: &'a [String],
}

/// A JavaScript `Error` with `kind` (an [`ErrorKind`] word) and
/// `retryable`, which the widget reads instead of the message.
fn error_of(kind: ErrorKind, message: impl std::fmt::Display) -> JsValue {
    let error = js_sys::Error::new(&message.to_string());
    let _ = js_sys::Reflect::set(&error, &"kind".into(), &kind.as_str().into());
    let _ = js_sys::Reflect::set(&error, &"retryable".into(), &kind.retryable().into());
    error.into()
}

/// A mistake in what the page asked (arguments, settings, call order).
fn bad_request(message: impl std::fmt::Display) -> JsValue {
    error_of(ErrorKind::BadRequest, message)
}

/// A fault of the client itself (worker, serialisation).
fn internal(message: impl std::fmt::Display) -> JsValue {
    error_of(ErrorKind::Internal, message)
}

/// The swarm's or the request's failure, with the blocks nobody served
/// (`uncovered: [[a, b], …]`) when that is the cause.
fn client_error(e: ClientError) -> JsValue {
    let error = error_of(e.kind(), &e);
    if let Some(uncovered) = e.uncovered() {
        let ranges: js_sys::Array = uncovered
            .iter()
            .map(|&(a, b)| js_sys::Array::of2(&(a as f64).into(), &(b as f64).into()))
            .collect();
        let _ = js_sys::Reflect::set(&error, &"uncovered".into(), &ranges);
    }
    error
}

/// The size of this instance's wasm memory (the page's or the worker's).
fn wasm_memory_bytes() -> f64 {
    wasm_bindgen::memory()
        .dyn_into::<js_sys::WebAssembly::Memory>()
        .map(|m| js_sys::ArrayBuffer::from(m.buffer()).byte_length() as f64)
        .unwrap_or(0.0)
}

fn to_js<T: Serialize>(value: &T) -> Result<JsValue, JsValue> {
    value
        .serialize(&serde_wasm_bindgen::Serializer::json_compatible())
        .map_err(internal)
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
    /// Starts the head worker, which downloads (or takes from the browser
    /// cache) the client part that the Corolla server at `server_url`
    /// serves and builds tokenizer, chat template and head.
    /// `on_progress({file, loaded, total, cached})`.
    pub async fn load(server_url: String, on_progress: Function) -> Result<CorollaClient, JsValue> {
        let head = HeadWorker::spawn().await.map_err(internal)?;
        let loaded = head
            .load(server_url.trim_end_matches('/'), on_progress)
            .await
            .map_err(|e| error_of(ErrorKind::Unreachable, e))?;
        let cfg = &loaded.config;
        let info = InfoJs {
            model: loaded.model.clone(),
            num_layers: cfg.num_hidden_layers,
            hidden_size: cfg.hidden_size,
            vocab_size: cfg.vocab_size,
            max_positions: cfg.max_position_embeddings,
            embeddings: loaded.embeddings,
        };
        Ok(CorollaClient {
            inner: Rc::new(Inner {
                model: loaded.model,
                info,
                config: loaded.config,
                head,
                blocks: RefCell::new(None),
                conversation: RefCell::new(Conversation::new()),
                stop: Cell::new(false),
                busy: Cell::new(false),
            }),
        })
    }

    /// Resolves with what the page has fetched, `{downloaded_bytes,
    /// cached_bytes, rows_downloaded, rows_cached}`, and the wasm memory of
    /// the worker and of the page (`worker_memory_bytes`,
    /// `page_memory_bytes`, and their sum `wasm_memory_bytes`), and what
    /// their Rust heaps hold now and held at most (`heap_bytes` and
    /// `heap_peak_bytes` for the worker, `page_heap_bytes` and
    /// `page_heap_peak_bytes`).
    pub fn traffic(&self) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let traffic = inner.head.traffic().await.map_err(internal)?;
            let worker = js_sys::Reflect::get(&traffic, &"wasm_memory_bytes".into())?
                .as_f64()
                .unwrap_or(0.0);
            let page = wasm_memory_bytes();
            let set =
                |key: &str, value: f64| js_sys::Reflect::set(&traffic, &key.into(), &value.into());
            set("worker_memory_bytes", worker)?;
            set("page_memory_bytes", page)?;
            set("wasm_memory_bytes", worker + page)?;
            let (heap, heap_peak) = heap::heap_bytes();
            set("page_heap_bytes", heap as f64)?;
            set("page_heap_peak_bytes", heap_peak as f64)?;
            Ok(traffic)
        })
    }

    /// `{model, num_layers, hidden_size, vocab_size, max_positions, embeddings}`.
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
                return Err(bad_request("cannot join another swarm while answering"));
            }
            let node = swarm::connect(&bootstrap)
                .await
                .map_err(|e| error_of(e.kind, e.message))?;
            let blocks = Blocks::swarm(
                node,
                browser_sessions(&inner.model),
                &inner.config,
                DType::F32,
                &Device::Cpu,
            )
            .map_err(client_error)?;
            if inner.busy.get() {
                return Err(bad_request("cannot join another swarm while answering"));
            }
            inner.blocks.replace(Some(Rc::new(blocks)));
            // Sessions on the old swarm are of no use any more.
            let old = inner.conversation.replace(Conversation::new());
            old.close().await;
            Ok(JsValue::UNDEFINED)
        })
    }

    /// Answers the conversation `messages` (`[{role, content}]`) with the
    /// model's chat template. `on_token(piece, token_id, text)` sees the
    /// text as it streams: each token's piece, and the answer's whole text
    /// as shown now. When tokens already shown are withdrawn (a server was
    /// caught lying about positions already answered, and they came out
    /// different when computed again) it is called with an empty piece, no
    /// token id and the shorter text. Resolves with the answer, its route
    /// and speed. Follow-ups
    /// (the same messages and more) send only what is new to the servers.
    pub fn chat(&self, messages: JsValue, settings: JsValue, on_token: Function) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let blocks = joined(&inner)?;
            let messages: Vec<ChatMessage> = serde_wasm_bindgen::from_value(messages)
                .map_err(|e| bad_request(format!("messages must be [{{role, content}}]: {e}")))?;
            let prompt_ids = inner
                .head
                .chat_prompt(messages)
                .await
                .map_err(bad_request)?;
            answer(&inner, &blocks, prompt_ids, settings, on_token).await
        })
    }

    /// Continues plain `prompt` text (no chat template), like `corolla generate`.
    pub fn complete(&self, prompt: String, settings: JsValue, on_token: Function) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move {
            let blocks = joined(&inner)?;
            let prompt_ids = inner.head.encode(prompt).await.map_err(bad_request)?;
            answer(&inner, &blocks, prompt_ids, settings, on_token).await
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
                return Err(bad_request("an answer is being generated"));
            }
            let old = inner.conversation.replace(Conversation::new());
            old.close().await;
            Ok(JsValue::UNDEFINED)
        })
    }
}

fn joined(inner: &Inner) -> Result<Rc<Blocks>, JsValue> {
    inner
        .blocks
        .borrow()
        .clone()
        .ok_or_else(|| bad_request("not connected: call connect() first"))
}

/// Clears the busy flag however the answer ends.
struct BusyGuard<'a>(&'a Cell<bool>);

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

/// A seed JavaScript can hold exactly (below 2^53), as the answer reports it.
/// The answer's text as the page has been shown it, token by token.
#[derive(Default)]
struct ShownText {
    text: String,
    /// Where each token's piece ends in `text`.
    ends: Vec<usize>,
}

impl ShownText {
    fn tokens(&self) -> usize {
        self.ends.len()
    }

    fn push(&mut self, piece: &str) {
        self.text.push_str(piece);
        self.ends.push(self.text.len());
    }

    /// Keeps the first `kept` tokens' text.
    fn truncate(&mut self, kept: usize) {
        self.ends.truncate(kept);
        self.text.truncate(self.ends.last().copied().unwrap_or(0));
    }

    fn text(&self) -> &str {
        &self.text
    }
}

fn fresh_seed() -> u64 {
    (js_sys::Math::random() * 9007199254740992.0) as u64
}

async fn answer(
    inner: &Inner,
    blocks: &Blocks,
    prompt_ids: Vec<u32>,
    settings: JsValue,
    on_token: Function,
) -> Result<JsValue, JsValue> {
    let settings: Settings = if settings.is_undefined() || settings.is_null() {
        serde_wasm_bindgen::from_value(js_sys::Object::new().into())
    } else {
        serde_wasm_bindgen::from_value(settings)
    }
    .map_err(|e| bad_request(format!("bad settings: {e}")))?;
    if settings.max_new_tokens == 0 || settings.max_new_tokens > MAX_NEW_TOKENS {
        return Err(bad_request(format!(
            "max_new_tokens must be 1..={MAX_NEW_TOKENS}, not {}",
            settings.max_new_tokens
        )));
    }
    if let Some(adapter) = &settings.adapter {
        check_adapter_name(adapter).map_err(bad_request)?;
    }
    if inner.busy.replace(true) {
        return Err(bad_request("an answer is already being generated"));
    }
    let _busy = BusyGuard(&inner.busy);
    inner.stop.set(false);
    let sampling = Sampling {
        temperature: settings.temperature,
        top_k: settings.top_k,
        top_p: settings.top_p,
        seed: settings.seed.unwrap_or_else(fresh_seed),
    };
    let request = GenerateRequest {
        prompt_ids,
        max_new_tokens: settings.max_new_tokens,
        sampling: SamplingParams::from(&sampling),
        stop_at_eos: settings.stop_at_eos,
        drafts: settings.drafts,
    };
    let seed = sampling.seed;
    // The text of each token the worker sampled, by position.
    let pieces = RefCell::new(Pieces::new());
    let prompt_len = request.prompt_ids.len();
    let mut head = inner
        .head
        .begin(&inner.config, sampling, &pieces)
        .await
        .map_err(internal)?;
    let mut shown = ShownText::default();
    let on_event = |event| {
        let (piece, token) = match event {
            AnswerEvent::Token(token) => {
                let position = prompt_len + shown.tokens();
                let piece = pieces.borrow_mut().remove(&position).unwrap_or_default();
                shown.push(&piece);
                (piece, JsValue::from(token))
            }
            AnswerEvent::Withdraw { kept } => {
                shown.truncate(kept);
                (String::new(), JsValue::UNDEFINED)
            }
        };
        let text = JsValue::from(shown.text());
        if let Err(e) = on_token.call3(&JsValue::NULL, &piece.into(), &token, &text) {
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
    conversation.set_adapter(settings.adapter);
    let answer = blocks
        .answer(&mut head, &mut conversation, &request, on_event)
        .await;
    inner.conversation.replace(conversation);
    let answer = answer.map_err(client_error)?;
    let output = &answer.output;
    let text = inner
        .head
        .decode(output.generated_ids.clone())
        .await
        .map_err(internal)?;
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
        steps: output.steps,
        drafted: output.drafted,
        accepted: output.accepted,
        route: answer.route.as_deref().unwrap_or_default(),
        recoveries: &answer.recoveries,
        suspects: &answer.suspects,
    })
}
