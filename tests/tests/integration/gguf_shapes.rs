//! 70B-class shapes (`corolla random-model`) and the page's split head.

use std::collections::HashMap;

use corolla_client::TextTokenizer;
use corolla_model::config::{Family, RopeScaling};
use corolla_model::convert::{write_page_part, PAGE_ROWS_FILE};
use corolla_model::embeddings::{RowFetch, RowFormat, RowsFuture};
use corolla_model::quantized_buffer::QuantizedBuffer;
use corolla_model::random_gguf::{write_random_gguf, ModelShape, RandomGguf, WeightQuant};
use corolla_model::rope::{frequency_divisors, RopeLayout};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, QuantizedWeights};
use corolla_tests::generate_local;
use sha2::{Digest, Sha256};

fn write(spec: &RandomGguf, dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join(format!("{}.gguf", spec.name));
    write_random_gguf(&path, spec, |_, _| {}).unwrap();
    path
}

#[test]
fn random_models_have_the_real_shapes_names_types_and_vocabularies() {
    let dir = tempfile::tempdir().unwrap();
    for shape in ModelShape::ALL {
        let path = write(&RandomGguf::new(shape, 1, WeightQuant::Q4K, 7), dir.path());
        let ck = Checkpoint::open(&path).unwrap();
        let real = shape.config(1);
        let cfg = ck.config();
        let name = shape.name();
        assert_eq!(
            (
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim
            ),
            (
                real.hidden_size,
                real.num_attention_heads,
                real.num_key_value_heads,
                128
            ),
            "{name}"
        );
        assert_eq!(cfg.intermediate_size, real.intermediate_size, "{name}");
        assert_eq!(cfg.vocab_size, real.vocab_size, "{name}");
        assert_eq!(cfg.rope_theta, real.rope_theta, "{name}");
        assert_eq!(cfg.eos_token_ids, real.eos_token_ids, "{name}");
        assert!(!cfg.tie_word_embeddings, "{name}");
        assert_eq!(cfg.experts, real.experts, "{name}");
        // What a server's --num-blocks auto counts: every expert, at
        // the stored size when kept quantized.
        let kept = ck.loaded_block_bytes(DType::F32).unwrap();
        let dense = Checkpoint::open(&path)
            .unwrap()
            .with_quantized_weights(QuantizedWeights::Dequantize)
            .loaded_block_bytes(DType::F32)
            .unwrap();
        assert_eq!(dense, cfg.block_parameters() * 4, "{name}");
        assert!(kept * 6 < dense, "{name}: {kept} kept, {dense} dequantized");
        let raw = |t: &str| format!("{:?}", ck.raw_tensor(t).unwrap().dtype);
        assert_eq!(raw("lm_head.weight"), "Q4K", "{name}");
        if cfg.experts.is_none() {
            assert_eq!(raw("model.layers.0.mlp.gate_proj.weight"), "Q4K", "{name}");
        }
        match shape {
            ModelShape::Llama2_70b => {
                assert_eq!(cfg.rope_scaling, RopeScaling::None);
                assert_eq!(ck.rope_layout(), RopeLayout::Interleaved);
            }
            ModelShape::Llama3_70b => {
                // llama.cpp's rope_freqs: the llama3 scaling as divisors.
                let RopeScaling::Divisors(d) = &cfg.rope_scaling else {
                    panic!("{:?}", cfg.rope_scaling)
                };
                for (got, want) in d.iter().zip(frequency_divisors(&real)) {
                    assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
                }
                assert_eq!(d.len(), 64);
            }
            ModelShape::Qwen25_72b => {
                assert_eq!(cfg.family, Family::Qwen2);
                assert!(cfg.qkv_bias && !cfg.attention_bias);
                assert_eq!(ck.rope_layout(), RopeLayout::Halves);
                assert!(ck.contains("model.layers.0.self_attn.q_proj.bias"));
                assert!(!ck.contains("model.layers.0.self_attn.o_proj.bias"));
                // 29568 is not whole blocks of 256: llama.cpp's fallback.
                assert_eq!(raw("model.layers.0.mlp.down_proj.weight"), "Q5_0");
            }
            ModelShape::Qwen3_32b => {
                assert_eq!(cfg.family, Family::Qwen3);
                assert_eq!(cfg.hidden_size, 5120);
                assert!(cfg.qk_norm && !cfg.qkv_bias && !cfg.attention_bias);
                assert_eq!(ck.rope_layout(), RopeLayout::Halves);
                for norm in ["q_norm", "k_norm"] {
                    let t = format!("model.layers.0.self_attn.{norm}.weight");
                    assert_eq!(ck.raw_tensor(&t).unwrap().shape, vec![128], "{t}");
                }
                assert!(!ck.contains("model.layers.0.self_attn.q_proj.bias"));
                assert_eq!(raw("model.layers.0.self_attn.o_proj.weight"), "Q4K");
            }
            ModelShape::Mixtral8x7b | ModelShape::Qwen3_30bA3b => {
                let experts = real.experts.clone().expect("experts");
                let (e, i) = (experts.count, experts.intermediate_size);
                let tensor = |t: &str| ck.raw_tensor(t).unwrap();
                let stacked = "model.layers.0.mlp.experts";
                assert_eq!(
                    tensor(&format!("{stacked}.gate_proj.weight")).shape,
                    [e, i, cfg.hidden_size]
                );
                assert_eq!(
                    tensor(&format!("{stacked}.down_proj.weight")).shape,
                    [e, cfg.hidden_size, i]
                );
                assert_eq!(raw(&format!("{stacked}.up_proj.weight")), "Q4K");
                assert_eq!(raw("model.layers.0.mlp.gate.weight"), "F32");
                let layout = if shape == ModelShape::Mixtral8x7b {
                    RopeLayout::Interleaved
                } else {
                    RopeLayout::Halves
                };
                assert_eq!(ck.rope_layout(), layout, "{name}");
            }
        }
        let tokenizer = TextTokenizer::for_checkpoint(&ck).unwrap();
        let text = "The quick brown fox jumps over the lazy dog, 12 times.";
        let ids = tokenizer.encode(text).unwrap();
        assert!(ids.iter().all(|&id| (id as usize) < cfg.vocab_size));
        assert!(ids.len() < text.len(), "{name}: {ids:?}");
        let decoded = tokenizer.decode(&ids).unwrap();
        assert_eq!(decoded.trim_start(), text, "{name}");
    }
}

