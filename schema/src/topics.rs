//! Kafka topic names. Each record type has one topic; the key is named beside it.

/// Per-GPU telemetry samples, keyed by GPU UUID so one GPU's samples stay ordered in one partition.
pub const SAMPLES: &str = "gpuwarden.samples";
/// Lease events from the enforcer, keyed by lease id.
pub const LEASES: &str = "gpuwarden.leases";
/// Signals computed by the pipeline, keyed by lease id (or GPU UUID, or team, by kind).
pub const SIGNALS: &str = "gpuwarden.signals";
/// The enforcer's audit trail, keyed by lease id (or team where no lease is involved).
pub const ACTIONS: &str = "gpuwarden.actions";

/// All four topics, in the order the pipeline subscribes to them.
pub const ALL: [&str; 4] = [SAMPLES, LEASES, SIGNALS, ACTIONS];
