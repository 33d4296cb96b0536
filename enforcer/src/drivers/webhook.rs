//! The `webhook` driver: any external provisioner (a portal, a scheduler, a cloud broker) that
//! accepts signed JSON over HTTP.
//!
//! Every call is `POST <url>` with `Content-Type: application/json` and a body
//! `{"action": "provision" | "resize" | "reclaim" | "status", "lease": {...}, "reason"?: "..."}`.
//! For provision and resize, `lease` carries every [`LeaseSpec`] field (`lease_id`, `team`,
//! `user`, `project`, `workload`, `gpu_model`, `gpu_count`, `gpu_uuids` (empty: the provisioner
//! picks devices), `command`, `labels`); for reclaim and status it is `{"lease_id": ...}`, and
//! reclaim adds `reason` (`user`, `expired`, `idle`, `budget`, `admin`, `failed`). Any 2xx answer
//! is success. The answer to `status` must be `{"state": "running" | "exited" | "gone"}`, with an
//! optional integer `exit_code` for `exited`. The provisioner must treat a repeated call as a
//! no-op (a retry may deliver one twice): provision of a running lease, reclaim of a gone one.
//!
//! Signing: with `secret` set, each attempt carries `X-Gpuwarden-Timestamp: <unix seconds>` and
//! `X-Gpuwarden-Signature: sha256=<hex>`, where `<hex>` is the lowercase hex HMAC-SHA256, keyed
//! with `secret`, of the timestamp's decimal digits, one `.`, and the exact body bytes. A receiver
//! recomputes it over the raw body before parsing, compares in constant time, and refuses a
//! timestamp more than 5 minutes from its own clock, so a captured request cannot be replayed
//! later. Each attempt is signed afresh. Without `secret` the headers are left out (for a
//! provisioner on a trusted network only; the driver logs a warning when built).
//!
//! Failures: each attempt may take `timeout` (default 10 s); a 4xx answer (but 408 and 429) is
//! the provisioner refusing the request: [`DriverError::Rejected`] at once, never retried. A 5xx,
//! 408, 429, timeout or connection error is retried up to `retries` more times (default 3), after
//! 0.1 s, 0.2 s, 0.4 s… (doubling, at most 5 s), then [`DriverError::Unavailable`].
//!
//! Inventory is the configured pool, `(gpu_model, capacity)`; the provisioner is not asked.

use std::time::Duration;

use bytes::Bytes;
use gpuwarden_schema::clock::wall_now_s;
use gpuwarden_schema::config::SubstrateConfig;
use gpuwarden_schema::retry::Backoff;
use gpuwarden_schema::ReleaseReason;
use hmac::{Hmac, KeyInit, Mac};
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{HeaderValue, CONTENT_TYPE, USER_AGENT};
use hyper::{Method, Request, StatusCode, Uri};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use super::{config_error, Driver, DriverError, Inventory, LeaseSpec, LeaseStatus};
use crate::outbound::{http_client, HttpClient};

/// Time allowed per attempt when `timeout` is not set.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Attempts after the first failure when `retries` is not set.
pub const DEFAULT_RETRIES: u32 = 3;
/// Header with the signature, `sha256=<hex>`.
pub const SIGNATURE_HEADER: &str = "x-gpuwarden-signature";
/// Header with the Unix time in seconds that the signature covers.
pub const TIMESTAMP_HEADER: &str = "x-gpuwarden-timestamp";

/// Wait before the first retry; each later one waits twice as long, up to [`MAX_BACKOFF`].
const BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Answers are small JSON documents; anything larger is not read in full.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// An external provisioner's driver.
#[derive(Debug)]
pub struct WebhookDriver {
    name: String,
    url: String,
    uri: Uri,
    secret: Option<Vec<u8>>,
    timeout: Duration,
    retries: u32,
    model: String,
    capacity: u32,
    client: HttpClient,
}

/// The body of every call.
#[derive(Debug, Serialize)]
struct Call<'a> {
    action: &'static str,
    lease: LeaseBody<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'static str>,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
enum LeaseBody<'a> {
    Full(FullLease<'a>),
    Id { lease_id: &'a str },
}

#[derive(Debug, Serialize)]
struct FullLease<'a> {
    lease_id: &'a str,
    team: &'a str,
    user: &'a str,
    project: &'a str,
    workload: &'static str,
    gpu_model: &'a str,
    gpu_count: u32,
    gpu_uuids: &'a [String],
    command: Option<&'a [String]>,
    labels: &'a std::collections::BTreeMap<String, String>,
}

