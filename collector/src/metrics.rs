//! The collector's Prometheus metrics: the GPU gauges under dcgm-exporter's names, units and
//! labels (so existing DCGM dashboards work unchanged), GPM's measures among them as
//! dcgm-exporter's profiling ratios, and the collector's own `gpuwarden_collector_*` counters.
//! Everything is rendered by hand in the text exposition format: the names are the contract, so
//! they are spelled out here rather than built by a library.
//!
//! A MIG device's series are labelled as dcgm-exporter labels a GPU instance's: its GPU's
//! `gpu`, `UUID`, `device` and `modelName`, with `GPU_I_PROFILE` and `GPU_I_ID` (the latter
//! once NVML told it), and gpuwarden's own `mig_uuid`, which keeps apart the MIG devices whose
//! GPU instance is not known yet. A GPU's unsliced rest is labelled as the GPU.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use gpuwarden_schema::prom::{escape, family, Histogram};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

use gpuwarden_schema::sample::{CONTAINER_LABEL, NAMESPACE_LABEL, POD_LABEL};
use gpuwarden_schema::Sample;

/// Why samples were dropped instead of published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DropReason {
    /// The buffer held more bytes than `collector.buffer_max_bytes`.
    BufferFull,
    /// A sample waited longer than `collector.buffer_max_age`.
    BufferAge,
    /// Kafka refused the message for good (e.g. too large), or shutdown came before delivery.
    Undeliverable,
}

impl DropReason {
    fn label(self) -> &'static str {
        match self {
            Self::BufferFull => "buffer_full",
            Self::BufferAge => "buffer_age",
            Self::Undeliverable => "undeliverable",
        }
    }
}

/// Upper bounds of the publish latency histogram, seconds.
const LATENCY_BUCKETS: [f64; 10] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0];

/// Counters and gauges shared by the sampling thread, the sink and the `/metrics` handler.
#[derive(Debug)]
pub struct Metrics {
    samples_taken: AtomicU64,
    samples_published: AtomicU64,
    dropped: Mutex<BTreeMap<DropReason, u64>>,
    nvml_errors: Mutex<BTreeMap<&'static str, u64>>,
    devices_lost: AtomicU64,
    podresources_errors: AtomicU64,
    buffer_bytes: AtomicU64,
    buffer_samples: AtomicU64,
    in_flight_samples: AtomicU64,
    latency: Mutex<Histogram>,
    latest: RwLock<Vec<Sample>>,
    gpu_instances: RwLock<HashMap<String, u32>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            samples_taken: AtomicU64::default(),
            samples_published: AtomicU64::default(),
            dropped: Mutex::default(),
            nvml_errors: Mutex::default(),
            devices_lost: AtomicU64::default(),
            podresources_errors: AtomicU64::default(),
            buffer_bytes: AtomicU64::default(),
            buffer_samples: AtomicU64::default(),
            in_flight_samples: AtomicU64::default(),
            latency: Mutex::new(Histogram::new(&LATENCY_BUCKETS)),
            latest: RwLock::default(),
            gpu_instances: RwLock::default(),
        }
    }
}

