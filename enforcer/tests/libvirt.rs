//! The libvirt driver against real libvirt: its built-in test hypervisor (`test:///default`, a
//! real libvirt connection to an in-memory hypervisor in this process, and `test:///<file>` for
//! a host described by a file, node devices included), and QEMU under a private session
//! libvirtd (software emulation; no GPU, no hostdev). Built with the `libvirt` feature.

#![cfg(feature = "libvirt")]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use gpuwarden_enforcer::drivers::{
    build, Driver, DriverContext, DriverError, LeaseSpec, LeaseStatus,
};
use gpuwarden_schema::config::SubstrateConfig;
use gpuwarden_schema::{ReleaseReason, Workload};
use virt::connect::Connect;
use virt::domain::Domain;
use virt::error::ErrorNumber;

mod support;

const H100: &str = "NVIDIA H100 80GB HBM3";

/// The test hypervisor's domain template; `extra` goes inside `<domain>`.
fn template(extra: &str) -> String {
    format!(
        "<domain type='test'>\n  <name>{{{{name}}}}</name>\n  <description>{{{{user}}}} of \
         {{{{team}}}}, {{{{gpu_count}}}} x {{{{gpu_model}}}}</description>\n  <memory \
         unit='MiB'>64</memory>\n  <os><type>hvm</type></os>\n  {extra}\n  <devices/>\n</domain>\n"
    )
}

/// `test:///default` is one hypervisor per process, and `cargo test` runs this file's tests on
/// threads of one process: each test that uses it holds this lock, and starts from a host with
/// only the hypervisor's own `test` domain.
static DEFAULT_HOST: std::sync::LazyLock<tokio::sync::Mutex<()>> =
    std::sync::LazyLock::new(|| tokio::sync::Mutex::new(()));

struct Host {
    _exclusive: Option<tokio::sync::MutexGuard<'static, ()>>,
    dir: tempfile::TempDir,
    /// The hypervisor's own connection: libvirt's test hypervisor lives as long as one is open,
    /// as a host outlives the enforcer's restarts; the tests also read domains through it.
    conn: Connect,
    uri: String,
}

impl Host {
    async fn default() -> anyhow::Result<Self> {
        let exclusive = DEFAULT_HOST.lock().await;
        let mut host = Self::at("test:///default")?;
        host._exclusive = Some(exclusive);
        for domain in host.conn.list_all_domains(0)? {
            if domain.get_name()? != "test" {
                if domain.is_active()? {
                    domain.destroy()?;
                }
                domain.undefine()?;
            }
        }
        Ok(host)
    }

    fn at(uri: &str) -> anyhow::Result<Self> {
        Ok(Self {
            _exclusive: None,
            dir: tempfile::tempdir()?,
            conn: Connect::open(Some(uri))?,
            uri: uri.to_owned(),
        })
    }

    /// A driver for this host: `settings` is the rest of `[substrates.libvirt]`.
    fn driver(&self, template: &str, settings: &str) -> Result<Box<dyn Driver>, DriverError> {
        let path = self.dir.path().join("domain.xml");
        std::fs::write(&path, template).expect("template written");
        build(&self.config(&path, settings), &self.context())
    }

    fn config(&self, template: &Path, settings: &str) -> SubstrateConfig {
        toml::from_str(&format!(
            "name = \"vms\"\ndriver = \"libvirt\"\n[libvirt]\nuri = \"{}\"\ndomain_template = \"{}\"\n{settings}\n",
            self.uri,
            template.display()
        ))
        .expect("test config parses")
    }

    fn context(&self) -> DriverContext {
        DriverContext {
            state_dir: self.dir.path().join("drivers/vms"),
            lease_refs: None,
        }
    }

    fn domain(&self, name: &str) -> Option<Domain> {
        match Domain::lookup_by_name(&self.conn, name) {
            Ok(d) => Some(d),
            Err(e) if e.code() == ErrorNumber::NoDomain => None,
            Err(e) => panic!("looking up {name}: {e}"),
        }
    }

    fn xml(&self, name: &str) -> String {
        self.domain(name)
            .unwrap_or_else(|| panic!("no domain {name}"))
            .get_xml_desc(0)
            .expect("domain XML")
    }

