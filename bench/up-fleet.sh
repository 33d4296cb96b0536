#!/usr/bin/env bash
# `gpuwarden up` with a large simulated fleet (issue: the signal window at 100,000 GPUs): the
# collector, the pipeline and the enforcer in one process, samples every 5 s in real time, for a
# while. Every 30 s it records the process's RSS and CPU time and the pipeline's consumer lag,
# samples read and signal computations; at the end it prints peak RSS, CPU per sample, the lag's
# maximum and last value, and the signal computations against the periods that passed. From the
# log's "rolled up" lines it then prints the rollup runs: their time (median, worst, how many
# took longer than pipeline.rollup_every), the hours each computed from kept partials, how far
# behind the wall clock team_hourly was when each run ended (its watermark's age: samples up to
# the watermark are in team_hourly from then on), and the longest a sample waited to be in
# team_hourly: a sample taken just after one run's watermark is in by the end of the next run
# (the end of run i less the watermark of run i - 1; it includes pipeline.flush_age, the time
# ingest may buffer a sample before its file lands), and from its file landing (a file landing
# just after run i - 1 started is read by run i).
#
#   bench/up-fleet.sh [GPUS] [MINUTES]     default 100000 GPUs, 20 minutes
#
# The embedded broker keeps at most 5 MB per partition; the fleet's topic gets 48 partitions so
# that a pipeline a few seconds behind still finds its records.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
GPUS="${1:-100000}"; MINUTES="${2:-20}"
DIR="${UP_FLEET_DIR:-/var/tmp/up-fleet}"
rm -rf "$DIR"; mkdir -p "$DIR"
cargo build --release -q --bin gpuwarden
BIN=$CARGO_TARGET_DIR/release/gpuwarden
python3 - "$DIR" "$GPUS" <<'PY'
import re, sys
d, gpus = sys.argv[1], int(sys.argv[2])
s = open("examples/gpuwarden.toml").read()
s = s.replace('partitions = 6', 'partitions = 48', 1)
s = s.replace('data_dir = "gpuwarden-data"', f'data_dir = "{d}/data"', 1)
s = s.replace('metrics_listen = "127.0.0.1:9400"', 'metrics_listen = "127.0.0.1:19400"', 1)
s = s.replace('metrics_listen = "127.0.0.1:9401"', 'metrics_listen = "127.0.0.1:19401"', 1)
s = s.replace('sql_listen = "127.0.0.1:5433"', 'sql_listen = "127.0.0.1:15433"', 1)
s = s.replace('listen = "127.0.0.1:8080"', 'listen = "127.0.0.1:18080"', 1)
hosts = re.search(r'hosts = \[\n(.*?)\n\]', s, re.S)
assert gpus % 8 == 0, "GPUS must be a multiple of 8"
s = s[:hosts.start()] + f'hosts = [\n  {{ prefix = "sim-h100", count = {gpus // 8}, gpus = 8, gpu_model = "NVIDIA H100 80GB HBM3" }},\n]' + s[hosts.end():]
open(f"{d}/gpuwarden.toml", "w").write(s)
PY
echo "machine: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); $GPUS GPUs for $MINUTES min" >&2
export GPUWARDEN_SIGNING_KEY="${GPUWARDEN_SIGNING_KEY:-$(openssl rand -hex 32)}"
export GPUWARDEN_SQL_PASSWORD="${GPUWARDEN_SQL_PASSWORD:-$(openssl rand -hex 16)}"
"$BIN" --log-format json up --config "$DIR/gpuwarden.toml" 2> "$DIR/up.log" &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
python3 - "$PID" "$MINUTES" "$DIR" <<'PY'
import json, re, sys, time, urllib.request
pid, minutes, d = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
tick = 100.0  # clock ticks per second (getconf CLK_TCK)
def proc():
    status = open(f"/proc/{pid}/status").read()
    kb = lambda k: int(re.search(rf"^{k}:\s+(\d+)", status, re.M).group(1))
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return kb("VmRSS") / 1024, kb("VmHWM") / 1024, (int(fields[11]) + int(fields[12])) / tick
def metrics():
    try:
        text = urllib.request.urlopen("http://127.0.0.1:19401/metrics", timeout=10).read().decode()
    except Exception:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out
