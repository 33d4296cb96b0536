//! The pipeline: consumes the four topics into the Parquet lake, rolls samples up into utilization,
//! waste and cost per GPU, team and lease with DataFusion, computes signals for the enforcer over
//! its hot window, and serves every table over the Postgres wire protocol.
//!
//! It depends on `gpuwarden-schema` only: it meets the collector and the enforcer in Kafka topics.
//! Ingest: [`consume`] (Kafka) and [`files`] (JSON lines) decode into [`buffer`]s, which writer
//! threads flush into the [`lake`]; [`metrics`] reports on it. Query: [`sql`] registers the
//! lake's tables in a DataFusion session, which [`endpoint`] serves to Postgres clients.
//! Signals: [`hot`] keeps the hot window from Kafka and publishes what [`signals`] computes.

pub mod buffer;
pub mod consume;
pub mod endpoint;
pub mod files;
pub mod hot;
pub mod lake;
pub mod metrics;
pub mod rollup;
pub mod signals;
pub mod sql;
pub mod versions;
mod writer;

pub use buffer::Table;
pub use consume::{IngestError, IngestOptions};
pub use hot::{SignalsError, SignalsOptions};
pub use lake::Lake;
pub use metrics::Metrics;
pub use rollup::{Rollup, RollupOptions};
