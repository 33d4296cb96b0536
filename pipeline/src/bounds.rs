//! Event time against arrival (docs/src/contributors/delivery.md#event-time): the bounds a record's time
//! must keep to be trusted, the watermark the fleet as a whole moves, and each host's clock skew
//! as measured.
//!
//! - A record's *arrival* is when it reached gpuwarden: the Kafka message's timestamp mapped onto
//!   the pipeline's clock, but never later than that clock's now (a producer whose clock runs
//!   ahead stamps its messages ahead too), or the time `gpuwarden ingest` read it.
//! - [`Bounds`]: a record whose `ts_ms` is more than `pipeline.clock.max_skew` ahead of its
//!   arrival is refused, and so is a sample on Kafka more than `pipeline.clock.max_age` behind
//!   it. Refused records are quarantined by ingest and skipped by the signals loop; neither
//!   moves a watermark.
//! - [`FleetWatermark`]: the event time the fleet has reached is the earliest latest-sample time
//!   among the hosts that are not idle, a host being idle once it is more than
//!   `pipeline.clock.idle_timeout` behind the median host, or once nothing of it arrived for
//!   that long (where arrivals are known). One host far ahead moves neither the median nor the
//!   minimum; a silent host holds the watermark back for `idle_timeout` at most.
//! - [`HostSkews`]: each host's latest skew (event time minus arrival), for `/metrics`.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, UNIX_EPOCH};

use gpuwarden_schema::clock::{duration_ms as ms, span};
use gpuwarden_schema::config::ClockBounds;
use gpuwarden_schema::{Clock, LATEST_MS};

/// When a record arrived, in the event time of `clock`: the message's wall-clock timestamp
/// (`None` for a record read from a file) mapped onto the clock, and no later than its now.
pub fn arrival_ms(clock: &dyn Clock, message_wall_ms: Option<i64>) -> i64 {
    let now = clock.now_ms();
    message_wall_ms.map_or(now, |wall| clock.at_wall(wall).min(now))
}

/// When a Kafka message arrived: [`arrival_ms`] of its producer's timestamp (`CreateTime`), or,
/// on a topic whose broker stamps messages itself (`LogAppendTime`), the broker's time as it is,
/// so that neither a producer's clock nor the pipeline's decides.
pub fn arrival_of_message(clock: &dyn Clock, timestamp: rdkafka::Timestamp) -> i64 {
    match timestamp {
        rdkafka::Timestamp::LogAppendTime(broker_ms) => clock.at_wall(broker_ms),
        other => arrival_ms(clock, other.to_millis()),
    }
}

/// How far a record's time may stray from its arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Largest `ts_ms − arrival` accepted, ms.
    pub max_ahead_ms: i64,
    /// Largest `arrival − ts_ms` accepted for a sample, ms; `None` accepts any age.
    pub max_age_ms: Option<i64>,
}

impl Bounds {
    /// The streaming pipeline's bounds: `max_skew` ahead, `max_age` behind.
    pub fn streaming(config: &ClockBounds) -> Self {
        Self {
            max_ahead_ms: ms(config.max_skew),
            max_age_ms: Some(ms(config.max_age)),
        }
    }

    /// `gpuwarden ingest`'s bounds: history of any age, nothing from the future.
    pub fn backfill(config: &ClockBounds) -> Self {
        Self {
            max_ahead_ms: ms(config.max_skew),
            max_age_ms: None,
        }
    }

    /// Bounds nothing fails: for tests of what the bounds are not about.
    pub fn none() -> Self {
        Self {
            max_ahead_ms: i64::MAX,
            max_age_ms: None,
        }
    }

    /// Whether a record dated `ts_ms` that arrived at `arrival_ms` is within the bounds. The age
    /// bound applies to samples only (`age_applies`): lease events and actions are the
    /// enforcer's record of what happened and are kept however late they come.
    pub fn check(&self, ts_ms: i64, arrival_ms: i64, age_applies: bool) -> Result<(), OutOfBounds> {
        if ts_ms < 0 {
            return Err(OutOfBounds {
                ts_ms,
                arrival_ms,
                limit_ms: 0,
                direction: Direction::BeforeEpoch,
            });
        }
        let skew = ts_ms.saturating_sub(arrival_ms);
        if skew > self.max_ahead_ms {
            return Err(OutOfBounds {
                ts_ms,
                arrival_ms,
                limit_ms: self.max_ahead_ms,
                direction: Direction::Ahead,
            });
        }
        match self.max_age_ms {
            Some(max_age) if age_applies && skew.saturating_neg() > max_age => Err(OutOfBounds {
                ts_ms,
                arrival_ms,
                limit_ms: max_age,
                direction: Direction::Behind,
            }),
            _ => Ok(()),
        }
    }
}

