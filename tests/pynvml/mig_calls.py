#!/usr/bin/env python3
"""MIG the way NVIDIA's tools drive it through nvidia-ml-py, against whatever libnvidia-ml.so.1
the library path finds: profile info gives the id, every other call takes the id; lists take a
buffer of the profile's instance count and an output-only count; MIG device handles lead back to
their GPU. GPU 0 must be in MIG mode with no instances; it is left that way.

Prints a JSON list of rows {call, documented, got, ok}; exits 1 when a row is not ok.
"""

import ctypes
import json
import sys

import pynvml as N

rows = []


def row(call, documented, got, ok):
    rows.append({"call": call, "documented": documented, "got": str(got), "ok": bool(ok)})


def error_of(fn, *args):
    try:
        fn(*args)
        return "success"
    except N.NVMLError as e:
        return str(e)


def address(handle):
    return ctypes.cast(handle, ctypes.c_void_p).value


def gpu_instances(device, info):
    count = ctypes.c_uint(0)
    buffer = (N.c_nvmlGpuInstance_t * info.instanceCount)()
    N.nvmlDeviceGetGpuInstances(device, info.id, buffer, ctypes.byref(count))
    return [buffer[i] for i in range(count.value)]


def main():
    N.nvmlInit()
    device = N.nvmlDeviceGetHandleByIndex(0)
    name = N.nvmlDeviceGetName(device)
    row("nvmlDeviceGetMigMode", "current and pending mode", N.nvmlDeviceGetMigMode(device),
        N.nvmlDeviceGetMigMode(device) == [1, 1])

    one = N.nvmlDeviceGetGpuInstanceProfileInfo(device, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    row("nvmlDeviceGetGpuInstanceProfileInfoV(1_SLICE)",
        "the profile's id (19 on A100/H100/H200, 14 on A30), not the index; name 'MIG 1g.*'",
        f"id {one.id}, name {one.name}, {one.sliceCount} slice, {one.instanceCount} instances",
        one.id != N.NVML_GPU_INSTANCE_PROFILE_1_SLICE and one.sliceCount == 1
        and (one.name.decode() if isinstance(one.name, bytes) else one.name).startswith("MIG 1g."))
    v1 = N.nvmlDeviceGetGpuInstanceProfileInfo(device, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 1)
    row("nvmlDeviceGetGpuInstanceProfileInfo(1_SLICE)", "the same id as the versioned call",
        v1.id, v1.id == one.id and v1.memorySizeMB == one.memorySizeMB)
    row("nvmlDeviceGetGpuInstanceProfileInfoV(0xFF)", "Invalid Argument (no such index)",
        error_of(N.nvmlDeviceGetGpuInstanceProfileInfo, device, 0xFF),
        error_of(N.nvmlDeviceGetGpuInstanceProfileInfo, device, 0xFF) == "Invalid Argument")

    count = ctypes.c_uint(0)
    N.nvmlDeviceGetGpuInstancePossiblePlacements(device, one.id, None, ctypes.byref(count))
    row("nvmlDeviceGetGpuInstancePossiblePlacements_v2(id, NULL)", "the number of placements",
        count.value, count.value >= one.instanceCount)
    placements = (N.c_nvmlGpuInstancePlacement_t * count.value)()
    N.nvmlDeviceGetGpuInstancePossiblePlacements(device, one.id, placements, ctypes.byref(count))
    starts = [placements[i].start for i in range(count.value)]
    row("nvmlDeviceGetGpuInstancePossiblePlacements_v2(id, buffer)", "placements of size 1",
        starts, all(placements[i].size == 1 for i in range(count.value)))

    capacity = N.nvmlDeviceGetGpuInstanceRemainingCapacity(device, one.id)
    row("nvmlDeviceGetGpuInstanceRemainingCapacity(id)", "the profile's instance count on an empty GPU",
        capacity, capacity == one.instanceCount)

    last = placements[count.value - 1]
    gi = N.nvmlDeviceCreateGpuInstanceWithPlacement(device, one.id, ctypes.byref(last))
    info = N.nvmlGpuInstanceGetInfo(gi)
    row("nvmlDeviceCreateGpuInstanceWithPlacement(id) + nvmlGpuInstanceGetInfo",
        "profileId is the id asked with, at the placement asked",
        f"profileId {info.profileId} at {info.placement.start}:{info.placement.size}",
        info.profileId == one.id and info.placement.start == last.start)
    row("nvmlDeviceGetGpuInstanceRemainingCapacity(id) after a create", "one less",
        N.nvmlDeviceGetGpuInstanceRemainingCapacity(device, one.id),
        N.nvmlDeviceGetGpuInstanceRemainingCapacity(device, one.id) == capacity - 1)

    # The bug an index-for-id mix-up makes: index 0 of 1g is the id of the whole-GPU profile.
    whole = N.nvmlDeviceGetGpuInstanceProfileInfo(device, 0)
    got = error_of(N.nvmlDeviceCreateGpuInstance, device, 0)
    row("nvmlDeviceCreateGpuInstance(0) beside a 1g", "id 0 is the whole-GPU profile: Insufficient Resources",
        got, got == "Insufficient Resources" and whole.id != 0)

    listed = gpu_instances(device, one)
    row("nvmlDeviceGetGpuInstances(id, buffer[instanceCount], count=0)", "the count is output only",
        len(listed), len(listed) == 1)
    by_id = N.nvmlDeviceGetGpuInstanceById(device, info.id)
    row("nvmlDeviceGetGpuInstanceById", "the same instance", N.nvmlGpuInstanceGetInfo(by_id).id,
        N.nvmlGpuInstanceGetInfo(by_id).id == info.id)

    ci_profile = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, N.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    row("nvmlGpuInstanceGetComputeInstanceProfileInfoV(1_SLICE, SHARED)", "one slice, one instance",
        f"id {ci_profile.id}, {ci_profile.sliceCount} slice, {ci_profile.instanceCount} instance",
        ci_profile.sliceCount == 1 and ci_profile.instanceCount == 1)
    ci = N.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)
    ci_info = N.nvmlComputeInstanceGetInfo(ci)
    row("nvmlGpuInstanceCreateComputeInstance(id) + nvmlComputeInstanceGetInfo_v2",
        "profileId is the compute profile's id", ci_info.profileId, ci_info.profileId == ci_profile.id)
    got = error_of(N.nvmlGpuInstanceCreateComputeInstance, gi, ci_profile.id)
    row("nvmlGpuInstanceCreateComputeInstance again", "Insufficient Resources (the slice is taken)",
        got, got == "Insufficient Resources")
    cis = (N.c_nvmlComputeInstance_t * ci_profile.instanceCount)()
    ci_count = ctypes.c_uint(0)
    N.nvmlGpuInstanceGetComputeInstances(gi, ci_profile.id, cis, ctypes.byref(ci_count))
    row("nvmlGpuInstanceGetComputeInstances(id, buffer, count=0)", "one", ci_count.value,
        ci_count.value == 1)

    mig = N.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)
    row("nvmlDeviceIsMigDeviceHandle", "true for a MIG device, false for the GPU",
        (N.nvmlDeviceIsMigDeviceHandle(mig).value, N.nvmlDeviceIsMigDeviceHandle(device).value),
        N.nvmlDeviceIsMigDeviceHandle(mig).value == 1 and N.nvmlDeviceIsMigDeviceHandle(device).value == 0)
    parent = N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    row("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "the GPU's handle",
        hex(address(parent) or 0), address(parent) == address(device))
    row("nvmlDeviceGetGpuInstanceId(MIG device)", "its GPU instance's id",
        N.nvmlDeviceGetGpuInstanceId(mig), N.nvmlDeviceGetGpuInstanceId(mig) == info.id)
    total = N.nvmlDeviceGetMemoryInfo(mig).total
    row("nvmlDeviceGetMemoryInfo(MIG device)", "the profile's memory",
        total >> 20, total >> 20 == one.memorySizeMB)
    uuid = N.nvmlDeviceGetUUID(mig)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    row("nvmlDeviceGetUUID(MIG device)", "MIG-<uuid>", uuid, uuid.startswith("MIG-"))
    row("nvmlDeviceGetComputeRunningProcesses(MIG device)", "the processes in that instance: none",
        N.nvmlDeviceGetComputeRunningProcesses(mig), N.nvmlDeviceGetComputeRunningProcesses(mig) == [])
    mig_name = N.nvmlDeviceGetName(mig)
    mig_name = mig_name.decode() if isinstance(mig_name, bytes) else mig_name
    row("nvmlDeviceGetName(MIG device)", "the GPU's name, MIG and the profile", mig_name,
        "MIG 1g." in mig_name)

    got = error_of(N.nvmlGpuInstanceDestroy, gi)
    row("nvmlGpuInstanceDestroy with a compute instance", "In use by another client", got,
        got == "In use by another client")
    N.nvmlComputeInstanceDestroy(ci)
    N.nvmlGpuInstanceDestroy(gi)
    row("nvmlGpuInstanceDestroy after its compute instance", "gone from the list",
        len(gpu_instances(device, one)), len(gpu_instances(device, one)) == 0)
    got = error_of(N.nvmlDeviceGetGpuInstanceById, device, info.id)
    row("nvmlDeviceGetGpuInstanceById after destroy", "Not Found", got, got == "Not Found")
    N.nvmlShutdown()
    return name


if __name__ == "__main__":
    try:
        main()
    except N.NVMLError as e:
        row("(unexpected)", "success", repr(e), False)
    json.dump(rows, sys.stdout, indent=1)
    print()
    sys.exit(0 if all(r["ok"] for r in rows) else 1)
