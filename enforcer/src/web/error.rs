//! The API's one error shape, `{error: {code, message, field?}}`, and how each failure maps to
//! a status: the service's [`ServiceError`]s by whose fault they are, and the HTTP layer's own
//! (a body that is not JSON or too large, a missing token, too many failed logins). An internal failure's detail goes to
//! the log, with the request it failed, through [`log_failures`]; the caller is told only that
//! the enforcer failed.

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use gpuwarden_schema::login_limit::{LockedOut, Scope};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::service::ServiceError;
use crate::store::StoreError;

/// An API error: whose fault, a status, and one JSON shape `{error: {code, message, field?}}`.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON (400); the message names the line and column.
    #[error("{0}")]
    MalformedJson(String),
    /// A field is missing, of the wrong type or out of range (422).
    #[error("{field}: {message}")]
    InvalidField {
        /// The field at fault, as a path (`gpus`, `labels.team`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// No valid bearer token was given (401).
    #[error("a valid bearer token is required")]
    Unauthorized,
    /// Too many bearer tokens that matched nothing came from this source address, or this
    /// token was presented too often (429, with `Retry-After`).
    #[error("too many failed logins {}; try again in {retry_after_secs} s", by_scope(*.scope))]
    TooManyFailedLogins {
        /// What is locked out.
        scope: Scope,
        /// Seconds until the lockout ends.
        retry_after_secs: u64,
    },
    /// The principal may not do this (403).
    #[error("{0}")]
    Forbidden(String),
    /// The team or lease named does not exist (404).
    #[error("{0}")]
    NotFound(String),
    /// The body is larger than `enforcer.max_request_bytes` (413).
    #[error("the request body is larger than the {limit} bytes allowed")]
    PayloadTooLarge {
        /// The limit, bytes.
        limit: usize,
    },
    /// The lease's state does not allow the change (409).
    #[error("{0}")]
    Conflict(String),
    /// A substrate driver failed; retrying may help (503).
    #[error("{0}")]
    Substrate(String),
    /// The lease store's database cannot be reached (503, with `Retry-After`); nothing was
    /// decided. Another replica, or this one a moment later, may answer.
    #[error("{0}")]
    StoreUnavailable(String),
    /// A bug or a store failure (500); the detail is logged (by `log_failures`), not sent.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MalformedJson(_) => StatusCode::BAD_REQUEST,
            Self::InvalidField { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::TooManyFailedLogins { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::Substrate(_) | Self::StoreUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable error code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::MalformedJson(_) => "malformed_json",
            Self::InvalidField { .. } => "invalid_field",
            Self::Unauthorized => "unauthorized",
            Self::TooManyFailedLogins { .. } => "too_many_failed_logins",
            Self::Forbidden(_) => "forbidden",
            Self::NotFound(_) => "not_found",
            Self::PayloadTooLarge { .. } => "payload_too_large",
            Self::Conflict(_) => "conflict",
            Self::Substrate(_) => "substrate_unavailable",
            Self::StoreUnavailable(_) => "store_unavailable",
            Self::Internal(_) => "internal",
        }
    }

    pub(super) fn locked_out(locked: LockedOut) -> Self {
        Self::TooManyFailedLogins {
            scope: locked.scope,
            retry_after_secs: locked.retry_after_secs(),
        }
    }

    pub(crate) fn field(name: &str, message: impl Into<String>) -> Self {
        Self::InvalidField {
            field: name.into(),
            message: message.into(),
        }
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        match e {
            ServiceError::Invalid { field, message } => Self::InvalidField { field, message },
            ServiceError::NotFound(m) => Self::NotFound(m),
            ServiceError::Conflict(m) => Self::Conflict(m),
            ServiceError::Forbidden(m) => Self::Forbidden(m),
            ServiceError::Substrate(m) => Self::Substrate(m),
            ServiceError::Store(StoreError::Unavailable(m)) => Self::StoreUnavailable(format!(
                "the lease store's database cannot be reached; nothing was decided, try again \
                 ({m})"
            )),
            e @ (ServiceError::Store(_) | ServiceError::Bug(_)) => Self::Internal(e.to_string()),
        }
    }
}

