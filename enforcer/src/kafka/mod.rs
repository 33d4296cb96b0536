//! The enforcer's two Kafka edges: [`outbox`] publishes what the lease store records (lease
//! events and actions) and [`signals`] feeds the pipeline's signals to the runtime rules.
//!
//! Both are handed an `rdkafka` [`ClientConfig`](rdkafka::config::ClientConfig) carrying the
//! bootstrap servers and `[kafka.properties]` (built by
//! [`gpuwarden_schema::kafka::client_config`]), as the collector's and the pipeline's Kafka code
//! is; connecting to the configured cluster, or starting the embedded broker, stays with the
//! command that runs them.

pub mod outbox;
pub mod signals;
