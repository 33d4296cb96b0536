//! The samples the signals read, kept per GPU and per time bucket (one minute by default) with
//! only the columns the signals use, deduplicated as they arrive.
//!
//! Each GPU holds its buckets in time order. A bucket keeps one `Point` per distinct `ts_ms`
//! (its offset in the bucket, `interval_ms`, `util_gpu_pct`, `sm_active_pct`, `mem_used_bytes`
//! and an index into the bucket's few (lease named, host) pairs), 40 bytes, and a cached
//! `Summary` of its points: the interval-weighted sums (of utilization, and of SM activity over
//! the samples that have it), the largest `mem_used_bytes`, and the first, last, last busy and
//! first-idle-after-last-busy times that idle runs need, once as utilization judges the samples
//! and once as SM activity does (falling back to utilization where a sample has none): the
//! measure is the owning lease's, which a bucket does not know. The signals read the summary of
//! a bucket whose points all name the same lease and whose minute no lease segment starts or
//! ends in (the common case: one entry per GPU-minute), and walk the points of the others (a
//! bucket cut by the window's start, by a grant, resize or release, or holding samples that name
//! different leases), so the figures are exactly those of the raw samples whatever order samples
//! and lease events arrive in.
//!
//! Why points keep values rather than only a set of seen `ts_ms`: copies of a sample that
//! disagree take each column's largest value (docs/src/finops/definitions.md#duplicates), which changes the
//! sums only if the first copy's values are known, and a lease event that arrives after the
//! samples of its minute cuts that minute where no aggregate made at arrival could be split.
//!
//! Cost, for a GPU sampled every `s` seconds: per GPU-minute one bucket (about 200 bytes with its
//! summary, 32 per (lease, host) pair; the strings are shared) plus `60 / s` points of 40 bytes:
//! about 800 bytes per GPU-minute at `s` = 5 (a fifth of the samples naming their lease).
//! `benches/signal_window.rs` counted 634 before SM activity was kept, which added 8 bytes a
//! point and 64 a bucket; the raw Arrow rows took about 2.5 KB counted and about 7 KB of
//! resident memory. SM activity is kept as a plain `f64` (NaN for none) rather than an `Option`,
//! so a point grows by 8 bytes, not 16.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use gpuwarden_schema::config::{IdleMeasure, PricingConfig};

/// Samples in buckets per GPU; see the module documentation.
#[derive(Debug)]
pub struct SampleWindow {
    bucket_ms: i64,
    gpus: HashMap<Arc<str>, Vec<Bucket>>,
    /// Host names and lease ids, shared by the buckets that name them.
    strings: HashSet<Arc<str>>,
    points: usize,
    buckets: usize,
}

/// One bucket of one GPU: the samples with `start <= ts_ms < start + bucket_ms`.
#[derive(Debug)]
pub(crate) struct Bucket {
    pub(crate) start: i64,
    /// By time, one per distinct `ts_ms`.
    pub(crate) points: Vec<Point>,
    /// The (lease named, host) pairs the points refer to.
    pub(crate) tags: Vec<Tag>,
    /// Over every point, for the thresholds it was taken with; `None` once a point changed.
    summary: Option<Summary>,
}

/// One deduplicated sample: the columns the signals read, each the largest of its copies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Point {
    pub(crate) util: f64,
    /// `sm_active_pct`, NaN where the sample has none.
    pub(crate) sm: f64,
    pub(crate) mem: i64,
    /// `ts_ms` − the bucket's start.
    pub(crate) offset: u32,
    pub(crate) interval: u32,
    /// Index into the bucket's tags.
    pub(crate) tag: u16,
}

/// The lease a sample names and its host.
#[derive(Debug, Clone)]
pub(crate) struct Tag {
    pub(crate) lease: Option<Arc<str>>,
    pub(crate) host: Arc<str>,
}

impl Point {
    /// `sm_active_pct`, where the sample has it.
    pub(crate) fn sm_active(&self) -> Option<f64> {
        (!self.sm.is_nan()).then_some(self.sm)
    }
}

/// The idle thresholds a summary was taken with: `idle_util_pct`, `idle_sm_active_pct`.
type Thresholds = (f64, f64);

fn thresholds(pricing: &PricingConfig) -> Thresholds {
    (pricing.idle_util_pct, pricing.idle_sm_active_pct)
}

