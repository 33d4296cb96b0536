//! The `local` driver: one bare-metal host whose GPUs the enforcer hands out by running each
//! lease's command as a child process of the enforcer.
//!
//! Inventory: `gpu_uuids` in order, with indexes `0..n` (what `CUDA_VISIBLE_DEVICES` names),
//! model `gpu_model`, host `host` or this machine's host name.
//!
//! Provision runs `lease.command` (argv, no shell) with `CUDA_VISIBLE_DEVICES` set to the
//! comma-separated indexes of the lease's GPUs and `GPUWARDEN_LEASE_ID` to its id, in a process
//! group of its own (so reclaim reaches whatever it forks), stdin from `/dev/null`, stdout and
//! stderr appended to `<state_dir>/<lease_id>.log`. A lease without a command just holds its
//! GPUs until it is reclaimed. Provisioning a lease whose process is still running is a no-op;
//! provisioning one that has ended starts it again. A lease may only name configured GPUs, and
//! none held by another running lease.
//!
//! Each lease's pid, and the process's start time from `/proc/<pid>/stat` (so a recycled pid is
//! not mistaken for it), go to `<state_dir>/<lease_id>.json`, written atomically. A new driver over
//! the same state dir (an enforcer restart) reads those files back: a lease whose process is
//! still the same live process is `Running` and can be reclaimed by pid; one whose process is
//! gone (or is a zombie) is `Gone`. Only the instance that started a process can reap it and
//! report `Exited(code)`.
//!
//! Reclaim sends SIGTERM to the lease's process group, waits up to `grace_period` (default 10 s)
//! for the group to empty, then sends SIGKILL; it deletes the lease's record (the log stays).
//! Reclaiming a lease that is unknown or already ended succeeds.
//!
//! Resize: a running process cannot change its `CUDA_VISIBLE_DEVICES`, and recording new GPUs
//! it cannot see would let the enforcer hand the GPUs it still uses to someone else. So resizing
//! a lease whose process is running is [`DriverError::Rejected`] (release it and admit a new
//! lease instead), unless the GPU set is unchanged (a no-op); a lease without a command, which
//! only holds GPUs, is resized by recording the new set.
//!
//! Linux only: liveness and start times come from `/proc`.

use std::collections::{BTreeSet, HashMap};
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use gpuwarden_schema::config::SubstrateConfig;
use gpuwarden_schema::ReleaseReason;
use rustix::io::Errno;
use rustix::process::{Pid, Signal};
use serde::{Deserialize, Serialize};

use super::account::{Account, Accounts};
use super::{
    check_lease_id, config_error, state_dir, write_atomically, Driver, DriverContext, DriverError,
    Gpu, Inventory, LeaseSpec, LeaseStatus, Refusal,
};

/// Time between SIGTERM and SIGKILL when `grace_period` is not set.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(10);

/// How often reclaim looks whether the process group has gone.
const POLL: Duration = Duration::from_millis(20);

/// How long reclaim waits for the kernel to finish a SIGKILLed process.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// A bare-metal host's driver.
#[derive(Debug)]
pub struct LocalDriver {
    name: String,
    host: String,
    model: String,
    uuids: Vec<String>,
    grace: Duration,
    dir: PathBuf,
    accounts: Accounts,
    /// Where each lease's working directory is made.
    work_root: PathBuf,
    leases: Mutex<HashMap<String, Entry>>,
}

#[derive(Debug)]
enum Entry {
    /// Holds its GPUs: its process was started here (`child`) or re-adopted from its record.
    Live {
        record: Record,
        child: Option<Child>,
    },
    /// Its process was reaped by this instance, with this exit code (none if killed by a signal).
    Exited(Option<i32>),
}

/// The version of a lease record's format this build reads and writes; a record without one
/// is version 1, as every record before the field was. A newer one makes the driver refuse to
/// start, naming both versions, rather than lose track of the lease's process.
const RECORD_VERSION: u64 = 1;

/// What `<state_dir>/<lease_id>.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    /// The format's version ([`RECORD_VERSION`]).
    #[serde(default = "gpuwarden_schema::format::one")]
    version: u64,
    lease_id: String,
    gpu_uuids: Vec<String>,
    /// The lease's process, absent for a lease without a command.
    process: Option<Process>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Process {
    pid: i32,
    /// Field 22 of `/proc/<pid>/stat` (clock ticks since boot): a recycled pid has another.
    start_time: u64,
}

