//! Which pod holds which GPU, from one `List` answer of the kubelet, and the lease of each such
//! pod, from the node's files: the pod's uid from the kubelet's pod log directory, and a
//! `GPUWARDEN_LEASE_ID` from the environment of a process in the pod's cgroup.
//!
//! The NVIDIA device plugin names devices by GPU UUID (`GPU-…`), MIG device UUID (`MIG-…`, or
//! `MIG-GPU-<uuid>/<gi>/<ci>` before driver 470), or by index with `DEVICE_ID_STRATEGY=index`
//! (`<gpu>` for a GPU, `<gpu>:<mig>` for a MIG device, `<mig>` its index among the GPU's MIG
//! devices in NVML); a time-sliced replica adds `::<n>`. A MIG device is sampled on its own
//! ([`PodMap::hold_mig`]); for a sample of a whole GPU (a GPU NVML does not show in MIG mode) a
//! MIG device on it stands for the GPU ([`PodMap::hold`]). A device that containers of several
//! pods share (replicas) carries no pod: its series cannot be split between them.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;
use std::time::SystemTime;

use gpuwarden_schema::lease::{is_lease_id, kubernetes_lease_id};
use gpuwarden_schema::sample::{CONTAINER_LABEL, NAMESPACE_LABEL, POD_LABEL};

use super::podresources::ListPodResourcesResponse;
use crate::environ::{env_var, LEASE_ENV};

/// Whether `resource` is one the NVIDIA device plugin advertises GPUs under: `nvidia.com/gpu`,
/// or a MIG profile with the `mixed` strategy (`nvidia.com/mig-1g.10gb`).
pub fn is_gpu_resource(resource: &str) -> bool {
    resource == "nvidia.com/gpu"
        || resource
            .strip_prefix("nvidia.com/mig-")
            .is_some_and(|profile| !profile.is_empty())
}

/// A device id of the NVIDIA device plugin, reduced to the GPU it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DeviceId {
    /// A GPU's UUID (of the GPU itself, or the parent named in an old MIG UUID).
    Gpu(String),
    /// A MIG device's UUID: which GPU it is on takes NVML to tell.
    Mig(String),
    /// A GPU's index, or the parent GPU's index of a MIG device of an old UUID.
    Index(u32),
    /// A MIG device by its GPU's index and its own index on that GPU.
    MigIndex(u32, u32),
}

impl DeviceId {
    fn parse(id: &str) -> Option<Self> {
        // A time-sliced (or MPS) replica of a device: `<id>::<replica>`.
        let id = match id.split_once("::") {
            Some((device, replica))
                if !replica.is_empty() && replica.bytes().all(|b| b.is_ascii_digit()) =>
            {
                device
            }
            Some(_) => return None,
            None => id,
        };
        if let Some(old_mig) = id.strip_prefix("MIG-GPU-") {
            let parent = old_mig.split('/').next().unwrap_or_default();
            return (!parent.is_empty()).then(|| Self::Gpu(format!("GPU-{parent}")));
        }
        if id.len() > "GPU-".len() && id.starts_with("GPU-") {
            return Some(Self::Gpu(id.to_owned()));
        }
        if id.len() > "MIG-".len() && id.starts_with("MIG-") {
            return Some(Self::Mig(id.to_owned()));
        }
        let number = |n: &str| {
            if n.is_empty() || n.len() > 9 || !n.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            n.parse::<u32>().ok()
        };
        match id.split_once(':') {
            Some((gpu, mig)) => Some(Self::MigIndex(number(gpu)?, number(mig)?)),
            None => number(id).map(Self::Index),
        }
    }
}

/// A container holding GPUs, as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Container {
    namespace: String,
    pod: String,
    container: String,
}

/// The pod holding a GPU, as a sample carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodHold {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container holding the GPU; `None` when several containers of the pod share it.
    pub container: Option<String>,
    /// The pod's lease; `None` when the pod's uid could not be found.
    pub lease_id: Option<String>,
}

