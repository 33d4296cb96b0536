//! The simulated fleet as the collector and the enforcer see it: which GPUs run which lease, and
//! whether a simulated day of each workload looks like the real thing, GPM's SM activity on
//! Hopper GPUs included (and a spinning GPU, busy to utilization and idle to SM activity).

use std::collections::{BTreeMap, BTreeSet};

use gpuwarden_collector::sim::{Fleet, Shape, SimError};
use gpuwarden_schema::config::{self, Config};
use gpuwarden_schema::{LeaseEvent, LeaseEventKind, Record, ReleaseReason, Sample, Workload, V1};

/// 2025-01-06T00:00:00Z.
const DAY0: i64 = 1_736_121_600_000;
const MIN: i64 = 60_000;
const HOUR: i64 = 60 * MIN;
const DAY: i64 = 24 * HOUR;

const H100: &str = "NVIDIA H100 80GB HBM3";

const CONFIG: &str = r#"
[[substrates]]
name = "sim"
driver = "simulated"
hosts = [
  { prefix = "h100", count = 4, gpus = 8, gpu_model = "NVIDIA H100 80GB HBM3" },
  { prefix = "a100", count = 2, gpus = 4, gpu_model = "NVIDIA A100-SXM4-40GB" },
  { prefix = "t4", count = 2, gpus = 4, gpu_model = "Tesla T4" },
]

[[substrates]]
name = "other"
driver = "simulated"
hosts = [{ prefix = "l40s", count = 1, gpus = 2, gpu_model = "NVIDIA L40S" }]

[[substrates]]
name = "box"
driver = "local"
gpu_model = "Tesla T4"
gpu_uuids = ["GPU-00000000-0000-0000-0000-000000000000"]
"#;

fn config() -> Config {
    config::parse("t.toml", CONFIG).expect("test config is valid")
}

fn fleet(seed: u64) -> Fleet {
    Fleet::new(&config().substrates[0], seed).expect("sim is a simulated substrate")
}

fn uuids(fleet: &Fleet, host: &str) -> Vec<String> {
    fleet
        .gpus()
        .iter()
        .filter(|g| g.host == host)
        .map(|g| g.uuid.clone())
        .collect()
}

struct Lease<'a> {
    id: &'a str,
    workload: Workload,
    model: &'a str,
    count: u32,
    uuids: Vec<String>,
    profile: Option<&'a str>,
}

impl Lease<'_> {
    fn event(&self, event: LeaseEventKind, ts_ms: i64) -> LeaseEvent {
        let ev = LeaseEvent {
            v: V1,
            ts_ms,
            event,
            lease_id: self.id.into(),
            team: "ml".into(),
            user: "ada".into(),
            project: "p".into(),
            workload: self.workload,
            substrate: "sim".into(),
            gpu_model: self.model.into(),
            gpu_count: self.count,
            gpu_uuids: self.uuids.clone(),
            labels: self
                .profile
                .map(|p| BTreeMap::from([("sim_profile".to_string(), p.to_string())])),
            reason: (event == LeaseEventKind::Released).then_some(ReleaseReason::User),
        };
        ev.validate().expect("test events are valid");
        ev
    }

    fn granted(&self, ts_ms: i64) -> LeaseEvent {
        self.event(LeaseEventKind::Granted, ts_ms)
    }
}

fn lease<'a>(id: &'a str, workload: Workload, uuids: Vec<String>) -> Lease<'a> {
    Lease {
        id,
        workload,
        model: H100,
        count: uuids.len() as u32,
        uuids,
        profile: None,
    }
}

/// Samples `fleet` every `step` ms over `[from, to)`, returning every sample.
fn run(fleet: &mut Fleet, from: i64, to: i64, step: i64) -> Vec<Sample> {
    let mut all = Vec::new();
    let mut ts = from + step;
    while ts <= to {
        all.extend(fleet.sample(ts, step));
        ts += step;
    }
    all
}

fn utils<'a>(samples: &'a [Sample], lease_id: &'a str) -> impl Iterator<Item = f64> + 'a {
    samples
        .iter()
        .filter(move |s| s.lease_id.as_deref() == Some(lease_id))
        .map(|s| s.util_gpu_pct)
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0), |(s, n), v| (s + v, n + 1));
    assert!(n > 0, "no values");
    sum / f64::from(n)
}

fn share(values: impl Iterator<Item = f64>, pred: impl Fn(f64) -> bool) -> f64 {
    let (hits, n) = values.fold((0, 0), |(h, n), v| (h + u32::from(pred(v)), n + 1));
    f64::from(hits) / f64::from(n)
}

