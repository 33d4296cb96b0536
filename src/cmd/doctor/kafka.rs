//! The Kafka checks: the brokers answer, gpuwarden's topics are as the config says, and this
//! machine's clock agrees with the time the records on them were stamped with.
//!
//! **Where the brokers' time comes from.** No Kafka request asks a broker for its clock, and the
//! one answer that carries it (a produce response's `log_append_time_ms`) needs a record written,
//! which doctor will not do to topics the pipeline and the enforcer consume. What doctor can read
//! without writing is the timestamp of the newest record of each partition: on a topic created
//! with `message.timestamp.type=LogAppendTime` the broker stamped it with its own clock when the
//! record arrived; on the default `CreateTime` its producer did, with the producing host's clock,
//! which is the time the pipeline takes as the record's arrival (`pipeline/src/bounds.rs`,
//! docs/src/contributors/delivery.md#event-time) and measures `pipeline.clock.max_skew` against. Either way
//! the stamp is a clock the pipeline trusts, read where it lives. The comparison is sound in one
//! direction for any record: the stamping clock read `ts` when it stamped, so now it reads at
//! least `ts`, and a `ts` more than `max_skew` ahead of this machine's now means this clock is
//! that far behind. The other direction needs a record stamped while doctor watches: doctor waits
//! for new records for a moment after reading the newest ones, and a record that arrives then was
//! stamped within that moment, so its `ts` against this machine's now measures the difference
//! both ways. Idle topics leave that direction open, and doctor says so instead of guessing.

use std::collections::BTreeMap;
use std::time::Duration;

use gpuwarden_schema::config::Config;
use gpuwarden_schema::kafka;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::Message as _;
use rdkafka::{Offset, Timestamp, TopicPartitionList};

use super::{span, Line};

/// The brokers, the four topics and (with `clock`) the clock, each step within `budget`.
pub(super) fn check(config: &Config, budget: Duration, clock: bool) -> Vec<Line> {
    let client = client(config);
    // The metadata request gives up a little before the deadline, so that its own reason (a
    // refused connection, a failed login) is what the line says rather than the deadline's.
    let metadata = match kafka::cluster_metadata(&client, budget.mul_f64(0.8)) {
        Ok(metadata) => metadata,
        Err(e) => {
            let (text, fix) = match e {
                // The settings to check for what librdkafka said (a login, TLS, ACLs).
                kafka::KafkaSetupError::Broker {
                    bootstrap,
                    reason,
                    check,
                } if !check.contains("kafka.brokers") => (
                    format!("Kafka at {bootstrap}: {reason}"),
                    format!("check {check}"),
                ),
                kafka::KafkaSetupError::Broker {
                    bootstrap, reason, ..
                } => (
                    format!("Kafka at {bootstrap}: {reason}"),
                    UNREACHABLE.to_string(),
                ),
                other => (other.to_string(), UNREACHABLE.to_string()),
            };
            let mut lines = vec![Line::fail("kafka", text, fix)];
            lines.push(Line::skipped(
                "topics",
                "the brokers did not answer, so the topics were not looked at",
            ));
            if clock {
                lines.push(Line::skipped(
                    "clock",
                    "the brokers did not answer, so no record dates their clock",
                ));
            }
            return lines;
        }
    };
    let brokers: Vec<String> = metadata
        .brokers()
        .iter()
        .map(|b| format!("{} at {}:{}", b.id(), b.host(), b.port()))
        .collect();
    let mut lines = vec![Line::ok(
        "kafka",
        format!(
            "{} answered: {} broker{} ({})",
            config.kafka.brokers,
            brokers.len(),
            if brokers.len() == 1 { "" } else { "s" },
            brokers.join(", ")
        ),
    )];
    let found: BTreeMap<&str, TopicFound> = metadata
        .topics()
        .iter()
        .map(|t| {
            (
                t.name(),
                TopicFound {
                    error: t
                        .error()
                        .map(|e| format!("{:?}", rdkafka::error::RDKafkaErrorCode::from(e))),
                    partitions: t.partitions().len(),
                    leaderless: t
                        .partitions()
                        .iter()
                        .filter(|p| p.leader() < 0)
                        .map(|p| p.id())
                        .collect(),
                    replication: t
                        .partitions()
                        .iter()
                        .map(|p| p.replicas().len())
                        .min()
                        .unwrap_or(0),
                },
            )
        })
        .collect();
    for topic in gpuwarden_schema::topics::ALL {
        lines.push(topic_line(
            topic,
            found.get(topic),
            config.kafka.partitions,
            config.kafka.replication_factor,
            metadata.brokers().len(),
        ));
    }
    if clock {
        lines.push(clock_line(config, budget));
    }
    lines
}

