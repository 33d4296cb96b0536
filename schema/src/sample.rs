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
    /// Share of time the SMs had at least one warp resident, averaged over all SMs, percent
    /// (NVML GPM `SM_UTIL`; DCGM's `PROF_SM_ACTIVE`). Only GPUs with GPM (Hopper and later, or
    /// a MIG instance of one) report it. A GPU spinning one tiny kernel, or stuck in a
    /// collective, reads 100 % in `util_gpu_pct` and near 0 here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 100.0))]
    pub sm_active_pct: Option<f64>,
    /// Warps resident per SM over the most an SM can hold, averaged, percent (GPM
    /// `SM_OCCUPANCY`; DCGM's `PROF_SM_OCCUPANCY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 100.0))]
    pub sm_occupancy_pct: Option<f64>,
    /// Share of time the tensor pipes were active, percent (GPM `ANY_TENSOR_UTIL`; DCGM's
    /// `PROF_PIPE_TENSOR_ACTIVE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 100.0))]
    pub tensor_active_pct: Option<f64>,
    /// Share of time the device memory interface was sending or receiving, percent (GPM
    /// `DRAM_BW_UTIL`; DCGM's `PROF_DRAM_ACTIVE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 100.0))]
    pub dram_active_pct: Option<f64>,
    /// Share of time the graphics engine was active, percent (GPM `GRAPHICS_UTIL`; DCGM's
    /// `PROF_GR_ENGINE_ACTIVE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 100.0))]
    pub gr_active_pct: Option<f64>,
    /// For a MIG instance (`gpu_uuid` `MIG-…`): the UUID of the physical GPU it is a slice of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_parent_uuid: Option<String>,
    /// For a MIG instance: its GPU instance's compute slices (1 for `1g.10gb`, 7 for `7g.80gb`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub mig_slices: Option<u32>,
    /// For a MIG instance: the compute slices of its whole parent GPU (7 on an A100 or H100, 4
    /// on an A30). A slice is `mig_slices / mig_parent_slices` of its parent, unless
    /// `[[pricing.mig]]` says otherwise for its profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub mig_parent_slices: Option<u32>,
    /// The workload's own measure of serving, when its processes declare one (an inference
    /// server's requests running, from its metrics endpoint: `GPUWARDEN_SERVING_METRICS` and
    /// `GPUWARDEN_SERVING_EXPR`): 0 while the server serves nothing, however busy its GPU
    /// looks to NVML.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub serving_requests: Option<f64>,
}

/// The GPM measures of a sample that are percentages, by field name (see [`Sample`]).
pub const GPM_FIELDS: [&str; 5] = [
    "sm_active_pct",
    "sm_occupancy_pct",
    "tensor_active_pct",
    "dram_active_pct",
    "gr_active_pct",
];

/// The optional fields a sample gained after the first v1 (GPM measures and MIG slices), checked
/// by the same rules wherever a sample is read.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Extra {
    pub gpm: [Option<f64>; 5],
    pub mig_slices: Option<u32>,
    pub mig_parent_slices: Option<u32>,
    pub serving_requests: Option<f64>,
}

pub(crate) fn check_extra(extra: &Extra) -> Result<(), ValidationError> {
    for (name, value) in GPM_FIELDS.iter().zip(extra.gpm) {
        if let Some(v) = value {
            if !(0.0..=100.0).contains(&v) {
                return Err(ValidationError::new(
                    *name,
                    format!("{v} is outside 0..=100"),
                ));
            }
        }
    }
    if let Some(v) = extra.serving_requests {
        if !(v.is_finite() && v >= 0.0) {
            return Err(ValidationError::new(
                "serving_requests",
                format!("{v} is not a finite number at least 0"),
            ));
        }
    }
    match (extra.mig_slices, extra.mig_parent_slices) {
        (Some(0), _) => Err(ValidationError::new("mig_slices", "must be at least 1")),
        (_, Some(0)) => Err(ValidationError::new(
            "mig_parent_slices",
            "must be at least 1",
        )),
        (Some(slices), Some(parent)) if slices > parent => Err(ValidationError::new(
            "mig_slices",
            format!("{slices} is more than mig_parent_slices ({parent})"),
        )),
        _ => Ok(()),
    }
}

impl Sample {
    fn extra(&self) -> Extra {
        Extra {
            gpm: [
                self.sm_active_pct,
                self.sm_occupancy_pct,
                self.tensor_active_pct,
                self.dram_active_pct,
                self.gr_active_pct,
            ],
            mig_slices: self.mig_slices,
            mig_parent_slices: self.mig_parent_slices,
            serving_requests: self.serving_requests,
        }
    }
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
        )?;
        check_extra(&self.extra())
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
            field("sm_active_pct", DataType::Float64, true),
            field("sm_occupancy_pct", DataType::Float64, true),
            field("tensor_active_pct", DataType::Float64, true),
            field("dram_active_pct", DataType::Float64, true),
            field("gr_active_pct", DataType::Float64, true),
            field("mig_parent_uuid", DataType::Utf8, true),
            field("mig_slices", DataType::Int64, true),
            field("mig_parent_slices", DataType::Int64, true),
            field("serving_requests", DataType::Float64, true),
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
                ax::f64s(r.iter().map(|s| s.sm_active_pct)),
                ax::f64s(r.iter().map(|s| s.sm_occupancy_pct)),
                ax::f64s(r.iter().map(|s| s.tensor_active_pct)),
                ax::f64s(r.iter().map(|s| s.dram_active_pct)),
                ax::f64s(r.iter().map(|s| s.gr_active_pct)),
                ax::strings(r.iter().map(|s| s.mig_parent_uuid.as_deref())),
                ax::i64s(r.iter().map(|s| s.mig_slices.map(i64::from))),
                ax::i64s(r.iter().map(|s| s.mig_parent_slices.map(i64::from))),
                ax::f64s(r.iter().map(|s| s.serving_requests)),
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
        // Columns a sample gained after the first v1: a batch of an older lake file lacks them.
        let [sm_active, sm_occupancy, tensor_active, dram_active, gr_active] = [
            c.later("sm_active_pct", Columns::f64)?,
            c.later("sm_occupancy_pct", Columns::f64)?,
            c.later("tensor_active_pct", Columns::f64)?,
            c.later("dram_active_pct", Columns::f64)?,
            c.later("gr_active_pct", Columns::f64)?,
        ];
        let mig_parent_uuid = c.later("mig_parent_uuid", Columns::str)?;
        let mig_slices = c.later("mig_slices", Columns::i64)?;
        let mig_parent_slices = c.later("mig_parent_slices", Columns::i64)?;
        let serving = c.later("serving_requests", Columns::f64)?;
        let f = |col: &Option<ax::Col<&arrow_array::Float64Array>>, i| col.as_ref()?.opt(i);
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
                    sm_active_pct: f(&sm_active, i),
                    sm_occupancy_pct: f(&sm_occupancy, i),
                    tensor_active_pct: f(&tensor_active, i),
                    dram_active_pct: f(&dram_active, i),
                    gr_active_pct: f(&gr_active, i),
                    mig_parent_uuid: mig_parent_uuid.as_ref().and_then(|c| c.opt(i)),
                    mig_slices: mig_slices.as_ref().map_or(Ok(None), |c| c.opt_as(i))?,
                    mig_parent_slices: mig_parent_slices
                        .as_ref()
                        .map_or(Ok(None), |c| c.opt_as(i))?,
                    serving_requests: f(&serving, i),
                })
            })
            .collect()
    }
}
