//! What the portal keeps between requests: its sessions and the request forms already sent, in
//! this process's memory or, where replicas share the store, through the service; beside the
//! API's state and the lake that the routes read.
//!
//! A session maps a random id (the cookie's value) to the principal, a CSRF token and when it
//! opened; never the API token. On a shared store the session's id is kept only as its SHA-256,
//! so that whoever reads the database cannot sign in with it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use axum::response::Response;
use gpuwarden_schema::config::Role;

use super::html::store_failed;
use super::insights::Insights;
use crate::policy::Principal;
use crate::service::Service;
use crate::web::AppState;

/// How long a session lasts from sign-in.
pub const SESSION_LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// Most sessions kept; past it, signing in drops the expired ones, then the oldest.
const SESSIONS_KEPT: usize = 10_000;
/// Sessions one token may hold at once (browsers, devices); signing in once more ends its
/// oldest, so that nobody holding one token can push everyone else's sessions out.
pub const SESSIONS_PER_TOKEN: usize = 16;

/// How many submitted request forms are remembered (the oldest forgotten first): far more than
/// anyone reloads a page after.
const SENT_KEPT: usize = 4096;

/// How long a shared store remembers a request form sent (the memory of one enforcer keeps the
/// last 4,096 instead).
const SUBMISSIONS_KEPT: Duration = Duration::from_secs(24 * 3600);

/// The portal's state: the API's (service, tokens, failed logins), the sessions, and the lake.
#[derive(Debug, Clone)]
pub(super) struct Portal(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    app: AppState,
    sessions: Mutex<HashMap<String, Session>>,
    /// The request forms already submitted, so that a form sent twice (a reload of the decision
    /// page re-posts it) asks once.
    sent: Mutex<Sent>,
    /// Whether the store is shared by replicas: then the sessions and the forms sent live
    /// there (through the service) instead of the two maps above, and every replica reads them,
    /// so a person is not signed out, nor a form asked twice, whichever replica answers.
    shared: bool,
    insights: Option<Arc<dyn Insights>>,
    /// Served over TLS: the cookie is `Secure` (and `__Host-` prefixed).
    secure: bool,
}

/// The one-use tokens of request forms submitted, each with the lease it made (none while the
/// request is being decided, or when it was denied).
#[derive(Debug, Default)]
struct Sent {
    order: VecDeque<String>,
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

/// A signed-in person's session: who, the CSRF token of their forms, and when it opened.
#[derive(Debug, Clone)]
pub(super) struct Session {
    pub(super) principal: Principal,
    pub(super) csrf: String,
    created: Instant,
}

impl Portal {
    /// The state over the API's `app`, reading the lake through `insights` when there is one.
    pub(super) fn new(app: AppState, insights: Option<Arc<dyn Insights>>) -> Self {
        let secure = app.service().config().enforcer.tls.is_some();
        let shared = app.service().store_is_shared();
        Portal(Arc::new(Inner {
            app,
            sessions: Mutex::default(),
            sent: Mutex::default(),
            shared,
            insights,
            secure,
        }))
    }

    /// The API's state: the service, the tokens and the failed-login limits.
    pub(super) fn app(&self) -> &AppState {
        &self.0.app
    }

    pub(super) fn service(&self) -> &Service {
        self.0.app.service()
    }

    /// What reads the lake, when this enforcer has one.
    pub(super) fn insights(&self) -> Option<&Arc<dyn Insights>> {
        self.0.insights.as_ref()
    }

    /// Whether the portal is served over TLS.
    pub(super) fn secure(&self) -> bool {
        self.0.secure
    }

    /// The teams `principal` may ask for or read: its own, or every team for an admin.
    pub(super) fn teams_of(&self, principal: &Principal) -> Vec<String> {
        match principal.role {
            Role::Admin => self
                .service()
                .config()
                .teams
                .iter()
                .map(|t| t.name.clone())
                .collect(),
            _ => principal.teams.clone(),
        }
    }

    fn sent(&self) -> MutexGuard<'_, Sent> {
        // A map of sent forms is valid after any panic.
        self.0.sent.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn sessions(&self) -> MutexGuard<'_, HashMap<String, Session>> {
        // A map of sessions is valid after any panic.
        self.0
            .sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A new session for `principal`: its id, for the cookie.
    pub(super) async fn open(&self, principal: Principal) -> Result<String, Response> {
        if !self.0.shared {
            return Ok(self.open_here(principal));
        }
        let id = random_token();
        let session = (
            principal.name,
            random_token(),
            gpuwarden_schema::clock::wall_now_ms(),
        );
        self.service()
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
    pub(super) async fn session(&self, id: &str) -> Result<Option<Session>, Response> {
        if !self.0.shared {
            return Ok(self.session_here(id));
        }
        let since = gpuwarden_schema::clock::wall_now_ms() - SESSION_LIFETIME.as_millis() as i64;
        let Some((name, csrf, created_ms)) = self
            .service()
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

    /// Ends session `id`.
    pub(super) async fn close(&self, id: &str) -> Result<(), Response> {
        if self.0.shared {
            return self
                .service()
                .portal_session_close(&sha256_hex(id))
                .await
                .map_err(store_failed);
        }
        self.sessions().remove(id);
        Ok(())
    }

    /// Marks the form sent with one-use `token`: `Ok` the first time, else the lease it made.
    pub(super) async fn first_time(
        &self,
        token: &str,
    ) -> Result<Result<(), Option<String>>, Response> {
        if !self.0.shared {
            return Ok(self.sent().first_time(token));
        }
        self.service()
            .portal_submission_first(
                token,
                gpuwarden_schema::clock::wall_now_ms(),
                SUBMISSIONS_KEPT.as_millis() as i64,
            )
            .await
            .map_err(store_failed)
    }

    /// Records the lease the form sent with `token` made.
    pub(super) async fn made(&self, token: &str, lease_id: &str) {
        if !self.0.shared {
            self.sent().made(token, lease_id);
        } else if let Err(e) = self.service().portal_submission_made(token, lease_id).await {
            tracing::warn!(error = %e, "could not record the lease a request form made; sent again, it is refused without naming the lease");
        }
    }
}

/// A session's id as a shared store keeps it: its SHA-256 in hex (as a token's is kept), so that
/// whoever reads the database cannot sign in with it.
fn sha256_hex(id: &str) -> String {
    crate::web::token_sha256_hex(id)
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
/// session id, CSRF token or form token no one guesses.
pub(super) fn random_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_tokens_are_long_and_differ() {
        let (a, b) = (random_token(), random_token());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }
}
