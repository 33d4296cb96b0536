//! A Kafka client of the tests' own (librdkafka through the rdkafka crate, not gpuwarden's
//! code): what a test writes to a topic or reads back from one, on any of the brokers of
//! [`BrokerKind`](super::BrokerKind). kcat (Debian's, librdkafka 2.0.2) fails the handshake
//! with tansu (docs/kafka-brokers.md), so the tests that run on both brokers use this instead.

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
