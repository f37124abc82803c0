//! The API's errors, in OpenAI's JSON shape.

use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use corolla_shared::ErrorKind;

use crate::error::ClientError;

/// An error in OpenAI's shape: `{"error": {message, type, param, code}}`.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
    pub(super) code: Option<&'static str>,
    /// Already counted in `/metrics` (where it happened, in the answer's task).
    pub(super) counted: bool,
    /// For a refusal a later try can get past: when to try again (else
    /// [`RETRY_AFTER_SECONDS`]).
    pub(super) retry_after: Option<Duration>,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            code: None,
            counted: false,
            retry_after: None,
        }
    }

    /// A refusal for want of room (429, code `busy`), to try again after
    /// `retry_after`.
    pub(super) fn busy(message: impl Into<String>, retry_after: Duration) -> Self {
        let mut e =
            Self::new(StatusCode::TOO_MANY_REQUESTS, message).with_code(ErrorKind::Busy.as_str());
        e.retry_after = Some(retry_after);
        e
    }

    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message).with_code(ErrorKind::BadRequest.as_str())
    }

    pub(super) fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The label `/metrics` counts this error under.
    pub(super) fn kind(&self) -> &'static str {
        match (self.code, self.status) {
            (_, StatusCode::PAYLOAD_TOO_LARGE) => "body_too_large",
            (Some(code), _) => code,
            (None, StatusCode::BAD_REQUEST) => ErrorKind::BadRequest.as_str(),
            (None, StatusCode::NOT_FOUND) => "not_found",
            (None, s) if s.is_server_error() => ErrorKind::Internal.as_str(),
            _ => "other",
        }
    }

    pub(super) fn body(&self) -> Value {
        let kind = match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": null, "code": self.code}})
    }
}

/// What a refusal for want of capacity suggests waiting before trying again.
const RETRY_AFTER_SECONDS: u32 = 5;

impl IntoResponse for ApiError {
    /// A refusal a later try can get past (busy servers, one leaving) says
    /// when to try again.
    fn into_response(self) -> Response {
        let retryable = matches!(
            self.code,
            Some(code) if code == ErrorKind::Busy.as_str() || code == ErrorKind::ShuttingDown.as_str()
        );
        let mut response = (self.status, Json(self.body())).into_response();
        if retryable {
            let seconds = self.retry_after.map_or(RETRY_AFTER_SECONDS, |wait| {
                u32::try_from(wait.as_secs()).unwrap_or(u32::MAX).max(1)
            });
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(seconds),
            );
        }
        response
    }
}

impl From<ClientError> for ApiError {
    /// The error's kind is its `code`; the status says who can fix it.
    fn from(e: ClientError) -> Self {
        let kind = e.kind();
        let status = match kind {
            ErrorKind::BadRequest | ErrorKind::ContextLengthExceeded => StatusCode::BAD_REQUEST,
            ErrorKind::Busy => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::NoCoverage | ErrorKind::ModelMismatch | ErrorKind::ShuttingDown => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ErrorKind::Unreachable | ErrorKind::BadServer => StatusCode::BAD_GATEWAY,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.to_string()).with_code(kind.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(cause: ErrorKind) -> ClientError {
        ClientError::Refused {
            uncovered: vec![(0, 4)],
            reasons: vec!["a (blocks 0..4): busy: 16/16 sessions in use".into()],
            cause,
        }
    }

    #[test]
    fn a_busy_swarm_says_so_and_when_to_try_again() {
        let response = ApiError::from(refused(ErrorKind::Busy)).into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            response.headers().get(axum::http::header::RETRY_AFTER),
            Some(&axum::http::HeaderValue::from(RETRY_AFTER_SECONDS))
        );
        // A swarm without the blocks is no better in 5 s: no Retry-After.
        let response = ApiError::from(ClientError::NoRoute {
            uncovered: vec![(0, 4)],
        })
        .into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(response
            .headers()
            .get(axum::http::header::RETRY_AFTER)
            .is_none());
        let response = ApiError::from(refused(ErrorKind::BadServer)).into_response();
        assert!(response
            .headers()
            .get(axum::http::header::RETRY_AFTER)
            .is_none());
    }
}
