//! The self-service commands' side of the enforcer's HTTP API: where it is (one URL, or one per
//! enforcer replica), the bearer token, whom to trust when it is `https://` (the system of
//! Mozilla's roots, or the CA of `--ca-cert`, with a client certificate when the enforcer asks
//! for one), and one JSON call over the enforcer's outbound client
//! ([`gpuwarden_enforcer::outbound`]). Errors the API answers (4xx/5xx) become errors carrying its
//! message.
//!
//! With several URLs a call goes to the enforcer that answered the command's last call (the
//! first given, at start) and moves on to the next only when asking that one decided nothing
//! ([`Miss`]): no connection could be made, or it answered 503 `store_unavailable`; a read also
//! moves on when its connection fails after it was sent. A change (POST) that may have reached
//! an enforcer is not sent to another: it may have been carried out there, and sending it again
//! could admit a second lease.

use anyhow::Context as _;
use bytes::Bytes;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use gpuwarden_enforcer::outbound::{http_client, http_client_with_tls, HttpClient};
use http_body_util::{BodyExt as _, Full};
use hyper::header;
use hyper::{Method, Request, StatusCode};
use serde_json::Value;

/// Where the enforcer is and who is calling; flattened into each self-service command.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ApiArgs {
    /// Base URL of the enforcer's API; for several enforcer replicas, one URL each,
    /// comma-separated or with --api repeated.
    ///
    /// With several, they are tried in the order given (a command's later calls start at the
    /// one that answered), moving on to the next only when nothing was decided there: no
    /// connection could be made, or it answered 503 store_unavailable (its lease store is
    /// unreachable). A read (leases) also moves on when the connection fails after the request
    /// was sent. A change (request, release) that may have reached an enforcer is never sent to
    /// another, since it may have been carried out there: the command fails, and `gpuwarden
    /// leases` shows what was done.
    #[arg(
        long,
        value_name = "URL",
        env = "GPUWARDEN_API",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:8080"
    )]
    api: Vec<String>,
    /// Bearer token for the API.
    #[arg(long, env = "GPUWARDEN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// PEM file of the CA that signed the API's certificate, for an https:// API whose
    /// certificate is not signed by a public CA. Only this CA is trusted then.
    #[arg(long, value_name = "FILE", env = "GPUWARDEN_CA_CERT")]
    ca_cert: Option<PathBuf>,
    /// PEM file of this client's certificate, for an API that asks for one
    /// (enforcer.tls.client_ca). Needs --client-key.
    #[arg(
        long,
        value_name = "FILE",
        env = "GPUWARDEN_CLIENT_CERT",
        requires = "client_key"
    )]
    client_cert: Option<PathBuf>,
    /// PEM file of the private key of --client-cert.
    #[arg(
        long,
        value_name = "FILE",
        env = "GPUWARDEN_CLIENT_KEY",
        requires = "client_cert"
    )]
    client_key: Option<PathBuf>,
}

pub(crate) struct ApiClient {
    /// The enforcers' base URLs, in the order given.
    bases: Vec<String>,
    /// The index in `bases` of the enforcer asked first: the one that answered last.
    current: AtomicUsize,
    token: Option<String>,
    client: HttpClient,
}

/// How asking one enforcer ended without an answer to hand back.
#[derive(Debug)]
enum Miss {
    /// Nothing was decided there (no connection, or a 503 `store_unavailable`): another
    /// enforcer may be asked, whatever the call.
    Undecided(anyhow::Error),
    /// The request may have reached it and been acted on: only a call that may be repeated
    /// (GET) is sent to another.
    Unknown(anyhow::Error),
}

/// The enforcers' base URLs from `--api`: each item trimmed of spaces and trailing slashes,
/// empty items dropped, at least one, every one http:// or https://.
fn bases(items: &[String]) -> anyhow::Result<Vec<String>> {
    let bases: Vec<String> = items
        .iter()
        .map(|item| item.trim().trim_end_matches('/').to_string())
        .filter(|base| !base.is_empty())
        .collect();
    anyhow::ensure!(!bases.is_empty(), "--api names no URL");
    for base in &bases {
        anyhow::ensure!(
            base.starts_with("https://") || base.starts_with("http://"),
            "--api must be an http:// or https:// URL, got {base}"
        );
    }
    Ok(bases)
}

/// Whether an answer decided nothing, so that another enforcer may be asked: a 503 whose
/// code is `store_unavailable` (the API's `ApiError::StoreUnavailable`). A 503
/// `substrate_unavailable` is not: the enforcer may have recorded the lease as failed, and
/// another replica would meet the same substrate.
fn undecided(status: StatusCode, answer: &Value) -> bool {
    status == StatusCode::SERVICE_UNAVAILABLE
        && answer.pointer("/error/code").and_then(Value::as_str) == Some("store_unavailable")
}

/// The error of an answer that is not a 2xx, naming the API's reason.
fn api_error(method: &Method, path: &str, status: StatusCode, answer: &Value) -> anyhow::Error {
    let message = answer
        .pointer("/error/message")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| answer.to_string());
    let hint = match status {
        StatusCode::UNAUTHORIZED => " (set --token or GPUWARDEN_TOKEN)",
        _ => "",
    };
    anyhow::anyhow!("{method} {path}: {status}: {message}{hint}")
}

impl ApiClient {
    /// A client of the API at `base` (an http:// URL, or https:// with a certificate from a
    /// public CA) with `token`.
    pub(crate) fn to(base: &str, token: Option<&str>) -> Self {
        Self::of(vec![base.trim_end_matches('/').to_string()], token)
    }

