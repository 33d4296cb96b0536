//! gpuwarden as a Kueue admission check controller: the `AdmissionCheck`s whose
//! `spec.controllerName` is `[substrates.kubernetes.kueue] controller_name`, and the state of
//! those checks on every Workload that lists one (`kueue.x-k8s.io`, `v1beta2` by default).
//!
//! Kueue reserves quota for a Workload in a ClusterQueue, then waits for each of the queue's
//! admission checks to be `Ready` before it admits the Workload and starts its pods. Every
//! `poll` (default 5 s) this controller lists the AdmissionChecks and the Workloads through the
//! API server and, for each Workload:
//!
//! - our check `Pending` with quota reserved: its GPUs are counted (each pod set's `count` × the
//!   GPUs of its pod template, as the webhook counts a pod's) and mapped as the webhook maps a
//!   pod (namespace → team; user, workload and project from the Workload's labels or
//!   annotations, else its pod templates'; the model from the templates' `nodeSelector`, else
//!   the cluster's only model), then admitted through [`Service::admit_named`] as lease
//!   `kueue-<workload uid>` (`kueue-<uid>-<n>` on its n-th admission, after an eviction). Admitted:
//!   `Ready`, with the estimate in the message and a `podSetUpdates` annotation
//!   `gpuwarden.io/lease` that Kueue puts on the pods it starts. Denied only for quota, budget,
//!   capacity or a blocked team (what may clear by itself): `Retry`, and Kueue requeues the
//!   Workload. Denied for anything else (policy: not a member, a model or size the team may not
//!   have, a Workload that names no user): `Rejected`, and Kueue deactivates it.
//! - our check `Ready`, the Workload not yet `Admitted` (its pods not started), and its team
//!   blocked (over budget, or by an administrator): back to `Retry` with the block in the
//!   message, and the lease is released (reason `budget`). An admitted Workload keeps running;
//!   the runtime rules decide about running work.
//! - our check `Ready` but its lease no longer open (gpuwarden ended it: expiry, idle or budget
//!   reclaim): `Retry`, which makes Kueue evict the Workload and queue it again.
//! - `Finished`, deleted, or back in the queue without quota (evicted): its lease is released.
//!
//! A Workload that asks for no GPU is `Ready` at once, without a lease. Only what gpuwarden
//! itself cannot do (its store failed, the nodes cannot be read) leaves a check `Pending`, to be
//! tried on the next poll.
//!
//! The check states are written with a JSON merge patch of the Workload's status subresource.
//! A merge patch replaces the whole `status.admissionChecks` list, so the list read is sent back
//! with only our entries changed and with the `resourceVersion` read: if Kueue changed the
//! Workload in between, the API server answers 409 and the Workload is read again on the next
//! poll (an admission already recorded is found again under the same lease id). The
//! AdmissionChecks' `Active` condition is written the same way.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use gpuwarden_schema::config::{KubernetesSettings, KueueSettings};
use gpuwarden_schema::ReleaseReason;
use k8s_openapi::api::core::v1::PodTemplateSpec;
use kube::api::{ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Api, Client};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{model_of, pods, team_of, workload_of};
use crate::door::{self, Grant};
use crate::fields;
use crate::policy::{Decision, ReasonCode};
use crate::service::{Service, ServiceError};
use crate::store::Lease;

/// Kueue's API group.
pub const GROUP: &str = "kueue.x-k8s.io";
/// How often the AdmissionChecks and Workloads are read when `poll` is not set.
pub const DEFAULT_POLL: Duration = Duration::from_secs(5);
/// The field manager of gpuwarden's writes.
pub const FIELD_MANAGER: &str = "gpuwarden";
/// The annotation a `Ready` check asks Kueue to put on the Workload's pods: the lease they run
/// under.
pub const LEASE_ANNOTATION: &str = "gpuwarden.io/lease";
/// The longest check message Kueue accepts (`AdmissionCheckState.message`, 32 KiB).
pub const MAX_MESSAGE_BYTES: usize = 32 * 1024;
/// The lease label naming the Workload's uid.
pub const WORKLOAD_UID_LABEL: &str = "kueue_workload_uid";

