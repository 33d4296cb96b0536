//! The SQL endpoint: serves a DataFusion session over the Postgres wire protocol, so that psql,
//! Grafana and any other Postgres client query the lake. datafusion-postgres (on pgwire) speaks
//! the protocol and answers the catalog queries clients send; this module owns what the library
//! leaves open, one job per submodule, each using only those before it:
//!
//! - `settings`: what a client may read and set (`current_setting`, `gpuwarden.as_of`,
//!   `statement_timeout`), and what it may not (DataFusion's settings, which every connection
//!   shares);
//! - `catalog`: what Postgres clients query besides the lake (`information_schema` shaped as
//!   Postgres's, `pg_catalog`, the functions their discovery queries call);
//! - `filter`: what may run: queries and the session statements clients send on connect, never
//!   anything that writes or changes the session every connection shares;
//! - `login`: who may connect (SCRAM-SHA-256 against `[[pipeline.sql_users]]`, anonymous only
//!   when `pipeline.sql_allow_anonymous` is set, TLS when served, failed logins limited);
//! - `serve`: the threads, the accept loop and each connection, whose queries the
//!   [`crate::governor::Governor`] runs under its user's limits.
//!
//! It talks to nothing but its listener and the session it is given.

// In layer order, one group each, so that rustfmt keeps the order.
mod settings;

mod catalog;

mod filter;

mod login;

mod serve;

use datafusion::error::DataFusionError;

pub use login::Auth;
pub use serve::{serve, Server};
pub use settings::AS_OF_SETTING;

/// Why the endpoint could not be served.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The session could not be given the Postgres catalog and functions clients expect
    /// (an internal error: nothing the operator configured is at fault).
    #[error("preparing the SQL session for Postgres clients: {0}")]
    Session(#[source] DataFusionError),
    /// The threads that handle connections could not be started, or the listener handed to
    /// them.
    #[error("starting the SQL endpoint's threads: {0}")]
    Threads(#[source] std::io::Error),
}
