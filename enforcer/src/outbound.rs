//! The one HTTP client gpuwarden calls out with: alert webhooks, webhook provisioners (the
//! `webhook` driver) and the command line's calls to the enforcer's API.
//!
//! HTTP/1 over hyper-util's pooled client, with TLS through rustls and Mozilla's roots built in
//! (no system trust store needed), so `https://` and `http://` URLs both work; a caller that
//! trusts its own CA (the command line with `--ca-cert`, for an enforcer with a private
//! certificate) hands in its rustls settings instead. Each caller sets its own timeout per
//! attempt and retries with [`gpuwarden_schema::retry::Backoff`]; a connection that is not
//! made within [`CONNECT_TIMEOUT`] fails at once, so a caller with several addresses (the
//! command line with several enforcer replicas) moves on from a host that drops packets rather
//! than waiting for the system's connect timeout (minutes).

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// An HTTP/1 client for `http://` and `https://` URLs that sends a whole body at once. Cheap to
/// clone: clones share one connection pool.
pub type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The longest a TCP connection takes to be made before the call fails.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The TCP connector every client uses: any scheme (TLS is the wrapper's), [`CONNECT_TIMEOUT`].
fn connector() -> HttpConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http
}

/// A new client with its own connection pool.
pub fn http_client() -> HttpClient {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(gpuwarden_schema::tls::provider())
        .expect("ring's provider supports the default protocol versions")
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector());
    Client::builder(TokioExecutor::new()).build(https)
}

/// A new client whose `https://` calls use `tls` (its trusted CAs, its client certificate)
/// instead of Mozilla's roots.
pub fn http_client_with_tls(tls: rustls::ClientConfig) -> HttpClient {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector());
    Client::builder(TokioExecutor::new()).build(https)
}