    fn of(bases: Vec<String>, token: Option<&str>) -> Self {
        Self {
            bases,
            current: AtomicUsize::new(0),
            token: token.map(str::to_string),
            client: http_client(),
        }
    }

    pub(crate) fn new(args: &ApiArgs) -> anyhow::Result<Self> {
        let mut client = Self::of(bases(&args.api)?, args.token.as_deref());
        if let Some(ca) = &args.ca_cert {
            if let Some(plain) = client.bases.iter().find(|b| !b.starts_with("https://")) {
                anyhow::bail!("--ca-cert is for an https:// API, but --api is {plain}");
            }
            let identity = args.client_cert.as_deref().zip(args.client_key.as_deref());
            let tls = gpuwarden_schema::tls::client_config(
                ca,
                identity,
                ("--ca-cert", "--client-cert", "--client-key"),
            )?;
            client.client = http_client_with_tls(tls);
        } else {
            anyhow::ensure!(
                args.client_cert.is_none(),
                "--client-cert needs --ca-cert too: the CA that signed the API's certificate"
            );
        }
        Ok(client)
    }

    /// One call, to the first enforcer that decides; the body of a 2xx answer as JSON, or an
    /// error naming the API's reason.
    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        self.call_keyed(method, path, body, None).await
    }

    /// [`ApiClient::call`] with an `Idempotency-Key`, which the enforcers answer the same way
    /// however often they are asked: a call whose answer was lost (the connection dropped after
    /// the request was sent) is sent again, to the next enforcer, like an idempotent method's.
    pub(crate) async fn call_keyed(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        key: Option<&str>,
    ) -> anyhow::Result<Value> {
        let payload = match body {
            Some(body) => Some(Bytes::from(serde_json::to_vec(body)?)),
            None => None,
        };
        let first = self.current.load(Ordering::Relaxed);
        let mut missed = Vec::new();
        for i in 0..self.bases.len() {
            let at = (first + i) % self.bases.len();
            let url = format!("{}{path}", self.bases[at]);
            let error = match self.once(&method, &url, payload.clone(), key).await {
                Ok((status, answer)) if undecided(status, &answer) => Miss::Undecided(
                    api_error(&method, path, status, &answer)
                        .context(format!("calling {method} {url}")),
                ),
                Ok((status, answer)) => {
                    self.current.store(at, Ordering::Relaxed);
                    if status.is_success() {
                        return Ok(answer);
                    }
                    return Err(api_error(&method, path, status, &answer));
                }
                Err(miss) => miss,
            };
            match error {
                Miss::Unknown(e) if !method.is_idempotent() && key.is_none() => {
                    return Err(e.context(format!(
                        "{method} {path} may have been carried out by the enforcer at {}, which \
                         did not answer; it was not sent again (see `gpuwarden leases`)",
                        self.bases[at]
                    )));
                }
                Miss::Undecided(e) | Miss::Unknown(e) => missed.push(e),
            }
        }
        if missed.len() == 1 {
            return Err(missed.remove(0));
        }
        let each: Vec<String> = missed.iter().map(|e| format!("{e:#}")).collect();
        anyhow::bail!(
            "no enforcer of the {} given decided {method} {path}: {}",
            self.bases.len(),
            each.join("; ")
        )
    }

    /// Asks the enforcer at `url` once: its answer's status and body (JSON, else the text as a
    /// JSON string), or how it failed.
    async fn once(
        &self,
        method: &Method,
        url: &str,
        payload: Option<Bytes>,
        key: Option<&str>,
    ) -> Result<(StatusCode, Value), Miss> {
        let calling = || format!("calling {method} {url}");
        let mut request = Request::builder().method(method.clone()).uri(url);
        if let Some(token) = &self.token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        if payload.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let request = request
            .body(Full::new(payload.unwrap_or_default()))
            .with_context(calling)
            .map_err(Miss::Undecided)?;
        let response = self.client.request(request).await.map_err(|e| {
            // A connection never made (refused, no route, a TLS handshake refused) carried
            // nothing; anything later may have carried the whole request.
            let connect = e.is_connect();
            let e = anyhow::Error::new(e).context(calling());
            if connect {
                Miss::Undecided(e)
            } else {
                Miss::Unknown(e)
            }
        })?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .with_context(calling)
            .map_err(Miss::Unknown)?
            .to_bytes();
        let value: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).trim().to_string()));
        Ok((status, value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn api_urls_are_trimmed_and_checked() {
        let items = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            bases(&items(&[" http://a:8080/ ", "", "https://b"])).unwrap(),
            ["http://a:8080", "https://b"]
        );
        assert_eq!(
            bases(&items(&["http://a", "b:8080"]))
                .unwrap_err()
                .to_string(),
            "--api must be an http:// or https:// URL, got b:8080"
        );
        assert!(bases(&items(&[" ", ""])).is_err());
    }

    #[test]
    fn only_a_store_unavailable_503_sends_a_call_to_another_enforcer() {
        let code = |c: &str| json!({"error": {"code": c, "message": "m"}});
        assert!(undecided(
            StatusCode::SERVICE_UNAVAILABLE,
            &code("store_unavailable")
        ));
        for (status, answer) in [
            (
                StatusCode::SERVICE_UNAVAILABLE,
                code("substrate_unavailable"),
            ),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                json!("Service Unavailable"),
            ),
            (StatusCode::INTERNAL_SERVER_ERROR, code("store_unavailable")),
            (StatusCode::CONFLICT, code("conflict")),
        ] {
            assert!(!undecided(status, &answer), "{status} {answer}");
        }
    }
}
