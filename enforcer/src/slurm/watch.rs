//! The watcher of a Slurm substrate's queue: every `poll`, it reads the queue and makes the
//! leases follow the jobs.
//!
//! - A job admitted by the submit hook (`admin_comment` `gpuwarden:hold=<hold>`) binds its hold
//!   to lease `slurm-<cluster>-<job id>` (an array's id for its tasks): the lease's `granted`
//!   LeaseEvent is published then.
//! - A lease goes `active` when its job (any task of an array) runs, and ends when its job has
//!   ended, however: `COMPLETED` and `CANCELLED` release it (reason `user`), `TIMEOUT` (reason
//!   `expired`), `FAILED`, `NODE_FAIL`, `OUT_OF_MEMORY`… fail it (reason `failed`); a job that
//!   left the queue before its end was seen releases it too.
//! - A job asking for GPUs that no hold or lease knows bypassed the hook (submitted before
//!   gpuwarden, or by root): it is adopted as a lease (an `admit` Action, reason `adopted`) when
//!   its account or partition maps to a team, else reported once as unattributed (an `alert`
//!   Action, reason `slurm_unattributed`, and a warning in the log).
//! - A hold whose job never reached the queue in `hold_timeout` (Slurm refused the job after the
//!   hook admitted it) is dropped, giving its GPUs back.
//!
//! Leases the runtime rules reclaim are cancelled by the driver (`scancel`); the watcher then
//! finds them closed already.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use gpuwarden_schema::{ActionKind, Outcome, ReleaseReason};
use tokio::sync::watch;

use super::{team_name, team_of, workload_and_project, HOLD_COMMENT, LEASE_COMMENT};
use crate::drivers::slurm::jobs::{End, Job, Phase};
use crate::drivers::slurm::{by_lease, Snapshot};
use crate::drivers::{Driver as _, SlurmDriver};
use crate::service::{Service, ServiceError};
use crate::store::audit::Audit;
use crate::store::{Lease, LeaseState, HOLD_PREFIX};

/// A lease missing from the queue is ended only when it was seen there before, or is older than
/// this (a job being submitted may not be in the queue read a moment earlier).
const GRACE: Duration = Duration::from_secs(60);

/// Reads every Slurm substrate's cluster once (at most `timeout` each), so that the submit hook's
/// first questions are answered from a snapshot rather than by asking Slurm, which waits for the
/// hook. Called before the API serves; a cluster that cannot be read is logged and left to the
/// watcher.
pub async fn prime(service: &Service, timeout: Duration) {
    for substrate in &service.config().substrates {
        let Some(driver) = service.driver_named(&substrate.name) else {
            continue;
        };
        let Some(slurm) = driver.slurm() else {
            continue;
        };
        match tokio::time::timeout(timeout, slurm.snapshot(Duration::ZERO)).await {
            Ok(Ok(snapshot)) => tracing::info!(
                substrate = %substrate.name,
                jobs = snapshot.jobs.len(),
                gpus = snapshot.inventory.pooled.iter().map(|(_, n)| u64::from(*n)).sum::<u64>(),
                "read the Slurm cluster"
            ),
            Ok(Err(e)) => {
                tracing::warn!(substrate = %substrate.name, error = %e, "cannot read the Slurm cluster yet; the watcher keeps trying")
            }
            Err(_) => {
                tracing::warn!(substrate = %substrate.name, ?timeout, "the Slurm cluster did not answer in time; the watcher keeps trying")
            }
        }
    }
}

