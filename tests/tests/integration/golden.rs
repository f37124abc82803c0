//! The model core against Hugging Face transformers' own outputs.

use corolla_client::TextTokenizer;
use corolla_model::convert::convert;
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_tests::{generate_local, relative_l2, tiny_llama, tiny_llama_fp16, Golden};

const F32_TOLERANCE: f64 = 1e-4;

fn load(
    dir: &std::path::Path,
    dtype: DType,
    ranges: &[(usize, usize)],
) -> (ClientHead, Vec<BlockSpan>) {
    let ck = Checkpoint::open(dir).unwrap();
    let head = ClientHead::load(&ck, dtype, &Device::Cpu).unwrap();
    let spans = ranges
        .iter()
        .map(|&(a, b)| BlockSpan::load(&ck, a, b, dtype, &Device::Cpu).unwrap())
        .collect();
    (head, spans)
}

/// Runs each prompt through `spans` and checks every span boundary's output
/// against the layer outputs, and the logits, of the reference.
fn check_layers_and_logits(
    head: &ClientHead,
    spans: &[BlockSpan],
    golden: &Golden,
    tolerance: f64,
) {
    for (p, prompt) in golden.prompts.iter().enumerate() {
        let ids = &prompt.input_ids;
        let mut x = head.embed(ids).unwrap();
        let err = relative_l2(&x, golden.tensor(&format!("prompt{p}.hidden_states.0")));
        assert!(
            err < tolerance,
            "prompt {p} embeddings: relative error {err:e}"
        );
        for span in spans {
            let mut cache = span.new_cache(ids.len()).unwrap();
            x = span.forward(&x, 0, &mut cache).unwrap();
            let last = span.range().end - 1;
            let err = relative_l2(&x, golden.tensor(&format!("prompt{p}.layer_output.{last}")));
            assert!(
                err < tolerance,
                "prompt {p} layer {last}: relative error {err:e}"
            );
        }
        let err = relative_l2(
            &head.final_norm(&x).unwrap(),
            golden.tensor(&format!("prompt{p}.final_norm")),
        );
        assert!(
            err < tolerance,
            "prompt {p} final norm: relative error {err:e}"
        );
        let err = relative_l2(
            &head.logits(&x).unwrap(),
            golden.tensor(&format!("prompt{p}.logits")),
        );
        assert!(err < tolerance, "prompt {p} logits: relative error {err:e}");
    }
}

fn check_greedy(head: &ClientHead, spans: &[BlockSpan], golden: &Golden) {
    for (p, prompt) in golden.prompts.iter().enumerate() {
        let new = generate_local(head, spans, &prompt.input_ids, 32, SamplingParams::greedy());
        assert_eq!(
            new, prompt.generated_new_ids,
            "prompt {p}: greedy tokens differ"
        );
        assert_eq!(
            [prompt.input_ids.clone(), new].concat(),
            golden.generated_ids(p),
            "prompt {p}: generated_ids tensor"
        );
    }
}

#[test]
fn every_layer_and_the_logits_match_in_f32() {
    let golden = Golden::load(&tiny_llama(), "float32");
    let (head, spans) = load(&tiny_llama(), DType::F32, &[(0, 1), (1, 2), (2, 3), (3, 4)]);
    check_layers_and_logits(&head, &spans, &golden, F32_TOLERANCE);
}

#[test]
fn greedy_generation_matches_as_one_span() {
    let golden = Golden::load(&tiny_llama(), "float32");
    let (head, spans) = load(&tiny_llama(), DType::F32, &[(0, 4)]);
    check_greedy(&head, &spans, &golden);
}

#[test]
fn greedy_generation_matches_as_chained_spans() {
    let golden = Golden::load(&tiny_llama(), "float32");
    let (head, spans) = load(&tiny_llama(), DType::F32, &[(0, 1), (1, 3), (3, 4)]);
    check_layers_and_logits(&head, &spans, &golden, F32_TOLERANCE);
    check_greedy(&head, &spans, &golden);
}

#[test]
fn decode_step_logits_match_the_reference_kv_cache_run() {
    let golden = Golden::load(&tiny_llama(), "float32");
    let (head, spans) = load(&tiny_llama(), DType::F32, &[(0, 2), (2, 4)]);
    let prompt = &golden.prompts[1];
    let all = golden.generated_ids(1);
    let mut caches: Vec<_> = spans
        .iter()
        .map(|s| s.new_cache(all.len()).unwrap())
        .collect();
    let expected = golden.tensor("prompt1.gen_step_logits");
    let mut start = 0;
    let mut input = prompt.input_ids.clone();
    for step in 0..32 {
        let mut x = head.embed(&input).unwrap();
        for (span, cache) in spans.iter().zip(&mut caches) {
            x = span.forward(&x, start, cache).unwrap();
        }
        let logits = head.last_logits(&x).unwrap();
        let err = relative_l2(&logits, &expected.get(step).unwrap());
        assert!(err < F32_TOLERANCE, "step {step}: relative error {err:e}");
        start += input.len();
        input = vec![all[start]];
    }
}

