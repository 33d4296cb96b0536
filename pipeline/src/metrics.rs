//! The pipeline's own metrics (`gpuwarden_pipeline_*`), served on `pipeline.metrics_listen`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use gpuwarden_schema::prom::{escape, family, Histogram};

const FLUSH_BUCKETS: [f64; 9] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0];

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

impl Metrics {
    /// Counts `n` records of `topic`, `bad` of them quarantined.
    pub(crate) fn records_in_n(&self, topic: &str, n: u64, bad: u64) {
        bump_str(&self.records_in, topic, n);
        if bad > 0 {
            bump_str(&self.quarantined, topic, bad);
        }
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
