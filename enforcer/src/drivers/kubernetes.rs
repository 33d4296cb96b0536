//! The `kubernetes` driver: a Kubernetes cluster through its API server (kube 5, k8s-openapi
//! 0.29 with the API of Kubernetes 1.33; API servers 1.33 to 1.37 serve these objects
//! unchanged).
//!
//! The cluster runs GPU pods that people create themselves; gpuwarden admits them in the
//! validating admission webhook (the enforcer's `kubernetes` module), which records each admitted pod as lease
//! `k8s-<pod uid>` with the pod's namespace, name and uid in its labels (`k8s_namespace`,
//! `k8s_pod`, `k8s_pod_uid`): that is where the driver finds the pod to reclaim, on any replica.
//! A pod or Deployment the driver creates itself is written down on its lease
//! ([`KubernetesDriver::track`], the lease's `substrate_ref` in the lease store), where every
//! replica's driver and webhook find it.
//!
//! - Inventory: the nodes' allocatable `nvidia.com/gpu` (and `nvidia.com/mig-<profile>`, as
//!   model `<model> MIG <profile>`), by the node label `model_label` (`nvidia.com/gpu.product`,
//!   set by NVIDIA's GPU feature discovery) read through `models`; cordoned nodes and nodes
//!   without the label are left out. Pooled capacity with [`Inventory::queues`] set: the
//!   scheduler keeps a pod pending until a node has room, so a request is bounded by the
//!   cluster's size, not by what is free now. Read at most once per `poll` (default 10 s).
//! - Reclaim: deletes the pod with the configured grace period and its uid as a precondition
//!   (a newer pod of the same name is never touched); a pod already gone is success.
//! - Status: the pod's phase: `Pending`/`Running` are running, `Succeeded` exited 0, `Failed`
//!   exited; a missing pod, or one of the same name with another uid, is gone.
//! - Provision (a lease admitted through the HTTP API): creates a pod from `pod_template` in the
//!   team's namespace ([`KubernetesSettings::namespace_of`]), named `gpuwarden-<lease id>`,
//!   labelled `gpuwarden.io/lease=<lease id>` (and team, user, workload), its first container
//!   given the lease's GPUs (`nvidia.com/gpu`, or the MIG resource of a `<model> MIG
//!   <profile>` lease) and command, every container `GPUWARDEN_LEASE_ID`, a node selector on the
//!   model, and `activeDeadlineSeconds` from the lease's time limit. The pod is tracked before it
//!   is created, so that the webhook, asked about it, recognizes it as the lease's own pod rather
//!   than a new admission. A pod already there under that name and label is the lease's
//!   (provisioning twice creates nothing). Without `pod_template`, provisioning is refused.
//! - Resize: a pod's GPUs cannot change, [`DriverError::Rejected`], and a resize is denied
//!   `resize_unsupported` before it gets here.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuwarden_schema::config::{KubernetesReclaim, KubernetesSettings, SubstrateConfig};
use gpuwarden_schema::ReleaseReason;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, Preconditions};
use kube::{Api, Client};
use serde::{Deserialize, Serialize};

use super::{
    check_lease_id, config_error, state_dir, Driver, DriverContext, DriverError, Inventory,
    LeaseSpec, LeaseStatus,
};

/// The resource NVIDIA's device plugin advertises for whole GPUs.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// The prefix of the resources it advertises for MIG devices (`nvidia.com/mig-1g.10gb`).
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";
/// How often the nodes are read when `poll` is not set.
pub const DEFAULT_POLL: Duration = Duration::from_secs(10);
/// A reclaimed pod's grace period when `grace_period` is not set.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(30);
/// The label of a pod the driver created, naming its lease.
pub const LEASE_LABEL: &str = "gpuwarden.io/lease";
/// The environment variable naming a lease to the work (and to the collector).
pub const LEASE_ENV: &str = "GPUWARDEN_LEASE_ID";

/// Where a lease's pod (or Deployment) is, as the driver writes it on the lease
/// (`substrate_ref`, JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    /// The pod's namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its uid: a pod recreated under the same name is another pod. Unknown for a moment
    /// while the driver creates the pod.
    #[serde(default)]
    pub uid: Option<String>,
    /// The GPUs (or MIG devices) it holds.
    #[serde(default)]
    pub gpus: Option<u32>,
    /// `namespace`/`name` is a Deployment the driver created for an inference lease, whose
    /// pods (labelled with the lease) hold the lease's GPUs, not a pod.
    #[serde(default)]
    pub deployment: bool,
}

/// What an enforcer before the pods moved into the lease store kept in
/// `<state_dir>/pods.jsonl`: one line per change, `{"lease": <id>, "pod": <PodRef or null>}`
/// (see [`KubernetesDriver::import_journal`]).
#[derive(Serialize, Deserialize)]
struct JournalLine {
    lease: String,
    pod: Option<PodRef>,
}

