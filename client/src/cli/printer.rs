//! An answer's text on a terminal as it streams, withdrawals included.

use std::io::Write;

use crate::error::ClientError;
use crate::generate::AnswerEvent;
use crate::text::{TextStream, TextTokenizer};

/// Prints an answer's pieces to stdout as they come. A terminal cannot take
/// text back: when tokens are withdrawn (a server caught lying about
/// positions already answered), stderr says so and stdout starts a new
/// line holding the answer again from its start, corrected, so the last
/// text on stdout is always the answer.
pub(super) struct AnswerPrinter<'a> {
    tokenizer: &'a TextTokenizer,
    stream: TextStream,
    /// The answer as shown now (withdrawn text removed).
    text: String,
}

impl<'a> AnswerPrinter<'a> {
    pub(super) fn new(tokenizer: &'a TextTokenizer) -> Self {
        AnswerPrinter {
            tokenizer,
            stream: TextStream::default(),
            text: String::new(),
        }
    }

    pub(super) fn show(&mut self, event: AnswerEvent) -> Result<(), ClientError> {
        let mut stdout = std::io::stdout().lock();
        match event {
            AnswerEvent::Token(token) => {
                if let Some(piece) = self.stream.push(self.tokenizer, token)? {
                    self.text.push_str(&piece);
                    let _ = write!(stdout, "{piece}");
                }
            }
            AnswerEvent::Withdraw { kept } => {
                let back = self.stream.truncate(self.tokenizer, kept)?;
                self.text
                    .truncate(self.text.len().saturating_sub(back.len()));
                eprintln!(
                    "\n[a server was caught lying about this answer: {:?} is withdrawn; the corrected answer follows]",
                    back
                );
                let _ = write!(stdout, "\n{}", self.text);
            }
        }
        let _ = stdout.flush();
        Ok(())
    }

    /// The answer's text as shown.
    pub(super) fn text(&self) -> &str {
        &self.text
    }
}
