//! The view of a checkpoint that model components load from.

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};

use super::Checkpoint;
use crate::error::Result;
use crate::rope::RopeLayout;

/// A view of a checkpoint under a name prefix, in a target dtype and device:
/// what model components take in their `load` functions.
#[derive(Clone)]
pub struct Weights<'a> {
    checkpoint: &'a Checkpoint,
    prefix: String,
    dtype: DType,
    device: Device,
}

impl<'a> Weights<'a> {
    /// Every tensor of `checkpoint`, in `dtype` on `device`.
    pub(super) fn new(checkpoint: &'a Checkpoint, dtype: DType, device: &Device) -> Self {
        Weights {
            checkpoint,
            prefix: String::new(),
            dtype,
            device: device.clone(),
        }
    }

    pub fn pp(&self, name: impl std::fmt::Display) -> Weights<'a> {
        let prefix = if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        };
        Weights {
            prefix,
            ..self.clone()
        }
    }

    fn full_name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.checkpoint
            .tensor(&self.full_name(name), shape, self.dtype, &self.device)
    }

    /// The weight quantized as stored, when it is and the checkpoint keeps it so.
    pub fn get_quantized(&self, name: &str, shape: &[usize]) -> Result<Option<QTensor>> {
        self.checkpoint
            .quantized_tensor(&self.full_name(name), shape, &self.device)
    }

    /// Matrix `index` of a stacked weight (`shape`: `[count, rows, columns]`)
    /// quantized as stored, when it is and the checkpoint keeps it so.
    pub fn get_quantized_part(
        &self,
        name: &str,
        index: usize,
        shape: &[usize],
    ) -> Result<Option<QTensor>> {
        self.checkpoint
            .quantized_part(&self.full_name(name), index, shape, &self.device)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.checkpoint.contains(&self.full_name(name))
    }

    pub fn rope_layout(&self) -> RopeLayout {
        self.checkpoint.rope_layout()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }
}