/// A bucket's points taken together.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Summary {
    thresholds: Thresholds,
    /// The one tag every point has; `None` when they differ.
    pub(crate) tag: Option<u16>,
    pub(crate) piece: Piece,
}

/// Samples of one GPU in a stretch of time, as the signals combine them: in time order, a later
/// piece's figures extend an earlier one's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Piece {
    /// Σ `interval_ms` × `util_gpu_pct`.
    pub(crate) weighted: f64,
    /// Σ `interval_ms`.
    pub(crate) observed: i64,
    /// Σ `interval_ms` × `sm_active_pct` over the samples that have it.
    pub(crate) sm_weighted: f64,
    /// Σ `interval_ms` over the samples that have `sm_active_pct`.
    pub(crate) sm_observed: i64,
    /// Samples, and samples with `sm_active_pct`: which measure could judge them.
    pub(crate) samples: u32,
    pub(crate) sm_samples: u32,
    pub(crate) mem_max: i64,
    pub(crate) first: i64,
    pub(crate) last: i64,
    /// The idle runs as each measure judges the samples ([`Piece::run`]).
    runs: [Run; 2],
}

/// Where the samples' latest idle run starts, as one measure judges them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Run {
    /// The latest busy sample.
    pub(crate) last_busy: Option<i64>,
    /// The first sample after `last_busy` (or the first, with none busy); `None` when the last
    /// sample is busy.
    pub(crate) idle_from: Option<i64>,
}

impl Run {
    fn of(t: i64, idle: bool) -> Self {
        Self {
            last_busy: (!idle).then_some(t),
            idle_from: idle.then_some(t),
        }
    }

    fn then(&mut self, later: &Run, later_first: i64) {
        if later.last_busy.is_some() {
            *self = *later;
        } else if self.idle_from.is_none() {
            self.idle_from = Some(later_first);
        }
    }
}

/// The slot of `measure`'s run in a piece.
fn slot(measure: IdleMeasure) -> usize {
    match measure {
        IdleMeasure::Util => 0,
        IdleMeasure::SmActive => 1,
    }
}

impl Piece {
    /// One sample's piece, judged idle or busy by each measure (`PricingConfig::judge_idle`).
    pub(crate) fn of(t: i64, p: &Point, pricing: &PricingConfig) -> Self {
        let sm = p.sm_active();
        let interval = i64::from(p.interval);
        let run = |measure| Run::of(t, pricing.judge_idle(measure, p.util, sm).0);
        Self {
            weighted: f64::from(p.interval) * p.util,
            observed: interval,
            sm_weighted: sm.map_or(0.0, |sm| f64::from(p.interval) * sm),
            sm_observed: if sm.is_some() { interval } else { 0 },
            samples: 1,
            sm_samples: u32::from(sm.is_some()),
            mem_max: p.mem,
            first: t,
            last: t,
            runs: [run(IdleMeasure::Util), run(IdleMeasure::SmActive)],
        }
    }

    /// `self` followed by `later` (every sample of `later` comes after those of `self`).
    pub(crate) fn then(&mut self, later: &Piece) {
        self.weighted += later.weighted;
        self.observed += later.observed;
        self.sm_weighted += later.sm_weighted;
        self.sm_observed += later.sm_observed;
        self.samples = self.samples.saturating_add(later.samples);
        self.sm_samples = self.sm_samples.saturating_add(later.sm_samples);
        self.mem_max = self.mem_max.max(later.mem_max);
        for (run, later_run) in self.runs.iter_mut().zip(&later.runs) {
            run.then(later_run, later.first);
        }
        self.last = later.last;
    }

    /// The idle run as `measure` judges these samples.
    pub(crate) fn run(&self, measure: IdleMeasure) -> &Run {
        &self.runs[slot(measure)]
    }
}

/// What became of a sample given to the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// A sample at a `(gpu_uuid, ts_ms)` not held before.
    New,
    /// A copy of one held: merged into it, each column taking the larger value.
    Duplicate,
}

