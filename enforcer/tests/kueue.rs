//! The Kueue admission check controller through kube-rs's own `Client` over a mocked API
//! transport (`tower_test::mock`, the pattern of kube-rs's client tests): each test serves
//! AdmissionCheck and Workload objects of `kueue.x-k8s.io/v1beta2` written as the API server
//! returns them (the fields of Kueue's `apis/kueue/v1beta2`), runs passes of the controller, and
//! checks every request it made (method, path, query, body) and the leases in the store. No API
//! server can be installed here; the substrate's driver reads its nodes from a small HTTP server
//! on 127.0.0.1 (a kubeconfig points at it), as the webhook's tests do.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::http::{header, Method, Request, Response, StatusCode};
use axum::routing::get;
use gpuwarden_enforcer::drivers::{self, Driver, DriverContext};
use gpuwarden_enforcer::kubernetes::kueue::{Controller, Pass};
use gpuwarden_enforcer::service::Service;
use gpuwarden_enforcer::store::{LeaseState, Store};
use gpuwarden_schema::{ManualClock, ReleaseReason};
use http_body_util::BodyExt as _;
use kube::client::Body;
use serde_json::{json, Value};
use tower_test::mock;

const GROUP: &str = "/apis/kueue.x-k8s.io/v1beta2";
const NOW: &str = "2026-12-05T06:00:00Z";
const H100: &str = "NVIDIA H100 80GB HBM3";

/// One request the controller made, and what was answered.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    method: Method,
    /// Path and query.
    uri: String,
    /// The JSON body (null when empty).
    body: Value,
}

/// The cluster as the mocked API server answers it.
#[derive(Debug, Default)]
struct Objects {
    checks: Vec<Value>,
    workloads: Vec<Value>,
}

/// A store, a service with the `k8s` substrate's real driver, and the mocked API transport of
/// the controller's client.
struct Cluster {
    service: Service,
    controller: Controller,
    handle: mock::Handle<Request<Body>, Response<Body>>,
    clock: Arc<ManualClock>,
    _dir: tempfile::TempDir,
}

fn epoch_ms(text: &str) -> i64 {
    humantime::parse_rfc3339(text)
        .unwrap()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Two H100 nodes of 8 and one A100 node of 8, as `GET /api/v1/nodes` answers.
fn nodes() -> Value {
    let node = |name: &str, product: &str| {
        json!({
            "metadata": {"name": name, "uid": format!("uid-{name}"), "resourceVersion": "100",
                "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": product}},
            "spec": {},
            "status": {"allocatable": {"cpu": "95500m", "memory": "1048Gi", "nvidia.com/gpu": "8", "pods": "110"}}
        })
    };
    json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "100"}, "items": [
        node("h100-0", "NVIDIA-H100-80GB-HBM3"),
        node("h100-1", "NVIDIA-H100-80GB-HBM3"),
        node("a100-0", "NVIDIA-A100-SXM4-80GB"),
    ]})
}

