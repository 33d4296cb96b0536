//! The signals loop: keeps the hot window (recent samples, deduplicated and bucketed per GPU and
//! minute in a [`SampleWindow`], and every lease) in memory straight from Kafka, computes signals
//! with [`crate::signals`] each time event time passes a multiple of `pipeline.signals.every`,
//! and publishes them on `gpuwarden.signals`.
//!
//! It talks to Kafka (one consumer, one producer), to the lake (the `team_hourly` rollup for
//! month-to-date spend, and the lock that elects the one publisher), and to nothing else.
//!
//! - Reading: the consumer takes no part in a consumer group's assignment or commits: it
//!   `assign`s every partition of `gpuwarden.leases` from the beginning (the lease state is
//!   rebuilt from every event, as the collector's simulated fleet does) and every partition of
//!   `gpuwarden.samples` from the first record its producer stamped (in wall time) after
//!   now − window − 1 min. With an accelerated clock that reads more than the window; pruning
//!   drops the rest. When the broker cannot look offsets up by time, samples are read from the
//!   beginning. Records that do not decode are skipped with a warning (ingest quarantines them).
//!   Nothing is computed until what the topics held at the start has been read (or for at most
//!   [`CATCH_UP_LIMIT`]): signals from half the samples and none of the leases would report
//!   every busy GPU as unattributed.
//! - Event time: the watermark is the fleet's ([`FleetWatermark`] over each host's latest sample
//!   within `pipeline.clock`'s bounds; a sample out of them is skipped and its host reported in
//!   a `clock_skew` signal, at most once per `every`). When it passes the next
//!   multiple B of `every`, signals are computed for B (the latest multiple, if it passed
//!   several) and the samples that can count in no later window are dropped, so memory follows
//!   the window, not the topic: about 150 bytes per GPU-minute plus 32 per distinct sample
//!   ([`crate::signals::window`]), about 630 bytes per GPU-minute at a 5 s cadence.
//! - Month-to-date spend: each team's `cost_usd` in `team_hourly` over the UTC month of B, read
//!   at most once per `pipeline.rollup_every` (wall time) and whenever B enters a new month. No
//!   rollup yet means no spend: teams then report only their burn.
//! - One publisher per lake: the instance holding `<lake>/signals.lock` (a `flock`, as the
//!   rollup's) reads and publishes; the others try again every few seconds and read nothing
//!   meanwhile. One that takes over rebuilds the window from Kafka; an idle run older than the
//!   window starts again from the window's first sample.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow_array::{Array, Float64Array, StringArray};
use arrow_schema::DataType;
use datafusion::error::DataFusionError;
use datafusion::prelude::SessionContext;
use gpuwarden_schema::calendar::month_of;
use gpuwarden_schema::clock::duration_ms;
use gpuwarden_schema::config::{Config, PricingConfig};
use gpuwarden_schema::sample_row::SampleRow;
use gpuwarden_schema::signing::SigningKeys;
use gpuwarden_schema::{topics, Clock, DecodeError, LeaseEvent, Record as _, Signal, SignalBody};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::bounds::{arrival_of_message, Bounds, FleetWatermark, OutOfBounds};
use crate::lake::{Lake, LakeError, LakeLock};
use crate::metrics::{signal_kind_index, Metrics};
use crate::rollup::leases::Leases;
use crate::rollup::{RollupTable, UNALLOCATED};
use crate::signals::window::{Kept, SampleFields, SampleWindow, BUCKET_MS};
use crate::signals::{idle_measures, IdleMeasures, Period, SignalEngine};
use gpuwarden_schema::log_throttle::Throttle;

/// The lock file of the one publisher, relative to the lake root.
pub const LOCK: &str = "signals.lock";

/// How far before the window samples are read from, in the producers' wall time: records are
/// stamped when produced, a little after the sample was taken.
const READ_MARGIN_MS: i64 = 60_000;

/// Messages handled per turn of the loop before the watermark is looked at.
const POLL_BATCH: usize = 2_000;

/// How long to wait on Kafka metadata and offset lookups.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest the loop waits to read what the topics held at its start before it computes anyway
/// (records deleted by retention meanwhile would otherwise keep it waiting).
pub const CATCH_UP_LIMIT: Duration = Duration::from_secs(30);

/// What the signals loop needs from the config.
#[derive(Debug, Clone)]
pub struct SignalsOptions {
    /// Signals are computed each time event time passes a multiple of this, ms.
    pub every_ms: i64,
    /// The window signals are computed over, ms.
    pub window_ms: i64,
    /// Prices and the idle thresholds.
    pub pricing: PricingConfig,
    /// The measure each workload's leases are judged idle by.
    pub idle_measures: IdleMeasures,
    /// Month-to-date spend is read from the lake at most this often (wall time).
    pub spend_refresh: Duration,
    /// How often an instance that does not hold the lock tries again.
    pub lock_retry: Duration,
    /// The bounds a sample's time must keep against its arrival (`pipeline.clock`).
    pub bounds: Bounds,
    /// A host this far behind the median host, or silent this long, stops holding the
    /// watermark back, ms.
    pub idle_ms: i64,
    /// The clock arrival is read on (the one the fleet's records are dated with).
    pub clock: Arc<dyn Clock>,
    /// Signs each signal (`[signing]`); the enforcer acts only on signed ones.
    pub signing: SigningKeys,
}

