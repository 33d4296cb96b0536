//! [`LeaseEvent`]: the enforcer's record of who holds which GPUs, published on
//! `gpuwarden.leases`. The pipeline attributes samples to teams through these events, and the
//! simulated fleet runs each granted lease's workload from them. It also owns how a Slurm job's
//! lease, a Kubernetes pod's lease and a Kueue Workload's lease are named ([`slurm_lease_id`],
//! [`kubernetes_lease_id`], [`kueue_lease_id`]), which the enforcer grants and the collector finds
//! again.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, DataType, Schema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::arrow::{self as ax, field, Columns};
use crate::error::{ArrowConvertError, ValidationError};
use crate::record::Record;
use crate::version::V1;

/// The longest `ClusterName` Slurm accepts (its accounting tables are named after it).
pub const SLURM_CLUSTER_NAME_MAX: usize = 40;

/// Whether `name` can be Slurm's `ClusterName` inside a lease id: 1 to
/// [`SLURM_CLUSTER_NAME_MAX`] ASCII letters, digits, `_`, `.` or `-`. Slurm itself accepts other
/// characters, but a lease id becomes file names and SQL literals, so those are refused.
pub fn is_slurm_cluster_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= SLURM_CLUSTER_NAME_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// The lease of Slurm job `job_id` on cluster `cluster`: `slurm-<cluster>-<job_id>`. For a job
/// array, `job_id` is the array's job id (`SLURM_ARRAY_JOB_ID`): the whole array is one lease.
/// The cluster is written in lower case, as Slurm silently maps `ClusterName` to lower case
/// (so `SLURM_CLUSTER_NAME` in a job's environment is always lower case).
pub fn slurm_lease_id(cluster: &str, job_id: u32) -> String {
    format!("slurm-{}-{job_id}", cluster.to_ascii_lowercase())
}

/// The lease of an admitted Kubernetes pod: `k8s-<pod uid>`. The uid, not namespace and name,
/// because a name is reused by the next pod of a StatefulSet or a re-created Job while the uid
/// (a UUID the API server assigns) names one pod for good; and it is what the kubelet's pod log
/// directory (`/var/log/pods/<namespace>_<name>_<uid>`) and the pod's cgroup carry on the node,
/// where the collector finds it again.
pub fn kubernetes_lease_id(pod_uid: &str) -> String {
    format!("k8s-{pod_uid}")
}

/// The lease of a Kueue Workload admitted by gpuwarden's admission check: `kueue-<workload
/// uid>`, and `kueue-<workload uid>-<attempt>` from its second admission on (a Workload that
/// Kueue evicts and requeues is checked again, and a lease id names one lease for good). The
/// uid, as for a pod, because a Job re-created under the same name makes a new Workload.
pub fn kueue_lease_id(workload_uid: &str, attempt: u32) -> String {
    if attempt <= 1 {
        format!("{KUEUE_LEASE_PREFIX}{workload_uid}")
    } else {
        format!("{KUEUE_LEASE_PREFIX}{workload_uid}-{attempt}")
    }
}

/// How every [`kueue_lease_id`] begins.
pub const KUEUE_LEASE_PREFIX: &str = "kueue-";

/// The longest lease id gpuwarden accepts (the enforcer's drivers name files after it).
pub const LEASE_ID_MAX: usize = 200;

/// Whether `id` passes the lease id rules of the enforcer's drivers: 1 to [`LEASE_ID_MAX`] ASCII
/// letters, digits, `-`, `_` or `.`, not starting with `.` (a lease id becomes file names and
/// SQL literals). What a process, a pod's directory or a virtual machine's firmware names
/// otherwise is ignored by the collector rather than published.
pub fn is_lease_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= LEASE_ID_MAX
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// What happened to the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LeaseEventKind {
    /// The lease was admitted and its GPUs assigned; opens a segment.
    Granted,
    /// The lease's GPUs changed; opens a new segment.
    Resized,
    /// The lease ended; closes its last segment.
    Released,
}

/// The kind of work a lease runs; each has its own policy in `[workloads.<name>]`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// Long, steady, multi-GPU jobs.
    Training,
    /// Serving; load follows users.
    Inference,
    /// Interactive sessions, mostly idle.
    Notebook,
    /// Finite batch jobs.
    Batch,
}

impl Workload {
    /// Every workload kind, in a stable order.
    pub const ALL: [Workload; 4] = [Self::Training, Self::Inference, Self::Notebook, Self::Batch];

    /// The snake_case name used in JSON and the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Training => "training",
            Self::Inference => "inference",
            Self::Notebook => "notebook",
            Self::Batch => "batch",
        }
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a lease was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseReason {
    /// The holder released it.
    User,
    /// It reached its duration.
    Expired,
    /// It was reclaimed for being idle.
    Idle,
    /// Its team ran out of budget.
    Budget,
    /// An administrator ended it.
    Admin,
    /// Its substrate failed to run it.
    Failed,
}