/// A fleet running one lease of each shape from midnight, sampled every minute for a day.
fn day_of_every_shape(seed: u64) -> (Fleet, Vec<Sample>) {
    let mut fleet = fleet(seed);
    let h0 = uuids(&fleet, "h100-0");
    let h1 = uuids(&fleet, "h100-1");
    let leases = [
        lease("train", Workload::Training, h0.clone()),
        lease("serve", Workload::Inference, h1[..2].to_vec()),
        lease("nb", Workload::Notebook, h1[2..3].to_vec()),
        Lease {
            profile: Some("stuck"),
            ..lease("hung", Workload::Training, h1[3..4].to_vec())
        },
        lease("job", Workload::Batch, h1[4..6].to_vec()),
        Lease {
            profile: Some("idle"),
            ..lease("sleepy", Workload::Notebook, h1[6..7].to_vec())
        },
    ];
    for l in &leases {
        fleet.apply(&l.granted(DAY0));
    }
    let samples = run(&mut fleet, DAY0, DAY0 + DAY, MIN);
    (fleet, samples)
}

#[test]
fn a_day_of_each_workload_has_its_shape() {
    let (_, samples) = day_of_every_shape(42);

    let training = mean(utils(&samples, "train"));
    let training_dips = share(utils(&samples, "train"), |u| u < 20.0);
    assert!(training > 85.0, "training mean util {training}");
    assert!(training_dips > 0.01, "training dips {training_dips}");

    let hour_of = |s: &Sample| (s.ts_ms - 1 - DAY0) / HOUR;
    let serve = |hours: std::ops::Range<i64>| {
        mean(
            samples
                .iter()
                .filter(|s| s.lease_id.as_deref() == Some("serve"))
                .filter(|s| hours.contains(&hour_of(s)))
                .map(|s| s.util_gpu_pct),
        )
    };
    let (afternoon, night) = (serve(12..18), serve(0..6));
    assert!(
        afternoon > night + 30.0,
        "inference afternoon {afternoon} vs night {night}"
    );

    let nb_quiet = share(utils(&samples, "nb"), |u| u < 5.0);
    let nb_bursts = share(utils(&samples, "nb"), |u| u > 30.0);
    assert!(nb_quiet > 0.8, "notebook quiet share {nb_quiet}");
    assert!(nb_bursts > 0.005, "notebook burst share {nb_bursts}");

    let batch = mean(utils(&samples, "job"));
    let batch_min = utils(&samples, "job").fold(100.0, f64::min);
    assert!(
        batch > 85.0 && batch_min > 80.0,
        "batch {batch}, min {batch_min}"
    );

    for s in samples
        .iter()
        .filter(|s| s.lease_id.as_deref() == Some("hung"))
    {
        assert_eq!(s.util_gpu_pct, 0.0);
        let held = s.mem_used_bytes as f64 / s.mem_total_bytes as f64;
        assert!((0.5..0.7).contains(&held), "stuck memory share {held}");
        assert_eq!(s.process_count, Some(1));
    }
    for s in samples
        .iter()
        .filter(|s| s.lease_id.as_deref() == Some("train"))
    {
        let held = s.mem_used_bytes as f64 / s.mem_total_bytes as f64;
        assert!((0.7..=0.95).contains(&held), "training memory share {held}");
    }
    eprintln!(
        "training mean {training:.1}% ({:.1}% of minutes < 20%); inference 12-18h {afternoon:.1}% \
         vs 0-6h {night:.1}%; notebook < 5% in {:.1}%, > 30% in {:.1}%; batch mean {batch:.1}%",
        100.0 * training_dips,
        100.0 * nb_quiet,
        100.0 * nb_bursts
    );
}

#[test]
fn free_gpus_read_idle_and_unattributed() {
    let (fleet, samples) = day_of_every_shape(42);
    let busy: BTreeSet<String> = uuids(&fleet, "h100-0")
        .into_iter()
        .chain(uuids(&fleet, "h100-1").into_iter().take(7))
        .collect();
    let free: Vec<&Sample> = samples
        .iter()
        .filter(|s| !busy.contains(&s.gpu_uuid))
        .collect();
    assert_eq!(free.len(), (fleet.gpus().len() - busy.len()) * 1440);
    for s in free {
        assert_eq!(s.util_gpu_pct, 0.0);
        assert_eq!(s.mem_used_bytes, 0);
        assert_eq!(s.process_count, Some(0));
        assert_eq!(s.lease_id, None);
        assert_eq!(s.util_mem_pct, Some(0.0));
        let gpu = fleet.gpus().iter().find(|g| g.uuid == s.gpu_uuid).unwrap();
        let power = s.power_w.unwrap();
        assert!(
            power >= gpu.idle_power_w && power < gpu.idle_power_w * 1.2 + 2.0,
            "free {} draws {power} W",
            gpu.model
        );
    }
}

