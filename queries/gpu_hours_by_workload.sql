-- GPU-hours by workload
--
-- Question: month by month, how are GPU-hours and dollars split between training, inference,
--   notebooks and batch jobs, and which kind of work leaves its GPUs idle?
-- Columns: month (YYYY-MM, UTC), workload, leases (with cost that month), gpu_hours
--   (allocated), busy_gpu_hours, utilization_pct (busy / observed), cost_usd, idle_cost_usd,
--   share_of_leased_cost_pct (of the month's leased cost). By month, then highest cost first.
-- Parameters: one month: add `AND h.hour >= TIMESTAMPTZ '2026-02-01T00:00:00Z' AND h.hour <
--   TIMESTAMPTZ '2026-03-01T00:00:00Z'` to the WHERE clause; by team as well: add l.team to
--   the SELECT and GROUP BY of `monthly` and to the final SELECT and ORDER BY.
-- Source: lease_hourly and leases (each lease's workload).
WITH monthly AS (
    SELECT to_char(h.hour, '%Y-%m') AS month,
           l.workload,
           count(DISTINCT h.lease_id) AS leases,
           sum(h.allocated_gpu_hours) AS gpu_hours,
           sum(h.observed_gpu_hours) AS observed,
           sum(h.busy_gpu_hours) AS busy,
           sum(h.cost_usd) AS cost,
           sum(h.idle_cost_usd) AS idle_cost
    FROM lease_hourly h
    JOIN leases l ON l.lease_id = h.lease_id
    WHERE h.lease_id IS NOT NULL
    GROUP BY 1, 2
)
SELECT month,
       workload,
       leases,
       round(gpu_hours, 3) AS gpu_hours,
       round(busy, 3) AS busy_gpu_hours,
       round(CASE WHEN observed > 0 THEN 100.0 * busy / observed END, 1) AS utilization_pct,
       round(cost, 2) AS cost_usd,
       round(idle_cost, 2) AS idle_cost_usd,
       round(CASE WHEN sum(cost) OVER (PARTITION BY month) > 0
                  THEN 100.0 * cost / sum(cost) OVER (PARTITION BY month) END, 1)
           AS share_of_leased_cost_pct
FROM monthly
ORDER BY month, cost DESC, workload;
