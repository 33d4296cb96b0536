//! The enforcer's HTTP API (axum): admission, leases, teams, health (`/healthz`: serving;
//! `/readyz`: able to decide) and the OpenAPI document.
//!
//! This layer only translates between HTTP and the [`Service`]: it authenticates the bearer
//! token to a [`Principal`] (`extract`), decodes the body with [`ApiJson`] (whose rejections
//! share [`ApiError`]'s one JSON shape), calls the service (`handlers`), and maps its answer to
//! the API's bodies (`types`) and its [`crate::service::ServiceError`] to a status
//! (`error`). A denial is a decision, answered with 200; 4xx is for malformed requests (naming
//! the field), authentication (401), authorization (403), names that do not exist (404),
//! changes the lease's state does not allow (409) and a source address or token locked out
//! after too many failed logins (429, with `Retry-After`); 503 is a substrate that did not
//! confirm, 500 the enforcer's own failure (logged with the request by `error::log_failures`).
//! The binary serves the router with connect info, so that failed logins are counted per source
//! address.
//!
//! - `error`: the error shape and the status of each failure;
//! - `extract`: the caller (bearer tokens) and JSON bodies;
//! - `handlers`: one function per operation;
//! - `types`: the API's own bodies;
//! - [`openapi`]: the OpenAPI document.

mod error;
mod extract;
mod handlers;
mod openapi;
mod types;

use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;

pub use self::error::{ApiError, ErrorBody, ErrorDetail};
pub use self::extract::{decode, source_of, token_sha256_hex, ApiJson, LoginRefusal};
pub use self::openapi::{openapi, openapi_json};
pub use self::types::{
    AdmissionResponse, DecisionKind, ExemptRequest, ExtendRequest, Lease, LeaseQuery, LeaseState,
    ResizeRequest, TeamView,
};
use crate::policy::Principal;
use crate::service::Service;

/// Everything the handlers share: the service, the bearer tokens and the failed logins.
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    service: Service,
    tokens: Arc<extract::Tokens>,
    logins: Arc<extract::Logins>,
}

impl AppState {
    /// State for the router: `service`, the bearer tokens of its config's `[[tokens]]`, and a
    /// failed-login limiter under its `[enforcer.login_limits]`.
    pub fn new(service: Service) -> Self {
        let tokens = Arc::new(extract::Tokens::new(&service.config().tokens));
        let logins = Arc::new(extract::Logins::new(
            &service.config().enforcer.login_limits,
        ));
        // On a store shared by replicas, each counts the others' failed logins too.
        if service.store().is_shared() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(extract::follow_failures(
                        service.store().clone(),
                        Arc::downgrade(&logins),
                        service.config().enforcer.login_limits.window,
                    ));
                }
                Err(_) => tracing::warn!(
                    "no runtime to follow the other replicas' failed logins; each replica counts its own"
                ),
            }
        }
        Self {
            service,
            tokens,
            logins,
        }
    }

    /// The service the API calls.
    pub fn service(&self) -> &Service {
        &self.service
    }

    /// The principal a bearer token belongs to, if any.
    pub fn authenticate(&self, token: &str) -> Option<Principal> {
        self.tokens.authenticate(token)
    }
}

/// The router: every route of the API on `state`. The binary adds `/metrics`, and serves it
/// with `into_make_service_with_connect_info::<SocketAddr>()` so that failed logins are limited
/// per source address too.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/admission", post(handlers::admission))
        .route("/v1/leases", get(handlers::list_leases))
        .route("/v1/leases/{id}", get(handlers::get_lease))
        .route("/v1/leases/{id}/release", post(handlers::release_lease))
        .route("/v1/leases/{id}/extend", post(handlers::extend_lease))
        .route("/v1/leases/{id}/resize", post(handlers::resize_lease))
        .route("/v1/leases/{id}/exempt", post(handlers::exempt_lease))
        .route("/v1/teams/{team}", get(handlers::get_team))
        .route("/v1/slurm/{substrate}/submit", post(handlers::slurm_submit))
        .route("/v1/slurm/{substrate}/modify", post(handlers::slurm_modify))
        .route("/healthz", get(handlers::healthz))
        .route("/readyz", get(handlers::readyz))
        .route("/openapi.json", get(handlers::openapi_document))
        .fallback(handlers::no_route)
        .layer(axum::middleware::from_fn(error::log_failures))
        .with_state(state)
}
