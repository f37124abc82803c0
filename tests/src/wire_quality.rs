//! What the wire's formats do to a model's answers: the model is split in
//! three spans run in this process, and the hidden states between the
//! client and each span go through the wire format (dtype, compression)
//! and back, exactly as a server would send them. Measured against the same
//! spans with nothing in between: the logits' error under teacher forcing
//! (the reference's own continuation fed back, so every position counts)
//! and whether each prompt's greedy answer stays the same.

use std::path::Path;

use candle_core::{DType, Device, IndexOp, Tensor};
use corolla_client::assistant::ClientPart;
use corolla_model::wire::{from_view, to_payload};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, QuantizedWeights};
use corolla_shared::{Compression, WireDType};

/// One wire format: what a session's `dtype` and `compression` say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireFormat {
    pub dtype: WireDType,
    pub compression: Compression,
}

impl WireFormat {
    pub const F32: WireFormat = WireFormat {
        dtype: WireDType::F32,
        compression: Compression::None,
    };
    pub const F16: WireFormat = WireFormat {
        dtype: WireDType::F16,
        compression: Compression::None,
    };
    pub const INT8: WireFormat = WireFormat {
        dtype: WireDType::F16,
        compression: Compression::Int8Block64,
    };

    pub fn name(self) -> &'static str {
        match (self.dtype, self.compression) {
            (_, Compression::Int8Block64) => "int8 blocks of 64",
            (WireDType::F32, _) => "f32",
            (WireDType::F16, _) => "f16",
            (WireDType::BF16, _) => "bf16",
        }
    }

    /// `x` as the other end of a session in this format sees it.
    fn cross(self, x: &Tensor) -> anyhow::Result<Tensor> {
        let sent = to_payload(x, self.dtype)?.compressed(self.compression);
        let received = from_view(&sent.view(), x.device())?;
        Ok(received.to_dtype(x.dtype())?)
    }
}

/// The figures of one format over every prompt.
#[derive(Debug, Clone)]
pub struct WireQuality {
    pub format: WireFormat,
    pub prompts: usize,
    /// Positions compared under teacher forcing.
    pub positions: usize,
    /// Positions whose top token equals the reference's.
    pub top_token_agreement: f64,
    /// Largest and mean absolute logit difference, over the logits' own
    /// standard deviation at that position.
    pub max_logit_error: f64,
    pub mean_logit_error: f64,
    /// Prompts whose greedy answer is token for token the reference's.
    pub identical_answers: usize,
}

/// The model split in three spans, and its head.
pub struct SplitModel {
    spans: Vec<BlockSpan>,
    head: ClientHead,
    pub part: ClientPart,
}

impl SplitModel {
    pub fn open(model: &Path) -> anyhow::Result<Self> {
        Self::open_with(model, QuantizedWeights::Auto)
    }

    /// [`Self::open`] with quantized weights kept or dequantized as `weights` says.
    pub fn open_with(model: &Path, weights: QuantizedWeights) -> anyhow::Result<Self> {
        let checkpoint = Checkpoint::open(model)?.with_quantized_weights(weights);
        let layers = checkpoint.config().num_hidden_layers;
        let cuts = [0, layers / 3, 2 * layers / 3, layers];
        let spans = cuts
            .windows(2)
            .map(|w| BlockSpan::load(&checkpoint, w[0], w[1], DType::F32, &Device::Cpu))
            .collect::<Result<Vec<_>, _>>()?;
        let part = ClientPart::load(&checkpoint, DType::F32)?;
        let head = ClientHead::load(&checkpoint, DType::F32, &Device::Cpu)?;
        Ok(SplitModel { spans, head, part })
    }

    /// Logits `[T, vocab]` of `ids` in one pass, every hidden state crossing
    /// `wire` (none: `None`) between client and spans.
    fn logits(&self, ids: &[u32], wire: Option<WireFormat>) -> anyhow::Result<Tensor> {
        let mut x = self.head.embed(ids)?;
        for span in &self.spans {
            if let Some(wire) = wire {
                x = wire.cross(&x)?;
            }
            let mut cache = span.new_cache(ids.len())?;
            x = span.forward(&x, 0, &mut cache)?;
        }
        if let Some(wire) = wire {
            x = wire.cross(&x)?;
        }
        Ok(self.head.logits(&x)?.i(0)?.to_dtype(DType::F32)?)
    }

