//! Kubernetes' side of admission: the validating admission webhook's answer to an
//! `AdmissionReview` (`admission.k8s.io/v1`) for a pod being created, over the [`Service`].
//!
//! The API server sends the pod as it will be stored (its uid and generated name already set:
//! validating webhooks run after the object is complete). A pod that asks for no GPU
//! (`nvidia.com/gpu` or `nvidia.com/mig-*`, see [`pods::gpu_ask`]) is allowed untouched, and so
//! is anything but the creation of a v1 Pod. A GPU pod is mapped by `[substrates.kubernetes]`:
//! its namespace to a team (`teams`, a namespace that is a team's name, or `"*"`), its user from
//! the `user_label` label or annotation or the review's `userInfo.username` (through `users`),
//! its workload and project from the `workload_label` (`<workload>[:<project>]`) and
//! `project_label` labels or annotations (project default: the namespace), its model from the
//! `model_label` in its `nodeSelector` or required node affinity (a pod that names none is
//! checked as the cluster's only model, and denied when there are several). The pod's
//! `activeDeadlineSeconds`, if any, is its duration, else the workload's `max_duration`.
//!
//! Admitted, the pod becomes lease `k8s-<pod uid>` at once (granted and published, nothing
//! provisioned; a review sent again for the same pod answers from that lease), the driver
//! remembers where the pod is, and the answer carries the estimate as a warning, which
//! `kubectl` prints. Denied, the answer is `allowed: false` with `status.code` 403 and every
//! reason in `status.message`, which `kubectl` prints as the error. Mistakes a person can fix
//! (a namespace without a team, an unknown workload, a user who is not a member) are denials.
//! When the cluster's nodes have never been read and the API server does not answer, the pod
//! is refused with `status.code` 503 and a message saying so (try again; what the administrator
//! should look at), whatever `failurePolicy` says: the enforcer answered. Only what the enforcer
//! itself cannot do (its store failed) is an error (HTTP 500), which the API server treats by
//! the webhook's `failurePolicy`. A body that is not an `AdmissionReview`
//! of `admission.k8s.io/v1` is refused with 400 and a message naming what is wrong, which the
//! API server logs.
//!
//! A GPU pod annotated `gpuwarden.io/lease` with the open lease of a Kueue Workload of its
//! namespace (the admission check's `podSetUpdates`, see [`kueue`]) runs under that lease and
//! is allowed with a warning naming it; one naming a lease that is not open, or smaller than
//! the pod, is denied.

pub mod pods;
pub mod kueue;
pub mod watch;

use std::collections::BTreeMap;
use std::time::Duration;

use gpuwarden_schema::config::KubernetesSettings;
use gpuwarden_schema::Workload;
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use kube::core::admission::{
    AdmissionRequest as Review, AdmissionResponse, AdmissionReview, Operation,
};
use kube::core::DynamicObject;

use crate::door::{self, Grant};
use crate::drivers::Inventory;
use crate::fields;
use crate::service::{Service, ServiceError};

/// The only `AdmissionReview` version spoken (the API server sends the first of the webhook's
/// `admissionReviewVersions` it knows).
pub const REVIEW_API_VERSION: &str = "admission.k8s.io/v1";
/// The largest review body read; the API server's own limit on an object is 3 MiB (etcd's
/// request size), and a review carries the object once (twice for updates, which are not sent).
pub const MAX_REVIEW_BYTES: usize = 8 << 20;

/// Why a review got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// The body is not an `admission.k8s.io/v1` `AdmissionReview` (HTTP 400).
    #[error("{0}")]
    Malformed(String),
    /// The enforcer could not decide (HTTP 500; the API server applies `failurePolicy`).
    #[error("{0}")]
    Unavailable(String),
}

/// The lease id of an admitted pod (the collector names it the same way from the kubelet).
pub fn lease_id(pod_uid: &str) -> String {
    gpuwarden_schema::lease::kubernetes_lease_id(pod_uid)
}

