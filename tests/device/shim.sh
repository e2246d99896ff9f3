#!/usr/bin/env bash
# The shim on a real NVIDIA GPU, with PyTorch: not run in CI (no GPU there). On a machine with a
# GPU, the CUDA driver and PyTorch:
#
#     bash tests/device/shim.sh            # writes its table to stdout and $OUT/shim.txt if set
#
# It builds libgpuslice.so, makes a 20 GiB slice the way the agent would (read-only config and
# the slice's memory ledger), and runs tests/device/shim_check.py under the shim: mem_get_info
# shows the cap, an allocation past it raises OutOfMemoryError, allocations under it work,
# nvidia-smi inside the slice shows the cap, a CUDA graph captures and replays. Nothing on the GPU
# is reconfigured. Finishes well under 5 minutes once the crate is built.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$(mktemp -d)}
cargo build --release -q -p gpuslice-shim
shim=$PWD/target/release/libgpuslice.so

slice=$(mktemp -d)/slices/device-s0
mkdir -p "$slice"
uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0 | tr -d ' ')
cat > "$slice/config" <<JSON
{"id":"device-s0","kind":"software","gpu":0,"deviceUuid":"$uuid","memoryBytes":$((20 << 30)),"computePercent":100}
JSON
chmod 0444 "$slice/config"

run() { LD_PRELOAD=$shim GPUSLICE_SLICE_CONFIG=$slice/config CUDA_VISIBLE_DEVICES=$uuid "$@"; }

{
  echo "== host view (no shim)"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv -i 0
  echo "== nvidia-smi inside the slice"
  run nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv -i 0
  echo "== PyTorch inside the slice"
  run timeout 240 python3 tests/device/shim_check.py
} 2>&1 | tee "$out/shim.txt"
