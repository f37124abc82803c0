//! What a checkpoint does with quantized (GGUF) weights at load.

/// What happens to quantized (GGUF) weights at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantizedWeights {
    /// Corolla's choice for the model: today the same as [`Self::Keep`] for
    /// every GGUF, the faster path on CPU (a decode step of the default
    /// model's Q4_1 blocks: 2.9 ms kept, 18.6 ms dequantized) and ~4x less
    /// memory. Decided by the model alone, never by the machine, so every
    /// server of a model computes alike.
    #[default]
    Auto,
    /// Keep weights quantized: least memory; activations are quantized for
    /// each product (as llama.cpp does), an approximation of the float math.
    Keep,
    /// Dense weights in the compute dtype: float-exact math, more memory.
    Dequantize,
}

impl QuantizedWeights {
    /// The choice as `--quantized` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Keep => "keep",
            Self::Dequantize => "dequantize",
        }
    }

    /// Whether quantized weights are loaded dense.
    pub fn dequantizes(self) -> bool {
        match self {
            Self::Auto | Self::Keep => false,
            Self::Dequantize => true,
        }
    }
}

impl std::str::FromStr for QuantizedWeights {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        [Self::Auto, Self::Keep, Self::Dequantize]
            .into_iter()
            .find(|choice| choice.as_str() == s)
            .ok_or_else(|| format!("{s:?} is not one of auto, keep, dequantize"))
    }
}
