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
//!
//! On a GPU with GPU performance monitoring (GPM: Hopper and later) each sample also carries the
//! SM activity, SM occupancy, tensor and DRAM activity and graphics activity of the interval
//! since the previous sample, from the GPM samples NVML took at both ends; the first sample of a
//! GPU has none, and a GPM failure leaves them empty, never the sample.
//!
//! A GPU in MIG mode is sampled as its MIG devices ("slices"), each a GPU of its own: its UUID,
//! profile (`1g.10gb`), compute slices out of the GPU's, its own memory and processes (and so
//! its lease, or the pod holding it), the GPM of its GPU instance, and its share of the GPU's
//! power and energy, which NVML reads for the whole GPU only. NVML has no utilization for MIG
//! devices: a slice's is its GPU instance's graphics activity where GPM has it, else 100 while a
//! process runs on it and 0 otherwise. Compute slices no MIG device holds are sampled as the
//! GPU's unsliced rest: its UUID, no profile, no lease, idle. A GPU in MIG mode has no sample of
//! the whole. The GPU instance of a MIG device (which its GPM and `/metrics` labels need) is
//! learnt from its processes, which NVML reports with it, and kept for as long as the device
//! is seen.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpuwarden_schema::lease::{is_slurm_cluster_name, slurm_lease_id};
use gpuwarden_schema::{Sample, V1};
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::gpm_metrics_get;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{Device, GpmSample, Nvml};
use thiserror::Error;

use crate::environ::{env_var, LEASE_ENV};
use crate::kubelet::{KubeletSettings, PodMap, PodWatcher};
use crate::metrics::Metrics;
use crate::serving::ServingFinder;

/// Slurm's environment of a job's processes: the array's job id (one lease per array), the
/// job's own id, and the cluster's name.
const SLURM_ARRAY_JOB_ID: &str = "SLURM_ARRAY_JOB_ID";
const SLURM_JOB_ID: &str = "SLURM_JOB_ID";
const SLURM_CLUSTER_NAME: &str = "SLURM_CLUSTER_NAME";

/// `NVML_DEVICE_MIG_ENABLE`: the MIG mode of a GPU in MIG mode.
const MIG_ENABLED: u32 = 1;

/// `NVML_GPU_INSTANCE_PROFILE_COUNT`: GPU instance profile ids are below it.
const GPU_INSTANCE_PROFILE_COUNT: u32 = 17;

/// The GPM metrics read, in the order of [`Gpm`]'s fields.
const GPM_METRICS: [GpmMetricId; 5] = [
    GpmMetricId::SmUtil,
    GpmMetricId::SmOccupancy,
    GpmMetricId::AnyTensorUtil,
    GpmMetricId::DramBwUtil,
    GpmMetricId::GraphicsUtil,
];

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

/// NVML, loaded and initialised. An [`NvmlSource`] borrows it, and so do the GPM samples the
/// source keeps from one round to the next; dropping it shuts NVML down.
pub struct NvmlLibrary {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlLibrary").finish_non_exhaustive()
    }
}

impl NvmlLibrary {
    /// Loads NVML from `library` (the system's `libnvidia-ml.so.1` when `None`).
    pub fn open(library: Option<&Path>) -> Result<Self, NvmlStartError> {
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
        Ok(Self { nvml })
    }
}

/// The GPM measures of one interval, percent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Gpm {
    sm_active: Option<f64>,
    sm_occupancy: Option<f64>,
    tensor_active: Option<f64>,
    dram_active: Option<f64>,
    gr_active: Option<f64>,
}

/// The readings of a physical GPU that are the same whatever part of it a sample describes,
/// or that NVML has only for the whole GPU (power, energy).
#[derive(Debug, Clone, Copy, Default)]
struct Readings {
    power_w: Option<f64>,
    power_limit_w: Option<f64>,
    energy_mj: Option<u64>,
    temp_c: Option<f64>,
    sm_clock_mhz: Option<u32>,
}

