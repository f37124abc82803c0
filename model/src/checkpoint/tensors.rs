//! One tensor of a checkpoint: found through the weight map, its file mapped
//! on first use, loaded dense in the compute dtype or kept quantized.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};
use safetensors::Dtype as StDtype;

use crate::weight_file::{RawDType, RawTensor, WeightFile};

use super::Checkpoint;

impl Checkpoint {
    /// The raw bytes and metadata of one tensor, mapping its file if needed.
    pub fn raw_tensor(&self, name: &str) -> Result<RawTensor> {
        let file_name = self
            .weight_map
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        let file = self.mapped(file_name)?;
        WeightFile::raw_tensor(&file, name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })
    }

    pub(super) fn mapped(&self, file_name: &str) -> Result<Arc<WeightFile>> {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = files.get(file_name) {
            return Ok(f.clone());
        }
        let path = self.dir.join(file_name);
        tracing::debug!(path = %path.display(), "mapping weight file");
        let f = Arc::new(WeightFile::open(&path)?);
        files.insert(file_name.to_string(), f.clone());
        Ok(f)
    }

    /// Loads one tensor, checks its shape and converts it to `dtype` on `device`.
    pub fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let raw = self.raw_tensor(name)?;
        check_shape(name, &raw.shape, shape)?;
        let st_dtype = match raw.dtype {
            RawDType::Safetensors(t) => t,
            RawDType::Ggml(_) => {
                let q = self.qtensor_of(&raw, name, device)?;
                return Ok(q
                    .dequantize(device)
                    .map_err(|e| ModelError::invalid_file(&self.dir, format!("{name}: {e}")))?
                    .to_dtype(dtype)?);
            }
        };
        let src_dtype = match st_dtype {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::UnsupportedTensorDType {
                    name: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let t = Tensor::from_raw_buffer(raw.data(), src_dtype, &raw.shape, device)?;
        Ok(t.to_dtype(dtype)?)
    }

    fn qtensor_of(&self, raw: &RawTensor, name: &str, device: &Device) -> Result<QTensor> {
        match (raw.file.as_ref(), raw.dtype) {
            (WeightFile::Gguf(g), RawDType::Ggml(_)) => g.qtensor(name, device),
            _ => Err(ModelError::UnsupportedTensorDType {
                name: name.into(),
                dtype: format!("{:?} (not a GGUF tensor)", raw.dtype),
            }),
        }
    }

    /// A GGUF tensor exactly as stored, whatever the dequantize setting.
    pub fn stored_qtensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        let raw = self.raw_tensor(name)?;
        self.qtensor_of(&raw, name, device)
    }

    /// The tensor in its stored quantization, when it is quantized and the
    /// checkpoint keeps quantized weights; `None` means "use [`Self::tensor`]".
    pub fn quantized_tensor(
        &self,
        name: &str,
        shape: &[usize],
        device: &Device,
    ) -> Result<Option<QTensor>> {
        match self.kept_quantized(name, shape)? {
            Some(raw) => self.qtensor_of(&raw, name, device).map(Some),
            None => Ok(None),
        }
    }

    /// `name` as stored, when it is quantized and the checkpoint keeps it so.
    fn kept_quantized(&self, name: &str, shape: &[usize]) -> Result<Option<RawTensor>> {
        if self.dequantize {
            return Ok(None);
        }
        let raw = self.raw_tensor(name)?;
        if !raw.dtype.is_quantized() {
            return Ok(None);
        }
        check_shape(name, &raw.shape, shape)?;
        Ok(Some(raw))
    }

    /// Matrix `index` of the stacked tensor `name` (`shape`: `[count, rows,
    /// columns]`, each expert's projection in a GGUF) in its stored
    /// quantization, when it is quantized and kept so; `None` means "use
    /// [`Self::tensor`] for the whole stack".
    pub fn quantized_part(
        &self,
        name: &str,
        index: usize,
        shape: &[usize],
        device: &Device,
    ) -> Result<Option<QTensor>> {
        let Some(raw) = self.kept_quantized(name, shape)? else {
            return Ok(None);
        };
        match raw.file.as_ref() {
            WeightFile::Gguf(g) => g.qtensor_part(name, index, device).map(Some),
            _ => Ok(None),
        }
    }
}

fn check_shape(name: &str, actual: &[usize], expected: &[usize]) -> Result<()> {
    if actual != expected {
        return Err(ModelError::WrongShape {
            name: name.into(),
            expected: expected.to_vec(),
            actual: actual.to_vec(),
        });
    }
    Ok(())
}
