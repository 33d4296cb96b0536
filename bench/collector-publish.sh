#!/usr/bin/env bash
# Collector publish benchmark (issue: collector): the collector's path against a bare rdkafka
# producer loop sending the same bytes, in one process, pinned to one core.
#
#   bench/collector-publish.sh         librdkafka's mock cluster, inside the bench process
#   bench/collector-publish.sh tansu   tansu in a process of its own (bench/tansu.sh), on the
#                                      other core
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
cargo bench -p gpuwarden-collector --bench publish --no-run
case "${1:-mock}" in
  mock) ;;
  tansu)
    source bench/tansu.sh
    start_tansu
    taskset -p -c 1 "$TANSU_PID" >/dev/null
    ;;
  *) echo "usage: $0 [mock|tansu]" >&2; exit 2 ;;
esac
taskset -c 0 cargo bench -p gpuwarden-collector --bench publish