/// The state of an admission check on a Workload (`AdmissionCheckState.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckState {
    /// Not decided yet.
    Pending,
    /// Admitted by the check.
    Ready,
    /// Not now: Kueue evicts and requeues the Workload, and the check starts again.
    Retry,
    /// Never: Kueue deactivates the Workload.
    Rejected,
}

impl CheckState {
    /// The state as Kueue writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Ready => "Ready",
            Self::Retry => "Retry",
            Self::Rejected => "Rejected",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        [Self::Pending, Self::Ready, Self::Retry, Self::Rejected]
            .into_iter()
            .find(|s| s.as_str() == text)
    }
}

/// Why a pass over the cluster's Workloads stopped.
#[derive(Debug, thiserror::Error)]
pub enum KueueError {
    /// The API server could not be read (retried on the next poll).
    #[error("substrate {substrate}: {what}: {message}")]
    Api {
        /// The substrate.
        substrate: String,
        /// What was being read.
        what: &'static str,
        /// The client's error.
        message: String,
    },
    /// gpuwarden's own store failed.
    #[error("{0}")]
    Service(#[from] ServiceError),
    /// The substrate has no `[substrates.kubernetes.kueue]` section.
    #[error("substrate {0} has no [substrates.kubernetes.kueue] settings")]
    NotConfigured(String),
}

/// What one pass changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pass {
    /// AdmissionChecks marked `Active`.
    pub activated: usize,
    /// Check states written, by the state written.
    pub written: BTreeMap<&'static str, usize>,
    /// Leases released.
    pub released: usize,
}

impl Pass {
    fn changed(&self) -> bool {
        self.activated > 0 || !self.written.is_empty() || self.released > 0
    }
}

/// A Workload, as much of it as the check reads.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct WorkloadSpec {
    pod_sets: Vec<PodSet>,
    queue_name: Option<String>,
    active: Option<bool>,
    maximum_execution_time_seconds: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodSet {
    #[serde(default = "PodSet::default_name")]
    name: String,
    #[serde(default = "PodSet::default_count")]
    count: i64,
    #[serde(default)]
    template: PodTemplateSpec,
}

