//! The Kafka side of ingest: a consumer group over the four topics, feeding per-partition
//! buffers, flushing them through the writers, which commit each flush to the Delta tables with
//! the partition's last offset as a Delta transaction (app id `<topic>-p<partition>`), and
//! committing each partition's offsets to Kafka after that (auto-commit off; the committed
//! offset is the *next* one to read, as librdkafka expects). A partition newly assigned resumes
//! after the offset its topic's table holds: what Kafka had committed before that is skipped,
//! and a writer leaves out of a commit any row the table holds already, so every record lands
//! once whoever reads it and however often.
//!
//! Consumer-group membership (static `group.instance.id`, the session timeout) comes with the
//! client settings the caller hands in. A consumer fenced out of the group because another one
//! took its `group.instance.id` stops ingest with [`IngestError::Fenced`]: it can never read again.
//!
//! Memory is bounded: when buffered rows plus rows being written pass
//! `pipeline.max_buffered_bytes`, the largest buffer is flushed early and consumption pauses until
//! the writers catch up.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuwarden_schema::log_throttle::Throttle;
use gpuwarden_schema::signing::{self, SigningKeys, Verdict};
use gpuwarden_schema::{topics, Clock};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::statistics::Statistics;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::bounds::{arrival_of_message, Bounds, Direction, HostSkews};
use crate::buffer::{Arrival, Outcome, QuarantineRow, SourceBuffer, Table};
use crate::lake::Lake;
use crate::metrics::Metrics;
use crate::writer::{Done, Job, Writers};

/// How ingest flushes and bounds memory.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// Flush a partition's buffer at this many records.
    pub flush_rows: usize,
    /// Flush a partition's buffer once its oldest record waited this long.
    pub flush_age: Duration,
    /// Pause consumption above this many buffered bytes (rows waiting plus rows being written).
    pub max_buffered_bytes: usize,
    /// Writer threads.
    pub writers: usize,
    /// Slows the writers to this many bytes per second: for testing a slow disk.
    pub write_throttle: Option<u64>,
    /// The bounds a record's time must keep against its arrival.
    pub bounds: Bounds,
    /// The clock arrival is read on (the one the fleet's records are dated with).
    pub clock: Arc<dyn Clock>,
    /// With a key (`[signing] key`), lease events, signals and actions must carry a signature
    /// made with it; any other is quarantined. Samples are not signed.
    pub signing: SigningKeys,
}

/// Ingest could not run.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// The consumer could not be created or subscribed.
    #[error("cannot consume from Kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// The lake could not be opened.
    #[error(transparent)]
    Lake(#[from] crate::lake::LakeError),
    /// The brokers did not say which cluster they are (within 30 s): the tables' transactions
    /// are kept per cluster.
    #[error(
        "cannot read the Kafka cluster's id from the brokers (kafka.brokers): is Kafka reachable?"
    )]
    NoClusterId,
    /// librdkafka's consumer failed for good; with static membership, because another consumer
    /// joined the group with the same `group.instance.id`. What was read and not committed is
    /// read again by whoever owns the partitions now.
    #[error("the Kafka consumer {instance} stopped for good: {reason} (each instance of a group needs its own kafka.group_instance_id)")]
    Fenced {
        /// `group.instance.id`, as the log names it.
        instance: String,
        /// librdkafka's reason.
        reason: String,
    },
}

/// A record whose signature did not check out.
struct RefusedSignature(Verdict);

impl RefusedSignature {
    /// The quarantine row's reason.
    fn reason(&self) -> String {
        match self.0 {
            Verdict::Unsigned => format!(
                "{}: missing; lease events, signals and actions must be signed with [signing] key",
                signing::HEADER
            ),
            _ => format!(
                "{}: matches neither signing.key nor signing.previous_key",
                signing::HEADER
            ),
        }
    }
}

/// Why `message` of `topic` is refused for its signature, if it is: samples are not signed;
/// with a key, every other record must be.
fn refused_signature(
    keys: &SigningKeys,
    topic: &str,
    message: &BorrowedMessage<'_>,
) -> Option<RefusedSignature> {
    if topic == topics::SAMPLES {
        return None;
    }
    keys.refusal(message).map(RefusedSignature)
}

/// The topic's index in [`topics::ALL`].
fn topic_index(topic: &str) -> Option<usize> {
    topics::ALL.iter().position(|t| *t == topic)
}

