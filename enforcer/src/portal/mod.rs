//! The self-service portal: server-rendered pages under `/ui/` on the API's listener, where a
//! person signs in with their API token, asks for GPUs (with the cost estimate as the fields
//! change), sees why a request was refused and what would make it pass, watches and ends their
//! leases, and sees their team's quota and spend; admins see every team, the audit trail and the
//! maturity scorecard.
//!
//! Like [`crate::api`], this layer only translates: between forms and pages and the
//! [`crate::service::Service`]. Sign-in checks the token exactly as the API does
//! ([`AppState::login`], failed-login limits included); the browser then holds a cookie
//! (`HttpOnly`, `SameSite=Strict`, `Secure` when served over TLS) naming a random session id that
//! maps, in this process's memory, to the principal and an expiry; never the token. Every form
//! that changes something carries the session's CSRF token, compared in constant time, and the
//! sign-in form (which has no session yet) is refused when its `Origin` is another site's. Pages
//! escape every value they show (`html::e`); the one script ([`ASSET_JS`]) only refreshes the
//! estimate, through `POST /ui/estimate`, a dry-run admission: decided by the same policy with
//! the same reasons, creating no lease and holding no quota. Pages work without it.
//!
//! - `html`: escaping, the layout, formats;
//! - `reasons`: a decision's reasons in words, with what would make them pass;
//! - `pages`: each page's body;
//! - [`insights`]: what the pages read from the lake, through the binary.

mod html;
pub mod insights;
mod pages;
mod reasons;

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use gpuwarden_schema::config::Role;
use serde::Deserialize;
use subtle::ConstantTimeEq;

use self::html::{page, Tab, Who};
pub use self::insights::Insights;
use crate::api::{self, source_of, ApiError, AppState, LoginRefusal};
use crate::policy::{AdmissionRequest, Principal};

/// The stylesheet, served at `/ui/static/portal.css`.
pub const ASSET_CSS: &str = include_str!("portal.css");
/// The live estimate's script, served at `/ui/static/portal.js`.
pub const ASSET_JS: &str = include_str!("portal.js");
/// The pages' icon (so that browsers do not ask for a `/favicon.ico` that is not there).
const ASSET_ICON: &str = r##"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" fill="#0d1117"/><path d="M4 4h8v8H4z" fill="none" stroke="#58a6ff" stroke-width="2"/></svg>"##;

/// How long a session lasts from sign-in.
pub const SESSION_LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// Most sessions kept; past it, signing in drops the expired ones, then the oldest.
const SESSIONS_KEPT: usize = 10_000;
/// Sessions one token may hold at once (browsers, devices); signing in once more ends its
/// oldest, so that nobody holding one token can push everyone else's sessions out.
pub const SESSIONS_PER_TOKEN: usize = 16;

/// The API's router with the portal's routes: what `gpuwarden enforce` serves.
pub fn app(state: AppState, insights: Option<Arc<dyn Insights>>) -> Router {
    api::router(state.clone()).merge(router(state, insights))
}

/// The portal's routes alone, under `/ui/`.
pub fn router(state: AppState, insights: Option<Arc<dyn Insights>>) -> Router {
    let secure = state.service().config().enforcer.tls.is_some();
    let shared = state
        .service()
        .store()
        .is_shared()
        .then(|| state.service().store().clone());
    let portal = Portal(Arc::new(Inner {
        app: state,
        sessions: Mutex::default(),
        sent: Mutex::default(),
        shared,
        insights,
        secure,
    }));
    Router::new()
        .route("/ui", get(home))
        .route("/ui/", get(home))
        .route("/ui/signin", get(signin_page).post(signin))
        .route("/ui/signout", post(signout))
        .route("/ui/request", get(request_page).post(request_submit))
        .route("/ui/estimate", post(estimate))
        .route("/ui/leases", get(leases_page))
        .route("/ui/leases/{id}/release", post(release))
        .route("/ui/leases/{id}/extend", post(extend))
        .route("/ui/team", get(team_page))
        .route("/ui/admin", get(admin_page))
        .route("/ui/scorecard", get(scorecard_page))
        .route("/ui/static/portal.css", get(css))
        .route("/ui/static/portal.js", get(js))
        .route("/ui/static/favicon.svg", get(icon))
        .with_state(portal)
}