    /// Defines (and starts, if `start`) a domain that is not gpuwarden's.
    fn define(&self, xml: &str, start: bool) -> anyhow::Result<()> {
        let d = Domain::define_xml(&self.conn, xml)?;
        if start {
            d.create()?;
        }
        Ok(())
    }
}

const TWO_GPUS: &str = r#"grace_period = "1s"
gpus = [
  { pci = "0000:41:00.0", model = "NVIDIA H100 80GB HBM3" },
  { pci = "0000:42:00.0", model = "NVIDIA H100 80GB HBM3" },
]"#;

fn lease(id: &str, gpus: u32) -> LeaseSpec {
    LeaseSpec {
        lease_id: id.to_owned(),
        team: "vision".to_owned(),
        user: "ada <lovelace> & co".to_owned(),
        project: "detector".to_owned(),
        workload: Workload::Training,
        gpu_model: H100.to_owned(),
        gpu_count: gpus,
        gpu_uuids: Vec::new(),
        command: None,
        time_limit: None,
        labels: Default::default(),
    }
}

/// `(bus)` of every PCI hostdev in a domain's XML.
fn hostdev_buses(xml: &str) -> Vec<String> {
    let doc = roxmltree::Document::parse(xml).expect("domain XML parses");
    doc.descendants()
        .filter(|n| n.has_tag_name("hostdev") && n.attribute("type") == Some("pci"))
        .filter_map(|h| h.descendants().find(|n| n.has_tag_name("address")))
        .map(|a| a.attribute("bus").unwrap_or_default().to_owned())
        .collect()
}

#[tokio::test]
async fn provision_defines_and_starts_a_domain_with_its_gpus_the_lease_in_metadata_and_smbios(
) -> anyhow::Result<()> {
    let host = Host::default().await?;
    let driver = host.driver(&template(""), TWO_GPUS)?;
    let inventory = driver.inventory().await?;
    assert_eq!(inventory.pooled, [(H100.to_owned(), 2)]);
    assert!(inventory.gpus.is_empty() && !inventory.queues);

    driver.provision(&lease("l-vm-1", 2)).await?;
    let domain = host
        .domain("gpuwarden-l-vm-1")
        .context("the lease's domain")?;
    assert!(domain.is_active()?, "started");
    let xml = host.xml("gpuwarden-l-vm-1");
    assert_eq!(hostdev_buses(&xml), ["0x41", "0x42"], "{xml}");
    let doc = roxmltree::Document::parse(&xml)?;
    let managed: Vec<_> = doc
        .descendants()
        .filter(|n| n.has_tag_name("hostdev"))
        .map(|n| (n.attribute("mode"), n.attribute("managed")))
        .collect();
    assert_eq!(managed, [(Some("subsystem"), Some("yes")); 2]);
    let oem: Vec<_> = doc
        .descendants()
        .filter(|n| {
            n.has_tag_name("entry") && n.parent().is_some_and(|p| p.has_tag_name("oemStrings"))
        })
        .filter_map(|n| n.text())
        .collect();
    assert_eq!(oem, ["gpuwarden.lease_id=l-vm-1"]);
    let smbios = doc
        .descendants()
        .find(|n| n.has_tag_name("smbios"))
        .context("<os><smbios>")?;
    assert_eq!(smbios.attribute("mode"), Some("sysinfo"));
    let description = doc
        .descendants()
        .find(|n| n.has_tag_name("description"))
        .context("description")?;
    assert_eq!(
        description.text(),
        Some("ada <lovelace> & co of vision, 2 x NVIDIA H100 80GB HBM3"),
        "placeholders filled, escaped"
    );
    // The metadata as libvirt hands it back (virsh metadata --uri).
    let metadata = domain.get_metadata(
        virt::sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
        Some("https://gpuwarden.io/xmlns/libvirt/1"),
        0,
    )?;
    assert!(
        metadata.contains("<id>l-vm-1</id>") && metadata.contains("<team>vision</team>"),
        "{metadata}"
    );

    // Every GPU is now held: a second lease finds none free, and the error says so.
    match driver.provision(&lease("l-vm-2", 1)).await {
        Err(DriverError::Unavailable { message, .. }) => {
            assert!(message.contains("0 of the 1"), "{message}")
        }
        other => panic!("expected no free GPU, got {other:?}"),
    }
    assert!(
        host.domain("gpuwarden-l-vm-2").is_none(),
        "nothing left behind"
    );
    driver.reclaim("l-vm-1", ReleaseReason::User).await?;
    assert!(host.domain("gpuwarden-l-vm-1").is_none(), "undefined");
    driver.provision(&lease("l-vm-2", 1)).await?;
    assert_eq!(hostdev_buses(&host.xml("gpuwarden-l-vm-2")), ["0x41"]);
    Ok(())
}

