//! The one configuration file every gpuwarden process reads.
//!
//! It lives in `schema` because the components that read it never import one another: the
//! collector's simulated fleet and the enforcer's `simulated` driver must see the same inventory,
//! and the pipeline and the enforcer must price GPUs the same way. A section a component does not
//! use is ignored by it, so one file serves every process.
//!
//! [`load`] parses the TOML, substitutes `${ENV}` references, checks every key and value, and
//! reports every problem it finds with its line, column and field path ([`ConfigErrors`]).
//!
//! Every section derives `JsonSchema` as well (durations and sizes through `schema_with`), so
//! that the reference page of the keys, docs/src/reference/config.md, is generated from these
//! types: their doc comments, types and `Default`s (tests/reference.rs).
//!
//! Its modules are declared lowest layer first, each using only those above it: how durations
//! and sizes are written (`duration`, `size`), where a field is (`field_path`), the rules a
//! config must follow beyond its keys and types (`validate`), and reading the file, which applies
//! them (`load`).

mod duration;
mod size;
mod field_path;
mod validate;
mod load;

pub use validate::{MAX_SIMULATED_GPUS, MAX_SIMULATED_GPUS_PER_HOST};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::lease::Workload;

pub use duration::parse as parse_duration;
pub use load::{
    load, load_for_build, parse, parse_for_build, ConfigError, ConfigErrors, CONFIG_VERSION,
};
pub use size::parse as parse_size;

/// The whole configuration file.
#[derive(Debug, Clone, Default, PartialEq, JsonSchema)]
pub struct Config {
    /// `[kafka]`: where the topics are.
    pub kafka: KafkaConfig,
    /// `[storage]`: where data lives on disk.
    pub storage: StorageConfig,
    /// `[collector]`: how GPUs are sampled.
    pub collector: CollectorConfig,
    /// `[pipeline]`: ingest, rollups, signals and the SQL endpoint.
    pub pipeline: PipelineConfig,
    /// `[pricing]`: what a GPU-hour costs.
    pub pricing: PricingConfig,
    /// `[[teams]]`: who may hold GPUs, how many, and for how much money.
    pub teams: Vec<TeamConfig>,
    /// `[workloads.<name>]`: policy per kind of work.
    pub workloads: BTreeMap<Workload, WorkloadPolicy>,
    /// `[enforcer]`: the admission API and runtime rules.
    pub enforcer: EnforcerConfig,
    /// `[[substrates]]`: where leases run, each through a driver.
    pub substrates: Vec<SubstrateConfig>,
    /// `[[tokens]]`: API principals.
    pub tokens: Vec<TokenConfig>,
    /// `[signing]`: the key that signs what the pipeline and the enforcer send each other.
    pub signing: SigningConfig,
}

/// `[signing]`: the shared HMAC key of the records between the pipeline and the enforcer
/// (signals one way, lease events and actions the other; see `gpuwarden_schema::signing`).
#[derive(Clone, Default, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SigningConfig {
    /// Signs and verifies; at least 32 bytes, e.g. `${GPUWARDEN_SIGNING_KEY}` holding
    /// `openssl rand -hex 32`. Without it nothing is signed and the enforcer acts on no signal.
    pub key: Option<String>,
    /// Also accepted while keys rotate.
    pub previous_key: Option<String>,
}

impl std::fmt::Debug for SigningConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |k: &Option<String>| k.as_ref().map(|_| "<set>");
        f.debug_struct("SigningConfig")
            .field("key", &set(&self.key))
            .field("previous_key", &set(&self.previous_key))
            .finish()
    }
}

impl Config {
    /// The measure that says a lease of `workload` is idle: the workload's `idle_measure`, else
    /// `pricing.idle_measure`.
    pub fn idle_measure(&self, workload: Option<Workload>) -> IdleMeasure {
        workload
            .and_then(|w| self.workloads.get(&w))
            .and_then(|p| p.idle_measure)
            .unwrap_or(self.pricing.idle_measure)
    }

    /// The team named `name`.
    pub fn team(&self, name: &str) -> Option<&TeamConfig> {
        self.teams.iter().find(|t| t.name == name)
    }

    /// The substrate named `name`.
    pub fn substrate(&self, name: &str) -> Option<&SubstrateConfig> {
        self.substrates.iter().find(|s| s.name == name)
    }

    /// The policy for a kind of work (the defaults when the file has none).
    pub fn workload(&self, workload: Workload) -> WorkloadPolicy {
        self.workloads.get(&workload).cloned().unwrap_or_default()
    }

    /// The enforcer's SQLite database: `enforcer.database`, or `enforcer.db` in the data dir.
    pub fn enforcer_database(&self) -> PathBuf {
        self.enforcer
            .database
            .clone()
            .unwrap_or_else(|| self.storage.data_dir.join("enforcer.db"))
    }

    /// Where the lease store lives: `[enforcer.store] url` when set (a `postgres://` URL, or
    /// `sqlite:<path>` / a path), else the SQLite file of [`Config::enforcer_database`].
    pub fn enforcer_store(&self) -> StoreLocation {
        let store = &self.enforcer.store;
        match store.url.as_deref() {
            None => StoreLocation::Sqlite(self.enforcer_database()),
            Some(url)
                if StoreConfig::POSTGRES_SCHEMES
                    .iter()
                    .any(|s| url.starts_with(s)) =>
            {
                StoreLocation::Postgres {
                    url: url.to_owned(),
                    password_file: store.password_file.clone(),
                }
            }
            Some(url) => {
                let path = url.strip_prefix("sqlite:").unwrap_or(url);
                let path = path.strip_prefix("//").unwrap_or(path);
                StoreLocation::Sqlite(PathBuf::from(path))
            }
        }
    }

    /// Where the Parquet lake is: `storage.lake`, else the directory `<data_dir>/lake`. A config
    /// that [`load`] accepted has a valid `storage.lake`; on one that it did not check, an invalid
    /// one is reported here.
    pub fn lake(&self) -> Result<LakeLocation, String> {
        match &self.storage.lake {
            None => Ok(LakeLocation::Directory(self.storage.data_dir.join("lake"))),
            Some(lake) => LakeLocation::parse(lake),
        }
    }
}

/// `[kafka]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// Bootstrap servers (`host:port,host:port`), or `"embedded"` for an in-process mock cluster.
    pub brokers: String,
    /// Client id prefix reported to the brokers.
    pub client_id: String,
    /// Partitions for topics gpuwarden creates (existing topics are left as they are).
    pub partitions: i32,
    /// Replication factor for topics gpuwarden creates.
    pub replication_factor: i32,
    /// Extra librdkafka properties (security.protocol, sasl.*, …); `${ENV}` for secrets.
    pub properties: BTreeMap<String, String>,
    /// Static consumer-group membership (Kafka's `group.instance.id`): a consumer that restarts
    /// with the same id takes its partitions back at once, without waiting for the group to
    /// forget the dead member. Its partitions then wait `session_timeout` when it does not come
    /// back. Not used with `brokers = "embedded"`, whose broker dies with the process.
    pub static_membership: bool,
    /// This process's `group.instance.id` in the consumer groups it joins (the pipeline's
    /// ingest group, the enforcer's signals group): 1 to 249 ASCII letters, digits, `.`, `_` or
    /// `-`, and distinct for every process of a group. Unset: `<host>-<data dir hash>-<n>`,
    /// where `n` is the first slot no running process of the same role on this host and data
    /// dir holds, so two instances on one host never share an id and a restarted one gets its
    /// old id back.
    pub group_instance_id: Option<String>,
    /// How long a consumer-group member may go unheard (a crash, a network partition) before
    /// the broker hands its partitions to the others (`session.timeout.ms`, heartbeats every
    /// tenth of it). Kafka brokers accept 6s to 30m by default. Shorter notices a dead member
    /// sooner; too short rebalances on every network hiccup.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub session_timeout: Duration,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        Self {
            brokers: "embedded".into(),
            client_id: "gpuwarden".into(),
            partitions: 6,
            replication_factor: 1,
            properties: BTreeMap::new(),
            static_membership: true,
            group_instance_id: None,
            session_timeout: Duration::from_secs(10),
        }
    }
}

