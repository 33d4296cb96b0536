//! The enforcer: the admission API that provisioning front-ends call before a GPU environment
//! exists, the durable lease store, the runtime rules that act on signals (idle reclaim, expiry,
//! budget blocks, autoscale), and the substrate drivers that carry actions out.
//!
//! It depends on `gpuwarden-schema` only: it meets the collector and the pipeline in Kafka topics.
//! Its modules are layers; each uses only those below it:
//!
//! - [`fields`], [`metrics`]: request field rules and counters;
//! - [`drivers`]: act on substrates (one trait, one registry);
//! - [`policy`]: decides (pure: a function of the request, a snapshot and the placement state);
//! - [`store`]: remembers (SQLite, with an outbox for Kafka; [`store::audit`] builds every Action);
//! - [`service`]: the lease lifecycle over the three, with a typed error saying whose fault;
//! - [`rules`]: act on the pipeline's signals through the service (alerting through [`alerts`]);
//! - [`api`]: translates between HTTP and the service.

pub mod alerts;
pub mod api;
pub mod drivers;
pub mod fields;
pub mod metrics;
pub mod policy;
pub mod rules;
pub mod service;
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
