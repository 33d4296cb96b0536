//! What admission reads, kept in memory: the open leases and what they hold ([`Held`]), the
//! latest spend per team, the blocked teams, exemptions, rule marks and the newest utilization
//! signal handled per lease, and the admissions' Idempotency-Keys of the last day ([`Memory`]); and
//! the exact sums ([`Accruals`]) from which a team's month-to-date spend is read without walking
//! its leases. [`load`] fills it from the file when the store opens.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use gpuwarden_schema::config::PricingConfig;
use rusqlite::Connection;

use super::rows::{row_to_raw, ParseRaw, RawLease, COLUMNS, OPEN};
use super::types::{Lease, Ledger, StoreError};
use crate::policy::HeldGpus;

/// The open leases, the latest spend per team and the blocked teams.
#[derive(Default)]
pub(super) struct Memory {
    /// Changed only through [`Memory::put`] and [`Memory::take`], which keep `held` in step.
    open: HashMap<String, Lease>,
    /// What the open leases hold, so that an admission reads it instead of walking them all.
    held: Held,
    /// Team → its latest spend signal: month-to-date USD, and when.
    pub(super) spend: BTreeMap<String, (f64, i64)>,
    /// Blocked teams.
    pub(super) blocked: BTreeSet<String>,
    /// Lease → the time its exemption from the runtime rules ends.
    pub(super) exempt: HashMap<String, i64>,
    /// Steps of the runtime rules already taken (see
    /// [`Store::record_once`](super::Store::record_once)).
    pub(super) marks: HashSet<String>,
    /// Open lease → the time of the newest `lease_utilization` signal handled for it (see
    /// [`Store::note_utilization_signal`](super::Store::note_utilization_signal)).
    pub(super) signals: HashMap<String, i64>,
    /// The PostgreSQL store's `store_version` that memory is up to date with (see
    /// `postgres::catch_up`); unused by SQLite's, whose memory is the only writer.
    pub(super) version: i64,
    /// The admissions' Idempotency-Keys of the last [`KEY_RETENTION_MS`]: (team, key) → the
    /// lease admitted with it, open or not.
    keys: HashMap<(String, String), String>,
    /// The same keys by the time their lease was granted, for forgetting the oldest.
    keys_by_grant: BTreeSet<(i64, (String, String))>,
}

/// How long an admission's Idempotency-Key is remembered after its lease was granted: asked
/// again within this time (by a client that retried on another replica after losing an
/// answer), the same key is answered with the same lease, never with a second one.
pub(super) const KEY_RETENTION_MS: i64 = 24 * 3_600_000;

/// Loads the recently used Idempotency-Keys ([`Memory::note_key`]): those of the leases granted
/// within [`KEY_RETENTION_MS`] of the newest keyed one, as `SELECT {COLUMNS} …`.
pub(super) fn recent_keys_sql(placeholder: &str) -> String {
    format!(
        "SELECT {COLUMNS} FROM leases WHERE admission_key IS NOT NULL AND granted_at > \
         (SELECT max(granted_at) FROM leases WHERE admission_key IS NOT NULL) - {placeholder}"
    )
}

/// What the open leases hold, by team and by substrate.
#[derive(Default)]
struct Held {
    /// GPUs, by team.
    gpus: BTreeMap<String, u32>,
    /// Named GPUs, by substrate.
    busy: BTreeMap<String, Arc<HeldGpus>>,
    /// Pooled GPUs, by substrate and model.
    pooled: BTreeMap<String, BTreeMap<String, u32>>,
    /// What each team's open leases cost over time, summed so that a team's spend is read
    /// without walking its leases.
    accruals: BTreeMap<String, Accruals>,
}