impl KafkaConfig {
    /// Whether an in-process mock cluster stands in for Kafka.
    pub fn is_embedded(&self) -> bool {
        self.brokers.trim() == "embedded"
    }
}

/// `[storage]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// Root of everything gpuwarden writes on this machine: the lake (unless `lake` puts it
    /// elsewhere), the enforcer's database, the slots of static group membership.
    pub data_dir: PathBuf,
    /// Where the Parquet lake is: a directory (`/srv/lake` or `file:///srv/lake`), or a bucket
    /// and prefix of an S3-compatible object store (`s3://bucket/prefix`, reached as `s3` says).
    /// Unset: `<data_dir>/lake`.
    pub lake: Option<String>,
    /// `[storage.s3]`: how an `s3://` lake is reached.
    pub s3: S3Config,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("gpuwarden-data"),
            lake: None,
            s3: S3Config::default(),
        }
    }
}

/// `[storage.s3]`: the endpoint, region and credentials of an `s3://` lake. Each one left unset
/// comes from the standard AWS environment variable in brackets, and then from the instance's
/// role (EC2 instance metadata, ECS task role, EKS web identity), as AWS's own tools find them.
#[derive(Clone, Default, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct S3Config {
    /// The store's URL, for stores other than AWS: MinIO, Ceph, R2, … (`AWS_ENDPOINT_URL`).
    /// Unset: AWS S3 in `region`.
    pub endpoint: Option<String>,
    /// The region requests are signed for (`AWS_REGION`, `AWS_DEFAULT_REGION`); stores that
    /// have none accept `us-east-1`.
    pub region: Option<String>,
    /// The access key (`AWS_ACCESS_KEY_ID`); `${ENV}` keeps it out of the file.
    pub access_key_id: Option<String>,
    /// The secret key (`AWS_SECRET_ACCESS_KEY`); `${ENV}` keeps it out of the file.
    pub secret_access_key: Option<String>,
    /// A temporary credential's session token (`AWS_SESSION_TOKEN`).
    pub session_token: Option<String>,
    /// Allow an `http://` endpoint, unencrypted (`AWS_ALLOW_HTTP`): for a store on the same
    /// host or a test.
    pub allow_http: Option<bool>,
    /// How long a role's lease on the lake lasts unless its holder renews it (every third of
    /// it): the one process rolling up, compacting, or publishing signals. A process that dies
    /// holding one gives its role up this long after its last renewal. Unset: 30 s.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub lease_ttl: Option<Duration>,
}

/// A role's lease on a lake in a bucket lasts this long unless `storage.s3.lease_ttl` says.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

impl S3Config {
    /// How long a role's lease lasts: `lease_ttl`, or [`DEFAULT_LEASE_TTL`].
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl.unwrap_or(DEFAULT_LEASE_TTL)
    }

    /// Whether any setting is given in the file.
    pub fn is_set(&self) -> bool {
        *self != Self::default()
    }
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |k: &Option<String>| k.as_ref().map(|_| "<set>");
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &set(&self.secret_access_key))
            .field("session_token", &set(&self.session_token))
            .field("allow_http", &self.allow_http)
            .field("lease_ttl", &self.lease_ttl)
            .finish()
    }
}

/// Where the lake is ([`Config::lake`]), read from `storage.lake`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LakeLocation {
    /// A directory of the local (or a shared) filesystem.
    Directory(PathBuf),
    /// Under `prefix` (no leading or trailing `/`; empty for the whole bucket) in an S3 bucket.
    S3 {
        /// The bucket's name.
        bucket: String,
        /// The key prefix every object of the lake starts with, then `/`.
        prefix: String,
    },
}

impl LakeLocation {
    /// Reads `storage.lake`: a path, `file://` and an absolute path, or `s3://bucket[/prefix]`.
    /// The error is a sentence about the value, for the config's report.
    pub fn parse(lake: &str) -> Result<Self, String> {
        const FORMS: &str =
            "storage.lake takes a directory (`/srv/lake`, `file:///srv/lake`) or `s3://BUCKET/PREFIX`";
        if lake.trim().is_empty() {
            return Err(format!("is empty; {FORMS}"));
        }
        let Some((scheme, rest)) = lake.split_once("://") else {
            return Ok(Self::Directory(PathBuf::from(lake)));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "file" => {
                if !rest.starts_with('/') {
                    return Err(format!(
                        "`{lake}` names a host or a relative path; a file URL is `file://` \
                         followed by an absolute path, `file:///srv/lake`"
                    ));
                }
                Ok(Self::Directory(PathBuf::from(rest)))
            }
            "s3" | "s3a" => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if !valid_bucket(bucket) {
                    return Err(format!(
                        "`{bucket}` is not an S3 bucket name (3 to 63 lowercase letters, \
                         digits, `.` and `-`, starting and ending with a letter or digit); {FORMS}"
                    ));
                }
                let prefix = prefix.trim_matches('/');
                if prefix.split('/').any(|part| {
                    part == "." || part == ".." || (part.is_empty() && !prefix.is_empty())
                }) || prefix.contains(['?', '#', '\\'])
                {
                    return Err(format!(
                        "`{prefix}` is not a key prefix the lake can live under: no empty, \
                         `.` or `..` parts, `?`, `#` or `\\`"
                    ));
                }
                Ok(Self::S3 {
                    bucket: bucket.to_string(),
                    prefix: prefix.to_string(),
                })
            }
            other => Err(format!(
                "`{other}://` is not a lake this build can reach; {FORMS} (S3-compatible \
                 stores such as MinIO or Ceph are `s3://` with `storage.s3.endpoint`)"
            )),
        }
    }

    /// Whether the lake is in an object store rather than a directory.
    pub fn is_object_store(&self) -> bool {
        !matches!(self, Self::Directory(_))
    }
}

impl std::fmt::Display for LakeLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Directory(dir) => write!(f, "{}", dir.display()),
            Self::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            Self::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

/// S3's rules for a bucket created today (the older, laxer names are not accepted here).
fn valid_bucket(name: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    (3..=63).contains(&name.len())
        && name.chars().all(|c| alnum(c) || c == '.' || c == '-')
        && name.starts_with(alnum)
        && name.ends_with(alnum)
        && !name.contains("..")
}

/// Where the collector reads GPUs from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CollectorSource {
    /// The host's GPUs through NVML (`libnvidia-ml.so`).
    #[default]
    Nvml,
    /// The simulated fleet of a `simulated` substrate.
    Simulated,
}

/// `[collector]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CollectorConfig {
    /// `nvml` or `simulated`.
    pub source: CollectorSource,
    /// Sampling interval, 1 s to 1 h.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub interval: Duration,
    /// Address of the Prometheus `/metrics` endpoint.
    pub metrics_listen: SocketAddr,
    /// Host name put in samples; the machine's host name when unset.
    pub host: Option<String>,
    /// Path of `libnvidia-ml.so`; the system's when unset.
    pub nvml_library: Option<PathBuf>,
    /// Slurm's `ClusterName` on a Slurm node: 1 to 40 ASCII letters, digits, `_`, `.` or `-`
    /// (written in lower case in lease ids, as Slurm does). A GPU process whose environment
    /// names no lease is then attributed to lease `slurm-<cluster>-<job id>` with the job id of
    /// its Slurm cgroup in `/proc/<pid>/cgroup`, which does not carry the cluster. That job id
    /// is an array task's own, not its array's: a process whose environment can be read is
    /// attributed through `SLURM_ARRAY_JOB_ID` / `SLURM_JOB_ID` instead, whatever this says.
    /// Unset: no cgroup lookup.
    pub slurm_cluster: Option<String>,
    /// The kubelet's PodResources socket on a Kubernetes node (its default is
    /// `/var/lib/kubelet/pod-resources/kubelet.sock`): GPUs are then attributed to the pods
    /// holding them, and to their leases. Unset: no pod lookup.
    pub kubelet_socket: Option<PathBuf>,
    /// The kubelet's pod log directory, whose `<namespace>_<pod>_<uid>` entries give the uid of
    /// a pod, and so its lease `k8s-<uid>`.
    pub pod_logs_dir: PathBuf,
    /// The kernel's directory of SMBIOS structures (`/sys/firmware/dmi/entries`). Inside a
    /// virtual machine gpuwarden's `libvirt` driver started, an OEM string
    /// `gpuwarden.lease_id=<id>` there names the machine's lease, which every GPU of the guest
    /// then works for unless a process or pod names another. Read once at start.
    pub dmi_entries_dir: PathBuf,
    /// Samples buffered while Kafka is unreachable, bytes, before the oldest are dropped.
    pub buffer_max_bytes: u64,
    /// Oldest buffered sample kept while Kafka is unreachable.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub buffer_max_age: Duration,
    /// `[collector.simulated]`: settings of the simulated source.
    pub simulated: SimulatedSourceConfig,
}

