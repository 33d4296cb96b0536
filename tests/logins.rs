//! Failed logins, limited as a client meets them: `gpuwarden enforce` driven with curl (wrong
//! bearer tokens lock their source address out with 429 and `Retry-After`; a good token from
//! another address still works) and `gpuwarden pipeline`'s SQL endpoint driven with psql (wrong
//! passwords lock the user out, then the address; SQLSTATE 28000 before any SCRAM exchange).
//! Both count what happened on `/metrics`, which promtool accepts.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::psql::{error_fields, RawClient};
use support::{Config, Psql, Running, Team};

const TOKEN: &str = "ada-secret-token";

/// An HTTP answer as curl saw it.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: not JSON: {}", self.body))
    }
}

/// curl `url`, from the local address `from` when given, with `token` when given.
fn curl(url: &str, from: Option<&str>, token: Option<&str>) -> Answer {
    let mut command = Command::new("curl");
    command.args(["-sS", "-i", "--max-time", "10"]);
    if let Some(from) = from {
        command.args(["--interface", from]);
    }
    if let Some(token) = token {
        command.args(["-H", &format!("Authorization: Bearer {token}")]);
    }
    let out = command.arg(url).output().expect("curl is installed");
    assert!(
        out.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("headers and a body");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_string(),
    }
}

/// The value of `series` (name and labels) in Prometheus text.
fn series(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{metrics}"))
}

/// `promtool check metrics` on `metrics` must pass.
fn promtool_accepts(dir: &Path, metrics: &str) {
    let file = dir.join("metrics.prom");
    std::fs::write(&file, metrics).unwrap();
    let out = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .expect("promtool is installed (Debian's prometheus package; .ci/run installs it)");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn wrong_bearer_tokens_lock_their_address_out_with_429_and_retry_after() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::new()
        .kafka("embedded")
        .data_dir(&dir.path().join("data"))
        .team(Team::new("ml", 4, 1000.0).members(&["ada"]))
        .enforcer()
        .raw(
            r#"
[enforcer]
login_limits = { max_failures = 100, max_failures_per_source = 3, window = "1m" }
"#,
        )
        .token("ada", TOKEN, "member", &["ml"])
        .write(dir.path().join("gpuwarden.toml"));
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let line = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = line["api"].as_str().expect("the api field").to_string();
    let leases = format!("{api}/v1/leases");

    // 127.0.0.1 and 127.0.0.2 are two sources to the enforcer (both are this host's).
    let attacker = Some("127.0.0.1");
    let answer = curl(&leases, attacker, Some(TOKEN));
    assert_eq!(answer.status, 200, "{}", answer.body);
    for guess in ["guess-1", "guess-2", "guess-3"] {
        let answer = curl(&leases, attacker, Some(guess));
        assert_eq!(answer.status, 401, "{guess}: {}", answer.body);
        assert_eq!(answer.header("www-authenticate"), Some("Bearer"));
    }
    // Locked out: even the good token is answered 429, unchecked, with when to come back.
    let answer = curl(&leases, attacker, Some(TOKEN));
    assert_eq!(answer.status, 429, "{}", answer.body);
    let retry: u64 = answer
        .header("retry-after")
        .expect("a Retry-After header")
        .parse()
        .unwrap();
    assert!((59..=60).contains(&retry), "Retry-After: {retry}");
    let body = answer.json();
    assert_eq!(body["error"]["code"], "too_many_failed_logins");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("too many failed logins from this address; try again in"),
        "{body}"
    );
    // Another address with the good token is let in; /healthz and /metrics need no token.
    let answer = curl(&leases, Some("127.0.0.2"), Some(TOKEN));
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(curl(&format!("{api}/healthz"), attacker, None).status, 200);
    let metrics = curl(&format!("{api}/metrics"), attacker, None);
    assert_eq!(metrics.status, 200);
    let metrics = metrics.body;
    for (name, value) in [
        ("gpuwarden_enforcer_login_failures_total", 3.0),
        (
            "gpuwarden_enforcer_login_lockouts_total{scope=\"source\"}",
            1.0,
        ),
        (
            "gpuwarden_enforcer_login_lockouts_total{scope=\"principal\"}",
            0.0,
        ),
        (
            "gpuwarden_enforcer_logins_refused_total{scope=\"source\"}",
            1.0,
        ),
    ] {
        assert_eq!(series(&metrics, name), value, "{name}");
    }
    promtool_accepts(dir.path(), &metrics);

    let (status, log) = enforcer.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));
    assert!(
        log.iter().any(|l| l.contains("too many failed API logins")
            && l.contains("127.0.0.1")
            && l.contains("\"source\"")),
        "the lockout is logged with its address:\n{}",
        log.join("\n")
    );
}