#[test]
fn a_70b_shaped_layer_generates_with_finite_activations_and_mapped_embeddings() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &RandomGguf::new(ModelShape::Llama2_70b, 1, WeightQuant::Q4K, 1),
        dir.path(),
    );
    // Kept quantized by `auto`, as every GGUF (a 70B one could not be dequantized).
    let ck = Checkpoint::open(&path)
        .unwrap()
        .with_quantized_weights(QuantizedWeights::Auto);
    assert!(!ck.dequantizes());
    let dev = Device::Cpu;
    let head = ClientHead::load(&ck, DType::F32, &dev).unwrap();
    assert_eq!(head.embeddings_kind(), "mapped");
    let span = BlockSpan::load(&ck, 0, 1, DType::F32, &dev).unwrap();
    let ids = [1, 400, 9000, 31999];
    let mut cache = span.new_cache(8).unwrap();
    let hidden = span
        .forward(&head.embed(&ids).unwrap(), 0, &mut cache)
        .unwrap();
    let logits = head.last_logits(&hidden).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(logits.len(), 32000);
    let rms = (logits.iter().map(|x| x * x).sum::<f32>() / logits.len() as f32).sqrt();
    assert!(
        logits.iter().all(|x| x.is_finite()) && rms > 0.1 && rms < 100.0,
        "{rms}"
    );
    let tokens = generate_local(&head, &[span], &ids, 3, Default::default());
    assert_eq!(tokens.len(), 3);
}

/// Rows read from the page part's row file, as a page's range requests would.
struct FileRows {
    bytes: Vec<u8>,
    row_bytes: usize,
    asked: std::sync::Mutex<Vec<u32>>,
}

impl RowFetch for FileRows {
    fn fetch<'a>(&'a self, ids: &'a [u32]) -> RowsFuture<'a> {
        self.asked.lock().unwrap().extend_from_slice(ids);
        let rows = ids
            .iter()
            .map(|&id| self.bytes[id as usize * self.row_bytes..][..self.row_bytes].to_vec())
            .collect();
        Box::pin(async move { Ok(rows) })
    }
}