/// Answers one review of substrate `substrate`: the `AdmissionReview` JSON to send back.
pub async fn review(
    service: &Service,
    substrate: &str,
    body: &[u8],
) -> Result<Vec<u8>, ReviewError> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ReviewError::Malformed(format!("the body is not JSON: {e}")))?;
    let version = value
        .get("apiVersion")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    let kind = value.get("kind").and_then(|v| v.as_str()).unwrap_or("");
    if kind != "AdmissionReview" || version != REVIEW_API_VERSION {
        return Err(ReviewError::Malformed(format!(
            "expected an AdmissionReview of {REVIEW_API_VERSION}, got kind {kind:?} of apiVersion \
             {version:?}: set admissionReviewVersions to [\"v1\"] in the webhook configuration"
        )));
    }
    let review: AdmissionReview<DynamicObject> =
        serde_path_to_error::deserialize(value).map_err(|e| {
            ReviewError::Malformed(format!("AdmissionReview field {}: {}", e.path(), e.inner()))
        })?;
    let request: Review<DynamicObject> = review
        .try_into()
        .map_err(|_| ReviewError::Malformed("the AdmissionReview has no request".into()))?;
    let response = answer(service, substrate, &request).await?;
    serde_json::to_vec(&response.into_review())
        .map_err(|e| ReviewError::Unavailable(format!("writing the answer: {e}")))
}

/// A denial: `allowed: false`, code 403, the message for `kubectl`.
fn deny(request: &Review<DynamicObject>, message: String) -> AdmissionResponse {
    let mut response = AdmissionResponse::from(request).deny(message);
    response.result.code = 403;
    response.result.reason = "Forbidden".into();
    response.result.status = Some(kube::core::response::StatusSummary::Failure);
    response
}

/// A refusal because gpuwarden cannot decide now: `allowed: false` with `status.code` 503, in
/// words the pod's creator can act on and an administrator can follow up. `cause` says why, as
/// [`Unavailable`] words it. An answer rather than an HTTP error, which the API server would
/// report as "failed calling webhook" with no word of why.
fn unavailable(request: &Review<DynamicObject>, cause: Unavailable<'_>) -> AdmissionResponse {
    let message = match cause {
        Unavailable::ApiUnreachable(why) => format!(
            "gpuwarden: this pod was not created because gpuwarden cannot check GPU capacity \
             right now: it cannot reach the Kubernetes API ({why}). This is not a policy \
             decision: try again in a minute. If it keeps happening, ask your cluster \
             administrator to check the gpuwarden enforcer's log and its access to the \
             Kubernetes API server."
        ),
        Unavailable::Substrate(why) => format!(
            "gpuwarden: this pod was not created because gpuwarden could not record its GPU \
             lease right now ({why}). This is not a policy decision: try again in a minute. If \
             it keeps happening, ask your cluster administrator to check the gpuwarden \
             enforcer's log."
        ),
    };
    let mut response = AdmissionResponse::from(request).deny(message);
    response.result.code = 503;
    response.result.reason = "ServiceUnavailable".into();
    response.result.status = Some(kube::core::response::StatusSummary::Failure);
    response
}

/// Why gpuwarden cannot decide on a pod now, for [`unavailable`].
#[derive(Debug, Clone, Copy)]
enum Unavailable<'a> {
    /// The cluster's nodes cannot be read: never listed, and the API server does not answer.
    ApiUnreachable(&'a str),
    /// Admission failed in the substrate's driver, or on a lease in a state it cannot take
    /// (`ServiceError::Substrate`, `ServiceError::Conflict`): trying again may help.
    Substrate(&'a str),
}

/// The answer to a review whose admission failed with `e`: a denial for what the request got
/// wrong (`Forbidden`, `NotFound`, `Invalid`), a 503 refusal for what trying again may mend
/// (`Substrate`, `Conflict`), and HTTP 500 for a failure of the enforcer itself (`Store`,
/// `Bug`), where the API server applies `failurePolicy`.
fn admit_failed(
    request: &Review<DynamicObject>,
    substrate: &str,
    e: ServiceError,
) -> Result<AdmissionResponse, ReviewError> {
    match e {
        ServiceError::Forbidden(_) | ServiceError::NotFound(_) | ServiceError::Invalid { .. } => {
            Ok(deny(request, format!("gpuwarden: denied: {e}")))
        }
        ServiceError::Substrate(_) | ServiceError::Conflict(_) => {
            tracing::error!(substrate = %substrate, error = %e, "cannot admit a GPU pod; it is refused (503)");
            Ok(unavailable(request, Unavailable::Substrate(&e.to_string())))
        }
        ServiceError::Store(_) | ServiceError::Bug(_) => {
            Err(ReviewError::Unavailable(e.to_string()))
        }
    }
}

/// A GPU pod under review: the review, the pod, what it asks for and where it is to run.
struct GpuPod<'a> {
    request: &'a Review<DynamicObject>,
    pod: &'a Pod,
    spec: &'a PodSpec,
    ask: &'a pods::GpuAsk,
    namespace: &'a str,
    name: &'a str,
}

