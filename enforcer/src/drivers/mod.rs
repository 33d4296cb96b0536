//! Substrate drivers: the one trait through which the enforcer provisions, resizes and reclaims
//! leases on a substrate and asks what it holds, and the registry that builds a driver from a
//! `[[substrates]]` entry by its `driver` kind.
//!
//! Adding a substrate is one module here, one [`Driver`] impl, and one arm in [`build`] (the
//! registry), with its `driver` kind and settings in the schema's config; the service, the
//! policy, the runtime rules and the API take any driver as it is. Every driver runs the same
//! contract suite (`tests/drivers.rs`, which also runs a driver written outside this crate
//! through the contract and the API). `docs/ARCHITECTURE.md` ("Adding a substrate driver")
//! gives the steps.
//!
//! - [`simulated`]: the simulated fleet; remembers which leases it was told to run, in
//!   `<state_dir>/leases.json` and a journal beside it, so that a restarted enforcer re-adopts
//!   them.
//! - [`local`]: one bare-metal host; runs each lease's command as a child process and keeps its
//!   pid in `<state_dir>/<lease_id>.json`.
//! - [`webhook`]: an external provisioner called with signed JSON over HTTP.
//! - [`slurm`]: a Slurm cluster, through its commands; keeps the job id of each lease it
//!   submitted in `<state_dir>/<lease_id>.json`.
//! - [`kubernetes`]: a Kubernetes cluster, through its API server; writes down the pod or
//!   Deployment it created for a lease on the lease itself, in the lease store
//!   ([`crate::store::Lease::substrate_ref`]), where every replica's driver finds it.
//! - `libvirt` (with the `libvirt` feature): virtual machines with GPUs passed through, one per
//!   lease; keeps nothing on disk: each domain carries its lease in its own metadata.
//!
//! Drivers that keep files (simulated, local) name them after the lease id, so they accept only
//! ids made of ASCII letters, digits, `-`, `_` and `.` (not starting with `.`); any other id is
//! [`DriverError::Rejected`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use gpuwarden_schema::config::{DriverKind, SubstrateConfig};
use gpuwarden_schema::{ReleaseReason, Workload};

pub mod account;
pub mod kubernetes;
#[cfg(feature = "libvirt")]
pub mod libvirt;
pub mod local;
pub mod simulated;
pub mod slurm;
pub mod webhook;

pub use kubernetes::KubernetesDriver;
#[cfg(feature = "libvirt")]
pub use libvirt::LibvirtDriver;
pub use local::LocalDriver;
pub use simulated::SimulatedDriver;
pub use slurm::SlurmDriver;
pub use webhook::WebhookDriver;
// What a driver reports lives below the policy, which decides from it; named here too, where
// drivers and their callers look for it.
pub use crate::inventory::{Gpu, Inventory, Refusal, RefusalCode};

/// A lease as a driver sees it: who, what, and where (placement already chose the GPUs).
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseSpec {
    /// The lease id.
    pub lease_id: String,
    /// Team, user and project the lease is for.
    pub team: String,
    /// The person.
    pub user: String,
    /// The project.
    pub project: String,
    /// The kind of work.
    pub workload: Workload,
    /// Full NVML model name.
    pub gpu_model: String,
    /// GPUs held.
    pub gpu_count: u32,
    /// The GPUs placement chose; empty on a pooled substrate.
    pub gpu_uuids: Vec<String>,
    /// local, slurm: the command to run (argv), if any.
    pub command: Option<Vec<String>>,
    /// How long the lease may last from its grant, if it has an end (slurm: the job's time
    /// limit).
    pub time_limit: Option<std::time::Duration>,
    /// Labels from the request.
    pub labels: BTreeMap<String, String>,
}

/// What the substrate says of a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseStatus {
    /// Running (for local: its process is alive).
    Running,
    /// It ended by itself (local: the process exited with this code, if known).
    Exited(Option<i32>),
    /// The substrate knows nothing of it (for example after a restart lost it).
    Gone,
}

/// A driver call that failed.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The config entry cannot make a driver (names the field).
    #[error("substrate {substrate}: {field}: {message}")]
    Config {
        /// The substrate's name.
        substrate: String,
        /// The config field at fault.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The substrate could not be reached or refused; retrying may help.
    #[error("substrate {substrate}: {message}")]
    Unavailable {
        /// The substrate's name.
        substrate: String,
        /// What happened.
        message: String,
    },
    /// The request cannot be carried out on this substrate (unknown GPU, no such lease…).
    #[error("substrate {substrate}: {message}")]
    Rejected {
        /// The substrate's name.
        substrate: String,
        /// Why.
        message: String,
    },
}

