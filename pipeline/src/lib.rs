//! The pipeline: consumes the four topics into the Parquet lake, rolls samples up into utilization,
//! waste and cost per GPU, team and lease with DataFusion, computes signals for the enforcer over
//! its hot window, and serves every table over the Postgres wire protocol.
//!
//! It depends on `gpuwarden-schema` only: it meets the collector and the enforcer in Kafka topics.
//! Ingest, rollups, signals and the SQL endpoint arrive with their issues; this crate is where
//! they go.
