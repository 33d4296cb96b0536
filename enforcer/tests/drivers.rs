//! The substrate driver contract, written once and run against every driver, then each driver's
//! own promises: the local driver with real child processes, the webhook driver against a real
//! HTTP provisioner on 127.0.0.1 that checks signatures.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context as _};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::Method;
use axum::http::{HeaderMap, StatusCode};
use gpuwarden_enforcer::api::{router, AppState};
use gpuwarden_enforcer::drivers::{
    self, build, Driver, DriverContext, DriverError, Gpu, Inventory, LeaseSpec, LeaseStatus,
    RefusalCode,
};
use gpuwarden_enforcer::service::Service;
use gpuwarden_enforcer::store::Store;
use gpuwarden_schema::config::{Config, GpuPrice, Role, SubstrateConfig, TeamConfig};
use gpuwarden_schema::{ManualClock, ReleaseReason, Workload};
use serde_json::{json, Value};

mod support;

use support::eventually_async;

fn substrate(text: &str) -> SubstrateConfig {
    toml::from_str(text).expect("test config parses")
}

fn context(dir: &Path) -> DriverContext {
    DriverContext {
        state_dir: dir.join("drivers").join("test"),
        lease_refs: None,
    }
}

/// A lease store in `dir` holding open leases `ids` of substrate `k8s`, as the enforcer holds
/// a lease before its driver provisions it: the Kubernetes driver writes each lease's pod down
/// on the lease.
async fn k8s_store(dir: &Path, ids: &[&str]) -> Store {
    let store = Store::open(&dir.join("enforcer.db")).unwrap();
    for id in ids {
        let lease = gpuwarden_enforcer::store::Lease {
            team: "vision".into(),
            ..support::lease(id, "k8s")
        };
        store.adopt(lease, 0, "test").await.unwrap();
    }
    store
}

/// [`context`] with `store`.
fn context_with(dir: &Path, store: &Store) -> DriverContext {
    DriverContext {
        lease_refs: Some(gpuwarden_enforcer::service::lease_refs(store.clone())),
        ..context(dir)
    }
}

fn lease(id: &str, model: &str, gpu_uuids: Vec<String>, command: Option<Vec<String>>) -> LeaseSpec {
    LeaseSpec {
        lease_id: id.to_owned(),
        team: "vision".to_owned(),
        user: "ada".to_owned(),
        project: "detector".to_owned(),
        workload: Workload::Training,
        gpu_model: model.to_owned(),
        gpu_count: u32::try_from(gpu_uuids.len().max(1)).expect("small"),
        gpu_uuids,
        command,
        labels: BTreeMap::from([("run".to_owned(), "42".to_owned())]),
        time_limit: None,
    }
}

fn argv(args: &[&str]) -> Option<Vec<String>> {
    Some(args.iter().map(|s| (*s).to_owned()).collect())
}

/// Inventory is non-empty and names each GPU once, each (host, index) once.
fn check_inventory(inventory: &Inventory) -> anyhow::Result<()> {
    ensure!(
        !inventory.gpus.is_empty() || !inventory.pooled.is_empty(),
        "empty inventory"
    );
    let uuids: BTreeSet<&str> = inventory.gpus.iter().map(|g| g.uuid.as_str()).collect();
    ensure!(
        uuids.len() == inventory.gpus.len(),
        "a UUID is listed twice"
    );
    let places: BTreeSet<(&str, u32)> = inventory
        .gpus
        .iter()
        .map(|g| (g.host.as_str(), g.index))
        .collect();
    ensure!(
        places.len() == inventory.gpus.len(),
        "a (host, index) is listed twice"
    );
    for gpu in &inventory.gpus {
        ensure!(
            gpu.uuid.starts_with("GPU-"),
            "{} is not an NVML UUID",
            gpu.uuid
        );
        ensure!(
            !gpu.host.is_empty() && !gpu.model.is_empty(),
            "{gpu:?} lacks host or model"
        );
    }
    for (model, count) in &inventory.pooled {
        ensure!(
            !model.is_empty() && *count > 0,
            "pooled entry {model:?} x {count}"
        );
    }
    Ok(())
}

/// Up to `n` GPUs of one model on one host, or none on a pooled substrate.
fn pick(inventory: &Inventory, n: usize) -> (String, Vec<String>) {
    match inventory.gpus.first() {
        Some(first) => (
            first.model.clone(),
            inventory
                .gpus
                .iter()
                .filter(|g| g.host == first.host && g.model == first.model)
                .take(n)
                .map(|g| g.uuid.clone())
                .collect(),
        ),
        None => (inventory.pooled[0].0.clone(), Vec::new()),
    }
}

/// What a driver's documentation says a resize of a running lease to other GPUs does.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ResizeMoves {
    /// The lease now holds the new GPUs.
    Yes,
    /// Rejected (local: a process cannot change its CUDA_VISIBLE_DEVICES).
    Rejected,
}

struct Subject {
    /// The substrate's name, as its driver must report it.
    name: String,
    /// A new instance of the driver: each call stands for the enforcer starting again over the
    /// same substrate.
    start: Box<dyn Fn() -> anyhow::Result<Box<dyn Driver>>>,
    command: Option<Vec<String>>,
    resize_moves: ResizeMoves,
}

impl Subject {
    /// The driver the registry (`drivers::build`) makes of `config`, over `context`.
    fn registered(
        config: SubstrateConfig,
        context: DriverContext,
        command: Option<Vec<String>>,
        resize_moves: ResizeMoves,
    ) -> Self {
        Self {
            name: config.name.clone(),
            start: Box::new(move || Ok(build(&config, &context)?)),
            command,
            resize_moves,
        }
    }
}

/// The contract every driver keeps.
async fn contract(subject: Subject) -> anyhow::Result<()> {
    let Subject {
        name,
        start,
        command,
        resize_moves,
    } = subject;
    let driver = start()?;
    assert_eq!(driver.name(), name);
    let inventory = driver.inventory().await?;
    check_inventory(&inventory)?;

    let (model, gpus) = pick(&inventory, 2);
    let one = lease(
        "lease-contract-1",
        &model,
        gpus.iter().take(1).cloned().collect(),
        command.clone(),
    );
    let two = LeaseSpec {
        gpu_uuids: gpus.clone(),
        gpu_count: 2,
        ..one.clone()
    };
    let id = one.lease_id.as_str();

    assert_eq!(
        driver.status(id).await?,
        LeaseStatus::Gone,
        "before provision"
    );
    driver.provision(&one).await?;
    assert_eq!(
        driver.status(id).await?,
        LeaseStatus::Running,
        "after provision"
    );
    driver.provision(&one).await.context("provisioning twice")?;
    assert_eq!(
        driver.status(id).await?,
        LeaseStatus::Running,
        "after provisioning twice"
    );

    driver
        .resize(&one)
        .await
        .context("resizing to the same GPUs")?;
    match (resize_moves, driver.resize(&two).await) {
        (ResizeMoves::Yes, Ok(())) | (ResizeMoves::Rejected, Err(DriverError::Rejected { .. })) => {
        }
        (expected, got) => bail!("resize to two GPUs: expected {expected:?}, got {got:?}"),
    }
    assert_eq!(
        driver.status(id).await?,
        LeaseStatus::Running,
        "after resize"
    );

    // A restart: a new instance over the same config and state dir re-adopts the lease.
    drop(driver);
    let driver = start()?;
    assert_eq!(
        driver.inventory().await?,
        inventory,
        "inventory after restart"
    );
    assert_eq!(
        driver.status(id).await?,
        LeaseStatus::Running,
        "after restart"
    );

    driver.reclaim(id, ReleaseReason::User).await?;
    assert_ne!(
        driver.status(id).await?,
        LeaseStatus::Running,
        "after reclaim"
    );
    driver
        .reclaim(id, ReleaseReason::User)
        .await
        .context("reclaiming twice")?;
    assert_ne!(
        driver.status(id).await?,
        LeaseStatus::Running,
        "after reclaiming twice"
    );

    drop(driver);
    let driver = start()?;
    assert_ne!(
        driver.status(id).await?,
        LeaseStatus::Running,
        "reclaimed, after restart"
    );
    assert_eq!(driver.status("lease-never-seen").await?, LeaseStatus::Gone);
    driver
        .reclaim("lease-never-seen", ReleaseReason::Admin)
        .await?;
    Ok(())
}

