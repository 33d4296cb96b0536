//! The Kafka sink: publishes samples to `gpuwarden.samples`, keyed by GPU UUID, from a thread of
//! its own so the sampling loop never waits on Kafka.
//!
//! Samples are JSON-encoded here, kept in a bounded buffer (bytes and age, `collector.buffer_*`),
//! and handed to an idempotent, compressing, batching producer a window at a time. When the
//! broker is unreachable the window stays in librdkafka (retried) and new samples wait in the
//! buffer; past either bound the oldest are dropped, counted, and warned about at most every ten
//! seconds. A delivery that times out comes back to the front of the buffer. On close, what is
//! buffered is flushed within a deadline, and whatever could not be delivered is counted.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpuwarden_schema::kafka::broker_errors;
use gpuwarden_schema::{Record, Sample};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;

use crate::metrics::{DropReason, Metrics};

/// Bounds of the sink.
#[derive(Debug, Clone)]
pub struct SinkSettings {
    /// Most bytes of encoded samples kept while Kafka is unreachable.
    pub max_buffer_bytes: usize,
    /// Oldest a sample may be and still be published.
    pub max_buffer_age: Duration,
    /// Most bytes handed to librdkafka and not yet acknowledged.
    pub in_flight_bytes: usize,
}

impl Default for SinkSettings {
    fn default() -> Self {
        Self {
            max_buffer_bytes: 64 << 20,
            max_buffer_age: Duration::from_secs(15 * 60),
            in_flight_bytes: 16 << 20,
        }
    }
}

/// What the sink did over its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SinkReport {
    /// Samples acknowledged by Kafka.
    pub published: u64,
    /// Samples dropped (bounds, refusals, or not delivered by the close deadline).
    pub dropped: u64,
}

/// An encoded sample on its way to Kafka.
#[derive(Debug)]
struct Pending {
    key: Vec<u8>,
    payload: Vec<u8>,
    /// When the sample was taken: its age counts from here.
    taken: Instant,
}

impl Pending {
    fn size(&self) -> usize {
        self.key.len() + self.payload.len()
    }
}

struct Meta {
    taken: Instant,
    size: usize,
}

struct Shared {
    metrics: Arc<Metrics>,
    /// Bytes handed to librdkafka and not yet acknowledged or returned.
    in_flight: AtomicUsize,
    /// Samples handed to librdkafka and not yet acknowledged or returned.
    in_flight_samples: AtomicUsize,
    returned: Mutex<Vec<Pending>>,
    /// Whether librdkafka last said every broker is down (and no delivery succeeded since).
    unreachable: AtomicBool,
    /// The bounds, for the log line that says the samples now wait.
    bounds: (usize, Duration),
}

struct SinkContext {
    shared: Arc<Shared>,
}

impl ClientContext for SinkContext {
    fn error(&self, error: KafkaError, reason: &str) {
        broker_errors().report("collector", &error, reason);
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown)
            && !self.shared.unreachable.swap(true, Ordering::AcqRel)
        {
            let (max_bytes, max_age) = self.shared.bounds;
            tracing::warn!(
                max_bytes,
                max_age_s = max_age.as_secs(),
                "Kafka unreachable: samples wait in memory until it is back, up to collector.buffer_max_bytes and collector.buffer_max_age (the oldest are dropped past either)"
            );
        }
    }
}

impl ProducerContext for SinkContext {
    type DeliveryOpaque = Box<Meta>;