/// The portal's state: the API's (service, tokens, failed logins), the sessions, and the lake.
#[derive(Debug, Clone)]
struct Portal(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    app: AppState,
    sessions: Mutex<HashMap<String, Session>>,
    /// The request forms already submitted, so that a form sent twice (a reload of the decision
    /// page re-posts it) asks once.
    sent: Mutex<Sent>,
    /// On a store shared by replicas, where the sessions and the forms sent live instead of the
    /// two maps above: every replica reads them, so a person is not signed out, nor a form
    /// asked twice, whichever replica answers.
    shared: Option<crate::store::Store>,
    insights: Option<Arc<dyn Insights>>,
    /// Served over TLS: the cookie is `Secure` (and `__Host-` prefixed).
    secure: bool,
}

/// How many submitted request forms are remembered (the oldest forgotten first): far more than
/// anyone reloads a page after.
const SENT_KEPT: usize = 4096;

/// The one-use tokens of request forms submitted, each with the lease it made (none while the
/// request is being decided, or when it was denied).
#[derive(Debug, Default)]
struct Sent {
    order: std::collections::VecDeque<String>,
    lease: HashMap<String, Option<String>>,
}

impl Sent {
    /// Marks `token` sent; false, with the lease it made, if it was sent before.
    fn first_time(&mut self, token: &str) -> Result<(), Option<String>> {
        if let Some(lease) = self.lease.get(token) {
            return Err(lease.clone());
        }
        if self.order.len() >= SENT_KEPT {
            if let Some(oldest) = self.order.pop_front() {
                self.lease.remove(&oldest);
            }
        }
        self.order.push_back(token.to_owned());
        self.lease.insert(token.to_owned(), None);
        Ok(())
    }

    /// Records the lease the form sent with `token` made.
    fn made(&mut self, token: &str, lease_id: &str) {
        if let Some(made) = self.lease.get_mut(token) {
            *made = Some(lease_id.to_owned());
        }
    }
}

#[derive(Debug, Clone)]
struct Session {
    principal: Principal,
    csrf: String,
    created: Instant,
}

