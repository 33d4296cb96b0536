//! `gpuwarden lake migrate` on a lake whose rollup tables are in the layout before Delta tables
//! (`rollups/<table>/date=…/hour=…/rollup.parquet`; in a bucket `rollup.v<n>.parquet`, the
//! highest `n` the hour's, and `leases.parquet` / `leases.v<n>.parquet`), in a directory and in
//! a bucket of the tests' S3 server: the rollups refuse to run until it has, a run stopped
//! before it deletes anything changes nothing a second run cannot finish, and afterwards every
//! answer is the one the old files gave, the old files are gone, and the rollups run again.
//!
//! The old layout is written here from the rows the rollups computed (read back with the
//! library, then written with `Lake::write` under the old names), since the code that wrote it
//! is gone: the files are the same rows, in the same schema (timestamps in milliseconds), under
//! the same names.

mod support;

use std::path::{Path, PathBuf};

use gpuwarden_pipeline::{sql, Lake, RollupTable};
use support::rollups::{gpuwarden, gpuwarden_answers, load, ok, unquoted, T0};
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
    for (path, batch, hour) in files {
        lake.write(&path, &batch, "rollups", hour).unwrap();
    }
    with_rows
}

fn migrates(
    config: &str,
    dir: &Path,
    lake: &Lake,
    remove_delta: &dyn Fn(&str),
    old_names: &dyn Fn() -> Vec<String>,
) {
    load(config, dir, "first", 0..8, T0, 150);
    let before = gpuwarden_answers(config, &[]).map(|a| unquoted(&a));
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
    migrates(
        config.to_str().unwrap(),
        dir.path(),
        &lake,
        &|table| std::fs::remove_dir_all(root.join(table)).unwrap(),
        &old_names,
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
    migrates(
        config.to_str().unwrap(),
        dir.path(),
        &lake,
        &remove,
        &old_names,
    );
}
