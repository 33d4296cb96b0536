//! The Kafka-protocol broker of a test, in a process of its own: librdkafka's mock cluster (a
//! `gpuwarden broker`) or tansu; [`on_both_brokers!`] runs a scenario on each.

use std::path::Path;
use std::time::Duration;

use super::{eventually, tansu, Running};

/// Which Kafka-protocol broker a test runs against: the suites that talk to Kafka run on both
/// ([`on_both_brokers!`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerKind {
    /// librdkafka's mock cluster in a `gpuwarden broker` process.
    Mock,
    /// tansu, an independent implementation of the protocol, in memory ([`tansu`]).
    Tansu,
}

/// A broker in a process of its own, three partitions per topic, and its bootstrap address;
/// stopped when dropped.
pub struct Broker {
    pub bootstrap: String,
    pub kind: BrokerKind,
    _mock: Option<Running>,
    _tansu: Option<tansu::Tansu>,
}

impl Broker {
    /// A `gpuwarden broker` process (librdkafka's mock cluster).
    pub fn start(dir: &Path) -> Self {
        Self::of(BrokerKind::Mock, dir)
    }

    /// A broker of `kind`, its files (tansu's log) under `dir`.
    pub fn of(kind: BrokerKind, dir: &Path) -> Self {
        match kind {
            BrokerKind::Mock => {
                let file = dir.join("bootstrap.txt");
                let process = Running::start(
                    &[
                        "broker",
                        "--partitions",
                        "3",
                        "--bootstrap-file",
                        file.to_str().unwrap(),
                    ],
                    &[],
                );
                let bootstrap = eventually(
                    "the broker's bootstrap file",
                    Duration::from_secs(20),
                    || {
                        std::fs::read_to_string(&file)
                            .map_err(|e| format!("{}: {e}", file.display()))
                    },
                );
                Self {
                    bootstrap: bootstrap.trim().to_string(),
                    kind,
                    _mock: Some(process),
                    _tansu: None,
                }
            }
            BrokerKind::Tansu => {
                let broker = tansu::Tansu::start(dir, tansu::Storage::Memory, 3);
                Self {
                    bootstrap: broker.bootstrap.clone(),
                    kind,
                    _mock: None,
                    _tansu: Some(broker),
                }
            }
        }
    }
}

/// Makes `scenario` (a `fn(BrokerKind)`) two tests, `name::mock` and `name::tansu`, one on each
/// broker of [`BrokerKind`].
#[macro_export]
macro_rules! on_both_brokers {
    ($name:ident, $scenario:ident) => {
        mod $name {
            #[test]
            fn mock() {
                super::$scenario($crate::support::BrokerKind::Mock)
            }
            #[test]
            fn tansu() {
                super::$scenario($crate::support::BrokerKind::Tansu)
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use on_both_brokers;
