//! Attribution of one hour, in Rust: the samples of the hour's files become `partials`, one row
//! per host, GPU, model and lease, with every sample's time attributed as
//! docs/src/finops/definitions.md#attribution defines it (and as the module documentation of
//! [`super`] lists the rules the definitions leave open).
//!
//! Each sample is attributed alone: its interval `[ts_ms - interval_ms, ts_ms)`, cut to the
//! hour, goes to the lease it names where that lease holds the GPU, to the GPU's owner for the
//! rest of what an owner holds, and to nobody for what is left. So the samples can be taken a
//! GPU at a time (the rows are sorted by GPU and time, duplicates merged), and the partials of
//! disjoint sets of samples add up to those of their union: an hour's partials are kept as the
//! sum over the samples before a cut plus those after it ([`super::Rollup`]'s incremental runs).
//!
//! The SQL this replaces (joins of every sample against the leases' holds and owners, then an
//! aggregation keyed by strings) spent its time copying and hashing strings; here a row is a
//! few integers (each string is interned as it is read), and a sample's owners and holds are
//! found in the short lists of its GPU and of the lease it names.
//!
//! Each piece of a sample weighs its length times the sample's share of a GPU
//! ([`PricingConfig::gpu_share`]: 1 for a whole GPU, e.g. 1/7 for an H100's `1g.10gb` MIG
//! slice), so every GPU-hour here is a GPU-equivalent; and each piece is judged idle by the
//! measure of the lease it goes to (`pricing.idle_measure` where it goes to none), SM activity
//! falling back to utilization where the sample has none ([`PricingConfig::judge_idle`]).

use std::sync::Arc;

use foldhash::{HashMap, HashMapExt as _, HashSet};

use arrow_array::builder::{Float64Builder, Int64Builder, StringBuilder};
use arrow_array::cast::AsArray as _;
use arrow_array::types::{Float64Type, Int64Type};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use datafusion::arrow::compute::cast;
use gpuwarden_schema::config::{IdleMeasure, PricingConfig};

use super::leases::{Hold, Leases, Owner};
use super::HOUR_MS;

/// The columns of `samples` the attribution reads, in the order [`Attributor::add`] expects.
pub(super) const COLUMNS: &str = "gpu_uuid, ts_ms, host, gpu_model, interval_ms, util_gpu_pct, \
                                  mem_used_bytes, power_w, lease_id, sm_active_pct, \
                                  mig_profile, mig_slices, mig_parent_slices";

/// No lease, in [`Sample::lease`].
const NONE: u32 = u32::MAX;

/// One sample row, its strings interned.
#[derive(Debug, Clone, Copy)]
struct Sample {
    gpu: u32,
    ts: i64,
    interval: i64,
    host: u32,
    model: u32,
    lease: u32,
    util: f64,
    mem: i64,
    power: Option<f64>,
    /// GPM's SM activity, percent, where the GPU reports it.
    sm: Option<f64>,
    /// The GPU-equivalents the device is ([`PricingConfig::gpu_share`]).
    share: f64,
}

/// The key of a partial row: host, GPU, model and lease (`None`: the time no lease holds).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct Key {
    host: Arc<str>,
    gpu: Arc<str>,
    model: Arc<str>,
    lease: Option<Arc<str>>,
}

/// The sums of one partial row. Times are milliseconds times the pieces' GPU shares
/// (GPU-equivalent milliseconds), but for the two that say which measure judged the pieces,
/// which are plain milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sums {
    samples: i64,
    observed_ms: f64,
    busy_ms_pct: f64,
    idle_ms: f64,
    energy_w_ms: f64,
    mem_max: Option<i64>,
    /// Σ ms × share × SM activity, over the pieces that have it.
    sm_active_ms_pct: f64,
    /// Σ ms × share over the pieces that have SM activity: how much of `observed_ms` GPM saw.
    gpm_ms: f64,
    /// Milliseconds of the pieces that utilization judged idle or not.
    util_judged_ms: i64,
    /// Milliseconds of the pieces that SM activity judged.
    sm_judged_ms: i64,
}

