//! Loading a server's client part into this wasm instance (the head
//! worker's): the manifest's files downloaded or taken from the cache, a
//! 70B-class LM head streamed into its quantized storage, and a source of
//! embedding rows where the table stays on the server.

use corolla_client::assistant::ClientPart;
use corolla_model::embeddings::RowFormat;
use corolla_model::quantized_buffer::{parse_ggml_dtype, QuantizedBuffer};
use corolla_model::{Checkpoint, DType, QuantizedWeights};
use corolla_shared::manifest::{ClientManifest, MAX_PART_BYTES};
use js_sys::Function;

use crate::download::{self, TrafficCounter};

/// Downloads (or takes from the browser cache) the client part that the
/// Corolla server at `base` serves; `on_progress({file, loaded, total, cached})`.
pub async fn load(
    base: &str,
    on_progress: &Function,
    traffic: &TrafficCounter,
) -> Result<ClientPart, String> {
    let manifest = download::manifest(base).await?;
    let cache = download::open_cache().await;
    let lm_head_file = manifest.lm_head.as_ref().map(|h| h.file.as_str());
    let digests_file = manifest.embedding_rows.as_ref().map(|r| r.digests.as_str());
    let mut files = Vec::with_capacity(manifest.files.len());
    let mut lm_head = None;
    let mut digests = None;
    for file in &manifest.files {
        if Some(file.name.as_str()) == lm_head_file {
            // Streamed straight into the quantized tensor's storage.
            let mut buffer = lm_head_buffer(&manifest)?;
            let mut dest = download::Dest::Fixed {
                bytes: buffer.bytes_mut(),
                filled: 0,
            };
            download::file_into(base, file, cache.as_ref(), on_progress, traffic, &mut dest)
                .await?;
            lm_head = Some(buffer.into_qtensor().map_err(|e| e.to_string())?);
            continue;
        }
        let bytes = download::file(base, file, cache.as_ref(), on_progress, traffic).await?;
        if Some(file.name.as_str()) == digests_file {
            digests = Some(bytes);
        } else {
            files.push((file.name.clone(), bytes));
        }
    }
    let checkpoint = Checkpoint::from_memory(files)
        .map_err(|e| e.to_string())?
        // As the CLI does, so that both compute the same logits.
        .with_quantized_weights(QuantizedWeights::Auto);
    let mut part = match (&manifest.embedding_rows, lm_head, digests) {
        (Some(rows), Some(lm_head), Some(digests)) => {
            let format = RowFormat {
                dtype: parse_ggml_dtype(&rows.dtype).map_err(|e| e.to_string())?,
                rows: rows.rows as usize,
                hidden: rows.hidden as usize,
            };
            if format.row_bytes() != Some(rows.row_bytes as usize) {
                return Err(format!(
                    "embedding rows of {} bytes are not {} {} values",
                    rows.row_bytes, rows.hidden, rows.dtype
                ));
            }
            let source =
                download::RowSource::new(base, rows, digests, cache.clone(), traffic.clone())?;
            ClientPart::load_split(&checkpoint, DType::F32, lm_head, format, Box::new(source))
        }
        (None, None, None) => ClientPart::load(&checkpoint, DType::F32),
        _ => {
            return Err("the manifest lists an LM head or embedding rows without the other".into())
        }
    }
    .map_err(|e| e.to_string())?;
    // The swarm knows the model by the manifest's name.
    part.model = manifest.model;
    Ok(part)
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
