//! Which replica leads: the one that does the work that must happen once (runtime rules,
//! expiry, watchers' changes, reclaims, publishing the outbox).
//!
//! On PostgreSQL leadership is a lease in the database's `leader` row: the elector thread of each
//! replica claims it when it is free or expired and renews it while it holds it, every third of
//! the lease (`elect`). Each new holder gets the next **term**, its fencing token. A change made
//! through a leading view of the store ([`Store::leading`](super::Store::leading)) carries the
//! replica's term ([`Fence`]), and the writer commits it only if, inside its transaction, the
//! `leader` row still names this replica with this term and an unexpired lease: a leader that was
//! paused or cut off past its lease, and wakes up, changes nothing. It also stops treating itself
//! as leader on its own once its lease has run out on its monotonic clock, which keeps counting
//! while the process is stopped.
//!
//! The lease's expiry is read from PostgreSQL's clock, so the replicas' clocks do not matter.
//!
//! An SQLite store has one owner (its file lock), which always leads.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postgres::Client;

use super::postgres::Target;
use super::types::StoreError;
use super::writer::lock;

/// A leader's claim, as a change carries it: the replica and its term.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The replica.
    pub replica: String,
    /// Its term, which grows with every new holder.
    pub term: i64,
}

/// What a replica knows of the leadership: whether it leads, and who does.
#[derive(Debug)]
pub struct Leadership {
    state: Mutex<State>,
    /// Whether this replica leads, for whoever starts and stops the leader's work.
    leads: tokio::sync::watch::Sender<bool>,
}

#[derive(Debug, Default)]
struct State {
    /// This replica's name.
    replica: String,
    /// This replica's term and when its claim runs out here, when it holds the lease.
    mine: Option<(i64, Instant)>,
    /// The holder and term last read from the database (empty before the first).
    leader: String,
    term: i64,
}

/// The part of the lease kept as a safety margin: a replica stops leading this much earlier, by
/// its own clock, than the database lets the lease run.
const MARGIN_DIVISOR: u32 = 10;

impl Leadership {
    /// A replica named `replica`, not leading yet.
    pub(super) fn new(replica: &str) -> Self {
        Self {
            state: Mutex::new(State {
                replica: replica.to_owned(),
                ..State::default()
            }),
            leads: tokio::sync::watch::channel(false).0,
        }
    }

    /// The one owner of an SQLite store, which always leads.
    pub(super) fn sole(replica: &str) -> Self {
        let me = Self::new(replica);
        me.lead_alone(replica);
        me
    }

    /// Leads for good, as `replica` (an SQLite store's one owner).
    pub(super) fn lead_alone(&self, replica: &str) {
        {
            let mut state = lock(&self.state);
            state.replica = replica.to_owned();
            state.mine = Some((0, far_future()));
            state.leader = replica.to_owned();
        }
        self.publish();
    }

    /// Names this replica (before its elector starts).
    pub(super) fn rename(&self, replica: &str) {
        lock(&self.state).replica = replica.to_owned();
    }

    /// This replica's name.
    pub fn replica(&self) -> String {
        lock(&self.state).replica.clone()
    }

    /// This replica's fence, while it leads.
    pub fn fence(&self) -> Option<Fence> {
        let state = lock(&self.state);
        match state.mine {
            Some((term, until)) if Instant::now() < until => Some(Fence {
                replica: state.replica.clone(),
                term,
            }),
            _ => None,
        }
    }

    /// Whether this replica leads now.
    pub fn is_leader(&self) -> bool {
        self.fence().is_some()
    }

    /// The leader and its term, as last read (this replica's own claim when it leads).
    pub fn leader(&self) -> (String, i64) {
        let state = lock(&self.state);
        (state.leader.clone(), state.term)
    }

    /// Follows whether this replica leads (changes as the elector sees them).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<bool> {
        self.leads.subscribe()
    }

    fn record(&self, mine: Option<(i64, Instant)>, leader: String, term: i64) {
        {
            let mut state = lock(&self.state);
            state.mine = mine;
            state.leader = leader;
            state.term = term;
        }
        self.publish();
    }

    /// Tells subscribers whether this replica leads now (its claim may have run out).
    fn publish(&self) {
        let leads = self.is_leader();
        self.leads.send_if_modified(|was| {
            let changed = *was != leads;
            *was = leads;
            changed
        });
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 86_400)
}

