//! [`Action`]: the enforcer's audit trail, one record per decision or enforcement step, published
//! on `gpuwarden.actions` and kept in the lake so that every admission, denial and reclaim can be
//! found with SQL.

use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, DataType, Schema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::arrow::{self as ax, field, Columns};
use crate::error::{ArrowConvertError, ValidationError};
use crate::record::Record;
use crate::version::V1;

/// What the enforcer decided or did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    /// An admission request became a lease.
    Admit,
    /// An admission request was refused.
    Deny,
    /// A lease's GPUs were taken back.
    Reclaim,
    /// A lease's GPU count was changed.
    Resize,
    /// A team's new admissions were stopped.
    Block,
    /// A team's block was lifted.
    Unblock,
    /// People were told; nothing was changed.
    Alert,
}

impl ActionKind {
    /// The snake_case name used in JSON and SQL.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admit => "admit",
            Self::Deny => "deny",
            Self::Reclaim => "reclaim",
            Self::Resize => "resize",
            Self::Block => "block",
            Self::Unblock => "unblock",
            Self::Alert => "alert",
        }
    }
}

/// How the step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Done.
    Ok,
    /// Tried and failed (the detail says why).
    Failed,
    /// Recorded only: `enforcer.mode = "dry_run"`.
    DryRun,
}

impl Outcome {
    /// The snake_case name used in JSON and SQL.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Failed => "failed",
            Self::DryRun => "dry_run",
        }
    }
}

/// One decision or enforcement step of the enforcer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(
    title = "Action",
    description = "The enforcer's audit trail: one record per decision or enforcement step."
)]
pub struct Action {
    /// Contract version.
    pub v: V1,
    /// When the step was taken, Unix epoch milliseconds (UTC).
    pub ts_ms: i64,
    /// What was decided or done.
    pub action: ActionKind,
    /// The lease concerned; null for steps about a team or an unleased GPU.
    pub lease_id: Option<String>,
    /// The team concerned; null for a GPU no lease holds.
    pub team: Option<String>,
    /// Why, as a stable code (a reason code of admission, or `idle`, `expired`, `budget`, …).
    pub reason: String,
    /// The policy that called for the step, e.g. `workloads.notebook.idle_timeout`.
    pub policy: Option<String>,
    /// The substrate driver that carried it out, when one did.
    pub driver: Option<String>,
    /// How the step ended.
    pub outcome: Outcome,
    /// Human-readable detail: the numbers behind the decision, or the driver's error.
    pub detail: String,
}

impl Record for Action {
    const NAME: &'static str = "action";
    const TOPIC: &'static str = crate::topics::ACTIONS;

    fn validate(&self) -> Result<(), ValidationError> {
        if self.reason.is_empty() {
            return Err(ValidationError::new("reason", "must not be empty"));
        }
        if self.lease_id.is_none() && self.team.is_none() && self.action != ActionKind::Alert {
            return Err(ValidationError::new(
                "lease_id",
                format!("a {} action names a lease or a team", self.action.as_str()),
            ));
        }
        Ok(())
    }

    fn key(&self) -> &str {
        self.lease_id
            .as_deref()
            .or(self.team.as_deref())
            .unwrap_or(self.reason.as_str())
    }

    fn arrow_schema() -> Arc<Schema> {
        Arc::new(Schema::new(vec![
            field("v", DataType::Int64, false),
            field("ts_ms", DataType::Int64, false),
            field("action", DataType::Utf8, false),
            field("lease_id", DataType::Utf8, true),
            field("team", DataType::Utf8, true),
            field("reason", DataType::Utf8, false),
            field("policy", DataType::Utf8, true),
            field("driver", DataType::Utf8, true),
            field("outcome", DataType::Utf8, false),
            field("detail", DataType::Utf8, false),
        ]))
    }

    fn to_record_batch(records: &[Self]) -> Result<RecordBatch, ArrowError> {
        let r = records;
        RecordBatch::try_new(
            Self::arrow_schema(),
            vec![
                ax::i64s(r.iter().map(|_| Some(i64::from(V1::NUMBER)))),
                ax::i64s(r.iter().map(|a| Some(a.ts_ms))),
                ax::strings(r.iter().map(|a| Some(a.action.as_str()))),
                ax::strings(r.iter().map(|a| a.lease_id.as_deref())),
                ax::strings(r.iter().map(|a| a.team.as_deref())),
                ax::strings(r.iter().map(|a| Some(a.reason.as_str()))),
                ax::strings(r.iter().map(|a| a.policy.as_deref())),
                ax::strings(r.iter().map(|a| a.driver.as_deref())),
                ax::strings(r.iter().map(|a| Some(a.outcome.as_str()))),
                ax::strings(r.iter().map(|a| Some(a.detail.as_str()))),
            ],
        )
    }

    fn from_record_batch(batch: &RecordBatch) -> Result<Vec<Self>, ArrowConvertError> {
        let c = Columns::new(batch);
        let (ts_ms, action, lease_id, team) = (
            c.i64("ts_ms")?,
            c.str("action")?,
            c.str("lease_id")?,
            c.str("team")?,
        );
        let (reason, policy, driver) = (c.str("reason")?, c.str("policy")?, c.str("driver")?);
        let (outcome, detail) = (c.str("outcome")?, c.str("detail")?);
        (0..batch.num_rows())
            .map(|i| {
                Ok(Action {
                    v: V1,
                    ts_ms: ts_ms.req(i)?,
                    action: action.parse(i)?,
                    lease_id: lease_id.opt(i),
                    team: team.opt(i),
                    reason: reason.req(i)?,
                    policy: policy.opt(i),
                    driver: driver.opt(i),
                    outcome: outcome.parse(i)?,
                    detail: detail.req(i)?,
                })
            })
            .collect()
    }
}
