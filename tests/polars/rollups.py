#!/usr/bin/env python3
"""The rollups `team_hourly` and `lease_usage`, computed with polars straight from the lake's raw
Parquet files: the independent second implementation that tests/rollup_polars.rs checks
DataFusion's rollups against.

It follows docs/src/finops/definitions.md, made precise as fourteen numbered rules;
each function below implements one or two of them and quotes them in its docstring. It shares no
code with the pipeline: keep it that way, or the cross-check stops meaning anything.

Usage:
    python rollups.py --lake DATA_DIR/lake --params '{"lateness_ms": 600000, "pricing": {...}}'

`pricing` has the keys of the config's [pricing] section that matter here: idle_util_pct,
idle_sm_active_pct, idle_measure ("util" or "sm_active"), default_usd_per_gpu_hour,
energy_usd_per_kwh, co2e_g_per_kwh (null when unset), gpu (a list of {"match",
"usd_per_gpu_hour"}, in config order) and mig (a list of {"profile", "share"}). `workloads` maps a
workload to its own idle_measure, for the workloads that set one.
Prints one JSON object: {"watermark_ms", "team_hourly": [...], "lease_usage": [...]}, rows sorted
by their keys, times as epoch milliseconds, NULL as null.
"""

import argparse
import glob
import json
import os
import sys

import polars as pl

HOUR = 3_600_000
UNALLOCATED = "(unallocated)"

# The lake's raw schemas (schema/src/sample.rs and schema/src/lease.rs), reduced to the columns
# the rollups read. Declared so that an empty lake still gives typed, empty tables.
SAMPLE_COLUMNS = {
    "ts_ms": pl.Int64,
    "interval_ms": pl.Int64,
    "host": pl.String,
    "gpu_uuid": pl.String,
    "gpu_model": pl.String,
    "util_gpu_pct": pl.Float64,
    "power_w": pl.Float64,
    "lease_id": pl.String,
    "sm_active_pct": pl.Float64,
    "mig_profile": pl.String,
    "mig_slices": pl.Int64,
    "mig_parent_slices": pl.Int64,
}
LEASE_EVENT_COLUMNS = {
    "ts_ms": pl.Int64,
    "event": pl.String,
    "lease_id": pl.String,
    "team": pl.String,
    "user": pl.String,
    "project": pl.String,
    "workload": pl.String,
    "substrate": pl.String,
    "gpu_model": pl.String,
    "gpu_count": pl.Int64,
    "gpu_uuids": pl.List(pl.String),
    "reason": pl.String,
}
IDENTITY = ["team", "user", "project", "workload", "substrate", "gpu_model"]
# The measures the rollups gained after their first release (rules 9, 10, 14).
NEW_MEASURES = [
    "sm_active_gpu_hours",
    "gpm_observed_gpu_hours",
    "idle_measure",
    "energy_cost_usd",
    "co2e_kg",
]


def read_table(lake: str, table: str, columns: dict) -> pl.LazyFrame:
    """Inputs: the valid rows of a raw table, every Parquet file under <lake>/<table>/. The
    date=/hour= directories are only a layout, not columns."""
    files = sorted(glob.glob(os.path.join(lake, table, "**", "*.parquet"), recursive=True))
    if not files:
        return pl.LazyFrame(schema=columns)
    return pl.scan_parquet(files, hive_partitioning=False).select(
        [pl.col(name).cast(dtype) for name, dtype in columns.items()]
    )


def watermark(samples: pl.LazyFrame, events: pl.LazyFrame) -> int:
    """Rule 1: W is the largest ts_ms over all samples and all lease events."""
    both = pl.concat([samples.select("ts_ms"), events.select("ts_ms")])
    w = both.select(pl.col("ts_ms").max()).collect().item()
    return 0 if w is None else w