/// Serves the nodes on 127.0.0.1; returns its URL.
async fn node_server() -> String {
    let app = axum::Router::new().route("/api/v1/nodes", get(|| async { axum::Json(nodes()) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// Teams: `ml` (namespace `ml-research`, quota 16), `vision` (A100 only), `lean` ($1 a month).
fn config(dir: &Path, api: &str) -> gpuwarden_schema::config::Config {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {api}\n\
             users:\n- name: gpuwarden\n  user:\n    token: test-token\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: gpuwarden\n\
             current-context: test\n"
        ),
    )
    .unwrap();
    let text = format!(
        r#"[storage]
data_dir = "{data}"

[pricing]
default_usd_per_gpu_hour = 2.0

[[teams]]
name = "ml"
members = ["ada", "bob"]
gpu_quota = 16
monthly_budget_usd = 10000.0

[[teams]]
name = "vision"
members = ["eve"]
gpu_quota = 16
monthly_budget_usd = 10000.0
allowed_models = ["NVIDIA A100 SXM4 80GB"]

[[teams]]
name = "lean"
members = ["lee"]
gpu_quota = 16
monthly_budget_usd = 1.0

[workloads.training]
max_gpus = 64
max_duration = "72h"

[workloads.inference]
max_gpus = 64
max_duration = "24h"

[[substrates]]
name = "k8s"
driver = "kubernetes"

[substrates.kubernetes]
kubeconfig = "{kubeconfig}"
webhook_listen = "127.0.0.1:0"
webhook_tls = {{ cert = "{dir}/webhook.pem", key = "{dir}/webhook.key" }}
teams = {{ "ml-research" = "ml" }}

[substrates.kubernetes.kueue]
controller_name = "gpuwarden.io/budget"
"#,
        data = dir.join("data").display(),
        kubeconfig = kubeconfig.display(),
        dir = dir.display(),
    );
    gpuwarden_schema::config::parse("gpuwarden.toml", &text).unwrap()
}

impl Cluster {
    async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = config(dir.path(), &node_server().await);
        let store = Store::open(&dir.path().join("enforcer.db")).unwrap();
        let context = DriverContext {
            state_dir: dir.path().join("drivers").join("k8s"),
            lease_refs: Some(gpuwarden_enforcer::service::lease_refs(store.clone())),
        };
        let driver: Arc<dyn Driver> =
            Arc::from(drivers::build(&config.substrates[0], &context).unwrap());
        let clock = Arc::new(ManualClock::new(epoch_ms(NOW)));
        let service = Service::new(
            Arc::new(config),
            store,
            BTreeMap::from([("k8s".to_owned(), driver)]),
            clock.clone(),
        );
        let (transport, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(transport, "default");
        let controller = Controller::new(service.clone(), "k8s", client).unwrap();
        Self {
            service,
            controller,
            handle,
            clock,
            _dir: dir,
        }
    }

    /// Runs one pass of the controller, answering its requests from `objects` (a PATCH is
    /// answered with the object as it was, which the controller does not read), and returns
    /// what it changed and every request it made.
    async fn pass(&mut self, objects: &Objects) -> (Pass, Vec<Seen>) {
        let mut seen = Vec::new();
        let pass = self.controller.pass();
        tokio::pin!(pass);
        loop {
            tokio::select! {
                result = &mut pass => return (result.unwrap(), seen),
                next = self.handle.next_request() => {
                    let (request, send) = next.expect("the controller's client is open");
                    let method = request.method().clone();
                    let uri = request.uri().to_string();
                    if method == Method::PATCH {
                        assert_eq!(
                            request.headers()[header::CONTENT_TYPE],
                            "application/merge-patch+json",
                            "{uri}"
                        );
                    }
                    let bytes = request.into_body().collect().await.unwrap().to_bytes();
                    let body = if bytes.is_empty() {
                        Value::Null
                    } else {
                        serde_json::from_slice(&bytes).unwrap()
                    };
                    let reply = answer(objects, &method, &uri);
                    send.send_response(
                        Response::builder()
                            .status(StatusCode::OK)
                            .header(header::CONTENT_TYPE, "application/json")
                            .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                            .unwrap(),
                    );
                    seen.push(Seen { method, uri, body });
                }
            }
        }
    }
}

fn answer(objects: &Objects, method: &Method, uri: &str) -> Value {
    let path = uri.split('?').next().unwrap();
    let list = |kind: &str, items: &[Value]| {
        json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": kind,
            "metadata": {"resourceVersion": "5000"}, "items": items})
    };
    match (method.as_str(), path) {
        ("GET", p) if p == format!("{GROUP}/admissionchecks") => {
            list("AdmissionCheckList", &objects.checks)
        }
        ("GET", p) if p == format!("{GROUP}/workloads") => list("WorkloadList", &objects.workloads),
        ("PATCH", p) => {
            let name = p.trim_end_matches("/status").rsplit('/').next().unwrap();
            objects
                .checks
                .iter()
                .chain(&objects.workloads)
                .find(|o| o["metadata"]["name"] == name)
                .cloned()
                .unwrap_or_else(|| panic!("PATCH of an object not served: {uri}"))
        }
        _ => panic!("unexpected request {method} {uri}"),
    }
}