/// The database's clock, in milliseconds since the epoch, as SQL.
const NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/// The elector thread: claims or renews the lease every third of `lease` until `stop` is set,
/// then gives it up (so another replica takes over at once rather than after the lease).
pub(super) fn elect(target: &Target, leadership: &Leadership, lease: Duration, stop: &AtomicBool) {
    let every = lease / 3;
    let replica = leadership.replica();
    let mut client: Option<Client> = None;
    let mut backoff = gpuwarden_schema::retry::Backoff::new(Duration::from_millis(200), every);
    while !stop.load(Ordering::Acquire) {
        let started = Instant::now();
        match claim(target, &mut client, &replica, lease) {
            Ok((mine, leader, term)) => {
                backoff.reset();
                let until = started + lease - lease / MARGIN_DIVISOR;
                let was = leadership.is_leader();
                leadership.record(mine.map(|t| (t, until)), leader.clone(), term);
                let now = leadership.is_leader();
                if now != was {
                    if now {
                        tracing::info!(replica = %replica, term, "this replica leads");
                    } else {
                        tracing::warn!(replica = %replica, leader = %leader, term, "this replica no longer leads");
                    }
                }
            }
            Err(e) => {
                if client.as_ref().is_some_and(Client::is_closed) {
                    client = None;
                }
                // The claim held runs out on its own; say so as soon as it does.
                leadership.publish();
                tracing::warn!(error = %e, "cannot renew or claim the leadership");
                sleep_unless(stop, backoff.next_pause());
                continue;
            }
        }
        sleep_unless(stop, every.saturating_sub(started.elapsed()));
    }
    if leadership.is_leader() {
        let resign = client.as_mut().map(|c| {
            c.execute(
                "UPDATE leader SET expires_ms = 0 WHERE id = 1 AND holder = $1",
                &[&replica],
            )
        });
        if let Some(Err(e)) = resign {
            tracing::debug!(error = %e, "could not give the leadership up; it runs out by itself");
        }
    }
    let (leader, term) = leadership.leader();
    leadership.record(None, leader, term);
}

/// Claims (or renews) the lease for `replica`: its term when it holds it, and the holder and
/// term the row names after.
fn claim(
    target: &Target,
    client: &mut Option<Client>,
    replica: &str,
    lease: Duration,
) -> Result<(Option<i64>, String, i64), StoreError> {
    if client.is_none() {
        *client = Some(target.connect()?);
    }
    let c = client.as_mut().expect("connected above");
    let fail = |e: postgres::Error| {
        StoreError::Unavailable(format!("PostgreSQL at {}: {e}", target.shown()))
    };
    let lease_ms = lease.as_millis() as i64;
    let mine = c
        .query_opt(
            &format!(
                "UPDATE leader SET term = CASE WHEN holder = $1 THEN term ELSE term + 1 END, \
                 holder = $1, expires_ms = {NOW_MS} + $2 \
                 WHERE id = 1 AND (holder = $1 OR expires_ms <= {NOW_MS}) RETURNING term"
            ),
            &[&replica, &lease_ms],
        )
        .map_err(fail)?
        .map(|r| r.get::<_, i64>(0));
    let row = c
        .query_one("SELECT holder, term FROM leader WHERE id = 1", &[])
        .map_err(fail)?;
    Ok((mine, row.get(0), row.get(1)))
}

/// The SQL a writer's transaction runs to read the lease's holder and term while the lease is
/// unexpired (no row when it has run out).
pub(super) fn holder_sql() -> String {
    format!("SELECT holder, term FROM leader WHERE id = 1 AND expires_ms > {NOW_MS}")
}

fn sleep_unless(stop: &AtomicBool, pause: Duration) {
    let until = Instant::now() + pause;
    while !stop.load(Ordering::Acquire) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
}

/// Starts the elector thread.
pub(super) fn spawn(
    target: Target,
    leadership: Arc<Leadership>,
    lease: Duration,
    stop: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>, StoreError> {
    std::thread::Builder::new()
        .name("lease-store-elect".into())
        .spawn(move || elect(&target, &leadership, lease, &stop))
        .map_err(|e| StoreError::Io(format!("cannot start the leader elector: {e}")))
}
