//! The enforcer's own counters and its replica's role ([`render_leadership`]), rendered as
//! Prometheus text for the binary's `/metrics`. Labels come from bounded sets (decision, reason
//! code, login limit scope, replica names); lease ids and client addresses never become label
//! values.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use gpuwarden_schema::login_limit::{Failure, Scope};
use gpuwarden_schema::signing::Verdict;

use crate::policy::ReasonCode;
use crate::store::leader::Leadership;
use crate::store::CommitStats;

/// Counters the API updates; cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct Metrics {
    admitted: AtomicU64,
    denied: AtomicU64,
    reasons: [AtomicU64; ReasonCode::ALL.len()],
    driver_errors: AtomicU64,
    login_failures: AtomicU64,
    /// By [`Scope`]: lockouts begun, and requests refused while locked out.
    lockouts: [AtomicU64; 2],
    logins_refused: [AtomicU64; 2],
    login_keys_evicted: AtomicU64,
    /// Signals read, by [`Verdict::ALL`].
    signals: [AtomicU64; Verdict::ALL.len()],
    /// `lease_utilization` signals refused for a time too far ahead of the enforcer's clock.
    signals_future: AtomicU64,
}

impl Metrics {
    /// Counts one decided admission (dry runs included) and each reason it was denied for.
    pub fn count_decision(&self, admitted: bool, reasons: impl IntoIterator<Item = ReasonCode>) {
        let counter = if admitted {
            &self.admitted
        } else {
            &self.denied
        };
        counter.fetch_add(1, Ordering::Relaxed);
        for code in reasons {
            let i = ReasonCode::ALL.iter().position(|c| *c == code).unwrap_or(0);
            self.reasons[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts one failed driver call.
    pub fn count_driver_error(&self) {
        self.driver_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one bearer token that matched no `[[tokens]]` entry, the lockouts it began and the
    /// keys the login limiter forgot to count it.
    pub fn count_login_failure(&self, failure: &Failure) {
        self.login_failures.fetch_add(1, Ordering::Relaxed);
        for lockout in failure.lockouts() {
            self.lockouts[scope_index(lockout.scope)].fetch_add(1, Ordering::Relaxed);
        }
        self.login_keys_evicted
            .fetch_add(failure.evicted, Ordering::Relaxed);
    }

    /// Counts one signal read from Kafka by what its signature was found to be.
    pub fn count_signal(&self, verdict: Verdict) {
        let i = Verdict::ALL.iter().position(|v| *v == verdict).unwrap_or(0);
        self.signals[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one `lease_utilization` signal refused, dated more than `pipeline.clock.max_skew`
    /// ahead of the enforcer's clock.
    pub fn count_future_signal(&self) {
        self.signals_future.fetch_add(1, Ordering::Relaxed);
    }

    /// `lease_utilization` signals refused so far for a time too far ahead.
    pub fn future_signals(&self) -> u64 {
        self.signals_future.load(Ordering::Relaxed)
    }

    /// Counts one request answered 429 because its source or token was locked out.
    pub fn count_login_refused(&self, scope: Scope) {
        self.logins_refused[scope_index(scope)].fetch_add(1, Ordering::Relaxed);
    }

    /// The counters, and the lease store's `commits`, in the Prometheus text format.
    pub fn render_with(&self, commits: CommitStats) -> String {
        let mut out = self.render();
        out.push_str(
            "# HELP gpuwarden_enforcer_store_commits_total Lease store transactions committed (one fsync each).\n",
        );
        out.push_str("# TYPE gpuwarden_enforcer_store_commits_total counter\n");
        let _ = writeln!(
            out,
            "gpuwarden_enforcer_store_commits_total {}",
            commits.commits
        );
        out.push_str(
            "# HELP gpuwarden_enforcer_store_writes_total Changes those transactions carried; writes / commits is the group-commit factor.\n",
        );
        out.push_str("# TYPE gpuwarden_enforcer_store_writes_total counter\n");
        let _ = writeln!(
            out,
            "gpuwarden_enforcer_store_writes_total {}",
            commits.writes
        );
        out
    }

    /// The counters in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        out.push_str("# HELP gpuwarden_enforcer_admissions_total Admission requests decided.\n");
        out.push_str("# TYPE gpuwarden_enforcer_admissions_total counter\n");
        for (label, c) in [("admitted", &self.admitted), ("denied", &self.denied)] {
            let _ = writeln!(
                out,
                "gpuwarden_enforcer_admissions_total{{decision=\"{label}\"}} {}",
                get(c)
            );
        }
        out.push_str(
            "# HELP gpuwarden_enforcer_denial_reasons_total Failed admission checks, by reason code.\n",
        );
        out.push_str("# TYPE gpuwarden_enforcer_denial_reasons_total counter\n");
        for (code, c) in ReasonCode::ALL.iter().zip(&self.reasons) {
            let _ = writeln!(
                out,
                "gpuwarden_enforcer_denial_reasons_total{{reason=\"{}\"}} {}",
                code.as_str(),
                get(c)
            );
        }
        out.push_str(
            "# HELP gpuwarden_enforcer_driver_errors_total Substrate driver calls that failed.\n",
        );
        out.push_str("# TYPE gpuwarden_enforcer_driver_errors_total counter\n");
        let _ = writeln!(
            out,
            "gpuwarden_enforcer_driver_errors_total {}",
            get(&self.driver_errors)
        );
        out.push_str(
            "# HELP gpuwarden_enforcer_login_failures_total Bearer tokens that matched no [[tokens]] entry.\n",
        );
        out.push_str("# TYPE gpuwarden_enforcer_login_failures_total counter\n");
        let _ = writeln!(
            out,
            "gpuwarden_enforcer_login_failures_total {}",
            get(&self.login_failures)
        );
        for (name, help, counters) in [
            (
                "gpuwarden_enforcer_login_lockouts_total",
                "Lockouts begun after too many failed logins, by what was locked out (source address or token).",
                &self.lockouts,
            ),
            (
                "gpuwarden_enforcer_logins_refused_total",
                "Requests answered 429 without checking their token because their source address or token was locked out.",
                &self.logins_refused,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for scope in Scope::ALL {
                let _ = writeln!(
                    out,
                    "{name}{{scope=\"{}\"}} {}",
                    scope.as_str(),
                    get(&counters[scope_index(scope)])
                );
            }
        }
        out.push_str(
            "# HELP gpuwarden_enforcer_login_keys_evicted_total Failed-login counts forgotten early because enforcer.login_limits.tracked_keys was reached.\n",
        );
        out.push_str("# TYPE gpuwarden_enforcer_login_keys_evicted_total counter\n");
        let _ = writeln!(
            out,
            "gpuwarden_enforcer_login_keys_evicted_total {}",
            get(&self.login_keys_evicted)
        );
        out.push_str(
            "# HELP gpuwarden_enforcer_signals_total Signals read from Kafka, by signature: current and previous key are acted on; unsigned and invalid are refused.\n",
        );
        out.push_str("# TYPE gpuwarden_enforcer_signals_total counter\n");
        for (verdict, c) in Verdict::ALL.iter().zip(&self.signals) {
            let _ = writeln!(
                out,
                "gpuwarden_enforcer_signals_total{{signature=\"{}\"}} {}",
                verdict.as_str(),
                get(c)
            );
        }
        out.push_str(
            "# HELP gpuwarden_enforcer_signals_future_total lease_utilization signals refused for a time more than pipeline.clock.max_skew ahead of the enforcer's clock.\n",
        );
        out.push_str("# TYPE gpuwarden_enforcer_signals_future_total counter\n");
        let _ = writeln!(
            out,
            "gpuwarden_enforcer_signals_future_total {}",
            get(&self.signals_future)
        );
        out
    }
}

/// This replica's role and the leader it knows of, in Prometheus' text format: the binary's
/// `/metrics` appends it to [`Metrics::render_with`].
pub fn render_leadership(page: &mut String, leadership: &Leadership) {
    use gpuwarden_schema::prom::{escape, family};
    let (leader, term) = leadership.leader();
    family(
        page,
        "gpuwarden_enforcer_leader",
        "gauge",
        "Whether this replica leads (does the runtime rules, expiry, watchers' changes and publishing).",
        [("", f64::from(u8::from(leadership.is_leader())))],
    );
    family(
        page,
        "gpuwarden_enforcer_leader_term",
        "gauge",
        "The leader's term (its fencing token), as this replica last read it.",
        [("", term as f64)],
    );
    let labels = format!(
        "replica=\"{}\",leader=\"{}\"",
        escape(&leadership.replica()),
        escape(&leader)
    );
    family(
        page,
        "gpuwarden_enforcer_replica_info",
        "gauge",
        "This replica's name and the leader's.",
        [(labels.as_str(), 1.0)],
    );
}

fn scope_index(scope: Scope) -> usize {
    Scope::ALL.iter().position(|s| *s == scope).unwrap_or(0)
}
