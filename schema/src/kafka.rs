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
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, Producer as _};
use thiserror::Error;

use crate::config::{Config, KafkaConfig};

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
    /// The brokers answered, but refused gpuwarden's login or its TLS handshake, or never
    /// answered the metadata request; `check` says what to look at.
    #[error("Kafka at {bootstrap}: {reason}; check {check}")]
    Broker {
        /// `bootstrap.servers`.
        bootstrap: String,
        /// librdkafka's words for what went wrong.
        reason: String,
        /// The settings or the part to check.
        check: &'static str,
    },
    /// The embedded broker's thread ended before it reported its address.
    #[error("the embedded Kafka broker did not start")]
    EmbeddedGone,
    /// No slot for a derived `group.instance.id` could be reserved under the data dir.
    #[error("cannot reserve a Kafka group.instance.id in {}: {source} (or set kafka.group_instance_id)", dir.display())]
    MemberSlot {
        /// The directory of the slot locks.
        dir: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
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

/// How a process joins its consumer groups: `[kafka]`'s `static_membership`,
/// `group_instance_id` and `session_timeout`, resolved once at start ([`GroupMembership::resolve`])
/// and put on each group consumer's settings ([`GroupMembership::apply`]).
///
/// With static membership (Kafka's KIP-345) a consumer that restarts with the same
/// `group.instance.id` takes its partitions back at once: the broker replaces the dead member by
/// the new one instead of waiting `session.timeout.ms` to forget it. Two live consumers of one
/// group must never share an id (the newer fences the older out), so a derived id is
/// `<host>-<data dir hash>-<n>` with `n` the first slot whose lock file
/// (`<data_dir>/kafka-members/<role>-<n>.lock`, a `flock` the kernel drops when the process dies)
/// no running process holds: a second instance on the same host and data dir takes the next
/// slot, and a restarted one gets its old slot back.
#[derive(Debug)]
pub struct GroupMembership {
    /// `group.instance.id`, when membership is static.
    instance_id: Option<String>,
    session_timeout: Duration,
    /// Reserves a derived id's slot while this value lives.
    _slot: Option<std::fs::File>,
}

/// Slots tried before giving up: far more instances than one host runs.
const MEMBER_SLOTS: usize = 256;

impl GroupMembership {
    /// The membership of the process playing `role` (`pipeline`, `enforcer`): static unless
    /// `kafka.static_membership = false` or the broker is the embedded one (it dies with the
    /// process, and with it the group), with `kafka.group_instance_id` or a derived id.
    pub fn resolve(config: &Config, role: &str) -> Result<Self, KafkaSetupError> {
        let kafka = &config.kafka;
        let mut membership = Self {
            instance_id: None,
            session_timeout: kafka.session_timeout,
            _slot: None,
        };
        if !kafka.static_membership || kafka.is_embedded() {
            return Ok(membership);
        }
        if let Some(id) = &kafka.group_instance_id {
            membership.instance_id = Some(id.clone());
            return Ok(membership);
        }
        let dir = config.storage.data_dir.join("kafka-members");
        let failed = |source| KafkaSetupError::MemberSlot {
            dir: dir.clone(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(failed)?;
        let data_dir = std::fs::canonicalize(&config.storage.data_dir)
            .unwrap_or_else(|_| config.storage.data_dir.clone());
        let (slot, file) = reserve_slot(&dir, role).map_err(failed)?;
        membership.instance_id = Some(derived_instance_id(&host_name(), &data_dir, slot));
        membership._slot = Some(file);
        Ok(membership)
    }

    /// `group.instance.id`; `None` when membership is dynamic.
    pub fn instance_id(&self) -> Option<&str> {
        self.instance_id.as_deref()
    }

    /// Sets `group.instance.id`, `session.timeout.ms` and `heartbeat.interval.ms` (a tenth of the
    /// session, at most 3 s) on a group consumer's settings. Each one already set in
    /// `[kafka.properties]` wins.
    pub fn apply<'c>(&self, client: &'c mut ClientConfig) -> &'c mut ClientConfig {
        if let Some(id) = &self.instance_id {
            if client.get("group.instance.id").is_none() {
                client.set("group.instance.id", id);
            }
        }
        if client.get("session.timeout.ms").is_none() {
            client.set(
                "session.timeout.ms",
                self.session_timeout.as_millis().to_string(),
            );
        }
        if client.get("heartbeat.interval.ms").is_none() {
            let session_ms = client
                .get("session.timeout.ms")
                .and_then(|ms| ms.parse::<u64>().ok())
                .unwrap_or(45_000);
            client.set(
                "heartbeat.interval.ms",
                (session_ms / 10).clamp(100, 3_000).to_string(),
            );
        }
        client
    }
}

/// Takes the first free slot lock of `role` in `dir`.
fn reserve_slot(dir: &std::path::Path, role: &str) -> std::io::Result<(usize, std::fs::File)> {
    for slot in 0..MEMBER_SLOTS {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(format!("{role}-{slot}.lock")))?;
        match file.try_lock() {
            Ok(()) => return Ok((slot, file)),
            Err(std::fs::TryLockError::WouldBlock) => continue,
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
    }
    Err(std::io::Error::other(format!(
        "all {MEMBER_SLOTS} slots are held by running processes"
    )))
}

/// `<host>-<first 8 hex digits of the data dir's SHA-256>-<slot>`, in the characters Kafka
/// allows in a `group.instance.id` (any other becomes `_`) and within its 249.
fn derived_instance_id(host: &str, data_dir: &std::path::Path, slot: usize) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(data_dir.as_os_str().as_encoded_bytes());
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(200)
        .collect();
    format!("{host}-{}-{slot}", hex::encode(&digest[..4]))
}

