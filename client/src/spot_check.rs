//! Spot checks of servers' work: a sampled step of a hop is computed again
//! by an independent witness (another replica of the same blocks, or the
//! client itself where it holds the weights) and the outputs compared. On a
//! mismatch a third opinion decides who lied; see `RemoteChain`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use corolla_model::wire::{candle_dtype, from_view, to_payload};
use corolla_model::{BlockSpan, Checkpoint, DType, Device, SessionCache};
use corolla_shared::session::{RemoteSession, SessionError};
use corolla_shared::{Compression, TensorPayload, WireDType};

use crate::error::ClientError;
use crate::route::Hop;

/// Outputs of honest servers of one compute mode differ by less than this
/// (the largest difference relative to the output's RMS): rounding of the
/// wire dtype, and kernels that sum in another order on other hardware.
pub fn tolerance(dtype: WireDType) -> f64 {
    match dtype {
        WireDType::F32 => 1e-3,
        WireDType::F16 | WireDType::BF16 => 5e-2,
    }
}

/// Whether two outputs of the same step agree.
pub fn agree(a: &TensorPayload, b: &TensorPayload) -> bool {
    agree_within(a, b, tolerance(a.dtype))
}

/// The tolerance of outputs that crossed the wire in `compression`: 8-bit
/// blocks round each value by up to half a step of its block's largest
/// magnitude, which for activations with outliers is a sizeable share of
/// their RMS (a noise of a tenth of the RMS per value, what
/// `--corrupt-outputs` adds, still exceeds it).
pub fn tolerance_on_the_wire(dtype: WireDType, compression: Compression) -> f64 {
    match compression {
        Compression::None => tolerance(dtype),
        Compression::Int8Block64 => 0.25,
    }
}

/// Whether two outputs of the same step differ by at most `tolerance`.
pub fn agree_within(a: &TensorPayload, b: &TensorPayload, tolerance: f64) -> bool {
    a.max_difference_relative_to_rms(b)
        .is_some_and(|d| d <= tolerance)
}

/// Clean checks after which a server new to this client is checked half
/// as often as at first (every step); see [`Schedule::rate_for`].
const CLEAN_CHECKS_TO_HALVE: f64 = 8.0;

/// Which steps are checked: each with a probability, unpredictably for the
/// servers (a liar must not know which of its answers are looked at). The
/// probability is the base rate for a server this client has checked many
/// times, and higher for one it has not: peer ids are free, so a liar that
/// lies often would otherwise answer most steps of a new identity unseen.
#[derive(Debug, Clone)]
pub struct Schedule {
    rate: f64,
    state: u64,
}

impl Schedule {
    pub fn new(rate: f64) -> Self {
        let seed = web_time::SystemTime::now()
            .duration_since(web_time::UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.as_nanos() as u64);
        Schedule {
            rate: rate.clamp(0.0, 1.0),
            state: seed ^ (&seed as *const u64 as u64),
        }
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// The probability of checking a step of a server whose outputs this
    /// client found right `clean_checks` times: every step at first, then
    /// `1 / (1 + clean_checks / 8)`, never below the base rate (and none
    /// when checks are off). A server lying on a share `p` of its steps
    /// survives its first 13 steps unseen with probability about
    /// `(1 - p)^9` (a 4 % chance at `p` = 0.3), its first 40 with
    /// `(1 - p)^22`, where the base rate of 0.05 alone gives `(1 - p)^2`.
    pub fn rate_for(&self, clean_checks: u32) -> f64 {
        if self.rate <= 0.0 {
            return 0.0;
        }
        let early = 1.0 / (1.0 + f64::from(clean_checks) / CLEAN_CHECKS_TO_HALVE);
        self.rate.max(early)
    }

    /// Draws for one step of a server found right `clean_checks` times.
    pub fn check_now(&mut self, clean_checks: u32) -> bool {
        let rate = self.rate_for(clean_checks);
        if rate <= 0.0 {
            return false;
        }
        if rate >= 1.0 {
            return true;
        }
        // splitmix64
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((z >> 11) as f64 / (1u64 << 53) as f64) < rate
    }
}

/// The client's own copy of the blocks, when its checkpoint has them: the
/// opinion of last resort (an honest computation by definition).
#[derive(Clone)]
pub struct Referee {
    checkpoint: Arc<Checkpoint>,
    dtype: DType,
    device: Device,
    spans: Arc<Mutex<LoadedSpans>>,
}

/// Spans the referee loaded, by `(start, end)`.
type LoadedSpans = HashMap<(usize, usize), Arc<BlockSpan>>;

impl std::fmt::Debug for Referee {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Referee")
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

impl Referee {
    /// A referee computing with `checkpoint`'s blocks, when it has them all.
    pub fn new(checkpoint: Arc<Checkpoint>, dtype: DType, device: Device) -> Option<Self> {
        let layers = checkpoint.config().num_hidden_layers;
        checkpoint.has_layers(0, layers).then(|| Referee {
            checkpoint,
            dtype,
            device,
            spans: Arc::default(),
        })
    }