#[tokio::test]
async fn reclaim_destroys_a_guest_that_ignores_shutdown_once_the_grace_period_is_over(
) -> anyhow::Result<()> {
    let host = Host::default().await?;
    // The test hypervisor restarts a guest whose poweroff action is `restart`: a guest that
    // ignores the shutdown request.
    let driver = host.driver(&template("<on_poweroff>restart</on_poweroff>"), TWO_GPUS)?;
    driver.provision(&lease("l-stubborn", 1)).await?;
    let started = Instant::now();
    driver.reclaim("l-stubborn", ReleaseReason::Idle).await?;
    let took = started.elapsed();
    ensure!(
        took >= Duration::from_secs(1),
        "destroyed before the 1 s grace period: {took:?}"
    );
    assert!(
        host.domain("gpuwarden-l-stubborn").is_none(),
        "destroyed, then undefined"
    );
    assert_eq!(driver.status("l-stubborn").await?, LeaseStatus::Gone);

    // A guest that shuts down when asked is not made to wait out the grace period.
    let driver = host.driver(&template(""), &TWO_GPUS.replace("\"1s\"", "\"10m\""))?;
    driver.provision(&lease("l-polite", 1)).await?;
    let started = Instant::now();
    driver.reclaim("l-polite", ReleaseReason::Idle).await?;
    ensure!(
        started.elapsed() < Duration::from_secs(300),
        "a guest that shut down was waited for as long as the grace period"
    );
    assert!(host.domain("gpuwarden-l-polite").is_none());
    Ok(())
}

#[tokio::test]
async fn disks_are_kept_unless_the_config_says_to_delete_them() -> anyhow::Result<()> {
    let host = Host::default().await?;
    let pool = virt::storage_pool::StoragePool::lookup_by_name(&host.conn, "default-pool")?;
    for name in ["keep.img", "drop.img"] {
        virt::storage_vol::StorageVol::create_xml(
            &pool,
            &format!("<volume><name>{name}</name><capacity unit='MiB'>1</capacity></volume>"),
            0,
        )?;
    }
    let disk = |file: &str| {
        template("").replace(
            "<devices/>",
            &format!("<devices><disk type='file' device='disk'><source file='/default-pool/{file}'/><target dev='vda'/></disk></devices>"),
        )
    };
    let keeps = host.driver(&disk("keep.img"), TWO_GPUS)?;
    keeps.provision(&lease("l-keep", 1)).await?;
    keeps.reclaim("l-keep", ReleaseReason::User).await?;
    let deletes = host.driver(
        &disk("drop.img"),
        &format!("{TWO_GPUS}\ndelete_disks = true"),
    )?;
    deletes.provision(&lease("l-drop", 1)).await?;
    deletes.reclaim("l-drop", ReleaseReason::User).await?;
    pool.refresh(0)?;
    let mut left = pool.list_volumes()?;
    left.sort();
    assert_eq!(left, ["keep.img"]);
    Ok(())
}

