//! Fetching a server's client part (config, tokenizer, embeddings, final
//! norm, LM head) over HTTP with progress, checked against the manifest's
//! sizes and SHA-256 digests, and kept in the browser's Cache API so the
//! next visit downloads nothing.

use js_sys::{Function, Reflect, Uint8Array};
use serde::Serialize;
use sha2::{Digest, Sha256};
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use web_sys::{Cache, Response};

/// Cache API bucket; entries are keyed by URL and digest.
const CACHE_NAME: &str = "corolla-model-v1";
/// Progress callbacks at most this often (bytes).
const PROGRESS_STEP: usize = 1 << 20;
/// Reserved before the first byte arrives; the manifest's size is only a
/// claim, so more is grown as the body really comes in.
const INITIAL_RESERVE: usize = 64 << 20;

use corolla_shared::manifest::{ClientFile, ClientManifest};

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

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn fetch(url: &str) -> Result<Response, String> {
    let window = web_sys::window().ok_or("no window: run the client in a page")?;
    let response = JsFuture::from(window.fetch_with_str(url))
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
    Ok(response)
}

/// The manifest at `base/model/manifest.json`, checked.
pub async fn manifest(base: &str) -> Result<ClientManifest, String> {
    let url = format!("{base}/model/manifest.json");
    let response = fetch(&url).await?;
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
    let window = web_sys::window()?;
    let present = Reflect::get(&window, &"caches".into()).ok()?;
    if present.is_undefined() || present.is_null() {
        tracing::info!("no Cache API here (not a secure context): the model is not kept");
        return None;
    }
    let caches = window.caches().ok()?;
    let cache = JsFuture::from(caches.open(CACHE_NAME)).await.ok()?;
    cache.dyn_into().ok()
}

async fn cached(cache: &Cache, key: &str, file: &ClientFile) -> Option<Vec<u8>> {
    let hit = JsFuture::from(cache.match_with_str(key)).await.ok()?;
    let response: Response = hit.dyn_into().ok()?;
    let buffer = JsFuture::from(response.array_buffer().ok()?).await.ok()?;
    let bytes = Uint8Array::new(&buffer).to_vec();
    // A damaged entry is fetched again rather than trusted.
    (bytes.len() as u64 == file.size && hex_sha256(&bytes) == file.sha256).then_some(bytes)
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

/// One file of the manifest: from `cache`, else downloaded (streamed, with
/// progress), checked, and put in `cache`.
pub async fn file(
    base: &str,
    file: &ClientFile,
    cache: Option<&Cache>,
    on_progress: &Function,
) -> Result<Vec<u8>, String> {
    let url = format!("{base}/model/{}", file.name);
    let key = format!("{url}?sha256={}", file.sha256);
    if let Some(cache) = cache {
        if let Some(bytes) = cached(cache, &key, file).await {
            report(on_progress, &file.name, file.size, file.size, true);
            return Ok(bytes);
        }
    }
    let response = fetch(&url).await?;
    let body = response
        .body()
        .ok_or_else(|| format!("{url}: empty response"))?;
    let reader: web_sys::ReadableStreamDefaultReader = body
        .get_reader()
        .dyn_into()
        .map_err(|_| format!("{url}: cannot read the response body"))?;
    let expected = usize::try_from(file.size).map_err(|_| format!("{url}: too large"))?;
    let mut bytes = Vec::with_capacity(expected.min(INITIAL_RESERVE));
    let mut next_report = 0;
    loop {
        let chunk = JsFuture::from(reader.read())
            .await
            .map_err(|e| js_error(&format!("download of {url} failed"), e))?;
        let done = Reflect::get(&chunk, &"done".into())
            .ok()
            .and_then(|d| d.as_bool())
            .unwrap_or(true);
        if done {
            break;
        }
        let value: Uint8Array = Reflect::get(&chunk, &"value".into())
            .ok()
            .and_then(|v| v.dyn_into().ok())
            .ok_or_else(|| format!("{url}: the body stream gave no bytes"))?;
        if bytes.len() + value.length() as usize > expected {
            return Err(format!(
                "{url}: more than the {expected} bytes the manifest announced"
            ));
        }
        let start = bytes.len();
        bytes.resize(start + value.length() as usize, 0);
        value.copy_to(&mut bytes[start..]);
        if bytes.len() >= next_report {
            report(
                on_progress,
                &file.name,
                bytes.len() as u64,
                file.size,
                false,
            );
            next_report = bytes.len() + PROGRESS_STEP;
        }
    }
    if bytes.len() != expected {
        return Err(format!(
            "{url}: got {} bytes, the manifest announced {expected}",
            bytes.len()
        ));
    }
    if hex_sha256(&bytes) != file.sha256 {
        return Err(format!("{url}: SHA-256 does not match the manifest"));
    }
    report(on_progress, &file.name, file.size, file.size, false);
    if let Some(cache) = cache {
        if let Err(e) = store(cache, &key, &mut bytes).await {
            // Quota or private mode: the page still works, it only downloads again next time.
            tracing::warn!(file = %file.name, error = %e, "not cached");
        }
    }
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
