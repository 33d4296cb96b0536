//! The enforcer's own counters, rendered as Prometheus text for the binary's `/metrics`. Labels
//! come from bounded sets (decision, reason code); lease ids never become label values.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::policy::ReasonCode;
use crate::store::CommitStats;

/// Counters the API updates; cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct Metrics {
    admitted: AtomicU64,
    denied: AtomicU64,
    reasons: [AtomicU64; ReasonCode::ALL.len()],
    driver_errors: AtomicU64,
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
        out
    }
}
