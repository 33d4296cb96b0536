//! Slurm's side of admission and of the lease lifecycle, over the [`Service`]: the submit hook's
//! questions ([`submit`], [`modify`]) and the watcher that turns the queue into lease changes
//! ([`watch`]).
//!
//! The hook (`deploy/slurm/job_submit.lua`) runs inside slurmctld, one submission at a time,
//! and sends Slurm's raw fields; everything that decides lives here, configured in
//! `[substrates.slurm]`: the GPUs a job asks for (`jobs::GpuRequest`), its team (from its
//! account or partition), its user (the Slurm user), its workload and project (from its wckey,
//! comment or job name, as `<workload>[:<project>]`), its model (from the GRES type). An
//! admitted job is recorded as a hold (its job id does not exist yet) and answered with the
//! `admin_comment` that lets the watcher bind it to lease `slurm-<cluster>-<job id>` once the
//! job is queued; the answer also sets its time limit to the workload's `max_duration` when it
//! asks for more or for none.
//!
//! A job submitted by the driver itself (an API admission on the Slurm substrate) carries
//! `GPUWARDEN_LEASE_ID`: the hook's question names that lease, which is admitted already, so the
//! answer only checks that the lease is this user's, on this substrate, and not yet claimed by
//! another job.

pub(crate) mod routes;
pub mod watch;

pub use self::routes::router;

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use utoipa::ToSchema;

use crate::door::{self, Grant};
use crate::drivers::slurm::jobs::{array_tasks, GpuRequest, TresFields};
use crate::drivers::SlurmDriver;
use crate::fields;
use crate::policy::Principal;
use crate::service::{Service, ServiceError};
use crate::store::LeaseState;
use gpuwarden_schema::config::{Config, Role, SlurmSettings, SlurmTeamFrom, SlurmWorkloadFrom};
use gpuwarden_schema::Workload;

/// The `admin_comment` prefix of a job admitted at submission: `gpuwarden:hold=<hold id>`.
pub const HOLD_COMMENT: &str = "gpuwarden:hold=";
/// The `admin_comment` prefix of a job the driver submitted: `gpuwarden:lease=<lease id>`.
pub const LEASE_COMMENT: &str = "gpuwarden:lease=";
/// The label of an array's lease: how many of its tasks may run at once.
pub const ARRAY_AT_ONCE: &str = "slurm_array_at_once";

/// What the submit hook sends for a job being submitted (`POST /v1/slurm/{substrate}/submit`):
/// Slurm's fields as the job asked for them; absent ones are null.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// The submitting Slurm user.
    pub user: String,
    /// Its uid.
    #[serde(default, deserialize_with = "crate::fields::optional_whole_u32")]
    pub uid: Option<u32>,
    /// `--account`.
    #[serde(default)]
    pub account: Option<String>,
    /// `--partition`; the cluster's default partition when null.
    #[serde(default)]
    pub partition: Option<String>,
    /// `--qos`.
    #[serde(default)]
    pub qos: Option<String>,
    /// `--comment`.
    #[serde(default)]
    pub comment: Option<String>,
    /// `--wckey`.
    #[serde(default)]
    pub wckey: Option<String>,
    /// `--job-name`.
    #[serde(default)]
    pub job_name: Option<String>,
    /// Slurm's TRES strings: `--gres`/`--gpus-per-node`.
    #[serde(default)]
    pub tres_per_node: Option<String>,
    /// `--gpus`.
    #[serde(default)]
    pub tres_per_job: Option<String>,
    /// `--gpus-per-task`.
    #[serde(default)]
    pub tres_per_task: Option<String>,
    /// `--gpus-per-socket`.
    #[serde(default)]
    pub tres_per_socket: Option<String>,
    /// `--nodes` (minimum).
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub min_nodes: Option<u64>,
    /// `--nodes`' maximum.
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub max_nodes: Option<u64>,
    /// `--ntasks`.
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub num_tasks: Option<u64>,
    /// `--ntasks-per-node`.
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub ntasks_per_node: Option<u64>,
    /// `--sockets-per-node`.
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub sockets_per_node: Option<u64>,
    /// `--array`'s index (`0-9%2`).
    #[serde(default)]
    pub array_inx: Option<String>,
    /// `--time`, minutes.
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub time_limit: Option<u64>,
    /// `GPUWARDEN_LEASE_ID` in the job's environment.
    #[serde(default)]
    pub lease_id: Option<String>,
}

