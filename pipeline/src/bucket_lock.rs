//! A role's lock on a lake in a bucket ([`BucketLock`]): an object, `<lake>/_leases/<role>.json`,
//! naming its holder, a generation and when it expires
//! (docs/src/contributors/object-storage.md). A directory's lake locks with `flock`
//! instead (`Lake::try_lock`); this is what stands for it in a bucket, where no kernel drops the
//! lock of a holder that died, so a lock that is not renewed ends by itself. (Such an expiring
//! lock is often called a lease; the objects' directory `_leases/` and the config key
//! `storage.s3.lease_ttl` keep that name, which lakes and configs already written use, but in
//! gpuwarden's code a lease is a GPU lease.)
//!
//! Every write of the object is conditional, checked by the object store with the write: taking
//! a free role creates the object (`PutMode::Create`); renewing, releasing, handing over, taking
//! up a lock handed over, and taking over an expired lock replace the very version that was read
//! (`PutMode::Update` on its ETag). So of any number of takers one wins, and a holder whose
//! renewal is refused knows another has taken the role since its last write: it was deposed.
//! Every body differs from the one it replaces (a new expiry, or a new generation and holder),
//! so an ETag never comes back.
//!
//! Expiry is read against the wall clock of whoever reads it, so the holders' clocks must agree
//! to well within a lock's length. A holder counts its own lock by its monotonic clock from
//! before each write ([`BucketLock::remaining`]), and must stop work it cannot finish before
//! then.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuwarden_schema::clock::wall_now_ms;
use object_store::{PutMode, UpdateVersion};
use serde::{Deserialize, Serialize};

use crate::base::LakeError;
use crate::objects::ObjectLake;

/// Where the lock objects are, relative to the lake's root (a name the lakes already written
/// keep).
pub const DIR: &str = "_leases";

/// The body of a lock object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Body {
    /// Who holds it (or held it last, once expired or released).
    holder: String,
    /// 1 for the first holder of the role, one more at each taking after that; a renewal keeps
    /// it.
    generation: u64,
    /// When it ends, in ms since the Unix epoch; 0 once released.
    expires_at_ms: i64,
}

/// What became of a holder's write to its lock.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// Written: the lock was still this holder's.
    Kept,
    /// Refused: another holder took the role over since this one's last write (its lock had
    /// expired), and this one holds nothing.
    Deposed,
}

