//! The lease store against a real SQLite file: admission is atomic under concurrency, leases and
//! quota survive a restart, the outbox holds every change in order, and the state machine refuses
//! invalid transitions.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gpuwarden_enforcer::drivers::{Gpu, Inventory};
use gpuwarden_enforcer::policy::{
    evaluate, AdmissionRequest, Decision, Placements, Principal, ReasonCode, Request, Snapshot,
    SubstrateState,
};
use gpuwarden_enforcer::store::{LeaseFilter, LeaseState, Ledger, Store, StoreError};
use gpuwarden_schema::config::{Config, Role, TeamConfig};
use gpuwarden_schema::{ReleaseReason, Workload};

mod support;

use support::eventually;

const NOW: i64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z

fn config(quota: u32) -> Arc<Config> {
    Arc::new(Config {
        teams: vec![TeamConfig {
            name: "ml".into(),
            members: Vec::new(),
            gpu_quota: quota,
            monthly_budget_usd: 1e9,
            allowed_models: Vec::new(),
        }],
        ..Config::default()
    })
}

fn inventory(gpus: u32) -> SubstrateState {
    SubstrateState {
        name: "sim".into(),
        inventory: Arc::new(Inventory {
            gpus: (0..gpus)
                .map(|i| Gpu {
                    uuid: format!("GPU-{i}"),
                    host: format!("h{}", i / 8),
                    index: i % 8,
                    model: "NVIDIA H100 80GB HBM3".into(),
                })
                .collect(),
            pooled: Vec::new(),
            queues: false,
        }),
        ..SubstrateState::default()
    }
}

fn request(gpus: u32) -> Request {
    Request {
        principal: Principal {
            name: "root".into(),
            role: Role::Admin,
            teams: Vec::new(),
        },
        admission: AdmissionRequest {
            team: "ml".into(),
            user: "ada".into(),
            project: "p".into(),
            workload: Workload::Training,
            gpus,
            gpu_model: None,
            substrate: None,
            duration: Some(Duration::from_secs(3600)),
            labels: None,
            dry_run: false,
            command: None,
        },
    }
}

/// The policy as the API runs it inside the store's transaction, over one simulated substrate
/// of `inventory_gpus` GPUs.
fn decide<'a>(
    req: &'a Request,
    config: &'a Arc<Config>,
    inventory_gpus: u32,
) -> impl FnOnce(Ledger) -> Decision + 'a {
    move |ledger| {
        let mut sub = inventory(inventory_gpus);
        sub.busy = ledger.busy.get("sim").cloned().unwrap_or_default();
        let snapshot = Snapshot {
            config: config.clone(),
            held_gpus: ledger.held_gpus,
            spend_usd: ledger.spend_usd,
            blocked: ledger.blocked,
            substrates: vec![sub],
        };
        evaluate(req, &snapshot, &mut Placements::default())
    }
}

/// Admits through the store exactly as the API does: the policy runs inside the transaction.
fn admit(store: &Store, config: &Arc<Config>, gpus: u32, inventory_gpus: u32) -> bool {
    let req = request(gpus);
    let (decision, lease) = store
        .admit(
            NOW,
            &config.pricing,
            &req.admission,
            decide(&req, config, inventory_gpus),
        )
        .wait()
        .unwrap();
    assert_eq!(decision.admitted(), lease.is_some());
    lease.is_some()
}

/// Admits one GPU without waiting for the commit, as a step nobody waits for is taken.
fn admit_without_waiting(store: &Store, config: &Arc<Config>) -> bool {
    let req = request(1);
    let before = store.open_leases().unwrap().len();
    let pending = store.admit(
        NOW,
        &config.pricing,
        &req.admission,
        decide(&req, config, 8),
    );
    // Memory holds the lease at once; its commit is left to the writer.
    let admitted = store.open_leases().unwrap().len() == before + 1;
    drop(pending);
    admitted
}

/// A store in a new directory, holding one admitted lease of one GPU (quota 4).
struct OneLease {
    /// Removed when dropped: keep it for as long as the store is used.
    dir: tempfile::TempDir,
    path: std::path::PathBuf,
    config: Arc<Config>,
    store: Store,
    /// The lease.
    id: String,
}