impl Portal {
    fn cookie_name(&self) -> &'static str {
        if self.0.secure {
            "__Host-gpuwarden_session"
        } else {
            "gpuwarden_session"
        }
    }

    fn sent(&self) -> std::sync::MutexGuard<'_, Sent> {
        // A map of sent forms is valid after any panic.
        self.0.sent.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        // A map of sessions is valid after any panic.
        self.0
            .sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A new session for `principal`: its id, for the cookie.
    async fn open(&self, principal: Principal) -> Result<String, Response> {
        let Some(store) = &self.0.shared else {
            return Ok(self.open_here(principal));
        };
        let id = random_token();
        let session = (
            principal.name,
            random_token(),
            gpuwarden_schema::clock::wall_now_ms(),
        );
        store
            .portal_session_open(
                &sha256_hex(&id),
                session,
                SESSION_LIFETIME.as_millis() as i64,
                SESSIONS_PER_TOKEN,
                SESSIONS_KEPT,
            )
            .await
            .map_err(store_failed)?;
        Ok(id)
    }

    /// [`Portal::open`] in this process's memory.
    fn open_here(&self, principal: Principal) -> String {
        let id = random_token();
        let now = Instant::now();
        let mut sessions = self.sessions();
        let mine = |s: &Session| s.principal.name == principal.name;
        while sessions.values().filter(|s| mine(s)).count() >= SESSIONS_PER_TOKEN
            && drop_oldest(&mut sessions, mine)
        {}
        if sessions.len() >= SESSIONS_KEPT {
            sessions.retain(|_, s| now.duration_since(s.created) < SESSION_LIFETIME);
            while sessions.len() >= SESSIONS_KEPT && drop_oldest(&mut sessions, |_| true) {}
        }
        sessions.insert(
            id.clone(),
            Session {
                principal,
                csrf: random_token(),
                created: now,
            },
        );
        id
    }

    /// The session `id`, unless it is unknown or past its lifetime.
    async fn session(&self, id: &str) -> Result<Option<Session>, Response> {
        let Some(store) = &self.0.shared else {
            return Ok(self.session_here(id));
        };
        let since = gpuwarden_schema::clock::wall_now_ms() - SESSION_LIFETIME.as_millis() as i64;
        let Some((name, csrf, created_ms)) = store
            .portal_session(&sha256_hex(id), since)
            .await
            .map_err(store_failed)?
        else {
            return Ok(None);
        };
        // The principal as the config names it now: a token taken out of the config ends its
        // sessions.
        let config = self.service().config();
        let Some(token) = config.tokens.iter().find(|t| t.name == name) else {
            return Ok(None);
        };
        let age = gpuwarden_schema::clock::wall_now_ms().saturating_sub(created_ms);
        Ok(Some(Session {
            principal: Principal {
                name,
                role: token.role,
                teams: token.teams.clone(),
            },
            csrf,
            created: Instant::now()
                .checked_sub(Duration::from_millis(age.max(0) as u64))
                .unwrap_or_else(Instant::now),
        }))
    }

    /// Ends session `id`.
    async fn close(&self, id: &str) -> Result<(), Response> {
        match &self.0.shared {
            Some(store) => store
                .portal_session_close(&sha256_hex(id))
                .await
                .map_err(store_failed),
            None => {
                self.sessions().remove(id);
                Ok(())
            }
        }
    }

    /// Marks the form sent with one-use `token`: `Ok` the first time, else the lease it made.
    async fn first_time(&self, token: &str) -> Result<Result<(), Option<String>>, Response> {
        match &self.0.shared {
            Some(store) => store
                .portal_submission_first(
                    token,
                    gpuwarden_schema::clock::wall_now_ms(),
                    SUBMISSIONS_KEPT.as_millis() as i64,
                )
                .await
                .map_err(store_failed),
            None => Ok(self.sent().first_time(token)),
        }
    }

    /// Records the lease the form sent with `token` made.
    async fn made(&self, token: &str, lease_id: &str) {
        match &self.0.shared {
            Some(store) => {
                if let Err(e) = store.portal_submission_made(token, lease_id).await {
                    tracing::warn!(error = %e, "could not record the lease a request form made; sent again, it is refused without naming the lease");
                }
            }
            None => self.sent().made(token, lease_id),
        }
    }

    /// [`Portal::session`] in this process's memory.
    fn session_here(&self, id: &str) -> Option<Session> {
        let mut sessions = self.sessions();
        let session = sessions.get(id)?;
        if session.created.elapsed() >= SESSION_LIFETIME {
            sessions.remove(id);
            return None;
        }
        Some(session.clone())
    }

    fn set_cookie(&self, id: &str) -> HeaderValue {
        let secure = if self.0.secure { "; Secure" } else { "" };
        HeaderValue::from_str(&format!(
            "{}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
            self.cookie_name(),
            SESSION_LIFETIME.as_secs()
        ))
        .expect("a session id is a header value")
    }

    fn clear_cookie(&self) -> HeaderValue {
        let secure = if self.0.secure { "; Secure" } else { "" };
        HeaderValue::from_str(&format!(
            "{}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0{secure}",
            self.cookie_name()
        ))
        .expect("a header value")
    }

    fn service(&self) -> &crate::service::Service {
        self.0.app.service()
    }
}

/// How long a shared store remembers a request form sent (the memory of one enforcer keeps the
/// last 4,096 instead).
const SUBMISSIONS_KEPT: Duration = Duration::from_secs(24 * 3600);

/// A session's id as a shared store keeps it: its SHA-256 in hex (as a token's is kept), so that
/// whoever reads the database cannot sign in with it.
fn sha256_hex(id: &str) -> String {
    crate::api::token_sha256_hex(id)
}