    fn delivery(&self, result: &DeliveryResult<'_>, meta: Box<Meta>) {
        self.shared.in_flight.fetch_sub(meta.size, Ordering::AcqRel);
        self.shared.in_flight_samples.fetch_sub(1, Ordering::AcqRel);
        match result {
            Ok(_) => {
                self.shared.metrics.published(meta.taken.elapsed());
                if self.shared.unreachable.swap(false, Ordering::AcqRel) {
                    tracing::info!(
                        waiting = self.shared.in_flight_samples.load(Ordering::Acquire),
                        "Kafka reachable again: publishing the samples that waited"
                    );
                }
            }
            Err((err, message)) if retriable(err) => {
                broker_errors().report("collector", err, "");
                let pending = Pending {
                    key: message.key().unwrap_or_default().to_vec(),
                    payload: message.payload().unwrap_or_default().to_vec(),
                    taken: meta.taken,
                };
                self.shared
                    .returned
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(pending);
            }
            Err((err, _)) => {
                broker_errors().report("collector", err, "");
                self.shared.metrics.dropped(DropReason::Undeliverable, 1);
                tracing::warn!(error = %err, "Kafka refused a sample for good; dropped");
            }
        }
    }
}

fn retriable(err: &KafkaError) -> bool {
    !matches!(
        err.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::TopicAuthorizationFailed
        )
    )
}

/// The producer settings of the sink: idempotent (a retry never duplicates), lz4-compressed,
/// batched for up to 20 ms, and timing out deliveries at the buffer's age bound. Public so the
/// benchmark's bare producer runs with exactly the same settings.
pub fn producer_config(client: &ClientConfig, settings: &SinkSettings) -> ClientConfig {
    let mut client = client.clone();
    let timeout_ms = settings
        .max_buffer_age
        .as_millis()
        .clamp(1_000, i32::MAX as u128);
    client
        .set("enable.idempotence", "true")
        .set("compression.type", "lz4")
        .set("linger.ms", "20")
        .set("batch.size", "1000000")
        .set("message.timeout.ms", timeout_ms.to_string());
    client
}

enum Command {
    Samples(Vec<Sample>, Instant),
    Close(Duration),
}

/// Queues samples for a [`KafkaSink`] from any thread; never blocks.
#[derive(Debug, Clone)]
pub struct SinkSender {
    commands: mpsc::Sender<Command>,
}

impl SinkSender {
    /// Queues samples for publishing; returns at once.
    pub fn send(&self, samples: Vec<Sample>) {
        if !samples.is_empty() {
            let _ = self
                .commands
                .send(Command::Samples(samples, Instant::now()));
        }
    }
}

/// Publishes samples from a thread of its own; see the module docs.
pub struct KafkaSink {
    commands: mpsc::Sender<Command>,
    thread: Option<JoinHandle<SinkReport>>,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink").finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// Creates the producer from `client` (bootstrap servers and `[kafka.properties]`) and starts
    /// the sink thread.
    pub fn start(
        client: &ClientConfig,
        topic: &str,
        settings: SinkSettings,
        metrics: Arc<Metrics>,
    ) -> Result<Self, KafkaError> {
        let client = producer_config(client, &settings);
        let shared = Arc::new(Shared {
            metrics,
            in_flight: AtomicUsize::new(0),
            in_flight_samples: AtomicUsize::new(0),
            returned: Mutex::new(Vec::new()),
            unreachable: AtomicBool::new(false),
            bounds: (settings.max_buffer_bytes, settings.max_buffer_age),
        });
        let producer: ThreadedProducer<SinkContext> = client.create_with_context(SinkContext {
            shared: Arc::clone(&shared),
        })?;
        let producer_client = client.clone();
        let (commands, receiver) = mpsc::channel();
        let topic = topic.to_string();
        let thread = std::thread::Builder::new()
            .name("kafka-sink".into())
            .spawn(move || {
                Worker::new(producer, producer_client, topic, settings, shared).run(receiver)
            })
            .expect("spawning the sink thread");
        Ok(Self {
            commands,
            thread: Some(thread),
        })
    }

    /// Queues samples for publishing; returns at once.
    pub fn send(&self, samples: Vec<Sample>) {
        self.sender().send(samples);
    }

    /// A handle that queues samples from another thread.
    pub fn sender(&self) -> SinkSender {
        SinkSender {
            commands: self.commands.clone(),
        }
    }

