//! What the enforcer's integration tests share: a substrate driver that records its calls and
//! fails on demand, and API tokens.

#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use gpuwarden_enforcer::drivers::{Driver, DriverError, Gpu, Inventory, LeaseSpec, LeaseStatus};
use gpuwarden_schema::config::{Role, TokenConfig};
use gpuwarden_schema::ReleaseReason;
use http_body_util::BodyExt;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tower::ServiceExt;

/// A substrate of `gpus` H100s on hosts of four; `fail_*` make its calls fail.
#[derive(Debug, Default)]
pub(crate) struct TestDriver {
    pub(crate) gpus: u32,
    pub(crate) fail_provision: AtomicBool,
    pub(crate) fail_resize: AtomicBool,
    pub(crate) fail_reclaim: AtomicBool,
    pub(crate) calls: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl Driver for TestDriver {
    fn name(&self) -> &str {
        "sim"
    }
    async fn inventory(&self) -> Result<Arc<Inventory>, DriverError> {
        Ok(Arc::new(Inventory {
            gpus: (0..self.gpus)
                .map(|i| Gpu {
                    uuid: format!("GPU-{i:02}"),
                    host: format!("h{}", i / 4),
                    index: i % 4,
                    model: "NVIDIA H100 80GB HBM3".into(),
                })
                .collect(),
            pooled: Vec::new(),
        }))
    }
    async fn provision(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("provision {}", lease.gpu_count));
        if self.fail_provision.load(Ordering::Relaxed) {
            return Err(DriverError::Unavailable {
                substrate: "sim".into(),
                message: "the fleet is down".into(),
            });
        }
        Ok(())
    }
    async fn resize(&self, lease: &LeaseSpec) -> Result<(), DriverError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("resize {}", lease.gpu_count));
        if self.fail_resize.load(Ordering::Relaxed) {
            return Err(DriverError::Unavailable {
                substrate: "sim".into(),
                message: "the fleet is down".into(),
            });
        }
        Ok(())
    }
    async fn reclaim(&self, _: &str, reason: ReleaseReason) -> Result<(), DriverError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("reclaim {}", reason.as_str()));
        if self.fail_reclaim.load(Ordering::Relaxed) {
            return Err(DriverError::Unavailable {
                substrate: "sim".into(),
                message: "the fleet is down".into(),
            });
        }
        Ok(())
    }
    async fn status(&self, _: &str) -> Result<LeaseStatus, DriverError> {
        Ok(LeaseStatus::Running)
    }
}

pub(crate) fn token(name: &str, role: Role, teams: &[&str]) -> TokenConfig {
    TokenConfig {
        name: name.into(),
        sha256: Sha256::digest(format!("tok-{name}"))
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
        role,
        teams: teams.iter().map(|t| t.to_string()).collect(),
    }
}

/// Calls the API as `who` (token `tok-<who>`); the answer's status and JSON body.
pub(crate) async fn call(
    app: &Router,
    method: Method,
    uri: &str,
    who: Option<&str>,
    body: Option<String>,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(who) = who {
        req = req.header("authorization", format!("Bearer tok-{who}"));
    }
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Body::from(b)
        }
        None => Body::empty(),
    };
    let response = app.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, value)
}
