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
//!
//! # Layers
//!
//! Modules are declared lowest layer first; a module uses only modules above it in this list
//! (`tests/workspace.rs` checks it):
//!
//! - [`metrics`]: the collector's counters and the `/metrics` text;
//! - [`environ`]: a process's environment, where it names its lease;
//! - [`serving`] (`environ`): a workload's own measure of serving, scraped from its endpoint;
//! - [`guest`]: the lease of the virtual machine the collector runs in;
//! - [`kubelet`] (`environ`, `metrics`): which pod holds which GPU;
//! - [`nvml`] (`environ`, `guest`, `kubelet`, `metrics`, `serving`): the NVML source;
//! - [`sim`]: the simulated fleet, the other source;
//! - [`sink`] (`metrics`): publishing to Kafka;
//! - [`source`] (`kubelet`, `metrics`, `nvml`, `sim`, `sink`): the sampling loop over a source
//!   and the sink.

pub mod metrics;
pub mod environ;
pub mod serving;
pub mod guest;
pub mod kubelet;
pub mod nvml;
pub mod sim;
pub mod sink;
pub mod source;

pub use metrics::Metrics;
pub use sink::{KafkaSink, SinkReport, SinkSettings};
pub use source::{Collector, SourceSpec, StartError};
