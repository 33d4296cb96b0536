#!/usr/bin/env bash
# Kafka -> Parquet benchmark (issue: pipeline ingest): the pipeline's ingest against a bare
# rdkafka consumer loop reading the same topic, in one process, same broker, same run.
#
#   bench/pipeline-kafka-ingest.sh         librdkafka's mock cluster, inside the bench process
#   bench/pipeline-kafka-ingest.sh tansu   tansu in a process of its own (bench/tansu.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
case "${1:-mock}" in
  mock) ;;
  tansu)
    cargo bench -p gpuwarden-pipeline --bench kafka_ingest --no-run
    source bench/tansu.sh
    start_tansu
    ;;
  *) echo "usage: $0 [mock|tansu]" >&2; exit 2 ;;
esac
cargo bench -p gpuwarden-pipeline --bench kafka_ingest
