//! The embedding table by row: each prompt's rows fetched by range request
//! (neighbours a few rows apart in one request), checked against their own
//! digests and kept in the Cache API.

use std::collections::HashMap;

use corolla_model::embeddings::{RowFetch, RowsFuture};
use corolla_model::ModelError;
use corolla_shared::manifest::RowsFile;
use js_sys::Uint8Array;
use sha2::{Digest, Sha256};
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;
use web_sys::{Cache, Response};

use super::{count, fetch, hex, read_body, store, Dest, ReadError, TrafficCounter, ROW_GAP};

/// The embedding rows of a server's client part, fetched by range request.
pub struct RowSource {
    url: String,
    row_bytes: usize,
    rows: u32,
    /// 32 bytes per row.
    digests: Vec<u8>,
    cache: Option<Cache>,
    traffic: TrafficCounter,
}

impl RowSource {
    pub fn new(
        base: &str,
        rows: &RowsFile,
        digests: Vec<u8>,
        cache: Option<Cache>,
        traffic: TrafficCounter,
    ) -> Result<Self, String> {
        let count = u32::try_from(rows.rows).map_err(|_| "too many embedding rows")?;
        if digests.len() as u64 != rows.rows * 32 {
            return Err(format!(
                "{} row digests for {} rows",
                digests.len() / 32,
                rows.rows
            ));
        }
        Ok(RowSource {
            url: format!("{base}/model/{}", rows.file),
            row_bytes: usize::try_from(rows.row_bytes).map_err(|_| "rows too large")?,
            rows: count,
            digests,
            cache,
            traffic,
        })
    }

    fn digest(&self, id: u32) -> &[u8] {
        &self.digests[id as usize * 32..][..32]
    }

    fn key(&self, id: u32) -> String {
        format!("{}?row={id}&sha256={}", self.url, hex(self.digest(id)))
    }

    async fn cached(&self, id: u32) -> Option<Vec<u8>> {
        let cache = self.cache.as_ref()?;
        let hit = JsFuture::from(cache.match_with_str(&self.key(id)))
            .await
            .ok()?;
        let response: Response = hit.dyn_into().ok()?;
        let buffer = JsFuture::from(response.array_buffer().ok()?).await.ok()?;
        let bytes = Uint8Array::new(&buffer).to_vec();
        (bytes.len() == self.row_bytes && Sha256::digest(&bytes)[..] == *self.digest(id))
            .then_some(bytes)
    }

    /// Rows `first..=last` by one range request, each checked.
    async fn download(&self, first: u32, last: u32) -> Result<Vec<Vec<u8>>, String> {
        let rb = self.row_bytes as u64;
        let response = fetch(
            &self.url,
            Some((first as u64 * rb, Some((last as u64 + 1) * rb - 1))),
        )
        .await?;
        let expected = (last - first + 1) as usize * self.row_bytes;
        let mut bytes = Vec::new();
        let mut hasher = Sha256::new();
        read_body(
            &response,
            &self.url,
            &mut Dest::Grow(&mut bytes),
            expected,
            &mut hasher,
            |_| {},
        )
        .await
        .map_err(|e| match e {
            ReadError::Interrupted(e) | ReadError::Fatal(e) => e,
        })?;
        if bytes.len() != expected {
            return Err(format!(
                "{}: rows {first}..={last}: {} bytes, not {expected}",
                self.url,
                bytes.len()
            ));
        }
        count(&self.traffic, |t| {
            t.downloaded_bytes += expected as u64;
            t.rows_downloaded += (last - first + 1) as u64;
        });
        let mut rows = Vec::with_capacity((last - first + 1) as usize);
        for (id, row) in (first..=last).zip(bytes.chunks_exact(self.row_bytes)) {
            if Sha256::digest(row)[..] != *self.digest(id) {
                return Err(format!("{}: row {id} does not match its digest", self.url));
            }
            let mut row = row.to_vec();
            if let Some(cache) = &self.cache {
                if let Err(e) = store(cache, &self.key(id), &mut row).await {
                    tracing::debug!(row = id, error = %e, "row not cached");
                }
            }
            rows.push(row);
        }
        Ok(rows)
    }

    async fn rows(&self, ids: &[u32]) -> Result<Vec<Vec<u8>>, String> {
        if let Some(&bad) = ids.iter().find(|&&id| id >= self.rows) {
            return Err(format!("row {bad} of {}", self.rows));
        }
        let mut found: HashMap<u32, Vec<u8>> = HashMap::new();
        let mut wanted: Vec<u32> = Vec::new();
        for &id in ids {
            match self.cached(id).await {
                Some(row) => {
                    count(&self.traffic, |t| {
                        t.cached_bytes += row.len() as u64;
                        t.rows_cached += 1;
                    });
                    found.insert(id, row);
                }
                None => wanted.push(id),
            }
        }
        wanted.sort_unstable();
        wanted.dedup();
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for id in wanted {
            match runs.last_mut() {
                Some((_, last)) if id - *last <= ROW_GAP => *last = id,
                _ => runs.push((id, id)),
            }
        }
        let fetched = futures::future::try_join_all(
            runs.iter().map(|&(first, last)| self.download(first, last)),
        )
        .await?;
        for (&(first, last), rows) in runs.iter().zip(fetched) {
            for (id, row) in (first..=last).zip(rows) {
                found.insert(id, row);
            }
        }
        ids.iter()
            .map(|id| {
                found
                    .get(id)
                    .cloned()
                    .ok_or_else(|| format!("row {id} was not fetched"))
            })
            .collect()
    }
}

impl RowFetch for RowSource {
    fn fetch<'a>(&'a self, ids: &'a [u32]) -> RowsFuture<'a> {
        Box::pin(async move { self.rows(ids).await.map_err(ModelError::RowFetch) })
    }
}