const SIMULATED: &str = r#"
name = "sim"
driver = "simulated"
hosts = [
  { prefix = "sim-h100", count = 2, gpus = 8, gpu_model = "NVIDIA H100 80GB HBM3" },
  { prefix = "sim-l40s", count = 1, gpus = 4, gpu_model = "NVIDIA L40S" },
]
"#;

fn local_config(grace: &str) -> SubstrateConfig {
    substrate(&format!(
        r#"
name = "workstation"
driver = "local"
host = "ws-1"
gpu_model = "NVIDIA RTX A6000"
gpu_uuids = ["GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111",
             "GPU-22222222-2222-2222-2222-222222222222", "GPU-33333333-3333-3333-3333-333333333333"]
grace_period = "{grace}"
accounts = {{ ada = "{account}" }}
run_as_enforcer = {as_self}
"#,
        account = support::accounts::lease_account(),
        // Not root, the enforcer can run leases only as itself, and only when told it may.
        as_self = !support::accounts::running_as_root(),
    ))
}

/// Where the local driver starts lease `id`'s command.
fn work_dir(ctx: &DriverContext, id: &str) -> std::path::PathBuf {
    ctx.state_dir.join("work").join(id)
}

fn webhook_config(url: &str, extra: &str) -> SubstrateConfig {
    substrate(&format!(
        r#"
name = "portal"
driver = "webhook"
url = "{url}"
gpu_model = "NVIDIA A100-SXM4-80GB"
capacity = 32
{extra}
"#
    ))
}

#[tokio::test]
async fn contract_simulated() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    contract(Subject::registered(
        substrate(SIMULATED),
        context(dir.path()),
        None,
        ResizeMoves::Yes,
    ))
    .await
}

#[tokio::test]
async fn contract_local_with_a_process() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    contract(Subject::registered(
        local_config("1s"),
        context(dir.path()),
        argv(&["sleep", "30"]),
        ResizeMoves::Rejected,
    ))
    .await
}

#[tokio::test]
async fn contract_local_holding_gpus_without_a_command() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    contract(Subject::registered(
        local_config("1s"),
        context(dir.path()),
        None,
        ResizeMoves::Yes,
    ))
    .await
}

#[tokio::test]
async fn contract_webhook() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let server = Provisioner::start("s3cret").await;
    contract(Subject::registered(
        webhook_config(&server.url, r#"secret = "s3cret""#),
        context(dir.path()),
        None,
        ResizeMoves::Yes,
    ))
    .await?;
    let calls = server.calls();
    assert!(calls.iter().any(|c| c.action == "resize"), "{calls:?}");
    assert!(
        calls.iter().all(|c| c.signature_ok),
        "every call was signed"
    );
    Ok(())
}

/// The contract against a Kubernetes cluster's API (`tests/support/kube_api.rs`: nodes and pods
/// served over HTTP as the API server serves them), with a pod template: provisioning creates
/// the lease's pod, reclaiming deletes it; a pod's GPUs cannot change.
#[tokio::test]
async fn contract_kubernetes() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let api = support::kube_api::KubeApi::start(vec![
        support::kube_api::gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", 8, false),
        support::kube_api::gpu_node("h100-1", "NVIDIA-H100-80GB-HBM3", 8, false),
    ]);
    let template = dir.path().join("pod.yaml");
    std::fs::write(
        &template,
        "apiVersion: v1\nkind: Pod\nmetadata:\n  labels:\n    app: trainer\nspec:\n  \
         restartPolicy: Never\n  containers:\n  - name: main\n    image: nvcr.io/nvidia/pytorch:25.01-py3\n    \
         command: [\"sleep\", \"infinity\"]\n    env:\n    - name: GPUWARDEN_LEASE_ID\n      value: stale\n  \
         - name: sidecar\n    image: busybox\n",
    )?;
    let config = substrate(&format!(
        r#"
name = "k8s"
driver = "kubernetes"
[kubernetes]
kubeconfig = "{kubeconfig}"
webhook_listen = "127.0.0.1:0"
webhook_tls = {{ cert = "/unused.pem", key = "/unused.key" }}
teams = {{ "ml-research" = "ml" }}
pod_template = "{template}"
grace_period = "20s"
"#,
        kubeconfig = api.kubeconfig(dir.path()).display(),
        template = template.display(),
    ));
    let store = k8s_store(dir.path(), &["lease-contract-1"]).await;
    contract(Subject::registered(
        config,
        context_with(dir.path(), &store),
        argv(&["python", "train.py"]),
        ResizeMoves::Rejected,
    ))
    .await?;
    // The pod it created, as the contract's first lease asked for it.
    let created: Vec<_> = api
        .seen()
        .into_iter()
        .filter(|r| r.method == "POST")
        .collect();
    ensure!(created.len() == 1, "one pod created: {created:?}");
    // The contract's lease is team vision's, which no namespace maps to: its own name.
    ensure!(
        created[0].path == "/api/v1/namespaces/vision/pods",
        "{}",
        created[0].path
    );
    let pod: Value = serde_json::from_str(&created[0].body)?;
    assert_eq!(pod["metadata"]["name"], "gpuwarden-lease-contract-1");
    assert_eq!(
        pod["metadata"]["labels"]["gpuwarden.io/lease"],
        "lease-contract-1"
    );
    assert_eq!(pod["metadata"]["labels"]["app"], "trainer");
    assert_eq!(
        pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3"
    );
    let main = &pod["spec"]["containers"][0];
    assert_eq!(main["resources"]["limits"]["nvidia.com/gpu"], "1");
    assert_eq!(main["command"], json!(["python", "train.py"]));
    for container in pod["spec"]["containers"].as_array().unwrap() {
        let lease_env: Vec<_> = container["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "GPUWARDEN_LEASE_ID")
            .collect();
        assert_eq!(
            lease_env,
            [&json!({"name": "GPUWARDEN_LEASE_ID", "value": "lease-contract-1"})]
        );
    }
    let deleted: Vec<_> = api
        .seen()
        .into_iter()
        .filter(|r| r.method == "DELETE")
        .collect();
    ensure!(!deleted.is_empty(), "the reclaim deleted the pod");
    let options: Value = serde_json::from_str(&deleted[0].body)?;
    assert_eq!(options["gracePeriodSeconds"], 20);
    Ok(())
}

/// A Kubernetes substrate's driver over `api`, with `extra` settings.
fn kubernetes_driver(
    dir: &Path,
    store: &Store,
    api: &support::kube_api::KubeApi,
    extra: &str,
) -> anyhow::Result<Box<dyn Driver>> {
    let config = substrate(&format!(
        r#"
name = "k8s"
driver = "kubernetes"
[kubernetes]
kubeconfig = "{kubeconfig}"
webhook_listen = "127.0.0.1:0"
webhook_tls = {{ cert = "/unused.pem", key = "/unused.key" }}
teams = {{ "serving" = "vision" }}
{extra}
"#,
        kubeconfig = api.kubeconfig(dir).display(),
    ));
    Ok(build(&config, &context_with(dir, store))?)
}