/// What a team's open leases have cost, kept as exact sums per model. A lease accrues from its
/// grant or from `since` (the team's latest spend signal, else the month's start), whichever is
/// later, so over the leases of a model the GPU-milliseconds to `now` are
/// `now × GPUs − since × GPUs granted by since − Σ grant × GPUs of those granted after`; the sums
/// of leases granted by `since` are folded in as `since` moves, each lease once.
#[derive(Default)]
struct Accruals {
    models: BTreeMap<String, ModelAccrual>,
}

/// One model's sums. Any `folded_until` is consistent while there are no leases, so the
/// default (0) is as good a start as any.
#[derive(Default)]
struct ModelAccrual {
    /// Open leases by grant time (ms): GPUs, and grant × GPUs.
    by_grant: BTreeMap<i64, (i64, i128)>,
    /// The same over every open lease.
    gpus: i64,
    weighted: i128,
    /// The same over the leases granted by `folded_until`.
    folded_until: i64,
    folded_gpus: i64,
    folded_weighted: i128,
}

impl ModelAccrual {
    /// Counts `gpus` GPUs granted at `granted_at` in the sums (negative: takes them out).
    fn add(&mut self, granted_at: i64, gpus: i64) {
        let weighted = i128::from(granted_at) * i128::from(gpus);
        let entry = self.by_grant.entry(granted_at).or_default();
        entry.0 += gpus;
        entry.1 += weighted;
        if entry.0 == 0 {
            self.by_grant.remove(&granted_at);
        }
        self.gpus += gpus;
        self.weighted += weighted;
        if granted_at <= self.folded_until {
            self.folded_gpus += gpus;
            self.folded_weighted += weighted;
        }
    }

    /// GPU-milliseconds accrued by `now`, counting from `since` (None when a lease or `since`
    /// lies after `now`: a clock that went back; the caller walks the leases then).
    fn gpu_ms(&mut self, since: i64, now: i64) -> Option<i128> {
        let latest = self.by_grant.last_key_value().map_or(i64::MIN, |(&g, _)| g);
        if now < since || now < latest {
            return None;
        }
        use std::ops::Bound::{Excluded, Included};
        if since > self.folded_until {
            for (_, &(g, w)) in self
                .by_grant
                .range((Excluded(self.folded_until), Included(since)))
            {
                self.folded_gpus += g;
                self.folded_weighted += w;
            }
        } else if since < self.folded_until {
            for (_, &(g, w)) in self
                .by_grant
                .range((Excluded(since), Included(self.folded_until)))
            {
                self.folded_gpus -= g;
                self.folded_weighted -= w;
            }
        }
        self.folded_until = since;
        let from = i128::from(since) * i128::from(self.folded_gpus)
            + (self.weighted - self.folded_weighted);
        Some(i128::from(now) * i128::from(self.gpus) - from)
    }
}

impl Accruals {
    /// Counts `lease`'s GPUs in its model's sums, `sign` 1, or takes them out, `sign` -1.
    fn add(&mut self, lease: &Lease, sign: i64) {
        let model = slot(&mut self.models, &lease.gpu_model);
        model.add(lease.granted_at, sign * i64::from(lease.gpu_count));
        if model.by_grant.is_empty() {
            self.models.remove(&lease.gpu_model);
        }
    }

    /// USD accrued by `now` since `since`, or None (see [`ModelAccrual::gpu_ms`]).
    fn usd(&mut self, since: i64, now: i64, pricing: &PricingConfig) -> Option<f64> {
        let mut usd = 0.0;
        for (model, accrual) in &mut self.models {
            let gpu_ms = accrual.gpu_ms(since, now)?;
            usd += gpu_ms as f64 / 3_600_000.0 * pricing.usd_per_gpu_hour(model);
        }
        Some(usd)
    }
}

impl Memory {
    /// The open lease `id`.
    pub(super) fn open(&self, id: &str) -> Option<&Lease> {
        self.open.get(id)
    }

