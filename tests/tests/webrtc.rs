//! WebRTC-direct with real libp2p-webrtc on both ends: a 4 MiB step each way
//! in one session, which needs the flow-controlled framing (pieces of at
//! most 8000 bytes, an acknowledged window). ICE ignores loopback, so the
//! server runs in a network namespace this test creates, behind a veth pair.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use corolla_model::random::{write_random_checkpoint, RandomSpec};
use corolla_model::wire::{from_view, to_payload};
use corolla_model::{BlockSpan, Checkpoint, DType, Device, Tensor};
use corolla_shared::flow::BROWSER_WINDOW;
use corolla_shared::native::{build_swarm, new_webrtc_certificate, ServerTransports};
use corolla_shared::node::Node;
use corolla_shared::protocol::OpenRequest;
use corolla_shared::session::RemoteSession;
use corolla_shared::WireDType;
use corolla_tests::{corolla_server_bin, relative_l2};
use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;

/// A network namespace with a veth pair to this one; removed when dropped,
/// with the server running inside it.
struct Namespace {
    name: String,
    host_ip: String,
    inner_ip: String,
    server: Option<Child>,
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Namespace {
    fn create() -> Option<Self> {
        let id = std::process::id() % 200 + 20;
        let name = format!("corolla-rtc-{id}");
        let (outer, inner) = (format!("crtc{id}a"), format!("crtc{id}b"));
        let ns = Namespace {
            host_ip: format!("10.201.{id}.1"),
            inner_ip: format!("10.201.{id}.2"),
            name: name.clone(),
            server: None,
        };
        let _ = ip(&["netns", "del", &name]);
        if !ip(&["netns", "add", &name]) {
            return None;
        }
        let ok = ip(&[
            "link", "add", &outer, "type", "veth", "peer", "name", &inner,
        ]) && ip(&["link", "set", &inner, "netns", &name])
            && ip(&["addr", "add", &format!("{}/24", ns.host_ip), "dev", &outer])
            && ip(&["link", "set", &outer, "up"])
            && ip(&[
                "-n",
                &name,
                "addr",
                "add",
                &format!("{}/24", ns.inner_ip),
                "dev",
                &inner,
            ])
            && ip(&["-n", &name, "link", "set", &inner, "up"])
            && ip(&["-n", &name, "link", "set", "lo", "up"]);
        assert!(ok, "could not wire the namespace {name}");
        Some(ns)
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        if let Some(mut child) = self.server.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Deleting the namespace deletes the veth pair with it.
        let _ = ip(&["netns", "del", &self.name]);
    }
}

const HIDDEN: usize = 2048;
const POSITIONS: usize = 512;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_mib_each_way_over_webrtc_direct() {
    let Some(mut ns) = Namespace::create() else {
        eprintln!("SKIPPED: cannot create a network namespace (needs root and iproute2)");
        return;
    };
    let spec = RandomSpec {
        hidden_size: HIDDEN,
        num_layers: 1,
        num_heads: 16,
        num_kv_heads: 8,
        intermediate_size: 1024,
        vocab_size: 64,
        max_positions: POSITIONS,
        seed: 5,
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("wide");
    write_random_checkpoint(&dir, &spec).unwrap();
    let addr_file = tmp.path().join("addr.json");
    let server = Command::new("ip")
        .args(["netns", "exec", &ns.name])
        .arg(corolla_server_bin())
        .arg("--model")
        .arg(&dir)
        .args([
            "--block-indices",
            "0:1",
            "--host",
            &ns.inner_ip,
            "--port",
            "0",
            "--new-swarm",
        ])
        .args(["--inference-max-length", &POSITIONS.to_string()])
        .arg("--addr-file")
        .arg(&addr_file)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    ns.server = Some(server);
    let started = Instant::now();
    while !addr_file.is_file() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the server did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let addrs: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&addr_file).unwrap()).unwrap();
    let webrtc: Multiaddr = addrs["addrs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str()?.parse().ok())
        .find(|a: &Multiaddr| a.iter().any(|p| matches!(p, Protocol::WebRTCDirect)))
        .expect("a WebRTC-direct address");
    let mut base = webrtc.clone();
    let Some(Protocol::P2p(peer)) = base.pop() else {
        panic!("{webrtc} has no peer id")
    };

    // A client that speaks WebRTC-direct (it must listen to dial: one UDP socket both ways).
    let key = libp2p::identity::Keypair::generate_ed25519();
    let swarm = build_swarm(
        key,
        Duration::from_secs(60),
        Some(ServerTransports {
            webrtc: new_webrtc_certificate().unwrap(),
            websocket_tls: None,
        }),
    )
    .await
    .unwrap();
    let (mut node, handle, _events) = Node::new(swarm);
    node.client_dht();
    let listen: Multiaddr = format!("/ip4/{}/udp/0/webrtc-direct", ns.host_ip)
        .parse()
        .unwrap();
    node.swarm_mut().listen_on(listen).unwrap();
    node.swarm_mut()
        .behaviour_mut()
        .kad
        .add_address(&peer, base.clone());
    node.swarm_mut().add_peer_address(peer, base);
    node.swarm_mut().dial(peer).unwrap();
    tokio::spawn(node.run());

    let hidden = Tensor::randn(0f32, 1.0, (1, POSITIONS, HIDDEN), &Device::Cpu).unwrap();
    let payload = to_payload(&hidden, WireDType::F32).unwrap();
    assert!(payload.data.len() >= 4 << 20);
    let expected = {
        let ck = Checkpoint::open(&dir).unwrap();
        let span = BlockSpan::load(&ck, 0, 1, DType::F32, &Device::Cpu).unwrap();
        let mut cache = span.new_cache(POSITIONS).unwrap();
        span.forward(&hidden, 0, &mut cache).unwrap()
    };
    let open = |flow_window| OpenRequest {
        model: "wide".into(),
        fingerprint: String::new(),
        start: 0,
        end: 1,
        max_length: POSITIONS as u32,
        dtype: WireDType::F32,
        flow_window,
    };

    // ICE sometimes times out on a first dial: retry, as clients do.
    let mut control = handle.control();
    let mut session = None;
    for attempt in 0..3 {
        match RemoteSession::open(
            &mut control,
            peer,
            open(BROWSER_WINDOW),
            Duration::from_secs(20),
        )
        .await
        {
            Ok(s) => {
                session = Some(s);
                break;
            }
            Err(e) => eprintln!("dial attempt {attempt} failed: {e}"),
        }
    }
    let mut session = session.expect("a WebRTC-direct session");
    let out = session
        .step(0, &payload)
        .await
        .expect("a 4 MiB step under flow control");
    let out = from_view(&out.view(), &Device::Cpu).unwrap();
    let err = relative_l2(&out, &expected);
    assert!(err < 1e-5, "relative error {err}");
    // A decode step on the same session still works.
    let one = to_payload(&hidden.narrow(1, 0, 1).unwrap(), WireDType::F32).unwrap();
    assert!(session.step(0, &one).await.is_ok());
    session.close().await;

    // Without the flow-controlled framing the same step does not get through.
    let plain = RemoteSession::open(&mut control, peer, open(0), Duration::from_secs(20)).await;
    if let Ok(mut plain) = plain {
        let got = tokio::time::timeout(Duration::from_secs(20), plain.step(0, &payload)).await;
        assert!(
            !matches!(got, Ok(Ok(_))),
            "a plain 4 MiB frame crossed WebRTC-direct"
        );
    }
}
