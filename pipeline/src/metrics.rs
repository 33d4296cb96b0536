//! The pipeline's own metrics (`gpuwarden_pipeline_*`), served on `pipeline.metrics_listen`:
//! ingest (records, files, buffers, lag, commits), rollups (runs, failures) and signals
//! (published, failures, the last computation's time, the hot window's size) and the SQL
//! endpoint's logins (failures, lockouts, connections refused while locked out). Client
//! addresses and user names never become label values.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use gpuwarden_schema::login_limit::{Failure, Scope};
use gpuwarden_schema::prom::{escape, family, Histogram};
use gpuwarden_schema::signing::Verdict;

use crate::bounds::Direction;

const FLUSH_BUCKETS: [f64; 9] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0];

/// The `kind` label values of the signal metrics: every [`gpuwarden_schema::SignalBody`] kind.
const SIGNAL_KINDS: [&str; 4] = [
    "lease_utilization",
    "gpu_unattributed",
    "team_spend",
    "clock_skew",
];

/// The index of a signal kind in [`SIGNAL_KINDS`] (an unknown kind counts as the last one; the
/// list covers every variant, so this does not happen).
pub(crate) fn signal_kind_index(kind: &str) -> usize {
    SIGNAL_KINDS
        .iter()
        .position(|k| *k == kind)
        .unwrap_or(SIGNAL_KINDS.len() - 1)
}

/// Counters and gauges shared by the consumer loop, the writers and `/metrics`.
#[derive(Debug)]
pub struct Metrics {
    records_in: Mutex<BTreeMap<String, u64>>,
    quarantined: Mutex<BTreeMap<String, u64>>,
    written: Mutex<BTreeMap<&'static str, u64>>,
    files_written: AtomicU64,
    bytes_written: AtomicU64,
    flush_seconds: Mutex<Histogram>,
    buffered_bytes: AtomicU64,
    buffered_bytes_peak: AtomicU64,
    buffered_limit: AtomicU64,
    paused: AtomicU64,
    pauses: AtomicU64,
    lag: AtomicI64,
    commits: AtomicU64,
    out_of_bounds: Mutex<BTreeMap<(String, &'static str), u64>>,
    refused_signature: Mutex<BTreeMap<(String, &'static str), u64>>,
    /// Each host's latest clock skew, ms, as ingest last published it.
    host_skews: Mutex<Vec<(String, i64)>>,
    /// The signals loop's fleet watermark, ms (`i64::MIN`: none yet).
    signals_watermark: AtomicI64,
    signals_out_of_bounds: AtomicU64,
    signals_published: [AtomicU64; 4],
    signal_failures: AtomicU64,
    signal_computations: AtomicU64,
    signal_compute_failures: AtomicU64,
    /// The last computation's wall time, seconds, as `f64` bits.
    signal_compute_seconds: AtomicU64,
    window_samples: AtomicU64,
    window_bytes: AtomicU64,
    signals_leader: AtomicU64,
    rollups: AtomicU64,
    rollup_failures: AtomicU64,
    /// Compaction: hours compacted, files replaced, files written, failed runs, lost manifests
    /// rebuilt.
    compaction: [AtomicU64; 5],
    /// Hours compaction left alone, by [`crate::compact::SkipReason`] (in `ALL`'s order).
    compaction_skipped: [AtomicU64; 1],
    /// Retention, by table: hours, files and bytes deleted.
    expired: Mutex<BTreeMap<&'static str, [u64; 3]>>,
    sql_login_failures: AtomicU64,
    /// By [`Scope`] (in [`Scope::ALL`]'s order): lockouts begun, connections refused.
    sql_lockouts: [AtomicU64; 2],
    sql_logins_refused: [AtomicU64; 2],
    sql_login_keys_evicted: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            records_in: Mutex::default(),
            quarantined: Mutex::default(),
            written: Mutex::default(),
            files_written: AtomicU64::default(),
            bytes_written: AtomicU64::default(),
            flush_seconds: Mutex::new(Histogram::new(&FLUSH_BUCKETS)),
            buffered_bytes: AtomicU64::default(),
            buffered_bytes_peak: AtomicU64::default(),
            buffered_limit: AtomicU64::default(),
            paused: AtomicU64::default(),
            pauses: AtomicU64::default(),
            lag: AtomicI64::new(-1),
            commits: AtomicU64::default(),
            out_of_bounds: Mutex::default(),
            refused_signature: Mutex::default(),
            host_skews: Mutex::default(),
            signals_watermark: AtomicI64::new(i64::MIN),
            signals_out_of_bounds: AtomicU64::default(),
            signals_published: Default::default(),
            signal_failures: AtomicU64::default(),
            signal_computations: AtomicU64::default(),
            signal_compute_failures: AtomicU64::default(),
            signal_compute_seconds: AtomicU64::new(0f64.to_bits()),
            window_samples: AtomicU64::default(),
            window_bytes: AtomicU64::default(),
            signals_leader: AtomicU64::default(),
            rollups: AtomicU64::default(),
            rollup_failures: AtomicU64::default(),
            compaction: Default::default(),
            compaction_skipped: Default::default(),
            expired: Mutex::default(),
            sql_login_failures: AtomicU64::default(),
            sql_lockouts: Default::default(),
            sql_logins_refused: Default::default(),
            sql_login_keys_evicted: AtomicU64::default(),
        }
    }
}