/// Which bound a record broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    /// Its time is too far ahead of its arrival (`max_skew`).
    Ahead,
    /// Its time is too far behind its arrival (`max_age`).
    Behind,
    /// Its time is before 1970, however old history may be.
    BeforeEpoch,
}

impl Direction {
    /// `ahead` or `behind`, as in `/metrics`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ahead => "ahead",
            Self::Behind | Self::BeforeEpoch => "behind",
        }
    }
}

/// A record whose time is out of bounds: its reason names the field, the distance and the
/// setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfBounds {
    /// The record's `ts_ms`.
    pub ts_ms: i64,
    /// When it arrived.
    pub arrival_ms: i64,
    /// The bound it broke, ms.
    pub limit_ms: i64,
    /// Which one.
    pub direction: Direction,
}

impl OutOfBounds {
    /// `ts_ms − arrival`: how far ahead (positive) or behind the record's clock ran.
    pub fn skew_ms(&self) -> i64 {
        self.ts_ms.saturating_sub(self.arrival_ms)
    }
}

impl fmt::Display for OutOfBounds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (distance, ts, arrival) = (
            span(self.skew_ms().saturating_abs()),
            instant(self.ts_ms),
            instant(self.arrival_ms),
        );
        let limit = span(self.limit_ms);
        match self.direction {
            Direction::Ahead => write!(
                f,
                "{ts} is {distance} ahead of the record's arrival at {arrival}, more than \
                 pipeline.clock.max_skew ({limit}) allows: the clock that dated it is wrong"
            ),
            Direction::Behind => write!(
                f,
                "{ts} is {distance} behind the record's arrival at {arrival}, more than \
                 pipeline.clock.max_age ({limit}) allows on Kafka: load history with \
                 `gpuwarden ingest` instead"
            ),
            Direction::BeforeEpoch => write!(
                f,
                "{ts} is before 1970, earlier than any GPU was measured: the clock that dated \
                 it is wrong"
            ),
        }
    }
}

/// A time as RFC 3339 to the second; one RFC 3339 cannot write (before 1970, after 9999) as its
/// milliseconds.
pub fn instant(ts_ms: i64) -> String {
    match u64::try_from(ts_ms) {
        Ok(ms) if ts_ms <= LATEST_MS => {
            humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
        }
        _ => format!("{ts_ms} ms since 1970"),
    }
}

/// The event time the fleet as a whole has reached (see the module documentation).
#[derive(Debug, Clone, Default)]
pub struct FleetWatermark {
    /// Each host's latest sample time, and when its latest record arrived (when known).
    hosts: HashMap<Box<str>, (i64, Option<i64>)>,
    idle_ms: i64,
    /// How long a host may go without an arrival before it is idle (`idle_ms` unless told).
    silence_ms: i64,
}

impl FleetWatermark {
    /// An empty watermark whose hosts go idle `idle_ms` behind the median host, or `idle_ms`
    /// after their last record arrived.
    pub fn new(idle_ms: i64) -> Self {
        Self {
            hosts: HashMap::new(),
            idle_ms: idle_ms.max(0),
            silence_ms: idle_ms.max(0),
        }
    }

    /// The same, with hosts idle only after `silence_ms` without an arrival: for arrivals known
    /// only as coarsely as a rollup's runs.
    pub fn with_silence(mut self, silence_ms: i64) -> Self {
        self.silence_ms = silence_ms.max(0);
        self
    }

    /// `host` reported a sample dated `ts_ms`, which arrived at `arrival_ms` when known.
    pub fn observe(&mut self, host: &str, ts_ms: i64, arrival_ms: Option<i64>) {
        match self.hosts.get_mut(host) {
            Some((latest, arrived)) => {
                *latest = (*latest).max(ts_ms);
                *arrived = (*arrived).max(arrival_ms);
            }
            None => {
                self.hosts.insert(host.into(), (ts_ms, arrival_ms));
            }
        }
    }

    /// The watermark: among the hosts heard from within the idle timeout of the latest arrival
    /// (every host, where arrivals are not known), the earliest latest time of those no more
    /// than the idle timeout behind the median host. The upper median: of two hosts, a silent
    /// one does not hold the watermark forever. `None` before any sample.
    pub fn watermark(&self) -> Option<i64> {
        let newest_arrival = self.hosts.values().filter_map(|(_, a)| *a).max();
        let heard = |arrived: &Option<i64>| match (arrived, newest_arrival) {
            (Some(arrived), Some(newest)) => *arrived >= newest.saturating_sub(self.silence_ms),
            _ => true,
        };
        let mut times: Vec<i64> = self
            .hosts
            .values()
            .filter(|(_, arrived)| heard(arrived))
            .map(|(latest, _)| *latest)
            .collect();
        if times.is_empty() {
            return None;
        }
        let middle = times.len() / 2;
        let (_, median, _) = times.select_nth_unstable(middle);
        let floor = median.saturating_sub(self.idle_ms);
        times.into_iter().filter(|t| *t >= floor).min()
    }

