#!/usr/bin/env bash
# CUDA MPS on a real NVIDIA GPU: not run in CI (no GPU there). On a machine with a GPU, its
# driver and the driver's MPS tools (nvidia-cuda-mps-control):
#
#     bash tests/device/mps.sh        # results on stdout and in $OUT/mps.txt if set
#
# 1. Fidelity of the emulated control tool: the same commands go to a daemon of the driver's
#    tool and to one of ours (target/*/nvidia-cuda-mps-control), each on pipes of its own in a
#    temporary folder, and both transcripts are printed side by side (`diff`); what differs is
#    what the emulator must learn.
# 2. `gpuslice bench compute --real-gpu --latency-only`: an inference client (a 2 ms request
#    every 20 ms) beside a training neighbour (10 ms kernels back to back) on GPU 0, first
#    time-sliced under the shim's arbiter, then as two MPS clients of half the SMs each (a daemon
#    of the bench's own, started with the driver's tool and told to quit at the end): p50/p99
#    latency and the PASS/FAIL verdict.
#
# 3. While the bench runs, NVML's compute processes (nvidia-smi --query-compute-apps), once a
#    second: whether the MPS server shows as a process of its own and the clients' memory; and
#    nvidia-smi's process table, whose type column says which list each is in (C: compute,
#    M+C: MPS client and compute), as the emulator models it.
#
# Daemons run with private pipe and log folders and are quit at the end; nothing on the GPU is
# reconfigured (no MIG, clock or compute-mode change). About 1 minute. It uses target/release
# binaries when present (cargo build --release --workspace elsewhere, carried along), else
# builds them (needs cargo).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$(mktemp -d)}
bin=target/release
if [ ! -x "$bin/gpuslice" ] || [ ! -e "$bin/libgpuslice.so" ] || [ ! -x "$bin/nvidia-cuda-mps-control" ]; then
  cargo build --release -q --workspace
fi
tmp=$(mktemp -d)
transcript() { # tool name
  local pipe=$tmp/$2/pipe log=$tmp/$2/log
  mkdir -p "$pipe" "$log"
  export CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$log
  "$1" -d; echo "-d: $?"
  # Another user commanding this daemon (a tenant with its own copy of the tool).
  chmod 755 "$tmp" "$tmp/$2" "$pipe"
  if command -v runuser > /dev/null; then
    echo get_server_list | runuser -u nobody -- env CUDA_MPS_PIPE_DIRECTORY="$pipe" "$1" 2>&1
    echo "as nobody: $?"
  fi
  printf '%s\n' get_default_active_thread_percentage "set_default_active_thread_percentage 30" \
    get_default_active_thread_percentage "set_default_device_pinned_mem_limit 0 2G" \
    "get_default_device_pinned_mem_limit 0" get_server_list | "$1"; echo "commands: $?"
  echo quit | "$1"; echo "quit: $?"
  sleep 1
  echo get_server_list | "$1" 2>&1; echo "after quit: $?"
  ls "$pipe"
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
{
  nvidia-smi --query-gpu=name,driver_version,compute_mode,compute_cap --format=csv -i 0
  real=$(command -v nvidia-cuda-mps-control || true)
  if [ -z "$real" ]; then
    echo "nvidia-cuda-mps-control is not on PATH: install the driver's MPS tools"; exit 1
  fi
  transcript "$real" real > "$tmp/real.txt" 2>&1 || true
  transcript "$bin/nvidia-cuda-mps-control" emulated > "$tmp/emulated.txt" 2>&1 || true
  echo "--- control tool transcripts (real | emulated)"
  diff -y -W 140 "$tmp/real.txt" "$tmp/emulated.txt" || true
  status=0
  # What NVML lists while the bench's clients run (is the MPS server a compute process of its
  # own? are the clients' memory figures there, for the watchdog?).
  ( for _ in $(seq 1 20); do
      nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader -i 0
      nvidia-smi -i 0 | sed -n '/Processes:/,$p' | grep -E ' (C|M|M\+C|C\+G) ' || true
      sleep 1
    done > "$tmp/apps.txt" 2>&1 ) &
  sampler=$!
  timeout 300 "$bin/gpuslice" bench compute --real-gpu --latency-only --seconds 4 || status=$?
  echo "exit status $status"
  wait "$sampler" || true
  echo "--- compute processes seen during the bench (distinct)"
  sort -u "$tmp/apps.txt"
} 2>&1 | tee "$out/mps.txt"
rm -rf "$tmp"