#[test]
fn an_idle_profile_keeps_a_notebook_idle_all_day() {
    let (_, samples) = day_of_every_shape(7);
    let sleepy: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.lease_id.as_deref() == Some("sleepy"))
        .collect();
    assert_eq!(sleepy.len(), 1440);
    for s in sleepy {
        assert_eq!(s.util_gpu_pct, 0.0);
        assert_eq!(s.process_count, Some(1));
        assert!(s.mem_used_bytes > 0 && s.mem_used_bytes < s.mem_total_bytes / 50);
        assert!(s.power_w.unwrap() < 70.0 + 0.05 * 630.0);
    }
}

#[test]
fn every_sample_is_valid_with_physical_power_and_energy() {
    let (fleet, samples) = day_of_every_shape(3);
    assert_eq!(samples.len(), fleet.gpus().len() * 1440);
    let mut energy: BTreeMap<&str, u64> = BTreeMap::new();
    for s in &samples {
        s.validate()
            .unwrap_or_else(|e| panic!("invalid sample {s:?}: {e}"));
        let gpu = fleet.gpus().iter().find(|g| g.uuid == s.gpu_uuid).unwrap();
        assert_eq!(s.interval_ms, MIN);
        assert_eq!((&s.host, &s.gpu_model), (&gpu.host, &gpu.model));
        assert_eq!(s.gpu_index, Some(gpu.index));
        assert_eq!(s.pci_bus_id.as_deref(), Some(gpu.pci_bus_id.as_str()));
        assert_eq!(s.mem_total_bytes, gpu.mem_total_bytes);
        assert_eq!(s.power_limit_w, Some(gpu.power_limit_w));
        assert_eq!((s.mig_profile.as_ref(), s.labels.as_ref()), (None, None));
        let power = s.power_w.unwrap();
        assert!(
            (gpu.idle_power_w..=gpu.power_limit_w).contains(&power),
            "{power} W outside {}..={} W",
            gpu.idle_power_w,
            gpu.power_limit_w
        );
        let temp = s.temp_c.unwrap();
        assert!((25.0..=90.0).contains(&temp), "{temp} C");
        let mem_util = s.util_mem_pct.unwrap();
        assert!((0.0..=s.util_gpu_pct.ceil()).contains(&mem_util));
        let e = s.energy_mj.unwrap();
        let last = energy.insert(&s.gpu_uuid, e).unwrap_or(0);
        assert!(e >= last, "energy went from {last} to {e} mJ");
    }
    // A day at 700 W at most, 70 W at least: 6.048e9 mJ and 6.048e8 mJ.
    for (uuid, e) in energy {
        let gpu = fleet.gpus().iter().find(|g| g.uuid == uuid).unwrap();
        let (lo, hi) = (
            gpu.idle_power_w * 86_400_000.0,
            gpu.power_limit_w * 86_400_000.0,
        );
        assert!((lo..=hi).contains(&(e as f64 + 1.0)), "{uuid}: {e} mJ");
    }
    let train_gpu = &fleet.gpus()[0];
    let train = samples
        .iter()
        .filter(|s| s.gpu_uuid == train_gpu.uuid)
        .map(|s| s.power_w.unwrap());
    let train_power = mean(train);
    assert!(
        train_power > 500.0,
        "training H100 mean power {train_power} W"
    );
    let clocks: BTreeSet<u32> = samples.iter().filter_map(|s| s.sm_clock_mhz).collect();
    assert!(
        clocks.contains(&1980) && clocks.contains(&345),
        "{clocks:?}"
    );
}

#[test]
fn the_same_seed_gives_the_same_samples_and_another_seed_does_not() {
    let (_, a) = day_of_every_shape(11);
    let (_, b) = day_of_every_shape(11);
    let (_, c) = day_of_every_shape(12);
    assert_eq!(a, b);
    assert_ne!(a, c);
    let differing = a
        .iter()
        .zip(&c)
        .filter(|(x, y)| x.util_gpu_pct != y.util_gpu_pct)
        .count();
    assert!(differing > a.len() / 10, "{differing} of {}", a.len());
}

