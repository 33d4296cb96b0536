//! The outbox publisher: moves the lease store's outbox rows (lease events and actions, written
//! in the same transaction as the change they record) to Kafka.
//!
//! Rows are sent oldest first by an idempotent producer, keyed and routed as the row says, and
//! marked published only once Kafka has acknowledged them. A row that is not acknowledged stays
//! in the outbox and is sent again on the next round, so Kafka being down delays records but
//! never loses them; a record may then reach Kafka twice (at-least-once), which consumers
//! already tolerate because they key on the lease and the event time.
//!
//! `gpuwarden enforce` (and `up` and `demo`, which contain it) runs one beside the admission API.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuwarden_schema::retry::Backoff;
use gpuwarden_schema::signing::SigningKeys;
use gpuwarden_schema::{topics, Clock};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::util::Timeout;
use tokio::sync::watch;

use crate::store::{OutboxRow, Store};

/// Rows sent per round.
const BATCH: usize = 500;
/// Pause when the outbox is empty.
const IDLE_POLL: Duration = Duration::from_millis(100);
/// Pauses after failed rounds: 0.2 s, doubling, at most 5 s.
const BACKOFF: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
/// Most one warning about Kafka per this interval.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// How long librdkafka keeps retrying one record before handing it back to us.
const MESSAGE_TIMEOUT_MS: &str = "10000";

/// How the publisher makes sure gpuwarden's topics exist before it sends anything: an external
/// cluster may not have them yet, and may not be up when the enforcer starts. (The embedded
/// broker creates them as it starts, so it needs none.)
#[derive(Debug, Clone)]
pub struct TopicSetup {
    /// Settings for the admin client that looks for the topics and creates the missing ones.
    pub admin: ClientConfig,
    /// Partitions of each topic created (`kafka.partitions`).
    pub partitions: i32,
    /// Replicas of each topic created (`kafka.replication_factor`).
    pub replication: i32,
}

impl TopicSetup {
    /// Creates the topics that are missing; blocks on the cluster's metadata.
    fn ensure(&self) -> Result<(), String> {
        gpuwarden_schema::kafka::ensure_topics(
            &self.admin,
            &topics::ALL,
            self.partitions,
            self.replication,
        )
        .map_err(|e| {
            let bootstrap = self.admin.get("bootstrap.servers").unwrap_or_default();
            format!("creating gpuwarden's topics on {bootstrap}: {e}")
        })
    }
}

/// Publishes the lease store's outbox; see the module docs.
pub struct Publisher {
    store: Store,
    /// The producer's settings, to make a new one after a fatal error.
    client: ClientConfig,
    producer: FutureProducer,
    clock: Arc<dyn Clock>,
    signing: SigningKeys,
    last_warning: Option<Instant>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").finish_non_exhaustive()
    }
}

impl Publisher {
    /// Creates the idempotent producer from `client` (bootstrap servers and
    /// `[kafka.properties]`); published rows are marked with `clock`'s time, and signed with
    /// `signing`'s key when it has one (the pipeline checks lease events and actions with it).
    pub fn new(
        client: &ClientConfig,
        store: Store,
        clock: Arc<dyn Clock>,
        signing: SigningKeys,
    ) -> Result<Self, KafkaError> {
        let mut client = client.clone();
        client
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .set("message.timeout.ms", MESSAGE_TIMEOUT_MS);
        Ok(Self {
            store,
            producer: client.create()?,
            client,
            clock,
            signing,
            last_warning: None,
        })
    }

