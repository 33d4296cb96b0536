//! The enforcer: the admission API that provisioning front-ends call before a GPU environment
//! exists, the durable lease store, the runtime rules that act on signals (idle reclaim, expiry,
//! budget blocks, autoscale), and the substrate drivers that carry actions out.
//!
//! It depends on `gpuwarden-schema` only: it meets the collector and the pipeline in Kafka topics.
//! [`policy`] decides (pure), [`store`] remembers (SQLite, with an outbox for Kafka), [`api`]
//! translates between HTTP and both, [`rules`] act on the pipeline's signals (alerting through
//! [`alerts`]), and [`drivers`] act on substrates.

pub mod alerts;
pub mod api;
pub mod drivers;
pub mod fields;
pub mod kafka;
pub mod metrics;
pub mod outbound;
pub mod policy;
pub mod rules;
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
