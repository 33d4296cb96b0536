//! `gpuwarden lake migrate` on a lake in the layout before Delta tables, in a directory and in a
//! bucket of the tests' S3 server. Raw tables: `<table>/date=…/hour=…/*.parquet`, read by the
//! old rules (an hour's `_compaction.json` hides the ingest files it `superseded` and the
//! `compact-g` files not in its `outputs`). Rollup tables: `rollups/<table>/date=…/hour=…/
//! rollup.parquet` (in a bucket `rollup.v<n>.parquet`, the highest `n` the hour's, and
//! `leases.parquet` / `leases.v<n>.parquet`). The rollups refuse to run until it has, a run
//! stopped before it deletes anything changes nothing a second run cannot finish, and afterwards
//! every answer is the one the old files gave, the files the old rules hid and the old rollup
//! files are gone, and the rollups run again.
//!
//! `gpuwarden lake migrate --to` moves a lake instead: the old layout in a directory to another
//! directory, stopped by a crash half way and finished by a second run; a lake of Delta tables
//! in a bucket to a directory, with the files its ingest committed, so that ingesting them again
//! at the new location adds nothing. Each time the new location answers as the old one did.
//!
//! The old layout is written here from the rows the Delta tables hold (read back with the
//! library, then written as plain Parquet under the old names), since the code that wrote it is
//! gone: the files are the same rows, in the same schema, under the same names.

mod support;

use std::path::{Path, PathBuf};

use gpuwarden_pipeline::delta::{block_on, AsOf};
use gpuwarden_pipeline::{sql, Lake, RollupTable};
use support::rollups::{
    gpuwarden, gpuwarden_answers, gpuwarden_with, load, ok, unquoted, MINUTE, T0,
};
use support::s3::S3Server;

/// Rewrites the rollup tables of `lake` in the old layout: the Delta tables' rows, hour by
/// hour, as `rollup.parquet` (in a bucket `rollup.v0000000002.parquet`, beside a stale
/// `v0000000001` holding one row fewer for the first hour), and the Delta tables removed.
/// Returns how many old files hold rows.
fn to_old_layout(lake: &Lake, remove_delta: &dyn Fn(&str)) -> usize {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let bucket = lake.objects().is_some();
    let mut files = Vec::new();
    for table in RollupTable::ALL {
        let dir = PathBuf::from(table.dir());
        match table.hour_column() {
            None => {
                let (_, batches) = runtime
                    .block_on(sql::query(lake, "SELECT * FROM leases"))
                    .unwrap();
                let batch =
                    datafusion::arrow::compute::concat_batches(&table.schema(), &batches).unwrap();
                let name = if bucket {
                    "leases.v0000000001.parquet"
                } else {
                    "leases.parquet"
                };
                files.push((dir.join(name), batch, 0));
            }
            Some(column) => {
                let (_, hours) = runtime
                    .block_on(sql::query(
                        lake,
                        &format!(
                            r#"SELECT DISTINCT CAST("{column}" AS BIGINT) FROM {}"#,
                            table.name()
                        ),
                    ))
                    .unwrap();
                let hours: Vec<i64> = hours
                    .iter()
                    .flat_map(|b| {
                        b.column(0)
                            .as_any()
                            .downcast_ref::<datafusion::arrow::array::Int64Array>()
                            .unwrap()
                            .values()
                            .to_vec()
                    })
                    .collect();
                assert!(!hours.is_empty(), "{} has hours", table.name());
                for hour in hours {
                    let (_, batches) = runtime
                        .block_on(sql::query(
                            lake,
                            &format!(
                                r#"SELECT * FROM {} WHERE CAST("{column}" AS BIGINT) = {hour}"#,
                                table.name()
                            ),
                        ))
                        .unwrap();
                    let batch =
                        datafusion::arrow::compute::concat_batches(&table.schema(), &batches)
                            .unwrap();
                    let hour_dir = dir.join(gpuwarden_pipeline::lake::hour_partition(hour));
                    if bucket {
                        if hour == T0 {
                            let stale = batch.slice(0, batch.num_rows() - 1);
                            files.push((hour_dir.join("rollup.v0000000001.parquet"), stale, hour));
                        }
                        files.push((hour_dir.join("rollup.v0000000002.parquet"), batch, hour));
                    } else {
                        files.push((hour_dir.join("rollup.parquet"), batch, hour));
                    }
                }
            }
        }
        remove_delta(&table.dir());
    }
    let with_rows = files
        .iter()
        .filter(|(p, ..)| !p.ends_with("rollup.v0000000001.parquet"))
        .count();
    for (path, batch, _) in files {
        write_old(lake, &path, &parquet(&batch));
    }
    with_rows
}