#[test]
fn the_converted_layout_gives_identical_outputs() {
    let golden = Golden::load(&tiny_llama(), "float32");
    let source = Checkpoint::open(tiny_llama()).unwrap();
    for blocks_per_file in [1, 3] {
        let out = tempfile::tempdir().unwrap();
        let dir = out.path().join("converted");
        let index = convert(&source, &dir, blocks_per_file, |_| {}).unwrap();
        assert_eq!(index.spans.len(), 4usize.div_ceil(blocks_per_file));
        assert!(dir.join("client.safetensors").is_file() && dir.join("tokenizer.json").is_file());
        assert!(!dir.join("model.safetensors").exists());
        let (head, spans) = load(&dir, DType::F32, &[(0, 1), (1, 3), (3, 4)]);
        check_layers_and_logits(&head, &spans, &golden, F32_TOLERANCE);
        check_greedy(&head, &spans, &golden);
    }
}

#[test]
fn a_span_loads_only_its_own_block_files() {
    let source = Checkpoint::open(tiny_llama()).unwrap();
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("converted");
    convert(&source, &dir, 2, |_| {}).unwrap();
    // A server of layers [2, 4) needs neither the other span nor the client part.
    std::fs::remove_file(dir.join("blocks-00000-00002.safetensors")).unwrap();
    std::fs::remove_file(dir.join("client.safetensors")).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    BlockSpan::load(&ck, 2, 4, DType::F32, &Device::Cpu).unwrap();
    assert!(BlockSpan::load(&ck, 1, 3, DType::F32, &Device::Cpu).is_err());
}

#[test]
fn fp16_logits_match_within_1e_2() {
    let golden = Golden::load(&tiny_llama_fp16(), "float16");
    let (head, spans) = load(&tiny_llama_fp16(), DType::F16, &[(0, 1), (1, 3), (3, 4)]);
    assert_eq!(head.dtype(), DType::F16);
    for (p, prompt) in golden.prompts.iter().enumerate() {
        let mut x = head.embed(&prompt.input_ids).unwrap();
        for span in &spans {
            let mut cache = span.new_cache(prompt.input_ids.len()).unwrap();
            x = span.forward(&x, 0, &mut cache).unwrap();
        }
        let err = relative_l2(
            &head.logits(&x).unwrap(),
            golden.tensor(&format!("prompt{p}.logits")),
        );
        assert!(err < 1e-2, "prompt {p}: fp16 logits relative error {err:e}");
    }
}

#[test]
fn fp16_weights_computed_in_f32_match_exactly() {
    let golden = Golden::load(&tiny_llama_fp16(), "float16_weights_float32_compute");
    let (head, spans) = load(&tiny_llama_fp16(), DType::F32, &[(0, 2), (2, 4)]);
    check_layers_and_logits(&head, &spans, &golden, F32_TOLERANCE);
    check_greedy(&head, &spans, &golden);
}

#[test]
fn the_tokenizer_encodes_prompts_like_transformers() {
    for (dir, label) in [(tiny_llama(), "float32"), (tiny_llama_fp16(), "float16")] {
        let golden = Golden::load(&dir, label);
        let tokenizer = TextTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        for prompt in &golden.prompts {
            assert_eq!(
                tokenizer.encode(&prompt.prompt).unwrap(),
                prompt.input_ids,
                "{:?}",
                prompt.prompt
            );
        }
    }
}

pub(crate) mod families {
    //! Llama 3 (llama3 rope scaling), Qwen2 (Q/K/V biases, tied embeddings),
    //! Mistral (a sliding window of 8, shorter than the prompts), Qwen3
    //! (per-head Q/K norms, heads wider than hidden / heads), Mixtral (four
    //! experts, two per token) and Qwen3-MoE (eight experts) against
    //! transformers (`tests/reference/families_reference.py`), from their
    //! transformers folders and from GGUF files written as llama.cpp does.