    /// `new_tokens` greedy tokens after `prompt` (a prefill, then one token
    /// per step with caches, as a client does).
    fn greedy(
        &self,
        prompt: &[u32],
        new_tokens: usize,
        wire: Option<WireFormat>,
    ) -> anyhow::Result<Vec<u32>> {
        let max = prompt.len() + new_tokens;
        let mut caches = self
            .spans
            .iter()
            .map(|s| s.new_cache(max))
            .collect::<Result<Vec<_>, _>>()?;
        let mut input = prompt.to_vec();
        let mut position = 0;
        let mut out = Vec::with_capacity(new_tokens);
        while out.len() < new_tokens {
            let mut x = self.head.embed(&input)?;
            for (span, cache) in self.spans.iter().zip(&mut caches) {
                if let Some(wire) = wire {
                    x = wire.cross(&x)?;
                }
                x = span.forward(&x, position, cache)?;
            }
            if let Some(wire) = wire {
                x = wire.cross(&x)?;
            }
            let logits = self.head.last_logits(&x)?.to_dtype(DType::F32)?;
            let token = logits.flatten_all()?.argmax(0)?.to_scalar::<u32>()?;
            position += input.len();
            out.push(token);
            input = vec![token];
        }
        Ok(out)
    }
}

/// Prompts of varied kinds: questions, instructions, code, lists, prose.
pub fn prompts(count: usize) -> Vec<String> {
    const SUBJECTS: [&str; 25] = [
        "the water cycle",
        "how a bicycle gear works",
        "the history of the printing press",
        "why the sky is blue",
        "a recipe for pancakes",
        "the rules of chess",
        "photosynthesis",
        "the French revolution",
        "how vaccines train the immune system",
        "binary search",
        "the life of honey bees",
        "plate tectonics",
        "how to write a good email",
        "the causes of inflation",
        "a sorting algorithm in Python",
        "the solar system's planets",
        "how a refrigerator keeps food cold",
        "the difference between weather and climate",
        "a short poem about autumn",
        "how the internet routes packets",
        "the Roman empire",
        "a healthy breakfast",
        "how compilers work",
        "the moon's phases",
        "saving money on groceries",
    ];
    const FORMS: [&str; 5] = [
        "Explain {} in simple terms.",
        "Write three short facts about {}.",
        "Question: what should a beginner know about {}? Answer:",
        "Here is a paragraph about {}:",
        "Summarize {} in one sentence.",
    ];
    (0..count)
        .map(|i| {
            let subject = SUBJECTS[i % SUBJECTS.len()];
            let form = FORMS[(i / SUBJECTS.len() + i) % FORMS.len()];
            form.replace("{}", subject)
        })
        .collect()
}

/// One prompt's reference logits (`[positions, vocab]`): what another
/// computation of the same positions is held to.
struct Reference {
    logits: Tensor,
    top: Vec<u32>,
    /// Each position's standard deviation of the logits.
    std: Tensor,
}

impl Reference {
    fn new(logits: Tensor) -> anyhow::Result<Self> {
        let top = logits.argmax(1)?.to_vec1::<u32>()?;
        let std = logits
            .broadcast_sub(&logits.mean_keepdim(1)?)?
            .sqr()?
            .mean_keepdim(1)?
            .sqrt()?;
        Ok(Reference { logits, top, std })
    }
}

/// A computation's figures as prompts are added.
struct Tally {
    figures: WireQuality,
    agreeing: usize,
    error_sum: f64,
}

impl Tally {
    fn new(format: WireFormat) -> Self {
        Tally {
            figures: WireQuality {
                format,
                prompts: 0,
                positions: 0,
                top_token_agreement: 0.0,
                max_logit_error: 0.0,
                mean_logit_error: 0.0,
                identical_answers: 0,
            },
            agreeing: 0,
            error_sum: 0.0,
        }
    }

