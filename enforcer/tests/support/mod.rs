//! What the enforcer's integration tests share: an enforcer put together for a test (its store
//! in a temp dir, a manual clock, a substrate driver that records its calls and fails on
//! demand), API tokens and calls, and waits for what happens in the background.
//!
//! Every test binary includes this module and uses a part of it, hence the `allow` below.

#![allow(dead_code, unreachable_pub)]

#[path = "../../../tests/support/accounts.rs"]
pub mod accounts;
#[path = "../../../tests/support/kube_api.rs"]
pub mod kube_api;
#[cfg(feature = "libvirt")]
#[path = "../../../tests/support/libvirtd.rs"]
pub mod libvirtd;
#[path = "../../../tests/support/postgres.rs"]
pub mod pg;
#[path = "../../../tests/support/pki.rs"]
pub mod pki;
#[path = "../../../tests/support/slurm.rs"]
pub mod slurm;
pub mod stores;

use std::collections::BTreeMap;
use std::fmt::Display;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use gpuwarden_enforcer::alerts::Alerts;
use gpuwarden_enforcer::api::{router, AppState};
use gpuwarden_enforcer::drivers::{Driver, DriverError, Gpu, Inventory, LeaseSpec, LeaseStatus};
use gpuwarden_enforcer::rules::Rules;
use gpuwarden_enforcer::service::Service;
use gpuwarden_enforcer::store::Store;
use gpuwarden_schema::config::{Config, Role, TokenConfig};
use gpuwarden_schema::{ManualClock, ReleaseReason};
use http_body_util::BodyExt;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tower::ServiceExt;

/// A granted one-GPU training lease `id` on `substrate` (team `ml`, user `ada`, project `p`, an
/// H100, granted at 0), for the tests that put a lease in the store or hand one to the rules
/// themselves; a test changes what it needs with `Lease { …, ..lease(id, substrate) }`.
pub fn lease(id: &str, substrate: &str) -> gpuwarden_enforcer::store::Lease {
    gpuwarden_enforcer::store::Lease {
        id: id.into(),
        team: "ml".into(),
        user: "ada".into(),
        project: "p".into(),
        workload: gpuwarden_schema::Workload::Training,
        substrate: substrate.into(),
        gpu_model: "NVIDIA H100 80GB HBM3".into(),
        gpu_count: 1,
        gpu_uuids: Vec::new(),
        labels: BTreeMap::new(),
        state: gpuwarden_enforcer::store::LeaseState::Granted,
        granted_at: 0,
        expires_at: None,
        updated_at: 0,
        released_at: None,
        release_reason: None,
        admission_key: None,
        substrate_ref: None,
    }
}

/// An enforcer in process: the API's router and the rules over one service, with the store in a
/// temp dir, a manual clock, and one substrate, `sim`, played by a `TestDriver`.
pub(crate) struct Enforcer {
    pub(crate) app: Router,
    pub(crate) service: Service,
    pub(crate) rules: Rules,
    pub(crate) clock: Arc<ManualClock>,
    pub(crate) driver: Arc<TestDriver>,
    _dir: tempfile::TempDir,
}

impl Enforcer {
    /// An enforcer on `config` whose clock reads `now` (epoch milliseconds), with `gpus` GPUs.
    pub(crate) fn new(config: Config, gpus: u32, now: i64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let driver = Arc::new(TestDriver {
            gpus,
            ..TestDriver::default()
        });
        let clock = Arc::new(ManualClock::new(now));
        let (service, rules, app) =
            assemble(Arc::new(config), dir.path(), driver.clone(), clock.clone());
        Self {
            app,
            service,
            rules,
            clock,
            driver,
            _dir: dir,
        }
    }
}

impl Enforcer {
    /// The enforcer stopped and started again on the same store file, driver and clock: what it
    /// knows after a restart is what the store kept.
    pub(crate) fn restart(self) -> Self {
        let Self {
            app,
            service,
            rules,
            clock,
            driver,
            _dir,
        } = self;
        let config = service.config().clone();
        // One store owns the file at a time: every handle on the old one goes first.
        drop((app, rules, service));
        let (service, rules, app) = assemble(config, _dir.path(), driver.clone(), clock.clone());
        Self {
            app,
            service,
            rules,
            clock,
            driver,
            _dir,
        }
    }
}

