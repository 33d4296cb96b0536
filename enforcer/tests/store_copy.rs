//! `store::copy`, moving a lease store between databases, against a real SQLite file and a real
//! PostgreSQL server (`support::pg`): a store with open leases of every kind, holds, named
//! leases, ended leases, a published and unpublished outbox larger than a batch, a block, spend,
//! an exemption, rule marks and a signal time is copied to PostgreSQL and back exactly, row for
//! row and as the store reads it; a non-empty target, a source an enforcer holds and a copy onto
//! itself are refused with nothing changed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpuwarden_enforcer::drivers::{Gpu, Inventory};
use gpuwarden_enforcer::policy::{
    evaluate, AdmissionRequest, Decision, Placements, Principal, Request, Snapshot, SubstrateState,
};
use gpuwarden_enforcer::store::audit::Audit;
use gpuwarden_enforcer::store::copy::{copy, CopyError, CopyReport};
use gpuwarden_enforcer::store::{Admitted, LeaseFilter, LeaseState, Ledger, Store, StoreError};
use gpuwarden_schema::config::{Config, Role, TeamConfig};
use gpuwarden_schema::{Action, ActionKind, Outcome, ReleaseReason, Workload};

mod support;

use support::pg::Postgres;
use support::stores::Db;

const NOW: i64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z
/// The ceiling of signal times the tests take.
const FAR: i64 = NOW + 86_400_000;
/// The tables of a store, in the order the copy reports them.
const TABLES: [&str; 7] = [
    "leases",
    "outbox",
    "blocked_teams",
    "team_spend",
    "exemptions",
    "rule_marks",
    "lease_signals",
];
/// Rule marks (each with its Action in the outbox) of the populated store: more than a batch of
/// the copy's, so that both tables are read in several.
const MARKS: usize = 12_345;

/// How a test looks at a store's rows directly.
impl Db {
    /// Every row of every table, each table's rows in their key's order.
    fn dump(&self) -> BTreeMap<&'static str, Vec<Vec<Cell>>> {
        TABLES
            .into_iter()
            .map(|table| {
                let sql = format!("SELECT * FROM {table}");
                let mut rows = match self {
                    Self::Sqlite { path, .. } => sqlite_rows(path, &sql),
                    Self::Postgres { url } => pg_rows(url, &sql),
                };
                // The key is the first column; the databases order text differently.
                rows.sort_by(|a, b| order(&a[0]).cmp(&order(&b[0])));
                (table, rows)
            })
            .collect()
    }

    /// The largest outbox id.
    fn max_outbox_id(&self) -> i64 {
        match &self.dump()["outbox"].last().unwrap()[0] {
            Cell::Int(id) => *id,
            other => panic!("an outbox id is {other:?}"),
        }
    }
}

/// How a key sorts: numbers by value, text by its bytes.
fn order(key: &Cell) -> (i64, &str) {
    match key {
        Cell::Int(n) => (*n, ""),
        Cell::Text(s) => (0, s),
        other => panic!("a key is {other:?}"),
    }
}

/// A column's value, whichever database it came from.
#[derive(Debug, Clone, PartialEq)]
enum Cell {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
}

fn sqlite_rows(path: &std::path::Path, sql: &str) -> Vec<Vec<Cell>> {
    use rusqlite::types::ValueRef;
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut stmt = conn.prepare(sql).unwrap();
    let n = stmt.column_count();
    let rows = stmt
        .query_map([], |r| {
            (0..n)
                .map(|i| {
                    Ok(match r.get_ref(i)? {
                        ValueRef::Null => Cell::Null,
                        ValueRef::Integer(v) => Cell::Int(v),
                        ValueRef::Real(v) => Cell::Real(v),
                        ValueRef::Text(v) => Cell::Text(String::from_utf8(v.to_vec()).unwrap()),
                        ValueRef::Blob(v) => panic!("a blob in the store: {v:?}"),
                    })
                })
                .collect()
        })
        .unwrap();
    rows.collect::<Result<_, _>>().unwrap()
}

