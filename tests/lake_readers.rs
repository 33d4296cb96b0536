//! The rollup tables read by Delta readers that are not gpuwarden's, as the book's page "Reading
//! the lake with any Delta reader" (docs/src/finops/delta-readers.md) shows them: DuckDB with its `delta` extension and polars' `scan_delta`
//! (through the `deltalake` package), each running the page's examples as written, on a lake in
//! a directory and in a bucket of the tests' S3 server, agreeing with `gpuwarden sql` to the cent
//! on `team_hourly`, `lease_usage` (leases joined to `lease_hourly`) and `focus_costs`. Then
//! `gpuwarden sql --as-of` reproduces the answer of a version that late data has since restated.
//! Last, the readers read over and over while other processes ingest, roll up and OPTIMIZE:
//! each answer is gpuwarden's at a version the table had meanwhile.
//!
//! Needs a Python with duckdb, its delta and httpfs extensions, polars and deltalake:
//! `GPUWARDEN_PYTHON` (set by .ci/run) names it.

mod support;

use std::path::Path;
use std::process::Command;

use support::rollups::{gpuwarden, gpuwarden_answers, load, ok, unquoted, MINUTE, T0};
use support::s3::S3Server;

/// The book's page that shows how other Delta readers read the lake.
const READERS_PAGE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/docs/src/finops/delta-readers.md"
);

/// A fenced block of the page "Reading the lake with any Delta reader" that begins with `marker`.
fn readme_example(marker: &str) -> String {
    let page = std::fs::read_to_string(READERS_PAGE).unwrap();
    let section = page
        .split("# Reading the lake with any Delta reader")
        .nth(1)
        .expect("docs/src/finops/delta-readers.md has the section");
    let block = section
        .split("```")
        .find(|b| b.lines().nth(1) == Some(marker))
        .unwrap_or_else(|| panic!("delta-readers.md has a block starting {marker}"));
    block.split_once('\n').unwrap().1.to_string()
}

/// The file of a DuckDB extension from its PyPI package, found by the page's own command.
fn extension(python: &str, package: &str) -> String {
    let page = std::fs::read_to_string(READERS_PAGE).unwrap();
    let prefix = format!("python3 -c \"import {package}");
    let finder = page
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.strip_suffix('"'))
        .unwrap_or_else(|| panic!("delta-readers.md says how to find {package}'s file"));
    let path = ok(Command::new(python)
        .args(["-c", &format!("import {package}{finder}")])
        .output()
        .unwrap());
    path.trim().to_string()
}

/// The page's DuckDB example with the lake at `location` (its `s3://gpuwarden-lake/prod`
/// replaced), the extensions loaded from their files, and `secret` for its secret (none for a
/// directory): its three answers as `key,value` lines.
fn duckdb(python: &str, location: &str, secret: Option<String>) -> [Vec<String>; 3] {
    let example = readme_example("-- DuckDB");
    let mut statements: Vec<String> = Vec::new();
    for statement in example.split(';') {
        let statement = statement.trim();
        if statement.is_empty() || statement.starts_with("-- DuckDB") && !statement.contains('\n') {
            continue;
        }
        let statement = statement.trim_start_matches("-- DuckDB").trim();
        if statement.starts_with("INSTALL") {
            continue;
        }
        if statement.starts_with("LOAD") {
            let name = statement.trim_start_matches("LOAD").trim();
            let package = format!("duckdb_extension_{name}");
            statements.push(format!("LOAD '{}'", extension(python, &package)));
            continue;
        }
        if statement.starts_with("CREATE SECRET") {
            if let Some(secret) = &secret {
                statements.push(secret.clone());
            }
            continue;
        }
        statements.push(statement.replace("s3://gpuwarden-lake/prod", location));
    }
    let out = ok(Command::new(python)
        .args([
            "-c",
            "import sys, duckdb\n\
             c = duckdb.connect()\n\
             *setup, a, b, f = sys.argv[1:]\n\
             [c.sql(s) for s in setup]\n\
             for q in (a, b, f):\n\
             \x20   for row in c.sql(q).fetchall():\n\
             \x20       print(','.join(str(v) for v in row))\n\
             \x20   print('--')",
        ])
        .args(&statements)
        .output()
        .unwrap());
    answers(&out)
}

