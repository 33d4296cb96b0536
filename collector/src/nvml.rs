//! The NVML source: reads every GPU of this host through `libnvidia-ml.so` (nvml-wrapper).
//!
//! NVML is used from one thread only (the sampling thread owns [`NvmlSource`]). A field a device
//! cannot report becomes null and is counted; a device that falls off the bus is logged once and
//! skipped while the others keep being sampled.
//!
//! The lease a GPU works for is found from its compute processes in `/proc` ([`LeaseFinder`]):
//! `GPUWARDEN_LEASE_ID` in a process's environment; else its Slurm job, `slurm-<cluster>-<id>`,
//! from `SLURM_ARRAY_JOB_ID` or `SLURM_JOB_ID` and `SLURM_CLUSTER_NAME` in that environment;
//! else, on a node whose Slurm cluster is configured (`collector.slurm_cluster`), the job id of
//! its Slurm cgroup in `/proc/<pid>/cgroup`; else, on a Kubernetes node whose kubelet is
//! configured (`collector.kubelet_socket`), the lease of the pod holding the GPU
//! ([`crate::kubelet`]), which also labels the sample with the pod; else, inside a virtual
//! machine whose SMBIOS OEM strings name a lease ([`crate::guest`], read once at start), that
//! lease, for every GPU of the machine, idle ones too. What a process says about
//! itself is trusted only as far as it goes today with `GPUWARDEN_LEASE_ID`: a process can put
//! anything in its own environment (or, with a delegated cgroup subtree, name its own cgroup),
//! so it can attribute its own GPU use to any lease, never another process's. Values that are
//! not well-formed (job ids other than digits, cluster names outside `[A-Za-z0-9_.-]`) are
//! ignored.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpuwarden_schema::lease::{is_slurm_cluster_name, slurm_lease_id};
use gpuwarden_schema::{Sample, V1};
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use thiserror::Error;

use crate::environ::{env_var, LEASE_ENV};
use crate::kubelet::{KubeletSettings, PodMap, PodWatcher};
use crate::metrics::Metrics;

/// Slurm's environment of a job's processes: the array's job id (one lease per array), the
/// job's own id, and the cluster's name.
const SLURM_ARRAY_JOB_ID: &str = "SLURM_ARRAY_JOB_ID";
const SLURM_JOB_ID: &str = "SLURM_JOB_ID";
const SLURM_CLUSTER_NAME: &str = "SLURM_CLUSTER_NAME";

/// NVML could not be started.
#[derive(Debug, Error)]
pub enum NvmlStartError {
    /// The driver library is not there (or not loadable).
    #[error(
        "cannot load the NVIDIA driver library {library}: {source}. Install the NVIDIA driver \
         (it provides libnvidia-ml.so.1), point `collector.nvml_library` at it, or run without \
         GPUs with `--source simulated`"
    )]
    Library {
        /// The library path tried.
        library: String,
        /// The loader's error.
        source: NvmlError,
    },
    /// The library loaded but NVML would not initialise.
    #[error("NVML failed to initialise: {0}. Is the NVIDIA driver loaded (nvidia-smi)?")]
    Init(NvmlError),
}

/// Static facts of one device, read once.
#[derive(Debug, Clone)]
struct DeviceInfo {
    uuid: String,
    model: String,
    pci_bus_id: Option<String>,
}

/// Reads the host's GPUs. Owns the NVML handle; keep it on one thread.
pub struct NvmlSource {
    nvml: Nvml,
    host: String,
    metrics: Arc<Metrics>,
    devices: Vec<Option<DeviceInfo>>,
    lost: Vec<bool>,
    leases: LeaseFinder,
    pods: Option<PodWatcher>,
    /// The lease of the virtual machine this runs in, if its SMBIOS names one.
    guest_lease: Option<String>,
    /// The parent GPU's UUID of each MIG device UUID the kubelet named (`None`: NVML does not
    /// know it); a MIG device keeps its parent for as long as NVML runs.
    mig_parents: HashMap<String, Option<String>>,
}

impl std::fmt::Debug for NvmlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSource")
            .field("host", &self.host)
            .field("devices", &self.devices.len())
            .finish()
    }
}

