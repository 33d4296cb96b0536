//! The binary as an operator runs it: exit codes, what it prints, and its logging flags.

use std::path::PathBuf;
use std::process::{Command, Output};

// Of the support module, only the config builder and the PostgreSQL server (for `store copy`).
#[allow(dead_code, unreachable_pub)]
#[path = "support/config.rs"]
mod config;
#[allow(dead_code, unreachable_pub)]
#[path = "support/postgres.rs"]
mod pg;

use config::{Config, Team};

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

/// A libvirt substrate checked by a binary built without the `libvirt` feature fails the check
/// on the substrate's `driver` line, naming the substrate and the rebuild it needs, as `enforce`
/// would refuse it at start; a binary built with the feature accepts it. (This test runs the
/// binary built with the tests' own features: `cargo test` checks the first, `cargo test
/// --features libvirt` the second.)
#[test]
fn check_config_fails_a_libvirt_substrate_unless_the_binary_has_the_libvirt_driver() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vms.toml");
    std::fs::write(
        &file,
        "[[substrates]]\nname = \"vm-host-1\"\ndriver = \"libvirt\"\n[substrates.libvirt]\n\
         domain_template = \"/etc/gpuwarden/vm.xml\"\n",
    )
    .unwrap();
    let out = gpuwarden(&["check-config", file.to_str().unwrap()]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    if cfg!(feature = "libvirt") {
        assert!(out.status.success(), "{stdout}{stderr}");
        assert!(stdout.contains(": ok ("), "{stdout}");
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    let expected = format!(
        "{}:3:10: error: substrates[0].driver: substrate vm-host-1 cannot run here: this \
         gpuwarden was built without the libvirt driver; build it with `cargo build --release \
         --features libvirt` (needs libvirt's headers: Debian's libvirt-dev)",
        file.display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
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

/// Text logs as a log collector, a file or `grep` gets them: stderr is a pipe or a file, not a
/// terminal, so no ANSI colour escapes.
#[test]
fn text_logs_to_a_pipe_or_a_file_carry_no_colour_escapes() {
    let command = || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_gpuwarden"));
        command
            .args(["check-config", "/nonexistent.toml"])
            .env("RUST_LOG", "gpuwarden=debug")
            .env_remove("NO_COLOR")
            .env_remove("GPUWARDEN_LOG_FORMAT");
        command
    };
    let piped = text(&command().output().unwrap().stderr);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("stderr.log");
    let status = command()
        .stderr(std::fs::File::create(&file).unwrap())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(1));
    let filed = std::fs::read_to_string(&file).unwrap();
    for (to, stderr) in [("a pipe", piped), ("a file", filed)] {
        let logged: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("checking configuration"))
            .collect();
        assert_eq!(logged.len(), 1, "stderr to {to}:\n{stderr}");
        assert!(
            logged[0].contains(" DEBUG gpuwarden::cmd::check_config: checking configuration file=/nonexistent.toml"),
            "stderr to {to}: {:?}",
            logged[0]
        );
        assert!(!stderr.contains('\u{1b}'), "stderr to {to}: {stderr:?}");
    }
}

/// On a terminal (a pseudo-terminal from util-linux's `script`) text logs are coloured, unless
/// `NO_COLOR` is set to something.
#[test]
fn text_logs_on_a_terminal_are_coloured_unless_no_color_is_set() {
    let on_terminal = |no_color: Option<&str>| {
        let mut command = Command::new("script");
        command
            .args(["-q", "-e", "-c"])
            .arg(format!(
                "'{}' check-config /nonexistent.toml",
                env!("CARGO_BIN_EXE_gpuwarden")
            ))
            .arg("/dev/null")
            .env("RUST_LOG", "gpuwarden=debug")
            .env_remove("GPUWARDEN_LOG_FORMAT")
            .stdin(std::process::Stdio::null());
        match no_color {
            Some(value) => command.env("NO_COLOR", value),
            None => command.env_remove("NO_COLOR"),
        };
        let out = command.output().expect("script (util-linux) is installed");
        let terminal = text(&out.stdout);
        assert!(terminal.contains("checking configuration"), "{terminal}");
        terminal
    };
    let coloured = on_terminal(None);
    assert!(
        coloured.contains("\u{1b}[34mDEBUG\u{1b}[0m"),
        "{coloured:?}"
    );
    assert!(
        on_terminal(Some("")).contains('\u{1b}'),
        "an empty NO_COLOR is unset"
    );
    for value in ["1", "0"] {
        let plain = on_terminal(Some(value));
        assert!(!plain.contains('\u{1b}'), "NO_COLOR={value}: {plain:?}");
    }
}

