//! The `simulated` driver: the substrate of the simulated fleet that `gpuwarden collect` runs
//! from the same `[[substrates]]` entry.
//!
//! Its inventory is [`simulated_inventory`], so the UUIDs the enforcer places leases on are the
//! ones the simulated collector reports telemetry for. The driver itself starts nothing: the
//! fleet makes a lease take effect by consuming the lease events the enforcer publishes to Kafka.
//! Provision, resize and reclaim only record what the fleet has been told.
//!
//! Restart semantics: the fleet keeps running a granted lease until it sees it released, whether
//! or not the enforcer restarts in between, so the driver must answer `Running` for such a lease
//! after a restart. It does so by keeping the leases it provisioned and has not reclaimed in
//! `<state_dir>/leases.json` (written atomically on every change; the state dir lives beside the
//! lease store, so the two share a lifetime). A lease it was never told about, or that it
//! reclaimed, is `Gone`, so a lease the enforcer believes active but never provisioned shows up
//! as lost instead of being silently re-adopted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Mutex;

use gpuwarden_schema::config::SubstrateConfig;
use gpuwarden_schema::fleet::simulated_inventory;
use gpuwarden_schema::ReleaseReason;
use serde::{Deserialize, Serialize};

use super::{
    check_lease_id, config_error, state_dir, write_atomically, Driver, DriverContext, DriverError,
    Gpu, Inventory, LeaseSpec, LeaseStatus,
};

/// The simulated fleet's driver.
#[derive(Debug)]
pub struct SimulatedDriver {
    name: String,
    gpus: Vec<Gpu>,
    path: PathBuf,
    /// Lease id → the GPUs it holds, for every lease provisioned and not reclaimed.
    leases: Mutex<BTreeMap<String, Vec<String>>>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    leases: BTreeMap<String, Vec<String>>,
}

impl SimulatedDriver {
    /// Builds the driver from a `driver = "simulated"` entry, reading back the leases a previous
    /// instance left in `context.state_dir`.
    pub fn new(config: &SubstrateConfig, context: &DriverContext) -> Result<Self, DriverError> {
        let gpus: Vec<Gpu> = simulated_inventory(config)
            .into_iter()
            .map(|g| Gpu {
                uuid: g.uuid,
                host: g.host,
                index: g.index,
                model: g.model,
            })
            .collect();
        if gpus.is_empty() {
            return Err(config_error(
                config,
                "hosts",
                "the simulated driver needs at least one host group with GPUs",
            ));
        }
        let path = state_dir(config, context)?.join("leases.json");
        let state = match std::fs::read(&path) {
            Ok(bytes) => {
                serde_json::from_slice::<State>(&bytes).map_err(|e| DriverError::Unavailable {
                    substrate: config.name.clone(),
                    message: format!("cannot read {}: {e}", path.display()),
                })?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::default(),
            Err(e) => {
                return Err(DriverError::Unavailable {
                    substrate: config.name.clone(),
                    message: format!("cannot read {}: {e}", path.display()),
                })
            }
        };
        Ok(Self {
            name: config.name.clone(),
            gpus,
            path,
            leases: Mutex::new(state.leases),
        })
    }

    fn rejected(&self, message: String) -> DriverError {
        DriverError::Rejected {
            substrate: self.name.clone(),
            message,
        }
    }

    fn check_gpus(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        check_lease_id(&self.name, &lease.lease_id)?;
        if lease.gpu_uuids.is_empty() {
            return Err(self.rejected(format!(
                "lease {} names no GPUs; the simulated fleet's GPUs are placed by UUID",
                lease.lease_id
            )));
        }
        let unique: BTreeSet<&String> = lease.gpu_uuids.iter().collect();
        if unique.len() != lease.gpu_uuids.len() {
            return Err(self.rejected(format!("lease {} names a GPU twice", lease.lease_id)));
        }
        for uuid in &lease.gpu_uuids {
            if !self.gpus.iter().any(|g| &g.uuid == uuid) {
                return Err(self.rejected(format!(
                    "lease {}: GPU {uuid} is not in this fleet",
                    lease.lease_id
                )));
            }
        }
        Ok(())
    }

    /// Applies `change` to the lease table and persists it; memory changes only if the file did.
    fn update(
        &self,
        change: impl FnOnce(&mut BTreeMap<String, Vec<String>>) -> bool,
    ) -> Result<(), DriverError> {
        let mut leases = self
            .leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut next = leases.clone();
        if !change(&mut next) {
            return Ok(());
        }
        let bytes = serde_json::to_vec_pretty(&State {
            leases: next.clone(),
        })
        .map_err(|e| DriverError::Unavailable {
            substrate: self.name.clone(),
            message: format!("cannot encode the lease table: {e}"),
        })?;
        write_atomically(&self.path, &bytes).map_err(|e| DriverError::Unavailable {
            substrate: self.name.clone(),
            message: format!("cannot write {}: {e}", self.path.display()),
        })?;
        *leases = next;
        Ok(())
    }
}

#[async_trait::async_trait]
impl Driver for SimulatedDriver {
    fn name(&self) -> &str {
        &self.name
    }

    async fn inventory(&self) -> Result<Inventory, DriverError> {
        Ok(Inventory {
            gpus: self.gpus.clone(),
            pooled: Vec::new(),
        })
    }

    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.check_gpus(lease)?;
        self.update(|leases| {
            if leases.contains_key(&lease.lease_id) {
                return false;
            }
            leases.insert(lease.lease_id.clone(), lease.gpu_uuids.clone());
            true
        })
    }

    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.check_gpus(lease)?;
        let known = self
            .leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains_key(&lease.lease_id);
        if !known {
            return Err(self.rejected(format!(
                "lease {} is not running here, so it cannot be resized",
                lease.lease_id
            )));
        }
        self.update(|leases| {
            let gpus = leases.entry(lease.lease_id.clone()).or_default();
            if *gpus == lease.gpu_uuids {
                return false;
            }
            gpus.clone_from(&lease.gpu_uuids);
            true
        })
    }

    async fn reclaim(&self, lease_id: &str, reason: ReleaseReason) -> Result<(), DriverError> {
        let _ = reason;
        self.update(|leases| leases.remove(lease_id).is_some())
    }

    async fn status(&self, lease_id: &str) -> Result<LeaseStatus, DriverError> {
        let leases = self
            .leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(if leases.contains_key(lease_id) {
            LeaseStatus::Running
        } else {
            LeaseStatus::Gone
        })
    }
}
