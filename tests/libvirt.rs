//! The libvirt substrate end to end (built with `--features libvirt`): `gpuwarden enforce` with a
//! libvirt substrate, whose leases asked for with the CLI become virtual machines on libvirt's
//! test hypervisor inside the enforcer's process (`test:///default`), so what the driver did is
//! read from the enforcer's log and the API; and a Linux guest booted under QEMU by the driver,
//! whose kernel shows the SMBIOS OEM string that the collector reads. The driver's own tests
//! (`enforcer/tests/libvirt.rs`) read the domains back through libvirt.

#![cfg(feature = "libvirt")]

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use gpuwarden_enforcer::drivers::{build, DriverContext, LeaseSpec, LeaseStatus};
use gpuwarden_schema::config::SubstrateConfig;
use gpuwarden_schema::{ReleaseReason, Workload};
use support::libvirtd::{give_to_daemon, SessionDaemon};

use support::{Broker, Config, Running, Substrate, Team};

const TOKEN: &str = "libvirt-test-token";
const H100: &str = "NVIDIA H100 80GB HBM3";

fn write_config(dir: &Path, bootstrap: &str) -> PathBuf {
    let template = dir.join("gpu-vm.xml");
    std::fs::write(
        &template,
        "<domain type='test'><name>{{name}}</name><memory unit='MiB'>64</memory>\
         <os><type>hvm</type></os><devices/></domain>",
    )
    .unwrap();
    let gpus = format!(
        r#"
[libvirt]
gpus = [
  {{ pci = "0000:41:00.0", model = "{H100}" }},
  {{ pci = "0000:42:00.0", model = "{H100}" }},
]
"#
    );
    Config::new()
        .broker(bootstrap)
        .data_dir(&dir.join("data"))
        .team(Team::new("ml", 4, 100000.0).members(&["ada"]))
        .workload(
            support::Workload::new("training")
                .max_gpus(4)
                .max_duration("24h")
                .substrates(&["vm-host-1"]),
        )
        .enforcer()
        .substrate(libvirt("vm-host-1", "test:///default", &template).raw(&gpus))
        .token("ada", TOKEN, "member", &["ml"])
        .write(dir.join("gpuwarden.toml"))
}

/// A libvirt substrate on the daemon at `uri`, its domains made from `template`, a guest given
/// a second to shut down before it is destroyed.
fn libvirt(name: &str, uri: &str, template: &Path) -> Substrate {
    Substrate::new(name, "libvirt").raw(&format!(
        "[libvirt]\nuri = \"{uri}\"\ndomain_template = \"{}\"\ngrace_period = \"1s\"\n",
        template.display()
    ))
}

fn cli(api: &str, args: &[&str]) -> Output {
    support::self_service(api, TOKEN, args)
}

fn text(output: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn request(api: &str, gpus: &str) -> Output {
    cli(
        api,
        &[
            "request",
            "--team",
            "ml",
            "--workload",
            "training",
            "--gpus",
            gpus,
            "--model",
            H100,
            "--env",
            "--wait",
        ],
    )
}

fn lease_id(output: &Output) -> String {
    assert_eq!(output.status.code(), Some(0), "{}", text(output));
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("export GPUWARDEN_LEASE_ID="))
        .unwrap_or_else(|| panic!("no lease id in\n{}", text(output)))
        .trim_matches('\'')
        .to_owned()
}

