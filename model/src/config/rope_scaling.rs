//! A config's rotary scaling (`rope_scaling`, or `rope_parameters` in
//! transformers 5), read and checked.

use serde::Deserialize;

use super::{RopeScaling, CUSTOM_DIVISORS};
use crate::error::{ModelError, Result};

#[derive(Debug, Deserialize)]
pub(super) struct RawRope {
    pub(super) rope_theta: Option<f64>,
    pub(super) rope_type: Option<String>,
    #[serde(rename = "type")]
    pub(super) legacy_type: Option<String>,
    pub(super) factor: Option<f64>,
    pub(super) low_freq_factor: Option<f64>,
    pub(super) high_freq_factor: Option<f64>,
    pub(super) original_max_position_embeddings: Option<usize>,
    pub(super) divisors: Option<Vec<f64>>,
}

pub(super) fn parse_rope_scaling(r: &RawRope, max_positions: usize) -> Result<RopeScaling> {
    let kind = r
        .rope_type
        .as_deref()
        .or(r.legacy_type.as_deref())
        .unwrap_or("default");
    let factor = || {
        r.factor
            .filter(|f| f.is_finite() && *f > 0.0)
            .ok_or_else(|| {
                ModelError::InvalidConfig(format!("rope type {kind:?} needs a positive factor"))
            })
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
        "llama3" => {
            let low = r.low_freq_factor.unwrap_or(1.0);
            let high = r.high_freq_factor.unwrap_or(4.0);
            if !(low > 0.0 && high > low) {
                return Err(ModelError::InvalidConfig(format!(
                    "llama3 rope needs 0 < low_freq_factor ({low}) < high_freq_factor ({high})"
                )));
            }
            Ok(RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: r
                    .original_max_position_embeddings
                    .unwrap_or(max_positions),
            })
        }
        CUSTOM_DIVISORS => {
            let divisors = r.divisors.clone().unwrap_or_default();
            if divisors.iter().any(|d| !(d.is_finite() && *d > 0.0)) {
                return Err(ModelError::InvalidConfig(
                    "rope divisors must be positive".into(),
                ));
            }
            Ok(RopeScaling::Divisors(divisors))
        }
        other => Err(ModelError::InvalidConfig(format!(
            "rope scaling type {other:?} is not supported (supported: default, linear, llama3)"
        ))),
    }
}
