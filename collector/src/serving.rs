//! Idleness from the workload itself: an inference server holds its GPU's memory and may run a
//! heartbeat kernel while serving no request for hours, so NVML reads it busy. A workload may
//! name, in its processes' environment, a metrics endpoint of its own and the expression that
//! means "serving"; the collector scrapes it once per tick and carries the value in the GPU's
//! sample (`serving_requests`), and the idle rule then judges by it instead of the GPU's measures
//! (docs/src/finops/definitions.md).
//!
//! - [`METRICS_ENV`], `GPUWARDEN_SERVING_METRICS`: an `http://host[:port][/path]` URL serving
//!   Prometheus text exposition (vLLM's and Triton's `/metrics` do), the path `/metrics` when
//!   absent;
//! - [`EXPR_ENV`], `GPUWARDEN_SERVING_EXPR`: one or more series selectors joined by `+`, each a
//!   metric name with optional label matchers (`=` or `!=`), e.g.
//!   `vllm:num_requests_running + vllm:num_requests_waiting` or
//!   `nv_inference_pending_request_count{model="llama"}`. A selector adds every series of its
//!   name whose labels match; a name the page lacks adds 0 (a server that has served nothing yet
//!   may not have the series).
//!
//! Plain HTTP only: the endpoint is the workload's own, on loopback or its pod's address. A
//! scrape that fails or takes longer than [`SCRAPE_TIMEOUT`] gives no value for that tick, so
//! the GPU's own measures judge it; the caller logs a failing endpoint once, not every tick.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpuwarden_schema::Sample;

use crate::environ::env_var;

/// The environment variable naming a workload's metrics endpoint.
pub const METRICS_ENV: &str = "GPUWARDEN_SERVING_METRICS";
/// The environment variable holding the expression that means "serving".
pub const EXPR_ENV: &str = "GPUWARDEN_SERVING_EXPR";
/// The longest one scrape may take, connection included.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(1);
/// The largest metrics page read; a larger one is refused.
const MAX_PAGE_BYTES: usize = 8 << 20;

/// Why a workload's declaration, or one scrape of it, gave no value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServingError {
    /// One of the two variables is set without the other.
    #[error("{set} is set but {missing} is not: both name a workload's serving measure")]
    Half {
        /// The variable that is set.
        set: &'static str,
        /// The one that is missing.
        missing: &'static str,
    },
    /// The endpoint is not a plain `http://` URL this module can reach.
    #[error("{METRICS_ENV} `{url}` is not an http://host[:port][/path] URL: {why}")]
    Url {
        /// The value as given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// The expression does not parse.
    #[error("{EXPR_ENV} `{expr}`: {why}")]
    Expr {
        /// The value as given.
        expr: String,
        /// What is wrong with it.
        why: String,
    },
    /// The endpoint could not be read: refused, timed out, an HTTP error, a page too large.
    #[error("scraping {url}: {why}")]
    Scrape {
        /// The endpoint.
        url: String,
        /// What went wrong.
        why: String,
    },
    /// The page is not Prometheus text exposition.
    #[error("{url} line {line}: not Prometheus text exposition ({why})")]
    Page {
        /// The endpoint.
        url: String,
        /// 1-based line number.
        line: usize,
        /// What the parser expected.
        why: String,
    },
}

/// A workload's serving measure: where to read it and what to add up.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    url: String,
    host: String,
    port: u16,
    path: String,
    expr: Vec<Selector>,
}

/// `name{label="value", other!="value"}`.
#[derive(Debug, Clone, PartialEq)]
struct Selector {
    name: String,
    matchers: Vec<(String, bool, String)>,
}

impl Probe {
    /// The probe a process's environment declares: `None` when it declares none, an error when
    /// it declares one badly (half of it, a URL or an expression that does not parse).
    pub fn from_environ(environ: &[u8]) -> Option<Result<Self, ServingError>> {
        let text = |name| env_var(environ, name).map(|v| String::from_utf8_lossy(v).into_owned());
        match (text(METRICS_ENV), text(EXPR_ENV)) {
            (None, None) => None,
            (Some(_), None) => Some(Err(ServingError::Half {
                set: METRICS_ENV,
                missing: EXPR_ENV,
            })),
            (None, Some(_)) => Some(Err(ServingError::Half {
                set: EXPR_ENV,
                missing: METRICS_ENV,
            })),
            (Some(url), Some(expr)) => Some(Self::new(&url, &expr)),
        }
    }

