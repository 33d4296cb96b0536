//! The NVML source through the real nvml-wrapper FFI path, against the scripted fake
//! `libnvidia-ml.so` built from `collector/fake-nvml`: values and units, a field the device
//! cannot report, a device lost mid-run, lease discovery from a process environment, a missing
//! library, the pods holding GPUs on a Kubernetes node (through a kubelet's PodResources API
//! served by tonic on a Unix socket), the lease of a virtual machine named by its SMBIOS OEM
//! strings (a faked `/sys/firmware/dmi/entries`), and the whole way to the broker.

mod support;
#[path = "../src/kubelet/test_server.rs"]
#[allow(dead_code)]
mod test_server;

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gpuwarden_collector::kubelet::podresources::{
    self, ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
};
use gpuwarden_collector::kubelet::KubeletSettings;
use gpuwarden_collector::nvml::NvmlSource;
use gpuwarden_collector::{Collector, KafkaSink, Metrics, SinkSettings, SourceSpec};
use gpuwarden_schema::kafka::EmbeddedBroker;
use gpuwarden_schema::{AcceleratedClock, Record};
use serde_json::json;

/// The fake's script is named by a process-wide environment variable: one test at a time.
static NVML: Mutex<()> = Mutex::new(());

fn fake_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let candidates = [
        dir.join("libgpuwarden_fake_nvml.so"),
        dir.join("../libgpuwarden_fake_nvml.so"),
    ];
    candidates.into_iter().find(|p| p.exists()).expect(
        "the fake libnvidia-ml.so is built beside the tests (dev-dependency gpuwarden-fake-nvml)",
    )
}

/// A process with a lease in its environment, as a lease's workload would be.
struct LeasedProcess(Child);

