//! [`Sample`]: one GPU over one sampling interval, as the collector reads it from NVML (or the
//! simulated fleet) and publishes it on `gpuwarden.samples`.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, DataType, Schema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::arrow::{self as ax, field, Columns};
use crate::error::{ArrowConvertError, ValidationError};
use crate::record::Record;
use crate::version::V1;

/// The longest sampling interval a sample may cover: one hour, in milliseconds.
pub const MAX_INTERVAL_MS: i64 = 3_600_000;

/// The [`Sample::labels`] keys of a GPU that a Kubernetes pod holds, as the collector writes
/// them and the lake keeps them: the pod's namespace.
pub const NAMESPACE_LABEL: &str = "k8s_namespace";
/// The pod's name (see [`NAMESPACE_LABEL`]).
pub const POD_LABEL: &str = "k8s_pod";
/// The container's name, when known (see [`NAMESPACE_LABEL`]).
pub const CONTAINER_LABEL: &str = "k8s_container";

/// One GPU, one sampling interval: covers `[ts_ms - interval_ms, ts_ms)`.
///
/// Optional fields are `null` when the device cannot report them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(
    title = "Sample",
    description = "One GPU, one sampling interval: covers [ts_ms - interval_ms, ts_ms). Optional fields are null when the device cannot report them."
)]
pub struct Sample {
    /// Contract version.
    pub v: V1,
    /// End of the interval, Unix epoch milliseconds (UTC).
    pub ts_ms: i64,
    /// Length of the interval in milliseconds, 1..=3,600,000.
    #[schemars(range(min = 1, max = 3_600_000))]
    pub interval_ms: i64,
    /// Host name of the machine the GPU is in.
    pub host: String,
    /// The GPU's UUID as NVML reports it (`GPU-…`, or `MIG-…` for a MIG instance).
    pub gpu_uuid: String,
    /// The GPU's full model name as NVML reports it, e.g. `NVIDIA H100 80GB HBM3`.
    pub gpu_model: String,
    /// Mean GPU (SM) utilization over the interval, percent, 0..=100.
    #[schemars(range(min = 0.0, max = 100.0))]
    pub util_gpu_pct: f64,
    /// Framebuffer memory in use, bytes.
    pub mem_used_bytes: u64,
    /// Framebuffer memory in total, bytes; never less than `mem_used_bytes`.
    pub mem_total_bytes: u64,
    /// NVML index of the GPU on its host.
    pub gpu_index: Option<u32>,
    /// PCI bus id, e.g. `00000000:17:00.0`.
    pub pci_bus_id: Option<String>,
    /// Memory controller utilization, percent.
    pub util_mem_pct: Option<f64>,
    /// Power draw, watts.
    pub power_w: Option<f64>,
    /// Enforced power limit, watts.
    pub power_limit_w: Option<f64>,
    /// Total energy consumed since the driver loaded, millijoules.
    pub energy_mj: Option<u64>,
    /// GPU temperature, degrees Celsius.
    pub temp_c: Option<f64>,
    /// SM clock, MHz.
    pub sm_clock_mhz: Option<u32>,
    /// Number of compute processes on the GPU.
    pub process_count: Option<u32>,
    /// The lease this GPU's work belongs to, when the collector could tell.
    pub lease_id: Option<String>,
    /// MIG profile of the instance, e.g. `1g.10gb`.
    pub mig_profile: Option<String>,
    /// Free-form labels, e.g. `k8s_namespace`, `k8s_pod`, `slurm_job_id`.
    pub labels: Option<BTreeMap<String, String>>,
}

/// The rules of the Sample contract, shared by [`Sample`] and the pipeline's borrowed
/// [`crate::sample_row::SampleRow`] so both reject exactly the same records.
pub(crate) fn check(
    interval_ms: i64,
    util_gpu_pct: f64,
    mem_used_bytes: u64,
    mem_total_bytes: u64,
    energy_mj: Option<u64>,
) -> Result<(), ValidationError> {
    if !(1..=MAX_INTERVAL_MS).contains(&interval_ms) {
        return Err(ValidationError::new(
            "interval_ms",
            format!("{interval_ms} is outside 1..=3600000"),
        ));
    }
    if !(0.0..=100.0).contains(&util_gpu_pct) {
        return Err(ValidationError::new(
            "util_gpu_pct",
            format!("{util_gpu_pct} is outside 0..=100"),
        ));
    }
    if mem_used_bytes > mem_total_bytes {
        return Err(ValidationError::new(
            "mem_used_bytes",
            format!("{mem_used_bytes} is more than mem_total_bytes ({mem_total_bytes})"),
        ));
    }
    // The lake stores integers as Int64; larger values could not be written.
    for (name, value) in [
        ("mem_total_bytes", Some(mem_total_bytes)),
        ("energy_mj", energy_mj),
    ] {
        if value.is_some_and(|v| i64::try_from(v).is_err()) {
            return Err(ValidationError::new(name, "is larger than 2^63-1"));
        }
    }
    Ok(())
}

impl Record for Sample {
    const NAME: &'static str = "sample";
    const TOPIC: &'static str = crate::topics::SAMPLES;

    fn validate(&self) -> Result<(), ValidationError> {
        check(
            self.interval_ms,
            self.util_gpu_pct,
            self.mem_used_bytes,
            self.mem_total_bytes,
            self.energy_mj,
        )
    }

    fn key(&self) -> &str {
        &self.gpu_uuid
    }