impl Default for CollectorConfig {
    fn default() -> Self {
        Self {
            source: CollectorSource::Nvml,
            interval: Duration::from_secs(5),
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9400)),
            host: None,
            nvml_library: None,
            slurm_cluster: None,
            kubelet_socket: None,
            pod_logs_dir: PathBuf::from("/var/log/pods"),
            dmi_entries_dir: PathBuf::from("/sys/firmware/dmi/entries"),
            buffer_max_bytes: 64 << 20,
            buffer_max_age: Duration::from_secs(15 * 60),
            simulated: SimulatedSourceConfig::default(),
        }
    }
}

/// `[collector.simulated]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SimulatedSourceConfig {
    /// The `simulated` substrate whose fleet to run; the only one when unset.
    pub substrate: Option<String>,
    /// Seed of every random choice, so a run can be repeated exactly.
    pub seed: u64,
    /// Event time per wall time (60 = one hour of fleet time per wall minute).
    pub speed: f64,
}

impl Default for SimulatedSourceConfig {
    fn default() -> Self {
        Self {
            substrate: None,
            seed: 42,
            speed: 1.0,
        }
    }
}

/// `[pipeline]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineConfig {
    /// Kafka consumer group of the pipeline instances.
    pub group_id: String,
    /// Rows buffered per table and hour before a Parquet file is written.
    pub flush_rows: usize,
    /// Longest a buffered row waits before its file is written.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub flush_age: Duration,
    /// Memory the ingest buffers may hold before consumption pauses: bytes, or `"512MiB"`.
    #[serde(deserialize_with = "size::required")]
    #[schemars(schema_with = "size::schema")]
    pub max_buffered_bytes: u64,
    /// How long after an hour ends its data may still arrive before it is final.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub lateness: Duration,
    /// How often the open hour's rollups are refreshed.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub rollup_every: Duration,
    /// Address of the pipeline's Prometheus `/metrics` endpoint.
    pub metrics_listen: SocketAddr,
    /// Address of the SQL endpoint (Postgres wire protocol).
    pub sql_listen: SocketAddr,
    /// Accept SQL connections without a password. Off unless set.
    pub sql_allow_anonymous: bool,
    /// `[[pipeline.sql_users]]`: who may connect to the SQL endpoint.
    pub sql_users: Vec<SqlUser>,
    /// `[pipeline.sql_limits]`: what one SQL query may take, and how many may run at once.
    pub sql_limits: SqlLimits,
    /// `[pipeline.sql_tls]`: TLS for the SQL endpoint. When set, clients must use it.
    pub sql_tls: Option<TlsConfig>,
    /// Serve the SQL endpoint over plain TCP on an address other than loopback. Passwords and
    /// query results then cross the network in the clear: off unless set.
    pub sql_insecure_plaintext: bool,
    /// How long Ctrl-C or SIGTERM leaves the process to stop (SQL queries are canceled at once;
    /// buffered rows are written and committed) before it exits anyway, with status 1. Whatever
    /// was not committed is read again from Kafka at the next start.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub shutdown_deadline: Duration,
    /// `[pipeline.signals]`: the hot window and how often signals are computed.
    pub signals: SignalsConfig,
    /// `[pipeline.clock]`: how far a record's time may stray from its arrival, and how the
    /// watermark treats a host that falls silent.
    pub clock: ClockBounds,
    /// `[pipeline.login_limits]`: failed SQL logins allowed before a source address or a user
    /// name is locked out.
    pub login_limits: LoginLimits,
    /// `[pipeline.compaction]`: how the files of a final hour are merged.
    pub compaction: CompactionConfig,
    /// `[pipeline.retention]`: how long raw tables are kept.
    pub retention: RetentionConfig,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            group_id: "gpuwarden-pipeline".into(),
            flush_rows: 200_000,
            flush_age: Duration::from_secs(60),
            max_buffered_bytes: 512 << 20,
            lateness: Duration::from_secs(10 * 60),
            rollup_every: Duration::from_secs(60),
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9401)),
            sql_listen: SocketAddr::from(([127, 0, 0, 1], 5433)),
            sql_allow_anonymous: false,
            sql_users: Vec::new(),
            sql_limits: SqlLimits::default(),
            sql_tls: None,
            sql_insecure_plaintext: false,
            shutdown_deadline: Duration::from_secs(30),
            signals: SignalsConfig::default(),
            clock: ClockBounds::default(),
            login_limits: LoginLimits::default(),
            compaction: CompactionConfig::default(),
            retention: RetentionConfig::default(),
        }
    }
}

/// `[[pipeline.sql_users]]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SqlUser {
    /// User name given by the client.
    pub name: String,
    /// Password; write `"${ENV_VAR}"` to keep it out of the file.
    pub password: String,
    /// This user's statement timeout; `sql_limits.statement_timeout` when unset.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub statement_timeout: Option<Duration>,
    /// Memory one of this user's queries may hold; `sql_limits.query_memory` when unset.
    #[serde(default, deserialize_with = "size::optional")]
    #[schemars(schema_with = "size::schema")]
    pub query_memory: Option<u64>,
    /// Queries this user may run at once; `sql_limits.max_queries_per_user` when unset.
    #[serde(default)]
    pub max_queries: Option<usize>,
}

/// `[pipeline.sql_limits]`: the limits of the SQL endpoint and of `gpuwarden sql`. Queries run on
/// threads of their own, at a lower CPU priority than ingest, rollups and signals, so that no
/// query can hold those back.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SqlLimits {
    /// Longest a query may run; past it the query is canceled with SQLSTATE 57014. `"0s"` for
    /// no limit. A client may ask for less with `SET statement_timeout`, never for more.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub statement_timeout: Duration,
    /// Memory one query may hold: bytes, or `"1GiB"`. Sorts, aggregations and joins that can
    /// spill to disk do so past it; a query that still needs more fails with SQLSTATE 53200.
    #[serde(deserialize_with = "size::required")]
    #[schemars(schema_with = "size::schema")]
    pub query_memory: u64,
    /// Queries one user may run at once (a `[[pipeline.sql_users]]` entry's `max_queries`
    /// overrides it).
    pub max_queries_per_user: usize,
    /// Queries all users together may run at once.
    pub max_queries: usize,
    /// How long a query waits for a free slot when a maximum is reached before it is refused
    /// with SQLSTATE 53300. `"0s"` refuses it at once.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub queue_timeout: Duration,
    /// Connections open at once; more are refused with SQLSTATE 53300.
    pub max_connections: usize,
    /// Threads that run queries; 0 for one per CPU.
    pub threads: usize,
}

