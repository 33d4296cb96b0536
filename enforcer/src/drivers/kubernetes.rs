//! The `kubernetes` driver: a Kubernetes cluster through its API server (kube 5, k8s-openapi
//! 0.29 with the API of Kubernetes 1.33; API servers 1.33 to 1.37 serve these objects
//! unchanged).
//!
//! The cluster runs GPU pods that people create themselves; gpuwarden admits them in the
//! validating admission webhook (`crate::kubernetes`), which records each admitted pod as lease
//! `k8s-<pod uid>` and tells this driver where the pod is ([`KubernetesDriver::track`], kept in
//! `<state_dir>/<lease_id>.json` so that a restarted enforcer can still reclaim it).
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
//! - Provision (pods created from a template for an admission through the HTTP API) and resize
//!   are not built: both answer [`DriverError::Rejected`] saying so, and a resize is denied
//!   `resize_unsupported` before it gets here.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuwarden_schema::config::{KubernetesSettings, SubstrateConfig};
use gpuwarden_schema::ReleaseReason;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, Preconditions};
use kube::{Api, Client};
use serde::{Deserialize, Serialize};

use super::{
    check_lease_id, config_error, state_dir, write_atomically, Driver, DriverContext, DriverError,
    Inventory, LeaseSpec, LeaseStatus,
};

/// The resource NVIDIA's device plugin advertises for whole GPUs.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// The prefix of the resources it advertises for MIG devices (`nvidia.com/mig-1g.10gb`).
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";
/// How often the nodes are read when `poll` is not set.
pub const DEFAULT_POLL: Duration = Duration::from_secs(10);
/// A reclaimed pod's grace period when `grace_period` is not set.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(30);

/// Where a lease's pod is, as the driver keeps it in `<state_dir>/<lease_id>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    /// The pod's namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its uid: a pod recreated under the same name is another pod.
    pub uid: String,
}

/// A Kubernetes cluster's driver.
pub struct KubernetesDriver {
    name: String,
    settings: KubernetesSettings,
    state_dir: PathBuf,
    client: tokio::sync::OnceCell<Client>,
    /// The inventory and when it was read.
    kept: Mutex<Option<(Instant, Arc<Inventory>)>>,
    /// One reader of the nodes at a time.
    reading: tokio::sync::Mutex<()>,
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
        Ok(Self {
            name: config.name.clone(),
            settings,
            state_dir: state_dir(config, context)?,
            client: tokio::sync::OnceCell::new(),
            kept: Mutex::new(None),
            reading: tokio::sync::Mutex::new(()),
        })
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
                Client::try_from(config)
                    .map_err(|e| self.unavailable(format!("building the API client: {e}")))
            })
            .await
            .cloned()
    }

    /// Remembers where lease `lease_id`'s pod is, durably (the webhook calls this for every pod
    /// it admits).
    pub fn track(&self, lease_id: &str, pod: &PodRef) -> Result<(), DriverError> {
        check_lease_id(&self.name, lease_id)?;
        let bytes = serde_json::to_vec(pod).expect("a PodRef serializes");
        write_atomically(&self.pod_file(lease_id), &bytes)
            .map_err(|e| self.unavailable(format!("recording the pod of {lease_id}: {e}")))
    }

    /// Where lease `lease_id`'s pod is, if the driver was told.
    pub fn tracked(&self, lease_id: &str) -> Option<PodRef> {
        check_lease_id(&self.name, lease_id).ok()?;
        let bytes = std::fs::read(self.pod_file(lease_id)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    fn pod_file(&self, lease_id: &str) -> PathBuf {
        self.state_dir.join(format!("{lease_id}.json"))
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

    /// The GPU models the cluster has, from the inventory last read (empty before the first).
    pub fn models(&self) -> Vec<String> {
        self.kept()
            .map(|(_, inv)| inv.pooled.iter().map(|(m, _)| m.clone()).collect())
            .unwrap_or_default()
    }
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
        Err(DriverError::Rejected {
            substrate: self.name.clone(),
            message: format!(
                "lease {}: gpuwarden does not create pods on a Kubernetes substrate yet; create \
                 the pod with kubectl and the admission webhook admits it",
                lease.lease_id
            ),
        })
    }

    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
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
        let params = DeleteParams {
            grace_period_seconds: Some(u32::try_from(grace.as_secs()).unwrap_or(u32::MAX)),
            preconditions: Some(Preconditions {
                uid: Some(pod.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let pods: Api<Pod> = Api::namespaced(self.client().await?, &pod.namespace);
        match pods.delete(&pod.name, &params).await {
            Ok(_) => {
                tracing::info!(substrate = %self.name, lease = lease_id, namespace = %pod.namespace, pod = %pod.name, reason = reason.as_str(), "pod deleted");
                Ok(())
            }
            // Gone already, or the name is another pod's now (the uid precondition failed).
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(()),
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
        if pod.metadata.uid.as_deref() != Some(tracked.uid.as_str()) {
            return Ok(LeaseStatus::Gone);
        }
        Ok(pod_status(&pod))
    }

    fn resizes(&self) -> bool {
        false
    }

    fn kubernetes(&self) -> Option<&KubernetesDriver> {
        Some(self)
    }
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
