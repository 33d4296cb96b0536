//! The Grafana dashboards of `dashboards/` run as Grafana runs them, against `gpuwarden demo`.
//!
//! Every SQL panel: its template variables (query variables run first, through psql) and
//! Grafana's PostgreSQL macros are expanded exactly as Grafana's frontend and its PostgreSQL data
//! source do (ported in tests/support/grafana.rs from `templateSrv`, `SqlDatasource.interpolateVariable`,
//! `rangeutil.calculateInterval`, and `pkg/tsdb/grafana-postgresql-datasource/macros.go` with
//! `sqleng.Interpolate`), over the demo data's event-time span, then run through psql against
//! the demo's SQL endpoint; an error, no rows, only nulls, or a time series Grafana could not
//! read (no `time` column, time not ascending) fails, naming the dashboard, the panel and the SQL
//! as sent. Every Prometheus panel: its PromQL, expanded as Grafana's Prometheus data source does
//! (`$__rate_interval` and the rest), runs on a real Prometheus scraping the demo's three
//! `/metrics`; an error or an empty result fails, and so does a metric name the demo does not
//! expose. The provisioning files must name the data sources the dashboards use, at the
//! addresses the demo listens on by default, and `promtool` must accept the scrape config.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::grafana::{
    calculate_interval, check_answer, expand_promql, expand_sql, go_duration, interval_to_ms,
    panels, parse_label_values, resolution, rfc3339_nano, seconds_to_hms, sql_global, sql_macros,
    target_uid, targets_on, template_replace, text, uses, variable_from, yaml_items, yaml_value,
    Flavor, Range, Selection, Variable,
};
use support::prometheus::{promql_metric_names, Prometheus};
use support::{eventually, http_get, Demo, Psql};

const SQL_UID: &str = "gpuwarden-sql";
const SQL_TYPE: &str = "grafana-postgresql-datasource";
const PROM_UID: &str = "gpuwarden-prometheus";
const PROM_TYPE: &str = "prometheus";
const DASHBOARDS: [&str; 3] = [
    "finops-chargeback.json",
    "fleet-health.json",
    "leadership-overview.json",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A dashboard of dashboards/grafana: its file name and its JSON.
struct Dashboard {
    file: String,
    json: Value,
}

/// Every dashboard of dashboards/grafana; the three of `DASHBOARDS` must be among them.
fn dashboards() -> Vec<Dashboard> {
    let dir = repo().join("dashboards/grafana");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".json"))
        .collect();
    files.sort();
    for expected in DASHBOARDS {
        assert!(
            files.iter().any(|f| f == expected),
            "{expected} in {files:?}"
        );
    }
    files
        .into_iter()
        .map(|file| {
            let text = read(&dir.join(&file));
            let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
            Dashboard { file, json }
        })
        .collect()
}

