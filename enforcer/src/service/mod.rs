//! The lease lifecycle: admission, provisioning, release, re-adoption, expiry, extension,
//! exemption, resizing and the team view, over the store, the pure policy and the substrate
//! drivers.
//!
//! Every entry point of the enforcer goes through [`Service`], and none holds the store: the
//! front doors (the HTTP API, the portal, a substrate's own admission hook: a submit plugin, an
//! admission webhook, a Kueue check) ask admission through one adapter (`door`) and call the
//! rest directly, translating its [`ServiceError`]s into their answers; the runtime rules
//! (`rules`) and the substrates' watchers call it for reclaims, resizes and what they record
//! (`records`); the binary calls it to re-adopt leases at start and to expire them on a timer.
//! The service knows nothing of HTTP, Kafka or tokens: it is told who asks ([`Principal`]) and
//! answers in its own types.
//!
//! Each change follows the same order: the policy decides inside the store's transaction (so
//! the decision and the lease it creates cannot disagree), the store records it (with its
//! LeaseEvent and Action in the outbox), then the driver carries it out; a driver failure is
//! recorded too (the lease failed, stays releasing, or is put back), and reported as
//! [`ServiceError::Substrate`].

mod error;
mod queries;
mod records;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use gpuwarden_schema::config::{Config, EnforcerMode, Role};
use gpuwarden_schema::{ActionKind, Clock, Outcome, ReleaseReason};

pub use self::error::ServiceError;
pub use self::records::lease_refs;
use crate::drivers::{Driver, Inventory, LeaseSpec, LeaseStatus};
use crate::fields;
use crate::metrics::Metrics;
use crate::policy::{
    self, AdmissionRequest, Decision, FleetIndex, Principal, Snapshot, SubstrateState,
};
use crate::store::audit::Audit;
use crate::store::{Admitted, Lease, LeaseFilter, LeaseState, Ledger, Store, StoreError};

/// What an admission or a resize decided, and the lease as it now is.
#[derive(Debug, Clone)]
pub struct Admission {
    /// The policy's decision: admitted, or every reason it was not.
    pub decision: Decision,
    /// The lease created or resized; none for a denied admission or a dry run.
    pub lease: Option<Lease>,
}

/// A team's quota, holdings, spend, budget and block, as admission sees them now.
#[derive(Debug, Clone, PartialEq)]
pub struct Team {
    /// The team.
    pub name: String,
    /// Most GPUs it may hold.
    pub gpu_quota: u32,
    /// GPUs it holds in open leases.
    pub gpus_held: u32,
    /// Month-to-date spend: the latest spend signal plus what open leases accrued since.
    pub month_to_date_usd: f64,
    /// Its monthly budget.
    pub monthly_budget_usd: f64,
    /// Whether its new admissions are blocked.
    pub blocked: bool,
    /// Models it may use (any when empty).
    pub allowed_models: Vec<String>,
}

/// The latest `lease_utilization` signal the rules handled for an open lease.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LastUtilization {
    /// The signal's time.
    pub ts_ms: i64,
    /// Mean utilization over its window, percent.
    pub util_pct: f64,
    /// How long all the lease's GPUs had been idle.
    pub idle_ms: i64,
}

/// Past this many remembered utilizations, those of leases no longer open are forgotten.
const UTILIZATIONS_KEPT: usize = 4096;

/// What [`Service::readopt`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Readoption {
    /// Leases still running on their substrate, kept.
    pub running: usize,
    /// Leases whose substrate no longer runs them, marked failed.
    pub failed: usize,
    /// Leases whose substrate could not answer, left as they were.
    pub unknown: usize,
}

/// How recently granted a lease on a shared store must be for re-adoption to leave it alone:
/// longer than any provisioning (a driver's calls, with their retries) takes.
const READOPT_GRACE_MS: i64 = 5 * 60 * 1000;

/// The enforcer's lease lifecycle over one store and one set of drivers. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Service {
    inner: Arc<Inner>,
    /// The lease store; a [`Service::leading`] view's changes are fenced by the leadership.
    store: Store,
}

#[derive(Debug)]
struct Inner {
    config: Arc<Config>,
    drivers: BTreeMap<String, Arc<dyn Driver>>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    /// What placement keeps from one decision to the next (see [`policy::Placements`]).
    placements: Mutex<policy::Placements>,
    /// Each open lease's latest utilization, as the rules last handled it.
    utilization: Mutex<std::collections::HashMap<String, LastUtilization>>,
}

impl Inner {
    fn placements(&self) -> std::sync::MutexGuard<'_, policy::Placements> {
        self.placements
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Service {
    /// The lifecycle over `store`, with one driver per `[[substrates]]` name (placement tries
    /// substrates in config order) and `clock` stamping every change.
    pub fn new(
        config: Arc<Config>,
        store: Store,
        drivers: BTreeMap<String, Arc<dyn Driver>>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            store: store.clone(),
            inner: Arc::new(Inner {
                config,
                drivers,
                clock,
                metrics: Arc::new(Metrics::default()),
                placements: Mutex::default(),
                utilization: Mutex::default(),
            }),
        }
    }