#[test]
fn a_minute_sample_is_the_mean_of_its_five_second_samples() {
    let mut coarse = fleet(5);
    let mut fine = fleet(5);
    let h0 = uuids(&coarse, "h100-0");
    for f in [&mut coarse, &mut fine] {
        f.apply(&lease("train", Workload::Training, h0[..4].to_vec()).granted(DAY0));
        f.apply(&lease("serve", Workload::Inference, h0[4..].to_vec()).granted(DAY0));
    }
    let minutes = run(&mut coarse, DAY0, DAY0 + 3 * HOUR, MIN);
    let ticks = run(&mut fine, DAY0, DAY0 + 3 * HOUR, 5_000);
    let n = coarse.gpus().len();
    for (m, minute) in minutes.chunks(n).enumerate() {
        for (g, s) in minute.iter().enumerate() {
            let from_ticks = mean((0..12).map(|k| ticks[(12 * m + k) * n + g].util_gpu_pct));
            assert!(
                (s.util_gpu_pct - from_ticks).abs() < 1e-9,
                "minute {m}, GPU {g}: {} vs {from_ticks}",
                s.util_gpu_pct
            );
            // GPM's measures too, on the Hopper GPUs (none on the others).
            let tick_sm = (0..12).map(|k| ticks[(12 * m + k) * n + g].sm_active_pct);
            match s.sm_active_pct {
                Some(sm) => {
                    let from_ticks = mean(tick_sm.map(Option::unwrap));
                    assert!(
                        (sm - from_ticks).abs() < 1e-9,
                        "minute {m}, GPU {g}: SM {sm} vs {from_ticks}"
                    );
                }
                None => assert!(tick_sm.into_iter().all(|t| t.is_none())),
            }
            assert_eq!(s.ts_ms, ticks[(12 * m + 11) * n + g].ts_ms);
        }
    }
    // Energy integrates the same power either way, up to rounding to whole millijoules.
    let last_minute = &minutes[minutes.len() - n..];
    let last_tick = &ticks[ticks.len() - n..];
    for (a, b) in last_minute.iter().zip(last_tick) {
        let (a, b) = (a.energy_mj.unwrap() as f64, b.energy_mj.unwrap() as f64);
        assert!((a - b).abs() <= 1.0 + a * 1e-9, "{a} vs {b} mJ");
    }
}

#[test]
fn sampling_order_does_not_change_values() {
    let mut forward = fleet(9);
    let mut backward = fleet(9);
    let h0 = uuids(&forward, "h100-0");
    for f in [&mut forward, &mut backward] {
        f.apply(&lease("nb", Workload::Notebook, h0.clone()).granted(DAY0));
    }
    let times: Vec<i64> = (1..=120).map(|k| DAY0 + k * MIN).collect();
    let a: Vec<Sample> = times.iter().flat_map(|&t| forward.sample(t, MIN)).collect();
    let mut b: Vec<Sample> = times
        .iter()
        .rev()
        .flat_map(|&t| backward.sample(t, MIN))
        .collect();
    let n = forward.gpus().len();
    b = b.chunks(n).rev().flatten().cloned().collect();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            (x.util_gpu_pct, x.mem_used_bytes, x.power_w, &x.lease_id),
            (y.util_gpu_pct, y.mem_used_bytes, y.power_w, &y.lease_id)
        );
    }
}

fn held_by(fleet: &Fleet, lease_id: &str) -> Vec<String> {
    fleet
        .gpus()
        .iter()
        .filter(|g| fleet.lease_on(&g.uuid) == Some(lease_id))
        .map(|g| g.uuid.clone())
        .collect()
}

fn sampled_lease(samples: &[Sample], lease_id: &str) -> BTreeSet<String> {
    samples
        .iter()
        .filter(|s| s.lease_id.as_deref() == Some(lease_id))
        .map(|s| s.gpu_uuid.clone())
        .collect()
}

