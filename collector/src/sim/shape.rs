//! What a GPU does under each kind of work, as functions of time.
//!
//! Utilization is defined at any instant `t` as a pure function of `(shape, lease key, GPU key,
//! t)`; the keys already hold the seed. Lease-wide events (a training job's checkpoint, a traffic
//! spike, a notebook cell running) hash the lease key, so every GPU of a lease moves together as
//! it does on real hardware; per-reading jitter hashes the GPU key and the 5 s tick. Power, memory
//! clocks and temperature are derived from utilization and the shape; so are the GPM measures
//! ([`gpm`]) of the models that have GPM.

use gpuwarden_schema::{LeaseEvent, Workload};

use super::models::ModelSpec;
use super::noise::{hash, uniform, unit};

/// The label on a lease that overrides the shape its workload implies (`sim_profile = "idle"`).
pub const PROFILE_LABEL: &str = "sim_profile";

/// Readings are jittered once per tick, like an exporter polling NVML every 5 s.
pub(crate) const TICK_MS: i64 = 5_000;
const MINUTE_MS: i64 = 60_000;
const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 24 * HOUR_MS;

// Independent noise streams drawn from the same key.
const S_LEVEL: u64 = 1;
const S_NOISE: u64 = 2;
const S_PERIOD: u64 = 3;
const S_OFFSET: u64 = 4;
const S_DIP: u64 = 5;
const S_BURST: u64 = 6;
const S_MEM: u64 = 7;
const S_MEM_GPU: u64 = 8;
const S_GPM: u64 = 9;

/// The load pattern a simulated GPU follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shape {
    /// Steady 90–99 % with a checkpoint every 30–60 min (per lease), during which utilization
    /// drops to 0–15 % for 5–8 % of the period (1.5–5 min); memory 70–95 %, constant.
    Training,
    /// Diurnal load peaking at 15:00 UTC (~70 %) with its trough at 03:00 UTC (~10 %), traffic
    /// spikes of +15–30 % in about one minute in seven, and per-reading jitter; memory 30–50 %,
    /// constant. That is the load of the lease's traffic spread over the GPUs it was granted:
    /// resized to other GPU counts, each GPU carries `granted / now` times as much (at most
    /// 100 %), as replicas behind a load balancer do, so autoscaling converges.
    Inference,
    /// Mostly idle (0–3 %); in about a third of 15 min slots a cell runs for 1–5 min at
    /// 30–80 %; memory 15–40 %, held throughout.
    Notebook,
    /// A hung process: memory held (55–65 %), utilization exactly 0.
    Stuck,
    /// A process that holds a context and does nothing: utilization 0, about 1 % of memory, power
    /// at idle draw.
    Idle,
    /// Steady 88–99 % like training, with no checkpoint dips; memory 40–80 %.
    Batch,
    /// A GPU that reads busy and does nothing: a rank spinning in an NCCL collective that never
    /// completes, or a loop launching one tiny kernel after another. Utilization 99–100 %, but
    /// SM activity 1.5–2.5 % (one block or two on the SMs), no tensor work, little memory
    /// traffic; memory 40–60 % held; power and heat barely above a held context's.
    Spinning,
}

impl Shape {
    /// Every shape, in a stable order.
    pub const ALL: [Shape; 7] = [
        Self::Training,
        Self::Inference,
        Self::Notebook,
        Self::Stuck,
        Self::Idle,
        Self::Batch,
        Self::Spinning,
    ];

