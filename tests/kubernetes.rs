//! The Kubernetes substrate at the boundaries reachable here (no API server can be installed on
//! these machines): `gpuwarden enforce` with a `kubernetes` substrate, its validating admission
//! webhook called over real HTTPS (rustls client, certificates made by the openssl command
//! line) with `AdmissionReview` objects written as the API server sends them, and the cluster's
//! API answered by a small HTTP server in this test that serves recorded-shape `NodeList`
//! objects and records the driver's requests (a kubeconfig points the driver at it).

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use gpuwarden_enforcer::outbound::{http_client_with_tls, HttpClient};
use gpuwarden_schema::tls::client_config;
use http_body_util::{BodyExt as _, Full};
use serde_json::{json, Value};
use support::kube_api::{gpu_node, KubeApi};
use support::pki::{Ca, Leaf};
use support::{Config, Running, Substrate, Team, Workload};

const ADMIN_TOKEN: &str = "admin-secret-token";

/// Four H100 nodes of 8, two A100 nodes of 8 (one cordoned), one CPU node.
fn nodes() -> Vec<Value> {
    let mut nodes: Vec<Value> = (0..4)
        .map(|i| gpu_node(&format!("h100-{i}"), "NVIDIA-H100-80GB-HBM3", 8, false))
        .collect();
    nodes.push(gpu_node("a100-0", "NVIDIA-A100-SXM4-80GB", 8, false));
    nodes.push(gpu_node("a100-1", "NVIDIA-A100-SXM4-80GB", 8, true));
    nodes.push(json!({"metadata": {"name": "cpu-0", "labels": {}}, "status": {"allocatable": {"cpu": "64"}}}));
    nodes
}

/// Teams: `ml` (quota 16, namespace `ml-research`), `vision` (A100 only), `lean` ($1 a month),
/// `burst` (quota 16, for the concurrent reviews).
fn write_config(dir: &Path, api: &KubeApi, ca: &Ca) -> PathBuf {
    write_config_for(dir, &api.kubeconfig(dir), ca)
}

/// [`write_config`] with `kubeconfig` naming the API server.
fn write_config_for(dir: &Path, kubeconfig: &Path, ca: &Ca) -> PathBuf {
    config(dir, cluster(kubeconfig, &ca.server("webhook"))).write(dir.join("gpuwarden.toml"))
}

/// [`write_config`]'s teams and workloads, with `k8s` as the one substrate.
fn config(dir: &Path, k8s: Substrate) -> Config {
    let team = |name: &str, members: &[&str], budget: f64, models: &[&str]| {
        Team::new(name, 16, budget)
            .members(members)
            .allowed_models(models)
    };
    Config::new()
        .data_dir(&dir.join("data"))
        .enforcer()
        .pricing(2.0)
        .team(team("ml", &["ada", "bob"], 100000.0, &[]))
        .team(team("vision", &["cy"], 100000.0, &["A100"]))
        .team(team("lean", &["dee"], 1.0, &[]))
        .team(team("burst", &["eve"], 1000000.0, &[]))
        .workload(Workload::new("inference").max_gpus(64).max_duration("24h"))
        .workload(Workload::new("training").max_gpus(64).max_duration("72h"))
        .substrate(k8s)
        .token("root", ADMIN_TOKEN, "admin", &[])
}

/// The cluster `k8s`, its API server as `kubeconfig` says, its webhook serving `leaf`: namespace
/// `ml-research` is team ml's, `oidc:ada@example.com` is ada, and a pod has 45 s to stop.
fn cluster(kubeconfig: &Path, leaf: &Leaf) -> Substrate {
    Substrate::kubernetes("k8s", kubeconfig, &leaf.cert, &leaf.key).raw(
        r#"
[kubernetes]
teams = { "ml-research" = "ml" }
users = { "oidc:ada@example.com" = "ada" }
grace_period = "45s"
"#,
    )
}

/// A pod being created, as the API server sends it to a validating webhook.
struct PodReview {
    namespace: &'static str,
    username: &'static str,
    gpus: Option<&'static str>,
    product: Option<&'static str>,
    labels: Value,
    dry_run: bool,
    pod_uid: String,
}