impl LeaseEventKind {
    /// The snake_case name used in JSON and the lake.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Granted => "granted",
            Self::Resized => "resized",
            Self::Released => "released",
        }
    }
}

impl ReleaseReason {
    /// The snake_case name used in JSON and the lake.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Expired => "expired",
            Self::Idle => "idle",
            Self::Budget => "budget",
            Self::Admin => "admin",
            Self::Failed => "failed",
        }
    }
}

/// A change in who holds which GPUs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(
    title = "LeaseEvent",
    description = "The enforcer's record of who holds which GPUs."
)]
pub struct LeaseEvent {
    /// Contract version.
    pub v: V1,
    /// When the event happened, Unix epoch milliseconds (UTC).
    pub ts_ms: i64,
    /// What happened.
    pub event: LeaseEventKind,
    /// The lease's id.
    pub lease_id: String,
    /// The team the lease is charged to.
    pub team: String,
    /// The person the lease is for.
    pub user: String,
    /// The project the work belongs to.
    pub project: String,
    /// The kind of work.
    pub workload: Workload,
    /// The substrate (a `[[substrates]]` name) the lease runs on.
    pub substrate: String,
    /// Full model name of the GPUs held, exactly as NVML reports it.
    pub gpu_model: String,
    /// Number of GPUs held from this event on.
    pub gpu_count: u32,
    /// UUIDs of the GPUs held; empty when the substrate picks devices itself.
    #[serde(default)]
    pub gpu_uuids: Vec<String>,
    /// Free-form labels.
    pub labels: Option<BTreeMap<String, String>>,
    /// Why the lease ended; present on `released` events only.
    pub reason: Option<ReleaseReason>,
}

impl Record for LeaseEvent {
    const NAME: &'static str = "lease_event";
    const TOPIC: &'static str = crate::topics::LEASES;

    fn validate(&self) -> Result<(), ValidationError> {
        for (name, value) in [
            ("lease_id", &self.lease_id),
            ("team", &self.team),
            ("substrate", &self.substrate),
            ("gpu_model", &self.gpu_model),
        ] {
            if value.is_empty() {
                return Err(ValidationError::new(name, "must not be empty"));
            }
        }
        match (self.event, self.reason) {
            (LeaseEventKind::Released, None) => {
                return Err(ValidationError::new(
                    "reason",
                    "required on released events",
                ));
            }
            (LeaseEventKind::Granted | LeaseEventKind::Resized, Some(_)) => {
                return Err(ValidationError::new(
                    "reason",
                    format!(
                        "only released events carry a reason, this one is {}",
                        self.event.as_str()
                    ),
                ));
            }
            _ => {}
        }
        if self.event != LeaseEventKind::Released && self.gpu_count == 0 {
            return Err(ValidationError::new("gpu_count", "must be at least 1"));
        }
        if !self.gpu_uuids.is_empty() && self.gpu_uuids.len() != self.gpu_count as usize {
            return Err(ValidationError::new(
                "gpu_uuids",
                format!(
                    "lists {} GPUs but gpu_count is {}; list all of them or none",
                    self.gpu_uuids.len(),
                    self.gpu_count
                ),
            ));
        }
        Ok(())
    }

    fn key(&self) -> &str {
        &self.lease_id
    }

    fn arrow_schema() -> Arc<Schema> {
        Arc::new(Schema::new(vec![
            field("v", DataType::Int64, false),
            field("ts_ms", DataType::Int64, false),
            field("event", DataType::Utf8, false),
            field("lease_id", DataType::Utf8, false),
            field("team", DataType::Utf8, false),
            field("user", DataType::Utf8, false),
            field("project", DataType::Utf8, false),
            field("workload", DataType::Utf8, false),
            field("substrate", DataType::Utf8, false),
            field("gpu_model", DataType::Utf8, false),
            field("gpu_count", DataType::Int64, false),
            field("gpu_uuids", ax::string_list_type(), false),
            field("labels", DataType::Utf8, true),
            field("reason", DataType::Utf8, true),
        ]))
    }