def pick(m, prefix):
    return sum(v for k, v in m.items() if k.startswith(prefix))
start = time.time()
rows = []
while time.time() - start < minutes * 60:
    time.sleep(30)
    try:
        rss, hwm, cpu = proc()
    except FileNotFoundError:
        sys.exit("gpuwarden up exited early; see " + d + "/up.log")
    m = metrics()
    row = {"t_s": round(time.time() - start), "rss_mib": round(rss), "peak_rss_mib": round(hwm), "cpu_s": cpu,
           "samples_in": pick(m, 'gpuwarden_pipeline_records_in_total{topic="gpuwarden.samples"'),
           "lag": pick(m, "gpuwarden_pipeline_consumer_lag_messages"),
           "computations": pick(m, "gpuwarden_pipeline_signal_computations_total"),
           "compute_s": pick(m, "gpuwarden_pipeline_signal_computation_seconds"),
           "window": {k: v for k, v in m.items() if k.startswith("gpuwarden_pipeline_signals_window")}}
    rows.append(row)
    print(json.dumps(row), flush=True)
last = rows[-1]
print(json.dumps({"summary": True, "minutes": minutes, "peak_rss_mib": max(r["peak_rss_mib"] for r in rows),
    "samples_in": last["samples_in"], "cpu_s": last["cpu_s"],
    "cpu_us_per_sample": 1e6 * last["cpu_s"] / max(last["samples_in"], 1),
    "lag_max": max(r["lag"] for r in rows), "lag_last": last["lag"],
    "signal_computations": last["computations"], "periods": minutes * 60 / 30}))
PY
python3 - "$DIR/up.log" <<'PY'
import json, statistics, sys
from datetime import datetime
runs = []
for line in open(sys.argv[1], errors="replace"):
    try:
        entry = json.loads(line)
    except ValueError:
        continue
    fields = entry.get("fields", entry)  # the JSON log puts fields at the top level
    if fields.get("message") != "rolled up":
        continue
    ended = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp() * 1000
    runs.append({"elapsed_s": fields["elapsed_ms"] / 1000, "hours": fields.get("hours"),
                 "incremental_hours": fields.get("incremental_hours"), "ended": ended,
                 "watermark": fields.get("watermark"),
                 "behind_s": (ended - fields["watermark"]) / 1000 if fields.get("watermark") else None})
if not runs:
    sys.exit("no rollup run ended; see " + sys.argv[1])
every = 60.0  # pipeline.rollup_every of examples/gpuwarden.toml
elapsed = [r["elapsed_s"] for r in runs]
behind = [r["behind_s"] for r in runs if r["behind_s"] is not None]
waited = [(b["ended"] - a["watermark"]) / 1000 for a, b in zip(runs, runs[1:]) if a["watermark"]]
# A file that lands just after a run started is read by the next one.
landed = [(b["ended"] - a["ended"]) / 1000 + a["elapsed_s"] for a, b in zip(runs, runs[1:])]
print(json.dumps({"rollup_runs": len(runs), "run_s_median": round(statistics.median(elapsed), 2),
    "run_s_worst": round(max(elapsed), 2), "runs_over_rollup_every": sum(e > every for e in elapsed),
    "incremental_hours": sum(r["incremental_hours"] or 0 for r in runs),
    "hours": sum(r["hours"] or 0 for r in runs),
    "team_hourly_behind_s_median": round(statistics.median(behind), 1) if behind else None,
    "team_hourly_behind_s_worst": round(max(behind), 1) if behind else None,
    "sample_to_team_hourly_s_worst": round(max(waited), 1) if waited else None,
    "landed_to_team_hourly_s_worst": round(max(landed), 1) if landed else None}))
for r in runs:
    print(json.dumps(r))
PY
