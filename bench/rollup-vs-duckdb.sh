#!/usr/bin/env bash
# Rollup benchmark (issue: rollups and SQL): `gpuwarden rollup` over a lake of N samples against
# DuckDB running the equivalent team_hourly SQL (bench/team_hourly.duckdb.sql) on the same
# Parquet files, with the same threads, in the same run. `gpuwarden rollup` computes more than
# DuckDB is asked to (gpu_hourly, lease_hourly, focus_costs and leases besides team_hourly), so
# the ratio is conservative. Reports the median wall time and peak RSS of three runs of each,
# then checks that both computed the same team_hourly rows (1e-9 relative).
#
#   bench/rollup-vs-duckdb.sh [N=20000000] [THREADS=2]
#
# THREADS is DuckDB's `SET threads`; gpuwarden uses one DataFusion partition per core, so run it
# with THREADS equal to the machine's cores. The lake is generated once (bench/gen_fleet.py
# streamed through `gpuwarden ingest`) and kept under /var/tmp/gpuwarden-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-20000000}"
THREADS="${2:-$(nproc)}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
WORK=/var/tmp/gpuwarden-bench
VENV=$WORK/venv
DATA=$WORK/rollup-$N
mkdir -p "$WORK"
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
"$VENV/bin/python" -c 'import duckdb, duckdb_extension_delta' 2>/dev/null || "$VENV/bin/pip" install -q -r tests/requirements.txt
cargo build --release -q --bin gpuwarden
BIN=$CARGO_TARGET_DIR/release/gpuwarden

CONFIG=$DATA/bench.toml
mkdir -p "$DATA"
cat > "$CONFIG" <<EOF
[storage]
data_dir = "$DATA"
[pipeline]
lateness = "10m"
[pricing]
idle_util_pct = 5.0
default_usd_per_gpu_hour = 2.0
[[pricing.gpu]]
match = "H100"
usd_per_gpu_hour = 4.5
[[pricing.gpu]]
match = "A100"
usd_per_gpu_hour = 2.6
[[pricing.gpu]]
match = "L40S"
usd_per_gpu_hour = 1.9
EOF
PRICE="CASE WHEN strpos(lower(gpu_model), 'h100') > 0 THEN 4.5 WHEN strpos(lower(gpu_model), 'a100') > 0 THEN 2.6 WHEN strpos(lower(gpu_model), 'l40s') > 0 THEN 1.9 ELSE 2.0 END"

# A lake of the layout before Delta tables is made again.
if [[ -e $DATA/.complete && ! -d $DATA/lake/samples/_delta_log ]]; then rm -f "$DATA/.complete"; fi
if [[ ! -e $DATA/.complete ]]; then
  echo "generating $N samples into $DATA/lake (once)"
  rm -rf "$DATA/lake"
  python3 bench/gen_fleet.py "$N" "$DATA/leases.jsonl" | "$BIN" ingest --config "$CONFIG" --samples -
  "$BIN" ingest --config "$CONFIG" --lease-events "$DATA/leases.jsonl"
  touch "$DATA/.complete"
fi
LAKE=$DATA/lake
# The config's defaults: idle by utilization, no MIG overrides, energy free, no CO2e factor.
sed -e "s|{lake}|$LAKE|g" -e "s|{price}|$PRICE|g" -e "s|{idle_sm}|5.0|g" -e "s|{idle}|5.0|g" \
  -e "s|{measure}|NULL|g" -e "s|{default_measure}|'util'|g" -e "s|{mig_share}|NULL|g" \
  -e "s|{energy_price}|0.0|g" -e "s|{co2e_per_kwh}|NULL|g" -e "s|{lateness_ms}|600000|g" \
  bench/team_hourly.duckdb.sql > "$DATA/team_hourly.sql"

measure() { # label, command...: prints "label seconds max_rss_kib"
  local label=$1; shift
  local out; out=$(mktemp)
  /usr/bin/time -f '%e %M' -o "$out" "$@" >/dev/null
  echo "$label $(cat "$out")"
}