fn one_lease() -> OneLease {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("enforcer.db");
    let config = config(4);
    let store = Store::open(&path).unwrap();
    assert!(admit(&store, &config, 1, 8));
    let id = store.open_leases().unwrap()[0].id.clone();
    OneLease {
        dir,
        path,
        config,
        store,
        id,
    }
}

fn open_gpus(store: &Store) -> Vec<String> {
    store
        .leases(&LeaseFilter::default())
        .wait()
        .unwrap()
        .into_iter()
        .filter(|l| l.state.is_open())
        .flat_map(|l| l.gpu_uuids)
        .collect()
}

/// 200 threads admitting one GPU each at once through one store; (admitted, GPUs held after a
/// reopen).
fn concurrent(path: &Path, quota: u32, inventory_gpus: u32) -> (usize, u32) {
    let config = config(quota);
    let store = Store::open(path).unwrap();
    let start = Arc::new(std::sync::Barrier::new(200));
    let threads: Vec<_> = (0..200)
        .map(|_| {
            let (store, config, start) = (store.clone(), config.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                admit(&store, &config, 1, inventory_gpus)
            })
        })
        .collect();
    let admitted = threads
        .into_iter()
        .map(|t| t.join().unwrap())
        .filter(|a| *a)
        .count();
    drop(store);
    let store = Store::open(path).unwrap();
    let held = store.ledger(NOW, &config.pricing).unwrap().held_gpus["ml"];
    (admitted, held)
}

#[test]
fn two_hundred_concurrent_admissions_fill_a_quota_of_16_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("enforcer.db");
    let (admitted, held) = concurrent(&path, 16, 64);
    assert_eq!(admitted, 16);
    assert_eq!(held, 16);
    let store = Store::open(&path).unwrap();
    let gpus = open_gpus(&store);
    assert_eq!(gpus.len(), 16);
    // Denials are audited too: 16 admits + 16 grants + 184 denials.
    assert_eq!(
        store.outbox_pending(1000).wait().unwrap().len(),
        16 * 2 + 184
    );
}

#[test]
fn two_hundred_concurrent_admissions_never_place_a_gpu_twice() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("enforcer.db");
    let (admitted, held) = concurrent(&path, 1000, 8);
    assert_eq!((admitted, held), (8, 8));
    let gpus = open_gpus(&Store::open(&path).unwrap());
    let distinct: BTreeSet<&String> = gpus.iter().collect();
    assert_eq!(distinct.len(), 8, "{gpus:?}");
}

#[test]
fn one_store_owns_a_database_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("enforcer.db");
    let store = Store::open(&path).unwrap();
    // Memory is the admission's truth, so a second owner would break the quota.
    let err = Store::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::InUse(_)), "{err}");
    assert!(
        err.to_string().contains("in use by another enforcer"),
        "{err}"
    );
    // A clone shares the one store; the lock goes with the last of them.
    let clone = store.clone();
    drop(store);
    assert!(matches!(Store::open(&path), Err(StoreError::InUse(_))));
    drop(clone);
    Store::open(&path).unwrap();
}

#[test]
fn a_change_not_waited_on_is_still_committed_before_the_store_closes() {
    let OneLease {
        dir: _dir,
        path,
        store,
        id,
        ..
    } = one_lease();
    let pending = store.transition(&id, LeaseState::Active, NOW + 1, ReleaseReason::User, "");
    // Memory changes at once: the next call sees it before the commit is heard of.
    assert_eq!(store.open_leases().unwrap()[0].state, LeaseState::Active);
    drop(pending);
    drop(store);
    let store = Store::open(&path).unwrap();
    let lease = store.lease(&id).wait().unwrap().unwrap();
    assert_eq!(lease.state, LeaseState::Active);
    assert_eq!(lease.updated_at, NOW + 1);
}