    /// The name used in the `sim_profile` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Training => "training",
            Self::Inference => "inference",
            Self::Notebook => "notebook",
            Self::Stuck => "stuck",
            Self::Idle => "idle",
            Self::Batch => "batch",
            Self::Spinning => "spinning",
        }
    }

    /// The shape named `name` (case-insensitive, surrounding spaces ignored).
    pub fn parse(name: &str) -> Option<Shape> {
        let name = name.trim();
        Self::ALL
            .into_iter()
            .find(|s| s.as_str().eq_ignore_ascii_case(name))
    }

    /// The shape a workload runs when nothing overrides it.
    pub fn of_workload(workload: Workload) -> Shape {
        match workload {
            Workload::Training => Self::Training,
            Workload::Inference => Self::Inference,
            Workload::Notebook => Self::Notebook,
            Workload::Batch => Self::Batch,
        }
    }

    /// The shape a lease runs: its `sim_profile` label when that names a shape, else its
    /// workload's. An unknown profile is ignored rather than refused: the label is a test aid,
    /// and the enforcer does not check it.
    pub fn of_lease(event: &LeaseEvent) -> Shape {
        event
            .labels
            .as_ref()
            .and_then(|labels| labels.get(PROFILE_LABEL))
            .and_then(|name| Shape::parse(name))
            .unwrap_or_else(|| Shape::of_workload(event.workload))
    }

    /// Share of memory bandwidth used per unit of SM utilization.
    fn mem_util_ratio(self) -> f64 {
        match self {
            Self::Training => 0.55,
            Self::Inference => 0.5,
            Self::Notebook => 0.35,
            Self::Batch => 0.45,
            Self::Spinning => 0.01,
            Self::Stuck | Self::Idle => 0.0,
        }
    }

    /// GPM's view of the work per unit of utilization: (SM activity, SM occupancy per unit of
    /// SM activity, tensor activity per unit of SM activity). Real work keeps most SMs busy
    /// while it runs; training and inference are mostly matrix multiplies on the tensor cores.
    fn gpm_ratios(self) -> (f64, f64, f64) {
        match self {
            Self::Training => (0.85, 0.6, 0.7),
            Self::Inference => (0.55, 0.35, 0.5),
            Self::Notebook => (0.6, 0.3, 0.2),
            Self::Batch => (0.8, 0.5, 0.4),
            // Spinning is not proportional to utilization: see `gpm`.
            Self::Spinning => (0.0, 0.5, 0.0),
            Self::Stuck | Self::Idle => (0.0, 0.0, 0.0),
        }
    }
}

/// One instant at which the GPUs are read, with what every GPU shares at that instant.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Point {
    pub(crate) t: i64,
    tick: i64,
    minute: i64,
    /// 1 at 15:00 UTC, 0 at 03:00 UTC.
    diurnal: f64,
}

impl Point {
    pub(crate) fn at(t: i64) -> Point {
        let hour = t.rem_euclid(DAY_MS) as f64 / HOUR_MS as f64;
        Point {
            t,
            tick: t.div_euclid(TICK_MS),
            minute: t.div_euclid(MINUTE_MS),
            diurnal: 0.5 + 0.5 * (std::f64::consts::TAU * (hour - 15.0) / 24.0).cos(),
        }
    }

    /// This GPU's jitter for this reading, uniform in `[0, 1)`.
    pub(crate) fn jitter(&self, gpu: u64, stream: u64) -> f64 {
        uniform(gpu, stream, self.tick)
    }
}

/// GPU utilization, percent, at `p`: an integer 0..=100 as NVML reads it.
pub(crate) fn util_pct(shape: Shape, lease: u64, gpu: u64, p: &Point) -> f64 {
    let jitter = p.jitter(hash(gpu, lease), S_NOISE);
    let pct = match shape {
        Shape::Training => {
            let period = (30 + (unit(hash(lease, S_PERIOD)) * 31.0) as i64) * MINUTE_MS;
            let shifted =
                p.t.saturating_add((unit(hash(lease, S_OFFSET)) * period as f64) as i64);
            let (cycle, pos) = (shifted.div_euclid(period), shifted.rem_euclid(period));
            let dip = (period as f64 * (0.05 + 0.03 * uniform(lease, S_DIP, cycle))) as i64;
            if pos >= period - dip {
                (jitter * 16.0).floor()
            } else {
                93.0 + 4.0 * unit(hash(lease, S_LEVEL)) + (jitter - 0.5) * 6.0
            }
        }
        Shape::Inference => {
            let scale = 0.8 + 0.3 * unit(hash(lease, S_LEVEL));
            let spike = uniform(lease, S_BURST, p.minute);
            let spike = if spike < 0.15 {
                15.0 + 100.0 * spike
            } else {
                0.0
            };
            scale * (10.0 + 60.0 * p.diurnal) + spike + (jitter - 0.5) * 16.0
        }
        Shape::Notebook => {
            const SLOT_MS: i64 = 15 * MINUTE_MS;
            let shifted =
                p.t.saturating_add((unit(hash(lease, S_OFFSET)) * SLOT_MS as f64) as i64);
            let (slot, pos) = (shifted.div_euclid(SLOT_MS), shifted.rem_euclid(SLOT_MS));
            let cell = hash(hash(lease, S_BURST), slot as u64);
            let len = MINUTE_MS + (unit(hash(cell, 1)) * (4 * MINUTE_MS) as f64) as i64;
            let start = (unit(hash(cell, 2)) * (SLOT_MS - len) as f64) as i64;
            if unit(cell) < 0.35 && (start..start + len).contains(&pos) {
                30.0 + 50.0 * unit(hash(cell, 3)) + (jitter - 0.5) * 10.0
            } else if jitter < 0.6 {
                0.0
            } else {
                1.0 + ((jitter - 0.6) / 0.4 * 3.0).floor()
            }
        }
        Shape::Stuck | Shape::Idle => 0.0,
        Shape::Batch => 90.0 + 7.0 * unit(hash(lease, S_LEVEL)) + (jitter - 0.5) * 8.0,
        // Some kernel is always running, so NVML reads it busy; one tick in five catches a gap.
        Shape::Spinning => {
            if jitter < 0.8 {
                100.0
            } else {
                99.0
            }
        }
    };
    pct.round().clamp(0.0, 100.0)
}

