//! `gpuwarden rollup` checked against an independent implementation of the same definitions:
//! tests/polars/rollups.py computes `team_hourly` and `lease_usage` with polars straight from the
//! lake's raw Parquet files, and both answers must agree row for row. A handful of numbers
//! worked out by hand from the fixture are asserted as well, so a mistake both implementations
//! share still fails.
//!
//! The fixture is generated here, deterministically, and loaded with `gpuwarden ingest` in two
//! phases with a rollup after each: the second phase brings late samples and late lease events
//! for hours the first rollup already closed.
//!
//! Needs a Python with polars: `GPUWARDEN_PYTHON` (set by .ci/run) names it.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

/// 2026-01-01T00:00:00Z, an hour boundary.
const T0: i64 = 1_767_225_600_000;
const HOUR: i64 = 3_600_000;
const MINUTE: i64 = 60_000;
const LATENESS: &str = "10m";
const LATENESS_MS: i64 = 10 * MINUTE;
const IDLE_UTIL_PCT: f64 = 5.0;
/// Below this SM activity a GPU is idle for `training` leases (`[workloads.training]
/// idle_measure = "sm_active"`); every other lease and unallocated time is judged by utilization.
const IDLE_SM_ACTIVE_PCT: f64 = 10.0;
const DEFAULT_PRICE: f64 = 2.0;
const ENERGY_PRICE: f64 = 0.12;
const CO2E_G_PER_KWH: f64 = 350.0;
/// `[[pricing.mig]]`: a 2g.20gb slice costs 0.3 of its GPU rather than 2/7.
const MIG_OVERRIDE: (&str, f64) = ("2g.20gb", 0.3);
/// `[[pricing.gpu]]` in order. Order matters twice: "H100" shadows the more specific entry after
/// it (so an H100 80GB HBM3 costs 4.5, never 9), and the lower-case A100-SXM4 entry must be
/// tried (case-insensitively) before the plain "A100".
const PRICES: [(&str, f64); 5] = [
    ("H100", 4.5),
    ("H100 80GB HBM3", 9.0),
    ("a100-sxm4-80gb", 3.2),
    ("A100", 2.6),
    ("L40S", 1.8),
];

const H100: &str = "NVIDIA H100 80GB HBM3";
const A100_SXM: &str = "NVIDIA A100-SXM4-80GB";
const A100_PCIE: &str = "NVIDIA A100-PCIE-40GB";
const L40S: &str = "NVIDIA L40S";
/// Matched by no entry: the default price.
const T4: &str = "Tesla T4";
const A6000: &str = "NVIDIA RTX A6000";
/// MIG slices of an H100, as NVML names them: priced by "H100", times their share.
const H100_3G: &str = "NVIDIA H100 80GB HBM3 MIG 3g.40gb";
const H100_2G: &str = "NVIDIA H100 80GB HBM3 MIG 2g.20gb";
const H100_1G: &str = "NVIDIA H100 80GB HBM3 MIG 1g.10gb";
const UNALLOCATED: &str = "(unallocated)";

/// Time `h` hours and `m` minutes after T0.
fn at(h: i64, m: i64) -> i64 {
    T0 + h * HOUR + m * MINUTE
}

/// The last sample of the fixture: the final watermark.
fn end_of_data() -> i64 {
    at(5, 20)
}

/// End of the first phase; everything later, and the late data, comes in the second.
fn end_of_phase_1() -> i64 {
    at(4, 30)
}

/// SplitMix64: a small, seeded generator, so the fixture is the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Rounded to 1/100, so the JSON stays readable.
    fn round(x: f64) -> f64 {
        (x * 100.0).round() / 100.0
    }

    /// A GPU utilization that often hits the edges: 0, exactly the idle threshold (not idle),
    /// 100, idle values and busy ones.
    fn util(&mut self) -> f64 {
        match self.below(20) {
            0 => 0.0,
            1 => IDLE_UTIL_PCT,
            2 => 100.0,
            3..=5 => Self::round(self.unit() * IDLE_UTIL_PCT * 0.99),
            _ => Self::round(IDLE_UTIL_PCT + self.unit() * (100.0 - IDLE_UTIL_PCT)),
        }
    }

    /// An SM activity: often low (a spinning GPU reads busy by utilization and idle by this),
    /// sometimes exactly the idle threshold (not idle).
    fn sm_active(&mut self) -> f64 {
        match self.below(10) {
            0..=2 => Self::round(self.unit() * IDLE_SM_ACTIVE_PCT * 0.99),
            3 => IDLE_SM_ACTIVE_PCT,
            _ => Self::round(IDLE_SM_ACTIVE_PCT + self.unit() * (100.0 - IDLE_SM_ACTIVE_PCT)),
        }
    }

    /// Power draw, or none in one sample of ten.
    fn power(&mut self) -> Option<f64> {
        (self.below(10) != 0).then(|| Self::round(50.0 + self.unit() * 650.0))
    }
}

