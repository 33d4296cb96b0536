//! A small stand-in for a Kubernetes API server, for the tests of the Kubernetes substrate (no
//! API server can be installed on these machines): real HTTP on 127.0.0.1, serving the paths,
//! objects and errors the API server serves for what gpuwarden uses — nodes (list), pods (list,
//! watch, get, create, delete with preconditions) — with resourceVersions, `Status` errors and
//! watch events as the API server writes them, and a record of every request. A test plays the
//! rest of the cluster: it stores pods as the API server would after admission, moves their
//! phase as the kubelet would, and deletes them; it may also be the validating webhook that a
//! pod created through this server is sent to before it is stored
//! ([`KubeApi::validate_pods_with`]).

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{json, Value};

/// One request the fake API server answered.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: String,
    pub body: String,
}

/// A validating admission webhook as the fake calls it: the pod being created (uid set, not
/// stored yet); Ok lets it be stored, Err is the webhook's refusal.
pub type Validate =
    Arc<dyn Fn(Value) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

#[derive(Default)]
struct Cluster {
    /// Asked about every pod created through the API before it is stored.
    validate: Option<Validate>,
    nodes: Vec<Value>,
    pods: BTreeMap<(String, String), Value>,
    deployments: BTreeMap<(String, String), Value>,
    /// A PodDisruptionBudget forbids evictions (429) while set.
    evictions_blocked: bool,
    resource_version: u64,
    /// Every watch event so far, with its resourceVersion, for watches that start behind.
    events: Vec<(u64, Value)>,
    watchers: Vec<tokio::sync::mpsc::UnboundedSender<Value>>,
    seen: Vec<Seen>,
}

impl Cluster {
    fn bump(&mut self) -> u64 {
        self.resource_version += 1;
        self.resource_version
    }

    fn emit(&mut self, kind: &str, mut object: Value) {
        let rv = self.bump();
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let event = json!({"type": kind, "object": object});
        self.events.push((rv, event.clone()));
        self.watchers.retain(|w| w.send(event.clone()).is_ok());
    }
}

/// The fake API server; its thread and runtime live as long as the test process.
#[derive(Clone)]
pub struct KubeApi {
    pub url: String,
    cluster: Arc<Mutex<Cluster>>,
}

/// A `Status` error as the API server writes one.
fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16()});
    (code, axum::Json(body)).into_response()
}

type Shared = Arc<Mutex<Cluster>>;

fn record(cluster: &Shared, method: &str, path: String, query: Option<String>, body: &[u8]) {
    cluster.lock().unwrap().seen.push(Seen {
        method: method.into(),
        path,
        query: query.unwrap_or_default(),
        body: String::from_utf8_lossy(body).into_owned(),
    });
}

async fn list_nodes(State(c): State<Shared>, RawQuery(q): RawQuery) -> Response {
    record(&c, "GET", "/api/v1/nodes".into(), q, b"");
    let c = c.lock().unwrap();
    axum::Json(json!({"apiVersion": "v1", "kind": "NodeList",
        "metadata": {"resourceVersion": c.resource_version.to_string()}, "items": c.nodes}))
    .into_response()
}

async fn list_pods(State(c): State<Shared>, RawQuery(q): RawQuery) -> Response {
    record(&c, "GET", "/api/v1/pods".into(), q.clone(), b"");
    let query = q.unwrap_or_default();
    let param = |name: &str| {
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .map(str::to_owned)
    };
    if matches!(param("watch").as_deref(), Some("true" | "1")) {
        let from: u64 = param("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        {
            let mut c = c.lock().unwrap();
            for (rv, event) in &c.events {
                if *rv > from {
                    let _ = tx.send(event.clone());
                }
            }
            c.watchers.push(tx);
        }
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            let event = rx.recv().await?;
            let mut line = serde_json::to_vec(&event).unwrap();
            line.push(b'\n');
            Some((Ok::<_, std::convert::Infallible>(Bytes::from(line)), rx))
        });
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    let c = c.lock().unwrap();
    let items: Vec<Value> = c.pods.values().cloned().collect();
    axum::Json(json!({"apiVersion": "v1", "kind": "PodList",
        "metadata": {"resourceVersion": c.resource_version.to_string()}, "items": items}))
    .into_response()
}