impl Sums {
    fn add(&mut self, other: &Sums) {
        self.samples += other.samples;
        self.observed_ms += other.observed_ms;
        self.busy_ms_pct += other.busy_ms_pct;
        self.idle_ms += other.idle_ms;
        self.energy_w_ms += other.energy_w_ms;
        self.mem_max = self.mem_max.max(other.mem_max);
        self.sm_active_ms_pct += other.sm_active_ms_pct;
        self.gpm_ms += other.gpm_ms;
        self.util_judged_ms += other.util_judged_ms;
        self.sm_judged_ms += other.sm_judged_ms;
    }
}

/// Partial rows of a set of samples: their sums add up over disjoint sets.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Partials {
    rows: HashMap<Key, Sums>,
}

impl Partials {
    /// Adds `other`'s rows to these.
    pub(super) fn merge(&mut self, other: &Partials) {
        for (key, sums) in &other.rows {
            self.rows.entry(key.clone()).or_default().add(sums);
        }
    }

    /// The `partials` table that the queries of `gpu_hourly` and `lease_hourly` read
    /// ([`super::tables`]).
    pub(super) fn to_batch(&self) -> Result<RecordBatch, ArrowError> {
        let mut rows: Vec<(&Key, &Sums)> = self.rows.iter().collect();
        rows.sort_by(|a, b| a.0.cmp(b.0));
        let n = rows.len();
        let (mut host, mut gpu, mut model, mut lease) = (
            StringBuilder::with_capacity(n, n * 16),
            StringBuilder::with_capacity(n, n * 40),
            StringBuilder::with_capacity(n, n * 24),
            StringBuilder::with_capacity(n, n * 16),
        );
        let int = || Int64Builder::with_capacity(n);
        let float = || Float64Builder::with_capacity(n);
        let (mut samples, mut mem, mut util_judged, mut sm_judged) = (int(), int(), int(), int());
        let (mut observed, mut busy, mut idle, mut energy, mut sm_active, mut gpm) =
            (float(), float(), float(), float(), float(), float());
        for (key, sums) in rows {
            host.append_value(&key.host);
            gpu.append_value(&key.gpu);
            model.append_value(&key.model);
            lease.append_option(key.lease.as_deref());
            samples.append_value(sums.samples);
            observed.append_value(sums.observed_ms);
            busy.append_value(sums.busy_ms_pct);
            idle.append_value(sums.idle_ms);
            energy.append_value(sums.energy_w_ms);
            mem.append_option(sums.mem_max);
            sm_active.append_value(sums.sm_active_ms_pct);
            gpm.append_value(sums.gpm_ms);
            util_judged.append_value(sums.util_judged_ms);
            sm_judged.append_value(sums.sm_judged_ms);
        }
        let columns: Vec<ArrayRef> = vec![
            Arc::new(host.finish()),
            Arc::new(gpu.finish()),
            Arc::new(model.finish()),
            Arc::new(lease.finish()),
            Arc::new(samples.finish()),
            Arc::new(observed.finish()),
            Arc::new(busy.finish()),
            Arc::new(idle.finish()),
            Arc::new(energy.finish()),
            Arc::new(mem.finish()),
            Arc::new(sm_active.finish()),
            Arc::new(gpm.finish()),
            Arc::new(util_judged.finish()),
            Arc::new(sm_judged.finish()),
        ];
        RecordBatch::try_new(schema(), columns)
    }
}