/// The topic's name as one of the four constants, so keys need no allocation per message.
fn static_topic(topic: &str) -> Option<&'static str> {
    topic_index(topic).map(|i| topics::ALL[i])
}

/// Messages handled per turn of the loop before flushes and commits are looked at.
const POLL_BATCH: usize = 2_000;

fn source_of(topic: &str, partition: i32) -> String {
    format!("{topic}-p{partition}")
}

/// The Delta transaction app id of a partition's commits: `<topic>-p<partition>@<cluster id>`.
fn app_id(topic: &str, partition: i32, cluster: &str) -> String {
    format!("{}@{cluster}", source_of(topic, partition))
}

#[derive(Default)]
struct Rebalances {
    assigned: Vec<(String, i32)>,
    revoked: Vec<(String, i32)>,
}

struct IngestContext {
    metrics: Arc<Metrics>,
    rebalances: Mutex<Rebalances>,
}

impl ClientContext for IngestContext {
    fn error(&self, error: KafkaError, reason: &str) {
        gpuwarden_schema::kafka::broker_errors().report("pipeline", &error, reason);
    }

    fn stats(&self, statistics: Statistics) {
        let lag: i64 = statistics
            .topics
            .values()
            .flat_map(|t| t.partitions.values())
            .filter(|p| p.partition >= 0 && p.consumer_lag >= 0)
            .map(|p| p.consumer_lag)
            .sum();
        self.metrics.set_lag(lag);
    }
}

impl ConsumerContext for IngestContext {
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let mut r = self.rebalances.lock().unwrap_or_else(|e| e.into_inner());
        match rebalance {
            Rebalance::Assign(tpl) => r.assigned.extend(
                tpl.elements()
                    .iter()
                    .map(|e| (e.topic().to_string(), e.partition())),
            ),
            Rebalance::Revoke(tpl) => r.revoked.extend(
                tpl.elements()
                    .iter()
                    .map(|e| (e.topic().to_string(), e.partition())),
            ),
            Rebalance::Error(e) => tracing::warn!(error = %e, "consumer group rebalance failed"),
        }
    }
}

