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
