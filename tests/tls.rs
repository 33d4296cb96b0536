//! TLS on the admission API and the SQL endpoint, driven with the clients an operator uses:
//! curl against the enforcer, psql with `sslmode=verify-full` against the pipeline, and the
//! `gpuwarden` self-service commands with `--ca-cert`. The CAs and certificates are made by the
//! openssl command line (tests/support/pki.rs). Also: a renewed certificate is served without a
//! restart, client certificates are enforced when configured, and plain TCP off loopback needs
//! an explicit opt-in.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use support::pki::{Ca, Leaf};
use support::{eventually, Config, Running, Substrate, Team, Workload, H100};

const TOKEN: &str = "ada-secret-token";
const SQL_PASSWORD: &str = "sql-secret";

/// Team `ml` with member ada (a member token), a simulated fleet of 8 H100s for training, and
/// `extra` appended (the TLS sections).
fn write_config(dir: &Path, extra: &str) -> PathBuf {
    Config::new()
        .data_dir(&dir.join("data"))
        .raw(&format!(
            r#"
[pipeline]
sql_listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"

[[pipeline.sql_users]]
name = "finops"
password = "{SQL_PASSWORD}"
"#
        ))
        .team(Team::new("ml", 4, 100000.0).members(&["ada"]))
        .workload(
            Workload::new("training")
                .max_gpus(8)
                .max_duration("24h")
                .substrates(&["sim"]),
        )
        .substrate(Substrate::simulated("sim").hosts("h", 1, 8, H100))
        .token("ada", TOKEN, "member", &["ml"])
        .raw(extra)
        .write(dir.join("gpuwarden.toml"))
}

/// The enforcer section, on a free port of 127.0.0.1, with TLS from `cert`/`key` and `more`.
fn enforcer_tls(dir: &Path, more: &str) -> String {
    format!(
        "[enforcer]\nlisten = \"127.0.0.1:0\"\n\n[enforcer.tls]\ncert = \"{}\"\nkey = \"{}\"\n{more}",
        dir.join("api.pem").display(),
        dir.join("api.key").display(),
    )
}

/// Starts the enforcer; returns it and its API's URL as it logs it.
fn start_enforcer(config: &Path) -> (Running, String) {
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let line = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = line["api"].as_str().expect("the api field").to_string();
    (enforcer, api)
}

/// curl, with no CA bundle but the ones given in `args`; returns its output.
fn curl(args: &[&str]) -> Output {
    Command::new("curl")
        .args(["-sS", "--max-time", "10", "-w", "\n%{http_code}"])
        .args(args)
        .env_remove("CURL_CA_BUNDLE")
        .env_remove("SSL_CERT_FILE")
        .env_remove("SSL_CERT_DIR")
        .output()
        .expect("curl is installed")
}