impl SignalsOptions {
    /// The options of a config file (`pipeline.signals`, `pipeline.rollup_every`,
    /// `pipeline.clock`, `pricing`), with arrival read on `clock`.
    pub fn from_config(config: &Config, clock: Arc<dyn Clock>) -> Self {
        let ms = duration_ms;
        Self {
            every_ms: ms(config.pipeline.signals.every),
            window_ms: ms(config.pipeline.signals.window),
            pricing: config.pricing.clone(),
            idle_measures: idle_measures(config),
            spend_refresh: config.pipeline.rollup_every,
            lock_retry: Duration::from_secs(5),
            bounds: Bounds::streaming(&config.pipeline.clock),
            idle_ms: ms(config.pipeline.clock.idle_timeout),
            clock,
            signing: SigningKeys::from_config(&config.signing),
        }
    }
}

/// The signals loop could not run.
#[derive(Debug, thiserror::Error)]
pub enum SignalsError {
    /// librdkafka refused to create the consumer or the producer: the `[kafka]` settings are wrong.
    #[error("cannot create the signals' Kafka clients: {0}")]
    Kafka(#[from] KafkaError),
    /// The lock file could not be created or locked.
    #[error(transparent)]
    Lake(#[from] LakeError),
    /// The thread's async runtime (for DataFusion) could not start.
    #[error("cannot start the signals runtime: {0}")]
    Runtime(std::io::Error),
}

/// The samples and leases signals are computed from, and the event time they have reached.
/// Pure state: [`run`] feeds it from Kafka.
#[derive(Debug)]
pub struct HotWindow {
    every_ms: i64,
    window_ms: i64,
    bounds: Bounds,
    /// The samples that can still count, deduplicated, per GPU and minute.
    samples: SampleWindow,
    /// Each host's latest sample; the watermark is taken over them.
    fleet: FleetWatermark,
    /// Whether a sample arrived since the watermark was last taken.
    fleet_changed: bool,
    /// The latest arrival seen.
    newest_arrival: Option<i64>,
    watermark: Option<i64>,
    computed: Option<i64>,
    events: Vec<LeaseEvent>,
    leases: Leases,
    leases_stale: bool,
    /// Hosts whose samples were out of bounds, to be reported as `clock_skew` signals.
    skewed: HashMap<String, Skewed>,
}

/// A host whose samples were out of bounds.
#[derive(Debug, Clone, Copy)]
struct Skewed {
    /// The last refused sample's skew, and when it arrived.
    skew_ms: i64,
    arrival_ms: i64,
    /// When a `clock_skew` signal last reported the host (arrival time).
    reported: Option<i64>,
}

/// What became of a sample offered to the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Added {
    /// Kept.
    Kept,
    /// A copy of a sample held: merged into it (each column keeps the larger value).
    Merged,
    /// Too old to count in any window still to be computed: dropped.
    TooOld,
    /// Its time is out of bounds: dropped, and its host reported.
    OutOfBounds(OutOfBounds),
}

/// Hosts (and the lease events' producer) silent this long in arrival time leave the watermark.
const FORGET_ARRIVED_MS: i64 = 3_600_000;

impl HotWindow {
    /// An empty window computing every `every_ms` over `window_ms` (both at least 1 ms), whose
    /// samples keep `bounds` and whose hosts go idle after `idle_ms`.
    pub fn new(every_ms: i64, window_ms: i64, idle_ms: i64, bounds: Bounds) -> Self {
        Self {
            every_ms: every_ms.max(1),
            window_ms: window_ms.max(1),
            bounds,
            samples: SampleWindow::new(BUCKET_MS),
            fleet: FleetWatermark::new(idle_ms),
            fleet_changed: false,
            newest_arrival: None,
            watermark: None,
            computed: None,
            events: Vec::new(),
            leases: Leases::default(),
            leases_stale: false,
            skewed: HashMap::new(),
        }
    }

    /// Decodes one sample that arrived at `arrival_ms` and keeps it, unless its time is out of
    /// bounds or too old to count in any window still to be computed.
    pub fn add_sample(&mut self, payload: &[u8], arrival_ms: i64) -> Result<Added, DecodeError> {
        let row = SampleRow::from_json(payload)?;
        self.newest_arrival = self.newest_arrival.max(Some(arrival_ms));
        if let Err(refused) = self.bounds.check(row.ts_ms, arrival_ms, true) {
            match self.skewed.get_mut(&*row.host) {
                Some(skewed) if arrival_ms >= skewed.arrival_ms => {
                    skewed.skew_ms = refused.skew_ms();
                    skewed.arrival_ms = arrival_ms;
                }
                Some(_) => {}
                None => {
                    self.skewed.insert(
                        row.host.to_string(),
                        Skewed {
                            skew_ms: refused.skew_ms(),
                            arrival_ms,
                            reported: None,
                        },
                    );
                }
            }
            return Ok(Added::OutOfBounds(refused));
        }
        self.fleet.observe(&row.host, row.ts_ms, Some(arrival_ms));
        self.fleet_changed = true;
        if self.cutoff().is_some_and(|cutoff| row.ts_ms <= cutoff) {
            return Ok(Added::TooOld);
        }
        let kept = self.samples.add(&SampleFields {
            gpu_uuid: &row.gpu_uuid,
            ts_ms: row.ts_ms,
            interval_ms: row.interval_ms,
            host: &row.host,
            util_gpu_pct: row.util_gpu_pct,
            sm_active_pct: row.sm_active_pct,
            mem_used_bytes: i64::try_from(row.mem_used_bytes).unwrap_or(i64::MAX),
            lease_id: row.lease_id.as_deref(),
        });
        Ok(match kept {
            Kept::New => Added::Kept,
            Kept::Duplicate => Added::Merged,
        })
    }