/// A change nobody waits for does not wake the writer, but it is committed on its own soon
/// after (the store's lazy commit), and a change someone waits for carries it along.
#[test]
fn changes_nobody_waits_for_are_committed_soon_or_with_the_next_one() {
    let OneLease {
        dir: _dir,
        config,
        store,
        id,
        ..
    } = one_lease();
    let before = store.commit_stats();
    drop(store.transition(&id, LeaseState::Active, NOW + 1, ReleaseReason::User, ""));
    eventually(
        "the commit of a change nobody waited for",
        Duration::from_secs(10),
        || {
            let stats = store.commit_stats();
            if stats.writes == before.writes {
                Err(format!("{stats:?}"))
            } else {
                Ok(())
            }
        },
    );
    let after = store.commit_stats();
    assert_eq!(
        (after.commits, after.writes),
        (before.commits + 1, before.writes + 1)
    );

    // Two changes nobody waits for, then one somebody does: once that one is committed, so
    // are the two queued before it (usually in the same commit).
    let before = store.commit_stats();
    assert!(admit_without_waiting(&store, &config));
    assert!(admit_without_waiting(&store, &config));
    assert!(admit(&store, &config, 1, 8));
    let after = store.commit_stats();
    assert_eq!(after.writes, before.writes + 3, "{before:?} → {after:?}");
}

#[test]
fn leases_and_quota_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("enforcer.db");
    let config = config(4);
    let store = Store::open(&path).unwrap();
    assert_eq!(store.schema_version().wait().unwrap(), 5);
    assert!(admit(&store, &config, 3, 8));
    let before = store.leases(&LeaseFilter::default()).wait().unwrap();
    drop(store);

    let store = Store::open(&path).unwrap();
    assert_eq!(store.schema_version().wait().unwrap(), 5);
    let after = store.leases(&LeaseFilter::default()).wait().unwrap();
    assert_eq!(before, after);
    assert_eq!(after[0].gpu_count, 3);
    assert_eq!(after[0].expires_at, Some(NOW + 3_600_000));
    assert_eq!(
        store.ledger(NOW, &config.pricing).unwrap().held_gpus["ml"],
        3
    );
    // The quota still counts the lease from before the restart.
    assert!(!admit(&store, &config, 2, 8));
    assert!(admit(&store, &config, 1, 8));
    assert!(
        dir.path().join("enforcer.db-wal").exists(),
        "not in WAL mode"
    );
}

#[test]
fn the_outbox_holds_every_change_in_order_until_published() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("e.db")).unwrap();
    let config = config(4);
    assert!(admit(&store, &config, 2, 8));
    assert!(!admit(&store, &config, 3, 8));
    let id = store.leases(&LeaseFilter::default()).wait().unwrap()[0]
        .id
        .clone();
    store
        .transition(&id, LeaseState::Active, NOW + 1, ReleaseReason::User, "")
        .wait()
        .unwrap();
    store
        .transition(
            &id,
            LeaseState::Released,
            NOW + 2,
            ReleaseReason::User,
            "done",
        )
        .wait()
        .unwrap();

    let rows = store.outbox_pending(10).wait().unwrap();
    let kinds: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            let v: serde_json::Value = serde_json::from_str(&r.payload).unwrap();
            let kind = v.get("event").or(v.get("action")).unwrap();
            (r.topic.clone(), kind.as_str().unwrap().to_string())
        })
        .collect();
    let expected = [
        ("gpuwarden.leases", "granted"),
        ("gpuwarden.actions", "admit"),
        ("gpuwarden.actions", "deny"),
        ("gpuwarden.leases", "released"),
        ("gpuwarden.actions", "reclaim"),
    ];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(kinds, expected);
    let deny: serde_json::Value = serde_json::from_str(&rows[2].payload).unwrap();
    assert_eq!(deny["reason"], "quota_exceeded");
    let released: serde_json::Value = serde_json::from_str(&rows[3].payload).unwrap();
    assert_eq!(released["reason"], "user");
    assert_eq!(rows[0].key, id);

    store
        .outbox_mark_published(&[rows[0].id, rows[1].id], NOW + 3)
        .wait()
        .unwrap();
    let rest = store.outbox_pending(10).wait().unwrap();
    assert_eq!(rest.len(), 3);
    assert_eq!(rest[0].id, rows[2].id);
    // Released GPUs no longer count.
    assert_eq!(
        store
            .ledger(NOW, &config.pricing)
            .unwrap()
            .held_gpus
            .get("ml"),
        None
    );
}