impl LocalDriver {
    /// Builds the driver from a `driver = "local"` entry and re-adopts the leases whose records
    /// a previous instance left in `context.state_dir`.
    pub fn new(config: &SubstrateConfig, context: &DriverContext) -> Result<Self, DriverError> {
        let model = match &config.gpu_model {
            Some(m) if !m.trim().is_empty() => m.clone(),
            _ => {
                return Err(config_error(
                    config,
                    "gpu_model",
                    "the local driver needs the GPUs' full NVML model name",
                ))
            }
        };
        if config.gpu_uuids.is_empty() {
            return Err(config_error(
                config,
                "gpu_uuids",
                "the local driver needs the UUIDs of the GPUs leases may hold",
            ));
        }
        let mut seen = BTreeSet::new();
        if let Some(dup) = config.gpu_uuids.iter().find(|u| !seen.insert(*u)) {
            return Err(config_error(
                config,
                "gpu_uuids",
                format!("{dup} is listed twice"),
            ));
        }
        let host = match &config.host {
            Some(h) if h.trim().is_empty() => {
                return Err(config_error(config, "host", "must not be empty"))
            }
            Some(h) => h.clone(),
            None => rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned(),
        };
        let dir = state_dir(config, context)?;
        let accounts = Accounts::new(config).map_err(|message| DriverError::Unavailable {
            substrate: config.name.clone(),
            message,
        })?;
        let work_root = config.work_dir.clone().unwrap_or_else(|| dir.join("work"));
        let leases = read_records(&config.name, &dir)?
            .into_iter()
            .map(|record| {
                (
                    record.lease_id.clone(),
                    Entry::Live {
                        record,
                        child: None,
                    },
                )
            })
            .collect();
        Ok(Self {
            name: config.name.clone(),
            host,
            model,
            uuids: config.gpu_uuids.clone(),
            grace: config.grace_period.unwrap_or(DEFAULT_GRACE_PERIOD),
            dir,
            accounts,
            work_root,
            leases: Mutex::new(leases),
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        self.leases.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn rejected(&self, message: String) -> DriverError {
        DriverError::Rejected {
            substrate: self.name.clone(),
            message,
        }
    }

    fn unavailable(&self, message: String) -> DriverError {
        DriverError::Unavailable {
            substrate: self.name.clone(),
            message,
        }
    }

    fn record_path(&self, lease_id: &str) -> PathBuf {
        self.dir.join(format!("{lease_id}.json"))
    }

    /// The lease's GPUs as `CUDA_VISIBLE_DEVICES` indexes, after checking that they are
    /// configured here, named once, and not held by another running lease.
    fn check_gpus(
        &self,
        leases: &mut HashMap<String, Entry>,
        lease: &LeaseSpec,
    ) -> Result<Vec<usize>, DriverError> {
        if lease.gpu_uuids.is_empty() {
            return Err(self.rejected(format!(
                "lease {} names no GPUs; the local driver runs leases on GPUs named by UUID",
                lease.lease_id
            )));
        }
        let mut indexes = Vec::with_capacity(lease.gpu_uuids.len());
        for uuid in &lease.gpu_uuids {
            let Some(index) = self.uuids.iter().position(|u| u == uuid) else {
                return Err(self.rejected(format!(
                    "lease {}: GPU {uuid} is not one of this host's configured GPUs",
                    lease.lease_id
                )));
            };
            if indexes.contains(&index) {
                return Err(
                    self.rejected(format!("lease {} names GPU {uuid} twice", lease.lease_id))
                );
            }
            indexes.push(index);
        }
        for (other, entry) in leases.iter_mut() {
            if other == &lease.lease_id || current_status(entry) != LeaseStatus::Running {
                continue;
            }
            if let Entry::Live { record, .. } = entry {
                if let Some(uuid) = lease
                    .gpu_uuids
                    .iter()
                    .find(|u| record.gpu_uuids.contains(u))
                {
                    return Err(self.rejected(format!(
                        "lease {}: GPU {uuid} is held by running lease {other}",
                        lease.lease_id
                    )));
                }
            }
        }
        Ok(indexes)
    }

    fn write_record(&self, record: &Record) -> Result<(), DriverError> {
        let path = self.record_path(&record.lease_id);
        let bytes = serde_json::to_vec_pretty(record)
            .map_err(|e| self.unavailable(format!("cannot encode the lease record: {e}")))?;
        write_atomically(&path, &bytes)
            .map_err(|e| self.unavailable(format!("cannot write {}: {e}", path.display())))
    }

    /// The account `user`'s commands run as, looked up off the async threads.
    async fn account(&self, user: &str) -> Result<Account, Refusal> {
        let (accounts, user) = (self.accounts.clone(), user.to_owned());
        match tokio::task::spawn_blocking(move || accounts.resolve(&user)).await {
            Ok(resolved) => resolved,
            Err(e) => Err(Refusal {
                code: super::RefusalCode::AccountUnmapped,
                message: format!("the account lookup failed: {e}"),
            }),
        }
    }

    fn spawn(
        &self,
        lease: &LeaseSpec,
        account: &Account,
        argv: &[String],
        indexes: &[usize],
    ) -> Result<(Child, Process), DriverError> {
        let Some((program, args)) = argv.split_first() else {
            return Err(self.rejected(format!("lease {}: the command is empty", lease.lease_id)));
        };
        let work_dir = account
            .work_dir(&self.work_root, &lease.lease_id)
            .map_err(|e| self.unavailable(format!("lease {}: {e}", lease.lease_id)))?;
        let log_path = self.dir.join(format!("{}.log", lease.lease_id));
        // Only the enforcer reads a lease's output (0600): it may hold the user's secrets.
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)
            .map_err(|e| self.unavailable(format!("cannot open {}: {e}", log_path.display())))?;
        let log_err = log
            .try_clone()
            .map_err(|e| self.unavailable(format!("cannot open {}: {e}", log_path.display())))?;
        let visible = indexes
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let vars = [
            ("CUDA_VISIBLE_DEVICES", visible),
            ("GPUWARDEN_LEASE_ID", lease.lease_id.clone()),
            ("GPUWARDEN_TEAM", lease.team.clone()),
            ("GPUWARDEN_USER", lease.user.clone()),
            ("GPUWARDEN_PROJECT", lease.project.clone()),
            ("GPUWARDEN_WORKLOAD", lease.workload.as_str().to_owned()),
        ];
        let child = account
            .command(program, args, &vars, &work_dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|e| {
                self.rejected(format!(
                    "lease {}: cannot run {program:?}: {e}",
                    lease.lease_id
                ))
            })?;
        let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
        // The process exists until we reap it, so its stat file is there to read.
        let start_time = proc_stat(pid).map(|s| s.start_time).unwrap_or(0);
        Ok((child, Process { pid, start_time }))
    }

    /// SIGTERM to the group, up to the grace period for it to empty, then SIGKILL. Returns the
    /// exit code if this instance reaped the leader.
    async fn terminate(
        &self,
        lease_id: &str,
        process: Process,
        mut child: Option<Child>,
    ) -> Result<Option<i32>, DriverError> {
        let mut code = None;
        let mut reaped = false;
        // A re-adopted pid is only signalled while it is provably the same process.
        if child.is_none() && !is_alive(process) {
            return Ok(None);
        }
        let Some(pgid) = Pid::from_raw(process.pid) else {
            return Ok(None);
        };
        self.signal(pgid, Signal::TERM)?;
        let deadline = Instant::now() + self.grace;
        loop {
            let leader_done = leader_done(child.as_mut(), process, &mut reaped, &mut code);
            if leader_done && !group_exists(pgid) {
                return Ok(code);
            }
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(POLL).await;
        }
        tracing::info!(
            substrate = %self.name,
            lease_id = %lease_id,
            grace_period = ?self.grace,
            "lease's processes outlived the grace period; sending SIGKILL"
        );
        self.signal(pgid, Signal::KILL)?;
        let deadline = Instant::now() + KILL_WAIT;
        while Instant::now() < deadline {
            let leader_done = leader_done(child.as_mut(), process, &mut reaped, &mut code);
            if leader_done {
                return Ok(code);
            }
            tokio::time::sleep(POLL).await;
        }
        Err(self.unavailable(format!(
            "lease {lease_id}: process {} survived SIGKILL for {KILL_WAIT:?}",
            process.pid
        )))
    }

    fn signal(&self, pgid: Pid, signal: Signal) -> Result<(), DriverError> {
        match rustix::process::kill_process_group(pgid, signal) {
            Ok(()) | Err(Errno::SRCH) => Ok(()),
            Err(e) => Err(self.unavailable(format!(
                "cannot signal process group {}: {e}",
                pgid.as_raw_nonzero()
            ))),
        }
    }
}

#[async_trait::async_trait]
impl Driver for LocalDriver {
    fn name(&self) -> &str {
        &self.name
    }

    async fn inventory(&self) -> Result<std::sync::Arc<Inventory>, DriverError> {
        let gpus = self
            .uuids
            .iter()
            .zip(0u32..)
            .map(|(uuid, index)| Gpu {
                uuid: uuid.clone(),
                host: self.host.clone(),
                index,
                model: self.model.clone(),
            })
            .collect();
        Ok(std::sync::Arc::new(Inventory {
            gpus,
            pooled: Vec::new(),
            queues: false,
        }))
    }

    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        check_lease_id(&self.name, &lease.lease_id)?;
        let account =
            match &lease.command {
                Some(_) => Some(self.account(&lease.user).await.map_err(|r| {
                    self.rejected(format!("lease {}: {}", lease.lease_id, r.message))
                })?),
                None => None,
            };
        let mut leases = self.lock();
        if let Some(entry) = leases.get_mut(&lease.lease_id) {
            if current_status(entry) == LeaseStatus::Running {
                return Ok(());
            }
        }
        let indexes = self.check_gpus(&mut leases, lease)?;
        let (child, process) = match (&lease.command, &account) {
            (Some(argv), Some(account)) => {
                let (child, process) = self.spawn(lease, account, argv, &indexes)?;
                (Some(child), Some(process))
            }
            _ => (None, None),
        };
        let record = Record {
            version: RECORD_VERSION,
            lease_id: lease.lease_id.clone(),
            gpu_uuids: lease.gpu_uuids.clone(),
            process,
        };
        if let Err(e) = self.write_record(&record) {
            // Without its record the process could not be re-adopted: do not leave it running.
            if let (Some(mut child), Some(p)) = (child, process) {
                if let Some(pgid) = Pid::from_raw(p.pid) {
                    let _ = rustix::process::kill_process_group(pgid, Signal::KILL);
                }
                let _ = child.wait();
            }
            return Err(e);
        }
        tracing::info!(
            substrate = %self.name,
            lease_id = %lease.lease_id,
            pid = ?process.map(|p| p.pid),
            account = ?account.as_ref().map(|a| &a.name),
            uid = ?account.as_ref().map(|a| a.uid),
            "lease provisioned"
        );
        leases.insert(lease.lease_id.clone(), Entry::Live { record, child });
        Ok(())
    }

    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        check_lease_id(&self.name, &lease.lease_id)?;
        let mut leases = self.lock();
        let running = leases
            .get_mut(&lease.lease_id)
            .is_some_and(|e| current_status(e) == LeaseStatus::Running);
        if !running {
            return Err(self.rejected(format!(
                "lease {} is not running here, so it cannot be resized",
                lease.lease_id
            )));
        }
        self.check_gpus(&mut leases, lease)?;
        let Some(Entry::Live { record, .. }) = leases.get_mut(&lease.lease_id) else {
            return Err(self.rejected(format!("lease {} is not running here", lease.lease_id)));
        };
        let old: BTreeSet<&String> = record.gpu_uuids.iter().collect();
        let new: BTreeSet<&String> = lease.gpu_uuids.iter().collect();
        if old == new {
            return Ok(());
        }
        if record.process.is_some() {
            return Err(self.rejected(format!(
                "lease {} runs a process, which cannot change its CUDA_VISIBLE_DEVICES; \
                 release it and admit a new lease on the new GPUs",
                lease.lease_id
            )));
        }
        let mut next = record.clone();
        next.gpu_uuids.clone_from(&lease.gpu_uuids);
        self.write_record(&next)?;
        *record = next;
        Ok(())
    }