/// GPM measures at one reading, percent (NVML's GPM metrics; DCGM's `PROF_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Gpm {
    pub(crate) sm_active: f64,
    pub(crate) sm_occupancy: f64,
    pub(crate) tensor_active: f64,
    pub(crate) dram_active: f64,
    pub(crate) gr_active: f64,
}

impl Gpm {
    /// The sum of two readings (their mean, after [`Gpm::mean`]).
    pub(crate) fn add(&mut self, other: &Gpm) {
        self.sm_active += other.sm_active;
        self.sm_occupancy += other.sm_occupancy;
        self.tensor_active += other.tensor_active;
        self.dram_active += other.dram_active;
        self.gr_active += other.gr_active;
    }

    /// The mean of `n` readings added up (divided, not multiplied by 1/n, so that twelve
    /// readings of 100 % mean exactly 100 %).
    pub(crate) fn mean(&self, n: f64) -> Gpm {
        Gpm {
            sm_active: self.sm_active / n,
            sm_occupancy: self.sm_occupancy / n,
            tensor_active: self.tensor_active / n,
            dram_active: self.dram_active / n,
            gr_active: self.gr_active / n,
        }
    }
}

/// The GPM measures at a reading of utilization `util_pct` under `shape` (`jitter` in `[0, 1)`,
/// this GPU's for this reading). Graphics activity is utilization: both count the time any
/// kernel ran. SM activity is a share of it that depends on the work, ±5 %; a spinning GPU's
/// is 1.5–2.5 % whatever its utilization. Memory bandwidth follows the memory controller's
/// utilization (`mem_util_pct` before rounding).
pub(crate) fn gpm(shape: Option<Shape>, util_pct: f64, jitter: f64) -> Gpm {
    let Some(shape) = shape else {
        return Gpm::default();
    };
    let (sm_ratio, occupancy, tensor) = shape.gpm_ratios();
    let sm_active = match shape {
        Shape::Spinning => 1.5 + jitter,
        _ => util_pct * sm_ratio * (0.95 + 0.1 * jitter),
    }
    .clamp(0.0, 100.0);
    Gpm {
        sm_active,
        sm_occupancy: sm_active * occupancy,
        tensor_active: sm_active * tensor,
        dram_active: (util_pct * shape.mem_util_ratio()).clamp(0.0, 100.0),
        gr_active: util_pct,
    }
}

/// GPM's noise for a reading of `gpu` at `p`.
pub(crate) fn gpm_jitter(gpu: u64, p: &Point) -> f64 {
    p.jitter(gpu, S_GPM)
}