    /// Publishes what is buffered, waiting at most `deadline`, and stops.
    pub fn close(mut self, deadline: Duration) -> SinkReport {
        let _ = self.commands.send(Command::Close(deadline));
        self.thread
            .take()
            .map(|t| t.join().unwrap_or_default())
            .unwrap_or_default()
    }
}

impl Drop for KafkaSink {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = self.commands.send(Command::Close(Duration::from_secs(5)));
            let _ = thread.join();
        }
    }
}

struct Worker {
    producer: ThreadedProducer<SinkContext>,
    /// The producer's settings, to make a new one after a fatal error.
    client: ClientConfig,
    topic: String,
    settings: SinkSettings,
    shared: Arc<Shared>,
    buffer: VecDeque<Pending>,
    buffer_bytes: usize,
    dropped_since_warning: u64,
    last_warning: Option<Instant>,
}

impl Worker {
    fn new(
        producer: ThreadedProducer<SinkContext>,
        client: ClientConfig,
        topic: String,
        settings: SinkSettings,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            producer,
            client,
            topic,
            settings,
            shared,
            buffer: VecDeque::new(),
            buffer_bytes: 0,
            dropped_since_warning: 0,
            last_warning: None,
        }
    }

    fn run(mut self, commands: mpsc::Receiver<Command>) -> SinkReport {
        let deadline = loop {
            match commands.recv_timeout(Duration::from_millis(10)) {
                Ok(Command::Samples(samples, taken)) => self.push(samples, taken),
                Ok(Command::Close(deadline)) => break deadline,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break Duration::from_secs(5),
            }
            while let Ok(command) = commands.try_recv() {
                match command {
                    Command::Samples(samples, taken) => self.push(samples, taken),
                    Command::Close(deadline) => {
                        self.pump();
                        return self.close(deadline);
                    }
                }
            }
            self.pump();
        };
        self.close(deadline)
    }

    fn push(&mut self, samples: Vec<Sample>, taken: Instant) {
        for sample in samples {
            let pending = Pending {
                key: sample.key().as_bytes().to_vec(),
                payload: sample.to_json(),
                taken,
            };
            self.buffer_bytes += pending.size();
            self.buffer.push_back(pending);
        }
    }

    /// An idempotent producer that hit a fatal error (the broker fenced it, its sequence numbers
    /// broke) fails every send after it: librdkafka's rule is to make a new one. What the old
    /// one held is purged back into the buffer (the delivery reports return it) first.
    fn replace_if_fatal(&mut self) {
        let Some((code, reason)) = self.producer.client().fatal_error() else {
            return;
        };
        let context = SinkContext {
            shared: Arc::clone(&self.shared),
        };
        match self.client.create_with_context(context) {
            Ok(producer) => {
                tracing::warn!(error = ?code, reason = %reason, "the Kafka producer failed for good; publishing through a new one");
                self.producer
                    .purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
                let _ = self.producer.flush(Duration::from_millis(100));
                self.producer = producer;
            }
            Err(e) => {
                tracing::warn!(error = %e, fatal = %reason, "cannot make a new Kafka producer after a fatal error; trying again");
            }
        }
    }

    /// Takes back timed-out deliveries, enforces the bounds, and feeds the producer.
    fn pump(&mut self) {
        self.replace_if_fatal();
        let returned = std::mem::take(
            &mut *self
                .shared
                .returned
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        if !returned.is_empty() {
            tracing::debug!(
                samples = returned.len(),
                "deliveries timed out; back in the buffer"
            );
            // They were taken before anything still buffered: they go to the front, in order.
            let mut returned = returned;
            returned.sort_by_key(|p| p.taken);
            for pending in returned.into_iter().rev() {
                self.buffer_bytes += pending.size();
                self.buffer.push_front(pending);
            }
        }
        self.enforce_bounds();
        while self.shared.in_flight.load(Ordering::Acquire) < self.settings.in_flight_bytes {
            let Some(pending) = self.buffer.pop_front() else {
                break;
            };
            let size = pending.size();
            let meta = Box::new(Meta {
                taken: pending.taken,
                size,
            });
            let record = BaseRecord::with_opaque_to(&self.topic, meta)
                .key(&pending.key)
                .payload(&pending.payload);
            self.shared.in_flight.fetch_add(size, Ordering::AcqRel);
            self.shared.in_flight_samples.fetch_add(1, Ordering::AcqRel);
            match self.producer.send(record) {
                Ok(()) => self.buffer_bytes -= size,
                Err((err, _record)) => {
                    self.shared.in_flight.fetch_sub(size, Ordering::AcqRel);
                    self.shared.in_flight_samples.fetch_sub(1, Ordering::AcqRel);
                    self.buffer.push_front(pending);
                    if err.rdkafka_error_code() != Some(RDKafkaErrorCode::QueueFull) {
                        tracing::warn!(error = %err, "cannot hand samples to librdkafka; they stay buffered");
                    }
                    break;
                }
            }
        }
        self.shared.metrics.buffer(
            self.buffer_bytes,
            self.buffer.len(),
            self.shared.in_flight_samples.load(Ordering::Acquire),
        );
    }

    fn enforce_bounds(&mut self) {
        let max_age = self.settings.max_buffer_age;
        let mut aged = 0;
        while self
            .buffer
            .front()
            .is_some_and(|p| p.taken.elapsed() > max_age)
        {
            let pending = self.buffer.pop_front().expect("front exists");
            self.buffer_bytes -= pending.size();
            aged += 1;
        }
        let mut full = 0;
        while self.buffer_bytes > self.settings.max_buffer_bytes {
            let Some(pending) = self.buffer.pop_front() else {
                break;
            };
            self.buffer_bytes -= pending.size();
            full += 1;
        }
        if aged > 0 {
            self.shared.metrics.dropped(DropReason::BufferAge, aged);
        }
        if full > 0 {
            self.shared.metrics.dropped(DropReason::BufferFull, full);
        }
        self.dropped_since_warning += aged + full;
        let due = self
            .last_warning
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(10));
        if self.dropped_since_warning > 0 && due {
            tracing::warn!(
                dropped = self.dropped_since_warning,
                buffered = self.buffer.len(),
                buffer_bytes = self.buffer_bytes,
                "Kafka is not keeping up or not reachable: dropped the oldest samples to stay within collector.buffer_max_bytes / buffer_max_age"
            );
            self.dropped_since_warning = 0;
            self.last_warning = Some(Instant::now());
        }
    }

    fn close(mut self, deadline: Duration) -> SinkReport {
        let until = Instant::now() + deadline;
        loop {
            self.pump();
            if self.buffer.is_empty() && self.shared.in_flight.load(Ordering::Acquire) == 0 {
                break;
            }
            if Instant::now() >= until {
                break;
            }
            let _ = self.producer.flush(Duration::from_millis(50));
        }
        let _ = self.producer.flush(Duration::ZERO);
        self.producer
            .purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
        let _ = self.producer.flush(Duration::from_millis(100));
        // Purged deliveries come back through the context as failures.
        let returned = std::mem::take(
            &mut *self
                .shared
                .returned
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        let undelivered = (self.buffer.len() + returned.len()) as u64;
        if undelivered > 0 {
            self.shared
                .metrics
                .dropped(DropReason::Undeliverable, undelivered);
            tracing::error!(
                undelivered,
                "Kafka did not take every buffered sample before the shutdown deadline"
            );
        }
        self.shared.metrics.buffer(0, 0, 0);
        SinkReport {
            published: self.shared.metrics.published_total(),
            dropped: self.shared.metrics.dropped_total(),
        }
    }
}
