//! Kafka → lake ingest in process, against a real Kafka-protocol broker (librdkafka's mock
//! cluster), checked with DataFusion over the Parquet files it wrote.

mod support;

use std::time::Duration;

use gpuwarden_pipeline::delta::{block_on, AsOf};
use gpuwarden_pipeline::{IngestOptions, Lake};
use gpuwarden_schema::kafka::EmbeddedBroker;
use gpuwarden_schema::topics;
use support::s3::on_each_lake;
use support::{options, produce, sample_json, sql_i64, sql_pairs, Running};

const T0: i64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z

/// How many files the latest commit of one table names for an hour.
fn files_in_hour(lake: &Lake, table: &str, hour_ms: i64) -> usize {
    block_on(lake.delta().files(table, AsOf::Latest))
        .unwrap()
        .map_or(0, |files| {
            files
                .files
                .iter()
                .filter(|f| f.hour_ms == Some(hour_ms))
                .count()
        })
}

/// The hours commits after version `since` added rows to, and the latest version.
fn changed_since(lake: &Lake, since: u64) -> (u64, Vec<i64>) {
    let (latest, hours) = block_on(lake.delta().changed_hours("samples", Some(since)))
        .unwrap()
        .unwrap();
    (latest, hours.unwrap().into_iter().collect())
}

#[test]
fn every_invalid_case_is_quarantined_with_its_reason_while_valid_records_arrive() {
    on_each_lake(every_invalid_case_is_quarantined_with_its_reason_while_valid_records_arrive_on);
}

fn every_invalid_case_is_quarantined_with_its_reason_while_valid_records_arrive_on(lake: Lake) {
    let broker = EmbeddedBroker::start(2).unwrap();

    let valid = |i: i64| sample_json("GPU-ok", T0 + i * 5_000, 50.0);
    let mut bad = serde_json::json!({});
    let mut bad_cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let base: serde_json::Value = serde_json::from_slice(&valid(0)).unwrap();
    for field in [
        "v",
        "ts_ms",
        "interval_ms",
        "host",
        "gpu_uuid",
        "gpu_model",
        "util_gpu_pct",
        "mem_used_bytes",
        "mem_total_bytes",
    ] {
        bad = base.clone();
        bad.as_object_mut().unwrap().remove(field);
        bad_cases.push((field, bad.to_string().into_bytes()));
    }
    for (field, value) in [
        ("ts_ms", serde_json::json!("noon")),
        ("host", serde_json::json!(42)),
        ("util_gpu_pct", serde_json::json!(100.5)),
        ("util_gpu_pct", serde_json::json!(-3)),
        ("interval_ms", serde_json::json!(0)),
        ("interval_ms", serde_json::json!(3_600_001)),
        ("mem_used_bytes", serde_json::json!(85_520_809_985u64)),
    ] {
        bad = base.clone();
        bad[field] = value;
        bad_cases.push((field, bad.to_string().into_bytes()));
    }
    let _ = bad;
    let not_json: Vec<(&str, Vec<u8>)> = vec![
        ("", b"this is not json".to_vec()),
        ("", valid(0)[..40].to_vec()),
        ("", Vec::new()),
    ];

    // Valid records before, between and after the bad ones.
    let mut records = Vec::new();
    let mut n_valid = 0;
    for (i, (_, payload)) in bad_cases.iter().chain(&not_json).enumerate() {
        records.push(("k".to_string(), valid(i as i64 * 2)));
        records.push(("k".to_string(), payload.clone()));
        n_valid += 1;
    }
    records.push(("k".to_string(), valid(1_000)));
    n_valid += 1;
    produce(broker.bootstrap_servers(), topics::SAMPLES, &records);
    // A lease event with a bad enum, on its own topic.
    produce(
        broker.bootstrap_servers(),
        topics::LEASES,
        &[(
            "l".into(),
            br#"{"v":1,"ts_ms":1,"event":"stolen"}"#.to_vec(),
        )],
    );

    let running = Running::start(broker.bootstrap_servers(), "q-test", &lake, options());
    running.wait_for_records(records.len() as u64 + 1, Duration::from_secs(30));
    let metrics = running.stop();
    let expected_bad = (bad_cases.len() + not_json.len() + 1) as u64;
    assert_eq!(metrics.quarantined_total(), expected_bad);
    assert!(metrics.render().contains(&format!(
        "gpuwarden_pipeline_records_quarantined_total{{topic=\"gpuwarden.samples\"}} {}",
        expected_bad - 1
    )));

    let root = &lake;
    assert_eq!(sql_i64(root, "SELECT count(*) FROM samples"), n_valid);
    assert_eq!(
        sql_i64(root, "SELECT count(*) FROM quarantine"),
        expected_bad as i64
    );
    let found = sql_pairs(root, "SELECT coalesce(field, ''), reason FROM quarantine WHERE topic = 'gpuwarden.samples' ORDER BY \"offset\"");
    assert_eq!(found.len(), bad_cases.len() + not_json.len());
    for ((field, _), (got_field, reason)) in bad_cases.iter().zip(&found) {
        assert_eq!(got_field, field, "{reason}");
        assert!(
            reason.contains(&format!("`{field}`")),
            "the reason names the field: {reason}"
        );
    }
    for (_, reason) in &found[bad_cases.len()..] {
        assert!(reason.contains("malformed JSON"), "{reason}");
    }
    // The raw bytes are kept as received.
    assert_eq!(
        sql_i64(
            root,
            "SELECT count(*) FROM quarantine WHERE raw = arrow_cast('this is not json', 'Binary')"
        ),
        1
    );
    let lease = sql_pairs(
        root,
        "SELECT topic, reason FROM quarantine WHERE topic = 'gpuwarden.leases'",
    );
    assert!(lease[0].1.contains("`event`"), "{lease:?}");
}

