//! The page's side of the head worker: it starts the worker (a module
//! worker built from a blob that imports this same wasm module, so it works
//! wherever the page could load the module), sends it calls and awaits the
//! replies. [`WorkerHead`] is the [`TokenHead`] the page's generate loop
//! drives: the page thread only moves hidden states between the swarm and
//! the worker, so it never blocks on the head's arithmetic.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use corolla_client::{ChatMessage, ClientError, TokenHead};
use corolla_model::{Device, LlamaConfig, Tensor};
use futures::channel::oneshot;
use js_sys::{Array, Float32Array, Function, Object, Reflect};
use serde::de::DeserializeOwned;
use wasm_bindgen::prelude::*;
use web_sys::{
    Blob, BlobPropertyBag, ErrorEvent, MessageEvent, Url, Worker, WorkerOptions, WorkerType,
};

use crate::protocol::{Call, Loaded, NextToken, Sampling, Verified};

#[wasm_bindgen]
extern "C" {
    /// The URL of this module's JavaScript (`corolla-wasm.js`).
    #[wasm_bindgen(thread_local_v2, js_namespace = ["import", "meta"], js_name = url)]
    static MODULE_URL: String;
}

/// A reply's value and hidden states.
struct Reply {
    value: JsValue,
    data: Option<Float32Array>,
}

type Pending = Rc<RefCell<HashMap<u32, oneshot::Sender<Result<Reply, String>>>>>;

/// The running worker. Dropping it ends the worker.
pub struct HeadWorker {
    worker: Worker,
    pending: Pending,
    next_id: Cell<u32>,
    /// Where progress messages go while loading.
    progress: Rc<RefCell<Option<Function>>>,
    /// Set once the worker failed as a whole: every later call gets it.
    failed: Rc<RefCell<Option<String>>>,
    _on_message: Closure<dyn FnMut(MessageEvent)>,
    _on_error: Closure<dyn FnMut(ErrorEvent)>,
}

impl Drop for HeadWorker {
    fn drop(&mut self) {
        self.worker.terminate();
    }
}

fn js_message(e: &JsValue) -> String {
    e.dyn_ref::<js_sys::Error>()
        .map(|e| String::from(e.message()))
        .or_else(|| e.as_string())
        .unwrap_or_else(|| format!("{e:?}"))
}

/// The worker's script: it imports this module's JavaScript from where the
/// page got it, and instantiates the compiled WebAssembly module the page
/// posts as its first message. One compilation serves both instances: the
/// renderer holds the code once, and caches it once.
fn worker_script() -> Result<String, String> {
    let url = MODULE_URL.with(String::clone);
    let url = serde_json::to_string(&url).map_err(|e| e.to_string())?;
    Ok(format!(
        "import init, {{ corolla_serve_head }} from {url};\n\
         self.onmessage = async (event) => {{\n\
           self.onmessage = null;\n\
           await init({{ module_or_path: event.data }});\n\
           corolla_serve_head();\n\
         }};\n"
    ))
}

/// The reply id the worker's `{ready}` message stands for.
const READY: u32 = 0;

impl HeadWorker {
    /// Starts the worker and waits until its wasm runs.
    pub async fn spawn() -> Result<HeadWorker, String> {
        let parts = Array::of1(&worker_script()?.into());
        let options = BlobPropertyBag::new();
        options.set_type("text/javascript");
        let blob = Blob::new_with_str_sequence_and_options(&parts, &options)
            .map_err(|e| format!("cannot make the worker's script: {}", js_message(&e)))?;
        let script = Url::create_object_url_with_blob(&blob)
            .map_err(|e| format!("cannot make the worker's script: {}", js_message(&e)))?;
        let options = WorkerOptions::new();
        options.set_type(WorkerType::Module);
        options.set_name("corolla-head");
        let worker = Worker::new_with_options(&script, &options);
        let _ = Url::revoke_object_url(&script);
        let worker =
            worker.map_err(|e| format!("cannot start the head worker: {}", js_message(&e)))?;

        let pending: Pending = Rc::default();
        let progress: Rc<RefCell<Option<Function>>> = Rc::default();
        let failed: Rc<RefCell<Option<String>>> = Rc::default();
        let on_message = {
            let pending = pending.clone();
            let progress = progress.clone();
            Closure::<dyn FnMut(MessageEvent)>::new(move |event: MessageEvent| {
                dispatch(&pending, &progress, event.data());
            })
        };
        let on_error = {
            let pending = pending.clone();
            let failed = failed.clone();
            Closure::<dyn FnMut(ErrorEvent)>::new(move |event: ErrorEvent| {
                event.prevent_default();
                let message = format!("the head worker failed: {}", event.message());
                tracing::warn!("{message}");
                failed.replace(Some(message.clone()));
                for (_, reply) in pending.borrow_mut().drain() {
                    let _ = reply.send(Err(message.clone()));
                }
            })
        };
        worker.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
        worker.set_onerror(Some(on_error.as_ref().unchecked_ref()));
        worker
            .post_message(&wasm_bindgen::module())
            .map_err(|e| format!("cannot start the head worker: {}", js_message(&e)))?;
        let (ready, started) = oneshot::channel();
        pending.borrow_mut().insert(READY, ready);
        let handle = HeadWorker {
            worker,
            pending,
            next_id: Cell::new(READY + 1),
            progress,
            failed,
            _on_message: on_message,
            _on_error: on_error,
        };
        started
            .await
            .map_err(|_| "the head worker ended before it started".to_string())??;
        Ok(handle)
    }

