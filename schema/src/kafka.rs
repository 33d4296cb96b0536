//! Kafka plumbing shared by every component (behind the `kafka` feature): client settings from
//! `[kafka]`, topic creation, and the embedded broker.
//!
//! The embedded broker is librdkafka's own mock cluster, a Kafka-protocol server that runs inside
//! the process. It stands in for Kafka in tests and the demo (`brokers = "embedded"`), and
//! `gpuwarden broker` hosts one as its own process so that separate processes meet over TCP as they
//! would in production. It keeps data in memory only, at most 5 MB or 100,000 batches per
//! partition: size tests for that.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::mocking::MockCluster;
use thiserror::Error;

use crate::config::KafkaConfig;

/// Kafka could not be set up.
#[derive(Debug, Error)]
pub enum KafkaSetupError {
    /// librdkafka refused to create a client or the mock cluster.
    #[error("cannot create the Kafka {what}: {source}")]
    Client {
        /// What was being created.
        what: &'static str,
        /// librdkafka's reason.
        source: KafkaError,
    },
    /// Creating a topic failed for a reason other than it existing already.
    #[error("cannot create topic {topic}: {reason}")]
    Topic {
        /// The topic.
        topic: String,
        /// The broker's reason.
        reason: String,
    },
    /// The embedded broker's thread ended before it reported its address.
    #[error("the embedded Kafka broker did not start")]
    EmbeddedGone,
}

/// librdkafka settings for any client of the configured cluster: `bootstrap.servers` (the given
/// address, which is the embedded broker's when `brokers = "embedded"`), `client.id`, and every
/// `[kafka.properties]` entry.
pub fn client_config(config: &KafkaConfig, bootstrap: &str, role: &str) -> ClientConfig {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", bootstrap)
        .set("client.id", format!("{}-{role}", config.client_id));
    for (key, value) in &config.properties {
        client.set(key, value);
    }
    client
}

/// Makes a consumer of a low-volume topic that something acts on (lease events, signals) hear of
/// a new record within 100 ms: librdkafka's default lets an empty fetch wait 500 ms, and the
/// mock cluster holds it that long even when a record arrives meanwhile. An explicit
/// `fetch.wait.max.ms` in `[kafka.properties]` wins.
pub fn low_latency(client: &mut ClientConfig) -> &mut ClientConfig {
    if client.get("fetch.wait.max.ms").is_none() {
        client.set("fetch.wait.max.ms", "100");
    }
    client
}

/// Creates the topics that do not exist yet; existing ones are left as they are.
///
/// Existing topics are found from the cluster's metadata first, so a cluster where they all exist
/// is never sent a CreateTopics request (librdkafka's mock cluster, for one, does not answer it).
pub fn ensure_topics(
    client: &ClientConfig,
    topics: &[&str],
    partitions: i32,
    replication: i32,
) -> Result<(), KafkaSetupError> {
    let admin: AdminClient<DefaultClientContext> =
        client.create().map_err(|source| KafkaSetupError::Client {
            what: "admin client",
            source,
        })?;
    let metadata = admin
        .inner()
        .fetch_metadata(None, Duration::from_secs(30))
        .map_err(|source| KafkaSetupError::Client {
            what: "metadata request",
            source,
        })?;
    let missing: Vec<&str> = topics
        .iter()
        .copied()
        .filter(|t| {
            !metadata
                .topics()
                .iter()
                .any(|m| m.name() == *t && m.error().is_none())
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let new: Vec<NewTopic<'_>> = missing
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(replication)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results =
        futures::executor::block_on(admin.create_topics(&new, &options)).map_err(|e| {
            KafkaSetupError::Topic {
                topic: topics.join(","),
                reason: e.to_string(),
            }
        })?;
    for result in results {
        match result {
            Ok(topic) => tracing::info!(topic = %topic, partitions, "created topic"),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(KafkaSetupError::Topic {
                    topic,
                    reason: code.to_string(),
                });
            }
        }
    }
    Ok(())
}

enum Control {
    Down(mpsc::Sender<Result<(), KafkaError>>),
    Up(mpsc::Sender<Result<(), KafkaError>>),
    Stop,
}

/// librdkafka's mock cluster, kept on a thread of its own (its handle cannot move between
/// threads) until this value is dropped.
#[derive(Debug)]
pub struct EmbeddedBroker {
    bootstrap: String,
    control: mpsc::Sender<Control>,
    thread: Option<JoinHandle<()>>,
}

impl EmbeddedBroker {
    /// Starts a one-broker mock cluster with gpuwarden's four topics created with `partitions`
    /// partitions each.
    pub fn start(partitions: i32) -> Result<Self, KafkaSetupError> {
        let (ready_tx, ready_rx) = mpsc::channel();
        let (control, control_rx) = mpsc::channel::<Control>();
        let thread = std::thread::Builder::new()
            .name("embedded-kafka".into())
            .spawn(move || {
                let cluster = match MockCluster::new(1) {
                    Ok(cluster) => cluster,
                    Err(source) => {
                        let _ = ready_tx.send(Err(KafkaSetupError::Client {
                            what: "mock cluster",
                            source,
                        }));
                        return;
                    }
                };
                for topic in crate::topics::ALL {
                    if let Err(source) = cluster.create_topic(topic, partitions, 1) {
                        let _ = ready_tx.send(Err(KafkaSetupError::Topic {
                            topic: topic.to_string(),
                            reason: source.to_string(),
                        }));
                        return;
                    }
                }
                let _ = ready_tx.send(Ok(cluster.bootstrap_servers()));
                while let Ok(command) = control_rx.recv() {
                    match command {
                        Control::Down(reply) => {
                            let _ = reply.send(cluster.broker_down(-1));
                        }
                        Control::Up(reply) => {
                            let _ = reply.send(cluster.broker_up(-1));
                        }
                        Control::Stop => break,
                    }
                }
            })
            .map_err(|_| KafkaSetupError::EmbeddedGone)?;
        let bootstrap = ready_rx
            .recv()
            .map_err(|_| KafkaSetupError::EmbeddedGone)??;
        tracing::info!(bootstrap = %bootstrap, partitions, "embedded Kafka broker started (in memory, bounded)");
        Ok(Self {
            bootstrap,
            control,
            thread: Some(thread),
        })
    }

    /// The `host:port` clients connect to.
    pub fn bootstrap_servers(&self) -> &str {
        &self.bootstrap
    }

    /// Makes the broker refuse connections (`down = true`) or accept them again: for outage
    /// tests. Data already stored is kept.
    pub fn set_down(&self, down: bool) -> Result<(), KafkaSetupError> {
        let (reply, answer) = mpsc::channel();
        let command = if down {
            Control::Down(reply)
        } else {
            Control::Up(reply)
        };
        self.control
            .send(command)
            .map_err(|_| KafkaSetupError::EmbeddedGone)?;
        answer
            .recv()
            .map_err(|_| KafkaSetupError::EmbeddedGone)?
            .map_err(|source| KafkaSetupError::Client {
                what: "mock broker state",
                source,
            })
    }
}

impl Drop for EmbeddedBroker {
    fn drop(&mut self) {
        let _ = self.control.send(Control::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
