//! The FinOps query library tested as files (DataFusion's sqllogictest, arroyo's golden
//! outputs): the fixture of `queries/fixture/` is loaded with `gpuwarden ingest` and rolled up
//! with `gpuwarden rollup` in a temporary directory, then every `queries/*.sql` runs through
//! `gpuwarden sql -f … --format csv` and must print exactly its `queries/*.expected.csv`.
//!
//! A blessed file only says that the output did not change, not that it is right, so a few
//! numbers are also worked out here from the fixture's story (queries/fixture/generate.py) and
//! asserted on the queries' output. The same files must also run through the Postgres-wire
//! endpoint with psql and give the same rows.
//!
//! `GPUWARDEN_BLESS=1 cargo nextest run -p gpuwarden --test queries` rewrites the expected
//! files from the current output (the hand-checked numbers must still hold).

mod support;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::process::ok;
use support::{start_pipeline_with_sql, Psql};

/// The price of a GPU-hour in queries/fixture/gpuwarden.toml.
const H100: f64 = 4.5;
const A100: f64 = 2.6;
/// No `[[pricing.gpu]]` entry matches the L40S: the default price.
const L40S: f64 = 2.0;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn queries_dir() -> PathBuf {
    root().join("queries")
}

fn fixture_dir() -> PathBuf {
    queries_dir().join("fixture")
}

/// The fixture's config with its (relative) data_dir pointed into `dir`, plus `extra` TOML.
fn write_config(dir: &Path, extra: &str) -> PathBuf {
    let text = std::fs::read_to_string(fixture_dir().join("gpuwarden.toml")).unwrap();
    let relative = "data_dir = \"gpuwarden-data\"";
    assert!(
        text.contains(relative),
        "queries/fixture/gpuwarden.toml sets {relative}"
    );
    let text = text.replace(
        relative,
        &format!("data_dir = \"{}\"", dir.join("data").display()),
    );
    let path = dir.join("gpuwarden.toml");
    std::fs::write(&path, format!("{text}\n{extra}")).unwrap();
    path
}

fn gpuwarden(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(args)
        .output()
        .unwrap()
}

fn lines_in(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count()
}

/// Loads the fixture into the lake of `config` and rolls it up; asserts every record was
/// written and none quarantined.
fn build_lake(config: &Path) {
    let config = config.to_str().unwrap();
    let inputs = [
        ("--samples", "samples.jsonl", "samples"),
        ("--lease-events", "lease_events.jsonl", "lease_events"),
        ("--actions", "actions.jsonl", "actions"),
        ("--signals", "signals.jsonl", "signals"),
    ];
    let mut args = vec!["ingest".to_string(), "--config".into(), config.into()];
    for (flag, file, _) in inputs {
        args.push(flag.into());
        args.push(fixture_dir().join(file).to_str().unwrap().into());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let stdout = ok(gpuwarden(&args));
    for (_, file, table) in inputs {
        let n = lines_in(&fixture_dir().join(file));
        assert!(n > 0, "queries/fixture/{file} is empty");
        assert!(
            stdout.contains(&format!(
                "{n} {table} records read, {n} written, 0 quarantined"
            )),
            "every line of queries/fixture/{file} must be valid:\n{stdout}"
        );
    }
    let out = gpuwarden(&["rollup", "--config", config]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let count = sql_csv(config, "SELECT count(*) AS n FROM quarantine");
    assert_eq!(count, "n\n0\n", "nothing of the fixture is quarantined");
}

fn sql_csv(config: &str, query: &str) -> String {
    let out = gpuwarden(&["sql", "--config", config, "--format", "csv", query]);
    assert!(
        out.status.success(),
        "{query}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `queries/*.sql`, sorted by name.
fn query_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(queries_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "sql"))
        .collect();
    files.sort();
    files
}

fn name_of(query: &Path) -> String {
    query.file_stem().unwrap().to_str().unwrap().to_string()
}

/// What is wrong with a query's header comment: it must open the file, as `--` lines, and say
/// the question, the columns and how to change the parameters.
fn header_problems(text: &str) -> Vec<String> {
    let header: Vec<&str> = text
        .lines()
        .take_while(|l| l.trim().is_empty() || l.trim_start().starts_with("--"))
        .collect();
    if !text.trim_start().starts_with("--") {
        return vec!["does not open with a `--` header comment".into()];
    }
    ["Question:", "Columns:", "Parameters:"]
        .into_iter()
        .filter(|key| !header.iter().any(|l| l.contains(key)))
        .map(|key| format!("its header comment has no `{key}` line"))
        .collect()
}

/// A line diff (longest common subsequence): `-` expected, `+` actual, ` ` both.
fn diff(expected: &str, actual: &str) -> String {
    let (a, b): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            let _ = writeln!(out, "  {}", a[i]);
            i += 1;
            j += 1;
        } else if i < a.len() && (j == b.len() || lcs[i + 1][j] >= lcs[i][j + 1]) {
            let _ = writeln!(out, "- {}", a[i]);
            i += 1;
        } else {
            let _ = writeln!(out, "+ {}", b[j]);
            j += 1;
        }
    }
    out
}

