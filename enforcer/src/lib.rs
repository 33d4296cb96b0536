//! The enforcer: the admission API that provisioning front-ends call before a GPU environment
//! exists, the durable lease store, the runtime rules that act on signals (idle reclaim, expiry,
//! budget blocks, autoscale), the substrate drivers that carry actions out, and the front doors
//! through which substrates ask admission themselves (a Slurm submit hook, a Kubernetes admission
//! webhook, a Kueue admission check).
//!
//! It depends on `gpuwarden-schema` only: it meets the collector and the pipeline in Kafka topics.
//!
//! Modules are declared lowest layer first; a module uses only modules above it in this list
//! (`tests/workspace.rs` checks it):
//!
//! - [`fields`]: the rules request fields follow; [`outbound`]: the one HTTP client for calls
//!   out (webhooks, alerts); [`scorecard`]: the maturity scorecard (pure: config and evidence);
//! - [`inventory`]: what a substrate has and whom it refuses, as its driver reports them;
//! - [`policy`]: decides (pure: a function of the request, a snapshot and the placement state);
//! - [`store`]: remembers (SQLite or PostgreSQL, with an outbox for Kafka; [`store::audit`]
//!   builds every Action);
//! - [`drivers`]: act on substrates (one trait, one registry); the one thing a driver writes to
//!   the store, where the substrate holds a lease (the Kubernetes driver's pods), goes through
//!   [`drivers::LeaseRefs`], which the service implements;
//! - [`metrics`]: the enforcer's counters;
//! - [`service`]: the lease lifecycle over the ones above, with a typed error saying whose
//!   fault; nothing above it holds the store, and nothing below it writes the store but
//!   through it;
//! - [`door`]: the one adapter between every front door and admission: a door's request into
//!   the service's admission request, the service's answer into what the door says;
//! - [`alerts`], [`rules`]: act on the pipeline's signals through the service, alerting through
//!   webhooks; [`kafka`]: the store's outbox to Kafka, and Kafka's signals to the rules;
//! - [`web`]: what the doors served over HTTP with bearer tokens share (callers, JSON bodies,
//!   the one error shape);
//! - the doors, each with its routes: [`slurm`] (the submit hook, and the watcher of the
//!   queue), [`kubernetes`] (the admission webhook, the pod watcher, the Kueue admission check),
//!   [`api`] (the HTTP API for front-ends, and the router that mounts the Slurm hook's routes
//!   beside it), [`portal`] (the self-service web pages under `/ui/`).
//!
//! Retries back off with `gpuwarden_schema::retry::Backoff` and time comes from the schema's
//! clock, as everywhere in gpuwarden.
//!
//! `docs/ARCHITECTURE.md` and `docs/src/contributors/enforcer.md` draw the same map.

pub mod fields;
pub mod outbound;
pub mod scorecard;
pub mod inventory;
pub mod policy;
pub mod store;
pub mod drivers;
pub mod metrics;
pub mod service;
pub mod door;
pub mod alerts;
pub mod rules;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod web;
pub mod slurm;
pub mod kubernetes;
pub mod api;
pub mod portal;

/// Randomized tests' numbers: a seeded xorshift, the same sequence on every run.
#[cfg(test)]
pub(crate) fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |below| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    }
}
