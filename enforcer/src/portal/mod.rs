//! The self-service portal's routes: server-rendered pages under `/ui/` on the API's listener,
//! where a person signs in with their API token, asks for GPUs (with the cost estimate as the
//! fields change), sees why a request was refused and what would make it pass, watches and ends
//! their leases, and sees their team's quota and spend; admins see every team, the audit trail
//! and the maturity scorecard.
//!
//! Like [`crate::api`], this layer only translates: between forms and pages and the
//! [`crate::service::Service`], which it calls for everything it reads or changes (never the
//! store). Sign-in checks the token exactly as the API does; the browser then holds a session
//! cookie, never the token; every form that changes something carries the session's CSRF token.
//! Pages escape every value they show (`html::e`); the one script ([`ASSET_JS`]) only refreshes
//! the estimate, through `POST /ui/estimate`, a dry-run admission: decided by the same policy
//! with the same reasons, creating no lease and holding no quota. Pages work without it.
//!
//! Submodules are declared lowest layer first: each uses only those above it (a blank line
//! between them keeps rustfmt from sorting them).

// Escaping, the page layout, redirects and failures, formats.
mod html;

// The stylesheet, the estimate's script and the icon.
mod assets;

// What the pages read from the lake, through the binary.
pub mod insights;

// A decision's reasons in words, with what would make them pass.
mod reasons;

// The forms as sent, checked and turned into the service's requests.
mod forms;

// The sessions and forms sent, kept in memory or through the service.
mod state;

// Sign-in and sign-out, the session cookie and the CSRF check.
mod session;

// Each page's body.
mod pages;

// Each signed-in route, from form to service to page.
mod handlers;

use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;

pub use self::assets::{ASSET_CSS, ASSET_JS};
pub use self::insights::Insights;
use self::state::Portal;
pub use self::state::{SESSIONS_PER_TOKEN, SESSION_LIFETIME};
use self::{assets as a, handlers as h, session as s};
use crate::api;
use crate::web::AppState;

/// The API's router with the portal's routes: what `gpuwarden enforce` serves.
pub fn app(state: AppState, insights: Option<Arc<dyn Insights>>) -> Router {
    api::router(state.clone()).merge(router(state, insights))
}

/// The portal's routes alone, under `/ui/`.
pub fn router(state: AppState, insights: Option<Arc<dyn Insights>>) -> Router {
    Router::new()
        .route("/ui", get(h::home))
        .route("/ui/", get(h::home))
        .route("/ui/signin", get(s::signin_page).post(s::signin))
        .route("/ui/signout", post(s::signout))
        .route("/ui/request", get(h::request_page).post(h::request_submit))
        .route("/ui/estimate", post(h::estimate))
        .route("/ui/leases", get(h::leases_page))
        .route("/ui/leases/{id}/release", post(h::release))
        .route("/ui/leases/{id}/extend", post(h::extend))
        .route("/ui/team", get(h::team_page))
        .route("/ui/admin", get(h::admin_page))
        .route("/ui/scorecard", get(h::scorecard_page))
        .route("/ui/static/portal.css", get(a::css))
        .route("/ui/static/portal.js", get(a::js))
        .route("/ui/static/favicon.svg", get(a::icon))
        .with_state(Portal::new(state, insights))
}
