//! The pipeline: consumes the four topics into the Parquet lake, rolls samples up into utilization,
//! waste and cost per GPU, team and lease with DataFusion, computes signals for the enforcer over
//! its hot window, and serves every table over the Postgres wire protocol.
//!
//! It depends on `gpuwarden-schema` only: it meets the collector and the enforcer in Kafka topics.
//! Ingest: [`consume`] (Kafka) and [`files`] (JSON lines) decode into [`buffer`]s, which writer
//! threads flush into the [`lake`]; [`metrics`] reports on it. Rollups: [`rollup`] computes the
//! derived tables from the lake and writes them back to it. Query: [`sql`] registers the lake's
//! tables in a DataFusion session, which [`endpoint`] serves to Postgres clients and [`governor`]
//! runs each query of, under its user's limits. Signals: [`hot`]
//! keeps the hot window from Kafka and publishes what [`signals`] computes.
//!
//! # Layers
//!
//! A module uses only modules above it in this list, never one below it:
//!
//! - [`versions`]: keeps the lake files a query listed readable while they are replaced.
//! - [`store`] (uses `versions`; its errors are `lake`'s `LakeError`): a lake in an
//!   S3-compatible object store: its client, keys, requests, and the reader DataFusion lists it
//!   through.
//! - [`delta`] (uses `store`, `lake`'s `hour_partition` and Parquet settings): the lake's
//!   Delta tables: their logs, commits that replace an hour, and reads of a version.
//! - [`lake`] (uses `versions`, `store`, `delta`): the lake's files, in a directory or an object
//!   store, their partitions, marks and locks.
//! - [`lease`] (uses `store`, `lake`'s `LakeError`): a role's lock on a lake in an object store,
//!   as a lease object that expires.
//! - [`bounds`]: event time against arrival: the bounds a record's time must keep, the fleet's
//!   watermark, each host's clock skew.
//! - [`buffer`] (uses `bounds`, `lake`): the raw tables and the rows waiting to be flushed to
//!   them.
//! - [`metrics`] (uses `bounds`): the pipeline's own Prometheus metrics.
//! - [`listing`]: a directory of the lake as a DataFusion table.
//! - `writer` (`buffer`, `lake`, `metrics`), then [`consume`] (the same and `writer`), then
//!   [`files`] (the same and `consume`): ingest.
//! - [`rollup`] (`buffer`, `lake`, `listing`): the rollup tables, their schemas and how they are
//!   computed; `rollup::leases` rebuilds leases from their events.
//! - [`signals`] (`rollup::leases`): signals as a pure function of the hot window.
//! - [`hot`] (`consume`, `lake`, `listing`, `metrics`, `rollup`, `signals`, `versions`): the
//!   signals loop.
//! - [`governor`]: runs the queries people submit on threads of their own, under their limits.
//! - [`sql`] (`buffer`, `governor`, `lake`, `listing`, `rollup`, `store`, `versions`): the session over
//!   every table.
//! - [`endpoint`] (`governor`): serves the session it is handed to Postgres clients.

pub mod bounds;
pub mod buffer;
pub mod compact;
pub mod consume;
pub mod delta;
pub mod endpoint;
pub mod files;
pub mod governor;
pub mod hot;
pub mod lake;
pub mod lease;
pub mod listing;
pub mod metrics;
pub mod retention;
pub mod rollup;
pub mod signals;
pub mod sql;
pub mod store;
pub mod versions;
mod writer;

pub use buffer::Table;
pub use compact::{CompactOptions, Compactor};
pub use consume::{IngestError, IngestOptions};
pub use hot::{SignalsError, SignalsOptions};
pub use lake::Lake;
pub use metrics::Metrics;
pub use rollup::{Rollup, RollupOptions, RollupTable};