/// `shape` shrunk to a hidden size of 256 (4/2 heads of 64) and a
/// vocabulary of 700: what a test computes in milliseconds.
fn small(shape: ModelShape, layers: usize, quant: WeightQuant, seed: u64) -> RandomGguf {
    let mut spec = RandomGguf::new(shape, layers, quant, seed);
    spec.config.hidden_size = 256;
    spec.config.num_attention_heads = 4;
    spec.config.num_key_value_heads = 2;
    spec.config.head_dim = 64;
    spec.config.vocab_size = 700;
    spec
}

/// Experts kept quantized (each one's matrices cut out of the stacked
/// GGUF tensors) compute what the same experts dequantized compute, up
/// to the activations' rounding; rows batched over sessions whose tokens
/// pick different experts give the bits each gives alone.
#[test]
fn quantized_experts_compute_as_dequantized_and_batch_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = small(ModelShape::Qwen3_30bA3b, 2, WeightQuant::Q4_1, 9);
    // A small vocabulary needs Llama 2's tokenizer conventions.
    spec.vocabulary = ModelShape::Llama2_70b;
    if let Some(experts) = spec.config.experts.as_mut() {
        experts.count = 16;
        experts.per_token = 4;
        experts.intermediate_size = 128;
    }
    let path = write(&spec, dir.path());
    let dev = Device::Cpu;
    let open = |choice| {
        Checkpoint::open(&path)
            .unwrap()
            .with_quantized_weights(choice)
    };
    let (kept, dense) = (
        open(QuantizedWeights::Keep),
        open(QuantizedWeights::Dequantize),
    );
    let head = ClientHead::load(&dense, DType::F32, &dev).unwrap();
    let prompts: [&[u32]; 3] = [&[1, 17, 300, 42, 9], &[5, 600, 2, 77], &[123, 321, 213]];
    let span = |ck: &Checkpoint| BlockSpan::load(ck, 0, 2, DType::F32, &dev).unwrap();
    let (kept_span, dense_span) = (span(&kept), span(&dense));
    for prompt in prompts {
        let x = head.embed(prompt).unwrap();
        let run = |s: &BlockSpan| {
            let mut cache = s.new_cache(8).unwrap();
            s.forward(&x, 0, &mut cache).unwrap()
        };
        let err = corolla_tests::relative_l2(&run(&kept_span), &run(&dense_span));
        assert!(err < 0.05, "kept vs dequantized experts: {err}");
    }
    // Decode: each prompt's next position alone, then all three as one batch.
    let step = |batch: &[usize]| -> Vec<Vec<f32>> {
        let mut caches: Vec<_> = prompts
            .iter()
            .map(|p| {
                let mut cache = kept_span.new_cache(8).unwrap();
                kept_span
                    .forward(&head.embed(p).unwrap(), 0, &mut cache)
                    .unwrap();
                cache
            })
            .collect();
        let mut rows = Vec::new();
        for (i, cache) in caches.iter_mut().enumerate() {
            if batch.contains(&i) {
                let input = head.embed(&[7 + i as u32]).unwrap();
                rows.push((input, prompts[i].len(), cache));
            }
        }
        kept_span
            .forward_decode_batch(&mut rows)
            .unwrap()
            .iter()
            .map(|y| y.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    };
    let together = step(&[0, 1, 2]);
    for (i, batched) in together.iter().enumerate() {
        assert_eq!(&step(&[i])[0], batched, "session {i} alone vs batched");
    }
}

