//! `gpuwarden assess`: the maturity scorecard of a running system, from its config and its
//! lake. The evidence is read here ([`gather`]) and scored by the enforcer's one scoring
//! function, `gpuwarden_enforcer::scorecard::assess`; the portal's scorecard page reads the lake
//! through [`LakeInsights`], the same queries, so both show the same scores.

use std::path::PathBuf;
use std::process::ExitCode;

use datafusion::prelude::SessionContext;
use datafusion::scalar::ScalarValue;
use gpuwarden_enforcer::portal::insights::{IdleLease, Insights, TeamIdle};
use gpuwarden_enforcer::scorecard::{self, Evidence, Scorecard, WINDOW_DAYS};
use gpuwarden_pipeline::{sql, Lake};
use gpuwarden_schema::config;
use serde_json::{Map, Value};

/// Score the fleet on the GPU infrastructure maturity model, from evidence.
///
/// Scores eight capabilities from 1 to 5: GPU-aware provisioning, workload-driven scaling,
/// quota and access governance, runtime policy enforcement, cost visibility and optimization,
/// self-service environments, multi-substrate orchestration and integration extensibility.
/// Each score comes from what the config sets up and what the lake shows happened in the 30
/// days up to its latest sample or lease event (leases granted and where, the enforcer's
/// actions, the signals, the priced GPU-hours): configuring idle reclaim is not enough for a 5
/// in runtime enforcement, reclaims must have happened. For each capability it prints the
/// evidence and what would raise the score, then the average and its band (below 3 reactive,
/// 3 transitional, 4 advanced, 5 optimized). The README's "Maturity scorecard" states every
/// rule. Admins see the same scorecard in the portal (/ui/scorecard).
///
/// Examples:
///   gpuwarden assess --config gpuwarden.toml
///   gpuwarden assess --config gpuwarden.toml --json | jq '.scores[] | {capability, score}'
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The config file (its [[teams]], [workloads.*], [[substrates]], [[tokens]] and the lake:
    /// storage.lake, or <storage.data_dir>/lake).
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
    /// Print the scorecard as one JSON object (scores, evidence, next steps, average, band).
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let lake = super::open_lake(&config, "assess")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let evidence = runtime.block_on(gather(&lake))?;
    let card = scorecard::assess(&config, &evidence);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&card)?);
    } else {
        print!("{}", text(&card));
    }
    Ok(ExitCode::SUCCESS)
}

/// The scorecard for people: each capability, its score, evidence and next step.
fn text(card: &Scorecard) -> String {
    let mut out = String::new();
    match card.as_of_ms {
        Some(ms) => out.push_str(&format!(
            "Maturity scorecard, from the {WINDOW_DAYS} days of the lake up to {}\n\n",
            humantime::format_rfc3339_seconds(
                std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64)
            )
        )),
        None => out.push_str("Maturity scorecard, from an empty lake\n\n"),
    }
    for s in &card.scores {
        out.push_str(&format!("{}/5  {}\n", s.score, s.title));
        for line in &s.evidence {
            out.push_str(&format!("      - {line}\n"));
        }
        if let Some(next) = &s.next {
            out.push_str(&format!("      to raise it: {next}\n"));
        }
    }
    out.push_str(&format!(
        "\nAverage {:.2} of 5: {}\n",
        card.average,
        card.band.as_str()
    ));
    out
}

/// Rows of `query` (with `params` for `$1`, `$2`…) as JSON objects.
async fn rows(
    ctx: &SessionContext,
    query: &str,
    params: Vec<ScalarValue>,
) -> anyhow::Result<Vec<Map<String, Value>>> {
    let mut frame = ctx.sql(query).await?;
    if !params.is_empty() {
        frame = frame.with_param_values(params)?;
    }
    let batches = frame.collect().await?;
    let mut writer = datafusion::arrow::json::ArrayWriter::new(Vec::new());
    for batch in &batches {
        writer.write(batch)?;
    }
    writer.finish()?;
    let bytes = writer.into_inner();
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    Ok(serde_json::from_slice(&bytes)?)
}

fn f64_of(row: &Map<String, Value>, column: &str) -> f64 {
    row.get(column).and_then(Value::as_f64).unwrap_or(0.0)
}

