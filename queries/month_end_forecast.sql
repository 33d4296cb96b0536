-- Month-end forecast
--
-- Question: at the current burn rate, what will each team have spent by the end of the month,
--   and will it stay within its budget?
-- "Now" is the lake's own latest time (the rollups' watermark: the latest sample or lease
--   event), never the wall clock, so the answer for a given lake never changes. The month is
--   the watermark's month (UTC).
-- Columns: month (YYYY-MM), as_of (the watermark), team ("(unallocated)" too: capacity no lease
--   holds, with no budget), monthly_budget_usd (empty without one), month_to_date_usd
--   (team_hourly's cost in the month so far), burn_usd_per_hour, burn_source, hours_left (from
--   the watermark to the end of the month), forecast_usd (month to date + burn x hours left),
--   forecast_vs_budget_usd (forecast - budget: positive means over), budget_exhausted_at (the
--   minute the burn rate uses the budget up, if within the month; empty otherwise), status
--   ("over budget" already, "forecast over budget", "within budget" or "no budget"). Highest
--   forecast first.
-- The burn rate is the latest `team_spend` signal of the month at or before the watermark (the
--   price of the GPUs the team's open leases hold: what the enforcer budgets with); a team with
--   no such signal (e.g. "(unallocated)", or a lake without signals) burns at what it cost in
--   the last complete hour before the watermark's hour.
-- Parameters: none; the budgets are the config's (`teams`: the [[teams]] of the config the
--   pipeline or `gpuwarden sql` runs with).
-- Source: team_hourly, signals (kind team_spend), samples and lease_events (the watermark),
--   teams.
WITH budgets AS (
    SELECT team, monthly_budget_usd FROM teams
),
watermark AS (
    SELECT max(ts_ms) AS w_ms
    FROM (SELECT ts_ms FROM samples UNION ALL SELECT ts_ms FROM lease_events)
),
bounds AS (
    SELECT w_ms,
           date_trunc('month', to_timestamp_millis(w_ms)) AS month_start,
           date_trunc('month', to_timestamp_millis(w_ms)) + INTERVAL '1 month' AS month_end,
           date_trunc('hour', to_timestamp_millis(w_ms)) - INTERVAL '1 hour' AS last_full_hour
    FROM watermark
),
month_to_date AS (
    SELECT t.team, sum(t.cost_usd) AS usd
    FROM team_hourly t, bounds b
    WHERE t.hour >= b.month_start AND t.hour < b.month_end
    GROUP BY t.team
),
last_hour AS (
    SELECT t.team, sum(t.cost_usd) AS usd_per_hour
    FROM team_hourly t, bounds b
    WHERE t.hour = b.last_full_hour
    GROUP BY t.team
),
latest_signal AS (
    SELECT team, burn_usd_per_hour
    FROM (
        SELECT s.team,
               s.burn_usd_per_hour,
               row_number() OVER (PARTITION BY s.team ORDER BY s.ts_ms DESC) AS n
        FROM signals s, bounds b
        WHERE s.kind = 'team_spend'
          AND s.ts_ms <= b.w_ms
          AND to_timestamp_millis(s.ts_ms) >= b.month_start
    )
    WHERE n = 1
),
all_teams AS (
    SELECT team FROM budgets
    UNION
    SELECT team FROM month_to_date
),
forecast AS (
    SELECT t.team,
           bg.monthly_budget_usd,
           COALESCE(m.usd, 0.0) AS to_date,
           COALESCE(s.burn_usd_per_hour, l.usd_per_hour, 0.0) AS burn,
           CASE WHEN s.burn_usd_per_hour IS NOT NULL THEN 'team_spend signal'
                ELSE 'last complete hour' END AS burn_source,
           (to_unixtime(b.month_end) * 1000 - b.w_ms) / 3600000.0 AS hours_left,
           b.w_ms,
           b.month_start
    FROM all_teams t
    CROSS JOIN bounds b
    LEFT JOIN budgets bg ON bg.team = t.team
    LEFT JOIN month_to_date m ON m.team = t.team
    LEFT JOIN latest_signal s ON s.team = t.team
    LEFT JOIN last_hour l ON l.team = t.team
)
SELECT to_char(month_start, '%Y-%m') AS month,
       to_timestamp_millis(w_ms) AT TIME ZONE 'UTC' AS as_of,
       team,
       round(monthly_budget_usd, 2) AS monthly_budget_usd,
       round(to_date, 2) AS month_to_date_usd,
       round(burn, 2) AS burn_usd_per_hour,
       burn_source,
       round(hours_left, 3) AS hours_left,
       round(to_date + burn * hours_left, 2) AS forecast_usd,
       round(to_date + burn * hours_left - monthly_budget_usd, 2) AS forecast_vs_budget_usd,
       CASE WHEN burn > 0 AND to_date < monthly_budget_usd
                 AND (monthly_budget_usd - to_date) / burn < hours_left
            THEN date_trunc('minute', to_timestamp_millis(
                     w_ms + CAST((monthly_budget_usd - to_date) / burn * 3600000.0 AS BIGINT)))
                 AT TIME ZONE 'UTC'
       END AS budget_exhausted_at,
       CASE WHEN monthly_budget_usd IS NULL THEN 'no budget'
            WHEN to_date > monthly_budget_usd THEN 'over budget'
            WHEN to_date + burn * hours_left > monthly_budget_usd THEN 'forecast over budget'
            ELSE 'within budget' END AS status
FROM forecast
ORDER BY forecast_usd DESC, team;