impl PodHold {
    /// The sample labels: `k8s_namespace`, `k8s_pod` and, when known, `k8s_container`.
    pub fn labels(&self) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::from([
            (NAMESPACE_LABEL.to_owned(), self.namespace.clone()),
            (POD_LABEL.to_owned(), self.pod.clone()),
        ]);
        if let Some(container) = &self.container {
            labels.insert(CONTAINER_LABEL.to_owned(), container.clone());
        }
        labels
    }
}

/// Which containers hold which GPUs, from one `List` answer, with each pod's lease.
#[derive(Debug, Clone, Default)]
pub struct PodMap {
    containers: Vec<Container>,
    by_uuid: HashMap<String, BTreeSet<usize>>,
    by_mig: HashMap<String, BTreeSet<usize>>,
    by_index: HashMap<u32, BTreeSet<usize>>,
    by_mig_index: HashMap<(u32, u32), BTreeSet<usize>>,
    /// Each pod holding GPUs, by namespace and name, with its lease once found.
    pods: HashMap<(String, String), Option<String>>,
}

impl PodMap {
    /// The GPUs (resources `nvidia.com/gpu` and `nvidia.com/mig-*`) of every container in the
    /// answer. Pods without them are left out; device ids in no known form are skipped.
    pub fn from_list(answer: &ListPodResourcesResponse) -> Self {
        let mut map = Self::default();
        for pod in &answer.pod_resources {
            for container in &pod.containers {
                let ids: Vec<DeviceId> = container
                    .devices
                    .iter()
                    .filter(|d| is_gpu_resource(&d.resource_name))
                    .flat_map(|d| &d.device_ids)
                    .filter_map(|id| {
                        let parsed = DeviceId::parse(id);
                        if parsed.is_none() {
                            tracing::debug!(device_id = %id, namespace = %pod.namespace, pod = %pod.name, "a GPU device id of no known form; skipped");
                        }
                        parsed
                    })
                    .collect();
                if ids.is_empty() {
                    continue;
                }
                let at = map.containers.len();
                map.containers.push(Container {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: container.name.clone(),
                });
                map.pods
                    .insert((pod.namespace.clone(), pod.name.clone()), None);
                for id in ids {
                    let holders = match id {
                        DeviceId::Gpu(uuid) => map.by_uuid.entry(uuid),
                        DeviceId::Mig(uuid) => map.by_mig.entry(uuid),
                        DeviceId::Index(index) => {
                            map.by_index.entry(index).or_default().insert(at);
                            continue;
                        }
                        DeviceId::MigIndex(gpu, mig) => {
                            map.by_mig_index.entry((gpu, mig)).or_default().insert(at);
                            continue;
                        }
                    };
                    holders.or_default().insert(at);
                }
            }
        }
        map
    }