/// `up` on a machine without NVML: the pipeline and the enforcer it started first stop again,
/// and it exits 1 with the collector's error, instead of hanging with the enforcer's threads.
#[test]
fn up_without_an_nvml_library_stops_what_it_started_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::new()
        .kafka("embedded")
        .data_dir(&dir.path().join("data"))
        .raw(
            r#"
[collector]
source = "nvml"
nvml_library = "/nonexistent/libnvidia-ml.so.1"
metrics_listen = "127.0.0.1:0"

[pipeline]
metrics_listen = "127.0.0.1:0"
"#,
        )
        .enforcer()
        .write(dir.path().join("gw.toml"));
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
    let file = Config::new()
        .team(Team::new("a", u32::MAX, 1.0))
        .team(Team::new("b", u32::MAX, 1.0))
        .write(dir.path().join("big.toml"));
    let out = gpuwarden(&["check-config", file.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("8589934590 GPUs of quota"), "{stdout}");
}

/// `gpuwarden sql` over an empty lake in `dir`: its output, its error output, and whether it
/// succeeded.
fn sql_on_empty_lake(dir: &std::path::Path, args: &[&str]) -> (String, String, bool) {
    let config = Config::new()
        .data_dir(&dir.join("data"))
        .write(dir.join("gw.toml"));
    let mut all = vec!["sql", "--config", config.to_str().unwrap()];
    all.extend_from_slice(args);
    let out = gpuwarden(&all);
    (text(&out.stdout), text(&out.stderr), out.status.success())
}

/// No rows: CSV still has its header (as `psql --csv` and DuckDB print it), JSON lines has no
/// line, and the table names the columns.
#[test]
fn sql_prints_the_header_of_an_empty_result_as_csv() {
    let dir = tempfile::tempdir().unwrap();
    let query = "SELECT lease_id, team, gpu_uuids FROM leases";
    let (csv, stderr, ok) = sql_on_empty_lake(dir.path(), &["--format", "csv", query]);
    assert!(ok, "{stderr}");
    assert_eq!(csv, "lease_id,team,gpu_uuids\n");
    // No batch at all (a filter that is always false): the header all the same.
    let (csv, _, ok) = sql_on_empty_lake(
        dir.path(),
        &["--format", "csv", "SELECT * FROM quarantine WHERE false"],
    );
    assert!(ok);
    assert_eq!(csv, "ts_ms,topic,partition,offset,field,reason,raw\n");
    let (json, _, ok) = sql_on_empty_lake(dir.path(), &["--format", "json", query]);
    assert!(ok);
    assert_eq!(json, "");
    let (table, _, ok) = sql_on_empty_lake(dir.path(), &[query]);
    assert!(ok);
    assert_eq!(table.trim(), "(lease_id, team, gpu_uuids) 0 rows");
}

/// information_schema lists the lake's tables and their columns, SHOW TABLES reads it, and a
/// query of it runs under the same limits as any other.
#[test]
fn sql_lists_the_lakes_tables_and_columns_in_information_schema() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, stderr, ok) = sql_on_empty_lake(
        dir.path(),
        &[
            "--format",
            "csv",
            "SELECT table_catalog, table_name, table_type FROM information_schema.tables \
             WHERE table_schema = 'public' ORDER BY table_name",
        ],
    );
    assert!(ok, "{stderr}");
    let expected: Vec<String> = [
        ("actions", "BASE TABLE"),
        ("clock_skew", "VIEW"),
        ("focus_costs", "BASE TABLE"),
        ("gpu_hourly", "BASE TABLE"),
        ("lease_events", "BASE TABLE"),
        ("lease_hourly", "BASE TABLE"),
        ("lease_usage", "VIEW"),
        ("leases", "BASE TABLE"),
        ("quarantine", "BASE TABLE"),
        ("samples", "BASE TABLE"),
        ("signals", "BASE TABLE"),
        ("team_hourly", "BASE TABLE"),
        ("teams", "BASE TABLE"),
        ("workloads", "BASE TABLE"),
    ]
    .iter()
    .map(|(name, kind)| format!("gpuwarden,{name},{kind}"))
    .collect();
    assert_eq!(
        tables.lines().collect::<Vec<_>>(),
        std::iter::once("table_catalog,table_name,table_type")
            .chain(expected.iter().map(String::as_str))
            .collect::<Vec<_>>()
    );

    let (columns, stderr, ok) = sql_on_empty_lake(
        dir.path(),
        &[
            "--format",
            "csv",
            "SELECT column_name, data_type, is_nullable FROM information_schema.columns \
             WHERE table_name = 'team_hourly' ORDER BY ordinal_position LIMIT 3",
        ],
    );
    assert!(ok, "{stderr}");
    assert_eq!(
        columns,
        "column_name,data_type,is_nullable\nhour,\"Timestamp(ms, \"\"UTC\"\")\",NO\n\
         team,Utf8,NO\ngpu_model,Utf8,NO\n"
    );

    let (shown, stderr, ok) = sql_on_empty_lake(dir.path(), &["--format", "csv", "SHOW TABLES"]);
    assert!(ok, "{stderr}");
    assert!(
        shown.contains("gpuwarden,public,lease_usage,VIEW"),
        "{shown}"
    );

    // Four copies of the ~200 columns cross-joined: far past a second, stopped at it.
    let (_, stderr, ok) = sql_on_empty_lake(
        dir.path(),
        &[
            "--timeout",
            "1s",
            "SELECT count(*) FROM information_schema.columns a, information_schema.columns b, \
             information_schema.columns c, information_schema.columns d",
        ],
    );
    assert!(!ok);
    assert!(
        stderr.contains("statement timeout (1s, --timeout)") && stderr.contains("57014"),
        "{stderr}"
    );
}

