//! The Slurm submit hook's HTTP routes, `POST /v1/slurm/{substrate}/submit` and `/modify`:
//! each signs the hook in with its bearer token, reads its JSON, asks [`super::submit`] or
//! [`super::modify`], and answers in the lines the Lua plugin reads. The API's router
//! (`api::router`) mounts them beside its own, and its OpenAPI document describes them.

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;

use crate::policy::Principal;
use crate::web::{ApiError, ApiJson, AppState, ErrorBody};

/// The hook's routes, on the API's state.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/slurm/{substrate}/submit", post(slurm_submit))
        .route("/v1/slurm/{substrate}/modify", post(slurm_modify))
}

/// The Slurm submit hook's question about a job being submitted. The answer is `text/plain`
/// for a Lua plugin: `admit` or `deny`, then `admin_comment=`, `time_limit=` (minutes) and
/// `message=` lines (see `deploy/slurm/job_submit.lua`).
#[utoipa::path(post, path = "/v1/slurm/{substrate}/submit", request_body = crate::slurm::SubmitRequest,
    params(("substrate" = String, Path, description = "The Slurm substrate's name")),
    responses(
        (status = 200, description = "The decision, as lines: `admit` or `deny`, then `key=value`", body = String, content_type = "text/plain"),
        (status = 403, description = "The token is not a service's or an admin's", body = ErrorBody),
        (status = 404, description = "No such substrate, or it is not a Slurm cluster", body = ErrorBody),
        (status = 422, description = "A field is missing or of the wrong type (the error names it)", body = ErrorBody),
        (status = 503, description = "The enforcer has not read the cluster yet (the hook applies its on_unavailable)", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn slurm_submit(
    State(state): State<AppState>,
    principal: Principal,
    Path(substrate): Path<String>,
    ApiJson(request): ApiJson<crate::slurm::SubmitRequest>,
) -> Result<Response, ApiError> {
    let answer = crate::slurm::submit(state.service(), &principal, &substrate, request).await?;
    Ok(hook_answer(&answer))
}

/// The Slurm submit hook's question about a pending job whose GPUs change (`scontrol update`).
/// Answered like [`slurm_submit`].
#[utoipa::path(post, path = "/v1/slurm/{substrate}/modify", request_body = crate::slurm::ModifyRequest,
    params(("substrate" = String, Path, description = "The Slurm substrate's name")),
    responses(
        (status = 200, description = "The decision, as lines: `admit` or `deny`, then `key=value`", body = String, content_type = "text/plain"),
        (status = 403, description = "The token is not a service's or an admin's", body = ErrorBody),
        (status = 404, description = "No such substrate, or it is not a Slurm cluster", body = ErrorBody),
        (status = 422, description = "A field is missing or of the wrong type (the error names it)", body = ErrorBody),
        (status = 503, description = "The enforcer has not read the cluster yet (the hook applies its on_unavailable)", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn slurm_modify(
    State(state): State<AppState>,
    principal: Principal,
    Path(substrate): Path<String>,
    ApiJson(request): ApiJson<crate::slurm::ModifyRequest>,
) -> Result<Response, ApiError> {
    let answer = crate::slurm::modify(state.service(), &principal, &substrate, request).await?;
    Ok(hook_answer(&answer))
}

fn hook_answer(answer: &crate::slurm::Answer) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        answer.to_text(),
    )
        .into_response()
}
