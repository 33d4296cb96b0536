//! Leases as the rollups see them, rebuilt from the `lease_events` table on every run: each
//! lease's identity, its segments (docs/src/finops/definitions.md#lease-segments), and from those the
//! three things an hour's rollup needs — how many GPU-hours each lease held in the hour, which
//! lease owns each GPU at each instant of the hour when several grants overlap, and when each
//! lease holds a GPU for the samples that name it.
//!
//! The event log is small next to the samples (a few events per lease), so this is plain Rust
//! over a `Vec`; the per-sample work stays in DataFusion, which cuts each sample's interval at
//! the edges of the [`Owner`] intervals (which never overlap) and of the named lease's [`Hold`]s.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, StringBuilder};
use arrow_array::{
    ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, TimestampMillisecondArray,
};
use arrow_schema::ArrowError;
use gpuwarden_schema::{LeaseEvent, LeaseEventKind};

use super::tables::{self, RollupTable};
use crate::lake::hour_of;

const HOUR_MS: i64 = 3_600_000;

/// One stretch of a lease with a fixed set of GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// Opened by a "granted" or "resized" event at this time.
    pub start: i64,
    /// The lease's next event; `None` while the lease is still running.
    pub end: Option<i64>,
    /// GPUs held.
    pub gpu_count: i64,
    /// Which GPUs, when the substrate said.
    pub gpu_uuids: Vec<String>,
}

impl Segment {
    /// The GPU-equivalents the segment holds: each GPU it lists (once) at its `share` (a MIG
    /// slice's part of its GPU, 1 for a whole GPU), and as whole GPUs those of `gpu_count` it
    /// does not list (all of them when it lists none). With whole GPUs, `gpu_count`.
    pub fn gpus(&self, share: &dyn Fn(&str) -> f64) -> f64 {
        let listed: std::collections::BTreeSet<&str> =
            self.gpu_uuids.iter().map(String::as_str).collect();
        let unlisted = (self.gpu_count - listed.len() as i64).max(0);
        listed.iter().map(|uuid| share(uuid)).sum::<f64>() + unlisted as f64
    }
}

/// A lease's identity and history.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    /// The lease id.
    pub lease_id: String,
    /// Identity, from the "granted" event (or the first event when none was seen).
    pub identity: LeaseEvent,
    /// When it was granted (the identity event's time): most recent grant wins a contested GPU.
    pub granted_at: i64,
    /// The time of its latest event.
    pub updated_at: i64,
    /// The size and GPUs of its latest granted or resized event.
    pub current: Option<(i64, Vec<String>)>,
    /// The "released" event's time and reason.
    pub released: Option<(i64, Option<String>)>,
    /// Its segments in time order.
    pub segments: Vec<Segment>,
}

/// An interval of one GPU that one lease owns for attribution: `[start, end)` within an hour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The GPU.
    pub gpu_uuid: String,
    /// Start, ms.
    pub start: i64,
    /// End (exclusive), ms.
    pub end: i64,
    /// The lease that owns it.
    pub lease_id: String,
}

/// A stretch of one hour in which a lease holds a GPU for the samples that name it
/// (docs/src/finops/definitions.md#attribution): `[start, end)` of one of its segments, for one GPU the
/// segment lists, or for any GPU (`gpu_uuid` `None`) when the segment lists none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// The lease.
    pub lease_id: String,
    /// The GPU; `None`: any GPU whose samples name the lease.
    pub gpu_uuid: Option<String>,
    /// Start, ms.
    pub start: i64,
    /// End (exclusive), ms.
    pub end: i64,
}

/// Every lease known to the lake.
#[derive(Debug, Default)]
pub struct Leases {
    by_id: BTreeMap<String, Lease>,
    max_ts: Option<i64>,
}

fn kind_order(kind: LeaseEventKind) -> u8 {
    match kind {
        LeaseEventKind::Granted => 0,
        LeaseEventKind::Resized => 1,
        LeaseEventKind::Released => 2,
    }
}

impl Leases {
    /// Builds the leases from their events, in any order, duplicates included.
    pub fn from_events(mut events: Vec<LeaseEvent>) -> Self {
        // Every event moves the watermark, even one that comes after its lease's release.
        let max_ts = events.iter().map(|e| e.ts_ms).max();
        events.sort_by(|a, b| {
            (a.lease_id.as_str(), a.ts_ms, kind_order(a.event)).cmp(&(
                b.lease_id.as_str(),
                b.ts_ms,
                kind_order(b.event),
            ))
        });
        // A replayed event is the same event: (lease, time, kind) counts once.
        events
            .dedup_by(|b, a| a.lease_id == b.lease_id && a.ts_ms == b.ts_ms && a.event == b.event);
        let mut by_id = BTreeMap::new();
        let mut rest = events.as_slice();
        while let Some(first) = rest.first() {
            let n = rest
                .iter()
                .take_while(|e| e.lease_id == first.lease_id)
                .count();
            let (lease_events, tail) = rest.split_at(n);
            rest = tail;
            let lease = Self::lease(lease_events);
            by_id.insert(lease.lease_id.clone(), lease);
        }
        Self { by_id, max_ts }
    }

