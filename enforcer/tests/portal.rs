//! The portal in process: its router (with the API's) driven with `tower::ServiceExt::oneshot`
//! over a real store, as a browser would, form posts and cookies by hand. What a real browser
//! shows is tests/portal.rs's; here: the session cookie's flags, CSRF and origin checks, the
//! failed-login limits the portal shares with the API, escaping, and that a dry run (the live
//! estimate) holds nothing.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use gpuwarden_enforcer::api::AppState;
use gpuwarden_enforcer::portal;
use gpuwarden_schema::config::{
    Config, GpuPrice, LoginLimits, PricingConfig, Role, TeamConfig, TlsConfig, WorkloadPolicy,
};
use gpuwarden_schema::Workload;
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

mod support;

use support::{call, token, Enforcer};

const NOW: i64 = 1_767_225_600_000;

fn config() -> Config {
    let team = |name: &str, members: &[&str]| TeamConfig {
        name: name.into(),
        members: members.iter().map(|m| m.to_string()).collect(),
        gpu_quota: 4,
        monthly_budget_usd: 1000.0,
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
        tokens: vec![
            token("root", Role::Admin, &[]),
            token("ada", Role::Member, &["ml"]),
            token("watcher", Role::Viewer, &["ml"]),
            token("eve", Role::Member, &["cv"]),
        ],
        ..Config::default()
    };
    config.enforcer.login_limits = LoginLimits {
        max_failures: 3,
        max_failures_per_source: 100,
        window: Duration::from_secs(600),
        ..LoginLimits::default()
    };
    config.workloads.insert(
        Workload::Training,
        WorkloadPolicy {
            max_gpus: Some(8),
            max_duration: Some(Duration::from_secs(24 * 3600)),
            ..WorkloadPolicy::default()
        },
    );
    config
}

struct Page {
    status: StatusCode,
    location: Option<String>,
    set_cookie: Option<String>,
    body: String,
}

async fn send(app: &Router, request: Request<Body>) -> Page {
    let response = app.clone().oneshot(request).await.unwrap();
    let header = |name| {
        response
            .headers()
            .get(name)
            .map(|v: &axum::http::HeaderValue| v.to_str().unwrap().to_owned())
    };
    let (status, location, set_cookie) = (
        response.status(),
        header(header::LOCATION),
        header(header::SET_COOKIE),
    );
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    Page {
        status,
        location,
        set_cookie,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

fn form_encode(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(k, v)| {
            let enc: String = v
                .bytes()
                .map(|b| match b {
                    b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                        (b as char).to_string()
                    }
                    _ => format!("%{b:02X}"),
                })
                .collect();
            format!("{k}={enc}")
        })
        .collect::<Vec<_>>()
        .join("&")
}

async fn post(app: &Router, path: &str, cookie: Option<&str>, fields: &[(&str, &str)]) -> Page {
    let mut request = Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(header::HOST, "127.0.0.1:8080")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    if let Some(cookie) = cookie {
        request = request.header(header::COOKIE, cookie);
    }
    send(app, request.body(Body::from(form_encode(fields))).unwrap()).await
}

async fn get(app: &Router, path: &str, cookie: Option<&str>) -> Page {
    let mut request = Request::get(path);
    if let Some(cookie) = cookie {
        request = request.header(header::COOKIE, cookie);
    }
    send(app, request.body(Body::empty()).unwrap()).await
}

/// Signs in with `token`: the `name=value` of the session cookie.
async fn sign_in(app: &Router, token: &str) -> String {
    let page = post(app, "/ui/signin", None, &[("token", token)]).await;
    assert_eq!(page.status, StatusCode::SEE_OTHER, "{}", page.body);
    page.set_cookie
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned()
}

