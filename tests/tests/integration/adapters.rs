//! LoRA adapters against transformers + PEFT (`tests/reference/adapters_reference.py`):
//! PEFT folders and GGUF adapters, over the transformers folder and the GGUF
//! file of the same base, split at every layer boundary, and sessions with
//! different adapters in one decode batch.

use corolla_model::{AdapterFile, BlockSpan, Checkpoint, ClientHead, DType, Device, Tensor};
use corolla_tests::{fixtures_dir, generate_local_with_adapter};

use crate::golden::families::{ids, last_logits_error};
use serde_json::Value;

fn golden() -> Value {
    corolla_tests::fixture_json("adapters/golden.json")
}

/// `family`'s client head and spans `ranges`, from the transformers folder
/// or (with `gguf`) the GGUF file.
fn base(family: &str, gguf: bool, ranges: &[(usize, usize)]) -> (ClientHead, Vec<BlockSpan>) {
    let (_, head, spans) = crate::golden::families::load(family, gguf, ranges);
    (head, spans)
}

fn adapter(file: &str) -> AdapterFile {
    AdapterFile::open(fixtures_dir().join("adapters").join(file)).unwrap()
}

/// Every adapter file over both forms of its base, in one span and in three:
/// PEFT's greedy tokens and last logits.
#[test]
fn adapters_generate_what_transformers_with_peft_generates() {
    let golden = golden();
    let cases = [
        ("llama3-alpha", "llama3-alpha"),
        ("llama3-alpha", "llama3-alpha.gguf"),
        ("llama3-beta", "llama3-beta"),
        ("qwen3-alpha", "qwen3-alpha"),
        ("qwen3-alpha", "qwen3-alpha.gguf"),
    ];
    for (name, file) in cases {
        let reference = &golden["adapters"][name];
        let family = reference["family"].as_str().unwrap();
        let adapter = adapter(file);
        for gguf_base in [false, true] {
            for ranges in [&[(0, 3)][..], &[(0, 1), (1, 2), (2, 3)]] {
                let (head, spans) = base(family, gguf_base, ranges);
                for run in reference["runs"].as_array().unwrap() {
                    let prompt = ids(&run["prompt_ids"]);
                    let want = ids(&run["generated_ids"]);
                    let case = format!(
                        "{file} over {family} (gguf {gguf_base}) {ranges:?}, prompt of {}",
                        prompt.len()
                    );
                    let got =
                        generate_local_with_adapter(&head, &spans, &adapter, &prompt, want.len());
                    assert_eq!(got, want, "{case}");
                    let mut hidden = head.embed(&prompt).unwrap();
                    for span in &spans {
                        let mut cache = span.new_cache(prompt.len()).unwrap();
                        cache.set_adapter(Some(span.adapter(&adapter).unwrap()));
                        hidden = span.forward(&hidden, 0, &mut cache).unwrap();
                    }
                    let err = last_logits_error(run, &head.last_logits(&hidden).unwrap());
                    assert!(err < 1e-4, "{case}: logits relative error {err}");
                }
            }
        }
    }
}

/// Three sessions (two adapters and none) decoding in one batch over kept
/// Q8_0 weights (what a server runs) give each the bits it gets alone.
#[test]
fn sessions_with_different_adapters_batch_together() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-q8.gguf");
    // Tiny Llama's shape is Llama 3's fixture's, with a fourth layer.
    corolla_tests::write_tiny_gguf(&path, true, None);
    let ck = Checkpoint::open(&path).unwrap();
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let span = BlockSpan::load(&ck, 0, 4, DType::F32, &Device::Cpu).unwrap();
    let choices = [
        Some(span.adapter(&adapter("llama3-alpha")).unwrap()),
        None,
        Some(span.adapter(&adapter("llama3-beta")).unwrap()),
    ];
    let prompt = [1u32, 17, 200, 33, 901, 45];
    let steps = 6;
    let token = |step: usize| head.embed(&[(step * 37 + 5) as u32]).unwrap();
    let prefilled = |choice: &Option<corolla_model::SpanAdapter>| {
        let mut cache = span.new_cache(prompt.len() + steps).unwrap();
        cache.set_adapter(choice.clone());
        span.forward(&head.embed(&prompt).unwrap(), 0, &mut cache)
            .unwrap();
        cache
    };
    let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // Alone: one decode step at a time.
    let alone: Vec<Vec<Vec<f32>>> = choices
        .iter()
        .map(|choice| {
            let mut cache = prefilled(choice);
            (0..steps)
                .map(|step| {
                    let mut one = [(token(step), prompt.len() + step, &mut cache)];
                    values(&span.forward_decode_batch(&mut one).unwrap()[0])
                })
                .collect()
        })
        .collect();
    // Together.
    let mut caches: Vec<_> = choices.iter().map(prefilled).collect();
    let mut expected: Vec<_> = alone.iter().map(|steps| steps.iter()).collect();
    for step in 0..steps {
        let mut batch: Vec<_> = caches
            .iter_mut()
            .map(|cache| (token(step), prompt.len() + step, cache))
            .collect();
        let outs = span.forward_decode_batch(&mut batch).unwrap();
        for (session, out) in outs.iter().enumerate() {
            let want = expected[session].next().unwrap();
            assert_eq!(&values(out), want, "session {session} step {step}");
        }
    }
    // The adapters change the outputs (the test would pass vacuously otherwise).
    assert_ne!(alone[0][steps - 1], alone[1][steps - 1]);
    assert_ne!(alone[0][steps - 1], alone[2][steps - 1]);
}

