# Sourced by the Kafka benchmarks: `start_tansu` starts tansu (tests/support/tansu.rs, installed by
# .ci/run) in memory on a free port of 127.0.0.1, sets GPUWARDEN_BENCH_BROKER to its address for
# the bench binary, and stops it when the script exits. The binary: GPUWARDEN_TANSU, else where
# .ci/run unpacks it.
start_tansu() {
  local tansu="${GPUWARDEN_TANSU:-/var/tmp/gpuwarden-tansu/tansu}"
  if [[ ! -x "$tansu" ]]; then
    echo "tansu is missing at $tansu: run bash .ci/run (its \"tansu broker\" step) first" >&2
    exit 1
  fi
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local log
  log=$(mktemp /tmp/gpuwarden-bench-tansu.XXXXXX.log)
  RUST_LOG=warn "$tansu" broker --listener-url "tcp://127.0.0.1:$port" \
    --advertised-listener-url "tcp://127.0.0.1:$port" --storage-engine memory://tansu/ \
    >"$log" 2>&1 &
  TANSU_PID=$!
  trap 'kill "$TANSU_PID" 2>/dev/null || true' EXIT
  for _ in $(seq 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      break
    fi
    sleep 0.05
  done
  export GPUWARDEN_BENCH_BROKER="127.0.0.1:$port"
  echo "tansu $("$tansu" --version | awk '{print $2}') at $GPUWARDEN_BENCH_BROKER (pid $TANSU_PID, log $log)"
}
