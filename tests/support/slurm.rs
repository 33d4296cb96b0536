//! A private, real Slurm cluster for one test, from the Debian packages (slurmctld, slurmd,
//! slurm-client, munge): one controller and one node with fake GPUs, every file of it under the
//! test's directory, on free ports of 127.0.0.1, stopped with its jobs when dropped.
//!
//! Several clusters run at once on one machine (nextest runs test binaries in parallel): each has
//! its own ports, state, spool, pid and log files, and its own range of job ids (`FirstJobId`), so
//! that logs and leases never mix. Jobs are tracked with proctrack/linuxproc and no task
//! plugin, which keeps them out of the cgroup tree the clusters would otherwise share; a job
//! still sees `CUDA_VISIBLE_DEVICES` and `SLURM_JOB_GPUS` (the GRES plugin sets them), but
//! nothing stops it from opening another job's device. munged is shared: started once (by its
//! pid file) and left running.
//!
//! The GPUs are character devices made with mknod under the test's directory (major 195, as
//! NVIDIA's): slurmd drops a GPU without `File=`, and nothing here opens them. Needs root.

use std::fmt::Write as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

use super::eventually;

/// What differs between the clusters tests start.
#[derive(Debug, Clone)]
pub struct SlurmOptions<'a> {
    /// Slurm's `ClusterName`, part of every lease id (`slurm-<cluster>-<job id>`).
    pub cluster_name: &'a str,
    /// How many fake GPUs the node has.
    pub gpus: u32,
    /// Their GRES type, as in `--gres=gpu:<type>:N`.
    pub gpu_type: &'a str,
    /// gpuwarden's hook: the job_submit.lua to install and the gpuwarden.conf it reads (given to
    /// slurmctld as `GPUWARDEN_HOOK_CONF`). None: no job_submit plugin.
    pub hook: Option<(&'a Path, &'a Path)>,
    /// Slurm's `MinJobAge`: seconds a finished job stays visible to squeue and scontrol.
    pub min_job_age: u32,
    /// Lines appended to slurm.conf as they are.
    pub extra_conf: &'a str,
}

impl Default for SlurmOptions<'_> {
    fn default() -> Self {
        Self {
            cluster_name: "test",
            gpus: 8,
            gpu_type: "h100",
            hook: None,
            min_job_age: 5,
            extra_conf: "",
        }
    }
}

/// A running slurmctld and slurmd, configured under one directory.
pub struct SlurmCluster {
    /// Its `ClusterName`, as Slurm keeps it (lower case).
    pub name: String,
    dir: PathBuf,
    conf: PathBuf,
    /// The only node's name.
    pub node: String,
    /// The first job id this cluster gives.
    pub first_job_id: u32,
    /// Where jobs run from: sbatch's working directory, writable by every account.
    pub jobs_dir: PathBuf,
    /// The fake GPU devices' directory.
    pub dev_dir: PathBuf,
    controller: Option<Child>,
    slurmd: Option<Child>,
}

/// The Debian packages the cluster needs, for a failure message.
pub const SLURM_PACKAGES: &str =
    "slurm-wlm slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge lua5.1 lua-socket";

/// Whether clusters can start here: root, which mknod and slurmd need. Tests return early,
/// saying so, when not; a missing package is a failure instead (see [`SLURM_PACKAGES`]).
pub fn can_run_slurm() -> bool {
    super::accounts::running_as_root()
}