impl NvmlSource {
    /// Loads NVML from `library` (the system's `libnvidia-ml.so.1` when `None`). `slurm_cluster`
    /// is the node's Slurm `ClusterName`, if it is a Slurm node (see [`LeaseFinder::new`]).
    pub fn open(
        library: Option<&Path>,
        host: String,
        slurm_cluster: Option<String>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, NvmlStartError> {
        let nvml = match library {
            Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
            None => Nvml::init(),
        };
        let nvml = nvml.map_err(|e| match e {
            NvmlError::LibloadingError(_) => NvmlStartError::Library {
                library: library.map_or_else(
                    || "libnvidia-ml.so.1".to_string(),
                    |p| p.display().to_string(),
                ),
                source: e,
            },
            other => NvmlStartError::Init(other),
        })?;
        let count = nvml.device_count().map_err(NvmlStartError::Init)? as usize;
        let driver = nvml
            .sys_driver_version()
            .unwrap_or_else(|_| "unknown".into());
        tracing::info!(devices = count, driver = %driver, "NVML started");
        Ok(Self {
            nvml,
            host,
            metrics,
            devices: vec![None; count],
            lost: vec![false; count],
            leases: LeaseFinder::new(PathBuf::from("/proc"), slurm_cluster),
            pods: None,
            guest_lease: None,
            mig_parents: HashMap::new(),
        })
    }

    /// Attributes GPUs to the pods holding them, as the kubelet of `kubelet` says (see
    /// [`crate::kubelet`]); waits for the first answer, at most the call's timeout.
    pub fn with_pods(mut self, kubelet: KubeletSettings) -> std::io::Result<Self> {
        tracing::info!(socket = %kubelet.socket.display(), pod_logs = %kubelet.pod_logs_dir.display(), "attributing GPUs to pods through the kubelet's PodResources API");
        self.pods = Some(PodWatcher::start(kubelet, Arc::clone(&self.metrics))?);
        Ok(self)
    }

    /// Attributes every GPU whose lease no process or pod names to the lease of the virtual
    /// machine this runs in, as the SMBIOS entries under `dmi_entries_dir` say (see
    /// [`crate::guest`]); read now, once, and logged.
    pub fn with_guest_lease(mut self, dmi_entries_dir: &Path) -> Self {
        self.guest_lease = crate::guest::read_lease(dmi_entries_dir);
        self
    }

    /// Number of devices NVML reported at start.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// One sample per device still on the bus, covering `[ts_ms - interval_ms, ts_ms)`.
    pub fn sample(&mut self, ts_ms: i64, interval_ms: i64) -> Vec<Sample> {
        let mut out = Vec::with_capacity(self.devices.len());
        let pods = self.pods.as_ref().map(PodWatcher::current);
        if let Some(pods) = &pods {
            self.find_mig_parents(pods);
        }
        for index in 0..self.devices.len() {
            if self.lost[index] {
                continue;
            }
            match self.sample_device(index as u32, ts_ms, interval_ms, pods.as_deref()) {
                Ok(Some(sample)) => out.push(sample),
                Ok(None) => {}
                Err(Lost) => {
                    self.lost[index] = true;
                    self.metrics.device_lost();
                    let uuid = self.devices[index]
                        .as_ref()
                        .map_or("unknown", |d| d.uuid.as_str());
                    tracing::error!(
                        index,
                        uuid,
                        "GPU fell off the bus; it is no longer sampled (the other GPUs are)"
                    );
                }
            }
        }
        self.leases.forget_unseen();
        out
    }

    /// Asks NVML for the parent GPU of each MIG device UUID not asked about before.
    fn find_mig_parents(&mut self, pods: &PodMap) {
        for mig in pods.mig_uuids() {
            if self.mig_parents.contains_key(mig) {
                continue;
            }
            let parent = self
                .nvml
                .device_by_uuid(mig)
                .and_then(|device| device.mig_parent_device())
                .and_then(|parent| parent.uuid());
            if let Err(e) = &parent {
                tracing::debug!(mig, error = %e, "NVML cannot tell the GPU of a MIG device the kubelet names");
            }
            self.mig_parents.insert(mig.to_owned(), parent.ok());
        }
    }

    fn sample_device(
        &mut self,
        index: u32,
        ts_ms: i64,
        interval_ms: i64,
        pods: Option<&PodMap>,
    ) -> Result<Option<Sample>, Lost> {
        let metrics = Arc::clone(&self.metrics);
        let Some(device) = required(self.nvml.device_by_index(index), &metrics, "device")? else {
            return Ok(None);
        };
        // Required fields: without them there is no valid sample this round.
        let info = match &self.devices[index as usize] {
            Some(info) => info.clone(),
            None => {
                let uuid = required(device.uuid(), &metrics, "gpu_uuid")?;
                let model = required(device.name(), &metrics, "gpu_model")?;
                let (Some(uuid), Some(model)) = (uuid, model) else {
                    return Ok(None);
                };
                let pci_bus_id =
                    optional(device.pci_info(), &metrics, "pci_bus_id")?.map(|p| p.bus_id);
                let info = DeviceInfo {
                    uuid,
                    model,
                    pci_bus_id,
                };
                self.devices[index as usize] = Some(info.clone());
                info
            }
        };
        let Some(util) = required(device.utilization_rates(), &metrics, "util_gpu_pct")? else {
            return Ok(None);
        };
        let Some(memory) = required(device.memory_info(), &metrics, "mem_used_bytes")? else {
            return Ok(None);
        };

        let power_w =
            optional(device.power_usage(), &metrics, "power_w")?.map(|mw| f64::from(mw) / 1000.0);
        let power_limit_w = optional(device.enforced_power_limit(), &metrics, "power_limit_w")?
            .map(|mw| f64::from(mw) / 1000.0);
        let energy_mj = optional(device.total_energy_consumption(), &metrics, "energy_mj")?;
        let temp_c = optional(
            device.temperature(TemperatureSensor::Gpu),
            &metrics,
            "temp_c",
        )?
        .map(f64::from);
        let sm_clock_mhz = optional(device.clock_info(Clock::SM), &metrics, "sm_clock_mhz")?;
        let processes = optional(
            device.running_compute_processes(),
            &metrics,
            "process_count",
        )?;
        let lease_id = processes
            .as_ref()
            .and_then(|procs| procs.iter().find_map(|p| self.leases.lease_of(p.pid)));
        let hold = pods.and_then(|pods| {
            pods.hold(&info.uuid, Some(index), |mig| {
                self.mig_parents.get(mig).cloned().flatten()
            })
        });
        let labels = hold.as_ref().map(|hold| hold.labels());
        let lease_id = lease_id
            .or_else(|| hold.and_then(|hold| hold.lease_id))
            .or_else(|| self.guest_lease.clone());

        Ok(Some(Sample {
            v: V1,
            ts_ms,
            interval_ms,
            host: self.host.clone(),
            gpu_uuid: info.uuid,
            gpu_model: info.model,
            util_gpu_pct: f64::from(util.gpu.min(100)),
            mem_used_bytes: memory.used.min(memory.total),
            mem_total_bytes: memory.total,
            gpu_index: Some(index),
            pci_bus_id: info.pci_bus_id,
            util_mem_pct: Some(f64::from(util.memory.min(100))),
            power_w,
            power_limit_w,
            energy_mj,
            temp_c,
            sm_clock_mhz,
            process_count: processes.map(|p| p.len() as u32),
            lease_id,
            mig_profile: None,
            labels,
        }))
    }
}

/// The device fell off the bus.
struct Lost;

/// Reads one field. An error other than a lost device is counted for `field` and gives `None`:
/// a required field then skips this device for the round (worth a warning), an optional one
/// becomes null (routine on devices that do not report it).
fn read<T>(
    result: Result<T, NvmlError>,
    metrics: &Metrics,
    field: &'static str,
    required: bool,
) -> Result<Option<T>, Lost> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(NvmlError::GpuLost) => Err(Lost),
        Err(e) => {
            metrics.nvml_error(field);
            if required {
                tracing::warn!(field, error = %e, "NVML cannot read a required field; skipping this GPU this round");
            } else {
                tracing::trace!(field, error = %e, "NVML field unavailable");
            }
            Ok(None)
        }
    }
}

