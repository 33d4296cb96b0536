//! Why a query stopped, and the SQLSTATE Postgres clients (psql, Grafana, JDBC) know it by.

use std::error::Error;
use std::time::Duration;

use datafusion::error::DataFusionError;

/// Why a query was stopped before it ended by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Reason {
    /// The client asked (a Postgres cancel request: Ctrl-C in psql).
    Canceled = 1,
    /// It ran past its statement timeout.
    Timeout = 2,
    /// The process is shutting down.
    Shutdown = 3,
    /// The client went away.
    Disconnected = 4,
}

impl Reason {
    pub(crate) fn from_u8(value: u8) -> Option<Self> {
        Some(match value {
            1 => Self::Canceled,
            2 => Self::Timeout,
            3 => Self::Shutdown,
            4 => Self::Disconnected,
            _ => return None,
        })
    }
}

/// A query the governor stopped or refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum QueryError {
    /// Canceled by its client.
    #[error("canceling statement due to user request")]
    Canceled,
    /// Past its statement timeout.
    #[error(
        "canceling statement due to statement timeout ({}, {set_by})",
        humantime::format_duration(*limit)
    )]
    Timeout {
        /// The timeout it ran past.
        limit: Duration,
        /// Which setting set it.
        set_by: String,
    },
    /// The process is shutting down.
    #[error("terminating statement due to administrator command (the server is shutting down)")]
    Shutdown,
    /// Its client disconnected.
    #[error("canceling statement: the client disconnected")]
    Disconnected,
    /// A connection that has not logged in (pgwire reads on after refusing a startup).
    #[error("not logged in")]
    NotLoggedIn,
    /// The user runs as many queries as they may.
    #[error(
        "too many queries: user \"{user}\" already runs {limit} (max_queries), and none ended \
         within {} (pipeline.sql_limits.queue_timeout)",
        humantime::format_duration(*waited)
    )]
    TooManyOfUser {
        /// Who.
        user: String,
        /// Their maximum.
        limit: usize,
        /// How long the query waited for one of theirs to end.
        waited: Duration,
    },
    /// All users together run as many queries as the server allows.
    #[error(
        "too many queries: the server already runs {limit} \
         (pipeline.sql_limits.max_queries), and none ended within {} \
         (pipeline.sql_limits.queue_timeout)",
        humantime::format_duration(*waited)
    )]
    TooMany {
        /// The maximum.
        limit: usize,
        /// How long the query waited.
        waited: Duration,
    },
}

impl QueryError {
    /// Its SQLSTATE.
    pub fn code(&self) -> &'static str {
        match self {
            // query_canceled
            Self::Canceled | Self::Timeout { .. } | Self::Disconnected => "57014",
            // admin_shutdown
            Self::Shutdown => "57P01",
            // invalid_authorization_specification
            Self::NotLoggedIn => "28000",
            // too_many_connections: what Postgres answers past its connection limits too.
            Self::TooManyOfUser { .. } | Self::TooMany { .. } => "53300",
        }
    }
}

impl From<QueryError> for DataFusionError {
    fn from(error: QueryError) -> Self {
        DataFusionError::External(Box::new(error))
    }
}

/// The SQLSTATE and message of an error a query ended with, when the governor or a limit is
/// the cause: [`QueryError`]s, and DataFusion's "resources exhausted" (a query that needed more
/// memory than its pool holds) as 53200, out_of_memory. `None` for any other error.
pub fn sqlstate(error: &(dyn Error + 'static)) -> Option<(&'static str, String)> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(query) = error.downcast_ref::<QueryError>() {
            return Some((query.code(), query.to_string()));
        }
        match error.downcast_ref::<DataFusionError>() {
            Some(DataFusionError::ResourcesExhausted(why)) => {
                return Some((
                    "53200",
                    format!(
                        "out of memory: the query needs more memory than it may hold \
                         (query_memory of pipeline.sql_limits or of the user), even after \
                         spilling what can be spilled to disk. {why}"
                    ),
                ))
            }
            // Shared errors (one error seen by several partitions) hide behind an Arc.
            Some(DataFusionError::Shared(shared)) => {
                next = Some(shared.as_ref());
                continue;
            }
            _ => {}
        }
        next = error.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn limits_are_found_under_the_errors_that_wrap_them() {
        let timeout = DataFusionError::from(QueryError::Timeout {
            limit: Duration::from_secs(2),
            set_by: "statement_timeout of user \"hasty\"".into(),
        })
        .context("while running the query");
        let (code, message) = sqlstate(&timeout).unwrap();
        assert_eq!(code, "57014");
        assert!(message.contains("statement timeout (2s"), "{message}");

        let memory = DataFusionError::Shared(Arc::new(DataFusionError::ResourcesExhausted(
            "Failed to allocate 1 MB".into(),
        )));
        let arrow = datafusion::arrow::error::ArrowError::ExternalError(Box::new(memory));
        let (code, message) = sqlstate(&arrow).unwrap();
        assert_eq!(code, "53200");
        assert!(message.contains("Failed to allocate 1 MB"), "{message}");

        assert_eq!(
            sqlstate(&DataFusionError::from(QueryError::TooMany {
                limit: 16,
                waited: Duration::ZERO
            }))
            .unwrap()
            .0,
            "53300"
        );
        assert!(sqlstate(&DataFusionError::Plan("no such table".into())).is_none());
    }
}
