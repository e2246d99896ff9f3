#!/usr/bin/env bash
# The real kubelet (tests/controlplane/build.sh's) on this containerd, standalone (no API server):
# one static pod, hostNetwork, imagePullPolicy Never, the probe image, uid 1000, read-only rootfs,
# RuntimeDefault seccomp. Shows the kubelet settings that work with containerd on this machine.
#
# Everything runs in one private mount namespace and pid namespace (containerd and the kubelet
# must share the mount namespace, see README.md), where /var/lib, /var/log and /run/containerd are
# empty tmpfs and the sysctl files the kubelet sets are plain files, so nothing leaks to the host
# or to kubelets that other tests run at the same time. Needs root; prints "N passed, N failed".
#
#   tests/containerd/kubelet-smoke.sh [--keep]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
keep=0; [[ "${1:-}" == --keep ]] && keep=1

B="$("$here/build.sh")/bin" || exit 1
K="$("$here/../controlplane/build.sh")/bin" || exit 1
D="$(mktemp -d /tmp/gpuslice-kubelet.XXXXXX)"
mkdir -p "$D"/{cdi,cni/net.d,manifests,pod-logs,volume-plugins,root,pki,sysctl}
passed=0; failed=0
check() {
  local name="$1"; shift
  if "$@" >>"$D/checks.log" 2>&1; then echo "ok   $name"; passed=$((passed + 1));
  else echo "FAIL $name"; failed=$((failed + 1)); fi
}
crictl() { "$B/crictl" --runtime-endpoint "unix://$D/containerd.sock" --timeout 30s "$@" 2>/dev/null; }
ns_pid=""
cleanup() {
  [[ -n "$ns_pid" ]] && { kill -KILL "$ns_pid" 2>/dev/null; wait "$ns_pid" 2>/dev/null; }
  # Container cgroups, empty now: with cgroupsPerQOS=false the kubelet gives no cgroup parent and
  # containerd uses /k8s.io/<id> in each hierarchy.
  sleep 1  # the kernel ends the namespace's processes after unshare has gone
  for id in $(cat "$D/containers" 2>/dev/null); do
    for c in /sys/fs/cgroup/*/k8s.io/"$id"; do [[ -d "$c" ]] && rmdir "$c" 2>/dev/null; done
  done
  rmdir /sys/fs/cgroup/*/k8s.io 2>/dev/null  # only where empty
  if [[ $keep == 1 ]]; then echo "kept $D" >&2; else rm -rf "$D"; fi
}
trap cleanup EXIT

"$here/image.sh" "$D/probe.tar" 2>/dev/null
"$here/image.sh" --name gpuslice.test/pause:1 --entrypoint 'sleep inf' "$D/pause.tar" 2>/dev/null
sed -e "s|@DIR@|$D|g; s|@BIN@|$B|g; s|@SNAPSHOTTER@|overlayfs|g; s|@SANDBOX_IMAGE@|gpuslice.test/pause:1|g" \
  "$here/config.toml.in" >"$D/config.toml"
printf '{"cniVersion": "1.0.0", "name": "gpuslice-none", "plugins": [{"type": "loopback"}]}\n' \
  >"$D/cni/net.d/10-none.conflist"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
cat >"$D/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
containerRuntimeEndpoint: unix://$D/containerd.sock
imageServiceEndpoint: unix://$D/containerd.sock
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
staticPodPath: $D/manifests
podLogsDir: $D/pod-logs
volumePluginDir: $D/volume-plugins
address: 127.0.0.1
port: $(free_port)
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $(free_port)
fileCheckFrequency: 2s
syncFrequency: 5s
EOF
cat >"$D/manifests/probe.yaml" <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: probe, namespace: default}
spec:
  hostNetwork: true
  containers:
  - name: probe
    image: gpuslice.test/probe:1
    imagePullPolicy: Never
    command: [sh, -c, 'echo id=$(id -u) pid=$$$$; grep Seccomp: /proc/self/status; touch /x 2>/dev/null || echo rootfs=ro; exec sleep inf']
    securityContext:
      runAsUser: 1000
      readOnlyRootFilesystem: true
      seccompProfile: {type: RuntimeDefault}
EOF
# The sysctls the kubelet checks and sets, as plain files holding the values it wants.
sysctls=(vm/overcommit_memory:1 vm/panic_on_oom:0 kernel/panic:10 kernel/panic_on_oops:1
         kernel/keys/root_maxkeys:1000000 kernel/keys/root_maxbytes:25000000)
binds=""
for s in "${sysctls[@]}"; do
  f="${s%%:*}"; echo "${s#*:}" >"$D/sysctl/${f//\//.}"
  binds+="mount --bind '$D/sysctl/${f//\//.}' /proc/sys/$f; "
done

host_state() { ls -d /var/lib/kubelet 2>&1; cat /proc/sys/vm/overcommit_memory /proc/sys/kernel/panic /proc/sys/kernel/panic_on_oops; }
host_before="$(host_state)"
PATH="$B:$PATH" unshare --mount --propagation private --pid --fork --mount-proc --kill-child sh -c "
  mount -t tmpfs tmpfs /var/lib && mount -t tmpfs tmpfs /var/log && $binds
  mkdir -p /run/containerd && mount -t tmpfs tmpfs /run/containerd
  '$B/containerd' --config '$D/config.toml' >'$D/containerd.log' 2>&1 &
  for i in \$(seq 100); do [ -S '$D/containerd.sock' ] && break; sleep 0.1; done
  '$B/ctr' --address '$D/containerd.sock' -n k8s.io images import '$D/probe.tar' >/dev/null 2>&1
  '$B/ctr' --address '$D/containerd.sock' -n k8s.io images import '$D/pause.tar' >/dev/null 2>&1
  exec '$K/kubelet' --config='$D/kubelet.yaml' --root-dir='$D/root' --cert-dir='$D/pki' \
    --hostname-override=containerd-smoke --v=2
" >"$D/kubelet.log" 2>&1 &
ns_pid=$!

cid=""
for _ in $(seq 120); do
  cid="$(crictl ps -q --name probe --state running)"
  [[ -n "$cid" ]] && break
  sleep 0.5
done
crictl ps -a -q >"$D/containers"; crictl pods -q >>"$D/containers"
check "kubelet started the static pod's container on containerd" test -n "$cid"
cgpath="$(crictl inspect "$cid" | grep -m1 '"cgroupsPath"' | tr -d ' ",' | cut -d: -f2-)"
echo "container cgroupsPath: $cgpath" | tee -a "$D/checks.log"
logs="$(crictl logs "$cid" 2>&1)"
echo "$logs" >>"$D/checks.log"
check "uid 1000, own pid namespace" grep -q 'id=1000 pid=1' <<<"$logs"
check "RuntimeDefault seccomp" grep -q 'Seccomp:.*2' <<<"$logs"
check "read-only rootfs" grep -q 'rootfs=ro' <<<"$logs"
check "pod log under podLogsDir" eval 'ls "$D"/pod-logs/default_probe-containerd-smoke_*/probe/0.log'
check "host /var/lib/kubelet and sysctls as they were" \
  eval '[[ "$(host_state)" == "$host_before" ]]'
grep -E 'oom|OOM' "$D/kubelet.log" | grep -iE 'error|fail' | head -3 >>"$D/checks.log"
echo "$passed passed, $failed failed"
[[ $failed == 0 ]] || { tail -30 "$D/checks.log" >&2; grep -E '^E[0-9]' "$D/kubelet.log" | tail -15 >&2; exit 1; }
