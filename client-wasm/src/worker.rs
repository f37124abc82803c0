//! Inside the head worker: the model's client part (tokenizer, chat
//! template, embeddings, LM head) and the sampler, off the page's thread.
//! The page sends one call at a time per answer; each is answered by a
//! message with the same id (see [`crate::protocol`]).

use std::cell::RefCell;
use std::rc::Rc;

use corolla_client::assistant::ClientPart;
use corolla_client::draft::verify_drafts;
use corolla_client::{ChatMessage, TextStream};
use corolla_model::{Device, Sampler, Tensor};
use futures::future::LocalBoxFuture;
use js_sys::{Array, Float32Array, Function, Object, Reflect};
use serde::Serialize;
use wasm_bindgen::prelude::*;
use web_sys::{DedicatedWorkerGlobalScope, MessageEvent};

use crate::download::{Traffic, TrafficCounter};
use crate::heap::heap_bytes;
use crate::protocol::{Call, Loaded, NextToken, Sampling, Verified};
use crate::{part, to_js, wasm_memory_bytes};

/// One answer's sampler and the text its tokens have made so far.
struct Answering {
    sampler: Sampler,
    text: TextStream,
}

#[derive(Default)]
struct Host {
    part: RefCell<Option<Rc<ClientPart>>>,
    answering: RefCell<Option<Answering>>,
    traffic: TrafficCounter,
}

/// What a call answers: a value, and hidden states as `data`.
struct Reply {
    value: JsValue,
    data: Option<Float32Array>,
}

impl Reply {
    fn value<T: Serialize>(value: &T) -> Result<Reply, String> {
        Ok(Reply {
            value: to_js(value).map_err(|e| format!("{e:?}"))?,
            data: None,
        })
    }
}

/// Runs in the worker's script once the wasm is instantiated: answers the
/// page's calls from now on, and tells the page so.
#[wasm_bindgen]
pub fn corolla_serve_head() -> Result<(), JsValue> {
    let scope: DedicatedWorkerGlobalScope = js_sys::global()
        .dyn_into()
        .map_err(|_| JsValue::from_str("corolla_serve_head runs in a dedicated worker"))?;
    let host = Rc::new(Host::default());
    let on_message = Closure::<dyn FnMut(MessageEvent)>::new(move |event: MessageEvent| {
        let host = host.clone();
        wasm_bindgen_futures::spawn_local(async move { host.serve(event.data()).await });
    });
    scope.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
    // The handler lives as long as the worker.
    on_message.forget();
    let ready = Object::new();
    Reflect::set(&ready, &"ready".into(), &true.into())?;
    scope.post_message(&ready)
}

fn post(message: &JsValue, transfer: Option<&JsValue>) {
    let scope: DedicatedWorkerGlobalScope = js_sys::global().unchecked_into();
    let result = match transfer {
        Some(buffer) => scope.post_message_with_transfer(message, &Array::of1(buffer)),
        None => scope.post_message(message),
    };
    if let Err(e) = result {
        tracing::warn!(error = ?e, "cannot answer the page");
    }
}

impl Host {
    async fn serve(&self, message: JsValue) {
        let id = Reflect::get(&message, &"id".into()).unwrap_or(JsValue::NULL);
        let reply = Object::new();
        let _ = Reflect::set(&reply, &"id".into(), &id);
        let data = Reflect::get(&message, &"data".into())
            .ok()
            .and_then(|d| d.dyn_into::<Float32Array>().ok());
        let outcome = match Reflect::get(&message, &"call".into()) {
            Ok(call) => match serde_wasm_bindgen::from_value::<Call>(call) {
                Ok(call) => self.answer(call, data).await,
                Err(e) => Err(format!("not a head-worker call: {e}")),
            },
            Err(_) => Err("a message without a call".into()),
        };
        match outcome {
            Ok(Reply { value, data }) => {
                let _ = Reflect::set(&reply, &"value".into(), &value);
                if let Some(data) = data {
                    let _ = Reflect::set(&reply, &"data".into(), &data);
                    post(&reply, Some(&data.buffer()));
                } else {
                    post(&reply, None);
                }
            }
            Err(e) => {
                let _ = Reflect::set(&reply, &"error".into(), &e.into());
                post(&reply, None);
            }
        }
    }

    fn part(&self) -> Result<Rc<ClientPart>, String> {
        self.part
            .borrow()
            .clone()
            .ok_or_else(|| "the model is not loaded yet".to_string())
    }

    /// Dispatches one call. Only loading and embedding wait; each runs as
    /// a boxed future, and every other call is a function of its own, so
    /// that this per-token path stays small: V8 recompiles a hot
    /// WebAssembly function whole, and this one, with every call inlined,
    /// was 52-58 KB and took 26-30 MB of the renderer to recompile.
    async fn answer(&self, call: Call, data: Option<Float32Array>) -> Result<Reply, String> {
        match call {
            Call::Load { server } => {
                let loading: LocalBoxFuture<'_, _> = Box::pin(self.load(server));
                loading.await
            }
            Call::Embed { ids } => {
                let embedding: LocalBoxFuture<'_, _> = Box::pin(self.embed(ids));
                embedding.await
            }
            Call::ChatPrompt { messages } => self.chat_prompt(&messages),
            Call::Encode { text } => self.encode(&text),
            Call::Begin { sampling } => self.begin(&sampling),
            Call::NextToken { context } => self.next_token(&context, data),
            Call::VerifyDrafts { context, drafts } => self.verify_drafts(&context, &drafts, data),
            Call::Rewind { kept } => self.rewind(kept),
            Call::Decode { ids } => self.decode(&ids),
            Call::Traffic => self.traffic(),
        }
    }