/// What to do about brokers that do not answer.
const UNREACHABLE: &str = "check kafka.brokers, that the brokers are up and reachable from this \
                           host, and the security settings in [kafka.properties]";

/// A client of the configured brokers for doctor, whose librdkafka logs stay quiet: what went
/// wrong is on doctor's lines.
fn client(config: &Config) -> rdkafka::ClientConfig {
    let mut client = kafka::client_config(&config.kafka, &config.kafka.brokers, "doctor");
    client.set_log_level(rdkafka::config::RDKafkaLogLevel::Emerg);
    client
}

/// What the metadata says of one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct TopicFound {
    /// The error the broker answered for the topic (librdkafka's name for it).
    pub(super) error: Option<String>,
    pub(super) partitions: usize,
    /// Partitions without a leader.
    pub(super) leaderless: Vec<i32>,
    /// The fewest replicas of any partition.
    pub(super) replication: usize,
}

/// The line of `topic`: present with `partitions` partitions, each led; missing (a warning
/// when the components can create it, a failure when its replication factor cannot be met).
pub(super) fn topic_line(
    topic: &str,
    found: Option<&TopicFound>,
    partitions: i32,
    replication: i32,
    brokers: usize,
) -> Line {
    let check = format!("topic {topic}");
    let Some(found) = found.filter(|f| f.error.as_deref() != Some("UnknownTopicOrPartition"))
    else {
        if usize::try_from(replication).unwrap_or(0) > brokers {
            return Line::fail(
                check,
                format!(
                    "does not exist, and cannot be created with kafka.replication_factor = \
                     {replication} on {brokers} broker{}",
                    if brokers == 1 { "" } else { "s" }
                ),
                format!(
                    "set kafka.replication_factor to at most {brokers}, or create the topic: \
                     kafka-topics.sh --create --topic {topic} --partitions {partitions} \
                     --replication-factor N"
                ),
            );
        }
        return Line::warn(
            check,
            format!("does not exist yet: collect, pipeline and enforce create it at their start, with {partitions} partitions and replication {replication}"),
            format!(
                "nothing, if gpuwarden's Kafka user may create topics; otherwise create it: \
                 kafka-topics.sh --create --topic {topic} --partitions {partitions} \
                 --replication-factor {replication}"
            ),
        );
    };
    if let Some(error) = &found.error {
        return Line::fail(
            check,
            format!("the brokers answered {error} for it"),
            "check the ACLs of gpuwarden's Kafka user: Describe, and Read or Write, on the \
             gpuwarden.* topics (docs/src/contributors/delivery.md#trust-between-the-parts)",
        );
    }
    if i32::try_from(found.partitions).ok() != Some(partitions) {
        return Line::fail(
            check,
            format!(
                "has {} partitions; kafka.partitions says {partitions}",
                found.partitions
            ),
            format!(
                "set kafka.partitions = {} to match the cluster, or add partitions with \
                 kafka-topics.sh --alter --topic {topic} --partitions {partitions} (Kafka cannot \
                 take partitions away)",
                found.partitions
            ),
        );
    }
    if !found.leaderless.is_empty() {
        let ids: Vec<String> = found.leaderless.iter().map(i32::to_string).collect();
        return Line::fail(
            check,
            format!("partitions {} have no leader", ids.join(", ")),
            "bring the brokers that hold their replicas back (kafka-topics.sh --describe \
             --under-min-isr-partitions shows them)",
        );
    }
    Line::ok(
        check,
        format!(
            "{} partitions (kafka.partitions), replication {}, each with a leader",
            found.partitions, found.replication
        ),
    )
}

/// How long doctor waits for a record stamped while it watches, within the clock's budget.
const WATCH: Duration = Duration::from_secs(2);

/// One record read for the clock: where, its stamp, and this machine's time when it was read.
#[derive(Debug, Clone)]
pub(super) struct Stamp {
    pub(super) topic: String,
    pub(super) partition: i32,
    pub(super) offset: i64,
    /// Its timestamp, ms.
    pub(super) ts_ms: i64,
    /// Stamped by the broker (`LogAppendTime`) rather than the producer (`CreateTime`).
    pub(super) broker: bool,
    /// This machine's wall clock when it was read, ms.
    pub(super) read_ms: i64,
    /// It arrived on the broker while doctor watched.
    pub(super) fresh: bool,
}

fn clock_line(config: &Config, budget: Duration) -> Line {
    match read_stamps(config, budget) {
        Ok(stamps) => judge_clock(&stamps, config.pipeline.clock.max_skew),
        Err(why) => Line::warn(
            "clock",
            format!("the records could not be read to date the brokers' clock: {why}"),
            "give gpuwarden's Kafka user Read on the gpuwarden.* topics to check it, or compare \
             the hosts' clocks by hand (chronyc tracking)",
        ),
    }
}

