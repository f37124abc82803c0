//! Conversions between candle tensors and wire payloads.

use candle_core::{DType, Device, Tensor};
use corolla_shared::{Compression, TensorPayload, TensorView, WireDType};

use crate::error::{ModelError, Result};

pub fn wire_dtype(dtype: DType) -> Result<WireDType> {
    match dtype {
        DType::F32 => Ok(WireDType::F32),
        DType::F16 => Ok(WireDType::F16),
        DType::BF16 => Ok(WireDType::BF16),
        other => Err(ModelError::InvalidConfig(format!(
            "dtype {other:?} cannot cross the wire"
        ))),
    }
}

pub fn candle_dtype(dtype: WireDType) -> DType {
    match dtype {
        WireDType::F32 => DType::F32,
        WireDType::F16 => DType::F16,
        WireDType::BF16 => DType::BF16,
    }
}

/// Converts `tensor` to `dtype` and copies its bytes out, little-endian.
pub fn to_payload(tensor: &Tensor, dtype: WireDType) -> Result<TensorPayload> {
    let t = tensor.to_dtype(candle_dtype(dtype))?.flatten_all()?;
    let data: Vec<u8> = match dtype {
        WireDType::F32 => t
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        WireDType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        WireDType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    };
    TensorPayload::new(dtype, tensor.dims().to_vec(), data)
        .map_err(|e| ModelError::InvalidConfig(e.to_string()))
}

/// Builds a tensor from received bytes (one copy, into the tensor's
/// storage; compressed bytes are decompressed first).
pub fn from_view(view: &TensorView<'_>, device: &Device) -> Result<Tensor> {
    if view.compression != Compression::None {
        let plain = view.to_owned().decompressed();
        return from_view(&plain.view(), device);
    }
    Ok(Tensor::from_raw_buffer(
        view.data,
        candle_dtype(view.dtype),
        &view.shape,
        device,
    )?)
}
