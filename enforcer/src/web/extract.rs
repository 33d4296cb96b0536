//! What the handlers take from a request: the caller, as the [`Principal`] its bearer token
//! belongs to, and a JSON body whose rejections share [`ApiError`]'s shape.
//!
//! Failed logins are limited here ([`Logins`]): a bearer token that matches no `[[tokens]]`
//! entry counts against the connection's source address and against the token itself (a
//! bearer token names no principal until it matches one, so the token presented stands for
//! the principal: the same wrong token from many addresses is locked out too). While either is
//! locked out the request is answered 429 with `Retry-After`, before the token is compared with
//! anything. A request without a token is answered 401 and not counted: it guessed nothing.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use axum::extract::{ConnectInfo, FromRequest, FromRequestParts, Request as HttpRequest};
use axum::http::header;
use axum::http::request::Parts;
use gpuwarden_schema::config::{LoginLimits, TokenConfig};
use gpuwarden_schema::login_limit::{LockedOut, LoginLimiter};
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::{ApiError, AppState};
use crate::policy::Principal;

/// The configured bearer tokens: each one's SHA-256 and the principal it stands for.
#[derive(Debug, Default)]
pub(super) struct Tokens(Vec<([u8; 32], Principal)>);

impl Tokens {
    /// The `[[tokens]]` entries. One whose `sha256` is not 64 hex digits never matches (the
    /// config validation reports it).
    pub(super) fn new(tokens: &[TokenConfig]) -> Self {
        Self(
            tokens
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
                .collect(),
        )
    }

    /// The principal a bearer token belongs to. Every configured hash is compared, in constant
    /// time, so the answer's timing says nothing of which token came close.
    pub(super) fn authenticate(&self, token: &str) -> Option<Principal> {
        self.authenticate_digest(&sha256(token))
    }

    /// The principal whose token has the SHA-256 `digest`, compared as [`Self::authenticate`]
    /// does.
    fn authenticate_digest(&self, digest: &[u8; 32]) -> Option<Principal> {
        let mut found = None;
        for (hash, principal) in &self.0 {
            if bool::from(hash.ct_eq(digest)) && found.is_none() {
                found = Some(principal.clone());
            }
        }
        found
    }
}

/// The failed logins of `[enforcer.login_limits]`, shared by every request.
#[derive(Debug)]
pub(super) struct Logins(Mutex<LoginLimiter>);

impl Logins {
    pub(super) fn new(limits: &LoginLimits) -> Self {
        Self(Mutex::new(LoginLimiter::new(limits)))
    }

    fn limiter(&self) -> std::sync::MutexGuard<'_, LoginLimiter> {
        // The limiter's state is a set of counts, valid after any panic.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Counts in `logins` the failed logins the other replicas of a shared store saw, every second,
/// for as long as `logins` lives: a source address or a token is locked out on every replica,
/// whichever it tried (within a second). Failures older than the limits' window are not taken.
pub(super) async fn follow_failures(
    service: crate::service::Service,
    logins: std::sync::Weak<Logins>,
    window: std::time::Duration,
) {
    let mut after = 0;
    let window_ms = window.as_millis() as i64;
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let Some(logins) = logins.upgrade() else {
            return;
        };
        let since = gpuwarden_schema::clock::wall_now_ms() - window_ms;
        let failures = match service.login_failures(after, since).await {
            Ok(failures) => failures,
            Err(e) => {
                tracing::debug!(error = %e, "could not read the other replicas' failed logins");
                continue;
            }
        };
        let now = Instant::now();
        let mut limiter = logins.limiter();
        for (id, source, principal) in failures {
            after = after.max(id);
            let source = source.and_then(|s| s.parse::<IpAddr>().ok());
            let principal = principal.as_deref().and_then(parse_hex32);
            let failure = limiter.failed(source, principal.as_ref().map(|p| &p[..]), now);
            for locked in failure.lockouts() {
                log_lockout(source, locked);
            }
        }
    }
}

fn sha256(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

/// What a `[[tokens]]` entry's `sha256` holds for the bearer token `token`: its SHA-256 in hex,
/// as `printf %s TOKEN | sha256sum` prints it.
pub fn token_sha256_hex(token: &str) -> String {
    hex(&sha256(token))
}

/// A digest in lowercase hex.
fn hex(digest: &[u8; 32]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
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

/// Why a presented token signed no one in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginRefusal {
    /// No token was presented (not counted as a failed login: it guessed nothing).
    Missing,
    /// The token matches no `[[tokens]]` entry (counted against the source and the token).
    Wrong,
    /// The source or the token is locked out after too many failed logins.
    LockedOut(LockedOut),
}

impl From<LoginRefusal> for ApiError {
    fn from(refusal: LoginRefusal) -> Self {
        match refusal {
            LoginRefusal::Missing | LoginRefusal::Wrong => ApiError::Unauthorized,
            LoginRefusal::LockedOut(locked) => ApiError::locked_out(locked),
        }
    }
}

impl AppState {
    /// The principal `token` belongs to, checked as every API request is: a source or token
    /// locked out is refused before the token is compared with anything, and a wrong token
    /// counts against both. The portal's sign-in calls this too, so the API and the portal share
    /// one set of failed logins.
    pub fn login(
        &self,
        source: Option<IpAddr>,
        token: Option<&str>,
    ) -> Result<Principal, LoginRefusal> {
        let metrics = self.service.metrics();
        let refuse = |locked: LockedOut| {
            metrics.count_login_refused(locked.scope);
            LoginRefusal::LockedOut(locked)
        };
        let now = Instant::now();
        self.logins
            .limiter()
            .check(source, None, now)
            .map_err(refuse)?;
        let token = token
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(LoginRefusal::Missing)?;
        let digest = sha256(token);
        self.logins
            .limiter()
            .check(None, Some(&digest), now)
            .map_err(refuse)?;
        if let Some(principal) = self.tokens.authenticate_digest(&digest) {
            return Ok(principal);
        }
        let failure = self.logins.limiter().failed(source, Some(&digest), now);
        // Told to the other replicas of a shared store, which count it too (`follow_failures`).
        self.service.share_failed_login(
            source.map(|s| s.to_string()),
            Some(hex(&digest)),
            gpuwarden_schema::clock::wall_now_ms(),
        );
        metrics.count_login_failure(&failure);
        for locked in failure.lockouts() {
            log_lockout(source, locked);
        }
        Err(LoginRefusal::Wrong)
    }
}

/// The source address of a request served with connect info; none in process (through
/// `oneshot`), where only the token is limited.
pub fn source_of(parts: &Parts) -> Option<IpAddr> {
    parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(peer)| peer.ip())
}

impl FromRequestParts<AppState> for Principal {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        Ok(state.login(source_of(parts), token)?)
    }
}

fn log_lockout(source: Option<IpAddr>, locked: LockedOut) {
    tracing::warn!(
        source = %source.map_or_else(|| "unknown".to_string(), |s| s.to_string()),
        scope = locked.scope.as_str(),
        retry_after_s = locked.retry_after_secs(),
        "too many failed API logins: locked out (enforcer.login_limits)"
    );
}

/// A JSON body extractor whose rejections are [`ApiError`]s: over `enforcer.max_request_bytes`
/// → 413, not JSON → 400 naming line and column, wrong shape → 422 naming the field.
#[derive(Debug, Clone)]
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: HttpRequest, state: &AppState) -> Result<Self, ApiError> {
        let limit = state.service.config().enforcer.max_request_bytes;
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
