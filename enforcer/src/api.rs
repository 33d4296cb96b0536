//! The enforcer's HTTP API (axum): admission, leases, teams, health and the OpenAPI document.
//!
//! Handlers only translate: they authenticate the bearer token to a [`Principal`], decode the
//! body with [`ApiJson`] (whose rejections share [`ApiError`]'s one JSON shape), call the pure
//! policy through the lease store's transactions, and carry admitted changes out through the
//! substrate drivers. A denial is a decision, answered with 200; 4xx is for malformed requests
//! (naming the field), authentication (401) and authorization (403). The same operations are
//! methods of [`AppState`] so the CLI and the runtime rules can call them in process.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request as HttpRequest, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use gpuwarden_schema::config::{Config, Role};
use gpuwarden_schema::{ActionKind, Clock, Outcome, ReleaseReason};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{OpenApi, ToSchema};

use crate::drivers::{Driver, Inventory, LeaseSpec, LeaseStatus};
use crate::fields;
use crate::metrics::Metrics;
use crate::policy::{
    self, AdmissionRequest, Decision, Estimate, FleetIndex, Principal, Reason, Snapshot,
    SubstrateState,
};
use crate::store::{Lease, LeaseFilter, LeaseState, Ledger, Store, StoreError};

/// An API error: whose fault, a status, and one JSON shape `{error: {code, message, field?}}`.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON (400); the message names the line and column.
    #[error("{0}")]
    MalformedJson(String),
    /// A field is missing, of the wrong type or out of range (422).
    #[error("{field}: {message}")]
    InvalidField {
        /// The field at fault, as a path (`gpus`, `labels.team`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// No valid bearer token was given (401).
    #[error("a valid bearer token is required")]
    Unauthorized,
    /// The principal may not do this (403).
    #[error("{0}")]
    Forbidden(String),
    /// The team or lease named does not exist (404).
    #[error("{0}")]
    NotFound(String),
    /// The body is larger than `enforcer.max_request_bytes` (413).
    #[error("the request body is larger than the {limit} bytes allowed")]
    PayloadTooLarge {
        /// The limit, bytes.
        limit: usize,
    },
    /// The lease's state does not allow the change (409).
    #[error("{0}")]
    Conflict(String),
    /// A substrate driver failed; retrying may help (503).
    #[error("{0}")]
    Substrate(String),
    /// A bug or a store failure (500); the detail is logged, not sent.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MalformedJson(_) => StatusCode::BAD_REQUEST,
            Self::InvalidField { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::Substrate(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable error code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::MalformedJson(_) => "malformed_json",
            Self::InvalidField { .. } => "invalid_field",
            Self::Unauthorized => "unauthorized",
            Self::Forbidden(_) => "forbidden",
            Self::NotFound(_) => "not_found",
            Self::PayloadTooLarge { .. } => "payload_too_large",
            Self::Conflict(_) => "conflict",
            Self::Substrate(_) => "substrate_unavailable",
            Self::Internal(_) => "internal",
        }
    }

    fn field(name: &str, message: impl Into<String>) -> Self {
        Self::InvalidField {
            field: name.into(),
            message: message.into(),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(_) => Self::NotFound(e.to_string()),
            StoreError::InvalidTransition { .. } => Self::Conflict(e.to_string()),
            other => Self::Internal(other.to_string()),
        }
    }
}

/// The body of every error response.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable code: `malformed_json`, `invalid_field`, `unauthorized`, `forbidden`,
    /// `not_found`, `payload_too_large`, `conflict`, `substrate_unavailable`, `internal`.
    pub code: String,
    /// For a person.
    pub message: String,
    /// The field at fault, for `invalid_field`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let message = match &self {
            Self::Internal(detail) => {
                tracing::error!(error = %detail, "enforcer API request failed");
                "the enforcer failed; the error is in its log".to_string()
            }
            Self::InvalidField { message, .. } => message.clone(),
            other => other.to_string(),
        };
        let field = match &self {
            Self::InvalidField { field, .. } => Some(field.clone()),
            _ => None,
        };
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code().into(),
                message,
                field,
            },
        };
        let mut response = (self.status(), Json(body)).into_response();
        if matches!(self, Self::Unauthorized) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// A JSON body extractor whose rejections are [`ApiError`]s: over `enforcer.max_request_bytes`
/// → 413, not JSON → 400 naming line and column, wrong shape → 422 naming the field.
#[derive(Debug, Clone)]
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: HttpRequest, state: &AppState) -> Result<Self, ApiError> {
        let limit = state.inner.config.enforcer.max_request_bytes;
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > limit) {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        let bytes = axum::body::to_bytes(req.into_body(), limit)
            .await
            .map_err(|e| {
                let inner = e.into_inner();
                if inner
                    .downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some()
                {
                    ApiError::PayloadTooLarge { limit }
                } else {
                    ApiError::MalformedJson(format!("the request body could not be read: {inner}"))
                }
            })?;
        decode(&bytes).map(ApiJson)
    }
}