    /// A probe of `url` adding up `expr`.
    pub fn new(url: &str, expr: &str) -> Result<Self, ServingError> {
        let (host, port, path) = parse_url(url).map_err(|why| ServingError::Url {
            url: url.to_owned(),
            why,
        })?;
        let expr_error = |why: String| ServingError::Expr {
            expr: expr.to_owned(),
            why,
        };
        let selectors = split_terms(expr)
            .into_iter()
            .map(|term| parse_selector(term.trim()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(expr_error)?;
        Ok(Self {
            url: url.to_owned(),
            host,
            port,
            path,
            expr: selectors,
        })
    }

    /// The endpoint, as declared.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Reads the endpoint once and adds up the expression.
    pub fn scrape(&self) -> Result<f64, ServingError> {
        let page = self.fetch()?;
        self.evaluate(&page)
    }

    /// The expression's value over a metrics page.
    pub fn evaluate(&self, page: &str) -> Result<f64, ServingError> {
        let mut total = vec![0.0; self.expr.len()];
        for (n, line) in page.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, labels, value) = parse_line(line).map_err(|why| ServingError::Page {
                url: self.url.clone(),
                line: n + 1,
                why,
            })?;
            for (sum, selector) in total.iter_mut().zip(&self.expr) {
                if selector.matches(name, &labels) && value.is_finite() {
                    *sum += value;
                }
            }
        }
        Ok(total.iter().sum())
    }

    fn fetch(&self) -> Result<String, ServingError> {
        let fail = |why: String| ServingError::Scrape {
            url: self.url.clone(),
            why,
        };
        let deadline = Instant::now() + SCRAPE_TIMEOUT;
        let address = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| fail(format!("cannot resolve {}: {e}", self.host)))?
            .next()
            .ok_or_else(|| fail(format!("{} has no address", self.host)))?;
        let mut stream = TcpStream::connect_timeout(&address, SCRAPE_TIMEOUT)
            .map_err(|e| fail(e.to_string()))?;
        // HTTP/1.0 with no keep-alive: the answer is neither chunked nor kept open, so it ends
        // where the connection does.
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        let request = format!(
            "GET {} HTTP/1.0\r\nHost: {host}:{}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n",
            self.path, self.port
        );
        let left = |deadline: Instant| {
            deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .ok_or_else(|| fail(format!("no answer within {SCRAPE_TIMEOUT:?}")))
        };
        stream
            .set_write_timeout(Some(left(deadline)?))
            .and_then(|()| stream.write_all(request.as_bytes()))
            .map_err(|e| fail(e.to_string()))?;
        let mut body = Vec::new();
        let mut buf = [0u8; 16 << 10];
        loop {
            stream
                .set_read_timeout(Some(left(deadline)?))
                .map_err(|e| fail(e.to_string()))?;
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => body.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(fail(format!("no whole answer within {SCRAPE_TIMEOUT:?}")));
                }
                Err(e) => return Err(fail(e.to_string())),
            }
            if body.len() > MAX_PAGE_BYTES {
                return Err(fail(format!(
                    "the page is larger than {MAX_PAGE_BYTES} bytes"
                )));
            }
        }
        let split = body
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| fail("the answer is not HTTP".into()))?;
        let head = String::from_utf8_lossy(&body[..split]);
        let status = head
            .lines()
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| fail("the answer has no HTTP status line".into()))?;
        if status != 200 {
            return Err(fail(format!("HTTP status {status}")));
        }
        String::from_utf8(body[split + 4..].to_vec())
            .map_err(|_| fail("the page is not UTF-8".into()))
    }
}

impl Selector {
    fn matches(&self, name: &str, labels: &[(String, String)]) -> bool {
        name == self.name
            && self.matchers.iter().all(|(key, equal, value)| {
                let actual = labels
                    .iter()
                    .find(|(k, _)| k == key)
                    .map_or("", |(_, v)| v.as_str());
                (actual == value) == *equal
            })
    }
}

/// `http://host[:port][/path]` → host, port, path.
fn parse_url(url: &str) -> Result<(String, u16, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| "only plain http:// is read".to_owned())?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/metrics"),
    };
    if authority.contains('@') {
        return Err("credentials in the URL are not read".into());
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or_else(|| "an IPv6 address without its closing `]`".to_owned())?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("no host".into());
    }
    let port = match port {
        None => 80,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("`{p}` is not a port"))?,
    };
    Ok((host.to_owned(), port, path.to_owned()))
}

