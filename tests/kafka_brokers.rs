//! Where tansu, the independent broker the Kafka-facing suites also run on
//! (tests/support/tansu.rs), departs from Kafka's documented behaviour in a way a test works
//! around: each departure shown with a plain librdkafka client, nothing of gpuwarden's. When one
//! of these fails, tansu has changed: the workaround it names can go. docs/src/operators/kafka-brokers.md
//! lists them with their reproductions.

mod support;

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use support::tansu::{Storage, Tansu};

const TOPIC: &str = "gpuwarden.actions";

fn static_member(bootstrap: &str, id: &str) -> BaseConsumer {
    let consumer: BaseConsumer = support::kafka::client(bootstrap)
        .set("group.id", "departure")
        .set("group.instance.id", id)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "600")
        .create()
        .unwrap();
    consumer.subscribe(&[TOPIC]).unwrap();
    consumer
}

fn assigned(consumer: &BaseConsumer) -> usize {
    consumer.assignment().map_or(0, |a| a.count())
}

/// KIP-345 (Kafka 2.3): a static member that stops heartbeating is removed from its group once
/// `session.timeout.ms` has passed, and its partitions go to the members left. tansu rebalances
/// then but leaves the dead member in the group with its partitions, for good. Worked around in
/// tests/pipeline.rs (two pipelines, one killed): on tansu its members are dynamic.
#[test]
fn tansu_keeps_the_partitions_of_a_static_member_whose_session_expired() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Tansu::start(dir.path(), Storage::Memory, 3);
    let survivor = static_member(&broker.bootstrap, "survivor");
    let victim = static_member(&broker.bootstrap, "victim");
    support::eventually(
        "both members hold partitions",
        Duration::from_secs(60),
        || {
            let _ = survivor.poll(Duration::from_millis(50));
            let _ = victim.poll(Duration::from_millis(50));
            match (assigned(&survivor), assigned(&victim)) {
                (a, b) if a > 0 && b > 0 && a + b == 3 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    );
    // A static member closing sends no LeaveGroup (KIP-345): to the broker it is a member that
    // stopped heartbeating, as one killed would be.
    drop(victim);
    let gone = Instant::now();
    let mut most = 0;
    while gone.elapsed() < Duration::from_secs(30) {
        let _ = survivor.poll(Duration::from_millis(100));
        most = most.max(assigned(&survivor));
    }
    assert!(
        most < 3,
        "tansu now hands the partitions of a static member whose session expired to the others, \
         as Kafka does: on tansu, tests/pipeline.rs may use static members again"
    );
    println!(
        "30 s (five session timeouts) after the static member went: the survivor holds {most} of 3 partitions"
    );
}