async fn answer(
    service: &Service,
    substrate: &str,
    request: &Review<DynamicObject>,
) -> Result<AdmissionResponse, ReviewError> {
    let allow = AdmissionResponse::from(request);
    let is_pod =
        request.kind.group.is_empty() && request.kind.version == "v1" && request.kind.kind == "Pod";
    if !is_pod || request.operation != Operation::Create || request.sub_resource.is_some() {
        return Ok(allow);
    }
    let Some(object) = &request.object else {
        return Err(ReviewError::Malformed(
            "a CREATE review without an object".into(),
        ));
    };
    let pod: Pod = serde_json::to_value(object)
        .and_then(serde_json::from_value)
        .map_err(|e| ReviewError::Malformed(format!("the object is not a v1 Pod: {e}")))?;
    let Some(spec) = &pod.spec else {
        return Err(ReviewError::Malformed("the pod has no spec".into()));
    };
    let ask = match pods::gpu_ask(spec) {
        Ok(ask) if ask.count == 0 => return Ok(allow),
        Ok(ask) => ask,
        Err(why) => return Ok(deny(request, format!("gpuwarden: denied: {}", why.0))),
    };
    let Some(driver) = service.driver_named(substrate) else {
        return Err(ReviewError::Unavailable(format!(
            "there is no substrate named {substrate}"
        )));
    };
    let Some(kubernetes) = driver.kubernetes() else {
        return Err(ReviewError::Unavailable(format!(
            "substrate {substrate} is not a Kubernetes cluster"
        )));
    };
    let namespace = request
        .namespace
        .clone()
        .or_else(|| pod.metadata.namespace.clone())
        .unwrap_or_else(|| "default".into());
    let name = pod
        .metadata
        .name
        .clone()
        .unwrap_or_else(|| request.name.clone());
    let Some(uid) = pod.metadata.uid.clone().filter(|u| !u.is_empty()) else {
        return Err(ReviewError::Malformed(
            "the pod has no metadata.uid: gpuwarden must be called as a validating webhook \
             (ValidatingWebhookConfiguration), after the API server has completed the pod"
                .into(),
        ));
    };
    let gpu_pod = GpuPod {
        request,
        pod: &pod,
        spec,
        ask: &ask,
        namespace: &namespace,
        name: &name,
    };
    // A pod that Kueue starts for a Workload gpuwarden's admission check admitted carries that
    // Workload's lease (the check's podSetUpdates, see `kueue`): it runs under it, and is not a
    // second lease.
    let annotations = pod.metadata.annotations.as_ref();
    if let Some(lease_id) = annotations.and_then(|a| a.get(kueue::LEASE_ANNOTATION)) {
        if lease_id.starts_with(gpuwarden_schema::lease::KUEUE_LEASE_PREFIX) {
            return under_kueue_lease(service, substrate, &gpu_pod, lease_id);
        }
    }
    // The pod gpuwarden's own driver is creating for a lease admitted through the HTTP API:
    // answered from that lease, once.
    let labels = pod.metadata.labels.as_ref();
    if let Some(id) = labels.and_then(|l| l.get(crate::drivers::kubernetes::LEASE_LABEL)) {
        return Ok(claim(service, substrate, kubernetes, &gpu_pod, id).await);
    }
    let mut work = match read_pod(service, substrate, &*driver, kubernetes, &gpu_pod).await {
        Ok(work) => work,
        Err(answered) => return Ok(answered),
    };
    work.labels = BTreeMap::from([
        ("k8s_namespace".to_owned(), namespace.clone()),
        ("k8s_pod".to_owned(), name.clone()),
        ("k8s_pod_uid".to_owned(), uid.clone()),
    ]);
    let lease_id = lease_id(&uid);
    let asked = work.request(service.config());
    let principal = door::substrate_principal(service.config(), format!("kubernetes:{substrate}"));
    match door::admit(service, &principal, Grant::Named(&lease_id), asked.clone()).await {
        Ok(door::Answer::Admitted(admission)) => {
            let mut allow = allow;
            let line = door::admitted(&asked, &admission.decision, &lease_id);
            allow.warnings = Some(vec![line]);
            Ok(allow)
        }
        Ok(door::Answer::Denied { message, .. }) => Ok(deny(request, message)),
        Ok(door::Answer::Refused(e)) | Err(e) => admit_failed(request, substrate, e),
    }
}