impl<'a> FullLease<'a> {
    fn new(lease: &'a LeaseSpec) -> Self {
        Self {
            lease_id: &lease.lease_id,
            team: &lease.team,
            user: &lease.user,
            project: &lease.project,
            workload: lease.workload.as_str(),
            gpu_model: &lease.gpu_model,
            gpu_count: lease.gpu_count,
            gpu_uuids: &lease.gpu_uuids,
            command: lease.command.as_deref(),
            labels: &lease.labels,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum State {
    Running,
    Exited,
    Gone,
}

#[derive(Debug, Deserialize)]
struct StatusAnswer {
    state: State,
    #[serde(default)]
    exit_code: Option<i32>,
}

/// `sha256=<hex>` over `<timestamp>.<body>` with `secret`; see the module docs.
pub fn signature(secret: &[u8], timestamp: u64, body: &[u8]) -> String {
    // HMAC takes a key of any length, so this cannot fail; the fallback keeps that local.
    let mut mac = match <Hmac<Sha256> as KeyInit>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => return String::new(),
    };
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

impl WebhookDriver {
    /// Builds the driver from a `driver = "webhook"` entry.
    pub fn new(config: &SubstrateConfig) -> Result<Self, DriverError> {
        let Some(url) = config.url.clone() else {
            return Err(config_error(
                config,
                "url",
                "the webhook driver needs the provisioner's URL",
            ));
        };
        let uri: Uri = url
            .parse()
            .map_err(|e| config_error(config, "url", format!("\"{url}\" is not a URL: {e}")))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(config_error(
                config,
                "url",
                format!("\"{url}\" is not an http:// or https:// URL"),
            ));
        }
        let model =
            match &config.gpu_model {
                Some(m) if !m.trim().is_empty() => m.clone(),
                _ => return Err(config_error(
                    config,
                    "gpu_model",
                    "the webhook driver needs the full NVML model name of the GPUs it hands out",
                )),
            };
        let capacity = match config.capacity {
            Some(c) if c > 0 => c,
            Some(_) => return Err(config_error(config, "capacity", "must be at least 1")),
            None => {
                return Err(config_error(
                    config,
                    "capacity",
                    "the webhook driver needs how many GPUs the provisioner can hand out",
                ))
            }
        };
        let timeout = config.timeout.unwrap_or(DEFAULT_TIMEOUT);
        if timeout.is_zero() {
            return Err(config_error(config, "timeout", "must be longer than zero"));
        }
        let secret = match &config.secret {
            Some(s) if s.is_empty() => {
                return Err(config_error(
                    config,
                    "secret",
                    "must not be empty; leave it out to send unsigned requests",
                ))
            }
            Some(s) => Some(s.as_bytes().to_vec()),
            None => {
                tracing::warn!(
                    substrate = %config.name,
                    "webhook substrate has no secret: its requests are not signed"
                );
                None
            }
        };
        Ok(Self {
            name: config.name.clone(),
            url,
            uri,
            secret,
            timeout,
            retries: config.retries.unwrap_or(DEFAULT_RETRIES),
            model,
            capacity,
            client: http_client(),
        })
    }

    /// Sends `call`, retrying as the module docs say; returns the 2xx answer's body.
    async fn call(&self, call: &Call<'_>) -> Result<Bytes, DriverError> {
        let lease_id = match &call.lease {
            LeaseBody::Full(l) => l.lease_id,
            LeaseBody::Id { lease_id } => lease_id,
        };
        let body = Bytes::from(
            serde_json::to_vec(call).map_err(|e| DriverError::Unavailable {
                substrate: self.name.clone(),
                message: format!("cannot encode the {} call: {e}", call.action),
            })?,
        );
        let attempts = self.retries.saturating_add(1);
        let mut last = String::new();
        let mut backoff = Backoff::new(BACKOFF, MAX_BACKOFF);
        for attempt in 0..attempts {
            if attempt > 0 {
                let wait = backoff.next_pause();
                tracing::warn!(
                    substrate = %self.name,
                    lease_id = %lease_id,
                    action = call.action,
                    attempt,
                    error = %last,
                    "webhook call failed; retrying in {wait:?}"
                );
                tokio::time::sleep(wait).await;
            }
            match tokio::time::timeout(self.timeout, self.attempt(body.clone())).await {
                Err(_) => last = format!("no answer within {:?}", self.timeout),
                Ok(Err(e)) => last = e,
                Ok(Ok((status, answer))) if status.is_success() => return Ok(answer),
                Ok(Ok((status, answer)))
                    if status.is_client_error()
                        && status != StatusCode::REQUEST_TIMEOUT
                        && status != StatusCode::TOO_MANY_REQUESTS =>
                {
                    return Err(DriverError::Rejected {
                        substrate: self.name.clone(),
                        message: format!(
                            "the provisioner refused to {} lease {lease_id}: {status}{}",
                            call.action,
                            excerpt(&answer)
                        ),
                    });
                }
                Ok(Ok((status, answer))) => {
                    last = format!("the provisioner answered {status}{}", excerpt(&answer));
                }
            }
        }
        Err(DriverError::Unavailable {
            substrate: self.name.clone(),
            message: format!(
                "{} of lease {lease_id} at {} failed after {attempts} attempt(s): {last}",
                call.action, self.url
            ),
        })
    }

    async fn attempt(&self, body: Bytes) -> Result<(StatusCode, Bytes), String> {
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(self.uri.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(
                USER_AGENT,
                HeaderValue::from_static(concat!("gpuwarden/", env!("CARGO_PKG_VERSION"))),
            );
        if let Some(secret) = &self.secret {
            let timestamp = wall_now_s();
            request = request
                .header(TIMESTAMP_HEADER, timestamp)
                .header(SIGNATURE_HEADER, signature(secret, timestamp, &body));
        }
        let request = request
            .body(Full::new(body))
            .map_err(|e| format!("cannot build the request: {e}"))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| format!("cannot reach {}: {}", self.url, chain(&e)))?;
        let status = response.status();
        let answer = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| format!("cannot read the answer: {e}"))?
            .to_bytes();
        Ok((status, answer))
    }
}

/// An error and its causes on one line: hyper's own message alone is only "client error".
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

/// The start of an answer's body, for error messages.
fn excerpt(answer: &[u8]) -> String {
    let text = String::from_utf8_lossy(answer);
    let text = text.trim();
    if text.is_empty() {
        return String::new();
    }
    let cut: String = text.chars().take(200).collect();
    format!(" ({cut})")
}

#[async_trait::async_trait]
impl Driver for WebhookDriver {
    fn name(&self) -> &str {
        &self.name
    }

