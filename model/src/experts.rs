//! A mixture of experts (Mixtral, Qwen3-MoE): a router scores every expert
//! for each row, the row goes through the best `per_token` of them, and
//! their outputs are summed with the router's softmax weights.
//!
//! Rows are grouped by expert, so each expert's weights are read once per
//! step for every row of a batch that chose it, whichever sessions the rows
//! belong to; a row's sum runs over its experts in index order, so its
//! output does not depend on what else is in the batch.

use candle_core::{DType, Tensor};

use crate::checkpoint::Weights;
use crate::config::{ExpertConfig, LlamaConfig};
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::lora::RowLoras;
use crate::mlp::Mlp;

#[derive(Debug, Clone)]
pub(crate) struct Experts {
    router: Linear,
    experts: Vec<Mlp>,
    per_token: usize,
    normalize: bool,
}

/// How a checkpoint names a layer's experts: Hugging Face folders hold one
/// tensor per expert and projection, GGUF files one stack per projection.
struct Naming {
    block: &'static str,
    /// Gate, up and down.
    projections: [&'static str; 3],
}

const MIXTRAL: Naming = Naming {
    block: "block_sparse_moe",
    projections: ["w1", "w3", "w2"],
};

const QWEN3_MOE: Naming = Naming {
    block: "mlp",
    projections: ["gate_proj", "up_proj", "down_proj"],
};

impl Experts {
    pub(crate) fn multiplied_by_candle(&self) -> bool {
        self.router.multiplied_by_candle() || self.experts.iter().any(Mlp::multiplied_by_candle)
    }

    pub(crate) fn load(layer: &Weights, cfg: &LlamaConfig, spec: &ExpertConfig) -> Result<Self> {
        let (h, i, count) = (cfg.hidden_size, spec.intermediate_size, spec.count);
        let naming = if layer.contains(&format!("{}.gate.weight", MIXTRAL.block)) {
            MIXTRAL
        } else {
            QWEN3_MOE
        };
        let block = layer.pp(naming.block);
        let router = Linear::load(&block.pp("gate"), count, h, false)?;
        let shapes = [[i, h], [i, h], [h, i]];
        let stacked = block.pp("experts");
        let experts = if stacked.contains("gate_proj.weight") {
            // One `[count, rows, columns]` tensor per projection (GGUF).
            let mut dense: [Option<Tensor>; 3] = Default::default();
            let mut experts = Vec::with_capacity(count);
            for e in 0..count {
                let mut linears = Vec::with_capacity(3);
                for (k, name) in QWEN3_MOE.projections.iter().enumerate() {
                    let w = stacked.pp(name);
                    let [rows, columns] = shapes[k];
                    let shape = [count, rows, columns];
                    linears.push(match w.get_quantized_part("weight", e, &shape)? {
                        Some(q) => Linear::quantized(q, None)?,
                        None => {
                            if dense[k].is_none() {
                                dense[k] = Some(w.get("weight", &shape)?);
                            }
                            let all = dense[k].as_ref().ok_or(ModelError::MissingTensor {
                                name: format!("{name} of the experts"),
                            })?;
                            Linear::dense(all.get(e)?.contiguous()?, None)
                        }
                    });
                }
                let [gate, up, down]: [Linear; 3] = linears
                    .try_into()
                    .map_err(|_| ModelError::InvalidConfig("three projections".into()))?;
                experts.push(Mlp::new(gate, up, down)?);
            }
            experts
        } else {
            (0..count)
                .map(|e| {
                    let w = stacked.pp(e);
                    let [gate, up, down] = naming.projections;
                    Mlp::new(
                        Linear::load(&w.pp(gate), i, h, false)?,
                        Linear::load(&w.pp(up), i, h, false)?,
                        Linear::load(&w.pp(down), h, i, false)?,
                    )
                })
                .collect::<Result<Vec<_>>>()?
        };
        Ok(Experts {
            router,
            experts,
            per_token: spec.per_token,
            normalize: spec.normalize,
        })
    }

    /// `x`: rows of the hidden size, under any leading dimensions.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let hidden = dims.last().copied().unwrap_or(0);
        let rows = x.reshape((x.elem_count() / hidden.max(1), hidden))?;
        let scores = self
            .router
            .forward(&rows)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        // For each expert, the rows that chose it and their weights.
        let mut chosen: Vec<(Vec<u32>, Vec<f32>)> = vec![Default::default(); self.experts.len()];
        for (row, scores) in scores.iter().enumerate() {
            for (expert, weight) in route(scores, self.per_token, self.normalize) {
                chosen[expert].0.push(row as u32);
                chosen[expert].1.push(weight);
            }
        }
        let mut out = rows.zeros_like()?;
        for (expert, (ids, weights)) in self.experts.iter().zip(&chosen) {
            if ids.is_empty() {
                continue;
            }
            let ids = Tensor::new(ids.as_slice(), rows.device())?;
            let y = expert.forward(&rows.index_select(&ids, 0)?, &RowLoras::None)?;
            let weights = Tensor::new(weights.as_slice(), rows.device())?
                .to_dtype(y.dtype())?
                .unsqueeze(1)?;
            out = out.index_add(&ids, &y.broadcast_mul(&weights)?, 0)?;
        }
        Ok(out.reshape(dims)?)
    }
}

/// The experts a row goes to, best first, with their weights: the softmax
/// of the router's scores over every expert, the `per_token` largest kept
/// (the lower index first on a tie) and, with `normalize`, rescaled to sum to 1.
fn route(scores: &[f32], per_token: usize, normalize: bool) -> Vec<(usize, f32)> {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
    order.truncate(per_token);
    let mut picked: Vec<(usize, f32)> = order.into_iter().map(|e| (e, exps[e] / sum)).collect();
    if normalize {
        let total: f32 = picked.iter().map(|(_, w)| w).sum();
        for (_, w) in &mut picked {
            *w /= total;
        }
    }
    picked
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn a_row_goes_to_its_best_experts_with_softmax_weights() {
        let scores = [0.0f32, 2.0, 1.0, 2.0_f32.ln() + 1.0];
        let picked = route(&scores, 2, false);
        let z: f32 = [0.0f32, 2.0, 1.0, 2.0_f32.ln() + 1.0]
            .iter()
            .map(|s| s.exp())
            .sum();
        assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 3]);
        assert!((picked[0].1 - 2.0f32.exp() / z).abs() < 1e-6);
        assert!((picked[1].1 - 2.0 * 1.0f32.exp() / z).abs() < 1e-6);
        let normalized = route(&scores, 2, true);
        let e2 = 2.0f32.exp();
        let e3 = 2.0 * 1.0f32.exp();
        assert!((normalized[0].1 - e2 / (e2 + e3)).abs() < 1e-6);
        assert!((normalized[1].1 - e3 / (e2 + e3)).abs() < 1e-6);
        // A tie goes to the lower index.
        assert_eq!(route(&[1.0, 1.0, 0.0], 1, true), vec![(0, 1.0)]);
    }
}
