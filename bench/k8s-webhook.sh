#!/usr/bin/env bash
# The Kubernetes admission webhook: reviews per second (closed loop) and latency at a fixed rate
# (open loop, default 1,000 reviews/s) of gpuwarden's webhook over keep-alive HTTPS, in one run
# against a peer answering a fixed allowing AdmissionReview on the same TLS, HTTP and JSON stack,
# and as three sides: the peer, gpuwarden on an SQLite lease store, and gpuwarden as two replicas
# sharing one lease store in PostgreSQL (the client's connections spread over both). Targets: p99
# under 5 ms at 1,000 reviews/s; the replicas' p99 within 1.5x SQLite's. Each review is a
# distinct one-GPU pod; the cluster's API is a fake server in the bench (nodes only).
#
#   bench/k8s-webhook.sh                         # mix admit, then mix half (half denied by budget)
#   bench/k8s-webhook.sh --rate 2000 --seconds 20 --connections 32 --rounds 5 --requests 10000
#   MIXES=admit bench/k8s-webhook.sh --gpuwarden target/release/gpuwarden   # the binary's webhook
#   bench/k8s-webhook.sh --no-postgres           # peer and SQLite only
#
# The webhook is served as `gpuwarden enforce` serves it, in a process of its own (each replica
# too); with --gpuwarden PATH, by that binary (build it with `cargo build --release`). The
# PostgreSQL server is started by the bench in a temp dir from Debian's `postgresql` package
# (GPUWARDEN_PG_BIN overrides where its programs are) and stopped when the bench ends. Builds with
# the bench profile (optimized). Run it under `flock /var/tmp/gpuwarden-bench.lock` on a shared
# machine.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench -p gpuwarden-enforcer --bench k8s_webhook --no-run
for mix in ${MIXES:-admit half}; do
  cargo bench -p gpuwarden-enforcer --bench k8s_webhook -- --mix "$mix" "$@"
done
