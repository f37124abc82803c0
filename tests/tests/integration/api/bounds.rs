//! The API's connection cap, header deadline and token cap.

use super::*;

/// The API's own bounds, on a local model (no swarm needed): idle sockets
/// cannot hold it (a connection cap, a header deadline), a request cannot
/// ask for more tokens than its cap.
#[test]
fn the_api_bounds_its_connections_header_time_and_tokens() {
    use std::io::{Read, Write};
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
    let addr = api
        .base
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .to_string();
    // Eight sockets that never send a byte take every connection slot:
    // a ninth is closed on arrival.
    let idle: Vec<std::net::TcpStream> = (0..8)
        .map(|_| std::net::TcpStream::connect(&addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut ninth = std::net::TcpStream::connect(&addr).expect("connect");
    ninth
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = ninth.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut buf = [0u8; 64];
    let read = ninth.read(&mut buf);
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "a connection over the cap was served: {read:?}"
    );
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