/// Parses CSV (RFC 4180: quoted fields, doubled quotes) into rows of fields.
fn parse_csv(text: &str) -> Vec<Vec<String>> {
    let (mut rows, mut row, mut field) = (Vec::new(), Vec::new(), String::new());
    let (mut quoted, mut chars) = (false, text.chars().peekable());
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (true, '"') => quoted = false,
            (true, c) => field.push(c),
            (false, '"') => quoted = true,
            (false, ',') => row.push(std::mem::take(&mut field)),
            (false, '\r') => {}
            (false, '\n') => {
                row.push(std::mem::take(&mut field));
                rows.push(std::mem::take(&mut row));
            }
            (false, c) => field.push(c),
        }
    }
    if !field.is_empty() || !row.is_empty() {
        row.push(field);
        rows.push(row);
    }
    rows
}

/// A query's output as records keyed by column name.
struct Table {
    name: String,
    rows: Vec<BTreeMap<String, String>>,
}

impl Table {
    fn parse(name: &str, csv: &str) -> Self {
        let mut rows = parse_csv(csv).into_iter();
        let header = rows.next().unwrap_or_default();
        Self {
            name: name.into(),
            rows: rows
                .map(|r| header.iter().cloned().zip(r).collect())
                .collect(),
        }
    }

    /// The one row whose columns have the given values.
    fn row(&self, key: &[(&str, &str)]) -> &BTreeMap<String, String> {
        let found: Vec<_> = self
            .rows
            .iter()
            .filter(|r| {
                key.iter()
                    .all(|(k, v)| r.get(*k).map(String::as_str) == Some(*v))
            })
            .collect();
        assert_eq!(found.len(), 1, "{}: one row with {key:?}", self.name);
        found[0]
    }

    fn number(&self, key: &[(&str, &str)], column: &str) -> f64 {
        let cell = &self.row(key)[column];
        cell.parse()
            .unwrap_or_else(|_| panic!("{}: {column} of {key:?} is {cell:?}", self.name))
    }

    fn column(&self, column: &str) -> Vec<&str> {
        self.rows.iter().map(|r| r[column].as_str()).collect()
    }
}

#[track_caller]
fn assert_usd(what: &str, actual: f64, expected: f64) {
    assert!(
        (actual - expected).abs() < 0.005 + 1e-9,
        "{what}: {actual}, worked out by hand as {expected:.4}"
    );
}