/// Ours (`gpuwarden-budget`, controller `gpuwarden.io/budget`) at `generation`, with `status`;
/// and the cluster's provisioning check, which is Kueue's.
fn checks(generation: i64, status: Value) -> Vec<Value> {
    vec![
        json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "AdmissionCheck",
            "metadata": {"name": "gpuwarden-budget", "uid": "0c5b7a1e-3f41-4a8e-9d62-7b8e1f0a2c3d",
                "resourceVersion": "812", "generation": generation,
                "creationTimestamp": "2026-12-01T09:00:00Z"},
            "spec": {"controllerName": "gpuwarden.io/budget"},
            "status": status,
        }),
        json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "AdmissionCheck",
            "metadata": {"name": "dws-prov", "uid": "9e2d4c6b-1a3f-4b5e-8c7d-6f0e1a2b3c4d",
                "resourceVersion": "640", "generation": 1},
            "spec": {"controllerName": "kueue.x-k8s.io/provisioning-request",
                "parameters": {"apiGroup": "kueue.x-k8s.io", "kind": "ProvisioningRequestConfig", "name": "dws-config"}},
            "status": {"conditions": [{"type": "Active", "status": "True", "reason": "Active",
                "message": "The admission check is active", "observedGeneration": 1,
                "lastTransitionTime": "2026-12-01T09:00:01Z"}]},
        }),
    ]
}

fn active_checks() -> Vec<Value> {
    checks(
        1,
        json!({"conditions": [{"type": "Active", "status": "True", "reason": "Active",
            "message": "gpuwarden admits the Workloads of this check by team quota, budget and policy",
            "observedGeneration": 1, "lastTransitionTime": "2026-12-01T09:00:05Z"}]}),
    )
}

/// A Workload for a batch Job as Kueue creates it, in `namespace`, whose pod set `main` runs
/// `count` pods of `gpus` GPUs each, pinned to `product` (a node label value) if given, labelled
/// with user `user` and workload `training`; quota reserved in ClusterQueue `gpu-cluster`, our
/// check `Pending` and the provisioning check `Ready`.
fn workload(
    namespace: &str,
    name: &str,
    uid: &str,
    user: Option<&str>,
    count: i64,
    gpus: u32,
    product: Option<&str>,
) -> Value {
    let mut labels =
        json!({"gpuwarden.io/workload": "training", "batch.kubernetes.io/job-name": name});
    if let Some(user) = user {
        labels["gpuwarden.io/user"] = json!(user);
    }
    let mut spec = json!({
        "restartPolicy": "Never",
        "containers": [{"name": "trainer", "image": "registry.example.com/ml/trainer:2.4",
            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string(), "memory": "64Gi"},
                "requests": {"nvidia.com/gpu": gpus.to_string(), "cpu": "8", "memory": "64Gi"}}}],
    });
    if let Some(product) = product {
        spec["nodeSelector"] = json!({"nvidia.com/gpu.product": product});
    }
    json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {
            "name": format!("job-{name}-5d2c1"), "namespace": namespace, "uid": uid,
            "resourceVersion": "4211", "generation": 1,
            "creationTimestamp": "2026-12-05T05:59:40Z",
            "labels": {"kueue.x-k8s.io/job-uid": "a9f3e2d1-7c6b-4a5e-8f9d-0e1c2b3a4d5f"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                "uid": "a9f3e2d1-7c6b-4a5e-8f9d-0e1c2b3a4d5f", "controller": true, "blockOwnerDeletion": true}],
            "finalizers": ["kueue.x-k8s.io/resource-in-use"],
        },
        "spec": {
            "active": true,
            "queueName": "team-queue",
            "priority": 0,
            "podSets": [{"name": "main", "count": count,
                "template": {"metadata": {"labels": labels}, "spec": spec}}],
        },
        "status": {
            "conditions": [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
                "message": "Quota reserved in ClusterQueue gpu-cluster", "observedGeneration": 1,
                "lastTransitionTime": "2026-12-05T05:59:41Z"}],
            "admission": {"clusterQueue": "gpu-cluster", "podSetAssignments": [{"name": "main",
                "flavors": {"cpu": "default", "memory": "default", "nvidia.com/gpu": "gpu-nodes"},
                "resourceUsage": {"cpu": (8 * count).to_string(), "memory": format!("{}Gi", 64 * count),
                    "nvidia.com/gpu": (i64::from(gpus) * count).to_string()},
                "count": count}]},
            "admissionChecks": [
                {"name": "dws-prov", "state": "Ready", "message": "Provisioned",
                    "lastTransitionTime": "2026-12-05T05:59:45Z",
                    "podSetUpdates": [{"name": "main", "annotations": {"cluster-autoscaler.kubernetes.io/consume-provisioning-request": "job-prov-1"}}]},
                {"name": "gpuwarden-budget", "state": "Pending", "message": "",
                    "lastTransitionTime": "2026-12-05T05:59:41Z"},
            ],
        },
    })
}

