//! The `libvirt` driver: each lease is a virtual machine (a libvirt domain) on one host, with
//! the lease's GPUs passed through to it, through libvirt's own C library (the `virt` crate).
//! Built with the `libvirt` feature (it links libvirt.so).
//!
//! - **Inventory**: the host's NVIDIA display controllers (PCI class 0x0300/0x0302, vendor
//!   0x10de) as libvirt lists them as node devices, each with its model from `models` (by PCI
//!   device id) or from a `gpus` entry for its address; a host whose libvirt lists none (a
//!   remote or test hypervisor) uses the `gpus` entries alone; vGPUs (mediated devices) come
//!   from `gpus` entries with `mdev`. The inventory is pooled, a count per model, less the
//!   devices that virtual machines gpuwarden did not start hold: the host's hypervisor, not
//!   gpuwarden's placement, knows which device is free, and the NVML UUIDs of passed-through
//!   GPUs are not visible on the host (the guest's collector reports them, and its samples
//!   carry the lease from the SMBIOS OEM string, which is how signals find them). Read again
//!   every `poll`.
//! - **Provision**: free devices of the lease's model are picked (those no defined domain of
//!   gpuwarden's and no running domain holds), one at a time per host, and the domain template
//!   is filled for the lease (`xml::render`): one `<hostdev>` per device, the lease in
//!   gpuwarden's `<metadata>` element and in the SMBIOS OEM strings (`gpuwarden.lease_id=<id>`,
//!   which the collector inside the guest reads); it is defined as `gpuwarden-<lease id>` and
//!   started. A domain of that name that is the lease's (its metadata says so) is started if it
//!   is not running; one that is not the lease's is never touched.
//! - **Reclaim**: an ACPI shutdown request; after `grace_period`, if the guest is still
//!   running, destroy (power off); then undefine, keeping its disks unless `delete_disks`.
//! - **Resize**: not supported (a running VM keeps its GPUs; the service denies resizes with
//!   `resize_unsupported`, and the driver refuses any resize that is not to what the lease
//!   holds).
//! - **Status**: from the domain's state; a lease's domain is found by its name, else by the
//!   lease id in any domain's metadata, so a restarted enforcer re-adopts the VMs it started.
//!
//! libvirt's calls block; each runs on tokio's blocking pool. The connection is opened when the
//! driver is built and opened again whenever it is missing or libvirt dropped it (a restarted
//! libvirtd); a host unreachable at start is logged and does not stop the enforcer, whose other
//! substrates go on (its calls fail `Unavailable` with libvirt's reason until it answers).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuwarden_schema::config::{LibvirtGpu, LibvirtSettings, SubstrateConfig};
use gpuwarden_schema::libvirt::PciAddress;
use gpuwarden_schema::ReleaseReason;
use virt::connect::Connect;
use virt::domain::Domain;
use virt::error::ErrorNumber;
use virt::sys;

use super::{
    check_lease_id, config_error, DriverContext, DriverError, Inventory, LeaseSpec, LeaseStatus,
};

mod xml;

use xml::{DomainParts, Passthrough};

/// Default time between the shutdown request and destroy.
const DEFAULT_GRACE: Duration = Duration::from_secs(120);
/// Default time between two reads of the host's node devices.
const DEFAULT_POLL: Duration = Duration::from_secs(30);
/// How often a shutting-down guest is looked at.
const SHUTDOWN_POLL: Duration = Duration::from_millis(100);

/// The prefix of every domain the driver defines.
pub const DOMAIN_PREFIX: &str = "gpuwarden-";

/// A connection that is closed when the last user lets go of it (`virt::connect::Connect` does
/// not close itself).
struct Conn(Connect);

impl Drop for Conn {
    fn drop(&mut self) {
        let _ = self.0.close();
    }
}

/// A device the driver may pass through, and its model.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Passable {
    device: Passthrough,
    model: String,
}

/// The inventory last read, and the devices it counts.
struct Kept {
    at: Instant,
    inventory: Arc<Inventory>,
    passable: Arc<Vec<Passable>>,
}