/// An inference lease with a Deployment template runs as a Deployment of replicas of the
/// template's GPUs; resizing it scales the Deployment, to whole replicas only.
#[tokio::test]
async fn kubernetes_inference_runs_as_a_deployment_resized_by_scaling() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let api = support::kube_api::KubeApi::start(vec![support::kube_api::gpu_node(
        "h100-0",
        "NVIDIA-H100-80GB-HBM3",
        8,
        false,
    )]);
    let template = dir.path().join("deployment.yaml");
    std::fs::write(
        &template,
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  labels: {app: llm}
spec:
  replicas: 1
  selector: {matchLabels: {app: llm}}
  template:
    metadata:
      labels: {app: llm}
    spec:
      containers:
      - name: server
        image: vllm/vllm-openai:v0.9.0
        resources:
          limits: {nvidia.com/gpu: "2"}
"#,
    )?;
    let store = k8s_store(dir.path(), &["lease-llm"]).await;
    let driver = kubernetes_driver(
        dir.path(),
        &store,
        &api,
        &format!("deployment_template = \"{}\"", template.display()),
    )?;
    assert!(driver.resizes());
    let mut spec = lease("lease-llm", "NVIDIA H100 80GB HBM3", Vec::new(), None);
    spec.workload = Workload::Inference;
    spec.gpu_count = 4;
    driver.provision(&spec).await?;
    driver
        .provision(&spec)
        .await
        .context("provisioning twice")?;
    assert_eq!(driver.status("lease-llm").await?, LeaseStatus::Running);
    let made = api
        .deployment("serving", "gpuwarden-lease-llm")
        .context("the deployment is in the team's namespace")?;
    assert_eq!(made["spec"]["replicas"], 2, "4 GPUs at 2 a replica");
    assert_eq!(
        made["spec"]["selector"],
        json!({"matchLabels": {"gpuwarden.io/lease": "lease-llm"}})
    );
    let template = &made["spec"]["template"];
    assert_eq!(
        template["metadata"]["labels"]["gpuwarden.io/lease"],
        "lease-llm"
    );
    assert_eq!(template["metadata"]["labels"]["app"], "llm");
    assert_eq!(
        template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "2"
    );
    assert_eq!(
        template["spec"]["containers"][0]["env"][0]["value"],
        "lease-llm"
    );
    assert_eq!(
        template["spec"]["nodeSelector"]["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3"
    );

    spec.gpu_count = 8;
    driver.resize(&spec).await?;
    assert_eq!(
        api.deployment("serving", "gpuwarden-lease-llm").unwrap()["spec"]["replicas"],
        4
    );
    spec.gpu_count = 3;
    assert!(matches!(
        driver.resize(&spec).await,
        Err(DriverError::Rejected { .. })
    ));
    let scales: Vec<_> = api
        .seen()
        .into_iter()
        .filter(|r| r.method == "PATCH")
        .collect();
    assert_eq!(scales.len(), 1, "{scales:?}");
    assert!(scales[0]
        .path
        .ends_with("/deployments/gpuwarden-lease-llm/scale"));

    // A restart keeps it; reclaiming deletes the Deployment (its pods go with it).
    drop(driver);
    let driver = kubernetes_driver(
        dir.path(),
        &store,
        &api,
        &format!(
            "deployment_template = \"{}\"",
            dir.path().join("deployment.yaml").display()
        ),
    )?;
    assert_eq!(driver.status("lease-llm").await?, LeaseStatus::Running);
    driver.reclaim("lease-llm", ReleaseReason::Idle).await?;
    assert!(api.deployment("serving", "gpuwarden-lease-llm").is_none());
    assert_eq!(driver.status("lease-llm").await?, LeaseStatus::Gone);
    driver.reclaim("lease-llm", ReleaseReason::Idle).await?;
    Ok(())
}

/// With `reclaim = "evict"`, a reclaim goes through the Eviction API with the grace period, and
/// a PodDisruptionBudget that forbids it makes the reclaim fail as retryable.
#[tokio::test]
async fn kubernetes_reclaim_by_eviction_respects_disruption_budgets() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let api = support::kube_api::KubeApi::start(vec![support::kube_api::gpu_node(
        "h100-0",
        "NVIDIA-H100-80GB-HBM3",
        8,
        false,
    )]);
    let template = dir.path().join("pod.yaml");
    std::fs::write(
        &template,
        "spec:\n  containers:\n  - name: main\n    image: busybox\n",
    )?;
    let store = k8s_store(dir.path(), &["lease-evict"]).await;
    let driver = kubernetes_driver(
        dir.path(),
        &store,
        &api,
        &format!(
            "pod_template = \"{}\"\nreclaim = \"evict\"\ngrace_period = \"7s\"",
            template.display()
        ),
    )?;
    let spec = lease("lease-evict", "NVIDIA H100 80GB HBM3", Vec::new(), None);
    driver.provision(&spec).await?;
    api.block_evictions(true);
    match driver.reclaim("lease-evict", ReleaseReason::Idle).await {
        Err(DriverError::Unavailable { message, .. }) => {
            assert!(message.contains("disruption budget"), "{message}")
        }
        other => bail!("a blocked eviction: {other:?}"),
    }
    assert_eq!(driver.status("lease-evict").await?, LeaseStatus::Running);
    api.block_evictions(false);
    driver.reclaim("lease-evict", ReleaseReason::Idle).await?;
    assert_eq!(driver.status("lease-evict").await?, LeaseStatus::Gone);
    let evictions: Vec<_> = api
        .seen()
        .into_iter()
        .filter(|r| r.path.ends_with("/eviction"))
        .collect();
    assert_eq!(evictions.len(), 2);
    let body: Value = serde_json::from_str(&evictions[1].body)?;
    assert_eq!(body["kind"], "Eviction");
    assert_eq!(body["deleteOptions"]["gracePeriodSeconds"], 7);
    Ok(())
}

// ---- simulated ------------------------------------------------------------------------------

/// The contract against a real Slurm cluster (`tests/support/slurm.rs`, Debian's slurmctld and
/// slurmd with fake GPUs): each lease is a batch job submitted as the user's system account, and
/// a resize to other GPUs is refused (Slurm cannot change a running job's GPUs). Needs root.
/// A domain template for libvirt's test hypervisor (`type='test'`).
#[cfg(feature = "libvirt")]
const LIBVIRT_TEMPLATE: &str =
    "<domain type='test'><name>{{name}}</name><memory unit='MiB'>64</memory>\
    <os><type>hvm</type></os><devices/></domain>";

#[cfg(feature = "libvirt")]
#[tokio::test]
async fn contract_libvirt() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // libvirt's test hypervisor (in this process, in memory) lives as long as a connection to
    // it is open: this one stands for the host, which outlives the enforcer's restarts.
    let _host = virt::connect::Connect::open(Some("test:///default"))?;
    let template = dir.path().join("domain.xml");
    std::fs::write(&template, LIBVIRT_TEMPLATE)?;
    contract(Subject::registered(
        substrate(&format!(
            r#"
name = "vms"
driver = "libvirt"
[libvirt]
uri = "test:///default"
domain_template = "{}"
grace_period = "1s"
gpus = [
  {{ pci = "0000:41:00.0", model = "NVIDIA H100 80GB HBM3" }},
  {{ pci = "0000:42:00.0", model = "NVIDIA H100 80GB HBM3" }},
]
"#,
            template.display()
        )),
        context(dir.path()),
        None,
        ResizeMoves::Rejected,
    ))
    .await
}

