//! Fetching a server's client part over HTTP. Whole files (config,
//! tokenizer, final norm, a 70B model's LM head) stream into their final
//! memory with progress, are checked against the manifest's size and
//! SHA-256 as they arrive, resume with a range request after a dropped
//! connection, and are kept in the browser's Cache API so the next visit
//! downloads nothing. The embedding table is never downloaded whole:
//! [`RowSource`] fetches the rows a prompt needs by range request, each
//! checked against its own digest and cached.

use std::cell::Cell;
use std::rc::Rc;

use js_sys::{Function, Promise, Reflect, Uint8Array};
use serde::Serialize;
use sha2::{Digest, Sha256};
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use web_sys::{Cache, CacheStorage, Headers, Request, RequestInit, Response};

use corolla_shared::manifest::{ClientFile, ClientManifest};

mod rows;
pub use rows::RowSource;

/// Cache API bucket; entries are keyed by URL and digest.
const CACHE_NAME: &str = "corolla-model-v1";
/// Progress callbacks at most this often (bytes).
const PROGRESS_STEP: usize = 1 << 20;
/// Reserved before the first byte arrives; the manifest's size is only a
/// claim, so more is grown as the body really comes in.
const INITIAL_RESERVE: usize = 64 << 20;
/// Range requests after a download broke off, before giving up.
const RESUMES: usize = 3;
/// Rows closer than this are fetched by one range request.
const ROW_GAP: u32 = 4;

/// Bytes this page fetched over the network and read from its cache.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Traffic {
    pub downloaded_bytes: u64,
    pub cached_bytes: u64,
    pub rows_downloaded: u64,
    pub rows_cached: u64,
    /// Range requests that resumed a download after its connection broke.
    pub resumes: u64,
}

/// Shared by the downloads and the row source of one client.
pub type TrafficCounter = Rc<Cell<Traffic>>;

fn count(counter: &TrafficCounter, f: impl FnOnce(&mut Traffic)) {
    let mut t = counter.take();
    f(&mut t);
    counter.set(t);
}

#[derive(Serialize)]
struct Progress<'a> {
    file: &'a str,
    loaded: u64,
    total: u64,
    cached: bool,
}

