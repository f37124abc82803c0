//! Shared helpers for the cross-crate tests: fixture paths, the reference
//! outputs computed by Hugging Face transformers, and error measures.

pub mod batching_bench;
pub mod browser;
pub mod chat_bench;
pub mod compute_bench;
pub mod demo_swarm;
pub mod experts_bench;
pub mod forwarder;
pub mod hop_timeline;
pub mod hostile;
pub mod nat;
pub mod netns;
pub mod page_figures;
pub mod prefix_bench;
pub mod reliability;
pub mod report;
pub mod span_batching;
pub mod tls;
pub mod wan;
pub mod wan_bench;
pub mod wire_quality;

/// The median of `v` (NaN when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The smallest and the largest of `v` (NaN for none): how far the rounds
/// behind a median spread on these noisy machines.
pub fn spread(v: &[f64]) -> (f64, f64) {
    let lowest = v.iter().copied().fold(f64::NAN, f64::min);
    let highest = v.iter().copied().fold(f64::NAN, f64::max);
    (lowest, highest)
}

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

pub fn tiny_llama() -> PathBuf {
    fixtures_dir().join("tiny-llama-a")
}

pub fn tiny_llama_fp16() -> PathBuf {
    fixtures_dir().join("tiny-llama-a-fp16")
}

/// The default model (SmolLM2-135M-Instruct, Q4_1 GGUF), if fetched: the
/// README's test command fetches it (`corolla fetch-model`). Tests that need
/// it say so loudly and pass vacuously without it.
pub fn default_model() -> Option<PathBuf> {
    let path = std::env::var_os("COROLLA_DEFAULT_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            corolla_client::models::cached_path(&corolla_client::models::DEFAULT_MODEL)
        });
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "SKIPPED: the default model is not at {} (run `corolla fetch-model`)",
            path.display()
        );
        None
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct SmolRun {
    pub prompt: String,
    pub chat: bool,
    pub rendered: String,
    pub input_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub generated_text: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct TokenizerCase {
    pub text: String,
    pub ids: Vec<u32>,
}

/// Ground truth for the default model from `tests/reference/smollm2_reference.py`.
#[derive(Debug, Clone, Deserialize)]
pub struct SmolReference {
    pub tokenizer_cases: Vec<TokenizerCase>,
    pub runs: Vec<SmolRun>,
}

impl SmolReference {
    pub fn load() -> Self {
        let path = fixtures_dir().join("smollm2").join("reference.json");
        serde_json::from_slice(&std::fs::read(path).expect("smollm2 reference")).expect("json")
    }
}

/// One prompt of [`LlamaCppReference`].
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaCppRun {
    pub prompt: String,
    pub chat: bool,
    pub input_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
}

/// llama.cpp's greedy tokens for the prompts of [`SmolReference`], computed
/// from the default model's quantized blocks as they are stored
/// (`tests/reference/smollm2_llamacpp.mjs`): the reference of
/// `--quantized keep`, and so of the default `auto`.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaCppReference {
    pub runs: Vec<LlamaCppRun>,
}

