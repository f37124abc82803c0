//! Multi-token steps (prompt-lookup drafts checked in one pass): greedy
//! output stays transformers' tokens, locally, through chained spans, through
//! real servers and on the default model, while repetitive text takes fewer
//! chain steps than tokens.

use corolla_client::{
    generate, Assistant, Conversation, DraftModel, GenerateOutput, GenerateRequest, LocalChain,
};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_server::RunningServer;
use corolla_tests::{
    corolla_bin, default_model, start_server, tiny_llama, tiny_llama_fp16, Golden,
};
use serde_json::Value;
use std::path::Path;

/// The reference prompt that repeats itself ("it was the ... of ..."), whose
/// greedy answer loops: drafts are accepted.
const REPETITIVE: usize = 2;
const NEW_TOKENS: usize = 32;

fn load(ranges: &[(usize, usize)]) -> (ClientHead, Vec<BlockSpan>) {
    let ck = Checkpoint::open(tiny_llama()).unwrap();
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let spans = ranges
        .iter()
        .map(|&(a, b)| BlockSpan::load(&ck, a, b, DType::F32, &Device::Cpu).unwrap())
        .collect();
    (head, spans)
}

fn run_local(
    head: &ClientHead,
    spans: &[BlockSpan],
    prompt_ids: &[u32],
    sampling: SamplingParams,
    drafts: usize,
) -> GenerateOutput {
    let request = GenerateRequest {
        prompt_ids: prompt_ids.to_vec(),
        max_new_tokens: NEW_TOKENS,
        sampling,
        stop_at_eos: false,
        drafts,
    };
    let mut chain = LocalChain::new(spans, request.max_length()).unwrap();
    futures::executor::block_on(generate(head, &mut chain, &request, |_| {
        std::ops::ControlFlow::Continue(())
    }))
    .unwrap()
}

#[test]
fn greedy_drafts_give_the_reference_tokens_in_fewer_steps() {
    let golden = Golden::load(&tiny_llama(), "float32");
    for ranges in [&[(0, 4)][..], &[(0, 1), (1, 3), (3, 4)]] {
        let (head, spans) = load(ranges);
        for (p, prompt) in golden.prompts.iter().enumerate() {
            let greedy = SamplingParams::greedy();
            let off = run_local(&head, &spans, &prompt.input_ids, greedy.clone(), 0);
            let on = run_local(&head, &spans, &prompt.input_ids, greedy, 6);
            assert_eq!(off.generated_ids, prompt.generated_new_ids, "prompt {p}");
            assert_eq!(on.generated_ids, prompt.generated_new_ids, "prompt {p}");
            assert_eq!((off.steps, off.drafted), (NEW_TOKENS - 1, 0));
            assert_eq!(on.steps + 1 + on.accepted, NEW_TOKENS, "prompt {p}");
            eprintln!(
                "spans {ranges:?} prompt {p}: {} steps for {NEW_TOKENS} tokens, {}/{} drafts accepted",
                on.steps, on.accepted, on.drafted
            );
            if p == REPETITIVE {
                assert!(on.accepted > 0, "no draft accepted");
                assert!(on.steps < NEW_TOKENS / 2, "{} steps", on.steps);
            }
        }
    }
}

#[test]
fn sampled_drafts_are_reproducible_change_nothing_and_top_1_sampling_is_greedy() {
    let golden = Golden::load(&tiny_llama(), "float32");
    let (head, spans) = load(&[(0, 4)]);
    let (_, three) = load(&[(0, 1), (1, 3), (3, 4)]);
    let prompt = &golden.prompts[REPETITIVE];
    // The random model's logits are nearly flat: sampled answers do not
    // loop, but they must come out the same through any layout of spans.
    for seed in 0..4 {
        let sampling = SamplingParams {
            temperature: 0.7,
            top_p: Some(0.95),
            seed,
            ..Default::default()
        };
        let a = run_local(&head, &spans, &prompt.input_ids, sampling.clone(), 6);
        let b = run_local(&head, &three, &prompt.input_ids, sampling.clone(), 6);
        assert_eq!(a.generated_ids, b.generated_ids, "seed {seed}");
        assert_eq!(a.generated_ids.len(), NEW_TOKENS);
        assert_eq!(a.steps + 1 + a.accepted, NEW_TOKENS);
        // A draft is accepted when it is the token the position's draw
        // picks: drafts change the steps, never the answer.
        let off = run_local(&head, &spans, &prompt.input_ids, sampling, 0);
        assert_eq!(
            off.generated_ids, a.generated_ids,
            "seed {seed}: drafts changed it"
        );
    }
    // Sampling from the top token alone takes the speculative path (accept
    // with probability p = 1) and must give greedy's tokens.
    let top_1 = SamplingParams {
        temperature: 0.7,
        top_k: Some(1),
        seed: 3,
        ..Default::default()
    };
    let out = run_local(&head, &spans, &prompt.input_ids, top_1, 6);
    assert_eq!(out.generated_ids, prompt.generated_new_ids);
    assert!(out.accepted > 0, "no sampled draft accepted");
    assert_eq!(out.accepted, out.drafted, "a sure draft was rejected");
}

