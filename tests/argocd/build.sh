#!/usr/bin/env bash
# Builds Argo CD (one binary: it is the application controller, the repo server or the `argocd`
# CLI by the name it is called by) from the Go module proxy, once per machine, into a cache folder
# keyed by the version and go.sum; prints the folder, which holds `argocd` and the two server
# names as links to it, and Argo CD's CRDs.
#
#   tests/argocd/build.sh          # builds if needed (~5 min cold on 2 cores)
#   tests/argocd/build.sh --find   # prints it only if already built (exit 1 otherwise)
#
# v3.1.16 is the newest that builds this way: v3.2's module does not compile, and v3.3+ replace
# gitops-engine with a local path. GPUSLICE_ARGOCD_CACHE overrides the cache root (default
# ~/.cache/gpuslice/argocd).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../cache.sh"
ARGOCD_VERSION=v3.1.16
key="argocd-${ARGOCD_VERSION}_$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-12)"
cache_at argocd "$key"
built() { [[ -x "$dest/argocd" && -f "$dest/crds/application-crd.yaml" ]]; }
done_or_find "${1:-}" built
mkdir -p "$dest"
tmp="$(mktemp -d "$dest/build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "[argocd] building argocd ${ARGOCD_VERSION}" >&2
(cd "$here" && go_release "$tmp/argocd" "github.com/argoproj/argo-cd/v3/cmd")
module_dir="$(cd "$here" && go list -m -f '{{.Dir}}' github.com/argoproj/argo-cd/v3)"
mkdir -p "$tmp/crds"
cp "$module_dir"/manifests/crds/app{lication,project}-crd.yaml "$tmp/crds/"
chmod -R u+w "$tmp/crds"
for name in argocd-application-controller argocd-repo-server; do
  ln -sf argocd "$tmp/$name"
done
rm -rf "$dest/crds"
mv "$tmp/crds" "$tmp/argocd" "$tmp/argocd-application-controller" "$tmp/argocd-repo-server" "$dest/"
echo "$dest"
