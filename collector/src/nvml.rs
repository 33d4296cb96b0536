//! The NVML source: reads every GPU of this host through `libnvidia-ml.so` (nvml-wrapper).
//!
//! NVML is used from one thread only (the sampling thread owns [`NvmlSource`]). A field a device
//! cannot report becomes null and is counted; a device that falls off the bus is logged once and
//! skipped while the others keep being sampled. The lease a GPU works for is found in the
//! environment of its compute processes (`GPUWARDEN_LEASE_ID`, read from `/proc`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpuwarden_schema::{Sample, V1};
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use thiserror::Error;

use crate::metrics::Metrics;

/// The environment variable that names a process's lease.
pub const LEASE_ENV: &str = "GPUWARDEN_LEASE_ID";

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
    /// Loads NVML from `library` (the system's `libnvidia-ml.so.1` when `None`).
    pub fn open(
        library: Option<&Path>,
        host: String,
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
            leases: LeaseFinder::new(PathBuf::from("/proc")),
        })
    }

    /// Number of devices NVML reported at start.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// One sample per device still on the bus, covering `[ts_ms - interval_ms, ts_ms)`.
    pub fn sample(&mut self, ts_ms: i64, interval_ms: i64) -> Vec<Sample> {
        let mut out = Vec::with_capacity(self.devices.len());
        for index in 0..self.devices.len() {
            if self.lost[index] {
                continue;
            }
            match self.sample_device(index as u32, ts_ms, interval_ms) {
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

    fn sample_device(
        &mut self,
        index: u32,
        ts_ms: i64,
        interval_ms: i64,
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
            labels: None,
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

/// Finds the lease of a process from `GPUWARDEN_LEASE_ID` in `/proc/<pid>/environ`, caching a
/// found lease per pid; a process whose environment cannot be read (another user's, gone) has none.
#[derive(Debug)]
pub struct LeaseFinder {
    proc_root: PathBuf,
    cache: HashMap<u32, String>,
    seen: Vec<u32>,
}

impl LeaseFinder {
    /// Reads process environments under `proc_root` (normally `/proc`).
    pub fn new(proc_root: PathBuf) -> Self {
        Self {
            proc_root,
            cache: HashMap::new(),
            seen: Vec::new(),
        }
    }

    /// The lease id in the environment of `pid`, if any.
    pub fn lease_of(&mut self, pid: u32) -> Option<String> {
        self.seen.push(pid);
        if let Some(hit) = self.cache.get(&pid) {
            return Some(hit.clone());
        }
        let lease = std::fs::read(self.proc_root.join(pid.to_string()).join("environ"))
            .ok()
            .and_then(|environ| lease_in_environ(&environ));
        // Only a found lease is cached: a process caught in the middle of exec shows an empty
        // environment for a moment, and must not stay lease-less for the rest of its life.
        if let Some(lease) = &lease {
            self.cache.insert(pid, lease.clone());
        }
        lease
    }

    /// Drops cached pids not looked up since the last call, so a reused pid is read afresh.
    pub fn forget_unseen(&mut self) {
        let seen = std::mem::take(&mut self.seen);
        self.cache.retain(|pid, _| seen.contains(pid));
    }
}

fn lease_in_environ(environ: &[u8]) -> Option<String> {
    let prefix = format!("{LEASE_ENV}=");
    environ
        .split(|b| *b == 0)
        .find_map(|var| var.strip_prefix(prefix.as_bytes()))
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_is_read_from_the_process_environment() {
        assert_eq!(
            lease_in_environ(b"PATH=/bin\0GPUWARDEN_LEASE_ID=l-42\0HOME=/root\0"),
            Some("l-42".into())
        );
        assert_eq!(
            lease_in_environ(b"PATH=/bin\0GPUWARDEN_LEASE_IDX=no\0"),
            None
        );
        assert_eq!(lease_in_environ(b"GPUWARDEN_LEASE_ID=\0"), None);
        assert_eq!(lease_in_environ(b""), None);
    }

    #[test]
    fn unreadable_or_missing_processes_have_no_lease() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("7")).unwrap();
        std::fs::write(dir.path().join("7/environ"), b"GPUWARDEN_LEASE_ID=l-7\0").unwrap();
        let mut finder = LeaseFinder::new(dir.path().to_path_buf());
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
    fn the_running_process_lease_is_found_through_real_proc() {
        // This test process has no lease; its own environ is readable.
        let mut finder = LeaseFinder::new(PathBuf::from("/proc"));
        assert_eq!(finder.lease_of(std::process::id()), None);
    }
}
