//! The enforcer: the admission API that provisioning front-ends call before a GPU environment
//! exists, the durable lease store, the runtime rules that act on signals (idle reclaim, expiry,
//! budget blocks, autoscale), and the substrate drivers that carry actions out.
//!
//! It depends on `gpuwarden-schema` only: it meets the collector and the pipeline in Kafka topics.
//! Its modules are layers; each uses only those above it in this list, never one below:
//!
//! - [`fields`]: the rules request fields follow; [`outbound`]: the one HTTP client for calls
//!   out (webhooks, alerts);
//! - [`drivers`]: act on substrates (one trait, one registry);
//! - [`policy`]: decides (pure: a function of the request, a snapshot and the placement state);
//! - [`store`]: remembers (SQLite, with an outbox for Kafka; [`store::audit`] builds every Action);
//! - [`metrics`]: the enforcer's counters;
//! - [`service`]: the lease lifecycle over the four, with a typed error saying whose fault;
//! - [`alerts`], [`rules`]: act on the pipeline's signals through the service, alerting through
//!   webhooks;
//! - [`api`]: translates between HTTP and the service;
//! - [`portal`]: the self-service web pages under `/ui/`, over the API's sign-in and the
//!   service; [`scorecard`]: the maturity scorecard (pure: config and evidence);
//! - [`kafka`]: the store's outbox to Kafka, and Kafka's signals to the rules.
//!
//! Retries back off with `gpuwarden_schema::retry::Backoff` and time comes from the schema's
//! clock, as everywhere in gpuwarden.
//!
//! `docs/ARCHITECTURE.md` ("The enforcer") draws the same map.

pub mod alerts;
pub mod api;
pub mod drivers;
pub mod fields;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod kubernetes;
pub mod metrics;
pub mod outbound;
pub mod policy;
pub mod portal;
pub mod rules;
pub mod scorecard;
pub mod service;
pub mod slurm;
pub mod store;

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
