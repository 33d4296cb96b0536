//! The self-service commands (`gpuwarden request`, `leases`) given several enforcer URLs, as
//! for replicas sharing one lease store: which failures send a call on to the next URL and which
//! do not. Small HTTP listeners on 127.0.0.1 stand in for the enforcers, so that each can refuse,
//! answer 503 or cut the connection on cue; the enforcer's own answers are tested with it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

/// What a stand-in enforcer does with each request it reads.
#[derive(Debug, Clone, Copy)]
enum Behaviour {
    /// Answers with this status and JSON body.
    Answer(u16, &'static str),
    /// Reads the whole request, then closes the connection without a word: whether it acted
    /// on it, the client cannot know.
    Cut,
}

/// An HTTP listener in place of an enforcer, recording each request's method and path, and the
/// `Idempotency-Key` of those that carry one.
struct Enforcer {
    url: String,
    seen: Arc<Mutex<Vec<String>>>,
    keys: Arc<Mutex<Vec<String>>>,
}

impl Enforcer {
    fn start(behaviour: Behaviour) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let keys = Arc::new(Mutex::new(Vec::new()));
        let records = (Arc::clone(&seen), Arc::clone(&keys));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (seen, keys) = (Arc::clone(&records.0), Arc::clone(&records.1));
                std::thread::spawn(move || serve(stream, behaviour, &seen, &keys));
            }
        });
        Self { url, seen, keys }
    }

    fn keys(&self) -> Vec<String> {
        self.keys.lock().unwrap().clone()
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

/// Serves the requests of one connection.
fn serve(
    stream: TcpStream,
    behaviour: Behaviour,
    seen: &Mutex<Vec<String>>,
    keys: &Mutex<Vec<String>>,
) {
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let request: Vec<&str> = line.split_whitespace().take(2).collect();
        let request = request.join(" ");
        let mut length = 0;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            if header == "\r\n" {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap();
                }
                if name.eq_ignore_ascii_case("idempotency-key") {
                    keys.lock().unwrap().push(value.trim().to_owned());
                }
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        seen.lock().unwrap().push(request);
        match behaviour {
            Behaviour::Cut => return,
            Behaviour::Answer(status, body) => {
                let written = write!(
                    reader.get_mut(),
                    "HTTP/1.1 {status} Whatever\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                if written.is_err() {
                    return;
                }
            }
        }
    }
}

/// A URL on 127.0.0.1 whose port nothing listens on (it was free a moment ago).
fn refusing_url() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", listener.local_addr().unwrap())
}

const LEASES: &str = r#"[{"id":"lease-from-the-second","team":"ml","user":"ada","workload":"training","substrate":"sim","gpu_count":1,"gpu_model":"NVIDIA H100 80GB HBM3","state":"active","expires_at":null}]"#;
const ADMITTED: &str = r#"{"decision":"admitted","reasons":[],"lease":{"id":"lease-admitted","substrate":"sim","gpu_count":1,"gpu_model":"NVIDIA H100 80GB HBM3","state":"active"}}"#;
const STORE_UNAVAILABLE: &str = r#"{"error":{"code":"store_unavailable","message":"the lease store's database cannot be reached; nothing was decided, try again"}}"#;
const SUBSTRATE_UNAVAILABLE: &str =
    r#"{"error":{"code":"substrate_unavailable","message":"the simulated fleet failed"}}"#;

/// `gpuwarden <args>` with `GPUWARDEN_API` set to `api` when given.
fn gpuwarden(api: Option<&str>, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpuwarden"));
    command
        .args(args)
        .env_remove("GPUWARDEN_API")
        .env("GPUWARDEN_TOKEN", "ada-token")
        .env("GPUWARDEN_USER", "ada");
    if let Some(api) = api {
        command.env("GPUWARDEN_API", api);
    }
    command.output().expect("runs gpuwarden")
}

