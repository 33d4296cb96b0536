//! The rules a config must follow beyond its keys and types: ranges, names that must be unique,
//! names that must refer to something, and settings that only make sense together.

use std::collections::BTreeSet;
use std::time::Duration;

use super::field_path::{key, FieldPath, Seg};
use super::{
    CollectorSource, Config, DriverKind, KubernetesSettings, KueueSettings, LibvirtSettings,
    Listener, LoginLimits, OnIdle, Role, SlurmSettings, SubstrateConfig, TlsConfig,
};

type Report<'r> = &'r mut dyn FnMut(FieldPath, String);

fn at(parts: &[&str]) -> FieldPath {
    parts.iter().map(|p| key(p)).collect()
}

fn item(list: &str, index: usize, field: &str) -> FieldPath {
    vec![key(list), Seg::Index(index), key(field)]
}

/// The most GPUs a `simulated` substrate may have. Every process that builds the fleet (the
/// collector's simulated source, the enforcer's simulated driver) holds all of it in memory and
/// samples every GPU each interval; an unbounded count in a config (a typo, an extra digit) would
/// stop them at start, out of memory, rather than be reported here. Ten times the largest fleet
/// the benchmarks simulate.
pub const MAX_SIMULATED_GPUS: u64 = 100_000;

/// The most GPUs one simulated host may have: more than any real machine holds.
pub const MAX_SIMULATED_GPUS_PER_HOST: u32 = 64;

pub(crate) fn check(config: &Config, report: Report<'_>) {
    kafka(config, report);
    collector(config, report);
    pipeline(config, report);
    pricing(config, report);
    teams(config, report);
    substrates(config, report);
    workloads(config, report);
    tokens(config, report);
    login_limits(&config.enforcer.login_limits, "enforcer", report);
    login_limits(&config.pipeline.login_limits, "pipeline", report);
    tls(config, report);
    signing(config, report);
    storage(config, report);
    if config.enforcer.max_request_bytes < 1024 {
        report(
            at(&["enforcer", "max_request_bytes"]),
            "must be at least 1024".into(),
        );
    }
    store(&config.enforcer, report);
    let lease = config.enforcer.leader.lease;
    if lease < Duration::from_secs(1) || lease > Duration::from_secs(600) {
        report(
            at(&["enforcer", "leader", "lease"]),
            "must be between 1s and 10m".into(),
        );
    }
    if let Some(name) = &config.enforcer.leader.replica {
        if name.is_empty() || name.len() > 253 || name.chars().any(char::is_control) {
            report(
                at(&["enforcer", "leader", "replica"]),
                "must be 1 to 253 printable characters".into(),
            );
        }
    }
    for (i, url) in config.enforcer.alert_webhooks.iter().enumerate() {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            report(
                vec![key("enforcer"), key("alert_webhooks"), Seg::Index(i)],
                format!("\"{url}\" is not an http:// or https:// URL"),
            );
        }
    }
}

fn store(enforcer: &super::EnforcerConfig, report: Report<'_>) {
    let store = &enforcer.store;
    let Some(url) = store.url.as_deref() else {
        if store.password_file.is_some() {
            report(
                at(&["enforcer", "store", "password_file"]),
                "is for a PostgreSQL store: set enforcer.store.url to its postgres:// URL".into(),
            );
        }
        return;
    };
    let postgres = super::StoreConfig::POSTGRES_SCHEMES
        .iter()
        .any(|s| url.starts_with(s));
    // Named twice whatever the URL is, so that both faults are reported at once.
    if enforcer.database.is_some() {
        report(
            at(&["enforcer", "database"]),
            if postgres {
                "names an SQLite file, but enforcer.store.url puts the store in PostgreSQL: \
                 remove one of them"
            } else {
                "and enforcer.store.url both name the store: keep one"
            }
            .into(),
        );
    }
    if postgres {
        return;
    }
    if url.contains("://") && !url.starts_with("sqlite://") {
        report(
            at(&["enforcer", "store", "url"]),
            format!("\"{url}\" is neither a postgres:// (or postgresql://) URL nor sqlite:<path>"),
        );
        return;
    }
    if url
        .trim_start_matches("sqlite:")
        .trim_start_matches("//")
        .is_empty()
    {
        report(
            at(&["enforcer", "store", "url"]),
            "sqlite: needs the database file's path, e.g. sqlite:/var/lib/gpuwarden/enforcer.db"
                .into(),
        );
    }
    if store.password_file.is_some() {
        report(
            at(&["enforcer", "store", "password_file"]),
            "is for a PostgreSQL store; an SQLite file has no password".into(),
        );
    }
}

fn login_limits(limits: &LoginLimits, section: &str, report: Report<'_>) {
    for (field, value) in [
        ("max_failures", limits.max_failures),
        ("max_failures_per_source", limits.max_failures_per_source),
    ] {
        if value == 0 {
            report(
                at(&[section, "login_limits", field]),
                "must be at least 1".into(),
            );
        }
    }
    if limits.window < Duration::from_secs(1) || limits.window > Duration::from_secs(24 * 3600) {
        report(
            at(&[section, "login_limits", "window"]),
            format!(
                "{} is outside 1s..=24h",
                humantime::format_duration(limits.window)
            ),
        );
    }
    if limits.tracked_keys < 64 {
        report(
            at(&[section, "login_limits", "tracked_keys"]),
            "must be at least 64".into(),
        );
    }
}

