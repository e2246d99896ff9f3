#!/usr/bin/env bash
# Builds gonvml — a MIG client on NVIDIA's Go bindings (github.com/NVIDIA/go-nvml) that drives MIG
# the way mig-parted does — from the Go module proxy, once per machine, into a cache folder keyed
# by the go-nvml version and the hash of go.mod, go.sum and main.go; prints the path of the binary.
#
#   tests/gonvml/build.sh          # builds if needed
#   tests/gonvml/build.sh --find   # prints it only if already built (exit 1 otherwise)
#
# GPUSLICE_GONVML_CACHE overrides the cache root (default ~/.cache/gpuslice/gonvml).
# go-nvml needs cgo (it dlopens libnvidia-ml at run time, nothing links against it at build time).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../cache.sh"
GO_NVML_VERSION=v0.13.4-1
key="gonvml-go-nvml-${GO_NVML_VERSION}_$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" | sha256sum | cut -c1-12)"
cache_at gonvml "$key" gonvml
done_or_find "${1:-}" test -x "$dest"
grep -q "github.com/NVIDIA/go-nvml ${GO_NVML_VERSION}\$" "$here/go.mod" || {
  echo "[gonvml] go.mod does not require github.com/NVIDIA/go-nvml ${GO_NVML_VERSION}" >&2
  exit 1
}
mkdir -p "$root/$key"
tmp="$(mktemp "$root/$key/gonvml.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
echo "[gonvml] building gonvml on go-nvml ${GO_NVML_VERSION}" >&2
# go-nvml's generated C calls NVML functions nvml.h marks deprecated; those warnings are noise here.
(cd "$here" && CGO_ENABLED=1 CGO_CFLAGS="${CGO_CFLAGS:--O2 -g} -Wno-deprecated-declarations" \
  GOFLAGS=-mod=readonly go build -trimpath -o "$tmp" .)
mv "$tmp" "$dest"
trap - EXIT
echo "$dest"