/// Decodes a JSON body into `T` with errors that name the line and column, or the field.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    use serde_json::error::Category;
    let syntax = |inner: &serde_json::Error| {
        ApiError::MalformedJson(format!(
            "the body is not valid JSON: {} at line {} column {}",
            strip_position(&inner.to_string()),
            inner.line(),
            inner.column()
        ))
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        match inner.classify() {
            Category::Syntax | Category::Eof | Category::Io => syntax(&inner),
            Category::Data => {
                let message = strip_position(&inner.to_string());
                // serde reports a missing field against the object that lacks it.
                let named = message
                    .split('`')
                    .nth(1)
                    .filter(|_| message.starts_with("missing field"));
                let field = match (path.as_str(), named) {
                    (".", Some(n)) => n.to_string(),
                    (p, Some(n)) => format!("{p}.{n}"),
                    (p, None) => p.to_string(),
                };
                ApiError::field(&field, message)
            }
        }
    })?;
    de.end().map_err(|e| syntax(&e))?;
    Ok(value)
}

fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_string(),
        None => message.to_string(),
    }
}

/// What `POST /v1/admission` (and `resize`) answers.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AdmissionResponse {
    /// `admitted` or `denied`.
    pub decision: DecisionKind,
    /// Every check that failed; empty when admitted.
    pub reasons: Vec<Reason>,
    /// The lease, when one was created or changed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease: Option<Lease>,
    /// What the lease would cost.
    pub estimate: Estimate,
}

/// The outcome of an admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DecisionKind {
    /// Every check passed.
    Admitted,
    /// At least one check failed.
    Denied,
}

impl AdmissionResponse {
    fn new(decision: Decision, lease: Option<Lease>) -> Self {
        Self {
            decision: if decision.admitted() {
                DecisionKind::Admitted
            } else {
                DecisionKind::Denied
            },
            reasons: decision.reasons,
            lease,
            estimate: decision.estimate,
        }
    }
}

/// The body of `POST /v1/leases/{id}/extend`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendRequest {
    /// How much longer, as `"30m"` or `"2h"`.
    #[schema(example = "1h")]
    pub duration: String,
}

/// The body of `POST /v1/leases/{id}/exempt`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExemptRequest {
    /// For how long from now, as `"8h"` or `"3d"`.
    #[schema(example = "8h")]
    pub duration: String,
    /// Why; kept in the audit trail.
    #[schema(example = "benchmark run over the weekend")]
    pub reason: String,
}

/// The body of `POST /v1/leases/{id}/resize`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    /// The GPU count wanted, at least 1; a whole number (`2.0` reads as 2).
    #[serde(deserialize_with = "crate::fields::gpu_count")]
    pub gpus: u32,
}

/// Query of `GET /v1/leases`.
#[derive(Debug, Clone, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct LeaseQuery {
    /// Only this team's leases.
    pub team: Option<String>,
    /// Only leases in this state.
    #[param(value_type = Option<LeaseState>)]
    pub state: Option<LeaseState>,
}

/// What `GET /v1/teams/{team}` answers.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TeamView {
    /// The team.
    pub team: String,
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

/// What [`AppState::readopt`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Readoption {
    /// Leases still running on their substrate, kept.
    pub running: usize,
    /// Leases whose substrate no longer runs them, marked failed.
    pub failed: usize,
    /// Leases whose substrate could not answer, left as they were.
    pub unknown: usize,
}

/// Everything the handlers share. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: Arc<Config>,
    store: Store,
    drivers: BTreeMap<String, Arc<dyn Driver>>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    tokens: Vec<([u8; 32], Principal)>,
    /// Each substrate's placement index, kept while its driver reports the same inventory.
    fleets: Mutex<BTreeMap<String, Arc<FleetIndex>>>,
}

