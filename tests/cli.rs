//! The binary as an operator runs it: exit codes, what it prints, and its logging flags.

use std::path::PathBuf;
use std::process::{Command, Output};

fn gpuwarden(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("GPUWARDEN_CONFIG")
        .env_remove("GPUWARDEN_LOG_FORMAT")
        .output()
        .expect("runs the gpuwarden binary")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn check_config_accepts_the_example_and_summarises_it() {
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/gpuwarden.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .arg("check-config")
        .arg(&example)
        .env("GPUWARDEN_SQL_PASSWORD", "secret")
        .env(
            "GPUWARDEN_SIGNING_KEY",
            "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0",
        )
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains(": ok (kafka embedded, 2 teams, 24 GPUs of quota"),
        "{stdout}"
    );
}

#[test]
fn check_config_reports_every_error_with_its_line_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        "[collector]\ninterval = \"5 parsecs\"\n\n[enforcer]\nlisten = \"127.0.0.1:8080\"\nmood = \"strict\"\n",
    )
    .unwrap();
    let out = gpuwarden(&["check-config", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let name = file.display();
    assert!(
        stderr.contains(&format!("{name}: 2 errors in the configuration")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "{name}:2:12: error: collector.interval: invalid duration \"5 parsecs\""
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "{name}:6:1: error: enforcer.mood: unknown key `mood`"
        )),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "errors go to stderr");
}

#[test]
fn check_config_on_a_missing_file_fails_with_a_reason() {
    let out = gpuwarden(&["check-config", "/nonexistent/gpuwarden.toml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("cannot read the file"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn version_and_help_teach_the_tool() {
    let out = gpuwarden(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        text(&out.stdout).trim(),
        format!("gpuwarden {}", env!("CARGO_PKG_VERSION"))
    );

    let out = gpuwarden(&["--help"]);
    let help = text(&out.stdout);
    assert!(out.status.success());
    for expected in [
        "check-config",
        "--log-format",
        "RUST_LOG",
        "examples/gpuwarden.toml",
    ] {
        assert!(help.contains(expected), "--help lacks {expected}:\n{help}");
    }
    let out = gpuwarden(&["check-config", "--help"]);
    assert!(
        text(&out.stdout).contains("GPUWARDEN_CONFIG"),
        "flags name their environment variable"
    );
}

#[test]
fn a_usage_error_exits_2_with_clap_message() {
    let out = gpuwarden(&["no-such-command"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("unrecognized subcommand"));
}

#[test]
fn json_log_format_writes_one_json_object_per_line() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["--log-format", "json", "check-config", "/nonexistent.toml"])
        .env("RUST_LOG", "debug")
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    let logs: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(!logs.is_empty(), "no JSON log line in:\n{stderr}");
    assert!(
        logs.iter()
            .all(|l| l.get("level").is_some() && l.get("timestamp").is_some()),
        "{logs:?}"
    );
}

/// `up` on a machine without NVML: the pipeline and the enforcer it started first stop again,
/// and it exits 1 with the collector's error, instead of hanging with the enforcer's threads.
#[test]
fn up_without_an_nvml_library_stops_what_it_started_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gw.toml");
    std::fs::write(
        &config,
        format!(
            "[kafka]\nbrokers = \"embedded\"\n[storage]\ndata_dir = \"{}\"\n\
             [collector]\nsource = \"nvml\"\nnvml_library = \"/nonexistent/libnvidia-ml.so.1\"\n\
             metrics_listen = \"127.0.0.1:0\"\n[pipeline]\nmetrics_listen = \"127.0.0.1:0\"\n\
             [enforcer]\nlisten = \"127.0.0.1:0\"\n",
            dir.path().join("data").display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["up", "--config", config.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("`up` still runs 60 s after its collector failed to start");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("error: starting the collector") && stderr.contains("libnvidia-ml.so.1"),
        "{stderr}"
    );
}

/// Quotas are summed wide enough: two teams of the largest quota add up, not overflow.
#[test]
fn check_config_sums_the_largest_quotas_without_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big.toml");
    let team = |name: &str| {
        format!("[[teams]]\nname = \"{name}\"\ngpu_quota = 4294967295\nmonthly_budget_usd = 1.0\n")
    };
    std::fs::write(&file, format!("{}{}", team("a"), team("b"))).unwrap();
    let out = gpuwarden(&["check-config", file.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("8589934590 GPUs of quota"), "{stdout}");
}
