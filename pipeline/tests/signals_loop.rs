//! The signals loop ([`gpuwarden_pipeline::hot`]) against a real Kafka-protocol broker
//! (librdkafka's mock cluster): lease events and samples produced to their topics come back as
//! signals on gpuwarden.signals, with month-to-date spend from the lake's `team_hourly`; one
//! instance per lake publishes; the loop stops on its flag.
//!
//! T0 = 2026-11-30T00:00Z; every 30 s, window 15 min; samples every 10 s.
//! - L-idle (ml, notebook, H100, g-idle) and L-busy (ds, training, A100, g-busy) granted at
//!   T0 − 10 min; L-gone (ops, g-gone) granted and released before T0. Notebooks are judged idle
//!   by SM activity, everything else by utilization.
//! - Phase 1, k = 10..=60 s: g-idle spins (util 100 %, SM active 2 %: GPM, an H100), g-busy
//!   80 %, g-rogue (no lease) 90 %, g-gone 70 % naming L-gone (its lease is closed:
//!   unattributed), and one invalid record. Signals at T0+60 s: L-idle util 100, SM active 2,
//!   judged by `sm_active`, idle since T0+10 s → 50,000 ms; L-busy util 80, no SM activity,
//!   judged by `util`, idle 0; g-rogue 90 and
//!   g-gone 70 unattributed; ml spent 100 $ this month (not the 1,000 $ of October, nor the
//!   `(unallocated)` 7 $), burns 4 $/h (1 H100); ds 20.5 $, burns 1.5 $/h (the default price).
//! - Phase 2, k = 65, 75, 85 s, all at 0 % but g-rogue, and a sample of host-wrong dated 400 days
//!   ahead (refused, reported in a clock_skew signal); then samples at 95 s of the three hosts
//!   still reporting move the fleet's watermark past T0+90 s. g-gone's host went silent at 60 s:
//!   it stops holding the watermark once 20 s (these tests' idle timeout) behind the median
//!   host. L-busy: util 6×80/9 = 53.333, idle since T0+65 s → 25,000 ms; L-idle (spinning
//!   still) 80,000 ms;
//!   g-gone's samples are still in the window.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arrow_array::{
    ArrayRef, BooleanArray, Float64Array, RecordBatch, StringArray, TimestampMillisecondArray,
};
use arrow_schema::DataType;
use gpuwarden_pipeline::bounds::Bounds;
use gpuwarden_pipeline::hot::{self, SignalsOptions};
use gpuwarden_pipeline::{Lake, Metrics};
use gpuwarden_schema::config::{GpuPrice, IdleMeasure, PricingConfig};
use gpuwarden_schema::kafka::EmbeddedBroker;
use gpuwarden_schema::signal::JudgedBy;
use gpuwarden_schema::signing::{self, SigningKeys, Verdict};
use gpuwarden_schema::{topics, Record, Signal, SignalBody, SystemClock, Workload};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers as _, Message};
use rdkafka::{Offset, TopicPartitionList};
use support::{client, produce, produce_signed};

const T0: i64 = 1_795_996_800_000;
const S: i64 = 1_000;
const DAY: i64 = 86_400 * S;
const WINDOW: i64 = 15 * 60 * S;
/// `pipeline.clock.idle_timeout`.
const IDLE: i64 = 20 * S;
const H100: &str = "NVIDIA H100 80GB HBM3";
const A100: &str = "NVIDIA A100-SXM4-80GB";

/// g-idle, an H100, reports GPM: it spins, at 2 % SM activity whatever its utilization.
fn sample(gpu: &str, at: i64, util: f64, lease: Option<&str>) -> (String, Vec<u8>) {
    let model = if gpu == "g-idle" { H100 } else { A100 };
    let mut json = serde_json::json!({"v": 1, "ts_ms": T0 + at, "interval_ms": 10_000,
        "host": format!("host-{gpu}"), "gpu_uuid": gpu, "gpu_model": model,
        "util_gpu_pct": util, "mem_used_bytes": 1_000 + at / S, "mem_total_bytes": 1_000_000,
        "lease_id": lease});
    if gpu == "g-idle" {
        json["sm_active_pct"] = serde_json::json!(2.0);
    }
    (gpu.to_string(), json.to_string().into_bytes())
}

fn lease_event(
    at: i64,
    kind: &str,
    lease: &str,
    team: &str,
    model: &str,
    gpu: &str,
) -> (String, Vec<u8>) {
    let workload = if lease == "L-idle" {
        "notebook"
    } else {
        "training"
    };
    let mut e = serde_json::json!({"v": 1, "ts_ms": T0 + at, "event": kind, "lease_id": lease,
        "team": team, "user": "u", "project": "p", "workload": workload, "substrate": "sim",
        "gpu_model": model, "gpu_count": 1, "gpu_uuids": [gpu]});
    if kind == "released" {
        e["reason"] = serde_json::json!("user");
    }
    (lease.to_string(), e.to_string().into_bytes())
}