fn bump<K: Ord>(map: &Mutex<BTreeMap<K, u64>>, key: K, n: u64) {
    *map.lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_default() += n;
}

/// Like [`bump`], without allocating a key that is already there (the per-record hot path).
fn bump_str(map: &Mutex<BTreeMap<String, u64>>, key: &str, n: u64) {
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    match map.get_mut(key) {
        Some(count) => *count += n,
        None => {
            map.insert(key.to_string(), n);
        }
    }
}

fn scope_index(scope: Scope) -> usize {
    Scope::ALL.iter().position(|s| *s == scope).unwrap_or(0)
}

impl Metrics {
    /// Counts one failed SQL login (a wrong password), the lockouts it began and the keys the
    /// login limiter forgot to count it.
    pub(crate) fn sql_login_failed(&self, failure: &Failure) {
        self.sql_login_failures.fetch_add(1, Ordering::Relaxed);
        for lockout in failure.lockouts() {
            self.sql_lockouts[scope_index(lockout.scope)].fetch_add(1, Ordering::Relaxed);
        }
        self.sql_login_keys_evicted
            .fetch_add(failure.evicted, Ordering::Relaxed);
    }

    /// Counts one SQL connection refused because its source address or user was locked out.
    pub(crate) fn sql_login_refused(&self, scope: Scope) {
        self.sql_logins_refused[scope_index(scope)].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a run of the rollups, failed or not.
    pub fn rolled_up(&self, failed: bool) {
        self.rollups.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.rollup_failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a run of compaction and retention: what it did, or that it failed.
    pub fn maintained(&self, result: Option<&crate::compact::Maintenance>) {
        let Some(done) = result else {
            self.compaction[3].fetch_add(1, Ordering::Relaxed);
            return;
        };
        let c = &done.compacted;
        for (i, n) in [c.hours, c.files_in, c.files_out].into_iter().enumerate() {
            self.compaction[i].fetch_add(n as u64, Ordering::Relaxed);
        }
        self.compaction[4].fetch_add(c.vacuumed as u64, Ordering::Relaxed);
        for (counter, n) in self.compaction_skipped.iter().zip(c.skipped) {
            counter.fetch_add(n as u64, Ordering::Relaxed);
        }
        let mut expired = self.expired.lock().unwrap_or_else(|e| e.into_inner());
        for e in &done.expired {
            let counts = expired.entry(e.table).or_default();
            counts[0] += e.hours as u64;
            counts[1] += e.files;
            counts[2] += e.bytes;
        }
    }

    /// Files deleted by retention from `table` so far.
    pub fn expired_files(&self, table: &str) -> u64 {
        let expired = self.expired.lock().unwrap_or_else(|e| e.into_inner());
        expired.get(table).map_or(0, |counts| counts[1])
    }

    /// Counts `n` records of `topic`, `bad` of them quarantined.
    pub(crate) fn records_in_n(&self, topic: &str, n: u64, bad: u64) {
        bump_str(&self.records_in, topic, n);
        if bad > 0 {
            bump_str(&self.quarantined, topic, bad);
        }
    }

    /// Counts `n` records of `topic` quarantined because their time was out of bounds.
    pub(crate) fn out_of_bounds(&self, topic: &str, direction: Direction, n: u64) {
        let mut map = self.out_of_bounds.lock().unwrap_or_else(|e| e.into_inner());
        *map.entry((topic.to_string(), direction.name()))
            .or_default() += n;
    }

    /// Counts a record of `topic` quarantined for its signature (`verdict`: unsigned or invalid).
    pub(crate) fn refused_signature(&self, topic: &str, verdict: Verdict) {
        let mut map = self
            .refused_signature
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *map.entry((topic.to_string(), verdict.as_str()))
            .or_default() += 1;
    }

    /// Records of `topic` quarantined for their signature, by `signature` (`unsigned`, `invalid`).
    pub fn refused_signature_total(&self, topic: &str, signature: &str) -> u64 {
        self.refused_signature
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|((t, s), _)| t == topic && *s == signature)
            .map(|(_, n)| *n)
            .sum()
    }

    /// Replaces the hosts' clock skews shown on `/metrics`.
    pub(crate) fn set_host_skews(&self, skews: Vec<(String, i64)>) {
        *self.host_skews.lock().unwrap_or_else(|e| e.into_inner()) = skews;
    }

    /// The signals loop's watermark moved.
    pub(crate) fn set_signals_watermark(&self, ts_ms: Option<i64>) {
        self.signals_watermark
            .store(ts_ms.unwrap_or(i64::MIN), Ordering::Relaxed);
    }

    /// The signals loop skipped a sample whose time was out of bounds.
    pub(crate) fn signals_out_of_bounds(&self) {
        self.signals_out_of_bounds.fetch_add(1, Ordering::Relaxed);
    }

    /// Records of `topic` quarantined for a time out of bounds, in `direction`.
    pub fn out_of_bounds_total(&self, topic: &str, direction: Direction) -> u64 {
        self.out_of_bounds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(topic.to_string(), direction.name()))
            .copied()
            .unwrap_or_default()
    }

