//! What the policy answers: a [`Decision`] with every failed check as a [`Reason`] (each with a
//! stable [`ReasonCode`]), the cost [`Estimate`], and where an admitted lease goes
//! ([`Placement`]). Plain data: nothing here decides.

use std::time::Duration;

use serde::Serialize;
use utoipa::ToSchema;

/// A stable reason for a denial; front-ends may switch on these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReasonCode {
    /// The caller may not act for this team, or the user is not one of its members.
    NotMember,
    /// The workload policy caps GPUs per lease (or the substrate is not one it allows).
    WorkloadLimit,
    /// The team may not use the GPU model asked for.
    ModelNotAllowed,
    /// The duration asked for is longer than the workload's `max_duration`.
    DurationLimit,
    /// GPUs held plus GPUs asked would exceed the team's quota.
    QuotaExceeded,
    /// Month-to-date spend plus this lease's estimate would exceed the team's monthly budget.
    BudgetExceeded,
    /// No fitting substrate has enough free GPUs of a fitting model.
    NoCapacity,
    /// The team's admissions are blocked (over budget, or by an administrator).
    TeamBlocked,
    /// The user has no system account the substrate can run the lease as (local: none in its
    /// `accounts` table, none of the same name, or one the enforcer cannot switch to).
    AccountUnmapped,
    /// The user's system account is root, in root's group, or under the substrate's `min_uid`.
    AccountPrivileged,
    /// The command's program is not one of the workload's `programs`.
    ProgramNotAllowed,
    /// The lease's substrate cannot change a running lease's GPUs (Slurm).
    ResizeUnsupported,
    /// The config defines `[workloads.*]` and not the kind asked for; with none defined, every
    /// kind is offered.
    WorkloadNotOffered,
}

impl ReasonCode {
    /// Every code, in a stable order.
    pub const ALL: [ReasonCode; 13] = [
        Self::NotMember,
        Self::WorkloadLimit,
        Self::ModelNotAllowed,
        Self::DurationLimit,
        Self::QuotaExceeded,
        Self::BudgetExceeded,
        Self::NoCapacity,
        Self::TeamBlocked,
        Self::AccountUnmapped,
        Self::AccountPrivileged,
        Self::ProgramNotAllowed,
        Self::ResizeUnsupported,
        Self::WorkloadNotOffered,
    ];

    /// The snake_case code used in JSON, actions and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotMember => "not_member",
            Self::WorkloadLimit => "workload_limit",
            Self::ModelNotAllowed => "model_not_allowed",
            Self::DurationLimit => "duration_limit",
            Self::QuotaExceeded => "quota_exceeded",
            Self::BudgetExceeded => "budget_exceeded",
            Self::NoCapacity => "no_capacity",
            Self::TeamBlocked => "team_blocked",
            Self::AccountUnmapped => "account_unmapped",
            Self::AccountPrivileged => "account_privileged",
            Self::ProgramNotAllowed => "program_not_allowed",
            Self::ResizeUnsupported => "resize_unsupported",
            Self::WorkloadNotOffered => "workload_not_offered",
        }
    }
}

/// One failed check.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Reason {
    /// Stable code.
    pub code: ReasonCode,
    /// For a person, with the numbers behind it.
    pub message: String,
}

/// What the lease would cost, priced as the lake prices GPU-hours.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Estimate {
    /// Price of one GPU-hour of the model × GPUs.
    pub usd_per_hour: f64,
    /// Cost over the requested duration (or the workload's `max_duration`); null when the lease
    /// has no end, in which case the budget check counts one hour.
    pub max_usd: Option<f64>,
    /// The GPU model priced: the one placed; when nothing could be placed, the dearest model the
    /// request could be placed on (else the model asked for); null when no model fits and the
    /// default price was used.
    pub gpu_model: Option<String>,
}

/// Where an admitted lease goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The substrate.
    pub substrate: String,
    /// The full model name of the GPUs.
    pub gpu_model: String,
    /// How many GPUs.
    pub gpu_count: u32,
    /// The GPUs chosen; empty on pooled capacity.
    pub gpu_uuids: Vec<String>,
}

/// The answer to a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Every check that failed; empty when admitted.
    pub reasons: Vec<Reason>,
    /// What the lease would cost.
    pub estimate: Estimate,
    /// Where it goes; `None` when there is no capacity.
    pub placement: Option<Placement>,
    /// When the lease ends, if it has a duration.
    pub duration: Option<Duration>,
}

impl Decision {
    /// Whether every check passed.
    pub fn admitted(&self) -> bool {
        self.reasons.is_empty() && self.placement.is_some()
    }

    /// Whether a check with `code` failed.
    pub fn has(&self, code: ReasonCode) -> bool {
        self.reasons.iter().any(|r| r.code == code)
    }

    pub(super) fn deny(&mut self, code: ReasonCode, message: String) {
        self.reasons.push(Reason { code, message });
    }
}
