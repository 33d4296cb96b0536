//! The config file as an operator meets it: the shipped example is valid, and every mistake is
//! reported with its line, column and field path, all of them in one run.

use std::path::PathBuf;
use std::time::Duration;

use gpuwarden_schema::config::{
    self, CollectorSource, ConfigError, EnforcerMode, IdleMeasure, LakeLocation, OnIdle,
};
use gpuwarden_schema::Workload;

fn errors(text: &str) -> Vec<ConfigError> {
    match config::parse("test.toml", text) {
        Ok(_) => panic!("config was accepted:\n{text}"),
        Err(e) => e.errors,
    }
}

fn find<'a>(errors: &'a [ConfigError], path: &str) -> &'a ConfigError {
    errors
        .iter()
        .find(|e| e.path == path)
        .unwrap_or_else(|| panic!("no error at `{path}` in {errors:#?}"))
}

#[test]
fn the_shipped_example_is_valid() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/gpuwarden.toml");
    std::env::set_var("GPUWARDEN_SQL_PASSWORD", "from-the-environment");
    std::env::set_var(
        "GPUWARDEN_SIGNING_KEY",
        "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0",
    );
    let config = config::load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.collector.source, CollectorSource::Simulated);
    assert_eq!(config.collector.interval, Duration::from_secs(5));
    assert_eq!(
        config.pipeline.sql_users[0].password,
        "from-the-environment"
    );
    assert_eq!(config.workload(Workload::Notebook).on_idle, OnIdle::Reclaim);
    assert_eq!(
        config.workload(Workload::Notebook).idle_timeout,
        Some(Duration::from_secs(1800))
    );
    assert_eq!(config.enforcer.mode, EnforcerMode::Enforce);
    assert_eq!(
        config.pricing.usd_per_gpu_hour("NVIDIA A100-SXM4-80GB"),
        3.2
    );
    assert_eq!(
        config.pricing.usd_per_gpu_hour("NVIDIA A100-SXM4-40GB"),
        2.6
    );
    assert_eq!(config.substrates[0].hosts.len(), 3);
    assert_eq!(
        config.lake(),
        Ok(LakeLocation::Directory(PathBuf::from(
            "gpuwarden-data/lake"
        )))
    );
}

#[test]
fn an_empty_file_is_all_defaults() {
    let config = config::parse("empty.toml", "").unwrap();
    assert!(config.kafka.is_embedded());
    assert_eq!(config.collector.interval, Duration::from_secs(5));
    assert_eq!(config.pricing.idle_util_pct, 5.0);
    assert_eq!(config.pipeline.signals.every, Duration::from_secs(30));
    assert_eq!(config.pipeline.signals.window, Duration::from_secs(900));
}

#[test]
fn unknown_key_and_bad_duration_are_both_reported_with_their_lines() {
    let text = "\
[collector]
interval = \"5 parsecs\"
sampling_rate = 3
";
    let errs = errors(text);
    assert_eq!(errs.len(), 2, "{errs:#?}");
    let unknown = find(&errs, "collector.sampling_rate");
    assert_eq!((unknown.line, unknown.column), (Some(3), Some(1)));
    assert!(
        unknown.message.contains("unknown key `sampling_rate`"),
        "{}",
        unknown.message
    );
    assert!(
        unknown.message.contains("`interval`"),
        "lists the keys that exist: {}",
        unknown.message
    );
    let duration = find(&errs, "collector.interval");
    assert_eq!((duration.line, duration.column), (Some(2), Some(12)));
    assert!(
        duration.message.contains("invalid duration \"5 parsecs\""),
        "{}",
        duration.message
    );
}

#[test]
fn errors_across_sections_and_list_items_are_all_found() {
    let text = "\
[kafka]
brokers = \"k1:9092\"
colour = \"blue\"

[collector]
source = \"nvm\"

[[teams]]
name = \"a\"
gpu_quota = -1
monthly_budget_usd = 1.0

[[teams]]
name = \"b\"
monthly_budget_usd = 1.0

[workloads.gaming]
max_gpus = 1

[bogus]
x = 1
";
    let errs = errors(text);
    let line = |path: &str| find(&errs, path).line;
    assert_eq!(line("kafka.colour"), Some(3));
    assert_eq!(line("collector.source"), Some(6));
    assert_eq!(line("teams[0].gpu_quota"), Some(10));
    assert!(find(&errs, "teams[1]")
        .message
        .contains("missing required key `gpu_quota`"));
    assert_eq!(line("teams[1]"), Some(13));
    assert_eq!(line("workloads.gaming"), Some(17));
    assert_eq!(line("bogus"), Some(20));
    assert_eq!(errs.len(), 6, "{errs:#?}");
    let lines: Vec<_> = errs.iter().map(|e| e.line).collect();
    let mut sorted = lines.clone();
    sorted.sort();
    assert_eq!(lines, sorted, "errors are reported in file order");
}