struct Gpu {
    uuid: &'static str,
    host: &'static str,
    model: &'static str,
    interval_ms: i64,
    /// Drops about one sample in twenty (a flaky exporter).
    flaky: bool,
    /// Reports GPM's SM activity (Hopper): H100s and their slices.
    gpm: bool,
    /// A MIG device: its profile ("" for the unsliced rest of a MIG GPU), its compute slices
    /// and its GPU's.
    mig: Option<(&'static str, u32, u32)>,
}

const GPUS: [Gpu; 20] = [
    gpu("GPU-A0", "node-a", H100, 60_000, false),
    gpu("GPU-A1", "node-a", H100, 60_000, true),
    gpu("GPU-A2", "node-a", H100, 60_000, false),
    gpu("GPU-A3", "node-a", H100, 60_000, true),
    gpu("GPU-B0", "node-b", A100_SXM, 60_000, false),
    gpu("GPU-B1", "node-b", A100_SXM, 60_000, false),
    gpu("GPU-B2", "node-b", A100_SXM, 60_000, true),
    gpu("GPU-B3", "node-b", A100_SXM, 60_000, true),
    gpu("GPU-C0", "node-c", A100_PCIE, 30_000, false),
    gpu("GPU-C1", "node-c", A100_PCIE, 30_000, false),
    gpu("GPU-D0", "node-d", L40S, 60_000, true),
    gpu("GPU-D1", "node-d", L40S, 60_000, false),
    gpu("GPU-E0", "node-e", T4, 60_000, false),
    gpu("GPU-F0", "node-f", A6000, 60_000, false),
    // GPU-M, an H100 in four slices (3 + 2 + 1 + 1 of 7); GPU-N, one 1g slice and 6/7 unsliced.
    mig("MIG-M0", "node-g", H100_3G, ("3g.40gb", 3, 7)),
    mig("MIG-M1", "node-g", H100_2G, ("2g.20gb", 2, 7)),
    mig("MIG-M2", "node-g", H100_1G, ("1g.10gb", 1, 7)),
    mig("MIG-M3", "node-g", H100_1G, ("1g.10gb", 1, 7)),
    mig("MIG-N0", "node-h", H100_1G, ("1g.10gb", 1, 7)),
    mig("GPU-N", "node-h", H100, ("", 6, 7)),
];

const fn gpu(
    uuid: &'static str,
    host: &'static str,
    model: &'static str,
    interval_ms: i64,
    flaky: bool,
) -> Gpu {
    Gpu {
        uuid,
        host,
        model,
        interval_ms,
        flaky,
        gpm: matches!(model.as_bytes(), b"NVIDIA H100 80GB HBM3"),
        mig: None,
    }
}

const fn mig(
    uuid: &'static str,
    host: &'static str,
    model: &'static str,
    shape: (&'static str, u32, u32),
) -> Gpu {
    Gpu {
        uuid,
        host,
        model,
        interval_ms: 60_000,
        flaky: false,
        // The unsliced rest is no GPU instance: no GPM of its own.
        gpm: !shape.0.is_empty(),
        mig: Some(shape),
    }
}

fn sample(gpu: &Gpu, ts: i64, util: f64, power: Option<f64>, lease: Option<&str>) -> Value {
    let mut s = json!({
        "v": 1, "ts_ms": ts, "interval_ms": gpu.interval_ms, "host": gpu.host,
        "gpu_uuid": gpu.uuid, "gpu_model": gpu.model, "util_gpu_pct": util,
        "mem_used_bytes": 40u64 << 30, "mem_total_bytes": 80u64 << 30, "power_w": power,
    });
    if let Some(lease) = lease {
        s["lease_id"] = json!(lease);
        s["labels"] = json!({"k8s_namespace": "ml", "k8s_pod": format!("{lease}-0")});
    }
    s
}

struct Lease {
    id: &'static str,
    team: &'static str,
    user: &'static str,
    workload: &'static str,
    model: &'static str,
}

impl Lease {
    fn event(&self, ts: i64, event: &str, count: u32, uuids: &[&str], reason: &str) -> Value {
        let mut e = json!({
            "v": 1, "ts_ms": ts, "event": event, "lease_id": self.id, "team": self.team,
            "user": self.user, "project": format!("{}-project", self.id), "workload": self.workload,
            "substrate": "sim", "gpu_model": self.model, "gpu_count": count, "gpu_uuids": uuids,
        });
        if event == "released" {
            e["reason"] = json!(reason);
        }
        e
    }
    fn granted(&self, ts: i64, count: u32, uuids: &[&str]) -> Value {
        self.event(ts, "granted", count, uuids, "")
    }
    fn resized(&self, ts: i64, count: u32, uuids: &[&str]) -> Value {
        self.event(ts, "resized", count, uuids, "")
    }
    fn released(&self, ts: i64, count: u32, uuids: &[&str], reason: &str) -> Value {
        self.event(ts, "released", count, uuids, reason)
    }
}

const TRAIN: Lease = lease("L-train", "research", "alice", "training", H100);
const SERVE: Lease = lease("L-serve", "serving", "carol", "inference", L40S);
const NOTEBOOK: Lease = lease("L-nb", "research", "bob", "notebook", A100_SXM);
const OLD: Lease = lease("L-old", "serving", "carol", "batch", A100_SXM);
const NEW: Lease = lease("L-new", "research", "alice", "training", A100_SXM);
const TIE_1: Lease = lease("L-tie-1", "research", "alice", "batch", A100_PCIE);
const TIE_2: Lease = lease("L-tie-2", "serving", "carol", "batch", A100_PCIE);
const PCIE: Lease = lease("L-pcie", "research", "bob", "training", A100_PCIE);
const EMPTY: Lease = lease("L-empty", "serving", "carol", "batch", T4);
const LATE: Lease = lease("L-late", "serving", "dave", "inference", A100_SXM);
const MIG_A: Lease = lease("L-mig-a", "vision", "erin", "training", H100);
const MIG_B: Lease = lease("L-mig-b", "serving", "frank", "inference", H100);
const MIG_C: Lease = lease("L-mig-c", "vision", "gina", "notebook", H100);

const fn lease(
    id: &'static str,
    team: &'static str,
    user: &'static str,
    workload: &'static str,
    model: &'static str,
) -> Lease {
    Lease {
        id,
        team,
        user,
        workload,
        model,
    }
}

/// The lease id a GPU's exporter writes into its sample at `ts`, if any.
fn named_lease(gpu: &str, ts: i64, rng: &mut Rng) -> Option<&'static str> {
    match gpu {
        // Half of L-train's samples on A0 name it; the others are found through its GPUs.
        "GPU-A0" if (at(0, 10)..at(4, 0)).contains(&ts) && rng.below(2) == 0 => Some(TRAIN.id),
        // An unknown lease: falls through to L-pcie, which holds C0 from 0:45 to 1:45 ...
        "GPU-C0" if (at(1, 0)..at(1, 30)).contains(&ts) => Some("L-ghost"),
        // ... and to nobody at 3:00.
        "GPU-C0" if (at(3, 0)..at(3, 10)).contains(&ts) => Some("L-ghost"),
        // A known lease before its segments hold this GPU: the name does not count, since
        // L-serve lists D0 only until 2:00 (D1 is unallocated then).
        "GPU-D1" if (at(0, 0)..at(0, 20)).contains(&ts) => Some(SERVE.id),
        // The only way to attribute samples to a lease with empty gpu_uuids.
        "GPU-E0" if (at(1, 20)..at(1, 40)).contains(&ts) => Some(EMPTY.id),
        // A T4's samples named by an H100 lease that lists A0 alone then: not the lease's.
        "GPU-E0" if (at(3, 0)..at(3, 10)).contains(&ts) => Some(TRAIN.id),
        _ => None,
    }
}

struct Fixture {
    samples: [Vec<String>; 2],
    lease_events: [Vec<String>; 2],
    /// Lines that must be quarantined, per phase and table: (samples, lease events).
    invalid: [(usize, usize); 2],
}

fn fixture() -> Fixture {
    let mut rng = Rng(0x6770_7577_6172_6465);
    let mut samples: [Vec<Value>; 2] = [Vec::new(), Vec::new()];
    let a2_duplicate_at = at(1, 0);
    let d0_duplicate_at = at(2, 30);
    for gpu in &GPUS {
        let mut ts = T0;
        while ts <= end_of_data() {
            let this = ts;
            ts += gpu.interval_ms;
            if gpu.flaky && rng.below(20) == 0 {
                continue;
            }
            // A real gap: D1 reported nothing from 3:00 to 3:20.
            if gpu.uuid == "GPU-D1" && (at(3, 0)..at(3, 20)).contains(&this) {
                continue;
            }
            // F0 is the hand-checked GPU: never leased, constant load.
            let (util, power) = if gpu.uuid == "GPU-F0" {
                (50.0, Some(70.0))
            } else {
                (rng.util(), rng.power())
            };
            if gpu.uuid == "GPU-A2" && this == a2_duplicate_at {
                continue;
            }
            let lease = named_lease(gpu.uuid, this, &mut rng);
            let mut s = sample(gpu, this, util, power, lease);
            // A3 lost GPM at 2:00 (a driver update): judged by utilization from then on.
            if gpu.gpm && !(gpu.uuid == "GPU-A3" && this >= at(2, 0)) {
                s["sm_active_pct"] = json!(rng.sm_active());
            }
            if let Some((profile, slices, parent)) = gpu.mig {
                s["mig_slices"] = json!(slices);
                s["mig_parent_slices"] = json!(parent);
                if profile.is_empty() {
                    // The unsliced rest: idle capacity nobody holds.
                    s["util_gpu_pct"] = json!(0.0);
                } else {
                    s["mig_profile"] = json!(profile);
                    s["mig_parent_uuid"] = json!(if gpu.uuid.starts_with("MIG-M") {
                        "GPU-M"
                    } else {
                        "GPU-N"
                    });
                }
            }
            // B1's samples from 2:00 to 2:40 arrive late, after the first rollup.
            let late = gpu.uuid == "GPU-B1" && (at(2, 0)..at(2, 40)).contains(&this);
            let phase = usize::from(late || this > end_of_phase_1());
            // Exact duplicates, as a collector retrying a send produces them.
            if gpu.uuid != "GPU-F0" && rng.below(50) == 0 {
                samples[phase].push(s.clone());
            }
            // Some samples are delivered again with the late data.
            if phase == 0 && gpu.uuid != "GPU-F0" && rng.below(200) == 0 {
                samples[1].push(s.clone());
            }
            samples[phase].push(s);
        }
    }
    let [a2, d0] = [&GPUS[2], &GPUS[10]];
    // Duplicates that disagree: the survivor takes each column's maximum, so the copy naming
    // L-nb gives its lease_id to the busier copy without one. L-nb does not hold A2, so the
    // name does not count and A2's minute is nobody's (A2 is in no lease at 1:00).
    samples[0].push(sample(a2, a2_duplicate_at, 40.0, Some(300.0), None));
    samples[0].push(sample(a2, a2_duplicate_at, 20.0, None, Some(NOTEBOOK.id)));
    // ... and one of the copies may come late.
    samples[1].push(sample(d0, d0_duplicate_at, 90.0, Some(650.0), None));

    let f0 = &GPUS[13];
    let mut invalid_sample = |phase: usize, ts: i64, field: &str, value: Value| {
        let mut s = sample(f0, ts, 99.0, Some(999.0), None);
        match value {
            Value::Null => {
                s.as_object_mut().unwrap().remove(field);
            }
            v => s[field] = v,
        }
        samples[phase].push(s);
    };
    invalid_sample(0, at(0, 30) + 7, "util_gpu_pct", json!(150.0));
    invalid_sample(0, at(0, 31) + 7, "gpu_model", Value::Null);
    invalid_sample(0, at(0, 32) + 7, "mem_used_bytes", json!(81u64 << 30));
    invalid_sample(1, at(0, 33) + 7, "interval_ms", json!(0));

    let (a, b) = (
        ["GPU-A0", "GPU-A1", "GPU-A2", "GPU-A3"],
        ["GPU-B1", "GPU-B2"],
    );
    let mut events: [Vec<Value>; 2] = [
        vec![
            TRAIN.granted(at(0, 10), 2, &a[..2]),
            // The enforcer published the grant twice.
            TRAIN.granted(at(0, 10), 2, &a[..2]),
            TRAIN.resized(at(1, 30), 4, &a),
            TRAIN.resized(at(3, 0), 1, &a[..1]),
            TRAIN.released(at(4, 0), 1, &a[..1], "user"),
            // After the release: ignored.
            TRAIN.resized(at(4, 20), 4, &a),
            SERVE.granted(at(0, 0), 1, &["GPU-D0"]),
            SERVE.resized(at(2, 0), 2, &["GPU-D0", "GPU-D1"]),
            NOTEBOOK.granted(at(0, 30), 1, &["GPU-B0"]),
            NOTEBOOK.released(at(1, 15), 1, &["GPU-B0"], "idle"),
            OLD.granted(at(0, 0), 2, &b),
            // B2 granted again while L-old holds it: the later grant wins while it lasts.
            NEW.granted(at(1, 0), 1, &b[1..]),
            NEW.released(at(3, 0), 1, &b[1..], "user"),
            // Granted at the same time: the larger lease id wins C1's samples.
            TIE_1.granted(at(2, 0), 1, &["GPU-C1"]),
            TIE_2.granted(at(2, 0), 1, &["GPU-C1"]),
            TIE_1.released(at(2, 30), 1, &["GPU-C1"], "user"),
            TIE_2.released(at(2, 30), 1, &["GPU-C1"], "user"),
            PCIE.granted(at(0, 45), 1, &["GPU-C0"]),
            PCIE.released(at(1, 45), 1, &["GPU-C0"], "budget"),
            EMPTY.granted(at(1, 0), 1, &[]),
            EMPTY.released(at(2, 0), 1, &[], "admin"),
            MIG_A.granted(at(0, 20), 2, &["MIG-M0", "MIG-M2"]),
            MIG_A.released(at(3, 0), 2, &["MIG-M0", "MIG-M2"], "user"),
            MIG_B.granted(at(1, 0), 1, &["MIG-M1"]),
            MIG_C.granted(at(0, 0), 1, &["MIG-N0"]),
            MIG_C.released(at(2, 0), 1, &["MIG-N0"], "idle"),
        ],
        vec![
            // Late: a whole lease in hours already final ...
            LATE.granted(at(0, 20), 1, &["GPU-B3"]),
            LATE.resized(at(0, 50), 1, &["GPU-B3"]),
            LATE.released(at(1, 40), 1, &["GPU-B3"], "failed"),
            // ... and the release of a lease the first rollup saw running.
            OLD.released(at(3, 30), 2, &b, "expired"),
        ],
    ];
    // Invalid (no such workload): had it counted, F0 would not be unallocated.
    let mut bogus =
        lease("L-bogus", "research", "eve", "training", A6000).granted(at(0, 0), 1, &["GPU-F0"]);
    bogus["workload"] = json!("gaming");
    events[0].push(bogus);

    let lines = |values: &[Value]| values.iter().map(Value::to_string).collect::<Vec<_>>();
    Fixture {
        samples: [lines(&samples[0]), lines(&samples[1])],
        lease_events: [lines(&events[0]), lines(&events[1])],
        invalid: [(3, 1), (1, 0)],
    }
}

fn write_config(dir: &Path) -> PathBuf {
    let mut toml = format!(
        "[storage]\ndata_dir = \"{}\"\n\n[pipeline]\nlateness = \"{LATENESS}\"\n\n\
         [workloads.training]\nidle_measure = \"sm_active\"\n\n[pricing]\n\
         idle_util_pct = {IDLE_UTIL_PCT:?}\nidle_sm_active_pct = {IDLE_SM_ACTIVE_PCT:?}\n\
         default_usd_per_gpu_hour = {DEFAULT_PRICE:?}\nenergy_usd_per_kwh = {ENERGY_PRICE:?}\n\
         co2e_g_per_kwh = {CO2E_G_PER_KWH:?}\n",
        dir.join("data").display()
    );
    for (m, usd) in PRICES {
        toml += &format!("\n[[pricing.gpu]]\nmatch = \"{m}\"\nusd_per_gpu_hour = {usd:?}\n");
    }
    let (profile, share) = MIG_OVERRIDE;
    toml += &format!("\n[[pricing.mig]]\nprofile = \"{profile}\"\nshare = {share:?}\n");
    let path = dir.join("gpuwarden.toml");
    std::fs::write(&path, toml).unwrap();
    path
}

/// The same parameters, as tests/polars/rollups.py takes them.
fn polars_params() -> String {
    let gpu: Vec<Value> = PRICES
        .iter()
        .map(|(m, usd)| json!({"match": m, "usd_per_gpu_hour": usd}))
        .collect();
    json!({
        "lateness_ms": LATENESS_MS,
        "pricing": {
            "idle_util_pct": IDLE_UTIL_PCT,
            "idle_sm_active_pct": IDLE_SM_ACTIVE_PCT,
            "idle_measure": "util",
            "default_usd_per_gpu_hour": DEFAULT_PRICE,
            "energy_usd_per_kwh": ENERGY_PRICE,
            "co2e_g_per_kwh": CO2E_G_PER_KWH,
            "gpu": gpu,
            "mig": [{"profile": MIG_OVERRIDE.0, "share": MIG_OVERRIDE.1}],
        },
        "workloads": {"training": "sm_active"},
    })
    .to_string()
}

/// Runs the binary; panics with its output unless it succeeds. Returns stdout.
fn gpuwarden(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "gpuwarden {}: {}\n{stdout}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The Python that runs the polars reference: GPUWARDEN_PYTHON, which must import polars.
fn python() -> String {
    support::venv_python("polars", "import polars")
}

type Row = BTreeMap<String, Value>;

struct Tables {
    team_hourly: Vec<Row>,
    lease_usage: Vec<Row>,
}

fn polars_rollups(python: &str, lake: &Path) -> Tables {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/polars/rollups.py");
    let out = Command::new(python)
        .arg(&script)
        .args([
            "--lake",
            lake.to_str().unwrap(),
            "--params",
            &polars_params(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let result: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = |table: &str| -> Vec<Row> {
        result[table]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| serde_json::from_value(r.clone()).unwrap())
            .collect()
    };
    Tables {
        team_hourly: rows("team_hourly"),
        lease_usage: rows("lease_usage"),
    }
}

const MEASURES: [&str; 13] = [
    "allocated_gpu_hours",
    "observed_gpu_hours",
    "busy_gpu_hours",
    "idle_gpu_hours",
    "utilization_pct",
    "cost_usd",
    "idle_cost_usd",
    "energy_kwh",
    "sm_active_gpu_hours",
    "gpm_observed_gpu_hours",
    "idle_measure",
    "energy_cost_usd",
    "co2e_kg",
];
const TEAM_HOURLY_KEY: [&str; 3] = ["hour", "team", "gpu_model"];
const LEASE_IDENTITY: [&str; 11] = [
    "lease_id",
    "team",
    "user",
    "project",
    "workload",
    "substrate",
    "gpu_model",
    "gpu_count",
    "granted_at",
    "released_at",
    "release_reason",
];
const TIMESTAMPS: [&str; 3] = ["hour", "granted_at", "released_at"];

const MILLISECONDS_UTC: &str = r#"Timestamp(Millisecond, Some("UTC"))"#;

/// A column for the SELECT list: timestamps as epoch milliseconds, whatever their unit.
fn select(column: &str) -> String {
    if TIMESTAMPS.contains(&column) {
        format!("CAST(arrow_cast({column}, '{MILLISECONDS_UTC}') AS BIGINT) AS {column}")
    } else {
        format!("\"{column}\"")
    }
}

fn datafusion_rollups(config: &Path) -> Tables {
    let query = |table: &str, columns: &[&str], order: &[&str]| -> Vec<Row> {
        let sql = format!(
            "SELECT {} FROM {table} ORDER BY {}",
            columns
                .iter()
                .map(|c| select(c))
                .collect::<Vec<_>>()
                .join(", "),
            order.join(", ")
        );
        let out = gpuwarden(&[
            "sql",
            "--config",
            config.to_str().unwrap(),
            "--format",
            "json",
            &sql,
        ]);
        // JSON lines leave out NULL columns; every row gets every column back.
        out.lines()
            .map(|line| {
                let mut row: Row = serde_json::from_str(line).unwrap();
                for c in columns {
                    row.entry(c.to_string()).or_insert(Value::Null);
                }
                row
            })
            .collect()
    };
    let hourly: Vec<&str> = TEAM_HOURLY_KEY
        .iter()
        .chain(&MEASURES)
        .chain(&["final"])
        .copied()
        .collect();
    let usage: Vec<&str> = LEASE_IDENTITY.iter().chain(&MEASURES).copied().collect();
    Tables {
        team_hourly: query("team_hourly", &hourly, &TEAM_HOURLY_KEY),
        lease_usage: query("lease_usage", &usage, &["lease_id"]),
    }
}

/// Equal within 1e-9 relative, or 1e-12 absolute near zero.
fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-12 || (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
            (Some(x), Some(y)) => x == y,
            _ => close(x.as_f64().unwrap(), y.as_f64().unwrap()),
        },
        _ => a == b,
    }
}

/// Every difference between DataFusion's rows and polars' rows of one table, one line each.
fn differences(table: &str, key: &[&str], datafusion: &[Row], polars: &[Row]) -> Vec<String> {
    let keyed = |rows: &[Row]| -> BTreeMap<String, Row> {
        let mut keyed = BTreeMap::new();
        for row in rows {
            let k = key.iter().map(|c| row[*c].to_string()).collect::<Vec<_>>();
            let k = format!("({})", k.join(", "));
            assert!(
                keyed.insert(k.clone(), row.clone()).is_none(),
                "{table}: two rows with key {k}"
            );
        }
        keyed
    };
    let (df, pl) = (keyed(datafusion), keyed(polars));
    let mut diffs = Vec::new();
    for k in df
        .keys()
        .collect::<BTreeSet<_>>()
        .union(&pl.keys().collect())
    {
        match (df.get(*k), pl.get(*k)) {
            (Some(_), None) => diffs.push(format!("{table} {k}: only in DataFusion")),
            (None, Some(_)) => diffs.push(format!("{table} {k}: only in polars")),
            (Some(d), Some(p)) => {
                for (column, expected) in p {
                    let actual = d.get(column).unwrap_or(&Value::Null);
                    if !same(actual, expected) {
                        diffs.push(format!(
                            "{table} {k} {column}: DataFusion {actual}, polars {expected}"
                        ));
                    }
                }
            }
            (None, None) => unreachable!(),
        }
    }
    diffs
}

fn assert_agree(phase: &str, datafusion: &Tables, polars: &Tables) -> (usize, usize) {
    let mut diffs = differences(
        "team_hourly",
        &TEAM_HOURLY_KEY,
        &datafusion.team_hourly,
        &polars.team_hourly,
    );
    diffs.extend(differences(
        "lease_usage",
        &["lease_id"],
        &datafusion.lease_usage,
        &polars.lease_usage,
    ));
    assert!(
        diffs.is_empty(),
        "after {phase}, DataFusion's rollups and the polars reference disagree \
         ({} differences):\n{}",
        diffs.len(),
        diffs.join("\n")
    );
    (polars.team_hourly.len(), polars.lease_usage.len())
}

/// The row of `rows` with this key; panics naming the key when there is none.
fn find<'a>(rows: &'a [Row], key: &[(&str, Value)]) -> &'a Row {
    rows.iter()
        .find(|r| key.iter().all(|(c, v)| &r[*c] == v))
        .unwrap_or_else(|| panic!("no row with {key:?}"))
}