    pub(crate) fn written(&self, table: &'static str, rows: usize, bytes: u64) {
        bump(&self.written, table, rows as u64);
        self.files_written.fetch_add(1, Ordering::Relaxed);
        self.bytes_written.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn flushed(&self, seconds: f64) {
        self.flush_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(seconds);
    }

    pub(crate) fn buffered(&self, bytes: usize, limit: usize) {
        self.buffered_bytes.store(bytes as u64, Ordering::Relaxed);
        self.buffered_bytes_peak
            .fetch_max(bytes as u64, Ordering::Relaxed);
        self.buffered_limit.store(limit as u64, Ordering::Relaxed);
    }

    pub(crate) fn set_paused(&self, paused: bool) {
        if paused && self.paused.swap(1, Ordering::Relaxed) == 0 {
            self.pauses.fetch_add(1, Ordering::Relaxed);
        } else if !paused {
            self.paused.store(0, Ordering::Relaxed);
        }
    }

    pub(crate) fn set_lag(&self, lag: i64) {
        self.lag.store(lag, Ordering::Relaxed);
    }

    pub(crate) fn committed(&self) {
        self.commits.fetch_add(1, Ordering::Relaxed);
    }

    /// A signal of kind index `kind` ([`signal_kind_index`]) was acknowledged by Kafka.
    pub(crate) fn signal_published(&self, kind: usize) {
        if let Some(n) = self.signals_published.get(kind) {
            n.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `n` signals could not be published.
    pub(crate) fn signal_failed(&self, n: u64) {
        self.signal_failures.fetch_add(n, Ordering::Relaxed);
    }

    /// One computation of signals ended, successfully or not, after `seconds`.
    pub(crate) fn signals_computed(&self, seconds: f64, ok: bool) {
        self.signal_computations.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.signal_compute_failures.fetch_add(1, Ordering::Relaxed);
        }
        self.signal_compute_seconds
            .store(seconds.to_bits(), Ordering::Relaxed);
    }

    pub(crate) fn set_window_samples(&self, rows: usize) {
        self.window_samples.store(rows as u64, Ordering::Relaxed);
    }

    pub(crate) fn set_window_bytes(&self, bytes: usize) {
        self.window_bytes.store(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn set_signals_leader(&self, leader: bool) {
        self.signals_leader
            .store(u64::from(leader), Ordering::Relaxed);
    }

    /// Signals of `kind` (`lease_utilization`, …) acknowledged by Kafka so far.
    pub fn signals_published(&self, kind: &str) -> u64 {
        SIGNAL_KINDS
            .iter()
            .position(|k| *k == kind)
            .map_or(0, |i| self.signals_published[i].load(Ordering::Relaxed))
    }

    /// Signals that could not be published so far.
    pub fn signal_failures_total(&self) -> u64 {
        self.signal_failures.load(Ordering::Relaxed)
    }

    /// Computations of signals so far (failed ones included).
    pub fn signal_computations_total(&self) -> u64 {
        self.signal_computations.load(Ordering::Relaxed)
    }

    /// Samples the hot window holds now.
    pub fn window_samples(&self) -> u64 {
        self.window_samples.load(Ordering::Relaxed)
    }

    /// Bytes the hot window's samples held after the last computation.
    pub fn window_bytes(&self) -> u64 {
        self.window_bytes.load(Ordering::Relaxed)
    }

    /// Whether this process holds the signals lock and publishes.
    pub fn signals_leader(&self) -> bool {
        self.signals_leader.load(Ordering::Relaxed) == 1
    }

    /// Records received so far, all topics.
    pub fn records_in_total(&self) -> u64 {
        self.records_in
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .sum()
    }

    /// Records quarantined so far, all topics.
    pub fn quarantined_total(&self) -> u64 {
        self.quarantined
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .sum()
    }

    /// Rows written to `table` so far.
    pub fn written_rows(&self, table: &str) -> u64 {
        self.written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(t, _)| **t == table)
            .map(|(_, n)| *n)
            .sum()
    }

    /// The most bytes buffered at once so far.
    pub fn buffered_bytes_peak(&self) -> u64 {
        self.buffered_bytes_peak.load(Ordering::Relaxed)
    }

    /// How many times consumption paused for memory.
    pub fn pauses_total(&self) -> u64 {
        self.pauses.load(Ordering::Relaxed)
    }

    /// Messages behind the end of the assigned partitions (-1 until known).
    pub fn lag(&self) -> i64 {
        self.lag.load(Ordering::Relaxed)
    }

    /// Offset commits so far.
    pub fn commits_total(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// The Prometheus text of every pipeline metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let labelled = |map: &BTreeMap<String, u64>, key: &str| -> Vec<(String, f64)> {
            map.iter()
                .map(|(k, v)| (format!("{key}=\"{}\"", escape(k)), *v as f64))
                .collect()
        };
        let records_in = labelled(
            &self.records_in.lock().unwrap_or_else(|e| e.into_inner()),
            "topic",
        );
        family(
            &mut out,
            "gpuwarden_pipeline_records_in_total",
            "counter",
            "Records read from Kafka (or ingested from files), by topic.",
            records_in.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        let quarantined = labelled(
            &self.quarantined.lock().unwrap_or_else(|e| e.into_inner()),
            "topic",
        );
        family(
            &mut out,
            "gpuwarden_pipeline_records_quarantined_total",
            "counter",
            "Records that failed to decode or validate, written to the quarantine table, by topic.",
            quarantined.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        let out_of_bounds: Vec<(String, f64)> = self
            .out_of_bounds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|((topic, bound), n)| {
                (
                    format!("topic=\"{}\",bound=\"{bound}\"", escape(topic)),
                    *n as f64,
                )
            })
            .collect();
        family(
            &mut out,
            "gpuwarden_pipeline_records_out_of_bounds_total",
            "counter",
            "Records quarantined because their time was more than pipeline.clock.max_skew ahead of their arrival (bound=\"ahead\") or, for samples on Kafka, more than pipeline.clock.max_age behind it (bound=\"behind\"); also counted in records_quarantined_total.",
            out_of_bounds.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        let refused: Vec<(String, f64)> = self
            .refused_signature
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|((topic, signature), n)| {
                (
                    format!("topic=\"{}\",signature=\"{signature}\"", escape(topic)),
                    *n as f64,
                )
            })
            .collect();
        family(
            &mut out,
            "gpuwarden_pipeline_records_refused_signature_total",
            "counter",
            "Lease events, signals and actions quarantined because they were not signed with [signing] key (signature=\"unsigned\") or their signature matched neither key (\"invalid\"); also counted in records_quarantined_total.",
            refused.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        let skews: Vec<(String, f64)> = self
            .host_skews
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(host, ms)| (format!("host=\"{}\"", escape(host)), *ms as f64 / 1000.0))
            .collect();
        family(
            &mut out,
            "gpuwarden_pipeline_host_clock_skew_seconds",
            "gauge",
            "Each host's clock against the pipeline's: its latest sample's time minus the sample's arrival (negative: behind, by the host's delay in sending). Hosts silent for an hour are dropped.",
            skews.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        let written: Vec<(String, f64)> = self
            .written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (format!("table=\"{k}\""), *v as f64))
            .collect();
        family(
            &mut out,
            "gpuwarden_pipeline_records_written_total",
            "counter",
            "Rows written to Parquet, by table.",
            written.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        family(
            &mut out,
            "gpuwarden_pipeline_files_written_total",
            "counter",
            "Parquet files written.",
            [("", self.files_written.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_written_bytes_total",
            "counter",
            "Bytes of Parquet written.",
            [("", self.bytes_written.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_offset_commits_total",
            "counter",
            "Kafka offset commits after durable writes.",
            [("", self.commits.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_buffered_bytes",
            "gauge",
            "Bytes of rows buffered or being written.",
            [("", self.buffered_bytes.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_buffered_bytes_limit",
            "gauge",
            "pipeline.max_buffered_bytes: consumption pauses above it.",
            [("", self.buffered_limit.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_paused",
            "gauge",
            "1 while consumption is paused because writing falls behind.",
            [("", self.paused.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_pauses_total",
            "counter",
            "Times consumption paused because writing fell behind.",
            [("", self.pauses.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_consumer_lag_messages",
            "gauge",
            "Messages behind the end of the assigned partitions.",
            [("", self.lag.load(Ordering::Relaxed).max(0) as f64)],
        );
        let published: Vec<(String, f64)> = SIGNAL_KINDS
            .iter()
            .zip(&self.signals_published)
            .map(|(kind, n)| (format!("kind=\"{kind}\""), n.load(Ordering::Relaxed) as f64))
            .collect();
        family(
            &mut out,
            "gpuwarden_pipeline_signals_published_total",
            "counter",
            "Signals published to gpuwarden.signals and acknowledged, by kind.",
            published.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        family(
            &mut out,
            "gpuwarden_pipeline_signal_publish_failures_total",
            "counter",
            "Signals that could not be published (refused or not delivered).",
            [("", self.signal_failures.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_signal_computations_total",
            "counter",
            "Computations of signals over the hot window, failed ones included.",
            [("", self.signal_computations.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_signal_computation_failures_total",
            "counter",
            "Computations of signals that failed (nothing was published for that time).",
            [(
                "",
                self.signal_compute_failures.load(Ordering::Relaxed) as f64,
            )],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_signal_computation_seconds",
            "gauge",
            "Wall time of the last computation of signals, publishing included.",
            [(
                "",
                f64::from_bits(self.signal_compute_seconds.load(Ordering::Relaxed)),
            )],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_rollups_total",
            "counter",
            "Runs of the rollups (every pipeline.rollup_every), failed ones included.",
            [("", self.rollups.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_rollup_failures_total",
            "counter",
            "Runs of the rollups that failed (retried at the next one).",
            [("", self.rollup_failures.load(Ordering::Relaxed) as f64)],
        );
        for (i, (name, help)) in [
            (
                "gpuwarden_pipeline_compactions_total",
                "Hours of a raw table compacted (each time: late data may reopen one).",
            ),
            (
                "gpuwarden_pipeline_compacted_files_in_total",
                "Files replaced by compaction.",
            ),
            (
                "gpuwarden_pipeline_compacted_files_out_total",
                "Files written by compaction.",
            ),
            (
                "gpuwarden_pipeline_compaction_failures_total",
                "Runs of compaction and retention that failed (retried at the next one).",
            ),
            (
                "gpuwarden_pipeline_vacuumed_files_total",
                "Files of the raw tables deleted by VACUUM: removed by a commit (OPTIMIZE, \
                 retention), or named by none (put by a process killed before its commit), \
                 longer ago than the tables keep removed files.",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            family(
                &mut out,
                name,
                "counter",
                help,
                [("", self.compaction[i].load(Ordering::Relaxed) as f64)],
            );
        }
        {
            let labels: Vec<(String, f64)> = crate::compact::SkipReason::ALL
                .iter()
                .zip(&self.compaction_skipped)
                .map(|(reason, n)| {
                    (
                        format!("reason=\"{}\"", reason.as_str()),
                        n.load(Ordering::Relaxed) as f64,
                    )
                })
                .collect();
            family(
                &mut out,
                "gpuwarden_pipeline_compaction_skipped_partitions_total",
                "counter",
                "Hours compaction left for its next run, each run: reason=\"conflict\", a \
                 commit removed one of the hour's files while it was compacted.",
                labels.iter().map(|(l, v)| (l.as_str(), *v)),
            );
        }
        {
            let expired = self.expired.lock().unwrap_or_else(|e| e.into_inner());
            for (i, (name, help)) in [
                (
                    "gpuwarden_pipeline_retention_deleted_partitions_total",
                    "Hour directories of a raw table deleted past pipeline.retention.",
                ),
                (
                    "gpuwarden_pipeline_retention_deleted_files_total",
                    "Files of a raw table deleted past pipeline.retention.",
                ),
                (
                    "gpuwarden_pipeline_retention_deleted_bytes_total",
                    "Bytes of a raw table deleted past pipeline.retention.",
                ),
            ]
            .into_iter()
            .enumerate()
            {
                let labels: Vec<(String, f64)> = expired
                    .iter()
                    .map(|(table, counts)| (format!("table=\"{table}\""), counts[i] as f64))
                    .collect();
                family(
                    &mut out,
                    name,
                    "counter",
                    help,
                    labels.iter().map(|(l, v)| (l.as_str(), *v)),
                );
            }
        }
        family(
            &mut out,
            "gpuwarden_pipeline_signals_window_samples",
            "gauge",
            "Distinct samples held in memory in the signals' hot window.",
            [("", self.window_samples.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_signals_window_bytes",
            "gauge",
            "Heap bytes the signals' hot window held for its samples after the last computation.",
            [("", self.window_bytes.load(Ordering::Relaxed) as f64)],
        );
        let watermark = self.signals_watermark.load(Ordering::Relaxed);
        family(
            &mut out,
            "gpuwarden_pipeline_signals_watermark_seconds",
            "gauge",
            "The event time the fleet has reached, as the signals loop reckons it (Unix seconds; absent before the first sample).",
            (watermark != i64::MIN).then(|| ("", watermark as f64 / 1000.0)),
        );
        family(
            &mut out,
            "gpuwarden_pipeline_signals_samples_out_of_bounds_total",
            "counter",
            "Samples the signals loop skipped because their time was out of bounds (ingest quarantines them).",
            [("", self.signals_out_of_bounds.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_signals_leader",
            "gauge",
            "1 while this process holds the lake's signals lock and publishes signals.",
            [("", self.signals_leader.load(Ordering::Relaxed) as f64)],
        );
        family(
            &mut out,
            "gpuwarden_pipeline_sql_login_failures_total",
            "counter",
            "SQL endpoint logins refused for a wrong password (or a user that does not exist).",
            [("", self.sql_login_failures.load(Ordering::Relaxed) as f64)],
        );
        let by_scope = |counters: &[AtomicU64; 2]| {
            let labels = Scope::ALL.map(|s| format!("scope=\"{}\"", s.as_str()));
            Scope::ALL
                .map(|s| counters[scope_index(s)].load(Ordering::Relaxed) as f64)
                .into_iter()
                .zip(labels)
                .map(|(value, label)| (label, value))
                .collect::<Vec<_>>()
        };
        let lockouts = by_scope(&self.sql_lockouts);
        family(
            &mut out,
            "gpuwarden_pipeline_sql_login_lockouts_total",
            "counter",
            "SQL endpoint lockouts begun after too many failed logins, by what was locked out (source address or user).",
            lockouts.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        let refused = by_scope(&self.sql_logins_refused);
        family(
            &mut out,
            "gpuwarden_pipeline_sql_logins_refused_total",
            "counter",
            "SQL connections refused without checking their password because their source address or user was locked out.",
            refused.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        family(
            &mut out,
            "gpuwarden_pipeline_sql_login_keys_evicted_total",
            "counter",
            "Failed-login counts forgotten early because pipeline.login_limits.tracked_keys was reached.",
            [("", self.sql_login_keys_evicted.load(Ordering::Relaxed) as f64)],
        );
        self.flush_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .render(
                &mut out,
                "gpuwarden_pipeline_flush_seconds",
                "Time to write one flush (all its files) durably.",
            );
        out
    }
}