/// The machine's host name (a container's is its own, e.g. the pod name).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "localhost".into())
}

/// A client context that keeps what librdkafka's error callback said last, so that a failed
/// request can say why (a refused login, a failed TLS handshake) instead of timing out.
#[derive(Debug, Default)]
struct SetupContext {
    last: std::sync::Mutex<Option<(Option<RDKafkaErrorCode>, String)>>,
}

impl rdkafka::ClientContext for SetupContext {
    fn error(&self, error: KafkaError, reason: &str) {
        let reason = if reason.is_empty() {
            error.to_string()
        } else {
            reason.to_string()
        };
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((error.rdkafka_error_code(), reason));
    }
}

impl rdkafka::producer::ProducerContext for SetupContext {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &rdkafka::producer::DeliveryResult<'_>, _: ()) {}
}

impl SetupContext {
    /// The last error, when it is one that retrying will not mend: a refused login, a failed
    /// TLS handshake, an authorization failure.
    fn refusal(&self) -> Option<(Option<RDKafkaErrorCode>, String)> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.clone().filter(|(code, _)| refused(*code))
    }
}

/// Errors that mean the brokers answered and said no: retrying with the same settings will not
/// change the answer.
fn refused(code: Option<RDKafkaErrorCode>) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        Some(
            C::Authentication
                | C::SaslAuthenticationFailed
                | C::SSL
                | C::TopicAuthorizationFailed
                | C::ClusterAuthorizationFailed
        )
    )
}

/// A client whose error events are served (a producer's poll serves its main queue, where
/// librdkafka puts them), for [`metadata`] and [`check_login`].
fn setup_client(client: &ClientConfig) -> Result<BaseProducer<SetupContext>, KafkaSetupError> {
    client
        .create_with_context(SetupContext::default())
        .map_err(|source| KafkaSetupError::Client {
            what: "client",
            source,
        })
}

/// The cluster's metadata, asked for once a second until `timeout`; a refusal (see [`refused`])
/// ends the wait at once with the broker's reason and the settings to check.
fn metadata(
    client: &ClientConfig,
    timeout: Duration,
) -> Result<rdkafka::metadata::Metadata, KafkaSetupError> {
    let probe = setup_client(client)?;
    let bootstrap = client
        .get("bootstrap.servers")
        .unwrap_or_default()
        .to_string();
    let until = std::time::Instant::now() + timeout;
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        let result = probe
            .client()
            .fetch_metadata(None, left.min(Duration::from_secs(1)));
        let source = match result {
            Ok(metadata) => return Ok(metadata),
            Err(source) => source,
        };
        probe.poll(Duration::ZERO);
        let context = probe.context();
        if let Some((code, reason)) = context.refusal() {
            return Err(KafkaSetupError::Broker {
                bootstrap,
                reason,
                check: hint(code),
            });
        }
        if std::time::Instant::now() >= until {
            let last = context
                .last
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            return Err(match last {
                Some((code, reason)) => KafkaSetupError::Broker {
                    bootstrap,
                    reason,
                    check: hint(code),
                },
                None => KafkaSetupError::Client {
                    what: "metadata request",
                    source,
                },
            });
        }
    }
}