#[tokio::test]
async fn contract_slurm() -> anyhow::Result<()> {
    if !support::slurm::can_run_slurm() {
        eprintln!("skipped: a Slurm cluster needs root (CI runs as root)");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let cluster = support::slurm::SlurmCluster::start(
        &dir.path().join("slurm"),
        &support::slurm::SlurmOptions {
            cluster_name: "contract",
            ..Default::default()
        },
    );
    let account = support::accounts::TestAccount::create("slc");
    let config = substrate(&format!(
        r#"
name = "hpc"
driver = "slurm"
accounts = {{ ada = "{account}" }}
work_dir = "{jobs}"
[slurm]
cluster = "contract"
slurm_conf = "{conf}"
poll = "500ms"
models = {{ h100 = "NVIDIA H100 80GB HBM3" }}
"#,
        account = account.name,
        jobs = cluster.jobs_dir.display(),
        conf = cluster.conf_path().display(),
    ));
    contract(Subject::registered(
        config,
        context(dir.path()),
        argv(&["sleep", "300"]),
        ResizeMoves::Rejected,
    ))
    .await?;
    // The job it ran was the lease's, as the account, and it was cancelled.
    let jobs = cluster.squeue_json();
    let job = jobs["jobs"]
        .as_array()
        .and_then(|jobs| {
            jobs.iter()
                .find(|j| j["name"] == "gpuwarden-lease-contract-1")
        })
        .context("the lease's job is still known to squeue")?;
    ensure!(job["user_name"] == account.name.as_str(), "{job}");
    ensure!(job["job_state"] == "CANCELLED", "{job}");
    ensure!(job["comment"] == "gpuwarden: reclaimed (user)", "{job}");
    ensure!(job["tres_per_node"] == "gres:gpu:h100:1", "{job}");
    Ok(())
}

#[tokio::test]
async fn simulated_inventory_is_the_collector_fleet() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = substrate(SIMULATED);
    let driver = build(&config, &context(dir.path()))?;
    let fleet = gpuwarden_schema::fleet::simulated_inventory(&config);
    let inventory = driver.inventory().await?;
    assert_eq!(inventory.gpus.len(), 20);
    assert_eq!(fleet.len(), 20);
    for (gpu, sim) in inventory.gpus.iter().zip(&fleet) {
        assert_eq!(
            (&gpu.uuid, &gpu.host, gpu.index, &gpu.model),
            (&sim.uuid, &sim.host, sim.index, &sim.model)
        );
    }
    let unknown = lease("lease-x", "NVIDIA L40S", vec!["GPU-not-here".into()], None);
    assert!(matches!(
        driver.provision(&unknown).await,
        Err(DriverError::Rejected { .. })
    ));
    Ok(())
}

#[tokio::test]
async fn simulated_state_survives_a_torn_journal_line_and_is_compacted() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = substrate(SIMULATED);
    let uuids: Vec<String> = gpuwarden_schema::fleet::simulated_inventory(&config)
        .into_iter()
        .map(|g| g.uuid)
        .collect();
    let model = "NVIDIA H100 80GB HBM3";
    {
        let driver = build(&config, &context(dir.path()))?;
        for (i, uuid) in uuids.iter().take(3).enumerate() {
            let spec = lease(&format!("lease-{i}"), model, vec![uuid.clone()], None);
            driver.provision(&spec).await?;
        }
        driver.reclaim("lease-1", ReleaseReason::User).await?;
    }
    let state = context(dir.path()).state_dir;
    let log = state.join("leases.log");
    // Three grants and a reclaim, one line each; then a crash in the middle of a fourth.
    assert_eq!(std::fs::read_to_string(&log)?.lines().count(), 4);
    let mut torn = std::fs::OpenOptions::new().append(true).open(&log)?;
    std::io::Write::write_all(&mut torn, br#"{"lease":"lease-9","gpus":["GPU-"#)?;
    drop(torn);

    let driver = build(&config, &context(dir.path()))?;
    assert_eq!(driver.status("lease-0").await?, LeaseStatus::Running);
    assert_eq!(driver.status("lease-1").await?, LeaseStatus::Gone);
    assert_eq!(driver.status("lease-2").await?, LeaseStatus::Running);
    assert_eq!(driver.status("lease-9").await?, LeaseStatus::Gone);
    assert_eq!(
        std::fs::read(&log)?.len(),
        0,
        "the log is folded into leases.json"
    );
    let snapshot: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join("leases.json"))?)?;
    assert_eq!(snapshot["leases"].as_object().map(|m| m.len()), Some(2));

    // Damage before the last line is not guessed around.
    std::fs::write(&log, "not json\n{\"lease\":\"lease-0\"}\n")?;
    let err = build(&config, &context(dir.path())).unwrap_err();
    assert!(err.to_string().contains("leases.log line 1"), "{err}");
    Ok(())
}

// ---- local ----------------------------------------------------------------------------------

fn record_pid(context: &DriverContext, lease_id: &str) -> anyhow::Result<i32> {
    let text = std::fs::read_to_string(context.state_dir.join(format!("{lease_id}.json")))?;
    let value: Value = serde_json::from_str(&text)?;
    let pid = value["process"]["pid"]
        .as_i64()
        .context("record has a pid")?;
    Ok(i32::try_from(pid)?)
}

/// Alive and not a zombie (the test process is the parent of a re-adopted child and never
/// reaps it).
fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => match stat.rfind(')') {
            Some(i) => !stat[i + 1..].trim_start().starts_with(['Z', 'X']),
            None => false,
        },
        Err(_) => false,
    }
}

/// The text of `path` once its last line is written (up to 10 s).
async fn wait_for_file(path: &Path) -> String {
    eventually_async(
        &format!("{} written", path.display()),
        Duration::from_secs(10),
        async || match std::fs::read_to_string(path) {
            Ok(text) if text.ends_with('\n') => Ok(text),
            other => Err(format!("{other:?}")),
        },
    )
    .await
}

#[tokio::test]
async fn local_child_sees_its_gpus_and_lease_id_and_logs_to_the_state_dir() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = local_config("1s");
    let ctx = context(dir.path());
    let driver = build(&config, &ctx)?;
    let env_file = work_dir(&ctx, "lease-env").join("env.txt");
    let gpus = vec![config.gpu_uuids[2].clone(), config.gpu_uuids[0].clone()];
    let spec = lease(
        "lease-env",
        "NVIDIA RTX A6000",
        gpus,
        argv(&[
            "sh",
            "-c",
            r#"echo "to the log"; printf '%s\n%s\n' "$CUDA_VISIBLE_DEVICES" "$GPUWARDEN_LEASE_ID" > env.txt; exec sleep 30"#,
        ]),
    );
    driver.provision(&spec).await?;
    assert_eq!(wait_for_file(&env_file).await, "2,0\nlease-env\n");
    let log = wait_for_file(&ctx.state_dir.join("lease-env.log")).await;
    assert_eq!(log, "to the log\n");
    let pid = record_pid(&ctx, "lease-env")?;
    assert!(process_alive(pid));

    // The lease's GPUs are taken, the others are not, and only configured GPUs exist.
    let clash = lease(
        "lease-clash",
        "NVIDIA RTX A6000",
        vec![config.gpu_uuids[0].clone()],
        None,
    );
    assert!(matches!(
        driver.provision(&clash).await,
        Err(DriverError::Rejected { .. })
    ));
    let free = lease(
        "lease-free",
        "NVIDIA RTX A6000",
        vec![config.gpu_uuids[1].clone()],
        None,
    );
    driver.provision(&free).await?;
    let stranger = lease(
        "lease-stranger",
        "NVIDIA RTX A6000",
        vec!["GPU-elsewhere".into()],
        None,
    );
    assert!(matches!(
        driver.provision(&stranger).await,
        Err(DriverError::Rejected { .. })
    ));

    // A polite process ends on SIGTERM, well before the grace period.
    let started = Instant::now();
    driver.reclaim("lease-env", ReleaseReason::Idle).await?;
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(driver.status("lease-env").await?, LeaseStatus::Exited(None));
    assert!(!process_alive(pid));
    assert!(!ctx.state_dir.join("lease-env.json").exists());
    driver.reclaim("lease-free", ReleaseReason::User).await?;
    Ok(())
}