/// A Kubernetes cluster's driver.
pub struct KubernetesDriver {
    name: String,
    settings: KubernetesSettings,
    /// Where each lease's pod is written down: on the lease, in the lease store, through the
    /// service.
    lease_refs: Arc<dyn super::LeaseRefs>,
    /// `<state_dir>/pods.jsonl`, an earlier version's record of the pods, read once by
    /// [`KubernetesDriver::import_journal`].
    journal: PathBuf,
    client: tokio::sync::OnceCell<Client>,
    /// `pod_template`, read when the driver is built.
    template: Option<Pod>,
    /// `deployment_template`, read when the driver is built.
    deployment_template: Option<Deployment>,
    /// The inventory and when it was read.
    kept: Mutex<Option<(Instant, Arc<Inventory>)>>,
    /// One reader of the nodes at a time.
    reading: tokio::sync::Mutex<()>,
    /// The pod watcher has listed every pod once (see [`KubernetesDriver::pods_listed`]).
    pods_listed: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for KubernetesDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesDriver")
            .field("name", &self.name)
            .field("kubeconfig", &self.settings.kubeconfig)
            .finish_non_exhaustive()
    }
}

impl KubernetesDriver {
    /// A driver for `[substrates.kubernetes]` of `config`. The API server is first reached
    /// when something is asked of it.
    pub fn new(config: &SubstrateConfig, context: &DriverContext) -> Result<Self, DriverError> {
        let settings = config
            .kubernetes
            .clone()
            .ok_or_else(|| config_error(config, "kubernetes", "the kubernetes driver needs it"))?;
        if let Some(path) = &settings.kubeconfig {
            if !path.is_file() {
                return Err(config_error(
                    config,
                    "kubernetes.kubeconfig",
                    format!("{} is not a file", path.display()),
                ));
            }
        }
        let template = match &settings.pod_template {
            None => None,
            Some(path) => Some(read_template(path).map_err(|why| {
                config_error(
                    config,
                    "kubernetes.pod_template",
                    format!("{}: {why}", path.display()),
                )
            })?),
        };
        let deployment_template = match &settings.deployment_template {
            None => None,
            Some(path) => Some(read_deployment(path).map_err(|why| {
                config_error(
                    config,
                    "kubernetes.deployment_template",
                    format!("{}: {why}", path.display()),
                )
            })?),
        };
        let lease_refs = context.lease_refs.clone().ok_or_else(|| {
            config_error(
                config,
                "driver",
                "the kubernetes driver writes each lease's pod down in the lease store, and was \
                 built without one",
            )
        })?;
        let journal = state_dir(config, context)?.join("pods.jsonl");
        Ok(Self {
            name: config.name.clone(),
            settings,
            lease_refs,
            journal,
            client: tokio::sync::OnceCell::new(),
            template,
            deployment_template,
            kept: Mutex::new(None),
            reading: tokio::sync::Mutex::new(()),
            pods_listed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Told by the pod watcher once it has listed every pod and followed them into their
    /// leases: from then on the leases the policy counts are the cluster's, and they stay
    /// followed (the watcher lists again after a failure) whatever happens to the API server.
    pub fn pods_listed(&self) {
        self.pods_listed
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// The substrate's settings.
    pub fn settings(&self) -> &KubernetesSettings {
        &self.settings
    }

    /// The API client, built on first use from the kubeconfig (or the in-cluster account).
    pub async fn client(&self) -> Result<Client, DriverError> {
        self.client
            .get_or_try_init(|| async {
                let config = match &self.settings.kubeconfig {
                    Some(path) => {
                        let kubeconfig =
                            kube::config::Kubeconfig::read_from(path).map_err(|e| {
                                self.unavailable(format!("reading {}: {e}", path.display()))
                            })?;
                        let options = kube::config::KubeConfigOptions {
                            context: self.settings.context.clone(),
                            ..Default::default()
                        };
                        kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                            .await
                            .map_err(|e| {
                                self.unavailable(format!("kubeconfig {}: {e}", path.display()))
                            })?
                    }
                    None => kube::Config::incluster().map_err(|e| {
                        self.unavailable(format!(
                            "no kubeconfig is set and this is not a pod with a service account: {e}"
                        ))
                    })?,
                };
                // kube retries 429, 503 and 504 for up to 15 attempts with pauses growing to
                // minutes; a reclaim that a PodDisruptionBudget holds back, or an admission
                // reading the nodes, would wait that long. gpuwarden retries on its own terms
                // (the rules retry reclaims, the watchers back off), so the call answers now.
                let mut config = config;
                config.default_retry = false;
                // kube's client builds its TLS with the process's default provider.
                gpuwarden_schema::tls::install_default_provider();
                Client::try_from(config)
                    .map_err(|e| self.unavailable(format!("building the API client: {e}")))
            })
            .await
            .cloned()
    }

    /// Writes down on open lease `lease_id` where its pod (or Deployment) is, once that is
    /// committed: from then on every replica's driver and webhook know it.
    pub async fn track(&self, lease_id: &str, pod: &PodRef) -> Result<(), DriverError> {
        check_lease_id(&self.name, lease_id)?;
        let written = serde_json::to_string(pod).expect("a PodRef serializes");
        match self.lease_refs.set(lease_id, Some(written)).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(DriverError::Rejected {
                substrate: self.name.clone(),
                message: format!("lease {lease_id} is not open, so its pod is not recorded"),
            }),
            Err(e) => Err(self.unavailable(format!("recording the pod of {lease_id}: {e}"))),
        }
    }

    /// Forgets lease `lease_id`'s pod (it was reclaimed, or ended).
    pub async fn untrack(&self, lease_id: &str) {
        if let Err(e) = self.lease_refs.set(lease_id, None).await {
            tracing::warn!(substrate = %self.name, lease = lease_id, error = %e, "recording a forgotten pod failed");
        }
    }

    /// Where lease `lease_id`'s pod is, from this replica's memory of the lease store (see
    /// [`pod_of`]); None when the lease is not open.
    pub fn tracked(&self, lease_id: &str) -> Option<PodRef> {
        let lease = self.lease_refs.open_lease(lease_id)?;
        self.pod_of(&lease)
    }

    /// Where open lease `lease`'s pod is: the one written down on it, else the one the webhook
    /// admitted as it (its labels).
    pub fn pod_of(&self, lease: &crate::store::Lease) -> Option<PodRef> {
        pod_of(&self.name, lease)
    }

    /// Reads the pods an earlier version kept in `<state_dir>/pods.jsonl` into the lease store
    /// (each open lease's latest line; a line cut short by a crash is skipped), then renames the
    /// file `pods.jsonl.imported`. How many were written down; 0 without the file.
    pub async fn import_journal(&self) -> Result<usize, DriverError> {
        let text = match std::fs::read_to_string(&self.journal) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => {
                return Err(self.unavailable(format!("reading {}: {e}", self.journal.display())))
            }
        };
        let mut pods: BTreeMap<String, PodRef> = BTreeMap::new();
        for (n, line) in text.lines().enumerate() {
            match serde_json::from_str::<JournalLine>(line) {
                Ok(JournalLine {
                    lease,
                    pod: Some(pod),
                }) => {
                    pods.insert(lease, pod);
                }
                Ok(JournalLine { lease, pod: None }) => {
                    pods.remove(&lease);
                }
                Err(e) => {
                    tracing::warn!(file = %self.journal.display(), line = n + 1, error = %e, "skipping an unreadable line of the pod journal")
                }
            }
        }
        let mut imported = 0;
        for (lease, pod) in &pods {
            match self.track(lease, pod).await {
                Ok(()) => imported += 1,
                // Ended since: nothing of it to reclaim.
                Err(DriverError::Rejected { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let done = self.journal.with_extension("jsonl.imported");
        std::fs::rename(&self.journal, &done).map_err(|e| {
            self.unavailable(format!(
                "renaming {} to {}: {e}",
                self.journal.display(),
                done.display()
            ))
        })?;
        tracing::info!(substrate = %self.name, imported, file = %done.display(), "the pods of the pod journal are now written down in the lease store");
        Ok(imported)
    }

    fn unavailable(&self, message: impl Into<String>) -> DriverError {
        DriverError::Unavailable {
            substrate: self.name.clone(),
            message: message.into(),
        }
    }

    fn kept(&self) -> Option<(Instant, Arc<Inventory>)> {
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Creates `object`, lease `lease`'s pod or (`deployment`) Deployment, tracked before it is
    /// created (the webhook is asked about a pod before `create` returns) and again with its
    /// uid after. One already there under that name is the lease's when it carries the lease's
    /// label (an earlier call's), else the call is refused; a request the API server refuses
    /// (4xx but 429) is refused too, and the object forgotten.
    async fn create_tracked<K>(
        &self,
        lease: &LeaseSpec,
        object: &K,
        deployment: bool,
    ) -> Result<(), DriverError>
    where
        K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + std::fmt::Debug
            + Serialize
            + serde::de::DeserializeOwned,
    {
        let kind = if deployment { "deployment" } else { "pod" };
        let namespace = object.meta().namespace.clone().unwrap_or_default();
        let name = object.meta().name.clone().unwrap_or_default();
        let mut tracked = PodRef {
            namespace: namespace.clone(),
            name: name.clone(),
            uid: None,
            gpus: Some(lease.gpu_count),
            deployment,
        };
        self.track(&lease.lease_id, &tracked).await?;
        let api: Api<K> = Api::namespaced(self.client().await?, &namespace);
        let created = match api.create(&kube::api::PostParams::default(), object).await {
            Ok(created) => created,
            Err(kube::Error::Api(status)) if status.code == 409 => {
                // There already: the lease's own from an earlier call, or someone else's.
                match api.get_opt(&name).await {
                    Ok(Some(existing))
                        if existing
                            .meta()
                            .labels
                            .as_ref()
                            .and_then(|l| l.get(LEASE_LABEL))
                            == Some(&lease.lease_id) =>
                    {
                        existing
                    }
                    Ok(_) => {
                        return Err(DriverError::Rejected {
                            substrate: self.name.clone(),
                            message: format!(
                                "{kind} {namespace}/{name} exists and is not lease {}'s",
                                lease.lease_id
                            ),
                        })
                    }
                    Err(e) => {
                        return Err(
                            self.unavailable(format!("reading {kind} {namespace}/{name}: {e}"))
                        )
                    }
                }
            }
            Err(kube::Error::Api(status))
                if (400..500).contains(&status.code) && status.code != 429 =>
            {
                self.untrack(&lease.lease_id).await;
                return Err(DriverError::Rejected {
                    substrate: self.name.clone(),
                    message: format!("creating {kind} {namespace}/{name}: {}", status.message),
                });
            }
            Err(e) => {
                return Err(self.unavailable(format!("creating {kind} {namespace}/{name}: {e}")))
            }
        };
        tracked.uid = created.meta().uid.clone();
        self.track(&lease.lease_id, &tracked).await?;
        tracing::info!(substrate = %self.name, lease = %lease.lease_id, namespace = %namespace, name = %name, kind, "created");
        Ok(())
    }

    /// Deletes the Deployment of a lease (its pods go with it, each with its own grace period).
    async fn delete_deployment(
        &self,
        lease_id: &str,
        tracked: &PodRef,
        grace: Duration,
        reason: ReleaseReason,
    ) -> Result<(), DriverError> {
        let params = DeleteParams {
            grace_period_seconds: Some(u32::try_from(grace.as_secs()).unwrap_or(u32::MAX)),
            preconditions: tracked.uid.clone().map(|uid| Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        let deployments: Api<Deployment> =
            Api::namespaced(self.client().await?, &tracked.namespace);
        match deployments.delete(&tracked.name, &params).await {
            Ok(_) => {
                tracing::info!(substrate = %self.name, lease = lease_id, namespace = %tracked.namespace, deployment = %tracked.name, reason = reason.as_str(), "deployment deleted");
                self.untrack(lease_id).await;
                Ok(())
            }
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                self.untrack(lease_id).await;
                Ok(())
            }
            Err(e) => Err(self.unavailable(format!(
                "deleting deployment {}/{}: {e}",
                tracked.namespace, tracked.name
            ))),
        }
    }

    /// The GPU models the cluster has, from the inventory last read (empty before the first).
    pub fn models(&self) -> Vec<String> {
        self.kept()
            .map(|(_, inv)| inv.pooled.iter().map(|(m, _)| m.clone()).collect())
            .unwrap_or_default()
    }
}

/// Reads a Pod manifest (YAML or JSON) that has at least one container.
fn read_template(path: &std::path::Path) -> Result<Pod, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let pod: Pod = serde_saphyr::from_str(&text).map_err(|e| format!("not a Pod manifest: {e}"))?;
    let containers = pod.spec.as_ref().map_or(0, |s| s.containers.len());
    if containers == 0 {
        return Err("the pod has no containers".into());
    }
    Ok(pod)
}

/// Reads a Deployment manifest (YAML or JSON) whose pod template has at least one container.
fn read_deployment(path: &std::path::Path) -> Result<Deployment, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let deployment: Deployment =
        serde_saphyr::from_str(&text).map_err(|e| format!("not a Deployment manifest: {e}"))?;
    let containers = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map_or(0, |s| s.containers.len());
    if containers == 0 {
        return Err("its pod template has no containers".into());
    }
    Ok(deployment)
}

/// The GPUs one replica of `deployment` asks for: its first container's GPU limit, else 1.
pub fn gpus_per_replica(deployment: &Deployment) -> u32 {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers.first())
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| {
            l.iter()
                .find(|(k, _)| *k == GPU_RESOURCE || k.starts_with(MIG_RESOURCE_PREFIX))
        })
        .and_then(|(_, q)| whole_quantity(&q.0))
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| *n > 0)
        .unwrap_or(1)
}

/// The Deployment the driver creates for an inference `lease` from `template`: its pod template
/// made as [`lease_pod`] makes a pod (each replica holding [`gpus_per_replica`] GPUs), selected
/// by the lease label, with the lease's GPUs / that many replicas.
pub fn lease_deployment(
    template: &Deployment,
    lease: &LeaseSpec,
    settings: &KubernetesSettings,
) -> Result<Deployment, String> {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    let per = gpus_per_replica(template);
    if !lease.gpu_count.is_multiple_of(per) {
        return Err(format!(
            "{} GPUs are not a whole number of replicas of {per} GPUs each",
            lease.gpu_count
        ));
    }
    let mut deployment = template.clone();
    let spec = deployment.spec.get_or_insert_with(Default::default);
    let pod = Pod {
        metadata: spec.template.metadata.clone().unwrap_or_default(),
        spec: spec.template.spec.clone(),
        status: None,
    };
    let per_replica = LeaseSpec {
        gpu_count: per,
        ..lease.clone()
    };
    let mut made = lease_pod(&pod, &per_replica, settings);
    // The pods of a Deployment are named by it.
    made.metadata.name = None;
    made.metadata.namespace = None;
    spec.template.metadata = Some(made.metadata.clone());
    spec.template.spec = made.spec;
    spec.replicas = Some(i32::try_from(lease.gpu_count / per).unwrap_or(i32::MAX));
    spec.selector = LabelSelector {
        match_labels: Some(std::collections::BTreeMap::from([(
            LEASE_LABEL.to_owned(),
            lease.lease_id.clone(),
        )])),
        match_expressions: None,
    };
    deployment.metadata.name = Some(pod_name(&lease.lease_id));
    deployment.metadata.generate_name = None;
    deployment.metadata.namespace = Some(settings.namespace_of(&lease.team));
    deployment.metadata.labels = made.metadata.labels;
    Ok(deployment)
}

/// The pod the driver creates for `lease` from `template` (see the module's documentation).
pub fn lease_pod(template: &Pod, lease: &LeaseSpec, settings: &KubernetesSettings) -> Pod {
    use k8s_openapi::api::core::v1::EnvVar;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let mut pod = template.clone();
    pod.metadata.name = Some(pod_name(&lease.lease_id));
    pod.metadata.generate_name = None;
    pod.metadata.namespace = Some(settings.namespace_of(&lease.team));
    let labels = pod.metadata.labels.get_or_insert_with(Default::default);
    labels.insert(LEASE_LABEL.into(), lease.lease_id.clone());
    labels.insert("gpuwarden.io/team".into(), lease.team.clone());
    labels.insert(settings.user_label.clone(), lease.user.clone());
    labels.insert(
        settings.workload_label.clone(),
        lease.workload.as_str().into(),
    );
    let (base, mig) = match lease.gpu_model.split_once(" MIG ") {
        Some((base, profile)) => (base, Some(profile)),
        None => (lease.gpu_model.as_str(), None),
    };
    let resource = match mig {
        Some(profile) => format!("{MIG_RESOURCE_PREFIX}{profile}"),
        None => GPU_RESOURCE.to_owned(),
    };
    let spec = pod.spec.get_or_insert_with(Default::default);
    spec.node_selector
        .get_or_insert_with(Default::default)
        .insert(settings.model_label.clone(), settings.label_of(base));
    if let Some(limit) = lease.time_limit {
        spec.active_deadline_seconds =
            Some(i64::try_from(limit.as_secs().max(1)).unwrap_or(i64::MAX));
    }
    for (i, container) in spec.containers.iter_mut().enumerate() {
        let env = container.env.get_or_insert_with(Vec::new);
        env.retain(|e| e.name != LEASE_ENV);
        env.push(EnvVar {
            name: LEASE_ENV.into(),
            value: Some(lease.lease_id.clone()),
            value_from: None,
        });
        if i == 0 {
            let resources = container.resources.get_or_insert_with(Default::default);
            let count = Quantity(lease.gpu_count.to_string());
            resources
                .limits
                .get_or_insert_with(Default::default)
                .insert(resource.clone(), count.clone());
            if let Some(requests) = &mut resources.requests {
                requests.insert(resource.clone(), count);
            }
            if let Some(command) = &lease.command {
                container.command = Some(command.clone());
                container.args = None;
            }
        }
    }
    pod
}

/// The name of lease `lease_id`'s pod.
pub fn pod_name(lease_id: &str) -> String {
    format!("gpuwarden-{}", lease_id.to_ascii_lowercase())
}

/// Allocatable GPUs of `nodes` by model, as [`KubernetesDriver`]'s inventory counts them.
pub fn pooled_gpus(nodes: &[Node], settings: &KubernetesSettings) -> Vec<(String, u32)> {
    let mut pooled: BTreeMap<String, u32> = BTreeMap::new();
    for node in nodes {
        if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
            continue;
        }
        let Some(label) = node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(&settings.model_label))
        else {
            continue;
        };
        let model = settings.model_of(label);
        let Some(allocatable) = node.status.as_ref().and_then(|s| s.allocatable.as_ref()) else {
            continue;
        };
        for (resource, quantity) in allocatable {
            let Some(count) = whole_quantity(&quantity.0) else {
                continue;
            };
            let model = if resource == GPU_RESOURCE {
                model.clone()
            } else if let Some(profile) = resource.strip_prefix(MIG_RESOURCE_PREFIX) {
                format!("{model} MIG {profile}")
            } else {
                continue;
            };
            let count = u32::try_from(count).unwrap_or(u32::MAX);
            if count > 0 {
                let entry = pooled.entry(model).or_default();
                *entry = entry.saturating_add(count);
            }
        }
    }
    pooled.into_iter().collect()
}

/// A quantity that is a whole number (`"2"`, `"2.0"` is not one Kubernetes writes for extended
/// resources, which must be integers): its value; anything else (`"500m"`, `"1Ki"`) is none.
pub fn whole_quantity(text: &str) -> Option<u64> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

#[async_trait::async_trait]
impl Driver for KubernetesDriver {
    fn name(&self) -> &str {
        &self.name
    }