/// One sample's columns that the signals read.
#[derive(Debug, Clone, Copy)]
pub struct SampleFields<'a> {
    /// The GPU.
    pub gpu_uuid: &'a str,
    /// End of its interval, ms.
    pub ts_ms: i64,
    /// Its interval, ms (1..=3,600,000).
    pub interval_ms: i64,
    /// Its host.
    pub host: &'a str,
    /// Utilization, %.
    pub util_gpu_pct: f64,
    /// SM activity, %, where the GPU has GPM.
    pub sm_active_pct: Option<f64>,
    /// Memory in use, bytes.
    pub mem_used_bytes: i64,
    /// The lease it names.
    pub lease_id: Option<&'a str>,
}

/// The default bucket: one minute.
pub const BUCKET_MS: i64 = 60_000;

impl SampleWindow {
    /// An empty window with buckets of `bucket_ms` (at least 1 ms, at most about 71 minutes).
    pub fn new(bucket_ms: i64) -> Self {
        Self {
            bucket_ms: bucket_ms.clamp(1, i64::from(u32::MAX)),
            gpus: HashMap::new(),
            strings: HashSet::new(),
            points: 0,
            buckets: 0,
        }
    }

    /// The buckets' length, ms.
    pub fn bucket_ms(&self) -> i64 {
        self.bucket_ms
    }

    fn intern(strings: &mut HashSet<Arc<str>>, s: &str) -> Arc<str> {
        match strings.get(s) {
            Some(shared) => Arc::clone(shared),
            None => {
                let shared: Arc<str> = Arc::from(s);
                strings.insert(Arc::clone(&shared));
                shared
            }
        }
    }

    /// Adds one sample, or merges it into the copy held.
    pub fn add(&mut self, s: &SampleFields<'_>) -> Kept {
        let start = s.ts_ms.div_euclid(self.bucket_ms) * self.bucket_ms;
        // Both fit: the offset is below the bucket's length, the interval is validated.
        let offset = u32::try_from(s.ts_ms - start).unwrap_or(u32::MAX);
        let interval = u32::try_from(s.interval_ms.max(0)).unwrap_or(u32::MAX);
        if !self.gpus.contains_key(s.gpu_uuid) {
            let gpu = Self::intern(&mut self.strings, s.gpu_uuid);
            self.gpus.insert(gpu, Vec::new());
        }
        let buckets = self.gpus.get_mut(s.gpu_uuid).expect("inserted above");
        // Samples mostly come in time order: look at the newest bucket first.
        let at = match buckets.last() {
            Some(b) if b.start == start => buckets.len() - 1,
            Some(b) if b.start < start => buckets.len(),
            None => 0,
            Some(_) => match buckets.binary_search_by_key(&start, |b| b.start) {
                Ok(i) | Err(i) => i,
            },
        };
        if buckets.get(at).is_none_or(|b| b.start != start) {
            // The minute before a new newest one is mostly complete: give back its spare room.
            if at == buckets.len() {
                if let Some(before) = buckets.last_mut() {
                    before.points.shrink_to_fit();
                    before.tags.shrink_to_fit();
                }
            }
            buckets.insert(
                at,
                Bucket {
                    start,
                    points: Vec::new(),
                    tags: Vec::new(),
                    summary: None,
                },
            );
            self.buckets += 1;
        }
        let bucket = &mut buckets[at];
        bucket.summary = None;
        match bucket.points.binary_search_by_key(&offset, |p| p.offset) {
            Ok(i) => {
                let held = bucket.points[i];
                let tag = &bucket.tags[usize::from(held.tag)];
                let lease = tag.lease.as_deref().max(s.lease_id);
                let host = (&*tag.host).max(s.host);
                let (lease, host) = (lease.map(str::to_owned), host.to_owned());
                let tag = Self::tag(&mut self.strings, bucket, lease.as_deref(), &host);
                let point = &mut bucket.points[i];
                point.interval = point.interval.max(interval);
                point.util = point.util.max(s.util_gpu_pct);
                // NaN (none) loses to any value, as a null does to `max` in SQL.
                point.sm = point.sm.max(s.sm_active_pct.unwrap_or(f64::NAN));
                point.mem = point.mem.max(s.mem_used_bytes);
                point.tag = tag;
                Kept::Duplicate
            }
            Err(i) => {
                let tag = Self::tag(&mut self.strings, bucket, s.lease_id, s.host);
                bucket.points.insert(
                    i,
                    Point {
                        util: s.util_gpu_pct,
                        sm: s.sm_active_pct.unwrap_or(f64::NAN),
                        mem: s.mem_used_bytes,
                        offset,
                        interval,
                        tag,
                    },
                );
                self.points += 1;
                Kept::New
            }
        }
    }

