//! Rotary position embeddings in the Hugging Face (rotate-half) layout or
//! GGUF's interleaved one, with the "linear" and "llama3" frequency scalings.

use std::f64::consts::PI;

use candle_core::{DType, Device, Tensor};

use crate::config::{LlamaConfig, RopeScaling};
use crate::error::{ModelError, Result};

/// Which dimensions of a head rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Hugging Face: dimension `i` pairs with `i + head_dim / 2`.
    Halves,
    /// GGUF (llama.cpp permutes Q/K rows): dimension `2i` pairs with `2i + 1`.
    Interleaved,
}

/// Precomputed cos/sin tables for every position the model supports.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    cos: Tensor,
    sin: Tensor,
    max_positions: usize,
    layout: RopeLayout,
}

fn inverse_frequencies(cfg: &LlamaConfig) -> Vec<f64> {
    let dim = cfg.head_dim;
    let base: Vec<f64> = (0..dim / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / dim as f64))
        .collect();
    match cfg.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Divisors(ref divisors) => {
            base.into_iter().zip(divisors).map(|(f, d)| f / d).collect()
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old_context = original_max_position_embeddings as f64;
            let low_freq_wavelen = old_context / low_freq_factor;
            let high_freq_wavelen = old_context / high_freq_factor;
            base.into_iter()
                .map(|freq| {
                    let wavelen = 2.0 * PI / freq;
                    if wavelen < high_freq_wavelen {
                        freq
                    } else if wavelen > low_freq_wavelen {
                        freq / factor
                    } else {
                        let smooth = (old_context / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                })
                .collect()
        }
    }
}

/// The divisor of each inverse frequency that `cfg`'s scaling amounts to:
/// what a GGUF file stores as its `rope_freqs` tensor (llama.cpp writes
/// llama3 scaling that way).
pub fn frequency_divisors(cfg: &LlamaConfig) -> Vec<f64> {
    let plain = LlamaConfig {
        rope_scaling: RopeScaling::None,
        ..cfg.clone()
    };
    inverse_frequencies(&plain)
        .into_iter()
        .zip(inverse_frequencies(cfg))
        .map(|(p, s)| p / s)
        .collect()
}

