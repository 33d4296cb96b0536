//! The portal's static files, the stylesheet, the estimate's script and the icon, and the
//! routes that serve them under `/ui/static/`.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

use super::html;

/// The stylesheet, served at `/ui/static/portal.css`.
pub const ASSET_CSS: &str = include_str!("portal.css");
/// The live estimate's script, served at `/ui/static/portal.js`.
pub const ASSET_JS: &str = include_str!("portal.js");
/// The pages' icon (so that browsers do not ask for a `/favicon.ico` that is not there).
const ASSET_ICON: &str = r##"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" fill="#0d1117"/><path d="M4 4h8v8H4z" fill="none" stroke="#58a6ff" stroke-width="2"/></svg>"##;

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=300"),
    );
    html::secure_headers(headers);
    response
}

pub(super) async fn css() -> Response {
    asset("text/css; charset=utf-8", ASSET_CSS)
}

pub(super) async fn js() -> Response {
    asset("text/javascript; charset=utf-8", ASSET_JS)
}

pub(super) async fn icon() -> Response {
    asset("image/svg+xml", ASSET_ICON)
}
