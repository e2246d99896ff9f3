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
# --qos: cgroupsPerQOS true, as on a real node, under a cgroupRoot of this run's own
# (/gpuslice-kubelet.XXXXXX, made here in every hierarchy, removed at the end): a second,
# Guaranteed pod, and checks that each container's cgroup path carries pod<uid>
# (<root>/kubepods/besteffort/pod<uid>/<id>, <root>/kubepods/pod<uid>/<id>), seen from the host in
# /proc/<pid>/cgroup of the pid crictl inspect gives (translated out of the pid namespace), and
# that every cgroup the kubelet made is gone after the teardown.
#
#   tests/containerd/kubelet-smoke.sh [--qos] [--keep]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
keep=0; qos=0
for a in "$@"; do
  case "$a" in
    --keep) keep=1 ;;
    --qos) qos=1 ;;
    *) echo "usage: $0 [--qos] [--keep]" >&2; exit 2 ;;
  esac
done

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
# --qos: the kubelet's cgroupRoot, this run's own. The kubelet refuses a root that is missing from
# any of cpu, cpuacct, cpuset, memory, pids, name=systemd ("invalid configuration: cgroup
# [...] has some missing paths: ..."); it is made in every hierarchy here, cpuset given its
# parent's cpus and mems.
cg_root=""
cg_dirs() { for h in /sys/fs/cgroup/*/; do [[ -d "$h${cg_root#/}" ]] && echo "$h${cg_root#/}"; done; }
teardown() {
  [[ -n "$ns_pid" ]] && { kill -KILL "$ns_pid" 2>/dev/null; wait "$ns_pid" 2>/dev/null; }
  ns_pid=""
  sleep 1  # the kernel ends the namespace's processes after unshare has gone
  # Container cgroups, empty now: with cgroupsPerQOS=false the kubelet gives no cgroup parent and
  # containerd uses /k8s.io/<id> in each hierarchy.
  for id in $(cat "$D/containers" 2>/dev/null); do
    for c in /sys/fs/cgroup/*/k8s.io/"$id"; do [[ -d "$c" ]] && rmdir "$c" 2>/dev/null; done
  done
  rmdir /sys/fs/cgroup/*/k8s.io 2>/dev/null  # only where empty
  # With --qos: <root>/kubepods/{besteffort,burstable,}/pod<uid>/<id>, deepest first; a cgroup
  # whose last task is still exiting is EBUSY for a moment.
  if [[ -n "$cg_root" ]]; then
    for _ in $(seq 10); do
      for c in $(cg_dirs); do find "$c" -depth -type d -exec rmdir {} + 2>/dev/null; done
      [[ -z "$(cg_dirs)" ]] && break
      sleep 0.5
    done
  fi
}
cleanup() {
  teardown
  if [[ $keep == 1 ]]; then echo "kept $D" >&2; else rm -rf "$D"; fi
}
trap cleanup EXIT
if [[ $qos == 1 ]]; then
  cg_root="/${D##*/}"
  for h in /sys/fs/cgroup/*/; do
    [[ -e "${h}cgroup.procs" ]] || continue
    mkdir "$h${cg_root#/}" || exit 1
    if [[ -e "${h}cpuset.cpus" ]]; then
      cat "${h}cpuset.cpus" >"$h${cg_root#/}/cpuset.cpus"; cat "${h}cpuset.mems" >"$h${cg_root#/}/cpuset.mems"
    fi
  done
fi

"$here/image.sh" "$D/probe.tar" 2>/dev/null
"$here/image.sh" --name gpuslice.test/pause:1 --entrypoint 'sleep inf' "$D/pause.tar" 2>/dev/null
sed -e "s|@DIR@|$D|g; s|@BIN@|$B|g; s|@SNAPSHOTTER@|overlayfs|g; s|@SANDBOX_IMAGE@|gpuslice.test/pause:1|g" \
  "$here/config.toml.in" >"$D/config.toml"
# The `nvidia` handler's base spec: the default one here (the tests add the emulated driver).
"$B/ctr" oci spec >"$D/nvidia-base-spec.json"
printf '{"cniVersion": "1.0.0", "name": "gpuslice-none", "plugins": [{"type": "loopback"}]}\n' \
  >"$D/cni/net.d/10-none.conflist"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
cat >"$D/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
$(if [[ $qos == 1 ]]; then echo "cgroupsPerQOS: true"; echo "cgroupRoot: $cg_root";
  else echo "cgroupsPerQOS: false"; fi)
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
# --qos: requests = limits, so Guaranteed: directly under kubepods, no QoS-class level.
[[ $qos == 1 ]] && cat >"$D/manifests/guaranteed.yaml" <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: guaranteed, namespace: default}
spec:
  hostNetwork: true
  containers:
  - name: guaranteed
    image: gpuslice.test/probe:1
    imagePullPolicy: Never
    command: [sleep, inf]
    resources: {limits: {cpu: 100m, memory: 32Mi}}
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

cid=""; gid=""
for _ in $(seq 120); do
  cid="$(crictl ps -q --name '^probe$' --state running)"
  [[ $qos == 1 ]] && gid="$(crictl ps -q --name '^guaranteed$' --state running)"
  [[ -n "$cid" && ( $qos == 0 || -n "$gid" ) ]] && break
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

if [[ $qos == 1 ]]; then
  # crictl inspect's info.pid is in containerd's pid namespace (the unshare's, where the kubelet is
  # pid 1); the container has a pid namespace of its own below that. The host pid is the one whose
  # NSpid (host, unshare's namespace, the container's) has it second, below the kubelet (unshare's
  # child, its namespace's init: the shims' parent once they daemonize).
  kubelet_pid="$(awk '{print $1}' /proc/"$ns_pid"/task/"$ns_pid"/children 2>/dev/null)"
  host_pid() {
    local p q
    # grep, not one awk: mawk stops at a status file whose process has just gone.
    for p in $(grep -s '^NSpid:' /proc/[0-9]*/status | awk -v want="$1" '$3 == want {print $1}'); do
      p="${p#/proc/}"; p="${p%/status:NSpid:}"; q="$p"
      while [[ -n "$q" && "$q" != 0 && "$q" != 1 ]]; do
        [[ "$q" == "$kubelet_pid" ]] && { echo "$p"; return; }
        q="$(awk '/^PPid:/ {print $2}' /proc/"$q"/status 2>/dev/null)"
      done
    done
  }
  # check_pod NAME CONTAINER-ID QOS-LEVEL ("besteffort/" or ""): the container's cgroupsPath and its
  # process's /proc/<pid>/cgroup on the host show <root>/kubepods/<level>pod<uid>/<id>, uid as the
  # pod's io.kubernetes.pod.uid label.
  check_pod() {
    local name="$1" id="$2" level="$3" json uid nspid hpid want
    json="$(crictl inspect "$id")"
    uid="$(python3 -c 'import json,sys; print(json.load(sys.stdin)["status"]["labels"]["io.kubernetes.pod.uid"])' <<<"$json")"
    nspid="$(python3 -c 'import json,sys; print(json.load(sys.stdin)["info"]["pid"])' <<<"$json")"
    hpid="$(host_pid "$nspid")"
    want="$cg_root/kubepods/${level}pod$uid/$id"
    echo "$name: uid $uid, pid $nspid in the namespace, $hpid on the host, want $want" | tee -a "$D/checks.log"
    check "$name: cgroupsPath $cg_root/kubepods/${level}pod<uid>/<id>" \
      grep -q "\"cgroupsPath\": \"$want\"" <<<"$json"
    cat /proc/"$hpid"/cgroup >"$D/cgroup.$name" 2>&1
    sed "s/^/  /" "$D/cgroup.$name" | tee -a "$D/checks.log"
    # Every v1 hierarchy the kubelet checks, and cgroup2 (unified) as well.
    check "$name: host /proc/<pid>/cgroup shows it in cpu, cpuacct, cpuset, memory, pids, systemd, unified" \
      in_all "$want" "$D/cgroup.$name"
  }
  in_all() {
    local c
    for c in :cpu: :cpuacct: :cpuset: :memory: :pids: :name=systemd: 0::; do
      grep -q "$c$1\$" "$2" || { echo "no $c$1 in $2"; return 1; }
    done
  }
  check_pod probe "$cid" besteffort/
  check_pod guaranteed "$gid" ""
  teardown
  check "teardown removed $cg_root (and the kubepods tree in it) from every hierarchy" \
    eval '[[ -z "$(cg_dirs)" ]]'
fi
echo "$passed passed, $failed failed"
[[ $failed == 0 ]] || { tail -30 "$D/checks.log" >&2; grep -E '^E[0-9]' "$D/kubelet.log" | tail -15 >&2; exit 1; }