impl SlurmCluster {
    /// Writes the configuration under `dir` and starts the daemons; returns once the node is
    /// idle and takes jobs.
    pub fn start(dir: &Path, options: &SlurmOptions<'_>) -> Self {
        assert!(can_run_slurm(), "a Slurm cluster needs root");
        for program in ["slurmctld", "slurmd", "sbatch", "munged"] {
            let found = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
                .iter()
                .any(|d| Path::new(d).join(program).exists());
            assert!(
                found,
                "{program} is not installed: apt-get install {SLURM_PACKAGES}"
            );
        }
        ensure_munged();

        // The directory is usually in a tempdir (0700): jobs run as other accounts must reach
        // jobs_dir and the devices through it.
        std::fs::create_dir_all(dir).unwrap();
        set_mode(dir, 0o755);
        for ancestor in dir.ancestors().skip(1) {
            allow_traversal(ancestor);
        }
        let state = dir.join("state");
        let spool = dir.join("spool");
        let jobs_dir = dir.join("jobs");
        let dev_dir = dir.join("dev");
        for d in [&state, &spool, &jobs_dir, &dev_dir] {
            std::fs::create_dir_all(d).unwrap();
        }
        set_mode(&jobs_dir, 0o1777);
        for i in 0..options.gpus {
            let path = dev_dir.join(format!("nvidia{i}"));
            if !path.exists() {
                rustix::fs::mknodat(
                    rustix::fs::CWD,
                    &path,
                    rustix::fs::FileType::CharacterDevice,
                    rustix::fs::Mode::from_raw_mode(0o666),
                    rustix::fs::makedev(195, i),
                )
                .unwrap_or_else(|e| panic!("mknod {}: {e}", path.display()));
            }
        }

        let [ctld_port, slurmd_port] = free_ports();
        // Job ids from a range of the cluster's own (ids stay below 67,108,863, Slurm's limit).
        let first_job_id = u32::from(ctld_port) * 1000 + 1;
        let host = uname_short();
        let node = format!("n{ctld_port}");
        let d = dir.display();
        let mut conf = format!(
            "# A private test cluster (tests/support/slurm.rs).
ClusterName={cluster}
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
FirstJobId={first_job_id}
MinJobAge={min_job_age}
KillWait=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
GresTypes=gpu
NodeName={node} NodeAddr=127.0.0.1 CPUs=16 RealMemory=16000 Gres=gpu:{gpu_type}:{gpus} State=UNKNOWN
PartitionName=gpu Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
",
            cluster = options.cluster_name,
            min_job_age = options.min_job_age,
            gpu_type = options.gpu_type,
            gpus = options.gpus,
        );
        if options.hook.is_some() {
            conf.push_str("JobSubmitPlugins=lua\n");
        }
        writeln!(conf, "{}", options.extra_conf).unwrap();
        let conf_path = dir.join("slurm.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let gres = if options.gpus == 0 {
            String::new()
        } else {
            format!(
                "NodeName={node} Name=gpu Type={} File={}/nvidia[0-{}]\n",
                options.gpu_type,
                dev_dir.display(),
                options.gpus - 1
            )
        };
        std::fs::write(dir.join("gres.conf"), gres).unwrap();
        // slurmd loads the cgroup plugin even with linuxproc; "disabled" is not a plugin in 22.05.
        std::fs::write(dir.join("cgroup.conf"), "CgroupPlugin=cgroup/v1\n").unwrap();

        let mut controller = Command::new("/usr/sbin/slurmctld");
        // -D: in the foreground, as our child; -i: an empty StateSaveLocation is expected.
        controller
            .args(["-D", "-i"])
            .env("SLURM_CONF", &conf_path)
            .stdin(Stdio::null())
            .stdout(log_file(&dir.join("slurmctld.out")))
            .stderr(log_file(&dir.join("slurmctld.out")));
        if let Some((lua, hook_conf)) = options.hook {
            // Slurm loads job_submit.lua from slurm.conf's directory.
            std::fs::copy(lua, dir.join("job_submit.lua")).unwrap();
            controller.env("GPUWARDEN_HOOK_CONF", hook_conf);
        }
        let controller = controller.spawn().expect("starts slurmctld");
        let mut cluster = Self {
            name: options.cluster_name.to_ascii_lowercase(),
            dir: dir.to_path_buf(),
            conf: conf_path,
            node,
            first_job_id,
            jobs_dir,
            dev_dir,
            controller: Some(controller),
            slurmd: None,
        };
        eventually("slurmctld answering", Duration::from_secs(30), || {
            cluster.check_alive()?;
            let out = cluster.command("scontrol").arg("ping").output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            if text.contains("is UP") {
                Ok(())
            } else {
                Err(format!("{text}{}", String::from_utf8_lossy(&out.stderr)))
            }
        });
        cluster.slurmd = Some(
            Command::new("/usr/sbin/slurmd")
                .args(["-D", "-N", &cluster.node])
                .env("SLURM_CONF", &cluster.conf)
                .stdin(Stdio::null())
                .stdout(log_file(&dir.join("slurmd.out")))
                .stderr(log_file(&dir.join("slurmd.out")))
                .spawn()
                .expect("starts slurmd"),
        );
        eventually("the node idle", Duration::from_secs(60), || {
            cluster.check_alive()?;
            let out = cluster
                .command("sinfo")
                .args(["-h", "-o", "%T"])
                .output()
                .unwrap();
            let state = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if state == "idle" {
                Ok(())
            } else {
                Err(format!("node state {state:?}"))
            }
        });
        cluster
    }

