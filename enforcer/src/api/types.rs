//! The API's own bodies: what its operations take and answer beyond the policy's request and
//! decision types, each converted from the service's answer.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::policy::{Estimate, Reason};
use crate::service::{Admission, Team};
use crate::store::{Lease, LeaseState};

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
            lease,
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