    /// Decodes one lease event that arrived at `arrival_ms` and keeps it; `Ok(false)`: it is
    /// dated too far ahead of its arrival, and was dropped.
    pub fn add_lease_event(
        &mut self,
        payload: &[u8],
        arrival_ms: i64,
    ) -> Result<bool, DecodeError> {
        let event = LeaseEvent::from_json(payload)?;
        if self.bounds.check(event.ts_ms, arrival_ms, false).is_err() {
            return Ok(false);
        }
        self.events.push(event);
        self.leases_stale = true;
        Ok(true)
    }

    /// The event time the fleet has reached ([`FleetWatermark`]); it never moves back.
    pub fn watermark(&mut self) -> Option<i64> {
        if self.fleet_changed {
            self.fleet_changed = false;
            self.watermark = self.watermark.max(self.fleet.watermark());
        }
        self.watermark
    }

    /// The time signals are due for: the latest multiple of `every` the watermark has reached,
    /// if signals were not computed for it (or a later time) yet.
    pub fn due(&mut self) -> Option<i64> {
        self.watermark();
        let boundary = self.boundary()?;
        self.computed
            .is_none_or(|c| boundary > c)
            .then_some(boundary)
    }

    fn boundary(&self) -> Option<i64> {
        self.watermark
            .map(|w| w.div_euclid(self.every_ms) * self.every_ms)
    }

    /// Samples at or before this time count in no window still to be computed: the next
    /// computation is for the watermark's boundary or a later one.
    fn cutoff(&self) -> Option<i64> {
        self.boundary().map(|b| b - self.window_ms)
    }

    /// The hosts to report in `clock_skew` signals now: those with a sample out of bounds since
    /// their last report, reported at most once per `every` (in arrival time). Each comes with
    /// its skew and the arrival of its last refused sample, the signal's time.
    pub fn take_skewed(&mut self) -> Vec<(String, i64, i64)> {
        let every = self.every_ms;
        let mut out = Vec::new();
        for (host, skewed) in &mut self.skewed {
            let due = skewed
                .reported
                .is_none_or(|at| skewed.arrival_ms > at && skewed.arrival_ms - at >= every);
            if due {
                skewed.reported = Some(skewed.arrival_ms);
                out.push((host.clone(), skewed.skew_ms, skewed.arrival_ms));
            }
        }
        if let Some(newest) = self.newest_arrival {
            self.skewed
                .retain(|_, s| s.arrival_ms >= newest.saturating_sub(FORGET_ARRIVED_MS));
        }
        out.sort();
        out
    }

    /// The samples held.
    pub fn samples(&self) -> &SampleWindow {
        &self.samples
    }

    /// The samples held and every lease, for a computation.
    pub fn parts(&mut self) -> (&mut SampleWindow, &Leases) {
        self.leases();
        (&mut self.samples, &self.leases)
    }

    /// Every lease, rebuilt from all the events seen.
    pub fn leases(&mut self) -> &Leases {
        if self.leases_stale {
            self.leases = Leases::from_events(self.events.clone());
            self.leases_stale = false;
        }
        &self.leases
    }

    /// Records that signals for `ts_ms` are done, and drops the samples that can count in no
    /// later window and the hosts not heard from for an hour.
    pub fn computed(&mut self, ts_ms: i64) {
        self.computed = Some(self.computed.map_or(ts_ms, |c| c.max(ts_ms)));
        self.watermark();
        if let Some(cutoff) = self.cutoff() {
            self.samples.evict_through(cutoff);
        }
        if let Some(newest) = self.newest_arrival {
            self.fleet
                .forget_arrived_before(newest.saturating_sub(FORGET_ARRIVED_MS));
        }
    }