#[test]
fn a_lease_runs_on_exactly_its_gpus_until_resized_and_released() {
    let mut fleet = fleet(1);
    let h2 = uuids(&fleet, "h100-2");
    let mut train = lease("train", Workload::Training, h2[..4].to_vec());
    fleet.apply(&train.granted(DAY0));

    let before = fleet.sample(DAY0, MIN);
    assert!(
        sampled_lease(&before, "train").is_empty(),
        "not before grant"
    );
    let s = fleet.sample(DAY0 + MIN, MIN);
    let on: BTreeSet<String> = h2[..4].iter().cloned().collect();
    assert_eq!(sampled_lease(&s, "train"), on);
    for x in &s {
        let leased = on.contains(&x.gpu_uuid);
        assert_eq!(x.process_count, Some(u32::from(leased)));
        assert_eq!(x.mem_used_bytes > 0, leased);
    }

    train.uuids = h2[..2].to_vec();
    train.count = 2;
    fleet.apply(&train.event(LeaseEventKind::Resized, DAY0 + 10 * MIN));
    let s = fleet.sample(DAY0 + 11 * MIN, MIN);
    let on: BTreeSet<String> = h2[..2].iter().cloned().collect();
    assert_eq!(sampled_lease(&s, "train"), on);
    for x in s
        .iter()
        .filter(|x| x.gpu_uuid == h2[2] || x.gpu_uuid == h2[3])
    {
        assert_eq!((x.util_gpu_pct, x.mem_used_bytes), (0.0, 0));
        assert_eq!((x.process_count, x.lease_id.as_deref()), (Some(0), None));
    }

    // A duplicate changes nothing; releasing what is unknown changes nothing.
    fleet.apply(&train.event(LeaseEventKind::Resized, DAY0 + 10 * MIN));
    fleet.apply(&lease("ghost", Workload::Batch, vec![]).event(LeaseEventKind::Released, DAY0));
    assert_eq!(held_by(&fleet, "train"), h2[..2].to_vec());

    fleet.apply(&train.event(LeaseEventKind::Released, DAY0 + 20 * MIN));
    let s = fleet.sample(DAY0 + 21 * MIN, MIN);
    assert!(s.iter().all(|x| x.lease_id.is_none()));
    assert!(s
        .iter()
        .all(|x| x.util_gpu_pct == 0.0 && x.mem_used_bytes == 0));
    fleet.apply(&train.event(LeaseEventKind::Released, DAY0 + 20 * MIN));
    assert!(held_by(&fleet, "train").is_empty());
}

#[test]
fn a_lease_without_uuids_is_packed_onto_the_fewest_hosts() {
    let mut fleet = fleet(1);
    let h0 = uuids(&fleet, "h100-0");
    let h1 = uuids(&fleet, "h100-1");
    // Leaves 3 free on h100-0 and 6 on h100-1; h100-2 and h100-3 are empty.
    let busy: Vec<String> = h0[..5].iter().chain(&h1[..2]).cloned().collect();
    fleet.apply(&lease("busy", Workload::Batch, busy).granted(DAY0));

    let hosts_of = |fleet: &Fleet, id: &str| -> BTreeMap<String, usize> {
        let mut hosts = BTreeMap::new();
        for g in fleet.gpus() {
            if fleet.lease_on(&g.uuid) == Some(id) {
                *hosts.entry(g.host.clone()).or_insert(0) += 1;
            }
        }
        hosts
    };
    let pick = |id: &'static str, model: &'static str, count: u32| Lease {
        id,
        workload: Workload::Training,
        model,
        count,
        uuids: vec![],
        profile: None,
    };
    fleet.apply(&pick("three", H100, 3).granted(DAY0));
    assert_eq!(
        hosts_of(&fleet, "three"),
        BTreeMap::from([("h100-0".into(), 3)])
    );
    fleet.apply(&pick("six", H100, 6).granted(DAY0));
    assert_eq!(
        hosts_of(&fleet, "six"),
        BTreeMap::from([("h100-1".into(), 6)])
    );
    fleet.apply(&pick("ten", H100, 10).granted(DAY0));
    assert_eq!(
        hosts_of(&fleet, "ten"),
        BTreeMap::from([("h100-2".into(), 8), ("h100-3".into(), 2)])
    );
    fleet.apply(&pick("t4s", "Tesla T4", 2).granted(DAY0));
    assert_eq!(
        hosts_of(&fleet, "t4s"),
        BTreeMap::from([("t4-0".into(), 2)])
    );

    // Growing keeps what it has and stays beside it; shrinking keeps the packed part.
    fleet.apply(&pick("ten", H100, 12).event(LeaseEventKind::Resized, DAY0 + MIN));
    assert_eq!(
        hosts_of(&fleet, "ten"),
        BTreeMap::from([("h100-2".into(), 8), ("h100-3".into(), 4)])
    );
    fleet.apply(&pick("ten", H100, 8).event(LeaseEventKind::Resized, DAY0 + MIN));
    assert_eq!(
        hosts_of(&fleet, "ten"),
        BTreeMap::from([("h100-2".into(), 8)])
    );

    // A repeated grant is a no-op, and the samples carry the lease.
    let before = held_by(&fleet, "six");
    fleet.apply(&pick("six", H100, 6).granted(DAY0 + 2 * MIN));
    assert_eq!(held_by(&fleet, "six"), before);
    let s = fleet.sample(DAY0 + 3 * MIN, MIN);
    assert_eq!(
        sampled_lease(&s, "six"),
        before.into_iter().collect::<BTreeSet<_>>()
    );
}

