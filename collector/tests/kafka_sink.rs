//! The sink against a real Kafka-protocol broker (librdkafka's mock cluster): every sample
//! arrives exactly once, keyed by GPU; a broker outage inside the buffer's bounds loses nothing;
//! past the bounds the oldest are dropped and counted.

mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use gpuwarden_collector::{KafkaSink, Metrics, SinkSettings};
use gpuwarden_schema::kafka::EmbeddedBroker;
use gpuwarden_schema::topics::SAMPLES;
use gpuwarden_schema::Record;
use support::{client, read_samples, sample};

#[test]
fn every_sample_arrives_once_keyed_by_its_gpu() {
    let broker = EmbeddedBroker::start(3).unwrap();
    let metrics = Arc::new(Metrics::default());
    let sink = KafkaSink::start(
        &client(broker.bootstrap_servers()),
        SAMPLES,
        SinkSettings::default(),
        Arc::clone(&metrics),
    )
    .unwrap();
    let mut sent = Vec::new();
    for tick in 0..20 {
        let batch: Vec<_> = (0..50)
            .map(|gpu| sample(&format!("GPU-{gpu}"), 1_000 + tick * 5_000))
            .collect();
        sent.extend(batch.iter().cloned());
        sink.send(batch);
    }
    let report = sink.close(Duration::from_secs(30));
    assert_eq!(report.published, 1_000);
    assert_eq!(report.dropped, 0);

    let got = read_samples(
        broker.bootstrap_servers(),
        SAMPLES,
        sent.len(),
        Duration::from_secs(30),
    );
    assert_eq!(
        got.len(),
        sent.len(),
        "exactly the samples produced, no more, no fewer"
    );
    for (key, s) in &got {
        assert_eq!(key, &s.gpu_uuid, "keyed by GPU UUID");
    }
    let got: BTreeSet<(String, i64)> = got
        .into_iter()
        .map(|(_, s)| (s.gpu_uuid, s.ts_ms))
        .collect();
    let want: BTreeSet<(String, i64)> = sent.into_iter().map(|s| (s.gpu_uuid, s.ts_ms)).collect();
    assert_eq!(got, want);
}

#[test]
fn an_outage_inside_the_bounds_loses_nothing() {
    let broker = EmbeddedBroker::start(2).unwrap();
    let metrics = Arc::new(Metrics::default());
    let sink = KafkaSink::start(
        &client(broker.bootstrap_servers()),
        SAMPLES,
        SinkSettings::default(),
        Arc::clone(&metrics),
    )
    .unwrap();
    sink.send((0..100).map(|i| sample("GPU-before", i)).collect());
    std::thread::sleep(Duration::from_millis(500));

    broker.set_down(true).unwrap();
    for tick in 0..10 {
        sink.send(
            (0..100)
                .map(|i| sample("GPU-during", tick * 1_000 + i))
                .collect(),
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        metrics.published_total() <= 100,
        "nothing is acknowledged while the broker is down"
    );
    broker.set_down(false).unwrap();

    let report = sink.close(Duration::from_secs(60));
    assert_eq!(report.dropped, 0, "{report:?}");
    let got = read_samples(
        broker.bootstrap_servers(),
        SAMPLES,
        1_100,
        Duration::from_secs(30),
    );
    let unique: BTreeSet<(String, i64)> = got
        .iter()
        .map(|(_, s)| (s.gpu_uuid.clone(), s.ts_ms))
        .collect();
    assert_eq!(
        unique.len(),
        1_100,
        "every sample from before and during the outage arrived"
    );
    assert_eq!(report.published, 1_100);
}

#[test]
fn past_the_byte_bound_the_oldest_samples_are_dropped_and_counted() {
    let broker = EmbeddedBroker::start(1).unwrap();
    let metrics = Arc::new(Metrics::default());
    let one = sample("GPU-x", 0);
    let size = one.key().len() + serde_json::to_vec(&one).unwrap().len();
    let settings = SinkSettings {
        // Room for about 200 samples buffered and 100 in flight.
        max_buffer_bytes: size * 200,
        in_flight_bytes: size * 100,
        ..SinkSettings::default()
    };
    broker.set_down(true).unwrap();
    let sink = KafkaSink::start(
        &client(broker.bootstrap_servers()),
        SAMPLES,
        settings,
        Arc::clone(&metrics),
    )
    .unwrap();
    for tick in 0..10 {
        sink.send((0..100).map(|i| sample("GPU-x", tick * 100 + i)).collect());
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let dropped = metrics.dropped_total();
    assert!(
        (650..=750).contains(&dropped),
        "1000 sent, ~300 fit: dropped {dropped}"
    );
    let rendered = metrics.render_own();
    assert!(
        rendered.contains(&format!(
            "gpuwarden_collector_samples_dropped_total{{reason=\"buffer_full\"}} {dropped}"
        )),
        "{rendered}"
    );

    broker.set_down(false).unwrap();
    let report = sink.close(Duration::from_secs(60));
    let got = read_samples(
        broker.bootstrap_servers(),
        SAMPLES,
        report.published as usize,
        Duration::from_secs(30),
    );
    let ts: BTreeSet<i64> = got.iter().map(|(_, s)| s.ts_ms).collect();
    assert_eq!(
        ts.len() as u64 + dropped,
        1_000,
        "every sample is either delivered or counted as dropped"
    );
    // The first window went out before the bound applied; after it, only the newest survive.
    let newest: Vec<i64> = (900..1_000).collect();
    assert!(
        newest.iter().all(|t| ts.contains(t)),
        "the newest samples were kept"
    );
    assert!(
        !ts.contains(&150),
        "a sample from the middle of the outage was dropped"
    );
}

#[test]
fn promtool_accepts_the_collectors_own_metrics() {
    let metrics = Metrics::default();
    metrics.sampled(3);
    metrics.published(Duration::from_millis(20));
    metrics.dropped(gpuwarden_collector::metrics::DropReason::BufferAge, 2);
    metrics.nvml_error("power_w");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("metrics.txt");
    std::fs::write(&file, metrics.render_own()).unwrap();
    let out = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .expect("promtool is installed (Debian's prometheus package; .ci/run installs it)");
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        metrics.render_own()
    );
}
