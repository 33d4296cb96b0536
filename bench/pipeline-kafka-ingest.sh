#!/usr/bin/env bash
# Kafka -> Parquet benchmark (issue: pipeline ingest): the pipeline's ingest against a bare
# rdkafka consumer loop reading the same topic, in one process, same broker, same run.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/gpuwarden-target}"
exec cargo bench -p gpuwarden-pipeline --bench kafka_ingest