#[test]
fn gpus_and_events_of_another_fleet_are_ignored() {
    let config = config();
    let other = Fleet::new(&config.substrates[1], 1).unwrap();
    let mut fleet = fleet(1);
    let mine = uuids(&fleet, "t4-1")[0].clone();
    let theirs = other.gpus()[0].uuid.clone();
    let mut mixed = lease("mixed", Workload::Inference, vec![mine.clone(), theirs]);
    mixed.model = "Tesla T4";
    fleet.apply(&mixed.granted(DAY0));
    assert_eq!(held_by(&fleet, "mixed"), vec![mine.clone()]);

    // An event for another substrate, even naming our GPUs, is not ours to run.
    let mut elsewhere = lease("elsewhere", Workload::Training, uuids(&fleet, "h100-3"));
    elsewhere.model = H100;
    let mut ev = elsewhere.granted(DAY0);
    ev.substrate = "other".into();
    fleet.apply(&ev);
    assert!(held_by(&fleet, "elsewhere").is_empty());
    let s = fleet.sample(DAY0 + MIN, MIN);
    assert_eq!(s.len(), fleet.gpus().len());
    assert_eq!(
        sampled_lease(&s, "mixed"),
        BTreeSet::from([mine.to_string()])
    );
}

#[test]
fn unleased_work_shows_without_a_lease_id() {
    let mut fleet = fleet(2);
    let rogue = uuids(&fleet, "a100-1")[1].clone();
    fleet.set_unleased(&rogue, Some(Shape::Batch));
    fleet.set_unleased("GPU-not-here", Some(Shape::Batch));
    let s = run(&mut fleet, DAY0, DAY0 + HOUR, MIN);
    let busy: Vec<&Sample> = s.iter().filter(|x| x.gpu_uuid == rogue).collect();
    assert_eq!(busy.len(), 60);
    for x in &busy {
        assert!(x.util_gpu_pct > 80.0, "{}", x.util_gpu_pct);
        assert_eq!((x.process_count, x.lease_id.as_deref()), (Some(1), None));
    }
    assert!(s
        .iter()
        .filter(|x| x.gpu_uuid != rogue)
        .all(|x| x.util_gpu_pct == 0.0));
    fleet.set_unleased(&rogue, None);
    let s = fleet.sample(DAY0 + HOUR + MIN, MIN);
    assert!(s
        .iter()
        .all(|x| x.util_gpu_pct == 0.0 && x.process_count == Some(0)));
}

#[test]
fn odd_input_is_harmless() {
    let mut fleet = fleet(4);
    let mut greedy = lease("greedy", Workload::Training, vec![]);
    greedy.count = u32::MAX;
    let mut ev = greedy.granted(i64::MIN);
    fleet.apply(&ev);
    // Everything of its model is held, nothing else.
    assert_eq!(held_by(&fleet, "greedy").len(), 32);
    ev.gpu_uuids = vec!["GPU-nope".into(); 3];
    ev.gpu_count = 0;
    fleet.apply(&ev);
    assert!(held_by(&fleet, "greedy").is_empty());
    for (ts, interval) in [(i64::MIN, 1), (i64::MAX, i64::MAX), (0, -5), (DAY0, 0)] {
        let s = fleet.sample(ts, interval);
        assert_eq!(s.len(), fleet.gpus().len());
        assert!(s.iter().all(|x| (0.0..=100.0).contains(&x.util_gpu_pct)));
    }
}

#[test]
fn only_a_simulated_substrate_has_a_fleet() {
    let config = config();
    let err = Fleet::new(&config.substrates[2], 1).unwrap_err();
    assert!(matches!(err, SimError::NotSimulated { .. }));
    let message = err.to_string();
    assert!(
        message.contains("`box`") && message.contains("local driver"),
        "{message}"
    );
}

