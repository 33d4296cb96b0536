#!/usr/bin/env bash
# The lake after a month (issues: compaction, Delta tables): a simulated fleet's samples committed
# as the pipeline commits them at steady state (a commit per partition and minute, a file each),
# each hour OPTIMIZEd once final as the pipeline's compaction does (LAKE_MONTH_COMPACT=end: once,
# at the end, with the queries timed before it too), the time to open the samples Delta table
# after each day of those commits, three queries over raw samples, and the same queries in
# DuckDB: over the same Delta
# table with its delta extension (delta_scan), and over the same rows written once by DuckDB
# (one COPY); all on 2 threads, best of 3. gpuwarden's queries after compaction
# are timed in a new session each (`gpuwarden sql`) and in one held session (the SQL endpoint's
# connection, and how DuckDB's connection is held here). Last, the same queries in a plain
# DataFusion session over DuckDB's file and over the compacted lake: what the query engine
# itself takes on these rows, the floor under gpuwarden's figures.
#
#   bench/lake-month.sh [GPUS] [DAYS]     default 1000 GPUs, 30 days (525 M samples)
#
# LAKE_MONTH_REUSE=1 keeps a lake (and DuckDB's file) that an earlier run with the same GPUS
# and DAYS left in the directory and only times the queries again (writing a month takes
# hours, and the queries are what changes).
#
# Needs the test venv's duckdb (tests/requirements.txt) and about 1.5 GB of disk per 100 M
# samples under ${LAKE_MONTH_DIR:-/var/tmp/lake-month}.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
PY="${GPUWARDEN_PYTHON:-/var/tmp/gpuwarden-venv/bin/python}"
GPUS="${1:-1000}"; DAYS="${2:-30}"
DIR="${LAKE_MONTH_DIR:-/var/tmp/lake-month}"
REUSE="${LAKE_MONTH_REUSE:-0}"
[ "$REUSE" = 1 ] || rm -rf "$DIR"
mkdir -p "$DIR"
echo "machine: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
cargo bench -q -p gpuwarden-pipeline --bench lake_month -- "$DIR" "$GPUS" "$DAYS" | tee "$DIR/gpuwarden.jsonl"
"$PY" - "$DIR" "$REUSE" <<'PY'
import glob, json, os, sys, time, duckdb, duckdb_extension_delta
d, reuse = sys.argv[1], sys.argv[2] == "1"
lines = [json.loads(l) for l in open(f"{d}/gpuwarden.jsonl")]
con = duckdb.connect()
con.execute("SET threads = 2")
ext = glob.glob(os.path.join(os.path.dirname(duckdb_extension_delta.__file__), "extensions", "*", "delta.duckdb_extension"))[0]
con.execute(f"LOAD '{ext}'")
t = time.perf_counter()
con.execute(f"CREATE VIEW delta_samples AS SELECT * FROM delta_scan('{d}/lake/samples')")
con.execute("SELECT count(*) FROM delta_samples").fetchall()
print(json.dumps({"phase": "duckdb delta_scan opened and counted", "s": time.perf_counter() - t}))
if not (reuse and os.path.exists(f"{d}/duck.parquet")):
    # The table's rows, written once by DuckDB.
    t = time.perf_counter()
    con.execute(f"COPY (SELECT * FROM delta_samples) TO '{d}/duck.parquet.tmp' (FORMAT parquet, COMPRESSION zstd)")
    os.rename(f"{d}/duck.parquet.tmp", f"{d}/duck.parquet")
    print(json.dumps({"phase": "duckdb wrote", "bytes": os.path.getsize(f"{d}/duck.parquet"), "copy_s": time.perf_counter() - t}))
open(f"{d}/duckdb.jsonl", "w").close()
con.execute(f"CREATE VIEW samples AS SELECT * FROM read_parquet('{d}/duck.parquet')")
after = {l["query"]: l for l in lines if l.get("phase") == "after compaction"}
before = {l["query"]: l for l in lines if l.get("phase") == "before compaction"}
def best(sql):
    times = []
    for _ in range(3):
        t = time.perf_counter(); con.execute(sql).fetchall(); times.append(time.perf_counter() - t)
    return min(times)
for name, l in after.items():
    duck = best(l["sql"])
    delta = best(l["sql"].replace("FROM samples", "FROM delta_samples"))
    times = [duck]
    with open(f"{d}/duckdb.jsonl", "a") as out:
        out.write(json.dumps({"query": name, "duckdb_best_s": times[0], "duckdb_delta_scan_best_s": delta}) + "\n")
    b = before.get(name, {}).get("best_s")
    print(json.dumps({"query": name, "duckdb_best_s": times[0], "duckdb_delta_scan_best_s": delta,
                      "ratio_compacted_vs_duckdb_delta_scan": l["best_s"] / delta,
                      "gpuwarden_compacted_best_s": l["best_s"],
                      "gpuwarden_compacted_held_session_best_s": l["held_session_best_s"],
                      "gpuwarden_uncompacted_best_s": b,
                      "ratio_compacted_vs_duckdb": l["best_s"] / times[0],
                      "ratio_compacted_held_session_vs_duckdb": l["held_session_best_s"] / times[0],
                      "ratio_uncompacted_vs_duckdb": (b / times[0]) if b else None}))
PY
# The engine's floor: a plain DataFusion session (no gpuwarden schema, versioned reads or
# governor) over DuckDB's file and over the compacted lake, against DuckDB's time.
LAKE_MONTH_BARE=1 cargo bench -q -p gpuwarden-pipeline --bench lake_month -- "$DIR" "$GPUS" "$DAYS" | tee "$DIR/bare.jsonl"
"$PY" - "$DIR" <<'PY'
import json, sys
d = sys.argv[1]
duck = {l["query"]: l["duckdb_best_s"] for l in map(json.loads, open(f"{d}/duckdb.jsonl"))}
for l in map(json.loads, open(f"{d}/bare.jsonl")):
    print(json.dumps({"phase": l["phase"], "query": l["query"], "best_s": l["best_s"],
                      "ratio_vs_duckdb": l["best_s"] / duck[l["query"]]}))
PY