    fn span(&self, start: usize, end: usize) -> Result<Arc<BlockSpan>, ClientError> {
        let mut spans = self.spans.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(span) = spans.get(&(start, end)) {
            return Ok(span.clone());
        }
        let span = Arc::new(BlockSpan::load(
            &self.checkpoint,
            start,
            end,
            self.dtype,
            &self.device,
        )?);
        spans.insert((start, end), span.clone());
        Ok(span)
    }
}

/// An independent computation of one hop's blocks, fed the same inputs.
pub enum Witness {
    Servers(Vec<(Hop, RemoteSession)>),
    Local {
        span: Arc<BlockSpan>,
        cache: SessionCache,
    },
}

/// A witness's failure: a server's (ban it) or the client's own.
pub enum WitnessError {
    Server(SessionError),
    Local(ClientError),
}

impl Witness {
    pub fn local(
        referee: &Referee,
        hop: (usize, usize),
        max_length: usize,
    ) -> Result<Self, ClientError> {
        let span = referee.span(hop.0, hop.1)?;
        let cache = span.new_cache(max_length)?;
        Ok(Witness::Local { span, cache })
    }

    /// The peers this witness's answers come from (none for the client).
    pub fn peers(&self) -> Vec<String> {
        match self {
            Witness::Servers(sessions) => sessions.iter().map(|(h, _)| h.peer_id.clone()).collect(),
            Witness::Local { .. } => Vec::new(),
        }
    }

    pub async fn step(
        &mut self,
        start: u32,
        input: &TensorPayload,
    ) -> Result<TensorPayload, WitnessError> {
        match self {
            Witness::Servers(sessions) => {
                let mut x = input.clone();
                for (_, s) in sessions.iter_mut() {
                    x = s.step(start, &x).await.map_err(WitnessError::Server)?;
                }
                Ok(x)
            }
            Witness::Local { span, cache } => {
                let mut compute = || -> Result<TensorPayload, ClientError> {
                    let x = from_view(&input.view(), span.device())?;
                    let y = span.forward(&x, start as usize, cache)?;
                    let y = y
                        .to_dtype(candle_dtype(input.dtype))
                        .map_err(corolla_model::ModelError::from)?;
                    Ok(to_payload(&y, input.dtype)?)
                };
                compute().map_err(WitnessError::Local)
            }
        }
    }

    /// Feeds `history` (every input the hop was sent), returning the output of its last entry.
    pub async fn replay(
        &mut self,
        history: &[(u32, TensorPayload)],
    ) -> Result<Option<TensorPayload>, WitnessError> {
        let mut last = None;
        for (start, input) in history {
            last = Some(self.step(*start, input).await?);
        }
        Ok(last)
    }

    pub async fn close(self) {
        if let Witness::Servers(sessions) = self {
            for (_, s) in sessions {
                s.close().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clean checks after which a server is checked at the base rate.
    const SEASONED: u32 = 10_000;

    #[test]
    fn schedules_sample_at_their_rate() {
        let mut never = Schedule::new(0.0);
        let mut always = Schedule::new(1.0);
        assert!((0..100).all(|_| !never.check_now(0) && always.check_now(SEASONED)));
        let mut some = Schedule::new(0.25);
        let hits = (0..10_000).filter(|_| some.check_now(SEASONED)).count();
        assert!((2_000..3_000).contains(&hits), "{hits}");
    }

    #[test]
    fn servers_not_yet_checked_are_checked_more_often() {
        let schedule = Schedule::new(0.05);
        assert_eq!(schedule.rate_for(0), 1.0);
        assert_eq!(schedule.rate_for(8), 0.5);
        let rates: Vec<f64> = (0..400).map(|n| schedule.rate_for(n)).collect();
        assert!(rates.windows(2).all(|w| w[1] <= w[0]));
        assert_eq!(
            schedule.rate_for(SEASONED),
            0.05,
            "never below the base rate"
        );
        assert_eq!(Schedule::new(0.0).rate_for(0), 0.0, "checks off stay off");
        // A server lying on 30 % of its steps, checked as it earns clean
        // checks: found within its first 40 steps but for a small chance.
        let mut survives = 1.0;
        let mut clean = 0.0;
        for _ in 0..40 {
            let rate = schedule.rate_for(clean as u32);
            survives *= 1.0 - 0.3 * rate;
            clean += rate;
        }
        assert!(survives < 0.01, "{survives}");
    }

    #[test]
    fn outputs_agree_within_the_dtype_tolerance() {
        let f32s = |v: &[f32]| {
            TensorPayload::new(
                WireDType::F32,
                vec![1, 1, v.len()],
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
            .unwrap()
        };
        let a = f32s(&[1.0, -2.0, 3.0, 0.5]);
        assert!(agree(&a, &f32s(&[1.0, -2.0, 3.0, 0.5000001])));
        assert!(!agree(&a, &f32s(&[1.1, -2.0, 3.0, 0.5])));
        assert!(!agree(&a, &f32s(&[1.0, -2.0, 3.0])));
    }
}