/// One DuckDB query with the delta (and httpfs) extensions loaded and `secret` made: its rows as
/// `key,value` lines.
fn duckdb_query(python: &str, secret: Option<String>, query: &str) -> Vec<String> {
    let mut statements = vec![
        format!("LOAD '{}'", extension(python, "duckdb_extension_delta")),
        format!("LOAD '{}'", extension(python, "duckdb_extension_httpfs")),
    ];
    statements.extend(secret);
    let out = ok(Command::new(python)
        .args([
            "-c",
            "import sys, duckdb\n\
             c = duckdb.connect()\n\
             *setup, q = sys.argv[1:]\n\
             [c.sql(s) for s in setup]\n\
             for row in c.sql(q).fetchall():\n\
             \x20   print(','.join(str(v) for v in row))",
        ])
        .args(&statements)
        .arg(query)
        .output()
        .unwrap());
    unquoted(&out.lines().map(str::to_owned).collect::<Vec<_>>())
}

/// The page's polars example with the lake at `location` and `storage` for its storage
/// options (none for a directory), then the other two answers the same way.
fn polars(python: &str, location: &str, storage: Option<String>) -> [Vec<String>; 3] {
    let example = readme_example("# polars");
    let mut script = String::new();
    for line in example.lines() {
        // The example's storage options span two lines; the test's replace them.
        if line.starts_with("storage = ") {
            script.push_str(&format!(
                "storage = {}\n",
                storage.as_deref().unwrap_or("None")
            ));
            continue;
        }
        if line.starts_with("           \"AWS_") {
            continue;
        }
        let line = line.replace("s3://gpuwarden-lake/prod", location);
        // The example prints a polars frame; the test prints its rows as the others do.
        let line = match line
            .strip_prefix("print(")
            .and_then(|l| l.strip_suffix(')'))
        {
            Some(frame) => format!("show({frame})"),
            None => line,
        };
        script.push_str(&line);
        script.push('\n');
    }
    let show = "def show(frame):\n    for row in frame.iter_rows():\n        \
                print(','.join(str(v) for v in row))\n    print('--')\n";
    let rest = format!(
        "leases = pl.scan_delta('{location}/rollups/leases', storage_options=storage)\n\
         hours = pl.scan_delta('{location}/rollups/lease_hourly', storage_options=storage)\n\
         usage = leases.join(hours, on='lease_id').group_by('team').agg(\
         pl.col('cost_usd').sum().round(2), pl.col('lease_id').n_unique()).sort('team')\n\
         show(usage.collect())\n\
         focus = pl.scan_delta('{location}/rollups/focus_costs', storage_options=storage)\n\
         show(focus.group_by('SubAccountName').agg(\
         pl.col('BilledCost').cast(pl.Float64).sum().round(2)).sort('SubAccountName').collect())\n"
    );
    let out = ok(Command::new(python)
        .args(["-c", &format!("{show}{script}{rest}")])
        .output()
        .unwrap());
    answers(&out)
}

fn answers(out: &str) -> [Vec<String>; 3] {
    let mut parts = out
        .split("--\n")
        .map(|part| part.lines().map(str::to_owned).collect::<Vec<_>>());
    [
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    ]
}