/// A listener off loopback speaks TLS unless plain TCP was asked for by name: tokens and SQL
/// passwords must not cross a network in the clear by default.
fn tls(config: &Config, report: Report<'_>) {
    let (e, p) = (&config.enforcer, &config.pipeline);
    if let Some(why) = config.plaintext_refusal(Listener::Api, e.listen) {
        report(at(&["enforcer", "listen"]), why);
    }
    if let Some(why) = config.plaintext_refusal(Listener::Sql, p.sql_listen) {
        report(at(&["pipeline", "sql_listen"]), why);
    }
    for (section, tls) in [("enforcer", &e.tls), ("pipeline", &p.sql_tls)] {
        let Some(tls) = tls else { continue };
        let table = if section == "enforcer" {
            "tls"
        } else {
            "sql_tls"
        };
        tls_section(tls, &[section, table], report);
    }
}

fn tls_section(tls: &TlsConfig, path: &[&str], report: Report<'_>) {
    let field = |name: &str| {
        let mut p = at(path);
        p.push(key(name));
        p
    };
    for (name, file) in [("cert", &tls.cert), ("key", &tls.key)] {
        if file.as_os_str().is_empty() {
            report(field(name), "must name a PEM file".into());
        }
    }
    if tls.client_ca.is_none() && tls.client_auth.is_some() {
        report(
            field("client_auth"),
            "applies to client certificates, which need `client_ca`: the CAs to check them against"
                .into(),
        );
    }
}