impl PodReview {
    fn new(namespace: &'static str, username: &'static str, gpus: Option<&'static str>) -> Self {
        Self {
            namespace,
            username,
            gpus,
            product: Some("NVIDIA-H100-80GB-HBM3"),
            labels: json!({"app": "serve"}),
            dry_run: false,
            pod_uid: uuid(),
        }
    }

    fn name(&self) -> String {
        format!("serve-{}", &self.pod_uid[..8])
    }

    /// The pod as the API server stores it once admitted.
    fn object(&self) -> Value {
        self.json("-")["request"]["object"].clone()
    }

    fn json(&self, review_uid: &str) -> Value {
        let mut resources =
            json!({"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "32Gi"}});
        if let Some(gpus) = self.gpus {
            resources["limits"]["nvidia.com/gpu"] = json!(gpus);
            resources["requests"]["nvidia.com/gpu"] = json!(gpus);
        }
        let name = self.name();
        let mut spec = json!({
            "containers": [{"name": "server", "image": "vllm/vllm-openai:v0.9.0",
                "resources": resources, "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"}],
            "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default", "securityContext": {}, "schedulerName": "default-scheduler",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priority": 0, "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority"
        });
        if let Some(product) = self.product {
            spec["nodeSelector"] = json!({"nvidia.com/gpu.product": product});
        }
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": review_uid,
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "name": name,
                "namespace": self.namespace,
                "operation": "CREATE",
                "userInfo": {"username": self.username, "uid": "u-1", "groups": ["system:authenticated"]},
                "object": {
                    "kind": "Pod", "apiVersion": "v1",
                    "metadata": {"name": name, "namespace": self.namespace, "uid": self.pod_uid,
                        "creationTimestamp": "2026-12-05T06:00:00Z", "labels": self.labels,
                        "managedFields": [{"manager": "kubectl-client-side-apply", "operation": "Update",
                            "apiVersion": "v1", "time": "2026-12-05T06:00:00Z", "fieldsType": "FieldsV1",
                            "fieldsV1": {"f:spec": {"f:containers": {}}}}]},
                    "spec": spec,
                    "status": {"phase": "Pending", "qosClass": "Burstable"}
                },
                "oldObject": null,
                "dryRun": self.dry_run,
                "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1", "fieldManager": "kubectl-client-side-apply"}
            }
        })
    }
}

fn uuid() -> String {
    uuid::Uuid::new_v4().to_string()
}

struct Webhook {
    client: HttpClient,
    url: String,
}

