//! The Grafana dashboards of `dashboards/` run as Grafana runs them, against `gpuwarden demo`.
//!
//! Every SQL panel: its template variables (query variables run first, through psql) and
//! Grafana's PostgreSQL macros are expanded exactly as Grafana's frontend and its PostgreSQL data
//! source do (ported below from `templateSrv`, `SqlDatasource.interpolateVariable`,
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
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, UNIX_EPOCH};

use serde_json::Value;
use support::{http_get, psql, status_and_body, Demo};

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

// ------------------------------------------------------------------------------------------
// Dashboards

struct Dashboard {
    file: String,
    json: Value,
}

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

/// Every panel that is not a row, rows' nested panels included, in layout order.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        if panel["type"] == "row" {
            out.extend(panel["panels"].as_array().into_iter().flatten());
        } else {
            out.push(panel);
        }
    }
    out
}

fn text<'a>(value: &'a Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {value}"))
}

/// The data source uid a target runs on: its own, else its panel's.
/// Every target of `dashboard` on the data source `uid`, with its panel and the name failures
/// give it: `file › panel title [refId]`, and which variable values it ran with.
fn targets_on<'a>(
    file: &str,
    dashboard: &'a Value,
    uid: &str,
    selection: Selection,
) -> Vec<(String, &'a Value, &'a Value)> {
    let mut out = Vec::new();
    for panel in panels(dashboard) {
        let title = text(&panel["title"], "title");
        for target in panel["targets"].as_array().into_iter().flatten() {
            if target_uid(panel, target) != uid {
                continue;
            }
            let what = format!(
                "{file} › {title} [{}]{}",
                target["refId"].as_str().unwrap_or("?"),
                if selection == Selection::Last {
                    " (each variable's last value)"
                } else {
                    ""
                }
            );
            out.push((what, panel, target));
        }
    }
    out
}

fn target_uid<'a>(panel: &'a Value, target: &'a Value) -> &'a str {
    target["datasource"]["uid"]
        .as_str()
        .or_else(|| panel["datasource"]["uid"].as_str())
        .unwrap_or_else(|| panic!("no data source for {target} in {}", panel["title"]))
}

// ------------------------------------------------------------------------------------------
// Time and intervals, as Grafana computes them

#[derive(Clone, Copy, Debug)]
struct Range {
    from_ms: i64,
    to_ms: i64,
}

/// Go's `time.RFC3339Nano` in UTC: trailing zeros of the fraction (and a bare dot) dropped.
fn rfc3339_nano(ms: i64) -> String {
    let time = UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap());
    let full = humantime::format_rfc3339_nanos(time).to_string();
    let (stamp, _) = full.split_once('Z').unwrap();
    let stamp = stamp.trim_end_matches('0').trim_end_matches('.');
    format!("{stamp}Z")
}

/// `rangeutil.roundInterval` of @grafana/data, in milliseconds.
fn round_interval(ms: f64) -> i64 {
    const LADDER: [(f64, i64); 30] = [
        (10.0, 1),
        (15.0, 10),
        (35.0, 20),
        (75.0, 50),
        (150.0, 100),
        (350.0, 200),
        (750.0, 500),
        (1500.0, 1000),
        (3500.0, 2000),
        (7500.0, 5000),
        (12500.0, 10000),
        (17500.0, 15000),
        (25000.0, 20000),
        (45000.0, 30000),
        (90000.0, 60000),
        (210000.0, 120000),
        (450000.0, 300000),
        (750000.0, 600000),
        (1050000.0, 900000),
        (1500000.0, 1200000),
        (2700000.0, 1800000),
        (5400000.0, 3600000),
        (9000000.0, 7200000),
        (16200000.0, 10800000),
        (32400000.0, 21600000),
        (86400000.0, 43200000),
        (604800000.0, 86400000),
        (1814400000.0, 604800000),
        (3628800000.0, 2592000000),
        (f64::INFINITY, 31536000000),
    ];
    LADDER.iter().find(|(below, _)| ms < *below).unwrap().1
}

/// `rangeutil.describeInterval` → milliseconds: `30s`, `1h`, `2d`, a bare number of seconds.
fn interval_to_ms(text: &str) -> Result<i64, String> {
    if let Ok(seconds) = text.parse::<i64>() {
        return Ok(seconds * 1000);
    }
    let digits: String = text.chars().take_while(|c| c.is_ascii_digit()).collect();
    let count: i64 = digits
        .parse()
        .map_err(|_| format!("invalid interval {text:?}"))?;
    let unit_ms = match &text[digits.len()..] {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "w" => 604_800_000,
        "M" => 2_592_000_000,
        "y" => 31_536_000_000,
        _ => return Err(format!("invalid interval {text:?}")),
    };
    Ok(count * unit_ms)
}