async fn get_pod(State(c): State<Shared>, Path((ns, name)): Path<(String, String)>) -> Response {
    record(
        &c,
        "GET",
        format!("/api/v1/namespaces/{ns}/pods/{name}"),
        None,
        b"",
    );
    let c = c.lock().unwrap();
    match c.pods.get(&(ns, name.clone())) {
        Some(pod) => axum::Json(pod.clone()).into_response(),
        None => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("pods \"{name}\" not found"),
        ),
    }
}

async fn create_pod(
    State(shared): State<Shared>,
    Path(ns): Path<String>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Response {
    record(
        &shared,
        "POST",
        format!("/api/v1/namespaces/{ns}/pods"),
        q,
        &body,
    );
    let mut pod: Value = match serde_json::from_slice(&body) {
        Ok(pod) => pod,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", e.to_string()),
    };
    let name = pod["metadata"]["name"].as_str().unwrap_or("").to_owned();
    let exists = |name: &str| {
        status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("pods \"{name}\" already exists"),
        )
    };
    let validate = {
        let c = shared.lock().unwrap();
        if c.pods.contains_key(&(ns.clone(), name.clone())) {
            return exists(&name);
        }
        c.validate.clone()
    };
    pod["metadata"]["namespace"] = json!(ns);
    pod["metadata"]["uid"] = json!(uuid::Uuid::new_v4().to_string());
    pod["metadata"]["creationTimestamp"] = json!("2026-12-05T06:00:00Z");
    pod["status"] = json!({"phase": "Pending", "qosClass": "BestEffort"});
    // The API server calls its validating webhooks before it stores the pod (and answers the
    // creator only then).
    if let Some(validate) = validate {
        if let Err(message) = validate(pod.clone()).await {
            return status(
                StatusCode::FORBIDDEN,
                "Forbidden",
                format!("admission webhook \"gpuwarden.io\" denied the request: {message}"),
            );
        }
    }
    let mut c = shared.lock().unwrap();
    if c.pods.contains_key(&(ns.clone(), name.clone())) {
        return exists(&name);
    }
    let rv = c.resource_version + 1;
    pod["metadata"]["resourceVersion"] = json!(rv.to_string());
    c.pods.insert((ns, name), pod.clone());
    c.emit("ADDED", pod.clone());
    (StatusCode::CREATED, axum::Json(pod)).into_response()
}

async fn delete_pod(
    State(c): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Response {
    record(
        &c,
        "DELETE",
        format!("/api/v1/namespaces/{ns}/pods/{name}"),
        q,
        &body,
    );
    let options: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut c = c.lock().unwrap();
    let key = (ns, name.clone());
    let Some(pod) = c.pods.get(&key).cloned() else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("pods \"{name}\" not found"),
        );
    };
    if let Some(uid) = options["preconditions"]["uid"].as_str() {
        if pod["metadata"]["uid"].as_str() != Some(uid) {
            return status(
                StatusCode::CONFLICT,
                "Conflict",
                format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    pod["metadata"]["uid"]
                ),
            );
        }
    }
    // Deleted at once (the kubelet's part, the grace period, is not played here).
    c.pods.remove(&key);
    c.emit("DELETED", pod.clone());
    axum::Json(pod).into_response()
}