    async fn reclaim(&self, lease_id: &str, reason: ReleaseReason) -> Result<(), DriverError> {
        if check_lease_id(&self.name, lease_id).is_err() {
            // No record can exist under such a name: it is already gone.
            return Ok(());
        }
        // Taken out while signals and waits run, so no lock is held across an await.
        let entry = self.lock().remove(lease_id);
        let outcome = match entry {
            None => Ok(None),
            Some(Entry::Exited(code)) => Ok(code),
            Some(Entry::Live { record, child }) => match record.process {
                None => Ok(None),
                Some(process) => self.terminate(lease_id, process, child).await,
            },
        };
        let code = match outcome {
            Ok(code) => code,
            Err(e) => {
                // Keep the record: the process may still be there, and a retry must find it.
                return Err(e);
            }
        };
        let path = self.record_path(lease_id);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(self.unavailable(format!("cannot remove {}: {e}", path.display())))
            }
        }
        tracing::info!(
            substrate = %self.name,
            lease_id = %lease_id,
            reason = reason.as_str(),
            exit_code = ?code,
            "lease reclaimed"
        );
        self.lock().insert(lease_id.to_owned(), Entry::Exited(code));
        Ok(())
    }

    async fn status(&self, lease_id: &str) -> Result<LeaseStatus, DriverError> {
        Ok(match self.lock().get_mut(lease_id) {
            Some(entry) => current_status(entry),
            None => LeaseStatus::Gone,
        })
    }

    async fn refusal(&self, user: &str) -> Option<Refusal> {
        self.account(user).await.err()
    }
}