/// What the hook sends when a job's GPUs change (`POST /v1/slurm/{substrate}/modify`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModifyRequest {
    /// The job.
    #[serde(deserialize_with = "crate::fields::whole_u64")]
    pub job_id: u64,
    /// The job's user, if the hook knows it.
    #[serde(default)]
    pub user: Option<String>,
    /// The uid changing it.
    #[serde(default, deserialize_with = "crate::fields::optional_whole_u32")]
    pub uid: Option<u32>,
    /// The job's `admin_comment` (set at submission).
    #[serde(default)]
    pub admin_comment: Option<String>,
    /// The GPU requests as they will be.
    #[serde(default)]
    pub tres_per_node: Option<String>,
    /// `--gpus`.
    #[serde(default)]
    pub tres_per_job: Option<String>,
    /// `--gpus-per-task`.
    #[serde(default)]
    pub tres_per_task: Option<String>,
    /// `--gpus-per-socket`.
    #[serde(default)]
    pub tres_per_socket: Option<String>,
    /// `--nodes`.
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub min_nodes: Option<u64>,
    /// `--nodes`' maximum.
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub max_nodes: Option<u64>,
    /// `--ntasks`.
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub num_tasks: Option<u64>,
    /// `--ntasks-per-node`.
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub ntasks_per_node: Option<u64>,
    /// `--sockets-per-node`.
    #[serde(default, deserialize_with = "crate::fields::optional_whole")]
    pub sockets_per_node: Option<u64>,
    /// An array's new index or throttle (`%4`), when it changes.
    #[serde(default)]
    pub array_inx: Option<String>,
}

/// The answer to the hook: lines of `key=value` after `admit` or `deny`, for a Lua plugin that
/// has no JSON parser.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// Whether the job may be submitted (or changed).
    pub admit: bool,
    /// What the hook sets the job's `admin_comment` to.
    pub admin_comment: Option<String>,
    /// What the hook sets the job's time limit to, minutes.
    pub time_limit: Option<u64>,
    /// For the user, one line.
    pub message: String,
}

impl Answer {
    fn deny(message: impl Into<String>) -> Self {
        Self {
            admit: false,
            admin_comment: None,
            time_limit: None,
            message: message.into(),
        }
    }

    fn admit(message: impl Into<String>) -> Self {
        Self {
            admit: true,
            ..Self::deny(message)
        }
    }

    /// The answer as the hook reads it.
    pub fn to_text(&self) -> String {
        let one_line = |s: &str| s.replace(['\n', '\r'], " ");
        let mut out = String::from(if self.admit { "admit\n" } else { "deny\n" });
        if let Some(comment) = &self.admin_comment {
            out.push_str(&format!("admin_comment={}\n", one_line(comment)));
        }
        if let Some(minutes) = self.time_limit {
            out.push_str(&format!("time_limit={minutes}\n"));
        }
        out.push_str(&format!("message={}\n", one_line(&self.message)));
        out
    }
}

/// The name that says a job's team (`team_from`): its account or its partition, with which of
/// the two it is.
pub(crate) fn team_name<'a>(
    settings: &SlurmSettings,
    account: &'a str,
    partition: &'a str,
) -> (&'static str, &'a str) {
    match settings.team_from {
        SlurmTeamFrom::Account => ("account", account),
        SlurmTeamFrom::Partition => ("partition", partition),
    }
}

/// The team Slurm name `name` maps to (see [`door::team_of`]).
pub(crate) fn team_of(settings: &SlurmSettings, config: &Config, name: &str) -> Option<String> {
    door::team_of(&settings.teams, config, name)
}