async fn create_deployment(
    State(c): State<Shared>,
    Path(ns): Path<String>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Response {
    record(
        &c,
        "POST",
        format!("/apis/apps/v1/namespaces/{ns}/deployments"),
        q,
        &body,
    );
    let mut d: Value = match serde_json::from_slice(&body) {
        Ok(d) => d,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", e.to_string()),
    };
    let name = d["metadata"]["name"].as_str().unwrap_or("").to_owned();
    let mut c = c.lock().unwrap();
    if c.deployments.contains_key(&(ns.clone(), name.clone())) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("deployments.apps \"{name}\" already exists"),
        );
    }
    d["metadata"]["namespace"] = json!(ns);
    d["metadata"]["uid"] = json!(uuid::Uuid::new_v4().to_string());
    d["metadata"]["generation"] = json!(1);
    d["metadata"]["resourceVersion"] = json!(c.bump().to_string());
    c.deployments.insert((ns, name), d.clone());
    (StatusCode::CREATED, axum::Json(d)).into_response()
}

async fn get_deployment(
    State(c): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    record(
        &c,
        "GET",
        format!("/apis/apps/v1/namespaces/{ns}/deployments/{name}"),
        None,
        b"",
    );
    let c = c.lock().unwrap();
    match c.deployments.get(&(ns, name.clone())) {
        Some(d) => axum::Json(d.clone()).into_response(),
        None => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("deployments.apps \"{name}\" not found"),
        ),
    }
}

async fn delete_deployment(
    State(c): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Response {
    record(
        &c,
        "DELETE",
        format!("/apis/apps/v1/namespaces/{ns}/deployments/{name}"),
        q,
        &body,
    );
    let mut c = c.lock().unwrap();
    match c.deployments.remove(&(ns, name.clone())) {
        Some(d) => axum::Json(d).into_response(),
        None => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("deployments.apps \"{name}\" not found"),
        ),
    }
}

async fn scale_deployment(
    State(c): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Response {
    record(
        &c,
        "PATCH",
        format!("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"),
        q,
        &body,
    );
    let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut c = c.lock().unwrap();
    let Some(d) = c.deployments.get_mut(&(ns.clone(), name.clone())) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("deployments.apps \"{name}\" not found"),
        );
    };
    if let Some(replicas) = patch["spec"]["replicas"].as_i64() {
        d["spec"]["replicas"] = json!(replicas);
    }
    let replicas = d["spec"]["replicas"].clone();
    axum::Json(json!({"apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {"name": name, "namespace": ns}, "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "selector": format!("gpuwarden.io/lease={name}")}}))
    .into_response()
}

async fn evict_pod(
    State(c): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Response {
    record(
        &c,
        "POST",
        format!("/api/v1/namespaces/{ns}/pods/{name}/eviction"),
        q,
        &body,
    );
    let mut c = c.lock().unwrap();
    if c.evictions_blocked {
        return status(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            "Cannot evict pod as it would violate the pod's disruption budget.".into(),
        );
    }
    let Some(pod) = c.pods.remove(&(ns, name.clone())) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("pods \"{name}\" not found"),
        );
    };
    c.emit("DELETED", pod);
    (
        StatusCode::CREATED,
        axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Success", "code": 201})),
    )
        .into_response()
}

impl KubeApi {
    /// Starts the server with `nodes` (Node objects).
    pub fn start(nodes: Vec<Value>) -> Self {
        Self::start_at(nodes, "127.0.0.1:0")
    }

