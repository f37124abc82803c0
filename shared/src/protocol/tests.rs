//! The protocol's encodings round-trip, and every bound is checked before allocating.

use super::*;
use proptest::prelude::*;

fn open() -> OpenRequest {
    OpenRequest {
        model: "tiny-llama-a".into(),
        fingerprint: "abc".into(),
        start: 1,
        end: 3,
        max_length: 48,
        dtype: WireDType::F32,
        compression: Compression::Int8Block64,
        flow_window: 16_000,
        next: Some(libp2p::PeerId::from_public_key(
            &libp2p::identity::Keypair::ed25519_from_bytes([5; 32])
                .unwrap()
                .public(),
        )),
        adapter: None,
    }
}

#[test]
fn an_open_names_its_adapter_and_one_without_reads_as_before() {
    let with = OpenRequest {
        adapter: Some("user/sql-lora".into()),
        ..open()
    };
    let limits = Limits::DEFAULT;
    for o in [open(), with] {
        let bytes = Request::Open(o.clone()).encode();
        assert_eq!(Request::decode(&bytes, &limits).unwrap(), Request::Open(o));
    }
    // A name longer than any adapter's is refused before it is read.
    let mut long = Request::Open(open()).encode();
    long.extend_from_slice(&(MAX_ADAPTER_NAME_LEN as u16 + 1).to_le_bytes());
    long.extend(std::iter::repeat_n(b'a', MAX_ADAPTER_NAME_LEN + 1));
    assert!(matches!(
        Request::decode(&long, &limits),
        Err(ProtocolError::StringTooLong { .. })
    ));
}

fn proof() -> PushProof {
    PushProof {
        digest: [4; 32],
        signature: vec![6; 64],
    }
}

fn samples() -> Vec<Vec<u8>> {
    let hidden = TensorPayload::new(WireDType::F16, vec![1, 2, 2], vec![7; 8]).unwrap();
    vec![
        Request::Open(open()).encode(),
        encode_step(5, &hidden),
        Request::Close.encode(),
        Request::Ack { received: 1 << 40 }.encode(),
        Response::Opened {
            max_length: 9,
            token: SessionToken([3; 16]),
        }
        .encode(),
        Response::StepOut {
            step_id: 7,
            pushed: true,
            input_proof: Some(proof()),
            hidden: hidden.view(),
        }
        .encode(),
        Response::error(ErrorCode::BadShape, "wrong shape").encode(),
        Response::PushRefused {
            step_id: 12,
            from: pusher(),
            reason: "a push for a step already passed".into(),
        }
        .encode(),
    ]
}

#[test]
fn messages_round_trip() {
    let limits = Limits::DEFAULT;
    let hidden = TensorPayload::new(WireDType::F16, vec![1, 2, 2], vec![7; 8]).unwrap();
    let s = samples();
    assert_eq!(
        Request::decode(&s[0], &limits).unwrap(),
        Request::Open(open())
    );
    assert_eq!(
        Request::decode(&s[1], &limits).unwrap(),
        Request::Step {
            header: StepHeader {
                start_position: 5,
                ..StepHeader::default()
            },
            hidden: hidden.view()
        }
    );
    assert_eq!(Request::decode(&s[2], &limits).unwrap(), Request::Close);
    assert_eq!(
        Request::decode(&s[3], &limits).unwrap(),
        Request::Ack { received: 1 << 40 }
    );
    assert_eq!(
        Response::decode(&s[4], &limits).unwrap(),
        Response::Opened {
            max_length: 9,
            token: SessionToken([3; 16])
        }
    );
    assert_eq!(
        Response::decode(&s[5], &limits).unwrap(),
        Response::StepOut {
            step_id: 7,
            pushed: true,
            input_proof: Some(proof()),
            hidden: hidden.view()
        }
    );
    let without = Response::StepOut {
        step_id: 7,
        pushed: false,
        input_proof: None,
        hidden: hidden.view(),
    };
    assert_eq!(
        Response::decode(&without.encode(), &limits).unwrap(),
        without
    );
    let alone = Request::Open(OpenRequest {
        next: None,
        ..open()
    });
    assert_eq!(Request::decode(&alone.encode(), &limits).unwrap(), alone);
    assert_eq!(
        Response::decode(&s[6], &limits).unwrap(),
        Response::error(ErrorCode::BadShape, "wrong shape")
    );
    assert_eq!(
        Response::decode(&s[7], &limits).unwrap(),
        Response::PushRefused {
            step_id: 12,
            from: pusher(),
            reason: "a push for a step already passed".into()
        }
    );
}