    /// The lease admitted for `team` with Idempotency-Key `key` within [`KEY_RETENTION_MS`]
    /// of `now_ms`, open or not.
    pub(super) fn keyed(&mut self, team: &str, key: &str, now_ms: i64) -> Option<String> {
        while let Some((granted_at, _)) = self.keys_by_grant.first() {
            if *granted_at >= now_ms.saturating_sub(KEY_RETENTION_MS) {
                break;
            }
            let (_, slot) = self.keys_by_grant.pop_first().expect("first was read");
            self.keys.remove(&slot);
        }
        self.keys.get(&(team.to_owned(), key.to_owned())).cloned()
    }

    /// Remembers `lease`'s Idempotency-Key, if it has one (a lease read back or caught up from
    /// another replica, open or ended).
    pub(super) fn note_key(&mut self, lease: &Lease) {
        let Some(key) = &lease.admission_key else {
            return;
        };
        let slot = (lease.team.clone(), key.clone());
        if !self.keys.contains_key(&slot) {
            self.keys.insert(slot.clone(), lease.id.clone());
            self.keys_by_grant.insert((lease.granted_at, slot));
        }
    }

    /// Every open lease, in no order.
    pub(super) fn open_leases(&self) -> impl Iterator<Item = &Lease> {
        self.open.values()
    }

    /// Records `lease` as open (replacing its previous version) and what it holds.
    pub(super) fn put(&mut self, lease: Lease) {
        self.note_key(&lease);
        // A change of state, end or release holds what it held: only the lease is replaced.
        if let Some(open) = self.open.get_mut(&lease.id) {
            let holds_the_same = open.team == lease.team
                && open.substrate == lease.substrate
                && open.gpu_model == lease.gpu_model
                && open.gpu_count == lease.gpu_count
                && open.gpu_uuids == lease.gpu_uuids
                && open.granted_at == lease.granted_at;
            if holds_the_same {
                *open = lease;
                return;
            }
        }
        self.take(&lease.id);
        let held = &mut self.held;
        *slot(&mut held.gpus, &lease.team) += lease.gpu_count;
        if lease.gpu_uuids.is_empty() {
            *slot(slot(&mut held.pooled, &lease.substrate), &lease.gpu_model) += lease.gpu_count;
        } else {
            Arc::make_mut(slot(&mut held.busy, &lease.substrate))
                .extend(lease.gpu_uuids.iter().cloned());
        }
        slot(&mut held.accruals, &lease.team).add(&lease, 1);
        self.open.insert(lease.id.clone(), lease);
    }

    /// Forgets an open lease and what it held; a team or pooled model left holding nothing has
    /// no entry, as if it never held anything.
    pub(super) fn take(&mut self, id: &str) -> Option<Lease> {
        let lease = self.open.remove(id)?;
        let held = &mut self.held;
        if let Some(gpus) = held.gpus.get_mut(&lease.team) {
            *gpus = gpus.saturating_sub(lease.gpu_count);
            if *gpus == 0 {
                held.gpus.remove(&lease.team);
            }
        }
        if lease.gpu_uuids.is_empty() {
            if let Some(models) = held.pooled.get_mut(&lease.substrate) {
                if let Some(n) = models.get_mut(&lease.gpu_model) {
                    *n = n.saturating_sub(lease.gpu_count);
                    if *n == 0 {
                        models.remove(&lease.gpu_model);
                    }
                }
                if models.is_empty() {
                    held.pooled.remove(&lease.substrate);
                }
            }
        } else if let Some(busy) = held.busy.get_mut(&lease.substrate) {
            // Kept when empty: placement follows this history of changes, and a new one would
            // make it count the substrate's free GPUs anew.
            let set = Arc::make_mut(busy);
            for uuid in &lease.gpu_uuids {
                set.remove(uuid);
            }
        }
        if let Some(accruals) = held.accruals.get_mut(&lease.team) {
            accruals.add(&lease, -1);
            if accruals.models.is_empty() {
                held.accruals.remove(&lease.team);
            }
        }
        Some(lease)
    }