fn sha256(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

/// What a `[[tokens]]` entry's `sha256` holds for the bearer token `token`: its SHA-256 in hex,
/// as `printf %s TOKEN | sha256sum` prints it.
pub fn token_sha256_hex(token: &str) -> String {
    sha256(token).iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex32(text: &str) -> Option<[u8; 32]> {
    let text = text.trim();
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl AppState {
    /// State for the router: the config (teams, workloads, pricing, tokens, limits), the open
    /// store, one driver per `[[substrates]]` name (placement tries substrates in config order),
    /// and the clock that stamps every change. Tokens whose `sha256` is not 64 hex digits never
    /// match (the config validation reports them).
    pub fn new(
        config: Arc<Config>,
        store: Store,
        drivers: BTreeMap<String, Arc<dyn Driver>>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let tokens = config
            .tokens
            .iter()
            .filter_map(|t| {
                Some((
                    parse_hex32(&t.sha256)?,
                    Principal {
                        name: t.name.clone(),
                        role: t.role,
                        teams: t.teams.clone(),
                    },
                ))
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                config,
                store,
                drivers,
                clock,
                metrics: Arc::new(Metrics::default()),
                tokens,
                fleets: Mutex::default(),
            }),
        }
    }

    /// The lease store.
    pub fn store(&self) -> &Store {
        &self.inner.store
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
        self.inner.config.enforcer.mode == gpuwarden_schema::config::EnforcerMode::DryRun
    }

    /// The API's counters (render them on `/metrics`).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// The principal a bearer token belongs to. Every configured hash is compared, in constant
    /// time, so the answer's timing says nothing of which token came close.
    pub fn authenticate(&self, token: &str) -> Option<Principal> {
        let digest = sha256(token);
        let mut found = None;
        for (hash, principal) in &self.inner.tokens {
            if bool::from(hash.ct_eq(&digest)) && found.is_none() {
                found = Some(principal.clone());
            }
        }
        found
    }

    /// Now, by the enforcer's clock.
    pub fn now(&self) -> i64 {
        self.inner.clock.now_ms()
    }

    /// Each substrate's inventory, in config order; a driver that cannot answer is left out
    /// (its capacity counts as none) and logged.
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
            let Some(driver) = self.inner.drivers.get(name) else {
                continue;
            };
            match driver.inventory().await {
                Ok(inventory) => out.push(SubstrateState {
                    name: name.clone(),
                    index: Some(self.fleet(name, &inventory)),
                    inventory,
                    ..SubstrateState::default()
                }),
                Err(e) => {
                    self.inner.metrics.count_driver_error();
                    tracing::warn!(substrate = %name, error = %e, "inventory failed; placing elsewhere");
                }
            }
        }
        out
    }

    /// `name`'s placement index for `inventory`: the kept one while the driver reports the same
    /// inventory, else a new one (built outside the lock, so a slow build stalls no one else).
    fn fleet(&self, name: &str, inventory: &Arc<Inventory>) -> Arc<FleetIndex> {
        let fleets = &self.inner.fleets;
        if let Some(index) = fleets.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
            if index.is_of(inventory) {
                return index.clone();
            }
        }
        let index = Arc::new(FleetIndex::new(inventory.clone()));
        fleets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), index.clone());
        index
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
    pub async fn admit(
        &self,
        principal: &Principal,
        request: AdmissionRequest,
    ) -> Result<AdmissionResponse, ApiError> {
        let config = self.inner.config.clone();
        for (field, value) in [
            ("team", &request.team),
            ("user", &request.user),
            ("project", &request.project),
        ] {
            fields::check_name(value).map_err(|why| ApiError::field(field, why))?;
        }
        if request.gpus == 0 {
            return Err(ApiError::field("gpus", "must be at least 1"));
        }
        if let Some(argv) = &request.command {
            fields::check_command(argv).map_err(|why| ApiError::field("command", why))?;
        }
        if config.team(&request.team).is_none() {
            return Err(ApiError::NotFound(format!(
                "there is no team named {}",
                request.team
            )));
        }
        // Like an unknown team, an unknown substrate is a name the document cannot list (it
        // depends on the config), so it is a 404 rather than a malformed request.
        if let Some(s) = &request.substrate {
            if !self.inner.drivers.contains_key(s) {
                return Err(ApiError::NotFound(format!(
                    "there is no substrate named {s}"
                )));
            }
        }
        if let Some(why) = principal.write_refusal(&request.team, &request.user) {
            return Err(ApiError::Forbidden(why));
        }
        let subs = self.inventories().await;
        let now = self.now();
        let command = request.command.clone();
        let policy_request = policy::Request {
            principal: principal.clone(),
            admission: request.clone(),
        };
        let (decision, lease) = self
            .inner
            .store
            .admit(now, &config.pricing, &request, |ledger| {
                policy::evaluate(&policy_request, &Self::snapshot(&config, ledger, subs))
            })
            .await?;
        self.inner
            .metrics
            .count_decision(decision.admitted(), decision.reasons.iter().map(|r| r.code));
        let lease = match lease {
            Some(lease) => Some(self.provision(lease, command).await?),
            None => None,
        };
        Ok(AdmissionResponse::new(decision, lease))
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
        }
    }

    fn driver(&self, lease: &Lease) -> Result<Arc<dyn Driver>, ApiError> {
        self.inner
            .drivers
            .get(&lease.substrate)
            .cloned()
            .ok_or_else(|| {
                ApiError::Substrate(format!("no driver runs substrate {}", lease.substrate))
            })
    }

    async fn provision(
        &self,
        lease: Lease,
        command: Option<Vec<String>>,
    ) -> Result<Lease, ApiError> {
        let driver = self.driver(&lease)?;
        let id = lease.id.clone();
        let spec = LeaseSpec {
            command,
            ..Self::spec(&lease)
        };
        match driver.provision(&spec).await {
            Ok(()) => {
                let now = self.now();
                // `granted` is on disk; if `active` is lost in a crash, re-adoption redoes it.
                let store = &self.inner.store;
                Ok(store
                    .transition(&id, LeaseState::Active, now, ReleaseReason::User, "")
                    .applied()
                    .await?)
            }
            Err(e) => {
                self.inner.metrics.count_driver_error();
                tracing::warn!(lease_id = %id, error = %e, "provisioning failed");
                let now = self.now();
                let detail = e.to_string();
                self.inner
                    .store
                    .transition(&id, LeaseState::Failed, now, ReleaseReason::Failed, &detail)
                    .await?;
                Err(ApiError::Substrate(format!(
                    "the lease was admitted but could not be started: {e}"
                )))
            }
        }
    }

    /// Ends a lease: `releasing`, the driver's reclaim, then `released` with a LeaseEvent in the
    /// outbox. A driver failure leaves it `releasing` (call again to retry). Used by the API's
    /// release and by runtime rules (reason `expired`, `idle`, `budget`).
    pub async fn release(&self, id: &str, reason: ReleaseReason) -> Result<Lease, ApiError> {
        self.release_for(id, reason, "").await
    }

    /// [`AppState::release`], saying why in the `reclaim` Action's detail.
    pub async fn release_for(
        &self,
        id: &str,
        reason: ReleaseReason,
        why: &str,
    ) -> Result<Lease, ApiError> {
        let now = self.now();
        // Not waited for: `released` commits after it, in order, and is waited for. If the
        // process dies between the reclaim and that commit, the lease is still open on disk and
        // re-adoption finds it gone from its substrate and marks it failed.
        let lease = self
            .inner
            .store
            .transition(id, LeaseState::Releasing, now, reason, "")
            .applied()
            .await?;
        let driver = self.driver(&lease)?;
        if let Err(e) = driver.reclaim(id, reason).await {
            self.inner.metrics.count_driver_error();
            return Err(ApiError::Substrate(format!(
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
            .inner
            .store
            .transition(id, LeaseState::Released, now, reason, &detail)
            .await?)
    }

    /// Re-adopts the leases a previous run of the enforcer left open: each `granted` or `active`
    /// lease's driver is asked for its status. `Running` keeps it (a `granted` one becomes
    /// `active`); `Exited` or `Gone` marks it `failed`, which publishes its `released` event
    /// (reason `failed`). A driver that cannot answer leaves the lease as it is, to be asked
    /// again on the next start; `releasing` leases are left to a retried release.
    pub async fn readopt(&self) -> Result<Readoption, ApiError> {
        let mut report = Readoption::default();
        let open = self.inner.store.open_leases()?;
        for lease in open {
            if !matches!(lease.state, LeaseState::Granted | LeaseState::Active) {
                continue;
            }
            let driver = self.driver(&lease)?;
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
                        self.inner
                            .store
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
                    self.inner
                        .store
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
    pub async fn expire_due(&self) -> Result<usize, ApiError> {
        let now = self.now();
        let due = self.inner.store.due_for_expiry(now)?;
        let mut released = 0;
        for lease in due {
            if self
                .inner
                .store
                .exempt_until(&lease.id)
                .is_some_and(|until| until > now)
            {
                continue;
            }
            if self.dry_run() {
                let record = crate::rules::lease_action(
                    ActionKind::Reclaim,
                    &lease,
                    "expired",
                    Outcome::DryRun,
                    "past its end; would be reclaimed".into(),
                    now,
                );
                self.inner
                    .store
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

    async fn lease_for_write(&self, principal: &Principal, id: &str) -> Result<Lease, ApiError> {
        let lease = self
            .inner
            .store
            .lease(id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("there is no lease {id}")))?;
        if let Some(why) = principal.write_refusal(&lease.team, &lease.user) {
            return Err(ApiError::Forbidden(why));
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
    ) -> Result<Lease, ApiError> {
        let lease = self.lease_for_write(principal, id).await?;
        let Some(expires_at) = lease.expires_at else {
            return Err(ApiError::Conflict(format!(
                "lease {id} has no end to extend"
            )));
        };
        let new_end = gpuwarden_schema::end_after(expires_at, by);
        let max = self.inner.config.workload(lease.workload).max_duration;
        if let Some(max) = max {
            let total = Duration::from_millis((new_end - lease.granted_at).max(0) as u64);
            if total > max && principal.role != Role::Admin {
                return Err(ApiError::Forbidden(format!(
                    "{} leases may last at most {}; extending by {} would make this one last {}",
                    lease.workload,
                    humantime::format_duration(max),
                    humantime::format_duration(by),
                    humantime::format_duration(total)
                )));
            }
        }
        let now = self.now();
        Ok(self.inner.store.extend(id, new_end, now).await?)
    }

    /// Exempts a lease from the runtime rules (idle and duration) for `duration` from now. Admins
    /// only; audited as an `alert` Action with reason `exempt`.
    pub async fn exempt(
        &self,
        principal: &Principal,
        id: &str,
        duration: Duration,
        reason: &str,
    ) -> Result<Lease, ApiError> {
        if principal.role != Role::Admin {
            return Err(ApiError::Forbidden(format!(
                "only an admin may exempt a lease from its policy; {} is a {}",
                principal.name,
                format!("{:?}", principal.role).to_lowercase()
            )));
        }
        if duration.is_zero() {
            return Err(ApiError::field("duration", "must be more than zero"));
        }
        fields::check_text(reason).map_err(|why| {
            ApiError::field("reason", format!("{why}; say why the lease is exempt"))
        })?;
        let now = self.now();
        let until_ms = gpuwarden_schema::end_after(now, duration);
        Ok(self
            .inner
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
    ) -> Result<AdmissionResponse, ApiError> {
        self.resize_for(principal, id, gpus, "requested", "").await
    }

    /// [`AppState::resize`] with the reason its `resize` Action carries (`requested` from the
    /// API; `idle` or `autoscale` from the runtime rules) and why, for its detail.
    pub async fn resize_for(
        &self,
        principal: &Principal,
        id: &str,
        gpus: u32,
        reason: &str,
        why: &str,
    ) -> Result<AdmissionResponse, ApiError> {
        if gpus == 0 {
            return Err(ApiError::field("gpus", "must be at least 1"));
        }
        let before = self.lease_for_write(principal, id).await?;
        let lease = &before;
        let subs: Vec<SubstrateState> = self
            .inventories()
            .await
            .into_iter()
            .filter(|s| s.name == lease.substrate)
            .collect();
        let config = self.inner.config.clone();
        let now = self.now();
        let (decision, lease) = self
            .inner
            .store
            .resize(id, now, &config.pricing, reason, why, |ledger, lease| {
                let snapshot = Self::snapshot(&config, ledger, subs);
                policy::evaluate_resize(&lease.holding(now), gpus, &snapshot)
            })
            .await?;
        if decision.admitted() {
            let driver = self.driver(&lease)?;
            if let Err(e) = driver.resize(&Self::spec(&lease)).await {
                self.inner.metrics.count_driver_error();
                tracing::warn!(lease_id = %id, error = %e, "resize failed on the substrate; putting the lease back");
                let now = self.now();
                self.inner
                    .store
                    .undo_resize(id, &before, now, &e.to_string())
                    .await?;
                return Err(ApiError::Substrate(format!(
                    "lease {id} keeps its {} GPUs: its substrate did not carry out the resize: {e}",
                    before.gpu_count
                )));
            }
        }
        Ok(AdmissionResponse::new(decision, Some(lease)))
    }

    /// A team's quota, holdings, spend, budget and block.
    pub async fn team(&self, principal: &Principal, team: &str) -> Result<TeamView, ApiError> {
        let config = self.inner.config.clone();
        let t = config
            .team(team)
            .ok_or_else(|| ApiError::NotFound(format!("there is no team named {team}")))?
            .clone();
        if !principal.may_read(team) {
            return Err(ApiError::Forbidden(format!(
                "{} may not read team {team}",
                principal.name
            )));
        }
        let now = self.now();
        let ledger = self.inner.store.ledger(now, &config.pricing)?;
        Ok(TeamView {
            gpus_held: ledger.held_gpus.get(&t.name).copied().unwrap_or(0),
            month_to_date_usd: ledger.spend_usd.get(&t.name).copied().unwrap_or(0.0),
            blocked: ledger.blocked.contains(&t.name),
            gpu_quota: t.gpu_quota,
            monthly_budget_usd: t.monthly_budget_usd,
            allowed_models: t.allowed_models,
            team: t.name,
        })
    }
}

impl FromRequestParts<AppState> for Principal {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(ApiError::Unauthorized)?;
        state.authenticate(token).ok_or(ApiError::Unauthorized)
    }
}

/// The router: every route of the API on `state`. The binary adds `/metrics`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/admission", post(admission))
        .route("/v1/leases", get(list_leases))
        .route("/v1/leases/{id}", get(get_lease))
        .route("/v1/leases/{id}/release", post(release_lease))
        .route("/v1/leases/{id}/extend", post(extend_lease))
        .route("/v1/leases/{id}/resize", post(resize_lease))
        .route("/v1/leases/{id}/exempt", post(exempt_lease))
        .route("/v1/teams/{team}", get(get_team))
        .route("/healthz", get(healthz))
        .route("/openapi.json", get(openapi_document))
        .fallback(no_route)
        .with_state(state)
}

/// Decides an admission request.
#[utoipa::path(post, path = "/v1/admission", request_body = AdmissionRequest,
    responses(
        (status = 200, description = "The decision: admitted (with the lease) or denied (with every reason)", body = AdmissionResponse),
        (status = 403, description = "The principal may not act for this team or user", body = ErrorBody),
        (status = 404, description = "No such team, or no such substrate", body = ErrorBody),
        (status = 422, description = "A field is missing, of the wrong type, or out of its bounds (the error names it)", body = ErrorBody),
        (status = 503, description = "Admitted, but the substrate could not start it", body = ErrorBody),
    ),
    security(("bearer" = [])))]
async fn admission(
    State(state): State<AppState>,
    principal: Principal,
    ApiJson(request): ApiJson<AdmissionRequest>,
) -> Result<Json<AdmissionResponse>, ApiError> {
    state.admit(&principal, request).await.map(Json)
}

/// Lists leases the principal may read, newest first.
#[utoipa::path(get, path = "/v1/leases", params(LeaseQuery),
    responses(
        (status = 200, description = "The leases", body = [Lease]),
        (status = 403, description = "The principal may not read this team", body = ErrorBody),
        (status = 422, description = "A query parameter is invalid or unknown", body = ErrorBody),
    ),
    security(("bearer" = [])))]
async fn list_leases(
    State(state): State<AppState>,
    principal: Principal,
    query: Result<Query<LeaseQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<Lease>>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::field("query", e.body_text()))?;
    let teams = match query.team {
        Some(team) if principal.may_read(&team) => Some(vec![team]),
        Some(team) => {
            return Err(ApiError::Forbidden(format!(
                "{} may not read team {team}",
                principal.name
            )))
        }
        None if principal.role == Role::Admin => None,
        None => Some(principal.teams.clone()),
    };
    let filter = LeaseFilter {
        teams,
        state: query.state,
    };
    Ok(Json(state.store().leases(&filter).await?))
}

/// One lease.
#[utoipa::path(get, path = "/v1/leases/{id}", params(("id" = String, Path, description = "Lease id")),
    responses(
        (status = 200, description = "The lease", body = Lease),
        (status = 403, description = "The principal may not read this lease's team", body = ErrorBody),
        (status = 404, description = "No such lease", body = ErrorBody),
    ),
    security(("bearer" = [])))]