/// Watches substrate `substrate`'s queue until `stop` turns true.
pub async fn run(service: Service, substrate: String, mut stop: watch::Receiver<bool>) {
    let Some(driver) = service.driver_named(&substrate) else {
        return;
    };
    let Some(poll) = driver.slurm().map(SlurmDriver::poll) else {
        return;
    };
    let mut watcher = Watcher::default();
    loop {
        if let Err(e) = watcher.tick(&service, &substrate).await {
            tracing::warn!(substrate = %substrate, error = %e, "reading the Slurm queue failed; trying again");
        }
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// What the watcher remembers from one read of the queue to the next.
#[derive(Debug, Default)]
pub struct Watcher {
    /// Leases whose job was in the queue at some read.
    seen: HashSet<String>,
}

impl Watcher {
    /// One read of the queue and the lease changes it calls for.
    pub async fn tick(&mut self, service: &Service, substrate: &str) -> Result<(), String> {
        let driver = service
            .driver_named(substrate)
            .ok_or_else(|| format!("no driver runs substrate {substrate}"))?;
        let slurm = driver
            .slurm()
            .ok_or_else(|| format!("substrate {substrate} is not a Slurm cluster"))?;
        // Open leases first: one created after this read is not missing from the queue below.
        let open: BTreeMap<String, Lease> = service
            .open_leases()
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter(|l| l.substrate == substrate)
            .map(|l| (l.id.clone(), l))
            .collect();
        let snapshot = slurm
            .snapshot(Duration::ZERO)
            .await
            .map_err(|e| e.to_string())?;
        // Every replica reads the queue (its submit hook answers from the snapshot); only the
        // leader follows it into leases.
        if !service.leadership().is_leader() {
            self.seen.clear();
            return Ok(());
        }
        // Leases whose jobs this read found (ended ones too).
        let mut in_queue: HashSet<String> = HashSet::new();
        for (lease_job, jobs) in by_lease(&snapshot.jobs) {
            if jobs.iter().all(|j| j.gpus().gpus == 0) {
                continue;
            }
            match self
                .follow(service, slurm, &snapshot, &open, lease_job, &jobs)
                .await
            {
                Ok(Some(id)) => {
                    in_queue.insert(id);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(substrate, job_id = lease_job, error = %e, "could not follow a Slurm job")
                }
            }
        }
        let now = service.now();
        let hold_timeout = slurm
            .settings()
            .hold_timeout
            .unwrap_or(Duration::from_secs(60));
        for (id, lease) in &open {
            if in_queue.contains(id) {
                continue;
            }
            let age = Duration::from_millis((now - lease.updated_at).max(0) as u64);
            if id.starts_with(HOLD_PREFIX) {
                if age > hold_timeout {
                    tracing::warn!(substrate, hold = %id, team = %lease.team, "no job came for an admission at submission; giving its GPUs back");
                    service.drop_hold(id).await.map_err(|e| e.to_string())?;
                }
                continue;
            }
            if lease.state == LeaseState::Releasing {
                continue;
            }
            if self.seen.contains(id) || age > GRACE {
                service
                    .ended(id, ReleaseReason::User, "its Slurm job left the queue")
                    .await
                    .map_err(|e| e.to_string())?;
                tracing::info!(substrate, lease_id = %id, "lease's Slurm job left the queue; released");
            }
        }
        self.seen.retain(|id| in_queue.contains(id));
        self.seen.extend(in_queue);
        Ok(())
    }

    /// Makes the lease of `jobs` (one job, or an array's records) follow them; the id of the
    /// lease that was open and follows them, if any.
    async fn follow(
        &mut self,
        service: &Service,
        slurm: &SlurmDriver,
        snapshot: &Snapshot,
        open: &BTreeMap<String, Lease>,
        lease_job: u64,
        jobs: &[&Job],
    ) -> Result<Option<String>, ServiceError> {
        let phases: Vec<Phase> = jobs.iter().map(|j| j.phase()).collect();
        let running = phases.contains(&Phase::Running);
        let pending = phases.contains(&Phase::Pending);
        // Being killed or cleaning up: it still holds its GPUs, but starts nothing new.
        let completing = phases.contains(&Phase::Completing);
        let comment = |prefix: &str| {
            jobs.iter()
                .find_map(|j| j.admin_comment.strip_prefix(prefix).map(str::to_owned))
        };
        // The lease named after the job; when that id belongs to a lease that ended before this
        // job was queued (the controller's job ids started again, or the job was requeued after
        // its lease ended), the first free id of `<id>-<when that lease ended>`.
        // (A job the driver submitted names its lease, and needs none of this. A job that ended
        // needs it only to bind its hold, should it end before this watcher first saw it.)
        let named = comment(LEASE_COMMENT);
        let may_bind = comment(HOLD_COMMENT).is_some();
        let mut job_lease = slurm.lease_id(lease_job);
        if named.is_none() && (running || pending || may_bind) && !open.contains_key(&job_lease) {
            for _ in 0..8 {
                match service.stored_lease(&job_lease).await? {
                    Some(ended) if !ended.state.is_open() => {
                        let at = ended.released_at.unwrap_or(ended.updated_at);
                        job_lease = format!("{}-{at}", slurm.lease_id(lease_job));
                    }
                    _ => break,
                }
            }
        }
        let id = if let Some(id) = named {
            id
        } else if open.contains_key(&job_lease) {
            job_lease
        } else if let Some(hold) = self.open_hold(service, open, comment(HOLD_COMMENT)).await? {
            let state = if running {
                LeaseState::Active
            } else {
                LeaseState::Granted
            };
            let detail = format!(
                "admitted at submission; Slurm job {lease_job} on cluster {}",
                slurm.settings().cluster
            );
            service.bind(&hold, &job_lease, state, &detail).await?;
            tracing::info!(lease_id = %job_lease, hold = %hold, "Slurm job admitted at submission is queued; lease bound");
            return self
                .settle(
                    service,
                    &job_lease,
                    state,
                    running,
                    pending || completing,
                    &phases,
                )
                .await;
        } else if service.stored_lease(&job_lease).await?.is_some() {
            // Its lease ended already (reclaimed, or ended while its job still shows).
            return Ok(None);
        } else if running || pending {
            return self
                .unknown(
                    service,
                    slurm,
                    snapshot,
                    jobs,
                    &job_lease,
                    running,
                    comment(HOLD_COMMENT).is_some(),
                )
                .await;
        } else {
            return Ok(None);
        };
        let Some(lease) = open.get(&id) else {
            return Ok(None);
        };
        // What the job holds now may pass what was admitted where Slurm changed it without
        // asking (an array's throttle raised with scontrol): the lease follows what runs.
        let held: u64 = jobs
            .iter()
            .filter(|j| j.phase() == Phase::Running)
            .map(|j| j.gpus().gpus)
            .sum();
        let held = u32::try_from(held).unwrap_or(u32::MAX);
        if held > lease.gpu_count && lease.state != LeaseState::Releasing {
            service
                .follow_size(
                    &id,
                    held,
                    &format!(
                        "its Slurm job holds {held} GPUs, {} more than admitted",
                        held - lease.gpu_count
                    ),
                )
                .await?;
            tracing::warn!(lease_id = %id, held, admitted = lease.gpu_count, "a Slurm job holds more GPUs than admitted; its lease follows");
        }
        self.settle(
            service,
            &id,
            lease.state,
            running,
            pending || completing,
            &phases,
        )
        .await
    }

    /// Hold `hold`, if it is open: in `open`, or admitted since `open` was read.
    async fn open_hold(
        &self,
        service: &Service,
        open: &BTreeMap<String, Lease>,
        hold: Option<String>,
    ) -> Result<Option<String>, ServiceError> {
        let Some(hold) = hold else { return Ok(None) };
        if open.contains_key(&hold) {
            return Ok(Some(hold));
        }
        let now_open = service
            .stored_lease(&hold)
            .await?
            .is_some_and(|l| l.state.is_open());
        Ok(now_open.then_some(hold))
    }

    /// Moves lease `id` (now `state`) to where its jobs are.
    async fn settle(
        &mut self,
        service: &Service,
        id: &str,
        state: LeaseState,
        running: bool,
        pending: bool,
        phases: &[Phase],
    ) -> Result<Option<String>, ServiceError> {
        if running && state == LeaseState::Granted {
            service.activate(id).await?;
            tracing::info!(lease_id = %id, "lease's Slurm job started");
        }
        // The lease is accounted for in this read, whatever happens below.
        let followed = Some(id.to_owned());
        if running || pending || state == LeaseState::Releasing {
            return Ok(followed);
        }
        // Every job ended: the worst end says how (a failed task fails an array).
        let end = phases
            .iter()
            .filter_map(|p| match p {
                Phase::Ended(e) => Some(*e),
                _ => None,
            })
            .max_by_key(|e| match e {
                End::Completed => 0,
                End::Cancelled => 1,
                End::Timeout => 2,
                End::Failed => 3,
            })
            .unwrap_or(End::Completed);
        let (reason, detail) = match end {
            End::Completed => (ReleaseReason::User, "its Slurm job completed"),
            End::Cancelled => (ReleaseReason::User, "its Slurm job was cancelled"),
            End::Timeout => (
                ReleaseReason::Expired,
                "its Slurm job reached its time limit",
            ),
            End::Failed => (ReleaseReason::Failed, "its Slurm job failed"),
        };
        service.ended(id, reason, detail).await?;
        tracing::info!(lease_id = %id, detail, "lease's Slurm job ended");
        Ok(followed)
    }

    /// A job no lease knows: adopted, or reported.
    #[allow(clippy::too_many_arguments)]
    async fn unknown(
        &mut self,
        service: &Service,
        slurm: &SlurmDriver,
        snapshot: &Snapshot,
        jobs: &[&Job],
        lease_id: &str,
        running: bool,
        admitted: bool,
    ) -> Result<Option<String>, ServiceError> {
        let job = jobs[0];
        let settings = slurm.settings();
        let config = service.config();
        let (_, name) = team_name(settings, &job.account, &job.partition);
        let team = team_of(settings, config, name);
        let adopt = settings.adopt.unwrap_or(true) || admitted;
        let request = job.gpus();
        let (Some(team), true, Ok(())) = (team, adopt, crate::fields::check_name(&job.user_name))
        else {
            let record = Audit::fleet(ActionKind::Alert, "slurm_unattributed").at(
                service.now(),
                Outcome::Ok,
                format!(
                    "Slurm job {} of user {} (account {:?}, partition {:?}) holds or waits for \
                     {} GPUs outside gpuwarden: its team is not mapped",
                    job.job_id, job.user_name, job.account, job.partition, request.gpus
                ),
            );
            if service
                .record_once(&format!("slurm_unattributed:{lease_id}"), &record)
                .await?
            {
                tracing::warn!(job_id = job.job_id, user = %job.user_name, account = %job.account, "a Slurm job with GPUs is outside gpuwarden and maps to no team; reported as unattributed");
            }
            return Ok(None);
        };
        let (workload, project) = workload_and_project(
            settings,
            [&job.wckey, &job.comment, &job.name].map(String::as_str),
            name,
            &job.partition,
        );
        let model = match &request.gpu_type {
            Some(t) => slurm.model_of(t),
            None => snapshot
                .inventory
                .pooled
                .first()
                .map_or_else(|| slurm.model_of(""), |(m, _)| m.clone()),
        };
        let now = service.now();
        let count: u64 = jobs
            .iter()
            .filter(|j| matches!(j.phase(), Phase::Running | Phase::Pending))
            .map(|j| j.gpus().gpus)
            .max()
            .unwrap_or(request.gpus);
        let lease = Lease {
            id: lease_id.to_owned(),
            team,
            user: job.user_name.clone(),
            project,
            workload,
            substrate: slurm.name().to_owned(),
            gpu_model: model,
            gpu_count: u32::try_from(count).unwrap_or(u32::MAX),
            gpu_uuids: Vec::new(),
            labels: BTreeMap::from([
                ("slurm_cluster".to_owned(), settings.cluster.clone()),
                ("slurm_adopted".to_owned(), "true".to_owned()),
            ]),
            state: if running {
                LeaseState::Active
            } else {
                LeaseState::Granted
            },
            granted_at: now,
            expires_at: None,
            updated_at: now,
            released_at: None,
            release_reason: None,
            admission_key: None,
            substrate_ref: None,
        };
        let detail = if admitted {
            format!(
                "Slurm job {} was admitted at submission but its hold was gone; adopted",
                job.job_id
            )
        } else {
            format!("Slurm job {} bypassed the submit hook; adopted", job.job_id)
        };
        service.adopt(lease, &detail).await?;
        tracing::info!(lease_id, job_id = job.job_id, user = %job.user_name, "adopted a Slurm job that bypassed the submit hook");
        Ok(Some(lease_id.to_owned()))
    }
}
