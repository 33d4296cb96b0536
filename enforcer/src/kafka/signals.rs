//! The enforcer's view of what the pipeline measures: every signal on `gpuwarden.signals` goes
//! to the runtime rules ([`crate::rules`]) — team spend for the budget check and
//! blocks, lease utilization for idle reclaim and autoscale, unattributed GPUs for alerts.
//!
//! It reads in the consumer group `gpuwarden-enforcer` from the earliest offset the group has
//! not committed. A replay repeats nothing: the store keeps only the newest spend per team, and
//! the rules ignore a lease's older signals and record each step once.
//!
//! Membership of the group (static `group.instance.id`, the session timeout) comes with the
//! client settings the caller hands in, so that a restarted enforcer takes its partitions back at
//! once. A consumer fenced out because another took its `group.instance.id` stops for good, and
//! says so at ERROR.
//!
//! Only signed signals are acted on: each must carry a `gpuwarden-signature` header made with
//! `[signing] key` (or `previous_key`, while keys rotate; see `gpuwarden_schema::signing`). One
//! unsigned or badly signed is refused before it is even decoded, counted in
//! `gpuwarden_enforcer_signals_total{signature}`, logged, and alerted on
//! ([`Rules::on_refused_signal`]). Without a key the enforcer refuses every signal.
//!
//! `gpuwarden enforce` (and `up` and `demo`, which contain it) runs it beside the admission API.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuwarden_schema::signing::{SigningKeys, Verdict};
use gpuwarden_schema::{topics, Record as _, Signal};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{BorrowedMessage, Message as _};
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::rules::Rules;

/// Signals waiting for the rules; the consumer waits when the rules fall this far behind.
const QUEUE: usize = 1024;

/// What the consumer hands to the rules.
enum Incoming {
    /// A signal whose signature checked out.
    Signed(Signal),
    /// A message refused for its signature (`Unsigned` or `Invalid`), and where it was read.
    Refused(Verdict, String),
}

/// Consumes signals until `stop` is set, handing each signed one to `rules` in order and
/// reporting the others. `client` carries the bootstrap servers and `[kafka.properties]`; `keys`
/// are `[signing]`'s. Runs the consumer on a blocking thread and the rules on the runtime it is
/// called from.
pub async fn run(client: ClientConfig, keys: SigningKeys, rules: Rules, stop: Arc<AtomicBool>) {
    if !keys.can_sign() {
        tracing::error!(
            "no [signing] key: every signal will be refused, so budgets, idle reclaim and \
             autoscaling will not act; set signing.key (the pipeline's too)"
        );
    }
    let (tx, mut rx) = mpsc::channel::<Incoming>(QUEUE);
    let metrics = Arc::clone(rules.metrics());
    let consumer =
        tokio::task::spawn_blocking(move || consume(client, &keys, &metrics, &tx, &stop));
    while let Some(incoming) = rx.recv().await {
        match incoming {
            Incoming::Signed(signal) => {
                if let Err(e) = rules.on_signal(&signal).await {
                    tracing::warn!(error = %e, kind = signal.body.kind(), "acting on a signal failed");
                }
            }
            Incoming::Refused(verdict, detail) => {
                if let Err(e) = rules.on_refused_signal(verdict, &detail).await {
                    tracing::warn!(error = %e, "recording a refused signal failed");
                }
            }
        }
    }
    let _ = consumer.await;
}

/// The signature check of one message (counted in `metrics`): a signed signal, or why it is
/// refused.
fn check(
    keys: &SigningKeys,
    metrics: &Metrics,
    message: &BorrowedMessage<'_>,
) -> Result<Incoming, String> {
    let payload = message.payload().unwrap_or_default();
    let verdict = keys.verify_message(message);
    metrics.count_signal(verdict);
    // Named only for a refusal or a bad payload: most signals are neither.
    let place = || {
        format!(
            "partition {}, offset {}",
            message.partition(),
            message.offset()
        )
    };
    if !verdict.trusted() {
        return Ok(Incoming::Refused(verdict, place()));
    }
    Signal::from_json(payload)
        .map(Incoming::Signed)
        .map_err(|e| format!("{}: {e}", place()))
}

fn consume(
    mut client: ClientConfig,
    keys: &SigningKeys,
    metrics: &Metrics,
    tx: &mpsc::Sender<Incoming>,
    stop: &AtomicBool,
) {
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
            Some(Ok(message)) => match check(keys, metrics, &message) {
                Ok(incoming) => {
                    if let Incoming::Refused(verdict, place) = &incoming {
                        tracing::warn!(signature = verdict.as_str(), at = %place, "refusing a signal that is not signed with the signing key");
                    }
                    if tx.blocking_send(incoming).is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "ignoring an invalid signal"),
            },
            Some(Err(e)) if consumer.client().fatal_error().is_some() => {
                tracing::error!(error = %e, instance = client.get("group.instance.id").unwrap_or("(dynamic member)"), "the signals consumer stopped for good (each enforcer needs its own kafka.group_instance_id); runtime rules are off until the enforcer restarts");
                return;
            }
            // Warn at most every 10 s while Kafka is unreachable.
            Some(Err(e)) if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) => {
                tracing::warn!(error = %e, "reading signals failed; retrying");
                last_warning = Some(Instant::now());
            }
            Some(Err(_)) => {}
        }
    }
}
