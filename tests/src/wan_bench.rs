//! `corolla-bench --wan`: tokens per second of the `corolla` CLI through
//! ten one-layer servers of the wire-shaped model, each link 20 or 50 ms
//! round trip ([`crate::wan`]), for a table of client variants and two
//! prompts, plus one recovery from a server killed mid-answer. Returns a
//! BENCHMARKS.md section.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};

use crate::wan::{generate_local, write_wire_model, Generation, LinkDelay, WanWorld};

pub const WAN_HEADING: &str = "## Over delayed links (`corolla-bench --wan`)";

/// A client variant: extra `corolla generate` flags.
pub struct Variant {
    pub name: &'static str,
    pub args: &'static [&'static str],
    /// Its tokens must equal the local run's (f16 on the wire may change
    /// some: it rounds what f32 servers compute).
    pub exact: bool,
}

/// The variants measured, one row each: add one per client flag to compare
/// (e.g. `--no-push`, `--wire-dtype f16`, `--drafts 4`).
pub const VARIANTS: &[Variant] = &[
    Variant {
        name: "(a) through the client",
        args: &["--no-push", "--drafts", "0"],
        exact: true,
    },
    Variant {
        name: "(b) push",
        args: &["--drafts", "0"],
        exact: true,
    },
    Variant {
        name: "(c) push + f16",
        args: &["--drafts", "0", "--wire-dtype", "f16"],
        exact: false,
    },
    Variant {
        name: "(d) push + multi-token steps",
        args: &[],
        exact: true,
    },
];

/// Round trips of every link, in milliseconds.
pub const RTTS_MS: &[u64] = &[20, 50];

/// One-layer servers in the route.
pub const SERVERS: usize = 10;

/// The block with a second server, for the recovery run.
const REPLICATED: usize = SERVERS / 2;