/// See the module docs.
pub struct LibvirtDriver {
    name: String,
    settings: LibvirtSettings,
    template: String,
    conn: Mutex<Option<Arc<Conn>>>,
    kept: Mutex<Option<Kept>>,
    /// Held while free devices are picked and the domain holding them is defined, so two
    /// leases never pick the same device.
    placing: tokio::sync::Mutex<()>,
    /// Warnings already logged (a GPU left out of the inventory is said once, not every poll).
    warned: Mutex<BTreeSet<String>>,
}

impl std::fmt::Debug for LibvirtDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibvirtDriver")
            .field("name", &self.name)
            .field("uri", &self.settings.uri)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// libvirt's error in a sentence: its message (which names the object and the operation).
fn said(e: &virt::error::Error) -> String {
    e.message().trim().to_owned()
}

impl LibvirtDriver {
    /// Reads the template (and renders it once with sample values, so a template that cannot
    /// make a domain stops the enforcer at start, naming what is wrong) and opens the
    /// connection.
    pub fn new(config: &SubstrateConfig, context: &DriverContext) -> Result<Self, DriverError> {
        let _ = context;
        let settings = config.libvirt.clone().ok_or_else(|| {
            config_error(
                config,
                "libvirt",
                "the libvirt driver needs [substrates.libvirt]",
            )
        })?;
        let template = std::fs::read_to_string(&settings.domain_template).map_err(|e| {
            config_error(
                config,
                "libvirt.domain_template",
                format!("cannot read {}: {e}", settings.domain_template.display()),
            )
        })?;
        let sample = LeaseSpec {
            lease_id: "l-template-check".into(),
            team: "team".into(),
            user: "user".into(),
            project: "project".into(),
            workload: gpuwarden_schema::Workload::Training,
            gpu_model: "model".into(),
            gpu_count: 1,
            gpu_uuids: Vec::new(),
            command: None,
            time_limit: None,
            labels: BTreeMap::new(),
        };
        let device = [Passthrough::Pci(PciAddress {
            domain: 0,
            bus: 0,
            slot: 0,
            function: 0,
        })];
        xml::render(&template, &parts(&sample, &device)).map_err(|e| {
            config_error(
                config,
                "libvirt.domain_template",
                format!("{}: {e}", settings.domain_template.display()),
            )
        })?;
        // libvirt prints every error to stderr unless told otherwise; they reach the log here.
        virt::error::clear_error_callback();
        // A host that cannot be reached now does not stop the enforcer (its other substrates
        // go on): the driver connects on each call until it can, and says why it cannot.
        let conn = match Connect::open(Some(&settings.uri)) {
            Ok(conn) => Some(Arc::new(Conn(conn))),
            Err(e) => {
                tracing::warn!(substrate = %config.name, uri = %settings.uri, error = %said(&e), "cannot connect to libvirt (substrates.libvirt.uri) now; trying again on each call");
                None
            }
        };
        Ok(Self {
            name: config.name.clone(),
            settings,
            template,
            conn: Mutex::new(conn),
            kept: Mutex::new(None),
            placing: tokio::sync::Mutex::new(()),
            warned: Mutex::new(BTreeSet::new()),
        })
    }

    fn unavailable(&self, message: impl Into<String>) -> DriverError {
        DriverError::Unavailable {
            substrate: self.name.clone(),
            message: message.into(),
        }
    }

    fn rejected(&self, message: impl Into<String>) -> DriverError {
        DriverError::Rejected {
            substrate: self.name.clone(),
            message: message.into(),
        }
    }

    fn warn_once(&self, message: String) {
        if lock(&self.warned).insert(message.clone()) {
            tracing::warn!(substrate = %self.name, "{message}");
        }
    }

    /// The connection, opened again if libvirt dropped it.
    fn conn(&self) -> Result<Arc<Conn>, DriverError> {
        let mut conn = lock(&self.conn);
        if let Some(c) = conn.as_ref() {
            if c.0.is_alive().unwrap_or(false) {
                return Ok(c.clone());
            }
            tracing::warn!(substrate = %self.name, uri = %self.settings.uri, "the libvirt connection was lost; connecting again");
        }
        *conn = None;
        let fresh = Connect::open(Some(&self.settings.uri)).map_err(|e| {
            self.unavailable(format!(
                "connecting to libvirt at {}: {}",
                self.settings.uri,
                said(&e)
            ))
        })?;
        let fresh = Arc::new(Conn(fresh));
        *conn = Some(fresh.clone());
        Ok(fresh)
    }