    /// The index of the tag (lease, host) in `bucket`, added if new.
    fn tag(
        strings: &mut HashSet<Arc<str>>,
        bucket: &mut Bucket,
        lease: Option<&str>,
        host: &str,
    ) -> u16 {
        if let Some(i) = bucket
            .tags
            .iter()
            .position(|t| t.lease.as_deref() == lease && &*t.host == host)
        {
            return u16::try_from(i).unwrap_or(u16::MAX);
        }
        // More than 65,536 hosts or leases in one GPU-minute is no real fleet: the last tag
        // absorbs the rest rather than failing.
        if bucket.tags.len() > usize::from(u16::MAX) {
            return u16::MAX;
        }
        bucket.tags.push(Tag {
            lease: lease.map(|l| Self::intern(strings, l)),
            host: Self::intern(strings, host),
        });
        u16::try_from(bucket.tags.len() - 1).unwrap_or(u16::MAX)
    }

    /// Drops every sample at or before `cutoff`: whole buckets, and the older points of the
    /// bucket that holds `cutoff`.
    pub fn evict_through(&mut self, cutoff: i64) {
        let bucket_ms = self.bucket_ms;
        let (mut points, mut buckets) = (0, 0);
        self.gpus.retain(|_, gpu| {
            let gone = gpu
                .iter()
                .take_while(|b| b.start + bucket_ms - 1 <= cutoff)
                .count();
            gpu.drain(..gone);
            // A GPU holds about window / bucket buckets: no need for twice the room.
            if gpu.capacity() > gpu.len() + gpu.len() / 2 + 1 {
                gpu.shrink_to(gpu.len() + 1);
            }
            if let Some(b) = gpu.first_mut().filter(|b| b.start <= cutoff) {
                let before = b.points.len();
                b.points.retain(|p| b.start + i64::from(p.offset) > cutoff);
                if b.points.len() != before {
                    b.summary = None;
                }
                if b.points.is_empty() {
                    gpu.remove(0);
                }
            }
            points += gpu.iter().map(|b| b.points.len()).sum::<usize>();
            buckets += gpu.len();
            !gpu.is_empty()
        });
        self.points = points;
        self.buckets = buckets;
        // Hosts and leases no bucket names any more.
        self.strings.retain(|s| Arc::strong_count(s) > 1);
    }

    /// Fills in the summary of every bucket that lacks one for `pricing`'s idle thresholds.
    pub(crate) fn summarize(&mut self, pricing: &PricingConfig) {
        let thresholds = thresholds(pricing);
        for bucket in self.gpus.values_mut().flatten() {
            if bucket.summary.is_some_and(|s| s.thresholds == thresholds) {
                continue;
            }
            let mut points = bucket.points.iter();
            let Some(first) = points.next() else {
                continue;
            };
            let mut piece = Piece::of(bucket.start + i64::from(first.offset), first, pricing);
            let mut tag = Some(first.tag);
            for p in points {
                piece.then(&Piece::of(bucket.start + i64::from(p.offset), p, pricing));
                if tag != Some(p.tag) {
                    tag = None;
                }
            }
            bucket.summary = Some(Summary {
                thresholds,
                tag,
                piece,
            });
        }
    }

    /// Each GPU with its buckets in time order.
    pub(crate) fn gpus(&self) -> impl Iterator<Item = (&str, &[Bucket])> {
        self.gpus.iter().map(|(g, b)| (&**g, b.as_slice()))
    }

    /// Distinct samples held.
    pub fn len(&self) -> usize {
        self.points
    }

    /// Whether no sample is held.
    pub fn is_empty(&self) -> bool {
        self.points == 0
    }

    /// GPU buckets held.
    pub fn buckets(&self) -> usize {
        self.buckets
    }

    /// GPUs with a sample held.
    pub fn gpu_count(&self) -> usize {
        self.gpus.len()
    }