#[test]
fn rules_across_sections_name_the_field_at_fault() {
    let text = "\
[[teams]]
name = \"ml\"
gpu_quota = 8
monthly_budget_usd = 100.0

[[teams]]
name = \"ml\"
gpu_quota = 8
monthly_budget_usd = -5.0

[workloads.notebook]
idle_timeout = \"10m\"
warn_before = \"20m\"
on_idle = \"resize\"
substrates = [\"nowhere\"]

[[substrates]]
name = \"sim\"
driver = \"simulated\"
url = \"http://x\"

[[tokens]]
name = \"bot\"
sha256 = \"abc\"
role = \"member\"
teams = [\"ghosts\"]

[pricing]
idle_util_pct = 150
";
    let errs = errors(text);
    assert!(find(&errs, "teams[1].name")
        .message
        .contains("defined twice"));
    assert_eq!(find(&errs, "teams[1].name").line, Some(7));
    assert!(find(&errs, "teams[1].monthly_budget_usd")
        .message
        .contains("negative"));
    assert!(find(&errs, "workloads.notebook.warn_before")
        .message
        .contains("shorter than idle_timeout"));
    assert!(find(&errs, "workloads.notebook.on_idle")
        .message
        .contains("min_gpus"));
    assert_eq!(
        find(&errs, "workloads.notebook.substrates[0]").line,
        Some(15)
    );
    assert!(find(&errs, "substrates[0].url")
        .message
        .contains("not a setting of the simulated driver"));
    assert!(find(&errs, "substrates[0].driver")
        .message
        .contains("needs `hosts`"));
    assert!(find(&errs, "tokens[0].sha256")
        .message
        .contains("64 lowercase hex"));
    assert!(find(&errs, "tokens[0].teams[0]")
        .message
        .contains("no team is named `ghosts`"));
    assert_eq!(find(&errs, "pricing.idle_util_pct").line, Some(29));
}

#[test]
fn the_slurm_cluster_is_optional_and_must_be_lease_id_safe() {
    let config =
        config::parse("ok.toml", "[collector]\nslurm_cluster = \"Study.2_b-c\"\n").unwrap();
    assert_eq!(
        config.collector.slurm_cluster.as_deref(),
        Some("Study.2_b-c")
    );
    assert_eq!(
        config::parse("empty.toml", "")
            .unwrap()
            .collector
            .slurm_cluster,
        None
    );

    let long = "c".repeat(41);
    for bad in ["", "a/b", "gpu cluster", "a'b", long.as_str()] {
        let text =
            format!("[kafka]\nbrokers = \"k:9092\"\n\n[collector]\nslurm_cluster = \"{bad}\"\n");
        let errs = errors(&text);
        assert_eq!(errs.len(), 1, "{bad:?}: {errs:#?}");
        let err = find(&errs, "collector.slurm_cluster");
        assert_eq!(err.line, Some(5), "{bad:?}");
        assert!(
            err.message
                .contains("not a Slurm ClusterName usable in a lease id"),
            "{bad:?}: {}",
            err.message
        );
    }
}

#[test]
fn the_kubelet_socket_is_optional_and_must_fit_a_unix_socket() {
    let config = config::parse("empty.toml", "").unwrap();
    assert_eq!(config.collector.kubelet_socket, None);
    assert_eq!(
        config.collector.pod_logs_dir,
        PathBuf::from("/var/log/pods")
    );
    let config = config::parse(
        "ok.toml",
        "[collector]\nkubelet_socket = \"/var/lib/kubelet/pod-resources/kubelet.sock\"\n\
         pod_logs_dir = \"/host/var/log/pods\"\n",
    )
    .unwrap();
    assert_eq!(
        config.collector.kubelet_socket,
        Some(PathBuf::from("/var/lib/kubelet/pod-resources/kubelet.sock"))
    );
    assert_eq!(
        config.collector.pod_logs_dir,
        PathBuf::from("/host/var/log/pods")
    );

    let long = format!("/{}", "s".repeat(107));
    for bad in ["", long.as_str()] {
        let text =
            format!("[kafka]\nbrokers = \"k:9092\"\n\n[collector]\nkubelet_socket = \"{bad}\"\n");
        let errs = errors(&text);
        assert_eq!(errs.len(), 1, "{bad:?}: {errs:#?}");
        let err = find(&errs, "collector.kubelet_socket");
        assert_eq!(err.line, Some(5), "{bad:?}");
        assert!(err.message.contains("1 to 107 bytes"), "{}", err.message);
    }
    let errs = errors("[kafka]\nbrokers = \"k:9092\"\n\n[collector]\npod_logs_dir = \"\"\n");
    assert_eq!(find(&errs, "collector.pod_logs_dir").line, Some(5));
}

#[test]
fn the_dmi_entries_dir_defaults_to_the_kernels_and_must_not_be_empty() {
    let config = config::parse("empty.toml", "").unwrap();
    assert_eq!(
        config.collector.dmi_entries_dir,
        PathBuf::from("/sys/firmware/dmi/entries")
    );
    let config = config::parse(
        "ok.toml",
        "[collector]\ndmi_entries_dir = \"/host/sys/firmware/dmi/entries\"\n",
    )
    .unwrap();
    assert_eq!(
        config.collector.dmi_entries_dir,
        PathBuf::from("/host/sys/firmware/dmi/entries")
    );
    let errs = errors("[kafka]\nbrokers = \"k:9092\"\n\n[collector]\ndmi_entries_dir = \"\"\n");
    assert_eq!(errs.len(), 1, "{errs:#?}");
    let err = find(&errs, "collector.dmi_entries_dir");
    assert_eq!(err.line, Some(5));
    assert!(
        err.message.contains("/sys/firmware/dmi/entries"),
        "{}",
        err.message
    );
}

#[test]
fn env_references_are_substituted_and_unset_ones_reported() {
    std::env::set_var("GPUWARDEN_TEST_BROKERS", "kafka-1:9092,kafka-2:9092");
    let config = config::parse(
        "t.toml",
        "[kafka]\nbrokers = \"${GPUWARDEN_TEST_BROKERS}\"\nclient_id = \"cost$${x}\"\n",
    )
    .unwrap();
    assert_eq!(config.kafka.brokers, "kafka-1:9092,kafka-2:9092");
    assert_eq!(
        config.kafka.client_id, "cost${x}",
        "a doubled dollar is a literal one"
    );

    let errs = errors("[kafka]\nbrokers = \"${GPUWARDEN_TEST_SURELY_UNSET}\"\n");
    let e = find(&errs, "kafka.brokers");
    assert_eq!(e.line, Some(2));
    assert!(
        e.message
            .contains("`GPUWARDEN_TEST_SURELY_UNSET` is not set"),
        "{}",
        e.message
    );
    let errs = errors("[kafka]\nbrokers = \"${UNCLOSED\"\n");
    assert!(find(&errs, "kafka.brokers").message.contains("unclosed"));
}

#[test]
fn toml_syntax_errors_point_at_the_place() {
    let errs = errors("[kafka]\nbrokers = \"a\"\npartitions = = 3\n");
    assert_eq!(errs.len(), 1);
    assert_eq!(errs[0].line, Some(3), "{errs:#?}");
    assert!(errs[0].message.starts_with("invalid TOML"));
}

#[test]
fn the_report_shows_file_line_column_and_the_source_line() {
    let err = config::parse("cfg.toml", "[collector]\ninterval = \"soon\"\n").unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("cfg.toml:2:12: error: collector.interval: invalid duration \"soon\""),
        "{text}"
    );
    assert!(text.contains("2 | interval = \"soon\""), "{text}");
    assert!(text.contains("|            ^"), "{text}");
}

#[test]
fn a_missing_file_says_so() {
    let err = config::load(std::path::Path::new("/nonexistent/gpuwarden.toml")).unwrap_err();
    assert!(err.to_string().contains("cannot read the file"), "{err}");
}

#[test]
fn sql_limits_take_sizes_and_durations_and_name_the_field_at_fault() {
    let good = config::parse(
        "good.toml",
        "\
[pipeline]
max_buffered_bytes = \"256MiB\"

[pipeline.sql_limits]
query_memory = \"2GiB\"
statement_timeout = \"0s\"

[[pipeline.sql_users]]
name = \"finops\"
password = \"x\"
query_memory = 67108864
max_queries = 2
",
    )
    .unwrap();
    let p = &good.pipeline;
    assert_eq!(p.max_buffered_bytes, 256 << 20);
    assert_eq!(p.sql_limits.query_memory, 2 << 30);
    assert!(p.sql_limits.statement_timeout.is_zero());
    assert_eq!(p.sql_limits.max_queries, 16, "the default");
    assert_eq!(p.sql_users[0].query_memory, Some(64 << 20));
    assert_eq!(p.sql_users[0].max_queries, Some(2));
    assert_eq!(p.sql_users[0].statement_timeout, None);

    let errs = errors(
        "\
[pipeline.sql_limits]
query_memory = \"lots\"
max_queries = 0

[[pipeline.sql_users]]
name = \"finops\"
password = \"x\"
max_queries = 0
statement_timeout = \"soon\"
",
    );
    assert!(find(&errs, "pipeline.sql_limits.query_memory")
        .message
        .contains("invalid size \"lots\""));
    assert_eq!(
        find(&errs, "pipeline.sql_limits.query_memory").line,
        Some(2)
    );
    assert!(find(&errs, "pipeline.sql_users[0].statement_timeout")
        .message
        .contains("invalid duration"));
}

#[test]
fn sql_limits_that_admit_nothing_are_refused() {
    let errs = errors(
        "\
[pipeline]
shutdown_deadline = \"0s\"

[pipeline.sql_limits]
max_queries = 0
max_connections = 0
query_memory = 1000

[[pipeline.sql_users]]
name = \"finops\"
password = \"x\"
max_queries = 0
",
    );
    for path in [
        "pipeline.shutdown_deadline",
        "pipeline.sql_limits.max_queries",
        "pipeline.sql_limits.max_connections",
        "pipeline.sql_limits.query_memory",
        "pipeline.sql_users[0].max_queries",
    ] {
        let _ = find(&errs, path);
    }
}

#[test]
fn clock_bounds_default_to_minutes_and_refuse_what_would_quarantine_honest_records() {
    let defaults = config::parse("d.toml", "").unwrap().pipeline.clock;
    assert_eq!(defaults.max_skew, std::time::Duration::from_secs(300));
    assert_eq!(defaults.max_age, std::time::Duration::from_secs(86_400));
    assert_eq!(defaults.idle_timeout, std::time::Duration::from_secs(300));
    let errs = errors(
        "\
[pipeline]
lateness = \"2h\"

[pipeline.clock]
max_skew = \"0s\"
max_age = \"1h\"
idle_timeout = \"0s\"
",
    );
    let age = find(&errs, "pipeline.clock.max_age");
    assert!(
        age.message
            .contains("must be longer than pipeline.lateness (2h)"),
        "{}",
        age.message
    );
    assert_eq!(age.line, Some(6));
    for path in ["pipeline.clock.max_skew", "pipeline.clock.idle_timeout"] {
        assert!(find(&errs, path).message.contains("longer than 0s"));
    }
}

#[test]
fn login_limits_are_on_by_default_take_an_inline_table_and_name_the_field_at_fault() {
    let defaults = config::parse("d.toml", "").unwrap();
    for limits in [
        &defaults.enforcer.login_limits,
        &defaults.pipeline.login_limits,
    ] {
        assert_eq!(limits.max_failures, 10);
        assert_eq!(limits.max_failures_per_source, 30);
        assert_eq!(limits.window, std::time::Duration::from_secs(300));
    }
    let set = config::parse(
        "s.toml",
        "[enforcer]\nlogin_limits = { max_failures = 3, window = \"90s\" }\n",
    )
    .unwrap();
    let limits = &set.enforcer.login_limits;
    assert_eq!(limits.max_failures, 3);
    assert_eq!(limits.window, std::time::Duration::from_secs(90));
    assert_eq!(
        limits.max_failures_per_source, 30,
        "unset fields keep their default"
    );
    assert_eq!(set.pipeline.login_limits, defaults.pipeline.login_limits);

    let errs = errors(
        "\
[enforcer]
login_limits = { max_failures = 0, window = \"0s\", tracked_keys = 10 }

[pipeline.login_limits]
max_failures_per_source = 0
window = \"2d\"
",
    );
    for (path, message, line) in [
        ("enforcer.login_limits.max_failures", "at least 1", 2),
        ("enforcer.login_limits.window", "outside 1s..=24h", 2),
        ("enforcer.login_limits.tracked_keys", "at least 64", 2),
        (
            "pipeline.login_limits.max_failures_per_source",
            "at least 1",
            5,
        ),
        ("pipeline.login_limits.window", "outside 1s..=24h", 6),
    ] {
        let error = find(&errs, path);
        assert!(error.message.contains(message), "{path}: {}", error.message);
        assert_eq!(error.line, Some(line), "{path}");
    }
    let errs = errors("[pipeline.login_limits]\nlockout = \"1h\"\n");
    let unknown = find(&errs, "pipeline.login_limits.lockout");
    assert!(
        unknown.message.contains("`max_failures_per_source`"),
        "{}",
        unknown.message
    );
}

#[test]
fn a_listener_off_loopback_needs_tls_or_the_explicit_plaintext_opt_in() {
    let errs = errors(
        "\
[pipeline]
sql_listen = \"0.0.0.0:5433\"

[enforcer]
listen = \"10.1.2.3:8080\"
",
    );
    let api = find(&errs, "enforcer.listen");
    assert_eq!(api.line, Some(5), "{api:?}");
    assert!(
        api.message
            .contains("10.1.2.3:8080 is not a loopback address")
            && api.message.contains("[enforcer.tls]")
            && api.message.contains("enforcer.insecure_plaintext = true"),
        "{api:?}"
    );
    let sql = find(&errs, "pipeline.sql_listen");
    assert_eq!(sql.line, Some(2), "{sql:?}");
    assert!(
        sql.message.contains("[pipeline.sql_tls]")
            && sql
                .message
                .contains("pipeline.sql_insecure_plaintext = true"),
        "{sql:?}"
    );

    // Loopback, the opt-in, or TLS: each is accepted.
    for text in [
        "[enforcer]\nlisten = \"127.0.0.1:8080\"\n[pipeline]\nsql_listen = \"[::1]:5433\"\n",
        "[enforcer]\nlisten = \"0.0.0.0:8080\"\ninsecure_plaintext = true\n\
         [pipeline]\nsql_listen = \"0.0.0.0:5433\"\nsql_insecure_plaintext = true\n",
        "[enforcer]\nlisten = \"0.0.0.0:8080\"\n[enforcer.tls]\ncert = \"a.pem\"\nkey = \"a.key\"\n\
         [pipeline]\nsql_listen = \"0.0.0.0:5433\"\n[pipeline.sql_tls]\ncert = \"a.pem\"\nkey = \"a.key\"\n",
    ] {
        config::parse("ok.toml", text).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn tls_sections_are_checked_field_by_field() {
    let parsed = config::parse(
        "t.toml",
        "[enforcer.tls]\ncert = \"/etc/gw/api.pem\"\nkey = \"/etc/gw/api.key\"\n\
         client_ca = \"/etc/gw/clients.pem\"\nclient_auth = \"optional\"\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let tls = parsed.enforcer.tls.expect("[enforcer.tls]");
    assert_eq!(tls.cert, PathBuf::from("/etc/gw/api.pem"));
    assert_eq!(tls.client_auth, Some(config::ClientAuth::Optional));
    assert_eq!(parsed.pipeline.sql_tls, None);

    let errs = errors(
        "\
[enforcer.tls]
cert = \"api.pem\"
colour = \"blue\"
",
    );
    let missing = find(&errs, "enforcer.tls");
    assert_eq!(missing.message, "missing required key `key`");
    let colour = find(&errs, "enforcer.tls.colour");
    assert_eq!(colour.line, Some(3), "{colour:?}");

    let errs = errors(
        "\
[pipeline.sql_tls]
cert = \"sql.pem\"
key = \"sql.key\"
client_auth = \"required\"
",
    );
    let auth = find(&errs, "pipeline.sql_tls.client_auth");
    assert_eq!(auth.line, Some(4), "{auth:?}");
    assert!(auth.message.contains("client_ca"), "{auth:?}");
}

#[test]
fn signing_keys_and_the_local_driver_s_accounts_are_checked_field_by_field() {
    let long = "k".repeat(32);
    let ok = config::parse(
        "s.toml",
        &format!("[signing]\nkey = \"{long}\"\nprevious_key = \"{long}-old\"\n"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.signing.key.as_deref(), Some(long.as_str()));
    assert!(
        !format!("{:?}", ok.signing).contains(&long),
        "keys never print"
    );

    let errs = errors("[signing]\nkey = \"short\"\n");
    assert!(find(&errs, "signing.key").message.contains("at least 32"));
    let errs = errors(&format!("[signing]\nprevious_key = \"{long}\"\n"));
    assert!(find(&errs, "signing.previous_key")
        .message
        .contains("beside `key`"));
    let errs = errors(&format!(
        "[signing]\nkey = \"{long}\"\nprevious_key = \"{long}\"\n"
    ));
    assert!(find(&errs, "signing.previous_key")
        .message
        .contains("same as `key`"));

    let errs = errors(
        "\
[workloads.batch]
programs = [\"python3\"]

[[substrates]]
name = \"box\"
driver = \"local\"
gpu_model = \"NVIDIA L4\"
gpu_uuids = [\"GPU-1\"]
accounts = { ada = \"../root\" }
min_uid = 0
work_dir = \"scratch\"

[[substrates]]
name = \"sim\"
driver = \"simulated\"
hosts = [{ prefix = \"h\", count = 1, gpus = 1, gpu_model = \"H100\" }]
accounts = { ada = \"ada\" }
",
    );
    for (path, says) in [
        ("workloads.batch.programs[0]", "not an absolute path"),
        ("substrates[0].accounts.ada", "not a system account name"),
        ("substrates[0].min_uid", "never runs as root"),
        ("substrates[0].work_dir", "not an absolute path"),
        (
            "substrates[1].accounts",
            "not a setting of the simulated driver",
        ),
    ] {
        let error = find(&errs, path);
        assert!(error.message.contains(says), "{path}: {}", error.message);
    }
}

/// Found by the `config` fuzz target (fuzz/corpus/config/simulated-fleet-too-large): a host
/// group of 4294967295 hosts of 4294967295 GPUs was accepted, and every component that builds
/// the simulated fleet at start (collector, enforcer) then ran out of memory instead of
/// starting. The fleet's size is bounded, and the error names the field.
#[test]
fn a_simulated_fleet_too_large_to_build_is_refused() {
    let errs = errors(
        "\
[[substrates]]
name = \"sim\"
driver = \"simulated\"
hosts = [
  { prefix = \"a\", count = 4294967295, gpus = 4294967295, gpu_model = \"NVIDIA H100 80GB HBM3\" },
]
",
    );
    let per_host = find(&errs, "substrates[0].hosts[0].gpus");
    assert!(
        per_host.message.contains("at most 64"),
        "{}",
        per_host.message
    );
    let total = find(&errs, "substrates[0].hosts");
    assert_eq!(total.line, Some(4), "{total:?}");
    assert!(
        total.message.contains("at most 100000"),
        "{}",
        total.message
    );

    // The bounds themselves are accepted: 1,562 hosts of 64 GPUs and one of 32 make 100,000.
    config::parse(
        "test.toml",
        "\
[[substrates]]
name = \"sim\"
driver = \"simulated\"
hosts = [
  { prefix = \"a\", count = 1562, gpus = 64, gpu_model = \"NVIDIA H100 80GB HBM3\" },
  { prefix = \"b\", count = 1, gpus = 32, gpu_model = \"NVIDIA H100 80GB HBM3\" },
]
",
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn the_example_slurm_substrate_is_valid_once_uncommented() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/gpuwarden.toml");
    let example = std::fs::read_to_string(path).unwrap();
    let start = example
        .find("# name = \"hpc\"")
        .expect("the example has a slurm entry");
    let block: String = example[..start]
        .lines()
        .last()
        .into_iter()
        .chain(example[start..].lines().take_while(|l| l.starts_with("# ")))
        .map(|l| l.trim_start_matches("# ").to_owned() + "\n")
        .collect();
    let text = format!(
        "[[teams]]\nname = \"research\"\ngpu_quota = 1\nmonthly_budget_usd = 1.0\n\
         [[teams]]\nname = \"serving\"\ngpu_quota = 1\nmonthly_budget_usd = 1.0\n{block}"
    );
    let config = config::parse("slurm.toml", &text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let slurm = config.substrates[0]
        .slurm
        .as_ref()
        .expect("[substrates.slurm]");
    assert_eq!(slurm.cluster, "hpc1");
    assert_eq!(slurm.teams["physics"], "research");
    assert_eq!(slurm.models["h100"], "NVIDIA H100 80GB HBM3");
    assert_eq!(slurm.poll, Some(Duration::from_secs(2)));
}

#[test]
fn slurm_settings_are_checked_field_by_field() {
    let text = "\
[[teams]]
name = \"ml\"
gpu_quota = 4
monthly_budget_usd = 10.0

[[substrates]]
name = \"hpc\"
driver = \"slurm\"
grace_period = \"5s\"

[substrates.slurm]
cluster = \"has space\"
teams = { physics = \"nope\" }
poll = \"10ms\"
hold_timeout = \"1s\"
slurm_conf = \"relative/slurm.conf\"

[[substrates]]
name = \"plain\"
driver = \"slurm\"
";
    let errs = errors(text);
    let message = |path: &str| find(&errs, path).message.clone();
    assert!(message("substrates[0].slurm.cluster").contains("\"has space\""));
    assert!(message("substrates[0].slurm.teams.physics").contains("no team is named `nope`"));
    assert!(message("substrates[0].slurm.poll").contains("between 200ms and 5m"));
    assert!(message("substrates[0].slurm.hold_timeout").contains("at least 10s"));
    assert!(message("substrates[0].slurm.slurm_conf").contains("absolute path"));
    assert!(message("substrates[0].grace_period").contains("not a setting of the slurm driver"));
    assert!(message("substrates[1].driver").contains("the slurm driver needs `slurm`"));
}

#[test]
fn the_outbox_is_kept_a_week_after_publishing_unless_told_otherwise() {
    let retention = |text: &str| {
        config::parse("e.toml", text)
            .unwrap_or_else(|e| panic!("{e}"))
            .enforcer
            .outbox_retention
    };
    assert_eq!(retention(""), Some(Duration::from_secs(7 * 86_400)));
    assert_eq!(
        retention("[enforcer]\noutbox_retention = \"36h\"\n"),
        Some(Duration::from_secs(36 * 3600))
    );
    assert_eq!(
        retention("[enforcer]\noutbox_retention = \"forever\"\n"),
        None
    );
    let errs = errors("[enforcer]\noutbox_retention = \"a week\"\n");
    assert!(find(&errs, "enforcer.outbox_retention")
        .message
        .contains("or \"forever\""));
}

/// A build without a driver (`gpuwarden check-config` asks the enforcer which it has) reports a
/// substrate of that kind on its `driver` line, naming the substrate and what to do.
#[test]
fn a_substrate_whose_driver_this_build_lacks_is_an_error_on_its_driver_line() {
    let text = "[[substrates]]\nname = \"gpus\"\ndriver = \"simulated\"\n\
                hosts = [{ prefix = \"h\", count = 1, gpus = 8, gpu_model = \"H100\" }]\n\n\
                [[substrates]]\nname = \"vms\"\ndriver = \"libvirt\"\n[substrates.libvirt]\n\
                domain_template = \"/etc/gpuwarden/vm.xml\"\n";
    let without_libvirt = |kind: config::DriverKind| {
        (kind == config::DriverKind::Libvirt).then(|| "rebuild with `--features libvirt`".into())
    };
    let errs = match config::parse_for_build("vm.toml", text, without_libvirt) {
        Ok(_) => panic!("a libvirt substrate was accepted by a build without libvirt"),
        Err(e) => e.errors,
    };
    assert_eq!(errs.len(), 1, "{errs:#?}");
    let error = find(&errs, "substrates[1].driver");
    assert_eq!((error.line, error.column), (Some(8), Some(10)));
    assert_eq!(
        error.message,
        "substrate vms cannot run here: rebuild with `--features libvirt`"
    );
    // A build that has every driver accepts it, as `parse` does.
    assert!(config::parse_for_build("vm.toml", text, |_| None).is_ok());
    assert!(config::parse("vm.toml", text).is_ok());
}

#[test]
fn libvirt_settings_have_defaults_and_are_checked_field_by_field() {
    let substrate = |settings: &str| {
        format!(
            "[[substrates]]\nname = \"vms\"\ndriver = \"libvirt\"\n[substrates.libvirt]\n\
             domain_template = \"/etc/gpuwarden/vm.xml\"\n{settings}"
        )
    };
    let config = config::parse("vm.toml", &substrate("")).unwrap();
    let libvirt = config.substrates[0].libvirt.clone().unwrap();
    assert_eq!(libvirt.uri, "qemu:///system");
    assert!(!libvirt.delete_disks && libvirt.gpus.is_empty() && libvirt.grace_period.is_none());

    let errs = errors(&substrate(
        r#"uri = "qemu"
models = { "2330" = "NVIDIA H100 80GB HBM3", "0x20b5" = " " }
gpus = [
  { pci = "0000:41:00.0", mdev = "c2177883-f1bb-47f0-914d-32a22e3a8804" },
  { pci = "0000:41:0.8", model = "X" },
  { pci = "41:00.0", model = "X" },
  { pci = "0000:41:00.0", model = "X" },
  { mdev = "not-a-uuid", model = "V" },
  { mdev = "c2177883-f1bb-47f0-914d-32a22e3a8804" },
]
grace_period = "2h"
poll = "100ms"
"#,
    ));
    let message = |path: &str| find(&errs, path).message.clone();
    assert!(message("substrates[0].libvirt.uri").contains("not a libvirt URI"));
    assert!(message("substrates[0].libvirt.models.2330").contains("not a PCI device id"));
    assert!(message("substrates[0].libvirt.models.0x20b5").contains("must name a GPU model"));
    assert!(message("substrates[0].libvirt.gpus[0].pci").contains("either `pci`"));
    assert!(message("substrates[0].libvirt.gpus[1].pci").contains("not a PCI address"));
    assert!(
        message("substrates[0].libvirt.gpus[3].pci").contains("listed twice"),
        "41:00.0 is 0000:41:00.0"
    );
    assert!(message("substrates[0].libvirt.gpus[4].mdev").contains("not a mediated device UUID"));
    assert!(message("substrates[0].libvirt.gpus[5].model").contains("a vGPU needs its model"));
    assert!(message("substrates[0].libvirt.grace_period").contains("at most 1h"));
    assert!(message("substrates[0].libvirt.poll").contains("between 1s and 10m"));

    let errs = errors("[[substrates]]\nname = \"vms\"\ndriver = \"libvirt\"\ngpu_model = \"X\"\n");
    assert!(find(&errs, "substrates[0].driver")
        .message
        .contains("the libvirt driver needs `libvirt`"));
    assert!(find(&errs, "substrates[0].gpu_model")
        .message
        .contains("not a setting of the libvirt driver"));
}

#[test]
fn kueue_settings_have_defaults_and_are_checked_field_by_field() {
    let substrate = |kueue: &str| {
        format!(
            "[[substrates]]\nname = \"k8s\"\ndriver = \"kubernetes\"\n\
             [substrates.kubernetes]\nwebhook_listen = \"127.0.0.1:8443\"\n\
             webhook_tls = {{ cert = \"/etc/w.pem\", key = \"/etc/w.key\" }}\n{kueue}"
        )
    };
    let config = config::parse("k8s.toml", &substrate("")).unwrap();
    assert_eq!(
        config.substrates[0].kubernetes.as_ref().unwrap().kueue,
        None
    );
    let config = config::parse("k8s.toml", &substrate("[substrates.kubernetes.kueue]\n")).unwrap();
    let kueue = config.substrates[0]
        .kubernetes
        .as_ref()
        .unwrap()
        .kueue
        .clone()
        .unwrap();
    assert_eq!(kueue.controller_name, "gpuwarden.io/budget");
    assert_eq!(kueue.api_version, "v1beta2");
    assert_eq!(kueue.poll, None);

    let errs = errors(&substrate(
        "[substrates.kubernetes.kueue]\ncontroller_name = \"\"\napi_version = \"v1\"\npoll = \"10m\"\n",
    ));
    let message = |path: &str| find(&errs, path).message.clone();
    assert!(
        message("substrates[0].kubernetes.kueue.controller_name").contains("1 to 253 characters")
    );
    assert!(message("substrates[0].kubernetes.kueue.api_version").contains("v1beta2 or v1beta1"));
    assert!(message("substrates[0].kubernetes.kueue.poll").contains("between 1s and 5m"));
    let errs = errors(&substrate(
        "[substrates.kubernetes.kueue]\ncontroler_name = \"x\"\n",
    ));
    assert!(
        errs.iter().any(|e| e.message.contains("controler_name")),
        "{errs:#?}"
    );
}

#[test]
fn consumer_group_membership_defaults_to_static_and_names_the_field_at_fault() {
    let config = config::parse("t.toml", "").unwrap();
    assert!(config.kafka.static_membership);
    assert_eq!(config.kafka.group_instance_id, None);
    assert_eq!(config.kafka.session_timeout, Duration::from_secs(10));

    let errs = errors("[kafka]\ngroup_instance_id = \"node 1\"\nsession_timeout = \"2s\"\n");
    let e = find(&errs, "kafka.group_instance_id");
    assert!(e.message.contains("ASCII letters, digits"), "{}", e.message);
    assert_eq!(e.line, Some(2));
    let e = find(&errs, "kafka.session_timeout");
    assert!(e.message.contains("outside 6s..=30m"), "{}", e.message);

    let errs = errors("[kafka]\nstatic_membership = false\ngroup_instance_id = \"a\"\n");
    assert!(find(&errs, "kafka.group_instance_id")
        .message
        .contains("only with static_membership = true"));
}

#[test]
fn the_lake_is_a_directory_or_an_s3_prefix() {
    let lake = |text: &str| {
        config::parse("test.toml", text)
            .unwrap_or_else(|e| panic!("{e}"))
            .lake()
            .unwrap()
    };
    let s3 = |bucket: &str, prefix: &str| LakeLocation::S3 {
        bucket: bucket.into(),
        prefix: prefix.into(),
    };
    assert_eq!(
        lake("[storage]\ndata_dir = \"/srv/gw\""),
        LakeLocation::Directory(PathBuf::from("/srv/gw/lake"))
    );
    assert_eq!(
        lake("[storage]\nlake = \"/mnt/shared/lake\""),
        LakeLocation::Directory(PathBuf::from("/mnt/shared/lake"))
    );
    assert_eq!(
        lake("[storage]\nlake = \"file:///mnt/shared/lake\""),
        LakeLocation::Directory(PathBuf::from("/mnt/shared/lake"))
    );
    assert_eq!(
        lake("[storage]\nlake = \"s3://gw-lake\""),
        s3("gw-lake", "")
    );
    assert_eq!(
        lake("[storage]\nlake = \"s3://gw-lake/prod/lake/\""),
        s3("gw-lake", "prod/lake")
    );
    let config = config::parse(
        "test.toml",
        "[storage]\nlake = \"s3://gw-lake/prod\"\n[storage.s3]\nendpoint = \"http://127.0.0.1:9000\"\n\
         allow_http = true\nregion = \"us-east-1\"\naccess_key_id = \"k\"\nsecret_access_key = \"s\"\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        config.storage.s3.endpoint.as_deref(),
        Some("http://127.0.0.1:9000")
    );
    assert_eq!(config.lake().unwrap().to_string(), "s3://gw-lake/prod");
    let shown = format!("{:?}", config.storage.s3);
    assert!(
        !shown.contains("\"s\""),
        "the secret stays out of Debug: {shown}"
    );
}

#[test]
fn a_lake_that_cannot_be_reached_is_reported_at_its_field() {
    for (value, expected) in [
        (
            "gs://bucket/lake",
            "`gs://` is not a lake this build can reach",
        ),
        (
            "s3://Upper_Case/lake",
            "`Upper_Case` is not an S3 bucket name",
        ),
        ("s3://", "`` is not an S3 bucket name"),
        ("s3://gw-lake/a//b", "is not a key prefix"),
        ("s3://gw-lake/a/../b", "is not a key prefix"),
        ("file://host/lake", "names a host or a relative path"),
        ("", "is empty"),
    ] {
        let found = errors(&format!("[storage]\nlake = \"{value}\"\n"));
        let error = find(&found, "storage.lake");
        assert!(
            error.message.contains(expected),
            "{value}: {}",
            error.message
        );
        assert_eq!(error.line, Some(2), "{value}");
    }

    // A bad URL does not hide the S3 settings' own mistakes.
    let found =
        errors("[storage]\nlake = \"s3://Bad_Bucket\"\n[storage.s3]\nendpoint = \"minio:9000\"\n");
    assert!(find(&found, "storage.lake")
        .message
        .contains("`Bad_Bucket`"));
    assert!(find(&found, "storage.s3.endpoint")
        .message
        .contains("not an http:// or https:// URL"));

    let found = errors("[storage]\nlake = \"/srv/lake\"\n[storage.s3]\nregion = \"eu-west-1\"\n");
    assert!(find(&found, "storage.s3")
        .message
        .contains("applies to an `s3://` storage.lake"));

    let found = errors(
        "[storage]\nlake = \"s3://gw-lake\"\n[storage.s3]\nendpoint = \"http://minio:9000\"\n\
         access_key_id = \"k\"\nsession_token = \"\"\n",
    );
    assert!(find(&found, "storage.s3.endpoint")
        .message
        .contains("set `allow_http = true`"));
    assert!(find(&found, "storage.s3.access_key_id")
        .message
        .contains("without `secret_access_key`"));
    assert!(find(&found, "storage.s3.session_token")
        .message
        .contains("is empty"));
    let found = errors("[storage]\nlake = \"s3://gw-lake\"\n[storage.s3]\nbucket = \"x\"\n");
    assert!(find(&found, "storage.s3.bucket")
        .message
        .contains("unknown"));
}

/// Every TOML block of README.md and of the book (`docs/src/**/*.md`) is a config, or a part of
/// one, that gpuwarden accepts as it is written there (with its `${…}` references set): a new user
/// copies them. A part that maps to the book's teams without defining them (research, serving) is
/// checked beside those two. A sketch that is not meant to load is fenced as `toml,ignore`.
#[test]
fn every_toml_block_of_the_readme_and_the_book_is_a_valid_config() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("README.md")];
    markdown_files(&root.join("docs/src"), &mut files);
    assert!(files.len() > 1, "no pages under docs/src");
    for (name, value) in [
        (
            "GPUWARDEN_SIGNING_KEY",
            "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0",
        ),
        (
            "GPUWARDEN_OLD_SIGNING_KEY",
            "1f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0",
        ),
        ("MINIO_ACCESS_KEY", "minio"),
        ("MINIO_SECRET_KEY", "minio-secret"),
    ] {
        std::env::set_var(name, value);
    }
    let mut blocks = 0;
    for file in &files {
        let page = std::fs::read_to_string(file).unwrap();
        let shown = file
            .strip_prefix(&root)
            .unwrap_or(file)
            .display()
            .to_string();
        let mut rest = page.as_str();
        while let Some(start) = rest.find("```toml\n") {
            let line = page[..page.len() - rest.len() + start].lines().count() + 1;
            let body = &rest[start + "```toml\n".len()..];
            let end = body.find("```").expect("a TOML block ends");
            let block = &body[..end];
            let text = if block.contains("[[teams]]") {
                block.to_string()
            } else {
                format!(
                    "{block}\n[[teams]]\nname = \"research\"\ngpu_quota = 1\nmonthly_budget_usd = 1\n\
                     [[teams]]\nname = \"serving\"\ngpu_quota = 1\nmonthly_budget_usd = 1\n"
                )
            };
            if let Err(e) = config::parse(&shown, &text) {
                panic!("{shown}'s TOML block at line {line}:\n{e}");
            }
            blocks += 1;
            rest = &body[end..];
        }
    }
    assert!(blocks >= 7, "{blocks} TOML blocks");
}

/// Every `.md` file under `dir`, sorted, appended to `out`.
fn markdown_files(dir: &std::path::Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            markdown_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "md") {
            out.push(path);
        }
    }
}

/// `[enforcer.store]` and `[enforcer.leader]`: a store URL of no known kind, a password file
/// without a PostgreSQL store, an SQLite file named twice, and a leader lease out of range are
/// each reported at their field; a PostgreSQL URL and `sqlite:` resolve to their store.
#[test]
fn store_and_leader_settings_are_checked_and_resolved() {
    let errs = errors(
        "[enforcer]\ndatabase = \"/var/lib/e.db\"\n[enforcer.store]\nurl = \"mysql://db/x\"\n\
         [enforcer.leader]\nlease = \"0s\"\nreplica = \"\"\n",
    );
    assert!(find(&errs, "enforcer.store.url")
        .message
        .contains("mysql://db/x"));
    // Named twice, reported with the bad URL rather than after it is mended.
    assert!(find(&errs, "enforcer.database")
        .message
        .contains("both name the store"));
    assert!(find(&errs, "enforcer.leader.lease").message.contains("1s"));
    find(&errs, "enforcer.leader.replica");
    let errs = errors("[enforcer.store]\npassword_file = \"/run/secrets/pg\"\n");
    assert!(find(&errs, "enforcer.store.password_file")
        .message
        .contains("postgres://"));
    let errs = errors(
        "[enforcer]\ndatabase = \"/var/lib/e.db\"\n[enforcer.store]\nurl = \"postgres://db/x\"\n",
    );
    find(&errs, "enforcer.database");
    let errs = errors("[enforcer.store]\nurl = \"sqlite:\"\n");
    find(&errs, "enforcer.store.url");

    let postgres = config::parse(
        "test.toml",
        "[enforcer.store]\nurl = \"postgresql://gw@db:5432/gw\"\npassword_file = \"/run/pg\"\n",
    )
    .unwrap();
    assert_eq!(
        postgres.enforcer_store(),
        config::StoreLocation::Postgres {
            url: "postgresql://gw@db:5432/gw".into(),
            password_file: Some(PathBuf::from("/run/pg")),
        }
    );
    let sqlite = config::parse(
        "test.toml",
        "[enforcer.store]\nurl = \"sqlite:/var/lib/e.db\"\n",
    )
    .unwrap();
    assert_eq!(
        sqlite.enforcer_store(),
        config::StoreLocation::Sqlite(PathBuf::from("/var/lib/e.db"))
    );
}

#[test]
fn the_idle_measure_mig_shares_and_emissions_are_read_and_checked() {
    let config = config::parse(
        "ok.toml",
        "[pricing]\nidle_measure = \"sm_active\"\nidle_sm_active_pct = 3.5\n\
         co2e_g_per_kwh = 380.0\n\n[[pricing.mig]]\nprofile = \"1g.10gb\"\nshare = 0.125\n\n\
         [workloads.inference]\nidle_measure = \"util\"\n",
    )
    .unwrap();
    let p = &config.pricing;
    assert_eq!(p.idle_measure, IdleMeasure::SmActive);
    assert_eq!(p.co2e_g_per_kwh, Some(380.0));
    assert_eq!(
        config.idle_measure(Some(Workload::Inference)),
        IdleMeasure::Util
    );
    assert_eq!(
        config.idle_measure(Some(Workload::Notebook)),
        IdleMeasure::SmActive
    );
    assert_eq!(config.idle_measure(None), IdleMeasure::SmActive);
    // A spinning GPU: busy by utilization, idle by SM activity; without GPM, utilization judges.
    assert_eq!(
        p.judge_idle(IdleMeasure::SmActive, 100.0, Some(2.0)),
        (true, IdleMeasure::SmActive)
    );
    assert_eq!(
        p.judge_idle(IdleMeasure::Util, 100.0, Some(2.0)),
        (false, IdleMeasure::Util)
    );
    assert_eq!(
        p.judge_idle(IdleMeasure::SmActive, 100.0, None),
        (false, IdleMeasure::Util)
    );
    // The override by profile, else compute slices over the parent's, else a whole GPU.
    assert_eq!(p.gpu_share(Some("1g.10gb"), Some(1), Some(7)), 0.125);
    assert_eq!(p.gpu_share(Some("2g.20gb"), Some(2), Some(7)), 2.0 / 7.0);
    assert_eq!(p.gpu_share(None, Some(3), Some(7)), 3.0 / 7.0);
    assert_eq!(p.gpu_share(None, None, None), 1.0);
    assert_eq!(
        config::parse("empty.toml", "")
            .unwrap()
            .pricing
            .co2e_g_per_kwh,
        None
    );

    let errs = errors(
        "[pricing]\nidle_sm_active_pct = 101\nco2e_g_per_kwh = -1\n\n\
         [[pricing.mig]]\nprofile = \"1g.10gb\"\nshare = 0\n\n\
         [[pricing.mig]]\nprofile = \"1g.10gb\"\nshare = 1.5\n",
    );
    assert!(find(&errs, "pricing.idle_sm_active_pct")
        .message
        .contains("outside 0..=100"));
    assert!(find(&errs, "pricing.co2e_g_per_kwh")
        .message
        .contains("negative"));
    assert!(find(&errs, "pricing.mig[0].share")
        .message
        .contains("outside (0, 1]"));
    assert!(find(&errs, "pricing.mig[1].profile")
        .message
        .contains("listed twice"));
    assert!(find(&errs, "pricing.mig[1].share")
        .message
        .contains("outside (0, 1]"));

    let errs = errors("[pricing]\nidle_measure = \"sm\"\n");
    let err = find(&errs, "pricing.idle_measure");
    assert!(err.message.contains("sm_active"), "{}", err.message);
}
