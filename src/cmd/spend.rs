//! The enforcer's view of what the pipeline measures: every `team_spend` signal on
//! `gpuwarden.signals` goes into the lease store, so that admission's budget check starts from
//! the pipeline's month-to-date spend (the store adds what open leases accrued since).
//!
//! It reads in the consumer group `gpuwarden-enforcer` from the earliest offset the group has
//! not committed; the store keeps only the newest figure per team, so a replay changes nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuwarden_enforcer::store::Store;
use gpuwarden_schema::{topics, Record as _, Signal, SignalBody};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::Message as _;

/// Consumes team spend until `stop` is set.
pub(crate) fn run(mut client: ClientConfig, store: Store, stop: Arc<AtomicBool>) {
    client
        .set("group.id", "gpuwarden-enforcer")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true");
    let consumer: BaseConsumer = match client.create() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot create the team spend consumer; budgets use only the spend of open leases");
            return;
        }
    };
    if let Err(e) = consumer.subscribe(&[topics::SIGNALS]) {
        tracing::error!(error = %e, "cannot subscribe to signals; budgets use only the spend of open leases");
        return;
    }
    let mut last_warning: Option<Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Ok(message)) => match Signal::from_json(message.payload().unwrap_or_default()) {
                Ok(Signal {
                    ts_ms,
                    body:
                        SignalBody::TeamSpend {
                            team,
                            month_to_date_usd,
                            burn_usd_per_hour,
                        },
                    ..
                }) => {
                    if let Err(e) = store
                        .record_team_spend(&team, month_to_date_usd, burn_usd_per_hour, ts_ms)
                        .wait()
                    {
                        tracing::warn!(error = %e, team, "recording team spend failed");
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, offset = message.offset(), "ignoring an invalid signal")
                }
            },
            // Warn at most every 10 s while Kafka is unreachable.
            Some(Err(e)) if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) => {
                tracing::warn!(error = %e, "reading signals failed; retrying");
                last_warning = Some(Instant::now());
            }
            Some(Err(_)) => {}
        }
    }
}
