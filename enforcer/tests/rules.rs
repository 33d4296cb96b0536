//! The runtime rules in process: signals handed to `Rules` as the Kafka consumer hands them, a
//! real SQLite store, a test driver, a manual clock, and a real HTTP server on 127.0.0.1
//! receiving the alerts.

use std::ops::Deref;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{Method, StatusCode};
use axum::Router;
use gpuwarden_enforcer::rules::{steps, Step, Utilization};
use gpuwarden_enforcer::store::LeaseState;
use gpuwarden_schema::config::{
    Config, EnforcerMode, GpuPrice, OnIdle, PricingConfig, Role, TeamConfig, WorkloadPolicy,
};
use gpuwarden_schema::{Signal, SignalBody, Workload, V1};
use serde_json::{json, Value};

mod support;

use support::{call, eventually_async, token, Enforcer};

/// 2026-01-10T00:00:00Z.
const NOW: i64 = 1_768_003_200_000;
const MIN: i64 = 60_000;

fn config(mode: EnforcerMode, webhook: &str) -> Config {
    let mut config = Config {
        pricing: PricingConfig {
            gpu: vec![GpuPrice {
                model_match: "H100".into(),
                usd_per_gpu_hour: 4.0,
            }],
            ..PricingConfig::default()
        },
        teams: vec![TeamConfig {
            name: "ml".into(),
            members: vec!["ada".into()],
            gpu_quota: 16,
            monthly_budget_usd: 1_000.0,
            allowed_models: Vec::new(),
        }],
        tokens: vec![
            token("root", Role::Admin, &[]),
            token("ada", Role::Member, &["ml"]),
        ],
        ..Config::default()
    };
    config.enforcer.mode = mode;
    config.enforcer.alert_webhooks = vec![webhook.to_string()];
    config.pipeline.signals.every = Duration::from_secs(30);
    config.workloads.insert(
        Workload::Notebook,
        WorkloadPolicy {
            max_gpus: Some(2),
            idle_timeout: Some(Duration::from_secs(30 * 60)),
            warn_before: Some(Duration::from_secs(10 * 60)),
            on_idle: OnIdle::Reclaim,
            ..WorkloadPolicy::default()
        },
    );
    config.workloads.insert(
        Workload::Training,
        WorkloadPolicy {
            max_gpus: Some(8),
            idle_timeout: Some(Duration::from_secs(30 * 60)),
            on_idle: OnIdle::Reclaim,
            ..WorkloadPolicy::default()
        },
    );
    config.workloads.insert(
        Workload::Batch,
        WorkloadPolicy {
            max_gpus: Some(4),
            min_gpus: Some(1),
            idle_timeout: Some(Duration::from_secs(10 * 60)),
            on_idle: OnIdle::Resize,
            ..WorkloadPolicy::default()
        },
    );
    config.workloads.insert(
        Workload::Inference,
        WorkloadPolicy {
            min_gpus: Some(1),
            max_gpus: Some(4),
            target_util_pct: Some(60.0),
            ..WorkloadPolicy::default()
        },
    );
    config
}

