//! GGUF loading without the default model: the tiny Llama fixture written as
//! GGUF the way llama.cpp converts (interleaved Q/K rows) must compute what
//! transformers computed from its safetensors.

use corolla_client::{ChatMessage, ChatTemplate, TextTokenizer};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_tests::{generate_local, relative_l2, tiny_llama, write_tiny_gguf, Golden};

const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn full_logits(ck: &Checkpoint, ids: &[u32]) -> candle_core::Tensor {
    let dev = Device::Cpu;
    let head = ClientHead::load(ck, DType::F32, &dev).unwrap();
    let layers = ck.config().num_hidden_layers;
    let span = BlockSpan::load(ck, 0, layers, DType::F32, &dev).unwrap();
    let mut cache = span.new_cache(ids.len()).unwrap();
    let hidden = span
        .forward(&head.embed(ids).unwrap(), 0, &mut cache)
        .unwrap();
    head.logits(&hidden).unwrap()
}

fn golden_tokens(ck: &Checkpoint) {
    let golden = Golden::load(&tiny_llama(), "float32");
    let dev = Device::Cpu;
    let head = ClientHead::load(ck, DType::F32, &dev).unwrap();
    let spans = [
        BlockSpan::load(ck, 0, 1, DType::F32, &dev).unwrap(),
        BlockSpan::load(ck, 1, 4, DType::F32, &dev).unwrap(),
    ];
    for p in &golden.prompts {
        let got = generate_local(
            &head,
            &spans,
            &p.input_ids,
            p.generated_new_ids.len(),
            SamplingParams::default(),
        );
        assert_eq!(got, p.generated_new_ids, "{:?}", p.prompt);
    }
}

#[test]
fn f32_gguf_computes_what_transformers_computed() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tiny.gguf");
    write_tiny_gguf(&path, false, None);
    let gguf = Checkpoint::open(&path).unwrap();
    let st = Checkpoint::open(tiny_llama()).unwrap();
    assert_eq!(gguf.config().num_hidden_layers, 4);
    assert_eq!(gguf.config().num_key_value_heads, 2);
    assert!(!gguf.config().tie_word_embeddings);
    let ids = Golden::load(&tiny_llama(), "float32").prompts[0]
        .input_ids
        .clone();
    let err = relative_l2(&full_logits(&gguf, &ids), &full_logits(&st, &ids));
    assert!(err < 1e-5, "relative error {err}");
    golden_tokens(&gguf);
}

#[test]
fn q8_gguf_stays_close_kept_or_dequantized() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tiny-q8.gguf");
    write_tiny_gguf(&path, true, None);
    let st = Checkpoint::open(tiny_llama()).unwrap();
    let ids = Golden::load(&tiny_llama(), "float32").prompts[0]
        .input_ids
        .clone();
    let reference = full_logits(&st, &ids);
    for dequantize in [false, true] {
        let ck = Checkpoint::open(&path).unwrap().with_dequantize(dequantize);
        let err = relative_l2(&full_logits(&ck, &ids), &reference);
        assert!(
            err > 1e-7 && err < 0.05,
            "dequantize={dequantize}: relative error {err}"
        );
    }
}

#[test]
fn gguf_tokenizer_matches_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tiny.gguf");
    write_tiny_gguf(&path, false, None);
    let from_gguf = TextTokenizer::for_checkpoint(&Checkpoint::open(&path).unwrap()).unwrap();
    let from_json =
        TextTokenizer::for_checkpoint(&Checkpoint::open(tiny_llama()).unwrap()).unwrap();
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "  spaces, digits 12345 and\nnew lines\t",
        "Ünïcödé 漢字 🚀",
        "<s>special</s>",
    ] {
        let ids = from_json.encode(text).unwrap();
        assert_eq!(from_gguf.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(
            from_gguf.decode(&ids).unwrap(),
            from_json.decode(&ids).unwrap()
        );
    }
}

#[test]
fn converted_gguf_parts_compute_the_same_and_keep_the_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tiny-q8.gguf");
    write_tiny_gguf(&path, true, Some(CHATML));
    let source = Checkpoint::open(&path).unwrap();
    let out = tmp.path().join("parts");
    let index = corolla_model::convert::convert(&source, &out, 2, |_| {}).unwrap();
    assert_eq!(index.client, "client.gguf");
    assert_eq!(index.spans.len(), 2);
    assert!(out.join("blocks-00000-00002.gguf").is_file());
    assert!(out.join("config.json").is_file());

    let parts = Checkpoint::open(&out).unwrap();
    assert_eq!(parts.config(), source.config());
    assert!(parts.is_gguf());
    let ids = Golden::load(&tiny_llama(), "float32").prompts[1]
        .input_ids
        .clone();
    let err = relative_l2(&full_logits(&parts, &ids), &full_logits(&source, &ids));
    assert_eq!(
        err, 0.0,
        "parts must compute exactly what the file computes"
    );
    assert_eq!(
        corolla_model::fingerprint::block_hashes(&parts, 0, 4).unwrap(),
        corolla_model::fingerprint::block_hashes(&source, 0, 4).unwrap()
    );

    // The client part carries the tokenizer and the chat template.
    let tok = TextTokenizer::for_checkpoint(&parts).unwrap();
    let template = parts.chat_template().unwrap();
    assert_eq!(template.as_deref(), Some(CHATML));
    let chat = ChatTemplate::new(template.as_deref(), &tok, Some(1), Some(2)).unwrap();
    assert_eq!(
        chat.render(&[ChatMessage::user("hi")], true).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn kept_quantized_blocks_are_told_apart_from_dequantized_ones() {
    use corolla_model::fingerprint::block_hashes;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tiny-q8.gguf");
    write_tiny_gguf(&path, true, None);
    let kept = block_hashes(&Checkpoint::open(&path).unwrap(), 0, 4).unwrap();
    let dense = block_hashes(
        &Checkpoint::open(&path).unwrap().with_dequantize(true),
        0,
        4,
    )
    .unwrap();
    assert!(kept.iter().zip(&dense).all(|(k, d)| *k == format!("{d}+q")));
    // Converted parts keep the weights' hashes; the mode is marked when loaded.
    let out = tmp.path().join("parts");
    corolla_model::convert::convert(&Checkpoint::open(&path).unwrap(), &out, 4, |_| {}).unwrap();
    let parts = Checkpoint::open(&out).unwrap().with_dequantize(true);
    assert_eq!(block_hashes(&parts, 0, 4).unwrap(), dense);
}