/// `rangeutil.secondsToHms`: the largest whole unit only.
fn seconds_to_hms(seconds: f64) -> String {
    let s = seconds.floor() as i64;
    let parts = [
        (s / 31_536_000, "y"),
        (s % 31_536_000 / 86_400, "d"),
        (s % 86_400 / 3_600, "h"),
        (s % 3_600 / 60, "m"),
        (s % 60, "s"),
    ];
    if let Some((n, unit)) = parts.iter().find(|(n, _)| *n > 0) {
        return format!("{n}{unit}");
    }
    let ms = (seconds * 1000.0).floor() as i64;
    if ms > 0 {
        format!("{ms}ms")
    } else {
        "less than a millisecond".into()
    }
}

/// `rangeutil.calculateInterval`: range / resolution, rounded, at least the lower limit.
fn calculate_interval(range: Range, resolution: f64, low_limit: &str) -> (i64, String) {
    let low = interval_to_ms(low_limit).unwrap_or_else(|e| panic!("{e}"));
    let ms = round_interval((range.to_ms - range.from_ms) as f64 / resolution).max(low);
    (ms, seconds_to_hms(ms as f64 / 1000.0))
}

/// Grafana sizes a query by the panel's width in pixels (or its maxDataPoints): a 24-column
/// grid on a 1920-pixel screen.
fn resolution(panel: &Value) -> f64 {
    panel["maxDataPoints"]
        .as_f64()
        .unwrap_or_else(|| panel["gridPos"]["w"].as_f64().unwrap_or(24.0) * 80.0)
}

/// Go's `%v` of a float64 (as macros.go prints interval seconds): the shortest digits, in `%e`
/// form when the exponent is under -4 or at least 6 (`2.592e+06`).
fn go_float(value: f64) -> String {
    let e = format!("{value:e}");
    let (mantissa, exponent) = e.split_once('e').unwrap();
    let exponent: i32 = exponent.parse().unwrap();
    if !(-4..6).contains(&exponent) {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    } else {
        format!("{value}")
    }
}

/// `gtime.ParseInterval`: `5m`, `'1h'` (quotes trimmed), `2d`, `1w`, `1y`, or a Go duration
/// (`1h30m`, `500ms`).
fn parse_go_interval(text: &str) -> Result<f64, String> {
    let text = text.trim_matches('\'');
    let err = || format!("error parsing interval {text}");
    for (suffix, seconds) in [("d", 86_400.0), ("w", 604_800.0), ("y", 31_536_000.0)] {
        if let Some(n) = text.strip_suffix(suffix) {
            if let Ok(n) = n.parse::<i64>() {
                return Ok(n as f64 * seconds);
            }
        }
    }
    // A Go duration: one or more <number><unit>.
    let mut rest = text;
    let mut total = 0.0;
    if rest.is_empty() {
        return Err(err());
    }
    while !rest.is_empty() {
        let number: String = rest
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        rest = &rest[number.len()..];
        let unit: String = rest.chars().take_while(|c| c.is_alphabetic()).collect();
        rest = &rest[unit.len()..];
        let n: f64 = number.parse().map_err(|_| err())?;
        let scale = match unit.as_str() {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(err()),
        };
        total += n * scale;
    }
    Ok(total)
}

/// `gtime.FormatInterval` (the backend's `$__interval`).
fn go_format_interval(ms: i64) -> String {
    for (unit, name) in [
        (31_536_000_000, "y"),
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
        (1, "ms"),
    ] {
        if ms >= unit {
            return format!("{}{name}", ms / unit);
        }
    }
    "1ms".into()
}

/// Go's `time.Duration.String()` for a whole number of milliseconds: `2m15s`, `1m0s`, `500ms`.
fn go_duration(ms: i64) -> String {
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m) = (ms / 3_600_000, ms / 60_000 % 60);
    let s = (ms % 60_000) as f64 / 1000.0;
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m{s}s"),
    }
}

// ------------------------------------------------------------------------------------------
// Template variables, as Grafana's templateSrv replaces them