#[test]
fn every_query_prints_its_expected_output_on_the_fixture_lake() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "");
    build_lake(&config);
    let bless = std::env::var_os("GPUWARDEN_BLESS").is_some_and(|v| v == "1");

    let queries = query_files();
    assert!(
        queries.len() >= 10,
        "the library has at least ten queries, found {}",
        queries.len()
    );
    let mut problems = Vec::new();
    let mut outputs = BTreeMap::new();
    for query in &queries {
        let name = name_of(query);
        let text = std::fs::read_to_string(query).unwrap();
        for problem in header_problems(&text) {
            problems.push(format!("queries/{name}.sql {problem}"));
        }
        let out = gpuwarden(&[
            "sql",
            "--config",
            config.to_str().unwrap(),
            "--format",
            "csv",
            "-f",
            query.to_str().unwrap(),
        ]);
        if !out.status.success() {
            problems.push(format!(
                "queries/{name}.sql failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
            continue;
        }
        let actual = String::from_utf8(out.stdout).unwrap();
        if actual.lines().count() < 2 {
            problems.push(format!(
                "queries/{name}.sql returns no rows on the fixture lake: make the fixture \
                 exercise it\n{actual}"
            ));
        }
        let expected_path = queries_dir().join(format!("{name}.expected.csv"));
        if bless {
            std::fs::write(&expected_path, &actual).unwrap();
        } else {
            match std::fs::read_to_string(&expected_path) {
                Err(_) => problems.push(format!(
                    "queries/{name}.expected.csv is missing (GPUWARDEN_BLESS=1 writes it)"
                )),
                Ok(expected) if expected != actual => problems.push(format!(
                    "queries/{name}.sql does not print queries/{name}.expected.csv \
                     (- expected, + actual; GPUWARDEN_BLESS=1 accepts the new output):\n{}",
                    diff(&expected, &actual)
                )),
                Ok(_) => {}
            }
        }
        outputs.insert(name, actual);
    }
    for entry in std::fs::read_dir(queries_dir()).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_str().unwrap().to_string();
        if let Some(name) = file.strip_suffix(".expected.csv") {
            if !queries_dir().join(format!("{name}.sql")).exists() {
                problems.push(format!(
                    "queries/{file} has no queries/{name}.sql: remove it"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));

    hand_checked_numbers(&outputs);
}

/// Numbers worked out from the fixture's story (queries/fixture/generate.py: T0 =
/// 2026-01-31T22:00Z, samples every 5 minutes until the watermark, 2026-02-01T02:55Z).
fn hand_checked_numbers(outputs: &BTreeMap<String, String>) {
    let table = |name: &str| Table::parse(name, &outputs[name]);

    // research in January: lease-01 holds 2 H100s from 22:00 and lease-05 1 L40S from 23:00,
    // both past midnight.
    let cost = table("cost_by_team_month");
    assert_usd(
        "research's January cost",
        cost.number(&[("month", "2026-01"), ("team", "research")], "cost_usd"),
        2.0 * 2.0 * H100 + 1.0 * 1.0 * L40S,
    );
    // vision in February: lease-02's H100 until its reclaim at 00:30, and lease-04's 2 A100s
    // from midnight to the watermark (2 h 55 min; a running lease is allocated to it).
    assert_usd(
        "vision's February cost",
        cost.number(&[("month", "2026-02"), ("team", "vision")], "cost_usd"),
        0.5 * H100 + 2.0 * (2.0 + 55.0 / 60.0) * A100,
    );

    // Capacity no lease held, GPU-hour by GPU-hour. Each GPU's samples (22:00 to 02:55, each
    // covering the 5 minutes before it) cover 21:55-02:55, 5 h: H100: h100-3 never leased
    // (5 h), h100-2 before lease-02 and after its reclaim (35 min + 2 h 25 min), h100-0 and
    // h100-1 before and after lease-01 (5 + 55 min each); A100: a100-0 before lease-03, between
    // it and lease-06 and after (5 + 30 + 25 min), a100-1 before and after lease-03 (5 min +
    // 1 h 55 min), a100-2 and -3 before lease-04 (1 h 5 min each); L40S: l40s-0 around lease-05
    // (1 h 5 min + 1 h 55 min), l40s-1 never (5 h).
    let unallocated = table("unallocated_capacity_cost");
    let costs = unallocated.column("cost_usd");
    let total: f64 = costs.iter().map(|c| c.parse::<f64>().unwrap()).sum();
    let by_hand = 10.0 * H100 + (5.0 + 1.0 / 6.0) * A100 + 8.0 * L40S;
    // Each row is rounded to the cent.
    assert!(
        (total - by_hand).abs() <= 0.005 * costs.len() as f64 + 1e-9,
        "the cost of unallocated capacity: {total}, worked out by hand as {by_hand:.4}"
    );
    assert_usd(
        "January's unallocated H100s",
        unallocated.number(
            &[("month", "2026-01"), ("gpu_model", "NVIDIA H100 80GB HBM3")],
            "cost_usd",
        ),
        // h100-3 from 21:55 (2 h 5 min), h100-2 until 22:30 (35 min), h100-0 and -1 until 22:00.
        (2.0 + 50.0 / 60.0) * H100,
    );

    // lease-02 (a notebook, max_duration 4h) was granted at 22:30 and reclaimed for idleness at
    // 00:30: it would have held its H100 until 02:30, before the watermark.
    let savings = table("reclaim_savings");
    assert_eq!(savings.column("lease_id"), ["lease-02"]);
    let key = [("lease_id", "lease-02")];
    assert_eq!(savings.row(&key)["assumed_end"], "2026-02-01T02:30:00Z");
    assert_usd(
        "lease-02's saved GPU-hours",
        savings.number(&key, "saved_gpu_hours"),
        2.0,
    );
    assert_usd(
        "lease-02's savings",
        savings.number(&key, "saved_usd"),
        2.0 * H100,
    );

    // The one rogue GPU: h100-3, busy from 23:00 to 01:00 with no lease, alerted once an hour.
    let rogue = table("rogue_usage");
    assert_eq!(rogue.column("gpu_uuid"), ["GPU-h100-3"]);
    let key = [("gpu_uuid", "GPU-h100-3")];
    assert_usd(
        "rogue GPU-hours",
        rogue.number(&key, "rogue_gpu_hours"),
        2.0,
    );
    assert_usd("rogue cost", rogue.number(&key, "cost_usd"), 2.0 * H100);
    assert_eq!(rogue.row(&key)["alerts"], "3");

    // Month-end: vision has spent its February so far and burns lease-04's 2 A100s for the
    // rest of February (28 days from midnight, less the 2 h 55 min already gone).
    let forecast = table("month_end_forecast");
    let key = [("team", "vision")];
    let to_date = 0.5 * H100 + 2.0 * (2.0 + 55.0 / 60.0) * A100;
    let hours_left = 28.0 * 24.0 - (2.0 + 55.0 / 60.0);
    assert_usd(
        "vision's burn rate",
        forecast.number(&key, "burn_usd_per_hour"),
        2.0 * A100,
    );
    assert_usd(
        "vision's month-end forecast",
        forecast.number(&key, "forecast_usd"),
        to_date + 2.0 * A100 * hours_left,
    );
    assert_eq!(forecast.row(&key)["status"], "forecast over budget");
    assert_eq!(
        forecast.row(&[("team", "research")])["status"],
        "within budget"
    );

    // Low memory and low utilization: lease-02 (mostly idle, 10 of 80 GiB), lease-04 (~15 %,
    // at most 20 of 80 GiB), lease-05 (~20 %, 12 of 48 GiB); the others are busy or full.
    let rightsizing = table("rightsizing_candidates");
    let mut candidates = rightsizing.column("lease_id");
    candidates.sort_unstable();
    assert_eq!(candidates, ["lease-02", "lease-04", "lease-05"]);

    // lease-02's samples are idle from 23:00 (30 minutes after its grant), and the one at 23:00
    // covers 22:55-23:00: idle 95 minutes up to its reclaim at 00:30.
    let idle = table("idle_waste_by_lease");
    assert_eq!(idle.rows[0]["lease_id"], "lease-02");
    assert_usd(
        "lease-02's idle cost",
        idle.number(&[("lease_id", "lease-02")], "idle_cost_usd"),
        95.0 / 60.0 * H100,
    );

    // Energy: every sample's power over its interval, from the fixture's own lines, is some
    // team's (or unallocated) energy; priced at $0.15 a kWh and 400 g CO2e a kWh
    // (queries/fixture/gpuwarden.toml).
    let energy = table("energy_cost_by_team");
    let drawn: f64 = std::fs::read_to_string(fixture_dir().join("samples.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let s: serde_json::Value = serde_json::from_str(l).unwrap();
            s["power_w"].as_f64().unwrap_or(0.0) * s["interval_ms"].as_f64().unwrap() / 3.6e9
        })
        .sum();
    let kwh: Vec<f64> = energy
        .column("energy_kwh")
        .iter()
        .map(|k| k.parse().unwrap())
        .collect();
    let total: f64 = kwh.iter().sum();
    assert!(
        (total - drawn).abs() <= 0.0005 * kwh.len() as f64,
        "the fixture's GPUs drew {drawn:.4} kWh; the teams' energy adds up to {total}"
    );
    for (i, row) in energy.rows.iter().enumerate() {
        let [cost, co2e] = ["energy_cost_usd", "co2e_kg"].map(|c| row[c].parse::<f64>().unwrap());
        assert!(
            (cost - kwh[i] * 0.15).abs() <= 0.005 + 0.0005 * 0.15,
            "{row:?}"
        );
        assert!(
            (co2e - kwh[i] * 0.4).abs() <= 0.0005 + 0.0005 * 0.4,
            "{row:?}"
        );
    }

    // alice's lease-01: 2 H100s for 4 hours.
    assert_usd(
        "alice's cost",
        table("top_users_by_cost").number(&[("user", "alice")], "cost_usd"),
        2.0 * 4.0 * H100,
    );
}

/// A psql cell and a `gpuwarden sql --format csv` cell say the same thing: equal text, equal
/// numbers (psql prints 0 where Arrow prints 0.0), the same instant (`2026-02-01
/// 02:55:00.000000+00` and `2026-02-01T02:55:00Z`), or the same boolean (`t` and `true`).
fn same_cell(psql: &str, ours: &str) -> bool {
    if psql == ours {
        return true;
    }
    if let (Ok(a), Ok(b)) = (psql.parse::<f64>(), ours.parse::<f64>()) {
        return (a - b).abs() <= 1e-9 * a.abs().max(1.0);
    }
    let instant = |s: &str| -> Option<String> {
        let s = s.replace(' ', "T");
        let s = s
            .strip_suffix("+00")
            .or_else(|| s.strip_suffix('Z'))?
            .to_string();
        let (base, fraction) = s.split_once('.').unwrap_or((&s, ""));
        let fraction = fraction.trim_end_matches('0');
        Some(if fraction.is_empty() {
            base.to_string()
        } else {
            format!("{base}.{fraction}")
        })
    };
    if let (Some(a), Some(b)) = (instant(psql), instant(ours)) {
        return a == b;
    }
    matches!((psql, ours), ("t", "true") | ("f", "false"))
}

#[test]
fn every_query_gives_the_same_rows_through_psql() {
    let dir = tempfile::tempdir().unwrap();
    // Rolled up once at the start: no rewrite of the rollups while psql reads them.
    let config = write_config(
        dir.path(),
        "[[pipeline.sql_users]]\nname = \"finops\"\npassword = \"fixture\"\n",
    );
    let text = std::fs::read_to_string(&config).unwrap().replacen(
        "[pipeline]\n",
        "[pipeline]\nrollup_every = \"1h\"\n",
        1,
    );
    std::fs::write(&config, text).unwrap();
    build_lake(&config);
    let (mut pipeline, port) = start_pipeline_with_sql(&config);
    let psql = Psql::new(port, "finops", Some("fixture"));
    pipeline.wait_for_log("rolled up", Duration::from_secs(60));

    let mut problems = Vec::new();
    for query in query_files() {
        let name = name_of(&query);
        let out = psql
            .command()
            .args(["--csv", "-v", "ON_ERROR_STOP=1", "-f"])
            .arg(&query)
            .output()
            .expect("psql (postgresql-client) is installed");
        if !out.status.success() {
            problems.push(format!(
                "psql -f queries/{name}.sql failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
            continue;
        }
        let theirs = parse_csv(&String::from_utf8(out.stdout).unwrap());
        let ours = gpuwarden(&[
            "sql",
            "--config",
            config.to_str().unwrap(),
            "--format",
            "csv",
            "-f",
            query.to_str().unwrap(),
        ]);
        assert!(ours.status.success(), "queries/{name}.sql failed");
        let ours = parse_csv(&String::from_utf8(ours.stdout).unwrap());
        let same = theirs.len() == ours.len()
            && theirs
                .iter()
                .zip(&ours)
                .all(|(a, b)| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_cell(x, y)));
        if !same {
            problems.push(format!(
                "queries/{name}.sql: psql printed\n{theirs:?}\nwhere gpuwarden sql printed\n\
                 {ours:?}"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

#[test]
fn the_helpers_compare_and_parse_as_documented() {
    assert_eq!(
        parse_csv("a,b\n\"x, \"\"y\"\"\",2\n"),
        [vec!["a", "b"], vec!["x, \"y\"", "2"]]
    );
    assert!(same_cell(
        "2026-02-01 02:55:00.000000+00",
        "2026-02-01T02:55:00Z"
    ));
    assert!(!same_cell("2026-02-01 02:56:00+00", "2026-02-01T02:55:00Z"));
    assert!(same_cell("0", "0.0") && same_cell("t", "true") && !same_cell("1", "2"));
    assert_eq!(diff("a\nb\nc\n", "a\nx\nc\n"), "  a\n- b\n+ x\n  c\n");
    assert!(header_problems("SELECT 1").len() == 1);
    assert_eq!(
        header_problems("-- Question: q\n-- Columns: c\nSELECT 1"),
        ["its header comment has no `Parameters:` line"]
    );
}