fn required<T>(
    result: Result<T, NvmlError>,
    metrics: &Metrics,
    field: &'static str,
) -> Result<Option<T>, Lost> {
    read(result, metrics, field, true)
}

fn optional<T>(
    result: Result<T, NvmlError>,
    metrics: &Metrics,
    field: &'static str,
) -> Result<Option<T>, Lost> {
    read(result, metrics, field, false)
}

/// Finds the lease of a process (see the module's doc for where it looks), caching a lease
/// found in a process's environment per pid; a process whose environment cannot be read
/// (another user's, gone) and whose cgroup names no Slurm job has none.
#[derive(Debug)]
pub struct LeaseFinder {
    proc_root: PathBuf,
    slurm_cluster: Option<String>,
    cache: HashMap<u32, String>,
    seen: Vec<u32>,
}

impl LeaseFinder {
    /// Reads processes under `proc_root` (normally `/proc`). `slurm_cluster` is the Slurm
    /// `ClusterName` of this node: it names the lease of a Slurm job found through a process's
    /// cgroup, or through an environment without `SLURM_CLUSTER_NAME`. Without it (or with a
    /// name that is not lease-id-safe), cgroups are not read.
    pub fn new(proc_root: PathBuf, slurm_cluster: Option<String>) -> Self {
        Self {
            proc_root,
            slurm_cluster: slurm_cluster.filter(|c| is_slurm_cluster_name(c)),
            cache: HashMap::new(),
            seen: Vec::new(),
        }
    }