fn readers_agree(
    config: &str,
    dir: &Path,
    location: &str,
    secret: Option<String>,
    storage: Option<String>,
) {
    let python = support::venv_python(
        "DuckDB with its delta and httpfs extensions, polars and deltalake",
        "import duckdb, duckdb_extension_delta, duckdb_extension_httpfs, polars, deltalake",
    );
    load(config, dir, "first", 0..8, T0, 150);
    let expected = gpuwarden_answers(config, &[]).map(|a| unquoted(&a));
    assert!(
        expected.iter().all(|a| !a.is_empty()),
        "every answer has rows: {expected:?}"
    );
    assert_eq!(
        expected[0]
            .iter()
            .map(|l| l.split(',').next().unwrap())
            .collect::<Vec<_>>(),
        ["(unallocated)", "ml", "vision"],
        "{expected:?}"
    );
    let by_duckdb = duckdb(&python, location, secret.clone()).map(|a| unquoted(&a));
    assert_eq!(by_duckdb, expected, "DuckDB's delta_scan and gpuwarden sql");
    let by_polars = polars(&python, location, storage.clone()).map(|a| unquoted(&a));
    assert_eq!(by_polars, expected, "polars' scan_delta and gpuwarden sql");

    // The raw samples, read by DuckDB through their table's log, before and after compaction
    // (OPTIMIZE) swapped every hour's files: the same rows as gpuwarden's, and the rollups'
    // answers unchanged.
    let raw = "SELECT count(*), count(DISTINCT gpu_uuid), sum(ts_ms) FROM samples";
    let gpuwarden_raw = unquoted(&support::rollups::sql(config, &[], raw));
    let duckdb_raw = |location: &str| {
        duckdb_query(
            &python,
            secret.clone(),
            &raw.replace(
                "FROM samples",
                &format!("FROM delta_scan('{location}/samples')"),
            ),
        )
    };
    assert_eq!(
        duckdb_raw(location),
        gpuwarden_raw,
        "DuckDB's delta_scan of samples"
    );
    // At the rollups' watermark: the hours it has passed (with the lateness) are compacted.
    let compacted = ok(gpuwarden(&["compact", "--config", config]));
    assert!(!compacted.contains("hours compacted: 0;"), "{compacted}");
    assert_eq!(duckdb_raw(location), gpuwarden_raw, "after OPTIMIZE");
    assert_eq!(
        duckdb(&python, location, secret.clone()).map(|a| unquoted(&a)),
        expected,
        "the rollups after OPTIMIZE"
    );

    // Late samples of four more GPUs restate the second hour; the answer as the invoice was
    // computed stays reproducible.
    // A FOCUS export says which version of focus_costs it was computed from.
    let focus = r#"SELECT "SubAccountName", round(CAST(sum("BilledCost") AS DOUBLE), 2)
                   FROM focus_costs GROUP BY 1 ORDER BY 1"#;
    let export = gpuwarden(&["sql", "--config", config, "--format", "csv", focus]);
    let said = String::from_utf8_lossy(&export.stderr).into_owned();
    let version = said
        .lines()
        .find_map(|l| l.strip_prefix("read focus_costs at version "))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("the export names its version: {said}"))
        .to_string();
    let before = std::time::SystemTime::now();
    std::thread::sleep(std::time::Duration::from_millis(1_100));
    load(config, dir, "late", 8..12, T0 + 60 * MINUTE, 30);
    let restated = gpuwarden_answers(config, &[]).map(|a| unquoted(&a));
    assert_ne!(
        restated[0], expected[0],
        "the late samples changed the costs"
    );
    let at = humantime::format_rfc3339_millis(before).to_string();
    let as_of = gpuwarden_answers(config, &["--as-of", &at]).map(|a| unquoted(&a));
    assert_eq!(
        as_of, expected,
        "--as-of {at} reads the tables as they stood"
    );
    let again = unquoted(&support::rollups::sql(
        config,
        &["--as-of", &version],
        focus,
    ));
    assert_ne!(restated[2], expected[2]);
    assert_eq!(
        again, expected[2],
        "--as-of {version} computes the export again"
    );
    let by_duckdb = duckdb(&python, location, secret.clone()).map(|a| unquoted(&a));
    assert_eq!(by_duckdb, restated, "DuckDB reads the latest version");

    readers_agree_while_it_changes(config, dir, location, &python, secret, storage);
}

/// The team costs of `team_hourly` as gpuwarden answers them.
const TEAM: &str =
    "SELECT team, round(sum(cost_usd), 2) FROM team_hourly GROUP BY team ORDER BY team";
/// The raw samples' rows and sum of `ts_ms`.
const RAW: &str = "SELECT count(*), sum(ts_ms) FROM samples";

