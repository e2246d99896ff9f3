#!/usr/bin/env python3
"""CUDA driver calls through NVIDIA's cuda-bindings (cuda.bindings.driver), against whatever
libcuda.so.1 the library path finds: cuda-bindings loads the driver and fetches every entry point
through cuGetProcAddress, by name and the CUDA version of the variant it means, and calls it with
that variant's arguments. So a driver (or a shim over it) that hands out the wrong variant gets
arguments it does not expect.

    driver_calls.py [EXPECT_TOTAL_BYTES]

Prints a JSON list of rows {call, documented, got, ok}; exits 1 when a row is not ok. With
EXPECT_TOTAL_BYTES (a slice's cap, when run under the shim), memory answers are checked against it
and an allocation past it must fail with CUDA_ERROR_OUT_OF_MEMORY.
"""

import json
import sys

from cuda.bindings import driver as cu

rows = []
SUCCESS = cu.CUresult.CUDA_SUCCESS


def row(call, documented, got, ok):
    rows.append({"call": call, "documented": documented, "got": str(got), "ok": bool(ok)})


def main(cap):
    (err,) = cu.cuInit(0)
    row("cuInit(0)", "CUDA_SUCCESS", err, err == SUCCESS)
    err, version = cu.cuDriverGetVersion()
    row("cuDriverGetVersion", "the driver's CUDA version, 1000*major + 10*minor", version,
        err == SUCCESS and version >= 12000)
    err, count = cu.cuDeviceGetCount()
    row("cuDeviceGetCount", "at least two devices here", count, err == SUCCESS and count >= 2)
    err, dev0 = cu.cuDeviceGet(0)
    err, dev1 = cu.cuDeviceGet(1)
    err, name = cu.cuDeviceGetName(96, dev0)
    name = name.split(b"\0")[0].decode()
    row("cuDeviceGetName", "the device's name", name, err == SUCCESS and name.startswith("NVIDIA"))
    err, total = cu.cuDeviceTotalMem(dev0)
    row("cuDeviceTotalMem (_v2)", "bytes of the device" + (", the slice's cap" if cap else ""),
        total, err == SUCCESS and total > 0 and (cap is None or total == cap))
    err, major = cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev0)
    row("cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)", "8 or 9 on A100/H100/H200", major,
        err == SUCCESS and major in (8, 9))
    err, uuid = cu.cuDeviceGetUuid(dev0)
    row("cuDeviceGetUuid (_v2 since 11.4)", "16 bytes", len(uuid.bytes), err == SUCCESS and len(uuid.bytes) == 16)

    # The three variants of cuCtxCreate, each fetched by its own version: on device 1, so that a
    # variant answered by another's code takes the wrong device.
    err, ctx = cu.cuCtxCreate(0, dev1)
    err2, on = cu.cuCtxGetDevice()
    row("cuCtxCreate (_v2) on device 1", "a context on device 1", (err, int(on)), err == SUCCESS and int(on) == 1)
    cu.cuCtxDestroy(ctx)
    err, ctx = cu.cuCtxCreate_v3(None, 0, 0, dev1)
    err2, on = cu.cuCtxGetDevice()
    row("cuCtxCreate_v3(NULL, 0, 0, device 1)", "a context on device 1", (err, int(on)),
        err == SUCCESS and int(on) == 1)
    cu.cuCtxDestroy(ctx)
    err, ctx = cu.cuCtxCreate_v4(None, 0, dev1)
    err2, on = cu.cuCtxGetDevice()
    row("cuCtxCreate_v4(NULL, 0, device 1)", "a context on device 1", (err, int(on)),
        err == SUCCESS and int(on) == 1)
    cu.cuCtxDestroy(ctx)

    err, ctx = cu.cuDevicePrimaryCtxRetain(dev0)
    cu.cuCtxSetCurrent(ctx)
    row("cuDevicePrimaryCtxRetain + cuCtxSetCurrent", "CUDA_SUCCESS", err, err == SUCCESS)
    err, free, total = cu.cuMemGetInfo()
    row("cuMemGetInfo (_v2)", "free <= total" + (", total the slice's cap" if cap else ""),
        (free, total), err == SUCCESS and free <= total and (cap is None or total == cap))
    err, ptr = cu.cuMemAlloc(64 << 20)
    row("cuMemAlloc (_v2) 64 MiB", "CUDA_SUCCESS and a device pointer", (err, int(ptr)),
        err == SUCCESS and int(ptr) != 0)
    err, free_after, _ = cu.cuMemGetInfo()
    row("cuMemGetInfo after it", "64 MiB less free", free - free_after,
        free - free_after >= 64 << 20)
    (err,) = cu.cuMemFree(ptr)
    row("cuMemFree (_v2)", "CUDA_SUCCESS", err, err == SUCCESS)
    err, managed = cu.cuMemAllocManaged(1 << 20, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value)
    row("cuMemAllocManaged 1 MiB", "CUDA_SUCCESS", err, err == SUCCESS)
    cu.cuMemFree(managed)
    if cap is not None:
        err, big = cu.cuMemAlloc(cap + (1 << 30))
        row("cuMemAlloc past the slice's cap", "CUDA_ERROR_OUT_OF_MEMORY", err,
            err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)

    err, stream = cu.cuStreamCreate(0)
    (err2,) = cu.cuStreamSynchronize(stream)
    row("cuStreamCreate + cuStreamSynchronize", "CUDA_SUCCESS", (err, err2), err == SUCCESS and err2 == SUCCESS)
    cu.cuStreamDestroy(stream)
    err, start = cu.cuEventCreate(0)
    err, end = cu.cuEventCreate(0)
    cu.cuEventRecord(start, 0)
    cu.cuEventRecord(end, 0)
    cu.cuEventSynchronize(end)
    err, ms = cu.cuEventElapsedTime(start, end)
    row("cuEventRecord/Synchronize/ElapsedTime", "milliseconds >= 0", ms, err == SUCCESS and ms >= 0)

    err, text = cu.cuGetErrorString(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    row("cuGetErrorString(OUT_OF_MEMORY)", "out of memory", text, err == SUCCESS and b"out of memory" in text)
    err, text = cu.cuGetErrorName(cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    row("cuGetErrorName(INVALID_VALUE)", "CUDA_ERROR_INVALID_VALUE", text, text == b"CUDA_ERROR_INVALID_VALUE")
    err, fn, status = cu.cuGetProcAddress(b"cuMemAlloc", 12000, 0)
    row("cuGetProcAddress_v2(cuMemAlloc, 12000)", "a function, CU_GET_PROC_ADDRESS_SUCCESS",
        (err, status), err == SUCCESS and int(fn) != 0
        and status == cu.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS)
    err, fn, status = cu.cuGetProcAddress(b"cuNoSuchCall", 12000, 0)
    row("cuGetProcAddress_v2(unknown)", "CUDA_ERROR_NOT_FOUND, SYMBOL_NOT_FOUND", (err, status),
        err == cu.CUresult.CUDA_ERROR_NOT_FOUND
        and status == cu.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
    cu.cuDevicePrimaryCtxRelease(dev0)


if __name__ == "__main__":
    cap = int(sys.argv[1]) if len(sys.argv) > 1 else None
    try:
        main(cap)
    except Exception as e:  # a call cuda-bindings could not make is a failed row, not a crash
        row("(unexpected)", "no exception", repr(e), False)
    json.dump(rows, sys.stdout, indent=1)
    print()
    sys.exit(0 if all(r["ok"] for r in rows) else 1)