/// `store copy` as an operator runs it to move an enforcer's SQLite file to PostgreSQL: a help
/// that says what it copies and what it asks first, a table of what it copied, a non-empty
/// target refused, and a source an enforcer holds refused with what to do.
#[test]
fn store_copy_moves_an_sqlite_store_to_postgres_and_refuses_what_it_must() {
    use gpuwarden_enforcer::store::Store;

    let out = gpuwarden(&["store", "copy", "--help"]);
    assert!(out.status.success());
    // As one line: the help wraps to the terminal.
    let help = text(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    for expected in [
        "Stop every enforcer first",
        "The target must be empty",
        "outbox",
        "--to-password-file",
        "GPUWARDEN_STORE_COPY_TO_PASSWORD_FILE",
        "gpuwarden store copy --from /var/lib/gpuwarden/enforcer.db --to postgres://gpuwarden@",
    ] {
        assert!(
            help.contains(expected),
            "store copy --help lacks {expected}:\n{help}"
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("enforcer.db");
    let store = Store::open(&database).unwrap();
    store
        .block_team("ml", "budget_exceeded", 1_000)
        .wait()
        .unwrap();
    let pricing = gpuwarden_schema::config::PricingConfig::default();
    store
        .record_team_spend("ml", 12.5, 0.5, 2_000, &pricing)
        .wait()
        .unwrap();
    let url = pg::server().database();
    let password = dir.path().join("pg-password");
    std::fs::write(&password, "unused-with-trust\n").unwrap();
    let from = format!("sqlite:{}", database.display());
    let args = [
        "store",
        "copy",
        "--from",
        &from,
        "--to",
        &url,
        "--to-password-file",
        password.to_str().unwrap(),
    ];

    // The enforcer still runs.
    let out = gpuwarden(&args);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("in use by another enforcer") && stderr.contains("stop that enforcer"),
        "{stderr}"
    );
    drop(store);

    let out = gpuwarden(&args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stderr.contains("outbox: 1 rows copied"), "{stderr}");
    let table: Vec<String> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    for row in [
        "leases 0 rows",
        "outbox 1 rows",
        "blocked_teams 1 rows",
        "team_spend 1 rows",
        "rule_marks 0 rows",
    ] {
        assert!(
            table.iter().any(|l| l == row),
            "no line {row} in:\n{stdout}"
        );
    }
    let mut client = pg::Postgres::client(&url);
    let blocked: String = client
        .query_one("SELECT reason FROM blocked_teams WHERE team = 'ml'", &[])
        .unwrap()
        .get(0);
    assert_eq!(blocked, "budget_exceeded");

    // Again, onto what the first copy wrote.
    let out = gpuwarden(&args);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("is not empty (table outbox holds 1 rows, table blocked_teams holds 1 rows, table team_spend holds 1 rows)"),
        "{stderr}"
    );
}

/// A relative `storage.data_dir` (the example config's "gpuwarden-data") is taken from the
/// current directory: `ingest` writes the lake's Delta tables there and `sql` reads them back.
/// Delta's log stores take only absolute file URLs, which once turned every write of such a
/// lake into "Cannot infer storage location".
#[test]
fn a_relative_data_dir_is_a_lake_under_the_current_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("gw.toml"),
        "[storage]\ndata_dir = \"gpuwarden-data\"\n",
    )
    .unwrap();
    let lines: Vec<String> = (0..24)
        .map(|i| {
            format!(
                r#"{{"v":1,"ts_ms":{},"interval_ms":5000,"host":"h","gpu_uuid":"GPU-{}","gpu_model":"M","util_gpu_pct":50,"mem_used_bytes":1,"mem_total_bytes":2}}"#,
                1_767_225_600_000i64 + (i / 4) * 60_000,
                i % 4
            )
        })
        .collect();
    std::fs::write(dir.path().join("samples.jsonl"), lines.join("\n")).unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
            .args(args)
            .current_dir(dir.path())
            .env_remove("RUST_LOG")
            .env_remove("GPUWARDEN_CONFIG")
            .env_remove("GPUWARDEN_LOG_FORMAT")
            .output()
            .unwrap();
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{args:?}: {stdout}{stderr}");
        stdout + &stderr
    };
    let ingested = run(&["ingest", "-c", "gw.toml", "--samples", "samples.jsonl"]);
    assert!(
        ingested.contains("24 samples records read, 24 written"),
        "{ingested}"
    );
    assert!(dir
        .path()
        .join("gpuwarden-data/lake/samples/_delta_log/00000000000000000000.json")
        .exists());
    let counted = run(&[
        "sql",
        "-c",
        "gw.toml",
        "--format",
        "csv",
        "SELECT count(*) AS n FROM samples",
    ]);
    assert!(counted.contains("n\n24\n"), "{counted}");
}