/// One MIG device as read this round.
#[derive(Debug)]
struct Slice {
    /// Its index among its GPU's MIG devices.
    index: u32,
    uuid: String,
    model: String,
    profile: Option<String>,
    slices: Option<u32>,
    /// Used and total; `None` when NVML cannot tell this round, which leaves the MIG device
    /// without a sample (but still holding its slices).
    memory: Option<(u64, u64)>,
    processes: Option<Vec<ProcessInfo>>,
    gpm: Gpm,
}

/// Reads the host's GPUs through the NVML it borrows. Keep it on one thread.
pub struct NvmlSource<'n> {
    nvml: &'n Nvml,
    host: String,
    metrics: Arc<Metrics>,
    devices: Vec<Option<DeviceInfo>>,
    lost: Vec<bool>,
    leases: LeaseFinder,
    /// The serving measures GPU processes declare ([`crate::serving`]).
    serving: ServingFinder,
    /// This round's samples' processes, by the sample's position: whose serving measure to read.
    pids: Vec<(usize, Vec<u32>)>,
    /// The same for the device being sampled, by position among its own samples.
    device_pids: Vec<(usize, Vec<u32>)>,
    pods: Option<PodWatcher>,
    /// The lease of the virtual machine this runs in, if its SMBIOS names one.
    guest_lease: Option<String>,
    /// The parent GPU's UUID of each MIG device UUID the kubelet named (`None`: NVML does not
    /// know it); a MIG device keeps its parent for as long as NVML runs.
    mig_parents: HashMap<String, Option<String>>,
    /// Whether each device has GPM, once NVML said.
    gpm_support: Vec<Option<bool>>,
    /// The latest GPM sample of each GPU (by UUID) and of each MIG device's GPU instance (by
    /// the MIG device's UUID), the start of the next interval's measures.
    gpm: HashMap<String, GpmSample<'n>>,
    /// The compute slices of each GPU in MIG mode, once asked (`Some(None)`: NVML tells none).
    mig_totals: Vec<Option<Option<u32>>>,
    /// The GPU instance of each MIG device UUID, as its processes told.
    gpu_instances: HashMap<String, u32>,
    /// The GPUs and MIG devices seen this round, by UUID: what is kept for the next.
    seen: HashSet<String>,
}

impl std::fmt::Debug for NvmlSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSource")
            .field("host", &self.host)
            .field("devices", &self.devices.len())
            .finish()
    }
}

