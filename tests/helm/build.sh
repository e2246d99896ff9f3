#!/usr/bin/env bash
# Builds the Helm CLI the chart's checks use, from the Go module proxy, once per machine, into a
# cache folder keyed by the version and go.sum; prints the path of the binary.
#
#   tests/helm/build.sh          # builds if needed
#   tests/helm/build.sh --find   # prints it only if already built (exit 1 otherwise)
#
# GPUSLICE_HELM_CACHE overrides the cache root (default ~/.cache/gpuslice/helm).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../cache.sh"
HELM_VERSION=v3.21.4
key="helm-${HELM_VERSION}_$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-12)"
cache_at helm "$key" helm
done_or_find "${1:-}" test -x "$dest"
mkdir -p "$root/$key"
tmp="$(mktemp "$root/$key/helm.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
echo "[helm] building helm ${HELM_VERSION}" >&2
(cd "$here" && go_release "$tmp" helm.sh/helm/v3/cmd/helm \
  -X "helm.sh/helm/v3/internal/version.version=${HELM_VERSION}")
mv "$tmp" "$dest"
trap - EXIT
echo "$dest"