/// The CSRF token in a page's forms.
fn csrf(body: &str) -> String {
    let at = body
        .find(r#"name="csrf" value=""#)
        .expect("a form with a csrf field");
    let rest = &body[at + r#"name="csrf" value=""#.len()..];
    rest[..rest.find('"').unwrap()].to_owned()
}

fn app_of(h: &Enforcer) -> Router {
    portal::app(AppState::new(h.service.clone()), None)
}

#[tokio::test]
async fn signing_in_sets_a_strict_http_only_cookie_holding_a_session_not_the_token() {
    let h = Enforcer::new(config(), 8, NOW);
    let app = app_of(&h);
    let page = get(&app, "/ui/leases", None).await;
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    assert_eq!(page.location.as_deref(), Some("/ui/signin"));

    let page = post(&app, "/ui/signin", None, &[("token", "tok-ada")]).await;
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    let cookie = page.set_cookie.unwrap();
    assert!(cookie.starts_with("gpuwarden_session="), "{cookie}");
    for flag in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=43200"] {
        assert!(cookie.contains(flag), "{flag} in {cookie}");
    }
    // Plain HTTP: not Secure (the browser would drop it).
    assert!(!cookie.contains("Secure"), "{cookie}");
    assert!(!cookie.contains("tok-ada"), "{cookie}");
    let session = cookie.split(';').next().unwrap();
    assert_eq!(session.len(), "gpuwarden_session=".len() + 64);

    let page = get(&app, "/ui/leases", Some(session)).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.body.contains("ada (member)"), "{}", page.body);
    // A made-up session is no session.
    let page = get(
        &app,
        "/ui/leases",
        Some(&format!("gpuwarden_session={}", "0".repeat(64))),
    )
    .await;
    assert_eq!(page.location.as_deref(), Some("/ui/signin"));

    // Signing out needs the session's CSRF token, and ends the session.
    let token = csrf(&get(&app, "/ui/leases", Some(session)).await.body);
    let page = post(&app, "/ui/signout", Some(session), &[("csrf", "wrong")]).await;
    assert_eq!(page.status, StatusCode::FORBIDDEN);
    let page = post(&app, "/ui/signout", Some(session), &[("csrf", &token)]).await;
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    assert!(page.set_cookie.unwrap().contains("Max-Age=0"));
    let page = get(&app, "/ui/leases", Some(session)).await;
    assert_eq!(page.location.as_deref(), Some("/ui/signin"));
}

#[tokio::test]
async fn over_tls_the_cookie_is_secure_and_host_prefixed() {
    let mut config = config();
    config.enforcer.tls = Some(TlsConfig {
        cert: "cert.pem".into(),
        key: "key.pem".into(),
        client_ca: None,
        client_auth: None,
    });
    let h = Enforcer::new(config, 8, NOW);
    let page = post(&app_of(&h), "/ui/signin", None, &[("token", "tok-ada")]).await;
    let cookie = page.set_cookie.unwrap();
    assert!(cookie.starts_with("__Host-gpuwarden_session="), "{cookie}");
    assert!(cookie.contains("; Secure"), "{cookie}");
}

#[tokio::test]
async fn the_portal_and_the_api_share_the_failed_login_limits() {
    let h = Enforcer::new(config(), 8, NOW);
    let app = app_of(&h);
    for _ in 0..3 {
        let page = post(&app, "/ui/signin", None, &[("token", "guess")]).await;
        assert_eq!(page.status, StatusCode::UNAUTHORIZED);
        assert!(page.body.contains("That token is not valid"));
    }
    // Locked out in the portal, and that token in the API too.
    let page = post(&app, "/ui/signin", None, &[("token", "guess")]).await;
    assert_eq!(page.status, StatusCode::TOO_MANY_REQUESTS, "{}", page.body);
    let response = app
        .clone()
        .oneshot(
            Request::get("/v1/leases")
                .header("authorization", "Bearer guess")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    // A sign-in posted from another site is refused before the token is looked at.
    let request = Request::builder()
        .method(Method::POST)
        .uri("/ui/signin")
        .header(header::HOST, "127.0.0.1:8080")
        .header(header::ORIGIN, "https://elsewhere.example")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from("token=tok-ada"))
        .unwrap();
    let page = send(&app, request).await;
    assert_eq!(page.status, StatusCode::FORBIDDEN);
    assert!(page.set_cookie.is_none());
}

