//! The one adapter between the front doors and admission: every door (the HTTP API, the portal,
//! the Slurm submit hook, the Kubernetes admission webhook, the Kueue admission check) turns its
//! request into the service's [`AdmissionRequest`] and asks through [`admit`], which answers in
//! what a door needs: admitted (the lease), denied by the policy (every reason with its code, and
//! [`denial`]'s line for a person), or refused for a mistake the asker can fix.
//!
//! The API and the portal read an [`AdmissionRequest`] as it is (a JSON body, a form). A
//! substrate's own door reads the work the substrate is starting (a Slurm job's fields, a pod, a
//! Workload) into a [`WorkAsk`], whose [`WorkAsk::request`] does what is the same for all of
//! them: the duration is what the work asked for cut to its workload's `max_duration`, or that
//! when it asked none (the substrate enforces the limit it is told, so the work is not denied for
//! it); the model and the substrate are pinned; no command. [`team_of`] maps a substrate's name
//! for a team (an account, a partition, a namespace), [`substrate_principal`] is who such a door
//! acts as, and [`admitted`] says an admission in one line. What is particular to a door (which
//! fields it reads, how it words and sends its answer) stays in the door.

use std::collections::BTreeMap;
use std::time::Duration;

use gpuwarden_schema::config::{Config, Role};
use gpuwarden_schema::Workload;

use crate::policy::{AdmissionRequest, Decision, Principal};
use crate::service::{Admission, Service, ServiceError};

/// How an admitted lease comes to be, by door.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant<'a> {
    /// Provisioned through its substrate's driver: the API and the portal. `key` is the API's
    /// `Idempotency-Key` (see [`Service::admit`]).
    Provision {
        /// The request's idempotency key, if it has one.
        key: Option<&'a str>,
    },
    /// A hold, for work its substrate is starting and names later: a Slurm job being submitted
    /// (see [`Service::hold`]).
    Hold,
    /// Recorded under the lease id the substrate's work already has: a pod's `k8s-<uid>`, a Kueue
    /// Workload's `kueue-<uid>` (see [`Service::admit_named`]).
    Named(&'a str),
}

/// What the service answered, as a door needs it.
#[derive(Debug)]
pub enum Answer {
    /// Admitted (in a dry run: would be): the lease (none in a dry run) and the decision it was
    /// admitted with (estimate, duration).
    Admitted(Admission),
    /// Denied by the policy: `admission.decision` has every reason with its code; `message`
    /// says them in one line for the person who asked ([`denial`]).
    Denied {
        /// The decision, and no lease.
        admission: Admission,
        /// The denial in one line.
        message: String,
    },
    /// Not decided, for a mistake the asker can fix: the request names a team, substrate or
    /// lease that does not exist, is for a team or user the principal does not act for, or
    /// breaks a field's rule ([`ServiceError::NotFound`], [`ServiceError::Forbidden`],
    /// [`ServiceError::Invalid`]). A substrate's door denies it in the error's words; the API
    /// answers it with the error's status.
    Refused(ServiceError),
}

impl Answer {
    /// The service's answer as it was: the admission, or a refusal as its error. For a door
    /// that answers a refusal as an error (the API, the portal).
    pub fn into_result(self) -> Result<Admission, ServiceError> {
        match self {
            Self::Admitted(admission) | Self::Denied { admission, .. } => Ok(admission),
            Self::Refused(e) => Err(e),
        }
    }
}

/// Asks the service to admit `request` for `principal`, the lease coming to be as `grant` says,
/// and sorts its answer (see [`Answer`]). What failed rather than decided (the store, a
/// substrate, a bug, an idempotency key or lease id in conflict) is the error, for the door to
/// answer as it must: a status from the API, `on_unavailable` in the Slurm hook, a 503 or
/// `failurePolicy` from the webhook, a Kueue check left pending.
pub async fn admit(
    service: &Service,
    principal: &Principal,
    grant: Grant<'_>,
    request: AdmissionRequest,
) -> Result<Answer, ServiceError> {
    let (team, model, gpus) = (
        request.team.clone(),
        request.gpu_model.clone(),
        request.gpus,
    );
    let answered = match grant {
        Grant::Provision { key } => service.admit(principal, request, key).await,
        Grant::Hold => service.hold(principal, request).await,
        Grant::Named(lease_id) => service.admit_named(principal, request, lease_id).await,
    };
    Ok(match answered {
        Ok(admission) if admission.decision.admitted() => Answer::Admitted(admission),
        Ok(admission) => Answer::Denied {
            message: denial(&team, model.as_deref(), gpus, &admission.decision),
            admission,
        },
        Err(
            e @ (ServiceError::Forbidden(_)
            | ServiceError::NotFound(_)
            | ServiceError::Invalid { .. }),
        ) => Answer::Refused(e),
        Err(e) => return Err(e),
    })
}

