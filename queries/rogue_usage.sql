-- Rogue (unattributed) usage
--
-- Question: which GPUs ran work that no lease accounts for, when, how much, what did it cost,
--   and who might it be?
-- A sample is unattributed when it names no lease the lake knows and no lease's segment holds
--   its GPU at its ts_ms (segments from lease_events, each grant or resize to the lease's next
--   event); it is rogue work when it is also busy, at or above pricing.idle_util_pct. Judged
--   whole at ts_ms: the rollups (docs/src/finops/definitions.md#attribution) split an interval that
--   straddles a grant or a release, so this list can differ from team_hourly's unallocated
--   busy time by those parts of intervals.
-- Columns: host, gpu_uuid, gpu_model, first_seen, last_seen (the intervals' ends, UTC),
--   rogue_gpu_hours (Σ interval of the busy unattributed samples), busy_gpu_hours (× their
--   utilization), mean_util_pct, cost_usd (rogue GPU-hours at the price team_hourly gives the
--   model), labels (the labels of the latest such sample, e.g. the Kubernetes pod), alerts (the
--   enforcer's "unattributed" alerts about that GPU). Highest cost first.
-- Parameters: `params`: the idle threshold (keep it equal to pricing.idle_util_pct). One
--   period: add `AND to_timestamp_millis(s.ts_ms) >= TIMESTAMP '2026-02-01 00:00:00'` (and
--   `<` its end) to the WHERE clause of `rogue`.
--   Reads every sample: on a large lake, restrict the period.
-- Source: samples, lease_events, leases, team_hourly (prices), actions (alerts).
WITH params AS (
    SELECT 5.0 AS idle_util_pct
),
-- Duplicates (same GPU and time) count once, each column taking its largest value, as in the
-- rollups.
s AS (
    SELECT gpu_uuid, ts_ms,
           max(host) AS host, max(gpu_model) AS gpu_model, max(interval_ms) AS interval_ms,
           max(util_gpu_pct) AS util, max(lease_id) AS lease_id, max(labels) AS labels
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
rogue AS (
    SELECT s.*
    FROM s
    CROSS JOIN params p
    LEFT JOIN leases named ON named.lease_id = s.lease_id
    LEFT JOIN segments g
           ON g.gpu_uuid = s.gpu_uuid AND s.ts_ms >= g.start_ms
          AND (g.next_ms IS NULL OR s.ts_ms < g.next_ms)
    WHERE named.lease_id IS NULL
      AND g.lease_id IS NULL
      AND s.util >= p.idle_util_pct
),
prices AS (
    SELECT gpu_model, sum(cost_usd) / sum(allocated_gpu_hours) AS usd_per_gpu_hour
    FROM team_hourly
    WHERE allocated_gpu_hours > 0
    GROUP BY gpu_model
),
per_gpu AS (
    SELECT host, gpu_uuid, gpu_model,
           min(ts_ms) AS first_ms,
           max(ts_ms) AS last_ms,
           sum(interval_ms) / 3600000.0 AS gpu_hours,
           sum(interval_ms * util / 100.0) / 3600000.0 AS busy
    FROM rogue
    GROUP BY host, gpu_uuid, gpu_model
),
latest_labels AS (
    SELECT gpu_uuid, labels
    FROM (SELECT gpu_uuid, labels,
                 row_number() OVER (PARTITION BY gpu_uuid ORDER BY ts_ms DESC) AS n
          FROM rogue)
    WHERE n = 1
),
alerts AS (
    SELECT r.gpu_uuid, count(*) AS n
    FROM (SELECT DISTINCT gpu_uuid FROM rogue) r
    JOIN actions a
      ON a.reason = 'unattributed' AND strpos(a.detail, 'GPU ' || r.gpu_uuid || ' on ') > 0
    GROUP BY r.gpu_uuid
)
SELECT g.host,
       g.gpu_uuid,
       g.gpu_model,
       to_timestamp_millis(g.first_ms) AT TIME ZONE 'UTC' AS first_seen,
       to_timestamp_millis(g.last_ms) AT TIME ZONE 'UTC' AS last_seen,
       round(g.gpu_hours, 3) AS rogue_gpu_hours,
       round(g.busy, 3) AS busy_gpu_hours,
       round(100.0 * g.busy / g.gpu_hours, 1) AS mean_util_pct,
       round(g.gpu_hours * p.usd_per_gpu_hour, 2) AS cost_usd,
       l.labels,
       COALESCE(a.n, 0) AS alerts
FROM per_gpu g
LEFT JOIN prices p ON p.gpu_model = g.gpu_model
LEFT JOIN latest_labels l ON l.gpu_uuid = g.gpu_uuid
LEFT JOIN alerts a ON a.gpu_uuid = g.gpu_uuid
ORDER BY cost_usd DESC, g.gpu_uuid;