/// `team_hourly` rows as the rollups write them: (hour, team, cost). The signals read only
/// `hour`, `team` and `cost_usd`: every other column is null where it may be, else zero, true
/// or `H100`, whatever columns the table has.
fn write_team_hourly(lake: &Lake, rows: &[(i64, &str, f64)]) {
    let schema = gpuwarden_pipeline::RollupTable::TeamHourly.schema();
    let n = rows.len();
    let columns: Vec<ArrayRef> = schema
        .fields()
        .iter()
        .map(|f| -> ArrayRef {
            match (f.name().as_str(), f.data_type()) {
                ("hour", _) => Arc::new(
                    TimestampMillisecondArray::from(rows.iter().map(|r| r.0).collect::<Vec<_>>())
                        .with_timezone("UTC"),
                ),
                ("team", _) => Arc::new(StringArray::from(
                    rows.iter().map(|r| r.1).collect::<Vec<_>>(),
                )),
                ("cost_usd", _) => Arc::new(Float64Array::from(
                    rows.iter().map(|r| r.2).collect::<Vec<_>>(),
                )),
                (_, t) if f.is_nullable() => arrow_array::new_null_array(t, n),
                (_, DataType::Float64) => Arc::new(Float64Array::from(vec![0.0; n])),
                (_, DataType::Boolean) => Arc::new(BooleanArray::from(vec![true; n])),
                (_, DataType::Utf8) => Arc::new(StringArray::from(vec![H100; n])),
                (name, t) => panic!("team_hourly.{name}: no test value for {t}"),
            }
        })
        .collect();
    let batch = RecordBatch::try_new(schema, columns).unwrap();
    // Committed to the Delta table as the rollups commit, from a thread of its own: the tests
    // call this from inside their runtime.
    let table = gpuwarden_pipeline::RollupTable::TeamHourly;
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(
                    lake.delta()
                        .replace(&table.dir(), &table.schema(), None, Some(&batch)),
                )
                .unwrap()
        })
        .join()
        .unwrap()
    });
}

fn options() -> SignalsOptions {
    SignalsOptions {
        every_ms: 30 * S,
        window_ms: WINDOW,
        pricing: PricingConfig {
            gpu: vec![GpuPrice {
                model_match: "H100".into(),
                usd_per_gpu_hour: 4.0,
            }],
            default_usd_per_gpu_hour: 1.5,
            idle_util_pct: 5.0,
            idle_sm_active_pct: 5.0,
            ..PricingConfig::default()
        },
        idle_measures: BTreeMap::from([(Workload::Notebook, IdleMeasure::SmActive)]),
        spend_refresh: Duration::from_secs(60),
        lock_retry: Duration::from_millis(200),
        // The tests' samples are dated around T0, days ago: history is let through; the future
        // is not.
        bounds: Bounds {
            max_ahead_ms: 5 * 60 * S,
            max_age_ms: None,
        },
        idle_ms: IDLE,
        clock: Arc::new(SystemClock),
        signing: SigningKeys::new(Some(SIGNING_KEY), None),
    }
}

/// The key the loop signs with.
const SIGNING_KEY: &[u8] = b"signals-loop-test-key-of-32-bytes-or-more";

/// The signals loop on a thread of its own.
struct Loop {
    metrics: Arc<Metrics>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Loop {
    fn start(bootstrap: &str, lake: &Lake) -> Self {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
        let metrics = Arc::new(Metrics::default());
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (client, lake, metrics, stop) = (
                client(bootstrap),
                lake.clone(),
                Arc::clone(&metrics),
                Arc::clone(&stop),
            );
            std::thread::spawn(move || hot::run(&client, lake, options(), metrics, stop).unwrap())
        };
        Self {
            metrics,
            stop,
            thread: Some(thread),
        }
    }

