//! What the end-to-end tests share, to drive the `gpuwarden` binary as an operator would. One
//! module a subject; the items most tests use are re-exported here (`support::Running`).
//!
//! - `config`: the config files the tests write ([`Config`] and its parts).
//! - `process`: a running `gpuwarden` and its JSON log, a command's output; `commands`: the
//!   commands tests start the same way (pipeline, collector, demo, the self-service commands).
//! - `wait`: [`eventually`], for what a process is expected to do.
//! - `http`: plain HTTP requests, `/metrics`, and a webhook that records alerts; `psql`: the
//!   SQL endpoint through psql or a raw client; `lake`: the lake read back with DataFusion.
//! - `broker`: the test's Kafka broker (mock or tansu, [`on_both_brokers!`]); `kafka`: the
//!   tests' own Kafka client; `tansu`: the independent broker.
//! - Services and fixtures of single suites: `accounts` (Unix accounts), `grafana` and
//!   `prometheus` (tests/dashboards.rs), `kube_api` (a Kubernetes API server), `libvirtd`,
//!   `pg` (PostgreSQL), `pki` (CAs and certificates), `rollups` (a lake of known rollups), `s3`
//!   (an S3-compatible server), `slurm` (a private Slurm cluster); `python`: the tests' venv.
//!
//! Every test binary includes this module and uses a part of it, hence the `allow` below.

#![allow(dead_code, unreachable_pub, unused_imports)]

pub mod accounts;
pub mod broker;
pub mod commands;
pub mod config;
pub mod grafana;
pub mod http;
pub mod kafka;
pub mod kube_api;
pub mod lake;
#[cfg(feature = "libvirt")]
pub mod libvirtd;
#[path = "postgres.rs"]
pub mod pg;
pub mod pki;
pub mod process;
pub mod prometheus;
pub mod psql;
pub mod python;
pub mod rollups;
pub mod s3;
pub mod slurm;
pub mod tansu;
pub mod wait;

pub(crate) use broker::on_both_brokers;
pub use broker::{Broker, BrokerKind};
pub use commands::{
    fake_nvml_library, metrics_address, self_service, sql_port, start_fake_nvml_collector,
    start_pipeline, start_pipeline_serving_sql, start_pipeline_with_sql, Demo,
};
pub use config::{sha256_hex, Config, Substrate, Team, Workload, H100};
pub use http::{http, http_get, metric, status_and_body, Webhook};
pub use lake::{
    config_lake_i64, files_under, ingest_samples, lake_i64, parquet_files, try_config_lake_i64,
    try_lake_i64,
};
pub use process::{
    log_line, process_state, sql_threads_busy, sql_threads_cpu, until_sql_threads_busy, Running,
};
pub use psql::{Answer, Psql};
pub use python::{venv_python, VENV_SETUP};
pub use wait::eventually;