#[test]
fn models_report_their_real_memory_and_power_limits() {
    let fleet = fleet(1);
    let by_model: BTreeMap<&str, (u64, f64)> = fleet
        .gpus()
        .iter()
        .map(|g| (g.model.as_str(), (g.mem_total_bytes, g.power_limit_w)))
        .collect();
    assert_eq!(by_model[H100], (81_559 << 20, 700.0));
    assert_eq!(by_model["NVIDIA A100-SXM4-40GB"], (40_960 << 20, 400.0));
    assert_eq!(by_model["Tesla T4"], (15_360 << 20, 70.0));
}

/// `cargo test --release -p gpuwarden-collector --test sim_shapes -- --ignored --nocapture`
#[test]
#[ignore = "a timing, not a check; run in release mode"]
fn sampling_ten_thousand_gpus_is_cheap() {
    let text = r#"
[[substrates]]
name = "big"
driver = "simulated"
hosts = [{ prefix = "node", count = 1250, gpus = 8, gpu_model = "NVIDIA H100 80GB HBM3" }]
"#;
    let config = config::parse("t.toml", text).unwrap();
    let mut fleet = Fleet::new(&config.substrates[0], 1).unwrap();
    for (i, chunk) in fleet.gpus().to_vec().chunks(8).enumerate().take(1000) {
        let workload = Workload::ALL[i % 4];
        let mut ev = lease(
            "x",
            workload,
            chunk.iter().map(|g| g.uuid.clone()).collect(),
        )
        .granted(DAY0);
        ev.substrate = "big".into();
        ev.lease_id = format!("lease-{i}");
        fleet.apply(&ev);
    }
    for interval in [5_000, MIN] {
        let started = std::time::Instant::now();
        let rounds = 20;
        for k in 1..=rounds {
            let s = fleet.sample(DAY0 + k * interval, interval);
            assert_eq!(s.len(), 10_000);
        }
        eprintln!(
            "10,000 GPUs, {} s interval: {:?} per sample call",
            interval / 1000,
            started.elapsed() / rounds as u32
        );
    }
}

#[test]
fn an_inference_lease_spreads_its_traffic_over_the_gpus_it_holds() {
    // Two fleets with the same seed run the same inference lease on 4 GPUs; in one it is
    // resized to 2 at 01:00. Its traffic is the same, so each remaining GPU carries twice the
    // load (capped at 100 %), and a training lease resized the same way does not change.
    let mut steady = fleet(3);
    let mut resized = fleet(3);
    let h0 = uuids(&steady, "h100-0");
    let mut serve = lease("serve", Workload::Inference, h0[..4].to_vec());
    steady.apply(&serve.granted(DAY0));
    resized.apply(&serve.granted(DAY0));
    serve.uuids = h0[..2].to_vec();
    serve.count = 2;
    resized.apply(&serve.event(LeaseEventKind::Resized, DAY0 + 60 * MIN));
    let from = DAY0 + 61 * MIN;
    let a = run(&mut steady, from, from + 60 * MIN, MIN);
    let b = run(&mut resized, from, from + 60 * MIN, MIN);
    let on_kept = |samples: &[Sample]| -> Vec<f64> {
        samples
            .iter()
            .filter(|s| s.lease_id.as_deref() == Some("serve") && h0[..2].contains(&s.gpu_uuid))
            .map(|s| s.util_gpu_pct)
            .collect()
    };
    let (a, b) = (on_kept(&a), on_kept(&b));
    assert_eq!(a.len(), b.len());
    assert!(!a.is_empty());
    for (x, y) in a.iter().zip(&b) {
        assert!(
            (y - (2.0 * x).min(100.0)).abs() <= 1.0,
            "{x} on 4 GPUs, {y} on 2"
        );
    }
    // Back to its grant's size, the load per GPU is as before.
    serve.uuids = h0[..4].to_vec();
    serve.count = 4;
    resized.apply(&serve.event(LeaseEventKind::Resized, DAY0 + 130 * MIN));
    let a = run(&mut steady, DAY0 + 131 * MIN, DAY0 + 141 * MIN, MIN);
    let b = run(&mut resized, DAY0 + 131 * MIN, DAY0 + 141 * MIN, MIN);
    assert_eq!(
        utils(&a, "serve").collect::<Vec<_>>(),
        utils(&b, "serve").collect::<Vec<_>>()
    );
}