    /// Forgets hosts no record of which arrived since `before_ms`.
    pub fn forget_arrived_before(&mut self, before_ms: i64) {
        self.hosts
            .retain(|_, (_, arrived)| arrived.is_none_or(|a| a >= before_ms));
    }

    /// Hosts known.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether no host is known.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }
}

/// Each host's clock as last measured: the skew (`ts_ms − arrival`) of its latest sample, and
/// when it arrived.
#[derive(Debug, Clone, Default)]
pub struct HostSkews {
    hosts: HashMap<Box<str>, (i64, i64)>,
}

impl HostSkews {
    /// A sample of `host` dated `ts_ms` arrived at `arrival_ms`.
    pub fn observe(&mut self, host: &str, ts_ms: i64, arrival_ms: i64) {
        let entry = (ts_ms.saturating_sub(arrival_ms), arrival_ms);
        match self.hosts.get_mut(host) {
            Some(last) if last.1 <= arrival_ms => *last = entry,
            Some(_) => {}
            None => {
                self.hosts.insert(host.into(), entry);
            }
        }
    }

    /// Forgets hosts whose latest sample arrived before `before_ms`.
    pub fn forget_before(&mut self, before_ms: i64) {
        self.hosts.retain(|_, (_, arrival)| *arrival >= before_ms);
    }

    /// Each host's latest skew, ms, by host name.
    pub fn skews(&self) -> Vec<(String, i64)> {
        let mut out: Vec<(String, i64)> = self
            .hosts
            .iter()
            .map(|(host, (skew, _))| (host.to_string(), *skew))
            .collect();
        out.sort_unstable();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuwarden_schema::{ManualClock, SystemClock};

    const MIN: i64 = 60_000;
    const DAY: i64 = 86_400_000;

    fn bounds() -> Bounds {
        Bounds::streaming(&ClockBounds::default())
    }

    #[test]
    fn a_record_ahead_of_its_arrival_by_more_than_the_skew_is_refused_and_says_why() {
        let arrival = 1_796_400_000_000; // 2026-12-04T16:00:00Z
        assert_eq!(bounds().check(arrival + 2 * MIN, arrival, true), Ok(()));
        assert_eq!(bounds().check(arrival + 5 * MIN, arrival, true), Ok(()));
        let err = bounds()
            .check(arrival + 400 * DAY, arrival, true)
            .unwrap_err();
        assert_eq!(err.direction, Direction::Ahead);
        assert_eq!(err.skew_ms(), 400 * DAY);
        assert_eq!(
            err.to_string(),
            "2028-01-08T16:00:00Z is 400d ahead of the record's arrival at 2026-12-04T16:00:00Z, \
             more than pipeline.clock.max_skew (5m) allows: the clock that dated it is wrong"
        );
        // Ahead is refused for every table; a lease event is not a sample, but no less wrong.
        assert!(bounds().check(arrival + 6 * MIN, arrival, false).is_err());
    }

    #[test]
    fn any_time_reads_in_a_reason() {
        assert_eq!(instant(0), "1970-01-01T00:00:00Z");
        assert_eq!(instant(LATEST_MS), "9999-12-31T23:59:59Z");
        assert_eq!(instant(i64::MAX), "9223372036854775807 ms since 1970");
        assert_eq!(instant(-1), "-1 ms since 1970");
        let err = bounds().check(i64::MAX, 0, true).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("9223372036854775807 ms since 1970 is 106751991167d 7h ahead"),
            "{err}"
        );
        let err = Bounds::backfill(&ClockBounds::default())
            .check(i64::MIN, 0, true)
            .unwrap_err();
        assert_eq!(err.direction, Direction::BeforeEpoch);
        assert_eq!(
            err.to_string(),
            "-9223372036854775808 ms since 1970 is before 1970, earlier than any GPU was \
             measured: the clock that dated it is wrong"
        );
    }

    #[test]
    fn only_samples_on_kafka_are_refused_for_age() {
        let arrival = 1_796_400_000_000;
        let old = arrival - 3 * DAY - 5 * 3_600_000;
        let err = bounds().check(old, arrival, true).unwrap_err();
        assert_eq!(err.direction, Direction::Behind);
        assert!(
            err.to_string().starts_with(
                "2026-12-01T11:00:00Z is 3d 5h behind the record's arrival at 2026-12-04T16:00:00Z, \
                 more than pipeline.clock.max_age (1d) allows on Kafka"
            ),
            "{err}"
        );
        assert_eq!(bounds().check(old, arrival, false), Ok(()));
        let backfill = Bounds::backfill(&ClockBounds::default());
        assert_eq!(backfill.check(old, arrival, true), Ok(()));
        assert!(backfill.check(arrival + DAY, arrival, true).is_err());
    }