    /// Publishes until `stop` turns true, then keeps going for at most `flush` while rows are
    /// pending. Returns how many rows were still pending at the end. With `topics`, creates the
    /// missing topics first, retrying until the cluster answers.
    pub async fn run(
        mut self,
        topics: Option<TopicSetup>,
        mut stop: watch::Receiver<bool>,
        flush: Duration,
    ) -> usize {
        if let Some(topics) = topics {
            let topics = Arc::new(topics);
            let mut backoff = BACKOFF;
            loop {
                let t = Arc::clone(&topics);
                match tokio::task::spawn_blocking(move || t.ensure()).await {
                    Ok(Ok(())) => break,
                    Ok(Err(e)) => self.warn(&e),
                    Err(e) => self.warn(&e.to_string()),
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next_pause()) => {}
                    _ = stopped(&mut stop) => return self.pending_count().await,
                }
            }
        }
        let mut backoff = BACKOFF;
        let mut deadline: Option<Instant> = None;
        loop {
            let stopping = *stop.borrow();
            if deadline.is_none() && stopping {
                deadline = Some(Instant::now() + flush);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return self.pending_count().await;
            }
            let pause = match self.round().await {
                Ok(0) if deadline.is_some() => return 0,
                Ok(0) => IDLE_POLL,
                Ok(_) => {
                    backoff.reset();
                    Duration::ZERO
                }
                Err(why) => {
                    self.warn(&why);
                    backoff.next_pause()
                }
            };
            if !pause.is_zero() {
                let sleep = match deadline {
                    Some(d) => pause.min(d.saturating_duration_since(Instant::now())),
                    None => pause,
                };
                tokio::select! {
                    _ = tokio::time::sleep(sleep) => {}
                    _ = stopped(&mut stop), if deadline.is_none() => {}
                }
            }
        }
    }

    /// Sends one batch; `Ok(n)` when all `n` rows were acknowledged, `Err` when some were not
    /// (those that were are marked all the same).
    async fn round(&mut self) -> Result<usize, String> {
        let rows: Vec<OutboxRow> = self
            .store
            .outbox_pending(BATCH)
            .await
            .map_err(|e| format!("reading the outbox: {e}"))?;
        if rows.is_empty() {
            return Ok(0);
        }
        let sends = rows.iter().map(|row| {
            let mut record = FutureRecord::to(&row.topic)
                .key(row.key.as_bytes())
                .payload(row.payload.as_bytes());
            if let Some(headers) =
                self.signing
                    .headers(&row.topic, row.key.as_bytes(), row.payload.as_bytes())
            {
                record = record.headers(headers);
            }
            self.producer.send(record, Timeout::Never)
        });
        let results = futures::future::join_all(sends).await;
        let mut delivered = Vec::with_capacity(rows.len());
        let mut failure = None;
        let mut fenced = None;
        for (row, result) in rows.iter().zip(results) {
            match result {
                Ok(_) => delivered.push(row.id),
                Err((e, _)) => {
                    if matches!(
                        e.rdkafka_error_code(),
                        Some(
                            RDKafkaErrorCode::ProducerFenced
                                | RDKafkaErrorCode::InvalidProducerEpoch
                        )
                    ) {
                        fenced.get_or_insert_with(|| e.to_string());
                    }
                    gpuwarden_schema::kafka::broker_errors().report("enforcer", &e, "");
                    failure.get_or_insert_with(|| format!("publishing to {}: {e}", row.topic));
                }
            }
        }
        self.replace_if_dead(fenced);
        let count = delivered.len();
        if !delivered.is_empty() {
            let now = self.clock.now_ms();
            self.store
                .outbox_mark_published(&delivered, now)
                .await
                .map_err(|e| format!("marking outbox rows published: {e}"))?;
        }
        match failure {
            None => Ok(count),
            Some(why) => Err(why),
        }
    }

    /// An idempotent producer that hit a fatal error (its sequence numbers broke), or that the
    /// brokers fence (`fenced`: another producer holds its id and epoch), fails every send after
    /// it: librdkafka's rule is to make a new one, which gets an id of its own. The rows it did
    /// not deliver are still pending in the outbox; the new producer sends them.
    fn replace_if_dead(&mut self, fenced: Option<String>) {
        let Some(reason) = self
            .producer
            .client()
            .fatal_error()
            .map(|(_, reason)| reason)
            .or(fenced)
        else {
            return;
        };
        match self.client.create() {
            Ok(producer) => {
                tracing::warn!(reason = %reason, "the Kafka producer failed for good; publishing the outbox through a new one");
                self.producer = producer;
            }
            Err(e) => {
                tracing::warn!(error = %e, fatal = %reason, "cannot make a new Kafka producer after a fatal error; trying again");
            }
        }
    }

    async fn pending_count(&self) -> usize {
        self.store.outbox_pending_count().await.unwrap_or(0)
    }

    fn warn(&mut self, why: &str) {
        if self.last_warning.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            self.last_warning = Some(Instant::now());
            tracing::warn!(error = %why, "Kafka is not taking the enforcer's records; they wait in the outbox");
        }
    }
}

/// Resolves once `stop` is true (or its sender is gone).
pub async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
