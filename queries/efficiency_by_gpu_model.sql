-- Efficiency by GPU model
--
-- Question: how well is each GPU model used, and what does an hour of useful work cost on it?
-- Columns: gpu_model, observed_gpu_hours (GPU-hours with samples), leased_gpu_hours (allocated
--   to leases), unallocated_gpu_hours (observed with no lease), busy_gpu_hours (GPU-hours ×
--   utilization), utilization_pct (busy / observed, the whole fleet of that model),
--   leased_utilization_pct (busy / allocated, within leases only), idle_pct (idle / observed),
--   cost_usd, idle_cost_usd, usd_per_busy_gpu_hour (cost / busy GPU-hours: the price of an
--   hour of work at the utilization achieved). Highest cost first.
-- Parameters: one period: add `WHERE hour >= TIMESTAMPTZ '2026-02-01T00:00:00Z' AND hour <
--   TIMESTAMPTZ '2026-03-01T00:00:00Z'` after `FROM team_hourly`.
-- Source: team_hourly.
WITH by_model AS (
    SELECT gpu_model,
           sum(observed_gpu_hours) AS observed,
           sum(CASE WHEN team <> '(unallocated)' THEN allocated_gpu_hours ELSE 0 END) AS leased,
           sum(CASE WHEN team = '(unallocated)' THEN observed_gpu_hours ELSE 0 END) AS unallocated,
           sum(busy_gpu_hours) AS busy,
           sum(CASE WHEN team <> '(unallocated)' THEN busy_gpu_hours ELSE 0 END) AS leased_busy,
           sum(idle_gpu_hours) AS idle,
           sum(cost_usd) AS cost,
           sum(idle_cost_usd) AS idle_cost
    FROM team_hourly
    GROUP BY gpu_model
)
SELECT gpu_model,
       round(observed, 3) AS observed_gpu_hours,
       round(leased, 3) AS leased_gpu_hours,
       round(unallocated, 3) AS unallocated_gpu_hours,
       round(busy, 3) AS busy_gpu_hours,
       round(CASE WHEN observed > 0 THEN 100.0 * busy / observed END, 1) AS utilization_pct,
       round(CASE WHEN leased > 0 THEN 100.0 * leased_busy / leased END, 1)
           AS leased_utilization_pct,
       round(CASE WHEN observed > 0 THEN 100.0 * idle / observed END, 1) AS idle_pct,
       round(cost, 2) AS cost_usd,
       round(idle_cost, 2) AS idle_cost_usd,
       round(CASE WHEN busy > 0 THEN cost / busy END, 2) AS usd_per_busy_gpu_hour
FROM by_model
ORDER BY cost DESC, gpu_model;