/// A substrate driver. Calls are idempotent: provisioning a lease twice, or reclaiming one that
/// is gone, succeeds.
#[async_trait::async_trait]
pub trait Driver: Send + Sync + std::fmt::Debug {
    /// The substrate's name (its `[[substrates]]` name).
    fn name(&self) -> &str;
    /// What the substrate has, whether held or free.
    async fn inventory(&self) -> Result<Arc<Inventory>, DriverError>;
    /// Starts a lease on its GPUs.
    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError>;
    /// Moves a running lease to `lease.gpu_uuids` / `lease.gpu_count`.
    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError>;
    /// Ends a lease (local: SIGTERM, then SIGKILL after the grace period).
    async fn reclaim(&self, lease_id: &str, reason: ReleaseReason) -> Result<(), DriverError>;
    /// What the substrate says of a lease; after an enforcer restart this is how running
    /// leases are re-adopted or found gone.
    async fn status(&self, lease_id: &str) -> Result<LeaseStatus, DriverError>;
    /// Why this substrate would refuse any lease for `user` (local: the user has no account it
    /// may run commands as); asked before placement. Most substrates refuse nobody.
    async fn refusal(&self, user: &str) -> Option<Refusal> {
        let _ = user;
        None
    }
    /// Whether the substrate can move a running lease to other GPUs; a resize of a lease on one
    /// that cannot is denied `resize_unsupported` without asking the policy or the driver.
    fn resizes(&self) -> bool {
        true
    }
    /// The Slurm driver behind this one, for the submit hook and the watcher of its queue.
    fn slurm(&self) -> Option<&SlurmDriver> {
        None
    }
    /// The Kubernetes driver behind this one, for the admission webhook of its cluster.
    fn kubernetes(&self) -> Option<&KubernetesDriver> {
        None
    }
    /// Whether the driver has what admission to its substrate decides from, or what it still
    /// lacks, for a person (the enforcer's `/readyz`). Most drivers are ready once built; a
    /// Kubernetes cluster's is once its nodes and pods have been listed.
    async fn readiness(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Where drivers may keep state that must outlive the process (local: its children's pids).
#[derive(Debug, Clone)]
pub struct DriverContext {
    /// `<storage.data_dir>/drivers/<substrate>/`.
    pub state_dir: PathBuf,
    /// Where a driver writes down, on an open lease itself, what every replica's driver must
    /// find (the Kubernetes driver's pods); others leave it be. The service makes it over its
    /// lease store (`service::lease_refs`): a driver never holds the store.
    pub lease_refs: Option<Arc<dyn LeaseRefs>>,
}

/// The one write a driver makes to the lease store, and the read that goes with it: where the
/// substrate holds an open lease ([`crate::store::Lease::substrate_ref`]). Implemented by the
/// service, which owns every write to the store.
#[async_trait::async_trait]
pub trait LeaseRefs: Send + Sync + std::fmt::Debug {
    /// Writes down (None: forgets) where the substrate holds open lease `lease_id`. Whether
    /// the lease is open: nothing is written for one that is not. Err: the store's refusal.
    async fn set(&self, lease_id: &str, substrate_ref: Option<String>) -> Result<bool, String>;

    /// Open lease `lease_id`, from this replica's memory of the store; None when it is not
    /// open (or the store cannot answer).
    fn open_lease(&self, lease_id: &str) -> Option<crate::store::Lease>;
}

/// Builds the driver a `[[substrates]]` entry names.
pub fn build(
    config: &SubstrateConfig,
    context: &DriverContext,
) -> Result<Box<dyn Driver>, DriverError> {
    Ok(match config.driver {
        DriverKind::Simulated => Box::new(SimulatedDriver::new(config, context)?),
        DriverKind::Local => Box::new(LocalDriver::new(config, context)?),
        DriverKind::Webhook => Box::new(WebhookDriver::new(config)?),
        DriverKind::Slurm => Box::new(SlurmDriver::new(config, context)?),
        DriverKind::Kubernetes => Box::new(KubernetesDriver::new(config, context)?),
        DriverKind::Libvirt => libvirt_driver(config, context)?,
    })
}

#[cfg(feature = "libvirt")]
fn libvirt_driver(
    config: &SubstrateConfig,
    context: &DriverContext,
) -> Result<Box<dyn Driver>, DriverError> {
    Ok(Box::new(LibvirtDriver::new(config, context)?))
}

/// This build has no libvirt driver: say how to get one.
#[cfg(not(feature = "libvirt"))]
fn libvirt_driver(
    config: &SubstrateConfig,
    context: &DriverContext,
) -> Result<Box<dyn Driver>, DriverError> {
    let _ = context;
    Err(config_error(config, "driver", NO_LIBVIRT))
}

/// Why a build without the `libvirt` feature cannot run a libvirt substrate, and how to get one
/// that can.
const NO_LIBVIRT: &str = "this gpuwarden was built without the libvirt driver; build it with \
    `cargo build --release --features libvirt` (needs libvirt's headers: Debian's libvirt-dev)";

/// Why this build cannot run a substrate of driver `kind`, and how to get one that can; none
/// when it can. `gpuwarden check-config` reports it on the substrate's `driver` line, as
/// [`build`] would refuse the substrate when the enforcer starts.
pub fn missing_driver(kind: DriverKind) -> Option<String> {
    missing_from(kind, cfg!(feature = "libvirt"))
}

/// [`missing_driver`] for a build with (`libvirt`) or without the libvirt driver.
fn missing_from(kind: DriverKind, libvirt: bool) -> Option<String> {
    match kind {
        DriverKind::Libvirt if !libvirt => Some(NO_LIBVIRT.to_owned()),
        DriverKind::Simulated
        | DriverKind::Local
        | DriverKind::Webhook
        | DriverKind::Slurm
        | DriverKind::Kubernetes
        | DriverKind::Libvirt => None,
    }
}

fn config_error(
    config: &SubstrateConfig,
    field: &'static str,
    message: impl Into<String>,
) -> DriverError {
    DriverError::Config {
        substrate: config.name.clone(),
        field,
        message: message.into(),
    }
}

/// Lease ids become file names under the state dir; anything that could leave it is refused.
fn check_lease_id(substrate: &str, lease_id: &str) -> Result<(), DriverError> {
    if gpuwarden_schema::lease::is_lease_id(lease_id) {
        Ok(())
    } else {
        Err(DriverError::Rejected {
            substrate: substrate.to_owned(),
            message: format!(
                "lease id {lease_id:?} must be 1 to {} ASCII letters, digits, '-', '_' or '.', \
                 not starting with '.'",
                gpuwarden_schema::lease::LEASE_ID_MAX
            ),
        })
    }
}

/// Creates the state dir; a driver that cannot keep state cannot promise re-adoption.
fn state_dir(config: &SubstrateConfig, context: &DriverContext) -> Result<PathBuf, DriverError> {
    std::fs::create_dir_all(&context.state_dir).map_err(|e| DriverError::Unavailable {
        substrate: config.name.clone(),
        message: format!(
            "cannot create the state directory {}: {e}",
            context.state_dir.display()
        ),
    })?;
    Ok(context.state_dir.clone())
}

/// Writes `bytes` to `path` so that a reader (or a crash) sees the old content or the new, never
/// a mix: a temporary file in the same directory, synced, then renamed over `path`.
fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A build without the `libvirt` feature lacks only the libvirt driver, and says how to get
    /// it; one with the feature lacks none. (Tests are built with the feature or without it;
    /// the function that decides is checked both ways.)
    #[test]
    fn a_build_lacks_the_libvirt_driver_only_without_the_feature() {
        let all = [
            DriverKind::Simulated,
            DriverKind::Local,
            DriverKind::Webhook,
            DriverKind::Slurm,
            DriverKind::Kubernetes,
            DriverKind::Libvirt,
        ];
        for kind in all {
            assert_eq!(missing_from(kind, true), None, "{kind:?}");
        }
        for kind in &all[..5] {
            assert_eq!(missing_from(*kind, false), None, "{kind:?}");
        }
        let why = missing_from(DriverKind::Libvirt, false).unwrap();
        assert!(
            why.contains("built without the libvirt driver")
                && why.contains("cargo build --release --features libvirt"),
            "{why}"
        );
        assert_eq!(
            missing_driver(DriverKind::Libvirt).is_none(),
            cfg!(feature = "libvirt")
        );
    }
}