def gpu_share(pricing: dict) -> pl.Expr:
    """Rule 13: a sample's share of a GPU, in GPU-equivalents: the pricing.mig entry of its
    mig_profile if there is one, else mig_slices / mig_parent_slices (mig_slices at most the
    parent's) when both are there and the parent's are positive, else 1 (a whole GPU)."""
    slices = pl.min_horizontal("mig_slices", "mig_parent_slices")
    expr = pl.when(
        pl.col("mig_slices").is_not_null()
        & pl.col("mig_parent_slices").is_not_null()
        & (pl.col("mig_parent_slices") > 0)
    ).then(slices / pl.col("mig_parent_slices")).otherwise(pl.lit(1.0))
    for entry in reversed(pricing.get("mig", [])):
        expr = pl.when(pl.col("mig_profile") == entry["profile"]).then(
            pl.lit(float(entry["share"]))
        ).otherwise(expr)
    return expr


def deduplicated_samples(samples: pl.LazyFrame, pricing: dict) -> pl.LazyFrame:
    """Rule 2: samples with the same (gpu_uuid, ts_ms) count once; each column of the survivor is
    the maximum of that column over the duplicates, nulls ignored; so is its `share` (rule 13),
    taken of each copy."""
    others = [c for c in SAMPLE_COLUMNS if c not in ("gpu_uuid", "ts_ms")] + ["share"]
    return (
        samples.with_columns(share=gpu_share(pricing))
        .group_by("gpu_uuid", "ts_ms")
        .agg([pl.col(c).max() for c in others])
    )


def device_shares(samples: pl.LazyFrame, pricing: dict) -> pl.LazyFrame:
    """Rule 13: the share of a MIG device that a lease listing it holds: the largest share of its
    samples with a mig_profile; (gpu_uuid, share). A device with none is a whole GPU (1)."""
    return (
        samples.filter(pl.col("mig_profile").is_not_null())
        .with_columns(share=gpu_share(pricing))
        .group_by("gpu_uuid")
        .agg(pl.col("share").max())
    )


def ordered_lease_events(events: pl.LazyFrame) -> pl.LazyFrame:
    """Rule 4: exact duplicates by (lease_id, ts_ms, event) count once; a lease's events are
    ordered by ts_ms, then granted < resized < released; events after the lease's first
    "released" are ignored. Adds `seq`, the event's position in its lease."""
    rank = pl.col("event").replace_strict(
        {"granted": 0, "resized": 1, "released": 2}, return_dtype=pl.Int8
    )
    released = (pl.col("event") == "released").cast(pl.Int64)
    return (
        # Duplicates are exact copies, so which one is kept does not matter.
        events.unique(subset=["lease_id", "ts_ms", "event"], keep="any")
        .with_columns(rank=rank)
        .sort("lease_id", "ts_ms", "rank")
        # Released events strictly before this one, in the lease's order.
        .with_columns(released_before=(released.cum_sum() - released).over("lease_id"))
        .filter(pl.col("released_before") == 0)
        .with_columns(seq=pl.int_range(pl.len()).over("lease_id"))
        .drop("released_before")
    )


def lease_identity(events: pl.LazyFrame) -> pl.LazyFrame:
    """Rule 5: identity from the lease's earliest "granted" event (its earliest event when it has
    none), granted_at = that event's ts_ms; gpu_count from its latest granted/resized event;
    released_at / release_reason from its first "released" event, else null.
    One row per known lease (rule 4: a lease_id with at least one event)."""
    # Sorting by (is not granted, seq) puts the earliest granted event first, or else the
    # earliest event.
    identity_order = [pl.col("event") != "granted", pl.col("seq")]
    opening = pl.col("event") != "released"
    released = pl.col("event") == "released"

    def in_order(column: str, where: pl.Expr) -> pl.Expr:
        return pl.col(column).filter(where).sort_by(pl.col("seq").filter(where))

    return events.group_by("lease_id").agg(
        [pl.col(c).sort_by(identity_order).first() for c in IDENTITY],
        granted_at=pl.col("ts_ms").sort_by(identity_order).first(),
        gpu_count=in_order("gpu_count", opening).last(),
        released_at=in_order("ts_ms", released).first(),
        release_reason=in_order("reason", released).first(),
    )