/// An HTTP server on 127.0.0.1 that keeps every JSON body POSTed to it.
async fn webhook() -> (String, Arc<Mutex<Vec<Value>>>) {
    let got: Arc<Mutex<Vec<Value>>> = Arc::default();
    let keep = got.clone();
    let app = Router::new().route(
        "/hook",
        axum::routing::post(move |axum::Json(body): axum::Json<Value>| {
            let keep = keep.clone();
            async move {
                keep.lock().unwrap().push(body);
                StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{address}/hook"), got)
}

/// An enforcer of 16 GPUs in `mode`, the clock at `NOW`, whose alerts reach the webhook above.
struct Harness {
    enforcer: Enforcer,
    alerts: Arc<Mutex<Vec<Value>>>,
}

impl Deref for Harness {
    type Target = Enforcer;

    fn deref(&self) -> &Enforcer {
        &self.enforcer
    }
}

async fn harness(mode: EnforcerMode) -> Harness {
    let (url, alerts) = webhook().await;
    Harness {
        enforcer: Enforcer::new(config(mode, &url), 16, NOW),
        alerts,
    }
}

impl Harness {
    async fn admit(&self, workload: &str, gpus: u32, duration: &str) -> String {
        let body = json!({"team": "ml", "user": "ada", "project": "p", "workload": workload,
            "gpus": gpus, "duration": duration});
        let (status, answer) = call(
            &self.app,
            Method::POST,
            "/v1/admission",
            Some("ada"),
            Some(body.to_string()),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{answer}");
        assert_eq!(answer["decision"], "admitted", "{answer}");
        answer["lease"]["id"].as_str().unwrap().to_string()
    }

    async fn utilization(&self, lease: &str, util_pct: f64, idle_ms: i64) {
        let current = self.service.store().lease(lease).await.unwrap().unwrap();
        let signal = Signal {
            v: V1,
            ts_ms: self.clock_now(),
            window_ms: 15 * MIN,
            body: SignalBody::LeaseUtilization {
                lease_id: lease.into(),
                team: "ml".into(),
                util_pct,
                idle_ms,
                gpus_active: if idle_ms > 0 { 0 } else { current.gpu_count },
                gpus_total: current.gpu_count,
                mem_used_max_bytes: 0,
                sm_active_pct: None,
                idle_measure: None,
            },
        };
        self.rules.on_signal(&signal).await.unwrap();
    }

    fn clock_now(&self) -> i64 {
        self.service.now()
    }

    fn advance(&self, ms: i64) {
        self.clock.advance(Duration::from_millis(ms as u64));
    }

    async fn state_of(&self, lease: &str) -> LeaseState {
        self.service
            .store()
            .lease(lease)
            .await
            .unwrap()
            .unwrap()
            .state
    }

    /// Every Action recorded so far, oldest first.
    async fn actions(&self) -> Vec<Value> {
        let rows = self.service.store().outbox_pending(10_000).await.unwrap();
        rows.iter()
            .filter(|r| r.topic == "gpuwarden.actions")
            .map(|r| serde_json::from_str(&r.payload).unwrap())
            .collect()
    }

    async fn actions_of(&self, lease: &str) -> Vec<(String, String, String)> {
        self.actions()
            .await
            .into_iter()
            .filter(|a| a["lease_id"] == lease)
            .map(|a| {
                (
                    a["action"].as_str().unwrap().to_string(),
                    a["reason"].as_str().unwrap().to_string(),
                    a["outcome"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    /// The alerts the webhook received, once there are `n` (up to 5 s).
    async fn alerts_received(&self, n: usize) -> Vec<Value> {
        eventually_async(
            &format!("{n} alerts at the webhook"),
            Duration::from_secs(5),
            async || {
                let alerts = self.alerts.lock().unwrap().clone();
                if alerts.len() >= n {
                    Ok(alerts)
                } else {
                    Err(format!("{alerts:?}"))
                }
            },
        )
        .await
    }
}

fn owned(v: &[(&str, &str, &str)]) -> Vec<(String, String, String)> {
    v.iter()
        .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
        .collect()
}

#[tokio::test]
async fn an_idle_notebook_is_warned_then_reclaimed_while_a_busy_training_lease_is_left_alone() {
    let h = harness(EnforcerMode::Enforce).await;
    let notebook = h.admit("notebook", 1, "8h").await;
    let training = h.admit("training", 2, "8h").await;

    // 15 min idle: before the warning (30 min timeout, warned 10 min before).
    h.advance(15 * MIN);
    h.utilization(&notebook, 0.0, 15 * MIN).await;
    h.utilization(&training, 92.0, 0).await;
    assert_eq!(
        h.actions_of(&notebook).await,
        owned(&[("admit", "admitted", "ok")])
    );

    // 21 min: warned, once, however often the signal repeats.
    h.advance(6 * MIN);
    h.utilization(&notebook, 0.0, 21 * MIN).await;
    h.advance(MIN / 2);
    h.utilization(&notebook, 0.0, 21 * MIN + MIN / 2).await;
    assert_eq!(
        h.actions_of(&notebook).await,
        owned(&[("admit", "admitted", "ok"), ("alert", "idle_warning", "ok")])
    );
    let alerts = h.alerts_received(1).await;
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    let text = alerts[0]["text"].as_str().unwrap();
    assert!(
        text.contains(&notebook) && text.contains("reclaimed"),
        "{text}"
    );
    assert_eq!(alerts[0]["gpuwarden"]["reason"], "idle_warning");

    // 30 min: reclaimed with reason idle; the repeated signal changes nothing more.
    h.advance(9 * MIN);
    h.utilization(&notebook, 0.0, 30 * MIN + MIN / 2).await;
    h.utilization(&training, 88.0, 0).await;
    assert_eq!(h.state_of(&notebook).await, LeaseState::Released);
    let lease = h.service.store().lease(&notebook).await.unwrap().unwrap();
    assert_eq!(lease.release_reason.unwrap().as_str(), "idle");
    h.advance(MIN / 2);
    h.utilization(&notebook, 0.0, 31 * MIN).await;
    assert_eq!(
        h.actions_of(&notebook).await,
        owned(&[
            ("admit", "admitted", "ok"),
            ("alert", "idle_warning", "ok"),
            ("reclaim", "idle", "ok"),
        ])
    );
    assert_eq!(h.state_of(&training).await, LeaseState::Active);
    assert_eq!(
        h.actions_of(&training).await,
        owned(&[("admit", "admitted", "ok")])
    );
    let calls = h.driver.calls.lock().unwrap().clone();
    assert_eq!(
        calls.iter().filter(|c| c.starts_with("reclaim")).count(),
        1,
        "{calls:?}"
    );
}

#[tokio::test]
async fn an_idle_lease_whose_policy_resizes_shrinks_to_its_minimum_once() {
    let h = harness(EnforcerMode::Enforce).await;
    let batch = h.admit("batch", 4, "8h").await;
    h.advance(11 * MIN);
    h.utilization(&batch, 0.0, 11 * MIN).await;
    let lease = h.service.store().lease(&batch).await.unwrap().unwrap();
    assert_eq!((lease.state, lease.gpu_count), (LeaseState::Active, 1));
    // Still idle on its one GPU: at the minimum, an alert once, and nothing more.
    h.advance(MIN);
    h.utilization(&batch, 0.0, 12 * MIN).await;
    h.advance(MIN);
    h.utilization(&batch, 0.0, 13 * MIN).await;
    assert_eq!(
        h.actions_of(&batch).await,
        owned(&[
            ("admit", "admitted", "ok"),
            ("resize", "idle", "ok"),
            ("alert", "idle", "ok"),
        ])
    );
    assert_eq!(*h.driver.calls.lock().unwrap(), ["provision 4", "resize 1"]);
}

#[tokio::test]
async fn an_older_signal_than_one_handled_is_ignored() {
    let h = harness(EnforcerMode::Enforce).await;
    let notebook = h.admit("notebook", 1, "8h").await;
    h.advance(40 * MIN);
    h.utilization(&notebook, 50.0, 0).await;
    // A late signal from before, saying it was idle for 35 min: stale, not acted on.
    let signal = Signal {
        v: V1,
        ts_ms: NOW + 39 * MIN,
        window_ms: 15 * MIN,
        body: SignalBody::LeaseUtilization {
            lease_id: notebook.clone(),
            team: "ml".into(),
            util_pct: 0.0,
            idle_ms: 35 * MIN,
            gpus_active: 0,
            gpus_total: 1,
            mem_used_max_bytes: 0,
            sm_active_pct: None,
            idle_measure: None,
        },
    };
    h.rules.on_signal(&signal).await.unwrap();
    assert_eq!(h.state_of(&notebook).await, LeaseState::Active);
}

#[tokio::test]
async fn a_team_over_budget_is_blocked_and_denied_then_unblocked_in_the_next_month() {
    let h = harness(EnforcerMode::Enforce).await;
    let spend = |usd: f64, ts_ms: i64| Signal {
        v: V1,
        ts_ms,
        window_ms: 15 * MIN,
        body: SignalBody::TeamSpend {
            team: "ml".into(),
            month_to_date_usd: usd,
            burn_usd_per_hour: 0.0,
        },
    };
    h.rules.on_signal(&spend(400.0, NOW)).await.unwrap();
    assert!(h.actions().await.is_empty());
    h.rules.on_signal(&spend(1_000.5, NOW + MIN)).await.unwrap();
    let actions = h.actions().await;
    let kinds: Vec<(&str, &str)> = actions
        .iter()
        .map(|a| (a["action"].as_str().unwrap(), a["reason"].as_str().unwrap()))
        .collect();
    assert_eq!(
        kinds,
        [("block", "budget_exceeded"), ("alert", "budget_exceeded")]
    );
    let alerts = h.alerts_received(1).await;
    assert!(
        alerts[0]["text"].as_str().unwrap().contains("*ml*"),
        "{alerts:?}"
    );

    let body = json!({"team": "ml", "user": "ada", "project": "p", "workload": "training", "gpus": 1, "duration": "1h"});
    let (status, answer) = call(
        &h.app,
        Method::POST,
        "/v1/admission",
        Some("ada"),
        Some(body.to_string()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer["decision"], "denied");
    let codes: Vec<&str> = answer["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["code"].as_str().unwrap())
        .collect();
    assert!(codes.contains(&"team_blocked"), "{answer}");
    assert!(codes.contains(&"budget_exceeded"), "{answer}");
    // The same spend again changes nothing.
    h.rules
        .on_signal(&spend(1_001.0, NOW + 2 * MIN))
        .await
        .unwrap();
    assert_eq!(h.actions().await.len(), 3, "{:?}", h.actions().await); // + the deny

    // February: last month's spend says nothing of this one.
    h.clock.set(1_769_904_000_000 + MIN);
    h.rules.check_budgets().await.unwrap();
    let last = h.actions().await.pop().unwrap();
    assert_eq!(last["action"], "unblock");
    let (_, answer) = call(
        &h.app,
        Method::POST,
        "/v1/admission",
        Some("ada"),
        Some(body.to_string()),
    )
    .await;
    assert_eq!(answer["decision"], "admitted", "{answer}");
}

/// Month-to-date spend only grows. A `team_spend` figure can still come in below what the
/// enforcer has already counted: it is read from the rollups, which lag the signal's time (an
/// open lease is allocated up to the rollups' watermark), and a period may be computed again
/// (a standby taking over publishing) from rollups read at another time. Such a figure must not
/// lower the team's spend, or a team just over its budget is unblocked by one signal and
/// blocked again by the next: two `block` actions for one decision.
#[tokio::test]
async fn a_lagging_or_recomputed_team_spend_does_not_unblock_and_block_a_team_again() {
    let h = harness(EnforcerMode::Enforce).await;
    let spend = |usd: f64, ts_ms: i64| Signal {
        v: V1,
        ts_ms,
        window_ms: 15 * MIN,
        body: SignalBody::TeamSpend {
            team: "ml".into(),
            month_to_date_usd: usd,
            burn_usd_per_hour: 0.0,
        },
    };
    let budget_steps = || async {
        h.actions()
            .await
            .iter()
            .filter(|a| a["team"] == "ml" && a["lease_id"].is_null())
            .map(|a| {
                format!(
                    "{}|{}",
                    a["action"].as_str().unwrap(),
                    a["reason"].as_str().unwrap()
                )
            })
            .collect::<Vec<_>>()
    };
    // 8 GPUs for an hour cost more than the 10 $ left: the enforcer's own count blocks ml.
    h.admit("training", 8, "8h").await;
    h.rules.on_signal(&spend(990.0, NOW)).await.unwrap();
    h.advance(60 * MIN);
    h.rules.check_budgets().await.unwrap();
    assert_eq!(
        budget_steps().await,
        ["block|budget_exceeded", "alert|budget_exceeded"]
    );

    // The next period's figure, from rollups that have counted only part of that hour.
    h.rules
        .on_signal(&spend(995.0, NOW + 60 * MIN))
        .await
        .unwrap();
    // The same period again, computed from rollups read earlier still.
    h.rules
        .on_signal(&spend(991.0, NOW + 60 * MIN))
        .await
        .unwrap();
    h.rules.check_budgets().await.unwrap();
    // The rollups catch up; a later period is above the budget as before.
    h.advance(MIN);
    h.rules
        .on_signal(&spend(1_020.0, NOW + 61 * MIN))
        .await
        .unwrap();
    h.rules
        .on_signal(&spend(1_020.0, NOW + 61 * MIN))
        .await
        .unwrap();
    assert_eq!(
        budget_steps().await,
        ["block|budget_exceeded", "alert|budget_exceeded"],
        "one decision, one block"
    );
    let (_, team) = call(&h.app, Method::GET, "/v1/teams/ml", Some("root"), None).await;
    assert_eq!(team["blocked"], true, "{team}");
    assert!(
        team["month_to_date_usd"].as_f64().unwrap() >= 1_020.0,
        "{team}"
    );
}

#[tokio::test]
async fn an_inference_lease_scales_down_when_its_load_drops_and_up_when_it_rises() {
    let h = harness(EnforcerMode::Enforce).await;
    let lease = h.admit("inference", 4, "8h").await;
    let gpus = || async {
        h.service
            .store()
            .lease(&lease)
            .await
            .unwrap()
            .unwrap()
            .gpu_count
    };
    // Too soon after the grant to judge the size: the window (15 min) has not measured it yet.
    h.advance(10 * MIN);
    h.utilization(&lease, 10.0, 0).await;
    assert_eq!(gpus().await, 4);
    // Load 20 % on 4 GPUs toward 60 %: 2 GPUs.
    h.advance(5 * MIN);
    h.utilization(&lease, 20.0, 0).await;
    let now = h.service.store().lease(&lease).await.unwrap().unwrap();
    assert_eq!(now.gpu_count, 2);
    assert_eq!(now.gpu_uuids.len(), 2);
    // Load rises to 100 % on 2: ⌈2 × 100 / 60⌉ = 4, but not before a window has measured 2.
    h.advance(10 * MIN);
    h.utilization(&lease, 100.0, 0).await;
    assert_eq!(gpus().await, 2);
    h.advance(5 * MIN);
    h.utilization(&lease, 100.0, 0).await;
    assert_eq!(gpus().await, 4);
    // Never past max_gpus; near the target, left alone.
    h.advance(20 * MIN);
    h.utilization(&lease, 100.0, 0).await;
    assert_eq!(gpus().await, 4);
    h.advance(20 * MIN);
    h.utilization(&lease, 57.0, 0).await;
    assert_eq!(gpus().await, 4);
    assert_eq!(
        h.actions_of(&lease).await,
        owned(&[
            ("admit", "admitted", "ok"),
            ("resize", "autoscale", "ok"),
            ("resize", "autoscale", "ok"),
        ])
    );
    let calls = h.driver.calls.lock().unwrap().clone();
    assert_eq!(calls, ["provision 4", "resize 2", "resize 4"]);
}

#[tokio::test]
async fn dry_run_records_every_step_once_and_changes_nothing() {
    let h = harness(EnforcerMode::DryRun).await;
    let notebook = h.admit("notebook", 1, "1h").await;
    h.advance(31 * MIN);
    h.utilization(&notebook, 0.0, 31 * MIN).await;
    h.advance(MIN / 2);
    h.utilization(&notebook, 0.0, 31 * MIN + MIN / 2).await;
    assert_eq!(h.state_of(&notebook).await, LeaseState::Active);
    // Past its end too.
    h.advance(30 * MIN);
    h.service.expire_due().await.unwrap();
    h.service.expire_due().await.unwrap();
    assert_eq!(h.state_of(&notebook).await, LeaseState::Active);
    assert_eq!(
        h.actions_of(&notebook).await,
        owned(&[
            ("admit", "admitted", "ok"),
            ("reclaim", "idle", "dry_run"),
            ("reclaim", "expired", "dry_run"),
        ])
    );
    let spend = Signal {
        v: V1,
        ts_ms: h.clock_now(),
        window_ms: 15 * MIN,
        body: SignalBody::TeamSpend {
            team: "ml".into(),
            month_to_date_usd: 5_000.0,
            burn_usd_per_hour: 4.0,
        },
    };
    h.rules.on_signal(&spend).await.unwrap();
    h.rules.on_signal(&spend).await.unwrap();
    let blocks: Vec<Value> = h
        .actions()
        .await
        .into_iter()
        .filter(|a| a["action"] == "block")
        .collect();
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0]["outcome"], "dry_run");
    assert!(!h
        .service
        .store()
        .ledger(h.clock_now(), &h.service.config().pricing)
        .unwrap()
        .blocked
        .contains("ml"));
    assert_eq!(*h.driver.calls.lock().unwrap(), ["provision 1"]);
    // An alert that is never sent cannot be waited for: the time one would take to arrive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        h.alerts.lock().unwrap().is_empty(),
        "a dry run sends nothing"
    );
}

#[tokio::test]
async fn a_reclaim_the_substrate_keeps_refusing_is_retried_then_the_lease_fails_with_an_alert() {
    let h = harness(EnforcerMode::Enforce).await;
    let notebook = h.admit("notebook", 1, "8h").await;
    h.driver.fail_reclaim.store(true, Ordering::Relaxed);
    h.advance(31 * MIN);
    h.utilization(&notebook, 0.0, 31 * MIN).await;
    let calls = h.driver.calls.lock().unwrap().clone();
    assert_eq!(
        calls.iter().filter(|c| *c == "reclaim idle").count(),
        gpuwarden_enforcer::rules::RECLAIM_ATTEMPTS as usize
    );
    assert_eq!(h.state_of(&notebook).await, LeaseState::Failed);
    assert_eq!(
        h.actions_of(&notebook).await,
        owned(&[
            ("admit", "admitted", "ok"),
            ("reclaim", "failed", "failed"),
            ("alert", "reclaim_failed", "ok"),
        ])
    );
    let alerts = h.alerts_received(1).await;
    assert_eq!(alerts[0]["gpuwarden"]["reason"], "reclaim_failed");
}

#[tokio::test]
async fn only_an_admin_exempts_a_lease_and_an_exempt_lease_is_not_reclaimed() {
    let h = harness(EnforcerMode::Enforce).await;
    let notebook = h.admit("notebook", 1, "8h").await;
    let uri = format!("/v1/leases/{notebook}/exempt");
    let body = json!({"duration": "2h", "reason": "demo rehearsal"}).to_string();
    let (status, answer) = call(&h.app, Method::POST, &uri, Some("ada"), Some(body.clone())).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{answer}");
    let (status, answer) = call(
        &h.app,
        Method::POST,
        &uri,
        Some("root"),
        Some(json!({"duration": "2h", "reason": " "}).to_string()),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{answer}");
    assert_eq!(answer["error"]["field"], "reason", "{answer}");
    let (status, answer) = call(&h.app, Method::POST, &uri, Some("root"), Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{answer}");

    h.advance(45 * MIN);
    h.utilization(&notebook, 0.0, 45 * MIN).await;
    assert_eq!(h.state_of(&notebook).await, LeaseState::Active);
    let exempt = h
        .actions()
        .await
        .into_iter()
        .find(|a| a["reason"] == "exempt")
        .unwrap();
    assert_eq!(exempt["action"], "alert");
    // Named as the rules name the policy they exempt it from.
    assert_eq!(exempt["policy"], "workloads.notebook", "{exempt}");
    let detail = exempt["detail"].as_str().unwrap();
    assert!(
        detail.contains("root") && detail.contains("demo rehearsal"),
        "{detail}"
    );

    // Once the exemption ends, the rules apply again.
    h.advance(80 * MIN);
    h.utilization(&notebook, 0.0, 125 * MIN).await;
    assert_eq!(h.state_of(&notebook).await, LeaseState::Released);
}

/// A `lease_utilization` signal about `lease` at `ts_ms`, idle for `idle_ms`.
fn utilization_at(lease: &str, ts_ms: i64, util_pct: f64, idle_ms: i64) -> Signal {
    Signal {
        v: V1,
        ts_ms,
        window_ms: 15 * MIN,
        body: SignalBody::LeaseUtilization {
            lease_id: lease.into(),
            team: "ml".into(),
            util_pct,
            idle_ms,
            gpus_active: if idle_ms > 0 { 0 } else { 2 },
            gpus_total: 2,
            mem_used_max_bytes: 0,
            sm_active_pct: None,
            idle_measure: None,
        },
    }
}

/// An old idle signal replayed after the enforcer restarted (anyone who can write the topic can
/// replay a signed record) is as old as it was before the restart: ignored, not a reclaim of a
/// lease that has been busy since.
#[tokio::test]
async fn an_old_idle_signal_replayed_after_a_restart_does_not_reclaim_a_busy_lease() {
    let h = harness(EnforcerMode::Enforce).await;
    let training = h.admit("training", 2, "8h").await;
    h.advance(45 * MIN);
    // Idle for 40 minutes five minutes ago, busy now: signals handled newest first (the older
    // one delayed in Kafka, or replayed).
    let busy = utilization_at(&training, h.clock_now(), 95.0, 0);
    let idle = utilization_at(&training, h.clock_now() - 5 * MIN, 0.0, 40 * MIN);
    h.rules.on_signal(&busy).await.unwrap();
    h.rules.on_signal(&idle).await.unwrap();
    assert_eq!(h.state_of(&training).await, LeaseState::Active);

    let h = Harness {
        enforcer: h.enforcer.restart(),
        alerts: h.alerts,
    };
    h.rules.on_signal(&idle).await.unwrap();
    assert_eq!(h.state_of(&training).await, LeaseState::Active);
    assert_eq!(
        h.actions_of(&training).await,
        owned(&[("admit", "admitted", "ok")])
    );
    assert_eq!(
        h.driver.calls.lock().unwrap().len(),
        1,
        "only the provision"
    );
    // A newer one is acted on as ever.
    h.advance(MIN);
    let idle_now = utilization_at(&training, h.clock_now(), 0.0, 31 * MIN);
    h.rules.on_signal(&idle_now).await.unwrap();
    assert_eq!(h.state_of(&training).await, LeaseState::Released);
}

/// A signal dated more than pipeline.clock.max_skew (5 min) ahead of the enforcer's clock is
/// refused and counted, and not kept as the lease's newest: the true signals after it, dated
/// before it, are acted on as ever, also after a restart.
#[tokio::test]
async fn a_signal_dated_past_max_skew_ahead_is_refused_and_does_not_shut_out_true_ones() {
    let h = harness(EnforcerMode::Enforce).await;
    let training = h.admit("training", 2, "8h").await;
    h.advance(45 * MIN);
    let ahead = utilization_at(&training, h.clock_now() + 6 * MIN, 95.0, 0);
    h.rules.on_signal(&ahead).await.unwrap();
    assert_eq!(h.rules.metrics().future_signals(), 1);
    assert!(h
        .rules
        .metrics()
        .render()
        .contains("gpuwarden_enforcer_signals_future_total 1\n"));
    // Within the bound it is taken: a clock a little ahead is not refused.
    let near = utilization_at(&training, h.clock_now() + 5 * MIN, 95.0, 0);
    h.rules.on_signal(&near).await.unwrap();
    assert_eq!(h.rules.metrics().future_signals(), 1);

    let h = Harness {
        enforcer: h.enforcer.restart(),
        alerts: h.alerts,
    };
    h.rules.on_signal(&ahead).await.unwrap();
    assert_eq!(h.state_of(&training).await, LeaseState::Active);
    // The true signals catch up with the one near the bound, and are acted on after it.
    h.advance(6 * MIN);
    let idle_now = utilization_at(&training, h.clock_now(), 0.0, 31 * MIN);
    h.rules.on_signal(&idle_now).await.unwrap();
    assert_eq!(h.state_of(&training).await, LeaseState::Released);
}

#[tokio::test]
async fn a_busy_gpu_no_lease_holds_is_alerted_once_an_hour() {
    let h = harness(EnforcerMode::Enforce).await;
    let signal = |ts_ms: i64| Signal {
        v: V1,
        ts_ms,
        window_ms: 15 * MIN,
        body: SignalBody::GpuUnattributed {
            gpu_uuid: "GPU-07".into(),
            host: "h1".into(),
            util_pct: 87.0,
        },
    };
    for i in 0..4 {
        h.rules.on_signal(&signal(NOW + i * MIN / 2)).await.unwrap();
    }
    h.rules.on_signal(&signal(NOW + 61 * MIN)).await.unwrap();
    let alerts: Vec<Value> = h
        .actions()
        .await
        .into_iter()
        .filter(|a| a["reason"] == "unattributed")
        .collect();
    assert_eq!(alerts.len(), 2);
    assert!(alerts[0]["detail"]
        .as_str()
        .unwrap()
        .contains("GPU-07 on h1"));
    assert_eq!(h.alerts_received(2).await.len(), 2);
}

#[test]
fn the_rules_decide_from_idle_time_policy_and_load() {
    let lease = |workload, gpus| gpuwarden_enforcer::store::Lease {
        workload,
        gpu_model: "H100".into(),
        gpu_count: gpus,
        state: LeaseState::Active,
        ..support::lease("L", "sim")
    };
    let config = config(EnforcerMode::Enforce, "http://127.0.0.1:9/");
    let notebook = config.workload(Workload::Notebook);
    let util = |idle_ms, util_pct, gpus_total| Utilization {
        ts_ms: 100 * MIN,
        util_pct,
        idle_ms,
        gpus_total,
    };
    let nb = lease(Workload::Notebook, 1);
    assert_eq!(steps(&nb, &notebook, &util(0, 50.0, 1), false, true), []);
    assert_eq!(
        steps(&nb, &notebook, &util(19 * MIN, 0.0, 1), false, true),
        []
    );
    assert_eq!(
        steps(&nb, &notebook, &util(20 * MIN, 0.0, 1), false, true),
        [Step::IdleWarning {
            run_start: 80 * MIN,
            deadline_ms: 110 * MIN
        }]
    );
    assert_eq!(
        steps(&nb, &notebook, &util(30 * MIN, 0.0, 1), false, true),
        [Step::Idle {
            run_start: 70 * MIN,
            on_idle: OnIdle::Reclaim,
            min_gpus: 1
        }]
    );
    assert_eq!(
        steps(&nb, &notebook, &util(30 * MIN, 0.0, 1), true, true),
        []
    );

    let inference = config.workload(Workload::Inference);
    let inf = lease(Workload::Inference, 2);
    assert_eq!(steps(&inf, &inference, &util(0, 60.0, 2), false, true), []);
    // Within 10 % of the target: left alone.
    assert_eq!(steps(&inf, &inference, &util(0, 65.0, 2), false, true), []);
    assert_eq!(steps(&inf, &inference, &util(0, 55.0, 2), false, true), []);
    assert_eq!(
        steps(&inf, &inference, &util(0, 67.0, 2), false, true),
        [Step::Autoscale { gpus: 3 }]
    );
    assert_eq!(
        steps(&inf, &inference, &util(0, 100.0, 2), false, true),
        [Step::Autoscale { gpus: 4 }]
    );
    assert_eq!(
        steps(&inf, &inference, &util(0, 5.0, 2), false, true),
        [Step::Autoscale { gpus: 1 }]
    );
    // Not measured long enough, or measured at another size: no change.
    assert_eq!(
        steps(&inf, &inference, &util(0, 100.0, 2), false, false),
        []
    );
    assert_eq!(steps(&inf, &inference, &util(0, 100.0, 3), false, true), []);
    // Training never autoscales.
    let tr = lease(Workload::Training, 2);
    assert_eq!(
        steps(
            &tr,
            &config.workload(Workload::Training),
            &util(0, 100.0, 2),
            false,
            true
        ),
        []
    );
}

#[tokio::test]
async fn a_host_with_a_wrong_clock_is_alerted_once_a_day_and_changes_nothing_else() {
    let h = harness(EnforcerMode::Enforce).await;
    const DAY: i64 = 24 * 60 * MIN;
    let signal = |host: &str, ts_ms: i64, skew_ms: i64| Signal {
        v: V1,
        ts_ms,
        window_ms: MIN / 2,
        body: SignalBody::ClockSkew {
            host: host.into(),
            skew_ms,
        },
    };
    // Reported every 30 s while the host's samples keep arriving 400 days ahead.
    for i in 0..10 {
        h.rules
            .on_signal(&signal("h1", NOW + i * MIN / 2, 400 * DAY))
            .await
            .unwrap();
    }
    h.rules
        .on_signal(&signal("h2", NOW, -3 * DAY))
        .await
        .unwrap();
    let alerts: Vec<Value> = h
        .actions()
        .await
        .into_iter()
        .filter(|a| a["reason"] == "clock_skew")
        .collect();
    assert_eq!(alerts.len(), 2, "{alerts:#?}");
    let detail = |i: usize| alerts[i]["detail"].as_str().unwrap().to_string();
    assert!(
        detail(0).contains("host h1 runs 400d ahead of gpuwarden's"),
        "{}",
        detail(0)
    );
    assert!(
        detail(1).contains("host h2 runs 3d behind"),
        "{}",
        detail(1)
    );
    assert_eq!(alerts[0]["action"], "alert");
    assert!(alerts[0]["team"].is_null() && alerts[0]["lease_id"].is_null());
    let received = h.alerts_received(2).await;
    assert_eq!(received.len(), 2);
    // Nothing else was done: no block, no reclaim.
    assert!(h
        .actions()
        .await
        .iter()
        .all(|a| a["reason"] == "clock_skew"));
}