/// The body and status of a curl that must have succeeded.
#[track_caller]
fn curl_ok(args: &[&str]) -> (String, u16) {
    let out = curl(args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "curl {args:?} failed: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (body, status) = text.rsplit_once('\n').unwrap();
    (body.trim_end().to_string(), status.parse().unwrap())
}

/// curl's exit code and error of a call that must fail.
#[track_caller]
fn curl_fails(args: &[&str]) -> (i32, String) {
    let out = curl(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "curl {args:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    (out.status.code().unwrap_or(-1), stderr)
}

fn https_port(api: &str) -> String {
    let port = api
        .strip_prefix("https://127.0.0.1:")
        .unwrap_or_else(|| panic!("the API is not served over https on 127.0.0.1: {api}"));
    port.to_string()
}

/// `https://localhost:PORT<path>`, with `localhost` resolved to 127.0.0.1 (it may be ::1 first).
fn localhost(port: &str, path: &str) -> Vec<String> {
    vec![
        "--resolve".into(),
        format!("localhost:{port}:127.0.0.1"),
        format!("https://localhost:{port}{path}"),
    ]
}

fn args(list: &[String]) -> Vec<&str> {
    list.iter().map(String::as_str).collect()
}

/// Runs a self-service command against `api`.
fn cli(api: &str, args: &[&str]) -> Output {
    support::self_service(api, TOKEN, args)
}

#[test]
fn the_api_serves_https_with_its_certificate_and_a_renewed_one_without_restart() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (first, second) = (Ca::new(d, "first-ca"), Ca::new(d, "second-ca"));
    first
        .server("api")
        .install(&d.join("api.pem"), &d.join("api.key"));
    let config = write_config(d, &enforcer_tls(d, ""));
    let (enforcer, api) = start_enforcer(&config);
    let port = https_port(&api);
    let ca = first.cert.to_str().unwrap();

    // Trusted through the CA, by name and by address.
    let mut healthz = vec!["--cacert".to_string(), ca.to_string()];
    healthz.extend(localhost(&port, "/healthz"));
    let (health, status) = curl_ok(&args(&healthz));
    assert_eq!(
        (health.lines().next(), status),
        (Some("ok"), 200),
        "{health}"
    );
    let by_address = format!("https://127.0.0.1:{port}/healthz");
    assert_eq!(curl_ok(&["--cacert", ca, &by_address]).1, 200);

    // An authenticated admission over https.
    let mut admission = vec![
        "--cacert".to_string(),
        ca.to_string(),
        "-H".into(),
        format!("Authorization: Bearer {TOKEN}"),
        "-H".into(),
        "Content-Type: application/json".into(),
        "-d".into(),
        r#"{"team":"ml","user":"ada","project":"p","workload":"training","gpus":1,"duration":"1h"}"#
            .into(),
    ];
    admission.extend(localhost(&port, "/v1/admission"));
    let (body, status) = curl_ok(&args(&admission));
    assert_eq!(status, 200, "{body}");
    let decision: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(decision["decision"], "admitted", "{body}");

    // Without the CA the certificate cannot be verified (curl's 60); plain HTTP gets no HTTP
    // answer, only rustls's alert (curl: "Received HTTP/0.9") or a closed connection.
    let (code, error) = curl_fails(&args(&localhost(&port, "/healthz")));
    assert_eq!(code, 60, "{error}");
    let plain = format!("http://127.0.0.1:{port}/healthz");
    let (code, error) = curl_fails(&[&plain]);
    assert!(matches!(code, 1 | 52 | 56), "curl exit {code}: {error}");

    // The command line: with --ca-cert it works, without it the certificate is refused.
    let listed = cli(&api, &["leases", "--ca-cert", ca]);
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains("training"),
        "{}",
        String::from_utf8_lossy(&listed.stdout)
    );
    let refused = cli(&api, &["leases"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains(&format!("calling GET {api}/v1/leases")),
        "{stderr}"
    );

    // Renewal: a certificate from another CA is written over the files, and served.
    second
        .server("api")
        .install(&d.join("api.pem"), &d.join("api.key"));
    let renewed = second.cert.to_str().unwrap();
    eventually(
        "the renewed certificate served",
        Duration::from_secs(20),
        || {
            let out = curl(&["--cacert", renewed, &by_address]);
            if out.status.success() {
                Ok(())
            } else {
                Err(String::from_utf8_lossy(&out.stderr).into_owned())
            }
        },
    );
    let (code, _) = curl_fails(&["--cacert", ca, &by_address]);
    assert_eq!(code, 60, "the old CA no longer verifies the server");

    // A broken renewal keeps the renewed certificate, and is counted on /metrics.
    std::fs::write(d.join("api.pem"), "not a certificate\n").unwrap();
    let metrics = format!("https://127.0.0.1:{port}/metrics");
    eventually(
        "the refused reload counted",
        Duration::from_secs(20),
        || {
            let (page, _) = curl_ok(&["--cacert", renewed, &metrics]);
            let wanted = [
                "gpuwarden_tls_reloads_total{listener=\"api\",result=\"ok\"} 1",
                "gpuwarden_tls_reloads_total{listener=\"api\",result=\"error\"} 1",
            ];
            if wanted.iter().all(|w| page.lines().any(|l| l == *w)) {
                Ok(())
            } else {
                Err(page
                    .lines()
                    .filter(|l| l.contains("gpuwarden_tls"))
                    .collect::<Vec<_>>()
                    .join("\n"))
            }
        },
    );
    assert_eq!(curl_ok(&["--cacert", renewed, &by_address]).1, 200);

    let (status, log) = enforcer.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));
    let refusal = log
        .iter()
        .find(|l| l.contains("the new TLS certificate or key does not load"))
        .unwrap_or_else(|| panic!("no reload error logged:\n{}", log.join("\n")));
    let cert = d.join("api.pem").display().to_string();
    assert!(
        refusal.contains("\"level\":\"ERROR\"")
            && refusal.contains(&format!("enforcer.tls.cert: {cert}: holds no certificate")),
        "{refusal}"
    );
}