/// The entry's status, reaping its process (and remembering the exit code) if it has ended.
fn current_status(entry: &mut Entry) -> LeaseStatus {
    match entry {
        Entry::Exited(code) => LeaseStatus::Exited(*code),
        Entry::Live {
            record: Record { process: None, .. },
            ..
        } => LeaseStatus::Running,
        Entry::Live {
            child: Some(child), ..
        } => match child.try_wait() {
            Ok(Some(status)) => {
                let code = status.code();
                *entry = Entry::Exited(code);
                LeaseStatus::Exited(code)
            }
            Ok(None) => LeaseStatus::Running,
            Err(_) => LeaseStatus::Gone,
        },
        Entry::Live {
            record:
                Record {
                    process: Some(process),
                    ..
                },
            child: None,
        } => {
            if is_alive(*process) {
                LeaseStatus::Running
            } else {
                LeaseStatus::Gone
            }
        }
    }
}

/// Reads the records a previous instance left; one that cannot be parsed is logged and skipped,
/// since refusing to start over it would stop every other lease from being re-adopted.
fn read_records(substrate: &str, dir: &Path) -> Result<Vec<Record>, DriverError> {
    let entries = std::fs::read_dir(dir).map_err(|e| DriverError::Unavailable {
        substrate: substrate.to_owned(),
        message: format!("cannot list {}: {e}", dir.display()),
    })?;
    let mut records = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let bytes = std::fs::read(&path);
        if let Ok(bytes) = &bytes {
            gpuwarden_schema::format::check_json(
                bytes,
                || format!("the lease record {}", path.display()),
                "record",
                RECORD_VERSION,
            )
            .map_err(|e| DriverError::Unavailable {
                substrate: substrate.to_owned(),
                message: e.to_string(),
            })?;
        }
        let parsed = bytes
            .map_err(|e| e.to_string())
            .and_then(|bytes| serde_json::from_slice::<Record>(&bytes).map_err(|e| e.to_string()));
        match parsed {
            Ok(record) if check_lease_id(substrate, &record.lease_id).is_ok() => {
                records.push(record)
            }
            Ok(record) => tracing::warn!(
                substrate,
                path = %path.display(),
                lease_id = %record.lease_id,
                "ignoring a lease record with an invalid lease id"
            ),
            Err(error) => tracing::warn!(
                substrate,
                path = %path.display(),
                %error,
                "ignoring an unreadable lease record"
            ),
        }
    }
    Ok(records)
}

