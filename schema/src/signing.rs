//! Signatures on the records the pipeline and the enforcer send each other through Kafka, so
//! that whoever can write a topic cannot make the enforcer act or the lake count.
//!
//! The signer puts a header on each message, `gpuwarden-signature: v1=<hex>`, whose value is
//! HMAC-SHA256, under the shared key `[signing] key`, of the topic, the message key and the
//! payload, each length-prefixed (a signal cannot be replayed as an action, nor its key swapped).
//! The payload is the record's JSON as sent; the record contracts are unchanged.
//!
//! Rotation: `[signing] previous_key` is accepted too while keys change. Every part both signs
//! and checks, so it takes three steps, each everywhere before the next: `key = old,
//! previous_key = new`; then `key = new, previous_key = old`; then `previous_key` dropped.
//!
//! Who signs and who checks (docs/src/contributors/delivery.md#trust-between-the-parts): the pipeline signs
//! `gpuwarden.signals`, which the enforcer refuses unsigned or badly signed; the enforcer signs
//! `gpuwarden.leases` and `gpuwarden.actions`, which the pipeline quarantines unsigned or badly
//! signed when it has a key.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::config::SigningConfig;

/// The Kafka header that carries the signature.
pub const HEADER: &str = "gpuwarden-signature";

/// The scheme tag before the signature's hex digits.
const SCHEME: &str = "v1=";

/// What checking a message's signature found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Signed with `[signing] key`.
    Current,
    /// Signed with `[signing] previous_key` (a rotation is under way).
    Previous,
    /// No signature header.
    Unsigned,
    /// A signature matching neither key, or one that is not `v1=<64 hex digits>`.
    Invalid,
}

impl Verdict {
    /// Every verdict, in a stable order (for counters by verdict).
    pub const ALL: [Verdict; 4] = [Self::Current, Self::Previous, Self::Unsigned, Self::Invalid];

    /// Whether the message may be trusted.
    pub fn trusted(self) -> bool {
        matches!(self, Self::Current | Self::Previous)
    }

    /// `current`, `previous`, `unsigned`, `invalid`: for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Current => "current",
            Self::Previous => "previous",
            Self::Unsigned => "unsigned",
            Self::Invalid => "invalid",
        }
    }
}

/// The keys of `[signing]`.
#[derive(Clone, Default)]
pub struct SigningKeys {
    current: Option<Vec<u8>>,
    previous: Option<Vec<u8>>,
}

impl std::fmt::Debug for SigningKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKeys")
            .field("current", &self.current.as_ref().map(|_| "<set>"))
            .field("previous", &self.previous.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl SigningKeys {
    /// The keys of a `[signing]` section (validated by the config's checks).
    pub fn from_config(config: &SigningConfig) -> Self {
        Self {
            current: config.key.as_ref().map(|k| k.as_bytes().to_vec()),
            previous: config.previous_key.as_ref().map(|k| k.as_bytes().to_vec()),
        }
    }

    /// Keys from raw bytes: `current` signs and verifies, `previous` only verifies.
    pub fn new(current: Option<&[u8]>, previous: Option<&[u8]>) -> Self {
        Self {
            current: current.map(<[u8]>::to_vec),
            previous: previous.map(<[u8]>::to_vec),
        }
    }

    /// Whether there is a key to sign with.
    pub fn can_sign(&self) -> bool {
        self.current.is_some()
    }

    /// The header value that signs a message, or none without a key.
    pub fn sign(&self, topic: &str, key: &[u8], payload: &[u8]) -> Option<String> {
        let mac = tag(self.current.as_deref()?, topic, key, payload);
        Some(format!("{SCHEME}{}", hex::encode(mac)))
    }

    /// Checks `header` (the value of [`HEADER`], if the message had one) against both keys, in
    /// constant time for each.
    pub fn verify(
        &self,
        topic: &str,
        key: &[u8],
        payload: &[u8],
        header: Option<&[u8]>,
    ) -> Verdict {
        let Some(header) = header else {
            return Verdict::Unsigned;
        };
        let Some(given) = header
            .strip_prefix(SCHEME.as_bytes())
            .and_then(|h| hex::decode(h).ok())
        else {
            return Verdict::Invalid;
        };
        for (secret, verdict) in [
            (self.current.as_deref(), Verdict::Current),
            (self.previous.as_deref(), Verdict::Previous),
        ] {
            let Some(secret) = secret else { continue };
            let mut mac = keyed(secret);
            feed(&mut mac, topic, key, payload);
            if mac.verify_slice(&given).is_ok() {
                return verdict;
            }
        }
        Verdict::Invalid
    }
}

/// The same over Kafka messages (feature `kafka`): the header to put on a message, and the check
/// of a message read, over its own topic, key, payload and header.
#[cfg(feature = "kafka")]
impl SigningKeys {
    /// Headers that sign a message, or none without a key.
    pub fn headers(
        &self,
        topic: &str,
        key: &[u8],
        payload: &[u8],
    ) -> Option<rdkafka::message::OwnedHeaders> {
        let signature = self.sign(topic, key, payload)?;
        Some(
            rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                key: HEADER,
                value: Some(&signature),
            }),
        )
    }

    /// What a reader that checks only when it has a key to check with (the pipeline) makes of a
    /// message: none when it may be used (signed with either key, or there is no key), else why
    /// not. The enforcer, which acts on signals, uses [`Self::verify_message`] and refuses them
    /// even without a key.
    pub fn refusal<M: rdkafka::message::Message>(&self, message: &M) -> Option<Verdict> {
        if !self.can_sign() {
            return None;
        }
        let verdict = self.verify_message(message);
        (!verdict.trusted()).then_some(verdict)
    }

    /// Checks a message read from Kafka.
    pub fn verify_message<M: rdkafka::message::Message>(&self, message: &M) -> Verdict {
        use rdkafka::message::Headers as _;
        let header = message
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == HEADER))
            .and_then(|h| h.value);
        self.verify(
            message.topic(),
            message.key().unwrap_or_default(),
            message.payload().unwrap_or_default(),
            header,
        )
    }
}