#[test]
fn hopper_gpus_report_sm_activity_that_follows_their_work() {
    let (fleet, samples) = day_of_every_shape(42);
    let gpm = |s: &Sample| {
        [
            s.sm_active_pct,
            s.sm_occupancy_pct,
            s.tensor_active_pct,
            s.dram_active_pct,
            s.gr_active_pct,
        ]
    };
    for s in &samples {
        if s.gpu_model != H100 {
            assert_eq!(gpm(s), [None; 5], "{} has no GPM", s.gpu_model);
            continue;
        }
        let [sm, occupancy, tensor, dram, gr] = gpm(s).map(|v| v.expect("an H100 has GPM"));
        // Graphics activity is utilization; SM activity, occupancy and tensor work are shares
        // of it; memory bandwidth follows the memory controller's utilization.
        assert!(
            (gr - s.util_gpu_pct).abs() < 1e-9,
            "{gr} vs {}",
            s.util_gpu_pct
        );
        assert!(
            sm <= s.util_gpu_pct && occupancy <= sm && tensor <= sm,
            "{s:?}"
        );
        assert!((dram - s.util_mem_pct.unwrap()).abs() <= 0.5, "{s:?}");
        if s.lease_id.is_none() {
            assert_eq!([sm, occupancy, tensor, dram, gr], [0.0; 5], "a free GPU");
        }
    }
    let sm_of = |lease: &str| {
        mean(
            samples
                .iter()
                .filter(|s| s.lease_id.as_deref() == Some(lease))
                .map(|s| s.sm_active_pct.unwrap()),
        )
    };
    let training = sm_of("train") / mean(utils(&samples, "train"));
    assert!(
        (0.8..0.9).contains(&training),
        "training SM/util {training}"
    );
    let serve = sm_of("serve") / mean(utils(&samples, "serve"));
    assert!((0.5..0.6).contains(&serve), "inference SM/util {serve}");
    assert_eq!(sm_of("hung"), 0.0);
    assert!(fleet.gpus().iter().any(|g| g.model != H100));
}

#[test]
fn a_spinning_lease_reads_busy_to_utilization_and_idle_to_sm_activity() {
    let mut fleet = fleet(13);
    let h0 = uuids(&fleet, "h100-0");
    let a0 = uuids(&fleet, "a100-0");
    let spinning = |id, uuids: Vec<String>, model| Lease {
        profile: Some("spinning"),
        model,
        ..lease(id, Workload::Notebook, uuids)
    };
    fleet.apply(&spinning("spin", h0[..2].to_vec(), H100).granted(DAY0));
    fleet.apply(&spinning("spin-a100", a0[..1].to_vec(), "NVIDIA A100-SXM4-40GB").granted(DAY0));
    fleet.apply(&lease("train", Workload::Training, h0[2..4].to_vec()).granted(DAY0));
    let samples = run(&mut fleet, DAY0, DAY0 + 2 * HOUR, MIN);
    let of = |id: &str| -> Vec<&Sample> {
        samples
            .iter()
            .filter(|s| s.lease_id.as_deref() == Some(id))
            .collect()
    };
    let (spin, spin_a100, train) = (of("spin"), of("spin-a100"), of("train"));
    assert_eq!((spin.len(), spin_a100.len()), (2 * 120, 120));
    for s in spin.iter().chain(&spin_a100) {
        assert!(s.util_gpu_pct >= 99.0, "{}", s.util_gpu_pct);
        assert_eq!(s.process_count, Some(1));
        let held = s.mem_used_bytes as f64 / s.mem_total_bytes as f64;
        assert!((0.4..=0.61).contains(&held), "spinning memory share {held}");
        // Barely more power than a held context, and cool.
        let power = s.power_w.unwrap();
        let limit = s.power_limit_w.unwrap();
        assert!(power < limit * 0.3, "spinning draws {power} W of {limit} W");
        assert!(
            s.temp_c.unwrap() < 50.0,
            "spinning at {} C",
            s.temp_c.unwrap()
        );
        s.validate().unwrap();
    }
    for s in &spin {
        let sm = s.sm_active_pct.unwrap();
        assert!((1.5..=2.5).contains(&sm), "SM active {sm}");
        assert_eq!(s.tensor_active_pct, Some(0.0));
        assert!(s.gr_active_pct.unwrap() >= 99.0);
    }
    // An A100 has no GPM: nothing tells its spinning from work.
    assert!(spin_a100.iter().all(|s| s.sm_active_pct.is_none()));
    let train_power = mean(train.iter().map(|s| s.power_w.unwrap()));
    let spin_power = mean(spin.iter().map(|s| s.power_w.unwrap()));
    assert!(
        spin_power * 2.5 < train_power,
        "spinning {spin_power} W, training {train_power} W"
    );
}