/// What a substrate's own door (the Slurm hook, the Kubernetes webhook, the Kueue check) asks
/// for the work the substrate is starting, read from the substrate's request.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkAsk {
    /// The substrate starting the work.
    pub substrate: String,
    /// The team, as the door mapped it ([`team_of`]).
    pub team: String,
    /// The person.
    pub user: String,
    /// The project.
    pub project: String,
    /// The kind of work.
    pub workload: Workload,
    /// GPUs, as the door counted them (past `u32::MAX`, asked as `u32::MAX`, which no quota
    /// allows).
    pub gpus: u64,
    /// The GPU model the work runs on.
    pub gpu_model: String,
    /// How long the work asked to run (Slurm's `--time`, a pod's `activeDeadlineSeconds`, a
    /// Workload's `maximumExecutionTimeSeconds`), if it said.
    pub asked: Option<Duration>,
    /// Labels naming the work on its substrate, carried into lease events.
    pub labels: BTreeMap<String, String>,
    /// Decide only (a server-side dry run of the pod): nothing is recorded.
    pub dry_run: bool,
}

impl WorkAsk {
    /// The admission request for this work under `config`: its duration is [`duration`]'s.
    pub fn request(self, config: &Config) -> AdmissionRequest {
        AdmissionRequest {
            duration: duration(config, self.workload, self.asked),
            team: self.team,
            user: self.user,
            project: self.project,
            workload: self.workload,
            gpus: u32::try_from(self.gpus).unwrap_or(u32::MAX),
            gpu_model: Some(self.gpu_model),
            substrate: Some(self.substrate),
            labels: Some(self.labels),
            dry_run: self.dry_run,
            command: None,
        }
    }
}

/// How long work that a substrate starts by itself may run: what it `asked` for cut to
/// `workload`'s `max_duration`, or that when it asked none (and what it asked when the workload
/// has no limit).
pub fn duration(config: &Config, workload: Workload, asked: Option<Duration>) -> Option<Duration> {
    match (asked, config.workload(workload).max_duration) {
        (Some(a), Some(m)) => Some(a.min(m)),
        (a, m) => a.or(m),
    }
}

/// The team a substrate's name for one (a Slurm account or partition, a Kubernetes namespace)
/// maps to: its entry in the substrate's `teams`, else the team of that very name, else the
/// `"*"` entry.
pub fn team_of(teams: &BTreeMap<String, String>, config: &Config, name: &str) -> Option<String> {
    teams
        .get(name)
        .cloned()
        .or_else(|| config.team(name).map(|t| t.name.clone()))
        .or_else(|| teams.get("*").cloned())
}

/// Who a substrate's own door acts as (`kubernetes:<substrate>`, `kueue:<substrate>`): a
/// service for every team, since the substrate's mapping chose the team.
pub fn substrate_principal(config: &Config, name: String) -> Principal {
    Principal {
        name,
        role: Role::Service,
        teams: config.teams.iter().map(|t| t.name.clone()).collect(),
    }
}

/// The line for the person who asked when `request` was admitted (or, in a dry run, would be)
/// as lease `lease_id`: team, workload, GPUs, the estimate and when it ends.
pub fn admitted(request: &AdmissionRequest, decision: &Decision, lease_id: &str) -> String {
    format!(
        "gpuwarden: {} for team {} as {}: {} x {}, about ${:.2}/h, lease {lease_id}{}",
        if request.dry_run {
            "would admit"
        } else {
            "admitted"
        },
        request.team,
        request.workload,
        request.gpus,
        request.gpu_model.as_deref().unwrap_or("GPU"),
        decision.estimate.usd_per_hour,
        request.duration.map_or(String::new(), |d| format!(
            ", ends after {}",
            humantime::format_duration(d)
        )),
    )
}

/// The line for the person who asked when a request of `team` for `gpus` of `model` was
/// denied: every reason with its code, and the estimate.
pub fn denial(team: &str, model: Option<&str>, gpus: u32, decision: &Decision) -> String {
    let reasons: Vec<String> = decision
        .reasons
        .iter()
        .map(|r| format!("{}: {}", r.code.as_str(), r.message))
        .collect();
    let reasons = if reasons.is_empty() {
        "no_capacity: no GPUs fit".to_owned()
    } else {
        reasons.join("; ")
    };
    format!(
        "gpuwarden: denied {gpus} x {} for team {team}: {reasons} (estimate ${:.2}/h)",
        model.unwrap_or("GPU"),
        decision.estimate.usd_per_hour
    )
}