    async fn load(&self, server: String) -> Result<Reply, String> {
        let on_progress = Closure::<dyn Fn(JsValue)>::new(|progress: JsValue| {
            let message = Object::new();
            let _ = Reflect::set(&message, &"progress".into(), &progress);
            post(&message, None);
        });
        let function: &Function = on_progress.as_ref().unchecked_ref();
        let part = part::load(server.trim_end_matches('/'), function, &self.traffic).await?;
        let loaded = Loaded {
            model: part.model.clone(),
            config: part.head.config().clone(),
            embeddings: part.head.embeddings_kind().to_string(),
        };
        self.part.replace(Some(Rc::new(part)));
        Reply::value(&loaded)
    }

    async fn embed(&self, ids: Vec<u32>) -> Result<Reply, String> {
        let part = self.part()?;
        let hidden = part
            .head
            .embed_fetching(&ids)
            .await
            .and_then(|h| Ok(h.flatten_all()?.to_vec1::<f32>()?))
            .map_err(|e| e.to_string())?;
        Ok(Reply {
            value: JsValue::NULL,
            data: Some(Float32Array::from(hidden.as_slice())),
        })
    }

    #[inline(never)]
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Reply, String> {
        let part = self.part()?;
        let text = part
            .template
            .render(messages, true)
            .map_err(|e| e.to_string())?;
        let ids = part
            .tokenizer
            .encode_chat(&text)
            .map_err(|e| e.to_string())?;
        Reply::value(&ids)
    }

    #[inline(never)]
    fn encode(&self, text: &str) -> Result<Reply, String> {
        let ids = self
            .part()?
            .tokenizer
            .encode(text)
            .map_err(|e| e.to_string())?;
        Reply::value(&ids)
    }

    #[inline(never)]
    fn begin(&self, sampling: &Sampling) -> Result<Reply, String> {
        let sampler = Sampler::new(&sampling.into()).map_err(|e| e.to_string())?;
        self.answering.replace(Some(Answering {
            sampler,
            text: TextStream::default(),
        }));
        Reply::value(&())
    }

    #[inline(never)]
    fn next_token(&self, context: &[u32], data: Option<Float32Array>) -> Result<Reply, String> {
        let part = self.part()?;
        let hidden = data.ok_or("next_token without the hidden state")?.to_vec();
        let size = part.head.config().hidden_size;
        if hidden.len() != size {
            return Err(format!(
                "a hidden state of {} values, not {size}",
                hidden.len()
            ));
        }
        let hidden =
            Tensor::from_vec(hidden, (1, 1, size), &Device::Cpu).map_err(|e| e.to_string())?;
        let logits = part.head.last_logits(&hidden).map_err(|e| e.to_string())?;
        let mut answering = self.answering.borrow_mut();
        let answering = answering.as_mut().ok_or("next_token before begin")?;
        let token = answering
            .sampler
            .sample(&logits, context)
            .map_err(|e| e.to_string())?;
        let piece = answering
            .text
            .push(&part.tokenizer, token)
            .map_err(|e| e.to_string())?
            .unwrap_or_default();
        Reply::value(&NextToken { token, piece })
    }

    #[inline(never)]
    fn verify_drafts(
        &self,
        context: &[u32],
        drafts: &[u32],
        data: Option<Float32Array>,
    ) -> Result<Reply, String> {
        let part = self.part()?;
        let hidden = data
            .ok_or("verify_drafts without the hidden states")?
            .to_vec();
        let size = part.head.config().hidden_size;
        let rows = drafts.len() + 1;
        if hidden.len() != rows * size {
            return Err(format!(
                "{} hidden values for {rows} rows of {size}",
                hidden.len()
            ));
        }
        let hidden =
            Tensor::from_vec(hidden, (1, rows, size), &Device::Cpu).map_err(|e| e.to_string())?;
        let mut answering = self.answering.borrow_mut();
        let answering = answering.as_mut().ok_or("verify_drafts before begin")?;
        let tokens = verify_drafts(&part.head, &mut answering.sampler, &hidden, context, drafts)
            .map_err(|e| e.to_string())?;
        let pieces = tokens
            .iter()
            .map(|&token| {
                Ok(answering
                    .text
                    .push(&part.tokenizer, token)
                    .map_err(|e| e.to_string())?
                    .unwrap_or_default())
            })
            .collect::<Result<Vec<_>, String>>()?;
        Reply::value(&Verified { tokens, pieces })
    }

    #[inline(never)]
    fn rewind(&self, kept: usize) -> Result<Reply, String> {
        let part = self.part()?;
        let mut answering = self.answering.borrow_mut();
        let answering = answering.as_mut().ok_or("rewind before begin")?;
        answering
            .text
            .truncate(&part.tokenizer, kept)
            .map_err(|e| e.to_string())?;
        Reply::value(&())
    }

    #[inline(never)]
    fn decode(&self, ids: &[u32]) -> Result<Reply, String> {
        let text = self
            .part()?
            .tokenizer
            .decode(ids)
            .map_err(|e| e.to_string())?;
        Reply::value(&text)
    }

    #[inline(never)]
    fn traffic(&self) -> Result<Reply, String> {
        #[derive(Serialize)]
        struct WorkerTraffic {
            #[serde(flatten)]
            traffic: Traffic,
            wasm_memory_bytes: f64,
            heap_bytes: usize,
            heap_peak_bytes: usize,
        }
        let traffic = self.traffic.take();
        self.traffic.set(traffic.clone());
        let (heap_bytes, heap_peak_bytes) = heap_bytes();
        Reply::value(&WorkerTraffic {
            traffic,
            wasm_memory_bytes: wasm_memory_bytes(),
            heap_bytes,
            heap_peak_bytes,
        })
    }
}