    /// Sets the stop flag and returns how long the loop took to end.
    fn stop(&mut self) -> Duration {
        let asked = Instant::now();
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
        asked.elapsed()
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Reads gpuwarden.signals from the beginning, outside any group.
struct Signals {
    consumer: BaseConsumer,
    seen: Vec<(String, Signal)>,
}

impl Signals {
    fn open(bootstrap: &str) -> Self {
        let consumer: BaseConsumer = client(bootstrap)
            .set("group.id", "signals-loop-test")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut assignment = TopicPartitionList::new();
        for p in 0..2 {
            assignment
                .add_partition_offset(topics::SIGNALS, p, Offset::Beginning)
                .unwrap();
        }
        consumer.assign(&assignment).unwrap();
        Self {
            consumer,
            seen: Vec::new(),
        }
    }

    /// Reads until `n` signals for `ts_ms` have arrived; returns them (by key).
    fn wait_for(&mut self, ts_ms: i64, n: usize, timeout: Duration) -> BTreeMap<String, Signal> {
        let until = Instant::now() + timeout;
        loop {
            let at: BTreeMap<String, Signal> = self
                .seen
                .iter()
                .filter(|(_, s)| s.ts_ms == ts_ms)
                .map(|(k, s)| (k.clone(), s.clone()))
                .collect();
            if at.len() >= n {
                return at;
            }
            assert!(
                Instant::now() < until,
                "{} of {n} signals for {ts_ms} within {timeout:?}; all so far: {:#?}",
                at.len(),
                self.seen
            );
            self.read(Duration::from_millis(100));
        }
    }

    /// Reads what arrives within `wait`.
    fn read(&mut self, wait: Duration) {
        while let Some(message) = self.consumer.poll(wait) {
            let message = message.unwrap();
            let key = String::from_utf8(message.key().unwrap().to_vec()).unwrap();
            // Every signal is signed over its topic, key and payload.
            let header = message
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == signing::HEADER))
                .and_then(|h| h.value);
            let verdict = SigningKeys::new(Some(SIGNING_KEY), None).verify(
                topics::SIGNALS,
                key.as_bytes(),
                message.payload().unwrap(),
                header,
            );
            assert_eq!(verdict, Verdict::Current, "signal {key}");
            let signal = Signal::from_json(message.payload().unwrap()).unwrap();
            self.seen.push((key, signal));
        }
    }

    /// Reads until `n` signals of `kind` have arrived; returns them.
    fn wait_for_kind(&mut self, kind: &str, n: usize, timeout: Duration) -> Vec<Signal> {
        let until = Instant::now() + timeout;
        loop {
            let of_kind: Vec<Signal> = self
                .seen
                .iter()
                .filter(|(_, s)| s.body.kind() == kind)
                .map(|(_, s)| s.clone())
                .collect();
            if of_kind.len() >= n {
                return of_kind;
            }
            assert!(
                Instant::now() < until,
                "{} of {n} {kind} signals within {timeout:?}; all so far: {:#?}",
                of_kind.len(),
                self.seen
            );
            self.read(Duration::from_millis(100));
        }
    }

    fn count(&self, kind: &str) -> u64 {
        self.seen
            .iter()
            .filter(|(_, s)| s.body.kind() == kind)
            .count() as u64
    }

    /// Signals of `kind` for distinct (key, time): a standby that takes over computes the
    /// latest boundary again, and may publish it before the reader stops.
    fn distinct(&self, kind: &str) -> u64 {
        self.seen
            .iter()
            .filter(|(_, s)| s.body.kind() == kind)
            .map(|(key, s)| (key, s.ts_ms))
            .collect::<std::collections::BTreeSet<_>>()
            .len() as u64
    }
}

type Utilization = (String, f64, i64, u32, u32, Option<f64>, Option<JudgedBy>);

fn lease_utilization(s: &Signal) -> Utilization {
    match &s.body {
        SignalBody::LeaseUtilization {
            team,
            util_pct,
            idle_ms,
            gpus_active,
            gpus_total,
            sm_active_pct,
            idle_measure,
            ..
        } => (
            team.clone(),
            (util_pct * 1000.0).round() / 1000.0,
            *idle_ms,
            *gpus_active,
            *gpus_total,
            *sm_active_pct,
            *idle_measure,
        ),
        other => panic!("not a lease_utilization: {other:?}"),
    }
}

