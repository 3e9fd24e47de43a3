#!/usr/bin/env bash
# Builds the real backends dask-otel's `backends` tests run against, from their Go modules:
# Jaeger v2, an OpenTelemetry Collector with the components of collector-config.yaml,
# Prometheus and VictoriaLogs. Each build is pinned by the go.mod/go.sum (and, for the
# collector, main.go) under deploy/backends/<name>/ and cached under
# ~/.cache/dask-otel-backends/<name>-<version>-<hash of those files>/, so a rerun on the
# same machine builds nothing. Prints one `name=path` line per binary on stdout.
#
#   scripts/backends.sh            build what is not cached, print the paths
#   scripts/backends.sh jaeger     only the named ones
set -euo pipefail
shopt -s nullglob
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${DASK_OTEL_BACKENDS_CACHE:-$HOME/.cache/dask-otel-backends}
export GOFLAGS="${GOFLAGS:-} -buildvcs=false -mod=readonly"

# name | version (for the cache's folder name) | Go package to build | binary | build tags
# (Prometheus without its service discoveries: the tests scrape static targets only, and
# the cloud SDKs they pull in are most of its build time)
BACKENDS=(
  "jaeger|v1.76.0|github.com/jaegertracing/jaeger/cmd/jaeger|jaeger|"
  "otelcol|v0.161.0|.|otelcol|"
  "prometheus|v0.316.0|github.com/prometheus/prometheus/cmd/prometheus|prometheus|remove_all_sd"
  "victorialogs|v1.52.1|github.com/VictoriaMetrics/VictoriaLogs/app/victoria-logs|victoria-logs|"
)

wanted=("$@")
for row in "${BACKENDS[@]}"; do
  IFS='|' read -r name version package binary tags <<<"$row"
  if [ ${#wanted[@]} -gt 0 ] && [[ ! " ${wanted[*]} " == *" $name "* ]]; then
    continue
  fi
  module="$ROOT/deploy/backends/$name"
  key=$(cd "$module" && { cat go.mod go.sum ./*.go; echo "tags=$tags"; } | sha256sum | cut -c1-12)
  out="$CACHE/$name-$version-$key/$binary"
  if [ ! -x "$out" ]; then
    echo "building $name $version (cache: $out)" >&2
    mkdir -p "$(dirname "$out")"
    started=$SECONDS
    (cd "$module" && go build -trimpath -tags "$tags" -o "$out.partial" "$package")
    mv "$out.partial" "$out"
    echo "built $name in $((SECONDS - started)) s" >&2
  fi
  echo "$name=$out"
done
