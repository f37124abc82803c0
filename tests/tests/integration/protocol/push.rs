//! Pushes between servers: only with the session's token, only where the
//! client said.

use super::*;

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
        // The session's client hears of it too, naming the pusher: it
        // carries the step itself and blames the pusher, not this server.
        match next_response(&mut session).await {
            Response::PushRefused {
                step_id,
                from,
                reason,
            } => {
                assert_eq!((step_id, from), (9, stranger.peer_id()));
                assert!(reason.contains(why), "{reason}");
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

    // The Open's `next` does not serve the next blocks (the stranger does
    // not even answer the info protocol): the server never pushes there,
    // whatever the steps ask (it is no reflection tool against hosts that
    // never asked), and says so.
    let mut incoming = stranger.control().accept(PUSH_PROTOCOL).unwrap();
    let after = target(libp2p::PeerId::random(), 43);
    let step = StepHeader {
        start_position: 2,
        step_id: 12,
        push: vec![target(stranger.peer_id(), 42), after.clone()],
    };
    write_frame(&mut session, &encode_step_with(&step, &hidden(1, 64)))
        .await
        .unwrap();
    match next_response(&mut session).await {
        Response::StepOut {
            step_id, pushed, ..
        } => assert_eq!((step_id, pushed), (12, false)),
        other => panic!("{other:?}"),
    }
    let reflected = tokio::time::timeout(Duration::from_millis(500), incoming.next()).await;
    assert!(
        reflected.is_err(),
        "a push reached a peer that serves nothing"
    );

    // The push of step 9 again, its proof still holding: a replay of a step
    // the session has passed is not computed (it would rewind the cache
    // under later steps), and the client hears why.
    write_frame(&mut push, &pushed).await.unwrap();
    match next_response(&mut session).await {
        Response::PushRefused {
            step_id,
            from,
            reason,
        } => {
            assert_eq!((step_id, from), (9, stranger.peer_id()));
            assert!(reason.contains("already passed"), "{reason}");
        }
        other => panic!("{other:?}"),
    }

    // Once the stranger says (its live record over the info protocol) that
    // it serves the blocks after the session's, a session naming it pushes
    // its output there, with the rest of the route, signed, and says so;
    // what it pushed is what it returned.
    let mut record =
        corolla_shared::session::fetch_info(&mut client.control(), peer, Duration::from_secs(5))
            .await
            .unwrap();
    (record.peer_id, record.start, record.end) = (stranger.peer_id().to_string(), 4, 8);
    let mut info = stranger.control().accept(INFO_PROTOCOL).unwrap();
    tokio::spawn(async move {
        while let Some((_, mut stream)) = info.next().await {
            let _ = write_frame(&mut stream, &record.to_bytes()).await;
        }
    });
    let mut session = client
        .control()
        .open_stream(peer, INFERENCE_PROTOCOL)
        .await
        .unwrap();
    write_frame(&mut session, &opening.encode()).await.unwrap();
    match next_response(&mut session).await {
        Response::Opened { .. } => {}
        other => panic!("{other:?}"),
    }
    let next = target(stranger.peer_id(), 42);
    let step = StepHeader {
        start_position: 0,
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
    assert_eq!((got.header.start_position, got.header.step_id), (0, 12));
    assert_eq!(got.header.push, vec![after]);
    assert_eq!(got.hidden.shape, vec![1, 1, 64]);
    let pushed_step = PushedStep {
        token: next.token,
        step_id: 12,
        start_position: 0,
    };
    got.proof
        .verify(&PushSender::new(peer), &pushed_step)
        .unwrap();
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