fn by_scope(scope: Scope) -> &'static str {
    match scope {
        Scope::Source => "from this address",
        Scope::Principal => "with this token",
    }
}

/// The body of every error response.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable code: `malformed_json`, `invalid_field`, `unauthorized`,
    /// `too_many_failed_logins`, `forbidden`, `not_found`, `payload_too_large`, `conflict`,
    /// `substrate_unavailable`, `store_unavailable`, `internal`.
    pub code: String,
    /// For a person.
    pub message: String,
    /// The field at fault, for `invalid_field`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let message = match &self {
            Self::Internal(_) => "the enforcer failed; the error is in its log".to_string(),
            Self::InvalidField { message, .. } => message.clone(),
            other => other.to_string(),
        };
        let field = match &self {
            Self::InvalidField { field, .. } => Some(field.clone()),
            _ => None,
        };
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code().into(),
                message,
                field,
            },
        };
        let mut response = (self.status(), Json(body)).into_response();
        if let Self::Internal(detail) = self {
            response.extensions_mut().insert(Failure(detail));
            return response;
        }
        match self {
            Self::Unauthorized => {
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            Self::TooManyFailedLogins {
                retry_after_secs, ..
            } => {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
            }
            Self::StoreUnavailable(_) => {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(1u64));
            }
            _ => {}
        }
        response
    }
}

/// The detail of an internal failure, carried from [`ApiError::into_response`] to
/// [`log_failures`] in the response's extensions.
#[derive(Debug, Clone)]
struct Failure(String);

/// Logs each internal failure with the method and path of the request it failed.
pub(crate) async fn log_failures(request: Request, next: Next) -> Response {
    // Both clones share the request's buffers: no copy on the way through.
    let (method, uri) = (request.method().clone(), request.uri().clone());
    let response = next.run(request).await;
    if let Some(Failure(detail)) = response.extensions().get::<Failure>() {
        tracing::error!(%method, path = uri.path(), error = %detail, "enforcer API request failed");
    }
    response
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use axum::body::Body;
    use axum::routing::get;
    use axum::Router;
    use tower::ServiceExt as _;

    use super::*;

    /// Log lines, kept for the test to read.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    async fn answer(app: &Router, path: &str) -> (StatusCode, String) {
        let request = Request::builder()
            .uri(path)
            .body(Body::empty())
            .expect("request");
        let response = app.clone().oneshot(request).await.expect("answered");
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .expect("body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    /// An internal failure's detail reaches the log with the request it failed, and never the
    /// caller; the caller's own faults are not logged as failures.
    #[tokio::test(flavor = "current_thread")]
    async fn internal_failures_are_logged_with_their_request_and_not_sent() {
        let lines = Lines::default();
        let writer = lines.clone();
        let _guard = tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .finish(),
        );
        let app = Router::new()
            .route(
                "/v1/broken",
                get(|| async { ApiError::Internal("the disk is full".into()) }),
            )
            .route(
                "/v1/missing",
                get(|| async { ApiError::NotFound("there is no lease x".into()) }),
            )
            .layer(axum::middleware::from_fn(log_failures));

        let (status, body) = answer(&app, "/v1/broken").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(
            !body.contains("disk"),
            "the detail stays in the log: {body}"
        );
        let (status, _) = answer(&app, "/v1/missing").await;
        assert_eq!(status, StatusCode::NOT_FOUND);

        let log = String::from_utf8(lines.0.lock().expect("lock").clone()).expect("UTF-8");
        let failures: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("enforcer API request failed"))
            .collect();
        assert_eq!(failures.len(), 1, "one failure logged: {log}");
        for part in [
            "ERROR",
            "method=GET",
            "path=\"/v1/broken\"",
            "the disk is full",
        ] {
            assert!(failures[0].contains(part), "{part} in {}", failures[0]);
        }
    }
}
