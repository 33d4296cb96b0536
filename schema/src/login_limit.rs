//! How many failed logins a client may make before it is locked out for a while: the one rule
//! the enforcer's API (bearer tokens) and the pipeline's SQL endpoint (passwords) share.
//!
//! A [`LoginLimiter`] counts failures in two key spaces at once: the source address (an IPv6
//! address counts as its /64, which one host usually holds whole) and the principal the client
//! tried (a SQL user name; for the API, the token presented). The first failure of a key opens
//! its window; the key is locked out once it has failed `max_failures` times (for a source,
//! `max_failures_per_source`) within that window, and stays locked for one `window` from that
//! last failure, whatever is tried meanwhile. A lockout that has passed leaves the key with a
//! clean count. A success clears the principal's count (the client proved it knows the secret
//! of that principal, and a user who mistyped twice starts over), never the source's: otherwise
//! an attacker holding one good secret could log in between guesses at the others and never be
//! locked out.
//!
//! Memory is bounded: each key space tracks at most `tracked_keys` keys, kept as keyed 128-bit
//! hashes (a few dozen bytes each, whatever the key's length). When a new key finds the space
//! full, keys whose window or lockout has passed are dropped first; if none has, an eighth of
//! the keys is forgotten early (counted as evictions): those not locked out, whose window ends
//! soonest, and lockouts only once every key tracked is one. An attacker spraying more keys than
//! that within one window makes the limiter forget some counts, and never makes it refuse a good
//! login or grow; to have a lockout forgotten, it must first lock out `tracked_keys` keys.
//!
//! It does no I/O and reads no clock: the caller passes `now`, and wraps the limiter in a lock.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::config::LoginLimits;

/// Which of the two limits a key fell under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The client's source address (an IPv6 address's /64).
    Source,
    /// The principal tried: a SQL user name, or the bearer token presented.
    Principal,
}

impl Scope {
    /// Both scopes, in the order metrics list them.
    pub const ALL: [Scope; 2] = [Scope::Source, Scope::Principal];

    /// The name used in metrics labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Source => "source",
            Self::Principal => "principal",
        }
    }

    fn index(self) -> usize {
        match self {
            Self::Source => 0,
            Self::Principal => 1,
        }
    }
}

/// A key locked out: which limit, and how long until it may try again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockedOut {
    /// The limit that locked it out.
    pub scope: Scope,
    /// How long until the lockout ends.
    pub retry_after: Duration,
}

impl LockedOut {
    /// [`Self::retry_after`] in whole seconds, rounded up and at least 1: what a `Retry-After`
    /// header says, so that a client that waits that long is let through.
    pub fn retry_after_secs(&self) -> u64 {
        let secs = self.retry_after.as_secs();
        let secs = if self.retry_after.subsec_nanos() > 0 {
            secs + 1
        } else {
            secs
        };
        secs.max(1)
    }
}

/// What one failed login did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Failure {
    /// The lockouts this failure began (one per scope at most; a key already locked out is
    /// not locked again).
    pub locked: [Option<LockedOut>; 2],
    /// Keys forgotten early to make room for this one's (see the module's documentation).
    pub evicted: u64,
}

impl Failure {
    /// The lockouts this failure began.
    pub fn lockouts(&self) -> impl Iterator<Item = LockedOut> + '_ {
        self.locked.iter().flatten().copied()
    }
}

/// Failed logins per source address and per principal (see the module's documentation).
#[derive(Debug)]
pub struct LoginLimiter {
    by_source: Window,
    by_principal: Window,
    /// Keys the hashes that stand for keys, so that they differ between processes and an
    /// attacker cannot choose keys that collide.
    hashes: RandomState,
}

impl LoginLimiter {
    /// A limiter under `limits`.
    pub fn new(limits: &LoginLimits) -> Self {
        Self {
            by_source: Window::new(
                limits.max_failures_per_source,
                limits.window,
                limits.tracked_keys,
            ),
            by_principal: Window::new(limits.max_failures, limits.window, limits.tracked_keys),
            hashes: RandomState::new(),
        }
    }