def lease_segments(events: pl.LazyFrame) -> pl.LazyFrame:
    """Rule 6: each granted or resized event opens a segment [ts_ms, ts_ms of the lease's next
    event) with that event's gpu_uuids and gpu_count. With no next event the segment is open:
    `end` is null."""
    return (
        events.sort("lease_id", "seq")
        .with_columns(end=pl.col("ts_ms").shift(-1).over("lease_id"))
        .filter(pl.col("event") != "released")
        .select("lease_id", start="ts_ms", end="end", gpu_uuids="gpu_uuids", gpu_count="gpu_count")
    )


def sample_pieces(
    samples: pl.LazyFrame, leases: pl.LazyFrame, segments: pl.LazyFrame
) -> pl.LazyFrame:
    """Rule 3: a sample covers [ts_ms - interval_ms, ts_ms). That interval is cut at every hour
    edge (a multiple of HOUR), at every start and end of a segment whose gpu_uuids contain the
    sample's GPU, and at every start and end of the segments of the lease the sample names (when
    that lease is known). Between two cuts rule 7 gives the same answer at every instant, so each
    piece [p, q) is attributed as at p, and belongs to the hour floor(p / HOUR) * HOUR.
    Returns one row per piece: gpu_uuid, ts_ms, p, q, hour, the sample's util_gpu_pct, power_w,
    gpu_model, sm_active_pct and share, and `named`, the sample's lease_id if it is a known
    lease, else null."""
    known = leases.select(named="lease_id")
    s = (
        samples.join(known, left_on="lease_id", right_on="named", how="left", coalesce=False)
        .with_columns(start=pl.col("ts_ms") - pl.col("interval_ms"), end=pl.col("ts_ms"))
        .select(
            "gpu_uuid",
            "ts_ms",
            "start",
            "end",
            "named",
            "util_gpu_pct",
            "power_w",
            "gpu_model",
            "sm_active_pct",
            "share",
        )
    )
    bounds = pl.concat(
        [
            segments.select("lease_id", "gpu_uuids", t="start"),
            segments.select("lease_id", "gpu_uuids", t="end"),
        ]
    ).drop_nulls("t")
    by_gpu = (
        bounds.explode("gpu_uuids")
        .drop_nulls("gpu_uuids")
        .select(gpu_uuid="gpu_uuids", t="t")
        .unique()
    )
    by_lease = bounds.select(named="lease_id", t="t").unique()
    inside = (pl.col("start") < pl.col("t")) & (pl.col("t") < pl.col("end"))
    key = ["gpu_uuid", "ts_ms"]
    hour_edges = (
        s.with_columns(
            t=pl.int_ranges((pl.col("start") // HOUR + 1) * HOUR, pl.col("end"), HOUR)
        )
        .explode("t")
        .drop_nulls("t")
        .select(*key, "t")
    )
    cuts = pl.concat(
        [
            s.select(*key, t="start"),
            s.select(*key, t="end"),
            hour_edges,
            s.join(by_gpu, on="gpu_uuid").filter(inside).select(*key, "t"),
            s.join(by_lease, on="named").filter(inside).select(*key, "t"),
        ]
    ).unique()
    return (
        cuts.sort(*key, "t")
        .with_columns(q=pl.col("t").shift(-1).over(key))
        .drop_nulls("q")
        .rename({"t": "p"})
        .join(s.drop("start", "end"), on=key)
        .with_columns(hour=(pl.col("p") // HOUR) * HOUR)
    )


def attributed_pieces(
    pieces: pl.LazyFrame,
    leases: pl.LazyFrame,
    segments: pl.LazyFrame,
    pricing: dict,
    workloads: dict,
) -> pl.LazyFrame:
    """Rule 7, at the instant p where a piece starts: it belongs to the lease the sample names if
    that lease is known and has a segment with start <= p < end (no end when open) whose
    gpu_uuids contain the sample's GPU or are empty. Otherwise to the lease having a segment
    whose gpu_uuids contain the GPU with start <= p < end; of several, the largest granted_at,
    then the larger lease_id. Otherwise to team "(unallocated)" with no lease. An attributed
    piece takes its lease's team and gpu_model; an unallocated one keeps its sample's
    gpu_model. Rule 14: a piece's idle measure is its lease's workload's (`workloads`), else
    pricing.idle_measure (so is an unallocated piece's). Returns the pieces with ms = q - p,
    hour, lease_id, team, gpu_model and measure."""
    key = ["gpu_uuid", "ts_ms", "p"]
    lease_of = leases.select("lease_id", "team", "gpu_model", "granted_at", "workload")
    p = pl.col("p")
    during = (pl.col("start") <= p) & (pl.col("end").is_null() | (p < pl.col("end")))
    holds_gpu = (pl.col("gpu_uuids").list.len() == 0) | pl.col("gpu_uuids").list.contains(
        pl.col("gpu_uuid")
    )
    by_name = (
        pieces.filter(pl.col("named").is_not_null())
        .join(segments, left_on="named", right_on="lease_id")
        .filter(during & holds_gpu)
        .select(*key, by_name="named")
        .unique()
    )
    holders = (
        segments.explode("gpu_uuids")
        .rename({"gpu_uuids": "gpu_uuid"})
        .drop_nulls("gpu_uuid")
        .join(lease_of.select("lease_id", "granted_at"), on="lease_id", how="inner")
    )
    most_recent = pl.col("lease_id").sort_by(["granted_at", "lease_id"], descending=True).first()
    by_gpu = (
        pieces.select(*key)
        .join(holders, on="gpu_uuid")
        .filter(during)
        .group_by(key)
        .agg(by_gpu=most_recent)
    )
    return (
        pieces.join(by_name, on=key, how="left")
        .join(by_gpu, on=key, how="left")
        .with_columns(lease_id=pl.coalesce("by_name", "by_gpu"), ms=pl.col("q") - p)
        .join(
            lease_of.select("lease_id", "team", "workload", lease_model="gpu_model"),
            on="lease_id",
            how="left",
        )
        .with_columns(
            team=pl.col("team").fill_null(UNALLOCATED),
            gpu_model=pl.coalesce("lease_model", "gpu_model"),
            measure=pl.col("workload")
            .replace_strict(workloads, default=pricing["idle_measure"], return_dtype=pl.String)
            .fill_null(pricing["idle_measure"]),
        )
        .select(
            "hour",
            "ms",
            "util_gpu_pct",
            "power_w",
            "sm_active_pct",
            "share",
            "measure",
            "lease_id",
            "team",
            "gpu_model",
        )
    )


def segment_gpus(segments: pl.LazyFrame, shares: pl.LazyFrame) -> pl.LazyFrame:
    """Rule 8 (its GPUs): a segment holds each GPU it lists, counted once, at its share (rule 13,
    1 for a device with none), plus gpu_count less the number of distinct GPUs listed (when
    that is positive) whole GPUs. Adds `gpus`."""
    keyed = segments.with_columns(seg=pl.int_range(pl.len()))
    listed = (
        keyed.select("seg", gpu_uuid="gpu_uuids")
        .explode("gpu_uuid")
        .drop_nulls("gpu_uuid")
        .unique()
        .join(shares, on="gpu_uuid", how="left")
        .group_by("seg")
        .agg(listed=pl.len(), shares=pl.col("share").fill_null(1.0).sum())
    )
    return (
        keyed.join(listed, on="seg", how="left")
        .with_columns(
            gpus=pl.col("shares").fill_null(0.0)
            + pl.max_horizontal(pl.col("gpu_count") - pl.col("listed").fill_null(0), pl.lit(0))
        )
        .drop("seg", "listed", "shares")
    )


def hourly_allocation_ms(segments: pl.LazyFrame, shares: pl.LazyFrame, w: int) -> pl.LazyFrame:
    """Rule 8: the allocation of lease L in hour H is the sum over L's segments of the overlap in
    ms of [start, end) (end = W for the open one; nothing if end <= start) with [H, H + HOUR),
    times the GPU-equivalents the segment holds (`segment_gpus`): (lease_id, hour,
    allocated_ms), in GPU-milliseconds."""
    end = pl.coalesce(pl.col("end"), pl.lit(w))
    return (
        segment_gpus(segments, shares)
        .with_columns(end=end)
        .filter(pl.col("end") > pl.col("start"))
        .with_columns(hour=pl.int_ranges((pl.col("start") // HOUR) * HOUR, pl.col("end"), HOUR))
        .explode("hour")
        .with_columns(
            overlap=pl.min_horizontal("end", pl.col("hour") + HOUR)
            - pl.max_horizontal("start", "hour")
        )
        .filter(pl.col("overlap") > 0)
        .group_by("lease_id", "hour")
        .agg(allocated_ms=(pl.col("overlap") * pl.col("gpus")).sum())
    )


def sample_measures(pricing: dict) -> list:
    """Rule 9, as aggregations over a group of pieces (rule 3): observed, busy, idle, SM-active
    and GPM-observed GPU-hours, each piece weighing its length ms times its share (rule 13), and
    energy, weighing ms alone (a slice's power is its share already). A piece whose measure
    (rule 14) is sm_active and that has sm_active_pct is idle when that is below
    idle_sm_active_pct; any other below idle_util_pct of utilization. SM-active and
    GPM-observed count the pieces with sm_active_pct. `pieces` counts them (rule 11 keeps a row
    with at least one); `sm_judged` and `util_judged` count those of ms > 0 each measure judged.
    Utilization and idle_measure are derived afterwards."""
    ms = pl.col("ms")
    weighed = ms * pl.col("share")
    util = pl.col("util_gpu_pct")
    sm = pl.col("sm_active_pct")
    by_sm = (pl.col("measure") == "sm_active") & sm.is_not_null()
    idle = pl.when(by_sm).then(sm < pricing["idle_sm_active_pct"]).otherwise(
        util < pricing["idle_util_pct"]
    )
    return [
        pl.len().alias("pieces"),
        (weighed.sum() / HOUR).alias("observed_gpu_hours"),
        ((weighed * util / 100).sum() / HOUR).alias("busy_gpu_hours"),
        (weighed.filter(idle).sum() / HOUR).alias("idle_gpu_hours"),
        ((pl.col("power_w").fill_null(0.0) * ms).sum() / 3.6e9).alias("energy_kwh"),
        ((weighed * sm / 100).filter(sm.is_not_null()).sum() / HOUR).alias(
            "sm_active_gpu_hours"
        ),
        (weighed.filter(sm.is_not_null()).sum() / HOUR).alias("gpm_observed_gpu_hours"),
        (by_sm & (ms > 0)).sum().alias("sm_judged"),
        (~by_sm & (ms > 0)).sum().alias("util_judged"),
    ]


def idle_measure() -> pl.Expr:
    """Rule 14: which measure judged a row's pieces: util, sm_active, mixed when both did, NULL
    when none (no sampled time)."""
    sm = pl.col("sm_judged").fill_null(0) > 0
    util = pl.col("util_judged").fill_null(0) > 0
    return (
        pl.when(sm & util)
        .then(pl.lit("mixed"))
        .when(sm)
        .then(pl.lit("sm_active"))
        .when(util)
        .then(pl.lit("util"))
        .otherwise(None)
        .alias("idle_measure")
    )


def energy(pricing: dict) -> list:
    """Rule 10 (energy): energy_cost_usd = energy_kwh * energy_usd_per_kwh; co2e_kg = energy_kwh *
    co2e_g_per_kwh / 1000, NULL without a factor."""
    factor = pricing.get("co2e_g_per_kwh")
    co2e = pl.lit(None, dtype=pl.Float64) if factor is None else pl.lit(factor / 1000.0)
    return [
        (pl.col("energy_kwh") * pricing["energy_usd_per_kwh"]).alias("energy_cost_usd"),
        (pl.col("energy_kwh") * co2e).alias("co2e_kg"),
    ]


def utilization() -> pl.Expr:
    """Rule 9: utilization_pct = 100 * busy / observed, NULL when observed = 0."""
    return (
        pl.when(pl.col("observed_gpu_hours") > 0)
        .then(100 * pl.col("busy_gpu_hours") / pl.col("observed_gpu_hours"))
        .otherwise(None)
        .alias("utilization_pct")
    )


def price(gpu_model: pl.Expr, pricing: dict) -> pl.Expr:
    """Rule 10: usd_per_gpu_hour of the first pricing.gpu entry whose `match` is a
    case-insensitive substring of the model, else default_usd_per_gpu_hour. (A when/then chain
    takes its first true branch, which is exactly "first entry wins".)"""
    model = gpu_model.str.to_lowercase()
    expr = None
    for entry in pricing.get("gpu", []):
        hit = model.str.contains(entry["match"].lower(), literal=True)
        then = pl.lit(float(entry["usd_per_gpu_hour"]))
        expr = pl.when(hit).then(then) if expr is None else expr.when(hit).then(then)
    default = pl.lit(float(pricing["default_usd_per_gpu_hour"]))
    return default if expr is None else expr.otherwise(default)


def team_hourly(
    samples: pl.LazyFrame, leases: pl.LazyFrame, allocation: pl.LazyFrame, w: int, params: dict
) -> pl.LazyFrame:
    """Rule 11: one row per (hour, team, gpu_model) with allocated_gpu_hours > 0 or at least one
    piece of a sample (rule 3).
    allocated = the sum of the team's leases' allocations of that model in that hour,
    or for "(unallocated)" its observed; cost = allocated * price, idle_cost = idle * price;
    final = W >= hour + HOUR + lateness. Groups with no samples measure 0 (and NULL
    utilization)."""
    pricing = params["pricing"]
    key = ["hour", "team", "gpu_model"]
    observed = samples.group_by(key).agg(sample_measures(pricing))
    allocated = (
        allocation.join(leases.select("lease_id", "team", "gpu_model"), on="lease_id", how="inner")
        .group_by(key)
        .agg(allocated_ms=pl.col("allocated_ms").sum())
    )
    sums = [
        "pieces",
        "observed_gpu_hours",
        "busy_gpu_hours",
        "idle_gpu_hours",
        "energy_kwh",
        "sm_active_gpu_hours",
        "gpm_observed_gpu_hours",
    ]
    return (
        observed.join(allocated, on=key, how="full", coalesce=True)
        .with_columns(pl.col(*sums, "allocated_ms").fill_null(0))
        .with_columns(
            allocated_gpu_hours=pl.when(pl.col("team") == UNALLOCATED)
            .then(pl.col("observed_gpu_hours"))
            .otherwise(pl.col("allocated_ms") / HOUR)
        )
        .filter((pl.col("allocated_gpu_hours") > 0) | (pl.col("pieces") > 0))
        .with_columns(
            utilization(), idle_measure(), *energy(pricing), price=price(pl.col("gpu_model"), pricing)
        )
        .with_columns(
            cost_usd=pl.col("allocated_gpu_hours") * pl.col("price"),
            idle_cost_usd=pl.col("idle_gpu_hours") * pl.col("price"),
            final=pl.lit(w) >= pl.col("hour") + HOUR + params["lateness_ms"],
        )
        .select(
            *key,
            "allocated_gpu_hours",
            "observed_gpu_hours",
            "busy_gpu_hours",
            "idle_gpu_hours",
            "utilization_pct",
            "cost_usd",
            "idle_cost_usd",
            "energy_kwh",
            "final",
            *NEW_MEASURES,
        )
        .sort(key)
    )


def lease_usage(
    samples: pl.LazyFrame, leases: pl.LazyFrame, allocation: pl.LazyFrame, params: dict
) -> pl.LazyFrame:
    """Rule 12: one row per known lease: its identity, then the measures over every hour:
    allocated_gpu_hours over all segments up to W, observed/busy/idle/energy over every piece
    attributed to it, utilization NULL if observed = 0, cost = allocated * price(lease
    gpu_model), idle_cost = idle * price."""
    pricing = params["pricing"]
    observed = samples.filter(pl.col("lease_id").is_not_null()).group_by("lease_id").agg(
        sample_measures(pricing)
    )
    allocated = allocation.group_by("lease_id").agg(allocated_ms=pl.col("allocated_ms").sum())
    sums = [
        "observed_gpu_hours",
        "busy_gpu_hours",
        "idle_gpu_hours",
        "energy_kwh",
        "sm_active_gpu_hours",
        "gpm_observed_gpu_hours",
    ]
    return (
        leases.join(allocated, on="lease_id", how="left")
        .join(observed, on="lease_id", how="left")
        .with_columns(
            pl.col(*sums).fill_null(0.0),
            allocated_gpu_hours=pl.col("allocated_ms").fill_null(0) / HOUR,
        )
        .with_columns(
            utilization(), idle_measure(), *energy(pricing), price=price(pl.col("gpu_model"), pricing)
        )
        .with_columns(
            cost_usd=pl.col("allocated_gpu_hours") * pl.col("price"),
            idle_cost_usd=pl.col("idle_gpu_hours") * pl.col("price"),
        )
        .select(
            "lease_id",
            *IDENTITY,
            "gpu_count",
            "granted_at",
            "released_at",
            "release_reason",
            "allocated_gpu_hours",
            "observed_gpu_hours",
            "busy_gpu_hours",
            "idle_gpu_hours",
            "utilization_pct",
            "cost_usd",
            "idle_cost_usd",
            "energy_kwh",
            *NEW_MEASURES,
        )
        .sort("lease_id")
    )


def rollups(lake: str, params: dict) -> dict:
    raw_samples = read_table(lake, "samples", SAMPLE_COLUMNS)
    raw_events = read_table(lake, "lease_events", LEASE_EVENT_COLUMNS)
    w = watermark(raw_samples, raw_events)

    events = ordered_lease_events(raw_events)
    leases = lease_identity(events)
    segments = lease_segments(events)
    pricing, workloads = params["pricing"], params.get("workloads", {})
    pieces = sample_pieces(deduplicated_samples(raw_samples, pricing), leases, segments)
    samples = attributed_pieces(pieces, leases, segments, pricing, workloads)
    allocation = hourly_allocation_ms(segments, device_shares(raw_samples, pricing), w)

    hourly, usage = pl.collect_all(
        [
            team_hourly(samples, leases, allocation, w, params),
            lease_usage(samples, leases, allocation, params),
        ]
    )
    return {"watermark_ms": w, "team_hourly": hourly.to_dicts(), "lease_usage": usage.to_dicts()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lake", required=True, help="the lake directory (<data_dir>/lake)")
    parser.add_argument(
        "--params",
        required=True,
        help='JSON: {"lateness_ms": N, "pricing": {"idle_util_pct": X, "idle_sm_active_pct": X, '
        '"idle_measure": S, "default_usd_per_gpu_hour": X, "energy_usd_per_kwh": X, '
        '"co2e_g_per_kwh": X, "gpu": [{"match": S, "usd_per_gpu_hour": X}, ...], '
        '"mig": [{"profile": S, "share": X}, ...]}, "workloads": {"<workload>": S}}',
    )
    args = parser.parse_args()
    result = rollups(args.lake, json.loads(args.params))
    json.dump(result, sys.stdout, allow_nan=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