    async fn call(&self, call: &Call, data: Option<Float32Array>) -> Result<Reply, String> {
        if let Some(failed) = self.failed.borrow().clone() {
            return Err(failed);
        }
        let id = self.next_id.get();
        self.next_id.set(id.wrapping_add(1).max(READY + 1));
        let message = Object::new();
        let set = |key: &str, value: &JsValue| {
            Reflect::set(&message, &key.into(), value).map_err(|e| js_message(&e))
        };
        set("id", &id.into())?;
        set(
            "call",
            &serde_wasm_bindgen::to_value(call).map_err(|e| e.to_string())?,
        )?;
        let (reply, replied) = oneshot::channel();
        self.pending.borrow_mut().insert(id, reply);
        let posted = match &data {
            Some(data) => {
                set("data", data)?;
                self.worker
                    .post_message_with_transfer(&message, &Array::of1(&data.buffer()))
            }
            None => self.worker.post_message(&message),
        };
        if let Err(e) = posted {
            self.pending.borrow_mut().remove(&id);
            return Err(format!("cannot reach the head worker: {}", js_message(&e)));
        }
        replied
            .await
            .map_err(|_| "the head worker ended".to_string())?
    }

    async fn value<T: DeserializeOwned>(&self, call: &Call) -> Result<T, String> {
        let reply = self.call(call, None).await?;
        serde_wasm_bindgen::from_value(reply.value)
            .map_err(|e| format!("a bad reply from the head worker: {e}"))
    }

    /// Loads the client part the server at `server` serves;
    /// `on_progress({file, loaded, total, cached})` sees the downloads.
    pub async fn load(&self, server: &str, on_progress: Function) -> Result<Loaded, String> {
        self.progress.replace(Some(on_progress));
        let loaded = self
            .value(&Call::Load {
                server: server.to_string(),
            })
            .await;
        self.progress.replace(None);
        loaded
    }

    pub async fn chat_prompt(&self, messages: Vec<ChatMessage>) -> Result<Vec<u32>, String> {
        self.value(&Call::ChatPrompt { messages }).await
    }

    pub async fn encode(&self, text: String) -> Result<Vec<u32>, String> {
        self.value(&Call::Encode { text }).await
    }

    pub async fn decode(&self, ids: Vec<u32>) -> Result<String, String> {
        self.value(&Call::Decode { ids }).await
    }

    /// The worker's traffic counters and wasm memory, as a JS object.
    pub async fn traffic(&self) -> Result<JsValue, String> {
        Ok(self.call(&Call::Traffic, None).await?.value)
    }

    /// A [`TokenHead`] for one answer: the worker's sampler starts afresh.
    /// `pieces` gets the text each sampled token completes, by the token's
    /// position, for the loop's event callback (a multi-token step yields
    /// several, and tokens sampled again after a re-check are not shown
    /// again unless they changed).
    pub async fn begin<'a>(
        &'a self,
        config: &'a LlamaConfig,
        sampling: Sampling,
        pieces: &'a RefCell<Pieces>,
    ) -> Result<WorkerHead<'a>, String> {
        self.call(&Call::Begin { sampling }, None).await?;
        Ok(WorkerHead {
            worker: self,
            config,
            pieces,
        })
    }
}