    /// Whether a client from `source` may try to log in as `principal` at `now`: the lockout
    /// that stops it, the source's first. Either key may be unknown (`None`): an in-process
    /// request has no source, a bearer token names no principal before it is checked.
    pub fn check(
        &mut self,
        source: Option<IpAddr>,
        principal: Option<&[u8]>,
        now: Instant,
    ) -> Result<(), LockedOut> {
        if let Some(source) = source {
            let key = self.source_key(source);
            if let Some(retry_after) = self.by_source.locked(key, now) {
                return Err(LockedOut {
                    scope: Scope::Source,
                    retry_after,
                });
            }
        }
        if let Some(principal) = principal {
            let key = self.key(principal);
            if let Some(retry_after) = self.by_principal.locked(key, now) {
                return Err(LockedOut {
                    scope: Scope::Principal,
                    retry_after,
                });
            }
        }
        Ok(())
    }

    /// Counts a failed login from `source` as `principal` at `now`.
    pub fn failed(
        &mut self,
        source: Option<IpAddr>,
        principal: Option<&[u8]>,
        now: Instant,
    ) -> Failure {
        let mut failure = Failure::default();
        if let Some(source) = source {
            let key = self.source_key(source);
            let (locked, evicted) = self.by_source.failed(key, now);
            failure.evicted += evicted;
            failure.locked[Scope::Source.index()] = locked.map(|retry_after| LockedOut {
                scope: Scope::Source,
                retry_after,
            });
        }
        if let Some(principal) = principal {
            let key = self.key(principal);
            let (locked, evicted) = self.by_principal.failed(key, now);
            failure.evicted += evicted;
            failure.locked[Scope::Principal.index()] = locked.map(|retry_after| LockedOut {
                scope: Scope::Principal,
                retry_after,
            });
        }
        failure
    }

    /// Clears `principal`'s count after it logged in; the source's count stays.
    pub fn succeeded(&mut self, principal: &[u8]) {
        let key = self.key(principal);
        self.by_principal.keys.remove(&key);
    }

    /// Keys tracked now, per scope (source, principal).
    pub fn tracked(&self) -> (usize, usize) {
        (self.by_source.keys.len(), self.by_principal.keys.len())
    }

    fn source_key(&self, source: IpAddr) -> u128 {
        self.key(source_prefix(source))
    }

    fn key(&self, key: impl Hash) -> u128 {
        let half = |salt: u8| {
            let mut hasher = self.hashes.build_hasher();
            salt.hash(&mut hasher);
            key.hash(&mut hasher);
            hasher.finish()
        };
        (u128::from(half(0)) << 64) | u128::from(half(1))
    }
}

/// The address a source is counted as: an IPv4 address (IPv4-mapped IPv6 included) as it is,
/// an IPv6 address as its /64.
pub fn source_prefix(source: IpAddr) -> IpAddr {
    match source {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut segments = v6.segments();
                segments[4..].fill(0);
                IpAddr::V6(segments.into())
            }
        },
    }
}

/// One key space: each key's failures in its window, or its lockout.
#[derive(Debug)]
struct Window {
    max_failures: u32,
    window: Duration,
    capacity: usize,
    keys: HashMap<u128, Entry>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    failures: u32,
    /// When the key's first counted failure was.
    since: Instant,
    /// Until when the key is locked out, once it is.
    locked_until: Option<Instant>,
}

impl Entry {
    /// When the entry stops mattering: its lockout's end, or its window's.
    fn expires(&self, window: Duration) -> Instant {
        self.locked_until.unwrap_or(self.since + window)
    }
}

impl Window {
    fn new(max_failures: u32, window: Duration, capacity: usize) -> Self {
        Self {
            max_failures: max_failures.max(1),
            window,
            capacity: capacity.max(1),
            keys: HashMap::new(),
        }
    }