/// Answers for a pod annotated with lease `lease_id` of a Kueue Workload: allowed, with a warning
/// naming the Workload, when that lease is open on this substrate, of the pod's namespace, and
/// holds at least the pod's GPUs; denied otherwise. Any pod of the namespace could name the
/// lease, but it is its own team's.
fn under_kueue_lease(
    service: &Service,
    substrate: &str,
    pod: &GpuPod<'_>,
    lease_id: &str,
) -> Result<AdmissionResponse, ReviewError> {
    let (namespace, ask) = (pod.namespace, pod.ask);
    let lease = service
        .open_lease(lease_id)
        .map_err(|e| ReviewError::Unavailable(e.to_string()))?
        .filter(|l| {
            l.substrate == substrate
                && l.labels.get("k8s_namespace").map(String::as_str) == Some(namespace)
                && u64::from(l.gpu_count) >= ask.count
        });
    let Some(lease) = lease else {
        return Ok(deny(
            pod.request,
            format!(
                "gpuwarden: denied: the pod names lease {lease_id} ({}), which is not an open \
                 lease of a Kueue Workload in namespace {namespace} holding {} GPUs",
                kueue::LEASE_ANNOTATION,
                ask.count
            ),
        ));
    };
    let mut allow = AdmissionResponse::from(pod.request);
    allow.warnings = Some(vec![format!(
        "gpuwarden: runs under lease {lease_id} of Kueue Workload {namespace}/{}",
        lease
            .labels
            .get("kueue_workload")
            .map_or("?", String::as_str)
    )]);
    Ok(allow)
}

/// Reads a GPU pod into what it asks admission for: its team (from its namespace), user (its
/// `user_label`, else the review's user through `users`), workload and project (its labels or
/// annotations), model (the one it pins, else the cluster's only one) and duration (its
/// `activeDeadlineSeconds`); its labels are the caller's to set. Otherwise the answer: a denial
/// of what the pod gets wrong, or a 503 refusal when the cluster's nodes cannot be read.
async fn read_pod(
    service: &Service,
    substrate: &str,
    driver: &dyn crate::drivers::Driver,
    kubernetes: &crate::drivers::KubernetesDriver,
    gpu_pod: &GpuPod<'_>,
) -> Result<door::WorkAsk, AdmissionResponse> {
    let GpuPod {
        request,
        pod,
        spec,
        ask,
        namespace,
        ..
    } = *gpu_pod;
    let settings = kubernetes.settings();
    let meta = |key: &str| -> Option<String> {
        pod.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(key))
            .or_else(|| pod.metadata.annotations.as_ref().and_then(|a| a.get(key)))
            .filter(|v| !v.is_empty())
            .cloned()
    };
    let Some(team) = team_of(settings, service.config(), namespace) else {
        return Err(deny(
            request,
            format!(
                "gpuwarden: denied: namespace {namespace:?} maps to no team (ask an administrator \
                 to add it to substrate {substrate}'s kubernetes.teams)"
            ),
        ));
    };
    let user = match meta(&settings.user_label) {
        Some(user) => user,
        None => {
            let username = request.user_info.username.clone().unwrap_or_default();
            settings.users.get(&username).cloned().unwrap_or(username)
        }
    };
    if let Err(why) = fields::check_name(&user) {
        return Err(deny(
            request,
            format!(
                "gpuwarden: denied: user {user:?} is not a name gpuwarden accepts: {why} (set the \
                 pod's {} label, or map the name in kubernetes.users)",
                settings.user_label
            ),
        ));
    }
    let (workload, project_from_workload) =
        match workload_of(meta(&settings.workload_label).as_deref(), settings) {
            Ok(found) => found,
            Err(why) => return Err(deny(request, format!("gpuwarden: denied: {why}"))),
        };
    let project = meta(&settings.project_label)
        .or(project_from_workload)
        .unwrap_or_else(|| namespace.to_owned());
    // Its model: the one it pins, else the cluster's only one.
    let inventory = match driver.inventory().await {
        Ok(inventory) => inventory,
        Err(e) => {
            tracing::error!(substrate = %substrate, error = %e, "cannot check GPU pods: the cluster's nodes cannot be read from the Kubernetes API; GPU pods are refused (503) until they can");
            return Err(unavailable(
                request,
                Unavailable::ApiUnreachable(&e.to_string()),
            ));
        }
    };
    let gpu_model = match model_of(spec, ask, settings, &inventory) {
        Ok(model) => model,
        Err(why) => return Err(deny(request, format!("gpuwarden: denied: {why}"))),
    };
    Ok(door::WorkAsk {
        substrate: substrate.to_owned(),
        team,
        user,
        project,
        workload,
        gpus: ask.count,
        gpu_model,
        asked: spec
            .active_deadline_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs),
        labels: BTreeMap::new(),
        dry_run: request.dry_run,
    })
}

