//! Bad requests get error frames while a healthy session goes on.

use super::*;

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
