//! What the policy is asked: who asks ([`Principal`]), for what ([`AdmissionRequest`], the body
//! of `POST /v1/admission` as the API decodes it), and, for a resize, the lease as it is
//! ([`Holding`]). Plain data and the checks of its fields: nothing here decides.

use std::collections::BTreeMap;
use std::time::Duration;

use gpuwarden_schema::config::Role;
use gpuwarden_schema::Workload;
use serde::Deserialize;
use utoipa::ToSchema;

use crate::fields;

/// Who is asking: the principal a bearer token maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token's name (a user for `member`, a front-end for `service`).
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// Teams it acts for (ignored for `admin`).
    pub teams: Vec<String>,
}

impl Principal {
    /// Whether the principal may read the team's leases and figures.
    pub fn may_read(&self, team: &str) -> bool {
        self.role == Role::Admin || self.teams.iter().any(|t| t == team)
    }

    /// Why the principal may not change leases of `team` for `user`, or `None` when it may.
    /// Admins act for anyone; members for themselves in their teams; services for anyone in
    /// their teams (membership of the user is checked by [`evaluate`](super::evaluate));
    /// viewers never write.
    pub fn write_refusal(&self, team: &str, user: &str) -> Option<String> {
        match self.role {
            Role::Admin => None,
            Role::Viewer => Some(format!("{} is a viewer and may only read", self.name)),
            _ if !self.teams.iter().any(|t| t == team) => {
                Some(format!("{} does not act for team {team}", self.name))
            }
            Role::Member if user != self.name => Some(format!(
                "{} is a member and acts only as itself, not as {user}",
                self.name
            )),
            Role::Member | Role::Service => None,
        }
    }
}

/// The body of `POST /v1/admission`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdmissionRequest {
    /// The team the lease is charged to.
    pub team: String,
    /// The person the lease is for.
    pub user: String,
    /// The project the work belongs to.
    pub project: String,
    /// The kind of work; its `[workloads.<kind>]` policy applies.
    #[schema(value_type = WorkloadName)]
    pub workload: Workload,
    /// GPUs wanted, at least 1; a whole number (`2.0` reads as 2).
    #[serde(deserialize_with = "crate::fields::gpu_count")]
    pub gpus: u32,
    /// A case-insensitive substring of the GPU model wanted (`"H100"`); any allowed model when
    /// absent.
    #[serde(default)]
    pub gpu_model: Option<String>,
    /// The substrate to run on; the workload's preference order when absent.
    #[serde(default)]
    pub substrate: Option<String>,
    /// How long the lease is wanted, as `"30m"`, `"2h"` or `"1h30m"`; the workload's
    /// `max_duration` when absent.
    #[serde(default, deserialize_with = "crate::fields::optional_duration")]
    #[schema(value_type = Option<String>, example = "2h")]
    pub duration: Option<Duration>,
    /// Free-form labels carried into lease events.
    #[serde(default)]
    pub labels: Option<BTreeMap<String, String>>,
    /// Evaluate only: the same decision, reasons and estimate as the request itself, but no
    /// lease is created, no quota or budget is held, and nothing is recorded or counted (what
    /// the portal's live estimate asks as a form changes).
    #[serde(default)]
    pub dry_run: bool,
    /// The program to run for the lease (argv, no shell), on substrates that run one (`local`);
    /// other drivers ignore it. It is not part of the policy's decision and is not stored: a
    /// re-adopted lease keeps running the process it has.
    #[serde(default)]
    pub command: Option<Vec<String>>,
}

impl AdmissionRequest {
    /// Checks the fields whose rules the types alone do not carry ([`crate::fields`]): names,
    /// the GPU count's minimum and the command. The field at fault and why, otherwise. Pure, so
    /// that what the API admits for its shape is one function of the body (the fuzz target
    /// `admission` runs it on every body it decodes).
    pub fn check_fields(&self) -> Result<(), (&'static str, String)> {
        for (field, value) in [
            ("team", &self.team),
            ("user", &self.user),
            ("project", &self.project),
        ] {
            fields::check_name(value).map_err(|why| (field, why))?;
        }
        if self.gpus == 0 {
            return Err(("gpus", "must be at least 1".into()));
        }
        if let Some(argv) = &self.command {
            fields::check_command(argv).map_err(|why| ("command", why))?;
        }
        Ok(())
    }
}

/// The kind of work; each has its own policy in `[workloads.<kind>]`.
// `schema::Workload` carries no OpenAPI derive (schema stays free of HTTP concerns); this enum
// stands for it in the document.
#[derive(ToSchema)]
#[schema(as = Workload)]
#[serde(rename_all = "snake_case")]
#[allow(dead_code)]
pub(crate) enum WorkloadName {
    Training,
    Inference,
    Notebook,
    Batch,
}

/// Why a lease ended.
// Stands for `schema::ReleaseReason` in the document, as [`WorkloadName`] does for `Workload`.
#[derive(ToSchema)]
#[schema(as = ReleaseReason)]
#[serde(rename_all = "snake_case")]
#[allow(dead_code)]
pub(crate) enum ReleaseReasonName {
    /// The holder released it.
    User,
    /// It reached its end.
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

/// An admission request and who makes it.
#[derive(Debug, Clone)]
pub struct Request {
    /// The caller.
    pub principal: Principal,
    /// What it asks for.
    pub admission: AdmissionRequest,
}

/// A lease as [`evaluate_resize`](super::evaluate_resize) sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Holding {
    /// The lease's team.
    pub team: String,
    /// Its kind of work.
    pub workload: Workload,
    /// Where it runs.
    pub substrate: String,
    /// Full model name of its GPUs.
    pub gpu_model: String,
    /// The GPUs it holds now (empty on pooled capacity).
    pub gpu_uuids: Vec<String>,
    /// How many it holds now.
    pub gpu_count: u32,
    /// How long it has left, if it ends.
    pub remaining: Option<Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> AdmissionRequest {
        AdmissionRequest {
            team: "ml".into(),
            user: "ada".into(),
            project: "p".into(),
            workload: Workload::Training,
            gpus: 1,
            gpu_model: None,
            substrate: None,
            duration: None,
            labels: None,
            dry_run: false,
            command: None,
        }
    }

    #[test]
    fn check_fields_names_the_field_at_fault() {
        assert_eq!(request().check_fields(), Ok(()));
        let with = |spoil: fn(&mut AdmissionRequest)| {
            let mut r = request();
            spoil(&mut r);
            r
        };
        for (r, field) in [
            (with(|r| r.team = String::new()), "team"),
            (with(|r| r.user = "ada ".into()), "user"),
            (with(|r| r.project = "a\nb".into()), "project"),
            (with(|r| r.gpus = 0), "gpus"),
            (
                with(|r| r.command = Some(vec!["sh".into(), "a\0b".into()])),
                "command",
            ),
        ] {
            let (at, why) = r.check_fields().unwrap_err();
            assert_eq!(at, field, "{why}");
            assert!(!why.is_empty());
        }
    }
}
