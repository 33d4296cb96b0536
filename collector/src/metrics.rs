//! The collector's Prometheus metrics: the GPU gauges under dcgm-exporter's names, units and
//! labels (so existing DCGM dashboards work unchanged), and the collector's own
//! `gpuwarden_collector_*` counters. Everything is rendered by hand in the text exposition format:
//! the names are the contract, so they are spelled out here rather than built by a library.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

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
#[derive(Debug, Default)]
pub struct Metrics {
    samples_taken: AtomicU64,
    samples_published: AtomicU64,
    dropped: Mutex<BTreeMap<DropReason, u64>>,
    nvml_errors: Mutex<BTreeMap<&'static str, u64>>,
    devices_lost: AtomicU64,
    buffer_bytes: AtomicU64,
    buffer_samples: AtomicU64,
    latency: Mutex<Histogram>,
    latest: RwLock<Vec<Sample>>,
}

#[derive(Debug, Default)]
struct Histogram {
    buckets: [u64; LATENCY_BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Metrics {
    /// Counts samples read from the source.
    pub fn sampled(&self, n: usize) {
        self.samples_taken.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Counts samples Kafka acknowledged, with how long each waited since it was taken.
    pub fn published(&self, latency: Duration) {
        self.samples_published.fetch_add(1, Ordering::Relaxed);
        let secs = latency.as_secs_f64();
        let mut h = self.latency.lock().unwrap_or_else(|e| e.into_inner());
        for (i, bound) in LATENCY_BUCKETS.iter().enumerate() {
            if secs <= *bound {
                h.buckets[i] += 1;
            }
        }
        h.count += 1;
        h.sum += secs;
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

    /// Sets the buffer gauges.
    pub fn buffer(&self, bytes: usize, samples: usize) {
        self.buffer_bytes.store(bytes as u64, Ordering::Relaxed);
        self.buffer_samples.store(samples as u64, Ordering::Relaxed);
    }

    /// Remembers the newest sample of each GPU for the dcgm gauges.
    pub fn set_latest(&self, samples: &[Sample]) {
        *self.latest.write().unwrap_or_else(|e| e.into_inner()) = samples.to_vec();
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
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        };
        counter(
            &mut out,
            "gpuwarden_collector_samples_total",
            "Samples read from the GPU source.",
            self.samples_taken.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "gpuwarden_collector_samples_published_total",
            "Samples acknowledged by Kafka.",
            self.published_total(),
        );
        counter(
            &mut out,
            "gpuwarden_collector_devices_lost_total",
            "GPUs that fell off the bus and are no longer sampled.",
            self.devices_lost.load(Ordering::Relaxed),
        );

        let _ = writeln!(out, "# HELP gpuwarden_collector_samples_dropped_total Samples dropped instead of published, by reason.");
        let _ = writeln!(
            out,
            "# TYPE gpuwarden_collector_samples_dropped_total counter"
        );
        let dropped = self
            .dropped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for reason in [
            DropReason::BufferFull,
            DropReason::BufferAge,
            DropReason::Undeliverable,
        ] {
            let n = dropped.get(&reason).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "gpuwarden_collector_samples_dropped_total{{reason=\"{}\"}} {n}",
                reason.label()
            );
        }

        let _ = writeln!(out, "# HELP gpuwarden_collector_nvml_errors_total NVML calls that failed, by the sample field they fill.");
        let _ = writeln!(out, "# TYPE gpuwarden_collector_nvml_errors_total counter");
        for (field, n) in self
            .nvml_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "gpuwarden_collector_nvml_errors_total{{field=\"{field}\"}} {n}"
            );
        }

        let gauge = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        };
        gauge(
            &mut out,
            "gpuwarden_collector_buffer_bytes",
            "Bytes of samples waiting for Kafka.",
            self.buffer_bytes.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "gpuwarden_collector_buffer_samples",
            "Samples waiting for Kafka.",
            self.buffer_samples.load(Ordering::Relaxed),
        );

        let h = self.latency.lock().unwrap_or_else(|e| e.into_inner());
        let name = "gpuwarden_collector_publish_latency_seconds";
        let _ = writeln!(out, "# HELP {name} Time from taking a sample to Kafka acknowledging it.\n# TYPE {name} histogram");
        for (bound, n) in LATENCY_BUCKETS.iter().zip(h.buckets) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            h.count, h.sum, h.count
        );
        out
    }

    /// The GPU gauges of the newest samples, under dcgm-exporter's names and labels.
    pub fn render_gpus(&self) -> String {
        let latest = self.latest.read().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        type Get = fn(&Sample) -> Option<f64>;
        let families: [(&str, &str, &str, Get); 9] = [
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
        ];
        for (name, kind, help, get) in families {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for sample in latest.iter() {
                if let Some(value) = get(sample) {
                    let _ = writeln!(out, "{name}{{{}}} {value}", labels(sample));
                }
            }
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

fn mib(bytes: u64) -> f64 {
    (bytes / (1 << 20)) as f64
}

/// dcgm-exporter's label set: gpu, UUID, pci_bus_id, device, modelName, Hostname; plus lease_id
/// when the GPU's lease is known.
fn labels(s: &Sample) -> String {
    let index = s.gpu_index.map(|i| i.to_string()).unwrap_or_default();
    let mut out = format!(
        "gpu=\"{index}\",UUID=\"{}\",pci_bus_id=\"{}\",device=\"nvidia{index}\",modelName=\"{}\",Hostname=\"{}\"",
        escape(&s.gpu_uuid),
        escape(s.pci_bus_id.as_deref().unwrap_or("")),
        escape(&s.gpu_model),
        escape(&s.host),
    );
    if let Some(lease) = &s.lease_id {
        let _ = write!(out, ",lease_id=\"{}\"", escape(lease));
    }
    out
}

fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