fn answer_with_draft_model(
    draft: &Path,
    prompt: &[u32],
    sampling: SamplingParams,
) -> GenerateOutput {
    let ck = Checkpoint::open(tiny_llama()).unwrap();
    let draft = DraftModel::load(&Checkpoint::open(draft).unwrap(), DType::F32).unwrap();
    let assistant = Assistant::local(&ck, DType::F32)
        .unwrap()
        .with_draft_model(draft)
        .unwrap();
    let request = GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_new_tokens: NEW_TOKENS,
        sampling,
        stop_at_eos: false,
        drafts: 6,
    };
    let answer = futures::executor::block_on(assistant.answer(
        &mut Conversation::one_shot(),
        &request,
        |_| std::ops::ControlFlow::Continue(()),
    ))
    .unwrap();
    answer.output
}

/// A draft model guesses text the conversation has not seen: with the
/// model itself as its draft nearly every draft is accepted on every
/// prompt, not only the one that repeats itself; with the same model in
/// f16 most are; the tokens stay transformers' either way.
#[test]
fn a_draft_model_gives_the_reference_tokens_in_few_steps_on_any_prompt() {
    let golden = Golden::load(&tiny_llama(), "float32");
    for (p, prompt) in golden.prompts.iter().enumerate() {
        let greedy = SamplingParams::greedy;
        let itself = answer_with_draft_model(&tiny_llama(), &prompt.input_ids, greedy());
        let half = answer_with_draft_model(&tiny_llama_fp16(), &prompt.input_ids, greedy());
        for (name, out) in [("itself", &itself), ("f16", &half)] {
            eprintln!(
                "prompt {p}, draft model {name}: {} steps for {NEW_TOKENS} tokens, {}/{} drafts accepted",
                out.steps, out.accepted, out.drafted
            );
            assert_eq!(
                out.generated_ids, prompt.generated_new_ids,
                "prompt {p}, {name}"
            );
            assert_eq!(
                out.steps + 1 + out.accepted,
                NEW_TOKENS,
                "prompt {p}, {name}"
            );
        }
        assert!(
            itself.accepted * 10 >= itself.drafted * 9,
            "prompt {p}: {itself:?}"
        );
        assert!(itself.steps <= 8, "prompt {p}: {} steps", itself.steps);
        assert!(half.accepted * 2 >= half.drafted, "prompt {p}: {half:?}");
    }
    // Sampling checks point-mass drafts the speculative way: a seed gives
    // one answer, and drawing from the top token alone is greedy.
    let prompt = &golden.prompts[0];
    let sampling = |top_k, seed| SamplingParams {
        temperature: 0.7,
        top_k,
        seed,
        ..Default::default()
    };
    let a = answer_with_draft_model(&tiny_llama(), &prompt.input_ids, sampling(None, 5));
    let b = answer_with_draft_model(&tiny_llama(), &prompt.input_ids, sampling(None, 5));
    assert_eq!(a.generated_ids, b.generated_ids);
    let (head, spans) = load(&[(0, 4)]);
    let plain = run_local(&head, &spans, &prompt.input_ids, sampling(None, 5), 0);
    assert_eq!(
        a.generated_ids, plain.generated_ids,
        "the draft model changed the answer"
    );
    let top_1 = answer_with_draft_model(&tiny_llama(), &prompt.input_ids, sampling(Some(1), 5));
    assert_eq!(top_1.generated_ids, prompt.generated_new_ids);
}

/// Drafts are token ids: a model whose ids mean other tokens (the same
/// vocabulary size, another tokenizer) or another vocabulary is refused.
#[test]
fn a_draft_model_with_another_tokenizer_is_refused() {
    let ck = Checkpoint::open(tiny_llama()).unwrap();
    let refusal = |path: &Path| {
        let draft = DraftModel::load(&Checkpoint::open(path).unwrap(), DType::F32).unwrap();
        match Assistant::local(&ck, DType::F32)
            .unwrap()
            .with_draft_model(draft)
        {
            Ok(_) => panic!("the draft model {} was taken", path.display()),
            Err(e) => e.to_string(),
        }
    };
    // 1024 tokens, like the tiny model, from another tokenizer.
    let tmp = tempfile::tempdir().unwrap();
    let other = corolla_tests::wan::write_wire_model(tmp.path(), 1);
    let err = refusal(&other);
    assert!(err.contains("tokenizer differs"), "{err}");
    if let Some(smollm2) = default_model() {
        let err = refusal(&smollm2);
        assert!(err.contains("49152 tokens, the model 1024"), "{err}");
    }
}

