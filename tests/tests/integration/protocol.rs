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
    SessionToken, StepHeader, INFERENCE_PROTOCOL, PUSH_PROTOCOL,
};
use corolla_shared::push_proof::{view_digest, PushProof, PushedStep};
use corolla_shared::reach::ReachSettings;
use corolla_shared::{Limits, TensorPayload, WireDType};
use corolla_tests::{start_server, tiny_llama, Golden};
use futures::{AsyncWriteExt, StreamExt};
use libp2p::identity::Keypair;
use libp2p::Stream;

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
    Some(
        match Response::decode(&buf, &Limits::DEFAULT).expect("server frames decode") {
            Response::Error { code, message } => (Some(code), message),
            Response::Opened { max_length, .. } => (None, format!("opened {max_length}")),
            Response::StepOut { hidden, .. } => (None, format!("step out {:?}", hidden.shape)),
        },
    )
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_error_frames_while_a_healthy_session_goes_on() {
    let server = server().await;
    let node = connect(&[server.tcp_addr().unwrap().clone()])
        .await
        .unwrap();
    let model = server.model().to_string();
    let hashes = block_hashes(&Checkpoint::open(tiny_llama()).unwrap(), 0, 4).unwrap();
    let fp = span_hash(&hashes);

    // The healthy session, generating alongside every bad request.
    let healthy = {
        let node = node.clone();
        let model = model.clone();
        let hashes = hashes.clone();
        let peer = server.peer_id();
        tokio::spawn(async move {
            let ck = Checkpoint::open(tiny_llama()).unwrap();
            let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
            let golden = Golden::load(&tiny_llama(), "float32");
            let request = GenerateRequest {
                prompt_ids: golden.prompts[2].input_ids.clone(),
                max_new_tokens: 32,
                sampling: SamplingParams::greedy(),
                stop_at_eos: false,
                drafts: corolla_client::DEFAULT_DRAFTS,
            };
            let mut settings = SessionSettings::new(model, 4, request.max_length(), WireDType::F32);
            settings.expected_blocks = Some(hashes);
            let mut chain = RemoteChain::connect(&node, settings, &Device::Cpu)
                .await
                .unwrap();
            assert_eq!(chain.route()[0].peer_id, peer.to_string());
            let out = generate(&head, &mut chain, &request, |_| {
                std::thread::sleep(Duration::from_millis(10));
                std::ops::ControlFlow::Continue(())
            })
            .await
            .unwrap();
            assert_eq!(out.generated_ids, golden.prompts[2].generated_new_ids);
        })
    };

    let control = node.control();
    let peer = server.peer_id();
    let new_stream = || {
        let mut control = control.clone();
        async move { control.open_stream(peer, INFERENCE_PROTOCOL).await.unwrap() }
    };

    // Acknowledgements need flow control, and may not claim unsent bytes.
    let mut s = new_stream().await;
    assert_error(
        exchange(&mut s, &Request::Ack { received: 0 }.encode()).await,
        ErrorCode::BadFrame,
        "without flow control",
    );
    let mut flowing = Request::Open(OpenRequest {
        model: model.clone(),
        fingerprint: fp.clone(),
        start: 0,
        end: 4,
        max_length: 16,
        dtype: WireDType::F32,
        compression: corolla_shared::Compression::None,
        flow_window: 16_000,
        next: None,
        adapter: None,
    })
    .encode();
    let (code, msg) = exchange(&mut s, &flowing).await.unwrap();
    assert_eq!(code, None, "{msg}");
    flowing = Request::Ack { received: 1 << 30 }.encode();
    assert_error(
        exchange(&mut s, &flowing).await,
        ErrorCode::BadFrame,
        "acknowledgement of 1073741824 bytes",
    );

    // A malformed frame, then the same stream still works.
    let mut s = new_stream().await;
    assert_error(
        exchange(&mut s, &[0xff, 1, 2, 3]).await,
        ErrorCode::BadFrame,
        "malformed request",
    );
    assert_error(
        exchange(&mut s, &[]).await,
        ErrorCode::BadFrame,
        "empty message",
    );
    let (code, msg) = exchange(&mut s, &open(&model, 0, 4, 16, &fp))
        .await
        .unwrap();
    assert_eq!(code, None, "{msg}");

    // A step with no session open (each refusal on a fresh stream: three
    // bad requests in a row close one).
    assert_error(
        exchange(&mut new_stream().await, &encode_step(0, &hidden(1, 64))).await,
        ErrorCode::UnknownSession,
        "Open first",
    );

    // Opens the server must refuse.
    assert_error(
        exchange(&mut new_stream().await, &open("other-model", 0, 4, 16, "")).await,
        ErrorCode::WrongModel,
        "other-model",
    );
    assert_error(
        exchange(&mut new_stream().await, &open(&model, 0, 4, 16, "0123abcd")).await,
        ErrorCode::WrongModel,
        "other weights",
    );
    assert_error(
        exchange(&mut new_stream().await, &open(&model, 2, 6, 16, &fp)).await,
        ErrorCode::SpanNotServed,
        "blocks 2..6",
    );
    assert_error(
        exchange(&mut new_stream().await, &open(&model, 3, 3, 16, &fp)).await,
        ErrorCode::SpanNotServed,
        "blocks 3..3",
    );
    assert_error(
        exchange(&mut new_stream().await, &open(&model, 0, 4, 129, &fp)).await,
        ErrorCode::TooLong,
        "max_length 129",
    );

    // Steps the open session must refuse, then a good one.
    assert_error(
        exchange(&mut s, &encode_step(0, &hidden(2, 63))).await,
        ErrorCode::BadShape,
        "[1, T, 64]",
    );
    assert_error(
        exchange(&mut s, &encode_step(3, &hidden(1, 64))).await,
        ErrorCode::BadShape,
        "start position 3",
    );
    // A good step resets the count of bad requests in a row.
    let (code, msg) = exchange(&mut s, &encode_step(0, &hidden(2, 64)))
        .await
        .unwrap();
    assert_eq!((code, msg.as_str()), (None, "step out [1, 2, 64]"));
    assert_error(
        exchange(&mut s, &encode_step(0, &hidden(17, 64))).await,
        ErrorCode::TooLong,
        "max_length 16",
    );
    // Tag, start position, step id, an empty push route; then the tensor.
    let mut huge = vec![2u8, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    huge.extend_from_slice(b"CTNS\x01\x00\x00\x03");
    for dim in [1u64, 1 << 20, 1 << 20] {
        huge.extend_from_slice(&dim.to_le_bytes());
    }
    assert_error(
        exchange(&mut s, &huge).await,
        ErrorCode::BadFrame,
        "exceeds the limit",
    );
    let (code, msg) = exchange(&mut s, &encode_step(0, &hidden(3, 64)))
        .await
        .unwrap();
    assert_eq!((code, msg.as_str()), (None, "step out [1, 3, 64]"));

    // A frame longer than the limit: refused, and the stream is closed.
    let mut s3 = new_stream().await;
    s3.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    s3.flush().await.unwrap();
    let mut buf = Vec::new();
    assert!(read_frame(&mut s3, 1 << 20, &mut buf).await.unwrap());
    match Response::decode(&buf, &Limits::DEFAULT).unwrap() {
        Response::Error { code, message } => {
            assert_eq!(code, ErrorCode::TooLong);
            assert!(message.contains("exceeds the limit"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        !read_frame(&mut s3, 1 << 20, &mut buf)
            .await
            .unwrap_or(false),
        "stream closed after an oversized frame"
    );

    healthy
        .await
        .expect("the healthy session produced the reference tokens");
    drop(control);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_reports_the_server_and_sessions_free_their_caches() {
    use corolla_shared::session::fetch_info;
    let flags = [
        "--inference-max-length",
        "32",
        "--max-sessions",
        "2",
        "--max-sessions-per-peer",
        "2",
        "--session-timeout",
        "1s",
    ];
    let server = start_server("1:3", None, &flags).await;
    let node = connect(&[server.tcp_addr().unwrap().clone()])
        .await
        .unwrap();
    let peer = server.peer_id();
    let control = node.control();
    let info = |mut control: libp2p_stream::Control| async move {
        fetch_info(&mut control, peer, Duration::from_secs(10))
            .await
            .unwrap()
    };
    let record = info(control.clone()).await;
    assert_eq!(record.peer_id, peer.to_string());
    assert_eq!(record.model, "tiny-llama-a");
    assert_eq!((record.start, record.end, record.num_layers), (1, 3, 4));
    assert!(record.throughput > 0.0 && record.prefill_throughput > 0.0);
    assert_eq!((record.sessions, record.cache_tokens_left), (0, 64));
    assert_eq!(record.version, env!("CARGO_PKG_VERSION"));

    assert_eq!(
        record.block_hashes,
        block_hashes(&Checkpoint::open(tiny_llama()).unwrap(), 1, 3).unwrap()
    );
    assert_eq!(
        record.fingerprint,
        corolla_model::fingerprint::fingerprint(&Checkpoint::open(tiny_llama()).unwrap()).unwrap()
    );
    let fp = span_hash(&record.block_hashes);
    let model = record.model.clone();
    let open_session = || {
        let mut control = control.clone();
        let frame = open(&model, 1, 3, 32, &fp);
        async move {
            let mut s = control.open_stream(peer, INFERENCE_PROTOCOL).await.unwrap();
            let (code, msg) = exchange(&mut s, &frame).await.unwrap();
            (s, code, msg)
        }
    };
    let sessions_become = |n: u32| {
        let control = control.clone();
        async move {
            for _ in 0..100 {
                if info(control.clone()).await.sessions == n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            panic!("sessions never became {n}");
        }
    };

    // Closed politely.
    let (mut a, code, _) = open_session().await;
    assert_eq!(code, None);
    sessions_become(1).await;
    assert_eq!(info(control.clone()).await.cache_tokens_left, 32);
    write_frame(&mut a, &Request::Close.encode()).await.unwrap();
    sessions_become(0).await;

    // Dropped without a word, and busy when full.
    let (b, _, _) = open_session().await;
    let (mut c, _, _) = open_session().await;
    sessions_become(2).await;
    let (_, code, msg) = open_session().await;
    assert_eq!(code, Some(ErrorCode::Busy), "{msg}");
    drop(b);
    sessions_become(1).await;

    // Idle past the timeout: the server says so, closes, and frees the cache.
    let mut buf = Vec::new();
    let got = tokio::time::timeout(
        Duration::from_secs(10),
        read_frame(&mut c, 1 << 20, &mut buf),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(got);
    match Response::decode(&buf, &Limits::DEFAULT).unwrap() {
        Response::Error { code, message } => {
            assert_eq!(code, ErrorCode::Timeout);
            assert!(message.contains("idle"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    sessions_become(0).await;
}

/// Reads one frame and decodes it as a response.
async fn next_response(stream: &mut Stream) -> Response<'static> {
    let mut buf = Vec::new();
    let got = tokio::time::timeout(
        Duration::from_secs(10),
        read_frame(stream, Limits::DEFAULT.max_frame_bytes(), &mut buf),
    )
    .await
    .expect("an answer within 10 s")
    .expect("a readable frame");
    assert!(got, "the stream ended");
    let buf: &'static [u8] = Box::leak(buf.into_boxed_slice());
    Response::decode(buf, &Limits::DEFAULT).expect("a response")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_gets_in_only_with_its_sessions_token_and_goes_only_where_the_client_said() {
    let server = server().await;
    let addr = server.tcp_addr().unwrap().clone();
    let client = connect(std::slice::from_ref(&addr)).await.unwrap();
    let stranger_key = Keypair::generate_ed25519();
    let stranger = connect_as(
        stranger_key.clone(),
        std::slice::from_ref(&addr),
        None,
        &ReachSettings::client(),
    )
    .await
    .unwrap();
    let peer = server.peer_id();
    let model = server.model().to_string();
    let fp = span_hash(&block_hashes(&Checkpoint::open(tiny_llama()).unwrap(), 0, 4).unwrap());

    // The session may push only to the stranger, as its Open says.
    let mut session = client
        .control()
        .open_stream(peer, INFERENCE_PROTOCOL)
        .await
        .unwrap();
    let opening = Request::Open(OpenRequest {
        next: Some(stranger.peer_id()),
        ..open_request(&model, 0, 4, 16, &fp)
    });
    write_frame(&mut session, &opening.encode()).await.unwrap();
    let token = match next_response(&mut session).await {
        Response::Opened { token, .. } => token,
        other => panic!("{other:?}"),
    };

    let header = |step_id| StepHeader {
        start_position: 0,
        step_id,
        push: Vec::new(),
    };
    let signed = |key: &Keypair, token, step_id, hidden: &TensorPayload| {
        let step = PushedStep {
            token,
            step_id,
            start_position: 0,
        };
        PushProof::sign(key, &step, hidden).unwrap()
    };
    // A push nobody asked for: refused on the push stream, and three in a
    // row close it.
    let mut push = stranger
        .control()
        .open_stream(peer, PUSH_PROTOCOL)
        .await
        .unwrap();
    let input = hidden(2, 64);
    for guess in 0..3u8 {
        let token = SessionToken([guess; 16]);
        let proof = signed(&stranger_key, token, 5, &input);
        let forged = PushStep::encode(token, &header(5), &proof, &input);
        write_frame(&mut push, &forged).await.unwrap();
        match next_response(&mut push).await {
            Response::Error { code, message } => {
                assert_eq!(code, ErrorCode::UnknownSession);
                assert!(message.contains("no open session"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
    let mut buf = Vec::new();
    assert!(
        !read_frame(&mut push, 1 << 20, &mut buf)
            .await
            .unwrap_or(false),
        "the push stream is closed after three refusals in a row"
    );

    // The session's token with a proof not signed by the pusher, or signed
    // for other numbers: refused before anything is computed.
    let mut push = stranger
        .control()
        .open_stream(peer, PUSH_PROTOCOL)
        .await
        .unwrap();
    let someone_else = signed(&Keypair::generate_ed25519(), token, 9, &input);
    let other_numbers = signed(&stranger_key, token, 9, &hidden_of(2, 64, 1.0));
    for (proof, why) in [
        (someone_else, "does not hold"),
        (other_numbers, "not that of what it carries"),
    ] {
        write_frame(
            &mut push,
            &PushStep::encode(token, &header(9), &proof, &input),
        )
        .await
        .unwrap();
        match next_response(&mut push).await {
            Response::Error { code, message } => {
                assert_eq!(code, ErrorCode::BadFrame);
                assert!(message.contains(why), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    // With the session's token and the pusher's proof, the session runs the
    // step and answers its own client, unasked, under the pushed step's id,
    // with the proof (what the client checks against the pusher's output).
    let proof = signed(&stranger_key, token, 9, &input);
    let pushed = PushStep::encode(token, &header(9), &proof, &input);
    write_frame(&mut push, &pushed).await.unwrap();
    match next_response(&mut session).await {
        Response::StepOut {
            step_id,
            pushed,
            input_proof,
            hidden,
        } => {
            assert_eq!((step_id, pushed), (9, false));
            assert_eq!(input_proof, Some(proof));
            assert_eq!(hidden.shape, vec![1, 2, 64]);
        }
        other => panic!("{other:?}"),
    }

    // Routes that loop are refused before any compute: one naming this
    // server, one naming a server twice.
    let target = |peer, byte| PushTarget {
        peer,
        token: SessionToken([byte; 16]),
    };
    for route in [
        vec![target(stranger.peer_id(), 1), target(peer, 2)],
        vec![
            target(stranger.peer_id(), 1),
            target(libp2p::PeerId::random(), 2),
            target(stranger.peer_id(), 3),
        ],
    ] {
        let step = StepHeader {
            start_position: 2,
            step_id: 10,
            push: route,
        };
        match exchange(&mut session, &encode_step_with(&step, &hidden(1, 64))).await {
            Some((Some(ErrorCode::BadFrame), message)) => {
                assert!(message.contains("cannot loop"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }

    // A first target other than the Open's: answered, never pushed.
    let elsewhere = StepHeader {
        start_position: 2,
        step_id: 11,
        push: vec![target(libp2p::PeerId::random(), 7)],
    };
    write_frame(&mut session, &encode_step_with(&elsewhere, &hidden(1, 64)))
        .await
        .unwrap();
    match next_response(&mut session).await {
        Response::StepOut {
            step_id, pushed, ..
        } => assert_eq!((step_id, pushed), (11, false)),
        other => panic!("{other:?}"),
    }

    // The client names the next session: the server pushes its output
    // there, with the rest of the route, signed, and says so; what it
    // pushed is what it returned.
    let mut incoming = stranger.control().accept(PUSH_PROTOCOL).unwrap();
    let next = target(stranger.peer_id(), 42);
    let after = target(libp2p::PeerId::random(), 43);
    let step = StepHeader {
        start_position: 2,
        step_id: 12,
        push: vec![next.clone(), after.clone()],
    };
    write_frame(&mut session, &encode_step_with(&step, &hidden(1, 64)))
        .await
        .unwrap();
    let (from, mut stream) = tokio::time::timeout(Duration::from_secs(10), incoming.next())
        .await
        .expect("a push within 10 s")
        .expect("a push stream");
    assert_eq!(from, peer);
    let mut buf = Vec::new();
    assert!(read_frame(&mut stream, 1 << 20, &mut buf).await.unwrap());
    let got = PushStep::decode(&buf, &Limits::DEFAULT).unwrap();
    assert_eq!(got.token, next.token);
    assert_eq!((got.header.start_position, got.header.step_id), (2, 12));
    assert_eq!(got.header.push, vec![after]);
    assert_eq!(got.hidden.shape, vec![1, 1, 64]);
    let pushed_step = PushedStep {
        token: next.token,
        step_id: 12,
        start_position: 2,
    };
    got.proof.verify(&peer, &pushed_step).unwrap();
    assert_eq!(got.proof.digest, view_digest(&got.hidden));
    match next_response(&mut session).await {
        Response::StepOut {
            step_id,
            pushed,
            hidden,
            ..
        } => {
            assert_eq!((step_id, pushed), (12, true));
            assert_eq!(view_digest(&hidden), got.proof.digest);
        }
        other => panic!("{other:?}"),
    }
}