#[tokio::test]
async fn a_restarted_driver_readopts_domains_by_the_lease_in_their_metadata() -> anyhow::Result<()>
{
    let host = Host::default().await?;
    let driver = host.driver(&template(""), TWO_GPUS)?;
    driver.provision(&lease("l-kept", 1)).await?;
    drop(driver);
    // An operator renamed nothing, but a domain of another name carries a lease too (defined by
    // hand from a dumped XML, say): found by its metadata.
    let renamed = host
        .xml("gpuwarden-l-kept")
        .replace("<name>gpuwarden-l-kept</name>", "<name>renamed-vm</name>")
        .replace("l-kept", "l-renamed");
    let renamed = renamed
        .lines()
        .filter(|l| !l.trim_start().starts_with("<uuid>"))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("bus='0x41'", "bus='0x42'");
    host.define(&renamed, true)?;

    let driver = host.driver(&template(""), TWO_GPUS)?;
    assert_eq!(driver.status("l-kept").await?, LeaseStatus::Running);
    assert_eq!(driver.status("l-renamed").await?, LeaseStatus::Running);
    assert_eq!(
        driver.inventory().await?.pooled,
        [(H100.to_owned(), 2)],
        "both held by gpuwarden's own leases"
    );
    driver.reclaim("l-renamed", ReleaseReason::Admin).await?;
    assert!(host.domain("renamed-vm").is_none());
    assert_eq!(driver.status("l-renamed").await?, LeaseStatus::Gone);

    // A guest shut down from inside: the lease's VM exited by itself.
    host.domain("gpuwarden-l-kept")
        .context("kept")?
        .shutdown()?;
    assert_eq!(driver.status("l-kept").await?, LeaseStatus::Exited(None));
    Ok(())
}

