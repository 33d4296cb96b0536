//! The self-service commands' side of the enforcer's HTTP API: where it is, the bearer token,
//! whom to trust when it is `https://` (the system of Mozilla's roots, or the CA of `--ca-cert`,
//! with a client certificate when the enforcer asks for one), and one JSON call over the
//! enforcer's outbound client ([`gpuwarden_enforcer::outbound`]). Errors the API answers
//! (4xx/5xx) become errors carrying its message.

use anyhow::Context as _;
use bytes::Bytes;
use std::path::PathBuf;

use gpuwarden_enforcer::outbound::{http_client, http_client_with_tls, HttpClient};
use http_body_util::{BodyExt as _, Full};
use hyper::header;
use hyper::{Method, Request, StatusCode};
use serde_json::Value;

/// Where the enforcer is and who is calling; flattened into each self-service command.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ApiArgs {
    /// Base URL of the enforcer's API.
    #[arg(
        long,
        value_name = "URL",
        env = "GPUWARDEN_API",
        default_value = "http://127.0.0.1:8080"
    )]
    api: String,
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
    base: String,
    token: Option<String>,
    client: HttpClient,
}

impl ApiClient {
    /// A client of the API at `base` (an http:// URL, or https:// with a certificate from a
    /// public CA) with `token`.
    pub(crate) fn to(base: &str, token: Option<&str>) -> Self {
        Self {
            base: base.trim_end_matches('/').to_string(),
            token: token.map(str::to_string),
            client: http_client(),
        }
    }

    pub(crate) fn new(args: &ApiArgs) -> anyhow::Result<Self> {
        let mut client = Self::to(&args.api, args.token.as_deref());
        let https = client.base.starts_with("https://");
        anyhow::ensure!(
            https || client.base.starts_with("http://"),
            "--api must be an http:// or https:// URL, got {}",
            client.base
        );
        if let Some(ca) = &args.ca_cert {
            anyhow::ensure!(
                https,
                "--ca-cert is for an https:// API, but --api is {}",
                client.base
            );
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

    /// One call; the body of a 2xx answer as JSON, or an error naming the API's reason.
    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let url = format!("{}{path}", self.base);
        let mut request = Request::builder().method(method.clone()).uri(&url);
        if let Some(token) = &self.token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let payload = match body {
            Some(body) => {
                request = request.header(header::CONTENT_TYPE, "application/json");
                Bytes::from(serde_json::to_vec(body)?)
            }
            None => Bytes::new(),
        };
        let response = self
            .client
            .request(request.body(Full::new(payload))?)
            .await
            .with_context(|| format!("calling {method} {url}"))?;
        let status = response.status();
        let bytes = response.into_body().collect().await?.to_bytes();
        let value: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).trim().to_string()));
        if status.is_success() {
            return Ok(value);
        }
        let message = value
            .pointer("/error/message")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| value.to_string());
        let hint = match status {
            StatusCode::UNAUTHORIZED => " (set --token or GPUWARDEN_TOKEN)",
            _ => "",
        };
        anyhow::bail!("{method} {path}: {status}: {message}{hint}")
    }
}
