//! The PostgreSQL elector: the thread of each replica that claims the `leader` row's lease when
//! it is free or expired, renews it every third of the lease while it holds it, and gives it up
//! when the store closes, recording what it finds in the replica's [`Leadership`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use postgres::Client;

use super::leader::{Leadership, MARGIN_DIVISOR, NOW_MS};
use super::postgres::Target;
use super::types::StoreError;

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