async fn get_lease(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Json<Lease>, ApiError> {
    let lease = state
        .store()
        .lease(&id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("there is no lease {id}")))?;
    if !principal.may_read(&lease.team) {
        return Err(ApiError::Forbidden(format!(
            "{} may not read team {}",
            principal.name, lease.team
        )));
    }
    Ok(Json(lease))
}

/// Ends a lease and frees its GPUs.
#[utoipa::path(post, path = "/v1/leases/{id}/release", params(("id" = String, Path, description = "Lease id")),
    responses(
        (status = 200, description = "The released lease", body = Lease),
        (status = 403, description = "The principal may not change this lease", body = ErrorBody),
        (status = 404, description = "No such lease", body = ErrorBody),
        (status = 409, description = "The lease has already ended", body = ErrorBody),
        (status = 503, description = "The substrate did not confirm; retry", body = ErrorBody),
    ),
    security(("bearer" = [])))]
async fn release_lease(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Json<Lease>, ApiError> {
    let lease = state.lease_for_write(&principal, &id).await?;
    let reason = if principal.role == Role::Admin && principal.name != lease.user {
        ReleaseReason::Admin
    } else {
        ReleaseReason::User
    };
    state.release(&id, reason).await.map(Json)
}

/// Moves a lease's end later, within the workload's `max_duration` (admins may go past it).
#[utoipa::path(post, path = "/v1/leases/{id}/extend", request_body = ExtendRequest,
    params(("id" = String, Path, description = "Lease id")),
    responses(
        (status = 200, description = "The extended lease", body = Lease),
        (status = 403, description = "Not this principal's lease, or past max_duration", body = ErrorBody),
        (status = 404, description = "No such lease", body = ErrorBody),
        (status = 409, description = "The lease has ended or has no end", body = ErrorBody),
        (status = 422, description = "The duration is invalid", body = ErrorBody),
    ),
    security(("bearer" = [])))]