#[tokio::test]
async fn local_sigkill_follows_sigterm_after_the_grace_period() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ctx = context(dir.path());
    let config = local_config("600ms");
    let driver = build(&config, &ctx)?;
    let ready = work_dir(&ctx, "lease-stubborn").join("ready");
    let spec = lease(
        "lease-stubborn",
        "NVIDIA RTX A6000",
        vec![config.gpu_uuids[3].clone()],
        argv(&[
            "sh",
            "-c",
            r#"trap 'echo got TERM' TERM; echo $$ > ready; while :; do sleep 0.05; done"#,
        ]),
    );
    driver.provision(&spec).await?;
    wait_for_file(&ready).await;
    let started = Instant::now();
    driver
        .reclaim("lease-stubborn", ReleaseReason::Budget)
        .await?;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(600),
        "SIGKILL came before the grace period: {took:?}"
    );
    assert!(took < Duration::from_secs(5), "reclaim took {took:?}");
    // Killed by a signal: no exit code.
    assert_eq!(
        driver.status("lease-stubborn").await?,
        LeaseStatus::Exited(None)
    );
    let log = std::fs::read_to_string(ctx.state_dir.join("lease-stubborn.log"))?;
    assert!(
        log.contains("got TERM"),
        "the child saw SIGTERM first: {log:?}"
    );
    Ok(())
}

#[tokio::test]
async fn local_reports_the_exit_code_of_a_process_that_ended() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = local_config("1s");
    let driver = build(&config, &context(dir.path()))?;
    let spec = lease(
        "lease-batch",
        "NVIDIA RTX A6000",
        vec![config.gpu_uuids[0].clone()],
        argv(&["sh", "-c", "exit 3"]),
    );
    driver.provision(&spec).await?;
    let code = eventually_async(
        "the process ends",
        Duration::from_secs(10),
        async || match driver.status("lease-batch").await {
            Ok(LeaseStatus::Exited(code)) => Ok(code),
            Ok(LeaseStatus::Running) => Err("running"),
            Ok(LeaseStatus::Gone) => panic!("the driver lost its own child"),
            Err(e) => panic!("status: {e}"),
        },
    )
    .await;
    assert_eq!(code, Some(3));
    // Its GPU is free again.
    let next = lease(
        "lease-next",
        "NVIDIA RTX A6000",
        vec![config.gpu_uuids[0].clone()],
        None,
    );
    driver.provision(&next).await?;
    Ok(())
}

#[tokio::test]
async fn local_restart_readopts_live_children_and_reports_dead_ones_gone() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ctx = context(dir.path());
    let config = local_config("2s");
    let driver = build(&config, &ctx)?;
    for (id, gpu) in [("lease-live", 0), ("lease-dead", 1)] {
        let spec = lease(
            id,
            "NVIDIA RTX A6000",
            vec![config.gpu_uuids[gpu].clone()],
            argv(&["sleep", "30"]),
        );
        driver.provision(&spec).await?;
    }
    let live = record_pid(&ctx, "lease-live")?;
    let dead = record_pid(&ctx, "lease-dead")?;
    drop(driver);

    let killed = std::process::Command::new("kill")
        .args(["-KILL", &dead.to_string()])
        .status()?;
    assert!(killed.success());
    eventually_async(
        &format!("kill -KILL ends {dead}"),
        Duration::from_secs(5),
        async || {
            if process_alive(dead) {
                Err("alive")
            } else {
                Ok(())
            }
        },
    )
    .await;

    let driver = build(&config, &ctx)?;
    assert_eq!(driver.status("lease-live").await?, LeaseStatus::Running);
    assert_eq!(driver.status("lease-dead").await?, LeaseStatus::Gone);
    // The dead lease's GPU is free; the live one's is still held.
    let on_dead = lease(
        "lease-after",
        "NVIDIA RTX A6000",
        vec![config.gpu_uuids[1].clone()],
        None,
    );
    driver.provision(&on_dead).await?;
    let on_live = lease(
        "lease-clash",
        "NVIDIA RTX A6000",
        vec![config.gpu_uuids[0].clone()],
        None,
    );
    assert!(matches!(
        driver.provision(&on_live).await,
        Err(DriverError::Rejected { .. })
    ));

    // Reclaim still reaches the re-adopted process by its pid.
    driver.reclaim("lease-live", ReleaseReason::Admin).await?;
    assert!(!process_alive(live), "re-adopted process survived reclaim");
    assert_ne!(driver.status("lease-live").await?, LeaseStatus::Running);
    driver.reclaim("lease-dead", ReleaseReason::Admin).await?;
    assert!(!ctx.state_dir.join("lease-dead.json").exists());
    Ok(())
}

#[tokio::test]
async fn local_never_takes_a_recycled_pid_for_its_process() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ctx = context(dir.path());
    std::fs::create_dir_all(&ctx.state_dir)?;
    // A record naming this very test process, with a start time it does not have.
    let me = std::process::id();
    std::fs::write(
        ctx.state_dir.join("lease-old.json"),
        serde_json::to_vec(&json!({
            "lease_id": "lease-old",
            "gpu_uuids": ["GPU-00000000-0000-0000-0000-000000000000"],
            "process": {"pid": me, "start_time": 1},
        }))?,
    )?;
    let driver = build(&local_config("1s"), &ctx)?;
    assert_eq!(driver.status("lease-old").await?, LeaseStatus::Gone);
    // Were it signalled, this test would not finish.
    driver.reclaim("lease-old", ReleaseReason::Admin).await?;
    assert!(!ctx.state_dir.join("lease-old.json").exists());
    Ok(())
}

