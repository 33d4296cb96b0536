-- Top users by cost
--
-- Question: whose leases cost the most, and how well did they use what they paid for?
-- Columns: user, team, leases (how many leases had cost in the period), gpu_hours (allocated),
--   busy_gpu_hours, utilization_pct (busy / observed), cost_usd, idle_cost_usd,
--   share_of_cost_pct (of all leased cost in the period; unallocated capacity is nobody's).
--   Highest cost first.
-- Parameters: N is the LIMIT (10). One period: add `AND h.hour >= TIMESTAMPTZ
--   '2026-02-01T00:00:00Z' AND h.hour < TIMESTAMPTZ '2026-03-01T00:00:00Z'` to the WHERE
--   clause. A user in two teams has a row per team.
-- Source: lease_hourly (cost per lease and hour) and leases (who holds each lease).
WITH per_user AS (
    SELECT l."user",
           l.team,
           count(DISTINCT h.lease_id) AS leases,
           sum(h.allocated_gpu_hours) AS gpu_hours,
           sum(h.observed_gpu_hours) AS observed,
           sum(h.busy_gpu_hours) AS busy,
           sum(h.cost_usd) AS cost,
           sum(h.idle_cost_usd) AS idle_cost
    FROM lease_hourly h
    JOIN leases l ON l.lease_id = h.lease_id
    WHERE h.lease_id IS NOT NULL
    GROUP BY l."user", l.team
)
SELECT "user",
       team,
       leases,
       round(gpu_hours, 3) AS gpu_hours,
       round(busy, 3) AS busy_gpu_hours,
       round(CASE WHEN observed > 0 THEN 100.0 * busy / observed END, 1) AS utilization_pct,
       round(cost, 2) AS cost_usd,
       round(idle_cost, 2) AS idle_cost_usd,
       round(CASE WHEN sum(cost) OVER () > 0 THEN 100.0 * cost / sum(cost) OVER () END, 1)
           AS share_of_cost_pct
FROM per_user
ORDER BY cost DESC, "user", team
LIMIT 10;