/// Answers for a pod that names lease `id` in its `gpuwarden.io/lease` label: allowed only when
/// it is the pod the driver tracks for that open, granted lease of this substrate (same
/// namespace and name, not created yet), or a replica of the Deployment it tracks for it (same
/// namespace, named after it), and asks for no more GPUs than the lease holds.
async fn claim(
    service: &Service,
    substrate: &str,
    kubernetes: &crate::drivers::KubernetesDriver,
    pod: &GpuPod<'_>,
    id: &str,
) -> AdmissionResponse {
    let GpuPod {
        request,
        ask,
        namespace,
        name,
        ..
    } = *pod;
    // As every replica has committed it: the driver that created the pod wrote it down on
    // the lease on whichever replica it runs.
    let lease = match service.current_lease(id).await {
        Ok(Some(lease)) => lease,
        _ => {
            return deny(
                request,
                format!("gpuwarden: denied: the pod's gpuwarden.io/lease names {id:?}, which is no open lease"),
            )
        }
    };
    let tracked = kubernetes.pod_of(&lease);
    let ours = lease.substrate == substrate
        && ask.count <= u64::from(lease.gpu_count)
        && tracked.as_ref().is_some_and(|p| {
            p.namespace == namespace
                && if p.deployment {
                    // A replica of the lease's Deployment, made by its ReplicaSet.
                    name.starts_with(&format!("{}-", p.name))
                } else {
                    p.name == name
                        && p.uid.is_none()
                        && lease.state == crate::store::LeaseState::Granted
                }
        });
    if !ours {
        return deny(
            request,
            format!(
                "gpuwarden: denied: only gpuwarden creates the pod of lease {id} (the gpuwarden.io/lease label is reserved)"
            ),
        );
    }
    let mut allow = AdmissionResponse::from(request);
    allow.warnings = Some(vec![format!(
        "gpuwarden: the pod of lease {id}: {} x {} for team {}",
        lease.gpu_count, lease.gpu_model, lease.team
    )]);
    allow
}

/// The workload and project a `<workload>[:<project>]` label value names (`settings`'s default
/// workload when there is none), or why it names none, for the person who set it.
pub(crate) fn workload_of(
    text: Option<&str>,
    settings: &KubernetesSettings,
) -> Result<(Workload, Option<String>), String> {
    let Some(text) = text else {
        return Ok((settings.default_workload, None));
    };
    let (w, p) = match text.split_once(':') {
        Some((w, p)) => (w, Some(p.to_owned()).filter(|p| !p.is_empty())),
        None => (text, None),
    };
    match Workload::ALL.into_iter().find(|k| k.as_str() == w.trim()) {
        Some(w) => Ok((w, p)),
        None => Err(format!(
            "the {} {text:?} names no workload (training, inference, notebook or batch, \
             optionally with :<project>)",
            settings.workload_label
        )),
    }
}

