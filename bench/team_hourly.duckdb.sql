-- team_hourly computed by DuckDB straight from the lake's raw Delta tables (delta_scan), following
-- docs/src/finops/definitions.md (the same rules as pipeline/src/rollup): the
-- peer of `gpuwarden rollup` in bench/rollup-vs-duckdb.sh, which also checks that both give the
-- same rows. Filled in by the script: {lake}, {price} (of the row's gpu_model), {idle}
-- (pricing.idle_util_pct), {idle_sm} (pricing.idle_sm_active_pct), {measure} (the idle measure
-- a lease's `workload` sets with [workloads.<kind>] idle_measure, NULL for the others, e.g.
-- CASE workload WHEN 'training' THEN 'sm_active' END, or NULL), {default_measure}
-- (pricing.idle_measure, for unallocated time), {mig_share} (a sample's share of its GPU from
-- mig_profile, mig_slices and mig_parent_slices: the [[pricing.mig]] overrides, e.g.
-- CASE mig_profile WHEN '2g.20gb' THEN 0.3 END, or NULL), {energy_price}
-- (pricing.energy_usd_per_kwh), {co2e_per_kwh} (pricing.co2e_g_per_kwh / 1000, or NULL) and
-- {lateness_ms}.
WITH
raw_events AS (
    SELECT DISTINCT ON (lease_id, ts_ms, event) *,
           CASE event WHEN 'granted' THEN 0 WHEN 'resized' THEN 1 ELSE 2 END AS k
    FROM delta_scan('{lake}/lease_events')
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
           arg_min(ts_ms, (k <> 0, n)) AS granted_at,
           arg_min(workload, (k <> 0, n)) AS workload
    FROM kept GROUP BY lease_id
),
segments AS (
    SELECT lease_id, ts_ms AS start_ms, gpu_count, gpu_uuids, event,
           lead(ts_ms) OVER (PARTITION BY lease_id ORDER BY n) AS end_ms
    FROM kept
),
samples AS (
    SELECT *,
           -- A MIG device's share of its GPU: the profile's override, else its slices over
           -- its GPU's, else 1 (a whole GPU).
           coalesce({mig_share},
                    CASE WHEN mig_slices IS NOT NULL AND mig_parent_slices > 0
                         THEN least(mig_slices, mig_parent_slices) / mig_parent_slices END,
                    1.0) AS share
    FROM delta_scan('{lake}/samples')
),
-- What a lease listing a device holds of a GPU: the largest share of its samples with a profile.
device_shares AS (
    SELECT gpu_uuid, max(share) AS share FROM samples WHERE mig_profile IS NOT NULL GROUP BY ALL
),
segs AS (  -- with the GPU-equivalents each holds: its listed GPUs at their shares, the rest whole
    SELECT s.*, coalesce(g.listed_share, 0) + greatest(s.gpu_count - coalesce(g.listed, 0), 0) AS gpus
    FROM segments s
    LEFT JOIN (
        SELECT lease_id, start_ms, count(*) AS listed, sum(coalesce(d.share, 1.0)) AS listed_share
        FROM (SELECT DISTINCT lease_id, start_ms, unnest(gpu_uuids) AS gpu_uuid
              FROM segments WHERE event <> 'released') u
        LEFT JOIN device_shares d USING (gpu_uuid)
        GROUP BY ALL
    ) g USING (lease_id, start_ms)
    WHERE s.event <> 'released'
),
-- The fleet's watermark (docs/src/finops/definitions.md#hours-and-the-watermark) as one rollup run over a
-- lake loaded at once takes it: the earliest latest sample among the hosts no more than
-- pipeline.clock.idle_timeout (5 min) behind the median host's latest, or the latest lease
-- event if that is later.
host_latest AS (SELECT host, max(ts_ms) AS t FROM samples GROUP BY host),
watermark AS (
    SELECT greatest(
        (SELECT min(t) FROM host_latest
          WHERE t >= (SELECT median(t) FROM host_latest) - 300000),
        (SELECT max(ts_ms) FROM raw_events)) AS w
),
-- Attribution (docs/src/finops/definitions.md#attribution) is of time: each sample's interval
-- [ts_ms - interval_ms, ts_ms) is cut at hour edges and where a lease starts or stops holding
-- its GPU, and each piece goes to the lease it names while that lease holds the GPU (a segment
-- listing it, or listing none), else to the owner of the GPU then, else to nobody.
claims AS (  -- segments by GPU, open ones without end
    SELECT s.lease_id, i.granted_at, unnest(s.gpu_uuids) AS gpu_uuid, s.start_ms,
           coalesce(s.end_ms, 9223372036854775807) AS end_ms
    FROM segs s JOIN identity i USING (lease_id)
),
holds AS (  -- what a sample naming the lease may claim: gpu_uuid null = any GPU
    SELECT DISTINCT lease_id,
           unnest(CASE WHEN len(gpu_uuids) = 0 THEN [NULL::VARCHAR] ELSE gpu_uuids END) AS gpu_uuid,
           start_ms, coalesce(end_ms, 9223372036854775807) AS end_ms
    FROM segs
),
cuts AS (
    SELECT DISTINCT gpu_uuid, t FROM (
        SELECT gpu_uuid, start_ms AS t FROM claims UNION ALL SELECT gpu_uuid, end_ms FROM claims)
),
windows AS (
    SELECT * FROM (
        SELECT gpu_uuid, t AS start_ms, lead(t) OVER (PARTITION BY gpu_uuid ORDER BY t) AS end_ms
        FROM cuts)
    WHERE end_ms IS NOT NULL
),
owners AS (  -- non-overlapping: the most recent grant wins each window
    SELECT w.gpu_uuid, w.start_ms, w.end_ms,
           arg_max(c.lease_id, (c.granted_at, c.lease_id)) AS lease
    FROM windows w JOIN claims c
      ON c.gpu_uuid = w.gpu_uuid AND c.start_ms <= w.start_ms AND w.end_ms <= c.end_ms
    GROUP BY ALL
),
deduplicated AS (
    SELECT r.gpu_uuid, r.ts_ms,
           max(r.gpu_model) AS gpu_model, max(r.interval_ms) AS interval_ms,
           max(r.util_gpu_pct) AS util, max(r.power_w) AS power_w, max(r.lease_id) AS lease_id,
           max(r.sm_active_pct) AS sm, max(r.share) AS share
    FROM samples r
    GROUP BY r.gpu_uuid, r.ts_ms
),
intervals AS (  -- each sample's interval, split at hour edges: [a, b) within hour
    SELECT d.gpu_uuid, d.ts_ms, d.gpu_model, d.util, d.power_w, d.sm, d.share,
           k.lease_id AS named, h.hour,
           greatest(d.ts_ms - d.interval_ms, h.hour) AS a, least(d.ts_ms, h.hour + 3600000) AS b
    FROM deduplicated d
    LEFT JOIN identity k ON d.lease_id = k.lease_id,
    LATERAL (SELECT unnest(range(((d.ts_ms - d.interval_ms) // 3600000) * 3600000, d.ts_ms, 3600000)) AS hour) h
),
named AS (
    SELECT i.gpu_uuid, i.ts_ms, i.hour, i.named AS lease,
           greatest(i.a, h.start_ms) AS a, least(i.b, h.end_ms) AS b
    FROM intervals i JOIN holds h
      ON h.lease_id = i.named AND (h.gpu_uuid IS NULL OR h.gpu_uuid = i.gpu_uuid)
     AND h.start_ms < i.b AND h.end_ms > i.a
),
owned AS (
    SELECT i.gpu_uuid, i.ts_ms, i.hour, o.lease,
           least(i.b, o.end_ms) - greatest(i.a, o.start_ms)
           - sum(CASE WHEN n.a IS NULL THEN 0  -- least/greatest skip nulls
                      ELSE greatest(0, least(i.b, o.end_ms, n.b) - greatest(i.a, o.start_ms, n.a)) END) AS ms
    FROM intervals i JOIN owners o
      ON o.gpu_uuid = i.gpu_uuid AND o.start_ms < i.b AND o.end_ms > i.a
    LEFT JOIN named n ON n.gpu_uuid = i.gpu_uuid AND n.ts_ms = i.ts_ms AND n.hour = i.hour
    GROUP BY i.gpu_uuid, i.ts_ms, i.hour, o.lease, o.start_ms, o.end_ms, i.a, i.b
),
attributed AS (
    SELECT gpu_uuid, ts_ms, hour, lease, b - a AS ms FROM named
    UNION ALL
    SELECT gpu_uuid, ts_ms, hour, lease, ms FROM owned WHERE ms > 0
),
pieces AS (
    SELECT p.hour, p.lease, NULL AS own_model, p.ms, i.util, i.power_w, i.sm, i.share
    FROM attributed p JOIN intervals i USING (gpu_uuid, ts_ms, hour)
    UNION ALL
    SELECT i.hour, NULL, i.gpu_model, i.b - i.a - coalesce(m.ms, 0), i.util, i.power_w, i.sm,
           i.share
    FROM intervals i
    LEFT JOIN (SELECT gpu_uuid, ts_ms, hour, sum(ms) AS ms FROM attributed GROUP BY ALL) m
      USING (gpu_uuid, ts_ms, hour)
),
judged AS (  -- each piece by its lease's workload's measure; SM activity only where there is some
    SELECT p.*, (coalesce({measure}, {default_measure}) = 'sm_active' AND p.sm IS NOT NULL) AS by_sm
    FROM pieces p LEFT JOIN identity i ON i.lease_id = p.lease
),
usage AS (
    SELECT hour, lease, own_model,
           sum(ms * share) AS observed_ms,
           sum(ms * share * util) AS busy_ms_pct,
           sum(CASE WHEN (by_sm AND sm < {idle_sm}) OR (NOT by_sm AND util < {idle})
                    THEN ms * share ELSE 0 END) AS idle_ms,
           sum(coalesce(power_w, 0) * ms) AS energy_w_ms,
           sum(CASE WHEN sm IS NOT NULL THEN ms * share * sm ELSE 0 END) AS sm_ms_pct,
           sum(CASE WHEN sm IS NOT NULL THEN ms * share ELSE 0 END) AS gpm_ms,
           sum(CASE WHEN by_sm THEN ms ELSE 0 END) AS sm_judged_ms,
           sum(CASE WHEN by_sm THEN 0 ELSE ms END) AS util_judged_ms
    FROM judged
    GROUP BY ALL
    HAVING sum(ms) > 0
),
allocation AS (
    SELECT lease_id AS lease, hour,
           sum(greatest(0, least(coalesce(end_ms, w), hour + 3600000) - greatest(start_ms, hour))
               * gpus) / 3600000.0 AS allocated
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
           coalesce(u.energy_w_ms, 0) AS energy_w_ms, coalesce(u.sm_ms_pct, 0) AS sm_ms_pct,
           coalesce(u.gpm_ms, 0) AS gpm_ms, coalesce(u.sm_judged_ms, 0) AS sm_judged_ms,
           coalesce(u.util_judged_ms, 0) AS util_judged_ms
    FROM usage u FULL OUTER JOIN allocation a ON u.lease = a.lease AND u.hour = a.hour
),
team_rows AS (
    SELECT j.hour, coalesce(i.team, '(unallocated)') AS team,
           coalesce(i.gpu_model, j.own_model) AS gpu_model,
           CASE WHEN j.lease IS NULL THEN j.observed_ms / 3600000.0
                ELSE coalesce(j.allocated, 0) END AS allocated,
           j.observed_ms / 3600000.0 AS observed, j.busy_ms_pct / 360000000.0 AS busy,
           j.idle_ms / 3600000.0 AS idle, j.energy_w_ms / 3600000000.0 AS energy,
           j.sm_ms_pct / 360000000.0 AS sm_active, j.gpm_ms / 3600000.0 AS gpm_observed,
           j.sm_judged_ms, j.util_judged_ms
    FROM joined j LEFT JOIN identity i ON j.lease = i.lease_id
)
SELECT hour, team, gpu_model,
       sum(allocated) AS allocated_gpu_hours, sum(observed) AS observed_gpu_hours,
       sum(busy) AS busy_gpu_hours, sum(idle) AS idle_gpu_hours,
       CASE WHEN sum(observed) > 0 THEN 100 * sum(busy) / sum(observed) END AS utilization_pct,
       sum(allocated) * ({price}) AS cost_usd, sum(idle) * ({price}) AS idle_cost_usd,
       sum(energy) AS energy_kwh,
       any_value(w) >= hour + 3600000 + {lateness_ms} AS final,
       sum(sm_active) AS sm_active_gpu_hours, sum(gpm_observed) AS gpm_observed_gpu_hours,
       CASE WHEN sum(sm_judged_ms) > 0 AND sum(util_judged_ms) > 0 THEN 'mixed'
            WHEN sum(sm_judged_ms) > 0 THEN 'sm_active'
            WHEN sum(util_judged_ms) > 0 THEN 'util' END AS idle_measure,
       sum(energy) * ({energy_price}) AS energy_cost_usd,
       sum(energy) * ({co2e_per_kwh}) AS co2e_kg
FROM team_rows, watermark
GROUP BY hour, team, gpu_model
ORDER BY hour, team, gpu_model
