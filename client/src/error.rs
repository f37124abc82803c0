//! The client crate's error type.

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Model(#[from] corolla_model::ModelError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("the prompt is empty after tokenization")]
    EmptyPrompt,
    #[error("prompt of {prompt} tokens plus {new} new tokens exceeds the model's {max} positions")]
    TooLong {
        prompt: usize,
        new: usize,
        max: usize,
    },
}