    /// Whether no container holds a GPU.
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty()
    }

    /// The MIG device UUIDs held, whose parent GPUs NVML has to tell.
    pub fn mig_uuids(&self) -> impl Iterator<Item = &str> {
        self.by_mig.keys().map(String::as_str)
    }

    /// Finds each pod's uid in `pod_logs_dir` and its lease (see [`PodMap::hold`]) from the
    /// processes under `proc_root`. A `pod_logs_dir` that cannot be read is an error (every pod
    /// is then left without a lease).
    pub fn find_leases(&mut self, pod_logs_dir: &Path, proc_root: &Path) -> std::io::Result<()> {
        if self.pods.is_empty() {
            return Ok(());
        }
        let uids = pod_uids(pod_logs_dir, self.pods.keys());
        let wanted: HashSet<&str> = uids
            .iter()
            .flat_map(HashMap::values)
            .map(String::as_str)
            .collect();
        let from_processes = leases_in_cgroups(proc_root, &wanted);
        for (key, lease) in &mut self.pods {
            let Some(uid) = uids.as_ref().ok().and_then(|uids| uids.get(key)) else {
                tracing::debug!(namespace = %key.0, pod = %key.1, dir = %pod_logs_dir.display(), "no log directory names this pod's uid; its GPUs get no lease");
                *lease = None;
                continue;
            };
            *lease = from_processes
                .get(uid.as_str())
                .cloned()
                .or_else(|| Some(kubernetes_lease_id(uid)).filter(|id| is_lease_id(id)));
        }
        uids.map(|_| ())
    }

    /// The pod holding the GPU `gpu_uuid` (index `gpu_index`), if one pod does. `mig_parent`
    /// gives the parent GPU's UUID of a MIG device UUID.
    ///
    /// Its lease: the `GPUWARDEN_LEASE_ID` of a process in the pod's cgroup (a pod gpuwarden's
    /// driver made carries it, and its GPU may be idle, with no process on it), else
    /// `k8s-<pod uid>`, the lease of a pod gpuwarden's admission webhook admitted.
    pub fn hold(
        &self,
        gpu_uuid: &str,
        gpu_index: Option<u32>,
        mig_parent: impl Fn(&str) -> Option<String>,
    ) -> Option<PodHold> {
        let mut holders: BTreeSet<usize> = BTreeSet::new();
        if let Some(h) = self.by_uuid.get(gpu_uuid) {
            holders.extend(h);
        }
        if let Some(index) = gpu_index {
            if let Some(h) = self.by_index.get(&index) {
                holders.extend(h);
            }
            for ((gpu, _), h) in &self.by_mig_index {
                if *gpu == index {
                    holders.extend(h);
                }
            }
        }
        for (mig, h) in &self.by_mig {
            if mig_parent(mig).as_deref() == Some(gpu_uuid) {
                holders.extend(h);
            }
        }
        self.pod_of(&holders, gpu_uuid)
    }

    /// The pod holding the MIG device `mig_uuid`, index `mig_index` on the GPU of index
    /// `gpu_index`, if one pod does; its lease as for [`PodMap::hold`].
    pub fn hold_mig(
        &self,
        mig_uuid: &str,
        gpu_index: Option<u32>,
        mig_index: u32,
    ) -> Option<PodHold> {
        let mut holders: BTreeSet<usize> = BTreeSet::new();
        if let Some(h) = self.by_mig.get(mig_uuid) {
            holders.extend(h);
        }
        if let Some(h) = gpu_index.and_then(|gpu| self.by_mig_index.get(&(gpu, mig_index))) {
            holders.extend(h);
        }
        self.pod_of(&holders, mig_uuid)
    }

    /// The one pod of the containers at `holders`, if they are of one pod.
    fn pod_of(&self, holders: &BTreeSet<usize>, gpu_uuid: &str) -> Option<PodHold> {
        let containers: BTreeSet<&Container> =
            holders.iter().map(|&at| &self.containers[at]).collect();
        let first = containers.first()?;
        if containers
            .iter()
            .any(|c| (&c.namespace, &c.pod) != (&first.namespace, &first.pod))
        {
            tracing::debug!(
                gpu_uuid,
                "GPU shared by several pods; its samples name none"
            );
            return None;
        }
        let lease_id = self
            .pods
            .get(&(first.namespace.clone(), first.pod.clone()))
            .cloned()
            .flatten();
        Some(PodHold {
            namespace: first.namespace.clone(),
            pod: first.pod.clone(),
            container: (containers.len() == 1).then(|| first.container.clone()),
            lease_id,
        })
    }
}

