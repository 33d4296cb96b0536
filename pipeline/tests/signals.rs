//! Signals over a hand-built window, every figure worked out here.
//!
//! T = 2026-11-30T00:00Z; samples every minute, `k` minutes after T; the window is 15 minutes,
//! so signals at T+15m read samples k = 1..=15 (k = 0 lies on the window's open start).
//! Pricing: H100 $4/h, anything else $1.50/h; idle below 5 %.
//!
//! - L1 (ml, g1+g2): g1 at 90 %, g2 at 80 % (g1 has a duplicate at k=3 at 10 %: the maximum
//!   counts), g2 uses 5,000 bytes at k=7 → util 85, idle 0, 2 active, mem 5,000.
//! - L2 (ds, notebook, L40S, g3): 50 % for k=1..=5, 0 % after; a 100 % sample at k=0 is outside
//!   → util 5×50/15 = 16.667, idle from k=6: 15−6 = 9 min = 540,000 ms, 1 active.
//! - L3 (ml, g4): no samples → util 0, idle 0 (no evidence), 0 active.
//! - L4 (ds, pooled, 2 GPUs): samples naming it on g7 and g8 at 1 % → util 1, never busy, idle
//!   from k=1: 14 min = 840,000 ms.
//! - L5 (ml, g9) was released at k=−10; g9 still runs at 95 % naming L5 → gpu_unattributed.
//! - L6 (ds, g10) granted k=8, resized k=10 to g10+g11: only k=10..=15 count (current segment),
//!   both at 60 % → util 60, 2 active; g10/g11 before k=10 are held GPUs, so not unattributed.
//! - g5 (no lease) 70 % → gpu_unattributed 70; g6 (no lease) 2 % → nothing.
//! - L7 (ops, g12) released at k=14; g12 runs at 80 % naming L7 for k=1..=14 and 0 % at k=15.
//!   k ≤ 14 are L7's (k=14 trails the release within the 1 min grace), so g12 reads 0 → nothing.
//!   Without the grace, k=14 and 15 would read 40 % unattributed.
//! - team_spend: ml 100 $ so far, burn L1 2×4 + L3 1×4 = 12; ds 20 $, burn L2 1.5 + L4 2×4 +
//!   L6 2×4 = 17.5; ops 0 and 0.
//!
//! None of those samples has SM activity, so every lease reads `idle_measure` `util` and no
//! `sm_active_pct`. The other tests here: spinning GPUs judged by each measure
//! ([`a_spinning_gpu_is_idle_by_sm_activity_and_busy_by_utilization`]), and one H100 split
//! into MIG slices ([`a_mig_slice_idles_on_its_own_while_its_neighbours_run`]).

use std::collections::BTreeMap;

use gpuwarden_pipeline::rollup::leases::Leases;
use gpuwarden_pipeline::signals::{idle_measures, IdleMeasures, Inputs, SignalEngine};
use gpuwarden_schema::config::{self, GpuPrice, IdleMeasure, PricingConfig};
use gpuwarden_schema::signal::JudgedBy;
use gpuwarden_schema::{LeaseEvent, Record, Sample, Signal, SignalBody};
use serde_json::json;

const T: i64 = 1_795_996_800_000;
const MIN: i64 = 60_000;
const WINDOW: i64 = 15 * MIN;
const H100: &str = "NVIDIA H100 80GB HBM3";

fn sample(gpu: &str, k: i64, util: f64, lease: Option<&str>) -> Sample {
    let mem = if gpu == "g2" && k == 7 {
        5000
    } else {
        1000 + k
    };
    Sample::from_json(
        json!({"v": 1, "ts_ms": T + k * MIN, "interval_ms": MIN, "host": format!("h-{gpu}"),
               "gpu_uuid": gpu, "gpu_model": H100, "util_gpu_pct": util,
               "mem_used_bytes": mem, "mem_total_bytes": 1_000_000, "lease_id": lease})
        .to_string()
        .as_bytes(),
    )
    .unwrap()
}

fn event(
    k: i64,
    kind: &str,
    lease: &str,
    team: &str,
    model: &str,
    count: u32,
    gpus: &[&str],
) -> LeaseEvent {
    workload_event(k, kind, lease, team, model, count, gpus, "training")
}

#[allow(clippy::too_many_arguments)]
fn workload_event(
    k: i64,
    kind: &str,
    lease: &str,
    team: &str,
    model: &str,
    count: u32,
    gpus: &[&str],
    workload: &str,
) -> LeaseEvent {
    let mut e = json!({"v": 1, "ts_ms": T + k * MIN, "event": kind, "lease_id": lease,
        "team": team, "user": "u", "project": "p", "workload": workload,
        "substrate": "sim", "gpu_model": model, "gpu_count": count, "gpu_uuids": gpus});
    if kind == "released" {
        e["reason"] = json!("user");
    }
    LeaseEvent::from_json(e.to_string().as_bytes()).unwrap()
}

