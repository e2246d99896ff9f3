#!/usr/bin/env bash
# Smoke test of the real container runtime on this machine, without a kubelet: builds (or finds)
# containerd/runc/crictl, builds the probe and pause images, starts containerd with
# config.toml.in in a private mount namespace (as the kubelet tests run the kubelet), and checks,
# with ctr and then through the CRI with crictl: root and non-root users, read-only bind mounts,
# own pid namespace, a hostNetwork pod sandbox with no CNI, a container with a CDI device (by the
# CRI's CDI_devices field and by a cdi.k8s.io/ annotation: env and a mount), read-only rootfs,
# RuntimeDefault seccomp, a tmpfs mounted in containerd's mount namespace (as the kubelet mounts
# projected volumes) bound into a container, exec and logs. Everything lives in a temp folder that
# is removed at the end. Needs root. Prints one line per check and "N passed, N failed".
#
#   tests/containerd/smoke.sh [--snapshotter overlayfs|native] [--keep]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
snapshotter=overlayfs
keep=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --snapshotter) snapshotter="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

built="$("$here/build.sh")" || exit 1
B="$built/bin"
D="$(mktemp -d /tmp/gpuslice-containerd.XXXXXX)"
cg="gpuslice-smoke-$$"
mkdir -p "$D"/{cdi,logs,slice0,hostro,vol,cni/net.d}
# A network config, no plugin binaries: containerd then reports NetworkReady (the kubelet keeps a
# node NotReady otherwise); hostNetwork pods never call CNI.
printf '{"cniVersion": "1.0.0", "name": "gpuslice-none", "plugins": [{"type": "loopback"}]}\n' \
  >"$D/cni/net.d/10-none.conflist"
passed=0; failed=0
check() { # name, then a command whose success is the check
  local name="$1"; shift
  if "$@" >>"$D/checks.log" 2>&1; then echo "ok   $name"; passed=$((passed + 1));
  else echo "FAIL $name"; failed=$((failed + 1)); fi
}
has() { grep -q -- "$2" <<<"$1" || { echo "missing '$2' in: $1"; return 1; }; }
ctr() { "$B/ctr" --address "$D/containerd.sock" -n k8s.io "$@" 2> >(grep -v DEPRECATION >&2); }
crictl() { "$B/crictl" --runtime-endpoint "unix://$D/containerd.sock" --image-endpoint "unix://$D/containerd.sock" --timeout 30s "$@"; }