fn u64_of(row: &Map<String, Value>, column: &str) -> u64 {
    row.get(column).and_then(Value::as_u64).unwrap_or(0)
}

fn text_of(row: &Map<String, Value>, column: &str) -> String {
    row.get(column)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// The lake's watermark: its latest sample or lease event, as the queries of `queries/` take
/// "now"; none for an empty lake.
async fn watermark(ctx: &SessionContext) -> anyhow::Result<Option<i64>> {
    let found = rows(
        ctx,
        "SELECT max(ts_ms) AS w FROM (SELECT ts_ms FROM samples UNION ALL SELECT ts_ms FROM lease_events)",
        Vec::new(),
    )
    .await?;
    Ok(found
        .first()
        .and_then(|r| r.get("w"))
        .and_then(Value::as_i64))
}

/// The scorecard's evidence: the lake's [`WINDOW_DAYS`] up to its watermark (the latest sample
/// or lease event, as the queries of `queries/` take "now").
pub(crate) async fn gather(lake: &Lake) -> anyhow::Result<Evidence> {
    let ctx = sql::context(lake).await?;
    let Some(w) = watermark(&ctx).await? else {
        return Ok(Evidence::default());
    };
    let from = w - WINDOW_DAYS * 86_400_000;
    let mut e = Evidence {
        as_of_ms: Some(w),
        ..Evidence::default()
    };
    // The leases held in the window: granted before its end (the watermark) and not released
    // before its start, so a lease granted earlier and still running counts.
    let granted = format!(
        "FROM lease_events WHERE event = 'granted' AND ts_ms <= {w} AND lease_id NOT IN \
         (SELECT lease_id FROM lease_events WHERE event = 'released' AND ts_ms <= {from})"
    );
    for row in rows(
        &ctx,
        &format!(
            "SELECT count(*) AS n, sum(CASE WHEN cardinality(gpu_uuids) > 0 THEN 1 ELSE 0 END) AS named {granted}"
        ),
        Vec::new(),
    )
    .await?
    {
        e.leases_granted = u64_of(&row, "n");
        e.leases_on_named_gpus = u64_of(&row, "named");
    }
    for (column, into) in [
        ("substrate", &mut e.substrates_with_leases),
        ("gpu_model", &mut e.gpu_models_leased),
        ("user", &mut e.users_with_leases),
        ("team", &mut e.teams_with_leases),
    ] {
        for row in rows(
            &ctx,
            &format!("SELECT DISTINCT \"{column}\" AS v {granted}"),
            Vec::new(),
        )
        .await?
        {
            into.insert(text_of(&row, "v"));
        }
    }
    for row in rows(
        &ctx,
        &format!(
            "SELECT action, reason, count(*) AS n FROM actions \
             WHERE outcome = 'ok' AND ts_ms > {from} GROUP BY action, reason"
        ),
        Vec::new(),
    )
    .await?
    {
        e.actions.insert(
            format!("{}:{}", text_of(&row, "action"), text_of(&row, "reason")),
            u64_of(&row, "n"),
        );
    }
    for row in rows(
        &ctx,
        &format!("SELECT kind, count(*) AS n FROM signals WHERE ts_ms > {from} GROUP BY kind"),
        Vec::new(),
    )
    .await?
    {
        e.signals.insert(text_of(&row, "kind"), u64_of(&row, "n"));
    }
    // The leased GPU-hours only: capacity no lease holds is idle by definition, and says
    // nothing about how well leases use their GPUs.
    for row in rows(
        &ctx,
        &format!(
            "SELECT sum(cost_usd) AS cost, sum(idle_cost_usd) AS idle FROM team_hourly \
             WHERE team <> '(unallocated)' AND hour >= to_timestamp_millis({from})"
        ),
        Vec::new(),
    )
    .await?
    {
        e.cost_usd = f64_of(&row, "cost");
        e.idle_cost_usd = f64_of(&row, "idle");
    }
    Ok(e)
}

/// A team's idle cost in the UTC month holding `now_ms`, with its `limit` leases of the
/// highest idle cost. How far its figures reach is the rollups' own watermark, read from their
/// state file (`rollups/_state.json`), not a scan of the raw tables: the rollups may lag the
/// latest sample, and the team page should not read all raw data on every render.
async fn team_idle(lake: &Lake, team: &str, now_ms: i64, limit: usize) -> anyhow::Result<TeamIdle> {
    let state = lake.clone();
    let as_of_ms =
        tokio::task::spawn_blocking(move || gpuwarden_pipeline::compact::rollup_watermark(&state))
            .await?;
    let ctx = sql::context(lake).await?;
    let (start, end) = gpuwarden_schema::calendar::month_of(now_ms);
    let month =
        format!("hour >= to_timestamp_millis({start}) AND hour < to_timestamp_millis({end})");
    let mut idle = TeamIdle {
        as_of_ms,
        ..TeamIdle::default()
    };
    for row in rows(
        &ctx,
        &format!(
            "SELECT sum(cost_usd) AS cost, sum(idle_cost_usd) AS idle FROM team_hourly \
             WHERE team = $1 AND {month}"
        ),
        vec![ScalarValue::from(team)],
    )
    .await?
    {
        idle.cost_usd = f64_of(&row, "cost");
        idle.idle_cost_usd = f64_of(&row, "idle");
    }
    let top = rows(
        &ctx,
        &format!(
            "SELECT h.lease_id, max(l.\"user\") AS \"user\", max(l.workload) AS workload, \
                    sum(h.idle_cost_usd) AS idle_cost_usd, sum(h.cost_usd) AS cost_usd \
             FROM lease_hourly h LEFT JOIN leases l ON l.lease_id = h.lease_id \
             WHERE h.team = $1 AND h.lease_id IS NOT NULL AND h.{month} \
             GROUP BY h.lease_id HAVING sum(h.idle_cost_usd) > 0 \
             ORDER BY idle_cost_usd DESC, h.lease_id LIMIT {limit}"
        ),
        vec![ScalarValue::from(team)],
    )
    .await?;
    idle.top = top
        .iter()
        .map(|row| IdleLease {
            lease_id: text_of(row, "lease_id"),
            user: text_of(row, "user"),
            workload: text_of(row, "workload"),
            idle_cost_usd: f64_of(row, "idle_cost_usd"),
            cost_usd: f64_of(row, "cost_usd"),
        })
        .collect();
    Ok(idle)
}

/// The lake as the portal reads it: the same queries as `gpuwarden assess`.
#[derive(Debug)]
pub(crate) struct LakeInsights {
    lake: Lake,
}

impl LakeInsights {
    pub(crate) fn new(lake: Lake) -> Self {
        Self { lake }
    }
}

#[async_trait::async_trait]
impl Insights for LakeInsights {
    async fn team_idle(&self, team: &str, now_ms: i64, limit: usize) -> Result<TeamIdle, String> {
        team_idle(&self.lake, team, now_ms, limit)
            .await
            .map_err(|e| format!("{e:#}"))
    }

    async fn evidence(&self) -> Result<Evidence, String> {
        gather(&self.lake).await.map_err(|e| format!("{e:#}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_shows_each_score_its_evidence_and_the_band() {
        let card = scorecard::assess(&config::Config::default(), &Evidence::default());
        let out = text(&card);
        assert!(
            out.starts_with("Maturity scorecard, from an empty lake\n"),
            "{out}"
        );
        assert!(out.contains("1/5  Runtime policy enforcement\n"), "{out}");
        assert!(out.contains("to raise it: set max_duration"), "{out}");
        assert!(out.ends_with("Average 1.00 of 5: reactive\n"), "{out}");
    }

    #[tokio::test]
    async fn the_idle_card_reaches_as_far_as_the_rollups_watermark() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let idle = team_idle(&lake, "ml", 1_767_225_600_000, 5).await.unwrap();
        assert_eq!(idle.as_of_ms, None, "no rollups have run");
        // The rollups' state names their watermark; the raw tables (empty here) are not read
        // for it.
        std::fs::create_dir_all(dir.path().join("rollups")).unwrap();
        std::fs::write(
            dir.path().join("rollups/_state.json"),
            r#"{"hours": {}, "watermark": 1767229200000, "pending": []}"#,
        )
        .unwrap();
        let idle = team_idle(&lake, "ml", 1_767_225_600_000, 5).await.unwrap();
        assert_eq!(idle.as_of_ms, Some(1_767_229_200_000));
    }
}