#[test]
fn the_page_parts_split_head_computes_what_the_whole_head_computes() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = small(ModelShape::Llama2_70b, 1, WeightQuant::Q4K, 3);
    spec.config.intermediate_size = 512;
    let path = write(&spec, dir.path());
    let ck = Checkpoint::open(&path)
        .unwrap()
        .with_quantized_weights(QuantizedWeights::Keep);
    let dev = Device::Cpu;
    let whole = ClientHead::load(&ck, DType::F32, &dev).unwrap();
    let out = dir.path().join("part");
    let part = write_page_part(&ck, &out).unwrap();
    let split = part.split.clone().expect("an untied Q4_K model is split");
    assert!(!part.files.contains(&PAGE_ROWS_FILE.to_string()));
    assert!(part.files.contains(&split.lm_head) && part.files.contains(&split.row_digests));
    let read = |name: &str| std::fs::read(out.join(name)).unwrap();
    let rows = read(&split.rows);
    let row_bytes = split.rows_format.row_bytes().unwrap();
    assert_eq!(rows.len(), row_bytes * 700);
    let digests = read(&split.row_digests);
    assert_eq!(
        &digests[5 * 32..6 * 32],
        &Sha256::digest(&rows[5 * row_bytes..][..row_bytes])[..]
    );

    // What a page holds: the client file and side files, the LM head in its own storage.
    let files: Vec<(String, Vec<u8>)> = part
        .files
        .iter()
        .filter(|n| **n != split.lm_head && **n != split.row_digests)
        .map(|n| (n.clone(), read(n)))
        .collect();
    let held = Checkpoint::from_memory(files)
        .unwrap()
        .with_quantized_weights(QuantizedWeights::Keep);
    assert!(!held.contains("model.embed_tokens.weight"));
    let mut lm_head = QuantizedBuffer::new(split.lm_head_dtype, &[700, 256], 1 << 30).unwrap();
    lm_head.bytes_mut().copy_from_slice(&read(&split.lm_head));
    let source = FileRows {
        bytes: rows,
        row_bytes,
        asked: Default::default(),
    };
    let asked = std::sync::Arc::new(source);
    struct Shared(std::sync::Arc<FileRows>);
    impl RowFetch for Shared {
        fn fetch<'a>(&'a self, ids: &'a [u32]) -> RowsFuture<'a> {
            self.0.fetch(ids)
        }
    }
    let format = RowFormat {
        dtype: split.rows_format.dtype,
        rows: 700,
        hidden: 256,
    };
    let page = ClientHead::load_split(
        &held,
        DType::F32,
        &dev,
        lm_head.into_qtensor().unwrap(),
        format,
        Box::new(Shared(asked.clone())),
    )
    .unwrap();
    assert_eq!(page.embeddings_kind(), "fetched");
    let ids = [1u32, 17, 17, 699, 300];
    assert!(
        page.embed(&ids).is_err(),
        "rows are not there before a fetch"
    );
    let span = BlockSpan::load(&ck, 0, 1, DType::F32, &dev).unwrap();
    let want = generate_local(
        &whole,
        std::slice::from_ref(&span),
        &ids,
        6,
        Default::default(),
    );
    let got = generate_local(
        &page,
        std::slice::from_ref(&span),
        &ids,
        6,
        Default::default(),
    );
    assert_eq!(got, want);
    let e_whole = whole.embed(&ids).unwrap();
    let e_page = page.embed(&ids).unwrap();
    let diff = (e_whole - e_page)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap();
    assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
    // Each distinct row was fetched once; later steps found them kept.
    let asked = asked.asked.lock().unwrap().clone();
    let mut distinct: HashMap<u32, usize> = HashMap::new();
    for id in &asked {
        *distinct.entry(*id).or_default() += 1;
    }
    assert!(distinct.values().all(|&n| n == 1), "{asked:?}");
    assert!(distinct.contains_key(&17) && distinct.contains_key(&699));
}

#[test]
fn qwen2_blocks_load_with_qkv_biases_and_rotate_halves() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = RandomGguf::new(ModelShape::Llama2_70b, 2, WeightQuant::Q8_0, 5);
    spec.config = corolla_model::LlamaConfig {
        family: Family::Qwen2,
        qkv_bias: true,
        hidden_size: 128,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        intermediate_size: 256,
        vocab_size: 500,
        rope_theta: 1e6,
        ..spec.config.clone()
    };
    let path = write(&spec, dir.path());
    let ck = Checkpoint::open(&path).unwrap();
    assert_eq!(ck.config().family, Family::Qwen2);
    assert_eq!(ck.rope_layout(), RopeLayout::Halves);
    let dev = Device::Cpu;
    let head = ClientHead::load(&ck, DType::F32, &dev).unwrap();
    let span = BlockSpan::load(&ck, 0, 2, DType::F32, &dev).unwrap();
    let tokens = generate_local(&head, &[span], &[3, 4, 5], 4, Default::default());
    assert_eq!(tokens.len(), 4);
}