/// The schema of [`Partials::to_batch`].
pub(super) fn schema() -> SchemaRef {
    let text = |name: &str, nullable: bool| Field::new(name, DataType::Utf8, nullable);
    Arc::new(Schema::new(vec![
        text("host", false),
        text("gpu_uuid", false),
        text("gpu_model", false),
        text("lease_id", true),
        Field::new("samples", DataType::Int64, false),
        Field::new("observed_ms", DataType::Float64, false),
        Field::new("busy_ms_pct", DataType::Float64, false),
        Field::new("idle_ms", DataType::Float64, false),
        Field::new("energy_w_ms", DataType::Float64, false),
        Field::new("mem_used_max_bytes", DataType::Int64, true),
        Field::new("sm_active_ms_pct", DataType::Float64, false),
        Field::new("gpm_ms", DataType::Float64, false),
        Field::new("util_judged_ms", DataType::Int64, false),
        Field::new("sm_judged_ms", DataType::Int64, false),
    ]))
}

/// Strings seen in an hour's samples, each kept once.
#[derive(Default)]
struct Interner {
    ids: HashMap<Arc<str>, u32>,
    names: Vec<Arc<str>>,
}

impl Interner {
    fn id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = u32::try_from(self.names.len()).expect("fewer than 2^32 distinct names");
        let name: Arc<str> = Arc::from(name);
        self.names.push(Arc::clone(&name));
        self.ids.insert(name, id);
        id
    }

    fn name(&self, id: u32) -> &Arc<str> {
        &self.names[id as usize]
    }
}

/// The attribution of one hour's samples: rows are added batch by batch, then attributed.
pub(super) struct Attributor {
    hour: i64,
    /// Idle thresholds and GPU shares.
    pricing: PricingConfig,
    /// The measure that judges the time of each lease (interned) idle; `pricing.idle_measure`
    /// for the time of none.
    measures: HashMap<u32, IdleMeasure>,
    /// Samples before it go to the first [`Partials`] of [`Attributor::finish`], the others to
    /// the second.
    cut: i64,
    strings: Interner,
    /// The leases the lake knows, interned.
    known: HashSet<u32>,
    /// Each GPU's owners in the hour: start, end, lease.
    owners: HashMap<u32, Vec<(i64, i64, u32)>>,
    /// Each lease's holds in the hour: GPU (`None`: any), start, end.
    holds: HashMap<u32, Vec<(Option<u32>, i64, i64)>>,
    samples: Vec<Sample>,
}

impl Attributor {
    /// An attribution of the hour starting at `hour` against `leases`, each judged idle by
    /// `measure` of its lease.
    pub(super) fn new(
        hour: i64,
        pricing: &PricingConfig,
        measure: impl Fn(&super::leases::Lease) -> IdleMeasure,
        cut: i64,
        leases: &Leases,
    ) -> Self {
        let mut strings = Interner::default();
        let known = leases.iter().map(|l| strings.id(&l.lease_id)).collect();
        let measures = leases
            .iter()
            .map(|l| (strings.id(&l.lease_id), measure(l)))
            .collect();
        let mut owners: HashMap<u32, Vec<(i64, i64, u32)>> = HashMap::new();
        for Owner {
            gpu_uuid,
            start,
            end,
            lease_id,
        } in leases.owners(hour)
        {
            let (gpu, lease) = (strings.id(&gpu_uuid), strings.id(&lease_id));
            owners.entry(gpu).or_default().push((start, end, lease));
        }
        let mut holds: HashMap<u32, Vec<(Option<u32>, i64, i64)>> = HashMap::new();
        for Hold {
            lease_id,
            gpu_uuid,
            start,
            end,
        } in leases.holds(hour)
        {
            let gpu = gpu_uuid.map(|g| strings.id(&g));
            holds
                .entry(strings.id(&lease_id))
                .or_default()
                .push((gpu, start, end));
        }
        Self {
            hour,
            pricing: pricing.clone(),
            measures,
            cut,
            strings,
            known,
            owners,
            holds,
            samples: Vec::new(),
        }
    }