impl Default for SqlLimits {
    fn default() -> Self {
        Self {
            statement_timeout: Duration::from_secs(5 * 60),
            query_memory: 1 << 30,
            max_queries_per_user: 8,
            max_queries: 16,
            queue_timeout: Duration::from_secs(30),
            max_connections: 100,
            threads: 0,
        }
    }
}

/// `[enforcer.login_limits]` and `[pipeline.login_limits]`: how many failed logins (a bearer
/// token that matches no `[[tokens]]` entry; a wrong SQL password) a source address and a
/// principal may make within `window` before they are locked out for one `window`
/// ([`crate::login_limit`]).
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LoginLimits {
    /// Failures of one principal (a SQL user name; for the API, one token presented) that lock
    /// it out, from every address.
    pub max_failures: u32,
    /// Failures from one source address (an IPv6 address's /64), whatever principals they
    /// tried, that lock the address out. Higher than `max_failures`: one address (a NAT, a
    /// Grafana server) carries many users.
    pub max_failures_per_source: u32,
    /// How long failures are counted, and how long a lockout lasts.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub window: Duration,
    /// Keys (addresses, principals) tracked per scope; past it, the counts that matter least
    /// are forgotten early, so that memory stays bounded under a spray of keys.
    pub tracked_keys: usize,
}

impl Default for LoginLimits {
    fn default() -> Self {
        Self {
            max_failures: 10,
            max_failures_per_source: 30,
            window: Duration::from_secs(5 * 60),
            tracked_keys: 65_536,
        }
    }
}

/// `[pipeline.compaction]`: once an hour is final (docs/src/contributors/lake.md#compaction), the files
/// of each raw table's hour are rewritten into as few files as `target_file_size` allows,
/// sorted for pruning.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CompactionConfig {
    /// Compact final hours. On unless set to false.
    pub enabled: bool,
    /// A compacted file is closed once it holds about this much: bytes, or `"256MiB"`.
    #[serde(deserialize_with = "size::required")]
    #[schemars(schema_with = "size::schema")]
    pub target_file_size: u64,
    /// Rows per Parquet row group of a compacted file.
    pub row_group_rows: usize,
    /// Memory the sort of one hour may hold before it spills to `<lake>/_compaction/tmp`.
    #[serde(deserialize_with = "size::required")]
    #[schemars(schema_with = "size::schema")]
    pub sort_memory: u64,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            target_file_size: 256 << 20,
            row_group_rows: 128 * 1024,
            sort_memory: 256 << 20,
        }
    }
}

/// `[pipeline.retention]`: how long each raw table's hours are kept after they end, by the
/// wall clock; `"forever"` keeps them. The rollups (`gpu_hourly`, `lease_hourly`,
/// `team_hourly`, `focus_costs`, `leases`) are always kept, and so are the lease events and
/// actions, which are the record of what was granted and done.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Raw samples; kept at least an hour longer than `pipeline.clock.max_age` whatever this
    /// says, so that a late sample never reopens an hour already deleted.
    #[serde(deserialize_with = "duration::or_forever")]
    #[schemars(schema_with = "duration::schema_or_forever")]
    pub samples: Option<Duration>,
    /// Signals as published.
    #[serde(deserialize_with = "duration::or_forever")]
    #[schemars(schema_with = "duration::schema_or_forever")]
    pub signals: Option<Duration>,
    /// Records that failed to decode or validate.
    #[serde(deserialize_with = "duration::or_forever")]
    #[schemars(schema_with = "duration::schema_or_forever")]
    pub quarantine: Option<Duration>,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            samples: Some(Duration::from_secs(90 * 86_400)),
            signals: Some(Duration::from_secs(30 * 86_400)),
            quarantine: Some(Duration::from_secs(30 * 86_400)),
        }
    }
}

/// `[pipeline.signals]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SignalsConfig {
    /// How often (event time) signals are computed and published.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub every: Duration,
    /// The hot window, kept in memory, that signals are computed over.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub window: Duration,
}

impl Default for SignalsConfig {
    fn default() -> Self {
        Self {
            every: Duration::from_secs(30),
            window: Duration::from_secs(15 * 60),
        }
    }
}

/// `[pipeline.clock]`: the bounds on event time that keep one host's wrong clock out of the
/// rollups and signals (docs/src/contributors/delivery.md#event-time).
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ClockBounds {
    /// How far a record's time may run ahead of its arrival (the Kafka message's timestamp, or
    /// the time `gpuwarden ingest` read it). A record further ahead is quarantined.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub max_skew: Duration,
    /// How far a sample's time may lag its arrival on Kafka before it is quarantined instead of
    /// reopening hours long final. `gpuwarden ingest`, for backfills, accepts any age.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub max_age: Duration,
    /// A host whose latest sample is this far behind the fleet's median host stops holding the
    /// watermark back.
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub idle_timeout: Duration,
}

impl Default for ClockBounds {
    fn default() -> Self {
        Self {
            max_skew: Duration::from_secs(5 * 60),
            max_age: Duration::from_secs(24 * 3600),
            idle_timeout: Duration::from_secs(5 * 60),
        }
    }
}

/// `[pricing]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PricingConfig {
    /// ISO 4217 currency of every price (FOCUS `BillingCurrency`).
    pub currency: String,
    /// A sample below this GPU utilization, percent, is idle (when utilization judges it).
    pub idle_util_pct: f64,
    /// Which measure says a GPU is idle: `util` (NVML's utilization, on every GPU) or
    /// `sm_active` (GPM's SM activity, which a spinning or deadlocked GPU does not fool; a GPU
    /// without GPM falls back to utilization). A workload may choose its own.
    pub idle_measure: IdleMeasure,
    /// A sample below this SM activity, percent, is idle (when SM activity judges it).
    pub idle_sm_active_pct: f64,
    /// Price of a GPU-hour for models no `[[pricing.gpu]]` entry matches.
    pub default_usd_per_gpu_hour: f64,
    /// Price of a kWh: energy cost is `energy_kwh` times this.
    pub energy_usd_per_kwh: f64,
    /// Grams of CO2-equivalent emitted per kWh, for the emissions columns; unset, they are null.
    pub co2e_g_per_kwh: Option<f64>,
    /// `[[pricing.gpu]]`: prices by model, first match wins.
    pub gpu: Vec<GpuPrice>,
    /// `[[pricing.mig]]`: a MIG profile's share of its parent GPU, where it should not be its
    /// compute slices over the parent's (1/7 for `1g.10gb` on an H100).
    pub mig: Vec<MigShare>,
    /// Who is billed in `focus_costs` (FOCUS `BillingAccountId` and `BillingAccountName`):
    /// usually the organization whose fleet this is.
    pub billing_account: String,
    /// Who charges the teams (FOCUS `InvoiceIssuerName`, `ProviderName`, `PublisherName`):
    /// usually the platform team that runs the fleet.
    pub provider: String,
}

impl Default for PricingConfig {
    fn default() -> Self {
        Self {
            currency: "USD".into(),
            idle_util_pct: 5.0,
            idle_measure: IdleMeasure::Util,
            idle_sm_active_pct: 5.0,
            default_usd_per_gpu_hour: 2.0,
            energy_usd_per_kwh: 0.0,
            co2e_g_per_kwh: None,
            gpu: Vec::new(),
            mig: Vec::new(),
            billing_account: "gpuwarden".into(),
            provider: "gpuwarden".into(),
        }
    }
}

impl PricingConfig {
    /// Price of one GPU-hour of `gpu_model`: the first `[[pricing.gpu]]` entry whose `match` is a
    /// case-insensitive substring of the model, else the default price.
    pub fn usd_per_gpu_hour(&self, gpu_model: &str) -> f64 {
        self.gpu
            .iter()
            .find(|p| contains_ignoring_case(gpu_model, &p.model_match))
            .map_or(self.default_usd_per_gpu_hour, |p| p.usd_per_gpu_hour)
    }