fn pg_rows(url: &str, sql: &str) -> Vec<Vec<Cell>> {
    use postgres::types::Type;
    Postgres::client(url)
        .query(sql, &[])
        .unwrap()
        .iter()
        .map(|row| {
            row.columns()
                .iter()
                .enumerate()
                .map(|(i, column)| {
                    let cell = match *column.type_() {
                        Type::INT4 => row.get::<_, Option<i32>>(i).map(|v| Cell::Int(v.into())),
                        Type::INT8 => row.get::<_, Option<i64>>(i).map(Cell::Int),
                        Type::FLOAT8 => row.get::<_, Option<f64>>(i).map(Cell::Real),
                        Type::TEXT => row.get::<_, Option<String>>(i).map(Cell::Text),
                        ref other => panic!("a column of type {other} in the store"),
                    };
                    cell.unwrap_or(Cell::Null)
                })
                .collect()
        })
        .collect()
}

fn config() -> Arc<Config> {
    Arc::new(Config {
        teams: vec![TeamConfig {
            name: "ml".into(),
            members: Vec::new(),
            gpu_quota: 64,
            monthly_budget_usd: 1e9,
            allowed_models: Vec::new(),
        }],
        ..Config::default()
    })
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
            labels: Some(BTreeMap::from([("run".to_owned(), "copy".to_owned())])),
            dry_run: false,
            command: None,
        },
    }
}