    /// Adds a batch of [`COLUMNS`]; rows whose interval does not reach into the hour are
    /// dropped at once.
    pub(super) fn add(&mut self, batch: &RecordBatch) -> Result<(), ArrowError> {
        let to = self.hour + HOUR_MS;
        let column = |i: usize, t: &DataType| -> Result<ArrayRef, ArrowError> {
            let c = batch.column(i);
            if c.data_type() == t {
                Ok(Arc::clone(c))
            } else {
                cast(c, t)
            }
        };
        let gpu = column(0, &DataType::Utf8)?;
        let ts = column(1, &DataType::Int64)?;
        let host = column(2, &DataType::Utf8)?;
        let model = column(3, &DataType::Utf8)?;
        let interval = column(4, &DataType::Int64)?;
        let util = column(5, &DataType::Float64)?;
        let mem = column(6, &DataType::Int64)?;
        let power = column(7, &DataType::Float64)?;
        let lease = column(8, &DataType::Utf8)?;
        let sm = column(9, &DataType::Float64)?;
        let profile = column(10, &DataType::Utf8)?;
        let slices = column(11, &DataType::Int64)?;
        let parent_slices = column(12, &DataType::Int64)?;
        let (gpu, host, model, lease, profile) = (
            gpu.as_string::<i32>(),
            host.as_string::<i32>(),
            model.as_string::<i32>(),
            lease.as_string::<i32>(),
            profile.as_string::<i32>(),
        );
        let sm = sm.as_primitive::<Float64Type>();
        let slices = slices.as_primitive::<Int64Type>();
        let parent_slices = parent_slices.as_primitive::<Int64Type>();
        let count = |c: &arrow_array::Int64Array, i: usize| {
            (!c.is_null(i))
                .then(|| u32::try_from(c.value(i)).ok())
                .flatten()
        };
        let ts = ts.as_primitive::<Int64Type>();
        let interval = interval.as_primitive::<Int64Type>();
        let util = util.as_primitive::<Float64Type>();
        let mem = mem.as_primitive::<Int64Type>();
        let power = power.as_primitive::<Float64Type>();
        self.samples.reserve(batch.num_rows());
        for i in 0..batch.num_rows() {
            // Columns the schema says are never null are read as such; a row with a null
            // there (a file written by something else) is left out.
            if [
                gpu.is_null(i),
                ts.is_null(i),
                interval.is_null(i),
                util.is_null(i),
                host.is_null(i),
                model.is_null(i),
                mem.is_null(i),
            ]
            .contains(&true)
            {
                continue;
            }
            let (t, iv) = (ts.value(i), interval.value(i));
            if t < self.hour || t - iv >= to {
                continue;
            }
            self.samples.push(Sample {
                gpu: self.strings.id(gpu.value(i)),
                ts: t,
                interval: iv,
                host: self.strings.id(host.value(i)),
                model: self.strings.id(model.value(i)),
                lease: if lease.is_null(i) {
                    NONE
                } else {
                    self.strings.id(lease.value(i))
                },
                util: util.value(i),
                mem: mem.value(i),
                power: (!power.is_null(i)).then(|| power.value(i)),
                sm: (!sm.is_null(i)).then(|| sm.value(i)),
                share: self.pricing.gpu_share(
                    (!profile.is_null(i)).then(|| profile.value(i)),
                    count(slices, i),
                    count(parent_slices, i),
                ),
            });
        }
        Ok(())
    }