    /// The share of its parent GPU a sample's device is, in GPU-equivalents: for a MIG
    /// instance, the `[[pricing.mig]]` entry for its profile, else its compute slices over its
    /// parent's (so does the unsliced rest of a MIG GPU, which has slices but no profile); 1 for
    /// a whole GPU.
    pub fn gpu_share(
        &self,
        mig_profile: Option<&str>,
        slices: Option<u32>,
        parent_slices: Option<u32>,
    ) -> f64 {
        if let Some(entry) = mig_profile.and_then(|p| self.mig.iter().find(|m| m.profile == p)) {
            return entry.share;
        }
        match (slices, parent_slices) {
            (Some(s), Some(p)) if p > 0 => f64::from(s.min(p)) / f64::from(p),
            _ => 1.0,
        }
    }

    /// The idle threshold, percent, of `measure`.
    pub fn idle_threshold_pct(&self, measure: IdleMeasure) -> f64 {
        match measure {
            IdleMeasure::Util => self.idle_util_pct,
            IdleMeasure::SmActive => self.idle_sm_active_pct,
        }
    }

    /// Whether a sample is idle by `measure`, and the measure that judged it: SM activity where
    /// `measure` is `sm_active` and the sample has it, utilization otherwise.
    pub fn judge_idle(
        &self,
        measure: IdleMeasure,
        util_gpu_pct: f64,
        sm_active_pct: Option<f64>,
    ) -> (bool, IdleMeasure) {
        match (measure, sm_active_pct) {
            (IdleMeasure::SmActive, Some(sm)) => {
                (sm < self.idle_sm_active_pct, IdleMeasure::SmActive)
            }
            _ => (util_gpu_pct < self.idle_util_pct, IdleMeasure::Util),
        }
    }
}

/// Which measure of a GPU's work says it is idle (`pricing.idle_measure`, a workload's
/// `idle_measure`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    Deserialize,
    Serialize,
    JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum IdleMeasure {
    /// NVML's `utilization.gpu`: the share of time any kernel ran. Every GPU has it; one tiny
    /// kernel a second reads busy.
    #[default]
    Util,
    /// GPM's SM activity (`sm_active_pct`): how much of the SMs held work. GPUs without GPM are
    /// judged by utilization instead.
    SmActive,
}

impl IdleMeasure {
    /// The name used in the config and the rollups' `idle_measure` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Util => "util",
            Self::SmActive => "sm_active",
        }
    }
}

/// `[[pricing.mig]]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MigShare {
    /// The MIG profile, exactly as NVML names it, e.g. `1g.10gb`.
    pub profile: String,
    /// Its share of the parent GPU's price and of a GPU in quotas, 0 < share ≤ 1.
    pub share: f64,
}

/// Whether `pattern` occurs in `text` when both are lowercased, as model names are matched
/// everywhere (pricing, `allowed_models`, a request's `gpu_model`). ASCII text, which model
/// names are, is compared in place; anything else is lowercased first.
pub fn contains_ignoring_case(text: &str, pattern: &str) -> bool {
    if text.is_ascii() && pattern.is_ascii() {
        let (text, pattern) = (text.as_bytes(), pattern.as_bytes());
        return pattern.is_empty()
            || text
                .windows(pattern.len())
                .any(|w| w.eq_ignore_ascii_case(pattern));
    }
    text.to_lowercase().contains(&pattern.to_lowercase())
}

/// `[[pricing.gpu]]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GpuPrice {
    /// Case-insensitive substring of the NVML model name, e.g. `"H100"`.
    #[serde(rename = "match")]
    pub model_match: String,
    /// Price of one GPU-hour.
    pub usd_per_gpu_hour: f64,
}

/// `[[teams]]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamConfig {
    /// The team's name, as used in leases and reports.
    pub name: String,
    /// User names that belong to the team.
    #[serde(default)]
    pub members: Vec<String>,
    /// Most GPUs the team may hold at once.
    pub gpu_quota: u32,
    /// Most the team may spend in a calendar month (UTC).
    pub monthly_budget_usd: f64,
    /// Substrings of the GPU models the team may use; any model when empty.
    #[serde(default)]
    pub allowed_models: Vec<String>,
}

/// What to do with a lease idle for its `idle_timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnIdle {
    /// Tell its holder and its team's webhooks; change nothing.
    #[default]
    Alert,
    /// Take the GPUs back.
    Reclaim,
    /// Shrink the lease to `min_gpus`.
    Resize,
}

impl OnIdle {
    /// The name used in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Alert => "alert",
            Self::Reclaim => "reclaim",
            Self::Resize => "resize",
        }
    }
}

/// `[workloads.<training|inference|notebook|batch>]`.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct WorkloadPolicy {
    /// Most GPUs one lease may hold (also the autoscale ceiling).
    pub max_gpus: Option<u32>,
    /// Fewest GPUs a lease is resized or autoscaled down to.
    pub min_gpus: Option<u32>,
    /// Longest a lease may run, extensions included.
    #[serde(deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub max_duration: Option<Duration>,
    /// How long all of a lease's GPUs may stay idle before `on_idle`.
    #[serde(deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub idle_timeout: Option<Duration>,
    /// How long before the idle deadline the holder is warned.
    #[serde(deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub warn_before: Option<Duration>,
    /// `alert`, `reclaim` or `resize` (to `min_gpus`).
    pub on_idle: OnIdle,
    /// The measure that says this kind of work is idle; `pricing.idle_measure` when unset.
    pub idle_measure: Option<IdleMeasure>,
    /// Utilization that inference autoscaling steers toward, percent.
    pub target_util_pct: Option<f64>,
    /// Substrates to place this kind of work on, in order of preference.
    pub substrates: Vec<String>,
    /// Programs a lease's `command` may start (absolute paths, compared with its first word);
    /// any program when empty.
    pub programs: Vec<String>,
}

/// Whether the enforcer acts or only records what it would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EnforcerMode {
    /// Decide and act.
    #[default]
    Enforce,
    /// Record every action with outcome `dry_run`; change nothing.
    DryRun,
}

/// `[enforcer]`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct EnforcerConfig {
    /// Address of the admission API (and its `/metrics`).
    pub listen: SocketAddr,
    /// `enforce` or `dry_run`.
    pub mode: EnforcerMode,
    /// SQLite lease store; `<data_dir>/enforcer.db` when unset.
    pub database: Option<PathBuf>,
    /// URLs that receive alerts as Slack-compatible JSON.
    pub alert_webhooks: Vec<String>,
    /// Largest request body accepted, bytes.
    pub max_request_bytes: usize,
    /// `[enforcer.login_limits]`: bearer tokens that match nothing allowed before a source
    /// address (or a token) is answered 429.
    pub login_limits: LoginLimits,
    /// `[enforcer.tls]`: TLS for the admission API (and its `/metrics`).
    pub tls: Option<TlsConfig>,
    /// Serve the API over plain HTTP on an address other than loopback. Tokens then cross the
    /// network in the clear: off unless set.
    pub insecure_plaintext: bool,
    /// How long outbox rows are kept once Kafka has acknowledged them (the records themselves
    /// live on in the topics and the lake); `"forever"` keeps them. Rows of leases still open are
    /// kept whatever their age: the portal reads a lease's history from them.
    #[serde(deserialize_with = "duration::or_forever")]
    #[schemars(schema_with = "duration::schema_or_forever")]
    pub outbox_retention: Option<Duration>,
    /// `[enforcer.store]`: where the lease store lives, when not the SQLite file of `database`.
    pub store: StoreConfig,
    /// `[enforcer.leader]`: how the replicas sharing a PostgreSQL store elect the one that does
    /// the work that must happen once.
    pub leader: LeaderConfig,
}