impl LeasedProcess {
    fn start(lease: &str) -> Self {
        let child = Command::new("sleep")
            .arg("60")
            .env("GPUWARDEN_LEASE_ID", lease)
            .spawn()
            .unwrap();
        // Right after exec the kernel shows an empty environment for a moment: wait it out, so
        // the first sample already finds the lease.
        let environ = format!("/proc/{}/environ", child.id());
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while !std::fs::read(&environ)
            .is_ok_and(|e| e.windows(18).any(|w| w == b"GPUWARDEN_LEASE_ID"))
        {
            assert!(
                std::time::Instant::now() < until,
                "the child's environment never showed the lease"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        Self(child)
    }
}

impl Drop for LeasedProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A fake `/sys/firmware/dmi/entries` of a guest whose SMBIOS OEM strings name `lease`, as
/// QEMU writes them for libvirt's `<oemStrings>`: one OEM Strings structure (type 11, QEMU's
/// handle 0x0E00) with the lease among other strings; a second one with only other strings, as
/// other firmware adds; and the BIOS's own entry.
fn dmi_entries(lease: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let entry = |name: &str, raw: &[u8]| {
        std::fs::create_dir(dir.path().join(name)).unwrap();
        std::fs::write(dir.path().join(name).join("raw"), raw).unwrap();
    };
    entry(
        "0-0",
        b"\x00\x18\x00\x00\x01\x02\xe8\x03\x00\x08\0\0\0\0\0\0\0\0\0\0\0\0\0\0SeaBIOS\0rel-1.16\0\0",
    );
    entry(
        "11-0",
        b"\x0b\x05\x00\x0c\x01io.systemd.credential:hostname=vm-7\0\0",
    );
    let mut oem = b"\x0b\x05\x00\x0e\x02vendor=acme\0gpuwarden.lease_id=".to_vec();
    oem.extend_from_slice(lease.as_bytes());
    oem.extend_from_slice(b"\0\0");
    entry("11-1", &oem);
    dir
}

const H100_TOTAL: u64 = 85_520_809_984;
const A100_MIG: &str = "MIG-bbbbbbbb-1111-0000-0000-000000000000";

fn script(dir: &std::path::Path, leased_pid: u32) -> PathBuf {
    let script = json!({
        "driver_version": "550.54.15",
        "devices": [
            {
                "uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000000",
                "name": "NVIDIA H100 80GB HBM3",
                "index": 0,
                "pci_bus_id": "00000000:17:00.0",
                "memory_total_bytes": H100_TOTAL,
                "memory_used_bytes": [1073741824u64, 2147483648u64],
                "util_gpu_pct": [95, 80, 0],
                "util_mem_pct": [40, 30, 0],
                "power_mw": [350000, 360500, 70250],
                "power_limit_mw": 700000,
                "energy_mj": [1000000, 1005000, 1010000],
                "temp_c": [61, 62, 40],
                "sm_clock_mhz": [1980, 1980, 345],
                "processes": [[{"pid": leased_pid, "used_memory_bytes": 1073741824u64}], [{"pid": leased_pid}], []]
            },
            {
                "uuid": "GPU-bbbbbbbb-0000-0000-0000-000000000000",
                "name": "NVIDIA A100-SXM4-40GB",
                "index": 1,
                "pci_bus_id": "00000000:27:00.0",
                "memory_total_bytes": 42949672960u64,
                "memory_used_bytes": [0],
                "util_gpu_pct": [10],
                "util_mem_pct": [1],
                "power_limit_mw": 400000,
                "energy_mj": [5],
                "temp_c": [35],
                "sm_clock_mhz": [210],
                "processes": [[]],
                "fail": {"power_usage": "not_supported"},
                "lost_at_sample": 2,
                "mig_devices": [{"uuid": A100_MIG}]
            }
        ]
    });
    let path = dir.join("nvml.json");
    std::fs::write(&path, script.to_string()).unwrap();
    path
}

#[test]
fn samples_carry_nvmls_values_in_the_contracts_units() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let leased = LeasedProcess::start("l-train-7");
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        script(dir.path(), leased.0.id()),
    );
    let metrics = Arc::new(Metrics::default());
    let mut source = NvmlSource::open(
        Some(&fake_library()),
        "gpu-node-1".into(),
        None,
        Arc::clone(&metrics),
    )
    .unwrap();
    assert_eq!(source.device_count(), 2);

    let first = source.sample(1_000_000, 5_000);
    assert_eq!(first.len(), 2);
    let h100 = &first[0];
    h100.validate().unwrap();
    assert_eq!(h100.host, "gpu-node-1");
    assert_eq!(h100.gpu_uuid, "GPU-aaaaaaaa-0000-0000-0000-000000000000");
    assert_eq!(h100.gpu_model, "NVIDIA H100 80GB HBM3");
    assert_eq!(h100.gpu_index, Some(0));
    assert_eq!(h100.pci_bus_id.as_deref(), Some("00000000:17:00.0"));
    assert_eq!((h100.ts_ms, h100.interval_ms), (1_000_000, 5_000));
    assert_eq!(h100.util_gpu_pct, 95.0);
    assert_eq!(h100.util_mem_pct, Some(40.0));
    assert_eq!(h100.mem_used_bytes, 1 << 30);
    assert_eq!(h100.mem_total_bytes, H100_TOTAL);
    assert_eq!(h100.power_w, Some(350.0), "milliwatts become watts");
    assert_eq!(h100.power_limit_w, Some(700.0));
    assert_eq!(
        h100.energy_mj,
        Some(1_000_000),
        "energy stays in millijoules"
    );
    assert_eq!(h100.temp_c, Some(61.0));
    assert_eq!(h100.sm_clock_mhz, Some(1980));
    assert_eq!(h100.process_count, Some(1));
    assert_eq!(
        h100.lease_id.as_deref(),
        Some("l-train-7"),
        "found in the process's environment"
    );

