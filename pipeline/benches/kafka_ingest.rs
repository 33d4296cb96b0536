//! Benchmark: Kafka → Parquet ingest rate of the pipeline (decode, validate, buffer, write
//! Parquet durably, commit) against a bare rdkafka consumer loop reading the same topic from the
//! same in-process broker, in the same run. Reports records/s, the ratio, and peak RSS (VmHWM,
//! reset before each phase). The pipeline's time is split into reading (until every record is
//! decoded and buffered) and draining (writing the buffers as Parquet, fsync, commit). Run with
//! `bench/pipeline-kafka-ingest.sh` (`… tansu` for tansu in a process of its own, whose address
//! it passes in `GPUWARDEN_BENCH_BROKER`); `GPUWARDEN_BENCH_ONLY=pipeline` leaves out the bare
//! consumer, for profiling the pipeline alone (`perf record`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuwarden_pipeline::{consume, IngestOptions, Lake, Metrics};
use gpuwarden_schema::kafka::{ensure_topics, EmbeddedBroker};
use gpuwarden_schema::topics::{self, SAMPLES};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

/// The test broker keeps at most 5 MB per partition: 400,000 samples of ~450 bytes over 48
/// partitions stay inside that.
const N: usize = 400_000;
const PARTITIONS: i32 = 48;
const REPEATS: usize = 3;

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    kb / 1024.0
}

fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn sample(i: usize) -> String {
    let g = i % 2_000;
    format!(
        r#"{{"v":1,"ts_ms":{},"interval_ms":5000,"host":"node-{:04}","gpu_uuid":"GPU-{g:08x}-0000-4000-8000-{g:012x}","gpu_model":"NVIDIA H100 80GB HBM3","util_gpu_pct":{}.5,"mem_used_bytes":{},"mem_total_bytes":85520809984,"gpu_index":{},"pci_bus_id":"00000000:17:00.0","util_mem_pct":12.5,"power_w":512.25,"power_limit_w":700.0,"energy_mj":{},"temp_c":61.0,"sm_clock_mhz":1980,"process_count":1,"lease_id":"l-{:05}","mig_profile":null,"labels":null}}"#,
        1_767_225_600_000i64 + (i / 2_000) as i64 * 5_000,
        g / 8,
        i % 100,
        (i % 80) << 30,
        g % 8,
        1_000_000 + i * 17,
        g / 4
    )
}

fn client(bootstrap: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap);
    c
}

fn bare(bootstrap: &str, group: &str) -> (Duration, f64) {
    reset_peak_rss();
    let consumer: BaseConsumer = client(bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[SAMPLES]).unwrap();
    let started = Instant::now();
    let (mut n, mut bytes) = (0usize, 0usize);
    while n < N {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            bytes += m.payload().map_or(0, <[u8]>::len);
            n += 1;
        }
    }
    std::hint::black_box(bytes);
    (started.elapsed(), peak_rss_mib())
}

/// The pipeline's time: in all, and until every record was read (decoded and buffered).
fn ours(bootstrap: &str, group: &str, dir: &std::path::Path) -> (Duration, Duration, f64) {
    reset_peak_rss();
    let _ = std::fs::remove_dir_all(dir);
    let lake = Lake::open(dir).unwrap();
    let metrics = Arc::new(Metrics::default());
    let stop = Arc::new(AtomicBool::new(false));
    let options = IngestOptions {
        flush_rows: 200_000,
        flush_age: Duration::from_secs(5),
        max_buffered_bytes: 512 << 20,
        writers: 2,
        write_throttle: None,
        // The bench's samples are dated in the past: bounds are not what it measures.
        bounds: gpuwarden_pipeline::bounds::Bounds::none(),
        clock: Arc::new(gpuwarden_schema::SystemClock),
        signing: gpuwarden_schema::signing::SigningKeys::default(),
    };
    let started = Instant::now();
    let thread = {
        let (client, group, metrics, stop) = (
            client(bootstrap),
            group.to_string(),
            Arc::clone(&metrics),
            Arc::clone(&stop),
        );
        std::thread::spawn(move || {
            consume::run(&client, &group, lake, options, metrics, stop).unwrap()
        })
    };
    while metrics.records_in_total() < N as u64 {
        std::thread::sleep(Duration::from_millis(2));
    }
    let read = started.elapsed();
    // Stopping flushes and commits what is buffered: the time counts until all of it is durable.
    stop.store(true, Ordering::SeqCst);
    thread.join().unwrap();
    let elapsed = started.elapsed();
    assert_eq!(metrics.written_rows("samples"), N as u64);
    (elapsed, read, peak_rss_mib())
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // GPUWARDEN_BENCH_BROKER: a broker of its own process (bench/tansu.sh); else the mock
    // cluster in this one.
    let embedded;
    let bootstrap = match std::env::var("GPUWARDEN_BENCH_BROKER") {
        Ok(bootstrap) => {
            ensure_topics(&client(&bootstrap), &topics::ALL, PARTITIONS, 1).unwrap();
            println!("broker: {bootstrap}, a process of its own");
            bootstrap
        }
        Err(_) => {
            embedded = EmbeddedBroker::start(PARTITIONS).unwrap();
            println!("broker: librdkafka's mock cluster in this process");
            embedded.bootstrap_servers().to_string()
        }
    };
    let producer: BaseProducer = client(&bootstrap)
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .unwrap();
    let mut payload_bytes = 0;
    for i in 0..N {
        let payload = sample(i);
        payload_bytes += payload.len();
        let key = format!("{}", i % 2_000);
        while producer
            .send(BaseRecord::to(SAMPLES).key(&key).payload(&payload))
            .is_err()
        {
            producer.poll(Duration::from_millis(5));
        }
    }
    producer.flush(Duration::from_secs(120)).unwrap();
    println!(
        "{N} samples on {PARTITIONS} partitions, {:.0} bytes each",
        payload_bytes as f64 / N as f64
    );

    let dir = std::env::temp_dir().join(format!("gpuwarden-bench-lake-{}", std::process::id()));
    let (mut peer, mut mine) = (Vec::new(), Vec::new());
    let only_pipeline = std::env::var("GPUWARDEN_BENCH_ONLY").as_deref() == Ok("pipeline");
    for r in 0..REPEATS {
        if !only_pipeline {
            let (t, rss) = bare(&bootstrap, &format!("bare-{r}"));
            println!(
                "bare rdkafka consumer loop   {:>7.3} s  {:>9.0} records/s  peak RSS {rss:>7.1} MiB",
                t.as_secs_f64(),
                N as f64 / t.as_secs_f64()
            );
            peer.push(t.as_secs_f64());
        }
        let (t, read, rss) = ours(&bootstrap, &format!("ours-{r}"), &dir);
        println!(
            "pipeline ingest to Parquet   {:>7.3} s  {:>9.0} records/s  peak RSS {rss:>7.1} MiB  (read {:.3} s, then write+fsync+commit {:.3} s)",
            t.as_secs_f64(),
            N as f64 / t.as_secs_f64(),
            read.as_secs_f64(),
            (t - read).as_secs_f64()
        );
        mine.push(t.as_secs_f64());
    }
    let _ = std::fs::remove_dir_all(&dir);
    if only_pipeline {
        return;
    }
    peer.sort_by(f64::total_cmp);
    mine.sort_by(f64::total_cmp);
    let (p, m) = (peer[REPEATS / 2], mine[REPEATS / 2]);
    println!(
        "median: bare {:.0} records/s, pipeline {:.0} records/s -> ratio {:.2} (target >= 0.8)",
        N as f64 / p,
        N as f64 / m,
        p / m
    );
}
