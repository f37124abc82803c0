//! The span this server hosts now, and what its sessions share. A
//! rebalancing server puts its span down and picks another one up; the
//! acceptors and the status page read the current span for each stream, so
//! a session stays with the span it opened on, and between two spans new
//! streams are told to go elsewhere.

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use corolla_model::fingerprint::{block_hashes, fingerprint};
use corolla_model::{BlockSpan, Checkpoint, DType, Device};
use corolla_shared::node::{Announcement, LiveFigures};

use corolla_shared::ServerRecord;
use tokio::sync::watch;

use crate::adapters::{AdapterFiles, ServedAdapters};
use crate::compute::ComputeCore;
use crate::error::ServerError;
use crate::host_settings::HostSettings;
use crate::hub::ModelSource;
use crate::measure::{measure, Throughput};
use crate::session::SessionContext;

/// Loads spans of the model this server serves, as often as it moves.
#[derive(Clone)]
pub(crate) struct SpanLoader {
    pub checkpoint: Arc<Checkpoint>,
    pub source: Arc<ModelSource>,
    pub dtype: DType,
    pub device: Device,
    pub step_delay: Duration,
    pub adapters: Arc<AdapterFiles>,
}

/// A span loaded and measured, ready to serve.
pub(crate) struct LoadedSpan {
    pub span: BlockSpan,
    pub throughput: Throughput,
    /// The whole model's fingerprint, when this server can know it.
    pub fingerprint: String,
    pub block_hashes: Vec<String>,
    /// The `--adapter`s on this span.
    pub adapters: ServedAdapters,
}

impl SpanLoader {
    /// Fetches (for a hub model), hashes, loads and measures blocks `start..end`.
    pub async fn load(&self, start: usize, end: usize) -> Result<LoadedSpan, ServerError> {
        let loader = self.clone();
        tokio::task::spawn_blocking(move || {
            let ck = &loader.checkpoint;
            loader.source.fetch(ck.files_for_layers(start, end))?;
            let hashes = block_hashes(ck, start, end)?;
            // Known when the index carries it or every weight is at hand;
            // a server that downloaded only its blocks announces none.
            let fingerprint = fingerprint(ck).unwrap_or_default();
            let span = BlockSpan::load(ck, start, end, loader.dtype, &loader.device)?;
            let adapters = loader.adapters.for_span(&span)?;
            let throughput = measure(&span, loader.step_delay)?;
            tracing::info!(
                start,
                end,
                decode = throughput.decode,
                prefill = throughput.prefill,
                adapters = adapters.names().len(),
                adapter_bytes = adapters.bytes(),
                "blocks loaded; measured tokens per second"
            );
            Ok(LoadedSpan {
                span,
                throughput,
                fingerprint,
                block_hashes: hashes,
                adapters,
            })
        })
        .await
        .map_err(|e| ServerError::LoadBlocks {
            start,
            end,
            message: e.to_string(),
        })?
    }
}

/// A span in service: its sessions' context and the switch that tells
/// them the server leaves.
pub(crate) struct Hosted {
    pub ctx: Arc<SessionContext>,
    leaving: watch::Sender<bool>,
}

impl Hosted {
    /// Open sessions finish their step, are told to continue elsewhere and end.
    pub fn tell_sessions_to_leave(&self) {
        let _ = self.leaving.send(true);
    }
}

impl HostSettings {
    /// Starts a compute core for `loaded` and the context its sessions share.
    pub fn host(self: &Arc<Self>, loaded: LoadedSpan) -> Result<Hosted, ServerError> {
        let range = loaded.span.range();
        let record = ServerRecord {
            fingerprint: loaded.fingerprint,
            block_hashes: loaded.block_hashes.clone(),
            start: range.start as u32,
            end: range.end as u32,
            throughput: loaded.throughput.decode,
            prefill_throughput: loaded.throughput.prefill,
            dtype: format!("{:?}", loaded.span.dtype()).to_lowercase(),
            adapters: loaded.adapters.names(),
            leaving: false,
            ..self.template.clone()
        };
        let core = ComputeCore::start(
            Arc::new(loaded.span),
            self.compute,
            self.metrics.clone(),
            self.cache.clone(),
        )
        .map_err(ServerError::ComputeThread)?;
        let (leaving, shutdown) = watch::channel(false);
        let ctx = SessionContext {
            core,
            block_hashes: loaded.block_hashes,
            adapters: loaded.adapters,
            settings: self.clone(),
            shutdown,
            record: Mutex::new(record),
        };
        Ok(Hosted {
            ctx: Arc::new(ctx),
            leaving,
        })
    }

    /// What the DHT is told about `hosted` each period, live figures included.
    pub fn announcement(&self, hosted: &Hosted) -> Announcement {
        let live: LiveFigures = {
            let ctx = Arc::downgrade(&hosted.ctx);
            Arc::new(move |record: &mut ServerRecord| {
                if let Some(ctx) = ctx.upgrade() {
                    ctx.fill_live_figures(record);
                }
            })
        };
        Announcement {
            record: hosted.ctx.record(),
            period: self.update_period,
            live: Some(live),
        }
    }
}

/// The span in service now, if any (none while the server moves).
pub(crate) struct SpanHost {
    current: RwLock<Option<Arc<Hosted>>>,
    /// The last span's record, for the status page between two spans.
    last_record: Mutex<ServerRecord>,
}

impl SpanHost {
    pub fn new(first: Hosted) -> Arc<Self> {
        let record = first.ctx.record();
        Arc::new(SpanHost {
            current: RwLock::new(Some(Arc::new(first))),
            last_record: Mutex::new(record),
        })
    }

    pub fn ctx(&self) -> Option<Arc<SessionContext>> {
        self.read().as_ref().map(|h| h.ctx.clone())
    }

    /// The current span's record with its live figures, or between two
    /// spans the last one's, marked leaving.
    pub fn record(&self) -> ServerRecord {
        match self.ctx() {
            Some(ctx) => ctx.record(),
            None => self
                .last_record
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }

    pub fn blocks(&self) -> (usize, usize) {
        match self.ctx() {
            Some(ctx) => {
                let range = ctx.core.span().range();
                (range.start, range.end)
            }
            None => {
                let r = self.last_record.lock().unwrap_or_else(|p| p.into_inner());
                (r.start as usize, r.end as usize)
            }
        }
    }

    /// Takes the span out of service: new streams are refused from now on.
    pub fn put_down(&self) -> Option<Arc<Hosted>> {
        let hosted = self.write().take()?;
        let mut record = hosted.ctx.record();
        record.leaving = true;
        *self.last_record.lock().unwrap_or_else(|p| p.into_inner()) = record;
        Some(hosted)
    }

    pub fn pick_up(&self, hosted: Hosted) {
        *self.write() = Some(Arc::new(hosted));
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Option<Arc<Hosted>>> {
        self.current.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Option<Arc<Hosted>>> {
        self.current.write().unwrap_or_else(|p| p.into_inner())
    }
}
