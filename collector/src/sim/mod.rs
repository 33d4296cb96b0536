//! The simulated fleet: `--source simulated` reads GPUs that do not exist, realistic enough that
//! the pipeline's rollups and the enforcer's idle rules behave as they do on real hardware.
//!
//! The fleet is the inventory of a `simulated` substrate ([`simulated_inventory`], which the
//! enforcer's `simulated` driver derives from the same config, so both agree on every UUID with
//! no import between them). It follows admitted work: it is fed the enforcer's [`LeaseEvent`]s and
//! runs each lease's workload ([`Shape`]) on that lease's GPUs; [`Fleet::set_unleased`] adds work
//! no lease accounts for. [`Fleet::sample`] reads every GPU as NVML would, with GPM's measures
//! (SM activity and the rest) on the models that have GPM (H100, H200). A lease labelled
//! `sim_profile = "spinning"` reads 100 % busy at 2 % SM activity: the GPU that fools
//! utilization.
//!
//! Every value is a function of the seed, the GPU, the lease and the time (`shape.rs` says how
//! each kind of work behaves), not of what was sampled before: a 60 s sample is the mean of the twelve 5 s samples it covers. The one
//! exception is the energy counter, which integrates power over the intervals actually sampled.

mod models;
mod noise;
mod place;
mod shape;

use std::collections::{BTreeMap, HashMap};

use gpuwarden_schema::config::{DriverKind, SubstrateConfig};
use gpuwarden_schema::fleet::simulated_inventory;
use gpuwarden_schema::{LeaseEvent, LeaseEventKind, Sample, V1};

use models::ModelSpec;
use shape::{Point, TICK_MS};

pub use shape::{Shape, PROFILE_LABEL};

/// Most readings averaged into one sample. Up to a minute every 5 s tick is read; longer
/// intervals are read at 12 evenly spaced instants, which keeps `sample` cheap for any interval.
const MAX_READINGS: usize = 12;
/// Noise stream of power jitter (shape.rs uses 1..=9).
const S_POWER: u64 = 20;
/// Noise stream that turns a GPU's key into the key of its unleased work.
const S_ROGUE: u64 = 21;

/// Why a fleet cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The substrate is run by another driver, so there is no fleet to simulate.
    #[error(
        "substrate `{substrate}` uses the {driver} driver, not simulated; \
         only a simulated substrate has a fleet to simulate"
    )]
    NotSimulated {
        /// The substrate's name.
        substrate: String,
        /// The driver it uses.
        driver: &'static str,
    },
    /// The substrate's `hosts` add up to no GPU.
    #[error("substrate `{substrate}` has no GPUs; give it at least one group in `hosts`")]
    NoGpus {
        /// The substrate's name.
        substrate: String,
    },
}

/// One simulated GPU and the facts about it that never change.
#[derive(Debug, Clone, PartialEq)]
pub struct SimGpu {
    /// Host name, `<prefix>-<n>`.
    pub host: String,
    /// NVML index on its host.
    pub index: u32,
    /// NVML UUID.
    pub uuid: String,
    /// Full NVML model name.
    pub model: String,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// Framebuffer total, bytes.
    pub mem_total_bytes: u64,
    /// Enforced power limit, watts.
    pub power_limit_w: f64,
    /// Draw with nothing running, watts: the floor of every power reading.
    pub idle_power_w: f64,
    pub(crate) spec: ModelSpec,
    /// Seeded hash of the UUID: the root of this GPU's noise.
    pub(crate) key: u64,
    /// Position of its host in the inventory, for placement.
    pub(crate) host_pos: usize,
}

/// Work that runs on a GPU: a lease's, or unleased.
#[derive(Debug, Clone, Copy)]
struct Work {
    shape: Shape,
    /// How much of the lease's traffic each GPU carries relative to its grant (inference after
    /// a resize); 1 otherwise.
    spread: f64,
    /// Seeded hash of the lease id (or of the GPU, for unleased work).
    key: u64,
}

#[derive(Debug, Clone)]
struct Holder {
    lease_id: String,
    work: Work,
    /// The lease runs here from this time on; before it, the GPU reads as it would without it.
    since_ms: i64,
}

#[derive(Debug, Clone, Default)]
struct GpuState {
    holder: Option<Holder>,
    unleased: Option<Work>,
    energy_mj: f64,
    /// End of the time already integrated into `energy_mj`.
    energy_until_ms: Option<i64>,
}

