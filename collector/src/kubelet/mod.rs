//! GPUs held by pods on a Kubernetes node, the way dcgm-exporter finds them: the kubelet's
//! PodResources API ([`podresources`]) says which container holds which device, and the node's
//! files give each such pod's lease ([`pods`]).
//!
//! [`PodWatcher`] asks the kubelet on a thread of its own, at most once per collector interval,
//! and keeps the latest [`PodMap`] for the sampling thread, which never waits on the kubelet: a
//! slow one costs at most the call's timeout, on the watcher's thread. A kubelet that cannot be
//! reached is logged once at WARN (again at INFO once it answers), counted in
//! `gpuwarden_collector_podresources_errors_total`, and leaves samples without pods until it
//! answers.

pub mod podresources;
pub mod pods;

use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub use podresources::{PodResourcesClient, PodResourcesError};
pub use pods::{PodHold, PodMap};

use crate::metrics::Metrics;

/// The default of `collector.pod_logs_dir`: where the kubelet keeps each pod's logs.
pub const DEFAULT_POD_LOGS_DIR: &str = "/var/log/pods";

/// How long one `List` call may take before the kubelet counts as unreachable this round.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// Where and how often to ask.
#[derive(Debug, Clone)]
pub struct KubeletSettings {
    /// The kubelet's PodResources socket (`collector.kubelet_socket`).
    pub socket: PathBuf,
    /// The kubelet's pod log directory, whose entries name pods' uids
    /// (`collector.pod_logs_dir`).
    pub pod_logs_dir: PathBuf,
    /// The processes to read pods' environments from (normally `/proc`).
    pub proc_root: PathBuf,
    /// How often to ask: the collector's interval.
    pub refresh: Duration,
    /// How long one call may take.
    pub timeout: Duration,
}

