//! Event time. Every computation in gpuwarden runs on a [`Clock`] rather than on the wall clock,
//! so the demo and the tests can run a day of fleet time in minutes and land on the same numbers.
//!
//! What genuinely needs the wall clock (a signature's timestamp, the time a record arrived, the
//! age of a kept file, a fresh directory's name) reads it through [`wall_now_ms`],
//! [`wall_now_s`] or [`wall_now`], here and nowhere else.

use std::fmt::Debug;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of event time in Unix epoch milliseconds (UTC).
pub trait Clock: Debug + Send + Sync {
    /// The current event time.
    fn now_ms(&self) -> i64;

    /// How many event-time milliseconds pass per wall-clock millisecond (1 for real time).
    fn speed(&self) -> f64 {
        1.0
    }

    /// The event time this clock read (or will read) at `wall_ms` of the wall clock: for dating
    /// what carries a wall time, such as a Kafka message's timestamp. A clock that cannot say
    /// (a manual one) answers its current time.
    fn at_wall(&self, wall_ms: i64) -> i64 {
        let _ = wall_ms;
        self.now_ms()
    }

    /// The wall-clock time to wait for `event` of event time to pass. A manual clock never
    /// advances by itself, so waiting on it takes no wall time.
    fn wall_for(&self, event: Duration) -> Duration {
        let speed = self.speed();
        if speed <= 0.0 || !speed.is_finite() {
            Duration::ZERO
        } else {
            event.div_f64(speed)
        }
    }
}

/// The machine's wall clock as a [`SystemTime`], for what takes one (a file's modified time) or
/// needs finer than a millisecond (a unique name).
pub fn wall_now() -> SystemTime {
    SystemTime::now()
}

/// The machine's wall clock in Unix epoch milliseconds (UTC); 0 before 1970. Event time comes
/// from a [`Clock`]; this is for what must be dated in real time whatever the clock runs at.
pub fn wall_now_ms() -> i64 {
    let since = wall_now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

/// [`wall_now_ms`] in whole seconds, for what is dated to the second (a request signature's
/// timestamp, file times).
pub fn wall_now_s() -> u64 {
    u64::try_from(wall_now_ms() / 1000).unwrap_or(0)
}

/// `duration` in whole milliseconds, as event times count them; `i64::MAX` for longer than
/// that can hold.
pub fn duration_ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The latest time gpuwarden records, in Unix epoch milliseconds: the last millisecond of the
/// year 9999, the last one RFC 3339 (and so every log line, CLI table and SQL client) can write.
pub const LATEST_MS: i64 = 253_402_300_799_999;

/// `start_ms + duration`, in milliseconds, no later than [`LATEST_MS`]: the end of a lease or an
/// exemption however long it was asked to last.
pub fn end_after(start_ms: i64, duration: Duration) -> i64 {
    start_ms
        .saturating_add(duration_ms(duration))
        .min(LATEST_MS)
}

/// A duration as its two largest units: `400d 2h`, `3h 5m`, `2m 10s`, `45s`, `120ms`.
pub fn span(ms: i64) -> String {
    let ms = ms.max(0);
    let (d, h, m, s) = (
        ms / 86_400_000,
        ms / 3_600_000 % 24,
        ms / 60_000 % 60,
        ms / 1000 % 60,
    );
    match (d, h, m, s) {
        (0, 0, 0, 0) => format!("{ms}ms"),
        (0, 0, 0, s) => format!("{s}s"),
        (0, 0, m, 0) => format!("{m}m"),
        (0, 0, m, s) => format!("{m}m {s}s"),
        (0, h, 0, _) => format!("{h}h"),
        (0, h, m, _) => format!("{h}h {m}m"),
        (d, 0, _, _) => format!("{d}d"),
        (d, h, _, _) => format!("{d}d {h}h"),
    }
}

/// The machine's clock: event time is wall time.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        wall_now_ms()
    }

    fn at_wall(&self, wall_ms: i64) -> i64 {
        wall_ms
    }
}

/// Event time that runs `speed` times faster than wall time from a chosen start.
#[derive(Debug, Clone)]
pub struct AcceleratedClock {
    start_ms: i64,
    started: Instant,
    speed: f64,
}

impl AcceleratedClock {
    /// A clock that reads `start_ms` now and advances `speed` event milliseconds per wall
    /// millisecond. `speed` must be positive and finite.
    pub fn new(start_ms: i64, speed: f64) -> Self {
        assert!(
            speed.is_finite() && speed > 0.0,
            "clock speed must be positive, got {speed}"
        );
        Self {
            start_ms,
            started: Instant::now(),
            speed,
        }
    }