impl LlamaCppReference {
    pub fn load() -> Self {
        let path = fixtures_dir().join("smollm2").join("llamacpp.json");
        serde_json::from_slice(&std::fs::read(path).expect("llama.cpp reference")).expect("json")
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct GoldenPrompt {
    pub prompt: String,
    pub input_ids: Vec<u32>,
    pub generated_new_ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
struct GoldenJson {
    prompts: Vec<GoldenPrompt>,
}

/// Reference tensors and prompts from `golden/<label>.{json,safetensors}`.
pub struct Golden {
    pub prompts: Vec<GoldenPrompt>,
    tensors: HashMap<String, Tensor>,
}

impl Golden {
    pub fn load(model_dir: &Path, label: &str) -> Self {
        let dir = model_dir.join("golden");
        let json = std::fs::read_to_string(dir.join(format!("{label}.json"))).expect("golden json");
        let parsed: GoldenJson = serde_json::from_str(&json).expect("golden json parses");
        let tensors =
            candle_core::safetensors::load(dir.join(format!("{label}.safetensors")), &Device::Cpu)
                .expect("golden tensors");
        Golden {
            prompts: parsed.prompts,
            tensors,
        }
    }

    pub fn tensor(&self, name: &str) -> &Tensor {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("golden tensor {name} missing"))
    }

    /// All ids of `prompt{p}.generated_ids`: prompt followed by the new tokens.
    pub fn generated_ids(&self, p: usize) -> Vec<u32> {
        self.tensor(&format!("prompt{p}.generated_ids"))
            .flatten_all()
            .and_then(|t| t.to_dtype(DType::I64))
            .and_then(|t| t.to_vec1::<i64>())
            .expect("ids")
            .into_iter()
            .map(|i| i as u32)
            .collect()
    }
}

/// ‖actual − expected‖₂ / ‖expected‖₂, computed in f64.
pub fn relative_l2(actual: &Tensor, expected: &Tensor) -> f64 {
    assert_eq!(actual.dims(), expected.dims(), "shape mismatch");
    let a = actual
        .flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .expect("actual");
    let e = expected
        .flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .expect("expected");
    let diff: f64 = a.iter().zip(&e).map(|(x, y)| (x - y) * (x - y)).sum();
    let norm: f64 = e.iter().map(|y| y * y).sum();
    (diff / norm).sqrt()
}

/// Greedy (or sampled) generation through `spans` chained in this process.
pub fn generate_local(
    head: &corolla_model::ClientHead,
    spans: &[corolla_model::BlockSpan],
    prompt_ids: &[u32],
    max_new_tokens: usize,
    sampling: corolla_model::SamplingParams,
) -> Vec<u32> {
    let request = corolla_client::GenerateRequest {
        prompt_ids: prompt_ids.to_vec(),
        max_new_tokens,
        sampling,
        stop_at_eos: false,
        drafts: corolla_client::DEFAULT_DRAFTS,
    };
    let mut chain =
        corolla_client::LocalChain::new(spans, request.max_length()).expect("session caches");
    let out = futures_lite_block_on(corolla_client::generate(head, &mut chain, &request, |_| {
        std::ops::ControlFlow::Continue(())
    }))
    .expect("generation");
    out.generated_ids
}

/// `tests/fixtures/<relative>`, parsed as JSON.
pub fn fixture_json(relative: &str) -> serde_json::Value {
    let path = fixtures_dir().join(relative);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// [`generate_local`] with every span's steps through `adapter`.
pub fn generate_local_with_adapter(
    head: &corolla_model::ClientHead,
    spans: &[corolla_model::BlockSpan],
    adapter: &corolla_model::AdapterFile,
    prompt_ids: &[u32],
    max_new_tokens: usize,
) -> Vec<u32> {
    let request = corolla_client::GenerateRequest {
        prompt_ids: prompt_ids.to_vec(),
        max_new_tokens,
        sampling: corolla_model::SamplingParams::greedy(),
        stop_at_eos: false,
        drafts: corolla_client::DEFAULT_DRAFTS,
    };
    let mut chain = corolla_client::LocalChain::with_adapter(spans, request.max_length(), adapter)
        .expect("session caches with the adapter");
    let out = futures_lite_block_on(corolla_client::generate(head, &mut chain, &request, |_| {
        std::ops::ControlFlow::Continue(())
    }))
    .expect("generation");
    out.generated_ids
}

/// Polls a future that never waits (the local chain) to completion.
fn futures_lite_block_on<F: std::future::Future>(fut: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    let mut fut = std::pin::pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
    }
}

/// Copies the fixture's side files into `dir` and writes `tensors` (a
/// subset or transformation of the fixture's) as a single `model.safetensors`.
pub fn write_variant(
    source: &Path,
    dir: &Path,
    config: serde_json::Value,
    tensors: &HashMap<String, Tensor>,
) {
    std::fs::create_dir_all(dir).expect("variant dir");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(source.join(f), dir.join(f)).expect("copy side file");
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&config).expect("json"),
    )
    .expect("config");
    candle_core::safetensors::save(tensors, dir.join("model.safetensors")).expect("save");
}

pub fn read_config(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("config.json")).expect("config")).expect("json")
}

pub fn read_weights(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).expect("weights")
}

/// The `corolla` binary built beside this test executable.
pub fn corolla_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // Tests run from target/<profile>/deps, binaries from target/<profile>.
    let parent = exe.parent().expect("executable dir");
    let dir = if parent.ends_with("deps") {
        parent.parent().expect("target profile dir")
    } else {
        parent
    };
    let bin = dir.join(format!("corolla{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} is missing: build it first (cargo build -p corolla-client --bin corolla)",
        bin.display()
    );
    bin
}