impl<'n> NvmlSource<'n> {
    /// Samples the GPUs of `nvml`. `slurm_cluster` is the node's Slurm `ClusterName`, if it is a
    /// Slurm node (see [`LeaseFinder::new`]).
    pub fn open(
        nvml: &'n NvmlLibrary,
        host: String,
        slurm_cluster: Option<String>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, NvmlStartError> {
        let nvml = &nvml.nvml;
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
            serving: ServingFinder::new(PathBuf::from("/proc")),
            pids: Vec::new(),
            device_pids: Vec::new(),
            pods: None,
            guest_lease: None,
            mig_parents: HashMap::new(),
            gpm_support: vec![None; count],
            gpm: HashMap::new(),
            mig_totals: vec![None; count],
            gpu_instances: HashMap::new(),
            seen: HashSet::new(),
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

    /// The samples of every device still on the bus, covering `[ts_ms - interval_ms, ts_ms)`:
    /// one per GPU, or one per MIG device (and the unsliced rest) of a GPU in MIG mode.
    pub fn sample(&mut self, ts_ms: i64, interval_ms: i64) -> Vec<Sample> {
        let mut out = Vec::with_capacity(self.devices.len());
        let pods = self.pods.as_ref().map(PodWatcher::current);
        if let Some(pods) = &pods {
            self.find_mig_parents(pods);
        }
        self.seen.clear();
        self.pids.clear();
        for index in 0..self.devices.len() {
            if self.lost[index] {
                continue;
            }
            self.device_pids.clear();
            match self.sample_device(index as u32, ts_ms, interval_ms, pods.as_deref()) {
                Ok(samples) => {
                    let base = out.len();
                    let device_pids = self.device_pids.drain(..);
                    self.pids
                        .extend(device_pids.map(|(at, pids)| (base + at, pids)));
                    out.extend(samples);
                }
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
        self.serving.fill(&mut out, &self.pids);
        self.serving.forget_unseen();
        // A GPU or MIG device not seen this round starts afresh when it is back.
        let seen = &self.seen;
        self.gpm.retain(|uuid, _| seen.contains(uuid));
        self.gpu_instances.retain(|uuid, _| seen.contains(uuid));
        self.metrics.set_gpu_instances(self.gpu_instances.clone());
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

    /// The device's static facts, read once (`None`: not readable this round).
    fn info(&mut self, index: u32, device: &Device<'_>) -> Result<Option<DeviceInfo>, Lost> {
        if let Some(info) = &self.devices[index as usize] {
            return Ok(Some(info.clone()));
        }
        let metrics = &self.metrics;
        let uuid = required(device.uuid(), metrics, "gpu_uuid")?;
        let model = required(device.name(), metrics, "gpu_model")?;
        let (Some(uuid), Some(model)) = (uuid, model) else {
            return Ok(None);
        };
        let pci_bus_id = optional(device.pci_info(), metrics, "pci_bus_id")?.map(|p| p.bus_id);
        let info = DeviceInfo {
            uuid,
            model,
            pci_bus_id,
        };
        self.devices[index as usize] = Some(info.clone());
        Ok(Some(info))
    }

    fn sample_device(
        &mut self,
        index: u32,
        ts_ms: i64,
        interval_ms: i64,
        pods: Option<&PodMap>,
    ) -> Result<Vec<Sample>, Lost> {
        let metrics = Arc::clone(&self.metrics);
        let nvml = self.nvml;
        let Some(device) = required(nvml.device_by_index(index), &metrics, "device")? else {
            return Ok(Vec::new());
        };
        // Required fields: without them there is no valid sample this round.
        let Some(info) = self.info(index, &device)? else {
            return Ok(Vec::new());
        };
        self.seen.insert(info.uuid.clone());
        if mig_enabled(&device, &metrics)? {
            return self.sample_mig(index, &device, info, ts_ms, interval_ms, pods);
        }
        let Some(util) = required(device.utilization_rates(), &metrics, "util_gpu_pct")? else {
            return Ok(Vec::new());
        };
        let Some(memory) = required(device.memory_info(), &metrics, "mem_used_bytes")? else {
            return Ok(Vec::new());
        };
        let readings = read_gpu(&device, &metrics)?;
        let processes = optional(
            device.running_compute_processes(),
            &metrics,
            "process_count",
        )?;
        let lease_id = processes
            .as_ref()
            .and_then(|procs| procs.iter().find_map(|p| self.leases.lease_of(p.pid)));
        if let Some(procs) = &processes {
            self.device_pids
                .push((0, procs.iter().map(|p| p.pid).collect()));
        }
        let hold = pods.and_then(|pods| {
            pods.hold(&info.uuid, Some(index), |mig| {
                self.mig_parents.get(mig).cloned().flatten()
            })
        });
        let labels = hold.as_ref().map(|hold| hold.labels());
        let lease_id = lease_id
            .or_else(|| hold.and_then(|hold| hold.lease_id))
            .or_else(|| self.guest_lease.clone());
        let gpm = if self.has_gpm(index, &device, &info.uuid) {
            self.gpm_between(&info.uuid, device.gpm_sample())
        } else {
            Gpm::default()
        };

        let sample = Sample {
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
            power_w: readings.power_w,
            power_limit_w: readings.power_limit_w,
            energy_mj: readings.energy_mj,
            temp_c: readings.temp_c,
            sm_clock_mhz: readings.sm_clock_mhz,
            process_count: processes.map(|p| p.len() as u32),
            lease_id,
            mig_profile: None,
            labels,
            sm_active_pct: gpm.sm_active,
            sm_occupancy_pct: gpm.sm_occupancy,
            tensor_active_pct: gpm.tensor_active,
            dram_active_pct: gpm.dram_active,
            gr_active_pct: gpm.gr_active,
            mig_parent_uuid: None,
            mig_slices: None,
            mig_parent_slices: None,
            serving_requests: None,
        };
        Ok(vec![sample])
    }

    /// The samples of a GPU in MIG mode: one per MIG device, and one of the unsliced rest.
    fn sample_mig(
        &mut self,
        index: u32,
        device: &Device<'n>,
        info: DeviceInfo,
        ts_ms: i64,
        interval_ms: i64,
        pods: Option<&PodMap>,
    ) -> Result<Vec<Sample>, Lost> {
        let metrics = Arc::clone(&self.metrics);
        let memory = optional(device.memory_info(), &metrics, "mem_total_bytes")?;
        let readings = read_gpu(device, &metrics)?;
        let has_gpm = self.has_gpm(index, device, &info.uuid);
        let most = optional(device.mig_device_count(), &metrics, "mig_profile")?.unwrap_or(0);
        let mut slices = Vec::new();
        for mig_index in 0..most {
            let mig = match device.mig_device_by_index(mig_index) {
                Ok(mig) => mig,
                // No MIG device at this index: the layout has fewer.
                Err(NvmlError::NotFound) => continue,
                Err(NvmlError::GpuLost) => return Err(Lost),
                Err(e) => {
                    metrics.nvml_error("mig_profile");
                    tracing::debug!(gpu_uuid = %info.uuid, mig_index, error = %e, "NVML cannot open a MIG device");
                    continue;
                }
            };
            if let Some(slice) = self.read_slice(mig_index, &mig, device, has_gpm)? {
                slices.push(slice);
            }
        }
        let used: u32 = slices.iter().filter_map(|s| s.slices).sum();
        // Without the GPU's size, its MIG devices share it out among themselves.
        let total = self.mig_total(index, device).map_or(used, |t| t.max(used));
        let free = total - used;
        let total = (total > 0).then_some(total);

        // The GPU's power and energy, shared out by compute slices, the unsliced rest last.
        let sliced_memory: u64 = slices.iter().filter_map(|s| s.memory).map(|m| m.1).sum();
        let pieces: Vec<Option<u32>> = slices
            .iter()
            .map(|s| s.slices)
            .chain((free > 0).then_some(Some(free)))
            .collect();
        let shares = Shares::new(&pieces, total, readings);

        let mut out = Vec::with_capacity(pieces.len());
        for (n, slice) in slices.into_iter().enumerate() {
            let Some((mem_used_bytes, mem_total_bytes)) = slice.memory else {
                continue;
            };
            let busy = slice.processes.as_ref().is_some_and(|p| !p.is_empty());
            let lease_id = slice
                .processes
                .as_ref()
                .and_then(|procs| procs.iter().find_map(|p| self.leases.lease_of(p.pid)));
            if let Some(procs) = &slice.processes {
                self.device_pids
                    .push((out.len(), procs.iter().map(|p| p.pid).collect()));
            }
            let hold = pods.and_then(|pods| pods.hold_mig(&slice.uuid, Some(index), slice.index));
            let labels = hold.as_ref().map(|hold| hold.labels());
            let lease_id = lease_id
                .or_else(|| hold.and_then(|hold| hold.lease_id))
                .or_else(|| self.guest_lease.clone());
            let share = shares.piece(n);
            let sample = Sample {
                v: V1,
                ts_ms,
                interval_ms,
                host: self.host.clone(),
                gpu_uuid: slice.uuid,
                gpu_model: slice.model,
                // NVML has no utilization for a MIG device: its GPU instance's graphics
                // activity (DCGM's measure for MIG), else whether a process runs on it.
                util_gpu_pct: slice
                    .gpm
                    .gr_active
                    .unwrap_or(if busy { 100.0 } else { 0.0 }),
                mem_used_bytes: mem_used_bytes.min(mem_total_bytes),
                mem_total_bytes,
                gpu_index: Some(index),
                pci_bus_id: info.pci_bus_id.clone(),
                util_mem_pct: None,
                power_w: share.power_w,
                power_limit_w: share.power_limit_w,
                energy_mj: share.energy_mj,
                temp_c: readings.temp_c,
                sm_clock_mhz: readings.sm_clock_mhz,
                process_count: slice.processes.map(|p| p.len() as u32),
                lease_id,
                mig_profile: slice.profile,
                labels,
                sm_active_pct: slice.gpm.sm_active,
                sm_occupancy_pct: slice.gpm.sm_occupancy,
                tensor_active_pct: slice.gpm.tensor_active,
                dram_active_pct: slice.gpm.dram_active,
                gr_active_pct: slice.gpm.gr_active,
                mig_parent_uuid: Some(info.uuid.clone()),
                mig_slices: slice.slices,
                mig_parent_slices: total,
                serving_requests: None,
            };
            out.push(sample);
        }
        if free > 0 {
            let share = shares.piece(pieces.len() - 1);
            out.push(Sample {
                v: V1,
                ts_ms,
                interval_ms,
                host: self.host.clone(),
                gpu_uuid: info.uuid,
                gpu_model: info.model,
                util_gpu_pct: 0.0,
                mem_used_bytes: 0,
                mem_total_bytes: memory.map_or(0, |m| m.total.saturating_sub(sliced_memory)),
                gpu_index: Some(index),
                pci_bus_id: info.pci_bus_id,
                util_mem_pct: None,
                power_w: share.power_w,
                power_limit_w: share.power_limit_w,
                energy_mj: share.energy_mj,
                temp_c: readings.temp_c,
                sm_clock_mhz: readings.sm_clock_mhz,
                process_count: Some(0),
                lease_id: None,
                mig_profile: None,
                labels: None,
                sm_active_pct: None,
                sm_occupancy_pct: None,
                tensor_active_pct: None,
                dram_active_pct: None,
                gr_active_pct: None,
                mig_parent_uuid: None,
                mig_slices: Some(free),
                mig_parent_slices: total,
                serving_requests: None,
            });
        }
        Ok(out)
    }

    /// Reads one MIG device (`None`: its required fields are not readable this round).
    fn read_slice(
        &mut self,
        index: u32,
        mig: &Device<'n>,
        gpu: &Device<'n>,
        has_gpm: bool,
    ) -> Result<Option<Slice>, Lost> {
        let metrics = Arc::clone(&self.metrics);
        let uuid = required(mig.uuid(), &metrics, "gpu_uuid")?;
        let model = required(mig.name(), &metrics, "gpu_model")?;
        let (Some(uuid), Some(model)) = (uuid, model) else {
            return Ok(None);
        };
        let memory = required(mig.memory_info(), &metrics, "mem_used_bytes")?;
        self.seen.insert(uuid.clone());
        // NVML names a MIG device `<GPU's name> MIG <profile>`.
        let profile = model
            .rsplit_once(" MIG ")
            .map(|(_, profile)| profile.to_owned());
        let slices = optional(mig.attributes(), &metrics, "mig_slices")?
            .map(|a| a.compute_instance_slice_count)
            .filter(|&n| n > 0)
            .or_else(|| profile.as_deref().and_then(profile_slices));
        let processes = optional(mig.running_compute_processes(), &metrics, "process_count")?;
        if let Some(gi) = processes.iter().flatten().find_map(|p| p.gpu_instance_id) {
            self.gpu_instances.insert(uuid.clone(), gi);
        }
        let gpm = match self.gpu_instances.get(&uuid) {
            Some(&gi) if has_gpm => self.gpm_between(&uuid, gpu.gpm_mig_sample(gi)),
            _ => Gpm::default(),
        };
        Ok(Some(Slice {
            index,
            uuid,
            model,
            profile,
            slices,
            memory: memory.map(|m| (m.used, m.total)),
            processes,
            gpm,
        }))
    }

    /// The compute slices of GPU `index` in MIG mode: its largest GPU instance profile's, asked
    /// once. `None` when NVML tells no profile (logged once).
    fn mig_total(&mut self, index: u32, device: &Device<'_>) -> Option<u32> {
        if let Some(total) = self.mig_totals[index as usize] {
            return total;
        }
        let total = (0..GPU_INSTANCE_PROFILE_COUNT)
            .filter_map(|profile| device.profile_info(profile).ok())
            .map(|info| info.slice_count)
            .max();
        if total.is_none() {
            tracing::warn!(index, "NVML tells no GPU instance profile of a GPU in MIG mode: its MIG devices share it out among themselves, with no unsliced rest");
        }
        self.mig_totals[index as usize] = Some(total);
        total
    }

    /// Whether GPU `index` has GPM, asked once it answers; a GPU without it is logged once.
    fn has_gpm(&mut self, index: u32, device: &Device<'_>, uuid: &str) -> bool {
        if let Some(known) = self.gpm_support[index as usize] {
            return known;
        }
        let supported = match device.gpm_support() {
            Ok(supported) => supported,
            // A driver from before GPM, or a GPU that cannot say: as good as none.
            Err(NvmlError::FailedToLoadSymbol(_) | NvmlError::NotSupported) => false,
            Err(e) => {
                tracing::debug!(gpu_uuid = uuid, error = %e, "NVML cannot tell whether a GPU has GPM; asking again next round");
                return false;
            }
        };
        if !supported {
            tracing::info!(gpu_uuid = uuid, "GPU has no GPU performance metrics (GPM, Hopper and later): its samples carry no SM activity, and idleness is judged on utilization");
        }
        self.gpm_support[index as usize] = Some(supported);
        supported
    }

    /// The GPM measures between the previous GPM sample under `key` and `taken`, which becomes
    /// the previous one. Nothing on the first sample or on any failure, which is counted.
    fn gpm_between(&mut self, key: &str, taken: Result<GpmSample<'n>, NvmlError>) -> Gpm {
        let taken = match taken {
            Ok(taken) => taken,
            Err(e) => {
                self.metrics.nvml_error("sm_active_pct");
                tracing::trace!(key, error = %e, "NVML cannot take a GPM sample");
                self.gpm.remove(key);
                return Gpm::default();
            }
        };
        let Some(before) = self.gpm.insert(key.to_owned(), taken) else {
            return Gpm::default();
        };
        let now = &self.gpm[key];
        match gpm_metrics_get(self.nvml, &before, now, &GPM_METRICS) {
            Ok(results) => {
                let value = |i: usize| {
                    results
                        .get(i)
                        .and_then(|r| r.as_ref().ok())
                        .map(|m| m.value)
                        .filter(|v| v.is_finite())
                        .map(|v| v.clamp(0.0, 100.0))
                };
                Gpm {
                    sm_active: value(0),
                    sm_occupancy: value(1),
                    tensor_active: value(2),
                    dram_active: value(3),
                    gr_active: value(4),
                }
            }
            Err(e) => {
                self.metrics.nvml_error("sm_active_pct");
                tracing::trace!(key, error = %e, "NVML cannot compute GPM metrics");
                Gpm::default()
            }
        }
    }
}

/// Whether the GPU is in MIG mode; a GPU without MIG (or whose mode cannot be read) is not.
fn mig_enabled(device: &Device<'_>, metrics: &Metrics) -> Result<bool, Lost> {
    match device.mig_mode() {
        Ok(mode) => Ok(mode.current == MIG_ENABLED),
        Err(NvmlError::GpuLost) => Err(Lost),
        Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => Ok(false),
        Err(e) => {
            metrics.nvml_error("mig_profile");
            tracing::trace!(error = %e, "NVML cannot read a GPU's MIG mode");
            Ok(false)
        }
    }
}

/// The readings of a physical GPU other than utilization and memory.
fn read_gpu(device: &Device<'_>, metrics: &Metrics) -> Result<Readings, Lost> {
    Ok(Readings {
        power_w: optional(device.power_usage(), metrics, "power_w")?
            .map(|mw| f64::from(mw) / 1000.0),
        power_limit_w: optional(device.enforced_power_limit(), metrics, "power_limit_w")?
            .map(|mw| f64::from(mw) / 1000.0),
        energy_mj: optional(device.total_energy_consumption(), metrics, "energy_mj")?,
        temp_c: optional(
            device.temperature(TemperatureSensor::Gpu),
            metrics,
            "temp_c",
        )?
        .map(f64::from),
        sm_clock_mhz: optional(device.clock_info(Clock::SM), metrics, "sm_clock_mhz")?,
    })
}

/// The compute slices of a MIG profile's name: `1g.10gb` has 1, a compute instance
/// `2c.3g.20gb` 2.
fn profile_slices(profile: &str) -> Option<u32> {
    let first = profile.split('.').next()?;
    let count = first
        .strip_suffix('c')
        .or_else(|| first.strip_suffix('g'))?;
    count.parse().ok().filter(|&n| n > 0)
}

/// The power, power limit and energy of a GPU shared out among pieces of it by compute slices.
#[derive(Debug)]
struct Shares {
    pieces: Vec<Readings>,
}

impl Shares {
    /// Shares `readings` among pieces of `slices` each out of `total`. Energy, a counter, is
    /// shared so that the pieces add up to the GPU's to the millijoule (each piece takes the
    /// whole millijoules between its running share and the one before it). A piece or GPU of
    /// unknown size gets no share.
    fn new(slices: &[Option<u32>], total: Option<u32>, readings: Readings) -> Self {
        let mut before: u64 = 0;
        let pieces = slices
            .iter()
            .map(|&piece| {
                let (Some(piece), Some(total)) = (piece, total.filter(|&t| t > 0)) else {
                    return Readings::default();
                };
                // Multiplied first: a whole share of whole watts stays whole.
                let share = |value: f64| value * f64::from(piece) / f64::from(total);
                let upto = before + u64::from(piece);
                let energy_mj = readings.energy_mj.map(|e| {
                    let at = |slices: u64| {
                        (u128::from(e) * u128::from(slices) / u128::from(total)) as u64
                    };
                    at(upto) - at(before)
                });
                before = upto;
                Readings {
                    power_w: readings.power_w.map(share),
                    power_limit_w: readings.power_limit_w.map(share),
                    energy_mj,
                    ..readings
                }
            })
            .collect();
        Self { pieces }
    }

    fn piece(&self, n: usize) -> Readings {
        self.pieces.get(n).copied().unwrap_or_default()
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
    fn a_mig_profile_names_its_compute_slices() {
        assert_eq!(profile_slices("1g.10gb"), Some(1));
        assert_eq!(profile_slices("7g.80gb"), Some(7));
        assert_eq!(profile_slices("1g.10gb+me"), Some(1));
        assert_eq!(profile_slices("2c.3g.20gb"), Some(2), "a compute instance");
        for bad in ["", "g.10gb", "0g.5gb", "xg.5gb", "10gb"] {
            assert_eq!(profile_slices(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn power_and_energy_are_shared_by_slices_and_add_up() {
        let gpu = Readings {
            power_w: Some(700.0),
            power_limit_w: Some(700.0),
            energy_mj: Some(1_000_003),
            temp_c: Some(50.0),
            sm_clock_mhz: Some(1980),
        };
        let shares = Shares::new(&[Some(1), Some(2), Some(1), Some(3)], Some(7), gpu);
        let pieces: Vec<Readings> = (0..4).map(|n| shares.piece(n)).collect();
        let power: Vec<f64> = pieces.iter().map(|p| p.power_w.unwrap()).collect();
        assert_eq!(power, [100.0, 200.0, 100.0, 300.0]);
        assert_eq!(pieces[1].power_limit_w, Some(200.0));
        let energy: Vec<u64> = pieces.iter().map(|p| p.energy_mj.unwrap()).collect();
        assert_eq!(energy, [142_857, 285_715, 142_858, 428_573]);
        assert_eq!(energy.iter().sum::<u64>(), 1_000_003, "to the millijoule");
        assert_eq!(
            (pieces[3].temp_c, pieces[3].sm_clock_mhz),
            (Some(50.0), Some(1980)),
            "the GPU's temperature and clock are every slice's"
        );
        let unknown = Shares::new(&[Some(1), None], None, gpu);
        assert_eq!(unknown.piece(0).power_w, None, "no total, no share");
        assert_eq!(unknown.piece(0).temp_c, None);
        // A counter shared this way never runs backwards by more than a millijoule.
        let mut before = Shares::new(&[Some(3), Some(4)], Some(7), gpu);
        for energy in 1_000_004..1_000_100 {
            let now = Shares::new(
                &[Some(3), Some(4)],
                Some(7),
                Readings {
                    energy_mj: Some(energy),
                    ..gpu
                },
            );
            for n in 0..2 {
                let (was, is) = (
                    before.piece(n).energy_mj.unwrap(),
                    now.piece(n).energy_mj.unwrap(),
                );
                assert!(is + 1 >= was, "{was} then {is}");
            }
            before = now;
        }
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
