//! The collector: samples every GPU of a host (through NVML, or the simulated fleet described in
//! the config) and publishes `Sample` records to `gpuwarden.samples`, keyed by GPU UUID; serves
//! the GPU gauges on `/metrics` under dcgm-exporter's names, with its own `gpuwarden_collector_*`
//! metrics beside them.
//!
//! It depends on `gpuwarden-schema` only: it meets the pipeline and the enforcer in Kafka topics.
//! [`source`] runs the sampling thread over an [`nvml`] or [`sim`] source, [`sink`] publishes,
//! [`metrics`] counts and renders them for `/metrics`. On a Kubernetes node, [`kubelet`] tells
//! which pod holds each GPU; inside a virtual machine, [`guest`] reads the machine's lease from
//! its SMBIOS OEM strings.

pub mod guest;
pub mod kubelet;
pub mod metrics;
pub mod nvml;
pub mod sim;
pub mod sink;
pub mod source;

pub use metrics::Metrics;
pub use sink::{KafkaSink, SinkReport, SinkSettings};
pub use source::{Collector, SourceSpec, StartError};
