//! The contracts every gpuwarden component shares, and nothing else.
//!
//! Collector, pipeline and enforcer never import one another: they meet in Kafka topics, and this
//! crate is what they agree on there. It owns the four v1 records ([`Sample`], [`LeaseEvent`],
//! [`Signal`], [`Action`]), their JSON form (what travels on the topics), their Arrow form (what
//! the lake stores), their validation, the topic names, the [`Clock`] that drives event time (and
//! the one place the wall clock is read), the retry pause every component waits between tries
//! ([`retry`]), how many failed logins a client may make ([`login_limit`]), the one configuration
//! file every process reads ([`config`]), and the versions of what gpuwarden persists
//! ([`mod@format`]). It does no I/O beyond reading that file, except behind its features: `kafka`
//! (Kafka client settings, topic creation, the embedded broker) and `tls` (the listeners'
//! certificates, read again when they change).
//!
//! # Layers
//!
//! Modules are declared lowest layer first; a module uses only modules above it in this list
//! (`tests/workspace.rs` checks it):
//!
//! - the parts of a record: [`version`], [`error`], [`topics`], then [`record`] and
//!   [`mod@arrow`] (`error`);
//! - what knows no record: [`clock`], [`calendar`], [`retry`], [`log_throttle`], [`prom`],
//!   [`mod@format`];
//! - the four records, over their parts: [`sample`] (and [`sample_row`], the pipeline's
//!   borrowed form of it), [`lease`], [`signal`], [`action`]; then [`json_schema`] (all four);
//! - the names of other systems that the config checks: [`kubernetes`], [`libvirt`];
//! - [`config`] (`format`, `kubernetes`, `lease`, `libvirt`);
//! - what reads the config: [`fleet`], [`login_limit`], [`signing`], and behind their features
//!   `kafka` (also `topics`, `log_throttle`, `prom`) and `tls` (also `prom`).

pub mod version;
pub mod error;
pub mod topics;
pub mod record;
pub mod arrow;
pub mod clock;
pub mod calendar;
pub mod retry;
pub mod log_throttle;
pub mod prom;
pub mod format;
pub mod sample;
pub mod sample_row;
pub mod lease;
pub mod signal;
pub mod action;
pub mod json_schema;
pub mod kubernetes;
pub mod libvirt;
pub mod config;
pub mod fleet;
pub mod login_limit;
pub mod signing;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "tls")]
pub mod tls;

pub use action::{Action, ActionKind, Outcome};
pub use clock::{end_after, AcceleratedClock, Clock, ManualClock, SystemClock, LATEST_MS};
pub use error::{ArrowConvertError, DecodeError, ValidationError};
pub use lease::{LeaseEvent, LeaseEventKind, ReleaseReason, Workload};
pub use record::Record;
pub use sample::Sample;
pub use signal::{Signal, SignalBody};
pub use version::V1;