/// The issue's attack: a member's lease command that reads /etc/shadow and prints its identity.
/// It runs as the account the user maps to, with that account's groups, a scrubbed environment,
/// in a directory of its own, and cannot read the file. Needs root (to make the account); CI runs
/// as root.
#[tokio::test]
async fn local_runs_the_command_as_the_user_s_account_not_as_the_enforcer() -> anyhow::Result<()> {
    if !support::accounts::running_as_root() {
        eprintln!("skipped: making a test account needs root");
        return Ok(());
    }
    let account = support::accounts::TestAccount::create("drv");
    let dir = tempfile::tempdir()?;
    let ctx = context(dir.path());
    let mut config = local_config("1s");
    config.accounts = BTreeMap::from([("ada".to_owned(), account.name.clone())]);
    let driver = build(&config, &ctx)?;
    let spec = lease(
        "lease-who",
        "NVIDIA RTX A6000",
        vec![config.gpu_uuids[1].clone()],
        argv(&[
            "sh",
            "-c",
            "id -u > uid; id -G > groups; env | sort > env; pwd > pwd; \
             grep NoNewPrivs /proc/self/status > nnp; echo $$ > pid; cut -d' ' -f6 /proc/$$/stat > sid; \
             head -2 /etc/shadow > shadow 2> shadow.err; echo $? > shadow.rc; echo ok > done",
        ]),
    );
    driver.provision(&spec).await?;
    let work = work_dir(&ctx, "lease-who");
    wait_for_file(&work.join("done")).await;
    let read = |f: &str| std::fs::read_to_string(work.join(f)).expect(f);
    assert_eq!(read("uid").trim(), account.uid().to_string());
    let groups: Vec<u32> = read("groups")
        .split_whitespace()
        .map(|g| g.parse().expect("gid"))
        .collect();
    assert!(
        groups.contains(&account.group_gid()),
        "the account's supplementary group is kept: {groups:?}"
    );
    assert!(!groups.contains(&0), "no root group: {groups:?}");
    assert_eq!(read("nnp").split_whitespace().last(), Some("1"));
    // A session of its own: the enforcer's terminal (if any) is out of its reach.
    assert_eq!(
        read("sid"),
        read("pid"),
        "the command leads its own session"
    );
    let log_mode = std::fs::metadata(ctx.state_dir.join("lease-who.log"))?.permissions();
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        log_mode.mode() & 0o777,
        0o600,
        "only the enforcer reads the log"
    );
    assert_ne!(
        read("shadow.rc").trim(),
        "0",
        "read /etc/shadow: {}",
        read("shadow")
    );
    assert!(read("shadow").is_empty());
    // Only the account's basics and the lease's variables; nothing of the enforcer's environment.
    let names: Vec<String> = read("env")
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k.to_owned()))
        .collect();
    let expected = [
        "CUDA_VISIBLE_DEVICES",
        "GPUWARDEN_LEASE_ID",
        "GPUWARDEN_PROJECT",
        "GPUWARDEN_TEAM",
        "GPUWARDEN_USER",
        "GPUWARDEN_WORKLOAD",
        "HOME",
        "LOGNAME",
        "PATH",
        "PWD",
        "SHELL",
        "USER",
    ];
    // sh may add its own (SHLVL, OLDPWD); every other name must be one of the expected.
    let extra: Vec<&String> = names
        .iter()
        .filter(|n| {
            !expected.contains(&n.as_str()) && !["SHLVL", "OLDPWD", "_"].contains(&n.as_str())
        })
        .collect();
    assert!(extra.is_empty(), "unexpected variables: {extra:?}");
    let env = read("env");
    assert!(env.contains(&format!("USER={}\n", account.name)), "{env}");
    assert!(env.contains("GPUWARDEN_USER=ada\n"), "{env}");
    assert!(env.contains("CUDA_VISIBLE_DEVICES=1\n"), "{env}");
    assert_eq!(read("pwd").trim(), work.to_str().context("utf-8")?);
    let meta = std::fs::metadata(&work)?;
    use std::os::unix::fs::MetadataExt as _;
    assert_eq!(meta.uid(), account.uid());
    assert_eq!(meta.permissions().mode() & 0o777, 0o700);
    driver.reclaim("lease-who", ReleaseReason::User).await?;

    // An account in a group as good as root is refused, whatever its uid.
    config.denied_groups = Some(vec![account.group.clone()]);
    let driver = build(&config, &context(&dir.path().join("2")))?;
    let refusal = driver.refusal("ada").await.context("refused")?;
    assert_eq!(refusal.code, RefusalCode::AccountPrivileged);
    assert!(
        refusal.message.contains(&account.group),
        "{}",
        refusal.message
    );
    Ok(())
}

/// Admission asks the driver first: a user with no account, or one mapped to root or to a system
/// account under `min_uid`, is refused with its code, and provisioning such a lease is refused too.
#[tokio::test]
async fn local_refuses_users_without_an_account_or_with_a_privileged_one() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ctx = context(dir.path());
    let mut config = local_config("1s");
    config.accounts.insert("rooted".into(), "root".into());
    config.accounts.insert("daemonic".into(), "daemon".into());
    config
        .accounts
        .insert("ghost".into(), "no-such-account-gw".into());
    let driver = build(&config, &ctx)?;
    assert_eq!(driver.refusal("ada").await, None);
    for (user, code, says) in [
        ("bob", RefusalCode::AccountUnmapped, "has no system account"),
        ("ghost", RefusalCode::AccountUnmapped, "does not exist"),
        ("rooted", RefusalCode::AccountPrivileged, "which is root"),
        ("daemonic", RefusalCode::AccountPrivileged, "below"),
    ] {
        let refusal = driver.refusal(user).await.context(user)?;
        assert_eq!(refusal.code, code, "{user}: {}", refusal.message);
        assert!(
            refusal.message.contains(says),
            "{user}: {}",
            refusal.message
        );
        let mut spec = lease(
            &format!("lease-{user}"),
            "NVIDIA RTX A6000",
            vec![config.gpu_uuids[0].clone()],
            argv(&["true"]),
        );
        spec.user = user.to_owned();
        assert!(
            matches!(
                driver.provision(&spec).await,
                Err(DriverError::Rejected { .. })
            ),
            "{user}"
        );
    }
    // A work_dir others may write is refused: one of them could swap a lease's directory.
    let open_root = dir.path().join("open");
    std::fs::create_dir(&open_root)?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&open_root, std::fs::Permissions::from_mode(0o777))?;
    let mut open = config.clone();
    open.work_dir = Some(open_root);
    let driver = build(&open, &context(&dir.path().join("open-state")))?;
    let err = driver
        .provision(&lease(
            "lease-open",
            "NVIDIA RTX A6000",
            vec![open.gpu_uuids[0].clone()],
            argv(&["true"]),
        ))
        .await
        .expect_err("a world-writable work_dir is refused");
    assert!(err.to_string().contains("writable by no one else"), "{err}");

    // With same_name_accounts, an unlisted user runs as the account of its own name.
    config.same_name_accounts = Some(true);
    let driver = build(&config, &context(&dir.path().join("2")))?;
    let refusal = driver.refusal("root").await.context("root by name")?;
    assert_eq!(refusal.code, RefusalCode::AccountPrivileged);
    let me = support::accounts::lease_account();
    if !support::accounts::running_as_root() {
        assert_eq!(driver.refusal(&me).await, None);
    }
    Ok(())
}

#[tokio::test]
async fn local_refuses_lease_ids_that_are_not_file_names() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = local_config("1s");
    let driver = build(&config, &context(dir.path()))?;
    for id in ["../escape", ".hidden", "", "a/b"] {
        let spec = lease(
            id,
            "NVIDIA RTX A6000",
            vec![config.gpu_uuids[0].clone()],
            None,
        );
        assert!(
            matches!(
                driver.provision(&spec).await,
                Err(DriverError::Rejected { .. })
            ),
            "{id:?}"
        );
    }
    Ok(())
}

// ---- config errors --------------------------------------------------------------------------