    /// Distinct samples held in memory.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether no sample is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Each team's month-to-date `cost_usd` from the `team_hourly` rollup, over the UTC month that
/// holds `ts_ms` (the open hour as the rollup last refreshed it). `(unallocated)` is no team and
/// is left out. A lake with no rollups gives an empty map.
pub async fn month_to_date(
    lake: &Lake,
    ts_ms: i64,
) -> Result<BTreeMap<String, f64>, DataFusionError> {
    let (start, end) = month_of(ts_ms);
    let ctx = SessionContext::new();
    let table = RollupTable::TeamHourly;
    lake.delta().register(
        &ctx,
        table.name(),
        &table.dir(),
        &table.schema(),
        crate::delta::AsOf::Latest,
    )?;
    let sql = format!(
        r#"SELECT team, CAST(sum(cost_usd) AS DOUBLE) AS cost_usd FROM team_hourly
           WHERE hour >= arrow_cast({start}, 'Timestamp(ms, "UTC")')
             AND hour < arrow_cast({end}, 'Timestamp(ms, "UTC")')
             AND team <> '{UNALLOCATED}'
           GROUP BY team"#
    );
    let mut spend = BTreeMap::new();
    for batch in ctx.sql(&sql).await?.collect().await? {
        let team = datafusion::arrow::compute::cast(batch.column(0), &DataType::Utf8)?;
        let team = team
            .as_any()
            .downcast_ref::<StringArray>()
            .ok_or_else(|| DataFusionError::Internal("team is not a string".into()))?;
        let cost = batch
            .column(1)
            .as_any()
            .downcast_ref::<Float64Array>()
            .ok_or_else(|| DataFusionError::Internal("cost_usd is not a double".into()))?;
        for i in 0..batch.num_rows() {
            if team.is_valid(i) && cost.is_valid(i) {
                spend.insert(team.value(i).to_owned(), cost.value(i));
            }
        }
    }
    Ok(spend)
}

/// Runs the signals loop until `stop` is set: waits for the lake's signals lock, then reads,
/// computes and publishes (see the module documentation). Returns an error only for what a
/// retry cannot fix (the Kafka settings, the lock file); Kafka being away is waited out.
pub fn run(
    client: &ClientConfig,
    lake: Lake,
    options: SignalsOptions,
    metrics: Arc<Metrics>,
    stop: Arc<AtomicBool>,
) -> Result<(), SignalsError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(SignalsError::Runtime)?;
    let mut standing_by = false;
    while !stop.load(Ordering::SeqCst) {
        let taken = match lake.try_lock(crate::lake::Role::Signals) {
            Ok(taken) => taken,
            // A bucket out of reach for a while: the role is tried again, as a held one is.
            Err(e @ LakeError::ObjectStore { .. }) => {
                tracing::warn!(error = %e, "cannot reach the lake to take the signals role; trying again");
                sleep_unless_stopped(options.lock_retry, &stop);
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let Some(lock) = taken else {
            if !standing_by {
                tracing::debug!(lake = %lake.location(), "another pipeline publishes signals for this lake; standing by");
                standing_by = true;
            }
            sleep_unless_stopped(options.lock_retry, &stop);
            continue;
        };
        tracing::info!(
            lock = %lock.path().display(),
            every_ms = options.every_ms,
            window_ms = options.window_ms,
            "this pipeline computes and publishes signals"
        );
        metrics.set_signals_leader(true);
        let result = Publisher::start(client, &lake, &options, &metrics, &stop)
            .map(|publisher| publisher.map(|p| p.run(&runtime, &stop, &lock)));
        metrics.set_signals_leader(false);
        metrics.set_window_samples(0);
        metrics.set_window_bytes(0);
        drop(lock);
        result?;
        // Stopped, or the role was lost (a bucket lock that lapsed): the latter stands
        // by again, and takes the role back when it is free.
        standing_by = false;
    }
    Ok(())
}

fn sleep_unless_stopped(duration: Duration, stop: &AtomicBool) {
    let until = Instant::now() + duration;
    while !stop.load(Ordering::SeqCst) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        std::thread::sleep(left.min(Duration::from_millis(100)));
    }
}

/// Counts deliveries: a signal is published once Kafka acknowledges it.
struct PublishContext {
    metrics: Arc<Metrics>,
    warnings: Mutex<Throttle>,
}

impl ClientContext for PublishContext {}

impl ProducerContext for PublishContext {
    /// The signal's kind, as [`signal_kind_index`].
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, kind: usize) {
        match result {
            Ok(_) => self.metrics.signal_published(kind),
            Err((e, _)) => {
                self.metrics.signal_failed(1);
                let ready = self
                    .warnings
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .ready();
                if let Some(held) = ready {
                    tracing::warn!(error = %e, more = held, "a signal was not delivered");
                }
            }
        }
    }
}

/// Month-to-date spend as last read from the lake.
#[derive(Debug, Default)]
struct Spend {
    month: Option<i64>,
    read_at: Option<Instant>,
    by_team: BTreeMap<String, f64>,
}

/// The end of each partition when reading started; the loop has caught up once it has read to
/// every one of them.
#[derive(Debug)]
struct CatchUp {
    ends: BTreeMap<(&'static str, i32), i64>,
    since: Instant,
    done: bool,
}

impl CatchUp {
    fn read(&mut self, topic: &'static str, partition: i32, offset: i64) {
        if self
            .ends
            .get(&(topic, partition))
            .is_some_and(|end| offset + 1 >= *end)
        {
            self.ends.remove(&(topic, partition));
        }
    }

