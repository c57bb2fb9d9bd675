#!/bin/sh
# Container entry point: a single-node Ray cluster with a fixed metrics-export port (scraped by
# Prometheus), then the Serve application from $SERVE_CONFIG (default deploy/serve_config.yaml: the
# default layout, as `python -m service` runs it; its args are service.app.AppArgs).
# `serve run` stays in the foreground and streams the replicas' logs.
set -eu
cd /app
NUM_CPUS_ARG=""
if [ -n "${RAY_NUM_CPUS:-}" ]; then
    NUM_CPUS_ARG="--num-cpus=${RAY_NUM_CPUS}"
fi
# shellcheck disable=SC2086
ray start --head --disable-usage-stats $NUM_CPUS_ARG \
    --metrics-export-port="${RAY_METRICS_EXPORT_PORT:-8080}" \
    --dashboard-host=0.0.0.0 --dashboard-port=8265
exec serve run --address=auto "${SERVE_CONFIG:-deploy/serve_config.yaml}"