/// The Workload as the API server holds it after the controller's `patch` (a merge patch of
/// `status.admissionChecks`).
fn patched(workload: &Value, patch: &Value) -> Value {
    let mut workload = workload.clone();
    workload["status"]["admissionChecks"] = patch["status"]["admissionChecks"].clone();
    workload["metadata"]["resourceVersion"] = json!("4300");
    workload
}

fn add_condition(workload: &mut Value, kind: &str) {
    workload["status"]["conditions"]
        .as_array_mut()
        .unwrap()
        .push(
            json!({"type": kind, "status": "True", "reason": kind, "message": "",
            "observedGeneration": 1, "lastTransitionTime": "2026-12-05T06:00:30Z"}),
        );
}

fn lists() -> Vec<Seen> {
    vec![
        Seen {
            method: Method::GET,
            uri: format!("{GROUP}/admissionchecks?"),
            body: Value::Null,
        },
        Seen {
            method: Method::GET,
            uri: format!("{GROUP}/workloads?"),
            body: Value::Null,
        },
    ]
}

/// The merge patch of a Workload read at `resource_version` whose checks become `checks`.
fn workload_patch(workload: &Value, ours: Value) -> Seen {
    let ns = workload["metadata"]["namespace"].as_str().unwrap();
    let name = workload["metadata"]["name"].as_str().unwrap();
    let mut checks = workload["status"]["admissionChecks"]
        .as_array()
        .unwrap()
        .clone();
    checks[1] = ours;
    Seen {
        method: Method::PATCH,
        uri: format!("{GROUP}/namespaces/{ns}/workloads/{name}/status?&fieldManager=gpuwarden"),
        body: json!({
            "metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]},
            "status": {"admissionChecks": checks},
        }),
    }
}

#[tokio::test]
async fn keeps_its_admission_check_active_and_leaves_the_others_alone() {
    let mut cluster = Cluster::new().await;
    let objects = Objects {
        checks: checks(1, json!({})),
        workloads: Vec::new(),
    };
    let (pass, seen) = cluster.pass(&objects).await;
    let active = |generation: i64, since: &str| Seen {
        method: Method::PATCH,
        uri: format!("{GROUP}/admissionchecks/gpuwarden-budget/status?&fieldManager=gpuwarden"),
        body: json!({"status": {"conditions": [{"type": "Active", "status": "True", "reason": "Active",
            "message": "gpuwarden admits the Workloads of this check by team quota, budget and policy",
            "observedGeneration": generation, "lastTransitionTime": since}]}}),
    };
    let mut expected = lists();
    expected.insert(1, active(1, NOW));
    assert_eq!(seen, expected);
    assert_eq!(pass.activated, 1);

    // Active for its generation: nothing to write.
    let (pass, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: Vec::new(),
        })
        .await;
    assert_eq!(seen, lists());
    assert_eq!(pass, Pass::default());

    // Its spec changed (generation 2): Active again for it, since the time it became Active.
    let mut changed = active_checks();
    changed[0]["metadata"]["generation"] = json!(2);
    let (_, seen) = cluster
        .pass(&Objects {
            checks: changed,
            workloads: Vec::new(),
        })
        .await;
    let mut expected = lists();
    expected.insert(1, active(2, "2026-12-01T09:00:05Z"));
    assert_eq!(seen, expected);
}

