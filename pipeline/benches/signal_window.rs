//! Benchmark: what the signals' hot window holds and what a computation costs, bucketed
//! (`HotWindow` + `SignalEngine::signals`, per GPU and minute) against the raw-sample engine it
//! replaced (sealed Arrow batches + DataFusion SQL, kept in `tests/reference/old_signals.rs`).
//!
//! A simulated fleet of `GPUS` GPUs (default 10,000) sampled every 5 s fills a `MINUTES`-minute
//! window (default 15); then for `PERIODS` periods of 30 s, 30 s of samples are added and signals
//! computed, as the signals loop does. Nine GPUs in ten are held by 4-GPU leases; a fifth of the
//! samples name their lease; one sample in fifty is delivered twice. Reports samples and bytes
//! held per GPU-minute, the process's resident memory growth, and compute time per period.
//!
//! Run each side in its own process (the resident memory is the process's):
//! `cargo bench -p gpuwarden-pipeline --bench signal_window -- new` (or `old`);
//! `GPUS=2000 MINUTES=5 …` for a smaller fleet.

#[path = "../tests/reference/old_signals.rs"]
mod old_signals;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use gpuwarden_pipeline::bounds::Bounds;
use gpuwarden_pipeline::hot::HotWindow;
use gpuwarden_pipeline::rollup::leases::Leases;
use gpuwarden_pipeline::signals::{Inputs, Period, SignalEngine};
use gpuwarden_schema::config::PricingConfig;
use gpuwarden_schema::sample_row::{SampleBuilder, SampleRow};
use gpuwarden_schema::{LeaseEvent, Record};
use old_signals::OldEngine;

const T0: i64 = 1_795_996_800_000;
const SAMPLE_MS: i64 = 5_000;
const EVERY_MS: i64 = 30_000;

fn env(name: &str, default: i64) -> i64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// The fleet: GPU i's lease (every 4 GPUs one lease, the last tenth unleased).
struct Fleet {
    gpus: usize,
}

impl Fleet {
    fn lease_of(&self, gpu: usize) -> Option<usize> {
        (gpu < self.gpus * 9 / 10).then_some(gpu / 4)
    }

    fn leases(&self) -> Leases {
        let mut events = Vec::new();
        let mut gpu = 0;
        while let Some(lease) = self.lease_of(gpu) {
            let held: Vec<String> = (gpu..gpu + 4)
                .filter(|g| self.lease_of(*g) == Some(lease))
                .map(|g| format!("GPU-{g:08}"))
                .collect();
            let json = serde_json::json!({"v": 1, "ts_ms": T0 - 3_600_000, "event": "granted",
                "lease_id": format!("L{lease}"), "team": format!("t{}", lease % 20), "user": "u",
                "project": "p", "workload": "training", "substrate": "sim",
                "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": held.len(), "gpu_uuids": held});
            events.push(LeaseEvent::from_json(json.to_string().as_bytes()).unwrap());
            gpu += 4;
        }
        Leases::from_events(events)
    }

    /// The samples of every GPU at `ts` (with a few copies), as the collectors send them.
    fn samples(&self, ts: i64, out: &mut Vec<Vec<u8>>) {
        for gpu in 0..self.gpus {
            let lease = self.lease_of(gpu);
            // Deterministic and varied: some GPUs idle, some busy, some in between.
            let util = ((gpu as i64 * 37 + ts / SAMPLE_MS * 11) % 100) as f64;
            let util = if gpu % 7 == 0 { util / 30.0 } else { util };
            let named = lease.filter(|_| (ts / SAMPLE_MS + gpu as i64) % 5 == 0);
            let json = serde_json::json!({"v": 1, "ts_ms": ts, "interval_ms": SAMPLE_MS,
                "host": format!("node-{:05}", gpu / 8), "gpu_uuid": format!("GPU-{gpu:08}"),
                "gpu_model": "NVIDIA H100 80GB HBM3", "util_gpu_pct": util,
                "mem_used_bytes": 1_000_000 + gpu as u64 * 3 + (ts % 1000) as u64,
                "mem_total_bytes": 80_000_000_000u64, "gpu_index": gpu % 8,
                "sm_active_pct": util * 0.8,
                "power_w": 300.5, "temp_c": 55.0,
                "lease_id": named.map(|l| format!("L{l}"))})
            .to_string()
            .into_bytes();
            if (ts / SAMPLE_MS + gpu as i64) % 50 == 0 {
                out.push(json.clone());
            }
            out.push(json);
        }
    }
}

fn pricing() -> PricingConfig {
    PricingConfig {
        idle_util_pct: 5.0,
        ..PricingConfig::default()
    }
}

/// What one side measured.
struct Figures {
    samples_held: usize,
    bytes_held: usize,
    rss_growth: u64,
    compute: Vec<Duration>,
    signals: usize,
}

