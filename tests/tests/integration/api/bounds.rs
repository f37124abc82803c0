//! The API's connection cap, header deadline and token cap.

use std::sync::Arc;

use super::*;

/// The API's own bounds, on a local model (no swarm needed): idle sockets
/// cannot hold it (a connection cap, a header deadline), a request cannot
/// ask for more tokens than its cap.
#[test]
fn the_api_bounds_its_connections_header_time_and_tokens() {
    use std::io::Read;
    let model = corolla_tests::tiny_llama();
    let api = Api::start(&[
        "--model",
        model.to_str().unwrap(),
        "--local",
        "--max-connections",
        "8",
        "--header-timeout",
        "1",
        "--max-tokens-cap",
        "16",
    ]);
    // Eight sockets that never send a byte take every connection slot:
    // a ninth is closed on arrival.
    let idle = every_slot_idle(&api, 8);
    let mut buf = [0u8; 64];
    // The idle ones are closed at the header deadline, and the API serves again.
    let started = Instant::now();
    for mut socket in idle {
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let read = socket.read(&mut buf);
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    let closed_after = started.elapsed();
    assert!(closed_after < Duration::from_secs(3), "{closed_after:?}");
    let auth = format!("Authorization: Bearer {KEY}");
    let models = curl(&["-s", "-H", &auth, &format!("{}/models", api.base)]);
    assert!(models.contains("tiny-llama"), "{models}");
    // A request for more tokens than the cap is refused, naming the cap.
    let body = serde_json::json!({
        "model": "tiny-llama-a",
        "prompt": "Hello",
        "max_tokens": 17,
    })
    .to_string();
    let (status, json) = post_completion(&api, &body);
    assert_eq!(status, "400", "{json}");
    let json: Value = serde_json::from_str(&json).expect("a JSON error");
    assert_eq!(json["error"]["code"], "bad_request", "{json}");
    assert!(
        json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cap of 16"),
        "{json}"
    );
    println!("API bounds: 9th connection closed, 8 idle sockets closed after {closed_after:?}");
    corolla_tests::reliability::Figures::of(
        "api::bounds::the_api_bounds_its_connections_header_time_and_tokens",
    )
    .set(
        "idle_closed_s",
        format!("{:.1}", closed_after.as_secs_f64()),
    )
    .save();
}

/// `slots` sockets from this host that never send a byte, holding every
/// connection slot of `api`; checked by a next one from this host, which
/// must be closed on arrival.
fn every_slot_idle(api: &Api, slots: usize) -> Vec<std::net::TcpStream> {
    use std::io::{Read, Write};
    let addr = api
        .base
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .to_string();
    let idle = (0..slots)
        .map(|_| std::net::TcpStream::connect(&addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut next = std::net::TcpStream::connect(&addr).expect("connect");
    next.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = next.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
    let read = next.read(&mut [0u8; 64]);
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "a connection over the cap was served: {read:?}"
    );
    idle
}

/// Connections are shared between hosts: one host's idle sockets holding
/// every slot refuse its own next connection, not another host's (which
/// takes the newest of them), so a flood from one address cannot keep the
/// API from everyone else.
#[test]
fn one_host_cannot_hold_every_connection() {
    use std::io::Read;
    let model = corolla_tests::tiny_llama();
    let api = Api::start(&[
        "--model",
        model.to_str().unwrap(),
        "--local",
        "--max-connections",
        "8",
        "--header-timeout",
        "30",
    ]);
    // Its own ninth is closed on arrival.
    let idle = every_slot_idle(&api, 8);
    let mut buf = [0u8; 64];
    // Another host (127.0.0.2: loopback, another address) is served at once,
    // well within the idle sockets' 30 s header deadline.
    let started = Instant::now();
    let auth = format!("Authorization: Bearer {KEY}");
    let models = curl(&[
        "-s",
        "--max-time",
        "10",
        "--interface",
        "127.0.0.2",
        "-H",
        &auth,
        &format!("{}/models", api.base),
    ]);
    let served_in = started.elapsed();
    assert!(models.contains("tiny-llama"), "{models}");
    assert!(served_in < Duration::from_secs(10), "{served_in:?}");
    // It took the newest idle socket's slot; the others still wait.
    let mut closed = 0;
    for mut socket in idle {
        socket
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        closed += usize::from(matches!(socket.read(&mut buf), Ok(0)));
    }
    assert_eq!(closed, 1, "exactly one idle socket gave its slot");
    println!("one host's 8 idle sockets: another host served in {served_in:?}, 1 socket evicted");
    corolla_tests::reliability::Figures::of("api::bounds::one_host_cannot_hold_every_connection")
        .set("served_ms", served_in.as_millis())
        .save();
}

/// A completion request from `interface`: the status, the `Retry-After`
/// header if any, and the body.
fn completion_from(api: &Api, interface: &str, body: &str) -> (u16, Option<String>, String) {
    let out = curl(&[
        "-s",
        "-i",
        "--max-time",
        "60",
        "--interface",
        interface,
        "-H",
        &format!("Authorization: Bearer {KEY}"),
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
        &format!("{}/completions", api.base),
    ]);
    let (head, body) = out.split_once("\r\n\r\n").expect("a response head");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    let retry_after = head.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("retry-after")
            .then(|| value.trim().to_string())
    });
    (status, retry_after, body.to_string())
}