#[derive(Clone, Debug)]
struct Variable {
    name: String,
    multi: bool,
    include_all: bool,
    all_value: Option<String>,
    options: Vec<String>,
    /// `None`: "All" is selected.
    selected: Option<Vec<String>>,
}

impl Variable {
    fn values(&self) -> Vec<String> {
        self.selected
            .clone()
            .unwrap_or_else(|| self.options.clone())
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Flavor {
    Sql,
    Prometheus,
}

/// `SqlDatasource.quoteLiteral`.
fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// `prometheusSpecialRegexEscape` of the Prometheus data source.
fn prom_regex_escape(value: &str) -> String {
    let mut out = String::new();
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\\\\\"),
            '$' | '^' | '*' | '{' | '}' | '[' | ']' | '\'' | '+' | '?' | '.' | '(' | ')' | '|' => {
                out.push_str("\\\\");
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    out
}

/// One variable's value as text: with a `:format` as templateSrv's format registry writes it,
/// without one as the data source's `interpolateVariable` does.
fn format_variable(
    variable: &Variable,
    format: Option<&str>,
    flavor: Flavor,
) -> Result<String, String> {
    if variable.selected.is_none() {
        if let Some(all) = &variable.all_value {
            // templateSrv inserts a custom all value as it is, whatever the format.
            return Ok(all.clone());
        }
    }
    let values = variable.values();
    // A multi-value or include-all variable's value is an array, even of one.
    let array = variable.multi || variable.include_all;
    Ok(match format {
        None if flavor == Flavor::Sql => {
            if array {
                values
                    .iter()
                    .map(|v| quote_literal(v))
                    .collect::<Vec<_>>()
                    .join(",")
            } else {
                values[0].replace('\'', "''")
            }
        }
        None => {
            if !array {
                values[0].replace('\\', "\\\\").replace('\'', "\\\\'")
            } else {
                let escaped: Vec<String> = values.iter().map(|v| prom_regex_escape(v)).collect();
                if escaped.len() == 1 {
                    escaped[0].clone()
                } else {
                    format!("({})", escaped.join("|"))
                }
            }
        }
        Some("csv") | Some("raw") => values.join(","),
        Some("pipe") => values.join("|"),
        Some("sqlstring") => values
            .iter()
            .map(|v| quote_literal(v))
            .collect::<Vec<_>>()
            .join(","),
        Some("singlequote") => values
            .iter()
            .map(|v| format!("'{}'", v.replace('\'', "\\'")))
            .collect::<Vec<_>>()
            .join(","),
        Some("doublequote") => values
            .iter()
            .map(|v| format!("\"{}\"", v.replace('"', "\\\"")))
            .collect::<Vec<_>>()
            .join(","),
        Some(other) => {
            return Err(format!(
                "variable format {other:?} is not supported by this test"
            ))
        }
    })
}

/// templateSrv.replace: `$name`, `[[name]]`, `[[name:fmt]]`, `${name}`, `${name:fmt}`; names it
/// does not know (Grafana's macros among them) stay as they are. `builtins` are the scoped
/// variables Grafana adds (`__interval`, `__from`, …), inserted as they are.
fn template_replace(
    text: &str,
    variables: &[Variable],
    builtins: &[(&str, String)],
    flavor: Flavor,
) -> Result<String, String> {
    let bytes = text.as_bytes();
    let word = |i: usize| {
        let mut j = i;
        while j < bytes.len() && (bytes[j].is_ascii_alphanumeric() || bytes[j] == b'_') {
            j += 1;
        }
        j
    };
    let mut out = String::new();
    let mut i = 0;
    while i < bytes.len() {
        // (name, format, end of the match)
        let mut found: Option<(&str, Option<&str>, usize)> = None;
        if bytes[i] == b'$' && i + 1 < bytes.len() && bytes[i + 1] == b'{' {
            if let Some(close) = text[i + 2..].find('}') {
                let inner = &text[i + 2..i + 2 + close];
                let (name, format) = match inner.split_once(':') {
                    Some((n, f)) => (n, Some(f)),
                    None => (inner, None),
                };
                if !name.is_empty() && word(i + 2) == i + 2 + name.len() {
                    found = Some((name, format, i + 3 + close));
                }
            }
        } else if bytes[i] == b'$' {
            let end = word(i + 1);
            if end > i + 1 {
                found = Some((&text[i + 1..end], None, end));
            }
        } else if text[i..].starts_with("[[") {
            if let Some(close) = text[i + 2..].find("]]") {
                let inner = &text[i + 2..i + 2 + close];
                let (name, format) = match inner.split_once(':') {
                    Some((n, f)) => (n, Some(f)),
                    None => (inner, None),
                };
                if !name.is_empty() && word(i + 2) == i + 2 + name.len() {
                    found = Some((name, format, i + 4 + close));
                }
            }
        }
        if let Some((name, format, end)) = found {
            if let Some(variable) = variables.iter().find(|v| v.name == name) {
                out.push_str(&format_variable(variable, format, flavor)?);
                i = end;
                continue;
            }
            if let Some((_, value)) = builtins.iter().find(|(n, _)| *n == name) {
                out.push_str(value);
                i = end;
                continue;
            }
            // Unknown: left as it is (a macro, or a typo Grafana would send as it is).
            out.push_str(&text[i..end]);
            i = end;
            continue;
        }
        let c = text[i..].chars().next().unwrap();
        out.push(c);
        i += c.len_utf8();
    }
    Ok(out)
}

// ------------------------------------------------------------------------------------------
// Grafana's PostgreSQL data source: sqleng.Interpolate, then the macro engine

/// `sqleng.Interpolate`: the global substitutions before the macros.
fn sql_global(sql: &str, interval_ms: i64, range: Range) -> String {
    sql.replace("$__interval_ms", &interval_ms.to_string())
        .replace("$__interval", &go_format_interval(interval_ms))
        .replace("$__unixEpochFrom()", &(range.from_ms / 1000).to_string())
        .replace("$__unixEpochTo()", &(range.to_ms / 1000).to_string())
}

/// `postgresMacroEngine.Interpolate` (TimescaleDB off): every `$name(args)` — args up to the
/// first `)`, as Grafana's regular expression `\$([_a-zA-Z0-9]+)\(([^\)]*)\)` has it.
fn sql_macros(sql: &str, range: Range) -> Result<String, String> {
    let bytes = sql.as_bytes();
    let mut out = String::new();
    let mut last = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'$' {
            i += 1;
            continue;
        }
        let mut j = i + 1;
        while j < bytes.len() && (bytes[j].is_ascii_alphanumeric() || bytes[j] == b'_') {
            j += 1;
        }
        if j == i + 1 || j >= bytes.len() || bytes[j] != b'(' {
            i += 1;
            continue;
        }
        let Some(close) = sql[j + 1..].find(')') else {
            i += 1;
            continue;
        };
        let whole = &sql[i..j + 2 + close];
        let mut name = &sql[i + 1..j];
        let args: Vec<&str> = sql[j + 1..j + 1 + close]
            .split(',')
            .map(|a| a.trim_matches(' '))
            .collect();
        // Before Grafana 5.3 $__timeGroup added the alias: it still does when a ',' follows
        // (looked up at the macro's first occurrence, as Grafana does).
        if name == "__timeGroup" {
            if let Some(at) = sql.find(whole) {
                if sql.as_bytes().get(at + whole.len()) == Some(&b',') {
                    name = "__timeGroupAlias";
                }
            }
        }
        out.push_str(&sql[last..i]);
        out.push_str(&evaluate_macro(name, &args, range)?);
        i = j + 2 + close;
        last = i;
    }
    out.push_str(&sql[last..]);
    Ok(out)
}

fn evaluate_macro(name: &str, args: &[&str], range: Range) -> Result<String, String> {
    // Go's strings.Split never gives an empty list, so Grafana's "missing time column" check
    // never fires: `$__timeFilter()` expands with an empty column.
    let first = args[0];
    let (from, to) = (rfc3339_nano(range.from_ms), rfc3339_nano(range.to_ms));
    let group = |alias: bool, epoch: bool| -> Result<String, String> {
        if args.len() < 2 {
            return Err(format!(
                "macro {name} needs time column and interval and optional fill value"
            ));
        }
        let seconds = parse_go_interval(args[1])
            .map_err(|_| format!("error parsing interval {}", args[1]))?;
        if args.len() == 3 {
            // sqleng.SetupFillmode: NULL, previous, or a number.
            if !matches!(args[2], "NULL" | "previous") && args[2].parse::<f64>().is_err() {
                return Err(format!("error parsing fill value {}", args[2]));
            }
        }
        let s = go_float(seconds);
        let expr = if epoch {
            format!("floor(({})/{s})*{s}", args[0])
        } else {
            format!("floor(extract(epoch from {})/{s})*{s}", args[0])
        };
        Ok(if alias {
            format!("{expr} AS \"time\"")
        } else {
            expr
        })
    };
    Ok(match name {
        "__time" => format!("{} AS \"time\"", first),
        "__timeEpoch" => format!("extract(epoch from {}) as \"time\"", first),
        "__timeFilter" => format!("{} BETWEEN '{from}' AND '{to}'", first),
        "__timeFrom" => format!("'{from}'"),
        "__timeTo" => format!("'{to}'"),
        "__timeGroup" => group(false, false)?,
        "__timeGroupAlias" => group(true, false)?,
        "__unixEpochFilter" => {
            let c = args[0];
            format!(
                "{c} >= {} AND {c} <= {}",
                range.from_ms / 1000,
                range.to_ms / 1000
            )
        }
        "__unixEpochNanoFilter" => {
            let c = args[0];
            format!(
                "{c} >= {} AND {c} <= {}",
                range.from_ms as i128 * 1_000_000,
                range.to_ms as i128 * 1_000_000
            )
        }
        "__unixEpochNanoFrom" => (range.from_ms as i128 * 1_000_000).to_string(),
        "__unixEpochNanoTo" => (range.to_ms as i128 * 1_000_000).to_string(),
        "__unixEpochGroup" => group(false, true)?,
        "__unixEpochGroupAlias" => group(true, true)?,
        other => return Err(format!("unknown macro {other:?}")),
    })
}

/// A panel's SQL as Grafana sends it: the frontend's variables, then the data source's
/// substitutions and macros.
fn expand_sql(
    sql: &str,
    variables: &[Variable],
    range: Range,
    interval: (i64, &str),
) -> Result<String, String> {
    let builtins = [
        ("__interval", interval.1.to_string()),
        ("__interval_ms", interval.0.to_string()),
        ("__from", range.from_ms.to_string()),
        ("__to", range.to_ms.to_string()),
        ("__range_ms", (range.to_ms - range.from_ms).to_string()),
        (
            "__range_s",
            ((range.to_ms - range.from_ms) / 1000).to_string(),
        ),
        (
            "__range",
            format!("{}s", (range.to_ms - range.from_ms) / 1000),
        ),
    ];
    let sql = template_replace(sql, variables, &builtins, Flavor::Sql)?;
    sql_macros(&sql_global(&sql, interval.0, range), range)
}

/// The Prometheus data source's `InterpolateVariables` (backend): `$__interval`,
/// `$__rate_interval` (max(interval + scrape interval, 4 × scrape interval)), `$__range`, in both
/// `$__x` and `${__x}` forms; the user's variables were replaced by the frontend before.
fn expand_promql(
    expr: &str,
    variables: &[Variable],
    range: Range,
    interval_ms: i64,
    scrape_ms: i64,
) -> Result<String, String> {
    let mut expr = template_replace(expr, variables, &[], Flavor::Prometheus)?;
    let range_ms = range.to_ms - range.from_ms;
    let range_s = (range_ms as f64 / 1000.0).round() as i64;
    let rate_ms = (interval_ms + scrape_ms).max(4 * scrape_ms);
    for (name, value) in [
        ("__interval_ms", interval_ms.to_string()),
        ("__interval", go_format_interval(interval_ms)),
        ("__range_ms", range_ms.to_string()),
        ("__range_s", range_s.to_string()),
        ("__range", format!("{range_s}s")),
        ("__rate_interval_ms", rate_ms.to_string()),
        ("__rate_interval", go_duration(rate_ms)),
    ] {
        expr = expr
            .replace(&format!("${{{name}}}"), &value)
            .replace(&format!("${name}"), &value);
    }
    Ok(expr)
}

/// Metric names a PromQL expression reads: identifiers outside label matchers, ranges and
/// strings that are not functions, aggregations, keywords or the label lists after
/// `by`/`without`/`on`/`ignoring`/`group_left`/`group_right`.
fn promql_metric_names(expr: &str) -> BTreeSet<String> {
    const AGGREGATIONS: [&str; 14] = [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    ];
    const KEYWORDS: [&str; 8] = [
        "bool", "offset", "and", "or", "unless", "atan2", "inf", "nan",
    ];
    const LABEL_LISTS: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let skip_to = |from: usize, open: char, close: char| -> usize {
        let mut depth = 0;
        let mut j = from;
        let mut quote: Option<char> = None;
        while j < chars.len() {
            let c = chars[j];
            if let Some(q) = quote {
                if c == '\\' {
                    j += 1;
                } else if c == q {
                    quote = None;
                }
            } else if c == '"' || c == '\'' || c == '`' {
                quote = Some(c);
            } else if c == open {
                depth += 1;
            } else if c == close {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            j += 1;
        }
        j
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '{' {
            i = skip_to(i, '{', '}');
        } else if c == '[' {
            i = skip_to(i, '[', ']');
        } else if c == '"' || c == '\'' || c == '`' {
            let mut j = i + 1;
            while j < chars.len() && chars[j] != c {
                if chars[j] == '\\' {
                    j += 1;
                }
                j += 1;
            }
            i = j + 1;
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(|d| d.is_ascii_digit()))
        {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            if LABEL_LISTS.contains(&word.as_str()) {
                if chars.get(next) == Some(&'(') {
                    i = skip_to(next, '(', ')');
                }
            } else if chars.get(next) == Some(&'(')
                || AGGREGATIONS.contains(&word.as_str())
                || KEYWORDS.contains(&word.to_ascii_lowercase().as_str())
            {
                // a function, an aggregation or a keyword
            } else {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// A Prometheus query variable: `label_values(label)` or `label_values(selector, label)`.
fn parse_label_values(query: &str) -> Result<(Option<String>, String), String> {
    let inner = query
        .trim()
        .strip_prefix("label_values(")
        .and_then(|q| q.strip_suffix(')'))
        .ok_or_else(|| format!("only label_values(…) variable queries are supported: {query}"))?;
    Ok(match inner.rsplit_once(',') {
        Some((selector, label)) => (Some(selector.trim().to_string()), label.trim().to_string()),
        None => (None, inner.trim().to_string()),
    })
}

// ------------------------------------------------------------------------------------------
// Provisioning files

/// The list items of a provisioning file (`- name: …` blocks under its one top-level list),
/// each as its `key: value` pairs at any depth. These files keep every key unique within an
/// item, so a flat map is all a check needs.
fn yaml_items(text: &str) -> Vec<BTreeMap<String, String>> {
    let mut items: Vec<BTreeMap<String, String>> = Vec::new();
    let mut item_indent = None;
    for line in text.lines() {
        let body = line.split(" #").next().unwrap();
        if body.trim().is_empty() || body.trim_start().starts_with('#') {
            continue;
        }
        let indent = body.len() - body.trim_start().len();
        let mut content = body.trim();
        if let Some(rest) = content.strip_prefix("- ") {
            if item_indent.is_none() || item_indent == Some(indent) {
                item_indent = Some(indent);
                items.push(BTreeMap::new());
                content = rest.trim();
            }
        } else if item_indent.is_some_and(|i| indent <= i) {
            item_indent = None;
        }
        if item_indent.is_none() {
            continue;
        }
        if let (Some(item), Some((key, value))) = (items.last_mut(), content.split_once(':')) {
            let value = value.trim().trim_matches('"').trim_matches('\'');
            if !value.is_empty() {
                item.insert(key.trim().to_string(), value.to_string());
            }
        }
    }
    items
}

fn yaml_value(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let (k, v) = line.split(" #").next().unwrap().split_once(':')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
    })
}

// ------------------------------------------------------------------------------------------
// psql, Prometheus and the demo

/// A query's answer with its column names; `None` for SQL NULL.
struct Answer {
    columns: Vec<String>,
    rows: Vec<Vec<Option<String>>>,
}

/// Runs `sql` through psql as the demo user, with column names (the bare rows of support::psql
/// have none, and a time series needs its `time` column).
fn psql_answer(port: u16, sql: &str) -> Result<Answer, String> {
    const NULL: &str = "\u{1}NULL";
    let mut command = Command::new("psql");
    for (name, _) in std::env::vars() {
        if name.starts_with("PG") {
            command.env_remove(name);
        }
    }
    let out = command
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            "demo",
            "-d",
            "gpuwarden",
        ])
        .args(["-X", "-w", "-A", "-F", "\u{1f}", "-P", "footer=off"])
        .args([
            "-P",
            &format!("null={NULL}"),
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            sql,
        ])
        .env("PGPASSWORD", "demo")
        .env("PGCONNECT_TIMEOUT", "10")
        .env("PGSSLMODE", "disable")
        .env("PGPASSFILE", "/dev/null")
        .stdin(Stdio::null())
        .output()
        .expect("psql (postgresql-client) is installed");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let columns: Vec<String> = lines
        .next()
        .ok_or("psql printed no header")?
        .split('\u{1f}')
        .map(str::to_string)
        .collect();
    let mut rows = Vec::new();
    for line in lines {
        let row: Vec<Option<String>> = line
            .split('\u{1f}')
            .map(|v| (v != NULL).then(|| v.to_string()))
            .collect();
        if row.len() != columns.len() {
            return Err(format!(
                "a row psql printed does not split into {columns:?}: {line:?}"
            ));
        }
        rows.push(row);
    }
    Ok(Answer { columns, rows })
}

/// One plain HTTP/1.0 GET (no chunked answer to decode), returning (status, body).
fn http10_get(address: &str, path: &str) -> Result<(u16, String), String> {
    let mut stream =
        std::net::TcpStream::connect(address).map_err(|e| format!("{address}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|e| format!("{address}{path}: {e}"))?;
    Ok(status_and_body(&response))
}

fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Debian's Prometheus, scraping with the given config into a TSDB of its own.
struct Prometheus {
    child: Child,
    address: String,
    log: PathBuf,
}

impl Prometheus {
    fn start(config: &Path, dir: &Path) -> Self {
        let address = format!("127.0.0.1:{}", free_port());
        let log = dir.join("prometheus.log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("prometheus (Debian package prometheus) is installed");
        let prometheus = Self {
            child,
            address,
            log,
        };
        let until = Instant::now() + Duration::from_secs(60);
        while !matches!(http10_get(&prometheus.address, "/-/ready"), Ok((200, _))) {
            assert!(
                Instant::now() < until,
                "Prometheus not ready within 60 s:\n{}",
                read(&prometheus.log)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        prometheus
    }

    fn api(&self, path: &str) -> Result<Value, String> {
        let (status, body) = http10_get(&self.address, path)?;
        let json: Value =
            serde_json::from_str(&body).map_err(|e| format!("HTTP {status}: {e}: {body}"))?;
        if json["status"] != "success" {
            return Err(format!(
                "{}: {}",
                json["errorType"].as_str().unwrap_or("error"),
                json["error"].as_str().unwrap_or(&body)
            ));
        }
        Ok(json["data"].clone())
    }

    /// An instant query at the current time: (result type, number of series or samples).
    fn query(&self, expr: &str) -> Result<(String, usize), String> {
        let data = self.api(&format!("/api/v1/query?query={}", url_encode(expr)))?;
        let kind = data["resultType"].as_str().unwrap_or_default().to_string();
        let n = match &data["result"] {
            Value::Array(series) if kind == "vector" || kind == "matrix" => series.len(),
            Value::Array(_) => 1,
            _ => 0,
        };
        Ok((kind, n))
    }

    fn label_values(&self, label: &str, selector: Option<&str>) -> Result<Vec<String>, String> {
        let mut path = format!("/api/v1/label/{}/values", url_encode(label));
        if let Some(selector) = selector {
            path.push_str(&format!("?match[]={}", url_encode(selector)));
        }
        let data = self.api(&path)?;
        Ok(data
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ------------------------------------------------------------------------------------------
// Tests

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

/// Which variable values a run selects: each variable's default (All), or each one's last
/// option, so that both the all-values and the one-value queries run. The last: with the demo's
/// data that is team research on its H100s and host l40s-0, which have data in every panel,
/// where the first, team (unallocated), holds no lease.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Selection {
    Default,
    Last,
}

fn variable_from(json: &Value, options: Vec<String>, selection: Selection) -> Variable {
    let mut options = options;
    let mut seen = BTreeSet::new();
    options.retain(|o| seen.insert(o.clone()));
    if json["sort"].as_i64() == Some(1) {
        options.sort();
    }
    let multi = json["multi"] == true;
    let include_all = json["includeAll"] == true;
    let current: Vec<String> = match &json["current"]["value"] {
        Value::Array(values) => values
            .iter()
            .filter_map(|v| v.as_str().map(String::from))
            .collect(),
        Value::String(v) => vec![v.clone()],
        _ => Vec::new(),
    };
    let selected = if selection == Selection::Last {
        Some(options.iter().last().cloned().into_iter().collect())
    } else if include_all && (current.is_empty() || current.iter().any(|v| v == "$__all")) {
        None
    } else if !current.is_empty() && current.iter().all(|v| options.contains(v)) {
        Some(current)
    } else {
        Some(options.iter().take(1).cloned().collect())
    };
    Variable {
        name: json["name"].as_str().unwrap().to_string(),
        multi,
        include_all,
        all_value: json["allValue"]
            .as_str()
            .filter(|v| !v.is_empty())
            .map(String::from),
        options,
        selected,
    }
}

#[test]
fn every_panel_answers_on_demo_data_through_psql_and_a_real_prometheus() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(&dir.path().join("demo"));
    let port = demo.sql_port;
    let count = |sql: &str| -> i64 {
        let out = psql(port, "demo", Some("demo"), sql, false);
        if !out.status.success() {
            return 0;
        }
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    };

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
    let until = Instant::now() + Duration::from_secs(180);
    let seen = loop {
        let seen = (
            count("SELECT count(DISTINCT hour) FROM team_hourly"),
            count("SELECT count(*) FROM lease_hourly WHERE lease_id IS NOT NULL"),
            count("SELECT count(*) FROM focus_costs"),
            count("SELECT count(*) FROM actions WHERE action = 'reclaim' AND reason = 'idle' AND outcome = 'ok'"),
        );
        if seen.0 >= 2 && seen.1 > 0 && seen.2 > 0 && seen.3 > 0 {
            break seen;
        }
        assert!(
            Instant::now() < until,
            "within 3 minutes: team_hourly hours (2), lease_hourly and focus_costs rows, idle reclaims = {seen:?}"
        );
        std::thread::sleep(Duration::from_secs(1));
    };
    eprintln!(
        "demo data after {:.0} s: {seen:?} (team_hourly hours, lease_hourly, focus_costs rows, idle reclaims)",
        started.elapsed().as_secs_f64()
    );
    // The dashboards' time range is the demo's event time: from its first hour to the end of
    // its last (the demo runs an hour a minute, from a day ago).
    let span = psql_answer(
        port,
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
                    || psql_answer(port, &sql),
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
                    || check_answer(psql_answer(port, &sql)?, time_series),
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
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        // Every target up, and a few scrapes behind each, so that rate() has points.
        let up =
            prometheus.query("count_over_time(up{job=~\"gpuwarden-.*\"}[1m]) >= 5 and up == 1");
        if matches!(up, Ok((_, 3))) {
            break;
        }
        assert!(
            Instant::now() < until,
            "Prometheus: the demo's 3 targets up and scraped 5 times within 60 s: {up:?}\n{}",
            read(&prometheus.log)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
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

fn uses(dashboard: &Value, uid: &str) -> bool {
    panels(dashboard).iter().any(|p| {
        p["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|t| target_uid(p, t) == uid)
    })
}

/// Checks an answer as Grafana would read it; returns its rows and its first row as text.
fn check_answer(answer: Answer, time_series: bool) -> Result<(usize, String), String> {
    if answer.rows.is_empty() {
        return Err("no rows".into());
    }
    let time = answer.columns.iter().position(|c| c == "time");
    let values = answer
        .rows
        .iter()
        .flat_map(|row| row.iter().enumerate().filter(|(i, _)| Some(*i) != time))
        .any(|(_, v)| v.is_some());
    if !values {
        return Err(format!(
            "only nulls in {} rows of {:?}",
            answer.rows.len(),
            answer.columns
        ));
    }
    if time_series {
        let Some(time) = time else {
            return Err(format!(
                "format time_series needs a column named time: {:?}",
                answer.columns
            ));
        };
        let key = |row: &Vec<Option<String>>| -> (f64, String) {
            let v = row[time].clone().unwrap_or_default();
            (v.parse::<f64>().unwrap_or(f64::NAN), v)
        };
        for pair in answer.rows.windows(2) {
            let (a, b) = (key(&pair[0]), key(&pair[1]));
            let descending = if a.0.is_nan() || b.0.is_nan() {
                a.1 > b.1
            } else {
                a.0 > b.0
            };
            if descending {
                return Err(format!(
                    "time goes back from {} to {}: Grafana turns a long series into a wide one only in time order",
                    a.1, b.1
                ));
            }
        }
    }
    let first: Vec<String> = answer
        .columns
        .iter()
        .zip(&answer.rows[0])
        .map(|(c, v)| format!("{c}={}", v.as_deref().unwrap_or("NULL")))
        .collect();
    let mut first = first.join(" ");
    if first.chars().count() > 160 {
        first = format!("{}…", first.chars().take(160).collect::<String>());
    }
    Ok((answer.rows.len(), first))
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