fn js_error(context: &str, e: JsValue) -> String {
    let detail = e
        .dyn_ref::<js_sys::Error>()
        .map(|e| String::from(e.message()))
        .or_else(|| e.as_string())
        .unwrap_or_else(|| format!("{e:?}"));
    format!("{context}: {detail}")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `fetch` of the page or of a worker.
fn global_fetch(request: &Request) -> Result<Promise, String> {
    let global = js_sys::global();
    if let Some(window) = global.dyn_ref::<web_sys::Window>() {
        return Ok(window.fetch_with_request(request));
    }
    if let Some(worker) = global.dyn_ref::<web_sys::WorkerGlobalScope>() {
        return Ok(worker.fetch_with_request(request));
    }
    Err("neither a page nor a worker: no fetch".into())
}

async fn fetch(url: &str, range: Option<(u64, Option<u64>)>) -> Result<Response, String> {
    let init = RequestInit::new();
    if let Some((start, end)) = range {
        let headers = Headers::new().map_err(|e| js_error("headers", e))?;
        let value = match end {
            Some(end) => format!("bytes={start}-{end}"),
            None => format!("bytes={start}-"),
        };
        headers
            .set("Range", &value)
            .map_err(|e| js_error("headers", e))?;
        init.set_headers(&headers);
    }
    let request = Request::new_with_str_and_init(url, &init)
        .map_err(|e| js_error(&format!("bad URL {url}"), e))?;
    let response = JsFuture::from(global_fetch(&request)?)
        .await
        .map_err(|e| js_error(&format!("cannot fetch {url}"), e))?;
    let response: Response = response
        .dyn_into()
        .map_err(|_| format!("{url}: fetch did not answer with a response"))?;
    if !response.ok() {
        return Err(format!(
            "{url}: HTTP {} {}",
            response.status(),
            response.status_text()
        ));
    }
    if range.is_some() && response.status() != 206 {
        // A 200 would be the whole file: stop it rather than read it.
        if let Some(body) = response.body() {
            let _ = body.cancel();
        }
        return Err(format!(
            "{url}: the server ignored the range request (HTTP {})",
            response.status()
        ));
    }
    Ok(response)
}

/// The manifest at `base/model/manifest.json`, checked.
pub async fn manifest(base: &str) -> Result<ClientManifest, String> {
    let url = format!("{base}/model/manifest.json");
    let response = fetch(&url, None).await?;
    let text = JsFuture::from(response.text().map_err(|e| js_error(&url, e))?)
        .await
        .map_err(|e| js_error(&url, e))?
        .as_string()
        .unwrap_or_default();
    ClientManifest::parse(text.as_bytes()).map_err(|e| format!("{url}: {e}"))
}

/// The model cache, where the page may have one: the Cache API exists only
/// in secure contexts (https, localhost), so a page on `http://<ip>` has none.
pub async fn open_cache() -> Option<Cache> {
    let global = js_sys::global();
    let present = Reflect::get(&global, &"caches".into()).ok()?;
    if present.is_undefined() || present.is_null() {
        tracing::info!("no Cache API here (not a secure context): the model is not kept");
        return None;
    }
    let caches: CacheStorage = present.dyn_into().ok()?;
    let cache = JsFuture::from(caches.open(CACHE_NAME)).await.ok()?;
    cache.dyn_into().ok()
}

fn report(on_progress: &Function, file: &str, loaded: u64, total: u64, cached: bool) {
    let progress = Progress {
        file,
        loaded,
        total,
        cached,
    };
    if let Ok(value) = serde_wasm_bindgen::to_value(&progress) {
        // A failing progress callback must not fail the download.
        let _ = on_progress.call1(&JsValue::NULL, &value);
    }
}

/// Where a file's bytes go: a growing vector, or memory of the exact size
/// (a quantized tensor's own storage).
pub enum Dest<'a> {
    Grow(&'a mut Vec<u8>),
    Fixed { bytes: &'a mut [u8], filled: usize },
}

impl Dest<'_> {
    fn filled(&self) -> usize {
        match self {
            Dest::Grow(v) => v.len(),
            Dest::Fixed { filled, .. } => *filled,
        }
    }

    fn restart(&mut self) {
        match self {
            Dest::Grow(v) => v.clear(),
            Dest::Fixed { filled, .. } => *filled = 0,
        }
    }

    /// Appends `chunk`, at most `limit` bytes in all; returns what was written.
    fn append(&mut self, chunk: &Uint8Array, limit: usize) -> Result<&[u8], String> {
        let start = self.filled();
        let len = chunk.length() as usize;
        if start + len > limit {
            return Err(format!(
                "more than the {limit} bytes the manifest announced"
            ));
        }
        Ok(match self {
            Dest::Grow(v) => {
                if v.capacity() == 0 {
                    v.reserve(limit.min(INITIAL_RESERVE));
                }
                v.resize(start + len, 0);
                chunk.copy_to(&mut v[start..]);
                &v[start..]
            }
            Dest::Fixed { bytes, filled } => {
                chunk.copy_to(&mut bytes[start..start + len]);
                *filled = start + len;
                &bytes[start..start + len]
            }
        })
    }
}

/// Why reading a body stopped.
enum ReadError {
    /// The connection broke: a range request can go on from here.
    Interrupted(String),
    Fatal(String),
}

/// Bytes read from a body at a time, into one reused buffer.
const READ_PIECE: u32 = 1 << 20;

/// A body reader: "bring your own buffer" where the stream allows it, so
/// that hundreds of megabytes pass through one reused buffer instead of
/// leaving a chunk of garbage each (the renderer's memory would hold them
/// until the next collection); else the default reader.
enum BodyReader {
    Byob {
        reader: web_sys::ReadableStreamByobReader,
        buffer: Option<js_sys::ArrayBuffer>,
        piece: u32,
    },
    Chunks(web_sys::ReadableStreamDefaultReader),
}

impl BodyReader {
    /// Reads `body` in pieces of at most `piece` bytes (a row's few KiB
    /// need no 1 MiB buffer each).
    fn new(body: &web_sys::ReadableStream, piece: u32) -> Result<Self, String> {
        let options = js_sys::Object::new();
        let _ = Reflect::set(&options, &"mode".into(), &"byob".into());
        let byob = Reflect::get(body, &"getReader".into())
            .ok()
            .and_then(|f| f.dyn_into::<Function>().ok())
            .and_then(|f| f.call1(body, &options).ok())
            .and_then(|r| r.dyn_into::<web_sys::ReadableStreamByobReader>().ok());
        if let Some(reader) = byob {
            return Ok(BodyReader::Byob {
                reader,
                buffer: Some(js_sys::ArrayBuffer::new(piece)),
                piece,
            });
        }
        body.get_reader()
            .dyn_into()
            .map(BodyReader::Chunks)
            .map_err(|_| "cannot read the response body".to_string())
    }

    /// The next bytes, or `None` at the end.
    async fn read(&mut self) -> Result<Option<Uint8Array>, JsValue> {
        let (promise, byob) = match self {
            BodyReader::Byob {
                reader,
                buffer,
                piece,
            } => {
                let buffer = buffer
                    .take()
                    .unwrap_or_else(|| js_sys::ArrayBuffer::new(*piece));
                let view = Uint8Array::new(&buffer);
                (reader.read_with_array_buffer_view(&view), true)
            }
            BodyReader::Chunks(reader) => (reader.read(), false),
        };
        let chunk = JsFuture::from(promise).await?;
        let done = Reflect::get(&chunk, &"done".into())?
            .as_bool()
            .unwrap_or(true);
        let value = Reflect::get(&chunk, &"value".into())?;
        if byob {
            // The buffer was transferred into the answer's view: reuse it.
            if let (BodyReader::Byob { buffer, .. }, Some(view)) =
                (&mut *self, value.dyn_ref::<Uint8Array>())
            {
                *buffer = view.buffer().dyn_into().ok();
            }
        }
        if done {
            return Ok(None);
        }
        value
            .dyn_into::<Uint8Array>()
            .map(Some)
            .map_err(|_| JsValue::from_str("the body stream gave no bytes"))
    }
}

/// Streams `response`'s body into `dest`, hashing as it goes.
async fn read_body(
    response: &Response,
    url: &str,
    dest: &mut Dest<'_>,
    limit: usize,
    hasher: &mut Sha256,
    mut progress: impl FnMut(usize),
) -> Result<(), ReadError> {
    let fatal = |m: String| ReadError::Fatal(format!("{url}: {m}"));
    let body = response
        .body()
        .ok_or_else(|| fatal("empty response".into()))?;
    let piece = u32::try_from(limit.max(1)).map_or(READ_PIECE, |l| l.min(READ_PIECE));
    let mut reader = BodyReader::new(&body, piece).map_err(fatal)?;
    loop {
        let chunk = reader
            .read()
            .await
            .map_err(|e| ReadError::Interrupted(js_error(&format!("download of {url}"), e)))?;
        let Some(value) = chunk else {
            return Ok(());
        };
        let written = dest.append(&value, limit).map_err(fatal)?;
        hasher.update(written);
        progress(written.len());
    }
}

/// One file of the manifest into `dest`: from `cache`, else downloaded
/// (streamed, with progress, resumed after a broken connection), checked,
/// and put in `cache`.
pub async fn file_into(
    base: &str,
    file: &ClientFile,
    cache: Option<&Cache>,
    on_progress: &Function,
    traffic: &TrafficCounter,
    dest: &mut Dest<'_>,
) -> Result<(), String> {
    let url = format!("{base}/model/{}", file.name);
    let key = format!("{url}?sha256={}", file.sha256);
    let expected = usize::try_from(file.size).map_err(|_| format!("{url}: too large"))?;
    if let Dest::Fixed { bytes, .. } = dest {
        if bytes.len() != expected {
            return Err(format!(
                "{url}: the manifest says {expected} bytes, the tensor takes {}",
                bytes.len()
            ));
        }
    }
    if let Some(cache) = cache {
        if let Some(response) = JsFuture::from(cache.match_with_str(&key))
            .await
            .ok()
            .and_then(|hit| hit.dyn_into::<Response>().ok())
        {
            let mut hasher = Sha256::new();
            let read = read_body(&response, &url, dest, expected, &mut hasher, |_| {}).await;
            if read.is_ok() && dest.filled() == expected && hex(&hasher.finalize()) == file.sha256 {
                count(traffic, |t| t.cached_bytes += file.size);
                report(on_progress, &file.name, file.size, file.size, true);
                return Ok(());
            }
            // A damaged entry is fetched again rather than trusted.
            dest.restart();
        }
    }
    let mut hasher = Sha256::new();
    let mut next_report = 0;
    for attempt in 0..=RESUMES {
        let from = dest.filled() as u64;
        let range = (attempt > 0).then_some((from, None));
        let response = fetch(&url, range).await?;
        let mut loaded = from as usize;
        let read = read_body(&response, &url, dest, expected, &mut hasher, |n| {
            loaded += n;
            if loaded >= next_report {
                report(on_progress, &file.name, loaded as u64, file.size, false);
                next_report = loaded + PROGRESS_STEP;
            }
        })
        .await;
        count(traffic, |t| {
            t.downloaded_bytes += dest.filled() as u64 - from;
        });
        match read {
            Ok(()) => break,
            Err(ReadError::Interrupted(e)) if attempt < RESUMES => {
                count(traffic, |t| t.resumes += 1);
                tracing::warn!(file = %file.name, error = %e, at = dest.filled(), "download broke off; resuming");
            }
            Err(ReadError::Interrupted(e) | ReadError::Fatal(e)) => return Err(e),
        }
    }
    let bytes_ok = dest.filled() == expected;
    if !bytes_ok || hex(&hasher.finalize()) != file.sha256 {
        return Err(if bytes_ok {
            format!("{url}: SHA-256 does not match the manifest")
        } else {
            format!(
                "{url}: got {} bytes, the manifest announced {expected}",
                dest.filled()
            )
        });
    }
    report(on_progress, &file.name, file.size, file.size, false);
    if let Some(cache) = cache {
        let bytes: &[u8] = match dest {
            Dest::Grow(v) => v,
            Dest::Fixed { bytes, .. } => bytes,
        };
        if let Err(e) = store_streamed(cache, &key, bytes).await {
            // Quota or private mode: the page still works, it only downloads again next time.
            tracing::warn!(file = %file.name, error = %e, "not cached");
        }
    }
    Ok(())
}

/// Puts verified `bytes` in the cache through a stream the cache pulls a
/// piece at a time, so a file of hundreds of megabytes is never copied
/// whole into JavaScript memory (as `new Response(bytes)` would). Every
/// piece goes through one reused buffer: a fresh buffer a piece left the
/// whole file as garbage, which the renderer held until its next collection
/// (60-100 MB above the page's resting memory for a 147 MB LM head). Reuse
/// is safe because the stream keeps no queue (high-water mark 0): the
/// cache's reader asks for a piece only once it has taken all of the last
/// one, and an entry damaged anyway would fail its SHA-256 when read.
async fn store_streamed(cache: &Cache, key: &str, bytes: &[u8]) -> Result<(), String> {
    struct Cursor {
        start: *const u8,
        len: usize,
        at: Cell<usize>,
        /// Cleared once the put settled: later pulls touch no memory.
        alive: Cell<bool>,
        piece: Uint8Array,
    }
    let cursor = Rc::new(Cursor {
        start: bytes.as_ptr(),
        len: bytes.len(),
        at: Cell::new(0),
        alive: Cell::new(true),
        piece: Uint8Array::new_with_length(READ_PIECE.min(bytes.len().max(1) as u32)),
    });
    let pulled = cursor.clone();
    let pull =
        wasm_bindgen::closure::Closure::<dyn FnMut(web_sys::ReadableStreamDefaultController)>::new(
            move |controller: web_sys::ReadableStreamDefaultController| {
                let at = pulled.at.get();
                if !pulled.alive.get() || at >= pulled.len {
                    let _ = controller.close();
                    return;
                }
                let end = (at + pulled.piece.length() as usize).min(pulled.len);
                // SAFETY: `alive` is set only while `store_streamed` awaits the
                // put, and for all that time it borrows `bytes`, which
                // `start..start + len` points into (wasm memory does not move).
                let piece = unsafe { std::slice::from_raw_parts(pulled.start.add(at), end - at) };
                let chunk = pulled.piece.subarray(0, piece.len() as u32);
                chunk.copy_from(piece);
                let _ = controller.enqueue_with_chunk(&chunk);
                pulled.at.set(end);
            },
        );
    let source = js_sys::Object::new();
    Reflect::set(&source, &"pull".into(), &pull.into_js_value())
        .map_err(|e| js_error("cache stream", e))?;
    let no_queue = web_sys::QueuingStrategy::new();
    no_queue.set_high_water_mark(0.0);
    let stream =
        web_sys::ReadableStream::new_with_underlying_source_and_strategy(&source, &no_queue)
            .map_err(|e| js_error("cache stream", e))?;
    let put = Response::new_with_opt_readable_stream(Some(&stream))
        .map(|response| JsFuture::from(cache.put_with_str(key, &response)));
    let result = match put {
        Ok(put) => put.await.map(|_| ()).map_err(|e| js_error("cache put", e)),
        Err(e) => Err(js_error("cannot build a cache entry", e)),
    };
    cursor.alive.set(false);
    result
}

/// One file of the manifest as bytes ([`file_into`] a growing vector).
pub async fn file(
    base: &str,
    file: &ClientFile,
    cache: Option<&Cache>,
    on_progress: &Function,
    traffic: &TrafficCounter,
) -> Result<Vec<u8>, String> {
    let mut bytes = Vec::new();
    file_into(
        base,
        file,
        cache,
        on_progress,
        traffic,
        &mut Dest::Grow(&mut bytes),
    )
    .await?;
    Ok(bytes)
}

async fn store(cache: &Cache, key: &str, bytes: &mut [u8]) -> Result<(), String> {
    let response = Response::new_with_opt_u8_array(Some(bytes))
        .map_err(|e| js_error("cannot build a cache entry", e))?;
    JsFuture::from(cache.put_with_str(key, &response))
        .await
        .map_err(|e| js_error("cache put", e))?;
    Ok(())
}