/// Structure, data sources and provisioning, without running anything but promtool and
/// `gpuwarden demo --help`.
#[test]
fn dashboards_and_provisioning_name_the_same_data_sources_at_the_demo_addresses() {
    let datasources = read(&repo().join("dashboards/provisioning/datasources/gpuwarden.yaml"));
    let items = yaml_items(&datasources);
    let item = |uid: &str| {
        items
            .iter()
            .find(|i| i.get("uid").map(String::as_str) == Some(uid))
            .unwrap_or_else(|| panic!("no data source with uid {uid} in {items:#?}"))
    };
    let (sql, prom) = (item(SQL_UID), item(PROM_UID));
    for (key, value) in [
        ("type", SQL_TYPE),
        ("url", "127.0.0.1:5433"),
        ("user", "${GPUWARDEN_SQL_USER}"),
        ("password", "${GPUWARDEN_SQL_PASSWORD}"),
        ("database", "gpuwarden"),
        ("sslmode", "disable"),
    ] {
        assert_eq!(
            sql.get(key).map(String::as_str),
            Some(value),
            "{key} of {sql:#?}"
        );
    }
    assert_eq!(
        prom.get("type").map(String::as_str),
        Some(PROM_TYPE),
        "{prom:#?}"
    );
    assert_eq!(
        prom.get("url").map(String::as_str),
        Some("http://127.0.0.1:9090"),
        "{prom:#?}"
    );
    // $__rate_interval counts on the data source's scrape interval being Prometheus's.
    let scrape = read(&repo().join("dashboards/prometheus.yml"));
    assert_eq!(
        prom.get("timeInterval").cloned(),
        yaml_value(&scrape, "scrape_interval"),
        "the Prometheus data source's timeInterval is the scrape interval of dashboards/prometheus.yml"
    );

    let providers = yaml_items(&read(
        &repo().join("dashboards/provisioning/dashboards/gpuwarden.yaml"),
    ));
    assert_eq!(providers.len(), 1, "{providers:#?}");
    assert_eq!(providers[0].get("type").map(String::as_str), Some("file"));
    let path = providers[0]
        .get("path")
        .expect("the provider's options.path");
    let readme = read(&repo().join("dashboards/README.md"));
    assert!(
        readme.contains(&format!("dashboards/grafana:{path}")),
        "dashboards/README.md mounts dashboards/grafana at the provider's path {path}"
    );
    assert!(readme.contains("dashboards/provisioning:/etc/grafana/provisioning"));

    // The addresses in the provisioning files are where `gpuwarden demo` listens by default.
    let help = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["demo", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for address in [
        "127.0.0.1:5433",
        "127.0.0.1:9400",
        "127.0.0.1:9401",
        "127.0.0.1:8080",
    ] {
        assert!(
            help.contains(&format!("[default: {address}]")),
            "{address} in\n{help}"
        );
        if address != "127.0.0.1:5433" {
            assert!(
                scrape.contains(&format!("\"{address}\"")),
                "{address} in prometheus.yml"
            );
        }
    }
    let out = Command::new("promtool")
        .args(["check", "config"])
        .arg(repo().join("dashboards/prometheus.yml"))
        .output()
        .expect("promtool (Debian package prometheus) is installed");
    assert!(
        out.status.success(),
        "promtool check config dashboards/prometheus.yml:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let mut uids = BTreeSet::new();
    for Dashboard { file, json } in dashboards() {
        assert!(
            uids.insert(text(&json["uid"], "uid").to_string()),
            "{file}: uid taken"
        );
        assert!(
            json["title"].as_str().is_some_and(|t| !t.is_empty()),
            "{file}: title"
        );
        assert!(
            json["schemaVersion"].as_i64().is_some_and(|v| v >= 36),
            "{file}: schemaVersion"
        );
        assert_eq!(json["time"]["from"], "now-24h", "{file}");
        assert_eq!(json["time"]["to"], "now", "{file}");
        let mut ids = BTreeSet::new();
        let mut titles = BTreeSet::new();
        let mut cells = BTreeMap::new();
        for panel in json["panels"].as_array().unwrap() {
            let grid = &panel["gridPos"];
            let (x, w) = (grid["x"].as_i64().unwrap(), grid["w"].as_i64().unwrap());
            let (y, h) = (grid["y"].as_i64().unwrap(), grid["h"].as_i64().unwrap());
            for cell in (x..x + w).flat_map(|x| (y..y + h).map(move |y| (x, y))) {
                if let Some(other) = cells.insert(cell, &panel["title"]) {
                    panic!("{file}: {} overlaps {other} at {cell:?}", panel["title"]);
                }
            }
            assert!(
                x >= 0 && w > 0 && x + w <= 24,
                "{file}: {} gridPos {grid}",
                panel["title"]
            );
            assert!(
                ids.insert(panel["id"].as_i64().unwrap()),
                "{file}: panel id {} twice",
                panel["id"]
            );
        }
        for panel in panels(&json) {
            let title = text(&panel["title"], "title");
            assert!(titles.insert(title), "{file}: two panels titled {title:?}");
            assert!(
                panel["description"].as_str().is_some_and(|d| !d.is_empty()),
                "{file}: {title}: a description says what the panel measures"
            );
            let targets = panel["targets"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default();
            assert!(!targets.is_empty(), "{file}: {title}: no query");
            let mut refs = BTreeSet::new();
            for target in targets {
                assert!(
                    refs.insert(text(&target["refId"], "refId")),
                    "{file}: {title}: refId twice"
                );
                let uid = target_uid(panel, target);
                let kind = target["datasource"]["type"]
                    .as_str()
                    .or(panel["datasource"]["type"].as_str());
                match uid {
                    SQL_UID => {
                        assert_eq!(kind, Some(SQL_TYPE), "{file}: {title}");
                        let sql = text(&target["rawSql"], "rawSql");
                        assert!(target["rawQuery"] == true, "{file}: {title}: rawQuery");
                        assert!(
                            matches!(target["format"].as_str(), Some("table" | "time_series")),
                            "{file}: {title}: format"
                        );
                        // Grafana 12 strips SQL comments before the macros; without any, every
                        // version sends the same SQL.
                        assert!(
                            !sql.contains("--") && !sql.contains("/*"),
                            "{file}: {title}: a comment in the SQL"
                        );
                    }
                    PROM_UID => {
                        assert_eq!(kind, Some(PROM_TYPE), "{file}: {title}");
                        text(&target["expr"], "expr");
                    }
                    other => panic!("{file}: {title}: data source {other:?} is not provisioned"),
                }
            }
        }
        for variable in json["templating"]["list"].as_array().into_iter().flatten() {
            let uid = text(&variable["datasource"]["uid"], "variable data source");
            assert!(
                uid == SQL_UID || uid == PROM_UID,
                "{file}: variable {}",
                variable["name"]
            );
        }
    }
}

/// The expansions against the cases of Grafana's own tests (macros_test.go, rangeutil).
#[test]
fn macros_and_variables_expand_as_grafana_expands_them() {
    // 2018-04-12T18:00:00Z to 18:05:00Z, as in Grafana's macros_test.go.
    let range = Range {
        from_ms: 1_523_556_000_000,
        to_ms: 1_523_556_300_000,
    };
    let m = |sql: &str| sql_macros(sql, range).unwrap();
    assert_eq!(
        m("select $__time(time_column)"),
        "select time_column AS \"time\""
    );
    assert_eq!(
        m("select min($__time(time_column))"),
        "select min(time_column AS \"time\")"
    );
    assert_eq!(
        m("WHERE $__timeFilter(time_column)"),
        "WHERE time_column BETWEEN '2018-04-12T18:00:00Z' AND '2018-04-12T18:05:00Z'"
    );
    assert_eq!(m("select $__timeFrom()"), "select '2018-04-12T18:00:00Z'");
    assert_eq!(m("select $__timeTo()"), "select '2018-04-12T18:05:00Z'");
    assert_eq!(
        m("SELECT $__timeGroup(time_column,'5m'), value"),
        "SELECT floor(extract(epoch from time_column)/300)*300 AS \"time\", value"
    );
    assert_eq!(
        m("SELECT $__timeGroup(time_column,'5m') as time, value"),
        "SELECT floor(extract(epoch from time_column)/300)*300 as time, value"
    );
    assert_eq!(
        m("SELECT $__timeGroup(time_column,'5m')"),
        "SELECT floor(extract(epoch from time_column)/300)*300"
    );
    assert_eq!(
        m("$__timeGroupAlias(time_column , '5m')"),
        "floor(extract(epoch from time_column)/300)*300 AS \"time\""
    );
    assert_eq!(
        m("$__timeGroupAlias(hour, 1h, 0)"),
        "floor(extract(epoch from hour)/3600)*3600 AS \"time\""
    );
    assert_eq!(
        m("$__timeGroup(hour, 30d)"),
        "floor(extract(epoch from hour)/2.592e+06)*2.592e+06"
    );
    assert_eq!(
        m("$__timeGroup(ts, 500ms, NULL)"),
        "floor(extract(epoch from ts)/0.5)*0.5"
    );
    assert!(sql_macros("$__timeGroup(ts, 1h, nothing)", range).is_err());
    assert!(sql_macros("$__timeGroup(ts)", range).is_err());
    assert!(sql_macros("$__nope(ts)", range).is_err());
    assert_eq!(
        m("select $__unixEpochFilter(time)"),
        "select time >= 1523556000 AND time <= 1523556300"
    );
    assert_eq!(
        m("SELECT $__unixEpochGroup(time_column+time_adjustment,'5m')"),
        "SELECT floor((time_column+time_adjustment)/300)*300"
    );
    assert_eq!(
        m("select $__unixEpochNanoFrom()"),
        "select 1523556000000000000"
    );
    // The arguments end at the first ')': a function call inside a macro breaks it, as in Grafana.
    assert_eq!(
        m("WHERE $__timeFilter(to_timestamp_millis(ts_ms))"),
        "WHERE to_timestamp_millis(ts_ms BETWEEN '2018-04-12T18:00:00Z' AND '2018-04-12T18:05:00Z')"
    );
    assert_eq!(rfc3339_nano(1_523_556_000_500), "2018-04-12T18:00:00.5Z");
    assert_eq!(
        sql_global(
            "$__interval_ms $__interval $__unixEpochFrom()",
            600_000,
            range
        ),
        "600000 10m 1523556000"
    );

    // rangeutil: 24 h over 1920 points is 45 s → 1m; 6 h over 960 → 22.5 s → 20s, raised to 1m.
    let day = Range {
        from_ms: 0,
        to_ms: 86_400_000,
    };
    assert_eq!(
        calculate_interval(day, 1920.0, "1ms"),
        (60_000, "1m".into())
    );
    assert_eq!(
        calculate_interval(day, 960.0, "15s"),
        (120_000, "2m".into())
    );
    assert_eq!(
        calculate_interval(day, 960.0, "1h"),
        (3_600_000, "1h".into())
    );
    assert_eq!(seconds_to_hms(0.5), "500ms");
    assert_eq!(seconds_to_hms(90.0), "1m");
    assert_eq!(go_duration(135_000), "2m15s");
    assert_eq!(go_duration(60_000), "1m0s");
    assert_eq!(go_duration(3_600_000), "1h0m0s");

    // Variables as the PostgreSQL data source and the Prometheus one format them.
    let team = Variable {
        name: "team".into(),
        multi: true,
        include_all: true,
        all_value: None,
        options: vec!["a".into(), "o'b".into()],
        selected: None,
    };
    let one = Variable {
        selected: Some(vec!["a".into()]),
        ..team.clone()
    };
    let single = Variable {
        name: "s".into(),
        multi: false,
        include_all: false,
        all_value: None,
        options: vec!["x.y".into()],
        selected: Some(vec!["x.y".into()]),
    };
    let vars = [team.clone(), single.clone()];
    let sql = |t: &str| template_replace(t, &vars, &[], Flavor::Sql).unwrap();
    assert_eq!(sql("team IN ($team)"), "team IN ('a','o''b')");
    assert_eq!(sql("team IN (${team})"), "team IN ('a','o''b')");
    assert_eq!(sql("team IN ([[team]])"), "team IN ('a','o''b')");
    assert_eq!(sql("${team:csv}|${team:sqlstring}"), "a,o'b|'a','o''b'");
    assert_eq!(
        sql("$s $__timeFilter(x) $teams"),
        "x.y $__timeFilter(x) $teams"
    );
    let sql_one =
        template_replace("IN ($team)", std::slice::from_ref(&one), &[], Flavor::Sql).unwrap();
    assert_eq!(sql_one, "IN ('a')");
    let prom =
        |vars: &[Variable], t: &str| template_replace(t, vars, &[], Flavor::Prometheus).unwrap();
    assert_eq!(
        prom(std::slice::from_ref(&team), "{t=~\"$team\"}"),
        "{t=~\"(a|o\\\\'b)\"}"
    );
    assert_eq!(prom(&[one], "{t=~\"$team\"}"), "{t=~\"a\"}");
    assert_eq!(prom(&[single], "{t=~\"$s\"}"), "{t=~\"x.y\"}");
    let all = Variable {
        all_value: Some(".*".into()),
        ..team
    };
    assert_eq!(prom(&[all], "{t=~\"$team\"}"), "{t=~\".*\"}");
    assert_eq!(
        expand_promql(
            "rate(x[$__rate_interval]) $__interval ${__range}",
            &[],
            day,
            120_000,
            15_000
        )
        .unwrap(),
        "rate(x[2m15s]) 2m 86400s"
    );

    assert_eq!(
        promql_metric_names(
            "histogram_quantile(0.99, sum by (le) (rate(a_bucket{x=\"y\"}[5m]))) / on (i) group_left(j) b or vector(0) > bool 1e3"
        ),
        ["a_bucket", "b"].into_iter().map(String::from).collect()
    );
    assert_eq!(
        parse_label_values("label_values(m{h=~\"$h\"}, modelName)").unwrap(),
        (Some("m{h=~\"$h\"}".into()), "modelName".into())
    );
}

#[test]
fn every_panel_answers_on_demo_data_through_psql_and_a_real_prometheus() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(&dir.path().join("demo"));
    let psql = Psql::new(demo.sql_port, "demo", Some("demo"));
    let count = |sql: &str| psql.number_or_zero(sql);

    // Prometheus scrapes the demo with dashboards/prometheus.yml, its addresses the demo's.
    let mut scrape = read(&repo().join("dashboards/prometheus.yml"));
    let default_address = |job: &str| match job {
        "gpuwarden-collector" => "127.0.0.1:9400",
        "gpuwarden-pipeline" => "127.0.0.1:9401",
        _ => "127.0.0.1:8080",
    };
    for (job, address) in &demo.metrics {
        let default = format!("\"{}\"", default_address(job));
        assert_eq!(
            scrape.matches(&default).count(),
            1,
            "{default} once in prometheus.yml"
        );
        scrape = scrape.replace(&default, &format!("\"{address}\""));
    }
    let scrape_interval = yaml_value(&scrape, "scrape_interval").expect("a global scrape_interval");
    let scrape = scrape.replace(
        &format!("scrape_interval: {scrape_interval}"),
        "scrape_interval: 1s",
    );
    let scrape_ms = interval_to_ms(&scrape_interval).unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(&config, &scrape).unwrap();
    let check = Command::new("promtool")
        .args(["check", "config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let prometheus = Prometheus::start(&config, dir.path());

    // The demo's data: rollups, a lease's hours, an idle reclaim.
    let seen = eventually(
        "team_hourly hours (2), lease_hourly and focus_costs rows, idle reclaims",
        Duration::from_secs(180),
        || {
            let seen = (
                count("SELECT count(DISTINCT hour) FROM team_hourly"),
                count("SELECT count(*) FROM lease_hourly WHERE lease_id IS NOT NULL"),
                count("SELECT count(*) FROM focus_costs"),
                count("SELECT count(*) FROM actions WHERE action = 'reclaim' AND reason = 'idle' AND outcome = 'ok'"),
            );
            if seen.0 >= 2 && seen.1 > 0 && seen.2 > 0 && seen.3 > 0 {
                Ok(seen)
            } else {
                Err(format!("{seen:?}"))
            }
        },
    );
    eprintln!(
        "demo data after {:.0} s: {seen:?} (team_hourly hours, lease_hourly, focus_costs rows, idle reclaims)",
        started.elapsed().as_secs_f64()
    );
    // The dashboards' time range is the demo's event time: from its first hour to the end of
    // its last (the demo runs an hour a minute, from a day ago).
    let span = psql
        .answer(
        "SELECT CAST(extract(epoch from min(hour)) AS BIGINT), CAST(extract(epoch from max(hour)) AS BIGINT) FROM team_hourly",
    )
    .unwrap();
    let seconds = |i: usize| span.rows[0][i].as_deref().unwrap().parse::<i64>().unwrap();
    let sql_range = Range {
        from_ms: seconds(0) * 1000,
        to_ms: (seconds(1) + 3600) * 1000,
    };
    eprintln!(
        "time range {} to {}",
        rfc3339_nano(sql_range.from_ms),
        rfc3339_nano(sql_range.to_ms)
    );

    let mut failures = Vec::new();
    let mut notes = Vec::new();
    let (mut sql_runs, mut sql_rows) = (0, 0);
    let sql_started = Instant::now();
    let boards = dashboards();
    for Dashboard { file, json } in boards.iter().filter(|d| uses(&d.json, SQL_UID)) {
        let has_variables = json["templating"]["list"]
            .as_array()
            .is_some_and(|l| !l.is_empty());
        // Each variable's last option, with the demo's data, is team research on its H100s and
        // host l40s-0, which have data in every panel; the first, team (unallocated), holds no
        // lease.
        let selections: &[Selection] = if has_variables {
            &[Selection::Default, Selection::Last]
        } else {
            &[Selection::Default]
        };
        for &selection in selections {
            // Query variables first, each with the ones before it.
            let mut variables: Vec<Variable> = Vec::new();
            for var in json["templating"]["list"].as_array().into_iter().flatten() {
                let name = text(&var["name"], "variable name");
                assert_eq!(
                    var["type"], "query",
                    "{file}: variable {name}: only query variables"
                );
                let query = var["query"]
                    .as_str()
                    .or(var["query"]["rawSql"].as_str())
                    .or(var["query"]["query"].as_str())
                    .unwrap_or_else(|| panic!("{file}: variable {name}: no query"));
                let interval = calculate_interval(sql_range, 1000.0, "1m");
                let sql = expand_sql(query, &variables, sql_range, (interval.0, &interval.1))
                    .unwrap_or_else(|e| panic!("{file}: variable {name}: {e}\n{query}"));
                let answer = retry(
                    &format!("{file}: variable {name}"),
                    || psql.answer(&sql),
                    &mut notes,
                )
                .unwrap_or_else(|e| panic!("{file}: variable {name}: {e}\n{sql}"));
                let column = answer
                    .columns
                    .iter()
                    .position(|c| c == "__value")
                    .unwrap_or(0);
                assert!(
                    answer.columns.len() == 1 || answer.columns.iter().any(|c| c == "__value"),
                    "{file}: variable {name}: Grafana offers every cell of {:?} as an option",
                    answer.columns
                );
                let options: Vec<String> = answer
                    .rows
                    .iter()
                    .filter_map(|r| r[column].clone())
                    .collect();
                assert!(
                    !options.is_empty(),
                    "{file}: variable {name} has no options:\n{sql}"
                );
                eprintln!("{file}: variable {name} ({selection:?}): {options:?}");
                variables.push(variable_from(var, options, selection));
            }
            for (what, panel, target) in targets_on(file, json, SQL_UID, selection) {
                let low = panel["interval"].as_str().unwrap_or("1m");
                let interval = calculate_interval(sql_range, resolution(panel), low);
                let raw = text(&target["rawSql"], "rawSql");
                let sql = match expand_sql(raw, &variables, sql_range, (interval.0, &interval.1)) {
                    Ok(sql) => sql,
                    Err(e) => {
                        failures.push(format!("{what}: Grafana cannot expand it: {e}\n{raw}"));
                        continue;
                    }
                };
                let time_series = target["format"] == "time_series";
                let began = Instant::now();
                let result = retry(
                    &what,
                    || check_answer(psql.answer(&sql)?, time_series),
                    &mut notes,
                );
                sql_runs += 1;
                match result {
                    Ok((rows, first)) => {
                        sql_rows += rows;
                        let ms = began.elapsed().as_millis();
                        eprintln!("{what}: {rows} rows in {ms} ms; first: {first}");
                    }
                    Err(e) => failures.push(format!(
                        "{what}: {e}\n--- SQL as Grafana sends it ---\n{sql}\n"
                    )),
                }
            }
        }
    }
    let sql_seconds = sql_started.elapsed().as_secs_f64();

    // Prometheus: every metric a panel names must be exposed by the demo, every query answer.
    let exposed: BTreeSet<String> = demo
        .metrics
        .iter()
        .flat_map(|(_, address)| {
            let (status, body) = http_get(address, "/metrics");
            assert_eq!(status, 200, "{address}/metrics");
            body.lines()
                .filter_map(|line| {
                    if let Some(rest) = line
                        .strip_prefix("# HELP ")
                        .or(line.strip_prefix("# TYPE "))
                    {
                        rest.split_whitespace().next().map(String::from)
                    } else if line.starts_with('#') || line.is_empty() {
                        None
                    } else {
                        line.split(['{', ' ']).next().map(String::from)
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect();
    // Prometheus's own series about each scrape.
    let synthetic = [
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_series_added",
    ];
    // Every target up, and a few scrapes behind each, so that rate() has points.
    eventually(
        "Prometheus: the demo's 3 targets up and scraped 5 times",
        Duration::from_secs(60),
        || match prometheus.query("count_over_time(up{job=~\"gpuwarden-.*\"}[1m]) >= 5 and up == 1")
        {
            Ok((_, 3)) => Ok(()),
            up => Err(format!("{up:?}\n{}", prometheus.log())),
        },
    );
    let prom_range = Range {
        from_ms: 0,
        to_ms: 86_400_000,
    };
    let (mut prom_runs, mut prom_series) = (0, 0);
    let mut names_checked = BTreeSet::new();
    for Dashboard { file, json } in boards.iter().filter(|d| uses(&d.json, PROM_UID)) {
        for selection in [Selection::Default, Selection::Last] {
            let mut variables: Vec<Variable> = Vec::new();
            for var in json["templating"]["list"].as_array().into_iter().flatten() {
                let name = text(&var["name"], "variable name");
                let query = var["query"]
                    .as_str()
                    .or(var["query"]["query"].as_str())
                    .unwrap_or_else(|| panic!("{file}: variable {name}: no query"));
                let query = template_replace(query, &variables, &[], Flavor::Prometheus).unwrap();
                let (selector, label) =
                    parse_label_values(&query).unwrap_or_else(|e| panic!("{file}: {e}"));
                for metric in selector.iter().flat_map(|s| promql_metric_names(s)) {
                    if !exposed.contains(&metric) {
                        failures.push(format!(
                            "{file}: variable {name}: the demo exposes no metric {metric}"
                        ));
                    }
                }
                let options = prometheus
                    .label_values(&label, selector.as_deref())
                    .unwrap_or_else(|e| panic!("{file}: variable {name}: {e}\n{query}"));
                assert!(
                    !options.is_empty(),
                    "{file}: variable {name} has no options: {query}"
                );
                eprintln!("{file}: variable {name} ({selection:?}): {options:?}");
                variables.push(variable_from(var, options, selection));
            }
            for (what, panel, target) in targets_on(file, json, PROM_UID, selection) {
                let raw = text(&target["expr"], "expr");
                for metric in promql_metric_names(raw) {
                    names_checked.insert(metric.clone());
                    if !exposed.contains(&metric) && !synthetic.contains(&metric.as_str()) {
                        failures.push(format!(
                            "{what}: the demo exposes no metric {metric}\n{raw}"
                        ));
                    }
                }
                let low = panel["interval"].as_str().unwrap_or(&scrape_interval);
                let (interval_ms, _) = calculate_interval(prom_range, resolution(panel), low);
                let expr = match expand_promql(raw, &variables, prom_range, interval_ms, scrape_ms)
                {
                    Ok(expr) => expr,
                    Err(e) => {
                        failures.push(format!("{what}: {e}\n{raw}"));
                        continue;
                    }
                };
                prom_runs += 1;
                match prometheus.query(&expr) {
                    Ok((_, 0)) => failures.push(format!("{what}: no series\n{expr}\n")),
                    Ok((kind, n)) => {
                        prom_series += n;
                        eprintln!("{what}: {n} {kind} series");
                    }
                    Err(e) => failures.push(format!("{what}: {e}\n{expr}\n")),
                }
            }
        }
    }
    for note in &notes {
        eprintln!("retried: {note}");
    }
    eprintln!(
        "{sql_runs} SQL queries ({sql_rows} rows) in {sql_seconds:.1} s; {prom_runs} PromQL queries \
         ({prom_series} series); {} metric names checked; {} retries; {:.0} s in all",
        names_checked.len(),
        notes.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} failing panel queries:\n\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        sql_runs >= 20 && prom_runs >= 20,
        "{sql_runs} SQL and {prom_runs} PromQL queries"
    );

    drop(prometheus);
    let (status, log) = demo.process.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));
}

/// Runs `attempt` again, up to 4 times over 10 s, when it finds nothing yet (the demo keeps
/// rolling up); any error fails at once. Each retry is noted.
fn retry<T>(
    what: &str,
    mut attempt: impl FnMut() -> Result<T, String>,
    notes: &mut Vec<String>,
) -> Result<T, String> {
    let mut tries = 0;
    loop {
        match attempt() {
            Ok(value) => return Ok(value),
            Err(e) if tries < 4 && (e == "no rows" || e.starts_with("only nulls")) => {
                notes.push(format!("{what}: {}", e.lines().next().unwrap_or_default()));
                tries += 1;
                std::thread::sleep(Duration::from_secs(tries));
            }
            Err(e) => return Err(e),
        }
    }
}
