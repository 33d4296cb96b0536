-- team_hourly computed by DuckDB straight from the lake's raw Parquet, following
-- docs/ARCHITECTURE.md "What the numbers mean" (the same rules as pipeline/src/rollup): the
-- peer of `gpuwarden rollup` in bench/rollup-vs-duckdb.sh, which also checks that both give the
-- same rows. {lake}, {price}, {idle} and {lateness_ms} are filled in by the script.
WITH
raw_events AS (
    SELECT DISTINCT ON (lease_id, ts_ms, event) *,
           CASE event WHEN 'granted' THEN 0 WHEN 'resized' THEN 1 ELSE 2 END AS k
    FROM read_parquet('{lake}/lease_events/**/*.parquet')
),
ranked AS (
    SELECT *, row_number() OVER (PARTITION BY lease_id ORDER BY ts_ms, k) AS n
    FROM raw_events
),
kept AS (  -- nothing after a lease's first release counts
    SELECT * FROM (
        SELECT *, min(CASE WHEN event = 'released' THEN n END) OVER (PARTITION BY lease_id) AS rel_n
        FROM ranked)
    WHERE rel_n IS NULL OR n <= rel_n
),
identity AS (  -- from the first "granted" event, else the first event
    SELECT lease_id,
           arg_min(team, (k <> 0, n)) AS team,
           arg_min(gpu_model, (k <> 0, n)) AS gpu_model,
           arg_min(ts_ms, (k <> 0, n)) AS granted_at
    FROM kept GROUP BY lease_id
),
segments AS (
    SELECT lease_id, ts_ms AS start_ms, gpu_count, gpu_uuids, event,
           lead(ts_ms) OVER (PARTITION BY lease_id ORDER BY n) AS end_ms
    FROM kept
),
segs AS (SELECT * FROM segments WHERE event <> 'released'),
samples AS (SELECT * FROM read_parquet('{lake}/samples/**/*.parquet')),
watermark AS (
    SELECT greatest((SELECT max(ts_ms) FROM samples), (SELECT max(ts_ms) FROM raw_events)) AS w
),
owners AS (
    SELECT s.lease_id, i.granted_at, unnest(s.gpu_uuids) AS gpu_uuid, s.start_ms, s.end_ms
    FROM segs s JOIN identity i USING (lease_id)
),
-- Deduplication and GPU-and-time matching in one aggregate: duplicates match the same owners,
-- and max / arg_max do not care how many times a row is seen.
attributed AS (
    SELECT r.gpu_uuid, r.ts_ms,
           max(r.gpu_model) AS gpu_model, max(r.interval_ms) AS interval_ms,
           max(r.util_gpu_pct) AS util, max(r.power_w) AS power_w, max(r.lease_id) AS lease_id,
           arg_max(o.lease_id, (o.granted_at, o.lease_id)) AS matched
    FROM samples r
    LEFT JOIN owners o
           ON r.gpu_uuid = o.gpu_uuid AND r.ts_ms >= o.start_ms
          AND (o.end_ms IS NULL OR r.ts_ms < o.end_ms)
    GROUP BY r.gpu_uuid, r.ts_ms
),
usage AS (
    SELECT (a.ts_ms // 3600000) * 3600000 AS hour,
           coalesce(k.lease_id, a.matched) AS lease,
           CASE WHEN coalesce(k.lease_id, a.matched) IS NULL THEN a.gpu_model END AS own_model,
           sum(a.interval_ms) AS observed_ms,
           sum(a.interval_ms * a.util) AS busy_ms_pct,
           sum(CASE WHEN a.util < {idle} THEN a.interval_ms ELSE 0 END) AS idle_ms,
           sum(coalesce(a.power_w, 0) * a.interval_ms) AS energy_w_ms
    FROM attributed a LEFT JOIN identity k ON a.lease_id = k.lease_id
    GROUP BY ALL
),
allocation AS (
    SELECT lease_id AS lease, hour,
           sum(greatest(0, least(coalesce(end_ms, w), hour + 3600000) - greatest(start_ms, hour))
               * gpu_count) / 3600000.0 AS allocated
    FROM (SELECT s.*, w,
                 unnest(range((s.start_ms // 3600000) * 3600000, coalesce(s.end_ms, w), 3600000)) AS hour
          FROM segs s, watermark)
    GROUP BY ALL
    HAVING allocated > 0
),
joined AS (
    SELECT coalesce(u.hour, a.hour) AS hour, coalesce(u.lease, a.lease) AS lease, u.own_model,
           a.allocated, coalesce(u.observed_ms, 0) AS observed_ms,
           coalesce(u.busy_ms_pct, 0) AS busy_ms_pct, coalesce(u.idle_ms, 0) AS idle_ms,
           coalesce(u.energy_w_ms, 0) AS energy_w_ms
    FROM usage u FULL OUTER JOIN allocation a ON u.lease = a.lease AND u.hour = a.hour
),
team_rows AS (
    SELECT j.hour, coalesce(i.team, '(unallocated)') AS team,
           coalesce(i.gpu_model, j.own_model) AS gpu_model,
           CASE WHEN j.lease IS NULL THEN j.observed_ms / 3600000.0
                ELSE coalesce(j.allocated, 0) END AS allocated,
           j.observed_ms / 3600000.0 AS observed, j.busy_ms_pct / 360000000.0 AS busy,
           j.idle_ms / 3600000.0 AS idle, j.energy_w_ms / 3600000000.0 AS energy
    FROM joined j LEFT JOIN identity i ON j.lease = i.lease_id
)
SELECT hour, team, gpu_model,
       sum(allocated) AS allocated_gpu_hours, sum(observed) AS observed_gpu_hours,
       sum(busy) AS busy_gpu_hours, sum(idle) AS idle_gpu_hours,
       CASE WHEN sum(observed) > 0 THEN 100 * sum(busy) / sum(observed) END AS utilization_pct,
       sum(allocated) * ({price}) AS cost_usd, sum(idle) * ({price}) AS idle_cost_usd,
       sum(energy) AS energy_kwh,
       any_value(w) >= hour + 3600000 + {lateness_ms} AS final
FROM team_rows, watermark
GROUP BY hour, team, gpu_model
ORDER BY hour, team, gpu_model