impl Rope {
    pub fn new(
        cfg: &LlamaConfig,
        layout: RopeLayout,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let inv_freq = inverse_frequencies(cfg);
        let half = inv_freq.len();
        let positions = cfg.max_position_embeddings;
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for &f in &inv_freq {
                // The reference computes angles in f32; so do we, so that
                // long positions round the same way.
                let angle = (p as f32) * (f as f32);
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (positions, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (positions, half), device)?.to_dtype(dtype)?;
        Ok(Rope {
            cos,
            sin,
            max_positions: positions,
            layout,
        })
    }

    /// Rotates, in place, rows of `heads` heads (`x`: `[rows, heads,
    /// head_dim]` of plain f32), row `i` at `positions[i]`, with candle's
    /// arithmetic (the same bits as [`Self::apply`]).
    pub fn rotate_rows(&self, x: &mut [f32], positions: &[usize], heads: usize) -> Result<()> {
        if let Some(&p) = positions.iter().find(|&&p| p >= self.max_positions) {
            return Err(ModelError::MaxLengthTooLarge {
                requested: p + 1,
                max: self.max_positions,
            });
        }
        let (cos_guard, cos_layout) = self.cos.storage_and_layout();
        let (sin_guard, sin_layout) = self.sin.storage_and_layout();
        let (cos, sin) = (
            f32_table(&cos_guard, cos_layout)?,
            f32_table(&sin_guard, sin_layout)?,
        );
        let half = cos_layout.dims()[1];
        let d = 2 * half;
        for (row, &p) in x.chunks_exact_mut(heads * d).zip(positions) {
            let (cos, sin) = (
                &cos[p * half..(p + 1) * half],
                &sin[p * half..(p + 1) * half],
            );
            for head in row.chunks_exact_mut(d) {
                for i in 0..half {
                    let (i1, i2) = match self.layout {
                        RopeLayout::Halves => (i, i + half),
                        RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (x1, x2) = (head[i1], head[i2]);
                    head[i1] = x1 * cos[i] - x2 * sin[i];
                    head[i2] = x1 * sin[i] + x2 * cos[i];
                }
            }
        }
        Ok(())
    }

    /// Which dimensions of a head rotate together.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// Rotates `x` of shape `[batch, heads, t, head_dim]` whose first
    /// position is `start`.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let t = x.dim(2)?;
        if start + t > self.max_positions {
            return Err(ModelError::MaxLengthTooLarge {
                requested: start + t,
                max: self.max_positions,
            });
        }
        let cos = self.cos.narrow(0, start, t)?;
        let sin = self.sin.narrow(0, start, t)?;
        self.rotate(x, &cos, &sin)
    }

    /// The rotation of one position for each row of a batch: `cos` and
    /// `sin` of shape `[B, 1, head_dim / 2]`, for [`Self::apply_rows`].
    pub fn rows_at(&self, positions: &[usize]) -> Result<(Tensor, Tensor)> {
        if let Some(&p) = positions.iter().find(|&&p| p >= self.max_positions) {
            return Err(ModelError::MaxLengthTooLarge {
                requested: p + 1,
                max: self.max_positions,
            });
        }
        let ids: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let ids = Tensor::from_vec(ids, positions.len(), self.cos.device())?;
        let half = self.cos.dim(1)?;
        let pick = |table: &Tensor| -> Result<Tensor> {
            Ok(table
                .index_select(&ids, 0)?
                .reshape((positions.len(), 1, half))?)
        };
        Ok((pick(&self.cos)?, pick(&self.sin)?))
    }

    /// Rotates `x` (`[B, heads, 1, head_dim]`), row `i` by `rows`' row `i`.
    pub fn apply_rows(&self, x: &Tensor, rows: &(Tensor, Tensor)) -> Result<Tensor> {
        self.rotate(x, &rows.0, &rows.1)
    }

    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        Ok(match self.layout {
            RopeLayout::Halves => candle_nn::rotary_emb::rope(&x, cos, sin)?,
            RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i(&x, cos, sin)?,
        })
    }
}

/// A CPU tensor's f32 values, read in place.
fn f32_table<'a>(
    storage: &'a candle_core::Storage,
    layout: &candle_core::Layout,
) -> Result<&'a [f32]> {
    match storage {
        candle_core::Storage::Cpu(cpu) if layout.is_contiguous() => {
            let all = cpu.as_slice::<f32>()?;
            let start = layout.start_offset();
            all.get(start..start + layout.shape().elem_count())
                .ok_or_else(|| {
                    ModelError::InvalidConfig("a rotation table out of its storage".into())
                })
        }
        _ => Err(ModelError::InvalidConfig(
            "rotation tables off the CPU or not f32".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let mut cfg = crate::config::LlamaConfig::from_json(
            r#"{"hidden_size":1024,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":8,"vocab_size":8,"rope_theta":500000.0,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
            "high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        )
        .unwrap();
        let scaled = inverse_frequencies(&cfg);
        cfg.rope_scaling = RopeScaling::None;
        let plain = inverse_frequencies(&cfg);
        assert_eq!(scaled[0], plain[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-18);
        assert!(scaled
            .iter()
            .zip(&plain)
            .all(|(s, p)| s <= p && *s >= p / 8.0));
        cfg.rope_scaling = scaled_cfg_scaling();
        let divided = LlamaConfig {
            rope_scaling: RopeScaling::Divisors(frequency_divisors(&cfg)),
            ..cfg.clone()
        };
        for (d, s) in inverse_frequencies(&divided).iter().zip(&scaled) {
            assert!((d - s).abs() <= 1e-12 * s, "{d} vs {s}");
        }
    }

    fn scaled_cfg_scaling() -> RopeScaling {
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }
    }
}