/// The first message the SQL endpoint answers a startup message for `user` with: its type, and
/// for an ErrorResponse its SQLSTATE and message (psql does not print the SQLSTATE of a refused
/// connection).
fn startup_answer(port: u16, user: &str) -> (u8, String, String) {
    let (kind, body) = RawClient::start(port, user)
        .next()
        .expect("an answer to the startup message");
    let (code, text) = if kind == b'E' {
        error_fields(&body)
    } else {
        (String::new(), String::new())
    };
    (kind, code, text)
}

#[test]
fn wrong_sql_passwords_lock_the_user_out_then_the_address() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::new()
        .kafka("embedded")
        .data_dir(&dir.path().join("data"))
        .raw(
            r#"
[pipeline]
login_limits = { max_failures = 3, max_failures_per_source = 6, window = "1m" }

[[pipeline.sql_users]]
name = "finops"
password = "correct horse"

[[pipeline.sql_users]]
name = "grafana"
password = "battery staple"
"#,
        )
        .write(dir.path().join("gpuwarden.toml"));
    let (pipeline, running) = support::start_pipeline_serving_sql(&config);
    let port = support::sql_port(&running);
    let metrics_url = running["metrics"].as_str().expect("the metrics field");
    let refused = |user: &str, password: &str| {
        let out = Psql::new(port, user, Some(password)).run("SELECT 1");
        assert!(!out.status.success(), "{user} got in");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };

    assert_eq!(
        Psql::new(port, "finops", Some("correct horse")).one("SELECT 1"),
        "1"
    );
    for i in 0..3 {
        let error = refused("finops", "incorrect horse");
        assert!(
            error.contains("password authentication failed for user \"finops\""),
            "failure {i}: {error}"
        );
    }
    // finops is locked out: the right password is refused too, and before any SCRAM exchange
    // (the startup message is answered with an error, not a SASL request).
    let error = refused("finops", "correct horse");
    assert!(
        error.contains("too many failed logins for user \"finops\"; try again in"),
        "{error}"
    );
    let (kind, code, message) = startup_answer(port, "finops");
    assert_eq!(kind, b'E', "answered with a {:?} message", kind as char);
    assert_eq!(code, "28000", "{message}");
    let seconds: u64 = message
        .rsplit_once("try again in ")
        .and_then(|(_, s)| s.strip_suffix(" s"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no time to wait in {message:?}"));
    assert!((1..=60).contains(&seconds), "{message}");

    // Another user from the same address is not locked out (the address has 3 of its 6) ...
    assert_eq!(
        Psql::new(port, "grafana", Some("battery staple")).one("SELECT 2"),
        "2"
    );
    // ... until three more failures, whatever users they try, lock the address out.
    for user in ["mallory", "eve", "trudy"] {
        let error = refused(user, "guess");
        assert!(error.contains("password authentication failed"), "{error}");
    }
    let error = refused("grafana", "battery staple");
    assert!(
        error.contains("too many failed logins from this address; try again in"),
        "{error}"
    );

    let (status, metrics) = support::http_get(
        metrics_url
            .trim_start_matches("http://")
            .trim_end_matches("/metrics"),
        "/metrics",
    );
    assert_eq!(status, 200);
    for (name, value) in [
        ("gpuwarden_pipeline_sql_login_failures_total", 6.0),
        (
            "gpuwarden_pipeline_sql_login_lockouts_total{scope=\"principal\"}",
            1.0,
        ),
        (
            "gpuwarden_pipeline_sql_login_lockouts_total{scope=\"source\"}",
            1.0,
        ),
        (
            "gpuwarden_pipeline_sql_logins_refused_total{scope=\"principal\"}",
            2.0,
        ),
        (
            "gpuwarden_pipeline_sql_logins_refused_total{scope=\"source\"}",
            1.0,
        ),
    ] {
        assert_eq!(series(&metrics, name), value, "{name}");
    }
    promtool_accepts(dir.path(), &metrics);

    let (status, log) = pipeline.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));
}