    async fn inventory(&self) -> Result<Arc<Inventory>, DriverError> {
        let poll = self.settings.poll.unwrap_or(DEFAULT_POLL);
        if let Some((at, inventory)) = self.kept() {
            if at.elapsed() < poll {
                return Ok(inventory);
            }
        }
        let _reading = self.reading.lock().await;
        // Another caller may have read the nodes while this one waited.
        if let Some((at, inventory)) = self.kept() {
            if at.elapsed() < poll {
                return Ok(inventory);
            }
        }
        let nodes: Api<Node> = Api::all(self.client().await?);
        let list = match nodes.list(&ListParams::default()).await {
            Ok(list) => list,
            Err(e) => {
                // Admission keeps deciding on the nodes last read; only a driver that never read
                // them fails.
                if let Some((_, inventory)) = self.kept() {
                    tracing::warn!(substrate = %self.name, error = %e, "reading the cluster's nodes failed; keeping the last inventory");
                    return Ok(inventory);
                }
                return Err(self.unavailable(format!("listing the nodes: {e}")));
            }
        };
        let inventory = Arc::new(Inventory {
            gpus: Vec::new(),
            pooled: pooled_gpus(&list.items, &self.settings),
            queues: true,
        });
        *self
            .kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some((Instant::now(), inventory.clone()));
        Ok(inventory)
    }

    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        check_lease_id(&self.name, &lease.lease_id)?;
        if self
            .tracked(&lease.lease_id)
            .is_some_and(|p| p.uid.is_some())
            && self.status(&lease.lease_id).await? == LeaseStatus::Running
        {
            // Created before: nothing to do while that very pod (or Deployment) is there.
            return Ok(());
        }
        if lease.workload == gpuwarden_schema::Workload::Inference {
            if let Some(template) = &self.deployment_template {
                let deployment =
                    lease_deployment(template, lease, &self.settings).map_err(|why| {
                        DriverError::Rejected {
                            substrate: self.name.clone(),
                            message: format!("lease {}: {why}", lease.lease_id),
                        }
                    })?;
                return self.create_tracked(lease, &deployment, true).await;
            }
        }
        let Some(template) = &self.template else {
            return Err(DriverError::Rejected {
                substrate: self.name.clone(),
                message: format!(
                    "lease {}: substrate {} has no kubernetes.pod_template, so gpuwarden creates \
                     no pods on it; create the pod with kubectl and the admission webhook admits it",
                    lease.lease_id, self.name
                ),
            });
        };
        let pod = lease_pod(template, lease, &self.settings);
        self.create_tracked(lease, &pod, false).await
    }

    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        let tracked = self.tracked(&lease.lease_id);
        if tracked
            .as_ref()
            .is_some_and(|p| p.gpus == Some(lease.gpu_count))
        {
            return Ok(());
        }
        if let (Some(mut tracked), Some(template)) = (
            tracked.filter(|p| p.deployment),
            self.deployment_template.as_ref(),
        ) {
            let per = gpus_per_replica(template);
            if !lease.gpu_count.is_multiple_of(per) {
                return Err(DriverError::Rejected {
                    substrate: self.name.clone(),
                    message: format!(
                        "lease {}: {} GPUs are not a whole number of replicas of {per} GPUs each",
                        lease.lease_id, lease.gpu_count
                    ),
                });
            }
            let replicas = lease.gpu_count / per;
            let deployments: Api<Deployment> =
                Api::namespaced(self.client().await?, &tracked.namespace);
            let patch = serde_json::json!({"spec": {"replicas": replicas}});
            deployments
                .patch_scale(
                    &tracked.name,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&patch),
                )
                .await
                .map_err(|e| {
                    self.unavailable(format!(
                        "scaling deployment {}/{} to {replicas}: {e}",
                        tracked.namespace, tracked.name
                    ))
                })?;
            tracked.gpus = Some(lease.gpu_count);
            self.track(&lease.lease_id, &tracked).await?;
            tracing::info!(substrate = %self.name, lease = %lease.lease_id, deployment = %tracked.name, replicas, "deployment scaled");
            return Ok(());
        }
        Err(DriverError::Rejected {
            substrate: self.name.clone(),
            message: format!("lease {}: a pod's GPUs cannot change", lease.lease_id),
        })
    }

    async fn reclaim(&self, lease_id: &str, reason: ReleaseReason) -> Result<(), DriverError> {
        let Some(pod) = self.tracked(lease_id) else {
            // Never told of it: nothing of it runs here.
            return Ok(());
        };
        let grace = self.settings.grace_period.unwrap_or(DEFAULT_GRACE_PERIOD);
        if pod.deployment {
            return self.delete_deployment(lease_id, &pod, grace, reason).await;
        }
        let params = DeleteParams {
            grace_period_seconds: Some(u32::try_from(grace.as_secs()).unwrap_or(u32::MAX)),
            preconditions: pod.uid.clone().map(|uid| Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let pods: Api<Pod> = Api::namespaced(self.client().await?, &pod.namespace);
        let ended = match self.settings.reclaim {
            KubernetesReclaim::Delete => pods.delete(&pod.name, &params).await.map(|_| "deleted"),
            KubernetesReclaim::Evict => {
                // Written here rather than with kube's `Api::evict`, whose body (kube-core
                // 5.0) names the options `delete_options` and no kind: the API server would
                // drop them, and the grace period with them.
                let body = serde_json::json!({
                    "apiVersion": "policy/v1",
                    "kind": "Eviction",
                    "metadata": {"name": pod.name, "namespace": pod.namespace},
                    "deleteOptions": params,
                });
                let request = hyper::Request::post(format!(
                    "/api/v1/namespaces/{}/pods/{}/eviction",
                    pod.namespace, pod.name
                ))
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(serde_json::to_vec(&body).expect("an Eviction serializes"))
                .expect("a valid request");
                match self
                    .client()
                    .await?
                    .request::<kube::core::Status>(request)
                    .await
                {
                    // A PodDisruptionBudget forbids it now: a retry may be let through.
                    Err(kube::Error::Api(status)) if status.code == 429 => {
                        return Err(self.unavailable(format!(
                            "evicting pod {}/{}: {} (a PodDisruptionBudget forbids it for now)",
                            pod.namespace, pod.name, status.message
                        )))
                    }
                    other => other.map(|_| "evicted"),
                }
            }
        };
        match ended {
            Ok(how) => {
                tracing::info!(substrate = %self.name, lease = lease_id, namespace = %pod.namespace, pod = %pod.name, reason = reason.as_str(), how, "pod ended");
                self.untrack(lease_id).await;
                Ok(())
            }
            // Gone already, or the name is another pod's now (the uid precondition failed).
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                self.untrack(lease_id).await;
                Ok(())
            }
            Err(kube::Error::Api(status)) if status.code == 403 => Err(DriverError::Rejected {
                substrate: self.name.clone(),
                message: format!(
                    "deleting pod {}/{}: {} (gpuwarden's service account needs `delete` on pods)",
                    pod.namespace, pod.name, status.message
                ),
            }),
            Err(e) => {
                Err(self.unavailable(format!("deleting pod {}/{}: {e}", pod.namespace, pod.name)))
            }
        }
    }

    async fn status(&self, lease_id: &str) -> Result<LeaseStatus, DriverError> {
        let Some(tracked) = self.tracked(lease_id) else {
            return Ok(LeaseStatus::Gone);
        };
        if tracked.deployment {
            let deployments: Api<Deployment> =
                Api::namespaced(self.client().await?, &tracked.namespace);
            return match deployments.get_opt(&tracked.name).await {
                Ok(Some(d)) if tracked.uid.is_none() || d.metadata.uid == tracked.uid => {
                    Ok(LeaseStatus::Running)
                }
                Ok(_) => Ok(LeaseStatus::Gone),
                Err(e) => Err(self.unavailable(format!(
                    "reading deployment {}/{}: {e}",
                    tracked.namespace, tracked.name
                ))),
            };
        }
        let pods: Api<Pod> = Api::namespaced(self.client().await?, &tracked.namespace);
        let pod = match pods.get_opt(&tracked.name).await {
            Ok(Some(pod)) => pod,
            Ok(None) => return Ok(LeaseStatus::Gone),
            Err(e) => {
                return Err(self.unavailable(format!(
                    "reading pod {}/{}: {e}",
                    tracked.namespace, tracked.name
                )))
            }
        };
        if tracked.uid.is_some() && pod.metadata.uid != tracked.uid {
            return Ok(LeaseStatus::Gone);
        }
        Ok(pod_status(&pod))
    }

    /// Only inference leases run as Deployments can change size; with no
    /// `deployment_template`, a resize is denied before it gets here.
    fn resizes(&self) -> bool {
        self.deployment_template.is_some()
    }

    fn kubernetes(&self) -> Option<&KubernetesDriver> {
        Some(self)
    }

    /// Ready once the nodes have been listed (the capacity admission checks; kept when a later
    /// read fails) and the pod watcher has listed the pods: from then on the webhook can decide,
    /// even while the API server is away.
    async fn readiness(&self) -> Result<(), String> {
        if let Err(e) = self.inventory().await {
            // The caller names the substrate.
            let why = match e {
                DriverError::Unavailable { message, .. }
                | DriverError::Rejected { message, .. } => message,
                other => other.to_string(),
            };
            return Err(format!(
                "the cluster's nodes have not been listed yet ({why}); check that the enforcer \
                 reaches the Kubernetes API server and may list nodes"
            ));
        }
        if !self.pods_listed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(
                "the pod watcher has not listed the cluster's pods yet; check that the \
                 enforcer may list and watch pods"
                    .into(),
            );
        }
        Ok(())
    }
}

