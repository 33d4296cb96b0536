-- Enforcement history
--
-- Question: what did the enforcer do, when, to whom and why: every denial, warning, alert,
--   reclaim, resize and block, in order?
-- Columns: at (UTC), action (deny, alert, reclaim, resize, block, unblock), reason (its stable
--   code: idle_warning, idle, expired, user, no_capacity, budget_exceeded, unattributed, ...),
--   outcome (ok, failed, dry_run), team, lease_id, user and workload (the lease's, when there is
--   one), gpu_count (the lease's GPUs), policy, detail (the numbers behind the step). Oldest
--   first. For the dollars the reclaims saved, see reclaim_savings.sql.
-- Parameters: admissions are left out (action <> 'admit'); drop that condition to see them
--   too. One period: add `AND to_timestamp_millis(a.ts_ms) >= TIMESTAMP '2026-02-01 00:00:00'`
--   (and `<` its end) to the WHERE clause; one team: `AND a.team = 'vision'`.
--   A count per month instead: GROUP BY to_char(to_timestamp_millis(ts_ms), '%Y-%m'), action,
--   reason, outcome.
-- Source: actions (the enforcer's audit trail), leases.
SELECT to_timestamp_millis(a.ts_ms) AT TIME ZONE 'UTC' AS at,
       a.action,
       a.reason,
       a.outcome,
       a.team,
       a.lease_id,
       l."user",
       l.workload,
       l.gpu_count,
       a.policy,
       a.detail
FROM actions a
LEFT JOIN leases l ON l.lease_id = a.lease_id
WHERE a.action <> 'admit'
ORDER BY a.ts_ms, a.action, a.lease_id NULLS FIRST, a.reason, a.detail;