/// The page for a shared store that could not be reached (503, try again).
fn store_failed(e: crate::store::StoreError) -> Response {
    tracing::warn!(error = %e, "the portal could not reach the lease store");
    let mut response = page(
        StatusCode::SERVICE_UNAVAILABLE,
        "Unavailable",
        None,
        Tab::None,
        "<p>The enforcer cannot reach its database just now. Try again in a moment.</p>",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// Ends the oldest of the sessions `which` picks; false if it picks none.
fn drop_oldest(sessions: &mut HashMap<String, Session>, which: impl Fn(&Session) -> bool) -> bool {
    let oldest = sessions
        .iter()
        .filter(|(_, s)| which(s))
        .min_by_key(|(_, s)| s.created)
        .map(|(id, _)| id.clone());
    oldest.is_some_and(|id| sessions.remove(&id).is_some())
}

/// 256 random bits in hex: two v4 UUIDs' random parts come from a CSPRNG, so two make a
/// session id or CSRF token no one guesses.
fn random_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// A signed-in person: the session's principal and CSRF token, and what the pages say about the
/// enforcer's clock when it is simulated.
struct Signed {
    id: String,
    principal: Principal,
    csrf: String,
    clock: Option<String>,
}

impl Signed {
    fn who(&self) -> Who<'_> {
        Who {
            principal: &self.principal,
            csrf: &self.csrf,
            clock: self.clock.as_deref(),
        }
    }

    /// Whether a form's `csrf` is this session's.
    fn csrf_ok(&self, presented: &str) -> bool {
        bool::from(self.csrf.as_bytes().ct_eq(presented.as_bytes()))
    }
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (k, v) = pair.trim().split_once('=')?;
            (k == name).then_some(v)
        })
}

impl FromRequestParts<Portal> for Signed {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, portal: &Portal) -> Result<Self, Response> {
        let session = match cookie(&parts.headers, portal.cookie_name()) {
            Some(id) => portal.session(id).await?.map(|s| (id.to_owned(), s)),
            None => None,
        };
        match session {
            Some((id, s)) => Ok(Signed {
                id,
                principal: s.principal,
                csrf: s.csrf,
                clock: {
                    let clock = portal.service().clock();
                    html::clock_note(
                        clock.speed(),
                        clock.now_ms(),
                        gpuwarden_schema::clock::wall_now_ms(),
                    )
                },
            }),
            None => Err(see_other("/ui/signin")),
        }
    }
}

/// The request's source address, for the failed-login limits.
struct Source(Option<IpAddr>);

impl FromRequestParts<Portal> for Source {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _: &Portal,
    ) -> Result<Self, std::convert::Infallible> {
        Ok(Source(source_of(parts)))
    }
}

fn see_other(to: &str) -> Response {
    let mut response = StatusCode::SEE_OTHER.into_response();
    response.headers_mut().insert(
        header::LOCATION,
        HeaderValue::from_str(to).expect("a portal path is a header value"),
    );
    html::secure_headers(response.headers_mut());
    response
}

/// A page for `signed` saying why it cannot be done.
fn refused(signed: &Signed, status: StatusCode, title: &str, why: &str) -> Response {
    page(
        status,
        title,
        Some(&signed.who()),
        Tab::None,
        &html::alert(why),
    )
}

fn csrf_refused(signed: &Signed) -> Response {
    refused(
        signed,
        StatusCode::FORBIDDEN,
        "Form expired",
        "This form was not sent from this session's page; go back, reload it and try again.",
    )
}

/// A service error as a status and a sentence for the page; an internal failure is logged and
/// told only as such.
fn failure(e: crate::service::ServiceError) -> (StatusCode, String) {
    let e = ApiError::from(e);
    let message = match &e {
        ApiError::Internal(detail) => {
            tracing::error!(error = %detail, "portal request failed");
            "the enforcer failed; try again, and tell an admin if it goes on".to_owned()
        }
        other => other.to_string(),
    };
    (e.status(), message)
}

async fn home(signed: Result<Signed, Response>) -> Response {
    match signed {
        Ok(s) if s.principal.role == Role::Viewer => see_other("/ui/leases"),
        Ok(_) => see_other("/ui/request"),
        Err(_) => see_other("/ui/signin"),
    }
}

async fn signin_page() -> Response {
    page(
        StatusCode::OK,
        "Sign in",
        None,
        Tab::None,
        &pages::signin(None),
    )
}

#[derive(Debug, Deserialize)]
struct SigninForm {
    #[serde(default)]
    token: String,
}

/// Whether a form came from this site: its `Origin`, when the browser sends one, names the
/// host the request was sent to.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    origin
        .split_once("://")
        .is_some_and(|(_, authority)| !host.is_empty() && authority == host)
}