/// The GPU model `spec` asking for `ask` runs on: the one its `nodeSelector` (or required node
/// affinity) pins by `model_label`, else the cluster's only model of that kind (whole GPUs, or
/// the MIG profile asked for). Why there is none, for the person who wrote the spec.
pub(crate) fn model_of(
    spec: &PodSpec,
    ask: &pods::GpuAsk,
    settings: &KubernetesSettings,
    inventory: &Inventory,
) -> Result<String, String> {
    let models: Vec<&String> = inventory
        .pooled
        .iter()
        .map(|(m, _)| m)
        .filter(|m| m.contains(" MIG ") == ask.mig_profile().is_some())
        .collect();
    let model = match pods::model_label_value(spec, &settings.model_label) {
        Some(value) => {
            let base = settings.model_of(&value);
            match ask.mig_profile() {
                Some(profile) => format!("{base} MIG {profile}"),
                None => base,
            }
        }
        None => {
            let fitting: Vec<&&String> = match ask.mig_profile() {
                Some(profile) => models
                    .iter()
                    .filter(|m| m.ends_with(&format!(" MIG {profile}")))
                    .collect(),
                None => models.iter().collect(),
            };
            match fitting.as_slice() {
                [one] => (**one).clone(),
                _ => {
                    return Err(format!(
                        "name a GPU model with nodeSelector {}: <model>; this cluster has {}",
                        settings.model_label,
                        if models.is_empty() {
                            "no GPUs".to_owned()
                        } else {
                            models
                                .iter()
                                .map(|m| m.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        }
                    ))
                }
            }
        }
    };
    if !inventory.pooled.iter().any(|(m, _)| *m == model) {
        return Err(format!("this cluster has no GPUs of model {model}"));
    }
    Ok(model)
}

/// The team of a namespace (see [`door::team_of`]).
pub(crate) fn team_of(
    settings: &KubernetesSettings,
    config: &gpuwarden_schema::config::Config,
    namespace: &str,
) -> Option<String> {
    door::team_of(&settings.teams, config, namespace)
}

/// The webhook's HTTP side for substrate `substrate`: `POST /validate` with an
/// `AdmissionReview`, answered with one (200), or 400 for a body that is not one, 413 over
/// [`MAX_REVIEW_BYTES`], 500 when the enforcer itself fails (its store); a pod it cannot decide
/// on for the cluster or the substrate is refused in a 200 answer with `status.code` 503. The
/// binary serves it over TLS on `webhook_listen`.
pub fn router(service: Service, substrate: String) -> axum::Router {
    use axum::extract::{DefaultBodyLimit, State};
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;

    async fn validate(
        State((service, substrate)): State<(Service, String)>,
        body: bytes::Bytes,
    ) -> axum::response::Response {
        match review(&service, &substrate, &body).await {
            Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
            Err(ReviewError::Malformed(why)) => {
                tracing::warn!(substrate = %substrate, error = %why, "refused an admission review");
                (StatusCode::BAD_REQUEST, format!("gpuwarden: {why}\n")).into_response()
            }
            Err(ReviewError::Unavailable(why)) => {
                tracing::error!(substrate = %substrate, error = %why, "could not decide an admission review");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("gpuwarden: {why}\n"),
                )
                    .into_response()
            }
        }
    }
    axum::Router::new()
        .route("/validate", axum::routing::post(validate))
        .layer(DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state((service, substrate))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> Review<DynamicObject> {
        let review: AdmissionReview<DynamicObject> = serde_json::from_value(serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "r-1",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "name": "train",
                "namespace": "ml",
                "operation": "CREATE",
                "userInfo": {"username": "ada"},
                "object": {"kind": "Pod", "apiVersion": "v1",
                    "metadata": {"name": "train", "namespace": "ml", "uid": "p-1"}},
                "dryRun": false
            }
        }))
        .unwrap();
        review.try_into().unwrap()
    }

    /// A substrate's failure, or a lease caught in a state it cannot take, is a 503 refusal
    /// saying what happened; what the request got wrong is a 403 denial; the enforcer's own
    /// failure (its store) is HTTP 500, for `failurePolicy`.
    #[test]
    fn an_admission_that_fails_is_answered_by_what_failed() {
        let request = request();
        for e in [
            ServiceError::Substrate("no driver runs substrate k8s".into()),
            ServiceError::Conflict("lease k8s-p-1 is releasing".into()),
        ] {
            let why = e.to_string();
            let answer = admit_failed(&request, "k8s", e).unwrap();
            assert!(!answer.allowed);
            assert_eq!(answer.result.code, 503);
            assert_eq!(answer.result.reason, "ServiceUnavailable");
            assert!(
                answer
                    .result
                    .message
                    .contains(&format!("could not record its GPU lease right now ({why})")),
                "{}",
                answer.result.message
            );
            assert!(answer.result.message.contains("not a policy decision"));
        }
        let answer = admit_failed(&request, "k8s", ServiceError::Forbidden("no".into())).unwrap();
        assert_eq!(answer.result.code, 403);
        assert!(matches!(
            admit_failed(
                &request,
                "k8s",
                ServiceError::Store(crate::store::StoreError::Io("disk full".into()))
            ),
            Err(ReviewError::Unavailable(why)) if why.contains("disk full")
        ));
        assert!(matches!(
            admit_failed(&request, "k8s", ServiceError::Bug("oops".into())),
            Err(ReviewError::Unavailable(_))
        ));
    }
}
