//! Plain HTTP/1.1 over a socket, as a client with no library in the way: one request and its
//! answer, one series of a `/metrics`, and [`Webhook`], a server that records what is posted.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

/// One plain HTTP/1.1 GET on 127.0.0.1, returning (status, body).
pub fn http_get(address: &str, path: &str) -> (u16, String) {
    http(address, "GET", path, None, None)
}

/// One plain HTTP/1.1 request on 127.0.0.1, with a bearer token and a JSON body when given;
/// returns (status, body).
pub fn http(
    address: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let mut stream = std::net::TcpStream::connect(address).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    if let Some(token) = token {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    let body = body.unwrap_or_default();
    if !body.is_empty() {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    write!(stream, "{head}\r\n{body}").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    status_and_body(&response)
}

/// The status code (0 when there is none) and the body of a whole HTTP response read as text.
pub fn status_and_body(response: &str) -> (u16, String) {
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The value of the unlabelled series `name` on the `/metrics` at `address`, when it has one.
pub fn metric(address: &str, name: &str) -> Option<f64> {
    let (_, body) = http_get(address, "/metrics");
    body.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// An alert webhook: records the body of every POST and answers 200.
pub struct Webhook {
    /// Where to POST.
    pub url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

impl Webhook {
    /// Listens on 127.0.0.1, port 0.
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&bodies);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let seen = Arc::clone(&seen);
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream);
                    loop {
                        let mut length = 0;
                        let mut line = String::new();
                        loop {
                            line.clear();
                            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
                            }
                            let lower = line.to_ascii_lowercase();
                            if let Some(n) = lower.strip_prefix("content-length:") {
                                length = n.trim().parse().unwrap();
                            }
                            if line == "\r\n" {
                                break;
                            }
                        }
                        let mut body = vec![0; length];
                        reader.read_exact(&mut body).unwrap();
                        seen.lock()
                            .unwrap()
                            .push(serde_json::from_slice(&body).unwrap());
                        let _ = reader
                            .get_mut()
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
                    }
                });
            }
        });
        Self { url, bodies }
    }

    /// The alerts received with `gpuwarden.reason` = `reason`.
    pub fn alerts(&self, reason: &str) -> Vec<Value> {
        self.bodies
            .lock()
            .unwrap()
            .iter()
            .filter(|b| b["gpuwarden"]["reason"] == reason)
            .cloned()
            .collect()
    }
}