const UID: &str = "3b1f7e2a-9c4d-4e8f-a1b2-c3d4e5f60718";

#[tokio::test]
async fn a_pending_workload_within_quota_becomes_ready_with_a_lease_released_when_it_finishes() {
    let mut cluster = Cluster::new().await;
    let pending = workload(
        "ml-research",
        "train",
        UID,
        Some("ada"),
        2,
        2,
        Some("NVIDIA-H100-80GB-HBM3"),
    );
    let (pass, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![pending.clone()],
        })
        .await;
    let lease_id = format!("kueue-{UID}");
    let mut expected = lists();
    expected.push(workload_patch(
        &pending,
        json!({"name": "gpuwarden-budget", "state": "Ready",
            "message": format!("gpuwarden: admitted for team ml as training: 4 x {H100}, about $8.00/h, lease {lease_id}, ends after 3days"),
            "lastTransitionTime": NOW,
            "podSetUpdates": [{"name": "main", "annotations": {"gpuwarden.io/lease": lease_id}}]}),
    ));
    assert_eq!(seen, expected);
    assert_eq!(pass.written, BTreeMap::from([("Ready", 1)]));

    let lease = cluster
        .service
        .store()
        .open_lease(&lease_id)
        .unwrap()
        .expect("an open lease");
    assert_eq!(
        (
            lease.team.as_str(),
            lease.user.as_str(),
            lease.project.as_str(),
            lease.substrate.as_str()
        ),
        ("ml", "ada", "ml-research", "k8s")
    );
    assert_eq!(
        (lease.gpu_count, lease.gpu_model.as_str(), lease.state),
        (4, H100, LeaseState::Granted)
    );
    assert_eq!(lease.labels["kueue_workload"], "job-train-5d2c1");
    assert_eq!(lease.labels["kueue_workload_uid"], UID);
    assert_eq!(lease.labels["kueue_queue"], "team-queue");
    assert_eq!(lease.expires_at, Some(epoch_ms(NOW) + 72 * 3600 * 1000));

    // Kueue admits it and starts its pods: nothing more to write, the lease stays.
    let mut ready = patched(&pending, &seen[2].body);
    add_condition(&mut ready, "Admitted");
    let (pass, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![ready.clone()],
        })
        .await;
    assert_eq!(seen, lists());
    assert_eq!(pass, Pass::default());
    assert!(cluster
        .service
        .store()
        .open_lease(&lease_id)
        .unwrap()
        .is_some());

    // It finishes: its lease is released, its check left as it is.
    cluster.clock.advance(Duration::from_secs(3600));
    let mut finished = ready;
    add_condition(&mut finished, "Finished");
    let (pass, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![finished],
        })
        .await;
    assert_eq!(seen, lists());
    assert_eq!(pass.released, 1);
    let lease = cluster
        .service
        .store()
        .lease(&lease_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lease.state, LeaseState::Released);
    assert_eq!(lease.release_reason, Some(ReleaseReason::User));
}

