#!/usr/bin/env bash
# The lake in an S3 bucket against the lake in a directory (docs/src/contributors/object-storage.md):
# the same samples ingested (`gpuwarden ingest`), rolled up (`gpuwarden rollup`) and compacted
# (`gpuwarden compact`) into a directory and into a bucket of the tests' S3 server
# (dev/s3-test-server: s3s-fs on this machine's disk, on 127.0.0.1), one after the other in one
# run, with the same release binary. Prints each phase's seconds on both, their ratio (bucket /
# directory), and the S3 requests each phase sent, by method, with the requests per hour of data.
#
#   bench/lake-s3.sh [SAMPLES] [STEADY_MINUTES]
#
# SAMPLES defaults to 1,440,000: 2,000 GPUs sampled every 5 s for an hour. With STEADY_MINUTES
# (default 0: skipped) it then runs `gpuwarden up` on the example config (its simulated fleet of
# 32 GPUs, the embedded broker, 6 partitions, a flush a minute, rollups every minute) with the
# lake in the bucket for that long, and reports the requests per hour of steady-state running,
# counted from its second minute on (the first holds the start).
#
# The server is s3s-fs on the same disk: the ratio is what the S3 protocol and the lake's object
# store code cost over a local file system, not a remote store's latency (for that, multiply the
# requests by the store's per-request time). Needs the S3 server `.ci/run` installs
# (GPUWARDEN_S3_TEST_SERVER, else /var/tmp/gpuwarden-s3s/bin/gpuwarden-s3-test-server) and curl.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
N="${1:-1440000}"
STEADY="${2:-0}"
DIR="${LAKE_S3_DIR:-/var/tmp/lake-s3-bench}"
SERVER="${GPUWARDEN_S3_TEST_SERVER:-/var/tmp/gpuwarden-s3s/bin/gpuwarden-s3-test-server}"
[ -x "$SERVER" ] || { echo "the S3 server $SERVER is missing: cargo install --locked --root /var/tmp/gpuwarden-s3s --path dev/s3-test-server" >&2; exit 1; }
rm -rf "$DIR"
mkdir -p "$DIR/s3"
echo "machine: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
# LAKE_S3_BIN: another build of gpuwarden (a debug one counts the same requests, not the same time).
if [ -n "${LAKE_S3_BIN:-}" ]; then BIN="$LAKE_S3_BIN"; else
  cargo build -q --release --bin gpuwarden
  BIN="$CARGO_TARGET_DIR/release/gpuwarden"
fi
python3 bench/gen_samples.py "$N" "$DIR/samples.jsonl"

KEY=gpuwarden-bench SECRET=gpuwarden-bench-secret
"$SERVER" --host 127.0.0.1 --port 0 --request-log "$DIR/requests.log" \
  --access-key "$KEY" --secret-key "$SECRET" "$DIR/s3" > "$DIR/server.out" 2>&1 &
SERVER_PID=$!
trap 'kill $SERVER_PID 2>/dev/null || true' EXIT
for _ in $(seq 100); do grep -q "server is running at" "$DIR/server.out" && break; sleep 0.1; done
ENDPOINT=$(grep -o "http://[0-9.:]*" "$DIR/server.out" | head -1)
[ -n "$ENDPOINT" ] || { cat "$DIR/server.out" >&2; exit 1; }
curl -sS --fail-with-body -X PUT --aws-sigv4 "aws:amz:us-east-1:s3" --user "$KEY:$SECRET" \
  -H "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855" \
  "$ENDPOINT/lake" > /dev/null

# The samples are of 2026-01-01: kept, whatever today's date.
KEEP=$'\n[pipeline.retention]\nsamples = "forever"\n'
printf '[storage]\ndata_dir = "%s"\n%s' "$DIR/dir" "$KEEP" > "$DIR/dir.toml"
printf '[storage]\ndata_dir = "%s"\nlake = "s3://lake/bench"\n\n[storage.s3]\nendpoint = "%s"\nallow_http = true\nregion = "us-east-1"\naccess_key_id = "%s"\nsecret_access_key = "%s"\n%s' \
  "$DIR/s3data" "$ENDPOINT" "$KEY" "$SECRET" "$KEEP" > "$DIR/s3.toml"