impl GpuState {
    fn work_at(&self, t: i64) -> Option<Work> {
        match &self.holder {
            Some(h) if t >= h.since_ms => Some(h.work),
            _ => self.unleased,
        }
    }

    fn lease_at(&self, t: i64) -> Option<&Holder> {
        self.holder.as_ref().filter(|h| t >= h.since_ms)
    }
}

/// The instants one sample reads, shared by every GPU.
struct Readings {
    points: [Point; MAX_READINGS],
    len: usize,
}

impl Readings {
    /// The midpoints of `n` equal parts of `[start, start + interval)`: with a 5 s-aligned
    /// interval of up to a minute, exactly the midpoints of its 5 s ticks.
    fn new(start: i64, interval_ms: i64) -> Readings {
        let n = (interval_ms / TICK_MS).clamp(1, MAX_READINGS as i64);
        let mut points = [Point::default(); MAX_READINGS];
        for (k, point) in points.iter_mut().enumerate().take(n as usize) {
            let offset = i128::from(2 * k as i64 + 1) * i128::from(interval_ms) / i128::from(2 * n);
            *point = Point::at(start.saturating_add(offset as i64));
        }
        Readings {
            points,
            len: n as usize,
        }
    }

    fn iter(&self) -> impl Iterator<Item = &Point> {
        self.points[..self.len].iter()
    }
}

/// A simulated fleet: the GPUs of one `simulated` substrate, and the work running on them.
#[derive(Debug, Clone)]
pub struct Fleet {
    substrate: String,
    seed: u64,
    gpus: Vec<SimGpu>,
    state: Vec<GpuState>,
    by_uuid: HashMap<String, usize>,
    /// The GPUs (positions in `gpus`, sorted) each lease holds.
    leases: BTreeMap<String, Vec<usize>>,
    /// GPUs each open lease was granted (how inference traffic spreads after a resize).
    granted: HashMap<String, u32>,
}

impl Fleet {
    /// The fleet of a `driver = "simulated"` substrate, all of it free; `seed` drives every random
    /// choice, so the same seed and the same calls give the same samples.
    pub fn new(substrate: &SubstrateConfig, seed: u64) -> Result<Fleet, SimError> {
        if substrate.driver != DriverKind::Simulated {
            return Err(SimError::NotSimulated {
                substrate: substrate.name.clone(),
                driver: substrate.driver.as_str(),
            });
        }
        let inventory = simulated_inventory(substrate);
        if inventory.is_empty() {
            return Err(SimError::NoGpus {
                substrate: substrate.name.clone(),
            });
        }
        let mut host_pos = 0;
        let mut gpus: Vec<SimGpu> = Vec::with_capacity(inventory.len());
        for gpu in inventory {
            if gpus.last().is_some_and(|prev| prev.host != gpu.host) {
                host_pos += 1;
            }
            let spec = models::spec_for(&gpu.model);
            gpus.push(SimGpu {
                key: noise::str_key(seed, &gpu.uuid),
                host: gpu.host,
                index: gpu.index,
                uuid: gpu.uuid,
                model: gpu.model,
                pci_bus_id: gpu.pci_bus_id,
                mem_total_bytes: spec.mem_total_bytes,
                power_limit_w: spec.power_limit_w,
                idle_power_w: spec.idle_power_w,
                spec,
                host_pos,
            });
        }
        let by_uuid = gpus
            .iter()
            .enumerate()
            .map(|(i, g)| (g.uuid.clone(), i))
            .collect();
        Ok(Fleet {
            substrate: substrate.name.clone(),
            seed,
            state: vec![GpuState::default(); gpus.len()],
            gpus,
            by_uuid,
            leases: BTreeMap::new(),
            granted: HashMap::new(),
        })
    }

    /// The substrate this fleet simulates.
    pub fn substrate(&self) -> &str {
        &self.substrate
    }

    /// Every simulated GPU with its static facts, host by host in config order.
    pub fn gpus(&self) -> &[SimGpu] {
        &self.gpus
    }

    /// The lease holding `gpu_uuid` now, if any.
    pub fn lease_on(&self, gpu_uuid: &str) -> Option<&str> {
        let &i = self.by_uuid.get(gpu_uuid)?;
        self.state[i].holder.as_ref().map(|h| h.lease_id.as_str())
    }