    use corolla_model::config::Family;
    use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, Tensor};
    use corolla_tests::{fixtures_dir, generate_local};
    use serde_json::Value;

    const FAMILIES: [(&str, Family); 6] = [
        ("llama3", Family::Llama),
        ("qwen2", Family::Qwen2),
        ("mistral", Family::Mistral),
        ("qwen3", Family::Qwen3),
        ("mixtral", Family::Mixtral),
        ("qwen3_moe", Family::Qwen3Moe),
    ];

    fn golden() -> Value {
        corolla_tests::fixture_json("families/golden.json")
    }

    /// The relative error of `logits` against a run's `last_logits`.
    pub(crate) fn last_logits_error(run: &Value, logits: &Tensor) -> f64 {
        let expected: Vec<f32> = run["last_logits"]
            .as_array()
            .expect("last_logits")
            .iter()
            .map(|x| x.as_f64().expect("a logit") as f32)
            .collect();
        corolla_tests::relative_l2(logits, &Tensor::new(expected, &Device::Cpu).unwrap())
    }

    pub(crate) fn ids(v: &Value) -> Vec<u32> {
        v.as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    }

    /// `family`'s checkpoint: the transformers folder, or with `gguf` the
    /// same weights as llama.cpp's converter writes them.
    pub(crate) fn load(
        family: &str,
        gguf: bool,
        ranges: &[(usize, usize)],
    ) -> (Checkpoint, ClientHead, Vec<BlockSpan>) {
        let name = if gguf {
            format!("{family}.gguf")
        } else {
            family.to_string()
        };
        let ck = Checkpoint::open(fixtures_dir().join("families").join(name)).unwrap();
        let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
        let spans = ranges
            .iter()
            .map(|&(a, b)| BlockSpan::load(&ck, a, b, DType::F32, &Device::Cpu).unwrap())
            .collect();
        (ck, head, spans)
    }

    #[test]
    fn each_family_generates_what_transformers_generates_in_one_and_three_spans() {
        let golden = golden();
        for ((family, kind), gguf) in FAMILIES.into_iter().flat_map(|f| [(f, false), (f, true)]) {
            for ranges in [&[(0, 3)][..], &[(0, 1), (1, 2), (2, 3)]] {
                let (ck, head, spans) = load(family, gguf, ranges);
                // llama.cpp stores Mistral as `llama` (its window as a key).
                let kind = if gguf && kind == Family::Mistral {
                    Family::Llama
                } else {
                    kind
                };
                assert_eq!(ck.config().family, kind, "{family} gguf: {gguf}");
                for run in golden["families"][family].as_array().unwrap() {
                    let prompt = ids(&run["prompt_ids"]);
                    let want = ids(&run["generated_ids"]);
                    let got =
                        generate_local(&head, &spans, &prompt, want.len(), Default::default());
                    assert_eq!(
                        got,
                        want,
                        "{family} gguf: {gguf} {ranges:?} prompt of {}",
                        prompt.len()
                    );
                    // The last position's logits of a plain forward.
                    let mut hidden = head.embed(&prompt).unwrap();
                    for span in &spans {
                        let mut cache = span.new_cache(prompt.len()).unwrap();
                        hidden = span.forward(&hidden, 0, &mut cache).unwrap();
                    }
                    let err = last_logits_error(run, &head.last_logits(&hidden).unwrap());
                    assert!(
                        err < 1e-4,
                        "{family} gguf: {gguf}: logits relative error {err}"
                    );
                }
            }
        }
    }

    /// What a server runs: decode steps through `forward_decode_batch` (the
    /// one-pass attention, with Mistral's window) after a prefill.
    #[test]
    fn each_family_decodes_through_the_batched_path_as_transformers_does() {
        let golden = golden();
        for ((family, _), gguf) in FAMILIES.into_iter().flat_map(|f| [(f, false), (f, true)]) {
            let (_, head, spans) = load(family, gguf, &[(0, 3)]);
            let span = &spans[0];
            for run in golden["families"][family].as_array().unwrap() {
                let prompt = ids(&run["prompt_ids"]);
                let want = ids(&run["generated_ids"]);
                let mut cache = span.new_cache(prompt.len() + want.len()).unwrap();
                let hidden = span
                    .forward(&head.embed(&prompt).unwrap(), 0, &mut cache)
                    .unwrap();
                let mut token = argmax(&head.last_logits(&hidden).unwrap());
                let mut got = vec![token];
                while got.len() < want.len() {
                    let position = prompt.len() + got.len() - 1;
                    let input = head.embed(&[token]).unwrap();
                    let out = span
                        .forward_decode_batch(&mut [(input, position, &mut cache)])
                        .unwrap();
                    token = argmax(&head.last_logits(&out[0]).unwrap());
                    got.push(token);
                }
                assert_eq!(
                    got,
                    want,
                    "{family} gguf: {gguf}: prompt of {}",
                    prompt.len()
                );
            }
        }
    }

    fn argmax(logits: &Tensor) -> u32 {
        logits.argmax(0).unwrap().to_scalar::<u32>().unwrap()
    }
}