#[tokio::test]
async fn over_budget_is_retried_and_policy_denials_are_rejected() {
    let mut cluster = Cluster::new().await;
    // `lean` has $1 a month: 1 H100 for up to 72 h is over it. Retry: a new month, or a raised
    // budget, admits it unchanged.
    let lean = workload(
        "lean",
        "sweep",
        "11111111-2222-4333-8444-555555555555",
        Some("lee"),
        1,
        1,
        Some("NVIDIA-H100-80GB-HBM3"),
    );
    // `vision` may use A100s only.
    let vision = workload(
        "vision",
        "detect",
        "22222222-3333-4444-8555-666666666666",
        Some("eve"),
        2,
        4,
        Some("NVIDIA-H100-80GB-HBM3"),
    );
    // A Workload that names no user.
    let anonymous = workload(
        "ml-research",
        "anon",
        "33333333-4444-4555-8666-777777777777",
        None,
        1,
        1,
        Some("NVIDIA-H100-80GB-HBM3"),
    );
    let (pass, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![lean.clone(), vision.clone(), anonymous.clone()],
        })
        .await;
    assert_eq!(seen.len(), 5, "{seen:#?}");
    assert_eq!(seen[..2], lists()[..]);
    let check = |seen: &Seen| seen.body["status"]["admissionChecks"][1].clone();
    let expect = |workload: &Value, state: &str, message: &str| {
        workload_patch(
            workload,
            json!({"name": "gpuwarden-budget", "state": state, "message": message, "lastTransitionTime": NOW}),
        )
    };
    let lean_message = check(&seen[2])["message"].as_str().unwrap().to_owned();
    assert!(
        lean_message.starts_with(
            "gpuwarden: denied 1 x NVIDIA H100 80GB HBM3 for team lean: budget_exceeded: "
        ),
        "{lean_message}"
    );
    assert_eq!(seen[2], expect(&lean, "Retry", &lean_message));
    let vision_message = check(&seen[3])["message"].as_str().unwrap().to_owned();
    assert!(
        vision_message.contains("model_not_allowed: "),
        "{vision_message}"
    );
    assert!(
        !vision_message.contains("budget_exceeded"),
        "{vision_message}"
    );
    assert_eq!(seen[3], expect(&vision, "Rejected", &vision_message));
    assert_eq!(
        seen[4],
        expect(&anonymous, "Rejected", "gpuwarden: rejected: the Workload names no user: set the gpuwarden.io/user label on the job's pod template (a Workload does not say who created it)")
    );
    assert_eq!(
        pass.written,
        BTreeMap::from([("Rejected", 2), ("Retry", 1)])
    );
    assert!(cluster.service.store().open_leases().unwrap().is_empty());
}