#[test]
fn a_bad_config_names_the_field_at_fault() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ctx = context(dir.path());
    let webhook = "name = \"w\"\ndriver = \"webhook\"\n";
    let local = "name = \"l\"\ndriver = \"local\"\n";
    let cases = [
        (format!("{webhook}gpu_model = \"A100\"\ncapacity = 4"), "url"),
        (
            format!("{webhook}url = \"ftp://example.com/hook\"\ngpu_model = \"A100\"\ncapacity = 4"),
            "url",
        ),
        (
            format!("{webhook}url = \"http://127.0.0.1:9/hook\"\ngpu_model = \"A100\"\ncapacity = 0"),
            "capacity",
        ),
        (
            format!("{webhook}url = \"http://127.0.0.1:9/hook\"\ngpu_model = \"A100\""),
            "capacity",
        ),
        (format!("{webhook}url = \"http://127.0.0.1:9/hook\"\ncapacity = 4"), "gpu_model"),
        (
            format!(
                "{webhook}url = \"http://127.0.0.1:9/hook\"\ngpu_model = \"A100\"\ncapacity = 4\nsecret = \"\""
            ),
            "secret",
        ),
        (format!("{local}gpu_model = \"RTX A6000\""), "gpu_uuids"),
        (format!("{local}gpu_uuids = [\"GPU-1\"]"), "gpu_model"),
        (
            format!("{local}gpu_model = \"RTX A6000\"\ngpu_uuids = [\"GPU-1\", \"GPU-1\"]"),
            "gpu_uuids",
        ),
        ("name = \"s\"\ndriver = \"simulated\"".to_owned(), "hosts"),
    ];
    for (text, expected) in cases {
        match build(&substrate(&text), &ctx) {
            Err(DriverError::Config {
                field, substrate, ..
            }) => {
                assert_eq!(field, expected, "{text}");
                assert!(["w", "l", "s"].contains(&substrate.as_str()));
            }
            other => panic!("{text}: expected a Config error on {expected}, got {other:?}"),
        }
    }
}

// ---- webhook --------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Seen {
    action: String,
    body: Value,
    signature_ok: bool,
    timestamp: u64,
}

/// A provisioner that checks signatures, records every call, can fail the first N calls with
/// 503, can be slow, refuses leases labelled `reject`, and answers status from what it ran.
#[derive(Default)]
struct Provisioner {
    secret: String,
    fail_first: AtomicU32,
    delay_ms: AtomicU32,
    calls: Mutex<Vec<Seen>>,
    leases: Mutex<HashMap<String, &'static str>>,
}

struct Server {
    url: String,
    state: Arc<Provisioner>,
}

impl Server {
    fn calls(&self) -> Vec<Seen> {
        self.state.calls.lock().expect("lock").clone()
    }
}

impl Provisioner {
    async fn start(secret: &str) -> Server {
        let state = Arc::new(Provisioner {
            secret: secret.to_owned(),
            ..Provisioner::default()
        });
        let app = axum::Router::new()
            .route("/hook", axum::routing::post(answer))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        Server {
            url: format!("http://{addr}/hook"),
            state,
        }
    }
}

async fn answer(
    State(p): State<Arc<Provisioner>>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    };
    let timestamp: u64 = header(drivers::webhook::TIMESTAMP_HEADER)
        .parse()
        .unwrap_or(0);
    let expected = drivers::webhook::signature(p.secret.as_bytes(), timestamp, &body);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let signature_ok = header(drivers::webhook::SIGNATURE_HEADER) == expected
        && timestamp.abs_diff(now) <= 300
        && header("content-type") == "application/json";
    let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let action = value["action"].as_str().unwrap_or("").to_owned();
    p.calls.lock().expect("lock").push(Seen {
        action: action.clone(),
        body: value.clone(),
        signature_ok,
        timestamp,
    });
    if !signature_ok {
        return (StatusCode::UNAUTHORIZED, "bad signature".into());
    }
    if p.fail_first
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return (StatusCode::SERVICE_UNAVAILABLE, "warming up".into());
    }
    let delay = p.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay.into())).await;
    }
    let id = value["lease"]["lease_id"].as_str().unwrap_or("").to_owned();
    let mut leases = p.leases.lock().expect("lock");
    match action.as_str() {
        "provision" if value["lease"]["labels"]["reject"].is_string() => (
            StatusCode::UNPROCESSABLE_ENTITY,
            "no A100s for this project".into(),
        ),
        "provision" => {
            leases.insert(id, "running");
            (StatusCode::OK, "{}".into())
        }
        "resize" if leases.get(&id) == Some(&"running") => (StatusCode::NO_CONTENT, String::new()),
        "resize" => (StatusCode::CONFLICT, "not running".into()),
        "reclaim" => {
            leases.insert(id, "gone");
            (StatusCode::OK, String::new())
        }
        "status" => {
            let state = leases.get(&id).copied().unwrap_or("gone");
            (StatusCode::OK, json!({ "state": state }).to_string())
        }
        _ => (StatusCode::BAD_REQUEST, "unknown action".into()),
    }
}

fn pooled_lease(id: &str) -> LeaseSpec {
    lease(id, "NVIDIA A100-SXM4-80GB", Vec::new(), None)
}

fn no_state() -> DriverContext {
    DriverContext {
        state_dir: "/nonexistent/webhook-keeps-no-state".into(),
        lease_refs: None,
    }
}