/// Routes a message from the worker to the call it answers.
fn dispatch(pending: &Pending, progress: &RefCell<Option<Function>>, message: JsValue) {
    let get = |key: &str| Reflect::get(&message, &key.into()).unwrap_or(JsValue::UNDEFINED);
    let report = get("progress");
    if !report.is_undefined() {
        if let Some(on_progress) = progress.borrow().as_ref() {
            // A failing progress callback must not fail the download.
            let _ = on_progress.call1(&JsValue::NULL, &report);
        }
        return;
    }
    let id = if get("ready").is_truthy() {
        READY
    } else {
        match get("id").as_f64() {
            Some(id) if id >= 0.0 && id <= f64::from(u32::MAX) => id as u32,
            _ => {
                tracing::warn!("a message from the head worker without an id");
                return;
            }
        }
    };
    let Some(reply) = pending.borrow_mut().remove(&id) else {
        tracing::warn!(id, "a reply from the head worker nobody waits for");
        return;
    };
    let error = get("error");
    let outcome = if let Some(error) = error.as_string() {
        Err(error)
    } else {
        Ok(Reply {
            value: get("value"),
            data: get("data").dyn_into::<Float32Array>().ok(),
        })
    };
    let _ = reply.send(outcome);
}

/// `hidden`'s last `rows` positions, `[1, T, hidden]` -> `rows * hidden`
/// f32 values.
fn last_positions(hidden: &Tensor, rows: usize) -> Result<Vec<f32>, corolla_model::ModelError> {
    let t = hidden.dim(1)?;
    let rows = rows.min(t);
    Ok(hidden
        .narrow(1, t - rows, rows)?
        .flatten_all()?
        .to_dtype(corolla_model::DType::F32)?
        .to_vec1()?)
}

fn head_error(e: impl std::fmt::Display) -> ClientError {
    ClientError::Head(e.to_string())
}

/// The text of each sampled token, by its position in the sequence.
pub type Pieces = BTreeMap<usize, String>;

/// One answer's embedding and sampling, done by the worker.
pub struct WorkerHead<'a> {
    worker: &'a HeadWorker,
    config: &'a LlamaConfig,
    pieces: &'a RefCell<Pieces>,
}

impl TokenHead for WorkerHead<'_> {
    fn config(&self) -> &LlamaConfig {
        self.config
    }

    async fn embed(&mut self, ids: &[u32]) -> Result<Tensor, ClientError> {
        let reply = self
            .worker
            .call(&Call::Embed { ids: ids.to_vec() }, None)
            .await
            .map_err(head_error)?;
        let data = reply
            .data
            .ok_or_else(|| head_error("the worker sent no embeddings"))?;
        let hidden = self.config.hidden_size;
        if data.length() as usize != ids.len() * hidden {
            return Err(head_error(format!(
                "{} embedding values for {} tokens of {hidden}",
                data.length(),
                ids.len()
            )));
        }
        Tensor::from_vec(data.to_vec(), (1, ids.len(), hidden), &Device::Cpu).map_err(head_error)
    }

    async fn next_token(&mut self, hidden: &Tensor, context: &[u32]) -> Result<u32, ClientError> {
        let last = last_positions(hidden, 1).map_err(head_error)?;
        let reply = self
            .worker
            .call(
                &Call::NextToken {
                    context: context.to_vec(),
                },
                Some(Float32Array::from(last.as_slice())),
            )
            .await
            .map_err(head_error)?;
        let next: NextToken = serde_wasm_bindgen::from_value(reply.value)
            .map_err(|e| head_error(format!("a bad reply from the head worker: {e}")))?;
        self.pieces.borrow_mut().insert(context.len(), next.piece);
        Ok(next.token)
    }

    async fn verify_drafts(
        &mut self,
        hidden: &Tensor,
        context: &[u32],
        drafts: &[u32],
    ) -> Result<Vec<u32>, ClientError> {
        let rows = last_positions(hidden, drafts.len() + 1).map_err(head_error)?;
        let reply = self
            .worker
            .call(
                &Call::VerifyDrafts {
                    context: context.to_vec(),
                    drafts: drafts.to_vec(),
                },
                Some(Float32Array::from(rows.as_slice())),
            )
            .await
            .map_err(head_error)?;
        let verified: Verified = serde_wasm_bindgen::from_value(reply.value)
            .map_err(|e| head_error(format!("a bad reply from the head worker: {e}")))?;
        if verified.pieces.len() != verified.tokens.len() {
            return Err(head_error(format!(
                "{} pieces of text for {} tokens",
                verified.pieces.len(),
                verified.tokens.len()
            )));
        }
        let mut pieces = self.pieces.borrow_mut();
        for (i, piece) in verified.pieces.into_iter().enumerate() {
            pieces.insert(context.len() + i, piece);
        }
        Ok(verified.tokens)
    }

    async fn rewind(&mut self, kept: usize) -> Result<(), ClientError> {
        self.worker
            .call(&Call::Rewind { kept }, None)
            .await
            .map_err(head_error)?;
        Ok(())
    }
}
