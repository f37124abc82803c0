//! The HTTP side's defences against prying: a request guard (414 for
//! over-long paths, 404 for over-long segments, dotfiles and anything a
//! symlink leads out of `--web-dir`). Floods meet `corolla_http`'s bounded
//! accept loop.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The longest request path accepted (414 beyond).
const MAX_PATH_BYTES: usize = 2048;
/// The longest path segment: file systems refuse longer names.
const MAX_SEGMENT_BYTES: usize = 255;

/// What the request guard knows: the web folder, resolved.
pub(crate) struct Guard {
    pub web_dir: Option<PathBuf>,
}

impl Guard {
    pub fn new(web_dir: Option<&Path>) -> Self {
        Guard {
            web_dir: web_dir.and_then(|d| d.canonicalize().ok()),
        }
    }
}

/// Refuses requests for what must not be served, before any handler runs.
pub(crate) async fn guard_request(
    State(guard): State<Arc<Guard>>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    if path.len() > MAX_PATH_BYTES {
        return StatusCode::URI_TOO_LONG.into_response();
    }
    let Some(segments) = decoded_segments(path) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if segments
        .iter()
        .any(|s| s.len() > MAX_SEGMENT_BYTES || s.starts_with('.') || s.contains(['/', '\\', '\0']))
    {
        return StatusCode::NOT_FOUND.into_response();
    }
    if let Some(root) = &guard.web_dir {
        let candidate = segments.iter().fold(root.clone(), |p, s| p.join(s));
        // Whatever exists must resolve inside the folder: no symlink out.
        if let Ok(resolved) = candidate.canonicalize() {
            if !resolved.starts_with(root) {
                return StatusCode::NOT_FOUND.into_response();
            }
        }
    }
    next.run(request).await
}

/// The path's non-empty segments, percent-decoded; `None` when not UTF-8
/// or badly encoded.
fn decoded_segments(path: &str) -> Option<Vec<String>> {
    path.split('/')
        .filter(|s| !s.is_empty())
        .map(|s| {
            let bytes: Vec<u8> = percent_encoding::percent_decode_str(s).collect();
            String::from_utf8(bytes).ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_decoded() {
        assert_eq!(
            decoded_segments("/a/%2e%2e/b%20c/").unwrap(),
            ["a", "..", "b c"]
        );
        assert!(decoded_segments("/%ff").is_none());
    }
}