#[tokio::test]
async fn a_team_blocked_later_moves_its_ready_workloads_back_to_retry() {
    let mut cluster = Cluster::new().await;
    let waiting = workload(
        "ml-research",
        "train",
        UID,
        Some("ada"),
        1,
        4,
        Some("NVIDIA-H100-80GB-HBM3"),
    );
    let running_uid = "44444444-5555-4666-8777-888888888888";
    let running = workload(
        "ml-research",
        "serve",
        running_uid,
        Some("bob"),
        1,
        2,
        Some("NVIDIA-H100-80GB-HBM3"),
    );
    let (pass, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![waiting.clone(), running.clone()],
        })
        .await;
    assert_eq!(pass.written, BTreeMap::from([("Ready", 2)]));
    let waiting = patched(&waiting, &seen[2].body);
    let mut running = patched(&running, &seen[3].body);
    add_condition(&mut running, "Admitted");
    let (waiting_lease, running_lease) = (format!("kueue-{UID}"), format!("kueue-{running_uid}"));
    assert_eq!(cluster.service.store().open_leases().unwrap().len(), 2);

    // The team goes over its budget: the rules block it.
    cluster.clock.advance(Duration::from_secs(60));
    cluster
        .service
        .block_team("ml", "budget_exceeded")
        .await
        .unwrap();
    let (pass, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![waiting.clone(), running.clone()],
        })
        .await;
    let message = format!(
        "gpuwarden: team ml is blocked (over its monthly budget, or by an administrator): the \
         Workload waits in its queue until the block is lifted; lease {waiting_lease} released"
    );
    let mut expected = lists();
    expected.push(workload_patch(
        &waiting,
        json!({"name": "gpuwarden-budget", "state": "Retry", "message": message,
            "lastTransitionTime": "2026-12-05T06:01:00Z"}),
    ));
    // Only the Workload whose pods have not started; the admitted one keeps its lease.
    assert_eq!(seen, expected);
    assert_eq!(
        (pass.released, pass.written.clone()),
        (1, BTreeMap::from([("Retry", 1)]))
    );
    let lease = cluster
        .service
        .store()
        .lease(&waiting_lease)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (lease.state, lease.release_reason),
        (LeaseState::Released, Some(ReleaseReason::Budget))
    );
    assert!(cluster
        .service
        .store()
        .open_lease(&running_lease)
        .unwrap()
        .is_some());

    // Kueue evicts it, gives its quota back and queues it again (our check Pending again):
    // while the block lasts it is retried, without a lease.
    let mut requeued = waiting.clone();
    requeued["status"]["admissionChecks"][1] = json!({"name": "gpuwarden-budget", "state": "Pending",
        "message": "", "lastTransitionTime": "2026-12-05T06:01:10Z"});
    let (_, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![requeued.clone(), running.clone()],
        })
        .await;
    let retried = seen[2].body["status"]["admissionChecks"][1].clone();
    assert_eq!(retried["state"], "Retry", "{seen:#?}");
    assert!(
        retried["message"]
            .as_str()
            .unwrap()
            .contains("team_blocked: "),
        "{retried}"
    );

    // Unblocked, it is admitted again under its second lease id.
    cluster.service.unblock_team("ml").await.unwrap();
    let (_, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![requeued, running],
        })
        .await;
    let ready = seen[2].body["status"]["admissionChecks"][1].clone();
    let second = format!("kueue-{UID}-2");
    assert_eq!(ready["state"], "Ready", "{seen:#?}");
    assert_eq!(
        ready["podSetUpdates"][0]["annotations"]["gpuwarden.io/lease"],
        json!(second)
    );
    assert!(cluster
        .service
        .store()
        .open_lease(&second)
        .unwrap()
        .is_some());

    // The running one is deleted (its Job removed): its lease is released.
    let (pass, _) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: Vec::new(),
        })
        .await;
    assert_eq!(pass.released, 2);
    assert!(cluster.service.store().open_leases().unwrap().is_empty());
}

#[tokio::test]
async fn a_ready_workload_whose_lease_gpuwarden_ended_is_sent_back_and_a_model_must_be_named() {
    let mut cluster = Cluster::new().await;
    let pending = workload("ml-research", "train", UID, Some("ada"), 1, 2, None);
    let (_, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![pending.clone()],
        })
        .await;
    // A pod template that names no model, in a cluster of two: rejected, saying how to name one.
    let rejected = seen[2].body["status"]["admissionChecks"][1].clone();
    assert_eq!(rejected["state"], "Rejected", "{rejected}");
    assert!(
        rejected["message"].as_str().unwrap().contains(
            "pod set \"main\": name a GPU model with nodeSelector nvidia.com/gpu.product: <model>"
        ),
        "{rejected}"
    );

    let pending = workload(
        "ml-research",
        "train",
        UID,
        Some("ada"),
        1,
        2,
        Some("NVIDIA-H100-80GB-HBM3"),
    );
    let (_, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![pending.clone()],
        })
        .await;
    let mut ready = patched(&pending, &seen[2].body);
    add_condition(&mut ready, "Admitted");
    let lease_id = format!("kueue-{UID}");
    // An administrator (or the idle rule) ends the lease.
    cluster
        .service
        .release(&lease_id, ReleaseReason::Idle)
        .await
        .unwrap();
    let (_, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![ready.clone()],
        })
        .await;
    let mut expected = lists();
    expected.push(workload_patch(
        &ready,
        json!({"name": "gpuwarden-budget", "state": "Retry",
            "message": format!("gpuwarden: lease {lease_id} of team ml ended (idle): the Workload is evicted and waits in its queue to be admitted again"),
            "lastTransitionTime": NOW}),
    ));
    assert_eq!(seen, expected);
}

