//! The one retry pause every component uses when something outside the process (Kafka, the
//! lake's disk, a webhook receiver, a provisioner) fails: a doubling [`Backoff`] with a ceiling.
//!
//! It only says how long to wait; each caller keeps its own loop, because what ends the loop
//! differs (a number of attempts, a stop signal, a deadline) and so does how it waits (a Tokio
//! sleep, a thread sleep, a select on shutdown).

use std::time::Duration;

/// A doubling pause between tries: first, then twice as long each time, never over max.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Pauses starting at `first` and doubling up to `max`; `max` wins when it is the shorter.
    pub const fn new(first: Duration, max: Duration) -> Self {
        Self {
            first,
            max,
            next: first,
        }
    }

    /// Pauses starting at `first` and doubling without a ceiling: for a loop whose number of
    /// tries already bounds the wait.
    pub const fn doubling(first: Duration) -> Self {
        Self::new(first, Duration::MAX)
    }

    /// The pause before the next try (first, 2×first, 4×first, …, capped at max).
    pub fn next_pause(&mut self) -> Duration {
        let pause = self.next.min(self.max);
        self.next = pause.saturating_mul(2);
        pause
    }

    /// Back to `first` (after a success).
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn pauses(backoff: &mut Backoff, n: usize) -> Vec<Duration> {
        (0..n).map(|_| backoff.next_pause()).collect()
    }

    #[test]
    fn pauses_double_from_the_first() {
        let mut backoff = Backoff::new(ms(100), Duration::from_secs(60));
        assert_eq!(
            pauses(&mut backoff, 5),
            [ms(100), ms(200), ms(400), ms(800), ms(1_600)]
        );
    }

    #[test]
    fn pauses_stop_growing_at_the_ceiling() {
        let mut backoff = Backoff::new(ms(200), Duration::from_secs(5));
        assert_eq!(
            pauses(&mut backoff, 8),
            [
                ms(200),
                ms(400),
                ms(800),
                ms(1_600),
                ms(3_200),
                ms(5_000),
                ms(5_000),
                ms(5_000)
            ]
        );
    }

    #[test]
    fn a_ceiling_below_the_first_pause_wins() {
        let mut backoff = Backoff::new(ms(300), ms(100));
        assert_eq!(pauses(&mut backoff, 3), [ms(100); 3]);
    }

    #[test]
    fn reset_starts_over() {
        let mut backoff = Backoff::new(ms(200), Duration::from_secs(30));
        pauses(&mut backoff, 4);
        backoff.reset();
        assert_eq!(pauses(&mut backoff, 3), [ms(200), ms(400), ms(800)]);
    }

    #[test]
    fn many_tries_neither_overflow_nor_pass_the_ceiling() {
        let mut capped = Backoff::new(ms(100), Duration::from_secs(5));
        let mut uncapped = Backoff::doubling(ms(100));
        for _ in 0..10_000 {
            assert!(capped.next_pause() <= Duration::from_secs(5));
            uncapped.next_pause();
        }
        assert_eq!(capped.next_pause(), Duration::from_secs(5));
        assert_eq!(uncapped.next_pause(), Duration::MAX);
    }

    #[test]
    fn a_zero_first_pause_stays_zero() {
        let mut backoff = Backoff::new(Duration::ZERO, Duration::from_secs(1));
        assert_eq!(pauses(&mut backoff, 3), [Duration::ZERO; 3]);
    }
}