#[test]
fn every_truncation_is_an_error() {
    for (i, bytes) in samples().iter().enumerate() {
        for len in 0..bytes.len() {
            let cut = &bytes[..len];
            if i < 3 {
                assert!(
                    Request::decode(cut, &Limits::DEFAULT).is_err(),
                    "message {i} cut at {len}"
                );
            } else {
                assert!(
                    Response::decode(cut, &Limits::DEFAULT).is_err(),
                    "message {i} cut at {len}"
                );
            }
        }
    }
}

#[test]
fn overlong_strings_are_truncated_by_the_sender() {
    let mut o = open();
    o.model = "é".repeat(MAX_NAME_LEN);
    let bytes = Request::Open(o).encode();
    match Request::decode(&bytes, &Limits::DEFAULT).unwrap() {
        Request::Open(o) => assert!(o.model.len() <= MAX_NAME_LEN),
        other => panic!("{other:?}"),
    }
}

/// One fixed peer id, so that samples compare equal.
fn pusher() -> libp2p::PeerId {
    libp2p::identity::Keypair::ed25519_from_bytes([7; 32])
        .unwrap()
        .public()
        .to_peer_id()
}

fn route(n: usize) -> Vec<PushTarget> {
    (0..n)
        .map(|i| PushTarget {
            peer: libp2p::PeerId::random(),
            token: SessionToken([i as u8; 16]),
        })
        .collect()
}

#[test]
fn steps_and_pushes_carry_their_routes() {
    let hidden = TensorPayload::new(WireDType::F16, vec![1, 2, 2], vec![7; 8]).unwrap();
    let header = StepHeader {
        start_position: 12,
        step_id: 99,
        push: route(3),
    };
    let bytes = encode_step_with(&header, &hidden);
    assert_eq!(
        Request::decode(&bytes, &Limits::DEFAULT).unwrap(),
        Request::Step {
            header: header.clone(),
            hidden: hidden.view()
        }
    );
    let token = SessionToken([9; 16]);
    let bytes = PushStep::encode(token, &header, &proof(), &hidden);
    let push = PushStep::decode(&bytes, &Limits::DEFAULT).unwrap();
    assert_eq!(push.token, token);
    assert_eq!(push.header, header);
    assert_eq!(push.proof, proof());
    assert_eq!(push.hidden, hidden.view());
    for len in 0..bytes.len() {
        assert!(PushStep::decode(&bytes[..len], &Limits::DEFAULT).is_err());
    }
    // A push is not a request on a session stream, nor the reverse.
    assert!(Request::decode(&bytes, &Limits::DEFAULT).is_err());
    assert!(PushStep::decode(&encode_step(0, &hidden), &Limits::DEFAULT).is_err());
}

#[test]
fn a_push_route_over_the_limit_is_refused_before_it_is_read() {
    let hidden = TensorPayload::new(WireDType::F16, vec![1, 1, 1], vec![0; 2]).unwrap();
    let mut bytes = encode_step(0, &hidden);
    // The route count sits after the tag, start and step id.
    bytes[9] = (MAX_PUSH_TARGETS + 1) as u8;
    assert_eq!(
        Request::decode(&bytes, &Limits::DEFAULT),
        Err(ProtocolError::PushRouteTooLong(MAX_PUSH_TARGETS + 1))
    );
    // Senders cut an overlong route to the limit.
    let header = StepHeader {
        push: route(MAX_PUSH_TARGETS + 5),
        ..StepHeader::default()
    };
    match Request::decode(&encode_step_with(&header, &hidden), &Limits::DEFAULT).unwrap() {
        Request::Step { header, .. } => assert_eq!(header.push.len(), MAX_PUSH_TARGETS),
        other => panic!("{other:?}"),
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Request::decode(&bytes, &Limits::DEFAULT);
        let _ = Response::decode(&bytes, &Limits::DEFAULT);
        let _ = PushStep::decode(&bytes, &Limits::DEFAULT);
    }
}
