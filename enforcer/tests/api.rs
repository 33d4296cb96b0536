//! The admission API in process: the axum `Router` driven with `tower::ServiceExt::oneshot`, a
//! real SQLite store in a temp dir, and a test driver standing in for a substrate.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use gpuwarden_enforcer::api::openapi_json;
use gpuwarden_schema::config::{
    Config, EnforcerConfig, GpuPrice, PricingConfig, Role, TeamConfig, WorkloadPolicy,
};
use gpuwarden_schema::Workload;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

mod support;

use support::{call, token, Enforcer};

const NOW: i64 = 1_767_225_600_000;

fn config() -> Config {
    let team = |name: &str, members: &[&str]| TeamConfig {
        name: name.into(),
        members: members.iter().map(|m| m.to_string()).collect(),
        gpu_quota: 16,
        monthly_budget_usd: 10_000.0,
        allowed_models: Vec::new(),
    };
    let mut config = Config {
        pricing: PricingConfig {
            gpu: vec![GpuPrice {
                model_match: "H100".into(),
                usd_per_gpu_hour: 4.0,
            }],
            ..PricingConfig::default()
        },
        teams: vec![team("ml", &["ada", "bob"]), team("cv", &["eve"])],
        enforcer: EnforcerConfig {
            max_request_bytes: 1024,
            ..EnforcerConfig::default()
        },
        tokens: vec![
            token("root", Role::Admin, &[]),
            token("ada", Role::Member, &["ml"]),
            token("portal", Role::Service, &["ml"]),
            token("watcher", Role::Viewer, &["ml"]),
            token("eve", Role::Member, &["cv"]),
        ],
        ..Config::default()
    };
    config.workloads.insert(
        Workload::Training,
        WorkloadPolicy {
            max_gpus: Some(8),
            max_duration: Some(Duration::from_secs(4 * 3600)),
            ..WorkloadPolicy::default()
        },
    );
    config
}

/// The enforcer every test here drives: the config above, 32 GPUs, the clock at `NOW`.
fn harness() -> Enforcer {
    Enforcer::new(config(), 32, NOW)
}

fn ask(team: &str, user: &str, gpus: i64) -> Value {
    json!({"team": team, "user": user, "project": "llm", "workload": "training", "gpus": gpus, "duration": "2h"})
}

async fn admit(app: &Router, who: &str, body: Value) -> (StatusCode, Value) {
    call(
        app,
        Method::POST,
        "/v1/admission",
        Some(who),
        Some(body.to_string()),
    )
    .await
}

#[tokio::test]
async fn admission_creates_provisions_and_publishes_a_lease() {
    let h = harness();
    let (status, body) = admit(&h.app, "ada", ask("ml", "ada", 2)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["decision"], "admitted");
    assert_eq!(body["reasons"], json!([]));
    assert_eq!(
        body["estimate"],
        json!({"usd_per_hour": 8.0, "max_usd": 16.0, "gpu_model": "NVIDIA H100 80GB HBM3"})
    );
    let lease = &body["lease"];
    assert_eq!(lease["state"], "active");
    assert_eq!(lease["gpu_count"], 2);
    assert_eq!(lease["gpu_uuids"].as_array().unwrap().len(), 2);
    assert_eq!(lease["expires_at"], NOW + 2 * 3_600_000);
    assert_eq!(*h.driver.calls.lock().unwrap(), vec!["provision 2"]);

    let rows = h.service.store().outbox_pending(10).await.unwrap();
    let topics: Vec<&str> = rows.iter().map(|r| r.topic.as_str()).collect();
    assert_eq!(topics, ["gpuwarden.leases", "gpuwarden.actions"]);
    let event: Value = serde_json::from_str(&rows[0].payload).unwrap();
    assert_eq!(event["event"], "granted");
    assert_eq!(event["lease_id"], lease["id"]);

    let (_, team) = call(&h.app, Method::GET, "/v1/teams/ml", Some("watcher"), None).await;
    assert_eq!(team["gpus_held"], 2);
    assert_eq!(team["gpu_quota"], 16);
    assert_eq!(team["blocked"], false);
    assert_eq!(
        h.service
            .metrics()
            .render()
            .lines()
            .find(|l| l.contains("admitted"))
            .unwrap(),
        "gpuwarden_enforcer_admissions_total{decision=\"admitted\"} 1"
    );
    // The admission was committed (its Pending awaited), so the store has counted it.
    let commits = h.service.store().commit_stats();
    assert!(
        commits.commits >= 1 && commits.writes >= commits.commits,
        "{commits:?}"
    );
    let text = h.service.metrics().render_with(commits);
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    assert_eq!(
        value("gpuwarden_enforcer_store_commits_total"),
        commits.commits
    );
    assert_eq!(
        value("gpuwarden_enforcer_store_writes_total"),
        commits.writes
    );
}

