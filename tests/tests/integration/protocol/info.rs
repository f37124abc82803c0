//! The info protocol, and sessions freeing their caches.

use super::*;

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