    /// Fails when a daemon has exited, with the tail of its output.
    fn check_alive(&mut self) -> Result<(), String> {
        if let Some(status) = self.controller.as_mut().and_then(|c| c.try_wait().unwrap()) {
            return Err(format!(
                "slurmctld exited ({status}):\n{}\n{}",
                read_tail(&self.dir.join("slurmctld.out")),
                read_tail(&self.dir.join("slurmctld.log"))
            ));
        }
        if let Some(slurmd) = &mut self.slurmd {
            if let Some(status) = slurmd.try_wait().unwrap() {
                return Err(format!(
                    "slurmd exited ({status}):\n{}\n{}",
                    read_tail(&self.dir.join("slurmd.out")),
                    read_tail(&self.dir.join("slurmd.log"))
                ));
            }
        }
        Ok(())
    }

    /// The environment a Slurm client command needs to talk to this cluster.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![("SLURM_CONF".into(), self.conf.display().to_string())]
    }

    /// slurm.conf's path.
    pub fn conf_path(&self) -> &Path {
        &self.conf
    }

    /// This cluster's settings in a gpuwarden `[[substrates]]` entry of driver `slurm`, as TOML
    /// (the support module's `Substrate::raw` takes it): jobs run as the account of the user's
    /// name, from [`Self::jobs_dir`], their state polled every 500 ms; jobs without an account
    /// are team `gpu`'s, and GPU type `h100` is an H100.
    pub fn substrate_settings(&self) -> String {
        format!(
            r#"
same_name_accounts = true
work_dir = "{jobs}"

[slurm]
cluster = "{cluster}"
slurm_conf = "{conf}"
poll = "500ms"
teams = {{ "" = "gpu" }}
models = {{ h100 = "NVIDIA H100 80GB HBM3" }}
"#,
            jobs = self.jobs_dir.display(),
            cluster = self.name,
            conf = self.conf.display(),
        )
    }

    /// A client command (sbatch, squeue, scontrol, ...) for this cluster, run as root from
    /// [`Self::jobs_dir`].
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command
            .envs(self.env())
            .current_dir(&self.jobs_dir)
            .stdin(Stdio::null());
        command
    }

    /// A client command for this cluster run as `user` (through runuser, which keeps the
    /// environment: add variables to the returned command to give them to a job); root runs it
    /// directly.
    pub fn command_as(&self, user: &str, program: &str) -> Command {
        if user == "root" {
            return self.command(program);
        }
        let mut command = self.command("runuser");
        command.args(["-u", user, "--", program]);
        command
    }

    /// `sbatch --parsable ARGS` as `user`: the job id, or sbatch's stderr.
    pub fn sbatch_as(&self, user: &str, args: &[&str]) -> Result<u32, String> {
        parse_sbatch(
            self.command_as(user, "sbatch")
                .arg("--parsable")
                .args(args)
                .output()
                .expect("runs sbatch"),
        )
    }

    /// `squeue --json`, every job the controller still knows.
    pub fn squeue_json(&self) -> Value {
        let out = self.command("squeue").arg("--json").output().unwrap();
        assert!(
            out.status.success(),
            "squeue --json: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("squeue --json prints JSON")
    }

    /// The job's entry in `squeue --json` (for an array, its first task's).
    pub fn job_json(&self, job: u32) -> Option<Value> {
        self.squeue_json()["jobs"]
            .as_array()?
            .iter()
            .find(|j| j["job_id"] == job || j["array_job_id"] == job)
            .cloned()
    }

    /// The job's state as `scontrol show job` gives it (PENDING, RUNNING, COMPLETED, ...).
    pub fn job_state(&self, job: u32) -> Result<String, String> {
        let out = self
            .command("scontrol")
            .args(["show", "job", &job.to_string()])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .find_map(|w| w.strip_prefix("JobState="))
            .map(str::to_string)
            .ok_or_else(|| format!("{text}{}", String::from_utf8_lossy(&out.stderr)))
    }

    /// Waits until the job is in one of `states`; returns the state seen.
    pub fn wait_state(&self, job: u32, states: &[&str], timeout: Duration) -> String {
        eventually(
            &format!("job {job} in {states:?}"),
            timeout,
            || match self.job_state(job) {
                Ok(state) if states.contains(&state.as_str()) => Ok(state),
                Ok(state) => Err(format!("state {state}")),
                Err(e) => Err(e),
            },
        )
    }

    /// slurmctld's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("slurmctld.log")).unwrap_or_default()
    }

    /// The lines of slurmctld's log written by gpuwarden's hook.
    pub fn hook_log(&self) -> Vec<String> {
        self.log()
            .lines()
            .filter(|l| l.contains("gpuwarden: "))
            .map(str::to_string)
            .collect()
    }

    /// Makes slurmctld load job_submit.lua and its gpuwarden.conf again at the next submission:
    /// Slurm 22.05 reloads the script when its modification time is later than its last load
    /// (`scontrol reconfigure` alone does not).
    pub fn reload_hook(&self) {
        let lua = std::fs::File::options()
            .write(true)
            .open(self.dir.join("job_submit.lua"))
            .expect("the cluster has a hook");
        lua.set_modified(SystemTime::now() + Duration::from_secs(1))
            .unwrap();
    }

    /// Cancels every job and waits (up to 20 s) until none is running or completing.
    pub fn cancel_all(&self) {
        let _ = self
            .command("scancel")
            .args(["--partition", "gpu"])
            .output();
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            let out = self
                .command("squeue")
                .args(["-h", "-t", "RUNNING,COMPLETING,SUSPENDED", "-o", "%i"])
                .output();
            match out {
                Ok(out) if out.status.success() && out.stdout.is_empty() => return,
                Err(_) => return,
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        if self.check_alive().is_ok() {
            self.cancel_all();
        }
        for daemon in [self.slurmd.take(), self.controller.take()]
            .into_iter()
            .flatten()
        {
            stop(daemon);
        }
    }
}

