//! Helpers shared by the collector's integration tests: a consumer that reads a whole topic back
//! from the broker, and sample builders.

#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use gpuwarden_schema::{Record, Sample, V1};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

pub fn client(bootstrap: &str) -> ClientConfig {
    let mut client = ClientConfig::new();
    client.set("bootstrap.servers", bootstrap);
    client
}

/// Reads every message of `topic` from the beginning until `expected` arrived or `timeout`
/// passed, decoding each as a Sample (a message that does not decode fails the test).
pub fn read_samples(
    bootstrap: &str,
    topic: &str,
    expected: usize,
    timeout: Duration,
) -> Vec<(String, Sample)> {
    let consumer: BaseConsumer = client(bootstrap)
        .set("group.id", format!("test-reader-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let mut assignment = TopicPartitionList::new();
    for p in metadata.topics()[0].partitions() {
        assignment
            .add_partition_offset(topic, p.id(), Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&assignment).unwrap();
    let mut out = Vec::new();
    let until = Instant::now() + timeout;
    while out.len() < expected && Instant::now() < until {
        if let Some(message) = consumer.poll(Duration::from_millis(100)) {
            let message = message.expect("reading the topic");
            let key = String::from_utf8(message.key().unwrap_or_default().to_vec()).unwrap();
            let sample = Sample::from_json(message.payload().unwrap_or_default())
                .unwrap_or_else(|e| panic!("a published message is not a valid Sample: {e}"));
            out.push((key, sample));
        }
    }
    // Anything beyond the expected count is a duplicate or a stray: read a little longer.
    let extra_until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < extra_until {
        if let Some(Ok(message)) = consumer.poll(Duration::from_millis(50)) {
            let sample = Sample::from_json(message.payload().unwrap_or_default()).unwrap();
            out.push((
                String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned(),
                sample,
            ));
        }
    }
    out
}

pub fn sample(gpu: &str, ts_ms: i64) -> Sample {
    Sample {
        v: V1,
        ts_ms,
        interval_ms: 5_000,
        host: "node-1".into(),
        gpu_uuid: gpu.into(),
        gpu_model: "NVIDIA H100 80GB HBM3".into(),
        util_gpu_pct: 50.0,
        mem_used_bytes: 1 << 30,
        mem_total_bytes: 80 << 30,
        gpu_index: Some(0),
        pci_bus_id: None,
        util_mem_pct: None,
        power_w: Some(300.0),
        power_limit_w: None,
        energy_mj: None,
        temp_c: None,
        sm_clock_mhz: None,
        process_count: None,
        lease_id: None,
        mig_profile: None,
        labels: None,
        sm_active_pct: None,
        sm_occupancy_pct: None,
        tensor_active_pct: None,
        dram_active_pct: None,
        gr_active_pct: None,
        mig_parent_uuid: None,
        mig_slices: None,
        mig_parent_slices: None,
        serving_requests: None,
    }
}