    #[test]
    fn arrival_is_the_message_time_but_never_later_than_now() {
        let clock = ManualClock::new(10 * MIN);
        // A manual clock cannot map wall times: its now is the arrival.
        assert_eq!(arrival_ms(&clock, Some(5)), 10 * MIN);
        let now = SystemClock.now_ms();
        // A producer whose clock is a year ahead stamps its messages a year ahead.
        let ahead = arrival_ms(&SystemClock, Some(now + 365 * DAY));
        assert!((ahead - now).abs() < MIN, "{ahead} vs {now}");
        // A message that waited in Kafka arrived when it was produced.
        assert_eq!(arrival_ms(&SystemClock, Some(now - DAY)), now - DAY);
        assert!(arrival_ms(&SystemClock, None) >= now);
        // A broker's own stamp is taken as it is, even ahead of this machine's clock.
        let stamped = rdkafka::Timestamp::LogAppendTime(now + 10 * MIN);
        assert_eq!(arrival_of_message(&SystemClock, stamped), now + 10 * MIN);
        let created = rdkafka::Timestamp::CreateTime(now + 10 * MIN);
        assert!(arrival_of_message(&SystemClock, created) < now + MIN);
    }

    fn fleet(hosts: &[(&str, i64)]) -> FleetWatermark {
        let mut w = FleetWatermark::new(5 * MIN);
        for (host, ts) in hosts {
            w.observe(host, *ts, None);
        }
        w
    }

    #[test]
    fn one_host_ahead_does_not_drag_the_watermark() {
        let t = 1_796_400_000_000;
        let hosts = [("a", t), ("b", t + 1_000), ("c", t - 2_000), ("d", t + 500)];
        assert_eq!(fleet(&hosts).watermark(), Some(t - 2_000));
        let mut with_wrong_clock = fleet(&hosts);
        with_wrong_clock.observe("e", t + 400 * DAY, None);
        assert_eq!(with_wrong_clock.watermark(), Some(t - 2_000));
        // Within the skew too: a host two minutes ahead is one more host, not the fleet's time.
        let mut two_minutes = fleet(&hosts);
        two_minutes.observe("e", t + 2 * MIN, None);
        assert_eq!(two_minutes.watermark(), Some(t - 2_000));
    }

    #[test]
    fn a_silent_host_holds_the_watermark_for_the_idle_timeout_at_most() {
        let t = 1_796_400_000_000;
        let mut w = fleet(&[("a", t), ("b", t), ("quiet", t)]);
        for step in 1..=10 {
            let now = t + step * MIN;
            w.observe("a", now, None);
            w.observe("b", now, None);
            let expected = if step * MIN <= 5 * MIN { t } else { now };
            assert_eq!(
                w.watermark(),
                Some(expected),
                "{step} min after quiet went silent"
            );
        }
        // Of two hosts, a silent one lets go too.
        let mut two = fleet(&[("a", t), ("quiet", t)]);
        two.observe("a", t + 6 * MIN, None);
        assert_eq!(two.watermark(), Some(t + 6 * MIN));
        assert_eq!(FleetWatermark::new(MIN).watermark(), None);
    }

    #[test]
    fn where_arrivals_are_known_most_of_the_fleet_falling_silent_holds_it_no_longer() {
        // Six hosts of ten stop; in event time alone they are the median. Their records stop
        // arriving, which is what lets them go.
        let t = 1_796_400_000_000;
        let mut w = FleetWatermark::new(5 * MIN);
        for i in 0..10 {
            w.observe(&format!("h{i}"), t, Some(t));
        }
        for step in 1..=10 {
            let now = t + step * MIN;
            for i in 6..10 {
                w.observe(&format!("h{i}"), now, Some(now));
            }
            let expected = if step * MIN <= 5 * MIN { t } else { now };
            assert_eq!(
                w.watermark(),
                Some(expected),
                "{step} min after six went silent"
            );
        }
        w.forget_arrived_before(t + MIN);
        assert_eq!(w.len(), 4);
    }

    #[test]
    fn each_host_keeps_the_skew_of_its_latest_arrival() {
        let mut skews = HostSkews::default();
        skews.observe("a", 1_000, 1_500);
        skews.observe("b", 400 * DAY, 2_000);
        skews.observe("a", 2_000, 2_100);
        // A record that arrived earlier (a replay) does not replace a later measure.
        skews.observe("a", 0, 1_000);
        assert_eq!(
            skews.skews(),
            vec![
                ("a".to_string(), -100),
                ("b".to_string(), 400 * DAY - 2_000)
            ]
        );
        skews.forget_before(2_050);
        assert_eq!(skews.skews(), vec![("a".to_string(), -100)]);
    }
}
