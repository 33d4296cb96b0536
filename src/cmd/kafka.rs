//! Connecting a command to the configured Kafka: the brokers named in `[kafka]`, or an embedded
//! broker started in this process when `brokers = "embedded"`.

use anyhow::Context as _;
use gpuwarden_enforcer::kafka::outbox::TopicSetup;
use gpuwarden_schema::config::Config;
use gpuwarden_schema::kafka::{self, EmbeddedBroker};
use rdkafka::config::ClientConfig;

/// How long a command that may start while Kafka is down waits to hear whether the brokers
/// accept its login ([`KafkaConnection::open_lazy`]).
const LOGIN_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// A connection to Kafka that lives as long as the command (the embedded broker with it).
pub(crate) struct KafkaConnection {
    pub(crate) bootstrap: String,
    /// Kept for as long as the connection: dropping it stops the embedded broker.
    _embedded: Option<EmbeddedBroker>,
    config: gpuwarden_schema::config::KafkaConfig,
}

impl KafkaConnection {
    pub(crate) fn open(config: &Config) -> anyhow::Result<Self> {
        let kafka = &config.kafka;
        if kafka.is_embedded() {
            let broker = EmbeddedBroker::start(kafka.partitions)
                .context("starting the embedded Kafka broker")?;
            Ok(Self {
                bootstrap: broker.bootstrap_servers().to_string(),
                _embedded: Some(broker),
                config: kafka.clone(),
            })
        } else {
            let connection = Self {
                bootstrap: kafka.brokers.clone(),
                _embedded: None,
                config: kafka.clone(),
            };
            kafka::ensure_topics(
                &connection.client("admin"),
                &gpuwarden_schema::topics::ALL,
                kafka.partitions,
                kafka.replication_factor,
            )
            .with_context(|| format!("creating gpuwarden's topics on {}", kafka.brokers))?;
            Ok(connection)
        }
    }

    /// Like [`open`](Self::open), but does not wait for an external cluster: a command that
    /// must start while Kafka is down (the enforcer, whose outbox waits for it) hands
    /// [`topic_setup`](Self::topic_setup) to what creates the topics later, when it can. It
    /// does fail when the brokers answer and refuse the login or the TLS handshake.
    pub(crate) fn open_lazy(config: &Config) -> anyhow::Result<Self> {
        if config.kafka.is_embedded() {
            return Self::open(config);
        }
        let connection = Self {
            bootstrap: config.kafka.brokers.clone(),
            _embedded: None,
            config: config.kafka.clone(),
        };
        // Kafka may be down, but a login it refuses will not mend by waiting: say so now.
        kafka::check_login(&connection.client("admin"), LOGIN_CHECK)
            .with_context(|| format!("logging in to Kafka at {}", config.kafka.brokers))?;
        Ok(connection)
    }

    /// What creating gpuwarden's topics on this cluster takes; none for the embedded broker,
    /// which has them from its start.
    pub(crate) fn topic_setup(&self) -> Option<TopicSetup> {
        if self._embedded.is_some() {
            return None;
        }
        Some(TopicSetup {
            admin: self.client("admin"),
            partitions: self.config.partitions,
            replication: self.config.replication_factor,
        })
    }

    /// Client settings for a client playing `role` (it names the client to the brokers).
    pub(crate) fn client(&self, role: &str) -> ClientConfig {
        kafka::client_config(&self.config, &self.bootstrap, role)
    }
}

/// Waits for Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => tracing::info!("interrupted; shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM; shutting down"),
    }
}

/// Bounds how long shutting down may take: once `deadline` has passed (or at a second Ctrl-C or
/// SIGTERM), the process exits with status 1 whatever it was doing. Nothing is lost: what was
/// not committed to Kafka is read again at the next start. `setting` names the deadline's
/// setting in the log.
pub(crate) fn arm_shutdown_deadline(deadline: std::time::Duration, setting: &'static str) {
    let watchdog = std::thread::Builder::new()
        .name("gpuwarden-shutdown-deadline".into())
        .spawn(move || {
            std::thread::sleep(deadline);
            tracing::error!(
                deadline = %humantime::format_duration(deadline),
                setting,
                "not stopped within the shutdown deadline; exiting now (what was not committed is read again at the next start)"
            );
            std::process::exit(1);
        });
    if let Err(e) = watchdog {
        tracing::warn!(error = %e, "cannot bound the shutdown: no watchdog thread");
    }
    tokio::spawn(async {
        shutdown_signal().await;
        tracing::warn!("second signal; exiting now");
        std::process::exit(1);
    });
}