/// A job's workload and project from `<workload>[:<project>]` in the field `workload_from`
/// names (`default_workload` when it names none); the project falls back to the team's Slurm
/// name, then the partition, then `default`.
pub(crate) fn workload_and_project(
    settings: &SlurmSettings,
    [wckey, comment, job_name]: [&str; 3],
    team_name: &str,
    partition: &str,
) -> (Workload, String) {
    let field = match settings.workload_from {
        SlurmWorkloadFrom::Wckey => wckey,
        SlurmWorkloadFrom::Comment => comment,
        SlurmWorkloadFrom::JobName => job_name,
    };
    let (workload, project) = field.split_once(':').unwrap_or((field, ""));
    let workload = Workload::ALL
        .into_iter()
        .find(|w| w.as_str() == workload.trim())
        .unwrap_or(settings.default_workload);
    let project = [project.trim(), team_name, partition]
        .into_iter()
        .find(|p| !p.is_empty() && fields::check_name(p).is_ok())
        .unwrap_or("default")
        .to_owned();
    (workload, project)
}

/// The hook's answers come from the watcher's snapshot of the cluster, never from a Slurm
/// command (slurmctld waits for the answer under its locks, so the command would wait for the
/// hook). Before the first read of the cluster there is nothing to answer from: a failure, which
/// the hook treats by its `on_unavailable`.
fn require_snapshot(slurm: &SlurmDriver, substrate: &str) -> Result<(), ServiceError> {
    match slurm.kept() {
        Some(_) => Ok(()),
        None => Err(ServiceError::Substrate(format!(
            "gpuwarden has not read Slurm cluster {substrate} yet; its watcher keeps trying"
        ))),
    }
}

/// Only the cluster's hook speaks for its users: a service or an admin token.
fn check_hook(principal: &Principal) -> Result<(), ServiceError> {
    match principal.role {
        Role::Admin | Role::Service => Ok(()),
        _ => Err(ServiceError::Forbidden(format!(
            "{} may not speak for a Slurm cluster: the submit hook needs a service or admin token",
            principal.name
        ))),
    }
}

/// Decides a job being submitted to Slurm substrate `substrate`.
pub async fn submit(
    service: &Service,
    principal: &Principal,
    substrate: &str,
    request: SubmitRequest,
) -> Result<Answer, ServiceError> {
    check_hook(principal)?;
    let driver = service.driver_named(substrate).ok_or_else(|| {
        ServiceError::NotFound(format!("there is no substrate named {substrate}"))
    })?;
    let slurm = driver.slurm().ok_or_else(|| {
        ServiceError::NotFound(format!("substrate {substrate} is not a Slurm cluster"))
    })?;
    let tres = TresFields {
        tres_per_node: request.tres_per_node.clone(),
        tres_per_job: request.tres_per_job.clone(),
        tres_per_task: request.tres_per_task.clone(),
        tres_per_socket: request.tres_per_socket.clone(),
        min_nodes: request.min_nodes,
        max_nodes: request.max_nodes,
        num_tasks: request.num_tasks,
        ntasks_per_node: request.ntasks_per_node,
        sockets_per_node: request.sockets_per_node,
    };
    let wanted = GpuRequest::of(&tres);
    if wanted.gpus == 0 {
        return Ok(Answer::admit(""));
    }
    require_snapshot(slurm, substrate)?;
    if let Some(why) = &wanted.uncountable {
        return Ok(Answer::deny(format!("gpuwarden: denied: {why}")));
    }
    if let Some(lease_id) = &request.lease_id {
        return Ok(claim(
            service,
            principal,
            slurm,
            substrate,
            &request.user,
            lease_id,
            wanted.gpus,
        )
        .await);
    }
    let job = match read_job(slurm, service.config(), substrate, &request, &wanted) {
        Ok(job) => job,
        Err(denied) => return Ok(denied),
    };
    let (team, model, workload, asked) = (
        job.ask.team.clone(),
        job.ask.gpu_model.clone(),
        job.ask.workload,
        job.ask.asked,
    );
    let request = job.ask.request(service.config());
    let admission = match door::admit(service, principal, Grant::Hold, request).await? {
        door::Answer::Admitted(admission) => admission,
        door::Answer::Denied { message, .. } => return Ok(Answer::deny(message)),
        // What the user can fix (a name, a team it is not in) is a denial, not an outage.
        door::Answer::Refused(e) => return Ok(Answer::deny(format!("gpuwarden: denied: {e}"))),
    };
    let decision = &admission.decision;
    let Some(hold) = admission.lease else {
        return Err(ServiceError::Bug(
            "an admitted hold came back without its lease".into(),
        ));
    };
    // The model is matched as a part of a name; only the very model counts.
    if hold.gpu_model != model {
        service.drop_hold(&hold.id).await?;
        return Ok(Answer::deny(format!(
            "gpuwarden: denied: this cluster has no GPUs of model {model}"
        )));
    }
    let minutes = decision.duration.map(|d| d.as_secs().div_ceil(60).max(1));
    let clamped = match (asked, decision.duration) {
        (None, Some(_)) => " (the workload's longest)",
        (Some(a), Some(d)) if d < a => " (cut to the workload's longest)",
        _ => "",
    };
    Ok(Answer {
        admit: true,
        admin_comment: Some(format!("{HOLD_COMMENT}{}", hold.id)),
        time_limit: minutes,
        message: format!(
            "gpuwarden: admitted for team {team} as {workload}: {} x {}{}, about \
             ${:.2}/h{}{clamped}",
            hold.gpu_count,
            hold.gpu_model,
            job.array_note,
            decision.estimate.usd_per_hour,
            minutes.map_or(String::new(), |m| format!(", time limit {m} min")),
        ),
    })
}