/// `batch` as a Parquet file.
fn parquet(batch: &datafusion::arrow::array::RecordBatch) -> Vec<u8> {
    let mut writer =
        datafusion::parquet::arrow::ArrowWriter::try_new(Vec::new(), batch.schema(), None).unwrap();
    writer.write(batch).unwrap();
    writer.into_inner().unwrap()
}

/// Writes `bytes` as the lake's file `path` (relative to it), as the old layout's writer did.
fn write_old(lake: &Lake, path: &Path, bytes: &[u8]) {
    match lake.objects() {
        Some(objects) => objects.put(path, bytes.to_vec()).unwrap(),
        None => {
            let full = lake.root().join(path);
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(full, bytes).unwrap();
        }
    }
}

/// Rewrites the raw tables of `lake` in the old layout: each file of a Delta table under its
/// hour directory, and in the first hour of `samples` what the old rules hid: a copy of the
/// hour's file its manifest lists as `superseded`, and a `compact-g` file its manifest's
/// `outputs` do not name (a compaction that crashed before its commit). Then the Delta tables
/// are removed. Returns the files the old rules show, and those they hide.
fn raw_to_old_layout(lake: &Lake, remove_delta: &dyn Fn(&str)) -> (usize, usize) {
    let (mut shown, mut hidden) = (0, 0);
    for table in [
        "samples",
        "lease_events",
        "signals",
        "actions",
        "quarantine",
    ] {
        let Some(files) = block_on(lake.delta().files(table, AsOf::Latest)).unwrap() else {
            continue;
        };
        let read: Vec<_> = files
            .files
            .iter()
            .map(|file| {
                let bytes = match lake.objects() {
                    Some(objects) => objects
                        .get(&Path::new(table).join(&file.path))
                        .unwrap()
                        .unwrap()
                        .to_vec(),
                    None => std::fs::read(lake.root().join(table).join(&file.path)).unwrap(),
                };
                (file.clone(), bytes)
            })
            .collect();
        remove_delta(table);
        let mut first_hour = true;
        for (n, (file, bytes)) in read.into_iter().enumerate() {
            let hour = gpuwarden_pipeline::lake::hour_partition(file.hour_ms.unwrap());
            let dir = Path::new(table).join(&hour);
            let name = format!("gpuwarden.{table}-p0-o{n:020}-{n:020}-h{n:016x}.parquet");
            write_old(lake, &dir.join(&name), &bytes);
            shown += 1;
            if table == "samples" && first_hour {
                first_hour = false;
                let superseded = format!("gpuwarden.{table}-p1-o{n:020}-{n:020}-h{n:016x}.parquet");
                write_old(lake, &dir.join(&superseded), &bytes);
                write_old(lake, &dir.join("compact-g1-0000.parquet"), &bytes);
                let manifest = serde_json::json!({
                    "generation": 0, "outputs": [], "superseded": [superseded]
                });
                write_old(
                    lake,
                    &dir.join("_compaction.json"),
                    manifest.to_string().as_bytes(),
                );
                hidden += 3;
            }
        }
    }
    write_old(lake, Path::new("_recompute/samples/1767225600000"), b"");
    (shown, hidden)
}

/// Rows and sums of each raw table, as `gpuwarden sql` answers.
fn raw_answers(config: &str) -> Vec<String> {
    [
        "samples",
        "lease_events",
        "signals",
        "actions",
        "quarantine",
    ]
    .iter()
    .map(|table| {
        ok(gpuwarden(&[
            "sql",
            "--config",
            config,
            &format!("SELECT count(*), sum(ts_ms) FROM {table}"),
        ]))
    })
    .collect()
}