    /// The lease of `pid`, if any.
    pub fn lease_of(&mut self, pid: u32) -> Option<String> {
        self.seen.push(pid);
        if let Some(hit) = self.cache.get(&pid) {
            return Some(hit.clone());
        }
        let dir = self.proc_root.join(pid.to_string());
        let cluster = self.slurm_cluster.as_deref();
        let lease = std::fs::read(dir.join("environ"))
            .ok()
            .and_then(|environ| lease_in_environ(&environ, cluster));
        // Only a lease found in the environment is cached: a process caught in the middle of
        // exec shows an empty environment for a moment, and must neither stay lease-less for the
        // rest of its life nor keep what its cgroup says (an array task's own job id, or its
        // Slurm job where its environment names a gpuwarden lease).
        if let Some(lease) = lease {
            self.cache.insert(pid, lease.clone());
            return Some(lease);
        }
        let cluster = cluster?;
        let cgroup = std::fs::read(dir.join("cgroup")).ok()?;
        slurm_job_in_cgroup(&cgroup).map(|job| slurm_lease_id(cluster, job))
    }

    /// Drops cached pids not looked up since the last call, so a reused pid is read afresh.
    pub fn forget_unseen(&mut self) {
        let seen = std::mem::take(&mut self.seen);
        self.cache.retain(|pid, _| seen.contains(pid));
    }
}

/// The lease an environment names: `GPUWARDEN_LEASE_ID`; else its Slurm job's, the array's id
/// before the job's own, on the cluster of `SLURM_CLUSTER_NAME` or else `slurm_cluster`.
fn lease_in_environ(environ: &[u8], slurm_cluster: Option<&str>) -> Option<String> {
    if let Some(lease) = env_var(environ, LEASE_ENV).filter(|v| !v.is_empty()) {
        return Some(String::from_utf8_lossy(lease).into_owned());
    }
    let job = env_var(environ, SLURM_ARRAY_JOB_ID)
        .and_then(job_id)
        .or_else(|| env_var(environ, SLURM_JOB_ID).and_then(job_id))?;
    let cluster = env_var(environ, SLURM_CLUSTER_NAME)
        .and_then(|c| std::str::from_utf8(c).ok())
        .filter(|c| is_slurm_cluster_name(c))
        .or(slurm_cluster)?;
    Some(slurm_lease_id(cluster, job))
}

/// A Slurm job id: 1 to 10 ASCII digits that make a non-zero `u32`.
fn job_id(text: &[u8]) -> Option<u32> {
    if text.is_empty() || text.len() > 10 || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text)
        .ok()?
        .parse()
        .ok()
        .filter(|id| *id != 0)
}

