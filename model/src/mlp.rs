//! The SwiGLU MLP: a dense block's feed-forward, and each expert of a
//! mixture ([`crate::experts`]).

use candle_core::Tensor;

use crate::adapter::Target;
use crate::checkpoint::Weights;
use crate::config::LlamaConfig;
use crate::error::Result;
use crate::linear::{Linear, Projections};
use crate::lora::RowLoras;
use crate::quant::ActivationScratch;

/// The room a step of [`Mlp::forward_rows_into`] reuses.
#[derive(Debug, Default)]
pub(crate) struct MlpScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
    stacked: Vec<f32>,
}

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

    /// [`Self::forward`] of `rows` rows of plain f32 into `out`, with the
    /// same bits, in the room `scratch` keeps between steps.
    pub(crate) fn forward_rows_into(
        &self,
        x: &[f32],
        rows: usize,
        loras: &RowLoras,
        out: &mut Vec<f32>,
        scratch: &mut MlpScratch,
        activations: &mut ActivationScratch,
    ) -> Result<()> {
        let MlpScratch { gate, up, stacked } = scratch;
        self.gate_up
            .forward_rows_into(x, rows, [gate, up], stacked, activations)?;
        *gate = loras.add_rows(Target::Gate, x, rows, std::mem::take(gate))?;
        *up = loras.add_rows(Target::Up, x, rows, std::mem::take(up))?;
        // Candle's SiLU of f32, then the product: the same two roundings
        // (into `gate`, which is read nowhere else).
        let up = &*up;
        crate::quant::parallel::for_parts(gate, 512, |start, part| {
            for (g, &u) in part.iter_mut().zip(&up[start..]) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
        });
        let gated = &*gate;
        self.down_proj
            .forward_rows_into(gated, rows, out, activations)?;
        *out = loras.add_rows(Target::Down, gated, rows, std::mem::take(out))?;
        Ok(())
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
