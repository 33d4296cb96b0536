//! What can go wrong in the lease lifecycle, by whose fault: the caller's (a field, a name that
//! does not exist, a change the lease's state or the principal's role does not allow), a
//! substrate's, the store's, or the enforcer's own. Each entry point maps it to its own terms:
//! the HTTP API to a status, the runtime rules to a retry or not.

use crate::store::StoreError;

/// A lease lifecycle failure.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The caller's request breaks a field's rule; nothing was changed.
    #[error("{field}: {message}")]
    Invalid {
        /// The field at fault, as a path (`gpus`, `labels.team`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The team, lease or substrate named does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The lease's state does not allow the change (it has ended, or has no end to extend).
    #[error("{0}")]
    Conflict(String),
    /// The principal may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// A substrate's driver failed or did not confirm; trying again may help. What the store
    /// holds says where the lease was left (failed, releasing, or put back as it was).
    #[error("{0}")]
    Substrate(String),
    /// The lease store failed (disk, SQLite); the change did not happen.
    #[error(transparent)]
    Store(StoreError),
    /// The enforcer broke one of its own rules: a bug.
    #[error("bug: {0}")]
    Bug(String),
}

impl ServiceError {
    /// The caller's `field` breaks its rule: `message` says how.
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl From<StoreError> for ServiceError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(_) => Self::NotFound(e.to_string()),
            StoreError::InvalidTransition { .. } | StoreError::KeyReused(_) => {
                Self::Conflict(e.to_string())
            }
            other => Self::Store(other),
        }
    }
}
