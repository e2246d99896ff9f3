#!/usr/bin/env bash
# Builds a real container runtime for the kubelet tests, from the Go module proxy, once per machine:
# containerd, ctr, the runc shim (containerd-shim-runc-v2), runc and crictl. The result is cached
# outside the repository in a folder keyed by the versions, go.mod/go.sum and this script; a second
# run finds it and prints its path at once.
#
#   tests/containerd/build.sh          # builds if needed; prints the folder holding bin/
#   tests/containerd/build.sh --find   # prints it only if already built (exit 1 otherwise)
#
# runc needs cgo (libcontainer/nsenter is C, compiled into every runc binary); it is linked
# statically (static-pie) against glibc (libc6-dev) and, where the Debian package libseccomp-dev is
# installed, libseccomp.a with the seccomp tag. Without libseccomp-dev runc is built without
# seccomp, and a container asking for a seccomp profile (RuntimeDefault, as the chart's operator
# does) then fails with "seccomp: config provided but seccomp not supported"; the folder's name
# says which (..._seccomp or ..._noseccomp). libpathrs (a Rust library) is left out: runc uses the
# pure-Go filepath-securejoin instead. Everything else is pure Go (CGO_ENABLED=0).
#
# GPUSLICE_CONTAINERD_CACHE overrides the cache root (default ~/.cache/gpuslice/containerd).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

CONTAINERD_VERSION=v2.4.2
RUNC_VERSION=v1.5.3
CRICTL_VERSION=v1.37.0

if [[ -f /usr/lib/x86_64-linux-gnu/libseccomp.a || -n "$(pkg-config --variable=libdir libseccomp 2>/dev/null)" ]]; then
  seccomp=seccomp
else
  seccomp=noseccomp
fi
key_input="$(cat "$here/go.mod" "$here/go.sum" "$here/tools.go" "$0")"
key="containerd-${CONTAINERD_VERSION}_runc-${RUNC_VERSION}_crictl-${CRICTL_VERSION}_$(printf '%s' "$key_input" | sha256sum | cut -c1-12)_${seccomp}"
root="${GPUSLICE_CONTAINERD_CACHE:-$HOME/.cache/gpuslice/containerd}"
dest="$root/$key"

binaries=(containerd containerd-shim-runc-v2 ctr runc crictl)
complete() {
  for b in "${binaries[@]}"; do [[ -x "$dest/bin/$b" ]] || return 1; done
}
if complete; then
  echo "$dest"
  exit 0
fi
if [[ "${1:-}" == "--find" ]]; then
  echo "not built yet (expected in $dest)" >&2
  exit 1
fi

mkdir -p "$root"
work="$(mktemp -d "$root/.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
export GOFLAGS=-mod=readonly
log() { printf '[containerd] %s\n' "$*" >&2; }

start=$(date +%s)
pkg=github.com/containerd/containerd/v2
cd_ldflags="-s -w -X $pkg/version.Version=${CONTAINERD_VERSION} -X $pkg/version.Package=$pkg -X $pkg/version.Revision=module-proxy"
for cmd in containerd ctr; do
  log "building $cmd ${CONTAINERD_VERSION}"
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -tags urfave_cli_no_docs -ldflags "$cd_ldflags" \
    -o "$work/bin/$cmd" "$pkg/cmd/$cmd")
done
log "building containerd-shim-runc-v2 ${CONTAINERD_VERSION}"
(cd "$here" && CGO_ENABLED=0 go build -trimpath -tags "urfave_cli_no_docs no_grpc" -ldflags "$cd_ldflags" \
  -o "$work/bin/containerd-shim-runc-v2" "$pkg/cmd/containerd-shim-runc-v2")

runc_tags="urfave_cli_no_docs netgo osusergo"
[[ $seccomp == seccomp ]] && runc_tags="seccomp $runc_tags"
log "building runc ${RUNC_VERSION} (cgo, static, tags: $runc_tags)"
(cd "$here" && CGO_ENABLED=1 go build -trimpath -buildmode=pie -tags "$runc_tags" \
  -ldflags "-s -w -X main.version=${RUNC_VERSION#v} -X main.gitCommit=module-proxy -linkmode external -extldflags -static-pie" \
  -o "$work/bin/runc" github.com/opencontainers/runc)

log "building crictl ${CRICTL_VERSION}"
(cd "$here" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=${CRICTL_VERSION}" \
  -o "$work/bin/crictl" sigs.k8s.io/cri-tools/cmd/crictl)

rm -rf "$dest"
mv "$work" "$dest"
trap - EXIT
log "built in $(( $(date +%s) - start )) s into $dest"
echo "$dest"