    /// Runs a blocking libvirt call on the blocking pool.
    async fn blocking<T, F>(&self, f: F) -> Result<T, DriverError>
    where
        T: Send + 'static,
        F: FnOnce(&Connect) -> Result<T, DriverError> + Send + 'static,
    {
        let conn = self.conn()?;
        tokio::task::spawn_blocking(move || f(&conn.0))
            .await
            .map_err(|e| self.unavailable(format!("a libvirt call panicked: {e}")))?
    }

    /// The inventory and the devices it counts, read again once `poll` has passed.
    async fn kept_inventory(&self) -> Result<(Arc<Inventory>, Arc<Vec<Passable>>), DriverError> {
        let poll = self.settings.poll.unwrap_or(DEFAULT_POLL);
        if let Some(kept) = lock(&self.kept).as_ref() {
            if kept.at.elapsed() < poll {
                return Ok((kept.inventory.clone(), kept.passable.clone()));
            }
        }
        let read = self
            .blocking(|conn| {
                let listed =
                    node_gpus(conn).map_err(|e| format!("listing the host's node devices: {e}"));
                let foreign = held_by_others(conn).map_err(|e| DriverError::Unavailable {
                    substrate: String::new(),
                    message: format!("listing the host's domains: {}", said(&e)),
                })?;
                Ok((listed, foreign))
            })
            .await;
        let (listed, foreign) = match read {
            Ok(read) => read,
            Err(e) => {
                if let Some(kept) = lock(&self.kept).as_ref() {
                    tracing::warn!(substrate = %self.name, error = %e, "reading the host's GPUs failed; keeping the last inventory");
                    return Ok((kept.inventory.clone(), kept.passable.clone()));
                }
                return Err(self.unavailable(match e {
                    DriverError::Unavailable { message, .. } => message,
                    other => other.to_string(),
                }));
            }
        };
        let listed = listed.unwrap_or_else(|why| {
            self.warn_once(format!("{why}; the inventory is the `gpus` entries alone"));
            Vec::new()
        });
        let (passable, warnings) = merge(&listed, &self.settings.gpus, &self.settings.models);
        for w in warnings {
            self.warn_once(w);
        }
        let mut pooled: BTreeMap<String, u32> = BTreeMap::new();
        for p in &passable {
            if foreign.contains(&p.device) {
                continue;
            }
            *pooled.entry(p.model.clone()).or_default() += 1;
        }
        let inventory = Arc::new(Inventory {
            gpus: Vec::new(),
            pooled: pooled.into_iter().collect(),
            queues: false,
        });
        let passable = Arc::new(passable);
        *lock(&self.kept) = Some(Kept {
            at: Instant::now(),
            inventory: inventory.clone(),
            passable: passable.clone(),
        });
        Ok((inventory, passable))
    }
}

/// The lease's values for the template.
fn parts<'a>(lease: &'a LeaseSpec, devices: &'a [Passthrough]) -> DomainParts<'a> {
    DomainParts {
        values: vec![
            ("name", domain_name(&lease.lease_id)),
            ("lease_id", lease.lease_id.clone()),
            ("team", lease.team.clone()),
            ("user", lease.user.clone()),
            ("project", lease.project.clone()),
            ("workload", lease.workload.as_str().to_owned()),
            ("gpu_model", lease.gpu_model.clone()),
            ("gpu_count", lease.gpu_count.to_string()),
        ],
        lease_id: &lease.lease_id,
        team: &lease.team,
        user: &lease.user,
        devices,
    }
}

/// The name of a lease's domain.
pub fn domain_name(lease_id: &str) -> String {
    format!("{DOMAIN_PREFIX}{lease_id}")
}