    /// The lease store itself, for tests that set up or inspect what lies beneath the service.
    /// Nothing in the enforcer calls it: the doors, the rules and the watchers go through the
    /// service's methods, and the binary keeps the store it opened.
    #[doc(hidden)]
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// This service for the work only the leader does (runtime rules, expiry, watchers,
    /// reclaims): every change it makes is fenced by this replica's leadership (see
    /// [`Store::leading`]), so a replica that lost it (paused past its lease, cut off) changes
    /// nothing when it wakes.
    pub fn leading(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            store: self.store.leading(),
        }
    }

    /// The config the enforcer runs with.
    pub fn config(&self) -> &Arc<Config> {
        &self.inner.config
    }

    /// The clock every change is stamped with.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    /// Whether the enforcer only records what it would do (`enforcer.mode = "dry_run"`).
    pub fn dry_run(&self) -> bool {
        self.inner.config.enforcer.mode == EnforcerMode::DryRun
    }

    /// The enforcer's counters (decisions, driver errors; rendered on `/metrics`).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// Now, by the enforcer's clock.
    pub fn now(&self) -> i64 {
        self.inner.clock.now_ms()
    }

    /// Remembers `util` as lease `id`'s latest utilization (the rules call this for every
    /// `lease_utilization` signal they act on), for the portal to show.
    pub fn note_utilization(&self, id: &str, util: LastUtilization) {
        let mut kept = self
            .inner
            .utilization
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if kept.len() >= UTILIZATIONS_KEPT && !kept.contains_key(id) {
            let open: std::collections::HashSet<String> = self
                .store
                .open_leases()
                .unwrap_or_default()
                .into_iter()
                .map(|l| l.id)
                .collect();
            kept.retain(|lease, _| open.contains(lease));
        }
        kept.insert(id.to_owned(), util);
    }

    /// Lease `id`'s latest utilization, if a signal about it was handled since the enforcer
    /// started.
    pub fn utilization(&self, id: &str) -> Option<LastUtilization> {
        self.inner
            .utilization
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .copied()
    }

    /// The GPU models the substrates have, named or pooled, each once, in config order; a
    /// driver that cannot answer is left out.
    pub async fn gpu_models(&self) -> Vec<String> {
        let mut models: Vec<String> = Vec::new();
        for sub in self.inventories().await {
            let named = sub.inventory.gpus.iter().map(|g| g.model.clone());
            let pooled = sub.inventory.pooled.iter().map(|(m, _)| m.clone());
            for model in named.chain(pooled) {
                if !models.contains(&model) {
                    models.push(model);
                }
            }
        }
        models
    }

    /// Each substrate's inventory, in config order, with its placement index; a driver that
    /// cannot answer is left out (its capacity counts as none) and logged.
    async fn inventories(&self) -> Vec<SubstrateState> {
        let mut out = Vec::new();
        let config = &self.inner.config;
        let mut names: Vec<&String> = config.substrates.iter().map(|s| &s.name).collect();
        for name in self.inner.drivers.keys() {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        for name in names {
            out.extend(self.inventory_of(name).await);
        }
        out
    }

    /// Substrate `name`'s inventory with its placement index; none when it has no driver, or
    /// when its driver cannot answer (counted and logged: its capacity counts as none).
    async fn inventory_of(&self, name: &str) -> Option<SubstrateState> {
        let driver = self.inner.drivers.get(name)?;
        match driver.inventory().await {
            Ok(inventory) => Some(SubstrateState {
                name: name.to_owned(),
                index: Some(self.fleet(name, &inventory)),
                inventory,
                ..SubstrateState::default()
            }),
            Err(e) => {
                self.inner.metrics.count_driver_error();
                tracing::warn!(substrate = %name, error = %e, "inventory failed; placing elsewhere");
                None
            }
        }
    }

    /// `name`'s placement index for `inventory`: the kept one while the driver reports the same
    /// inventory, else a new one (built outside the lock, so a slow build stalls no one else).
    fn fleet(&self, name: &str, inventory: &Arc<Inventory>) -> Arc<FleetIndex> {
        if let Some(index) = self.placements().index_of(name, inventory) {
            return index;
        }
        let index = Arc::new(FleetIndex::new(inventory.clone()));
        self.placements().keep_index(name, index.clone());
        index
    }

    fn placements(&self) -> std::sync::MutexGuard<'_, policy::Placements> {
        self.inner.placements()
    }

    fn snapshot(
        config: &Arc<Config>,
        mut ledger: Ledger,
        mut subs: Vec<SubstrateState>,
    ) -> Snapshot {
        for s in &mut subs {
            s.busy = ledger.busy.remove(&s.name).unwrap_or_default();
            s.pooled_in_use = ledger.pooled_in_use.remove(&s.name).unwrap_or_default();
        }
        Snapshot {
            config: config.clone(),
            held_gpus: ledger.held_gpus,
            spend_usd: ledger.spend_usd,
            blocked: ledger.blocked,
            substrates: subs,
        }
    }

    /// Decides an admission request and, when admitted (and not a dry run), records the lease,
    /// provisions it through its substrate's driver and leaves its records in the outbox.
    ///
    /// With an idempotency `key` (the API's `Idempotency-Key`), a request the team asked with
    /// that key before is answered with the lease it was admitted as, on any replica, and
    /// nothing is decided again: a client that lost an answer (a connection dropped, a replica
    /// or the database went down as the lease was committed) retries without being admitted
    /// twice. Such a lease still `granted` is provisioned again (drivers start a lease id once),
    /// since the answer that was lost may be the only one that would have started it.
    pub async fn admit(
        &self,
        principal: &Principal,
        request: AdmissionRequest,
        key: Option<&str>,
    ) -> Result<Admission, ServiceError> {
        let command = request.command.clone();
        let admitted = key.map_or(Admitted::Lease, |k| Admitted::Keyed(k.to_owned()));
        let (decision, lease) = self.decide(principal, request, admitted).await?;
        let lease = match lease {
            Some(lease) if lease.state == LeaseState::Granted => {
                Some(self.provision(lease, command).await?)
            }
            other => other,
        };
        Ok(Admission { decision, lease })
    }

    /// Decides an admission request for work its substrate is already starting by itself (a
    /// Slurm job being submitted) and, when admitted (and not a dry run), records a hold (see
    /// [`crate::store::HOLD_PREFIX`]): it counts for quota and budget from now, and becomes a
    /// lease when the substrate names it ([`Service::bind`]). Nothing is provisioned, and the
    /// substrate's refusals of users without a system account do not apply (its users run as
    /// themselves).
    pub async fn hold(
        &self,
        principal: &Principal,
        request: AdmissionRequest,
    ) -> Result<Admission, ServiceError> {
        let (decision, lease) = self.decide(principal, request, Admitted::Hold).await?;
        Ok(Admission { decision, lease })
    }

    /// Decides an admission request for work its substrate starts by itself and has already
    /// named (a Kubernetes pod being created, `k8s-<uid>`): when admitted (and not a dry run),
    /// lease `lease_id` is recorded and published at once, and nothing is provisioned; the
    /// substrate's refusals of users without a system account do not apply. A lease already open
    /// under that id is answered as admitted, unchanged.
    pub async fn admit_named(
        &self,
        principal: &Principal,
        request: AdmissionRequest,
        lease_id: &str,
    ) -> Result<Admission, ServiceError> {
        let (decision, lease) = self
            .decide(principal, request, Admitted::Named(lease_id.to_owned()))
            .await?;
        Ok(Admission { decision, lease })
    }

    async fn decide(
        &self,
        principal: &Principal,
        request: AdmissionRequest,
        admitted: Admitted,
    ) -> Result<(Decision, Option<Lease>), ServiceError> {
        let config = self.inner.config.clone();
        request
            .check_fields()
            .map_err(|(field, why)| ServiceError::invalid(field, why))?;
        if config.team(&request.team).is_none() {
            return Err(ServiceError::NotFound(format!(
                "there is no team named {}",
                request.team
            )));
        }
        // Like an unknown team, an unknown substrate is a name that depends on the config, so
        // it is not found rather than malformed.
        if let Some(s) = &request.substrate {
            if !self.inner.drivers.contains_key(s) {
                return Err(ServiceError::NotFound(format!(
                    "there is no substrate named {s}"
                )));
            }
        }
        if let Some(why) = principal.write_refusal(&request.team, &request.user) {
            return Err(ServiceError::Forbidden(why));
        }
        let mut subs = match (&request.substrate, &admitted) {
            (Some(name), Admitted::Hold | Admitted::Named(_)) => {
                self.inventory_of(name).await.into_iter().collect()
            }
            _ => self.inventories().await,
        };
        if matches!(admitted, Admitted::Lease | Admitted::Keyed(_)) {
            for sub in &mut subs {
                if let Some(driver) = self.inner.drivers.get(&sub.name) {
                    sub.refusal = driver.refusal(&request.user).await;
                }
            }
        }
        let now = self.now();
        let policy_request = policy::Request {
            principal: principal.clone(),
            admission: request.clone(),
        };
        let inner = self.inner.clone();
        let pricing = config.pricing.clone();
        let pending =
            self.store
                .admit_as(now, &pricing, &request, admitted.clone(), move |ledger| {
                    let snapshot = Self::snapshot(&config, ledger, subs);
                    policy::evaluate(&policy_request, &snapshot, &mut inner.placements())
                });
        // A hold is answered once memory has it, without waiting for its commit: the submit hook
        // asks under slurmctld's locks, where every fsync would stall the cluster's submissions.
        // Losing it in a crash is repaired: the job carries the hold's id, and the watcher adopts
        // a job whose hold is gone. A lease is reported only once it is on disk.
        let (decision, lease) = match admitted {
            Admitted::Lease | Admitted::Named(_) | Admitted::Keyed(_) => pending.await?,
            Admitted::Hold => pending.applied().await?,
        };
        // A dry run (the portal's live estimate asks one per change of a field) decided
        // nothing that happened, so it is not counted.
        if !request.dry_run {
            self.inner
                .metrics
                .count_decision(decision.admitted(), decision.reasons.iter().map(|r| r.code));
        }
        Ok((decision, lease))
    }

    /// Gives hold `hold_id` its substrate's lease id (see [`Store::bind`]).
    pub async fn bind(
        &self,
        hold_id: &str,
        lease_id: &str,
        state: LeaseState,
        detail: &str,
    ) -> Result<Lease, ServiceError> {
        let now = self.now();
        Ok(self
            .store
            .bind(hold_id, lease_id, state, now, detail)
            .await?)
    }

    /// Forgets hold `hold_id`, whose work never reached its substrate (see [`Store::drop_hold`]).
    pub async fn drop_hold(&self, hold_id: &str) -> Result<(), ServiceError> {
        Ok(self.store.drop_hold(hold_id).await?)
    }

    /// Records work its substrate runs without having asked admission (see [`Store::adopt`]).
    pub async fn adopt(&self, lease: Lease, detail: &str) -> Result<Lease, ServiceError> {
        let now = self.now();
        Ok(self.store.adopt(lease, now, detail).await?)
    }

    /// Marks an open lease `active`: its substrate started it.
    pub async fn activate(&self, id: &str) -> Result<Lease, ServiceError> {
        let now = self.now();
        Ok(self
            .store
            .transition(id, LeaseState::Active, now, ReleaseReason::User, "")
            .await?)
    }

    /// Records that an open lease ended on its substrate by itself (a Slurm job completed,
    /// failed or was cancelled outside gpuwarden): `released` with `reason` (`failed` makes it
    /// `failed`), without asking the driver to end it.
    pub async fn ended(
        &self,
        id: &str,
        reason: ReleaseReason,
        detail: &str,
    ) -> Result<Lease, ServiceError> {
        let now = self.now();
        let to = match reason {
            ReleaseReason::Failed => LeaseState::Failed,
            _ => LeaseState::Released,
        };
        Ok(self.store.transition(id, to, now, reason, detail).await?)
    }

    /// Changes the GPUs of a lease whose substrate is changing them itself (a pending Slurm
    /// job's `scontrol update`): checked by the policy like [`Service::resize`], and recorded
    /// without calling the driver.
    pub async fn resize_pending(
        &self,
        principal: &Principal,
        id: &str,
        gpus: u32,
    ) -> Result<Admission, ServiceError> {
        if gpus == 0 {
            return Err(ServiceError::invalid("gpus", "must be at least 1"));
        }
        let lease = self.lease_for_write(principal, id).await?;
        let (decision, lease) = self
            .store_resize(
                &lease,
                gpus,
                "requested",
                "changed in the substrate's queue",
            )
            .await
            .applied()
            .await?;
        Ok(Admission {
            decision,
            lease: Some(lease),
        })
    }

    fn spec(lease: &Lease) -> LeaseSpec {
        LeaseSpec {
            lease_id: lease.id.clone(),
            team: lease.team.clone(),
            user: lease.user.clone(),
            project: lease.project.clone(),
            workload: lease.workload,
            gpu_model: lease.gpu_model.clone(),
            gpu_count: lease.gpu_count,
            gpu_uuids: lease.gpu_uuids.clone(),
            command: None,
            labels: lease.labels.clone(),
            time_limit: lease
                .expires_at
                .map(|end| Duration::from_millis((end - lease.granted_at).max(0) as u64)),
        }
    }

    /// The driver of substrate `name`.
    pub fn driver_named(&self, name: &str) -> Option<Arc<dyn Driver>> {
        self.inner.drivers.get(name).cloned()
    }

    /// Whether every substrate's driver has what admission decides from (see
    /// [`Driver::readiness`]), or, one sentence per substrate, what is missing.
    pub async fn readiness(&self) -> Result<(), String> {
        let mut missing = Vec::new();
        for (name, driver) in &self.inner.drivers {
            if let Err(why) = driver.readiness().await {
                missing.push(format!("substrate {name}: {why}"));
            }
        }
        if missing.is_empty() {
            Ok(())
        } else {
            Err(missing.join("; "))
        }
    }

    fn driver(&self, lease: &Lease) -> Result<Arc<dyn Driver>, ServiceError> {
        self.inner
            .drivers
            .get(&lease.substrate)
            .cloned()
            .ok_or_else(|| {
                ServiceError::Substrate(format!("no driver runs substrate {}", lease.substrate))
            })
    }

    async fn provision(
        &self,
        lease: Lease,
        command: Option<Vec<String>>,
    ) -> Result<Lease, ServiceError> {
        let driver = self.driver(&lease)?;
        let id = lease.id.clone();
        let spec = LeaseSpec {
            command,
            ..Self::spec(&lease)
        };
        match driver.provision(&spec).await {
            // A Slurm job waits in the queue: the watcher of the queue marks it active when it
            // starts.
            Ok(()) if driver.slurm().is_some() => Ok(lease),
            Ok(()) => {
                let now = self.now();
                // `granted` is on disk; if `active` is lost in a crash, re-adoption redoes it.
                let store = &self.store;
                match store
                    .transition(&id, LeaseState::Active, now, ReleaseReason::User, "")
                    .applied()
                    .await
                {
                    // Provisioned and made active meanwhile by another try of the same request
                    // (a client retrying with its Idempotency-Key while the first try runs): the
                    // lease as that try left it.
                    Err(StoreError::InvalidTransition {
                        from: LeaseState::Active,
                        to: LeaseState::Active,
                        ..
                    }) => match store.open_lease(&id)? {
                        Some(active) => Ok(active),
                        None => Err(ServiceError::Conflict(format!(
                            "lease {id} ended while it was being started"
                        ))),
                    },
                    done => Ok(done?),
                }
            }
            Err(e) => {
                self.inner.metrics.count_driver_error();
                tracing::warn!(lease_id = %id, error = %e, "provisioning failed");
                let now = self.now();
                let detail = e.to_string();
                self.store
                    .transition(&id, LeaseState::Failed, now, ReleaseReason::Failed, &detail)
                    .await?;
                Err(ServiceError::Substrate(format!(
                    "the lease was admitted but could not be started: {e}"
                )))
            }
        }
    }

    /// The leases `principal` may read, newest first: of `team` when given (which it must be
    /// allowed to read), else of every team it reads (every team for an admin); only those in
    /// `state` when given.
    pub async fn leases(
        &self,
        principal: &Principal,
        team: Option<String>,
        state: Option<LeaseState>,
    ) -> Result<Vec<Lease>, ServiceError> {
        let teams = match team {
            Some(team) if principal.may_read(&team) => Some(vec![team]),
            Some(team) => {
                return Err(ServiceError::Forbidden(format!(
                    "{} may not read team {team}",
                    principal.name
                )))
            }
            None if principal.role == Role::Admin => None,
            None => Some(principal.teams.clone()),
        };
        let filter = LeaseFilter { teams, state };
        Ok(self.store.leases(&filter).await?)
    }

    /// Lease `id` as the store has it, whoever asks.
    async fn stored(&self, id: &str) -> Result<Lease, ServiceError> {
        self.store
            .lease(id)
            .await?
            .ok_or_else(|| ServiceError::NotFound(format!("there is no lease {id}")))
    }

    /// Lease `id`, if `principal` may read its team.
    pub async fn lease(&self, principal: &Principal, id: &str) -> Result<Lease, ServiceError> {
        let lease = self.stored(id).await?;
        if !principal.may_read(&lease.team) {
            return Err(ServiceError::Forbidden(format!(
                "{} may not read team {}",
                principal.name, lease.team
            )));
        }
        Ok(lease)
    }

    /// Ends lease `id` for `principal`: reason `user`, or `admin` when an admin ends someone
    /// else's lease. See [`Service::release`]. The `reclaim` Action's detail says who asked
    /// (`released (user): asked by ada`, `…: asked by service <token>` for a front-end acting
    /// for the holder), since reason `user` is also what a substrate's own ending records (a
    /// Slurm job that completed, a deleted pod), and the portal tells them apart by it.
    pub async fn release_by(&self, principal: &Principal, id: &str) -> Result<Lease, ServiceError> {
        let lease = self.lease_for_write(principal, id).await?;
        let reason = if principal.role == Role::Admin && principal.name != lease.user {
            ReleaseReason::Admin
        } else {
            ReleaseReason::User
        };
        let why = match principal.role {
            Role::Service => format!("asked by service {}", principal.name),
            _ => format!("asked by {}", principal.name),
        };
        self.release_for(id, reason, &why).await
    }

    /// Ends a lease: `releasing`, the driver's reclaim, then `released` with a LeaseEvent in the
    /// outbox. A driver failure leaves it `releasing` (call again to retry). Used by the API's
    /// release and by runtime rules (reason `expired`, `idle`, `budget`).
    pub async fn release(&self, id: &str, reason: ReleaseReason) -> Result<Lease, ServiceError> {
        self.release_for(id, reason, "").await
    }

    /// [`Service::release`], saying why in the `reclaim` Action's detail.
    pub async fn release_for(
        &self,
        id: &str,
        reason: ReleaseReason,
        why: &str,
    ) -> Result<Lease, ServiceError> {
        let now = self.now();
        // Not waited for: `released` commits after it, in order, and is waited for. If the
        // process dies between the reclaim and that commit, the lease is still open on disk and
        // re-adoption finds it gone from its substrate and marks it failed.
        let lease = self
            .store
            .transition(id, LeaseState::Releasing, now, reason, "")
            .applied()
            .await?;
        let driver = self.driver(&lease)?;
        if let Err(e) = driver.reclaim(id, reason).await {
            self.inner.metrics.count_driver_error();
            return Err(ServiceError::Substrate(format!(
                "lease {id} is releasing but its substrate did not confirm: {e}"
            )));
        }
        let now = self.now();
        let mut detail = format!("released ({})", reason.as_str());
        if !why.is_empty() {
            detail.push_str(": ");
            detail.push_str(why);
        }
        Ok(self
            .store
            .transition(id, LeaseState::Released, now, reason, &detail)
            .await?)
    }

    /// Marks lease `id` failed with `why` (a substrate that never confirmed its reclaim); its
    /// `released` event (reason `failed`) goes to the outbox.
    pub async fn fail(&self, id: &str, why: &str) -> Result<Lease, ServiceError> {
        let now = self.now();
        Ok(self
            .store
            .transition(id, LeaseState::Failed, now, ReleaseReason::Failed, why)
            .await?)
    }

    /// Re-adopts the leases a previous run of the enforcer left open: each `granted` or `active`
    /// lease's driver is asked for its status. `Running` keeps it (a `granted` one becomes
    /// `active`); `Exited` or `Gone` marks it `failed`, which publishes its `released` event
    /// (reason `failed`). A driver that cannot answer leaves the lease as it is, to be asked
    /// again on the next start; `releasing` leases are left to a retried release.
    pub async fn readopt(&self) -> Result<Readoption, ServiceError> {
        self.readopt_where(|l| matches!(l.state, LeaseState::Granted | LeaseState::Active))
            .await
    }

    /// Settles the leases granted on a shared store whose replica never reported them started
    /// or failed (it died between the commit and the driver's answer): a `granted` lease older
    /// than the re-adoption grace is asked of its driver, as [`Service::readopt`] does, so that
    /// it becomes `active` or `failed` without waiting for the next change of leader. The
    /// leader calls it with its other periodic work.
    pub async fn settle_stranded_grants(&self) -> Result<Readoption, ServiceError> {
        if !self.store.is_shared() {
            return Ok(Readoption::default());
        }
        let now = self.now();
        self.readopt_where(|l| {
            l.state == LeaseState::Granted && now - l.updated_at >= READOPT_GRACE_MS
        })
        .await
    }

    async fn readopt_where(
        &self,
        wanted: impl Fn(&Lease) -> bool,
    ) -> Result<Readoption, ServiceError> {
        let mut report = Readoption::default();
        let open = self.store.open_leases()?;
        for lease in open {
            if !wanted(&lease) {
                continue;
            }
            // On a shared store another replica may be provisioning a lease it has just
            // granted: one not yet provisioned is not gone. Such a lease is left to its
            // replica, which makes it active or failed itself.
            if self.store.is_shared()
                && lease.state == LeaseState::Granted
                && self.now() - lease.updated_at < READOPT_GRACE_MS
            {
                report.unknown += 1;
                continue;
            }
            let driver = self.driver(&lease)?;
            // A Slurm substrate's leases and holds follow its queue, which its watcher reads; a
            // Kueue Workload's lease follows the Workload, which the Kueue controller reads.
            if driver.slurm().is_some()
                || lease
                    .id
                    .starts_with(gpuwarden_schema::lease::KUEUE_LEASE_PREFIX)
            {
                continue;
            }
            let status = match driver.status(&lease.id).await {
                Ok(status) => status,
                Err(e) => {
                    self.inner.metrics.count_driver_error();
                    tracing::warn!(lease_id = %lease.id, error = %e, "cannot ask the substrate about a lease; leaving it as it is");
                    report.unknown += 1;
                    continue;
                }
            };
            let now = self.now();
            let id = lease.id.clone();
            match status {
                LeaseStatus::Running => {
                    if lease.state == LeaseState::Granted {
                        self.store
                            .transition(&id, LeaseState::Active, now, ReleaseReason::User, "")
                            .await?;
                    }
                    report.running += 1;
                }
                LeaseStatus::Exited(_) | LeaseStatus::Gone => {
                    let detail = match status {
                        LeaseStatus::Exited(Some(code)) => {
                            format!("ended while the enforcer was down (exit code {code})")
                        }
                        _ => "gone from its substrate while the enforcer was down".to_string(),
                    };
                    tracing::warn!(lease_id = %lease.id, substrate = %lease.substrate, detail = %detail, "lease failed");
                    self.store
                        .transition(&id, LeaseState::Failed, now, ReleaseReason::Failed, &detail)
                        .await?;
                    report.failed += 1;
                }
            }
        }
        Ok(report)
    }

    /// Releases every open lease whose `expires_at` has passed, with reason `expired`; returns
    /// how many were released. A lease whose driver fails stays `releasing` and is tried again
    /// on the next call.
    pub async fn expire_due(&self) -> Result<usize, ServiceError> {
        let now = self.now();
        let due = self.store.due_for_expiry(now)?;
        let mut released = 0;
        for lease in due {
            if self
                .store
                .exempt_until(&lease.id)
                .is_some_and(|until| until > now)
            {
                continue;
            }
            if self.dry_run() {
                let record = Audit::lease(ActionKind::Reclaim, &lease, "expired")
                    .under_workload_policy(lease.workload)
                    .at(now, Outcome::DryRun, "past its end; would be reclaimed");
                self.store
                    .record_once(&format!("dry_run:expired:{}", lease.id), &record)
                    .await?;
                continue;
            }
            match self.release(&lease.id, ReleaseReason::Expired).await {
                Ok(_) => {
                    tracing::info!(lease_id = %lease.id, team = %lease.team, "lease expired; released");
                    released += 1;
                }
                Err(e) => {
                    tracing::warn!(lease_id = %lease.id, error = %e, "releasing an expired lease failed; will retry")
                }
            }
        }
        Ok(released)
    }

    async fn lease_for_write(
        &self,
        principal: &Principal,
        id: &str,
    ) -> Result<Lease, ServiceError> {
        let lease = self.stored(id).await?;
        if let Some(why) = principal.write_refusal(&lease.team, &lease.user) {
            return Err(ServiceError::Forbidden(why));
        }
        Ok(lease)
    }

    /// Moves a lease's end later by `by`. Only admins may go past the workload's `max_duration`
    /// (counted from the grant).
    pub async fn extend(
        &self,
        principal: &Principal,
        id: &str,
        by: Duration,
    ) -> Result<Lease, ServiceError> {
        let lease = self.lease_for_write(principal, id).await?;
        let Some(expires_at) = lease.expires_at else {
            return Err(ServiceError::Conflict(format!(
                "lease {id} has no end to extend"
            )));
        };
        let new_end = gpuwarden_schema::end_after(expires_at, by);
        let max = self.inner.config.workload(lease.workload).max_duration;
        if let Some(max) = max {
            let total = Duration::from_millis((new_end - lease.granted_at).max(0) as u64);
            if total > max && principal.role != Role::Admin {
                return Err(ServiceError::Forbidden(format!(
                    "{} leases may last at most {}; extending by {} would make this one last {}",
                    lease.workload,
                    humantime::format_duration(max),
                    humantime::format_duration(by),
                    humantime::format_duration(total)
                )));
            }
        }
        let now = self.now();
        Ok(self.store.extend(id, new_end, now).await?)
    }

    /// Exempts a lease from the runtime rules (idle and duration) for `duration` from now. Admins
    /// only; audited as an `alert` Action with reason `exempt`.
    pub async fn exempt(
        &self,
        principal: &Principal,
        id: &str,
        duration: Duration,
        reason: &str,
    ) -> Result<Lease, ServiceError> {
        if principal.role != Role::Admin {
            return Err(ServiceError::Forbidden(format!(
                "only an admin may exempt a lease from its policy; {} is a {}",
                principal.name,
                format!("{:?}", principal.role).to_lowercase()
            )));
        }
        if duration.is_zero() {
            return Err(ServiceError::invalid("duration", "must be more than zero"));
        }
        fields::check_text(reason).map_err(|why| {
            ServiceError::invalid("reason", format!("{why}; say why the lease is exempt"))
        })?;
        let now = self.now();
        let until_ms = gpuwarden_schema::end_after(now, duration);
        Ok(self
            .store
            .exempt(id, until_ms, &principal.name, reason, now)
            .await?)
    }

    /// Changes a lease's GPU count, checked by the policy like an admission, and carries it out
    /// through the driver.
    pub async fn resize(
        &self,
        principal: &Principal,
        id: &str,
        gpus: u32,
    ) -> Result<Admission, ServiceError> {
        self.resize_for(principal, id, gpus, "requested", "").await
    }

    /// [`Service::resize`] with the reason its `resize` Action carries (`requested` from the
    /// API; `idle` or `autoscale` from the runtime rules) and why, for its detail.
    pub async fn resize_for(
        &self,
        principal: &Principal,
        id: &str,
        gpus: u32,
        reason: &str,
        why: &str,
    ) -> Result<Admission, ServiceError> {
        if gpus == 0 {
            return Err(ServiceError::invalid("gpus", "must be at least 1"));
        }
        let before = self.lease_for_write(principal, id).await?;
        let lease = &before;
        if gpus != lease.gpu_count && !self.driver(lease)?.resizes() {
            let decision = Decision {
                reasons: vec![policy::Reason {
                    code: policy::ReasonCode::ResizeUnsupported,
                    message: format!(
                        "lease {id} runs on substrate {}, which cannot change a running lease's \
                         GPUs; release it and ask again",
                        lease.substrate
                    ),
                }],
                estimate: policy::Estimate {
                    usd_per_hour: 0.0,
                    max_usd: None,
                    gpu_model: Some(lease.gpu_model.clone()),
                },
                placement: None,
                duration: None,
            };
            return Ok(Admission {
                decision,
                lease: Some(before),
            });
        }
        let (decision, lease) = self.store_resize(lease, gpus, reason, why).await.await?;
        if decision.admitted() {
            let driver = self.driver(&lease)?;
            if let Err(e) = driver.resize(&Self::spec(&lease)).await {
                self.inner.metrics.count_driver_error();
                tracing::warn!(lease_id = %id, error = %e, "resize failed on the substrate; putting the lease back");
                let now = self.now();
                self.store
                    .undo_resize(id, &before, now, &e.to_string())
                    .await?;
                return Err(ServiceError::Substrate(format!(
                    "lease {id} keeps its {} GPUs: its substrate did not carry out the resize: {e}",
                    before.gpu_count
                )));
            }
        }
        Ok(Admission {
            decision,
            lease: Some(lease),
        })
    }

    /// Records that lease `id` holds `gpus` on its substrate, which changed it without asking (a
    /// Slurm array's throttle raised): a `resized` event and a `resize` Action with reason
    /// `observed` and `why`; no policy decides, since the GPUs are held already.
    pub async fn follow_size(&self, id: &str, gpus: u32, why: &str) -> Result<Lease, ServiceError> {
        let config = self.inner.config.clone();
        let now = self.now();
        let (_, lease) = self
            .store
            .resize(
                id,
                now,
                &config.pricing.clone(),
                "observed",
                why,
                move |_, lease| Decision {
                    reasons: Vec::new(),
                    estimate: policy::Estimate {
                        usd_per_hour: config.pricing.usd_per_gpu_hour(&lease.gpu_model)
                            * f64::from(gpus),
                        max_usd: None,
                        gpu_model: Some(lease.gpu_model.clone()),
                    },
                    placement: Some(policy::Placement {
                        substrate: lease.substrate.clone(),
                        gpu_model: lease.gpu_model.clone(),
                        gpu_count: gpus,
                        gpu_uuids: Vec::new(),
                    }),
                    duration: None,
                },
            )
            .await?;
        Ok(lease)
    }

    /// Lease `lease` holding `gpus`, decided by the policy against its substrate's inventory (a
    /// lease is resized where it runs: only its substrate is asked) and recorded by
    /// `Store::resize` with `reason` and `why` for its Action.
    async fn store_resize(
        &self,
        lease: &Lease,
        gpus: u32,
        reason: &str,
        why: &str,
    ) -> crate::store::Pending<(Decision, Lease)> {
        let subs: Vec<SubstrateState> = self
            .inventory_of(&lease.substrate)
            .await
            .into_iter()
            .collect();
        let config = self.inner.config.clone();
        let now = self.now();
        let inner = self.inner.clone();
        self.store.resize(
            &lease.id,
            now,
            &config.pricing.clone(),
            reason,
            why,
            move |ledger, lease| {
                let snapshot = Self::snapshot(&config, ledger, subs);
                policy::evaluate_resize(
                    &lease.holding(now),
                    gpus,
                    &snapshot,
                    &mut inner.placements(),
                )
            },
        )
    }

    /// Blocks `team`'s new admissions for `reason` (`budget_exceeded`), with a `block` Action.
    pub async fn block_team(&self, team: &str, reason: &str) -> Result<(), ServiceError> {
        let now = self.now();
        Ok(self.store.block_team(team, reason, now).await?)
    }

    /// Lifts `team`'s block, with an `unblock` Action.
    pub async fn unblock_team(&self, team: &str) -> Result<(), ServiceError> {
        let now = self.now();
        Ok(self.store.unblock_team(team, now).await?)
    }

    /// A team's quota, holdings, spend, budget and block.
    pub async fn team(&self, principal: &Principal, team: &str) -> Result<Team, ServiceError> {
        let config = self.inner.config.clone();
        let t = config
            .team(team)
            .ok_or_else(|| ServiceError::NotFound(format!("there is no team named {team}")))?
            .clone();
        if !principal.may_read(team) {
            return Err(ServiceError::Forbidden(format!(
                "{} may not read team {team}",
                principal.name
            )));
        }
        let now = self.now();
        let ledger = self.store.ledger(now, &config.pricing)?;
        Ok(Team {
            gpus_held: ledger.held_gpus.get(&t.name).copied().unwrap_or(0),
            month_to_date_usd: ledger.spend_usd.get(&t.name).copied().unwrap_or(0.0),
            blocked: ledger.blocked.contains(&t.name),
            gpu_quota: t.gpu_quota,
            monthly_budget_usd: t.monthly_budget_usd,
            allowed_models: t.allowed_models,
            name: t.name,
        })
    }
}
