-- Cost of unallocated capacity
--
-- Question: what did the GPUs that no lease held cost, month by month and model by model, and
--   how much of that capacity was idle rather than running unleased (rogue) work?
-- Columns: month (YYYY-MM, UTC), gpu_model, unallocated_gpu_hours (observed GPU-hours no lease
--   held), idle_gpu_hours (of those, under pricing.idle_util_pct), in_use_gpu_hours (the rest:
--   work without a lease, see rogue_usage.sql), cost_usd (all of it, at the model's price),
--   idle_cost_usd, in_use_cost_usd. By month, then highest cost first. (Its share of each
--   month's cost is in cost_by_team_month.sql.)
-- Parameters: one month: add `AND hour >= TIMESTAMPTZ '2026-02-01T00:00:00Z' AND hour <
--   TIMESTAMPTZ '2026-03-01T00:00:00Z'` to the WHERE clause.
-- Source: team_hourly, team "(unallocated)" (priced at allocated = observed GPU-hours).
WITH monthly AS (
    SELECT to_char(hour, '%Y-%m') AS month,
           gpu_model,
           sum(observed_gpu_hours) AS gpu_hours,
           sum(idle_gpu_hours) AS idle,
           sum(cost_usd) AS cost,
           sum(idle_cost_usd) AS idle_cost
    FROM team_hourly
    WHERE team = '(unallocated)'
    GROUP BY 1, 2
)
SELECT month,
       gpu_model,
       round(gpu_hours, 3) AS unallocated_gpu_hours,
       round(idle, 3) AS idle_gpu_hours,
       round(gpu_hours - idle, 3) AS in_use_gpu_hours,
       round(cost, 2) AS cost_usd,
       round(idle_cost, 2) AS idle_cost_usd,
       round(cost - idle_cost, 2) AS in_use_cost_usd
FROM monthly
ORDER BY month, cost DESC, gpu_model;