/// The host's NVIDIA GPUs as its libvirt lists them.
fn node_gpus(conn: &Connect) -> Result<Vec<xml::NodeGpu>, String> {
    let devices = conn
        .list_all_node_devices(sys::VIR_CONNECT_LIST_NODE_DEVICES_CAP_PCI_DEV)
        .map_err(|e| said(&e))?;
    let mut gpus = Vec::new();
    for device in devices {
        let desc = device.get_xml_desc(0).map_err(|e| said(&e))?;
        if let Some(gpu) = xml::node_gpu(&desc) {
            gpus.push(gpu);
        }
    }
    gpus.sort_by_key(|g| g.address);
    Ok(gpus)
}

/// The devices the driver may pass through, from the GPUs the host lists and the `gpus`
/// entries (see the module docs), and what was left out and why.
fn merge(
    listed: &[xml::NodeGpu],
    configured: &[LibvirtGpu],
    models: &BTreeMap<String, String>,
) -> (Vec<Passable>, Vec<String>) {
    let mut out = Vec::new();
    let mut warnings = Vec::new();
    let entry_for = |address: PciAddress| {
        configured
            .iter()
            .find(|g| g.pci.as_deref().and_then(PciAddress::parse) == Some(address))
    };
    for gpu in listed {
        let model = entry_for(gpu.address)
            .and_then(|e| e.model.clone())
            .or_else(|| models.get(&gpu.product_id).cloned());
        match model {
            Some(model) => out.push(Passable {
                device: Passthrough::Pci(gpu.address),
                model,
            }),
            None => warnings.push(format!(
                "GPU {} ({}, PCI device id {}) is left out: neither `models` nor a `gpus` entry \
                 says its model",
                gpu.address, gpu.product, gpu.product_id
            )),
        }
    }
    for entry in configured {
        let device = match (&entry.pci, &entry.mdev) {
            (Some(pci), None) => {
                let Some(address) = PciAddress::parse(pci) else {
                    continue;
                };
                if listed.iter().any(|g| g.address == address) {
                    continue;
                }
                if !listed.is_empty() {
                    warnings.push(format!(
                        "`gpus` names {address}, which the host's libvirt does not list as an \
                         NVIDIA GPU; it is left out"
                    ));
                    continue;
                }
                Passthrough::Pci(address)
            }
            (None, Some(mdev)) => Passthrough::Mdev(mdev.to_ascii_lowercase()),
            _ => continue,
        };
        match entry.model.clone() {
            Some(model) => out.push(Passable { device, model }),
            None => warnings.push(format!(
                "`gpus` entry {device} is left out: it needs `model` (the host does not list it)"
            )),
        }
    }
    (out, warnings)
}

/// The devices held by domains gpuwarden did not define (running or not: another VM's
/// configuration claims them) — never counted, never picked.
fn held_by_others(conn: &Connect) -> Result<BTreeSet<Passthrough>, virt::error::Error> {
    let mut held = BTreeSet::new();
    for domain in conn.list_all_domains(0)? {
        if lease_of(&domain).is_some() {
            continue;
        }
        held.extend(xml::hostdevs(&domain.get_xml_desc(0)?));
    }
    Ok(held)
}

/// The devices every defined domain holds (gpuwarden's and others').
fn held_by_any(conn: &Connect) -> Result<BTreeSet<Passthrough>, virt::error::Error> {
    let mut held = BTreeSet::new();
    for domain in conn.list_all_domains(0)? {
        held.extend(xml::hostdevs(&domain.get_xml_desc(0)?));
    }
    Ok(held)
}

/// The lease a domain's metadata names, if any.
fn lease_of(domain: &Domain) -> Option<String> {
    domain
        .get_metadata(
            sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
            Some(xml::METADATA_NS),
            0,
        )
        .ok()
        .and_then(|element| xml::metadata_lease(&element))
}

