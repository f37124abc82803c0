//! Throughput of this server's span on its device, measured once at start-up.

use corolla_model::{BlockSpan, Result, Tensor};
use web_time::Instant;

pub struct Throughput {
    /// Decode tokens per second (one position per step).
    pub decode: f64,
    /// Prefill tokens per second.
    pub prefill: f64,
}

/// `step_delay` is a delay the server adds to every step; it is part of
/// what a client will see, so it is part of the figures.
pub fn measure(span: &BlockSpan, step_delay: std::time::Duration) -> Result<Throughput> {
    const PREFILL: usize = 32;
    const DECODE: usize = 8;
    let hidden = span.config().hidden_size;
    let mut cache = span.new_cache(PREFILL + DECODE)?;
    let prompt = Tensor::randn(0f32, 1.0, (1, PREFILL, hidden), span.device())?;
    let started = Instant::now();
    span.forward(&prompt, 0, &mut cache)?;
    let delay = step_delay.as_secs_f64();
    let prefill = PREFILL as f64 / (started.elapsed().as_secs_f64() + delay).max(1e-9);
    let step = Tensor::randn(0f32, 1.0, (1, 1, hidden), span.device())?;
    let started = Instant::now();
    for i in 0..DECODE {
        span.forward(&step, PREFILL + i, &mut cache)?;
    }
    let decode =
        DECODE as f64 / (started.elapsed().as_secs_f64() + delay * DECODE as f64).max(1e-9);
    Ok(Throughput { decode, prefill })
}
