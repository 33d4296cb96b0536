//! The API's own bodies: what its operations take and answer beyond the policy's request and
//! decision types, each converted from the service's answer. The lease and its state are written
//! here again rather than derived on the store's records, so the store's rows and the API's
//! bodies can change apart.

use std::collections::BTreeMap;

use gpuwarden_schema::{ReleaseReason, Workload};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::policy::{Estimate, Reason, ReleaseReasonName, WorkloadName};
use crate::service::{Admission, Team};
use crate::store;

/// What `POST /v1/admission` (and `resize`) answers.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AdmissionResponse {
    /// `admitted` or `denied`.
    pub decision: DecisionKind,
    /// Every check that failed; empty when admitted.
    pub reasons: Vec<Reason>,
    /// The lease, when one was created or changed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease: Option<Lease>,
    /// What the lease would cost.
    pub estimate: Estimate,
}

/// The outcome of an admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DecisionKind {
    /// Every check passed.
    Admitted,
    /// At least one check failed.
    Denied,
}

impl From<Admission> for AdmissionResponse {
    fn from(Admission { decision, lease }: Admission) -> Self {
        Self {
            decision: if decision.admitted() {
                DecisionKind::Admitted
            } else {
                DecisionKind::Denied
            },
            reasons: decision.reasons,
            lease: lease.map(Lease::from),
            estimate: decision.estimate,
        }
    }
}

/// The body of `POST /v1/leases/{id}/extend`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendRequest {
    /// How much longer, as `"30m"` or `"2h"`.
    #[schema(example = "1h")]
    pub duration: String,
}

/// The body of `POST /v1/leases/{id}/exempt`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExemptRequest {
    /// For how long from now, as `"8h"` or `"3d"`.
    #[schema(example = "8h")]
    pub duration: String,
    /// Why; kept in the audit trail.
    #[schema(example = "benchmark run over the weekend")]
    pub reason: String,
}

/// The body of `POST /v1/leases/{id}/resize`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    /// The GPU count wanted, at least 1; a whole number (`2.0` reads as 2).
    #[serde(deserialize_with = "crate::fields::gpu_count")]
    pub gpus: u32,
}

/// Query of `GET /v1/leases`.
#[derive(Debug, Clone, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct LeaseQuery {
    /// Only this team's leases.
    pub team: Option<String>,
    /// Only leases in this state.
    #[param(value_type = Option<LeaseState>)]
    pub state: Option<LeaseState>,
}

/// What `GET /v1/teams/{team}` answers.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TeamView {
    /// The team.
    pub team: String,
    /// Most GPUs it may hold.
    pub gpu_quota: u32,
    /// GPUs it holds in open leases.
    pub gpus_held: u32,
    /// Month-to-date spend: the latest spend signal plus what open leases accrued since.
    pub month_to_date_usd: f64,
    /// Its monthly budget.
    pub monthly_budget_usd: f64,
    /// Whether its new admissions are blocked.
    pub blocked: bool,
    /// Models it may use (any when empty).
    pub allowed_models: Vec<String>,
}

impl From<Team> for TeamView {
    fn from(t: Team) -> Self {
        Self {
            team: t.name,
            gpu_quota: t.gpu_quota,
            gpus_held: t.gpus_held,
            month_to_date_usd: t.month_to_date_usd,
            monthly_budget_usd: t.monthly_budget_usd,
            blocked: t.blocked,
            allowed_models: t.allowed_models,
        }
    }
}

/// One lease. Times are Unix epoch milliseconds (UTC).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Lease {
    /// The lease's id.
    pub id: String,
    /// The team it is charged to.
    pub team: String,
    /// The person it is for.
    pub user: String,
    /// The project the work belongs to.
    pub project: String,
    /// The kind of work.
    #[schema(value_type = WorkloadName)]
    pub workload: Workload,
    /// The substrate it runs on.
    pub substrate: String,
    /// Full model name of its GPUs.
    pub gpu_model: String,
    /// GPUs held.
    pub gpu_count: u32,
    /// The GPUs held; empty on a substrate that picks devices itself.
    pub gpu_uuids: Vec<String>,
    /// Labels from the request.
    pub labels: BTreeMap<String, String>,
    /// Where it is in its life.
    pub state: LeaseState,
    /// When it was admitted.
    pub granted_at: i64,
    /// When it must end; null when it has no end.
    pub expires_at: Option<i64>,
    /// When it last changed.
    pub updated_at: i64,
    /// When it ended.
    pub released_at: Option<i64>,
    /// Why it ended.
    #[schema(value_type = Option<ReleaseReasonName>)]
    pub release_reason: Option<ReleaseReason>,
}

/// Where a lease is in its life. `granted → active → releasing → released`, and `failed` from
/// any open state; `released` and `failed` are final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Admitted and recorded; the substrate is being asked to start it.
    Granted,
    /// The substrate runs it.
    Active,
    /// The substrate is being asked to end it.
    Releasing,
    /// Ended; its GPUs are free.
    Released,
    /// The substrate could not run or end it cleanly; its GPUs are free.
    Failed,
}

impl From<store::Lease> for Lease {
    fn from(l: store::Lease) -> Self {
        Self {
            id: l.id,
            team: l.team,
            user: l.user,
            project: l.project,
            workload: l.workload,
            substrate: l.substrate,
            gpu_model: l.gpu_model,
            gpu_count: l.gpu_count,
            gpu_uuids: l.gpu_uuids,
            labels: l.labels,
            state: l.state.into(),
            granted_at: l.granted_at,
            expires_at: l.expires_at,
            updated_at: l.updated_at,
            released_at: l.released_at,
            release_reason: l.release_reason,
        }
    }
}

impl From<store::LeaseState> for LeaseState {
    fn from(s: store::LeaseState) -> Self {
        match s {
            store::LeaseState::Granted => Self::Granted,
            store::LeaseState::Active => Self::Active,
            store::LeaseState::Releasing => Self::Releasing,
            store::LeaseState::Released => Self::Released,
            store::LeaseState::Failed => Self::Failed,
        }
    }
}

impl From<LeaseState> for store::LeaseState {
    fn from(s: LeaseState) -> Self {
        match s {
            LeaseState::Granted => Self::Granted,
            LeaseState::Active => Self::Active,
            LeaseState::Releasing => Self::Releasing,
            LeaseState::Released => Self::Released,
            LeaseState::Failed => Self::Failed,
        }
    }
}