    async fn inventory(&self) -> Result<std::sync::Arc<Inventory>, DriverError> {
        Ok(std::sync::Arc::new(Inventory {
            gpus: Vec::new(),
            pooled: vec![(self.model.clone(), self.capacity)],
            queues: false,
        }))
    }

    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.call(&Call {
            action: "provision",
            lease: LeaseBody::Full(FullLease::new(lease)),
            reason: None,
        })
        .await
        .map(drop)
    }

    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.call(&Call {
            action: "resize",
            lease: LeaseBody::Full(FullLease::new(lease)),
            reason: None,
        })
        .await
        .map(drop)
    }

    async fn reclaim(&self, lease_id: &str, reason: ReleaseReason) -> Result<(), DriverError> {
        self.call(&Call {
            action: "reclaim",
            lease: LeaseBody::Id { lease_id },
            reason: Some(reason.as_str()),
        })
        .await
        .map(drop)
    }

    async fn status(&self, lease_id: &str) -> Result<LeaseStatus, DriverError> {
        let answer = self
            .call(&Call {
                action: "status",
                lease: LeaseBody::Id { lease_id },
                reason: None,
            })
            .await?;
        let answer: StatusAnswer =
            serde_json::from_slice(&answer).map_err(|e| DriverError::Unavailable {
                substrate: self.name.clone(),
                message: format!(
                    "the provisioner's status answer for lease {lease_id} is not \
                     {{\"state\": \"running\" | \"exited\" | \"gone\"}}: {e}{}",
                    excerpt(&answer)
                ),
            })?;
        Ok(match answer.state {
            State::Running => LeaseStatus::Running,
            State::Exited => LeaseStatus::Exited(answer.exit_code),
            State::Gone => LeaseStatus::Gone,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_covers_timestamp_and_body() {
        let sig = signature(b"Jefe", 1_700_000_000, b"{}");
        assert!(sig.starts_with("sha256="));
        assert_eq!(sig.len(), "sha256=".len() + 64);
        assert_ne!(sig, signature(b"Jefe", 1_700_000_001, b"{}"));
        assert_ne!(sig, signature(b"Jefe", 1_700_000_000, b"{ }"));
        assert_ne!(sig, signature(b"jefe", 1_700_000_000, b"{}"));
    }

    #[test]
    fn signature_is_hmac_sha256_of_timestamp_dot_body() {
        // RFC 4231 test case 2 checks the primitive; then the signed content is "<ts>.<body>".
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(b"Jefe").expect("any key");
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(b"k").expect("any key");
        mac.update(b"42.body");
        assert_eq!(
            signature(b"k", 42, b"body"),
            format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
        );
    }

    #[test]
    fn retries_wait_as_documented() {
        // 0.1 s, 0.2 s, 0.4 s…, doubling, at most 5 s: the module docs' promise to provisioners.
        let mut backoff = Backoff::new(BACKOFF, MAX_BACKOFF);
        let pauses: Vec<Duration> = (0..9).map(|_| backoff.next_pause()).collect();
        assert_eq!(
            pauses,
            [100, 200, 400, 800, 1_600, 3_200, 5_000, 5_000, 5_000].map(Duration::from_millis)
        );
        // The n-th retry waits BACKOFF·2ⁿ⁻¹, capped, however many retries are configured.
        let mut backoff = Backoff::new(BACKOFF, MAX_BACKOFF);
        for retry in 0..64u32 {
            let doubled = BACKOFF.saturating_mul(1 << retry.min(16)).min(MAX_BACKOFF);
            assert_eq!(backoff.next_pause(), doubled, "retry {retry}");
        }
    }
}
