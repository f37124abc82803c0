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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_tokenizer::tests::spm;

    fn conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "Be brief. "),
            ChatMessage::user("Hi"),
            ChatMessage::assistant("Hello"),
            ChatMessage::user(" Again"),
        ]
    }

    #[test]
    fn llama2_is_the_fallback_without_chatml_tokens() {
        let tok = TextTokenizer::from_gguf(&spm(&[])).unwrap();
        let t = ChatTemplate::new(None, &tok, Some(1), Some(2)).unwrap();
        assert_eq!(t.kind, "llama2");
        assert_eq!(
            t.render(&conversation(), true).unwrap(),
            "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello </s><s>[INST] Again [/INST]"
        );
        let err = t
            .render(&[ChatMessage::assistant("first")], true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("alternate"), "{err}");
    }

    #[test]
    fn chatml_is_the_fallback_when_the_vocabulary_has_it() {
        let tok = TextTokenizer::from_gguf(&spm(&["<|im_start|>", "<|im_end|>"])).unwrap();
        let t = ChatTemplate::new(None, &tok, Some(1), Some(2)).unwrap();
        assert_eq!(t.kind, "chatml");
        assert_eq!(
            t.render(&conversation()[1..2], true).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(&conversation()[1..2], false).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn model_templates_get_python_methods_and_special_tokens() {
        let tok = TextTokenizer::from_gguf(&spm(&[])).unwrap();
        let source = "{{ bos_token }}{% for m in messages %}{{ m['role'].upper() }}: {{ m['content'].strip() }}\n{% endfor %}{{ eos_token }}";
        let t = ChatTemplate::new(Some(source), &tok, Some(1), Some(2)).unwrap();
        assert_eq!(t.kind, "model");
        assert_eq!(
            t.render(&conversation()[..2], false).unwrap(),
            "<s>SYSTEM: Be brief.\nUSER: Hi\n</s>"
        );
        assert!(ChatTemplate::new(Some("{% for %}"), &tok, None, None).is_err());
    }
}
