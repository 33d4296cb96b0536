//! The enforcer's view of what the pipeline measures: every signal on `gpuwarden.signals` goes
//! to the runtime rules ([`crate::rules`]) — team spend for the budget check and
//! blocks, lease utilization for idle reclaim and autoscale, unattributed GPUs for alerts.
//!
//! It reads in the consumer group `gpuwarden-enforcer` from the earliest offset the group has
//! not committed. A replay repeats nothing: the store keeps only the newest spend per team, and
//! the rules ignore a lease's older signals and record each step once.
//!
//! `gpuwarden enforce` (and `up` and `demo`, which contain it) runs it beside the admission API.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuwarden_schema::{topics, Record as _, Signal};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::Message as _;
use tokio::sync::mpsc;

use crate::rules::Rules;

/// Signals waiting for the rules; the consumer waits when the rules fall this far behind.
const QUEUE: usize = 1024;

/// Consumes signals until `stop` is set, handing each to `rules` in order. `client` carries the
/// bootstrap servers and `[kafka.properties]`. Runs the consumer on a blocking thread and the
/// rules on the runtime it is called from.
pub async fn run(client: ClientConfig, rules: Rules, stop: Arc<AtomicBool>) {
    let (tx, mut rx) = mpsc::channel::<Signal>(QUEUE);
    let consumer = tokio::task::spawn_blocking(move || consume(client, &tx, &stop));
    while let Some(signal) = rx.recv().await {
        if let Err(e) = rules.on_signal(&signal).await {
            tracing::warn!(error = %e, kind = signal.body.kind(), "acting on a signal failed");
        }
    }
    let _ = consumer.await;
}

fn consume(mut client: ClientConfig, tx: &mpsc::Sender<Signal>, stop: &AtomicBool) {
    gpuwarden_schema::kafka::low_latency(&mut client)
        .set("group.id", "gpuwarden-enforcer")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true");
    let consumer: BaseConsumer = match client.create() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot create the signals consumer; runtime rules are off and budgets use only the spend of open leases");
            return;
        }
    };
    if let Err(e) = consumer.subscribe(&[topics::SIGNALS]) {
        tracing::error!(error = %e, "cannot subscribe to signals; runtime rules are off and budgets use only the spend of open leases");
        return;
    }
    let mut last_warning: Option<Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Ok(message)) => match Signal::from_json(message.payload().unwrap_or_default()) {
                Ok(signal) => {
                    if tx.blocking_send(signal).is_err() {
                        return;
                    }
                }
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