fn show(output: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

const REQUEST: [&str; 7] = [
    "request",
    "--team",
    "ml",
    "--gpus",
    "1",
    "--workload",
    "training",
];

#[test]
fn the_cli_moves_to_the_second_url_when_the_first_refuses_connections() {
    let second = Enforcer::start(Behaviour::Answer(200, LEASES));
    let refused = refusing_url();

    // Comma-separated in GPUWARDEN_API.
    let out = gpuwarden(Some(&format!("{refused},{}", second.url)), &["leases"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("lease-from-the-second"),
        "{}",
        show(&out)
    );
    assert_eq!(second.seen(), ["GET /v1/leases"]);

    // --api repeated; a change too, since nothing reached the first.
    let admitting = Enforcer::start(Behaviour::Answer(200, ADMITTED));
    let mut args = REQUEST.to_vec();
    args.extend(["--api", refused.as_str(), "--api", admitting.url.as_str()]);
    let out = gpuwarden(None, &args);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("admitted\n  lease lease-admitted"),
        "{}",
        show(&out)
    );
    assert_eq!(admitting.seen(), ["POST /v1/admission"]);

    // Every URL refusing: the error names each.
    let other = refusing_url();
    let out = gpuwarden(Some(&format!("{refused}, {other}")), &["leases"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no enforcer of the 2 given decided GET /v1/leases")
            && stderr.contains(&format!("calling GET {refused}/v1/leases"))
            && stderr.contains(&format!("calling GET {other}/v1/leases")),
        "{}",
        show(&out)
    );
}

#[test]
fn a_store_unavailable_answer_sends_a_request_to_the_next_enforcer() {
    let store_away = Enforcer::start(Behaviour::Answer(503, STORE_UNAVAILABLE));
    let admitting = Enforcer::start(Behaviour::Answer(200, ADMITTED));
    let out = gpuwarden(
        Some(&format!("{},{}", store_away.url, admitting.url)),
        &REQUEST,
    );
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(store_away.seen(), ["POST /v1/admission"]);
    assert_eq!(admitting.seen(), ["POST /v1/admission"]);

    // A substrate's failure is the enforcer's answer: the same substrate is behind every
    // replica, and the lease may have been recorded as failed.
    let substrate_failed = Enforcer::start(Behaviour::Answer(503, SUBSTRATE_UNAVAILABLE));
    let out = gpuwarden(
        Some(&format!("{},{}", substrate_failed.url, admitting.url)),
        &REQUEST,
    );
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("POST /v1/admission: 503 Service Unavailable: the simulated fleet failed"),
        "{}",
        show(&out)
    );
    assert_eq!(admitting.seen().len(), 1, "the second was not asked");
}

/// An admission carries an Idempotency-Key, so one whose answer was lost (the connection cut
/// after the request was sent) is sent again to the next enforcer with the same key, which
/// answers with the lease the first may have admitted. A change without one (a release) is not
/// sent again: it may have been carried out.
#[test]
fn a_request_that_may_have_reached_an_enforcer_is_sent_again_only_with_its_idempotency_key() {
    let cutting = Enforcer::start(Behaviour::Cut);
    let admitting = Enforcer::start(Behaviour::Answer(200, ADMITTED));
    let out = gpuwarden(
        Some(&format!("{},{}", cutting.url, admitting.url)),
        &REQUEST,
    );
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(cutting.seen(), ["POST /v1/admission"]);
    assert_eq!(admitting.seen(), ["POST /v1/admission"]);
    let key = cutting.keys();
    assert_eq!(key.len(), 1, "{key:?}");
    assert!(uuid::Uuid::parse_str(&key[0]).is_ok(), "{key:?}");
    assert_eq!(admitting.keys(), key, "the same key on the second try");
    // Another request is another key.
    let again = Enforcer::start(Behaviour::Answer(200, ADMITTED));
    let out = gpuwarden(Some(&again.url), &REQUEST);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_ne!(again.keys(), key);

    let out = gpuwarden(
        Some(&format!("{},{}", cutting.url, admitting.url)),
        &["release", "lease-1"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "POST /v1/leases/lease-1/release may have been carried out by the enforcer at {}, \
             which did not answer; it was not sent again (see `gpuwarden leases`)",
            cutting.url
        )),
        "{}",
        show(&out)
    );
    assert_eq!(
        admitting.seen(),
        ["POST /v1/admission"],
        "the release was not sent to the second"
    );

    // A read may be asked again: the second answers.
    let listing = Enforcer::start(Behaviour::Answer(200, LEASES));
    let out = gpuwarden(
        Some(&format!("{},{}", cutting.url, listing.url)),
        &["leases", "--format", "json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(listing.seen(), ["GET /v1/leases"]);
}

#[test]
fn help_says_how_to_give_several_enforcers() {
    let out = gpuwarden(None, &["leases", "--help"]);
    assert!(out.status.success(), "{}", show(&out));
    // Words as a reader sees them, whatever the width clap wraps the help at.
    let help = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    for expected in [
        "comma-separated or with --api repeated",
        "503 store_unavailable",
        "never sent to another",
        "GPUWARDEN_API",
    ] {
        assert!(
            help.contains(expected),
            "--help lacks {expected:?}:\n{help}"
        );
    }
}
