#!/usr/bin/env bash
# Collector publish benchmark (issue: collector): the collector's path against a bare rdkafka
# producer loop sending the same bytes, in one process, pinned to one core.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
cargo bench -p gpuwarden-collector --bench publish --no-run
exec taskset -c 0 cargo bench -p gpuwarden-collector --bench publish