    fn lease(events: &[LeaseEvent]) -> Lease {
        // Nothing after the first release counts.
        let end = events
            .iter()
            .position(|e| e.event == LeaseEventKind::Released)
            .map_or(events.len(), |i| i + 1);
        let events = &events[..end];
        let identity = events
            .iter()
            .find(|e| e.event == LeaseEventKind::Granted)
            .unwrap_or(&events[0])
            .clone();
        let mut segments: Vec<Segment> = Vec::new();
        let mut current = None;
        for (i, e) in events.iter().enumerate() {
            if e.event == LeaseEventKind::Released {
                continue;
            }
            let gpu_count = i64::from(e.gpu_count);
            current = Some((gpu_count, e.gpu_uuids.clone()));
            segments.push(Segment {
                start: e.ts_ms,
                end: events.get(i + 1).map(|next| next.ts_ms),
                gpu_count,
                gpu_uuids: e.gpu_uuids.clone(),
            });
        }
        let released = events
            .last()
            .filter(|e| e.event == LeaseEventKind::Released)
            .map(|e| (e.ts_ms, e.reason.map(|r| r.as_str().to_owned())));
        Lease {
            lease_id: identity.lease_id.clone(),
            granted_at: identity.ts_ms,
            updated_at: events.last().map_or(identity.ts_ms, |e| e.ts_ms),
            identity,
            current,
            released,
            segments,
        }
    }

    /// Number of leases.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether no lease is known.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Every lease, by id.
    pub fn iter(&self) -> impl Iterator<Item = &Lease> {
        self.by_id.values()
    }

    /// The lease with this id.
    pub fn get(&self, lease_id: &str) -> Option<&Lease> {
        self.by_id.get(lease_id)
    }

    /// The largest time of any lease event, ignored ones included.
    pub fn max_ts(&self) -> Option<i64> {
        self.max_ts
    }

    /// Every hour in which some lease holds GPUs, up to the watermark.
    pub fn allocated_hours(&self, watermark: i64) -> std::collections::BTreeSet<i64> {
        let mut hours = std::collections::BTreeSet::new();
        for segment in self.by_id.values().flat_map(|l| &l.segments) {
            let end = segment.end.unwrap_or(watermark);
            if end <= segment.start || segment.gpu_count == 0 {
                continue;
            }
            let mut hour = hour_of(segment.start);
            while hour < end {
                hours.insert(hour);
                hour += HOUR_MS;
            }
        }
        hours
    }

    /// GPU-hours each lease held in the hour starting at `hour` (allocated GPU-hours,
    /// docs/src/finops/definitions.md#measures): open segments run to the watermark. Leases holding nothing
    /// in the hour are left out. A segment holds [`Segment::gpus`] GPU-equivalents, each GPU
    /// it lists weighing `share` of its UUID.
    pub fn allocation(
        &self,
        hour: i64,
        watermark: i64,
        share: &dyn Fn(&str) -> f64,
    ) -> Vec<(&str, f64)> {
        let (from, to) = (hour, hour + HOUR_MS);
        self.by_id
            .values()
            .filter_map(|lease| {
                let gpu_ms: f64 = lease
                    .segments
                    .iter()
                    .map(|s| {
                        let overlap = s.end.unwrap_or(watermark).min(to) - s.start.max(from);
                        match overlap {
                            ..=0 => 0.0,
                            ms => ms as f64 * s.gpus(share),
                        }
                    })
                    .sum();
                (gpu_ms > 0.0).then(|| (lease.lease_id.as_str(), gpu_ms / HOUR_MS as f64))
            })
            .collect()
    }