/// The policy as the API runs it inside the store's transaction, over 64 simulated GPUs.
fn decide(req: &Request, config: &Arc<Config>) -> impl FnOnce(Ledger) -> Decision + Send + 'static {
    let (req, config) = (req.clone(), config.clone());
    move |ledger| {
        let mut sub = SubstrateState {
            name: "sim".into(),
            inventory: Arc::new(Inventory {
                gpus: (0..64)
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
        };
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

/// Admits `gpus` GPUs at `at` as `admitted` says; the lease's id.
fn admit(store: &Store, gpus: u32, at: i64, admitted: Admitted) -> String {
    let (config, req) = (config(), request(gpus));
    let (_, lease) = store
        .admit_as(
            at,
            &config.pricing,
            &req.admission,
            admitted,
            decide(&req, &config),
        )
        .wait()
        .unwrap();
    lease.expect("admitted").id
}

fn to(store: &Store, id: &str, state: LeaseState, at: i64) {
    store
        .transition(id, state, at, ReleaseReason::User, "")
        .wait()
        .unwrap();
}

fn warning(id: &str, at: i64) -> Action {
    Audit::fleet(ActionKind::Alert, "idle_warning").at(at, Outcome::Ok, format!("lease {id}"))
}

/// What a populated store holds that the checks look up by name.
struct Populated {
    /// Leases by what they are: granted, active, releasing, hold, named, released, failed.
    leases: BTreeMap<&'static str, String>,
}

/// Fills `store` with every kind of row: open leases of every kind (each granted at its own
/// time, so that every database lists them in one order), ended ones, a denial, outbox rows
/// published and not, a blocked team, spend, an exemption, rule marks and a signal time.
fn populate(store: &Store) -> Populated {
    let mut leases = BTreeMap::new();
    let mut at = NOW;
    let mut next = || {
        at += 1_000;
        at
    };
    leases.insert("granted", admit(store, 1, next(), Admitted::Lease));
    let active = admit(store, 2, next(), Admitted::Lease);
    to(store, &active, LeaseState::Active, next());
    let releasing = admit(store, 1, next(), Admitted::Lease);
    to(store, &releasing, LeaseState::Active, next());
    to(store, &releasing, LeaseState::Releasing, next());
    leases.insert("hold", admit(store, 4, next(), Admitted::Hold));
    let named = "k8s-6f1c2a9e-2b4d-4c1e-9a57-0d3b5e8f7a21";
    leases.insert(
        "named",
        admit(store, 1, next(), Admitted::Named(named.into())),
    );
    let released = admit(store, 1, next(), Admitted::Lease);
    to(store, &released, LeaseState::Active, next());
    to(store, &released, LeaseState::Released, next());
    let failed = admit(store, 1, next(), Admitted::Lease);
    to(store, &failed, LeaseState::Failed, next());
    // A denial: more GPUs than the team's quota.
    let (config, req) = (config(), request(100));
    let (decision, lease) = store
        .admit(
            next(),
            &config.pricing,
            &req.admission,
            decide(&req, &config),
        )
        .wait()
        .unwrap();
    assert!(!decision.admitted() && lease.is_none());

    store
        .block_team("vision", "budget_exceeded", next())
        .wait()
        .unwrap();
    store
        .record_team_spend("ml", 1_234.567_891_234_5, 6.25, next(), &config.pricing)
        .wait()
        .unwrap();
    store
        .exempt(&active, NOW + 7_200_000, "root", "a long run", next())
        .wait()
        .unwrap();
    assert!(store
        .note_utilization_signal(&active, next(), FAR)
        .wait()
        .unwrap());
    let ts = next();
    for i in 0..MARKS {
        // Not waited for one by one: they commit together.
        drop(store.record_once(&format!("idle:{active}:{i:05}"), &warning(&active, ts)));
    }
    assert!(store
        .record_once("idle:last", &warning(&active, ts))
        .wait()
        .unwrap());
    // The first half of the outbox was published.
    let rows = store.outbox_pending(100_000).wait().unwrap();
    let ids: Vec<i64> = rows[..rows.len() / 2].iter().map(|r| r.id).collect();
    store.outbox_mark_published(&ids, next()).wait().unwrap();

    leases.insert("active", active);
    leases.insert("releasing", releasing);
    leases.insert("released", released);
    leases.insert("failed", failed);
    Populated { leases }
}

/// Asserts that `copy` reads as `original` does through every query of the store, and holds the
/// same rows.
fn assert_same(original: &Db, copy: &Db, populated: &Populated) {
    assert_eq!(original.dump(), copy.dump(), "the rows differ");
    let (a, b) = (original.open(), copy.open());
    let all = LeaseFilter::default();
    let leases = a.leases(&all).wait().unwrap();
    assert_eq!(leases.len(), 7, "{leases:?}");
    assert_eq!(leases, b.leases(&all).wait().unwrap());
    assert_eq!(a.open_leases().unwrap(), b.open_leases().unwrap());
    let pricing = &config().pricing;
    let (la, lb) = (
        a.ledger(NOW + 60_000, pricing).unwrap(),
        b.ledger(NOW + 60_000, pricing).unwrap(),
    );
    assert_eq!(la.held_gpus["ml"], 9, "{la:?}");
    assert_eq!(la, lb);
    let pending = a.outbox_pending(100_000).wait().unwrap();
    assert!(pending.len() > 1_000, "{}", pending.len());
    assert_eq!(pending, b.outbox_pending(100_000).wait().unwrap());
    assert_eq!(
        a.outbox_pending_count().wait().unwrap(),
        b.outbox_pending_count().wait().unwrap()
    );
    assert_eq!(
        a.recent_actions(50, Some("ml")).wait().unwrap(),
        b.recent_actions(50, Some("ml")).wait().unwrap()
    );
    let active = &populated.leases["active"];
    assert!(b.marked("idle:last"));
    assert!(b.marked(&format!("idle:{active}:00000")));
    assert!(!b.marked("idle:never"));
    assert_eq!(b.exempt_until(active), Some(NOW + 7_200_000));
    assert_eq!(a.exempt_until(active), b.exempt_until(active));
    for (what, id) in &populated.leases {
        let lease = b.lease(id).wait().unwrap().unwrap();
        assert_eq!(Some(&lease), a.lease(id).wait().unwrap().as_ref(), "{what}");
    }
    // Its newest signal time came along: an older signal is still old.
    assert!(!b
        .note_utilization_signal(active, NOW + 1, FAR)
        .wait()
        .unwrap());
}

/// The report names every table with the rows copied, and progress told of each.
fn assert_reported(report: &CopyReport, progress: &[(String, u64)], source: &Db) {
    let dump = source.dump();
    let expected: Vec<(&str, u64)> = TABLES.iter().map(|t| (*t, dump[t].len() as u64)).collect();
    assert_eq!(report.rows, expected);
    assert_eq!(report.rows_of("rule_marks"), MARKS as u64 + 1);
    assert_eq!(report.total(), expected.iter().map(|(_, n)| n).sum::<u64>());
    let mut last: BTreeMap<&str, u64> = BTreeMap::new();
    for (table, rows) in progress {
        let seen = last.entry(table.as_str()).or_default();
        assert!(*rows >= *seen, "{table} went back: {progress:?}");
        *seen = *rows;
    }
    let last: Vec<(&str, u64)> = TABLES.iter().map(|t| (*t, last[t])).collect();
    assert_eq!(last, expected, "{progress:?}");
    // The outbox, larger than a batch, was copied in several.
    let outbox = progress.iter().filter(|(t, _)| t == "outbox").count();
    assert!(outbox >= 2, "{progress:?}");
}

/// Copies `from` to `to`; the report, and the progress calls.
fn run(from: &Db, to: &Db) -> Result<(CopyReport, Vec<(String, u64)>), CopyError> {
    let mut progress = Vec::new();
    let report = copy(&from.location(), &to.location(), |table, rows| {
        progress.push((table.to_owned(), rows))
    })?;
    Ok((report, progress))
}

/// An installation moves from its SQLite file to PostgreSQL: every row comes along as it was,
/// the store reads the same, and new rows come after the copied ones.
#[test]
fn sqlite_to_postgres_copies_every_table_exactly_and_new_rows_come_after() {
    let source = Db::sqlite();
    let populated = populate(&source.open());
    let target = Db::postgres();

    let (report, progress) = run(&source, &target).unwrap();
    assert_reported(&report, &progress, &source);
    assert!(report.to.contains("127.0.0.1"), "{report:?}");
    assert_same(&source, &target, &populated);

    let last = target.max_outbox_id();
    let store = target.open();
    store
        .record_action(&warning("after", NOW + 3_600_000))
        .wait()
        .unwrap();
    let id = admit(&store, 1, NOW + 3_600_001, Admitted::Lease);
    let pending = store.outbox_pending(100_000).wait().unwrap();
    let new: Vec<i64> = pending.iter().rev().take(3).map(|r| r.id).collect();
    assert!(new.iter().all(|&n| n > last), "{new:?} after {last}");
    assert_eq!(pending.last().unwrap().key, id);
    // The GPUs of the copied open leases stay taken.
    let held = store.ledger(NOW, &config().pricing).unwrap().held_gpus["ml"];
    assert_eq!(held, 10);
}

/// And back: PostgreSQL to PostgreSQL, then to a new SQLite file, gives a store identical to the
/// one it started from, even while a replica has a PostgreSQL source open (idle); new rows come
/// after the copied ones there too.
#[test]
fn postgres_back_to_sqlite_gives_an_identical_store() {
    let original = Db::sqlite();
    let populated = populate(&original.open());
    let first = Db::postgres();
    run(&original, &first).unwrap();
    let second = Db::postgres();
    let replica = first.open();
    let (report, progress) = run(&first, &second).unwrap();
    assert_reported(&report, &progress, &first);
    assert_same(&original, &second, &populated);

    let back = Db::sqlite();
    let (report, progress) = run(&second, &back).unwrap();
    assert_reported(&report, &progress, &second);
    assert_same(&original, &back, &populated);
    drop(replica);

    let last = back.max_outbox_id();
    let store = back.open();
    store
        .record_action(&warning("after", NOW + 3_600_000))
        .wait()
        .unwrap();
    let newest = store.outbox_pending(100_000).wait().unwrap().pop().unwrap();
    assert!(newest.id > last, "{} after {last}", newest.id);
}

/// SQLite to SQLite, and the copy holds both files while it runs: no enforcer can start on
/// either meanwhile.
#[test]
fn sqlite_to_sqlite_holds_both_files_while_it_copies() {
    let (source, target) = (Db::sqlite(), Db::sqlite());
    let populated = populate(&source.open());
    let mut tried = 0;
    copy(&source.location(), &target.location(), |_, _| {
        for db in [&source, &target] {
            let err = Store::open_at(&db.location()).unwrap_err();
            assert!(matches!(err, StoreError::InUse(_)), "{err}");
        }
        tried += 1;
    })
    .unwrap();
    assert!(tried > 0);
    assert_same(&source, &target, &populated);
}

/// A replica running on a PostgreSQL target that the copy made wakes up to the copied rows: the
/// copy bumps the store's version, so its memory reloads.
#[test]
fn a_replica_already_on_the_target_sees_the_copy() {
    let source = Db::sqlite();
    let populated = populate(&source.open());
    let target = Db::postgres();
    let replica = target.open();
    assert!(replica.open_leases().unwrap().is_empty());
    run(&source, &target).unwrap();
    let expected = source.open().open_leases().unwrap();
    support::eventually("the replica reloads", Duration::from_secs(10), || {
        // Memory follows by itself (NOTIFY); a read makes sure the replica has caught up.
        replica
            .outbox_pending_count()
            .wait()
            .map_err(|e| e.to_string())?;
        let open = replica.open_leases().unwrap();
        if open == expected {
            Ok(())
        } else {
            Err(format!("{} open leases", open.len()))
        }
    });
    assert!(replica.marked("idle:last"));
    assert_eq!(
        replica.exempt_until(&populated.leases["active"]),
        Some(NOW + 7_200_000)
    );
}

/// A target holding anything is refused with the tables that hold rows, and left as it was.
#[test]
fn a_non_empty_target_is_refused_and_left_unchanged() {
    let source = Db::sqlite();
    populate(&source.open());
    for target in [Db::postgres(), Db::sqlite()] {
        let id = admit(&target.open(), 1, NOW, Admitted::Lease);
        let before = target.dump();
        let err = run(&source, &target).unwrap_err();
        match &err {
            CopyError::NotEmpty { tables, .. } => {
                assert_eq!(tables, &[("leases", 1), ("outbox", 2)], "{err}")
            }
            other => panic!("not refused as non-empty: {other}"),
        }
        let text = err.to_string();
        assert!(
            text.contains("is not empty (table leases holds 1 rows, table outbox holds 2 rows)"),
            "{text}"
        );
        assert_eq!(target.dump(), before);
        assert_eq!(target.open().open_leases().unwrap()[0].id, id);
    }
}

/// An enforcer running on the SQLite source (its store open) makes the copy fail, naming the
/// source, with nothing written; once it has stopped, the copy goes through.
#[test]
fn a_source_an_enforcer_holds_is_refused_as_in_use() {
    let source = Db::sqlite();
    let running = source.open();
    populate(&running);
    let target = Db::postgres();
    drop(target.open());
    let err = run(&source, &target).unwrap_err();
    match &err {
        CopyError::Source {
            error: StoreError::InUse(_),
            ..
        } => {}
        other => panic!("not refused as in use: {other}"),
    }
    assert!(err.to_string().starts_with("the source store "), "{err}");
    assert!(target.dump().values().all(Vec::is_empty));
    drop(running);
    run(&source, &target).unwrap();
}

/// A store is not copied onto itself, and a source file that does not exist is not created.
#[test]
fn a_copy_onto_itself_or_from_a_missing_file_is_refused() {
    let db = Db::sqlite();
    populate(&db.open());
    let err = run(&db, &db).unwrap_err();
    assert!(matches!(err, CopyError::Same(_)), "{err}");

    let missing = Db::sqlite();
    let target = Db::sqlite();
    let err = run(&missing, &target).unwrap_err();
    assert!(
        matches!(&err, CopyError::Source { error: StoreError::Io(m), .. } if m.contains("there is no file")),
        "{err}"
    );
    let Db::Sqlite { path, .. } = &missing else {
        unreachable!()
    };
    assert!(!path.exists());
}