    /// Starts the server with `nodes` on `address` (an API server coming back where a kubeconfig
    /// already points).
    pub fn start_at(nodes: Vec<Value>, address: &str) -> Self {
        let address = address.to_owned();
        let cluster: Shared = Arc::new(Mutex::new(Cluster {
            nodes,
            resource_version: 100,
            ..Cluster::default()
        }));
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = cluster.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let app = axum::Router::new()
                    .route("/api/v1/nodes", get(list_nodes))
                    .route("/api/v1/pods", get(list_pods))
                    .route(
                        "/api/v1/namespaces/{ns}/pods",
                        axum::routing::post(create_pod),
                    )
                    .route(
                        "/api/v1/namespaces/{ns}/pods/{name}",
                        get(get_pod).delete(delete_pod),
                    )
                    .route(
                        "/api/v1/namespaces/{ns}/pods/{name}/eviction",
                        axum::routing::post(evict_pod),
                    )
                    .route(
                        "/apis/apps/v1/namespaces/{ns}/deployments",
                        axum::routing::post(create_deployment),
                    )
                    .route(
                        "/apis/apps/v1/namespaces/{ns}/deployments/{name}",
                        get(get_deployment).delete(delete_deployment),
                    )
                    .route(
                        "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale",
                        axum::routing::patch(scale_deployment),
                    )
                    .with_state(shared);
                let listener = tokio::net::TcpListener::bind(&address).await.unwrap();
                tx.send(format!("http://{}", listener.local_addr().unwrap()))
                    .unwrap();
                axum::serve(listener, app).await.unwrap();
            });
        });
        Self {
            url: rx.recv().unwrap(),
            cluster,
        }
    }

    /// A kubeconfig file in `dir` that points at this server.
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        kubeconfig_for(&self.url, dir)
    }

    /// Sends every pod created through the API from now on to `validate` before storing it, as
    /// the API server sends it to its validating admission webhooks.
    pub fn validate_pods_with(&self, validate: Validate) {
        self.cluster.lock().unwrap().validate = Some(validate);
    }

    /// Stores `pod` as the API server does once admission allowed it (ADDED).
    pub fn store_pod(&self, pod: Value) {
        let ns = pod["metadata"]["namespace"].as_str().unwrap().to_owned();
        let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
        let mut c = self.cluster.lock().unwrap();
        c.pods.insert((ns, name), pod.clone());
        c.emit("ADDED", pod);
    }

    /// Moves a pod to `phase` as its kubelet reports it (MODIFIED).
    pub fn set_phase(&self, namespace: &str, name: &str, phase: &str) {
        let mut c = self.cluster.lock().unwrap();
        let key = (namespace.to_owned(), name.to_owned());
        let pod = c.pods.get_mut(&key).expect("the pod is stored");
        pod["status"]["phase"] = json!(phase);
        let pod = pod.clone();
        c.emit("MODIFIED", pod);
    }

    /// Removes a pod, as after its deletion completed (DELETED).
    pub fn remove_pod(&self, namespace: &str, name: &str) {
        let mut c = self.cluster.lock().unwrap();
        if let Some(pod) = c.pods.remove(&(namespace.to_owned(), name.to_owned())) {
            c.emit("DELETED", pod);
        }
    }

    /// A stored pod.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        let c = self.cluster.lock().unwrap();
        c.pods
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// A stored Deployment.
    pub fn deployment(&self, namespace: &str, name: &str) -> Option<Value> {
        let c = self.cluster.lock().unwrap();
        c.deployments
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// While `blocked`, evictions are refused as a PodDisruptionBudget refuses them (429).
    pub fn block_evictions(&self, blocked: bool) {
        self.cluster.lock().unwrap().evictions_blocked = blocked;
    }

    /// Every request so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.cluster.lock().unwrap().seen.clone()
    }
}

/// A kubeconfig file in `dir` that points at the API server `url` (`http://host:port`).
pub fn kubeconfig_for(url: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n\
             users:\n- name: gpuwarden\n  user:\n    token: test-token\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: gpuwarden\n\
             current-context: test\n"
        ),
    )
    .unwrap();
    path
}

/// A GPU node as NVIDIA's GPU feature discovery and device plugin leave it.
pub fn gpu_node(name: &str, product: &str, gpus: u32, cordoned: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": format!("uid-{name}"), "resourceVersion": "100",
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": product,
                       "nvidia.com/gpu.count": gpus.to_string()}},
        "spec": {"unschedulable": cordoned},
        "status": {
            "capacity": {"cpu": "96", "memory": "1056Gi", "nvidia.com/gpu": gpus.to_string(), "pods": "110"},
            "allocatable": {"cpu": "95500m", "memory": "1048Gi", "nvidia.com/gpu": gpus.to_string(), "pods": "110"}
        }
    })
}