/// The lease's domain: the one named after it if its metadata says so, else any domain whose
/// metadata names the lease (one renamed by an operator).
fn find(conn: &Connect, lease_id: &str) -> Result<Option<Domain>, virt::error::Error> {
    match Domain::lookup_by_name(conn, &domain_name(lease_id)) {
        Ok(domain) if lease_of(&domain).as_deref() == Some(lease_id) => return Ok(Some(domain)),
        Ok(_) => {}
        Err(e) if e.code() == ErrorNumber::NoDomain => {}
        Err(e) => return Err(e),
    }
    Ok(conn
        .list_all_domains(0)?
        .into_iter()
        .find(|d| lease_of(d).as_deref() == Some(lease_id)))
}

/// Undefines a domain with what hangs on it (its managed save image, snapshot and checkpoint
/// metadata, UEFI variables), asking for less from a hypervisor that supports fewer flags
/// (libvirt's test driver knows no NVRAM or checkpoints). Disks are never touched here.
fn undefine(domain: &Domain) -> Result<(), virt::error::Error> {
    let all = sys::VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | sys::VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA;
    let tries = [
        all | sys::VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA | sys::VIR_DOMAIN_UNDEFINE_NVRAM,
        all,
    ];
    for flags in tries {
        match domain.undefine_flags(flags) {
            Err(e) if e.code() == ErrorNumber::InvalidArg => continue,
            done => return done,
        }
    }
    domain.undefine()
}

/// Whether an error says the domain is gone or not running (so the step it stopped is moot).
fn moot(e: &virt::error::Error) -> bool {
    matches!(
        e.code(),
        ErrorNumber::NoDomain | ErrorNumber::OperationInvalid
    )
}

#[async_trait::async_trait]
impl super::Driver for LibvirtDriver {
    fn name(&self) -> &str {
        &self.name
    }