ctd_pid=""
cleanup() {
  if [[ -n "$ctd_pid" ]]; then
    # unshare --fork ignores SIGTERM; SIGKILL ends it, and --kill-child ends the rest.
    kill -KILL "$ctd_pid" 2>/dev/null; wait "$ctd_pid" 2>/dev/null
  fi
  for c in /sys/fs/cgroup/*/"$cg"; do
    [[ -d "$c" ]] && find "$c" -depth -type d -exec rmdir {} + 2>/dev/null
  done
  if [[ $keep == 1 ]]; then echo "kept $D" >&2; else rm -rf "$D"; fi
}
trap cleanup EXIT

# /usr/bin/stat (coreutils) is dynamically linked: image.sh brings its libraries along.
"$here/image.sh" "$D/probe.tar" /usr/bin/stat:/opt/bin/stat 2>/dev/null
"$here/image.sh" --name gpuslice.test/pause:1 --entrypoint 'sleep inf' "$D/pause.tar" 2>/dev/null
sed -e "s|@DIR@|$D|g; s|@BIN@|$B|g; s|@SNAPSHOTTER@|$snapshotter|g; s|@SANDBOX_IMAGE@|gpuslice.test/pause:1|g" \
  "$here/config.toml.in" >"$D/config.toml"
# The `nvidia` handler's base spec: the default one here (the tests add the emulated driver).
"$B/ctr" oci spec >"$D/nvidia-base-spec.json"

# containerd in a mount namespace of its own, as the kubelet tests run the kubelet: the kubelet
# must share it (or mounts it makes, like projected volumes, are not seen by runc). And in a pid
# namespace with its own /proc, containerd its init: when unshare ends, containerd gets SIGKILL
# and the kernel kills every shim and container with it (shims otherwise outlive containerd).
# A tmpfs on /run/containerd there: shims put their sockets in /run/containerd/s whatever the
# config says, and those left by a SIGKILL go with the namespace.
PATH="$B:$PATH" unshare --mount --propagation private --pid --fork --mount-proc --kill-child \
  sh -c 'mkdir -p /run/containerd && mount -t tmpfs tmpfs /run/containerd && exec "$0" --config "$1"' \
  "$B/containerd" "$D/config.toml" >"$D/containerd.log" 2>&1 &
ctd_pid=$!
for _ in $(seq 100); do [[ -S "$D/containerd.sock" ]] && break; sleep 0.1; done
check "containerd serves on $D/containerd.sock" test -S "$D/containerd.sock"
status="$(crictl info 2>/dev/null | tr -d ' \n')"
check "CRI status RuntimeReady and NetworkReady" \
  eval 'has "$status" "\"status\":true,\"type\":\"RuntimeReady\"" && has "$status" "\"status\":true,\"type\":\"NetworkReady\""'
check "import the probe image" ctr images import "$D/probe.tar"
check "import the pause image" ctr images import "$D/pause.tar"

out="$(ctr run --rm --fifo-dir "$D/fifo" --snapshotter "$snapshotter" gpuslice.test/probe:1 smoke-root sh -c 'id -u; echo pid=$$' 2>&1)"
check "ctr run as root, own pid namespace" eval 'has "$out" "^0$" && has "$out" "pid=1"'
out="$(ctr run --rm --fifo-dir "$D/fifo" --snapshotter "$snapshotter" gpuslice.test/probe:1 smoke-dyn /opt/bin/stat -c 'owner=%U' /etc/passwd 2>&1)"
check "a dynamically linked host binary runs in the image" has "$out" "owner=root"
echo hello >"$D/hostro/f"
out="$(ctr run --rm --fifo-dir "$D/fifo" --snapshotter "$snapshotter" --user 1000:1000 \
  --mount "type=bind,src=$D/hostro,dst=/data,options=rbind:ro" gpuslice.test/probe:1 smoke-user \
  sh -c 'id -u; cat /data/f; touch /data/g 2>&1; true' 2>&1)"
check "ctr run as uid 1000 with a read-only bind mount" \
  eval 'has "$out" "^1000$" && has "$out" "hello" && has "$out" "Read-only file system"'

cat >"$D/pod.json" <<EOF
{
  "metadata": {"name": "smoke", "namespace": "default", "uid": "smoke-$$", "attempt": 0},
  "log_directory": "$D/logs",
  "linux": {
    "cgroup_parent": "/$cg/pod-smoke",
    "security_context": {"namespace_options": {"network": 2, "pid": 1, "ipc": 0}}
  }
}
EOF
pod="$(crictl runp "$D/pod.json" 2>>"$D/checks.log")"
check "CRI RunPodSandbox, hostNetwork, no CNI" test -n "$pod"

cat >"$D/cdi/gpuslice.json" <<EOF
{
  "cdiVersion": "0.6.0",
  "kind": "gpuslice.io/slice",
  "devices": [
    {"name": "s0", "containerEdits": {
      "env": ["GPUSLICE_SLICE=s0"],
      "mounts": [{"hostPath": "$D/slice0", "containerPath": "/var/run/gpuslice", "options": ["ro", "nosuid", "nodev", "bind"]}]}},
    {"name": "s1", "containerEdits": {"env": ["GPUSLICE_OTHER=s1"]}}
  ],
  "containerEdits": {"env": ["GPUSLICE_COMMON=1"]}
}
EOF
echo slice-zero >"$D/slice0/info"
# A tmpfs mounted inside containerd's mount namespace, as the kubelet mounts projected volumes.
nsenter -t "$ctd_pid" -m sh -c "mount -t tmpfs tmpfs '$D/vol' && echo token-in-tmpfs > '$D/vol/token'"
script='echo id=$(id -u):$(id -g); echo slice=$GPUSLICE_SLICE other=$GPUSLICE_OTHER common=$GPUSLICE_COMMON; echo info=$(cat /var/run/gpuslice/info); if touch /var/run/gpuslice/x 2>/dev/null; then echo cdimount=rw; else echo cdimount=ro; fi; if touch /probe 2>/dev/null; then echo rootfs=rw; else echo rootfs=ro; fi; echo pid=$$; grep Seccomp: /proc/self/status; echo vol=$(cat /vol/token); exec sleep inf'
cat >"$D/ctr.json" <<EOF
{
  "metadata": {"name": "probe", "attempt": 0},
  "image": {"image": "gpuslice.test/probe:1"},
  "command": ["sh", "-c", "$script"],
  "log_path": "probe.log",
  "annotations": {"cdi.k8s.io/gpuslice": "gpuslice.io/slice=s1"},
  "CDI_devices": [{"name": "gpuslice.io/slice=s0"}],
  "mounts": [{"container_path": "/vol", "host_path": "$D/vol", "readonly": true}],
  "linux": {"security_context": {
    "run_as_user": {"value": 1000}, "run_as_group": {"value": 1000}, "readonly_rootfs": true,
    "namespace_options": {"pid": 1},
    "seccomp": {"profile_type": 0}}}
}
EOF
if "$B/runc" features | tr -d ' \n' | grep -q '"seccomp":{"enabled":true'; then
  seccomp=0 seccomp_mode=2   # RuntimeDefault: a filter
else
  # runc built without libseccomp-dev: RuntimeDefault would fail, ask for Unconfined.
  seccomp=1 seccomp_mode=0
  sed -i 's/"profile_type": 0/"profile_type": 1/' "$D/ctr.json"
fi
cid="$(crictl create "$pod" "$D/ctr.json" "$D/pod.json" 2>>"$D/checks.log")"
check "CRI CreateContainer with CDI devices" test -n "$cid"
check "CRI StartContainer" crictl start "$cid"
for _ in $(seq 50); do grep -q vol= "$D/logs/probe.log" 2>/dev/null && break; sleep 0.1; done
logs="$(crictl logs "$cid" 2>&1)"
check "container runs as 1000:1000" has "$logs" "id=1000:1000"
check "CDI env from CDI_devices, annotation and spec" has "$logs" "slice=s0 other=s1 common=1"
check "CDI mount, read-only" eval 'has "$logs" "info=slice-zero" && has "$logs" "cdimount=ro"'
check "read-only rootfs" has "$logs" "rootfs=ro"
check "own pid namespace (pid 1)" has "$logs" "pid=1"
check "seccomp profile $seccomp applied (0 RuntimeDefault, 1 Unconfined)" has "$logs" "Seccomp:.*$seccomp_mode"
check "tmpfs of containerd's mount namespace seen" has "$logs" "vol=token-in-tmpfs"
check "log file in CRI format" grep -q ' stdout F id=1000:1000' "$D/logs/probe.log"
out="$(crictl exec "$cid" sh -c 'id -u; echo $GPUSLICE_SLICE; ps -o pid,comm' 2>&1)"
check "CRI exec sees the env and only the container's processes" \
  eval 'has "$out" "^1000$" && has "$out" "^s0$" && has "$out" "1 sleep" && [[ $(grep -cE "^ *[0-9]+ " <<<"$out") -le 4 ]]'
check "CRI StopContainer" crictl stop -t 2 "$cid"
check "CRI RemoveContainer" crictl rm "$cid"
check "CRI StopPodSandbox" crictl stopp "$pod"
check "CRI RemovePodSandbox" crictl rmp "$pod"
# Pods left running when containerd's pid namespace ends die with it.
left="$(crictl runp "$D/pod.json" 2>>"$D/checks.log")"
sed -e 's/"name": "probe"/"name": "left"/' -e "s|\"command\": .*|\"command\": [\"sleep\", \"3$$\"],|" \
  "$D/ctr.json" >"$D/left.json"
lcid="$(crictl create "$left" "$D/left.json" "$D/pod.json" 2>>"$D/checks.log")"
check "a second pod runs" eval 'crictl start "$lcid" && sleep 0.5 && pgrep -x -f "sleep 3$$"'
kill -KILL "$ctd_pid"; wait "$ctd_pid" 2>/dev/null; ctd_pid=""
sleep 0.5
check "killing unshare ends containerd, shims and containers" \
  eval '! pgrep -x -f "sleep 3$$" && ! pgrep -f -- "-address $D/containerd.sock"'
echo "containerd: $("$B/containerd" --version | cut -d' ' -f3), runc: $("$B/runc" --version | head -1 | cut -d' ' -f3), snapshotter: $snapshotter"
echo "$passed passed, $failed failed"
[[ $failed == 0 ]] || { echo "--- checks.log" >&2; tail -40 "$D/checks.log" >&2; echo "--- containerd.log" >&2; grep -E 'level=(error|fatal)' "$D/containerd.log" | tail -10 >&2; exit 1; }
