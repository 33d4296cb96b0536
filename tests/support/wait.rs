//! Waiting for what a test expects to happen: [`eventually`] retries a check until it holds.

use std::fmt::Display;
use std::time::{Duration, Instant};

/// Tries `check` until it gives `Ok`, and returns what it gave. After `timeout` it panics with
/// `what` and the last `Err`, which says what the check saw instead.
///
/// Between tries it waits nine times as long as the try took, from 5 ms to 1 s, so that the
/// checks take a tenth of the time at most, of this process and of the one they ask: a check
/// that reads a file sees the change within milliseconds, and one that runs psql or calls an
/// API leaves the CPU to the processes it is waiting for.
#[track_caller]
pub fn eventually<T, E: Display>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, E>,
) -> T {
    let started = Instant::now();
    loop {
        let tried = Instant::now();
        let seen = match check() {
            Ok(value) => return value,
            Err(seen) => seen,
        };
        if started.elapsed() >= timeout {
            panic!("{what}: not within {timeout:?}; the last try saw:\n{seen}");
        }
        let pause = (tried.elapsed() * 9).clamp(Duration::from_millis(5), Duration::from_secs(1));
        std::thread::sleep(pause.min(timeout.saturating_sub(started.elapsed())));
    }
}