/// The Slurm job id in the contents of `/proc/<pid>/cgroup`, from the first line
/// (`hierarchy:controllers:path`) whose path runs through a Slurm job's cgroup:
/// cgroup v1 `…/slurm/uid_<uid>/job_<id>/…` (`slurm_<node>` with several slurmd per host), or
/// v2 `…/slurmstepd.scope/job_<id>/…` (`<node>_slurmstepd.scope`). An array task's cgroup
/// carries its own job id, not the array's.
fn slurm_job_in_cgroup(cgroup: &[u8]) -> Option<u32> {
    cgroup.split(|b| *b == b'\n').find_map(|line| {
        let mut fields = line.splitn(3, |b| *b == b':');
        let path = fields.nth(2)?;
        let parts: Vec<&[u8]> = path.split(|b| *b == b'/').collect();
        parts.iter().enumerate().find_map(|(i, part)| {
            if !is_slurm_cgroup_root(part) {
                return None;
            }
            let mut rest = parts[i + 1..].iter();
            let mut next = *rest.next()?;
            if let Some(uid) = next.strip_prefix(b"uid_") {
                if uid.is_empty() || !uid.iter().all(u8::is_ascii_digit) {
                    return None;
                }
                next = rest.next()?;
            }
            job_id(next.strip_prefix(b"job_")?)
        })
    })
}

