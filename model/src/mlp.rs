//! The SwiGLU MLP: a dense block's feed-forward, and each expert of a
//! mixture ([`crate::experts`]).

use candle_core::Tensor;

use crate::adapter::Target;
use crate::checkpoint::Weights;
use crate::config::LlamaConfig;
use crate::error::Result;
use crate::linear::{Linear, Projections};
use crate::lora::RowLoras;

/// `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub(crate) struct Mlp {
    /// Gate and up.
    gate_up: Projections<2>,
    down_proj: Linear,
}

impl Mlp {
    pub(crate) fn load(w: &Weights, cfg: &LlamaConfig) -> Result<Self> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Self::new(
            Linear::load(&w.pp("gate_proj"), i, h, bias)?,
            Linear::load(&w.pp("up_proj"), i, h, bias)?,
            Linear::load(&w.pp("down_proj"), h, i, bias)?,
        )
    }

    pub(crate) fn new(gate: Linear, up: Linear, down: Linear) -> Result<Self> {
        Ok(Mlp {
            gate_up: Projections::new([gate, up])?,
            down_proj: down.interleaved()?,
        })
    }

    pub(crate) fn multiplied_by_candle(&self) -> bool {
        self.gate_up.multiplied_by_candle() || self.down_proj.multiplied_by_candle()
    }

    /// [`Self::forward`] of `rows` rows of plain f32, with the same bits.
    pub(crate) fn forward_rows(
        &self,
        x: &[f32],
        rows: usize,
        loras: &RowLoras,
    ) -> Result<Vec<f32>> {
        let [gate, up] = self.gate_up.forward_rows(x, rows)?;
        let gate = loras.add_rows(Target::Gate, x, rows, gate)?;
        let up = loras.add_rows(Target::Up, x, rows, up)?;
        // Candle's SiLU of f32, then the product: the same two roundings.
        let mut gated = vec![0f32; gate.len()];
        crate::quant::parallel::for_parts(&mut gated, 512, |start, part| {
            let (gate, up) = (&gate[start..], &up[start..]);
            for ((out, &g), &u) in part.iter_mut().zip(gate).zip(up) {
                *out = g / (1.0 + (-g).exp()) * u;
            }
        });
        let down = self.down_proj.forward_rows(&gated, rows)?;
        loras.add_rows(Target::Down, &gated, rows, down)
    }

    pub(crate) fn forward(&self, x: &Tensor, loras: &RowLoras) -> Result<Tensor> {
        let [gate, up] = self.gate_up.forward(x)?;
        let gate = loras.add(Target::Gate, x, gate)?;
        let up = loras.add(Target::Up, x, up)?;
        let gated = (candle_nn::ops::silu(&gate)? * up)?;
        let down = self.down_proj.forward(&gated)?;
        loras.add(Target::Down, &gated, down)
    }
}