/// Starts a server of the tiny Llama's `blocks` on an ephemeral loopback
/// port: a new swarm, or joining `join` (a multiaddr); `extra` flags last.
pub async fn start_server(
    blocks: &str,
    join: Option<&str>,
    extra: &[&str],
) -> corolla_server::RunningServer {
    start_model_server(&tiny_llama(), blocks, join, extra).await
}

/// With `COROLLA_TEST_LOG` set (a `tracing` filter such as
/// `warn,corolla_shared=debug`), the in-process servers' logs go to stderr:
/// how a flaky network test is read after the fact (libtest captures only
/// the test's own thread, and the servers run on the runtime's).
fn log_servers_when_asked() {
    static LOGS: std::sync::Once = std::sync::Once::new();
    LOGS.call_once(|| {
        if let Ok(filter) = std::env::var("COROLLA_TEST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_writer(std::io::stderr)
                .try_init();
        }
    });
}

/// [`start_server`] for any model folder or GGUF file.
pub async fn start_model_server(
    model: &Path,
    blocks: &str,
    join: Option<&str>,
    extra: &[&str],
) -> corolla_server::RunningServer {
    log_servers_when_asked();
    let mut args: Vec<String> = [
        "corolla-server",
        "--model",
        model.to_str().expect("utf-8 path"),
        "--block-indices",
        blocks,
    ]
    .into_iter()
    .chain(["--host", "127.0.0.1", "--port", "0"])
    .map(String::from)
    .collect();
    match join {
        Some(peer) => args.extend(["--initial-peers".to_string(), peer.to_string()]),
        None => args.push("--new-swarm".into()),
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let args = corolla_server::ServerArgs::from_args_and_file(args).expect("server flags");
    corolla_server::Server::start(args)
        .await
        .expect("server starts")
}

/// Writes the tiny Llama fixture as a GGUF file the way llama.cpp's
/// converter does: Q and K rows permuted into the interleaved rotary layout,
/// `llama.*` metadata, and its byte-level BPE tokenizer as `gpt2` metadata.
/// With `quantize`, the projections whose rows are whole Q8_0 blocks become
/// Q8_0 (the rest stays F32).
pub fn write_tiny_gguf(path: &Path, quantize: bool, chat_template: Option<&str>) {
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::{GgmlDType, QTensor};

    let source = tiny_llama();
    let cfg = read_config(&source);
    let heads = cfg["num_attention_heads"].as_u64().expect("heads") as usize;
    let kv_heads = cfg["num_key_value_heads"].as_u64().expect("kv heads") as usize;
    let weights = read_weights(&source);
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|hf| {
            let w = &weights[hf];
            let permute_heads = if hf.ends_with("q_proj.weight") {
                Some(heads)
            } else if hf.ends_with("k_proj.weight") {
                Some(kv_heads)
            } else {
                None
            };
            // llama.cpp: reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2)
            let w = match permute_heads {
                Some(n) => {
                    let (rows, cols) = w.dims2().expect("2-d");
                    w.reshape((n, 2, rows / n / 2, cols))
                        .and_then(|t| t.transpose(1, 2))
                        .and_then(|t| t.reshape((rows, cols)))
                        .expect("permute")
                }
                None => w.clone(),
            };
            let cols = *w.dims().last().expect("dims");
            let dtype = if quantize && w.rank() == 2 && cols % 32 == 0 && hf.contains(".layers.") {
                GgmlDType::Q8_0
            } else {
                GgmlDType::F32
            };
            let name = corolla_model::gguf::gguf_name(hf).expect("a Llama tensor");
            (name, QTensor::quantize(&w, dtype).expect("quantize"))
        })
        .collect();

    let tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(source.join("tokenizer.json")).expect("tokenizer"))
            .expect("json");
    let vocab = tok["model"]["vocab"].as_object().expect("vocab");
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, id) in vocab {
        tokens[id.as_u64().expect("id") as usize] = t.clone();
    }
    let mut types = vec![1i32; tokens.len()];
    for added in tok["added_tokens"].as_array().expect("added") {
        types[added["id"].as_u64().expect("id") as usize] = 3;
    }
    let merges: Vec<String> = tok["model"]["merges"]
        .as_array()
        .expect("merges")
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => s.clone(),
            pair => format!(
                "{} {}",
                pair[0].as_str().unwrap(),
                pair[1].as_str().unwrap()
            ),
        })
        .collect();
    let u32v = |k: &str| Value::U32(cfg[k].as_u64().expect(k) as u32);
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let mut metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", u32v("num_hidden_layers")),
        ("llama.context_length", u32v("max_position_embeddings")),
        ("llama.embedding_length", u32v("hidden_size")),
        ("llama.feed_forward_length", u32v("intermediate_size")),
        ("llama.attention.head_count", u32v("num_attention_heads")),
        ("llama.attention.head_count_kv", u32v("num_key_value_heads")),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32),
        ),
        (
            "llama.rope.freq_base",
            Value::F32(cfg["rope_theta"].as_f64().unwrap() as f32),
        ),
        ("llama.vocab_size", u32v("vocab_size")),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("default".into())),
        ("tokenizer.ggml.tokens", strings(tokens)),
        (
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges", strings(merges)),
        ("tokenizer.ggml.bos_token_id", u32v("bos_token_id")),
        ("tokenizer.ggml.eos_token_id", u32v("eos_token_id")),
        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
    ];
    if let Some(t) = chat_template {
        metadata.push(("tokenizer.chat_template", Value::String(t.into())));
    }
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut file = std::fs::File::create(path).expect("create gguf");
    gguf_file::write(&mut file, &metadata, &tensors).expect("write gguf");
}