    /// Whether the loop has caught up (logged once, when it happens).
    fn done(&mut self, window: &mut HotWindow) -> bool {
        if self.done {
            return true;
        }
        if self.ends.is_empty() || self.since.elapsed() >= CATCH_UP_LIMIT {
            self.done = true;
            tracing::info!(
                samples = window.len(),
                lease_events = window.events.len(),
                watermark = window.watermark(),
                behind = self.ends.len(),
                elapsed_ms = self.since.elapsed().as_millis() as u64,
                "signals: read what the topics held at the start"
            );
        }
        self.done
    }
}

struct Publisher<'a> {
    consumer: BaseConsumer,
    catch_up: CatchUp,
    producer: BaseProducer<PublishContext>,
    window: HotWindow,
    engine: SignalEngine,
    spend: Spend,
    lake: &'a Lake,
    options: &'a SignalsOptions,
    metrics: &'a Metrics,
    skipped: Throttle,
    read_errors: Throttle,
    send_errors: Throttle,
}

impl<'a> Publisher<'a> {
    /// Creates the clients and assigns the partitions; `Ok(None)` if stopped meanwhile.
    fn start(
        client: &ClientConfig,
        lake: &'a Lake,
        options: &'a SignalsOptions,
        metrics: &'a Arc<Metrics>,
        stop: &AtomicBool,
    ) -> Result<Option<Self>, SignalsError> {
        let mut consumer_config = client.clone();
        gpuwarden_schema::kafka::low_latency(&mut consumer_config)
            // Needed by librdkafka for a consumer; nothing joins this group or commits to it.
            .set("group.id", "gpuwarden-pipeline-signals")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest");
        let consumer: BaseConsumer = consumer_config.create()?;
        let producer: BaseProducer<PublishContext> =
            client.create_with_context(PublishContext {
                metrics: Arc::clone(metrics),
                warnings: Mutex::default(),
            })?;
        let mut publisher = Self {
            consumer,
            catch_up: CatchUp {
                ends: BTreeMap::new(),
                since: Instant::now(),
                done: false,
            },
            producer,
            window: HotWindow::new(
                options.every_ms,
                options.window_ms,
                options.idle_ms,
                options.bounds,
            ),
            engine: SignalEngine::new(),
            spend: Spend::default(),
            lake,
            options,
            metrics,
            skipped: Throttle::default(),
            read_errors: Throttle::default(),
            send_errors: Throttle::default(),
        };
        Ok(publisher.assign(stop).then_some(publisher))
    }

    /// Assigns every partition of both topics, retrying while Kafka cannot say what they are.
    /// `false` if stopped first.
    fn assign(&mut self, stop: &AtomicBool) -> bool {
        while !stop.load(Ordering::SeqCst) {
            match self.try_assign() {
                Ok(()) => return true,
                Err(e) => {
                    if let Some(more) = self.read_errors.ready() {
                        tracing::warn!(error = %e, more, "cannot assign the partitions signals read; retrying");
                    }
                }
            }
            sleep_unless_stopped(Duration::from_secs(2), stop);
        }
        false
    }

