//! The API's errors, in OpenAI's JSON shape.

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
}

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            code: None,
            counted: false,
        }
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

impl From<ClientError> for ApiError {
    /// The error's kind is its `code`; the status says who can fix it.
    fn from(e: ClientError) -> Self {
        let kind = e.kind();
        let status = match kind {
            ErrorKind::BadRequest | ErrorKind::ContextLengthExceeded => StatusCode::BAD_REQUEST,
            ErrorKind::NoCoverage
            | ErrorKind::ModelMismatch
            | ErrorKind::Busy
            | ErrorKind::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Unreachable | ErrorKind::BadServer => StatusCode::BAD_GATEWAY,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.to_string()).with_code(kind.as_str())
    }
}