async fn signin(
    State(portal): State<Portal>,
    Source(source): Source,
    headers: HeaderMap,
    Form(form): Form<SigninForm>,
) -> Response {
    if !same_origin(&headers) {
        return page(
            StatusCode::FORBIDDEN,
            "Sign in",
            None,
            Tab::None,
            &pages::signin(Some(
                "This sign-in was sent from another site, and was refused.",
            )),
        );
    }
    match portal.0.app.login(source, Some(&form.token)) {
        Ok(principal) => {
            let id = match portal.open(principal).await {
                Ok(id) => id,
                Err(response) => return response,
            };
            let mut response = see_other("/ui/");
            response
                .headers_mut()
                .insert(header::SET_COOKIE, portal.set_cookie(&id));
            response
        }
        Err(LoginRefusal::Missing) => page(
            StatusCode::UNAUTHORIZED,
            "Sign in",
            None,
            Tab::None,
            &pages::signin(Some("Paste your API token to sign in.")),
        ),
        Err(LoginRefusal::Wrong) => page(
            StatusCode::UNAUTHORIZED,
            "Sign in",
            None,
            Tab::None,
            &pages::signin(Some(
                "That token is not valid. Check that you pasted all of it; an admin can give you a new one.",
            )),
        ),
        Err(LoginRefusal::LockedOut(locked)) => {
            let mut response = page(
                StatusCode::TOO_MANY_REQUESTS,
                "Sign in",
                None,
                Tab::None,
                &pages::signin(Some(&format!(
                    "Too many failed sign-ins; try again in {} s.",
                    locked.retry_after_secs()
                ))),
            );
            if let Ok(v) = HeaderValue::from_str(&locked.retry_after_secs().to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
            response
        }
    }
}

#[derive(Debug, Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

async fn signout(
    State(portal): State<Portal>,
    signed: Signed,
    Form(form): Form<CsrfForm>,
) -> Response {
    if !signed.csrf_ok(&form.csrf) {
        return csrf_refused(&signed);
    }
    if let Err(response) = portal.close(&signed.id).await {
        return response;
    }
    let mut response = see_other("/ui/signin");
    response
        .headers_mut()
        .insert(header::SET_COOKIE, portal.clear_cookie());
    response
}

/// The request form's fields, as the browser sends them.
#[derive(Debug, Clone, Default, Deserialize)]
struct RequestForm {
    #[serde(default)]
    csrf: String,
    /// The form's one-use token (a new one each time the form is drawn): a second submission of
    /// the same form, as a reload sends, asks nothing.
    #[serde(default)]
    submission: String,
    #[serde(default)]
    team: String,
    #[serde(default)]
    user: String,
    #[serde(default)]
    project: String,
    #[serde(default)]
    workload: String,
    #[serde(default)]
    gpu_model: String,
    #[serde(default)]
    gpus: String,
    #[serde(default)]
    duration: String,
    /// `key=value`, one a line.
    #[serde(default)]
    labels: String,
    /// Set by the "Check cost" button: a dry run.
    #[serde(default)]
    check: Option<String>,
}

impl RequestForm {
    /// The admission request these fields make, decoded as the API decodes its body (so a
    /// field is refused for the same reasons, named the same way): the field at fault and why,
    /// otherwise.
    fn admission(&self, principal: &Principal, dry_run: bool) -> Result<AdmissionRequest, String> {
        let user = if principal.role == Role::Member || self.user.trim().is_empty() {
            principal.name.clone()
        } else {
            self.user.trim().to_owned()
        };
        let gpus: serde_json::Value = match self.gpus.trim().parse::<u64>() {
            Ok(n) => n.into(),
            Err(_) => {
                return Err(format!(
                    "GPUs: \"{}\" is not a whole number of GPUs",
                    self.gpus.trim()
                ))
            }
        };
        let mut labels = BTreeMap::new();
        for line in self.labels.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let Some((k, v)) = line.split_once('=') else {
                return Err(format!(
                    "labels: \"{line}\" is not key=value (one label a line)"
                ));
            };
            labels.insert(k.trim().to_owned(), v.trim().to_owned());
        }
        let mut body = serde_json::json!({
            "team": self.team.trim(),
            "user": user,
            "project": self.project.trim(),
            "workload": self.workload.trim(),
            "gpus": gpus,
            "dry_run": dry_run,
        });
        if !self.gpu_model.trim().is_empty() {
            body["gpu_model"] = self.gpu_model.trim().into();
        }
        if !self.duration.trim().is_empty() {
            body["duration"] = self.duration.trim().into();
        }
        if !labels.is_empty() {
            body["labels"] = serde_json::json!(labels);
        }
        let request: AdmissionRequest =
            api::decode(body.to_string().as_bytes()).map_err(|e| e.to_string())?;
        request
            .check_fields()
            .map_err(|(field, why)| format!("{field}: {why}"))?;
        Ok(request)
    }
}