impl Metrics {
    /// Counts samples read from the source.
    pub fn sampled(&self, n: usize) {
        self.samples_taken.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Counts samples Kafka acknowledged, with how long each waited since it was taken.
    pub fn published(&self, latency: Duration) {
        self.samples_published.fetch_add(1, Ordering::Relaxed);
        self.latency
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(latency.as_secs_f64());
    }

    /// Counts dropped samples.
    pub fn dropped(&self, reason: DropReason, n: u64) {
        *self
            .dropped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(reason)
            .or_default() += n;
    }

    /// Counts an NVML call that failed for `field` (the Sample field it would have filled).
    pub fn nvml_error(&self, field: &'static str) {
        *self
            .nvml_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(field)
            .or_default() += 1;
    }

    /// Counts a device that fell off the bus.
    pub fn device_lost(&self) {
        self.devices_lost.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a lookup of the kubelet's PodResources API that failed (unreachable, error, or
    /// too slow).
    pub fn podresources_error(&self) {
        self.podresources_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Failed PodResources lookups so far.
    pub fn podresources_errors_total(&self) -> u64 {
        self.podresources_errors.load(Ordering::Relaxed)
    }

    /// Sets the buffer gauges.
    pub fn buffer(&self, bytes: usize, samples: usize, in_flight: usize) {
        self.buffer_bytes.store(bytes as u64, Ordering::Relaxed);
        self.buffer_samples.store(samples as u64, Ordering::Relaxed);
        self.in_flight_samples
            .store(in_flight as u64, Ordering::Relaxed);
    }

    /// Remembers the newest sample of each GPU for the dcgm gauges.
    pub fn set_latest(&self, samples: &[Sample]) {
        *self.latest.write().unwrap_or_else(|e| e.into_inner()) = samples.to_vec();
    }

    /// Remembers the GPU instance of each MIG device UUID, for its series' `GPU_I_ID`.
    pub fn set_gpu_instances(&self, gpu_instances: HashMap<String, u32>) {
        *self
            .gpu_instances
            .write()
            .unwrap_or_else(|e| e.into_inner()) = gpu_instances;
    }

    /// Samples published so far.
    pub fn published_total(&self) -> u64 {
        self.samples_published.load(Ordering::Relaxed)
    }

    /// Samples dropped so far, all reasons.
    pub fn dropped_total(&self) -> u64 {
        self.dropped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .sum()
    }

    /// NVML errors counted for `field`.
    pub fn nvml_errors_for(&self, field: &str) -> u64 {
        let errors = self.nvml_errors.lock().unwrap_or_else(|e| e.into_inner());
        errors
            .iter()
            .filter(|(f, _)| **f == field)
            .map(|(_, n)| *n)
            .sum()
    }

    /// The collector's own metrics only (`gpuwarden_collector_*`).
    pub fn render_own(&self) -> String {
        let mut out = String::new();
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed) as f64;
        family(
            &mut out,
            "gpuwarden_collector_samples_total",
            "counter",
            "Samples read from the GPU source.",
            [("", load(&self.samples_taken))],
        );
        family(
            &mut out,
            "gpuwarden_collector_samples_published_total",
            "counter",
            "Samples acknowledged by Kafka.",
            [("", load(&self.samples_published))],
        );
        family(
            &mut out,
            "gpuwarden_collector_devices_lost_total",
            "counter",
            "GPUs that fell off the bus and are no longer sampled.",
            [("", load(&self.devices_lost))],
        );
        family(
            &mut out,
            "gpuwarden_collector_podresources_errors_total",
            "counter",
            "Lookups of the kubelet's PodResources API that failed or timed out; GPUs are sampled without their pods meanwhile.",
            [("", load(&self.podresources_errors))],
        );
        let dropped = self
            .dropped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let dropped: Vec<(String, f64)> = [
            DropReason::BufferFull,
            DropReason::BufferAge,
            DropReason::Undeliverable,
        ]
        .into_iter()
        .map(|r| {
            (
                format!("reason=\"{}\"", r.label()),
                dropped.get(&r).copied().unwrap_or(0) as f64,
            )
        })
        .collect();
        family(
            &mut out,
            "gpuwarden_collector_samples_dropped_total",
            "counter",
            "Samples dropped instead of published, by reason.",
            dropped.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        let errors: Vec<(String, f64)> = self
            .nvml_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(f, n)| (format!("field=\"{f}\""), *n as f64))
            .collect();
        family(
            &mut out,
            "gpuwarden_collector_nvml_errors_total",
            "counter",
            "NVML calls that failed, by the sample field they fill.",
            errors.iter().map(|(l, v)| (l.as_str(), *v)),
        );
        family(
            &mut out,
            "gpuwarden_collector_buffer_bytes",
            "gauge",
            "Bytes of samples waiting for Kafka.",
            [("", load(&self.buffer_bytes))],
        );
        family(
            &mut out,
            "gpuwarden_collector_buffer_samples",
            "gauge",
            "Samples waiting for Kafka.",
            [("", load(&self.buffer_samples))],
        );
        family(
            &mut out,
            "gpuwarden_collector_in_flight_samples",
            "gauge",
            "Samples handed to the Kafka producer and not yet acknowledged by the brokers (retried by it while they are away).",
            [("", load(&self.in_flight_samples))],
        );
        gpuwarden_schema::kafka::broker_errors().render(&mut out);
        self.latency
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .render(
                &mut out,
                "gpuwarden_collector_publish_latency_seconds",
                "Time from taking a sample to Kafka acknowledging it.",
            );
        out
    }

    /// The GPU gauges of the newest samples, under dcgm-exporter's names and labels.
    pub fn render_gpus(&self) -> String {
        let latest = self.latest.read().unwrap_or_else(|e| e.into_inner());
        let instances = self.gpu_instances.read().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        type Get = fn(&Sample) -> Option<f64>;
        let families: [(&str, &str, &str, Get); 14] = [
            (
                "DCGM_FI_DEV_SM_CLOCK",
                "gauge",
                "SM clock frequency (in MHz).",
                |s| s.sm_clock_mhz.map(f64::from),
            ),
            (
                "DCGM_FI_DEV_GPU_TEMP",
                "gauge",
                "GPU temperature (in C).",
                |s| s.temp_c,
            ),
            (
                "DCGM_FI_DEV_POWER_USAGE",
                "gauge",
                "Power draw (in W).",
                |s| s.power_w,
            ),
            (
                "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                "counter",
                "Total energy consumption since boot (in mJ).",
                |s| s.energy_mj.map(|e| e as f64),
            ),
            (
                "DCGM_FI_DEV_GPU_UTIL",
                "gauge",
                "GPU utilization (in %).",
                |s| Some(s.util_gpu_pct),
            ),
            (
                "DCGM_FI_DEV_MEM_COPY_UTIL",
                "gauge",
                "Memory utilization (in %).",
                |s| s.util_mem_pct,
            ),
            (
                "DCGM_FI_DEV_FB_FREE",
                "gauge",
                "Frame buffer memory free (in MB).",
                |s| Some(mib(s.mem_total_bytes - s.mem_used_bytes)),
            ),
            (
                "DCGM_FI_DEV_FB_USED",
                "gauge",
                "Frame buffer memory used (in MB).",
                |s| Some(mib(s.mem_used_bytes)),
            ),
            (
                "DCGM_FI_DEV_POWER_MGMT_LIMIT",
                "gauge",
                "Power management limit (in W).",
                |s| s.power_limit_w,
            ),
            (
                "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                "gauge",
                "Ratio of time the graphics engine is active.",
                |s| ratio(s.gr_active_pct),
            ),
            (
                "DCGM_FI_PROF_SM_ACTIVE",
                "gauge",
                "The ratio of cycles an SM has at least 1 warp assigned.",
                |s| ratio(s.sm_active_pct),
            ),
            (
                "DCGM_FI_PROF_SM_OCCUPANCY",
                "gauge",
                "The ratio of number of warps resident on an SM.",
                |s| ratio(s.sm_occupancy_pct),
            ),
            (
                "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
                "gauge",
                "Ratio of cycles the tensor (HMMA) pipe is active.",
                |s| ratio(s.tensor_active_pct),
            ),
            (
                "DCGM_FI_PROF_DRAM_ACTIVE",
                "gauge",
                "Ratio of cycles the device memory interface is active sending or receiving data.",
                |s| ratio(s.dram_active_pct),
            ),
        ];
        for (name, kind, help, get) in families {
            let lines: Vec<(String, f64)> = latest
                .iter()
                .filter_map(|s| get(s).map(|v| (labels(s, &instances), v)))
                .collect();
            family(
                &mut out,
                name,
                kind,
                help,
                lines.iter().map(|(l, v)| (l.as_str(), *v)),
            );
        }
        out
    }

    /// Everything `/metrics` serves.
    pub fn render(&self) -> String {
        let mut out = self.render_gpus();
        out.push_str(&self.render_own());
        out
    }
}

/// A GPM percentage as dcgm-exporter's profiling ratio (0..1).
fn ratio(pct: Option<f64>) -> Option<f64> {
    pct.map(|p| p / 100.0)
}

fn mib(bytes: u64) -> f64 {
    (bytes / (1 << 20)) as f64
}

/// dcgm-exporter's label set: gpu, UUID, pci_bus_id, device, modelName, for a MIG device its
/// GPU's with GPU_I_PROFILE and GPU_I_ID, Hostname; container, namespace and pod when a pod
/// holds the GPU (dcgm-exporter's names, from the sample's `k8s_*` labels); plus mig_uuid for a
/// MIG device and lease_id when the GPU's lease is known.
fn labels(s: &Sample, gpu_instances: &HashMap<String, u32>) -> String {
    let index = s.gpu_index.map(|i| i.to_string()).unwrap_or_default();
    let (uuid, model) = match &s.mig_parent_uuid {
        // NVML names a MIG device `<GPU's name> MIG <profile>`; DCGM names it as its GPU.
        Some(parent) => (
            parent.as_str(),
            s.gpu_model
                .rsplit_once(" MIG ")
                .map_or(s.gpu_model.as_str(), |(gpu, _)| gpu),
        ),
        None => (s.gpu_uuid.as_str(), s.gpu_model.as_str()),
    };
    let mut out = format!(
        "gpu=\"{index}\",UUID=\"{}\",pci_bus_id=\"{}\",device=\"nvidia{index}\",modelName=\"{}\"",
        escape(uuid),
        escape(s.pci_bus_id.as_deref().unwrap_or("")),
        escape(model),
    );
    if s.mig_parent_uuid.is_some() {
        let profile = s.mig_profile.as_deref().unwrap_or("");
        let _ = write!(out, ",GPU_I_PROFILE=\"{}\"", escape(profile));
        if let Some(gi) = gpu_instances.get(&s.gpu_uuid) {
            let _ = write!(out, ",GPU_I_ID=\"{gi}\"");
        }
    }
    let _ = write!(out, ",Hostname=\"{}\"", escape(&s.host));
    if let Some(labels) = &s.labels {
        for (key, name) in [
            (CONTAINER_LABEL, "container"),
            (NAMESPACE_LABEL, "namespace"),
            (POD_LABEL, "pod"),
        ] {
            if let Some(value) = labels.get(key) {
                let _ = write!(out, ",{name}=\"{}\"", escape(value));
            }
        }
    }
    if s.mig_parent_uuid.is_some() {
        let _ = write!(out, ",mig_uuid=\"{}\"", escape(&s.gpu_uuid));
    }
    if let Some(lease) = &s.lease_id {
        let _ = write!(out, ",lease_id=\"{}\"", escape(lease));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuwarden_schema::V1;

    fn sample(uuid: &str, index: u32, labels: Option<&[(&str, &str)]>) -> Sample {
        Sample {
            v: V1,
            ts_ms: 1_000,
            interval_ms: 5_000,
            host: "node-1".into(),
            gpu_uuid: uuid.into(),
            gpu_model: "NVIDIA H100 80GB HBM3".into(),
            util_gpu_pct: 87.0,
            mem_used_bytes: 1 << 30,
            mem_total_bytes: 80 << 30,
            gpu_index: Some(index),
            pci_bus_id: Some("00000000:17:00.0".into()),
            util_mem_pct: None,
            power_w: None,
            power_limit_w: None,
            energy_mj: None,
            temp_c: None,
            sm_clock_mhz: None,
            process_count: None,
            lease_id: labels.map(|_| "k8s-0f3c".into()),
            mig_profile: None,
            labels: labels.map(|l| {
                l.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect()
            }),
            sm_active_pct: None,
            sm_occupancy_pct: None,
            tensor_active_pct: None,
            dram_active_pct: None,
            gr_active_pct: None,
            mig_parent_uuid: None,
            mig_slices: None,
            mig_parent_slices: None,
            serving_requests: None,
        }
    }

    #[test]
    fn gpu_series_of_a_pod_carry_dcgm_exporters_pod_labels() {
        let metrics = Metrics::default();
        metrics.set_latest(&[
            sample(
                "GPU-a",
                0,
                Some(&[
                    ("k8s_namespace", "ml"),
                    ("k8s_pod", "train-0"),
                    ("k8s_container", "trainer"),
                    ("slurm_job_id", "ignored"),
                ]),
            ),
            sample(
                "GPU-b",
                1,
                Some(&[("k8s_namespace", "ml"), ("k8s_pod", "infer-\"2\"")]),
            ),
            sample("GPU-c", 2, None),
        ]);
        let text = metrics.render_gpus();
        let util: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("DCGM_FI_DEV_GPU_UTIL{"))
            .collect();
        assert_eq!(
            util,
            [
                "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\",pci_bus_id=\"00000000:17:00.0\",device=\"nvidia0\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"node-1\",container=\"trainer\",namespace=\"ml\",pod=\"train-0\",lease_id=\"k8s-0f3c\"} 87",
                "DCGM_FI_DEV_GPU_UTIL{gpu=\"1\",UUID=\"GPU-b\",pci_bus_id=\"00000000:17:00.0\",device=\"nvidia1\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"node-1\",namespace=\"ml\",pod=\"infer-\\\"2\\\"\",lease_id=\"k8s-0f3c\"} 87",
                "DCGM_FI_DEV_GPU_UTIL{gpu=\"2\",UUID=\"GPU-c\",pci_bus_id=\"00000000:17:00.0\",device=\"nvidia2\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"node-1\"} 87",
            ]
        );
        assert!(
            text.lines()
                .filter(|l| l.starts_with("DCGM_FI_DEV_FB_USED{gpu=\"0\""))
                .all(|l| l.contains(",container=\"trainer\",namespace=\"ml\",pod=\"train-0\",")),
            "every GPU family carries them"
        );
        assert!(!text.contains("slurm_job_id"));
        assert!(!text.contains("pod_uid"));
    }

    #[test]
    fn a_mig_device_is_labelled_as_dcgm_exporter_labels_a_gpu_instance() {
        let metrics = Metrics::default();
        let slice = |uuid: &str| Sample {
            gpu_model: "NVIDIA H100 80GB HBM3 MIG 1g.10gb".into(),
            mig_parent_uuid: Some("GPU-a".into()),
            mig_profile: Some("1g.10gb".into()),
            mig_slices: Some(1),
            mig_parent_slices: Some(7),
            sm_active_pct: Some(2.5),
            gr_active_pct: Some(40.0),
            ..sample(uuid, 3, None)
        };
        metrics.set_latest(&[slice("MIG-1"), slice("MIG-2"), sample("GPU-b", 4, None)]);
        metrics.set_gpu_instances(HashMap::from([("MIG-1".to_owned(), 9)]));
        let text = metrics.render_gpus();
        let family = |name: &str| -> Vec<&str> {
            text.lines()
                .filter(|l| l.starts_with(&format!("{name}{{")))
                .collect()
        };
        assert_eq!(
            family("DCGM_FI_PROF_SM_ACTIVE"),
            [
                "DCGM_FI_PROF_SM_ACTIVE{gpu=\"3\",UUID=\"GPU-a\",pci_bus_id=\"00000000:17:00.0\",device=\"nvidia3\",modelName=\"NVIDIA H100 80GB HBM3\",GPU_I_PROFILE=\"1g.10gb\",GPU_I_ID=\"9\",Hostname=\"node-1\",mig_uuid=\"MIG-1\"} 0.025",
                "DCGM_FI_PROF_SM_ACTIVE{gpu=\"3\",UUID=\"GPU-a\",pci_bus_id=\"00000000:17:00.0\",device=\"nvidia3\",modelName=\"NVIDIA H100 80GB HBM3\",GPU_I_PROFILE=\"1g.10gb\",Hostname=\"node-1\",mig_uuid=\"MIG-2\"} 0.025",
            ],
            "GPM percentages as ratios; a GPU instance not known yet has no GPU_I_ID"
        );
        assert_eq!(family("DCGM_FI_PROF_GR_ENGINE_ACTIVE").len(), 2);
        assert!(family("DCGM_FI_PROF_DRAM_ACTIVE").is_empty());
        assert!(text.contains("# TYPE DCGM_FI_PROF_DRAM_ACTIVE gauge\n"));
        assert_eq!(
            family("DCGM_FI_DEV_GPU_UTIL")[2],
            "DCGM_FI_DEV_GPU_UTIL{gpu=\"4\",UUID=\"GPU-b\",pci_bus_id=\"00000000:17:00.0\",device=\"nvidia4\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"node-1\"} 87",
            "a whole GPU as before"
        );
    }
}
