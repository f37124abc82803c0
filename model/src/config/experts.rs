//! Mixture-of-experts settings (Mixtral, Qwen3-MoE), read from a config and checked.

use serde::{Deserialize, Serialize};

use super::{Family, RawConfig};
use crate::error::{ModelError, Result};

/// A mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): each token goes
/// through `per_token` of `count` SwiGLU experts, weighted by the router's
/// softmax over all of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertConfig {
    pub count: usize,
    pub per_token: usize,
    /// Each expert's FFN width.
    pub intermediate_size: usize,
    /// The chosen experts' weights rescaled to sum to 1 (Mixtral always;
    /// Qwen3-MoE with `norm_topk_prob`).
    pub normalize: bool,
}

/// The most experts a layer may declare (Qwen3-MoE has 128).
pub const MAX_EXPERTS: usize = 1024;

/// The mixture of experts a config declares, checked.
pub(super) fn experts_of(raw: &RawConfig, family: Family) -> Result<Option<ExpertConfig>> {
    let moe_family = matches!(family, Family::Mixtral | Family::Qwen3Moe);
    let count = raw.num_local_experts.or(raw.num_experts).unwrap_or(0);
    if count == 0 {
        if moe_family {
            return Err(ModelError::InvalidConfig(format!(
                "{} without experts (num_local_experts)",
                family.architecture()
            )));
        }
        return Ok(None);
    }
    if !moe_family {
        return Err(ModelError::InvalidConfig(format!(
            "{} has no experts, but the config declares {count}",
            family.architecture()
        )));
    }
    let invalid = |m: String| Err(ModelError::InvalidConfig(m));
    if count > MAX_EXPERTS {
        return invalid(format!("{count} experts (at most {MAX_EXPERTS})"));
    }
    let per_token = raw.num_experts_per_tok.unwrap_or(2);
    if per_token == 0 || per_token > count {
        return invalid(format!(
            "num_experts_per_tok {per_token} must be 1 to {count}"
        ));
    }
    // Qwen3-MoE can interleave dense and sparse blocks; its released models do not.
    if raw.decoder_sparse_step.unwrap_or(1) != 1 || !raw.mlp_only_layers.is_empty() {
        return invalid(
            "dense blocks between expert blocks (decoder_sparse_step, mlp_only_layers) are not supported"
                .into(),
        );
    }
    let intermediate_size = match family {
        Family::Qwen3Moe => raw.moe_intermediate_size.unwrap_or(raw.intermediate_size),
        _ => raw.intermediate_size,
    };
    if intermediate_size == 0 {
        return invalid("the experts' intermediate size must be positive".into());
    }
    Ok(Some(ExpertConfig {
        count,
        per_token,
        intermediate_size,
        normalize: family == Family::Mixtral || raw.norm_topk_prob.unwrap_or(false),
    }))
}
