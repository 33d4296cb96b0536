//! The lease store against each of its databases, a real SQLite file and a real PostgreSQL
//! server (started by the tests, `support::pg`): admission is atomic under concurrency, leases
//! and quota survive a restart, the outbox holds every change in order, and the state machine
//! refuses invalid transitions. Each test of both runs once per database (`<test>::sqlite`,
//! `<test>::postgres`); then what only one of them does: SQLite's one owner per file and lazy
//! commits, PostgreSQL's replicas sharing one database.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpuwarden_enforcer::drivers::{Gpu, Inventory};
use gpuwarden_enforcer::policy::{
    evaluate, AdmissionRequest, Decision, Placements, Principal, ReasonCode, Request, Snapshot,
    SubstrateState,
};
use gpuwarden_enforcer::store::{Admitted, LeaseFilter, LeaseState, Ledger, Store, StoreError};
use gpuwarden_schema::config::{Config, Role, TeamConfig};
use gpuwarden_schema::{ReleaseReason, Workload};

mod support;

use support::eventually;
use support::pg::Postgres;
use support::stores::Db;

/// What a test looks at in a store's database.
impl Db {
    /// The schema version a new database is brought to.
    fn latest_schema(&self) -> i64 {
        if self.is_sqlite() {
            7
        } else {
            5
        }
    }

    /// Every outbox row: (id, key, published_at), in id order.
    fn outbox_rows(&self) -> Vec<(i64, String, Option<i64>)> {
        const SQL: &str = "SELECT id, key, published_at FROM outbox ORDER BY id";
        match self {
            Self::Sqlite { path, .. } => {
                let conn = rusqlite::Connection::open(path).unwrap();
                let mut stmt = conn.prepare(SQL).unwrap();
                let rows = stmt
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                    .unwrap();
                rows.collect::<Result<_, _>>().unwrap()
            }
            Self::Postgres { url } => Postgres::client(url)
                .query(SQL, &[])
                .unwrap()
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2)))
                .collect(),
        }
    }

    /// How many rows `table` holds.
    fn count(&self, table: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {table}");
        match self {
            Self::Sqlite { path, .. } => rusqlite::Connection::open(path)
                .unwrap()
                .query_row(&sql, [], |r| r.get(0))
                .unwrap(),
            Self::Postgres { url } => Postgres::client(url).query_one(&sql, &[]).unwrap().get(0),
        }
    }
}

/// Runs each named test (a function of a [`Db`]) on SQLite and on PostgreSQL, as
/// `<name>::sqlite` and `<name>::postgres`.
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn sqlite() {
                    super::$name(super::Db::sqlite());
                }

                #[test]
                fn postgres() {
                    super::$name(super::Db::postgres());
                }
            }
        )*
    };
}

on_both!(
    two_hundred_concurrent_admissions_fill_a_quota_of_16_exactly,
    two_hundred_concurrent_admissions_never_place_a_gpu_twice,
    a_change_not_waited_on_is_still_committed_before_the_store_closes,
    leases_and_quota_survive_a_restart,
    the_outbox_holds_every_change_in_order_until_published,
    invalid_transitions_are_refused,
    expiry_spend_and_blocks,
    exemptions_and_rule_marks_survive_a_restart_and_end_with_the_lease,
    published_outbox_rows_past_the_retention_are_pruned_in_batches_and_unpublished_rows_never,
    the_newest_utilization_signal_handled_survives_a_restart_and_ends_with_the_lease,
    a_signal_time_past_the_ceiling_is_not_taken_and_a_kept_one_no_longer_blocks,
    an_idempotency_key_admits_once_and_answers_its_retries_for_a_day,
);

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
fn decide(
    req: &Request,
    config: &Arc<Config>,
    inventory_gpus: u32,
) -> impl FnOnce(Ledger) -> Decision + Send + 'static {
    let (req, config) = (req.clone(), config.clone());
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
        evaluate(&req, &snapshot, &mut Placements::default())
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
    /// Its database (an SQLite file is removed when dropped: keep it while the store is used).
    db: Db,
    config: Arc<Config>,
    store: Store,
    /// The lease.
    id: String,
}