#[tokio::test]
async fn domains_gpuwarden_did_not_define_are_never_touched_and_their_gpus_never_counted(
) -> anyhow::Result<()> {
    let host = Host::default().await?;
    // Another VM on the host holds the second GPU.
    host.define(
        "<domain type='test'><name>someone-elses</name><memory unit='MiB'>64</memory><os><type>hvm</type></os>\
         <devices><hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0x0000' bus='0x42' slot='0x00' function='0x0'/></source></hostdev></devices></domain>",
        false,
    )?;
    // And one has the name a lease's domain would have, without gpuwarden's metadata.
    host.define(
        "<domain type='test'><name>gpuwarden-l-taken</name><memory unit='MiB'>64</memory><os><type>hvm</type></os><devices/></domain>",
        true,
    )?;
    let driver = host.driver(&template(""), TWO_GPUS)?;
    assert_eq!(driver.inventory().await?.pooled, [(H100.to_owned(), 1)]);
    match driver.provision(&lease("l-taken", 1)).await {
        Err(DriverError::Rejected { message, .. }) => {
            assert!(message.contains("not lease l-taken's"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(driver.status("l-taken").await?, LeaseStatus::Gone);
    driver.reclaim("l-taken", ReleaseReason::Admin).await?;
    assert!(host
        .domain("gpuwarden-l-taken")
        .context("still there")?
        .is_active()?);

    match driver.provision(&lease("l-two", 2)).await {
        Err(DriverError::Unavailable { message, .. }) => {
            assert!(message.contains("1 of the 2"), "{message}")
        }
        other => panic!("expected too few free GPUs, got {other:?}"),
    }
    driver.provision(&lease("l-one", 1)).await?;
    assert_eq!(
        hostdev_buses(&host.xml("gpuwarden-l-one")),
        ["0x41"],
        "not the other VM's GPU"
    );
    Ok(())
}

#[tokio::test]
async fn leases_provisioned_at_once_never_share_a_gpu() -> anyhow::Result<()> {
    let host = Host::default().await?;
    let driver: Arc<dyn Driver> = Arc::from(host.driver(&template(""), TWO_GPUS)?);
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let driver = driver.clone();
            tokio::spawn(async move { driver.provision(&lease(&format!("l-race-{i}"), 1)).await })
        })
        .collect();
    let mut started = 0;
    for task in tasks {
        match task.await? {
            Ok(()) => started += 1,
            Err(DriverError::Unavailable { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    assert_eq!(started, 2);
    let mut buses: Vec<String> = (0..4)
        .filter_map(|i| host.domain(&format!("gpuwarden-l-race-{i}")))
        .flat_map(|d| hostdev_buses(&d.get_xml_desc(0).expect("xml")))
        .collect();
    buses.sort();
    assert_eq!(buses, ["0x41", "0x42"]);
    Ok(())
}

/// A host described by a file: libvirt's test hypervisor reads its node devices from it.
const NODE: &str = r#"<node>
  <cpu><nodes>1</nodes><sockets>1</sockets><cores>4</cores><threads>1</threads><active>4</active><mhz>2000</mhz><model>x86</model></cpu>
  <memory>8388608</memory>
  DEVICES
</node>"#;

fn pci_device(name: &str, bus: u8, class: &str, vendor: &str, product: &str) -> String {
    format!(
        "<device><name>{name}</name><parent>computer</parent><capability type='pci'>\
         <class>{class}</class><domain>0</domain><bus>{bus}</bus><slot>0</slot><function>0</function>\
         <product id='{product}'>product {product}</product><vendor id='{vendor}'>vendor</vendor>\
         </capability></device>"
    )
}

#[tokio::test]
async fn the_inventory_is_the_hosts_nvidia_gpus_as_libvirt_lists_them() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let devices = [
        pci_device("pci_0000_41_00_0", 0x41, "0x030200", "0x10de", "0x2330"),
        pci_device("pci_0000_41_00_1", 0x41, "0x040300", "0x10de", "0x22a3"), // its audio function
        pci_device("pci_0000_42_00_0", 0x42, "0x030200", "0x10de", "0x2330"),
        pci_device("pci_0000_43_00_0", 0x43, "0x030000", "0x10de", "0x26b5"), // a VGA L40S
        pci_device("pci_0000_44_00_0", 0x44, "0x030000", "0x1002", "0x740f"), // not NVIDIA
        pci_device("pci_0000_45_00_0", 0x45, "0x030200", "0x10de", "0x20b5"), // no model known
    ];
    let node = dir.path().join("node.xml");
    std::fs::write(&node, NODE.replace("DEVICES", &devices.concat()))?;
    let host = Host::at(&format!("test://{}", node.display()))?;
    assert!(host.domain("gpuwarden-l-l40s").is_none());
    let driver = host.driver(
        &template(""),
        r#"models = { "0x2330" = "NVIDIA H100 80GB HBM3" }
gpus = [ { pci = "0000:43:00.0", model = "NVIDIA L40S" } ]"#,
    )?;
    let inventory = driver.inventory().await?;
    assert_eq!(
        inventory.pooled,
        [(H100.to_owned(), 2), ("NVIDIA L40S".to_owned(), 1)]
    );
    let mut l40s = lease("l-l40s", 1);
    l40s.gpu_model = "NVIDIA L40S".into();
    // A hypervisor read from a file is private to its connection: what the driver defines is
    // seen through the driver.
    driver.provision(&l40s).await?;
    assert_eq!(driver.status("l-l40s").await?, LeaseStatus::Running);
    l40s.lease_id = "l-l40s-2".into();
    match driver.provision(&l40s).await {
        Err(DriverError::Unavailable { message, .. }) => {
            assert!(message.contains("0 of the 1"), "{message}")
        }
        other => panic!("expected the one L40S taken, got {other:?}"),
    }
    driver.provision(&lease("l-h100", 2)).await?;
    assert_eq!(driver.status("l-h100").await?, LeaseStatus::Running);
    Ok(())
}

#[test]
fn start_up_errors_name_the_setting_at_fault() {
    let host = Host::at("test:///default").expect("test hypervisor");
    let error = |template: &str, settings: &str| match host.driver(template, settings) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("{template} / {settings}: built"),
    };
    let e = error(&template("<x>{{gpus}}</x>"), "");
    assert!(
        e.contains("libvirt.domain_template") && e.contains("unknown placeholder {{gpus}}"),
        "{e}"
    );
    let e = error(&template("").replace("{{name}}", "fixed"), "");
    assert!(e.contains("<name> must be {{name}}"), "{e}");
    let e = error(&template("").replace("</domain>", ""), "");
    assert!(e.contains("not well-formed"), "{e}");

    let path = host.dir.path().join("missing.xml");
    let e = build(&host.config(&path, ""), &host.context())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("libvirt.domain_template") && e.contains("missing.xml"),
        "{e}"
    );
}

#[tokio::test]
async fn a_host_that_cannot_be_reached_fails_its_calls_not_the_enforcer() {
    let host = Host::at("test:///default").expect("test hypervisor");
    let path = host.dir.path().join("domain.xml");
    std::fs::write(&path, template("")).expect("written");
    let mut config = host.config(&path, TWO_GPUS);
    config.libvirt.as_mut().expect("libvirt").uri = "nosuchdriver:///system".into();
    let driver =
        build(&config, &host.context()).expect("built: the enforcer's other substrates go on");
    for e in [
        driver.inventory().await.map(|_| ()).unwrap_err(),
        driver.provision(&lease("l-1", 1)).await.unwrap_err(),
        driver.status("l-1").await.map(|_| ()).unwrap_err(),
    ] {
        match e {
            DriverError::Unavailable { message, .. } => {
                assert!(message.contains("nosuchdriver:///system"), "{message}")
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn the_shipped_domain_template_makes_a_lease_domain() -> anyhow::Result<()> {
    let host = Host::at("test:///default")?;
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/libvirt/gpu-vm.xml"
    ))?;
    // Rendered when the driver is built: every placeholder known, <name>, <os>, <devices> there.
    host.driver(&shipped, TWO_GPUS)?;
    Ok(())
}

/// A guest with no disk: the firmware finds nothing to boot and keeps running, and, with no
/// operating system, ignores the ACPI shutdown request.
const QEMU_TEMPLATE: &str = "<domain type='qemu'>\n  <name>{{name}}</name>\n  <memory unit='MiB'>32</memory>\n  \
    <os><type arch='x86_64' machine='pc'>hvm</type></os>\n  <devices><emulator>/usr/bin/qemu-system-x86_64</emulator>\
    <serial type='pty'/></devices>\n</domain>\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_runs_the_lease_domain_with_the_lease_in_its_smbios_and_is_destroyed_when_deaf(
) -> anyhow::Result<()> {
    let daemon = support::libvirtd::SessionDaemon::start()?;
    let host = Host::at(&daemon.uri())?;
    let driver = host.driver(QEMU_TEMPLATE, "grace_period = \"2s\"")?;
    let mut vm = lease("l-qemu", 0);
    vm.gpu_count = 0;
    driver.provision(&vm).await?;
    assert_eq!(driver.status("l-qemu").await?, LeaseStatus::Running);
    let line = support::libvirtd::qemu_command_line("gpuwarden-l-qemu")
        .context("no QEMU process runs the lease's guest")?;
    assert!(
        line.contains("-smbios type=11,value=gpuwarden.lease_id=l-qemu"),
        "{line}"
    );

    let started = Instant::now();
    driver.reclaim("l-qemu", ReleaseReason::Idle).await?;
    ensure!(
        started.elapsed() >= Duration::from_secs(2),
        "destroyed before the grace period"
    );
    assert!(host.domain("gpuwarden-l-qemu").is_none(), "undefined");
    assert!(
        support::libvirtd::qemu_command_line("gpuwarden-l-qemu").is_none(),
        "QEMU is gone"
    );
    assert_eq!(driver.status("l-qemu").await?, LeaseStatus::Gone);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_connects_again_after_libvirtd_restarts_and_finds_its_running_guest(
) -> anyhow::Result<()> {
    let mut daemon = support::libvirtd::SessionDaemon::start()?;
    let host = Host::at(&daemon.uri())?;
    let driver = host.driver(QEMU_TEMPLATE, "grace_period = \"1s\"")?;
    driver.provision(&lease("l-survivor", 0)).await?;
    assert_eq!(driver.status("l-survivor").await?, LeaseStatus::Running);

    daemon.restart()?;
    // The guest never stopped; the driver's connection died with the old daemon and is opened
    // again on the next call.
    assert!(
        support::libvirtd::qemu_command_line("gpuwarden-l-survivor").is_some(),
        "QEMU outlives libvirtd"
    );
    let status = support::eventually_async(
        "the driver reads the guest through the new libvirtd",
        Duration::from_secs(30),
        async || driver.status("l-survivor").await,
    )
    .await;
    assert_eq!(status, LeaseStatus::Running);
    driver.reclaim("l-survivor", ReleaseReason::User).await?;
    assert_eq!(driver.status("l-survivor").await?, LeaseStatus::Gone);
    assert!(
        support::libvirtd::qemu_command_line("gpuwarden-l-survivor").is_none(),
        "QEMU is gone"
    );
    Ok(())
}