async fn request_page(
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
            .or_else(|| teams_of(&portal, &signed.principal).into_iter().next())
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

/// The teams `principal` may ask for or read: its own, or every team for an admin.
fn teams_of(portal: &Portal, principal: &Principal) -> Vec<String> {
    match principal.role {
        Role::Admin => portal
            .service()
            .config()
            .teams
            .iter()
            .map(|t| t.name.clone())
            .collect(),
        _ => principal.teams.clone(),
    }
}

/// What an admission answered, for a page.
pub(crate) struct Outcome {
    /// The request asked.
    request: AdmissionRequest,
    /// Its decision and lease.
    admission: crate::service::Admission,
    /// The team after the decision.
    team: Option<crate::service::Team>,
}

/// Asks the service for `form`'s admission (a dry run when `dry_run`): the outcome, or the
/// status and sentence of what was wrong with the request.
async fn ask(
    portal: &Portal,
    signed: &Signed,
    form: &RequestForm,
    dry_run: bool,
) -> Result<Outcome, (StatusCode, String)> {
    let request = form
        .admission(&signed.principal, dry_run)
        .map_err(|why| (StatusCode::UNPROCESSABLE_ENTITY, why))?;
    let admission = portal
        .service()
        .admit(&signed.principal, request.clone(), None)
        .await
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

async fn request_submit(
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
        admission: crate::service::Admission {
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
        &teams_of(portal, &signed.principal),
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
async fn estimate(
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

async fn leases_page(
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

async fn release(
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
    outcome: Result<crate::store::Lease, crate::service::ServiceError>,
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

#[derive(Debug, Deserialize)]
struct ExtendForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    duration: String,
}

async fn extend(
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

/// `text` for a query string: letters, digits, `-` and `_` as they are, anything else
/// percent-encoded.
fn query_value(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn team_page(
    State(portal): State<Portal>,
    signed: Signed,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let teams = teams_of(&portal, &signed.principal);
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

async fn admin_page(State(portal): State<Portal>, signed: Signed) -> Response {
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

async fn scorecard_page(State(portal): State<Portal>, signed: Signed) -> Response {
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

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=300"),
    );
    html::secure_headers(headers);
    response
}

async fn css() -> Response {
    asset("text/css; charset=utf-8", ASSET_CSS)
}

async fn js() -> Response {
    asset("text/javascript; charset=utf-8", ASSET_JS)
}

async fn icon() -> Response {
    asset("image/svg+xml", ASSET_ICON)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_are_found_by_exact_name() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; gpuwarden_session=abc; x_gpuwarden_session=no"),
        );
        assert_eq!(cookie(&headers, "gpuwarden_session"), Some("abc"));
        assert_eq!(cookie(&headers, "session"), None);
    }

    #[test]
    fn a_form_from_another_site_is_not_same_origin() {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
        assert!(same_origin(&headers));
        headers.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:8080"),
        );
        assert!(same_origin(&headers));
        headers.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://evil.example"),
        );
        assert!(!same_origin(&headers));
        headers.insert(header::ORIGIN, HeaderValue::from_static("null"));
        assert!(!same_origin(&headers));
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(query_value("0193-ab_C"), "0193-ab_C");
        assert_eq!(query_value("a b&c"), "a%20b%26c");
    }

    #[test]
    fn random_tokens_are_long_and_differ() {
        let (a, b) = (random_token(), random_token());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }
}
