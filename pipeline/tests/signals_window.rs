//! The bucketed signal window ([`SampleWindow`] + [`SignalEngine::signals`]) gives the figures of
//! the raw samples: one worked case where a lease segment starts inside a minute, and randomized
//! fleets (copies that agree and disagree, samples and lease events arriving late and out of
//! order, grants, resizes and releases at any millisecond, eviction as the window moves; GPUs
//! with SM activity, without, and with it now and then, judged by utilization or SM activity per
//! workload) checked against the engine that ran DataFusion SQL over every raw sample
//! (`reference/old_signals.rs`).

#[path = "reference/old_signals.rs"]
mod old_signals;

use std::collections::BTreeMap;

use gpuwarden_pipeline::rollup::leases::Leases;
use gpuwarden_pipeline::signals::window::{Kept, SampleFields, SampleWindow, BUCKET_MS};
use gpuwarden_pipeline::signals::{IdleMeasures, Inputs, Period, SignalEngine};
use gpuwarden_schema::config::{IdleMeasure, PricingConfig};
use gpuwarden_schema::{LeaseEvent, Record, Sample, Signal, SignalBody, Workload};
use old_signals::OldEngine;
use serde_json::json;

const T0: i64 = 1_795_996_800_000;
const S: i64 = 1_000;

fn pricing() -> PricingConfig {
    PricingConfig {
        default_usd_per_gpu_hour: 2.0,
        idle_util_pct: 5.0,
        idle_sm_active_pct: 5.0,
        ..PricingConfig::default()
    }
}

#[derive(Debug, Clone)]
struct Row {
    gpu: String,
    ts_ms: i64,
    interval_ms: i64,
    host: String,
    util: f64,
    sm: Option<f64>,
    mem: i64,
    lease: Option<String>,
}

impl Row {
    fn fields(&self) -> SampleFields<'_> {
        SampleFields {
            gpu_uuid: &self.gpu,
            ts_ms: self.ts_ms,
            interval_ms: self.interval_ms,
            host: &self.host,
            util_gpu_pct: self.util,
            sm_active_pct: self.sm,
            mem_used_bytes: self.mem,
            lease_id: self.lease.as_deref(),
        }
    }

    fn sample(&self) -> Sample {
        Sample::from_json(
            json!({"v": 1, "ts_ms": self.ts_ms, "interval_ms": self.interval_ms,
                   "host": self.host, "gpu_uuid": self.gpu, "gpu_model": "M",
                   "util_gpu_pct": self.util, "sm_active_pct": self.sm,
                   "mem_used_bytes": self.mem, "mem_total_bytes": 1_000_000_000,
                   "lease_id": self.lease})
            .to_string()
            .as_bytes(),
        )
        .unwrap()
    }
}

fn row(gpu: &str, ts_ms: i64, util: f64, lease: Option<&str>) -> Row {
    Row {
        gpu: gpu.into(),
        ts_ms,
        interval_ms: 10 * S,
        host: format!("h-{gpu}"),
        util,
        sm: None,
        mem: 1_000,
        lease: lease.map(str::to_owned),
    }
}

/// The workload of lease `L<n>`: the four in turn, so each measure judges some leases.
fn workload_of(lease: &str) -> Workload {
    let n: usize = lease.trim_start_matches('L').parse().unwrap_or(0);
    Workload::ALL[n % Workload::ALL.len()]
}

fn event(ts_ms: i64, kind: &str, lease: &str, gpus: &[String]) -> LeaseEvent {
    let mut e = json!({"v": 1, "ts_ms": ts_ms, "event": kind, "lease_id": lease,
        "team": format!("team-{lease}"), "user": "u", "project": "p",
        "workload": workload_of(lease).as_str(),
        "substrate": "sim", "gpu_model": "M", "gpu_count": gpus.len().max(1),
        "gpu_uuids": gpus});
    if kind == "released" {
        e["reason"] = json!("user");
    }
    LeaseEvent::from_json(e.to_string().as_bytes()).unwrap()
}