/// Kafka's rules for a `group.instance.id` (those of a topic name).
fn valid_group_instance_id(id: &str) -> bool {
    (1..=249).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn kafka(config: &Config, report: Report<'_>) {
    let k = &config.kafka;
    if let Some(id) = &k.group_instance_id {
        if !k.static_membership {
            report(
                at(&["kafka", "group_instance_id"]),
                "applies only with static_membership = true".into(),
            );
        } else if !valid_group_instance_id(id) {
            report(
                at(&["kafka", "group_instance_id"]),
                format!("\"{id}\" must be 1 to 249 ASCII letters, digits, '.', '_' or '-'"),
            );
        }
    }
    // Kafka brokers' own bounds by default (group.min/max.session.timeout.ms): outside them
    // every join would be refused.
    if k.session_timeout < Duration::from_secs(6) || k.session_timeout > Duration::from_secs(1800) {
        report(
            at(&["kafka", "session_timeout"]),
            format!(
                "{} is outside 6s..=30m, what Kafka brokers accept by default",
                humantime::format_duration(k.session_timeout)
            ),
        );
    }
    if k.brokers.trim().is_empty() {
        report(
            at(&["kafka", "brokers"]),
            "must name at least one broker (host:port), or be \"embedded\"".into(),
        );
    }
    if k.partitions < 1 {
        report(at(&["kafka", "partitions"]), "must be at least 1".into());
    }
    if k.replication_factor < 1 {
        report(
            at(&["kafka", "replication_factor"]),
            "must be at least 1".into(),
        );
    }
}

fn collector(config: &Config, report: Report<'_>) {
    let c = &config.collector;
    if c.interval < Duration::from_secs(1) || c.interval > Duration::from_secs(3600) {
        report(
            at(&["collector", "interval"]),
            format!(
                "{} is outside 1s..=1h",
                humantime::format_duration(c.interval)
            ),
        );
    }
    if let Some(cluster) = &c.slurm_cluster {
        if !crate::lease::is_slurm_cluster_name(cluster) {
            report(
                at(&["collector", "slurm_cluster"]),
                format!(
                    "{cluster:?} is not a Slurm ClusterName usable in a lease id: 1 to {} ASCII \
                     letters, digits, '_', '.' or '-'",
                    crate::lease::SLURM_CLUSTER_NAME_MAX
                ),
            );
        }
    }
    if let Some(socket) = &c.kubelet_socket {
        // A Unix socket's path must fit `sockaddr_un.sun_path` (108 bytes with its NUL on Linux).
        let len = socket.as_os_str().len();
        if len == 0 || len > 107 {
            report(
                at(&["collector", "kubelet_socket"]),
                format!(
                    "must be the path of the kubelet's PodResources socket, 1 to 107 bytes (a \
                     Unix socket's limit), e.g. /var/lib/kubelet/pod-resources/kubelet.sock; \
                     this one has {len}"
                ),
            );
        }
    }
    if c.pod_logs_dir.as_os_str().is_empty() {
        report(
            at(&["collector", "pod_logs_dir"]),
            "must be the kubelet's pod log directory, e.g. /var/log/pods".into(),
        );
    }
    if c.dmi_entries_dir.as_os_str().is_empty() {
        report(
            at(&["collector", "dmi_entries_dir"]),
            "must be the kernel's directory of SMBIOS structures, e.g. /sys/firmware/dmi/entries"
                .into(),
        );
    }
    if !(c.simulated.speed.is_finite() && c.simulated.speed > 0.0) {
        report(
            at(&["collector", "simulated", "speed"]),
            "must be a positive number".into(),
        );
    }
    let simulated: Vec<&SubstrateConfig> = config
        .substrates
        .iter()
        .filter(|s| s.driver == DriverKind::Simulated)
        .collect();
    match &c.simulated.substrate {
        Some(name) => match config.substrate(name) {
            None => report(
                at(&["collector", "simulated", "substrate"]),
                format!("no substrate is named `{name}`"),
            ),
            Some(s) if s.driver != DriverKind::Simulated => report(
                at(&["collector", "simulated", "substrate"]),
                format!(
                    "substrate `{name}` uses the {} driver, not simulated",
                    s.driver.as_str()
                ),
            ),
            Some(_) => {}
        },
        None if c.source == CollectorSource::Simulated && simulated.len() != 1 => report(
            at(&["collector", "source"]),
            format!(
                "the simulated source needs a fleet: {} substrates use the simulated driver; \
                 define one, or name it in `collector.simulated.substrate`",
                simulated.len()
            ),
        ),
        None => {}
    }
}

fn pipeline(config: &Config, report: Report<'_>) {
    let p = &config.pipeline;
    if p.flush_rows == 0 {
        report(at(&["pipeline", "flush_rows"]), "must be at least 1".into());
    }
    if p.signals.every.is_zero() {
        report(
            at(&["pipeline", "signals", "every"]),
            "must be longer than 0s".into(),
        );
    }
    if p.signals.window < p.signals.every {
        report(
            at(&["pipeline", "signals", "window"]),
            "must be at least as long as `signals.every`".into(),
        );
    }
    let c = &p.compaction;
    if c.row_group_rows == 0 {
        report(
            at(&["pipeline", "compaction", "row_group_rows"]),
            "must be at least 1".into(),
        );
    }
    if c.target_file_size < 1 << 20 {
        report(
            at(&["pipeline", "compaction", "target_file_size"]),
            "must be at least 1MiB".into(),
        );
    }
    if c.sort_memory < 16 << 20 {
        report(
            at(&["pipeline", "compaction", "sort_memory"]),
            "must be at least 16MiB".into(),
        );
    }
    // An hour is deleted only once it is final. Samples are kept at least an hour past
    // `clock.max_age` whatever this says (gpuwarden_pipeline::retention::limits).
    let hour = std::time::Duration::from_secs(3600);
    for (field, kept, floor, why) in [
        (
            "samples",
            p.retention.samples,
            p.lateness + hour,
            "an hour plus `pipeline.lateness`",
        ),
        (
            "signals",
            p.retention.signals,
            p.lateness + hour,
            "an hour plus `pipeline.lateness`",
        ),
        (
            "quarantine",
            p.retention.quarantine,
            p.lateness + hour,
            "an hour plus `pipeline.lateness`",
        ),
    ] {
        if kept.is_some_and(|kept| kept < floor) {
            report(
                at(&["pipeline", "retention", field]),
                format!(
                    "must be at least {} ({why}), or \"forever\": an hour is deleted only once \
                     no late record can reopen it",
                    humantime::format_duration(floor)
                ),
            );
        }
    }
    // Port 0 asks for any free port, so two of them never clash.
    if p.sql_listen == p.metrics_listen && p.sql_listen.port() != 0 {
        report(
            at(&["pipeline", "sql_listen"]),
            "is the same address as `pipeline.metrics_listen`".into(),
        );
    }
    let mut names = BTreeSet::new();
    for (i, user) in p.sql_users.iter().enumerate() {
        if user.name.is_empty() {
            report(
                item_in(&["pipeline", "sql_users"], i, "name"),
                "must not be empty".into(),
            );
        } else if !names.insert(&user.name) {
            report(
                item_in(&["pipeline", "sql_users"], i, "name"),
                format!("user `{}` is defined twice", user.name),
            );
        }
        if user.password.is_empty() {
            report(
                item_in(&["pipeline", "sql_users"], i, "password"),
                "must not be empty".into(),
            );
        }
        if user.max_queries == Some(0) {
            report(
                item_in(&["pipeline", "sql_users"], i, "max_queries"),
                "must be at least 1".into(),
            );
        }
        if user.query_memory.is_some_and(|m| m < MIN_QUERY_MEMORY) {
            report(
                item_in(&["pipeline", "sql_users"], i, "query_memory"),
                format!("must be at least {}MiB", MIN_QUERY_MEMORY >> 20),
            );
        }
    }
    let limits = &p.sql_limits;
    for (field, value) in [
        ("max_queries_per_user", limits.max_queries_per_user),
        ("max_queries", limits.max_queries),
        ("max_connections", limits.max_connections),
    ] {
        if value == 0 {
            report(
                at(&["pipeline", "sql_limits", field]),
                "must be at least 1".into(),
            );
        }
    }
    if limits.query_memory < MIN_QUERY_MEMORY {
        report(
            at(&["pipeline", "sql_limits", "query_memory"]),
            format!("must be at least {}MiB", MIN_QUERY_MEMORY >> 20),
        );
    }
    let clock = &p.clock;
    for (field, value) in [
        ("max_skew", clock.max_skew),
        ("idle_timeout", clock.idle_timeout),
    ] {
        if value.is_zero() {
            report(
                at(&["pipeline", "clock", field]),
                "must be longer than 0s".into(),
            );
        }
    }
    if clock.max_age <= p.lateness {
        report(
            at(&["pipeline", "clock", "max_age"]),
            format!(
                "must be longer than pipeline.lateness ({}): samples still in time for their hour would be quarantined",
                humantime::format_duration(p.lateness)
            ),
        );
    }
    if p.shutdown_deadline.is_zero() {
        report(
            at(&["pipeline", "shutdown_deadline"]),
            "must be longer than 0s".into(),
        );
    }
}

/// Less memory than this cannot hold a query's first batches.
const MIN_QUERY_MEMORY: u64 = 1 << 20;

fn item_in(parents: &[&str], index: usize, field: &str) -> FieldPath {
    let mut path = at(parents);
    path.push(Seg::Index(index));
    path.push(key(field));
    path
}

fn non_negative(value: f64) -> bool {
    value.is_finite() && value >= 0.0
}

fn pricing(config: &Config, report: Report<'_>) {
    let p = &config.pricing;
    if p.currency.len() != 3 || !p.currency.chars().all(|c| c.is_ascii_uppercase()) {
        report(
            at(&["pricing", "currency"]),
            format!("\"{}\" is not an ISO 4217 code like \"USD\"", p.currency),
        );
    }
    if !(0.0..=100.0).contains(&p.idle_util_pct) {
        report(
            at(&["pricing", "idle_util_pct"]),
            format!("{} is outside 0..=100", p.idle_util_pct),
        );
    }
    if !(0.0..=100.0).contains(&p.idle_sm_active_pct) {
        report(
            at(&["pricing", "idle_sm_active_pct"]),
            format!("{} is outside 0..=100", p.idle_sm_active_pct),
        );
    }
    if p.co2e_g_per_kwh.is_some_and(|g| !non_negative(g)) {
        report(
            at(&["pricing", "co2e_g_per_kwh"]),
            "must not be negative".into(),
        );
    }
    let mut profiles = BTreeSet::new();
    for (i, mig) in p.mig.iter().enumerate() {
        if mig.profile.trim().is_empty() {
            report(
                item_in(&["pricing", "mig"], i, "profile"),
                "must not be empty".into(),
            );
        } else if !profiles.insert(mig.profile.as_str()) {
            report(
                item_in(&["pricing", "mig"], i, "profile"),
                format!("`{}` is listed twice", mig.profile),
            );
        }
        if !(mig.share.is_finite() && mig.share > 0.0 && mig.share <= 1.0) {
            report(
                item_in(&["pricing", "mig"], i, "share"),
                format!(
                    "{} is outside (0, 1]: a slice is part of one GPU",
                    mig.share
                ),
            );
        }
    }
    if !non_negative(p.default_usd_per_gpu_hour) {
        report(
            at(&["pricing", "default_usd_per_gpu_hour"]),
            "must not be negative".into(),
        );
    }
    if !non_negative(p.energy_usd_per_kwh) {
        report(
            at(&["pricing", "energy_usd_per_kwh"]),
            "must not be negative".into(),
        );
    }
    for (name, value) in [
        ("billing_account", &p.billing_account),
        ("provider", &p.provider),
    ] {
        if value.trim().is_empty() {
            report(
                at(&["pricing", name]),
                "must not be empty: FOCUS requires it on every row".into(),
            );
        }
    }
    for (i, price) in p.gpu.iter().enumerate() {
        if price.model_match.trim().is_empty() {
            report(
                item_in(&["pricing", "gpu"], i, "match"),
                "must not be empty: it would match every model".into(),
            );
        }
        if !non_negative(price.usd_per_gpu_hour) {
            report(
                item_in(&["pricing", "gpu"], i, "usd_per_gpu_hour"),
                "must not be negative".into(),
            );
        }
    }
}

fn teams(config: &Config, report: Report<'_>) {
    let mut names = BTreeSet::new();
    for (i, team) in config.teams.iter().enumerate() {
        if team.name.trim().is_empty() {
            report(item("teams", i, "name"), "must not be empty".into());
        } else if team.name.starts_with('(') {
            report(
                item("teams", i, "name"),
                format!(
                    "`{}` is reserved; team names may not start with `(`",
                    team.name
                ),
            );
        } else if !names.insert(&team.name) {
            report(
                item("teams", i, "name"),
                format!("team `{}` is defined twice", team.name),
            );
        }
        if !non_negative(team.monthly_budget_usd) {
            report(
                item("teams", i, "monthly_budget_usd"),
                "must not be negative".into(),
            );
        }
    }
}

fn substrates(config: &Config, report: Report<'_>) {
    let mut names = BTreeSet::new();
    // Lease ids are named after the cluster: two substrates of one cluster would share them.
    let mut clusters = BTreeSet::new();
    for (i, s) in config.substrates.iter().enumerate() {
        if let Some(slurm) = &s.slurm {
            if !clusters.insert(slurm.cluster.to_ascii_lowercase()) {
                report(
                    vec![
                        key("substrates"),
                        Seg::Index(i),
                        key("slurm"),
                        key("cluster"),
                    ],
                    format!(
                        "cluster `{}` is another substrate's too: its lease ids would collide",
                        slurm.cluster
                    ),
                );
            }
        }
    }
    for (i, s) in config.substrates.iter().enumerate() {
        if s.name.trim().is_empty() {
            report(item("substrates", i, "name"), "must not be empty".into());
        } else if !names.insert(&s.name) {
            report(
                item("substrates", i, "name"),
                format!("substrate `{}` is defined twice", s.name),
            );
        }
        let driver = s.driver.as_str();
        let set: [(&str, bool); 19] = [
            ("hosts", !s.hosts.is_empty()),
            ("host", s.host.is_some()),
            ("gpu_model", s.gpu_model.is_some()),
            ("gpu_uuids", !s.gpu_uuids.is_empty()),
            ("capacity", s.capacity.is_some()),
            ("grace_period", s.grace_period.is_some()),
            ("url", s.url.is_some()),
            ("secret", s.secret.is_some()),
            ("timeout", s.timeout.is_some()),
            ("retries", s.retries.is_some()),
            ("accounts", !s.accounts.is_empty()),
            ("same_name_accounts", s.same_name_accounts.is_some()),
            ("min_uid", s.min_uid.is_some()),
            ("work_dir", s.work_dir.is_some()),
            ("denied_groups", s.denied_groups.is_some()),
            ("run_as_enforcer", s.run_as_enforcer.is_some()),
            ("slurm", s.slurm.is_some()),
            ("kubernetes", s.kubernetes.is_some()),
            ("libvirt", s.libvirt.is_some()),
        ];
        let (required, allowed): (&[&str], &[&str]) = match s.driver {
            DriverKind::Simulated => (&["hosts"], &["hosts"]),
            DriverKind::Local => (
                &["gpu_model", "gpu_uuids"],
                &[
                    "host",
                    "gpu_model",
                    "gpu_uuids",
                    "grace_period",
                    "accounts",
                    "same_name_accounts",
                    "min_uid",
                    "work_dir",
                    "denied_groups",
                    "run_as_enforcer",
                ],
            ),
            DriverKind::Webhook => (
                &["url", "gpu_model", "capacity"],
                &[
                    "url",
                    "secret",
                    "timeout",
                    "retries",
                    "gpu_model",
                    "capacity",
                ],
            ),
            DriverKind::Slurm => (
                &["slurm"],
                &[
                    "slurm",
                    "accounts",
                    "same_name_accounts",
                    "min_uid",
                    "denied_groups",
                    "work_dir",
                ],
            ),
            DriverKind::Kubernetes => (&["kubernetes"], &["kubernetes"]),
            DriverKind::Libvirt => (&["libvirt"], &["libvirt"]),
        };
        for (field, present) in set {
            if present && !allowed.contains(&field) {
                report(
                    item("substrates", i, field),
                    format!(
                        "is not a setting of the {driver} driver (it takes {})",
                        allowed.join(", ")
                    ),
                );
            }
            if !present && required.contains(&field) {
                report(
                    item("substrates", i, "driver"),
                    format!("the {driver} driver needs `{field}`"),
                );
            }
        }
        for (j, group) in s.hosts.iter().enumerate() {
            let path = |f: &str| {
                vec![
                    key("substrates"),
                    Seg::Index(i),
                    key("hosts"),
                    Seg::Index(j),
                    key(f),
                ]
            };
            if group.count == 0 {
                report(path("count"), "must be at least 1".into());
            }
            if group.gpus == 0 {
                report(path("gpus"), "must be at least 1".into());
            }
            if group.gpus > MAX_SIMULATED_GPUS_PER_HOST {
                report(
                    path("gpus"),
                    format!(
                        "{} GPUs on one host; a simulated host has at most {MAX_SIMULATED_GPUS_PER_HOST}",
                        group.gpus
                    ),
                );
            }
            if group.prefix.trim().is_empty() {
                report(path("prefix"), "must not be empty".into());
            }
        }
        for (user, account) in &s.accounts {
            if account.trim().is_empty() || account.contains(['/', ':', '\0']) {
                let path = vec![key("substrates"), Seg::Index(i), key("accounts"), key(user)];
                report(path, format!("\"{account}\" is not a system account name"));
            }
        }
        if s.min_uid == Some(0) {
            report(
                item("substrates", i, "min_uid"),
                "must be at least 1: a lease's command never runs as root".into(),
            );
        }
        if let Some(dir) = &s.work_dir {
            if !dir.is_absolute() {
                report(
                    item("substrates", i, "work_dir"),
                    format!("{} is not an absolute path", dir.display()),
                );
            }
        }
        let total: u64 = s
            .hosts
            .iter()
            .map(|g| u64::from(g.count) * u64::from(g.gpus))
            .sum();
        if total > MAX_SIMULATED_GPUS {
            report(
                item("substrates", i, "hosts"),
                format!(
                    "the host groups add up to {total} GPUs; a simulated substrate has at most \
                     {MAX_SIMULATED_GPUS}"
                ),
            );
        }
        if let Some(slurm) = &s.slurm {
            slurm_settings(config, i, slurm, report);
        }
        if let Some(kubernetes) = &s.kubernetes {
            kubernetes_settings(config, i, kubernetes, report);
        }
        if let Some(libvirt) = &s.libvirt {
            libvirt_settings(i, libvirt, report);
        }
        if let Some(url) = &s.url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                report(
                    item("substrates", i, "url"),
                    format!("\"{url}\" is not an http:// or https:// URL"),
                );
            }
        }
    }
}

