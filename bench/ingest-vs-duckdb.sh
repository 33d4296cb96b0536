#!/usr/bin/env bash
# Ingest benchmark (issue: pipeline ingest): `gpuwarden ingest` of N samples from JSON lines to
# the lake against DuckDB on the same file, with the same thread count, in the same run, for the
# samples in time order and the same samples shuffled (seeded), as a backfill export may be:
#   duckdb       COPY (SELECT * FROM read_json(...)) TO 'f.parquet' (FORMAT parquet): one file
#   duckdb-hours the same, PARTITION_BY (date, hour): one directory per hour (gpuwarden commits
#                files of one hour each to the samples Delta table)
# Each is run three times per order; reports the median wall time and peak RSS, the time ratio of
# gpuwarden to each DuckDB peer (target for the shuffled order: <= 1.0 against duckdb-hours), and
# Parquet files per hour of gpuwarden and of duckdb-hours (target: no more than DuckDB). DuckDB
# comes from the test virtualenv (/var/tmp/gpuwarden-venv, or $GPUWARDEN_PYTHON), installed
# from PyPI if missing. The machine's load (uptime) is printed with each order: the figures mean
# little on a busy machine.
#
#   [GPUWARDEN_BIN=path] bench/ingest-vs-duckdb.sh [N=2000000] [THREADS=2]
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-2000000}"
THREADS="${2:-2}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
WORK=/var/tmp/gpuwarden-bench
PYTHON="${GPUWARDEN_PYTHON:-/var/tmp/gpuwarden-venv/bin/python}"
mkdir -p "$WORK"
[[ -x $PYTHON ]] || { python3 -m venv /var/tmp/gpuwarden-venv; PYTHON=/var/tmp/gpuwarden-venv/bin/python; }
"$PYTHON" -c 'import duckdb' 2>/dev/null || "$PYTHON" -m pip install -q duckdb
SORTED=$WORK/samples-$N.jsonl
SHUFFLED=$WORK/samples-$N-shuffled.jsonl
[[ -s $SORTED ]] || { echo "generating $N samples into $SORTED"; python3 bench/gen_samples.py "$N" "$SORTED"; }
[[ -s $SHUFFLED ]] || { echo "generating $N shuffled samples into $SHUFFLED"; python3 bench/gen_samples.py "$N" "$SHUFFLED" --shuffle; }
# GPUWARDEN_BIN: a gpuwarden binary to measure instead of building one (an older build, for a
# baseline in the same conditions).
BIN="${GPUWARDEN_BIN:-}"
[[ -n $BIN ]] || { cargo build --release -q --bin gpuwarden; BIN=$CARGO_TARGET_DIR/release/gpuwarden; }

measure() { # label, command...: prints "label seconds max_rss_kib"
  local label=$1; shift
  local out; out=$(mktemp)
  /usr/bin/time -f '%e %M' -o "$out" "$@" >/dev/null 2>&1
  echo "$label $(cat "$out")"
  rm -f "$out"
}

# DuckDB's side, as a script of its own so that /usr/bin/time measures it: input, partitioned
cat > "$WORK/duck.py" <<PY
import sys, duckdb
source, partitioned = sys.argv[1], sys.argv[2] == "1"
c = duckdb.connect()
c.execute("SET threads=$THREADS")
select = f"SELECT * FROM read_json('{source}', format='newline_delimited')"
target, options = "$WORK/duck.parquet", "FORMAT parquet, COMPRESSION zstd"
if partitioned:
    select = f"SELECT *, CAST(epoch_ms(ts_ms) AS DATE) AS date, hour(epoch_ms(ts_ms)) AS hour FROM read_json('{source}', format='newline_delimited')"
    target, options = "$WORK/duck-hours", options + ", PARTITION_BY (date, hour)"
c.execute(f"COPY ({select}) TO '{target}' ({options})")
PY

run_once() { # input
  rm -rf "$WORK/lake" "$WORK/duck.parquet" "$WORK/duck-hours"
  printf '[storage]\ndata_dir = "%s"\n' "$WORK" > "$WORK/bench.toml"
  sync
  measure gpuwarden "$BIN" ingest --config "$WORK/bench.toml" --samples "$1" --threads "$THREADS"
  sync
  measure duckdb "$PYTHON" "$WORK/duck.py" "$1" 0
  sync
  measure duckdb-hours "$PYTHON" "$WORK/duck.py" "$1" 1
}

per_hour() { # directory of hour partitions: "files hours"
  echo "$(find "$1" -name '*.parquet' | wc -l) $(find "$1" -name '*.parquet' -printf '%h\n' | sort -u | wc -l)"
}

gpuwarden_per_hour() { # a Delta table gpuwarden wrote (ingest only adds): "files hours", each
  # file named after its hour, <YYYY-MM-DD>T<HH>-…
  echo "$(find "$1" -maxdepth 1 -name '*.parquet' | wc -l) $(find "$1" -maxdepth 1 -name '*.parquet' -printf '%f\n' | cut -c1-13 | sort -u | wc -l)"
}

for order in sorted shuffled; do
  input=$SORTED; [[ $order == shuffled ]] && input=$SHUFFLED
  echo "== $order: $(wc -l < "$input") lines, $(du -h "$input" | cut -f1); threads: $THREADS; load before: $(uptime | sed 's/.*load average: //')"
  results=$( for i in 1 2 3; do run_once "$input"; done )
  echo "$results" | awk '{printf "%-13s %7.2f s  peak RSS %7.1f MiB\n", $1, $2, $3/1024}'
  echo "$results" | awk -v order="$order" '
    { t[$1, ++n[$1]] = $2; r[$1, n[$1]] = $3 }
    function med(name, a,  i, j, k, v, x) { k = n[name]; for (i = 1; i <= k; i++) v[i] = (a == "t" ? t[name, i] : r[name, i]);
      for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (v[j] < v[i]) { x = v[i]; v[i] = v[j]; v[j] = x }; return v[int((k + 1) / 2)] }
    END { g = med("gpuwarden", "t"); d = med("duckdb", "t"); h = med("duckdb-hours", "t");
      printf "%s median: gpuwarden %.2f s, duckdb %.2f s, duckdb-hours %.2f s -> time ratio %.2f vs duckdb, %.2f vs duckdb-hours (target <= 1.0); peak RSS %.0f / %.0f / %.0f MiB\n",
        order, g, d, h, g / d, g / h, med("gpuwarden", "r") / 1024, med("duckdb", "r") / 1024, med("duckdb-hours", "r") / 1024 }'
  read -r gf gh <<<"$(gpuwarden_per_hour "$WORK/lake/samples")"
  read -r df dh <<<"$(per_hour "$WORK/duck-hours")"
  echo "$order files per hour: gpuwarden $gf files / $gh hours ($(du -sh "$WORK/lake/samples" | cut -f1)), duckdb-hours $df files / $dh hours ($(du -sh "$WORK/duck-hours" | cut -f1)), duckdb one file ($(du -h "$WORK/duck.parquet" | cut -f1)); load after: $(uptime | sed 's/.*load average: //')"
done