    /// Which lease owns each GPU when, within the hour starting at `hour`: where the segments
    /// of several leases name a GPU at the same instant, the most recently granted lease wins
    /// (ties: the larger lease id). A running lease's segment has no end here: a sample taken
    /// after the watermark's event still belongs to it.
    pub fn owners(&self, hour: i64) -> Vec<Owner> {
        let (from, to) = (hour, hour + HOUR_MS);
        // Per GPU: (start, end, priority, lease) clipped to the hour.
        type Claim<'a> = (i64, i64, (i64, &'a str));
        let mut claims: BTreeMap<&str, Vec<Claim<'_>>> = BTreeMap::new();
        for lease in self.by_id.values() {
            for s in &lease.segments {
                let (start, end) = (s.start.max(from), s.end.unwrap_or(i64::MAX).min(to));
                if start >= end {
                    continue;
                }
                for gpu in &s.gpu_uuids {
                    claims.entry(gpu).or_default().push((
                        start,
                        end,
                        (lease.granted_at, lease.lease_id.as_str()),
                    ));
                }
            }
        }
        let mut owners = Vec::new();
        for (gpu, claims) in claims {
            let mut cuts: Vec<i64> = claims.iter().flat_map(|c| [c.0, c.1]).collect();
            cuts.sort_unstable();
            cuts.dedup();
            for w in cuts.windows(2) {
                let (start, end) = (w[0], w[1]);
                let winner = claims
                    .iter()
                    .filter(|c| c.0 <= start && end <= c.1)
                    .map(|c| c.2)
                    .max();
                let Some((_, lease_id)) = winner else {
                    continue;
                };
                match owners.last_mut() {
                    Some(Owner {
                        gpu_uuid,
                        end: last_end,
                        lease_id: last,
                        ..
                    }) if gpu_uuid == gpu && *last_end == start && last == lease_id => {
                        *last_end = end;
                    }
                    _ => owners.push(Owner {
                        gpu_uuid: gpu.to_owned(),
                        start,
                        end,
                        lease_id: lease_id.to_owned(),
                    }),
                }
            }
        }
        owners
    }

    /// When each lease holds which GPU within the hour starting at `hour`, for the samples that
    /// name it: each segment clipped to the hour, once per GPU it lists (or once for any GPU
    /// when it lists none). A running lease's segment has no end here either.
    pub fn holds(&self, hour: i64) -> Vec<Hold> {
        let (from, to) = (hour, hour + HOUR_MS);
        let mut holds = Vec::new();
        for lease in self.by_id.values() {
            for s in &lease.segments {
                let (start, end) = (s.start.max(from), s.end.unwrap_or(i64::MAX).min(to));
                if start >= end {
                    continue;
                }
                let hold = |gpu_uuid: Option<&str>| Hold {
                    lease_id: lease.lease_id.clone(),
                    gpu_uuid: gpu_uuid.map(str::to_owned),
                    start,
                    end,
                };
                if s.gpu_uuids.is_empty() {
                    holds.push(hold(None));
                } else {
                    let gpus: std::collections::BTreeSet<&str> =
                        s.gpu_uuids.iter().map(String::as_str).collect();
                    holds.extend(gpus.into_iter().map(|gpu| hold(Some(gpu))));
                }
            }
        }
        holds
    }

    /// The `leases` table: one row per lease, its current state.
    pub fn to_batch(&self) -> Result<RecordBatch, ArrowError> {
        let leases: Vec<&Lease> = self.by_id.values().collect();
        let text = |f: &dyn Fn(&Lease) -> Option<String>| -> ArrayRef {
            Arc::new(leases.iter().map(|l| f(l)).collect::<StringArray>())
        };
        let time = |f: &dyn Fn(&Lease) -> Option<i64>| -> ArrayRef {
            Arc::new(
                leases
                    .iter()
                    .map(|l| f(l))
                    .collect::<TimestampMillisecondArray>()
                    .with_timezone("UTC"),
            )
        };
        let mut uuids = ListBuilder::new(StringBuilder::new());
        for lease in &leases {
            for gpu in lease.current.as_ref().map_or(&[][..], |c| &c.1) {
                uuids.values().append_value(gpu);
            }
            uuids.append(true);
        }
        let columns: Vec<ArrayRef> = vec![
            text(&|l| Some(l.lease_id.clone())),
            text(&|l| {
                Some(
                    if l.released.is_some() {
                        "released"
                    } else {
                        "active"
                    }
                    .to_owned(),
                )
            }),
            text(&|l| Some(l.identity.team.clone())),
            text(&|l| Some(l.identity.user.clone())),
            text(&|l| Some(l.identity.project.clone())),
            text(&|l| Some(l.identity.workload.as_str().to_owned())),
            text(&|l| Some(l.identity.substrate.clone())),
            text(&|l| Some(l.identity.gpu_model.clone())),
            Arc::new(
                leases
                    .iter()
                    .map(|l| Some(l.current.as_ref().map_or(0, |c| c.0)))
                    .collect::<Int64Array>(),
            ),
            Arc::new(uuids.finish()),
            text(&|l| {
                l.identity
                    .labels
                    .as_ref()
                    .map(|m| serde_json::to_string(m).expect("a string map serializes"))
            }),
            time(&|l| Some(l.granted_at)),
            time(&|l| Some(l.updated_at)),
            time(&|l| l.released.as_ref().map(|r| r.0)),
            text(&|l| l.released.as_ref().and_then(|r| r.1.clone())),
        ];
        RecordBatch::try_new(RollupTable::Leases.schema(), columns)
    }

    /// `known_leases`: each lease's id, team, model and FOCUS tags, for joining samples to it.
    pub fn known_batch(&self) -> Result<RecordBatch, ArrowError> {
        let leases: Vec<&Lease> = self.by_id.values().collect();
        let text = |f: &dyn Fn(&Lease) -> String| -> ArrayRef {
            Arc::new(leases.iter().map(|l| Some(f(l))).collect::<StringArray>())
        };
        RecordBatch::try_new(
            tables::known_leases(),
            vec![
                text(&|l| l.lease_id.clone()),
                text(&|l| l.identity.team.clone()),
                text(&|l| l.identity.gpu_model.clone()),
                text(&|l| {
                    serde_json::json!({
                        "user": l.identity.user,
                        "project": l.identity.project,
                        "workload": l.identity.workload.as_str(),
                    })
                    .to_string()
                }),
            ],
        )
    }

    /// `hour_allocation(lease_id, allocated_gpu_hours)` for one hour, with each GPU's `share`.
    pub fn allocation_batch(
        &self,
        hour: i64,
        watermark: i64,
        share: &dyn Fn(&str) -> f64,
    ) -> Result<RecordBatch, ArrowError> {
        let allocation = self.allocation(hour, watermark, share);
        RecordBatch::try_new(
            tables::allocation(),
            vec![
                Arc::new(
                    allocation
                        .iter()
                        .map(|a| Some(a.0))
                        .collect::<StringArray>(),
                ),
                Arc::new(Float64Array::from_iter_values(
                    allocation.iter().map(|a| a.1),
                )),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuwarden_schema::Record as _;

    const H: i64 = 1_764_547_200_000; // 2025-12-01T00:00:00Z

    fn event(ts: i64, kind: &str, lease: &str, count: u32, gpus: &[&str]) -> LeaseEvent {
        let reason = if kind == "released" {
            r#","reason":"user""#
        } else {
            ""
        };
        LeaseEvent::from_json(
            format!(
                r#"{{"v":1,"ts_ms":{ts},"event":"{kind}","lease_id":"{lease}","team":"t-{lease}","user":"u","project":"p","workload":"training","substrate":"s","gpu_model":"NVIDIA H100","gpu_count":{count},"gpu_uuids":{gpus:?}{reason}}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn segments_follow_resizes_and_close_at_release() {
        let leases = Leases::from_events(vec![
            event(H + 600_000, "resized", "a", 2, &["g1", "g2"]),
            event(H, "granted", "a", 1, &["g1"]),
            event(H, "granted", "a", 1, &["g1"]), // replayed
            event(H + 1_800_000, "released", "a", 2, &[]),
            event(H + 2_000_000, "resized", "a", 4, &[]), // after release: ignored
        ]);
        let a = leases.get("a").unwrap();
        assert_eq!(a.segments.len(), 2);
        assert_eq!(
            (a.segments[0].start, a.segments[0].end),
            (H, Some(H + 600_000))
        );
        assert_eq!(a.segments[1].end, Some(H + 1_800_000));
        assert_eq!(a.released, Some((H + 1_800_000, Some("user".into()))));
        assert_eq!(
            leases.max_ts(),
            Some(H + 2_000_000),
            "an ignored event still moves the watermark"
        );
        // 10 min × 1 GPU + 20 min × 2 GPUs = 50 GPU-minutes.
        let allocation = leases.allocation(H, H + 10 * HOUR_MS, &|_| 1.0);
        assert_eq!(allocation, vec![("a", 50.0 / 60.0)]);
        assert_eq!(
            leases.allocation(H + HOUR_MS, H + 10 * HOUR_MS, &|_| 1.0),
            vec![]
        );
    }

    /// A segment listing MIG slices holds their shares of a GPU; one listing GPUs with no known
    /// share holds them whole, and one listing none holds its count of whole GPUs.
    #[test]
    fn a_segment_holds_the_shares_of_the_gpus_it_lists() {
        let leases = Leases::from_events(vec![
            event(H, "granted", "a", 2, &["MIG-1", "MIG-2"]),
            event(H + 1_800_000, "resized", "a", 2, &["MIG-1", "g1"]),
            event(H + 2_700_000, "resized", "a", 3, &[]),
        ]);
        let share = |uuid: &str| match uuid {
            "MIG-1" => 1.0 / 7.0,
            "MIG-2" => 3.0 / 7.0,
            _ => 1.0,
        };
        let segments = &leases.get("a").unwrap().segments;
        let gpus: Vec<f64> = segments.iter().map(|s| s.gpus(&share)).collect();
        assert_eq!(gpus, [4.0 / 7.0, 1.0 / 7.0 + 1.0, 3.0]);
        let allocation = leases.allocation(H, H + HOUR_MS, &share);
        let want = 0.5 * 4.0 / 7.0 + 0.25 * (1.0 / 7.0 + 1.0) + 0.25 * 3.0;
        assert!(
            allocation.len() == 1 && (allocation[0].1 - want).abs() < 1e-12,
            "{allocation:?}"
        );
        // With whole GPUs, the count.
        assert_eq!(segments[0].gpus(&|_| 1.0), 2.0);
    }

    #[test]
    fn a_running_lease_is_allocated_to_the_watermark_and_owns_its_gpu_past_it() {
        let leases = Leases::from_events(vec![event(H + 1_800_000, "granted", "a", 1, &["g1"])]);
        let watermark = H + HOUR_MS + 900_000;
        assert_eq!(leases.allocation(H, watermark, &|_| 1.0), vec![("a", 0.5)]);
        assert_eq!(
            leases.allocation(H + HOUR_MS, watermark, &|_| 1.0),
            vec![("a", 0.25)]
        );
        assert_eq!(
            leases
                .allocated_hours(watermark)
                .into_iter()
                .collect::<Vec<_>>(),
            vec![H, H + HOUR_MS]
        );
        assert_eq!(
            leases.owners(H + HOUR_MS),
            vec![Owner {
                gpu_uuid: "g1".into(),
                start: H + HOUR_MS,
                end: H + 2 * HOUR_MS,
                lease_id: "a".into()
            }]
        );
    }

    #[test]
    fn a_lease_holds_the_gpus_its_segments_list_or_any_gpu_when_they_list_none() {
        let leases = Leases::from_events(vec![
            event(H - 600_000, "granted", "a", 3, &["g1", "g2", "g1"]),
            event(H + 600_000, "resized", "a", 1, &["g2"]),
            event(H + 1_200_000, "granted", "b", 2, &[]),
            event(H + 1_800_000, "released", "b", 2, &[]),
        ]);
        let holds: Vec<(&str, Option<&str>, i64, i64)> = leases
            .holds(H)
            .iter()
            .map(|h| {
                (
                    if h.lease_id == "a" { "a" } else { "b" },
                    h.gpu_uuid
                        .as_deref()
                        .map(|g| if g == "g1" { "g1" } else { "g2" }),
                    h.start - H,
                    h.end - H,
                )
            })
            .collect();
        assert_eq!(
            holds,
            vec![
                // Clipped to the hour; a GPU listed twice is held once.
                ("a", Some("g1"), 0, 600_000),
                ("a", Some("g2"), 0, 600_000),
                // Running: to the end of the hour.
                ("a", Some("g2"), 600_000, HOUR_MS),
                ("b", None, 1_200_000, 1_800_000),
            ]
        );
        assert!(leases.holds(H - 2 * HOUR_MS).is_empty());
    }

    #[test]
    fn the_most_recent_grant_owns_a_contested_gpu() {
        let leases = Leases::from_events(vec![
            event(H, "granted", "old", 1, &["g1"]),
            event(H + 600_000, "granted", "new", 2, &["g1", "g2"]),
            event(H + 1_200_000, "released", "new", 1, &[]),
        ]);
        let owners: Vec<(i64, i64, &str, &str)> = leases
            .owners(H)
            .iter()
            .map(|o| {
                (
                    o.start - H,
                    o.end - H,
                    o.gpu_uuid.as_str(),
                    o.lease_id.as_str(),
                )
            })
            .map(|(a, b, g, l)| {
                (
                    a,
                    b,
                    if g == "g1" { "g1" } else { "g2" },
                    if l == "old" { "old" } else { "new" },
                )
            })
            .collect();
        assert_eq!(
            owners,
            vec![
                (0, 600_000, "g1", "old"),
                (600_000, 1_200_000, "g1", "new"),
                (1_200_000, HOUR_MS, "g1", "old"),
                (600_000, 1_200_000, "g2", "new"),
            ]
        );
    }
}