async fn extend_lease(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ExtendRequest>,
) -> Result<Json<Lease>, ApiError> {
    let by = fields::parse_duration(&body.duration).map_err(|e| ApiError::field("duration", e))?;
    state.extend(&principal, &id, by).await.map(Json)
}

/// Exempts a lease from the idle and duration rules for a while (admins only; audited).
#[utoipa::path(post, path = "/v1/leases/{id}/exempt", request_body = ExemptRequest,
    params(("id" = String, Path, description = "Lease id")),
    responses(
        (status = 200, description = "The exempted lease", body = Lease),
        (status = 403, description = "Only admins may exempt a lease", body = ErrorBody),
        (status = 404, description = "No such lease", body = ErrorBody),
        (status = 409, description = "The lease has ended", body = ErrorBody),
        (status = 422, description = "The duration or reason is invalid", body = ErrorBody),
    ),
    security(("bearer" = [])))]
async fn exempt_lease(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ExemptRequest>,
) -> Result<Json<Lease>, ApiError> {
    let by = fields::parse_duration(&body.duration).map_err(|e| ApiError::field("duration", e))?;
    state
        .exempt(&principal, &id, by, &body.reason)
        .await
        .map(Json)
}

/// Changes a lease's GPU count; answered like an admission.
#[utoipa::path(post, path = "/v1/leases/{id}/resize", request_body = ResizeRequest,
    params(("id" = String, Path, description = "Lease id")),
    responses(
        (status = 200, description = "The decision, with the lease as it now is", body = AdmissionResponse),
        (status = 403, description = "The principal may not change this lease", body = ErrorBody),
        (status = 404, description = "No such lease", body = ErrorBody),
        (status = 409, description = "The lease has ended", body = ErrorBody),
        (status = 422, description = "The GPU count is invalid", body = ErrorBody),
        (status = 503, description = "The substrate did not confirm", body = ErrorBody),
    ),
    security(("bearer" = [])))]
