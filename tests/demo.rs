//! The README's first command as a newcomer meets it: `gpuwarden demo` prints what to paste,
//! and within two minutes psql shows `team_hourly` rows, and reclaims and denials in `actions`;
//! SIGTERM (as Ctrl-C) stops it cleanly.

mod support;

use std::time::{Duration, Instant};

use support::{eventually, http, Demo, Psql};

#[test]
fn the_demo_prints_what_to_paste_and_fills_team_hourly_and_actions_within_two_minutes() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let Demo {
        process: demo,
        banner,
        sql_port: port,
        api,
        ..
    } = Demo::start(dir.path());
    // The psql line, ready to paste, and the API with its token.
    assert!(
        banner.contains("psql \"postgres://demo:demo@127.0.0.1:"),
        "{banner}"
    );
    assert!(banner.contains("demo-admin-token"), "{banner}");
    assert!(
        banner.contains("curl -s -H 'Authorization: Bearer demo-admin-token'"),
        "{banner}"
    );
    assert!(
        banner.contains(&dir.path().join("lake").display().to_string()),
        "{banner}"
    );
    let api = api.as_str();
    let (status, _) = http(
        api,
        "GET",
        "/v1/teams/research",
        Some("demo-admin-token"),
        None,
    );
    assert_eq!(status, 200);

    let psql = Psql::new(port, "demo", Some("demo"));
    let count = |sql: &str| psql.number_or_zero(sql);
    // Two minutes from the start, the banner's time included.
    let left = Duration::from_secs(120).saturating_sub(started.elapsed());
    let seen = eventually("team_hourly rows, reclaims, denials", left, || {
        let seen = (
            count("SELECT count(*) FROM team_hourly"),
            count("SELECT count(*) FROM actions WHERE action = 'reclaim'"),
            count("SELECT count(*) FROM actions WHERE action = 'deny'"),
        );
        if seen.0 > 0 && seen.1 > 0 && seen.2 > 0 {
            Ok(seen)
        } else {
            Err(format!("{seen:?}"))
        }
    });
    eprintln!(
        "demo: {seen:?} (team_hourly rows, reclaims, denials) after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let (status, log) = demo.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));
    assert!(
        log.iter().any(|l| l.contains("pipeline stopped")),
        "{}",
        log.join("\n")
    );
}
