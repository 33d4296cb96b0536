//! Grafana's side of the dashboards, ported so that a test can send what Grafana sends: walking a
//! dashboard's panels and targets, the time range and intervals (`rangeutil` of @grafana/data,
//! `gtime` of the backend), template variables as `templateSrv` and each data source's
//! `interpolateVariable` replace them, the PostgreSQL data source's macros
//! (`pkg/tsdb/grafana-postgresql-datasource/macros.go` after `sqleng.Interpolate`), the
//! Prometheus data source's own variables, and the provisioning files.
//!
//! tests/dashboards.rs checks these ports against the cases of Grafana's own tests.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, UNIX_EPOCH};

use serde_json::Value;

use super::Answer;

// ------------------------------------------------------------------------------------------
// Dashboards

/// Every panel that is not a row, rows' nested panels included, in layout order.
pub fn panels(dashboard: &Value) -> Vec<&Value> {
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

/// A string field of a dashboard's JSON; `what` names it when it is not one.
pub fn text<'a>(value: &'a Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {value}"))
}

/// The data source uid a target runs on: its own, else its panel's.
pub fn target_uid<'a>(panel: &'a Value, target: &'a Value) -> &'a str {
    target["datasource"]["uid"]
        .as_str()
        .or_else(|| panel["datasource"]["uid"].as_str())
        .unwrap_or_else(|| panic!("no data source for {target} in {}", panel["title"]))
}

/// Every target of `dashboard` on the data source `uid`, with its panel and the name failures
/// give it: `file › panel title [refId]`, and which variable values it ran with.
pub fn targets_on<'a>(
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

/// Whether a panel of `dashboard` queries the data source `uid`.
pub fn uses(dashboard: &Value, uid: &str) -> bool {
    panels(dashboard).iter().any(|p| {
        p["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|t| target_uid(p, t) == uid)
    })
}

/// Which variable values a run selects: each variable's default (All), or each one's last
/// option, so that both the all-values and the one-value queries run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Selection {
    Default,
    Last,
}

/// A variable as the dashboard's `json` declares it, with the `options` its query gave (kept
/// once each, sorted when it says so), and its value chosen as `selection` says.
pub fn variable_from(json: &Value, options: Vec<String>, selection: Selection) -> Variable {
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

// ------------------------------------------------------------------------------------------
// Time and intervals, as Grafana computes them

/// A dashboard's time range, in epoch milliseconds.
#[derive(Clone, Copy, Debug)]
pub struct Range {
    pub from_ms: i64,
    pub to_ms: i64,
}

/// Go's `time.RFC3339Nano` in UTC: trailing zeros of the fraction (and a bare dot) dropped.
pub fn rfc3339_nano(ms: i64) -> String {
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
pub fn interval_to_ms(text: &str) -> Result<i64, String> {
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
pub fn seconds_to_hms(seconds: f64) -> String {
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
pub fn calculate_interval(range: Range, resolution: f64, low_limit: &str) -> (i64, String) {
    let low = interval_to_ms(low_limit).unwrap_or_else(|e| panic!("{e}"));
    let ms = round_interval((range.to_ms - range.from_ms) as f64 / resolution).max(low);
    (ms, seconds_to_hms(ms as f64 / 1000.0))
}

/// Grafana sizes a query by the panel's width in pixels (or its maxDataPoints): a 24-column
/// grid on a 1920-pixel screen.
pub fn resolution(panel: &Value) -> f64 {
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
pub fn go_duration(ms: i64) -> String {
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

/// A query variable of a dashboard, its options and what is selected.
#[derive(Clone, Debug)]
pub struct Variable {
    pub name: String,
    pub multi: bool,
    pub include_all: bool,
    pub all_value: Option<String>,
    pub options: Vec<String>,
    /// `None`: "All" is selected.
    pub selected: Option<Vec<String>>,
}

impl Variable {
    /// What is selected: every option when "All" is.
    pub fn values(&self) -> Vec<String> {
        self.selected
            .clone()
            .unwrap_or_else(|| self.options.clone())
    }
}

/// Whose `interpolateVariable` formats a variable without a `:format`: the PostgreSQL data
/// source's or the Prometheus one's.
#[derive(Clone, Copy, PartialEq)]
pub enum Flavor {
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
pub fn template_replace(
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
pub fn sql_global(sql: &str, interval_ms: i64, range: Range) -> String {
    sql.replace("$__interval_ms", &interval_ms.to_string())
        .replace("$__interval", &go_format_interval(interval_ms))
        .replace("$__unixEpochFrom()", &(range.from_ms / 1000).to_string())
        .replace("$__unixEpochTo()", &(range.to_ms / 1000).to_string())
}

/// `postgresMacroEngine.Interpolate` (TimescaleDB off): every `$name(args)` — args up to the
/// first `)`, as Grafana's regular expression `\$([_a-zA-Z0-9]+)\(([^\)]*)\)` has it.
pub fn sql_macros(sql: &str, range: Range) -> Result<String, String> {
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

/// One macro of the PostgreSQL data source, `$name(args)`, expanded over `range`.
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
pub fn expand_sql(
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

/// Checks an answer as Grafana would read it; returns its rows and its first row as text.
pub fn check_answer(answer: Answer, time_series: bool) -> Result<(usize, String), String> {
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

// ------------------------------------------------------------------------------------------
// Grafana's Prometheus data source

/// The Prometheus data source's `InterpolateVariables` (backend): `$__interval`,
/// `$__rate_interval` (max(interval + scrape interval, 4 × scrape interval)), `$__range`, in both
/// `$__x` and `${__x}` forms; the user's variables were replaced by the frontend before.
pub fn expand_promql(
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

/// A Prometheus query variable: `label_values(label)` or `label_values(selector, label)`.
pub fn parse_label_values(query: &str) -> Result<(Option<String>, String), String> {
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
pub fn yaml_items(text: &str) -> Vec<BTreeMap<String, String>> {
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

/// The value of `key` on the first line that sets it, at any depth, quotes dropped.
pub fn yaml_value(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let (k, v) = line.split(" #").next().unwrap().split_once(':')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
    })
}