    /// How long `key` stays locked out, if it is.
    fn locked(&mut self, key: u128, now: Instant) -> Option<Duration> {
        let entry = self.keys.get(&key)?;
        match entry.locked_until {
            Some(until) if until > now => Some(until - now),
            // The lockout has passed: the key starts over.
            Some(_) => {
                self.keys.remove(&key);
                None
            }
            None => None,
        }
    }

    /// Counts a failure of `key`: how long the lockout it began lasts, if it began one, and how
    /// many keys were forgotten to make room for it.
    fn failed(&mut self, key: u128, now: Instant) -> (Option<Duration>, u64) {
        let mut evicted = 0;
        if !self.keys.contains_key(&key) && self.keys.len() >= self.capacity {
            evicted = self.make_room(now);
        }
        let window = self.window;
        let entry = self.keys.entry(key).or_insert(Entry {
            failures: 0,
            since: now,
            locked_until: None,
        });
        match entry.locked_until {
            // Already locked out (a try that was let through before the lockout began fails
            // after it): the lockout stands as it is.
            Some(until) if until > now => return (None, evicted),
            Some(_) => {
                *entry = Entry {
                    failures: 0,
                    since: now,
                    locked_until: None,
                }
            }
            None if now >= entry.since + window => {
                entry.failures = 0;
                entry.since = now;
            }
            None => {}
        }
        entry.failures = entry.failures.saturating_add(1);
        if entry.failures >= self.max_failures {
            entry.locked_until = Some(now + window);
            return (Some(window), evicted);
        }
        (None, evicted)
    }

