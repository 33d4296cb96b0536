//! What each signed-in route does: checks the role and the form's CSRF token, asks the
//! service, and answers with a page (or, after a change, a redirect to one).
//!
//! Only translation lives here: the decisions are the service's, the words and markup are
//! [`super::pages`]' and [`super::html`]'s.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Form;
use gpuwarden_schema::config::Role;

use super::forms::{CsrfForm, ExtendForm, Outcome, RequestForm};
use super::html::{self, failure, page, query_value, see_other, Tab};
use super::pages;
use super::session::{csrf_refused, refused, Signed};
use super::state::Portal;
use crate::door::{self, Answer, Grant};
use crate::service::{Admission, ServiceError};
use crate::store::Lease;

pub(super) async fn home(signed: Result<Signed, Response>) -> Response {
    match signed {
        Ok(s) if s.principal.role == Role::Viewer => see_other("/ui/leases"),
        Ok(_) => see_other("/ui/request"),
        Err(_) => see_other("/ui/signin"),
    }
}

pub(super) async fn request_page(
    State(portal): State<Portal>,
    signed: Signed,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    if signed.principal.role == Role::Viewer {
        return viewer_refused(&signed);
    }
    let form = RequestForm {
        team: query
            .get("team")
            .cloned()
            .or_else(|| portal.teams_of(&signed.principal).into_iter().next())
            .unwrap_or_default(),
        project: String::new(),
        workload: pages::offered_workloads(portal.service().config())
            .first()
            .map(|w| w.as_str().to_owned())
            .unwrap_or_default(),
        gpus: "1".into(),
        duration: "2h".into(),
        ..RequestForm::default()
    };
    request_form(&portal, &signed, &form, None, StatusCode::OK, "").await
}

fn viewer_refused(signed: &Signed) -> Response {
    refused(
        signed,
        StatusCode::FORBIDDEN,
        "Request GPUs",
        &format!(
            "{} is a viewer and may only read: there is no request form for viewers.",
            signed.principal.name
        ),
    )
}

/// Asks the service for `form`'s admission (a dry run when `dry_run`) through the door adapter,
/// as the API does: the outcome (admitted or denied), or the status and sentence of what was
/// wrong with the request or failed.
async fn ask(
    portal: &Portal,
    signed: &Signed,
    form: &RequestForm,
    dry_run: bool,
) -> Result<Outcome, (StatusCode, String)> {
    let request = form
        .admission(&signed.principal, dry_run)
        .map_err(|why| (StatusCode::UNPROCESSABLE_ENTITY, why))?;
    let admission = door::admit(
        portal.service(),
        &signed.principal,
        Grant::Provision { key: None },
        request.clone(),
    )
    .await
    .and_then(Answer::into_result)
    .map_err(failure)?;
    let team = portal
        .service()
        .team(&signed.principal, &request.team)
        .await
        .ok();
    Ok(Outcome {
        request,
        admission,
        team,
    })
}

pub(super) async fn request_submit(
    State(portal): State<Portal>,
    signed: Signed,
    Form(form): Form<RequestForm>,
) -> Response {
    if !signed.csrf_ok(&form.csrf) {
        return csrf_refused(&signed);
    }
    if signed.principal.role == Role::Viewer {
        return viewer_refused(&signed);
    }
    let dry_run = form.check.is_some();
    // A real request's one-use token is remembered with the lease it made.
    let remembered = !dry_run && !form.submission.is_empty();
    let token = format!("{}:{}", signed.csrf, form.submission);
    let seen = if remembered {
        match portal.first_time(&token).await {
            Ok(seen) => seen,
            Err(response) => return response,
        }
    } else {
        Ok(())
    };
    if let Err(lease) = seen {
        let message = match lease {
            Some(id) => format!(
                "This form was already sent, and it made lease {id}: nothing more was asked. It \
                 is under My leases."
            ),
            None => "This form was already sent: nothing more was asked. Fill it in again to ask \
                     once more."
                .to_owned(),
        };
        let mut form = form;
        form.submission.clear();
        let notice = html::notice(&message);
        return request_form(&portal, &signed, &form, None, StatusCode::OK, &notice).await;
    }
    let outcome = ask(&portal, &signed, &form, dry_run).await;
    if let Ok(Outcome {
        admission: Admission {
            lease: Some(lease), ..
        },
        ..
    }) = &outcome
    {
        if remembered {
            portal.made(&token, &lease.id).await;
        }
    }
    let status = match &outcome {
        Ok(_) => StatusCode::OK,
        Err((status, _)) => *status,
    };
    request_form(&portal, &signed, &form, Some(&outcome), status, "").await
}

/// The request page: `notice` (HTML) above the form filled in with `form`, and `outcome`'s
/// decision when there is one.
async fn request_form(
    portal: &Portal,
    signed: &Signed,
    form: &RequestForm,
    outcome: Option<&Result<Outcome, (StatusCode, String)>>,
    status: StatusCode,
    notice: &str,
) -> Response {
    let models = portal.service().gpu_models().await;
    let body = pages::request(
        portal,
        signed,
        form,
        &models,
        &portal.teams_of(&signed.principal),
        outcome,
    );
    page(
        status,
        "Request GPUs",
        Some(&signed.who()),
        Tab::Request,
        &format!("{notice}{body}"),
    )
}