#[test]
fn invalid_transitions_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("e.db")).unwrap();
    assert!(admit(&store, &config(4), 1, 8));
    let id = store.leases(&LeaseFilter::default()).wait().unwrap()[0]
        .id
        .clone();
    store
        .transition(&id, LeaseState::Released, NOW, ReleaseReason::Admin, "")
        .wait()
        .unwrap();
    let err = store
        .transition(&id, LeaseState::Active, NOW, ReleaseReason::User, "")
        .wait()
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidTransition { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        format!("lease {id} is released and cannot become active")
    );
    assert!(matches!(
        store
            .transition("nope", LeaseState::Active, NOW, ReleaseReason::User, "")
            .wait(),
        Err(StoreError::NotFound(_))
    ));
}

#[test]
fn expiry_spend_and_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("e.db")).unwrap();
    let config = config(8);
    assert!(admit(&store, &config, 2, 8));
    assert!(store.due_for_expiry(NOW + 3_599_999).unwrap().is_empty());
    assert_eq!(store.due_for_expiry(NOW + 3_600_000).unwrap().len(), 1);

    // $2/GPU-hour default: a signal of $100 half an hour in, then 2 GPUs for another half hour.
    store
        .record_team_spend("ml", 100.0, 4.0, NOW + 1_800_000, &config.pricing)
        .wait()
        .unwrap();
    store
        .record_team_spend("ml", 1.0, 4.0, NOW, &config.pricing)
        .wait()
        .unwrap(); // older: ignored
    let ledger = store.ledger(NOW + 3_600_000, &config.pricing).unwrap();
    assert!(
        (ledger.spend_usd["ml"] - 102.0).abs() < 1e-9,
        "{:?}",
        ledger.spend_usd
    );

    store.block_team("ml", "budget", NOW).wait().unwrap();
    assert!(!admit(&store, &config, 1, 8));
    store.unblock_team("ml", NOW).wait().unwrap();
    assert!(admit(&store, &config, 1, 8));
    let actions: BTreeMap<String, usize> = store
        .outbox_pending(100)
        .wait()
        .unwrap()
        .iter()
        .filter_map(|r| {
            let v: serde_json::Value = serde_json::from_str(&r.payload).ok()?;
            Some(v.get("action")?.as_str()?.to_string())
        })
        .fold(BTreeMap::new(), |mut m, a| {
            *m.entry(a).or_default() += 1;
            m
        });
    assert_eq!(actions["block"], 1);
    assert_eq!(actions["unblock"], 1);
    assert_eq!(actions["deny"], 1);
    let _ = ReasonCode::TeamBlocked;
}

#[test]
fn exemptions_and_rule_marks_survive_a_restart_and_end_with_the_lease() {
    let OneLease {
        dir: _dir,
        path,
        store,
        id,
        ..
    } = one_lease();
    store
        .exempt(&id, NOW + 3_600_000, "root", "demo", NOW)
        .wait()
        .unwrap();
    let warning = gpuwarden_schema::Action {
        v: gpuwarden_schema::V1,
        ts_ms: NOW,
        action: gpuwarden_schema::ActionKind::Alert,
        lease_id: Some(id.clone()),
        team: Some("ml".into()),
        reason: "idle_warning".into(),
        policy: None,
        driver: None,
        outcome: gpuwarden_schema::Outcome::Ok,
        detail: String::new(),
    };
    assert!(store.record_once("warn:1", &warning).wait().unwrap());
    assert!(!store.record_once("warn:1", &warning).wait().unwrap());
    drop(store);

    let store = Store::open(&path).unwrap();
    assert_eq!(store.exempt_until(&id), Some(NOW + 3_600_000));
    assert!(store.marked("warn:1"));
    assert!(!store.record_once("warn:1", &warning).wait().unwrap());
    let reasons: Vec<String> = store
        .outbox_pending(100)
        .wait()
        .unwrap()
        .iter()
        .filter(|r| r.topic == "gpuwarden.actions")
        .map(|r| {
            serde_json::from_str::<serde_json::Value>(&r.payload).unwrap()["reason"].to_string()
        })
        .collect();
    assert_eq!(reasons, ["\"admitted\"", "\"exempt\"", "\"idle_warning\""]);
    store
        .transition(&id, LeaseState::Released, NOW + 1, ReleaseReason::User, "")
        .wait()
        .unwrap();
    assert_eq!(store.exempt_until(&id), None);
    assert!(matches!(
        store
            .exempt(&id, NOW + 7_200_000, "root", "late", NOW + 2)
            .wait(),
        Err(StoreError::InvalidTransition { .. })
    ));
}

