//! What the portal shows from the lake: a team's idle cost this month and the leases that cost
//! most idle, and the scorecard's evidence. The enforcer does not read the lake itself (the
//! pipeline's crate owns it, and the enforcer imports no other role); the binary hands the
//! portal an [`Insights`] that reads it with DataFusion (`src/cmd/assess.rs`). Without one (an
//! enforcer whose data dir holds no lake, or a test), those parts of the pages say so.

use crate::scorecard::Evidence;

/// One lease's idle cost.
#[derive(Debug, Clone, PartialEq)]
pub struct IdleLease {
    /// The lease.
    pub lease_id: String,
    /// Who held it.
    pub user: String,
    /// Its kind of work.
    pub workload: String,
    /// What its idle GPU-hours cost in the period.
    pub idle_cost_usd: f64,
    /// What all its GPU-hours cost in the period.
    pub cost_usd: f64,
}

/// A team's idle cost over one month.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TeamIdle {
    /// How far the hourly rollups reach (the watermark of their last run, from
    /// `rollups/_state.json`), Unix epoch milliseconds; none before they have run. The figures
    /// below are priced up to it, so they lag the enforcer's own count of spend by what came
    /// after.
    pub as_of_ms: Option<i64>,
    /// Idle cost of the team's GPU-hours in the month so far.
    pub idle_cost_usd: f64,
    /// Cost of all of them.
    pub cost_usd: f64,
    /// The leases with the highest idle cost in the month, highest first.
    pub top: Vec<IdleLease>,
}

/// The lake, as the portal reads it.
#[async_trait::async_trait]
pub trait Insights: Send + Sync + std::fmt::Debug {
    /// `team`'s idle cost in the UTC month holding `now_ms`, with its `limit` leases of the
    /// highest idle cost.
    async fn team_idle(&self, team: &str, now_ms: i64, limit: usize) -> Result<TeamIdle, String>;

    /// The scorecard's evidence: the 30 days up to the lake's watermark.
    async fn evidence(&self) -> Result<Evidence, String>;
}
