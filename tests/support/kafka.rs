//! A Kafka client of the tests' own (librdkafka through the rdkafka crate, not gpuwarden's
//! code): what a test writes to a topic or reads back from one, on any of the brokers of
//! [`BrokerKind`](super::BrokerKind). kcat (Debian's, librdkafka 2.0.2) fails the handshake
//! with tansu (docs/src/operators/kafka-brokers.md), so the tests that run on both brokers use this instead.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

/// Settings for a client of the broker at `bootstrap`.
pub fn client(bootstrap: &str) -> ClientConfig {
    let mut client = ClientConfig::new();
    client.set("bootstrap.servers", bootstrap);
    client
}

/// Writes one record to `topic`, keyed `key`, with `headers`, and waits until the broker has it.
pub fn produce(bootstrap: &str, topic: &str, key: &str, payload: &str, headers: &[(&str, &str)]) {
    let producer: BaseProducer = client(bootstrap).create().unwrap();
    let mut record = BaseRecord::to(topic).key(key).payload(payload);
    if !headers.is_empty() {
        let mut owned = OwnedHeaders::new();
        for (name, value) in headers {
            owned = owned.insert(Header {
                key: name,
                value: Some(*value),
            });
        }
        record = record.headers(owned);
    }
    producer.send(record).map_err(|(e, _)| e).unwrap();
    producer
        .flush(Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("producing to {topic} on {bootstrap}: {e}"));
}

/// Sends each `(key, payload)` of `records` to `topic` on the broker at `bootstrap`, waiting
/// while the producer's queue is full, then waits until every one is delivered.
pub fn produce_all(
    bootstrap: &str,
    topic: &str,
    records: impl IntoIterator<Item = (String, String)>,
) {
    let producer: BaseProducer = client(bootstrap)
        .set("linger.ms", "5")
        .create()
        .expect("a producer for the test broker");
    for (key, payload) in records {
        while producer
            .send(BaseRecord::to(topic).key(&key).payload(&payload))
            .is_err()
        {
            producer.poll(Duration::from_millis(5));
        }
        producer.poll(Duration::ZERO);
    }
    producer
        .flush(Duration::from_secs(30))
        .expect("the test broker takes every record");
}