/// Where open lease `lease` of substrate `substrate` has its pod: the pod or Deployment the
/// driver wrote down on it, else the pod the webhook admitted as it (its `k8s_namespace`,
/// `k8s_pod` and `k8s_pod_uid` labels). The labels are believed only on the lease the webhook
/// recorded for that very pod (`k8s-<its uid>`): an admission through the API may carry any
/// labels, and must not point a reclaim at somebody else's pod.
pub fn pod_of(substrate: &str, lease: &crate::store::Lease) -> Option<PodRef> {
    if lease.substrate != substrate {
        return None;
    }
    if let Some(written) = &lease.substrate_ref {
        return serde_json::from_str(written).ok();
    }
    let label = |name: &str| lease.labels.get(name).cloned();
    let uid = label("k8s_pod_uid")?;
    if lease.id != gpuwarden_schema::lease::kubernetes_lease_id(&uid) {
        return None;
    }
    Some(PodRef {
        namespace: label("k8s_namespace")?,
        name: label("k8s_pod")?,
        uid: Some(uid),
        gpus: Some(lease.gpu_count),
        deployment: false,
    })
}

/// What a pod's phase says of its lease.
pub fn pod_status(pod: &Pod) -> LeaseStatus {
    match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
        Some("Succeeded") => LeaseStatus::Exited(Some(0)),
        Some("Failed") => LeaseStatus::Exited(None),
        // Pending, Running, and Unknown (its node is unreachable: it may still run).
        _ => LeaseStatus::Running,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Lease, LeaseState, Store};

    fn pod(name: &str) -> PodRef {
        PodRef {
            namespace: "ml".into(),
            name: name.into(),
            uid: Some(format!("uid-{name}")),
            gpus: Some(2),
            deployment: false,
        }
    }

    fn lease(id: &str, labels: &[(&str, &str)]) -> Lease {
        Lease {
            substrate: "k8s".into(),
            gpu_count: 2,
            gpu_uuids: Vec::new(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..*crate::store::test_lease(id, LeaseState::Granted, 0)
        }
    }

    /// The lease store's substrate refs as the service hands them to drivers (kept here, in
    /// the driver's layer, so its tests do not reach up to the service).
    #[derive(Debug)]
    struct Refs(Store);

    #[async_trait::async_trait]
    impl crate::drivers::LeaseRefs for Refs {
        async fn set(&self, lease_id: &str, substrate_ref: Option<String>) -> Result<bool, String> {
            self.0
                .set_substrate_ref(lease_id, substrate_ref)
                .await
                .map_err(|e| e.to_string())
        }

        fn open_lease(&self, lease_id: &str) -> Option<Lease> {
            self.0.open_lease(lease_id).ok().flatten()
        }
    }

    fn driver(dir: &std::path::Path, store: &Store) -> KubernetesDriver {
        let config: SubstrateConfig = toml::from_str(
            "name = \"k8s\"\ndriver = \"kubernetes\"\n[kubernetes]\nwebhook_listen = \"127.0.0.1:0\"\n\
             webhook_tls = { cert = \"/unused.pem\", key = \"/unused.key\" }\n",
        )
        .unwrap();
        let context = DriverContext {
            state_dir: dir.join("drivers").join("k8s"),
            lease_refs: Some(Arc::new(Refs(store.clone()))),
        };
        KubernetesDriver::new(&config, &context).unwrap()
    }

    /// A pod written down on its lease is found after a restart (it is in the store); a pod
    /// the webhook admitted is found from its lease's labels, but the same labels on another
    /// lease name nothing; an ended lease has none.
    #[tokio::test]
    async fn a_leases_pod_is_written_down_in_the_store_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("enforcer.db");
        {
            let store = Store::open(&path).unwrap();
            let pod_b = [
                ("k8s_namespace", "ml"),
                ("k8s_pod", "b"),
                ("k8s_pod_uid", "uid-b"),
            ];
            for l in [
                lease("lease-a", &[]),
                lease("k8s-uid-b", &pod_b),
                // An API admission whose labels name pod b: its lease is not pod b's.
                lease("lease-forged", &pod_b),
            ] {
                store.adopt(l, 0, "test").await.unwrap();
            }
            let k8s = driver(dir.path(), &store);
            k8s.track("lease-a", &pod("a")).await.unwrap();
            let err = k8s.track("lease-gone", &pod("x")).await.unwrap_err();
            assert!(err.to_string().contains("not open"), "{err}");
        }
        let store = Store::open(&path).unwrap();
        let k8s = driver(dir.path(), &store);
        assert_eq!(k8s.tracked("lease-a"), Some(pod("a")));
        assert_eq!(k8s.tracked("k8s-uid-b"), Some(pod("b")));
        assert_eq!(k8s.tracked("lease-forged"), None, "labels are not a pod");
        k8s.untrack("lease-a").await;
        assert_eq!(k8s.tracked("lease-a"), None);
        store
            .transition(
                "k8s-uid-b",
                LeaseState::Released,
                1,
                gpuwarden_schema::ReleaseReason::User,
                "",
            )
            .await
            .unwrap();
        assert_eq!(k8s.tracked("k8s-uid-b"), None);
    }

    /// An earlier version's `pods.jsonl` is read into the store once: each open lease's latest
    /// line, a line cut short skipped, a lease since ended left out; the file is renamed.
    #[tokio::test]
    async fn the_pod_journal_of_an_earlier_version_is_imported_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("enforcer.db")).unwrap();
        for id in ["k8s-a", "k8s-b", "k8s-c"] {
            store.adopt(lease(id, &[]), 0, "test").await.unwrap();
        }
        let k8s = driver(dir.path(), &store);
        let line = |lease: &str, pod: Option<PodRef>| {
            serde_json::to_string(&JournalLine {
                lease: lease.into(),
                pod,
            })
            .unwrap()
        };
        let text = [
            line("k8s-a", Some(pod("a"))),
            line("k8s-b", Some(pod("b"))),
            line("k8s-a", None),
            line("k8s-c", Some(pod("c"))),
            line("k8s-ended", Some(pod("e"))),
            // A crash in the middle of a line.
            "{\"lease\":\"k8s-d\",\"pod\":{\"namesp".into(),
        ]
        .join("\n");
        let path = dir.path().join("drivers/k8s/pods.jsonl");
        std::fs::write(&path, text).unwrap();
        assert_eq!(k8s.import_journal().await.unwrap(), 2);
        assert_eq!(k8s.tracked("k8s-a"), None);
        assert_eq!(k8s.tracked("k8s-b"), Some(pod("b")));
        assert_eq!(k8s.tracked("k8s-c"), Some(pod("c")));
        assert!(!path.exists());
        assert!(dir.path().join("drivers/k8s/pods.jsonl.imported").exists());
        assert_eq!(k8s.import_journal().await.unwrap(), 0, "once");
    }
}