/// The newest record of every partition of the four topics, then those that arrive within
/// [`WATCH`]; read without a consumer group, so no offset is committed anywhere.
fn read_stamps(config: &Config, budget: Duration) -> Result<Vec<Stamp>, String> {
    let deadline = std::time::Instant::now() + budget;
    let left = || deadline.saturating_duration_since(std::time::Instant::now());
    let mut client = client(config);
    // A group id librdkafka wants for a consumer; partitions are assigned, never subscribed,
    // so no group is joined, and no offset is committed.
    client
        .set("group.id", "gpuwarden-doctor")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false");
    let consumer: BaseConsumer = client.create().map_err(|e| e.to_string())?;
    let mut assignment = TopicPartitionList::new();
    // Where each partition ended when doctor looked: a record at or past it arrived since.
    let mut ends: BTreeMap<(String, i32), i64> = BTreeMap::new();
    let mut newest_wanted = 0usize;
    for topic in gpuwarden_schema::topics::ALL {
        let metadata = consumer
            .fetch_metadata(Some(topic), left())
            .map_err(|e| format!("{topic}: {e}"))?;
        let Some(found) = metadata.topics().first().filter(|t| t.error().is_none()) else {
            continue;
        };
        for partition in found.partitions() {
            let (low, high) = consumer
                .fetch_watermarks(topic, partition.id(), left())
                .map_err(|e| format!("{topic} [{}]: {e}", partition.id()))?;
            let from = if high > low {
                newest_wanted += 1;
                high - 1
            } else {
                high
            };
            ends.insert((topic.to_string(), partition.id()), high);
            assignment
                .add_partition_offset(topic, partition.id(), Offset::Offset(from))
                .map_err(|e| e.to_string())?;
        }
    }
    consumer.assign(&assignment).map_err(|e| e.to_string())?;
    let mut stamps: Vec<Stamp> = Vec::new();
    let mut watch_until = None;
    loop {
        let now = std::time::Instant::now();
        let done_reading = stamps.iter().filter(|s| !s.fresh).count() >= newest_wanted;
        if done_reading && watch_until.is_none() {
            watch_until = Some(now + WATCH.min(left()));
        }
        if watch_until.is_some_and(|until| now >= until) || left().is_zero() {
            break;
        }
        if stamps.iter().any(|s| s.fresh) {
            break;
        }
        let Some(message) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let message = message.map_err(|e| e.to_string())?;
        let (ts_ms, broker) = match message.timestamp() {
            Timestamp::CreateTime(ms) => (ms, false),
            Timestamp::LogAppendTime(ms) => (ms, true),
            Timestamp::NotAvailable => continue,
        };
        let end = ends
            .get(&(message.topic().to_string(), message.partition()))
            .copied()
            .unwrap_or(i64::MAX);
        stamps.push(Stamp {
            topic: message.topic().to_string(),
            partition: message.partition(),
            offset: message.offset(),
            ts_ms,
            broker,
            read_ms: gpuwarden_schema::clock::wall_now_ms(),
            fresh: message.offset() >= end,
        });
    }
    Ok(stamps)
}

/// Whose clock a stamp is.
fn stamper(stamp: &Stamp) -> &'static str {
    if stamp.broker {
        "the broker's clock (LogAppendTime)"
    } else {
        "its producer's clock (CreateTime)"
    }
}

fn place(stamp: &Stamp) -> String {
    format!(
        "{} [{}] offset {}",
        stamp.topic, stamp.partition, stamp.offset
    )
}

