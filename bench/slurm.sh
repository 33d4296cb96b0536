#!/usr/bin/env bash
# Cost of gpuwarden's Slurm hook: sbatch throughput of one private Slurm cluster (Debian's 22.05
# packages, 8 fake GPUs) with (a) a pure-Lua job_submit policy (reject more than 4 GPUs, no call)
# and (b) deploy/slurm/job_submit.lua asking a real `gpuwarden enforce` over HTTP.
#
#   bench/slurm.sh                   # 500 jobs each, one at a time and in 4 parallel loops
#   bench/slurm.sh --jobs 2000 --parallel 8
#   bench/slurm.sh --poll 5m         # the enforcer reads the queue every 5 min instead of 2 s:
#                                    # what its watcher's squeue --json costs the submissions
#   bench/slurm.sh --enforcer-nice -10   # the enforcer at a higher priority than the sbatch
#                                    # processes it shares the CPUs with
#   bench/slurm.sh --plumbing        # (b) against an enforcer without the Slurm endpoint:
#                                    # every call fails and on_unavailable = admit lets jobs in
#
# Each job is `sbatch --gres=gpu:h100:1 --hold --wrap true` as an ordinary account (root's jobs
# skip the hook), so nothing runs; they are cancelled after each run. Reported per hook and run:
# submissions/s, slurmctld CPU per job (utime+stime from /proc/<pid>/stat), and the hook's own
# latency_ms (p50/p99/max) from its decision lines in slurmctld's log; then the ratio b/a.
#
# Needs root and the packages of .ci/run. The enforcer is built with the bench profile
# (optimized: a long first build) into $CARGO_TARGET_DIR; GPUWARDEN_BIN=<path> uses that binary
# instead. Everything lives in a temp dir and is stopped and removed at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

jobs=500 parallel=4 plumbing=0 poll=2s nice=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --jobs) jobs=$2; shift 2 ;;
    --parallel) parallel=$2; shift 2 ;;
    --plumbing) plumbing=1; shift ;;
    --poll) poll=$2; shift 2 ;;
    --enforcer-nice) nice=$2; shift 2 ;;
    *) echo "unknown option $1 (see the head of $0)" >&2; exit 2 ;;
  esac
done
[[ $(id -u) -eq 0 ]] || { echo "needs root (slurmd, mknod, a test account)" >&2; exit 1; }
for p in slurmctld slurmd sbatch munged lua5.1; do
  command -v "$p" >/dev/null || [[ -x /usr/sbin/$p ]] || { echo "$p missing: see .ci/run's packages" >&2; exit 1; }
done

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
bin="${GPUWARDEN_BIN:-}"
if [[ -z $bin ]]; then
  echo "building gpuwarden (bench profile) ..." >&2
  cargo build --profile bench --bin gpuwarden >&2
  bin="$CARGO_TARGET_DIR/release/gpuwarden"
fi