/// Every outbox row: (id, key, published_at), in id order, read from the file.
fn outbox_rows(path: &Path) -> Vec<(i64, String, Option<i64>)> {
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut stmt = conn
        .prepare("SELECT id, key, published_at FROM outbox ORDER BY id")
        .unwrap();
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap();
    rows.collect::<Result<_, _>>().unwrap()
}

fn fleet_alert(ts_ms: i64, reason: &str) -> gpuwarden_schema::Action {
    gpuwarden_enforcer::store::audit::Audit::fleet(gpuwarden_schema::ActionKind::Alert, reason).at(
        ts_ms,
        gpuwarden_schema::Outcome::Ok,
        "",
    )
}

#[test]
fn published_outbox_rows_past_the_retention_are_pruned_in_batches_and_unpublished_rows_never() {
    const DAY: i64 = 86_400_000;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let prune = |store: &Store, before: i64, batch: usize| {
        runtime.block_on(store.prune_outbox(before, batch)).unwrap()
    };
    let OneLease {
        dir: _dir,
        path,
        config,
        store,
        id: open_lease,
    } = one_lease();
    // A lease admitted and released: its four rows (granted, admit, released, reclaim).
    assert!(admit(&store, &config, 1, 8));
    let ended = store
        .open_leases()
        .unwrap()
        .into_iter()
        .find(|l| l.id != open_lease)
        .unwrap()
        .id;
    store
        .transition(&ended, LeaseState::Released, NOW, ReleaseReason::User, "")
        .wait()
        .unwrap();
    for reason in ["unpublished", "recent", "old-1", "old-2", "old-3", "newest"] {
        store
            .record_action(&fleet_alert(NOW, reason))
            .wait()
            .unwrap();
    }
    let rows = store.outbox_pending(100).wait().unwrap();
    assert_eq!(rows.len(), 12);
    let id_of = |reason: &str| {
        rows.iter()
            .find(|r| r.payload.contains(&format!("\"reason\":\"{reason}\"")))
            .unwrap()
            .id
    };
    let (unpublished, recent) = (id_of("unpublished"), id_of("recent"));
    // Kafka acknowledged every row but one on day 1, and `recent` on day 30.
    let long_ago: Vec<i64> = rows
        .iter()
        .map(|r| r.id)
        .filter(|&i| i != unpublished && i != recent)
        .collect();
    store
        .outbox_mark_published(&long_ago, NOW + DAY)
        .wait()
        .unwrap();
    store
        .outbox_mark_published(&[recent], NOW + 30 * DAY)
        .wait()
        .unwrap();

    // A week's retention on day 31, two rows per commit: the ended lease's four rows and the
    // three old alerts go.
    let before = store.commit_stats();
    let deleted = prune(&store, NOW + 24 * DAY, 2);
    assert_eq!(deleted, 7);
    assert!(
        store.commit_stats().commits >= before.commits + 4,
        "seven rows two at a time are four commits"
    );
    // (A fleet alert's key is its reason.)
    let kept: Vec<String> = outbox_rows(&path)
        .into_iter()
        .map(|(_, key, published)| {
            let state = if published.is_some() {
                "published"
            } else {
                "pending"
            };
            format!("{key} {state}")
        })
        .collect();
    assert_eq!(
        kept,
        [
            // The open lease's grant and admission: the portal shows its history.
            format!("{open_lease} published"),
            format!("{open_lease} published"),
            "unpublished pending".to_owned(),
            "recent published".to_owned(),
            // The newest row stays, so that outbox ids keep growing.
            "newest published".to_owned(),
        ]
    );
    assert_eq!(store.outbox_pending(100).wait().unwrap()[0].id, unpublished);
    // Nothing more to do until the retention passes the rest.
    assert_eq!(prune(&store, NOW + 24 * DAY, 2), 0);
    // With no retention at all, `recent` goes too; a row Kafka never acknowledged stays,
    // however old.
    assert_eq!(prune(&store, i64::MAX, 100), 1);
    let left: Vec<i64> = outbox_rows(&path)
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    assert_eq!(left.len(), 4);
    assert!(left.contains(&unpublished), "{left:?}");
    // New rows still come after the newest kept.
    store
        .record_action(&fleet_alert(NOW, "later"))
        .wait()
        .unwrap();
    let pending = store.outbox_pending(100).wait().unwrap();
    assert_eq!(pending.len(), 2);
    assert!(pending[1].id > id_of("newest"), "{pending:?}");
}