/// SIGTERM, then SIGKILL after 10 s.
fn stop(mut child: Child) {
    let pid = rustix::process::Pid::from_child(&child);
    let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The job id `sbatch --parsable` printed (`id` or `id;cluster`), or its stderr.
fn parse_sbatch(out: Output) -> Result<u32, String> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(stderr);
    }
    stdout
        .trim()
        .split(';')
        .next()
        .and_then(|id| id.parse().ok())
        .ok_or_else(|| format!("no job id in {stdout:?}; stderr: {stderr}"))
}

/// Starts munged unless its pid file names a live process, and waits until it answers.
fn ensure_munged() {
    let alive = std::fs::read_to_string("/run/munge/munged.pid")
        .ok()
        .and_then(|p| p.trim().parse::<i32>().ok())
        .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
    if !alive {
        std::fs::create_dir_all("/run/munge").unwrap();
        let _ = Command::new("chown")
            .args(["munge:munge", "/run/munge"])
            .status();
        if !Path::new("/etc/munge/munge.key").exists() {
            let _ = Command::new("runuser")
                .args(["-u", "munge", "--", "mungekey", "--create"])
                .status();
        }
        // Two tests may both get here; the second munged finds the socket taken and exits.
        let _ = Command::new("runuser")
            .args(["-u", "munge", "--", "/usr/sbin/munged"])
            .status();
    }
    eventually("munged answering", Duration::from_secs(20), || {
        let out = Command::new("sh")
            .args(["-c", "munge -n | unmunge"])
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    });
}

/// Two ports free on 127.0.0.1 right now (both held while choosing, so they differ).
fn free_ports() -> [u16; 2] {
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    [
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    ]
}

/// The host name up to its first dot: slurmctld checks that SlurmctldHost names this machine.
fn uname_short() -> String {
    let name = rustix::system::uname();
    let name = name.nodename().to_string_lossy();
    name.split('.').next().unwrap().to_string()
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Adds search (x) permission for everyone to a directory that lacks it.
fn allow_traversal(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = std::fs::metadata(dir) else {
        return;
    };
    let mode = meta.permissions().mode();
    if mode & 0o001 == 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o011)).unwrap();
    }
}

fn log_file(path: &Path) -> std::fs::File {
    std::fs::File::options()
        .create(true)
        .append(true)
        .open(path)
        .unwrap()
}

fn read_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
