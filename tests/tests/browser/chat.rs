//! The chat page and the widget: tokens equal to `corolla generate`'s over
//! both transports, a steady layout, Markdown, regenerate, edit, new chat.

use super::*;

#[test]
fn chat_page_over_webrtc_and_widget_over_websocket_match_generate() {
    let _one = serial();
    let Some(model) = default_model() else { return };
    let Some(mut swarm) = ready("chat page and widget") else {
        return;
    };
    swarm.start_page_server(&model, 0, 15, &[]);
    swarm.start_server(&model, 15, 30, &[]);
    let http = swarm.servers[0].http().expect("http").to_string();
    let bootstrap = swarm.servers[0].tcp_addr();

    // The chat page, WebRTC-direct only, three turns, the last one stopped.
    let run = run_page_with(
        &format!("{http}/?transport=webrtc-direct"),
        &[
            GERMANY,
            "And of France?",
            "Tell me a long story about a dragon.",
        ],
        24,
        "chat-page-webrtc",
        &["--stop-after-tokens", "3"],
        || {},
    );
    let answer = first_answer(&run);
    let native = native_chat(&model, &bootstrap, GERMANY, None, 24);
    assert_same_tokens(&answer, &native);
    assert!(
        answer["text"].as_str().unwrap().contains("Berlin"),
        "{answer}"
    );
    assert_route_covers(&answer, 30);
    let answers = run.answers();
    assert_eq!(
        answers.len(),
        3,
        "a later turn got no answer: {:?}",
        run.events
    );
    // The second turn's prompt holds the whole conversation so far.
    let first_turn = ids(&answer["prompt_ids"]);
    assert!(ids(&answers[1]["prompt_ids"]).len() > first_turn.len() + 1);
    assert!(!ids(&answers[1]["generated_ids"]).is_empty());
    // ... and the servers already held most of it: only the new turn was sent.
    let reused = answers[1]["reused_tokens"].as_u64().expect("reused_tokens");
    assert!(reused >= first_turn.len() as u64, "{}", answers[1]);
    // Stop ends the answer early.
    assert_eq!(answers[2]["stop_reason"], "cancelled", "{}", answers[2]);
    let stopped = ids(&answers[2]["generated_ids"]).len();
    assert!((3..24).contains(&stopped), "{stopped} tokens after Stop");

    // The widget on its demo page, WebSocket only; it sets a system prompt.
    let prompt = "Name one vegetable that grows well in shade.";
    let run = run_page(
        &format!("{http}/widget-demo.html?transport=websocket"),
        &[prompt],
        24,
        "widget-demo-websocket",
        || {},
    );
    let answer = first_answer(&run);
    let system = run.system();
    assert!(system.is_some(), "the demo page sets a system prompt");
    let native = native_chat(&model, &bootstrap, prompt, system.as_deref(), 24);
    assert_same_tokens(&answer, &native);
    assert_route_covers(&answer, 30);
}

#[test]
fn chat_page_renders_markdown_regenerates_edits_and_keeps_the_conversation() {
    let _one = serial();
    let Some(model) = default_model() else { return };
    let Some(mut swarm) = ready("chat page features") else {
        return;
    };
    swarm.start_page_server(&model, 0, 30, &[]);
    let http = swarm.servers[0].http().expect("http").to_string();
    let bootstrap = swarm.servers[0].tcp_addr();
    let run = run_page_with(
        &format!("{http}/?transport=websocket"),
        &[GERMANY, "And of France?"],
        24,
        "chat-page-features",
        &["--ui-check"],
        || {},
    );
    let answer = first_answer(&run);
    assert_same_tokens(&answer, &native_chat(&model, &bootstrap, GERMANY, None, 24));
    assert_steady_layout(&run);

    let md = event(&run, "markdown");
    assert_eq!(md["imgs"], 0, "model output became HTML: {md}");
    assert_eq!(md["raw_html_as_text"], true, "{md}");
    assert_eq!(md["code"], "let a = 1;", "{md}");
    assert_eq!(md["copy"], true);
    assert_eq!(md["strong"], "there");
    assert_eq!(md["items"], 2);
    assert_eq!(md["link"], "https://example.org");

    // Regenerate asks the same conversation again: the sessions already held
    // all of its prompt but the last token.
    let second = &run.answers()[1];
    let regenerated = &event(&run, "regenerated")["result"];
    assert_eq!(regenerated["prompt_ids"], second["prompt_ids"]);
    let prompt_len = ids(&regenerated["prompt_ids"]).len() as u64;
    assert_eq!(
        regenerated["reused_tokens"],
        prompt_len - 1,
        "{regenerated}"
    );
    assert_ne!(
        regenerated["seed"], second["seed"],
        "a fresh seed per answer"
    );

    // Edit the last question: it goes back to the input with its answer gone,
    // and the edited question reuses the first turn's positions.
    let edit = event(&run, "edit");
    assert_eq!(edit["input"], "And of France?");
    assert_eq!(
        edit["after"].as_u64().unwrap() + 2,
        edit["before"].as_u64().unwrap()
    );
    let edited = &event(&run, "edited")["result"];
    let first_turn = ids(&answer["prompt_ids"]).len() as u64;
    assert!(
        edited["reused_tokens"].as_u64().unwrap() >= first_turn,
        "{edited}"
    );

    let restored = event(&run, "restored");
    assert_eq!(restored["before"], 4);
    assert_eq!(restored["after"], 4, "the reload lost the conversation");
    let new_chat = event(&run, "new_chat");
    assert_eq!(new_chat["messages"], 0);
    assert!(new_chat["examples"].as_u64().unwrap() >= 1);
    let example = &event(&run, "example")["result"];
    assert!(!ids(&example["generated_ids"]).is_empty());
    assert_eq!(
        example["reused_tokens"], 0,
        "a new chat starts new sessions"
    );
}
