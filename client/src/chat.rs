//! Chat prompts: a conversation rendered by the model's own Jinja chat
//! template (as transformers' `apply_chat_template` does), or by a built-in
//! ChatML or Llama 2 template for models that ship none.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::ClientError;
use crate::text::TextTokenizer;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// ChatML (`<|im_start|>role ... <|im_end|>`), for models whose vocabulary has it.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Llama 2 chat: `[INST]` turns, the system prompt inside the first one.
pub const LLAMA2_TEMPLATE: &str = "{% if messages[0]['role'] == 'system' %}\
{% set system = '<<SYS>>\\n' + messages[0]['content'] | trim + '\\n<</SYS>>\\n\\n' %}\
{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}\
{% for message in messages %}\
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\
{% if message['role'] == 'user' %}\
{{ bos_token + '[INST] ' + (system if loop.first else '') + message['content'] | trim + ' [/INST]' }}\
{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}\
{% endfor %}";

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Where the template came from: `model`, `chatml` or `llama2`.
    pub kind: &'static str,
}

fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("kind", &self.kind)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`, or a fallback when the model has no template:
    /// ChatML when the vocabulary has `<|im_start|>`, else Llama 2.
    pub fn new(
        source: Option<&str>,
        tokenizer: &TextTokenizer,
        bos_token_id: Option<u32>,
        eos_token_id: Option<u32>,
    ) -> Result<Self, ClientError> {
        let (source, kind) = match source {
            Some(s) => (s.to_string(), "model"),
            None if tokenizer.token_to_id("<|im_start|>").is_some() => {
                (CHATML_TEMPLATE.to_string(), "chatml")
            }
            None => (LLAMA2_TEMPLATE.to_string(), "llama2"),
        };
        let token = |id: Option<u32>| {
            id.and_then(|i| tokenizer.id_to_token(i))
                .unwrap_or_default()
        };
        let mut env = Environment::new();
        // Templates are written for Python's Jinja: `.strip()`, `.items()`, …
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| ClientError::Tokenizer(format!("invalid chat template: {e}")))?;
        Ok(ChatTemplate {
            env,
            bos_token: token(bos_token_id),
            eos_token: token(eos_token_id),
            kind,
        })
    }

    /// The prompt for `messages`; with `add_generation_prompt`, it ends
    /// where the assistant's answer begins.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ClientError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ClientError::Tokenizer(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| ClientError::Tokenizer(format!("chat template: {e}")))
    }
}