/// A job being submitted, read into what it asks admission for.
struct Job {
    /// Its team, user, workload, project, GPUs, model, time limit and labels.
    ask: door::WorkAsk,
    /// For an array, how many tasks and how many at once, for the answer's message.
    array_note: String,
}

/// Reads a job being submitted to `substrate`, which `wanted` GPUs: its team (from its account
/// or partition), user, workload and project, GPUs (an array's tasks that may run at once, each
/// with the job's), model (its GRES type's), time limit and labels; or the denial of a job that
/// names none of them in a way gpuwarden can use.
fn read_job(
    slurm: &SlurmDriver,
    config: &Config,
    substrate: &str,
    request: &SubmitRequest,
    wanted: &GpuRequest,
) -> Result<Job, Answer> {
    let settings = slurm.settings();
    // Its team, from its account or partition.
    let partition = match &request.partition {
        Some(p) => Some(p.clone()),
        // Never a Slurm command here: slurmctld waits for this answer under its locks.
        None => slurm.kept().and_then(|s| s.default_partition),
    };
    let (from, name) = team_name(
        settings,
        request.account.as_deref().unwrap_or(""),
        partition.as_deref().unwrap_or(""),
    );
    let Some(team) = team_of(settings, config, name) else {
        return Err(Answer::deny(format!(
            "gpuwarden: denied: the job's {from} {name:?} maps to no team (ask an \
             administrator to add it to substrate {substrate}'s slurm.teams)"
        )));
    };
    if let Err(why) = fields::check_name(&request.user) {
        return Err(Answer::deny(format!(
            "gpuwarden: denied: Slurm user {:?} is not a name gpuwarden accepts: {why}",
            request.user
        )));
    }
    let (workload, project) = workload_and_project(
        settings,
        [&request.wckey, &request.comment, &request.job_name].map(|f| f.as_deref().unwrap_or("")),
        name,
        partition.as_deref().unwrap_or(""),
    );
    // An array is decided once: its tasks that may run at once, each with the job's GPUs.
    let mut gpus = wanted.gpus;
    let mut array_note = String::new();
    let mut at_once_label = None;
    if let Some(index) = request.array_inx.as_deref().filter(|i| !i.is_empty()) {
        let Some((count, at_once)) = array_tasks(index) else {
            return Err(Answer::deny(format!(
                "gpuwarden: denied: cannot read the array index {index:?}"
            )));
        };
        gpus = gpus.saturating_mul(at_once);
        array_note = format!(" (an array of {count} tasks, {at_once} at once)");
        at_once_label = Some(at_once);
    }
    // The model: the GRES type's; a job naming no type may land on any GPU of the cluster, so it
    // is priced and checked as one only when the cluster has one model.
    let model = match &wanted.gpu_type {
        Some(t) => slurm.model_of(t),
        None => {
            let models: Vec<String> = slurm
                .kept()
                .map(|s| s.inventory.pooled.iter().map(|(m, _)| m.clone()).collect())
                .unwrap_or_default();
            match models.as_slice() {
                [one] => one.clone(),
                _ => {
                    return Err(Answer::deny(format!(
                        "gpuwarden: denied: name a GPU type (--gres=gpu:<type>:N or \
                         --gpus=<type>:N): this cluster has {}",
                        models.join(", ")
                    )))
                }
            }
        }
    };
    let asked = request
        .time_limit
        .map(|m| Duration::from_secs(m.saturating_mul(60)));
    let mut labels = BTreeMap::from([("slurm_cluster".to_owned(), settings.cluster.clone())]);
    for (key, value) in [
        ("slurm_account", request.account.as_deref()),
        ("slurm_partition", partition.as_deref()),
        ("slurm_job_name", request.job_name.as_deref()),
    ] {
        if let Some(v) = value.filter(|v| !v.is_empty()) {
            labels.insert(key.to_owned(), v.to_owned());
        }
    }
    if let Some(n) = at_once_label {
        labels.insert(ARRAY_AT_ONCE.to_owned(), n.to_string());
    }
    Ok(Job {
        ask: door::WorkAsk {
            substrate: substrate.to_owned(),
            team,
            user: request.user.clone(),
            project,
            workload,
            gpus,
            gpu_model: model,
            asked,
            labels,
            dry_run: false,
        },
        array_note,
    })
}

