//! A gpuwarden config file written in code, for the tests that need a team, a workload, a
//! substrate or a token: typed parts for what the tests share, and `raw` for any other key.
//!
//! ```ignore
//! Config::new()
//!     .broker(&broker.bootstrap)
//!     .data_dir(&dir.join("data"))
//!     .team(Team::new("ml", 4, 1000.0).members(&["ada"]))
//!     .workload(Workload::new("training").max_gpus(8).max_duration("24h"))
//!     .enforcer()
//!     .substrate(Substrate::simulated("sim").hosts("h", 1, 8, H100))
//!     .token("ada", TOKEN, "member", &["ml"])
//!     .raw("[enforcer]\nmode = \"advisory\"\n")
//!     .write(dir.join("gpuwarden.toml"))
//! ```
//!
//! `raw` (on [`Config`] and on each part) merges TOML text into what is there: tables merge key
//! by key, an array of tables (`[[tokens]]`) grows, and any other key it names again takes its
//! value, so that a test can say "the same config, but…". The file is the TOML the `toml` crate
//! prints, which says the same as a hand-written one: the loader does not care about the order
//! of keys, nor whether a table is written inline.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use toml::{Table, Value};

/// The GPU model the simulated fleets of the tests are made of, as NVML names it.
pub const H100: &str = "NVIDIA H100 80GB HBM3";