/// `[substrates.libvirt]`: a URI, PCI ids and addresses, mediated device UUIDs libvirt would
/// accept, each GPU named once, bounded times.
fn libvirt_settings(i: usize, l: &LibvirtSettings, report: Report<'_>) {
    let path = |f: &str| vec![key("substrates"), Seg::Index(i), key("libvirt"), key(f)];
    if !l.uri.contains(":/") {
        report(
            path("uri"),
            format!(
                "\"{}\" is not a libvirt URI (e.g. qemu:///system, qemu+ssh://host/system)",
                l.uri
            ),
        );
    }
    if l.domain_template.as_os_str().is_empty() {
        report(
            path("domain_template"),
            "must name a domain XML file".into(),
        );
    }
    for (id, model) in &l.models {
        let mut p = path("models");
        p.push(key(id));
        if !crate::libvirt::is_pci_device_id(id) {
            report(
                p.clone(),
                format!(
                    "\"{id}\" is not a PCI device id (four hex digits after 0x, e.g. \"0x2330\")"
                ),
            );
        }
        if model.trim().is_empty() {
            report(p, "must name a GPU model".into());
        }
    }
    let mut seen = BTreeSet::new();
    for (j, gpu) in l.gpus.iter().enumerate() {
        let path = |f: &str| {
            let mut p = path("gpus");
            p.push(Seg::Index(j));
            p.push(key(f));
            p
        };
        match (&gpu.pci, &gpu.mdev) {
            (Some(_), Some(_)) | (None, None) => report(
                path("pci"),
                "name either `pci` (a GPU passed through whole) or `mdev` (a vGPU), not both"
                    .into(),
            ),
            (Some(pci), None) => match crate::libvirt::PciAddress::parse(pci) {
                None => report(
                    path("pci"),
                    format!(
                        "\"{pci}\" is not a PCI address (domain:bus:slot.function, e.g. \
                             0000:41:00.0)"
                    ),
                ),
                Some(address) => {
                    if !seen.insert(address.to_string()) {
                        report(path("pci"), format!("{address} is listed twice"));
                    }
                }
            },
            (None, Some(mdev)) => {
                if !crate::libvirt::is_uuid(mdev) {
                    report(
                        path("mdev"),
                        format!("\"{mdev}\" is not a mediated device UUID (8-4-4-4-12 hex digits)"),
                    );
                } else if !seen.insert(mdev.to_ascii_lowercase()) {
                    report(path("mdev"), format!("{mdev} is listed twice"));
                }
                if gpu.model.is_none() {
                    report(
                        path("model"),
                        "a vGPU needs its model (what the guest's NVML reports)".into(),
                    );
                }
            }
        }
        if gpu.model.as_ref().is_some_and(|m| m.trim().is_empty()) {
            report(path("model"), "must name a GPU model".into());
        }
    }
    if l.poll
        .is_some_and(|p| p < Duration::from_secs(1) || p > Duration::from_secs(600))
    {
        report(path("poll"), "must be between 1s and 10m".into());
    }
    if l.grace_period
        .is_some_and(|g| g > Duration::from_secs(3600))
    {
        report(path("grace_period"), "must be at most 1h".into());
    }
}