/// Admits a job the driver submitted for lease `lease_id`, once: the lease must be open,
/// `granted`, on this substrate, the user's, one the caller may act for, hold the job's GPUs,
/// and have no job yet (none claimed it since the enforcer started, and the driver keeps no job
/// for it).
#[allow(clippy::too_many_arguments)]
async fn claim(
    service: &Service,
    principal: &Principal,
    slurm: &SlurmDriver,
    substrate: &str,
    user: &str,
    lease_id: &str,
    gpus: u64,
) -> Answer {
    let refused = |why: &str| {
        Answer::deny(format!(
            "gpuwarden: denied: GPUWARDEN_LEASE_ID={lease_id} {why}; ask for GPUs through \
             gpuwarden, or submit without it"
        ))
    };
    // From memory: a made-up id must not make the hook wait for the store's writer.
    let lease = match service.open_lease(lease_id) {
        Ok(Some(lease)) => lease,
        Ok(None) => return refused("names no open lease"),
        Err(_) => return refused("cannot be checked now"),
    };
    if lease.substrate != substrate || lease.user != user {
        return refused("is not a lease of this user on this cluster");
    }
    if principal.write_refusal(&lease.team, &lease.user).is_some() {
        return refused("is not a lease this hook may act for");
    }
    if lease.state != LeaseState::Granted || u64::from(lease.gpu_count) < gpus {
        return refused("is not waiting for a job of this size");
    }
    if !slurm.claim(lease_id) {
        return refused("has its job already");
    }
    Answer {
        admit: true,
        admin_comment: Some(format!("{LEASE_COMMENT}{lease_id}")),
        time_limit: None,
        message: format!("gpuwarden: lease {lease_id}"),
    }
}