/// What a `[[tokens]]` entry's `sha256` holds for a bearer token, computed here independently of
/// the enforcer: SHA-256 in hex, as `printf %s TOKEN | sha256sum` prints it.
pub fn sha256_hex(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A whole config file. Its methods add to it (where two set one key, the later wins);
/// [`Config::write`] writes it.
#[derive(Clone, Debug, Default)]
pub struct Config(Table);

impl Config {
    /// An empty file: every section at its defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// `[kafka] brokers`: a bootstrap address, or `"embedded"` for the broker each process
    /// starts in itself.
    pub fn kafka(self, brokers: &str) -> Self {
        self.set("kafka", "brokers", brokers)
    }

    /// [`Config::kafka`] for the test's broker at `bootstrap`, with `partitions = 3`: as many as
    /// `support::Broker` and tansu make a topic.
    pub fn broker(self, bootstrap: &str) -> Self {
        self.kafka(bootstrap).set("kafka", "partitions", 3)
    }

    /// `[storage] data_dir`: where the lake and the enforcer's state live.
    pub fn data_dir(self, dir: &Path) -> Self {
        self.set("storage", "data_dir", dir.display().to_string())
    }

    /// `[pricing] default_usd_per_gpu_hour`: what a GPU-hour costs that no [`Config::gpu_price`]
    /// matches.
    pub fn pricing(self, default_usd_per_gpu_hour: f64) -> Self {
        self.set(
            "pricing",
            "default_usd_per_gpu_hour",
            default_usd_per_gpu_hour,
        )
    }

    /// A `[[pricing.gpu]]`: a GPU-hour of a model whose name contains `model` costs
    /// `usd_per_gpu_hour`.
    pub fn gpu_price(mut self, model: &str, usd_per_gpu_hour: f64) -> Self {
        let price = table([
            ("match", model.into()),
            ("usd_per_gpu_hour", usd_per_gpu_hour.into()),
        ]);
        push(section(&mut self.0, "pricing"), "gpu", price);
        self
    }

    /// A `[[teams]]`.
    pub fn team(mut self, team: Team) -> Self {
        push(&mut self.0, "teams", team.0);
        self
    }

    /// A `[workloads.NAME]`.
    pub fn workload(mut self, workload: Workload) -> Self {
        section(&mut self.0, "workloads").insert(workload.name, Value::Table(workload.rules));
        self
    }

    /// `[enforcer] listen = "127.0.0.1:0"`: the admission API on a free port, which the
    /// enforcer's "enforcer running" log line gives.
    pub fn enforcer(self) -> Self {
        self.set("enforcer", "listen", "127.0.0.1:0")
    }

    /// `[enforcer.store] url`: the lease store in the PostgreSQL database at `url`, which
    /// replicas share.
    pub fn store(self, url: &str) -> Self {
        self.set("enforcer.store", "url", url)
    }

    /// `[enforcer.leader]`: this replica's name, `replica`, and how long the leader's lease
    /// lasts, `lease`.
    pub fn leader(self, lease: &str, replica: &str) -> Self {
        self.set("enforcer.leader", "lease", lease)
            .set("enforcer.leader", "replica", replica)
    }

    /// A `[[substrates]]`.
    pub fn substrate(mut self, substrate: Substrate) -> Self {
        push(&mut self.0, "substrates", substrate.0);
        self
    }

    /// A `[[tokens]]`: `name`, the SHA-256 of the bearer token `secret`, `role` (`admin`,
    /// `member`, `viewer`, `service`) and the `teams` it acts for (none written when empty, as
    /// for an admin).
    pub fn token(mut self, name: &str, secret: &str, role: &str, teams: &[&str]) -> Self {
        let mut token = table([
            ("name", name.into()),
            ("sha256", sha256_hex(secret).into()),
            ("role", role.into()),
        ]);
        if !teams.is_empty() {
            token.insert("teams".into(), strings(teams));
        }
        push(&mut self.0, "tokens", token);
        self
    }

    /// `[signing] key`: the key signals are signed with.
    pub fn signing(self, key: &str) -> Self {
        self.set("signing", "key", key)
    }

    /// What `gpuwarden up` runs here on a simulated fleet: the collector samples every 10 s (of
    /// event time), the pipeline flushes at 300 ms and rolls up every 2 s, and every listener,
    /// the enforcer's API included, takes a free port of 127.0.0.1.
    pub fn up(self) -> Self {
        const FREE: &str = "127.0.0.1:0";
        self.set("collector", "source", "simulated")
            .set("collector", "interval", "10s")
            .set("collector", "metrics_listen", FREE)
            .set("pipeline", "flush_age", "300ms")
            .set("pipeline", "rollup_every", "2s")
            .set("pipeline", "metrics_listen", FREE)
            .set("pipeline", "sql_listen", FREE)
            .enforcer()
    }

    /// `[pipeline] sql_allow_anonymous = true`: psql connects to the SQL endpoint as anyone.
    pub fn anonymous_sql(self) -> Self {
        self.set("pipeline", "sql_allow_anonymous", true)
    }

    /// `[pipeline.signals]`: a signal every `every` over the last `window` (of event time).
    pub fn signals(self, every: &str, window: &str) -> Self {
        self.set("pipeline.signals", "every", every)
            .set("pipeline.signals", "window", window)
    }

    /// Merges `toml` into the file (see the module's doc): for the keys no method names.
    pub fn raw(mut self, toml: &str) -> Self {
        merge(&mut self.0, toml);
        self
    }

    /// The file's text.
    pub fn text(&self) -> String {
        toml::to_string(&self.0).expect("a config prints as TOML")
    }

    /// Writes the file at `path`, and returns `path`.
    pub fn write(&self, path: impl Into<PathBuf>) -> PathBuf {
        let path = path.into();
        std::fs::write(&path, self.text())
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        path
    }

    /// Sets `key` of the table at the dotted `path` (`"enforcer.store"`).
    fn set(mut self, path: &str, key: &str, value: impl Into<Value>) -> Self {
        let table = path.split('.').fold(&mut self.0, section);
        table.insert(key.into(), value.into());
        self
    }
}

/// A `[[teams]]` entry.
#[derive(Clone, Debug)]
pub struct Team(Table);

impl Team {
    /// Team `name`, which may hold `gpu_quota` GPUs at once and spend `monthly_budget_usd` a
    /// month.
    pub fn new(name: &str, gpu_quota: u32, monthly_budget_usd: f64) -> Self {
        Self(table([
            ("name", name.into()),
            ("gpu_quota", gpu_quota.into()),
            ("monthly_budget_usd", monthly_budget_usd.into()),
        ]))
    }

    /// `members`: the users who may ask for the team.
    pub fn members(mut self, members: &[&str]) -> Self {
        self.0.insert("members".into(), strings(members));
        self
    }

    /// `allowed_models`: the GPU models the team may have (an empty list says any).
    pub fn allowed_models(mut self, models: &[&str]) -> Self {
        self.0.insert("allowed_models".into(), strings(models));
        self
    }
}

/// A `[workloads.NAME]` section: the rules for one workload.
#[derive(Clone, Debug)]
pub struct Workload {
    name: String,
    rules: Table,
}

impl Workload {
    /// Workload `name` with no rule of its own: offered, its leases only expire. (A config that
    /// defines some workloads offers only those.)
    pub fn new(name: &str) -> Self {
        Self {
            name: name.into(),
            rules: Table::new(),
        }
    }

    /// `max_gpus`: the most GPUs one lease may have.
    pub fn max_gpus(mut self, gpus: u32) -> Self {
        self.rules.insert("max_gpus".into(), gpus.into());
        self
    }

    /// `max_duration`: the longest lease, as `"24h"`.
    pub fn max_duration(mut self, duration: &str) -> Self {
        self.rules.insert("max_duration".into(), duration.into());
        self
    }

    /// `substrates`: the only substrates its leases may run on.
    pub fn substrates(mut self, names: &[&str]) -> Self {
        self.rules.insert("substrates".into(), strings(names));
        self
    }

    /// `on_idle` (as `"reclaim"`) once a lease has been idle for `idle_timeout`.
    pub fn on_idle(mut self, action: &str, idle_timeout: &str) -> Self {
        self.rules
            .insert("idle_timeout".into(), idle_timeout.into());
        self.rules.insert("on_idle".into(), action.into());
        self
    }

    /// Merges `toml` into this workload's section, for the rules no method names.
    pub fn raw(mut self, toml: &str) -> Self {
        merge(&mut self.rules, toml);
        self
    }
}

/// A `[[substrates]]` entry: where leases run.
#[derive(Clone, Debug)]
pub struct Substrate(Table);

impl Substrate {
    /// Substrate `name` of `driver`; [`Substrate::raw`] adds the driver's settings.
    pub fn new(name: &str, driver: &str) -> Self {
        Self(table([("name", name.into()), ("driver", driver.into())]))
    }

    /// A simulated fleet, of the [`Substrate::hosts`] added to it.
    pub fn simulated(name: &str) -> Self {
        Self::new(name, "simulated")
    }

    /// One entry of a simulated fleet's `hosts`: `count` hosts named `prefix`0, `prefix`1, …,
    /// each with `gpus` GPUs of `gpu_model`.
    pub fn hosts(mut self, prefix: &str, count: u32, gpus: u32, gpu_model: &str) -> Self {
        let hosts = table([
            ("prefix", prefix.into()),
            ("count", count.into()),
            ("gpus", gpus.into()),
            ("gpu_model", gpu_model.into()),
        ]);
        push(&mut self.0, "hosts", hosts);
        self
    }

    /// A Kubernetes cluster, its API server as `kubeconfig` says, with the admission webhook on
    /// a free port of 127.0.0.1 serving TLS with `cert` and `key`.
    pub fn kubernetes(name: &str, kubeconfig: &Path, cert: &Path, key: &Path) -> Self {
        let tls = table([
            ("cert", cert.display().to_string().into()),
            ("key", key.display().to_string().into()),
        ]);
        let kubernetes = table([
            ("kubeconfig", kubeconfig.display().to_string().into()),
            ("webhook_listen", "127.0.0.1:0".into()),
            ("webhook_tls", Value::Table(tls)),
        ]);
        let mut substrate = Self::new(name, "kubernetes");
        substrate
            .0
            .insert("kubernetes".into(), Value::Table(kubernetes));
        substrate
    }

    /// Merges `toml` into this substrate's entry, for the settings no method names; the driver's
    /// own table is `[DRIVER]` here (`[slurm]` for `[substrates.slurm]`).
    pub fn raw(mut self, toml: &str) -> Self {
        merge(&mut self.0, toml);
        self
    }
}

fn table<const N: usize>(entries: [(&str, Value); N]) -> Table {
    entries
        .into_iter()
        .map(|(key, value)| (key.to_string(), value))
        .collect()
}

fn strings(items: &[&str]) -> Value {
    Value::Array(items.iter().map(|&item| item.into()).collect())
}

/// The table `name` of `table`, made empty when there is none.
fn section<'t>(table: &'t mut Table, name: &str) -> &'t mut Table {
    match table
        .entry(name)
        .or_insert_with(|| Value::Table(Table::new()))
    {
        Value::Table(section) => section,
        other => panic!("`{name}` is {other}, not a table"),
    }
}

/// Appends `entry` to the array of tables `name` of `table`.
fn push(table: &mut Table, name: &str, entry: Table) {
    match table
        .entry(name)
        .or_insert_with(|| Value::Array(Vec::new()))
    {
        Value::Array(entries) => entries.push(Value::Table(entry)),
        other => panic!("`{name}` is {other}, not an array of tables"),
    }
}

/// Merges the TOML `text` into `into`: tables merge, arrays of tables grow, other keys take the
/// value `text` gives them.
fn merge(into: &mut Table, text: &str) {
    let more: Table = text
        .parse()
        .unwrap_or_else(|e| panic!("raw TOML that does not parse: {e}\n{text}"));
    merge_tables(into, more);
}

fn merge_tables(into: &mut Table, more: Table) {
    for (key, value) in more {
        match (into.get_mut(&key), value) {
            (Some(Value::Table(old)), Value::Table(new)) => merge_tables(old, new),
            (Some(Value::Array(old)), Value::Array(new))
                if new.iter().all(Value::is_table) && old.iter().all(Value::is_table) =>
            {
                old.extend(new)
            }
            (_, value) => {
                into.insert(key, value);
            }
        }
    }
}
