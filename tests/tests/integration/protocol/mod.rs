//! Bad input on the inference protocol: each gets an error frame with a
//! clear message, while a healthy session on the same server keeps
//! producing the reference tokens.

use std::time::Duration;

use corolla_client::network::{connect, connect_as};
use corolla_client::{generate, GenerateRequest, RemoteChain, SessionSettings};
use corolla_model::fingerprint::{block_hashes, span_hash};
use corolla_model::{Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_server::RunningServer;
use corolla_shared::framing::{read_frame, write_frame};
use corolla_shared::protocol::{
    encode_step, encode_step_with, ErrorCode, OpenRequest, PushStep, PushTarget, Request, Response,
    SessionToken, StepHeader, INFERENCE_PROTOCOL, INFO_PROTOCOL, PUSH_PROTOCOL,
};
use corolla_shared::push_proof::{view_digest, PushProof, PushSender, PushedStep};
use corolla_shared::reach::ReachSettings;
use corolla_shared::{Limits, TensorPayload, WireDType};
use corolla_tests::{start_server, tiny_llama, Golden};
use futures::{AsyncWriteExt, StreamExt};
use libp2p::identity::Keypair;
use libp2p::Stream;

mod info;
mod push;
mod refusals;

async fn server() -> RunningServer {
    start_server(
        "0:4",
        None,
        &["--inference-max-length", "128", "--update-period", "5s"],
    )
    .await
}

/// Sends one frame and decodes the answer; `None` when the server closed the stream.
async fn exchange(stream: &mut Stream, frame: &[u8]) -> Option<(Option<ErrorCode>, String)> {
    write_frame(stream, frame).await.ok()?;
    let mut buf = Vec::new();
    if !read_frame(stream, Limits::DEFAULT.max_frame_bytes(), &mut buf)
        .await
        .ok()?
    {
        return None;
    }
    Some(corolla_tests::hostile::describe(
        Response::decode(&buf, &Limits::DEFAULT).expect("server frames decode"),
    ))
}

fn open_request(
    model: &str,
    start: u32,
    end: u32,
    max_length: u32,
    fingerprint: &str,
) -> OpenRequest {
    OpenRequest {
        model: model.into(),
        fingerprint: fingerprint.into(),
        start,
        end,
        max_length,
        dtype: WireDType::F32,
        compression: corolla_shared::Compression::None,
        flow_window: 0,
        next: None,
        adapter: None,
    }
}

fn open(model: &str, start: u32, end: u32, max_length: u32, fingerprint: &str) -> Vec<u8> {
    Request::Open(open_request(model, start, end, max_length, fingerprint)).encode()
}

fn hidden(t: usize, h: usize) -> TensorPayload {
    hidden_of(t, h, 0.0)
}

fn hidden_of(t: usize, h: usize, value: f32) -> TensorPayload {
    let data = std::iter::repeat_n(value.to_le_bytes(), t * h)
        .flatten()
        .collect();
    TensorPayload::new(WireDType::F32, vec![1, t, h], data).unwrap()
}

fn assert_error(got: Option<(Option<ErrorCode>, String)>, code: ErrorCode, needle: &str) {
    let (got_code, message) = got.expect("an answer, not a closed stream");
    assert_eq!(got_code, Some(code), "{message}");
    assert!(
        message.contains(needle),
        "{message:?} should mention {needle:?}"
    );
}