/// The `corolla-server` binary built beside this test executable.
pub fn corolla_server_bin() -> PathBuf {
    let bin =
        corolla_bin().with_file_name(format!("corolla-server{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} is missing: build the binaries first",
        bin.display()
    );
    bin
}

/// The outcome of [`concurrent_generations`].
pub struct ConcurrentRun {
    /// One per request, in order.
    pub outputs: Vec<corolla_client::GenerateOutput>,
    /// From the first session's start to the last one's end.
    pub wall_time: std::time::Duration,
}

impl ConcurrentRun {
    /// New tokens of all sessions per second of wall time.
    pub fn aggregate_tokens_per_second(&self) -> f64 {
        let tokens: usize = self.outputs.iter().map(|o| o.generated_ids.len()).sum();
        tokens as f64 / self.wall_time.as_secs_f64().max(1e-9)
    }

    /// The median session's own tokens per second.
    pub fn median_session_tokens_per_second(&self) -> f64 {
        let mut v: Vec<f64> = self.outputs.iter().map(|o| o.tokens_per_second()).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    }
}

/// Runs every request at once, each through its own chain of sessions on
/// the swarm `node` knows, and waits for all of them.
pub async fn concurrent_generations(
    node: &corolla_shared::node::NodeHandle,
    settings: &corolla_client::SessionSettings,
    head: &corolla_model::ClientHead,
    requests: &[corolla_client::GenerateRequest],
) -> anyhow::Result<ConcurrentRun> {
    let started = std::time::Instant::now();
    let runs = requests.iter().map(|request| async move {
        let mut settings = settings.clone();
        settings.max_length = request.max_length();
        let mut chain =
            corolla_client::RemoteChain::connect(node, settings, &candle_core::Device::Cpu).await?;
        let out = corolla_client::generate(head, &mut chain, request, |_| {
            std::ops::ControlFlow::Continue(())
        })
        .await;
        chain.close().await;
        Ok::<_, anyhow::Error>(out?)
    });
    let outputs = futures::future::try_join_all(runs).await?;
    Ok(ConcurrentRun {
        outputs,
        wall_time: started.elapsed(),
    })
}

/// A greedy request for `max_new_tokens` after `prompt_ids`, past any end of sequence.
pub fn greedy(prompt_ids: Vec<u32>, max_new_tokens: usize) -> corolla_client::GenerateRequest {
    corolla_client::GenerateRequest {
        prompt_ids,
        max_new_tokens,
        sampling: corolla_model::SamplingParams::greedy(),
        stop_at_eos: false,
        drafts: corolla_client::DEFAULT_DRAFTS,
    }
}

/// The benchmarks' random Llama: hidden 512, 8 layers, 8 heads, 4 KV heads,
/// FFN 1376, vocab 4096.
pub fn bench_spec() -> corolla_model::random::RandomSpec {
    corolla_model::random::RandomSpec {
        hidden_size: 512,
        num_layers: 8,
        num_heads: 8,
        num_kv_heads: 4,
        intermediate_size: 1376,
        vocab_size: 4096,
        max_positions: 1024,
        seed: 7,
    }
}
