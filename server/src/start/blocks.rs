//! The model a server opens and the span it serves: the checkpoint (local or
//! from the hub), the device, and which blocks (the flag's, or those that
//! fit and that the swarm lacks most).

use std::sync::Arc;
use std::time::Duration;

use corolla_model::fingerprint::default_model_name;
use corolla_model::{Checkpoint, Device, LlamaConfig, ModelError};
use corolla_shared::node::NodeHandle;

use crate::adapters::AdapterFiles;
use crate::config::{DeviceArg, NumBlocks, ServerArgs};
use crate::error::ServerError;
use crate::host::SpanLoader;
use crate::hub::ModelSource;
use crate::placement::choose_blocks;

/// The checkpoint a server serves and where it computes.
pub(super) struct OpenedModel {
    pub source: Arc<ModelSource>,
    pub checkpoint: Arc<Checkpoint>,
    pub config: LlamaConfig,
    pub device: Device,
    /// The name announced in the DHT.
    pub name: String,
    /// `--adapter`s, read once for every span the server will host.
    pub adapters: Arc<AdapterFiles>,
}

impl OpenedModel {
    pub async fn open(args: &ServerArgs) -> Result<Self, ServerError> {
        let device = match args.device {
            DeviceArg::Cpu => Device::Cpu,
            DeviceArg::Cuda => cuda_device()?,
        };
        let model = args.model.clone();
        let source = Arc::new(
            tokio::task::spawn_blocking(move || ModelSource::resolve(&model))
                .await
                .map_err(ServerError::Task)??,
        );
        let checkpoint =
            Arc::new(Checkpoint::open(source.dir())?.with_quantized_weights(args.quantized));
        let config = checkpoint.config().clone();
        let adapter_args = args.adapters.clone();
        let adapters = tokio::task::spawn_blocking(move || AdapterFiles::read(&adapter_args))
            .await
            .map_err(ServerError::Task)??;
        let name = args
            .model_name
            .clone()
            .or_else(|| source.default_name(&checkpoint))
            .unwrap_or_else(|| default_model_name(&checkpoint));
        Ok(OpenedModel {
            source,
            checkpoint,
            config,
            device,
            name,
            adapters: Arc::new(adapters),
        })
    }

    /// What loads this model's spans, now and whenever the server moves.
    pub fn loader(&self, args: &ServerArgs) -> SpanLoader {
        SpanLoader {
            checkpoint: self.checkpoint.clone(),
            source: self.source.clone(),
            dtype: args.dtype.resolve(&self.config, &self.device),
            device: self.device.clone(),
            step_delay: Duration::from_millis(args.step_delay_ms),
            adapters: self.adapters.clone(),
        }
    }

    /// The blocks `[start, end)` to serve: `--block-indices`, or
    /// `--num-blocks` (a count, or what fits) placed where the swarm
    /// `node` has joined covers least.
    pub async fn choose_span(
        &self,
        args: &ServerArgs,
        node: &NodeHandle,
        joined_a_swarm: bool,
    ) -> Result<(usize, usize), ServerError> {
        let num_layers = self.config.num_hidden_layers;
        let (start, end) = match (args.block_indices, args.num_blocks) {
            (Some(r), None) => (r.start, r.end),
            (Some(_), Some(_)) => {
                return Err(ServerError::BadArgs(
                    "pass --block-indices A:B or --num-blocks N|auto, not both".into(),
                ))
            }
            (None, n) => {
                let n = match n.unwrap_or(NumBlocks::Auto) {
                    NumBlocks::Count(n) => n,
                    NumBlocks::Auto => self.auto_block_count(args)?,
                };
                let existing = if joined_a_swarm {
                    node.discover(&self.name, Duration::from_secs(5))
                        .await
                        .unwrap_or_default()
                } else {
                    Vec::new()
                };
                choose_blocks(num_layers, n, &existing)
            }
        };
        if end > num_layers {
            return Err(ModelError::LayerRange {
                start,
                end,
                num_layers,
            }
            .into());
        }
        Ok((start, end))
    }

    /// `--num-blocks auto`: the blocks that fit in `--memory-limit` (default:
    /// the memory available now) with the KV cache they need.
    fn auto_block_count(&self, args: &ServerArgs) -> Result<usize, ServerError> {
        let config = &self.config;
        let limit = match (args.memory_limit, self.device.is_cpu()) {
            (Some(limit), _) => limit,
            (None, true) => crate::memory::available_bytes().ok_or_else(|| {
                ServerError::BadArgs(
                    "cannot read the available memory: pass --memory-limit or --num-blocks".into(),
                )
            })?,
            (None, false) => return Err(ServerError::BadArgs(
                "--num-blocks auto on a GPU needs --memory-limit (the VRAM this server may use)"
                    .into(),
            )),
        };
        let dtype = args.dtype.resolve(config, &self.device);
        let dtype_bytes = dtype.size_in_bytes();
        let max_length = args
            .inference_max_length
            .min(config.max_position_embeddings);
        let cache_tokens = args
            .cache_tokens
            .unwrap_or((args.max_sessions as u64).saturating_mul(max_length as u64));
        // Kept-quantized blocks take their stored size, not the compute dtype's.
        let block_bytes = self
            .checkpoint
            .loaded_block_bytes(dtype)
            .unwrap_or_else(|| config.block_parameters().saturating_mul(dtype_bytes as u64))
            .saturating_add(self.adapters.bytes_per_block(dtype_bytes));
        let n = crate::memory::blocks_that_fit(
            limit,
            block_bytes,
            cache_tokens,
            config.cache_bytes_per_token_per_block(dtype_bytes),
            config.num_hidden_layers,
        );
        tracing::info!(
            blocks = n,
            limit_mib = limit >> 20,
            block_mib = block_bytes >> 20,
            "--num-blocks auto"
        );
        Ok(n)
    }
}

#[cfg(feature = "cuda")]
fn cuda_device() -> Result<Device, ServerError> {
    Device::new_cuda(0).map_err(|e| ServerError::Device(format!("no usable CUDA device: {e}")))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Result<Device, ServerError> {
    Err(ServerError::Device(
        "this build has no CUDA support; rebuild corolla-server with --features cuda".into(),
    ))
}
