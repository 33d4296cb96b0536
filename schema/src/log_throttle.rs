//! Holding back repeated warnings: one line every ten seconds at most, saying how many like it
//! were held back. Shared by the pipeline's ingest and signals loops and the Kafka clients'
//! broker errors (`kafka::BrokerErrors`).

use std::time::{Duration, Instant};

/// How often a [`Throttle`] lets a line through.
pub const EVERY: Duration = Duration::from_secs(10);

/// Logs a warning at most every ten seconds, saying how many like it were held back.
#[derive(Debug, Default)]
pub struct Throttle {
    last: Option<Instant>,
    held: u64,
}

impl Throttle {
    /// Whether to log one more now; if so, also how many were held back since the last one.
    pub fn ready(&mut self) -> Option<u64> {
        self.ready_n(1)
    }

    /// [`Throttle::ready`] for `n` alike at once; the answer leaves them out.
    pub fn ready_n(&mut self, n: u64) -> Option<u64> {
        if self.last.is_some_and(|t| t.elapsed() < EVERY) {
            self.held += n;
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.held))
    }
}
