//! The API's errors, in OpenAI's JSON shape.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

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
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub(super) fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The label `/metrics` counts this error under.
    pub(super) fn kind(&self) -> &'static str {
        match (self.code, self.status) {
            (Some(code), _) => code,
            (None, StatusCode::BAD_REQUEST) => "invalid_request",
            (None, StatusCode::NOT_FOUND) => "not_found",
            (None, StatusCode::PAYLOAD_TOO_LARGE) => "body_too_large",
            (None, s) if s.is_server_error() => "server_error",
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
    fn from(e: ClientError) -> Self {
        match &e {
            ClientError::NoRoute { .. } | ClientError::Refused { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()).with_code("no_route")
            }
            ClientError::MixedQuantization { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
                    .with_code("mixed_quantization")
            }
            ClientError::TooLong { .. } | ClientError::SessionTooLong { .. } => {
                ApiError::bad_request(e.to_string()).with_code("context_length_exceeded")
            }
            ClientError::EmptyPrompt | ClientError::BadRequest(_) | ClientError::Tokenizer(_) => {
                ApiError::bad_request(e.to_string())
            }
            ClientError::Model(corolla_model::ModelError::InvalidSampling(_)) => {
                ApiError::bad_request(e.to_string())
            }
            _ => ApiError::new(StatusCode::BAD_GATEWAY, e.to_string()).with_code("swarm_error"),
        }
    }
}