/// The expression's terms: split at `+` outside label braces and quotes.
fn split_terms(expr: &str) -> Vec<&str> {
    let (mut terms, mut start, mut depth, mut quoted, mut escaped) = (vec![], 0, 0, false, false);
    for (i, c) in expr.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '{' if !quoted => depth += 1,
            '}' if !quoted => depth -= 1,
            '+' if !quoted && depth == 0 => {
                terms.push(&expr[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&expr[start..]);
    terms
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    is_name_start(c) || c.is_ascii_digit()
}

/// The metric name at the start of `text`, and what follows it.
fn take_name(text: &str) -> Option<(&str, &str)> {
    if !text.starts_with(is_name_start) {
        return None;
    }
    let end = text.find(|c| !is_name_char(c)).unwrap_or(text.len());
    Some((&text[..end], &text[end..]))
}

fn parse_selector(term: &str) -> Result<Selector, String> {
    if term.is_empty() {
        return Err("an empty term (a `+` with nothing beside it)".into());
    }
    let (name, rest) =
        take_name(term).ok_or_else(|| format!("`{term}` does not start with a metric name"))?;
    let rest = rest.trim();
    let matchers = if rest.is_empty() {
        Vec::new()
    } else {
        let (pairs, after) = parse_labels(rest, true)?;
        if !after.trim().is_empty() {
            return Err(format!("`{}` after `{name}`'s labels", after.trim()));
        }
        pairs
    };
    Ok(Selector {
        name: name.to_owned(),
        matchers,
    })
}

/// `{k="v", …}` at the start of `text`: the pairs (with whether each is `=`, not `!=`), and
/// what follows the closing brace. `!=` is allowed only in selectors.
#[allow(clippy::type_complexity)]
fn parse_labels(text: &str, selector: bool) -> Result<(Vec<(String, bool, String)>, &str), String> {
    let mut rest = text
        .strip_prefix('{')
        .ok_or_else(|| format!("`{text}`: expected `{{`"))?;
    let mut pairs = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((pairs, after));
        }
        let (key, after) =
            take_name(rest).ok_or_else(|| format!("`{rest}`: expected a label name"))?;
        let after = after.trim_start();
        let (equal, after) = if let Some(a) = after.strip_prefix("!=") {
            if !selector {
                return Err("`!=` in a series' labels".into());
            }
            (false, a)
        } else if let Some(a) = after.strip_prefix('=') {
            (true, a)
        } else {
            return Err(format!("expected `=` after label `{key}`"));
        };
        let after = after
            .trim_start()
            .strip_prefix('"')
            .ok_or_else(|| format!("label `{key}`'s value is not quoted"))?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err(format!("label `{key}`'s value has no closing quote")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err(format!("label `{key}`'s value ends in `\\`")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        pairs.push((key.to_owned(), equal, value));
        rest = after[end + 1..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

/// A series' labels, as written.
type Labels = Vec<(String, String)>;

/// One exposition line: the series' name, labels and value (a timestamp after it is ignored).
fn parse_line(line: &str) -> Result<(&str, Labels, f64), String> {
    let (name, rest) = take_name(line)
        .ok_or_else(|| "a line that does not start with a metric name".to_owned())?;
    let (labels, rest) = if rest.starts_with('{') {
        let (pairs, after) = parse_labels(rest, false)?;
        (pairs.into_iter().map(|(k, _, v)| (k, v)).collect(), after)
    } else {
        (Vec::new(), rest)
    };
    let value = rest
        .split_whitespace()
        .next()
        .ok_or_else(|| format!("`{name}` has no value"))?;
    let value = match value {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v
            .parse::<f64>()
            .map_err(|_| format!("`{v}` is not a number"))?,
    };
    Ok((name, labels, value))
}

/// Finds the serving probe each GPU's processes declare and fills the samples' values, one
/// scrape per endpoint per round, all endpoints at once (a slow one delays the round by at most
/// [`SCRAPE_TIMEOUT`]). A bad declaration is logged once per process, a failing endpoint once
/// until it answers again.
#[derive(Debug)]
pub struct ServingFinder {
    proc_root: PathBuf,
    /// Each process's declaration, read once (`None`: it declares none, or a bad one).
    probes: HashMap<u32, Option<Probe>>,
    seen: HashSet<u32>,
    failing: HashSet<String>,
}

impl ServingFinder {
    /// Reads processes' environments under `proc_root` (normally `/proc`).
    pub fn new(proc_root: PathBuf) -> Self {
        Self {
            proc_root,
            probes: HashMap::new(),
            seen: HashSet::new(),
            failing: HashSet::new(),
        }
    }

    /// The probe the first of `pids` that declares one declares.
    fn probe_of(&mut self, pids: &[u32]) -> Option<Probe> {
        pids.iter().find_map(|&pid| {
            self.seen.insert(pid);
            if let Some(known) = self.probes.get(&pid) {
                return known.clone();
            }
            let environ = std::fs::read(self.proc_root.join(pid.to_string()).join("environ"));
            // Unreadable (gone, or caught mid-exec): asked again next round.
            let environ = environ.ok().filter(|e| !e.is_empty())?;
            let probe = match Probe::from_environ(&environ) {
                None => None,
                Some(Ok(probe)) => Some(probe),
                Some(Err(e)) => {
                    tracing::warn!(pid, error = %e, "a GPU process declares a serving measure that cannot be read; its GPU is judged by its own measures");
                    None
                }
            };
            self.probes.insert(pid, probe.clone());
            probe
        })
    }

    /// Sets `serving_requests` of each sample whose processes (`pids`, by the sample's
    /// position in `samples`) declare a serving measure that could be read this round.
    pub fn fill(&mut self, samples: &mut [Sample], pids: &[(usize, Vec<u32>)]) {
        let wanted: Vec<(usize, Probe)> = pids
            .iter()
            .filter_map(|(at, pids)| Some((*at, self.probe_of(pids)?)))
            .collect();
        let mut endpoints: Vec<&Probe> = Vec::new();
        for (_, probe) in &wanted {
            if !endpoints.contains(&probe) {
                endpoints.push(probe);
            }
        }
        let values: Vec<Result<f64, ServingError>> = std::thread::scope(|scope| {
            let running: Vec<_> = endpoints
                .iter()
                .map(|probe| scope.spawn(|| probe.scrape()))
                .collect();
            running
                .into_iter()
                .map(|t| t.join().expect("a scrape does not panic"))
                .collect()
        });
        for (probe, value) in endpoints.iter().zip(&values) {
            match value {
                Ok(_) => {
                    if self.failing.remove(probe.url()) {
                        tracing::info!(url = probe.url(), "a serving endpoint answers again");
                    }
                }
                Err(e) => {
                    if self.failing.insert(probe.url().to_owned()) {
                        tracing::warn!(error = %e, "a serving endpoint cannot be read; its GPUs are judged by their own measures until it can");
                    }
                }
            }
        }
        for (at, probe) in &wanted {
            let i = endpoints
                .iter()
                .position(|p| *p == probe)
                .expect("listed above");
            if let (Some(sample), Ok(value)) = (samples.get_mut(*at), &values[i]) {
                sample.serving_requests = Some(value.max(0.0));
            }
        }
    }

    /// Drops processes not looked up since the last call, so a reused pid is read afresh.
    pub fn forget_unseen(&mut self) {
        let seen = std::mem::take(&mut self.seen);
        self.probes.retain(|pid, _| seen.contains(pid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM_PAGE: &str = "\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name=\"llama-3-8b\"} 3.0
vllm:num_requests_running{model_name=\"mistral-7b\"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name=\"llama-3-8b\"} 2.0 1733560000000
vllm:num_requests_waiting{model_name=\"mistral-7b\"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name=\"a \\\"quoted\\\" name\"} 0.42
";

    fn probe(expr: &str) -> Probe {
        Probe::new("http://127.0.0.1:8000/metrics", expr).unwrap()
    }

    #[test]
    fn selectors_add_up_matching_series() {
        let value = |expr| probe(expr).evaluate(VLLM_PAGE).unwrap();
        assert_eq!(value("vllm:num_requests_running"), 4.0);
        assert_eq!(
            value("vllm:num_requests_running + vllm:num_requests_waiting"),
            6.0
        );
        assert_eq!(
            value("vllm:num_requests_running{model_name=\"llama-3-8b\"}"),
            3.0
        );
        assert_eq!(
            value("vllm:num_requests_waiting{model_name!=\"llama-3-8b\"}"),
            0.0
        );
        assert_eq!(
            value("vllm:gpu_cache_usage_perc{model_name=\"a \\\"quoted\\\" name\"}"),
            0.42
        );
        // A series the server has not written yet counts as 0.
        assert_eq!(
            value("vllm:num_requests_swapped + vllm:num_requests_running"),
            4.0
        );
    }

    #[test]
    fn a_page_that_is_not_prometheus_text_names_its_line() {
        let err = probe("x").evaluate("# ok\nx 1\n<html>\n").unwrap_err();
        assert!(matches!(&err, ServingError::Page { line: 3, .. }), "{err}");
        let err = probe("x").evaluate("x{a=\"1} 2\n").unwrap_err();
        assert!(err.to_string().contains("no closing quote"), "{err}");
        let err = probe("x").evaluate("x{a=\"1\" 2\n").unwrap_err();
        assert!(err.to_string().contains("expected a label name"), "{err}");
    }

    #[test]
    fn declarations_are_read_from_the_environment_and_checked() {
        let env = b"PATH=/bin\0GPUWARDEN_SERVING_METRICS=http://10.0.0.7:9000\0GPUWARDEN_SERVING_EXPR=nv_inference_pending_request_count\0";
        let probe = Probe::from_environ(env).unwrap().unwrap();
        assert_eq!(
            (probe.host.as_str(), probe.port, probe.path.as_str()),
            ("10.0.0.7", 9000, "/metrics")
        );
        assert_eq!(Probe::from_environ(b"PATH=/bin\0"), None);
        let half = Probe::from_environ(b"GPUWARDEN_SERVING_EXPR=x\0").unwrap();
        assert!(half
            .unwrap_err()
            .to_string()
            .contains("GPUWARDEN_SERVING_METRICS is not"));
        for (url, why) in [
            ("https://h/metrics", "only plain http://"),
            ("http://:80/", "no host"),
            ("http://h:0/", "is not a port"),
            ("http://u:p@h/", "credentials"),
        ] {
            let err = Probe::new(url, "x").unwrap_err().to_string();
            assert!(err.contains(why), "{url}: {err}");
        }
        for (expr, why) in [
            ("", "an empty term"),
            ("a + ", "an empty term"),
            ("9lives", "does not start with a metric name"),
            ("a{b=c}", "not quoted"),
            ("a{b=\"c\"} d", "after `a`'s labels"),
        ] {
            let err = Probe::new("http://h/", expr).unwrap_err().to_string();
            assert!(err.contains(why), "{expr:?}: {err}");
        }
        let v6 = Probe::new("http://[::1]:8000/stats", "x").unwrap();
        assert_eq!(
            (v6.host.as_str(), v6.port, v6.path.as_str()),
            ("::1", 8000, "/stats")
        );
    }

    /// A real HTTP server on loopback, answering as a metrics endpoint does.
    fn serve(answer: &'static str, delay: Duration) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/metrics", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let mut stream = stream.unwrap();
                let mut request = [0u8; 1024];
                let _ = stream.read(&mut request);
                std::thread::sleep(delay);
                let _ = stream.write_all(answer.as_bytes());
            }
        });
        url
    }

    #[test]
    fn a_scrape_reads_a_real_endpoint_and_fails_cleanly() {
        let ok = serve(
            "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\r\n\
             vllm:num_requests_running{model_name=\"m\"} 2\n",
            Duration::ZERO,
        );
        let probe = Probe::new(&ok, "vllm:num_requests_running").unwrap();
        assert_eq!(probe.scrape(), Ok(2.0));

        let missing = serve("HTTP/1.0 404 Not Found\r\n\r\nno", Duration::ZERO);
        let err = Probe::new(&missing, "x").unwrap().scrape().unwrap_err();
        assert!(err.to_string().contains("HTTP status 404"), "{err}");

        let slow = serve("HTTP/1.0 200 OK\r\n\r\nx 1\n", SCRAPE_TIMEOUT * 2);
        let started = Instant::now();
        let err = Probe::new(&slow, "x").unwrap().scrape().unwrap_err();
        assert!(err.to_string().contains("within"), "{err}");
        assert!(started.elapsed() < SCRAPE_TIMEOUT * 2);
    }
}