fn signals(
    engine: &mut SignalEngine,
    window: &mut SampleWindow,
    ts_ms: i64,
    window_ms: i64,
    leases: &Leases,
) -> Vec<Signal> {
    let (spend, pricing, measures) = (BTreeMap::new(), pricing(), IdleMeasures::new());
    engine.signals(
        window,
        &Period {
            ts_ms,
            window_ms,
            leases,
            month_to_date_usd: &spend,
            pricing: &pricing,
            idle_measures: &measures,
            release_grace_ms: 30 * S,
        },
    )
}

/// `lease_id`'s (util_pct, idle_ms, gpus_active, mem_used_max_bytes).
fn lease(signals: &[Signal], lease_id: &str) -> Option<(f64, i64, u32, u64)> {
    signals.iter().find_map(|s| match &s.body {
        SignalBody::LeaseUtilization {
            lease_id: id,
            util_pct,
            idle_ms,
            gpus_active,
            mem_used_max_bytes,
            ..
        } if id == lease_id => Some((
            (util_pct * 1e6).round() / 1e6,
            *idle_ms,
            *gpus_active,
            *mem_used_max_bytes,
        )),
        _ => None,
    })
}

/// g1 is sampled every 10 s (k = 1.., at T0 + 10 s × k) and held by A from T0 + 150.5 s, inside
/// the minute [120 s, 180 s): k ≤ 15 (90 %) were before the grant, k = 16..=24 run at 30 %,
/// k ≥ 25 at 2 % (idle). The grant arrives after every sample, which arrive newest first.
/// A copy of k = 5 names A at 0 %: the sample names an open lease, so it is A's, at 90 %
/// (each column's largest value); a copy of k = 20 at 10 % changes nothing.
///
/// At T0 + 300 s over 300 s: A has k = 5 and 16..=30 → util (90 + 9 × 30 + 6 × 2) / 16 =
/// 23.25, idle since k = 25: 50 s. After eviction to T0 + 60 s and k = 31..=36 at 2 %, at
/// T0 + 360 s: k = 16..=36 → (9 × 30 + 12 × 2) / 21 = 14, idle 110 s.
#[test]
fn a_segment_that_starts_inside_a_minute_cuts_it_exactly() {
    let mut window = SampleWindow::new(BUCKET_MS);
    for k in (1..=30).rev() {
        let util = match k {
            ..=15 => 90.0,
            16..=24 => 30.0,
            _ => 2.0,
        };
        assert_eq!(
            window.add(&row("g1", T0 + k * 10 * S, util, None).fields()),
            Kept::New
        );
    }
    assert_eq!(
        window.add(&row("g1", T0 + 50 * S, 0.0, Some("A")).fields()),
        Kept::Duplicate
    );
    assert_eq!(
        window.add(&row("g1", T0 + 200 * S, 10.0, None).fields()),
        Kept::Duplicate
    );
    assert_eq!((window.len(), window.buckets()), (30, 6));
    let leases = Leases::from_events(vec![event(T0 + 150_500, "granted", "A", &["g1".into()])]);
    let mut engine = SignalEngine::new();
    let at300 = signals(&mut engine, &mut window, T0 + 300 * S, 300 * S, &leases);
    assert_eq!(lease(&at300, "A"), Some((23.25, 50 * S, 1, 1_000)));
    // g1 is held: its samples before the grant are nobody's, and not unattributed either.
    assert!(!at300
        .iter()
        .any(|s| matches!(s.body, SignalBody::GpuUnattributed { .. })));

    window.evict_through(T0 + 60 * S);
    assert_eq!((window.len(), window.buckets()), (24, 5));
    for k in 31..=36 {
        window.add(&row("g1", T0 + k * 10 * S, 2.0, None).fields());
    }
    let at360 = signals(&mut engine, &mut window, T0 + 360 * S, 300 * S, &leases);
    assert_eq!(lease(&at360, "A"), Some((14.0, 110 * S, 1, 1_000)));
}

/// A small deterministic generator (xorshift64*), so a failing seed can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

/// Floats rounded so that sums taken in another order compare equal.
fn rounded(mut signals: Vec<Signal>) -> Vec<Signal> {
    for s in &mut signals {
        match &mut s.body {
            SignalBody::LeaseUtilization {
                util_pct,
                sm_active_pct,
                ..
            } => {
                *util_pct = (*util_pct * 1e6).round() / 1e6;
                *sm_active_pct = sm_active_pct.map(|sm| (sm * 1e6).round() / 1e6);
            }
            SignalBody::GpuUnattributed { util_pct, .. } => {
                *util_pct = (*util_pct * 1e6).round() / 1e6
            }
            _ => {}
        }
    }
    signals
}

