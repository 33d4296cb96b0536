-- Right-sizing candidates
--
-- Question: which leases hold more GPU than their work needs: peak memory under half of the
--   GPU's and utilization under 30 %, so fewer or smaller GPUs would do?
-- Columns: lease_id, team, user, workload, gpu_model, gpu_count, state (active, released),
--   utilization_pct (busy / observed GPU-hours over the lease's life), peak_mem_gib and
--   peak_mem_pct (the most memory any of its GPUs used, of that GPU's memory), suggested_gpus
--   (GPUs that would run the same work at the target utilization; at least 1), cost_usd,
--   idle_cost_usd, savings_usd_per_hour_at_suggested (what dropping to suggested_gpus saves per
--   hour at the lease's rate). Largest cost first.
-- A lease's samples are those attributed to it (docs/src/finops/definitions.md#attribution: the samples
--   naming it, and those of the GPUs its segments hold while they hold them; where grants
--   overlap, the most recently granted lease's).
-- Parameters: `params`: peak memory under max_peak_mem_pct (50) and utilization under
--   max_util_pct (30) make a candidate; target_util_pct (60) sizes the suggestion. Reads every
--   sample: on a large lake, restrict the period in `s`, e.g.
--   `WHERE to_timestamp_millis(ts_ms) >= TIMESTAMP '2026-02-01 00:00:00'`.
-- Source: samples, lease_events, leases, lease_usage.
WITH params AS (
    SELECT 50.0 AS max_peak_mem_pct, 30.0 AS max_util_pct, 60.0 AS target_util_pct
),
s AS (
    SELECT gpu_uuid, ts_ms,
           max(mem_used_bytes) AS mem_used, max(mem_total_bytes) AS mem_total,
           max(lease_id) AS lease_id
    FROM samples
    GROUP BY gpu_uuid, ts_ms
),
events AS (
    SELECT lease_id, ts_ms, event, gpu_uuids,
           lead(ts_ms) OVER (PARTITION BY lease_id ORDER BY ts_ms,
                             CASE event WHEN 'granted' THEN 0 WHEN 'resized' THEN 1 ELSE 2 END)
               AS next_ms
    FROM lease_events
),
segments AS (
    SELECT lease_id, ts_ms AS start_ms, next_ms, unnest(gpu_uuids) AS gpu_uuid
    FROM events
    WHERE event <> 'released'
),
by_segment AS (
    SELECT lease_id, gpu_uuid, ts_ms, mem_used, mem_total
    FROM (
        SELECT g.lease_id, s.gpu_uuid, s.ts_ms, s.mem_used, s.mem_total,
               row_number() OVER (PARTITION BY s.gpu_uuid, s.ts_ms
                                  ORDER BY l.granted_at DESC, g.lease_id) AS n
        FROM s
        JOIN segments g
          ON g.gpu_uuid = s.gpu_uuid AND s.ts_ms >= g.start_ms
         AND (g.next_ms IS NULL OR s.ts_ms < g.next_ms)
        JOIN leases l ON l.lease_id = g.lease_id
        WHERE s.lease_id IS NULL OR s.lease_id NOT IN (SELECT lease_id FROM leases)
    )
    WHERE n = 1
),
attributed AS (
    SELECT s.lease_id, s.mem_used, s.mem_total
    FROM s
    JOIN leases l ON l.lease_id = s.lease_id
    UNION ALL
    SELECT lease_id, mem_used, mem_total FROM by_segment
),
peaks AS (
    SELECT lease_id,
           max(mem_used) AS peak_bytes,
           max(100.0 * mem_used / mem_total) AS peak_pct
    FROM attributed
    WHERE mem_total > 0
    GROUP BY lease_id
)
SELECT u.lease_id,
       u.team,
       u."user",
       u.workload,
       u.gpu_model,
       l.gpu_count,
       l.state,
       round(u.utilization_pct, 1) AS utilization_pct,
       round(k.peak_bytes / 1073741824.0, 1) AS peak_mem_gib,
       round(k.peak_pct, 1) AS peak_mem_pct,
       greatest(CAST(ceil(l.gpu_count * u.utilization_pct / p.target_util_pct) AS BIGINT), 1)
           AS suggested_gpus,
       round(u.cost_usd, 2) AS cost_usd,
       round(u.idle_cost_usd, 2) AS idle_cost_usd,
       round((l.gpu_count - greatest(CAST(ceil(l.gpu_count * u.utilization_pct
                                                / p.target_util_pct) AS BIGINT), 1))
             * u.cost_usd / u.allocated_gpu_hours, 2) AS savings_usd_per_hour_at_suggested
FROM lease_usage u
JOIN leases l ON l.lease_id = u.lease_id
JOIN peaks k ON k.lease_id = u.lease_id
CROSS JOIN params p
WHERE k.peak_pct < p.max_peak_mem_pct
  AND u.utilization_pct < p.max_util_pct
  AND u.allocated_gpu_hours > 0
ORDER BY cost_usd DESC, u.lease_id;