async fn resize_lease(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ResizeRequest>,
) -> Result<Json<AdmissionResponse>, ApiError> {
    state.resize(&principal, &id, body.gpus).await.map(Json)
}

/// A team's quota, GPUs held, spend, budget and block.
#[utoipa::path(get, path = "/v1/teams/{team}", params(("team" = String, Path, description = "Team name")),
    responses(
        (status = 200, description = "The team", body = TeamView),
        (status = 403, description = "The principal may not read this team", body = ErrorBody),
        (status = 404, description = "No such team", body = ErrorBody),
    ),
    security(("bearer" = [])))]
async fn get_team(
    State(state): State<AppState>,
    principal: Principal,
    Path(team): Path<String>,
) -> Result<Json<TeamView>, ApiError> {
    state.team(&principal, &team).await.map(Json)
}

/// Liveness: answers while the process serves.
#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "Serving", body = String)))]
async fn healthz() -> &'static str {
    "ok\n"
}

/// Any path the API does not have: a 404 in the API's one error shape.
async fn no_route(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(format!("there is no {} in this API", uri.path()))
}

async fn openapi_document() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], openapi_json()).into_response()
}

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "An API token from `[[tokens]]` (the config keeps its SHA-256)",
                    ))
                    .build(),
            ),
        );
    }
}

