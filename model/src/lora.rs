//! LoRA on a span: each adapted projection adds `scale · B (A x)` to what the
//! base weight computes, as PEFT and llama.cpp do (the base weights are
//! never merged, so one span serves every adapter and none at once).
//!
//! A [`SpanAdapter`] is an adapter file's layers for one span, in the span's
//! dtype, device and rotary row layout; a session's [`crate::SessionCache`]
//! names the one it runs with. In a batched decode step the base
//! projections run once for all rows, and each row goes through its own
//! adapter's matrices alone ([`RowLoras`]).

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::adapter::{AdapterFile, LowRankPair, Target};
use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::rope::RopeLayout;

/// One adapted projection, ready for the span's math.
#[derive(Debug)]
struct LoraPair {
    /// `[rank, in]`.
    a: Tensor,
    /// `[out, rank]`.
    b: Tensor,
    scale: f64,
}

impl LoraPair {
    /// `scale · B (A x)` for `x` of rows `[.., in]`.
    fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        let in_dim = dims.last().copied().unwrap_or(0);
        let rows = x.elem_count() / in_dim.max(1);
        let low = x.reshape((rows, in_dim))?.matmul(&self.a.t()?)?;
        let y = (low.matmul(&self.b.t()?)? * self.scale)?;
        let mut out_dims = dims.to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = self.b.dim(0)?;
        }
        Ok(y.reshape(out_dims)?)
    }
}

/// The adapted projections of one layer.
#[derive(Debug, Default)]
pub(crate) struct LayerLora {
    pairs: [Option<LoraPair>; 7],
}

/// An adapter's layers for one span. Cheap to clone (shared matrices).
#[derive(Debug, Clone)]
pub struct SpanAdapter {
    layers: Arc<[Arc<LayerLora>]>,
    first_layer: usize,
    bytes: usize,
}

impl SpanAdapter {
    /// Takes `file`'s layers in `layers` into `dtype` on `device`, with query
    /// and key rows in `layout` (a span over GGUF `llama` weights has them
    /// permuted as llama.cpp does), checking every shape against `config`.
    pub(crate) fn new(
        file: &AdapterFile,
        config: &LlamaConfig,
        layers: Range<usize>,
        layout: RopeLayout,
        dtype: candle_core::DType,
        device: &Device,
    ) -> Result<Self> {
        let invalid = |message: String| ModelError::invalid_file(file.path(), message);
        if let Some(last) = file.last_layer() {
            if last >= config.num_hidden_layers {
                return Err(invalid(format!(
                    "adapts layer {last}, but the model has {} layers",
                    config.num_hidden_layers
                )));
            }
        }
        if let Some(architecture) = file.architecture() {
            let model = crate::gguf::architecture_of(config.family);
            if architecture != model {
                return Err(invalid(format!(
                    "an adapter for the {architecture} architecture, the model is {model}"
                )));
            }
        }
        let mut bytes = 0;
        let mut span_layers = Vec::with_capacity(layers.len());
        for layer in layers.clone() {
            let mut adapted = LayerLora::default();
            for target in Target::ALL {
                let Some(pair) = file.pairs().get(&(layer, target)) else {
                    continue;
                };
                let name = format!("layer {layer} {}", target.hf_module());
                if target.is_feed_forward() && config.experts.is_some() {
                    return Err(invalid(format!(
                        "{name}: a mixture of experts has no dense MLP to adapt"
                    )));
                }
                let (out_dim, in_dim) = target_shape(config, target);
                let (a_dims, b_dims) = (pair.a.dims(), pair.b.dims());
                if a_dims[1] != in_dim || b_dims[0] != out_dim {
                    return Err(invalid(format!(
                        "{name}: A {a_dims:?} and B {b_dims:?} do not fit a [{out_dim}, {in_dim}] projection"
                    )));
                }
                let b = match target {
                    Target::Query => {
                        relayout(pair, config.num_attention_heads, file.layout(), layout)?
                    }
                    Target::Key => {
                        relayout(pair, config.num_key_value_heads, file.layout(), layout)?
                    }
                    _ => pair.b.clone(),
                };
                let pair = LoraPair {
                    a: pair.a.to_dtype(dtype)?.to_device(device)?,
                    b: b.to_dtype(dtype)?.to_device(device)?,
                    scale: pair.scale,
                };
                bytes += (pair.a.elem_count() + pair.b.elem_count()) * dtype.size_in_bytes();
                adapted.pairs[target.index()] = Some(pair);
            }
            span_layers.push(Arc::new(adapted));
        }
        Ok(SpanAdapter {
            layers: span_layers.into(),
            first_layer: layers.start,
            bytes,
        })
    }