/// The cluster's metadata (brokers, topics, partitions), asked for until `timeout` as
/// [`ensure_topics`] asks for it: a refused login or TLS handshake ends the wait at once, with
/// the broker's reason and the settings to check. For a command that examines the brokers rather
/// than waits for them (`gpuwarden doctor`).
pub fn cluster_metadata(
    client: &ClientConfig,
    timeout: Duration,
) -> Result<rdkafka::metadata::Metadata, KafkaSetupError> {
    metadata(client, timeout)
}

/// Fails when the brokers answer and say no (a refused SASL login, a failed TLS handshake, an
/// authorization failure); passes
/// when they accept it, when they cannot be reached, and when `wait` passes without an answer:
/// for a command that starts while Kafka is down and waits for it (the enforcer).
pub fn check_login(client: &ClientConfig, wait: Duration) -> Result<(), KafkaSetupError> {
    use RDKafkaErrorCode as C;
    let probe = setup_client(client)?;
    let until = std::time::Instant::now() + wait;
    while std::time::Instant::now() < until {
        if probe
            .client()
            .fetch_metadata(None, Duration::from_millis(250))
            .is_ok()
        {
            return Ok(());
        }
        probe.poll(Duration::ZERO);
        let context = probe.context();
        if let Some((code, reason)) = context.refusal() {
            return Err(KafkaSetupError::Broker {
                bootstrap: client
                    .get("bootstrap.servers")
                    .unwrap_or_default()
                    .to_string(),
                reason,
                check: hint(code),
            });
        }
        let last = context
            .last
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some((Some(C::AllBrokersDown | C::Resolve), _)) = last {
            return Ok(());
        }
    }
    Ok(())
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
    let metadata = metadata(client, Duration::from_secs(30))?;
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
    let admin: AdminClient<rdkafka::client::DefaultClientContext> =
        client.create().map_err(|source| KafkaSetupError::Client {
            what: "admin client",
            source,
        })?;
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

/// What the Kafka clients of this process heard from the brokers that went wrong, by error:
/// librdkafka's error callback (a broker down, a failed authentication), a consumer's poll, a
/// delivery report. Each is counted for `/metrics` (`gpuwarden_kafka_errors_total{error}`) and
/// logged once per ten seconds and error with what to check, so that a broker answering
/// every request with an error makes one line every ten seconds, not one per retry.
///
/// Process-wide: the components of `gpuwarden up` share one `/metrics` family per process.
#[derive(Debug, Default)]
pub struct BrokerErrors {
    seen: std::sync::Mutex<std::collections::BTreeMap<String, Seen>>,
}

#[derive(Debug, Default)]
struct Seen {
    count: u64,
    log: crate::log_throttle::Throttle,
}

/// The errors of this process's Kafka clients; see [`BrokerErrors`].
pub fn broker_errors() -> &'static BrokerErrors {
    static ERRORS: std::sync::OnceLock<BrokerErrors> = std::sync::OnceLock::new();
    ERRORS.get_or_init(BrokerErrors::default)
}

impl BrokerErrors {
    /// Counts and (at most every ten seconds per error) logs `error` that the `client` (the
    /// component: `collector`, `pipeline`, `enforcer`) got, with librdkafka's `reason` when it
    /// gave one.
    pub fn report(&self, client: &str, error: &KafkaError, reason: &str) {
        let code = error.rdkafka_error_code();
        let name = code.map_or_else(|| "other".to_string(), |c| format!("{c:?}"));
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let entry = seen.entry(name.clone()).or_default();
        entry.count += 1;
        let Some(held) = entry.log.ready() else {
            return;
        };
        let times = held + 1;
        drop(seen);
        let reason = if reason.is_empty() {
            error.to_string()
        } else {
            reason.to_string()
        };
        tracing::warn!(
            client,
            error = %name,
            reason = %reason,
            times,
            check = hint(code),
            "Kafka broker error"
        );
    }

    /// `gpuwarden_kafka_errors_total{error}`, in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let samples: Vec<(String, f64)> = seen
            .iter()
            .map(|(name, s)| {
                (
                    format!("error=\"{}\"", crate::prom::escape(name)),
                    s.count as f64,
                )
            })
            .collect();
        crate::prom::family(
            out,
            "gpuwarden_kafka_errors_total",
            "counter",
            "Errors this process's Kafka clients got from or about the brokers, by librdkafka error code.",
            samples.iter().map(|(l, v)| (l.as_str(), *v)),
        );
    }
}