    /// One prompt: `logits` of the reference's positions, and whether the
    /// greedy answer was the reference's.
    fn add(
        &mut self,
        reference: &Reference,
        logits: Tensor,
        same_answer: bool,
    ) -> anyhow::Result<()> {
        let top = logits.argmax(1)?.to_vec1::<u32>()?;
        self.agreeing += top
            .iter()
            .zip(&reference.top)
            .filter(|(a, b)| a == b)
            .count();
        let error = (logits - &reference.logits)?
            .abs()?
            .max_keepdim(1)?
            .broadcast_div(&reference.std)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let f = &mut self.figures;
        f.prompts += 1;
        f.positions += error.len();
        f.max_logit_error = error
            .iter()
            .fold(f.max_logit_error, |m, e| m.max(f64::from(*e)));
        self.error_sum += error.iter().map(|e| f64::from(*e)).sum::<f64>();
        f.identical_answers += usize::from(same_answer);
        Ok(())
    }

    fn finish(mut self) -> WireQuality {
        let positions = self.figures.positions.max(1) as f64;
        self.figures.top_token_agreement = self.agreeing as f64 / positions;
        self.figures.mean_logit_error = self.error_sum / positions;
        self.figures
    }
}

/// A prompt, its greedy answer on the reference model, and the positions
/// teacher forcing compares: the prompt and the answer but its last token
/// (`ids`), from the prompt's last position (`from`) on.
struct Forced {
    prompt: Vec<u32>,
    answer: Vec<u32>,
    ids: Vec<u32>,
    from: usize,
}

impl Forced {
    fn new(model: &SplitModel, text: &str, new_tokens: usize) -> anyhow::Result<Self> {
        let prompt = model.part.tokenizer.encode(text)?;
        let answer = model.greedy(&prompt, new_tokens, None)?;
        let mut ids = prompt.clone();
        ids.extend_from_slice(&answer[..new_tokens - 1]);
        let from = prompt.len() - 1;
        Ok(Forced {
            prompt,
            answer,
            ids,
            from,
        })
    }

    /// `model`'s logits of the compared positions, with hidden states
    /// crossing `wire`.
    fn logits(&self, model: &SplitModel, wire: Option<WireFormat>) -> anyhow::Result<Tensor> {
        Ok(model.logits(&self.ids, wire)?.i(self.from..)?)
    }

    /// Whether `model`'s greedy answer is the reference's.
    fn same_answer(&self, model: &SplitModel, wire: Option<WireFormat>) -> anyhow::Result<bool> {
        Ok(model.greedy(&self.prompt, self.answer.len(), wire)? == self.answer)
    }
}

/// Measures `formats` on `count` prompts with `new_tokens` greedy tokens each.
pub fn measure(
    model: &Path,
    count: usize,
    new_tokens: usize,
    formats: &[WireFormat],
) -> anyhow::Result<Vec<WireQuality>> {
    let split = SplitModel::open(model)?;
    let mut tallies: Vec<Tally> = formats.iter().map(|&f| Tally::new(f)).collect();
    for text in prompts(count) {
        let forced = Forced::new(&split, &text, new_tokens)?;
        let reference = Reference::new(forced.logits(&split, None)?)?;
        for (tally, &format) in tallies.iter_mut().zip(formats) {
            let logits = forced.logits(&split, Some(format))?;
            tally.add(
                &reference,
                logits,
                forced.same_answer(&split, Some(format))?,
            )?;
        }
    }
    Ok(tallies.into_iter().map(Tally::finish).collect())
}

/// The figures as a Markdown table.
pub fn table(figures: &[WireQuality], new_tokens: usize) -> String {
    let mut out = String::from(
        "| wire format | bytes per value | top token agreement (teacher-forced) | logit error max / mean (× the logits' std) | identical greedy answers |\n|---|---|---|---|---|\n",
    );
    for f in figures {
        let bytes = f.format.compression.data_len(f.format.dtype, 8192) as f64 / 8192.0;
        out.push_str(&format!(
            "| {} | {:.2} | {:.2} % of {} positions | {:.4} / {:.5} | {} of {} ({} tokens each) |\n",
            f.format.name(),
            bytes,
            100.0 * f.top_token_agreement,
            f.positions,
            f.max_logit_error,
            f.mean_logit_error,
            f.identical_answers,
            f.prompts,
            new_tokens,
        ));
    }
    out
}