run_once() {
  rm -rf "$LAKE/rollups"
  sync
  measure gpuwarden "$BIN" rollup --config "$CONFIG"
  sync
  measure duckdb "$VENV/bin/python" -c "
import duckdb, duckdb_extension_delta, glob, os
c = duckdb.connect()
c.execute('SET threads=$THREADS')
c.execute(\"LOAD '\" + glob.glob(os.path.join(os.path.dirname(duckdb_extension_delta.__file__), 'extensions', '*', 'delta.duckdb_extension'))[0] + \"'\")
c.execute(\"COPY (\" + open('$DATA/team_hourly.sql').read() + \") TO '$DATA/duckdb-team-hourly.csv' (HEADER)\")
"
}

files=$(find "$LAKE/samples" -maxdepth 1 -name '*.parquet' | wc -l)
rows=$("$BIN" sql --config "$CONFIG" --format csv "SELECT count(*) AS n FROM samples" | tail -1)
echo "lake: $rows sample rows in $files Parquet files ($(du -sh "$LAKE/samples" | cut -f1)), $(wc -l < "$DATA/leases.jsonl") lease events; threads: $THREADS"
results=$( for i in 1 2 3; do run_once; done )
echo "$results" | awk '{printf "%-10s %7.2f s  peak RSS %7.1f MiB\n", $1, $2, $3/1024}'
echo "$results" | awk '
  $1=="gpuwarden"{g[++ng]=$2; gr[ng]=$3} $1=="duckdb"{d[++nd]=$2; dr[nd]=$3}
  function med(a,n,  i,j,t){for(i=1;i<=n;i++)for(j=i+1;j<=n;j++)if(a[j]<a[i]){t=a[i];a[i]=a[j];a[j]=t};return a[int((n+1)/2)]}
  END{mg=med(g,ng); md=med(d,nd); mgr=med(gr,ng); mdr=med(dr,nd);
      printf "median: gpuwarden %.2f s, duckdb %.2f s -> time ratio %.2f (target <= 1.0); peak RSS %.0f vs %.0f MiB -> ratio %.2f (target <= 0.25)\n", mg, md, mg/md, mgr/1024, mdr/1024, mgr/mdr}'

"$BIN" sql --config "$CONFIG" --format csv \
  "SELECT CAST(hour AS BIGINT) AS hour, team, gpu_model, allocated_gpu_hours, observed_gpu_hours, busy_gpu_hours, idle_gpu_hours, utilization_pct, cost_usd, idle_cost_usd, energy_kwh, final, sm_active_gpu_hours, gpm_observed_gpu_hours, idle_measure, energy_cost_usd, co2e_kg FROM team_hourly ORDER BY hour, team, gpu_model" \
  > "$DATA/gpuwarden-team-hourly.csv"
"$VENV/bin/python" - "$DATA/gpuwarden-team-hourly.csv" "$DATA/duckdb-team-hourly.csv" <<'EOF'
import csv, math, sys
ours, theirs = (list(csv.DictReader(open(p))) for p in sys.argv[1:3])
key = lambda r: (int(r["hour"]), r["team"], r["gpu_model"])
a, b = {key(r): r for r in ours}, {key(r): r for r in theirs}
diffs = [f"only in {'gpuwarden' if k in a else 'duckdb'}: {k}" for k in set(a) ^ set(b)]
for k in set(a) & set(b):
    for col, x in a[k].items():
        y = b[k][col]
        if col in ("hour", "team", "gpu_model"):
            continue
        if col in ("final", "idle_measure"):
            same = x.lower() == y.lower()
        elif x == "" or y == "":
            same = x == y
        else:
            same = math.isclose(float(x), float(y), rel_tol=1e-9, abs_tol=1e-12)
        if not same:
            diffs.append(f"{k} {col}: gpuwarden {x}, duckdb {y}")
print(f"team_hourly: {len(a)} rows from gpuwarden, {len(b)} from duckdb, {len(diffs)} differences")
for d in sorted(diffs)[:20]:
    print("  " + d)
sys.exit(1 if diffs else 0)
EOF
