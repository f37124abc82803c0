//! LoRA adapters against transformers + PEFT (`tests/reference/adapters_reference.py`):
//! PEFT folders and GGUF adapters, over the transformers folder and the GGUF
//! file of the same base, split at every layer boundary, and sessions with
//! different adapters in one decode batch.

use corolla_model::{AdapterFile, BlockSpan, Checkpoint, ClientHead, DType, Device, Tensor};
use corolla_tests::{fixtures_dir, generate_local_with_adapter};
use serde_json::Value;

fn golden() -> Value {
    let path = fixtures_dir().join("adapters/golden.json");
    serde_json::from_slice(&std::fs::read(path).expect("golden.json")).expect("JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn base(family: &str, gguf: bool, ranges: &[(usize, usize)]) -> (ClientHead, Vec<BlockSpan>) {
    let name = match gguf {
        true => format!("{family}.gguf"),
        false => family.to_string(),
    };
    let ck = Checkpoint::open(fixtures_dir().join("families").join(name)).unwrap();
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let spans = ranges
        .iter()
        .map(|&(a, b)| BlockSpan::load(&ck, a, b, DType::F32, &Device::Cpu).unwrap())
        .collect();
    (head, spans)
}

fn adapter(file: &str) -> AdapterFile {
    AdapterFile::open(fixtures_dir().join("adapters").join(file)).unwrap()
}

/// Every adapter file over both forms of its base, in one span and in three:
/// PEFT's greedy tokens and last logits.
#[test]
fn adapters_generate_what_transformers_with_peft_generates() {
    let golden = golden();
    let cases = [
        ("llama3-alpha", "llama3-alpha"),
        ("llama3-alpha", "llama3-alpha.gguf"),
        ("llama3-beta", "llama3-beta"),
        ("qwen3-alpha", "qwen3-alpha"),
        ("qwen3-alpha", "qwen3-alpha.gguf"),
    ];
    for (name, file) in cases {
        let reference = &golden["adapters"][name];
        let family = reference["family"].as_str().unwrap();
        let adapter = adapter(file);
        for gguf_base in [false, true] {
            for ranges in [&[(0, 3)][..], &[(0, 1), (1, 2), (2, 3)]] {
                let (head, spans) = base(family, gguf_base, ranges);
                for run in reference["runs"].as_array().unwrap() {
                    let prompt = ids(&run["prompt_ids"]);
                    let want = ids(&run["generated_ids"]);
                    let case = format!(
                        "{file} over {family} (gguf {gguf_base}) {ranges:?}, prompt of {}",
                        prompt.len()
                    );
                    let got =
                        generate_local_with_adapter(&head, &spans, &adapter, &prompt, want.len());
                    assert_eq!(got, want, "{case}");
                    let mut hidden = head.embed(&prompt).unwrap();
                    for span in &spans {
                        let mut cache = span.new_cache(prompt.len()).unwrap();
                        cache.set_adapter(Some(span.adapter(&adapter).unwrap()));
                        hidden = span.forward(&hidden, 0, &mut cache).unwrap();
                    }
                    let logits = head.last_logits(&hidden).unwrap();
                    let expected: Vec<f32> = run["last_logits"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_f64().unwrap() as f32)
                        .collect();
                    let err = corolla_tests::relative_l2(
                        &logits,
                        &Tensor::new(expected, &Device::Cpu).unwrap(),
                    );
                    assert!(err < 1e-4, "{case}: logits relative error {err}");
                }
            }
        }
    }
}

/// Three sessions (two adapters and none) decoding in one batch over kept
/// Q8_0 weights (what a server runs) give each the bits it gets alone.
#[test]
fn sessions_with_different_adapters_batch_together() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-q8.gguf");
    // Tiny Llama's shape is Llama 3's fixture's, with a fourth layer.
    corolla_tests::write_tiny_gguf(&path, true, None);
    let ck = Checkpoint::open(&path).unwrap();
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let span = BlockSpan::load(&ck, 0, 4, DType::F32, &Device::Cpu).unwrap();
    let choices = [
        Some(span.adapter(&adapter("llama3-alpha")).unwrap()),
        None,
        Some(span.adapter(&adapter("llama3-beta")).unwrap()),
    ];
    let prompt = [1u32, 17, 200, 33, 901, 45];
    let steps = 6;
    let token = |step: usize| head.embed(&[(step * 37 + 5) as u32]).unwrap();
    let prefilled = |choice: &Option<corolla_model::SpanAdapter>| {
        let mut cache = span.new_cache(prompt.len() + steps).unwrap();
        cache.set_adapter(choice.clone());
        span.forward(&head.embed(&prompt).unwrap(), 0, &mut cache)
            .unwrap();
        cache
    };
    let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // Alone: one decode step at a time.
    let alone: Vec<Vec<Vec<f32>>> = choices
        .iter()
        .map(|choice| {
            let mut cache = prefilled(choice);
            (0..steps)
                .map(|step| {
                    let mut one = [(token(step), prompt.len() + step, &mut cache)];
                    values(&span.forward_decode_batch(&mut one).unwrap()[0])
                })
                .collect()
        })
        .collect();
    // Together.
    let mut caches: Vec<_> = choices.iter().map(prefilled).collect();
    let mut expected: Vec<_> = alone.iter().map(|steps| steps.iter()).collect();
    for step in 0..steps {
        let mut batch: Vec<_> = caches
            .iter_mut()
            .map(|cache| (token(step), prompt.len() + step, cache))
            .collect();
        let outs = span.forward_decode_batch(&mut batch).unwrap();
        for (session, out) in outs.iter().enumerate() {
            let want = expected[session].next().unwrap();
            assert_eq!(&values(out), want, "session {session} step {step}");
        }
    }
    // The adapters change the outputs (the test would pass vacuously otherwise).
    assert_ne!(alone[0][steps - 1], alone[1][steps - 1]);
    assert_ne!(alone[0][steps - 1], alone[2][steps - 1]);
}

/// Adapters that do not fit the base are refused with what is wrong.
#[test]
fn adapters_that_do_not_fit_are_refused() {
    let (_, spans) = base("qwen3", false, &[(0, 3)]);
    // Llama 3's adapter: its projections are [64, 64]; Qwen3's queries are 128 wide.
    let err = spans[0]
        .adapter(&adapter("llama3-alpha"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("do not fit"), "{err}");
    let (_, spans) = base("llama3", false, &[(0, 3)]);
    let err = spans[0]
        .adapter(&adapter("qwen3-alpha.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("qwen3 architecture"), "{err}");
    let (_, spans) = base("mixtral", false, &[(0, 3)]);
    let err = spans[0]
        .adapter(&adapter("llama3-alpha"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("mixture of experts"), "{err}");
    let err = AdapterFile::open(fixtures_dir().join("families/llama3.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a LoRA adapter"), "{err}");
    let err = AdapterFile::open(fixtures_dir().join("families/llama3"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("adapter_config.json"), "{err}");
}