    /// The whole ledger: every team's spend.
    pub(super) fn ledger(&mut self, now_ms: i64, pricing: &PricingConfig) -> Ledger {
        let mut teams: BTreeSet<String> = self.held.accruals.keys().cloned().collect();
        teams.extend(self.spend.keys().cloned());
        let spend_usd = teams
            .into_iter()
            .filter_map(|team| {
                let usd = self.spend_of(&team, now_ms, pricing)?;
                Some((team, usd))
            })
            .collect();
        Ledger {
            spend_usd,
            ..self.holdings()
        }
    }

    /// The ledger an admission or resize for `team` reads: what every team holds, but only
    /// `team`'s spend (all the policy looks at).
    pub(super) fn ledger_of(&mut self, team: &str, now_ms: i64, pricing: &PricingConfig) -> Ledger {
        let mut ledger = self.holdings();
        if let Some(usd) = self.spend_of(team, now_ms, pricing) {
            ledger.spend_usd.insert(team.to_owned(), usd);
        }
        ledger
    }

    /// Held GPUs and blocked teams, without spend.
    fn holdings(&self) -> Ledger {
        Ledger {
            held_gpus: self.held.gpus.clone(),
            spend_usd: BTreeMap::new(),
            blocked: self.blocked.clone(),
            busy: self.held.busy.clone(),
            pooled_in_use: self.held.pooled.clone(),
        }
    }

    /// `team`'s month-to-date spend: its latest spend signal of this month plus what its open
    /// leases have accrued since (or since the month began, or since they were granted,
    /// whichever is latest), at their current GPU counts. None when it has neither.
    pub(super) fn spend_of(
        &mut self,
        team: &str,
        now_ms: i64,
        pricing: &PricingConfig,
    ) -> Option<f64> {
        let month_start = month_start_ms(now_ms);
        let signal = self
            .spend
            .get(team)
            .filter(|&&(_, ts)| ts >= month_start)
            .copied();
        let since = signal.map_or(month_start, |(_, ts)| ts);
        let accrued = match self.held.accruals.get_mut(team) {
            None if signal.is_none() => return None,
            None => 0.0,
            Some(accruals) => match accruals.usd(since, now_ms, pricing) {
                Some(usd) => usd,
                // A clock that went back: lease by lease, each accruing nothing before it began.
                None => self
                    .open
                    .values()
                    .filter(|l| l.team == team)
                    .map(|l| {
                        let ms = (now_ms - since.max(l.granted_at)).max(0);
                        ms as f64 / 3_600_000.0
                            * f64::from(l.gpu_count)
                            * pricing.usd_per_gpu_hour(&l.gpu_model)
                    })
                    .sum(),
            },
        };
        Some(signal.map_or(0.0, |(usd, _)| usd) + accrued)
    }
}

/// `map[key]`, inserted as the default first if absent; the key is copied only then.
fn slot<'m, V: Default>(map: &'m mut BTreeMap<String, V>, key: &str) -> &'m mut V {
    if !map.contains_key(key) {
        map.insert(key.to_owned(), V::default());
    }
    map.get_mut(key).expect("the key was just inserted")
}