/// What one randomized fleet exercised.
#[derive(Debug, Default)]
struct Seen {
    signals: usize,
    unattributed: usize,
    max_idle: i64,
    /// `lease_utilization` signals judged by each of `util`, `sm_active`, `mixed`.
    judged: [usize; 3],
}

/// One randomized fleet: eight GPUs for ten minutes, six leases, signals every 30 s over a
/// 3-minute window (whose start falls on a minute every other time). Some GPUs have GPM (SM
/// activity in every sample), some none, some now and then; SM activity is drawn apart from
/// utilization, so spinning samples (busy by utilization, idle by SM activity) and their
/// opposite occur. Each workload is judged by a measure drawn per fleet, or by the pricing's.
fn fleet(seed: u64) -> Seen {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let measures = [IdleMeasure::Util, IdleMeasure::SmActive];
    let mut idle_measures = IdleMeasures::new();
    for w in Workload::ALL {
        if rng.chance(75) {
            idle_measures.insert(w, *rng.pick(&measures));
        }
    }
    let pricing = PricingConfig {
        idle_measure: *rng.pick(&measures),
        ..pricing()
    };
    let gpus: Vec<String> = (0..8).map(|g| format!("g{g}")).collect();
    let lease_ids = ["L0", "L1", "L2", "L3", "L4", "L5"];
    // Lease events at any millisecond, each arriving up to a minute late.
    let mut events: Vec<(i64, LeaseEvent)> = Vec::new();
    for id in lease_ids {
        let held: Vec<String> = (0..rng.below(3))
            .map(|_| rng.pick(&gpus).clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let granted = T0 - 120 * S + rng.below(480_000) as i64;
        events.push((granted, event(granted, "granted", id, &held)));
        let mut last = granted;
        if rng.chance(40) {
            last += 1 + rng.below(180_000) as i64;
            let mut resized = held.clone();
            resized.push(rng.pick(&gpus).clone());
            resized.sort();
            resized.dedup();
            events.push((last, event(last, "resized", id, &resized)));
        }
        if rng.chance(50) {
            last += 1 + rng.below(240_000) as i64;
            events.push((last, event(last, "released", id, &held)));
        }
    }
    let events: Vec<(i64, LeaseEvent)> = events
        .into_iter()
        .map(|(ts, e)| (ts + rng.below(60_000) as i64, e))
        .collect();
    // Samples every 5 s from a random phase, some missing, some copied (the same record, or a
    // copy that disagrees), each arriving up to 90 s late.
    let utils = [0.0, 1.0, 4.5, 5.0, 20.0, 60.0, 95.0, 100.0];
    let sms = [0.0, 2.0, 4.9, 5.0, 30.0, 90.0];
    let mut arrivals: Vec<(i64, Row)> = Vec::new();
    for (g, gpu) in gpus.iter().enumerate() {
        let phase = rng.below(5_000) as i64;
        let busy = rng.chance(50);
        // Percent of its samples with SM activity: none (no GPM), all, or some.
        let gpm = *rng.pick(&[0, 100, 100, 60]);
        for k in 0..120 {
            if rng.chance(5) {
                continue;
            }
            let util = if busy || rng.chance(20) {
                *rng.pick(&utils)
            } else {
                *rng.pick(&utils[..3])
            };
            let sm = rng.chance(gpm).then(|| *rng.pick(&sms));
            let lease = match rng.below(10) {
                0..=5 => None,
                6..=8 => Some(rng.pick(&lease_ids).to_string()),
                _ => Some("X".to_string()),
            };
            let r = Row {
                gpu: gpu.clone(),
                ts_ms: T0 + phase + 5 * S * k,
                interval_ms: *rng.pick(&[5 * S, 4 * S]),
                host: format!("h{}", g % 3),
                util,
                sm,
                mem: rng.below(1_000_000) as i64,
                lease,
            };
            let late = |rng: &mut Rng| r.ts_ms + rng.below(90_000) as i64;
            if rng.chance(10) {
                arrivals.push((late(&mut rng), r.clone()));
            }
            if rng.chance(10) {
                let mut copy = r.clone();
                copy.util = *rng.pick(&utils);
                copy.sm = rng.chance(50).then(|| *rng.pick(&sms));
                copy.mem = rng.below(1_000_000) as i64;
                copy.interval_ms = *rng.pick(&[5 * S, 4 * S]);
                copy.lease = rng.chance(50).then(|| rng.pick(&lease_ids).to_string());
                copy.host = format!("h{}", rng.below(3));
                arrivals.push((late(&mut rng), copy));
            }
            arrivals.push((late(&mut rng), r));
        }
    }
    arrivals.sort_by_key(|(at, _)| *at);

    let (every, length) = (30 * S, 180 * S);
    let mut window = SampleWindow::new(BUCKET_MS);
    let mut raw: Vec<Sample> = Vec::new();
    let (mut engine, mut old) = (SignalEngine::new(), OldEngine::new());
    let (mut next, mut seen) = (0, Seen::default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for j in 1..=22 {
        let ts = T0 + j * every;
        // What arrived by `ts`; like the hot window, nothing at or before the last eviction.
        while let Some((_, r)) = arrivals.get(next).filter(|(at, _)| *at <= ts) {
            if r.ts_ms > ts - length {
                window.add(&r.fields());
            }
            raw.push(r.sample());
            next += 1;
        }
        let known: Vec<LeaseEvent> = events
            .iter()
            .filter(|(at, _)| *at <= ts)
            .map(|(_, e)| e.clone())
            .collect();
        let leases = Leases::from_events(known);
        let spend = BTreeMap::from([("team-L0".to_string(), 3.5)]);
        let period = Period {
            ts_ms: ts,
            window_ms: length,
            leases: &leases,
            month_to_date_usd: &spend,
            pricing: &pricing,
            idle_measures: &idle_measures,
            release_grace_ms: every,
        };
        let new = rounded(engine.signals(&mut window, &period));
        let batch = Sample::to_record_batch(&raw).unwrap();
        let want = rt
            .block_on(old.compute(&Inputs {
                ts_ms: ts,
                window_ms: length,
                samples: &[batch],
                leases: &leases,
                month_to_date_usd: &spend,
                pricing: &pricing,
                idle_measures: &idle_measures,
                release_grace_ms: every,
            }))
            .unwrap();
        assert_eq!(
            new,
            rounded(want),
            "seed {seed}, signals at T0 + {j} × 30 s"
        );
        seen.signals += new.len();
        for s in &new {
            match s.body {
                SignalBody::GpuUnattributed { .. } => seen.unattributed += 1,
                SignalBody::LeaseUtilization {
                    idle_ms,
                    idle_measure,
                    ..
                } => {
                    seen.max_idle = seen.max_idle.max(idle_ms);
                    if let Some(m) = idle_measure {
                        seen.judged[m as usize] += 1;
                    }
                }
                _ => {}
            }
        }
        // As the hot window does after each computation: the next one starts at ts + every −
        // length.
        window.evict_through(ts + every - length);
        assert!(window
            .timestamps()
            .first()
            .is_none_or(|t| *t > ts + every - length));
    }
    seen
}

#[test]
fn randomized_fleets_match_the_raw_sample_engine() {
    let mut all = Seen::default();
    for seed in 1..=8 {
        let seen = fleet(seed);
        all.signals += seen.signals;
        all.unattributed += seen.unattributed;
        all.max_idle = all.max_idle.max(seen.max_idle);
        for (a, s) in all.judged.iter_mut().zip(seen.judged) {
            *a += s;
        }
    }
    // The fleets exercise what they are meant to: signals of every kind, idle runs, and leases
    // judged by each measure and by both.
    assert!(all.signals > 400, "{} signals", all.signals);
    assert!(
        all.unattributed > 10,
        "{} gpu_unattributed",
        all.unattributed
    );
    assert!(
        all.max_idle > 60 * S,
        "longest idle run {} ms",
        all.max_idle
    );
    assert!(
        all.judged.iter().all(|&n| n > 10),
        "judged by util, sm_active, mixed: {:?}",
        all.judged
    );
}