pub const WIRE_QUALITY_HEADING: &str =
    "## Activations on the wire (`corolla-bench --wire-quality`)";

/// The BENCHMARKS.md section: f32, f16 and 8-bit blocks on `prompts` prompts.
pub fn wire_quality_section(
    model: &Path,
    prompts: usize,
    new_tokens: usize,
) -> anyhow::Result<String> {
    let formats = [WireFormat::F32, WireFormat::F16, WireFormat::INT8];
    let figures = measure(model, prompts, new_tokens, &formats)?;
    Ok(format!(
        "{WIRE_QUALITY_HEADING}\n\n\
         Command: `corolla-bench --wire-quality --prompts {prompts} --new-tokens {new_tokens} --write BENCHMARKS.md`.\n\n\
         The default model (SmolLM2-135M-Instruct, dequantized to f32) split in three spans in one \
         process; every hidden state between the client and a span crosses the wire format and back, \
         as sessions send them (`tests/src/wire_quality.rs`). Against the same spans with nothing in \
         between: the top token and the logits at every position of the reference's own greedy \
         continuation fed back (teacher forcing), and each prompt's {new_tokens}-token greedy answer. \
         {prompts} prompts of varied kinds (explanations, lists, questions, summaries).\n\n{}\n\
         So the wire carries the compute dtype by default (f32 here, f16 on GPU servers computing in \
         f16): this model's residual stream has outliers that f16 rounds coarsely enough to change \
         some answers, and a swarm's answer must be the local one. f16 (`--wire-dtype f16`) and 8-bit \
         blocks (`--wire-compression int8`) are options for links where bytes matter more.\n",
        table(&figures, new_tokens)
    ))
}

/// How far the model kept quantized (8-bit activations, as llama.cpp
/// computes) is from the same model dequantized to f32, on `count` prompts:
/// the same figures as the wire's, the kept-quantized model in the place of
/// a wire format.
pub fn measure_kept_quantized(
    model: &Path,
    count: usize,
    new_tokens: usize,
) -> anyhow::Result<WireQuality> {
    let float = SplitModel::open_with(model, QuantizedWeights::Dequantize)?;
    let kept = SplitModel::open_with(model, QuantizedWeights::Keep)?;
    let mut tally = Tally::new(WireFormat::F32);
    for text in prompts(count) {
        let forced = Forced::new(&float, &text, new_tokens)?;
        let reference = Reference::new(forced.logits(&float, None)?)?;
        tally.add(
            &reference,
            forced.logits(&kept, None)?,
            forced.same_answer(&kept, None)?,
        )?;
    }
    Ok(tally.finish())
}

pub const KEPT_QUANTIZED_HEADING: &str =
    "## Kept quantized against dequantized (`corolla-bench --quantization-quality`)";

/// The BENCHMARKS.md section: the default GGUF kept quantized against the
/// same weights dequantized to f32.
pub fn kept_quantized_section(
    model: &Path,
    prompts: usize,
    new_tokens: usize,
) -> anyhow::Result<String> {
    let f = measure_kept_quantized(model, prompts, new_tokens)?;
    Ok(format!(
        "{KEPT_QUANTIZED_HEADING}\n\n\
         Command: `corolla-bench --quantization-quality --prompts {prompts} --new-tokens {new_tokens} --write BENCHMARKS.md`.\n\n\
         The default model (SmolLM2-135M-Instruct Q4_1 GGUF) split in three spans in one process, its blocks and \
         tied LM head kept quantized (`--quantized keep`: each activation row rounded to 8 bits per block of 32, \
         as llama.cpp computes), against the same weights dequantized to f32 (`--quantized dequantize`, the float \
         model whose tokens match transformers'). The same measures as the wire's below, on the same {prompts} \
         prompts (`tests/src/wire_quality.rs`).\n\n\
         | compute | top token agreement (teacher-forced) | logit error max / mean (× the logits' std) | identical greedy answers |\n|---|---|---|---|\n\
         | kept quantized | {:.2} % of {} positions | {:.4} / {:.5} | {} of {} ({new_tokens} tokens each) |\n",
        100.0 * f.top_token_agreement,
        f.positions,
        f.max_logit_error,
        f.mean_logit_error,
        f.identical_answers,
        f.prompts,
    ))
}
