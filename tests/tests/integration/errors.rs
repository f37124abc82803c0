//! Clear errors for bad checkpoints and bad calls, and the checkpoint
//! layouts that must load identically.

use std::collections::HashMap;

use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, ModelError, Tensor};
use corolla_tests::{read_config, read_weights, relative_l2, tiny_llama, write_variant};

fn cpu() -> Device {
    Device::Cpu
}

#[test]
fn a_layer_range_outside_the_model_is_refused() {
    let ck = Checkpoint::open(tiny_llama()).unwrap();
    for (a, b) in [(3, 5), (2, 2), (4, 4), (3, 1)] {
        let err = BlockSpan::load(&ck, a, b, DType::F32, &cpu()).unwrap_err();
        assert!(
            matches!(err, ModelError::LayerRange { num_layers: 4, .. }),
            "{a}..{b}: {err}"
        );
        assert!(
            err.to_string().contains("outside the model's 4 layers"),
            "{err}"
        );
    }
}

#[test]
fn a_missing_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let mut weights = read_weights(&tiny_llama());
    weights.remove("model.layers.2.mlp.up_proj.weight");
    write_variant(
        &tiny_llama(),
        tmp.path(),
        read_config(&tiny_llama()),
        &weights,
    );
    let ck = Checkpoint::open(tmp.path()).unwrap();
    BlockSpan::load(&ck, 0, 2, DType::F32, &cpu()).unwrap();
    let err = BlockSpan::load(&ck, 1, 3, DType::F32, &cpu()).unwrap_err();
    assert!(
        matches!(&err, ModelError::MissingTensor { name } if name == "model.layers.2.mlp.up_proj.weight"),
        "{err}"
    );
}

#[test]
fn a_wrong_shape_is_reported_with_both_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = read_config(&tiny_llama());
    config["intermediate_size"] = 200.into();
    write_variant(
        &tiny_llama(),
        tmp.path(),
        config,
        &read_weights(&tiny_llama()),
    );
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let err = BlockSpan::load(&ck, 0, 1, DType::F32, &cpu()).unwrap_err();
    match err {
        ModelError::WrongShape {
            name,
            expected,
            actual,
        } => {
            assert_eq!(name, "model.layers.0.mlp.gate_proj.weight");
            assert_eq!(expected, vec![200, 64]);
            assert_eq!(actual, vec![176, 64]);
        }
        other => panic!("unexpected error {other}"),
    }
}

#[test]
fn an_unsupported_architecture_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = read_config(&tiny_llama());
    config["architectures"] = serde_json::json!(["GemmaForCausalLM"]);
    write_variant(
        &tiny_llama(),
        tmp.path(),
        config.clone(),
        &read_weights(&tiny_llama()),
    );
    let err = Checkpoint::open(tmp.path()).unwrap_err();
    assert!(
        matches!(&err, ModelError::UnsupportedArchitecture(a) if a == "GemmaForCausalLM"),
        "{err}"
    );
    // A mixture-of-experts family whose config names no experts.
    config["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
    let tmp = tempfile::tempdir().unwrap();
    write_variant(
        &tiny_llama(),
        tmp.path(),
        config,
        &read_weights(&tiny_llama()),
    );
    let err = Checkpoint::open(tmp.path()).unwrap_err().to_string();
    assert!(err.contains("without experts (num_local_experts)"), "{err}");
}

#[test]
fn a_folder_without_weights_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        tiny_llama().join("config.json"),
        tmp.path().join("config.json"),
    )
    .unwrap();
    assert!(matches!(
        Checkpoint::open(tmp.path()),
        Err(ModelError::NoWeights(_))
    ));
}

