//! `corolla-bench --prefixes`: a widget's visitors share a system prompt.
//! Two different clients (nodes of their own) ask different questions after
//! the same ~600-token system prompt on `corolla demo`'s layout; the second
//! one's prefill is timed against the first one's, on a swarm that shares
//! prefixes and on one started with `--no-shared-prefixes`, in the same run.

use std::path::Path;

use corolla_client::network::connect;
use corolla_client::{
    generate, ChatMessage, ChatTemplate, GenerateOutput, GenerateRequest, RemoteChain,
    SessionSettings, TextTokenizer,
};
use corolla_model::fingerprint::block_hashes;
use corolla_model::{Checkpoint, ClientHead, DType, Device, QuantizedWeights, SamplingParams};
use corolla_server::RunningServer;
use corolla_shared::WireDType;

use crate::demo_swarm::demo_swarm;
use crate::median;

pub const PREFIX_HEADING: &str = "## Shared prefixes: a system prompt across clients";

/// The benchmark's target: the second client's prefill over the first one's.
pub const PREFIX_TARGET: f64 = 0.3;

const SYSTEM_SENTENCES: [&str; 6] = [
    "You are the help desk of the Harbour Street Library, which lends books, films, music and tools \
     to everyone who lives or works in the town, and you answer visitors of its website politely, \
     briefly and only about the library and its services.",
    "The library opens from nine in the morning to eight in the evening on weekdays, from ten to five \
     on Saturdays, and stays closed on Sundays and public holidays; the reading room upstairs keeps \
     the same hours except in August, when it closes at four.",
    "Members may borrow up to twelve items at a time for three weeks each, renew them twice online or \
     at the desk unless another member has reserved them, and return them through the slot by the \
     main door at any hour of the day or night.",
    "Membership is free for residents, students and people who work in the town; others pay a small \
     yearly fee, and everyone needs a photo identity document and a proof of address to register at \
     the front desk on the ground floor.",
    "The tool library lends drills, ladders, sewing machines and garden tools for one week, asks for a \
     refundable deposit, and offers a short safety introduction every first Saturday of the month \
     in the workshop behind the children's corner.",
    "When you do not know an answer, say so, suggest calling the front desk or writing to the \
     librarians through the contact form, and never invent opening hours, fees, events or rules that \
     are not written here.",
];

/// The system prompt of round `round`: the same text, told apart per round so
/// that every round's first client finds nothing stored.
fn system_prompt(round: usize) -> String {
    let mut text = format!("Edition {round}. ");
    for _ in 0..2 {
        for sentence in SYSTEM_SENTENCES {
            text.push_str(sentence);
            text.push(' ');
        }
    }
    text
}

/// One answer from a client of its own (a new node) on `servers`.
async fn answer_as_a_new_client(
    servers: &[RunningServer],
    settings: &SessionSettings,
    head: &ClientHead,
    request: &GenerateRequest,
) -> anyhow::Result<GenerateOutput> {
    let addrs = servers
        .iter()
        .filter_map(|s| s.tcp_addr().cloned())
        .collect::<Vec<_>>();
    let node = connect(&addrs).await?;
    let mut settings = settings.clone();
    settings.max_length = request.max_length();
    let mut chain = RemoteChain::connect(&node, settings, &Device::Cpu).await?;
    anyhow::ensure!(chain.route().len() == 3, "one hop per server");
    let out = generate(head, &mut chain, request, |_| {
        std::ops::ControlFlow::Continue(())
    })
    .await?;
    chain.close().await;
    Ok(out)
}

/// Per round: the first and the second client's prefill times, in ms.
struct Prefills {
    first: Vec<f64>,
    second: Vec<f64>,
    reused_positions: u64,
}

impl Prefills {
    fn ratio(&self) -> f64 {
        median(self.second.clone()) / median(self.first.clone())
    }
}

