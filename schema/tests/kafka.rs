//! The embedded broker and topic creation against it (only with the `kafka` feature).
#![cfg(feature = "kafka")]

use std::time::Duration;

use gpuwarden_schema::config::KafkaConfig;
use gpuwarden_schema::kafka::{client_config, ensure_topics, EmbeddedBroker};
use rdkafka::consumer::{BaseConsumer, Consumer};

#[test]
fn embedded_broker_has_the_four_topics_and_ensure_topics_leaves_them_be() {
    let broker = EmbeddedBroker::start(4).unwrap();
    let config = KafkaConfig::default();
    let client = client_config(&config, broker.bootstrap_servers(), "test");
    ensure_topics(&client, &gpuwarden_schema::topics::ALL, 4, 1).unwrap();
    // librdkafka's mock cluster does not answer CreateTopics, so creating a missing topic can
    // only be tested against a real Kafka; here, existing topics must not be re-created.
    let consumer: BaseConsumer = client.clone().set("group.id", "t").create().unwrap();
    let metadata = consumer
        .fetch_metadata(None, Duration::from_secs(10))
        .unwrap();
    for topic in gpuwarden_schema::topics::ALL {
        let t = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .unwrap_or_else(|| panic!("{topic} missing"));
        assert_eq!(t.partitions().len(), 4, "{topic}");
    }
}
