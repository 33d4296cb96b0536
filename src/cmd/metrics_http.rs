//! The `/metrics` and `/healthz` endpoint every long-running command serves: the component's
//! crate renders its metrics, this serves them.

use axum::http::header;
use axum::routing::get;
use axum::Router;

/// Routes serving `render()` as Prometheus text on `/metrics`, and `ok` on `/healthz`.
pub(crate) fn router(render: impl Fn() -> String + Clone + Send + Sync + 'static) -> Router {
    metrics_only(render).route("/healthz", get(|| async { "ok\n" }))
}

/// Only the `/metrics` route, for a server that answers `/healthz` itself (the enforcer's API).
pub(crate) fn metrics_only(render: impl Fn() -> String + Clone + Send + Sync + 'static) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let render = render.clone();
            async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    render(),
                )
            }
        }),
    )
}