fn new_side(fleet: &Fleet, minutes: i64, periods: i64) -> Figures {
    let window_ms = minutes * 60_000;
    let leases = fleet.leases();
    let mut window = HotWindow::new(EVERY_MS, window_ms, 300_000, Bounds::none());
    // The lease events, as the loop reads them.
    for lease in leases.iter() {
        let mut e = lease.identity.clone();
        e.ts_ms = lease.granted_at;
        window
            .add_lease_event(&e.to_json(), lease.granted_at)
            .unwrap();
    }
    let (spend, pricing, measures) = (BTreeMap::new(), pricing(), BTreeMap::new());
    let mut engine = SignalEngine::new();
    let before = rss_bytes();
    let mut payloads = Vec::new();
    let (mut compute, mut signals) = (Vec::new(), 0);
    let mut ts = T0;
    let end = T0 + window_ms + periods * EVERY_MS;
    while ts <= end {
        payloads.clear();
        fleet.samples(ts, &mut payloads);
        for p in &payloads {
            window.add_sample(p, ts).unwrap();
        }
        if let Some(due) = window.due() {
            if due >= T0 + window_ms {
                let (samples, leases) = window.parts();
                let started = Instant::now();
                let out = engine.signals(
                    samples,
                    &Period {
                        ts_ms: due,
                        window_ms,
                        leases,
                        month_to_date_usd: &spend,
                        pricing: &pricing,
                        idle_measures: &measures,
                        release_grace_ms: EVERY_MS,
                    },
                );
                compute.push(started.elapsed());
                signals = out.len();
            }
            window.computed(due);
        }
        ts += SAMPLE_MS;
    }
    Figures {
        samples_held: window.len(),
        bytes_held: window.samples().bytes(),
        rss_growth: rss_bytes().saturating_sub(before),
        compute,
        signals,
    }
}

fn old_side(fleet: &Fleet, minutes: i64, periods: i64) -> Figures {
    let window_ms = minutes * 60_000;
    let leases = fleet.leases();
    let (spend, pricing, measures) = (BTreeMap::new(), pricing(), BTreeMap::new());
    let mut engine = OldEngine::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let before = rss_bytes();
    // As the old hot window: rows sealed into batches of 8,192, batches dropped whole once no
    // later window can use them.
    let mut open = SampleBuilder::default();
    let mut open_max = i64::MIN;
    let mut sealed: Vec<(i64, RecordBatch)> = Vec::new();
    let mut payloads = Vec::new();
    let (mut compute, mut signals) = (Vec::new(), 0);
    let mut ts = T0;
    let end = T0 + window_ms + periods * EVERY_MS;
    while ts <= end {
        payloads.clear();
        fleet.samples(ts, &mut payloads);
        for p in &payloads {
            let row = SampleRow::from_json(p).unwrap();
            open.append(&row);
            open_max = open_max.max(row.ts_ms);
            if open.len() >= 8_192 {
                sealed.push((open_max, open.finish().unwrap()));
                open_max = i64::MIN;
            }
        }
        if ts % EVERY_MS == 0 && ts >= T0 + window_ms {
            if !open.is_empty() {
                sealed.push((open_max, open.finish().unwrap()));
                open_max = i64::MIN;
            }
            let batches: Vec<RecordBatch> = sealed.iter().map(|(_, b)| b.clone()).collect();
            let started = Instant::now();
            let out = runtime
                .block_on(engine.compute(&Inputs {
                    ts_ms: ts,
                    window_ms,
                    samples: &batches,
                    leases: &leases,
                    month_to_date_usd: &spend,
                    pricing: &pricing,
                    idle_measures: &measures,
                    release_grace_ms: EVERY_MS,
                }))
                .unwrap();
            compute.push(started.elapsed());
            signals = out.len();
            let cutoff = ts + EVERY_MS - window_ms;
            sealed.retain(|(max, _)| *max > cutoff);
        }
        ts += SAMPLE_MS;
    }
    let rows: usize = sealed.iter().map(|(_, b)| b.num_rows()).sum::<usize>() + open.len();
    let bytes: usize = sealed.iter().map(|(_, b)| b.get_array_memory_size()).sum();
    Figures {
        samples_held: rows,
        bytes_held: bytes,
        rss_growth: rss_bytes().saturating_sub(before),
        compute,
        signals,
    }
}

fn main() {
    // `cargo nextest run --all-targets` lists every bench target's tests: it has none.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let side = std::env::args()
        .skip(1)
        .find(|a| a == "old" || a == "new")
        .unwrap_or_else(|| "new".into());
    let gpus = env("GPUS", 10_000) as usize;
    let minutes = env("MINUTES", 15);
    let periods = env("PERIODS", 6);
    let fleet = Fleet { gpus };
    let started = Instant::now();
    let f = if side == "old" {
        old_side(&fleet, minutes, periods)
    } else {
        new_side(&fleet, minutes, periods)
    };
    let gpu_minutes = (gpus as f64) * (minutes as f64);
    let mut times: Vec<f64> = f.compute.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let max = times.last().copied().unwrap_or(f64::NAN);
    println!(
        "{side}: {gpus} GPUs × {minutes} min every {} s: {} samples held ({:.1} per GPU-minute), \
         {:.1} MiB counted ({:.0} B per GPU-minute, {:.0} B per sample), RSS +{:.1} MiB; \
         compute per period: median {median:.1} ms, max {max:.1} ms over {} periods; \
         {} signals; {:.1} s in all",
        SAMPLE_MS / 1000,
        f.samples_held,
        f.samples_held as f64 / gpu_minutes,
        f.bytes_held as f64 / 1048576.0,
        f.bytes_held as f64 / gpu_minutes,
        f.bytes_held as f64 / f.samples_held.max(1) as f64,
        f.rss_growth as f64 / 1048576.0,
        times.len(),
        f.signals,
        started.elapsed().as_secs_f64(),
    );
}