    /// Applies one of the enforcer's lease events.
    ///
    /// `granted` and `resized` both say which GPUs the lease holds from `ts_ms` on: the listed
    /// `gpu_uuids` of this fleet (others are ignored), or, when the list is empty, `gpu_count`
    /// GPUs of `gpu_model` chosen here: those it already holds first, then free ones packed onto
    /// the fewest hosts. GPUs it no longer holds become free. A listed GPU that another lease holds
    /// moves to this one: the enforcer's record wins. `released` frees all its GPUs. Events for
    /// another substrate, for unknown leases, and repeated events change nothing.
    pub fn apply(&mut self, event: &LeaseEvent) {
        if event.substrate != self.substrate {
            return;
        }
        match event.event {
            LeaseEventKind::Released => self.release(&event.lease_id),
            LeaseEventKind::Granted | LeaseEventKind::Resized => self.assign(event),
        }
    }

    /// Marks a GPU as running `shape` with no lease (rogue or unattributed work), or clears it
    /// with `None`. While a lease holds the GPU, the lease's work is what runs; the unleased work
    /// shows again once the lease lets go. Unknown UUIDs are ignored.
    pub fn set_unleased(&mut self, gpu_uuid: &str, shape: Option<Shape>) {
        if let Some(&i) = self.by_uuid.get(gpu_uuid) {
            let key = noise::hash(self.gpus[i].key, S_ROGUE);
            self.state[i].unleased = shape.map(|shape| Work {
                shape,
                spread: 1.0,
                key,
            });
        }
    }

    /// Reads every GPU over `[ts_ms - interval_ms, ts_ms)`: one [`Sample`] per GPU, in
    /// [`Fleet::gpus`] order. Utilization and power are the mean of the readings in the interval;
    /// memory, processes and lease are as at its end; energy is the running total since the fleet
    /// started, never decreasing, whatever order intervals are sampled in.
    pub fn sample(&mut self, ts_ms: i64, interval_ms: i64) -> Vec<Sample> {
        let span = interval_ms.max(1);
        let start = ts_ms.saturating_sub(span);
        let end = ts_ms.saturating_sub(1);
        let readings = Readings::new(start, span);
        self.gpus
            .iter()
            .zip(self.state.iter_mut())
            .map(|(gpu, state)| read(gpu, state, &readings, ts_ms, interval_ms, start, end))
            .collect()
    }

    fn release(&mut self, lease_id: &str) {
        self.granted.remove(lease_id);
        for i in self.leases.remove(lease_id).unwrap_or_default() {
            self.state[i].holder = None;
        }
    }

    fn assign(&mut self, event: &LeaseEvent) {
        let held = self.leases.remove(&event.lease_id).unwrap_or_default();
        let target = if event.gpu_uuids.is_empty() {
            self.choose(event, &held)
        } else {
            let mut listed: Vec<usize> = event
                .gpu_uuids
                .iter()
                .filter_map(|u| self.by_uuid.get(u.as_str()).copied())
                .collect();
            listed.sort_unstable();
            listed.dedup();
            listed
        };
        for &i in held.iter().filter(|i| target.binary_search(i).is_err()) {
            self.state[i].holder = None;
        }
        let shape = Shape::of_lease(event);
        if event.event == LeaseEventKind::Granted {
            self.granted
                .insert(event.lease_id.clone(), event.gpu_count.max(1));
        }
        let granted = *self
            .granted
            .entry(event.lease_id.clone())
            .or_insert(event.gpu_count.max(1));
        let spread = if shape == Shape::Inference && !target.is_empty() {
            f64::from(granted) / target.len() as f64
        } else {
            1.0
        };
        let work = Work {
            shape,
            spread,
            key: noise::str_key(self.seed, &event.lease_id),
        };
        for &i in &target {
            match &mut self.state[i].holder {
                Some(h) if h.lease_id == event.lease_id => h.work = work,
                other => {
                    if let Some(previous) = other.take() {
                        if let Some(gpus) = self.leases.get_mut(&previous.lease_id) {
                            gpus.retain(|&g| g != i);
                        }
                    }
                    *other = Some(Holder {
                        lease_id: event.lease_id.clone(),
                        work,
                        since_ms: event.ts_ms,
                    });
                }
            }
        }
        if !target.is_empty() {
            self.leases.insert(event.lease_id.clone(), target);
        }
    }