/// Decides a change of a pending job's GPUs (`scontrol update JobId=… Gres=…`).
pub async fn modify(
    service: &Service,
    principal: &Principal,
    substrate: &str,
    request: ModifyRequest,
) -> Result<Answer, ServiceError> {
    check_hook(principal)?;
    let driver = service.driver_named(substrate).ok_or_else(|| {
        ServiceError::NotFound(format!("there is no substrate named {substrate}"))
    })?;
    let slurm = driver.slurm().ok_or_else(|| {
        ServiceError::NotFound(format!("substrate {substrate} is not a Slurm cluster"))
    })?;
    require_snapshot(slurm, substrate)?;
    // Everything from memory: the hook must not wait for the store's writer.
    let open = |id: &str| service.open_lease(id);
    let comment = request.admin_comment.as_deref().unwrap_or("");
    let lease = if let Some(hold) = comment.strip_prefix(HOLD_COMMENT) {
        // Bound already, or still a hold.
        match open(&slurm.lease_id(request.job_id))? {
            Some(lease) => Some(lease),
            None => open(hold)?,
        }
    } else if let Some(id) = comment.strip_prefix(LEASE_COMMENT) {
        open(id)?
    } else {
        open(&slurm.lease_id(request.job_id))?
    };
    let wanted = GpuRequest::of(&TresFields {
        tres_per_node: request.tres_per_node,
        tres_per_job: request.tres_per_job,
        tres_per_task: request.tres_per_task,
        tres_per_socket: request.tres_per_socket,
        min_nodes: request.min_nodes,
        max_nodes: request.max_nodes,
        num_tasks: request.num_tasks,
        ntasks_per_node: request.ntasks_per_node,
        sockets_per_node: request.sockets_per_node,
    });
    let Some(lease) = lease else {
        // Not a job gpuwarden admitted: without GPUs it is none of gpuwarden's business; one
        // gaining GPUs would skip admission.
        if wanted.gpus == 0 {
            return Ok(Answer::admit(""));
        }
        return Ok(Answer::deny(
            "gpuwarden: denied: a job admitted without GPUs cannot gain them; submit it again \
             with its GPUs",
        ));
    };
    if let Some(why) = &wanted.uncountable {
        return Ok(Answer::deny(format!("gpuwarden: denied: {why}")));
    }
    if let Some(t) = &wanted.gpu_type {
        if slurm.model_of(t) != lease.gpu_model {
            return Ok(Answer::deny(format!(
                "gpuwarden: denied: lease {} holds {}; a job's GPU type cannot change after \
                 admission: submit it again",
                lease.id, lease.gpu_model
            )));
        }
    }
    // An array's lease holds its tasks that may run at once, each with the job's GPUs.
    let at_once = match request.array_inx.as_deref().filter(|i| !i.is_empty()) {
        Some(index) => match array_tasks(index) {
            Some((_, at_once)) => Some(at_once),
            None => {
                return Ok(Answer::deny(format!(
                    "gpuwarden: denied: cannot read the array index {index:?}"
                )))
            }
        },
        None => lease
            .labels
            .get(ARRAY_AT_ONCE)
            .and_then(|n| n.parse::<u64>().ok()),
    };
    if at_once.is_some() && !lease.labels.contains_key(ARRAY_AT_ONCE) {
        return Ok(Answer::deny(
            "gpuwarden: denied: a job admitted alone cannot become an array; submit it again",
        ));
    }
    let gpus = wanted.gpus.saturating_mul(at_once.unwrap_or(1));
    let gpus = u32::try_from(gpus).unwrap_or(u32::MAX);
    if gpus == 0 {
        return Ok(Answer::deny(
            "gpuwarden: denied: a job admitted with GPUs keeps at least one; cancel it instead",
        ));
    }
    if gpus == lease.gpu_count {
        return Ok(Answer::admit(""));
    }
    if lease.state != LeaseState::Granted {
        return Ok(Answer::deny(format!(
            "gpuwarden: denied: lease {} runs already; Slurm cannot change a running job's GPUs",
            lease.id
        )));
    }
    let admission = match service.resize_pending(principal, &lease.id, gpus).await {
        Ok(admission) => admission,
        Err(e @ (ServiceError::Forbidden(_) | ServiceError::Invalid { .. })) => {
            return Ok(Answer::deny(format!("gpuwarden: denied: {e}")))
        }
        Err(e) => return Err(e),
    };
    Ok(if admission.decision.admitted() {
        Answer::admit(format!(
            "gpuwarden: lease {} now holds {gpus} GPUs",
            lease.id
        ))
    } else {
        Answer::deny(door::denial(
            &lease.team,
            Some(&lease.gpu_model),
            gpus,
            &admission.decision,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_lines_the_hook_reads() {
        let answer = Answer {
            admit: true,
            admin_comment: Some("gpuwarden:hold=hold-1".into()),
            time_limit: Some(120),
            message: "two\nlines".into(),
        };
        assert_eq!(
            answer.to_text(),
            "admit\nadmin_comment=gpuwarden:hold=hold-1\ntime_limit=120\nmessage=two lines\n"
        );
        assert_eq!(Answer::deny("no").to_text(), "deny\nmessage=no\n");
    }
}