    /// A clock starting at the current wall time.
    pub fn from_now(speed: f64) -> Self {
        Self::new(wall_now_ms(), speed)
    }
}

impl Clock for AcceleratedClock {
    fn now_ms(&self) -> i64 {
        let elapsed_ms = self.started.elapsed().as_secs_f64() * 1000.0 * self.speed;
        self.start_ms.saturating_add(elapsed_ms as i64)
    }

    fn at_wall(&self, wall_ms: i64) -> i64 {
        // Relative to now, not to the wall time at the start, so that a step of the machine's
        // clock since the start moves no mapped time.
        let ago_ms = wall_now_ms().saturating_sub(wall_ms) as f64 * self.speed;
        self.now_ms().saturating_sub(ago_ms as i64)
    }

    fn speed(&self) -> f64 {
        self.speed
    }
}

/// Event time that moves only when told to: for tests that step through time exactly.
#[derive(Debug, Default)]
pub struct ManualClock {
    now_ms: AtomicI64,
}

impl ManualClock {
    /// A clock reading `now_ms`.
    pub fn new(now_ms: i64) -> Self {
        Self {
            now_ms: AtomicI64::new(now_ms),
        }
    }

    /// Sets the time. Moving backwards is allowed: tests of late data need it.
    pub fn set(&self, now_ms: i64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }

    /// Moves the time forward by `by`, returning the new time.
    pub fn advance(&self, by: Duration) -> i64 {
        let by = duration_ms(by);
        self.now_ms.fetch_add(by, Ordering::SeqCst) + by
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.now_ms.load(Ordering::SeqCst)
    }

    fn speed(&self) -> f64 {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_stop_at_the_last_time_rfc_3339_can_write() {
        assert_eq!(end_after(1_000, Duration::from_secs(2)), 3_000);
        assert_eq!(end_after(1_000, Duration::MAX), LATEST_MS);
        assert_eq!(end_after(LATEST_MS - 1, Duration::from_secs(1)), LATEST_MS);
        let latest = UNIX_EPOCH + Duration::from_millis(LATEST_MS as u64);
        assert_eq!(
            humantime::format_rfc3339_millis(latest).to_string(),
            "9999-12-31T23:59:59.999Z"
        );
    }

    #[test]
    fn spans_read_as_their_two_largest_units() {
        for (ms, text) in [
            (120, "120ms"),
            (45_000, "45s"),
            (2 * 60_000, "2m"),
            (2 * 60_000 + 10_000, "2m 10s"),
            (3 * 3_600_000 + 5 * 60_000 + 7, "3h 5m"),
            (400 * 86_400_000, "400d"),
            (400 * 86_400_000 + 2 * 3_600_000 + 60_000, "400d 2h"),
        ] {
            assert_eq!(span(ms), text);
        }
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::new(1_000);
        assert_eq!(clock.now_ms(), 1_000);
        assert_eq!(clock.advance(Duration::from_secs(2)), 3_000);
        clock.set(500);
        assert_eq!(clock.now_ms(), 500);
        assert_eq!(clock.wall_for(Duration::from_secs(60)), Duration::ZERO);
    }

    #[test]
    fn accelerated_clock_runs_faster_than_wall_time() {
        let clock = AcceleratedClock::new(0, 1_000.0);
        std::thread::sleep(Duration::from_millis(20));
        let now = clock.now_ms();
        // 20 ms of wall time at 1000x is at least 20 s of event time.
        assert!(now >= 20_000, "event time {now} ms after 20 ms at 1000x");
        assert_eq!(
            clock.wall_for(Duration::from_secs(60)),
            Duration::from_millis(60)
        );
        // A wall time maps onto the same event time: a second ago is 1000 s of event time ago.
        let (wall, event) = (wall_now_ms(), clock.now_ms());
        let mapped = clock.at_wall(wall - 1_000);
        assert!(
            (event - 1_000_000 - mapped).abs() < 100_000,
            "{mapped} for a second before {event}"
        );
    }

    #[test]
    fn system_clock_is_wall_time() {
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let before = i64::try_from(before.as_millis()).unwrap();
        let wall = wall_now_ms();
        let now = SystemClock.now_ms();
        assert!(
            wall >= before && wall - before < 5_000,
            "{wall} vs {before}"
        );
        assert!(now >= wall && now - wall < 5_000, "{now} vs {wall}");
        let seconds = i64::try_from(wall_now_s()).unwrap();
        assert!(
            seconds >= wall / 1000 && seconds - wall / 1000 < 5,
            "{seconds} vs {wall}"
        );
    }
}
