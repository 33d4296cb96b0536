#!/usr/bin/env bash
# Ingest benchmark (issue: pipeline ingest): `gpuwarden ingest` of N samples from JSON lines to
# Parquet against DuckDB's COPY (SELECT * FROM read_json(...)) TO ... (FORMAT parquet) on the same
# file, with the same thread count, in the same run. Reports wall time and peak RSS of both, and
# the ratio of times. DuckDB comes from PyPI into a virtualenv under /var/tmp.
#
#   bench/ingest-vs-duckdb.sh [N=2000000] [THREADS=2]
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-2000000}"
THREADS="${2:-2}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
WORK=/var/tmp/gpuwarden-bench
VENV=$WORK/venv
mkdir -p "$WORK"
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
"$VENV/bin/python" -c 'import duckdb' 2>/dev/null || "$VENV/bin/pip" install -q duckdb
INPUT=$WORK/samples-$N.jsonl
[[ -s $INPUT ]] || { echo "generating $N samples into $INPUT"; python3 bench/gen_samples.py "$N" "$INPUT"; }
cargo build --release -q --bin gpuwarden
BIN=$CARGO_TARGET_DIR/release/gpuwarden

measure() { # label, command...: prints "label seconds max_rss_kib"
  local label=$1; shift
  local out; out=$(mktemp)
  /usr/bin/time -f '%e %M' -o "$out" "$@" >/dev/null
  echo "$label $(cat "$out")"
}

run_once() {
  rm -rf "$WORK/lake" "$WORK/duck.parquet"
  printf '[storage]\ndata_dir = "%s"\n[pipeline]\nflush_rows = 250000\n' "$WORK" > "$WORK/bench.toml"
  sync
  measure gpuwarden "$BIN" ingest --config "$WORK/bench.toml" --samples "$INPUT" --threads "$THREADS"
  sync
  measure duckdb "$VENV/bin/python" -c "
import duckdb
c = duckdb.connect()
c.execute('SET threads=$THREADS')
c.execute(\"COPY (SELECT * FROM read_json('$INPUT', format='newline_delimited')) TO '$WORK/duck.parquet' (FORMAT parquet, COMPRESSION zstd)\")
"
}

echo "input: $(wc -l < "$INPUT") lines, $(du -h "$INPUT" | cut -f1); threads: $THREADS"
results=$( for i in 1 2 3; do run_once; done )
echo "$results" | awk '{printf "%-10s %7.2f s  peak RSS %7.1f MiB\n", $1, $2, $3/1024}'
echo "$results" | awk '
  $1=="gpuwarden"{g[++ng]=$2; gr[ng]=$3} $1=="duckdb"{d[++nd]=$2; dr[nd]=$3}
  function med(a,n,  i,j,t){for(i=1;i<=n;i++)for(j=i+1;j<=n;j++)if(a[j]<a[i]){t=a[i];a[i]=a[j];a[j]=t};return a[int((n+1)/2)]}
  END{mg=med(g,ng); md=med(d,nd); mgr=med(gr,ng); mdr=med(dr,nd);
      printf "median: gpuwarden %.2f s, duckdb %.2f s -> time ratio %.2f (target <= 1.0); peak RSS %.0f vs %.0f MiB\n", mg, md, mg/md, mgr/1024, mdr/1024}'
rows=$(ls "$WORK"/lake/samples/*/*/*.parquet | wc -l)
echo "gpuwarden wrote $rows Parquet files, $(du -sh "$WORK/lake/samples" | cut -f1); duckdb wrote $(du -h "$WORK/duck.parquet" | cut -f1)"