fn leases() -> Leases {
    Leases::from_events(vec![
        event(-60, "granted", "L1", "ml", H100, 2, &["g1", "g2"]),
        event(-60, "granted", "L2", "ds", "NVIDIA L40S", 1, &["g3"]),
        event(-60, "granted", "L3", "ml", H100, 1, &["g4"]),
        event(-60, "granted", "L4", "ds", H100, 2, &[]),
        event(-60, "granted", "L5", "ml", H100, 1, &["g9"]),
        event(-10, "released", "L5", "ml", H100, 1, &["g9"]),
        event(8, "granted", "L6", "ds", H100, 1, &["g10"]),
        event(10, "resized", "L6", "ds", H100, 2, &["g10", "g11"]),
        event(-30, "granted", "L7", "ops", H100, 1, &["g12"]),
        event(14, "released", "L7", "ops", H100, 1, &["g12"]),
    ])
}

fn first_window() -> Vec<Sample> {
    let mut s = Vec::new();
    s.push(sample("g3", 0, 100.0, None));
    for k in 1..=15 {
        s.push(sample("g1", k, 90.0, None));
        s.push(sample("g2", k, 80.0, None));
        s.push(sample("g3", k, if k <= 5 { 50.0 } else { 0.0 }, None));
        s.push(sample("g7", k, 1.0, Some("L4")));
        s.push(sample("g8", k, 1.0, Some("L4")));
        s.push(sample("g9", k, 95.0, Some("L5")));
        s.push(sample("g10", k, 60.0, None));
        s.push(sample("g11", k, 60.0, None));
        s.push(sample("g5", k, 70.0, None));
        s.push(sample("g6", k, 2.0, None));
        // L7's work runs until the fleet follows its release, one sample late.
        s.push(sample(
            "g12",
            k,
            if k <= 14 { 80.0 } else { 0.0 },
            Some("L7"),
        ));
    }
    s.push(sample("g1", 3, 10.0, None));
    s
}

fn pricing() -> PricingConfig {
    PricingConfig {
        gpu: vec![GpuPrice {
            model_match: "H100".into(),
            usd_per_gpu_hour: 4.0,
        }],
        default_usd_per_gpu_hour: 1.5,
        idle_util_pct: 5.0,
        ..PricingConfig::default()
    }
}

async fn compute(
    engine: &mut SignalEngine,
    ts: i64,
    samples: &[Sample],
    leases: &Leases,
) -> Vec<Signal> {
    compute_with(
        engine,
        ts,
        samples,
        leases,
        &pricing(),
        &IdleMeasures::new(),
    )
    .await
}

async fn compute_with(
    engine: &mut SignalEngine,
    ts: i64,
    samples: &[Sample],
    leases: &Leases,
    pricing: &PricingConfig,
    measures: &IdleMeasures,
) -> Vec<Signal> {
    let batch = Sample::to_record_batch(samples).unwrap();
    let spend = BTreeMap::from([
        ("ml".to_string(), 100.0),
        ("ds".to_string(), 20.0),
        ("ops".to_string(), 0.0),
    ]);
    let signals = engine
        .compute(&Inputs {
            ts_ms: ts,
            window_ms: WINDOW,
            samples: &[batch],
            leases,
            month_to_date_usd: &spend,
            pricing,
            idle_measures: measures,
            release_grace_ms: MIN,
        })
        .await
        .unwrap();
    for s in &signals {
        assert_eq!((s.ts_ms, s.window_ms), (ts, WINDOW));
    }
    signals
}

fn utilization(signals: &[Signal]) -> Vec<(String, String, f64, i64, u32, u32, u64)> {
    signals
        .iter()
        .filter_map(|s| match &s.body {
            SignalBody::LeaseUtilization {
                lease_id,
                team,
                util_pct,
                idle_ms,
                gpus_active,
                gpus_total,
                mem_used_max_bytes,
                ..
            } => Some((
                lease_id.clone(),
                team.clone(),
                (util_pct * 1000.0).round() / 1000.0,
                *idle_ms,
                *gpus_active,
                *gpus_total,
                *mem_used_max_bytes,
            )),
            _ => None,
        })
        .collect()
}

