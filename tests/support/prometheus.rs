//! A real Prometheus (Debian's) for the tests, scraping into a TSDB of its own and asked through
//! its HTTP API, and the metric names a PromQL expression reads.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::{eventually, status_and_body};

/// Debian's Prometheus, scraping with the given config into a TSDB of its own.
pub struct Prometheus {
    child: Child,
    address: String,
    log: PathBuf,
}

impl Prometheus {
    /// Starts it with `config` on a free port of 127.0.0.1, its TSDB and log under `dir`, and
    /// waits until it is ready.
    pub fn start(config: &Path, dir: &Path) -> Self {
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
        eventually(
            "Prometheus ready",
            Duration::from_secs(60),
            || match http10_get(&prometheus.address, "/-/ready") {
                Ok((200, _)) => Ok(()),
                other => Err(format!("{other:?}\n{}", prometheus.log())),
            },
        );
        prometheus
    }

    /// What it has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The `data` of an answer of its HTTP API; the error it gives otherwise.
    pub fn api(&self, path: &str) -> Result<Value, String> {
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
    pub fn query(&self, expr: &str) -> Result<(String, usize), String> {
        let data = self.api(&format!("/api/v1/query?query={}", url_encode(expr)))?;
        let kind = data["resultType"].as_str().unwrap_or_default().to_string();
        let n = match &data["result"] {
            Value::Array(series) if kind == "vector" || kind == "matrix" => series.len(),
            Value::Array(_) => 1,
            _ => 0,
        };
        Ok((kind, n))
    }

    /// The values of `label`, on the series `selector` matches when there is one.
    pub fn label_values(&self, label: &str, selector: Option<&str>) -> Result<Vec<String>, String> {
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

/// Percent-encodes all but RFC 3986's unreserved characters.
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

/// A port of 127.0.0.1 that is free right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Metric names a PromQL expression reads: identifiers outside label matchers, ranges and
/// strings that are not functions, aggregations, keywords or the label lists after
/// `by`/`without`/`on`/`ignoring`/`group_left`/`group_right`.
pub fn promql_metric_names(expr: &str) -> BTreeSet<String> {
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