    /// About how many bytes the window holds on the heap: buckets, points, tags, the GPU map
    /// and the shared strings, by capacity.
    pub fn bytes(&self) -> usize {
        use std::mem::size_of;
        let per_gpu = size_of::<(Arc<str>, Vec<Bucket>)>() + 1;
        let mut bytes = self.gpus.capacity() * per_gpu;
        for buckets in self.gpus.values() {
            bytes += buckets.capacity() * size_of::<Bucket>();
            for b in buckets {
                bytes += b.points.capacity() * size_of::<Point>();
                bytes += b.tags.capacity() * size_of::<Tag>();
            }
        }
        bytes += self.strings.capacity() * (size_of::<Arc<str>>() + 1);
        // Each shared string: its bytes and the two reference counts.
        bytes += self.strings.iter().map(|s| s.len() + 16).sum::<usize>();
        bytes
    }

    /// Every `ts_ms` held, ascending (a GPU's copies once).
    pub fn timestamps(&self) -> Vec<i64> {
        let mut out: Vec<i64> = self
            .gpus
            .values()
            .flatten()
            .flat_map(|b| b.points.iter().map(|p| b.start + i64::from(p.offset)))
            .collect();
        out.sort_unstable();
        out
    }
}

impl Bucket {
    /// The summary taken by [`SampleWindow::summarize`], if still current.
    pub(crate) fn summary(&self) -> Option<&Summary> {
        self.summary.as_ref()
    }