/// `[enforcer.leader]`: the leader's lease, for replicas on one PostgreSQL store. The leader
/// renews its lease every third of `lease`; when it stops (killed, paused, cut off), another
/// replica takes over once the lease has run out, so `lease` bounds how long the runtime rules,
/// expiry, watchers and publishing pause. On SQLite the one enforcer always leads.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LeaderConfig {
    /// How long a leader's claim lasts without renewal (default 6 s; at least 1 s).
    #[serde(deserialize_with = "duration::required")]
    #[schemars(schema_with = "duration::schema")]
    pub lease: Duration,
    /// This replica's name, as `/metrics` and `/healthz` show the leader (default: the host's
    /// name and the process id; a Kubernetes pod's name is its host name).
    pub replica: Option<String>,
}

impl Default for LeaderConfig {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(6),
            replica: None,
        }
    }
}

/// `[enforcer.store]`: the lease store's database. Unset, it is the embedded SQLite file of
/// `enforcer.database` (one enforcer per file). A `postgres://` URL puts it in PostgreSQL, where
/// several enforcer replicas share it.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `sqlite:<path>` (or a plain path), or `postgres://user@host:port/dbname?options` as libpq
    /// reads it. A password is better kept in `password_file` than in the URL.
    pub url: Option<String>,
    /// A file holding the PostgreSQL user's password (its first line), read at start: a mounted
    /// secret, kept out of the config file.
    pub password_file: Option<PathBuf>,
}

/// Where the lease store lives, from `[enforcer.store]` and `enforcer.database`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// An SQLite file, owned by one enforcer.
    Sqlite(PathBuf),
    /// A PostgreSQL database, shared by every replica: the URL, and the password file.
    Postgres {
        url: String,
        password_file: Option<PathBuf>,
    },
}

impl StoreConfig {
    /// The scheme of a PostgreSQL URL (libpq accepts both).
    pub const POSTGRES_SCHEMES: [&'static str; 2] = ["postgres://", "postgresql://"];
}

impl Default for EnforcerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            mode: EnforcerMode::Enforce,
            database: None,
            alert_webhooks: Vec::new(),
            max_request_bytes: 64 << 10,
            login_limits: LoginLimits::default(),
            tls: None,
            insecure_plaintext: false,
            outbox_retention: Some(Duration::from_secs(7 * 86_400)),
            store: StoreConfig::default(),
            leader: LeaderConfig::default(),
        }
    }
}

/// `[enforcer.tls]` and `[pipeline.sql_tls]`: a listener's certificate, and whom it asks for one.
/// The certificate and key files are read again when they change (a renewal needs no restart).
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file of the server's certificate, then any intermediates.
    pub cert: PathBuf,
    /// PEM file of the certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM file of the CAs whose client certificates are accepted. No client certificate is
    /// asked for when unset.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: `required` (the default) refuses a client without a valid certificate;
    /// `optional` lets one without a certificate through (one it shows must still be valid).
    #[serde(default)]
    pub client_auth: Option<ClientAuth>,
}

/// Whether a client certificate is required (`[enforcer.tls].client_auth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ClientAuth {
    /// Every client shows a certificate signed by `client_ca`.
    Required,
    /// A client may show none; one it shows is checked against `client_ca`.
    Optional,
}

/// The listeners that serve TLS when configured to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// The admission API (`enforcer.listen`).
    Api,
    /// The SQL endpoint (`pipeline.sql_listen`).
    Sql,
}

impl Config {
    /// Why `listener` may not serve plain TCP on `listen` (its configured address, or one given on
    /// the command line), or none: it has TLS, `listen` is loopback (only this machine can reach
    /// it), or plain TCP was asked for by name. The config's own check and the binaries' checks of
    /// `--listen` share it.
    pub fn plaintext_refusal(&self, listener: Listener, listen: SocketAddr) -> Option<String> {
        let (e, p) = (&self.enforcer, &self.pipeline);
        let (tls, opt_in) = match listener {
            Listener::Api => (e.tls.is_some(), e.insecure_plaintext),
            Listener::Sql => (p.sql_tls.is_some(), p.sql_insecure_plaintext),
        };
        if tls || opt_in || listen.ip().is_loopback() {
            return None;
        }
        Some(match listener {
            Listener::Api => format!(
                "{listen} is not a loopback address, and the API would serve it over plain HTTP: \
                 configure [enforcer.tls] (cert, key), or set enforcer.insecure_plaintext = true \
                 to send tokens in the clear"
            ),
            Listener::Sql => format!(
                "{listen} is not a loopback address, and the SQL endpoint would serve it over \
                 plain TCP: configure [pipeline.sql_tls] (cert, key), or set \
                 pipeline.sql_insecure_plaintext = true to send passwords and results in the clear"
            ),
        })
    }
}

/// The substrate drivers this build knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DriverKind {
    /// The simulated fleet (`hosts`).
    Simulated,
    /// One bare-metal host (`gpu_model`, `gpu_uuids`, `grace_period`).
    Local,
    /// An external provisioner called over HTTP (`url`, `secret`, `timeout`, `retries`, `capacity`).
    Webhook,
    /// A Slurm cluster (`[substrates.slurm]`, and the local driver's `accounts` settings for
    /// the jobs gpuwarden submits itself).
    Slurm,
    /// A Kubernetes cluster (`[substrates.kubernetes]`): a validating admission webhook for GPU
    /// pods, and the cluster's nodes and pods through its API.
    Kubernetes,
    /// A libvirt host (`[substrates.libvirt]`): one virtual machine per lease with the lease's
    /// GPUs passed through to it.
    Libvirt,
}

impl DriverKind {
    /// The name used in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Simulated => "simulated",
            Self::Local => "local",
            Self::Webhook => "webhook",
            Self::Slurm => "slurm",
            Self::Kubernetes => "kubernetes",
            Self::Libvirt => "libvirt",
        }
    }
}

/// `[[substrates]]`. Which fields apply depends on `driver`; the others must be left out.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SubstrateConfig {
    /// The substrate's name, used in leases and `[workloads.*].substrates`.
    pub name: String,
    /// Which driver runs it.
    pub driver: DriverKind,
    /// simulated: the fleet, in groups of identical hosts.
    #[serde(default)]
    pub hosts: Vec<FleetHosts>,
    /// local: host name; the machine's when unset.
    pub host: Option<String>,
    /// local, webhook: full NVML model name of the GPUs.
    pub gpu_model: Option<String>,
    /// local: UUIDs of the GPUs leases may hold.
    #[serde(default)]
    pub gpu_uuids: Vec<String>,
    /// webhook: how many GPUs the provisioner can hand out.
    pub capacity: Option<u32>,
    /// local: time between SIGTERM and SIGKILL on reclaim.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub grace_period: Option<Duration>,
    /// webhook: URL that receives `{action, lease}`.
    pub url: Option<String>,
    /// webhook: HMAC-SHA256 key for the signature header; `${ENV}` to keep it out of the file.
    pub secret: Option<String>,
    /// webhook: time allowed per call.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub timeout: Option<Duration>,
    /// webhook: attempts after the first failure.
    pub retries: Option<u32>,
    /// local, slurm: the system account each gpuwarden user's commands (slurm: the jobs gpuwarden
    /// submits for it) run as (`user = "account"`).
    #[serde(default)]
    pub accounts: BTreeMap<String, String>,
    /// local: a user missing from `accounts` runs as the system account of the same name, if
    /// there is one.
    pub same_name_accounts: Option<bool>,
    /// local: the lowest uid a lease may run as; accounts below it (root, system services) are
    /// refused. Default 1000.
    pub min_uid: Option<u32>,
    /// local: where each lease gets a working directory of its own, `<work_dir>/<lease_id>`,
    /// owned by its account; `<state dir>/work` when unset. slurm: where the jobs gpuwarden
    /// submits start and write their output (a directory every node sees); the account's home
    /// when unset.
    pub work_dir: Option<PathBuf>,
    /// local: groups whose members are refused (as good as root); a default list when unset.
    pub denied_groups: Option<Vec<String>>,
    /// local, enforcer not root: leases may run as the enforcer's own account.
    pub run_as_enforcer: Option<bool>,
    /// slurm: the cluster and how its jobs map to teams, users, workloads and models.
    pub slurm: Option<SlurmSettings>,
    /// kubernetes: the API server, the admission webhook's listener, and how pods map to teams,
    /// users, workloads and models.
    pub kubernetes: Option<KubernetesSettings>,
    /// libvirt: the host's libvirt, the domain template, and the GPUs it may pass through.
    pub libvirt: Option<LibvirtSettings>,
}