    /// Drops the keys that no longer matter; if that frees nothing, forgets an eighth of the
    /// keys: those not locked out first, soonest to expire first. Returns how many keys were
    /// forgotten early.
    fn make_room(&mut self, now: Instant) -> u64 {
        let window = self.window;
        self.keys.retain(|_, e| e.expires(window) > now);
        if self.keys.len() < self.capacity {
            return 0;
        }
        // One pass frees an eighth of the space, so a flood of new keys costs O(1) per key
        // on average rather than a scan each.
        let n = (self.capacity / 8).max(1);
        let mut by_worth: Vec<((bool, Instant), u128)> = self
            .keys
            .iter()
            .map(|(k, e)| ((e.locked_until.is_some(), e.expires(window)), *k))
            .collect();
        by_worth.select_nth_unstable_by_key(n - 1, |(worth, _)| *worth);
        for (_, key) in &by_worth[..n] {
            self.keys.remove(key);
        }
        n as u64
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn limits(max_failures: u32, per_source: u32, tracked_keys: usize) -> LoginLimits {
        LoginLimits {
            max_failures,
            max_failures_per_source: per_source,
            window: 5 * MINUTE,
            tracked_keys,
        }
    }

    fn ip(last: u8) -> Option<IpAddr> {
        Some(IpAddr::V4(Ipv4Addr::new(192, 0, 2, last)))
    }

    #[test]
    fn the_nth_failure_locks_the_principal_out_for_a_window() {
        let mut limiter = LoginLimiter::new(&limits(3, 100, 1000));
        let t0 = Instant::now();
        for i in 0..2 {
            let now = t0 + Duration::from_secs(i);
            assert_eq!(limiter.check(ip(1), Some(b"alice"), now), Ok(()));
            let failure = limiter.failed(ip(1), Some(b"alice"), now);
            assert_eq!(failure.lockouts().count(), 0, "failure {i}");
        }
        let third = t0 + Duration::from_secs(2);
        let failure = limiter.failed(ip(1), Some(b"alice"), third);
        let locked: Vec<LockedOut> = failure.lockouts().collect();
        assert_eq!(
            locked,
            [LockedOut {
                scope: Scope::Principal,
                retry_after: 5 * MINUTE
            }]
        );
        // Locked from any address, for one window from the failure that locked it.
        let later = third + 2 * MINUTE;
        let refused = limiter.check(ip(9), Some(b"alice"), later).unwrap_err();
        assert_eq!(refused.scope, Scope::Principal);
        assert_eq!(refused.retry_after, 3 * MINUTE);
        assert_eq!(refused.retry_after_secs(), 180);
        // Another principal from the same address is not.
        assert_eq!(limiter.check(ip(1), Some(b"bob"), later), Ok(()));
        // Once the window has passed, the key starts over with a clean count.
        let after = third + 5 * MINUTE;
        assert_eq!(limiter.check(ip(1), Some(b"alice"), after), Ok(()));
        let failure = limiter.failed(ip(1), Some(b"alice"), after);
        assert_eq!(failure.lockouts().count(), 0);
    }

    #[test]
    fn failures_older_than_the_window_do_not_count() {
        let mut limiter = LoginLimiter::new(&limits(3, 100, 1000));
        let t0 = Instant::now();
        limiter.failed(None, Some(b"alice"), t0);
        limiter.failed(None, Some(b"alice"), t0 + MINUTE);
        // The window opened at t0 has passed: this failure opens a new one.
        let failure = limiter.failed(None, Some(b"alice"), t0 + 5 * MINUTE);
        assert_eq!(failure.lockouts().count(), 0);
        let failure = limiter.failed(None, Some(b"alice"), t0 + 6 * MINUTE);
        assert_eq!(failure.lockouts().count(), 0);
        let failure = limiter.failed(None, Some(b"alice"), t0 + 7 * MINUTE);
        assert_eq!(failure.lockouts().count(), 1);
    }

    #[test]
    fn the_source_limit_counts_every_principal_tried_from_it() {
        let mut limiter = LoginLimiter::new(&limits(100, 4, 1000));
        let t0 = Instant::now();
        for (i, user) in ["a", "b", "c"].iter().enumerate() {
            let failure = limiter.failed(ip(1), Some(user.as_bytes()), t0);
            assert_eq!(failure.lockouts().count(), 0, "failure {i}");
        }
        let failure = limiter.failed(ip(1), Some(b"d"), t0);
        assert_eq!(
            failure.lockouts().collect::<Vec<_>>(),
            [LockedOut {
                scope: Scope::Source,
                retry_after: 5 * MINUTE
            }]
        );
        // Refused whoever it tries, even a principal with no failure; another address is not.
        let refused = limiter.check(ip(1), Some(b"e"), t0).unwrap_err();
        assert_eq!(refused.scope, Scope::Source);
        assert_eq!(limiter.check(ip(2), Some(b"e"), t0), Ok(()));
        assert_eq!(
            limiter.check(ip(1), None, t0).unwrap_err().scope,
            Scope::Source
        );
    }

    #[test]
    fn a_success_clears_the_principal_and_not_the_source() {
        let mut limiter = LoginLimiter::new(&limits(3, 3, 1000));
        let t0 = Instant::now();
        limiter.failed(ip(1), Some(b"alice"), t0);
        limiter.failed(ip(1), Some(b"alice"), t0);
        limiter.succeeded(b"alice");
        // Alice starts over: two more failures do not lock her out ...
        let failure = limiter.failed(ip(2), Some(b"alice"), t0);
        assert_eq!(failure.lockouts().count(), 0);
        // ... but the address she failed from twice is locked out at its third failure.
        let failure = limiter.failed(ip(1), Some(b"mallory"), t0);
        assert_eq!(
            failure.lockouts().next().map(|l| l.scope),
            Some(Scope::Source)
        );
    }

    #[test]
    fn failures_while_locked_out_do_not_extend_the_lockout() {
        let mut limiter = LoginLimiter::new(&limits(1, 100, 1000));
        let t0 = Instant::now();
        assert_eq!(
            limiter.failed(None, Some(b"alice"), t0).lockouts().count(),
            1
        );
        let failure = limiter.failed(None, Some(b"alice"), t0 + 4 * MINUTE);
        assert_eq!(failure.lockouts().count(), 0);
        let refused = limiter
            .check(None, Some(b"alice"), t0 + 4 * MINUTE)
            .unwrap_err();
        assert_eq!(refused.retry_after, MINUTE);
        assert_eq!(limiter.check(None, Some(b"alice"), t0 + 5 * MINUTE), Ok(()));
    }

    #[test]
    fn ipv6_counts_per_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(source_prefix(a), source_prefix(b));
        assert_ne!(source_prefix(a), source_prefix(other));
        assert_eq!(
            source_prefix(IpAddr::V6(Ipv4Addr::new(192, 0, 2, 7).to_ipv6_mapped())),
            ip(7).unwrap()
        );
        assert_eq!(
            source_prefix(IpAddr::V6(Ipv6Addr::LOCALHOST)),
            IpAddr::V6(Ipv6Addr::UNSPECIFIED)
        );

        let mut limiter = LoginLimiter::new(&limits(100, 2, 1000));
        let t0 = Instant::now();
        limiter.failed(Some(a), None, t0);
        limiter.failed(Some(b), None, t0);
        assert!(limiter.check(Some(a), None, t0).is_err());
        assert_eq!(limiter.check(Some(other), None, t0), Ok(()));
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let locked = |retry_after| LockedOut {
            scope: Scope::Source,
            retry_after,
        };
        assert_eq!(locked(Duration::from_millis(1)).retry_after_secs(), 1);
        assert_eq!(locked(Duration::from_millis(1500)).retry_after_secs(), 2);
        assert_eq!(locked(Duration::from_secs(300)).retry_after_secs(), 300);
        assert_eq!(locked(Duration::ZERO).retry_after_secs(), 1);
    }