    /// The layers this adapter was made for (absolute indices).
    pub fn layers(&self) -> Range<usize> {
        self.first_layer..self.first_layer + self.layers.len()
    }

    /// Bytes its matrices take.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Layer `layer`'s projections (an absolute index inside [`Self::layers`]).
    pub(crate) fn layer(&self, layer: usize) -> Option<&LayerLora> {
        self.layers
            .get(layer.checked_sub(self.first_layer)?)
            .map(|l| l.as_ref())
    }
}

/// `(out, in)` of a target's projection.
fn target_shape(config: &LlamaConfig, target: Target) -> (usize, usize) {
    let (h, i, hd) = (
        config.hidden_size,
        config.intermediate_size,
        config.head_dim,
    );
    let (heads, kv) = (
        config.num_attention_heads * hd,
        config.num_key_value_heads * hd,
    );
    match target {
        Target::Query => (heads, h),
        Target::Key | Target::Value => (kv, h),
        Target::Output => (h, heads),
        Target::Gate | Target::Up => (i, h),
        Target::Down => (h, i),
    }
}

/// `B` of a query or key pair with its rows in layout `to`: llama.cpp's
/// converter puts each head's rotary pairs next to each other.
fn relayout(pair: &LowRankPair, heads: usize, from: RopeLayout, to: RopeLayout) -> Result<Tensor> {
    let b = &pair.b;
    let (out, rank) = b.dims2()?;
    let half = out / heads / 2;
    Ok(match (from, to) {
        (RopeLayout::Halves, RopeLayout::Interleaved) => b
            .reshape((heads, 2, half, rank))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((out, rank))?,
        (RopeLayout::Interleaved, RopeLayout::Halves) => b
            .reshape((heads, half, 2, rank))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((out, rank))?,
        _ => b.clone(),
    })
}

/// Which adapter each row of a step runs with, for one layer.
pub(crate) enum RowLoras<'a> {
    None,
    /// Every row, as one product: a session's own step.
    All(&'a LayerLora),
    /// One decode row per session, each through its own adapter alone: a
    /// row's change is then the same bits whatever shares its batch (a
    /// product over several rows may sum in another order, and kept-quantized
    /// weights round the next activations to 8 bits, which makes last-bit
    /// differences visible). The rank is small: a row costs `rank · (in +
    /// out)` multiply-adds, against `in · out` for the base projection.
    Rows(Vec<Option<&'a LayerLora>>),
}

impl<'a> RowLoras<'a> {
    pub(crate) fn all(layer: Option<&'a LayerLora>) -> Self {
        layer.map_or(RowLoras::None, RowLoras::All)
    }

    /// One entry per row of a decode batch.
    pub(crate) fn per_row(rows: Vec<Option<&'a LayerLora>>) -> Self {
        match rows.iter().all(Option::is_none) {
            true => RowLoras::None,
            false => RowLoras::Rows(rows),
        }
    }

    pub(crate) fn is_none(&self) -> bool {
        matches!(self, RowLoras::None)
    }

    /// [`Self::add`] for rows of plain f32 (`x`: `rows` rows; `y`: the
    /// base projection `target` of `x`, `rows` rows too).
    pub(crate) fn add_rows(
        &self,
        target: Target,
        x: &[f32],
        rows: usize,
        y: Vec<f32>,
    ) -> Result<Vec<f32>> {
        if self.is_none() {
            return Ok(y);
        }
        let x = Tensor::from_slice(x, (rows, x.len() / rows), &Device::Cpu)?;
        let width = y.len() / rows;
        let y = Tensor::from_vec(y, (rows, width), &Device::Cpu)?;
        Ok(self.add(target, &x, y)?.flatten_all()?.to_vec1()?)
    }

    /// `y` (the base projection `target` of `x`) plus each row's adapter's change.
    pub(crate) fn add(&self, target: Target, x: &Tensor, y: Tensor) -> Result<Tensor> {
        let pair = |layer: &'a LayerLora| layer.pairs[target.index()].as_ref();
        match self {
            RowLoras::None => Ok(y),
            RowLoras::All(layer) => match pair(layer) {
                Some(pair) => Ok((y + pair.delta(x)?)?),
                None => Ok(y),
            },
            RowLoras::Rows(rows) => {
                if !rows.iter().flatten().any(|layer| pair(layer).is_some()) {
                    return Ok(y);
                }
                let out = rows
                    .iter()
                    .enumerate()
                    .map(|(i, layer)| {
                        let base = y.narrow(0, i, 1)?;
                        match layer.and_then(pair) {
                            Some(pair) => Ok((base + pair.delta(&x.narrow(0, i, 1)?)?)?),
                            None => Ok(base),
                        }
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&out, 0)?)
            }
        }
    }
}
