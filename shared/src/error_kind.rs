//! The words every failure a user or a program sees is classed under: the
//! same in every release and on every surface (the CLI's `--json`, the
//! OpenAI API's `error.code`, the page's client and the widget), so that
//! programs match a kind, never a message.

use serde::{Deserialize, Serialize};

use crate::protocol::ErrorCode;
use crate::session::SessionError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request itself is wrong (empty prompt, bad settings, bad tokens):
    /// asking again unchanged cannot help.
    BadRequest,
    /// The prompt and answer need more positions than the model or the
    /// servers allow.
    ContextLengthExceeded,
    /// No server announces some of the model's blocks.
    NoCoverage,
    /// Servers exist, but for other weights or another quantization than
    /// the route follows.
    ModelMismatch,
    /// The servers are full: asking later can help.
    Busy,
    /// A server could not be reached, or stopped answering.
    Unreachable,
    /// The server is leaving the swarm.
    ShuttingDown,
    /// A server answered wrongly: a malformed message, an impossible
    /// output, or wrong activations caught by a spot check.
    BadServer,
    /// A fault of this program, not of the request or the swarm.
    Internal,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 9] = [
        ErrorKind::BadRequest,
        ErrorKind::ContextLengthExceeded,
        ErrorKind::NoCoverage,
        ErrorKind::ModelMismatch,
        ErrorKind::Busy,
        ErrorKind::Unreachable,
        ErrorKind::ShuttingDown,
        ErrorKind::BadServer,
        ErrorKind::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::ContextLengthExceeded => "context_length_exceeded",
            ErrorKind::NoCoverage => "no_coverage",
            ErrorKind::ModelMismatch => "model_mismatch",
            ErrorKind::Busy => "busy",
            ErrorKind::Unreachable => "unreachable",
            ErrorKind::ShuttingDown => "shutting_down",
            ErrorKind::BadServer => "bad_server",
            ErrorKind::Internal => "internal",
        }
    }

    /// Whether the same request may succeed later without any change.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::NoCoverage
                | ErrorKind::Busy
                | ErrorKind::Unreachable
                | ErrorKind::ShuttingDown
                | ErrorKind::BadServer
        )
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<ErrorCode> for ErrorKind {
    /// How a server's refusal reads to the client that got it.
    fn from(code: ErrorCode) -> Self {
        match code {
            ErrorCode::Busy => ErrorKind::Busy,
            ErrorCode::ShuttingDown => ErrorKind::ShuttingDown,
            ErrorCode::WrongModel | ErrorCode::SpanNotServed => ErrorKind::ModelMismatch,
            ErrorCode::TooLong => ErrorKind::ContextLengthExceeded,
            ErrorCode::BadFrame | ErrorCode::BadShape => ErrorKind::BadRequest,
            ErrorCode::Timeout => ErrorKind::Unreachable,
            ErrorCode::UnknownSession | ErrorCode::Internal => ErrorKind::BadServer,
        }
    }
}

impl SessionError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            SessionError::Connect { .. }
            | SessionError::Io { .. }
            | SessionError::Closed { .. }
            | SessionError::Timeout { .. } => ErrorKind::Unreachable,
            SessionError::Remote { code, .. } => ErrorKind::from(*code),
            SessionError::Protocol { .. }
            | SessionError::Unexpected { .. }
            | SessionError::BadOutput { .. }
            | SessionError::Caught { .. }
            | SessionError::PushLie { .. }
            | SessionError::PushRefused { .. }
            | SessionError::PushUndelivered { .. } => ErrorKind::BadServer,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_one_name_and_serde_writes_that_name() {
        let mut names = std::collections::HashSet::new();
        for kind in ErrorKind::ALL {
            assert!(names.insert(kind.as_str()), "{kind:?} shares its name");
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.as_str()));
            let back: ErrorKind = serde_json::from_str(&json).unwrap();
            assert_eq!(back, kind);
        }
    }

    #[test]
    fn a_busy_server_reads_as_busy_and_a_gone_one_as_unreachable() {
        let peer = libp2p::PeerId::random();
        let busy = SessionError::Remote {
            peer,
            code: ErrorCode::Busy,
            message: "busy: 16/16 sessions".into(),
        };
        assert_eq!(busy.kind(), ErrorKind::Busy);
        assert!(busy.kind().retryable());
        assert_eq!(SessionError::Closed { peer }.kind(), ErrorKind::Unreachable);
        assert_eq!(SessionError::Caught { peer }.kind(), ErrorKind::BadServer);
        assert!(!ErrorKind::BadRequest.retryable());
    }
}
