//! The pipeline: consumes the four topics into the lake's Delta tables, rolls samples up into
//! utilization, waste and cost per GPU, team and lease with DataFusion, compacts and expires the
//! raw tables, computes signals for the enforcer over its hot window, and serves every table over
//! the Postgres wire protocol.
//!
//! It depends on `gpuwarden-schema` only: it meets the collector and the enforcer in Kafka topics.
//! Ingest: [`consume`] (Kafka) and [`files`] (JSON lines) decode into [`buffer`]s, which writer
//! threads commit to the [`lake`]'s [`delta`] tables; [`metrics`] reports on it. Rollups:
//! [`rollup`] computes the derived tables from the lake and writes them back to it; [`compact`]
//! OPTIMIZEs final hours and [`retention`] deletes expired ones. Query: [`sql`] registers the
//! lake's tables in a DataFusion session, which [`endpoint`] serves to Postgres clients and
//! [`governor`] runs each query of, under its user's limits. Signals: [`hot`] keeps the hot
//! window from Kafka and publishes what [`signals`] computes.
//!
//! # Layers
//!
//! A module uses only modules above it in this list, never one below it (no cycle; the same
//! order is in docs/ARCHITECTURE.md#the-pipelines-modules):
//!
//! - [`base`]: the lake's errors (`LakeError`, `DeltaError`), Parquet encoding, hour names.
//! - [`bounds`]: event time against arrival: the bounds a record's time must keep, the fleet's
//!   watermark, each host's clock skew. [`governor`]: runs the queries people submit on threads
//!   of their own, under their limits.
//! - [`store`] (`base`): a lake in an S3-compatible object store: its client, keys, requests.
//! - [`delta`] (`base`, `store`): the lake's Delta tables: commits (ingest's appends with their
//!   offsets, an hour replaced, OPTIMIZE, DELETE), reads of a version, VACUUM.
//! - [`lease`] (`base`, `store`): a role's lock on a lake in an object store, as a lease object
//!   that expires.
//! - [`lake`] (`base`, `delta`, `lease`, `store`): the lake, in a directory or an object store:
//!   its tables, roles and state objects.
//! - [`buffer`] (`bounds`, `lake`): the raw tables and the rows waiting to be flushed to them.
//! - [`retention`] and [`migrate`] (`buffer`, `delta`, `lake`): deleting expired hours; moving
//!   a lake of the layout before Delta into its tables.
//! - [`rollup`] (`bounds`, `buffer`, `delta`, `lake`, `migrate`): the rollup tables, their
//!   schemas and how they are computed; `rollup::leases` rebuilds leases from their events.
//! - [`relocate`] (`buffer`, `delta`, `lake`, `migrate`, `rollup`): moving a lake to a new
//!   location.
//! - [`compact`] (`buffer`, `delta`, `lake`, `retention`, `rollup`): OPTIMIZE of final hours.
//! - [`metrics`] (`bounds`, `compact`): the pipeline's own Prometheus metrics.
//! - `writer` (`buffer`, `delta`, `lake`, `metrics`), then [`consume`] (the same and `bounds`,
//!   `writer`), then [`files`] (the same and `consume`): ingest.
//! - [`signals`] (`rollup`): signals as a pure function of the hot window.
//! - [`hot`] (`bounds`, `consume`, `delta`, `lake`, `metrics`, `rollup`, `signals`): the
//!   signals loop.
//! - [`sql`] (`buffer`, `delta`, `governor`, `lake`, `rollup`): the session over every table.
//! - [`endpoint`] (`delta`, `governor`): serves the session it is handed to Postgres clients.

pub mod base;
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
pub mod metrics;
pub mod migrate;
pub mod relocate;
pub mod retention;
pub mod rollup;
pub mod signals;
pub mod sql;
pub mod store;
mod writer;

pub use buffer::Table;
pub use compact::{CompactOptions, Compactor};
pub use consume::{IngestError, IngestOptions};
pub use hot::{SignalsError, SignalsOptions};
pub use lake::Lake;
pub use metrics::Metrics;
pub use rollup::{Rollup, RollupOptions, RollupTable};