    /// A spray of more keys than the limiter tracks keeps it at its cap; what it forgets is
    /// counted, and a lockout outlives the keys that merely failed once.
    #[test]
    fn memory_stays_bounded_under_a_spray_of_keys_and_lockouts_are_kept_longest() {
        let mut limiter = LoginLimiter::new(&limits(2, 1_000_000, 64));
        let t0 = Instant::now();
        limiter.failed(None, Some(b"alice"), t0);
        limiter.failed(None, Some(b"alice"), t0);
        let mut evicted = 0;
        for i in 0..10_000u32 {
            let now = t0 + Duration::from_millis(u64::from(i));
            evicted += limiter.failed(ip(1), Some(&i.to_le_bytes()), now).evicted;
            let (sources, principals) = limiter.tracked();
            assert!(sources <= 64 && principals <= 64, "{sources}, {principals}");
        }
        let (sources, principals) = limiter.tracked();
        assert_eq!(sources, 1);
        assert!(principals > 64 - 64 / 8, "{principals}");
        assert_eq!(
            evicted,
            10_000 + 1 - principals as u64,
            "what is not tracked was counted as evicted"
        );
        let now = t0 + Duration::from_secs(10);
        assert!(
            limiter.check(None, Some(b"alice"), now).is_err(),
            "the lockout was forgotten before keys that failed once"
        );
    }

    /// When every key tracked is locked out, lockouts are forgotten too: the cap holds.
    #[test]
    fn the_cap_holds_when_every_key_is_locked_out() {
        let mut limiter = LoginLimiter::new(&limits(1, 1_000_000, 64));
        let t0 = Instant::now();
        let mut evicted = 0;
        for i in 0..1000u32 {
            let failure = limiter.failed(None, Some(&i.to_le_bytes()), t0);
            assert_eq!(failure.lockouts().count(), 1);
            evicted += failure.evicted;
        }
        let tracked = limiter.tracked().1;
        assert!(tracked <= 64, "{tracked}");
        assert_eq!(evicted, 1000 - tracked as u64);
        assert!(limiter
            .check(None, Some(&999u32.to_le_bytes()), t0)
            .is_err());
    }

    /// Keys whose window has passed make room before any live count is forgotten.
    #[test]
    fn expired_keys_make_room_first() {
        let mut limiter = LoginLimiter::new(&limits(5, 1_000_000, 8));
        let t0 = Instant::now();
        for i in 0..8u32 {
            limiter.failed(None, Some(&i.to_le_bytes()), t0);
        }
        let later = t0 + 5 * MINUTE;
        let failure = limiter.failed(None, Some(b"new"), later);
        assert_eq!(failure.evicted, 0);
        assert_eq!(limiter.tracked().1, 1);
    }
}
