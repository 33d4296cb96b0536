//! Audit records: the one place the enforcer builds an [`Action`], the record of each thing it
//! decided or did (on `gpuwarden.actions` through the outbox, and in the lake).
//!
//! Start from what the Action is about ([`Audit::lease`], [`Audit::team`], [`Audit::fleet`]),
//! name the policy that called for it if one did, and finish it with [`Audit::at`]:
//!
//! ```ignore
//! let action = Audit::lease(ActionKind::Alert, &lease, "idle")
//!     .under_workload_policy(lease.workload)
//!     .at(now_ms, Outcome::Ok, "all 8 GPU(s) idle for 2h");
//! ```

use gpuwarden_schema::{Action, ActionKind, Outcome, Workload, V1};

use super::types::Lease;

/// An [`Action`] being built. Its outcome, detail and time are given last, by [`Audit::at`].
#[derive(Debug, Clone)]
#[must_use = "an Audit records nothing until `at` builds its Action"]
pub struct Audit {
    action: ActionKind,
    lease_id: Option<String>,
    team: Option<String>,
    reason: String,
    policy: Option<String>,
    driver: Option<String>,
}

impl Audit {
    /// An Action about `lease`: its id, its team, and its substrate as the driver.
    pub fn lease(action: ActionKind, lease: &Lease, reason: &str) -> Self {
        Self {
            lease_id: Some(lease.id.clone()),
            team: Some(lease.team.clone()),
            driver: Some(lease.substrate.clone()),
            ..Self::fleet(action, reason)
        }
    }

    /// An Action about a team as a whole (a denial, a block).
    pub fn team(action: ActionKind, team: &str, reason: &str) -> Self {
        Self {
            team: Some(team.to_owned()),
            ..Self::fleet(action, reason)
        }
    }

    /// An Action about the fleet, of no lease or team (a busy GPU nobody holds).
    pub fn fleet(action: ActionKind, reason: &str) -> Self {
        Self {
            action,
            lease_id: None,
            team: None,
            reason: reason.to_owned(),
            policy: None,
            driver: None,
        }
    }

    /// Names the config entry that called for the Action (`workloads.training`).
    pub fn under_policy(mut self, policy: String) -> Self {
        self.policy = Some(policy);
        self
    }

    /// Names the workload's policy, `workloads.<workload>`.
    pub fn under_workload_policy(self, workload: Workload) -> Self {
        self.under_policy(format!("workloads.{}", workload.as_str()))
    }

    /// Names the team's budget, `teams.<team>.monthly_budget_usd`.
    pub fn under_budget_of(self, team: &str) -> Self {
        self.under_policy(format!("teams.{team}.monthly_budget_usd"))
    }

    /// The Action, at `ts_ms`, with its outcome and a detail for a person.
    pub fn at(self, ts_ms: i64, outcome: Outcome, detail: impl Into<String>) -> Action {
        Action {
            v: V1,
            ts_ms,
            action: self.action,
            lease_id: self.lease_id,
            team: self.team,
            reason: self.reason,
            policy: self.policy,
            driver: self.driver,
            outcome,
            detail: detail.into(),
        }
    }
}