fn one_lease(db: Db) -> OneLease {
    let config = config(4);
    let store = db.open();
    assert!(admit(&store, &config, 1, 8));
    let id = store.open_leases().unwrap()[0].id.clone();
    OneLease {
        db,
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
fn concurrent(db: &Db, quota: u32, inventory_gpus: u32) -> (usize, u32) {
    let config = config(quota);
    let store = db.open();
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
    let store = db.open();
    let held = store.ledger(NOW, &config.pricing).unwrap().held_gpus["ml"];
    (admitted, held)
}

fn two_hundred_concurrent_admissions_fill_a_quota_of_16_exactly(db: Db) {
    let (admitted, held) = concurrent(&db, 16, 64);
    assert_eq!(admitted, 16);
    assert_eq!(held, 16);
    let store = db.open();
    let gpus = open_gpus(&store);
    assert_eq!(gpus.len(), 16);
    // Denials are audited too: 16 admits + 16 grants + 184 denials.
    assert_eq!(
        store.outbox_pending(1000).wait().unwrap().len(),
        16 * 2 + 184
    );
}

fn two_hundred_concurrent_admissions_never_place_a_gpu_twice(db: Db) {
    let (admitted, held) = concurrent(&db, 1000, 8);
    assert_eq!((admitted, held), (8, 8));
    let gpus = open_gpus(&db.open());
    let distinct: BTreeSet<&String> = gpus.iter().collect();
    assert_eq!(distinct.len(), 8, "{gpus:?}");
}

#[test]
fn one_store_owns_an_sqlite_database_at_a_time() {
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

fn a_change_not_waited_on_is_still_committed_before_the_store_closes(db: Db) {
    let OneLease { db, store, id, .. } = one_lease(db);
    let pending = store.transition(&id, LeaseState::Active, NOW + 1, ReleaseReason::User, "");
    if db.is_sqlite() {
        // Memory changes at once: the next call sees it before the commit is heard of. (On
        // PostgreSQL the change is decided on the writer's thread, in its transaction.)
        assert_eq!(store.open_leases().unwrap()[0].state, LeaseState::Active);
    }
    drop(pending);
    drop(store);
    let store = db.open();
    let lease = store.lease(&id).wait().unwrap().unwrap();
    assert_eq!(lease.state, LeaseState::Active);
    assert_eq!(lease.updated_at, NOW + 1);
}

/// A change nobody waits for does not wake the writer, but it is committed on its own soon
/// after (the store's lazy commit), and a change someone waits for carries it along.
#[test]
fn changes_nobody_waits_for_are_committed_soon_or_with_the_next_one() {
    let OneLease {
        config, store, id, ..
    } = one_lease(Db::sqlite());
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

fn leases_and_quota_survive_a_restart(db: Db) {
    let config = config(4);
    let store = db.open();
    assert_eq!(store.schema_version().wait().unwrap(), db.latest_schema());
    assert!(admit(&store, &config, 3, 8));
    let before = store.leases(&LeaseFilter::default()).wait().unwrap();
    drop(store);

    let store = db.open();
    assert_eq!(store.schema_version().wait().unwrap(), db.latest_schema());
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
    if let Db::Sqlite { path, .. } = &db {
        let wal = PathBuf::from(format!("{}-wal", path.display()));
        assert!(wal.exists(), "not in WAL mode");
    }
}

fn the_outbox_holds_every_change_in_order_until_published(db: Db) {
    let store = db.open();
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

fn invalid_transitions_are_refused(db: Db) {
    let store = db.open();
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

fn expiry_spend_and_blocks(db: Db) {
    let store = db.open();
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

fn exemptions_and_rule_marks_survive_a_restart_and_end_with_the_lease(db: Db) {
    let OneLease { db, store, id, .. } = one_lease(db);
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

    let store = db.open();
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

fn fleet_alert(ts_ms: i64, reason: &str) -> gpuwarden_schema::Action {
    gpuwarden_enforcer::store::audit::Audit::fleet(gpuwarden_schema::ActionKind::Alert, reason).at(
        ts_ms,
        gpuwarden_schema::Outcome::Ok,
        "",
    )
}

fn published_outbox_rows_past_the_retention_are_pruned_in_batches_and_unpublished_rows_never(
    db: Db,
) {
    const DAY: i64 = 86_400_000;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let prune = |store: &Store, before: i64, batch: usize| {
        runtime.block_on(store.prune_outbox(before, batch)).unwrap()
    };
    let OneLease {
        db,
        config,
        store,
        id: open_lease,
    } = one_lease(db);
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
    let kept: Vec<String> = db
        .outbox_rows()
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
    let left: Vec<i64> = db.outbox_rows().into_iter().map(|(id, _, _)| id).collect();
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

fn the_newest_utilization_signal_handled_survives_a_restart_and_ends_with_the_lease(db: Db) {
    let OneLease { db, store, id, .. } = one_lease(db);
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

    let store = db.open();
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
    assert_eq!(
        db.count("lease_signals"),
        0,
        "an ended lease's signal time is forgotten"
    );
}

/// A kept signal time past the clock's ceiling (the clock moved back since it was handled, as
/// `gpuwarden up --start` on an existing database does) no longer shuts out the signals dated
/// before it, in this run or after a restart; a signal past the ceiling is never taken.
fn a_signal_time_past_the_ceiling_is_not_taken_and_a_kept_one_no_longer_blocks(db: Db) {
    let OneLease { db, store, id, .. } = one_lease(db);
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

    let store = db.open();
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

// What only the PostgreSQL store does: several stores (enforcer replicas) on one database.

/// Three replicas on one database, 600 one-GPU admissions at once spread over them against a
/// quota of 16: exactly 16 are admitted, no GPU is placed twice, every replica counts all 16,
/// and the team's spend is the sum of its leases' cost.
#[test]
fn three_replicas_admit_600_at_once_against_a_quota_of_16_exactly() {
    let db = Db::postgres();
    let replicas: Vec<Store> = (0..3).map(|_| db.open()).collect();
    let config = config(16);
    let start = Arc::new(std::sync::Barrier::new(600));
    let threads: Vec<_> = (0..600)
        .map(|i| {
            let (store, config, start) = (replicas[i % 3].clone(), config.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                admit(&store, &config, 1, 64)
            })
        })
        .collect();
    let admitted: Vec<bool> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(admitted.iter().filter(|a| **a).count(), 16);
    let gpus = open_gpus(&replicas[0]);
    assert_eq!(gpus.len(), 16);
    assert_eq!(gpus.iter().collect::<BTreeSet<_>>().len(), 16, "{gpus:?}");
    // An hour later each lease has cost one GPU-hour at the default price.
    let hour = NOW + 3_600_000;
    let leases = replicas[0].leases(&LeaseFilter::default()).wait().unwrap();
    let expected: f64 = leases
        .iter()
        .filter(|l| l.state.is_open())
        .map(|l| config.pricing.usd_per_gpu_hour(&l.gpu_model) * f64::from(l.gpu_count))
        .sum();
    assert!(expected > 0.0);
    for (i, replica) in replicas.iter().enumerate() {
        // Each one's memory follows the others' commits.
        eventually(
            &format!("replica {i} to count all 16 GPUs"),
            Duration::from_secs(10),
            || {
                let ledger = replica.ledger(hour, &config.pricing).unwrap();
                match ledger.held_gpus.get("ml") {
                    Some(16) => Ok(ledger),
                    other => Err(format!("{other:?}")),
                }
            },
        );
        let ledger = replica.ledger(hour, &config.pricing).unwrap();
        assert!(
            (ledger.spend_usd["ml"] - expected).abs() < 1e-6,
            "replica {i}: {} ≠ {expected}",
            ledger.spend_usd["ml"]
        );
        // And none admits more.
        assert!(!admit(replica, &config, 1, 64));
    }
    // 16 grants and admissions, and every denial, audited once.
    assert_eq!(db.count("outbox"), 16 * 2 + (600 - 16) + 3);
}

/// A lease admitted on one replica is at once visible, releasable and counted on another, and
/// its GPUs are free for either once released.
#[test]
fn a_lease_admitted_on_one_replica_is_visible_releasable_and_counted_on_another() {
    let db = Db::postgres();
    let (a, b) = (db.open(), db.open());
    let config = config(2);
    assert!(admit(&a, &config, 2, 8));
    let id = a.open_leases().unwrap()[0].id.clone();
    // Seen by a read, and by the next decision, without waiting for b's memory to follow.
    assert_eq!(
        b.lease(&id).wait().unwrap().map(|l| l.state),
        Some(LeaseState::Granted)
    );
    assert!(!admit(&b, &config, 1, 8), "b counts a's lease in the quota");
    b.transition(
        &id,
        LeaseState::Released,
        NOW + 1,
        ReleaseReason::User,
        "on b",
    )
    .wait()
    .unwrap();
    assert!(admit(&a, &config, 2, 8), "a knows b released it");
    let err = a
        .transition(&id, LeaseState::Active, NOW + 2, ReleaseReason::User, "")
        .wait()
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidTransition { .. }), "{err}");
    // A block on one replica stops admissions on the other.
    b.block_team("ml", "budget_exceeded", NOW + 3)
        .wait()
        .unwrap();
    a.transition(
        &a.open_leases().unwrap()[0].id,
        LeaseState::Released,
        NOW + 4,
        ReleaseReason::User,
        "",
    )
    .wait()
    .unwrap();
    assert!(!admit(&a, &config, 1, 8), "a sees b's block");
}

/// Admits `req` with Idempotency-Key `key` at `now`, as the API does for a request that carries one.
fn admit_keyed(
    store: &Store,
    config: &Arc<Config>,
    key: &str,
    req: &Request,
    now: i64,
) -> Result<(Decision, Option<gpuwarden_enforcer::store::Lease>), StoreError> {
    store
        .admit_as(
            now,
            &config.pricing,
            &req.admission,
            Admitted::Keyed(key.into()),
            decide(req, config, 8),
        )
        .wait()
}

/// A request asked again with its Idempotency-Key (a client whose answer was lost) is answered
/// with the lease it was admitted as: nothing is held twice, after a restart too, and on
/// PostgreSQL on another replica. The key asked for someone else, or after its lease ended, is
/// refused, naming the key and the lease; a day after its grant the key is forgotten.
fn an_idempotency_key_admits_once_and_answers_its_retries_for_a_day(db: Db) {
    let config = config(8);
    let store = db.open();
    let held = |store: &Store| store.ledger(NOW, &config.pricing).unwrap().held_gpus["ml"];
    let req = request(2);
    let (_, first) = admit_keyed(&store, &config, "k-1", &req, NOW).unwrap();
    let first = first.expect("admitted");
    assert_eq!(first.admission_key.as_deref(), Some("k-1"));
    let (decision, again) = admit_keyed(&store, &config, "k-1", &req, NOW + 1).unwrap();
    assert!(decision.admitted());
    assert_eq!(again.as_ref(), Some(&first));
    assert_eq!(held(&store), 2);
    let (_, second) = admit_keyed(&store, &config, "k-2", &req, NOW + 2).unwrap();
    let second = second.expect("another key is another request");
    assert_ne!(second.id, first.id);
    assert_eq!((held(&store), db.count("leases")), (4, 2));
    // A key reused for someone else is refused, not answered with another's lease.
    let mut bob = request(2);
    bob.admission.user = "bob".into();
    let err = admit_keyed(&store, &config, "k-1", &bob, NOW + 3).unwrap_err();
    assert!(matches!(err, StoreError::KeyReused(_)), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("\"k-1\"") && message.contains(&first.id) && message.contains("user"),
        "{message}"
    );
    if !db.is_sqlite() {
        // Another replica answers the retry with the lease this one admitted.
        let other = db.open();
        let (_, there) = admit_keyed(&other, &config, "k-2", &req, NOW + 4).unwrap();
        assert_eq!(there.map(|l| l.id), Some(second.id.clone()));
    }
    drop(store);
    let store = db.open();
    let (_, after) = admit_keyed(&store, &config, "k-1", &req, NOW + 5).unwrap();
    assert_eq!(
        after.map(|l| l.id),
        Some(first.id.clone()),
        "after a restart"
    );
    store
        .transition(
            &first.id,
            LeaseState::Released,
            NOW + 6,
            ReleaseReason::User,
            "",
        )
        .wait()
        .unwrap();
    let ended = |store: &Store, now| {
        let err = admit_keyed(store, &config, "k-1", &req, now).unwrap_err();
        assert!(err.to_string().contains("has ended"), "{err}");
    };
    ended(&store, NOW + 7);
    drop(store);
    let store = db.open();
    ended(&store, NOW + 8);
    // A day after its grant the key names nothing: a new request.
    let day = 24 * 3_600_000;
    let (_, fresh) = admit_keyed(&store, &config, "k-1", &req, NOW + day + 1).unwrap();
    assert_ne!(fresh.expect("admitted").id, first.id);
    assert_eq!(db.count("leases"), 3);
}

/// On a shared store, a lease granted by a replica that died before its driver answered is
/// settled by the leader's periodic work once the re-adoption grace has passed: failed when its
/// substrate has nothing of it, active when it runs there; a recent grant is left to the replica
/// provisioning it. On SQLite, whose one enforcer re-adopts at start, there is nothing to settle.
#[test]
fn grants_a_dead_replica_left_unstarted_are_settled_once_the_grace_has_passed() {
    use gpuwarden_enforcer::drivers::{self, Driver, DriverContext, LeaseSpec};
    use gpuwarden_enforcer::service::Service;
    use gpuwarden_schema::ManualClock;

    let dir = tempfile::tempdir().unwrap();
    let sim: gpuwarden_schema::config::SubstrateConfig = toml::from_str(
        "name = \"sim\"\ndriver = \"simulated\"\nhosts = [{ prefix = \"h\", count = 1, gpus = 8, \
         gpu_model = \"NVIDIA H100 80GB HBM3\" }]\n",
    )
    .unwrap();
    let context = DriverContext {
        state_dir: dir.path().join("sim"),
        lease_refs: None,
    };
    let driver: Arc<dyn Driver> = Arc::from(drivers::build(&sim, &context).unwrap());
    let minute = 60_000;
    let lease = |id: &str, granted_at: i64| gpuwarden_enforcer::store::Lease {
        gpu_uuids: vec![format!("GPU-{id}")],
        granted_at,
        updated_at: granted_at,
        ..support::lease(id, "sim")
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    for db in [Db::postgres(), Db::sqlite()] {
        let store = db.open();
        let service = Service::new(
            Arc::new(Config {
                substrates: vec![sim.clone()],
                ..Config::default()
            }),
            store.clone(),
            BTreeMap::from([("sim".to_owned(), driver.clone())]),
            Arc::new(ManualClock::new(NOW)),
        );
        let settled = runtime.block_on(async {
            for (id, at) in [
                ("stranded", NOW - 6 * minute),
                ("started", NOW - 6 * minute),
                ("recent", NOW - minute),
            ] {
                store.adopt(lease(id, at), at, "test").await.unwrap();
            }
            // Only `started` was provisioned before its replica died.
            let gpu = driver.inventory().await.unwrap().gpus[0].uuid.clone();
            let spec = LeaseSpec {
                lease_id: "started".into(),
                team: "ml".into(),
                user: "ada".into(),
                project: "p".into(),
                workload: Workload::Training,
                gpu_model: "NVIDIA H100 80GB HBM3".into(),
                gpu_count: 1,
                gpu_uuids: vec![gpu],
                command: None,
                time_limit: None,
                labels: BTreeMap::new(),
            };
            driver.provision(&spec).await.unwrap();
            service.settle_stranded_grants().await.unwrap()
        });
        let state = |id: &str| store.lease(id).wait().unwrap().unwrap().state;
        if db.is_sqlite() {
            assert_eq!((settled.running, settled.failed), (0, 0));
            assert_eq!(state("stranded"), LeaseState::Granted);
            continue;
        }
        assert_eq!((settled.running, settled.failed), (1, 1), "{settled:?}");
        assert_eq!(state("stranded"), LeaseState::Failed);
        assert_eq!(state("started"), LeaseState::Active);
        assert_eq!(state("recent"), LeaseState::Granted);
        runtime
            .block_on(driver.reclaim("started", ReleaseReason::Admin))
            .unwrap();
    }
}

/// Replicas that start together on a new database migrate it once; one that finds a schema
/// newer than it knows refuses to start, naming both versions.
#[test]
fn replicas_migrate_once_and_refuse_a_newer_schema() {
    let db = Db::postgres();
    let opened: Vec<_> = (0..4)
        .map(|_| {
            let Db::Postgres { url } = &db else {
                unreachable!()
            };
            let url = url.clone();
            std::thread::spawn(move || Store::open_postgres(&url, None).map(|_| ()))
        })
        .collect();
    for o in opened {
        o.join().unwrap().unwrap();
    }
    assert_eq!(db.open().schema_version().wait().unwrap(), 5);
    let Db::Postgres { url } = &db else {
        unreachable!()
    };
    Postgres::client(url)
        .batch_execute("UPDATE schema_version SET version = 7")
        .unwrap();
    let err = Store::open_postgres(url, None).unwrap_err();
    assert!(
        matches!(err, StoreError::TooNew { found: 7, known: 5 }),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "the lease store is at schema version 7; this gpuwarden ({}) knows up to 5: upgrade \
             gpuwarden",
            env!("CARGO_PKG_VERSION")
        )
    );
}

/// PostgreSQL stopped under a store: every change fails as unavailable (nothing is reported
/// done that is not committed), and once it is back the store recovers by itself, its memory
/// what the database holds.
#[test]
fn a_store_answers_unavailable_while_postgres_is_down_and_recovers_without_a_restart() {
    let server = Postgres::private();
    let url = server.database();
    let store = Store::open_postgres(&url, None).unwrap();
    let config = config(8);
    assert!(admit(&store, &config, 1, 8));
    server.stop();
    let req = request(1);
    let err = store
        .admit(
            NOW,
            &config.pricing,
            &req.admission,
            decide(&req, &config, 8),
        )
        .wait()
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    assert!(matches!(
        store.leases(&LeaseFilter::default()).wait(),
        Err(StoreError::Unavailable(_))
    ));
    server.run();
    eventually("the store to admit again", Duration::from_secs(30), || {
        let req = request(1);
        store
            .admit(
                NOW,
                &config.pricing,
                &req.admission,
                decide(&req, &config, 8),
            )
            .wait()
            .map_err(|e| e.to_string())
    });
    let held = store.ledger(NOW, &config.pricing).unwrap().held_gpus["ml"];
    let rows = Postgres::client(&url)
        .query_one("SELECT count(*) FROM leases", &[])
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!((held, rows), (2, 2), "memory is what was committed");
}

/// A database that cannot be reached when the store opens is reported as unavailable, with
/// the URL but not its password.
#[test]
fn opening_an_unreachable_database_names_it_without_its_password() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://gpuwarden:s3cret@127.0.0.1:{port}/gpuwarden");
    let err = Store::open_postgres(&url, None).unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    let text = err.to_string();
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
}

/// Leadership: one replica leads; only it changes anything through the leading view; a leader
/// whose lease ran out in the database (paused, cut off) is refused by the fence inside the
/// transaction even while it still believes it leads; the next leader has the next term; a
/// leader that closes gives the leadership up at once.
#[test]
fn only_the_leader_changes_through_the_leading_view_and_a_deposed_one_is_fenced() {
    let db = Db::postgres();
    let Db::Postgres { url } = &db else {
        unreachable!()
    };
    let config = config(8);
    // A long lease: a and b renew every 100 s, so below a keeps believing it leads, and
    // neither takes the lease back before c.
    let lease = Duration::from_secs(300);
    let (a, b) = (db.open(), db.open());
    a.elect("a", lease).unwrap();
    eventually("a to lead", Duration::from_secs(10), || {
        if a.leadership().is_leader() {
            Ok(())
        } else {
            Err(format!("{:?}", a.leadership().leader()))
        }
    });
    let (_, a_term) = a.leadership().leader();
    b.elect("b", lease).unwrap();
    eventually(
        "b to see that a leads",
        Duration::from_secs(10),
        || match b.leadership().leader() {
            (who, _) if who == "a" => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    assert!(!b.leadership().is_leader());
    a.leading()
        .record_action(&fleet_alert(NOW, "by-a"))
        .wait()
        .unwrap();
    let err = b
        .leading()
        .record_action(&fleet_alert(NOW, "by-b"))
        .wait()
        .unwrap_err();
    assert!(matches!(err, StoreError::Fenced(_)), "{err}");
    assert!(err.to_string().contains("the leader is a"), "{err}");
    // Admissions are every replica's.
    assert!(admit(&b, &config, 1, 8));

    // a's lease runs out in the database (as when a is stopped past it); c starts and takes
    // over at once, with the next term.
    Postgres::client(url)
        .batch_execute("UPDATE leader SET expires_ms = 0")
        .unwrap();
    let c = db.open();
    c.elect("c", Duration::from_secs(30)).unwrap();
    eventually("c to lead", Duration::from_secs(10), || {
        if c.leadership().is_leader() {
            Ok(())
        } else {
            Err(format!("{:?}", c.leadership().leader()))
        }
    });
    assert_eq!(c.leadership().leader(), ("c".to_owned(), a_term + 1));
    // a has not renewed since: it still believes it leads, and its changes are refused anyway.
    assert!(a.leadership().is_leader());
    let err = a
        .leading()
        .record_action(&fleet_alert(NOW, "by-a-after"))
        .wait()
        .unwrap_err();
    assert!(matches!(err, StoreError::Fenced(_)), "{err}");
    assert!(err.to_string().contains("c holds term"), "{err}");
    assert!(matches!(
        a.leading().outbox_pending(10).wait(),
        Err(StoreError::Fenced(_))
    ));
    c.leading()
        .record_action(&fleet_alert(NOW, "by-c"))
        .wait()
        .unwrap();
    let reasons: Vec<String> = db
        .outbox_rows()
        .into_iter()
        .map(|(_, key, _)| key)
        .filter(|k| k.starts_with("by-"))
        .collect();
    assert_eq!(reasons, ["by-a", "by-c"]);

    // c closes and gives the leadership up: d, starting then, leads at once rather than
    // after c's 30 s lease.
    drop(c);
    let d = db.open();
    let asked = std::time::Instant::now();
    d.elect("d", Duration::from_secs(3)).unwrap();
    eventually("d to lead", Duration::from_secs(10), || {
        if d.leadership().is_leader() {
            Ok(())
        } else {
            Err(format!("{:?}", d.leadership().leader()))
        }
    });
    assert!(asked.elapsed() < Duration::from_secs(10));
    assert_eq!(d.leadership().leader(), ("d".to_owned(), a_term + 2));
}

/// On SQLite the one store leads, and its leading view changes what it is asked to.
#[test]
fn an_sqlite_store_always_leads() {
    let db = Db::sqlite();
    let store = db.open();
    store.elect("solo", Duration::from_secs(5)).unwrap();
    assert!(store.leadership().is_leader());
    assert_eq!(store.leadership().leader().0, "solo");
    store
        .leading()
        .record_action(&fleet_alert(NOW, "solo"))
        .wait()
        .unwrap();
}

/// `sslmode=require` (or libpq's `verify-full`) in the URL: the store talks TLS, verifying the
/// server's certificate against `sslrootcert`; a server whose certificate another CA signed is
/// refused; `sslrootcert` without TLS asked for is a mistake named at once.
#[test]
fn a_store_reaches_postgres_over_verified_tls() {
    let pki_dir = tempfile::tempdir().unwrap();
    let ca = support::pki::Ca::new(pki_dir.path(), "pg-ca");
    let leaf = ca.server("postgres");
    let other = support::pki::Ca::new(pki_dir.path(), "other-ca");
    let mut server = Postgres::private_stopped();
    let cert = server.file(&leaf.cert, "server.pem");
    let key = server.file(&leaf.key, "server.key");
    server.set("ssl", "on");
    server.set("ssl_cert_file", cert.to_str().unwrap());
    server.set("ssl_key_file", key.to_str().unwrap());
    server.run();
    let url = server.database();
    let tls_url = |mode: &str, root: &std::path::Path| {
        format!("{url}?sslmode={mode}&sslrootcert={}", root.display())
    };

    let store = Store::open_postgres(&tls_url("verify-full", &ca.cert), None).unwrap();
    assert!(admit(&store, &config(4), 1, 8));
    // The listener connects on a task of its own: it may come a moment after the open returns.
    let mut client = Postgres::client(&url);
    let started = std::time::Instant::now();
    let over_tls = loop {
        let over_tls: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
                 WHERE application_name = 'gpuwarden-enforcer' AND ssl",
                &[],
            )
            .unwrap()
            .get(0);
        if over_tls >= 2 || started.elapsed() > Duration::from_secs(20) {
            break over_tls;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        over_tls >= 2,
        "the writer and the listener use TLS: {over_tls}"
    );
    drop(store);

    let err = Store::open_postgres(&tls_url("require", &other.cert), None).unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );

    let err = Store::open_postgres(&format!("{url}?sslrootcert={}", ca.cert.display()), None)
        .unwrap_err();
    assert!(err.to_string().contains("sslrootcert"), "{err}");
}

/// A URL that is not one PostgreSQL reads, and a password file that cannot be read, are refused
/// at open, naming the setting.
#[test]
fn a_bad_postgres_url_or_password_file_is_named_at_open() {
    let err = Store::open_postgres("postgres://db:notaport/x", None).unwrap_err();
    assert!(err.to_string().contains("enforcer.store.url"), "{err}");
    let err = Store::open_postgres(
        "postgres://gw@127.0.0.1:1/x",
        Some(std::path::Path::new("/nonexistent/pg-password")),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("enforcer.store.password_file"),
        "{err}"
    );
}
