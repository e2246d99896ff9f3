#!/usr/bin/env bash
# MIG profiles on a real NVIDIA GPU against the emulator's: not run in CI (no GPU there). On a
# machine with a GPU and its driver:
#
#     bash tests/device/mig.sh        # a report on stdout and in $OUT/mig.txt if set
#
# Read-only: it lists what NVML says of every GPU's MIG profiles (ids, names, slices, instance
# counts, memory, SMs, placements, minor numbers, existing instances) through nvidia-ml-py
# (tests/device/mig_profiles.py), then asks the emulator the same for the same models and prints
# every difference. It changes no MIG mode, creates no instance, touches no setting.
#
# It needs nvidia-ml-py (python3 -c "import pynvml"; else a copy of pynvml.py in target/pynvml/,
# carried along for machines without a package index) and target/release/gpuslice with the
# emulator beside it (built elsewhere with `cargo build --release -p gpuslice -p
# gpuslice-nvml-emulator` and carried along), else
# builds them (needs cargo). GPUSLICE_BIN_DIR points elsewhere (target/debug, say).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$(mktemp -d)}
bin=${GPUSLICE_BIN_DIR:-target/release}
python=${GPUSLICE_TEST_PYTHON:-python3}
if ! "$python" -c "import pynvml" 2>/dev/null; then
  export PYTHONPATH="$PWD/target/pynvml${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ ! -x "$bin/gpuslice" ] || [ ! -e "$bin/libnvidia_ml.so" ]; then
  # Naming the emulator's package puts its library beside the binary.
  cargo build --release -q -p gpuslice -p gpuslice-nvml-emulator
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
{
  nvidia-smi --query-gpu=index,name,driver_version,mig.mode.current,memory.total --format=csv || true
  "$python" tests/device/mig_profiles.py > "$out/mig-real.json"
  echo "real GPUs: $(grep -c '"index"' "$out/mig-real.json") entries read"
  # The same models, emulated: one GPU each, MIG on, no instances.
  "$python" - "$out/mig-real.json" > "$work/node.yaml" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
print("name: n\ngpus:")
for i, name in enumerate(sorted({g["name"] for g in doc["gpus"]})):
    print(f"- {{index: {i}, model: {json.dumps(name)}, mig: {{enabled: true, instances: []}}}}")
PY
  mkdir -p "$work/source" "$work/lib"
  cp "$bin/libnvidia_ml.so" "$work/lib/libnvidia-ml.so.1"
  status=0
  if "$bin/gpuslice" agent --once --source "$work/source" --emulate "$work/node.yaml" \
      --state "$work/state" > /dev/null 2> "$work/seed.log"; then
    GPUSLICE_EMULATOR_STATE="$work/state/emulated-n.json" LD_LIBRARY_PATH="$work/lib" \
      "$python" tests/device/mig_profiles.py > "$out/mig-emulated.json"
    "$python" tests/device/mig_profiles.py --compare "$out/mig-real.json" "$out/mig-emulated.json" \
      || status=$?
  else
    echo "the emulator does not know these models:"
    cat "$work/seed.log"
    status=1
  fi
  echo "exit status $status"
} 2>&1 | tee "$out/mig.txt"
