-- Idle waste by lease (top N)
--
-- Question: which leases wasted the most money on idle GPUs?
-- Columns: lease_id, team, user, workload, gpu_model, gpu_count, release_reason (empty while
--   the lease runs), allocated_gpu_hours, idle_gpu_hours (GPU-hours of samples under
--   pricing.idle_util_pct), idle_cost_usd, cost_usd, idle_share_pct (idle cost / cost).
--   Highest idle cost first; only leases with some idle cost.
-- Parameters: N is the LIMIT (10). Over the leases of one team: add `AND team = 'vision'` to
--   the WHERE clause. Over one period instead of each lease's whole life: sum lease_hourly's
--   idle_cost_usd over the hours wanted instead of reading lease_usage.
-- Source: lease_usage (one row per lease, measures over its whole life).
SELECT lease_id,
       team,
       "user",
       workload,
       gpu_model,
       gpu_count,
       release_reason,
       round(allocated_gpu_hours, 3) AS allocated_gpu_hours,
       round(idle_gpu_hours, 3) AS idle_gpu_hours,
       round(idle_cost_usd, 2) AS idle_cost_usd,
       round(cost_usd, 2) AS cost_usd,
       round(CASE WHEN cost_usd > 0 THEN 100.0 * idle_cost_usd / cost_usd END, 1)
           AS idle_share_pct
FROM lease_usage
WHERE idle_cost_usd > 0
ORDER BY idle_cost_usd DESC, lease_id
LIMIT 10;
