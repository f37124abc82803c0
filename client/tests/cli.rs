//! The `corolla` binary end to end on the reference fixture.

use std::path::PathBuf;
use std::process::Command;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-llama-a")
}

fn corolla(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_corolla"))
        .args(args)
        .output()
        .expect("run corolla")
}

fn golden_prompts() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(fixture().join("golden/float32.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["prompts"].as_array().unwrap().clone()
}

fn generate_json(model: &std::path::Path, prompt: &str, extra: &[&str]) -> serde_json::Value {
    let model = model.to_str().unwrap();
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--local",
        "--prompt",
        prompt,
        "--max-new-tokens",
        "32",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = corolla(&args);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

#[test]
fn generate_json_prints_the_reference_ids() {
    for prompt in golden_prompts() {
        let json = generate_json(
            &fixture(),
            prompt["prompt"].as_str().unwrap(),
            &["--temperature", "0"],
        );
        assert_eq!(json["prompt_ids"], prompt["input_ids"]);
        assert_eq!(json["generated_ids"], prompt["generated_new_ids"]);
        assert!(json["tokens_per_second"].as_f64().unwrap() > 0.0);
        assert!(json["text"].is_string());
    }
}

#[test]
fn convert_then_generate_gives_the_same_ids_and_sampling_is_seeded() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("converted");
    let status = corolla(&[
        "convert",
        "--model",
        fixture().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--blocks-per-file",
        "2",
    ]);
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let prompt = &golden_prompts()[0];
    let text = prompt["prompt"].as_str().unwrap();
    assert_eq!(
        generate_json(&out, text, &[])["generated_ids"],
        prompt["generated_new_ids"]
    );

    let sampled = [
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
        "--repetition-penalty",
        "1.1",
        "--seed",
        "7",
    ];
    let a = generate_json(&fixture(), text, &sampled);
    assert_eq!(
        a["generated_ids"],
        generate_json(&out, text, &sampled)["generated_ids"]
    );
    assert_ne!(a["generated_ids"], prompt["generated_new_ids"]);
    let other_seed = [&sampled[..8], &["--seed", "8"]].concat();
    assert_ne!(
        a["generated_ids"],
        generate_json(&fixture(), text, &other_seed)["generated_ids"]
    );
}

#[test]
fn bad_input_gives_one_clear_error() {
    let out = corolla(&[
        "generate",
        "--model",
        "/nonexistent",
        "--local",
        "--prompt",
        "x",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));

    let model = fixture();
    let out = corolla(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--local",
        "--prompt",
        "x",
        "--top-p",
        "2",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("top-p"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = corolla(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--local",
        "--prompt",
        "x",
        "--max-new-tokens",
        "1000",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("exceeds the model's 256 positions"));
    // The largest number a user can type sizes nothing: one clear error, no panic.
    let out = corolla(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--local",
        "--prompt",
        "x",
        "--max-new-tokens",
        "18446744073709551615",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("exceeds the model's 256 positions"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    let out = corolla(&[
        "convert",
        "--model",
        model.to_str().unwrap(),
        "--out",
        model.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not empty"));
}