/// Reads what memory holds from the file.
pub(super) fn load(conn: &Connection) -> Result<Memory, StoreError> {
    let mut memory = Memory::default();
    {
        let mut stmt = conn.prepare(&format!("SELECT {COLUMNS} FROM leases WHERE {OPEN}"))?;
        let rows = stmt.query_map([], row_to_raw)?;
        for row in rows {
            let lease = row.map_err(StoreError::from).and_then(RawLease::parse)?;
            memory.put(lease);
        }
        let mut stmt = conn.prepare(&recent_keys_sql("?1"))?;
        let rows = stmt.query_map([KEY_RETENTION_MS], row_to_raw)?;
        for row in rows {
            let lease = row.map_err(StoreError::from).and_then(RawLease::parse)?;
            memory.note_key(&lease);
        }
    }
    {
        let mut stmt = conn.prepare("SELECT team, month_to_date_usd, ts_ms FROM team_spend")?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, f64>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })?;
        for row in rows {
            let (team, usd, ts) = row?;
            memory.spend.insert(team, (usd, ts));
        }
    }
    {
        let mut stmt = conn.prepare("SELECT team FROM blocked_teams")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        memory.blocked = rows.collect::<Result<_, _>>()?;
    }
    {
        let mut stmt = conn.prepare("SELECT lease_id, until_ms FROM exemptions")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
        for row in rows {
            let (lease, until) = row?;
            if memory.open.contains_key(&lease) {
                memory.exempt.insert(lease, until);
            }
        }
    }
    {
        let mut stmt = conn.prepare("SELECT lease_id, ts_ms FROM lease_signals")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
        for row in rows {
            let (lease, ts_ms) = row?;
            if memory.open.contains_key(&lease) {
                memory.signals.insert(lease, ts_ms);
            }
        }
    }
    let mut stmt = conn.prepare("SELECT key FROM rule_marks")?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
    memory.marks = rows.collect::<Result<_, _>>()?;
    Ok(memory)
}

/// Start of the UTC calendar month holding `ms`.
fn month_start_ms(ms: i64) -> i64 {
    gpuwarden_schema::calendar::month_of(ms).0
}

#[cfg(test)]
mod tests {
    use gpuwarden_schema::config::GpuPrice;

    use super::*;
    use crate::store::types::tests::lease;
    use crate::store::LeaseState;

    /// A time in the middle of a month (2026-12-03).
    const NOW: i64 = 1_796_300_000_000;

    #[test]
    fn month_start_is_the_first_of_the_utc_month() {
        // 2024-03-15T12:00:00Z → 2024-03-01T00:00:00Z.
        assert_eq!(month_start_ms(1_710_504_000_000), 1_709_251_200_000);
        // 2024-02-29T23:59:59Z → 2024-02-01.
        assert_eq!(month_start_ms(1_709_251_199_000), 1_706_745_600_000);
        assert_eq!(month_start_ms(0), 0);
    }

    /// The holdings recounted from every open lease, as the ledger was once built each time.
    fn recount(memory: &Memory) -> Ledger {
        let mut ledger = Ledger {
            blocked: memory.blocked.clone(),
            ..Ledger::default()
        };
        for l in memory.open.values() {
            *slot(&mut ledger.held_gpus, &l.team) += l.gpu_count;
            if l.gpu_uuids.is_empty() {
                *slot(slot(&mut ledger.pooled_in_use, &l.substrate), &l.gpu_model) += l.gpu_count;
            } else {
                Arc::make_mut(slot(&mut ledger.busy, &l.substrate))
                    .extend(l.gpu_uuids.iter().cloned());
            }
        }
        ledger
    }

    /// A team's spend lease by lease, as the ledger once added it up each time.
    fn spend_lease_by_lease(
        memory: &Memory,
        team: &str,
        now: i64,
        pricing: &PricingConfig,
    ) -> Option<f64> {
        let month_start = month_start_ms(now);
        let signal = memory
            .spend
            .get(team)
            .filter(|&&(_, ts)| ts >= month_start)
            .copied();
        let since = signal.map_or(month_start, |(_, ts)| ts);
        let leases: Vec<&Lease> = memory.open.values().filter(|l| l.team == team).collect();
        if signal.is_none() && leases.is_empty() {
            return None;
        }
        let accrued: f64 = leases
            .iter()
            .map(|l| {
                let hours = (now - since.max(l.granted_at)).max(0) as f64 / 3_600_000.0;
                hours * f64::from(l.gpu_count) * pricing.usd_per_gpu_hour(&l.gpu_model)
            })
            .sum();
        Some(signal.map_or(0.0, |(usd, _)| usd) + accrued)
    }