work=$(mktemp -d /var/tmp/gpuwarden-bench-slurm.XXXXXX)
chmod 755 "$work"
user="gwb$$"
pids=()
cleanup() {
  set +e
  [[ -n ${SLURM_CONF:-} ]] && scancel --partition gpu >/dev/null 2>&1
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  done
  userdel "$user" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
useradd --no-create-home --gid users --shell /usr/sbin/nologin "$user"
uid=$(id -u "$user"); gid=$(id -g "$user")

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() { # wait_for SECONDS WHAT COMMAND...
  local until=$((SECONDS + $1)) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    (( SECONDS < until )) || { echo "timed out waiting for $what" >&2; exit 1; }
    sleep 0.2
  done
}

# ---- munge (shared; started only when its pid file names no live process) ----
if ! { [[ -f /run/munge/munged.pid ]] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; }; then
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged
fi
wait_for 10 munged sh -c 'munge -n | unmunge'

# ---- gpuwarden: broker, enforcer, token (the enforcer's config is written below) ----
token="slurm-bench-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
printf '%s\n' "$token" > "$work/token"
token_sha=$(printf %s "$token" | sha256sum | cut -d' ' -f1)
api_port=$(free_port)
cluster=bench

"$bin" broker --partitions 3 --bootstrap-file "$work/bootstrap" > "$work/broker.log" 2>&1 &
pids+=($!)
wait_for 20 "the broker" test -s "$work/bootstrap"

if [[ $plumbing == 1 ]]; then
  # An enforcer without the Slurm endpoint (a simulated substrate): every call is answered 404,
  # a failure, and on_unavailable = admit lets the job in. Checks the bench, not the endpoint.
  substrate_block=$(cat <<EOF
[[substrates]]
name = "sim"
driver = "simulated"
hosts = [{ prefix = "h", count = 1, gpus = 8, gpu_model = "NVIDIA H100 80GB HBM3" }]
EOF
)
  workload_substrate=sim
  on_unavailable=admit
else
  # The Slurm substrate (docs/src/operators/slurm.md). The hook's conf names it `substrate = slurm`; its
  # ClusterName is "$cluster". Jobs name no account, which maps to team bench; their workload is
  # the default, batch.
  substrate_block=$(cat <<EOF
[[substrates]]
name = "slurm"
driver = "slurm"
accounts = { $user = "$user" }

[substrates.slurm]
cluster = "$cluster"
slurm_conf = "$work/slurm/slurm.conf"
teams = { "" = "bench" }
models = { h100 = "NVIDIA H100 80GB HBM3" }
poll = "$poll"

EOF
)
  workload_substrate=slurm
  on_unavailable=reject
fi
substrate_name=$(sed -n 's/^name = "\(.*\)"/\1/p' <<<"$substrate_block" | head -1)

cat > "$work/gpuwarden.toml" <<EOF
[kafka]
brokers = "$(cat "$work/bootstrap")"
partitions = 3

[storage]
data_dir = "$work/data"

[[teams]]
name = "bench"
members = ["$user"]
gpu_quota = 1000000
monthly_budget_usd = 1000000000.0

[workloads.training]
max_gpus = 8
max_duration = "24h"
substrates = ["$workload_substrate"]

[workloads.batch]
max_gpus = 8
substrates = ["$workload_substrate"]

[enforcer]
listen = "127.0.0.1:$api_port"

$substrate_block

[[tokens]]
name = "slurm-hook"
sha256 = "$token_sha"
role = "service"
teams = ["bench"]

[signing]
key = "slurm-bench-signing-key-0123456789abcdef"
EOF
"$bin" check-config "$work/gpuwarden.toml" >&2 || {
  echo "the enforcer's config is not valid (see the marked substrate block in $0)" >&2; exit 1; }
nice -n "$nice" "$bin" enforce --config "$work/gpuwarden.toml" > "$work/enforcer.log" 2>&1 &
enforcer_pid=$!
pids+=($enforcer_pid)
wait_for 60 "the enforcer" curl -sf "http://127.0.0.1:$api_port/healthz"

# ---- one private Slurm cluster, as tests/support/slurm.rs makes them ----
s="$work/slurm"
mkdir -p "$s/state" "$s/spool" "$s/dev" "$s/jobs"
chmod 755 "$s"; chmod 1777 "$s/jobs"
for i in 0 1 2 3 4 5 6 7; do mknod "$s/dev/nvidia$i" c 195 "$i"; done
ctld_port=$(free_port); slurmd_port=$(free_port)
node="n$ctld_port"
cat > "$s/slurm.conf" <<EOF
ClusterName=$cluster
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
StateSaveLocation=$s/state
SlurmdSpoolDir=$s/spool
SlurmctldPidFile=$s/slurmctld.pid
SlurmdPidFile=$s/slurmd.pid
SlurmctldLogFile=$s/slurmctld.log
SlurmdLogFile=$s/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
FirstJobId=$((ctld_port * 1000 + 1))
MinJobAge=5
MaxJobCount=100000
KillWait=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
GresTypes=gpu
JobSubmitPlugins=lua
NodeName=$node NodeAddr=127.0.0.1 CPUs=16 RealMemory=16000 Gres=gpu:h100:8 State=UNKNOWN
PartitionName=gpu Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
echo "NodeName=$node Name=gpu Type=h100 File=$s/dev/nvidia[0-7]" > "$s/gres.conf"
echo "CgroupPlugin=cgroup/v1" > "$s/cgroup.conf"
cat > "$work/gpuwarden.conf" <<EOF
url = http://127.0.0.1:$api_port
substrate = $substrate_name
token_file = $work/token
timeout = 0.5
on_unavailable = $on_unavailable
EOF

# (a): the recipe's pure-Lua policy, with the same one log line per decision as gpuwarden's hook.
cat > "$work/pure.lua" <<'EOF'
local socket = require("socket")
local MAX_GPUS = 4
local function gpus_in(tres)
   if tres == nil or tres == "" then return 0 end
   local total = 0
   for item in string.gmatch(tres, "[^,]+") do
      local n = string.match(item, "gpu[^,]*[:=](%d+)$")
      if n == nil and string.match(item, "gpu") then n = "1" end
      if n then total = total + tonumber(n) end
   end
   return total
end
function slurm_job_submit(job_desc, part_list, submit_uid)
   local started = socket.gettime()
   local total = math.max(gpus_in(job_desc.tres_per_node), gpus_in(job_desc.tres_per_job),
      gpus_in(job_desc.tres_per_task))
   if total == 0 or submit_uid == 0 then return slurm.SUCCESS end
   local decision = total > MAX_GPUS and "deny" or "admit"
   slurm.log_info("gpuwarden: submit decision=%s reason=policy uid=%d latency_ms=%.2f",
      decision, submit_uid, (socket.gettime() - started) * 1000)
   if decision == "deny" then
      slurm.log_user("request of %d GPUs exceeds the per-job limit of %d", total, MAX_GPUS)
      return slurm.ERROR
   end
   return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
return slurm.SUCCESS
EOF
cp "$work/pure.lua" "$s/job_submit.lua"

export SLURM_CONF="$s/slurm.conf"
GPUWARDEN_HOOK_CONF="$work/gpuwarden.conf" /usr/sbin/slurmctld -D -i > "$s/slurmctld.out" 2>&1 &
ctld_pid=$!
pids+=($ctld_pid)
wait_for 30 slurmctld sh -c 'scontrol ping | grep -q "is UP"'
/usr/sbin/slurmd -D -N "$node" > "$s/slurmd.out" 2>&1 &
pids+=($!)
wait_for 60 "the node" sh -c 'sinfo -h -o %T | grep -qx idle'

# ---- the runs ----
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; } # utime + stime (after the name)
hz=$(getconf CLK_TCK)
submit_loop() { # submit_loop N: N held one-GPU jobs, one after the other, as $user
  local i
  for ((i = 0; i < $1; i++)); do
    setpriv --reuid="$uid" --regid="$gid" --init-groups \
      sbatch --parsable --gres=gpu:h100:1 --hold -o /dev/null --wrap true >/dev/null 2>>"$work/sbatch.err" || true
  done
}
install_hook() { # install_hook FILE: Slurm reloads job_submit.lua when its mtime passes the last load
  cp "$1" "$s/job_submit.lua"
  touch -d "@$(($(date +%s) + 1))" "$s/job_submit.lua"
  sleep 1.1
}
declare -A rate cpu lat
run() { # run LABEL MODE(seq|par)
  local label=$1 mode=$2 before_lines before_cpu t0 t1 n
  scancel --partition gpu >/dev/null 2>&1 || true
  wait_for 60 "an empty queue" sh -c '[ -z "$(squeue -h -o %i)" ]'
  before_lines=$(wc -l < "$s/slurmctld.log")
  before_cpu=$(cpu_ticks "$ctld_pid")
  : > "$work/sbatch.err"
  t0=$(date +%s.%N)
  if [[ $mode == seq ]]; then
    submit_loop "$jobs"
  else
    local loops=()
    for ((n = 0; n < parallel; n++)); do submit_loop $((jobs / parallel)) & loops+=($!); done
    wait "${loops[@]}"
  fi
  t1=$(date +%s.%N)
  local submitted failed decisions
  decisions=$(tail -n +$((before_lines + 1)) "$s/slurmctld.log" | grep -c 'gpuwarden: submit decision=' || true)
  failed=$(grep -c 'Batch job submission failed' "$work/sbatch.err" || true)
  submitted=$jobs
  [[ $mode == seq ]] || submitted=$((jobs / parallel * parallel))
  rate[$label.$mode]=$(awk -v n="$submitted" -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", n / (b - a) }')
  cpu[$label.$mode]=$(awk -v d=$(( $(cpu_ticks "$ctld_pid") - before_cpu )) -v hz="$hz" -v n="$submitted" \
    'BEGIN { printf "%.2f", d * 1000 / hz / n }')
  lat[$label.$mode]=$(tail -n +$((before_lines + 1)) "$s/slurmctld.log" | grep -o 'gpuwarden: submit decision=.*latency_ms=[0-9.]*' \
    | sed 's/.*latency_ms=//' | sort -g | awk '{ v[NR] = $1 } END {
        if (NR == 0) { print "-"; exit }
        p50 = v[int((NR - 1) * 0.50) + 1]; p99 = v[int((NR - 1) * 0.99) + 1]
        printf "%.2f/%.2f/%.2f", p50, p99, v[NR] }')
  local verdicts
  verdicts=$(tail -n +$((before_lines + 1)) "$s/slurmctld.log" | grep -o 'gpuwarden: submit decision=[a-z]* reason=[a-z]*' \
    | sed 's/gpuwarden: submit //' | sort | uniq -c | awk '{ printf "%s%s×%s", sep, $2 " " $3, $1; sep = ", " }')
  printf '%-10s %-4s %5d jobs  %7s/s  ctld %5s ms CPU/job  hook latency p50/p99/max %s ms  (%s; %d rejected)\n' \
    "$label" "$mode" "$submitted" "${rate[$label.$mode]}" "${cpu[$label.$mode]}" "${lat[$label.$mode]}" \
    "$verdicts" "$failed" >&2
  [[ $decisions -ge $submitted ]] || echo "  warning: $decisions decision lines for $submitted jobs" >&2
}

echo "Slurm $(sinfo -V | cut -d' ' -f2), $(nproc) CPUs; $jobs jobs per run, $parallel loops in parallel; enforcer $bin" >&2
install_hook "$work/pure.lua"
run pure-lua seq
run pure-lua par
install_hook "$repo/deploy/slurm/job_submit.lua"
run gpuwarden seq
run gpuwarden par
scancel --partition gpu >/dev/null 2>&1 || true

printf '\n| hook | jobs | sbatch/s sequential | sbatch/s %d parallel | slurmctld CPU ms/job (seq, par) | hook latency p50/p99/max ms (seq; par) |\n|---|---|---|---|---|---|\n' "$parallel"
for h in pure-lua gpuwarden; do
  printf '| %s | %d | %s | %s | %s, %s | %s; %s |\n' "$h" "$jobs" "${rate[$h.seq]}" "${rate[$h.par]}" \
    "${cpu[$h.seq]}" "${cpu[$h.par]}" "${lat[$h.seq]}" "${lat[$h.par]}"
done
awk -v as="${rate[pure-lua.seq]}" -v bs="${rate[gpuwarden.seq]}" -v ap="${rate[pure-lua.par]}" -v bp="${rate[gpuwarden.par]}" \
  'BEGIN { printf "\nratio gpuwarden / pure-lua: %.2f sequential, %.2f parallel\n", bs / as, bp / ap }'
[[ $plumbing == 1 ]] && echo "(--plumbing: every gpuwarden call failed and on_unavailable = admit let the job in)"
exit 0