    fn arrow_schema() -> Arc<Schema> {
        Arc::new(Schema::new(vec![
            field("v", DataType::Int64, false),
            field("ts_ms", DataType::Int64, false),
            field("interval_ms", DataType::Int64, false),
            field("host", DataType::Utf8, false),
            field("gpu_uuid", DataType::Utf8, false),
            field("gpu_model", DataType::Utf8, false),
            field("util_gpu_pct", DataType::Float64, false),
            field("mem_used_bytes", DataType::Int64, false),
            field("mem_total_bytes", DataType::Int64, false),
            field("gpu_index", DataType::Int64, true),
            field("pci_bus_id", DataType::Utf8, true),
            field("util_mem_pct", DataType::Float64, true),
            field("power_w", DataType::Float64, true),
            field("power_limit_w", DataType::Float64, true),
            field("energy_mj", DataType::Int64, true),
            field("temp_c", DataType::Float64, true),
            field("sm_clock_mhz", DataType::Int64, true),
            field("process_count", DataType::Int64, true),
            field("lease_id", DataType::Utf8, true),
            field("mig_profile", DataType::Utf8, true),
            field("labels", DataType::Utf8, true),
        ]))
    }

    fn to_record_batch(records: &[Self]) -> Result<RecordBatch, ArrowError> {
        let r = records;
        let labels: Vec<Option<String>> = r
            .iter()
            .map(|s| ax::labels_json(s.labels.as_ref()))
            .collect();
        RecordBatch::try_new(
            Self::arrow_schema(),
            vec![
                ax::i64s(r.iter().map(|_| Some(i64::from(V1::NUMBER)))),
                ax::i64s(r.iter().map(|s| Some(s.ts_ms))),
                ax::i64s(r.iter().map(|s| Some(s.interval_ms))),
                ax::strings(r.iter().map(|s| Some(s.host.as_str()))),
                ax::strings(r.iter().map(|s| Some(s.gpu_uuid.as_str()))),
                ax::strings(r.iter().map(|s| Some(s.gpu_model.as_str()))),
                ax::f64s(r.iter().map(|s| Some(s.util_gpu_pct))),
                ax::u64s("mem_used_bytes", r.iter().map(|s| Some(s.mem_used_bytes)))?,
                ax::u64s("mem_total_bytes", r.iter().map(|s| Some(s.mem_total_bytes)))?,
                ax::i64s(r.iter().map(|s| s.gpu_index.map(i64::from))),
                ax::strings(r.iter().map(|s| s.pci_bus_id.as_deref())),
                ax::f64s(r.iter().map(|s| s.util_mem_pct)),
                ax::f64s(r.iter().map(|s| s.power_w)),
                ax::f64s(r.iter().map(|s| s.power_limit_w)),
                ax::u64s("energy_mj", r.iter().map(|s| s.energy_mj))?,
                ax::f64s(r.iter().map(|s| s.temp_c)),
                ax::i64s(r.iter().map(|s| s.sm_clock_mhz.map(i64::from))),
                ax::i64s(r.iter().map(|s| s.process_count.map(i64::from))),
                ax::strings(r.iter().map(|s| s.lease_id.as_deref())),
                ax::strings(r.iter().map(|s| s.mig_profile.as_deref())),
                ax::strings(labels.iter().map(|l| l.as_deref())),
            ],
        )
    }

    fn from_record_batch(batch: &RecordBatch) -> Result<Vec<Self>, ArrowConvertError> {
        let c = Columns::new(batch);
        let (ts_ms, interval_ms) = (c.i64("ts_ms")?, c.i64("interval_ms")?);
        let (host, gpu_uuid, gpu_model) = (c.str("host")?, c.str("gpu_uuid")?, c.str("gpu_model")?);
        let util_gpu_pct = c.f64("util_gpu_pct")?;
        let (mem_used, mem_total) = (c.i64("mem_used_bytes")?, c.i64("mem_total_bytes")?);
        let (gpu_index, pci_bus_id) = (c.i64("gpu_index")?, c.str("pci_bus_id")?);
        let (util_mem, power, power_limit) = (
            c.f64("util_mem_pct")?,
            c.f64("power_w")?,
            c.f64("power_limit_w")?,
        );
        let (energy, temp, sm_clock) = (
            c.i64("energy_mj")?,
            c.f64("temp_c")?,
            c.i64("sm_clock_mhz")?,
        );
        let (process_count, lease_id) = (c.i64("process_count")?, c.str("lease_id")?);
        let (mig_profile, labels) = (c.str("mig_profile")?, c.str("labels")?);
        (0..batch.num_rows())
            .map(|i| {
                Ok(Sample {
                    v: V1,
                    ts_ms: ts_ms.req(i)?,
                    interval_ms: interval_ms.req(i)?,
                    host: host.req(i)?,
                    gpu_uuid: gpu_uuid.req(i)?,
                    gpu_model: gpu_model.req(i)?,
                    util_gpu_pct: util_gpu_pct.req(i)?,
                    mem_used_bytes: mem_used.req_as(i)?,
                    mem_total_bytes: mem_total.req_as(i)?,
                    gpu_index: gpu_index.opt_as(i)?,
                    pci_bus_id: pci_bus_id.opt(i),
                    util_mem_pct: util_mem.opt(i),
                    power_w: power.opt(i),
                    power_limit_w: power_limit.opt(i),
                    energy_mj: energy.opt_as(i)?,
                    temp_c: temp.opt(i),
                    sm_clock_mhz: sm_clock.opt_as(i)?,
                    process_count: process_count.opt_as(i)?,
                    lease_id: lease_id.opt(i),
                    mig_profile: mig_profile.opt(i),
                    labels: labels.labels(i)?,
                })
            })
            .collect()
    }
}