/// `[substrates.kubernetes]`: teams that exist, label keys Kubernetes accepts, bounded times.
fn kubernetes_settings(config: &Config, i: usize, k: &KubernetesSettings, report: Report<'_>) {
    let path = |f: &str| vec![key("substrates"), Seg::Index(i), key("kubernetes"), key(f)];
    for (namespace, team) in &k.teams {
        if config.team(team).is_none() {
            let mut p = path("teams");
            p.push(key(namespace));
            report(p, format!("no team is named `{team}`"));
        }
    }
    for (field, label) in [
        ("user_label", &k.user_label),
        ("workload_label", &k.workload_label),
        ("project_label", &k.project_label),
        ("model_label", &k.model_label),
    ] {
        if let Err(why) = crate::kubernetes::check_label_key(label) {
            report(
                path(field),
                format!("\"{label}\" is not a Kubernetes label key: {why}"),
            );
        }
    }
    for (value, model) in &k.models {
        if model.trim().is_empty() {
            let mut p = path("models");
            p.push(key(value));
            report(p, "must name a GPU model".into());
        }
    }
    if k.poll
        .is_some_and(|p| p < Duration::from_secs(1) || p > Duration::from_secs(600))
    {
        report(path("poll"), "must be between 1s and 10m".into());
    }
    if k.grace_period
        .is_some_and(|g| g > Duration::from_secs(3600))
    {
        report(path("grace_period"), "must be at most 1h".into());
    }
    if let Some(kueue) = &k.kueue {
        let path = |f: &str| {
            let mut p = path("kueue");
            p.push(key(f));
            p
        };
        // Kueue's own rule for a controller name: a non-empty string of at most 253 characters.
        if kueue.controller_name.trim().is_empty() || kueue.controller_name.len() > 253 {
            report(
                path("controller_name"),
                "must be 1 to 253 characters, the spec.controllerName of the AdmissionCheck".into(),
            );
        }
        if !KueueSettings::API_VERSIONS.contains(&kueue.api_version.as_str()) {
            report(
                path("api_version"),
                format!(
                    "\"{}\" is not a Kueue API version gpuwarden speaks ({})",
                    kueue.api_version,
                    KueueSettings::API_VERSIONS.join(" or ")
                ),
            );
        }
        if kueue
            .poll
            .is_some_and(|p| p < Duration::from_secs(1) || p > Duration::from_secs(300))
        {
            report(path("poll"), "must be between 1s and 5m".into());
        }
    }
}