/// The uid of each pod in `pods` from the kubelet's log directories,
/// `<pod_logs_dir>/<namespace>_<name>_<uid>` (neither a namespace nor a pod name can contain
/// `_`). A pod re-created under the same name leaves several until the old one is cleaned up:
/// the newest by modification time is the running one.
fn pod_uids<'p>(
    pod_logs_dir: &Path,
    pods: impl Iterator<Item = &'p (String, String)>,
) -> std::io::Result<HashMap<(String, String), String>> {
    let wanted: HashSet<&(String, String)> = pods.collect();
    let entries = std::fs::read_dir(pod_logs_dir)?;
    let mut found: HashMap<(String, String), Vec<(SystemTime, String)>> = HashMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let mut parts = name.splitn(3, '_');
        let (Some(namespace), Some(pod), Some(uid)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let key = (namespace.to_owned(), pod.to_owned());
        if !wanted.contains(&key) || !is_lease_id(&kubernetes_lease_id(uid)) {
            continue;
        }
        let modified = entry
            .metadata()
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH);
        found
            .entry(key)
            .or_default()
            .push((modified, uid.to_owned()));
    }
    Ok(found
        .into_iter()
        .map(|(key, mut dirs)| {
            dirs.sort();
            if dirs.len() > 1 {
                let uids: Vec<&str> = dirs.iter().map(|(_, uid)| uid.as_str()).collect();
                tracing::debug!(namespace = %key.0, pod = %key.1, ?uids, "several log directories for one pod; the newest names its uid");
            }
            let (_, uid) = dirs.pop().expect("an entry is made with one directory");
            (key, uid)
        })
        .collect())
}

/// The `GPUWARDEN_LEASE_ID` of a process in the cgroup of each pod of `uids`, the lowest pid's
/// that names a well-formed one.
fn leases_in_cgroups(proc_root: &Path, uids: &HashSet<&str>) -> HashMap<String, String> {
    let mut out = HashMap::new();
    if uids.is_empty() {
        return out;
    }
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return out;
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    for pid in pids {
        let dir = proc_root.join(pid.to_string());
        let Ok(cgroup) = std::fs::read(dir.join("cgroup")) else {
            continue;
        };
        let Some(uid) = pod_uid_in_cgroup(&cgroup, uids) else {
            continue;
        };
        if out.contains_key(uid) {
            continue;
        }
        let Ok(environ) = std::fs::read(dir.join("environ")) else {
            continue;
        };
        let lease = env_var(&environ, LEASE_ENV)
            .and_then(|v| std::str::from_utf8(v).ok())
            .filter(|v| is_lease_id(v));
        if let Some(lease) = lease {
            out.insert(uid.to_owned(), lease.to_owned());
        }
    }
    out
}