/// The section: the default model in `corolla demo`'s layout, shared and not.
pub async fn prefix_section(model: &Path, rounds: usize) -> anyhow::Result<String> {
    let ck = Checkpoint::open(model)?.with_quantized_weights(QuantizedWeights::Auto);
    let layers = ck.config().num_hidden_layers;
    let tokenizer = TextTokenizer::for_checkpoint(&ck)?;
    let template = ChatTemplate::new(ck.chat_template()?.as_deref(), &tokenizer, None, None)?;
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu)?;
    let request = |round: usize, question: &str| -> anyhow::Result<GenerateRequest> {
        let messages = [
            ChatMessage::new("system", system_prompt(round)),
            ChatMessage::user(question),
        ];
        Ok(GenerateRequest {
            prompt_ids: tokenizer.encode_chat(&template.render(&messages, true)?)?,
            max_new_tokens: 8,
            sampling: SamplingParams::greedy(),
            stop_at_eos: false,
            drafts: 0,
        })
    };
    let mut settings = SessionSettings::new("", layers, 0, WireDType::F32);
    settings.expected_blocks = Some(block_hashes(&ck, 0, layers)?);
    let mut prompt_tokens = 0;
    let mut figures = Vec::new();
    // Every answer of each mode, to hold the shared swarm's to the other's.
    let mut answers: Vec<Vec<Vec<u32>>> = Vec::new();
    for flags in [&[][..], &["--no-shared-prefixes"][..]] {
        let servers = demo_swarm(model, layers, flags).await;
        settings.model = servers[0].model().to_string();
        let mut prefills = Prefills {
            first: Vec::new(),
            second: Vec::new(),
            reused_positions: 0,
        };
        let mut tokens = Vec::new();
        for round in 0..rounds + 1 {
            let first = request(round, "When does the library open on Saturdays?")?;
            let second = request(round, "Can I borrow a ladder, and for how long?")?;
            prompt_tokens = first.prompt_ids.len();
            let a = answer_as_a_new_client(&servers, &settings, &head, &first).await?;
            let b = answer_as_a_new_client(&servers, &settings, &head, &second).await?;
            tokens.extend([a.generated_ids.clone(), b.generated_ids.clone()]);
            if round > 0 {
                prefills.first.push(a.prefill_time.as_secs_f64() * 1e3);
                prefills.second.push(b.prefill_time.as_secs_f64() * 1e3);
            }
            eprintln!(
                "prefix bench {flags:?} round {round}: first {:.0} ms, second {:.0} ms",
                a.prefill_time.as_secs_f64() * 1e3,
                b.prefill_time.as_secs_f64() * 1e3
            );
        }
        prefills.reused_positions = servers
            .iter()
            .map(|s| s.compute_figures().prefix_positions_reused)
            .sum();
        figures.push(prefills);
        answers.push(tokens);
    }
    anyhow::ensure!(
        answers[0] == answers[1],
        "answers differ with and without shared prefixes"
    );
    let (shared, alone) = (&figures[0], &figures[1]);
    let ms = |v: &[f64]| median(v.to_vec());
    let shared_ratio = shared.ratio();
    Ok(format!(
        "{PREFIX_HEADING}\n\n\
         Command: `corolla-bench --prefixes --rounds {rounds} --write BENCHMARKS.md` (also part of \
         `bash scripts/bench.sh`).\n\n\
         SmolLM2-135M-Instruct (kept quantized) in `corolla demo`'s layout: three servers of {} blocks on \
         loopback, in the benchmark's process. Each round, one client (a node of its own) asks a \
         question after a {prompt_tokens}-token chat prompt (a ~600-token system prompt, new each \
         round), then a second client asks another question after the same system prompt; prefill = \
         time to the first token; medians of {rounds} rounds after a warm-up. The same run on three \
         servers started with `--no-shared-prefixes` is the baseline; every answer (8 greedy tokens) \
         is the same token for token on both swarms.\n\n\
         | servers | first client (ms) | second client (ms) | second / first | positions reused (all servers) |\n\
         |---|---|---|---|---|\n\
         | sharing prefixes | {:.0} | {:.0} | **{:.2}** | {} |\n\
         | `--no-shared-prefixes` | {:.0} | {:.0} | {:.2} | {} |\n\n\
         - second client's prefill / first's, sharing: **{shared_ratio:.2}** (target <= {PREFIX_TARGET}): \
         {}\n\
         - The second client still sends every position (a server sees hidden states, not tokens, and \
         keys its pages by them), so what remains is the transfer of its {prompt_tokens} positions \
         through three servers, the hashing, the copy of the pages and the positions after the last \
         whole page of 64.\n",
        layers / 3,
        ms(&shared.first),
        ms(&shared.second),
        shared_ratio,
        shared.reused_positions,
        ms(&alone.first),
        ms(&alone.second),
        alone.ratio(),
        alone.reused_positions,
        if shared_ratio <= PREFIX_TARGET { "met" } else { "missed" },
    ))
}