/// Each lease's (id, `sm_active_pct`, `idle_measure`).
fn judged(signals: &[Signal]) -> Vec<(String, Option<f64>, Option<JudgedBy>)> {
    signals
        .iter()
        .filter_map(|s| match &s.body {
            SignalBody::LeaseUtilization {
                lease_id,
                sm_active_pct,
                idle_measure,
                ..
            } => Some((
                lease_id.clone(),
                sm_active_pct.map(|sm| (sm * 1000.0).round() / 1000.0),
                *idle_measure,
            )),
            _ => None,
        })
        .collect()
}

/// The GPUs of `gpu_unattributed` signals, with their utilization.
fn unattributed(signals: &[Signal]) -> Vec<(String, f64)> {
    signals
        .iter()
        .filter_map(|s| match &s.body {
            SignalBody::GpuUnattributed {
                gpu_uuid, util_pct, ..
            } => Some((gpu_uuid.clone(), *util_pct)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn every_kind_of_signal_matches_its_worked_figures() {
    let leases = leases();
    let mut engine = SignalEngine::new();
    let signals = compute(&mut engine, T + WINDOW, &first_window(), &leases).await;
    let s = |id: &str, team: &str, util, idle, active, total, mem| {
        (
            id.to_string(),
            team.to_string(),
            util,
            idle,
            active,
            total,
            mem,
        )
    };
    assert_eq!(
        utilization(&signals),
        vec![
            s("L1", "ml", 85.0, 0, 2, 2, 5000),
            s("L2", "ds", 16.667, 540_000, 1, 1, 1015),
            s("L3", "ml", 0.0, 0, 0, 1, 0),
            s("L4", "ds", 1.0, 840_000, 0, 2, 1015),
            s("L6", "ds", 60.0, 0, 2, 2, 1015),
        ]
    );
    // No sample has SM activity: utilization judged every lease that had samples.
    assert_eq!(
        judged(&signals),
        vec![
            ("L1".into(), None, Some(JudgedBy::Util)),
            ("L2".into(), None, Some(JudgedBy::Util)),
            ("L3".into(), None, None),
            ("L4".into(), None, Some(JudgedBy::Util)),
            ("L6".into(), None, Some(JudgedBy::Util)),
        ]
    );
    let rest: Vec<&SignalBody> = signals
        .iter()
        .map(|s| &s.body)
        .filter(|b| !matches!(b, SignalBody::LeaseUtilization { .. }))
        .collect();
    let unattributed = |gpu: &str, util: f64| SignalBody::GpuUnattributed {
        gpu_uuid: gpu.into(),
        host: format!("h-{gpu}"),
        util_pct: util,
    };
    let spend = |team: &str, mtd: f64, burn: f64| SignalBody::TeamSpend {
        team: team.into(),
        month_to_date_usd: mtd,
        burn_usd_per_hour: burn,
    };
    assert_eq!(
        rest,
        vec![
            &unattributed("g5", 70.0),
            &unattributed("g9", 95.0),
            &spend("ds", 20.0, 17.5),
            &spend("ml", 100.0, 12.0),
            &spend("ops", 0.0, 0.0),
        ]
    );
}

#[tokio::test]
async fn an_idle_run_longer_than_the_window_is_remembered() {
    let leases = leases();
    let mut engine = SignalEngine::new();
    compute(&mut engine, T + WINDOW, &first_window(), &leases).await;
    // The next window holds only g3's idle samples, k = 16..=30; L2 idles since k = 6.
    let later: Vec<Sample> = (16..=30).map(|k| sample("g3", k, 0.0, None)).collect();
    let ts = T + 30 * MIN;
    let l2 = |signals: &[Signal]| {
        utilization(signals)
            .into_iter()
            .find(|u| u.0 == "L2")
            .map(|u| u.3)
    };
    assert_eq!(
        l2(&compute(&mut engine, ts, &later, &leases).await),
        Some(24 * MIN)
    );
    // A fresh engine knows only the window: idle from k = 16.
    let mut fresh = SignalEngine::new();
    assert_eq!(
        l2(&compute(&mut fresh, ts, &later, &leases).await),
        Some(14 * MIN)
    );
    // A busy sample ends the run; the next idle one starts a new one.
    let mut busy_again = later.clone();
    busy_again.retain(|s| s.ts_ms != T + 20 * MIN);
    busy_again.push(sample("g3", 20, 40.0, None));
    assert_eq!(
        l2(&compute(&mut engine, ts, &busy_again, &leases).await),
        Some(9 * MIN)
    );
    // Released leases get no signal.
    let mut events = vec![event(25, "released", "L2", "ds", "NVIDIA L40S", 1, &["g3"])];
    events.extend([event(-60, "granted", "L2", "ds", "NVIDIA L40S", 1, &["g3"])]);
    let closed = Leases::from_events(events);
    assert_eq!(l2(&compute(&mut engine, ts, &later, &closed).await), None);
}

/// A sample with SM activity (a GPU with GPM).
fn gpm_sample(gpu: &str, k: i64, util: f64, sm: Option<f64>, lease: Option<&str>) -> Sample {
    let mut s = sample(gpu, k, util, lease);
    s.sm_active_pct = sm;
    s
}

/// Spinning: utilization 100 %, SM activity 2 %, for k = 1..=15, window 15 min, signals at
/// T+15m. Notebooks are judged by SM activity (`[workloads.notebook] idle_measure`), the rest
/// by `pricing.idle_measure`.
/// - S1 (notebook, g20) spins → idle since k=1: 14 min = 840,000 ms, 0 active, SM 2,
///   `sm_active`.
/// - S2 (training, g21) spins the same → judged by utilization: busy, 1 active, `util`.
/// - S3 (notebook, g22): k=1..=5 at 100 % with no SM activity (GPM not read), then spinning →
///   utilization judges the first five (busy), SM activity the rest: idle since k=6, 9 min =
///   540,000 ms, SM 2 over the samples that have it, `mixed`.
/// - g23 (no lease) spins; g24 (no lease, no GPM) runs at 70 %. With `pricing.idle_measure` =
///   `util` both are unattributed work; with `sm_active`, only g24 (utilization judges it).
#[tokio::test]
async fn a_spinning_gpu_is_idle_by_sm_activity_and_busy_by_utilization() {
    let leases = Leases::from_events(vec![
        workload_event(-60, "granted", "S1", "ml", H100, 1, &["g20"], "notebook"),
        workload_event(-60, "granted", "S2", "ml", H100, 1, &["g21"], "training"),
        workload_event(-60, "granted", "S3", "ds", H100, 1, &["g22"], "notebook"),
    ]);
    let mut samples = Vec::new();
    for k in 1..=15 {
        samples.push(gpm_sample("g20", k, 100.0, Some(2.0), Some("S1")));
        samples.push(gpm_sample("g21", k, 100.0, Some(2.0), None));
        let sm = (k > 5).then_some(2.0);
        samples.push(gpm_sample("g22", k, 100.0, sm, None));
        samples.push(gpm_sample("g23", k, 100.0, Some(2.0), None));
        samples.push(gpm_sample("g24", k, 70.0, None, None));
    }
    let by_util = config::parse(
        "t.toml",
        "[pricing]\nidle_measure = \"util\"\n\n[workloads.notebook]\nidle_measure = \"sm_active\"\n",
    )
    .unwrap();
    let by_sm = config::parse(
        "t.toml",
        "[pricing]\nidle_measure = \"sm_active\"\n\n[workloads.training]\nidle_measure = \"util\"\n",
    )
    .unwrap();
    for (config, rogue) in [
        (
            &by_util,
            vec![("g23".to_string(), 100.0), ("g24".to_string(), 70.0)],
        ),
        (&by_sm, vec![("g24".to_string(), 70.0)]),
    ] {
        let measures = idle_measures(config);
        let signals = compute_with(
            &mut SignalEngine::new(),
            T + WINDOW,
            &samples,
            &leases,
            &config.pricing,
            &measures,
        )
        .await;
        let util = utilization(&signals);
        let figures: Vec<(&str, f64, i64, u32)> =
            util.iter().map(|u| (u.0.as_str(), u.2, u.3, u.4)).collect();
        assert_eq!(
            figures,
            [
                ("S1", 100.0, 840_000, 0),
                ("S2", 100.0, 0, 1),
                ("S3", 100.0, 540_000, 1),
            ]
        );
        assert_eq!(
            judged(&signals),
            [
                ("S1".into(), Some(2.0), Some(JudgedBy::SmActive)),
                ("S2".into(), Some(2.0), Some(JudgedBy::Util)),
                ("S3".into(), Some(2.0), Some(JudgedBy::Mixed)),
            ]
        );
        assert_eq!(unattributed(&signals), rogue);
    }
    // Without any measure configured, utilization judges everything: no lease is idle.
    let signals = compute(&mut SignalEngine::new(), T + WINDOW, &samples, &leases).await;
    assert!(utilization(&signals).iter().all(|u| u.3 == 0));
    assert!(judged(&signals).iter().all(|j| j.2 == Some(JudgedBy::Util)));
}

/// A MIG sample: a slice (`MIG-…`) of H100 `GPU-p`, or (no profile) its unsliced rest.
fn slice_sample(
    gpu: &str,
    profile: Option<&str>,
    slices: u32,
    k: i64,
    (util, sm): (f64, Option<f64>),
    lease: Option<&str>,
) -> Sample {
    let mut s = gpm_sample(gpu, k, util, sm, lease);
    s.host = "h-p".into();
    s.gpu_model = match profile {
        Some(p) => format!("{H100} MIG {p}"),
        None => H100.into(),
    };
    s.gr_active_pct = sm.map(|_| util);
    s.mig_parent_uuid = profile.map(|_| "GPU-p".to_string());
    s.mig_profile = profile.map(str::to_owned);
    s.mig_slices = Some(slices);
    s.mig_parent_slices = Some(7);
    s.validate().unwrap();
    s
}

/// H100 `GPU-p`'s 7 compute slices: M1 holds `MIG-a` (3g.40gb), M2 `MIG-b` (2g.20gb), M3
/// `MIG-c` (1g.10gb); one slice is unsliced, sampled as the parent's UUID with no lease and
/// utilization 0. Each slice's utilization is its GPU instance's graphics activity. M1 runs at
/// 90 % (SM 70 %, its samples naming it), M2 at 60 % (SM 45 %, attributed by holding), M3's
/// slice idles (0 %, SM 0 %) from k=1. At T+15m: M3 idle 14 min, the others 0; five minutes
/// later (k=16..=20 alike), M3 idle 19 min: its run grows while its neighbours run. Neither the
/// unsliced rest nor any slice reads as unattributed, by either measure.
#[tokio::test]
async fn a_mig_slice_idles_on_its_own_while_its_neighbours_run() {
    let leases = Leases::from_events(vec![
        workload_event(-60, "granted", "M1", "ml", H100, 1, &["MIG-a"], "training"),
        workload_event(-60, "granted", "M2", "ds", H100, 1, &["MIG-b"], "inference"),
        workload_event(-60, "granted", "M3", "ops", H100, 1, &["MIG-c"], "notebook"),
    ]);
    let minutes = |ks: std::ops::RangeInclusive<i64>| -> Vec<Sample> {
        ks.flat_map(|k| {
            [
                slice_sample(
                    "MIG-a",
                    Some("3g.40gb"),
                    3,
                    k,
                    (90.0, Some(70.0)),
                    Some("M1"),
                ),
                slice_sample("MIG-b", Some("2g.20gb"), 2, k, (60.0, Some(45.0)), None),
                slice_sample("MIG-c", Some("1g.10gb"), 1, k, (0.0, Some(0.0)), None),
                slice_sample("GPU-p", None, 1, k, (0.0, None), None),
            ]
        })
        .collect()
    };
    for measure in [IdleMeasure::Util, IdleMeasure::SmActive] {
        let pricing = PricingConfig {
            idle_measure: measure,
            ..pricing()
        };
        let measures = IdleMeasures::new();
        let mut engine = SignalEngine::new();
        let first = minutes(1..=15);
        let at15 = compute_with(
            &mut engine,
            T + WINDOW,
            &first,
            &leases,
            &pricing,
            &measures,
        )
        .await;
        let idle = |signals: &[Signal]| -> Vec<(String, i64, u32)> {
            utilization(signals)
                .into_iter()
                .map(|u| (u.0, u.3, u.4))
                .collect()
        };
        assert_eq!(
            idle(&at15),
            [
                ("M1".into(), 0, 1),
                ("M2".into(), 0, 1),
                ("M3".into(), 14 * MIN, 0)
            ],
            "{measure:?}"
        );
        assert_eq!(unattributed(&at15), [], "{measure:?}");
        let later = minutes(6..=20);
        let at20 = compute_with(
            &mut engine,
            T + 20 * MIN,
            &later,
            &leases,
            &pricing,
            &measures,
        )
        .await;
        assert_eq!(
            idle(&at20),
            [
                ("M1".into(), 0, 1),
                ("M2".into(), 0, 1),
                ("M3".into(), 19 * MIN, 0)
            ],
            "{measure:?}"
        );
        assert_eq!(unattributed(&at20), [], "{measure:?}");
        let by = match measure {
            IdleMeasure::Util => JudgedBy::Util,
            IdleMeasure::SmActive => JudgedBy::SmActive,
        };
        assert_eq!(
            judged(&at20),
            [
                ("M1".into(), Some(70.0), Some(by)),
                ("M2".into(), Some(45.0), Some(by)),
                ("M3".into(), Some(0.0), Some(by)),
            ]
        );
    }
}