/// The uid among `uids` of the pod whose cgroup the contents of `/proc/<pid>/cgroup` run
/// through: a path component `pod<uid>` (the cgroupfs driver:
/// `/kubepods/burstable/pod<uid>/<container>`) or `…-pod<uid>.slice` with the uid's `-` written
/// `_` (the systemd driver: `/kubepods.slice/kubepods-burstable.slice/
/// kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope`).
fn pod_uid_in_cgroup<'u>(cgroup: &[u8], uids: &HashSet<&'u str>) -> Option<&'u str> {
    let text = String::from_utf8_lossy(cgroup);
    text.lines().find_map(|line| {
        let path = line.splitn(3, ':').nth(2)?;
        path.split('/').find_map(|part| {
            let uid = if let Some(uid) = part.strip_prefix("pod") {
                uid.to_owned()
            } else {
                let slice = part.strip_suffix(".slice")?;
                let (_, uid) = slice.rsplit_once("-pod")?;
                uid.replace('_', "-")
            };
            uids.get(uid.as_str()).copied()
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::podresources::{ContainerDevices, ContainerResources, PodResources};

    /// A container's devices: resource name and device ids.
    type Devices<'a> = &'a [(&'a str, &'a [&'a str])];

    fn pod(namespace: &str, name: &str, containers: &[(&str, Devices<'_>)]) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: namespace.into(),
            containers: containers
                .iter()
                .map(|(container, devices)| ContainerResources {
                    name: (*container).into(),
                    devices: devices
                        .iter()
                        .map(|(resource, ids)| ContainerDevices {
                            resource_name: (*resource).into(),
                            device_ids: ids.iter().map(|s| (*s).into()).collect(),
                            topology: None,
                        })
                        .collect(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn map(pods: Vec<PodResources>) -> PodMap {
        PodMap::from_list(&ListPodResourcesResponse {
            pod_resources: pods,
        })
    }

    fn no_mig(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn device_ids_of_every_strategy_name_their_gpu() {
        let gpu = |s: &str| Some(DeviceId::Gpu(s.into()));
        assert_eq!(DeviceId::parse("GPU-8f2c"), gpu("GPU-8f2c"));
        assert_eq!(
            DeviceId::parse("GPU-8f2c::3"),
            gpu("GPU-8f2c"),
            "a time-sliced replica"
        );
        assert_eq!(
            DeviceId::parse("MIG-GPU-8f2c/7/0"),
            gpu("GPU-8f2c"),
            "a MIG UUID from before driver 470 names its parent"
        );
        assert_eq!(
            DeviceId::parse("MIG-1a2b"),
            Some(DeviceId::Mig("MIG-1a2b".into()))
        );
        assert_eq!(DeviceId::parse("3"), Some(DeviceId::Index(3)));
        assert_eq!(
            DeviceId::parse("3:1"),
            Some(DeviceId::MigIndex(3, 1)),
            "MIG device 1 of GPU 3"
        );
        assert_eq!(DeviceId::parse("3:1::2"), Some(DeviceId::MigIndex(3, 1)));
        assert_eq!(DeviceId::parse("3::0"), Some(DeviceId::Index(3)));
        for bad in [
            "",
            "GPU-",
            "MIG-",
            "MIG-GPU-",
            "x",
            "-1",
            "3:",
            ":1",
            "3:x",
            "GPU-a::x",
            "GPU-a::",
            "99999999999",
            "3:99999999999",
            "3:1:2",
            "nvidia0/gi1",
        ] {
            assert_eq!(DeviceId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn only_nvidia_gpu_resources_count() {
        assert!(is_gpu_resource("nvidia.com/gpu"));
        assert!(is_gpu_resource("nvidia.com/mig-1g.10gb"));
        for other in [
            "nvidia.com/mig-",
            "nvidia.com/gpu.shared",
            "cpu",
            "amd.com/gpu",
            "example.com/nvidia.com/gpu",
        ] {
            assert!(!is_gpu_resource(other), "{other}");
        }
    }

    #[test]
    fn a_gpu_is_held_by_the_container_listing_it() {
        let pods = map(vec![
            pod(
                "ml",
                "train-0",
                &[
                    ("trainer", &[("nvidia.com/gpu", &["GPU-a", "GPU-b"])]),
                    ("sidecar", &[]),
                ],
            ),
            pod("ml", "cpu-only", &[("main", &[("cpu", &["0", "1"])])]),
            pod(
                "web",
                "serve-1",
                &[("server", &[("nvidia.com/gpu", &["2"])])],
            ),
        ]);
        let hold = pods.hold("GPU-a", Some(0), no_mig).unwrap();
        assert_eq!(
            hold,
            PodHold {
                namespace: "ml".into(),
                pod: "train-0".into(),
                container: Some("trainer".into()),
                lease_id: None,
            }
        );
        assert_eq!(pods.hold("GPU-b", Some(1), no_mig).unwrap().pod, "train-0");
        assert_eq!(
            pods.hold("GPU-c", Some(2), no_mig).unwrap().pod,
            "serve-1",
            "by index"
        );
        assert_eq!(pods.hold("GPU-d", Some(3), no_mig), None);
        assert_eq!(pods.hold("GPU-d", None, no_mig), None);
        assert_eq!(pods.hold("0", Some(7), no_mig), None, "a CPU id is no GPU");
        assert_eq!(
            hold.labels(),
            BTreeMap::from([
                ("k8s_namespace".into(), "ml".into()),
                ("k8s_pod".into(), "train-0".into()),
                ("k8s_container".into(), "trainer".into()),
            ])
        );
    }

    #[test]
    fn a_mig_device_is_held_by_the_pod_listing_it_by_uuid_or_index() {
        let pods = map(vec![
            pod(
                "ml",
                "infer-0",
                &[("server", &[("nvidia.com/mig-1g.10gb", &["MIG-1111"])])],
            ),
            pod(
                "ml",
                "infer-1",
                &[("server", &[("nvidia.com/mig-1g.10gb", &["0:1"])])],
            ),
            pod(
                "ml",
                "infer-2",
                &[("server", &[("nvidia.com/mig-3g.40gb", &["MIG-3333::0"])])],
            ),
            pod(
                "ml",
                "infer-3",
                &[("server", &[("nvidia.com/mig-3g.40gb", &["MIG-3333::1"])])],
            ),
        ]);
        let hold = pods.hold_mig("MIG-1111", Some(0), 0).unwrap();
        assert_eq!(
            (hold.pod.as_str(), hold.container.as_deref()),
            ("infer-0", Some("server"))
        );
        assert_eq!(
            pods.hold_mig("MIG-2222", Some(0), 1).unwrap().pod,
            "infer-1",
            "MIG device 1 of GPU 0, by index"
        );
        assert_eq!(pods.hold_mig("MIG-2222", Some(1), 1), None, "another GPU's");
        assert_eq!(pods.hold_mig("MIG-2222", None, 1), None);
        assert_eq!(
            pods.hold_mig("MIG-3333", Some(0), 2),
            None,
            "replicas of one MIG device held by two pods"
        );
        assert_eq!(
            pods.hold("GPU-zero", Some(0), no_mig).unwrap().pod,
            "infer-1",
            "for a sample of the whole GPU, a MIG device by index stands for its GPU"
        );
    }

    #[test]
    fn a_mig_device_stands_for_its_parent_gpu() {
        let pods = map(vec![
            pod(
                "ml",
                "infer-0",
                &[("server", &[("nvidia.com/mig-1g.10gb", &["MIG-1111"])])],
            ),
            pod(
                "ml",
                "infer-1",
                &[("server", &[("nvidia.com/mig-1g.10gb", &["MIG-2222"])])],
            ),
            pod(
                "ml",
                "infer-2",
                &[
                    ("a", &[("nvidia.com/mig-3g.40gb", &["MIG-3333"])]),
                    ("b", &[("nvidia.com/mig-3g.40gb", &["MIG-4444"])]),
                ],
            ),
        ]);
        assert_eq!(
            pods.mig_uuids().collect::<BTreeSet<_>>(),
            BTreeSet::from(["MIG-1111", "MIG-2222", "MIG-3333", "MIG-4444"])
        );
        let parent = |mig: &str| -> Option<String> {
            Some(
                match mig {
                    "MIG-1111" => "GPU-one",
                    "MIG-2222" => "GPU-two",
                    "MIG-3333" | "MIG-4444" => "GPU-three",
                    _ => return None,
                }
                .into(),
            )
        };
        let hold = pods.hold("GPU-one", Some(0), parent).unwrap();
        assert_eq!(
            (hold.pod.as_str(), hold.container.as_deref()),
            ("infer-0", Some("server"))
        );
        assert_eq!(
            pods.hold("GPU-one", Some(0), no_mig),
            None,
            "a MIG UUID NVML cannot place"
        );
        let hold = pods.hold("GPU-three", Some(2), parent).unwrap();
        assert_eq!(
            (hold.pod.as_str(), hold.container),
            ("infer-2", None),
            "two containers of one pod share the GPU: the pod, no container"
        );
        let shared = map(vec![
            pod("ml", "a", &[("c", &[("nvidia.com/gpu", &["GPU-x::0"])])]),
            pod("ml", "b", &[("c", &[("nvidia.com/gpu", &["GPU-x::1"])])]),
        ]);
        assert_eq!(
            shared.hold("GPU-x", Some(0), no_mig),
            None,
            "replicas held by two pods"
        );
    }

    /// A fixture node: `/var/log/pods` and `/proc`.
    struct Node {
        logs: tempfile::TempDir,
        proc: tempfile::TempDir,
    }

    impl Node {
        fn new() -> Self {
            Self {
                logs: tempfile::tempdir().unwrap(),
                proc: tempfile::tempdir().unwrap(),
            }
        }

        fn log_dir(&self, name: &str, modified: SystemTime) {
            let dir = self.logs.path().join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::File::open(&dir)
                .unwrap()
                .set_modified(modified)
                .unwrap();
        }

        fn process(&self, pid: u32, cgroup: &str, environ: &[&str]) {
            let dir = self.proc.path().join(pid.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cgroup"), cgroup).unwrap();
            let mut bytes = Vec::new();
            for var in environ {
                bytes.extend_from_slice(var.as_bytes());
                bytes.push(0);
            }
            std::fs::write(dir.join("environ"), bytes).unwrap();
        }

        fn leases(&self, pods: &mut PodMap) {
            pods.find_leases(self.logs.path(), self.proc.path())
                .unwrap();
        }
    }

    const UID_A: &str = "0f3c1a52-7d7e-4b8e-9a43-2c1d5e6f7a80";
    const UID_B: &str = "5b1e2c3d-0000-4a4a-8b8b-123456789abc";
    const UID_OLD: &str = "11111111-2222-4333-8444-555555555555";

    fn at(seconds: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(seconds)
    }

    #[test]
    fn a_pod_lease_is_its_uid_from_the_newest_log_directory() {
        let node = Node::new();
        node.log_dir(&format!("ml_train-0_{UID_OLD}"), at(1_000));
        node.log_dir(&format!("ml_train-0_{UID_A}"), at(2_000));
        node.log_dir(&format!("other_train-0_{UID_B}"), at(3_000));
        node.log_dir("not-a-pod-dir", at(3_000));
        let mut pods = map(vec![
            pod(
                "ml",
                "train-0",
                &[("trainer", &[("nvidia.com/gpu", &["GPU-a"])])],
            ),
            pod("ml", "no-logs", &[("c", &[("nvidia.com/gpu", &["GPU-b"])])]),
        ]);
        node.leases(&mut pods);
        assert_eq!(
            pods.hold("GPU-a", None, no_mig)
                .unwrap()
                .lease_id
                .as_deref(),
            Some(format!("k8s-{UID_A}").as_str()),
            "the newest of the pod's directories, not another namespace's pod of the same name"
        );
        let lost = pods.hold("GPU-b", None, no_mig).unwrap();
        assert_eq!(
            (lost.pod.as_str(), lost.lease_id),
            ("no-logs", None),
            "a pod whose uid cannot be found keeps its labels, with no lease"
        );
    }

    #[test]
    fn a_lease_in_the_environment_of_a_process_of_the_pod_wins() {
        let node = Node::new();
        node.log_dir(&format!("ml_train-0_{UID_A}"), at(1));
        node.log_dir(&format!("ml_driven-1_{UID_B}"), at(1));
        node.log_dir(&format!("ml_bad-2_{UID_OLD}"), at(1));
        let systemd_a = UID_A.replace('-', "_");
        // Pod A (systemd driver): the pause process without the variable, the workload with it.
        node.process(
            40,
            &format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd_a}.slice/cri-containerd-aa.scope\n"),
            &["PATH=/bin"],
        );
        node.process(
            41,
            &format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd_a}.slice/cri-containerd-bb.scope\n"),
            &["PATH=/bin", "GPUWARDEN_LEASE_ID=l-notebook-7"],
        );
        // Pod B (cgroupfs driver, cgroup v1).
        node.process(
            50,
            &format!("12:memory:/kubepods/besteffort/pod{UID_B}/cc\n11:devices:/kubepods/besteffort/pod{UID_B}/cc\n"),
            &["GPUWARDEN_LEASE_ID=l-driven-1"],
        );
        // Pod C: a lease id that breaks the rules is ignored.
        node.process(
            60,
            &format!("0::/kubepods/pod{UID_OLD}/dd\n"),
            &["GPUWARDEN_LEASE_ID=../../etc/passwd"],
        );
        // A process outside any pod names a lease it cannot give a pod.
        node.process(70, "0::/user.slice\n", &["GPUWARDEN_LEASE_ID=l-other"]);
        let mut pods = map(vec![
            pod("ml", "train-0", &[("c", &[("nvidia.com/gpu", &["GPU-a"])])]),
            pod(
                "ml",
                "driven-1",
                &[("c", &[("nvidia.com/gpu", &["GPU-b"])])],
            ),
            pod("ml", "bad-2", &[("c", &[("nvidia.com/gpu", &["GPU-c"])])]),
        ]);
        node.leases(&mut pods);
        let lease = |uuid| pods.hold(uuid, None, no_mig).unwrap().lease_id;
        assert_eq!(lease("GPU-a").as_deref(), Some("l-notebook-7"));
        assert_eq!(lease("GPU-b").as_deref(), Some("l-driven-1"));
        assert_eq!(
            lease("GPU-c"),
            Some(format!("k8s-{UID_OLD}")),
            "a malformed lease id is ignored: the pod's own lease"
        );
    }

    #[test]
    fn a_missing_log_directory_is_an_error_and_leaves_no_lease() {
        let node = Node::new();
        node.log_dir(&format!("ml_train-0_{UID_A}"), at(1));
        let mut pods = map(vec![pod(
            "ml",
            "train-0",
            &[("trainer", &[("nvidia.com/gpu", &["GPU-a"])])],
        )]);
        node.leases(&mut pods);
        assert!(pods.hold("GPU-a", None, no_mig).unwrap().lease_id.is_some());
        let missing = node.logs.path().join("not-mounted");
        let err = pods.find_leases(&missing, node.proc.path()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
        let hold = pods.hold("GPU-a", None, no_mig).unwrap();
        assert_eq!(
            (hold.pod.as_str(), hold.lease_id),
            ("train-0", None),
            "the pod is still named; the lease found before is not kept"
        );
    }

    #[test]
    fn log_directories_with_unusable_uids_are_ignored() {
        let node = Node::new();
        let long = "u".repeat(gpuwarden_schema::lease::LEASE_ID_MAX);
        node.log_dir(&format!("ml_p_{long}"), at(1));
        node.log_dir("ml_q_a b", at(1));
        let mut pods = map(vec![
            pod("ml", "p", &[("c", &[("nvidia.com/gpu", &["GPU-a"])])]),
            pod("ml", "q", &[("c", &[("nvidia.com/gpu", &["GPU-b"])])]),
        ]);
        node.leases(&mut pods);
        assert_eq!(pods.hold("GPU-a", None, no_mig).unwrap().lease_id, None);
        assert_eq!(pods.hold("GPU-b", None, no_mig).unwrap().lease_id, None);
    }

    #[test]
    fn cgroup_paths_name_pod_uids_of_both_drivers() {
        let uids = HashSet::from([UID_A]);
        let systemd = UID_A.replace('-', "_");
        let find = |text: &str| pod_uid_in_cgroup(text.as_bytes(), &uids);
        assert_eq!(
            find(&format!("0::/kubepods/burstable/pod{UID_A}/abc\n")),
            Some(UID_A)
        );
        assert_eq!(
            find(&format!(
                "0::/kubepods.slice/kubepods-pod{systemd}.slice/cri-containerd-1.scope\n"
            )),
            Some(UID_A)
        );
        assert_eq!(find(&format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{systemd}.slice\n")), Some(UID_A));
        assert_eq!(
            find(&format!("0::/kubepods/burstable/pod{UID_B}/abc\n")),
            None,
            "another pod"
        );
        assert_eq!(
            find(&format!("0::/kubepods/burstable/xpod{UID_A}/abc\n")),
            None
        );
        assert_eq!(find(&format!("pod{UID_A}\n")), None, "not a cgroup line");
        assert_eq!(find(""), None);
    }
}
