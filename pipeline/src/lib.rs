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
//! Modules are declared lowest layer first; a module uses only modules above it in this list
//! (each declaration's comment names them), never one below it, so there is no cycle. The same
//! order is in docs/ARCHITECTURE.md#the-pipelines-modules. Each declaration stands alone, so that
//! rustfmt keeps the order.

// base: the lake's errors (`LakeError`, `DeltaError`), Parquet encoding, hour names.
pub mod base;

// bounds: event time against arrival: the bounds a record's time must keep, the fleet's watermark,
// each host's clock skew.
pub mod bounds;

// governor: runs the queries people submit on threads of their own, under their limits.
pub mod governor;

// objects (base): the object-store client of a lake in an S3-compatible bucket: keys, requests.
pub mod objects;

// delta (base, objects): the lake's Delta tables: commits (ingest's appends with their offsets, an
// hour replaced, OPTIMIZE, DELETE), reads of a version, VACUUM.
pub mod delta;

// bucket_lock (base, objects): a role's lock on a lake in a bucket, as an object that expires.
pub mod bucket_lock;

// lake (base, bucket_lock, delta, objects): the lake, in a directory or a bucket: its tables,
// roles and state objects.
pub mod lake;

// buffer (bounds, lake): the raw tables and the rows waiting to be flushed to them.
pub mod buffer;

// retention (buffer, delta, lake): deleting expired hours.
pub mod retention;

// migrate (buffer, delta, lake): moving a lake of the layout before Delta into its tables.
pub mod migrate;

// rollup (bounds, buffer, delta, lake, migrate): the rollup tables, their columns and queries, and
// running them; `rollup::leases` rebuilds GPU leases from their events.
pub mod rollup;

// relocate (buffer, delta, lake, migrate, rollup): moving a lake to a new location.
pub mod relocate;

// sql (buffer, delta, governor, lake, rollup): the session over every table.
pub mod sql;

// compact (buffer, delta, lake, migrate, retention, rollup; sql in its tests): OPTIMIZE of final
// hours.
pub mod compact;

// metrics (bounds, compact): the pipeline's own Prometheus metrics.
pub mod metrics;

// writer (buffer, delta, lake, metrics): the writer threads of ingest.
mod writer;

// consume (bounds, buffer, delta, lake, metrics, writer): ingest from Kafka.
pub mod consume;

// files (bounds, buffer, consume, delta, lake, metrics): ingest from JSON lines files.
pub mod files;

// signals (rollup): signals as a pure function of the hot window.
pub mod signals;

// hot (bounds, consume, delta, lake, metrics, rollup, signals): the signals loop.
pub mod hot;

// endpoint (delta, governor, metrics): serves the session it is handed to Postgres clients.
pub mod endpoint;

pub use buffer::Table;
pub use compact::{CompactOptions, Compactor};
pub use consume::{IngestError, IngestOptions};
pub use hot::{SignalsError, SignalsOptions};
pub use lake::Lake;
pub use metrics::Metrics;
pub use rollup::{Rollup, RollupOptions, RollupTable};
