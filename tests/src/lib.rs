//! Shared helpers for the cross-crate tests: fixture paths, the reference
//! outputs computed by Hugging Face transformers, and error measures.

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
    };
    let mut chain =
        corolla_client::LocalChain::new(spans, request.max_length()).expect("session caches");
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
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target profile dir");
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
    let model = tiny_llama();
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
