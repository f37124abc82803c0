//! The user's choice of compute dtype.

use std::str::FromStr;

use candle_core::{DType, Device};

use crate::config::LlamaConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelDType {
    /// The checkpoint's own dtype where the device computes it well: on CPU,
    /// f16 checkpoints run in f16 and everything else in f32 (bf16 has no
    /// fast CPU path and diverges from the reference sooner).
    #[default]
    Auto,
    F32,
    F16,
    BF16,
}

impl ModelDType {
    pub fn resolve(self, config: &LlamaConfig, device: &Device) -> DType {
        match self {
            ModelDType::F32 => DType::F32,
            ModelDType::F16 => DType::F16,
            ModelDType::BF16 => DType::BF16,
            ModelDType::Auto => match (config.torch_dtype.as_deref(), device.is_cpu()) {
                (Some("float16"), _) => DType::F16,
                (Some("bfloat16"), false) => DType::BF16,
                _ => DType::F32,
            },
        }
    }
}

impl FromStr for ModelDType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(ModelDType::Auto),
            "f32" | "float32" => Ok(ModelDType::F32),
            "f16" | "float16" => Ok(ModelDType::F16),
            "bf16" | "bfloat16" => Ok(ModelDType::BF16),
            other => Err(format!(
                "unknown dtype {other:?}; expected auto, f32, f16 or bf16"
            )),
        }
    }
}