fn hour_key(h: i64, team: &str, gpu_model: &str) -> [(&'static str, Value); 3] {
    [
        ("hour", json!(at(h, 0))),
        ("team", json!(team)),
        ("gpu_model", json!(gpu_model)),
    ]
}

fn lease_key(id: &str) -> [(&'static str, Value); 1] {
    [("lease_id", json!(id))]
}

/// The numbers worked out by hand from the fixture, checked in one implementation's tables.
fn assert_hand_checked(who: &str, t: &Tables) {
    let mut wrong = Vec::new();
    let mut expect = |rows: &[Row], key: &[(&str, Value)], expected: &[(&str, Value)]| {
        let row = find(rows, key);
        for (column, value) in expected {
            if !same(&row[*column], value) {
                let key: Vec<String> = key.iter().map(|(_, v)| v.to_string()).collect();
                wrong.push(format!(
                    "({}) {column}: {}, by hand {value}",
                    key.join(", "),
                    row[*column]
                ));
            }
        }
    };
    let (hourly, usage) = (&t.team_hourly, &t.lease_usage);

    // F0: unallocated, sampled every minute at 50 % and 70 W; its invalid samples count nowhere.
    // Unallocated time counts as allocated, at the default price.
    expect(
        hourly,
        &hour_key(0, UNALLOCATED, A6000),
        &[
            ("observed_gpu_hours", json!(1.0)),
            ("allocated_gpu_hours", json!(1.0)),
            ("busy_gpu_hours", json!(0.5)),
            ("idle_gpu_hours", json!(0.0)),
            ("utilization_pct", json!(50.0)),
            ("cost_usd", json!(2.0)),
            ("energy_kwh", json!(0.07)),
            ("energy_cost_usd", json!(0.07 * ENERGY_PRICE)),
            ("co2e_kg", json!(0.07 * CO2E_G_PER_KWH / 1000.0)),
            ("idle_measure", json!("util")),
            ("sm_active_gpu_hours", json!(0.0)),
            ("final", json!(true)),
        ],
    );
    expect(
        hourly,
        &hour_key(4, UNALLOCATED, A6000),
        &[("final", json!(true))],
    );
    // The samples at 5:01 to 5:20 (the one at 5:00 covers 4:59 to 5:00); the watermark is
    // 5:20, so hour 5 is open.
    expect(
        hourly,
        &hour_key(5, UNALLOCATED, A6000),
        &[
            ("observed_gpu_hours", json!(20.0 / 60.0)),
            ("final", json!(false)),
        ],
    );
    // L-train: 2 GPUs 0:10-1:30, 4 GPUs 1:30-3:00, 1 GPU 3:00-4:00; the resize after its
    // release is ignored. Priced by "H100", the first entry that matches.
    expect(
        usage,
        &lease_key(TRAIN.id),
        &[
            ("allocated_gpu_hours", json!(580.0 / 60.0)),
            ("cost_usd", json!(43.5)),
            ("gpu_count", json!(1)),
            ("granted_at", json!(at(0, 10))),
            ("released_at", json!(at(4, 0))),
            ("release_reason", json!("user")),
        ],
    );
    expect(
        hourly,
        &hour_key(1, "research", H100),
        &[("allocated_gpu_hours", json!(3.0))],
    );
    // Hour 3: A0 all hour, its allocation; the ten samples of a T4 that name L-train are not
    // its time (it holds A0 alone), nor are A1 to A3's samples at 3:00, which cover 2:59 to 3:00.
    expect(
        hourly,
        &hour_key(3, "research", H100),
        &[
            ("observed_gpu_hours", json!(1.0)),
            ("allocated_gpu_hours", json!(1.0)),
        ],
    );
    // L-serve never ends: 1 GPU 0:00-2:00, then 2 GPUs up to the watermark, 5:20.
    expect(
        usage,
        &lease_key(SERVE.id),
        &[
            ("allocated_gpu_hours", json!(520.0 / 60.0)),
            ("cost_usd", json!(520.0 / 60.0 * 1.8)),
            ("gpu_count", json!(2)),
            ("released_at", Value::Null),
        ],
    );
    // L-old: 2 GPUs from 0:00 to its late release at 3:30; L-late, all late, 0:20 to 1:40.
    expect(
        usage,
        &lease_key(OLD.id),
        &[
            ("allocated_gpu_hours", json!(7.0)),
            ("released_at", json!(at(3, 30))),
            ("release_reason", json!("expired")),
        ],
    );
    expect(
        usage,
        &lease_key(LATE.id),
        &[("allocated_gpu_hours", json!(80.0 / 60.0))],
    );
    // L-nb: B0 from 0:30 to 1:15, exactly its allocation; not the A2 sample that names it.
    expect(
        usage,
        &lease_key(NOTEBOOK.id),
        &[
            ("observed_gpu_hours", json!(45.0 / 60.0)),
            ("allocated_gpu_hours", json!(45.0 / 60.0)),
        ],
    );
    // L-pcie: C0 every 30 s from 0:45 to 1:45, the samples naming the unknown L-ghost included;
    // at 3:00 they belong to nobody.
    expect(
        usage,
        &lease_key(PCIE.id),
        &[("observed_gpu_hours", json!(1.0))],
    );
    expect(
        hourly,
        &hour_key(3, UNALLOCATED, A100_PCIE),
        &[("allocated_gpu_hours", json!(2.0))],
    );
    // C1's samples go to L-tie-2 (same grant time, larger id); L-tie-1 has none: an hour with
    // allocation and no samples.
    expect(
        usage,
        &lease_key(TIE_2.id),
        &[("observed_gpu_hours", json!(0.5))],
    );
    expect(
        usage,
        &lease_key(TIE_1.id),
        &[
            ("allocated_gpu_hours", json!(0.5)),
            ("observed_gpu_hours", json!(0.0)),
            ("utilization_pct", Value::Null),
        ],
    );
    expect(
        hourly,
        &hour_key(2, "research", A100_PCIE),
        &[
            ("allocated_gpu_hours", json!(0.5)),
            ("observed_gpu_hours", json!(0.0)),
            ("utilization_pct", Value::Null),
        ],
    );
    // L-empty holds no GPU by name: only samples naming it count; a T4 has the default price.
    expect(
        usage,
        &lease_key(EMPTY.id),
        &[
            ("allocated_gpu_hours", json!(1.0)),
            ("observed_gpu_hours", json!(20.0 / 60.0)),
            ("cost_usd", json!(2.0)),
        ],
    );
    // MIG: a lease holds its slices' shares. L-mig-c, one 1g slice (1/7) from 0:00 to 2:00;
    // L-mig-b, a 2g slice at its [[pricing.mig]] share, 0.3, from 1:00 to the watermark, 5:20;
    // L-mig-a, 3g + 1g (4/7), 0:20 to 3:00. Priced as H100s.
    let seventh = 1.0 / 7.0;
    expect(
        usage,
        &lease_key(MIG_C.id),
        &[
            ("allocated_gpu_hours", json!(2.0 * seventh)),
            ("observed_gpu_hours", json!(2.0 * seventh)),
            ("cost_usd", json!(2.0 * seventh * 4.5)),
            ("idle_measure", json!("util")),
        ],
    );
    expect(
        usage,
        &lease_key(MIG_B.id),
        &[
            ("allocated_gpu_hours", json!(260.0 / 60.0 * 0.3)),
            ("cost_usd", json!(260.0 / 60.0 * 0.3 * 4.5)),
        ],
    );
    expect(
        usage,
        &lease_key(MIG_A.id),
        &[
            ("allocated_gpu_hours", json!(160.0 / 60.0 * 4.0 * seventh)),
            ("observed_gpu_hours", json!(160.0 / 60.0 * 4.0 * seventh)),
            (
                "gpm_observed_gpu_hours",
                json!(160.0 / 60.0 * 4.0 * seventh),
            ),
            ("idle_measure", json!("sm_active")),
        ],
    );
    // Hour 0's free slices: MIG-M3 all hour and MIG-M2 until L-mig-a took it at 0:20.
    expect(
        hourly,
        &hour_key(0, UNALLOCATED, H100_1G),
        &[
            ("observed_gpu_hours", json!(80.0 / 60.0 * seventh)),
            ("allocated_gpu_hours", json!(80.0 / 60.0 * seventh)),
            ("cost_usd", json!(80.0 / 60.0 * seventh * 4.5)),
        ],
    );
    // Training is judged by SM activity where there is GPM: L-train's H100s had it, but A3 lost
    // it at 2:00 (so hour 1 is mixed already: A3's sample at 2:00 covers 1:59-2:00); L-new's
    // A100 never had it.
    expect(
        usage,
        &lease_key(TRAIN.id),
        &[("idle_measure", json!("mixed"))],
    );
    expect(
        usage,
        &lease_key(NEW.id),
        &[("idle_measure", json!("util"))],
    );
    expect(
        hourly,
        &hour_key(0, "research", H100),
        &[("idle_measure", json!("sm_active"))],
    );
    expect(
        hourly,
        &hour_key(1, "research", H100),
        &[("idle_measure", json!("mixed"))],
    );
    assert!(
        wrong.is_empty(),
        "{who} disagrees with the numbers worked out by hand:\n{}",
        wrong.join("\n")
    );
    let leases: BTreeSet<&str> = usage
        .iter()
        .map(|r| r["lease_id"].as_str().unwrap())
        .collect();
    let known = [
        TRAIN.id,
        SERVE.id,
        NOTEBOOK.id,
        OLD.id,
        NEW.id,
        TIE_1.id,
        TIE_2.id,
        PCIE.id,
        EMPTY.id,
        LATE.id,
        MIG_A.id,
        MIG_B.id,
        MIG_C.id,
    ];
    assert_eq!(
        leases,
        known.into_iter().collect(),
        "{who}: one row per known lease"
    );
}

#[test]
fn rollups_agree_with_the_polars_reference_through_late_data() {
    let python = python();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path());
    let config = config.to_str().unwrap();
    let lake = dir.path().join("data/lake");
    let fixture = fixture();

    let mut compared = Vec::new();
    for phase in 0..2 {
        let samples = dir.path().join(format!("samples-{}.jsonl", phase + 1));
        let events = dir.path().join(format!("lease-events-{}.jsonl", phase + 1));
        std::fs::write(&samples, fixture.samples[phase].join("\n")).unwrap();
        std::fs::write(&events, fixture.lease_events[phase].join("\n")).unwrap();
        let out = gpuwarden(&[
            "ingest",
            "--config",
            config,
            "--samples",
            samples.to_str().unwrap(),
            "--lease-events",
            events.to_str().unwrap(),
        ]);
        let (bad_samples, bad_events) = fixture.invalid[phase];
        for (table, lines, bad) in [
            ("samples", &fixture.samples[phase], bad_samples),
            ("lease_events", &fixture.lease_events[phase], bad_events),
        ] {
            let expected = format!(
                "{} {table} records read, {} written, {bad} quarantined",
                lines.len(),
                lines.len() - bad
            );
            assert!(out.contains(&expected), "expected {expected:?} in:\n{out}");
        }
        gpuwarden(&["rollup", "--config", config]);
        let name = format!(
            "phase {} (watermark {})",
            phase + 1,
            [end_of_phase_1(), end_of_data()][phase]
        );
        compared.push(assert_agree(
            &name,
            &datafusion_rollups(Path::new(config)),
            &polars_rollups(&python, &lake),
        ));
    }

    let datafusion = datafusion_rollups(Path::new(config));
    let polars = polars_rollups(&python, &lake);
    assert_hand_checked("polars", &polars);
    assert_hand_checked("DataFusion", &datafusion);
    // Every piece of a sample's interval counts for the lease holding its GPU then, so no lease
    // is observed longer than it held GPUs (docs/src/finops/definitions.md#attribution).
    for (who, tables) in [("polars", &polars), ("DataFusion", &datafusion)] {
        for row in &tables.lease_usage {
            let [observed, allocated] =
                ["observed_gpu_hours", "allocated_gpu_hours"].map(|c| row[c].as_f64().unwrap());
            assert!(
                observed <= allocated + 1e-9,
                "{who}: {} observed {observed} GPU-hours, allocated {allocated}",
                row["lease_id"]
            );
        }
    }
    assert_eq!(
        support::lake_i64(&lake, "SELECT count(*) FROM quarantine"),
        5,
        "every invalid line is quarantined"
    );
    eprintln!("rows compared (team_hourly, lease_usage) per phase: {compared:?}");
}

#[test]
fn a_difference_names_the_key_the_column_and_both_values() {
    let row = |key: &str, x: Value, y: Value| -> Row {
        [
            ("k".to_string(), json!(key)),
            ("x".into(), x),
            ("y".into(), y),
        ]
        .into_iter()
        .collect()
    };
    let polars = [
        row("a", json!(1.0), json!(null)),
        row("b", json!(2.0), json!(true)),
        row("c", json!(0.0), json!(7)),
    ];
    let datafusion = [
        row("a", json!(1.0 + 1e-12), json!(null)),
        row("b", json!(2.1), json!(false)),
        row("d", json!(0.0), json!(7)),
    ];
    assert_eq!(
        differences("t", &["k"], &datafusion, &polars),
        [
            "t (\"b\") x: DataFusion 2.1, polars 2.0",
            "t (\"b\") y: DataFusion false, polars true",
            "t (\"c\"): only in polars",
            "t (\"d\"): only in DataFusion",
        ]
    );
    assert!(close(0.0, 1e-13) && !close(0.0, 1e-11) && !close(1.0, 1.0 + 1e-8));
}
