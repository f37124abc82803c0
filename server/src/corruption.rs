//! `--corrupt-outputs` and `--corrupt-pushes`, testing aids: plausible but
//! wrong activations, what clients' spot checks and push proofs must catch.

use corolla_model::wire::{from_view, to_payload};
use corolla_model::{DType, Tensor};
use corolla_shared::TensorPayload;

/// `--corrupt-pushes`: `payload` with noise added, as it would go on the wire.
pub(crate) fn with_noise(
    payload: &TensorPayload,
    device: &corolla_model::Device,
) -> corolla_model::Result<TensorPayload> {
    let y = from_view(&payload.decompressed().view(), device)?;
    let noisy = add_noise(&y)?;
    Ok(to_payload(&noisy, payload.dtype)?.compressed(payload.compression))
}

/// `--corrupt-outputs`: plausible but wrong activations, `y` plus Gaussian
/// noise of a tenth of its root mean square.
pub(crate) fn add_noise(y: &Tensor) -> corolla_model::Result<Tensor> {
    let rms = y
        .to_dtype(DType::F32)?
        .sqr()?
        .mean_all()?
        .sqrt()?
        .to_scalar::<f32>()?;
    let noise = Tensor::randn(0f32, 0.1 * rms.max(1e-3), y.shape(), y.device())?;
    Ok((y + noise.to_dtype(y.dtype())?)?)
}