    fn try_assign(&mut self) -> Result<(), KafkaError> {
        let sample_partitions = partitions(&self.consumer, topics::SAMPLES)?;
        let lease_partitions = partitions(&self.consumer, topics::LEASES)?;
        let from = crate::consume::wall_ms() - self.options.window_ms - READ_MARGIN_MS;
        let starts: Vec<(&'static str, i32, Offset)> =
            sample_offsets(&self.consumer, &sample_partitions, from)
                .into_iter()
                .map(|(p, o)| (topics::SAMPLES, p, o))
                .chain(
                    lease_partitions
                        .iter()
                        .map(|p| (topics::LEASES, *p, Offset::Beginning)),
                )
                .collect();
        let mut assignment = TopicPartitionList::new();
        let mut ends = BTreeMap::new();
        for &(topic, partition, start) in &starts {
            assignment.add_partition_offset(topic, partition, start)?;
            match self
                .consumer
                .fetch_watermarks(topic, partition, KAFKA_TIMEOUT)
            {
                Ok((low, high)) => {
                    let first = match start {
                        Offset::Offset(o) => o,
                        Offset::Beginning => low,
                        _ => high,
                    };
                    if high > first {
                        ends.insert((topic, partition), high);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, topic, partition, "cannot read a partition's end; not waiting to catch up with it")
                }
            }
        }
        self.consumer.assign(&assignment)?;
        self.catch_up = CatchUp {
            ends,
            since: Instant::now(),
            done: false,
        };
        tracing::info!(
            samples_from_wall_ms = from,
            starts = ?starts,
            "signals: reading samples and leases"
        );
        Ok(())
    }

    /// Publishes until `stop` is set or `lock` is lost (its bucket lock lapsed or was
    /// taken over): then another process publishes, and this one stops before its next signal.
    fn run(mut self, runtime: &tokio::runtime::Runtime, stop: &AtomicBool, lock: &LakeLock) {
        let mut last_check = Instant::now();
        while !stop.load(Ordering::SeqCst) {
            if let Err(e) = lock.check("publishing signals") {
                tracing::warn!(error = %e, "this pipeline stops publishing signals");
                break;
            }
            let full = self.poll() == POLL_BATCH;
            self.producer.poll(Duration::ZERO);
            for (host, skew_ms, ts_ms) in self.window.take_skewed() {
                tracing::warn!(host, skew_ms, "a host's clock is wrong: its samples' time is out of bounds (pipeline.clock); they are skipped here and quarantined by ingest");
                self.publish(&Signal {
                    v: gpuwarden_schema::V1,
                    ts_ms,
                    window_ms: self.options.every_ms,
                    body: SignalBody::ClockSkew { host, skew_ms },
                });
            }
            // While catching up (a full turn), compute at most once a second: the signals of
            // boundaries passed on the way are out of date before they are published.
            let due = self.window.due();
            self.metrics.set_signals_watermark(self.window.watermark());
            if let Some(ts) = due {
                let caught_up = self.catch_up.done(&mut self.window);
                if caught_up && (!full || last_check.elapsed() >= Duration::from_secs(1)) {
                    self.compute(runtime, ts);
                    last_check = Instant::now();
                }
            }
            self.metrics.set_window_samples(self.window.len());
        }
        let unsent = self.producer.in_flight_count();
        if let Err(e) = self.producer.flush(Duration::from_secs(5)) {
            let lost = self.producer.in_flight_count();
            tracing::warn!(error = %e, unsent, lost, "signals not delivered before shutdown");
            self.metrics
                .signal_failed(u64::try_from(lost).unwrap_or_default());
        }
        tracing::info!(
            watermark = self.window.watermark(),
            "signals stopped; what was computed is delivered"
        );
    }

    /// Handles up to [`POLL_BATCH`] messages: waits up to 100 ms for the first, then takes what
    /// is already there. Returns how many it took.
    fn poll(&mut self) -> usize {
        for n in 0..POLL_BATCH {
            let wait = if n == 0 {
                Duration::from_millis(100)
            } else {
                Duration::ZERO
            };
            let message = match self.consumer.poll(wait) {
                None => return n,
                Some(Ok(message)) => message,
                Some(Err(e)) => {
                    if let Some(more) = self.read_errors.ready() {
                        tracing::warn!(error = %e, more, "reading samples and leases for signals failed; retrying");
                    }
                    return n;
                }
            };
            let payload = message.payload().unwrap_or_default();
            let arrival = arrival_of_message(&*self.options.clock, message.timestamp());
            let result = match message.topic() {
                topics::SAMPLES => {
                    self.catch_up
                        .read(topics::SAMPLES, message.partition(), message.offset());
                    self.window.add_sample(payload, arrival).map(|added| {
                        if let Added::OutOfBounds(_) = added {
                            self.metrics.signals_out_of_bounds();
                        }
                    })
                }
                topics::LEASES => {
                    self.catch_up
                        .read(topics::LEASES, message.partition(), message.offset());
                    // A forged lease event would otherwise charge a team in `team_spend`.
                    if self.options.signing.refusal(&message).is_some() {
                        if let Some(more) = self.skipped.ready() {
                            tracing::warn!(partition = message.partition(), offset = message.offset(), more, "a lease event not signed with the signing key is skipped (ingest quarantines it)");
                        }
                        continue;
                    }
                    self.window.add_lease_event(payload, arrival).map(|kept| {
                        if !kept {
                            if let Some(more) = self.skipped.ready() {
                                tracing::warn!(partition = message.partition(), offset = message.offset(), more, "a lease event dated too far ahead of its arrival is skipped (ingest quarantines it)");
                            }
                        }
                    })
                }
                _ => Ok(()),
            };
            if let Err(e) = result {
                if let Some(more) = self.skipped.ready() {
                    tracing::warn!(
                        error = %e,
                        topic = message.topic(),
                        partition = message.partition(),
                        offset = message.offset(),
                        more,
                        "signals skip an invalid record (ingest quarantines it)"
                    );
                }
            }
        }
        POLL_BATCH
    }

    /// Computes and publishes the signals for `ts`; a failure is logged and that time skipped.
    fn compute(&mut self, runtime: &tokio::runtime::Runtime, ts: i64) {
        let started = Instant::now();
        self.refresh_spend(runtime, ts);
        let (samples, leases) = self.window.parts();
        let period = Period {
            ts_ms: ts,
            window_ms: self.options.window_ms,
            leases,
            month_to_date_usd: &self.spend.by_team,
            pricing: &self.options.pricing,
            idle_measures: &self.options.idle_measures,
            release_grace_ms: self.options.every_ms,
        };
        let signals = self.engine.signals(samples, &period);
        for signal in &signals {
            self.publish(signal);
        }
        tracing::debug!(
            ts_ms = ts,
            signals = signals.len(),
            samples = self.window.len(),
            buckets = self.window.samples().buckets(),
            "signals computed"
        );
        self.window.computed(ts);
        self.metrics
            .signals_computed(started.elapsed().as_secs_f64(), true);
        self.metrics.set_window_bytes(self.window.samples().bytes());
    }

    fn refresh_spend(&mut self, runtime: &tokio::runtime::Runtime, ts: i64) {
        let month = month_of(ts).0;
        let fresh = self.spend.month == Some(month)
            && self
                .spend
                .read_at
                .is_some_and(|t| t.elapsed() < self.options.spend_refresh);
        if fresh {
            return;
        }
        match runtime.block_on(month_to_date(self.lake, ts)) {
            Ok(by_team) => self.spend.by_team = by_team,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read month-to-date spend from team_hourly; keeping the last figures");
                if self.spend.month != Some(month) {
                    self.spend.by_team.clear();
                }
            }
        }
        self.spend.month = Some(month);
        self.spend.read_at = Some(Instant::now());
    }

    fn publish(&mut self, signal: &Signal) {
        let payload = signal.to_json();
        let kind = signal_kind_index(signal.body.kind());
        let key = signal.key();
        let mut record = BaseRecord::with_opaque_to(topics::SIGNALS, kind)
            .key(key)
            .payload(&payload);
        if let Some(headers) =
            self.options
                .signing
                .headers(topics::SIGNALS, key.as_bytes(), &payload)
        {
            record = record.headers(headers);
        }
        // A full queue drains as the producer is polled; give it up to a second.
        for _ in 0..100 {
            match self.producer.send(record) {
                Ok(()) => return,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    self.producer.poll(Duration::from_millis(10));
                }
                Err((e, _)) => {
                    self.metrics.signal_failed(1);
                    if let Some(more) = self.send_errors.ready() {
                        tracing::warn!(error = %e, more, "cannot publish a signal");
                    }
                    return;
                }
            }
        }
        self.metrics.signal_failed(1);
        if let Some(more) = self.send_errors.ready() {
            tracing::warn!(
                more,
                "cannot publish a signal: the producer's queue stayed full"
            );
        }
    }
}

