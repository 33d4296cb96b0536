-- Cost by team and month
--
-- Question: what did each team's GPUs cost, month by month, and how much of it paid for idle
--   GPUs? "(unallocated)" is capacity no lease held (priced like any other GPU-hour).
-- Columns: month (YYYY-MM, UTC), team, allocated_gpu_hours, busy_gpu_hours, utilization_pct
--   (busy / observed GPU-hours), cost_usd, idle_cost_usd (GPU-hours under
--   pricing.idle_util_pct, priced), share_of_month_pct (the team's part of the month's cost).
--   Rows by month, then by cost (highest first).
-- Parameters: one month only: add `WHERE hour >= TIMESTAMPTZ '2026-01-01T00:00:00Z' AND
--   hour < TIMESTAMPTZ '2026-02-01T00:00:00Z'` after `FROM team_hourly`. By year instead of
--   month: use '%Y' in to_char. Money is rounded to cents, hours to 1/1000.
-- Source: team_hourly (docs/src/finops/definitions.md).
WITH monthly AS (
    SELECT to_char(hour, '%Y-%m') AS month,
           team,
           sum(allocated_gpu_hours) AS allocated,
           sum(observed_gpu_hours) AS observed,
           sum(busy_gpu_hours) AS busy,
           sum(cost_usd) AS cost,
           sum(idle_cost_usd) AS idle_cost
    FROM team_hourly
    GROUP BY 1, 2
)
SELECT month,
       team,
       round(allocated, 3) AS allocated_gpu_hours,
       round(busy, 3) AS busy_gpu_hours,
       round(CASE WHEN observed > 0 THEN 100.0 * busy / observed END, 1) AS utilization_pct,
       round(cost, 2) AS cost_usd,
       round(idle_cost, 2) AS idle_cost_usd,
       round(CASE WHEN sum(cost) OVER (PARTITION BY month) > 0
                  THEN 100.0 * cost / sum(cost) OVER (PARTITION BY month) END, 1)
           AS share_of_month_pct
FROM monthly
ORDER BY month, cost DESC, team;
