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
//! `<state_dir>`, which lives beside the lease store, so the two share a lifetime: every change
//! is one line appended to `leases.log`, and on start the log is replayed over `leases.json`,
//! which is then rewritten (atomically) and the log emptied. A change costs one `write`, not a
//! rewrite of the table; it is not fsynced, so it survives the enforcer's process dying but not
//! the host losing power (which ends the simulated fleet too). A torn last line, from a crash in
//! the middle of a write, is dropped on replay. A lease the driver was never told about, or that
//! it reclaimed, is `Gone`, so a lease the enforcer believes active but never provisioned shows
//! up as lost instead of being silently re-adopted.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};

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
    inventory: Arc<Inventory>,
    /// Lease id → the GPUs it holds, for every lease provisioned and not reclaimed, and the
    /// journal each change is appended to.
    state: Mutex<(BTreeMap<String, Vec<String>>, File)>,
}

/// The version of `leases.json`'s format this build reads and writes (absent: 1, as before the
/// field). It covers `leases.log` too, which each start empties after writing the snapshot.
const STATE_VERSION: u64 = 1;

#[derive(Debug, Serialize, Deserialize)]
struct State {
    /// The format's version ([`STATE_VERSION`]).
    #[serde(default = "gpuwarden_schema::format::one")]
    version: u64,
    leases: BTreeMap<String, Vec<String>>,
}

/// One line of `leases.log`: the lease now holds `gpus`, or (`gpus` absent) is gone.
#[derive(Debug, Serialize, Deserialize)]
struct Change {
    lease: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gpus: Option<Vec<String>>,
}

/// The leases `leases.json` and then `leases.log` describe.
fn replay(dir: &Path) -> Result<BTreeMap<String, Vec<String>>, String> {
    let snapshot = dir.join("leases.json");
    let mut leases = match std::fs::read(&snapshot) {
        Ok(bytes) => {
            gpuwarden_schema::format::check_json(
                &bytes,
                || format!("the simulated leases {}", snapshot.display()),
                "state",
                STATE_VERSION,
            )
            .map_err(|e| e.to_string())?;
            serde_json::from_slice::<State>(&bytes)
                .map_err(|e| format!("cannot read {}: {e}", snapshot.display()))?
                .leases
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
        Err(e) => return Err(format!("cannot read {}: {e}", snapshot.display())),
    };
    let log = dir.join("leases.log");
    let text = match std::fs::read(&log) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(format!("cannot read {}: {e}", log.display())),
    };
    let lines: Vec<&[u8]> = text.split(|&b| b == b'\n').collect();
    for (i, line) in lines.iter().enumerate() {
        if line.is_empty() {
            continue;
        }
        match serde_json::from_slice::<Change>(line) {
            Ok(Change {
                lease,
                gpus: Some(gpus),
            }) => {
                leases.insert(lease, gpus);
            }
            Ok(Change { lease, gpus: None }) => {
                leases.remove(&lease);
            }
            // The last line may be torn by a crash mid-write; anything before it is damage.
            Err(_) if i + 1 == lines.len() => {}
            Err(e) => {
                return Err(format!("{} line {}: {e}", log.display(), i + 1));
            }
        }
    }
    Ok(leases)
}

impl SimulatedDriver {
    /// Builds the driver from a `driver = "simulated"` entry, reading back the leases a previous
    /// instance left in `context.state_dir`.
    pub fn new(config: &SubstrateConfig, context: &DriverContext) -> Result<Self, DriverError> {
        let gpus: Vec<Gpu> = simulated_inventory(config)
            .into_iter()
            .map(Gpu::from)
            .collect();
        if gpus.is_empty() {
            return Err(config_error(
                config,
                "hosts",
                "the simulated driver needs at least one host group with GPUs",
            ));
        }
        let dir = state_dir(config, context)?;
        let unavailable = |message: String| DriverError::Unavailable {
            substrate: config.name.clone(),
            message,
        };
        let leases = replay(&dir).map_err(unavailable)?;
        // Compact: the snapshot takes in the log, then the log starts empty.
        let snapshot = dir.join("leases.json");
        let bytes = serde_json::to_vec_pretty(&State {
            version: STATE_VERSION,
            leases: leases.clone(),
        })
        .map_err(|e| unavailable(format!("cannot encode the lease table: {e}")))?;
        write_atomically(&snapshot, &bytes)
            .map_err(|e| unavailable(format!("cannot write {}: {e}", snapshot.display())))?;
        let log = dir.join("leases.log");
        let journal = File::create(&log)
            .map_err(|e| unavailable(format!("cannot open {}: {e}", log.display())))?;
        Ok(Self {
            name: config.name.clone(),
            inventory: Arc::new(Inventory {
                gpus,
                pooled: Vec::new(),
                queues: false,
            }),
            state: Mutex::new((leases, journal)),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, (BTreeMap<String, Vec<String>>, File)> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
            if !self.inventory.gpus.iter().any(|g| &g.uuid == uuid) {
                return Err(self.rejected(format!(
                    "lease {}: GPU {uuid} is not in this fleet",
                    lease.lease_id
                )));
            }
        }
        Ok(())
    }

    /// Records that `lease` now holds `gpus` (`None`: it is gone) in the journal, then in
    /// memory; memory changes only if the journal did. A change to what is already so is not
    /// written.
    fn record(&self, lease: &str, gpus: Option<&[String]>) -> Result<(), DriverError> {
        let mut state = self.state();
        let (leases, journal) = &mut *state;
        if leases.get(lease).map(Vec::as_slice) == gpus {
            return Ok(());
        }
        let mut line = serde_json::to_vec(&Change {
            lease: lease.to_owned(),
            gpus: gpus.map(<[String]>::to_vec),
        })
        .expect("strings serialize");
        line.push(b'\n');
        journal
            .write_all(&line)
            .map_err(|e| DriverError::Unavailable {
                substrate: self.name.clone(),
                message: format!("cannot append to the lease journal: {e}"),
            })?;
        match gpus {
            Some(gpus) => leases.insert(lease.to_owned(), gpus.to_vec()),
            None => leases.remove(lease),
        };
        Ok(())
    }
}

#[async_trait::async_trait]
impl Driver for SimulatedDriver {
    fn name(&self) -> &str {
        &self.name
    }

    async fn inventory(&self) -> Result<Arc<Inventory>, DriverError> {
        Ok(self.inventory.clone())
    }

    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.check_gpus(lease)?;
        if self.state().0.contains_key(&lease.lease_id) {
            return Ok(());
        }
        self.record(&lease.lease_id, Some(&lease.gpu_uuids))
    }

    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.check_gpus(lease)?;
        if !self.state().0.contains_key(&lease.lease_id) {
            return Err(self.rejected(format!(
                "lease {} is not running here, so it cannot be resized",
                lease.lease_id
            )));
        }
        self.record(&lease.lease_id, Some(&lease.gpu_uuids))
    }

    async fn reclaim(&self, lease_id: &str, reason: ReleaseReason) -> Result<(), DriverError> {
        let _ = reason;
        self.record(lease_id, None)
    }

    async fn status(&self, lease_id: &str) -> Result<LeaseStatus, DriverError> {
        Ok(if self.state().0.contains_key(lease_id) {
            LeaseStatus::Running
        } else {
            LeaseStatus::Gone
        })
    }
}