#[cfg(test)]
mod tests {
    use gpuwarden_schema::config::WorkloadPolicy;

    use super::*;
    use crate::policy::{Estimate, Reason, ReasonCode};

    const HOUR: Duration = Duration::from_secs(3600);

    /// Notebooks last at most 8 h; batch work has no limit.
    fn config() -> Config {
        let mut config = Config::default();
        config.workloads.insert(
            Workload::Notebook,
            WorkloadPolicy {
                max_duration: Some(8 * HOUR),
                ..WorkloadPolicy::default()
            },
        );
        config
    }

    fn decision(reasons: Vec<Reason>) -> Decision {
        Decision {
            reasons,
            estimate: Estimate {
                usd_per_hour: 6.5,
                max_usd: None,
                gpu_model: None,
            },
            placement: None,
            duration: None,
        }
    }

    #[test]
    fn work_a_substrate_starts_runs_for_what_it_asked_cut_to_its_workloads_longest() {
        let config = config();
        let notebook = |asked| duration(&config, Workload::Notebook, asked);
        assert_eq!(notebook(Some(2 * HOUR)), Some(2 * HOUR));
        assert_eq!(notebook(Some(20 * HOUR)), Some(8 * HOUR));
        assert_eq!(notebook(None), Some(8 * HOUR));
        assert_eq!(
            duration(&config, Workload::Batch, Some(20 * HOUR)),
            Some(20 * HOUR)
        );
        assert_eq!(duration(&config, Workload::Batch, None), None);
    }

    #[test]
    fn a_work_ask_becomes_the_request_of_its_substrate_and_model() {
        let ask = WorkAsk {
            substrate: "k8s".into(),
            team: "ml".into(),
            user: "ada".into(),
            project: "p".into(),
            workload: Workload::Notebook,
            gpus: u64::from(u32::MAX) + 1,
            gpu_model: "NVIDIA H100".into(),
            asked: Some(20 * HOUR),
            labels: BTreeMap::from([("k8s_pod".into(), "train".into())]),
            dry_run: true,
        };
        let request = ask.request(&config());
        assert_eq!(request.gpus, u32::MAX);
        assert_eq!(request.duration, Some(8 * HOUR));
        assert_eq!(request.substrate.as_deref(), Some("k8s"));
        assert_eq!(request.gpu_model.as_deref(), Some("NVIDIA H100"));
        assert_eq!(request.labels.unwrap()["k8s_pod"], "train");
        assert!(request.dry_run);
        assert_eq!(request.command, None);
    }

    #[test]
    fn the_lines_for_a_person_say_every_reason_and_the_estimate() {
        let denied = decision(vec![
            Reason {
                code: ReasonCode::QuotaExceeded,
                message: "ml holds 16 of 16 GPUs".into(),
            },
            Reason {
                code: ReasonCode::BudgetExceeded,
                message: "over budget".into(),
            },
        ]);
        assert_eq!(
            denial("ml", Some("H100"), 2, &denied),
            "gpuwarden: denied 2 x H100 for team ml: quota_exceeded: ml holds 16 of 16 GPUs; \
             budget_exceeded: over budget (estimate $6.50/h)"
        );
        assert_eq!(
            denial("ml", None, 1, &decision(Vec::new())),
            "gpuwarden: denied 1 x GPU for team ml: no_capacity: no GPUs fit (estimate $6.50/h)"
        );
        let mut request = WorkAsk {
            substrate: "k8s".into(),
            team: "ml".into(),
            user: "ada".into(),
            project: "p".into(),
            workload: Workload::Notebook,
            gpus: 2,
            gpu_model: "H100".into(),
            asked: None,
            labels: BTreeMap::new(),
            dry_run: false,
        }
        .request(&config());
        assert_eq!(
            admitted(&request, &decision(Vec::new()), "k8s-1"),
            "gpuwarden: admitted for team ml as notebook: 2 x H100, about $6.50/h, lease k8s-1, \
             ends after 8h"
        );
        request.dry_run = true;
        request.duration = None;
        assert_eq!(
            admitted(&request, &decision(Vec::new()), "k8s-1"),
            "gpuwarden: would admit for team ml as notebook: 2 x H100, about $6.50/h, lease k8s-1"
        );
    }
}
