//! The API door: the enforcer's HTTP API (axum) for front-ends, with admission, leases, teams,
//! health (`/healthz`: serving; `/readyz`: able to decide) and the OpenAPI document, and the
//! router that mounts it with the Slurm hook's routes.
//!
//! This layer only translates between HTTP and the [`Service`](crate::service::Service): the
//! caller and the body come from [`crate::web`] (a bearer token's [`Principal`](crate::policy::Principal),
//! [`ApiJson`] whose rejections share [`ApiError`]'s one JSON shape), an admission goes through
//! [`crate::door`] like every door's, and the answer becomes the API's bodies (`types`) or a
//! status. A denial is a decision, answered with 200; 4xx is for malformed requests (naming
//! the field), authentication (401), authorization (403), names that do not exist (404),
//! changes the lease's state does not allow (409) and a source address or token locked out
//! after too many failed logins (429, with `Retry-After`); 503 is a substrate that did not
//! confirm, 500 the enforcer's own failure (logged with the request by `web::log_failures`).
//! The binary serves the router with connect info, so that failed logins are counted per source
//! address.
//!
//! - `handlers`: one function per operation;
//! - `types`: the API's own bodies;
//! - [`openapi`]: the OpenAPI document, the Slurm hook's routes included.

mod types;
mod handlers;
mod openapi;

use axum::routing::{get, post};
use axum::Router;

pub use self::openapi::{openapi, openapi_json};
pub use self::types::{
    AdmissionResponse, DecisionKind, ExemptRequest, ExtendRequest, Lease, LeaseQuery, LeaseState,
    ResizeRequest, TeamView,
};
// What every HTTP door shares, named here too, where the API's callers have always found it.
pub use crate::web::{
    decode, source_of, token_sha256_hex, ApiError, ApiJson, AppState, ErrorBody, ErrorDetail,
    LoginRefusal,
};

/// The router: every route of the API, and the Slurm submit hook's (which the API's document
/// describes and its tokens sign in), on `state`. The binary adds `/metrics`, and serves it with
/// `into_make_service_with_connect_info::<SocketAddr>()` so that failed logins are limited per
/// source address too.
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
        .merge(crate::slurm::router())
        .route("/healthz", get(handlers::healthz))
        .route("/readyz", get(handlers::readyz))
        .route("/openapi.json", get(openapi::openapi_document))
        .fallback(handlers::no_route)
        .layer(axum::middleware::from_fn(crate::web::log_failures))
        .with_state(state)
}
