//! Model families, adapters and a missing block in the page.

use super::*;

/// `family`'s tiny model (tests/fixtures/families) in the page through two
/// servers: the page's answer equals `corolla generate`'s, whose tokens the
/// swarm test checks against transformers. Returns the page's answer.
fn page_answers_as_the_native_client_does(family: &str) -> Option<Value> {
    let _one = serial();
    let mut swarm = ready(&format!("a {family} model in the page"))?;
    let model = corolla_tests::fixtures_dir().join("families").join(family);
    swarm.start_page_server(&model, 0, 2, &[]);
    swarm.start_server(&model, 2, 3, &[]);
    let http = swarm.servers[0].http().expect("http").to_string();
    let prompt = "Where do the rivers of the mountains go?";
    let run = run_page(
        &format!("{http}/?transport=websocket"),
        &[prompt],
        12,
        &format!("chat-page-{family}"),
        || {},
    );
    let answer = first_answer(&run);
    let native = native_chat(
        &model,
        &swarm.servers[0].tcp_addr(),
        prompt,
        run.system().as_deref(),
        12,
    );
    assert_same_tokens(&answer, &native);
    assert_route_covers(&answer, 3);
    Some(answer)
}

/// Mistral: a sliding window of 8, shorter than the chat prompt.
#[test]
fn page_answers_a_mistral_model_as_the_native_client_does() {
    let Some(answer) = page_answers_as_the_native_client_does("mistral") else {
        return;
    };
    assert!(
        ids(&answer["prompt_ids"]).len() > 8,
        "the prompt must outrun the window"
    );
}

/// Qwen3 (per-head query and key norms, heads wider than hidden / heads)
/// and the two mixtures of experts, Mixtral and Qwen3-MoE: the page holds
/// their head, the servers their blocks.
#[test]
fn page_answers_qwen3_and_expert_models_as_the_native_client_does() {
    for family in ["qwen3", "mixtral", "qwen3_moe"] {
        page_answers_as_the_native_client_does(family);
    }
}

/// A page choosing a LoRA adapter (the widget's `adapter` attribute, here
/// from the page's `?adapter=`) answers as the native client does with
/// `--adapter`, through the servers running it; an adapter no server runs
/// fails the answer with the kind `no_coverage`.
#[test]
fn a_page_answers_with_the_adapter_it_names_as_the_native_client_does() {
    let _one = serial();
    let Some(mut swarm) = ready("a page choosing an adapter") else {
        return;
    };
    let model = corolla_tests::fixtures_dir().join("families/llama3");
    let adapter = corolla_tests::fixtures_dir().join("adapters/llama3-alpha");
    let flag = format!("alpha={}", adapter.display());
    swarm.start_page_server(&model, 0, 2, &["--adapter", &flag]);
    swarm.start_server(&model, 2, 3, &["--adapter", &flag]);
    let http = swarm.servers[0].http().expect("http").to_string();
    let prompt = "Where do the rivers of the mountains go?";
    let run = run_page(
        &format!("{http}/?transport=websocket&adapter=alpha"),
        &[prompt],
        12,
        "chat-page-adapter",
        || {},
    );
    let answer = first_answer(&run);
    let bootstrap = swarm.servers[0].tcp_addr();
    let system = run.system();
    let native = |extra: &[&str]| {
        corolla_tests::browser::native_chat_with(
            &model,
            &bootstrap,
            prompt,
            system.as_deref(),
            12,
            extra,
        )
    };
    assert_same_tokens(&answer, &native(&["--adapter", "alpha"]));
    assert_ne!(
        ids(&answer["generated_ids"]),
        ids(&native(&[])["generated_ids"]),
        "the adapter changes nothing here: the test proves nothing"
    );
    let run = run_page(
        &format!("{http}/?transport=websocket&adapter=gamma"),
        &[prompt],
        4,
        "chat-page-unknown-adapter",
        || {},
    );
    assert!(run.answers().is_empty(), "it answered: {:?}", run.events);
    let error = event(&run, "error");
    assert_eq!(error["kind"], "no_coverage", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap_or_default()
            .contains("adapter \"gamma\""),
        "{error}"
    );
}

/// A page whose swarm lacks a block: the answer fails with the kind
/// `no_coverage` (the client's word, not a parsed message), and the
/// widget's banner and `corolla-error` event say so ("No route").
#[test]
fn a_page_whose_swarm_lacks_a_block_reports_no_coverage() {
    let _one = serial();
    let Some(mut swarm) = ready("a page whose swarm lacks a block") else {
        return;
    };
    let model = corolla_tests::fixtures_dir().join("families/mistral");
    swarm.start_page_server(&model, 0, 2, &[]);
    let http = swarm.servers[0].http().expect("http").to_string();
    let run = run_page(
        &format!("{http}/?transport=websocket"),
        &["Which blocks are missing?"],
        4,
        "chat-page-no-coverage",
        || {},
    );
    assert!(run.answers().is_empty(), "it answered: {:?}", run.events);
    let error = run
        .events
        .iter()
        .find(|e| e["event"] == "error")
        .unwrap_or_else(|| panic!("no error event: {:?}\n{}", run.events, run.stderr));
    assert_eq!(error["kind"], "no_coverage", "{error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("No route: "), "{error}");
    assert!(
        message.contains("2..3"),
        "the missing blocks are named: {error}"
    );
    let banner = error["banner"].as_str().unwrap_or_default();
    assert!(banner.contains("No route"), "{error}");
}