/// While other processes ingest late samples, roll them up and OPTIMIZE the raw tables, the
/// readers read over and over: each answer of DuckDB's (the latest version when it plans) is
/// gpuwarden's at one of the versions the table had while it read, and polars', pinned to a
/// version by `deltalake`, is gpuwarden's at that version (`--as-of`): no reader sees a torn
/// hour, a file counted twice, or one missing.
fn readers_agree_while_it_changes(
    config: &str,
    dir: &Path,
    location: &str,
    python: &str,
    secret: Option<String>,
    storage: Option<String>,
) {
    let stop = dir.join("readers.stop");
    let writer = {
        let (config, dir, stop) = (config.to_string(), dir.to_path_buf(), stop.clone());
        std::thread::spawn(move || {
            for round in 0..3 {
                let gpus = 12 + 2 * round..14 + 2 * round;
                load(
                    &config,
                    &dir,
                    &format!("round{round}"),
                    gpus,
                    T0 + 20 * MINUTE,
                    90,
                );
                ok(gpuwarden(&["compact", "--config", &config]));
            }
            std::fs::write(&stop, "").unwrap();
        })
    };
    let delta = extension(python, "duckdb_extension_delta");
    let httpfs = extension(python, "duckdb_extension_httpfs");
    let script = r#"
import json, os, sys, duckdb, polars as pl
from deltalake import DeltaTable
location, delta, httpfs, secret, storage, stop = sys.argv[1:]
storage = eval(storage)
c = duckdb.connect()
c.sql(f"LOAD '{delta}'")
c.sql(f"LOAD '{httpfs}'")
if secret:
    c.sql(secret)
team = f"{location}/rollups/team_hourly"
samples = f"{location}/samples"
def version(path):
    return DeltaTable(path, storage_options=storage).version()
def rows(result):
    return [",".join(str(v) for v in row) for row in result]
while True:
    last = os.path.exists(stop)
    t0, s0 = version(team), version(samples)
    by_duckdb = rows(c.sql(f"SELECT team, round(sum(cost_usd), 2) FROM delta_scan('{team}') GROUP BY 1 ORDER BY 1").fetchall())
    raw = rows(c.sql(f"SELECT count(*), sum(ts_ms) FROM delta_scan('{samples}')").fetchall())
    t1, s1 = version(team), version(samples)
    pinned = version(team)
    frame = pl.read_delta(team, version=pinned, storage_options=storage)
    by_polars = rows(frame.group_by("team").agg(pl.col("cost_usd").sum().round(2)).sort("team").iter_rows())
    print(json.dumps({"team": [t0, t1], "samples": [s0, s1], "duckdb": by_duckdb, "raw": raw,
                      "pinned": pinned, "polars": by_polars}), flush=True)
    if last:
        break
"#;
    let out = Command::new(python)
        .args(["-c", script, location, &delta, &httpfs])
        .arg(secret.unwrap_or_default())
        .arg(storage.unwrap_or_else(|| "None".to_string()))
        .arg(&stop)
        .output()
        .unwrap();
    writer.join().expect("the writer's rounds");
    let out = ok(out);
    let seen: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(seen.len() >= 3, "the readers read while it changed: {out}");
    let mut answers: std::collections::HashMap<(&str, u64), Vec<String>> = Default::default();
    let mut at = |query: &'static str, version: u64| -> Vec<String> {
        answers
            .entry((query, version))
            .or_insert_with(|| {
                unquoted(&support::rollups::sql(
                    config,
                    &["--as-of", &version.to_string()],
                    query,
                ))
            })
            .clone()
    };
    let strings = |v: &serde_json::Value| -> Vec<String> {
        unquoted(
            &v.as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect::<Vec<_>>(),
        )
    };
    let range = |v: &serde_json::Value| v[0].as_u64().unwrap()..=v[1].as_u64().unwrap();
    let mut versions = std::collections::BTreeSet::new();
    for observed in &seen {
        let duckdb = strings(&observed["duckdb"]);
        assert!(
            range(&observed["team"]).any(|v| at(TEAM, v) == duckdb),
            "DuckDB's team costs are gpuwarden's at a version it read between: {observed}"
        );
        let raw = strings(&observed["raw"]);
        assert!(
            range(&observed["samples"]).any(|v| at(RAW, v) == raw),
            "DuckDB's samples are gpuwarden's at a version it read between: {observed}"
        );
        let pinned = observed["pinned"].as_u64().unwrap();
        assert_eq!(
            strings(&observed["polars"]),
            at(TEAM, pinned),
            "polars at version {pinned}: {observed}"
        );
        versions.insert(pinned);
    }
    println!(
        "{} reads while it changed; team_hourly versions polars pinned: {versions:?}",
        seen.len()
    );
    assert!(
        versions.len() >= 2,
        "the readers saw the table change under them: {out}"
    );
    let last = seen.last().unwrap();
    assert_eq!(
        strings(&last["duckdb"]),
        unquoted(&support::rollups::sql(config, &[], TEAM)),
        "the last read, after the writers stopped, is the latest answer"
    );
}

#[test]
fn delta_readers_agree_with_gpuwarden_sql_on_a_lake_in_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let (config, lake) = support::rollups::dir_config(dir.path());
    readers_agree(
        config.to_str().unwrap(),
        dir.path(),
        lake.to_str().unwrap(),
        None,
        None,
    );
}

#[test]
fn delta_readers_agree_with_gpuwarden_sql_on_a_lake_in_a_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "gpuwarden-lake");
    let config = server.config_file(dir.path(), "prod");
    let host = server.endpoint.trim_start_matches("http://");
    let secret = format!(
        "CREATE SECRET (TYPE s3, KEY_ID '{}', SECRET '{}', REGION '{}', ENDPOINT '{host}', \
         URL_STYLE 'path', USE_SSL false)",
        support::s3::ACCESS_KEY,
        support::s3::SECRET_KEY,
        support::s3::REGION,
    );
    let storage = format!(
        "{{'AWS_ENDPOINT_URL': '{}', 'AWS_REGION': '{}', 'AWS_ACCESS_KEY_ID': '{}', \
         'AWS_SECRET_ACCESS_KEY': '{}', 'AWS_ALLOW_HTTP': 'true'}}",
        server.endpoint,
        support::s3::REGION,
        support::s3::ACCESS_KEY,
        support::s3::SECRET_KEY,
    );
    readers_agree(
        config.to_str().unwrap(),
        dir.path(),
        "s3://gpuwarden-lake/prod",
        Some(secret),
        Some(storage),
    );
}
