//! Alerts: the runtime rules tell people through `enforcer.alert_webhooks`.
//!
//! Each alert is POSTed to every configured URL as JSON that Slack-compatible incoming webhooks
//! accept (`text`, in Slack's mrkdwn), with the [`Action`] it was recorded as under `gpuwarden`
//! for receivers that want the fields. Delivery runs in the background, so a slow receiver
//! never holds up enforcement: each URL is tried up to [`ATTEMPTS`] times with a doubling
//! backoff, then the alert is given up on, logged and counted (the Action is already in the
//! audit trail either way).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use gpuwarden_schema::retry::Backoff;
use gpuwarden_schema::{Action, ActionKind};
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{HeaderValue, CONTENT_TYPE, USER_AGENT};
use hyper::{Method, Request, Uri};
use serde::Serialize;

use crate::outbound::{http_client, HttpClient};

/// Tries per URL before an alert is given up on.
pub const ATTEMPTS: u32 = 4;
/// Wait before the first retry; each later one waits twice as long.
const BACKOFF: Duration = Duration::from_millis(200);
/// Time allowed per attempt.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Sends alerts to the configured webhooks. Cheap to clone.
#[derive(Clone)]
pub struct Alerts {
    inner: Arc<Inner>,
}

struct Inner {
    urls: Vec<(String, Uri)>,
    client: HttpClient,
    delivered: AtomicU64,
    failed: AtomicU64,
}

impl std::fmt::Debug for Alerts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alerts")
            .field("urls", &self.inner.urls.len())
            .finish_non_exhaustive()
    }
}

/// The body each webhook receives.
#[derive(Debug, Serialize)]
pub struct AlertBody<'a> {
    /// One line for people (Slack mrkdwn).
    pub text: String,
    /// The Action the alert was recorded as.
    pub gpuwarden: &'a Action,
}

impl Alerts {
    /// Alerts to `urls` (already validated by the config: http or https). URLs that do not
    /// parse are logged and skipped.
    pub fn new(urls: &[String]) -> Self {
        let urls = urls
            .iter()
            .filter_map(|u| match u.parse::<Uri>() {
                Ok(uri) => Some((u.clone(), uri)),
                Err(e) => {
                    tracing::error!(url = %u, error = %e, "alert webhook URL does not parse; skipped");
                    None
                }
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                urls,
                client: http_client(),
                delivered: AtomicU64::new(0),
                failed: AtomicU64::new(0),
            }),
        }
    }

    /// Alerts delivered (per URL) since the start.
    pub fn delivered(&self) -> u64 {
        self.inner.delivered.load(Ordering::Relaxed)
    }

    /// Alerts given up on (per URL) since the start.
    pub fn failed(&self) -> u64 {
        self.inner.failed.load(Ordering::Relaxed)
    }

    /// Sends `action` to every webhook in the background; returns at once. Needs a Tokio
    /// runtime.
    pub fn send(&self, action: &Action) {
        if self.inner.urls.is_empty() {
            return;
        }
        let body = AlertBody {
            text: text(action),
            gpuwarden: action,
        };
        let body = match serde_json::to_vec(&body) {
            Ok(b) => Bytes::from(b),
            Err(e) => {
                tracing::error!(error = %e, "cannot encode an alert; this is a bug");
                return;
            }
        };
        for (url, uri) in &self.inner.urls {
            let (inner, url, uri, body) = (
                Arc::clone(&self.inner),
                url.clone(),
                uri.clone(),
                body.clone(),
            );
            tokio::spawn(async move { inner.deliver(&url, uri, body).await });
        }
    }
}

impl Inner {
    async fn deliver(&self, url: &str, uri: Uri, body: Bytes) {
        let mut last = String::new();
        let mut backoff = Backoff::doubling(BACKOFF);
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(backoff.next_pause()).await;
            }
            match tokio::time::timeout(TIMEOUT, self.attempt(uri.clone(), body.clone())).await {
                Err(_) => last = format!("no answer within {TIMEOUT:?}"),
                Ok(Err(e)) => last = e,
                Ok(Ok(status)) if status.is_success() => {
                    self.delivered.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Ok(Ok(status)) => last = format!("the webhook answered {status}"),
            }
            tracing::debug!(url, attempt, error = %last, "alert delivery failed");
        }
        self.failed.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(url, attempts = ATTEMPTS, error = %last, "alert not delivered; giving up");
    }

    async fn attempt(&self, uri: Uri, body: Bytes) -> Result<hyper::StatusCode, String> {
        let request = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(
                USER_AGENT,
                HeaderValue::from_static(concat!("gpuwarden/", env!("CARGO_PKG_VERSION"))),
            )
            .body(Full::new(body))
            .map_err(|e| format!("cannot build the request: {e}"))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| format!("cannot reach the webhook: {e}"))?;
        let status = response.status();
        // Read (and drop) the answer so the connection can be reused.
        let _ = Limited::new(response.into_body(), 64 << 10).collect().await;
        Ok(status)
    }
}

/// The one line people read: what happened, to whom, and why.
pub fn text(action: &Action) -> String {
    let subject = match (&action.lease_id, &action.team) {
        (Some(lease), Some(team)) => format!("lease `{lease}` of team *{team}*"),
        (None, Some(team)) => format!("team *{team}*"),
        (Some(lease), None) => format!("lease `{lease}`"),
        (None, None) => "the fleet".to_string(),
    };
    let what = match action.action {
        ActionKind::Alert => "alert",
        ActionKind::Reclaim => "reclaimed",
        ActionKind::Resize => "resized",
        ActionKind::Block => "blocked",
        ActionKind::Unblock => "unblocked",
        ActionKind::Admit => "admitted",
        ActionKind::Deny => "denied",
    };
    let mut line = format!(":warning: gpuwarden {what} ({}): {subject}", action.reason);
    if !action.detail.is_empty() {
        line.push_str(" — ");
        line.push_str(&action.detail);
    }
    if action.outcome == gpuwarden_schema::Outcome::DryRun {
        line.push_str(" _(dry run: nothing was changed)_");
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_wait_twice_as_long_each_time() {
        let mut backoff = Backoff::doubling(BACKOFF);
        let pauses: Vec<Duration> = (1..ATTEMPTS).map(|_| backoff.next_pause()).collect();
        assert_eq!(pauses, [200, 400, 800].map(Duration::from_millis));
    }
}