    /// The GPUs a lease that names none holds: `gpu_count` of them, keeping what it holds.
    fn choose(&self, event: &LeaseEvent, held: &[usize]) -> Vec<usize> {
        let want = event.gpu_count as usize;
        if held.len() >= want {
            return place::keep(held, |i| self.gpus[i].host_pos, want);
        }
        let fits = |i: usize| {
            self.state[i].holder.is_none()
                && self.gpus[i].model.eq_ignore_ascii_case(&event.gpu_model)
        };
        let mut chosen = held.to_vec();
        // First the free GPUs beside the ones it has, so a growing lease stays together.
        for i in 0..self.gpus.len() {
            if chosen.len() == want {
                break;
            }
            let beside = held
                .iter()
                .any(|&h| self.gpus[h].host_pos == self.gpus[i].host_pos);
            if beside && fits(i) {
                chosen.push(i);
            }
        }
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        for i in (0..self.gpus.len()).filter(|&i| fits(i) && !chosen.contains(&i)) {
            match hosts.last_mut() {
                Some(h) if self.gpus[h[0]].host_pos == self.gpus[i].host_pos => h.push(i),
                _ => hosts.push(vec![i]),
            }
        }
        let need = want - chosen.len();
        chosen.extend(place::pack(hosts, need));
        chosen.sort_unstable();
        chosen
    }
}

/// One GPU's sample.
fn read(
    gpu: &SimGpu,
    state: &mut GpuState,
    readings: &Readings,
    ts_ms: i64,
    interval_ms: i64,
    start: i64,
    end: i64,
) -> Sample {
    let (mut util_sum, mut power_sum) = (0.0, 0.0);
    let mut gpm_sum = shape::Gpm::default();
    for point in readings.iter() {
        let work = state.work_at(point.t);
        let util = work.map_or(0.0, |w| {
            let util = shape::util_pct(w.shape, w.key, gpu.key, point);
            if w.spread == 1.0 {
                util
            } else {
                (util * w.spread).round().clamp(0.0, 100.0)
            }
        });
        let jitter = point.jitter(gpu.key, S_POWER);
        let shape = work.map(|w| w.shape);
        power_sum += shape::power_w(&gpu.spec, shape, util, jitter);
        util_sum += util;
        if gpu.spec.gpm {
            gpm_sum.add(&shape::gpm(shape, util, shape::gpm_jitter(gpu.key, point)));
        }
    }
    let n = readings.len as f64;
    let (util, power) = (util_sum / n, power_sum / n);
    // GPM's figures are means over the interval too; a model without GPM has none.
    let gpm = gpu.spec.gpm.then(|| gpm_sum.mean(n));

    // Energy: integrate only time not integrated before, so re-sampled or overlapping
    // intervals never count twice and the counter never goes back.
    let from = state
        .energy_until_ms
        .map_or(start, |until| until.max(start));
    if ts_ms > from {
        state.energy_mj += power * (ts_ms - from) as f64; // W × ms = mJ
        state.energy_until_ms = Some(ts_ms);
    }

    let now = state.work_at(end);
    let shape_now = now.map(|w| w.shape);
    Sample {
        v: V1,
        ts_ms,
        interval_ms,
        host: gpu.host.clone(),
        gpu_uuid: gpu.uuid.clone(),
        gpu_model: gpu.model.clone(),
        util_gpu_pct: util,
        mem_used_bytes: shape::mem_used_bytes(
            shape_now,
            now.map_or(0, |w| w.key),
            gpu.key,
            gpu.mem_total_bytes,
        ),
        mem_total_bytes: gpu.mem_total_bytes,
        gpu_index: Some(gpu.index),
        pci_bus_id: Some(gpu.pci_bus_id.clone()),
        util_mem_pct: Some(shape::mem_util_pct(shape_now, util)),
        // NVML reports milliwatts.
        power_w: Some((power * 1000.0).round() / 1000.0),
        power_limit_w: Some(gpu.power_limit_w),
        energy_mj: Some(state.energy_mj as u64),
        temp_c: Some(shape::temp_c(
            &gpu.spec,
            gpu.key,
            shape::heat_pct(shape_now, util),
        )),
        sm_clock_mhz: Some(shape::sm_clock_mhz(&gpu.spec, shape_now, util)),
        process_count: Some(u32::from(now.is_some())),
        lease_id: state.lease_at(end).map(|h| h.lease_id.clone()),
        mig_profile: None,
        labels: None,
        sm_active_pct: gpm.map(|g| g.sm_active),
        sm_occupancy_pct: gpm.map(|g| g.sm_occupancy),
        tensor_active_pct: gpm.map(|g| g.tensor_active),
        dram_active_pct: gpm.map(|g| g.dram_active),
        gr_active_pct: gpm.map(|g| g.gr_active),
        // The simulated fleet has no MIG: every GPU is whole.
        mig_parent_uuid: None,
        mig_slices: None,
        mig_parent_slices: None,
        serving_requests: None,
    }
}
