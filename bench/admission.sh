#!/usr/bin/env bash
# Admission throughput and latency: the enforcer's POST /v1/admission against a bare axum
# handler on the same HTTP stack, at maximum throughput and at a fixed 1,000 requests/s.
# Targets: enforcer >= 0.5x the bare handler's throughput, p99 < 5 ms at 1,000 rps.
#
#   bench/admission.sh                      # defaults: 5 rounds of 10,000 cycles a side, 1,000 rps for 10 s, 16 connections
#   bench/admission.sh --rate 2000 --seconds 30 --connections 32 --rounds 3 --requests 50000
#   bench/admission.sh --hosts 1024 --held 4000 --only enforcer --seconds 0   # a large, busy fleet
#
# Each cycle is a real admission and the release of its lease. Builds with the bench profile
# (optimized); the lease store is SQLite in a temp dir, WAL mode.
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo bench -p gpuwarden-enforcer --bench admission -- "$@"