/// Consumes the four topics into the lake until `stop` is set, then flushes and commits
/// everything buffered and returns. `client` carries bootstrap servers and `[kafka.properties]`;
/// `group_id` is the consumer group of all pipeline instances.
pub fn run(
    client: &ClientConfig,
    group_id: &str,
    lake: Lake,
    options: IngestOptions,
    metrics: Arc<Metrics>,
    stop: Arc<AtomicBool>,
) -> Result<(), IngestError> {
    let mut client = client.clone();
    client
        .set("group.id", group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("statistics.interval.ms", "5000")
        .set("partition.assignment.strategy", "cooperative-sticky");
    let context = IngestContext {
        metrics: Arc::clone(&metrics),
        rebalances: Mutex::default(),
    };
    let instance = client
        .get("group.instance.id")
        .map_or_else(|| "(dynamic member)".to_string(), str::to_string);
    let consumer: BaseConsumer<IngestContext> = client.create_with_context(context)?;
    // Offsets are numbered per cluster: a broker started again empty (the embedded one, a
    // restarted `gpuwarden broker`) numbers from 0 again. The tables' transactions are kept per
    // cluster, so its records are new ones, not a replay of the old cluster's.
    let cluster = consumer
        .client()
        .fetch_cluster_id(Duration::from_secs(30))
        .ok_or(IngestError::NoClusterId)?;
    consumer.subscribe(&topics::ALL)?;
    let writer_stop = Arc::new(AtomicBool::new(false));
    let (writers, done) = Writers::start(
        options.writers,
        lake.clone(),
        Arc::clone(&metrics),
        options.write_throttle,
        Arc::clone(&writer_stop),
    );
    let mut state = State {
        consumer,
        lake,
        options,
        metrics,
        writers,
        buffers: BTreeMap::new(),
        in_flight: BTreeMap::new(),
        owned: BTreeSet::new(),
        resume_after: BTreeMap::new(),
        rewind: BTreeMap::new(),
        paused: false,
        skews: HostSkews::default(),
        cluster,
        skews_published: None,
        out_of_bounds_log: Throttle::default(),
        signature_log: Throttle::default(),
    };
    tracing::info!(group = group_id, instance = %instance, cluster = %state.cluster, topics = ?topics::ALL, "ingest running");
    while !stop.load(Ordering::SeqCst) {
        state.rebalance();
        state.collect(&done, Duration::ZERO);
        state.backpressure();
        if !state.poll() {
            if let Some((_, reason)) = state.consumer.client().fatal_error() {
                writer_stop.store(true, Ordering::SeqCst);
                state.writers.join();
                return Err(IngestError::Fenced { instance, reason });
            }
        }
        state.flush_due(false);
    }
    tracing::info!("ingest stopping: flushing what is buffered");
    // Flush everything, one job per partition at a time, then wait for the writers.
    loop {
        state.rebalance();
        state.collect(&done, Duration::from_millis(50));
        state.flush_due(true);
        if state.in_flight.is_empty() && state.buffers.values().all(SourceBuffer::is_empty) {
            break;
        }
    }
    writer_stop.store(true, Ordering::SeqCst);
    state.writers.join();
    tracing::info!(
        records = state.metrics.records_in_total(),
        quarantined = state.metrics.quarantined_total(),
        "ingest stopped; everything read is written and committed"
    );
    Ok(())
}

struct State {
    consumer: BaseConsumer<IngestContext>,
    lake: Lake,
    options: IngestOptions,
    metrics: Arc<Metrics>,
    writers: Writers,
    buffers: BTreeMap<(&'static str, i32), SourceBuffer>,
    /// Bytes of each partition's flush being written.
    in_flight: BTreeMap<(&'static str, i32), usize>,
    owned: BTreeSet<(&'static str, i32)>,
    /// Each owned partition's last offset its table held when it was assigned: records up to
    /// it are skipped.
    resume_after: BTreeMap<(&'static str, i32), i64>,
    /// Owned partitions whose committed offset in Kafka was past what their table held when
    /// they were assigned (a lake moved or restored from an earlier version, commits lost):
    /// read again from the offset after the table's.
    rewind: BTreeMap<(&'static str, i32), Rewind>,
    paused: bool,
    /// Each host's clock skew, published to the metrics every [`SKEW_PUBLISH`].
    skews: HostSkews,
    /// The Kafka cluster's id.
    cluster: String,
    skews_published: Option<std::time::Instant>,
    /// Out-of-bounds records are logged at most every 10 s.
    out_of_bounds_log: Throttle,
    /// So are records refused for their signature.
    signature_log: Throttle,
}

/// How often the hosts' clock skews are copied to `/metrics`.
const SKEW_PUBLISH: Duration = Duration::from_secs(5);

/// A host silent this long (in arrival time) leaves the clock-skew gauge.
const SKEW_FORGET_MS: i64 = 3_600_000;

impl State {
    fn buffered_bytes(&self) -> usize {
        self.buffers
            .values()
            .map(SourceBuffer::bytes)
            .sum::<usize>()
            + self.in_flight.values().sum::<usize>()
    }

    fn rebalance(&mut self) {
        let changes = std::mem::take(
            &mut *self
                .consumer
                .context()
                .rebalances
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        if !changes.revoked.is_empty() || !changes.assigned.is_empty() {
            tracing::info!(
                assigned = changes.assigned.len(),
                revoked = changes.revoked.len(),
                owned_before = self.owned.len(),
                "consumer group rebalanced"
            );
        }
        for (topic, partition) in changes.revoked {
            // Uncommitted rows of a partition we no longer own are replayed by its next owner.
            let Some(topic) = static_topic(&topic) else {
                continue;
            };
            self.buffers.remove(&(topic, partition));
            self.owned.remove(&(topic, partition));
            self.resume_after.remove(&(topic, partition));
            self.rewind.remove(&(topic, partition));
        }
        if changes.assigned.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        for (topic, partition) in &changes.assigned {
            tpl.add_partition(topic, *partition);
        }
        let committed = self
            .consumer
            .committed_offsets(tpl, Duration::from_secs(30));
        for (topic, partition) in changes.assigned {
            let Some(topic) = static_topic(&topic) else {
                continue;
            };
            let source = app_id(topic, partition, &self.cluster);
            let table = Table::of_topic(topic).expect("each of the four topics has a table");
            // The topic's own table is committed last in each flush: what it holds, every
            // table holds.
            let held = match crate::delta::block_on(
                self.lake.delta().txn_version(table.name(), &source),
            ) {
                Ok(held) => held,
                Err(e) => {
                    // Rows the table holds are still left out when each flush commits.
                    tracing::warn!(error = %e, topic, partition, "cannot read the offset the table holds for the partition; reading from Kafka's committed offset");
                    None
                }
            };
            let kafka = match &committed {
                Ok(list) => list
                    .find_partition(topic, partition)
                    .and_then(|e| match e.offset() {
                        Offset::Offset(o) => Some(o),
                        _ => None,
                    }),
                Err(_) => None,
            };
            // A partition whose offsets end at or below what the table holds was deleted and
            // created again (offsets from 0 again, on the same cluster): what the table holds
            // is of the partition before, and its offsets are forgotten.
            let watermarks =
                self.consumer
                    .fetch_watermarks(topic, partition, Duration::from_secs(10));
            let held = match (held, &watermarks) {
                (Some(held), Ok((_, high))) if *high <= held => {
                    tracing::warn!(topic, partition, table_holds = held, partition_ends = high, "the partition's offsets end below what the table holds: it was deleted and created again; its offsets in the tables start again");
                    let tables = [Table::Quarantine, table];
                    for t in tables {
                        if let Err(e) = crate::delta::block_on(self.lake.delta().forget_txn(
                            t.name(),
                            &t.schema(),
                            &source,
                        )) {
                            tracing::error!(error = %e, table = t.name(), "cannot reset the partition's offsets in the table; its new records up to the old offset are skipped");
                        }
                    }
                    None
                }
                (held, _) => held,
            };
            if let Some(held) = held {
                self.resume_after.insert((topic, partition), held);
                if kafka.is_some_and(|next| next > held + 1) {
                    // The records after the table's offset are not in it: read them again
                    // (from the oldest Kafka still has, if it has dropped some).
                    let low = watermarks.as_ref().map_or(0, |(low, _)| *low);
                    let to = (held + 1).max(low);
                    tracing::warn!(topic, partition, kafka_committed = ?kafka, table_holds = held, reading_from = to, "Kafka's committed offset is past what the table holds (a lake moved or restored from an earlier version, or commits lost): reading again from after the table's offset");
                    if to > held + 1 {
                        tracing::error!(
                            topic,
                            partition,
                            from = held + 1,
                            to,
                            "Kafka no longer holds records the table lacks; they are lost"
                        );
                    }
                    let _ = self.consumer.seek(
                        topic,
                        partition,
                        Offset::Offset(to),
                        Duration::from_secs(5),
                    );
                    self.rewind
                        .insert((topic, partition), Rewind { to, seeked: false });
                } else if kafka.is_none_or(|next| next <= held) {
                    // Skip what the table holds without reading it, where librdkafka lets us
                    // seek this early; the filter in `poll` skips it otherwise.
                    let seek = self.consumer.seek(
                        topic,
                        partition,
                        Offset::Offset(held + 1),
                        Duration::from_secs(5),
                    );
                    tracing::info!(topic, partition, kafka_committed = ?kafka, table_holds = held, seeked = seek.is_ok(), "resuming after the offset the table holds");
                }
            } else {
                self.resume_after.remove(&(topic, partition));
            }
            self.owned.insert((topic, partition));
        }
        if self.paused {
            // New partitions start paused too while memory is over the bound.
            let _ = self.consumer.pause(&self.assignment());
        }
    }

    fn assignment(&self) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        for (topic, partition) in &self.owned {
            tpl.add_partition(topic, *partition);
        }
        tpl
    }

    fn collect(&mut self, done: &std::sync::mpsc::Receiver<Done>, wait: Duration) {
        let mut first = true;
        loop {
            let next = if first && !wait.is_zero() {
                done.recv_timeout(wait).ok()
            } else {
                done.try_recv().ok()
            };
            first = false;
            let Some(done) = next else { break };
            let Some(topic) = static_topic(&done.topic) else {
                continue;
            };
            let key = (topic, done.partition);
            self.in_flight.remove(&key);
            if !self.owned.contains(&key) {
                // Revoked meanwhile: the next owner resumes after what the table holds.
                continue;
            }
            let mut tpl = TopicPartitionList::new();
            let _ = tpl.add_partition_offset(
                &done.topic,
                done.partition,
                Offset::Offset(done.last + 1),
            );
            match self.consumer.commit(&tpl, CommitMode::Sync) {
                Ok(()) => {
                    self.metrics.committed();
                    tracing::debug!(topic = %done.topic, partition = done.partition, next = done.last + 1, files = done.files, bytes = done.bytes, "committed");
                }
                Err(e) => {
                    tracing::warn!(error = %e, topic = %done.topic, partition = done.partition, "offset commit failed; the range will be replayed after a restart")
                }
            }
        }
    }

    fn backpressure(&mut self) {
        let bytes = self.buffered_bytes();
        let limit = self.options.max_buffered_bytes;
        self.metrics.buffered(bytes, limit);
        if !self.paused && bytes > limit {
            self.paused = true;
            self.metrics.set_paused(true);
            let _ = self.consumer.pause(&self.assignment());
            tracing::info!(
                buffered = bytes,
                limit,
                "writing falls behind; consumption paused"
            );
            // Free memory as soon as possible: flush the largest buffer now.
            self.flush_largest();
        } else if self.paused && bytes <= limit / 4 * 3 {
            self.paused = false;
            self.metrics.set_paused(false);
            let _ = self.consumer.resume(&self.assignment());
            tracing::info!(buffered = bytes, limit, "consumption resumed");
        } else if self.paused {
            self.flush_largest();
        }
    }

    /// Handles up to [`POLL_BATCH`] messages: waits up to 100 ms for the first, then takes what
    /// is already there. `false` if the consumer reported an error.
    fn poll(&mut self) -> bool {
        let mut healthy = true;
        let mut counts: [(u64, u64); 4] = [(0, 0); 4];
        let mut out_of_bounds: BTreeMap<(&'static str, Direction), u64> = BTreeMap::new();
        let mut last_out_of_bounds = None;
        // Stop taking messages the moment memory passes the bound, so the pause that follows
        // holds it to within one message.
        let mut bytes = self.buffered_bytes();
        for n in 0..POLL_BATCH {
            if bytes > self.options.max_buffered_bytes {
                break;
            }
            let wait = if n == 0 {
                Duration::from_millis(100)
            } else {
                Duration::ZERO
            };
            let Some(message) = self.consumer.poll(wait) else {
                break;
            };
            let message = match message {
                Ok(m) => m,
                Err(e) => {
                    gpuwarden_schema::kafka::broker_errors().report("pipeline", &e, "");
                    healthy = false;
                    break;
                }
            };
            let Some(i) = topic_index(message.topic()) else {
                // Only the four topics are subscribed; anything else is a librdkafka surprise.
                tracing::error!(
                    topic = message.topic(),
                    "message from a topic that was not subscribed; skipped"
                );
                continue;
            };
            let topic = topics::ALL[i];
            let (partition, offset) = (message.partition(), message.offset());
            if let Some(rewind) = self.rewind.get_mut(&(topic, partition)) {
                // A partition to read again from an earlier offset: a seek at assignment may
                // not have held (librdkafka starts fetching from the committed offset), so the
                // first record past it seeks again, now that the partition is being fetched.
                // Once: after it, what comes is read (an offset may be missing for good).
                if offset > rewind.to && !rewind.seeked {
                    rewind.seeked = true;
                    let to = rewind.to;
                    match self.consumer.seek(
                        topic,
                        partition,
                        Offset::Offset(to),
                        Duration::from_secs(5),
                    ) {
                        Ok(()) => {
                            tracing::info!(
                                topic,
                                partition,
                                from = to,
                                "reading again from after the table's offset"
                            );
                            continue;
                        }
                        Err(e) => {
                            tracing::error!(error = %e, topic, partition, from = to, to = offset, "cannot go back to the offset after the table's; those records are not read");
                            self.rewind.remove(&(topic, partition));
                        }
                    }
                } else {
                    // At or before the offset, or past it after the seek: read from here on.
                    self.rewind.remove(&(topic, partition));
                }
            }
            if self
                .resume_after
                .get(&(topic, partition))
                .is_some_and(|held| offset <= *held)
            {
                // The table holds it already.
                continue;
            }
            let arrival = Arrival {
                ms: arrival_of_message(&*self.options.clock, message.timestamp()),
                bounds: &self.options.bounds,
            };
            let payload = message.payload().unwrap_or_default();
            let table = Table::of_topic(topic).expect("each of the four topics has a table");
            let buffer = self.buffers.entry((topic, partition)).or_default();
            if let Some(refused) = refused_signature(&self.options.signing, topic, &message) {
                buffer.refuse(QuarantineRow {
                    ts_ms: arrival.ms,
                    topic: topic.to_string(),
                    partition,
                    offset,
                    field: Some(signing::HEADER.to_string()),
                    reason: refused.reason(),
                    raw: payload.to_vec(),
                });
                counts[i].0 += 1;
                counts[i].1 += 1;
                self.metrics.refused_signature(topic, refused.0);
                if let Some(more) = self.signature_log.ready() {
                    tracing::warn!(topic, partition, offset, signature = refused.0.as_str(), more, "a record not signed with the signing key was quarantined: whoever wrote it lacks [signing] key");
                }
                continue;
            }
            let before = buffer.bytes();
            let outcome = buffer.add(
                table,
                payload,
                topic,
                partition,
                offset,
                &arrival,
                Some(&mut self.skews),
            );
            bytes += buffer.bytes() - before;
            counts[i].0 += 1;
            counts[i].1 += u64::from(outcome.quarantined());
            if let Outcome::OutOfBounds(direction) = outcome {
                *out_of_bounds.entry((topic, direction)).or_default() += 1;
                last_out_of_bounds = Some((topic, direction, partition, offset));
            }
        }
        for (topic, (n, bad)) in topics::ALL.iter().zip(counts) {
            if n > 0 {
                self.metrics.records_in_n(topic, n, bad);
            }
        }
        let refused: u64 = out_of_bounds.values().sum();
        for ((topic, direction), n) in out_of_bounds {
            self.metrics.out_of_bounds(topic, direction, n);
        }
        if let Some((topic, direction, partition, offset)) = last_out_of_bounds {
            if let Some(held) = self.out_of_bounds_log.ready_n(refused) {
                tracing::warn!(
                    records = held + refused,
                    topic,
                    partition,
                    offset,
                    bound = direction.name(),
                    "records whose time is out of bounds were quarantined (the quarantine table says why; the last is named here)"
                );
            }
        }
        if self
            .skews_published
            .is_none_or(|t| t.elapsed() >= SKEW_PUBLISH)
        {
            self.skews
                .forget_before(self.options.clock.now_ms() - SKEW_FORGET_MS);
            self.metrics.set_host_skews(self.skews.skews());
            self.skews_published = Some(std::time::Instant::now());
        }
        healthy
    }

    fn flush_due(&mut self, all: bool) {
        let due: Vec<(&'static str, i32)> = self
            .buffers
            .iter()
            .filter(|(key, b)| {
                !b.is_empty()
                    && !self.in_flight.contains_key(*key)
                    && (all
                        || b.rows() >= self.options.flush_rows
                        || b.started()
                            .is_some_and(|t| t.elapsed() >= self.options.flush_age))
            })
            .map(|(key, _)| *key)
            .collect();
        for key in due {
            self.flush(key);
        }
    }

    fn flush_largest(&mut self) {
        let largest = self
            .buffers
            .iter()
            .filter(|(key, b)| !b.is_empty() && !self.in_flight.contains_key(*key))
            .max_by_key(|(_, b)| b.bytes())
            .map(|(key, _)| *key);
        if let Some(key) = largest {
            self.flush(key);
        }
    }

    fn flush(&mut self, key: (&'static str, i32)) {
        let Some(buffer) = self.buffers.get_mut(&key) else {
            return;
        };
        let sealed = match buffer.seal() {
            Ok(Some(sealed)) => sealed,
            Ok(None) => return,
            Err(e) => {
                tracing::error!(error = %e, "cannot build Arrow batches; this is a bug");
                return;
            }
        };
        self.in_flight.insert(key, sealed.bytes);
        let (topic, partition) = key;
        self.writers.submit(Job {
            source: source_of(topic, partition),
            app_id: app_id(topic, partition, &self.cluster),
            topic: topic.to_string(),
            partition,
            sealed,
        });
    }
}

/// Wall-clock milliseconds, for dating records that carry no time of their own.
pub(crate) fn wall_ms() -> i64 {
    gpuwarden_schema::clock::wall_now_ms()
}

/// A partition read again from an earlier offset than Kafka's committed one.
#[derive(Debug, Clone, Copy)]
struct Rewind {
    /// The offset to read from: the one after what the table holds (or Kafka's oldest).
    to: i64,
    /// Whether a record past it made the consumer seek back already.
    seeked: bool,
}