/// `[substrates.libvirt]`: a libvirt host on which each lease is a virtual machine (a libvirt
/// domain) with the lease's GPUs passed through to it.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LibvirtSettings {
    /// The libvirt connection URI. Default `qemu:///system`.
    #[serde(default = "LibvirtSettings::default_uri")]
    pub uri: String,
    /// A libvirt domain XML file, the template of every lease's virtual machine. `{{name}}`
    /// (required, in `<name>`) becomes `gpuwarden-<lease id>`; `{{lease_id}}`, `{{team}}`,
    /// `{{user}}`, `{{project}}`, `{{workload}}`, `{{gpu_model}}` and `{{gpu_count}}` the lease's
    /// values (XML-escaped). The driver adds one `<hostdev>` per GPU, the lease in the domain's
    /// `<metadata>` and in its SMBIOS OEM strings (`gpuwarden.lease_id=<id>`).
    pub domain_template: PathBuf,
    /// PCI device id (`"0x2330"`) → full NVML model name, for the GPUs the host's node devices
    /// list. An NVIDIA GPU whose id is missing here (and from `gpus`) is left out, with a warning.
    #[serde(default)]
    pub models: BTreeMap<String, String>,
    /// GPUs named by hand: a host whose libvirt lists no node devices, a GPU whose model the
    /// node devices do not say, and vGPUs (mediated devices).
    #[serde(default)]
    pub gpus: Vec<LibvirtGpu>,
    /// Time a reclaimed VM gets between the shutdown request (ACPI) and its destruction
    /// (power off). Default 2 min.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub grace_period: Option<Duration>,
    /// Delete a reclaimed VM's disk volumes (those in a libvirt storage pool) after it is
    /// undefined. Default false: disks are kept.
    #[serde(default)]
    pub delete_disks: bool,
    /// How often the host's node devices are read for the inventory. Default 30 s.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub poll: Option<Duration>,
}

impl LibvirtSettings {
    fn default_uri() -> String {
        "qemu:///system".to_owned()
    }
}

/// `[[substrates.libvirt.gpus]]`: one GPU (`pci`) or vGPU (`mdev`) the libvirt driver may pass
/// through.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LibvirtGpu {
    /// PCI address of a GPU passed through whole (`0000:41:00.0`).
    pub pci: Option<String>,
    /// UUID of a mediated device (a vGPU) passed through as `type='mdev'`.
    pub mdev: Option<String>,
    /// Full NVML model name (as the guest's NVML reports it); for a GPU the host's libvirt
    /// lists, the model `models` gives its PCI device id when unset.
    pub model: Option<String>,
}

/// `[substrates.kubernetes]`: a Kubernetes cluster, and how its GPU pods map to gpuwarden's
/// names.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KubernetesSettings {
    /// The kubeconfig file that says how to reach the API server and as whom; the in-cluster
    /// service account (the pod's mounted token and CA) when unset.
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig's context to use; its current context when unset.
    pub context: Option<String>,
    /// Address of the validating admission webhook's HTTPS listener (the API server calls it;
    /// see `deploy/kubernetes/`).
    pub webhook_listen: SocketAddr,
    /// `[substrates.kubernetes.webhook_tls]`: the webhook's certificate and key (reread when
    /// the files change); with `client_ca`, only callers showing a certificate it signed (the
    /// API server's `--admission-control-config-file` client certificate) are answered.
    pub webhook_tls: TlsConfig,
    /// Namespace → team. A namespace missing here that is itself a team's name maps to that
    /// team; `"*"` maps every other namespace. A GPU pod in a namespace that maps to no team is
    /// denied.
    #[serde(default)]
    pub teams: BTreeMap<String, String>,
    /// The pod label (or annotation) naming its user; its creator (the review's
    /// `userInfo.username`) when the pod has none. Default `gpuwarden.io/user`.
    #[serde(default = "KubernetesSettings::default_user_label")]
    pub user_label: String,
    /// Kubernetes user name → gpuwarden user (`"oidc:ada@example.com" = "ada"`); a name missing
    /// here is used as it is.
    #[serde(default)]
    pub users: BTreeMap<String, String>,
    /// The pod label (or annotation) naming its workload, optionally with its project as
    /// `<workload>[:<project>]`. Default `gpuwarden.io/workload`.
    #[serde(default = "KubernetesSettings::default_workload_label")]
    pub workload_label: String,
    /// The pod label (or annotation) naming its project (wins over the workload label's).
    /// Default `gpuwarden.io/project`.
    #[serde(default = "KubernetesSettings::default_project_label")]
    pub project_label: String,
    /// The workload of a pod that names none. Default `inference`.
    #[serde(default = "KubernetesSettings::default_workload")]
    pub default_workload: Workload,
    /// The node label saying a node's GPU model, which a pod names in its `nodeSelector` (or a
    /// required node affinity) to ask for a model. Default `nvidia.com/gpu.product`, which
    /// NVIDIA's GPU feature discovery sets.
    #[serde(default = "KubernetesSettings::default_model_label")]
    pub model_label: String,
    /// Model label value → full NVML model name (`"NVIDIA-H100-80GB-HBM3" = "NVIDIA H100 80GB
    /// HBM3"`); a value missing here is read with its `-` as spaces.
    #[serde(default)]
    pub models: BTreeMap<String, String>,
    /// How often the cluster's nodes are read for the inventory. Default 10 s.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub poll: Option<Duration>,
    /// Time a reclaimed pod gets between SIGTERM and SIGKILL (its deletion's grace period).
    /// Default 30 s.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub grace_period: Option<Duration>,
    /// A Pod manifest (YAML or JSON) the driver creates for each lease admitted through the
    /// HTTP API on this substrate: in the namespace of the lease's team (the first of `teams`
    /// that maps to it, else the team's name), named `gpuwarden-<lease id>`, its first
    /// container given the lease's GPUs (and command), every container `GPUWARDEN_LEASE_ID`,
    /// the pod the model's node selector and the lease's labels. Unset: such admissions are
    /// refused (pods are then only created with kubectl and admitted by the webhook).
    pub pod_template: Option<PathBuf>,
    /// A Deployment manifest (YAML or JSON) the driver creates, instead of a pod, for each
    /// `inference` lease admitted through the HTTP API: named and labelled as the pods of
    /// `pod_template` are, its pod template treated the same way, with as many replicas as the
    /// lease's GPUs make at the GPUs its first container asks for (1 when it names none).
    /// Resizing the lease (the autoscale rule) scales it.
    pub deployment_template: Option<PathBuf>,
    /// How a reclaimed pod is ended: `delete` (default: the pod is deleted with
    /// `grace_period`) or `evict` (the Eviction API, which respects PodDisruptionBudgets; a
    /// budget that forbids it makes the reclaim fail and be retried).
    #[serde(default)]
    pub reclaim: KubernetesReclaim,
    /// `[substrates.kubernetes.kueue]`: gpuwarden as a Kueue admission check controller; off
    /// when absent.
    pub kueue: Option<KueueSettings>,
}

/// How the kubernetes driver ends a reclaimed pod (`[substrates.kubernetes].reclaim`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum KubernetesReclaim {
    /// Delete the pod with the grace period.
    #[default]
    Delete,
    /// Evict it through the Eviction API (PodDisruptionBudgets apply).
    Evict,
}