    /// The partials of the samples before the cut and of those from it on.
    pub(super) fn finish(mut self) -> (Partials, Partials) {
        // By GPU, then time: a GPU's duplicates are neighbours.
        self.samples.sort_unstable_by_key(|s| (s.gpu, s.ts));
        let mut sums = [HashMap::new(), HashMap::new()];
        let mut named = Vec::new();
        let mut i = 0;
        while i < self.samples.len() {
            let mut s = self.samples[i];
            i += 1;
            // Duplicates count once; where they disagree each column takes its largest value.
            while let Some(d) = self
                .samples
                .get(i)
                .filter(|d| (d.gpu, d.ts) == (s.gpu, s.ts))
            {
                let larger = |a: u32, b: u32| -> u32 {
                    match (a, b) {
                        (NONE, b) => b,
                        (a, NONE) => a,
                        (a, b) if self.strings.name(b) > self.strings.name(a) => b,
                        (a, _) => a,
                    }
                };
                s.host = larger(s.host, d.host);
                s.model = larger(s.model, d.model);
                s.lease = larger(s.lease, d.lease);
                s.interval = s.interval.max(d.interval);
                s.util = s.util.max(d.util);
                s.mem = s.mem.max(d.mem);
                let larger = |a: Option<f64>, b: Option<f64>| match (a, b) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                };
                s.power = larger(s.power, d.power);
                s.sm = larger(s.sm, d.sm);
                s.share = s.share.max(d.share);
                i += 1;
            }
            let side = usize::from(s.ts >= self.cut);
            self.attribute(&s, &mut named, &mut sums[side]);
        }
        let [before, after] = sums.map(|rows| Partials {
            rows: rows
                .into_iter()
                .map(|((host, gpu, model, lease), sums)| {
                    let name = |id: u32| Arc::clone(self.strings.name(id));
                    let key = Key {
                        host: name(host),
                        gpu: name(gpu),
                        model: name(model),
                        lease: (lease != NONE).then(|| name(lease)),
                    };
                    (key, sums)
                })
                .collect(),
        });
        (before, after)
    }

    /// Attributes one (deduplicated) sample's part of the hour, `[a, b)`: to the lease it names
    /// where that lease holds the GPU, to the GPU's owners for the rest of what they hold, and
    /// to no lease for what is left, which also counts the sample (in its own hour) and its
    /// memory.
    fn attribute(
        &self,
        s: &Sample,
        named: &mut Vec<(i64, i64)>,
        sums: &mut HashMap<(u32, u32, u32, u32), Sums>,
    ) {
        let (from, to) = (self.hour, self.hour + HOUR_MS);
        let a = (s.ts - s.interval).max(from);
        let b = s.ts.min(to);
        let mut put = |lease: u32, ms: i64, own: i64, mem: Option<i64>| {
            let row = sums.entry((s.host, s.gpu, s.model, lease)).or_default();
            let measure = match lease {
                NONE => self.pricing.idle_measure,
                lease => self.measures[&lease],
            };
            let weighed = ms as f64 * s.share;
            row.samples += own;
            row.observed_ms += weighed;
            row.busy_ms_pct += weighed * s.util;
            let (idle, judged) = self.pricing.judge_idle(measure, s.util, s.sm);
            if idle {
                row.idle_ms += weighed;
            }
            match judged {
                IdleMeasure::Util => row.util_judged_ms += ms,
                IdleMeasure::SmActive => row.sm_judged_ms += ms,
            }
            if let Some(sm) = s.sm {
                row.sm_active_ms_pct += weighed * sm;
                row.gpm_ms += weighed;
            }
            // Each slice's sample carries its share of its GPU's power already.
            row.energy_w_ms += s.power.unwrap_or(0.0) * ms as f64;
            row.mem_max = row.mem_max.max(mem);
        };
        let mut attributed = 0;
        named.clear();
        if s.lease != NONE && self.known.contains(&s.lease) {
            for &(gpu, start, end) in self.holds.get(&s.lease).into_iter().flatten() {
                if gpu.is_none_or(|g| g == s.gpu) && start < b && end > a {
                    let piece = (a.max(start), b.min(end));
                    named.push(piece);
                    attributed += piece.1 - piece.0;
                    put(s.lease, piece.1 - piece.0, 0, None);
                }
            }
        }
        for &(start, end, lease) in self.owners.get(&s.gpu).into_iter().flatten() {
            if start < b && end > a {
                let (oa, ob) = (a.max(start), b.min(end));
                let taken: i64 = named
                    .iter()
                    .map(|&(na, nb)| (ob.min(nb) - oa.max(na)).max(0))
                    .sum();
                let ms = ob - oa - taken;
                if ms > 0 {
                    attributed += ms;
                    put(lease, ms, 0, None);
                }
            }
        }
        put(NONE, b - a - attributed, i64::from(s.ts < to), Some(s.mem));
    }
}