struct Stat {
    state: char,
    start_time: u64,
}

/// Parses `/proc/<pid>/stat`; the command name in parentheses may itself hold spaces or `)`.
fn proc_stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // `state` is field 3; `starttime` is field 22.
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start_time })
}

/// Whether a lease's leader process has finished: reaped by this instance (its exit code goes
/// to `code`), or, for a re-adopted one, no longer alive.
fn leader_done(
    child: Option<&mut Child>,
    process: Process,
    reaped: &mut bool,
    code: &mut Option<i32>,
) -> bool {
    match child {
        Some(c) => {
            if !*reaped {
                if let Ok(Some(status)) = c.try_wait() {
                    *code = status.code();
                    *reaped = true;
                }
            }
            *reaped
        }
        None => !is_alive(process),
    }
}

/// Whether `process` is still that same process and has not finished (a zombie has).
fn is_alive(process: Process) -> bool {
    match proc_stat(process.pid) {
        Some(stat) => {
            stat.start_time == process.start_time && !matches!(stat.state, 'Z' | 'X' | 'x')
        }
        None => false,
    }
}

/// Whether any process is left in the group (a zombie counts: it is reaped soon).
fn group_exists(pgid: Pid) -> bool {
    rustix::process::test_kill_process_group(pgid).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_awkward_command_names() {
        let line = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 \
                    1000 100 18446744073709551615";
        let stat = parse_stat(line).expect("parses");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.start_time, 987_654);
    }

    #[test]
    fn this_process_is_alive_and_a_wrong_start_time_is_not() {
        let pid = i32::try_from(std::process::id()).expect("pid fits");
        let start_time = proc_stat(pid).expect("own stat").start_time;
        assert!(is_alive(Process { pid, start_time }));
        assert!(!is_alive(Process {
            pid,
            start_time: start_time + 1
        }));
    }
}
