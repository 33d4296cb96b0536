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

use std::collections::BTreeMap;

use gpuwarden_pipeline::rollup::leases::Leases;
use gpuwarden_pipeline::signals::{Inputs, SignalEngine};
use gpuwarden_schema::config::{GpuPrice, PricingConfig};
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
    let mut e = json!({"v": 1, "ts_ms": T + k * MIN, "event": kind, "lease_id": lease,
        "team": team, "user": "u", "project": "p", "workload": "training",
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
    let batch = Sample::to_record_batch(samples).unwrap();
    let spend = BTreeMap::from([
        ("ml".to_string(), 100.0),
        ("ds".to_string(), 20.0),
        ("ops".to_string(), 0.0),
    ]);
    let pricing = pricing();
    let signals = engine
        .compute(&Inputs {
            ts_ms: ts,
            window_ms: WINDOW,
            samples: &[batch],
            leases,
            month_to_date_usd: &spend,
            pricing: &pricing,
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