/// `[substrates.kubernetes.kueue]`: the Kueue `AdmissionCheck`s gpuwarden decides, and how often
/// it reads them and their Workloads. A Workload's team, user, workload and model are read as
/// the webhook reads a pod's, through the `[substrates.kubernetes]` settings above.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KueueSettings {
    /// The `spec.controllerName` of the AdmissionChecks gpuwarden answers for. Default
    /// `gpuwarden.io/budget`.
    #[serde(default = "KueueSettings::default_controller_name")]
    pub controller_name: String,
    /// The version of Kueue's API (`kueue.x-k8s.io`) spoken: `v1beta2` (Kueue 0.15 and later,
    /// the default) or `v1beta1` (older Kueue); the fields read and written are the same.
    #[serde(default = "KueueSettings::default_api_version")]
    pub api_version: String,
    /// How often the AdmissionChecks and Workloads are read. Default 5 s.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub poll: Option<Duration>,
}

impl KueueSettings {
    /// The Kueue API versions gpuwarden speaks.
    pub const API_VERSIONS: [&'static str; 2] = ["v1beta2", "v1beta1"];

    fn default_controller_name() -> String {
        "gpuwarden.io/budget".into()
    }
    fn default_api_version() -> String {
        "v1beta2".into()
    }
}

impl Default for KueueSettings {
    fn default() -> Self {
        Self {
            controller_name: Self::default_controller_name(),
            api_version: Self::default_api_version(),
            poll: None,
        }
    }
}

impl KubernetesSettings {
    fn default_user_label() -> String {
        "gpuwarden.io/user".into()
    }
    fn default_workload_label() -> String {
        "gpuwarden.io/workload".into()
    }
    fn default_project_label() -> String {
        "gpuwarden.io/project".into()
    }
    fn default_model_label() -> String {
        "nvidia.com/gpu.product".into()
    }
    fn default_workload() -> Workload {
        Workload::Inference
    }

    /// The NVML model name of a model label value.
    pub fn model_of(&self, label: &str) -> String {
        match self.models.get(label) {
            Some(model) => model.clone(),
            None => label.replace('-', " "),
        }
    }

    /// The model label value of an NVML model name: the inverse of [`Self::model_of`].
    pub fn label_of(&self, model: &str) -> String {
        match self.models.iter().find(|(_, m)| *m == model) {
            Some((label, _)) => label.clone(),
            None => model.replace(' ', "-"),
        }
    }

    /// The namespace of a team's pods: the first namespace `teams` maps to it, else its name.
    pub fn namespace_of(&self, team: &str) -> String {
        self.teams
            .iter()
            .find(|(namespace, t)| *t == team && namespace.as_str() != "*")
            .map_or_else(|| team.to_owned(), |(namespace, _)| namespace.clone())
    }
}

/// `[substrates.slurm]`: a Slurm cluster, and how its jobs' names map to gpuwarden's.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SlurmSettings {
    /// Slurm's `ClusterName`: lease ids of its jobs are `slurm-<cluster>-<job id>`.
    pub cluster: String,
    /// The `slurm.conf` the Slurm commands read (`SLURM_CONF`); Slurm's default when unset.
    pub slurm_conf: Option<PathBuf>,
    /// Directory of `sbatch`, `squeue`, `sinfo`, `scancel` and `scontrol`; `/usr/bin` when unset.
    pub bin_dir: Option<PathBuf>,
    /// Which of a job's names says its team: `account` (default) or `partition`.
    #[serde(default)]
    pub team_from: SlurmTeamFrom,
    /// Slurm account (or partition) → team. A name missing here that is itself a team's name
    /// maps to that team; `"*"` maps every other name.
    #[serde(default)]
    pub teams: BTreeMap<String, String>,
    /// Which of a job's fields says its workload and project, as `<workload>[:<project>]`:
    /// `wckey` (default), `comment` or `job_name`.
    #[serde(default)]
    pub workload_from: SlurmWorkloadFrom,
    /// The workload of a job whose field names none. Default `batch`.
    #[serde(default = "SlurmSettings::default_workload")]
    pub default_workload: Workload,
    /// GRES type → full NVML model name (`h100 = "NVIDIA H100 80GB HBM3"`); a type missing here
    /// is matched as a case-insensitive part of the model name.
    #[serde(default)]
    pub models: BTreeMap<String, String>,
    /// How often the cluster's jobs and nodes are read. Default 2 s.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub poll: Option<Duration>,
    /// Jobs that bypassed the submit hook (submitted before gpuwarden, or by root) become leases
    /// when their team maps (default true); otherwise they are only reported as unattributed.
    pub adopt: Option<bool>,
    /// How long an admission waits for its job to appear in the queue before its GPUs are
    /// given back (Slurm refused the job after the hook admitted it). Default 1 min.
    #[serde(default, deserialize_with = "duration::optional")]
    #[schemars(schema_with = "duration::schema")]
    pub hold_timeout: Option<Duration>,
}

impl SlurmSettings {
    fn default_workload() -> Workload {
        Workload::Batch
    }
}

/// Which Slurm name says a job's team.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SlurmTeamFrom {
    /// `--account`.
    #[default]
    Account,
    /// `--partition` (the default partition when the job names none).
    Partition,
}

/// Which Slurm field says a job's workload and project.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SlurmWorkloadFrom {
    /// `--wckey`.
    #[default]
    Wckey,
    /// `--comment`.
    Comment,
    /// `--job-name`.
    JobName,
}

/// A group of identical simulated hosts: `count` hosts named `<prefix>-<n>`, each with `gpus`
/// GPUs of `gpu_model`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FleetHosts {
    /// Host name prefix.
    pub prefix: String,
    /// Number of hosts.
    pub count: u32,
    /// GPUs per host.
    pub gpus: u32,
    /// Full NVML model name, e.g. `"NVIDIA H100 80GB HBM3"`.
    pub gpu_model: String,
}

/// What a principal may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything, for every team.
    Admin,
    /// Acts for itself in its teams.
    Member,
    /// A front-end acting for named users of its teams.
    Service,
    /// Reads only.
    Viewer,
}

/// `[[tokens]]`: an API principal. The token itself is never stored, only its SHA-256.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// The principal's name (a user for `member`, a front-end for `service`).
    pub name: String,
    /// Lowercase hex SHA-256 of the bearer token.
    pub sha256: String,
    /// What the principal may do.
    pub role: Role,
    /// Teams the principal acts for (not needed for `admin`).
    #[serde(default)]
    pub teams: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contains_ignoring_case_is_lowercased_contains() {
        for (text, pattern) in [
            ("NVIDIA H100 80GB HBM3", "h100"),
            ("NVIDIA H100 80GB HBM3", "80gb hbm3"),
            ("NVIDIA H100 80GB HBM3", "A100"),
            ("NVIDIA H100 80GB HBM3", ""),
            ("", "h100"),
            ("h1", "H100"),
            ("NVIDIA L40S", "nvidia l40s"),
            ("GPU Ä100", "ä100"),
            ("GPU Ä100", "Ä1000"),
        ] {
            assert_eq!(
                contains_ignoring_case(text, pattern),
                text.to_lowercase().contains(&pattern.to_lowercase()),
                "{text:?} / {pattern:?}"
            );
        }
    }

    #[test]
    fn price_is_first_case_insensitive_substring_match_else_default() {
        let pricing = PricingConfig {
            default_usd_per_gpu_hour: 1.5,
            gpu: vec![
                GpuPrice {
                    model_match: "h100".into(),
                    usd_per_gpu_hour: 4.0,
                },
                GpuPrice {
                    model_match: "H100 80GB".into(),
                    usd_per_gpu_hour: 9.0,
                },
                GpuPrice {
                    model_match: "A100".into(),
                    usd_per_gpu_hour: 2.5,
                },
            ],
            ..PricingConfig::default()
        };
        assert_eq!(pricing.usd_per_gpu_hour("NVIDIA H100 80GB HBM3"), 4.0);
        assert_eq!(pricing.usd_per_gpu_hour("NVIDIA A100-SXM4-40GB"), 2.5);
        assert_eq!(pricing.usd_per_gpu_hour("Tesla T4"), 1.5);
    }
}
