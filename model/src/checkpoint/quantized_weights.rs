//! What a checkpoint does with quantized (GGUF) weights at load.

/// What happens to quantized (GGUF) weights at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantizedWeights {
    /// Dequantize models whose float32 weights take at most
    /// [`AUTO_DEQUANTIZE_LIMIT`] bytes, keep larger ones quantized. Decided
    /// by the model alone, so every server of a model computes alike.
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

/// Models up to this many bytes of float32 weights are dequantized by [`QuantizedWeights::Auto`].
pub const AUTO_DEQUANTIZE_LIMIT: u64 = 2 << 30;