/// `[substrates.slurm]`: names that become lease ids and teams that exist.
fn slurm_settings(config: &Config, i: usize, slurm: &SlurmSettings, report: Report<'_>) {
    let path = |f: &str| vec![key("substrates"), Seg::Index(i), key("slurm"), key(f)];
    let cluster = &slurm.cluster;
    if !crate::lease::is_slurm_cluster_name(cluster) {
        report(
            path("cluster"),
            format!(
                "\"{cluster}\" is not a Slurm cluster name gpuwarden can put in a lease id \
                 (1 to {} ASCII letters, digits, '_', '.' or '-')",
                crate::lease::SLURM_CLUSTER_NAME_MAX
            ),
        );
    }
    for (name, team) in &slurm.teams {
        if config.team(team).is_none() {
            let mut p = path("teams");
            p.push(key(name));
            report(p, format!("no team is named `{team}`"));
        }
    }
    for (gres, model) in &slurm.models {
        if model.trim().is_empty() {
            let mut p = path("models");
            p.push(key(gres));
            report(p, "must name a GPU model".into());
        }
    }
    if slurm
        .poll
        .is_some_and(|p| p < Duration::from_millis(200) || p > Duration::from_secs(300))
    {
        report(path("poll"), "must be between 200ms and 5m".into());
    }
    if slurm
        .hold_timeout
        .is_some_and(|t| t < Duration::from_secs(10))
    {
        report(
            path("hold_timeout"),
            "must be at least 10s: a job needs time to reach the queue".into(),
        );
    }
    for (field, dir) in [
        ("slurm_conf", &slurm.slurm_conf),
        ("bin_dir", &slurm.bin_dir),
    ] {
        if dir.as_ref().is_some_and(|d| !d.is_absolute()) {
            report(path(field), "must be an absolute path".into());
        }
    }
}

