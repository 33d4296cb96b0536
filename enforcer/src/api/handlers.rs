//! The API's operations: each takes the caller and its request apart, calls the service, and
//! answers in the API's bodies. No decision is made here. Each operation's `#[utoipa::path]`
//! documents it in the OpenAPI document ([`super::openapi`]).

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::types::{
    AdmissionResponse, ExemptRequest, ExtendRequest, Lease, LeaseQuery, ResizeRequest, TeamView,
};
use super::{ApiError, ApiJson, AppState, ErrorBody};
use crate::door;
use crate::fields;
use crate::policy::{AdmissionRequest, Principal};

/// Decides an admission request; with `dry_run`, only says what the decision would be.
///
/// A client that may retry (after a timeout, a dropped connection, or a 503 from a replica
/// whose database went away as it committed) sends an `Idempotency-Key`, the same on every try
/// of one request: a key the team used within the last day is answered with the lease it
/// admitted, on whichever replica, never with a second lease.
#[utoipa::path(post, path = "/v1/admission", request_body = AdmissionRequest,
    params(("Idempotency-Key" = Option<String>, Header,
        description = "Names one request across its retries (1 to 255 visible ASCII characters, a UUID for example; quoted or not): asked again by the same team within a day, it is answered with the lease it admitted")),
    responses(
        (status = 200, description = "The decision: admitted (with the lease; none for a dry run) or denied (with every reason)", body = AdmissionResponse),
        (status = 403, description = "The principal may not act for this team or user", body = ErrorBody),
        (status = 404, description = "No such team, or no such substrate", body = ErrorBody),
        (status = 409, description = "The Idempotency-Key admitted a lease that has ended, or was used for another user, project, workload or GPU count", body = ErrorBody),
        (status = 422, description = "A field or the Idempotency-Key is missing, of the wrong type, or out of its bounds (the error names it)", body = ErrorBody),
        (status = 503, description = "The lease store cannot be reached (nothing was admitted that is not durable; retry, with the same Idempotency-Key), or the substrate could not start an admitted lease", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(super) async fn admission(
    State(state): State<AppState>,
    principal: Principal,
    headers: header::HeaderMap,
    ApiJson(request): ApiJson<AdmissionRequest>,
) -> Result<Json<AdmissionResponse>, ApiError> {
    let key = match headers.get(IDEMPOTENCY_KEY) {
        None => None,
        Some(value) => Some(
            fields::idempotency_key(value.as_bytes())
                .map_err(|why| ApiError::field(IDEMPOTENCY_KEY, why))?,
        ),
    };
    let grant = door::Grant::Provision {
        key: key.as_deref(),
    };
    let answer = door::admit(state.service(), &principal, grant, request).await?;
    Ok(Json(answer.into_result()?.into()))
}

/// The header that names one admission request across its retries.
const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// Lists leases the principal may read, newest first.
#[utoipa::path(get, path = "/v1/leases", params(LeaseQuery),
    responses(
        (status = 200, description = "The leases", body = [Lease]),
        (status = 403, description = "The principal may not read this team", body = ErrorBody),
        (status = 422, description = "A query parameter is invalid or unknown", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(super) async fn list_leases(
    State(state): State<AppState>,
    principal: Principal,
    query: Result<Query<LeaseQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<Lease>>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::field("query", e.body_text()))?;
    let leases = state
        .service()
        .leases(&principal, query.team, query.state.map(Into::into))
        .await?;
    Ok(Json(leases.into_iter().map(Lease::from).collect()))
}

/// One lease.
#[utoipa::path(get, path = "/v1/leases/{id}", params(("id" = String, Path, description = "Lease id")),
    responses(
        (status = 200, description = "The lease", body = Lease),
        (status = 403, description = "The principal may not read this lease's team", body = ErrorBody),
        (status = 404, description = "No such lease", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(super) async fn get_lease(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Json<Lease>, ApiError> {
    Ok(Json(state.service().lease(&principal, &id).await?.into()))
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
pub(super) async fn release_lease(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Json<Lease>, ApiError> {
    Ok(Json(
        state.service().release_by(&principal, &id).await?.into(),
    ))
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
pub(super) async fn extend_lease(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ExtendRequest>,
) -> Result<Json<Lease>, ApiError> {
    let by = fields::parse_duration(&body.duration).map_err(|e| ApiError::field("duration", e))?;
    Ok(Json(
        state.service().extend(&principal, &id, by).await?.into(),
    ))
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
pub(super) async fn exempt_lease(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ExemptRequest>,
) -> Result<Json<Lease>, ApiError> {
    let by = fields::parse_duration(&body.duration).map_err(|e| ApiError::field("duration", e))?;
    let lease = state
        .service()
        .exempt(&principal, &id, by, &body.reason)
        .await?;
    Ok(Json(lease.into()))
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
pub(super) async fn resize_lease(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ResizeRequest>,
) -> Result<Json<AdmissionResponse>, ApiError> {
    let resized = state.service().resize(&principal, &id, body.gpus).await?;
    Ok(Json(resized.into()))
}

/// A team's quota, GPUs held, spend, budget and block.
#[utoipa::path(get, path = "/v1/teams/{team}", params(("team" = String, Path, description = "Team name")),
    responses(
        (status = 200, description = "The team", body = TeamView),
        (status = 403, description = "The principal may not read this team", body = ErrorBody),
        (status = 404, description = "No such team", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(super) async fn get_team(
    State(state): State<AppState>,
    principal: Principal,
    Path(team): Path<String>,
) -> Result<Json<TeamView>, ApiError> {
    Ok(Json(state.service().team(&principal, &team).await?.into()))
}

/// Liveness: answers while the process serves, with this replica's role (`leader` or
/// `follower`) and the leader it knows of, one `name: value` per line after `ok`.
#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "Serving: `ok`, then the replica's role and the leader", body = String)))]
pub(super) async fn healthz(State(state): State<AppState>) -> String {
    let leadership = state.service().leadership();
    let (leader, term) = leadership.leader();
    let role = if leadership.is_leader() {
        "leader"
    } else {
        "follower"
    };
    format!(
        "ok\nreplica: {}\nrole: {role}\nleader: {}\nterm: {term}\n",
        leadership.replica(),
        if leader.is_empty() {
            "unknown"
        } else {
            &leader
        }
    )
}

/// Readiness: whether the enforcer can decide admissions, i.e. every substrate's driver has what
/// it decides from (a Kubernetes cluster: its nodes and pods listed once). Once ready it stays
/// so while a substrate's API is away, deciding on what it last read.
#[utoipa::path(get, path = "/readyz", responses(
    (status = 200, description = "Ready to decide admissions", body = String),
    (status = 503, description = "Not ready yet: what is missing, per substrate", body = String),
))]
pub(super) async fn readyz(State(state): State<AppState>) -> Response {
    // A replica that cannot reach a shared store cannot admit: route no one to it.
    if let Err(e) = state.service().store_answers().await {
        return (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")).into_response();
    }
    match state.service().readiness().await {
        Ok(()) => "ready\n".into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

/// Any path the API does not have: a 404 in the API's one error shape.
pub(super) async fn no_route(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(format!("there is no {} in this API", uri.path()))
}