/// A held lock on a role ([`BucketLock::try_take`]). Dropped without [`BucketLock::release`],
/// it stays taken until it expires.
#[derive(Debug)]
pub struct BucketLock {
    objects: ObjectLake,
    relative: PathBuf,
    body: Body,
    /// The object as this holder last wrote it.
    version: UpdateVersion,
    ttl: Duration,
    /// By this process's clock: when the lock ends unless renewed.
    valid_until: Instant,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl BucketLock {
    /// The lock object of `role`, relative to the lake's root.
    pub fn path(role: &str) -> PathBuf {
        Path::new(DIR).join(format!("{role}.json"))
    }

    /// Takes the lock on `role` for `holder`, lasting `ttl`, without waiting: when there is no
    /// lock object yet, or the one there has expired (or was released). `Ok(None)` when another
    /// holder's lock has not expired, or another taker won the same free lock first.
    pub fn try_take(
        objects: &ObjectLake,
        role: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Self>, LakeError> {
        let relative = Self::path(role);
        let (generation, mode) = match Self::read(objects, &relative)? {
            None => (1, PutMode::Create),
            Some((old, version)) => {
                if old.expires_at_ms > wall_now_ms() {
                    return Ok(None);
                }
                (old.generation + 1, PutMode::Update(version))
            }
        };
        let started = Instant::now();
        let body = Body {
            holder: holder.to_string(),
            generation,
            expires_at_ms: wall_now_ms().saturating_add(ms(ttl)),
        };
        let Some(version) = objects.put_if(&relative, Self::encode(&body), mode)? else {
            return Ok(None);
        };
        Ok(Some(Self {
            objects: objects.clone(),
            relative,
            body,
            version,
            ttl,
            valid_until: started + ttl,
        }))
    }

    /// Takes up the lock on `role` that its holder handed to `holder` ([`BucketLock::hand_over`]),
    /// extending it to `ttl` from now: a conditional write on the version read, so of two
    /// adopters under one name one wins. `Ok(None)` when the lock is not handed to `holder`,
    /// has expired meanwhile (whoever wants it takes it over as usual), or the write was
    /// refused. A holder's name must be its process's alone: a restarted process under its
    /// old name would adopt its old lock as well.
    pub fn adopt(
        objects: &ObjectLake,
        role: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Self>, LakeError> {
        let relative = Self::path(role);
        let Some((handed, version)) = Self::read(objects, &relative)? else {
            return Ok(None);
        };
        if handed.holder != holder || handed.expires_at_ms <= wall_now_ms() {
            return Ok(None);
        }
        let started = Instant::now();
        let body = Body {
            expires_at_ms: wall_now_ms()
                .saturating_add(ms(ttl))
                .max(handed.expires_at_ms + 1),
            ..handed
        };
        let Some(version) =
            objects.put_if(&relative, Self::encode(&body), PutMode::Update(version))?
        else {
            return Ok(None);
        };
        Ok(Some(Self {
            objects: objects.clone(),
            relative,
            body,
            version,
            ttl,
            valid_until: started + ttl,
        }))
    }

    /// The lock object at `relative` and the version read, or `None` when there is none.
    fn read(
        objects: &ObjectLake,
        relative: &Path,
    ) -> Result<Option<(Body, UpdateVersion)>, LakeError> {
        let Some((bytes, version)) = objects.get_versioned(relative)? else {
            return Ok(None);
        };
        let body = serde_json::from_slice(&bytes).map_err(|e| LakeError::ObjectStore {
            action: "reading the lock object",
            key: objects.key(relative).to_string(),
            lake: objects.display().to_string(),
            source: Box::new(object_store::Error::Generic {
                store: "S3",
                source: Box::new(e),
            }),
        })?;
        Ok(Some((body, version)))
    }

    fn encode(body: &Body) -> Vec<u8> {
        serde_json::to_vec(body).expect("a lock body encodes")
    }

    /// Writes `body` over the version this holder last wrote.
    fn replace(&mut self, body: Body) -> Result<Held, LakeError> {
        let started = Instant::now();
        match self.objects.put_if(
            &self.relative,
            Self::encode(&body),
            PutMode::Update(self.version.clone()),
        )? {
            Some(version) => {
                self.version = version;
                self.body = body;
                self.valid_until = started + self.ttl;
                Ok(Held::Kept)
            }
            None => {
                self.valid_until = started;
                Ok(Held::Deposed)
            }
        }
    }

    /// Extends the lock by its length from now, if it is still this holder's: even after it
    /// expired, as long as nobody took it over meanwhile. [`Held::Deposed`] when another has.
    pub fn renew(&mut self) -> Result<Held, LakeError> {
        let mut body = self.body.clone();
        // At least 1 ms later, so that the body, and with it the ETag, is new.
        body.expires_at_ms = wall_now_ms()
            .saturating_add(ms(self.ttl))
            .max(self.body.expires_at_ms + 1);
        self.replace(body)
    }

    /// Gives the role up, so that the next taker need not wait for the expiry: the object stays,
    /// marked expired. [`Held::Deposed`] when it was no longer this holder's to give.
    pub fn release(mut self) -> Result<Held, LakeError> {
        let mut body = self.body.clone();
        body.expires_at_ms = 0;
        self.replace(body)
    }

    /// Hands the role to `to`, who takes the lock up with [`BucketLock::adopt`] before it
    /// expires, a lock's length from now (else anyone may take it over then): a new generation under the
    /// new holder's name, written over the version this holder last wrote. [`Held::Deposed`]
    /// when it was no longer this holder's to give.
    pub fn hand_over(mut self, to: &str) -> Result<Held, LakeError> {
        let body = Body {
            holder: to.to_string(),
            generation: self.body.generation + 1,
            expires_at_ms: wall_now_ms().saturating_add(ms(self.ttl)),
        };
        self.replace(body)
    }

    /// Who holds it.
    pub fn holder(&self) -> &str {
        &self.body.holder
    }

    /// The how-manieth taking of the role this is, 1 for the first: a later holder always has
    /// a greater one.
    pub fn generation(&self) -> u64 {
        self.body.generation
    }

    /// How long the lock lasts after each renewal.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How long the lock lasts from now unless renewed, by this process's clock, counted from
    /// before its last write was sent; zero once expired or deposed.
    pub fn remaining(&self) -> Duration {
        self.valid_until.saturating_duration_since(Instant::now())
    }
}
