//! The `slurm` driver: a Slurm cluster, driven through its command-line tools with `--json`.
//!
//! **Why the CLI and not slurmrestd.** The commands (`sbatch`, `squeue --json`, `sinfo --json`,
//! `scancel`, `scontrol`) authenticate with munge, which every Slurm node already runs, and
//! need nothing else; slurmrestd is one more daemon to run (as neither root nor SlurmUser), needs
//! JWT keys and tokens to rotate, and loses the submit hook's message on a rejected submission
//! (Slurm 22.05 answers only "Unspecified error"). The CLI costs a fork per call, which is why
//! the driver reads the queue and the nodes once per `poll` (default 2 s) into a snapshot, and
//! admission reads the snapshot, never Slurm. The REST API cannot be reached by accident: every
//! command runs with a cleared environment (no `SLURM_JWT`, no `SLURMRESTD_*`, no user's
//! `SLURM_*` defaults), `PATH` limited to the configured `bin_dir`, and only `SLURM_CONF` set.
//!
//! **What the driver does.**
//! - Inventory: the GPUs of the nodes that can run jobs, per GRES type (`gpu:h100:8`), as pooled
//!   capacity of the model the type maps to (`[substrates.slurm] models`). Slurm queues what
//!   cannot start now, so the inventory says so ([`Inventory::queues`]): a request fits when
//!   the cluster has that many GPUs of the model at all.
//! - Provision (a lease admitted through the API): `sbatch` as the user's system account (the
//!   local driver's `accounts` mapping and refusals), with the lease's command (or `sleep
//!   infinity`, to hold the GPUs until the lease is released), `--gres=gpu:<type>:<n>`, the
//!   lease's time limit, and `GPUWARDEN_LEASE_ID` in its environment, starting in `work_dir`
//!   (else the account's home) and writing `gpuwarden-<lease id>.out` there; the job id is kept
//!   in `<state_dir>/<lease_id>.json`. The submit hook recognizes the job by that variable and
//!   admits it as already admitted.
//! - Reclaim: the reason goes into the job's comment (`scontrol update … Comment=`), then
//!   `scancel`; Slurm signals the job and kills it after its `KillWait`. A job already ended
//!   counts as reclaimed.
//! - Status: from the latest snapshot of the queue.
//! - Resize: not supported. Slurm 22.05 cannot change a running job's GPUs ("Job is no longer
//!   pending execution"); a pending job's GPUs change with `scontrol update`, which the submit
//!   hook's modify check decides. The driver says so instead of pretending.
//!
//! Jobs submitted with `sbatch` by the cluster's users are admitted by the submit hook
//! (`deploy/slurm/job_submit.lua`, answered by the enforcer's `slurm` module, a layer above the
//! drivers); its watcher (`slurm::watch`) turns the queue into lease changes.

pub mod jobs;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gpuwarden_schema::config::{SlurmSettings, SubstrateConfig};
use gpuwarden_schema::ReleaseReason;
use serde::{Deserialize, Serialize};

use self::jobs::{Job, Nodes, Phase, Queue};
use super::account::{Account, Accounts};
use super::{
    check_lease_id, config_error, state_dir, write_atomically, Driver, DriverContext, DriverError,
    Inventory, LeaseSpec, LeaseStatus, Refusal,
};

/// How long one Slurm command may take before the call fails.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The model of GPUs whose GRES names no type.
pub const UNTYPED_MODEL: &str = "GPU";

/// What the driver last read of the cluster.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// When it was read.
    pub at: Instant,
    /// Every job the controller knows.
    pub jobs: Arc<Vec<Job>>,
    /// The GPUs, as an inventory.
    pub inventory: Arc<Inventory>,
    /// The partition jobs that name none run in.
    pub default_partition: Option<String>,
}

