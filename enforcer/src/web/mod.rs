//! What every door served over HTTP with bearer tokens shares (the API, the Slurm hook's
//! routes, the portal): the state their handlers hold ([`AppState`]: the service, the tokens,
//! the failed logins), the caller as a [`Principal`], JSON bodies ([`ApiJson`]) and the one
//! error shape ([`ApiError`]), with each failure's status.
//!
//! - `error`: the error shape and the status of each failure; `log_failures` logs the
//!   enforcer's own failures with the request they failed;
//! - `extract`: the caller (bearer tokens, failed logins limited per source and per token) and
//!   JSON bodies.
//!
//! The routes themselves belong to their doors: `api::router` mounts the API's and the Slurm
//! hook's, and the portal adds its own.

mod error;
mod extract;

use std::sync::Arc;

pub(crate) use self::error::log_failures;
pub use self::error::{ApiError, ErrorBody, ErrorDetail};
pub use self::extract::{decode, source_of, token_sha256_hex, ApiJson, LoginRefusal};
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
        if service.store_is_shared() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(extract::follow_failures(
                        service.clone(),
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

    /// The service the handlers call.
    pub fn service(&self) -> &Service {
        &self.service
    }

    /// The principal a bearer token belongs to, if any.
    pub fn authenticate(&self, token: &str) -> Option<Principal> {
        self.tokens.authenticate(token)
    }
}