#[test]
fn leases_on_a_libvirt_substrate_are_virtual_machines_started_and_reclaimed() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = write_config(dir.path(), &broker.bootstrap);
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let line = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = line["api"].as_str().expect("the api field").to_owned();

    let first = lease_id(&request(&api, "1"));
    let started = enforcer.wait_for_log(
        "started the lease's virtual machine",
        Duration::from_secs(30),
    );
    assert_eq!(started["domain"], format!("gpuwarden-{first}"), "{started}");

    // One of the host's two GPUs is held: two more do not fit, and the answer says why.
    let denied = request(&api, "2");
    assert_eq!(denied.status.code(), Some(3), "{}", text(&denied));
    assert!(text(&denied).contains("no_capacity"), "{}", text(&denied));

    let released = cli(&api, &["release", &first]);
    assert_eq!(released.status.code(), Some(0), "{}", text(&released));
    let reclaimed = enforcer.wait_for_log(
        "reclaimed the lease's virtual machine",
        Duration::from_secs(30),
    );
    assert_eq!(
        reclaimed["domain"],
        format!("gpuwarden-{first}"),
        "{reclaimed}"
    );

    // Both GPUs free again: one VM with two of them.
    let second = lease_id(&request(&api, "2"));
    let started = enforcer.wait_for_log(
        "started the lease's virtual machine",
        Duration::from_secs(30),
    );
    assert_eq!(
        started["domain"],
        format!("gpuwarden-{second}"),
        "{started}"
    );
    let (status, log) = enforcer.terminate(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{}", log.join("\n"));
}

/// Where `.ci/run` puts a Linux kernel for guests: Debian's cloud kernel, whose serial console,
/// initramfs support and DMI entries in sysfs are built in.
fn guest_kernel() -> PathBuf {
    let path = std::env::var_os("GPUWARDEN_GUEST_KERNEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/gpuwarden-guest/vmlinuz"));
    assert!(
        path.is_file(),
        "no guest kernel at {} (GPUWARDEN_GUEST_KERNEL): .ci/run unpacks Debian's \
         linux-image-cloud-amd64 there",
        path.display()
    );
    path
}

/// An initramfs whose init prints every SMBIOS OEM Strings structure the kernel shows, in hex
/// between marker lines on the serial console, then powers the guest off.
fn initramfs(dir: &Path) -> PathBuf {
    let busybox = Path::new("/bin/busybox");
    let linked = Command::new("ldd").arg(busybox).output().expect("runs ldd");
    assert!(
        String::from_utf8_lossy(&linked.stdout).contains("not a dynamic executable")
            || String::from_utf8_lossy(&linked.stderr).contains("not a dynamic executable"),
        "/bin/busybox must be static (Debian: busybox-static)"
    );
    let root = dir.join("initramfs");
    for sub in ["bin", "proc", "sys", "dev"] {
        std::fs::create_dir_all(root.join(sub)).unwrap();
    }
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    let init = root.join("init");
    std::fs::write(
        &init,
        "#!/bin/busybox sh\n\
         /bin/busybox mount -t proc proc /proc\n\
         /bin/busybox mount -t sysfs sysfs /sys\n\
         for f in /sys/firmware/dmi/entries/11-*/raw; do\n\
           echo \"gpuwarden-dmi-begin $f\"\n\
           /bin/busybox od -An -tx1 -v \"$f\"\n\
           echo gpuwarden-dmi-end\n\
         done\n\
         echo gpuwarden-guest-done\n\
         /bin/busybox poweroff -f\n",
    )
    .unwrap();
    std::fs::set_permissions(&init, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let image = dir.join("initrd.cpio");
    let built = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "find . | cpio -o -H newc --quiet > {}",
            image.display()
        ))
        .current_dir(&root)
        .status()
        .expect("runs cpio");
    assert!(built.success(), "cpio (Debian: cpio) failed");
    image
}

