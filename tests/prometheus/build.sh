#!/usr/bin/env bash
# Builds the Prometheus server and promtool that the observability test runs, from the Go module
# proxy, once per machine, into a cache folder keyed by the version and go.sum; prints the folder
# that holds both binaries.
#
#   tests/prometheus/build.sh          # builds if needed (~6 min cold on 2 cores)
#   tests/prometheus/build.sh --find   # prints it only if already built (exit 1 otherwise)
#
# GPUSLICE_PROMETHEUS_CACHE overrides the cache root (default ~/.cache/gpuslice/prometheus).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../cache.sh"
PROMETHEUS_VERSION=v0.316.0 # Prometheus 3.16
key="prometheus-${PROMETHEUS_VERSION}_$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-12)"
cache_at prometheus "$key"
built() { [[ -x "$dest/prometheus" && -x "$dest/promtool" ]]; }
done_or_find "${1:-}" built
mkdir -p "$dest"
tmp="$(mktemp -d "$dest/build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
for tool in promtool prometheus; do
  echo "[prometheus] building $tool ${PROMETHEUS_VERSION}" >&2
  (cd "$here" && go_release "$tmp/$tool" "github.com/prometheus/prometheus/cmd/$tool")
done
mv "$tmp/promtool" "$tmp/prometheus" "$dest/"
echo "$dest"