/// What an operator checks first for an error, in the words of gpuwarden's settings.
fn hint(code: Option<RDKafkaErrorCode>) -> &'static str {
    use RDKafkaErrorCode as C;
    match code {
        Some(C::AllBrokersDown | C::BrokerTransportFailure | C::Resolve) => {
            "that kafka.brokers is right and the brokers are up; records wait in memory meanwhile"
        }
        Some(C::Authentication | C::SaslAuthenticationFailed) => {
            "sasl.mechanism, sasl.username and sasl.password in [kafka.properties]"
        }
        Some(C::SSL) => {
            "the ssl.* settings in [kafka.properties] (CA, certificate, host name) and security.protocol"
        }
        Some(
            C::TopicAuthorizationFailed
            | C::GroupAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::TransactionalIdAuthorizationFailed,
        ) => "the ACLs of gpuwarden's user: it reads and writes the gpuwarden.* topics and uses its consumer groups",
        Some(C::UnknownTopic | C::UnknownTopicOrPartition | C::UnknownPartition) => {
            "that the gpuwarden.* topics exist (gpuwarden creates them at start; one deleted since is not made again)"
        }
        Some(C::ThrottlingQuotaExceeded) => "the broker's quotas for gpuwarden's client ids",
        _ => "the broker's log",
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config(data_dir: &std::path::Path, kafka: &str) -> Config {
        let text = format!(
            "[kafka]\nbrokers = \"k1:9092\"\n{kafka}\n[storage]\ndata_dir = \"{}\"\n",
            data_dir.display()
        );
        crate::config::parse("t.toml", &text).unwrap()
    }

    #[test]
    fn a_derived_id_is_distinct_per_running_instance_and_returns_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let c = config(dir.path(), "");
        let first = GroupMembership::resolve(&c, "pipeline").unwrap();
        let second = GroupMembership::resolve(&c, "pipeline").unwrap();
        let (a, b) = (first.instance_id().unwrap(), second.instance_id().unwrap());
        assert_ne!(a, b, "two instances on one host and data dir");
        assert!(a.ends_with("-0") && b.ends_with("-1"), "{a} {b}");
        // Another role has slots of its own: its group is another one.
        let enforcer = GroupMembership::resolve(&c, "enforcer").unwrap();
        assert_eq!(enforcer.instance_id(), Some(a));
        // The first one dies; its restart gets its id back, not the second's.
        let a = a.to_string();
        drop(first);
        let restarted = GroupMembership::resolve(&c, "pipeline").unwrap();
        assert_eq!(restarted.instance_id(), Some(a.as_str()));
        assert!(
            a.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')),
            "{a}"
        );

        // Another data dir on the same host: another id.
        let other_dir = tempfile::tempdir().unwrap();
        let other = GroupMembership::resolve(&config(other_dir.path(), ""), "pipeline").unwrap();
        assert_ne!(other.instance_id(), Some(a.as_str()));
        assert!(other.instance_id().unwrap().ends_with("-0"));
    }

    #[test]
    fn the_configured_id_dynamic_membership_and_the_embedded_broker() {
        let dir = tempfile::tempdir().unwrap();
        let named = config(dir.path(), "group_instance_id = \"ingest-a\"");
        let m = GroupMembership::resolve(&named, "pipeline").unwrap();
        assert_eq!(m.instance_id(), Some("ingest-a"));
        let dynamic = config(dir.path(), "static_membership = false");
        assert_eq!(
            GroupMembership::resolve(&dynamic, "pipeline")
                .unwrap()
                .instance_id(),
            None
        );
        let mut embedded = config(dir.path(), "");
        embedded.kafka.brokers = "embedded".into();
        assert_eq!(
            GroupMembership::resolve(&embedded, "pipeline")
                .unwrap()
                .instance_id(),
            None
        );
    }

    #[test]
    fn settings_go_on_the_consumer_and_properties_win() {
        let dir = tempfile::tempdir().unwrap();
        let c = config(
            dir.path(),
            "group_instance_id = \"i-1\"\nsession_timeout = \"20s\"",
        );
        let m = GroupMembership::resolve(&c, "pipeline").unwrap();
        let mut client = ClientConfig::new();
        m.apply(&mut client);
        assert_eq!(client.get("group.instance.id"), Some("i-1"));
        assert_eq!(client.get("session.timeout.ms"), Some("20000"));
        assert_eq!(client.get("heartbeat.interval.ms"), Some("2000"));

        // An explicit session.timeout.ms sets the heartbeat's pace too.
        let mut client = ClientConfig::new();
        client.set("session.timeout.ms", "6000");
        m.apply(&mut client);
        assert_eq!(client.get("session.timeout.ms"), Some("6000"));
        assert_eq!(client.get("heartbeat.interval.ms"), Some("600"));
    }
}