#[test]
fn backpressure_holds_memory_under_the_bound_while_the_disk_is_slow() {
    on_each_lake(backpressure_holds_memory_under_the_bound_while_the_disk_is_slow_on);
}

fn backpressure_holds_memory_under_the_bound_while_the_disk_is_slow_on(lake: Lake) {
    // The mock broker keeps at most 5 MB per partition: 12,000 samples over 4 partitions fit.
    let broker = EmbeddedBroker::start(4).unwrap();
    let n = 12_000;
    let records: Vec<(String, Vec<u8>)> = (0..n)
        .map(|i| {
            (
                format!("GPU-{}", i % 100),
                sample_json(&format!("GPU-{}", i % 100), T0 + i * 1_000, 75.0),
            )
        })
        .collect();
    produce(broker.bootstrap_servers(), topics::SAMPLES, &records);

    let limit = 1 << 20;
    let options = IngestOptions {
        flush_rows: 2_000,
        flush_age: Duration::from_secs(2),
        max_buffered_bytes: limit,
        writers: 1,
        // About 100 KB of Parquet per second: far slower than the broker delivers.
        write_throttle: Some(100_000),
        ..support::options()
    };
    let running = Running::start(broker.bootstrap_servers(), "bp-test", &lake, options);
    running.wait_for_records(n as u64, Duration::from_secs(120));
    let metrics = running.stop();
    let peak = metrics.buffered_bytes_peak();
    assert!(
        metrics.pauses_total() >= 1,
        "consumption paused at least once"
    );
    // One message (~300 bytes in memory) may land after the check that pauses.
    assert!(
        peak <= limit as u64 + 4_096,
        "buffered {peak} bytes with a bound of {limit}"
    );
    assert!(metrics
        .render()
        .contains(&format!("gpuwarden_pipeline_buffered_bytes_limit {limit}")));
    assert_eq!(sql_i64(&lake, "SELECT count(*) FROM samples"), n);
    assert_eq!(
        sql_i64(
            &lake,
            "SELECT count(DISTINCT (gpu_uuid, ts_ms)) FROM samples"
        ),
        n
    );
}

#[test]
fn late_samples_go_to_a_new_file_and_their_commit_names_their_hour() {
    on_each_lake(late_samples_go_to_a_new_file_and_their_commit_names_their_hour_on);
}

