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
//! An SQLite store has one owner (its file lock), which always leads. The elector thread that
//! claims the lease on PostgreSQL is `election`'s; this module keeps what it found.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

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
pub(super) const MARGIN_DIVISOR: u32 = 10;

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

    /// Records what the elector read: this replica's term and how long its claim holds here,
    /// when it holds the lease, and the holder and term the database names.
    pub(super) fn record(&self, mine: Option<(i64, Instant)>, leader: String, term: i64) {
        {
            let mut state = lock(&self.state);
            state.mine = mine;
            state.leader = leader;
            state.term = term;
        }
        self.publish();
    }

    /// Tells subscribers whether this replica leads now (its claim may have run out).
    pub(super) fn publish(&self) {
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
pub(super) const NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/// The SQL a writer's transaction runs to read the lease's holder and term while the lease is
/// unexpired (no row when it has run out).
pub(super) fn holder_sql() -> String {
    format!("SELECT holder, term FROM leader WHERE id = 1 AND expires_ms > {NOW_MS}")
}

/// `mutex`'s guard, whether or not a holder panicked: the state changes by whole fields.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