/// Power draw, watts, at a reading: idle draw plus a share of the headroom that follows
/// utilization; a held context costs a little even at 0 %, and a spinning GPU little more
/// whatever its utilization (one busy SM or two). `jitter` in `[0, 1)` adds up to 2 % of
/// the headroom, so a reading never falls below idle nor rises above the limit.
pub(crate) fn power_w(spec: &ModelSpec, shape: Option<Shape>, util_pct: f64, jitter: f64) -> f64 {
    let load = match shape {
        None => 0.0,
        Some(Shape::Idle) => 0.02,
        Some(Shape::Stuck) => 0.06,
        Some(Shape::Spinning) => 0.12,
        Some(_) => 0.03 + 0.9 * util_pct / 100.0,
    };
    let headroom = spec.power_limit_w - spec.idle_power_w;
    (spec.idle_power_w + headroom * (load + 0.02 * jitter))
        .clamp(spec.idle_power_w, spec.power_limit_w)
}

/// Memory in use, bytes: constant for a lease on a GPU (a lease-wide share, plus up to 1 % more
/// on some GPUs, as rank 0 usually holds), in whole 2 MiB pages; 0 with nothing running.
pub(crate) fn mem_used_bytes(shape: Option<Shape>, lease: u64, gpu: u64, total: u64) -> u64 {
    let Some(shape) = shape else { return 0 };
    let (lo, hi) = match shape {
        Shape::Training => (0.70, 0.94),
        Shape::Inference => (0.30, 0.50),
        Shape::Notebook => (0.15, 0.40),
        Shape::Stuck => (0.55, 0.65),
        Shape::Idle => (0.005, 0.012),
        Shape::Batch => (0.40, 0.80),
        Shape::Spinning => (0.40, 0.60),
    };
    let share =
        lo + (hi - lo) * unit(hash(lease, S_MEM)) + 0.01 * unit(hash(hash(lease, gpu), S_MEM_GPU));
    let bytes = (total as f64 * share) as u64;
    (bytes & !((2 << 20) - 1)).min(total)
}

/// Memory controller utilization, percent, over an interval with mean GPU utilization `util`.
pub(crate) fn mem_util_pct(shape: Option<Shape>, util_pct: f64) -> f64 {
    shape.map_or(0.0, |s| (util_pct * s.mem_util_ratio()).round())
}

/// SM clock, MHz: boost under load, base with a context and little work, idle otherwise.
pub(crate) fn sm_clock_mhz(spec: &ModelSpec, shape: Option<Shape>, util_pct: f64) -> u32 {
    match shape {
        _ if util_pct >= 5.0 => spec.boost_mhz,
        Some(_) => spec.base_mhz,
        None => spec.idle_mhz,
    }
}

/// How hard a GPU works, percent of full load, for its temperature: its utilization, but a
/// spinning GPU, whose utilization is near 100 % with one SM or two busy, heats little.
pub(crate) fn heat_pct(shape: Option<Shape>, util_pct: f64) -> f64 {
    match shape {
        Some(Shape::Spinning) => util_pct * 0.1,
        _ => util_pct,
    }
}

