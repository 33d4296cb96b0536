//! Deterministic noise. Every random-looking value of the simulation is a hash of what it depends
//! on (seed, GPU, lease, time slot), never the next draw of a generator: a value then does not
//! depend on what was sampled before it, in what order, or how often.

/// splitmix64's finalizer: a cheap bijective mix with full avalanche.
pub(crate) const fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Combines a key with one more input. Not symmetric, so `hash(a, b) != hash(b, a)`.
pub(crate) const fn hash(key: u64, input: u64) -> u64 {
    mix(key ^ mix(input))
}

/// A key derived from a string (a GPU UUID, a lease id) and the seed.
pub(crate) fn str_key(seed: u64, s: &str) -> u64 {
    let fnv = s.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    hash(mix(seed), fnv)
}

/// A uniform value in `[0, 1)` from a hash.
pub(crate) fn unit(h: u64) -> f64 {
    (h >> 11) as f64 * (1.0 / (1_u64 << 53) as f64)
}

/// A uniform value in `[0, 1)` for `key`, a named stream of it, and a slot (tick, minute, cycle).
pub(crate) fn uniform(key: u64, stream: u64, slot: i64) -> f64 {
    unit(hash(hash(key, stream), slot as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_values_cover_the_unit_interval_evenly() {
        let n = 100_000;
        let mut buckets = [0_u32; 10];
        for i in 0..n {
            let u = uniform(7, 1, i);
            assert!((0.0..1.0).contains(&u), "{u} outside [0, 1)");
            buckets[(u * 10.0) as usize] += 1;
        }
        for (i, &count) in buckets.iter().enumerate() {
            assert!(
                (9_000..11_000).contains(&count),
                "bucket {i} holds {count} of {n}"
            );
        }
    }

    #[test]
    fn keys_depend_on_seed_and_string() {
        assert_eq!(str_key(1, "GPU-a"), str_key(1, "GPU-a"));
        assert_ne!(str_key(1, "GPU-a"), str_key(2, "GPU-a"));
        assert_ne!(str_key(1, "GPU-a"), str_key(1, "GPU-b"));
        assert_ne!(hash(1, 2), hash(2, 1));
    }
}