/// The clock's line from the records read (see the module docs for what each direction needs).
pub(super) fn judge_clock(stamps: &[Stamp], max_skew: Duration) -> Line {
    let max_ms = gpuwarden_schema::clock::duration_ms(max_skew);
    let shown = humantime::format_duration(max_skew);
    let ahead = |s: &Stamp| s.ts_ms - s.read_ms;
    let fix_here = "set this machine's clock right (NTP: chronyc tracking, timedatectl \
                    show-timesync), and the clock of the host that stamped it";
    // Stamped ahead of this clock: the stamping clock is ahead, whatever the record's age.
    if let Some(s) = stamps.iter().max_by_key(|s| ahead(s)) {
        if ahead(s) > max_ms {
            return Line::fail(
                "clock",
                format!(
                    "{} is stamped {} ahead of this machine's clock by {}, more than \
                     pipeline.clock.max_skew ({shown}): the pipeline quarantines what the \
                     clock that is wrong dates",
                    place(s),
                    span(Duration::from_millis(ahead(s).unsigned_abs())),
                    stamper(s)
                ),
                fix_here,
            );
        }
    }
    // Stamped while doctor watched: behind by more than max_skew is this clock running ahead.
    if let Some(s) = stamps.iter().filter(|s| s.fresh).min_by_key(|s| ahead(s)) {
        if -ahead(s) > max_ms {
            return Line::fail(
                "clock",
                format!(
                    "{}, which arrived while doctor watched, is stamped {} behind this \
                     machine's clock by {}, more than pipeline.clock.max_skew ({shown})",
                    place(s),
                    span(Duration::from_millis(ahead(s).unsigned_abs())),
                    stamper(s)
                ),
                fix_here,
            );
        }
        return Line::ok(
            "clock",
            format!(
                "within pipeline.clock.max_skew ({shown}) of {}: {} arrived while doctor \
                 watched, stamped {}",
                stamper(s),
                place(s),
                relative(ahead(s))
            ),
        );
    }
    let Some(newest) = stamps.iter().max_by_key(|s| s.ts_ms) else {
        return Line::warn(
            "clock",
            "the gpuwarden topics hold no record yet, so nothing on the brokers dates a clock",
            "run doctor again once the collectors publish, or compare the hosts' clocks by hand \
             (chronyc tracking)",
        );
    };
    let age = newest.read_ms - newest.ts_ms;
    if age > max_ms {
        return Line::warn(
            "clock",
            format!(
                "no record arrived while doctor watched, and the newest, {}, is {} old by this \
                 machine's clock: either the topics are idle or this clock runs ahead of {}",
                place(newest),
                span(Duration::from_millis(age.unsigned_abs())),
                stamper(newest)
            ),
            "run doctor again while the collectors publish, or compare the clocks by hand \
             (chronyc tracking)",
        );
    }
    Line::ok(
        "clock",
        format!(
            "within pipeline.clock.max_skew ({shown}) of {}: the newest record, {}, is stamped \
             {}",
            stamper(newest),
            place(newest),
            relative(-age)
        ),
    )
}

/// `1m 5s ahead of` (`ms` > 0) or `300ms behind`, this machine's clock.
fn relative(ms: i64) -> String {
    let side = if ms < 0 { "behind" } else { "ahead of" };
    format!(
        "{} {side} this machine's clock",
        span(Duration::from_millis(ms.unsigned_abs()))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(ts_ms: i64, read_ms: i64, fresh: bool) -> Stamp {
        Stamp {
            topic: "gpuwarden.samples".into(),
            partition: 1,
            offset: 7,
            ts_ms,
            broker: false,
            read_ms,
            fresh,
        }
    }

    const MIN: i64 = 60_000;

    #[test]
    fn a_stamp_ahead_fails_whatever_its_age_and_a_fresh_one_behind_fails_too() {
        let skew = Duration::from_secs(300);
        let line = judge_clock(&[stamp(100 * MIN + 6 * MIN, 100 * MIN, false)], skew);
        assert_eq!(line.status, super::super::Status::Fail);
        assert!(line.text.contains("6m ahead"), "{}", line.text);
        let line = judge_clock(&[stamp(100 * MIN - 6 * MIN, 100 * MIN, true)], skew);
        assert_eq!(line.status, super::super::Status::Fail);
        assert!(line.text.contains("6m behind"), "{}", line.text);
        // An old record behind says nothing sure: a warning.
        let line = judge_clock(&[stamp(100 * MIN - 6 * MIN, 100 * MIN, false)], skew);
        assert_eq!(line.status, super::super::Status::Warn);
        let line = judge_clock(&[stamp(100 * MIN - 4 * MIN, 100 * MIN, false)], skew);
        assert_eq!(line.status, super::super::Status::Ok);
        assert_eq!(judge_clock(&[], skew).status, super::super::Status::Warn);
    }

    #[test]
    fn a_topic_is_judged_by_its_partitions_leaders_and_whether_it_can_be_made() {
        let found = TopicFound {
            error: None,
            partitions: 3,
            leaderless: vec![],
            replication: 1,
        };
        assert_eq!(
            topic_line("t", Some(&found), 3, 1, 1).status,
            super::super::Status::Ok
        );
        assert_eq!(
            topic_line("t", Some(&found), 6, 1, 1).to_string(),
            "FAIL    topic t: has 3 partitions; kafka.partitions says 6; fix: set \
             kafka.partitions = 3 to match the cluster, or add partitions with kafka-topics.sh \
             --alter --topic t --partitions 6 (Kafka cannot take partitions away)"
        );
        assert_eq!(
            topic_line("t", None, 3, 1, 1).status,
            super::super::Status::Warn
        );
        assert_eq!(
            topic_line("t", None, 3, 3, 1).status,
            super::super::Status::Fail
        );
        let leaderless = TopicFound {
            leaderless: vec![2],
            ..found
        };
        assert_eq!(
            topic_line("t", Some(&leaderless), 3, 1, 1).status,
            super::super::Status::Fail
        );
    }
}