    async fn inventory(&self) -> Result<Arc<Inventory>, DriverError> {
        Ok(self.kept_inventory().await?.0)
    }

    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        check_lease_id(&self.name, &lease.lease_id)?;
        let (_, passable) = self.kept_inventory().await?;
        let _placing = self.placing.lock().await;
        let lease_id = lease.lease_id.clone();
        let name = self.name.clone();
        let substrate = self.name.clone();
        let template = self.template.clone();
        let model = lease.gpu_model.clone();
        let count = lease.gpu_count as usize;
        let lease = lease.clone();
        self.blocking(move |conn| {
            let unavailable = |what: &str, e: &virt::error::Error| DriverError::Unavailable {
                substrate: substrate.clone(),
                message: format!("{what} {}: {}", domain_name(&lease_id), said(e)),
            };
            let domain = match Domain::lookup_by_name(conn, &domain_name(&lease_id)) {
                Ok(domain) => {
                    if lease_of(&domain).as_deref() != Some(lease_id.as_str()) {
                        return Err(DriverError::Rejected {
                            substrate: substrate.clone(),
                            message: format!(
                                "a domain named {} exists and is not lease {lease_id}'s (its \
                                 metadata does not name it); it is left alone",
                                domain_name(&lease_id)
                            ),
                        });
                    }
                    domain
                }
                Err(e) if e.code() == ErrorNumber::NoDomain => {
                    let held = held_by_any(conn).map_err(|e| unavailable("listing the domains beside", &e))?;
                    let free: Vec<Passthrough> = passable
                        .iter()
                        .filter(|p| p.model == model && !held.contains(&p.device))
                        .map(|p| p.device.clone())
                        .take(count)
                        .collect();
                    if free.len() < count {
                        return Err(DriverError::Unavailable {
                            substrate: substrate.clone(),
                            message: format!(
                                "{} of the {count} {model} GPUs lease {lease_id} needs are free on this host",
                                free.len()
                            ),
                        });
                    }
                    let xml = xml::render(&template, &parts(&lease, &free)).map_err(|e| {
                        DriverError::Rejected {
                            substrate: substrate.clone(),
                            message: format!("the domain template: {e}"),
                        }
                    })?;
                    Domain::define_xml(conn, &xml).map_err(|e| unavailable("defining", &e))?
                }
                Err(e) => return Err(unavailable("looking up", &e)),
            };
            if domain.is_active().map_err(|e| unavailable("reading the state of", &e))? {
                return Ok(());
            }
            if let Err(e) = domain.create() {
                // A domain that cannot start (a GPU held by another VM, no IOMMU) is not kept.
                if let Err(undefine) = domain.undefine() {
                    tracing::warn!(substrate = %name, domain = %domain_name(&lease_id), error = %said(&undefine), "undefining a domain that did not start failed");
                }
                return Err(unavailable("starting", &e));
            }
            tracing::info!(substrate = %name, domain = %domain_name(&lease_id), "started the lease's virtual machine");
            Ok(())
        })
        .await
    }

    /// Succeeds only when the lease already holds as many GPUs as it asks for: a running
    /// virtual machine's GPUs are not changed (hot-plugging a GPU into a guest is rarely what
    /// its software survives).
    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        check_lease_id(&self.name, &lease.lease_id)?;
        let lease_id = lease.lease_id.clone();
        let substrate = self.name.clone();
        let held = self
            .blocking(move |conn| {
                find(conn, &lease_id)
                    .and_then(|d| d.map(|d| d.get_xml_desc(0)).transpose())
                    .map(|x| x.map(|x| xml::hostdevs(&x).len()))
                    .map_err(|e| DriverError::Unavailable {
                        substrate: substrate.clone(),
                        message: format!(
                            "reading the virtual machine of lease {lease_id}: {}",
                            said(&e)
                        ),
                    })
            })
            .await?;
        match held {
            None => Err(self.rejected(format!("lease {} has no virtual machine", lease.lease_id))),
            Some(held) if held == lease.gpu_count as usize => Ok(()),
            Some(held) => Err(self.rejected(format!(
                "lease {}: a running virtual machine's GPUs cannot be changed ({held} passed \
                 through, {} asked for); release it and ask again",
                lease.lease_id, lease.gpu_count
            ))),
        }
    }

    async fn reclaim(&self, lease_id: &str, reason: ReleaseReason) -> Result<(), DriverError> {
        check_lease_id(&self.name, lease_id)?;
        let grace = self.settings.grace_period.unwrap_or(DEFAULT_GRACE);
        let delete_disks = self.settings.delete_disks;
        let lease_id = lease_id.to_owned();
        let substrate = self.name.clone();
        self.blocking(move |conn| {
            let unavailable = |what: &str, e: &virt::error::Error| DriverError::Unavailable {
                substrate: substrate.clone(),
                message: format!("{what} the virtual machine of lease {lease_id}: {}", said(e)),
            };
            let Some(domain) = find(conn, &lease_id).map_err(|e| unavailable("looking up", &e))? else {
                return Ok(());
            };
            let name = domain.get_name().unwrap_or_else(|_| domain_name(&lease_id));
            let disks = if delete_disks {
                domain
                    .get_xml_desc(0)
                    .map(|x| xml::disk_files(&x))
                    .map_err(|e| unavailable("reading", &e))?
            } else {
                Vec::new()
            };
            let running = |d: &Domain| d.is_active().map_err(|e| unavailable("reading the state of", &e));
            if running(&domain)? {
                if !grace.is_zero() {
                    match domain.shutdown() {
                        Ok(_) => {}
                        Err(e) if moot(&e) => {}
                        Err(e) => return Err(unavailable("shutting down", &e)),
                    }
                    let deadline = Instant::now() + grace;
                    while Instant::now() < deadline && running(&domain)? {
                        std::thread::sleep(SHUTDOWN_POLL);
                    }
                }
                if running(&domain)? {
                    match domain.destroy() {
                        Ok(()) => tracing::info!(substrate = %substrate, domain = %name, grace = ?grace, reason = %reason.as_str(), "the guest did not shut down within the grace period; destroyed it"),
                        Err(e) if moot(&e) => {}
                        Err(e) => return Err(unavailable("destroying", &e)),
                    }
                }
            }
            match undefine(&domain) {
                Ok(()) => {}
                // A transient domain is gone once it stops.
                Err(e) if moot(&e) => {}
                Err(e) => return Err(unavailable("undefining", &e)),
            }
            for disk in disks {
                let deleted = virt::storage_vol::StorageVol::lookup_by_path(conn, &disk)
                    .and_then(|vol| vol.delete(0));
                if let Err(e) = deleted {
                    tracing::warn!(substrate = %substrate, domain = %name, disk = %disk, error = %said(&e), "deleting a reclaimed VM's disk failed (it is in no libvirt storage pool, or the pool refused); it is kept");
                }
            }
            tracing::info!(substrate = %substrate, domain = %name, reason = %reason.as_str(), "reclaimed the lease's virtual machine");
            Ok(())
        })
        .await
    }

    async fn status(&self, lease_id: &str) -> Result<LeaseStatus, DriverError> {
        check_lease_id(&self.name, lease_id)?;
        let lease_id = lease_id.to_owned();
        let substrate = self.name.clone();
        self.blocking(move |conn| {
            let unavailable = |e: &virt::error::Error| DriverError::Unavailable {
                substrate: substrate.clone(),
                message: format!(
                    "reading the virtual machine of lease {lease_id}: {}",
                    said(e)
                ),
            };
            let Some(domain) = find(conn, &lease_id).map_err(|e| unavailable(&e))? else {
                return Ok(LeaseStatus::Gone);
            };
            let (state, _) = domain.get_state().map_err(|e| unavailable(&e))?;
            Ok(match state {
                sys::VIR_DOMAIN_SHUTOFF | sys::VIR_DOMAIN_CRASHED => LeaseStatus::Exited(None),
                _ => LeaseStatus::Running,
            })
        })
        .await
    }

    fn resizes(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(address: &str, product_id: &str) -> xml::NodeGpu {
        xml::NodeGpu {
            address: PciAddress::parse(address).unwrap(),
            product_id: product_id.into(),
            product: "GH100".into(),
        }
    }

    fn entry(pci: Option<&str>, mdev: Option<&str>, model: Option<&str>) -> LibvirtGpu {
        LibvirtGpu {
            pci: pci.map(Into::into),
            mdev: mdev.map(Into::into),
            model: model.map(Into::into),
        }
    }

    fn pci(a: &str) -> Passthrough {
        Passthrough::Pci(PciAddress::parse(a).unwrap())
    }

    #[test]
    fn listed_gpus_take_their_model_by_device_id_or_from_their_entry() {
        let models = BTreeMap::from([("0x2330".to_owned(), "NVIDIA H100 80GB HBM3".to_owned())]);
        let listed = [
            node("0000:41:00.0", "0x2330"),
            node("0000:42:00.0", "0x2330"),
            node("0000:43:00.0", "0x20b5"),
        ];
        let configured = [
            entry(Some("0000:42:00.0"), None, Some("NVIDIA H100 NVL")),
            entry(Some("0000:99:00.0"), None, Some("X")),
            entry(
                None,
                Some("C2177883-F1BB-47F0-914D-32A22E3A8804"),
                Some("NVIDIA A100 (vGPU)"),
            ),
        ];
        let (passable, warnings) = merge(&listed, &configured, &models);
        assert_eq!(
            passable,
            [
                Passable {
                    device: pci("0000:41:00.0"),
                    model: "NVIDIA H100 80GB HBM3".into()
                },
                Passable {
                    device: pci("0000:42:00.0"),
                    model: "NVIDIA H100 NVL".into()
                },
                Passable {
                    device: Passthrough::Mdev("c2177883-f1bb-47f0-914d-32a22e3a8804".into()),
                    model: "NVIDIA A100 (vGPU)".into()
                },
            ]
        );
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("0000:43:00.0") && warnings[0].contains("0x20b5"));
        assert!(warnings[1].contains("0000:99:00.0"));
    }

    #[test]
    fn a_host_that_lists_no_gpus_uses_the_entries() {
        let configured = [
            entry(Some("0000:41:00.0"), None, Some("NVIDIA L4")),
            entry(Some("0000:42:00.0"), None, None),
        ];
        let (passable, warnings) = merge(&[], &configured, &BTreeMap::new());
        assert_eq!(
            passable,
            [Passable {
                device: pci("41:00.0"),
                model: "NVIDIA L4".into()
            }]
        );
        assert!(warnings[0].contains("needs `model`"), "{warnings:?}");
    }
}