/// The validating webhook's review of pod `name` that Kueue's Job controller creates for
/// Workload pod set `main`, with `annotations` (what the admission check's podSetUpdates add).
fn pod_review(name: &str, gpus: u32, annotations: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "7d3c2b1a-0f9e-4d8c-b7a6-958473625140",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": name,
            "namespace": "ml-research",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller",
                "uid": "u-jc", "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": {
                "kind": "Pod", "apiVersion": "v1",
                "metadata": {"name": name, "namespace": "ml-research",
                    "uid": "5e4d3c2b-1a09-4f8e-9d7c-6b5a49382716",
                    "labels": {"batch.kubernetes.io/job-name": "train", "gpuwarden.io/user": "ada",
                        "kueue.x-k8s.io/podset": "main"},
                    "annotations": annotations,
                    "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "train",
                        "uid": "a9f3e2d1-7c6b-4a5e-8f9d-0e1c2b3a4d5f", "controller": true, "blockOwnerDeletion": true}]},
                "spec": {"restartPolicy": "Never",
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                    "containers": [{"name": "trainer", "image": "registry.example.com/ml/trainer:2.4",
                        "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]},
                "status": {"phase": "Pending", "qosClass": "BestEffort"}
            },
            "oldObject": null,
            "dryRun": false,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
        }
    }))
    .unwrap()
}

#[tokio::test]
async fn the_webhook_lets_the_pods_of_an_admitted_workload_run_under_its_lease() {
    let mut cluster = Cluster::new().await;
    let pending = workload(
        "ml-research",
        "train",
        UID,
        Some("ada"),
        2,
        2,
        Some("NVIDIA-H100-80GB-HBM3"),
    );
    let (_, seen) = cluster
        .pass(&Objects {
            checks: active_checks(),
            workloads: vec![pending],
        })
        .await;
    let lease_id = format!("kueue-{UID}");
    let updates = &seen[2].body["status"]["admissionChecks"][1]["podSetUpdates"][0];
    let review = |body: Vec<u8>| {
        let service = cluster.service.clone();
        async move {
            let answer = gpuwarden_enforcer::kubernetes::review(&service, "k8s", &body)
                .await
                .unwrap();
            serde_json::from_slice::<Value>(&answer).unwrap()["response"].clone()
        }
    };
    // A pod of it, with the annotation Kueue copied from the check: allowed, no second lease.
    let answer = review(pod_review(
        "train-0-x7k2p",
        2,
        updates["annotations"].clone(),
    ))
    .await;
    assert_eq!(answer["allowed"], true, "{answer}");
    assert_eq!(
        answer["warnings"],
        json!([format!(
            "gpuwarden: runs under lease {lease_id} of Kueue Workload ml-research/job-train-5d2c1"
        )])
    );
    let open = cluster.service.store().open_leases().unwrap();
    assert_eq!(
        open.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(),
        [lease_id.as_str()]
    );

    // A pod naming it that asks for more GPUs than it holds, or naming a lease that is not
    // open: denied.
    for (gpus, named) in [(8, lease_id.clone()), (2, format!("kueue-{UID}-7"))] {
        let answer = review(pod_review(
            "train-0-x7k2p",
            gpus,
            json!({"gpuwarden.io/lease": named}),
        ))
        .await;
        assert_eq!(answer["allowed"], false, "{answer}");
        let message = answer["status"]["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!(
                "gpuwarden: denied: the pod names lease {named} (gpuwarden.io/lease)"
            )),
            "{message}"
        );
    }
}
