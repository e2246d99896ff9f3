#!/usr/bin/env bash
# Builds the real Kubernetes control plane used by the operator tests, from the Go module proxy,
# once per machine: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the kubelet,
# kubectl (the same version, so no skew against the API server), kwok and kwok's stage
# definitions. The result is cached outside the repository in a folder keyed
# by the versions and go.sum files; a second run finds it and prints its path in a second. (The
# kubelet's container runtime, containerd with runc, is tests/containerd's.)
#
#   tests/controlplane/build.sh          # builds if needed; prints the folder holding bin/ and stages/
#   tests/controlplane/build.sh --find   # prints it only if already built (exit 1 otherwise)
#
# GPUSLICE_CONTROLPLANE_CACHE overrides the cache root (default ~/.cache/gpuslice/controlplane).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../cache.sh"

K8S_VERSION=v1.36.3
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.8.0

key_input="$(cat "$here"/*/go.mod "$here"/*/go.sum "$here"/*/*.go)"
key="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_$(printf '%s' "$key_input" | sha256sum | cut -c1-12)"
cache_at controlplane "$key"

binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kwok)
complete() {
  for b in "${binaries[@]}"; do [[ -x "$dest/bin/$b" ]] || return 1; done
  [[ -f "$dest/stages/stages.yaml" ]]
}
done_or_find "${1:-}" complete

work="$(mktemp -d "$root.build.XXXXXX" 2>/dev/null || { mkdir -p "$root"; mktemp -d "$root.build.XXXXXX"; })"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin" "$work/stages"
export CGO_ENABLED=0 GOFLAGS=-mod=readonly

log() { printf '[controlplane] %s\n' "$*" >&2; }

minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-s -w \
  -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} \
  -X k8s.io/component-base/version.gitMajor=1 \
  -X k8s.io/component-base/version.gitMinor=${minor} \
  -X k8s.io/component-base/version.gitTreeState=clean \
  -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"

start=$(date +%s)
log "building etcd ${ETCD_VERSION}"
(cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$work/bin/etcd" .)
log "building kwok ${KWOK_VERSION}"
(cd "$here/kwok" && go build -trimpath -ldflags "-s -w" -o "$work/bin/kwok" sigs.k8s.io/kwok/cmd/kwok)
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl; do
  log "building $cmd ${K8S_VERSION}"
  (cd "$here/kubernetes" && go build -trimpath -ldflags "$ldflags" -o "$work/bin/$cmd" "k8s.io/kubernetes/cmd/$cmd")
done

stages="$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  cat "$stages/$f"
  printf '\n---\n'
done > "$work/stages/stages.yaml"

mkdir -p "$root"
rm -rf "$dest"
mv "$work" "$dest"
trap - EXIT
log "built in $(( $(date +%s) - start )) s into $dest"
echo "$dest"