#[tokio::test]
async fn estimates_hold_nothing_requests_need_the_csrf_token_and_labels_are_escaped() {
    let h = Enforcer::new(config(), 8, NOW);
    let app = app_of(&h);
    let session = sign_in(&app, "tok-ada").await;
    let form = get(&app, "/ui/request", Some(&session)).await;
    assert_eq!(form.status, StatusCode::OK);
    let token = csrf(&form.body);
    let ask = |gpus: &'static str, labels: &'static str| {
        vec![
            ("team", "ml"),
            ("project", "llm"),
            ("workload", "training"),
            ("gpus", gpus),
            ("duration", "2h"),
            ("labels", labels),
        ]
    };
    // The live estimate: a dry run, as often as the fields change, holding nothing.
    for gpus in ["1", "4", "9"] {
        let mut fields = ask(gpus, "");
        fields.push(("csrf", &token));
        let page = post(&app, "/ui/estimate", Some(&session), &fields).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        let answer: Value = serde_json::from_str(&page.body).unwrap();
        // Placed, an H100 costs $4 a GPU-hour. Nine fit nowhere, so no model is placed: the
        // estimate prices the dearest model the request could get (the H100 again, and says
        // so), not the default price ($2), so asking for more never looks cheaper per GPU.
        let n = gpus.parse::<f64>().unwrap();
        assert_eq!(answer["usd_per_hour"], 4.0 * n, "{answer}");
        assert_eq!(answer["gpu_model"], "NVIDIA H100 80GB HBM3", "{answer}");
        let summary = answer["summary"].as_str().unwrap();
        assert!(
            summary.contains(&format!("{gpus} GPU"))
                && summary.contains(" of NVIDIA H100 80GB HBM3 × $4.00/h"),
            "{summary}"
        );
        if gpus == "9" {
            assert_eq!(answer["decision"], "denied");
            assert!(
                summary.ends_with(
                    "Nothing could be placed: priced as the dearest model the request could get."
                ),
                "{summary}"
            );
            let codes: Vec<&str> = answer["reasons"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["code"].as_str().unwrap())
                .collect();
            assert_eq!(codes, ["workload_limit", "quota_exceeded", "no_capacity"]);
        } else {
            assert_eq!(answer["decision"], "admitted", "{answer}");
        }
    }
    let (_, team) = call(&h.app, Method::GET, "/v1/teams/ml", Some("ada"), None).await;
    assert_eq!(team["gpus_held"], 0);
    assert!(h.driver.calls.lock().unwrap().is_empty());
    // Dry runs are not counted as decisions.
    assert!(
        !h.service
            .metrics()
            .render()
            .contains("decision=\"admitted\"} 1"),
        "{}",
        h.service.metrics().render()
    );

    // Without the session's CSRF token, nothing is asked.
    let page = post(&app, "/ui/request", Some(&session), &ask("1", "")).await;
    assert_eq!(page.status, StatusCode::FORBIDDEN);
    assert!(h.driver.calls.lock().unwrap().is_empty());

    // With it, a lease, whose markup label is shown as text.
    let mut fields = ask("2", "note=<script>alert(1)</script>\nteam=\"a&b\"");
    fields.push(("csrf", &token));
    let page = post(&app, "/ui/request", Some(&session), &fields).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.body.contains("admitted"), "{}", page.body);
    let leases = get(&app, "/ui/leases", Some(&session)).await;
    assert!(
        leases
            .body
            .contains("note=&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{}",
        leases.body
    );
    assert!(leases.body.contains("team=&quot;a&amp;b&quot;"));
    assert!(!leases.body.contains("<script>alert"));

    // A field the API would refuse is refused here with the API's words, naming it.
    let mut fields = ask("2", "");
    fields[1] = ("project", "");
    fields.push(("csrf", &token));
    let page = post(&app, "/ui/request", Some(&session), &fields).await;
    assert_eq!(page.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(page.body.contains("project: "), "{}", page.body);
}

#[tokio::test]
async fn a_resized_lease_costs_what_it_held_over_time_and_a_denial_is_told_at_the_top() {
    let h = Enforcer::new(config(), 8, NOW);
    let app = app_of(&h);
    let (status, lease) = call(
        &h.app,
        Method::POST,
        "/v1/admission",
        Some("ada"),
        Some(
            serde_json::json!({
                "team": "ml", "user": "ada", "project": "llm", "workload": "training",
                "gpus": 2, "duration": "4h"
            })
            .to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{lease}");
    let id = lease["lease"]["id"].as_str().unwrap().to_owned();
    // 2 GPUs for an hour, then 4 for an hour: 6 GPU-hours at $4 = $24, not 4 × 2 h = $32.
    h.clock.advance(Duration::from_secs(3600));
    let (status, resized) = call(
        &h.app,
        Method::POST,
        &format!("/v1/leases/{id}/resize"),
        Some("ada"),
        Some(r#"{"gpus": 4}"#.to_owned()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{resized}");
    assert_eq!(resized["decision"], "admitted", "{resized}");
    h.clock.advance(Duration::from_secs(3600));
    let session = sign_in(&app, "tok-ada").await;
    let page = get(&app, "/ui/leases", Some(&session)).await.body;
    let cost = page
        .split(r#"<td data-label="Cost so far" class="cost">"#)
        .nth(1)
        .and_then(|rest| rest.split("</td>").next())
        .unwrap_or_else(|| panic!("no cost cell in {page}"));
    assert_eq!(
        cost, r#"$24.00<br><span class="hint">$16.00/h now</span>"#,
        "{page}"
    );

    // A denial is said above the form, where a phone shows it without scrolling, with its
    // first reason; the form and the estimate below it keep every reason.
    let form = get(&app, "/ui/request", Some(&session)).await.body;
    let fields = [
        ("csrf", csrf(&form)),
        ("submission", "s1".to_owned()),
        ("team", "ml".to_owned()),
        ("project", "llm".to_owned()),
        ("workload", "training".to_owned()),
        ("gpus", "2".to_owned()),
        ("duration", "2h".to_owned()),
    ];
    let fields: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let page = post(&app, "/ui/request", Some(&session), &fields).await;
    assert_eq!(page.status, StatusCode::OK);
    let notice = page
        .body
        .find(r#"id="decision""#)
        .expect("a decision notice");
    assert!(
        notice < page.body.find(r#"id="request-form""#).unwrap(),
        "{}",
        page.body
    );
    assert!(
        page.body.contains(
            r##"role="alert" id="decision"><strong>Denied</strong>: The team has 0 of 4 GPUs free (4 held in open leases); you asked for 2. <a href="#estimate-title">"##
        ),
        "{}",
        page.body
    );
    // The form offers only the workloads the config defines.
    assert!(page.body.contains(r#"<select id="workload" name="workload"><option value="training" selected>training</option></select>"#), "{}", page.body);
}

/// The lease ids listed on a leases page, in its order.
fn listed(body: &str) -> Vec<String> {
    body.split(r#"<tr data-lease=""#)
        .skip(1)
        .map(|rest| rest[..rest.find('"').unwrap()].to_owned())
        .collect()
}

#[tokio::test]
async fn a_form_sent_twice_asks_once_and_a_viewer_s_posts_ask_nothing() {
    let h = Enforcer::new(config(), 8, NOW);
    let app = app_of(&h);
    let session = sign_in(&app, "tok-ada").await;
    let form = get(&app, "/ui/request", Some(&session)).await.body;
    let token = csrf(&form);
    let at =
        form.find(r#"name="submission" value=""#).unwrap() + r#"name="submission" value=""#.len();
    let submission = form[at..at + 64].to_owned();
    let fields = [
        ("csrf", token.as_str()),
        ("submission", submission.as_str()),
        ("team", "ml"),
        ("project", "llm"),
        ("workload", "training"),
        ("gpus", "1"),
        ("duration", "2h"),
    ];
    let first = post(&app, "/ui/request", Some(&session), &fields).await;
    assert!(first.body.contains("admitted"), "{}", first.body);
    // A reload of the decision page posts the same form again: nothing more is asked.
    let again = post(&app, "/ui/request", Some(&session), &fields).await;
    assert_eq!(again.status, StatusCode::OK);
    let leases = listed(&get(&app, "/ui/leases", Some(&session)).await.body);
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert!(
        again.body.contains(&format!(
            "This form was already sent, and it made lease {}",
            leases[0]
        )),
        "{}",
        again.body
    );
    // The page drawn after it is a new form: sending that one asks again.
    let at = again.body.find(r#"name="submission" value=""#).unwrap()
        + r#"name="submission" value=""#.len();
    let fresh = again.body[at..at + 64].to_owned();
    assert_ne!(fresh, submission);
    let mut next = fields;
    next[1] = ("submission", fresh.as_str());
    post(&app, "/ui/request", Some(&session), &next).await;
    assert_eq!(
        listed(&get(&app, "/ui/leases", Some(&session)).await.body).len(),
        2
    );

    // A viewer's session has a CSRF token, but its posts ask for nothing, not even an estimate.
    let viewer = sign_in(&app, "tok-watcher").await;
    let token = csrf(&get(&app, "/ui/leases", Some(&viewer)).await.body);
    let mut fields = next;
    fields[0] = ("csrf", token.as_str());
    fields[1] = ("submission", "");
    for path in ["/ui/request", "/ui/estimate"] {
        let page = post(&app, path, Some(&viewer), &fields).await;
        assert_eq!(page.status, StatusCode::FORBIDDEN, "{path}: {}", page.body);
    }
    let (_, team) = call(&h.app, Method::GET, "/v1/teams/ml", Some("ada"), None).await;
    assert_eq!(team["gpus_held"], 2, "{team}");
}

#[tokio::test]
async fn leases_are_released_and_extended_with_the_csrf_token_and_show_their_idle_warnings() {
    let h = Enforcer::new(config(), 8, NOW);
    let app = app_of(&h);
    let (status, lease) = call(
        &h.app,
        Method::POST,
        "/v1/admission",
        Some("ada"),
        Some(
            serde_json::json!({
                "team": "ml", "user": "ada", "project": "llm", "workload": "training",
                "gpus": 2, "duration": "2h"
            })
            .to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{lease}");
    let id = lease["lease"]["id"].as_str().unwrap().to_owned();
    let expires = lease["lease"]["expires_at"].as_i64().unwrap();
    // An idle warning among the rules' alerts, behind a thousand alerts about other leases.
    let alert = |lease: &str, reason: &str, detail: &str| gpuwarden_schema::Action {
        v: Default::default(),
        ts_ms: NOW + 60_000,
        action: gpuwarden_schema::ActionKind::Alert,
        lease_id: Some(lease.to_owned()),
        team: Some("ml".into()),
        reason: reason.into(),
        policy: None,
        driver: None,
        outcome: gpuwarden_schema::Outcome::Ok,
        detail: detail.into(),
    };
    h.service
        .store()
        .record_action(&alert(&id, "idle_warning", "all 2 GPU(s) idle for 20m"))
        .await
        .unwrap();
    for n in 0..1000 {
        h.service
            .store()
            .record_action(&alert(&format!("l-other-{n}"), "idle_warning", "another"))
            .await
            .unwrap();
    }

    let session = sign_in(&app, "tok-ada").await;
    let page = get(&app, "/ui/leases", Some(&session)).await.body;
    assert_eq!(listed(&page), [id.as_str()]);
    assert!(page.contains("all 2 GPU(s) idle for 20m"), "{page}");
    let token = csrf(&page);
    // The extension choices keep the lease within the workload's 24 h.
    assert!(page.contains(&format!(r#"action="/ui/leases/{id}/extend""#)));

    let extend = format!("/ui/leases/{id}/extend");
    let page = post(&app, &extend, Some(&session), &[("duration", "1h")]).await;
    assert_eq!(page.status, StatusCode::FORBIDDEN);
    let page = post(
        &app,
        &extend,
        Some(&session),
        &[("csrf", &token), ("duration", "1h")],
    )
    .await;
    assert_eq!(page.status, StatusCode::SEE_OTHER, "{}", page.body);
    assert_eq!(
        page.location.as_deref(),
        Some(format!("/ui/leases?extended={id}").as_str())
    );
    let (_, after) = call(
        &h.app,
        Method::GET,
        &format!("/v1/leases/{id}"),
        Some("ada"),
        None,
    )
    .await;
    assert_eq!(
        after["expires_at"].as_i64().unwrap(),
        expires + 3_600_000,
        "{after}"
    );
    let page = get(&app, "/ui/leases?extended=x", Some(&session))
        .await
        .body;
    assert!(page.contains("Lease x extended."));
    // Past the workload's longest (24 h), refused with the reason, and nothing changed.
    let page = post(
        &app,
        &extend,
        Some(&session),
        &[("csrf", &token), ("duration", "23h")],
    )
    .await;
    assert_eq!(page.status, StatusCode::FORBIDDEN, "{}", page.body);
    assert!(
        page.body.contains(&format!(
            "Lease {id} was not extended: training leases may last at most"
        )),
        "{}",
        page.body
    );
    // Only a lease id is echoed in a notice: a link cannot make the page say something else.
    let page = get(
        &app,
        "/ui/leases?released=Your%20account%20is%20closed",
        Some(&session),
    )
    .await
    .body;
    assert!(!page.contains("account is closed"), "{page}");

    // The team page forecasts the lease until it expires (3 h at $8/h), not to the month's end.
    let team = get(&app, "/ui/team?team=ml", Some(&session)).await.body;
    assert!(
        team.contains("Month-end forecast: <strong>$24.00</strong> (forecast within budget)"),
        "{team}"
    );

    let release = format!("/ui/leases/{id}/release");
    let page = post(&app, &release, Some(&session), &[("csrf", "wrong")]).await;
    assert_eq!(page.status, StatusCode::FORBIDDEN);
    let (_, still) = call(
        &h.app,
        Method::GET,
        &format!("/v1/leases/{id}"),
        Some("ada"),
        None,
    )
    .await;
    assert_ne!(still["state"], "released", "{still}");
    let page = post(&app, &release, Some(&session), &[("csrf", &token)]).await;
    assert_eq!(page.status, StatusCode::SEE_OTHER, "{}", page.body);
    let (_, gone) = call(
        &h.app,
        Method::GET,
        &format!("/v1/leases/{id}"),
        Some("ada"),
        None,
    )
    .await;
    assert_eq!(gone["state"], "released", "{gone}");
}

#[tokio::test]
async fn one_token_holds_a_bounded_number_of_sessions_and_cannot_push_out_anyone_else_s() {
    let h = Enforcer::new(config(), 8, NOW);
    let app = app_of(&h);
    let eve = sign_in(&app, "tok-eve").await;
    let mut ada = Vec::new();
    for _ in 0..portal::SESSIONS_PER_TOKEN + 40 {
        ada.push(sign_in(&app, "tok-ada").await);
    }
    let signed_in = |page: &Page| page.status == StatusCode::OK;
    // Ada's newest sessions work, her oldest were ended, and Eve's is untouched.
    let mut working = 0;
    for (i, session) in ada.iter().enumerate() {
        let ok = signed_in(&get(&app, "/ui/leases", Some(session)).await);
        assert_eq!(ok, i >= 40, "session {i}");
        working += usize::from(ok);
    }
    assert_eq!(working, portal::SESSIONS_PER_TOKEN);
    assert!(signed_in(&get(&app, "/ui/leases", Some(&eve)).await));
}