/// The raw SMBIOS structures the guest printed, as `(path in the guest, bytes)`.
fn printed_entries(console: &str) -> Vec<(String, Vec<u8>)> {
    let mut entries = Vec::new();
    let mut current: Option<(String, Vec<u8>)> = None;
    for line in console.lines() {
        let line = line.trim();
        if let Some(path) = line.strip_prefix("gpuwarden-dmi-begin ") {
            current = Some((path.to_owned(), Vec::new()));
        } else if line == "gpuwarden-dmi-end" {
            entries.extend(current.take());
        } else if let Some((_, bytes)) = current.as_mut() {
            bytes.extend(
                line.split_whitespace()
                    .map(|b| u8::from_str_radix(b, 16).expect("od's hex")),
            );
        }
    }
    entries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_booted_by_the_driver_finds_its_lease_in_smbios_as_the_collector_reads_it() {
    let kernel = guest_kernel();
    let daemon = SessionDaemon::start().expect("a session libvirtd");
    let dir = daemon.dir.path().join("guest");
    std::fs::create_dir(&dir).unwrap();
    let initrd = initramfs(&dir);
    give_to_daemon(&dir).unwrap();
    let console = dir.join("console.log");
    let template = dir.join("guest.xml");
    // ACPI, as in the shipped template: without it the guest's poweroff only halts its CPU and
    // the VM runs on.
    std::fs::write(
        &template,
        format!(
            "<domain type='qemu'><name>{{{{name}}}}</name><memory unit='MiB'>160</memory>\
             <os><type arch='x86_64' machine='pc'>hvm</type><kernel>{}</kernel><initrd>{}</initrd>\
             <cmdline>console=ttyS0 quiet panic=-1</cmdline></os>\
             <features><acpi/></features><devices><emulator>/usr/bin/qemu-system-x86_64</emulator>\
             <serial type='file'><source path='{}'/><target port='0'/></serial></devices></domain>",
            kernel.display(),
            initrd.display(),
            console.display()
        ),
    )
    .unwrap();
    let config: SubstrateConfig = gpuwarden_schema::config::parse(
        "vm.toml",
        &Config::new()
            .substrate(libvirt("vms", &daemon.uri(), &template))
            .text(),
    )
    .unwrap()
    .substrates
    .remove(0);
    let driver = build(
        &config,
        &DriverContext {
            state_dir: dir.join("state"),
            lease_refs: None,
        },
    )
    .unwrap();
    let lease = LeaseSpec {
        lease_id: "l-boot-1".into(),
        team: "ml".into(),
        user: "ada".into(),
        project: "p".into(),
        workload: Workload::Training,
        gpu_model: "none".into(),
        gpu_count: 0,
        gpu_uuids: Vec::new(),
        command: None,
        time_limit: None,
        labels: Default::default(),
    };
    driver.provision(&lease).await.unwrap();

    // Software emulation boots this kernel in about 5 s on an idle machine.
    let deadline = Instant::now() + Duration::from_secs(180);
    let printed = loop {
        let text = std::fs::read_to_string(&console).unwrap_or_default();
        if text.contains("gpuwarden-guest-done") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the guest printed no SMBIOS in 180 s:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let entries = printed_entries(&printed);
    assert!(
        !entries.is_empty(),
        "no OEM Strings structure in the guest:\n{printed}"
    );
    // The guest's bytes, laid out as its /sys/firmware/dmi/entries, read by the collector's code.
    let sysfs = tempfile::tempdir().unwrap();
    for (path, bytes) in &entries {
        let entry = Path::new(path)
            .parent()
            .and_then(Path::file_name)
            .expect("11-<n>/raw");
        std::fs::create_dir(sysfs.path().join(entry)).unwrap();
        std::fs::write(sysfs.path().join(entry).join("raw"), bytes).unwrap();
    }
    assert_eq!(
        gpuwarden_collector::guest::read_lease(sysfs.path()).as_deref(),
        Some("l-boot-1"),
        "{printed}"
    );

    // The guest powered itself off: its lease's VM has ended by itself.
    let deadline = Instant::now() + Duration::from_secs(60);
    while driver.status("l-boot-1").await.unwrap() == LeaseStatus::Running {
        assert!(Instant::now() < deadline, "the guest did not power off");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(
        driver.status("l-boot-1").await.unwrap(),
        LeaseStatus::Exited(None)
    );
    driver
        .reclaim("l-boot-1", ReleaseReason::Expired)
        .await
        .unwrap();
    assert_eq!(driver.status("l-boot-1").await.unwrap(), LeaseStatus::Gone);
}