impl PodSet {
    fn default_name() -> String {
        "main".into()
    }
    fn default_count() -> i64 {
        1
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct WorkloadStatus {
    conditions: Vec<Condition>,
    admission: Option<Value>,
    admission_checks: Vec<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Condition {
    #[serde(rename = "type")]
    kind: String,
    status: String,
    observed_generation: Option<i64>,
}

impl WorkloadStatus {
    fn is(&self, kind: &str) -> bool {
        self.conditions
            .iter()
            .any(|c| c.kind == kind && c.status == "True")
    }
}

/// What the check decided for a Workload.
#[derive(Debug)]
enum Verdict {
    Ready {
        message: String,
        lease: Option<String>,
    },
    Retry(String),
    Rejected(String),
}

/// The admission check controller of one Kubernetes substrate.
pub struct Controller {
    service: Service,
    substrate: String,
    client: Client,
    settings: KubernetesSettings,
    kueue: KueueSettings,
    checks: ApiResource,
    workloads: ApiResource,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("substrate", &self.substrate)
            .field("controller_name", &self.kueue.controller_name)
            .finish_non_exhaustive()
    }
}

impl Controller {
    /// The controller of substrate `substrate` (its `[substrates.kubernetes.kueue]`), talking to
    /// the API server through `client`.
    pub fn new(service: Service, substrate: &str, client: Client) -> Result<Self, KueueError> {
        let settings = service
            .config()
            .substrates
            .iter()
            .find(|s| s.name == substrate)
            .and_then(|s| s.kubernetes.clone())
            .ok_or_else(|| KueueError::NotConfigured(substrate.to_owned()))?;
        let kueue = settings
            .kueue
            .clone()
            .ok_or_else(|| KueueError::NotConfigured(substrate.to_owned()))?;
        let resource = |kind: &str, plural: &str| ApiResource {
            group: GROUP.into(),
            version: kueue.api_version.clone(),
            api_version: format!("{GROUP}/{}", kueue.api_version),
            kind: kind.into(),
            plural: plural.into(),
        };
        Ok(Self {
            checks: resource("AdmissionCheck", "admissionchecks"),
            workloads: resource("Workload", "workloads"),
            service,
            substrate: substrate.to_owned(),
            client,
            settings,
            kueue,
        })
    }

    /// Runs a pass every `poll` until `stop` turns true.
    pub async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let poll = self.kueue.poll.unwrap_or(DEFAULT_POLL);
        tracing::info!(substrate = %self.substrate, controller_name = %self.kueue.controller_name, api_version = %self.kueue.api_version, "kueue admission check controller running");
        loop {
            match self.pass().await {
                Ok(pass) if pass.changed() => {
                    tracing::info!(substrate = %self.substrate, activated = pass.activated, written = ?pass.written, released = pass.released, "kueue admission checks updated")
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(substrate = %self.substrate, error = %e, "kueue admission check pass failed; trying again on the next poll")
                }
            }
            tokio::select! {
                () = tokio::time::sleep(poll) => {}
                _ = stop.wait_for(|stopped| *stopped) => return,
            }
        }
    }

    /// One pass: keeps our AdmissionChecks `Active`, decides our checks on every Workload, and
    /// releases the leases of Workloads that finished, went away or lost their quota.
    pub async fn pass(&self) -> Result<Pass, KueueError> {
        let mut pass = Pass::default();
        let ours = self.activate_checks(&mut pass).await?;
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &self.workloads);
        let workloads = api
            .list(&ListParams::default())
            .await
            .map_err(|e| self.api_error("listing the Workloads", e))?;
        let mut open: BTreeMap<String, Lease> = BTreeMap::new();
        for lease in self.service.open_leases()? {
            if lease.substrate != self.substrate {
                continue;
            }
            if let Some(uid) = lease.labels.get(WORKLOAD_UID_LABEL) {
                open.insert(uid.clone(), lease);
            }
        }
        let blocked = self.service.ledger(self.service.now())?.blocked;
        let mut seen = BTreeSet::new();
        for workload in &workloads.items {
            let uid = workload.metadata.uid.clone().unwrap_or_default();
            seen.insert(uid.clone());
            if let Err(e) = self
                .reconcile(workload, &ours, open.get(&uid), &blocked, &mut pass)
                .await
            {
                tracing::warn!(substrate = %self.substrate, namespace = ?workload.metadata.namespace, workload = ?workload.metadata.name, error = %e, "deciding a Workload's admission check failed; trying again on the next poll");
            }
        }
        for (uid, lease) in &open {
            if !seen.contains(uid) {
                self.end(
                    lease,
                    ReleaseReason::User,
                    "its Workload was deleted",
                    &mut pass,
                )
                .await?;
            }
        }
        Ok(pass)
    }