    fn to_record_batch(records: &[Self]) -> Result<RecordBatch, ArrowError> {
        let r = records;
        let labels: Vec<Option<String>> = r
            .iter()
            .map(|e| ax::labels_json(e.labels.as_ref()))
            .collect();
        RecordBatch::try_new(
            Self::arrow_schema(),
            vec![
                ax::i64s(r.iter().map(|_| Some(i64::from(V1::NUMBER)))),
                ax::i64s(r.iter().map(|e| Some(e.ts_ms))),
                ax::strings(r.iter().map(|e| Some(e.event.as_str()))),
                ax::strings(r.iter().map(|e| Some(e.lease_id.as_str()))),
                ax::strings(r.iter().map(|e| Some(e.team.as_str()))),
                ax::strings(r.iter().map(|e| Some(e.user.as_str()))),
                ax::strings(r.iter().map(|e| Some(e.project.as_str()))),
                ax::strings(r.iter().map(|e| Some(e.workload.as_str()))),
                ax::strings(r.iter().map(|e| Some(e.substrate.as_str()))),
                ax::strings(r.iter().map(|e| Some(e.gpu_model.as_str()))),
                ax::i64s(r.iter().map(|e| Some(i64::from(e.gpu_count)))),
                ax::string_lists(r.iter().map(|e| e.gpu_uuids.as_slice())),
                ax::strings(labels.iter().map(|l| l.as_deref())),
                ax::strings(r.iter().map(|e| e.reason.map(ReleaseReason::as_str))),
            ],
        )
    }

    fn from_record_batch(batch: &RecordBatch) -> Result<Vec<Self>, ArrowConvertError> {
        let c = Columns::new(batch);
        let (ts_ms, event, lease_id, team) = (
            c.i64("ts_ms")?,
            c.str("event")?,
            c.str("lease_id")?,
            c.str("team")?,
        );
        let (user, project, workload) = (c.str("user")?, c.str("project")?, c.str("workload")?);
        let (substrate, gpu_model, gpu_count) = (
            c.str("substrate")?,
            c.str("gpu_model")?,
            c.i64("gpu_count")?,
        );
        let (gpu_uuids, labels, reason) =
            (c.list("gpu_uuids")?, c.str("labels")?, c.str("reason")?);
        (0..batch.num_rows())
            .map(|i| {
                Ok(LeaseEvent {
                    v: V1,
                    ts_ms: ts_ms.req(i)?,
                    event: event.parse(i)?,
                    lease_id: lease_id.req(i)?,
                    team: team.req(i)?,
                    user: user.req(i)?,
                    project: project.req(i)?,
                    workload: workload.parse(i)?,
                    substrate: substrate.req(i)?,
                    gpu_model: gpu_model.req(i)?,
                    gpu_count: gpu_count.req_as(i)?,
                    gpu_uuids: gpu_uuids.strings(i)?,
                    labels: labels.labels(i)?,
                    reason: reason.parse_opt(i)?,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_lease_ids_name_the_cluster_in_lower_case_and_the_job() {
        assert_eq!(slurm_lease_id("study", 42), "slurm-study-42");
        assert_eq!(slurm_lease_id("Study", 42), "slurm-study-42");
        assert_eq!(
            slurm_lease_id("a.b_c-d", 4294967294),
            "slurm-a.b_c-d-4294967294"
        );
    }

    #[test]
    fn kubernetes_lease_ids_name_the_pod_uid() {
        assert_eq!(
            kubernetes_lease_id("0f3c1a52-7d7e-4b8e-9a43-2c1d5e6f7a80"),
            "k8s-0f3c1a52-7d7e-4b8e-9a43-2c1d5e6f7a80"
        );
    }

    #[test]
    fn kueue_lease_ids_name_the_workload_uid_and_later_attempts() {
        let uid = "5a1e2c3d-0b4f-4e6a-8c7d-9e0f1a2b3c4d";
        assert_eq!(kueue_lease_id(uid, 1), format!("kueue-{uid}"));
        assert_eq!(kueue_lease_id(uid, 0), format!("kueue-{uid}"));
        assert_eq!(kueue_lease_id(uid, 3), format!("kueue-{uid}-3"));
    }

    #[test]
    fn lease_ids_follow_the_drivers_rules() {
        for ok in [
            "l-1",
            "k8s-0f3c1a52-7d7e",
            "a.b_c",
            "A9",
            &"x".repeat(LEASE_ID_MAX),
        ] {
            assert!(is_lease_id(ok), "{ok:?}");
        }
        for bad in [
            "",
            ".hidden",
            "a/b",
            "a b",
            "été",
            "a\0b",
            "a\nb",
            "a=b",
            &"x".repeat(LEASE_ID_MAX + 1),
        ] {
            assert!(!is_lease_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn slurm_cluster_names_are_short_and_lease_id_safe() {
        for ok in ["study", "Study", "c1", "a.b_c-d", &"x".repeat(40)] {
            assert!(is_slurm_cluster_name(ok), "{ok:?}");
        }
        for bad in [
            "",
            &"x".repeat(41),
            "a b",
            "a/b",
            "a:b",
            "été",
            "a\0b",
            "a'b",
        ] {
            assert!(!is_slurm_cluster_name(bad), "{bad:?}");
        }
    }
}