now() { date +%s.%N; }
requests() { wc -l < "$DIR/requests.log"; }
declare -A SECONDS_OF REQUESTS_OF
for lake in dir s3; do
  config="$DIR/$lake.toml"
  for phase in ingest rollup compact; do
    case $phase in
      ingest) args=(ingest --config "$config" --samples "$DIR/samples.jsonl") ;;
      rollup) args=(rollup --config "$config") ;;
      compact) args=(compact --config "$config" --watermark 2030-01-01T00:00:00Z) ;;
    esac
    before=$(requests); t=$(now)
    "$BIN" "${args[@]}" > "$DIR/$lake-$phase.out"
    SECONDS_OF[$lake-$phase]=$(echo "$(now) - $t" | bc)
    REQUESTS_OF[$lake-$phase]=$(( $(requests) - before ))
    if [ "$lake" = s3 ]; then
      sed -n "$((before + 1)),\$p" "$DIR/requests.log" | cut -d' ' -f1 | sort | uniq -c \
        | awk -v p="$phase" '{printf "%s %s=%s\n", p, $2, $1}' >> "$DIR/methods.txt"
    fi
  done
done
rows_dir=$("$BIN" sql --config "$DIR/dir.toml" --format csv "SELECT count(*) AS n FROM samples" | tail -1)
rows_s3=$("$BIN" sql --config "$DIR/s3.toml" --format csv "SELECT count(*) AS n FROM samples" | tail -1)
[ "$rows_dir" = "$N" ] && [ "$rows_s3" = "$N" ] || { echo "rows: directory $rows_dir, bucket $rows_s3, of $N" >&2; exit 1; }
hours=$("$BIN" sql --config "$DIR/s3.toml" --format csv "SELECT count(DISTINCT date_trunc('hour', to_timestamp_millis(ts_ms))) AS h FROM samples" | tail -1)
for phase in ingest rollup compact; do
  d=${SECONDS_OF[dir-$phase]} s=${SECONDS_OF[s3-$phase]} r=${REQUESTS_OF[s3-$phase]}
  methods=$(grep "^$phase " "$DIR/methods.txt" | cut -d' ' -f2 | paste -sd, -)
  printf '{"phase": "%s", "samples": %s, "hours_of_data": %s, "directory_s": %.2f, "s3_s": %.2f, "ratio_s3_vs_directory": %.2f, "s3_requests": %s, "s3_requests_per_hour_of_data": %.0f, "by_method": "%s"}\n' \
    "$phase" "$N" "$hours" "$d" "$s" "$(echo "$s / $d" | bc -l)" "$r" "$(echo "$r / $hours" | bc -l)" "$methods"
done

[ "$STEADY" -gt 0 ] || exit 0
python3 - "$DIR" "$ENDPOINT" "$KEY" "$SECRET" <<'PY'
import sys
d, endpoint, key, secret = sys.argv[1:5]
s = open("examples/gpuwarden.toml").read()
storage = (f'data_dir = "{d}/steady"\nlake = "s3://lake/steady"\n\n[storage.s3]\nendpoint = "{endpoint}"\n'
           f'allow_http = true\nregion = "us-east-1"\naccess_key_id = "{key}"\nsecret_access_key = "{secret}"\n')
assert 'data_dir = "gpuwarden-data"\n' in s
s = s.replace('data_dir = "gpuwarden-data"\n', storage, 1)
for old, new in [('127.0.0.1:9400', '127.0.0.1:29400'), ('127.0.0.1:9401', '127.0.0.1:29401'),
                 ('127.0.0.1:5433', '127.0.0.1:25433'), ('127.0.0.1:8080', '127.0.0.1:28080')]:
    s = s.replace(old, new)
open(f"{d}/steady.toml", "w").write(s)
PY
export GPUWARDEN_SIGNING_KEY="${GPUWARDEN_SIGNING_KEY:-$(openssl rand -hex 32)}"
export GPUWARDEN_SQL_PASSWORD="${GPUWARDEN_SQL_PASSWORD:-$(openssl rand -hex 16)}"
"$BIN" up --config "$DIR/steady.toml" > "$DIR/up.out" 2> "$DIR/up.log" &
UP_PID=$!
trap 'kill $UP_PID 2>/dev/null || true; kill $SERVER_PID 2>/dev/null || true' EXIT
sleep 60
from=$(requests)
sleep $((STEADY * 60))
to=$(requests)
kill -TERM $UP_PID; wait $UP_PID || true
methods=$(sed -n "$((from + 1)),${to}p" "$DIR/requests.log" | cut -d' ' -f1 | sort | uniq -c | awk '{printf "%s=%s,", $2, $1}')
printf '{"phase": "steady", "minutes": %s, "s3_requests": %s, "s3_requests_per_hour": %.0f, "by_method": "%s"}\n' \
  "$STEADY" "$((to - from))" "$(echo "($to - $from) * 60 / $STEADY" | bc -l)" "${methods%,}"