impl Webhook {
    async fn post(&self, body: Vec<u8>) -> (u16, Vec<u8>) {
        let request = hyper::Request::post(&self.url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let response = self.client.request(request).await.unwrap();
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec();
        (status, body)
    }

    /// Sends `pod`; returns the review's `response`.
    async fn review(&self, pod: &PodReview) -> Value {
        let uid = uuid();
        let (status, body) = self
            .post(serde_json::to_vec(&pod.json(&uid)).unwrap())
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let review: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(review["kind"], "AdmissionReview");
        assert_eq!(
            review["response"]["uid"],
            uid.as_str(),
            "the answer copies the review's uid"
        );
        review["response"].clone()
    }
}

fn message(response: &Value) -> String {
    response["status"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

fn start(dir: &Path) -> (Running, Webhook, String, KubeApi) {
    let api_server = KubeApi::start(nodes());
    let ca = Ca::new(dir, "webhook-ca");
    let config = write_config(dir, &api_server, &ca);
    let (enforcer, webhook, api) = start_enforcer(&config, &ca);
    (enforcer, webhook, api, api_server)
}

/// Starts the enforcer on `config`; returns it, a client of its webhook trusting `ca`, and its
/// API's URL.
fn start_enforcer(config: &Path, ca: &Ca) -> (Running, Webhook, String) {
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let line = enforcer.wait_for_log(
        "kubernetes admission webhook running",
        Duration::from_secs(60),
    );
    let url = line["url"].as_str().unwrap().to_owned();
    let line = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = line["api"].as_str().unwrap().to_owned();
    let tls = client_config(&ca.cert, None, ("ca", "cert", "key")).unwrap();
    let webhook = Webhook {
        client: http_client_with_tls(tls),
        url,
    };
    (enforcer, webhook, api)
}

/// `GET {api}{path}` without a token: status and body.
async fn get_text(api: &str, path: &str) -> (u16, String) {
    let client = gpuwarden_enforcer::outbound::http_client();
    let request = hyper::Request::get(format!("{api}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Releases `lease` through the API at `api`, as an admin, expecting it released.
async fn release(api: &str, lease: &str) {
    let (status, body) = call(api, "POST", &format!("/v1/leases/{lease}/release"), "{}").await;
    assert_eq!(status, 200, "releasing {lease}: {body}");
}

/// A call to the enforcer's API with the admin token.
async fn call(api: &str, method: &str, path: &str, body: &str) -> (u16, Value) {
    let client = gpuwarden_enforcer::outbound::http_client();
    let request = hyper::Request::builder()
        .method(method)
        .uri(format!("{api}{path}"))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// Waits until lease `id` is in `state` (the watcher follows pods in the background).
async fn wait_for_state(api: &str, id: &str, state: &str) {
    for _ in 0..200 {
        let (status, lease) = call(api, "GET", &format!("/v1/leases/{id}"), "").await;
        if status == 200 && lease["state"] == state {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, lease) = call(api, "GET", &format!("/v1/leases/{id}"), "").await;
    panic!("lease {id} never became {state}: {lease}");
}

#[test]
fn the_webhook_admits_denies_and_explains_over_https() {
    let dir = tempfile::tempdir().unwrap();
    let (enforcer, webhook, api, kube) = start(dir.path());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        // Two GPUs within quota: allowed, the estimate as a warning.
        let pod = PodReview::new("ml-research", "oidc:ada@example.com", Some("2"));
        let ok = webhook.review(&pod).await;
        assert_eq!(ok["allowed"], true, "{ok}");
        let warning = ok["warnings"][0].as_str().unwrap();
        assert!(
            warning.contains("admitted for team ml as inference: 2 x NVIDIA H100 80GB HBM3"),
            "{warning}"
        );
        assert!(warning.contains("$4.00/h"), "{warning}");
        assert!(
            warning.contains(&format!("lease k8s-{}", pod.pod_uid)),
            "{warning}"
        );
        // The same pod reviewed again (the API server retries a call that timed out): the same
        // answer, and still one lease.
        let again = webhook.review(&pod).await;
        assert_eq!(again["allowed"], true, "{again}");

        // Over quota: 2 held + 15 > 16.
        let over = webhook
            .review(&PodReview::new(
                "ml-research",
                "oidc:ada@example.com",
                Some("15"),
            ))
            .await;
        assert_eq!(over["allowed"], false);
        assert_eq!(over["status"]["code"], 403);
        assert!(message(&over).contains("quota_exceeded"), "{over}");

        // Over budget: $1 a month, one GPU for a day costs $48.
        let broke = webhook
            .review(&PodReview::new("lean", "dee", Some("1")))
            .await;
        assert_eq!(broke["allowed"], false);
        assert!(message(&broke).contains("budget_exceeded"), "{broke}");

        // A model the team may not use.
        let wrong = webhook
            .review(&PodReview::new("vision", "cy", Some("1")))
            .await;
        assert_eq!(wrong["allowed"], false);
        assert!(message(&wrong).contains("model_not_allowed"), "{wrong}");
        let mut a100 = PodReview::new("vision", "cy", Some("1"));
        a100.product = Some("NVIDIA-A100-SXM4-80GB");
        assert_eq!(webhook.review(&a100).await["allowed"], true);

        // Every reason at once, each named.
        let mut many = PodReview::new("lean", "mallory", Some("80"));
        many.labels = json!({"gpuwarden.io/workload": "training:llm"});
        let many = webhook.review(&many).await;
        let text = message(&many);
        for code in [
            "not_member",
            "workload_limit",
            "quota_exceeded",
            "budget_exceeded",
        ] {
            assert!(text.contains(code), "{code} in {text}");
        }

        // No GPUs: allowed untouched.
        let web = webhook
            .review(&PodReview::new("ml-research", "ada", None))
            .await;
        assert_eq!(web["allowed"], true);
        assert!(web.get("warnings").is_none(), "{web}");

        // Mistakes a person can fix are denials that say what to do.
        let nowhere = webhook
            .review(&PodReview::new("sandbox", "ada", Some("1")))
            .await;
        assert!(
            message(&nowhere).contains("namespace \"sandbox\" maps to no team"),
            "{nowhere}"
        );
        let mut unpinned = PodReview::new("ml-research", "ada", Some("1"));
        unpinned.product = None;
        let unpinned = webhook.review(&unpinned).await;
        assert!(
            message(&unpinned)
                .contains("name a GPU model with nodeSelector nvidia.com/gpu.product"),
            "{unpinned}"
        );
        let mut typo = PodReview::new("ml-research", "ada", Some("1"));
        typo.labels = json!({"gpuwarden.io/workload": "trainig"});
        assert!(message(&webhook.review(&typo).await).contains("names no workload"));

        // A dry run is decided and recorded nowhere.
        let mut dry = PodReview::new("ml-research", "ada", Some("14"));
        dry.dry_run = true;
        let dry = webhook.review(&dry).await;
        assert_eq!(dry["allowed"], true, "{dry}");
        assert!(dry["warnings"][0].as_str().unwrap().contains("would admit"));
        let fits = webhook
            .review(&PodReview::new("ml-research", "bob", Some("14")))
            .await;
        assert_eq!(fits["allowed"], true, "the dry run held nothing: {fits}");

        // Not a review: 400, naming what is wrong.
        let (status, body) = webhook.post(b"{\"kind\": ".to_vec()).await;
        assert_eq!(status, 400);
        assert!(String::from_utf8_lossy(&body).contains("not JSON"));
        let mut broken = pod.json("r-1");
        broken["request"]["operation"] = json!(42);
        let (status, body) = webhook.post(serde_json::to_vec(&broken).unwrap()).await;
        assert_eq!(status, 400);
        assert!(
            String::from_utf8_lossy(&body).contains("request.operation"),
            "{}",
            String::from_utf8_lossy(&body)
        );
        // A version it does not speak: 400, which the API server logs with the message.
        let mut old = pod.json("r-2");
        old["apiVersion"] = json!("admission.k8s.io/v1beta1");
        let (status, body) = webhook.post(serde_json::to_vec(&old).unwrap()).await;
        assert_eq!(status, 400);
        assert!(String::from_utf8_lossy(&body).contains("admissionReviewVersions"));

        // Releasing the first pod's lease deletes the pod, with the grace period and its uid as
        // a precondition.
        kube.store_pod(pod.object());
        let lease = format!("k8s-{}", pod.pod_uid);
        release(&api, &lease).await;
        assert!(
            kube.pod("ml-research", &pod.name()).is_none(),
            "the pod was deleted"
        );
    });
    let deletes: Vec<_> = kube
        .seen()
        .into_iter()
        .filter(|r| r.method == "DELETE")
        .collect();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert!(
        deletes[0]
            .path
            .starts_with("/api/v1/namespaces/ml-research/pods/serve-"),
        "{deletes:?}"
    );
    let body: Value = serde_json::from_str(&deletes[0].body).unwrap();
    assert_eq!(body["gracePeriodSeconds"], 45);
    assert!(
        body["preconditions"]["uid"]
            .as_str()
            .is_some_and(|u| deletes[0].path.contains(&u[..8])),
        "{body}"
    );
    drop(enforcer);
}

#[test]
fn two_hundred_concurrent_reviews_against_a_quota_of_16_admit_exactly_16() {
    let dir = tempfile::tempdir().unwrap();
    let (enforcer, webhook, _, _kube) = start(dir.path());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let webhook = Arc::new(webhook);
    let answers: Vec<Value> = runtime.block_on(async {
        let tasks: Vec<_> = (0..200)
            .map(|_| {
                let webhook = webhook.clone();
                tokio::spawn(async move {
                    webhook
                        .review(&PodReview::new("burst", "eve", Some("1")))
                        .await
                })
            })
            .collect();
        futures::future::join_all(tasks)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect()
    });
    let admitted = answers.iter().filter(|a| a["allowed"] == true).count();
    assert_eq!(admitted, 16);
    for denied in answers.iter().filter(|a| a["allowed"] == false) {
        assert!(message(denied).contains("quota_exceeded"), "{denied}");
    }
    drop(enforcer);
}

#[test]
fn a_pods_lease_follows_the_pod_it_was_admitted_for() {
    let dir = tempfile::tempdir().unwrap();
    let (enforcer, webhook, api, kube) = start(dir.path());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        // Admitted, stored, scheduled and run: granted, then active; it succeeds: released.
        let job = PodReview::new("ml-research", "ada", Some("4"));
        assert_eq!(webhook.review(&job).await["allowed"], true);
        let id = format!("k8s-{}", job.pod_uid);
        wait_for_state(&api, &id, "granted").await;
        kube.store_pod(job.object());
        kube.set_phase("ml-research", &job.name(), "Running");
        wait_for_state(&api, &id, "active").await;
        kube.set_phase("ml-research", &job.name(), "Succeeded");
        wait_for_state(&api, &id, "released").await;

        // One that fails is failed; one deleted while running is released; their GPUs are
        // given back (the team's quota of 16 takes 16 again).
        let crash = PodReview::new("ml-research", "ada", Some("8"));
        let gone = PodReview::new("ml-research", "bob", Some("8"));
        for pod in [&crash, &gone] {
            assert_eq!(webhook.review(pod).await["allowed"], true);
            kube.store_pod(pod.object());
            kube.set_phase("ml-research", &pod.name(), "Running");
        }
        wait_for_state(&api, &format!("k8s-{}", gone.pod_uid), "active").await;
        let full = webhook
            .review(&PodReview::new("ml-research", "ada", Some("1")))
            .await;
        assert!(message(&full).contains("quota_exceeded"), "{full}");
        kube.set_phase("ml-research", &crash.name(), "Failed");
        kube.remove_pod("ml-research", &gone.name());
        wait_for_state(&api, &format!("k8s-{}", crash.pod_uid), "failed").await;
        wait_for_state(&api, &format!("k8s-{}", gone.pod_uid), "released").await;
        let (_, lease) = call(&api, "GET", &format!("/v1/leases/k8s-{}", gone.pod_uid), "").await;
        assert_eq!(lease["release_reason"], "user", "{lease}");
        assert_eq!(
            webhook
                .review(&PodReview::new("ml-research", "ada", Some("16")))
                .await["allowed"],
            true
        );
    });
    drop(enforcer);
}

/// With the API server unreachable from the start, the enforcer serves but is not ready, and a
/// GPU pod is refused as the failure it is (503, saying what happened and what to do), never
/// with a bare HTTP 500; once the API server answers, it becomes ready and admits.
#[test]
fn while_the_api_server_is_unreachable_the_enforcer_is_not_ready_and_says_why_pods_wait() {
    let dir = tempfile::tempdir().unwrap();
    // Where the API server will be: nothing listens there yet.
    let address = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let kubeconfig = support::kube_api::kubeconfig_for(&format!("http://{address}"), dir.path());
    let ca = Ca::new(dir.path(), "webhook-ca");
    let config = write_config_for(dir.path(), &kubeconfig, &ca);
    let (enforcer, webhook, api) = start_enforcer(&config, &ca);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let _api_server = runtime.block_on(async {
        // Alive, not ready, and saying why.
        let (status, health) = get_text(&api, "/healthz").await;
        assert_eq!(status, 200);
        assert!(
            health.starts_with("ok\n") && health.contains("\nrole: leader\n"),
            "{health}"
        );
        let (status, why) = get_text(&api, "/readyz").await;
        eprintln!("/readyz answers {status}: {why}");
        assert_eq!(status, 503, "{why}");
        assert!(
            why.starts_with(
                "not ready: substrate k8s: the cluster's nodes have not been listed yet (listing \
                 the nodes: "
            ) && why.ends_with(
                "); check that the enforcer reaches the Kubernetes API server and may list nodes\n"
            ),
            "{why}"
        );

        // A GPU pod: an AdmissionReview refusing it with 503, in words its creator can act on.
        let pod = PodReview::new("ml-research", "oidc:ada@example.com", Some("2"));
        let refused = webhook.review(&pod).await;
        assert_eq!(refused["allowed"], false, "{refused}");
        assert_eq!(refused["status"]["code"], 503, "{refused}");
        assert_eq!(
            refused["status"]["reason"], "ServiceUnavailable",
            "{refused}"
        );
        let text = message(&refused);
        eprintln!("the pod's creator reads: {text}");
        assert!(
            text.starts_with(
                "gpuwarden: this pod was not created because gpuwarden cannot check GPU capacity \
                 right now: it cannot reach the Kubernetes API (substrate k8s: listing the nodes: "
            ),
            "{text}"
        );
        assert!(
            text.ends_with(
                "This is not a policy decision: try again in a minute. If it keeps happening, ask \
                 your cluster administrator to check the gpuwarden enforcer's log and its access \
                 to the Kubernetes API server."
            ),
            "{text}"
        );
        // A pod without GPUs is none of gpuwarden's business, API server or not.
        let plain = webhook
            .review(&PodReview::new("ml-research", "ada", None))
            .await;
        assert_eq!(plain["allowed"], true, "{plain}");

        // The API server comes up where the kubeconfig points: ready, and the pod is admitted.
        let api_server = KubeApi::start_at(nodes(), &address);
        let mut last = (0, String::new());
        for _ in 0..600 {
            last = get_text(&api, "/readyz").await;
            if last.0 == 200 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(last, (200, "ready\n".to_owned()));
        let admitted = webhook.review(&pod).await;
        assert_eq!(admitted["allowed"], true, "{admitted}");
        api_server
    });
    drop(enforcer);
}

/// Runs `gpuwarden enforce --config <config>`, which must exit by itself within a minute;
/// returns its exit code and its last error line.
fn enforce_exits(config: &Path) -> (Option<i32>, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["enforce", "--config", config.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("gpuwarden enforce kept running after a fatal start-up error");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    let error = stderr
        .lines()
        .rfind(|l| l.starts_with("error"))
        .unwrap_or("")
        .to_owned();
    (output.status.code(), error)
}

#[test]
fn a_missing_webhook_certificate_or_a_taken_port_stops_the_enforcer_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let api = KubeApi::start(nodes());
    let ca = Ca::new(dir.path(), "webhook-ca");
    let kubeconfig = api.kubeconfig(dir.path());
    let leaf = ca.server("webhook");

    // The webhook's key file missing (a renewal tool that has not run yet).
    let nowhere = Leaf {
        cert: "/nonexistent.pem".into(),
        key: "/nonexistent.key".into(),
    };
    let missing =
        config(dir.path(), cluster(&kubeconfig, &nowhere)).write(dir.path().join("missing.toml"));
    let (code, error) = enforce_exits(&missing);
    assert_eq!(code, Some(1), "{error}");
    assert!(
        error.contains("substrates.kubernetes.webhook_tls.cert")
            && error.contains("/nonexistent.pem"),
        "{error}"
    );

    // The API's port taken by another process.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let busy = config(dir.path(), cluster(&kubeconfig, &leaf))
        .raw(&format!("[enforcer]\nlisten = \"127.0.0.1:{port}\"\n"))
        .write(dir.path().join("busy.toml"));
    let (code, error) = enforce_exits(&busy);
    assert_eq!(code, Some(1), "{error}");
    assert!(
        error.contains(&format!("binding the API to 127.0.0.1:{port}")),
        "{error}"
    );

    // The webhook's port taken.
    let webhook_on_port = format!("[kubernetes]\nwebhook_listen = \"127.0.0.1:{port}\"\n");
    let hooked = config(
        dir.path(),
        cluster(&kubeconfig, &leaf).raw(&webhook_on_port),
    )
    .write(dir.path().join("hooked.toml"));
    let (code, error) = enforce_exits(&hooked);
    assert_eq!(code, Some(1), "{error}");
    assert!(error.contains("admission webhook to 127.0.0.1:"), "{error}");
}

/// Two replicas on one PostgreSQL store (tests/support/postgres.rs), each serving the webhook
/// as the Service would reach them: a pod one replica creates for an API admission is let in by
/// the other's webhook (the API server may send the review to either), and a pod admitted
/// through one is deleted when the other releases its lease; reviews sent to either are decided
/// against one quota, and with one replica killed the other goes on answering, counting what
/// the first admitted.
#[test]
fn reviews_through_two_replicas_on_postgres_share_one_quota_and_survive_one_killed() {
    let dir = tempfile::tempdir().unwrap();
    let api_server = KubeApi::start(nodes());
    let ca = Ca::new(dir.path(), "webhook-ca");
    let store = support::pg::server().database();
    let template = dir.path().join("pod.yaml");
    std::fs::write(
        &template,
        "spec:\n  containers:\n  - name: main\n    image: nvcr.io/nvidia/pytorch:25.01-py3\n",
    )
    .unwrap();
    let mut replicas = Vec::new();
    let mut apis = Vec::new();
    for name in ["r0", "r1"] {
        let home = dir.path().join(name);
        std::fs::create_dir_all(&home).unwrap();
        let pod_template = format!("[kubernetes]\npod_template = \"{}\"\n", template.display());
        let k8s = cluster(&api_server.kubeconfig(&home), &ca.server("webhook")).raw(&pod_template);
        let config = config(&home, k8s)
            .store(&store)
            .leader("2s", name)
            .write(home.join("gpuwarden.toml"));
        let (enforcer, webhook, api) = start_enforcer(&config, &ca);
        apis.push(api);
        replicas.push((Some(enforcer), webhook));
    }
    // The API server sends the pods created through it to the second replica's webhook.
    let second = replicas[1].1.url.clone();
    let cert = ca.cert.clone();
    api_server.validate_pods_with(Arc::new(move |pod: Value| {
        let (url, cert) = (second.clone(), cert.clone());
        Box::pin(async move {
            let tls = client_config(&cert, None, ("ca", "cert", "key")).unwrap();
            let webhook = Webhook {
                client: http_client_with_tls(tls),
                url,
            };
            let mut review = PodReview::new(
                "ml-research",
                "system:serviceaccount:gpuwarden:enforcer",
                None,
            )
            .json(&uuid());
            review["request"]["name"] = pod["metadata"]["name"].clone();
            review["request"]["namespace"] = pod["metadata"]["namespace"].clone();
            review["request"]["object"] = pod;
            let (status, body) = webhook.post(serde_json::to_vec(&review).unwrap()).await;
            let answer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            match answer["response"]["allowed"].as_bool() {
                Some(true) => Ok(()),
                _ => Err(format!("{status}: {}", message(&answer["response"]))),
            }
        })
    }));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (mut processes, webhooks): (Vec<_>, Vec<_>) = replicas.into_iter().unzip();
    let ask = |replica: usize| {
        let pod = PodReview::new("ml-research", "oidc:ada@example.com", Some("2"));
        runtime.block_on(webhooks[replica].review(&pod))
    };
    runtime.block_on(async {
        // An API admission on the first replica: its driver creates the pod, whose review the
        // second answers, knowing the pod as the lease's own.
        let (status, answer) = call(
            &apis[0],
            "POST",
            "/v1/admission",
            r#"{"team": "ml", "user": "ada", "project": "p", "workload": "training",
                "gpus": 2, "substrate": "k8s", "duration": "1h"}"#,
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["decision"], "admitted", "{answer}");
        let lease = answer["lease"]["id"].as_str().unwrap().to_owned();
        let pod = format!("gpuwarden-{lease}");
        assert!(
            api_server.pod("ml-research", &pod).is_some(),
            "the pod was let in"
        );
        // Released through the second replica, which deletes the pod the first created.
        release(&apis[1], &lease).await;
        assert!(api_server.pod("ml-research", &pod).is_none(), "deleted");

        // A pod admitted by the first replica's webhook is deleted, with its uid as a
        // precondition, when the second releases its lease.
        let admitted = PodReview::new("ml-research", "oidc:ada@example.com", Some("2"));
        let answer = webhooks[0].review(&admitted).await;
        assert_eq!(answer["allowed"], true, "{answer}");
        api_server.store_pod(admitted.object());
        let lease = format!("k8s-{}", admitted.pod_uid);
        release(&apis[1], &lease).await;
        assert!(
            api_server.pod("ml-research", &admitted.name()).is_none(),
            "the second replica deleted the pod the first admitted"
        );
        let delete = api_server
            .seen()
            .into_iter()
            .rfind(|r| r.method == "DELETE")
            .unwrap();
        assert!(delete.body.contains(&admitted.pod_uid), "{delete:?}");
    });
    // Six pods of 2 GPUs, alternately: 12 of the team's 16.
    for i in 0..6 {
        let answer = ask(i % 2);
        assert_eq!(answer["allowed"], true, "review {i}: {answer}");
    }
    // The first replica dies; the second counts its leases: two more fit, the third does not.
    drop(processes[0].take());
    for i in 0..2 {
        let answer = ask(1);
        assert_eq!(
            answer["allowed"], true,
            "review {i} after the kill: {answer}"
        );
    }
    let answer = ask(1);
    assert_eq!(answer["allowed"], false, "{answer}");
    assert!(message(&answer).contains("quota_exceeded"), "{answer}");
}
