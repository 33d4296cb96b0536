-- Savings from reclaims
--
-- Question: what did the enforcer save by taking GPUs back from leases (idle, over budget, or
--   by an administrator), in GPU-hours and dollars?
-- Columns: lease_id, team, user, workload, gpu_model, gpu_count, reason (the reclaim's),
--   granted_at, reclaimed_at, assumed_end (see below), saved_gpu_hours, usd_per_gpu_hour (the
--   lease's own rate: its cost / its allocated GPU-hours), saved_usd, idle_cost_usd (what the
--   lease had wasted on idle GPUs before it was reclaimed). Largest saving first.
-- The estimate: without the reclaim the lease would have kept its GPUs until its requested end.
--   The lake does not record that end (a lease's expires_at lives in the enforcer's database
--   and is on no lease event or action), so the query takes the enforcer's default, the
--   lease's workload max_duration after its grant (`workloads`, from the config's
--   [workloads.*]; without one, the lease would have run on), and counts no further than the lake's latest time:
--   savings realised so far, not projected. A lease asked for a shorter duration than its
--   workload's maximum is so over-credited; one still idle would have cost its full price, so
--   the dollars are the GPU-hours at the lease's rate. Reclaims for "user" (a release),
--   "expired" (the lease reached its end) and "failed" save nothing and are left out, as are
--   reclaims that did not succeed (outcome failed or dry_run).
-- Parameters: the reasons in the WHERE clause of `reclaims`. A dry-run enforcer's would-be savings: use outcome = 'dry_run' there.
-- Source: actions (action reclaim), lease_events (grant times), leases, lease_usage, samples
--   and lease_events (the lake's latest time), workloads.
WITH max_durations AS (
    SELECT workload, max_duration_ms FROM workloads
),
watermark AS (
    SELECT max(ts_ms) AS w_ms
    FROM (SELECT ts_ms FROM samples UNION ALL SELECT ts_ms FROM lease_events)
),
reclaims AS (
    SELECT lease_id, min(ts_ms) AS reclaimed_ms, min(reason) AS reason
    FROM actions
    WHERE action = 'reclaim'
      AND outcome = 'ok'
      AND reason NOT IN ('user', 'expired', 'failed')
      AND lease_id IS NOT NULL
    GROUP BY lease_id
),
granted AS (
    SELECT lease_id, min(ts_ms) AS granted_ms
    FROM lease_events
    WHERE event = 'granted'
    GROUP BY lease_id
),
estimate AS (
    SELECT r.lease_id,
           u.team,
           u."user",
           u.workload,
           u.gpu_model,
           l.gpu_count,
           r.reason,
           g.granted_ms,
           r.reclaimed_ms,
           least(COALESCE(g.granted_ms + d.max_duration_ms, w.w_ms), w.w_ms) AS end_ms,
           CASE WHEN u.allocated_gpu_hours > 0
                THEN u.cost_usd / u.allocated_gpu_hours END AS rate,
           u.idle_cost_usd
    FROM reclaims r
    JOIN granted g ON g.lease_id = r.lease_id
    JOIN leases l ON l.lease_id = r.lease_id
    JOIN lease_usage u ON u.lease_id = r.lease_id
    LEFT JOIN max_durations d ON d.workload = u.workload
    CROSS JOIN watermark w
)
SELECT lease_id,
       team,
       "user",
       workload,
       gpu_model,
       gpu_count,
       reason,
       to_timestamp_millis(granted_ms) AT TIME ZONE 'UTC' AS granted_at,
       to_timestamp_millis(reclaimed_ms) AT TIME ZONE 'UTC' AS reclaimed_at,
       to_timestamp_millis(end_ms) AT TIME ZONE 'UTC' AS assumed_end,
       round(gpu_count * greatest(end_ms - reclaimed_ms, 0) / 3600000.0, 3) AS saved_gpu_hours,
       round(rate, 2) AS usd_per_gpu_hour,
       round(gpu_count * greatest(end_ms - reclaimed_ms, 0) / 3600000.0 * rate, 2) AS saved_usd,
       round(idle_cost_usd, 2) AS idle_cost_usd
FROM estimate
ORDER BY saved_usd DESC, lease_id;