/// Adapters that do not fit the base are refused with what is wrong.
#[test]
fn adapters_that_do_not_fit_are_refused() {
    let (_, spans) = base("qwen3", false, &[(0, 3)]);
    // Llama 3's adapter: its projections are [64, 64]; Qwen3's queries are 128 wide.
    let err = spans[0]
        .adapter(&adapter("llama3-alpha"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("do not fit"), "{err}");
    let (_, spans) = base("llama3", false, &[(0, 3)]);
    let err = spans[0]
        .adapter(&adapter("qwen3-alpha.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("qwen3 architecture"), "{err}");
    let (_, spans) = base("mixtral", false, &[(0, 3)]);
    let err = spans[0]
        .adapter(&adapter("llama3-alpha"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("mixture of experts"), "{err}");
    let err = AdapterFile::open(fixtures_dir().join("families/llama3.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a LoRA adapter"), "{err}");
    let err = AdapterFile::open(fixtures_dir().join("families/llama3"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("adapter_config.json"), "{err}");
}

mod through_the_swarm {
    //! Servers announce the adapters they load (PEFT folders and a GGUF
    //! adapter under one name), clients pick one per session, and the tokens
    //! are transformers + PEFT's.

    use corolla_tests::{corolla_bin, fixtures_dir, start_model_server};

    use serde_json::Value;

    async fn generate(peers: &str, adapter: Option<&str>, prompt: &str) -> std::process::Output {
        let model = fixtures_dir().join("families/llama3");
        let mut cmd = tokio::process::Command::new(corolla_bin());
        cmd.args(["generate", "--model", model.to_str().unwrap(), "--json"])
            .args([
                "--max-new-tokens",
                "24",
                "--ignore-eos",
                "--initial-peers",
                peers,
            ])
            .args(["--discovery-timeout", "5", "--prompt", prompt])
            .env("RUST_LOG", "warn");
        if let Some(adapter) = adapter {
            cmd.args(["--adapter", adapter]);
        }
        cmd.output().await.expect("run corolla")
    }

    fn json(out: &std::process::Output) -> Value {
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}): {} / {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn clients_pick_an_adapter_per_session_and_get_peft_tokens() {
        let golden = super::golden();
        let families: Value = serde_json::from_slice(
            &std::fs::read(fixtures_dir().join("families/golden.json")).unwrap(),
        )
        .unwrap();
        let model = fixtures_dir().join("families/llama3");
        let adapters = fixtures_dir().join("adapters");
        let path = |name: &str| adapters.join(name).to_str().unwrap().to_string();
        // Both servers load the same two adapters; the second reads alpha
        // from its GGUF file.
        let flags = |alpha: &str| {
            [
                "--update-period".to_string(),
                "2s".into(),
                "--adapter".into(),
                format!("alpha={}", path(alpha)),
                "--adapter".into(),
                format!("beta={}", path("llama3-beta")),
            ]
        };
        let (first_flags, second_flags) = (flags("llama3-alpha"), flags("llama3-alpha.gguf"));
        let first_flags: Vec<&str> = first_flags.iter().map(String::as_str).collect();
        let second_flags: Vec<&str> = second_flags.iter().map(String::as_str).collect();
        let first = start_model_server(&model, "0:2", None, &first_flags).await;
        let peers = first.tcp_addr().expect("tcp address").to_string();
        let second = start_model_server(&model, "2:3", Some(&peers), &second_flags).await;
        // One hop for the whole model, without adapters: the route a client
        // without an adapter may take, and one with an adapter must not.
        let plain =
            start_model_server(&model, "0:3", Some(&peers), &["--update-period", "2s"]).await;
        let plain_id = plain.peer_id().to_string();
        let prompt = families["families"]["llama3"][0]["prompt"]
            .as_str()
            .unwrap();

        // Two sessions with different adapters at once (where their decode
        // steps meet, a server batches them; the batched math is checked by
        // `sessions_with_different_adapters_batch_together`).
        let (alpha, beta) = tokio::join!(
            generate(&peers, Some("alpha"), prompt),
            generate(&peers, Some("beta"), prompt)
        );
        for (name, out) in [("llama3-alpha", alpha), ("llama3-beta", beta)] {
            let out = json(&out);
            let want = &golden["adapters"][name]["runs"][0];
            assert_eq!(out["prompt_ids"], want["prompt_ids"], "{name}");
            assert_eq!(out["generated_ids"], want["generated_ids"], "{name}: {out}");
            let route = out["route"].as_array().expect("route");
            assert_eq!(route.len(), 2, "{name}: {out}");
            assert!(
                !out["route"].to_string().contains(&plain_id),
                "{name}: {out}"
            );
        }
        // Without an adapter: the base model's tokens.
        let out = json(&generate(&peers, None, prompt).await);
        assert_eq!(
            out["generated_ids"],
            families["families"]["llama3"][0]["generated_ids"]
        );
        // An adapter nobody runs: a clear refusal, as a kind.
        let out = generate(&peers, Some("gamma"), prompt).await;
        assert!(!out.status.success());
        let error = json(&out)["error"].clone();
        assert_eq!(error["kind"], "no_coverage", "{error}");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains("no server runs adapter \"gamma\""),
            "{message}"
        );
        // Records name the adapters; a server without any announces none.
        assert_eq!(first.record().adapters, ["alpha", "beta"]);
        assert_eq!(second.record().adapters, ["alpha", "beta"]);
        assert!(plain.record().adapters.is_empty());
        for server in [first, second, plain] {
            server.shutdown();
        }
    }
}