/// A ceiling no signal time in these tests reaches.
const FAR: i64 = i64::MAX;

#[test]
fn the_newest_utilization_signal_handled_survives_a_restart_and_ends_with_the_lease() {
    let OneLease {
        dir: _dir,
        path,
        store,
        id,
        ..
    } = one_lease();
    assert!(store
        .note_utilization_signal(&id, NOW + 10, FAR)
        .wait()
        .unwrap());
    assert!(!store
        .note_utilization_signal(&id, NOW + 10, FAR)
        .wait()
        .unwrap());
    assert!(!store
        .note_utilization_signal(&id, NOW + 5, FAR)
        .wait()
        .unwrap());
    assert!(!store
        .note_utilization_signal("no-such-lease", NOW + 10, FAR)
        .wait()
        .unwrap());
    drop(store);

    let store = Store::open(&path).unwrap();
    assert!(
        !store
            .note_utilization_signal(&id, NOW + 5, FAR)
            .wait()
            .unwrap(),
        "a signal older than one handled before the restart is still old"
    );
    assert!(store
        .note_utilization_signal(&id, NOW + 11, FAR)
        .wait()
        .unwrap());
    store
        .transition(&id, LeaseState::Released, NOW + 12, ReleaseReason::User, "")
        .wait()
        .unwrap();
    assert!(!store
        .note_utilization_signal(&id, NOW + 20, FAR)
        .wait()
        .unwrap());
    drop(store);
    let conn = rusqlite::Connection::open(&path).unwrap();
    let kept: i64 = conn
        .query_row("SELECT count(*) FROM lease_signals", [], |r| r.get(0))
        .unwrap();
    assert_eq!(kept, 0, "an ended lease's signal time is forgotten");
}

/// A kept signal time past the clock's ceiling (the clock moved back since it was handled, as
/// `gpuwarden up --start` on an existing database does) no longer shuts out the signals dated
/// before it, in this run or after a restart; a signal past the ceiling is never taken.
#[test]
fn a_signal_time_past_the_ceiling_is_not_taken_and_a_kept_one_no_longer_blocks() {
    let OneLease {
        dir: _dir,
        path,
        store,
        id,
        ..
    } = one_lease();
    let ceiling = NOW + 5 * 60_000;
    assert!(
        !store
            .note_utilization_signal(&id, ceiling + 1, ceiling)
            .wait()
            .unwrap(),
        "a time past the ceiling is not taken"
    );
    assert!(store
        .note_utilization_signal(&id, NOW, ceiling)
        .wait()
        .unwrap());
    // Handled while the clock read a day later; then the clock moved back to NOW.
    let day = 86_400_000;
    assert!(store
        .note_utilization_signal(&id, NOW + day, ceiling + day)
        .wait()
        .unwrap());
    assert!(
        store
            .note_utilization_signal(&id, NOW + 10, ceiling)
            .wait()
            .unwrap(),
        "a kept time past the ceiling does not shut out a signal of now"
    );
    assert!(!store
        .note_utilization_signal(&id, NOW + 5, ceiling)
        .wait()
        .unwrap());
    drop(store);

    let store = Store::open(&path).unwrap();
    assert!(
        !store
            .note_utilization_signal(&id, NOW + 5, ceiling)
            .wait()
            .unwrap(),
        "the lower time replaced the one past the ceiling in the file"
    );
    assert!(store
        .note_utilization_signal(&id, NOW + 20, ceiling)
        .wait()
        .unwrap());
}