/// Answers are shared between client addresses: a burst of 24 requests
/// from one host on an API generating 2 at once gets its 2, queues 2 and
/// is refused busy (429, `Retry-After`) for the rest, at once; a request
/// from another host during the burst is served, and so is the burst's
/// host once it ended.
#[test]
fn a_burst_from_one_host_is_refused_busy_and_leaves_room_for_others() {
    let model = corolla_tests::tiny_llama();
    let api = Arc::new(Api::start(&[
        "--model",
        model.to_str().unwrap(),
        "--local",
        "--max-concurrent",
        "2",
    ]));
    let body = serde_json::json!({
        "model": "tiny-llama-a",
        "prompt": "Hello",
        "max_tokens": 200,
        "temperature": 0,
    })
    .to_string();
    let burst: Vec<_> = (0..24)
        .map(|_| {
            let (api, body) = (api.clone(), body.clone());
            std::thread::spawn(move || completion_from(&api, "127.0.0.1", &body))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let (other, _, other_body) = completion_from(&api, "127.0.0.2", &body);
    let other_took = started.elapsed();
    let replies: Vec<_> = burst.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(other, 200, "another host during the burst: {other_body}");
    let served = replies.iter().filter(|(s, _, _)| *s == 200).count();
    let refused: Vec<_> = replies.iter().filter(|(s, _, _)| *s != 200).collect();
    for (status, retry_after, body) in &refused {
        assert_eq!(*status, 429, "{body}");
        let json: Value = serde_json::from_str(body).expect("a JSON error");
        assert_eq!(json["error"]["code"], "busy", "{json}");
        assert!(
            retry_after
                .as_deref()
                .and_then(|s| s.parse::<u32>().ok())
                .is_some(),
            "no Retry-After: {body}"
        );
    }
    assert!(
        !refused.is_empty() && served >= 2,
        "{served} served, {} refused",
        refused.len()
    );
    let (after, _, after_body) = completion_from(&api, "127.0.0.1", &body);
    assert_eq!(after, 200, "after the burst: {after_body}");
    println!(
        "API with 2 answers at once: a burst of 24 from one host, {served} served and {} \
         refused busy; another host served in {other_took:?}; the burst's host served after it",
        refused.len()
    );
    corolla_tests::reliability::Figures::of(
        "api::bounds::a_burst_from_one_host_is_refused_busy_and_leaves_room_for_others",
    )
    .set("served", served)
    .set("refused", refused.len())
    .set("other_ms", other_took.as_millis())
    .save();
}