/// Temperature, whole degrees Celsius: the model's idle temperature, this GPU's place in the
/// chassis (0–5 °C warmer), and a rise that follows the load (`heat_pct`).
pub(crate) fn temp_c(spec: &ModelSpec, gpu: u64, util_pct: f64) -> f64 {
    let airflow = 5.0 * unit(hash(gpu, S_LEVEL));
    (spec.idle_temp_c + airflow + spec.load_temp_rise_c * util_pct / 100.0).round()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::models::spec_for;

    /// 2025-01-06T00:00:00Z, a Monday.
    const DAY0: i64 = 1_736_121_600_000;

    fn readings(shape: Shape, lease: u64, from: i64, to: i64) -> Vec<f64> {
        (from..to)
            .step_by(TICK_MS as usize)
            .map(|t| util_pct(shape, lease, 99, &Point::at(t + TICK_MS / 2)))
            .collect()
    }

    #[test]
    fn every_reading_is_a_whole_percent_in_range() {
        for shape in Shape::ALL {
            for lease in 0..20 {
                for u in readings(shape, lease, DAY0, DAY0 + 2 * HOUR_MS) {
                    assert!((0.0..=100.0).contains(&u), "{shape:?}: {u}");
                    assert_eq!(u, u.round(), "{shape:?}: {u}");
                }
            }
        }
    }

    #[test]
    fn training_dips_for_a_few_minutes_each_checkpoint() {
        for lease in 0..50 {
            let day = readings(Shape::Training, lease, DAY0, DAY0 + DAY_MS);
            let dips = day.iter().filter(|&&u| u <= 15.0).count();
            // Checkpoints take 5-8 % of the time: 72-115 min a day.
            let dip_min = dips as f64 * TICK_MS as f64 / MINUTE_MS as f64;
            assert!(
                (65.0..=125.0).contains(&dip_min),
                "lease {lease}: {dip_min} min"
            );
            let mean = day.iter().sum::<f64>() / day.len() as f64;
            assert!(mean > 85.0, "lease {lease}: mean {mean}");
        }
    }

    #[test]
    fn inference_peaks_in_the_afternoon() {
        let point = |h: i64| Point::at(DAY0 + h * HOUR_MS);
        assert!((point(15).diurnal - 1.0).abs() < 1e-9);
        assert!(point(3).diurnal.abs() < 1e-9);
    }

    #[test]
    fn power_stays_between_idle_and_limit() {
        let spec = spec_for("NVIDIA H100 80GB HBM3");
        for shape in [None, Some(Shape::Training), Some(Shape::Stuck)] {
            for util in [0.0, 50.0, 100.0] {
                for jitter in [0.0, 0.5, 0.999_999] {
                    let p = power_w(&spec, shape, util, jitter);
                    assert!(
                        (70.0..=700.0).contains(&p),
                        "{shape:?} {util} {jitter}: {p}"
                    );
                }
            }
        }
        assert_eq!(power_w(&spec, None, 0.0, 0.0), 70.0);
        assert!(power_w(&spec, Some(Shape::Training), 95.0, 0.5) > 600.0);
    }

    #[test]
    fn memory_is_whole_pages_within_the_shape_band() {
        let total = spec_for("Tesla T4").mem_total_bytes;
        assert_eq!(mem_used_bytes(None, 1, 2, total), 0);
        for lease in 0..100 {
            let used = mem_used_bytes(Some(Shape::Training), lease, 3, total);
            let share = used as f64 / total as f64;
            assert!((0.69..=0.95).contains(&share), "{share}");
            assert_eq!(used % (2 << 20), 0);
        }
    }

    #[test]
    fn gpm_follows_utilization_but_a_spinning_gpu_has_almost_no_sm_activity() {
        assert_eq!(gpm(None, 0.0, 0.5), Gpm::default());
        for jitter in [0.0, 0.5, 0.999_999] {
            let training = gpm(Some(Shape::Training), 95.0, jitter);
            assert!((76.0..=85.0).contains(&training.sm_active), "{training:?}");
            assert!(training.tensor_active < training.sm_active);
            assert!(training.sm_occupancy < training.sm_active);
            assert_eq!(training.gr_active, 95.0);
            let spinning = gpm(Some(Shape::Spinning), 100.0, jitter);
            assert!((1.5..2.5).contains(&spinning.sm_active), "{spinning:?}");
            assert_eq!((spinning.gr_active, spinning.tensor_active), (100.0, 0.0));
            assert!(spinning.dram_active <= 1.0);
            assert_eq!(gpm(Some(Shape::Idle), 0.0, jitter), Gpm::default());
        }
        let spec = spec_for("NVIDIA H100 80GB HBM3");
        let spinning = power_w(&spec, Some(Shape::Spinning), 100.0, 0.5);
        assert!(spinning < power_w(&spec, Some(Shape::Training), 30.0, 0.5));
        assert!(heat_pct(Some(Shape::Spinning), 100.0) <= 10.0);
        assert_eq!(heat_pct(Some(Shape::Training), 90.0), 90.0);
    }

    #[test]
    fn profile_names_parse() {
        for shape in Shape::ALL {
            assert_eq!(Shape::parse(shape.as_str()), Some(shape));
        }
        assert_eq!(Shape::parse(" IDLE "), Some(Shape::Idle));
        assert_eq!(Shape::parse("Spinning"), Some(Shape::Spinning));
        assert_eq!(Shape::parse("sleepy"), None);
    }
}