    let a100 = &first[1];
    a100.validate().unwrap();
    assert_eq!(
        a100.power_w, None,
        "a field the device cannot report is null"
    );
    assert_eq!(
        a100.power_limit_w,
        Some(400.0),
        "the device's other fields are still read"
    );
    assert_eq!(a100.lease_id, None);
    assert_eq!(
        metrics.nvml_errors_for("power_w"),
        1,
        "and the failure is counted"
    );

    let second = source.sample(1_005_000, 5_000);
    assert_eq!(second.len(), 2);
    assert_eq!(second[0].util_gpu_pct, 80.0);
    assert_eq!(second[0].power_w, Some(360.5));
    assert_eq!(second[0].lease_id.as_deref(), Some("l-train-7"));

    // Sample 2: the A100 falls off the bus; the H100 keeps being sampled.
    let third = source.sample(1_010_000, 5_000);
    assert_eq!(
        third
            .iter()
            .map(|s| s.gpu_uuid.as_str())
            .collect::<Vec<_>>(),
        ["GPU-aaaaaaaa-0000-0000-0000-000000000000"]
    );
    assert_eq!(third[0].util_gpu_pct, 0.0);
    assert_eq!(third[0].process_count, Some(0));
    assert_eq!(third[0].lease_id, None, "no process, no lease");
    let fourth = source.sample(1_015_000, 5_000);
    assert_eq!(fourth.len(), 1, "a lost device stays skipped");
    assert!(metrics
        .render_own()
        .contains("gpuwarden_collector_devices_lost_total 1"));
    assert_eq!(metrics.nvml_errors_for("power_w"), 2);
}

#[test]
fn a_virtual_machines_gpus_work_for_the_lease_its_smbios_names() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let leased = LeasedProcess::start("l-train-7");
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        script(dir.path(), leased.0.id()),
    );
    let dmi = dmi_entries("l-vm-7");
    let mut source = NvmlSource::open(
        Some(&fake_library()),
        "vm-7".into(),
        None,
        Arc::new(Metrics::default()),
    )
    .unwrap()
    .with_guest_lease(dmi.path());

    let first = source.sample(1_000_000, 5_000);
    let leases = |samples: &[gpuwarden_schema::Sample]| {
        samples
            .iter()
            .map(|s| (s.process_count, s.lease_id.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        leases(&first),
        [
            (Some(1), Some("l-train-7".into())),
            (Some(0), Some("l-vm-7".into())),
        ],
        "a process's own lease first; the idle A100 works for the machine's lease"
    );
    source.sample(1_005_000, 5_000);
    let third = source.sample(1_010_000, 5_000);
    assert_eq!(
        leases(&third),
        [(Some(0), Some("l-vm-7".into()))],
        "the H100, idle once its process is gone, too"
    );
    for s in first.iter().chain(&third) {
        s.validate().unwrap();
    }

    // The SMBIOS is read once, at start: a machine's lease is fixed when it boots.
    std::fs::remove_dir_all(dmi.path().join("11-1")).unwrap();
    assert_eq!(
        source.sample(1_015_000, 5_000)[0].lease_id.as_deref(),
        Some("l-vm-7")
    );
}

#[test]
fn in_a_virtual_machine_a_pods_lease_comes_before_the_machines() {
    let node = KubeNode::start();
    let dmi = dmi_entries("l-vm-7");
    let mut source = node
        .source("vm-node-7", Arc::new(Metrics::default()))
        .with_guest_lease(dmi.path());

    let first = source.sample(1_000_000, 5_000);
    assert_eq!(first[0].lease_id.as_deref(), Some("l-train-7"));
    assert_eq!(
        first[1].lease_id,
        Some(format!("k8s-{NOTEBOOK_UID}")),
        "the pod's lease, not the machine's"
    );
    source.sample(1_005_000, 5_000);
    let third = source.sample(1_010_000, 5_000);
    assert_eq!(
        third[0]
            .labels
            .as_ref()
            .and_then(|l| l.get("k8s_pod"))
            .map(String::as_str),
        Some("train-0")
    );
    assert_eq!(
        third[0].lease_id.as_deref(),
        Some("l-vm-7"),
        "a pod whose lease cannot be found leaves the GPU to the machine's lease"
    );
}

#[test]
fn a_missing_driver_library_says_what_to_install() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let err = NvmlSource::open(
        Some(std::path::Path::new("/nonexistent/libnvidia-ml.so.1")),
        "h".into(),
        None,
        Arc::new(Metrics::default()),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("/nonexistent/libnvidia-ml.so.1"), "{err}");
    assert!(err.contains("Install the NVIDIA driver"), "{err}");
    assert!(err.contains("--source simulated"), "{err}");
}