/// The answers every operation of a kind can give, added once rather than listed on each: 401
/// where a token is required, 400 and 413 where a body is read, 500 on every `/v1` operation.
struct CommonResponses;

fn error_response(description: &str) -> utoipa::openapi::Response {
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build(),
        )
        .build()
}

impl utoipa::Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::header::HeaderBuilder;
        use utoipa::openapi::{ObjectBuilder, Type};
        for (path, item) in openapi.paths.paths.iter_mut() {
            for operation in [&mut item.get, &mut item.post].into_iter().flatten() {
                let responses = &mut operation.responses.responses;
                let mut add = |status: &str, response: utoipa::openapi::Response| {
                    responses.entry(status.into()).or_insert(response.into());
                };
                if operation.security.is_some() {
                    let mut unauthorized = error_response(
                        "No bearer token, or one that matches no `[[tokens]]` entry",
                    );
                    unauthorized.headers.insert(
                        "WWW-Authenticate".into(),
                        HeaderBuilder::new()
                            .schema(ObjectBuilder::new().schema_type(Type::String))
                            .description(Some("`Bearer`"))
                            .build(),
                    );
                    add("401", unauthorized);
                }
                if operation.request_body.is_some() {
                    add(
                        "400",
                        error_response("The body is missing or is not JSON (the error names the line and column)"),
                    );
                    add(
                        "413",
                        error_response("The body is larger than `enforcer.max_request_bytes`"),
                    );
                }
                if path.starts_with("/v1/") {
                    add(
                        "500",
                        error_response(
                            "The enforcer failed (its store, or a bug); the detail is in its log",
                        ),
                    );
                }
            }
        }
    }
}

/// The bounds and patterns of [`fields`], written into the request schemas that the handlers
/// check against them.
struct FieldRules;

