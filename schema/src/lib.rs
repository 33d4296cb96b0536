//! The contracts every gpuwarden component shares, and nothing else.
//!
//! Collector, pipeline and enforcer never import one another: they meet in Kafka topics, and this
//! crate is what they agree on there. It owns the four v1 records ([`Sample`], [`LeaseEvent`],
//! [`Signal`], [`Action`]), their JSON form (what travels on the topics), their Arrow form (what the
//! lake stores), their validation, the topic names, the [`Clock`] that drives event time (and the one place the
//! wall clock is read), the retry pause every component waits between tries ([`retry`]), how many
//! failed logins a client may make ([`login_limit`]), the one configuration file every
//! process reads ([`config`]), and the versions of what gpuwarden persists ([`mod@format`]). It does
//! no I/O beyond reading that file, except behind its features: `kafka` (Kafka client settings, topic creation, the embedded broker) and `tls` (the
//! listeners' certificates, read again when they change).

pub mod action;
pub mod arrow;
pub mod calendar;
pub mod clock;
pub mod config;
pub mod error;
pub mod fleet;
pub mod format;
pub mod json_schema;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod kubernetes;
pub mod lease;
pub mod libvirt;
pub mod log_throttle;
pub mod login_limit;
pub mod prom;
pub mod record;
pub mod retry;
pub mod sample;
pub mod sample_row;
pub mod signal;
pub mod signing;
#[cfg(feature = "tls")]
pub mod tls;
pub mod topics;
pub mod version;

pub use action::{Action, ActionKind, Outcome};
pub use clock::{end_after, AcceleratedClock, Clock, ManualClock, SystemClock, LATEST_MS};
pub use error::{ArrowConvertError, DecodeError, ValidationError};
pub use lease::{LeaseEvent, LeaseEventKind, ReleaseReason, Workload};
pub use record::Record;
pub use sample::Sample;
pub use signal::{Signal, SignalBody};
pub use version::V1;
