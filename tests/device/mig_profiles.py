#!/usr/bin/env python3
"""Read-only: what NVML says of every GPU's MIG profiles, as JSON on stdout.

Per GPU: index, name, minor number, MIG mode, and for every GPU-instance profile index
(NVML_GPU_INSTANCE_PROFILE_*) the GPU offers: the profile id NVML gives for it, its name, compute
slices, instance count, memory and SMs, and its possible placements; and the GPU instances that
exist. It asks the way NVIDIA's tools do (nvidia-ml-py, the versioned profile-info call, a null
buffer for the placement count) and changes nothing: no MIG mode, no instance, no setting.

    python3 tests/device/mig_profiles.py                  # the GPUs of this machine
    python3 tests/device/mig_profiles.py --compare A B    # rows where two such outputs differ

Run against the emulator by pointing the library path at it (LD_LIBRARY_PATH with the emulator
as libnvidia-ml.so.1, GPUSLICE_EMULATOR_STATE at its state); tests/device/mig.sh compares a real
GPU's answers with the emulator's for the same model.
"""

import json
import sys

import pynvml as N

# nvml.h: NVML_GPU_INSTANCE_PROFILE_COUNT; older bindings may lack the constant.
PROFILE_COUNT = getattr(N, "NVML_GPU_INSTANCE_PROFILE_COUNT", 17)


def text(value):
    return value.decode() if isinstance(value, bytes) else value


def placements(handle, profile_id):
    count = N.c_uint(0)
    N.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, N.byref(count))
    buffer = (N.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
    N.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, buffer, N.byref(count))
    return [[buffer[i].start, buffer[i].size] for i in range(count.value)]


def profiles(handle):
    out = []
    for index in range(PROFILE_COUNT):
        try:
            info = N.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except N.NVMLError as e:
            if e.value in (N.NVML_ERROR_NOT_SUPPORTED, N.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
        row = {
            "index": index,
            "id": info.id,
            "name": text(info.name).removeprefix("MIG "),
            "slices": info.sliceCount,
            "instanceCount": info.instanceCount,
            "memoryMiB": info.memorySizeMB,
            "sms": info.multiprocessorCount,
        }
        # nvml.h: placements are listed whether MIG mode is on or not.
        row["placements"] = placements(handle, info.id)
        out.append(row)
    return out


def instances(handle, offered):
    out = []
    for p in offered:
        count = N.c_uint(0)
        buffer = (N.c_nvmlGpuInstance_t * max(p["instanceCount"], 1))()
        N.nvmlDeviceGetGpuInstances(handle, p["id"], buffer, N.byref(count))
        for i in range(count.value):
            info = N.nvmlGpuInstanceGetInfo(buffer[i])
            out.append(
                {
                    "id": info.id,
                    "profileId": info.profileId,
                    "profile": p["name"],
                    "placement": [info.placement.start, info.placement.size],
                }
            )
    return sorted(out, key=lambda i: i["placement"])


def read():
    N.nvmlInit()
    gpus = []
    try:
        driver = text(N.nvmlSystemGetDriverVersion())
        for index in range(N.nvmlDeviceGetCount()):
            handle = N.nvmlDeviceGetHandleByIndex(index)
            gpu = {
                "index": index,
                "name": text(N.nvmlDeviceGetName(handle)),
                "minor": N.nvmlDeviceGetMinorNumber(handle),
            }
            try:
                current, pending = N.nvmlDeviceGetMigMode(handle)
            except N.NVMLError_NotSupported:
                gpu["mig"] = None
                gpus.append(gpu)
                continue
            gpu["mig"] = {"current": current, "pending": pending}
            gpu["profiles"] = profiles(handle)
            if current == 1:
                gpu["instances"] = instances(handle, gpu["profiles"])
            gpus.append(gpu)
    finally:
        N.nvmlShutdown()
    return {"driver": driver, "gpus": gpus}


def compare(a, b):
    """Rows (model, profile, field, first's answer, second's answer) of the profiles two outputs
    give differently, per model present in both."""
    by_model = lambda doc: {g["name"]: g for g in doc["gpus"] if g.get("profiles")}
    first, second = by_model(a), by_model(b)
    rows = []
    for model in sorted(first.keys() & second.keys()):
        left = {p["index"]: p for p in first[model]["profiles"]}
        right = {p["index"]: p for p in second[model]["profiles"]}
        for index in sorted(left.keys() | right.keys()):
            l, r = left.get(index), right.get(index)
            name = (l or r)["name"]
            if l is None or r is None:
                rows.append((model, name, "offered", l is not None, r is not None))
                continue
            for field in ("id", "name", "slices", "instanceCount", "memoryMiB", "sms", "placements"):
                if field in l and field in r and l[field] != r[field]:
                    rows.append((model, name, field, l[field], r[field]))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        with open(sys.argv[2]) as f, open(sys.argv[3]) as g:
            first, second = json.load(f), json.load(g)
        rows = compare(first, second)
        common = {x["name"] for x in first["gpus"]} & {x["name"] for x in second["gpus"]}
        print(f"models in both: {', '.join(sorted(common)) or 'none'}")
        for row in rows:
            print("DIFF  %s  %s  %s: %s vs %s" % row)
        print(f"{len(rows)} difference(s)")
        sys.exit(1 if rows or not common else 0)
    json.dump(read(), sys.stdout, indent=1)
    print()