/// The store in `dir`, the service the API and the rules share, the rules and the router, put
/// together as `gpuwarden enforce` does. The one place in the tests that knows how.
fn assemble(
    config: Arc<Config>,
    dir: &Path,
    driver: Arc<TestDriver>,
    clock: Arc<ManualClock>,
) -> (Service, Rules, Router) {
    let store = Store::open(&dir.join("enforcer.db")).unwrap();
    let mut drivers: BTreeMap<String, Arc<dyn Driver>> = BTreeMap::new();
    drivers.insert("sim".into(), driver);
    let service = Service::new(config.clone(), store, drivers, clock);
    let rules = Rules::new(
        service.clone(),
        Alerts::new(&config.enforcer.alert_webhooks),
    );
    (service.clone(), rules, router(AppState::new(service)))
}

/// How long the waits below pause between tries.
const PAUSE: Duration = Duration::from_millis(10);

/// Tries `check` until it gives `Ok`, and returns what it gave. After `timeout` it panics with
/// `what` and the last `Err`, which says what the check saw instead.
#[track_caller]
pub(crate) fn eventually<T, E: Display>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, E>,
) -> T {
    let started = Instant::now();
    loop {
        match check() {
            Ok(value) => return value,
            Err(seen) if started.elapsed() >= timeout => {
                panic!("{what}: not within {timeout:?}; the last try saw:\n{seen}")
            }
            Err(_) => std::thread::sleep(PAUSE),
        }
    }
}

/// [`eventually`] for a Tokio test: the pauses leave the runtime to the tasks being waited for.
pub(crate) async fn eventually_async<T, E: Display>(
    what: &str,
    timeout: Duration,
    mut check: impl AsyncFnMut() -> Result<T, E>,
) -> T {
    let started = Instant::now();
    loop {
        match check().await {
            Ok(value) => return value,
            Err(seen) if started.elapsed() >= timeout => {
                panic!("{what}: not within {timeout:?}; the last try saw:\n{seen}")
            }
            Err(_) => tokio::time::sleep(PAUSE).await,
        }
    }
}

/// A substrate of `gpus` H100s on hosts of four; `fail_*` make its calls fail.
#[derive(Debug, Default)]
pub(crate) struct TestDriver {
    pub(crate) gpus: u32,
    pub(crate) fail_provision: AtomicBool,
    pub(crate) fail_resize: AtomicBool,
    pub(crate) fail_reclaim: AtomicBool,
    pub(crate) calls: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl Driver for TestDriver {
    fn name(&self) -> &str {
        "sim"
    }
    async fn inventory(&self) -> Result<Arc<Inventory>, DriverError> {
        Ok(Arc::new(Inventory {
            gpus: (0..self.gpus)
                .map(|i| Gpu {
                    uuid: format!("GPU-{i:02}"),
                    host: format!("h{}", i / 4),
                    index: i % 4,
                    model: "NVIDIA H100 80GB HBM3".into(),
                })
                .collect(),
            pooled: Vec::new(),
            queues: false,
        }))
    }
    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("provision {}", lease.gpu_count));
        if self.fail_provision.load(Ordering::Relaxed) {
            return Err(DriverError::Unavailable {
                substrate: "sim".into(),
                message: "the fleet is down".into(),
            });
        }
        Ok(())
    }
    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("resize {}", lease.gpu_count));
        if self.fail_resize.load(Ordering::Relaxed) {
            return Err(DriverError::Unavailable {
                substrate: "sim".into(),
                message: "the fleet is down".into(),
            });
        }
        Ok(())
    }
    async fn reclaim(&self, _: &str, reason: ReleaseReason) -> Result<(), DriverError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("reclaim {}", reason.as_str()));
        if self.fail_reclaim.load(Ordering::Relaxed) {
            return Err(DriverError::Unavailable {
                substrate: "sim".into(),
                message: "the fleet is down".into(),
            });
        }
        Ok(())
    }
    async fn status(&self, _: &str) -> Result<LeaseStatus, DriverError> {
        Ok(LeaseStatus::Running)
    }
}

pub(crate) fn token(name: &str, role: Role, teams: &[&str]) -> TokenConfig {
    TokenConfig {
        name: name.into(),
        sha256: Sha256::digest(format!("tok-{name}"))
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
        role,
        teams: teams.iter().map(|t| t.to_string()).collect(),
    }
}

/// Calls the API as `who` (token `tok-<who>`); the answer's status and JSON body.
pub(crate) async fn call(
    app: &Router,
    method: Method,
    uri: &str,
    who: Option<&str>,
    body: Option<String>,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(who) = who {
        req = req.header("authorization", format!("Bearer tok-{who}"));
    }
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Body::from(b)
        }
        None => Body::empty(),
    };
    let response = app.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, value)
}