/// The `slurm` driver (see the module docs).
#[derive(Debug)]
pub struct SlurmDriver {
    name: String,
    settings: SlurmSettings,
    bin_dir: PathBuf,
    accounts: Accounts,
    work_dir: Option<PathBuf>,
    state_dir: PathBuf,
    snapshot: Mutex<Option<Snapshot>>,
    /// Set when a change of the driver's own (a submission, a cancel) makes the snapshot stale:
    /// the next reader that may wait reads the cluster again. The snapshot itself is kept for
    /// those that may not (the submit hook's answers).
    stale: std::sync::atomic::AtomicBool,
    /// Leases whose job the submit hook admitted already (see [`SlurmDriver::claim`]).
    claimed: Mutex<std::collections::HashSet<String>>,
    /// Serializes reads of the cluster, so that callers arriving together share one.
    reading: tokio::sync::Mutex<()>,
}

/// What the driver keeps of a lease it submitted.
#[derive(Debug, Serialize, Deserialize)]
struct Submitted {
    job_id: u64,
    /// The GPUs it asked for.
    gpus: u32,
}

impl SlurmDriver {
    /// The driver of a `slurm` entry.
    pub fn new(config: &SubstrateConfig, context: &DriverContext) -> Result<Self, DriverError> {
        let settings = config.slurm.clone().ok_or_else(|| {
            config_error(config, "slurm", "the slurm driver needs [substrates.slurm]")
        })?;
        let bin_dir = settings
            .bin_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("/usr/bin"));
        for tool in ["sbatch", "squeue", "sinfo", "scancel", "scontrol"] {
            if !bin_dir.join(tool).is_file() {
                return Err(config_error(
                    config,
                    "slurm.bin_dir",
                    format!(
                        "{} has no `{tool}`: install Slurm's client commands (Debian: \
                         slurm-client) or point bin_dir at them",
                        bin_dir.display()
                    ),
                ));
            }
        }
        let accounts =
            Accounts::new(config).map_err(|message| config_error(config, "accounts", message))?;
        Ok(Self {
            name: config.name.clone(),
            settings,
            bin_dir,
            accounts,
            work_dir: config.work_dir.clone(),
            state_dir: state_dir(config, context)?,
            snapshot: Mutex::default(),
            stale: std::sync::atomic::AtomicBool::new(false),
            claimed: Mutex::default(),
            reading: tokio::sync::Mutex::new(()),
        })
    }

    /// Claims lease `lease_id` for the job being submitted with its id: true the first time, so
    /// that a second job naming the same lease is refused. Forgotten when the lease is reclaimed.
    pub fn claim(&self, lease_id: &str) -> bool {
        // A job the driver submitted before a restart is on record.
        if self.submitted(lease_id).is_some() {
            return false;
        }
        self.claimed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(lease_id.to_owned())
    }

    /// Its `[substrates.slurm]` settings.
    pub fn settings(&self) -> &SlurmSettings {
        &self.settings
    }

    /// The lease id of the job whose lease is named after `job_id` (an array's id for its
    /// tasks): `slurm-<cluster>-<job_id>`.
    pub fn lease_id(&self, job_id: u64) -> String {
        // Slurm's job ids are 32-bit.
        let job_id = u32::try_from(job_id).unwrap_or(u32::MAX);
        gpuwarden_schema::lease::slurm_lease_id(&self.settings.cluster, job_id)
    }

    /// The job a lease id of [`SlurmDriver::lease_id`]'s form names.
    fn job_of_lease_id(&self, lease_id: &str) -> Option<u64> {
        lease_id
            .strip_prefix("slurm-")?
            .strip_prefix(self.settings.cluster.to_ascii_lowercase().as_str())?
            .strip_prefix('-')?
            .parse()
            .ok()
    }

    /// The full model name of GRES type `gpu_type` (`""` when untyped).
    pub fn model_of(&self, gpu_type: &str) -> String {
        match self.settings.models.get(gpu_type) {
            Some(model) => model.clone(),
            None if gpu_type.is_empty() => UNTYPED_MODEL.to_owned(),
            None => gpu_type.to_owned(),
        }
    }

    /// The GRES type of full model name `model`.
    fn type_of(&self, model: &str) -> Option<String> {
        self.settings
            .models
            .iter()
            .find(|(_, m)| *m == model)
            .map(|(t, _)| t.clone())
            .or_else(|| (model != UNTYPED_MODEL).then(|| model.to_owned()))
    }

    /// A Slurm command, with nothing of the enforcer's environment but `SLURM_CONF`.
    fn command(&self, tool: &str) -> std::process::Command {
        let mut command = std::process::Command::new(self.bin_dir.join(tool));
        command.env_clear().env("PATH", &self.bin_dir);
        if let Some(conf) = &self.settings.slurm_conf {
            command.env("SLURM_CONF", conf);
        }
        command
    }

    /// Runs `command` and returns its standard output; a failure carries its standard error.
    async fn run(&self, command: std::process::Command) -> Result<Vec<u8>, DriverError> {
        let shown = format!("{:?}", command.get_program());
        let mut command = tokio::process::Command::from(command);
        command
            .kill_on_drop(true)
            .stdin(std::process::Stdio::null());
        let output = tokio::time::timeout(COMMAND_TIMEOUT, command.output())
            .await
            .map_err(|_| {
                self.unavailable(format!("{shown} did not finish in {COMMAND_TIMEOUT:?}"))
            })?
            .map_err(|e| self.unavailable(format!("cannot run {shown}: {e}")))?;
        if !output.status.success() {
            return Err(DriverError::Rejected {
                substrate: self.name.clone(),
                message: format!(
                    "{shown} failed ({}): {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim()
                ),
            });
        }
        Ok(output.stdout)
    }

    fn unavailable(&self, message: String) -> DriverError {
        DriverError::Unavailable {
            substrate: self.name.clone(),
            message,
        }
    }

    /// The latest snapshot of the cluster, read again when older than `max_age`.
    pub async fn snapshot(&self, max_age: Duration) -> Result<Snapshot, DriverError> {
        if let Some(s) = self.fresh(max_age) {
            return Ok(s);
        }
        let _reading = self.reading.lock().await;
        // Someone else may have read it while this caller waited.
        if let Some(s) = self.fresh(max_age) {
            return Ok(s);
        }
        let at = Instant::now();
        self.stale.store(false, std::sync::atomic::Ordering::SeqCst);
        // --all: hidden partitions too; the enforcer's account must see every user's jobs
        // (SlurmUser, root or an operator, under PrivateData=jobs).
        let mut squeue = self.command("squeue");
        squeue.args(["--all", "--json"]);
        let queue: Queue = serde_json::from_slice(&self.run(squeue).await?).map_err(|e| {
            self.unavailable(format!("squeue --json answered what it cannot read: {e}"))
        })?;
        let mut sinfo = self.command("sinfo");
        sinfo.arg("--json");
        let nodes: Nodes = serde_json::from_slice(&self.run(sinfo).await?).map_err(|e| {
            self.unavailable(format!("sinfo --json answered what it cannot read: {e}"))
        })?;
        let mut scontrol = self.command("scontrol");
        scontrol.args(["show", "partition", "--oneliner"]);
        let partitions = String::from_utf8_lossy(&self.run(scontrol).await?).into_owned();
        let mut pooled: Vec<(String, u32)> = Vec::new();
        for (gpu_type, count) in jobs::gpus_of(&nodes) {
            let model = self.model_of(&gpu_type);
            let count = u32::try_from(count).unwrap_or(u32::MAX);
            match pooled.iter_mut().find(|(m, _)| *m == model) {
                Some((_, c)) => *c = c.saturating_add(count),
                None => pooled.push((model, count)),
            }
        }
        let snapshot = Snapshot {
            at,
            jobs: Arc::new(queue.jobs),
            inventory: Arc::new(Inventory {
                gpus: Vec::new(),
                pooled,
                queues: true,
            }),
            default_partition: default_partition(&partitions),
        };
        // Keep the inventory's Arc while it is the same, so that placement keeps its index.
        let snapshot = match self.kept() {
            Some(old) if old.inventory == snapshot.inventory => Snapshot {
                inventory: old.inventory,
                ..snapshot
            },
            _ => snapshot,
        };
        *self.lock() = Some(snapshot.clone());
        Ok(snapshot)
    }

    /// The latest snapshot, however old, without reading the cluster (what the submit hook's
    /// answers use: see [`Driver::inventory`]).
    pub fn kept(&self) -> Option<Snapshot> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Snapshot>> {
        self.snapshot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How often the cluster is read.
    pub fn poll(&self) -> Duration {
        self.settings.poll.unwrap_or(Duration::from_secs(2))
    }

    fn record_path(&self, lease_id: &str) -> PathBuf {
        self.state_dir.join(format!("{lease_id}.json"))
    }

    /// What the driver kept of lease `lease_id`'s job, if it submitted it.
    fn submitted(&self, lease_id: &str) -> Option<Submitted> {
        let bytes = std::fs::read(self.record_path(lease_id)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// The job of lease `lease_id`: the one the driver submitted, or the one its id names.
    fn job_of(&self, lease_id: &str) -> Option<u64> {
        match self.submitted(lease_id) {
            Some(record) => Some(record.job_id),
            None => self.job_of_lease_id(lease_id),
        }
    }

    /// Marks the snapshot stale: the next reader that may wait sees what a change just did.
    fn invalidate(&self) {
        self.stale.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The kept snapshot if it is not stale and at most `max_age` old.
    fn fresh(&self, max_age: Duration) -> Option<Snapshot> {
        if self.stale.load(std::sync::atomic::Ordering::SeqCst) {
            return None;
        }
        self.kept().filter(|s| s.at.elapsed() <= max_age)
    }

    /// The job (or an array's jobs) of `job_id` in `jobs`.
    fn jobs_of(jobs: &[Job], job_id: u64) -> impl Iterator<Item = &Job> {
        jobs.iter()
            .filter(move |j| j.job_id == job_id || j.array_job_id == job_id)
    }

    /// The script that runs `argv` as the job (each argument quoted for the shell).
    fn script(argv: Option<&Vec<String>>) -> String {
        let quoted: Vec<String> = match argv {
            Some(argv) => argv.iter().map(|a| shell_quote(a)).collect(),
            None => vec!["sleep".into(), "infinity".into()],
        };
        format!("#!/bin/sh\nexec {}\n", quoted.join(" "))
    }

    async fn submit(&self, lease: &LeaseSpec, account: &Account) -> Result<u64, DriverError> {
        let gres = match self.type_of(&lease.gpu_model) {
            Some(t) => format!("gpu:{t}:{}", lease.gpu_count),
            None => format!("gpu:{}", lease.gpu_count),
        };
        // Where the job starts and writes its output: `work_dir` (a directory every node sees),
        // else the account's home.
        let home = self
            .work_dir
            .clone()
            .unwrap_or_else(|| account.home().to_path_buf());
        let mut args = vec![
            "--parsable".to_owned(),
            format!("--job-name=gpuwarden-{}", lease.lease_id),
            format!("--gres={gres}"),
            format!("--chdir={}", home.display()),
            format!(
                "--output={}",
                home.join(format!("gpuwarden-{}.out", lease.lease_id))
                    .display()
            ),
        ];
        if let Some(limit) = lease.time_limit {
            args.push(format!("--time={}", limit.as_secs().div_ceil(60).max(1)));
        }
        let mut vars: Vec<(&str, String)> = vec![
            ("GPUWARDEN_LEASE_ID", lease.lease_id.clone()),
            ("GPUWARDEN_TEAM", lease.team.clone()),
            ("GPUWARDEN_USER", lease.user.clone()),
            ("GPUWARDEN_PROJECT", lease.project.clone()),
            ("GPUWARDEN_WORKLOAD", lease.workload.as_str().to_owned()),
        ];
        if let Some(conf) = &self.settings.slurm_conf {
            vars.push(("SLURM_CONF", conf.display().to_string()));
        }
        let sbatch = self.bin_dir.join("sbatch");
        let mut command = account.command(&sbatch.to_string_lossy(), &args, &vars, Path::new("/"));
        command.env("PATH", format!("{}:/usr/bin:/bin", self.bin_dir.display()));
        let script = Self::script(lease.command.as_ref());
        let mut command = tokio::process::Command::from(command);
        command
            .kill_on_drop(true)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = command
            .spawn()
            .map_err(|e| self.unavailable(format!("cannot run sbatch: {e}")))?;
        if let Some(mut stdin) = child.stdin.take() {
            use tokio::io::AsyncWriteExt as _;
            stdin.write_all(script.as_bytes()).await.map_err(|e| {
                self.unavailable(format!("cannot give sbatch the job's script: {e}"))
            })?;
        }
        let output = tokio::time::timeout(COMMAND_TIMEOUT, child.wait_with_output())
            .await
            .map_err(|_| self.unavailable("sbatch did not finish".into()))?
            .map_err(|e| self.unavailable(format!("sbatch: {e}")))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            return Err(DriverError::Rejected {
                substrate: self.name.clone(),
                message: format!(
                    "sbatch refused the job: {}",
                    String::from_utf8_lossy(&output.stderr).trim()
                ),
            });
        }
        // `--parsable` prints `<job id>` or `<job id>;<cluster>`.
        stdout
            .trim()
            .split(';')
            .next()
            .and_then(|id| id.parse().ok())
            .ok_or_else(|| self.unavailable(format!("sbatch printed no job id: {stdout:?}")))
    }
}

/// The partition marked `Default=YES` in `scontrol show partition --oneliner`.
fn default_partition(text: &str) -> Option<String> {
    text.lines()
        .find(|line| line.split_whitespace().any(|f| f == "Default=YES"))
        .and_then(|line| {
            line.split_whitespace()
                .find_map(|f| f.strip_prefix("PartitionName="))
                .map(str::to_owned)
        })
}

/// `text` as one shell word.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

#[async_trait::async_trait]
impl Driver for SlurmDriver {
    fn name(&self) -> &str {
        &self.name
    }

    async fn inventory(&self) -> Result<Arc<Inventory>, DriverError> {
        // Admission reads the snapshot the watcher keeps fresh, never Slurm: the submit hook asks
        // while slurmctld holds its locks, so a Slurm command here would wait for the hook that
        // waits for it. Only a driver that never read the cluster reads it now.
        match self.kept() {
            Some(snapshot) => Ok(snapshot.inventory),
            None => Ok(self.snapshot(Duration::ZERO).await?.inventory),
        }
    }

    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        check_lease_id(&self.name, &lease.lease_id)?;
        if self.submitted(&lease.lease_id).is_some() {
            return Ok(());
        }
        let account = {
            let accounts = self.accounts.clone();
            let user = lease.user.clone();
            tokio::task::spawn_blocking(move || accounts.resolve(&user))
                .await
                .map_err(|e| self.unavailable(format!("account lookup: {e}")))?
                .map_err(|refusal| DriverError::Rejected {
                    substrate: self.name.clone(),
                    message: refusal.message,
                })?
        };
        let job_id = match self.submit(lease, &account).await {
            Ok(job_id) => job_id,
            Err(e) => {
                // The hook may have claimed the lease for the job Slurm then refused.
                self.claimed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&lease.lease_id);
                return Err(e);
            }
        };
        self.invalidate();
        let record = serde_json::to_vec(&Submitted {
            job_id,
            gpus: lease.gpu_count,
        })
        .expect("plain data");
        write_atomically(&self.record_path(&lease.lease_id), &record).map_err(|e| {
            self.unavailable(format!(
                "job {job_id} was submitted but its record could not be kept: {e}"
            ))
        })?;
        tracing::info!(substrate = %self.name, lease_id = %lease.lease_id, job_id, "submitted the lease's Slurm job");
        Ok(())
    }

    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        check_lease_id(&self.name, &lease.lease_id)?;
        let held = match self.submitted(&lease.lease_id) {
            Some(record) => Some(u64::from(record.gpus)),
            None => match self.job_of_lease_id(&lease.lease_id) {
                Some(job) => {
                    let snapshot = self.snapshot(self.poll()).await?;
                    Self::jobs_of(&snapshot.jobs, job)
                        .map(|j| j.gpus().gpus)
                        .max()
                }
                None => None,
            },
        };
        if held == Some(u64::from(lease.gpu_count)) {
            return Ok(());
        }
        Err(DriverError::Rejected {
            substrate: self.name.clone(),
            message: format!(
                "lease {} is a Slurm job, and Slurm cannot change a running job's GPUs; release \
                 it and ask again (a pending job's GPUs change with `scontrol update`)",
                lease.lease_id
            ),
        })
    }

    async fn reclaim(&self, lease_id: &str, reason: ReleaseReason) -> Result<(), DriverError> {
        check_lease_id(&self.name, lease_id)?;
        let Some(job_id) = self.job_of(lease_id) else {
            return Ok(());
        };
        let mut comment = self.command("scontrol");
        comment.args([
            "update".to_owned(),
            format!("JobId={job_id}"),
            format!("Comment=gpuwarden: reclaimed ({})", reason.as_str()),
        ]);
        // Best effort: the job may have ended already.
        if let Err(e) = self.run(comment).await {
            tracing::debug!(substrate = %self.name, job_id, error = %e, "could not comment the job before cancelling it");
        }
        let mut scancel = self.command("scancel");
        scancel.arg(job_id.to_string());
        match self.run(scancel).await {
            Ok(_) => {}
            // Ended already, or forgotten by the controller: reclaimed all the same.
            Err(DriverError::Rejected { message, .. })
                if message.contains("already completing or completed")
                    || message.contains("Invalid job id") =>
            {
                tracing::debug!(substrate = %self.name, job_id, %message, "job already ended");
            }
            Err(e) => return Err(e),
        }
        let _ = std::fs::remove_file(self.record_path(lease_id));
        self.invalidate();
        self.claimed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(lease_id);
        tracing::info!(substrate = %self.name, lease_id, job_id, reason = reason.as_str(), "cancelled the lease's Slurm job");
        Ok(())
    }

    async fn status(&self, lease_id: &str) -> Result<LeaseStatus, DriverError> {
        check_lease_id(&self.name, lease_id)?;
        let Some(job_id) = self.job_of(lease_id) else {
            return Ok(LeaseStatus::Gone);
        };
        let snapshot = self.snapshot(self.poll()).await?;
        let phases: Vec<Phase> = Self::jobs_of(&snapshot.jobs, job_id)
            .map(Job::phase)
            .collect();
        Ok(
            if phases
                .iter()
                .any(|p| matches!(p, Phase::Running | Phase::Pending))
            {
                LeaseStatus::Running
            } else if phases.is_empty() {
                LeaseStatus::Gone
            } else {
                LeaseStatus::Exited(None)
            },
        )
    }

    async fn refusal(&self, user: &str) -> Option<Refusal> {
        let accounts = self.accounts.clone();
        let user = user.to_owned();
        tokio::task::spawn_blocking(move || accounts.resolve(&user).err())
            .await
            .ok()
            .flatten()
    }

    fn resizes(&self) -> bool {
        false
    }

    fn slurm(&self) -> Option<&SlurmDriver> {
        Some(self)
    }
}

/// The jobs of `jobs` grouped by the job id their lease is named after.
pub fn by_lease(jobs: &[Job]) -> BTreeMap<u64, Vec<&Job>> {
    let mut out: BTreeMap<u64, Vec<&Job>> = BTreeMap::new();
    for job in jobs {
        out.entry(job.lease_job_id()).or_default().push(job);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_partition_is_read_from_scontrol() {
        let text = "PartitionName=cpu AllowGroups=ALL Default=NO Nodes=n1\n\
                    PartitionName=gpu AllowGroups=ALL Default=YES Nodes=n1\n";
        assert_eq!(default_partition(text), Some("gpu".into()));
        assert_eq!(default_partition("PartitionName=a Default=NO\n"), None);
    }

    #[test]
    fn commands_are_quoted_for_the_shell() {
        let argv = vec!["python".to_owned(), "it's; rm -rf /".to_owned()];
        assert_eq!(
            SlurmDriver::script(Some(&argv)),
            "#!/bin/sh\nexec 'python' 'it'\\''s; rm -rf /'\n"
        );
        assert_eq!(
            SlurmDriver::script(None),
            "#!/bin/sh\nexec sleep infinity\n"
        );
    }
}
