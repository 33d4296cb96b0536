//! Helpers for the pipeline's tests: run ingest on a thread, produce records, and query the
//! lake with DataFusion, an engine independent of the code under test.

#![allow(dead_code, unreachable_pub)]

#[path = "../../../tests/support/s3.rs"]
pub mod s3;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use gpuwarden_pipeline::bounds::Bounds;
use gpuwarden_pipeline::{consume, IngestOptions, Lake, Metrics};
use gpuwarden_schema::SystemClock;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

pub fn client(bootstrap: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap);
    c
}

/// Produces `(key, payload)` records to `topic` and waits until all are acknowledged.
pub fn produce(bootstrap: &str, topic: &str, records: &[(String, Vec<u8>)]) {
    produce_signed(bootstrap, topic, records, None);
}

/// [`produce`], each record signed with `keys` when given, as the enforcer signs its own.
pub fn produce_signed(
    bootstrap: &str,
    topic: &str,
    records: &[(String, Vec<u8>)],
    keys: Option<&gpuwarden_schema::signing::SigningKeys>,
) {
    let producer: BaseProducer = client(bootstrap).set("linger.ms", "5").create().unwrap();
    for (key, payload) in records {
        let headers = keys.and_then(|k| k.headers(topic, key.as_bytes(), payload));
        loop {
            let mut record = BaseRecord::to(topic).key(key).payload(payload);
            if let Some(h) = &headers {
                record = record.headers(h.clone());
            }
            match producer.send(record) {
                Ok(()) => break,
                Err(_) => {
                    producer.poll(Duration::from_millis(10));
                }
            }
        }
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(30)).unwrap();
}

/// Ingest running on a thread until stopped.
pub struct Running {
    pub metrics: Arc<Metrics>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Running {
    pub fn start(bootstrap: &str, group: &str, lake: &Lake, options: IngestOptions) -> Self {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
        let metrics = Arc::new(Metrics::default());
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (client, group, lake, metrics, stop) = (
                client(bootstrap),
                group.to_string(),
                lake.clone(),
                Arc::clone(&metrics),
                Arc::clone(&stop),
            );
            std::thread::spawn(move || {
                consume::run(&client, &group, lake, options, metrics, stop).unwrap()
            })
        };
        Self {
            metrics,
            stop,
            thread: Some(thread),
        }
    }

    /// Waits until `n` records were read.
    pub fn wait_for_records(&self, n: u64, timeout: Duration) {
        let until = Instant::now() + timeout;
        while self.metrics.records_in_total() < n {
            assert!(
                Instant::now() < until,
                "read {} of {n} records within {timeout:?}",
                self.metrics.records_in_total()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops (flush and commit) and waits.
    pub fn stop(mut self) -> Arc<Metrics> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        Arc::clone(&self.metrics)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn options() -> IngestOptions {
    IngestOptions {
        flush_rows: 1_000,
        flush_age: Duration::from_millis(300),
        max_buffered_bytes: 64 << 20,
        writers: 2,
        write_throttle: None,
        // The tests' records are dated in 2026-01: these tests are not about the bounds.
        bounds: Bounds::none(),
        clock: Arc::new(SystemClock),
        signing: gpuwarden_schema::signing::SigningKeys::default(),
    }
}

/// Runs `query` over the lake's raw tables, registered as `gpuwarden sql` registers them.
pub fn sql(lake: &Lake, query: &str) -> Vec<RecordBatch> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime
        .block_on(gpuwarden_pipeline::sql::query(lake, query))
        .unwrap_or_else(|e| panic!("{query}: {e}"))
        .1
}

/// The single integer a query returns.
pub fn sql_i64(lake: &Lake, query: &str) -> i64 {
    let batches = sql(lake, query);
    let column = datafusion::arrow::compute::cast(
        batches[0].column(0),
        &datafusion::arrow::datatypes::DataType::Int64,
    )
    .unwrap();
    arrow_array::cast::AsArray::as_primitive::<arrow_array::types::Int64Type>(&column).value(0)
}

/// Every row of a two-string-column query.
pub fn sql_pairs(lake: &Lake, query: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for batch in sql(lake, query) {
        let utf8 = |i: usize| {
            datafusion::arrow::compute::cast(
                batch.column(i),
                &datafusion::arrow::datatypes::DataType::Utf8,
            )
            .unwrap()
        };
        let (a, b) = (utf8(0), utf8(1));
        let a = arrow_array::cast::AsArray::as_string::<i32>(&a);
        let b = arrow_array::cast::AsArray::as_string::<i32>(&b);
        for i in 0..batch.num_rows() {
            out.push((a.value(i).to_string(), b.value(i).to_string()));
        }
    }
    out
}

pub fn sample_json(gpu: &str, ts_ms: i64, util: f64) -> Vec<u8> {
    serde_json::json!({
        "v": 1, "ts_ms": ts_ms, "interval_ms": 5000, "host": "node-1", "gpu_uuid": gpu,
        "gpu_model": "NVIDIA H100 80GB HBM3", "util_gpu_pct": util,
        "mem_used_bytes": 1073741824u64, "mem_total_bytes": 85520809984u64, "power_w": 300.5
    })
    .to_string()
    .into_bytes()
}
