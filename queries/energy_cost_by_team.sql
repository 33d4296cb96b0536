-- Energy cost and emissions by team and month
--
-- Question: what did the energy each team's GPUs drew cost, month by month, what did it emit,
--   and how does that compare with what the GPU-hours cost? "(unallocated)" is the energy of
--   GPUs no lease held.
-- Columns: month (YYYY-MM, UTC), team, energy_kwh (the GPUs' power over time; a MIG slice's
--   share of its GPU's), energy_cost_usd (kWh × pricing.energy_usd_per_kwh), co2e_kg (kWh ×
--   pricing.co2e_g_per_kwh / 1000; empty without a factor), cost_usd (GPU-hours priced),
--   energy_share_pct (energy cost / GPU-hour cost), sm_active_gpu_hours and busy_gpu_hours
--   (how much work the energy bought: SM activity where the GPUs have GPM, and utilization).
--   Rows by month, then by energy cost (highest first).
-- Parameters: one month only: add `WHERE hour >= TIMESTAMPTZ '2026-01-01T00:00:00Z' AND
--   hour < TIMESTAMPTZ '2026-02-01T00:00:00Z'` after `FROM team_hourly`. By GPU model as
--   well: add gpu_model to the SELECT lists and both GROUP BYs. Money is rounded to cents,
--   kWh, kilograms and GPU-hours to 1/1000. Hours rolled up before gpuwarden priced energy
--   have no energy cost: they count as 0.
-- Source: team_hourly (docs/src/finops/definitions.md).
WITH monthly AS (
    SELECT to_char(hour, '%Y-%m') AS month,
           team,
           sum(energy_kwh) AS kwh,
           sum(energy_cost_usd) AS energy_cost,
           sum(co2e_kg) AS co2e,
           sum(cost_usd) AS cost,
           sum(sm_active_gpu_hours) AS sm_active,
           sum(busy_gpu_hours) AS busy
    FROM team_hourly
    GROUP BY 1, 2
)
SELECT month,
       team,
       round(kwh, 3) AS energy_kwh,
       round(COALESCE(energy_cost, 0.0), 2) AS energy_cost_usd,
       round(co2e, 3) AS co2e_kg,
       round(cost, 2) AS cost_usd,
       round(CASE WHEN cost > 0 THEN 100.0 * COALESCE(energy_cost, 0.0) / cost END, 1)
           AS energy_share_pct,
       round(COALESCE(sm_active, 0.0), 3) AS sm_active_gpu_hours,
       round(busy, 3) AS busy_gpu_hours
FROM monthly
ORDER BY month, energy_cost DESC NULLS LAST, team;