fn keyed(secret: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length.
    <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC accepts any key length")
}

fn feed(mac: &mut Hmac<Sha256>, topic: &str, key: &[u8], payload: &[u8]) {
    for part in [topic.as_bytes(), key, payload] {
        let len = u64::try_from(part.len()).unwrap_or(u64::MAX);
        mac.update(&len.to_be_bytes());
        mac.update(part);
    }
}

fn tag(secret: &[u8], topic: &str, key: &[u8], payload: &[u8]) -> [u8; 32] {
    let mut mac = keyed(secret);
    feed(&mut mac, topic, key, payload);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEW: &[u8] = b"0123456789abcdef0123456789abcdef-new";
    const OLD: &[u8] = b"0123456789abcdef0123456789abcdef-old";

    #[test]
    fn a_signed_message_verifies_and_any_change_breaks_it() {
        let keys = SigningKeys::new(Some(NEW), None);
        let header = keys.sign("gpuwarden.signals", b"ml", b"{}").expect("signs");
        assert!(
            header.starts_with("v1=") && header.len() == 3 + 64,
            "{header}"
        );
        let check = |topic: &str, key: &[u8], payload: &[u8], h: Option<&[u8]>| {
            keys.verify(topic, key, payload, h)
        };
        let h = Some(header.as_bytes());
        assert_eq!(
            check("gpuwarden.signals", b"ml", b"{}", h),
            Verdict::Current
        );
        assert_eq!(
            check("gpuwarden.actions", b"ml", b"{}", h),
            Verdict::Invalid
        );
        assert_eq!(
            check("gpuwarden.signals", b"cv", b"{}", h),
            Verdict::Invalid
        );
        assert_eq!(
            check("gpuwarden.signals", b"ml", b"{ }", h),
            Verdict::Invalid
        );
        // Moving a byte from the key to the payload changes the length prefixes.
        assert_eq!(
            check("gpuwarden.signals", b"m", b"l{}", h),
            Verdict::Invalid
        );
        assert_eq!(
            check("gpuwarden.signals", b"ml", b"{}", None),
            Verdict::Unsigned
        );
        for bad in ["", "v1=", "v1=zz", "v2=00", &header[3..]] {
            assert_eq!(
                check("gpuwarden.signals", b"ml", b"{}", Some(bad.as_bytes())),
                Verdict::Invalid,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn during_a_rotation_the_previous_key_is_accepted_and_named() {
        let old_signer = SigningKeys::new(Some(OLD), None);
        let reader = SigningKeys::new(Some(NEW), Some(OLD));
        let header = old_signer.sign("t", b"k", b"p").expect("signs");
        assert_eq!(
            reader.verify("t", b"k", b"p", Some(header.as_bytes())),
            Verdict::Previous
        );
        // Once the previous key is dropped, its signatures are refused.
        let after = SigningKeys::new(Some(NEW), None);
        assert_eq!(
            after.verify("t", b"k", b"p", Some(header.as_bytes())),
            Verdict::Invalid
        );
        // Without keys nothing is signed and nothing verifies.
        let none = SigningKeys::default();
        assert_eq!(none.sign("t", b"k", b"p"), None);
        assert_eq!(
            none.verify("t", b"k", b"p", Some(header.as_bytes())),
            Verdict::Invalid
        );
        assert!(!format!("{reader:?}").contains("0123"), "keys never print");
    }
}