#[tokio::test]
async fn webhook_signs_and_sends_the_whole_lease() -> anyhow::Result<()> {
    let server = Provisioner::start("s3cret").await;
    let driver = build(
        &webhook_config(&server.url, r#"secret = "s3cret""#),
        &no_state(),
    )?;
    driver.provision(&pooled_lease("lease-w1")).await?;
    driver.reclaim("lease-w1", ReleaseReason::Idle).await?;
    let calls = server.calls();
    assert_eq!(calls.len(), 2);
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    assert!(calls
        .iter()
        .all(|c| c.signature_ok && now.abs_diff(c.timestamp) <= 5));
    assert_eq!(
        calls[0].body,
        json!({
            "action": "provision",
            "lease": {
                "lease_id": "lease-w1", "team": "vision", "user": "ada", "project": "detector",
                "workload": "training", "gpu_model": "NVIDIA A100-SXM4-80GB", "gpu_count": 1,
                "gpu_uuids": [], "command": null, "labels": {"run": "42"},
            },
        })
    );
    assert_eq!(
        calls[1].body,
        json!({"action": "reclaim", "lease": {"lease_id": "lease-w1"}, "reason": "idle"})
    );
    assert_eq!(
        driver.inventory().await?.pooled,
        vec![("NVIDIA A100-SXM4-80GB".to_owned(), 32)]
    );
    Ok(())
}

#[tokio::test]
async fn webhook_with_the_wrong_secret_is_refused_once_not_retried() -> anyhow::Result<()> {
    let server = Provisioner::start("s3cret").await;
    let driver = build(
        &webhook_config(&server.url, r#"secret = "guess""#),
        &no_state(),
    )?;
    let err = driver
        .provision(&pooled_lease("lease-w2"))
        .await
        .expect_err("refused");
    assert!(matches!(err, DriverError::Rejected { .. }), "{err}");
    assert!(err.to_string().contains("401"), "{err}");
    assert_eq!(server.calls().len(), 1);
    Ok(())
}

#[tokio::test]
async fn webhook_retries_5xx_with_backoff_until_it_succeeds() -> anyhow::Result<()> {
    let server = Provisioner::start("s3cret").await;
    server.state.fail_first.store(2, Ordering::SeqCst);
    let config = webhook_config(&server.url, "secret = \"s3cret\"\nretries = 3");
    let driver = build(&config, &no_state())?;
    let started = Instant::now();
    driver.provision(&pooled_lease("lease-w3")).await?;
    // Two failures: waits of 0.1 s and 0.2 s before the second and third attempts.
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(server.calls().len(), 3);
    assert_eq!(driver.status("lease-w3").await?, LeaseStatus::Running);
    Ok(())
}

#[tokio::test]
async fn webhook_gives_up_after_its_retries_as_unavailable() -> anyhow::Result<()> {
    let server = Provisioner::start("s3cret").await;
    server.state.fail_first.store(100, Ordering::SeqCst);
    let config = webhook_config(&server.url, "secret = \"s3cret\"\nretries = 2");
    let driver = build(&config, &no_state())?;
    let err = driver
        .provision(&pooled_lease("lease-w4"))
        .await
        .expect_err("fails");
    assert!(matches!(err, DriverError::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains("503"), "{err}");
    assert_eq!(server.calls().len(), 3, "one attempt and two retries");
    Ok(())
}

#[tokio::test]
async fn webhook_does_not_retry_a_4xx() -> anyhow::Result<()> {
    let server = Provisioner::start("s3cret").await;
    let driver = build(
        &webhook_config(&server.url, r#"secret = "s3cret""#),
        &no_state(),
    )?;
    let mut spec = pooled_lease("lease-w5");
    spec.labels.insert("reject".into(), "yes".into());
    let err = driver.provision(&spec).await.expect_err("refused");
    assert!(matches!(err, DriverError::Rejected { .. }), "{err}");
    assert!(
        err.to_string().contains("no A100s for this project"),
        "{err}"
    );
    assert_eq!(server.calls().len(), 1);
    Ok(())
}

#[tokio::test]
async fn webhook_retries_a_timeout_then_is_unavailable() -> anyhow::Result<()> {
    let server = Provisioner::start("s3cret").await;
    server.state.delay_ms.store(2_000, Ordering::SeqCst);
    let config = webhook_config(
        &server.url,
        "secret = \"s3cret\"\nretries = 1\ntimeout = \"200ms\"",
    );
    let driver = build(&config, &no_state())?;
    let started = Instant::now();
    let err = driver.status("lease-w6").await.expect_err("times out");
    assert!(matches!(err, DriverError::Unavailable { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_millis(1_500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(server.calls().len(), 2);
    Ok(())
}

#[tokio::test]
async fn webhook_that_nobody_answers_is_unavailable() -> anyhow::Result<()> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    drop(listener);
    let config = webhook_config(&format!("http://{addr}/hook"), "retries = 1");
    let driver = build(&config, &no_state())?;
    let err = driver
        .reclaim("lease-w7", ReleaseReason::User)
        .await
        .expect_err("refused");
    assert!(matches!(err, DriverError::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains("2 attempt"), "{err}");
    Ok(())
}

/// A substrate driver written outside the enforcer crate, as a new substrate's driver would be
/// written inside it: one type implementing [`Driver`]. Its substrate keeps what runs (as Slurm
/// or a hypervisor would), so a new instance over the same substrate re-adopts it.
#[derive(Debug)]
struct Outside {
    gpus: Vec<Gpu>,
    /// The substrate: lease id → the GPUs it runs on.
    running: Arc<Mutex<BTreeMap<String, Vec<String>>>>,
}

impl Outside {
    fn new(running: Arc<Mutex<BTreeMap<String, Vec<String>>>>) -> Self {
        let gpus = (0..4)
            .map(|i| Gpu {
                uuid: format!("GPU-outside-{i}"),
                host: "outside-1".into(),
                index: i,
                model: "NVIDIA H100 80GB HBM3".into(),
            })
            .collect();
        Self { gpus, running }
    }

    fn running(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<String>>> {
        self.running.lock().expect("lock")
    }
}

#[async_trait::async_trait]
impl Driver for Outside {
    fn name(&self) -> &str {
        "outside"
    }
    async fn inventory(&self) -> Result<Arc<Inventory>, DriverError> {
        Ok(Arc::new(Inventory {
            gpus: self.gpus.clone(),
            pooled: Vec::new(),
            queues: false,
        }))
    }
    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.running()
            .insert(lease.lease_id.clone(), lease.gpu_uuids.clone());
        Ok(())
    }
    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        match self.running().get_mut(&lease.lease_id) {
            Some(gpus) => {
                *gpus = lease.gpu_uuids.clone();
                Ok(())
            }
            None => Err(DriverError::Rejected {
                substrate: "outside".into(),
                message: format!("lease {} does not run here", lease.lease_id),
            }),
        }
    }
    async fn reclaim(&self, lease_id: &str, _: ReleaseReason) -> Result<(), DriverError> {
        self.running().remove(lease_id);
        Ok(())
    }
    async fn status(&self, lease_id: &str) -> Result<LeaseStatus, DriverError> {
        Ok(match self.running().contains_key(lease_id) {
            true => LeaseStatus::Running,
            false => LeaseStatus::Gone,
        })
    }
}

/// A new substrate is one driver: the contract suite takes it as it is, and the service and the
/// HTTP API admit, place and release leases on it without a change.
#[tokio::test]
async fn a_driver_from_outside_the_crate_keeps_the_contract_and_serves_the_api(
) -> anyhow::Result<()> {
    let substrate = Arc::new(Mutex::new(BTreeMap::new()));
    let kept = substrate.clone();
    contract(Subject {
        name: "outside".into(),
        start: Box::new(move || Ok(Box::new(Outside::new(kept.clone())))),
        command: None,
        resize_moves: ResizeMoves::Yes,
    })
    .await?;

    let dir = tempfile::tempdir()?;
    let store = Store::open(&dir.path().join("enforcer.db"))?;
    let mut config = Config {
        teams: vec![TeamConfig {
            name: "ml".into(),
            members: vec!["ada".into()],
            gpu_quota: 8,
            monthly_budget_usd: 1_000.0,
            allowed_models: Vec::new(),
        }],
        tokens: vec![support::token("ada", Role::Member, &["ml"])],
        ..Config::default()
    };
    config.pricing.gpu.push(GpuPrice {
        model_match: "H100".into(),
        usd_per_gpu_hour: 4.0,
    });
    let mut drivers: BTreeMap<String, Arc<dyn Driver>> = BTreeMap::new();
    drivers.insert("outside".into(), Arc::new(Outside::new(substrate.clone())));
    let service = Service::new(
        Arc::new(config),
        store,
        drivers,
        Arc::new(ManualClock::new(1_767_225_600_000)),
    );
    let app = router(AppState::new(service));

    let ask = json!({"team": "ml", "user": "ada", "project": "p", "workload": "training",
        "gpus": 2, "duration": "1h"});
    let (status, answer) = support::call(
        &app,
        Method::POST,
        "/v1/admission",
        Some("ada"),
        Some(ask.to_string()),
    )
    .await;
    ensure!(status == StatusCode::OK, "admission: {status} {answer}");
    ensure!(answer["decision"] == "admitted", "{answer}");
    let lease = &answer["lease"];
    ensure!(lease["substrate"] == "outside", "{lease}");
    ensure!(lease["state"] == "active", "{lease}");
    let id = lease["id"].as_str().context("a lease id")?;
    let held: Vec<String> = serde_json::from_value(lease["gpu_uuids"].clone())?;
    ensure!(
        substrate.lock().expect("lock").get(id) == Some(&held),
        "the substrate runs the lease on the GPUs placement chose"
    );

    let (status, released) = support::call(
        &app,
        Method::POST,
        &format!("/v1/leases/{id}/release"),
        Some("ada"),
        None,
    )
    .await;
    ensure!(status == StatusCode::OK, "release: {status} {released}");
    ensure!(released["state"] == "released", "{released}");
    ensure!(substrate.lock().expect("lock").is_empty());
    Ok(())
}