fn workloads(config: &Config, report: Report<'_>) {
    for (workload, policy) in &config.workloads {
        let path = |f: &str| vec![key("workloads"), key(workload.as_str()), key(f)];
        if policy.max_gpus == Some(0) {
            report(path("max_gpus"), "must be at least 1".into());
        }
        if let (Some(min), Some(max)) = (policy.min_gpus, policy.max_gpus) {
            if min > max {
                report(
                    path("min_gpus"),
                    format!("{min} is more than max_gpus ({max})"),
                );
            }
        }
        if let (Some(warn), Some(idle)) = (policy.warn_before, policy.idle_timeout) {
            if warn >= idle {
                report(
                    path("warn_before"),
                    "must be shorter than idle_timeout".into(),
                );
            }
        }
        if policy.on_idle == OnIdle::Resize && policy.min_gpus.is_none() {
            report(
                path("on_idle"),
                "\"resize\" shrinks a lease to min_gpus, which is not set".into(),
            );
        }
        if policy.on_idle != OnIdle::Alert && policy.idle_timeout.is_none() {
            report(
                path("on_idle"),
                "needs idle_timeout to say when a lease counts as idle".into(),
            );
        }
        if let Some(target) = policy.target_util_pct {
            if !(target > 0.0 && target <= 100.0) {
                report(
                    path("target_util_pct"),
                    format!("{target} is outside (0, 100]"),
                );
            }
        }
        for (i, name) in policy.substrates.iter().enumerate() {
            if config.substrate(name).is_none() {
                let mut p = path("substrates");
                p.push(Seg::Index(i));
                report(p, format!("no substrate is named `{name}`"));
            }
        }
        for (i, program) in policy.programs.iter().enumerate() {
            if !program.starts_with('/') {
                let mut p = path("programs");
                p.push(Seg::Index(i));
                report(
                    p,
                    format!("\"{program}\" is not an absolute path; a command's first word is compared with it as written"),
                );
            }
        }
    }
}