/// `gpuwarden lake migrate --config from --to to`, first killed (`crash_at`: after copying that
/// table's files, before its commit) when given, then run to the end: the new location answers
/// `before` (the rollups) and `raw_before` (the raw tables), and a run again commits nothing.
fn moves(
    from: &str,
    to: &str,
    crash_at: Option<&str>,
    before: &[Vec<String>; 3],
    raw_before: &[String],
) -> String {
    if let Some(table) = crash_at {
        let crashed = gpuwarden_with(
            &["lake", "migrate", "--config", from, "--to", to],
            &[("GPUWARDEN_MOVE_CRASH_AT", table.to_string())],
        );
        assert!(
            !crashed.status.success(),
            "killed after copying {table}: {}",
            String::from_utf8_lossy(&crashed.stderr)
        );
    }
    let moved = ok(gpuwarden(&[
        "lake", "migrate", "--config", from, "--to", to,
    ]));
    println!("{moved}");
    assert!(moved.contains("compared equal"), "{moved}");
    assert!(moved.contains("rollups' state: carried"), "{moved}");
    if crash_at.is_some() {
        assert!(
            moved.contains("committed by an earlier run"),
            "the tables committed before the crash are not committed again: {moved}"
        );
    }
    assert_eq!(
        &gpuwarden_answers(to, &[]).map(|a| unquoted(&a)),
        before,
        "the new location answers as the old one did"
    );
    assert_eq!(raw_answers(to), raw_before, "the raw tables moved whole");
    let again = moved_again(from, to);
    assert!(again.contains("rollups' state: kept"), "{again}");
    assert_eq!(
        sources(&again),
        sources(&moved),
        "a run again reports the sources the first carried: {again}"
    );
    // The new location's rollups go on from the state carried: same answers.
    ok(gpuwarden(&["rollup", "--config", to]));
    assert_eq!(&gpuwarden_answers(to, &[]).map(|a| unquoted(&a)), before);
    moved
}