#[test]
fn leases_and_samples_come_back_as_signals_from_one_publisher_until_it_stops() {
    let broker = EmbeddedBroker::start(2).unwrap();
    let bootstrap = broker.bootstrap_servers().to_string();
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path().join("lake")).unwrap();
    let october = T0 - 40 * 24 * 3_600 * S;
    write_team_hourly(
        &lake,
        &[
            (T0 - 3_600 * S, "ml", 60.0),
            (T0 - 7_200 * S, "ml", 40.0),
            (T0 - 3_600 * S, "ds", 20.5),
            (T0 - 3_600 * S, "(unallocated)", 7.0),
            (october, "ml", 1_000.0),
        ],
    );

    produce_signed(
        &bootstrap,
        topics::LEASES,
        &[
            lease_event(-600 * S, "granted", "L-idle", "ml", H100, "g-idle"),
            lease_event(-600 * S, "granted", "L-busy", "ds", A100, "g-busy"),
            lease_event(-600 * S, "granted", "L-gone", "ops", A100, "g-gone"),
            lease_event(-300 * S, "released", "L-gone", "ops", A100, "g-gone"),
        ],
        Some(&SigningKeys::new(Some(SIGNING_KEY), None)),
    );
    // A forged grant, unsigned: were it counted, g-rogue would be L-forged's and ds would be
    // charged for it.
    produce(
        &bootstrap,
        topics::LEASES,
        &[lease_event(
            -600 * S,
            "granted",
            "L-forged",
            "ds",
            H100,
            "g-rogue",
        )],
    );
    let mut phase1 = Vec::new();
    for k in 1..=6 {
        let at = k * 10 * S;
        phase1.push(sample("g-idle", at, 100.0, None));
        phase1.push(sample("g-busy", at, 80.0, None));
        phase1.push(sample("g-rogue", at, 90.0, None));
        phase1.push(sample("g-gone", at, 70.0, Some("L-gone")));
    }
    phase1.push(("g-bad".into(), br#"{"v":1,"ts_ms":"noon"}"#.to_vec()));
    produce(&bootstrap, topics::SAMPLES, &phase1);

    let mut publisher = Loop::start(&bootstrap, &lake);
    let mut signals = Signals::open(&bootstrap);
    let at60 = signals.wait_for(T0 + 60 * S, 6, Duration::from_secs(15));
    assert_eq!(
        at60.keys().collect::<Vec<_>>(),
        ["L-busy", "L-idle", "ds", "g-gone", "g-rogue", "ml"],
        "keyed by lease, GPU and team"
    );
    let (sm, util) = (Some(JudgedBy::SmActive), Some(JudgedBy::Util));
    assert_eq!(
        lease_utilization(&at60["L-idle"]),
        ("ml".into(), 100.0, 50_000, 0, 1, Some(2.0), sm)
    );
    assert_eq!(
        lease_utilization(&at60["L-busy"]),
        ("ds".into(), 80.0, 0, 1, 1, None, util)
    );
    let unattributed = |gpu: &str, util: f64| SignalBody::GpuUnattributed {
        gpu_uuid: gpu.into(),
        host: format!("host-{gpu}"),
        util_pct: util,
    };
    assert_eq!(at60["g-rogue"].body, unattributed("g-rogue", 90.0));
    assert_eq!(at60["g-gone"].body, unattributed("g-gone", 70.0));
    let spend = |team: &str, mtd: f64, burn: f64| SignalBody::TeamSpend {
        team: team.into(),
        month_to_date_usd: mtd,
        burn_usd_per_hour: burn,
    };
    assert_eq!(at60["ml"].body, spend("ml", 100.0, 4.0));
    assert_eq!(at60["ds"].body, spend("ds", 20.5, 1.5));
    for (_, s) in &signals.seen {
        assert_eq!(s.window_ms, WINDOW);
        assert_eq!(s.ts_ms, T0 + 60 * S, "only the latest boundary is computed");
    }

    // A second instance on the same lake stands by while the first holds the lock.
    let mut standby = Loop::start(&bootstrap, &lake);
    std::thread::sleep(Duration::from_millis(500));
    assert!(publisher.metrics.signals_leader());
    assert!(!standby.metrics.signals_leader());
    assert_eq!(standby.metrics.signal_computations_total(), 0);

    // Live: more samples, one from a host whose clock is 400 days ahead, then those that move
    // the fleet's watermark past T0+90 s.
    let mut phase2 = Vec::new();
    for at in [65 * S, 75 * S, 85 * S] {
        phase2.push(sample("g-idle", at, 100.0, None));
        phase2.push(sample("g-busy", at, 0.0, None));
        phase2.push(sample("g-rogue", at, 90.0, None));
    }
    let wall_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let wrong = serde_json::json!({"v": 1, "ts_ms": wall_ms + 400 * DAY, "interval_ms": 10_000,
        "host": "host-wrong", "gpu_uuid": "g-idle", "gpu_model": H100, "util_gpu_pct": 100.0,
        "mem_used_bytes": 1, "mem_total_bytes": 1_000_000, "lease_id": "L-idle"});
    phase2.push(("g-idle".into(), wrong.to_string().into_bytes()));
    produce(&bootstrap, topics::SAMPLES, &phase2);
    let until = Instant::now() + Duration::from_secs(10);
    while publisher.metrics.window_samples() < 24 + 9 {
        assert!(
            Instant::now() < until,
            "the window holds {} samples",
            publisher.metrics.window_samples()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let skew = signals.wait_for_kind("clock_skew", 1, Duration::from_secs(10));
    let SignalBody::ClockSkew { host, skew_ms } = &skew[0].body else {
        unreachable!()
    };
    assert_eq!(host, "host-wrong");
    assert!(
        (skew_ms - 400 * DAY).abs() < 60 * S,
        "skew {skew_ms} ms, 400 days is {} ms",
        400 * DAY
    );
    // host-g-gone, silent since 60 s, is 25 s behind the median host: no longer held for.
    // The fleet is at 85 s, not yet past 90 s.
    signals.read(Duration::from_millis(500));
    assert!(
        !signals.seen.iter().any(|(_, s)| s.ts_ms == T0 + 90 * S),
        "signals for T0+90 s before the fleet reached it"
    );
    let mut fleet_at_95 = Vec::new();
    for gpu in ["g-idle", "g-busy", "g-rogue"] {
        fleet_at_95.push(sample(
            gpu,
            95 * S,
            match gpu {
                "g-rogue" => 90.0,
                "g-idle" => 100.0,
                _ => 0.0,
            },
            None,
        ));
    }
    produce(&bootstrap, topics::SAMPLES, &fleet_at_95);
    let at90 = signals.wait_for(T0 + 90 * S, 6, Duration::from_secs(10));
    assert_eq!(
        lease_utilization(&at90["L-busy"]),
        ("ds".into(), 53.333, 25_000, 1, 1, None, util)
    );
    assert_eq!(
        lease_utilization(&at90["L-idle"]),
        ("ml".into(), 100.0, 80_000, 0, 1, Some(2.0), sm)
    );
    assert_eq!(at90["g-rogue"].body, unattributed("g-rogue", 90.0));
    // Its samples of T0+10..=60 s are still in the window.
    assert_eq!(at90["g-gone"].body, unattributed("g-gone", 70.0));
    assert_eq!(at90["ml"].body, spend("ml", 100.0, 4.0));

    // Stopping delivers what was computed, and the counters say what was published.
    let took = publisher.stop();
    assert!(took < Duration::from_secs(3), "stopped in {took:?}");
    signals.read(Duration::from_millis(500));
    let metrics = &publisher.metrics;
    for (kind, n) in [
        ("lease_utilization", 4),
        ("gpu_unattributed", 4),
        ("team_spend", 4),
    ] {
        assert_eq!(signals.distinct(kind), n, "{kind}");
        assert_eq!(metrics.signals_published(kind), n, "{kind}");
    }
    // The standby, taking over meanwhile, may report host-wrong again: it reads it anew.
    assert!(signals.count("clock_skew") >= 1);
    assert_eq!(metrics.signals_published("clock_skew"), 1);
    assert_eq!(metrics.signal_failures_total(), 0);
    assert_eq!(metrics.signal_computations_total(), 2);
    assert!(
        text_has(
            &metrics.render(),
            "gpuwarden_pipeline_signals_samples_out_of_bounds_total 1"
        ),
        "the wrong clock's sample is counted"
    );
    assert!(!metrics.signals_leader());
    let text = metrics.render();
    assert!(
        text.contains("gpuwarden_pipeline_signals_published_total{kind=\"team_spend\"} 4"),
        "{text}"
    );
    assert!(
        text.contains("gpuwarden_pipeline_signals_window_samples 0"),
        "{text}"
    );

    // The standby takes over once the lock is free, rebuilding the window from Kafka.
    let until = Instant::now() + Duration::from_secs(5);
    while standby.metrics.signal_computations_total() == 0 {
        assert!(Instant::now() < until, "the standby did not take over");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(standby.metrics.signals_leader());
    while standby.metrics.window_samples() != 24 + 9 + 3 {
        assert!(
            Instant::now() < until,
            "the standby holds {} samples",
            standby.metrics.window_samples()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = standby.stop();
    assert!(took < Duration::from_secs(3), "stopped in {took:?}");
}

#[tokio::test]
async fn month_to_date_spend_is_empty_without_rollups() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path().join("lake")).unwrap();
    assert!(hot::month_to_date(&lake, T0).await.unwrap().is_empty());
    write_team_hourly(&lake, &[(T0 - 3_600 * S, "ml", 5.0)]);
    let next_month = T0 + 24 * 3_600 * S;
    assert!(hot::month_to_date(&lake, next_month)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        hot::month_to_date(&lake, T0).await.unwrap(),
        BTreeMap::from([("ml".to_string(), 5.0)])
    );
}

fn text_has(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}
