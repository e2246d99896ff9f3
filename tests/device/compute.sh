#!/usr/bin/env bash
# Compute shares on a real NVIDIA GPU: not run in CI (no GPU there). On a machine with a GPU and
# its driver:
#
#     bash tests/device/compute.sh        # one table on stdout and in $OUT/compute.txt if set
#
# The scenarios of `gpuslice bench compute` (10/90, 30/70, 4 x 25, guaranteed 50 + 2 best-effort,
# capped 25 alone, 8 mixed caps, bursty, two processes of one slice, graphs, timeSlice 10 vs 50
# ms), run by real processes under libgpuslice.so on GPU 0 through the real driver: each
# launches single-thread kernels of a busy loop (PTX, compiled by the driver) calibrated to
# 500 µs alone, two steps in flight. Achieved shares come from each process's completed kernels
# (kernels finished in a 1 s window x the calibrated kernel time). Then the launch overhead
# (shim without and with arbitration) and four jobs of fixed work sharing the GPU against the
# same four one after another (aggregate throughput). Nothing on the GPU is reconfigured; the
# processes are ours. About 3 minutes.
#
# It uses target/release/gpuslice and target/release/libgpuslice.so when they are there (built
# elsewhere with `cargo build --release -p gpuslice -p gpuslice-shim` and carried along), else
# builds them (needs cargo).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$(mktemp -d)}
bin=target/release
if [ ! -x "$bin/gpuslice" ] || [ ! -e "$bin/libgpuslice.so" ]; then
  cargo build --release -q -p gpuslice -p gpuslice-shim
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv -i 0
  status=0
  timeout 450 "$bin/gpuslice" bench compute --real-gpu --seconds 4 || status=$?
  echo "exit status $status"
} 2>&1 | tee "$out/compute.txt"
