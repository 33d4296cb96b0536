//! The enforcer: the admission API that provisioning front-ends call before a GPU environment
//! exists, the durable lease store, the runtime rules that act on signals (idle reclaim, expiry,
//! budget blocks, autoscale), and the substrate drivers that carry actions out.
//!
//! It depends on `gpuwarden-schema` only: it meets the collector and the pipeline in Kafka topics.
//! Its API, policy engine, store and drivers arrive with their issues; this crate is where they go.

pub mod drivers;
