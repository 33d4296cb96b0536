//! The collector: samples every GPU of a host (through NVML, or the simulated fleet described in
//! the config) and publishes `Sample` records to `gpuwarden.samples`, keyed by GPU UUID; serves
//! the GPU gauges on `/metrics` under dcgm-exporter's names.
//!
//! It depends on `gpuwarden-schema` only: it meets the pipeline and the enforcer in Kafka topics.
//! Its sources, sink and metrics arrive with the collector issue; this crate is the place they go.