/// Whether a cgroup path component is where Slurm puts its jobs' cgroups.
fn is_slurm_cgroup_root(part: &[u8]) -> bool {
    let named = |node: &[u8]| !node.is_empty();
    part == b"slurm"
        || part == b"slurmstepd.scope"
        || part.strip_prefix(b"slurm_").is_some_and(named)
        || part.strip_suffix(b"_slurmstepd.scope").is_some_and(named)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixture `/proc` with one directory per pid.
    struct Proc(tempfile::TempDir);

    impl Proc {
        fn new() -> Self {
            Self(tempfile::tempdir().unwrap())
        }

        fn environ(&self, pid: u32, vars: &[&str]) -> &Self {
            let mut environ = Vec::new();
            for var in vars {
                environ.extend_from_slice(var.as_bytes());
                environ.push(0);
            }
            self.write(pid, "environ", &environ)
        }

        fn cgroup(&self, pid: u32, text: &str) -> &Self {
            self.write(pid, "cgroup", text.as_bytes())
        }

        fn write(&self, pid: u32, file: &str, bytes: &[u8]) -> &Self {
            let dir = self.0.path().join(pid.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(file), bytes).unwrap();
            self
        }

        fn finder(&self, slurm_cluster: Option<&str>) -> LeaseFinder {
            LeaseFinder::new(self.0.path().to_path_buf(), slurm_cluster.map(String::from))
        }
    }

    /// What this host's Slurm 22.05 (cgroup v1, `slurm_<node>`) shows for a batch step of job 16.
    const V1_CGROUP: &str =
        "9:name=systemd:/\n8:pids:/\n6:freezer:/slurm_vm/uid_0/job_16/step_batch\n\
                             5:devices:/slurm_vm/uid_0/job_16/step_batch/task_0\n\
                             4:memory:/process_api/05890893ca87\n0::/\n";

    #[test]
    fn lease_is_read_from_the_process_environment() {
        let lease = |environ: &[u8]| lease_in_environ(environ, None);
        assert_eq!(
            lease(b"PATH=/bin\0GPUWARDEN_LEASE_ID=l-42\0HOME=/root\0"),
            Some("l-42".into())
        );
        assert_eq!(lease(b"PATH=/bin\0GPUWARDEN_LEASE_IDX=no\0"), None);
        assert_eq!(lease(b"GPUWARDEN_LEASE_ID=\0"), None);
        assert_eq!(lease(b""), None);
    }

    #[test]
    fn a_slurm_job_is_its_lease_and_a_gpuwarden_lease_wins() {
        let lease = |environ: &[u8], cluster| lease_in_environ(environ, cluster);
        let job = b"SLURM_JOB_ID=42\0SLURM_CLUSTER_NAME=study\0";
        assert_eq!(lease(job, None), Some("slurm-study-42".into()));
        assert_eq!(
            lease(job, Some("other")),
            Some("slurm-study-42".into()),
            "the job's own cluster name wins over the configured one"
        );
        assert_eq!(
            lease(
                b"SLURM_CLUSTER_NAME=study\0SLURM_JOB_ID=42\0GPUWARDEN_LEASE_ID=l-7\0",
                None
            ),
            Some("l-7".into()),
            "a job submitted by gpuwarden's driver carries the lease it was made for"
        );
        assert_eq!(
            lease(
                b"GPUWARDEN_LEASE_ID=\0SLURM_JOB_ID=42\0SLURM_CLUSTER_NAME=study\0",
                None
            ),
            Some("slurm-study-42".into()),
            "an empty GPUWARDEN_LEASE_ID names nothing"
        );
        assert_eq!(
            lease(b"SLURM_JOB_ID=42\0", None),
            None,
            "no cluster in the environment or the config"
        );
        assert_eq!(
            lease(b"SLURM_JOB_ID=42\0", Some("study")),
            Some("slurm-study-42".into())
        );
        assert_eq!(
            lease(b"SLURM_JOB_ID=42\0SLURM_CLUSTER_NAME=Study\0", None),
            Some("slurm-study-42".into()),
            "in lower case, as Slurm writes ClusterName"
        );
        assert_eq!(lease(b"SLURM_CLUSTER_NAME=study\0", Some("study")), None);
    }

    #[test]
    fn a_job_array_is_one_lease() {
        // What Slurm 22.05 gives task 0 of array 15, which runs as job 16.
        let task = b"SLURM_ARRAY_JOB_ID=15\0SLURM_ARRAY_TASK_ID=0\0SLURM_CLUSTER_NAME=study\0SLURM_JOB_ID=16\0";
        assert_eq!(lease_in_environ(task, None), Some("slurm-study-15".into()));
        assert_eq!(
            lease_in_environ(
                b"SLURM_JOB_ID=16\0SLURM_CLUSTER_NAME=study\0SLURM_ARRAY_JOB_ID=15\0",
                None
            ),
            Some("slurm-study-15".into()),
            "whatever the order of the variables"
        );
    }

    #[test]
    fn malformed_slurm_variables_are_ignored() {
        let lease = |environ: &[u8]| lease_in_environ(environ, None);
        for job in [
            "",
            "abc",
            "42abc",
            "+42",
            "-1",
            " 42",
            "4.2",
            "0",
            "4294967296",
            "00000000042",
        ] {
            let environ = format!("SLURM_JOB_ID={job}\0SLURM_CLUSTER_NAME=study\0");
            assert_eq!(lease(environ.as_bytes()), None, "job id {job:?}");
        }
        for cluster in [
            "",
            "a/b",
            "../x",
            "a b",
            "a'b",
            "c\u{e9}t\u{e9}",
            &"c".repeat(41),
        ] {
            let environ = format!("SLURM_JOB_ID=42\0SLURM_CLUSTER_NAME={cluster}\0");
            assert_eq!(lease(environ.as_bytes()), None, "cluster {cluster:?}");
            assert_eq!(
                lease_in_environ(environ.as_bytes(), Some("study")),
                Some("slurm-study-42".into()),
                "a malformed cluster name is no name: the configured one is used ({cluster:?})"
            );
        }
        assert_eq!(
            lease(b"SLURM_JOB_ID=42\0SLURM_CLUSTER_NAME=\xff\xfe\0"),
            None
        );
        assert_eq!(
            lease(b"SLURM_ARRAY_JOB_ID=x15\0SLURM_JOB_ID=16\0SLURM_CLUSTER_NAME=study\0"),
            Some("slurm-study-16".into()),
            "a malformed array id is no array id"
        );
        assert_eq!(
            lease(b"SLURM_JOB_ID=7\0SLURM_JOB_ID=8\0SLURM_CLUSTER_NAME=study\0"),
            Some("slurm-study-7".into()),
            "the first of a repeated variable, as getenv reads it"
        );
        assert_eq!(
            lease(b"XSLURM_JOB_ID=7\0SLURM_JOB_IDS=8\0SLURM_CLUSTER_NAME=study\0"),
            None,
            "only the exact names"
        );
    }

    #[test]
    fn the_job_id_is_read_from_v1_and_v2_slurm_cgroups() {
        let job = |text: &str| slurm_job_in_cgroup(text.as_bytes());
        assert_eq!(job(V1_CGROUP), Some(16));
        assert_eq!(
            job("7:devices:/slurm/uid_1001/job_42/step_batch/task_0\n"),
            Some(42)
        );
        assert_eq!(
            job("7:freezer:/slurm/uid_1001/job_42\n"),
            Some(42),
            "the job's own cgroup"
        );
        assert_eq!(
            job("0::/system.slice/slurmstepd.scope/job_42/step_0/user/task_0\n"),
            Some(42)
        );
        assert_eq!(
            job("0::/system.slice/node7_slurmstepd.scope/job_42/step_extern/user/task_0\n"),
            Some(42),
            "v2 with several slurmd per host"
        );
        assert_eq!(
            job("0::/../../system.slice/slurmstepd.scope/job_42/step_0/user/task_0\n"),
            Some(42),
            "seen from another cgroup namespace"
        );
        assert_eq!(
            job("12:pids:/user.slice\n3:cpuset:/slurm/uid_5/job_9/step_0\n"),
            Some(9)
        );
    }

    #[test]
    fn cgroups_that_are_not_a_slurm_job_name_none() {
        for text in [
            "",
            "0::/\n",
            "0::/user.slice/user-1001.slice/session-3.scope\n",
            "0::/system.slice/slurmd.service\n",
            "0::/system.slice/slurmstepd.scope/system\n",
            "0::/system.slice/slurmstepd.scope\n",
            "7:devices:/slurm/uid_1001\n",
            "7:devices:/slurm/uid_x/job_42/step_0\n",
            "7:devices:/slurm/uid_/job_42\n",
            "7:devices:/slurm/job_42x/step_0\n",
            "7:devices:/slurm/uid_1/job_/step_0\n",
            "7:devices:/slurm/uid_1/job_0/step_0\n",
            "7:devices:/slurm/uid_1/step_0/job_42\n",
            "7:devices:/slurm_/uid_1/job_42\n",
            "7:devices:/slurmx/uid_1/job_42\n",
            "0::/system.slice/_slurmstepd.scope/job_42\n",
            "0::/docker/job_42\n",
            "/slurm/uid_1/job_42\n",
        ] {
            assert_eq!(slurm_job_in_cgroup(text.as_bytes()), None, "{text:?}");
        }
        assert_eq!(
            slurm_job_in_cgroup(b"garbage\0\xff:\n::\xfe/slurm/\n"),
            None
        );
    }

    #[test]
    fn the_environment_comes_first_then_the_cgroup_with_the_configured_cluster() {
        let proc = Proc::new();
        // 1: a gpuwarden lease in a Slurm job. 2: an array task. 3: an unreadable environment.
        // 4: an environment without Slurm. 5: a Slurm environment without a cluster name.
        // 6: an environment with junk, in a cgroup that is no Slurm job.
        proc.environ(
            1,
            &[
                "GPUWARDEN_LEASE_ID=l-1",
                "SLURM_JOB_ID=16",
                "SLURM_CLUSTER_NAME=study",
            ],
        )
        .cgroup(1, V1_CGROUP);
        proc.environ(
            2,
            &[
                "SLURM_ARRAY_JOB_ID=15",
                "SLURM_JOB_ID=16",
                "SLURM_CLUSTER_NAME=study",
            ],
        )
        .cgroup(2, V1_CGROUP);
        proc.cgroup(3, V1_CGROUP);
        proc.environ(4, &["PATH=/bin"]).cgroup(
            4,
            "0::/system.slice/slurmstepd.scope/job_42/step_0/user/task_0\n",
        );
        proc.environ(5, &["SLURM_JOB_ID=77"]).cgroup(5, V1_CGROUP);
        proc.environ(6, &["SLURM_JOB_ID=../../etc", "SLURM_CLUSTER_NAME=a/b"])
            .cgroup(6, "0::/user.slice/job_9\n");

        let mut finder = proc.finder(Some("Study"));
        assert_eq!(finder.lease_of(1), Some("l-1".into()));
        assert_eq!(finder.lease_of(2), Some("slurm-study-15".into()));
        assert_eq!(
            finder.lease_of(3),
            Some("slurm-study-16".into()),
            "the cgroup's job (an array task's own id: the environment is preferred)"
        );
        assert_eq!(finder.lease_of(4), Some("slurm-study-42".into()));
        assert_eq!(finder.lease_of(5), Some("slurm-study-77".into()));
        assert_eq!(finder.lease_of(6), None);
        assert_eq!(finder.lease_of(8), None, "a pid with no /proc entry");

        let mut unconfigured = proc.finder(None);
        assert_eq!(unconfigured.lease_of(2), Some("slurm-study-15".into()));
        assert_eq!(
            unconfigured.lease_of(3),
            None,
            "no cluster: cgroups are not read"
        );
        assert_eq!(unconfigured.lease_of(4), None);
        assert_eq!(unconfigured.lease_of(5), None);

        let mut unsafe_cluster = proc.finder(Some("a/b"));
        assert_eq!(
            unsafe_cluster.lease_of(3),
            None,
            "a cluster name unfit for a lease id"
        );
    }

    #[test]
    fn unreadable_or_missing_processes_have_no_lease() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("7")).unwrap();
        std::fs::write(dir.path().join("7/environ"), b"GPUWARDEN_LEASE_ID=l-7\0").unwrap();
        let mut finder = LeaseFinder::new(dir.path().to_path_buf(), None);
        assert_eq!(finder.lease_of(7), Some("l-7".into()));
        assert_eq!(finder.lease_of(8), None, "a pid with no /proc entry");
        finder.forget_unseen();
        std::fs::write(
            dir.path().join("7/environ"),
            b"GPUWARDEN_LEASE_ID=l-other\0",
        )
        .unwrap();
        assert_eq!(
            finder.lease_of(7),
            Some("l-7".into()),
            "cached while the pid is seen"
        );
        finder.forget_unseen();
        finder.forget_unseen();
        assert_eq!(
            finder.lease_of(7),
            Some("l-other".into()),
            "read afresh once the pid went unseen"
        );
    }

    #[test]
    fn a_lease_from_the_environment_is_cached_one_from_the_cgroup_is_not() {
        let proc = Proc::new();
        // Caught in the middle of exec: an empty environment, and the cgroup of array task 16.
        proc.environ(9, &[]).cgroup(9, V1_CGROUP);
        let mut finder = proc.finder(Some("study"));
        assert_eq!(finder.lease_of(9), Some("slurm-study-16".into()));
        proc.environ(
            9,
            &[
                "SLURM_ARRAY_JOB_ID=15",
                "SLURM_JOB_ID=16",
                "SLURM_CLUSTER_NAME=study",
            ],
        );
        assert_eq!(
            finder.lease_of(9),
            Some("slurm-study-15".into()),
            "the environment, once there, replaces what the cgroup said"
        );
        proc.environ(9, &[]).cgroup(9, "0::/\n");
        assert_eq!(
            finder.lease_of(9),
            Some("slurm-study-15".into()),
            "and is kept while the pid is seen"
        );
        // A lease-less pid is read again each time, as before.
        proc.environ(10, &[]);
        assert_eq!(finder.lease_of(10), None);
        proc.environ(10, &["SLURM_JOB_ID=5", "SLURM_CLUSTER_NAME=study"]);
        assert_eq!(finder.lease_of(10), Some("slurm-study-5".into()));
    }

    #[test]
    fn the_running_process_lease_is_found_through_real_proc() {
        // This test process has no lease; its own environ is readable.
        let mut finder = LeaseFinder::new(PathBuf::from("/proc"), None);
        if std::env::var_os(LEASE_ENV).is_none() && std::env::var_os(SLURM_JOB_ID).is_none() {
            assert_eq!(finder.lease_of(std::process::id()), None);
        }
    }
}
