#!/usr/bin/env bash
# Builds a container image as an OCI image-layout tarball, locally, with no registry: one
# uncompressed layer holding Debian's static busybox as /bin/busybox with every applet linked
# (sh, sleep, cat, env, id, ls, ps, mount, ...), /etc/passwd and /etc/group (root, nobody, a
# user 1000), /tmp, and any extra files given as SRC:DEST pairs (a SRC folder is copied whole);
# a dynamically linked SRC file brings its shared libraries and loader along (ldd's paths).
# The tarball is deterministic: the same inputs give the same bytes, so the same image digest.
#
#   tests/containerd/image.sh [--name REF] [--entrypoint 'CMD ARGS'] OUT.tar [SRC:DEST ...]
#
#   --name REF          image name (default gpuslice.test/probe:1); `ctr -n k8s.io images import
#                       OUT.tar` registers it under this name (annotation io.containerd.image.name)
#   --entrypoint 'C A'  the image's Entrypoint, split on blanks (default: none; Cmd is ["sh"]);
#                       e.g. --name gpuslice.test/pause:1 --entrypoint 'sleep inf' for a sandbox
#                       (pause) image
#
# The busybox-static package comes from the Debian archive (`apt-get download`), cached in
# GPUSLICE_CONTAINERD_CACHE (default ~/.cache/gpuslice/containerd)/debs.
set -euo pipefail

name=gpuslice.test/probe:1
entrypoint=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --entrypoint) entrypoint="$2"; shift 2 ;;
    --) shift; break ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { sed -n '2,17p' "$0" >&2; exit 2; }
out="$1"; shift

root="${GPUSLICE_CONTAINERD_CACHE:-$HOME/.cache/gpuslice/containerd}"
debs="$root/debs"
mkdir -p "$debs"
deb="$(ls "$debs"/busybox-static_*.deb 2>/dev/null | sort | tail -n1 || true)"
if [[ -z "$deb" ]]; then
  dl="$(mktemp -d "$debs/.dl.XXXXXX")"
  ( cd "$dl" && { apt-get download busybox-static >/dev/null 2>&1 ||
                  { apt-get update -qq >/dev/null && apt-get download busybox-static >/dev/null; }; } )
  mv "$dl"/busybox-static_*.deb "$debs/"
  rmdir "$dl"
  deb="$(ls "$debs"/busybox-static_*.deb | sort | tail -n1)"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
mkdir -p "$work/deb" "$rootfs"/{bin,sbin,usr/bin,usr/sbin,etc,tmp,proc,sys,dev,root,home/user}
dpkg-deb -x "$deb" "$work/deb"
install -m 0755 "$work/deb/bin/busybox" "$rootfs/bin/busybox"
# Every applet, at the path busybox gives it, as a relative symlink to /bin/busybox.
"$rootfs/bin/busybox" --list-full | while read -r applet; do
  [[ "$applet" == bin/busybox || -e "$rootfs/$applet" || -L "$rootfs/$applet" ]] && continue
  dir="$(dirname "$applet")"
  mkdir -p "$rootfs/$dir"
  rel="$(printf '%s' "$dir" | sed -e 's#[^/]*#..#g')/bin/busybox"
  ln -s "$rel" "$rootfs/$applet"
done
chmod 1777 "$rootfs/tmp"
chmod 0700 "$rootfs/root"
cat > "$rootfs/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
user:x:1000:1000:user:/home/user:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat > "$rootfs/etc/group" <<'EOF'
root:x:0:
user:x:1000:
nogroup:x:65534:
EOF

libs_of() { # an ELF file -> the absolute paths of its shared libraries and loader, if dynamic
  [[ "$(head -c 4 "$1" | od -An -c | tr -d ' ')" == '177ELF' ]] || return 0
  ldd "$1" 2>/dev/null | sed -n -e 's#.*=> \(/[^ ]*\) (0x.*#\1#p' -e 's#^[[:space:]]*\(/[^ ]*\) (0x.*#\1#p'
}
: >"$work/libs"
for pair in "$@"; do
  src="${pair%%:*}"; dst="${pair#*:}"
  [[ "$pair" == *:* && -n "$src" && "$dst" == /* ]] || { echo "bad SRC:DEST pair: $pair" >&2; exit 2; }
  mkdir -p "$rootfs$(dirname "$dst")"
  if [[ -d "$src" ]]; then
    mkdir -p "$rootfs$dst"
    cp -a "$src/." "$rootfs$dst/"
  else
    cp -L --preserve=mode "$src" "$rootfs$dst"
    libs_of "$src" >>"$work/libs"
  fi
done
# The shared libraries (and the dynamic loader) of each dynamically linked file, as ldd resolves
# them on this machine, at the same paths: busybox is static, the image has no libc of its own.
sort -u "$work/libs" | while read -r lib; do
  [[ -e "$rootfs$lib" ]] && continue
  mkdir -p "$rootfs$(dirname "$lib")"
  cp -L --preserve=mode "$lib" "$rootfs$lib"
done

# The layer: sorted, owned by root, mtime 0, no atime/ctime, so deterministic.
layer="$work/layer.tar"
tar -C "$rootfs" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
  --format=pax --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -cf "$layer" .

blobs="$work/oci/blobs/sha256"
mkdir -p "$blobs"
put() { # file -> prints "sha256:<hex> <size>", moving the file into blobs/
  local h s
  h="$(sha256sum "$1" | cut -d' ' -f1)"; s="$(stat -c %s "$1")"
  mv "$1" "$blobs/$h"
  echo "sha256:$h $s"
}
read -r layer_digest layer_size < <(put "$layer")

json_words() { # words -> JSON array of strings
  local first=1 w
  printf '['
  for w in "$@"; do
    [[ $first == 1 ]] || printf ','
    first=0
    printf '"%s"' "$(printf '%s' "$w" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g')"
  done
  printf ']'
}
ep=""
if [[ -n "$entrypoint" ]]; then
  # shellcheck disable=SC2086
  ep="\"Entrypoint\":$(json_words $entrypoint),\"Cmd\":null,"
else
  ep='"Cmd":["sh"],'
fi
printf '{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z","config":{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],%s"WorkingDir":"/"},"rootfs":{"type":"layers","diff_ids":["%s"]},"history":[{"created":"1970-01-01T00:00:00Z","created_by":"tests/containerd/image.sh"}]}' \
  "$ep" "$layer_digest" > "$work/config.json"
read -r config_digest config_size < <(put "$work/config.json")

printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"%s","size":%s}]}' \
  "$config_digest" "$config_size" "$layer_digest" "$layer_size" > "$work/manifest.json"
read -r manifest_digest manifest_size < <(put "$work/manifest.json")

tag="${name##*:}"; [[ "$name" == *:* && "$tag" != */* ]] || tag=latest
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
  "$manifest_digest" "$manifest_size" "$name" "$tag" > "$work/oci/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' > "$work/oci/oci-layout"

mkdir -p "$(dirname "$out")"
tar -C "$work/oci" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 --format=pax \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime -cf "$out.tmp" .
mv "$out.tmp" "$out"
echo "$name $manifest_digest" >&2
