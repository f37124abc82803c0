//! `corolla-bench --only-chat`: chat turns' time to the first token, one
//! conversation against new sessions every turn.

use corolla_client::network::connect;
use corolla_client::{GenerateRequest, SessionSettings};
use corolla_model::{Checkpoint, DType, SamplingParams};

use crate::demo_swarm::{bootstrap, demo_swarm};
use crate::median;

pub const CHAT_HEADING: &str = "## Chat turns: time to first token";

/// A six-turn chat on `corolla demo`'s layout whose history grows by ~100
/// tokens a turn (a ~60-token message, a 40-token answer): time to the
/// first token of each turn through one conversation (only new tokens are
/// sent) and through a new conversation per turn (the whole history again).
pub async fn bench_chat_turns(path: &std::path::Path, rounds: usize) -> anyhow::Result<String> {
    use corolla_client::{Assistant, ChatMessage, Conversation};
    use corolla_model::QuantizedWeights;
    const TURNS: usize = 6;
    const ANSWER: usize = 40;
    let ck = Checkpoint::open(path)?.with_quantized_weights(QuantizedWeights::Auto);
    let layers = ck.config().num_hidden_layers;
    let servers = demo_swarm(path, layers, &[]).await;
    let node = connect(&[bootstrap(&servers)?]).await?;
    let assistant = Assistant::swarm(&ck, DType::F32, node, SessionSettings::default())?;
    // Each round's chat is its own from the first message on, so no round
    // finds the pages of an earlier one's beginning (shared prefixes).
    let message = |round: usize, turn: usize| {
        ChatMessage::user(format!(
            "Walk {round}, question {turn}: I am planning a long walk along the coast next weekend, with friends who \
             like birds, old lighthouses and small harbours. What should we pack, which time of day is \
             best for the light, and what should we look out for on the way?"
        ))
    };
    // (reuse?, turn) -> time to first token, per round.
    let mut ttft = vec![vec![Vec::new(); TURNS]; 2];
    let mut history_len = [0; TURNS];
    for round in 0..rounds + 1 {
        for (mode, reuse) in [(0, true), (1, false)] {
            let mut conversation = Conversation::new();
            let mut messages = Vec::new();
            for turn in 0..TURNS {
                messages.push(message(round, turn));
                let request = GenerateRequest {
                    prompt_ids: assistant.chat_prompt(&messages)?,
                    max_new_tokens: ANSWER,
                    sampling: SamplingParams::greedy(),
                    stop_at_eos: false,
                    drafts: 0,
                };
                history_len[turn] = request.prompt_ids.len();
                if !reuse {
                    std::mem::take(&mut conversation).close().await;
                }
                let started = std::time::Instant::now();
                let mut first_token = None;
                let answer = assistant
                    .answer(&mut conversation, &request, |_| {
                        first_token.get_or_insert_with(|| started.elapsed());
                        std::ops::ControlFlow::Continue(())
                    })
                    .await?;
                if reuse && turn > 0 {
                    anyhow::ensure!(answer.reused_tokens > 0, "turn {turn} reused nothing");
                }
                let text = assistant.tokenizer().decode(&answer.output.generated_ids)?;
                messages.push(ChatMessage::assistant(text.trim().to_string()));
                if round > 0 {
                    ttft[mode][turn].push(first_token.unwrap_or_default().as_secs_f64() * 1e3);
                }
            }
            conversation.close().await;
        }
        eprintln!("chat round {round} done");
    }
    drop(servers);
    let med: Vec<Vec<f64>> = ttft
        .into_iter()
        .map(|turns| turns.into_iter().map(median).collect())
        .collect();
    let mut rows = String::new();
    for turn in 0..TURNS {
        rows.push_str(&format!(
            "| {} | {} | {:.0} | {:.0} |\n",
            turn + 1,
            history_len[turn],
            med[0][turn],
            med[1][turn]
        ));
    }
    Ok(format!(
        "{CHAT_HEADING}\n\n\
         Command: `corolla-bench --only-chat --rounds {rounds} --write BENCHMARKS.md` (also part of `bash scripts/bench.sh`).\n\n\
         SmolLM2-135M-Instruct in `corolla demo`'s layout (three servers of 10 blocks on loopback, in the benchmark's \
         process); a {TURNS}-turn chat whose history grows by ~100 tokens a turn (a ~60-token message and a \
         {ANSWER}-token greedy answer); time from asking to the first token, medians of {rounds} rounds after a warm-up. \
         One conversation keeps its server sessions and sends only the new tokens; the other opens new sessions \
         and sends the whole history every turn (what every answer did before); the servers share prefixes, \
         so the second finds the pages of the first one's same history (each round's chat differs from its first \
         message on, so a round's first turn finds nothing).\n\n\
         | turn | prompt tokens | one conversation (ms) | new sessions each turn (ms) |\n|---|---|---|---|\n{rows}\n\
         - turn {TURNS} / turn 1, one conversation: **{:.2}** (target <= 1.2)\n\
         - turn {TURNS} / turn 1, new sessions each turn: {:.2}\n",
        med[0][TURNS - 1] / med[0][0],
        med[1][TURNS - 1] / med[1][0],
    ))
}
