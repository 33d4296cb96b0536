-- Budget burn-down
--
-- Question: day by day, how much of each team's monthly budget has been spent and how much is
--   left?
-- Columns: month (YYYY-MM, UTC), day (YYYY-MM-DD, UTC), team, monthly_budget_usd, day_cost_usd
--   (what the team's leases cost that day), month_to_date_usd (from the 1st to the end of that
--   day), remaining_usd (budget - month to date; negative once over), used_pct. Only days with
--   spend have a row; by month, team, then day.
-- Parameters: the budgets are the config's (`teams`, the [[teams]] of the config the
--   pipeline or `gpuwarden sql` runs with). One month: add `AND hour >= TIMESTAMPTZ '2026-02-01T00:00:00Z' AND hour < TIMESTAMPTZ
--   '2026-03-01T00:00:00Z'` to the WHERE clause of `daily`. Hour by hour instead of day by
--   day: use '%Y-%m-%dT%H:00Z' in the second to_char.
-- Source: team_hourly (cost_usd; the open hour counts what it has accrued so far), teams.
WITH budgets AS (
    SELECT team, monthly_budget_usd FROM teams
),
daily AS (
    SELECT to_char(hour, '%Y-%m') AS month,
           to_char(hour, '%Y-%m-%d') AS day,
           team,
           sum(cost_usd) AS cost
    FROM team_hourly
    WHERE team IN (SELECT team FROM budgets)
    GROUP BY 1, 2, 3
),
burned AS (
    SELECT d.month,
           d.day,
           d.team,
           b.monthly_budget_usd,
           d.cost,
           sum(d.cost) OVER (PARTITION BY d.month, d.team ORDER BY d.day
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS to_date
    FROM daily d
    JOIN budgets b ON b.team = d.team
)
SELECT month,
       day,
       team,
       round(monthly_budget_usd, 2) AS monthly_budget_usd,
       round(cost, 2) AS day_cost_usd,
       round(to_date, 2) AS month_to_date_usd,
       round(monthly_budget_usd - to_date, 2) AS remaining_usd,
       round(CASE WHEN monthly_budget_usd > 0 THEN 100.0 * to_date / monthly_budget_usd END, 2)
           AS used_pct
FROM burned
ORDER BY month, team, day;
