-- Chargeback export in FOCUS
--
-- Question: what does each team owe for the billing period, lease by lease, as a FOCUS 1.2
--   cost-and-usage file that FinOps tools import as they are?
-- Columns: FOCUS 1.2 names (case-sensitive), one row per billing period (calendar month),
--   SubAccountId (the team), ResourceId (the lease; empty for "(unallocated)" capacity, which
--   has one row per GPU model, SkuId) with its charge period the first to the last hour
--   charged; the costs and quantities are the sums of focus_costs' hourly rows, costs rounded
--   to cents, quantities (GPU-hours) to 1/10000 and the x_ GPU-hours to 1/1000. x_ columns are
--   gpuwarden's own: busy and idle GPU-hours, idle cost, and x_Final (false while an hour of
--   the period can still change).
-- Parameters: one billing period: add `WHERE "BillingPeriodStart" = TIMESTAMPTZ
--   '2026-01-01T00:00:00Z'` before GROUP BY. Hourly rows instead: SELECT * FROM focus_costs.
--   Export: gpuwarden sql --config F --format csv -f queries/focus_chargeback.sql > focus.csv
-- Source: focus_costs (one FOCUS row per lease and hour, and per GPU model and hour for
--   unallocated capacity).
SELECT "BillingAccountId",
       "BillingAccountName",
       "BillingCurrency",
       "BillingPeriodStart",
       "BillingPeriodEnd",
       min("ChargePeriodStart") AS "ChargePeriodStart",
       max("ChargePeriodEnd") AS "ChargePeriodEnd",
       "ChargeCategory",
       "ChargeDescription",
       "InvoiceIssuerName",
       "ProviderName",
       "PublisherName",
       "ServiceCategory",
       "ServiceName",
       "SubAccountId",
       "SubAccountName",
       "ResourceId",
       "ResourceName",
       "ResourceType",
       "SkuId",
       "PricingUnit",
       CAST("ListUnitPrice" AS DECIMAL(38, 2)) AS "ListUnitPrice",
       CAST(sum("PricingQuantity") AS DECIMAL(38, 4)) AS "PricingQuantity",
       CAST(sum("ConsumedQuantity") AS DECIMAL(38, 4)) AS "ConsumedQuantity",
       "ConsumedUnit",
       CAST(sum("ListCost") AS DECIMAL(38, 2)) AS "ListCost",
       CAST(sum("ContractedCost") AS DECIMAL(38, 2)) AS "ContractedCost",
       CAST(sum("EffectiveCost") AS DECIMAL(38, 2)) AS "EffectiveCost",
       CAST(sum("BilledCost") AS DECIMAL(38, 2)) AS "BilledCost",
       "Tags",
       round(sum("x_BusyGpuHours"), 3) AS "x_BusyGpuHours",
       round(sum("x_IdleGpuHours"), 3) AS "x_IdleGpuHours",
       CAST(sum("x_IdleCost") AS DECIMAL(38, 2)) AS "x_IdleCost",
       bool_and("x_Final") AS "x_Final"
FROM focus_costs
GROUP BY "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodStart",
         "BillingPeriodEnd", "ChargeCategory", "ChargeDescription", "InvoiceIssuerName",
         "ProviderName", "PublisherName", "ServiceCategory", "ServiceName", "SubAccountId",
         "SubAccountName", "ResourceId", "ResourceName", "ResourceType", "SkuId", "PricingUnit",
         "ListUnitPrice", "ConsumedUnit", "Tags"
ORDER BY "BillingPeriodStart", "SubAccountId", "ResourceId" NULLS LAST, "SkuId";