#[test]
fn sharded_checkpoints_load_and_compute_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let weights = read_weights(&tiny_llama());
    let (mut first, mut second): (HashMap<String, Tensor>, HashMap<String, Tensor>) =
        Default::default();
    let mut weight_map = serde_json::Map::new();
    for (name, t) in weights {
        let in_first = name.starts_with("model.layers.0.")
            || name.starts_with("model.layers.1.")
            || name.starts_with("model.embed");
        let file = if in_first {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        weight_map.insert(name.clone(), file.into());
        if in_first {
            first.insert(name, t)
        } else {
            second.insert(name, t)
        };
    }
    candle_core::safetensors::save(&first, dir.join("model-00001-of-00002.safetensors")).unwrap();
    candle_core::safetensors::save(&second, dir.join("model-00002-of-00002.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(tiny_llama().join(f), dir.join(f)).unwrap();
    }

    let logits = |dir: &std::path::Path| {
        let ck = Checkpoint::open(dir).unwrap();
        let head = ClientHead::load(&ck, DType::F32, &cpu()).unwrap();
        let span = BlockSpan::load(&ck, 0, 4, DType::F32, &cpu()).unwrap();
        let mut cache = span.new_cache(8).unwrap();
        let x = span
            .forward(&head.embed(&[1, 5, 9, 200]).unwrap(), 0, &mut cache)
            .unwrap();
        head.logits(&x).unwrap()
    };
    assert_eq!(relative_l2(&logits(dir), &logits(&tiny_llama())), 0.0);

    // A server of layers [0, 2) needs only the first shard.
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    BlockSpan::load(&ck, 0, 2, DType::F32, &cpu()).unwrap();
    let err = BlockSpan::load(&ck, 2, 4, DType::F32, &cpu()).unwrap_err();
    assert!(
        err.to_string().contains("model-00002-of-00002.safetensors"),
        "{err}"
    );
}

fn span_and_head() -> (ClientHead, BlockSpan) {
    let ck = Checkpoint::open(tiny_llama()).unwrap();
    (
        ClientHead::load(&ck, DType::F32, &cpu()).unwrap(),
        BlockSpan::load(&ck, 0, 4, DType::F32, &cpu()).unwrap(),
    )
}

#[test]
fn decoding_one_position_at_a_time_equals_prefill() {
    let (head, span) = span_and_head();
    let ids = [1u32, 711, 899, 519, 554, 652];
    let mut cache = span.new_cache(ids.len()).unwrap();
    let prefill = span
        .forward(&head.embed(&ids).unwrap(), 0, &mut cache)
        .unwrap();
    let mut cache = span.new_cache(ids.len()).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        let step = span
            .forward(&head.embed(&[id]).unwrap(), i, &mut cache)
            .unwrap();
        let err = relative_l2(&step, &prefill.narrow(1, i, 1).unwrap());
        assert!(err < 1e-5, "position {i}: {err:e}");
    }
    assert_eq!(cache.len(), ids.len());
}

#[test]
fn rewinding_the_cache_recomputes_the_same_outputs() {
    let (head, span) = span_and_head();
    let mut cache = span.new_cache(16).unwrap();
    let first = span
        .forward(&head.embed(&[1, 2, 3, 4, 5]).unwrap(), 0, &mut cache)
        .unwrap();
    // Overwrite positions 3.. with other tokens, then rewind and redo them.
    span.forward(&head.embed(&[9, 9, 9]).unwrap(), 3, &mut cache)
        .unwrap();
    let again = span
        .forward(&head.embed(&[4, 5]).unwrap(), 3, &mut cache)
        .unwrap();
    assert!(relative_l2(&again, &first.narrow(1, 3, 2).unwrap()) < 1e-5);
    assert_eq!(cache.len(), 5);
}

#[test]
fn bad_positions_and_shapes_are_errors() {
    let (head, span) = span_and_head();
    let mut cache = span.new_cache(4).unwrap();
    let x = head.embed(&[1, 2, 3]).unwrap();
    assert!(matches!(
        span.forward(&x, 1, &mut cache),
        Err(ModelError::PositionGap {
            start: 1,
            cached: 0
        })
    ));
    span.forward(&x, 0, &mut cache).unwrap();
    assert!(matches!(
        span.forward(&x, 3, &mut cache),
        Err(ModelError::CacheFull {
            end: 6,
            capacity: 4
        })
    ));
    let wrong = Tensor::zeros((1, 2, 63), DType::F32, &cpu()).unwrap();
    assert!(matches!(
        span.forward(&wrong, 0, &mut cache),
        Err(ModelError::HiddenShape { .. })
    ));
    assert!(matches!(
        span.new_cache(257),
        Err(ModelError::MaxLengthTooLarge { max: 256, .. })
    ));
    assert!(matches!(
        head.embed(&[1024]),
        Err(ModelError::TokenOutOfRange {
            id: 1024,
            vocab: 1024
        })
    ));
}

#[test]
fn every_dtype_runs_on_cpu_and_stays_close() {
    let ck = Checkpoint::open(tiny_llama()).unwrap();
    let reference = {
        let (head, span) = span_and_head();
        let mut cache = span.new_cache(4).unwrap();
        head.logits(
            &span
                .forward(&head.embed(&[1, 7, 8, 9]).unwrap(), 0, &mut cache)
                .unwrap(),
        )
        .unwrap()
    };
    for (dtype, tolerance) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
        let head = ClientHead::load(&ck, dtype, &cpu()).unwrap();
        let span = BlockSpan::load(&ck, 0, 4, dtype, &cpu()).unwrap();
        let mut cache = span.new_cache(4).unwrap();
        let x = span
            .forward(&head.embed(&[1, 7, 8, 9]).unwrap(), 0, &mut cache)
            .unwrap();
        assert_eq!(x.dtype(), dtype);
        let err = relative_l2(&head.logits(&x).unwrap(), &reference);
        assert!(err < tolerance, "{dtype:?}: {err:e}");
    }
}