    #[test]
    fn holdings_and_spend_kept_in_step_equal_a_recount_lease_by_lease() {
        let pricing = PricingConfig {
            default_usd_per_gpu_hour: 2.0,
            gpu: vec![GpuPrice {
                model_match: "h100".into(),
                usd_per_gpu_hour: 4.37,
            }],
            ..PricingConfig::default()
        };
        let mut memory = Memory::default();
        let month = month_start_ms(NOW);
        let hour: i64 = 3_600_000;
        memory.spend.insert("old".into(), (50.0, month - 1));
        let mut next = crate::xorshift(0x2545_f491_4f6c_dd1d_u64);
        let teams = ["ml", "cv", "old"];
        let mut now = month + 2 * hour;
        for step in 0..3_000 {
            let id = format!("l{}", next(60));
            match next(8) {
                0 | 1 => drop(memory.take(&id)),
                // A transition: the same holdings, another state.
                3 if memory.open.contains_key(&id) => {
                    let mut l = memory.open[&id].clone();
                    l.state = LeaseState::Releasing;
                    l.updated_at = step;
                    memory.put(l);
                    assert_eq!(memory.open[&id].state, LeaseState::Releasing);
                }
                // A spend signal moves the time the team's leases accrue from, either way.
                2 => {
                    let ts = month + next(4 * hour as u64) as i64;
                    memory
                        .spend
                        .insert(teams[next(3) as usize].into(), (next(500) as f64, ts));
                }
                _ => {
                    // New, resized, moved or pooled: whatever it held before must be let go.
                    let mut l = *lease(&id, LeaseState::Active, step);
                    l.team = teams[next(3) as usize].into();
                    l.substrate = ["sim", "pool"][next(2) as usize].into();
                    l.gpu_model = ["NVIDIA H100 80GB HBM3", "A100"][next(2) as usize].into();
                    l.gpu_count = 1 + next(4) as u32;
                    l.gpu_uuids = match l.substrate.as_str() {
                        "pool" => Vec::new(),
                        _ => (0..l.gpu_count).map(|g| format!("GPU-{id}-{g}")).collect(),
                    };
                    l.granted_at = month + next(4 * hour as u64) as i64;
                    memory.put(l);
                }
            }
            // Mostly forward, now and then back (before some grants), or into the next month.
            now = match next(10) {
                0 => month + next(2 * hour as u64) as i64,
                1 => month + 32 * 24 * hour + next(hour as u64) as i64,
                _ => now.max(month + 4 * hour) + next(60_000) as i64,
            };
            let whole = memory.ledger(now, &pricing);
            let recounted = recount(&memory);
            assert_eq!(whole.held_gpus, recounted.held_gpus, "step {step}");
            let mut kept = whole.busy.clone();
            kept.retain(|_, held| !held.is_empty());
            assert_eq!(kept, recounted.busy, "step {step}");
            assert_eq!(whole.pooled_in_use, recounted.pooled_in_use, "step {step}");
            for team in teams {
                let want = spend_lease_by_lease(&memory, team, now, &pricing);
                let one = memory.ledger_of(team, now, &pricing);
                assert_eq!(one.held_gpus, whole.held_gpus);
                for (got, what) in [
                    (one.spend_usd.get(team), "alone"),
                    (whole.spend_usd.get(team), "in the whole ledger"),
                ] {
                    let same = match (got, want) {
                        (Some(&a), Some(b)) => (a - b).abs() <= 1e-9 * b.abs().max(1.0),
                        (a, b) => a.is_none() && b.is_none(),
                    };
                    assert!(
                        same,
                        "step {step}, {team} {what}: {got:?}, lease by lease {want:?}"
                    );
                }
            }
            if next(50) == 0 {
                // Back into this month, for the next steps.
                now = month + 4 * hour;
            }
        }
        assert!(memory.held.accruals.values().all(|a| !a.models.is_empty()));
    }
}
