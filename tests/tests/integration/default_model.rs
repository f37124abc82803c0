//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end: the
//! `corolla` commands a user runs first, through real servers.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use corolla_model::fingerprint::keeps_quantized;
use corolla_tests::{
    corolla_bin, default_model, start_model_server, LlamaCppReference, SmolReference,
};
use serde_json::Value;

const FRANCE: &str = "What is the capital of France?";
/// The default model kept quantized answers this one right at once (and
/// France's only after it: "L'Étoile, la Marseillaise", as llama.cpp does).
const GERMANY: &str = "What is the capital of Germany?";

fn corolla(args: &[&str]) -> std::process::Output {
    let out = Command::new(corolla_bin())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run corolla");
    assert!(
        out.status.success(),
        "corolla {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn generate_json(model: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--json",
        "--max-new-tokens",
        "24",
    ];
    args.extend_from_slice(extra);
    serde_json::from_slice(&corolla(&args).stdout).expect("json")
}

/// The float model (the blocks dequantized) gives transformers' tokens.
#[test]
fn generate_dequantized_answers_the_capital_of_france_with_paris() {
    let Some(model) = default_model() else { return };
    let out = generate_json(
        &model,
        &[
            "--local",
            "--quantized",
            "dequantize",
            "--chat",
            "--prompt",
            FRANCE,
        ],
    );
    let text = out["text"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text:?}");
    let reference = &SmolReference::load().runs[0];
    let ids: Vec<u32> = serde_json::from_value(out["generated_ids"].clone()).unwrap();
    assert_eq!(ids, reference.generated_ids);
    assert_eq!(out["stop_reason"], "end_of_sequence");
}