/// The live estimate: a dry run of the form's fields, answered as JSON for the script, which
/// shows every string as text.
pub(super) async fn estimate(
    State(portal): State<Portal>,
    signed: Signed,
    Form(form): Form<RequestForm>,
) -> Response {
    if !signed.csrf_ok(&form.csrf) || signed.principal.role == Role::Viewer {
        return (
            StatusCode::FORBIDDEN,
            axum::Json(serde_json::json!({
                "decision": "invalid",
                "summary": "This form cannot ask for an estimate; reload the page.",
                "reasons": [],
            })),
        )
            .into_response();
    }
    // The project decides nothing: a form not yet filled in is estimated all the same.
    let mut form = form;
    if form.project.trim().is_empty() {
        form.project = "unnamed".into();
    }
    let answer = match ask(&portal, &signed, &form, true).await {
        Ok(outcome) => pages::estimate_json(&portal, &signed, &outcome),
        Err((_, why)) => serde_json::json!({
            "decision": "invalid",
            "summary": why,
            "reasons": [],
        }),
    };
    let mut response = axum::Json(answer).into_response();
    html::secure_headers(response.headers_mut());
    response
}

pub(super) async fn leases_page(
    State(portal): State<Portal>,
    signed: Signed,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let mut message = String::new();
    // The notice names only what reads as a lease id: a link cannot put other words in it.
    let query: HashMap<String, String> = query
        .into_iter()
        .filter(|(_, id)| gpuwarden_schema::lease::is_lease_id(id))
        .collect();
    if let Some(id) = query.get("released") {
        message = html::notice(&format!("Lease {id} released; its GPUs are free."));
    } else if let Some(id) = query.get("extended") {
        message = html::notice(&format!("Lease {id} extended."));
    }
    leases_with(&portal, &signed, StatusCode::OK, &message).await
}

async fn leases_with(
    portal: &Portal,
    signed: &Signed,
    status: StatusCode,
    message: &str,
) -> Response {
    let body = match pages::leases(portal, signed).await {
        Ok(body) => format!("{message}{body}"),
        Err(e) => {
            let (status, why) = failure(e);
            return refused(signed, status, "My leases", &why);
        }
    };
    page(status, "My leases", Some(&signed.who()), Tab::Leases, &body)
}

pub(super) async fn release(
    State(portal): State<Portal>,
    signed: Signed,
    Path(id): Path<String>,
    Form(form): Form<CsrfForm>,
) -> Response {
    if !signed.csrf_ok(&form.csrf) {
        return csrf_refused(&signed);
    }
    let done = portal.service().release_by(&signed.principal, &id).await;
    after_lease_step(&portal, &signed, &id, done, "released").await
}

/// After a release or an extension (`done`, in words: "released", "extended"): back to the
/// leases page, which says it was done; or that page at once, saying why not.
async fn after_lease_step(
    portal: &Portal,
    signed: &Signed,
    id: &str,
    outcome: Result<Lease, ServiceError>,
    done: &str,
) -> Response {
    match outcome {
        Ok(lease) => see_other(&format!("/ui/leases?{done}={}", query_value(&lease.id))),
        Err(e) => {
            let (status, why) = failure(e);
            leases_with(
                portal,
                signed,
                status,
                &html::alert(&format!("Lease {id} was not {done}: {why}")),
            )
            .await
        }
    }
}

pub(super) async fn extend(
    State(portal): State<Portal>,
    signed: Signed,
    Path(id): Path<String>,
    Form(form): Form<ExtendForm>,
) -> Response {
    if !signed.csrf_ok(&form.csrf) {
        return csrf_refused(&signed);
    }
    let by = match crate::fields::parse_duration(&form.duration) {
        Ok(by) => by,
        Err(why) => {
            return leases_with(
                &portal,
                &signed,
                StatusCode::UNPROCESSABLE_ENTITY,
                &html::alert(&format!("duration: {why}")),
            )
            .await
        }
    };
    let done = portal.service().extend(&signed.principal, &id, by).await;
    after_lease_step(&portal, &signed, &id, done, "extended").await
}

pub(super) async fn team_page(
    State(portal): State<Portal>,
    signed: Signed,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let teams = portal.teams_of(&signed.principal);
    let Some(team) = query
        .get("team")
        .cloned()
        .or_else(|| teams.first().cloned())
    else {
        return refused(
            &signed,
            StatusCode::NOT_FOUND,
            "My team",
            "You belong to no team; an admin can add you to one.",
        );
    };
    match pages::team(&portal, &signed, &team, &teams).await {
        Ok(body) => page(
            StatusCode::OK,
            &format!("Team {team}"),
            Some(&signed.who()),
            Tab::Team,
            &body,
        ),
        Err(e) => {
            let (status, why) = failure(e);
            refused(&signed, status, "My team", &why)
        }
    }
}

fn admin_only(signed: &Signed, title: &str) -> Option<Response> {
    (signed.principal.role != Role::Admin).then(|| {
        refused(
            signed,
            StatusCode::FORBIDDEN,
            title,
            &format!(
                "Only admins may see this page; {} is a {}.",
                signed.principal.name,
                html::role_name(signed.principal.role)
            ),
        )
    })
}

pub(super) async fn admin_page(State(portal): State<Portal>, signed: Signed) -> Response {
    if let Some(refusal) = admin_only(&signed, "Admin") {
        return refusal;
    }
    match pages::admin(&portal, &signed).await {
        Ok(body) => page(
            StatusCode::OK,
            "Admin",
            Some(&signed.who()),
            Tab::Admin,
            &body,
        ),
        Err(e) => {
            let (status, why) = failure(e);
            refused(&signed, status, "Admin", &why)
        }
    }
}

pub(super) async fn scorecard_page(State(portal): State<Portal>, signed: Signed) -> Response {
    if let Some(refusal) = admin_only(&signed, "Maturity scorecard") {
        return refusal;
    }
    let body = pages::scorecard(&portal).await;
    page(
        StatusCode::OK,
        "Maturity scorecard",
        Some(&signed.who()),
        Tab::Scorecard,
        &body,
    )
}
