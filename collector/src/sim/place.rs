//! Where a lease that names no GPUs runs: the substrate picks them, as a scheduler would, packing
//! onto as few hosts as possible so that whole hosts stay free for large jobs. Pure functions of
//! GPU positions, so a placement is repeatable.

/// Picks `need` GPUs from `hosts` (each the free GPUs of one host, in inventory order) on the
/// fewest hosts: while no single host can take what is left, it takes the host with the most free
/// GPUs; then the host with the fewest free GPUs that still fits the rest (best fit). Ties go to
/// the host listed first. Returns fewer than `need` when there are not that many. Sorted.
pub(crate) fn pack(mut hosts: Vec<Vec<usize>>, mut need: usize) -> Vec<usize> {
    hosts.retain(|h| !h.is_empty());
    let mut picked = Vec::new();
    while need > 0 && !hosts.is_empty() {
        let fits = hosts
            .iter()
            .enumerate()
            .filter(|(_, h)| h.len() >= need)
            .min_by_key(|&(i, h)| (h.len(), i))
            .map(|(i, _)| i);
        if let Some(i) = fits {
            picked.extend_from_slice(&hosts[i][..need]);
            need = 0;
        } else {
            let largest = hosts
                .iter()
                .enumerate()
                .max_by_key(|&(i, h)| (h.len(), std::cmp::Reverse(i)))
                .map_or(0, |(i, _)| i);
            let host = hosts.remove(largest);
            need -= host.len();
            picked.extend(host);
        }
    }
    picked.sort_unstable();
    picked
}

/// Which `want` of a lease's GPUs it keeps when shrinking: those on the hosts where it holds the
/// most, so that what it keeps stays packed. Ties go to the GPU listed first. Sorted.
pub(crate) fn keep(held: &[usize], host_of: impl Fn(usize) -> usize, want: usize) -> Vec<usize> {
    let on_host = |host: usize| held.iter().filter(|&&g| host_of(g) == host).count();
    let mut ranked: Vec<(usize, usize)> = held.iter().map(|&g| (on_host(host_of(g)), g)).collect();
    ranked.sort_by_key(|&(count, g)| (std::cmp::Reverse(count), g));
    let mut kept: Vec<usize> = ranked.into_iter().take(want).map(|(_, g)| g).collect();
    kept.sort_unstable();
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hosts of 8 GPUs (positions 8h..8h+8) with `free[h]` free GPUs each, the last ones.
    fn hosts(free: &[usize]) -> Vec<Vec<usize>> {
        free.iter()
            .enumerate()
            .map(|(h, &n)| (8 * h + 8 - n..8 * h + 8).collect())
            .collect()
    }

    fn hosts_used(picked: &[usize]) -> Vec<usize> {
        let mut used: Vec<usize> = picked.iter().map(|g| g / 8).collect();
        used.dedup();
        used
    }

    #[test]
    fn a_small_lease_goes_to_the_fullest_host_that_fits() {
        let free = hosts(&[8, 3, 6, 3]);
        assert_eq!(pack(free.clone(), 3), vec![13, 14, 15]);
        assert_eq!(hosts_used(&pack(free.clone(), 4)), vec![2]);
        assert_eq!(hosts_used(&pack(free, 7)), vec![0]);
    }

    #[test]
    fn a_large_lease_takes_the_fewest_hosts() {
        let free = hosts(&[3, 8, 6, 8, 2]);
        let picked = pack(free.clone(), 18);
        assert_eq!(picked.len(), 18);
        // 8 + 8 leaves 2: the 2-free host fits it exactly.
        assert_eq!(hosts_used(&picked), vec![1, 3, 4]);
        assert_eq!(hosts_used(&pack(free, 10)), vec![1, 4]);
    }

    #[test]
    fn a_lease_larger_than_what_is_free_gets_what_there_is() {
        assert_eq!(pack(hosts(&[1, 2]), 5), vec![7, 14, 15]);
        assert_eq!(pack(Vec::new(), 2), Vec::<usize>::new());
        assert_eq!(pack(hosts(&[4]), 0), Vec::<usize>::new());
    }

    #[test]
    fn shrinking_keeps_the_gpus_on_the_busiest_hosts() {
        let held = [6, 7, 8, 9, 10, 16];
        assert_eq!(keep(&held, |g| g / 8, 3), vec![8, 9, 10]);
        assert_eq!(keep(&held, |g| g / 8, 5), vec![6, 7, 8, 9, 10]);
        assert_eq!(keep(&held, |g| g / 8, 9), held.to_vec());
    }
}