fn late_samples_go_to_a_new_file_and_their_commit_names_their_hour_on(lake: Lake) {
    let broker = EmbeddedBroker::start(1).unwrap();
    let first: Vec<(String, Vec<u8>)> = (0..10)
        .map(|i| ("g".into(), sample_json("GPU-late", T0 + i * 5_000, 10.0)))
        .collect();
    produce(broker.bootstrap_servers(), topics::SAMPLES, &first);
    let running = Running::start(broker.bootstrap_servers(), "late-test", &lake, options());
    running.wait_for_records(10, Duration::from_secs(30));
    // Read is not committed yet: the flush lands within its age, later on a loaded machine.
    let until = std::time::Instant::now() + Duration::from_secs(30);
    let (read, hours) = loop {
        let committed = block_on(lake.delta().changed_hours("samples", Some(0))).unwrap();
        match committed {
            Some((_, Some(hours))) if !hours.is_empty() || std::time::Instant::now() > until => {
                break changed_since(&lake, 0);
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
        assert!(
            std::time::Instant::now() < until + Duration::from_secs(1),
            "no commit within 30 s"
        );
    };
    assert_eq!(
        hours,
        vec![T0],
        "the commits say which hour has new rows, for the rollups"
    );
    // An hour later, a sample for the first hour arrives.
    produce(
        broker.bootstrap_servers(),
        topics::SAMPLES,
        &[
            ("g".into(), sample_json("GPU-late", T0 + 7_200_000, 10.0)),
            ("g".into(), sample_json("GPU-late", T0 + 60_000, 10.0)),
        ],
    );
    running.wait_for_records(12, Duration::from_secs(30));
    running.stop();
    assert_eq!(
        changed_since(&lake, read).1,
        vec![T0, T0 + 7_200_000],
        "the late sample's commit names its hour again, the new one its own"
    );
    assert_eq!(
        files_in_hour(&lake, "samples", T0),
        2,
        "the late sample is in a file of its own"
    );
    assert_eq!(sql_i64(&lake, "SELECT count(*) FROM samples"), 12);
}

/// With a signing key, lease events (and signals and actions) count only when signed with it,
/// over their topic, key and payload: an unsigned one, one signed with another key, and one
/// whose signature was made for another key are quarantined with the reason, and counted.
/// Samples carry no signature and are taken as they are.
#[test]
fn with_a_signing_key_only_signed_lease_events_reach_the_lake() {
    on_each_lake(with_a_signing_key_only_signed_lease_events_reach_the_lake_on);
}

fn with_a_signing_key_only_signed_lease_events_reach_the_lake_on(lake: Lake) {
    use gpuwarden_schema::signing::{SigningKeys, HEADER};
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};

    let broker = EmbeddedBroker::start(1).unwrap();
    let keys = SigningKeys::new(Some(b"ingest-test-signing-key-0123456789abcdef"), None);
    let intruder = SigningKeys::new(Some(b"not-the-key-the-pipeline-has-0123456789"), None);
    let event = |lease: &str| {
        serde_json::json!({"v": 1, "ts_ms": T0, "event": "granted", "lease_id": lease,
            "team": "ml", "user": "ada", "project": "p", "workload": "training",
            "substrate": "sim", "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 1,
            "gpu_uuids": ["GPU-1"]})
        .to_string()
    };
    let producer: BaseProducer = support::client(broker.bootstrap_servers())
        .create()
        .unwrap();
    let send = |key: &str, payload: &str, headers: Option<rdkafka::message::OwnedHeaders>| {
        let mut record = BaseRecord::to(topics::LEASES).key(key).payload(payload);
        if let Some(h) = headers {
            record = record.headers(h);
        }
        producer.send(record).unwrap();
    };
    let signed = event("L-signed");
    send(
        "L-signed",
        &signed,
        keys.headers(topics::LEASES, b"L-signed", signed.as_bytes()),
    );
    send("L-unsigned", &event("L-unsigned"), None);
    let forged = event("L-forged");
    send(
        "L-forged",
        &forged,
        intruder.headers(topics::LEASES, b"L-forged", forged.as_bytes()),
    );
    // A signature moved onto another record: made for L-signed's key, not this one's.
    let moved = event("L-moved");
    send(
        "L-moved",
        &moved,
        keys.headers(topics::LEASES, b"L-signed", moved.as_bytes()),
    );
    producer.flush(Duration::from_secs(10)).unwrap();
    produce(
        broker.bootstrap_servers(),
        topics::SAMPLES,
        &[("GPU-1".into(), sample_json("GPU-1", T0, 10.0))],
    );

    let options = IngestOptions {
        signing: keys,
        ..options()
    };
    let running = Running::start(broker.bootstrap_servers(), "sig-test", &lake, options);
    running.wait_for_records(5, Duration::from_secs(30));
    let metrics = running.stop();
    let root = &lake;
    assert_eq!(sql_i64(root, "SELECT count(*) FROM samples"), 1);
    let kept = sql_pairs(root, "SELECT lease_id, event FROM lease_events");
    assert_eq!(kept, [("L-signed".to_string(), "granted".to_string())]);
    let refused = sql_pairs(
        root,
        "SELECT field, reason FROM quarantine WHERE topic = 'gpuwarden.leases' ORDER BY \"offset\"",
    );
    assert_eq!(refused.len(), 3, "{refused:?}");
    assert!(
        refused.iter().all(|(field, _)| field == HEADER),
        "{refused:?}"
    );
    assert!(refused[0].1.contains("missing"), "{refused:?}");
    assert!(refused[1].1.contains("matches neither"), "{refused:?}");
    assert!(refused[2].1.contains("matches neither"), "{refused:?}");
    assert_eq!(
        metrics.refused_signature_total(topics::LEASES, "unsigned"),
        1
    );
    assert_eq!(
        metrics.refused_signature_total(topics::LEASES, "invalid"),
        2
    );
    assert!(metrics.render().contains(
        "gpuwarden_pipeline_records_refused_signature_total{topic=\"gpuwarden.leases\",signature=\"invalid\"} 2"
    ));
}