impl utoipa::Modify for FieldRules {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::{KnownFormat, SchemaFormat};
        use utoipa::openapi::{RefOr, Schema};
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        let mut constrain =
            |schema: &str, property: &str, rule: &dyn Fn(&mut utoipa::openapi::Object)| {
                let Some(RefOr::T(Schema::Object(object))) = components.schemas.get_mut(schema)
                else {
                    panic!("the OpenAPI document has no object schema {schema}");
                };
                let Some(RefOr::T(Schema::Object(field))) = object.properties.get_mut(property)
                else {
                    panic!("{schema} has no property {property} to constrain");
                };
                rule(field);
            };
        let name = |o: &mut utoipa::openapi::Object| {
            o.min_length = Some(1);
            o.max_length = Some(fields::MAX_NAME_CHARS);
            o.pattern = Some(fields::NAME_PATTERN.into());
        };
        let duration = |o: &mut utoipa::openapi::Object| {
            o.pattern = Some(fields::DURATION_PATTERN.into());
        };
        let gpus = |o: &mut utoipa::openapi::Object| {
            o.format = Some(SchemaFormat::KnownFormat(KnownFormat::Int64));
            o.minimum = Some(1usize.into());
            o.maximum = Some((fields::MAX_GPUS as usize).into());
        };
        for property in ["team", "user", "project"] {
            constrain("AdmissionRequest", property, &name);
        }
        constrain("AdmissionRequest", "gpus", &gpus);
        constrain("AdmissionRequest", "duration", &duration);
        constrain("ResizeRequest", "gpus", &gpus);
        constrain("ExtendRequest", "duration", &duration);
        constrain("ExemptRequest", "duration", &duration);
        constrain("ExemptRequest", "reason", &|o| {
            o.max_length = Some(fields::MAX_NAME_CHARS);
            o.pattern = Some(fields::TEXT_PATTERN.into());
        });
        let Some(RefOr::T(Schema::Object(admission))) =
            components.schemas.get_mut("AdmissionRequest")
        else {
            panic!("the OpenAPI document has no AdmissionRequest");
        };
        let Some(RefOr::T(Schema::Array(command))) = admission.properties.get_mut("command") else {
            panic!("AdmissionRequest's command is not an array");
        };
        let argument = || {
            utoipa::openapi::ObjectBuilder::new()
                .schema_type(utoipa::openapi::Type::String)
                .pattern(Some(fields::ARGUMENT_PATTERN))
        };
        command.min_items = Some(1);
        command.items =
            utoipa::openapi::schema::ArrayItems::RefOrSchema(Box::new(argument().into()));
        command.prefix_items = vec![argument().min_length(Some(1)).into()];
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "gpuwarden enforcer",
        description = "Admission and leases for GPU fleets: a denial is a 200 decision with every reason."
    ),
    paths(admission, list_leases, get_lease, release_lease, extend_lease, resize_lease, exempt_lease, get_team, healthz),
    components(schemas(
        AdmissionRequest, AdmissionResponse, DecisionKind, Reason, policy::ReasonCode, Estimate,
        Lease, LeaseState, ExtendRequest, ExemptRequest, ResizeRequest, TeamView, ErrorBody, ErrorDetail,
        policy::WorkloadName, policy::ReleaseReasonName
    )),
    modifiers(&BearerAuth, &CommonResponses, &FieldRules)
)]
struct ApiDoc;

/// The OpenAPI document of [`router`], without its links (see [`openapi_json`]).
pub fn openapi() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The operations on one lease that an answer carrying it links to: (link name, operationId,
/// description).
const LEASE_LINKS: [(&str, &str, &str); 5] = [
    ("GetLease", "get_lease", "The lease"),
    ("ReleaseLease", "release_lease", "End the lease"),
    ("ExtendLease", "extend_lease", "Move the lease's end later"),
    (
        "ResizeLease",
        "resize_lease",
        "Change the lease's GPU count",
    ),
    (
        "ExemptLease",
        "exempt_lease",
        "Exempt the lease from the runtime rules",
    ),
];

/// [`openapi`] as pretty JSON with a trailing newline: what `/openapi.json` serves and
/// `enforcer/openapi.json` holds. It adds the links from every answer that carries a lease to the
/// operations on that lease, so a client (or a stateful test) can follow a lease from its
/// admission to its release. They are written here, as JSON, because utoipa 5.5 serializes a
/// Link's fields in snake case (`operation_id`) where OpenAPI spells them `operationId`.
pub fn openapi_json() -> String {
    let mut document = serde_json::to_value(openapi()).expect("an OpenAPI document is plain JSON");
    for (path, method, id) in [
        ("/v1/admission", "post", "$response.body#/lease/id"),
        ("/v1/leases/{id}/resize", "post", "$response.body#/lease/id"),
        ("/v1/leases/{id}", "get", "$response.body#/id"),
        ("/v1/leases/{id}/extend", "post", "$response.body#/id"),
        ("/v1/leases/{id}/exempt", "post", "$response.body#/id"),
    ] {
        let ok = &mut document["paths"][path][method]["responses"]["200"];
        assert!(ok.is_object(), "{method} {path} documents no 200 answer");
        ok["links"] = LEASE_LINKS
            .iter()
            .map(|(name, operation, description)| {
                let link = serde_json::json!({
                    "operationId": operation,
                    "parameters": {"id": id},
                    "description": description,
                });
                (name.to_string(), link)
            })
            .collect();
    }
    let mut text =
        serde_json::to_string_pretty(&document).expect("an OpenAPI document is plain JSON");
    text.push('\n');
    text
}