async fn start(blocks: &str, join: Option<&RunningServer>) -> RunningServer {
    let join = join.map(|first| first.tcp_addr().expect("tcp address").to_string());
    start_server(
        blocks,
        join.as_deref(),
        &["--update-period", "2s", "--inference-max-length", "256"],
    )
    .await
}

async fn corolla(args: &[&str]) -> Value {
    let out = tokio::process::Command::new(corolla_bin())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("run corolla");
    assert!(
        out.status.success(),
        "corolla {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn ids(out: &Value) -> Vec<u32> {
    serde_json::from_value(out["generated_ids"].clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafts_through_three_servers_give_the_same_tokens() {
    let first = start("0:1", None).await;
    let second = start("1:3", Some(&first)).await;
    let third = start("3:4", Some(&first)).await;
    let peers = first.tcp_addr().expect("tcp address").to_string();
    let golden = Golden::load(&tiny_llama(), "float32");
    let prompt = &golden.prompts[REPETITIVE];
    let model = tiny_llama();
    let generate = |drafts: &'static str, extra: Vec<String>| {
        let mut args: Vec<String> = [
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--json",
            "--max-new-tokens",
            "32",
            "--prompt",
            &prompt.prompt,
            "--drafts",
            drafts,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra);
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            corolla(&args).await
        }
    };
    let swarm = || vec!["--initial-peers".to_string(), peers.clone()];
    let on = generate("6", swarm()).await;
    let off = generate("0", swarm()).await;
    assert_eq!(ids(&on), prompt.generated_new_ids);
    assert_eq!(ids(&off), prompt.generated_new_ids);
    assert_eq!(off["steps"], 31);
    assert_eq!(off["drafted"], 0);
    let (steps, accepted) = (
        on["steps"].as_u64().unwrap(),
        on["accepted"].as_u64().unwrap(),
    );
    eprintln!(
        "through 3 servers: {steps} steps for 32 tokens, {accepted}/{} drafts accepted",
        on["drafted"]
    );
    assert!(accepted > 0, "no draft accepted: {on}");
    assert!(steps < 16, "{steps} steps");
    assert_eq!(steps + 1 + accepted, 32);

    // Speculative sampling through the servers draws what a local run draws.
    let sampled = |place: Vec<String>| {
        let mut extra = place;
        extra.extend(
            ["--temperature", "0.7", "--top-p", "0.95", "--seed", "7"]
                .iter()
                .map(|s| s.to_string()),
        );
        generate("6", extra)
    };
    let local = sampled(vec!["--local".to_string()]).await;
    let remote = sampled(swarm()).await;
    assert_eq!(ids(&local), ids(&remote));
    assert_eq!(local["accepted"], remote["accepted"]);

    // Drafts from a local draft model, on a prompt that does not repeat.
    let plain = &golden.prompts[0];
    let mut args = vec![
        "generate".to_string(),
        "--model".into(),
        model.to_str().unwrap().into(),
        "--json".into(),
        "--max-new-tokens".into(),
        "32".into(),
        "--prompt".into(),
        plain.prompt.clone(),
        "--draft-model".into(),
        tiny_llama_fp16().to_str().unwrap().into(),
    ];
    args.extend(swarm());
    let drafted = corolla(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert_eq!(ids(&drafted), plain.generated_new_ids);
    assert!(drafted["draft_model"].is_string(), "{drafted}");
    let steps = drafted["steps"].as_u64().unwrap();
    eprintln!(
        "through 3 servers with a draft model: {steps} steps for 32 tokens, {}/{} drafts accepted",
        drafted["accepted"], drafted["drafted"]
    );
    assert!(steps < 16, "{steps} steps: {drafted}");
    drop((first, second, third));
}

#[test]
fn the_default_model_gives_the_same_tokens_with_and_without_drafts() {
    let Some(model) = default_model() else { return };
    let text = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over \
                the lazy dog. The quick brown fox jumps over the lazy dog.";
    let run = |drafts: &str| {
        let out = std::process::Command::new(corolla_bin())
            .args([
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--local",
                "--json",
                "--max-new-tokens",
                "40",
                "--chat",
                "--prompt",
                &format!("Repeat this text exactly: {text}"),
                "--drafts",
                drafts,
            ])
            .env("RUST_LOG", "warn")
            .output()
            .expect("run corolla");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).expect("json")
    };
    let on = run("6");
    let off = run("0");
    assert_eq!(ids(&on), ids(&off), "{}\n{}", on["text"], off["text"]);
    let generated = ids(&on).len() as u64;
    let (steps, accepted) = (
        on["steps"].as_u64().unwrap(),
        on["accepted"].as_u64().unwrap(),
    );
    eprintln!(
        "default model: {steps} steps for {generated} tokens, {accepted}/{} drafts accepted: {}",
        on["drafted"], on["text"]
    );
    assert!(accepted > 0, "no draft accepted");
    assert!(
        steps + 1 < generated,
        "{steps} steps for {generated} tokens"
    );
}