#[test]
fn collected_samples_reach_the_broker_exactly_as_produced() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let leased = LeasedProcess::start("l-e2e");
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        script(dir.path(), leased.0.id()),
    );
    let broker = EmbeddedBroker::start(2).unwrap();
    let metrics = Arc::new(Metrics::default());
    let sink = KafkaSink::start(
        &support::client(broker.bootstrap_servers()),
        gpuwarden_schema::topics::SAMPLES,
        SinkSettings::default(),
        Arc::clone(&metrics),
    )
    .unwrap();
    // 1 s of event time per 10 ms of wall time.
    let clock = Arc::new(AcceleratedClock::from_now(100.0));
    // Inside a virtual machine of lease l-vm-e2e.
    let dmi = dmi_entries("l-vm-e2e");
    let spec = SourceSpec::Nvml {
        library: Some(fake_library()),
        host: "gpu-node-2".into(),
        slurm_cluster: None,
        kubelet: None,
        dmi_entries_dir: Some(dmi.path().to_path_buf()),
    };
    let collector = Collector::start(
        spec,
        sink,
        Duration::from_secs(1),
        clock,
        Arc::clone(&metrics),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let report = collector.stop(Duration::from_secs(30));

    assert!(
        report.published >= 6,
        "about 20 rounds of 1-2 GPUs: {report:?}"
    );
    assert_eq!(report.dropped, 0);
    let got = support::read_samples(
        broker.bootstrap_servers(),
        gpuwarden_schema::topics::SAMPLES,
        report.published as usize,
        Duration::from_secs(30),
    );
    assert_eq!(
        got.len() as u64,
        report.published,
        "the broker holds exactly what the collector published"
    );
    let a100 = got
        .iter()
        .filter(|(_, s)| s.gpu_uuid.starts_with("GPU-bbbb"))
        .count();
    assert_eq!(
        a100, 2,
        "the A100 was sampled twice before it fell off the bus"
    );
    assert!(
        got.iter()
            .filter(|(_, s)| s.gpu_uuid.starts_with("GPU-bbbb"))
            .all(|(_, s)| s.process_count == Some(0) && s.lease_id.as_deref() == Some("l-vm-e2e")),
        "the idle A100 works for the machine's lease: {got:#?}"
    );
    for (key, s) in &got {
        assert_eq!(key, &s.gpu_uuid);
        assert_eq!(s.host, "gpu-node-2");
        assert!(
            s.interval_ms >= 1 && s.interval_ms <= 5_000,
            "interval covers the time since the previous sample: {}",
            s.interval_ms
        );
    }
    let first_h100 = got
        .iter()
        .map(|(_, s)| s)
        .filter(|s| s.gpu_uuid.starts_with("GPU-aaaa"))
        .min_by_key(|s| s.ts_ms)
        .unwrap();
    assert_eq!(first_h100.power_w, Some(350.0));
    assert_eq!(first_h100.lease_id.as_deref(), Some("l-e2e"));
}