    /// Lists the AdmissionChecks, marks ours `Active` where they are not yet (for their current
    /// generation), and returns their names.
    async fn activate_checks(&self, pass: &mut Pass) -> Result<BTreeSet<String>, KueueError> {
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &self.checks);
        let checks = api
            .list(&ListParams::default())
            .await
            .map_err(|e| self.api_error("listing the AdmissionChecks", e))?;
        let mut ours = BTreeSet::new();
        for check in &checks.items {
            let controller = check
                .data
                .pointer("/spec/controllerName")
                .and_then(Value::as_str);
            if controller != Some(self.kueue.controller_name.as_str()) {
                continue;
            }
            let Some(name) = check.metadata.name.clone() else {
                continue;
            };
            ours.insert(name.clone());
            let generation = check.metadata.generation;
            let conditions: Vec<Value> = check
                .data
                .pointer("/status/conditions")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let active = conditions.iter().find(|c| c["type"] == "Active");
            let current = active.and_then(|c| serde_json::from_value::<Condition>(c.clone()).ok());
            if current
                .as_ref()
                .is_some_and(|c| c.status == "True" && c.observed_generation == generation)
            {
                continue;
            }
            let since = match (&current, active) {
                (Some(c), Some(a)) if c.status == "True" => a["lastTransitionTime"].clone(),
                _ => json!(self.timestamp()),
            };
            let mut written: Vec<Value> = conditions
                .iter()
                .filter(|c| c["type"] != "Active")
                .cloned()
                .collect();
            written.push(json!({
                "type": "Active",
                "status": "True",
                "reason": "Active",
                "message": "gpuwarden admits the Workloads of this check by team quota, budget and policy",
                "observedGeneration": generation,
                "lastTransitionTime": since,
            }));
            let patch = json!({"status": {"conditions": written}});
            match api
                .patch_status(&name, &self.patch_params(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    tracing::info!(substrate = %self.substrate, admission_check = %name, "admission check marked Active");
                    pass.activated += 1;
                }
                Err(e) => {
                    tracing::warn!(substrate = %self.substrate, admission_check = %name, error = %e, "marking the admission check Active failed; trying again on the next poll")
                }
            }
        }
        Ok(ours)
    }

    async fn reconcile(
        &self,
        object: &DynamicObject,
        ours: &BTreeSet<String>,
        lease: Option<&Lease>,
        blocked: &BTreeSet<String>,
        pass: &mut Pass,
    ) -> Result<(), KueueError> {
        let status: WorkloadStatus = object
            .data
            .get("status")
            .and_then(|s| serde_json::from_value(s.clone()).ok())
            .unwrap_or_default();
        let state = status
            .admission_checks
            .iter()
            .filter(|c| c["name"].as_str().is_some_and(|n| ours.contains(n)))
            .find_map(|c| c["state"].as_str().and_then(CheckState::parse));
        let name = object.metadata.name.clone().unwrap_or_default();
        let namespace = object.metadata.namespace.clone().unwrap_or_default();
        if status.is("Finished") {
            if let Some(lease) = lease {
                let why = format!("Workload {namespace}/{name} finished");
                self.end(lease, ReleaseReason::User, &why, pass).await?;
            }
            return Ok(());
        }
        let Some(state) = state else {
            return Ok(());
        };
        let admitted = status.is("Admitted");
        let quota_reserved = status.is("QuotaReserved") || status.admission.is_some();
        let verdict = match state {
            CheckState::Pending if quota_reserved => {
                let spec: WorkloadSpec = object
                    .data
                    .get("spec")
                    .map(|s| serde_json::from_value(s.clone()))
                    .transpose()
                    .map_err(|e| KueueError::Api {
                        substrate: self.substrate.clone(),
                        what: "reading a Workload's spec",
                        message: e.to_string(),
                    })?
                    .unwrap_or_default();
                if spec.active == Some(false) {
                    return Ok(());
                }
                self.decide(object, &spec, lease).await?
            }
            CheckState::Pending => {
                // Kueue took its quota back (evicted, or preempted) and queued it again.
                if let Some(lease) = lease {
                    let why = format!("Workload {namespace}/{name} went back to its queue");
                    self.end(lease, ReleaseReason::User, &why, pass).await?;
                }
                return Ok(());
            }
            CheckState::Ready => {
                let team = team_of(&self.settings, self.service.config(), &namespace);
                match lease {
                    Some(lease) if !admitted && blocked.contains(&lease.team) => {
                        let why = format!(
                            "gpuwarden: team {} is blocked (over its monthly budget, or by an \
                             administrator): the Workload waits in its queue until the block is \
                             lifted; lease {} released",
                            lease.team, lease.id
                        );
                        self.end(lease, ReleaseReason::Budget, &why, pass).await?;
                        Verdict::Retry(why)
                    }
                    Some(_) => return Ok(()),
                    None => {
                        let Some(id) = self.lease_named_by(&status, ours) else {
                            // Made Ready without a lease: a Workload without GPUs.
                            return Ok(());
                        };
                        let ended = self.service.stored_lease(&id).await?;
                        let reason = ended
                            .as_ref()
                            .and_then(|l| l.release_reason)
                            .map_or("released", |r| r.as_str());
                        Verdict::Retry(format!(
                            "gpuwarden: lease {id} of team {} ended ({reason}): the Workload is \
                             evicted and waits in its queue to be admitted again",
                            team.unwrap_or_default()
                        ))
                    }
                }
            }
            CheckState::Retry | CheckState::Rejected => {
                if let Some(lease) = lease {
                    let why = format!(
                        "admission check of Workload {namespace}/{name} is {}",
                        state.as_str()
                    );
                    self.end(lease, ReleaseReason::User, &why, pass).await?;
                }
                return Ok(());
            }
        };
        self.write(object, &status, ours, verdict, pass).await
    }

    /// The lease id our `Ready` check entry asked Kueue to put on the pods.
    fn lease_named_by(&self, status: &WorkloadStatus, ours: &BTreeSet<String>) -> Option<String> {
        status
            .admission_checks
            .iter()
            .filter(|c| c["name"].as_str().is_some_and(|n| ours.contains(n)))
            .flat_map(|c| c["podSetUpdates"].as_array().into_iter().flatten())
            .find_map(|u| u["annotations"][LEASE_ANNOTATION].as_str())
            .map(str::to_owned)
    }

    /// Maps a Workload whose quota Kueue reserved to an admission request and asks the service,
    /// as lease `lease`'s id when it had one already.
    async fn decide(
        &self,
        object: &DynamicObject,
        spec: &WorkloadSpec,
        lease: Option<&Lease>,
    ) -> Result<Verdict, KueueError> {
        let mut work = match self.read_workload(object, spec).await? {
            Ok(work) => work,
            Err(verdict) => return Ok(verdict),
        };
        let meta = &object.metadata;
        let uid = meta.uid.clone().unwrap_or_default();
        let lease_id = match lease {
            Some(lease) => lease.id.clone(),
            None => self.next_lease_id(&uid).await?,
        };
        work.labels = BTreeMap::from([
            (
                "k8s_namespace".to_owned(),
                meta.namespace.clone().unwrap_or_default(),
            ),
            (
                "kueue_workload".to_owned(),
                meta.name.clone().unwrap_or_default(),
            ),
            (WORKLOAD_UID_LABEL.to_owned(), uid),
        ]);
        if let Some(queue) = &spec.queue_name {
            work.labels.insert("kueue_queue".to_owned(), queue.clone());
        }
        let config = self.service.config();
        let request = work.request(config);
        let principal = door::substrate_principal(config, format!("kueue:{}", self.substrate));
        let grant = Grant::Named(&lease_id);
        Ok(
            match door::admit(&self.service, &principal, grant, request.clone()).await? {
                door::Answer::Admitted(admission) => Verdict::Ready {
                    message: door::admitted(&request, &admission.decision, &lease_id),
                    lease: Some(lease_id),
                },
                door::Answer::Denied { admission, message } if may_clear(&admission.decision) => {
                    Verdict::Retry(message)
                }
                door::Answer::Denied { message, .. } => Verdict::Rejected(message),
                door::Answer::Refused(e) => Verdict::Rejected(format!("gpuwarden: rejected: {e}")),
            },
        )
    }

    /// Reads a Workload into what it asks admission for: its GPUs (each pod set's `count` × the
    /// GPUs of its pod template), team (from its namespace), user, workload and project (its
    /// labels or annotations, else its pod templates'), model (the templates' `nodeSelector`,
    /// else the cluster's only one; one for all its pod sets) and duration (its
    /// `maximumExecutionTimeSeconds`); its labels are the caller's to set. Otherwise the verdict:
    /// `Ready` for a Workload asking for no GPU, `Rejected` for one that gets something wrong.
    async fn read_workload(
        &self,
        object: &DynamicObject,
        spec: &WorkloadSpec,
    ) -> Result<Result<door::WorkAsk, Verdict>, KueueError> {
        let settings = &self.settings;
        let config = self.service.config();
        let namespace = object.metadata.namespace.clone().unwrap_or_default();
        let reject = |why: String| {
            Ok(Err(Verdict::Rejected(format!(
                "gpuwarden: rejected: {why}"
            ))))
        };
        // The Workload's own labels and annotations, then its pod templates'.
        let meta = |key: &str| -> Option<String> {
            let own = [&object.metadata.labels, &object.metadata.annotations];
            let templates = spec.pod_sets.iter().flat_map(|p| {
                let m = p.template.metadata.as_ref();
                [
                    m.and_then(|m| m.labels.as_ref()),
                    m.and_then(|m| m.annotations.as_ref()),
                ]
            });
            own.into_iter()
                .map(Option::as_ref)
                .chain(templates)
                .flatten()
                .find_map(|map| map.get(key).filter(|v| !v.is_empty()).cloned())
        };
        // Its GPUs, as the pod sets ask for them; a Workload without any needs no lease.
        let mut asks = Vec::new();
        for set in &spec.pod_sets {
            let Some(pod) = &set.template.spec else {
                continue;
            };
            match pods::gpu_ask(pod) {
                Ok(ask) if ask.count == 0 => {}
                Ok(ask) => asks.push((set, pod, ask)),
                Err(why) => return reject(format!("pod set {:?}: {}", set.name, why.0)),
            }
        }
        let gpus = asks.iter().fold(0u64, |sum, (set, _, ask)| {
            let count = u64::try_from(set.count.max(0)).unwrap_or(0);
            sum.saturating_add(count.saturating_mul(ask.count))
        });
        if gpus == 0 {
            return Ok(Err(Verdict::Ready {
                message: "gpuwarden: the Workload asks for no GPU".into(),
                lease: None,
            }));
        }
        let Some(team) = team_of(settings, config, &namespace) else {
            return reject(format!(
                "namespace {namespace:?} maps to no team (ask an administrator to add it to \
                 substrate {}'s kubernetes.teams)",
                self.substrate
            ));
        };
        let Some(user) = meta(&settings.user_label) else {
            return reject(format!(
                "the Workload names no user: set the {} label on the job's pod template (a \
                 Workload does not say who created it)",
                settings.user_label
            ));
        };
        if let Err(why) = fields::check_name(&user) {
            return reject(format!(
                "user {user:?} is not a name gpuwarden accepts: {why} (the {} label)",
                settings.user_label
            ));
        }
        let (workload, project_from_workload) =
            match workload_of(meta(&settings.workload_label).as_deref(), settings) {
                Ok(found) => found,
                Err(why) => return reject(why),
            };
        let project = meta(&settings.project_label)
            .or(project_from_workload)
            .unwrap_or_else(|| namespace.clone());
        // One kind of GPU and one model for all its pod sets, as one lease holds.
        let inventory = match self.service.driver_named(&self.substrate) {
            Some(driver) => driver.inventory().await.map_err(|e| KueueError::Api {
                substrate: self.substrate.clone(),
                what: "reading the cluster's GPUs",
                message: e.to_string(),
            })?,
            None => return Err(KueueError::NotConfigured(self.substrate.clone())),
        };
        let mut kind: Option<(&str, String)> = None;
        for (set, pod, ask) in &asks {
            let model = match model_of(pod, ask, settings, &inventory) {
                Ok(model) => model,
                Err(why) => return reject(format!("pod set {:?}: {why}", set.name)),
            };
            match &kind {
                Some((resource, first)) if *resource != ask.resource || *first != model => {
                    return reject(format!(
                        "pod set {:?} asks for {} of model {model}, another for {resource} of \
                         model {first}: a Workload gpuwarden admits holds one kind of GPU",
                        set.name, ask.resource
                    ))
                }
                Some(_) => {}
                None => kind = Some((ask.resource.as_str(), model)),
            }
        }
        let Some((_, model)) = kind else {
            return Err(ServiceError::Bug(
                "a Workload asking for GPUs had no pod set asking".into(),
            )
            .into());
        };
        Ok(Ok(door::WorkAsk {
            substrate: self.substrate.clone(),
            team,
            user,
            project,
            workload,
            gpus,
            gpu_model: model,
            asked: spec
                .maximum_execution_time_seconds
                .and_then(|s| u64::try_from(s).ok())
                .map(Duration::from_secs),
            labels: BTreeMap::new(),
            dry_run: false,
        }))
    }

    /// The first lease id of the Workload's attempts that names no lease yet.
    async fn next_lease_id(&self, uid: &str) -> Result<String, KueueError> {
        for attempt in 1..=1000 {
            let id = gpuwarden_schema::lease::kueue_lease_id(uid, attempt);
            if self.service.stored_lease(&id).await?.is_none() {
                return Ok(id);
            }
        }
        Err(ServiceError::Invalid {
            field: "lease_id".into(),
            message: format!("Workload {uid} was admitted 1000 times"),
        }
        .into())
    }

    /// Writes `verdict` into our entries of the Workload's `status.admissionChecks`.
    async fn write(
        &self,
        object: &DynamicObject,
        status: &WorkloadStatus,
        ours: &BTreeSet<String>,
        verdict: Verdict,
        pass: &mut Pass,
    ) -> Result<(), KueueError> {
        let (state, message, lease) = match verdict {
            Verdict::Ready { message, lease } => (CheckState::Ready, message, lease),
            Verdict::Retry(message) => (CheckState::Retry, message, None),
            Verdict::Rejected(message) => (CheckState::Rejected, message, None),
        };
        let spec_sets: Vec<String> = object
            .data
            .pointer("/spec/podSets")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|p| p["name"].as_str().unwrap_or("main").to_owned())
            .collect();
        let now = self.timestamp();
        let message = bounded(message);
        let checks: Vec<Value> = status
            .admission_checks
            .iter()
            .map(|entry| {
                let mine = entry["name"].as_str().is_some_and(|n| ours.contains(n));
                if !mine {
                    return entry.clone();
                }
                let mut entry = entry.clone();
                if entry["state"] != state.as_str() {
                    entry["lastTransitionTime"] = json!(now);
                }
                entry["state"] = json!(state.as_str());
                entry["message"] = json!(message);
                if let Some(map) = entry.as_object_mut() {
                    map.remove("podSetUpdates");
                }
                if let Some(lease) = &lease {
                    entry["podSetUpdates"] = spec_sets
                        .iter()
                        .map(|set| json!({"name": set, "annotations": {LEASE_ANNOTATION: lease}}))
                        .collect();
                }
                entry
            })
            .collect();
        let name = object.metadata.name.clone().unwrap_or_default();
        let namespace = object.metadata.namespace.clone().unwrap_or_default();
        let patch = json!({
            "metadata": {"resourceVersion": object.metadata.resource_version},
            "status": {"admissionChecks": checks},
        });
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &namespace, &self.workloads);
        match api
            .patch_status(&name, &self.patch_params(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                tracing::info!(substrate = %self.substrate, namespace = %namespace, workload = %name, state = state.as_str(), message = %message, "admission check set");
                *pass.written.entry(state.as_str()).or_default() += 1;
                Ok(())
            }
            // Changed since it was read (409) or gone (404): read again on the next poll.
            Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => {
                tracing::debug!(substrate = %self.substrate, namespace = %namespace, workload = %name, code = e.code, "the Workload changed while its check was decided; reading it again on the next poll");
                Ok(())
            }
            Err(e) => Err(self.api_error("writing a Workload's admission check", e)),
        }
    }

    /// Releases `lease` as its Workload has ended, left or been sent back: nothing runs under it
    /// that gpuwarden must stop (the driver keeps no pod for a Kueue lease).
    async fn end(
        &self,
        lease: &Lease,
        reason: ReleaseReason,
        why: &str,
        pass: &mut Pass,
    ) -> Result<(), KueueError> {
        match self.service.ended(&lease.id, reason, why).await {
            Ok(_) => {
                tracing::info!(substrate = %self.substrate, lease_id = %lease.id, reason = reason.as_str(), why, "kueue lease released");
                pass.released += 1;
                Ok(())
            }
            // Ended meanwhile by someone else (a release through the API, a rule).
            Err(ServiceError::NotFound(_) | ServiceError::Conflict(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn patch_params(&self) -> PatchParams {
        PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        }
    }

    fn timestamp(&self) -> String {
        let ms = u64::try_from(self.service.now()).unwrap_or(0);
        humantime::format_rfc3339_seconds(SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
            .to_string()
    }

    fn api_error(&self, what: &'static str, e: kube::Error) -> KueueError {
        KueueError::Api {
            substrate: self.substrate.clone(),
            what,
            message: e.to_string(),
        }
    }
}

/// Whether every reason of a denial may clear without anyone changing the Workload: GPUs freed
/// (capacity, quota), a new month or a raised budget, a lifted block.
fn may_clear(decision: &Decision) -> bool {
    decision.reasons.iter().all(|r| {
        matches!(
            r.code,
            ReasonCode::NoCapacity
                | ReasonCode::QuotaExceeded
                | ReasonCode::BudgetExceeded
                | ReasonCode::TeamBlocked
        )
    })
}

/// `message` cut to Kueue's limit, at a character boundary.
fn bounded(mut message: String) -> String {
    if message.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES - 3;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...");
    }
    message
}

/// Runs substrate `substrate`'s controller until `stop`, with the API client of its driver
/// (asked again every `poll` until the driver has one).
pub async fn run(
    service: Service,
    substrate: String,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let poll = service
        .config()
        .substrates
        .iter()
        .find(|s| s.name == substrate)
        .and_then(|s| s.kubernetes.as_ref())
        .and_then(|k| k.kueue.as_ref())
        .and_then(|k| k.poll)
        .unwrap_or(DEFAULT_POLL);
    let client = loop {
        let found = match service.driver_named(&substrate) {
            Some(driver) => match driver.kubernetes() {
                Some(kubernetes) => kubernetes.client().await.map_err(|e| e.to_string()),
                None => Err(format!("substrate {substrate} is not a Kubernetes cluster")),
            },
            None => Err(format!("there is no substrate named {substrate}")),
        };
        match found {
            Ok(client) => break client,
            Err(e) => {
                tracing::warn!(substrate = %substrate, error = %e, "the kueue admission check controller has no API client yet");
            }
        }
        tokio::select! {
            () = tokio::time::sleep(poll) => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
    };
    match Controller::new(service, &substrate, client) {
        Ok(controller) => controller.run(stop).await,
        Err(e) => {
            tracing::error!(substrate = %substrate, error = %e, "the kueue admission check controller cannot start")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Estimate, Reason};

    fn denial(codes: &[ReasonCode]) -> Decision {
        Decision {
            reasons: codes
                .iter()
                .map(|&code| Reason {
                    code,
                    message: String::new(),
                })
                .collect(),
            estimate: Estimate {
                usd_per_hour: 0.0,
                max_usd: None,
                gpu_model: None,
            },
            placement: None,
            duration: None,
        }
    }

    #[test]
    fn only_denials_that_may_clear_by_themselves_are_retried() {
        assert!(may_clear(&denial(&[ReasonCode::QuotaExceeded])));
        assert!(may_clear(&denial(&[
            ReasonCode::BudgetExceeded,
            ReasonCode::NoCapacity,
            ReasonCode::TeamBlocked
        ])));
        assert!(!may_clear(&denial(&[ReasonCode::ModelNotAllowed])));
        assert!(!may_clear(&denial(&[
            ReasonCode::QuotaExceeded,
            ReasonCode::WorkloadLimit
        ])));
        assert!(!may_clear(&denial(&[ReasonCode::DurationLimit])));
    }

    #[test]
    fn messages_are_cut_to_kueues_limit_at_a_character_boundary() {
        assert_eq!(bounded("short".into()), "short");
        let long = "é".repeat(MAX_MESSAGE_BYTES);
        let cut = bounded(long);
        assert!(cut.len() <= MAX_MESSAGE_BYTES, "{}", cut.len());
        assert!(cut.ends_with("..."));
        assert!(cut.len() > MAX_MESSAGE_BYTES - 8);
    }

    #[test]
    fn check_states_read_as_kueue_writes_them() {
        for s in ["Pending", "Ready", "Retry", "Rejected"] {
            assert_eq!(CheckState::parse(s).map(CheckState::as_str), Some(s));
        }
        assert_eq!(CheckState::parse("ready"), None);
    }
}