/// `--local` and three servers, both kept quantized by default: the same
/// tokens, which part from llama.cpp's only at near ties
/// (`gguf::auto_keeps_the_default_model_quantized_and_decodes_as_llama_cpp`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_servers_of_ten_blocks_give_the_local_tokens() {
    let Some(model) = default_model() else { return };
    let extra = ["--update-period", "5s"];
    let first = start_model_server(&model, "0:10", None, &extra).await;
    let peer = first.tcp_addr().expect("tcp address").to_string();
    let second = start_model_server(&model, "10:20", Some(&peer), &extra).await;
    let third = start_model_server(&model, "20:30", Some(&peer), &extra).await;
    for server in [&first, &second, &third] {
        assert!(
            server
                .record()
                .block_hashes
                .iter()
                .all(|h| keeps_quantized(h)),
            "a default server keeps the GGUF's blocks quantized"
        );
    }
    let reference = LlamaCppReference::load();
    let model2 = model.clone();
    let outputs = tokio::task::spawn_blocking(move || {
        reference
            .runs
            .iter()
            .map(|run| {
                let mut args = vec!["--prompt", &run.prompt];
                if run.chat {
                    args.push("--chat");
                }
                let local = generate_json(&model2, &[&args[..], &["--local"]].concat());
                let swarm =
                    generate_json(&model2, &[&args[..], &["--initial-peers", &peer]].concat());
                (run.clone(), local, swarm)
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    for (run, local, swarm) in outputs {
        let ids: Vec<u32> = serde_json::from_value(swarm["generated_ids"].clone()).unwrap();
        let local: Vec<u32> = serde_json::from_value(local["generated_ids"].clone()).unwrap();
        assert_eq!(ids, local, "{:?}", run.prompt);
        let spans: Vec<(u64, u64)> = swarm["route"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| (h["start"].as_u64().unwrap(), h["end"].as_u64().unwrap()))
            .collect();
        assert_eq!(spans, vec![(0, 10), (10, 20), (20, 30)]);
    }
    for server in [first, second, third] {
        server.shutdown();
    }
}

#[test]
fn demo_starts_a_local_swarm_and_answers() {
    let Some(model) = default_model() else { return };
    let web = tempfile::tempdir().unwrap();
    std::fs::write(
        web.path().join("index.html"),
        "<!doctype html><title>chat</title>",
    )
    .unwrap();
    let out = corolla(&[
        "demo",
        "--model",
        model.to_str().unwrap(),
        "--http-port",
        "0",
        "--web-dir",
        web.path().to_str().unwrap(),
        "--prompt",
        GERMANY,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("Berlin"), "{stdout:?}");
    assert!(
        !stderr.contains("web chat: http://"),
        "a page that dies with the one answer must not be offered: {stderr}"
    );
    for span in ["0..10", "10..20", "20..30"] {
        assert!(stderr.contains(span), "route {span} missing: {stderr}");
    }
}

/// `corolla chat --local` with piped stdin, stdout and stderr.
fn spawn_chat(model: &Path, max_new_tokens: &str) -> std::process::Child {
    Command::new(corolla_bin())
        .args(["chat", "--local", "--model", model.to_str().unwrap()])
        .args(["--max-new-tokens", max_new_tokens])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn chat_keeps_the_conversation_across_turns() {
    let Some(model) = default_model() else { return };
    let mut child = spawn_chat(&model, "32");
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{GERMANY}\nAnd what is the capital of France?").unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout:?}");
    assert!(lines[0].contains("Berlin"), "{stdout:?}");
    assert!(lines[1].contains("Paris"), "{stdout:?}");
}

#[test]
fn ctrl_c_stops_an_answer_but_not_the_chat() {
    let Some(model) = default_model() else { return };
    let mut child = spawn_chat(&model, "400");
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    writeln!(
        stdin,
        "Write a very long story about a dragon who learns to cook."
    )
    .unwrap();
    // Wait for the answer to start streaming, then interrupt it.
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();
    let started = Instant::now();
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut stopped_answer = String::new();
    stdout.read_line(&mut stopped_answer).unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the answer did not stop"
    );
    writeln!(stdin, "{GERMANY}").unwrap();
    drop(stdin);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("stopped"), "{stderr}");
    assert!(rest.contains("Berlin"), "{rest:?}");
    // The stopped answer was short of the 400 tokens it could have had.
    let first_stats = stderr.lines().find(|l| l.contains("tokens/s")).unwrap();
    let n: usize = first_stats
        .trim_start_matches('[')
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(n < 400, "{first_stats}");
}

#[test]
fn converted_gguf_parts_answer_like_the_file() {
    let Some(model) = default_model() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let parts = tmp.path().join("parts");
    corolla(&[
        "convert",
        "--model",
        model.to_str().unwrap(),
        "--out",
        parts.to_str().unwrap(),
        "--blocks-per-file",
        "10",
    ]);
    for file in [
        "client.gguf",
        "blocks-00000-00010.gguf",
        "blocks-00020-00030.gguf",
        "config.json",
    ] {
        assert!(parts.join(file).is_file(), "{file} missing");
    }
    let question = ["--local", "--chat", "--prompt", FRANCE];
    let parts_out = generate_json(&parts, &question);
    let file_out = generate_json(&model, &question);
    assert_eq!(parts_out["generated_ids"], file_out["generated_ids"]);
    let dequantize = ["--quantized", "dequantize"];
    let out = generate_json(&parts, &[&question[..], &dequantize].concat());
    let ids: Vec<u32> = serde_json::from_value(out["generated_ids"].clone()).unwrap();
    assert_eq!(ids, SmolReference::load().runs[0].generated_ids);
}

/// Starts `corolla demo` on the default model, waits for its swarm, sends
/// `signal` to it and checks that its first server stops listening. With
/// `closed_stdin`, the demo must keep serving its web chat until then.
fn demo_servers_stop_on(model: &Path, signal: &str, closed_stdin: bool) {
    let web = tempfile::tempdir().unwrap();
    std::fs::write(web.path().join("index.html"), "<!doctype html>").unwrap();
    let mut child = Command::new(corolla_bin())
        .args([
            "demo",
            "--model",
            model.to_str().unwrap(),
            "--http-port",
            "0",
            "--web-dir",
            web.path().to_str().unwrap(),
        ])
        .stdin(if closed_stdin {
            Stdio::null()
        } else {
            Stdio::piped()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _stdin = child.stdin.take();
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut port = None;
    for line in stderr.by_ref() {
        let line = line.unwrap();
        if let Some(addr) = line.strip_prefix("local swarm ready; bootstrap address ") {
            let tcp = addr.split("/tcp/").nth(1).unwrap();
            port = Some(tcp.split('/').next().unwrap().parse::<u16>().unwrap());
            if !closed_stdin {
                break;
            }
        }
        if line.contains("the web chat stays up at http://127.0.0.1:") {
            break;
        }
    }
    let port = port.expect("the demo reports its swarm");
    if closed_stdin {
        std::thread::sleep(Duration::from_secs(1));
        assert!(
            child.try_wait().unwrap().is_none(),
            "the demo must keep serving when its input is closed"
        );
    }
    // Keep reading: a closed pipe would make the demo's next line fail.
    let drain = std::thread::spawn(move || stderr.map_while(Result::ok).count());
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    let status = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    let _ = drain.join();
    if signal == "-TERM" {
        assert!(exit.success(), "{exit}");
    }
    // A killed demo cannot remove its servers' log folder.
    let _ =
        std::fs::remove_dir_all(std::env::temp_dir().join(format!("corolla-demo-{}", child.id())));
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the first server still listens after the demo ended ({signal})"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn demo_stops_its_servers_when_terminated() {
    let Some(model) = default_model() else { return };
    demo_servers_stop_on(&model, "-TERM", true);
}

#[test]
fn demo_servers_die_with_a_killed_demo() {
    let Some(model) = default_model() else { return };
    demo_servers_stop_on(&model, "-KILL", false);
}

/// Starts a server of the default model that sizes its span from
/// `memory_limit` (`--num-blocks auto`) and places it itself.
async fn start_auto_server(
    model: &Path,
    memory_limit: u64,
    join: &str,
    extra: &[&str],
) -> corolla_server::RunningServer {
    let mut args: Vec<String> = ["corolla-server", "--model"].map(String::from).to_vec();
    args.push(model.to_string_lossy().into_owned());
    args.extend(
        [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--initial-peers",
            join,
            "--memory-limit",
            &memory_limit.to_string(),
        ]
        .map(String::from),
    );
    args.extend(extra.iter().map(|s| s.to_string()));
    let args = corolla_server::ServerArgs::from_args_and_file(args).expect("server flags");
    corolla_server::Server::start(args)
        .await
        .expect("server starts")
}

/// Blocks `0..n` all served by some of `servers`.
fn covered(servers: &[&corolla_server::RunningServer], n: usize) -> bool {
    (0..n).all(|b| {
        servers.iter().any(|s| {
            let (start, end) = s.blocks();
            (start..end).contains(&b)
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_auto_servers_spread_out_while_an_answer_runs() {
    let Some(model) = default_model() else { return };
    let ck = corolla_model::Checkpoint::open(&model).unwrap();
    let config = ck.config().clone();
    assert_eq!(config.num_hidden_layers, 30);
    // A memory limit for ten of the thirty blocks (f32, dequantized) with
    // 4096 cache positions each, over the margin of 256 MiB. The client's
    // head is dense too: the float reference's tokens.
    let cache_tokens = 4096u64;
    let per_block =
        config.block_parameters() * 4 + cache_tokens * config.cache_bytes_per_token_per_block(4);
    let limit = (256u64 << 20) + per_block * 21 / 2;
    // Two seconds: the answer below is under way before the first look.
    let auto = [
        "--update-period",
        "2s",
        "--dtype",
        "f32",
        "--quantized",
        "dequantize",
        "--cache-tokens",
        "4096",
    ];
    // A slow server with fixed blocks 20..30 keeps the swarm whole from the
    // start; it never moves.
    let fixed = start_model_server(
        &model,
        "20:30",
        None,
        &[
            "--update-period",
            "1s",
            "--step-delay-ms",
            "100",
            "--quantized",
            "dequantize",
        ],
    )
    .await;
    let boot = fixed.tcp_addr().unwrap().to_string();
    let c = start_auto_server(&model, limit, &boot, &auto).await;
    assert_eq!(
        c.blocks(),
        (0, 10),
        "the first automatic server takes the first gap"
    );
    // Two servers starting together see the same swarm and overlap.
    let (a, b) = tokio::join!(
        start_auto_server(&model, limit, &boot, &auto),
        start_auto_server(&model, limit, &boot, &auto)
    );
    assert_eq!(
        (a.blocks(), b.blocks()),
        ((10, 20), (10, 20)),
        "the two overlap"
    );

    // An answer runs while the swarm rebalances: the overlap's weakest
    // neighbour is the slow server's blocks, so one of the two moves there.
    let reference = SmolReference::load().runs[0].clone();
    let answer = {
        let (model, boot, prompt) = (model.clone(), boot.clone(), reference.prompt.clone());
        let chat = reference.chat;
        tokio::task::spawn_blocking(move || {
            let mut args = vec![
                "--initial-peers",
                boot.as_str(),
                "--quantized",
                "dequantize",
                "--prompt",
                prompt.as_str(),
            ];
            if chat {
                args.push("--chat");
            }
            generate_json(&model, &args)
        })
    };
    let started = Instant::now();
    while !covered(&[&a, &b, &c], 30) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no full coverage by the automatic servers: {:?} {:?} {:?}",
            a.blocks(),
            b.blocks(),
            c.blocks()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let moved_after = started.elapsed();
    let out = answer.await.unwrap();
    let ids: Vec<u32> = serde_json::from_value(out["generated_ids"].clone()).unwrap();
    assert_eq!(ids, reference.generated_ids, "the answer during the move");
    let mut spans = [a.blocks(), b.blocks(), c.blocks()];
    spans.sort();
    assert_eq!(spans, [(0, 10), (10, 20), (20, 30)]);
    println!(
        "full coverage {moved_after:?} after the answer started; its route {}, recoveries {}",
        out["route"], out["recoveries"]
    );
    corolla_tests::reliability::Figures::of(
        "default_model::overlapping_auto_servers_spread_out_while_an_answer_runs",
    )
    .set("moved_s", format!("{:.1}", moved_after.as_secs_f64()))
    .save();

    // The automatic servers alone answer now, the same tokens.
    fixed.leave().await;
    let peer = a.tcp_addr().unwrap().to_string();
    let out = tokio::task::spawn_blocking({
        let (model, prompt, chat) = (model.clone(), reference.prompt.clone(), reference.chat);
        move || {
            let mut args = vec![
                "--initial-peers",
                peer.as_str(),
                "--quantized",
                "dequantize",
                "--prompt",
                prompt.as_str(),
            ];
            if chat {
                args.push("--chat");
            }
            generate_json(&model, &args)
        }
    })
    .await
    .unwrap();
    let ids: Vec<u32> = serde_json::from_value(out["generated_ids"].clone()).unwrap();
    assert_eq!(ids, reference.generated_ids, "the answer after the move");
    // Nobody moves once the swarm is even.
    assert_eq!(
        {
            let mut s = [a.blocks(), b.blocks(), c.blocks()];
            s.sort();
            s
        },
        [(0, 10), (10, 20), (20, 30)]
    );
}