/// The partitions of `topic`.
fn partitions(consumer: &BaseConsumer, topic: &str) -> Result<Vec<i32>, KafkaError> {
    let metadata = consumer.fetch_metadata(Some(topic), KAFKA_TIMEOUT)?;
    let mut ids = Vec::new();
    for t in metadata.topics() {
        if let Some(e) = t.error() {
            return Err(KafkaError::MetadataFetch(e.into()));
        }
        ids.extend(t.partitions().iter().map(|p| p.id()));
    }
    if ids.is_empty() {
        return Err(KafkaError::MetadataFetch(
            RDKafkaErrorCode::UnknownTopicOrPartition,
        ));
    }
    ids.sort_unstable();
    Ok(ids)
}

/// Where to start reading each samples partition: the first record stamped at or after
/// `from_ms`, the end when there is none, the beginning when the broker cannot say.
fn sample_offsets(consumer: &BaseConsumer, partitions: &[i32], from_ms: i64) -> Vec<(i32, Offset)> {
    let lookup = |ts: i64| -> Option<BTreeMap<i32, Offset>> {
        let mut query = TopicPartitionList::new();
        for p in partitions {
            query
                .add_partition_offset(topics::SAMPLES, *p, Offset::Offset(ts))
                .ok()?;
        }
        match consumer.offsets_for_times(query, KAFKA_TIMEOUT) {
            Ok(answer) => Some(
                answer
                    .elements()
                    .iter()
                    .filter(|e| e.error().is_ok())
                    .map(|e| (e.partition(), e.offset()))
                    .collect(),
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cannot look up sample offsets by time; reading samples from the beginning");
                None
            }
        }
    };
    let found = lookup(from_ms).unwrap_or_default();
    // "No record at or after the time" is also what a broker that cannot look offsets up by
    // time answers (librdkafka's mock cluster, which `gpuwarden broker` runs). Asking for the
    // epoch tells them apart: every record of a partition is at or after it.
    let mut probe: Option<BTreeMap<i32, Offset>> = None;
    partitions
        .iter()
        .map(|p| {
            let offset = match found.get(p) {
                Some(Offset::Offset(o)) => Offset::Offset(*o),
                Some(Offset::End) => {
                    let probe = probe.get_or_insert_with(|| lookup(0).unwrap_or_default());
                    match probe.get(p) {
                        Some(Offset::Offset(_)) => Offset::End,
                        // Empty, or no lookup by time: from the beginning is right for both.
                        _ => Offset::Beginning,
                    }
                }
                _ => Offset::Beginning,
            };
            (*p, offset)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000;

    fn sample(gpu: &str, ts_ms: i64) -> Vec<u8> {
        serde_json::json!({"v": 1, "ts_ms": ts_ms, "interval_ms": 10_000, "host": "h",
            "gpu_uuid": gpu, "gpu_model": "M", "util_gpu_pct": 50.0,
            "mem_used_bytes": 1, "mem_total_bytes": 2})
        .to_string()
        .into_bytes()
    }

    fn window(every: i64, length: i64) -> HotWindow {
        HotWindow::new(every, length, 5 * 60 * S, Bounds::none())
    }

    /// Added, arriving when it was taken.
    fn add(w: &mut HotWindow, gpu: &str, ts: i64) -> Added {
        w.add_sample(&sample(gpu, ts), ts).unwrap()
    }

    #[test]
    fn signals_are_due_at_the_latest_boundary_the_watermark_passed() {
        let mut w = window(30 * S, 120 * S);
        assert_eq!(w.due(), None, "no samples, no event time");
        assert_eq!(add(&mut w, "g", 29 * S), Added::Kept);
        assert_eq!(w.due(), Some(0));
        w.computed(0);
        assert_eq!(w.due(), None);
        add(&mut w, "g", 59 * S);
        assert_eq!(w.due(), Some(30 * S));
        // Two boundaries passed at once: only the latest is due.
        add(&mut w, "g", 95 * S);
        assert_eq!(w.due(), Some(90 * S));
        // A late sample does not move the watermark back.
        add(&mut w, "g", 40 * S);
        assert_eq!((w.watermark(), w.due()), (Some(95 * S), Some(90 * S)));
        w.computed(90 * S);
        assert_eq!(w.due(), None);
        assert!(w.add_sample(b"{\"v\":1}", 0).is_err());
    }

    fn host_sample(host: &str, ts_ms: i64) -> Vec<u8> {
        serde_json::json!({"v": 1, "ts_ms": ts_ms, "interval_ms": 10_000, "host": host,
            "gpu_uuid": format!("GPU-{host}"), "gpu_model": "M", "util_gpu_pct": 50.0,
            "mem_used_bytes": 1, "mem_total_bytes": 2})
        .to_string()
        .into_bytes()
    }

    #[test]
    fn a_sample_from_a_wrong_clock_is_refused_reported_and_moves_nothing() {
        const DAY: i64 = 86_400 * S;
        let t = 1_796_400_000_000;
        let mut w = HotWindow::new(
            30 * S,
            120 * S,
            5 * 60 * S,
            Bounds::streaming(&gpuwarden_schema::config::ClockBounds::default()),
        );
        for host in ["a", "b", "c"] {
            assert_eq!(w.add_sample(&host_sample(host, t), t).unwrap(), Added::Kept);
        }
        assert_eq!(w.due(), Some(t));
        let added = w
            .add_sample(&host_sample("wrong", t + 400 * DAY), t + S)
            .unwrap();
        assert!(matches!(added, Added::OutOfBounds(e) if e.skew_ms() == 400 * DAY - S));
        // Two minutes ahead is within the bounds: kept, yet the fleet's time stays the fleet's.
        assert_eq!(
            w.add_sample(&host_sample("fast", t + 120 * S), t + S)
                .unwrap(),
            Added::Kept
        );
        assert_eq!((w.watermark(), w.due()), (Some(t), Some(t)));
        assert_eq!(w.len(), 4);
        assert_eq!(
            w.take_skewed(),
            vec![("wrong".to_string(), 400 * DAY - S, t + S)]
        );
        // Reported once per `every` of arrival time while it lasts.
        w.add_sample(&host_sample("wrong", t + 400 * DAY), t + 2 * S)
            .unwrap();
        assert_eq!(w.take_skewed(), vec![]);
        w.add_sample(&host_sample("wrong", t + 400 * DAY), t + 40 * S)
            .unwrap();
        assert_eq!(
            w.take_skewed(),
            vec![("wrong".to_string(), 400 * DAY - 40 * S, t + 40 * S)]
        );
        // A lease event from the future is not kept either.
        let event = serde_json::json!({"v": 1, "ts_ms": t + 400 * DAY, "event": "granted",
            "lease_id": "L", "team": "t", "user": "u", "project": "p", "workload": "batch",
            "substrate": "s", "gpu_model": "M", "gpu_count": 1, "gpu_uuids": ["g"]});
        assert!(!w.add_lease_event(event.to_string().as_bytes(), t).unwrap());
        assert_eq!(w.leases().len(), 0);
    }

    #[test]
    fn a_host_that_falls_silent_holds_signals_back_for_its_idle_timeout_at_most() {
        let t = 1_796_400_000_000;
        let mut w = window(30 * S, 120 * S);
        for host in ["a", "b", "quiet"] {
            w.add_sample(&host_sample(host, t), t).unwrap();
        }
        let mut held = 0;
        for step in 1..=20 {
            let now = t + step * 30 * S;
            for host in ["a", "b"] {
                w.add_sample(&host_sample(host, now), now).unwrap();
            }
            if w.watermark() == Some(t) {
                held = step * 30 * S;
            } else {
                assert_eq!(w.watermark(), Some(now));
            }
        }
        assert_eq!(
            held,
            5 * 60 * S,
            "held by the silent host for exactly idle_timeout"
        );
    }

    #[test]
    fn batches_that_no_later_window_can_use_are_dropped() {
        let mut w = window(30 * S, 60 * S);
        for t in (10..=100).step_by(10) {
            add(&mut w, "g", t * S);
            if let Some(ts) = w.due() {
                w.computed(ts);
            }
        }
        // Computed at 90 s: the next window is (90 s − 60 s, …], so samples up to 30 s go
        // (the minute bucket that holds 30 s keeps its later samples).
        let held = w.samples().timestamps();
        assert_eq!(
            held,
            vec![40 * S, 50 * S, 60 * S, 70 * S, 80 * S, 90 * S, 100 * S]
        );
        assert_eq!(w.len(), 7);
        // Samples that old are not kept at all.
        assert_eq!(add(&mut w, "g", 30 * S), Added::TooOld);
        assert_eq!(add(&mut w, "g", 31 * S), Added::Kept);
        assert_eq!(w.len(), 8);
        // A copy is merged into the sample it repeats.
        assert_eq!(add(&mut w, "g", 31 * S), Added::Merged);
        assert_eq!((w.len(), w.samples().buckets()), (8, 2));
    }

    #[test]
    fn leases_are_rebuilt_from_every_event() {
        let mut w = window(30 * S, 60 * S);
        let event = |kind: &str, ts: i64| {
            let mut e = serde_json::json!({"v": 1, "ts_ms": ts, "event": kind, "lease_id": "L",
                "team": "t", "user": "u", "project": "p", "workload": "batch",
                "substrate": "s", "gpu_model": "M", "gpu_count": 1, "gpu_uuids": ["g"]});
            if kind == "released" {
                e["reason"] = serde_json::json!("user");
            }
            e.to_string().into_bytes()
        };
        w.add_lease_event(&event("granted", 0), 0).unwrap();
        assert_eq!(w.leases().len(), 1);
        assert!(w.leases().get("L").unwrap().released.is_none());
        w.add_lease_event(&event("released", 10), 10).unwrap();
        assert_eq!(
            w.leases().get("L").unwrap().released.as_ref().map(|r| r.0),
            Some(10)
        );
        assert!(w.add_lease_event(b"{}", 0).is_err());
    }
}