/// `POST /v1/admission` with an `Idempotency-Key` header (`value` as sent).
async fn admit_keyed(app: &Router, who: &str, body: Value, value: &str) -> (StatusCode, Value) {
    let req = Request::post("/v1/admission")
        .header("authorization", format!("Bearer tok-{who}"))
        .header("content-type", "application/json")
        .header("idempotency-key", value)
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap())
}

/// A client that lost an answer asks again with the same Idempotency-Key and is answered with
/// the lease it was admitted as, provisioned once; a bad key is refused naming the header, a key
/// reused for another request or after its lease ended is a 409 naming the lease.
#[tokio::test]
async fn a_retry_with_its_idempotency_key_is_answered_with_the_same_lease() {
    let h = harness();
    let key = "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"";
    let (status, first) = admit_keyed(&h.app, "ada", ask("ml", "ada", 2), key).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let id = first["lease"]["id"].clone();
    // The quotes are the header's own (a structured-field string): the same key without them.
    let (status, again) = admit_keyed(
        &h.app,
        "ada",
        ask("ml", "ada", 2),
        "8e03978e-40d5-43e8-bc93-6894a57f9324",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(again["decision"], "admitted");
    assert_eq!(again["lease"]["id"], id);
    assert_eq!(again["lease"]["state"], "active");
    assert_eq!(*h.driver.calls.lock().unwrap(), vec!["provision 2"]);
    let (_, team) = call(&h.app, Method::GET, "/v1/teams/ml", Some("watcher"), None).await;
    assert_eq!(team["gpus_held"], 2);

    // The same request sent eight times at once with one key (a client that retried while its
    // first try was still being started): one lease, every try answered with it.
    let tries: Vec<_> = (0..8)
        .map(|_| {
            let app = h.app.clone();
            tokio::spawn(
                async move { admit_keyed(&app, "ada", ask("ml", "ada", 1), "at-once").await },
            )
        })
        .collect();
    let mut ids = std::collections::BTreeSet::new();
    for t in tries {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["lease"]["state"], "active", "{body}");
        ids.insert(body["lease"]["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    let (_, team) = call(&h.app, Method::GET, "/v1/teams/ml", Some("watcher"), None).await;
    assert_eq!(team["gpus_held"], 3);

    for bad in ["", "with space", &"k".repeat(256), "\"unclosed"] {
        let (status, body) = admit_keyed(&h.app, "ada", ask("ml", "ada", 1), bad).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{bad:?}: {body}");
        assert_eq!(body["error"]["field"], "Idempotency-Key", "{body}");
    }
    let (status, body) = admit_keyed(&h.app, "ada", ask("ml", "ada", 4), key).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(id.as_str().unwrap()) && message.contains("gpus"),
        "{message}"
    );
    let (status, _) = call(
        &h.app,
        Method::POST,
        &format!("/v1/leases/{}/release", id.as_str().unwrap()),
        Some("ada"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = admit_keyed(&h.app, "ada", ask("ml", "ada", 2), key).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("has ended"));
}

#[tokio::test]
async fn a_denial_is_a_200_with_every_reason() {
    let h = harness();
    h.service
        .store()
        .record_team_spend("ml", 9_500.0, 0.0, NOW, &h.service.config().pricing)
        .await
        .unwrap();
    let mut body = ask("ml", "ada", 20);
    body["duration"] = json!("8h");
    let (status, body) = admit(&h.app, "root", body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["decision"], "denied");
    assert!(body.get("lease").is_none());
    let codes: Vec<&str> = body["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["code"].as_str().unwrap())
        .collect();
    assert_eq!(
        codes,
        [
            "workload_limit",
            "duration_limit",
            "quota_exceeded",
            "budget_exceeded"
        ]
    );
    assert!(body["reasons"][2]["message"]
        .as_str()
        .unwrap()
        .contains("holds 0 of its 16 GPUs and asked for 20"));
    // 20 × $4 × 8 h.
    assert_eq!(body["estimate"]["max_usd"], 640.0);
    assert!(h.driver.calls.lock().unwrap().is_empty());
}

#[tokio::test]
async fn dry_run_evaluates_only() {
    let h = harness();
    let mut body = ask("ml", "ada", 2);
    body["dry_run"] = json!(true);
    let (status, body) = admit(&h.app, "ada", body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["decision"], "admitted");
    assert!(body.get("lease").is_none());
    assert!(h
        .service
        .store()
        .outbox_pending(10)
        .await
        .unwrap()
        .is_empty());
    assert!(h.driver.calls.lock().unwrap().is_empty());

    // A dry run holds no quota: eight GPUs asked for three times (24, past the quota of 16)
    // leave all sixteen free.
    let mut eight = ask("ml", "ada", 8);
    eight["dry_run"] = json!(true);
    for _ in 0..3 {
        let (_, body) = admit(&h.app, "ada", eight.clone()).await;
        assert_eq!(body["decision"], "admitted", "{body}");
        assert_eq!(body["estimate"]["usd_per_hour"], 32.0);
    }
    let (_, team) = call(&h.app, Method::GET, "/v1/teams/ml", Some("ada"), None).await;
    assert_eq!(team["gpus_held"], 0);
    // Denied, a dry run gives the same reasons, in the same words, as the request itself.
    let mut over = ask("ml", "ada", 20);
    over["dry_run"] = json!(true);
    let (_, dry) = admit(&h.app, "ada", over.clone()).await;
    over["dry_run"] = json!(false);
    let (_, real) = admit(&h.app, "ada", over).await;
    assert_eq!(dry["decision"], "denied");
    assert_eq!(dry["reasons"], real["reasons"]);
    assert_eq!(dry["estimate"], real["estimate"]);
    // Only the real request is counted among the decisions, and recorded (its `deny` Action).
    let metrics = h.service.metrics().render();
    assert!(
        metrics.contains("gpuwarden_enforcer_admissions_total{decision=\"denied\"} 1"),
        "{metrics}"
    );
    assert_eq!(h.service.store().outbox_pending(10).await.unwrap().len(), 1);
    // The whole quota is there for real requests.
    for _ in 0..2 {
        let (_, body) = admit(&h.app, "ada", ask("ml", "ada", 8)).await;
        assert_eq!(body["decision"], "admitted", "{body}");
    }
}

#[tokio::test]
async fn two_hundred_concurrent_requests_admit_exactly_the_quota() {
    let h = harness();
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let app = h.app.clone();
            let user = if i % 2 == 0 { "ada" } else { "bob" };
            tokio::spawn(async move { admit(&app, "portal", ask("ml", user, 1)).await })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        if body["decision"] == "admitted" {
            admitted += 1;
        } else {
            assert_eq!(body["reasons"][0]["code"], "quota_exceeded", "{body}");
        }
    }
    assert_eq!(admitted, 16);
    let (_, team) = call(&h.app, Method::GET, "/v1/teams/ml", Some("root"), None).await;
    assert_eq!(team["gpus_held"], 16);
}

#[tokio::test]
async fn authentication_and_authorization_matrix() {
    let h = harness();
    let app = &h.app;
    // 401: no token, unknown token.
    for who in [None, Some("nobody")] {
        let (s, b) = call(
            app,
            Method::POST,
            "/v1/admission",
            who,
            Some(ask("ml", "ada", 1).to_string()),
        )
        .await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        assert_eq!(b["error"]["code"], "unauthorized");
        let (s, _) = call(app, Method::GET, "/v1/leases", who, None).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
    }
    // Admission: (token, team, user) → status, decision.
    let cases = [
        ("root", "ml", "ada", StatusCode::OK, Some("admitted")),
        ("root", "cv", "eve", StatusCode::OK, Some("admitted")),
        ("ada", "ml", "ada", StatusCode::OK, Some("admitted")),
        ("ada", "ml", "bob", StatusCode::FORBIDDEN, None),
        ("ada", "cv", "ada", StatusCode::FORBIDDEN, None),
        ("portal", "ml", "bob", StatusCode::OK, Some("admitted")),
        ("portal", "ml", "eve", StatusCode::OK, Some("denied")),
        ("portal", "cv", "eve", StatusCode::FORBIDDEN, None),
        ("watcher", "ml", "ada", StatusCode::FORBIDDEN, None),
        ("eve", "ml", "eve", StatusCode::FORBIDDEN, None),
    ];
    let mut ml_lease = String::new();
    for (who, team, user, status, decision) in cases {
        let (s, b) = admit(app, who, ask(team, user, 1)).await;
        assert_eq!(s, status, "{who} for {user}@{team}: {b}");
        match decision {
            Some(d) => assert_eq!(b["decision"], d, "{who} for {user}@{team}: {b}"),
            None => assert_eq!(b["error"]["code"], "forbidden"),
        }
        if who == "ada" && s == StatusCode::OK {
            ml_lease = b["lease"]["id"].as_str().unwrap().to_string();
        }
        if decision == Some("denied") {
            assert_eq!(b["reasons"][0]["code"], "not_member");
        }
    }
    // Reading.
    let lease_uri = format!("/v1/leases/{ml_lease}");
    for (who, status) in [
        ("root", 200),
        ("ada", 200),
        ("portal", 200),
        ("watcher", 200),
        ("eve", 403),
    ] {
        let (s, _) = call(app, Method::GET, &lease_uri, Some(who), None).await;
        assert_eq!(s.as_u16(), status, "{who} reads a lease");
        let (s, _) = call(app, Method::GET, "/v1/teams/ml", Some(who), None).await;
        assert_eq!(s.as_u16(), status, "{who} reads the team");
        let (s, _) = call(app, Method::GET, "/v1/leases?team=ml", Some(who), None).await;
        assert_eq!(s.as_u16(), status, "{who} lists the team's leases");
    }
    let (_, listed) = call(app, Method::GET, "/v1/leases", Some("eve"), None).await;
    assert!(
        listed.as_array().unwrap().iter().all(|l| l["team"] == "cv"),
        "{listed}"
    );
    // Writing to ada's lease.
    let release = format!("/v1/leases/{ml_lease}/release");
    for who in ["watcher", "eve"] {
        let (s, _) = call(app, Method::POST, &release, Some(who), None).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{who} releases ada's lease");
    }
    let (s, b) = call(app, Method::POST, &release, Some("ada"), None).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(b["state"], "released");
    assert_eq!(b["release_reason"], "user");
    let (s, b) = call(app, Method::POST, &release, Some("root"), None).await;
    assert_eq!(s, StatusCode::CONFLICT, "{b}");
}

#[tokio::test]
async fn malformed_requests_get_one_error_shape_naming_the_fault() {
    let h = harness();
    let post = |body: String| {
        let app = h.app.clone();
        async move {
            call(
                &app,
                Method::POST,
                "/v1/admission",
                Some("root"),
                Some(body),
            )
            .await
        }
    };
    let (s, b) = post("{\"team\": \"ml\",\n \"gpus\": }".into()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(b["error"]["code"], "malformed_json");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("line 2 column 10"),
        "{b}"
    );

    for (body, field) in [
        (
            json!({"team": "ml", "user": "ada", "project": "p", "workload": "training", "gpus": "two"}),
            "gpus",
        ),
        (ask("ml", "ada", -1), "gpus"),
        (ask("ml", "ada", 0), "gpus"),
        (
            json!({"team": "ml", "project": "p", "workload": "training", "gpus": 1}),
            "user",
        ),
        (
            json!({"team": "ml", "user": "ada", "project": "p", "workload": "gaming", "gpus": 1}),
            "workload",
        ),
        (
            json!({"team": "ml", "user": "ada", "project": "p", "workload": "training", "gpus": 1, "duration": "soon"}),
            "duration",
        ),
        (
            json!({"team": "ml", "user": "ada", "project": "p", "workload": "training", "gpus": 1, "colour": "red"}),
            "colour",
        ),
        (
            json!({"team": "ml", "user": "ada", "project": "p", "workload": "training", "gpus": 1, "labels": {"a": 1}}),
            "labels.a",
        ),
    ] {
        let (s, b) = post(body.to_string()).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {b}");
        assert_eq!(b["error"]["code"], "invalid_field");
        assert_eq!(b["error"]["field"], field, "{body}: {b}");
    }

    let (s, b) = post(ask("nope", "ada", 1).to_string()).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(b["error"]["code"], "not_found");

    let mut big = ask("ml", "ada", 1);
    big["labels"] = json!({"x": "y".repeat(2000)});
    let (s, b) = post(big.to_string()).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(b["error"]["code"], "payload_too_large");
    assert!(b["error"]["message"]
        .as_str()
        .unwrap()
        .contains("1024 bytes"));

    let (s, b) = call(&h.app, Method::GET, "/v1/teams/nope", Some("root"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{b}");
    let (s, b) = call(&h.app, Method::GET, "/v1/leases/nope", Some("root"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{b}");
    let (s, b) = call(
        &h.app,
        Method::GET,
        "/v1/leases?state=sleeping",
        Some("root"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
}

/// What the OpenAPI document states of each field is what the handlers enforce: names are
/// non-blank with no space at either end, GPU counts are whole numbers however written,
/// durations follow the document's pattern and are more than zero, a missing body is a 400, and
/// an unknown substrate is a 404 like an unknown team.
#[tokio::test]
async fn fields_are_checked_as_the_document_states() {
    let h = harness();
    let app = &h.app;
    for (field, value) in [
        ("team", ""),
        ("team", " ml"),
        ("user", "ada "),
        ("project", "   "),
        ("project", "a\nb"),
    ] {
        let mut body = ask("ml", "ada", 1);
        body[field] = json!(value);
        let (s, b) = admit(app, "root", body.clone()).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {b}");
        assert_eq!(b["error"]["field"], field, "{body}: {b}");
    }
    let mut long = ask("ml", "ada", 1);
    long["project"] = json!("p".repeat(257));
    let (s, b) = admit(app, "root", long).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 256"),
        "{b}"
    );

    // JSON Schema's integer is any number without a fraction.
    let (s, b) = call(
        app,
        Method::POST,
        "/v1/admission",
        Some("ada"),
        Some(r#"{"team":"ml","user":"ada","project":"p","workload":"training","gpus":2.0,"dry_run":true}"#.into()),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(b["decision"], "admitted", "{b}");
    for gpus in ["1.5", "4294967296", "1e10"] {
        let body = format!(
            r#"{{"team":"ml","user":"ada","project":"p","workload":"training","gpus":{gpus}}}"#
        );
        let (s, b) = call(app, Method::POST, "/v1/admission", Some("ada"), Some(body)).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{gpus}: {b}");
        assert_eq!(b["error"]["field"], "gpus", "{b}");
    }

    for duration in ["0s", "0h 0m", "1.5h", "2 h ", "05m", "2H"] {
        let mut body = ask("ml", "ada", 1);
        body["duration"] = json!(duration);
        let (s, b) = admit(app, "ada", body).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{duration:?}: {b}");
        assert_eq!(b["error"]["field"], "duration", "{b}");
    }
    for duration in ["90m", "1h 30m", "1 hour"] {
        let mut body = ask("ml", "ada", 1);
        body["duration"] = json!(duration);
        body["dry_run"] = json!(true);
        let (s, b) = admit(app, "ada", body).await;
        assert_eq!(s, StatusCode::OK, "{duration:?}: {b}");
    }

    let mut body = ask("ml", "ada", 1);
    body["substrate"] = json!("moon");
    let (s, b) = admit(app, "ada", body).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{b}");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("moon"),
        "{b}"
    );

    let (_, b) = admit(app, "ada", ask("ml", "ada", 1)).await;
    let id = b["lease"]["id"].as_str().unwrap().to_string();
    for op in ["extend", "exempt", "resize"] {
        let path = format!("/v1/leases/{id}/{op}");
        let (s, b) = call(app, Method::POST, &path, Some("root"), None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{op}: {b}");
        assert_eq!(b["error"]["code"], "malformed_json", "{op}: {b}");
    }
    let path = format!("/v1/leases/{id}/exempt");
    for (body, status) in [
        (
            json!({"duration": "0s", "reason": "x"}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json!({"duration": "1h", "reason": " \t"}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json!({"duration": "1ms", "reason": "the shortest exemption"}),
            StatusCode::OK,
        ),
    ] {
        let body = Some(body.to_string());
        let (s, b) = call(app, Method::POST, &path, Some("root"), body).await;
        assert_eq!(s, status, "{b}");
    }

    let (s, b) = call(app, Method::GET, "/v2/nothing", Some("root"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(b["error"]["code"], "not_found", "{b}");
}

#[tokio::test]
async fn leases_are_listed_extended_resized_and_released() {
    let h = harness();
    let app = &h.app;
    let (_, b) = admit(app, "ada", ask("ml", "ada", 2)).await;
    let id = b["lease"]["id"].as_str().unwrap().to_string();
    admit(app, "portal", ask("ml", "bob", 1)).await;

    let (_, all) = call(
        app,
        Method::GET,
        "/v1/leases?team=ml&state=active",
        Some("watcher"),
        None,
    )
    .await;
    assert_eq!(all.as_array().unwrap().len(), 2);

    // Extend: 2 h + 1 h fits the 4 h limit; another 2 h does not, except for an admin.
    let extend = format!("/v1/leases/{id}/extend");
    let (s, b) = call(
        app,
        Method::POST,
        &extend,
        Some("ada"),
        Some(json!({"duration": "1h"}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(b["expires_at"], NOW + 3 * 3_600_000);
    let (s, b) = call(
        app,
        Method::POST,
        &extend,
        Some("ada"),
        Some(json!({"duration": "2h"}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{b}");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 4h"),
        "{b}"
    );
    let (s, b) = call(
        app,
        Method::POST,
        &extend,
        Some("root"),
        Some(json!({"duration": "2h"}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(b["expires_at"], NOW + 5 * 3_600_000);

    // Resize: up to 6, refused past the workload cap, down to 1.
    let resize = format!("/v1/leases/{id}/resize");
    let (s, b) = call(
        app,
        Method::POST,
        &resize,
        Some("ada"),
        Some(json!({"gpus": 6}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(b["decision"], "admitted");
    assert_eq!(b["lease"]["gpu_count"], 6);
    let uuids: std::collections::BTreeSet<&str> = b["lease"]["gpu_uuids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u.as_str().unwrap())
        .collect();
    assert_eq!(uuids.len(), 6);
    let (s, b) = call(
        app,
        Method::POST,
        &resize,
        Some("ada"),
        Some(json!({"gpus": 9}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(b["decision"], "denied");
    assert_eq!(b["reasons"][0]["code"], "workload_limit");
    let (_, b) = call(
        app,
        Method::POST,
        &resize,
        Some("ada"),
        Some(json!({"gpus": 1}).to_string()),
    )
    .await;
    assert_eq!(b["lease"]["gpu_count"], 1);
    assert_eq!(
        *h.driver.calls.lock().unwrap(),
        vec!["provision 2", "provision 1", "resize 6", "resize 1"]
    );

    let (s, b) = call(
        app,
        Method::POST,
        &format!("/v1/leases/{id}/release"),
        Some("root"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(b["release_reason"], "admin");
    let (_, team) = call(app, Method::GET, "/v1/teams/ml", Some("ada"), None).await;
    assert_eq!(team["gpus_held"], 1);
    let events: Vec<String> = h
        .service
        .store()
        .outbox_pending(100)
        .await
        .unwrap()
        .iter()
        .filter(|r| r.topic == "gpuwarden.leases")
        .map(|r| {
            serde_json::from_str::<Value>(&r.payload).unwrap()["event"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        events,
        ["granted", "granted", "resized", "resized", "released"]
    );
}

#[tokio::test]
async fn a_lease_the_substrate_cannot_start_fails_and_frees_its_gpus() {
    let h = harness();
    h.driver.fail_provision.store(true, Ordering::Relaxed);
    let (s, b) = admit(&h.app, "ada", ask("ml", "ada", 4)).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{b}");
    assert_eq!(b["error"]["code"], "substrate_unavailable");
    let (_, leases) = call(
        &h.app,
        Method::GET,
        "/v1/leases?state=failed",
        Some("ada"),
        None,
    )
    .await;
    assert_eq!(leases[0]["release_reason"], "failed");
    let (_, team) = call(&h.app, Method::GET, "/v1/teams/ml", Some("ada"), None).await;
    assert_eq!(team["gpus_held"], 0);
}

#[tokio::test]
async fn a_resize_the_substrate_cannot_carry_out_is_put_back() {
    let h = harness();
    let (s, b) = admit(&h.app, "ada", ask("ml", "ada", 2)).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let id = b["lease"]["id"].as_str().unwrap().to_string();
    let gpus = b["lease"]["gpu_uuids"].clone();
    h.driver.fail_resize.store(true, Ordering::Relaxed);
    let (s, b) = call(
        &h.app,
        Method::POST,
        &format!("/v1/leases/{id}/resize"),
        Some("ada"),
        Some(json!({"gpus": 6}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{b}");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("keeps its 2 GPUs"),
        "{b}"
    );
    let (_, lease) = call(
        &h.app,
        Method::GET,
        &format!("/v1/leases/{id}"),
        Some("ada"),
        None,
    )
    .await;
    assert_eq!(
        (lease["gpu_count"].clone(), lease["gpu_uuids"].clone()),
        (json!(2), gpus.clone())
    );
    let (_, team) = call(&h.app, Method::GET, "/v1/teams/ml", Some("ada"), None).await;
    assert_eq!(team["gpus_held"], 2);
    // Downstream saw the resize and sees it undone, with the failure audited.
    let rows = h.service.store().outbox_pending(100).await.unwrap();
    let records: Vec<Value> = rows
        .iter()
        .map(|r| serde_json::from_str(&r.payload).unwrap())
        .collect();
    let resized: Vec<&Value> = records.iter().filter(|r| r["event"] == "resized").collect();
    assert_eq!(resized.len(), 2);
    assert_eq!(resized[0]["gpu_count"], 6);
    assert_eq!(
        (
            resized[1]["gpu_count"].clone(),
            resized[1]["gpu_uuids"].clone()
        ),
        (json!(2), gpus)
    );
    let failed = records
        .iter()
        .find(|r| r["action"] == "resize" && r["outcome"] == "failed")
        .expect("a failed resize action");
    assert_eq!(failed["reason"], "substrate_failed");
    assert!(failed["detail"]
        .as_str()
        .unwrap()
        .contains("the fleet is down"));
}

#[tokio::test]
async fn health_and_the_committed_openapi_document() {
    let h = harness();
    // Alive, and this replica's role: an SQLite store's one owner leads.
    let (s, b) = call(&h.app, Method::GET, "/healthz", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let health = b.as_str().unwrap();
    assert!(health.starts_with("ok\n"), "{health}");
    assert!(health.contains("\nrole: leader\n"), "{health}");
    // Its one substrate has what admission decides from.
    let (s, b) = call(&h.app, Method::GET, "/readyz", None, None).await;
    assert_eq!((s, b), (StatusCode::OK, Value::String("ready\n".into())));

    let response = h
        .app
        .clone()
        .oneshot(Request::get("/openapi.json").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let served = String::from_utf8(
        response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    assert_eq!(served, openapi_json());
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("openapi.json");
    if std::env::var_os("GPUWARDEN_BLESS").is_some() {
        std::fs::write(&path, &served).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == served,
        "enforcer/openapi.json differs from the API; if the change is deliberate, run \
         `GPUWARDEN_BLESS=1 cargo test -p gpuwarden-enforcer --test api` and commit the result"
    );
    let doc: Value = serde_json::from_str(&served).unwrap();
    for path in [
        "/v1/admission",
        "/v1/leases",
        "/v1/leases/{id}",
        "/v1/leases/{id}/release",
        "/v1/leases/{id}/extend",
        "/v1/leases/{id}/resize",
        "/v1/teams/{team}",
        "/healthz",
        "/readyz",
    ] {
        assert!(doc["paths"].get(path).is_some(), "{path} missing");
    }
}

/// Calls `GET /v1/leases` with `token` as if from `peer` (the connect info `gpuwarden enforce`
/// serves with; `None` for none, as `oneshot` gives): status, `Retry-After`, JSON body.
async fn leases_from(
    app: &Router,
    peer: Option<&str>,
    token: Option<&str>,
) -> (StatusCode, Option<String>, Value) {
    let mut request = Request::get("/v1/leases");
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let mut request = request.body(Body::empty()).unwrap();
    if let Some(peer) = peer {
        let peer: std::net::SocketAddr = peer.parse().unwrap();
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(peer));
    }
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, retry_after, serde_json::from_slice(&bytes).unwrap())
}

/// The series `name` of the enforcer's `/metrics` text.
fn metric(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{metrics}"))
}

#[tokio::test]
async fn failed_logins_lock_out_their_address_and_their_token_with_429_and_retry_after() {
    let mut config = config();
    config.enforcer.login_limits.max_failures_per_source = 3;
    config.enforcer.login_limits.max_failures = 4;
    let h = Enforcer::new(config, 32, NOW);
    let app = &h.app;
    let attacker = Some("192.0.2.1:40000");

    // Three wrong tokens from one address: 401 each, then the address is locked out.
    for guess in ["guess-1", "guess-2", "guess-3"] {
        let (status, retry, body) = leases_from(app, attacker, Some(guess)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{guess}: {body}");
        assert_eq!(retry, None);
    }
    // Locked out: 429 whatever the token, a good one included, and without one; another port of
    // the same address is the same source.
    for (peer, token) in [
        (attacker, Some("tok-ada")),
        (attacker, Some("guess-4")),
        (Some("192.0.2.1:40001"), None),
    ] {
        let (status, retry, body) = leases_from(app, peer, token).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{token:?}: {body}");
        let retry: u64 = retry.expect("a Retry-After header").parse().unwrap();
        assert!((299..=300).contains(&retry), "Retry-After: {retry}");
        assert_eq!(body["error"]["code"], "too_many_failed_logins");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("from this address"), "{message}");
        assert!(
            message.contains(&format!("try again in {retry} s")),
            "{message}"
        );
    }
    // A good token from another address, or from no known address, still works.
    let (status, _, body) = leases_from(app, Some("192.0.2.2:40000"), Some("tok-ada")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _, body) = leases_from(app, None, Some("tok-ada")).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // One wrong token presented from many addresses is locked out by itself: its fourth failure
    // locks it, wherever it comes from next.
    for i in 0..4 {
        let peer = format!("198.51.100.{i}:5000");
        let (status, _, _) = leases_from(app, Some(&peer), Some("stale-token")).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "from {peer}");
    }
    let (status, retry, body) =
        leases_from(app, Some("198.51.100.99:5000"), Some("stale-token")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(retry.is_some());
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("with this token"),
        "{body}"
    );
    // That address may still log in with a good token.
    let (status, _, _) = leases_from(app, Some("198.51.100.99:5000"), Some("tok-ada")).await;
    assert_eq!(status, StatusCode::OK);

    let metrics = h.service.metrics().render();
    assert_eq!(
        metric(&metrics, "gpuwarden_enforcer_login_failures_total"),
        7.0
    );
    for (series, value) in [
        (
            "gpuwarden_enforcer_login_lockouts_total{scope=\"source\"}",
            1.0,
        ),
        (
            "gpuwarden_enforcer_login_lockouts_total{scope=\"principal\"}",
            1.0,
        ),
        (
            "gpuwarden_enforcer_logins_refused_total{scope=\"source\"}",
            3.0,
        ),
        (
            "gpuwarden_enforcer_logins_refused_total{scope=\"principal\"}",
            1.0,
        ),
        ("gpuwarden_enforcer_login_keys_evicted_total", 0.0),
    ] {
        assert_eq!(metric(&metrics, series), value, "{series}");
    }

    // The document says so for every operation that takes a token, and only for those.
    let doc: Value = serde_json::from_str(&openapi_json()).unwrap();
    let mut secured = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let locked_out = &operation["responses"]["429"];
            if operation.get("security").is_some() {
                secured += 1;
                assert_eq!(
                    locked_out["headers"]["Retry-After"]["schema"]["type"], "integer",
                    "{method} {path}"
                );
            } else {
                assert!(locked_out.is_null(), "{method} {path} takes no token");
            }
        }
    }
    assert!(secured >= 8, "{secured} operations take a token");
}