    /// The time of `p`, one of this bucket's points.
    pub(crate) fn ts(&self, p: &Point) -> i64 {
        self.start + i64::from(p.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields<'a>(gpu: &'a str, ts_ms: i64, util: f64, lease: Option<&'a str>) -> SampleFields<'a> {
        SampleFields {
            gpu_uuid: gpu,
            ts_ms,
            interval_ms: 5_000,
            host: "h",
            util_gpu_pct: util,
            sm_active_pct: None,
            mem_used_bytes: 10,
            lease_id: lease,
        }
    }

    fn pricing() -> PricingConfig {
        PricingConfig {
            idle_util_pct: 5.0,
            idle_sm_active_pct: 5.0,
            ..PricingConfig::default()
        }
    }

    #[test]
    fn copies_merge_into_one_point_taking_each_columns_largest_value() {
        let mut w = SampleWindow::new(BUCKET_MS);
        assert_eq!(w.add(&fields("g", 5_000, 90.0, None)), Kept::New);
        // At-least-once delivery: the same record again.
        assert_eq!(w.add(&fields("g", 5_000, 90.0, None)), Kept::Duplicate);
        // A copy that disagrees: lower utilization, more memory, a lease named.
        let mut other = fields("g", 5_000, 10.0, Some("L"));
        other.mem_used_bytes = 99;
        other.host = "z";
        other.sm_active_pct = Some(3.0);
        assert_eq!(w.add(&other), Kept::Duplicate);
        // SM activity: a value beats none, the larger of two wins; none never erases one.
        let mut sm = fields("g", 5_000, 0.0, None);
        sm.sm_active_pct = Some(2.0);
        assert_eq!(w.add(&sm), Kept::Duplicate);
        assert_eq!(w.add(&fields("g", 5_000, 0.0, None)), Kept::Duplicate);
        assert_eq!((w.len(), w.buckets()), (1, 1));
        let bucket = &w.gpus.get("g").unwrap()[0];
        let p = bucket.points[0];
        assert_eq!((p.util, p.mem, p.interval), (90.0, 99, 5_000));
        assert_eq!(p.sm_active(), Some(3.0));
        let tag = &bucket.tags[usize::from(p.tag)];
        assert_eq!((tag.lease.as_deref(), &*tag.host), (Some("L"), "z"));
    }

    #[test]
    fn a_late_sample_lands_in_its_own_older_bucket_in_time_order() {
        let mut w = SampleWindow::new(BUCKET_MS);
        for ts in [125_000, 65_000, 130_000, 5_000, 70_000, 60_000] {
            assert_eq!(w.add(&fields("g", ts, 50.0, None)), Kept::New);
        }
        let starts: Vec<i64> = w.gpus.get("g").unwrap().iter().map(|b| b.start).collect();
        assert_eq!(starts, vec![0, 60_000, 120_000]);
        assert_eq!(
            w.timestamps(),
            vec![5_000, 60_000, 65_000, 70_000, 125_000, 130_000]
        );
        w.summarize(&pricing());
        let s = w.gpus.get("g").unwrap()[1].summary().copied().unwrap();
        assert_eq!(s.tag, Some(0));
        assert_eq!(
            (s.piece.first, s.piece.last, s.piece.observed),
            (60_000, 70_000, 15_000)
        );
        // A new point makes the summary stale.
        w.add(&fields("g", 61_000, 1.0, None));
        assert!(w.gpus.get("g").unwrap()[1].summary().is_none());
    }

    #[test]
    fn a_summary_knows_the_last_busy_sample_and_the_idle_run_after_it() {
        let mut w = SampleWindow::new(BUCKET_MS);
        for (ts, util) in [(10_000, 1.0), (20_000, 50.0), (30_000, 2.0), (40_000, 3.0)] {
            w.add(&fields("g", ts, util, None));
        }
        w.add(&fields("g", 50_000, 0.0, Some("L")));
        w.summarize(&pricing());
        let s = w.gpus.get("g").unwrap()[0].summary().copied().unwrap();
        assert_eq!(s.tag, None, "two tags: the signals walk the points");
        // No sample has SM activity: both measures judge by utilization.
        for measure in [IdleMeasure::Util, IdleMeasure::SmActive] {
            let run = s.piece.run(measure);
            assert_eq!(
                (run.last_busy, run.idle_from, s.piece.mem_max),
                (Some(20_000), Some(30_000), 10)
            );
        }
        assert_eq!(s.piece.weighted, 5_000.0 * 56.0);
        assert_eq!((s.piece.samples, s.piece.sm_samples), (5, 0));
    }

    /// A spinning GPU: utilization 100 %, SM activity 2 %, then one sample without GPM at 100 %
    /// and one of real work. Utilization sees no idle run; SM activity sees one from the first
    /// sample to the sample without SM activity, which utilization judges busy.
    #[test]
    fn a_summary_keeps_the_run_of_each_measure() {
        let mut w = SampleWindow::new(BUCKET_MS);
        for ts in [10_000, 20_000, 30_000] {
            let mut f = fields("g", ts, 100.0, Some("L"));
            f.sm_active_pct = Some(2.0);
            w.add(&f);
        }
        w.add(&fields("g", 40_000, 100.0, Some("L")));
        let mut f = fields("g", 50_000, 100.0, Some("L"));
        f.sm_active_pct = Some(1.0);
        w.add(&f);
        w.summarize(&pricing());
        let s = w.gpus.get("g").unwrap()[0].summary().copied().unwrap();
        let util = s.piece.run(IdleMeasure::Util);
        assert_eq!((util.last_busy, util.idle_from), (Some(50_000), None));
        let sm = s.piece.run(IdleMeasure::SmActive);
        assert_eq!((sm.last_busy, sm.idle_from), (Some(40_000), Some(50_000)));
        assert_eq!((s.piece.samples, s.piece.sm_samples), (5, 4));
        assert_eq!(
            (s.piece.sm_weighted, s.piece.sm_observed),
            (5_000.0 * 7.0, 20_000)
        );
        // Another SM threshold makes the summary stale: at 0.5 %, 1 % is busy.
        let lower = PricingConfig {
            idle_sm_active_pct: 0.5,
            ..pricing()
        };
        w.summarize(&lower);
        let s = w.gpus.get("g").unwrap()[0].summary().copied().unwrap();
        let sm = s.piece.run(IdleMeasure::SmActive);
        assert_eq!((sm.last_busy, sm.idle_from), (Some(50_000), None));
    }

    #[test]
    fn eviction_drops_whole_buckets_and_the_older_points_of_the_one_cut() {
        let mut w = SampleWindow::new(BUCKET_MS);
        for ts in (5_000..=180_000).step_by(5_000) {
            w.add(&fields("a", ts, 50.0, Some("L")));
        }
        w.add(&fields("b", 10_000, 50.0, Some("M")));
        assert_eq!((w.len(), w.buckets(), w.gpu_count()), (37, 5, 2));
        w.evict_through(90_000);
        assert_eq!(w.timestamps().first(), Some(&95_000));
        assert_eq!((w.len(), w.buckets(), w.gpu_count()), (18, 3, 1));
        // The lease only b's sample named is forgotten with it.
        assert!(!w.strings.contains("M") && w.strings.contains("L"));
        w.evict_through(180_000);
        assert!(w.is_empty());
        assert_eq!((w.buckets(), w.gpu_count()), (0, 0));
    }
}