#[test]
fn client_certificates_are_required_when_configured() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (servers, clients) = (Ca::new(d, "servers"), Ca::new(d, "clients"));
    servers
        .server("api")
        .install(&d.join("api.pem"), &d.join("api.key"));
    let client_ca = format!("client_ca = \"{}\"\n", clients.cert.display());
    let config = write_config(d, &enforcer_tls(d, &client_ca));
    let (_enforcer, api) = start_enforcer(&config);
    let url = format!("{api}/healthz");
    let ca = servers.cert.to_str().unwrap();

    let (code, error) = curl_fails(&["--cacert", ca, &url]);
    assert!(matches!(code, 35 | 56), "curl exit {code}: {error}");

    let ada: Leaf = clients.client("ada");
    let (cert, key) = (ada.cert.to_str().unwrap(), ada.key.to_str().unwrap());
    let (health, status) = curl_ok(&["--cacert", ca, "--cert", cert, "--key", key, &url]);
    assert_eq!(
        (health.lines().next(), status),
        (Some("ok"), 200),
        "{health}"
    );

    // A certificate from a CA the enforcer does not trust for clients is refused as well.
    let stranger = servers.client("eve");
    let (code, error) = curl_fails(&[
        "--cacert",
        ca,
        "--cert",
        stranger.cert.to_str().unwrap(),
        "--key",
        stranger.key.to_str().unwrap(),
        &url,
    ]);
    assert!(matches!(code, 35 | 56), "curl exit {code}: {error}");

    let listed = cli(
        &api,
        &[
            "leases",
            "--ca-cert",
            ca,
            "--client-cert",
            cert,
            "--client-key",
            key,
        ],
    );
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let without = cli(&api, &["leases", "--ca-cert", ca]);
    assert!(!without.status.success());
}

/// psql with `conninfo` (host, sslmode, …) added to the port, user and database; no
/// environment, never a prompt.
fn psql(port: u16, conninfo: &str, sql: &str) -> Output {
    let mut command = Command::new("psql");
    for (name, _) in std::env::vars() {
        if name.starts_with("PG") {
            command.env_remove(name);
        }
    }
    command
        .arg(format!(
            "port={port} user=finops dbname=gpuwarden connect_timeout=10 {conninfo}"
        ))
        .args(["-X", "-w", "-A", "-t", "-v", "VERBOSITY=verbose", "-c", sql])
        .env("PGPASSWORD", SQL_PASSWORD)
        .env("PGPASSFILE", "/dev/null")
        .output()
        .expect("psql (postgresql-client) is installed")
}

#[test]
fn the_sql_endpoint_serves_tls_verified_by_psql_and_refuses_logins_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (ca, other) = (Ca::new(d, "ca"), Ca::new(d, "other"));
    ca.server("sql")
        .install(&d.join("sql.pem"), &d.join("sql.key"));
    let config = write_config(
        d,
        &format!(
            "[pipeline.sql_tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            d.join("sql.pem").display(),
            d.join("sql.key").display()
        ),
    );
    let (pipeline, port) = support::start_pipeline_with_sql(&config);
    let host = "host=localhost hostaddr=127.0.0.1";

    let verified = format!(
        "{host} sslmode=verify-full sslrootcert={}",
        ca.cert.display()
    );
    let out = psql(port, &verified, "SELECT 40 + 2");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42");

    // Without TLS: refused before the password is asked for (psql shows no SQLSTATE for a
    // connection it could not open; the message is the endpoint's).
    let out = psql(port, &format!("{host} sslmode=disable"), "SELECT 1");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("FATAL:  the SQL endpoint requires TLS (pipeline.sql_tls)"),
        "{stderr}"
    );

    // A client that trusts another CA does not accept the endpoint's certificate.
    let out = psql(
        port,
        &format!(
            "{host} sslmode=verify-full sslrootcert={}",
            other.cert.display()
        ),
        "SELECT 1",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("certificate verify failed"),
        "{stderr}"
    );
    drop(pipeline);
}

#[test]
fn plain_tcp_off_loopback_needs_the_explicit_opt_in() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = write_config(d, "[enforcer]\nlisten = \"0.0.0.0:0\"\n");
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["check-config", config.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("error: enforcer.listen: 0.0.0.0:0 is not a loopback address")
            && stderr.contains("enforcer.insecure_plaintext = true"),
        "{stderr}"
    );

    // --listen moves a loopback config off loopback: refused at start, naming the setting.
    let config = write_config(d, "[enforcer]\nlisten = \"127.0.0.1:0\"\n");
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["enforce", "--config", config.to_str().unwrap()])
        .args(["--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("enforcer.insecure_plaintext = true"),
        "{stderr}"
    );

    // With the opt-in it serves plain HTTP there.
    let config = write_config(
        d,
        "[enforcer]\nlisten = \"0.0.0.0:0\"\ninsecure_plaintext = true\n",
    );
    let (_enforcer, api) = start_enforcer(&config);
    let port = api.rsplit_once(':').unwrap().1;
    assert!(api.starts_with("http://"), "{api}");
    let (status, body) = support::http_get(&format!("127.0.0.1:{port}"), "/healthz");
    assert_eq!((status, body.lines().next()), (200, Some("ok")), "{body}");

    // A TLS section whose files are missing names the field and the file.
    let config = write_config(d, &enforcer_tls(d, ""));
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["enforce", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains(&format!(
                "enforcer.tls.cert: cannot read {}",
                d.join("api.pem").display()
            )),
        "{stderr}"
    );
}