/// A prompt whose continuation repeats text (what draft tokens can guess)
/// and one whose does not.
pub const PROMPTS: [(&str, &str); 2] = [
    (
        "repeats",
        "The river rises in the hills and runs through the old town, past the mill and under \
         the stone bridge, to the sea. The river rises in the hills and runs through the old \
         town, past the mill and under the stone bridge, to the sea. Repeat the text above.",
    ),
    (
        "fresh",
        "Write a short story about a lighthouse keeper who finds a map in a bottle.",
    ),
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The section, or `None` where network namespaces cannot be made.
pub fn bench_wan(rounds: usize, new_tokens: usize) -> Result<Option<String>> {
    let rounds = rounds.max(1);
    let Some(mut world) = WanWorld::create(LinkDelay::rtt_ms(RTTS_MS[0])) else {
        return Ok(None);
    };
    let written = Instant::now();
    let model = write_wire_model(world.dir(), SERVERS);
    let one_layer = write_wire_model(world.dir(), 1);
    eprintln!(
        "wrote the wire-shaped models in {:.1} s",
        written.elapsed().as_secs_f64()
    );
    let mut spans: Vec<(usize, usize)> = (0..SERVERS).map(|i| (i, i + 1)).collect();
    spans.push((REPLICATED, REPLICATED + 1));
    world.start_servers(&model, &spans, &[]);

    // The references, and what one layer's decode step costs here.
    let mut local = Vec::new();
    for (_, prompt) in PROMPTS {
        local.push(generate_local(&model, prompt, new_tokens).map_err(|e| anyhow!(e))?);
    }
    let local_one = generate_local(&one_layer, PROMPTS[1].1, new_tokens).map_err(|e| anyhow!(e))?;
    let local_ms = local[1].decode_ms_per_token();
    let layer_ms = (local_ms - local_one.decode_ms_per_token()) / (SERVERS - 1) as f64;

    let run = |world: &WanWorld, prompt: &str, args: &[&str]| -> Result<Generation> {
        world
            .generate(&model, prompt, new_tokens, args)
            .map_err(|e| anyhow!("{e}\n{}", world.logs()))
    };
    // Warm-up: page cache, the servers' first sessions.
    run(&world, PROMPTS[1].1, &[])?;

    let mut rows = String::new();
    let mut differ = Vec::new();
    let mut lossy = Vec::new();
    // (RTT, variant, prompt) -> median tokens/s, for the ratios.
    let mut rates = std::collections::HashMap::new();
    for &rtt in RTTS_MS {
        world.set_delay(LinkDelay::rtt_ms(rtt));
        for ((name, prompt), reference) in PROMPTS.iter().zip(&local) {
            for variant in VARIANTS {
                let (mut tps, mut step_ms, mut per_step) = (Vec::new(), Vec::new(), Vec::new());
                for round in 0..rounds {
                    let out = run(&world, prompt, variant.args)?;
                    if out.generated_ids != reference.generated_ids {
                        let run = format!("{rtt} ms, {}, {name}, round {round}", variant.name);
                        if variant.exact {
                            differ.push(run);
                        } else {
                            lossy.push(run);
                        }
                    }
                    eprintln!(
                        "{rtt} ms RTT, {}, {name}: {:.2} tokens/s",
                        variant.name,
                        out.decode_tokens_per_second()
                    );
                    tps.push(out.decode_tokens_per_second());
                    step_ms.push(out.decode_ms_per_step());
                    per_step.push(out.decode_ms_per_step() / out.decode_ms_per_token());
                }
                let tps = median(tps);
                rates.insert((rtt, variant.name, *name), tps);
                writeln!(
                    rows,
                    "| {rtt} ms | {} | {name} | {tps:.2} | {:.0} | {:.0} | {:.2} |",
                    variant.name,
                    1e3 / tps,
                    median(step_ms),
                    median(per_step)
                )?;
            }
        }
    }
    if !differ.is_empty() {
        bail!("tokens differ from the local run in: {}", differ.join("; "));
    }

    world.set_delay(LinkDelay::rtt_ms(RTTS_MS[0]));
    // A failed recovery is a finding to report, not a reason to lose the table.
    let recovery = recovery_run(&mut world, &model, new_tokens, &local[1]).unwrap_or_else(|e| {
        let e = e.to_string();
        let first = e.lines().take(6).collect::<Vec<_>>().join(" / ");
        format!(
            "Recovery at {} ms RTT (the server of block {REPLICATED} in use killed mid-answer): \
             **failed**: {first}\n",
            RTTS_MS[0]
        )
    });

    let mut ratios = Vec::new();
    for &rtt in RTTS_MS {
        for (name, _) in PROMPTS {
            let rate = |v: usize| rates.get(&(rtt, VARIANTS[v].name, name)).copied();
            if let (Some(a), Some(b), Some(d)) = (rate(0), rate(1), rate(3)) {
                ratios.push(format!(
                    "{rtt} ms, {name}: push / through the client **{:.2}×**, push + multi-token / \
                     through the client {:.2}×",
                    b / a,
                    d / a
                ));
            }
        }
    }
    let lossy = if lossy.is_empty() {
        "f16 on the wire gave the local run's tokens in every run.".to_string()
    } else {
        format!(
            "f16 on the wire changed tokens (against the f32 local run) in: {}.",
            lossy.join("; ")
        )
    };

    let variants: Vec<String> = VARIANTS
        .iter()
        .map(|v| match v.args {
            [] => format!("{} (no extra flags)", v.name),
            args => format!("{} (`{}`)", v.name, args.join(" ")),
        })
        .collect();
    let limits: Vec<String> = RTTS_MS
        .iter()
        .map(|&rtt| {
            format!(
                "{rtt} ms: {:.0} ms through the client ({SERVERS} round trips), \
                 {:.0} ms server to server ({} one-way links)",
                SERVERS as f64 * rtt as f64,
                (SERVERS + 1) as f64 * rtt as f64 / 2.0,
                SERVERS + 1
            )
        })
        .collect();
    Ok(Some(format!(
        "{WAN_HEADING}\n\n\
         Command: `corolla-bench --wan --rounds {rounds} --new-tokens {new_tokens} --write BENCHMARKS.md` \
         (as root: it makes network namespaces).\n\n\
         The wire-shaped model (`RandomGguf::wire_shaped`: Llama 2 70B's hidden size 8192, so every hop \
         carries 70B-sized activations, with one attention head, an FFN of 64 and a vocabulary of 1024; \
         Q8_0, kept quantized as `--quantized auto` does), {SERVERS} layers: {SERVERS} servers of one layer each (and a second \
         server of block {REPLICATED}, for the recovery), each in its own network namespace behind a \
         delaying TCP forwarder that it announces (`--public-name`); the `corolla` CLI in another \
         namespace; the host forwards nothing between them, so every link (client to server, server to \
         server) has the round trip below. Greedy, {new_tokens} new tokens; decode tokens/s (the prefill \
         left out), medians of {rounds} rounds; every run's tokens equal `corolla generate --local`'s \
         except where f16 rounds them ({lossy}). Variants: {}.\n\n\
         One layer's decode step on this CPU: **{layer_ms:.1} ms** (local runs of 10 and 1 layers: \
         {local_ms:.1} and {:.1} ms per token, the head included).\n\n\
         | RTT | variant | prompt | tokens/s | ms/token | ms/step | tokens/step |\n|---|---|---|---|---|---|---|\n{rows}\n\
         A step is one trip down the route; a drafting client may take several tokens a step. \
         Floors per step set by the delays alone: {}.\n\nRatios (same run): {}.\n\n{recovery}",
        variants.join(", "),
        local_one.decode_ms_per_token(),
        limits.join("; "),
        ratios.join("; ")
    )))
}

/// Kills the server in use for the replicated block once the answer is
/// under way; the answer must still equal the local one.
fn recovery_run(
    world: &mut WanWorld,
    model: &Path,
    new_tokens: usize,
    reference: &Generation,
) -> Result<String> {
    let prompt = PROMPTS[1].1;
    let normal = world
        .generate(model, prompt, new_tokens, &[])
        .map_err(|e| anyhow!(e))?;
    let replicas = [REPLICATED, SERVERS];
    let before = world.traffic();
    let started = Instant::now();
    let child = world
        .generate_command(model, prompt, new_tokens, &[])
        .spawn()?;
    // The prompt's activations and ~10 tokens' (f16 at least) on its link.
    let threshold = 10 * 8192 * 2 * 2 + (64 << 10);
    let Some(victim) =
        world.wait_for_traffic(&before, &replicas, threshold, Duration::from_secs(300))
    else {
        let out = WanWorld::wait_generation(child, started);
        bail!("no replica carried the answer: {out:?}");
    };
    world.servers[victim].kill();
    let killed_after = started.elapsed();
    let out = WanWorld::wait_generation(child, started).map_err(|e| anyhow!(e))?;
    if out.generated_ids != reference.generated_ids {
        bail!("tokens after the recovery differ from the local run");
    }
    let recoveries = out.recoveries();
    let seconds: f64 = recoveries
        .iter()
        .filter_map(|r| r["seconds"].as_f64())
        .sum();
    if recoveries.is_empty() {
        bail!("the answer went on without a recovery: the wrong server was killed");
    }
    Ok(format!(
        "Recovery at {} ms RTT: the server of block {REPLICATED} in use is killed {:.1} s into the answer \
         (once it has computed 8 tokens); the answer goes on through the other \
         server of the block, with the same tokens as the local run.\n\n\
         | measure | s |\n|---|---|\n\
         | answer without a failure | {:.2} |\n\
         | answer with the failure | {:.2} |\n\
         | client's count (failure to caught up) | {seconds:.2} |\n",
        RTTS_MS[0],
        killed_after.as_secs_f64(),
        normal.total_seconds,
        out.total_seconds,
    ))
}