/// The sources' transactions a move reports for each table.
fn sources(moved: &str) -> Vec<usize> {
    moved
        .lines()
        .filter_map(|l| {
            l.split("sources ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<usize>()
                .ok()
        })
        .collect()
}

/// A move from `from` to `to` run once more, after one that finished: every table (5 raw, 5
/// rollup) is compared again, none committed again.
fn moved_again(from: &str, to: &str) -> String {
    let again = ok(gpuwarden(&[
        "lake", "migrate", "--config", from, "--to", to,
    ]));
    assert_eq!(
        again.matches("committed by an earlier run").count(),
        10,
        "a move run again commits nothing: {again}"
    );
    again
}

fn migrates(
    config: &str,
    dir: &Path,
    lake: &Lake,
    remove_delta: &dyn Fn(&str),
    old_names: &dyn Fn() -> Vec<String>,
    move_old_to: Option<&str>,
) {
    load(config, dir, "first", 0..8, T0, 150);
    let before = gpuwarden_answers(config, &[]).map(|a| unquoted(&a));
    let raw_before = raw_answers(config);
    let (shown, hidden) = raw_to_old_layout(lake, remove_delta);
    assert!(shown > 0 && hidden == 3);
    let old = to_old_layout(lake, remove_delta);
    assert!(!old_names().is_empty());
    assert_eq!(
        gpuwarden_answers(config, &[]).map(|a| unquoted(&a))[0],
        Vec::<String>::new(),
        "the old files are no Delta table"
    );

    let refused = gpuwarden(&["rollup", "--config", config]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(stderr.contains("gpuwarden lake migrate"), "{stderr}");

    // Moved elsewhere as it stands, old layout and all, and left as it was.
    if let Some(to) = move_old_to {
        let old_before = old_names();
        // Not to itself under another name: a lake in the old layout has no log to tell.
        let alias = tempfile::tempdir().unwrap();
        let (aliased, same) = support::rollups::dir_config(alias.path());
        std::os::unix::fs::symlink(lake.root(), same).unwrap();
        let refused = gpuwarden(&[
            "lake",
            "migrate",
            "--config",
            config,
            "--to",
            aliased.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "{stderr}");
        assert!(stderr.contains("is the lake itself"), "{stderr}");
        moves(
            config,
            to,
            Some("rollups/team_hourly"),
            &before,
            &raw_before,
        );
        assert_eq!(old_names(), old_before, "the old lake is left as it was");
    }

    // Compared, and stopped before anything is deleted: as a crash there leaves it.
    let kept = ok(gpuwarden(&[
        "lake",
        "migrate",
        "--config",
        config,
        "--keep-old-files",
    ]));
    println!("{kept}");
    assert!(kept.contains("none (--keep-old-files)"), "{kept}");
    assert!(!old_names().is_empty(), "the old files are kept");
    assert_eq!(gpuwarden_answers(config, &[]).map(|a| unquoted(&a)), before);

    let migrated = ok(gpuwarden(&["lake", "migrate", "--config", config]));
    println!("{migrated}");
    assert!(migrated.contains("compared equal"), "{migrated}");
    let files: usize = migrated
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<usize>().ok())
        .sum();
    assert_eq!(files, old, "{migrated}");
    assert_eq!(
        old_names(),
        Vec::<String>::new(),
        "the old files are deleted"
    );
    assert_eq!(
        gpuwarden_answers(config, &[]).map(|a| unquoted(&a)),
        before,
        "the answers the old files gave"
    );
    assert_eq!(
        raw_answers(config),
        raw_before,
        "the raw tables read as the old rules did"
    );
    let raw_files: usize = migrated
        .lines()
        .filter(|l| l.contains("raw table:"))
        .filter_map(|l| {
            let (_, rest) = l.split_once(" hours, ")?;
            rest.split_whitespace().next()?.parse::<usize>().ok()
        })
        .sum();
    assert_eq!(
        raw_files, shown,
        "every file the old rules showed is in a log: {migrated}"
    );
    let deleted: usize = migrated
        .lines()
        .filter(|l| l.contains("raw table:"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<usize>().ok())
        .sum();
    assert_eq!(
        deleted, hidden,
        "what the old rules hid is deleted: {migrated}"
    );
    let again = ok(gpuwarden(&["lake", "migrate", "--config", config]));
    assert!(again.contains("nothing to migrate"), "{again}");

    // The rollups run again, over hours the migration committed.
    ok(gpuwarden(&["rollup", "--config", config]));
    assert_eq!(gpuwarden_answers(config, &[]).map(|a| unquoted(&a)), before);
}

#[test]
fn a_lake_in_a_directory_is_migrated_to_delta_tables() {
    let dir = tempfile::tempdir().unwrap();
    let (config, root) = support::rollups::dir_config(dir.path());
    let lake = Lake::open(&root).unwrap();
    let rollups = root.join("rollups");
    let old_names = || -> Vec<String> {
        let mut names = Vec::new();
        for table in std::fs::read_dir(&rollups).unwrap().flatten() {
            let mut dirs = vec![table.path()];
            while let Some(d) = dirs.pop() {
                for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if e.path().is_dir() && (name.starts_with("date=") || name.starts_with("hour="))
                    {
                        dirs.push(e.path());
                    } else if name == "rollup.parquet"
                        || name == "leases.parquet"
                        || name.starts_with("date=")
                    {
                        names.push(e.path().display().to_string());
                    }
                }
            }
        }
        names
    };
    let elsewhere = tempfile::tempdir().unwrap();
    let (to, _) = support::rollups::dir_config(elsewhere.path());
    migrates(
        config.to_str().unwrap(),
        dir.path(),
        &lake,
        &|table| std::fs::remove_dir_all(root.join(table)).unwrap(),
        &old_names,
        Some(to.to_str().unwrap()),
    );
}

#[test]
fn a_lake_in_a_bucket_is_migrated_to_delta_tables() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "gpuwarden-lake");
    let config = server.config_file(dir.path(), "prod");
    let lake = server.lake("prod", &dir.path().join("staging"));
    let remove = |table: &str| {
        for key in server.keys(&format!("prod/{table}/")) {
            std::fs::remove_file(server.object_path(&key)).unwrap();
        }
    };
    let old_names = || -> Vec<String> {
        server
            .keys("prod/rollups/")
            .into_iter()
            .filter(|k| k.contains("/rollup.v") || k.contains("/leases.v"))
            .collect()
    };
    let config = config.to_str().unwrap();
    migrates(config, dir.path(), &lake, &remove, &old_names, None);

    // New rows ingested into its Delta tables, then the lake moved to a directory: the files
    // its ingest committed go with it, so ingesting them again there adds nothing.
    load(config, dir.path(), "second", 0..8, T0 + 150 * MINUTE, 30);
    let before = gpuwarden_answers(config, &[]).map(|a| unquoted(&a));
    let raw_before = raw_answers(config);
    let elsewhere = tempfile::tempdir().unwrap();
    let (to, _) = support::rollups::dir_config(elsewhere.path());
    let to = to.to_str().unwrap();
    let moved = moves(config, to, None, &before, &raw_before);
    let carried: usize = sources(&moved).iter().sum();
    assert!(
        carried >= 2,
        "the ingested files' transactions are carried: {moved}"
    );
    load(to, elsewhere.path(), "second", 0..8, T0 + 150 * MINUTE, 30);
    assert_eq!(raw_answers(to), raw_before, "ingested again: nothing added");
    assert_eq!(gpuwarden_answers(to, &[]).map(|a| unquoted(&a)), before);

    // Both lakes go on (the old one's pipeline not stopped yet, the new one's started): a move
    // run again still compares each table's move commit with the version it copied.
    load(config, dir.path(), "third", 0..8, T0 + 180 * MINUTE, 30);
    load(to, elsewhere.path(), "fourth", 0..8, T0 + 210 * MINUTE, 30);
    assert_ne!(raw_answers(to), raw_before, "the new lake took in new rows");
    moved_again(config, to);

    // A location that holds a lake of its own is refused before anything is written.
    let refused = gpuwarden(&["lake", "migrate", "--config", to, "--to", config]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(stderr.contains("already holds samples"), "{stderr}");
}
