//! The names of the tensors outside the decoder blocks, as Hugging Face
//! checkpoints spell them (GGUF names are mapped to these on load).

pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";