/// A pod whose one container holds device `id` of `resource`.
fn pod(namespace: &str, name: &str, container: &str, resource: &str, id: &str) -> PodResources {
    PodResources {
        name: name.into(),
        namespace: namespace.into(),
        containers: vec![ContainerResources {
            name: container.into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids: vec![id.into()],
                topology: None,
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// What the kubelet of the fake node says: pod `ml/train-0` holds the H100 by UUID, pod
/// `ml/notebook-1` the A100 by index, and a pod holds CPUs only.
fn kubelet_pods() -> ListPodResourcesResponse {
    ListPodResourcesResponse {
        pod_resources: vec![
            pod(
                "ml",
                "train-0",
                "trainer",
                "nvidia.com/gpu",
                "GPU-aaaaaaaa-0000-0000-0000-000000000000",
            ),
            pod("ml", "notebook-1", "lab", "nvidia.com/gpu", "1"),
            pod("ops", "agent", "main", "example.com/nic", "eth1"),
        ],
    }
}

const NOTEBOOK_UID: &str = "9a8b7c6d-1111-4222-8333-444455556666";

/// A Kubernetes node as the collector finds it: the fake NVML's two GPUs, the first used by a
/// process whose environment names lease `l-train-7`; a kubelet answering [`kubelet_pods`]; the
/// notebook pod's log directory (its uid); an empty `/proc` for the pods' processes. It holds
/// [`NVML`] while it lives.
struct KubeNode {
    _dir: tempfile::TempDir,
    _leased: LeasedProcess,
    kubelet: test_server::TestKubelet,
    logs: tempfile::TempDir,
    proc: tempfile::TempDir,
    // Last, so that the lock is let go after everything above is gone.
    _one: MutexGuard<'static, ()>,
}

impl KubeNode {
    fn start() -> Self {
        let one = NVML.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let leased = LeasedProcess::start("l-train-7");
        std::env::set_var(
            "GPUWARDEN_FAKE_NVML_SCRIPT",
            script(dir.path(), leased.0.id()),
        );
        let kubelet = test_server::TestKubelet::start(test_server::Answer::Pods(kubelet_pods()));
        let logs = tempfile::tempdir().unwrap();
        std::fs::create_dir(logs.path().join(format!("ml_notebook-1_{NOTEBOOK_UID}"))).unwrap();
        Self {
            _dir: dir,
            _leased: leased,
            kubelet,
            logs,
            proc: tempfile::tempdir().unwrap(),
            _one: one,
        }
    }

    /// The NVML source of node `name`, attributing GPUs to pods through this node's kubelet.
    fn source(&self, name: &str, metrics: Arc<Metrics>) -> NvmlSource {
        NvmlSource::open(Some(&fake_library()), name.into(), None, metrics)
            .unwrap()
            .with_pods(KubeletSettings {
                pod_logs_dir: self.logs.path().to_path_buf(),
                proc_root: self.proc.path().to_path_buf(),
                ..KubeletSettings::new(&self.kubelet.socket, Duration::from_secs(3600))
            })
            .unwrap()
    }
}

#[test]
fn a_kubernetes_nodes_gpus_carry_their_pods_and_leases() {
    let node = KubeNode::start();
    let metrics = Arc::new(Metrics::default());
    let mut source = node.source("gpu-node-3", Arc::clone(&metrics));

    let samples = source.sample(1_000_000, 5_000);
    let labels = |s: &gpuwarden_schema::Sample| {
        s.labels
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect::<Vec<_>>()
    };
    let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    let h100 = &samples[0];
    assert_eq!(
        labels(h100),
        [
            pair("k8s_container", "trainer"),
            pair("k8s_namespace", "ml"),
            pair("k8s_pod", "train-0"),
        ]
    );
    assert_eq!(
        h100.lease_id.as_deref(),
        Some("l-train-7"),
        "the GPU process's GPUWARDEN_LEASE_ID comes first; train-0 has no log directory anyway"
    );
    let a100 = &samples[1];
    assert_eq!(
        labels(a100),
        [
            pair("k8s_container", "lab"),
            pair("k8s_namespace", "ml"),
            pair("k8s_pod", "notebook-1"),
        ],
        "held by index"
    );
    let expected_lease = format!("k8s-{NOTEBOOK_UID}");
    assert_eq!(
        a100.lease_id.as_deref(),
        Some(expected_lease.as_str()),
        "an idle GPU (no process) works for its pod's lease"
    );
    for s in &samples {
        s.validate().unwrap();
        assert_eq!(
            gpuwarden_schema::Sample::from_json(&s.to_json()).unwrap(),
            *s,
            "the labels survive the wire"
        );
    }

    metrics.set_latest(&samples);
    let text = metrics.render();
    assert!(
        text.contains(&format!(
            "DCGM_FI_DEV_GPU_UTIL{{gpu=\"1\",UUID=\"GPU-bbbbbbbb-0000-0000-0000-000000000000\",\
             pci_bus_id=\"00000000:27:00.0\",device=\"nvidia1\",modelName=\"NVIDIA A100-SXM4-40GB\",\
             Hostname=\"gpu-node-3\",container=\"lab\",namespace=\"ml\",pod=\"notebook-1\",\
             lease_id=\"{expected_lease}\"}} 10\n"
        )),
        "{text}"
    );
    assert!(text.contains("gpuwarden_collector_podresources_errors_total 0\n"));
    assert_eq!(
        node.kubelet.calls(),
        1,
        "asked once an interval, not once a sample"
    );
}

#[test]
fn without_its_kubelet_a_node_is_sampled_without_pods() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        script(dir.path(), std::process::id()),
    );
    let metrics = Arc::new(Metrics::default());
    let mut source = NvmlSource::open(
        Some(&fake_library()),
        "gpu-node-4".into(),
        None,
        Arc::clone(&metrics),
    )
    .unwrap()
    .with_pods(KubeletSettings::new(
        dir.path().join("no-kubelet.sock"),
        Duration::from_secs(3600),
    ))
    .unwrap();
    let samples = source.sample(1_000_000, 5_000);
    assert_eq!(samples.len(), 2, "every GPU is still sampled");
    assert!(samples.iter().all(|s| s.labels.is_none()));
    assert_eq!(metrics.podresources_errors_total(), 1);
    assert!(metrics
        .render()
        .contains("gpuwarden_collector_podresources_errors_total 1\n"));
}

#[test]
fn a_mig_device_names_the_pod_of_its_gpu() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        script(dir.path(), std::process::id()),
    );
    let kubelet =
        test_server::TestKubelet::start(test_server::Answer::Pods(ListPodResourcesResponse {
            pod_resources: vec![pod(
                "ml",
                "infer-2",
                "server",
                "nvidia.com/mig-1g.5gb",
                A100_MIG,
            )],
        }));
    let logs = tempfile::tempdir().unwrap();
    let metrics = Arc::new(Metrics::default());
    let mut source = NvmlSource::open(
        Some(&fake_library()),
        "gpu-node-5".into(),
        None,
        Arc::clone(&metrics),
    )
    .unwrap()
    .with_pods(KubeletSettings {
        pod_logs_dir: logs.path().to_path_buf(),
        ..KubeletSettings::new(&kubelet.socket, Duration::from_secs(3600))
    })
    .unwrap();
    let samples = source.sample(1_000_000, 5_000);
    assert_eq!(samples[0].labels, None, "the H100 holds no MIG device");
    let a100 = samples[1].labels.clone().unwrap();
    assert_eq!(
        (
            a100["k8s_namespace"].as_str(),
            a100["k8s_pod"].as_str(),
            a100["k8s_container"].as_str()
        ),
        ("ml", "infer-2", "server"),
        "NVML names the MIG device's GPU"
    );
    assert_eq!(
        samples[1].lease_id, None,
        "no log directory names the pod's uid"
    );
}