impl KubeletSettings {
    /// The node's default places for a kubelet at `socket`, asked every `refresh`.
    pub fn new(socket: impl Into<PathBuf>, refresh: Duration) -> Self {
        Self {
            socket: socket.into(),
            pod_logs_dir: PathBuf::from(DEFAULT_POD_LOGS_DIR),
            proc_root: PathBuf::from("/proc"),
            refresh,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// One lookup of the node's pods: the kubelet's answer, then the pods' leases. Keeps whether
/// the kubelet was failing, so that an outage is logged once.
#[derive(Debug)]
pub struct PodLookup {
    settings: KubeletSettings,
    client: PodResourcesClient,
    metrics: Arc<Metrics>,
    failing: bool,
    logs_failing: bool,
}

impl PodLookup {
    /// A lookup with `settings`, counting failures in `metrics`.
    pub fn new(settings: KubeletSettings, metrics: Arc<Metrics>) -> Self {
        let client = PodResourcesClient::new(&settings.socket, settings.timeout);
        Self {
            settings,
            client,
            metrics,
            failing: false,
            logs_failing: false,
        }
    }

    /// Asks the kubelet which containers hold GPUs and finds their pods' leases. A kubelet
    /// that cannot be reached gives an empty map (and is logged and counted).
    pub async fn refresh(&mut self) -> PodMap {
        match self.client.list().await {
            Ok(answer) => {
                if std::mem::take(&mut self.failing) {
                    tracing::info!(socket = %self.settings.socket.display(), "the kubelet's PodResources API answers again; GPUs are attributed to pods");
                }
                let mut pods = PodMap::from_list(&answer);
                let dir = &self.settings.pod_logs_dir;
                match pods.find_leases(dir, &self.settings.proc_root) {
                    Ok(()) => self.logs_failing = false,
                    Err(e) if !std::mem::replace(&mut self.logs_failing, true) => {
                        tracing::warn!(dir = %dir.display(), error = %e, "cannot read the kubelet's pod log directory (collector.pod_logs_dir): GPUs are attributed to pods but not to their leases");
                    }
                    Err(_) => {}
                }
                pods
            }
            Err(e) => {
                self.metrics.podresources_error();
                if std::mem::replace(&mut self.failing, true) {
                    tracing::debug!(error = %e, "the kubelet's PodResources API still cannot be read");
                } else {
                    tracing::warn!(error = %e, "cannot read the kubelet's PodResources API; GPUs are sampled without their pods until it answers (retried every interval)");
                }
                PodMap::default()
            }
        }
    }
}

/// Keeps the node's [`PodMap`] fresh on a thread of its own (see the module's doc).
#[derive(Debug)]
pub struct PodWatcher {
    current: Arc<Mutex<Arc<PodMap>>>,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl PodWatcher {
    /// Starts the watcher and waits for its first lookup (at most the call's timeout, and a
    /// little), so that the first samples already carry their pods.
    pub fn start(settings: KubeletSettings, metrics: Arc<Metrics>) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let current = Arc::new(Mutex::new(Arc::new(PodMap::default())));
        let (stop, stopped) = mpsc::channel::<()>();
        let (first_tx, first_rx) = mpsc::channel::<()>();
        let wait_first = settings.timeout + Duration::from_secs(1);
        let refresh = settings.refresh.max(Duration::from_millis(100));
        let thread = {
            let current = Arc::clone(&current);
            let mut lookup = PodLookup::new(settings, metrics);
            std::thread::Builder::new()
                .name("kubelet-pods".into())
                .spawn(move || loop {
                    let pods = runtime.block_on(lookup.refresh());
                    *current.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(pods);
                    let _ = first_tx.send(());
                    match stopped.recv_timeout(refresh) {
                        Err(RecvTimeoutError::Timeout) => {}
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
                    }
                })?
        };
        let _ = first_rx.recv_timeout(wait_first);
        Ok(Self {
            current,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The latest lookup's map.
    pub fn current(&self) -> Arc<PodMap> {
        Arc::clone(&self.current.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for PodWatcher {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
pub(crate) mod test_server;

#[cfg(test)]
mod tests {
    use super::podresources::{
        ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
    };
    use super::test_server::{Answer, TestKubelet};
    use super::*;

    const GPU_A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
    const GPU_B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";
    const GPU_C: &str = "GPU-cccccccc-0000-0000-0000-000000000000";
    const MIG_C: &str = "MIG-c1c1c1c1-0000-0000-0000-000000000000";
    const UID_TRAIN: &str = "0f3c1a52-7d7e-4b8e-9a43-2c1d5e6f7a80";
    const UID_INFER: &str = "5b1e2c3d-0000-4a4a-8b8b-123456789abc";

    fn container(name: &str, resource: &str, ids: &[&str]) -> ContainerResources {
        ContainerResources {
            name: name.into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids: ids.iter().map(|s| (*s).into()).collect(),
                topology: None,
            }],
            ..Default::default()
        }
    }

    fn pod(namespace: &str, name: &str, containers: Vec<ContainerResources>) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: namespace.into(),
            containers,
            ..Default::default()
        }
    }

    /// Two pods holding GPUs by UUID (one of them two GPUs, the other a MIG device), a pod with
    /// CPUs only, and pods of a node whose device plugin names GPUs and MIG devices by index.
    fn fixture() -> ListPodResourcesResponse {
        ListPodResourcesResponse {
            pod_resources: vec![
                pod(
                    "ml",
                    "train-0",
                    vec![
                        container("trainer", "nvidia.com/gpu", &[GPU_A, GPU_B]),
                        ContainerResources {
                            name: "sidecar".into(),
                            ..Default::default()
                        },
                    ],
                ),
                pod(
                    "ml",
                    "infer-0",
                    vec![container("server", "nvidia.com/mig-1g.10gb", &[MIG_C])],
                ),
                pod(
                    "kube-system",
                    "pinned-0",
                    vec![ContainerResources {
                        name: "main".into(),
                        cpu_ids: vec![2, 3],
                        ..container("main", "example.com/nic", &["eth1"])
                    }],
                ),
                pod(
                    "web",
                    "serve-1",
                    vec![container("server", "nvidia.com/gpu", &["3"])],
                ),
                pod(
                    "web",
                    "serve-2",
                    vec![container("server", "nvidia.com/mig-1g.10gb", &["4:3"])],
                ),
            ],
        }
    }

    /// The node's files: pod log directories and a `/proc` tree.
    struct NodeFiles {
        logs: tempfile::TempDir,
        proc: tempfile::TempDir,
    }

    impl NodeFiles {
        fn new() -> Self {
            let files = Self {
                logs: tempfile::tempdir().unwrap(),
                proc: tempfile::tempdir().unwrap(),
            };
            for dir in [
                format!("ml_train-0_{UID_TRAIN}"),
                format!("ml_infer-0_{UID_INFER}"),
            ] {
                std::fs::create_dir(files.logs.path().join(dir)).unwrap();
            }
            files
        }

        fn process(&self, pid: u32, cgroup: &str, environ: &str) {
            let dir = self.proc.path().join(pid.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cgroup"), cgroup).unwrap();
            std::fs::write(dir.join("environ"), environ).unwrap();
        }

        fn settings(&self, socket: &std::path::Path, timeout: Duration) -> KubeletSettings {
            KubeletSettings {
                socket: socket.to_path_buf(),
                pod_logs_dir: self.logs.path().to_path_buf(),
                proc_root: self.proc.path().to_path_buf(),
                refresh: Duration::from_secs(3600),
                timeout,
            }
        }
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn mig_parent(mig: &str) -> Option<String> {
        (mig == MIG_C).then(|| GPU_C.to_owned())
    }

    #[test]
    fn list_goes_over_grpc_on_the_unix_socket() {
        let kubelet = TestKubelet::start(Answer::Pods(fixture()));
        let client = PodResourcesClient::new(&kubelet.socket, Duration::from_secs(10));
        let answer = runtime().block_on(client.list()).unwrap();
        assert_eq!(answer, fixture());
        assert_eq!(kubelet.calls(), 1);
    }

    #[test]
    fn gpus_are_attributed_to_their_pods_and_the_pods_leases() {
        let kubelet = TestKubelet::start(Answer::Pods(fixture()));
        let node = NodeFiles::new();
        // A process of infer-0 (systemd cgroup driver) carries the lease gpuwarden's driver
        // gave the pod.
        node.process(
            300,
            &format!(
                "0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-9.scope\n",
                UID_INFER.replace('-', "_")
            ),
            "HOME=/\0GPUWARDEN_LEASE_ID=l-infer-3\0",
        );
        let metrics = Arc::new(Metrics::default());
        let mut lookup = PodLookup::new(
            node.settings(&kubelet.socket, Duration::from_secs(10)),
            Arc::clone(&metrics),
        );
        let pods = runtime().block_on(lookup.refresh());

        let train = pods.hold(GPU_A, Some(0), mig_parent).unwrap();
        assert_eq!(
            (
                train.namespace.as_str(),
                train.pod.as_str(),
                train.container.as_deref()
            ),
            ("ml", "train-0", Some("trainer"))
        );
        assert_eq!(train.lease_id, Some(format!("k8s-{UID_TRAIN}")));
        assert_eq!(pods.hold(GPU_B, Some(1), mig_parent), Some(train));

        let infer = pods.hold(GPU_C, Some(2), mig_parent).unwrap();
        assert_eq!(
            (
                infer.pod.as_str(),
                infer.container.as_deref(),
                infer.lease_id.as_deref()
            ),
            ("infer-0", Some("server"), Some("l-infer-3")),
            "the MIG device's GPU; the lease in its process's environment wins"
        );

        let by_index = pods.hold("GPU-dddd", Some(3), mig_parent).unwrap();
        assert_eq!(
            (
                by_index.namespace.as_str(),
                by_index.pod.as_str(),
                by_index.lease_id
            ),
            ("web", "serve-1", None),
            "held by index; no log directory names its uid, so no lease"
        );
        assert_eq!(
            pods.hold_mig(MIG_C, Some(2), 0),
            Some(infer.clone()),
            "the MIG device itself, sampled on its own"
        );
        let serve = pods.hold_mig("MIG-ffff", Some(4), 3).unwrap();
        assert_eq!(
            (serve.pod.as_str(), serve.container.as_deref()),
            ("serve-2", Some("server")),
            "MIG device 3 of GPU 4, named by index"
        );
        assert_eq!(pods.hold_mig("MIG-ffff", Some(4), 2), None);
        assert_eq!(pods.hold("GPU-eeee", Some(5), mig_parent), None);
        assert_eq!(metrics.podresources_errors_total(), 0);
    }

    #[test]
    fn an_absent_kubelet_is_counted_and_found_again_once_it_listens() {
        let node = NodeFiles::new();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kubelet.sock");
        let metrics = Arc::new(Metrics::default());
        let mut lookup = PodLookup::new(
            node.settings(&socket, Duration::from_secs(10)),
            Arc::clone(&metrics),
        );
        let runtime = runtime();
        let pods = runtime.block_on(lookup.refresh());
        assert!(pods.is_empty());
        assert_eq!(pods.hold(GPU_A, Some(0), mig_parent), None);
        assert_eq!(metrics.podresources_errors_total(), 1);
        runtime.block_on(lookup.refresh());
        assert_eq!(
            metrics.podresources_errors_total(),
            2,
            "every failed round counts"
        );
        assert!(metrics
            .render_own()
            .contains("gpuwarden_collector_podresources_errors_total 2\n"));

        let err = runtime
            .block_on(PodResourcesClient::new(&socket, Duration::from_secs(10)).list())
            .unwrap_err();
        assert!(matches!(err, PodResourcesError::Connect { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("kubelet.sock"), "{text}");
        assert!(text.contains("No such file or directory"), "{text}");

        let kubelet = TestKubelet::start(Answer::Pods(fixture()));
        let mut lookup = PodLookup::new(
            node.settings(&kubelet.socket, Duration::from_secs(10)),
            Arc::clone(&metrics),
        );
        lookup.failing = true;
        let pods = runtime.block_on(lookup.refresh());
        assert_eq!(
            pods.hold(GPU_A, Some(0), mig_parent).unwrap().pod,
            "train-0"
        );
        assert!(!lookup.failing);
        assert_eq!(metrics.podresources_errors_total(), 2);
    }

    #[test]
    fn a_kubelet_that_does_not_answer_times_out() {
        let kubelet = TestKubelet::start(Answer::Hang);
        let node = NodeFiles::new();
        let metrics = Arc::new(Metrics::default());
        let runtime = runtime();
        let client = PodResourcesClient::new(&kubelet.socket, Duration::from_millis(200));
        let err = runtime.block_on(client.list()).unwrap_err();
        assert!(
            matches!(err, PodResourcesError::Timeout { timeout, .. } if timeout == Duration::from_millis(200)),
            "{err:?}"
        );
        assert_eq!(
            kubelet.calls(),
            1,
            "the call reached the kubelet, which never answered"
        );

        let mut lookup = PodLookup::new(
            node.settings(&kubelet.socket, Duration::from_millis(200)),
            Arc::clone(&metrics),
        );
        assert!(runtime.block_on(lookup.refresh()).is_empty());
        assert_eq!(metrics.podresources_errors_total(), 1);

        kubelet.answer(Answer::Pods(fixture()));
        let pods = runtime.block_on(lookup.refresh());
        assert_eq!(
            pods.hold(GPU_A, Some(0), mig_parent).unwrap().pod,
            "train-0"
        );
    }

    #[test]
    fn the_watcher_has_the_first_answer_when_it_starts() {
        let kubelet = TestKubelet::start(Answer::Pods(fixture()));
        let node = NodeFiles::new();
        let watcher = PodWatcher::start(
            node.settings(&kubelet.socket, Duration::from_secs(10)),
            Arc::new(Metrics::default()),
        )
        .unwrap();
        let hold = watcher.current().hold(GPU_A, Some(0), mig_parent).unwrap();
        assert_eq!(hold.lease_id, Some(format!("k8s-{UID_TRAIN}")));
        drop(watcher);
        assert_eq!(kubelet.calls(), 1, "refreshed once per hour here");
    }
}
