//! The pipeline's HTTP endpoint: `/metrics` for Prometheus, `/healthz` for probes.

use std::sync::Arc;

use axum::http::header;
use axum::routing::get;
use axum::Router;

use crate::metrics::Metrics;

/// The routes, ready to serve with `axum::serve`.
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = Arc::clone(&metrics);
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        metrics.render(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
}