/// `storage.lake` and `[storage.s3]`: a lake location gpuwarden can reach, and S3 settings only
/// where the lake is in S3.
fn storage(config: &Config, report: Report<'_>) {
    let s3 = &config.storage.s3;
    match config.lake() {
        // The S3 settings are checked too: the lake was meant to be in a bucket, or a typo
        // in its URL should not hide the other mistakes.
        Err(message) => report(at(&["storage", "lake"]), message),
        Ok(location) if !location.is_object_store() => {
            if s3.is_set() {
                report(
                    at(&["storage", "s3"]),
                    format!(
                        "is set, but the lake is the directory {location}: `[storage.s3]` \
                         applies to an `s3://` storage.lake"
                    ),
                );
            }
            return;
        }
        Ok(_) => {}
    }
    if let Some(endpoint) = &s3.endpoint {
        let http = endpoint.starts_with("http://");
        if !http && !endpoint.starts_with("https://") {
            report(
                at(&["storage", "s3", "endpoint"]),
                format!("\"{endpoint}\" is not an http:// or https:// URL"),
            );
        } else if http && s3.allow_http != Some(true) {
            report(
                at(&["storage", "s3", "endpoint"]),
                format!(
                    "\"{endpoint}\" is plain HTTP: set `allow_http = true` to send the lake's \
                     data and signed requests unencrypted, or use https://"
                ),
            );
        }
    }
    for (field, value) in [
        ("access_key_id", &s3.access_key_id),
        ("secret_access_key", &s3.secret_access_key),
        ("session_token", &s3.session_token),
        ("region", &s3.region),
    ] {
        if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
            report(
                at(&["storage", "s3", field]),
                "is empty; leave it out to take it from the environment".into(),
            );
        }
    }
    if s3.access_key_id.is_some() != s3.secret_access_key.is_some() {
        let (given, missing) = if s3.access_key_id.is_some() {
            ("access_key_id", "secret_access_key")
        } else {
            ("secret_access_key", "access_key_id")
        };
        report(
            at(&["storage", "s3", given]),
            format!("is set without `{missing}`: a credential is the two together"),
        );
    }
    if let Some(ttl) = s3.lease_ttl {
        if ttl < std::time::Duration::from_secs(3) {
            report(
                at(&["storage", "s3", "lease_ttl"]),
                format!(
                    "is {} ms: a lease is renewed every third of it, over the network, so it \
                     must be at least 3s (30s is the default)",
                    ttl.as_millis()
                ),
            );
        }
    }
    if s3.session_token.is_some() && s3.access_key_id.is_none() {
        report(
            at(&["storage", "s3", "session_token"]),
            "is set without `access_key_id` and `secret_access_key`, which it belongs to".into(),
        );
    }
}

/// The shortest signing key accepted, in bytes: HMAC-SHA256's own output size.
pub(crate) const MIN_SIGNING_KEY_BYTES: usize = 32;

fn signing(config: &Config, report: Report<'_>) {
    let s = &config.signing;
    for (field, value) in [("key", &s.key), ("previous_key", &s.previous_key)] {
        if let Some(k) = value {
            if k.len() < MIN_SIGNING_KEY_BYTES {
                report(
                    at(&["signing", field]),
                    format!(
                        "is {} bytes; a signing key needs at least {MIN_SIGNING_KEY_BYTES} (e.g. `openssl rand -hex 32`)",
                        k.len()
                    ),
                );
            }
        }
    }
    if s.previous_key.is_some() && s.key.is_none() {
        report(
            at(&["signing", "previous_key"]),
            "is only accepted beside `key`, which signs".into(),
        );
    }
    if s.key.is_some() && s.key == s.previous_key {
        report(
            at(&["signing", "previous_key"]),
            "is the same as `key`; during a rotation it holds the old key".into(),
        );
    }
}

fn tokens(config: &Config, report: Report<'_>) {
    let mut hashes = BTreeSet::new();
    for (i, token) in config.tokens.iter().enumerate() {
        let hash = &token.sha256;
        if hash.len() != 64
            || !hash
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
        {
            report(
                item("tokens", i, "sha256"),
                "must be 64 lowercase hex digits: the SHA-256 of the token (`printf %s TOKEN | sha256sum`)".into(),
            );
        } else if !hashes.insert(hash) {
            report(
                item("tokens", i, "sha256"),
                "the same token is configured twice".into(),
            );
        }
        if matches!(token.role, Role::Member | Role::Service) && token.teams.is_empty() {
            report(
                item("tokens", i, "teams"),
                "a member or service token must name at least one team".into(),
            );
        }
        for (j, team) in token.teams.iter().enumerate() {
            if config.team(team).is_none() {
                report(
                    vec![key("tokens"), Seg::Index(i), key("teams"), Seg::Index(j)],
                    format!("no team is named `{team}`"),
                );
            }
        }
    }
}
